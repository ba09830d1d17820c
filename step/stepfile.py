"""The step plan file (``plan step compile -o F.step``): ``MAGIC | version u16 |
flags u16 | body length u64 | sha256(body) | body``, the body zlib-compressed
msgpack of plain values and raw int64 arrays — the step problem (document
lengths and origins, carried count, model, mesh, builtin profile name, mask
text, block size, packing), the micro-batch plan's columns, and every
distinct micro-batch's attention plan as a plan file of its own
(:mod:`attnplan.backends.planfile`). Nothing is unpickled and no path named
in a file is ever opened (the mask is parsed as text; a profile is a builtin
name or none).

Loading has the same safety as a plan file: the header and the declared
length are checked against the file's size and ``MAX_STEP_FILE`` before the
body is read; the body's inflated size is counted against
``MAX_STEP_BODY`` before it is inflated; msgpack decodes with length bounds;
every field is checked before anything is built; the problem is rebuilt by
:func:`make_problem` (its own checks), the plan verified
(:func:`verify_plan`), every attention plan loaded by the plan-file reader
(schema and verifier) and matched to its micro-batch, and every device's
peak memory recomputed from them against the stored cap
(:func:`verify_lowered`, as :func:`compile_step` checks). Every failure is one :class:`PlanFileError`
naming the file and the field. The file is a pure function of the compile
inputs: compiling the same step twice gives the same bytes.
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct
import zlib
from dataclasses import dataclass, fields

import msgpack
import numpy as np

from ..backends.cost import PROFILES
from ..backends.planfile import pack as pack_plan
from ..backends.planfile import unpack as unpack_plan
from ..errors import AttnplanError, PlanFileError
from ..frontend import parse_mask
from ..ir import limits as L
from ..ir.module import PlanIR
from .driver import CompiledStep, pipelined, step_peaks
from .ir import StepPlan
from .lower import Lowered, cache_of, make_problem, pipeline_text
from .mesh import Mesh
from .pipeline import build_schedule
from .model import model_from_dict
from .verify import verify_lowered, verify_plan

MAGIC = b"ATTNSTEP"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sHHQ32s")
_CHUNK = 1 << 20
PLAN_COLUMNS = ("frag_doc", "frag_start", "frag_end", "frag_mb", "mb_group", "mb_slot", "group_ptr", "group_ranks",
                "queue_out")


@dataclass(frozen=True, slots=True, eq=False)
class LoadedStep:
    """A step plan read back: the verified plan and every micro-batch's verified attention plan."""

    plan: StepPlan
    attention: tuple[PlanIR, ...]


# ------------------------------------------------------------------ writing

def _arr(a) -> dict:
    a = np.ascontiguousarray(np.asarray(a, dtype="<i8"))
    return {"shape": list(a.shape), "data": a.tobytes()}


def to_body(c: CompiledStep) -> dict:
    plan = c.plan
    p = plan.problem
    keys: dict[int, int] = {}
    files: list[bytes] = []
    index = []
    for low in c.lowered:  # one plan file per distinct attention plan (the cache shares equal micro-batches)
        if id(low) not in keys:
            keys[id(low)] = len(files)
            meta = {"pipeline": pipeline_text(low.strategy, p.block_size), "strategy": low.strategy,
                    "block_size": p.block_size, "profile": p.profile.name}
            files.append(pack_plan(low.ir, meta))
        index.append(keys[id(low)])
    mesh = {f.name: getattr(p.mesh, f.name) for f in fields(Mesh)}
    mesh["memory_cap"] = p.cap  # the cap the plan was verified against, whatever the profile
    return {
        "problem": {"seqlens": _arr(p.seqlens), "origin": _arr(p.origin), "carried": p.carried, "step": p.step,
                    "model": p.model.to_dict(), "mesh": mesh,
                    "profile": p.profile.name if p.profile.name in PROFILES else None,
                    "mask": cache_of(p).mask.source, "block_size": p.block_size,
                    "packing": None if p.packing is None else _arr(p.packing),
                    **({"partials_dtype": p.partials_dtype} if p.partials_dtype != "float32" else {}),  # absent:
                    **({"keep_kv": True} if p.keep_kv else {})},  # the defaults
        "plan": {"system": plan.system, **{k: _arr(getattr(plan, k)) for k in PLAN_COLUMNS},
                 "mb_strategy": list(plan.mb_strategy), "info": [[str(k), v] for k, v in plan.info],
                 "chunk_keep": plan.chunk_keep,
                 **({"mb_unkept": list(plan.mb_unkept)} if plan.mb_unkept else {})},  # absent: every one keeps
        "attention": files,
        "mb_attention": _arr(index),
    }


