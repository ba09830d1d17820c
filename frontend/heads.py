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

from .names import _children
from .tree import Call, Name

__all__ = ["HeadShare", "head_free_nodes"]


def _depends(root, dep: set[str]) -> dict[int, bool]:
    """For every node under ``root`` (by ``id``): whether it names ``h`` or a
    let in ``dep``. One post-order pass with an explicit stack."""
    out: dict[int, bool] = {}
    stack: list = [(root, False)]
    while stack:
        n, done = stack.pop()
        kids = _children(n)
        if done:
            own = isinstance(n, (Name, Call)) and (n.name == "h" or n.name in dep)
            out[id(n)] = own or any(out[id(c)] for c in kids)
        else:
            stack.append((n, True))
            stack.extend((c, False) for c in kids)
    return out


def head_free_nodes(lets: dict, expr) -> frozenset[int]:
    """``id`` of the maximal subexpressions evaluated without parameters that
    cannot depend on the query head (module doc)."""
    dep: set[str] = set()
    for name, let in lets.items():  # a let only uses lets defined above it
        if _depends(let.body, dep)[id(let.body)]:
            dep.add(name)
    out: set[int] = set()
    for root in [expr] + [let.body for let in lets.values() if not let.params]:
        depends, stack = _depends(root, dep), [root]
        while stack:
            n = stack.pop()
            if depends[id(n)]:
                stack.extend(_children(n))
            else:
                out.add(id(n))
    return frozenset(out)


@dataclass
class HeadShare:
    """Values of head-free subexpressions (:func:`head_free_nodes`) per sample, shared by the heads' lowerings."""

    nodes: frozenset[int]
    values: dict = field(default_factory=dict)  # (node id, sample key) -> value
