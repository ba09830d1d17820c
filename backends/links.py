"""Links shared max-min fairly: the ``links="fair"`` mode of the simulator.

The default simulator (``links="queue"``, :mod:`attnplan.backends.cost`)
gives each message a whole link for ``alpha + bytes / bandwidth`` and
serves a device's sends (and its receives) one at a time. Here every
message that both sides have posted is a flow: after its latency ``alpha``
it moves its bytes at a rate shared with the other flows on the same ports,
max-min fair (progressive filling, Bertsekas & Gallager, *Data Networks*,
§6.5.2). A device has four ports: an intra-node send and receive port of
``intra_bw`` (NVLink: every peer of the node through one switch) and an
inter-node send and receive port of ``inter_bw`` (its own NIC, as an H100
node has one 400 Gb/s NIC per GPU; a node's inter-node capacity is then the
sum of its devices', so no node-level constraint binds). A flow uses its
sender's send port and its receiver's receive port of its kind. Rates are
recomputed whenever a flow starts or ends; a flow ends when its bytes are
done, and the waits on it end then.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from .walk import PhaseWalk


def max_min_rates(ports: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """Max-min fair rates of flows that each use the ports of one row of
    ``ports`` (flows × k port ids), ports of ``capacity``: progressive
    filling — raise every unfrozen flow's rate equally until a port is full,
    freeze the flows through it, repeat."""
    n = len(ports)
    rate = np.zeros(n)
    if n == 0:
        return rate
    left = capacity.astype(float).copy()
    live = np.ones(n, bool)
    while live.any():
        count = np.bincount(ports[live].ravel(), minlength=len(left))
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where(count > 0, left / np.maximum(count, 1), np.inf)
        m = float(share.min())
        full = share <= m * (1 + 1e-12)
        hit = live & full[ports].any(axis=1)
        rate[hit] = m
        np.subtract.at(left, ports[hit].ravel(), m)
        np.maximum(left, 0.0, out=left)
        live &= ~hit
    return rate


@dataclass(slots=True, eq=False)
class FairWalk(PhaseWalk):
    """:class:`PhaseWalk` with fluid flows instead of link queues: a
    message posted on both sides starts after ``alpha``; its ``end`` is set
    when its bytes are done (until then a wait on it stalls)."""

    nbytes: list = field(default_factory=list)   # per message: bytes
    alpha: list = field(default_factory=list)    # ... latency
    port: list = field(default_factory=list)     # ... (send port, receive port)
    capacity: np.ndarray = field(default_factory=lambda: np.zeros(0))
    starts: list = field(default_factory=list)   # heap of (time, message): flows about to move bytes
    flows: list = field(default_factory=list)    # active messages
    left: list = field(default_factory=list)     # their bytes left
    rates: np.ndarray = field(default_factory=lambda: np.zeros(0))
    now: float = 0.0                             # the fluid state's time
    ready: dict = field(default_factory=dict)    # message -> time both sides had posted

    def run(self) -> None:
        while self.heap or self.starts or self.flows:
            t_dev = self.heap[0][0] if self.heap else np.inf
            t_start = self.starts[0][0] if self.starts else np.inf
            t_end, k = self._next_end()
            t = min(t_dev, t_start, t_end)
            if t == t_end and t_end <= t_start and t_end <= t_dev:
                self._drain(t)
                self._finish(k, t)
            elif t == t_start and t_start <= t_dev:
                self._drain(t)
                _, m = heapq.heappop(self.starts)
                self.flows.append(m)
                self.left.append(float(self.nbytes[m]))
                self._rerate()
            else:
                _, d = heapq.heappop(self.heap)
                self.advance(d)

    def _next_end(self) -> tuple[float, int]:
        if not self.flows:
            return np.inf, -1
        with np.errstate(divide="ignore"):
            t = np.asarray(self.left) / self.rates
        k = int(np.argmin(t))
        return self.now + float(t[k]), k

    def _drain(self, t: float) -> None:
        """Move the fluid state forward to ``t``."""
        if self.flows and t > self.now:
            self.left = np.maximum(np.asarray(self.left) - self.rates * (t - self.now), 0.0).tolist()
        self.now = max(self.now, t)

    def _rerate(self) -> None:
        ports = np.asarray([self.port[m] for m in self.flows], np.int64).reshape(-1, 2)
        self.rates = max_min_rates(ports, self.capacity)

    def _finish(self, k: int, t: float) -> None:
        m = self.flows.pop(k)
        self.left.pop(k)
        self._rerate()
        self.end[m] = t
        if self.record:
            self.ev_t.append((m, self.src[m], self.dst[m], self.ready[m], t))
        self._release(m, t)

    def post(self, t: int, now: float) -> None:
        """One end of message ``t`` is posted at ``now``; the second post starts its latency."""
        if t not in self.posted:
            self.posted[t] = now
            return
        ready = self.ready[t] = max(self.posted[t], now)
        heapq.heappush(self.starts, (ready + self.alpha[t], t))


def fair_walk(steps, src, dst, nbytes, per_node: int, prof, record: bool, n_local: int) -> FairWalk:
    """A :class:`FairWalk` over one phase's steps and messages (``src``,
    ``dst``, ``nbytes`` per message) under ``prof``'s bandwidths."""
    n = len(steps)
    src_a, dst_a = np.asarray(src, np.int64), np.asarray(dst, np.int64)
    inter = (src_a // per_node) != (dst_a // per_node)
    port = np.column_stack([2 * src_a + inter, 2 * n + 2 * dst_a + inter])
    capacity = np.tile([prof.intra_bw, prof.inter_bw], 2 * n).astype(float)
    alpha = np.where(inter, prof.inter_alpha, prof.intra_alpha)
    return FairWalk(steps, list(src), list(dst), [0.0] * len(src), record=record, n_local=n_local,
                    nbytes=np.asarray(nbytes, float).tolist(), alpha=alpha.tolist(), port=port.tolist(),
                    capacity=capacity)