def pack(c: CompiledStep) -> bytes:
    raw = zlib.compress(msgpack.packb(to_body(c), use_bin_type=True), 1)
    if _HEADER.size + len(raw) > L.MAX_STEP_FILE:
        raise PlanFileError(f"cannot write a step file: {len(raw):,} bytes, over MAX_STEP_FILE = "
                            f"{L.MAX_STEP_FILE:,} (ir/limits.py)")
    return _HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(raw), hashlib.sha256(raw).digest()) + raw


# ------------------------------------------------------------------ reading

def _fail(source: str, msg: str) -> PlanFileError:
    return PlanFileError(f"{source}: {msg}")


def _header(head: bytes, size: int, source: str) -> tuple[int, bytes]:
    if len(head) < _HEADER.size:
        raise _fail(source, "not an attnplan step file" if not head.startswith(MAGIC[:len(head)]) or not head
                    else f"truncated step file ({len(head)} bytes, header needs {_HEADER.size})")
    magic, version, flags, length, digest = _HEADER.unpack_from(head)
    if magic != MAGIC:
        raise _fail(source, "not an attnplan step file (bad magic)")
    if version != FORMAT_VERSION:
        raise _fail(source, f"step file format version {version}; this attnplan reads version {FORMAT_VERSION}")
    if flags:
        raise _fail(source, f"step file header has unknown flags {flags:#06x}")
    if _HEADER.size + length > L.MAX_STEP_FILE:
        raise _fail(source, f"step file of {_HEADER.size + length:,} bytes is over MAX_STEP_FILE = "
                            f"{L.MAX_STEP_FILE:,} (ir/limits.py)")
    if size - _HEADER.size != length:
        raise _fail(source, f"step file {'truncated' if size - _HEADER.size < length else 'has trailing bytes'}: "
                            f"body is {size - _HEADER.size} bytes, header says {length}")
    return length, digest


def _inflate(raw: bytes, source: str) -> bytes:
    d, buf, out, total = zlib.decompressobj(), raw, [], 0
    try:
        while not d.eof:
            chunk = d.decompress(buf, _CHUNK)
            total += len(chunk)
            if total > L.MAX_STEP_BODY:
                raise _fail(source, f"step body inflates to more than MAX_STEP_BODY = {L.MAX_STEP_BODY:,} bytes")
            if not chunk and len(d.unconsumed_tail) == len(buf):
                raise _fail(source, "step body does not decode: the compressed stream is incomplete")
            out.append(chunk)
            buf = d.unconsumed_tail
    except zlib.error as e:
        raise _fail(source, f"step body does not decode: {e}") from None
    if d.unused_data:
        raise _fail(source, "step body does not decode: bytes follow the compressed stream")
    return b"".join(out)


def _decode(raw: bytes, source: str) -> dict:
    packed = _inflate(raw, source)
    try:
        body = msgpack.unpackb(packed, raw=False, strict_map_key=True, max_str_len=4 * L.MAX_MASK_TEXT,
                               max_bin_len=len(packed), max_array_len=L.MAX_MICRO_BATCHES, max_map_len=64,
                               max_ext_len=0)
    except Exception as e:  # msgpack's errors, ValueError (limits, nesting)
        raise _fail(source, f"step body does not decode: {type(e).__name__}: {str(e)[:100]}") from None
    if not isinstance(body, dict):
        raise _fail(source, "malformed step file: the body is not a map")
    return body


def _get(d, key: str, kind, where: str, source: str):
    if not isinstance(d, dict) or key not in d:
        raise _fail(source, f"malformed step file: {where}.{key} is missing")
    v = d[key]
    if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
        raise _fail(source, f"malformed step file: {where}.{key} has the wrong type ({type(v).__name__})")
    return v


