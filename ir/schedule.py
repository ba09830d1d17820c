"""Schedule: which stage each compute block runs in and which forward
transfers feed it. Backward transfers follow from the forward ones (see
:mod:`attnplan.passes.emit`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .program import BWD

if TYPE_CHECKING:
    from .graph import BlockGraph
    from .placement import Placement

# forward transfer kinds
X_Q, X_KV, X_O = 0, 1, 2
XFER_KIND_NAMES = ("Q", "KV", "O")
# columns of Schedule.xfer
XK, XTB, XHG, XSRC, XDST, XSTAGE = range(6)


@dataclass(frozen=True, slots=True, eq=False)
class Schedule:
    """``cb_stage[cb]``: stage of each compute block. ``xfer``: int64 ``[n, 6]``
    rows ``(kind, tb, hg, src, dst, stage)``: Q and KV blocks move from their
    home to a computing device before ``stage``; partial O blocks move from a
    computing device to the home after ``stage``."""

    stages: int
    cb_stage: np.ndarray
    xfer: np.ndarray
    overlap: bool = False  # post stage s+1 transfers during stage s; send partials when final
    collective: bool = False  # comm{mode=a2a}: one stage, no overlap; each phase's data and its partials are one
    #                           all-to-all each (the runtime runs them as all_to_all_single, runtime/dist.py)
    reduce: bool = False  # comm{reduce=node}: partials bound for another node are summed inside their node first,
    #                       then cross once per (block, node) (emit derives the routes, passes/comm.reduce_rows)
    run_flops: float = 0.0  # overlap{run=F}: a device's blocks for remote partners share one kernel run (waits
    #                         before it, partial sends after it) until the remote work before a partner's blocks
    #                         reaches another multiple of F (0: a run per partner; passes/emit.compute_runs)
    local_last: bool = False  # overlap{local=last}: in the backward a device runs its blocks that need nothing
    #                           remote after all its others, in its last stage, so its partials travel while it
    #                           computes its own (phase_schedule below)

    def __post_init__(self):
        self.cb_stage.setflags(write=False)
        self.xfer.setflags(write=False)

    def to_text(self, limit: int = 40) -> str:
        lines = [f"schedule stages={self.stages} transfers={len(self.xfer)} overlap={self.overlap}"
                 + (" collective=True" if self.collective else "") + (" reduce=node" if self.reduce else "")
                 + (f" run={self.run_flops:g}" if self.run_flops else "")
                 + (" local=last" if self.local_last else "")]
        for k, tb, hg, s, d, st in self.xfer[:limit].tolist():
            lines.append(f"  stage {st}: {XFER_KIND_NAMES[k]}[tb{tb},hg{hg}] d{s} -> d{d}")
        if len(self.xfer) > limit:
            lines.append(f"  ... ({len(self.xfer)} transfers)")
        return "\n".join(lines)


def phase_schedule(g: BlockGraph, pl: Placement, s: Schedule, phase: int) -> Schedule:
    """The schedule a phase's program follows: ``s``, except in the
    backward under ``s.local_last``, where the blocks needing nothing remote
    run in the last stage, after every other block
    (:func:`attnplan.passes.emit.compute_order`): a device's partial outputs
    leave before its own work, which then hides their flight (the forward
    keeps them first: its partials are few and its local blocks hide the
    first data's). The verifier checks every program against it."""
    if phase != BWD or not s.local_last:
        return dataclasses.replace(s, local_last=False) if s.local_last else s
    return dataclasses.replace(s, cb_stage=np.where(own_blocks(g, pl), s.stages - 1, s.cb_stage))


def own_blocks(g: BlockGraph, pl: Placement) -> np.ndarray:
    """Per compute block: whether it needs nothing remote (its Q and KV are homed on its device)."""
    return (pl.home[g.cb_q] == pl.cb_device) & (pl.home[g.cb_k] == pl.cb_device)
