"""The simulated timeline panel: the simulator's events (``cost.simulate(record=True)``)
per device — compute by stage, merges, waits, sends and receives, forward and
backward. Events closer than a time step are merged into spans; the step
doubles until at most ``max_spans`` spans remain. Spans keep their busy
seconds, event counts and bytes, so totals survive the merge. Also the
exposed communication of each stage (waits, attributed to the stage of the
compute block each wait delays; waits after a device's last compute block
belong to its *tail*: merges of incoming partials and completion of sends).
"""

from __future__ import annotations

import numpy as np

from ..errors import PlanError
from ..ir.program import M_BYTES, M_DST, M_END, M_SRC, M_START, T_KIND, T_TB
from ..ir.schedule import phase_schedule
from .cost import Profile, resolve_profile, simulate

# timeline lanes
L_COMPUTE, L_WAIT, L_SEND, L_RECV = range(4)
LANES = ("compute", "wait", "send", "recv")
SPAN_COLUMNS = ("dev", "t0", "t1", "n", "busy", "key", "a", "b", "bytes", "peer", "kind", "tb")


def plan_profile(plan, profile=None) -> Profile:
    """The profile to draw ``plan`` with: the caller's ``profile`` (a name,
    FILE.json or :class:`Profile`), else the one given to ``compile`` for a
    plan in memory (``plan.profile``), else the plan's recorded name
    (``meta.profile``), which must be builtin: a plan never names a file."""
    if profile is None:
        profile = getattr(plan, "profile", None)
    return resolve_profile(profile, plan.meta.get("profile"))


def _merge_spans(cols: tuple, eps: float) -> dict:
    """Merge events of one lane (columns ``dev, t0, t1, key, ident, nbytes,
    peer, kind, tb``), per device in time order, into spans: a new span
    starts where the device or ``key`` changes or the gap to the span's
    furthest end exceeds ``eps``. Returns columns of the spans."""
    dev, t0, t1, key, ident, nbytes, peer, kind, tb = cols
    order = np.lexsort((t0, dev))
    dev, t0, t1, key, ident, nbytes, peer, kind, tb = (a[order] for a in (dev, t0, t1, key, ident, nbytes, peer,
                                                                          kind, tb))
    if not len(dev):
        z = np.zeros(0)
        return {c: z.astype(np.int64) if c not in ("t0", "t1", "busy") else z for c in SPAN_COLUMNS}
    # running furthest end per device: offset each device's times past the previous ones
    span = float(max(t1.max(), t0.max())) + 1.0 + eps
    reach = np.maximum.accumulate(t1 + dev * span)
    new = np.ones(len(dev), bool)
    new[1:] = (dev[1:] != dev[:-1]) | (key[1:] != key[:-1]) | (t0[1:] + dev[1:] * span > reach[:-1] + eps)
    st = np.flatnonzero(new)
    stop = np.concatenate([st[1:], [len(dev)]])
    pmin, pmax = np.minimum.reduceat(peer, st), np.maximum.reduceat(peer, st)
    kmin, kmax = np.minimum.reduceat(kind, st), np.maximum.reduceat(kind, st)
    return {
        "dev": dev[st], "t0": t0[st], "t1": np.maximum.reduceat(t1, st), "n": (stop - st).astype(np.int64),
        "busy": np.add.reduceat(t1 - t0, st), "key": key[st], "a": np.minimum.reduceat(ident, st),
        "b": np.maximum.reduceat(ident, st), "bytes": np.add.reduceat(nbytes, st),
        "peer": np.where(pmin == pmax, pmin, -1), "kind": np.where(kmin == kmax, kmin, -1),
        "tb": np.where(stop - st == 1, tb[st], -1),
    }


