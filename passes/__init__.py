"""Passes over the IR and their registry.

A pass is a small frozen dataclass: a ``name``, its options as fields, and
one ``apply(ir) -> ir`` that returns a new :class:`~attnplan.ir.module.PlanIR`.
A pipeline is text such as ``tile{block=1024},zigzag,comm,emit``
(:func:`parse_pipeline`); :func:`run_pipeline` applies it and runs the
verifier after every pass.

The built-in passes are listed here by name (:data:`BUILTIN`) and registered
when this package is imported; nothing is found by scanning modules.

Writing your own pass::

    from dataclasses import dataclass
    from attnplan.passes import Pass, register, unregister

    @register
    @dataclass(frozen=True, slots=True)
    class Reverse(Pass):
        name = "reverse_devices"            # the name used in pipeline text
        needs = ("placement",)              # IR levels that must exist before apply
        flip: bool = True                   # options: typed fields, ``reverse_devices{flip=false}``

        def apply(self, ir):
            ...                             # return a new IR: ir.with_levels(placement=...)

    attnplan.compile(seqlens=[4096], devices=4, pipeline="tile,zigzag,reverse_devices,comm,emit")
    unregister("reverse_devices")           # when done (tests, notebooks)

Set ``strategy = True`` (and ``default_comm``) on the class to make it usable
as ``compile(strategy=NAME)``. The verifier runs after your pass like after
any other (unless ``verify=False``): a pass that loses a compute block,
places a block on a device that does not exist or breaks a transfer fails
with a :class:`~attnplan.errors.VerifyError` naming it, before a plan is
written. Names of built-in passes cannot be taken or removed.
"""

from __future__ import annotations

import dataclasses

from ..errors import PlanError
from .base import REGISTRY, Pass, parse_pipeline, run_pipeline, strategies, strategy_entries, strategy_name
from .base import register as _register
from .comm import Comm, Overlap
from .dacp import Dacp
from .divide import Divide
from .emit import Emit
from .hypergraph import HypergraphPlacement
from .minheap import MinHeap
from .span import Span
from .per_doc import PerDoc
from .tile import Tile
from .tile_pool import TilePool
from .ulysses import Ulysses
from .usp import Usp
from .zigzag import Zigzag

BUILTIN: dict[str, type[Pass]] = {cls.name: cls for cls in (
    Tile,                                               # token blocks per sample, the block graph
    Zigzag, PerDoc, Ulysses, Usp, MinHeap, HypergraphPlacement, TilePool, Dacp, Span,   # placement strategies
    Comm, Overlap, Divide,                              # transfers, their overlap, stages
    Emit,                                               # lowering to per-device programs
)}

_SPEC_CHARS = set(",{}=") | {" ", "\t", "\n"}


def register(cls):
    """Register a pass class under its ``name`` (usable as a decorator).

    ``cls`` must be a dataclass subclassing :class:`Pass` with a non-empty
    ``name`` free of ``,{}=`` and spaces; re-registering a name of your own
    replaces it; a built-in pass's name cannot be taken."""
    if not (isinstance(cls, type) and issubclass(cls, Pass) and dataclasses.is_dataclass(cls)):
        raise PlanError(f"register: {cls!r} is not a dataclass subclass of attnplan.passes.Pass")
    name = cls.name
    if not isinstance(name, str) or not name or _SPEC_CHARS & set(name):
        raise PlanError(f"register: {cls.__name__}.name must be a non-empty name without ',{{}}=' or spaces, "
                        f"got {name!r}")
    if name in BUILTIN and BUILTIN[name] is not cls:
        raise PlanError(f"register: {name!r} is a built-in pass; choose another name for {cls.__name__}")
    return _register(cls)


def unregister(name: str) -> type[Pass]:
    """Remove a pass registered with :func:`register`; returns its class."""
    if name in BUILTIN:
        raise PlanError(f"unregister: {name!r} is a built-in pass and cannot be removed")
    if name not in REGISTRY:
        raise PlanError(f"unregister: no pass named {name!r} is registered")
    return REGISTRY.pop(name)


for _cls in BUILTIN.values():
    _register(_cls)

__all__ = ["BUILTIN", "REGISTRY", "Pass", "parse_pipeline", "register", "run_pipeline", "strategies",
           "strategy_entries", "strategy_name",
           "unregister"]
