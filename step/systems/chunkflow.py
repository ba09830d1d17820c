"""chunkflow — ChunkFlow (Yuan, Xu et al. 2025, "Efficient Long Context
Fine-tuning with Chunk Flow", arXiv:2503.02356; survey §5): the batch
reorganised into chunks of one size, scheduled through the pipeline.

1. **Chunks.** A document longer than the chunk size ``C`` is cut into
   ``⌈s / C⌉`` *dependent* chunks of ``C`` tokens (the last one shorter);
   the others are packed into *standalone* chunks of at most ``C`` tokens
   by first-fit decreasing (the paper's greedy bin packing, fewest bins).
2. **Dependent chunks** of a document run in order, each a micro-batch of
   its own attending to every earlier key of its document (its attention is
   a real attention plan: its rows × the document's keys up to its end, a
   cross-attention problem); the KV of the earlier chunks is carried (the
   paper's StateStore) and their gradients flow back.
3. **State-aware scheduling** with ``K = k``: a document's last ``K`` chunks
   keep their activations; the earlier ones drop them after their forward
   and recompute it before their backward (:mod:`attnplan.step.pipeline`,
   schedule ``chunkflow``), so a device holds the activations of at most
   ``K`` chunks of a document plus the document's KV.
4. **Replicas.** Units — a document's chunks together, or one standalone
   chunk — go to data-parallel replicas by LPT; a replica runs its units in
   data order, its ``t``-th chunk in slot ``t``, on its CP group.
   ``cost=tokens`` balances tokens (time ∝ length, ChunkFlow's cost model);
   ``cost=model`` (default) the units' step compute at the effective peak,
   attention's exact pairs included (:func:`simulate.doc_seconds`): the
   chunks of a long document cost more than their tokens say.

Choices the paper leaves to its user, made here:

* ``chunk=0`` takes ``C`` from the mesh: at most the tokens a CP group holds
  under the memory model (:func:`common.tokens_per_device` × cp), and at
  most the step's tokens / (dp · 4 · pp), so that every replica has about
  four chunks per stage to run (1F1B's bubble is ``(p − 1) / (m + p − 1)``;
  without a pipeline, chunks enough to balance the replicas); rounded up to
  a multiple of the block size.
* Inside a chunk: ``inner`` (default ``minheap``, which splits the short
  query side of a late chunk finest) on the replica's CP group; ChunkFlow
  itself runs without context parallelism (cp = 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import StepError
from ...ir.limits import MAX_MICRO_BATCHES
from ...ir.mask import Pieces
from ..base import StepPass, check_int
from ..ir import StepPlan, StepProblem
from ..lower import cache_of, check_option, choose_strategy
from ..pipeline import Schedule, backward_order, one_f_one_b
from ..pipesim import bubble_ratio, timeline
from ..simulate import doc_seconds
from .common import tokens_per_device


def first_fit_decreasing(lens: np.ndarray, cap: int) -> list[list[int]]:
    """Bins of at most ``cap`` tokens: items longest first (ties: lower index), each into the first bin
    it fits; every bin's items in increasing index order."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in np.lexsort((np.arange(len(lens)), -lens)).tolist():
        s = int(lens[i])
        for b, r in enumerate(room):
            if s <= r:
                bins[b].append(i)
                room[b] -= s
                break
        else:
            bins.append([i])
            room.append(cap - s)
    return [sorted(b) for b in bins]


def make_units(lens: np.ndarray, chunk: int) -> list[tuple[int, list]]:
    """The step's units in data order: (first document, its chunks), a chunk being a list of
    (document, start, end). A long document is one unit of its dependent chunks; a standalone chunk is
    a unit of one chunk. Units are ordered by their first document."""
    long_ = np.flatnonzero(lens > chunk)
    short = np.flatnonzero(lens <= chunk)
    units: list[tuple[int, list]] = []
    for d in long_.tolist():
        n = int(lens[d])
        units.append((d, [[(d, a, min(a + chunk, n))] for a in range(0, n, chunk)]))
    for b in first_fit_decreasing(lens[short], chunk):
        docs = short[b]
        units.append((int(docs.min()), [[(int(d), 0, int(lens[d])) for d in docs]]))
    units.sort(key=lambda u: u[0])
    return units


