"""Pipeline schedules of a step plan (survey §1.4, §5): for every pipeline
stage, the ordered forward and backward ops it runs.

**Units.** The plan's slots are the units that move through the pipeline:
the micro-batches of one slot run at once on disjoint groups of every
stage and travel from stage to stage together (Megatron-LM's DP replicas
run the same schedule in lockstep too; a slot's op lasts as long as its
slowest micro-batch). With ``pp = 1`` there is one stage and this is the
plain accumulation order.

**Model chunks.** ``pp · vp`` chunks of layers in pipeline order; chunk ``c``
runs on stage ``c mod pp``.

**Schedules** (:func:`build_schedule` picks by the plan and the mesh):

* ``1f1b`` (Narayanan et al., PipeDream-Flush / Megatron-LM, ``vp = 1``):
  stage ``s`` runs ``pp − s − 1`` warm-up forwards, then one forward and one
  backward in turn, then the remaining backwards (:func:`one_f_one_b`);
* ``interleaved`` (Megatron-LM's interleaved 1F1B, ``vp > 1``): forwards
  in groups of ``pp`` units, model chunk by model chunk; backwards the same
  with the chunks reversed; ``(pp − s − 1)·2 + (vp − 1)·pp`` warm-up ops
  (:func:`interleaved`); like Megatron-LM it needs the units to be a
  multiple of ``pp``;
* ``chunkflow`` (ChunkFlow, Yuan et al. 2025, Algorithm "state-aware
  chunk scheduling", embedded in 1F1B): units in data order; a document cut
  into ``N`` chunks runs its chunks' backwards in reverse order once its last
  chunk's forward is done (each chunk's backward adds the gradients of the
  earlier chunks' KV it read), and only its last ``K`` chunks keep their
  activations — the forward of the earlier ones runs again right before
  their backward (``recompute``). The survey's summary of the algorithm
  runs that phase in ascending chunk order; gradients flow from later
  chunks to earlier ones, so a chunk's backward must follow every later
  chunk's, and this order is descending.

The same generalized rule lays out ``1f1b`` and ``chunkflow`` on a stage: a
forward while fewer than ``warm-up + 1`` units are in flight or while the next
backward's unit has not yet run forward here, else that backward. With the
backward order equal to the forward order it is exactly 1F1B.

:func:`verify_schedule` checks a schedule against its plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import StepError, VerifyError
from .ir import StepPlan

F, B = 0, 1
KINDS = ("1f1b", "interleaved", "chunkflow")


@dataclass(frozen=True, slots=True, eq=False)
class Schedule:
    """Per stage (CSR ``op_ptr``) the ops in the order it runs them: unit, model chunk, kind (F or B).
    ``recompute[u]``: unit ``u``'s backward runs its forward again first (ChunkFlow's dropped chunks).
    ``bwd_order``: the units in the order their backwards run (every stage the same)."""

    kind: str
    stages: int
    vp: int
    units: int
    op_ptr: np.ndarray
    op_unit: np.ndarray
    op_chunk: np.ndarray
    op_kind: np.ndarray
    recompute: np.ndarray
    bwd_order: np.ndarray

    @property
    def chunks(self) -> int:
        return self.stages * self.vp

    def stage_ops(self, s: int) -> range:
        return range(int(self.op_ptr[s]), int(self.op_ptr[s + 1]))

    def to_text(self, limit: int = 48, stage_devices: int = 0) -> str:
        """One line per stage: its ops as ``F3``/``B3`` (unit), ``.c`` the model chunk when ``vp > 1``,
        ``R`` a backward that recomputes its forward first; with ``stage_devices`` each stage's global ranks."""
        def ranks(s: int) -> str:
            n = stage_devices
            return f" (ranks {s * n}..{s * n + n - 1})" if n > 1 else (f" (rank {s})" if n == 1 else "")
        lines = [f"schedule {self.kind}: {self.stages} stages x {self.vp} model chunks, {self.units} units (a unit "
                 f"is a slot: its micro-batches go through the stages together; F forward, B backward, R a "
                 f"backward that first runs the forward again: the chunk dropped its activations)"]
        for s in range(self.stages):
            ops = []
            for i in self.stage_ops(s):
                u, k = int(self.op_unit[i]), int(self.op_kind[i])
                tag = "F" if k == F else ("R" if self.recompute[u] else "B")
                ops.append(f"{tag}{u}" + (f".{int(self.op_chunk[i]) // self.stages}" if self.vp > 1 else ""))
            more = f" ... ({len(ops)} ops)" if len(ops) > limit else ""
            lines.append(f"  stage {s}{ranks(s)}: " + " ".join(ops[:limit]) + more)
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------- units

