"""Keeping the forward's KV where the memory allows it.

A step problem with ``keep_kv`` asks every micro-batch's attention to keep
the K and V each device received in its forward until its backward
(:class:`attnplan.ir.problem.Problem`): no KV moves in the backward, and
without recompute each layer holds those bytes from its forward to its
backward. The systems size micro-batches by tokens and know nothing of it,
so a micro-batch that fits without kept KV may not fit with it. Refusing
the step then would turn an option that saves time into one that loses
plans: :func:`keep_where_it_fits` instead lowers such micro-batches without
``keep_kv`` (recorded in :attr:`attnplan.step.ir.StepPlan.mb_unkept`) until
every device is under the cap or no kept KV is left on the devices over it.

The rule, one round after another, for every device over the cap: the
micro-batch that sets its peak stops keeping if it keeps (a plan that keeps
may also be placed differently, so it may need more there even where it
keeps nothing); where it does not keep (a pipeline's peak also counts the KV
that micro-batches in flight hold), the one keeping the most bytes on that
device stops (ties: the lowest). Each round drops at least one micro-batch, so it
ends within as many rounds as there are micro-batches. Systems choose each
micro-batch's strategy with the plans they see, so a step can still be over
the cap where the same system without ``keep_kv`` would fit; then the step
is planned without ``keep_kv`` at all (:func:`attnplan.step.driver.compile_step`,
``info`` says so), and what still exceeds the cap is refused as before
(:func:`attnplan.step.verify.verify_lowered`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from .ir import StepPlan
from .lower import Lowered, lower_mb

Peaks = Callable[[StepPlan, list], tuple[np.ndarray, np.ndarray]]


def _kept_on(plan: StepPlan, low: Lowered, m: int, device: int) -> int:
    """Bytes of KV micro-batch ``m`` keeps on global rank ``device`` (0 where it does not run there)."""
    pos = np.flatnonzero(plan.mb_ranks(m) == device)
    return int(low.kept[pos[0]]) if len(pos) else 0


def culprits(plan: StepPlan, lowered: list, over: np.ndarray, peak_mb: np.ndarray) -> set[int]:
    """The micro-batches that stop keeping this round (the module doc's rule)."""
    drop: set[int] = set()
    keeping = [m for m in range(plan.n_mb) if plan.mb_keeps_kv(m)]
    for d in over.tolist():
        m = int(peak_mb[d])
        if m >= 0 and plan.mb_keeps_kv(m):
            drop.add(m)
        else:
            held = [(-_kept_on(plan, lowered[k], k, d), k) for k in keeping]
            held = [h for h in held if h[0] < 0]
            if held:
                drop.add(min(held)[1])
    return drop


def keep_where_it_fits(plan: StepPlan, lowered: list, peaks: Peaks, cap: int
                       ) -> tuple[StepPlan, list, np.ndarray, np.ndarray]:
    """``plan`` and its lowered micro-batches with as few as the rule gives lowered without kept KV, and their
    peak bytes per rank and the micro-batch setting each (``peaks(plan, lowered)``)."""
    peak, peak_mb = peaks(plan, lowered)
    if not plan.problem.keep_kv:
        return plan, lowered, peak, peak_mb
    lowered = list(lowered)
    while True:
        drop = culprits(plan, lowered, np.flatnonzero(peak > cap), peak_mb)
        if not drop:
            return plan, lowered, peak, peak_mb
        plan = dataclasses.replace(plan, mb_unkept=tuple(sorted(set(plan.mb_unkept) | drop)))
        for m in sorted(drop):
            lowered[m] = lower_mb(plan, m)
        peak, peak_mb = peaks(plan, lowered)
