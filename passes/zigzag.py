"""zigzag: the ring-attention baseline. The packed sequence is cut into 2N
equal chunks (the first T mod 2N chunks one token longer); device i holds
chunks i and 2N-1-i. Compute runs where Q lives; KV travels — by default
around the ring (``comm{mode=ring}``), as deployed; ``comm{mode=p2p}`` sends
only what each device needs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir.module import PlanIR
from ..ir.place import chunk_bounds, place_segments, zigzag_device
from .base import Pass, register

__all__ = ["Zigzag", "chunk_bounds", "zigzag_device"]


@register
@dataclass(frozen=True, slots=True)
class Zigzag(Pass):
    name = "zigzag"
    needs = ("graph",)
    strategy = True
    default_comm = "ring"  # what ring-flash-attn / TransformerEngine run today

    def segments(self, ir: PlanIR) -> tuple[np.ndarray, np.ndarray]:
        """Segment starts and their devices (what :func:`place_segments` takes)."""
        n = ir.devices
        return chunk_bounds(ir.problem.tokens, 2 * n)[:-1], zigzag_device(np.arange(2 * n), n)

    def apply(self, ir: PlanIR) -> PlanIR:
        return place_segments(ir, *self.segments(ir))