def slot_members(plan: StepPlan) -> list[np.ndarray]:
    """The micro-batches of every slot (unit), in micro-batch order."""
    order = np.lexsort((np.arange(plan.n_mb), plan.mb_slot))
    return np.split(order, np.searchsorted(plan.mb_slot[order], np.arange(1, plan.n_slots())))


def chains(plan: StepPlan) -> list[np.ndarray]:
    """For every document cut into chunks, the units of its chunks in document order."""
    count = np.bincount(plan.frag_doc, minlength=plan.problem.docs)
    out = []
    for d in np.flatnonzero(count > 1).tolist():
        f = np.flatnonzero(plan.frag_doc == d)
        f = f[np.argsort(plan.frag_start[f], kind="stable")]
        out.append(plan.mb_slot[plan.frag_mb[f]])
    return out


def backward_order(units: int, chain_units: list[np.ndarray]) -> np.ndarray:
    """The units in backward order: unit ``u`` may run its backward once every unit holding a later chunk
    of a document it holds has (its *successors*), and it is ready once the forward of its last successor
    is done; by readiness, later units first among equals. Without chains: ``0 .. units-1``."""
    ready = np.arange(units, dtype=np.int64)
    succ: list[list[int]] = [[] for _ in range(units)]
    for c in chain_units:
        for a, b in zip(c[:-1].tolist(), c[1:].tolist()):
            succ[a].append(b)
    for u in range(units - 1, -1, -1):  # successors are later units: one pass from the end closes readiness
        for v in succ[u]:
            ready[u] = max(ready[u], ready[v])
    return np.lexsort((-np.arange(units), ready)).astype(np.int64)


def recomputed_units(plan: StepPlan) -> np.ndarray:
    """Units whose backward recomputes their forward: ChunkFlow keeps the activations of a document's last
    ``chunk_keep`` chunks only."""
    out = np.zeros(plan.n_slots(), bool)
    if plan.chunk_keep < 1:
        return out
    for c in chains(plan):
        out[c[:max(0, len(c) - plan.chunk_keep)]] = True
    return out


# ---------------------------------------------------------------------------------------- orders

def one_f_one_b(units: int, stages: int, bwd: np.ndarray) -> list[list[tuple[int, int]]]:
    """Per stage, (unit, kind) in order: the generalized 1F1B rule of the module doc."""
    out = []
    for s in range(stages):
        warm = stages - s - 1
        ops: list[tuple[int, int]] = []
        f = b = 0
        while b < units:
            if f < units and (f < b + warm + 1 or int(bwd[b]) >= f):
                ops.append((f, F))
                f += 1
            else:
                ops.append((int(bwd[b]), B))
                b += 1
        out.append(ops)
    return out


