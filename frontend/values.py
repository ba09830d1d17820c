"""The values a mask expression computes: numbers, linear position terms, masks.

Numbers are exact (``int`` or :class:`~fractions.Fraction`) and stay inside
the language's range: an integer, and a fraction's numerator and denominator,
are at most ``MAX_MASK_INT`` in magnitude. Every arithmetic result is checked
(:class:`RangeOverflow`, turned into a :class:`MaskError` at the operator by
the evaluator), so no chain of products can grow a number without bound.
While a mask is only being checked (no sample yet), ``L`` is :data:`UNKNOWN`
and every mask is :data:`STATIC_MASK`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from attnplan.ir.limits import MAX_MASK_INT
from attnplan.ir.mask import Pieces

from .stdlib import fmt_number

__all__ = ["UNKNOWN", "STATIC_MASK", "Lin", "RangeOverflow", "arith", "checked", "describe", "fmt_lin",
           "interval", "is_mask", "is_num", "lin", "mk_lin", "negate", "FLIP"]


class _Unknown:
    """A number not known until lowering (it depends on L)."""
    __slots__ = ()

    def __repr__(self):
        return "?"


UNKNOWN = _Unknown()


class _StaticMask:
    """The value of every mask expression while checking statically."""
    __slots__ = ()

    def __repr__(self):
        return "<mask>"


STATIC_MASK = _StaticMask()


class RangeOverflow(Exception):
    """An arithmetic result outside the language's number range (carries the value's description)."""


@dataclass(frozen=True, slots=True)
class Lin:
    """cq*q + ck*k + c (coefficients may be UNKNOWN while checking)."""
    cq: Any
    ck: Any
    c: Any


def is_num(v) -> bool:
    return isinstance(v, (int, Fraction)) or v is UNKNOWN


def is_mask(v) -> bool:
    return v is STATIC_MASK or isinstance(v, Pieces)


def checked(v):
    """``v`` normalized (integral fractions become ints), or RangeOverflow if out of range."""
    if isinstance(v, Fraction):
        if v.denominator == 1:
            v = v.numerator
        elif abs(v.numerator) > MAX_MASK_INT or v.denominator > MAX_MASK_INT:
            raise RangeOverflow(f"a fraction with {len(str(v.denominator))}-digit denominator")
    if isinstance(v, int) and abs(v) > MAX_MASK_INT:
        raise RangeOverflow(f"a number of {len(str(abs(v)))} digits")
    return v


def arith(op: str, a, b):
    """``a op b`` on numbers (``//`` floors; ``b != 0`` is checked by the caller)."""
    if a is UNKNOWN or b is UNKNOWN:
        return UNKNOWN
    if op == "+":
        return checked(a + b)
    if op == "-":
        return checked(a - b)
    if op == "*":
        return checked(a * b)
    return checked(math.floor(Fraction(a) / Fraction(b)))


def negate(v):
    """``-v`` for a number or a position term."""
    if isinstance(v, Lin):
        return mk_lin(arith("*", v.cq, -1), arith("*", v.ck, -1), arith("*", v.c, -1))
    return arith("*", v, -1)


def fmt_lin(v: Lin) -> str:
    parts = []
    for coef, var in ((v.cq, "q"), (v.ck, "k")):
        if coef is UNKNOWN:
            parts.append(f"?*{var}")
        elif coef:
            parts.append(var if coef == 1 else f"-{var}" if coef == -1 else f"{fmt_number(coef)}*{var}")
    if v.c is UNKNOWN or v.c:
        parts.append(fmt_number(v.c) if v.c is not UNKNOWN else "?")
    s = " + ".join(parts) or "0"
    return s.replace("+ -", "- ")


def describe(v) -> str:
    if is_mask(v):
        return "a mask"
    if isinstance(v, Lin):
        return f"the position term `{fmt_lin(v)}`"
    if v is UNKNOWN:
        return "a number"
    return f"the number {fmt_number(v)}"


def lin(v) -> Lin:
    return v if isinstance(v, Lin) else Lin(0, 0, v)


def mk_lin(cq, ck, c):
    if cq is not UNKNOWN and ck is not UNKNOWN and cq == 0 and ck == 0:
        return c
    return Lin(cq, ck, c)


FLIP = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "==", "!=": "!="}


def interval(op: str, t: Fraction) -> list[tuple[int | None, int | None]]:
    """Integer x with ``x OP t`` as a union of disjoint intervals [lo, hi] (None: unbounded)."""
    if op == "<":
        return [(None, math.ceil(t) - 1)]
    if op == "<=":
        return [(None, math.floor(t))]
    if op == ">":
        return [(math.floor(t) + 1, None)]
    if op == ">=":
        return [(math.ceil(t), None)]
    integral = t.denominator == 1
    if op == "==":
        return [(int(t), int(t))] if integral else []
    return [(None, int(t) - 1), (int(t) + 1, None)] if integral else [(None, None)]
