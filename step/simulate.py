"""Whole-step simulation (survey §1.5: minimise max over ranks of T_r subject
to M_r ≤ M_cap): per device, every micro-batch's linear and attention work
for every layer, then the gradient reduction; and per device its peak memory.

**One micro-batch** on its group, one layer forward: device ``d`` runs its
linear work (its tokens × the model's linear FLOPs per token, at the
profile's effective rate) and then its part of the attention plan, whose
simulated per-device finish times (:func:`attnplan.backends.cost.simulate`,
all devices starting together) are shifted by that linear work; the layer
ends when the group's last device does, since the next layer's attention
needs every device. Backward likewise, with linear × 2 and the attention
plan's backward; under full recompute each layer's backward is preceded by
its forward again. The output layer (logits, forward + backward) runs once
per micro-batch. So, with ``F = max_d(lin_d + fwd_d)`` and
``B = max_d(2·lin_d + bwd_d)``: duration = layers · (F + B [+ F]) + output.
The coupling between a device's late start and its peers' waits inside one
attention call is not modelled (the attention simulation starts them together).

**The step**: every rank runs its micro-batches in slot order; a micro-batch
starts when all of its group's ranks are free (groups run in lockstep).

**Gradient reduction** over the ``dp · cp`` replicas (ZeRO-1: a reduce-scatter
of the bf16 gradients, as a ring: ``(n−1)·α + (n−1)/n · bytes / bandwidth``,
inter-node bandwidth once the group spans nodes), overlapped with the
backward as Megatron-LM's ``--overlap-grad-reduce`` does: only the last
micro-batch's backward overlaps (earlier ones accumulate locally), one
bucket per layer (Megatron's buckets hold ~40M parameters: a layer of the
models here) is reduced once every rank has finished that layer's backward,
buckets go one at a time in backward order — the untied output layer's
first, the embedding's last. The step ends when the last bucket is
reduced; the exposed part is what runs after the last rank's compute. The
parameter all-gather of the distributed optimizer overlaps the next step's
forward (``--overlap-param-gather``) and the optimizer's update (memory-bound,
under 2 ms here) is left out.

**Lower bound**: all FLOPs of the step (linear, output layer and exact
attention pairs, forward, backward and recompute) / (devices × effective peak):
perfect balance and no exposed communication, so step / bound = 1 is perfect.

**Memory** per device: the model states (:func:`model.static_bytes`), the
planner's reserve, and the largest activation of its micro-batches
(:func:`model.activation_bytes` with the attention plan's buffers).
"""

from __future__ import annotations

import numpy as np

from .ir import StepPlan
from .lower import Lowered
from .model import (GRAD_BYTES, LINEAR_BWD_FACTOR, activation_bytes, attn_flops_per_pair, head_flops, layer_params,
                    linear_flops, param_count, static_bytes)


def rates(plan_or_problem) -> dict:
    """Seconds per token (linear per layer, output layer) and per pair (attention per layer), forward."""
    p = getattr(plan_or_problem, "problem", plan_or_problem)
    rate = p.profile.flops
    return {"lin": linear_flops(p.model) / rate, "head": head_flops(p.model) / rate,
            "pair": attn_flops_per_pair(p.model) / rate}


def work_factors(problem) -> tuple[float, float]:
    """(linear, attention) passes per layer per step: forward + backward (+ the recompute forward)."""
    rec = 1.0 if problem.mesh.recompute == "full" else 0.0
    return 1.0 + LINEAR_BWD_FACTOR + rec, 1.0 + problem.profile.bwd_factor + rec


def doc_seconds(problem) -> np.ndarray:
    """Per document: its total compute seconds in one step at the effective peak (linear, output layer,
    exact attention; forward, backward, recompute) — the work the batch passes balance."""
    r = rates(problem)
    fl, fa = work_factors(problem)
    L = problem.model.layers
    return problem.seqlens * (L * fl * r["lin"] + (1.0 + LINEAR_BWD_FACTOR) * r["head"]) + problem.pairs * (
        L * fa * r["pair"])


def mb_timing(plan: StepPlan, low: Lowered) -> dict:
    """Duration, per-layer backward and per-device busy seconds of one micro-batch (see the module doc)."""
    p = plan.problem
    r = rates(p)
    L = p.model.layers
    lin = low.tokens * r["lin"]
    layer_f = float(np.max(lin + low.fwd_finish))
    layer_b = float(np.max(LINEAR_BWD_FACTOR * lin + low.bwd_finish))
    rec = p.mesh.recompute == "full"
    if rec:
        layer_b += layer_f
    head = low.tokens * r["head"] * (1.0 + LINEAR_BWD_FACTOR)
    busy_layer = lin + low.fwd_busy + LINEAR_BWD_FACTOR * lin + low.bwd_busy + (lin + low.fwd_busy if rec else 0.0)
    return {"duration": L * (layer_f + layer_b) + float(head.max()), "layer_bwd": layer_b,
            "busy": L * busy_layer + head, "attn": L * (float(low.fwd_finish.max()) * (2.0 if rec else 1.0)
                                                        + float(low.bwd_finish.max()))}


def ring_seconds(nbytes: float, n: int, spans_nodes: bool, profile) -> float:
    """A ring reduce-scatter of ``nbytes`` over ``n`` devices."""
    if n <= 1:
        return 0.0
    bw, alpha = (profile.inter_bw, profile.inter_alpha) if spans_nodes else (profile.intra_bw, profile.intra_alpha)
    return (n - 1) * alpha + (n - 1) / n * nbytes / bw


