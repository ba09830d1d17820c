"""comm{mode=p2p|ring|allgather|allgather_ring|a2a, relay=none|node|tree, reduce=none|node}: derive the
transfers a placement needs.

* ``p2p`` (zero-redundant, MagiAttention/DCP style): each Q and KV block goes
  from its home straight to every other device that computes with it, once;
  one stage.
* ``ring`` (ring attention as deployed in ring-flash-attn and
  TransformerEngine): every KV block travels around the ring of devices,
  one hop a stage, so every device receives every other device's KV whether
  it needs it or not; a compute block runs in the stage its KV arrives
  (``(device - home) mod N``). Q (if it must move) goes p2p in stage 0.
* ``allgather`` (all-gather CP as Llama 3 (Dubey et al. 2024, §3.3.2) and
  TransformerEngine's ``all_gather`` mode deploy it): every device receives
  every KV block from its home, needed or not, in one stage before any
  compute; the backward's dKV partials go home as before (the reduce-scatter
  of an all-gather, restricted to the blocks that were used): one message per
  peer after coalescing. ``allgather_ring``: the same gather as the
  algorithm NCCL runs an all-gather with — every KV block forwarded one hop
  a stage round the ring of devices (the traffic of ``mode=ring``), and every
  compute block in the last stage, after the whole gather — so the
  programs and the cost model carry NCCL's ring: N−1 steps, each a message
  to the next device, the inter-node hops on the ring's path.
* ``a2a`` (the all-to-all of DeepSpeed-Ulysses and yunchang, for any
  placement): p2p's transfers, one stage, no overlap and no relays, run as
  collectives: per phase one all-to-all of the data (Q, KV) before any
  compute and one of the partial outputs after it
  (``torch.distributed.all_to_all_single`` in :mod:`attnplan.runtime.collective`;
  the in-process executor and the cost model see its point-to-point
  messages, which is what NCCL's all-to-all is: grouped sends and receives
  to every peer, and what it costs).

Either way each partial O goes from a computing device to the Q block's home
once, after its last write (with ``reduce=node``, through its node's sum).

``relay=node`` (with ``p2p``; the default pipelines of p2p strategies use
it, :func:`default_comm`; DCP's two-phase inter-node transfer, Jiang et al.
2025 §4): a Q or KV block that several devices of one remote node need
crosses the inter-node link once, to one of those devices (the one with the
source's local rank where it needs the block, else the next: rail-aligned,
see ``relay_rows``; always the lowest put a node's whole inbound traffic on
one link), in
stage 0, and that device forwards it to the others over the node's links in
stage 1; compute blocks that use a relayed block run in stage 1. Inter-node
bytes then count each (block, remote node) once, and the verifier proves the
relay holds the block before it forwards it.

``relay=tree`` (with ``p2p``; auto's ``name:tree``): the node relays, then
inside each node every Q and KV block — a home's own, a relay's forwards —
spreads by recursive doubling over the node's devices that exchange it (a
group per connected set of them: a span), or by Bruck's algorithm where they
are no power of two (:func:`tree_rows`): in
stage ``t + b`` a device sends what it holds to the member whose position
differs in bit ``b`` (or is ``2^b`` lower, cyclically), one message per
partner. Where
one document spans whole nodes a device then receives ``log2(8) = 3``
messages per entry stage where direct sends gave it 7, each an ``alpha``
on its receive queue; the blocks reach the last members two stages later.
Measured with the h100 profile at 32 devices (4 nodes), best span variant
per batch: lmsys-128k-0 3.12 -> 2.52 of the bound, libra-128k-0 2.10 ->
1.81, github-128k-0 2.39 -> 1.95; it loses where documents span a few
devices (longalign-128k-1 1.57 -> 1.75), so it is a variant auto tries,
not the default.

``reduce=node`` (with ``p2p``; the default pipelines of p2p strategies use
it too, :func:`default_reduce`): the dual of the relay for the partial
outputs (forward O, backward dQ and dKV). The partials of one block computed
on two or more devices of a node that is not the block's home node are
summed inside that node first: each sends its partial to one of them (the
aggregator, chosen as the relay of the reversed rows would choose it,
:func:`reduce_rows`), which merges them into its own after its last write
and sends the sum home — one inter-node message per (block, node) instead
of one per device. The schedule records only the flag; emit derives the
routes (:mod:`attnplan.passes.emit`), and the program verifier proves that
every partial is merged once and that a partial is final when it is sent.
"""

