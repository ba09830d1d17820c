"""Evaluating mask expressions: to pieces for one sample, or (``length=None``)
only checking types and parameter values.

Two properties keep evaluation bounded whatever the text:

* No recursion: :meth:`Evaluator.run` drives one generator per node being
  evaluated from an explicit stack (a trampoline), so a 10,000-level nesting
  or a chain of 20,000 ``let`` definitions is as safe as a flat expression.
* Every definition is evaluated once per sample: results are memoised by
  (name, arguments), so ``let a1 = a0 | a0`` repeated 40 times costs 40
  evaluations, not 2^40. Whatever evaluation remains (calls with ever new
  arguments, large piece sets) is charged to a :class:`~.setops.Budget`.
"""

from __future__ import annotations

from fractions import Fraction
from types import GeneratorType
from typing import Any

import numpy as np

from attnplan.errors import MaskError
from attnplan.ir.mask import INF, Pieces, nonempty_row, tighten_row

from . import setops, unionsplit
from .cells import check_form, lower_chain
from .periodic import TermError, add, floordiv, mod, scale
from .setops import NODE_COST, Budget, LimitExceeded
from .stdlib import BUILTINS, Builtin, Segments, segment_rows
from .tree import Call, Chain, Fold, InSeg, Name, Num, Unary, start_of
from .values import (FLIP, STATIC_MASK, UNKNOWN, Lin, Per, RangeOverflow, arith, describe, fmt_lin, fmt_term,
                     interval, is_mask, is_num, is_term, lin, mk_lin, negate)

__all__ = ["Evaluator"]

_Q, _K = Lin(1, 0, 0), Lin(0, 1, 0)
_WORDS = {"&": "intersection", "|": "union"}


def _memo_key(v):
    """A hashable stand-in for an argument value (pieces by identity; the memo keeps them alive)."""
    return ("pieces", id(v)) if isinstance(v, Pieces) else v


def _tight(rows) -> Pieces:
    """``Pieces.of(rows)`` for a few rows in plain Python (:func:`attnplan.ir.mask.tighten_row`), without a
    dozen numpy calls a row (a 10,000-term union of comparisons spent half its time there)."""
    out = [r for r in (tighten_row(*row) for row in rows) if nonempty_row(r)]
    return Pieces(np.array(out, dtype=np.int64).reshape(-1, 6))