def interleaved(units: int, stages: int, vp: int) -> list[list[tuple[int, int, int]]]:
    """Per stage, (unit, model chunk, kind) in Megatron-LM's interleaved 1F1B order (module doc)."""
    def sequence(backward: bool) -> list[tuple[int, int]]:
        seq = []
        for g in range(0, units, stages):
            for v in range(vp):
                for u in range(g, min(units, g + stages)):
                    seq.append((u, vp - 1 - v if backward else v))
        return seq
    fwd, bwd = sequence(False), sequence(True)
    total = len(fwd)
    out = []
    for s in range(stages):
        warm = min((stages - s - 1) * 2 + (vp - 1) * stages, total)
        ops = [(u, v * stages + s, F) for u, v in fwd[:warm]]
        for i in range(total - warm):
            u, v = fwd[warm + i]
            ops.append((u, v * stages + s, F))
            u, v = bwd[i]
            ops.append((u, v * stages + s, B))
        ops += [(u, v * stages + s, B) for u, v in bwd[total - warm:]]
        out.append(ops)
    return out


def build_schedule(plan: StepPlan) -> Schedule:
    """The schedule of ``plan`` on its mesh (module doc); StepError for a combination that has none."""
    mesh = plan.problem.mesh
    P, V, n = mesh.pp, mesh.vp, plan.n_slots()
    if plan.chunk_keep >= 1 and V > 1:
        raise StepError(f"chunked documents (ChunkFlow) run on a 1F1B pipeline; the mesh has vp={V}: use vp=1")
    if V > 1:
        if n % P:
            raise StepError(f"the interleaved schedule (vp={V}) needs a multiple of pp={P} micro-batch slots per "
                            f"step (as Megatron-LM requires); {plan.system} planned {n}: use vp=1 or more "
                            f"micro-batches")
        rows = [op for stage in interleaved(n, P, V) for op in stage]
        ptr = np.arange(P + 1, dtype=np.int64) * (2 * n * V)
        bwd = np.arange(n, dtype=np.int64)
        kind = "interleaved"
    else:
        bwd = backward_order(n, chains(plan))
        per = one_f_one_b(n, P, bwd)
        rows = [(u, s, k) for s, stage in enumerate(per) for u, k in stage]
        ptr = np.arange(P + 1, dtype=np.int64) * (2 * n)
        kind = "chunkflow" if plan.chunk_keep >= 1 else "1f1b"
    a = np.array(rows, np.int64).reshape(-1, 3)
    return Schedule(kind, P, V, n, ptr, a[:, 0], a[:, 1], a[:, 2], recomputed_units(plan), bwd)


# ---------------------------------------------------------------------------------------- verifier

def verify_schedule(plan: StepPlan, sch: Schedule) -> None:
    """Every stage runs the forward and the backward of every unit on each of its model chunks exactly
    once, the backward after the forward (so every activation sent to the next stage has a receiver and
    every gradient sent back one: stages hold consecutive chunks); a document's chunks run their backwards
    in reverse order on every stage, so the KV a chunk carries lives until its last reader (the later
    chunks' forwards and backwards all come before its own backward); the ops can all run (no stage waits
    on a stage that waits on it: :func:`attnplan.step.pipesim.timeline` is run by the simulator)."""
    P, C, n = sch.stages, sch.chunks, sch.units
    if sch.units != plan.n_slots() or sch.stages != plan.problem.mesh.pp:
        raise VerifyError(f"schedule of {plan.system}: {sch.units} units on {sch.stages} stages, the plan has "
                          f"{plan.n_slots()} slots on pp={plan.problem.mesh.pp}")
    for s in range(P):
        r = sch.stage_ops(s)
        u, c, k = sch.op_unit[r.start:r.stop], sch.op_chunk[r.start:r.stop], sch.op_kind[r.start:r.stop]
        if len(u) and ((c % P != s).any() or (c < 0).any() or (c >= C).any() or (u < 0).any() or (u >= n).any()):
            raise VerifyError(f"schedule of {plan.system}: stage {s} runs an op of a unit or model chunk that "
                              f"is not its own")
        for kind, name in ((F, "forward"), (B, "backward")):
            key = u[k == kind] * C + c[k == kind]
            want = np.sort((np.arange(n)[:, None] * C + np.arange(s, C, P)[None, :]).ravel())
            if not np.array_equal(np.sort(key), want):
                raise VerifyError(f"schedule of {plan.system}: stage {s} does not run the {name} of every unit on "
                                  f"each of its model chunks exactly once")
        first = {}
        for i, (uu, cc, kk) in enumerate(zip(u.tolist(), c.tolist(), k.tolist())):
            if kk == F:
                first[(uu, cc)] = i
            elif (uu, cc) not in first:
                raise VerifyError(f"schedule of {plan.system}: stage {s} runs the backward of unit {uu} before "
                                  f"its forward")
        bpos = np.full(n, -1, np.int64)
        bu = u[k == B]
        bpos[bu[c[k == B] == s]] = np.flatnonzero(c[k == B] == s)
        for chain in chains(plan):
            if (np.diff(bpos[chain]) >= 0).any():
                raise VerifyError(f"schedule of {plan.system}: stage {s} runs the backwards of a document's "
                                  f"chunks (units {chain.tolist()[:8]}) out of reverse order: a chunk's KV "
                                  f"gradients come from every later chunk")


