"""per_doc: per-document zigzag (WLB-LLM's per-document sharding,
TransformerEngine's THD context parallelism).

Every document (sample) of length ``L`` is cut into ``2N`` chunks; device
``i`` holds chunks ``i`` and ``2N-1-i`` of every document, so under a causal
mask each device gets one light and one heavy chunk of each document and the
attention work is balanced document by document, not only in expectation as
with whole-sequence zigzag. Nothing is padded: chunks have ``L // 2N``
tokens, and the ``L mod 2N`` remainder tokens add one token to chunks chosen
round-robin over the 2N slots ``(device 0 front, ..., device N-1 front,
device 0 back, ..., device N-1 back)``, the cursor carrying on from one
document to the next. Consecutive extras land on consecutive devices, so over
the whole batch the token counts of any two devices differ by at most one.
Compute runs where Q lives; KV travels (``comm`` moves only what is needed).

Chunk ``c`` of every document lives on one device and plays the same part
in each (a column of the chunk table): the chunks of a column are one varlen
group (:mod:`attnplan.ir.groups`; ``varlen`` > 0 caps a group's tokens), one
token block and one compute block per column pair — what TransformerEngine's
THD attention runs as one varlen kernel call per ring step — instead of a
block per chunk and a tile per (document, chunk pair). Under a causal or full
mask the tiles are relations (:mod:`attnplan.ir.relation`): no piece per
(document, chunk pair) is ever listed, so thousands of documents on hundreds
of devices plan in seconds.

The cost (WLB-LLM §3, Libra §3.3): short documents become chunks far shorter
than the kernel's 128-row query tile, which a real kernel pays as whole
tiles; ``stats()["kernel_work_ratio"]`` measures that waste.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import PlanError
from ..ir.module import PlanIR
from ..ir.groups import group_limit
from ..ir.place import place_segments
from .base import Pass, register


def per_doc_chunks(seqlens: np.ndarray, devices: int) -> tuple[np.ndarray, np.ndarray]:
    """Chunk sizes ``[docs, 2N]`` and the device of each chunk column ``[2N]``.

    Column ``c`` is chunk ``c`` of its document, held by device ``c`` for
    ``c < N`` and ``2N-1-c`` otherwise. Sizes are ``L // 2N`` plus one for the
    remainder tokens, placed round-robin (see the module doc)."""
    n, m = devices, 2 * devices
    lens = np.asarray(seqlens, np.int64)
    base, rem = lens // m, lens % m
    cursor = (np.cumsum(rem) - rem) % m  # round-robin position where each document's extras start
    col = np.arange(m)
    # slot of each chunk column: fronts are slots 0..N-1, backs slots N..2N-1, both in device order
    dev = np.where(col < n, col, m - 1 - col)
    slot = np.where(col < n, col, n + dev)
    extra = ((slot[None, :] - cursor[:, None]) % m) < rem[:, None]
    return base[:, None] + extra, dev


@register
@dataclass(frozen=True, slots=True)
class PerDoc(Pass):
    """Per-document zigzag: chunks ``i`` and ``2N-1-i`` of every document on device ``i``."""

    name = "per_doc"
    needs = ("graph",)
    strategy = True
    tree = True  # each document's devices gather its KV: the in-node tree pays (tools/auto.py comm_variants)
    varlen: int = -1  # tokens per varlen group of chunks: -1 no cap (a group per column), 0 no groups

    def __post_init__(self):
        if self.varlen < -1:
            raise PlanError(f"per_doc: varlen must be -1 (no cap), 0 (no groups) or tokens, got {self.varlen}")

    def chunks(self, ir: PlanIR) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Segment starts, their devices and their chunk columns (0 .. 2N-1)."""
        p = ir.problem
        sizes, dev = per_doc_chunks(p.seqlens, ir.devices)
        starts = (p.offsets[:-1, None] + np.cumsum(sizes, axis=1) - sizes).ravel()
        chunk_dev = np.broadcast_to(dev, sizes.shape).ravel()
        col = np.broadcast_to(np.arange(sizes.shape[1]), sizes.shape).ravel()
        keep = sizes.ravel() > 0  # sorted: documents in order, chunks in order
        return starts[keep], chunk_dev[keep], col[keep]

    def segments(self, ir: PlanIR) -> tuple[np.ndarray, np.ndarray]:
        """Segment starts and their devices (what :func:`place_segments` takes)."""
        return self.chunks(ir)[:2]

    def apply(self, ir: PlanIR) -> PlanIR:
        starts, devices, col = self.chunks(ir)
        limit = group_limit(ir.need_graph(), self.varlen)
        return place_segments(ir, starts, devices, group_key=col, group_tokens=limit)
