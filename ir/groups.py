"""Varlen groups: token blocks made of many spans (issue 9, item 1).

Per-document sharding cuts every document into 2N chunks; as contiguous
token blocks that is a block per (document, chunk) and a tile per
(document, q chunk, kv chunk). A *varlen group* is one token block made of
the chunks of many documents that live on one device and play the same part
(per_doc: chunk ``c`` of every document): its tiles hold the pieces of all
of those documents — what one varlen kernel call (``cu_seqlens``) computes
as one compute block — and it moves as one block. The mask pieces stay
exactly those of the contiguous tiling (each piece still rounded to the
kernel tile on its own, backends/cost.py); compute blocks, transfers and
buffers become per group.

:func:`varlen_groups` packs blocks into groups; :func:`group_graph` builds the
grouped :class:`~attnplan.ir.graph.BlockGraph` from a contiguous one.
"""

from __future__ import annotations

import numpy as np

from ..errors import PlanError
from .graph import _TABLES, BlockGraph, _compute_blocks, build_graph, built, graph_head_groups, is_built
from .limits import MAX_TILE_PIECES
from .relation import table


def group_limit(g: BlockGraph, varlen: int) -> int:
    """Tokens per varlen group for a strategy's ``varlen`` option: -1 no cap
    (every token: one group per (device, key) — per_doc's whole chunk column,
    what TransformerEngine's THD attention runs as one varlen call per ring
    step), else ``varlen`` (0: no groups)."""
    return max(1, g.problem.tokens) if varlen == -1 else varlen


def varlen_groups(tb_len: np.ndarray, home: np.ndarray, key: np.ndarray, limit: int) -> np.ndarray:
    """A group id for every token block: blocks with the same ``home`` and
    the same ``key >= 0`` are packed in position order, greedily, into groups
    of at most ``limit`` tokens (a block longer than ``limit`` alone); a block
    with ``key < 0`` is a group of its own. Ids are numbered by each group's
    first block."""
    n = len(tb_len)
    grp = np.arange(n, dtype=np.int64)
    cand = np.flatnonzero(np.asarray(key) >= 0)
    if len(cand) and limit >= int(tb_len[cand].sum()):  # no cap: one group per (home, key)
        order = cand[np.lexsort((cand, key[cand], home[cand]))]
        new = np.ones(len(order), bool)
        new[1:] = (home[order[1:]] != home[order[:-1]]) | (key[order[1:]] != key[order[:-1]])
        grp[order] = order[np.flatnonzero(new)][np.cumsum(new) - 1]
    elif len(cand):
        order = cand[np.lexsort((cand, key[cand], home[cand]))]
        same = np.zeros(len(order), bool)
        same[1:] = (home[order[1:]] == home[order[:-1]]) & (key[order[1:]] == key[order[:-1]])
        lead, fill = -1, 0
        for tb, cont, size in zip(order.tolist(), same.tolist(), tb_len[order].tolist()):
            if cont and fill + size <= limit:
                fill += size
            else:
                lead, fill = tb, size
            grp[tb] = lead
    first = np.full(n, n, np.int64)
    np.minimum.at(first, grp, np.arange(n))
    used = np.flatnonzero(first < n)
    renum = np.empty(n, np.int64)
    renum[used[np.argsort(first[used], kind="stable")]] = np.arange(len(used))
    return renum[grp]


def group_spans(tb_start: np.ndarray, tb_end: np.ndarray, group: np.ndarray):
    """(tb_ptr, span_start, span_end) of the groups ``group`` (ids ``0..G-1``)
    of the contiguous blocks ``[tb_start, tb_end)``: each group's members in
    position order, adjacent ones merged into one span."""
    group = np.asarray(group, np.int64)
    n = int(group.max()) + 1 if len(group) else 0
    tb = np.lexsort((np.arange(len(group)), group))
    gs = group[tb]
    new_span = np.ones(len(tb), bool)
    new_span[1:] = (gs[1:] != gs[:-1]) | (tb[1:] != tb[:-1] + 1)
    first = np.flatnonzero(new_span)
    last = np.append(first[1:], len(tb)) - 1
    tb_ptr = np.searchsorted(gs[first], np.arange(n + 1)).astype(np.int64)
    return tb_ptr, tb_start[tb[first]].astype(np.int64), tb_end[tb[last]].astype(np.int64)