from __future__ import annotations

import difflib
import re

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..errors import PlanError
from ..ir.module import PlanIR
from ..ir.schedule import X_KV, X_O, X_Q, XDST, XHG, XSRC, XSTAGE, XTB, Schedule
from ..ir.verify import needed_transfers
from .base import DEFAULT_RUN, Pass, parse_pipeline, register, strategies


MODES = ("p2p", "ring", "allgather", "allgather_ring", "a2a")

COMM_VARIANTS = {  # name:variant -> the options of the comm step
    "p2p": "mode=p2p,relay=node,reduce=node",  # the default of p2p strategies: node relays in, node reduces out
    "reduce": "mode=p2p,relay=node,reduce=node",  # the same, named: partials summed inside their node before crossing
    "relay": "mode=p2p,relay=node",       # relays only (DCP's two-phase inter-node transfer): partials cross one each
    "direct": "mode=p2p,relay=none",      # p2p without relays or reduces: every remote device gets its own crossing
    "tree": "mode=p2p,relay=tree,reduce=node",  # node relays, then recursive doubling inside each node; node reduces
    "ring": "mode=ring",                  # KV one hop a stage round the ring (ring-flash-attn, TransformerEngine)
    "allgather": "mode=allgather",        # every KV block to every device first (Llama 3, TE's all_gather CP)
    "allgather_ring": "mode=allgather_ring",  # the same, as NCCL's ring all-gather (N-1 hops, then compute)
    "a2a": "mode=a2a",                    # p2p's blocks as two all-to-alls a phase (DeepSpeed-Ulysses, yunchang)
}


class Entry(NamedTuple):
    """A strategy entry parsed (:func:`parse_entry`): the strategy step
    (``name`` or ``name{options}``), its variant's comm step options (None:
    the strategy's default), its overlap step's ``local`` option (``kept``,
    the default, where the entry names none) and the entry's canonical
    text (what a plan records: stripped, one space before the order, no
    ``overlap{local=kept}``)."""

    strategy: str
    comm: str | None
    local: str
    text: str


MAX_ENTRY = 1000  # characters of a strategy entry (the longest builtin with every option is under 200)
_ORDER_AT = re.compile(r"\s(overlap\b.*)\Z", re.DOTALL)  # where an entry's order suffix starts: linear time
_ORDER = re.compile(r"overlap\{\s*local\s*=\s*([^{}\s]*)\s*\}")


def _shown(entry: str) -> str:
    return repr(entry if len(entry) <= 120 else entry[:120] + "...")


def split_order(entry: str) -> tuple[str, str]:
    """``entry`` (stripped) as (its strategy and variant, its ``local`` order:
    ``kept`` where it ends in no `` overlap{local=...}``)."""
    text = entry.strip()
    if len(text) > MAX_ENTRY:
        raise PlanError(f"strategy entry of {len(text):,} characters (at most {MAX_ENTRY}): {_shown(text)}")
    at = _ORDER_AT.search(text)
    if at is None:
        return text, "kept"
    m = _ORDER.fullmatch(at.group(1))
    if m is None:
        raise PlanError(f"strategy entry {_shown(text)}: after the strategy only ' overlap{{local=...}}' (one of "
                        f"{', '.join(LOCAL_ORDERS)}: where the backward runs a device's own blocks) may follow")
    if m.group(1) not in LOCAL_ORDERS:
        raise PlanError(f"strategy entry {_shown(text)}: local must be {', '.join(LOCAL_ORDERS[:-1])} or "
                        f"{LOCAL_ORDERS[-1]}, got {m.group(1)!r}")
    return text[:at.start()].rstrip(), m.group(1)


