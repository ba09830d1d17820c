"""Placing segments: most strategies are *cut points and devices*: the packed
token axis is cut into segments ``[starts[i], starts[i+1])`` and segment ``i``
is homed on ``devices[i]``; compute runs where Q lives. :func:`place_segments`
is that shared tail (re-tile at the cuts, home every token block by its
segment, place compute blocks, clear the levels below), so a strategy only
computes its segments."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..errors import PlanError
from .graph import BlockGraph, block_bounds, build_graph, graph_head_groups
from .groups import group_home, group_spans, grouped_graph, varlen_groups
from .module import PlanIR
from .placement import Placement


def chunk_bounds(tokens: int, chunks: int) -> np.ndarray:
    """``chunks + 1`` boundaries of an even split of ``[0, tokens)`` (sizes differ
    by at most one; chunks are empty when ``chunks > tokens``)."""
    return (np.arange(chunks + 1, dtype=np.int64) * tokens) // chunks


def zigzag_device(chunk, n: int) -> np.ndarray:
    """Device of zigzag chunk ``chunk`` of 2n: chunk j on device j, or 2n-1-j in the second half."""
    chunk = np.asarray(chunk, dtype=np.int64)
    return np.where(chunk < n, chunk, 2 * n - 1 - chunk)


def segment_home(tb_start: np.ndarray, starts: np.ndarray, devices: np.ndarray) -> np.ndarray:
    """Device of every token block: that of the last segment starting at or
    before the block's start. Equal starts (empty segments) resolve to the last
    of them, the non-empty one. The token blocks must not cross a segment start
    (re-tile at ``starts`` first)."""
    return np.asarray(devices, np.int64)[np.searchsorted(starts, tb_start, "right") - 1]


def _grouped(ir: PlanIR, cuts: np.ndarray, head, starts: np.ndarray, devices: np.ndarray, key: np.ndarray,
             limit: int) -> tuple[BlockGraph, np.ndarray]:
    """The grouped graph and its homes (see place_segments): the contiguous
    blocks at ``cuts`` are homed and packed into varlen groups before any
    tile is made, so the pieces of the contiguous tiling are never enumerated
    when the groups' tiles are relations (:func:`grouped_graph`)."""
    if key.shape != starts.shape:
        raise PlanError(f"placement: {key.shape} group keys for {starts.shape} segments")
    p = ir.problem
    tb_start, tb_end = block_bounds(p, cuts)
    home = segment_home(tb_start, starts, devices)
    seg = np.searchsorted(starts, tb_start, "right") - 1
    group = varlen_groups(tb_end - tb_start, home, key[seg], limit)
    n_hg, kv_rep, hg_starts = head
    kv_rep, hs, _, _ = graph_head_groups(p, n_hg, kv_rep, hg_starts)
    tb_ptr, span_start, span_end = group_spans(tb_start, tb_end, group)
    g = grouped_graph(p, tb_ptr, span_start, span_end, hs, kv_rep)
    return g, group_home(home, group)


def q_home(graph: BlockGraph, home: np.ndarray) -> np.ndarray:
    """Compute where Q lives: the home of every compute block's Q block."""
    return home[graph.cb_q]


def _check_segments(starts: np.ndarray, devices: np.ndarray, tokens: int, n: int) -> None:
    """Segments must be sorted, start at 0, lie in ``[0, tokens)`` and name devices in ``[0, n)``."""
    if starts.ndim != 1 or starts.shape != devices.shape:
        raise PlanError(f"placement: {starts.shape} segment starts but {devices.shape} devices; need one device "
                        f"per segment start")
    if not len(starts) or starts[0] != 0:
        raise PlanError(f"placement: the first segment must start at token 0, got "
                        f"{starts[:1].tolist() or 'no segments'}")
    if (np.diff(starts) < 0).any() or (tokens and starts[-1] >= tokens):
        raise PlanError(f"placement: segment starts must be sorted and below {tokens} tokens")
    bad = devices[(devices < 0) | (devices >= n)]
    if len(bad):
        raise PlanError(f"placement: a segment is homed on device {int(bad[0])}, outside [0, {n})")


def place_segments(ir: PlanIR, starts, devices, *, extra_cuts=None, head_groups: int | None = None,
                   kv_rep: int | None = None,
                   compute: Callable[[BlockGraph, np.ndarray], np.ndarray] | None = None,
                   group_key=None, group_tokens: int = 0) -> PlanIR:
    """The placement tail of a cut-based strategy.

    ``starts`` (sorted, the first 0) cut the packed axis into segments;
    segment ``i`` — ``[starts[i], starts[i+1])``, the last one up to the end —
    is homed on ``devices[i]``. Steps:

    1. re-tile ``ir.graph`` at its own cuts plus ``starts`` and ``extra_cuts``,
       with ``head_groups`` head groups over ``kv_rep`` copies of the kv heads
       (default: the graph's);
    2. home every token block on its segment's device (:func:`segment_home`);
    3. place every compute block: ``compute(graph, home)``, by default where
       its Q lives (:func:`q_home`);
    4. return ``ir`` with the new graph and placement; the schedule and the
       program are cleared (:meth:`PlanIR.with_levels`).

    ``group_key`` (one per segment) and ``group_tokens > 0``: after step 2,
    the token blocks of the segments with a key ``>= 0`` are packed into
    varlen groups of at most ``group_tokens`` tokens per (device, key), in
    position order (:mod:`attnplan.ir.groups`; the blocks of one segment
    that land in one group merge into one span); a strategy gives the same
    key only to segments of different documents (per_doc: the chunk's column)."""
    if ir.graph is None:
        raise PlanError("placement: no block graph to re-tile; run the tile pass first")
    starts = np.asarray(starts, np.int64)
    devices = np.asarray(devices, np.int64)
    _check_segments(starts, devices, ir.problem.tokens, ir.devices)
    cuts = [ir.graph.cuts, starts]
    if extra_cuts is not None:
        cuts.append(np.asarray(extra_cuts, np.int64))
    old = ir.graph
    keep = head_groups is None and kv_rep is None  # the graph's own head groups (class cuts included)
    head = (old.n_hg if head_groups is None else head_groups, old.kv_rep if kv_rep is None else kv_rep,
            old.hg_start if keep else None)
    if group_key is not None and group_tokens > 0:
        g, home = _grouped(ir, np.concatenate(cuts), head, starts, devices, np.asarray(group_key, np.int64),
                           group_tokens)
    else:
        g = build_graph(ir.problem, np.concatenate(cuts), head[0], head[1], hg_starts=head[2])
        home = segment_home(g.tb_start, starts, devices)
    cb_device = np.array((compute or q_home)(g, home), np.int64)  # a fresh array the Placement owns
    if cb_device.shape != (g.n_cb,):
        raise PlanError(f"placement: {cb_device.shape} compute devices for {g.n_cb} compute blocks")
    pl = Placement(devices=ir.devices, nodes=ir.nodes, home=home, cb_device=cb_device)
    return ir.with_levels(graph=g, placement=pl)
