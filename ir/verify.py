"""The verifier. ``verify(ir)`` checks every level the IR has so far:

1. Mask pieces are disjoint and inside their sample.
2. Every allowed (q, k, head) is computed exactly once: token blocks
   partition the token axis, head groups the kv heads, every tile piece lies
   inside its tile and inside the mask piece it came from, those pieces add up
   to every mask piece's pair count, and every (tile, head group) is one
   compute block, run exactly once by the program. Relation tiles (no
   stored pieces, ir/relation.py): the entry table rebuilt from the blocks
   makes exactly these tiles and pair counts, summing to the mask's.
3. A compute block's Q and KV are on its device before it runs: owned, or
   received in a message whose wait came first. The schedule moves exactly
   the blocks a device needs, each once.
4. Every partial output is merged into its home exactly once (forward O;
   backward dQ and dKV), after its last write, and nothing writes a buffer
   while it is being sent: each partial is sent once and each received
   partial merged once, into its home or, on a node reduce's aggregator,
   into that device's own partial of the block after it computed some of it
   and before that is sent — so every contribution reaches its home once.
5. Every message has one send and one receive; the blocks it carries are
   the transfers the message table says, each packed from a buffer of its
   block and unpacked into a receive buffer of the same block and size; for
   every ordered pair of devices, sends and receives are posted in the same
   order (a transport may match by order, as NCCL does); and a symbolic run
   of all programs (rendezvous semantics) finishes: no deadlock.
6. Per-device buffer memory stays under ``ir.memory_cap`` in each phase.

A program also runs its compute blocks in its schedule's order (what the
simulator's stages, the timeline and auto's schedule bound assume): on each
device, stages ascending, within a stage the blocks needing nothing remote
first — in the backward under ``schedule.local_last`` they are all in the
last stage, after every other block (:func:`attnplan.ir.schedule.phase_schedule`).

Beyond the invariants, everything the runtime relies on is checked: every
opcode is legal in its phase, every operand names what the instruction set
(:data:`attnplan.ir.program.ISA`) says it names (a message of this phase and
this device, the message's peer, an existing buffer of the right kind and
role, a compute block placed on this device), the message table is a CSR
index of the transfer table, buffer tables hold only the
kinds of their phase with their canonical sizes, and every array has the
shape and the value ranges the levels promise.

Cost follows the size of the IR: the checks are columnar over all devices at
once (no per-device or per-transfer Python loops; the program's are in
:mod:`attnplan.ir.program_check`), piece disjointness is a sort and sweep
(:func:`attnplan.ir.mask.first_overlap`), and deadlock freedom is a graph
check (:func:`attnplan.ir.interp.check_deadlock_free`).

A failure raises :class:`VerifyError` naming the invariant, the block and the
device, with the IR around it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from .arrays import unique
from .graph import BlockGraph
from .limits import MAX_DEVICES, MAX_MASK_PIECES
from .mask import HI, K0, K1, LO, Q0, Q1, first_overlap, piece_counts, tight
from .module import PlanIR
from .placement import Placement
from .problem import Problem
from .program import A1, ATTN, ATTN_BWD, BWD, FWD, OP, PHASES
from .program_check import check_shape as _shape
from .relation import table
from .program_check import fail as _fail
from .program_check import first as _first
from .program_check import verify_phase, verify_program
from .schedule import X_KV, X_O, X_Q, XDST, XHG, XK, XSRC, XSTAGE, XTB, Schedule, own_blocks, phase_schedule

__all__ = ["NEED_DST", "NEED_HG", "NEED_SRC", "NEED_TB", "VerifyCache", "needed_transfers", "verify",
           "verify_graph", "verify_phase", "verify_placement", "verify_problem", "verify_program", "verify_schedule"]


# ------------------------------------------------------------------------------------------------ problem

def _class_overlap(a: np.ndarray, ptr: list) -> tuple[int, int] | None:
    """Two overlapping pieces of one mask class (classes ``a[ptr[c]:ptr[c+1]]``), or None."""
    for lo, hi in zip(ptr[:-1], ptr[1:]):
        hit = first_overlap(a[lo:hi])
        if hit is not None:
            return hit[0] + lo, hit[1] + lo
    return None


def verify_problem(p: Problem) -> None:
    a = p.pieces.a
    _shape(a, (None, 6), "mask pieces", 1)
    if len(a) > MAX_MASK_PIECES:
        _fail(1, f"{len(a)} mask pieces, more than MAX_MASK_PIECES = {MAX_MASK_PIECES}")
    off = p.offsets
    s = np.searchsorted(off, a[:, Q0], "right") - 1
    lo, hi = off[np.clip(s, 0, len(off) - 1)], off[np.clip(s + 1, 0, len(off) - 1)]
    bad = _first((s < 0) | (s >= len(p.seqlens)) | (a[:, Q1] > hi) | (a[:, K0] < lo) | (a[:, K1] > hi))
    if bad is not None:
        _fail(1, f"mask piece {bad} {a[bad].tolist()} is not inside its sample")
    if p.q_lens is not None:  # cross-attention: queries x keys of the sample
        split = lo + p.q_lens[np.clip(s, 0, len(p.seqlens) - 1)]
        bad = _first((a[:, Q1] > split) | (a[:, K0] < split))
        if bad is not None:
            _fail(1, f"mask piece {bad} {a[bad].tolist()} of a cross-attention sample is not inside its queries "
                     f"[{int(lo[bad])}, {int(split[bad])}) x its keys [{int(split[bad])}, {int(hi[bad])})")
    T = p.tokens  # a tightened piece's band lies in [-T, T]: bounded before any arithmetic on it
    band = a[:, [LO, HI]]
    if ((band < -T) | (band > T)).any() or not tight(a) \
            or (piece_counts(a) <= 0).any():
        _fail(1, "mask pieces are not in canonical (tightened, non-empty) form")
    hit = _class_overlap(a, [0, len(a)] if p.class_ptr is None else p.class_ptr.tolist())
    if hit is not None:
        x, y = hit
        _fail(1, f"mask pieces {x} {a[x].tolist()} and {y} {a[y].tolist()} overlap")


# ------------------------------------------------------------------------------------------------ graph

def _check_graph_shapes(g: BlockGraph) -> None:
    n_tb, n_hg, n = len(g.tb_start), len(g.hg_start), len(g.tile_q)
    for name, shape in (("tb_start", (None,)), ("tb_end", (n_tb,)), ("hg_start", (None,)), ("hg_end", (n_hg,)),
                        ("tile_q", (None,)), ("tile_k", (n,)), ("tile_pairs", (n,)), ("tile_ptr", (n + 1,)),
                        ("pieces", (None, 6)), ("piece_src", (len(g.pieces),)), ("cb_tile", (None,)),
                        ("cb_hg", (len(g.cb_tile),))):
        _shape(getattr(g, name), shape, f"graph.{name}", 2)
    ptr, ss, se = g.tb_ptr, g.span_start, g.span_end
    if ptr is not None and ss is not None and se is not None:
        _shape(ptr, (n_tb + 1,), "graph.tb_ptr", 2)
        _shape(ss, (None,), "graph.span_start", 2)
        _shape(se, (len(ss),), "graph.span_end", 2)
    elif ptr is not None or ss is not None or se is not None:
        _fail(2, "varlen groups need graph.tb_ptr, span_start and span_end together")


def _check_spans(g: BlockGraph) -> bool:
    """Varlen groups: the spans partition [0, T), each block's spans are
    non-empty, in position order, and ``tb_start``/``tb_end`` are its first
    start and last end. False when some check fails."""
    ptr, ss, se = g._spans()
    T = g.problem.tokens
    if ptr[0] != 0 or ptr[-1] != len(ss) or (np.diff(ptr) <= 0).any() or (se <= ss).any():
        return False
    order = np.argsort(ss, kind="stable")
    if ss[order[0]] != 0 or se[order[-1]] != T or not np.array_equal(ss[order[1:]], se[order[:-1]]):
        return False
    owner = np.repeat(np.arange(g.n_tb), np.diff(ptr))
    inner = owner[1:] == owner[:-1]
    if (inner & (ss[1:] <= ss[:-1])).any():
        return False
    return np.array_equal(g.tb_start, ss[ptr[:-1]]) and np.array_equal(g.tb_end, se[ptr[1:] - 1])


def check_blocks(g: BlockGraph) -> None:
    """Invariant 2's block checks alone (a plan file's blocks before its tiles are rebuilt from them)."""
    _check_graph_shapes(g)
    _check_blocks(g)


def _check_blocks(g: BlockGraph) -> None:
    """Token blocks partition [0, T); head groups partition the kv heads."""
    p = g.problem
    if g.grouped:
        if not g.n_tb or not _check_spans(g):
            _fail(2, "the spans of the varlen groups do not partition [0, T) (or a block's spans are out of order)")
    elif not g.n_tb or g.tb_start[0] != 0 or g.tb_end[-1] != p.tokens \
            or not np.array_equal(g.tb_start[1:], g.tb_end[:-1]) or (g.tb_len <= 0).any():
        _fail(2, "token blocks do not partition [0, T)")
    rep = g.kv_rep
    if not isinstance(rep, int) or isinstance(rep, bool) or rep < 1 or p.heads % (p.kv_heads * rep):
        _fail(2, f"kv_rep {rep!r}: {p.heads} query heads are not a multiple of {p.kv_heads} kv heads x kv_rep")
    if not g.n_hg or g.hg_start[0] != 0 or g.hg_end[-1] != p.kv_heads * rep \
            or not np.array_equal(g.hg_start[1:], g.hg_end[:-1]) or (g.hg_end <= g.hg_start).any():
        _fail(2, "head groups do not partition the kv heads" + (f" (x kv_rep {rep})" if rep > 1 else ""))
    if p.head_class is not None:  # per-head masks: a head group's query heads share one mask class
        group = p.heads // (p.kv_heads * rep)
        per_head = np.repeat(np.arange(g.n_hg), (g.hg_end - g.hg_start) * group)
        ir_class = p.ir_head_classes()  # query heads in the plan's head order (Problem.head_order)
        bad = _first(ir_class != g.hg_class[per_head])
        if bad is not None:
            _fail(2, f"head group {per_head[bad]} holds query heads of mask classes {g.hg_class[per_head[bad]]} and "
                     f"{ir_class[bad]} (head position {bad})")


def _check_tile_index(g: BlockGraph) -> None:
    """Tiles name existing token blocks, each (q block, kv block) once; piece pointers are a CSR index."""
    bad = _first((g.tile_q < 0) | (g.tile_q >= g.n_tb) | (g.tile_k < 0) | (g.tile_k >= g.n_tb))
    if bad is not None:
        _fail(2, f"tile {bad} names token blocks ({g.tile_q[bad]}, {g.tile_k[bad]}) outside 0..{g.n_tb - 1}")
    if g.relation:
        if len(g.pieces) or g.tile_ptr.any() or not g.grouped or g.problem.class_ptr is not None:
            _fail(2, "a relation graph (graph.relation) has varlen groups, one mask class and no stored pieces")
    elif g.tile_ptr[0] != 0 or g.tile_ptr[-1] != len(g.pieces) or (np.diff(g.tile_ptr) <= 0).any():
        _fail(2, "tile piece pointers are malformed")
    bad = _first((g.piece_src < 0) | (g.piece_src >= len(g.problem.pieces)))
    if bad is not None:
        _fail(2, f"tile piece {bad} comes from mask piece {g.piece_src[bad]}, which does not exist")
    key = g.tile_q * g.n_tb + g.tile_k
    if g.problem.class_ptr is not None:  # per-head masks: a tile's pieces are of one class, tiles per class
        cls = g.problem.class_of_piece()[g.piece_src]
        owner = np.repeat(np.arange(g.n_tile), np.diff(g.tile_ptr))
        bad = _first(cls != g.tile_class[owner])
        if bad is not None:
            _fail(2, f"tile {owner[bad]} holds pieces of mask classes {g.tile_class[owner[bad]]} and {cls[bad]}")
        key = key + g.tile_class * (g.n_tb * g.n_tb)
    key = np.sort(key)
    dup = _first(key[1:] == key[:-1])
    if dup is not None:
        c, qk = divmod(int(key[dup]), g.n_tb * g.n_tb)
        _fail(2, f"tile (q block, kv block) {divmod(qk, g.n_tb)} appears twice" + (f" in mask class {c}" if c else ""))


def _in_block(g: BlockGraph, lo: np.ndarray, hi: np.ndarray, tb: np.ndarray) -> np.ndarray:
    """``[lo, hi)`` lies inside one span of block ``tb`` (its interval without varlen groups)."""
    ss, se, owner = g.spans()
    order = np.argsort(ss, kind="stable")
    i = order[(np.searchsorted(ss[order], lo, "right") - 1).clip(0)]
    return (lo >= ss[i]) & (hi <= se[i]) & (owner[i] == tb)


def _check_relation(g: BlockGraph) -> None:
    """Relation tiles (:mod:`attnplan.ir.relation`): the entry table rebuilt
    from the blocks makes exactly these tiles with exactly these pair counts,
    and they add up to the mask's pairs."""
    ss, se, owner = g.spans()
    t = table(g.problem, ss, se, owner, g.n_tb)
    if t is None:
        _fail(2, "graph.relation, but the mask is not one causal or full piece per document, a document meets a "
                 "block in two intervals, or no order of the blocks has every document's rows in order")
    tq, tk = t.tiles()
    want, have = tq * g.n_tb + tk, g.tile_q * g.n_tb + g.tile_k
    if not np.array_equal(want, have):
        miss, extra = np.setdiff1d(want, have), np.setdiff1d(have, want)
        what = (f"tile (q block, kv block) {divmod(int(miss[0]), g.n_tb)} is missing" if len(miss) else
                f"tile {divmod(int(extra[0]), g.n_tb)} holds no pairs of the mask" if len(extra) else
                "the tiles are not ordered by (q block, kv block)")
        _fail(2, f"relation tiles: {what}")
    pairs = np.rint(t.sums(tq, tk)).astype(np.int64)
    bad = _first(pairs != g.tile_pairs)
    if bad is not None:
        _fail(2, f"relation tile {bad} (q=tb{tq[bad]}, kv=tb{tk[bad]}) has {g.tile_pairs[bad]} pairs; its "
                 f"documents make {pairs[bad]}")
    total = int(piece_counts(g.problem.pieces.a).sum())
    if int(pairs.sum()) != total:
        _fail(2, f"relation tiles cover {int(pairs.sum())} pairs, the mask has {total}")


