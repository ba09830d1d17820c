"""hypergraph: DCP's placement by hypergraph partitioning (Mt-KaHyPar).

The block graph becomes a hypergraph (DCP, SOSP'25, §3.2 of the survey):

* vertices: every compute block (weight: its pairs × query heads, i.e. its
  FLOPs) and every token block (its data: Q, KV and O of all head groups,
  which share one home; weight: its tokens);
* nets: one per data block and side — ``(tb, hg, Q)`` joins the token block
  with every compute block that reads that Q (and so writes that O),
  ``(tb, hg, KV)`` with every compute block that reads that KV. A net's weight
  is the bytes one more device using it costs under ``comm{mode=p2p}``
  (Q side: Q + partial O forward, Q bundle + partial dQ backward; KV side: KV
  forward, KV + partial dKV backward), so the connectivity−1 (km1) objective
  of a partition *is* the plan's ``comm_bytes_total``.

Mt-KaHyPar minimizes km1 under a (1+ε) bound on one vertex weight. Two bounds
are wanted — compute ≤ (1+eps)·mean per device and tokens ≤ (1+mem_eps)·mean
— and they cannot be one weight: compute grows with the square of a
document's length, tokens linearly, so a device balanced in one is not in the
other. Compute is what the partitioner balances; tokens are repaired around
it. Per level, on the level's clusters (below):

1. partition with compute weights only (token vertices weigh 1, so they go
   wherever their users are, which is what minimizes traffic);
2. token repair, first by whole samples: while a part holds more than its
   token cap, move a sample lying wholly on it (closed: no net leaves it, so
   no byte changes) to the part with token room whose compute overflows
   least; then, if still needed, single token blocks (homes), fewest added
   bytes per token first;
3. compute repair: while a part is over its compute cap, move the compute
   vertex that adds the fewest bytes per unit of work to a part with room
   (a vertex that homes tokens — a whole short sample — only where they fit);
4. if anything moved, warm start: one Mt-KaHyPar V-cycle from the repaired
   partition with every home *fixed*, so compute follows the homes (then
   step 3 again); keep whichever of the two moves fewer bytes.

Step 4 used to be a second partition from scratch with the homes fixed; the
V-cycle skips initial partitioning and costs a fifth of it, and over the
shared batches it finds as many bytes (either wins about as often).

Repairs use the exact int64 pairs, tokens and bytes; Mt-KaHyPar gets them
scaled to int32. Step 3 always reaches the cap when no compute vertex
exceeds the slack (a vertex moved to the least-loaded part lands under the
cap), which the granularity rule below provides; otherwise it still lowers
the maximum. Token caps are best effort at token-block granularity.

Clusters (:func:`~.hypergraph_build.coarsen`; planning 1,048,576 tokens on 64
devices in seconds, issue 9): Mt-KaHyPar's time grows with its vertices and
pins, not with the work, and the block graph of a long-tailed batch has most
of its blocks in a few long documents, each tile far below the slack. A
level with more than ``_SMALL`` vertices per part is partitioned on clusters:
a short sample no net leaves, whose work fits ``coarsen × slack``, is one
vertex (placing it whole costs no byte); in the other samples ``m × m``
neighbouring tiles of one head group are one vertex, ``m`` the largest side
that fits ``coarsen × slack``; token blocks stay single. A net spans the same
parts on the clusters as on their blocks, so km1 on the clusters is exactly
the plan's traffic of the expanded partition. Clusters are kept to at least
``_MIN_CLUSTERS`` per part (the grain shrinks until there are). Where a
cluster was too coarse for a repair (work above the cap left by a cluster
heavier than the slack; a short sample's tokens that fit no part whole), the
repair finishes on the single blocks after expansion. Mt-KaHyPar runs its
DETERMINISTIC preset with a lower contraction limit and one initial
partitioning run (:data:`~.hypergraph_build._FAST`).

Measured (benchmarks/hypergraph_bench.py; this 2-core machine, load ≈ 4;
before = the pass without clusters, with the full preset and a second
partition in step 4): 1,048,576 tokens (lmsys-512k-0 + libra-512k-0) on 64
devices, the whole compile with the verifier, 23.6 s → 1.0 s (32 devices:
46 s → 0.8 s), 15.7 → 13.2 GB moved. Over the 28 shared batches at 8 and 32
devices: bytes over ring zigzag's, causal, median 0.111 → 0.118, worst
0.457 → 0.461; total bytes causal −2%, streaming(64,4096) −10%,
shared_question(4,0.2) +1%; compute imbalance ≤ 1.05 on every batch × device
count × builtin mask (504 plans).

Hierarchical, as DCP: first across nodes (caps ``1+eps/4`` of a node's
compute share and ``1+mem_eps/4`` of its tokens, less where blocks would not
pack, so each node keeps slack for its devices), then, per node, across its
devices on the sub-hypergraph of that node's vertices (a net's pins on
other nodes only add a constant there). Devices of node ``n`` are
``n·dpn .. n·dpn+dpn-1``.

Granularity (see :func:`refine`): a compute block larger than the slack
cannot be balanced, and a document spread over many devices moves more KV
than two half-head copies of it spread over half as many. With ``block=0``
the pass raises the head groups up to the devices its largest document
needs (divisors of the kv heads), then cuts token blocks until no compute
block exceeds ``grain × mean device load`` (``grain=0``: the slack, ``eps``
on one node, ``3/4·eps`` on several), never below ``min_block`` tokens (a
kernel tile). Tiny or degenerate hypergraphs (fewer than two compute blocks
per part, no nets) get a deterministic greedy (largest block first onto the
least-loaded part) followed by the same repairs.

Deterministic: the DETERMINISTIC preset (the only one that gives the same
partition twice; it gives the same partition on 1 and 2 threads, and it
ignores ``mtkahypar.set_seed``, so ``seed`` relabels the vertices instead),
and every tie broken by index.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import PlanError
from ..ir.graph import BlockGraph, build_graph
from ..ir.module import PlanIR
from ..ir.placement import Placement
from .base import Pass, register
from .hypergraph_build import (_Hyper, build_hypergraph, closed_samples, coarsen, kahypar_partition,
                               scaled_weights, side_bytes)

__all__ = ["HypergraphPlacement", "build_hypergraph", "coarsen", "refine", "side_bytes", "solve_level"]


# --------------------------------------------------------------------------- levels

# a level with at most _SMALL vertices per part is partitioned as it is
# (Mt-KaHyPar takes well under 0.1 s there); a larger one is clustered, to no
# fewer than _MIN_CLUSTERS compute clusters per part (Mt-KaHyPar needs some
# choice per part to find cheap cuts)
_SMALL = 128
_MIN_CLUSTERS = 24


class _Level:
    """The sub-hypergraph of some vertices, partitioned into ``k`` parts, with
    the per-(net, part) pin counts the repairs keep up to date."""

    def __init__(self, h: _Hyper, verts: np.ndarray, k: int):
        self.k = k
        self.verts = verts                                   # global vertex ids, sorted
        local = np.full(h.n, -1, np.int64)
        local[verts] = np.arange(len(verts))
        keep = local[h.pin_vtx] >= 0
        net_g, vtx = h.pin_net[keep], local[h.pin_vtx[keep]]
        nets, net = np.unique(net_g, return_inverse=True)    # local nets with at least one pin
        self.net_w = h.net_w[nets]
        self.pin_net, self.pin_vtx = net, vtx                # sorted by net
        order = np.argsort(vtx, kind="stable")               # vertex -> nets CSR
        self.vn = net[order]
        self.vptr = np.concatenate([[0], np.cumsum(np.bincount(vtx, minlength=len(verts)))]).astype(np.int64)
        self.work = h.work[verts]
        self.tokens = h.tokens[verts]
        self.is_cb = verts < h.n_cb
        # closed samples: every net touching them joins only their own vertices,
        # so moving one whole (all on one part) changes no net's span
        _, self.sample = np.unique(h.sample[verts], return_inverse=True)
        ns = int(self.sample.max(initial=-1)) + 1
        self.closed = closed_samples(self.pin_net, self.sample[self.pin_vtx], ns)
        self.s_tokens = np.bincount(self.sample, weights=self.tokens, minlength=ns).astype(np.int64)
        self.s_work = np.bincount(self.sample, weights=self.work, minlength=ns).astype(np.int64)

    # objective ---------------------------------------------------------------
    def counts(self, part: np.ndarray) -> np.ndarray:
        """Pins of every net on every part, ``[n_net, k]``."""
        k = self.k
        flat = np.bincount(self.pin_net * k + part[self.pin_vtx], minlength=len(self.net_w) * k)
        return flat.reshape(len(self.net_w), k).astype(np.int64)

    def cost(self, part: np.ndarray) -> int:
        """Σ net bytes × (parts it spans − 1): the p2p bytes of this level."""
        lam = (self.counts(part) > 0).sum(1)
        return int((self.net_w * np.maximum(lam - 1, 0)).sum())

    # Mt-KaHyPar --------------------------------------------------------------
    def kahypar(self, eps: float, seed: int, fixed: np.ndarray | None,
                start: np.ndarray | None = None) -> np.ndarray | None:
        """Partition with Mt-KaHyPar (km1, deterministic), or improve ``start``
        by one V-cycle; None where the hypergraph is too small or degenerate.
        Mt-KaHyPar runs its DETERMINISTIC preset with less initial partitioning
        (:data:`~.hypergraph_build._FAST`)."""
        if int(self.is_cb.sum()) < 2 * self.k:
            return None
        return kahypar_partition(self.pin_net, self.pin_vtx, self.net_w, scaled_weights(self.work, self.is_cb),
                                 self.k, eps, seed, fixed, start, fast=True)

    def greedy(self) -> np.ndarray:
        """Largest compute block first onto the least-loaded part; each token
        block where most of its users are (else on the part with fewest tokens)."""
        part = np.zeros(len(self.verts), np.int64)
        load = np.zeros(self.k, np.int64)
        cbs = np.flatnonzero(self.is_cb)
        for v in cbs[np.argsort(-self.work[cbs], kind="stable")].tolist():
            p = int(np.argmin(load))
            part[v] = p
            load[p] += self.work[v]
        # users[v, p]: bytes of the nets of token vertex v whose compute pins lie on part p
        data = np.full(len(self.net_w), -1, np.int64)
        dp = ~self.is_cb[self.pin_vtx]
        data[self.pin_net[dp]] = self.pin_vtx[dp]
        cp = ~dp & (data[self.pin_net] >= 0)
        users = np.bincount(data[self.pin_net[cp]] * self.k + part[self.pin_vtx[cp]],
                            weights=self.net_w[self.pin_net[cp]],
                            minlength=len(self.verts) * self.k).reshape(len(self.verts), self.k)
        tok = np.zeros(self.k, np.int64)
        for v in np.flatnonzero(~self.is_cb).tolist():
            p = int(np.argmax(users[v])) if users[v].any() else int(np.argmin(tok))
            part[v] = p
            tok[p] += self.tokens[v]
        return part

    # repairs -------------------------------------------------------------------
    def repair(self, part: np.ndarray, movable: np.ndarray, x: np.ndarray, cap: int,
               token_cap: int | None = None) -> int:
        """Move ``movable`` vertices (weights ``x``, indexed by vertex) off parts
        above ``cap`` until none is, cheapest added bytes per unit of weight
        first; a move lands a part at most at ``cap``, or, where no such move
        exists, strictly below the source's load (so Σ load² falls and the loop
        ends). With ``token_cap``, a vertex that homes tokens (a whole sample's
        cluster) only moves to a part whose tokens stay within it. Returns the
        number of moves; ``part`` is updated in place."""
        k = self.k
        load = np.bincount(part[movable], weights=x[movable], minlength=k).astype(np.int64)
        if load.max(initial=0) <= cap:
            return 0
        cnt = self.counts(part)
        tok = np.bincount(part, weights=self.tokens, minlength=k).astype(np.int64)
        moves = 0
        for _ in range(4 * len(movable) + 16):
            o = int(np.argmax(load - cap))
            if load[o] <= cap:
                break
            cand = movable[part[movable] == o]
            if not len(cand):
                break
            lo, deg = self.vptr[cand], self.vptr[cand + 1] - self.vptr[cand]
            first = np.cumsum(deg) - deg
            owner = np.repeat(np.arange(len(cand)), deg)
            nets = self.vn[np.arange(int(deg.sum())) - np.repeat(first, deg) + lo[owner]]
            w = self.net_w[nets].astype(np.float64)
            rem = np.bincount(owner, weights=w * (cnt[nets, o] == 1), minlength=len(cand))
            # bytes a move to each part adds: Σ over the vertex's nets absent there
            add = np.zeros((len(cand), k))
            some = deg > 0
            if some.any():
                add[some] = np.add.reduceat((cnt[nets] == 0) * w[:, None], first[some], axis=0)
            xc = x[cand].astype(np.int64)
            delta = add - rem[:, None]
            room = np.ones((len(cand), k), bool)
            if token_cap is not None:
                tc = self.tokens[cand]
                room = (tc[:, None] == 0) | (tok[None, :] + tc[:, None] <= token_cap)
            ok = (load[None, :] + xc[:, None] <= cap) & room
            ok[:, o] = False
            if not ok.any():
                ok = (load[None, :] + xc[:, None] < load[o]) & room
                ok[:, o] = False
                if not ok.any():
                    break
            score = np.where(ok, delta / np.maximum(xc, 1)[:, None], np.inf)
            i, e = np.unravel_index(int(np.argmin(score)), score.shape)
            v = int(cand[i])
            part[v] = e
            load[o] -= xc[i]
            load[e] += xc[i]
            tok[o] -= self.tokens[v]
            tok[e] += self.tokens[v]
            vn = self.vn[self.vptr[v]:self.vptr[v + 1]]
            cnt[vn, o] -= 1
            cnt[vn, e] += 1
            moves += 1
        return moves

    def move_samples(self, part: np.ndarray, token_cap: int, work_cap: int) -> int:
        """Token repair by whole samples: while a part is above ``token_cap``,
        move a closed sample lying wholly on it (no byte changes) to a part
        whose tokens stay under the cap, the one whose compute overflows least
        per token moved (the compute repair pays for the overflow later)."""
        k, ns = self.k, len(self.closed)
        tok = np.bincount(part, weights=self.tokens, minlength=k).astype(np.int64)
        work = np.bincount(part, weights=self.work, minlength=k).astype(np.int64)
        moves = 0
        for _ in range(ns + 1):
            o = int(np.argmax(tok - token_cap))
            if tok[o] <= token_cap:
                break
            away = np.bincount(self.sample, weights=part != o, minlength=ns)
            cand = np.flatnonzero(self.closed & (away == 0) & (self.s_tokens > 0))
            if not len(cand):
                break
            t, w = self.s_tokens[cand], self.s_work[cand]
            ok = tok[None, :] + t[:, None] <= token_cap
            ok[:, o] = False
            if not ok.any():
                break
            over = np.maximum(0, work[None, :] + w[:, None] - work_cap) / t[:, None]
            score = np.where(ok, over - 1e-12 * t[:, None], np.inf)
            i, e = np.unravel_index(int(np.argmin(score)), score.shape)
            part[self.sample == cand[i]] = e
            tok[o] -= t[i]
            tok[e] += t[i]
            work[o] -= w[i]
            work[e] += w[i]
            moves += 1
        return moves

    def solve(self, eps_kahypar: float, work_cap: int, token_cap: int, seed: int) -> np.ndarray:
        """Steps 1–4 of the module docstring; the part of every local vertex."""
        if self.k == 1:
            return np.zeros(len(self.verts), np.int64)
        cbs, tbs = np.flatnonzero(self.is_cb), np.flatnonzero(~self.is_cb)
        part = self.kahypar(eps_kahypar, seed, None)
        fresh = part is not None
        if part is None:
            part = self.greedy()
        moved = self.move_samples(part, token_cap, work_cap)
        moved += self.repair(part, tbs, self.tokens, token_cap)
        moved += self.repair(part, cbs, self.work, work_cap, token_cap)
        cands = [part]
        if moved and fresh:
            # every home stays where the repairs put it; compute follows them
            again = self.kahypar(eps_kahypar, seed, np.where(self.tokens > 0, part, -1), part)
            if again is not None:
                self.repair(again, cbs, self.work, work_cap, token_cap)
                cands.append(again)
        costs = [self.cost(p) for p in cands]
        return cands[int(np.argmin(costs))]


def solve_level(h: _Hyper, verts: np.ndarray, k: int, grain: float, eps_kahypar: float, work_cap: int,
                token_cap: int, seed: int) -> np.ndarray:
    """The part of every vertex of ``verts`` (sorted global ids) at one level:
    solve on its clusters (:func:`coarsen`, clusters up to ``grain`` work),
    expand; where a cluster was too coarse for a repair (a sample's tokens
    that fit no part whole, work above ``work_cap`` left by clusters heavier
    than the slack), the repairs finish on the single blocks."""
    if len(verts) <= _SMALL * k:
        grain = 0.0                                       # small enough for Mt-KaHyPar as it is
    hc, cluster = coarsen(h, verts, grain)
    tries = 0
    while hc.n_cb < _MIN_CLUSTERS * k and hc.n < len(verts):
        tries += 1                                        # too few to partition well: halve the cluster side,
        grain = grain / 4 if tries < 5 else 0.0           # at last take the blocks themselves
        hc, cluster = coarsen(h, verts, grain)
    part = _Level(hc, np.arange(hc.n), k).solve(eps_kahypar, work_cap, token_cap, seed)[cluster]
    if k > 1 and hc.n < len(verts):
        tok = np.bincount(part, weights=h.tokens[verts], minlength=k)
        load = np.bincount(part, weights=h.work[verts], minlength=k)
        if tok.max(initial=0) > token_cap or load.max(initial=0) > work_cap:
            fine = _Level(h, verts, k)
            fine.repair(part, np.flatnonzero(~fine.is_cb), fine.tokens, token_cap)
            fine.repair(part, np.flatnonzero(fine.is_cb), fine.work, work_cap)
    return part


# --------------------------------------------------------------------------- granularity

def _max_group_heads(kv_heads: int, n_hg: int, group: int) -> int:
    return -(-kv_heads // n_hg) * group


def refine(ir: PlanIR, g: BlockGraph, mean: float, limit: float, block: int, min_block: int,
           head_groups: int) -> BlockGraph:
    """The graph the partitioner works on.

    Head groups (``head_groups=0``): a document whose work needs ``s``
    devices gets up to ``s`` head groups (divisors of the kv heads), so each
    group's copy of the document spreads over fewer devices and needs less
    of its KV from elsewhere (2 groups vs 1, bytes over ring zigzag's:
    0.519 → 0.457 on libra-128k-0 at 8 devices, 0.346 → 0.300 on
    longalign-128k-0 at 32) — and more if a compute block would still exceed
    ``limit`` (pairs × heads). Tokens: with
    ``block > 0`` every token block is cut to at most ``block`` tokens; else
    the token blocks of tiles still above ``limit`` are cut evenly, never
    below ``min_block`` tokens."""
    p = ir.problem
    n_hg = head_groups or g.n_hg
    lens = g.tb_len
    big = int(g.tile_pairs.max(initial=0))
    if not head_groups:
        divs = [d for d in range(n_hg, p.kv_heads + 1) if p.kv_heads % d == 0] or [n_hg]
        sample = np.searchsorted(p.offsets, g.tb_start, "right") - 1
        work = np.bincount(sample[g.tile_q], weights=g.tile_pairs, minlength=len(p.seqlens)) * p.heads
        span = math.ceil(work.max(initial=0) / max(mean, 1e-9) - 1e-9)
        # (per-head masks: the graph's head groups are cut at class changes, so n_hg may divide nothing)
        n_hg = max((d for d in divs if d <= max(span, n_hg)), default=divs[0])
        if block <= 0 and big * _max_group_heads(p.kv_heads, n_hg, p.group) > limit:
            n_hg = next((d for d in divs if d >= n_hg and big * _max_group_heads(p.kv_heads, d, p.group) <= limit),
                        divs[-1])
    if block > 0:
        pieces = -(-lens // block)
    else:
        hq = _max_group_heads(p.kv_heads, n_hg, p.group)
        over = g.tile_pairs * hq > limit
        pieces = np.ones(g.n_tb, np.int64)
        if over.any():
            b = max(min_block, math.isqrt(int(limit // hq)))
            hit = np.zeros(g.n_tb, bool)
            hit[g.tile_q[over]] = True
            hit[g.tile_k[over]] = True
            pieces = np.where(hit, np.maximum(1, -(-lens // b)), 1)
    if (pieces == 1).all() and n_hg == g.n_hg:
        return g
    owner = np.repeat(np.arange(g.n_tb), pieces)
    j = np.arange(int(pieces.sum())) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    cuts = g.tb_start[owner] + (lens[owner] * j) // pieces[owner]
    return build_graph(p, np.concatenate([g.tb_start, cuts]), n_hg)


# --------------------------------------------------------------------------- the pass

@register
@dataclass(frozen=True, slots=True)
class HypergraphPlacement(Pass):
    """DCP placement: km1 hypergraph partitioning with Mt-KaHyPar under a
    (1+eps) compute bound and a (1+mem_eps) token bound, nodes then devices."""

    name = "hypergraph"
    needs = ("graph",)
    strategy = True
    eps: float = 0.05       # every device computes at most (1+eps) × the mean FLOPs
    mem_eps: float = 0.25   # every device homes at most (1+mem_eps) × the mean tokens (token-block granularity)
    seed: int = 0           # Mt-KaHyPar's seed
    block: int = 0          # 0: refine automatically (see grain); > 0: cut token blocks to at most this
    min_block: int = 128    # automatic refinement never cuts token blocks below this (one kernel tile)
    head_groups: int = 0    # 0: the tile pass's, raised automatically when a block is too heavy
    grain: float = 0.0      # largest compute block / mean device load; 0: the balance slack
    coarsen: float = 2.0    # largest cluster Mt-KaHyPar sees / the level's balance slack; 0: single blocks

    def __post_init__(self):
        for f in ("eps", "mem_eps"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise PlanError(f"hypergraph: {f} must be a finite number >= 0, got {v!r}")
        for f in ("block", "head_groups", "seed"):
            if getattr(self, f) < 0:
                raise PlanError(f"hypergraph: {f} must be >= 0, got {getattr(self, f)}")
        if self.min_block <= 0:
            raise PlanError(f"hypergraph: min_block must be a positive integer, got {self.min_block}")
        for f in ("grain", "coarsen"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise PlanError(f"hypergraph: {f} must be a finite number >= 0, got {v!r}")

    def apply(self, ir: PlanIR) -> PlanIR:
        p, n, nodes = ir.problem, ir.devices, ir.nodes
        if self.head_groups > p.kv_heads:
            raise PlanError(f"hypergraph: head_groups={self.head_groups} exceeds kv_heads={p.kv_heads}")
        dpn = n // nodes
        node_eps = self.eps / 4 if nodes > 1 else 0.0
        mean = p.pairs() / n
        limit = (self.grain or (self.eps - node_eps)) * mean
        g = refine(ir, ir.need_graph(), mean, limit, self.block, self.min_block, self.head_groups)
        h = build_hypergraph(g)
        work_cap = math.floor((1 + self.eps) * mean)
        tok_mean = p.tokens / n
        tok_cap = math.floor((1 + self.mem_eps) * tok_mean)
        part = np.zeros(h.n, np.int64)
        if nodes > 1:
            # a node's tokens must pack into its devices at token-block granularity:
            # below dpn·(cap − largest block) the least-loaded device always has room
            node_tok = min((1 + self.mem_eps / 4) * tok_mean * dpn, dpn * (tok_cap - int(g.tb_len.max())))
            part = solve_level(h, np.arange(h.n), nodes, self.coarsen * node_eps * mean * dpn, node_eps,
                               math.floor((1 + node_eps) * mean * dpn),
                               max(math.ceil(tok_mean * dpn), int(node_tok)), self.seed)
        dev = np.zeros(h.n, np.int64)
        for node in range(nodes):
            verts = np.flatnonzero(part == node)
            if not len(verts):
                continue
            w = int(h.work[verts].sum())
            eps_local = (work_cap * dpn / w - 1) if w else self.eps
            local = solve_level(h, verts, dpn, self.coarsen * limit, min(max(eps_local, 1e-3), 10.0), work_cap,
                                tok_cap, self.seed)
            dev[verts] = node * dpn + local
        pl = Placement(devices=n, nodes=nodes, home=dev[h.n_cb:].copy(), cb_device=dev[:h.n_cb].copy())
        return ir.with_levels(graph=g, placement=pl)
