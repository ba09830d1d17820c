"""The segment preview of :mod:`attnplan.tools.auto` (its step 0): a lower
bound of a strategy's placement estimate from its segments alone — the
strategies whose placement homes segments on devices and computes where Q
lives (zigzag, per_doc, dacp) — before anything is tiled or placed; and its
first tiers over the longest samples (:func:`sample_docs`)."""

from __future__ import annotations

import numpy as np

from ..backends.cost import DTYPE_EFFICIENCY, launches
from ..errors import PlanError
from ..ir.arrays import unique
from ..ir.graph import q_block_rows
from ..ir.mask import HI, K0, K1, LO, Q0, Q1, piece_counts, tighten
from ..ir.module import PlanIR
from ..ir.place import segment_home


def row_tiles(rows: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Per piece (clipped to one q block, tightened): the token blocks (sorted
    ``starts``) that its first or its last query row reaches, whichever is
    more. A piece's row allows one contiguous key interval, so each of those
    blocks holds an allowed pair of the q block: a lower bound of the q
    block's tiles (exact for a causal document cut into blocks)."""
    out = np.zeros(len(rows), np.int64)
    for q in (rows[:, Q0], rows[:, Q1] - 1):
        lo = np.maximum(rows[:, K0], q + rows[:, LO])
        hi = np.minimum(rows[:, K1] - 1, q + rows[:, HI])
        out = np.maximum(out, np.searchsorted(starts, hi, "right") - np.searchsorted(starts, lo, "right") + 1)
    return out


def segment_bound(tiled: PlanIR, starts: np.ndarray, devices: np.ndarray, prof,
                  max_blocks: int | None = None, grouped: bool = False, docs: np.ndarray | None = None) -> float:
    """A lower bound of :func:`estimate` for a strategy that homes segments
    ``[starts[i], starts[i+1])`` on ``devices[i]`` and computes where Q lives
    (``place_segments`` with its default compute), from the segments alone —
    no tiles: the token blocks are the tile pass's cut at the segment starts;
    each is the Q of at least :func:`row_tiles` tiles, so its device launches
    at least that many compute blocks per head group for it, and computes
    all of its rows' pairs — a piece of at most one kernel tile of rows
    rounded up to that tile (the pieces tiling cuts from it have no more
    rows), a longer one unrounded — and receives the KV of :func:`kv_bound`.
    Forward + backward of the busiest device: ``estimate`` takes at least
    each phase's compute maximum, and the backward is the forward ×
    ``bwd_factor`` device by device. Costs one pass over (piece, q block).
    Those counts also bound the compute blocks the placement would make:
    over ``max_blocks`` it raises the PlanError placing would raise, before
    building anything (per_doc on 4M tokens at 32 devices: 4 s to fail
    otherwise). ``grouped``: the strategy packs its segments into varlen
    groups (ir/groups.py), so its compute blocks are not counted per q block:
    one launch per device with work, and no refusal by count; and a
    segment's blocks merge into one span of its group, so the pieces are
    cut at the segment starts only (coarser pieces only lower the bound: a
    piece of r rows, cut into pieces of fewer rows, rounds each up).
    ``docs`` (sorted sample indices): the same bound over those samples
    only (:func:`sampled_pieces`) — less work and traffic on every device,
    so no more than the whole bound, at a cost that follows their segments."""
    g, n, p = tiled.need_graph(), tiled.devices, tiled.problem
    starts = np.asarray(starts, np.int64)
    cut_from = np.concatenate([g.tb_start[:0] if grouped else g.tb_start, starts])
    if docs is None:
        pieces, index, cuts = p.pieces.a, None, unique(np.concatenate([cut_from, [p.tokens]]))
    else:
        pieces, index, cuts = sampled_pieces(p, docs, cut_from)
    rows, src, qb = q_block_rows(pieces, cuts[:-1], cuts[1:])
    src = src if index is None else index[src]
    dev = segment_home(cuts[:-1], starts, np.asarray(devices, np.int64))
    seen = p.piece_heads()  # per-head masks: the heads that see each piece (else every head, applied below)
    counts = piece_counts(rows).astype(float) * (1.0 if seen is None else seen[src] / p.heads)
    # a piece of r <= tile_q rows: every piece tiling makes of it has at most r rows, each rounded up to one
    # kernel tile (backends/cost.rounded_pairs), so its work is at least pairs * tile_q / r; longer ones: pairs
    r = (rows[:, Q1] - rows[:, Q0]).astype(float)
    counts *= np.where(r <= prof.tile_q, prof.tile_q / r, 1.0)
    pairs = np.bincount(dev[qb], weights=counts, minlength=n)
    per_row = row_tiles(rows, cuts[:-1])
    order = np.lexsort((per_row, qb))  # by q block, its largest count last
    last = np.flatnonzero(np.diff(np.append(qb[order], -1)))  # each q block's largest count
    per_class_hg = g.n_hg if p.head_class is None else 1  # per-head masks: a class has at least one head group
    blocks = np.bincount(dev[qb[order][last]], weights=per_row[order][last], minlength=n) * per_class_hg
    if grouped:
        blocks = np.minimum(blocks, 1.0)
    elif max_blocks is not None and blocks.sum() > max_blocks:
        raise PlanError(f"the placement would make at least {int(blocks.sum()):,} compute blocks, over the limit of "
                        f"{max_blocks:,} (counted from its segments, before placing)")
    rate = DTYPE_EFFICIENCY.get(p.dtype, 1.0)
    fwd = (prof.launch_s * launches(blocks, prof) + 4.0 * p.head_dim * p.heads * pairs / prof.flops) / rate
    if not n:
        return 0.0
    recv, send_b, node, node_out = kv_bound(tiled, cuts, dev, rows, qb, prof)
    again = 0.0 if p.keep_kv else 1.0  # keep_kv: the backward receives no KV
    bwd = np.maximum(np.maximum(fwd * prof.bwd_factor, recv * again), send_b)
    return float(max(np.maximum(fwd, recv).max(), node) + max(bwd.max(), node * again, node_out))


def sampled_pieces(p, docs: np.ndarray, cut_from: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For :func:`segment_bound` over the samples ``docs`` only: their mask
    pieces with keys clipped to their own sample (pairs dropped, never
    added), the index of each in the problem's pieces, and the cuts inside
    those samples (``cut_from``) with their bounds. Blocks between the
    samples hold no piece and no key of one."""
    offs = p.offsets
    inside = np.zeros(len(p.seqlens), bool)
    inside[docs] = True
    P = p.pieces.a
    sample = np.searchsorted(offs, P[:, Q0], "right") - 1
    index = np.flatnonzero(inside[sample])
    rows, sample = P[index], sample[index]
    rows[:, K0] = np.maximum(rows[:, K0], offs[sample])
    rows[:, K1] = np.minimum(rows[:, K1], offs[sample + 1])
    keep = tighten(rows)
    cut_from = cut_from[inside[np.searchsorted(offs, cut_from, "right") - 1]]
    return rows[keep], index[keep], unique(np.concatenate([cut_from, offs[docs], offs[docs + 1]]))


SAMPLE_SEGMENTS = 16_384  # a preview over more segments than this is first taken over the longest samples


def sample_docs(p, starts: np.ndarray, limit: int | None = None) -> np.ndarray | None:
    """The longest samples (ties: the first) whose segments (``starts``
    inside them) number at most ``limit`` (default :data:`SAMPLE_SEGMENTS`)
    — at least one — sorted; None where every segment is within the limit."""
    limit = SAMPLE_SEGMENTS if limit is None else limit
    if len(starts) <= limit:
        return None
    offs = p.offsets
    per = np.bincount(np.searchsorted(offs, starts, "right") - 1, minlength=len(p.seqlens))
    order = np.lexsort((np.arange(len(per)), -np.asarray(p.seqlens)))
    k = max(1, int(np.searchsorted(np.cumsum(per[order]), limit, "right")))
    return np.sort(order[:k])


def kv_bound(tiled: PlanIR, cuts: np.ndarray, dev: np.ndarray, rows: np.ndarray, qb: np.ndarray, prof
             ) -> tuple[np.ndarray, np.ndarray, float, float]:
    """Seconds of transfers a placement that computes where Q lives (the
    token blocks ``cuts`` homed on ``dev``, the pieces ``rows`` clipped to q
    block ``qb``) cannot avoid. A tightened piece needs every key of
    ``[K0, K1)``, so a device receives at least the keys its pieces reach
    that live elsewhere (in whole blocks: at least those tokens), in each
    phase (the forward only under ``keep_kv``: :func:`segment_bound` drops
    them from the backward), each at no more than the faster link's bandwidth; in the backward
    it sends each of those keys' partial dK/dV out (fp32, home or to its
    node's aggregator under a node reduce: at the faster link's bandwidth
    too); the keys a node's devices reach on other nodes cross into it over
    its devices' inter-node links at least once (relays included), and their
    partial dK/dV cross out of it at least once (a node reduce's sums
    included), so some device of the node spends at least a 1/devices_per_node
    share of each crossing, on its receive and on its send queue. Returns
    (per device: KV receive seconds, backward partial send seconds; the node
    terms in and out). Zero for per-head masks and KV-head copies (not every
    head group then needs every key)."""
    g, n, per_node = tiled.need_graph(), tiled.devices, tiled.devices // tiled.nodes
    p = tiled.problem
    if p.head_class is not None or g.kv_rep != 1 or not len(rows):
        return np.zeros(n), np.zeros(n), 0.0, 0.0
    kv_token = 2.0 * p.kv_heads * p.head_dim * p.dtype_bytes
    dkv_token = 2.0 * p.kv_heads * p.head_dim * p.partial_bytes  # as partials travel
    starts, lens, owner = cuts[:-1], np.diff(cuts), dev[qb]
    remote = _remote_keys(owner, rows[:, K0], rows[:, K1], starts, lens, dev, n)
    fastest = max(prof.intra_bw, prof.inter_bw)
    recv = remote * kv_token / fastest
    send = remote * dkv_token / fastest  # a node reduce's aggregator may be on this node: no link is sure
    if tiled.nodes == 1:
        return recv, send, 0.0, 0.0
    inter = _remote_keys(owner // per_node, rows[:, K0], rows[:, K1], starts, lens, dev // per_node, tiled.nodes)
    crossing = inter.max() / (prof.inter_bw * per_node)
    return recv, send, float(crossing * kv_token), float(crossing * dkv_token)


def _remote_keys(owner: np.ndarray, a: np.ndarray, b: np.ndarray, starts: np.ndarray, lens: np.ndarray,
                 home: np.ndarray, n: int, owner_home: np.ndarray | None = None) -> np.ndarray:
    """Per owner ``o``: tokens in the union of its intervals ``[a, b)`` whose
    block (``starts``, ``lens``) has a ``home`` other than ``owner_home[o]``
    (default ``o``)."""
    order = np.lexsort((a, owner))
    owner, a, b = owner[order], a[order], b[order]
    shift = (owner * (int(b.max(initial=0)) + 1)).astype(np.int64)
    reach = np.maximum.accumulate(b + shift) - shift  # the furthest end so far, per owner
    new = np.ones(len(a), bool)
    new[1:] = (owner[1:] != owner[:-1]) | (a[1:] > reach[:-1])
    first = np.flatnonzero(new)
    last = np.append(first[1:], len(a)) - 1
    m_owner, m_a, m_b = owner[first], a[first], reach[last]  # the merged intervals
    total = np.bincount(m_owner, weights=(m_b - m_a).astype(float), minlength=n)
    h = m_owner if owner_home is None else owner_home[m_owner]  # tokens homed on h inside its merged intervals
    below = _homed_below(np.concatenate([h, h]), np.concatenate([m_b, m_a]), starts, lens, home)
    inside = below[:len(h)] - below[len(h):]
    return total - np.bincount(m_owner, weights=inside.astype(float), minlength=n)


def _homed_below(h: np.ndarray, x: np.ndarray, starts: np.ndarray, lens: np.ndarray, home: np.ndarray) -> np.ndarray:
    """Per query i: tokens below position ``x[i]`` in the blocks (``starts``,
    ``lens``, disjoint) whose ``home`` is ``h[i]`` — one sort of the blocks by
    (home, start) and two binary searches per query."""
    order = np.lexsort((starts, home))
    hs, ss = home[order].astype(np.int64), starts[order].astype(np.int64)
    es = ss + lens[order]
    cum = np.concatenate([[0], np.cumsum(lens[order])])
    span = int(es.max(initial=0)) + 1
    h, x = np.asarray(h, np.int64), np.asarray(x, np.int64)
    first = np.searchsorted(hs, h, "left")  # h's first block in that order
    at = np.searchsorted(hs * span + ss, h * span + x, "right") - 1  # h's last block starting at or below x
    ok = at >= first
    at = np.maximum(at, 0)
    return np.where(ok, cum[at] - cum[first] + np.minimum(x, es[at]) - ss[at], 0)  # first <= len(ss) < len(cum)
