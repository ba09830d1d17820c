"""Canonical mask form: disjoint pieces.

A piece is the set of (q, k) with ``q0 <= q < q1``, ``k0 <= k < k1`` and
``lo <= k - q <= hi``: a rectangle intersected with a diagonal band. Full,
causal, sliding-window, inverse-causal and band masks are single pieces; the
family is closed under intersection, and differences split into at most six
pieces, so unions and complements stay disjoint piece lists. A piece's pair
count has a closed form (:func:`piece_counts`), so nothing here ever builds a
dense matrix except :meth:`Pieces.to_dense`, which tests use.

``Pieces`` is columnar: one ``int64`` array of shape ``[n, 6]`` with columns
``q0, q1, k0, k1, lo, hi``. ``INF`` stands for an unbounded band side.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

INF = 1 << 62
Q0, Q1, K0, K1, LO, HI = range(6)
_CHUNK = 1 << 20  # max pairs materialized at once by pairwise ops
_SMALL = 8  # pieces: below this, Python integers beat numpy's per-call overhead (the union of 10,000 terms)


def tighten(a: np.ndarray) -> np.ndarray:
    """Tighten pieces in place (int64 ``[n, 6]``); return the mask of non-empty rows.

    After this, every row ``q`` in ``[q0, q1)`` and every column in ``[k0, k1)``
    of a non-empty piece has at least one allowed pair, and ``lo``/``hi`` are
    finite. Bounds only move inwards, so a row found empty stays empty."""
    if len(a) <= _SMALL:
        return _tighten_rows(a)
    for _ in range(2):
        a[:, LO] = np.maximum(a[:, LO], a[:, K0] - (a[:, Q1] - 1))
        a[:, HI] = np.minimum(a[:, HI], (a[:, K1] - 1) - a[:, Q0])
        a[:, Q0] = np.maximum(a[:, Q0], a[:, K0] - a[:, HI])
        a[:, Q1] = np.minimum(a[:, Q1], a[:, K1] - a[:, LO])
        a[:, K0] = np.maximum(a[:, K0], a[:, Q0] + a[:, LO])
        a[:, K1] = np.minimum(a[:, K1], a[:, Q1] + a[:, HI])
    return (a[:, Q0] < a[:, Q1]) & (a[:, K0] < a[:, K1]) & (a[:, LO] <= a[:, HI])


def tighten_row(q0: int, q1: int, k0: int, k1: int, lo: int, hi: int) -> tuple[int, int, int, int, int, int]:
    """One piece tightened on Python integers: :func:`tighten`'s steps, the same results (every bound is
    within ``±INF``, so no step leaves int64), without numpy's cost per call on a few rows."""
    for _ in range(2):
        lo = max(lo, k0 - (q1 - 1))
        hi = min(hi, (k1 - 1) - q0)
        q0 = max(q0, k0 - hi)
        q1 = min(q1, k1 - lo)
        k0 = max(k0, q0 + lo)
        k1 = min(k1, q1 + hi)
    return q0, q1, k0, k1, lo, hi


def nonempty_row(r: tuple) -> bool:
    """Whether a tightened piece (:func:`tighten_row`) holds a pair."""
    return r[0] < r[1] and r[2] < r[3] and r[4] <= r[5]


def _tighten_rows(a: np.ndarray) -> np.ndarray:
    """:func:`tighten` on a few rows, row by row (:func:`tighten_row`)."""
    rows = [tighten_row(*r) for r in a.tolist()]
    if rows:
        a[:] = rows
    return np.array([nonempty_row(r) for r in rows], dtype=bool)


def tight(a: np.ndarray) -> bool:
    """Whether every row of the pieces ``a`` is already what :func:`normalize`
    makes of it: non-empty, and no bound :func:`tighten` would move (one of
    its steps leaving every bound in place is its fixed point; bounds only
    move inwards, so a moved one never comes back) — comparisons, no copy."""
    q0, q1, k0, k1, lo, hi = (a[:, i] for i in range(6))
    return bool(((q0 < q1) & (k0 < k1) & (lo <= hi) & (lo >= k0 - (q1 - 1)) & (hi <= (k1 - 1) - q0)
                 & (q0 >= k0 - hi) & (q1 <= k1 - lo) & (k0 >= q0 + lo) & (k1 <= q1 + hi)).all())


def normalize(a: np.ndarray) -> np.ndarray:
    """A tightened copy of the pieces ``a`` without the empty ones (see :func:`tighten`)."""
    a = np.array(a, dtype=np.int64, copy=True).reshape(-1, 6)
    return a[tighten(a)]