def message_blocks(prog) -> tuple[np.ndarray, np.ndarray]:
    """Per message: the kind of the blocks it carries (-1: several kinds) and
    its token block (-1: more than one block)."""
    M, X = prog.messages, prog.transfers
    if not len(M):
        z = np.zeros(0, np.int64)
        return z, z
    start, count = M[:, M_START], M[:, M_END] - M[:, M_START]
    kmin, kmax = np.minimum.reduceat(X[:, T_KIND], start), np.maximum.reduceat(X[:, T_KIND], start)
    return np.where(kmin == kmax, kmin, -1), np.where(count == 1, X[start, T_TB], -1)


def _lane_events(plan, ev: dict, stage_of_cb: np.ndarray) -> list[tuple]:
    """The events of one phase as lane columns ``(lane, dev, t0, t1, key, id, bytes, peer, kind, tb)``
    (``id``: the compute block, or the message)."""
    M = plan.ir.program.messages
    kind, tb = message_blocks(plan.ir.program)
    C, R, W = ev["compute"], ev["transfer"], ev["wait"]
    lanes = []
    cb = C[:, 3].astype(np.int64)
    stg = np.where(cb >= 0, stage_of_cb[np.maximum(cb, 0)] if len(stage_of_cb) else 0, -1)
    zc = np.zeros(len(C), np.int64)
    lanes.append((L_COMPUTE, C[:, 0].astype(np.int64), C[:, 1], C[:, 2], stg, cb, zc, zc - 1, zc - 1, zc - 1))
    wt = W[:, 3].astype(np.int64)
    wd = W[:, 0].astype(np.int64)
    wsrc, wdst = M[wt, M_SRC], M[wt, M_DST]
    zw = np.zeros(len(W), np.int64)
    lanes.append((L_WAIT, wd, W[:, 1], W[:, 2], zw, wt, M[wt, M_BYTES], np.where(wsrc == wd, wdst, wsrc),
                  kind[wt], tb[wt]))
    tt = R[:, 0].astype(np.int64)
    src, dst = R[:, 1].astype(np.int64), R[:, 2].astype(np.int64)
    zt = np.zeros(len(R), np.int64)
    for lane, d, peer in ((L_SEND, src, dst), (L_RECV, dst, src)):
        lanes.append((lane, d, R[:, 3], R[:, 4], zt, tt, M[tt, M_BYTES], peer, kind[tt], tb[tt]))
    return lanes


def _next_compute(C: np.ndarray, W: np.ndarray) -> np.ndarray:
    """For every wait, the row of ``C`` (compute blocks, merges excluded) that
    its device runs first at or after the wait ends, or -1 (none: the tail).
    One search over (device, time rank) keys: times are ranked together so
    the keys are exact integers."""
    real = np.flatnonzero(C[:, 3] >= 0)
    times = np.concatenate([C[real, 1], W[:, 2] - 1e-15])
    rank = np.unique(times, return_inverse=True)[1].reshape(-1).astype(np.int64)
    R = len(times) + 1
    ckey = C[real, 0].astype(np.int64) * R + rank[:len(real)]
    wkey = W[:, 0].astype(np.int64) * R + rank[len(real):]
    order = np.argsort(ckey, kind="stable")
    pos = np.searchsorted(ckey[order], wkey, "left")
    ok = pos < len(real)
    ok[ok] = ckey[order][pos[ok]] // R == wkey[ok] // R  # the same device
    out = np.full(len(W), -1, np.int64)
    out[ok] = real[order][pos[ok]]
    return out


def exposed_by_stage(plan, ev: dict, stage_of_cb: np.ndarray) -> dict:
    """Exposed communication of one phase: each wait is charged to the stage
    of the next compute block on its device (-1: the tail, after the last
    one). Returns ``{stage: {"total_s", "max_s", "device", "per_device"}}``:
    the sum over devices, the largest device's waits and which device that
    is, and every device's waits."""
    n = plan.ir.devices
    C, W = ev["compute"], ev["wait"]
    nxt = _next_compute(C, W)
    stage = np.full(len(W), -1, np.int64)
    stage[nxt >= 0] = stage_of_cb[C[nxt[nxt >= 0], 3].astype(np.int64)]
    out = {}
    dur = W[:, 2] - W[:, 1]
    for s in np.unique(stage).tolist():
        sel = stage == s
        per_dev = np.bincount(W[sel, 0].astype(np.int64), weights=dur[sel], minlength=n)
        out[int(s)] = {"total_s": float(per_dev.sum()), "max_s": float(per_dev.max()),
                       "device": int(per_dev.argmax()), "per_device": per_dev}
    return out


