"""The hypergraph of the ``hypergraph`` placement, its coarsening, and the
call into Mt-KaHyPar (the design: passes/hypergraph.py's docstring).

* :func:`build_hypergraph`: DCP's hypergraph of a block graph (SOSP'25, §3.2
  of the survey) — a vertex per compute block and per token block, a net per
  data block and side whose weight is the bytes one more device using it
  costs, so km1 is the plan's p2p traffic.
* :func:`coarsen`: the vertices one level of the hierarchy partitions,
  clustered so that Mt-KaHyPar's input stays small (its time grows with
  vertices and pins, not with work). A sample that no net of the level leaves
  and whose work fits the grain becomes one vertex (placing it whole costs
  nothing); in the other samples, the compute blocks of ``m × m``
  neighbouring tiles of one head group become one vertex, ``m`` the largest
  side whose cluster still fits the grain. Other token blocks stay single
  (the token repair moves them one by one). A net's span over parts is the
  same on the clusters as on their blocks, so the coarse km1 *is* the fine
  km1 of the expanded partition; and with a grain no larger than the slack
  the compute repair still reaches its cap on the clusters (multilevel
  partitioning with a fixed first contraction: Karypis & Kumar, hMETIS,
  DAC'97; Schlag et al., KaHyPar, ALENEX'16).
* :func:`kahypar_partition`: one km1 partition, or one V-cycle improving a
  given one, with the DETERMINISTIC preset or a faster variant of it.
"""

from __future__ import annotations

import os
import tempfile
import threading
from dataclasses import dataclass

import numpy as np

from ..ir.arrays import unique
from ..ir.graph import BlockGraph
from ..ir.program import B_DKV, B_DQ, B_KV, B_O, B_Q, BWD, FWD, buffer_bytes

# Mt-KaHyPar weights are int32: scale vertex weights to about this total and
# net weights so that no km1 value can overflow.
_VERTEX_TOTAL = 1 << 24
_NET_TOTAL = 1 << 26

_INIT = None


def _initializer():
    """Mt-KaHyPar's process-wide initializer (created once; 2 threads at most)."""
    global _INIT
    if _INIT is None:
        import mtkahypar
        _INIT = mtkahypar.initialize(max(1, min(2, os.cpu_count() or 1)), False)
    return _INIT


@dataclass(frozen=True, slots=True, eq=False)
class _Hyper:
    """A hypergraph, columnar. Vertices ``0..n_cb-1`` are compute blocks (or
    clusters holding some), ``n_cb..n-1`` token blocks. ``pin_net``/``pin_vtx``
    list every pin sorted by net; ``net_w`` are exact bytes, indexed by net id;
    ``work``/``tokens`` the two vertex weights; ``sample`` the sample of each
    vertex (a compute block's is its Q block's).

    The tile coordinates, where known (``None`` otherwise, e.g. on a coarse
    hypergraph): ``qloc``/``kloc`` the Q and KV token block's index inside its
    sample (a token block: its own index, twice), ``ksample`` the KV block's
    sample, ``hg`` the head group (-1: a token block)."""

    n_cb: int
    pin_net: np.ndarray
    pin_vtx: np.ndarray
    net_w: np.ndarray
    work: np.ndarray
    tokens: np.ndarray
    sample: np.ndarray
    qloc: np.ndarray | None = None
    kloc: np.ndarray | None = None
    ksample: np.ndarray | None = None
    hg: np.ndarray | None = None

    @property
    def n(self) -> int:
        return len(self.work)


def side_bytes(g: BlockGraph) -> tuple[np.ndarray, np.ndarray]:
    """Bytes one more device using a (tb, hg) data block costs under p2p
    communication, forward + backward (KV in the forward only under
    ``keep_kv``): (Q side, KV side), each ``[n_tb, n_hg]``."""
    tb = np.repeat(np.arange(g.n_tb), g.n_hg)
    hg = np.tile(np.arange(g.n_hg), g.n_tb)
    q_side = ((FWD, B_Q), (FWD, B_O), (BWD, B_Q), (BWD, B_DQ))
    kv_side: tuple = ((FWD, B_KV), (BWD, B_KV), (BWD, B_DKV))
    if g.problem.keep_kv:  # the backward computes with the forward's copies: KV travels once
        kv_side = ((FWD, B_KV), (BWD, B_DKV))
    q = np.sum([buffer_bytes(g, ph, k, tb, hg, wire=True) for ph, k in q_side], 0)  # partials as they travel
    kv = np.sum([buffer_bytes(g, ph, k, tb, hg, wire=True) for ph, k in kv_side], 0)
    return q.reshape(g.n_tb, g.n_hg), kv.reshape(g.n_tb, g.n_hg)


