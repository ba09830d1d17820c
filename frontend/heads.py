"""Per-head lowering without repeating what does not depend on the head.

A mask that uses ``h`` is lowered once per query head (``lower.lower_heads``).
Most of its work rarely depends on ``h``: in
``(h < 4 & q // 64 == k // 64) | (h >= 4 & (k - q) % 64 == 0)`` only the two
head tests do. :func:`head_free_nodes` finds the largest subexpressions that
cannot depend on ``h`` — they name neither ``h`` nor a ``let`` that does —
among the nodes evaluated without parameters (the mask expression and the
bodies of parameterless ``let``s); :class:`HeadShare` keeps their values per
sample, so every head after the first reuses them."""

from __future__ import annotations

from dataclasses import dataclass, field

from .names import _children, mentions
from .tree import Call, Name

__all__ = ["HeadShare", "head_free_nodes"]


def _calls(node) -> set[str]:
    """Names a subexpression names or calls (explicit stack)."""
    out, stack = set(), [node]
    while stack:
        n = stack.pop()
        if isinstance(n, (Name, Call)):
            out.add(n.name)
        stack.extend(_children(n))
    return out


def head_free_nodes(lets: dict, expr) -> frozenset[int]:
    """``id`` of the maximal subexpressions evaluated without parameters that
    cannot depend on the query head (module doc)."""
    dep: set[str] = set()
    for name, let in lets.items():  # a let only uses lets defined above it
        if mentions([let.body], "h") or _calls(let.body) & dep:
            dep.add(name)
    roots = [expr] + [let.body for let in lets.values() if not let.params]
    out, stack = set(), list(roots)
    while stack:
        n = stack.pop()
        if not mentions([n], "h") and not (_calls(n) & dep):
            out.add(id(n))
            continue
        stack.extend(_children(n))
    return frozenset(out)


@dataclass
class HeadShare:
    """Values of head-free subexpressions (:func:`head_free_nodes`) per sample, shared by the heads' lowerings."""

    nodes: frozenset[int]
    values: dict = field(default_factory=dict)  # (node id, sample key) -> value
