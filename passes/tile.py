"""tile{block=B,head_groups=G}: cut every sample into blocks of B tokens
(the last block of a sample may be short; nothing is padded) and the kv heads
into G groups; build the BlockGraph."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import PlanError
from ..ir.graph import build_graph, sample_cuts
from ..ir.module import PlanIR
from .base import Pass, register


@register
@dataclass(frozen=True, slots=True)
class Tile(Pass):
    name = "tile"
    block: int = 2048
    head_groups: int = 1

    def __post_init__(self):
        if self.block <= 0:
            raise PlanError(f"tile: block must be a positive integer, got {self.block}")
        if self.head_groups <= 0:
            raise PlanError(f"tile: head_groups must be a positive integer, got {self.head_groups}")

    def apply(self, ir: PlanIR) -> PlanIR:
        if self.head_groups > ir.problem.kv_heads:
            raise PlanError(f"tile: head_groups={self.head_groups} exceeds kv_heads={ir.problem.kv_heads}")
        g = build_graph(ir.problem, sample_cuts(ir.problem, self.block), self.head_groups)
        return ir.replace(graph=g, placement=None, schedule=None, program=None)
