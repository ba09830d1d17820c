"""flexsp — FlexSP (Wang, Wang, Zhu et al. 2025, arXiv:2412.01523; survey
§1.1, §3.1): heterogeneous sequence-parallel groups of power-of-two sizes run
concurrently on the DP × CP pool, and a MILP assigns the sequences to them.

The step's documents are cut into micro-batches that fit the pool's memory;
for each, the *time-balanced assignment* of the survey

    min  C
    s.t. Σ_k A_kp · t(s_k, d_p) ≤ C                  ∀ groups p        (time)
         Σ_k A_kp · s_k ≤ T · d_p · m_p               ∀ p               (memory; no sequence on an unused group)
         Σ_k A_kp ≥ m_p                               ∀ p               (a used group holds a sequence)
         Σ_p d_p · m_p ≤ n                                               (devices)
         Σ_p A_kp = 1                                 ∀ sequences k
    t(s, d) = (1/d)·(α1·s² + α2·s)  +  (1/(d·v_d))·α3·s

over *virtual* groups ``p`` (every allowed size ``d``, as many copies as fit
the pool) with ``m_p`` whether group ``p`` is used, is solved by
``scipy.optimize.milp`` (HiGHS) under a time limit; the groups used then run
side by side, each on its sequences packed together. Inside a group the
sequences are scattered Ulysses style (``ulysses``: head split, all-to-all)
when the group has at most as many devices as the model has KV heads (and
they divide them), else by the ``fallback`` strategy (``zigzag``, ring
style), or, with ``copies=true``, by ``ulysses`` with every KV head copied
``lcm(kv_heads, d) / kv_heads`` times (``graph.kv_rep``, as yunchang does;
the all-to-all carries the copies, priced in :func:`comm_seconds`) wherever
``d`` divides the query heads — FlexSP as all-Ulysses, the default (the
README's tables are measured with it); ``copies=false`` keeps the ring
fallback for every group beyond the KV heads.

Choices the paper and the survey leave open (or that differ), made here:

* Costs come from attnplan's model, not a profile fit: ``(α1·s² + α2·s)``
  is the document's step compute at the effective peak — exact attention
  pairs, linear and output layer, forward, backward, recompute
  (:func:`simulate.doc_seconds`); ``α3·s`` is the bytes a device sends per
  layer: Ulysses' all-to-all moves Q, K, V in and O out, ``(d − 1)/d`` of
  them off the device, once forward, once backward and once more for the
  recomputed forward; a ``fallback`` ring group instead passes K and V of
  the whole sequence, ``s·(d − 1)/d`` tokens, forward, twice backward (K, V
  and their gradients) and again under recompute — not divided by ``d``, and
  counted as if not overlapped. ``v_d`` is the profile's intra-node
  bandwidth for a group inside one node, its inter-node bandwidth otherwise.
  The kernels' launch overhead (:func:`launch_seconds`, the cost model's
  ``launch_s`` per token-block pair) is added for an unfused profile:
  Ulysses runs every block pair on every device of its group, which the s²
  term alone misses; a fused profile launches a run of blocks once.
* ``T`` (tokens per device) is ``max_tokens`` or the memory model's bound
  (:func:`common.micro_tokens`); a group of ``d`` devices holds its
  sequences' tokens evenly (Ulysses and zigzag split them evenly).
* Group sizes: the powers of two that stay node-aligned, as ``dyncp``
  (:func:`dyncp.group_sizes`), size 1 included (FlexSP's code skips it);
  at most ``⌊n/d⌋`` copies of size ``d`` and no more than the micro-batch
  has sequences that size can hold. Groups are laid out largest first on
  consecutive ranks (:func:`dyncp.layout`): a group of at most a node's
  devices never crosses one. The device constraint is ``≤ n`` (the paper:
  ``= n``), so a micro-batch with few sequences may leave devices idle.
* Symmetry: copies of one size are interchangeable, so the MILP orders them
  (used ones first, then by time), which only removes equal solutions.
* Sequence bucketing (FlexSP §5, to keep the MILP small): the micro-batch's
  sequences, longest first, are cut into at most ``buckets`` runs that
  minimise the summed over-estimate ``Σ (t_max − t_i)`` (dynamic
  programming); a bucket is priced by its longest sequence (time and
  memory, so the MILP's answer is safe), the MILP chooses how many of each
  bucket every group takes, and the bucket's sequences, longest first, then
  go to the group of least exact time among those with quota left.
  ``buckets=0`` gives every sequence its own variable, as long as the
  MILP keeps at most ``MAX_VARIABLES`` assignment variables (fewer
  buckets beyond).
* Micro-batches (FlexSP's "sort_consec" chunking): the documents sorted
  longest first are cut into the fewest consecutive runs whose largest
  token count the pool can hold (:func:`fixed.smallest_context`); if a run
  has no feasible assignment the step takes one more micro-batch. The
  micro-batches run heaviest last (the overlapped gradient reduction then
  hides behind the longest backward).
* The MILP's answer is compared with the homogeneous assignments (every
  group of one size ``d``, sequences LPT by exact time, memory checked) and
  the fastest by exact cost is kept; a MILP stopped by its time limit may
  be worse than one of them. ``info`` reports, per step, the MILP's largest
  relative gap (``mip_gap``: HiGHS's incumbent against its dual bound, in the
  bucketed costs), how the solver stopped (``optimal``: proven within
  ``gap``; ``time_limit``; ``heuristic`` when a homogeneous assignment won)
  and the groups used. HiGHS is deterministic, so a plan is a pure function
  of the problem whenever the solver stops on ``gap`` rather than on the
  time limit, which ``solver_stop`` says.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import StepError
from ...ir.limits import MAX_MICRO_BATCHES
from ...passes.ulysses import kv_copies as ulysses_copies
from ..base import StepPass, check_int
from ..ir import StepPlan, StepProblem, build_plan
from ..lower import check_option, choose_strategy
from ..model import ACT_BYTES
from ..simulate import doc_seconds
from .common import micro_tokens
from .dyncp import group_sizes, layout, need_size, refuse_unfit
from .fixed import next_fit, smallest_context
from .flexsp_milp import Buckets, Solved, groups_milp, homogeneous, polish, pooled_milp

MAX_VARIABLES = 4096    # bucket × virtual-group variables of one MILP: fewer buckets beyond
FORMULATIONS = ("pooled", "groups")
INNER = ("ulysses", "adaptive")
DP_ITEMS = 2048         # items the bucketing's dynamic programme takes (more are merged first)
DP_BLOCK = 256          # rows of the bucketing's cost matrix built at once


def uses_ulysses(problem: StepProblem, d: int, copies: bool = False) -> bool:
    """Whether a group of ``d`` devices scatters heads Ulysses style: ``d`` divides the KV heads, or, with
    ``copies``, the attention level's ``ulysses`` can copy them for ``d`` (:func:`kv_copies`)."""
    m = problem.model
    return m.kv_heads % d == 0 or (copies and ulysses_copies(m.kv_heads, m.heads, d) is not None)


