"""A first cost model and an event simulator of the programs.

Compute: a compute block costs ``launch_s`` plus its FLOPs at
``peak_flops * efficiency``, with each piece's query rows rounded up to the
kernel's ``tile_q`` (a 1-row piece costs a whole 128-row tile). Backward
costs ``bwd_factor`` times forward (flash-attention's 5 matmuls vs 2).
Communication: ``alpha + bytes / bandwidth``, intra-node or inter-node; a
sender's link carries one transfer at a time. Merges and adds stream their
bytes at ``mem_bw``.

The simulator walks the programs with the same cooperative walk as the
verifier; a transfer starts once both ends are posted (and the sender's link
is free). ``predicted_s`` = forward makespan + backward makespan.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..errors import PlanError
from ..errors import DeadlockError
from ..ir.mask import Q0, Q1, piece_counts
from ..ir.program import (ATTN, ATTN_BWD, BBYTES, BWD, FWD, PHASES, RECV, SEND, T_BYTES, T_DST, T_SRC, WAIT)


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    peak_flops: float      # dense bf16 matmul peak, FLOP/s
    efficiency: float      # attention kernel's share of peak
    launch_s: float        # per compute-block launch overhead
    tile_q: int            # kernel query tile (rows are rounded up to it)
    intra_bw: float        # bytes/s per direction, same node
    inter_bw: float        # bytes/s per direction, across nodes
    intra_alpha: float     # latency per transfer, same node
    inter_alpha: float
    mem_bw: float          # bytes/s for merges
    bwd_factor: float = 2.5

    @property
    def flops(self) -> float:
        return self.peak_flops * self.efficiency


PROFILES = {
    # H100 SXM: 989 TFLOP/s dense bf16; NVLink 4 450 GB/s per direction; 400 Gb/s IB per GPU.
    "h100": Profile("h100", 989e12, 0.6, 5e-6, 128, 370e9, 45e9, 10e-6, 20e-6, 3.0e12),
    # H200: H100 compute, 4.8 TB/s HBM3e.
    "h200": Profile("h200", 989e12, 0.6, 5e-6, 128, 370e9, 45e9, 10e-6, 20e-6, 4.8e12),
    # A100 SXM: 312 TFLOP/s; NVLink 3 300 GB/s per direction; 200 Gb/s IB per GPU.
    "a100": Profile("a100", 312e12, 0.6, 5e-6, 128, 240e9, 22e9, 10e-6, 20e-6, 1.8e12),
    # this 2-core CPU: the CPU flash op reaches 270-670 GFLOP/s bf16; gloo on loopback 1-3 GB/s.
    "cpu-local": Profile("cpu-local", 4e11, 1.0, 50e-6, 1, 2e9, 2e9, 50e-6, 50e-6, 5e9),
}


# share of the bf16 kernel rate reached by other dtypes (fp32 runs as TF32 on GPUs)
DTYPE_EFFICIENCY = {"bfloat16": 1.0, "float16": 1.0, "float32": 0.5}


def get_profile(name: str) -> Profile:
    """A shipped profile by name, or a JSON file written by ``plan calibrate``."""
    if name in PROFILES:
        return PROFILES[name]
    if name.endswith(".json"):
        import json
        from dataclasses import fields
        try:
            with open(name) as f:
                data = json.load(f)
            return Profile(**{f.name: data[f.name] for f in fields(Profile) if f.name in data})
        except (OSError, ValueError, TypeError) as e:
            raise PlanError(f"cost profile {name}: cannot read it ({e})") from None
    raise PlanError(f"unknown cost profile {name!r}; known: {', '.join(sorted(PROFILES))} or a FILE.json "
                    f"from `plan calibrate`")


def rounded_pairs(graph, tile_q: int) -> np.ndarray:
    """Per tile: allowed pairs with each piece's query rows rounded up to the
    kernel's ``tile_q`` (the work a tiled kernel really does)."""
    P = graph.pieces
    if len(P) == 0:
        return np.zeros(graph.n_tile)
    rows = P[:, Q1] - P[:, Q0]
    rounded = piece_counts(P) * (-(-rows // tile_q) * tile_q) / rows
    return np.add.reduceat(rounded, graph.tile_ptr[:-1])


def cb_seconds(graph, prof: Profile) -> np.ndarray:
    """Forward seconds of every compute block (tile rounding, launch overhead)."""
    if graph.n_tile == 0:
        return np.zeros(graph.n_cb)
    tile = rounded_pairs(graph, prof.tile_q)
    flops = 4.0 * graph.problem.head_dim * tile[graph.cb_tile] * graph.hg_heads[graph.cb_hg]
    return prof.launch_s + flops / prof.flops


def simulate(ir, prof: Profile, record: bool = False) -> dict:
    """Event-driven simulation of every device's forward, then backward, program.

    Each device has a compute stream (its instruction stream: compute blocks,
    merges) and a send and a receive queue. Devices advance in global time
    order; a transfer is ready once both its ends are posted, takes ``alpha +
    bytes / bandwidth`` of the link it crosses (intra- or inter-node) on the
    sender's queue and on the receiver's queue, each serving its transfers in
    the order they became ready, and ends when the later of the two is done;
    a ``wait`` stalls its device until then.

    Returns per phase ``finish_s`` and ``compute_s`` per device and the
    ``makespan_s``; ``predicted_s`` is forward + backward. With ``record``,
    each phase also has ``events``: ``compute`` rows ``(device, start, end,
    cb)`` (merges/adds have cb = -1), ``transfer`` rows ``(tag, src, dst,
    start, end)`` and ``wait`` rows ``(device, start, end, tag)`` for every
    wait that left the device idle; times in seconds."""
    import heapq

    g, pl, prog = ir.graph, ir.placement, ir.program
    fwd_cost = cb_seconds(g, prof) / DTYPE_EFFICIENCY.get(g.problem.dtype, 1.0)
    n = prog.devices
    node = np.arange(n) // pl.devices_per_node
    X = prog.transfers
    src, dst, nbytes = X[:, T_SRC], X[:, T_DST], X[:, T_BYTES].astype(float)
    inter = node[src] != node[dst] if len(X) else np.zeros(0, bool)
    dur = np.where(inter, prof.inter_alpha + nbytes / prof.inter_bw, prof.intra_alpha + nbytes / prof.intra_bw)
    src_l, dst_l, dur_l = src.tolist(), dst.tolist(), dur.tolist()
    result = {}
    for phase, factor in ((FWD, 1.0), (BWD, prof.bwd_factor)):
        code = [c.tolist() for c in prog.code[phase]]
        bufbytes = [b[:, BBYTES].tolist() for b in prog.buffers[phase]]
        cost = (fwd_cost * factor).tolist()
        clock = [0.0] * n
        busy = [0.0] * n
        pc = [0] * n
        send_free = [0.0] * n
        recv_free = [0.0] * n
        posted: dict[int, float] = {}   # tag -> time of the first post
        end: dict[int, float] = {}      # tag -> completion time
        waiting: dict[int, list] = {}   # tag -> devices stalled on it
        ev_c, ev_t, ev_w = [], [], []
        heap = [(0.0, d) for d in range(n)]

        def post(t, now):
            if t not in posted:
                posted[t] = now
                return
            a, b = src_l[t], dst_l[t]
            ready = max(posted[t], now)
            # the sender's and the receiver's queues each serve their own
            # transfers in turn; a transfer ends when the busier side is done
            # (reserving both sides at the later start would leave idle gaps
            # that convoy through every link)
            send_free[a] = max(ready, send_free[a]) + dur_l[t]
            recv_free[b] = max(ready, recv_free[b]) + dur_l[t]
            end[t] = max(send_free[a], recv_free[b])
            if record:
                ev_t.append((t, a, b, end[t] - dur_l[t], end[t]))
            for w in waiting.pop(t, ()):
                if record and end[t] > clock[w]:
                    ev_w.append((w, clock[w], end[t], t))
                clock[w] = max(clock[w], end[t])
                pc[w] += 1
                heapq.heappush(heap, (clock[w], w))

        while heap:
            _, d = heapq.heappop(heap)
            c, i, now = code[d], pc[d], clock[d]
            while i < len(c):  # run until the next instruction that talks to another device
                row = c[i]
                op = row[0]
                if op in (SEND, RECV):
                    if now > clock[d] or (heap and heap[0][0] < now):
                        break  # let devices earlier in time post first
                    post(row[1], now)
                elif op == WAIT:
                    t = row[1]
                    if t not in end:
                        clock[d], pc[d] = now, i
                        waiting.setdefault(t, []).append(d)
                        break
                    if end[t] > now:
                        if record:
                            ev_w.append((d, now, end[t], t))
                        now = end[t]
                elif op in (ATTN, ATTN_BWD):
                    dt = cost[row[1]]
                    if record:
                        ev_c.append((d, now, now + dt, row[1]))
                    now += dt
                    busy[d] += dt
                else:  # MERGE / ADD stream their bytes
                    dt = bufbytes[d][row[2]] * 3 / prof.mem_bw
                    if record:
                        ev_c.append((d, now, now + dt, -1))
                    now += dt
                    busy[d] += dt
                i += 1
            else:
                clock[d], pc[d] = now, i
                continue
            if c[i][0] == WAIT and c[i][1] not in end:
                continue  # stalled: woken by the transfer's second post
            clock[d], pc[d] = now, i
            heapq.heappush(heap, (now, d))
        stalled = [d for d in range(n) if pc[d] < len(code[d])]
        if stalled:  # the verifier proves this cannot happen for emitted programs
            raise DeadlockError(f"simulation of {PHASES[phase]} stalled on devices {stalled}")
        name = PHASES[phase]
        result[name] = {"finish_s": clock, "compute_s": busy, "makespan_s": max(clock) if clock else 0.0}
        if record:
            result[name]["events"] = {
                "compute": np.asarray(ev_c, float).reshape(-1, 4),
                "transfer": np.asarray(ev_t, float).reshape(-1, 5),
                "wait": np.asarray(ev_w, float).reshape(-1, 4),
            }
    result["predicted_s"] = result["fwd"]["makespan_s"] + result["bwd"]["makespan_s"]
    result["profile"] = asdict(prof)
    return result
