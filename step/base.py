"""Batch passes (one per system of the survey) and their registry.

A batch pass is a frozen dataclass with a ``name``, its options as typed
fields and one ``apply(problem: StepProblem) -> StepPlan``; it is registered
by name (:func:`register_system`), and a system is written as text like a
pipeline item: ``wlb{micro=2,inner=zigzag}``. A pass decides which documents
go together, on which group of ranks, in which order and with which
attention strategy; lowering, verification and the whole-step simulation are
the same for every pass (:func:`attnplan.step.compile_step`). Writing one::

    from dataclasses import dataclass
    from attnplan.step import StepPass, build_plan, register_system

    @register_system
    @dataclass(frozen=True, slots=True)
    class OneGroup(StepPass):
        name = "one_group"                  # the name in --systems and in text
        strategy: str = "minheap"           # options: typed fields, one_group{strategy=zigzag}

        def apply(self, problem):
            ranks = list(range(problem.mesh.stage_devices))
            docs = list(range(problem.docs))
            return build_plan(problem, self.spec(), [docs], [ranks], [0], [self.strategy])

A pass must be a pure function of the problem (state carried between steps,
like WLB-LLM's outlier queue, is ``problem.carried`` in and ``queue_out``
out); it may use ``attnplan.step.lower.cache_of(problem)`` to lower and
simulate candidate micro-batches, which the step's lowering then reuses.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from ..errors import StepError
from ..passes.base import instantiate
from .ir import StepPlan, StepProblem

SYSTEMS: dict[str, type[StepPass]] = {}
BUILTIN_SYSTEMS: dict[str, type[StepPass]] = {}  # attnplan.step.systems, entered when attnplan.step loads
_SPEC_CHARS = set(",{}=") | {" ", "\t", "\n"}


@dataclass(frozen=True, slots=True)
class StepPass:
    name: ClassVar[str] = ""

    def apply(self, problem: StepProblem) -> StepPlan:  # pragma: no cover - abstract
        raise NotImplementedError

    def carries_state(self) -> bool:
        """Whether this pass's plans may queue documents for a later step (``queue_out``), so that step
        ``n + 1`` must be planned with step ``n``'s queue as its ``carried`` documents (the step loader
        then plans the steps as a chain, in order). A pass with a queue must place every carried
        document when a step brings no new ones (the end of the data: the queue drains)."""
        return False

    def spec(self) -> str:
        opts = ",".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))
        return f"{self.name}{{{opts}}}" if opts else self.name


def register_system(cls):
    """Register a batch pass class under its ``name`` (usable as a decorator);
    re-registering a name replaces it, except a built-in one."""
    if not (isinstance(cls, type) and issubclass(cls, StepPass) and dataclasses.is_dataclass(cls)):
        raise StepError(f"register_system: {cls!r} is not a dataclass subclass of attnplan.step.StepPass")
    name = cls.name
    if not isinstance(name, str) or not name or _SPEC_CHARS & set(name):
        raise StepError(f"register_system: {cls.__name__}.name must be a non-empty name without ',{{}}=' or "
                        f"spaces, got {name!r}")
    if name in BUILTIN_SYSTEMS and BUILTIN_SYSTEMS[name] is not cls:
        raise StepError(f"register_system: {name!r} is a built-in system; choose another name for {cls.__name__}")
    SYSTEMS[name] = cls
    return cls


def unregister_system(name: str) -> type[StepPass]:
    if name in BUILTIN_SYSTEMS:
        raise StepError(f"unregister_system: {name!r} is a built-in system and cannot be removed")
    if name not in SYSTEMS:
        raise StepError(f"unregister_system: no system named {name!r} is registered")
    return SYSTEMS.pop(name)


def system_names() -> tuple[str, ...]:
    """Names of the registered systems, built-in ones first in their table's order."""
    return tuple(SYSTEMS)


def parse_system(spec) -> StepPass:
    """``name{opt=value,...}`` → a batch pass instance (StepError on unknown names or options)."""
    if isinstance(spec, StepPass):
        return spec
    if not isinstance(spec, str) or not spec.strip() or len(spec) > 1000:
        raise StepError(f"a system is a name such as fixed or wlb{{micro=2}}, got {spec!r:.60}")
    name, brace, rest = spec.strip().partition("{")
    name = name.strip()
    if name not in SYSTEMS:
        raise StepError(f"unknown system {name[:40]!r}; known: {', '.join(SYSTEMS)}")
    if brace and (not rest.endswith("}") or "{" in rest):
        raise StepError(f"system {spec[:60]!r}: expected name{{opt=value,...}}")
    return instantiate(SYSTEMS[name], f"system {name}", rest[:-1], StepError)


def check_int(owner: str, key: str, v, lo: int, hi: int) -> None:
    """An option's integer range (StepError naming it)."""
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise StepError(f"{owner}: {key} must be an integer in {lo:,}..{hi:,}, got {v!r:.40}")
