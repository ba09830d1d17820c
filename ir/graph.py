"""BlockGraph: data blocks and compute blocks, columnar.

* token blocks ``tb``: contiguous intervals ``[tb_start, tb_end)`` partitioning
  the packed axis; the tile pass cuts at sample boundaries and every ``block``
  tokens from each sample start (no padding: a short last block is fine);
  placement passes may add cuts. *Varlen groups* (``tb_ptr`` set, made by
  :mod:`attnplan.ir.groups`): a token block is a list of spans
  ``[span_start, span_end)`` (CSR ``tb_ptr``, each block's spans in position
  order, its rows their concatenation), the spans partitioning the packed
  axis — per-document sharding's chunk ``c`` of many documents as one block;
  ``tb_start``/``tb_end`` are then each block's first start and last end.
* head groups ``hg``: kv-head ranges ``[hg_start, hg_end)``; a group's query
  heads are ``[hg_start * group, hg_end * group)``. With ``kv_rep = r > 1``
  (KV-head replication, as yunchang's Ulysses does beyond the kv heads) the
  ranges count *virtual* kv heads ``0 .. kv_heads·r``: virtual head ``j`` is a
  copy of kv head ``j // r`` serving ``group = heads / (kv_heads·r)`` query
  heads, so a kv head's query heads can be split over ``r`` head groups.
* data blocks are implicit: Q, KV and O of one (token block, head group).
* tiles: (q block, kv block) pairs with at least one allowed pair; each owns
  the mask pieces clipped to its rectangle (CSR: ``tile_ptr`` into ``pieces``),
  ``piece_src`` names the mask piece each came from.
* compute blocks ``cb``: (tile, head group); ``cb_pairs`` is exact.
* per-head masks (``problem.head_class``): every tile belongs to one mask
  class (``tile_class``, from its pieces' mask pieces), every head group's
  query heads to one class (``hg_class``: head groups are cut where the class
  changes, and kv heads copied ``kv_rep`` times where one kv head's query
  heads differ) — head positions count the query heads in
  ``problem.head_order()`` (each kv head's query heads sorted by class;
  the runtime permutes q's heads in and the output's back), and the compute blocks are the (tile, head group) pairs of
  the same class — tiles of a class then head groups, in order.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import numpy as np

from ..errors import PlanError
from .arrays import unique
from .limits import MAX_TILE_PIECES
from .mask import HI, INF, K0, K1, LO, Q0, Q1, piece_counts, tighten
from .problem import Problem
from .relation import Table, table, tile_pieces


def _ramp(n: np.ndarray) -> np.ndarray:
    """``0 .. n[i]-1`` for every ``i``, concatenated."""
    n = np.asarray(n, np.int64)
    return np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)


def _expand(first: np.ndarray, last: np.ndarray, what: str = "rows"):
    """For ranges ``[first[i], last[i]]`` return (owner row, value) of every
    element; PlanError before allocating when there are over MAX_TILE_PIECES."""
    n = np.maximum(last - first + 1, 0)
    total = int(n.sum(dtype=np.int64)) if len(n) else 0
    if total > MAX_TILE_PIECES:
        raise PlanError(f"tiling would make {total:,} {what}, over the limit of {MAX_TILE_PIECES:,} (ir/limits.py "
                        f"MAX_TILE_PIECES): use a larger block size, fewer devices, or a strategy that cuts the "
                        f"documents less finely (per_doc, and dacp for the documents it spreads, cut each into "
                        f"2 x devices chunks)")
    owner = np.repeat(np.arange(len(first)), n)
    value = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n) + first[owner]
    return owner, value


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)
class BlockGraph:
    problem: Problem
    tb_start: np.ndarray
    tb_end: np.ndarray
    hg_start: np.ndarray
    hg_end: np.ndarray
    tile_q: np.ndarray
    tile_k: np.ndarray
    tile_ptr: np.ndarray
    pieces: np.ndarray
    piece_src: np.ndarray
    tile_pairs: np.ndarray
    cb_tile: np.ndarray
    cb_hg: np.ndarray
    kv_rep: int = 1  # copies of every kv head (head groups count kv_heads * kv_rep virtual kv heads)
    tb_ptr: np.ndarray | None = None      # varlen groups: block b's spans are tb_ptr[b]:tb_ptr[b+1]
    span_start: np.ndarray | None = None  # varlen groups: the spans, block by block
    span_end: np.ndarray | None = None
    relation: bool = False  # varlen groups whose tiles are relations (ir/relation.py): no pieces stored

    def __post_init__(self):
        for f in self.__dataclass_fields__:
            v = getattr(self, f)
            if isinstance(v, np.ndarray):
                v.setflags(write=False)

    # sizes -------------------------------------------------------------------
    @property
    def n_tb(self) -> int:
        return len(self.tb_start)

    @property
    def n_hg(self) -> int:
        return len(self.hg_start)

    @property
    def n_tile(self) -> int:
        return len(self.tile_q)

    @property
    def n_cb(self) -> int:
        return len(self.cb_tile)

    # derived columns -----------------------------------------------------------
    @property
    def grouped(self) -> bool:
        """Token blocks are varlen groups of spans (see the module doc)."""
        return self.tb_ptr is not None

    def _spans(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tb_ptr, span_start, span_end) of a grouped graph."""
        ptr, ss, se = self.tb_ptr, self.span_start, self.span_end
        if ptr is None or ss is None or se is None:
            raise PlanError("varlen groups need graph.tb_ptr, span_start and span_end together")
        return ptr, ss, se

    @property
    def tb_len(self) -> np.ndarray:
        """Rows of each token block."""
        if self.tb_ptr is None:
            return self.tb_end - self.tb_start
        ptr, ss, se = self._spans()
        return np.add.reduceat(se - ss, ptr[:-1]) if self.n_tb else self.tb_start[:0]

    def spans(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(start, end, block) of every span, block by block (one span per
        block without varlen groups): the rows of block ``b`` are its spans in order."""
        if self.tb_ptr is None:
            return self.tb_start, self.tb_end, np.arange(self.n_tb, dtype=np.int64)
        ptr, ss, se = self._spans()
        return ss, se, np.repeat(np.arange(self.n_tb, dtype=np.int64), np.diff(ptr))

    @property
    def cuts(self) -> np.ndarray:
        """Every span start, increasing: the contiguous partition a strategy re-tiles from."""
        return self.tb_start if self.tb_ptr is None else np.sort(self._spans()[1])

    def block_rows(self, tbs: np.ndarray) -> np.ndarray:
        """Global token index of every row of the blocks ``tbs``, block after block."""
        ss, se, _ = self.spans()
        tbs = np.asarray(tbs, np.int64)
        if self.tb_ptr is None:
            first, last = tbs, tbs + 1
        else:
            first, last = self.tb_ptr[tbs], self.tb_ptr[tbs + 1]
        span = np.repeat(first, last - first) + _ramp(last - first)
        n = se[span] - ss[span]
        return (np.repeat(ss[span], n) + _ramp(n)).astype(np.int64)

    def local_pieces(self, tile: int) -> tuple[np.ndarray, int, int]:
        """(pieces, qs, ks) for a kernel: the tile's pieces in coordinates
        where its q block's rows start at ``qs`` and its kv block's at ``ks``
        — global ones (the blocks' starts) without varlen groups; with them,
        each piece moved to its block's local rows (``qs = ks = 0``)."""
        P = self.tile_pieces(tile)
        qb, kb = int(self.tile_q[tile]), int(self.tile_k[tile])
        if self.tb_ptr is None:
            return P, int(self.tb_start[qb]), int(self.tb_start[kb])
        dq, dk = self._span_shift(qb, P[:, Q0]), self._span_shift(kb, P[:, K0])
        out = P.copy()
        out[:, [Q0, Q1]] -= dq[:, None]
        out[:, [K0, K1]] -= dk[:, None]
        for c in (LO, HI):  # lo <= k - q <= hi, both moved: the band moves by dq - dk (unbounded sides stay)
            bounded = np.abs(out[:, c]) < INF
            out[bounded, c] += (dq - dk)[bounded]
        return out, 0, 0

    def _span_shift(self, tb: int, pos: np.ndarray) -> np.ndarray:
        """Global minus local row of positions ``pos`` inside block ``tb``'s spans."""
        ptr, ss, se = self._spans()
        a, b = int(ptr[tb]), int(ptr[tb + 1])
        ss, se = ss[a:b], se[a:b]
        local0 = np.cumsum(se - ss) - (se - ss)
        i = np.searchsorted(ss, pos, "right") - 1
        return ss[i] - local0[i]

    @property
    def kv_virtual(self) -> int:
        """The kv heads head groups split: ``kv_heads`` copied ``kv_rep`` times."""
        return self.problem.kv_heads * self.kv_rep

    @property
    def group(self) -> int:
        """Query heads per (virtual) kv head."""
        return self.problem.heads // self.kv_virtual

    @property
    def hg_heads(self) -> np.ndarray:
        """Query heads per head group."""
        return (self.hg_end - self.hg_start) * self.group

    @property
    def tile_class(self) -> np.ndarray:
        """The mask class of each tile (all 0 without per-head masks)."""
        if self.problem.class_ptr is None or not self.n_tile:
            return np.zeros(self.n_tile, np.int64)
        return self.problem.class_of_piece()[self.piece_src[self.tile_ptr[:-1]]]

    @property
    def hg_class(self) -> np.ndarray:
        """The mask class of each head group (that of its first query head)."""
        return self.problem.ir_head_classes()[self.hg_start * self.group]

    @property
    def cb_q(self) -> np.ndarray:
        return self.tile_q[self.cb_tile]

    @property
    def cb_k(self) -> np.ndarray:
        return self.tile_k[self.cb_tile]

    @property
    def cb_pairs(self) -> np.ndarray:
        """Allowed pairs × query heads of each compute block."""
        return self.tile_pairs[self.cb_tile] * self.hg_heads[self.cb_hg]

    def cb_flops(self) -> np.ndarray:
        return 4 * self.problem.head_dim * self.cb_pairs

    def tile_pieces(self, tile: int) -> np.ndarray:
        """The mask pieces of ``tile`` (made from the entry table for relation tiles)."""
        if self.relation:
            return tile_pieces(self.problem, self.relation_table(), int(self.tile_q[tile]), int(self.tile_k[tile]))[0]
        return self.pieces[self.tile_ptr[tile]:self.tile_ptr[tile + 1]]

    def relation_table(self) -> Table:
        """The entry table of a relation graph (:mod:`attnplan.ir.relation`), made once."""
        t = _TABLES.get(self)
        if t is None:
            ss, se, owner = self.spans()
            t = table(self.problem, ss, se, owner, self.n_tb) if self.relation and self.grouped else None
            if t is None:
                raise PlanError("this graph's tiles are not relations of its blocks (graph.relation needs varlen "
                                "groups of a per-document causal or full mask in a consistent order)")
            _TABLES[self] = t
        return t

    def to_text(self, limit: int = 40) -> str:
        shown = "relation" if self.relation else len(self.pieces)
        lines = [(f"blockgraph token_blocks={self.n_tb} head_groups={self.n_hg} tiles={self.n_tile} "
                  f"compute_blocks={self.n_cb} pieces={shown}")]
        ss, se, _ = self.spans()
        for t in range(min(self.n_tb, limit)):
            if self.tb_ptr is None:
                lines.append(f"  tb{t} [{self.tb_start[t]}, {self.tb_end[t]})")
            else:
                a, b = int(self.tb_ptr[t]), int(self.tb_ptr[t + 1])
                shown = " ".join(f"[{ss[i]}, {se[i]})" for i in range(a, min(b, a + 4)))
                lines.append(f"  tb{t} {b - a} spans {shown}{' ...' if b - a > 4 else ''}")
        for c in range(min(self.n_cb, limit)):
            t = self.cb_tile[c]
            lines.append(f"  c{c} = tile{t}(q=tb{self.tile_q[t]}, kv=tb{self.tile_k[t]}) hg{self.cb_hg[c]} "
                         f"pairs={self.cb_pairs[c]}" + ("" if self.relation else
                                                        f" pieces={self.tile_ptr[t + 1] - self.tile_ptr[t]}"))
        if max(self.n_tb, self.n_cb) > limit:
            lines.append(f"  ... ({self.n_tb} token blocks, {self.n_cb} compute blocks)")
        return "\n".join(lines)


def head_groups(kv_heads: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Split ``kv_heads`` into ``n`` contiguous groups as evenly as possible."""
    bounds = np.array([kv_heads * i // n for i in range(n + 1)], dtype=np.int64)
    return bounds[:-1], bounds[1:]


def q_block_rows(P: np.ndarray, starts: np.ndarray, ends: np.ndarray):
    """The mask pieces ``P`` clipped to the query rows of every token block
    ``[starts[i], ends[i])`` they touch, tightened, empty ones dropped:
    (rows, the piece each came from, its block)."""
    first = np.searchsorted(starts, P[:, Q0], "right") - 1
    last = np.searchsorted(starts, P[:, Q1] - 1, "right") - 1
    src, qb = _expand(first, last, "(mask piece, q block) rows")
    rows = P[src]
    rows[:, Q0] = np.maximum(rows[:, Q0], starts[qb])
    rows[:, Q1] = np.minimum(rows[:, Q1], ends[qb])
    keep = tighten(rows)
    return rows[keep], src[keep], qb[keep]


def class_kv_rep(problem: Problem, kv_rep: int) -> int:
    """``kv_rep`` raised (to a multiple) so that every virtual kv head's query
    heads share one mask class: the least ``r`` dividing ``heads / kv_heads``
    with class-pure runs of ``heads / (kv_heads · r)`` heads, lcm with ``kv_rep``."""
    if problem.head_class is None:
        return kv_rep
    hc, group = problem.ir_head_classes(), problem.heads // problem.kv_heads
    need = next(r for r in range(1, group + 1)
                if group % r == 0 and (hc.reshape(-1, group // r) == hc.reshape(-1, group // r)[:, :1]).all())
    return kv_rep * need // math.gcd(kv_rep, need)


def class_head_groups(problem: Problem, kv_rep: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`head_groups` of the virtual kv heads, also cut where the mask class changes."""
    kv = problem.kv_heads * kv_rep
    hs, he = head_groups(kv, n)
    if problem.head_class is None:
        return hs, he
    vclass = problem.ir_head_classes()[np.arange(kv) * (problem.heads // kv)]
    cuts = unique(np.concatenate([hs, np.flatnonzero(vclass[1:] != vclass[:-1]) + 1, [kv]]))
    return cuts[:-1].astype(np.int64), cuts[1:].astype(np.int64)


def hg_share(g: BlockGraph, n: int) -> np.ndarray:
    """For each head group, which of the ``n`` near-even shares of the virtual
    kv heads (:func:`head_groups`) holds it: the identity when the graph has
    exactly those ``n`` groups; a share split where the mask class changes
    keeps its parts together."""
    starts = head_groups(g.kv_virtual, n)[0]
    return (np.searchsorted(starts, g.hg_start, "right") - 1).astype(np.int64)


def _compute_blocks(tile_class: np.ndarray, hg_class: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(cb_tile, cb_hg): every tile with every head group of its class, in tile order then head group."""
    n_tile, n_hg = len(tile_class), len(hg_class)
    if not hg_class.any():  # one class: every tile with every head group
        return (np.repeat(np.arange(n_tile, dtype=np.int64), n_hg), np.tile(np.arange(n_hg, dtype=np.int64), n_tile))
    order = np.argsort(hg_class, kind="stable")
    n_cls = int(max(hg_class.max(), tile_class.max(initial=0))) + 1
    cnt = np.bincount(hg_class, minlength=n_cls)
    start = np.cumsum(cnt) - cnt
    per_tile = cnt[tile_class]
    cb_tile = np.repeat(np.arange(len(tile_class), dtype=np.int64), per_tile)
    within = np.arange(len(cb_tile)) - np.repeat(np.cumsum(per_tile) - per_tile, per_tile)
    return cb_tile, order[start[tile_class][cb_tile] + within].astype(np.int64)


def check_kv_rep(problem: Problem, kv_rep: int) -> None:
    """KV-head replication ``kv_rep`` must leave every virtual kv head at least one
    query head: ``heads`` a multiple of ``kv_heads · kv_rep``; else PlanError."""
    if not isinstance(kv_rep, int) or isinstance(kv_rep, bool) or kv_rep < 1:
        raise PlanError(f"kv_rep must be an integer >= 1, got {kv_rep!r}")
    if problem.heads % (problem.kv_heads * kv_rep):
        raise PlanError(f"{problem.kv_heads} kv heads copied {kv_rep} times: {problem.heads} query heads are not a "
                        f"multiple of {problem.kv_heads * kv_rep} (each copy serves whole query heads)")


def block_bounds(problem: Problem, cuts) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of the contiguous token blocks cut at ``cuts`` (0 and T added, duplicates dropped)."""
    T = problem.tokens
    cuts = unique(np.concatenate([np.asarray(cuts, np.int64), [0, T]]))
    cuts = cuts[(cuts >= 0) & (cuts <= T)]
    return cuts[:-1], cuts[1:]


def graph_head_groups(problem: Problem, n_head_groups: int, kv_rep: int, hg_starts: np.ndarray | None = None):
    """(kv_rep, hg_start, hg_end, hg_class) that :func:`build_graph` uses: ``n_head_groups`` head
    groups over ``kv_heads · kv_rep`` virtual kv heads (:func:`class_head_groups`), or those
    starting at ``hg_starts``."""
    check_kv_rep(problem, kv_rep)
    kv_rep = class_kv_rep(problem, kv_rep)
    if not 1 <= n_head_groups <= problem.kv_heads * kv_rep:
        raise PlanError(f"{n_head_groups} head groups over {problem.kv_heads * kv_rep} kv heads: between 1 and "
                        f"the kv heads")
    if hg_starts is None:
        hs, he = class_head_groups(problem, kv_rep, n_head_groups)
    else:
        hs = np.asarray(hg_starts, np.int64)
        he = np.append(hs[1:], problem.kv_heads * kv_rep).astype(np.int64)
    hg_class = problem.ir_head_classes()[hs * (problem.heads // (problem.kv_heads * kv_rep))]
    return kv_rep, hs, he, hg_class


def build_graph(problem: Problem, cuts: np.ndarray, n_head_groups: int = 1, kv_rep: int = 1,
                hg_starts: np.ndarray | None = None) -> BlockGraph:
    """Tile ``problem`` at the token positions ``cuts`` (0 and T are added),
    with ``n_head_groups`` head groups over ``kv_heads · kv_rep`` (virtual) kv heads
    (:func:`class_head_groups`), or the head groups starting at ``hg_starts``
    (a graph's own, when re-tiling it).

    Vectorized: mask pieces are expanded over the q blocks they touch, then
    over the kv blocks each clipped piece touches, clipped, tightened and
    grouped by (q block, kv block)."""
    kv_rep, hs, he, hg_class = graph_head_groups(problem, n_head_groups, kv_rep, hg_starts)
    starts, ends = block_bounds(problem, cuts)
    rows, src, qb = q_block_rows(problem.pieces.a, starts, ends)
    # over kv blocks
    first = np.searchsorted(starts, rows[:, K0], "right") - 1
    last = np.searchsorted(starts, rows[:, K1] - 1, "right") - 1
    own, kb = _expand(first, last, "(mask piece, tile) rows")
    rows, src, qb = rows[own], src[own], qb[own]
    rows[:, K0] = np.maximum(rows[:, K0], starts[kb])
    rows[:, K1] = np.minimum(rows[:, K1], ends[kb])
    keep = np.flatnonzero(tighten(rows))
    src = src[keep]
    # group into tiles: (mask class, q block, kv block); one class without per-head masks
    key = qb[keep] * len(starts) + kb[keep]
    if problem.class_ptr is not None:
        key += problem.class_of_piece()[src] * (len(starts) * len(starts))
    order = np.lexsort((src, key))
    rows, src, key = rows[keep[order]], src[order], key[order]  # one gather of the rows: they are the bulk
    bound = np.flatnonzero(np.diff(key)) + 1
    # CSR pointers: one per tile plus the end (just [0] when the mask allows no pair at all)
    tile_ptr = np.concatenate([[0], bound, [len(key)]] if len(key) else [[0]]).astype(np.int64)
    tile_key = key[tile_ptr[:-1]]
    counts = piece_counts(rows)
    tile_pairs = np.add.reduceat(counts, tile_ptr[:-1]) if len(counts) else counts
    n = len(starts)
    cb_tile, cb_hg = _compute_blocks(tile_key // (n * n), hg_class)
    return built(BlockGraph(
        problem=problem, tb_start=starts.copy(), tb_end=ends.copy(), hg_start=hs, hg_end=he,
        tile_q=(tile_key // n) % n, tile_k=tile_key % n, tile_ptr=tile_ptr,
        pieces=np.ascontiguousarray(rows), piece_src=src, tile_pairs=tile_pairs.astype(np.int64),
        cb_tile=cb_tile, cb_hg=cb_hg, kv_rep=kv_rep,
    ))


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # relation graph -> its entry table
_BUILT: weakref.WeakSet = weakref.WeakSet()  # graphs made by build_graph / group_graph themselves


def built(g: BlockGraph) -> BlockGraph:
    """Mark ``g`` as the tile pass's own construction from its blocks (so a
    plan file may leave its tiles out: :func:`attnplan.ir.groups.tiles_derived`);
    any other graph — ``dataclasses.replace`` of one included — is not marked."""
    _BUILT.add(g)
    return g


def is_built(g: BlockGraph) -> bool:
    return g in _BUILT


def sample_cuts(problem: Problem, block: int, pack: bool = True) -> np.ndarray:
    """Token block starts: every ``block`` tokens from the start of each sample
    longer than ``block``; consecutive samples of at most ``block`` tokens are
    packed greedily, in order, into blocks of at most ``block`` tokens (a new
    block starts where the next sample would not fit, and after a long
    sample). A packed block is a varlen group: its tiles hold the pieces of
    every short document in it, one compute block (one varlen kernel call) for
    all of them, each piece's rows still rounded to the kernel tile on its own
    (backends/cost.py). No sample straddles a packed block. ``pack=False``:
    a block boundary at every sample start (one block per short sample).
    Cross-attention: a sample's queries and its keys are cut as two samples,
    never packed (a block holds one side only, so nothing moves the other
    side's unused Q or KV)."""
    off = problem.offsets
    lens = problem.seqlens
    if problem.q_lens is not None:
        lens = np.stack([problem.q_lens, lens - problem.q_lens], 1).reshape(-1)
        off, pack = np.concatenate([[0], np.cumsum(lens)]), False
    long = lens > block if pack else np.ones(len(lens), bool)
    per = np.where(long, (lens + block - 1) // block, 0)
    owner = np.repeat(np.arange(len(lens)), per)
    idx = np.arange(int(per.sum())) - np.repeat(np.cumsum(per) - per, per)
    return np.concatenate([off[owner] + idx * block, off[:1], _packed_starts(off, lens, long, block)])


def _packed_starts(off: np.ndarray, lens: np.ndarray, long: np.ndarray, block: int) -> np.ndarray:
    """Starts of the packed blocks of short samples (see :func:`sample_cuts`)."""
    short = np.flatnonzero(~long)
    if not len(short):
        return np.zeros(0, np.int64)
    # the greedy only restarts at a long sample or an overflow: one Python step per short sample
    after_long = np.zeros(len(lens), bool)
    after_long[1:] = long[:-1]
    out, fill = [], block
    for i, n, fresh in zip(short.tolist(), lens[short].tolist(), after_long[short].tolist()):
        if fresh or fill + n > block:
            out.append(i)
            fill = n
        else:
            fill += n
    return off[np.asarray(out, np.int64)]
