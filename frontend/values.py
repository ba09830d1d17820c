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

__all__ = ["UNKNOWN", "STATIC_MASK", "Floor", "Lin", "Per", "RangeOverflow", "arith", "checked", "describe",
           "fmt_lin", "interval", "is_mask", "is_num", "is_term", "lin", "mk_lin", "negate", "FLIP"]


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


@dataclass(frozen=True, slots=True)
class Floor:
    """``floor((s*x + b) / m)`` for a position ``x``: ``var`` is "q", "k" or "d"
    (d = k - q; None while checking when not yet known), ``s`` is 1 or -1, ``b``
    an integer and ``m`` a positive integer (b, m may be UNKNOWN while checking).
    When known, ``0 <= b < m`` (the whole part of b/m is moved to the constant)."""
    var: str | None
    s: int
    b: Any
    m: Any


@dataclass(frozen=True, slots=True)
class Per:
    """A position term with floors: ``cq*q + ck*k + c + sum(coef * f for f, coef in terms)``,
    every coefficient nonzero (or UNKNOWN). ``x % m`` is ``x - m * (x // m)``."""
    cq: Any
    ck: Any
    c: Any
    terms: tuple  # ((Floor, coef), ...)


def is_term(v) -> bool:
    """A position term: linear in q and k, possibly with floors."""
    return isinstance(v, (Lin, Per))


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
    """``a op b`` on numbers (``//`` floors, ``%`` is ``a - b * (a // b)``; ``b != 0`` is
    checked by the caller)."""
    if a is UNKNOWN or b is UNKNOWN:
        return UNKNOWN
    if op == "+":
        return checked(a + b)
    if op == "-":
        return checked(a - b)
    if op == "*":
        return checked(a * b)
    if op == "%":
        return checked(a - b * math.floor(Fraction(a) / Fraction(b)))
    return checked(math.floor(Fraction(a) / Fraction(b)))


def negate(v):
    """``-v`` for a number or a position term."""
    if isinstance(v, Per):
        return Per(arith("*", v.cq, -1), arith("*", v.ck, -1), arith("*", v.c, -1),
                   tuple((f, arith("*", coef, -1)) for f, coef in v.terms))
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


_VAR_TEXT = {"q": "q", "k": "k", "d": "(k - q)", None: "?"}


def fmt_floor(f: Floor) -> str:
    x = _VAR_TEXT[f.var]
    if f.s < 0:
        x = "-" + x
    if f.b is UNKNOWN or f.b:
        x = f"({x} + {fmt_number(f.b) if f.b is not UNKNOWN else '?'})".replace("+ -", "- ")
    return f"{x} // {fmt_number(f.m) if f.m is not UNKNOWN else '?'}"


def fmt_term(v) -> str:
    """A position term as text (floors written ``x // m``)."""
    if isinstance(v, Lin):
        return fmt_lin(v)
    parts = [] if (v.cq == 0 and v.ck == 0 and v.c == 0) else [fmt_lin(Lin(v.cq, v.ck, v.c))]
    for f, coef in v.terms:
        text = fmt_floor(f)
        parts.append(text if coef == 1 else f"-({text})" if coef == -1 else
                     f"{fmt_number(coef) if coef is not UNKNOWN else '?'}*({text})")
    return " + ".join(parts).replace("+ -", "- ")


def describe(v) -> str:
    if is_mask(v):
        return "a mask"
    if is_term(v):
        return f"the position term `{fmt_term(v)}`"
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
