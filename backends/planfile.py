"""The plan file: ``MAGIC | version u16 | flags u16 | body length u64 |
sha256(body) | body``, where the body is zlib-compressed msgpack of plain
maps, lists, numbers, strings and raw array bytes. Loading checks each
layer (magic, version, length, checksum, schema) and then runs the verifier;
nothing is ever unpickled.

Everything in the body but ``measured`` (the wall time of the compile) is a
pure function of the compile inputs, so the same inputs give the same bytes
there; ``canonical_bytes`` leaves ``measured`` out.
"""

from __future__ import annotations

import hashlib
import struct
import zlib

import msgpack
import numpy as np

from ..errors import AttnplanError, PlanFileError
from ..frontend.batch import _check_segments
from ..ir.graph import BlockGraph
from ..ir.mask import Pieces
from ..ir.module import PlanIR
from ..ir.placement import Placement
from ..ir.problem import Problem
from ..ir.program import Program
from ..ir.schedule import Schedule
from ..ir.verify import verify

MAGIC = b"ATTNPLAN"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sHHQ32s")


def _arr(a: np.ndarray) -> dict:
    a = np.asarray(a, dtype=np.int64)
    lo, hi = (int(a.min()), int(a.max())) if a.size else (0, 0)
    dt = "<i4" if -(1 << 31) <= lo and hi < (1 << 31) else "<i8"
    return {"dtype": dt, "shape": list(a.shape), "data": a.astype(dt).tobytes()}


def _unarr(x, what: str) -> np.ndarray:
    if not isinstance(x, dict) or set(x) != {"dtype", "shape", "data"}:
        raise PlanFileError(f"malformed plan file: {what} is not an array record")
    if x["dtype"] not in ("<i4", "<i8") or not isinstance(x["shape"], list) \
            or not all(isinstance(s, int) and s >= 0 for s in x["shape"]) or not isinstance(x["data"], bytes):
        raise PlanFileError(f"malformed plan file: bad array record for {what}")
    n = int(np.prod(x["shape"])) if x["shape"] else 1
    if len(x["data"]) != n * int(x["dtype"][-1]):
        raise PlanFileError(f"malformed plan file: {what} has {len(x['data'])} bytes for shape {x['shape']}")
    return np.frombuffer(x["data"], dtype=x["dtype"]).reshape(x["shape"]).astype(np.int64)


def to_body(ir: PlanIR, meta: dict) -> dict:
    p, g, pl, s, prog = ir.problem, ir.graph, ir.placement, ir.schedule, ir.program
    return {
        "problem": {"seqlens": _arr(p.seqlens), "heads": p.heads, "kv_heads": p.kv_heads, "head_dim": p.head_dim,
                    "pieces": _arr(p.pieces.a), "mask": p.mask, "dtype": p.dtype,
                    "segments": [list(map(list, s_)) if s_ is not None else None for s_ in p.segments]
                    if p.segments is not None else None},
        "devices": ir.devices, "nodes": ir.nodes, "memory_cap": ir.memory_cap,
        "graph": {f: _arr(getattr(g, f)) for f in BlockGraph.__dataclass_fields__ if f != "problem"},
        "placement": {"home": _arr(pl.home), "cb_device": _arr(pl.cb_device)},
        "schedule": {"stages": s.stages, "cb_stage": _arr(s.cb_stage), "xfer": _arr(s.xfer), "overlap": s.overlap},
        "program": {"transfers": _arr(prog.transfers),
                    "buffers": [[_arr(b) for b in ph] for ph in prog.buffers],
                    "code": [[_arr(c) for c in ph] for ph in prog.code]},
        "meta": meta,
    }


def pack(ir: PlanIR, meta: dict, measured: dict) -> bytes:
    body = dict(to_body(ir, meta), measured=measured)
    raw = zlib.compress(msgpack.packb(body, use_bin_type=True), 6)
    return _HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(raw), hashlib.sha256(raw).digest()) + raw


def canonical_bytes(ir: PlanIR, meta: dict) -> bytes:
    return msgpack.packb(to_body(ir, meta), use_bin_type=True)


def _get(d, key, typ, what):
    if not isinstance(d, dict) or key not in d:
        raise PlanFileError(f"malformed plan file: missing {what}.{key}")
    v = d[key]
    if typ is not None and not isinstance(v, typ) or isinstance(v, bool) and typ is int:
        raise PlanFileError(f"malformed plan file: {what}.{key} has the wrong type")
    return v