def piece_counts(a: np.ndarray) -> np.ndarray:
    """Exact number of allowed pairs of each *normalized* piece (closed form)."""
    q0, q1, k0, k1, lo, hi = (a[:, i] for i in range(6))
    n = q1 - q0
    # sum over q of upper(q) = min(k1 - 1, q + hi): q + hi for q <= k1 - 1 - hi
    m = np.clip(k1 - hi, q0, q1)
    upper = (q0 + m - 1) * (m - q0) // 2 + (m - q0) * hi + (q1 - m) * (k1 - 1)
    # sum over q of lower(q) = max(k0, q + lo): q + lo for q >= k0 - lo
    m2 = np.clip(k0 - lo, q0, q1)
    lower = (m2 - q0) * k0 + (m2 + q1 - 1) * (q1 - m2) // 2 + (q1 - m2) * lo
    return upper - lower + n


def _pairwise(a: np.ndarray, b: np.ndarray):
    """Index pairs (i, j) whose bounding boxes overlap, chunked to bound memory."""
    ii, jj = [], []
    step = max(1, _CHUNK // max(1, len(b)))
    for s in range(0, len(a), step):
        x = a[s:s + step]
        hit = ((x[:, None, Q0] < b[None, :, Q1]) & (b[None, :, Q0] < x[:, None, Q1])
               & (x[:, None, K0] < b[None, :, K1]) & (b[None, :, K0] < x[:, None, K1]))
        i, j = np.nonzero(hit)
        ii.append(i + s)
        jj.append(j)
    if not ii:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(ii), np.concatenate(jj)


def intersect_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Row-wise intersections of the pieces ``x[i]`` and ``y[i]`` (untightened: :func:`tighten` finds empties)."""
    out = np.empty_like(x)
    out[:, [Q0, K0, LO]] = np.maximum(x[:, [Q0, K0, LO]], y[:, [Q0, K0, LO]])
    out[:, [Q1, K1, HI]] = np.minimum(x[:, [Q1, K1, HI]], y[:, [Q1, K1, HI]])
    return out


def _meets(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Whether each piece of ``a`` shares an allowed pair with the piece ``b`` (their intersection, a
    piece too, is not empty). Subtracting ``b`` from a piece it does not meet would only cut the piece
    into parts: a union of many diagonals (``k - q == d | ...``) fragmented so into tens of thousands."""
    x = a.copy()
    x[:, [Q0, K0, LO]] = np.maximum(x[:, [Q0, K0, LO]], b[[Q0, K0, LO]])
    x[:, [Q1, K1, HI]] = np.minimum(x[:, [Q1, K1, HI]], b[[Q1, K1, HI]])
    return tighten(x)


def _subtract_one(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a \\ b for every row of ``a`` against the single piece ``b`` (six disjoint parts)."""
    parts = []
    # rows above and below b's rows
    p = a.copy(); p[:, Q1] = np.minimum(p[:, Q1], b[Q0]); parts.append(p)
    p = a.copy(); p[:, Q0] = np.maximum(p[:, Q0], b[Q1]); parts.append(p)
    inside = a.copy()
    inside[:, Q0] = np.maximum(inside[:, Q0], b[Q0])
    inside[:, Q1] = np.minimum(inside[:, Q1], b[Q1])
    # columns left and right of b's columns, within b's rows
    p = inside.copy(); p[:, K1] = np.minimum(p[:, K1], b[K0]); parts.append(p)
    p = inside.copy(); p[:, K0] = np.maximum(p[:, K0], b[K1]); parts.append(p)
    inside[:, K0] = np.maximum(inside[:, K0], b[K0])
    inside[:, K1] = np.minimum(inside[:, K1], b[K1])
    # inside b's rectangle, outside its band
    p = inside.copy(); p[:, HI] = np.minimum(p[:, HI], b[LO] - 1); parts.append(p)
    p = inside.copy(); p[:, LO] = np.maximum(p[:, LO], b[HI] + 1); parts.append(p)
    return normalize(np.concatenate(parts))


def _ranges(first: np.ndarray, stop: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(owner, value) of every element of the ranges ``[first[i], stop[i])``."""
    n = np.maximum(stop - first, 0)
    owner = np.repeat(np.arange(len(first), dtype=np.int64), n)
    value = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n) + first[owner]
    return owner, value


def _first_hit(a: np.ndarray, i: np.ndarray, j: np.ndarray) -> tuple[int, int] | None:
    """The first candidate pair ``(i[x], j[x])`` whose pieces share a pair, chunked to bound memory."""
    for s in range(0, len(i), _CHUNK):
        x, y = i[s:s + _CHUNK], j[s:s + _CHUNK]
        hit = np.flatnonzero(tighten(intersect_rows(a[x], a[y])))
        if len(hit):
            return int(x[hit[0]]), int(y[hit[0]])
    return None


def _row_overlap_pairs(s: np.ndarray, budget: int):
    """Pairs of pieces (sorted by q0) whose row ranges overlap, or None if
    there are more than ``budget`` of them."""
    n = len(s)
    stop = np.searchsorted(s[:, Q0], s[:, Q1], "left")  # pieces starting before this one's rows end
    first = np.arange(1, n + 1, dtype=np.int64)
    if int((stop - first).clip(0).sum()) > budget:
        return None
    return _ranges(first, stop)


def _sweep_pairs(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The pairs a row sweep finds adjacent (Shamos–Hoey): O(n log n) candidates
    that include an overlapping pair whenever one exists.

    On row q a normalized piece covers the key interval
    ``[max(k0, q + lo), min(k1 - 1, q + hi)]`` (never empty), whose ends move
    by 0 or 1 per row. Disjoint pieces therefore keep their left-to-right
    order on every row they share. The sweep keeps the active pieces ordered
    by left end; a piece is compared with its neighbours when it starts, and
    the two pieces that become neighbours when one ends are compared. If all
    those pairs are disjoint, every row's intervals stay sorted and disjoint,
    so the pieces are; the pairs are checked exactly by the caller."""
    from bisect import bisect_left

    q0, q1, k0, lo = (s[:, c].tolist() for c in (Q0, Q1, K0, LO))
    n = len(q0)
    rows = np.concatenate([s[:, Q1], s[:, Q0]])
    kind = np.repeat(np.array([0, 1], np.int8), n)          # ends (0) before starts (1) on the same row
    order = np.lexsort((kind, rows))
    active: list[int] = []
    pi: list[int] = []
    pj: list[int] = []
    for e in order.tolist():
        p, start = e % n, e >= n
        r = q0[p] if start else q1[p] - 1                   # a piece ending at q1 is compared on its last row
        pos = bisect_left(active, max(k0[p], r + lo[p]), key=lambda x: max(k0[x], r + lo[x]))
        if start:
            active.insert(pos, p)
            if pos:
                pi.append(active[pos - 1])
                pj.append(p)
            if pos + 1 < len(active):
                pi.append(p)
                pj.append(active[pos + 1])
            continue
        if pos >= len(active) or active[pos] != p:          # out of order: an overlap, found by the checks
            pos = active.index(p)
        del active[pos]
        if 0 < pos < len(active):
            pi.append(active[pos - 1])
            pj.append(active[pos])
    return np.asarray(pi, np.int64), np.asarray(pj, np.int64)


def first_overlap(a: np.ndarray) -> tuple[int, int] | None:
    """Two pieces of the normalized pieces ``a`` that share a (q, k) pair, or
    None when they are pairwise disjoint. Pieces are sorted by first row; when
    few pairs of them share rows (the usual case: pieces of different samples
    never do) those pairs are checked directly, otherwise a row sweep
    (:func:`_sweep_pairs`) picks O(n) candidate pairs: O(n log n) either way."""
    n = len(a)
    if n < 2:
        return None
    order = np.lexsort((a[:, K0], a[:, Q0]))
    s = a[order]
    pairs = _row_overlap_pairs(s, budget=4 * n + _CHUNK)
    hit = _first_hit(s, *(pairs if pairs is not None else _sweep_pairs(s)))
    if hit is None:
        return None
    i, j = sorted((int(order[hit[0]]), int(order[hit[1]])))
    return i, j


@dataclass(frozen=True, slots=True, eq=False)
class Pieces:
    """A disjoint set of mask pieces, columnar (``a``: int64 ``[n, 6]``)."""

    a: np.ndarray

    def __post_init__(self):
        self.a.setflags(write=False)

    # construction ---------------------------------------------------------
    @staticmethod
    def of(rows) -> Pieces:
        """Pieces from raw rows ``(q0, q1, k0, k1, lo, hi)``; tightens and drops empties.
        The rows must already be pairwise disjoint."""
        return Pieces(normalize(np.asarray(rows, dtype=np.int64).reshape(-1, 6)))

    @staticmethod
    def empty() -> Pieces:
        return Pieces(np.zeros((0, 6), np.int64))

    @staticmethod
    def rect(q0, q1, k0, k1, lo=-INF, hi=INF) -> Pieces:
        return Pieces.of([(q0, q1, k0, k1, lo, hi)])

    @staticmethod
    def concat(parts) -> Pieces:
        """Union of piece sets that are known to be disjoint from each other."""
        arrs = [p.a for p in parts if len(p.a)]
        return Pieces(np.concatenate(arrs)) if arrs else Pieces.empty()

    # queries ----------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.a)

    def counts(self) -> np.ndarray:
        return piece_counts(self.a)

    def pair_count(self) -> int:
        return int(self.counts().sum())

    def __eq__(self, other) -> bool:
        return isinstance(other, Pieces) and np.array_equal(self.sorted().a, other.sorted().a)

    def __hash__(self):  # pragma: no cover - unhashable on purpose
        raise TypeError("Pieces is not hashable")

    def sorted(self) -> Pieces:
        order = np.lexsort(self.a.T[::-1])
        return Pieces(self.a[order])

    # algebra ----------------------------------------------------------------
    def shift(self, offset: int) -> Pieces:
        a = self.a.copy()
        a[:, :4] += offset
        return Pieces(a)

    def intersect(self, other: Pieces) -> Pieces:
        if len(self.a) == 1 == len(other.a):  # one piece each (a term of a long union): Python integers
            x, y = self.a[0].tolist(), other.a[0].tolist()
            r = tighten_row(max(x[Q0], y[Q0]), min(x[Q1], y[Q1]), max(x[K0], y[K0]), min(x[K1], y[K1]),
                            max(x[LO], y[LO]), min(x[HI], y[HI]))
            return Pieces(np.array([r] if nonempty_row(r) else [], np.int64).reshape(-1, 6))
        i, j = _pairwise(self.a, other.a)
        return Pieces(normalize(intersect_rows(self.a[i], other.a[j])))

    def subtract(self, other: Pieces, charge=None) -> Pieces:
        """The pairs of this set not in ``other``, one piece of ``other`` at a time. ``charge``, if
        given, is called with the pieces each step tests (a caller's work budget)."""
        cur = self.a
        for b in other.a:
            if not len(cur):
                break
            if charge is not None:
                charge(len(cur))
            hit = ((cur[:, Q0] < b[Q1]) & (b[Q0] < cur[:, Q1])
                   & (cur[:, K0] < b[K1]) & (b[K0] < cur[:, K1]))
            if hit.any():
                idx = np.flatnonzero(hit)
                hit[idx[~_meets(cur[idx], b)]] = False  # boxes that overlap but share no pair are left whole
            if hit.any():
                cur = np.concatenate([cur[~hit], _subtract_one(cur[hit], b)])
        return Pieces(np.ascontiguousarray(cur))

    def union(self, other: Pieces) -> Pieces:
        return Pieces.concat([self, other.subtract(self)])

    def complement(self, length: int) -> Pieces:
        """The pairs of ``[0, length)^2`` not in this set."""
        return Pieces.rect(0, length, 0, length).subtract(self)

    def clip(self, q0, q1, k0, k1) -> Pieces:
        return self.intersect(Pieces.rect(q0, q1, k0, k1))

    # views (tests, pictures) ---------------------------------------------------
    def to_dense(self, size: int) -> np.ndarray:
        """Boolean ``[size, size]`` matrix. For tests and small pictures only."""
        m = np.zeros((size, size), dtype=bool)
        for q0, q1, k0, k1, lo, hi in self.a.tolist():  # each piece written inside its rectangle only
            q0, q1, k0, k1 = max(q0, 0), min(q1, size), max(k0, 0), min(k1, size)
            d = np.arange(k0, k1)[None, :] - np.arange(q0, q1)[:, None]
            if d.size:
                m[q0:q1, k0:k1] |= (d >= lo) & (d <= hi)
        return m

    def to_string(self, size: int, width: int = 64) -> str:
        """ASCII picture, one text row per query row (or per cell of rows when
        ``size > width``): '#' all allowed, '+' mostly, '.' some, ' ' none."""
        cell = max(1, -(-size // width))
        n = -(-size // cell)
        frac = np.zeros((n, n))
        for q0, q1, k0, k1, lo, hi in self.a:
            for r in range(q0 // cell, (q1 - 1) // cell + 1):
                for c in range(k0 // cell, (k1 - 1) // cell + 1):
                    box = normalize(np.array([[max(q0, r * cell), min(q1, (r + 1) * cell),
                                               max(k0, c * cell), min(k1, (c + 1) * cell), lo, hi]]))
                    frac[r, c] += piece_counts(box).sum()
        area = np.full((n, n), float(cell * cell))
        tail = size - (n - 1) * cell
        area[-1, :] *= tail / cell
        area[:, -1] *= tail / cell
        frac /= area
        chars = np.where(frac >= 1 - 1e-9, "#", np.where(frac > 0.5, "+", np.where(frac > 0, ".", " ")))
        return "\n".join("".join(row) for row in chars)
