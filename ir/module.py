"""PlanIR: the value passes rewrite. Each level is filled in by some pass.

Levels, top down: ``problem`` → ``graph`` → ``placement`` → ``schedule`` →
``program``; each is derived from the ones above it. Two ways to make a new
PlanIR:

* :meth:`PlanIR.with_levels` — what passes use: set some levels and clear
  every other level below them (a new graph invalidates the placement,
  schedule and program made for the old one).
* :meth:`PlanIR.replace` — explicit: exactly the fields given change, nothing
  is cleared (tests use it to build deliberately inconsistent IR for the
  verifier).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..errors import PlanError
from .graph import BlockGraph
from .placement import Placement
from .problem import Problem
from .program import Program
from .schedule import Schedule

LEVELS = ("problem", "graph", "placement", "schedule", "program")


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

    def replace(self, **changes) -> PlanIR:
        """A copy with exactly ``changes`` applied; no other field changes (no
        level is cleared). Passes use :meth:`with_levels`."""
        return dataclasses.replace(self, **changes)

    def with_levels(self, **levels) -> PlanIR:
        """A copy with the given IR levels set and every other level below
        the highest one given cleared (they were derived from what it
        replaces): ``with_levels(graph=g, placement=p)`` clears the schedule
        and the program, ``with_levels(schedule=s)`` the program. Only level
        names (:data:`LEVELS`) are accepted."""
        unknown = sorted(set(levels) - set(LEVELS))
        if unknown:
            raise PlanError(f"with_levels: {', '.join(unknown)} is not an IR level; levels: {', '.join(LEVELS)} "
                            f"(use replace() for other fields)")
        if not levels:
            return self
        highest = min(LEVELS.index(name) for name in levels)
        changes: dict[str, Any] = {name: None for name in LEVELS[highest + 1:]}
        changes.update(levels)
        return dataclasses.replace(self, **changes)

    # typed access to a level that must exist (PlanError naming it otherwise) ---------------------------
    def _need(self, name: str):
        level = getattr(self, name)
        if level is None:
            raise PlanError(f"this IR has no {name} yet: run a pass that makes one first")
        return level

    def need_graph(self) -> BlockGraph:
        return self._need("graph")

    def need_placement(self) -> Placement:
        return self._need("placement")

    def need_schedule(self) -> Schedule:
        return self._need("schedule")

    def need_program(self) -> Program:
        return self._need("program")

    def to_text(self) -> str:
        parts = [self.problem.to_text()]
        for level in (self.graph, self.placement, self.schedule):
            if level is not None:
                parts.append(level.to_text())
        if self.program is not None:
            parts.append(self.program.to_text())
        return "\n".join(parts)
