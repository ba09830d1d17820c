"""Whole-step simulation on a pipeline (``pp > 1``, or chunks carrying KV):
the step plan's slots run through the stages by their schedule
(:mod:`attnplan.step.pipeline`).

**An op** — unit ``u`` (a slot) on model chunk ``c`` of ``L_c`` layers —
lasts as long as the slowest micro-batch of the slot: forward
``L_c · F_m`` (+ the output layer's forward on the last chunk), backward
``L_c · B_m`` (+ the output layer's backward on the last chunk), with the
per-layer ``F_m``/``B_m`` of :func:`attnplan.step.simulate.mb_timing` (linear
work shifted by the attention plan's simulated finish times; full recompute
in ``B_m``). A chunk that reads earlier KV (ChunkFlow) gathers that KV over
its group first, a ring all-gather per layer forward and a reduce-scatter of
its gradient per layer backward; a chunk whose activations were dropped
runs its forward again before its backward (``L_c · F_m``).

**Between stages** an op's output goes to the next model chunk's stage as
one message per device, ``α + tokens · hidden · 2 B / bandwidth`` over the
link between the two stages' devices (inter-node when any pair of them sits
on different nodes), for the activations forward and their gradients
backward. An op starts when its stage is free and its input has arrived:
the previous chunk's forward (forward), the next chunk's backward, or its
own forward on the last chunk (backward).

**Micro-batches of one unit** (a slot) on disjoint ranks run independently:
every stage-local rank has its own clock, so data-parallel replicas with
their own groups do not wait for each other's micro-batches.

**Bubble ratio**, as the pipeline papers state it: the share of its compute
span a device idles, over every *column* (one stage-local rank on each
stage; span from the column's first op to its last) —
``(p − 1) / (m + p − 1)`` for ``m`` equal micro-batches under 1F1B.
Load imbalance between columns is the DP imbalance, not counted here.

**Gradient reduction**: every stage reduces its own parameters over its
``dp · cp`` devices, overlapped with its last backward as in
:func:`attnplan.step.simulate.grad_reduce`; the step ends with the last stage
to finish. **Lower bound**: the step's FLOPs over all ``dp · cp · pp``
devices. **Memory** per device: its stage's model states
(:func:`model.stage_static_bytes`), the reserve, and the activations the
schedule keeps in flight — walked op by op: a forward adds what its unit
keeps for the backward on this chunk (the layers' checkpoints, or every
activation without recompute; nothing for a dropped chunk; plus, for a chunk
of a cut document, its K, V and their gradients until its own backward), a
backward frees it; the transient of the op running (one layer's full set
and the attention buffers, the logits on the last chunk, a dropped chunk's
recomputed activations) is added on top.
"""

from __future__ import annotations

import numpy as np

from ..errors import StepError
from .ir import StepPlan
from .lower import Lowered
from .model import (ACT_BYTES, GRAD_BYTES, LINEAR_BWD_FACTOR, checkpoint_bytes, kv_bytes, layer_activation_bytes,
                    layer_params, logits_bytes, stage_static_bytes)
from .pipeline import B, F, Schedule, build_schedule, slot_members
from .simulate import grad_reduce, rates, ring_seconds, step_flops_s


def mb_parts(plan: StepPlan, lowered: list[Lowered]) -> list[dict]:
    """Per micro-batch, one layer's forward and backward seconds (scalars: its group moves in lockstep),
    the output layer's forward seconds, per-device busy seconds of one layer and of the output layer, and
    the per-layer KV gather seconds of a chunk reading earlier KV."""
    p = plan.problem
    r = rates(p)
    rec = p.mesh.recompute == "full"
    out = []
    for m, low in enumerate(lowered):
        lin = low.tokens * r["lin"]
        f = float(np.max(lin + low.fwd_finish))
        b = float(np.max(LINEAR_BWD_FACTOR * lin + low.bwd_finish)) + (f if rec else 0.0)
        busy = lin + low.fwd_busy + LINEAR_BWD_FACTOR * lin + low.bwd_busy + ((lin + low.fwd_busy) if rec else 0.0)
        prefix, ranks = plan.mb_prefix(m), plan.mb_ranks(m)
        gather = 0.0
        if prefix:
            spans = len(np.unique(p.mesh.node_of(ranks))) > 1
            gather = ring_seconds(prefix * kv_bytes(p.model), len(ranks), spans, p.profile)
        out.append({"f": f + gather, "b": b + gather, "f_plain": f + gather,
                    "head_f": float((low.tokens * r["head"]).max()), "busy": busy,
                    "head_busy": low.tokens * r["head"] * (1.0 + LINEAR_BWD_FACTOR),
                    "refwd_busy": lin + low.fwd_busy, "tokens": low.tokens, "ranks": ranks})
    return out


