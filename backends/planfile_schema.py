"""The plan file's schema: a decoded body (plain maps, lists, numbers, strings
and array records) checked field by field and built into a :class:`PlanIR`.

Everything the verifier and the runtime rely on is checked here, before
anything proportional to a declared size is built: sizes within the stated
limits (:mod:`attnplan.ir.limits`), array ranks, lengths that agree with each
other, ids in range, positive sample lengths (summed without overflow), head
counts, the dtype, the opcodes each phase may hold and the operand ids of
every instruction. Only then is the IR
built and handed to the verifier. Every failure is a :class:`PlanFileError`
naming the field (the caller adds the file name).

The program's derived fields are stored as *residuals* against what this
module derives from the rest (:func:`derived_transfer_bytes`,
:func:`derived_buffer_bytes`, :func:`derived_messages`): all zeros for an
emitted program, so they cost next to nothing, and any program — a valid
one or not — round-trips exactly. Transfer rows are stored in (phase, kind,
tb, hg, src, dst) order, which compresses far better than the message order
of the program, each with its row index in the program (:data:`FILE_ORDER`).
"""

from __future__ import annotations

import math
from typing import NoReturn

import numpy as np

from ..errors import BatchError, PlanError, PlanFileError, VerifyError
from ..ir import limits as L
from ..ir.graph import BlockGraph
from ..ir.groups import derive_tiles
from ..ir.verify import check_blocks
from ..ir.mask import Pieces
from ..ir.module import PlanIR
from ..ir.placement import Placement
from ..ir.problem import DTYPE_BYTES, Problem
from ..ir.program import (ADD, ATTN, ATTN_BWD, BBYTES, BHG, BK, BPEER, BROLE, BTB, B_DKV, KEPT, KINDS, MERGE,
                          M_BYTES, M_COLS, M_DST, M_END, M_ID, M_PHASE, M_SRC, M_START, OPS, PHASES, RECV, SEND,
                          T_BYTES, T_COLS, T_DST, T_HG, T_KIND, T_PHASE, T_RBUF, T_SBUF, T_SRC, T_TAG, T_TB, WAIT,
                          Program, buffer_bytes)
from ..ir.schedule import Schedule
from ..ir.segments import check_segments
from .cost import PROFILES

BIG = 1 << 62  # bound on every stored integer: numpy arithmetic on checked values never overflows
GRAPH_FIELDS = ("tb_start", "tb_end", "hg_start", "hg_end", "tile_q", "tile_k", "tile_ptr", "pieces",
                "piece_src", "tile_pairs", "cb_tile", "cb_hg")
BLOCK_FIELDS = ("tb_start", "tb_end", "hg_start", "hg_end")  # with "tiles": "derived", all the graph stores
SPAN_FIELDS = ("tb_ptr", "span_start", "span_end")  # varlen groups only (ir/groups.py)
BODY_KEYS = frozenset({"problem", "devices", "nodes", "memory_cap", "graph", "placement", "schedule", "program",
                       "meta"})
LEGACY_KEYS = frozenset({"measured"})  # written by older versions (compile wall time); ignored
_ARRAY_DTYPES = {"<i4": 4, "<i8": 8}

# what each instruction operand names: 0 unused (must be 0), 1 message, 2 device, 3 buffer, 4 compute block
_Z, _MSG, _DEV, _BUF, _CB = range(5)
_OPERAND_KINDS = np.zeros((len(OPS), 5), np.int64)
for _op, _kinds in ((RECV, (_MSG, _DEV)), (SEND, (_MSG, _DEV)), (WAIT, (_MSG,)),
                    (ATTN, (_CB, _BUF, _BUF, _BUF)), (MERGE, (_BUF, _BUF)), (ATTN_BWD, (_CB, _BUF, _BUF, _BUF, _BUF)),
                    (ADD, (_BUF, _BUF))):
    _OPERAND_KINDS[_op, :len(_kinds)] = _kinds
_OPERAND_NAMES = ("unused", "message", "device", "buffer", "compute block")
# the opcodes each phase may hold: the runner has no backward attn in the forward phase and no forward one after
_PHASE_OPS = ((RECV, SEND, WAIT, ATTN, MERGE), (RECV, SEND, WAIT, ATTN_BWD, ADD))


def fail(msg: str) -> NoReturn:
    raise PlanFileError(msg)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _kind(v) -> str:
    return "null" if v is None else type(v).__name__


# ------------------------------------------------------------------ scalar fields

def field(d, key: str, where: str):
    if not isinstance(d, dict):
        fail(f"{where} must be a map, got {_kind(d)}")
    if key not in d:
        fail(f"missing {where}.{key}")
    return d[key]