def group_graph(g: BlockGraph, group: np.ndarray) -> BlockGraph:
    """The graph whose token block ``j`` is the blocks of ``g`` with
    ``group == j`` (ids ``0..G-1``; adjacent members merged into one span),
    its tiles the (mask class, q group, kv group) unions of ``g``'s tiles
    with the same pieces, its compute blocks every tile with every head group
    of its class. A mask piece may meet only one block of each group (true
    when a group holds at most one chunk of a document): else PlanError."""
    if g.grouped:
        raise PlanError("varlen groups: the graph's token blocks are already grouped")
    group = np.asarray(group, np.int64)
    n = int(group.max()) + 1 if len(group) else 0
    tb_ptr, span_start, span_end = group_spans(g.tb_start, g.tb_end, group)
    fine_key = (g.tile_class * n + group[g.tile_q]) * n + group[g.tile_k]  # each fine tile lies in one group tile
    key = np.repeat(fine_key, np.diff(g.tile_ptr))
    porder = np.lexsort((g.piece_src, key))
    key, src = key[porder], g.piece_src[porder]
    dup = np.flatnonzero((key[1:] == key[:-1]) & (src[1:] == src[:-1]))
    if len(dup):
        raise PlanError(f"varlen groups: mask piece {int(src[dup[0]])} meets two blocks of one group "
                        f"(a group may hold one chunk of a document)")
    bound = np.flatnonzero(np.diff(key)) + 1
    tile_ptr = np.concatenate([[0], bound, [len(key)]] if len(key) else [[0]]).astype(np.int64)
    tile_key = key[tile_ptr[:-1]]
    tile_of = np.searchsorted(tile_key, fine_key)  # sums of the fine tiles' exact counts (< 2**53: exact)
    tile_pairs = np.rint(np.bincount(tile_of, weights=g.tile_pairs, minlength=len(tile_key))).astype(np.int64)
    cb_tile, cb_hg = _compute_blocks(tile_key // (n * n), g.hg_class)
    hull_start = span_start[tb_ptr[:-1]]
    hull_end = span_end[tb_ptr[1:] - 1]
    out = BlockGraph(
        problem=g.problem, tb_start=hull_start, tb_end=hull_end, hg_start=g.hg_start, hg_end=g.hg_end,
        tile_q=(tile_key // n) % n, tile_k=tile_key % n, tile_ptr=tile_ptr,
        pieces=np.ascontiguousarray(g.pieces[porder]), piece_src=src, tile_pairs=tile_pairs.astype(np.int64),
        cb_tile=cb_tile, cb_hg=cb_hg, kv_rep=g.kv_rep, tb_ptr=tb_ptr,
        span_start=span_start.astype(np.int64), span_end=span_end.astype(np.int64))
    # from a built graph this is what derive_tiles rebuilds: no mask piece meets two blocks of a group, so
    # the merged spans clip every piece as its own block did
    return built(out) if is_built(g) else out


def group_home(home: np.ndarray, group: np.ndarray) -> np.ndarray:
    """The home of every group: that of its members (PlanError if they differ)."""
    n = int(group.max()) + 1 if len(group) else 0
    out = np.full(n, -1, np.int64)
    out[group] = home
    if not np.array_equal(out[group], home):
        raise PlanError("varlen groups: a group's blocks are homed on different devices")
    return out


def ungroup(g: BlockGraph) -> tuple[BlockGraph, np.ndarray]:
    """For a grouped graph: the contiguous graph of its spans (one token block
    per span, same head groups) and, for each of that graph's compute blocks,
    the compute block of ``g`` that holds its pairs — what a picture of the
    plan draws position by position."""
    ss, _, owner = g.spans()
    order = np.argsort(ss, kind="stable")
    try:
        fine = build_graph(g.problem, ss[order], g.n_hg, g.kv_rep, hg_starts=g.hg_start)
    except PlanError as e:  # a relation graph's pieces were never listed: here they would be
        raise PlanError(f"this plan is drawn span by span, one tile per pair of spans: {e}") from None
    block = owner[order]  # the group of each fine block
    n = g.n_tb
    key = (g.tile_class * n + g.tile_q) * n + g.tile_k
    fine_key = (fine.tile_class * n + block[fine.tile_q]) * n + block[fine.tile_k]
    korder = np.argsort(key, kind="stable")
    tile = korder[np.searchsorted(key[korder], fine_key)]
    cb_key = g.cb_tile * g.n_hg + g.cb_hg
    corder = np.argsort(cb_key, kind="stable")
    cb = corder[np.searchsorted(cb_key[corder], tile[fine.cb_tile] * g.n_hg + fine.cb_hg)]
    return fine, cb.astype(np.int64)


def grouped_graph(problem, tb_ptr: np.ndarray, span_start: np.ndarray, span_end: np.ndarray,
                  hg_start: np.ndarray, kv_rep: int) -> BlockGraph:
    """The grouped graph of these blocks (``tb_ptr`` into the spans) and head
    groups: relation tiles (:mod:`attnplan.ir.relation`, no pieces stored)
    where the mask and the blocks allow, else the contiguous tiling of the
    spans grouped by :func:`group_graph` (its pieces enumerated)."""
    tb_ptr, ss, se = (np.asarray(a, np.int64) for a in (tb_ptr, span_start, span_end))
    n = len(tb_ptr) - 1
    owner = np.repeat(np.arange(n, dtype=np.int64), np.diff(tb_ptr))
    if ((owner[1:] == owner[:-1]) & (ss[1:] == se[:-1])).any():  # a block's adjacent spans are one (as
        order = np.argsort(ss, kind="stable")                    # group_graph makes them): one form per plan
        tb_ptr, ss, se = group_spans(ss[order], se[order], owner[order])
        owner = np.repeat(np.arange(n, dtype=np.int64), np.diff(tb_ptr))
    tab = table(problem, ss, se, owner, n)
    if tab is None:
        order = np.argsort(ss, kind="stable")
        fine = build_graph(problem, ss[order], len(hg_start), kv_rep, hg_starts=hg_start)
        if fine.n_tb != len(order):
            raise PlanError("varlen groups: the spans do not partition the tokens")
        return group_graph(fine, owner[order])
    kv_rep, hs, he, hg_class = graph_head_groups(problem, len(hg_start), kv_rep, hg_start)
    tq, tk = tab.tiles()
    if len(tq) * len(hs) > MAX_TILE_PIECES:  # each tile holds a piece at least: the enumerated tiling's limit
        raise PlanError(f"varlen groups: {len(tq):,} tiles x {len(hs)} head groups, over the limit of "
                        f"{MAX_TILE_PIECES:,} (ir/limits.py MAX_TILE_PIECES)")
    cb_tile, cb_hg = _compute_blocks(np.zeros(len(tq), np.int64), hg_class)
    g = BlockGraph(
        problem=problem, tb_start=ss[tb_ptr[:-1]], tb_end=se[tb_ptr[1:] - 1], hg_start=hs, hg_end=he,
        tile_q=tq, tile_k=tk, tile_ptr=np.zeros(len(tq) + 1, np.int64), pieces=np.zeros((0, 6), np.int64),
        piece_src=np.zeros(0, np.int64), tile_pairs=np.rint(tab.sums(tq, tk)).astype(np.int64),
        cb_tile=cb_tile, cb_hg=cb_hg, kv_rep=kv_rep, tb_ptr=tb_ptr, span_start=ss, span_end=se, relation=True)
    _TABLES[g] = tab
    return built(g)


def derive_tiles(problem, tb_start: np.ndarray, hg_start: np.ndarray, kv_rep: int, tb_ptr: np.ndarray | None = None,
                 span_start: np.ndarray | None = None, span_end: np.ndarray | None = None) -> BlockGraph:
    """The graph that :func:`~attnplan.ir.graph.build_graph` (and, with spans,
    :func:`grouped_graph`) make from these token blocks and head groups: what
    a plan file need not store when its tiles are exactly these
    (:func:`tiles_derived`)."""
    if tb_ptr is None or span_start is None or span_end is None:
        return build_graph(problem, tb_start, len(hg_start), kv_rep, hg_starts=hg_start)
    return grouped_graph(problem, tb_ptr, span_start, span_end, hg_start, kv_rep)


def tiles_derived(g: BlockGraph) -> bool:
    """Whether :func:`derive_tiles` of ``g``'s blocks gives ``g`` exactly:
    true of the graphs build_graph and group_graph made (marked when made),
    else checked by rebuilding."""
    if is_built(g):
        return True
    try:
        d = derive_tiles(g.problem, g.tb_start, g.hg_start, g.kv_rep, g.tb_ptr, g.span_start, g.span_end)
    except PlanError:
        return False
    return all(_same(getattr(d, f), getattr(g, f)) for f in g.__dataclass_fields__ if f != "problem")


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape and np.array_equal(a, b)
    return a == b
