"""The mask language: parse text into a :class:`MaskProgram`, lower it to pieces.

The language
============

A mask file is a few statements, one a line, with ``#`` comments::

    # a window with a few global "sink" tokens
    let window(w) = q - w < k <= q
    let sinks = k < 16 & k <= q
    mask = window(256) | sinks

* ``let NAME = EXPR`` and ``let NAME(P1, P2, ...) = EXPR`` define helpers. A
  name refers to definitions above it (so there is no recursion); builtins and
  the reserved names ``q k L`` cannot be redefined.
* Exactly one mask expression: either a bare expression or ``mask = EXPR``.
* A newline ends a statement, except inside parentheses: wrap a long
  expression in ``( ... )`` to split it over lines.

Expressions, loosest binding first:

=================  ============================================================
``A | B``          union
``A & B``          intersection
``!A``             complement within the sample (``!k < 5`` is ``!(k < 5)``)
``a < b <= c``     comparisons ``< <= > >= == !=``, chains allowed (each adjacent
                   pair must hold); ``q in KIND``, ``k in KIND`` (the token's
                   segment has that kind)
``a + b, a - b``   integer arithmetic on numbers and on linear terms of q and k
``a * b, a // b``  (``//`` floors); ``-a``
atoms              numbers (``64``, ``1_000``, exact decimals ``0.25``), ``q``,
                   ``k``, ``L`` (the sample length), ``true``, ``false``,
                   ``NAME``, ``NAME(args)``, ``( EXPR )``
=================  ============================================================

``q`` and ``k`` are query and key positions relative to the start of the
sample; ``L`` is its length, and a mask never leaves ``[0, L)^2``. A comparison
must reduce to ``k - q OP c``, ``k OP c`` or ``q OP c`` (a diagonal band, a
column range or a row range), e.g. ``q - k < w``, ``k <= q``, ``2*k < 2*q + 7``,
``k < L // 2``; anything else (``q * k``, ``k < 2 * q``, ``q // 2 == k``) is an
error at its position. Masks, numbers and linear terms are distinct types:
``causal + 1`` or ``sliding_window(k)`` is an error.

Named masks (see :mod:`attnplan.frontend.stdlib`): ``causal``, ``full``,
``sliding_window(w)``, ``streaming(s, w)``, ``shared_question(n, f)``,
``causal_blockwise(b, k)``, ``block_causal(b)``, ``prefix_lm(p)``,
``chunked_causal(c)``, and the segment predicates ``same_segment`` and
``earlier_segment`` (k's segment lies before q's). A sample without segments
is one segment of kind ``text``.

Everything that does not depend on ``L`` or on segments is checked when the
text is parsed (names, arity, parameter values, types, reducibility);
the rest when a sample is lowered. Errors are :class:`MaskError` with
``file:line:col``, the line and a caret.

Examples::

    causal
    sliding_window(256) | (k < 16 & k <= q)
    mask = earlier_segment | (same_segment & (q in image | k <= q))
    let local(w) = q - w < k <= q
    chunked_causal(1024) | local(128)
"""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from lark import Lark, Token, Transformer
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken, VisitError
from lark.lark import PostLex

from attnplan.errors import BatchError, MaskError
from attnplan.ir.mask import INF, K0, K1, Q0, Q1, Pieces, normalize, piece_counts

from .batch import Batch
from .stdlib import BUILTINS, Builtin, Segments, fmt_number, segment_rows

__all__ = ["MaskProgram", "parse_mask", "load_mask", "lower_batch", "render"]

RESERVED = ("q", "k", "L")


# --------------------------------------------------------------------------- AST

@dataclass(frozen=True, slots=True)
class _Node:
    line: int
    col: int


@dataclass(frozen=True, slots=True)
class _Num(_Node):
    value: int | Fraction


@dataclass(frozen=True, slots=True)
class _Name(_Node):
    name: str


@dataclass(frozen=True, slots=True)
class _Call(_Node):
    name: str
    args: tuple


@dataclass(frozen=True, slots=True)
class _Bin(_Node):
    """``left op right``; line/col is the operator's."""
    op: str
    left: Any
    right: Any


