"""comm: derive the transfers a placement needs — each Q and KV block goes
from its home to every other device that computes with it, once; each
partial O goes from a computing device to its home, once — and a
single-stage schedule (every compute block in stage 0)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir.module import PlanIR
from ..ir.schedule import Schedule
from ..ir.verify import needed_transfers
from .base import Pass, register


@register
@dataclass(frozen=True, slots=True)
class Comm(Pass):
    name = "comm"
    needs = ("graph", "placement")

    def apply(self, ir: PlanIR) -> PlanIR:
        need = needed_transfers(ir.graph, ir.placement)
        rows = [np.column_stack([np.full(len(r), kind), r, np.zeros(len(r), np.int64)])
                for kind, r in sorted(need.items())]
        xfer = np.concatenate(rows).astype(np.int64) if rows else np.zeros((0, 6), np.int64)
        s = Schedule(stages=1, cb_stage=np.zeros(ir.graph.n_cb, np.int64), xfer=xfer)
        return ir.replace(schedule=s, program=None)
