"""ulysses: head-split context parallelism (DeepSpeed-Ulysses, Jacobs et al.
2023, arXiv:2309.14509; survey §4.1).

Outside attention every device holds an even, contiguous share of the packed
sequence (``T / N`` tokens, all heads). For attention the layout is turned
around: device ``h`` computes the *whole* packed sequence for its head group
``h`` — ``kv_heads / N`` kv heads and their ``heads / N`` query heads — so the
attention work of every device is exactly ``1 / N`` of the total on any mask.
The price is moving (almost) everything: the Q and KV of every token block go
to every other head-group device and the partial O comes back, the
all-to-all of Ulysses (``(N − 1) / N`` of Q, KV and O cross the network).

The pass re-tiles the graph with ``N`` head groups (one per device) and at
the ``N − 1`` boundaries of the even token split, homes token block ``tb`` on
the device whose contiguous share holds it, and places compute block
``(tile, hg)`` on device ``hg``. The ``comm`` pass then derives the
transfers; our transfer model sends them point-to-point per (token block,
head group), which a runtime may batch into one ``all_to_all_single`` per
phase and kind.

Head split needs ``N ≤ kv_heads``: a kv head cannot be split further (the
survey: cp ≤ num_kv_heads). With ``N`` not dividing ``kv_heads`` the groups
are uneven and the compute imbalance is ``ceil(K/N) / (K/N)``; DeepSpeed
requires the heads to divide evenly, and so does this pass unless
``uneven=true`` (then ``build_graph``'s near-even head split is used).
Unsupported shapes raise :class:`PlanError` saying "not supported".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import PlanError
from ..ir.module import PlanIR
from ..ir.placement import chunk_bounds, place_segments
from .base import Pass, register


@register
@dataclass(frozen=True, slots=True)
class Ulysses(Pass):
    name = "ulysses"
    needs = ("graph",)
    strategy = True
    uneven: bool = False  # allow N not dividing kv_heads (uneven head groups, imbalance ceil(K/N)/(K/N))

    def apply(self, ir: PlanIR) -> PlanIR:
        n, kv = ir.devices, ir.problem.kv_heads
        if n > kv:
            raise PlanError(f"ulysses: {n} devices with {kv} kv heads is not supported: head split needs "
                            f"devices <= kv_heads (each device computes at least one whole kv head)")
        if kv % n and not self.uneven:
            raise PlanError(f"ulysses: {kv} kv heads over {n} devices is not supported: kv_heads must be a "
                            f"multiple of devices (or pass ulysses{{uneven=true}} for uneven head groups)")
        # contiguous shares homed in device order; head group h computed on device h
        bounds = chunk_bounds(ir.problem.tokens, n)
        return place_segments(ir, bounds[:-1], np.arange(n), head_groups=n, compute=lambda g, home: g.cb_hg)
