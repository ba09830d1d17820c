"""The plan file: ``MAGIC | version u16 | flags u16 | body length u64 |
sha256(body) | body``, where the body is zlib-compressed msgpack of plain
maps, lists, numbers, strings and array records (column-wise
differences, :func:`_arr`). Nothing is ever unpickled. The program's
derived fields (sizes, the message table's routes and ranges) are stored as
residuals against what the reader derives, and transfer rows in block order
(:mod:`.planfile_schema`): emitted programs store zeros there, and every
program round-trips exactly.

The file is a pure function of the compile inputs: it holds the IR and the
plan's metadata (pipeline, strategy, block size, builtin cost profile, auto's
candidates) and no timing, so compiling the same inputs twice gives the same
bytes. The body inflates to exactly :func:`canonical_bytes`.

Loading is bounded by the stated limits (:mod:`attnplan.ir.limits`) at every
layer: the header is read first and the declared body length checked against
the file's size and ``MAX_PLAN_FILE`` before the body is read; the body's
inflated size is counted (in 1 MiB steps, nothing kept) against
``MAX_PLAN_BODY`` before it is inflated; msgpack decodes with length bounds
and a budget of maps and lists (:class:`_Budget`);
:mod:`.planfile_schema` checks every field (sizes, ranks, id ranges) before
the IR is built; then the verifier runs. Every failure is one
:class:`PlanFileError` naming the file and the field.
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct
import zlib

import msgpack
import numpy as np

from ..errors import AttnplanError, PlanFileError
from ..ir import limits as L
from ..ir.groups import tiles_derived
from ..ir.module import PlanIR
from ..ir.verify import verify
from . import planfile_schema as schema
from .cost import PROFILES

MAGIC = b"ATTNPLAN"
FORMAT_VERSION = 3  # the version written: coalesced messages (a message table; send/recv/wait name messages)
READ_VERSIONS = (3,)  # records may be delta-encoded by column ("enc") or raw row-major (no "enc")
_OLD_PROGRAMS = (1, 2)  # one transfer per send/recv: such plans must be compiled again
_HEADER = struct.Struct("<8sHHQ32s")
_CHUNK = 1 << 20  # inflate step while counting the body's size
_ZLIB_LEVEL = 1  # level 6 is 4.8x slower for <1% smaller files (130 MB body: 10.8 s vs 2.3 s, 16.46 vs 16.52 MB)

# ------------------------------------------------------------------ writing


def _arr(a: np.ndarray) -> dict:
    """An array record. Stored column by column, each column as the differences
    of consecutive values (``enc: "delta"``, wrapping int64 arithmetic, so any
    values round-trip exactly): plan columns are sorted or slowly varying ids,
    which zlib then packs 4x tighter than raw rows (zigzag, 4M tokens on 64
    devices: 15.0 MB -> 3.7 MB)."""
    a = np.asarray(a, dtype=np.int64)
    cols = a.T if a.ndim == 2 else a
    with np.errstate(over="ignore"):
        d = np.diff(cols, axis=-1, prepend=np.zeros(cols.shape[:-1] + (1,), np.int64)) if a.size else cols
    lo, hi = (int(d.min()), int(d.max())) if d.size else (0, 0)
    dt = "<i4" if -(1 << 31) <= lo and hi < (1 << 31) else "<i8"
    return {"dtype": dt, "shape": list(a.shape), "data": np.ascontiguousarray(d).astype(dt).tobytes(), "enc": "delta"}


def file_meta(meta: dict) -> dict:
    """The metadata a plan file stores: keys sorted (the bytes do not depend on
    insertion order), and ``profile`` only when it is a builtin name (a
    FILE.json profile is the caller's, not the plan's: a plan file never makes
    the tool open a path)."""
    out = {k: meta[k] for k in sorted(meta, key=str) if not (k == "profile" and meta[k] not in PROFILES)}
    if isinstance(out.get("candidates"), dict):
        out["candidates"] = {k: out["candidates"][k] for k in sorted(out["candidates"], key=str)}
    try:
        return schema.check_meta(out)
    except PlanFileError as e:
        raise PlanFileError(f"cannot write a plan file: {e}") from None


def to_body(ir: PlanIR, meta: dict, derive: bool = True) -> dict:
    """The plan file's body; ``derive=False`` writes the tiles even where the reader could rebuild them."""
    p, g, pl, s, prog = ir.problem, ir.graph, ir.placement, ir.schedule, ir.program
    if g is None or pl is None or s is None or prog is None:
        raise PlanFileError("cannot write a plan file: the IR has no program yet (the pipeline must end in 'emit')")
    return {
        "problem": {"seqlens": _arr(p.seqlens), "heads": p.heads, "kv_heads": p.kv_heads, "head_dim": p.head_dim,
                    "pieces": _arr(p.pieces.a), "mask": p.mask, "dtype": p.dtype,
                    "segments": [list(map(list, s_)) if s_ is not None else None for s_ in p.segments]
                    if p.segments is not None else None,
                    **({"q_lens": _arr(p.q_lens)} if p.q_lens is not None else {}),  # absent: self-attention
                    **({"partials_dtype": p.partials_dtype} if p.partials_dtype != "float32" else {}),  # absent: fp32
                    **({"keep_kv": True} if p.keep_kv else {}),  # absent: the backward receives its KV again
                    **({"head_class": _arr(p.head_class), "class_ptr": _arr(p.class_ptr)}
                       if p.head_class is not None and p.class_ptr is not None else {})},  # absent: one mask
        "devices": ir.devices, "nodes": ir.nodes, "memory_cap": ir.memory_cap,
        "graph": _graph_body(g, derive),
        "placement": {"home": _arr(pl.home), "cb_device": _arr(pl.cb_device)},
        "schedule": {"stages": s.stages, "cb_stage": _arr(s.cb_stage), "xfer": _arr(s.xfer), "overlap": s.overlap,
                     **({"collective": True} if s.collective else {}),  # absent: False (older files stay byte-equal)
                     **({"reduce": True} if s.reduce else {}),
                     **({"run": s.run_flops} if s.run_flops else {}),  # absent: 0.0 (a run per partner)
                     **({"local_last": True} if s.local_last else {})},  # absent: local blocks first
        "program": {"transfers": _arr(schema.transfers_body(g, prog.transfers)),
                    "messages": _arr(schema.messages_body(prog.transfers, prog.messages)),
                    "buffers": [[_arr(schema.buffers_body(g, ph, b)) for b in bufs]
                                for ph, bufs in enumerate(prog.buffers)],
                    "code": [[_arr(c) for c in ph] for ph in prog.code]},
        "meta": file_meta(meta),
    }


