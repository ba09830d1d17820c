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

The rule is a greedy descent on the bytes over the cap (summed over the
devices): each round tries, one at a time, every micro-batch that keeps KV
and runs on a device over the cap, and drops the one that leaves the least
excess (ties: the lowest), until the step fits or no kept KV is left on
the devices over the cap. A drop is not always a saving: a micro-batch
without kept KV moves its KV again in the backward and may need more
buffer at its own peak than its kept KV cost it, and in a pipeline the
peak also counts the KV that micro-batches in flight hold, which only some
of them do at the peak's moment; so a round may have to drop one that
lowers nothing by itself. Once the step fits, every dropped micro-batch in
order keeps its KV again where the step still fits: a drop an earlier
round needed may not be needed after later ones, and no drop is left that
the step does without. At most as many rounds as micro-batches, each
trying every candidate once (its plan without kept KV is cached).

Systems choose each micro-batch's strategy with the plans they see, so a
step can still be over the cap where the same system without ``keep_kv``
would fit; then the step is planned without ``keep_kv`` at all (:func:`attnplan.step.driver.compile_step`,
``info`` says so), and what still exceeds the cap is refused as before
(:func:`attnplan.step.verify.verify_lowered`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from .ir import StepPlan
from .lower import lower_mb

Peaks = Callable[[StepPlan, list], tuple[np.ndarray, np.ndarray]]


def excess(peak: np.ndarray, cap: int) -> int:
    """Bytes over the cap, summed over the devices."""
    return int(np.maximum(peak - cap, 0).sum())


def candidates(plan: StepPlan, over: np.ndarray) -> list[int]:
    """The micro-batches that keep KV and run on a device over the cap."""
    hit = set(over.tolist())
    return [m for m in range(plan.n_mb) if plan.mb_keeps_kv(m) and hit.intersection(plan.mb_ranks(m).tolist())]


def keep_where_it_fits(plan: StepPlan, lowered: list, peaks: Peaks, cap: int
                       ) -> tuple[StepPlan, list, np.ndarray, np.ndarray]:
    """``plan`` and its lowered micro-batches with the micro-batches the rule picks lowered without kept KV,
    and their peak bytes per rank and the micro-batch setting each (``peaks(plan, lowered)``)."""
    peak, peak_mb = peaks(plan, lowered)
    if not plan.problem.keep_kv:
        return plan, lowered, peak, peak_mb
    lowered = list(lowered)
    while excess(peak, cap) > 0:
        best = None
        for m in candidates(plan, np.flatnonzero(peak > cap)):
            trial = dataclasses.replace(plan, mb_unkept=tuple(sorted((*plan.mb_unkept, m))))
            low = lowered[:m] + [lower_mb(trial, m)] + lowered[m + 1:]
            pk, pm = peaks(trial, low)
            if best is None or excess(pk, cap) < best[0]:
                best = (excess(pk, cap), trial, low, pk, pm)
        if best is None:  # no kept KV left on the devices over the cap
            return plan, lowered, peak, peak_mb
        _, plan, lowered, peak, peak_mb = best
    return rekeep(plan, lowered, peaks, cap, peak, peak_mb)


def rekeep(plan: StepPlan, lowered: list, peaks: Peaks, cap: int, peak: np.ndarray, peak_mb: np.ndarray
           ) -> tuple[StepPlan, list, np.ndarray, np.ndarray]:
    """A drop that was needed may not be once later ones are made: every micro-batch without kept KV, in
    order, keeps it again where the step still fits."""
    for m in plan.mb_unkept:
        trial = dataclasses.replace(plan, mb_unkept=tuple(k for k in plan.mb_unkept if k != m))
        low = lowered[:m] + [lower_mb(trial, m)] + lowered[m + 1:]
        pk, pm = peaks(trial, low)
        if excess(pk, cap) == 0:
            plan, lowered, peak, peak_mb = trial, low, pk, pm
    return plan, lowered, peak, peak_mb
