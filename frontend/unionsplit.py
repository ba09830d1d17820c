"""Unions of many overlapping operands by splitting the plane (a k-d tree).

Folding ``a | b | c | ...`` from the left subtracts each operand from
everything gathered so far: ``n`` operands of one piece cost about ``n^2``
row operations, so a 10,000-term union of rectangles on 4,096 tokens passed
the work budget. Here the operands' pieces are split instead, as a k-d tree
splits points (Bentley, CACM 1975). A cell is done when its pieces come from
one operand or share no pair across operands (then they are disjoint), or
when one piece covers it (then the union there is the cell). Any other cell
is cut in two at the median of the piece edges inside it, the pieces that
cross the cut clipped into both halves, if that thins it (each half at most
80% of its pieces, at most 60% of them cut); a cell that no cut thins, or
that holds few pieces, is folded as before. Cells are disjoint, so their
results concatenate; pieces that a cut divided are joined again where they
line up (:func:`coalesce`).

For ``n`` pieces that a cut mostly separates this does ``O(n log n)`` row
operations instead of ``O(n^2)``; its work is charged to the same
:class:`~.setops.Budget`.
"""

from __future__ import annotations

import numpy as np

from attnplan.ir.mask import HI, INF, K0, K1, LO, Q0, Q1, Pieces, intersect_rows, normalize, piece_counts, tighten

from .setops import _ROW_PASSES, OP_COST, Budget, candidate_pairs, check_pieces, union

__all__ = ["MIN_OPERANDS", "union_split", "coalesce"]

MIN_OPERANDS = 32     # fewer operands fold as before (their pieces, order and all, stay what they were)
_LEAF = 16            # a cell of at most this many pieces is folded
_THIN = 0.8           # a cut must leave each half at most this share of the cell's pieces
_CROSS = 0.6          # and cut at most this share of them in two (else the cell folds)
_PAIRS = 1 << 14      # candidate pairs tested for a shared pair at once


def _covers(a: np.ndarray, box: tuple[int, int, int, int]) -> np.ndarray:
    """Which pieces hold every pair of the cell ``box`` = (q0, q1, k0, k1)."""
    q0, q1, k0, k1 = box
    return ((a[:, Q0] <= q0) & (a[:, Q1] >= q1) & (a[:, K0] <= k0) & (a[:, K1] >= k1)
            & (a[:, LO] <= k0 - (q1 - 1)) & (a[:, HI] >= (k1 - 1) - q0))


def _disjoint(a: np.ndarray, owner: np.ndarray, budget: Budget) -> bool:
    """Whether no two pieces of different operands share a pair (distinct diagonals ``k - q == d`` never
    do, though all their boxes overlap); False, without deciding, when the candidate pairs are too many."""
    pairs = candidate_pairs(a, 4 * len(a) + (1 << 20), budget, f"a union of {len(a):,} pieces")
    if pairs is None:
        return False
    x, y = pairs
    other = np.flatnonzero(owner[x] != owner[y])
    for s in range(0, len(other), _PAIRS):  # pieces that meet are usually found in the first chunk
        i = other[s:s + _PAIRS]
        if tighten(intersect_rows(a[x[i]], a[y[i]])).any():
            return False
    return True


def _cut(a: np.ndarray, box) -> tuple[int, int] | None:
    """(axis column, coordinate) of the cut of a cell: the median piece edge strictly inside the
    cell along its longer side (the other side when that one has none); None when neither has."""
    q0, q1, k0, k1 = box
    for lo_col, hi_col, lo, hi in sorted(((Q0, Q1, q0, q1), (K0, K1, k0, k1)), key=lambda x: x[2] - x[3]):
        edges = np.concatenate([a[:, lo_col], a[:, hi_col]])
        edges = edges[(edges > lo) & (edges < hi)]
        if len(edges):
            return lo_col, int(np.sort(edges)[len(edges) // 2])
    return None


def _clip(a: np.ndarray, owner: np.ndarray, lo_col: int, hi_col: int, lo: int | None, hi: int | None):
    """The pieces of ``a`` (and their owners) clipped to ``lo <= coordinate < hi`` along one axis."""
    keep = np.ones(len(a), bool)
    if lo is not None:
        keep &= a[:, hi_col] > lo
    if hi is not None:
        keep &= a[:, lo_col] < hi
    x, o = a[keep].copy(), owner[keep]
    if lo is not None:
        x[:, lo_col] = np.maximum(x[:, lo_col], lo)
    if hi is not None:
        x[:, hi_col] = np.minimum(x[:, hi_col], hi)
    live = tighten(x)
    return x[live], o[live]


def _fold(a: np.ndarray, owner: np.ndarray, budget: Budget) -> np.ndarray:
    """The union of a cell's pieces, operand by operand (each operand's pieces are disjoint)."""
    order = np.argsort(owner, kind="stable")
    a, owner = a[order], owner[order]
    starts = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])
    acc = Pieces.empty()
    for s, e in zip(starts, np.r_[starts[1:], len(a)]):
        acc = union(acc, Pieces(a[s:e]), budget)
    return acc.a