def assign_replicas(sizes: np.ndarray, dp: int) -> np.ndarray:
    """Replica of every unit: LPT on ``sizes`` (largest first, each to the replica of least total; ties to
    the lower index)."""
    load = np.zeros(dp)
    out = np.zeros(len(sizes), np.int64)
    for u in np.lexsort((np.arange(len(sizes)), -sizes)).tolist():
        r = int(np.argmin(load))
        out[u] = r
        load[r] += sizes[u]
    return out


def bubble_example(lengths, stages: int, chunk: int = 0, keep: int = 1, bwd_factor: float = 2.0) -> float:
    """The bubble ratio of sequences of ``lengths`` on ``stages`` pipeline stages, each op lasting its
    tokens (ChunkFlow's cost model: time ∝ length; backward ``bwd_factor`` × forward, a dropped chunk's
    backward one forward more), no communication: under 1F1B with ``chunk=0``, else as ChunkFlow's units
    (:func:`make_units`) under its state-aware 1F1B with ``K = keep``."""
    lens = np.asarray(lengths, np.int64)
    if chunk:
        units = make_units(lens, chunk)
    else:
        units = [(i, [[(i, 0, int(n))]]) for i, n in enumerate(lens.tolist())]
    times: list[int] = []
    chain_units: list[np.ndarray] = []
    for _, chunks in units:
        first = len(times)
        times += [sum(e - s for _, s, e in c) for c in chunks]
        if len(chunks) > 1:
            chain_units.append(np.arange(first, len(times)))
    n = len(times)
    bwd = backward_order(n, chain_units)
    rows = [(u, s, k) for s, ops in enumerate(one_f_one_b(n, stages, bwd)) for u, k in ops]
    a = np.array(rows, np.int64).reshape(-1, 3)
    recompute = np.zeros(n, bool)
    for c in chain_units:
        recompute[c[:max(0, len(c) - keep)]] = True
    sch = Schedule("chunkflow" if chain_units else "1f1b", stages, 1, n, np.arange(stages + 1) * 2 * n,
                   a[:, 0], a[:, 1], a[:, 2], recompute, bwd)
    fd = np.repeat(np.asarray(times, np.float64)[:, None], stages, 1)
    bd = fd * bwd_factor + np.where(recompute[:, None], fd, 0.0)
    members, ranks = [np.array([u]) for u in range(n)], [np.array([0]) for _ in range(n)]
    start, end = timeline(sch, members, ranks, 1, fd, bd, fd * 0, fd * 0)
    return bubble_ratio(sch, ranks, 1, start, end)[0]


def check_cuttable(problem: StepProblem, length: int) -> None:
    """StepError unless the step's mask lets no query see a later key (on a document of ``length`` tokens):
    a chunk reads only the KV before its end."""
    mask = cache_of(problem).mask
    ahead = mask.lower(length).intersect(Pieces.rect(0, length, 0, length, lo=1)).pair_count()
    if ahead:
        raise StepError(f"chunkflow cuts documents longer than a chunk, which needs a mask where no query sees a "
                        f"later key; {mask.source.strip()[:60]!r} lets {ahead:,} pairs of a {length:,}-token "
                        f"document look ahead: give chunkflow{{chunk=...}} at least the longest document")


MAX_CHUNKS = 256  # chunks a replica's pipeline may run in one step (each one an attention plan: 10-50 ms here)