def _graph_body(g, derive: bool = True) -> dict:
    """The graph's token blocks and head groups; its tiles, pieces and
    compute blocks only where they are not exactly what the tile pass makes
    from those blocks (``"tiles": "derived"``: the reader rebuilds them,
    :func:`attnplan.ir.groups.derive_tiles`) — most of a plan's bytes."""
    derived = (derive or g.relation) and tiles_derived(g)
    if g.relation and not derived:  # relation tiles store no pieces: only their blocks can say what they are
        raise PlanFileError("cannot write a plan file: a graph with relation tiles is stored only as derived tiles, "
                            "and these are not what its blocks make")
    fields = schema.BLOCK_FIELDS if derived else schema.GRAPH_FIELDS
    return {**{f: _arr(getattr(g, f)) for f in fields},
            **({"kv_rep": g.kv_rep} if g.kv_rep != 1 else {}),  # absent: 1
            **({f: _arr(getattr(g, f)) for f in schema.SPAN_FIELDS} if g.grouped else {}),  # varlen groups
            **({"tiles": "derived"} if derived else {})}


def canonical_bytes(ir: PlanIR, meta: dict, derive: bool = True) -> bytes:
    """The plan file's body before compression: msgpack of :func:`to_body`."""
    return msgpack.packb(to_body(ir, meta, derive), use_bin_type=True)


def pack(ir: PlanIR, meta: dict, derive: bool = True) -> bytes:
    """The plan file's bytes: header and compressed :func:`canonical_bytes`."""
    return pack_body(to_body(ir, meta, derive))


def pack_body(body) -> bytes:
    """A plan file of the msgpack-able ``body`` (valid header, length and checksum; the body itself is
    checked only when read — tests craft bodies with it)."""
    raw = zlib.compress(msgpack.packb(body, use_bin_type=True), _ZLIB_LEVEL)
    return _HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(raw), hashlib.sha256(raw).digest()) + raw