def unpack(data: bytes, source: str = "<bytes>", check: bool = True) -> tuple[PlanIR, dict, dict]:
    """Inverse of :func:`pack`; raises :class:`PlanFileError` on anything wrong."""
    if len(data) < _HEADER.size:
        if not data.startswith(MAGIC[:len(data)]) or not data:
            raise PlanFileError(f"{source}: not an attnplan plan file")
        raise PlanFileError(f"{source}: truncated plan file ({len(data)} bytes, header needs {_HEADER.size})")
    magic, version, flags, length, digest = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise PlanFileError(f"{source}: not an attnplan plan file (bad magic)")
    if version != FORMAT_VERSION:
        raise PlanFileError(f"{source}: plan file format version {version}; this attnplan reads version {FORMAT_VERSION}")
    if flags != 0:  # no flags are defined: the header (not covered by the checksum) was altered
        raise PlanFileError(f"{source}: plan file header has unknown flags {flags:#06x}")
    raw = data[_HEADER.size:]
    if len(raw) != length:
        kind = "truncated" if len(raw) < length else "has trailing bytes"
        raise PlanFileError(f"{source}: plan file {kind}: body is {len(raw)} bytes, header says {length}")
    if hashlib.sha256(raw).digest() != digest:
        raise PlanFileError(f"{source}: plan file checksum mismatch: the file was altered or corrupted")
    try:
        body = msgpack.unpackb(zlib.decompress(raw), raw=False, strict_map_key=True)
    except Exception as e:  # zlib.error, msgpack errors, ValueError
        raise PlanFileError(f"{source}: plan body does not decode: {e}") from None
    try:
        ir = _from_body(body)
    except AttnplanError as e:
        if isinstance(e, PlanFileError):
            raise PlanFileError(f"{source}: {e}") from None
        raise PlanFileError(f"{source}: malformed plan file: {e}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise PlanFileError(f"{source}: malformed plan file: {e}") from None
    meta, measured = body.get("meta", {}), body.get("measured", {})
    _check_meta(meta, measured, source)
    if check:
        try:
            verify(ir)
        except AttnplanError as e:
            raise PlanFileError(f"{source}: plan does not verify: {e}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as e:
            # the verifier assumes well-formed arrays (right rank, ids in range); a crafted body can break that
            raise PlanFileError(f"{source}: plan does not verify: malformed arrays "
                                f"({type(e).__name__}: {e})") from None
    return ir, meta, measured


_META_TYPES = {"pipeline": str, "strategy": str, "profile": str, "block_size": int}


def _check_meta(meta, measured, source: str) -> None:
    """``meta`` and ``measured`` are used as they are by ``Plan.stats``; check their shape here."""
    if not isinstance(meta, dict) or not isinstance(measured, dict):
        raise PlanFileError(f"{source}: malformed plan file: meta and measured must be maps")
    for key, typ in _META_TYPES.items():
        if key in meta and (not isinstance(meta[key], typ) or isinstance(meta[key], bool)):
            raise PlanFileError(f"{source}: malformed plan file: meta.{key} must be {typ.__name__}")
    for key, v in measured.items():
        if not isinstance(key, str) or not isinstance(v, (int, float)) or isinstance(v, bool):
            raise PlanFileError(f"{source}: malformed plan file: measured.{key} must be a number")


def _from_body(body) -> PlanIR:
    if not isinstance(body, dict):
        raise PlanFileError("malformed plan file: body is not a map")
    pb = _get(body, "problem", dict, "body")
    seqlens = _unarr(_get(pb, "seqlens", dict, "problem"), "problem.seqlens")
    segs = pb.get("segments")
    # one entry per sample, each null or [[kind, length], ...] summing to the sample length (BatchError otherwise)
    segments = _check_segments(segs, seqlens.tolist(), "problem.") if segs is not None else None
    pieces = _unarr(_get(pb, "pieces", dict, "problem"), "problem.pieces")
    if pieces.ndim != 2 or pieces.shape[1] != 6:
        raise PlanFileError("malformed plan file: problem.pieces must be [n, 6]")
    problem = Problem(seqlens=seqlens,
                      heads=_get(pb, "heads", int, "problem"), kv_heads=_get(pb, "kv_heads", int, "problem"),
                      head_dim=_get(pb, "head_dim", int, "problem"), pieces=Pieces(pieces),
                      mask=_get(pb, "mask", str, "problem"), segments=segments,
                      dtype=_get(pb, "dtype", str, "problem"))
    gb = _get(body, "graph", dict, "body")
    graph = BlockGraph(problem=problem, **{f: _unarr(_get(gb, f, dict, "graph"), f"graph.{f}")
                                           for f in BlockGraph.__dataclass_fields__ if f != "problem"})
    if graph.pieces.ndim != 2 or (len(graph.pieces) and graph.pieces.shape[1] != 6):
        raise PlanFileError("malformed plan file: graph.pieces must be [n, 6]")
    plb = _get(body, "placement", dict, "body")
    devices, nodes = _get(body, "devices", int, "body"), _get(body, "nodes", int, "body")
    placement = Placement(devices, nodes, _unarr(_get(plb, "home", dict, "placement"), "placement.home"),
                          _unarr(_get(plb, "cb_device", dict, "placement"), "placement.cb_device"))
    sb = _get(body, "schedule", dict, "body")
    schedule = Schedule(_get(sb, "stages", int, "schedule"), _unarr(_get(sb, "cb_stage", dict, "schedule"), "cb_stage"),
                        _unarr(_get(sb, "xfer", dict, "schedule"), "schedule.xfer").reshape(-1, 6),
                        _get(sb, "overlap", bool, "schedule"))
    pr = _get(body, "program", dict, "body")
    bufs, code = _get(pr, "buffers", list, "program"), _get(pr, "code", list, "program")
    if len(bufs) != 2 or len(code) != 2 or any(len(ph) != devices for ph in bufs + code):
        raise PlanFileError(f"malformed plan file: program does not have 2 phases x {devices} devices")
    program = Program(devices, _unarr(_get(pr, "transfers", dict, "program"), "program.transfers"),
                      tuple(tuple(_unarr(b, "program.buffers") for b in ph) for ph in bufs),
                      tuple(tuple(_unarr(c, "program.code") for c in ph) for ph in code))
    cap = body.get("memory_cap")
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap <= 0):
        raise PlanFileError("malformed plan file: memory_cap must be null or a positive integer")
    return PlanIR(problem=problem, devices=devices, nodes=nodes, memory_cap=cap, graph=graph,
                  placement=placement, schedule=schedule, program=program)
