"""Planning one training step end to end, the same for every system:

    system (batch pass) ── apply ──▶ StepPlan ── verify_plan
      ── lower every micro-batch (frontend + attention passes, verified after each pass; cached)
      ── simulate the whole step, peak memory per device (with keep_kv: kept KV only where it fits, step/kept.py;
         where that leaves some micro-batches keeping and some not, the step without keep_kv if it is faster)
      ── verify_lowered (plans match, memory under the cap)

:func:`compile_step` returns a :class:`CompiledStep`; ``plan_s`` (wall
seconds, all of the above) is measured, never part of a plan.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from ..errors import PlanError, StepError
from .base import StepPass, parse_system
from .ir import StepPlan, StepProblem
from .kept import keep_where_it_fits
from .lower import Lowered, cache_of, lower_or_fall_back
from .pipeline import align_slots, build_schedule, verify_schedule
from .pipesim import mb_parts, simulate_pipeline, stage_memory
from .simulate import memory, simulate_step
from .verify import verify_lowered, verify_plan


@dataclass(frozen=True, slots=True, eq=False)
class CompiledStep:
    plan: StepPlan
    lowered: tuple[Lowered, ...]
    report: dict
    measured: dict = field(default_factory=dict)


def pipelined(plan: StepPlan) -> bool:
    """Whether the step runs on a pipeline schedule: stages (``pp > 1``) or chunks carrying KV."""
    return plan.problem.mesh.pp > 1 or plan.chunk_keep >= 1


def step_peaks(plan: StepPlan, lowered: list[Lowered], sch=None) -> tuple:
    """Peak bytes per device and the micro-batch that sets each: per pipeline stage under the schedule
    ``sch`` (:func:`build_schedule`, where :func:`pipelined`), else per rank."""
    return stage_memory(plan, sch, mb_parts(plan, lowered), lowered) if sch is not None else memory(plan, lowered)


def compile_step(problem: StepProblem, system: str | StepPass = "fixed", verify: bool = True) -> CompiledStep:
    """Plan ``problem`` with ``system`` (a name, ``name{opt=value}`` text or a pass), lower, verify, simulate."""
    t0 = time.perf_counter()
    sp = parse_system(system)
    plan = align_slots(sp.apply(problem))  # the interleaved schedule's multiple of pp slots (vp > 1)
    if verify:
        verify_plan(plan)
    plan, lowered = lower_or_fall_back(plan)  # a strategy its group cannot lower gives way to one that can
    sch = build_schedule(plan) if pipelined(plan) else None
    if verify and sch is not None:
        verify_schedule(plan, sch)

    def peaks(plan: StepPlan, lowered: list) -> tuple:
        return step_peaks(plan, lowered, sch)
    # with keep_kv, a micro-batch whose kept KV would exceed the cap does without it (step/kept.py)
    plan, lowered, peak, peak_mb = keep_where_it_fits(plan, lowered, peaks, problem.cap)
    if problem.keep_kv and (peak > problem.cap).any():  # the system chose for kept KV: plan it without
        return _without_kept(problem, sp, verify, t0)
    if verify:
        verify_lowered(plan, lowered, peak, peak_mb, problem.cap)
    report = simulate_pipeline(plan, lowered, sch) if sch is not None else simulate_step(plan, lowered)
    if plan.mb_unkept:  # some keep and some do not, as no system chose: the step without kept KV if faster
        try:
            plain = _without_kept(problem, sp, verify, t0, _SLOWER)
            if plain.report["step_s"] < report["step_s"]:
                return plain
        except (StepError, PlanError):  # the system cannot plan the step without kept KV (its sizing, the cap)
            pass
    plan_s = time.perf_counter() - t0
    report["plan_s"] = plan_s
    return CompiledStep(plan, tuple(lowered), report, {"plan_s": plan_s})


_OVER = "the forward's KV is kept in no micro-batch: with it the step exceeds the memory cap"
_SLOWER = ("the forward's KV is kept in no micro-batch: kept only where it fits, the step is slower than "
           "without it")


def _without_kept(problem: StepProblem, sp: StepPass, verify: bool, t0: float, why: str = _OVER
                  ) -> CompiledStep:
    """The step planned without ``keep_kv`` (its micro-batches chosen for plans that do not keep), ``why``
    in its ``info``: with kept KV, even where it fits (step/kept.py), a device exceeds the cap, or the
    step that keeps it only in some micro-batches is slower."""
    plain = dataclasses.replace(problem, keep_kv=False, cache=cache_of(problem).without_kept())
    c = compile_step(plain, sp, verify)
    note = ("keep_kv", why)
    plan = dataclasses.replace(c.plan, info=tuple(c.plan.info) + (note,))
    report = {**c.report, "info": plan.info_dict(), "plan_s": time.perf_counter() - t0}
    return CompiledStep(plan, c.lowered, report, {"plan_s": report["plan_s"]})