@dataclass(frozen=True, slots=True)
class _Unary(_Node):
    op: str  # "-" or "!"
    operand: Any


@dataclass(frozen=True, slots=True)
class _Chain(_Node):
    terms: tuple
    ops: tuple  # ((op, line, col), ...)


@dataclass(frozen=True, slots=True)
class _InSeg(_Node):
    var: str  # "q" or "k"
    kind: str


@dataclass(frozen=True, slots=True)
class _Let(_Node):
    name: str
    params: tuple | None  # None: `let x = ...`; tuple: `let f(a, b) = ...`
    body: Any


@dataclass(frozen=True, slots=True)
class _MaskStmt(_Node):
    expr: Any


def _start(node) -> tuple[int, int]:
    """Where an expression starts in the text (for carets)."""
    while isinstance(node, (_Bin, _Chain)):
        node = node.left if isinstance(node, _Bin) else node.terms[0]
    return node.line, node.col


# ------------------------------------------------------------------------ parsing

class _ParenNewlines(PostLex):
    """Drop newlines inside parentheses so an expression can span lines."""
    always_accept = ("_NL",)

    def process(self, stream):
        depth = 0
        for tok in stream:
            if tok.type == "LPAR":
                depth += 1
            elif tok.type == "RPAR":
                depth = max(0, depth - 1)
            elif tok.type == "_NL" and depth:
                continue
            yield tok


_PARSER: Lark | None = None


def _parser() -> Lark:
    global _PARSER
    if _PARSER is None:
        _PARSER = Lark(Path(__file__).with_name("mask.lark").read_text(), parser="lalr",
                       propagate_positions=True, postlex=_ParenNewlines(), maybe_placeholders=False)
    return _PARSER


class _ToAst(Transformer):
    def __init__(self, err):
        super().__init__()
        self.err = err  # err(message, line, col) -> MaskError

    def number(self, children):
        (tok,) = children
        text = tok.value.replace("_", "")
        value = Fraction(text)
        return _Num(tok.line, tok.column, value.numerator if value.denominator == 1 else value)

    def name(self, children):
        (tok,) = children
        return _Name(tok.line, tok.column, tok.value)

    def call(self, children):
        tok, *args = children
        return _Call(tok.line, tok.column, tok.value, tuple(args))

    def _bin(self, children):
        left, op, right = children
        return _Bin(op.line, op.column, op.value, left, right)

    union = inter = sum = product = _bin

    def neg(self, children):
        op, operand = children
        return _Unary(op.line, op.column, "!", operand)

    def unary(self, children):
        op, operand = children
        return _Unary(op.line, op.column, "-", operand)

    def chain(self, children):
        terms = tuple(children[0::2])
        ops = tuple((t.value, t.line, t.column) for t in children[1::2])
        line, col = _start(terms[0])
        return _Chain(line, col, terms, ops)

    def segtest(self, children):
        var, _, kind = children
        if not (isinstance(var, _Name) and var.name in ("q", "k")):
            line, col = _start(var)
            raise self.err(f"`in` tests the segment of `q` or `k`: write `q in {kind.value}` "
                           f"or `k in {kind.value}`", line, col)
        return _InSeg(var.line, var.col, var.name, kind.value)

    def let_stmt(self, children):
        _, name, *rest = children
        params = None
        if len(rest) == 2:
            ptoks = rest[0].children
            params = tuple(t.value for t in ptoks)
            seen = set()
            for t in ptoks:
                if t.value in seen:
                    raise self.err(f"parameter `{t.value}` of `{name.value}` is listed twice", t.line, t.column)
                seen.add(t.value)
                _check_definable(t.value, t.line, t.column, self.err, "a parameter")
        _check_definable(name.value, name.line, name.column, self.err, "a definition")
        return _Let(name.line, name.column, name.value, params, rest[-1])

    def assign_stmt(self, children):
        name, expr = children
        if name.value != "mask":
            hint = (f"to compare, use `==` (`{name.value} == ...`)" if name.value in RESERVED
                    else f"to define a helper, write `let {name.value} = ...`")
            raise self.err(f"only `mask = EXPR` can be assigned; {hint}", name.line, name.column)
        return _MaskStmt(name.line, name.column, expr)

    def expr_stmt(self, children):
        (expr,) = children
        line, col = _start(expr)
        return _MaskStmt(line, col, expr)

    def start(self, children):
        return list(children)


