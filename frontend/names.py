"""Name checking: every name a mask uses is a parameter, ``q k L Lq Lk``, a ``let``
defined above, or a builtin, called with the right number of arguments.
Also finds whether the mask depends on segments. Walks with an explicit
stack, so an expression of any depth is checked without recursion."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Callable

from attnplan.errors import MaskError

from .stdlib import BUILTINS
from .tree import RESERVED, Call, Chain, Fold, InSeg, Let, Name, Unary

__all__ = ["Scope", "mentions", "resolve"]

Err = Callable[..., MaskError]  # (message, line, col) -> MaskError


@dataclass
class Scope:
    """The definitions seen so far while checking a file top to bottom."""
    lets: dict = field(default_factory=dict)           # name -> Let
    let_segments: dict = field(default_factory=dict)   # name -> whether it uses segments
    all_lets: dict = field(default_factory=dict)       # name -> line of every let in the file


def _children(node) -> tuple:
    if isinstance(node, Call):
        return node.args
    if isinstance(node, (Fold, Chain)):
        return node.terms
    if isinstance(node, Unary):
        return (node.operand,)
    return ()


def resolve(expr, params: frozenset, scope: Scope, err: Err) -> bool:
    """Check the names in ``expr`` left to right (a call's arguments before its
    name); return whether it uses segments."""
    uses = False
    stack: list = [expr]
    while stack:
        node = stack.pop()
        if isinstance(node, tuple):  # (call,): its arguments are checked, now its name
            uses |= _check_name(node[0], params, scope, err)
            continue
        if isinstance(node, InSeg):
            uses = True
        elif isinstance(node, Name) or (isinstance(node, Call) and (node.name in params or node.name in RESERVED)):
            uses |= _check_name(node, params, scope, err)
        elif isinstance(node, Call):
            stack.append((node,))
        stack.extend(reversed(_children(node)))
    return uses


def mentions(exprs, name: str) -> bool:
    """Whether any of ``exprs`` names ``name`` (walked with an explicit stack)."""
    stack = list(exprs)
    while stack:
        node = stack.pop()
        if isinstance(node, Name) and node.name == name:
            return True
        stack.extend(_children(node))
    return False


def _check_name(node, params: frozenset, scope: Scope, err: Err) -> bool:
    """Check one name or call (not its arguments); return whether it uses segments."""
    n = node.name
    is_call = isinstance(node, Call)
    if n in params or n in RESERVED:
        if is_call:
            what = ("a parameter" if n in params else "a position" if n in ("q", "k")
                    else "the query head" if n == "h" else "a sample length")
            raise err(f"`{n}` is {what}, not a mask or function: it cannot be called", node.line, node.col)
        return False
    nargs = len(node.args) if is_call else 0
    if n in scope.lets:
        let: Let = scope.lets[n]
        want = let.params or ()
        if nargs != len(want):
            raise err(_arity_msg(n, want, nargs, "defined at line %d" % let.line), node.line, node.col)
        return scope.let_segments[n]
    if n in BUILTINS:
        b = BUILTINS[n]
        want = tuple(p.name for p in b.params)
        if nargs != len(want):
            raise err(_arity_msg(n, want, nargs, "builtin"), node.line, node.col)
        return b.uses_segments
    raise err(_unknown_msg(n, params, scope), node.line, node.col)


def _arity_msg(name, want, got, origin):
    sig = f"{name}({', '.join(want)})" if want else name
    if not want:
        return f"`{name}` takes no arguments, got {got} ({origin}: {sig})"
    return (f"`{name}` takes {len(want)} argument{'s' if len(want) > 1 else ''} "
            f"({', '.join(want)}), got {got} ({origin}: {sig})")


def _unknown_msg(name, params, scope: Scope):
    if name in scope.all_lets:
        return f"`{name}` is used before its definition at line {scope.all_lets[name]}; define it above its use"
    known = sorted(BUILTINS)
    mine = sorted(set(scope.lets) | set(params))
    close = difflib.get_close_matches(name, known + mine + list(RESERVED), n=1)
    hint = f"did you mean `{close[0]}`? " if close else ""
    msg = f"unknown name `{name}`; {hint}known masks: {', '.join(BUILTINS[b].signature for b in known)}"
    if mine:
        shown = ", ".join(mine[:20]) + (f", ... ({len(mine)} in all)" if len(mine) > 20 else "")
        msg += f"; defined here: {shown}"
    return msg + "; positions: q, k; sample lengths: L, Lq, Lk; query head: h"
