"""The step IR: a global batch (:class:`StepProblem`) and its micro-batch
plan (:class:`StepPlan`), columnar and immutable like the attention IR
(docs/DESIGN.md, "Above one attention call").

A step plan says, for one optimizer step,

* which **fragments** ``(doc, start, end)`` of the step's documents go
  together: fragment ``f`` is tokens ``[start, end)`` of document ``doc`` and
  belongs to micro-batch ``frag_mb[f]``; fragments are listed micro-batch by
  micro-batch, in the order their samples are packed in that micro-batch's
  attention problem;
* on which **group** of global ranks each micro-batch runs (groups are CSR
  lists of ranks and may differ in size), with which attention **strategy**;
* in which **order**: micro-batch ``m`` has accumulation index
  ``mb_slot[m]``; a rank runs its micro-batches by increasing slot, and
  micro-batches of one slot run at the same time (their groups are
  disjoint);
* which documents wait for a later step (``queue_out``, WLB-LLM's outlier
  queue): state carried between steps is an explicit input
  (``StepProblem.carried``) and output, so a plan is a pure function of
  its inputs;
* whether documents are cut into **chunks** that carry their KV between
  micro-batches (ChunkFlow, ``chunk_keep = K ≥ 1``): a document's fragments
  then run in order, each a micro-batch of its own after the first, whose
  attention is its rows × every earlier key of the document; the pipeline
  schedule (:mod:`attnplan.step.pipeline`) keeps the activations of the
  last ``K`` chunks of a document and recomputes the others' forward before
  their backward. ``chunk_keep = 0``: every document is one fragment.

The verifier (:mod:`attnplan.step.verify`) checks the invariants.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..backends.cost import Profile
from .mesh import Mesh
from .model import Model


def _frozen(a, dtype=np.int64, shape=None) -> np.ndarray:
    out = np.array(a, dtype=dtype, copy=True)
    if shape is not None:
        out = out.reshape(shape)
    out.setflags(write=False)
    return out


@dataclass(frozen=True, slots=True, eq=False)
class StepProblem:
    """The documents of one step and what they run on.

    ``seqlens``: document lengths; the first ``carried`` came from the queue
    of earlier steps (in queue order), the rest are this step's batch.
    ``origin[i] = (step, index)``: the step and batch position document ``i``
    was drawn at. ``pairs[i]``: allowed (q, k) pairs of document ``i`` under
    ``mask`` (exact, from the mask pieces). ``packing``: optional packed-sequence
    id of every document (a fixed packing, for systems that never repack).
    ``partials_dtype`` and ``keep_kv``: the attention plans' options
    (:class:`attnplan.ir.problem.Problem`: partial outputs on the wire in
    bf16; the backward computes with the forward's KV). ``cache`` memoizes
    lowered attention plans (keyed by their full inputs; never part of a result)."""

    seqlens: np.ndarray
    origin: np.ndarray
    pairs: np.ndarray
    model: Model
    mesh: Mesh
    profile: Profile
    mask: str = "causal"
    block_size: int = 2048
    carried: int = 0
    step: int = 0
    packing: np.ndarray | None = None
    partials_dtype: str = "float32"
    keep_kv: bool = False
    cache: object = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        for name in ("seqlens", "origin", "pairs", "packing"):
            v = getattr(self, name)
            if isinstance(v, np.ndarray):
                v.setflags(write=False)

    @property
    def docs(self) -> int:
        return len(self.seqlens)

    @property
    def tokens(self) -> int:
        return int(self.seqlens.sum())

    @property
    def cap(self) -> int:
        """Memory per device (bytes)."""
        return self.mesh.cap(self.profile)

    def attention_options(self) -> str:
        """The attention plans' options that are not the defaults, as text ('' when none)."""
        return ", ".join(([f"partials {self.partials_dtype}"] if self.partials_dtype != "float32" else [])
                         + (["forward KV kept"] if self.keep_kv else []))

    def to_text(self) -> str:
        lens = self.seqlens.tolist()
        shown = ", ".join(map(str, lens[:12])) + (f", ... ({len(lens)} documents)" if len(lens) > 12 else "")
        opts = self.attention_options()
        return (f"step {self.step}: {self.tokens:,} tokens in {self.docs} documents ({self.carried} carried), "
                f"model {self.model.name}, mesh {self.mesh.spec()} ({self.mesh.devices_per_node}/node), "
                f"profile {self.profile.name}, mask {self.mask.strip()!r}" + (f", attention: {opts}" if opts else "")
                + f"\n  seqlens [{shown}]")


def kept_note(info: dict, unkept, n_mb: int) -> str:
    """Where a step asked to keep the forward's KV (``keep_kv``) does not, and why, in a few words ("" where
    it keeps it everywhere or was not asked to), from a plan's ``info``, ``mb_unkept`` and micro-batch count
    (or a report row's): the lines of ``plan step compile``, ``compare`` and ``show``."""
    why = info.get("keep_kv")
    if why is not None:  # planned without keep_kv altogether (step/driver.py)
        return f"forward KV kept in no micro-batch ({str(why).split(': ', 1)[-1]})"
    if unkept:
        return (f"forward KV not kept in {len(unkept)} of {n_mb} micro-batches (over the memory cap with it): "
                f"{', '.join(map(str, unkept))}")
    return ""


@dataclass(frozen=True, slots=True, eq=False)
class StepPlan:
    """A micro-batch plan of a :class:`StepProblem` (see the module doc)."""

    problem: StepProblem
    system: str
    frag_doc: np.ndarray
    frag_start: np.ndarray
    frag_end: np.ndarray
    frag_mb: np.ndarray
    mb_group: np.ndarray
    mb_slot: np.ndarray
    mb_strategy: tuple[str, ...]
    group_ptr: np.ndarray
    group_ranks: np.ndarray
    queue_out: np.ndarray = field(default_factory=lambda: _frozen([]))
    info: tuple = ()   # (key, value) pairs a system reports (context length, solver gap, ...)
    chunk_keep: int = 0  # ChunkFlow's K: documents may be cut into chunks carrying their KV (0: never cut)
    # micro-batches whose attention does not keep the forward's KV although the problem asks for it (keep_kv):
    # with it their devices would exceed the memory cap (step/kept.py), ascending
    mb_unkept: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("frag_doc", "frag_start", "frag_end", "frag_mb", "mb_group", "mb_slot", "group_ptr",
                     "group_ranks", "queue_out"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))
        object.__setattr__(self, "mb_strategy", tuple(self.mb_strategy))
        object.__setattr__(self, "info", tuple(self.info))
        object.__setattr__(self, "mb_unkept", tuple(self.mb_unkept))

    def mb_keeps_kv(self, m: int) -> bool:
        """Whether micro-batch ``m``'s attention keeps the forward's KV for its backward."""
        return self.problem.keep_kv and m not in self.mb_unkept

    def kept_note(self) -> str:
        """:func:`kept_note` of this plan."""
        return kept_note(self.info_dict(), self.mb_unkept, self.n_mb)

    # sizes and views ------------------------------------------------------------------------------
    @property
    def n_mb(self) -> int:
        return len(self.mb_group)

    @property
    def n_groups(self) -> int:
        return len(self.group_ptr) - 1

    @property
    def frag_len(self) -> np.ndarray:
        return self.frag_end - self.frag_start

    def mb_ptr(self) -> np.ndarray:
        """CSR offsets of each micro-batch's fragments (fragments are listed micro-batch by micro-batch)."""
        return np.searchsorted(self.frag_mb, np.arange(self.n_mb + 1), "left").astype(np.int64)

    def mb_prefix(self, m: int) -> int:
        """Keys before micro-batch ``m``'s rows: the start of its one fragment when that fragment is a
        later chunk of a document (its attention reads the document's earlier KV), else 0."""
        p = self.mb_ptr()
        f = int(p[m])
        return int(self.frag_start[f]) if p[m + 1] - f == 1 else 0

    def n_slots(self) -> int:
        return int(self.mb_slot.max()) + 1 if self.n_mb else 0

    def mb_seqlens(self, m: int) -> tuple[int, ...]:
        """Sample lengths of micro-batch ``m``'s attention problem, in order."""
        p = self.mb_ptr()
        return tuple(self.frag_len[p[m]:p[m + 1]].tolist())

    def group(self, g: int) -> np.ndarray:
        return self.group_ranks[self.group_ptr[g]:self.group_ptr[g + 1]]

    def mb_ranks(self, m: int) -> np.ndarray:
        return self.group(int(self.mb_group[m]))

    def mb_tokens(self) -> np.ndarray:
        return np.bincount(self.frag_mb, weights=self.frag_len, minlength=self.n_mb).astype(np.int64)

    def rank_order(self) -> list[list[int]]:
        """Per global rank, its micro-batches in the order it runs them (by slot)."""
        out: list[list[int]] = [[] for _ in range(self.problem.mesh.stage_devices)]
        for m in np.lexsort((np.arange(self.n_mb), self.mb_slot)).tolist():
            for r in self.mb_ranks(m).tolist():
                out[r].append(m)
        return out

    def info_dict(self) -> dict:
        return dict(self.info)

    def to_text(self, limit: int = 200) -> str:
        """Every fragment with its micro-batch, slot, strategy and global ranks (``plan step show``)."""
        p = self.problem
        lines = [p.to_text(), f"system {self.system}: {self.n_mb} micro-batches, {self.n_groups} groups, "
                 f"{len(self.frag_doc)} fragments, {len(self.queue_out)} documents queued for later steps"]
        for key, value in self.info:
            lines.append(f"  {key} = {value}")
        if self.mb_unkept:
            lines.append(f"  {self.kept_note()}")
        ptr = self.mb_ptr()
        shown = 0
        for m in range(self.n_mb):
            ranks = self.mb_ranks(m)
            lines.append(f"mb {m} slot {int(self.mb_slot[m])} group {int(self.mb_group[m])} ranks "
                         f"{_ranks_text(ranks)} strategy {self.mb_strategy[m]} tokens "
                         f"{int(self.frag_len[ptr[m]:ptr[m + 1]].sum()):,}")
            for f in range(int(ptr[m]), int(ptr[m + 1])):
                if shown >= limit:
                    break
                d = int(self.frag_doc[f])
                lines.append(f"  frag {f}: doc {d} [{int(self.frag_start[f])}, {int(self.frag_end[f])}) "
                             f"of {int(p.seqlens[d])}")
                shown += 1
        if shown >= limit and len(self.frag_doc) > limit:
            lines.append(f"... {len(self.frag_doc) - limit} more fragments")
        if len(self.queue_out):
            lines.append("queued: " + ", ".join(f"doc {int(d)} ({int(p.seqlens[d])})" for d in self.queue_out[:50]))
        return "\n".join(lines)