def kv_copies(problem: StepProblem, d: int) -> int:
    """Copies of every KV head a Ulysses group of ``d`` devices moves: the attention level's rule
    (``lcm(kv_heads, d) / kv_heads``; 1 when ``d`` divides the KV heads)."""
    m = problem.model
    return ulysses_copies(m.kv_heads, m.heads, d) or 1


def comm_seconds(problem: StepProblem, s: np.ndarray, d: int, fallback: str, copies: bool = False) -> np.ndarray:
    """The survey's ``α3·s / (d·v)`` for documents of lengths ``s`` on a group of ``d`` devices: per device,
    the seconds its sends take over the whole step (see the module doc); a Ulysses group beyond the KV
    heads (``copies``) moves every copy of K and V."""
    if d <= 1:
        return np.zeros(len(s))
    m, mesh, prof = problem.model, problem.mesh, problem.profile
    v = prof.intra_bw if d <= mesh.devices_per_node else prof.inter_bw
    rec = 1.0 if mesh.recompute == "full" else 0.0
    s = np.asarray(s, float)
    if uses_ulysses(problem, d, copies):
        kv = m.kv_heads * kv_copies(problem, d)
        per_token = ACT_BYTES * (2 * m.heads + 2 * kv) * m.head_dim             # Q, K, V in; O out
        volume = s / d * (d - 1) / d * per_token * (2.0 + rec)
    else:
        per_token = ACT_BYTES * 2 * m.kv_heads * m.head_dim                     # K and V around the ring
        volume = s * (d - 1) / d * per_token * (3.0 + rec)
    return m.layers * volume / v


