"""Schedule: which stage each compute block runs in and which forward
transfers feed it. Backward transfers follow from the forward ones (see
:mod:`attnplan.passes.emit`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
    #                           computes its own (passes/emit.phase_schedule)

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
