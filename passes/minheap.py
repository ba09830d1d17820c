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
(``k = ceil(T / (C·N))``). ``chunk=0`` (the default) chooses per batch, in
two stages:

1. *Equal chunks.* The coarsest ``k`` in 1, 2, 4, ... whose greedy placement
   reaches compute imbalance ``<= balance``, never going below ``min_chunk``
   tokens a chunk (the kernel's 128-row query tile: shorter chunks waste
   kernel work). Every device holds ``k`` chunks: equal tokens.
2. *Chunks cut by work*, only when stage 1 misses the target. That happens
   when a mask puts much of the work in few query rows: in
   ``causal_blockwise(256, 2)`` a sample's last 256 rows see the whole
   sample, and on the strategies benchmark's 131K batch at 32 devices they
   are 2.4 mean device loads; compute stays where Q lives, so no split into
   128-row chunks can balance them. Each chunk of a stage-1 split whose work
   exceeds a cap is cut into the fewest pieces of equal work under it
   (:func:`split_by_work`, one query row the finest), and the greedy places
   the pieces under a token cap instead of a chunk count: a device takes
   pieces while it holds fewer than ``(1 + s) · T / N`` tokens. The search
   takes the cap coarsest first (``PIECE_CAPS`` × the mean device load, then
   ``balance − 1`` of it), then ``k`` coarsest first, then the least slack
   ``s`` of ``SLACK`` that reaches the target, up to ``TOKEN_SLACK`` (only
   when no (cap, k) reaches it within that does the first that reaches it
   at all take more). Coarse first because every piece of a heavy region
   needs that region's whole KV where it runs: a few large pieces move
   less, make fewer compute blocks and waste less of the 128-row tiles than
   many small ones (the 131K batch at 32 devices: predicted 13 ms coarse
   first, 70 ms with the finest cap alone). With ``s = ∞`` the greedy
   is Graham's LPT rule, whose makespan is at most the mean plus the largest
   piece (Graham, "Bounds on multiprocessing timing anomalies", SIAM J.
   Appl. Math. 17(2), 1969), so the last cap meets the target whenever no
   single query row is heavier than ``balance − 1`` mean loads. Compute
   balance is the target; a device holding heavy rows holds fewer tokens,
   and token balance is what the slack gives up (a device holds at most
   ``(1 + s) · T / N`` tokens plus one piece: token imbalance 1.25 at worst
   on the suite's batches).

Chunk areas come from the mask pieces in closed form, so the imbalance the
search sees is exactly the one ``stats()`` reports; each candidate costs one
O(n log N) greedy (stage 2 adds a bisection over closed-form prefix sums).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from ..errors import PlanError
from ..ir.arrays import unique
from ..ir.graph import _expand
from ..ir.mask import Q0, Q1, piece_counts, tighten
from ..ir.module import PlanIR
from ..ir.place import chunk_bounds, place_segments
from .base import Pass, register

SLACK = (0.0, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0, math.inf)  # token slack ladder of stage 2
TOKEN_SLACK = 1 / 4  # stage 2 prefers a finer split to more token slack than this
PIECE_CAPS = (1.0, 1 / 2, 1 / 4, 1 / 8, 1 / 16)  # stage 2's caps on a chunk's work, coarsest first
MIN_EPS = 1 / 64  # stage 2 cuts no chunk below this share of the mean device load (bounds the chunk count)


def token_cap(tokens: int, devices: int, slack: float) -> float:
    """Tokens a device may reach before it stops taking chunks: ``ceil((1 + slack) · tokens / devices)``."""
    return math.inf if math.isinf(slack) else float(math.ceil((1.0 + slack) * tokens / devices))


def interval_pairs(pieces: np.ndarray, bounds: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """Exact allowed pairs whose query row lies in each interval ``[bounds[i], bounds[i+1])``
    (each piece's pairs times its integer weight, if given: per-head masks
    count a piece once per head of its class, :meth:`Problem.piece_heads`).

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
    counts = piece_counts(rows[keep]) * (1 if weights is None else weights[src[keep]])
    return np.bincount(iv[keep], weights=counts, minlength=n).astype(np.int64)


def prefix_pairs(pieces: np.ndarray, rows: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """Allowed pairs whose query lies in ``[0, r)``, for every ``r`` of ``rows`` (any order)."""
    u, inv = np.unique(np.asarray(rows, np.int64), return_inverse=True)
    end = max(int(u[-1]), int(pieces[:, Q1].max())) if len(pieces) and len(u) else 0
    cum = np.cumsum(interval_pairs(pieces, np.concatenate([[0], u, [end]]), weights))
    return cum[inv.reshape(-1)]


def split_by_work(pieces: np.ndarray, bounds: np.ndarray, areas: np.ndarray, cap: float,
                  weights: np.ndarray | None = None) -> np.ndarray:
    """``bounds`` with every interval whose area exceeds ``cap`` cut into
    ``m = ceil(area / cap)`` pieces of equal work (at most one per query row).

    Cut ``j`` of an interval ``[a, b)`` is the first row ``r`` with
    ``pairs[a, r) >= j · area / m``, found by a bisection run for all cuts at
    once (O(log(b − a)) closed-form passes), so every piece holds at most
    ``area / m`` plus one row's pairs."""
    size = np.diff(bounds)
    parts = np.minimum(np.ceil(areas / cap), size).astype(np.int64) if cap > 0 else np.ones_like(size)
    heavy = np.flatnonzero(parts > 1)
    if not len(heavy):
        return bounds
    owner, j = _expand(np.ones(len(heavy), np.int64), parts[heavy] - 1)
    iv = heavy[owner]
    target = prefix_pairs(pieces, bounds[iv], weights) + (j * areas[iv]) // parts[iv]
    lo, hi = bounds[iv] + 1, bounds[iv + 1]         # the cut is in (a, b]: pairs[a, b) = area >= target
    while (open_ := lo < hi).any():
        mid = (lo + hi) // 2
        reached = prefix_pairs(pieces, mid, weights) >= target
        hi = np.where(open_ & reached, mid, hi)
        lo = np.where(open_ & ~reached, mid + 1, lo)
    return unique(np.concatenate([bounds, np.minimum(lo, bounds[iv + 1])]))


def minheap_assign(areas: np.ndarray, devices: int, per_device: float, sizes: np.ndarray | None = None) -> np.ndarray:
    """MagiAttention's greedy: items by area descending (stable), each onto the
    least-loaded device (ties: lower id) that has room. A device has room while
    the sizes it holds sum to less than ``per_device``; ``sizes`` defaults to one
    per item, so ``per_device`` is then an item count. Returns the device of every
    item. Needs the sizes to fit: ``sum(sizes) <= devices * per_device``
    (``per_device = inf``: no room limit, Graham's LPT rule)."""
    sz = np.ones(len(areas), np.int64) if sizes is None else np.asarray(sizes, np.int64)
    if sz.sum() > devices * per_device:
        raise PlanError(f"minheap: {len(areas)} chunks of {int(sz.sum())} in all do not fit {devices} devices x "
                        f"{per_device}")
    order = np.argsort(-np.asarray(areas, np.int64), kind="stable")
    heap = [(0, d) for d in range(devices)]
    held = [0] * devices
    out = np.empty(len(areas), np.int64)
    for i, a, s in zip(order.tolist(), np.asarray(areas)[order].tolist(), sz[order].tolist()):
        load, d = heapq.heappop(heap) if heap else (0, 0)  # every device full: only empty items are left
        out[i] = d
        held[d] += s
        if held[d] < per_device:
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
    shortest equal chunk auto may choose (stage 2 cuts heavy chunks finer)."""

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
        """``(k, bounds, chunk_device)`` for this batch: the equal chunk count per
        device (of the split stage 2 refined, see the module doc), the chunk
        boundaries (``k·N + 1`` of them unless stage 2 cut chunks by work) and the
        device of every chunk."""
        T, n = ir.problem.tokens, ir.devices
        P, w = ir.problem.pieces.a, ir.problem.piece_heads()
        if self.chunk:
            k = max(1, -(-T // (self.chunk * n)))
            bounds = chunk_bounds(T, k * n)
            return k, bounds, minheap_assign(interval_pairs(P, bounds, w), n, k)
        ks = [1]
        while T // (2 * ks[-1] * n) >= self.min_chunk:
            ks.append(2 * ks[-1])
        splits = []
        for k in ks:                                                  # stage 1: equal chunks
            bounds = chunk_bounds(T, k * n)
            areas = interval_pairs(P, bounds, w)
            dev = minheap_assign(areas, n, k)
            imb = imbalance(np.bincount(dev, weights=areas, minlength=n))
            if imb <= self.balance:
                return k, bounds, dev
            splits.append((bounds, areas))
        return self.cut_by_work(P, ks, splits, n, (imb, ks[-1], bounds, dev), w)

    def cut_by_work(self, P: np.ndarray, ks: list[int], splits: list[tuple[np.ndarray, np.ndarray]], n: int,
                    best: tuple[float, int, np.ndarray, np.ndarray],
                    w: np.ndarray | None = None) -> tuple[int, np.ndarray, np.ndarray]:
        """Stage 2 of the module doc. ``splits[i]`` holds the bounds and areas of
        stage 1's equal split with ``ks[i]`` chunks a device. Tries, in order: the
        piece cap (coarsest first), ``k`` (coarsest first), the token slack
        (least first, at most ``TOKEN_SLACK``); a (cap, k) whose greedy misses
        the target even without a token cap is skipped. Returns the first that
        reaches ``balance``; else the first (cap, k) that reaches it with more
        slack; else the most balanced seen, ``best`` (stage 1's finest) included."""
        mean = float(splits[0][1].sum()) / n
        first: tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        for f in self.piece_caps():
            for k, (bounds, areas) in zip(ks, splits):
                cut = split_by_work(P, bounds, areas, f * mean, w)
                cut_areas, sizes = interval_pairs(P, cut, w), np.diff(cut)
                lpt = minheap_assign(cut_areas, n, math.inf, sizes)
                imb = imbalance(np.bincount(lpt, weights=cut_areas, minlength=n))
                if imb > self.balance:
                    if imb < best[0]:
                        best = (imb, k, cut, lpt)
                    continue
                dev = self.least_slack(cut_areas, sizes, n, [s for s in SLACK if s <= TOKEN_SLACK])
                if dev is not None:
                    return k, cut, dev
                if first is None:
                    first = (k, cut, cut_areas, sizes, lpt)
        if first is not None:  # no (cap, k) within TOKEN_SLACK: the first that balances, with the least slack
            k, cut, cut_areas, sizes, lpt = first
            dev = self.least_slack(cut_areas, sizes, n, [s for s in SLACK if TOKEN_SLACK < s < math.inf])
            return k, cut, lpt if dev is None else dev
        return best[1], best[2], best[3]

    def least_slack(self, areas: np.ndarray, sizes: np.ndarray, n: int, slacks: list[float]) -> np.ndarray | None:
        """The greedy under the token cap of the first slack of ``slacks`` that reaches ``balance``, or None."""
        T = int(sizes.sum())
        for s in slacks:
            dev = minheap_assign(areas, n, token_cap(T, n, s), sizes)
            if imbalance(np.bincount(dev, weights=areas, minlength=n)) <= self.balance:
                return dev
        return None

    def piece_caps(self) -> list[float]:
        """Stage 2's caps on a chunk's work, as shares of the mean device load:
        ``PIECE_CAPS``, then ``balance − 1`` (Graham's bound; at least ``MIN_EPS``)."""
        eps = max(self.balance - 1.0, MIN_EPS)
        return [f for f in PIECE_CAPS if f > eps] + [eps]

    def apply(self, ir: PlanIR) -> PlanIR:
        _, bounds, dev = self.chunks_per_device(ir)
        return place_segments(ir, bounds[:-1], dev)
