"""A step-level loader for training (issue 10, item 7): given global batches
of token-id documents and a mesh, it plans every step with a batch pass (a
system of :mod:`attnplan.step`) ahead of time in worker processes, and
yields, on each rank, the micro-batches that rank runs, in order::

    import torch.distributed as dist
    from attnplan.step import Mesh
    from attnplan.tools.step_loader import StepLoader

    with StepLoader(batches, model=my_model, mesh=Mesh(dp=2, cp=2), system="wlb") as loader:
        for step in loader:                    # one optimizer step: this rank's share of the global batch
            for mb in step:                    # its micro-batches, in gradient-accumulation order
                logits = net(mb.ids, mb.position_ids, mb.attention)   # mb.attention(q, k, v): its group's plan
                loss = (cross_entropy(logits, mb.labels.clamp_min(0), reduction="none") * mb.loss_weights).sum()
                loss.backward()
            # sum the gradients over all dp × cp ranks (one all_reduce), then the optimizer step

**Planning.** ``batches`` is any iterable of global batches, each a list of
documents (1-D integer token ids) or a dict with ``docs`` and an optional
``name``; :func:`batch_documents` cuts a stream of documents into global
batches. Only the document lengths go to the workers (a
:class:`~attnplan.tools.prefetch.PlanPrefetcher` whose worker function is
:func:`plan_step_to_bytes`): each builds the step problem
(:func:`attnplan.step.make_problem`: the lengths, the model, the mesh, the
cost profile, the mask, the block size), plans and verifies it
(:func:`attnplan.step.compile_step`: batch pass, step verifier, every
micro-batch lowered to a verified attention plan, memory under the cap) and
sends back the step file (:mod:`attnplan.step.stepfile`), which the training
process reads with the step file's checks (schema, verifier, every attention
plan matched to its micro-batch) — nothing is pickled. A plan is a pure
function of the batch and the options, so every rank plans the same step on
its own; the loader proves it once per step (an ``all_gather`` of the step
file's digest over the default group, :class:`~attnplan.errors.StepError`
naming the ranks that differ) before any group is built or any attention
call made.

**Process groups.** A micro-batch's attention runs on its group's global
ranks, device ``d`` of its attention plan being the ``d``-th of them. A
torch.distributed sub-group is built once per distinct rank set and reused
for every later micro-batch on the same ranks; a group of all the ranks is
the default group itself. ``new_group`` must be called by every rank in the same
order: each rank walks the same (verified equal) step plan's groups in
index order and builds the ones it has not built yet, so the calls agree
without any extra communication.

**What a rank gets per micro-batch** (:class:`MicroBatch`), in the local
layout of its attention plan (its home token blocks in increasing order,
:mod:`attnplan.runtime.layout`): token ids; labels (the next token of the
same document, ``-100`` at a document's last token); loss weights
(``1 / L`` on every labelled token, ``L`` the label tokens of the whole
step over all ranks, 0 elsewhere — so Σ weight × token loss over every rank
and micro-batch is the global mean, and summing parameter gradients over all
``dp × cp`` ranks gives the gradient of single-process training on the
global batch); ``position_ids`` (the position inside the token's document,
a fragment's start included); the attention plan (an :class:`attnplan.Plan`)
and its process group. A rank's micro-batches come in the order it runs
them: by slot, then index — one total order that every rank follows
(micro-batches of one slot have disjoint groups), so no two ranks wait on
each other in opposite orders. A rank may hold no token of a micro-batch
(a short document on a large group) and must still call its attention: its
device may compute or forward blocks of others.

**Pipelines and chunks.** With ``pp > 1`` the job has ``dp · cp · pp`` ranks; every stage runs the
same micro-batches on the same stage-local groups, so a rank of stage ``s`` gets the micro-batches of its
stage-local rank ``rank mod dp · cp``, the same tokens at every stage, with the process group of stage
``s`` (global ranks ``s · dp · cp +`` the local group, :func:`stage_ranks`; built for every stage on every
rank). A later chunk of a document cut by ChunkFlow has a cross plan (queries = its rows, keys = its
document up to its end): a rank gets the rows of the chunk it homes on the query side
(:func:`query_rows`); the key rows it homes (:func:`key_rows`) are K, V of the document the training
loop carries from the earlier chunks (examples/train_step.py).

Choices made here:

* A system that queues documents for a later step (WLB-LLM's outlier queue,
  ``wlb{outlier>0}``; :meth:`StepPass.carries_state`) makes step ``s + 1``'s
  plan depend on step ``s``'s: step ``s + 1`` is planned with step ``s``'s
  ``queue_out`` as its ``carried`` documents (their token ids stay in the
  training process, their origins ``(step, index)`` go into the plan). The
  steps are then planned as a chain, in order, by one worker process: as
  soon as step ``s``'s plan arrives, step ``s + 1`` is sent to the worker
  with its carried lengths, so planning stays one step ahead of training
  (``lookahead`` does not apply; ``workers=0`` plans in place when a step
  is asked for). Every rank runs the same chain, so the plans stay equal
  and two runs are identical. When the data ends with documents still
  queued, the loader yields one more step, named ``end-of-data``, holding
  only those documents (a step without new documents drains the queue), so
  every document of the data is trained exactly once. A step that fails
  (a malformed batch, a planning error) trains nothing, and the documents
  carried into it are carried on to the next step.
* Planning errors (a document no mesh group can hold, a bad option) are
  raised typed when their step comes up, with its batch named; the following
  steps still come (the prefetcher's rule). A malformed batch (not a list of
  non-empty integer documents with ids in ``[0, vocab)``) is a
  :class:`BatchError` at its step, the same way.
* ``process_groups=False`` builds no groups and needs no torch.distributed
  (inspection, tests, in-process execution): ``rank`` must be given and
  ``MicroBatch.group`` is ``None``.

Nothing here uses a global random number generator. Worker processes import
no torch (the step layer is numpy only); torch is imported in the training
process, when a step is handed out.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import AttnplanError, BatchError, PlanError, StepError
from ..ir.limits import MAX_SAMPLES, MAX_TOKENS
from ..step import Mesh, StepPlan, compile_step, load_model, make_problem, parse_system
from ..step.model import Model, model_from_dict
from ..step.stepfile import LoadedStep
from ..step.stepfile import pack as pack_step
from ..step.stepfile import unpack as unpack_step
from .prefetch import WORKER_DIED, PlanPrefetcher

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .plan import Plan

IGNORE = -100  # the label of a document's last token (no next token), as torch's cross_entropy ignores


# ------------------------------------------------------------------------------------ worker side

def planning_options(model, mesh: Mesh, system: str = "wlb", profile: str = "h100", mask: str = "causal",
                     block_size: int = 2048, partials_dtype: str = "float32", keep_kv: bool = False) -> dict:
    """The plain, picklable options a planning worker needs (checked here, in the training process)."""
    mdl = load_model(model)
    if not isinstance(mesh, Mesh):
        raise StepError(f"mesh must be an attnplan.step.Mesh, got {type(mesh).__name__}")
    if not isinstance(system, str):
        raise StepError(f"system must be text such as wlb or gds{{inner=dacp}}, got {type(system).__name__}")
    spec = parse_system(system).spec()  # unknown systems and options fail here, not in a worker
    if not isinstance(profile, str):
        raise StepError(f"profile must be a builtin profile name (a step file records no other), got "
                        f"{type(profile).__name__}")
    if not isinstance(mask, str):
        raise StepError(f"mask must be mask text or a builtin mask name, got {type(mask).__name__}")
    opts = {"model": mdl.to_dict(), "mesh": {f.name: getattr(mesh, f.name) for f in dataclasses.fields(Mesh)},
            "system": spec, "profile": profile, "mask": mask, "block_size": block_size,
            "partials_dtype": partials_dtype, "keep_kv": keep_kv}
    make_problem([1], model=mdl, mesh=mesh, profile=profile, mask=mask, block_size=block_size,  # checks the rest
                 partials_dtype=partials_dtype, keep_kv=keep_kv)
    return opts


def _problem(seqlens, opts: dict):
    return make_problem(seqlens, model=model_from_dict(opts["model"], "<planning options>"), mesh=Mesh(**opts["mesh"]),
                        profile=opts["profile"], mask=opts["mask"], block_size=opts["block_size"],
                        partials_dtype=opts["partials_dtype"], keep_kv=opts["keep_kv"])


def plan_step_to_bytes(seqlens, segments, opts: dict):
    """Worker side (the prefetcher's ``compile_fn``): plan one step of documents of lengths ``seqlens``
    with ``opts`` (:func:`planning_options`); ``("ok", step file bytes)`` or ``("error", AttnplanError)``."""
    try:
        if segments is not None:
            raise StepError("the step loader takes documents without segments")
        return ("ok", pack_step(compile_step(_problem(seqlens, opts), opts["system"])))
    except AttnplanError as e:
        err: AttnplanError = e
    except Exception as e:  # a bug, not bad input: still name the step in the training process
        err = StepError(f"step planning failed: {type(e).__name__}: {e}")
    try:
        pickle.dumps(err)
    except Exception:
        err = StepError(f"step planning failed: {type(err).__name__}: {err}")
    return ("error", err)


def plan_chain_step_to_bytes(seqlens, carried, carried_origin, step: int, opts: dict):
    """Worker side of a chain (a system that carries documents between steps): plan step ``step`` of
    new documents of lengths ``seqlens`` after the ``carried`` ones (their ``(step, index)`` origins);
    what :func:`plan_step_to_bytes` returns."""
    try:
        problem = make_problem(seqlens, model=model_from_dict(opts["model"], "<planning options>"),
                               mesh=Mesh(**opts["mesh"]), profile=opts["profile"], mask=opts["mask"],
                               block_size=opts["block_size"], carried=carried, carried_origin=carried_origin,
                               step=step, partials_dtype=opts["partials_dtype"], keep_kv=opts["keep_kv"])
        return ("ok", pack_step(compile_step(problem, opts["system"])))
    except AttnplanError as e:
        err: AttnplanError = e
    except Exception as e:  # a bug, not bad input
        err = StepError(f"step planning failed: {type(e).__name__}: {e}")
    try:
        pickle.dumps(err)
    except Exception:
        err = StepError(f"step planning failed: {type(err).__name__}: {err}")
    return ("error", err)


def read_step(data: bytes, source: str) -> tuple[bytes, LoadedStep]:
    """Training side (the prefetcher's ``decode``): the step file's digest and the checked step."""
    return hashlib.sha256(data).digest(), unpack_step(data, source)


# ------------------------------------------------------------------------------------ batches

def batch_documents(documents: Iterable, tokens: int, drop_last: bool = False) -> Iterator[list[np.ndarray]]:
    """Global batches from a stream of documents, in order: each batch takes documents until it holds at
    least ``tokens`` tokens (documents are never cut); the last, shorter one too unless ``drop_last``."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= MAX_TOKENS:
        raise BatchError(f"tokens per step must be an integer in 1..{MAX_TOKENS:,}, got {tokens!r:.40}")
    batch: list[np.ndarray] = []
    held = 0
    for doc in documents:
        a = np.asarray(doc)
        batch.append(a)
        held += int(a.size)
        if held >= tokens:
            yield batch
            batch, held = [], 0
    if batch and not drop_last:
        yield batch


def _documents(batch, vocab: int) -> list[np.ndarray]:
    """A batch's documents as int64 arrays, checked (BatchError naming the document)."""
    docs = batch.get("docs") if isinstance(batch, dict) else batch
    if isinstance(docs, (str, bytes)) or not isinstance(docs, Iterable):
        raise BatchError(f"a global batch is a list of documents (token ids) or a dict with 'docs', got "
                         f"{type(batch).__name__}")
    out: list[np.ndarray] = []
    for i, d in enumerate(docs):
        if len(out) >= MAX_SAMPLES:
            raise BatchError(f"more than MAX_SAMPLES = {MAX_SAMPLES:,} documents (ir/limits.py)")
        a = np.asarray(d)
        if a.ndim != 1 or not len(a) or a.dtype.kind not in "iu":
            raise BatchError(f"document {i}: a non-empty 1-D array of integer token ids, got "
                             f"{a.dtype} of shape {a.shape}")
        if int(a.min()) < 0 or int(a.max()) >= vocab:
            raise BatchError(f"document {i}: token ids must be in 0..{vocab - 1} (the model's vocabulary)")
        out.append(a.astype(np.int64))
    if not out:
        raise BatchError("the batch has no documents")
    if sum(len(a) for a in out) > MAX_TOKENS:
        raise BatchError(f"more than MAX_TOKENS = {MAX_TOKENS:,} tokens (ir/limits.py)")
    return out


def _requests(batches, vocab: int) -> Iterator[dict]:
    """What the prefetcher sees of each batch: its name and document lengths (the token ids stay here).
    A malformed batch is planned as one token and its error raised when it comes up."""
    for i, batch in enumerate(batches):
        name = str(batch.get("name", f"#{i}")) if isinstance(batch, dict) else f"#{i}"
        try:
            docs = _documents(batch, vocab)
        except BatchError as e:
            yield {"name": name, "seqlens": [1], "error": e.with_prefix(f"step {name}: ")}
            continue
        yield {"name": name, "seqlens": [len(a) for a in docs], "docs": docs}


# ------------------------------------------------------------------------------------ what a rank gets

@dataclasses.dataclass(frozen=True, eq=False)
class MicroBatch:
    """One micro-batch as one rank runs it (see the module doc). Tensors are CPU torch tensors in the
    attention plan's local layout of ``device``: ``ids``, ``labels``, ``position_ids`` int64,
    ``loss_weights`` float32; ``doc_ids`` the step document of each local token."""

    index: int              # the micro-batch in the step plan
    slot: int               # its gradient-accumulation index
    ranks: tuple[int, ...]  # global ranks of its group: device d of the plan is ranks[d]
    device: int             # this rank's device in the plan
    plan: Plan
    group: Any              # the torch.distributed group of ``ranks`` (None without process groups)
    ids: torch.Tensor
    labels: torch.Tensor
    loss_weights: torch.Tensor
    position_ids: torch.Tensor
    doc_ids: torch.Tensor
    label_tokens: int       # labelled tokens of this rank in this micro-batch

    def attention(self, q, k, v, **kw):
        """:func:`attnplan.attention` of this micro-batch's plan on its group."""
        from .compiler import attention
        return attention(q, k, v, self.plan, self.group, **kw)


@dataclasses.dataclass(frozen=True, eq=False)
class StepBatch:
    """One optimizer step on one rank: its micro-batches in order (iterate it), the step plan, and the
    global batch's label count (the loss normalization, the same on every rank)."""

    index: int
    name: str
    rank: int
    plan: StepPlan
    micro_batches: tuple[MicroBatch, ...]
    label_tokens: int       # over the whole step, every rank
    tokens: int             # tokens of the whole step
    digest: bytes           # sha256 of the step file: equal on every rank
    stage: int = 0          # this rank's pipeline stage (its micro-batches are those of rank mod dp · cp)

    def __iter__(self) -> Iterator[MicroBatch]:
        return iter(self.micro_batches)

    def __len__(self) -> int:
        return len(self.micro_batches)


def fragment_arrays(plan: StepPlan, m: int, docs: list[np.ndarray]) -> tuple[np.ndarray, ...]:
    """Micro-batch ``m``'s packed token ids, labels, positions and documents (global token order of its
    attention problem: fragments in plan order). Labels are the next token of the same document
    (``IGNORE`` after its last token), positions count from the document's start."""
    ptr = plan.mb_ptr()
    ids, labels, pos, doc = [], [], [], []
    for f in range(int(ptr[m]), int(ptr[m + 1])):
        d, s, e = int(plan.frag_doc[f]), int(plan.frag_start[f]), int(plan.frag_end[f])
        a = docs[d]
        ids.append(a[s:e])
        nxt = np.full(e - s, IGNORE, np.int64)
        last = min(e, len(a) - 1)  # tokens s..last-1 have a next token in the document
        nxt[:max(0, last - s)] = a[s + 1:last + 1]
        labels.append(nxt)
        pos.append(np.arange(s, e, dtype=np.int64))
        doc.append(np.full(e - s, d, np.int64))
    return tuple(np.concatenate(x) for x in (ids, labels, pos, doc))


def step_label_tokens(plan: StepPlan) -> int:
    """Labelled tokens of the whole step: every computed token but a document's last one."""
    lens = plan.problem.seqlens[plan.frag_doc]
    return int((plan.frag_len - (plan.frag_end == lens)).sum())


def stage_ranks(local_ranks, stage: int, mesh: Mesh) -> tuple[int, ...]:
    """The global ranks of a group of stage-local ranks on pipeline stage ``stage`` (``mesh.py``: global
    rank = stage · dp · cp + local rank; every stage runs the same micro-batches on the same local groups)."""
    n = mesh.stage_devices
    return tuple(stage * n + int(r) for r in np.asarray(local_ranks).tolist())


def query_rows(ir, device: int) -> np.ndarray:
    """Rows of ``device``'s local layout as indices into the micro-batch's own token rows (its fragments'
    tokens in order): the packed index of a self-attention plan; for a later chunk of a document (a cross
    plan: queries = its rows, keys = the document up to its end) the index among the query tokens, its
    key-side rows being KV only (:func:`key_rows`)."""
    from ..runtime.layout import local_index, side_rows
    if ir.problem.q_lens is None:
        return local_index(ir, device)
    return side_rows(ir, device, "q")[1]


def key_rows(ir, device: int) -> np.ndarray | None:
    """For a cross plan (a later chunk of a document), the key tokens ``device`` holds, as positions in
    the document (key ``k`` is the document's token ``k``); None for a self-attention plan."""
    from ..runtime.layout import side_rows
    if ir.problem.q_lens is None:
        return None
    return side_rows(ir, device, "k")[1]


class GroupCache:
    """torch.distributed groups by their global ranks, each built once and reused (see the module doc)."""

    def __init__(self, world: int):
        self.world = world
        self._groups: dict[tuple[int, ...], Any] = {}

    def __len__(self) -> int:
        return len(self._groups)

    def ensure(self, plan: StepPlan) -> None:
        """Build the groups of ``plan`` not built yet, in the plan's group order, each on every pipeline
        stage (stage ``s`` of a group of stage-local ranks ``G`` is the global ranks ``s · dp · cp + G``):
        every rank calls this with the same plan, so every rank calls ``new_group`` the same times in the
        same order."""
        import torch.distributed as dist
        mesh = plan.problem.mesh
        for g in range(plan.n_groups):
            for s in range(mesh.pp):
                key = stage_ranks(plan.group(g), s, mesh)
                if key not in self._groups:
                    self._groups[key] = dist.group.WORLD if key == tuple(range(self.world)) else \
                        dist.new_group(list(key))

    def get(self, ranks: tuple[int, ...]):
        if ranks not in self._groups:
            raise StepError(f"no process group was built for ranks {list(ranks)[:16]}")
        return self._groups[ranks]


class StepLoader:
    """Iterate :class:`StepBatch` es of this rank, planned ahead in ``workers`` processes (see the module doc).

    ``model``: an :class:`attnplan.step.Model`, a preset name or a JSON file (its heads, KV heads and
    head dim are the attention plans'); ``mesh``: the :class:`attnplan.step.Mesh` (``dp · cp · pp`` ranks:
    a rank of pipeline stage ``s`` gets the micro-batches of its stage-local rank ``rank mod dp · cp``, whose
    groups are that stage's global ranks, :func:`stage_ranks`);
    ``system``: a batch pass as text (``wlb``, ``gds``, ``pool{inner=minheap}`` ...); ``profile``, ``mask``,
    ``block_size``, ``partials_dtype``, ``keep_kv``: as for :func:`attnplan.step.make_problem`. ``rank``:
    default the process's rank in the default group. ``workers``/``lookahead``: as for
    :class:`PlanPrefetcher` (``workers=0`` plans in this process when a step is asked for). ``check``: prove
    once per step that every rank holds the same step plan. ``timeout``: seconds for that check (and nothing else)."""

    def __init__(self, batches, model, mesh: Mesh, system: str = "wlb", *, profile: str = "h100",
                 mask: str = "causal", block_size: int = 2048, rank: int | None = None, workers: int = 1,
                 lookahead: int | None = None, process_groups: bool = True, check: bool = True,
                 mp_context: str = "spawn", partials_dtype: str = "float32", keep_kv: bool = False):
        self.opts = planning_options(model, mesh, system, profile, mask, block_size, partials_dtype, keep_kv)
        self.model: Model = load_model(model)
        self.mesh = mesh
        self.world = mesh.devices
        self.process_groups, self.check = bool(process_groups), bool(check)
        if process_groups:
            import torch.distributed as dist
            if not dist.is_available() or not dist.is_initialized():
                raise StepError("StepLoader: torch.distributed is not initialized (call init_process_group "
                                "first, or pass process_groups=False with a rank)")
            if dist.get_world_size() != self.world:
                raise StepError(f"StepLoader: the mesh {mesh.spec()} has {self.world} ranks but the default "
                                f"group has {dist.get_world_size()}")
            if rank is None:
                rank = dist.get_rank()
            elif rank != dist.get_rank():
                raise StepError(f"StepLoader: rank {rank} given, but this process is rank {dist.get_rank()}")
        if rank is None or isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) \
                or not 0 <= rank < self.world:
            raise StepError(f"StepLoader: rank must be an integer in 0..{self.world - 1}, got {rank!r:.40}")
        self.rank = int(rank)
        self.stage, self.local_rank = divmod(self.rank, mesh.stage_devices)
        self.groups = GroupCache(self.world)
        self._index = 0
        self._chain: _Chain | None = None
        self._prefetcher: PlanPrefetcher | None = None
        if parse_system(self.opts["system"]).carries_state():
            self._chain = _Chain(_requests(batches, self.model.vocab), self.opts, workers, mp_context)
        else:
            self._prefetcher = PlanPrefetcher(_requests(batches, self.model.vocab), self.opts, workers=workers,
                                              lookahead=lookahead, mp_context=mp_context,
                                              compile_fn=plan_step_to_bytes, decode=read_step)

    def __iter__(self) -> StepLoader:
        return self

    def __next__(self) -> StepBatch:
        index = self._index
        try:  # a planning error is raised here, typed, its batch named; the next steps still come
            source = self._chain if self._chain is not None else self._prefetcher
            if source is None:
                raise StopIteration
            request, (digest, loaded) = next(source)
        finally:
            self._index += 1
        if "error" in request:
            raise request["error"]
        name = request["name"]
        plan = loaded.plan
        docs = request.get("all_docs", request["docs"])   # carried documents first, in a chain
        if plan.problem.seqlens.tolist() != [len(a) for a in docs]:
            raise StepError(f"step {name}: the step plan is not of this batch's documents")
        if len(plan.queue_out) and self._chain is None:
            raise StepError(f"step {name}: system {plan.system} queued {len(plan.queue_out)} document(s) for a "
                            f"later step, but it does not say it carries state (StepPass.carries_state)")
        if self.process_groups and self.check:
            self._agree(digest, name)
        if self.process_groups:
            self.groups.ensure(plan)
        return self._step(index, name, plan, loaded.attention, docs, digest)

    def _agree(self, digest: bytes, name: str) -> None:
        """Every rank holds the same step plan (an all_gather of 16 bytes of its digest)."""
        import torch
        import torch.distributed as dist
        mine = torch.from_numpy(np.frombuffer(digest[:16], dtype=np.int64).copy())
        every = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine)
        seen: dict[tuple, list[int]] = {}
        for r, t in enumerate(every):
            seen.setdefault(tuple(t.tolist()), []).append(r)
        if len(seen) > 1:
            parts = "; ".join(f"rank(s) {', '.join(map(str, rs))}: plan {k[0] & 0xffffffffffff:012x}"
                              for k, rs in seen.items())
            raise StepError(f"step {name}: the ranks planned different steps ({parts}); every rank must read "
                            f"the same global batches with the same options")

    def _step(self, index: int, name: str, plan: StepPlan, attention, docs: list[np.ndarray],
              digest: bytes) -> StepBatch:
        import torch

        from .plan import Plan
        total = step_label_tokens(plan)
        out = []
        for m in plan.rank_order()[self.local_rank]:
            local = [int(r) for r in plan.mb_ranks(m).tolist()]
            ranks = stage_ranks(local, self.stage, plan.problem.mesh)
            device = local.index(self.local_rank)
            ir = attention[m]
            ids, labels, pos, doc = fragment_arrays(plan, m, docs)
            idx = query_rows(ir, device)
            lab = labels[idx]
            has = lab != IGNORE
            w = np.where(has, 1.0 / total, 0.0) if total else np.zeros(len(idx))
            out.append(MicroBatch(
                index=m, slot=int(plan.mb_slot[m]), ranks=ranks, device=device,
                plan=Plan(ir, {"strategy": plan.mb_strategy[m], "block_size": plan.problem.block_size}),
                group=self.groups.get(ranks) if self.process_groups else None,
                ids=torch.from_numpy(ids[idx]), labels=torch.from_numpy(lab),
                loss_weights=torch.from_numpy(w.astype(np.float32)), position_ids=torch.from_numpy(pos[idx]),
                doc_ids=torch.from_numpy(doc[idx]), label_tokens=int(has.sum())))
        return StepBatch(index, name, self.rank, plan, tuple(out), total, plan.problem.tokens, digest, self.stage)

    def close(self) -> None:
        """Stop the planning workers (the process groups stay: they belong to the default group)."""
        if self._prefetcher is not None:
            self._prefetcher.close()
        if self._chain is not None:
            self._chain.close()

    def __enter__(self) -> StepLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Chain:
    """Steps planned in order, each with the previous step's queue as its carried documents (see the
    module doc): one step in flight in one worker process (none with ``workers=0``). Yields what the
    prefetcher yields, ``(request, (digest, LoadedStep))``, the request gaining ``all_docs`` (the carried
    documents' token ids, then the batch's)."""

    END = "end-of-data"

    def __init__(self, requests, opts: dict, workers: int, mp_context: str):
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise PlanError(f"StepLoader: workers must be a non-negative integer, got {workers!r:.40}")
        self._requests = requests
        self.opts = opts
        try:
            self._ctx = multiprocessing.get_context(mp_context)
        except (ValueError, TypeError):
            raise PlanError(f"StepLoader: mp_context must be one of "
                            f"{', '.join(multiprocessing.get_all_start_methods())}, got {mp_context!r:.40}") from None
        self._pool = ProcessPoolExecutor(1, mp_context=self._ctx) if workers else None
        self._carried: list[np.ndarray] = []        # token ids of the queued documents, in queue order
        self._carried_origin = np.zeros((0, 2), np.int64)
        self._step = 0
        self._done = False
        self._pending: tuple[dict, Any] | None = None   # (request, future or None)
        self._advance()

    def _advance(self) -> None:
        """Take the next request (or the end-of-data step while documents are queued) and send it."""
        if self._pending is not None or self._done:
            return
        try:
            request = next(self._requests)
        except StopIteration:
            if not self._carried:
                self._done = True
                return
            request = {"name": self.END, "seqlens": [], "docs": []}
        request = dict(request, step=self._step, all_docs=self._carried + list(request.get("docs", [])),
                       carried=[len(a) for a in self._carried], carried_origin=self._carried_origin)
        self._step += 1
        future = None
        if "error" not in request and self._pool is not None:
            future = self._pool.submit(plan_chain_step_to_bytes, request["seqlens"], request["carried"],
                                       request["carried_origin"], request["step"], self.opts)
        self._pending = (request, future)

    def __iter__(self):
        return self

    def __next__(self):
        from concurrent.futures.process import BrokenProcessPool
        if self._pending is None:
            self._advance()
            if self._pending is None:
                raise StopIteration
        request, future = self._pending
        self._pending = None
        if "error" in request:          # a malformed batch: nothing trained, the queue carries on
            self._advance()
            return request, (b"", None)
        args = (request["seqlens"], request["carried"], request["carried_origin"], request["step"], self.opts)
        try:
            res = future.result() if future is not None else plan_chain_step_to_bytes(*args)
        except BrokenProcessPool:       # the worker died: a new one plans the next steps
            from concurrent.futures import ProcessPoolExecutor
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = ProcessPoolExecutor(1, mp_context=self._ctx)
            res = ("error", PlanError(f"{WORKER_DIED} before this step was planned; the worker was restarted"))
        if res[0] == "error":
            self._advance()
            raise res[1].with_prefix(f"batch {request['name']}: ")
        digest, loaded = read_step(res[1], f"<step plan of batch {request['name']}>")
        queue = loaded.plan.queue_out.tolist()
        origin = loaded.plan.problem.origin
        self._carried = [request["all_docs"][d] for d in queue]
        self._carried_origin = origin[queue].reshape(-1, 2) if queue else np.zeros((0, 2), np.int64)
        self._advance()                 # the next step plans while this one trains
        return request, (digest, loaded)

    def close(self) -> None:
        self._done = True
        if self._pending is not None and self._pending[1] is not None:
            self._pending[1].cancel()
        self._pending = None
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