def _check_definable(name, line, col, err, what):
    if name in RESERVED:
        raise err(f"`{name}` is reserved (q, k: positions, L: sample length) and cannot be {what}", line, col)
    if name == "mask":
        raise err("`mask` is reserved: write the mask expression as `mask = EXPR`", line, col)
    if name in BUILTINS:
        raise err(f"`{name}` is a builtin mask ({BUILTINS[name].signature}) and cannot be redefined as {what}",
                  line, col)


_EXPR_START = {"NAME", "NUMBER", "LPAR", "MINUS", "NOT"}
_OPERATORS = {"PLUS", "MINUS", "STAR", "FLOORDIV", "CMP", "AND", "OR", "IN"}
_PUNCT = {"LPAR": "'('", "RPAR": "')'", "COMMA": "','", "EQUAL": "'='", "LET": "'let'"}


def _describe_token(tok: Token) -> str:
    if tok.type == "$END":
        return "end of input"
    if tok.type == "_NL":
        return "end of line"
    return repr(tok.value)


def _expected_words(accepts: set[str]) -> str:
    acc = set(accepts)
    words = []
    if {"NAME", "NUMBER"} <= acc:
        words.append("an expression")
        acc -= _EXPR_START
    if acc & _OPERATORS:
        words.append("an operator")
        acc -= _OPERATORS
        acc -= {"LPAR", "EQUAL"}  # `f(` and `mask =` after a bare name: not worth listing
    if acc == {"NAME"}:
        words.append("a name")
        acc = set()
    acc.discard("NAME")
    words += [_PUNCT[t] for t in ("LPAR", "COMMA", "RPAR", "EQUAL", "LET") if t in acc]
    if acc & {"_NL", "$END"}:
        words.append("end of line")
    if not words:
        return "something else"
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _end_position(text: str) -> tuple[int, int]:
    body = text.rstrip()
    lines = body.split("\n")
    return len(lines), len(lines[-1]) + 1


def _syntax_error(e: UnexpectedInput, text: str, filename: str) -> MaskError:
    if isinstance(e, UnexpectedCharacters):
        ch = text[e.pos_in_stream] if e.pos_in_stream is not None and e.pos_in_stream < len(text) else e.char
        return MaskError(f"unexpected character {ch!r}", filename, e.line, e.column, text)
    if isinstance(e, UnexpectedToken):
        tok = e.token
        accepts = e.accepts or e.expected
        line, col = (tok.line, tok.column) if tok.type != "$END" else _end_position(text)
        if tok.type == "_NL" and tok.line is not None:
            # point after the last character of the line that ended early
            line = tok.line
            col = len(text.split("\n")[line - 1].split("#")[0].rstrip()) + 1
        msg = f"expected {_expected_words(accepts)}, got {_describe_token(tok)}"
        if tok.type == "EQUAL":
            msg += " (to compare, use `==`)"
        return MaskError(msg, filename, line or 1, col or 1, text)
    line, col = _end_position(text)
    return MaskError("unexpected end of input", filename, line, col, text)


# ------------------------------------------------------------------------- values

class _Unknown:
    """A number not known until lowering (it depends on L)."""
    __slots__ = ()

    def __repr__(self):
        return "?"


UNKNOWN = _Unknown()
_STATIC_MASK = object()  # the value of a mask expression while checking statically


@dataclass(frozen=True, slots=True)
class _Lin:
    """cq*q + ck*k + c (coefficients may be UNKNOWN while checking)."""
    cq: Any
    ck: Any
    c: Any


def _is_num(v) -> bool:
    return isinstance(v, (int, Fraction)) or v is UNKNOWN


def _is_mask(v) -> bool:
    return v is _STATIC_MASK or isinstance(v, Pieces)


