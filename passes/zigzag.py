"""zigzag: the ring-attention baseline. The packed sequence is cut into 2N
equal chunks (the first T mod 2N chunks one token longer); device i holds
chunks i and 2N-1-i. Compute runs where Q lives; KV travels — by default
around the ring (``comm{mode=ring}``), as deployed; ``comm{mode=p2p}`` sends
only what each device needs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir.graph import build_graph
from ..ir.module import PlanIR
from ..ir.placement import Placement
from .base import Pass, register


def chunk_bounds(tokens: int, chunks: int) -> np.ndarray:
    """``chunks + 1`` boundaries of an even split of ``[0, tokens)`` (sizes differ
    by at most one; chunks are empty when ``chunks > tokens``)."""
    return (np.arange(chunks + 1, dtype=np.int64) * tokens) // chunks


def zigzag_device(chunk, n: int) -> np.ndarray:
    """Device of zigzag chunk ``chunk`` of 2n: chunk j on device j, or 2n-1-j in the second half."""
    chunk = np.asarray(chunk, dtype=np.int64)
    return np.where(chunk < n, chunk, 2 * n - 1 - chunk)


@register
@dataclass(frozen=True, slots=True)
class Zigzag(Pass):
    name = "zigzag"
    needs = ("graph",)
    strategy = True
    default_comm = "ring"  # what ring-flash-attn / TransformerEngine run today

    def apply(self, ir: PlanIR) -> PlanIR:
        g, n = ir.graph, ir.devices
        bounds = chunk_bounds(ir.problem.tokens, 2 * n)
        g = build_graph(ir.problem, np.concatenate([g.tb_start, bounds]), g.n_hg)
        chunk = np.searchsorted(bounds, g.tb_start, "right") - 1
        home = zigzag_device(chunk, n)
        pl = Placement(devices=n, nodes=ir.nodes, home=home, cb_device=home[g.cb_q].copy())
        return ir.replace(graph=g, placement=pl, schedule=None, program=None)