def integer(d, key: str, where: str, lo: int, hi: int, limit: str = "") -> int:
    v = field(d, key, where)
    if not _is_int(v):
        fail(f"{where}.{key} must be an integer, got {_kind(v)}")
    if not lo <= v <= hi:
        fail(f"{where}.{key} = {v} is outside [{lo}, {hi}]" + (f" (the limit {limit})" if limit else ""))
    return v


def string(d, key: str, where: str, limit: int = L.MAX_MASK_TEXT) -> str:
    v = field(d, key, where)
    if not isinstance(v, str):
        fail(f"{where}.{key} must be a string, got {_kind(v)}")
    if len(v) > limit:
        fail(f"{where}.{key} has {len(v)} characters, more than {limit}")
    return v


# ------------------------------------------------------------------ arrays

def array(d, key: str, where: str, cols: int | None = None, length: int | None = None,
          max_len: int | None = None, limit: str = "") -> np.ndarray:
    """An int64 array from an array record ``{dtype, shape, data}``: ``[n]``, or
    ``[n, cols]``; its shape is checked before any data is decoded."""
    return record(field(d, key, where), f"{where}.{key}", cols, length, max_len, limit)


def record(rec, name: str, cols: int | None = None, length: int | None = None, max_len: int | None = None,
           limit: str = "") -> np.ndarray:
    """:func:`array` for the record ``rec`` named ``name``."""
    if not isinstance(rec, dict) or set(rec) - {"enc"} != {"dtype", "shape", "data"}:
        fail(f"{name} is not an array record")
    enc = rec.get("enc", "raw")
    if enc not in ("raw", "delta"):
        fail(f"{name}: enc must be 'raw' or 'delta', got {_kind(enc) if not isinstance(enc, str) else repr(enc[:20])}")
    dt, shape, data = rec["dtype"], rec["shape"], rec["data"]
    if not isinstance(dt, str) or dt not in _ARRAY_DTYPES:
        fail(f"{name}: dtype must be one of {sorted(_ARRAY_DTYPES)}")
    if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
        fail(f"{name}: shape must be a list of non-negative integers")
    want = [None] if cols is None else [None, cols]
    if len(shape) != len(want) or (cols is not None and shape[1] != cols):
        fail(f"{name} has shape {shape}, expected " + ("[n]" if cols is None else f"[n, {cols}]"))
    if length is not None and shape[0] != length:
        fail(f"{name} has {shape[0]} rows, expected {length}")
    if max_len is not None and shape[0] > max_len:
        fail(f"{name} has {shape[0]} rows, more than {max_len}" + (f" ({limit})" if limit else ""))
    if not isinstance(data, bytes) or len(data) != math.prod(shape) * _ARRAY_DTYPES[dt]:
        fail(f"{name}: data has {len(data) if isinstance(data, bytes) else _kind(data)} bytes for shape {shape}")
    if enc == "raw":
        return np.frombuffer(data, dtype=dt).reshape(shape).astype(np.int64)
    return undelta(np.frombuffer(data, dtype=dt), shape)


def undelta(d: np.ndarray, shape: list) -> np.ndarray:
    """Invert the ``delta`` encoding: ``d`` holds the column-major differences
    of an array of ``shape``; running sums in wrapping int64 arithmetic (a
    crafted file yields some int64 values, which the range checks then judge)."""
    cols = d.astype(np.int64).reshape(shape[::-1])
    with np.errstate(over="ignore"):
        out = np.cumsum(cols, axis=-1, dtype=np.int64) if cols.size else cols
    return np.ascontiguousarray(out.T if len(shape) == 2 else out)


def in_range(a: np.ndarray, lo: int, hi: int, name: str) -> None:
    """Every entry of ``a`` (1-D) in ``[lo, hi]``."""
    if a.size and (int(a.min()) < lo or int(a.max()) > hi):
        i = int(np.flatnonzero((a < lo) | (a > hi))[0])
        fail(f"{name}[{i}] = {int(a[i])} is outside [{lo}, {hi}]")


def columns_in_range(a: np.ndarray, bounds: dict, name: str) -> None:
    """``bounds``: column index -> (column name, lo, hi)."""
    for c, (cname, lo, hi) in bounds.items():
        in_range(a[:, c], lo, hi, f"{name}[:, {cname}]")


