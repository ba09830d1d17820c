"""tile{block=B,head_groups=G,pack=true}: cut every sample longer than B into
blocks of B tokens (the last block of a sample may be short; nothing is
padded), pack consecutive samples of at most B tokens into shared blocks of at
most B tokens (varlen groups: one compute block runs the tiles of all their
documents; ``pack=false``: one block per short sample), cut the kv heads into
G groups; build the BlockGraph (:func:`attnplan.ir.graph.sample_cuts`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import PlanError
from ..ir.graph import build_graph, sample_cuts
from ..ir.limits import MAX_BLOCK_SIZE, MAX_HEADS
from ..ir.module import PlanIR
from .base import Pass, register


@register
@dataclass(frozen=True, slots=True)
class Tile(Pass):
    name = "tile"
    block: int = 2048
    head_groups: int = 1
    pack: bool = True

    def __post_init__(self):
        for name, hi, limit in (("block", MAX_BLOCK_SIZE, "MAX_BLOCK_SIZE"), ("head_groups", MAX_HEADS, "MAX_HEADS")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
                raise PlanError(f"tile: {name} must be an integer in [1, {hi}] ({limit}), got {v!r}")
        if not isinstance(self.pack, bool):
            raise PlanError(f"tile: pack must be true or false, got {self.pack!r}")

    def apply(self, ir: PlanIR) -> PlanIR:
        if self.head_groups > ir.problem.kv_heads:
            raise PlanError(f"tile: head_groups={self.head_groups} exceeds kv_heads={ir.problem.kv_heads}")
        g = build_graph(ir.problem, sample_cuts(ir.problem, self.block, self.pack), self.head_groups)
        return ir.with_levels(graph=g)