def launch_seconds(problem: StepProblem, d: int, copies: bool = False) -> np.ndarray:
    """Per device, the attention kernels' launch overhead of every document on a group of ``d`` over the
    step: one launch (the profile's ``launch_s``) per token-block pair, per phase (forward, backward,
    recomputed forward) and layer. Ulysses runs every block pair of the document on every device (for its
    heads), cut again at the ``d − 1`` boundaries of the even token split; a ring (``zigzag``) group
    spreads the pairs of the ``2·d`` chunks over its devices. Masks sparser than causal have
    proportionally fewer pairs. With a fused profile (one launch per run of compute blocks,
    :mod:`attnplan.backends.cost`) a group's documents share a handful of calls per layer and phase:
    microseconds against a step of seconds, taken as zero."""
    s = problem.seqlens.astype(float)
    if problem.profile.fused:
        return np.zeros(len(s))
    nb = np.ceil(s / problem.block_size)
    causal = s * (s + 1) / 2
    ulysses = uses_ulysses(problem, d, copies)
    if d > 1:
        nb = nb + (d - 1 if ulysses else 2 * d - 1)
    pairs = nb * (nb + 1) / 2 * np.minimum(1.0, problem.pairs / causal)
    per_device = pairs if ulysses else pairs / d
    rec = 1.0 if problem.mesh.recompute == "full" else 0.0
    return problem.model.layers * (2.0 + rec) * problem.profile.launch_s * per_device


def bucket_runs(w: np.ndarray, buckets: int) -> np.ndarray:
    """Start index of every bucket of ``w`` (sorted descending) cut into at most ``buckets`` consecutive
    runs minimising the over-estimate ``Σ_runs Σ_i (w[first] − w[i])``: dynamic programming over
    ``buckets`` × runs, O(buckets · m²) for ``m = min(n, DP_ITEMS)`` items (beyond that, consecutive
    items are first merged ``DP_ITEMS`` ways, each merged item priced by its first)."""
    n = len(w)
    if buckets <= 0 or n <= buckets:
        return np.arange(n, dtype=np.int64)
    w = np.asarray(w, float)
    first = np.unique(np.linspace(0, n, min(n, DP_ITEMS), endpoint=False).astype(np.int64))  # merged items
    m = len(first)
    cnt = np.diff(np.concatenate([first, [n]])).astype(float)
    wf = w[first]                                                   # each merged item's price (its largest)
    C = np.concatenate([[0.0], np.cumsum(cnt)])                     # items before merged item i
    Q = np.concatenate([[0.0], np.cumsum(w)])[np.concatenate([first, [n]])]   # their summed w
    # cost of merged run [j, i) = wf[j]·(C[i] − C[j]) − (Q[i] − Q[j]); the j part:
    base = Q[:-1] - wf * C[:-1]
    best = np.full(m + 1, np.inf)
    best[0] = 0.0
    back = np.zeros((buckets + 1, m + 1), np.int64)
    for b in range(1, buckets + 1):
        new = np.full(m + 1, np.inf)
        for lo in range(1, m + 1, DP_BLOCK):
            i = np.arange(lo, min(m + 1, lo + DP_BLOCK))
            cand = best[None, :-1] + base[None, :] + C[i][:, None] * wf[None, :]
            cand[np.arange(m)[None, :] >= i[:, None]] = np.inf       # runs [j, i) need j < i
            arg = np.argmin(cand, axis=1)
            new[i] = cand[np.arange(len(i)), arg] - Q[i]
            back[b, i] = arg
        best = new
    starts = []
    at, b = m, buckets
    while at > 0:
        at = int(back[b, at])
        starts.append(at)
        b -= 1
    return first[np.asarray(starts[::-1], np.int64)]