def link(plan: StepPlan, a: int, b: int) -> tuple[float, float]:
    """(bandwidth, latency) between stage ``a``'s and stage ``b``'s devices (same local rank)."""
    mesh, prof = plan.problem.mesh, plan.problem.profile
    n = mesh.stage_devices
    local = np.arange(n)
    inter = bool((mesh.node_of(local + a * n) != mesh.node_of(local + b * n)).any())
    return (prof.inter_bw, prof.inter_alpha) if inter else (prof.intra_bw, prof.intra_alpha)


def op_durations(plan: StepPlan, sch: Schedule, parts: list[dict]):
    """``[micro-batches, chunks]`` forward and backward seconds and the send seconds after each
    (activations forward, gradients backward) — see the module doc."""
    p = plan.problem
    C, P = sch.chunks, sch.stages
    layers = p.mesh.chunk_layers(p.model.layers)
    unit = plan.mb_slot
    shape = (plan.n_mb, C)
    fd, bd, fs, bs = np.zeros(shape), np.zeros(shape), np.zeros(shape), np.zeros(shape)
    links = {(a, b): link(plan, a, b) for a in range(P) for b in range(P)}
    for m, pr in enumerate(parts):
        msg = int(pr["tokens"].max()) * p.model.hidden * ACT_BYTES
        for c in range(C):
            last = c == C - 1
            fd[m, c] = layers[c] * pr["f"] + (pr["head_f"] if last else 0.0)
            bd[m, c] = (layers[c] * pr["b"] + (LINEAR_BWD_FACTOR * pr["head_f"] if last else 0.0)
                        + (layers[c] * pr["f_plain"] if sch.recompute[unit[m]] else 0.0))
            if P > 1 and c + 1 < C:
                bw, alpha = links[(c % P, (c + 1) % P)]
                fs[m, c] = alpha + msg / bw
            if P > 1 and c > 0:
                bw, alpha = links[(c % P, (c - 1) % P)]
                bs[m, c] = alpha + msg / bw
    return fd, bd, fs, bs


