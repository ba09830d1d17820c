"""The memory a device's stream needs, read off its program.

The program states every buffer's size (its row of the buffer table,
:func:`attnplan.ir.program.buffer_bytes`) and, through the instructions that
name it, its lifetime. The runner (:mod:`attnplan.runtime.runner`) binds home
buffers to the caller's tensors for the whole stream and creates every other
buffer at the first instruction that names it (a receive, a kernel's partial
output, a merge or add into an empty buffer), dropping it after its last one
(a KV block the backward keeps lives to the end of the forward, and in the
backward from its start).
:func:`stream_peak` replays exactly that on the buffer table: the most bytes
of buffers alive at once, which the verifier's per-device sum of every
buffer (invariant 6) bounds from above. Kernel workspace (a tile's partial
output before it is merged, the gathered operands of a varlen launch) comes on
top; the GPU check measures it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir.program import BBYTES, BROLE, FWD, HOME, KEPT
from .runner import _last_use, _message_buffers, first_use, kept_sources


@dataclass(frozen=True)
class StreamMemory:
    """Bytes of one device's stream: ``home`` (bound all along), ``peak`` (home
    plus the most transient buffers alive at once) and ``total`` (every buffer:
    the verifier's bound)."""

    home: int
    peak: int
    total: int


def stream_peak(program, phase: int, device: int) -> StreamMemory:
    """The buffer bytes of ``device``'s ``phase`` stream (module doc)."""
    code = program.code[phase][device]
    bufs = program.buffers[phase][device]
    nbytes = bufs[:, BBYTES].astype(np.int64)
    home = bufs[:, BROLE] == HOME
    if not len(code):
        return StreamMemory(int(nbytes[home].sum()), int(nbytes[home].sum()), int(nbytes.sum()))
    msg = _message_buffers(program, phase, device, code)
    first, last = first_use(code, len(bufs), msg), _last_use(code, len(bufs), msg)
    if phase == FWD:  # what the backward keeps lives to the end of the forward ...
        last[kept_sources(program, device)] = len(code) - 1
    first[bufs[:, BROLE] == KEPT] = 0  # ... and from the start of the backward
    used = ~home & (first >= 0)
    delta = np.zeros(len(code) + 1, np.int64)
    np.add.at(delta, first[used], nbytes[used])
    np.add.at(delta, last[used] + 1, -nbytes[used])
    transient = int(np.cumsum(delta).max(initial=0))
    h = int(nbytes[home].sum())
    return StreamMemory(h, h + transient, int(nbytes.sum()))