def _pieces_in_range(a: np.ndarray, T: int, name: str) -> None:
    """Token columns in [0, T]; band columns in [-T, T] (a tightened piece's are)."""
    columns_in_range(a, {0: ("q0", 0, T), 1: ("q1", 0, T), 2: ("k0", 0, T), 3: ("k1", 0, T),
                         4: ("lo", -T, T), 5: ("hi", -T, T)}, name)


# ------------------------------------------------------------------ levels

def _seqlens(pb) -> np.ndarray:
    lens = array(pb, "seqlens", "problem", max_len=L.MAX_SAMPLES, limit="MAX_SAMPLES")
    if not len(lens):
        fail("problem.seqlens is empty")
    in_range(lens, 1, L.MAX_TOKENS, "problem.seqlens")
    total = int(lens.sum())  # at most MAX_SAMPLES * MAX_TOKENS = 2^46: exact in int64
    if total > L.MAX_TOKENS:
        fail(f"problem.seqlens sum to {total} tokens, more than MAX_TOKENS = {L.MAX_TOKENS}")
    return lens


def _segments(pb, lens: np.ndarray):
    segs = pb.get("segments")
    if segs is None:
        return None
    try:
        return check_segments(segs, lens.tolist(), "problem.")
    except BatchError as e:
        fail(str(e))


_OPTIONAL = {"q_lens": L.MAX_SAMPLES, "head_class": L.MAX_HEADS, "class_ptr": L.MAX_HEADS + 1}  # absent: None


