"""fixed — the baseline users run today (survey §1.1, §2.4 "BSHD"): documents
packed in data order into sequences of the context length, the sequences
dealt to data-parallel replicas in order, one CP size for all (the mesh's),
``zigzag`` over each packed sequence inside its CP group.

Choices the survey leaves open, made here:

* Packing is next-fit in data order: a sequence takes documents until the
  next one would overflow the context length, and a document is never cut
  (this issue does not split documents across micro-batches; real loaders
  truncate or wrap the overflow instead).
* ``context=0`` (the default) takes the *smallest* context length, at least
  the longest document, at which the batch packs into ``dp · micro``
  sequences — the most favourable fixed configuration for the batch, so a
  speedup measured against it is not inflated by a badly chosen context.
  A given ``context`` packs into as many sequences as it takes.
* A problem that carries a fixed packing (``StepProblem.packing``) keeps it
  when ``context=0``: sequence ids in increasing order, documents in order.
* Sequence ``k`` goes to replica ``k mod dp`` as its ``k // dp``-th
  micro-batch (gradient-accumulation index).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import StepError
from ...ir.limits import MAX_MICRO_BATCHES
from ..base import StepPass, check_int
from ..ir import StepPlan, StepProblem, build_plan
from ..lower import check_option, choose_strategy
from .common import check_fits, deal, pipeline_micro


def next_fit(lens: np.ndarray, context: int, limit: int) -> np.ndarray | None:
    """Start index of every sequence of the next-fit packing of ``lens`` (in order) into ``context``
    tokens, or None once it needs more than ``limit`` sequences. Each step is one binary search on the
    prefix sums; every length must be at most ``context``."""
    ends = np.cumsum(lens)
    starts = [0]
    base = 0
    while True:
        i = int(np.searchsorted(ends, base + context, "right"))  # documents [start, i) fit
        if i == starts[-1]:
            raise StepError(f"document {i} ({int(lens[i]):,} tokens) is longer than the context length {context:,}")
        if i >= len(lens):
            return np.asarray(starts, np.int64)
        if len(starts) >= limit:
            return None
        starts.append(i)
        base = int(ends[i - 1])


def smallest_context(lens: np.ndarray, sequences: int) -> int:
    """The smallest context length (at least the longest document) whose next-fit packing needs at
    most ``sequences`` sequences (the count never grows with the context: binary search)."""
    lo, hi = int(lens.max()), int(lens.sum())
    while lo < hi:
        mid = (lo + hi) // 2
        if next_fit(lens, mid, sequences) is None:
            lo = mid + 1
        else:
            hi = mid
    return lo


@dataclass(frozen=True, slots=True)
class Fixed(StepPass):
    name = "fixed"
    context: int = 0          # tokens per packed sequence; 0 = the smallest that packs into dp · micro sequences
    micro: int = 1            # packed sequences per replica and step (with context=0)
    strategy: str = "zigzag"  # attention strategy inside each CP group (or auto: the fastest per micro-batch)

    def __post_init__(self):
        check_int("fixed", "context", self.context, 0, 1 << 40)
        check_int("fixed", "micro", self.micro, 1, MAX_MICRO_BATCHES)
        check_option("fixed", "strategy", self.strategy, adaptive=False)

    def apply(self, problem: StepProblem) -> StepPlan:
        mesh, lens = problem.mesh, problem.seqlens
        check_fits(problem, np.arange(problem.docs), mesh.cp, "fixed")
        if problem.packing is not None and self.context == 0:
            order = np.argsort(problem.packing, kind="stable")
            _, starts = np.unique(problem.packing[order], return_index=True)
            docs = np.split(order, starts[1:])
            context = int(max(lens[d].sum() for d in docs))
        else:
            if self.context:
                context = self.context
                if lens.max() > context:
                    i = int(np.argmax(lens))
                    raise StepError(f"fixed: document {i} ({int(lens[i]):,} tokens) is longer than the context "
                                    f"length {context:,}; give fixed{{context=...}} at least {int(lens.max()):,}")
            else:
                context = smallest_context(lens, mesh.dp * pipeline_micro(problem, self.micro))
            cuts = next_fit(lens, context, MAX_MICRO_BATCHES)
            if cuts is None:
                raise StepError(f"fixed: the context length {context:,} packs the batch into more than "
                                f"{MAX_MICRO_BATCHES:,} sequences (ir/limits.py MAX_MICRO_BATCHES)")
            docs = np.split(np.arange(len(lens), dtype=np.int64), cuts[1:])
        replica, slot = deal(len(docs), mesh.dp)
        ranks = [mesh.cp_group(int(r)) for r in replica]
        inner = [choose_strategy(problem, tuple(lens[d].tolist()), r, self.strategy) for d, r in zip(docs, ranks)]
        return build_plan(problem, self.spec(), docs, ranks, slot, inner,
                          info=[("context", context), ("sequences", len(docs))])