# ------------------------------------------------------------------ the header


def _check_header(head: bytes, source: str) -> tuple[int, bytes]:
    """(declared body length, checksum) from the first ``_HEADER.size`` bytes."""
    if len(head) < _HEADER.size:
        if not head or not head.startswith(MAGIC[:len(head)]):
            raise PlanFileError(f"{source}: not an attnplan plan file")
        raise PlanFileError(f"{source}: truncated plan file ({len(head)} bytes, header needs {_HEADER.size})")
    magic, version, flags, length, digest = _HEADER.unpack_from(head)
    if magic != MAGIC:
        raise PlanFileError(f"{source}: not an attnplan plan file (bad magic)")
    if version in _OLD_PROGRAMS:
        raise PlanFileError(f"{source}: plan file format version {version} sends every block as its own message; "
                            f"this attnplan reads version {FORMAT_VERSION} (coalesced messages): compile the plan "
                            f"again")
    if version not in READ_VERSIONS:
        raise PlanFileError(f"{source}: plan file format version {version}; "
                            f"this attnplan reads versions {', '.join(map(str, READ_VERSIONS))}")
    if flags != 0:  # no flags are defined: the header (not covered by the checksum) was altered
        raise PlanFileError(f"{source}: plan file header has unknown flags {flags:#06x}")
    return length, digest


def _check_length(length: int, available: int, source: str) -> None:
    """The body the header declares against the bytes that follow it."""
    if available != length:
        kind = "truncated" if available < length else "has trailing bytes"
        raise PlanFileError(f"{source}: plan file {kind}: body is {available} bytes, header says {length}")


def _check_limit(length: int, source: str) -> None:
    if _HEADER.size + length > L.MAX_PLAN_FILE:
        raise PlanFileError(f"{source}: plan file of {_HEADER.size + length} bytes is larger than the limit "
                            f"MAX_PLAN_FILE = {L.MAX_PLAN_FILE} bytes")


# ------------------------------------------------------------------ the body


def _inflated_size(raw: bytes, source: str) -> int:
    """Bytes ``raw`` inflates to, counted without keeping them; PlanFileError as
    soon as the count passes ``MAX_PLAN_BODY`` (a zlib bomb costs one step of memory)."""
    d, buf, total = zlib.decompressobj(), raw, 0
    try:
        while not d.eof:
            out = d.decompress(buf, _CHUNK)
            total += len(out)
            if total > L.MAX_PLAN_BODY:
                raise PlanFileError(f"{source}: plan body inflates to more than MAX_PLAN_BODY = "
                                    f"{L.MAX_PLAN_BODY} bytes")
            if not out and len(d.unconsumed_tail) == len(buf):
                raise PlanFileError(f"{source}: plan body does not decode: the compressed stream is incomplete")
            buf = d.unconsumed_tail
    except zlib.error as e:
        raise PlanFileError(f"{source}: plan body does not decode: {e}") from None
    if d.unused_data:
        raise PlanFileError(f"{source}: plan body does not decode: {len(d.unused_data)} bytes follow the "
                            f"compressed stream")
    return total


class _Budget:
    """Bounds what msgpack builds, beyond the body's bytes: one byte of msgpack
    can become a 64-byte Python map or list. A plan body has a few maps per
    device (array records) and lists mostly for segments; ``slots`` counts list
    and map entries plus 8 per container (its Python overhead in words)."""

    MAX_MAPS = 8 * L.MAX_DEVICES + 1024
    MAX_SLOTS = 12 * (L.MAX_SEGMENTS + L.MAX_SAMPLES) + 64 * L.MAX_DEVICES + (1 << 20)

    def __init__(self, source: str):
        self.source, self.maps, self.slots = source, 0, 0

    def _spend(self, slots: int) -> None:
        self.slots += slots + 8
        if self.slots > self.MAX_SLOTS:
            raise PlanFileError(f"{self.source}: plan body holds more lists and maps than a plan of MAX_SEGMENTS "
                                f"segments, MAX_SAMPLES samples and MAX_DEVICES devices can")

    def on_list(self, v: list) -> list:
        self._spend(len(v))
        return v

    def on_map(self, d: dict) -> dict:
        self.maps += 1
        if self.maps > self.MAX_MAPS:
            raise PlanFileError(f"{self.source}: plan body holds more than {self.MAX_MAPS} maps (a few per device, "
                                f"MAX_DEVICES = {L.MAX_DEVICES})")
        self._spend(2 * len(d))
        return d


