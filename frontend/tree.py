"""The mask language's syntax tree, and its construction from lark's parse tree.

Nodes are frozen dataclasses carrying the line and column a caret points at.
Left-associative chains (``a | b | c``, ``a & b``, ``a + b - c``, ``a * b // c``)
become one :class:`Fold` node with n terms, so a 10,000-term union is one
node, not a tree 10,000 levels deep. The nodes are built as lark's LALR parser
reduces (:class:`Builder`, its inline transformer: no parse tree, no
recursion), and number literals are checked against ``MAX_MASK_INT`` before
they are converted.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable

from lark import Token

from attnplan.errors import MaskError
from attnplan.ir.limits import MAX_MASK_INT

from .stdlib import BUILTINS

__all__ = ["Node", "Num", "Name", "Call", "Fold", "Unary", "Chain", "InSeg", "Let", "MaskStmt", "RESERVED",
           "start_of", "Builder"]

RESERVED = ("q", "k", "L", "Lq", "Lk", "h")
_MAX_DIGITS = len(str(MAX_MASK_INT))

Err = Callable[..., MaskError]  # (message, line, col) -> MaskError


@dataclass(frozen=True, slots=True)
class Node:
    line: int
    col: int


@dataclass(frozen=True, slots=True)
class Num(Node):
    value: int | Fraction


@dataclass(frozen=True, slots=True)
class Name(Node):
    name: str


@dataclass(frozen=True, slots=True)
class Call(Node):
    name: str
    args: tuple


@dataclass(frozen=True, slots=True)
class Fold(Node):
    """``terms[0] op1 terms[1] op2 terms[2] ...`` folded from the left; ``ops`` is
    ``((op, line, col), ...)``, all of one precedence level (``|``, ``&``,
    ``+ -`` or ``* //``). line/col is where the first term starts."""
    terms: tuple
    ops: tuple


@dataclass(frozen=True, slots=True)
class Unary(Node):
    op: str  # "-" or "!"
    operand: Any


@dataclass(frozen=True, slots=True)
class Chain(Node):
    """A comparison chain ``a < b <= c``; line/col is where ``a`` starts."""
    terms: tuple
    ops: tuple  # ((op, line, col), ...)


@dataclass(frozen=True, slots=True)
class InSeg(Node):
    var: str  # "q" or "k"
    kind: str


@dataclass(frozen=True, slots=True)
class Let(Node):
    name: str
    params: tuple | None  # None: `let x = ...`; tuple: `let f(a, b) = ...`
    body: Any


@dataclass(frozen=True, slots=True)
class MaskStmt(Node):
    expr: Any


def start_of(node) -> tuple[int, int]:
    """Where an expression starts in the text (for carets)."""
    return node.line, node.col


# --------------------------------------------------------------- literals

def number_value(tok: Token, err: Err) -> int | Fraction:
    """The exact value of a NUMBER token; MaskError if out of range (checked on
    the digits, before any conversion, so a 5,000-digit literal costs nothing)."""
    whole, _, frac = tok.value.replace("_", "").partition(".")
    whole, frac = whole.lstrip("0"), frac.rstrip("0")
    if len(whole) > _MAX_DIGITS or (whole and int(whole) > MAX_MASK_INT):
        raise err(f"number out of range: numbers in a mask are at most {MAX_MASK_INT} "
                  f"(2^62) in magnitude, this one has {len(whole)} digits", tok.line, tok.column)
    if len(frac) > _MAX_DIGITS - 1:
        raise err(f"number has {len(frac)} decimal places; at most {_MAX_DIGITS - 1} are allowed",
                  tok.line, tok.column)
    if not frac:
        return int(whole or "0")
    value = Fraction(int(whole + frac), 10 ** len(frac))
    if value.numerator > MAX_MASK_INT:
        raise err(f"number out of range: numbers in a mask are at most {MAX_MASK_INT} (2^62) in magnitude",
                  tok.line, tok.column)
    return value


# ------------------------------------------------------------ conversion

_FOLDS = ("union", "inter", "sum", "product")


class _Open(list):
    """A left-associative chain being reduced: ``[t0, op1, t1, ...]`` of one rule (``rule``), extended in
    place as the parser reduces ``rule: rule OP term`` (so 10,000 terms cost 10,000 appends), made a
    :class:`Fold` once something else takes it."""
    __slots__ = ("rule",)


def _closed(kid, err):
    return _fold(kid, err) if isinstance(kid, _Open) else kid


class Builder:
    """The AST built while lark's LALR parser reduces (its inline ``transformer``: no parse tree is made).
    One method per rule; ``err`` is the current parse's MaskError maker (set by :func:`attnplan.frontend.
    lang` before each parse, under its lock)."""

    def __init__(self):
        self.err: Err | None = None
        for rule, build in _RULES.items():
            setattr(self, rule, self._folding(rule) if rule in _FOLDS else self._building(build))

    def _building(self, build):
        def reduce(kids):
            return build([_closed(k, self.err) for k in kids], self.err)
        return reduce

    def _folding(self, rule):
        def reduce(kids):
            left = kids[0]
            if isinstance(left, _Open) and left.rule == rule:
                left.append(kids[1])
                left.append(_closed(kids[2], self.err))
                return left
            chain = _Open(_closed(k, self.err) for k in kids)
            chain.rule = rule
            return chain
        return reduce


def _fold(kids, err) -> Fold:
    terms = tuple(kids[0::2])
    ops = tuple((t.value, t.line, t.column) for t in kids[1::2])
    return Fold(terms[0].line, terms[0].col, terms, ops)


def _chain(kids, err) -> Chain:
    terms = tuple(kids[0::2])
    ops = tuple((t.value, t.line, t.column) for t in kids[1::2])
    return Chain(terms[0].line, terms[0].col, terms, ops)


def _segtest(kids, err) -> InSeg:
    var, _, kind = kids
    if not (isinstance(var, Name) and var.name in ("q", "k")):
        raise err(f"`in` tests the segment of `q` or `k`: write `q in {kind.value}` "
                  f"or `k in {kind.value}`", var.line, var.col)
    return InSeg(var.line, var.col, var.name, kind.value)


def check_definable(name: str, line: int, col: int, err: Err, what: str) -> None:
    if name in RESERVED:
        raise err(f"`{name}` is reserved (q, k: positions, L, Lq, Lk: sample lengths, h: query head) and cannot be "
                  f"{what}", line, col)
    if name == "mask":
        raise err("`mask` is reserved: write the mask expression as `mask = EXPR`", line, col)
    if name in BUILTINS:
        raise err(f"`{name}` is a builtin mask ({BUILTINS[name].signature}) and cannot be redefined as {what}",
                  line, col)


def _let(kids, err) -> Let:
    _, name, *rest = kids
    params = None
    if len(rest) == 2:
        ptoks = rest[0]
        params = tuple(t.value for t in ptoks)
        seen = set()
        for t in ptoks:
            if t.value in seen:
                raise err(f"parameter `{t.value}` of `{name.value}` is listed twice", t.line, t.column)
            seen.add(t.value)
            check_definable(t.value, t.line, t.column, err, "a parameter")
    check_definable(name.value, name.line, name.column, err, "a definition")
    return Let(name.line, name.column, name.value, params, rest[-1])


def _assign(kids, err) -> MaskStmt:
    name, expr = kids
    if name.value != "mask":
        hint = (f"to compare, use `==` (`{name.value} == ...`)" if name.value in RESERVED
                else f"to define a helper, write `let {name.value} = ...`")
        raise err(f"only `mask = EXPR` can be assigned; {hint}", name.line, name.column)
    return MaskStmt(name.line, name.column, expr)


def _expr_stmt(kids, err) -> MaskStmt:
    (expr,) = kids
    return MaskStmt(expr.line, expr.col, expr)


def _unary(op: str):
    def build(kids, err):
        tok, operand = kids
        return Unary(tok.line, tok.column, op, operand)
    return build


_RULES: dict[str, Callable] = {
    "number": lambda kids, err: Num(kids[0].line, kids[0].column, number_value(kids[0], err)),
    "name": lambda kids, err: Name(kids[0].line, kids[0].column, kids[0].value),
    "call": lambda kids, err: Call(kids[0].line, kids[0].column, kids[0].value, tuple(kids[1:])),
    "union": _fold, "inter": _fold, "sum": _fold, "product": _fold,
    "neg": _unary("!"), "unary": _unary("-"),
    "chain": _chain, "segtest": _segtest,
    "params": lambda kids, err: list(kids),
    "let_stmt": _let, "assign_stmt": _assign, "expr_stmt": _expr_stmt,
    "start": lambda kids, err: list(kids),
}


