"""span: every document on the fewest devices that pay off, inside one node
whenever it fits — cost-aware per-document placement for micro-batches that
are small against their group.

Per-document sharding over all ``N`` devices (``per_doc``, Skrull's
distributed documents in ``dacp``) makes every device gather every
document's KV, and at 4+ nodes that traffic crosses the slow links: with
8 heads / 2 kv heads a 128K batch on 32 H100s is ~0.4 ms of compute
against ~130 MB of KV per device. Most of those documents do not need 32
devices: a document whose work is a small share of a device's even share
runs best whole on one device (no traffic at all, as DACP's local
documents), and one a few times a device's share needs only a few devices —
of one node, where the links are 8x faster and an all-gather's latency is
half. Only a document larger than a node's share must cross nodes.

The rule (pure functions below; Graham's LPT, Graham 1969, over the
documents' pieces, as Skrull's and WLB-LLM's balancers are):

1. **span** of each document, from its attention work ``P`` (exact allowed
   pairs) against the even share ``W / N`` of the batch's work ``W``: the
   fewest devices ``k`` with ``P / k <= grain * W / N`` (:func:`doc_spans`),
   at most ``length / (2 * min_chunk)`` (a per-document zigzag chunk shorter
   than the kernel's query tile wastes the rest of the tile), rounded up to
   whole nodes when it exceeds a node's devices (a document larger than a
   node's share spans ``ceil(k / per_node)`` nodes).
2. **place** the documents by decreasing work (:func:`place_spans`): a
   multi-node document on the least-loaded nodes (all their devices); a
   document of ``k <= per_node`` devices on the ``k`` least-loaded devices
   of the node where that leaves the smallest maximum; one of one device on
   the least-loaded device. Loads add ``P / k`` to each device of the span.
3. **segments**: a document of one device is one segment there; one of
   ``k`` devices is cut into ``2k`` zigzag chunks (chunk ``j`` and
   ``2k-1-j`` on the span's ``j``-th device, WLB-LLM's per-document
   sharding inside the span), so causal work is even across the span;
   the cuts go to multiples of ``align`` tokens (the kernel's query tile)
   where that leaves the busiest device less tiled work (``zigzag_bounds``).
   Compute runs where Q lives; ``comm`` moves the KV a device needs (p2p,
   node relays for multi-node documents).

Chunks of documents with the same span (device tuple) that play the same
part share a varlen group (one token block that moves as one, as per_doc's
chunk columns); whole documents of a device share one.
``grain`` trades balance against traffic: smaller pieces balance better and
move more. No one grain wins every batch (``plan bench``, h100, 2 kv heads:
grain 1–1.5 on the 128K batches at 8 devices and on most 512K batches at 32;
1.5–2 on most 128K batches at 32; 4 where one document dominates a 128K
batch at 32, lmsys-128k-0 and libra-128k-1, whose pieces then cross fewer
nodes), so ``span{grain=1}``, ``span{grain=2}`` and ``span{grain=4}`` are the
pass's ``variants``: ``auto`` searches them beside ``span`` (grain 1.5) and
keeps the one its simulation predicts fastest, and ``plan bench --strategies
all`` compiles all four (adding 1.25, 2.5 and 3 too moved no median or worst
there by more than 0.01). Deterministic: ties go to the lowest device, node and document.

``cross`` (0: off) keeps a document inside one node when the grain would
send it across nodes but the best span of one node leaves its busiest
device at most ``cross`` times the limit: a little balance for none of the
slow links' traffic and latency. ``span{grain=1,cross=1.2}`` at 32 devices
(4 nodes) wins github-128k-1 (1.94 → 1.63 of the bound: its 18,773-token
document on the 8 devices of one node, 1.09 times the even share, instead
of 16 devices of two) and the longalign batches (512K: 1.14 → 1.08), and
moves no median of ``plan bench`` (docs/results.md). It is an option, not
the rule (on every grain it moved the 512K median 1.18 → 1.21) nor a
variant (``auto`` would place and simulate it too: its 2× compile-time
rule went from 51/56 to 49/56 cases, median 1.54× → 1.72×).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import PlanError
from ..ir.groups import group_limit
from ..ir.module import PlanIR
from ..ir.place import chunk_bounds, place_segments, zigzag_device
from .base import Pass, register
from .dacp import doc_pairs

_COLUMNS: dict = {}   # (problem id, devices, nodes, options) -> (problem, columns): the last few, oldest first
_COLUMNS_KEPT = 8


def span_options(length: int, devices: int, per_node: int, min_chunk: int) -> list[int]:
    """The spans a document of ``length`` tokens may take, fewest first:
    ``1 .. per_node`` devices of one node, then whole nodes, none with a
    zigzag chunk (``length / 2k`` tokens) shorter than ``min_chunk`` (one
    device always)."""
    cap = max(1, length // (2 * max(1, min_chunk)))
    inside = list(range(1, min(per_node, devices, cap) + 1))
    whole = [m * per_node for m in range(2, devices // per_node + 1) if m * per_node <= cap]
    if per_node < devices and per_node not in inside and per_node <= cap:
        whole.insert(0, per_node)
    return inside + whole


def _best_devices(load: np.ndarray, k: int, per_node: int) -> np.ndarray:
    """The ``k`` devices a document of span ``k`` would take: for ``k`` up to
    a node, the ``k`` least-loaded devices of the node where their busiest is
    least loaded (ties: the node's total, then the lowest node); for whole
    nodes, the ``k / per_node`` nodes whose busiest device is least loaded."""
    nodes = len(load) // per_node
    per = load.reshape(nodes, per_node)
    if k > per_node:
        pick = np.sort(np.lexsort((np.arange(nodes), per.sum(1), per.max(1)))[:k // per_node])
        return (pick[:, None] * per_node + np.arange(per_node)[None, :]).ravel()
    if nodes == 1:
        node = 0
    else:  # the busiest of a node's k least-loaded devices is its k-th smallest load
        top = per.min(1) if k == 1 else np.partition(per, k - 1, axis=1)[:, k - 1]
        node = int(np.lexsort((np.arange(nodes), per.sum(1), top))[0])
    if k == 1:
        return np.array([node * per_node + int(per[node].argmin())], np.int64)
    return np.sort(node * per_node + np.argsort(per[node], kind="stable")[:k])


def _span_tops(load: np.ndarray, per_node: int):
    """For the current ``load``: a function of ``k`` giving the busiest
    device's load on the span :func:`_best_devices` would pick for ``k``,
    from one sort of the loads (so trying every ``k`` of a document costs
    one sort, not one per ``k``)."""
    nodes = len(load) // per_node
    per = load.reshape(nodes, per_node)
    srt = np.sort(per, axis=1)  # the k-th smallest of a node: the busiest of its k least-loaded devices
    sums = per.sum(1)
    node_ids = np.arange(nodes)
    by_max = np.lexsort((node_ids, sums, srt[:, -1]))  # whole nodes, least-loaded busiest device first

    def top(k: int) -> float:
        if k > per_node:
            return float(srt[by_max[:k // per_node], -1].max())
        return float(srt[:, k - 1].min())
    return top


def place_spans(lens: np.ndarray, work: np.ndarray, devices: int, per_node: int, grain: float,
                min_chunk: int, cross: float = 0.0) -> list[np.ndarray]:
    """The devices of every document (rules 1 and 2 of the module doc): by
    decreasing work (ties: document index), each takes the fewest devices
    (:func:`span_options`) after which its busiest device holds at most
    ``target = grain * W / N`` (or the busiest device's load so far, if
    higher) — the largest span when none does; but with ``cross > 0`` a
    document that would cross nodes stays inside one when the best span of
    a node leaves its busiest device at most ``cross`` times that limit
    (balance traded for the slow links). Returns one sorted device array per
    document, in document order."""
    work = np.asarray(work, float)
    load = np.zeros(devices)
    target = grain * float(work.sum()) / max(1, devices)
    out: list[np.ndarray] = [np.zeros(0, np.int64)] * len(work)
    one = np.asarray(lens, np.int64) < 4 * max(1, min_chunk)  # a single option: one device (span_options)
    for d in np.lexsort((np.arange(len(work)), -work)).tolist():
        if one[d]:  # the least-loaded device (the lowest of equals), as _best_devices picks for k = 1
            i = int(load.argmin())
            load[i] += work[d]
            out[d] = np.array([i], np.int64)
            continue
        limit = max(target, float(load.max()))
        if float(load.min()) + work[d] <= limit * (1 + 1e-12):  # one device suffices: span 1, the first option
            devs = _best_devices(load, 1, per_node)
            load[devs] += work[d]
            out[d] = devs
            continue
        top_of = _span_tops(load, per_node)
        best: tuple[float, int] | None = None
        inside: tuple[float, int] | None = None  # the best span inside one node
        for k in span_options(int(lens[d]), devices, per_node, min_chunk):
            top = top_of(k) + work[d] / k
            if best is None or top < best[0]:
                best = (top, k)
            if k <= per_node and (inside is None or top < inside[0]):
                inside = (top, k)
            if top <= limit * (1 + 1e-12):
                break
        assert best is not None
        if cross and best[1] > per_node and inside is not None and inside[0] <= cross * limit * (1 + 1e-12):
            best = inside
        devs = _best_devices(load, best[1], per_node)
        load[devs] += work[d] / len(devs)
        out[d] = devs.astype(np.int64)
    return out


def tiled_top(bounds: np.ndarray, k: int, tile: int) -> float:
    """The busiest device's causal work under the zigzag chunks ``bounds``
    (``2k + 1`` cuts of one document over ``k`` devices) as a tiled kernel
    does it: each chunk's rows in query tiles of ``tile`` rows from its
    start, a tile charged ``tile`` rows times the keys up to its last row."""
    lo = bounds[:-1].astype(float)
    tiles = -(-np.diff(bounds) // tile)
    work = tile * (tiles * lo + tile * tiles * (tiles + 1) / 2)  # sum over t of tile * (lo + (t + 1) * tile)
    return float(np.bincount(zigzag_device(np.arange(2 * k), k), weights=work, minlength=k).max())


def zigzag_bounds(length: int, k: int, align: int) -> np.ndarray:
    """The ``2k`` zigzag chunks of a document over ``k`` devices: the even
    split, or its cuts rounded to multiples of ``align`` tokens from the
    document's start where that gives the busiest device less tiled work
    (:func:`tiled_top`; a chunk of 394 rows is 4 tiles of 128, 512 rows of
    work: cuts at tile multiples waste none, but move the pairs' balance;
    12,625 tokens over 7 devices: 3% less on the busiest. With the h100
    profile at 32 devices the best plan of lmsys-128k-1 goes from 3.52 to
    3.22 of the bound, llama3sft-128k-1 from 2.90 to 2.75; lmsys-128k-0 keeps
    its even split). The even split where its chunks are
    shorter than ``align`` (``min_chunk`` below it) or ``align`` is 0."""
    b = chunk_bounds(length, 2 * k)
    if align <= 1 or length < 2 * k * align:
        return b
    a = np.minimum(np.round(b / align).astype(np.int64) * align, length)
    a[-1] = length
    return a if tiled_top(a, k, align) < tiled_top(b, k, align) else b


def span_segments(offsets: np.ndarray, lens: np.ndarray, span_devices: list[np.ndarray],
                  devices: int, align: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Segment starts (sorted), their devices and varlen group keys (rule 3):
    a one-device document is one segment with key 0; a ``k``-device one its
    ``2k`` zigzag chunks (:func:`zigzag_bounds`), chunk ``j`` keyed by (its
    span's device tuple, ``j``) so that only chunks of one span and part share a group."""
    k_of = np.array([len(sd) for sd in span_devices], np.int64)
    single = np.flatnonzero(k_of == 1)  # whole documents: one segment each, key 0 (vectorized: there may be 100k)
    starts = [np.asarray(offsets, np.int64)[single]]
    devs = [np.array([int(span_devices[d][0]) for d in single.tolist()], np.int64)]
    keys = [np.zeros(len(single), np.int64)]
    span_id: dict[tuple, int] = {}
    m = 2 * devices
    for d in np.flatnonzero(k_of > 1).tolist():
        off, length, sd = int(offsets[d]), int(lens[d]), span_devices[d]
        k = len(sd)
        sid = span_id.setdefault(tuple(sd.tolist()), len(span_id) + 1)
        b = zigzag_bounds(length, k, align)
        starts.append(off + b[:-1])
        devs.append(sd[zigzag_device(np.arange(2 * k), k)])
        keys.append(sid * m + np.arange(2 * k, dtype=np.int64))
    if not len(offsets):
        return np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64)
    s, v, key = np.concatenate(starts), np.concatenate(devs), np.concatenate(keys)
    order = np.argsort(s, kind="stable")  # empty chunks repeat a start; the stable sort keeps the non-empty last
    return s[order], v[order], key[order]