def _norm(v):
    if isinstance(v, Fraction) and v.denominator == 1:
        return v.numerator
    return v


def _arith(op, a, b):
    if a is UNKNOWN or b is UNKNOWN:
        return UNKNOWN
    if op == "+":
        return _norm(a + b)
    if op == "-":
        return _norm(a - b)
    if op == "*":
        return _norm(a * b)
    return math.floor(Fraction(a) / Fraction(b))  # "//", b != 0 checked by the caller


def _fmt_lin(v: _Lin) -> str:
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


def _describe(v) -> str:
    if _is_mask(v):
        return "a mask"
    if isinstance(v, _Lin):
        return f"the position term `{_fmt_lin(v)}`"
    if v is UNKNOWN:
        return "a number"
    return f"the number {fmt_number(v)}"


def _lin(v) -> _Lin:
    return v if isinstance(v, _Lin) else _Lin(0, 0, v)


def _mk_lin(cq, ck, c):
    if cq is not UNKNOWN and ck is not UNKNOWN and cq == 0 and ck == 0:
        return c
    return _Lin(cq, ck, c)


_FLIP = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "==", "!=": "!="}


def _interval(op: str, t: Fraction) -> list[tuple[int | None, int | None]]:
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


# ---------------------------------------------------------------------- evaluator