def grad_reduce(end: np.ndarray, layer_bwd: np.ndarray, layers: int, first_s: float, bucket_s: float,
                last_s: float) -> float:
    """End of the overlapped gradient reduction. Rank ``r`` finishes its compute at ``end[r]``; its last
    micro-batch's per-layer backward takes ``layer_bwd[r]`` (0 for a rank without micro-batches). Buckets,
    in backward order: the output layer's (``first_s``, ready when the layers' backward starts), one per
    layer (``bucket_s``, ready when that layer's backward is done), the embedding's (``last_s``, ready at
    the end); a bucket is reduced once every rank has it ready, one bucket at a time."""
    back = np.arange(layers, -1, -1, dtype=float)     # layers still to go when each bucket is ready
    ready = np.max(end[None, :] - back[:, None] * layer_bwd[None, :], axis=1)
    f = 0.0
    for t, cost in zip(ready.tolist(), [first_s] + [bucket_s] * layers):
        f = max(f, t) + cost
    return max(f, float(end.max())) + last_s


def memory(plan: StepPlan, lowered: list[Lowered]) -> tuple[np.ndarray, np.ndarray]:
    """Peak bytes per rank and the micro-batch that sets it (-1: none)."""
    p = plan.problem
    n = p.mesh.stage_devices
    base = static_bytes(p.model, n) + p.mesh.reserve
    peak = np.zeros(n, np.int64)
    which = np.full(n, -1, np.int64)
    for m, low in enumerate(lowered):
        ranks = plan.mb_ranks(m)
        act = activation_bytes(p.model, low.tokens, p.mesh.recompute, low.buffers, low.kept).astype(np.int64)
        better = act > peak[ranks]
        peak[ranks[better]] = act[better]
        which[ranks[better]] = m
    return peak + base, which


def step_flops_s(plan: StepPlan) -> float:
    """Seconds of all the step's FLOPs at the effective peak on one device: linear and output layer per
    token, attention per allowed pair of every computed document (a document cut into chunks counts
    once: its chunks' rows partition it), forward, backward and the mesh's recompute."""
    p = plan.problem
    r = rates(p)
    fl, fa = work_factors(p)
    tokens = int(plan.frag_len.sum())
    return (tokens * (p.model.layers * fl * r["lin"] + (1.0 + LINEAR_BWD_FACTOR) * r["head"])
            + int(p.pairs[np.unique(plan.frag_doc)].sum()) * p.model.layers * fa * r["pair"])


def simulate_step(plan: StepPlan, lowered: list[Lowered]) -> dict:
    """The step's timeline and report (see the module doc): ``step_s``, ``lower_bound_s``,
    ``step_over_lower_bound``, per-rank busy and end times, ``dp_imbalance`` (max/mean busy),
    exposed gradient reduction, peak memory per rank, the micro-batches' start and end."""
    p = plan.problem
    mesh, prof, model = p.mesh, p.profile, p.model
    n = mesh.stage_devices
    clock = np.zeros(n)
    busy = np.zeros(n)
    last_bwd = np.zeros(n)
    start = np.zeros(plan.n_mb)
    end = np.zeros(plan.n_mb)
    attn = np.zeros(plan.n_mb)
    for m in np.lexsort((np.arange(plan.n_mb), plan.mb_slot)).tolist():
        t = mb_timing(plan, lowered[m])
        ranks = plan.mb_ranks(m)
        start[m] = clock[ranks].max()
        end[m] = start[m] + t["duration"]
        clock[ranks] = end[m]
        busy[ranks] += t["busy"]
        last_bwd[ranks] = t["layer_bwd"]
        attn[m] = t["attn"]
    spans = mesh.nodes > 1 and n > mesh.devices_per_node
    bucket = ring_seconds(layer_params(model) * GRAD_BYTES, n, spans, prof)
    output = 0 if model.tied else model.vocab * model.hidden            # untied output layer: reduced first
    first = ring_seconds(output * GRAD_BYTES, n, spans, prof)
    rest = ring_seconds((param_count(model) - model.layers * layer_params(model) - output) * GRAD_BYTES, n, spans,
                        prof)
    step = grad_reduce(clock, last_bwd, model.layers, first, bucket, rest)
    tokens = int(plan.frag_len.sum())
    lower = step_flops_s(plan) / n
    peak, peak_mb = memory(plan, lowered)
    mean_busy = float(busy.mean())
    return {
        "system": plan.system,
        "devices": n,
        "micro_batches": plan.n_mb,
        "max_slots": int(max(len(o) for o in plan.rank_order())),
        "tokens": tokens,
        "tokens_queued": int(p.seqlens[plan.queue_out].sum()),
        "step_s": step,
        "compute_end_s": float(clock.max()),
        "exposed_grad_s": step - float(clock.max()),
        "grad_reduce_s": first + model.layers * bucket + rest,
        "lower_bound_s": lower,
        "step_over_lower_bound": step / lower if lower > 0 else 1.0,
        "dp_imbalance": float(busy.max() / mean_busy) if mean_busy > 0 else 1.0,
        "peak_memory_bytes": int(peak.max()),
        "memory_cap_bytes": int(p.cap),
        "per_rank": {"busy_s": busy.tolist(), "end_s": clock.tolist(), "peak_memory_bytes": peak.tolist(),
                     "peak_micro_batch": peak_mb.tolist()},
        "per_mb": {"start_s": start.tolist(), "end_s": end.tolist(), "attention_s": attn.tolist(),
                   "tokens": plan.mb_tokens().tolist(), "devices": [len(plan.mb_ranks(m)) for m in range(plan.n_mb)],
                   "strategy": list(plan.mb_strategy), "slot": plan.mb_slot.tolist()},
        "info": plan.info_dict(),
        "mb_unkept": list(plan.mb_unkept),  # keep_kv: micro-batches over the cap with kept KV (step/kept.py)
    }
