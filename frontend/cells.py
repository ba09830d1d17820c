"""Lowering comparisons with floors (``q // W == k // W``, ``(k - q) % d == 0``,
``-1 <= q % W - k % W <= 1``) to exact disjoint pieces.

A comparison ``E OP 0`` (one link of a chain; a chain is lowered as one
conjunction) has ``E = a*q + b*k + c + sum(coef * floor((s*x + t) / m))``
with x one of q, k, d = k - q (see :mod:`.periodic`). Every floor is constant
between its breakpoints, so the positions split into *segments*: along q,
along k, or along the diagonal d. Two families:

* floors of q and/or k: the sample's square is a grid of cells
  (q segment x k segment). Inside a cell E is linear, ``a*q + b*k + C``, and
  ``a*q + b*k`` must be a row (b = 0), a column (a = 0) or a band (a = -b)
  condition: the cell intersected with it is one piece. ``E = f(q) + g(k) + c``
  is separable, so a cell's range of E is exact from its two segments, and
  cells are *full* (every pair holds), *partial* or *empty*. When g (or f) is
  monotone (``q // W == k // W``, ``k // W <= q // W + 1``), the full and
  partial cells of a q segment are contiguous runs found by binary search:
  work and pieces grow with the number of segments (L / period), not with
  the grid. Otherwise (``q % W <= k % W``) every cell is looked at: work and
  pieces grow with (L / period)^2 — write ``(k - q) % W == 0`` rather than
  ``q % W == k % W`` (the same mask in 2L/W pieces instead of (L/W)^2).
* floors of d: segments are diagonal bands, one piece each (2L / period).

A full run of cells is one rectangle, and adjacent pieces that differ in one
bound only are merged, so ``q // W < 3`` is one piece. Counts of segments and
cells are known before anything is built: the work is charged to the
:class:`~.setops.Budget` and the pieces checked against ``MAX_MASK_PIECES``
first, so a huge sample with a tiny period is one clear error, in bounded
time. Values stay in int64: a comparison whose terms could pass 2^61 on this
sample is refused (:class:`TermError`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fractions import Fraction

import numpy as np

from attnplan.ir.limits import MAX_MASK_PIECES
from attnplan.ir.mask import HI, INF, K0, K1, LO, Q0, Q1, Pieces

from . import setops
from .periodic import TermError, term_parts
from .setops import OP_COST, Budget, LimitExceeded
from .stdlib import fmt_number, merge_rows
from .values import FLIP, UNKNOWN, Lin, fmt_lin

__all__ = ["check_form", "lower_chain"]

_PASSES = 16          # numpy passes per row built (as setops' _ROW_PASSES)
_CELL_PASSES = 6      # per condition, per cell classified in the full grid
_CHUNK = 1 << 20      # cells classified at once
_RANGE = 1 << 61      # |a term| allowed on a sample (int64 with room for sums)
_OPS = {"<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal, "==": np.equal,
        "!=": np.not_equal}


@dataclass(frozen=True, slots=True)
class Cond:
    """``a*q + b*k + c + sum(coef * floor((s*x + t) // m)) OP 0`` in integers."""
    op: str
    a: int
    b: int
    c: int
    atoms: tuple  # ((var, s, t, m, coef), ...)

    def negated(self) -> "Cond":
        return Cond(FLIP[self.op], -self.a, -self.b, -self.c,
                    tuple((v, s, t, m, -coef) for v, s, t, m, coef in self.atoms))

    def uses(self, var: str) -> bool:
        return any(v == var for v, *_ in self.atoms)


# ------------------------------------------------------------------ forms

def check_form(e, op: str) -> None:
    """TermError unless ``e OP 0`` is lowerable (unknown parts are checked when lowering)."""
    cq, ck, c, terms = term_parts(e)
    found = {f.var for f, _ in terms}
    if "d" in found and found & {"q", "k"}:
        raise TermError("this comparison takes `//` or `%` of `k - q` and also of q or k; a comparison may "
                        "use floors of `k - q`, or of q and k, not both (compare them separately, joined "
                        "with `&` or `|`)")
    if cq is UNKNOWN or ck is UNKNOWN or (cq, ck) == (0, 0) or cq == 0 or ck == 0 or cq == -ck:
        return
    raise TermError(f"with its floors (`//`, `%`) held fixed this comparison is `{fmt_lin(Lin(cq, ck, 0))} + ... "
                    f"{op} 0`, which is not of the form `k - q OP c`, `k OP c` or `q OP c`")


def _cond(e, op: str, L: int) -> Cond:
    """The comparison ``e OP 0`` in integers, scaled and bounded for int64 on a sample of length L."""
    check_form(e, op)
    cq, ck, c, terms = term_parts(e)
    values = [Fraction(cq), Fraction(ck), Fraction(c)] + [Fraction(coef) for _, coef in terms]
    den = math.lcm(*(v.denominator for v in values))
    ints = [int(v * den) for v in values]
    g = math.gcd(*ints) or 1
    a, b, c0, *coefs = (x // g for x in ints)
    rest = (abs(a) + abs(b) + sum(abs(x) for x in coefs)) * (L + 1)
    if rest > _RANGE:
        raise TermError(f"the terms of this comparison reach {rest:,} on a sample of length {L}; "
                        f"numbers in a mask are at most 2^62 in magnitude")
    c0 = max(-rest - 1, min(rest + 1, c0))  # same truth everywhere, and no int64 overflow
    atoms = tuple((f.var, f.s, int(f.b), int(f.m), coef) for (f, _), coef in zip(terms, coefs))
    return Cond(op, a, b, c0, atoms)


# --------------------------------------------------------------- segments

def _segments(L: int, var: str, conds, budget: Budget) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of the segments of ``var``'s range where every floor of it is constant."""
    lo, hi = (-(L - 1), L) if var == "d" else (0, L)
    atoms = sorted({(s, t, m) for c in conds for v, s, t, m, _ in c.atoms if v == var})
    count = 1 + sum((hi - lo) // m + 1 for _, _, m in atoms)
    if count > MAX_MASK_PIECES:
        s, t, m = min(atoms, key=lambda x: x[2])
        raise LimitExceeded(f"`//` and `%` of `{'k - q' if var == 'd' else var}` with period {fmt_number(m)} cut a "
                            f"sample of length {L:,} into {count:,} segments, more than MAX_MASK_PIECES = "
                            f"{MAX_MASK_PIECES:,} (ir/limits.py); pieces grow with L / period")
    budget.charge(OP_COST + _PASSES * count, f"cutting {var} into {count:,} periods")
    parts = [np.array([lo], dtype=np.int64)]
    for s, t, m in atoms:
        first = lo + ((-t - lo) % m if s == 1 else (t + 1 - lo) % m)
        parts.append(np.arange(first if first > lo else first + m, hi, m, dtype=np.int64))
    starts = np.unique(np.concatenate(parts))
    return starts, np.append(starts[1:], hi)


def _floors(cond: Cond, var: str, starts: np.ndarray) -> np.ndarray:
    """The floors of ``var`` in ``cond``, summed, on each segment."""
    out = np.zeros(len(starts), dtype=np.int64)
    for v, s, t, m, coef in cond.atoms:
        if v == var:
            out += coef * ((s * starts + t) // m)
    return out


def _span(slope: int, base: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(min, max) of ``slope * x + base`` over each segment [start, end)."""
    x0, x1 = slope * starts + base, slope * (ends - 1) + base
    return np.minimum(x0, x1), np.maximum(x0, x1)


# ---------------------------------------------------------------- constraints

def _solve(coef: int, C: np.ndarray, op: str, L: int) -> tuple[np.ndarray, np.ndarray]:
    """Integer x with ``coef*x + C OP 0`` (coef != 0) as [lo, hi], clamped to just outside the sample."""
    if coef < 0:
        coef, C, op = -coef, -C, FLIP[op]
    big = np.full(len(C), L + 1, dtype=np.int64)
    lo, hi = -big, big
    if op == "<":
        hi = (-C - 1) // coef
    elif op == "<=":
        hi = -C // coef
    elif op == ">":
        lo = -C // coef + 1
    elif op == ">=":
        lo = -(C // coef)
    else:  # ==
        lo, hi = -(C // coef), -C // coef
    return np.clip(lo, -(L + 1), L + 1), np.clip(hi, -(L + 1), L + 1)


def _constrain(rows: np.ndarray, cond: Cond, C: np.ndarray, L: int) -> None:
    """Intersect every raw row with ``a*q + b*k + C OP 0`` (C per row), in place."""
    a, b = cond.a, cond.b
    if a == 0 and b == 0:
        fails = ~_OPS[cond.op](C, 0)
        rows[fails, Q1] = rows[fails, Q0]
        return
    coef, (c0, c1) = (a, (Q0, Q1)) if b == 0 else (b, (K0, K1)) if a == 0 else (b, (LO, HI))
    lo, hi = _solve(coef, C, cond.op, L)
    rows[:, c0] = np.maximum(rows[:, c0], lo)
    if c1 == HI:
        rows[:, HI] = np.minimum(rows[:, HI], hi)
    else:
        rows[:, c1] = np.minimum(rows[:, c1], hi + 1)


def _raw(q0, q1, k0, k1, lo=-INF, hi=INF) -> np.ndarray:
    cols = np.broadcast_arrays(*[np.asarray(x, dtype=np.int64) for x in (q0, q1, k0, k1, lo, hi)])
    return np.stack(cols, axis=-1).reshape(-1, 6).copy()


# ------------------------------------------------------------------ the grid

@dataclass(frozen=True, slots=True)
class _Axis:
    starts: np.ndarray
    ends: np.ndarray

    def __len__(self):
        return len(self.starts)


def _ranges_for(op: str, omin, omax, imin, imax, c) -> tuple:
    """(full, candidate) inner index ranges per outer segment for one condition whose
    inner function is non-decreasing (imin, imax sorted): E = outer + inner + c."""
    n = np.full(len(omin), len(imin), dtype=np.int64)
    zero = np.zeros(len(omin), dtype=np.int64)
    lt_max = np.searchsorted(imax, -(omax + c), "left")    # cells with Emax < 0
    lt_min = np.searchsorted(imin, -(omin + c), "left")    # Emin < 0
    le_max = np.searchsorted(imax, -(omax + c), "right")   # Emax <= 0
    le_min = np.searchsorted(imin, -(omin + c), "right")   # Emin <= 0
    return {"<": ((zero, lt_max), (zero, lt_min)), "<=": ((zero, le_max), (zero, le_min)),
            ">": ((le_min, n), (le_max, n)), ">=": ((lt_min, n), (lt_max, n)),
            "==": ((lt_min, le_max), (lt_max, le_min))}[op]


def _monotone(conds, inner_var: str):
    """The conditions oriented so that their inner part (``inner_var``'s terms) never
    decreases, or None when some inner part is not monotone."""
    out = []
    for c in conds:
        lin = c.b if inner_var == "k" else c.a
        slopes = [lin] + [coef * s for v, s, _, _, coef in c.atoms if v == inner_var]
        if all(x >= 0 for x in slopes):
            out.append(c)
        elif all(x <= 0 for x in slopes):
            out.append(c.negated())
        else:
            return None
    return out


def _parts(cond: Cond, var: str, axis: _Axis):
    """(slope, floors per segment, min, max) of ``cond``'s terms in ``var`` on ``axis``."""
    slope = cond.a if var == "q" else cond.b
    base = _floors(cond, var, axis.starts)
    return slope, base, *_span(slope, base, axis.starts, axis.ends)


def _sorted_cells(L, conds, outer: str, axes: dict, budget: Budget):
    """(full runs as raw rows, partial cells as (q index, k index)) when the inner parts are monotone."""
    inner = "k" if outer == "q" else "q"
    ao, ai = axes[outer], axes[inner]
    budget.charge(OP_COST + _PASSES * len(conds) * (len(ao) + len(ai)), "classifying periodic cells")
    f0 = c0 = np.zeros(len(ao), dtype=np.int64)
    f1 = c1 = np.full(len(ao), len(ai), dtype=np.int64)
    for cond in conds:
        _, _, omin, omax = _parts(cond, outer, ao)
        _, _, imin, imax = _parts(cond, inner, ai)
        (g0, g1), (h0, h1) = _ranges_for(cond.op, omin, omax, imin, imax, cond.c)
        f0, f1, c0, c1 = np.maximum(f0, g0), np.minimum(f1, g1), np.maximum(c0, h0), np.minimum(c1, h1)
    full = f0 < f1
    c1 = np.maximum(c0, c1)
    left_end = np.where(full, np.clip(f0, c0, c1), c1)
    right_start = np.where(full, np.clip(f1, c0, c1), c1)
    partial = (left_end - c0) + (c1 - right_start)
    total = int(partial.sum()) + int(full.sum())
    setops.check_pieces(total, "this comparison")
    budget.charge(OP_COST + _PASSES * (1 + len(conds)) * total, f"building {total:,} periodic pieces")
    i = np.flatnonzero(full)
    runs = [ao.starts[i], ao.ends[i], ai.starts[f0[i]], ai.ends[f1[i] - 1]]
    cells = [_cells_in(c0, left_end), _cells_in(right_start, c1)]
    io = np.concatenate([x[0] for x in cells])
    ii = np.concatenate([x[1] for x in cells])
    if outer == "q":
        return _raw(*runs), (io, ii)
    return _raw(runs[2], runs[3], runs[0], runs[1]), (ii, io)


def _cells_in(first: np.ndarray, stop: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(outer index, inner index) of every cell in the ranges ``[first[i], stop[i])``."""
    n = np.maximum(stop - first, 0)
    owner = np.repeat(np.arange(len(first), dtype=np.int64), n)
    inner = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n) + first[owner]
    return owner, inner


def _all_cells(L, conds, axes: dict, budget: Budget):
    """(full runs, partial cells) by classifying every cell of the grid, in chunks."""
    aq, ak = axes["q"], axes["k"]
    cells = len(aq) * len(ak)
    budget.charge(OP_COST + _CELL_PASSES * max(1, len(conds)) * cells,
                  f"a periodic comparison over all {len(aq):,} x {len(ak):,} cells (pieces and work grow with "
                  f"(L / period)^2 here; floors of `k - q` grow with L / period)")
    parts = [(_parts(c, "q", aq), _parts(c, "k", ak)) for c in conds]
    step = max(1, _CHUNK // len(ak))
    runs, pq, pk, total = [], [], [], 0
    for s in range(0, len(aq), step):
        full = np.ones((min(step, len(aq) - s), len(ak)), dtype=bool)
        cand = full.copy()
        for cond, ((_, _, fmin, fmax), (_, _, gmin, gmax)) in zip(conds, parts):
            emin = fmin[s:s + step, None] + gmin[None, :] + cond.c
            emax = fmax[s:s + step, None] + gmax[None, :] + cond.c
            f, c = _classify(cond.op, emin, emax)
            full &= f
            cand &= c
        i, j = np.nonzero(cand & ~full)
        run = _full_runs(full)
        total += len(i) + len(run[0])
        setops.check_pieces(total, "this comparison")
        pq.append(i + s)
        pk.append(j)
        ri, rj0, rj1 = run
        runs.append(_raw(aq.starts[ri + s], aq.ends[ri + s], ak.starts[rj0], ak.ends[rj1 - 1]))
    budget.charge(_PASSES * (1 + len(conds)) * total, f"building {total:,} periodic pieces")
    return np.concatenate(runs), (np.concatenate(pq), np.concatenate(pk))


def _classify(op: str, emin: np.ndarray, emax: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(every pair of the cell holds, some pair may hold) from the cell's range of E."""
    if op == "<":
        return emax < 0, emin < 0
    if op == "<=":
        return emax <= 0, emin <= 0
    if op == ">":
        return emin > 0, emax > 0
    if op == ">=":
        return emin >= 0, emax >= 0
    return (emin == 0) & (emax == 0), (emin <= 0) & (emax >= 0)


def _full_runs(full: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, first column, end column) of every run of True in each row of ``full``."""
    pad = np.zeros((full.shape[0], 1), dtype=bool)
    edges = np.diff(np.concatenate([pad, full, pad], axis=1).astype(np.int8), axis=1)
    r0, j0 = np.nonzero(edges == 1)
    _, j1 = np.nonzero(edges == -1)
    return r0, j0, j1


def _grid(L: int, conds, budget: Budget) -> np.ndarray:
    axes = {v: _Axis(*_segments(L, v, conds, budget)) for v in ("q", "k")}
    for outer, inner in (("q", "k"), ("k", "q")):
        oriented = _monotone(conds, inner)
        if oriented is not None:
            runs, (iq, ik) = _sorted_cells(L, oriented, outer, axes, budget)
            conds = oriented
            break
    else:
        runs, (iq, ik) = _all_cells(L, conds, axes, budget)
    aq, ak = axes["q"], axes["k"]
    rows = _raw(aq.starts[iq], aq.ends[iq], ak.starts[ik], ak.ends[ik])
    for cond in conds:
        C = _floors(cond, "q", aq.starts)[iq] + _floors(cond, "k", ak.starts)[ik] + cond.c
        _constrain(rows, cond, C, L)
    return np.concatenate([runs, rows])


def _bands(L: int, conds, budget: Budget) -> np.ndarray:
    starts, ends = _segments(L, "d", conds, budget)
    budget.charge(OP_COST + _PASSES * (1 + len(conds)) * len(starts), f"building {len(starts):,} diagonal pieces")
    rows = _raw(0, L, 0, L, starts, ends - 1)
    for cond in conds:
        _constrain(rows, cond, _floors(cond, "d", starts) + cond.c, L)
    return rows


# ------------------------------------------------------------------ merging

def _tidy(rows: np.ndarray) -> Pieces:
    keep = (rows[:, Q0] < rows[:, Q1]) & (rows[:, K0] < rows[:, K1]) & (rows[:, LO] <= rows[:, HI])
    rows = rows[keep]
    for lo, hi, step in ((Q0, Q1, 0), (K0, K1, 0), (LO, HI, 1)):
        rows = merge_rows(rows, lo, hi, step)
    return Pieces.of(rows)


# ------------------------------------------------------------------- chains

def _conjunction(L: int, conds, budget: Budget) -> np.ndarray:
    if any(c.uses("d") for c in conds):
        return _bands(L, conds, budget)
    return _grid(L, conds, budget)


def _compatible(conds) -> bool:
    d = any(c.uses("d") for c in conds)
    return not (d and any(c.uses("q") or c.uses("k") for c in conds))


def lower_chain(L: int, comparisons, budget: Budget) -> Pieces:
    """Pieces of the conjunction of ``comparisons`` (``(term, op)``: ``term OP 0``) on a
    sample of length ``L``. TermError for a form that cannot be lowered; LimitExceeded
    past the stated limits."""
    conds = [_cond(e, op, L) for e, op in comparisons]
    ne = [i for i, c in enumerate(conds) if c.op == "!="]
    if len(ne) > 1 or not _compatible(conds):
        acc = None
        for cmp in comparisons:
            part = lower_chain(L, [cmp], budget)
            acc = part if acc is None else setops.intersect(acc, part, budget)
        return acc if acc is not None else Pieces.empty()
    if ne:  # a != b: a < b or a > b, disjoint
        i = ne[0]
        alts = [conds[:i] + [replace(conds[i], op=op)] + conds[i + 1:] for op in ("<", ">")]
        return _tidy(np.concatenate([_conjunction(L, alt, budget) for alt in alts]))
    return _tidy(_conjunction(L, conds, budget))