class _Eval:
    """Evaluates expressions; with ``length=None`` it only checks (static mode)."""

    def __init__(self, prog: "MaskProgram", length: int | None, seg: Segments | None):
        self.prog, self.L, self.seg = prog, length, seg
        self.static = length is None
        self.stack: list[tuple[str, int, int]] = []  # let calls being evaluated

    def err(self, msg, line, col) -> MaskError:
        for name, l, c in reversed(self.stack):
            msg += f" (in `{name}`, used at line {l}, col {c})"
        if not self.static:
            msg += f" [sample length {self.L}]"
        return MaskError(msg, self.prog.filename, line, col, self.prog.source)

    def mask(self, node, env, what="the mask expression") -> Any:
        v = self.eval(node, env)
        if not _is_mask(v):
            line, col = _start(node)
            raise self.err(f"{what} must be a mask, got {_describe(v)}", line, col)
        return v

    # helpers building masks (or the static placeholder)
    def _full(self):
        return _STATIC_MASK if self.static else Pieces.rect(0, self.L, 0, self.L)

    def eval(self, node, env):
        m = getattr(self, "_" + type(node).__name__[1:].lower())
        return m(node, env)

    def _num(self, node, env):
        return node.value

    def _name(self, node, env):
        n = node.name
        if n == "q":
            return _Lin(1, 0, 0)
        if n == "k":
            return _Lin(0, 1, 0)
        if n == "L":
            return UNKNOWN if self.static else self.L
        if n in env:
            return env[n]
        return self._call(_Call(node.line, node.col, n, ()), env)

    def _call(self, node, env):
        args = [self.eval(a, env) for a in node.args]
        let = self.prog._lets.get(node.name)
        if let is not None:
            self.stack.append((node.name, node.line, node.col))
            try:
                return self.eval(let.body, dict(zip(let.params or (), args)))
            finally:
                self.stack.pop()
        b: Builtin = BUILTINS[node.name]
        values = []
        for p, a, v in zip(b.params, node.args, args):
            line, col = _start(a)
            if not _is_num(v):
                raise self.err(f"{b.name}: {p.name} ({p.doc}) must be a number, got {_describe(v)}", line, col)
            if v is not UNKNOWN:
                problem = p.problem(v)
                if problem:
                    raise self.err(f"{b.name}: {problem}", line, col)
            values.append(v)
        if self.static:
            return _STATIC_MASK
        return b.build(self.L, self.seg, *values)

    def _bin(self, node, env):
        op = node.op
        a, b = self.eval(node.left, env), self.eval(node.right, env)
        if op in "&|":
            word = "intersection" if op == "&" else "union"
            for side, v, sub in (("left", a, node.left), ("right", b, node.right)):
                if not _is_mask(v):
                    line, col = _start(sub)
                    raise self.err(f"the {side} side of `{op}` ({word}) must be a mask, got {_describe(v)}", line, col)
            if self.static:
                return _STATIC_MASK
            if op == "&":
                return a.intersect(b)
            if not len(a):
                return b
            return a.union(b) if len(b) else a
        for side, v, sub in (("left", a, node.left), ("right", b, node.right)):
            if _is_mask(v):
                line, col = _start(sub)
                raise self.err(f"the {side} side of `{op}` must be a number or a position term, got a mask",
                               line, col)
        if _is_num(a) and _is_num(b):
            if op == "//" and b == 0:
                raise self.err("division by zero", node.line, node.col)
            return _arith(op, a, b)
        if op in "+-":
            x, y = _lin(a), _lin(b)
            return _mk_lin(_arith(op, x.cq, y.cq), _arith(op, x.ck, y.ck), _arith(op, x.c, y.c))
        if op == "*":
            if isinstance(a, _Lin) and isinstance(b, _Lin):
                raise self.err(f"`({_fmt_lin(a)}) * ({_fmt_lin(b)})` multiplies two position terms; "
                               f"a comparison must stay linear in q and k", node.line, node.col)
            lin, s = (a, b) if isinstance(a, _Lin) else (b, a)
            return _mk_lin(_arith("*", lin.cq, s), _arith("*", lin.ck, s), _arith("*", lin.c, s))
        raise self.err(f"`//` needs numbers on both sides; floor division of a position "
                       f"({_describe(a if isinstance(a, _Lin) else b)}) is not linear", node.line, node.col)

    def _unary(self, node, env):
        v = self.eval(node.operand, env)
        if node.op == "!":
            if not _is_mask(v):
                line, col = _start(node.operand)
                raise self.err(f"`!` (complement) needs a mask, got {_describe(v)}", line, col)
            return _STATIC_MASK if self.static else v.complement(self.L)
        if _is_mask(v):
            raise self.err("unary `-` needs a number or a position term, got a mask", node.line, node.col)
        if isinstance(v, _Lin):
            return _mk_lin(_arith("*", v.cq, -1), _arith("*", v.ck, -1), _arith("*", v.c, -1))
        return _arith("*", v, -1)

    def _chain(self, node, env):
        vals = [self.eval(t, env) for t in node.terms]
        for v, t in zip(vals, node.terms):
            if _is_mask(v):
                line, col = _start(t)
                raise self.err("a comparison compares numbers and position terms (q, k), not masks; "
                               "combine masks with & and |", line, col)
        result = None
        for (op, line, col), a, b in zip(node.ops, vals, vals[1:]):
            m = self._compare(op, a, b, line, col)
            if self.static:
                result = _STATIC_MASK
            else:
                result = m if result is None else result.intersect(m)
        return result

    def _compare(self, op, a, b, line, col):
        d = _lin(a)
        e = _lin(b)
        diff = _Lin(_arith("-", d.cq, e.cq), _arith("-", d.ck, e.ck), _arith("-", d.c, e.c))
        cq, ck, c = diff.cq, diff.ck, diff.c
        if cq is UNKNOWN or ck is UNKNOWN:
            return _STATIC_MASK if self.static else None  # never reached when lowering
        if cq == 0 and ck == 0:
            var, coef = None, None
        elif ck == 0:
            var, coef = "q", cq
        elif cq == 0:
            var, coef = "k", ck
        elif cq == -ck:
            var, coef = "k - q", ck
        else:
            raise self.err(f"this comparison reduces to `{_fmt_lin(diff)} {op} 0`, which is not of the form "
                           f"`k - q OP c`, `k OP c` or `q OP c`", line, col)
        if self.static or c is UNKNOWN:
            return _STATIC_MASK
        L = self.L
        if var is None:  # constant truth
            holds = {"<": c < 0, "<=": c <= 0, ">": c > 0, ">=": c >= 0, "==": c == 0, "!=": c != 0}[op]
            return Pieces.rect(0, L, 0, L) if holds else Pieces.empty()
        # coef*x + c OP 0  <=>  x OP' -c/coef
        t = Fraction(-c) / Fraction(coef)
        if coef < 0:
            op = _FLIP[op]
        rows = []
        for lo, hi in _interval(op, t):
            # clamp to just outside the sample: same pairs, no int64 overflow
            lo = -(L + 1) if lo is None else min(max(lo, -(L + 1)), L + 1)
            hi = L + 1 if hi is None else min(max(hi, -(L + 1)), L + 1)
            if var == "q":
                rows.append((max(lo, 0), min(hi + 1, L), 0, L, -INF, INF))
            elif var == "k":
                rows.append((0, L, max(lo, 0), min(hi + 1, L), -INF, INF))
            else:
                rows.append((0, L, 0, L, lo, hi))
        return Pieces.of(rows) if rows else Pieces.empty()

    def _inseg(self, node, env):
        if self.static:
            return _STATIC_MASK
        return segment_rows(self.L, self.seg, node.var, node.kind)