@dataclass(frozen=True, slots=True)
class FlexSP(StepPass):
    name = "flexsp"
    time_limit: float = 2.0   # seconds HiGHS may take for the step (shared by its micro-batches)
    gap: float = 0.01         # relative MIP gap at which HiGHS stops
    buckets: int = 16         # length buckets per micro-batch (FlexSP §5); 0 = a variable per sequence
    micro: int = 0            # micro-batches; 0 = the fewest the pool's memory allows, more while infeasible
    fallback: str = "zigzag"  # strategy of groups Ulysses cannot split (beyond the KV heads without copies)
    formulation: str = "pooled"  # pooled (a column per group size) or groups (a column per virtual group, the paper's)
    inner: str = "ulysses"    # ulysses (FlexSP's; fallback where it cannot split) or adaptive (the faster of the two)
    copies: bool = True       # groups beyond the KV heads run ulysses with copied KV heads (where d divides heads)
    max_tokens: int = 0       # tokens a device holds; 0 = from the memory model

    def __post_init__(self):
        if not 0.0 < self.time_limit <= 3600.0:
            raise StepError(f"flexsp: time_limit must be in (0, 3600] seconds, got {self.time_limit}")
        if not 0.0 <= self.gap < 1.0:
            raise StepError(f"flexsp: gap must be in [0, 1), got {self.gap}")
        check_int("flexsp", "buckets", self.buckets, 0, 1024)
        check_int("flexsp", "micro", self.micro, 0, MAX_MICRO_BATCHES)
        check_int("flexsp", "max_tokens", self.max_tokens, 0, 1 << 40)
        check_option("flexsp", "fallback", self.fallback, adaptive=False)
        if self.formulation not in FORMULATIONS:
            raise StepError(f"flexsp: formulation must be one of {', '.join(FORMULATIONS)}, "
                            f"got {self.formulation!r:.40}")
        if self.inner not in INNER:
            raise StepError(f"flexsp: inner must be one of {', '.join(INNER)}, got {self.inner!r:.40}")
        if self.fallback in ("auto", "ulysses"):
            raise StepError(f"flexsp: fallback is the strategy of groups ulysses cannot take: zigzag, per_doc, ..., "
                            f"not {self.fallback}")

    # ------------------------------------------------------------------------------------ the step
    def apply(self, problem: StepProblem) -> StepPlan:
        mesh, lens = problem.mesh, problem.seqlens
        n = mesh.stage_devices
        cap = self.max_tokens or micro_tokens(problem)
        sizes = group_sizes(mesh)
        need = need_size(lens, cap, sizes)
        refuse_unfit(problem, need, cap, "flexsp")
        work = doc_seconds(problem)
        times = {d: work / d + comm_seconds(problem, lens, d, self.fallback, self.copies)
                 + launch_seconds(problem, d, self.copies) for d in sizes}
        order = np.lexsort((np.arange(problem.docs), -lens))
        micro = self.micro or max(1, -(-problem.tokens // (cap * n)))
        while True:
            runs = self._chunks(lens[order], micro, cap * n)
            solved: list[Solved] | None = None
            if runs is not None:
                budget = self.time_limit / len(runs)
                solved = []
                for docs in (order[a:b] for a, b in zip(runs[:-1], runs[1:])):
                    got = self._solve(problem, docs, need, times, cap, sizes, budget)
                    if got is None:
                        solved = None
                        break
                    solved.append(got)
            if solved is not None:
                return self._plan(problem, solved, cap)
            if self.micro or micro >= min(problem.docs, MAX_MICRO_BATCHES):
                raise StepError(f"flexsp: no assignment of the batch to {micro} micro-batch(es) of {n} devices fits "
                                f"{cap:,} tokens a device; give more micro-batches (flexsp{{micro=N}})")
            micro += 1

    @staticmethod
    def _chunks(sorted_lens: np.ndarray, micro: int, pool: int) -> np.ndarray | None:
        """Bounds of the fewest-token consecutive cut of the sorted documents into ``micro`` runs, or None
        when its largest run is more than the pool holds."""
        micro = min(micro, len(sorted_lens))
        ctx = smallest_context(sorted_lens, micro)
        if ctx > pool:
            return None
        starts = next_fit(sorted_lens, ctx, micro)
        if starts is None:  # cannot happen: smallest_context guarantees it
            return None
        return np.concatenate([starts, [len(sorted_lens)]]).astype(np.int64)

    # ------------------------------------------------------------------------------------ one micro-batch
    def _solve(self, problem: StepProblem, docs: np.ndarray, need: np.ndarray, times: dict, cap: int,
               sizes: list[int], budget: float) -> Solved | None:
        n = problem.mesh.stage_devices
        lens = problem.seqlens
        best = None
        for d in sizes:  # homogeneous assignments: every group of size d, LPT by exact time
            if d < need[docs].max():
                continue
            got = homogeneous(docs, lens, times[d], d, n // d, cap)
            if got is not None:
                got = _polished(got, times, need, lens, cap)
                if best is None or got.makespan < best.makespan:
                    best = got
        milp = self._milp(problem, docs, need, times, cap, sizes, budget)
        if milp is not None:
            milp = _polished(milp, times, need, lens, cap)
            if best is None or milp.makespan <= best.makespan:
                return milp
        if best is None:
            return None
        gap = milp.gap if milp is not None else float("nan")
        return Solved(best.groups, best.makespan, best.how, "heuristic", gap)

    def _milp(self, problem: StepProblem, docs: np.ndarray, need: np.ndarray, times: dict, cap: int,
              sizes: list[int], budget: float) -> Solved | None:
        """The micro-batch's MILP (``formulation``), solved by HiGHS, turned into groups of documents; None
        when HiGHS has no feasible answer in time or the answer does not fit memory document by document."""
        n = problem.mesh.stage_devices
        ref = times[sizes[0]]                              # any size orders documents the same way
        docs = docs[np.lexsort((docs, -ref[docs]))]
        allowed = [d for d in sizes if (need[docs] <= d).any()]
        if self.formulation == "groups":   # virtual groups: ⌊n/d⌋ copies, no more than documents it can hold
            cols = [d for d in allowed for _ in range(min(n // d, int((need[docs] <= d).sum())))]
        else:
            cols = allowed
        starts = bucket_runs(ref[docs], max(1, min(self.buckets or len(docs), MAX_VARIABLES // len(cols))))
        bk = Buckets(docs, starts, problem.seqlens, need, times, cols)
        if self.formulation == "groups":
            lp, decode = groups_milp(bk, n, cap)
        else:
            lp, decode = pooled_milp(bk, n, cap)
        from scipy.optimize import milp

        res = milp(lp.c, integrality=lp.integrality, bounds=lp.bounds(), constraints=lp.constraints(),
                   options={"time_limit": max(budget, 1e-3), "mip_rel_gap": self.gap, "presolve": True})
        if res.x is None:
            return None
        groups = decode(np.rint(res.x).astype(np.int64), cap)
        if groups is None:
            return None
        makespan = max(float(times[d][m].sum()) for d, m in groups)
        gap = float(res.mip_gap) if getattr(res, "mip_gap", None) is not None else float("nan")
        return Solved([(d, m.tolist()) for d, m in groups], makespan, f"milp {self.formulation}",
                       "optimal" if res.status == 0 else "time_limit", gap)

    # ------------------------------------------------------------------------------------ the plan
    def _plan(self, problem: StepProblem, solved: list[Solved], cap: int) -> StepPlan:
        mb_docs, mb_ranks, mb_slot, inner = [], [], [], []
        for slot, sol in enumerate(solved[::-1]):          # heaviest micro-batch (the first cut) last
            for (d, docs), ranks in zip(sol.groups, layout([d for d, _ in sol.groups])):
                mb_docs.append(np.sort(np.asarray(docs, np.int64)))
                mb_ranks.append(ranks)
                mb_slot.append(slot)
                if not uses_ulysses(problem, d, self.copies):
                    inner.append(self.fallback)
                elif self.inner == "adaptive":
                    inner.append(choose_strategy(problem, tuple(problem.seqlens[mb_docs[-1]].tolist()), ranks,
                                                 "adaptive", ("ulysses", self.fallback)))
                else:
                    inner.append("ulysses")
        gaps = [s.gap for s in solved if s.gap == s.gap]
        stops = {s.stop for s in solved}
        stop = "time_limit" if "time_limit" in stops else ("heuristic" if "heuristic" in stops else "optimal")
        shapes = ";".join("+".join(f"{c}x{d}" for d, c in _counts([d for d, _ in s.groups])) for s in solved[::-1])
        return build_plan(problem, self.spec(), mb_docs, mb_ranks, mb_slot, inner,
                          info=[("max_tokens", int(cap)), ("micro_batches", len(solved)),
                                ("mip_gap", max(gaps) if gaps else -1.0), ("solver_stop", stop),
                                ("chosen", ";".join(s.how for s in solved[::-1])), ("groups", shapes),
                                ("estimated_s", float(sum(s.makespan for s in solved)))])


def _polished(sol: Solved, times: dict, need: np.ndarray, lens: np.ndarray, cap: int) -> Solved:
    groups = polish(sol.groups, times, need, lens, cap)
    makespan = max(float(times[d][np.asarray(m, np.int64)].sum()) for d, m in groups)
    return Solved(groups, makespan, sol.how, sol.stop, sol.gap)


def _counts(sizes: list[int]) -> list[tuple[int, int]]:
    """(size, count) pairs, largest size first."""
    u, c = np.unique(np.asarray(sizes, np.int64), return_counts=True)
    return [(int(a), int(b)) for a, b in zip(u[::-1], c[::-1])]