# ---------------------------------------------------------------------------------------- alignment

def align_slots(plan: StepPlan) -> StepPlan:
    """``plan`` with as many slots as the interleaved schedule needs (a multiple of ``pp``; Megatron-LM's
    dynamic-CP loader, ``align_sample_id_groups``, splits tail micro-batches the same way): while the
    count is off, the slot of most tokens among those holding a micro-batch of two or more fragments is
    cut in two — each such micro-batch's fragments split where their tokens are closest to half, the
    second halves in a new slot right after — and its ``info`` says so. Unchanged with ``vp = 1``;
    StepError when no slot can be cut."""
    mesh = plan.problem.mesh
    if mesh.vp == 1 or plan.n_slots() % mesh.pp == 0:
        return plan
    import dataclasses
    frag = np.stack([plan.frag_doc, plan.frag_start, plan.frag_end, plan.frag_mb], 1)
    mb_slot, mb_group, strat = plan.mb_slot.copy(), plan.mb_group.copy(), list(plan.mb_strategy)
    cuts = 0
    while (int(mb_slot.max()) + 1) % mesh.pp:
        counts = np.bincount(frag[:, 3], minlength=len(mb_slot))
        tokens = np.bincount(mb_slot[frag[:, 3]], weights=frag[:, 2] - frag[:, 1], minlength=int(mb_slot.max()) + 1)
        ok = np.unique(mb_slot[counts >= 2])
        if not len(ok):
            raise StepError(f"the interleaved schedule (vp={mesh.vp}) needs a multiple of pp={mesh.pp} micro-batch "
                            f"slots per step (as Megatron-LM requires); {plan.system} planned "
                            f"{plan.n_slots()} and no micro-batch has two documents to split: use vp=1")
        t = int(ok[np.argmax(tokens[ok])])
        mb_slot[mb_slot > t] += 1
        rows = []
        for m in np.flatnonzero((mb_slot == t) & (counts >= 2)).tolist():
            mine = np.flatnonzero(frag[:, 3] == m)
            run = np.cumsum(frag[mine, 2] - frag[mine, 1])
            k = int(np.clip(np.argmin(np.abs(run - run[-1] / 2)) + 1, 1, len(mine) - 1))
            new = len(mb_slot)
            mb_slot = np.append(mb_slot, t + 1)
            mb_group = np.append(mb_group, mb_group[m])
            strat.append(strat[m])
            frag[mine[k:], 3] = new
            rows.append(new)
        cuts += len(rows)
    order = np.argsort(frag[:, 3], kind="stable")
    frag = frag[order]
    info = tuple(plan.info) + (("aligned", f"{cuts} micro-batch(es) split so the {mesh.pp}-stage interleaved "
                                           f"schedule gets a multiple of {mesh.pp} slots"),)
    return dataclasses.replace(plan, frag_doc=frag[:, 0], frag_start=frag[:, 1], frag_end=frag[:, 2],
                               frag_mb=frag[:, 3], mb_slot=mb_slot, mb_group=mb_group, mb_strategy=tuple(strat),
                               info=info)