def timeline(sch: Schedule, members: list[np.ndarray], ranks: list[np.ndarray], n: int, fd: np.ndarray,
             bd: np.ndarray, fs: np.ndarray, bs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start and end ``[micro-batch, chunk, kind]`` of every op: the stages run their ops in schedule order,
    each micro-batch of a unit on its own ranks (``ranks[m]``, stage-local, ``n`` a stage), as early as
    those ranks and its input allow (module doc): a unit's micro-batches on disjoint ranks do not wait for
    each other. StepError if the ops cannot all run (a stage waits on a stage waiting on it)."""
    C = sch.chunks
    n_mb = len(fd)
    start = np.full((n_mb, C, 2), np.nan)
    end = np.full((n_mb, C, 2), np.nan)
    ptr = sch.op_ptr[:-1].copy()
    clock = np.zeros((sch.stages, n))
    left = len(sch.op_unit)
    while left:
        moved = False
        for s in range(sch.stages):
            while ptr[s] < sch.op_ptr[s + 1]:
                i = int(ptr[s])
                u, c, k = int(sch.op_unit[i]), int(sch.op_chunk[i]), int(sch.op_kind[i])
                mbs = members[u]
                if k == F:
                    ready = np.zeros(len(mbs)) if c == 0 else end[mbs, c - 1, F] + fs[mbs, c - 1]
                else:
                    ready = end[mbs, c, F] if c == C - 1 else end[mbs, c + 1, B] + bs[mbs, c + 1]
                if np.isnan(ready).any():
                    break
                for m, r0 in zip(mbs.tolist(), ready.tolist()):
                    r = ranks[m]
                    t0 = max(float(clock[s, r].max()), r0)
                    start[m, c, k] = t0
                    end[m, c, k] = clock[s, r] = t0 + (fd[m, c] if k == F else bd[m, c])
                ptr[s] += 1
                left -= 1
                moved = True
        if not moved:
            s = int(np.argmax(ptr < sch.op_ptr[1:]))
            i = int(ptr[s])
            raise StepError(f"the {sch.kind} schedule cannot run: stage {s} waits for the input of unit "
                            f"{int(sch.op_unit[i])} on model chunk {int(sch.op_chunk[i])}, which waits on it")
    return start, end


def bubble_ratio(sch: Schedule, ranks: list[np.ndarray], n: int, start: np.ndarray, end: np.ndarray
                 ) -> tuple[float, np.ndarray]:
    """(bubble ratio, busy seconds per stage-local rank and stage ``[stages, n]``). A *column* is one
    stage-local rank on every stage; its span runs from the first op on any of its devices to the last;
    the ratio is ``1 − busy / (stages · span)`` summed over the columns that run anything (module doc)."""
    P = sch.stages
    busy = np.zeros((P, n))
    first = np.full(n, np.inf)
    last = np.full(n, -np.inf)
    for m, r in enumerate(ranks):
        for c in range(sch.chunks):
            for k in (F, B):
                busy[c % P, r] += end[m, c, k] - start[m, c, k]
            first[r] = np.minimum(first[r], np.nanmin(start[m]))
            last[r] = np.maximum(last[r], np.nanmax(end[m]))
    used = np.isfinite(first)
    span = float((last[used] - first[used]).sum()) * P
    # max(0, ·): busy is at most stages · span, equal up to rounding where nothing idles
    return (max(0.0, float(1.0 - busy[:, used].sum() / span)) if span > 0 else 0.0), busy


def stage_memory(plan: StepPlan, sch: Schedule, parts: list[dict], lowered: list[Lowered]
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Peak bytes per global rank (stage-major) and the micro-batch that set it (module doc)."""
    p = plan.problem
    mesh, model = p.mesh, p.model
    n, P, C = mesh.stage_devices, sch.stages, sch.chunks
    layers = mesh.chunk_layers(model.layers)
    keep_tok = checkpoint_bytes(model) if mesh.recompute == "full" else layer_activation_bytes(model)
    full_tok = layer_activation_bytes(model)
    cut = np.bincount(plan.frag_doc, minlength=p.docs) > 1
    ptr = plan.mb_ptr()
    carries = [bool(cut[plan.frag_doc[ptr[m]:ptr[m + 1]]].any()) for m in range(plan.n_mb)]
    units = slot_members(plan)
    peak = np.zeros(n * P, np.int64)
    which = np.full(n * P, -1, np.int64)
    for s in range(P):
        on = [c for c in range(C) if c % P == s]
        static = stage_static_bytes(model, sum(layers[c] for c in on), s == 0, (C - 1) % P == s, n) + mesh.reserve
        kept = np.zeros(n)
        top = np.zeros(n)
        top_mb = np.full(n, -1, np.int64)
        for i in sch.stage_ops(s):
            u, c, k = int(sch.op_unit[i]), int(sch.op_chunk[i]), int(sch.op_kind[i])
            last = c == C - 1
            for m in units[u].tolist():
                ranks, tok = parts[m]["ranks"], parts[m]["tokens"].astype(np.float64)
                held = tok * layers[c] * ((0 if sch.recompute[u] else keep_tok) + (2 * kv_bytes(model)
                                                                                   if carries[m] else 0))
                if mesh.recompute != "full" and not sch.recompute[u]:  # the KV its attention keeps for its
                    #                                                      backward (Problem.keep_kv)
                    held = held + layers[c] * lowered[m].kept.astype(np.float64)
                trans = np.maximum(tok * logits_bytes(model) if last else 0.0,
                                   tok * full_tok + lowered[m].buffers if mesh.recompute == "full"
                                   else lowered[m].buffers.astype(np.float64))
                if k == B and sch.recompute[u]:
                    trans = trans + tok * layers[c] * keep_tok
                if k == F:
                    kept[ranks] += held
                now = kept[ranks] + trans
                better = now > top[ranks]
                top[ranks[better]] = now[better]
                top_mb[ranks[better]] = m
                if k == B:
                    kept[ranks] -= held
        peak[s * n:(s + 1) * n] = top.astype(np.int64) + static
        which[s * n:(s + 1) * n] = top_mb
    return peak, which


def stage_grad_end(plan: StepPlan, sch: Schedule, done: float, s: int, layers_s: int, last_b: float
                   ) -> tuple[float, float]:
    """(end, total seconds) of stage ``s``'s overlapped gradient reduction
    (:func:`attnplan.step.simulate.grad_reduce` with the stage's own buckets: the output layer's first on
    the last stage, the embedding's last on the first), its compute done at ``done``, its last backward
    op ``last_b`` seconds long."""
    p = plan.problem
    mesh, model, prof = p.mesh, p.model, p.profile
    n = mesh.stage_devices
    spans = mesh.nodes > 1 and n > mesh.devices_per_node
    bucket = ring_seconds(layer_params(model) * GRAD_BYTES, n, spans, prof)
    holds_last = (sch.chunks - 1) % sch.stages == s
    first = ring_seconds(model.vocab * model.hidden * GRAD_BYTES, n, spans, prof) if holds_last else 0.0
    rest = ring_seconds(model.vocab * model.hidden * GRAD_BYTES, n, spans, prof) if s == 0 else 0.0
    per_layer = last_b / max(layers_s, 1)
    return (grad_reduce(np.array([done]), np.array([per_layer]), layers_s, first, bucket, rest),
            first + layers_s * bucket + rest)


def dp_imbalance(busy: np.ndarray, n: int) -> float:
    """The largest over stages of (busiest device / mean device) among the stage's ``n`` data- and
    context-parallel devices: how unevenly the replicas share the work, not how the layers split."""
    per = busy.reshape(-1, n)
    mean = per.mean(1)
    ok = mean > 0
    return float((per[ok].max(1) / mean[ok]).max()) if ok.any() else 1.0


def simulate_pipeline(plan: StepPlan, lowered: list[Lowered], sch: Schedule | None = None) -> dict:
    """The step's report on its pipeline (module doc): the keys of
    :func:`attnplan.step.simulate.simulate_step` (per-rank lists over all ``dp · cp · pp`` ranks,
    stage-major) plus ``bubble_ratio`` and ``pipeline`` (schedule, stages, per-stage busy and end)."""
    p = plan.problem
    mesh, model = p.mesh, p.model
    sch = sch or build_schedule(plan)
    parts = mb_parts(plan, lowered)
    n, P, C = mesh.stage_devices, sch.stages, sch.chunks
    units = slot_members(plan)
    ranks = [pr["ranks"] for pr in parts]
    fd, bd, fs, bs = op_durations(plan, sch, parts)
    start, end = timeline(sch, units, ranks, n, fd, bd, fs, bs)
    ratio, _ = bubble_ratio(sch, ranks, n, start, end)
    layers = mesh.chunk_layers(model.layers)
    busy = np.zeros(n * P)
    for u, mbs in enumerate(units):
        for m in mbs.tolist():
            pr = parts[m]
            for c in range(C):
                s = c % P
                extra = pr["refwd_busy"] * layers[c] if sch.recompute[u] else 0.0
                busy[s * n + pr["ranks"]] += pr["busy"] * layers[c] + extra + (pr["head_busy"] if c == C - 1 else 0)
    grad_end = []
    for s in range(P):
        on = [c for c in range(C) if c % P == s]
        done = np.nanmax(end[:, on, :]) if plan.n_mb else 0.0
        last_b = max(float(bd[m, c]) for m in range(plan.n_mb) for c in on
                     if end[m, c, B] == np.nanmax(end[:, on, B]))
        grad_end.append(stage_grad_end(plan, sch, float(done), s, sum(layers[c] for c in on), last_b))
    step = float(max(g for g, _ in grad_end))
    compute_end = float(np.nanmax(end))
    lower = step_flops_s(plan) / (n * P)
    peak, peak_mb = stage_memory(plan, sch, parts, lowered)
    mb_start = start[:, 0, F]
    mb_end = end[:, 0, B]
    stage_busy = [float(np.nansum(end[:, [c for c in range(C) if c % P == s]] - start[:, [c for c in range(C)
                                                                                          if c % P == s]]))
                  for s in range(P)]
    return {
        "system": plan.system, "devices": n * P, "micro_batches": plan.n_mb, "max_slots": plan.n_slots(),
        "tokens": int(plan.frag_len.sum()), "tokens_queued": int(p.seqlens[plan.queue_out].sum()),
        "step_s": step, "compute_end_s": compute_end, "exposed_grad_s": step - compute_end,
        "grad_reduce_s": float(max(t for _, t in grad_end)), "lower_bound_s": lower,
        "step_over_lower_bound": step / lower if lower > 0 else 1.0,
        "dp_imbalance": dp_imbalance(busy, n),
        "bubble_ratio": ratio,
        "peak_memory_bytes": int(peak.max()), "memory_cap_bytes": int(p.cap),
        "per_rank": {"busy_s": busy.tolist(), "peak_memory_bytes": peak.tolist(),
                     "peak_micro_batch": peak_mb.tolist()},
        "per_mb": {"start_s": mb_start.tolist(), "end_s": mb_end.tolist(),
                   "tokens": plan.mb_tokens().tolist(), "devices": [len(plan.mb_ranks(m)) for m in range(plan.n_mb)],
                   "strategy": list(plan.mb_strategy), "slot": plan.mb_slot.tolist()},
        "pipeline": {"schedule": sch.kind, "stages": P, "vp": sch.vp, "units": sch.units,
                     "chunk_layers": list(layers), "stage_busy_s": stage_busy,
                     "stage_grad_end_s": [g for g, _ in grad_end], "recomputed_units": int(sch.recompute.sum()),
                     "ops": {"unit": sch.op_unit.tolist(), "chunk": sch.op_chunk.tolist(),
                             "kind": sch.op_kind.tolist(), "stage_ptr": sch.op_ptr.tolist()},
                     "mb_start_s": start.tolist(), "mb_end_s": end.tolist()},
        "info": plan.info_dict(),
        "mb_unkept": list(plan.mb_unkept),  # keep_kv: micro-batches over the cap with kept KV (step/kept.py)
    }
