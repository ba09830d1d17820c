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
  ``wlb``). They run one after another on every device (one slot each).
* Documents keep their data order inside a micro-batch (the placement
  strategy decides where each token goes).
* The pool spans nodes: its attention traffic crosses the inter-node links
  that a CP group inside a node never uses — Libra's argument for bounded
  pools (§2.1), which this system deliberately ignores.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import StepError
from ...ir.limits import MAX_DEVICES, MAX_MICRO_BATCHES
from ..base import StepPass, check_int
from ..ir import StepPlan, StepProblem, build_plan
from ..lower import check_option, choose_strategy
from ..simulate import doc_seconds
from .common import greedy_fill, members, micro_tokens

ADAPTIVE = ("minheap", "hypergraph")


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
        while True:
            where = greedy_fill(order, lens, work, micro, cap)
            if (where >= 0).all():
                break
            if self.micro or micro >= min(problem.docs, MAX_MICRO_BATCHES):
                d = int(np.flatnonzero(where < 0)[0])
                raise StepError(f"pool: document {d} ({int(lens[d]):,} tokens) does not fit in any of {micro} "
                                f"micro-batches of at most {cap:,} tokens; give more (pool{{micro=N}})")
            micro += 1
        docs = [d for d in members(where, micro) if len(d)]
        ranks = np.arange(n, dtype=np.int64)
        inner = [choose_strategy(problem, tuple(lens[d].tolist()), ranks, self.inner, ADAPTIVE) for d in docs]
        return build_plan(problem, self.spec(), docs, [ranks] * len(docs), np.arange(len(docs)), inner,
                          info=[("max_tokens", cap)])
