"""comm{mode=p2p|ring|allgather}: derive the transfers a placement needs.

* ``p2p`` (zero-redundant, MagiAttention/DCP style): each Q and KV block goes
  from its home straight to every other device that computes with it, once;
  one stage.
* ``ring`` (ring attention as deployed in ring-flash-attn and
  TransformerEngine): every KV block travels around the ring of devices,
  one hop a stage, so every device receives every other device's KV whether
  it needs it or not; a compute block runs in the stage its KV arrives
  (``(device - home) mod N``). Q (if it must move) goes p2p in stage 0.
* ``allgather`` (all-gather CP as Llama 3 (Dubey et al. 2024, §3.3.2) and
  TransformerEngine's ``all_gather`` mode deploy it): every device receives
  every KV block from its home, needed or not, in one stage before any
  compute; the backward's dKV partials go home as before (the reduce-scatter
  of an all-gather, restricted to the blocks that were used). One message
  per peer after coalescing: the direct all-gather; NCCL's ring all-gather
  moves the same bytes per device.

Either way each partial O goes from a computing device to the Q block's home
once, after its last write.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..errors import PlanError
from ..ir.module import PlanIR
from ..ir.schedule import X_KV, X_O, X_Q, Schedule
from ..ir.verify import needed_transfers
from .base import Pass, register


def _rows(kind, r, stage) -> np.ndarray:
    """Schedule rows (kind, tb, hg, src, dst, stage) from needed rows (tb, hg, src, dst)."""
    return np.column_stack([np.full(len(r), kind), r, np.broadcast_to(stage, (len(r),))]).astype(np.int64)


def allgather_kv(g, pl) -> np.ndarray:
    """All-gather traffic: schedule rows of every KV block from its home to
    every other device, stage 0, ordered by source then destination."""
    n = pl.devices
    tb = np.repeat(np.arange(g.n_tb), g.n_hg)
    hg = np.tile(np.arange(g.n_hg), g.n_tb)
    src = pl.home[tb]
    off = np.arange(1, n)
    dst = (src[:, None] + off[None, :]) % n
    rows = np.column_stack([np.full(dst.size, X_KV), np.repeat(tb, n - 1), np.repeat(hg, n - 1),
                            np.repeat(src, n - 1), dst.ravel(), np.zeros(dst.size, np.int64)])
    order = np.lexsort((rows[:, 4], rows[:, 3]))
    return rows[order].astype(np.int64).reshape(-1, 6)


def ring_kv(g, pl) -> tuple[np.ndarray, np.ndarray]:
    """Ring traffic: (schedule rows of KV, stage of every compute block).
    Rows come by stage, then sending device (block order within): the order
    of the messages they travel in."""
    n = pl.devices
    tb = np.repeat(np.arange(g.n_tb), g.n_hg)
    hg = np.tile(np.arange(g.n_hg), g.n_tb)
    h = pl.home[tb]
    hop = np.arange(1, n)
    s = np.repeat(hop, len(tb))
    tb_, hg_, h_ = (np.tile(a, n - 1) for a in (tb, hg, h))
    src = (h_ + s - 1) % n
    order = np.argsort(src.astype(np.uint16), kind="stable")  # radix sorts (devices < 2^16): by stage, then source
    order = order[np.argsort(s[order].astype(np.uint16), kind="stable")]
    s, tb_, hg_, src = s[order], tb_[order], hg_[order], src[order]
    rows = np.column_stack([np.full(len(s), X_KV), tb_, hg_, src, (src + 1) % n, s])
    stage = (pl.cb_device - pl.home[g.cb_k]) % n
    return rows.astype(np.int64).reshape(-1, 6), stage.astype(np.int64)


@register
@dataclass(frozen=True, slots=True)
class Comm(Pass):
    name = "comm"
    needs = ("graph", "placement")
    mode: str = "p2p"

    def __post_init__(self):
        if self.mode not in ("p2p", "ring", "allgather"):
            raise PlanError(f"comm: mode must be p2p, ring or allgather, got {self.mode!r}")

    def apply(self, ir: PlanIR) -> PlanIR:
        g, pl = ir.need_graph(), ir.need_placement()
        need = needed_transfers(g, pl)
        if self.mode == "p2p" or pl.devices == 1:
            stages = 1
            kv = _rows(X_KV, need[X_KV], 0)
            cb_stage = np.zeros(g.n_cb, np.int64)
        elif self.mode == "allgather":
            stages = 1
            kv = allgather_kv(g, pl)
            cb_stage = np.zeros(g.n_cb, np.int64)
        else:
            stages = pl.devices
            kv, cb_stage = ring_kv(g, pl)
        xfer = np.concatenate([_rows(X_Q, need[X_Q], 0), kv, _rows(X_O, need[X_O], stages - 1)])
        return ir.with_levels(schedule=Schedule(stages, cb_stage, xfer))


@register
@dataclass(frozen=True, slots=True)
class Overlap(Pass):
    """Post each stage's transfers during the previous stage's compute, wait
    for a block right before its first use, and send partial outputs home as
    soon as they are final (see :mod:`attnplan.passes.emit`)."""

    name = "overlap"
    needs = ("graph", "placement", "schedule")

    def apply(self, ir: PlanIR) -> PlanIR:
        return ir.with_levels(schedule=dataclasses.replace(ir.need_schedule(), overlap=True))