# ------------------------------------------------------------------ name checking

def _resolve(node, params: frozenset, lets: dict, err, where: dict):
    """Check names and arity in ``node``; collect whether segments are used."""
    if isinstance(node, _Num):
        return
    if isinstance(node, (_Name, _Call)):
        n = node.name
        is_call = isinstance(node, _Call)
        if n in params or n in RESERVED:
            if is_call:
                what = "a parameter" if n in params else "a position" if n in "qk" else "the sample length"
                raise err(f"`{n}` is {what}, not a mask or function: it cannot be called", node.line, node.col)
            return
        for a in getattr(node, "args", ()):
            _resolve(a, params, lets, err, where)
        nargs = len(node.args) if is_call else 0
        if n in lets:
            let = lets[n]
            want = let.params or ()
            if nargs != len(want):
                raise err(_arity_msg(n, want, nargs, "defined at line %d" % let.line), node.line, node.col)
            where["uses"] |= where["let_segments"][n]
            return
        if n in BUILTINS:
            b = BUILTINS[n]
            want = tuple(p.name for p in b.params)
            if nargs != len(want):
                raise err(_arity_msg(n, want, nargs, "builtin"), node.line, node.col)
            where["uses"] |= b.uses_segments
            return
        raise err(_unknown_msg(n, params, lets, where.get("later", {})), node.line, node.col)
    if isinstance(node, _Bin):
        _resolve(node.left, params, lets, err, where)
        _resolve(node.right, params, lets, err, where)
    elif isinstance(node, _Unary):
        _resolve(node.operand, params, lets, err, where)
    elif isinstance(node, _Chain):
        for t in node.terms:
            _resolve(t, params, lets, err, where)
    elif isinstance(node, _InSeg):
        where["uses"] = True


def _arity_msg(name, want, got, origin):
    sig = f"{name}({', '.join(want)})" if want else name
    if not want:
        return f"`{name}` takes no arguments, got {got} ({origin}: {sig})"
    return (f"`{name}` takes {len(want)} argument{'s' if len(want) > 1 else ''} "
            f"({', '.join(want)}), got {got} ({origin}: {sig})")


def _unknown_msg(name, params, lets, later):
    if name in later:
        return f"`{name}` is used before its definition at line {later[name]}; define it above its use"
    known = sorted(BUILTINS)
    mine = sorted(set(lets) | set(params))
    close = difflib.get_close_matches(name, known + mine + list(RESERVED), n=1)
    hint = f"did you mean `{close[0]}`? " if close else ""
    msg = f"unknown name `{name}`; {hint}known masks: {', '.join(BUILTINS[b].signature for b in known)}"
    if mine:
        msg += f"; defined here: {', '.join(mine)}"
    return msg + "; positions: q, k; sample length: L"


# ---------------------------------------------------------------------- programs