def build_hypergraph(g: BlockGraph) -> _Hyper:
    """The DCP hypergraph of ``g``: net ``(tb·n_hg + hg)·2 + side`` (side 0 = Q, 1 = KV)."""
    n_cb, n_hg = g.n_cb, g.n_hg
    qb, kb = side_bytes(g)
    net_w = np.stack([qb.ravel(), kb.ravel()], 1).ravel().astype(np.int64)
    n_net = len(net_w)
    cb = np.arange(n_cb, dtype=np.int64)
    qnet = (g.cb_q * n_hg + g.cb_hg) * 2
    knet = (g.cb_k * n_hg + g.cb_hg) * 2 + 1
    data_net = np.arange(n_net, dtype=np.int64)
    data_vtx = n_cb + data_net // (2 * n_hg)
    pin_net = np.concatenate([qnet, knet, data_net])
    pin_vtx = np.concatenate([cb, cb, data_vtx])
    order = np.lexsort((pin_vtx, pin_net))
    work = np.concatenate([g.cb_pairs, np.zeros(g.n_tb, np.int64)]).astype(np.int64)
    tokens = np.concatenate([np.zeros(n_cb, np.int64), g.tb_len]).astype(np.int64)
    tb_sample = (np.searchsorted(g.problem.offsets, g.tb_start, "right") - 1).astype(np.int64)
    tb_loc = np.arange(g.n_tb, dtype=np.int64) - np.searchsorted(tb_sample, tb_sample, "left")
    sample = np.concatenate([tb_sample[g.cb_q], tb_sample])
    qloc = np.concatenate([tb_loc[g.cb_q], tb_loc])
    kloc = np.concatenate([tb_loc[g.cb_k], tb_loc])
    ksample = np.concatenate([tb_sample[g.cb_k], tb_sample])
    hg = np.concatenate([g.cb_hg, np.full(g.n_tb, -1, np.int64)]).astype(np.int64)
    return _Hyper(n_cb, pin_net[order], pin_vtx[order], net_w, work, tokens, sample, qloc, kloc, ksample, hg)


def closed_samples(pin_net: np.ndarray, pin_sample: np.ndarray, n_samples: int) -> np.ndarray:
    """Per sample: does no net (pins sorted by net) join it with another sample?"""
    if not len(pin_net):
        return np.ones(n_samples, bool)
    bound = np.flatnonzero(np.diff(np.concatenate([[-1], pin_net])))
    pure = np.minimum.reduceat(pin_sample, bound) == np.maximum.reduceat(pin_sample, bound)
    sizes = np.diff(np.concatenate([bound, [len(pin_net)]]))
    return np.bincount(pin_sample, weights=np.repeat(~pure, sizes), minlength=n_samples) == 0


def cluster_side(grain: float, heaviest: np.ndarray) -> np.ndarray:
    """Tiles per side of a cluster: the largest ``m`` with ``m² · heaviest <= grain`` (at least 1)."""
    ratio = np.where(heaviest > 0, grain / np.maximum(heaviest, 1), 1.0)
    return np.maximum(1, np.floor(np.sqrt(np.maximum(ratio, 1.0)) + 1e-9)).astype(np.int64)