def _check_tile_pieces(g: BlockGraph) -> None:
    """Every tile piece is canonical and lies inside its tile and its mask
    piece; a tile holds at most one piece of each mask piece; the pieces of a
    mask piece add up to its pair count (so they partition it)."""
    P, src, M = g.pieces, g.piece_src, g.problem.pieces.a
    owner = np.repeat(np.arange(g.n_tile), np.diff(g.tile_ptr))
    inside = _in_block(g, P[:, Q0], P[:, Q1], g.tile_q[owner]) & _in_block(g, P[:, K0], P[:, K1], g.tile_k[owner])
    sub = ((P[:, Q0] >= M[src, Q0]) & (P[:, Q1] <= M[src, Q1]) & (P[:, K0] >= M[src, K0]) & (P[:, K1] <= M[src, K1])
           & (P[:, LO] >= M[src, LO]) & (P[:, HI] <= M[src, HI]))
    bad = _first(~(inside & sub))
    if bad is not None:
        _fail(2, f"piece {P[bad].tolist()} of tile {owner[bad]} lies outside its tile or its mask piece {src[bad]}")
    if not tight(P):
        _fail(2, "tile pieces are not in canonical (tightened, non-empty) form")
    counts = piece_counts(P)
    bad = _first(counts <= 0)
    if bad is not None:
        _fail(2, f"tile {owner[bad]} has an empty piece")
    same = owner[1:] == owner[:-1]
    if (same & (src[1:] <= src[:-1])).any():
        _fail(2, "a tile holds two pieces of the same mask piece (or its pieces are not ordered by mask piece)")
    per_src = np.zeros(len(M), np.int64)
    np.add.at(per_src, src, counts)
    want = piece_counts(M)
    bad = _first(per_src != want)
    if bad is not None:
        _fail(2, f"mask piece {bad} has {want[bad]} pairs but its tiles cover {per_src[bad]}")
    got = np.add.reduceat(counts, g.tile_ptr[:-1]) if g.n_tile else counts[:0]
    if not np.array_equal(got, g.tile_pairs):
        _fail(2, "tile pair counts do not match their pieces")


