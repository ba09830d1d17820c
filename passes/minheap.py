"""minheap: MagiAttention's dispatch solver as a placement pass.

The packed query axis is cut into ``n = k · N`` equal chunks (N devices, the
first ``T mod n`` chunks one token longer, nothing padded). Each chunk's cost
is its mask area: the exact number of allowed (q, k) pairs whose query lies
in the chunk. Chunks are sorted by area, largest first (ties: lower index
first), and each goes to the least-loaded device that still has room
(ties: lower device); every device takes exactly ``k`` chunks, so token
counts stay balanced while the quadratic attention work is balanced by the
greedy. A chunk's tokens live on its device and its queries are computed
there (Q stays); KV moves only to the devices that need it, which is what
the ``comm`` pass derives.

Granularity. ``chunk=C`` asks for chunks of at most ``C`` tokens
(``k = ceil(T / (C·N))``). ``chunk=0`` (the default) chooses per batch: the
coarsest ``k`` in 1, 2, 4, ... whose greedy placement reaches compute
imbalance ``<= balance``, never going below ``min_chunk`` tokens a chunk (the
kernel's 128-row query tile: shorter chunks waste kernel work). Chunk areas
come from the mask pieces in closed form, so the imbalance the search sees is
exactly the one ``stats()`` reports, and each candidate costs one
O(n log N) greedy.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from ..errors import PlanError
from ..ir.graph import _expand
from ..ir.mask import Q0, Q1, piece_counts, tighten
from ..ir.module import PlanIR
from ..ir.placement import chunk_bounds, place_segments
from .base import Pass, register


def interval_pairs(pieces: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Exact allowed pairs whose query row lies in each interval ``[bounds[i], bounds[i+1])``.

    ``bounds`` is non-decreasing (empty intervals get 0). Each mask piece is
    clipped to the intervals its rows touch and counted in closed form, so the
    cost is O(pieces + intervals), never O(tokens²)."""
    n = len(bounds) - 1
    if n <= 0 or not len(pieces):
        return np.zeros(max(n, 0), np.int64)
    first = np.searchsorted(bounds, pieces[:, Q0], "right") - 1
    last = np.searchsorted(bounds, pieces[:, Q1] - 1, "right") - 1
    src, iv = _expand(first, last)
    rows = pieces[src]
    rows[:, Q0] = np.maximum(rows[:, Q0], bounds[iv])
    rows[:, Q1] = np.minimum(rows[:, Q1], bounds[iv + 1])
    keep = tighten(rows)
    return np.bincount(iv[keep], weights=piece_counts(rows[keep]), minlength=n).astype(np.int64)


def minheap_assign(areas: np.ndarray, devices: int, per_device: int) -> np.ndarray:
    """MagiAttention's greedy: items by area descending (stable), each onto the
    least-loaded device (ties: lower id) that holds fewer than ``per_device``
    items. Returns the device of every item. Needs ``len(areas) <= devices * per_device``."""
    if len(areas) > devices * per_device:
        raise PlanError(f"minheap: {len(areas)} chunks do not fit {devices} devices x {per_device}")
    order = np.argsort(-np.asarray(areas, np.int64), kind="stable")
    heap = [(0, d) for d in range(devices)]
    count = [0] * devices
    out = np.empty(len(areas), np.int64)
    for i, a in zip(order.tolist(), np.asarray(areas)[order].tolist()):
        load, d = heapq.heappop(heap)
        out[i] = d
        count[d] += 1
        if count[d] < per_device:
            heapq.heappush(heap, (load + a, d))
    return out


def imbalance(load: np.ndarray) -> float:
    """max / mean of per-device loads (1.0 when there is no work)."""
    m = float(np.mean(load)) if len(load) else 0.0
    return float(np.max(load) / m) if m > 0 else 1.0


@register
@dataclass(frozen=True, slots=True)
class MinHeap(Pass):
    """Equal query chunks placed by area with a min-heap (MagiAttention).

    Options: ``chunk`` tokens per chunk (0 = auto, see the module doc),
    ``balance`` the auto target for compute imbalance, ``min_chunk`` the
    shortest chunk auto may choose."""

    name = "minheap"
    needs = ("graph",)
    strategy = True
    chunk: int = 0
    balance: float = 1.05
    min_chunk: int = 128

    def __post_init__(self):
        if self.chunk < 0:
            raise PlanError(f"minheap: chunk must be >= 0 (0 = auto), got {self.chunk}")
        if self.balance < 1.0:
            raise PlanError(f"minheap: balance must be >= 1.0, got {self.balance}")
        if self.min_chunk <= 0:
            raise PlanError(f"minheap: min_chunk must be a positive integer, got {self.min_chunk}")

    def chunks_per_device(self, ir: PlanIR) -> tuple[int, np.ndarray, np.ndarray]:
        """``(k, bounds, chunk_device)`` for this batch: the chosen chunk count per
        device, the ``k·N + 1`` chunk boundaries and the device of every chunk."""
        T, n = ir.problem.tokens, ir.devices
        P = ir.problem.pieces.a
        if self.chunk:
            k = max(1, -(-T // (self.chunk * n)))
            bounds = chunk_bounds(T, k * n)
            return k, bounds, minheap_assign(interval_pairs(P, bounds), n, k)
        k = 1
        while True:
            bounds = chunk_bounds(T, k * n)
            areas = interval_pairs(P, bounds)
            dev = minheap_assign(areas, n, k)
            if imbalance(np.bincount(dev, weights=areas, minlength=n)) <= self.balance \
                    or T // (2 * k * n) < self.min_chunk:
                return k, bounds, dev
            k *= 2

    def apply(self, ir: PlanIR) -> PlanIR:
        _, bounds, dev = self.chunks_per_device(ir)
        return place_segments(ir, bounds[:-1], dev)
