"""dyncp — Megatron-LM Dynamic Context Parallelism (NVIDIA Technical Blog,
"Speeding Up Variable-Length Training with Dynamic Context Parallelism and
NVIDIA Megatron Core", 2026; Megatron Core's hybrid context parallel
scheduler, ``BalancedCPScheduler``; survey §2.4, §3.1).

The DP × CP grid is flattened into one pool of ``n = dp · cp`` devices (THD
layout: the batch is a pool of variable-length documents, survey §2.4), and
every document gets its own CP size: the smallest group that holds it,

    cp(s) = next power of two of ⌈s / max_tokens⌉       (max_tokens: Megatron's max_seqlen_per_dp_cp_rank)

raised, with ``quota=true``, for an *overloaded* document — one whose work
per device would exceed a device's share of the step (the step's work /
``n``) — to the smallest size that brings it under that quota (survey §3.1
step 3: samples over their workload quota go to a larger cp_size, heavy
samples are cut finer). Documents, longest first, are then scheduled in
**rounds** (Megatron calls them groups): a round is a set of disjoint CP
groups covering the pool, each running its documents one after another; a
round ends at a barrier and the next round regroups the devices. One round
is formed so (the order of Megatron's scheduler):

1. *Buckets*: the documents left are cut, in order, into as many buckets as
   they have distinct CP sizes, of about equal estimated work per device
   (a bucket closes at 1.1 × its share); the buckets only set the order in
   which documents are tried.
2. *Groups formed*: the head of the first bucket that can be placed — a
   group of its CP size exists, or enough devices are free to form one —
   goes to a new group when the free devices allow it, else to the least
   loaded group of its size (a document only ever runs on a group of exactly
   its CP size here). Once a document of a smaller CP size than the round's
   first has been placed, the round closes as soon as every device is busy
   and the estimated work per device is within ``delta`` of the largest.
3. *Overloaded groups trimmed*: while the round is out of balance, the last
   document of the most loaded group leaves it (for a later round) if that
   narrows the spread.
4. *Empty devices filled*: while devices are idle, a group of the smallest
   CP size doubles (the next allowed size) over idle devices — its
   documents are now split over twice the devices.

The number of rounds, and so of micro-batches, varies from step to step.

Choices the survey leaves open, made here:

* ``max_tokens=0`` takes the memory model's bound
  (:func:`common.micro_tokens`); Megatron asks the user.
* The workload quota is the step's whole estimated work over the ``n``
  devices, the balance a perfect schedule reaches; the survey's per-rank
  quota ``W_i·(m_i·V + p − 1)`` reduces to it with pp = 1. Megatron's code
  raises CP sizes only through step 4; ``quota=false`` does the same.
* Work per device of a document on ``g`` devices: ``cost=model`` (default)
  is its step compute at the effective peak — linear, output layer and the
  exact attention pairs (:func:`simulate.doc_seconds`) — over ``g``;
  ``cost=square`` is Megatron's estimator ``s² / g`` (attention only).
* Group sizes are powers of two (Megatron pre-builds a process group per
  power of two) that keep groups node-aligned — ones dividing the devices of
  a node or multiples of it — plus the whole pool. Ranks are laid out per
  round, largest groups first, each on consecutive ranks at a multiple of
  its size: groups of up to a node never cross one (Megatron lays groups out
  consecutively without this alignment).
* Step 4 grows the *most loaded* group of the smallest size (Megatron: the
  first formed), recomputing its work per device exactly; a size that no
  idle devices can complete leaves them idle. Documents trimmed in step 3 or
  left in the buckets go to the next round sorted longest first again
  (Megatron appends the trimmed ones unsorted).
* ``pack=true`` (default) packs a group's documents of one round, in their
  order, into THD micro-batches of at most ``g · max_tokens`` tokens (the
  blog chooses a CP size per micro-batch); ``pack=false`` runs every
  document as its own micro-batch (the hybrid-CP code as written). A
  micro-batch runs in the round's slots, so slots of one round never meet
  another round's.
* Inside a micro-batch: ``inner=adaptive`` (default) lowers it with
  ``zigzag`` and ``per_doc`` (TransformerEngine's THD context parallelism
  splits every document into 2·cp chunks) and keeps the faster — on one
  device, where nothing is balanced or sent, ``zigzag`` without comparing;
  ``auto`` or any strategy name as in the other systems.
* The round barrier: the step simulator starts a micro-batch once its own
  group's ranks are free, so a round's end only waits where the next
  round's groups span ranks of several groups; ``round_slots`` (info) lists
  the first slot of every round so the full barrier can be priced
  (benchmarks/dyncp_megatron.py does).
* Pipelines (``pp > 1``): the rounds' micro-batches run through the stages
  by the step's schedule (:mod:`attnplan.step.pipeline`); the per-device
  budget is at most the step's share for four micro-batches a stage
  (:func:`common.micro_tokens`). With ``vp > 1`` the micro-batch count is
  brought to a multiple of ``pp`` by splitting micro-batches, as Megatron-LM's
  dynamic-CP loader does (``align_sample_id_groups``, dev branch, 2026-08;
  :func:`attnplan.step.pipeline.align_slots`). The survey's per-rank quota
  ``W_i·(m_i·V + p − 1)`` is the interleaved 1F1B time of ``m_i`` equal
  micro-batches whose forward and backward on one model chunk take ``W_i``;
  the schedule simulation computes it exactly (a test checks it against the
  closed form). Megatron-LM's code (main ``hybrid_cp_schedule.py``, dev
  ``data_schedule_utils.py``) neither states nor uses it: its scheduler
  balances each micro-batch step across the DP × CP ranks only (main asserts
  ``pp = 1`` for hybrid CP; dev lifts that and aligns the micro-batch count).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from ...errors import StepError
from ...ir.limits import MAX_MICRO_BATCHES
from ..base import StepPass, check_int
from ..ir import StepPlan, StepProblem, build_plan
from ..lower import check_option, choose_strategy
from ..mesh import Mesh, gib
from ..simulate import doc_seconds
from .common import micro_tokens

ADAPTIVE = ("zigzag", "per_doc")
COSTS = ("model", "square")
BUCKET_SLACK = 1.1   # a bucket closes once it would exceed its share of the work by 10% (Megatron's)


# ---------------------------------------------------------------------------------------- shared with flexsp

def group_sizes(mesh: Mesh) -> list[int]:
    """Allowed group sizes, ascending: powers of two up to the pool that divide the devices of a node
    or are multiples of it (so a group laid out at a multiple of its size is node-aligned), and the
    whole pool."""
    n, k = mesh.stage_devices, mesh.devices_per_node
    out = []
    p = 1
    while p <= n:
        if k % p == 0 or p % k == 0:
            out.append(p)
        p *= 2
    if out[-1] != n:
        out.append(n)
    return out


def need_size(amount: np.ndarray, per: float, sizes: list[int]) -> np.ndarray:
    """The smallest allowed size ``g`` with ``g · per ≥ amount``, for every amount (0 where none does):
    tokens against a device's token bound, or work against a device's work quota."""
    sz = np.asarray(sizes, np.int64)
    i = np.searchsorted(sz * per, np.asarray(amount), "left")
    return np.where(i < len(sz), sz[np.minimum(i, len(sz) - 1)], 0)


def refuse_unfit(problem: StepProblem, need: np.ndarray, cap: int, what: str) -> None:
    """StepError in one line naming the longest document no allowed group can hold."""
    bad = np.flatnonzero(need == 0)
    if len(bad):
        d = int(bad[np.argmax(problem.seqlens[bad])])
        n = problem.mesh.stage_devices
        raise StepError(f"{what}: document {d} ({int(problem.seqlens[d]):,} tokens) does not fit a group of {n} "
                        f"devices of {gib(problem.cap)} GiB ({cap * n:,} tokens at most)")


def layout(sizes: list[int]) -> list[np.ndarray]:
    """Ranks of groups of the given sizes: largest first (stable), each on consecutive ranks from the
    end of the previous one — with power-of-two sizes every group starts at a multiple of its size."""
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    out: list[np.ndarray] = [np.zeros(0, np.int64)] * len(sizes)
    at = 0
    for i in order:
        out[i] = np.arange(at, at + sizes[i], dtype=np.int64)
        at += sizes[i]
    return out


def pack_next_fit(docs: list[int], lens: np.ndarray, cap: int) -> list[list[int]]:
    """``docs`` in order, cut into runs of at most ``cap`` tokens (a longer document alone)."""
    out: list[list[int]] = []
    held = 0
    for d in docs:
        s = int(lens[d])
        if out and held + s <= cap:
            out[-1].append(d)
            held += s
        else:
            out.append([d])
            held = s
    return out


# ---------------------------------------------------------------------------------------- one round

class _Group:
    __slots__ = ("docs", "load", "size", "work")

    def __init__(self, size: int):
        self.size = size
        self.docs: list[int] = []
        self.work = 0.0      # summed work of its documents (device-seconds or s²)
        self.load = 0.0      # work per device

    def add(self, d: int, w: float) -> None:
        self.docs.append(d)
        self.work += w
        self.load = self.work / self.size


def _spread(groups: list[_Group], free: int) -> tuple[float, float]:
    """(largest, smallest) work per device over the pool (idle devices count 0)."""
    loads = [g.load for g in groups]
    hi = max(loads, default=0.0)
    lo = 0.0 if free else min(loads, default=0.0)
    return hi, lo


def buckets_of(items: list[int], need: np.ndarray, work: np.ndarray) -> list[deque]:
    """``items`` (in order) cut into as many buckets as they have distinct CP sizes, each of about an equal
    share of the work per device; a bucket closes when it would exceed its share by ``BUCKET_SLACK`` or
    when the items left are just enough to give every remaining bucket one, and the last takes the rest
    (Megatron's ``make_buckets_equal`` may open more than that many)."""
    k = len({int(need[d]) for d in items})
    per = [float(work[d]) / int(need[d]) for d in items]
    target = sum(per) / k
    out: list[deque] = []
    cur: list[int] = []
    cur_w = 0.0
    for i, d in enumerate(items):
        left = len(items) - i
        if cur and len(out) < k - 1 and (cur_w + per[i] > BUCKET_SLACK * target or left <= k - len(out) - 1):
            out.append(deque(cur))
            cur, cur_w = [], 0.0
        cur.append(d)
        cur_w += per[i]
    if cur:
        out.append(deque(cur))
    return out


def _fill_lightest(groups: list[_Group], left: list[int], need: np.ndarray, work: np.ndarray) -> list[int]:
    """Step 3b: the lightest documents left, lightest first, each into the least loaded group at least its
    CP size whose work per device stays at most the round's largest; stops at the first that fits nowhere.
    Returns the documents still left (in their order)."""
    hi = max(g.load for g in groups)
    taken = set()
    for d in sorted(left, key=lambda d: (float(work[d]), d)):
        fits = [g for g in groups if g.size >= need[d] and g.load + float(work[d]) / g.size <= hi]
        if not fits:
            break
        min(fits, key=lambda g: (g.load, -g.size)).add(d, float(work[d]))
        taken.add(d)
    return [d for d in left if d not in taken]


def form_round(items: list[int], need: np.ndarray, work: np.ndarray, n: int, sizes: list[int], delta: float,
               fill: bool = True) -> tuple[list[_Group], list[int]]:
    """One round (see the module doc, steps 1-4): its groups and the documents left for later rounds."""
    buckets = buckets_of(items, need, work)
    groups: list[_Group] = []
    free = n
    first = 0
    check = False
    while True:
        pick = None
        for b in buckets:
            if b and (free >= need[b[0]] or any(g.size == need[b[0]] for g in groups)):
                pick = b
                break
        if pick is None:
            break
        d = pick.popleft()
        size = int(need[d])
        if free >= size:
            grp = _Group(size)
            groups.append(grp)
            free -= size
        else:
            grp = min((g for g in groups if g.size == size), key=lambda g: g.load)
        grp.add(d, float(work[d]))
        first = first or size
        check = check or size < first
        if check and any(buckets):
            hi, lo = _spread(groups, free)
            if hi - lo <= delta * hi:
                break
    left = [d for b in buckets for d in b]
    # step 3: move the last document of the most loaded group out while that narrows the spread
    while not free and groups:
        hi, lo = _spread(groups, free)
        if hi - lo <= delta * hi:
            break
        top = max(groups, key=lambda g: g.load)
        if len(top.docs) <= 1:
            break
        d = top.docs[-1]
        after = (top.work - float(work[d])) / top.size
        loads = [after if g is top else g.load for g in groups]
        if max(loads) - min(loads) >= hi - lo:
            break
        top.docs.pop()
        top.work -= float(work[d])
        top.load = top.work / top.size
        left.append(d)
    if fill and not free and left:
        left = _fill_lightest(groups, left, need, work)
    # step 4: grow the most loaded group of the smallest size over idle devices
    while free and groups:
        small = min(g.size for g in groups)
        grow = [s for s in sizes if s > small and s - small <= free]
        if not grow:
            break
        top = max((g for g in groups if g.size == small), key=lambda g: g.load)
        free -= grow[0] - small
        top.size = grow[0]
        top.load = top.work / top.size
    return groups, left


# ---------------------------------------------------------------------------------------- the pass

@dataclass(frozen=True, slots=True)
class DynCP(StepPass):
    name = "dyncp"
    max_tokens: int = 0       # tokens a device holds (max_seqlen_per_dp_cp_rank); 0 = from the memory model
    delta: float = 0.05       # a round closes once the work per device is within delta of the largest
    cost: str = "model"       # work estimate: model (linear + exact attention seconds) or square (Megatron's s²)
    quota: bool = True        # raise the CP size of a document whose work exceeds a device's share of the step
    fill: bool = False        # fill a round's slack with the lightest documents left, on groups of any larger size
    pack: bool = True         # pack a group's documents of one round into THD micro-batches
    heavy_last: bool = True   # run the rounds, and a group's micro-batches, lightest first (else as formed)
    inner: str = "adaptive"   # adaptive (zigzag or per_doc per micro-batch), auto, or an attention strategy

    def __post_init__(self):
        check_int("dyncp", "max_tokens", self.max_tokens, 0, 1 << 40)
        if not 0.0 <= self.delta <= 1.0:
            raise StepError(f"dyncp: delta must be in [0, 1] (a share of the largest work per device), "
                            f"got {self.delta}")
        if self.cost not in COSTS:
            raise StepError(f"dyncp: cost must be one of {', '.join(COSTS)}, got {self.cost!r:.40}")
        check_option("dyncp", "inner", self.inner, adaptive=True)

    def apply(self, problem: StepProblem) -> StepPlan:
        mesh, lens = problem.mesh, problem.seqlens
        n = mesh.stage_devices
        cap = self.max_tokens or micro_tokens(problem)
        sizes = group_sizes(mesh)
        need = need_size(lens, cap, sizes)
        refuse_unfit(problem, need, cap, "dyncp")
        work = doc_seconds(problem) if self.cost == "model" else lens.astype(float) ** 2
        if self.quota:  # the whole pool always holds a document under the quota: no 0 from need_size
            heavy = np.minimum(need_size(work, float(work.sum()) / n, sizes), min(mesh.devices_per_node, n))
            need = np.maximum(need, heavy)
        items = np.lexsort((np.arange(problem.docs), -lens)).tolist()
        rounds: list[list[tuple[np.ndarray, list[list[int]]]]] = []
        count = 0
        while items:
            groups, left = form_round(items, need, work, n, sizes, self.delta, self.fill)
            if not groups:  # cannot happen: the longest document left always starts a group
                raise StepError(f"dyncp: no document of {len(items)} could be placed in a round")
            placed = []
            for grp, ranks in zip(groups, layout([g.size for g in groups])):
                runs = pack_next_fit(grp.docs, lens, grp.size * cap) if self.pack else [[d] for d in grp.docs]
                placed.append((ranks, runs[::-1] if self.heavy_last else runs))
                count += len(runs)
            if count > MAX_MICRO_BATCHES:
                raise StepError(f"dyncp: more than {MAX_MICRO_BATCHES:,} micro-batches (ir/limits.py "
                                f"MAX_MICRO_BATCHES); pack them (dyncp{{pack=true}})")
            rounds.append(placed)
            items = sorted(left, key=lambda d: (-int(lens[d]), d))
        mb_docs: list[list[int]] = []
        mb_ranks: list[np.ndarray] = []
        mb_slot: list[int] = []
        starts: list[int] = []
        base = 0
        for placed in (rounds[::-1] if self.heavy_last else rounds):
            starts.append(base)
            for ranks, runs in placed:
                for j, docs in enumerate(runs):
                    mb_docs.append(docs)
                    mb_ranks.append(ranks)
                    mb_slot.append(base + j)
            base += max(len(runs) for _, runs in placed)
        inner = [ADAPTIVE[0] if self.inner == "adaptive" and len(r) == 1 else
                 choose_strategy(problem, tuple(lens[d].tolist()), r, self.inner, ADAPTIVE)
                 for d, r in zip(mb_docs, mb_ranks)]
        per_size = np.zeros(n + 1, np.int64)
        for d, r in zip(mb_docs, mb_ranks):
            per_size[len(r)] += len(d)
        return build_plan(problem, self.spec(), [np.asarray(d, np.int64) for d in mb_docs], mb_ranks, mb_slot,
                          inner, info=[("max_tokens", int(cap)), ("rounds", len(starts)),
                                       ("round_slots", ",".join(map(str, starts))),
                                       ("documents_per_cp_size", ",".join(f"{g}:{int(per_size[g])}" for g in sizes
                                                                          if per_size[g]))])