@register
@dataclass(frozen=True, slots=True)
class Span(Pass):
    """Every document on the fewest devices that pay off, inside one node when it fits (module doc)."""

    name = "span"
    needs = ("graph",)
    strategy = True
    variants = ("grain=1", "grain=2", "grain=4")  # auto and plan bench also try these
    tree = True  # a document over whole nodes gathers its KV inside each node (comm.tree_rows)
    grain: float = 1.5   # a document's piece of work on a device at most grain x the even share W / N
    min_chunk: int = 128  # tokens: no zigzag chunk shorter (the kernel's query tile)
    align: int = 128     # tokens: zigzag cuts at multiples of it where that tiles better (zigzag_bounds); 0: never
    varlen: int = -1     # tokens per varlen group (per_doc's option): -1 no cap, 0 no groups
    cross: float = 0.0   # > 0: a document stays inside a node when that leaves at most cross x the limit (place_spans)

    def __post_init__(self):
        if not 0.0 < self.grain <= 1e6:
            raise PlanError(f"span: grain must be in (0, 1e6], got {self.grain}")
        if self.min_chunk < 1:
            raise PlanError(f"span: min_chunk must be >= 1 token, got {self.min_chunk}")
        if self.varlen < -1:
            raise PlanError(f"span: varlen must be -1 (no cap), 0 (no groups) or tokens, got {self.varlen}")
        if self.align < 0:
            raise PlanError(f"span: align must be >= 0 tokens (0: the even split), got {self.align}")
        if not (self.cross == 0.0 or 1.0 <= self.cross <= 1e6):
            raise PlanError(f"span: cross must be 0 (off) or in [1, 1e6], got {self.cross}")

    def columns(self, ir: PlanIR) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Segment starts, devices and group keys of this batch (rules 1-3), read-only; the last few are
        remembered (``auto`` asks for each span variant's twice: its preview, then its placement)."""
        p = ir.problem
        key = (id(p), ir.devices, ir.nodes, self.grain, self.min_chunk, self.cross, self.align)
        hit = _COLUMNS.get(key)
        if hit is not None and hit[0] is p:  # the problem itself, held: its id cannot be another's
            return hit[1]
        n = ir.devices
        per_node = max(1, n // ir.nodes)
        where = place_spans(p.seqlens, doc_pairs(p).astype(float), n, per_node, self.grain, self.min_chunk,
                            self.cross)
        out = span_segments(p.offsets[:-1], p.seqlens, where, n, self.align)
        for a in out:
            a.setflags(write=False)
        _COLUMNS[key] = (p, out)
        while len(_COLUMNS) > _COLUMNS_KEPT:
            del _COLUMNS[next(iter(_COLUMNS))]
        return out

    def segments(self, ir: PlanIR) -> tuple[np.ndarray, np.ndarray]:
        """Segment starts and their devices (what :func:`place_segments` takes)."""
        return self.columns(ir)[:2]

    def apply(self, ir: PlanIR) -> PlanIR:
        starts, devices, keys = self.columns(ir)
        limit = group_limit(ir.need_graph(), self.varlen)
        return place_segments(ir, starts, devices, group_key=keys, group_tokens=limit)