def _ranks_text(ranks: np.ndarray) -> str:
    r = ranks.tolist()
    if len(r) > 1 and r == list(range(r[0], r[-1] + 1)):
        return f"{r[0]}..{r[-1]}"
    return ",".join(map(str, r))


def build_plan(problem: StepProblem, system: str, mb_docs: list, mb_ranks: list, mb_slot, mb_strategy,
               queue_out=(), info=()) -> StepPlan:
    """A plan whose micro-batch ``m`` holds the whole documents ``mb_docs[m]``
    (in that order) on the global ranks ``mb_ranks[m]``. Equal rank lists
    share one group. The batch passes of this issue never split a document,
    so this is the one constructor they need."""
    lens = problem.seqlens
    counts = np.array([len(d) for d in mb_docs], dtype=np.int64)
    docs = np.concatenate([np.asarray(d, np.int64) for d in mb_docs]) if len(mb_docs) else np.zeros(0, np.int64)
    groups: dict[tuple, int] = {}
    mb_group = []
    for ranks in mb_ranks:
        key = tuple(int(r) for r in ranks)
        mb_group.append(groups.setdefault(key, len(groups)))
    keys = list(groups)
    ptr = np.concatenate([[0], np.cumsum([len(k) for k in keys])]).astype(np.int64)
    ranks_flat = np.array([r for k in keys for r in k], dtype=np.int64)
    return StepPlan(problem, system, frag_doc=docs, frag_start=np.zeros(len(docs), np.int64), frag_end=lens[docs],
                    frag_mb=np.repeat(np.arange(len(mb_docs), dtype=np.int64), counts),
                    mb_group=np.array(mb_group, np.int64), mb_slot=np.asarray(mb_slot, np.int64),
                    mb_strategy=tuple(mb_strategy), group_ptr=ptr, group_ranks=ranks_flat,
                    queue_out=np.asarray(queue_out, np.int64), info=tuple(info))
