"""usp: Ulysses inside a group × zigzag ring across groups — yunchang's USP
(Fang & Zhao 2024, arXiv:2405.07719) and TransformerEngine's ``a2a+p2p``
context parallelism (survey §4.1: the hybrid that keeps Ulysses' all-to-all
on the fast links and sends only KV over the slow ones).

The ``N`` devices form ``R = N / U`` ring ranks of ``U`` devices each
(``U``, the Ulysses degree: ``ulysses=U``, by default the most devices of
one node that divide both ``kv_heads`` and ``N``, so a Ulysses group is a
node or a part of one). Outside attention the packed sequence is cut as
zigzag cuts it for ``R`` ranks (``2R`` chunks, rank ``r`` holds chunks
``r`` and ``2R − 1 − r``); each chunk is split evenly over its rank's ``U``
devices, so every device holds ``T / N`` tokens, all heads. For attention,
device ``u`` of rank ``r`` computes head group ``u`` (``kv_heads / U`` kv
heads) for all of rank ``r``'s query tokens — the Ulysses all-to-all inside
the group gathers them — against every KV block it needs, which comes from
the other ranks (the ring's traffic; ``comm{mode=p2p}`` by default sends
each needed block once from its home, which the message level coalesces
into one message per peer and phase, as TransformerEngine's ``a2a+p2p``
sends one message per peer).

Choices the papers leave open: the ring's zigzag split is over ranks (not
devices), inside a rank the chunk is split contiguously; ``U`` must divide
``N``; a ``U`` that does not divide ``kv_heads`` (given explicitly; the
default never needs it) copies every kv head as ``ulysses`` does beyond the
kv heads (``kv_copies``: ``lcm(kv_heads, U)`` must divide the query heads).
``U = 1`` is zigzag with p2p transfers,
``U = N`` is ``ulysses``. Unsupported shapes raise :class:`PlanError`
saying "not supported".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import PlanError
from ..ir.graph import hg_share
from ..ir.module import PlanIR
from ..ir.place import chunk_bounds, place_segments, zigzag_device
from .base import Pass, register
from .ulysses import kv_copies


def default_degree(devices: int, per_node: int, kv_heads: int) -> int:
    """The largest ``U ≤ per_node`` dividing ``devices`` and ``kv_heads``."""
    return max(u for u in range(1, max(1, min(per_node, kv_heads, devices)) + 1)
               if devices % u == 0 and kv_heads % u == 0)


def usp_segments(tokens: int, ranks: int, degree: int) -> tuple[np.ndarray, np.ndarray]:
    """Segment starts and devices: zigzag chunks of ``ranks`` ranks, each
    chunk split evenly over its rank's ``degree`` devices (device
    ``rank * degree + u``)."""
    b = chunk_bounds(tokens, 2 * ranks)
    lo, size = b[:-1, None], (b[1:] - b[:-1])[:, None]
    u = np.arange(degree, dtype=np.int64)[None, :]
    starts = (lo + size * u // degree).ravel()
    rank = zigzag_device(np.arange(2 * ranks), ranks)
    devices = (rank[:, None] * degree + u).ravel()
    return starts, devices


@register
@dataclass(frozen=True, slots=True)
class Usp(Pass):
    name = "usp"
    default_run = 0.0  # a kernel run per partner: its partners' data arrive far apart (comm.Overlap)
    needs = ("graph",)
    strategy = True
    tree = True  # each document's devices gather its KV: the in-node tree pays (tools/auto.py comm_variants)
    ulysses: int = 0  # Ulysses degree U (devices per group); 0: the most of one node dividing kv_heads and N

    def degree(self, ir: PlanIR) -> tuple[int, int]:
        """The Ulysses degree ``U`` and the copies of every kv head it needs."""
        n, kv, heads = ir.devices, ir.problem.kv_heads, ir.problem.heads
        if self.ulysses == 0:
            return default_degree(n, max(1, n // ir.nodes), kv), 1
        u = self.ulysses
        copies = kv_copies(kv, heads, u) if u >= 1 else None
        if u < 1 or n % u or copies is None:
            raise PlanError(f"usp: ulysses={u} is not supported with {n} devices and {heads}/{kv} heads: the "
                            f"Ulysses degree must divide the devices, and lcm(kv_heads, U) the query heads")
        return u, copies

    def apply(self, ir: PlanIR) -> PlanIR:
        # no ``segments``: auto's segment bound assumes compute where Q lives
        u, rep = self.degree(ir)
        starts, devices = usp_segments(ir.problem.tokens, ir.devices // u, u)
        # compute block (tile, hg) on device hg of the rank that holds its Q block
        return place_segments(ir, starts, devices, head_groups=u, kv_rep=rep,
                              compute=lambda g, home: (home[g.cb_q] // u) * u + hg_share(g, u)[g.cb_hg])