def problem(pb) -> Problem:
    lens = _seqlens(pb)
    heads = integer(pb, "heads", "problem", 1, L.MAX_HEADS, "MAX_HEADS")
    kv_heads = integer(pb, "kv_heads", "problem", 1, L.MAX_HEADS, "MAX_HEADS")
    if heads % kv_heads:
        fail(f"problem.heads ({heads}) is not a multiple of problem.kv_heads ({kv_heads})")
    head_dim = integer(pb, "head_dim", "problem", 1, L.MAX_HEAD_DIM, "MAX_HEAD_DIM")
    dtype = string(pb, "dtype", "problem", 32)
    if dtype not in DTYPE_BYTES:
        fail(f"problem.dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    pieces = array(pb, "pieces", "problem", cols=6, max_len=L.MAX_MASK_PIECES, limit="MAX_MASK_PIECES")
    _pieces_in_range(pieces, int(lens.sum()), "problem.pieces")
    kw = dict(mask=string(pb, "mask", "problem"), segments=_segments(pb, lens), dtype=dtype,
              **{f: array(pb, f, "problem", max_len=n) for f, n in _OPTIONAL.items() if f in pb})
    if "partials_dtype" in pb:  # absent: float32
        kw["partials_dtype"] = string(pb, "partials_dtype", "problem", 32)
    if "keep_kv" in pb:  # absent: False
        if pb["keep_kv"] is not True and pb["keep_kv"] is not False:
            fail(f"problem.keep_kv must be a boolean, got {_kind(pb['keep_kv'])}")
        kw["keep_kv"] = pb["keep_kv"]
    try:  # Problem checks what the optional arrays mean (cross-attention, per-head masks)
        return Problem(seqlens=lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim, pieces=Pieces(pieces), **kw)
    except (PlanError, BatchError) as e:
        fail(f"problem: {e}")


def _kv_rep(gb, p: Problem) -> int:
    """KV-head replication (absent: 1); the query heads must split evenly over the copies."""
    if not isinstance(gb, dict) or "kv_rep" not in gb:
        return 1
    rep = integer(gb, "kv_rep", "graph", 1, L.MAX_HEADS, "MAX_HEADS")
    if p.heads % (p.kv_heads * rep):
        fail(f"graph.kv_rep = {rep}: problem.heads ({p.heads}) is not a multiple of kv_heads x kv_rep "
             f"({p.kv_heads * rep})")
    return rep


def _graph_blocks(gb, p: Problem, rep: int) -> dict:
    """Token blocks and head groups (over ``kv_heads · rep`` virtual kv heads)."""
    T, kv = p.tokens, p.kv_heads * rep
    a = {"tb_start": array(gb, "tb_start", "graph", max_len=T)}
    a["tb_end"] = array(gb, "tb_end", "graph", length=len(a["tb_start"]))
    a["hg_start"] = array(gb, "hg_start", "graph", max_len=kv)
    a["hg_end"] = array(gb, "hg_end", "graph", length=len(a["hg_start"]))
    if not len(a["tb_start"]) or not len(a["hg_start"]):
        fail("graph has no token blocks or no head groups")
    for f, hi in (("tb_start", T), ("tb_end", T), ("hg_start", kv), ("hg_end", kv)):
        in_range(a[f], 0, hi, f"graph.{f}")
    if isinstance(gb, dict) and any(f in gb for f in SPAN_FIELDS):  # varlen groups: the spans of every block
        a["span_start"] = array(gb, "span_start", "graph", max_len=T)
        a["span_end"] = array(gb, "span_end", "graph", length=len(a["span_start"]))
        a["tb_ptr"] = array(gb, "tb_ptr", "graph", length=len(a["tb_start"]) + 1)
        for f, hi in (("span_start", T), ("span_end", T), ("tb_ptr", len(a["span_start"]))):
            in_range(a[f], 0, hi, f"graph.{f}")
    return a


def _graph_tiles(gb, p: Problem, n_tb: int, n_hg: int) -> dict:
    """Tiles, their pieces and the compute blocks."""
    T = p.tokens
    a = {"tile_q": array(gb, "tile_q", "graph")}
    n = len(a["tile_q"])
    a["tile_k"] = array(gb, "tile_k", "graph", length=n)
    a["tile_pairs"] = array(gb, "tile_pairs", "graph", length=n)
    a["tile_ptr"] = array(gb, "tile_ptr", "graph", length=n + 1)
    a["pieces"] = array(gb, "pieces", "graph", cols=6)
    a["piece_src"] = array(gb, "piece_src", "graph", length=len(a["pieces"]))
    # every (tile, head group) is one compute block (invariant 2; per-head masks: of one class, so at most that)
    per_class = p.head_class is not None
    a["cb_tile"] = array(gb, "cb_tile", "graph", length=None if per_class else n * n_hg,
                         max_len=n * n_hg if per_class else None)
    a["cb_hg"] = array(gb, "cb_hg", "graph", length=len(a["cb_tile"]))
    for f, lo, hi in (("tile_q", 0, n_tb - 1), ("tile_k", 0, n_tb - 1), ("tile_pairs", 0, T * T),
                      ("tile_ptr", 0, len(a["pieces"])), ("piece_src", 0, len(p.pieces) - 1),
                      ("cb_tile", 0, n - 1), ("cb_hg", 0, n_hg - 1)):
        in_range(a[f], lo, hi, f"graph.{f}")
    _pieces_in_range(a["pieces"], T, "graph.pieces")
    return a


def graph(gb, p: Problem) -> BlockGraph:
    rep = _kv_rep(gb, p)
    blocks = _graph_blocks(gb, p, rep)
    _check_blocks(p, blocks, rep)  # the blocks partition the tokens and heads before anything is built on them
    tiles_mode = gb.get("tiles") if isinstance(gb, dict) else None
    if tiles_mode is not None:
        if tiles_mode != "derived":
            fail(f"graph.tiles must be \"derived\" or absent, got {_kind(tiles_mode)}")
        stored = [f for f in GRAPH_FIELDS if f not in BLOCK_FIELDS and f in gb]
        if stored:
            fail(f"graph.tiles is \"derived\" but the graph also stores {', '.join(stored)}")
        return _derived(p, blocks, rep)
    tiles = _graph_tiles(gb, p, len(blocks["tb_start"]), len(blocks["hg_start"]))
    return BlockGraph(problem=p, **blocks, **tiles, kv_rep=rep)


def _check_blocks(p: Problem, blocks: dict, rep: int) -> None:
    """Invariant 2's block checks (and the spans' shape) on a graph of the blocks alone."""
    empty = np.zeros(0, np.int64)
    shell = BlockGraph(problem=p, **blocks, tile_q=empty, tile_k=empty, tile_ptr=np.zeros(1, np.int64),
                       pieces=np.zeros((0, 6), np.int64), piece_src=empty, tile_pairs=empty, cb_tile=empty,
                       cb_hg=empty, kv_rep=rep)
    try:
        check_blocks(shell)
    except VerifyError as e:
        fail(f"graph: {e}")


def _derived(p: Problem, blocks: dict, rep: int) -> BlockGraph:
    """The tiles the tile pass makes from the stored (checked) blocks, bounded
    by its own limits; the stored block arrays must be exactly the rebuilt graph's."""
    try:
        g = derive_tiles(p, blocks["tb_start"], blocks["hg_start"], rep, blocks.get("tb_ptr"), blocks.get("span_start"),
                         blocks.get("span_end"))
    except PlanError as e:
        fail(f"graph: its tiles cannot be rebuilt from its blocks: {e}")
    for f, a in blocks.items():
        if not np.array_equal(getattr(g, f), a):
            fail(f"graph.{f} is not what its blocks make (the tiles are derived from them)")
    return g


def devices_nodes(body) -> tuple[int, int]:
    devices = integer(body, "devices", "body", 1, L.MAX_DEVICES, "MAX_DEVICES")
    nodes = integer(body, "nodes", "body", 1, devices)
    if devices % nodes:
        fail(f"body.devices ({devices}) is not a multiple of body.nodes ({nodes})")
    return devices, nodes


def placement(plb, g: BlockGraph, devices: int, nodes: int) -> Placement:
    home = array(plb, "home", "placement", length=g.n_tb)
    cb_device = array(plb, "cb_device", "placement", length=g.n_cb)
    in_range(home, 0, devices - 1, "placement.home")
    in_range(cb_device, 0, devices - 1, "placement.cb_device")
    return Placement(devices, nodes, home, cb_device)


def schedule(sb, g: BlockGraph, devices: int) -> Schedule:
    stages = integer(sb, "stages", "schedule", 1, BIG)
    cb_stage = array(sb, "cb_stage", "schedule", length=g.n_cb)
    in_range(cb_stage, 0, stages - 1, "schedule.cb_stage")
    xfer = array(sb, "xfer", "schedule", cols=6)
    columns_in_range(xfer, {0: ("kind", 0, 2), 1: ("tb", 0, g.n_tb - 1), 2: ("hg", 0, g.n_hg - 1),
                            3: ("src", 0, devices - 1), 4: ("dst", 0, devices - 1),
                            5: ("stage", 0, stages - 1)}, "schedule.xfer")
    overlap = field(sb, "overlap", "schedule")
    if not isinstance(overlap, bool):
        fail(f"schedule.overlap must be a boolean, got {_kind(overlap)}")
    collective = sb.get("collective", False)
    if collective is not True and collective is not False:
        fail(f"schedule.collective must be a boolean, got {_kind(collective)}")
    reduce = sb.get("reduce", False)
    if reduce is not True and reduce is not False:
        fail(f"schedule.reduce must be a boolean, got {_kind(reduce)}")
    run = sb.get("run", 0.0)
    if isinstance(run, bool) or not isinstance(run, (int, float)) or not 0.0 <= run <= 1e30:
        fail(f"schedule.run must be FLOPs in [0, 1e30], got {run!r}" if isinstance(run, (int, float))
             else f"schedule.run must be a number, got {_kind(run)}")
    local_last = sb.get("local_last", False)
    if local_last is not True and local_last is not False:
        fail(f"schedule.local_last must be a boolean, got {_kind(local_last)}")
    return Schedule(stages, cb_stage, xfer, overlap, collective, reduce, float(run), local_last)


def _per_device(pr, key: str, devices: int) -> list:
    v = field(pr, key, "program")
    if not isinstance(v, list) or len(v) != 2 or any(not isinstance(ph, list) or len(ph) != devices for ph in v):
        fail(f"program.{key} must have 2 phases x {devices} devices")
    return v


# ------------------------------------------------------------------ derived fields (stored as residuals)

# the order of transfer rows in a file: by phase, kind, tb, hg, src, dst (np.lexsort keys, last is primary)
FILE_ORDER = (T_DST, T_SRC, T_HG, T_TB, T_KIND, T_PHASE)


def canonical_bytes_of(g: BlockGraph, phase: np.ndarray, kind: np.ndarray, tb: np.ndarray,
                       hg: np.ndarray) -> np.ndarray:
    """:func:`~attnplan.ir.program.buffer_bytes` of every row (0 where phase,
    kind, tb or hg is out of range): what the verifier requires."""
    out = np.zeros(len(kind), np.int64)
    ok = (tb >= 0) & (tb < g.n_tb) & (hg >= 0) & (hg < g.n_hg)
    for ph in (0, 1):
        for k in range(len(KINDS)):
            sel = np.flatnonzero(ok & (phase == ph) & (kind == k))
            if len(sel):
                out[sel] = buffer_bytes(g, ph, k, tb[sel], hg[sel])
    return out


def derived_transfer_bytes(g: BlockGraph, X: np.ndarray) -> np.ndarray:
    return canonical_bytes_of(g, X[:, T_PHASE], X[:, T_KIND], X[:, T_TB], X[:, T_HG])


def derived_buffer_bytes(g: BlockGraph, phase: int, B: np.ndarray) -> np.ndarray:
    return canonical_bytes_of(g, np.full(len(B), phase), B[:, BK], B[:, BTB], B[:, BHG])


def derived_messages(X: np.ndarray, end: np.ndarray, start: np.ndarray | None = None) -> np.ndarray:
    """The message table a CSR index ``end`` of the transfer table ``X``
    implies: ids 0..m-1, each message starting where the previous ended,
    with the route (phase, src, dst) of its first transfer and its
    transfers' bytes summed (ranges clipped to the table). ``start``, when
    given, replaces the implied starts for the route and the bytes."""
    m, n = len(end), len(X)
    out = np.zeros((m, M_COLS), np.int64)
    out[:, M_ID] = np.arange(m)
    out[:, M_START] = np.concatenate([[0], end[:-1]]) if m else 0
    out[:, M_END] = end
    st = out[:, M_START] if start is None else start
    if m and n:
        first = np.clip(st, 0, n - 1)
        out[:, M_PHASE], out[:, M_SRC], out[:, M_DST] = X[first, T_PHASE], X[first, T_SRC], X[first, T_DST]
        with np.errstate(over="ignore"):
            total = np.concatenate([[0], np.cumsum(X[:, T_BYTES])])
            out[:, M_BYTES] = total[np.clip(end, 0, n)] - total[np.clip(st, 0, n)]
    return out


def _buffers(recs: list, g: BlockGraph, devices: int) -> tuple:
    out = []
    for ph, phase in enumerate(recs):
        row = []
        for d, rec in enumerate(phase):
            name = f"program.buffers[{ph}][{d}]"
            b = record(rec, name, cols=6)
            columns_in_range(b, {0: ("kind", 0, B_DKV), 1: ("tb", 0, g.n_tb - 1), 2: ("hg", 0, g.n_hg - 1),
                                 3: ("role", 0, KEPT), 4: ("peer", -1, BIG)}, name)
            # a kept buffer's peer is a forward buffer's index (the verifier checks which); others name a device
            in_range(b[b[:, BROLE] != KEPT, BPEER], -1, devices - 1, f"{name}[:, peer]")
            with np.errstate(over="ignore"):
                b[:, BBYTES] += derived_buffer_bytes(g, ph, b)  # stored: the residual
            in_range(b[:, BBYTES], 0, BIG, f"{name}[:, bytes]")
            row.append(b)
        out.append(tuple(row))
    return tuple(out)


def _check_operands(c: np.ndarray, hi_of_kind: np.ndarray, name: str) -> None:
    """Every operand names an existing message, device, buffer or compute block; unused ones are 0."""
    kinds = _OPERAND_KINDS[c[:, 0]]  # [n, 5]
    hi = hi_of_kind[kinds]  # the unused kind's bound is 0: operands beyond the arity must be 0
    bad = (c[:, 1:] < 0) | (c[:, 1:] > hi)
    if bad.any():
        i, j = (int(x) for x in np.argwhere(bad)[0])
        fail(f"{name} instruction {i} ({OPS[c[i, 0]]}): operand {j + 1} = {int(c[i, j + 1])} names no "
             f"{_OPERAND_NAMES[kinds[i, j]]} (allowed 0..{int(hi[i, j])})")


def _code(recs: list, buffers: tuple, g: BlockGraph, devices: int, n_messages: int) -> tuple:
    total = 0
    out = []
    for ph, phase in enumerate(recs):
        row = []
        for d, rec in enumerate(phase):
            name = f"program.code[{ph}][{d}]"
            c = record(rec, name, cols=6, max_len=L.MAX_INSTRUCTIONS - total, limit="MAX_INSTRUCTIONS")
            total += len(c)
            in_range(c[:, 0], 0, len(OPS) - 1, f"{name}[:, op]")
            wrong = np.flatnonzero(~np.isin(c[:, 0], _PHASE_OPS[ph]))
            if len(wrong):
                i = int(wrong[0])
                fail(f"{name} instruction {i}: {OPS[c[i, 0]]} is not a {PHASES[ph]} instruction")
            hi = np.array([0, n_messages - 1, devices - 1, len(buffers[ph][d]) - 1, g.n_cb - 1], np.int64)
            _check_operands(c, hi, name)
            row.append(c)
        out.append(tuple(row))
    return tuple(out)


def _transfer_buffers(transfers: np.ndarray, buffers: tuple) -> None:
    """Every transfer's source buffer exists on its source and its receive
    buffer on its destination, in the transfer's phase."""
    nb = np.array([[len(b) for b in ph] for ph in buffers], np.int64)  # [phase, device]
    for col, dev, cname in ((T_SBUF, T_SRC, "sbuf"), (T_RBUF, T_DST, "rbuf")):
        hi = nb[transfers[:, T_PHASE], transfers[:, dev]] - 1
        bad = np.flatnonzero(transfers[:, col] > hi)
        if len(bad):
            i = int(bad[0])
            fail(f"program.transfers[:, {cname}][{i}] = {int(transfers[i, col])} names no buffer of device "
                 f"{int(transfers[i, dev])} (it has {int(hi[i]) + 1} in {PHASES[transfers[i, T_PHASE]]})")


FILE_TRANSFER_COLS = T_COLS + 1  # the row index, then the program's columns (tag and bytes as residuals)


def transfers_body(g: BlockGraph, X: np.ndarray) -> np.ndarray:
    """The transfer record of a file: every row ``(row, tag - row, phase,
    kind, tb, hg, src, dst, bytes - canonical bytes, sbuf, rbuf)`` in
    :data:`FILE_ORDER` (the inverse of :func:`_transfers`)."""
    order = np.lexsort(tuple(X[:, c] for c in FILE_ORDER)) if len(X) else np.zeros(0, np.int64)
    out = np.empty((len(X), FILE_TRANSFER_COLS), np.int64)
    out[:, 0] = order
    out[:, 1:] = X[order]
    with np.errstate(over="ignore"):
        out[:, 1 + T_TAG] -= order
        out[:, 1 + T_BYTES] -= derived_transfer_bytes(g, X[order])
    return out


def _transfers(pr, g: BlockGraph, devices: int) -> np.ndarray:
    """The transfer table from its record (see :func:`transfers_body`)."""
    rows = array(pr, "transfers", "program", cols=FILE_TRANSFER_COLS, max_len=L.MAX_TRANSFERS, limit="MAX_TRANSFERS")
    n = len(rows)
    at = rows[:, 0]
    in_range(at, 0, n - 1, "program.transfers[:, row]")
    if n and np.bincount(at, minlength=n).max() > 1:
        fail(f"program.transfers: row {int(np.argmax(np.bincount(at, minlength=n) > 1))} is stored twice")
    X = np.empty((n, T_COLS), np.int64)
    X[at] = rows[:, 1:]
    columns_in_range(X, {T_PHASE: ("phase", 0, 1), T_KIND: ("kind", 0, B_DKV), T_TB: ("tb", 0, g.n_tb - 1),
                         T_HG: ("hg", 0, g.n_hg - 1), T_SRC: ("src", 0, devices - 1), T_DST: ("dst", 0, devices - 1),
                         T_SBUF: ("sbuf", 0, BIG), T_RBUF: ("rbuf", 0, BIG)}, "program.transfers")
    with np.errstate(over="ignore"):
        X[:, T_TAG] += np.arange(n)
        X[:, T_BYTES] += derived_transfer_bytes(g, X)
    columns_in_range(X, {T_TAG: ("tag", 0, n - 1), T_BYTES: ("bytes", 0, BIG)}, "program.transfers")
    return X


def messages_body(X: np.ndarray, M: np.ndarray) -> np.ndarray:
    """The message record of a file: the table less what :func:`derived_messages`
    derives from its ``end`` column (stored as it is)."""
    implied = derived_messages(X, M[:, M_END])[:, M_START]  # where each message would start
    with np.errstate(over="ignore"):
        out = M - derived_messages(X, M[:, M_END], M[:, M_START])  # id, route and bytes
        out[:, M_START] = M[:, M_START] - implied
    out[:, M_END] = M[:, M_END]
    return out


def _messages(pr, X: np.ndarray, devices: int) -> np.ndarray:
    """The message table from its record (see :func:`messages_body`)."""
    n = len(X)
    # a message carries at least one transfer: never more messages than transfers
    R = array(pr, "messages", "program", cols=M_COLS, max_len=n, limit="one transfer at least each")
    in_range(R[:, M_END], 0, n, "program.messages[:, end]")
    M = R.copy()
    with np.errstate(over="ignore"):
        M[:, M_START] += derived_messages(X, R[:, M_END])[:, M_START]
        in_range(M[:, M_START], 0, n, "program.messages[:, start]")
        D = derived_messages(X, R[:, M_END], M[:, M_START])
        for c in (M_ID, M_PHASE, M_SRC, M_DST, M_BYTES):
            M[:, c] += D[:, c]
    columns_in_range(M, {M_ID: ("id", 0, len(M) - 1), M_PHASE: ("phase", 0, 1), M_SRC: ("src", 0, devices - 1),
                         M_DST: ("dst", 0, devices - 1), M_BYTES: ("bytes", 0, BIG)}, "program.messages")
    return M


def buffers_body(g: BlockGraph, phase: int, B: np.ndarray) -> np.ndarray:
    """A buffer table's record: its bytes column as the residual against the canonical sizes."""
    out = np.array(B, np.int64)
    with np.errstate(over="ignore"):
        out[:, BBYTES] -= derived_buffer_bytes(g, phase, out)
    return out


def program(pr, g: BlockGraph, devices: int) -> Program:
    X = _transfers(pr, g, devices)
    messages = _messages(pr, X, devices)
    bufs = _per_device(pr, "buffers", devices)
    code = _per_device(pr, "code", devices)
    buffers = _buffers(bufs, g, devices)
    _transfer_buffers(X, buffers)
    return Program(devices, X, buffers, _code(code, buffers, g, devices, len(messages)), messages)


def memory_cap(body) -> int | None:
    v = body.get("memory_cap")
    if v is not None and (not _is_int(v) or not 1 <= v <= L.MAX_MEMORY_CAP):
        fail(f"body.memory_cap must be null or a positive integer up to MAX_MEMORY_CAP = {L.MAX_MEMORY_CAP}, "
             f"got {v if _is_int(v) else _kind(v)}")
    return v


def from_body(body) -> PlanIR:
    """The IR of a decoded plan body; every field checked (see the module doc)."""
    if not isinstance(body, dict):
        fail(f"the body must be a map, got {_kind(body)}")
    unknown = sorted(str(k) for k in body if k not in BODY_KEYS | LEGACY_KEYS)
    if unknown:
        fail(f"unknown body keys {unknown[:5]}")
    p = problem(field(body, "problem", "body"))
    devices, nodes = devices_nodes(body)
    g = graph(field(body, "graph", "body"), p)
    pl = placement(field(body, "placement", "body"), g, devices, nodes)
    s = schedule(field(body, "schedule", "body"), g, devices)
    prog = program(field(body, "program", "body"), g, devices)
    return PlanIR(problem=p, devices=devices, nodes=nodes, memory_cap=memory_cap(body), graph=g, placement=pl,
                  schedule=s, program=prog)


# ------------------------------------------------------------------ meta

def _meta_string(v, name: str) -> None:
    if not isinstance(v, str) or len(v) > L.MAX_MASK_TEXT:
        fail(f"{name} must be a string of at most {L.MAX_MASK_TEXT} characters, got {_kind(v)}")


def _meta_number(v, name: str) -> None:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        fail(f"{name} must be a finite number, got {v!r}" if isinstance(v, float) else
             f"{name} must be a finite number, got {_kind(v)}")


def _meta_profile(v, name: str) -> None:
    # a plan file never names a file to open: a profile FILE.json can only come from the command line
    if not isinstance(v, str) or v not in PROFILES:
        shown = repr(v[:80]) if isinstance(v, str) else _kind(v)
        fail(f"{name} must be a builtin cost profile ({', '.join(sorted(PROFILES))}), got {shown}")


def _meta_block_size(v, name: str) -> None:
    if not _is_int(v) or not 1 <= v <= L.MAX_BLOCK_SIZE:
        fail(f"{name} must be an integer in [1, {L.MAX_BLOCK_SIZE}]")


def _meta_candidates(v, name: str) -> None:
    if not isinstance(v, dict) or len(v) > 1024:
        fail(f"{name} must be a map of strategy name to predicted seconds")
    for k, x in v.items():
        _meta_string(k, f"{name} key")
        _meta_number(x, f"{name}.{k}")


def _meta_reasons(v, name: str) -> None:
    if not isinstance(v, dict) or len(v) > 1024:
        fail(f"{name} must be a map of strategy name to a reason")
    for k, x in v.items():
        _meta_string(k, f"{name} key")
        _meta_string(x, f"{name}.{k}")


def _meta_scalar(v, name: str) -> None:
    """Keys this version does not use: a string, a finite number, a boolean or null."""
    if v is None or isinstance(v, bool):
        return
    (_meta_string if isinstance(v, str) else _meta_number)(v, name)


_META = {"pipeline": _meta_string, "strategy": _meta_string, "profile": _meta_profile,
         "block_size": _meta_block_size, "candidates": _meta_candidates, "estimates": _meta_candidates,
         "pruned": _meta_reasons}


def check_meta(meta) -> dict:
    """``meta`` is used as it is by ``Plan.stats`` and the report: check every key's type."""
    if not isinstance(meta, dict):
        fail(f"meta must be a map, got {_kind(meta)}")
    for key, v in meta.items():
        if not isinstance(key, str):
            fail("meta keys must be strings")
        _META.get(key, _meta_scalar)(v, f"meta.{key}")
    return meta
