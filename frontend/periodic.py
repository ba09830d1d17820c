"""Position terms with floors: ``x // m`` and ``x % m`` on positions.

``%`` and ``//`` take a position term on the left and a positive integer on
the right (a number, ``L`` included; never a position: ``q % k`` is an
error). The left side is one of

* ``q``, ``k``, ``k - q`` or ``q - k`` (or their negatives) plus an integer:
  ``q // 64``, ``(q + 3) % 4``, ``(q - k) % d``;
* a term divided already: ``q // W // H`` (is ``q // (W*H)``), ``(q // W) % H``,
  ``(q % (H*W)) // W`` (any term whose floors have coefficients divisible by the
  divisor, or a single floor plus an integer).

``x % m`` is ``x - m * (x // m)``, so the result is a :class:`~.values.Per`:
a linear part plus integer multiples of floors. Anything else (``(2*q) // 4``,
``(q + k) // 2``, ``(q % 4) // 3``) is a :class:`TermError`, which the
evaluator reports at the operator.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from .stdlib import fmt_number
from .values import UNKNOWN, Floor, Lin, Per, arith, checked, describe, fmt_term, mk_lin

__all__ = ["TermError", "add", "scale", "floordiv", "mod", "vars_of", "term_parts"]

_FORMS = {(1, 0): ("q", 1), (-1, 0): ("q", -1), (0, 1): ("k", 1), (0, -1): ("k", -1),
          (-1, 1): ("d", 1), (1, -1): ("d", -1)}


class TermError(Exception):
    """A floor or remainder this language cannot lower exactly (the message says why)."""


def term_parts(v) -> tuple[Any, Any, Any, tuple]:
    """``(cq, ck, c, terms)`` of a number, a Lin or a Per."""
    if isinstance(v, Per):
        return v.cq, v.ck, v.c, v.terms
    if isinstance(v, Lin):
        return v.cq, v.ck, v.c, ()
    return 0, 0, v, ()


def _known(*xs) -> bool:
    return all(x is not UNKNOWN for x in xs)


def _norm_floor(f: Floor) -> tuple[Floor, Any]:
    """``f`` with ``0 <= b < m``, and the integer moved out of it."""
    if not _known(f.b, f.m):
        return f, 0
    whole, b = divmod(f.b, f.m)
    return Floor(f.var, f.s, b, f.m), whole


def _build(cq, ck, c, items) -> Any:
    """The term ``cq*q + ck*k + c + sum(coef * floor)`` (floors normalized, equal ones merged)."""
    acc: dict = {}
    for f, coef in items:
        f, whole = _norm_floor(f)
        if whole:
            c = arith("+", c, arith("*", coef, whole))
        coef = coef if coef is UNKNOWN else checked(coef)
        acc[f] = arith("+", acc[f], coef) if f in acc else coef
    terms = tuple((f, coef) for f, coef in acc.items() if coef is UNKNOWN or coef != 0)
    if not terms:
        return mk_lin(cq, ck, c)
    return Per(cq, ck, c, terms)


def add(a, b, sign: int = 1):
    """``a + sign*b`` for numbers and position terms (at least one a term)."""
    aq, ak, ac, at = term_parts(a)
    bq, bk, bc, bt = term_parts(b)
    op = "+" if sign > 0 else "-"
    return _build(arith(op, aq, bq), arith(op, ak, bk), arith(op, ac, bc),
                  list(at) + [(f, arith("*", coef, sign)) for f, coef in bt])


def scale(a, s):
    """``s * a`` for a position term ``a`` and a number ``s``."""
    cq, ck, c, terms = term_parts(a)
    return _build(arith("*", cq, s), arith("*", ck, s), arith("*", c, s),
                  [(f, arith("*", coef, s)) for f, coef in terms])


def vars_of(v) -> set:
    """The positions the floors of ``v`` are taken of ("q", "k", "d"; None: not known yet)."""
    return {f.var for f, _ in term_parts(v)[3]}


def _divisor(m, op: str):
    if m is UNKNOWN:
        return m
    if isinstance(m, Fraction) or m < 1:
        raise TermError(f"the right side of `{op}` on a position must be a positive integer, got {fmt_number(m)}")
    return m


def _divisible(coef, m) -> bool:
    return Fraction(coef) / m == int(Fraction(coef) / m)


def _unknown_floor(v) -> Per:
    """While checking, a floor whose divisor or form is not known yet (checked when lowering)."""
    found: set[str | None] = {f.var for f, _ in term_parts(v)[3]}
    cq, ck = term_parts(v)[:2]
    if _known(cq, ck) and (cq, ck) in _FORMS:
        found.add(_FORMS[(cq, ck)][0])
    only = found.pop() if len(found) == 1 else None
    return Per(0, 0, 0, ((Floor(only, 1, UNKNOWN, UNKNOWN), 1),))


def _floor_of_linear(cq, ck, c, m, op: str):
    if (cq, ck) == (0, 0):
        return arith("//", c, m) if m is not UNKNOWN else UNKNOWN
    if (cq, ck) not in _FORMS:
        raise TermError(f"`{op}` applies to q, k or k - q (or their negatives) plus an integer, e.g. "
                        f"`q {op} 64`, `(k - q) {op} 4`; got `{fmt_term(Lin(cq, ck, c))}`")
    if c is not UNKNOWN and isinstance(c, Fraction):
        raise TermError(f"`{op}` applies to a position plus an integer; `{fmt_term(Lin(cq, ck, c))}` "
                        f"adds {fmt_number(c)}")
    var, s = _FORMS[(cq, ck)]
    return _build(0, 0, 0, [(Floor(var, s, c, m), 1)])


def floordiv(t, m, op: str = "//"):
    """``t // m`` for a position term ``t`` and a number ``m`` (TermError if not expressible)."""
    m = _divisor(m, op)
    cq, ck, c, terms = term_parts(t)
    if not _known(cq, ck, c, m) or any(not _known(f.b, f.m, coef) for f, coef in terms):
        return _unknown_floor(t)
    if not terms:
        return _floor_of_linear(cq, ck, c, m, op)
    odd = [(f, coef) for f, coef in terms if not _divisible(coef, m)]
    rest = [(f, Fraction(coef) / m) for f, coef in terms if _divisible(coef, m)]
    if not odd:  # t = (linear) + m * (integer): the floors pass through
        return add(_floor_of_linear(cq, ck, c, m, op), _build(0, 0, 0, rest))
    if (cq, ck) == (0, 0) and len(odd) == 1 and odd[0][1] in (1, -1) and not isinstance(c, Fraction):
        (f, e), = odd
        # floor((floor(y/a) + c) / m) = floor((y + c*a) / (a*m)); -floor(y/a) = floor((-y + a - 1) / a)
        b = f.b + c * f.m if e == 1 else -f.b + f.m - 1 + c * f.m
        inner = Floor(f.var, f.s * e, checked(b), arith("*", f.m, m))
        return add(_build(0, 0, 0, [(inner, 1)]), _build(0, 0, 0, rest))
    raise TermError(f"`{op}` of {describe(t)} cannot be lowered exactly: `{op}` applies to q, k or k - q "
                    f"plus an integer, or to one `//` of those (`q // W // H`, `(q // W) % H`)")


def mod(t, m):
    """``t % m`` = ``t - m * (t // m)``."""
    return add(t, scale(floordiv(t, m, "%"), m), -1)