def _cell(a, owner, box, budget: Budget) -> tuple[np.ndarray | None, list]:
    """(result, sub-cells): the union of a cell's pieces when it is decided here, else its two halves."""
    budget.charge(OP_COST + _ROW_PASSES * len(a), f"splitting a union of {len(a):,} pieces")
    if not len(a) or (owner == owner[0]).all():
        return a, []
    if _disjoint(a, owner, budget):
        return a, []
    if _covers(a, box).any():
        return normalize(np.array([(*box, -INF, INF)], np.int64)), []
    cut = None if len(a) <= _LEAF else _cut(a, box)
    if cut is not None:
        col, at = cut
        lo_col, hi_col = (Q0, Q1) if col == Q0 else (K0, K1)
        halves = [(*_clip(a, owner, lo_col, hi_col, None, at), _half(box, col, None, at)),
                  (*_clip(a, owner, lo_col, hi_col, at, None), _half(box, col, at, None))]
        sizes = [len(h[0]) for h in halves]
        if max(sizes) <= _THIN * len(a) and sum(sizes) <= (1 + _CROSS) * len(a):
            return None, halves
    return _fold(a, owner, budget), []


def _half(box, col: int, lo: int | None, hi: int | None) -> tuple[int, int, int, int]:
    q0, q1, k0, k1 = box
    if col == Q0:
        return (q0 if lo is None else lo, q1 if hi is None else hi, k0, k1)
    return (q0, q1, k0 if lo is None else lo, k1 if hi is None else hi)


def union_split(values: list, budget: Budget) -> Pieces:
    """``values[0] | values[1] | ...`` for pieces sets that are each disjoint (see the module)."""
    unique = {id(v): v.a for v in values if len(v)}  # `x | x | ...` (one value, many terms): taken once
    parts = list(unique.values())
    if not parts:
        return Pieces.empty()
    rows = sum(len(p) for p in parts)
    budget.charge(OP_COST + _ROW_PASSES * 4 * rows, f"sorting a union of {len(values):,} operands")  # before
    a = np.concatenate(parts)                                                     # anything is allocated
    owner = np.repeat(np.arange(len(parts)), [len(p) for p in parts])
    a, first = np.unique(a, axis=0, return_index=True)  # a piece two operands share is taken once
    owner = owner[first]
    box = (int(a[:, Q0].min()), int(a[:, Q1].max()), int(a[:, K0].min()), int(a[:, K1].max()))
    out, total, todo = [], 0, [(a, owner, box)]
    while todo:
        done, halves = _cell(*todo.pop(), budget)
        todo.extend(reversed(halves))
        if done is not None and len(done):
            out.append(done)
            total += len(done)
            check_pieces(total, "the union")
    result = coalesce(np.concatenate(out) if out else np.zeros((0, 6), np.int64))
    check_pieces(len(result), "the union")
    return Pieces(result)


def _join(a: np.ndarray, lo_col: int, hi_col: int, same: list[int]) -> np.ndarray:
    """Join runs of pieces that meet end to start along one axis and agree in the columns ``same``
    (their extent across it, or their band), where one piece — the hull of the run — holds exactly
    their pairs (pair counts prove it; otherwise the run stays as it was)."""
    a = a[np.lexsort([a[:, lo_col], *(a[:, c] for c in reversed(same))])]
    link = (a[1:, same] == a[:-1, same]).all(axis=1) & (a[1:, lo_col] == a[:-1, hi_col])
    starts = np.flatnonzero(np.r_[True, ~link])
    joined = a[starts].copy()
    for c, reduce in ((Q0, np.minimum), (K0, np.minimum), (LO, np.minimum),
                      (Q1, np.maximum), (K1, np.maximum), (HI, np.maximum)):
        joined[:, c] = reduce.reduceat(a[:, c], starts)
    tighten(joined)  # a superset of non-empty pieces: never empty
    exact = piece_counts(joined) == np.add.reduceat(piece_counts(a), starts)
    return np.concatenate([joined[exact], a[np.repeat(~exact, np.diff(np.r_[starts, len(a)]))]])


def coalesce(a: np.ndarray) -> np.ndarray:
    """Disjoint pieces with those that a cut divided joined back: along q, then along k, first those
    with the same extent across the cut (rectangles), then those with the same band (diagonals,
    whose extent across a cut moves with it); the same pairs."""
    for lo_col, hi_col, across in ((Q0, Q1, [K0, K1]), (K0, K1, [Q0, Q1])):
        for same in (across, [LO, HI]):
            if len(a) > 1:
                a = _join(a, lo_col, hi_col, same)
    return a
