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

Beyond the kv heads (``N > kv_heads``, the survey's cp ≤ num_kv_heads
limit) the pass replicates KV heads as yunchang's Ulysses does
(``replicate=true``, the default): every kv head is copied
``r = lcm(kv_heads, N) / kv_heads`` times (``graph.kv_rep``), so the
``kv_heads·r`` copies split evenly over the devices and each device computes
whole query heads with its own copy of their kv head. The price is in the
plan: each copy is a KV block of its own, moved and stored as such (the
all-to-all carries ``r``× the KV), and the runtime expands ``k``/``v`` to
the copies on entry (their gradients sum back). It needs ``heads`` a multiple
of ``N``. With ``N ≤ kv_heads`` not dividing ``kv_heads`` the groups are
uneven and the compute imbalance is ``ceil(K/N) / (K/N)``; DeepSpeed
requires the heads to divide evenly, and so does this pass unless
``uneven=true`` (then ``build_graph``'s near-even head split is used).
Unsupported shapes raise :class:`PlanError` saying "not supported".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import PlanError
from ..ir.graph import hg_share
from ..ir.module import PlanIR
from ..ir.place import chunk_bounds, place_segments
from .base import Pass, register


def kv_copies(kv_heads: int, heads: int, n: int) -> int | None:
    """The fewest copies ``r`` of every kv head for ``n`` even head groups of
    whole query heads: ``kv_heads·r = lcm(kv_heads, n)``, which must divide
    ``heads``; ``None`` when it does not."""
    virtual = math.lcm(kv_heads, n)
    return virtual // kv_heads if heads % virtual == 0 else None


@register
@dataclass(frozen=True, slots=True)
class Ulysses(Pass):
    name = "ulysses"
    needs = ("graph",)
    strategy = True
    uneven: bool = False  # allow N not dividing kv_heads (uneven head groups, imbalance ceil(K/N)/(K/N))
    replicate: bool = True  # N > kv_heads: copy each kv head lcm(kv_heads, N) / kv_heads times (yunchang)

    def apply(self, ir: PlanIR) -> PlanIR:
        n, kv, heads = ir.devices, ir.problem.kv_heads, ir.problem.heads
        rep = 1
        if n > kv:
            if not self.replicate:
                raise PlanError(f"ulysses: {n} devices with {kv} kv heads is not supported with replicate=false: "
                                f"head split needs devices <= kv_heads (or KV-head replication)")
            copies = kv_copies(kv, heads, n)
            if copies is None:
                raise PlanError(f"ulysses: {n} devices with {heads} query heads is not supported: each device "
                                f"computes whole query heads (heads must be a multiple of devices)")
            rep = copies
        elif kv % n and not self.uneven:
            raise PlanError(f"ulysses: {kv} kv heads over {n} devices is not supported: kv_heads must be a "
                            f"multiple of devices (or pass ulysses{{uneven=true}} for uneven head groups)")
        # contiguous shares homed in device order; head group h computed on device h
        bounds = chunk_bounds(ir.problem.tokens, n)
        return place_segments(ir, bounds[:-1], np.arange(n), head_groups=n, kv_rep=rep,
                              compute=lambda g, home: hg_share(g, n)[g.cb_hg])