def _merged_spans(lanes: list[tuple], makespan: float, columns: int, max_spans: int) -> tuple[dict, float]:
    """Spans of every lane with the smallest merge step ``makespan / columns · 2^i``
    that leaves at most ``max_spans`` of them (or exceeds twice the makespan)."""
    eps = makespan / columns
    while True:
        merged = [(lane, _merge_spans(tuple(cols), eps)) for lane, *cols in lanes]
        total = sum(len(m["dev"]) for _, m in merged)
        if total <= max_spans or eps > 2 * makespan:
            break
        eps *= 2
    spans = {c: np.concatenate([m[c] for _, m in merged]) for c in merged[0][1]}
    spans["lane"] = np.concatenate([np.full(len(m["dev"]), lane, np.int64) for lane, m in merged])
    return spans, eps


def _phase_timeline(plan, sim_phase: dict, stage_of_cb: np.ndarray, max_spans: int, columns: int) -> dict:
    n = plan.ir.devices
    ev = sim_phase["events"]
    C, W = ev["compute"], ev["wait"]
    ends = np.concatenate([C[:, 2], W[:, 2]])
    makespan = float(ends.max()) if len(ends) else 0.0
    spans, eps = _merged_spans(_lane_events(plan, ev, stage_of_cb), makespan, columns, max_spans)
    return {
        "spans": spans, "eps_s": eps, "makespan_s": makespan,
        "finish_s": np.asarray(sim_phase["finish_s"], float),
        "compute_s": np.bincount(C[:, 0].astype(np.int64), weights=C[:, 2] - C[:, 1], minlength=n),
        "wait_s": np.bincount(W[:, 0].astype(np.int64), weights=W[:, 2] - W[:, 1], minlength=n),
        "events": {k: len(v) for k, v in ev.items()},
        "exposed": exposed_by_stage(plan, ev, stage_of_cb),
    }


def timeline(plan, profile=None, max_spans: int = 20000, columns: int = 1600, sim: dict | None = None) -> dict:
    """The simulated timeline per phase (``fwd``, ``bwd``): merged ``spans``
    (columns ``lane, dev, t0, t1, n, busy, key, a, b, bytes, peer, kind, tb``;
    ``key`` is the stage of compute spans, -1 for merges/adds; ``a``/``b`` the
    first/last compute block or message), ``eps_s`` (the merge step),
    ``makespan_s``, per-device ``finish_s``, ``compute_s``, ``wait_s``, the
    ``events`` counts, ``exposed`` (see :func:`exposed_by_stage`) and
    ``stages``. ``profile``: the caller's (name, FILE.json or Profile), else
    the plan's recorded builtin name; ``sim``: a recorded simulation under it."""
    for name, v in (("max_spans", max_spans), ("columns", columns)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise PlanError(f"{name} must be a positive integer, got {v!r}")
    ir = plan.ir
    prof = plan_profile(plan, profile)
    if sim is None:
        sim = simulate(ir, prof, record=True)
    out = {"profile": prof.name, "stages": int(ir.schedule.stages)}
    for phase, name in enumerate(("fwd", "bwd")):  # the backward's own blocks may run in its last stage
        stage_of_cb = phase_schedule(ir.graph, ir.placement, ir.schedule, phase).cb_stage.astype(np.int64)
        out[name] = _phase_timeline(plan, sim[name], stage_of_cb, max_spans, columns)
    out["predicted_s"] = sim["predicted_s"]
    return out