@dataclass(frozen=True, eq=False)
class MaskProgram:
    """A parsed, statically checked mask. Immutable; ``lower`` gives pieces."""

    source: str
    filename: str
    uses_segments: bool
    _lets: dict = field(repr=False, compare=False)
    _expr: Any = field(repr=False, compare=False)

    def __repr__(self):
        text = self.source.strip()
        return f"MaskProgram({self.filename if self.filename != '<mask>' else text!r})"

    def __eq__(self, other):
        return isinstance(other, MaskProgram) and (self.source, self.filename) == (other.source, other.filename)

    def __hash__(self):
        return hash((self.source, self.filename))

    @property
    def label(self) -> str:
        """A short name for pictures and reports: the file name, or the expression text."""
        if self.filename != "<mask>":
            return self.filename
        return " ".join(self.source.split())

    def lower(self, length: int, segments: tuple[tuple[str, int], ...] | None = None) -> Pieces:
        """Sample-relative disjoint pieces inside ``[0, length)^2``.

        ``segments``: ``((kind, length), ...)`` summing to ``length``; None is one
        segment of kind ``text``."""
        length = _check_length(length)
        seg = Segments.of(length, _check_segments(length, segments))
        ev = _Eval(self, length, seg)
        try:
            return ev.mask(self._expr, {})
        except RecursionError:
            raise MaskError("expression nested too deeply", self.filename) from None


def _check_length(length) -> int:
    if isinstance(length, (bool, np.bool_)) or not isinstance(length, (int, np.integer)) or length < 1:
        raise BatchError(f"sample length must be a positive integer, got {length!r}")
    return int(length)


def _check_segments(length, segments):
    if segments is None:
        return None
    segs = tuple((str(kind), int(n)) for kind, n in segments)
    if any(n < 1 for _, n in segs) or sum(n for _, n in segs) != length:
        raise BatchError(f"segments {list(segs)} must be positive lengths summing to the sample length {length}")
    return segs


def parse_mask(text: str, filename: str = "<mask>") -> MaskProgram:
    """Parse and statically check mask text (names, arity, parameter values, types)."""

    def err(msg, line, col):
        return MaskError(msg, filename, line, col, text)

    try:
        tree = _parser().parse(text)
        stmts = _ToAst(err).transform(tree)
    except UnexpectedInput as e:
        raise _syntax_error(e, text, filename) from None
    except VisitError as e:
        if isinstance(e.orig_exc, MaskError):
            raise e.orig_exc from None
        raise
    except RecursionError:
        raise MaskError("expression nested too deeply", filename) from None

    lets: dict[str, _Let] = {}
    let_segments: dict[str, bool] = {}
    later = {s.name: s.line for s in stmts if isinstance(s, _Let)}
    main = None
    for s in stmts:
        where = {"uses": False, "let_segments": let_segments,
                 "later": {n: l for n, l in later.items() if n not in lets}}
        if isinstance(s, _Let):
            if s.name in lets:
                raise err(f"`{s.name}` is already defined at line {lets[s.name].line}", s.line, s.col)
            _resolve(s.body, frozenset(s.params or ()), lets, err, where)
            lets[s.name] = s
            let_segments[s.name] = where["uses"]
        else:
            if main is not None:
                raise err(f"a second mask expression; a file has exactly one (the first is at line {main.line})",
                          s.line, s.col)
            _resolve(s.expr, frozenset(), lets, err, where)
            main, uses = s, where["uses"]
    if main is None:
        if not text.strip():
            raise MaskError("empty mask: write an expression such as `causal`", filename)
        raise MaskError("no mask expression: write one expression (e.g. `causal`) or `mask = EXPR`",
                        filename, *_end_position(text), text)

    prog = MaskProgram(text, filename, uses, dict(lets), main.expr)
    ev = _Eval(prog, None, None)
    try:
        for let in lets.values():
            if let.params is None:
                ev.eval(let.body, {})
        ev.mask(main.expr, {})
    except RecursionError:
        raise MaskError("expression nested too deeply", filename) from None
    return prog


def load_mask(arg: str) -> MaskProgram:
    """A path to an existing file, a path ending in ``.mask`` (then it must exist),
    or the mask expression itself (``"causal"``, ``"sliding_window(256)"``)."""
    if os.path.isfile(arg):
        try:
            text = Path(arg).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise MaskError(f"cannot read mask file: {e}", arg) from None
        return parse_mask(text, arg)
    if arg.endswith(".mask"):
        raise MaskError("mask file not found", arg)
    return parse_mask(arg)