def _check_compute_blocks(g: BlockGraph) -> None:
    """Every (tile, head group) of one mask class is exactly one compute block."""
    n, h = g.n_tile, g.n_hg
    bad = _first((g.cb_tile < 0) | (g.cb_tile >= n) | (g.cb_hg < 0) | (g.cb_hg >= h))
    if bad is not None:
        _fail(2, f"compute block c{bad} refers to tile {g.cb_tile[bad]} / head group {g.cb_hg[bad]}, which do "
                 f"not exist")
    if g.problem.head_class is not None:  # per class: every tile of class c with every head group of c
        tc, hc = g.tile_class, g.hg_class
        bad = _first(tc[g.cb_tile] != hc[g.cb_hg])
        if bad is not None:
            _fail(2, f"compute block c{bad} pairs tile {g.cb_tile[bad]} (mask class {tc[g.cb_tile[bad]]}) with "
                     f"head group {g.cb_hg[bad]} (mask class {hc[g.cb_hg[bad]]})")
        want = int(np.bincount(hc, minlength=int(tc.max(initial=0)) + 1)[tc].sum())
        key = np.sort(g.cb_tile * h + g.cb_hg)
        dup = _first(key[1:] == key[:-1])
        if dup is not None or len(key) != want:
            k = int(key[dup]) if dup is not None else 0
            _fail(2, f"compute blocks of tile {k // h} / head group {k % h} repeat" if dup is not None else
                  f"{len(key)} compute blocks where the tiles and head groups of each mask class make {want}")
        return
    key = g.cb_tile * h + g.cb_hg
    order = np.argsort(key, kind="stable")
    sk = key[order]
    dup = _first(sk[1:] == sk[:-1])
    if dup is not None:
        k = int(sk[dup])
        _fail_block(g, k // h, k % h, np.flatnonzero(key == k))
    if len(sk) != n * h:  # no duplicates: a key of 0..n*h-1 is missing
        miss = _first(sk != np.arange(len(sk)))
        k = len(sk) if miss is None else miss
        _fail_block(g, k // h, k % h, np.zeros(0, np.int64))


def _fail_block(g: BlockGraph, t: int, h: int, cbs: np.ndarray) -> None:
    what = "is missing" if not len(cbs) else f"appears {len(cbs)} times"
    _fail(2, f"compute block (tile {t}: q=tb{g.tile_q[t]}, kv=tb{g.tile_k[t]}, hg {h}) {what}"
          + (f" (blocks {cbs.tolist()})" if len(cbs) else ""))


def verify_graph(g: BlockGraph) -> None:
    _check_graph_shapes(g)
    _check_blocks(g)
    _check_tile_index(g)
    (_check_relation if g.relation else _check_tile_pieces)(g)
    _check_compute_blocks(g)


# ------------------------------------------------------------------------------------------------ placement

def verify_placement(g: BlockGraph, pl: Placement) -> None:
    if not isinstance(pl.devices, (int, np.integer)) or not isinstance(pl.nodes, (int, np.integer)) \
            or not 1 <= pl.devices <= MAX_DEVICES or pl.nodes <= 0 or pl.devices % pl.nodes:
        _fail(3, f"{pl.devices} devices cannot be split over {pl.nodes} nodes (at most MAX_DEVICES = {MAX_DEVICES})")
    _shape(pl.home, (g.n_tb,), "placement.home (one device per token block)", 3)
    _shape(pl.cb_device, (g.n_cb,), "placement.cb_device (one device per compute block)", 3)
    for name, arr in (("token block", pl.home), ("compute block", pl.cb_device)):
        bad = _first((arr < 0) | (arr >= pl.devices))
        if bad is not None:
            _fail(3, f"{name} {bad} is placed on device {arr[bad]}, outside 0..{pl.devices - 1}")


# columns of the rows of needed_transfers
NEED_TB, NEED_HG, NEED_SRC, NEED_DST = range(4)


_NEEDED: OrderedDict = OrderedDict()  # (id(graph), id(placement)) -> (graph, placement, transfers), newest last
_NEEDED_KEEP = 8  # placements remembered: auto's candidates of one placement ask for them many times


def needed_transfers(g: BlockGraph, pl: Placement) -> dict[int, np.ndarray]:
    """The forward transfers a placement needs, as unique rows ``(tb, hg, src, dst)`` per kind
    (columns ``NEED_TB``, ``NEED_HG``, ``NEED_SRC``, ``NEED_DST``), sorted, read-only. Remembered for
    the last few (graph, placement) pairs — both immutable, held while remembered so their ids stay
    theirs: ``auto`` asks for the same placement's transfers from its estimates, each candidate's comm
    pass, its schedule bound and emit (about 10 times a placement)."""
    key = (id(g), id(pl))
    hit = _NEEDED.get(key)
    if hit is not None and hit[0] is g and hit[1] is pl:
        _NEEDED.move_to_end(key)
        return dict(hit[2])
    home, dev = pl.home, pl.cb_device
    out = {}
    for kind, tb, toward_home in ((X_Q, g.cb_q, False), (X_KV, g.cb_k, False), (X_O, g.cb_q, True)):
        need = np.flatnonzero(home[tb] != dev)
        src, dst = (dev[need], home[tb[need]]) if toward_home else (home[tb[need]], dev[need])
        out[kind] = _unique_rows(tb[need], g.cb_hg[need], src, dst, g.n_tb, g.n_hg, pl.devices)
        out[kind].setflags(write=False)
    _NEEDED[key] = (g, pl, out)
    while len(_NEEDED) > _NEEDED_KEEP:
        _NEEDED.popitem(last=False)
    return dict(out)


def _unique_rows(tb, hg, src, dst, n_tb: int, n_hg: int, n: int) -> np.ndarray:
    """Sorted unique rows ``(tb, hg, src, dst)``: one int64 key a row (mixed radix) when it fits."""
    if n_tb * n_hg * n * n >= 1 << 62:  # only for IR far over the stated limits
        rows = np.stack([tb, hg, src, dst], 1)
        return np.unique(rows, axis=0) if len(rows) else rows.reshape(0, 4)
    key = unique(((tb * n_hg + hg) * n + src) * n + dst)
    key, d = np.divmod(key, n)
    key, s = np.divmod(key, n)
    t, h = np.divmod(key, n_hg)
    return np.stack([t, h, s, d], 1).astype(np.int64)


# ------------------------------------------------------------------------------------------------ schedule

def _keys(tb, hg, dev, g: BlockGraph, devices: int) -> np.ndarray:
    return (np.asarray(tb) * g.n_hg + np.asarray(hg)) * devices + np.asarray(dev)


def _check_xfer_table(g: BlockGraph, pl: Placement, s: Schedule) -> np.ndarray:
    """The schedule's shapes and ranges; returns the columns of ``xfer`` (its
    transpose, contiguous)."""
    if not isinstance(s.stages, (int, np.integer)) or s.stages < 1:
        _fail(3, f"schedule has {s.stages} stages; it needs at least one")
    _shape(s.cb_stage, (g.n_cb,), "schedule.cb_stage (one stage per compute block)", 3)
    _shape(s.xfer, (None, 6), "schedule.xfer", 3)
    if ((s.cb_stage < 0) | (s.cb_stage >= s.stages)).any():
        _fail(3, "schedule stages do not match the compute blocks")
    if s.local_last and (s.collective or not s.overlap):
        _fail(3, f"schedule.local_last (overlap{{local=last}}) orders an overlapped p2p schedule; this one has "
                 f"overlap={s.overlap}, collective={s.collective}")
    if s.collective and (s.stages != 1 or s.overlap):
        _fail(3, f"a collective schedule (comm{{mode=a2a}}) has one stage and no overlap; this one has {s.stages} "
                 f"stages, overlap={s.overlap}")
    if s.collective and s.reduce:
        _fail(3, "a collective schedule (comm{mode=a2a}) runs its partials as one all-to-all: it has no node reduce")
    x = s.xfer
    xt = np.ascontiguousarray(x.T)
    k, tb, hg, src, dst, st = (xt[c] for c in (XK, XTB, XHG, XSRC, XDST, XSTAGE))
    bad = ((k < 0) | (k > X_O) | (src < 0) | (src >= pl.devices) | (dst < 0) | (dst >= pl.devices) | (tb < 0)
           | (tb >= g.n_tb) | (hg < 0) | (hg >= g.n_hg) | (src == dst) | (st < 0) | (st >= s.stages))
    if bad.any():
        _fail(3, f"scheduled transfer {_first(bad)} {x[_first(bad)].tolist()} names a kind, block, device or "
                 f"stage that does not exist")
    return xt


def _check_inputs_delivered(g: BlockGraph, pl: Placement, s: Schedule, xt: np.ndarray, kind: int, name: str,
                            cb_tb) -> None:
    """Each Q (or KV) block reaches a device at most once, never its home;
    a forwarding device holds the block first; every compute block's remote
    input arrives by its stage. ``xt``: the columns of ``s.xfer``."""
    n = pl.devices
    sel = xt[XK] == kind
    tb, hg, src, dst, stage = (xt[c][sel] for c in (XTB, XHG, XSRC, XDST, XSTAGE))
    home = pl.home[tb]
    i = _first(dst == home)
    if i is not None:
        _fail(3, f"{name}[tb{tb[i]},hg{hg[i]}] is sent to its own home d{dst[i]}")
    key = _keys(tb, hg, dst, g, n)
    order = np.argsort(key, kind="stable")
    skey, sstage = key[order], stage[order]
    dup = _first(skey[1:] == skey[:-1])
    if dup is not None:
        i = order[dup]
        _fail(3, f"{name}[tb{tb[i]},hg{hg[i]}] is delivered to d{dst[i]} twice")

    def arrival(k):
        pos = np.clip(np.searchsorted(skey, k), 0, max(0, len(skey) - 1))
        found = (skey[pos] == k) if len(skey) else np.zeros(len(k), bool)
        return np.where(found, sstage[pos] if len(skey) else 0, -1), found

    fwd = src != home
    arr, found = arrival(_keys(tb[fwd], hg[fwd], src[fwd], g, n))
    bad = _first(~found | (arr >= stage[fwd]))
    if bad is not None:
        i = np.flatnonzero(fwd)[bad]
        _fail(3, f"d{src[i]} forwards {name}[tb{tb[i]},hg{hg[i]}] in stage {stage[i]} without holding it "
                 f"(it is not home there and does not arrive in an earlier stage)")
    remote = np.flatnonzero(pl.home[cb_tb] != pl.cb_device)
    arr, found = arrival(_keys(cb_tb[remote], g.cb_hg[remote], pl.cb_device[remote], g, n))
    late = _first(~found | (arr > s.cb_stage[remote]))
    if late is not None:
        c = remote[late]
        what = "never arrives" if not found[late] else f"arrives in stage {arr[late]}"
        _fail(3, f"{name}[tb{cb_tb[c]},hg{g.cb_hg[c]}] is needed on d{pl.cb_device[c]} by compute block c{c} "
                 f"in stage {s.cb_stage[c]} but {what}")


def _row_keys(rows: np.ndarray, g: BlockGraph, n: int) -> np.ndarray:
    """One int64 per (tb, hg, src, dst) row (all in range: at most 2^58)."""
    return _keys(rows[:, NEED_TB], rows[:, NEED_HG], rows[:, NEED_SRC], g, n) * n + rows[:, NEED_DST]


def _check_partials_scheduled(g: BlockGraph, pl: Placement, s: Schedule) -> None:
    """Exactly the partial O blocks the placement makes go home, once each."""
    n = pl.devices
    have = np.sort(_row_keys(s.xfer[s.xfer[:, XK] == X_O][:, [XTB, XHG, XSRC, XDST]], g, n))
    if (have[1:] == have[:-1]).any():
        _fail(4, "a partial O transfer is scheduled twice")
    want = _row_keys(needed_transfers(g, pl)[X_O], g, n)  # unique and sorted
    missing, extra = np.setdiff1d(want, have), np.setdiff1d(have, want)
    for keys, msg in ((missing, "partial O of tb{} hg{} computed on d{} is never sent home to d{}"),
                      (extra, "partial O transfer of tb{} hg{} d{}->d{} has no partial to carry")):
        if len(keys):
            k = int(keys[0])
            k, dst = divmod(k, n)
            k, src = divmod(k, n)
            tb, hg = divmod(k, g.n_hg)
            _fail(4, msg.format(tb, hg, src, dst))


def verify_schedule(g: BlockGraph, pl: Placement, s: Schedule) -> None:
    """Q and KV reach every device that computes with them, once, in time;
    a block is forwarded only by a device that received it in an earlier
    stage; partial outputs go from each computing device to the home."""
    xt = _check_xfer_table(g, pl, s)
    _check_inputs_delivered(g, pl, s, xt, X_Q, "Q", g.cb_q)
    _check_inputs_delivered(g, pl, s, xt, X_KV, "KV", g.cb_k)
    _check_partials_scheduled(g, pl, s)


def verify_order(g: BlockGraph, pl: Placement, s: Schedule, prog) -> None:
    """Each device's program runs its compute blocks in the order of its
    phase's schedule (:func:`attnplan.ir.schedule.phase_schedule`): stages
    ascending; within a stage the blocks needing nothing remote first, or,
    in the backward under ``local_last``, last."""
    own = own_blocks(g, pl)
    for phase in (FWD, BWD):
        code = prog.code[phase]
        C = np.concatenate(code) if code else np.zeros((0, 6), np.int64)
        dev = np.repeat(np.arange(len(code), dtype=np.int64), [len(c) for c in code])
        sel = C[:, OP] == (ATTN if phase == FWD else ATTN_BWD)
        cb, d = C[sel, A1], dev[sel]
        ps = phase_schedule(g, pl, s, phase)
        last = phase == BWD and s.local_last
        key = ps.cb_stage[cb] * 3 + np.where(own[cb], 2 if last else 0, 1)
        bad = _first((d[1:] == d[:-1]) & (key[1:] < key[:-1]))
        if bad is not None:
            a, b = int(cb[bad]), int(cb[bad + 1])
            what = {0: "needs nothing remote", 1: "needs remote data", 2: "needs nothing remote"}
            rule = ("its blocks needing nothing remote after every other (schedule.local_last)" if last else
                    "stages ascending, in each the blocks needing nothing remote first")
            _fail(3, f"d{d[bad]} runs c{b} (stage {ps.cb_stage[b]}, {what[int(key[bad + 1] % 3)]}) after c{a} "
                     f"(stage {ps.cb_stage[a]}, {what[int(key[bad] % 3)]}) in its {PHASES[phase]} program; its "
                     f"schedule's order is {rule}")


# ------------------------------------------------------------------------------------------------ verify

class VerifyCache:
    """The levels one pipeline has verified, to skip those a pass did not change.

    Each level is remembered with the objects (and values) it was verified
    against, *held by reference*: a level is skipped only if the very same
    objects are still there (``is``), which a freed object's reused id cannot
    fake. Only the latest verified version of each level is kept."""

    __slots__ = ("_seen",)

    def __init__(self):
        self._seen: dict[str, tuple] = {}

    @staticmethod
    def _same(a, b) -> bool:
        if isinstance(b, (bool, int, np.integer)) or b is None:
            return type(a) is type(b) and a == b
        return a is b

    def verified(self, level: str, *deps) -> bool:
        """``level`` was verified against exactly ``deps``."""
        old = self._seen.get(level)
        return old is not None and len(old) == len(deps) and all(map(self._same, old, deps))

    def add(self, level: str, *deps) -> None:
        self._seen[level] = deps


def _levels(ir: PlanIR) -> list:
    """(level, what it is checked against, check) for every level ``ir`` has."""
    p, g, pl, s, prog = ir.problem, ir.graph, ir.placement, ir.schedule, ir.program
    out: list[tuple[str, tuple, Callable[[], None]]] = [("problem", (p,), lambda: verify_problem(p))]
    if g is not None:
        out.append(("graph", (p, g), lambda: _verify_graph_of(p, g)))
    if g is not None and pl is not None:
        out.append(("placement", (g, pl, ir.devices, ir.nodes), lambda: _verify_placement_of(ir, g, pl)))
        if s is not None:
            out.append(("schedule", (g, pl, s), lambda: verify_schedule(g, pl, s)))
        if prog is not None:
            out.append(("program", (g, pl, prog, ir.memory_cap), lambda: verify_program(g, pl, prog, ir.memory_cap)))
            if s is not None:
                out.append(("order", (g, pl, s, prog), lambda: verify_order(g, pl, s, prog)))
    return out


def _verify_graph_of(p: Problem, g: BlockGraph) -> None:
    if g.problem is not p:
        _fail(2, "block graph belongs to another problem")
    verify_graph(g)


def _verify_placement_of(ir: PlanIR, g: BlockGraph, pl: Placement) -> None:
    if pl.devices != ir.devices or pl.nodes != ir.nodes:
        _fail(3, f"placement is for {pl.devices} devices on {pl.nodes} nodes, the plan for {ir.devices} on "
                 f"{ir.nodes}")
    verify_placement(g, pl)


def verify(ir: PlanIR, done: VerifyCache | None = None) -> None:
    """Check every invariant that applies to the levels ``ir`` has (see module doc).

    ``done`` (a :class:`VerifyCache`) lets a pipeline skip the levels that a
    pass did not change: a level is checked again whenever it, or anything it
    is checked against, is another object. Levels are checked top down and
    remembered only once they pass."""
    if done is not None and not isinstance(done, VerifyCache):
        raise TypeError(f"verify: done must be a VerifyCache, got {type(done).__name__}")
    for level, deps, check in _levels(ir):
        if done is not None and done.verified(level, *deps):
            continue
        check()
        if done is not None:
            done.add(level, *deps)