@dataclass(frozen=True, slots=True)
class ChunkFlow(StepPass):
    name = "chunkflow"
    chunk: int = 0          # tokens per chunk (C); 0 = from the memory model and the pipeline (module doc)
    k: int = 1              # chunks of a document that keep their activations (K); the rest recompute
    inner: str = "minheap"  # attention strategy inside every chunk (or auto)
    cost: str = "model"     # what LPT balances over replicas: model (compute seconds) or tokens (the paper's)

    def __post_init__(self):
        check_int("chunkflow", "chunk", self.chunk, 0, 1 << 40)
        check_int("chunkflow", "k", self.k, 1, MAX_MICRO_BATCHES)
        check_option("chunkflow", "inner", self.inner, adaptive=False)
        if self.cost not in ("model", "tokens"):
            raise StepError(f"chunkflow: cost must be model or tokens, got {self.cost!r:.40}")

    def chunk_size(self, problem: StepProblem) -> int:
        if self.chunk:
            return self.chunk
        mesh = problem.mesh
        size = min(tokens_per_device(problem) * mesh.cp, -(-problem.tokens // (mesh.dp * 4 * mesh.pp)))
        b = problem.block_size
        return max(b, -(-size // b) * b)

    def apply(self, problem: StepProblem) -> StepPlan:
        mesh, lens = problem.mesh, problem.seqlens
        chunk = self.chunk_size(problem)
        if (lens > chunk).any():
            check_cuttable(problem, int(lens.max()))
        units = make_units(lens, chunk)
        if self.cost == "tokens":
            sizes = np.array([sum(e - s for c in u[1] for _, s, e in c) for u in units], np.float64)
        else:
            work = doc_seconds(problem)
            sizes = np.array([sum(work[d] for d in {d for c in u[1] for d, _, _ in c}) for u in units])
        replica = assign_replicas(sizes, mesh.dp)
        per_replica = np.bincount(replica, weights=[len(u[1]) for u in units], minlength=mesh.dp)
        if per_replica.max(initial=0) > MAX_CHUNKS:  # each chunk is an attention plan to lower: bounded time
            held = np.bincount(replica, weights=[sum(e - s for c in u[1] for _, s, e in c) for u in units])
            raise StepError(f"chunkflow: {int(per_replica.max()):,} chunks of {chunk:,} tokens on one replica, over "
                            f"{MAX_CHUNKS:,}; give a larger chunkflow{{chunk=...}} (at least "
                            f"{-(-int(held.max()) // MAX_CHUNKS):,} tokens here)")
        frags: list[tuple[int, int, int, int]] = []  # (doc, start, end, micro-batch)
        mb_slot: list[int] = []
        mb_rep: list[int] = []
        for r in range(mesh.dp):
            t = 0
            for u in np.flatnonzero(replica == r).tolist():
                for c in units[u][1]:
                    m = len(mb_slot)
                    frags += [(d, s, e, m) for d, s, e in c]
                    mb_slot.append(t)
                    mb_rep.append(r)
                    t += 1
        if len(mb_slot) > MAX_MICRO_BATCHES:
            raise StepError(f"chunkflow: {len(mb_slot):,} chunks of {chunk:,} tokens, over MAX_MICRO_BATCHES = "
                            f"{MAX_MICRO_BATCHES:,} (ir/limits.py); give a larger chunkflow{{chunk=...}}")
        f = np.array(frags, np.int64).reshape(-1, 4)
        groups = [mesh.cp_group(r) for r in range(mesh.dp)]
        used = sorted(set(mb_rep))
        index = {r: i for i, r in enumerate(used)}
        ptr = np.concatenate([[0], np.cumsum([mesh.cp] * len(used))]).astype(np.int64)
        ranks = np.concatenate([groups[r] for r in used])
        mb_group = np.array([index[r] for r in mb_rep], np.int64)
        strategies = []
        for m in range(len(mb_slot)):
            rows = f[f[:, 3] == m]
            prefix = int(rows[0, 1]) if len(rows) == 1 else 0
            strategies.append(choose_strategy(problem, tuple((rows[:, 2] - rows[:, 1]).tolist()), groups[mb_rep[m]],
                                              self.inner, prefix=prefix))
        dependent = int(np.count_nonzero(lens > chunk))
        return StepPlan(problem, self.spec(), frag_doc=f[:, 0], frag_start=f[:, 1], frag_end=f[:, 2],
                        frag_mb=f[:, 3], mb_group=mb_group, mb_slot=np.array(mb_slot, np.int64),
                        mb_strategy=tuple(strategies), group_ptr=ptr, group_ranks=ranks,
                        chunk_keep=self.k if dependent else 0,
                        info=(("chunk", chunk), ("chunks", len(mb_slot)), ("documents_cut", dependent),
                              ("k", self.k)))
