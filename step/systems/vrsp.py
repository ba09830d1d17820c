"""vrsp — Libra's Variance-Reduced Sequence Placement over bounded sequence
pools, with TAP inside each pool (Wang, Yuan, Yang et al., arXiv:2607.23250;
survey §2.1 and §3.2).

Libra never repacks: the batch keeps the fixed packing users run today
(packed sequences of the context length). The data-parallel replicas are
grouped into pools of ``P`` replicas; VRSP places whole packed sequences into
pools by LPT so that every pool's summed work is close to the mean (the
survey's pseudo-code):

    F_i ← work of packed sequence i
    sort by F_i descending; each into the lightest pool that is not full;
    a pool holding its quota of sequences leaves the candidates

and inside a pool the tiled attention pool (TAP, the ``tile_pool`` attention
pass) moves sequence × head tiles between the pool's ``P · cp`` devices to
remove what imbalance is left. Libra's pool law explains the bound: with
``D`` sequences of work coefficient of variation CV in ``D/P`` pools, the
expected largest normalized pool load of a placement that does not balance
is ``E[R] ≈ 1 + CV/√P · √(2 ln(D/P))``, so a bounded pool (Libra takes
P = 8) gets most of the gain while its traffic stays on local links
(``benchmarks/libra_pool_law.py`` measures it against this pass).

Choices the survey leaves open, made here:

* **Packing**: exactly ``fixed``'s (:func:`fixed_packing`): ``problem.packing``
  when the problem carries one (and ``context=0``), else next-fit in data
  order into the smallest context length at which the batch packs into
  ``dp · micro`` sequences, or the given ``context``.
* **Work** ``F_i``: the step's compute seconds of the sequence's documents
  (:func:`simulate.doc_seconds`: linear + output layer per token, attention
  per exact allowed pair). Libra's proxy Σ ℓ² ignores the per-token term
  because its packed sequences all hold exactly the context length; next-fit
  leaves up to one document of slack per sequence, and on sequences of equal
  tokens both orders agree.
* **Pools**: replicas ``jP .. jP+P−1`` form pool ``j`` (consecutive ranks,
  inside a node when ``P · cp`` divides the devices of a node); ``P`` must
  divide ``dp``. A pool's quota is ``P · k`` sequences, ``k = ceil(S / dp)``
  per replica (one per replica and step when ``S = dp``). Ties go to the
  lower sequence, then the lower pool.
* **Inside a pool**: its sequences by work descending are cut into slots of
  ``P`` (the heaviest ``P`` first): slot ``t`` is one micro-batch over all the
  pool's devices (accumulation index ``t``), its sequences concatenated, each
  in its documents' data order. Grouping sequences of similar work leaves
  TAP the least imbalance to move, so the fewest tiles cross replicas (the
  pool's time is the sum of its slots, each balanced by TAP, whatever the
  grouping). TAP's contiguous token homes give each device ``1/(P·cp)`` of
  the slot, as ``fixed`` gives each device ``1/cp`` of one sequence: memory
  per device is fixed's.
* ``place=data`` replaces VRSP by fixed's deal (sequence ``k`` on replica
  ``k mod dp`` as its ``k // dp``-th micro-batch) and pools the replicas as
  they are, each slot holding the pool's replicas' sequences of that
  accumulation index: Libra's bounded pool with TAP but without VRSP, the
  placement the pool law describes (the ablation of
  ``benchmarks/libra_pool_law.py``).
* ``inner=tile_pool`` (the default, TAP with its defaults) places each
  micro-batch; ``auto`` or any attention strategy replaces it (``zigzag``
  gives Libra's VRSP-only ablation at ``pool=1``).
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
from .common import check_fits, deal, pipeline_micro
from .fixed import next_fit, smallest_context


PLACES = ("lpt", "data")


def fixed_packing(problem: StepProblem, context: int, micro: int, owner: str) -> tuple[list[np.ndarray], int]:
    """(documents of every packed sequence, context length): the packing of ``fixed{context, micro}``."""
    lens = problem.seqlens
    if problem.packing is not None and context == 0:
        order = np.argsort(problem.packing, kind="stable")
        _, starts = np.unique(problem.packing[order], return_index=True)
        seqs = np.split(order.astype(np.int64), starts[1:])
        return seqs, int(max(lens[d].sum() for d in seqs))
    if context:
        if lens.max() > context:
            i = int(np.argmax(lens))
            raise StepError(f"{owner}: document {i} ({int(lens[i]):,} tokens) is longer than the context length "
                            f"{context:,}; give {owner}{{context=...}} at least {int(lens.max()):,}")
    else:
        context = smallest_context(lens, problem.mesh.dp * pipeline_micro(problem, micro))
    cuts = next_fit(lens, context, MAX_MICRO_BATCHES)
    if cuts is None:
        raise StepError(f"{owner}: the context length {context:,} packs the batch into more than "
                        f"{MAX_MICRO_BATCHES:,} sequences (ir/limits.py MAX_MICRO_BATCHES)")
    return np.split(np.arange(len(lens), dtype=np.int64), cuts[1:]), context


def lpt_pools(work: np.ndarray, pools: int, quota: int) -> np.ndarray:
    """Pool of every sequence: by work descending (ties: lower index), each into the pool of least summed
    work that holds fewer than ``quota`` sequences (ties: lower pool). Needs ``pools · quota >= len(work)``."""
    if pools * quota < len(work):
        raise StepError(f"vrsp: {len(work)} sequences do not fit {pools} pools of {quota}")
    load = np.zeros(pools)
    count = np.zeros(pools, np.int64)
    out = np.full(len(work), -1, np.int64)
    for i in np.lexsort((np.arange(len(work)), -np.asarray(work, float))).tolist():
        open_ = np.flatnonzero(count < quota)
        b = int(open_[np.argmin(load[open_])])
        out[i] = b
        load[b] += work[i]
        count[b] += 1
    return out


@dataclass(frozen=True, slots=True)
class Vrsp(StepPass):
    name = "vrsp"
    pool: int = 1              # P: data-parallel replicas per pool (must divide dp)
    context: int = 0           # tokens per packed sequence, as fixed; 0 = the smallest that packs into dp · micro
    micro: int = 1             # packed sequences per replica and step (with context=0), as fixed
    inner: str = "tile_pool"   # attention strategy over each pool's devices (or auto)
    place: str = "lpt"         # lpt (VRSP) or data (fixed's deal, replicas pooled as they are: no VRSP)

    def __post_init__(self):
        check_int("vrsp", "pool", self.pool, 1, MAX_DEVICES)
        check_int("vrsp", "context", self.context, 0, 1 << 40)
        check_int("vrsp", "micro", self.micro, 1, MAX_MICRO_BATCHES)
        check_option("vrsp", "inner", self.inner, adaptive=False)
        if self.place not in PLACES:
            raise StepError(f"vrsp: place must be one of {', '.join(PLACES)}, got {self.place!r:.40}")

    def apply(self, problem: StepProblem) -> StepPlan:
        mesh, lens = problem.mesh, problem.seqlens
        P = self.pool
        if mesh.dp % P:
            raise StepError(f"vrsp: pool={P} replicas must divide dp={mesh.dp}")
        if P * mesh.cp > MAX_DEVICES:
            raise StepError(f"vrsp: a pool of {P} x {mesh.cp} devices is over MAX_DEVICES = {MAX_DEVICES} "
                            f"(ir/limits.py)")
        check_fits(problem, np.arange(problem.docs), mesh.cp, "vrsp")
        seqs, context = fixed_packing(problem, self.context, self.micro, "vrsp")
        doc_work = doc_seconds(problem)
        work = np.array([doc_work[d].sum() for d in seqs])
        pools = mesh.dp // P
        if self.place == "lpt":
            where = lpt_pools(work, pools, P * -(-len(seqs) // mesh.dp))
            slots = []
            for j in range(pools):
                mine = np.flatnonzero(where == j)
                mine = mine[np.lexsort((mine, -work[mine]))]
                slots.append([mine[t:t + P] for t in range(0, len(mine), P)])
        else:  # fixed's deal (sequence k on replica k mod dp, slot k // dp), replicas pooled as they are
            replica, slot = deal(len(seqs), mesh.dp)
            where = replica // P
            slots = [[np.flatnonzero((where == j) & (slot == t)) for t in range(int(slot.max()) + 1)]
                     for j in range(pools)]
        mb_docs, mb_ranks, mb_slot = [], [], []
        for j in range(pools):
            ranks = np.arange(j * P * mesh.cp, (j + 1) * P * mesh.cp, dtype=np.int64)
            for t, members in enumerate(x for x in slots[j] if len(x)):
                mb_docs.append(np.concatenate([seqs[k] for k in members.tolist()]))
                mb_ranks.append(ranks)
                mb_slot.append(t)
        inner = [choose_strategy(problem, tuple(lens[d].tolist()), r, self.inner) for d, r in zip(mb_docs, mb_ranks)]
        load = np.bincount(where, weights=work, minlength=pools)
        return build_plan(problem, self.spec(), mb_docs, mb_ranks, mb_slot, inner,
                          info=[("context", context), ("sequences", len(seqs)), ("pools", pools), ("pool_size", P),
                                ("sequence_work_cv", float(work.std() / work.mean()) if work.mean() > 0 else 0.0),
                                ("pool_load_ratio", float(load.max() / load.mean()) if load.mean() > 0 else 1.0)])
