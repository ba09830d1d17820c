"""tile_pool: Libra's TAP (tiled attention pooling) as a placement pass.

Attention is cut along the sequence *and* the heads: the graph is rebuilt
with several head groups (``head_groups=0``: one per kv head, at most 4), so
a tile — a compute block, (q block, kv block, head group) — is the unit of
placement. Splitting along heads costs the kernel nothing (equal-width head
chunks, same bytes and shape), unlike ever shorter sequence blocks.

Token homes are an equal split of the packed axis, contiguous by default:
device ``i`` holds tokens ``[i·T/N, (i+1)·T/N)``. That is Libra's setting
(each worker of the pool keeps the sequences its data loader gave it; tiles
migrate, data does not), and it keeps short documents whole on one device so
their tiles compute at home for free. ``homes=zigzag`` (chunks ``i`` and
``2N-1-i`` of ``2N``) starts from a better balance but cuts more documents in
two; over the shared workloads it moved about as many bytes or more, so it is
not the default.

Placement is a greedy over compute blocks: rows (the blocks of one Q block and
head group) by total cost, heaviest first, and inside a row the blocks by
cost, heaviest first (ties: lower id). Every device has a soft cap
``(1 + eps) · mean`` forward pairs. Among the devices that stay under the
cap, a block goes where it adds the fewest weighted bytes of communication:
nothing for a Q (with its returning partial O) or a KV block already on the
device — owned, or shipped there for an earlier block — else the block's
bytes, times ``inter_cost`` when they cross nodes; ties go to the
least-loaded device, then the lower id. When no device has room the
least-loaded device takes the block. Keeping a row together means a row that
leaves home ships its Q and partial O once.

Two refinements keep traffic down (on the shared workloads, 1.5-5x fewer
forward bytes than the plain heaviest-first greedy): the row order above, and a
reservation — a device counts the cost of its own not-yet-placed *local*
blocks (Q and KV both homed there) against the cap when it is offered
another device's block, so spilled work does not push a light device's own
blocks off it and cause a cascade of further spills. ``locality=false``
drops the byte preference (plain least-loaded under the cap) for comparison.

Granularity: ``block=0`` (auto) starts from the tile pass's blocks and halves
them (down to ``min_block`` tokens) until the greedy reaches compute
imbalance ``<= 1 + eps``; ``block=B`` cuts every ``B`` tokens of each sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import PlanError
from ..ir.graph import BlockGraph, sample_cuts
from ..ir.module import PlanIR
from ..ir.place import chunk_bounds, place_segments, zigzag_device
from ..ir.program import B_KV, B_O, B_Q, FWD, buffer_bytes
from .base import Pass, register

MAX_AUTO_HEAD_GROUPS = 4  # more groups multiply blocks and transfers; sequence blocks already give the granularity


def split_segments(tokens: int, devices: int, zigzag: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``(segment starts, their devices)`` of an equal split of the packed axis:
    contiguous (device i holds the i-th N-th) or zigzag (chunks i and 2N-1-i of 2N)."""
    parts = np.arange(2 * devices if zigzag else devices)
    bounds = chunk_bounds(tokens, len(parts))
    return bounds[:-1], (zigzag_device(parts, devices) if zigzag else parts)


def pool_assign(g: BlockGraph, home: np.ndarray, devices: int, nodes: int, eps: float,
                inter_cost: float = 8.0, locality: bool = True) -> np.ndarray:
    """The TAP greedy (see the module doc): the device of every compute block,
    given the home device of every token block."""
    if g.n_cb == 0:
        return np.zeros(0, np.int64)
    cost = g.cb_pairs
    local = np.where(home[g.cb_q] == home[g.cb_k], home[g.cb_q], -1)  # the home of blocks with Q and KV both there
    st = _PoolState(g, home, local, devices, nodes, (1.0 + eps) * float(cost.sum()) / devices, float(inter_cost),
                    locality)
    qkey = g.cb_q * g.n_hg + g.cb_hg
    kkey = g.cb_k * g.n_hg + g.cb_hg
    row_cost = np.bincount(qkey, weights=cost, minlength=g.n_tb * g.n_hg)
    order = np.lexsort((-cost, qkey, -row_cost[qkey]))
    out = np.empty(g.n_cb, np.int64)
    for c, w, qk, kk, own in zip(order.tolist(), cost[order].tolist(), qkey[order].tolist(),
                                 kkey[order].tolist(), local[order].tolist()):
        out[c] = st.place(w, qk, kk, own)
    return out


_NONE: frozenset = frozenset()