class Evaluator:
    """Evaluates expressions of ``prog``; with ``length=None`` it only checks (static mode)."""

    def __init__(self, prog, length: int | None, seg: Segments | None, budget: Budget | None = None,
                 cross: tuple[int, int] | None = None, head: int | None = None, share=None, sample=None):
        self.prog, self.seg, self.head = prog, seg, head
        self.share, self.sample = share, sample  # heads.HeadShare: head-free values kept across heads
        self.L: Any = length  # an int when lowering: the side of the square evaluated
        self.lq_lk: tuple[Any, Any] = cross if cross is not None else (length, length)
        self.static = length is None
        self.budget = budget if budget is not None else Budget()
        self.stack: list[tuple[str, int, int]] = []  # let calls being evaluated
        self.memo: dict = {}                          # (name, arg keys) -> (value, args)

    def err(self, msg, line, col) -> MaskError:
        for name, l, c in reversed(self.stack):
            msg += f" (in `{name}`, used at line {l}, col {c})"
        if not self.static:
            lq, lk = self.lq_lk
            msg += f" [sample length {self.L}]" if lq == lk == self.L else f" [cross sample Lq={lq}, Lk={lk}]"
            msg += f" [head {self.head}]" if self.head is not None else ""
        return MaskError(msg, self.prog.filename, line, col, self.prog.source)

    # ------------------------------------------------------------- driving
    def run(self, node, env: dict):
        """The value of ``node`` in ``env`` (a trampoline over the node generators)."""
        stack: list = []  # (generator, key under which its value is shared or None)
        value = None
        req: tuple | None = (node, env)
        while True:
            if req is not None:
                key = self._share_key(*req)
                if key is not None and key in self.share.values:
                    value = self.share.values[key]
                else:
                    value = self._visit(*req)
                    if isinstance(value, GeneratorType):
                        stack.append((value, key))
                        value = None
                    elif key is not None:
                        self.share.values[key] = value
            if not stack:
                return value
            try:
                req = stack[-1][0].send(value)
            except StopIteration as stop:
                key = stack.pop()[1]
                value, req = stop.value, None
                if key is not None:
                    self.share.values[key] = value

    def _share_key(self, node, env) -> tuple | None:
        """The key of ``node``'s value among the heads' shared values, if it is head-free and parameterless."""
        if self.share is None or env or id(node) not in self.share.nodes:
            return None
        return id(node), self.sample

    def mask(self, node, env, what="the mask expression") -> Any:
        v = self.run(node, env)
        if not is_mask(v):
            raise self.err(f"{what} must be a mask, got {describe(v)}", *start_of(node))
        return v

    def _visit(self, node, env):
        """A leaf's value, or a generator that yields ``(child, env)`` requests and returns the value."""
        try:
            self.budget.charge(NODE_COST, "one more expression node")
        except LimitExceeded as e:
            raise self.err(str(e), node.line, node.col) from None
        if isinstance(node, Num):
            return node.value
        if isinstance(node, Name):
            return self._name(node, env)
        if isinstance(node, Call):
            return self._call(node, node.args, env)
        if isinstance(node, Fold):
            return self._fold(node, env)
        if isinstance(node, Unary):
            return self._unary(node, env)
        if isinstance(node, Chain):
            return self._chain(node, env)
        if isinstance(node, InSeg):
            return STATIC_MASK if self.static else self._limited(segment_rows, node, self.L, self.seg, node.var,
                                                                node.kind)
        raise TypeError(f"not an expression node: {node!r}")  # pragma: no cover - the parser makes no other

    def _limited(self, fn, node, *args, line=None, col=None):
        """``fn(*args)``, with limit and range errors reported at ``node`` (or at line/col)."""
        try:
            return fn(*args)
        except (LimitExceeded, RangeOverflow) as e:
            if isinstance(e, RangeOverflow):
                e = f"arithmetic result out of range ({e}): numbers in a mask are at most 2^62 in magnitude"
            raise self.err(str(e), line or node.line, col or node.col) from None

    # --------------------------------------------------------------- names
    def _name(self, node, env):
        n = node.name
        if n == "q":
            return _Q
        if n == "k":
            return _K
        if n == "L":
            return UNKNOWN if self.static else self.L
        if n in ("Lq", "Lk"):
            return UNKNOWN if self.static else self.lq_lk[n == "Lk"]
        if n == "h":
            if self.static:
                return UNKNOWN
            if self.head is None:
                raise self.err("this mask uses the query head `h`: give a head (plan mask --head H, "
                               "MaskProgram.lower(..., head=H)); attnplan.compile lowers every head", node.line,
                               node.col)
            return self.head
        if n in env:
            return env[n]
        return self._call(node, (), env)

    def _call(self, node, arg_nodes, env):
        args = []
        for a in arg_nodes:
            args.append((yield (a, env)))
        let = self.prog._lets.get(node.name)
        if let is None:
            return self._builtin(node, arg_nodes, args)
        key = (node.name, tuple(_memo_key(a) for a in args))
        if key in self.memo:
            return self.memo[key][0]
        self.stack.append((node.name, node.line, node.col))
        value = yield (let.body, dict(zip(let.params or (), args)))
        self.stack.pop()
        self.memo[key] = (value, args)
        return value

    def _builtin(self, node, arg_nodes, args):
        b: Builtin = BUILTINS[node.name]
        for p, a, v in zip(b.params, arg_nodes, args):
            if not is_num(v):
                raise self.err(f"{b.name}: {p.name} ({p.doc}) must be a number, got {describe(v)}", *start_of(a))
            problem = None if v is UNKNOWN else p.problem(v)
            if problem:
                raise self.err(f"{b.name}: {problem}", *start_of(a))
        fit = b.check(*args) if b.check is not None and all(v is not UNKNOWN for v in args) else None
        if fit:
            raise self.err(f"{b.name}: {fit[1]}", *start_of(arg_nodes[fit[0]]))
        if self.static:
            return STATIC_MASK
        size = b.max_pieces(self.L, self.seg, *args)
        self._limited(setops.check_pieces, node, size, f"`{b.signature}` on this sample")
        self._limited(self.budget.charge, node, setops.build_cost(size), f"building `{b.name}`")
        return b.build(self.L, self.seg, *args)

    # -------------------------------------------------------- operators
    def _fold(self, node: Fold, env):
        values = []
        for t in node.terms:
            values.append((yield (t, env)))
        if node.ops[0][0] in _WORDS:
            return self._setop(node, values, not env)
        acc = values[0]
        for (op, line, col), right, v in zip(node.ops, node.terms[1:], values[1:]):
            acc = self._arith(op, acc, v, node.terms[0], right, line, col)
        return acc

    def _setop(self, node: Fold, values, top: bool = False):
        op = node.ops[0][0]
        for i, (v, t) in enumerate(zip(values, node.terms)):
            if not is_mask(v):
                side = "left" if i == 0 else "right"
                raise self.err(f"the {side} side of `{op}` ({_WORDS[op]}) must be a mask, got {describe(v)}",
                               *start_of(t))
        if self.static:
            return STATIC_MASK
        if top and self.share is not None:
            values = self._share_terms(node, values)
        if op == "|":
            apart = self._limited(setops.union_apart, node, values, self.budget)
            if apart is not None:
                return apart
            if len(values) >= unionsplit.MIN_OPERANDS:
                return self._limited(unionsplit.union_split, node, values, self.budget)
        fn = setops.intersect if op == "&" else setops.union
        acc = values[0]
        for (_, line, col), v in zip(node.ops, values[1:]):
            acc = self._limited(fn, node, acc, v, self.budget, line=line, col=col)
        return acc

    def _share_terms(self, node: Fold, values: list) -> list:
        """Per-head lowering (:mod:`.heads`): the head-free terms of a union or
        an intersection combined once per sample (the operation is associative
        and commutative), then the terms that depend on the head."""
        free = [v for v, t in zip(values, node.terms) if id(t) in self.share.nodes]
        rest = [v for v, t in zip(values, node.terms) if id(t) not in self.share.nodes]
        if len(free) < 2 or not rest:
            return values
        key = (id(node), "terms", self.sample)
        if key not in self.share.values:
            fn = setops.intersect if node.ops[0][0] == "&" else setops.union
            acc = free[0]
            for v in free[1:]:
                acc = self._limited(fn, node, acc, v, self.budget)
            self.share.values[key] = acc
        return [self.share.values[key], *rest]

    def _arith(self, op, a, b, left, right, line, col):
        for side, v, sub in (("left", a, left), ("right", b, right)):
            if is_mask(v):
                raise self.err(f"the {side} side of `{op}` must be a number or a position term, got a mask",
                               *start_of(sub))
        return self._limited(self._linear, None, op, a, b, line, col, line=line, col=col)

    def _linear(self, op, a, b, line, col):
        if is_num(a) and is_num(b):
            if op in ("//", "%") and b == 0:
                raise self.err("division by zero", line, col)
            return arith(op, a, b)
        if op in ("//", "%") or isinstance(a, Per) or isinstance(b, Per):
            return self._periodic(op, a, b, line, col)
        if op in "+-":
            x, y = lin(a), lin(b)
            return mk_lin(arith(op, x.cq, y.cq), arith(op, x.ck, y.ck), arith(op, x.c, y.c))
        if op == "*":
            if isinstance(a, Lin) and isinstance(b, Lin):
                raise self.err(f"`({fmt_lin(a)}) * ({fmt_lin(b)})` multiplies two position terms; "
                               f"a comparison must stay linear in q and k", line, col)
            term, s = (a, b) if isinstance(a, Lin) else (b, a)
            return mk_lin(arith("*", term.cq, s), arith("*", term.ck, s), arith("*", term.c, s))
        raise TypeError(f"not an arithmetic operator: {op!r}")  # pragma: no cover - the grammar has no other

    def _periodic(self, op, a, b, line, col):
        """``a op b`` where a floor of a position is involved (:mod:`.periodic`)."""
        try:
            if op in "+-":
                return add(a, b, 1 if op == "+" else -1)
            if op == "*":
                if is_term(a) and is_term(b):
                    raise self.err(f"`({fmt_term(a)}) * ({fmt_term(b)})` multiplies two position terms; "
                                   f"a comparison must stay linear in q and k", line, col)
                return scale(*((a, b) if is_term(a) else (b, a)))
            if is_term(b):
                raise self.err(f"the right side of `{op}` must be a positive integer, got {describe(b)}: "
                               f"`{op}` by a position (`q {op} k`) cannot be lowered to pieces", line, col)
            if b == 0:
                raise self.err("division by zero", line, col)
            return floordiv(a, b) if op == "//" else mod(a, b)
        except TermError as e:
            raise self.err(str(e), line, col) from None

    def _unary(self, node: Unary, env):
        v = yield (node.operand, env)
        if node.op == "!":
            if not is_mask(v):
                raise self.err(f"`!` (complement) needs a mask, got {describe(v)}", *start_of(node.operand))
            return STATIC_MASK if self.static else self._limited(setops.complement, node, v, self.L, self.budget)
        if is_mask(v):
            raise self.err("unary `-` needs a number or a position term, got a mask", node.line, node.col)
        return self._limited(negate, node, v)

    # ------------------------------------------------------ comparisons
    def _chain(self, node: Chain, env):
        values = []
        for t in node.terms:
            values.append((yield (t, env)))
        for v, t in zip(values, node.terms):
            if is_mask(v):
                raise self.err("a comparison compares numbers and position terms (q, k), not masks; "
                               "combine masks with & and |", *start_of(t))
        if any(isinstance(v, Per) for v in values):
            return self._periodic_chain(node, values)
        result = None
        for (op, line, col), a, b in zip(node.ops, values, values[1:]):
            m = self._compare(op, a, b, line, col)
            if self.static:
                result = STATIC_MASK
            else:
                result = m if result is None else self._limited(setops.intersect, node, result, m, self.budget,
                                                                line=line, col=col)
        return result

    def _periodic_chain(self, node: Chain, values):
        """A chain with floors of positions: checked link by link, lowered as one conjunction."""
        links = []
        for (op, line, col), a, b in zip(node.ops, values, values[1:]):
            e = self._limited(add, node, a, b, -1, line=line, col=col)
            try:
                check_form(e, op)
            except TermError as err:
                raise self.err(str(err), line, col) from None
            links.append((e, op))
        if self.static:
            return STATIC_MASK
        try:
            return self._limited(lower_chain, node, self.L, links, self.budget, line=node.ops[0][1],
                                 col=node.ops[0][2])
        except TermError as err:
            raise self.err(str(err), node.ops[0][1], node.ops[0][2]) from None

    def _compare(self, op, a, b, line, col):
        d, e = lin(a), lin(b)
        cq, ck, c = (arith("-", x, y) if x is UNKNOWN or y is UNKNOWN else x - y
                     for x, y in ((d.cq, e.cq), (d.ck, e.ck), (d.c, e.c)))
        if cq is UNKNOWN or ck is UNKNOWN:
            return STATIC_MASK if self.static else None  # never reached when lowering
        var, coef = self._comparison_form(op, cq, ck, c, line, col)
        if self.static or c is UNKNOWN:
            return STATIC_MASK
        return self._compare_rows(op, var, coef, c)

    def _comparison_form(self, op, cq, ck, c, line, col):
        """Which of ``k - q``, ``k``, ``q`` (or nothing) the comparison constrains, and its coefficient."""
        if cq == 0 and ck == 0:
            return None, None
        if ck == 0:
            return "q", cq
        if cq == 0:
            return "k", ck
        if cq == -ck:
            return "k - q", ck
        raise self.err(f"this comparison reduces to `{fmt_lin(Lin(cq, ck, c))} {op} 0`, which is not of the form "
                       f"`k - q OP c`, `k OP c` or `q OP c`", line, col)

    def _compare_rows(self, op, var, coef, c) -> Pieces:
        L = self.L
        if var is None:  # constant truth
            holds = {"<": c < 0, "<=": c <= 0, ">": c > 0, ">=": c >= 0, "==": c == 0, "!=": c != 0}[op]
            return Pieces.rect(0, L, 0, L) if holds else Pieces.empty()
        # coef*x + c OP 0  <=>  x OP' -c/coef
        t = Fraction(-c) / Fraction(coef)
        if coef < 0:
            op = FLIP[op]
        rows = []
        for low, high in interval(op, t):
            # clamp to just outside the sample: same pairs, no int64 overflow
            lo = -(L + 1) if low is None else min(max(low, -(L + 1)), L + 1)
            hi = L + 1 if high is None else min(max(high, -(L + 1)), L + 1)
            if var == "q":
                rows.append((max(lo, 0), min(hi + 1, L), 0, L, -INF, INF))
            elif var == "k":
                rows.append((0, L, max(lo, 0), min(hi + 1, L), -INF, INF))
            else:
                rows.append((0, L, 0, L, lo, hi))
        return _tight(rows) if rows else Pieces.empty()
