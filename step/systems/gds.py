"""gds — Skrull's Global Data Scheduling (Xu, Shen, Wei et al. 2025,
arXiv:2505.19609; survey §2.2, cost model §1.1), with DACP inside.

Skrull schedules the global batch in two layers. GDS acts between
micro-batches: it first bin-packs the batch's sequences across the
data-parallel ranks by their FLOPs (a coarse balance of what each replica
computes before the gradient reduction), then cuts each replica's share into
micro-batches so that long and short sequences interleave — the long ones
spread evenly over the micro-batches, every micro-batch mixing long and
short. DACP (the ``dacp`` attention pass, :mod:`attnplan.passes.dacp`) then
acts inside each micro-batch's CP group: short documents stay whole on one
device (no CP traffic), long ones are sharded, under the per-device token
budget (BucketSize) C.

**Cost.** A document of ``s`` tokens costs ``c1·s + c2·s²`` (survey §1.1;
Skrull's per-layer ``(20h² + 4h·h_kv)·s + 4h·s²``), in seconds of one whole
step at the profile's effective rate, derived from the step cost model
(:mod:`attnplan.step.simulate`) rather than fitted by profiling:

* ``c1`` = layers × (forward + backward + recompute passes) × linear FLOPs
  per token (:func:`model.linear_flops`, the real matmul shapes; Skrull's
  ``20h² + 4h·h_kv`` where the shapes agree) / rate, plus the output layer's
  forward and backward per token;
* ``c2`` = layers × (attention passes) × attention FLOPs per allowed pair
  (:func:`model.attn_flops_per_pair`) / rate × ρ, where ρ = Σ pairs / Σ s²
  over the batch's documents is the mask's pair density (½ for causal
  documents up to the diagonal: pairs = s(s+1)/2), so ``c2·s²`` is the
  quadratic term Skrull's ``4h·s²`` counts.

:func:`skrull_coefficients` returns them; the plan's ``info`` reports them.

Choices the survey leaves open, made here:

* **Across DP ranks**: LPT — documents by cost descending (ties: lower
  index), each to the replica of least summed cost (ties: lower replica).
  Carried documents are ordinary documents (GDS keeps no queue).
* **Memory bound**: a micro-batch holds at most ``M = tokens_per_device ×
  cp / slack`` tokens (:func:`common.micro_tokens`), ``slack`` being
  DACP's automatic one (1.1 in one node, 2 for a group that spans nodes:
  :func:`attnplan.passes.dacp.default_slack`): DACP's automatic BucketSize is
  ``C = max(slack·T/N, all-distributed share)``, so a micro-batch of at most
  M tokens keeps C within what a device holds (the verifier checks the
  real plan, attention buffers included). ``max_tokens`` overrides M.
* **Micro-batches per replica**: ``micro=0`` (the default) takes, for each
  replica, the fewest at which its documents fit under M (from
  ``ceil(tokens / M)`` up), so replicas may run different numbers of
  micro-batches (the step IR allows it; DeepSpeed's fixed accumulation count
  would pad). ``micro=k`` gives every replica k.
* **Interleaving** (the survey's rule): inside a replica, documents by
  length descending (ties: lower index), each to the micro-batch holding the
  fewest tokens where it fits under M (ties: lower index) — LPT on tokens.
  The k longest documents open the k micro-batches one each, the short ones
  fill them up, so long documents are spread evenly and every micro-batch
  mixes long and short (what DACP needs to overlap the distributed ones'
  traffic with the local ones' compute) and memory is even. A replica's
  compute is the sum of its micro-batches, so the cut need not balance time.
  A replica runs its micro-batches in index order (the one holding its
  longest document first); documents keep data order inside a micro-batch.
* **Inside**: ``inner=dacp`` (the default) with its automatic BucketSize.
  The linear term cannot be put into DACP's load: the ``dacp`` pass balances
  attention pairs only (its ``L`` is the documents' exact pairs) and takes no
  load option, and the step's lowering passes a strategy by name only, so
  DACP runs with its default load; it keeps each device within ``slack`` of
  the even token share, which bounds the linear imbalance it can cause to
  ``slack − 1`` (10% in one node, 100% across nodes). ``inner=auto`` or any strategy name replaces it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import StepError
from ...ir.limits import MAX_MICRO_BATCHES
from ...passes.dacp import default_slack
from ..base import StepPass, check_int
from ..ir import StepPlan, StepProblem, build_plan
from ..lower import check_option, choose_strategy
from ..model import LINEAR_BWD_FACTOR
from ..mesh import gib
from ..simulate import rates, work_factors
from .common import micro_tokens, tokens_per_device



def skrull_coefficients(problem: StepProblem) -> tuple[float, float]:
    """``(c1, c2)``: step seconds per token and per squared token of a document (module doc)."""
    r = rates(problem)
    fl, fa = work_factors(problem)
    L = problem.model.layers
    c1 = L * fl * r["lin"] + (1.0 + LINEAR_BWD_FACTOR) * r["head"]
    sq = float(np.sum(problem.seqlens.astype(float) ** 2))
    rho = float(problem.pairs.sum()) / sq if sq > 0 else 0.0
    return c1, L * fa * r["pair"] * rho


def lpt(order: np.ndarray, cost: np.ndarray, bins: int) -> np.ndarray:
    """Bin of every item taken in ``order``: the bin of least summed cost (ties: lower bin)."""
    load = np.zeros(bins)
    out = np.full(len(cost), -1, np.int64)
    for i in order.tolist():
        b = int(np.argmin(load))
        out[i] = b
        load[b] += cost[i]
    return out


def interleave(docs: np.ndarray, lens: np.ndarray, micro: int, cap: int) -> list[np.ndarray] | None:
    """``docs`` cut into ``micro`` micro-batches of at most ``cap`` tokens: by length descending, each to the
    micro-batch of fewest tokens where it fits (module doc); None when one fits nowhere. Each micro-batch's
    documents come back in increasing (data) order; empty micro-batches are dropped."""
    held = np.zeros(micro, np.int64)
    where = np.full(len(docs), -1, np.int64)
    for j in np.lexsort((docs, -lens[docs])).tolist():
        s = int(lens[docs[j]])
        room = np.flatnonzero(held + s <= cap)
        if not len(room):
            return None
        b = int(room[np.argmin(held[room])])
        where[j] = b
        held[b] += s
    return [np.sort(docs[where == b]) for b in range(micro) if held[b] > 0]


@dataclass(frozen=True, slots=True)
class Gds(StepPass):
    name = "gds"
    micro: int = 0          # micro-batches per replica; 0 = the fewest at which each replica's documents fit
    max_tokens: int = 0     # tokens per micro-batch (M); 0 = from the memory model and DACP's slack
    inner: str = "dacp"     # attention strategy inside each CP group (or auto)

    def __post_init__(self):
        check_int("gds", "micro", self.micro, 0, MAX_MICRO_BATCHES)
        check_int("gds", "max_tokens", self.max_tokens, 0, 1 << 40)
        check_option("gds", "inner", self.inner, adaptive=False)

    def apply(self, problem: StepProblem) -> StepPlan:
        mesh, lens = problem.mesh, problem.seqlens
        slack = default_slack(-(-mesh.cp // mesh.devices_per_node))  # the dacp pass's automatic one, its nodes'
        cap = self.max_tokens or int(micro_tokens(problem) * mesh.cp / slack)
        if not self.max_tokens and mesh.pp > 1:  # the pipeline's share never refuses what memory holds
            cap = max(cap, min(int(lens.max()), int(tokens_per_device(problem) * mesh.cp / slack)))
        if lens.max() > cap:
            d = int(np.argmax(lens))
            raise StepError(f"gds: document {d} ({int(lens[d]):,} tokens) does not fit a micro-batch of at most "
                            f"{cap:,} tokens (a CP group of {mesh.cp} devices of {gib(problem.cap)} GiB, "
                            f"DACP's slack {slack})")
        c1, c2 = skrull_coefficients(problem)
        cost = c1 * lens + c2 * lens.astype(float) ** 2
        replica = lpt(np.lexsort((np.arange(problem.docs), -cost)), cost, mesh.dp)
        mb_docs, mb_ranks, mb_slot = [], [], []
        counts = []
        for r in range(mesh.dp):
            docs = np.flatnonzero(replica == r).astype(np.int64)
            if not len(docs):
                counts.append(0)
                continue
            micro = self.micro or max(1, -(-int(lens[docs].sum()) // cap))
            while True:
                cut = interleave(docs, lens, micro, cap)
                if cut is not None:
                    break
                if self.micro or micro >= min(len(docs), MAX_MICRO_BATCHES):
                    raise StepError(f"gds: replica {r}'s {len(docs)} documents ({int(lens[docs].sum()):,} tokens) "
                                    f"do not fit in {micro} micro-batches of at most {cap:,} tokens; give more "
                                    f"(gds{{micro=N}})")
                micro += 1
            ranks = mesh.cp_group(r)
            for slot, members in enumerate(cut):
                mb_docs.append(members)
                mb_ranks.append(ranks)
                mb_slot.append(slot)
            counts.append(len(cut))
        if len(mb_docs) > MAX_MICRO_BATCHES:
            raise StepError(f"gds: {len(mb_docs):,} micro-batches, over MAX_MICRO_BATCHES = {MAX_MICRO_BATCHES:,}")
        inner = [choose_strategy(problem, tuple(lens[d].tolist()), r, self.inner) for d, r in zip(mb_docs, mb_ranks)]
        load = np.bincount(replica, weights=cost, minlength=mesh.dp)
        return build_plan(problem, self.spec(), mb_docs, mb_ranks, mb_slot, inner,
                          info=[("c1_s_per_token", c1), ("c2_s_per_token2", c2), ("max_tokens", cap),
                                ("micro_batches", len(mb_docs)), ("most_per_replica", max(counts)),
                                ("replica_cost_ratio", float(load.max() / load.mean()) if load.mean() > 0 else 1.0)])