def parse_entry(entry: str) -> Entry:
    """A strategy entry ``name``, ``name{options}`` (``span{grain=2}``: the
    strategy pass with those options) or either with ``:variant``, each
    optionally followed by `` overlap{local=first|last|kept}`` (the order of
    the backward's own blocks, :class:`Overlap`: what ``auto`` names a plan
    it chose in the other order, ``span:tree overlap{local=last}``), as an
    :class:`Entry`; PlanError naming what is unknown."""
    main, local = split_order(entry)
    head, _, variant = main.partition(":")
    name, brace, _ = head.partition("{")
    if name == "auto":
        hint = f" (drop the 'auto:' prefix: {_shown(entry.strip()[5:])} is what auto chose)" if variant else ""
        raise PlanError(f"{_shown(entry.strip())}: auto takes no options, variant or order{hint}" if main != "auto"
                        or local != "kept" or entry.strip() != "auto" else "auto chooses among the strategies "
                        "(compile --strategy auto); it is not an entry of a strategy list")
    if name not in strategies():
        close = difflib.get_close_matches(name, list(strategies()) + ["auto"], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise PlanError(f"unknown strategy {_shown(name)}{hint}; known: {', '.join(strategies())}, auto, or "
                        f"NAME:VARIANT with a variant of {', '.join(COMM_VARIANTS)}")
    if brace:
        if len(parse_pipeline(head)) != 1:  # its options checked as the pipeline will check them
            raise PlanError(f"strategy entry {_shown(entry.strip())}: one strategy with its options, e.g. "
                            "'span{grain=2}'")
    if ":" in main and variant not in COMM_VARIANTS:
        raise PlanError(f"unknown communication variant {_shown(variant)} in {_shown(entry.strip())}; known: "
                        f"{', '.join(COMM_VARIANTS)}")
    text = main + (f" overlap{{local={local}}}" if local != "kept" else "")
    return Entry(head, COMM_VARIANTS[variant] if ":" in main else None, local, text)


def default_relay(mode: str) -> str:
    """The relay of a default pipeline (:func:`default_comm`): ``node`` for
    p2p (on one node it changes nothing), else ``none``. Measured with the h100 profile at 32 devices (4 nodes), the
    median predicted / lower bound falls with the relay for every p2p
    strategy: per_doc 28.2 -> 24.3 and dacp 26.7 -> 22.5 on the 128K
    batches; minheap 3.34 -> 2.67, tile_pool 2.61 -> 2.53, hypergraph
    1.44 -> 1.43 on the 512K batches (single batches can lose: the relayed
    blocks' compute waits for stage 1)."""
    return "node" if mode == "p2p" else "none"


def default_reduce(mode: str) -> str:
    """The node reduce of a default pipeline (:func:`default_comm`): ``node``
    for p2p, else ``none``. Measured with the h100 profile at 32 devices (4
    nodes; ``plan bench``'s shape), the median predicted / lower bound falls
    with it for every p2p strategy but where it sends nothing: per_doc 17.8
    -> 8.8 and dacp 16.6 -> 8.4, hypergraph 6.65 -> 5.40, minheap 9.66 ->
    6.65 on the 128K batches; minheap 2.52 -> 1.94, tile_pool 2.61 -> 2.36,
    ``span{grain=1}`` 1.48 -> 1.33 on the 512K batches (single batches can
    lose: a node's sum leaves only after its aggregator's last block, so
    ``auto`` also tries ``name:relay``)."""
    return "node" if mode == "p2p" else "none"


def default_comm(mode: str) -> str:
    """The options of a default pipeline's comm step for a strategy whose
    ``default_comm`` is ``mode`` (an explicit ``comm{mode=p2p}`` means no
    relay and no reduce: ``divide`` and other staged passes need its one stage)."""
    relay, reduce = default_relay(mode), default_reduce(mode)
    return (f"mode={mode}" + (f",relay={relay}" if relay != "none" else "")
            + (f",reduce={reduce}" if reduce != "none" else ""))


def _rows(kind, r, stage) -> np.ndarray:
    """Schedule rows (kind, tb, hg, src, dst, stage) from needed rows (tb, hg, src, dst)."""
    return np.column_stack([np.full(len(r), kind), r, np.broadcast_to(stage, (len(r),))]).astype(np.int64)


def read_kv(g) -> tuple[np.ndarray, np.ndarray]:
    """(token block, head group) of every KV block some compute block reads,
    by block then group: what a ring or an all-gather moves. Blocks no
    compute reads — the keys of a mask that never sees them, a cross-attention
    sample's query side, a head group whose class never reads the block —
    stay home."""
    key = np.unique(g.cb_k * g.n_hg + g.cb_hg)
    return key // g.n_hg, key % g.n_hg


def allgather_kv(g, pl) -> np.ndarray:
    """All-gather traffic: schedule rows of every KV block read (:func:`read_kv`)
    from its home to every other device, stage 0, ordered by source then destination."""
    n = pl.devices
    tb, hg = read_kv(g)
    src = pl.home[tb]
    off = np.arange(1, n)
    dst = (src[:, None] + off[None, :]) % n
    rows = np.column_stack([np.full(dst.size, X_KV), np.repeat(tb, n - 1), np.repeat(hg, n - 1),
                            np.repeat(src, n - 1), dst.ravel(), np.zeros(dst.size, np.int64)])
    order = np.lexsort((rows[:, 4], rows[:, 3]))
    return rows[order].astype(np.int64).reshape(-1, 6)


def relay_rows(kind: int, need: np.ndarray, per_node: int) -> tuple[np.ndarray, np.ndarray]:
    """``need`` rows ``(tb, hg, src, dst)`` of one kind as schedule rows with
    relays: per (block, destination node) off the source's node with two or
    more destinations, one destination
    receives in stage 0 and forwards in stage 1: the first at or after the
    source's own slot ``src mod per_node`` (cyclically) — rail-aligned, as
    NCCL's rail-optimized inter-node paths pair local rank r with local rank
    r: a device then receives inter-node messages from few sources (one per
    remote node where it is the destination itself), where a counter over the
    groups (before) gave each device blocks from up to every remote device,
    each message another latency (lmsys-128k-0, span{grain=1} at 32 devices:
    168 -> 96 inter-node forward messages; plan bench medians at 128K x 32:
    hypergraph 5.39 -> 4.92, per_doc 8.80 -> 8.32; at 512K x 32 hypergraph
    1.41 -> 1.38, span{grain=1} 1.34 -> 1.30). Returns (rows, the relayed
    rows' ``(tb, hg, dst)``)."""
    tb, hg, src, dst = need.T
    node = dst // per_node
    remote = node != src // per_node
    key = np.stack([tb, hg, node], 1)
    # groups of rows sharing (block, destination node); need is sorted by (tb, hg, src, dst)
    order = np.lexsort((dst, node, hg, tb))
    k = key[order]
    start = np.r_[True, np.any(k[1:] != k[:-1], axis=1)] if len(k) else np.zeros(0, bool)
    gid = np.cumsum(start) - 1
    size = np.bincount(gid, minlength=int(gid[-1]) + 1 if len(gid) else 0)[gid] if len(gid) else gid
    first = np.flatnonzero(start)[gid] if len(gid) else gid
    # the group's first destination at or after the source's slot in its node, cyclically (rail-aligned)
    slot = (src[order][start] % per_node)[gid]
    after = (dst[order] % per_node - slot) % per_node
    best = np.lexsort((after, gid))  # rows by group (the groups keep their positions), then distance
    pick = best[first]
    relay_dst = dst[order][pick]
    forwarded = remote[order] & (size >= 2) & (np.arange(len(order)) != pick)
    srcs = np.where(forwarded, relay_dst, src[order])
    stage = forwarded.astype(np.int64)
    rows = np.column_stack([np.full(len(order), kind), tb[order], hg[order], srcs, dst[order], stage])
    rows = rows[np.lexsort((rows[:, 4], rows[:, 3], rows[:, 5]))]  # by stage, then source, then destination
    return rows.astype(np.int64).reshape(-1, 6), np.stack([tb[order], hg[order], dst[order]], 1)[forwarded]


def tree_rows(rows: np.ndarray, per_node: int) -> np.ndarray:
    """Schedule rows ``(kind, tb, hg, src, dst, stage)``, those whose source
    and destination share a node routed as MPICH's all-gather for short
    messages routes them (Thakur, Rabenseifner & Gropp 2005, §4.1):
    recursive doubling, the hypercube, where the members are a power of two,
    and Bruck's algorithm (Bruck et al. 1997) otherwise — restricted to who
    needs what. Per entry stage ``t`` (0 for a block's home, 1 for a node
    relay's forwards), the members of a group are devices of one node that
    exchange such rows with each other (a connected component of the rows'
    devices: where a node holds several documents' spans, each span is a
    group, and no block passes through another document's devices), by
    device; a block entering at the member of position
    ``e`` reaches the one at ``p`` through the hops of the set bits of ``d``,
    lowest first, bit ``b``'s hop in stage ``t + b``: ``d = e xor p``, a hop
    flipping bit ``b`` (doubling), or ``d = (e - p) mod members``, a hop to
    the position ``2^b`` lower, cyclically (Bruck). Either way a member sends
    to one partner and receives from one per stage and entry stage, whatever
    blocks it carries (one message each), ``ceil(log2(members))`` stages
    where direct sends gave it one message per peer: latency, not bandwidth,
    is what a small micro-batch pays on many devices (a document over a
    whole node: 7 messages per device before, 3 now). Bruck keeps every
    member busy in every stage where doubling on a count that is no power of
    two leaves members without a partner (those of 7 devices with none at
    position 7 received nothing in the first stage): with the h100 profile at
    128K tokens on 32 devices the tree's candidates' best per batch went 2.01
    (3.00) -> 1.92 (2.91). The price of both: blocks reach the last members a
    stage or two later, and an intermediate receives what it only forwards.
    Rows across nodes stay as they are."""
    rows = np.asarray(rows, np.int64).reshape(-1, 6)
    inside = (rows[:, 3] // per_node) == (rows[:, 4] // per_node)
    r = rows[inside]
    if not len(r):
        return rows
    from scipy.sparse import coo_matrix  # scipy on first use: importing the passes stays quick
    from scipy.sparse.csgraph import connected_components

    # member groups: per entry stage, the devices that exchange rows (connected components, inside a node)
    n = (int(r[:, 3:5].max()) // per_node + 1) * per_node
    a, b = r[:, 5] * n + r[:, 3], r[:, 5] * n + r[:, 4]
    size_all = (int(r[:, 5].max()) + 1) * n
    _, comp = connected_components(coo_matrix((np.ones(len(r)), (a, b)), shape=(size_all, size_all)), directed=False)
    keys, group = np.unique(comp[a], return_inverse=True)
    group = group.ravel()
    members = np.unique(np.r_[group, group] * n + np.r_[r[:, 3], r[:, 4]])
    start = np.searchsorted(members, np.arange(len(keys)) * n)
    size = np.diff(np.r_[start, len(members)])[group]
    first = start[group]
    e = np.searchsorted(members, group * n + r[:, 3]) - first
    p = np.searchsorted(members, group * n + r[:, 4]) - first
    bruck = (size & (size - 1)) != 0
    dist = np.where(bruck, (e - p) % size, e ^ p)
    holder, at = e.copy(), e.copy()
    hops = []
    for bit in range(int(size.max() - 1).bit_length()):
        on = (dist >> bit) & 1 == 1
        at = np.where(on, np.where(bruck, (at - (1 << bit)) % size, at ^ (1 << bit)), at)
        dev = members[first[on] + [holder[on], at[on]]] % n
        hops.append(np.column_stack([r[on, :3], dev.T, r[on, 5] + bit]))
        holder = at  # np.where made a new array: no alias
    out = np.concatenate([rows[~inside], _distinct(np.concatenate(hops))])  # routes share their first hops
    return out[np.lexsort((out[:, 4], out[:, 3], out[:, 5]))].astype(np.int64)


def _distinct(rows: np.ndarray) -> np.ndarray:
    """The distinct rows of non-negative int64 ``rows``, in an order of their
    mixed-radix keys (one 1-D unique, not a sort of rows)."""
    key = np.zeros(len(rows), np.int64)
    for c in range(rows.shape[1]):
        key = key * (int(rows[:, c].max(initial=0)) + 1) + rows[:, c]
    return rows[np.unique(key, return_index=True)[1]]


def arrival_stage(g, pl, rows_by_kind: list[np.ndarray]) -> np.ndarray:
    """Stage of every compute block: the latest stage in which its Q or its
    KV arrives at its device (0 where both are home); ``rows_by_kind``: the
    schedule rows of Q, then of KV (one arrival per block and destination)."""
    n, n_hg = pl.devices, g.n_hg
    stage = np.zeros(g.n_cb, np.int64)
    for kind_tb, r in zip((g.cb_q, g.cb_k), rows_by_kind):
        if len(r):
            keys = (r[:, XTB] * n_hg + r[:, XHG]) * n + r[:, XDST]
            order = np.argsort(keys, kind="stable")
            keys = keys[order]
            mine = (kind_tb * n_hg + g.cb_hg) * n + pl.cb_device
            pos = np.searchsorted(keys, mine).clip(0, len(keys) - 1)
            stage = np.maximum(stage, np.where(keys[pos] == mine, r[order[pos], XSTAGE], 0))
    return stage


HOP_DIRECT, HOP_GATHER, HOP_CROSS = 0, 1, 2  # a partial's route under reduce=node (reduce_rows)


def reduce_rows(rows: np.ndarray, per_node: int) -> tuple[np.ndarray, np.ndarray]:
    """The routes of partial-output rows ``(kind, tb, hg, src, dst, stage)``
    (``src`` the computing device, ``dst`` the home) under ``reduce=node``,
    as (rows, hop of each). Per (block, source node) off the home's node with
    two or more sources, every source but the aggregator sends to the
    aggregator (``HOP_GATHER``), and the aggregator sends the sum home
    (``HOP_CROSS``); every other row goes home directly (``HOP_DIRECT``).
    The aggregator is the device :func:`relay_rows` would pick to relay the
    block from its home to those devices (the reversed rows), so the reduce
    is the relay run backwards. Every row gets the rows' last stage (emit
    sets the stage a partial is sent in itself, :mod:`attnplan.passes.emit`)."""
    rows = np.asarray(rows, np.int64).reshape(-1, 6)
    if not len(rows):
        return rows, np.zeros(0, np.int64)
    kind, stage = int(rows[0, 0]), rows[:, 5]
    if len(np.unique(rows[:, 0])) != 1:
        raise PlanError("reduce_rows: rows of one kind of partial at a time")
    rev = rows[:, [1, 2, 4, 3]]  # (tb, hg, home, computing): the relay's view
    routed, gathered = relay_rows(kind, rev, per_node)
    tb, hg, src, dst, hop1 = routed[:, 1], routed[:, 2], routed[:, 3], routed[:, 4], routed[:, 5] == 1
    node = dst // per_node
    key = (tb * (int(hg.max()) + 1) + hg) * (int(node.max()) + 1) + node
    got = gathered[:, 0] * (int(hg.max()) + 1) + gathered[:, 1]
    got = np.unique(got * (int(node.max()) + 1) + gathered[:, 2] // per_node)
    cross = ~hop1 & np.isin(key, got)
    hop = np.where(hop1, HOP_GATHER, np.where(cross, HOP_CROSS, HOP_DIRECT))
    out = np.column_stack([np.full(len(routed), kind), tb, hg, dst, src, np.full(len(routed), stage.max())])
    return out, hop


def reduced_partials(rows: np.ndarray, per_node: int) -> tuple[np.ndarray, np.ndarray]:
    """Partial rows ``(tb, hg, src, dst)`` (``src`` computes, ``dst`` is
    home) as :func:`reduce_rows` routes them under a node reduce, still as
    ``(tb, hg, src, dst)`` rows, with the hop of each (``HOP_DIRECT``,
    ``HOP_GATHER`` to the node's aggregator, ``HOP_CROSS`` for the node's sum)."""
    full = np.column_stack([np.zeros(len(rows), np.int64), rows, np.zeros(len(rows), np.int64)])
    routed, hop = reduce_rows(full, per_node)
    return routed[:, [XTB, XHG, XSRC, XDST]], hop


def ring_kv(g, pl) -> tuple[np.ndarray, np.ndarray]:
    """Ring traffic: (schedule rows of KV, stage of every compute block).
    Rows come by stage, then sending device (block order within): the order
    of the messages they travel in."""
    n = pl.devices
    tb, hg = read_kv(g)  # every KV block some compute block reads goes round
    h = pl.home[tb]
    hop = np.arange(1, n)
    s = np.repeat(hop, len(tb))
    tb_, hg_, h_ = (np.tile(a, n - 1) for a in (tb, hg, h))
    src = (h_ + s - 1) % n
    order = np.argsort(src.astype(np.uint16), kind="stable")  # radix sorts (devices < 2^16): by stage, then source
    order = order[np.argsort(s[order].astype(np.uint16), kind="stable")]
    s, tb_, hg_, src = s[order], tb_[order], hg_[order], src[order]
    rows = np.column_stack([np.full(len(s), X_KV), tb_, hg_, src, (src + 1) % n, s])
    stage = (pl.cb_device - pl.home[g.cb_k]) % n
    return rows.astype(np.int64).reshape(-1, 6), stage.astype(np.int64)


def tree_data_rows(need: list, per_node: int, nodes: int) -> list[np.ndarray]:
    """The Q and the KV rows of ``relay=tree``: node relays across nodes
    (:func:`relay_rows`), then recursive doubling inside each node (:func:`tree_rows`)."""
    return [tree_rows(relay_rows(k, need[k], per_node)[0] if nodes > 1 else _rows(k, need[k], 0), per_node)
            for k in (X_Q, X_KV)]


def _staged(g, pl, need, data: list[np.ndarray]) -> Schedule:
    """The schedule of routed Q and KV rows: as many stages as their last
    hop needs, every compute block in the stage its last operand arrives,
    the partial outputs from the last."""
    stages = 1 + max((int(r[:, XSTAGE].max()) for r in data if len(r)), default=0)
    return Schedule(stages, arrival_stage(g, pl, data), np.concatenate(data + [_rows(X_O, need[X_O], stages - 1)]))


@register
@dataclass(frozen=True, slots=True)
class Comm(Pass):
    name = "comm"
    needs = ("graph", "placement")
    mode: str = "p2p"
    relay: str = "none"  # "node": DCP's two-phase inter-node transfer (p2p only; default pipelines use it);
    #                      "tree": node relays, then recursive doubling inside each node (tree_rows)
    reduce: str = "none"  # "node": partials summed inside their node before they cross (p2p only; reduce_rows)

    def __post_init__(self):
        if self.mode not in MODES:
            raise PlanError(f"comm: mode must be {', '.join(MODES[:-1])} or {MODES[-1]}, got {self.mode!r}")
        if self.relay not in ("none", "node", "tree"):
            raise PlanError(f"comm: relay must be none, node or tree, got {self.relay!r}")
        if self.relay != "none" and self.mode != "p2p":
            raise PlanError(f"comm: relay={self.relay} needs mode=p2p (got mode={self.mode})")
        if self.reduce not in ("none", "node"):
            raise PlanError(f"comm: reduce must be none or node, got {self.reduce!r}")
        if self.reduce == "node" and self.mode != "p2p":
            raise PlanError(f"comm: reduce=node needs mode=p2p (got mode={self.mode})")

    def spec(self) -> str:
        """Its options, ``reduce`` only when on (pipelines without it read as they always did)."""
        return f"comm{{mode={self.mode},relay={self.relay}" + (f",reduce={self.reduce}}}" if self.reduce != "none"
                                                                else "}")

    def apply(self, ir: PlanIR) -> PlanIR:
        out = self._apply(ir)
        if self.reduce == "node" and out.need_placement().nodes > 1:
            out = out.with_levels(schedule=dataclasses.replace(out.need_schedule(), reduce=True))
        return out

    def _apply(self, ir: PlanIR) -> PlanIR:
        g, pl = ir.need_graph(), ir.need_placement()
        need = needed_transfers(g, pl)
        if self.relay == "tree":
            return ir.with_levels(schedule=self._tree(g, pl, need))
        if self.relay == "node" and pl.nodes > 1:
            return ir.with_levels(schedule=self._relayed(g, pl, need))
        if self.mode == "a2a":
            xfer = np.concatenate([_rows(X_Q, need[X_Q], 0), _rows(X_KV, need[X_KV], 0), _rows(X_O, need[X_O], 0)])
            return ir.with_levels(schedule=Schedule(1, np.zeros(g.n_cb, np.int64), xfer, collective=True))
        if self.mode == "p2p" or pl.devices == 1:
            stages = 1
            kv = _rows(X_KV, need[X_KV], 0)
            cb_stage = np.zeros(g.n_cb, np.int64)
        elif self.mode == "allgather_ring":
            stages = pl.devices
            kv, _ = ring_kv(g, pl)
            cb_stage = np.full(g.n_cb, stages - 1, np.int64)
        elif self.mode == "allgather":
            stages = 1
            kv = allgather_kv(g, pl)
            cb_stage = np.zeros(g.n_cb, np.int64)
        else:
            stages = pl.devices
            kv, cb_stage = ring_kv(g, pl)
        xfer = np.concatenate([_rows(X_Q, need[X_Q], 0), kv, _rows(X_O, need[X_O], stages - 1)])
        return ir.with_levels(schedule=Schedule(stages, cb_stage, xfer))

    @staticmethod
    def _relayed(g, pl, need) -> Schedule:
        return _staged(g, pl, need, [relay_rows(k, need[k], pl.devices_per_node)[0] for k in (X_Q, X_KV)])

    @staticmethod
    def _tree(g, pl, need) -> Schedule:
        return _staged(g, pl, need, tree_data_rows(need, pl.devices_per_node, pl.nodes))


LOCAL_ORDERS = ("first", "last", "kept")  # overlap{local=...}


@register
@dataclass(frozen=True, slots=True)
class Overlap(Pass):
    """Post each stage's transfers during the previous stage's compute, wait
    for a block right before the kernel run that first uses it, and send
    partial outputs home as soon as their run is done (see
    :mod:`attnplan.passes.emit`); a collective schedule (``comm{mode=a2a}``)
    stays as it is.

    ``run`` (FLOPs): a device's blocks for its remote partners share one
    kernel run until the remote work before a partner's blocks reaches
    another multiple of ``run`` (:func:`attnplan.passes.emit.compute_runs`;
    0: one run per partner). A run costs one launch (5 µs on the GPU
    profiles, 12.5 µs backward) and waits for all of its partners' data;
    3e10 FLOPs is about 50 µs of an H100's attention, ten launches. Measured
    with the h100 profile (8/2 heads x 128, 32 devices on 4 nodes), the
    128K batches' best plan per batch, median pred / bound (worst): 0 ->
    2.21 (4.10), 3e10 -> 2.13 (4.08), 1e11 -> 2.13 (4.35). Strategies whose
    partners' data arrive far apart take 0 in their default pipeline
    (``default_run``: tile_pool 7.09 at 0 against 8.10, usp 4.69 against
    5.01, same batches).

    ``local``: where the backward runs a device's blocks that need nothing
    remote — ``first`` (while its remote data is on the way), ``last``
    (after every block that writes a partial output, in its last stage: its
    partials travel home while it computes its own; the first remote data is
    then waited for with nothing to do), or ``kept`` (the default: ``last``
    where the backward keeps the forward's KV, ``Problem.keep_kv``, so that
    a device's first blocks wait for nothing, else ``first``). Measured in
    docs/results.md ("Own blocks last in the backward")."""

    name = "overlap"
    needs = ("graph", "placement", "schedule")
    run: float = DEFAULT_RUN
    local: str = "kept"

    def __post_init__(self):
        if not 0.0 <= self.run <= 1e30:
            raise PlanError(f"overlap: run must be FLOPs in [0, 1e30], got {self.run}")
        if self.local not in LOCAL_ORDERS:
            raise PlanError(f"overlap: local must be {', '.join(LOCAL_ORDERS[:-1])} or {LOCAL_ORDERS[-1]}, "
                            f"got {self.local!r}")

    def spec(self) -> str:
        """``overlap`` with its options that are not the defaults (``overlap{run=F,local=last}``)."""
        opts = ([f"run={self.run:g}"] if self.run != DEFAULT_RUN else []) + \
            ([f"local={self.local}"] if self.local != "kept" else [])
        return "overlap" + (f"{{{','.join(opts)}}}" if opts else "")

    def apply(self, ir: PlanIR) -> PlanIR:
        s = ir.need_schedule()
        if s.collective:  # an all-to-all is a blocking exchange: nothing to overlap
            return ir
        last = self.local == "last" or (self.local == "kept" and ir.problem.keep_kv)
        return ir.with_levels(schedule=dataclasses.replace(s, overlap=True, run_flops=float(self.run),
                                                           local_last=last))