def _decode(raw: bytes, source: str):
    size = _inflated_size(raw, source)
    longest = max(L.MAX_SEGMENTS, L.MAX_SAMPLES, L.MAX_DEVICES)
    budget = _Budget(source)
    try:
        packed = zlib.decompress(raw, bufsize=max(size, 1))
        return msgpack.unpackb(packed, raw=False, strict_map_key=True, use_list=True,
                               list_hook=budget.on_list, object_hook=budget.on_map,
                               max_str_len=4 * L.MAX_MASK_TEXT, max_bin_len=len(packed),
                               max_array_len=min(len(packed), longest), max_map_len=min(len(packed), 1 << 16),
                               max_ext_len=len(packed))
    except PlanFileError:
        raise
    except Exception as e:  # zlib.error, msgpack's errors, ValueError (limits, nesting)
        raise PlanFileError(f"{source}: plan body does not decode: {type(e).__name__}: {e}") from None


def _verify(ir: PlanIR, source: str) -> None:
    try:
        verify(ir)
    except AttnplanError as e:
        raise PlanFileError(f"{source}: plan does not verify: {e}") from None
    except Exception as e:  # noqa: BLE001  the verifier met arrays the schema let through: still the file's fault
        raise PlanFileError(f"{source}: plan does not verify: malformed arrays ({type(e).__name__}: {e})") from None


def _unpack_body(raw: bytes, digest: bytes, source: str, check: bool) -> tuple[PlanIR, dict]:
    if hashlib.sha256(raw).digest() != digest:
        raise PlanFileError(f"{source}: plan file checksum mismatch: the file was altered or corrupted")
    body = _decode(raw, source)
    try:
        ir = schema.from_body(body)
        meta = schema.check_meta(body.get("meta", {}))
    except PlanFileError as e:
        raise PlanFileError(f"{source}: malformed plan file: {e}") from None
    if check:
        _verify(ir, source)
    return ir, meta


# ------------------------------------------------------------------ reading


def unpack(data: bytes, source: str = "<bytes>", check: bool = True) -> tuple[PlanIR, dict]:
    """Inverse of :func:`pack`: (IR, meta); raises :class:`PlanFileError` on anything wrong.
    ``check=False`` skips the verifier (the schema checks still run)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PlanFileError(f"{source}: plan file data must be bytes, got {type(data).__name__}")
    data = bytes(data)
    length, digest = _check_header(data[:_HEADER.size], source)
    _check_length(length, len(data) - _HEADER.size, source)
    _check_limit(length, source)
    return _unpack_body(data[_HEADER.size:], digest, source, check)


def _read_body(f, source: str) -> tuple[bytes, bytes]:
    """(body, checksum) of the open file ``f``: the header first, then exactly the declared body."""
    length, digest = _check_header(f.read(_HEADER.size), source)
    st = os.fstat(f.fileno())
    if stat.S_ISREG(st.st_mode):  # a pipe or device has no size: read at most the declared length
        _check_length(length, st.st_size - _HEADER.size, source)
    _check_limit(length, source)
    raw = f.read(length)
    if len(raw) < length:
        _check_length(length, len(raw), source)
    if f.read(1):
        raise PlanFileError(f"{source}: plan file has trailing bytes: body is more than {length} bytes, "
                            f"header says {length}")
    return raw, digest


def read_file(path, check: bool = True) -> tuple[PlanIR, dict]:
    """Read and check the plan file at ``path``: (IR, meta). Reads the header,
    checks it, then reads exactly the declared body (never more than
    ``MAX_PLAN_FILE`` bytes)."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise PlanFileError(f"a plan file path must be a string or path, got {type(path).__name__}")
    source = os.fsdecode(path)
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block, a device never end
            raise PlanFileError(f"{source}: cannot read plan file: not a regular file")
        with open(path, "rb") as f:
            raw, digest = _read_body(f, source)
    except OSError as e:
        raise PlanFileError(f"{source}: cannot read plan file: {e.strerror or e}") from None
    return _unpack_body(raw, digest, source, check)
