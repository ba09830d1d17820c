"""The event walk of one phase's programs, which :func:`attnplan.backends.cost.simulate`
drives (and :mod:`attnplan.backends.links` refines with fair-shared links): every
device's stream cut into steps (a send, a receive, a wait, or a run of local
instructions with their seconds summed), walked in global time order."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from ..errors import DeadlockError
from ..ir.program import A1, A2, ATTN, ATTN_BWD, OP, PHASES, RECV, SEND, WAIT


def run_starts(op: np.ndarray, dev: np.ndarray) -> np.ndarray:
    """Of a concatenation of device streams (ops, and each row's device):
    the compute instructions that begin a run of consecutive compute
    instructions of one device (one fused kernel call)."""
    attn = (op == ATTN) | (op == ATTN_BWD)
    first = attn.copy()
    if len(op):
        first[1:] &= ~attn[:-1] | (dev[1:] != dev[:-1])
    return first


def merge_seconds(nbytes, mem_bw: float):
    """Seconds of merging (or adding) a received partial output of ``nbytes``
    into its home block: memory-bound, reading both and writing one."""
    return nbytes * 3 / mem_bw


LOCAL = -1  # a step of local instructions (compute blocks, merges, adds), their seconds summed


@dataclass(slots=True, eq=False)
class Steps:
    """One phase's streams as steps: every send, receive and wait, and every
    maximal run of local instructions of a device as one step (its seconds
    summed). ``steps[d]``: device ``d``'s steps as ``(op, message or step
    index, seconds)``; for recording, the instructions behind each local step."""

    steps: list
    row_dev: np.ndarray      # local instructions (all devices, stream order): device
    row_dur: np.ndarray      # ... seconds
    row_cb: np.ndarray       # ... compute block (-1: merge / add)
    row_step: np.ndarray     # ... their local step (global index)
    step_first: np.ndarray   # local step -> its first row in the arrays above


def phase_steps(code: tuple, bufbytes: tuple, cost: np.ndarray, mem_bw: float, launch: float = 0.0) -> Steps:
    n = len(code)
    lens = np.array([len(c) for c in code], np.int64)
    C = np.concatenate(code) if n else np.zeros((0, 6), np.int64)
    dev = np.repeat(np.arange(n, dtype=np.int64), lens)
    op = C[:, OP]
    comm = (op == SEND) | (op == RECV) | (op == WAIT)
    attn = (op == ATTN) | (op == ATTN_BWD)
    dur = np.zeros(len(C))
    dur[attn] = cost[C[attn, A1]]
    if launch:  # fused: one launch per run of compute blocks, charged to its first
        dur[run_starts(op, dev)] += launch
    other = np.flatnonzero(~comm & ~attn)  # MERGE / ADD stream their bytes
    if len(other):
        boff = np.concatenate([[0], np.cumsum([len(b) for b in bufbytes])]).astype(np.int64)
        flat = np.concatenate(bufbytes).astype(float)
        dur[other] = merge_seconds(flat[boff[dev[other]] + C[other, A2]], mem_bw)
    # a new step at every communication instruction, after one, and at every device's start
    new = comm.copy()
    if len(C):
        new[1:] |= comm[:-1] | (dev[1:] != dev[:-1])
        new[0] = True
    step = np.cumsum(new) - 1
    first = np.flatnonzero(new)
    sdur = np.add.reduceat(dur, first) if len(first) else np.zeros(0)
    sop = np.where(comm[first], op[first], LOCAL)
    loc = ~comm
    lstep = step[loc]
    lfirst = np.flatnonzero(np.r_[True, lstep[1:] != lstep[:-1]]) if len(lstep) else np.zeros(0, np.int64)
    local_id = np.full(len(first), -1, np.int64)
    local_id[lstep[lfirst]] = np.arange(len(lfirst))
    sarg = np.where(comm[first], C[first, A1] if len(first) else 0, local_id)
    items = list(zip(sop.tolist(), sarg.tolist(), sdur.tolist()))
    steps, at = [], 0
    for k in np.bincount(dev[first], minlength=n).tolist():
        steps.append(items[at:at + k])
        at += k
    return Steps(steps, dev[loc], dur[loc], np.where(attn[loc], C[loc, A1], -1), local_id[lstep], lfirst)


@dataclass(slots=True, eq=False)
class PhaseWalk:
    """The mutable state of one phase's simulation (private to :func:`simulate`):
    per device its clock, busy time, program counter and link queues; per
    message its first post, its end and the devices waiting on it."""

    steps: list           # per device: its steps (op, message or local step, seconds)
    src: list             # per message: sender, receiver, seconds
    dst: list
    dur: list
    record: bool
    n_local: int = 0      # local steps (their start times are recorded)
    clock: list = field(default_factory=list)
    busy: list = field(default_factory=list)
    pc: list = field(default_factory=list)
    send_free: list = field(default_factory=list)
    recv_free: list = field(default_factory=list)
    posted: dict = field(default_factory=dict)    # message -> time of the first post
    end: dict = field(default_factory=dict)       # message -> completion time
    waiting: dict = field(default_factory=dict)   # message -> devices stalled on it
    heap: list = field(default_factory=list)
    local_t0: list = field(default_factory=list)  # local step -> start time
    ev_t: list = field(default_factory=list)
    ev_w: list = field(default_factory=list)

    def __post_init__(self):
        n = len(self.steps)
        self.clock, self.busy, self.pc = [0.0] * n, [0.0] * n, [0] * n
        self.send_free, self.recv_free = [0.0] * n, [0.0] * n
        self.heap = [(0.0, d) for d in range(n)]
        self.local_t0 = [0.0] * self.n_local

    def run(self) -> None:
        """Advance devices in global time order until every one has ended or stalled."""
        while self.heap:
            _, d = heapq.heappop(self.heap)
            self.advance(d)

    def advance(self, d: int) -> None:
        """Run device ``d`` until its program ends, it stalls on a wait, or it
        reaches a send/receive that devices earlier in time must post before."""
        c, i, now = self.steps[d], self.pc[d], self.clock[d]
        while i < len(c):
            op, arg, dt = c[i]
            if op == LOCAL:
                if self.record:
                    self.local_t0[arg] = now
                self.busy[d] += dt
                now += dt
            elif op == WAIT:
                if arg not in self.end:  # stalled: woken by the message's second post
                    self.clock[d], self.pc[d] = now, i
                    self.waiting.setdefault(arg, []).append(d)
                    return
                if self.end[arg] > now:
                    if self.record:
                        self.ev_w.append((d, now, self.end[arg], arg))
                    now = self.end[arg]
            else:  # SEND / RECV
                if now > self.clock[d] or (self.heap and self.heap[0][0] < now):
                    break  # let devices earlier in time post first
                self.post(arg, now)
            i += 1
        else:
            self.clock[d], self.pc[d] = now, i
            return
        self.clock[d], self.pc[d] = now, i
        heapq.heappush(self.heap, (now, d))

    def post(self, t: int, now: float) -> None:
        """One end of message ``t`` is posted at ``now``; the second post starts it."""
        if t not in self.posted:
            self.posted[t] = now
            return
        a, b = self.src[t], self.dst[t]
        ready = max(self.posted[t], now)
        # the sender's and the receiver's queues each serve their own
        # messages in turn; a message ends when the busier side is done
        # (reserving both sides at the later start would leave idle gaps
        # that convoy through every link)
        self.send_free[a] = max(ready, self.send_free[a]) + self.dur[t]
        self.recv_free[b] = max(ready, self.recv_free[b]) + self.dur[t]
        end = self.end[t] = max(self.send_free[a], self.recv_free[b])
        if self.record:
            self.ev_t.append((t, a, b, end - self.dur[t], end))
        self._release(t, end)

    def _release(self, t: int, end: float) -> None:
        """Message ``t`` arrived at ``end``: every device waiting on it resumes then."""
        for w in self.waiting.pop(t, ()):
            if self.record and end > self.clock[w]:
                self.ev_w.append((w, self.clock[w], end, t))
            self.clock[w] = max(self.clock[w], end)
            self.pc[w] += 1
            heapq.heappush(self.heap, (self.clock[w], w))

    def summary(self, phase: int, st: Steps) -> dict:
        """``finish_s``, ``compute_s``, ``makespan_s`` (and ``events`` when recording); DeadlockError if stalled."""
        stalled = [d for d in range(len(self.steps)) if self.pc[d] < len(self.steps[d])]
        if stalled:  # the verifier proves this cannot happen for emitted programs
            raise DeadlockError(f"simulation of {PHASES[phase]} stalled on devices {stalled}")
        out = {"finish_s": self.clock, "compute_s": self.busy, "makespan_s": max(self.clock) if self.clock else 0.0}
        if self.record:
            out["events"] = {
                "compute": local_events(st, np.asarray(self.local_t0, float)),
                "transfer": np.asarray(self.ev_t, float).reshape(-1, 5),
                "wait": np.asarray(self.ev_w, float).reshape(-1, 4),
            }
        return out


def local_events(st: Steps, t0: np.ndarray) -> np.ndarray:
    """Rows ``(device, start, end, cb)`` of every local instruction, from the
    start time of its step and the seconds of the instructions before it in
    the step."""
    if not len(st.row_dur):
        return np.zeros((0, 4))
    before = np.concatenate([[0.0], np.cumsum(st.row_dur)[:-1]])  # exclusive running sum, all rows
    start = t0[st.row_step] + (before - before[st.step_first][st.row_step])
    return np.column_stack([st.row_dev.astype(float), start, start + st.row_dur, st.row_cb.astype(float)])