def coarsen(h: _Hyper, verts: np.ndarray, grain: float) -> tuple[_Hyper, np.ndarray]:
    """Cluster the vertices ``verts`` of ``h`` (sorted global ids) into
    clusters of at most ``grain`` work, a single block aside (see the module
    docstring).
    Returns the coarse hypergraph on the clusters (global net ids, nets
    restricted to ``verts``) and the cluster of each vertex of ``verts``.
    ``grain <= 0`` or unknown tile coordinates: every vertex its own cluster."""
    n = len(verts)
    local = np.full(h.n, -1, np.int64)
    local[verts] = np.arange(n)
    keep = local[h.pin_vtx] >= 0
    pn, pv = h.pin_net[keep], local[h.pin_vtx[keep]]
    work, tokens, is_cb = h.work[verts], h.tokens[verts], verts < h.n_cb
    _, s = np.unique(h.sample[verts], return_inverse=True)
    s = s.astype(np.int64)
    ns = int(s.max(initial=-1)) + 1
    if grain <= 0 or h.qloc is None or h.kloc is None or h.ksample is None or h.hg is None:
        cluster = np.arange(n, dtype=np.int64)
        kind = (~is_cb).astype(np.int64)
    else:
        s_work = np.bincount(s, weights=work, minlength=ns)
        whole = closed_samples(pn, s[pv], ns) & (s_work <= grain)
        s_cb = np.bincount(s, weights=is_cb, minlength=ns) > 0
        tiles = is_cb & ~whole[s]
        heaviest = np.zeros(ns, np.int64)
        np.maximum.at(heaviest, s[tiles], work[tiles])
        m = cluster_side(grain, heaviest)[s]
        qloc, kloc, ks, hg = h.qloc[verts], h.kloc[verts], h.ksample[verts], h.hg[verts]
        # key columns: (kind, sample, k sample, q cluster row, k cluster column, head group, token block)
        kind = np.where(whole[s], (~s_cb[s]).astype(np.int64), (~is_cb).astype(np.int64))
        z = np.zeros(n, np.int64)
        cols = [np.where(tiles, c, z) for c in (ks, qloc // m, kloc // m, hg)]
        tok = np.where(~is_cb & ~whole[s], qloc, -1)
        key = np.stack([kind, s, *cols, tok], 1)
        order = np.lexsort(key.T[::-1])
        new = np.ones(n, bool)
        new[1:] = (key[order][1:] != key[order][:-1]).any(1)
        cluster = np.empty(n, np.int64)
        cluster[order] = np.cumsum(new) - 1
    nc = int(cluster.max(initial=-1)) + 1
    c_kind = np.zeros(nc, np.int64)
    c_kind[cluster] = kind
    # compute clusters first (kind 0), each kind in cluster order
    rank = np.empty(nc, np.int64)
    rank[np.argsort(c_kind, kind="stable")] = np.arange(nc)
    cluster = rank[cluster]
    _, first = np.unique(cluster, return_index=True)
    pins = unique(pn * nc + cluster[pv])
    return _Hyper(
        n_cb=int((c_kind == 0).sum()), pin_net=pins // nc, pin_vtx=pins % nc, net_w=h.net_w,
        work=np.bincount(cluster, weights=work, minlength=nc).astype(np.int64),
        tokens=np.bincount(cluster, weights=tokens, minlength=nc).astype(np.int64),
        sample=h.sample[verts][first],
    ), cluster


# Mt-KaHyPar's DETERMINISTIC preset option by option (Mt-KaHyPar 1.7: loaded
# from this list it prints the same configuration and gives the same
# partitions as ``PresetType.DETERMINISTIC``; ``deterministic=true`` makes
# Mt-KaHyPar refuse any non-deterministic algorithm).
_DETERMINISTIC = (
    ("mode", "direct"), ("preset-type", "deterministic"), ("deterministic", "true"),
    ("maxnet-removal-factor", "0.01"), ("smallest-maxnet-threshold", "50000"), ("maxnet-ignore", "1000"),
    ("num-vcycles", "0"), ("s-use-localized-random-shuffle", "false"), ("s-static-balancing-work-packages", "128"),
    ("p-enable-community-detection", "true"), ("p-louvain-edge-weight-function", "hybrid"),
    ("p-max-louvain-pass-iterations", "5"), ("p-louvain-min-vertex-move-fraction", "0.01"),
    ("p-vertex-degree-sampling-threshold", "200000"), ("p-louvain-low-memory-contraction", "true"),
    ("p-num-sub-rounds", "16"), ("c-type", "deterministic_multilevel_coarsener"),
    ("c-use-adaptive-edge-size", "false"), ("c-resolve-swaps", "true"), ("c-min-shrink-factor", "1.01"),
    ("c-max-shrink-factor", "2.5"), ("c-s", "1"), ("c-t", "160"), ("c-vertex-degree-sampling-threshold", "200000"),
    ("c-num-sub-rounds", "3"), ("c-rating-score", "heavy_edge"), ("c-rating-heavy-node-penalty", "no_penalty"),
    ("c-rating-acceptance-criterion", "best_prefer_unmatched"), ("i-mode", "rb"), ("i-runs", "20"),
    ("i-use-adaptive-ip-runs", "false"), ("i-perform-refinement-on-best-partitions", "false"),
    ("i-fm-refinement-rounds", "3"), ("i-lp-maximum-iterations", "20"), ("i-lp-initial-block-size", "5"),
    ("i-r-refine-until-no-improvement", "false"), ("i-r-rebalancer-type", "deterministic"),
    ("i-r-lp-type", "deterministic"), ("i-r-lp-maximum-iterations", "5"), ("i-r-sync-lp-sub-rounds", "1"),
    ("i-r-lp-he-size-activation-threshold", "100"), ("i-r-sync-lp-active-nodeset", "true"),
    ("i-r-fm-type", "do_nothing"), ("i-population-size", "64"), ("r-refine-until-no-improvement", "false"),
    ("r-rebalancer-type", "deterministic"), ("r-max-det-rebalancing-rounds", "0"),
    ("r-det-rebalancing-deadzone", "0.1"), ("r-det-rebalancing-heavy-vertex-exclusion", "1.5"),
    ("r-lp-type", "do_nothing"), ("r-lp-maximum-iterations", "5"), ("r-sync-lp-sub-rounds", "1"),
    ("r-lp-he-size-activation-threshold", "100"), ("r-sync-lp-active-nodeset", "true"),
    ("r-jet-type", "deterministic"), ("r-jet-num-iterations", "8"), ("r-jet-dynamic-rounds", "3"),
    ("r-jet-initial-negative-gain", "0.75"), ("r-jet-final-negative-gain", "0.0"), ("r-fm-type", "do_nothing"),
    ("r-flow-algo", "do_nothing"),
)

# The same with a lower contraction limit (coarsen to 20·k vertices, not
# 160·k) and one initial partitioning run (not 20), for the large levels: on
# hypergraphs of a few hundred to two thousand vertices initial partitioning
# is most of Mt-KaHyPar's time (1,048,576 tokens on 64 devices, the 18 calls
# of the hierarchy: 9.4 s → 2.6 s, km1 within a few percent either way).
_FAST = {"c-t": "20", "i-runs": "1"}

_CONTEXTS: dict[bool, object] = {}
_LOCK = threading.Lock()


def _context(fast: bool):
    """The partitioning context, made once per variant (setting k and ε per
    call gives the same partitions as a fresh context). Mt-KaHyPar reads
    options from a file only, so they go through a private temporary file."""
    if fast not in _CONTEXTS:
        init = _initializer()
        over = _FAST if fast else {}
        with tempfile.TemporaryDirectory(prefix="attnplan-mtkahypar-") as d:
            path = os.path.join(d, "deterministic.ini")
            with open(path, "w") as f:
                f.write("".join(f"{k}={over.get(k, v)}\n" for k, v in _DETERMINISTIC))
            _CONTEXTS[fast] = init.context_from_file(path)
    return _CONTEXTS[fast]


def kahypar_partition(pin_net: np.ndarray, pin_vtx: np.ndarray, net_w: np.ndarray, weight: np.ndarray, k: int,
                      eps: float, seed: int, fixed: np.ndarray | None,
                      start: np.ndarray | None = None, fast: bool = False) -> np.ndarray | None:
    """km1 partition into ``k`` parts, deterministic: ``pin_net`` (sorted, local
    net ids ``0..len(net_w)-1``) and ``pin_vtx`` the pins, ``weight`` the
    vertex weights (>= 1), ``fixed`` a part per vertex or -1. With ``start``
    (a partition), improve it by one V-cycle (coarsen keeping its parts,
    refine) instead of partitioning from scratch: no initial partitioning,
    a fraction of the time. ``fast``: the preset with less initial
    partitioning (:data:`_FAST`). None where the hypergraph has no net with
    two pins, or the result is not a partition that keeps the fixed vertices."""
    n = len(weight)
    sizes = np.bincount(pin_net, minlength=len(net_w))
    big = sizes >= 2
    if not big.any():
        return None
    import mtkahypar
    init = _initializer()
    nw_all = np.maximum(1, (net_w * (_NET_TOTAL / max(1, int(net_w.sum())) / k)).round())
    # the seed relabels vertices: the DETERMINISTIC preset ignores mtkahypar.set_seed
    perm = np.random.default_rng(seed).permutation(n) if seed else np.arange(n)
    inv = np.argsort(perm)
    keep_pin = big[pin_net]
    starts = np.flatnonzero(np.diff(np.concatenate([[-1], pin_net[keep_pin]])))
    nets = [a.tolist() for a in np.split(inv[pin_vtx[keep_pin]], starts[1:])]
    w = weight[perm]
    if fixed is not None:
        fixed = fixed[perm]
    with _LOCK:
        ctx = _context(fast)
        ctx.set_partitioning_parameters(k, float(max(eps, 1e-3)), mtkahypar.Objective.KM1)
        ctx.logging = False
        hg = init.create_hypergraph(ctx, n, len(nets), nets, w.tolist(), nw_all[big].astype(np.int64).tolist())
        if fixed is not None:
            hg.add_fixed_vertices(fixed.tolist(), k)
        if start is None:
            ph = hg.partition(ctx)
        else:
            ph = hg.create_partitioned_hypergraph(ctx, k, start[perm].tolist())
            ph.improve_partition(ctx, 1)
        part = np.asarray(ph.get_partition(), np.int64)
    if len(part) != n or (part < 0).any() or (part >= k).any():
        return None
    if fixed is not None and (part[fixed >= 0] != fixed[fixed >= 0]).any():
        return None
    return part[inv]


def scaled_weights(work: np.ndarray, is_cb: np.ndarray) -> np.ndarray:
    """Mt-KaHyPar vertex weights: compute vertices their work scaled to about
    ``_VERTEX_TOTAL`` (at least 1), token vertices 1."""
    w = np.ones(len(work), np.int64)
    tot = max(1, int(work.sum()))
    w[is_cb] = np.maximum(1, (work[is_cb] * (_VERTEX_TOTAL / tot)).round()).astype(np.int64)
    return w