# ------------------------------------------------------------------------ batches

def _batch_args(seqlens, segments):
    if isinstance(seqlens, Batch):
        seqlens, segments = seqlens.seqlens, seqlens.segments if segments is None else segments
    lens = [_check_length(n) for n in seqlens]
    if segments is not None and len(segments) != len(lens):
        raise BatchError(f"segments has {len(segments)} entries for {len(lens)} samples")
    return lens, segments


def lower_batch(mask: MaskProgram, seqlens, segments=None) -> Pieces:
    """The whole packed mask: sample ``i`` lowered and shifted to its offset.

    ``seqlens`` is a sequence of positive lengths (or a :class:`Batch`, whose
    segments are used); ``segments`` is None or one entry per sample (None or
    ``((kind, length), ...)``). Lowering is cached per distinct (length,
    segments) — segments only count when the mask uses them."""
    lens, segments = _batch_args(seqlens, segments)
    if not lens:
        return Pieces.empty()
    cache: dict = {}
    arrays = []
    for i, n in enumerate(lens):
        seg = segments[i] if segments is not None and mask.uses_segments else None
        key = (n, None if seg is None else tuple((str(a), int(b)) for a, b in seg))
        a = cache.get(key)
        if a is None:
            a = cache[key] = mask.lower(n, key[1]).a
        arrays.append(a)
    counts = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(lens), dtype=np.int64)
    np.cumsum(lens[:-1], out=offsets[1:])
    out = np.concatenate(arrays)
    out[:, :4] += np.repeat(offsets, counts)[:, None]
    return Pieces(out)


def density(pieces: Pieces, size: int, width: int = 64):
    """Allowed pairs per picture cell: ``(counts, areas, cell)``, both ``[n, n]``
    int64 arrays for an ``n x n`` grid of ``cell x cell`` token squares."""
    cell = max(1, -(-size // width))
    n = -(-size // cell)
    a = pieces.a
    for lo_col, hi_col in ((Q0, Q1), (K0, K1)):  # split at cell rows, then at cell columns
        first = a[:, lo_col] // cell
        span = (a[:, hi_col] - 1) // cell - first + 1
        idx = np.repeat(np.arange(len(a)), span)
        step = np.arange(len(idx)) - np.repeat(np.cumsum(span) - span, span)
        c = first[idx] + step
        a = a[idx]
        a[:, lo_col] = np.maximum(a[:, lo_col], c * cell)
        a[:, hi_col] = np.minimum(a[:, hi_col], (c + 1) * cell)
        a = normalize(a)
    counts = np.zeros((n, n), dtype=np.int64)
    np.add.at(counts, (a[:, Q0] // cell, a[:, K0] // cell), piece_counts(a))
    side = np.minimum(np.arange(1, n + 1) * cell, size) - np.arange(n) * cell
    return counts, side[:, None] * side[None, :], cell


def render(mask: MaskProgram, seqlens, segments=None, width: int = 64) -> str:
    """ASCII picture of the whole packed mask, one character per cell of
    ``cell x cell`` tokens: '#' all pairs allowed, '+' over half, '.' some, ' ' none."""
    lens, segments = _batch_args(seqlens, segments)
    pieces = lower_batch(mask, lens, segments)
    total = sum(lens)
    counts, area, cell = density(pieces, total, width)
    chars = np.where(counts == area, "#", np.where(2 * counts > area, "+", np.where(counts > 0, ".", " ")))
    pairs = int(counts.sum())
    head = (f"mask {mask.label}: {len(lens)} sample{'s' * (len(lens) != 1)}, {total} tokens, "
            f"{pairs} allowed pairs ({100 * pairs / total ** 2:.3g}% of the square)")
    legend = (f"1 char = {cell}x{cell} tokens; " if cell > 1 else "1 char = 1 token pair; ") + \
        "'#' all allowed, '+' over half, '.' some, ' ' none"
    border = "+" + "-" * chars.shape[1] + "+"
    rows = ["|" + "".join(r) + "|" for r in chars]
    return "\n".join([head, legend, border, *rows, border])