class _PoolState:
    """The greedy's state: per device its load and the cost of its own
    not-yet-placed local blocks (reserved); per data key (token block × head
    group) the devices holding its Q / KV (home, or shipped there for an
    earlier block) and how many (``q_held``: 0 where the key has no bytes).

    A block goes to the device with the fewest added weighted bytes among
    those with room, then the least load, then the lowest id. A device's
    added bytes are 0 for what it holds, else the bytes times 1 (the home's
    node) or ``inter_cost``: so beyond the holders only the devices of the
    Q home's and the KV home's nodes can differ, and every other device adds
    the same — the least-loaded of those with room is their candidate, looked
    for only when it could win. The arithmetic is the same as over whole
    arrays (pair counts and bytes are integers, exact in float64), so the
    placements are those of the plain vectorized greedy (tests compare)."""

    def __init__(self, g: BlockGraph, home: np.ndarray, local: np.ndarray, n: int, nodes: int, cap: float,
                 inter_cost: float, locality: bool):
        hg = g.n_hg
        keys = np.arange(g.n_tb * hg)
        ktb, khg = keys // hg, keys % hg
        qbytes = (buffer_bytes(g, FWD, B_Q, ktb, khg) + buffer_bytes(g, FWD, B_O, ktb, khg, wire=True)).astype(float)
        kvbytes = buffer_bytes(g, FWD, B_KV, ktb, khg).astype(float)
        if not locality:
            qbytes[:] = 0.0
            kvbytes[:] = 0.0
        self.n, self.per, self.cap, self.ic = n, n // nodes, cap, inter_cost
        self.node = np.arange(n) // self.per
        self.qb, self.kb = qbytes.tolist(), kvbytes.tolist()
        self.key_home = home[ktb].tolist()
        # load and reserved as lists for the per-device checks and as arrays for the scans off the two nodes
        self.reserved = np.bincount(local[local >= 0], weights=g.cb_pairs[local >= 0], minlength=n).astype(float)
        self.res = self.reserved.tolist()
        self.load = np.zeros(n)
        self.lo = [0.0] * n
        self.q_extra: dict[int, set] = {}   # key -> devices other than its home holding its Q
        self.kv_extra: dict[int, set] = {}
        # a local block whose Q or KV (of positive bytes) is held by its home alone can only go home when home
        # has room (every other device would add bytes): decided without looking at other devices
        self.q_held = [1 if b > 0 else 0 for b in self.qb]
        self.kv_held = [1 if b > 0 else 0 for b in self.kb]
        self._outside: dict[tuple[int, int], np.ndarray] = {}
        self._no_reservations = [0.0] * n

    def place(self, w: float, qk: int, kk: int, own: int) -> int:
        if own >= 0:
            self.res[own] -= w
            self.reserved[own] -= w
            if (self.q_held[qk] == 1 or self.kv_held[kk] == 1) and self.lo[own] + w <= self.cap:
                return self._take(own, w, qk, kk)
        return self._take(self._choose(w, qk, kk, own), w, qk, kk)

    def _take(self, d: int, w: float, qk: int, kk: int) -> int:
        self.lo[d] += w
        self.load[d] += w
        if d != self.key_home[qk]:
            held = self.q_extra.setdefault(qk, set())
            if d not in held:
                held.add(d)
                self.q_held[qk] += self.q_held[qk] > 0
        if d != self.key_home[kk]:
            held = self.kv_extra.setdefault(kk, set())
            if d not in held:
                held.add(d)
                self.kv_held[kk] += self.kv_held[kk] > 0
        return d

    def _choose(self, w: float, qk: int, kk: int, own: int) -> int:
        per = self.per
        nq, nk = self.key_home[qk] // per, self.key_home[kk] // per
        near = list(range(nq * per, (nq + 1) * per))
        if nk != nq:
            near += range(nk * per, (nk + 1) * per)
        near += [d for d in self.q_extra.get(qk, _NONE) | self.kv_extra.get(kk, _NONE) if d // per not in (nq, nk)]
        ba, bl, bd = self._scan(near, w, qk, kk, own, self.res)
        if len(near) < self.n:
            far = self.qb[qk] * self.ic + self.kb[kk] * self.ic  # what every device off both nodes adds (or less)
            if bd < 0 or far <= ba:
                d = self._least_loaded_off(nq, nk, w, own)
                if d >= 0 and (bd < 0 or (far, self.lo[d], d) < (ba, bl, bd)):
                    bd = d
        if bd >= 0:
            return bd
        return self._no_room(w, qk, kk)

    def _scan(self, devices, w: float, qk: int, kk: int, own: int, res: list) -> tuple[float, float, int]:
        """The best (added weighted bytes, load, device) among ``devices``
        with room under the cap counting ``res`` (none for ``own``, whose
        reservation is this block); device -1 if none has room. A device adds
        0 for the Q (+ partial O) or KV it holds, else its bytes times 1 on
        the home's node, ``inter_cost`` elsewhere. This loop is most of
        tile_pool's time: everything it reads is a local."""
        hq, hk, per, lo, cap = self.key_home[qk], self.key_home[kk], self.per, self.lo, self.cap
        nq, nk = hq // per, hk // per
        qx, kx = self.q_extra.get(qk, _NONE), self.kv_extra.get(kk, _NONE)
        qb, kb = self.qb[qk], self.kb[kk]
        q_far, k_far = qb * self.ic, kb * self.ic
        ba, bl, bd = math.inf, math.inf, -1
        for d in devices:
            if (lo[d] + w <= cap) if d == own else (lo[d] + res[d] + w <= cap):
                nd = d // per
                a = ((0.0 if d == hq or d in qx else (qb if nd == nq else q_far))
                     + (0.0 if d == hk or d in kx else (kb if nd == nk else k_far)))
                if a < ba or (a == ba and (lo[d] < bl or (lo[d] == bl and d < bd))):
                    ba, bl, bd = a, lo[d], d
        return ba, bl, bd

    def _least_loaded_off(self, nq: int, nk: int, w: float, own: int) -> int:
        """The least-loaded device with room off the nodes ``nq`` and ``nk`` (lowest id on ties); -1 if none."""
        off = self._outside.get((nq, nk))
        if off is None:
            off = self._outside[(nq, nk)] = (self.node != nq) & (self.node != nk)
        room = self.load + self.reserved + w <= self.cap
        if own >= 0:
            room[own] = self.load[own] + w <= self.cap
        room &= off
        if not room.any():
            return -1
        return int(np.argmin(np.where(room, self.load, np.inf)))

    def _no_room(self, w: float, qk: int, kk: int) -> int:
        """No device has room counting reservations: the fewest added bytes
        among those with room without them, else the least-loaded device."""
        d = self._scan(range(self.n), w, qk, kk, -1, self._no_reservations)[2]
        return d if d >= 0 else int(np.argmin(self.load))


@register
@dataclass(frozen=True, slots=True)
class TilePool(Pass):
    """Tiles over sequence and heads, placed greedily under a soft load cap with
    a preference for devices that already hold the tile's data (Libra TAP).

    Options: ``eps`` soft cap slack (cap = (1 + eps) · mean); ``head_groups``
    (0 = one per kv head, at most 4); ``block`` tokens per sequence block
    (0 = auto); ``min_block`` the smallest block auto may choose;
    ``inter_cost`` weight of a byte crossing nodes relative to one inside a
    node; ``homes`` ``contiguous`` or ``zigzag``; ``locality`` prefer devices
    that hold the data (false: least-loaded only)."""

    name = "tile_pool"
    default_run = 0.0  # a kernel run per partner: its partners' data arrive far apart (comm.Overlap)
    needs = ("graph",)
    strategy = True
    eps: float = 0.04
    head_groups: int = 0
    block: int = 0
    min_block: int = 128
    inter_cost: float = 8.0
    homes: str = "contiguous"
    locality: bool = True

    def __post_init__(self):
        if not self.eps >= 0:
            raise PlanError(f"tile_pool: eps must be >= 0, got {self.eps}")
        if self.head_groups < 0:
            raise PlanError(f"tile_pool: head_groups must be >= 0 (0 = auto), got {self.head_groups}")
        if self.block < 0:
            raise PlanError(f"tile_pool: block must be >= 0 (0 = auto), got {self.block}")
        if self.min_block <= 0:
            raise PlanError(f"tile_pool: min_block must be a positive integer, got {self.min_block}")
        if not self.inter_cost >= 0:
            raise PlanError(f"tile_pool: inter_cost must be >= 0, got {self.inter_cost}")
        if self.homes not in ("contiguous", "zigzag"):
            raise PlanError(f"tile_pool: homes must be contiguous or zigzag, got {self.homes!r}")

    def apply(self, ir: PlanIR) -> PlanIR:
        p, n = ir.problem, ir.devices
        if self.head_groups > p.kv_heads:
            raise PlanError(f"tile_pool: head_groups={self.head_groups} exceeds kv_heads={p.kv_heads}")
        hg = self.head_groups or min(p.kv_heads, MAX_AUTO_HEAD_GROUPS)
        starts, devs = split_segments(p.tokens, n, self.homes == "zigzag")
        block = self.block or int(ir.need_graph().tb_len.max(initial=1))

        def assign(g: BlockGraph, home: np.ndarray) -> np.ndarray:
            return pool_assign(g, home, n, ir.nodes, self.eps, self.inter_cost, self.locality)

        while True:
            out = place_segments(ir, starts, devs, extra_cuts=sample_cuts(p, block), head_groups=hg, compute=assign)
            load = np.bincount(out.need_placement().cb_device, weights=out.need_graph().cb_pairs, minlength=n)
            if self.block or block // 2 < self.min_block or load.max(initial=0) <= (1 + self.eps) * load.mean():
                return out
            block //= 2
