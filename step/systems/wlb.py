"""wlb — WLB-LLM (Wang, Cai, Xie et al. 2025, arXiv:2503.17924; survey §2.3,
§4.3): workload-aware variable-length packing, an outlier queue, and
per-document sharding inside each CP group.

The packing is the survey's greedy for

    min max_j Σ_i [W_a(x_ij·d_i) + W_l(x_ij·d_i)]   s.t. every document in one micro-batch,
                                                        Σ_i x_ij·d_i ≤ L_max (memory only)

documents by length, longest first, each into the micro-batch of least total
work (attention + linear); if its tokens do not fit there, into the
micro-batch holding the fewest tokens (:func:`common.greedy_fill`).

Choices the survey leaves open, made here:

* Work is the step's compute seconds of the document at the effective peak:
  linear and output layer per token, attention per exact allowed pair, with
  the backward and recompute factors (:func:`simulate.doc_seconds`).
* ``L_max`` is memory-bounded, not window-bounded: the tokens a CP group of
  the mesh holds (:func:`common.micro_tokens` × cp), or ``max_tokens``.
* There are ``dp · micro`` micro-batches (``micro=0``: the fewest per
  replica, from the token bound up, at which every document fits), dealt to
  replicas heaviest first to the replica of least summed work among those
  with fewest micro-batches (:func:`common.deal_balanced`): the greedy
  balances micro-batches, the deal their sums per replica (the gradient
  reduction waits for the slowest replica). A replica runs its micro-batches
  heaviest first.
* Outliers: with ``outlier = f > 0`` a document of at least ``f · L_max``
  tokens joins a FIFO queue (after the carried ones, in data order); once
  the queue holds ``dp · micro`` documents, the first ``dp · micro`` leave
  it, one per micro-batch, placed before the greedy; the rest stay queued
  (``queue_out``, the carried state of the next step). ``outlier=0`` (the
  default) queues nothing, so one step's table compares the same work.
  A step with no new documents (only carried ones: the end of the data)
  drains the queue: every carried document is packed by the greedy like
  any other, so no document waits forever.
* Inside: ``inner=adaptive`` lowers each micro-batch with ``per_doc`` and
  ``zigzag`` and keeps the one of lower predicted attention time (WLB-LLM
  §4.3 compares the kernels' tile-rounded work; attnplan's simulator prices
  that rounding, launches and communication); ``inner=auto`` takes the
  fastest of every strategy; any strategy name is used as is.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import StepError
from ...ir.limits import MAX_MICRO_BATCHES
from ..base import StepPass, check_int
from ..ir import StepPlan, StepProblem, build_plan
from ..lower import check_option, choose_strategy
from ..mesh import gib
from ..simulate import doc_seconds
from .common import deal_balanced, greedy_fill, members, micro_tokens

ADAPTIVE = ("zigzag", "per_doc")


def split_outliers(problem: StepProblem, threshold: float, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """(documents leaving the queue this step, documents staying queued), FIFO: carried documents
    first, then this step's documents of at least ``threshold`` tokens in data order."""
    docs = np.arange(problem.docs, dtype=np.int64)
    carried = docs[:problem.carried]
    if problem.docs and problem.carried == problem.docs:  # the end of the data: the queue drains
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if threshold <= 0:
        queue = carried
    else:
        fresh = docs[problem.carried:]
        queue = np.concatenate([carried, fresh[problem.seqlens[fresh] >= threshold]])
    if len(queue) >= slots:
        return queue[:slots], queue[slots:]
    return np.zeros(0, np.int64), queue


@dataclass(frozen=True, slots=True)
class Wlb(StepPass):
    name = "wlb"
    micro: int = 0             # micro-batches per replica; 0 = the fewest at which every document fits
    outlier: float = 0.0       # queue documents of at least outlier × L_max tokens (0 = no queue)
    inner: str = "adaptive"    # adaptive (per_doc or zigzag per micro-batch) or an attention strategy
    max_tokens: int = 0        # L_max, tokens per micro-batch; 0 = from the memory model

    def __post_init__(self):
        check_int("wlb", "micro", self.micro, 0, MAX_MICRO_BATCHES)
        check_int("wlb", "max_tokens", self.max_tokens, 0, 1 << 40)
        if not 0.0 <= self.outlier <= 1.0:
            raise StepError(f"wlb: outlier must be in [0, 1] (a share of L_max), got {self.outlier}")
        check_option("wlb", "inner", self.inner, adaptive=True)

    def carries_state(self) -> bool:
        return self.outlier > 0

    def apply(self, problem: StepProblem) -> StepPlan:
        mesh, lens = problem.mesh, problem.seqlens
        lmax = self.max_tokens or micro_tokens(problem) * mesh.cp
        if lens.max() > lmax:
            d = int(np.argmax(lens))
            raise StepError(f"wlb: document {d} ({int(lens[d]):,} tokens) does not fit a micro-batch of at most "
                            f"{lmax:,} tokens (a CP group of {mesh.cp} devices of {gib(problem.cap)} GiB)")
        work = doc_seconds(problem)
        micro = self.micro or max(1, -(-problem.tokens // (lmax * mesh.dp)))  # the fewest that can hold the tokens
        while True:
            bins = mesh.dp * micro
            out, queued = split_outliers(problem, self.outlier * lmax, bins)
            load = np.zeros(bins)
            held = np.zeros(bins, np.int64)
            load[:len(out)] += work[out]
            held[:len(out)] += lens[out]
            rest = np.setdiff1d(np.arange(problem.docs, dtype=np.int64), np.concatenate([out, queued]))
            order = rest[np.lexsort((rest, -lens[rest]))]
            where = np.full(problem.docs, -1, np.int64)
            where[out] = np.arange(len(out))
            where[rest] = greedy_fill(order, lens, work, bins, lmax, load, held)[rest]
            lost = rest[where[rest] < 0]
            if not len(lost):
                return self._plan(problem, where, bins, queued, lmax, work)
            if self.micro or bins >= min(problem.docs, MAX_MICRO_BATCHES):
                d = int(lost[np.argmax(lens[lost])])
                raise StepError(f"wlb: document {d} ({int(lens[d]):,} tokens) does not fit in any of {bins} "
                                f"micro-batches of at most {lmax:,} tokens; give more micro-batches (wlb{{micro=N}})")
            micro += 1

    def _plan(self, problem: StepProblem, where: np.ndarray, bins: int, queued: np.ndarray, lmax: int,
              work: np.ndarray) -> StepPlan:
        mesh = problem.mesh
        computed = where >= 0
        replica, slot = deal_balanced(np.bincount(where[computed], weights=work[computed], minlength=bins), mesh.dp)
        docs = members(where, bins)
        keep = [j for j in range(bins) if len(docs[j])]
        ranks = [mesh.cp_group(int(replica[j])) for j in keep]
        inner = [choose_strategy(problem, tuple(problem.seqlens[docs[j]].tolist()), r, self.inner, ADAPTIVE)
                 for j, r in zip(keep, ranks)]
        return build_plan(problem, self.spec(), [docs[j] for j in keep], ranks, slot[keep], inner, queue_out=queued,
                          info=[("max_tokens", lmax), ("micro_batches", bins)])
