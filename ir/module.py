"""PlanIR: the value passes rewrite. Each level is filled in by some pass."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .graph import BlockGraph
from .placement import Placement
from .problem import Problem
from .program import Program
from .schedule import Schedule


@dataclass(frozen=True, slots=True, eq=False)
class PlanIR:
    problem: Problem
    devices: int
    nodes: int = 1
    memory_cap: int | None = None  # bytes of buffers per device and phase; None = unlimited
    graph: BlockGraph | None = None
    placement: Placement | None = None
    schedule: Schedule | None = None
    program: Program | None = None

    def replace(self, **changes) -> "PlanIR":
        return dataclasses.replace(self, **changes)

    def to_text(self) -> str:
        parts = [self.problem.to_text()]
        for level in (self.graph, self.placement, self.schedule):
            if level is not None:
                parts.append(level.to_text())
        if self.program is not None:
            parts.append(self.program.to_text())
        return "\n".join(parts)
