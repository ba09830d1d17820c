"""Mask set operations with a work budget, so that no mask can make lowering
spend unbounded time or memory.

The piece algebra of :mod:`attnplan.ir.mask` subtracts one piece at a time
(a union or complement of ``n`` and ``m`` pieces does about ``n * m`` row
operations) and intersects by testing every pair of bounding boxes. Here
each operation is charged to a :class:`Budget` *before* it runs, in work
units of about one numpy row operation; past ``MAX_MASK_WORK`` units, or
``MAX_MASK_PIECES`` pieces in a result, the operation raises
:class:`LimitExceeded` and the evaluator reports it at the operator.
Intersections run in chunks, so even one whose result is too large stops
after building at most ``MAX_MASK_PIECES`` pieces.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from attnplan.ir.limits import MAX_MASK_PIECES, MAX_MASK_WORK
from attnplan.ir.mask import HI, K0, K1, LO, Q0, Q1, Pieces, normalize, tighten

__all__ = ["Budget", "LimitExceeded", "NODE_COST", "OP_COST", "build_cost", "union", "union_apart", "intersect",
           "complement", "check_pieces", "candidate_pairs"]

# Work units are about one numpy row operation (10-20 ns here); a numpy call's
# fixed overhead is about 100 units.
NODE_COST = 300        # evaluating one expression node (a few microseconds of Python)
OP_COST = 3000         # fixed cost of one piece operation (a few dozen numpy calls)
_ITER_COST = 4000      # Pieces.subtract: fixed cost per subtracted piece (one loop iteration)
_ROW_PASSES = 16       # numpy passes over a row: per subtracted piece, per bounding-box test plus result
_CHUNK = 1 << 20       # bounding-box tests per intersection chunk


class LimitExceeded(Exception):
    """A stated limit would be passed; the message says which and by what."""


class Budget:
    """Work spent so far by every evaluation sharing this budget (one parse, or one batch)."""

    __slots__ = ("work",)

    def __init__(self):
        self.work = 0

    def charge(self, units: int, what: str) -> None:
        self.work += units
        if self.work > MAX_MASK_WORK:
            raise LimitExceeded(f"evaluating the mask needs more than {MAX_MASK_WORK:,} work units "
                                f"(ir/limits.py MAX_MASK_WORK; about one numpy row operation each), "
                                f"the last being {what}; simplify the mask or use fewer distinct samples")


def check_pieces(n: int, what: str) -> None:
    if n > MAX_MASK_PIECES:
        raise LimitExceeded(f"{what} has {n:,} pieces, more than MAX_MASK_PIECES = {MAX_MASK_PIECES:,} "
                            f"(ir/limits.py)")


def _subtract_cost(n: int, m: int) -> int:
    """Work of ``a.subtract(b)`` for ``n`` pieces in ``a`` and ``m`` in ``b``: one loop
    iteration per piece of ``b``, each over (about) the pieces left of ``a``."""
    return OP_COST + m * (_ITER_COST + _ROW_PASSES * (n + m))


def build_cost(pieces: int) -> int:
    """Work of building ``pieces`` pieces directly (a builtin mask)."""
    return OP_COST + _ROW_PASSES * pieces


def _subtract(a: Pieces, b: Pieces, budget: Budget, what: str) -> Pieces:
    """``a.subtract(b)``, charged :func:`_subtract_cost` before it runs and, while it runs, every
    piece it tests beyond what that assumed: pieces that split on every step (a square cut by many
    diagonals) cannot outrun the budget."""
    budget.charge(_subtract_cost(len(a), len(b)), what)
    assumed, tested = len(b) * (len(a) + len(b)), 0

    def charge(rows: int) -> None:
        nonlocal tested
        over = max(0, tested + rows - max(tested, assumed))
        tested += rows
        if over:
            budget.charge(_ROW_PASSES * over, what)
    return a.subtract(b, charge)


def union(a: Pieces, b: Pieces, budget: Budget) -> Pieces:
    """``a | b``, subtracting the operand with fewer pieces from the other."""
    if not len(a) or not len(b):
        return b if not len(a) else a
    small, big = (a, b) if len(a) <= len(b) else (b, a)
    out = Pieces.concat([small, _subtract(big, small, budget, f"a union of {len(a):,} and {len(b):,} pieces")])
    check_pieces(len(out), "the union")
    return out


def _overlap_candidates(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """(order, stop, count): boxes sorted by ``lo``; box ``order[i]``'s range overlaps those of
    ``order[i+1:stop[i]]``, which are every later box whose range overlaps it; ``count`` pairs."""
    order = np.argsort(lo, kind="stable")
    stop = np.searchsorted(lo[order], hi[order], "left")
    return order, stop, int(np.maximum(stop - np.arange(1, len(lo) + 1), 0).sum())


def candidate_pairs(a: np.ndarray, limit: int, budget: Budget, what: str) -> tuple[np.ndarray, np.ndarray] | None:
    """Index pairs ``(x, y)`` of the pieces ``a`` whose bounding boxes overlap (each pair once), found
    by sorting along q or k, whichever pairs fewer candidates; None when both pair more than ``limit``."""
    n = len(a)
    budget.charge(OP_COST + _ROW_PASSES * 4 * n, f"sorting {what}")
    axes = [(*_overlap_candidates(a[:, lo], a[:, hi]), (olo, ohi))
            for (lo, hi), (olo, ohi) in (((Q0, Q1), (K0, K1)), ((K0, K1), (Q0, Q1)))]
    order, stop, count, (olo, ohi) = min(axes, key=lambda x: x[2])
    if count > limit:
        return None
    budget.charge(_ROW_PASSES * count, f"checking {what}")
    first = np.arange(1, n + 1)
    span = np.maximum(stop - first, 0)
    i = np.repeat(np.arange(n), span)
    j = np.arange(int(span.sum())) - np.repeat(np.cumsum(span) - span, span) + first[i]
    x, y = order[i], order[j]
    keep = (a[x, olo] < a[y, ohi]) & (a[y, olo] < a[x, ohi])
    return x[keep], y[keep]


def _apart(values: list, budget: Budget) -> bool:
    """Whether no piece of one operand has a bounding box overlapping a piece of another
    (pieces of one operand may); False, without deciding, when the candidates are too many."""
    a = np.concatenate([v.a for v in values])
    owner = np.repeat(np.arange(len(values)), [len(v) for v in values])
    pairs = candidate_pairs(a, 4 * len(a) + (1 << 20), budget, f"a union of {len(values):,} operands")
    return pairs is not None and not (owner[pairs[0]] != owner[pairs[1]]).any()


def union_apart(values: list, budget: Budget) -> Pieces | None:
    """``values[0] | values[1] | ...`` when no two pieces of different operands have
    overlapping bounding boxes (a union of columns, rows, blocks): nothing is subtracted,
    so folding :func:`union` from the left would only concatenate. This gives the same
    pieces in the same order in O(n log n) instead of O(n^2); None when it does not
    apply (or the result would pass MAX_MASK_PIECES: the fold then names the operator)."""
    total = sum(len(v) for v in values)
    if len(values) < 3 or total > MAX_MASK_PIECES or not _apart(values, budget):
        return None
    blocks: deque = deque()
    size = 0
    for v in values:  # union(acc, v): the operand with fewer pieces first, the other after it
        if not len(v):
            continue
        if size and size <= len(v):
            blocks.append(v)
        else:
            blocks.appendleft(v)
        size += len(v)
    return Pieces.concat(blocks)


def _inside(a: np.ndarray, p: np.ndarray) -> bool:
    """Whether every (canonical) piece of ``a`` lies in the piece ``p``: its
    rectangle inside p's and its band inside p's band (then ``a & p`` is ``a``)."""
    return bool(((a[:, Q0] >= p[Q0]) & (a[:, Q1] <= p[Q1]) & (a[:, K0] >= p[K0]) & (a[:, K1] <= p[K1])
                 & (a[:, LO] >= p[LO]) & (a[:, HI] <= p[HI])).all())


def intersect(a: Pieces, b: Pieces, budget: Budget) -> Pieces:
    """``a & b`` in chunks of ``a``, stopping once the result passes MAX_MASK_PIECES."""
    if not len(a) or not len(b):
        return Pieces.empty()
    if len(a) < len(b):
        a, b = b, a
    if len(a) == 1:  # one piece each (a term of a long union): no chunks, no containment test
        budget.charge(OP_COST + _ROW_PASSES, "an intersection of 1 and 1 pieces")
        return a.intersect(b)
    if len(b) == 1 and _inside(a.a, b.a[0]):  # a constant-true side (``h < 4``), a window inside causal: a itself
        budget.charge(OP_COST + _ROW_PASSES * len(a), "an intersection with a piece that holds the other side")
        return a
    what = f"an intersection of {len(a):,} and {len(b):,} pieces"
    step = max(1, _CHUNK // len(b))
    budget.charge(-(-len(a) // step) * OP_COST + _ROW_PASSES // 2 * len(a) * len(b), what)
    parts, total = [], 0
    for s in range(0, len(a), step):
        part = Pieces(a.a[s:s + step]).intersect(b)
        total += len(part)
        check_pieces(total, "the intersection")
        budget.charge(_ROW_PASSES * len(part), what)
        parts.append(part)
    return Pieces.concat(parts)


def complement(a: Pieces, length: int, budget: Budget) -> Pieces:
    """``!a`` within ``[0, length)^2``: the gaps between the diagonal bands of ``a`` that span the
    square (:func:`whole_bands`: a sliding window, ``(k - q) % 7 == 0``), each gap one band, in
    O(n log n); then every other piece of ``a`` subtracted from them."""
    what = f"a complement of {len(a):,} pieces"
    budget.charge(OP_COST + _ROW_PASSES * 4 * len(a), what)
    whole = whole_bands(a.a, length)
    gaps = _band_gaps(a.a[whole, LO], a.a[whole, HI], length)
    out = _subtract(gaps, Pieces(a.a[~whole]), budget, what) if not whole.all() else gaps
    check_pieces(len(out), "the complement")
    return out


def whole_bands(a: np.ndarray, length: int) -> np.ndarray:
    """Which pieces of ``a`` (normalized) are all of their band ``lo <= k - q <= hi`` in
    ``[0, length)^2``: the band over the whole square normalizes to the piece itself."""
    sq = a.copy()
    sq[:, [Q0, K0]] = 0
    sq[:, [Q1, K1]] = length
    keep = tighten(sq)
    return keep & (sq == a).all(axis=1)


def _band_gaps(lo: np.ndarray, hi: np.ndarray, length: int) -> Pieces:
    """The diagonals of ``[0, length)^2`` in none of the bands ``[lo, hi]``, as bands (normalized)."""
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], np.maximum.accumulate(hi[order]) if len(hi) else hi[order]
    start = np.concatenate([[-(length - 1)], hi + 1])   # a gap opens after each band's reach so far
    stop = np.concatenate([lo - 1, [length - 1]])        # and closes before the next band
    keep = start <= stop
    n = int(keep.sum())
    rows = np.column_stack([np.zeros(n, np.int64), np.full(n, length), np.zeros(n, np.int64), np.full(n, length),
                            start[keep], stop[keep]]).astype(np.int64)
    return Pieces(normalize(rows))