def _array(d, key: str, where: str, source: str, ndim: int = 1) -> np.ndarray:
    rec = _get(d, key, dict, where, source)
    shape = rec.get("shape")
    data = rec.get("data")
    if (not isinstance(shape, list) or len(shape) != ndim or not isinstance(data, bytes)
            or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= L.MAX_TOKENS for s in shape)):
        raise _fail(source, f"malformed step file: {where}.{key} is not an array record of rank {ndim}")
    if int(np.prod(shape, dtype=np.int64)) * 8 != len(data):
        raise _fail(source, f"malformed step file: {where}.{key}: {len(data)} bytes for shape {shape}")
    return np.frombuffer(data, dtype="<i8").astype(np.int64).reshape(shape)


def from_body(body: dict, source: str) -> LoadedStep:
    pb = _get(body, "problem", dict, "body", source)
    qb = _get(body, "plan", dict, "body", source)
    try:
        lens = _array(pb, "seqlens", "problem", source)
        origin = _array(pb, "origin", "problem", source, 2)
        carried = _get(pb, "carried", int, "problem", source)
        step = _get(pb, "step", int, "problem", source)
        if not 0 <= carried <= len(lens) or len(origin) != len(lens) or abs(step) > 1 << 62:
            raise _fail(source, "malformed step file: problem.carried, origin or step out of range")
        model = model_from_dict(_get(pb, "model", dict, "problem", source), f"{source}: problem.model")
        md = _get(pb, "mesh", dict, "problem", source)
        if not set(md) <= {f.name for f in fields(Mesh)} or not {"dp", "cp", "pp"} <= set(md):
            raise _fail(source, "malformed step file: problem.mesh has the wrong fields")
        mesh = Mesh(**md)
        prof = pb.get("profile")
        if prof is not None and (not isinstance(prof, str) or prof not in PROFILES):
            raise _fail(source, f"problem.profile {str(prof)[:40]!r} is not a builtin profile")
        mask = parse_mask(_get(pb, "mask", str, "problem", source))
        packing = None if pb.get("packing") is None else _array(pb, "packing", "problem", source)
        keep_kv = pb.get("keep_kv", False)
        if keep_kv is not True and keep_kv is not False:
            raise _fail(source, "malformed step file: problem.keep_kv must be a boolean")
        problem = make_problem(lens[carried:], model=model, mesh=mesh, profile=prof or "h100", mask=mask,
                               block_size=_get(pb, "block_size", int, "problem", source), carried=lens[:carried],
                               carried_origin=origin[:carried], step=step, packing=packing,
                               partials_dtype=_get(pb, "partials_dtype", str, "problem", source)
                               if "partials_dtype" in pb else "float32", keep_kv=keep_kv)
        if not np.array_equal(problem.origin, origin):
            raise _fail(source, "malformed step file: problem.origin does not match the step's documents")
        strategies = _get(qb, "mb_strategy", list, "plan", source)
        info = _get(qb, "info", list, "plan", source)
        keep = qb.get("chunk_keep", 0)
        if isinstance(keep, bool) or not isinstance(keep, int) or not 0 <= keep <= L.MAX_MICRO_BATCHES:
            raise _fail(source, "malformed step file: plan.chunk_keep must be a count of chunks")
        if not all(isinstance(s, str) for s in strategies) or not all(
                isinstance(i, list) and len(i) == 2 and isinstance(i[0], str)
                and isinstance(i[1], (int, float, str)) for i in info):
            raise _fail(source, "malformed step file: plan.mb_strategy or plan.info has the wrong types")
        unkept = qb.get("mb_unkept", [])
        if not isinstance(unkept, list) or len(unkept) > L.MAX_MICRO_BATCHES:
            raise _fail(source, "malformed step file: plan.mb_unkept must be a list of micro-batches")
        plan = StepPlan(problem, _get(qb, "system", str, "plan", source),
                        **{k: _array(qb, k, "plan", source) for k in PLAN_COLUMNS},
                        mb_strategy=tuple(strategies), info=tuple((k, v) for k, v in info), chunk_keep=keep,
                        mb_unkept=tuple(unkept))
        verify_plan(plan)
        files = _get(body, "attention", list, "body", source)
        index = _array(body, "mb_attention", "body", source)
        if len(index) != plan.n_mb or (len(index) and (index.min() < 0 or index.max() >= len(files))):
            raise _fail(source, "malformed step file: mb_attention does not index the attention plans")
        irs = []
        for i, data in enumerate(files):
            if not isinstance(data, bytes):
                raise _fail(source, f"malformed step file: attention[{i}] is not a plan file")
            irs.append(unpack_plan(data, f"{source}: attention plan {i}")[0])
        attention = tuple(irs[int(j)] for j in index)
        _verify_memory(plan, attention)
    except PlanFileError:
        raise
    except AttnplanError as e:
        raise _fail(source, f"step plan does not verify: {str(e).splitlines()[0]}") from None
    return LoadedStep(plan, attention)


