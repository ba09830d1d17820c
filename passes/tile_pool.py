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

from dataclasses import dataclass

import numpy as np

from ..errors import PlanError
from ..ir.graph import BlockGraph, sample_cuts
from ..ir.module import PlanIR
from ..ir.placement import chunk_bounds, place_segments, zigzag_device
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
    n, hg = devices, g.n_hg
    cost = g.cb_pairs
    if g.n_cb == 0:
        return np.zeros(0, np.int64)
    cap = (1.0 + eps) * float(cost.sum()) / n
    node = np.arange(n) // (n // nodes)
    weight = np.where(node[:, None] == node[None, :], 1.0, float(inter_cost))  # [src device, dst device]
    keys = np.arange(g.n_tb * hg)  # data key of (token block, head group) = tb * hg + group
    ktb, khg = keys // hg, keys % hg
    qbytes = (buffer_bytes(g, FWD, B_Q, ktb, khg) + buffer_bytes(g, FWD, B_O, ktb, khg)).astype(float)
    kvbytes = buffer_bytes(g, FWD, B_KV, ktb, khg).astype(float)
    if not locality:
        qbytes[:] = 0.0
        kvbytes[:] = 0.0
    # weighted bytes of shipping a key's Q (+ partial O back) / KV to each device, 0 where the device already
    # holds it (owned, or shipped there for an earlier block)
    q_inc = qbytes[:, None] * weight[home[ktb]]
    kv_inc = kvbytes[:, None] * weight[home[ktb]]
    has_q = np.zeros((len(keys), n), bool)
    has_kv = np.zeros((len(keys), n), bool)
    has_q[keys, home[ktb]] = True
    has_kv[keys, home[ktb]] = True
    q_inc[has_q] = 0.0
    kv_inc[has_kv] = 0.0
    qkey = g.cb_q * hg + g.cb_hg
    kkey = g.cb_k * hg + g.cb_hg
    local = np.where(home[g.cb_q] == home[g.cb_k], home[g.cb_q], -1)
    reserved = np.bincount(local[local >= 0], weights=cost[local >= 0], minlength=n).astype(float)
    row_cost = np.bincount(qkey, weights=cost, minlength=len(keys))
    order = np.lexsort((-cost, qkey, -row_cost[qkey]))
    load = np.zeros(n)
    out = np.empty(g.n_cb, np.int64)
    # devices holding each key's Q / KV: a local block whose Q or KV (of positive bytes) is held by its home
    # alone can only go home when home has room (every other device would add bytes) — decided without the
    # device scan below
    q_held = [1 if b > 0 else 0 for b in qbytes.tolist()]
    kv_held = [1 if b > 0 else 0 for b in kvbytes.tolist()]
    for c, w, qk, kk, own in zip(order.tolist(), cost[order].tolist(), qkey[order].tolist(),
                                 kkey[order].tolist(), local[order].tolist()):
        if own >= 0:
            reserved[own] -= w
            if (q_held[qk] == 1 or kv_held[kk] == 1) and load[own] + w <= cap:
                out[c] = own
                load[own] += w
                continue
        room = load + reserved + w <= cap
        if own >= 0:
            room[own] = load[own] + w <= cap
        if not room.any():
            room = load + w <= cap
        # the fewest added bytes among the devices with room (none: every device), then the least load,
        # then the lowest id (argmin takes the first)
        key = np.where(room, q_inc[qk] + kv_inc[kk], np.inf) if room.any() else load
        d = int(np.argmin(np.where(key == key.min(), load, np.inf)))
        out[c] = d
        load[d] += w
        if not has_q[qk, d]:
            q_held[qk] += q_held[qk] > 0
            has_q[qk, d] = True
            q_inc[qk, d] = 0.0
        if not has_kv[kk, d]:
            kv_held[kk] += kv_held[kk] > 0
            has_kv[kk, d] = True
            kv_inc[kk, d] = 0.0
    return out


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
