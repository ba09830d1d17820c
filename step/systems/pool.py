"""pool — the DCP / MagiAttention view of the step (survey §1.3, §3.2, §4.4):
the data-parallel boundary is artificial, so the whole DP × CP grid is one
pool of identical workers, and each micro-batch is one attention problem
over all of them, placed by ``minheap`` (MagiAttention's dispatch solver:
equal-token chunks, balanced mask area) or ``hypergraph`` (DCP's
partitioning) inside: ``inner=adaptive`` (the default) lowers both and keeps
the one of lower predicted attention time, per micro-batch.

Choices the survey leaves open, made here:

* Micro-batches: ``micro=0`` (the default) takes the fewest that hold the
  step's tokens under the memory bound (one on the suite's batches); the
  documents are spread over them longest first, each into the micro-batch of
  least work whose tokens still fit (:func:`common.greedy_fill`; work as in
  ``wlb``). They run one after another on every device (one slot each). The
  token bound does not see an attention plan's buffers (nor the KV it keeps),
  so without pipeline stages each micro-batch's plan is checked against the
  cap with that micro-batch alone (:func:`attnplan.step.lower.fits_alone`):
  ``adaptive`` takes the faster candidate that fits, and ``micro=0`` one more
  micro-batch while a plan does not (at most ``MORE_MICRO`` more).
* Documents keep their data order inside a micro-batch (the placement
  strategy decides where each token goes).
* The pool spans nodes: its attention traffic crosses the inter-node links
  that a CP group inside a node never uses — Libra's argument for bounded
  pools (§2.1), which this system deliberately ignores.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import PlanError, StepError
from ...ir.limits import MAX_DEVICES, MAX_MICRO_BATCHES
from ..base import StepPass, check_int
from ..ir import StepPlan, StepProblem, build_plan
from ..lower import check_option, choose_lowered, fits_alone
from ..simulate import doc_seconds
from .common import greedy_fill, members, micro_tokens

ADAPTIVE = ("minheap", "hypergraph")
MORE_MICRO = 8  # micro-batches micro=0 adds beyond the token bound's count where plans do not fit (each one lowered)


@dataclass(frozen=True, slots=True)
class Pool(StepPass):
    name = "pool"
    micro: int = 0            # micro-batches (each on the whole grid); 0 = the fewest that fit in memory
    inner: str = "adaptive"   # adaptive (minheap or hypergraph per micro-batch) or an attention strategy

    def __post_init__(self):
        check_int("pool", "micro", self.micro, 0, MAX_MICRO_BATCHES)
        check_option("pool", "inner", self.inner, adaptive=True)

    def apply(self, problem: StepProblem) -> StepPlan:
        mesh, lens = problem.mesh, problem.seqlens
        n = mesh.stage_devices
        if n > MAX_DEVICES:
            raise StepError(f"pool: one attention plan over {n} devices is over MAX_DEVICES = {MAX_DEVICES} "
                            f"(ir/limits.py)")
        cap = micro_tokens(problem) * n
        if lens.max() > cap:
            d = int(np.argmax(lens))
            raise StepError(f"pool: document {d} ({int(lens[d]):,} tokens) does not fit the pool of {n} devices "
                            f"({cap:,} tokens at most)")
        work = doc_seconds(problem)
        order = np.lexsort((np.arange(problem.docs), -lens))
        micro = self.micro or max(1, -(-problem.tokens // cap))
        # without stages, a micro-batch's devices hold at least its own plan's activations (fits_alone); the
        # token bound above does not see a plan's buffers, so micro=0 takes one micro-batch more until every
        # micro-batch's plan fits (at most MORE_MICRO more), and adaptive takes the faster plan that fits
        fits = fits_alone(problem) if mesh.pp == 1 else None
        ranks = np.arange(n, dtype=np.int64)
        first = micro
        while True:
            where = greedy_fill(order, lens, work, micro, cap)
            last = self.micro or micro >= min(problem.docs, MAX_MICRO_BATCHES)
            if not (where >= 0).all():
                if last and problem.tokens > micro * cap:
                    raise StepError(f"pool: the step's {problem.tokens:,} tokens do not fit in {micro} micro-batches "
                                    f"of at most {cap:,} tokens; give at least {-(-problem.tokens // cap)} "
                                    f"(pool{{micro=N}}, or micro=0: the fewest that fit)")
                if last:
                    d = int(np.flatnonzero(where < 0)[0])
                    raise StepError(f"pool: document {d} ({int(lens[d]):,} tokens) does not fit in any of {micro} "
                                    f"micro-batches of at most {cap:,} tokens; give more (pool{{micro=N}})")
                micro += 1
                continue
            docs = [d for d in members(where, micro) if len(d)]
            low = [self._lowered(problem, tuple(lens[d].tolist()), ranks, fits) for d in docs]
            if last or fits is None or micro >= first + MORE_MICRO or all(x is None or fits(x) for x in low):
                break
            micro += 1
        inner = [self.inner if x is None else x.strategy for x in low]
        return build_plan(problem, self.spec(), docs, [ranks] * len(docs), np.arange(len(docs)), inner,
                          info=[("max_tokens", cap)])

    def _lowered(self, problem: StepProblem, lens: tuple[int, ...], ranks: np.ndarray, fits):
        """A micro-batch's plan for ``inner`` (:func:`choose_lowered`); None where a named strategy cannot
        lower on the pool (its name stays: the step's fallback, ``lower_or_fall_back``, takes one that can)."""
        try:
            return choose_lowered(problem, lens, ranks, self.inner, ADAPTIVE, fits=fits)
        except PlanError:
            if self.inner in ("adaptive", "auto"):
                raise
            return None