def _verify_memory(plan: StepPlan, attention: tuple) -> None:
    """The attention plans match their micro-batches and every device's peak memory, recomputed from
    them, stays under the cap the step was compiled for (what :func:`compile_step` checked)."""
    lowered = [Lowered.of(ir, s) for ir, s in zip(attention, plan.mb_strategy)]
    peak, peak_mb = step_peaks(plan, lowered, build_schedule(plan) if pipelined(plan) else None)
    verify_lowered(plan, lowered, peak, peak_mb, plan.problem.cap)


def unpack(data: bytes, source: str = "<bytes>") -> LoadedStep:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise _fail(source, f"step file data must be bytes, got {type(data).__name__}")
    data = bytes(data)
    _, digest = _header(data[:_HEADER.size], len(data), source)
    raw = data[_HEADER.size:]
    if hashlib.sha256(raw).digest() != digest:
        raise _fail(source, "step file checksum mismatch: the file was altered or corrupted")
    return from_body(_decode(raw, source), source)


def read_file(path) -> LoadedStep:
    """Read and check the step file at ``path`` (a regular file of at most ``MAX_STEP_FILE`` bytes)."""
    if not isinstance(path, (str, os.PathLike)):
        raise PlanFileError(f"a step file path must be a string or path, got {type(path).__name__}")
    source = os.fspath(path)
    try:
        st = os.stat(source)
        if not stat.S_ISREG(st.st_mode):
            raise _fail(source, "cannot read step file: not a regular file")
        if st.st_size > L.MAX_STEP_FILE:
            raise _fail(source, f"step file of {st.st_size:,} bytes is over MAX_STEP_FILE = {L.MAX_STEP_FILE:,}")
        with open(source, "rb") as f:
            data = f.read(L.MAX_STEP_FILE + 1)
    except OSError as e:
        raise _fail(source, f"cannot read step file: {e.strerror or e}") from None
    return unpack(data, source)


def schedule_json(plan: StepPlan) -> dict | None:
    """The pipeline schedule of a plan that runs on one (stages or chunks), per stage its ops in order as
    ``[unit (slot), model chunk, "F" | "B"]``; None otherwise."""
    if plan.problem.mesh.pp == 1 and plan.chunk_keep < 1:
        return None
    sch = build_schedule(plan)
    return {"kind": sch.kind, "stages": sch.stages, "vp": sch.vp, "recompute_units": np.flatnonzero(
        sch.recompute).tolist(), "ops": [[[int(sch.op_unit[i]), int(sch.op_chunk[i]), "FB"[int(sch.op_kind[i])]]
                                          for i in sch.stage_ops(s)] for s in range(sch.stages)]}


def to_json(loaded: LoadedStep) -> dict:
    """``plan step show --json``: every micro-batch with its slot, ranks, strategy and fragments."""
    plan = loaded.plan
    p = plan.problem
    ptr = plan.mb_ptr()
    return {
        "system": plan.system, "model": p.model.name, "mesh": p.mesh.spec(), "tokens": p.tokens, "documents": p.docs,
        "partials_dtype": p.partials_dtype, "keep_kv": p.keep_kv,
        "carried": p.carried, "queue_out": plan.queue_out.tolist(), "info": dict(plan.info),
        "chunk_keep": plan.chunk_keep, "schedule": schedule_json(plan),
        "micro_batches": [{"mb": m, "slot": int(plan.mb_slot[m]), "ranks": plan.mb_ranks(m).tolist(),
                           "strategy": plan.mb_strategy[m], "keep_kv": plan.mb_keeps_kv(m),
                           "fragments": [[int(plan.frag_doc[f]), int(plan.frag_start[f]), int(plan.frag_end[f])]
                                         for f in range(int(ptr[m]), int(ptr[m + 1]))]}
                          for m in range(plan.n_mb)],
    }
