"""``auto``: rank the strategies by a cheap estimate of their placement, then
compile and simulate only the promising ones.

Compiling and simulating every strategy costs the sum of all of them (10–34 s
at 1M tokens, issue 9). Much of that is lowering (comm, emit, the verifier on
the program) and the event simulation, and the placement alone already bounds
what a strategy can reach: a placement whose busiest device has more work
than the best simulated plan's whole makespan cannot win.

0. **Preview** (:mod:`attnplan.tools.auto_preview`) the strategies whose placement is segments homed on devices
   with compute where Q lives (zigzag, per_doc, dacp: their pass has
   ``segments(ir)``): :func:`segment_bound` bounds their estimate from the
   segments alone, without tiles — the busiest device's query blocks (one
   kernel launch each at least, one in all with a fused profile; one per
   device for per_doc's and dacp's varlen groups) and pairs. A strategy
   whose lower bound already loses is never tiled. Over more than
   :data:`SAMPLE_SEGMENTS` segments the preview is taken first over the
   longest samples only (:func:`sample_docs`; a lower bound of the whole
   preview), refined when it comes up over :data:`SAMPLE_GROWTH` times as
   many, up to all of them (per_doc, the 4M batch at 128 devices: 590,760
   segments, 0.73 s for the whole preview, 0.04 s for its 64 longest
   documents, which already prune it; 100,000 short documents at 8 devices:
   1.4M segments, 1.8 s whole, pruned at the second tier).
1. **Place**: ``tile`` (once, shared) and the strategy pass of each default
   pipeline (:func:`attnplan.passes.default.default_pipeline`). The mask is lowered
   once for all of them. Candidates are not verified pass by pass: the
   chosen plan is, every level of it (``verify``), before it is returned —
   the verifier was 40% of auto's time (cProfile, pretrain-128k-0 at 8 devices),
   spent mostly on plans that lose.
2. **Estimate** each placement (:func:`estimate`): per device and phase, its
   compute (:func:`attnplan.backends.cost.cb_seconds`: per-piece tile
   rounding, the dtype's rate; backward × ``bwd_factor``; launches as
   :func:`attnplan.backends.cost.launches` bounds them; plus merging the
   partial outputs it receives, :func:`_merges` — exactly the merge and add
   instructions emit will give it) and the time its send and its receive queue are busy with the transfers
   the placement needs (:func:`attnplan.ir.verify.needed_transfers`, or the
   ring of ``comm{mode=ring}``, or the node relays of ``relay=node``; ``bytes / bandwidth`` of the link per block,
   the bytes of :func:`attnplan.ir.program.buffer_bytes`, and ``alpha`` per
   message: per phase, source, destination, ring hop, data or partial — no
   more than the program's messages, which coalesce every block of one
   stage between two devices). A device can overlap
   its transfers with its compute but not do either faster, so a phase takes
   at least ``max over devices of max(compute, send, receive)`` (the load
   bound of a schedule, Graham 1969) — the estimate is that bound, forward +
   backward: the placement with no exposed communication. The simulator's
   makespan is never below it (every device runs its own compute blocks and
   waits for all its sends and receives, each queue serving one transfer at
   a time); on the shared batches it is 0.51–1.0 of the predicted time
   (median 0.87), lowest where inter-node traffic is exposed.
3. **Schedule bound** (:mod:`attnplan.tools.auto_schedule`): a placed
   candidate that comes up is scheduled (its pipeline up to ``emit``: comm,
   overlap, 1–4 ms) and bounded again with what the load bound cannot see —
   program order: the messages posted at time 0 start in an order known
   before emitting (each queue by the other end's id), so their arrivals
   are exact; a forward leaves after what it forwards arrived; a block waits
   for its operands' messages, a relay for what it forwards; a fused
   kernel launches once per run of blocks; a partial output leaves after its
   last writer, in the messages emit groups it in, and is merged after it
   arrives; a node reduce's sum across nodes leaves after its aggregator
   merged what it gathered (3–40 ms where emitting and simulating take
   20–300 ms). Tighter
   than the estimate: 0.91–1.0 of the predicted time for every strategy
   on libra-512k-0 at 32 devices, github-512k-1 at 64 and lmsys-512k-0 at
   256 (the forward alone exact for most), where the estimate is
   0.59–0.80; on the 4M batch at 32 devices, libra-512k-0 at 32 and 64,
   github-512k-1 at 64 and llama3sft-512k-0 at 256 only the winner is
   emitted. The first candidate goes through it too (it is never
   emitted before a lower schedule bound): on the 4M batch at 32 devices
   minheap has the lowest estimate and loses, and its schedule bound now
   says so before emitting it.
4. **Branch and bound** over those lower bounds, smallest first (:func:`search`):
   a strategy known only by its preview is placed when its preview comes
   up (its estimate is never below the preview); a placed one is scheduled
   and bounded (step 3); a scheduled one is emitted and simulated;
   the first bound at or above the best predicted time so far ends the
   search — as every bound is a lower bound, nothing after it can be
   faster, and nothing after it wins a tie (:func:`choice_key`: the lowest
   predicted time wins; equal predicted times go to the lower estimate,
   then the first name — a strategy popped later has no lower pair of
   them). Ties are common: where every document fits on one device, every
   balanced placement predicts the pure compute time (the pretraining
   batches at 8 devices: 6–8 candidates were finished only to tie). The
   choice is therefore the exhaustive search's (compile and simulate
   every strategy, keep the lowest :func:`choice_key`), at the cost of the
   previews, the placements that come up and the finished candidates
   (benchmarks/auto_bench.py);
   ``tests/test_auto.py`` checks the bounds and the choice. ``keep`` forces
   at least that many to be finished.
5. **The other order** (:func:`other_order`): the winner again with its
   backward's own blocks last (``overlap{local=last}``: its partial outputs
   travel home while it computes its own) where its default runs them
   first — the same placement and transfers in another order, so one more
   schedule bound and, unless that rules it out, one more simulation. The
   faster of the two is the plan (a tie keeps the default). The order is
   tried on the winner only: on the fourteen 128K batches at 32 devices
   the best of every candidate in both orders is each winner's best order
   (``benchmarks/gap.py --local``, docs/results.md).

Every registered strategy is searched, and each of its ``variants`` as a
strategy of its own (``span{grain=1}``, ``span{grain=2}``: the strategy pass
with those options, :func:`attnplan.passes.base.strategy_entries`).
A placed strategy enters the search as one candidate per schedule auto
tries for it (:func:`tails`): its default pipeline (node relays and node
reduces), and, for a p2p strategy on several nodes, ``name:relay`` (no node
reduces), ``name:direct`` (neither) and ``name:tree`` (relays, then
recursive doubling inside each node), each bounded by its own estimate.

The chosen plan's IR and pipeline are exactly those of ``compile(strategy=
winner)`` (``name:relay``, ``name:direct`` and ``name:tree`` too: the default
pipeline with the comm step of that variant; after step 5 it may be
``name overlap{local=last}``: that pipeline with ``overlap{local=last}``).
Its ``meta`` records, as pure functions of the inputs (no timings):
``candidates`` (predicted seconds of the simulated ones),
``estimates`` (the estimate of every strategy that was placed) and
``pruned`` (strategy → why it was not simulated: its bound — a preview
before placing, the estimate, or the schedule bound — against the best predicted time, or the
PlanError it raised). ``Plan.measured`` (in memory only) has the seconds of
every preview and placement and of every finished candidate.

Everything runs in this process, one thing at a time: a process pool for
the placements (``concurrent.futures``, forkserver, workers started with
attnplan imported) was 1.18x slower in the median than placing in this
process on this 2-core machine (0.84-2.51x over the 56 shared cases, load
1-4, measured with an earlier version of auto_bench.py); placing
hypergraph in a background thread while this one places the others
(Mt-KaHyPar releases the GIL) was 1.11-1.30x slower on five of six cases
(median of 7; its two worker threads and this one share two cores); two
compiles in two forked processes finish only 1.30x faster than one after
the other here; and placing tile_pool, minheap and usp in a forked child
(results sent back as msgpack arrays) while this process places hypergraph
took 372 ms against 346 ms one after the other (libra-512k-0 at 32
devices: hypergraph's placement went from 170 to 313 ms beside the child),
so there is none of them.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, replace

import numpy as np

from ..backends.cost import DTYPE_EFFICIENCY, cb_seconds, get_profile, launches, simulate
from ..backends.walk import merge_seconds
from ..errors import PlanError, VerifyError
from ..ir.module import PlanIR
from ..ir.program import B_DKV, B_DQ, B_KV, B_O, B_Q, BWD, FWD, buffer_bytes
from ..ir.schedule import X_KV, X_O, X_Q, XDST, XHG, XSRC, XSTAGE, XTB
from ..ir.verify import needed_transfers, verify
from ..passes import REGISTRY, parse_pipeline, run_pipeline, strategy_entries, strategy_name
from ..passes.comm import (COMM_VARIANTS, HOP_CROSS, HOP_GATHER, Overlap, default_reduce, default_relay, split_order,
                           reduced_partials, relay_rows, ring_kv, tree_data_rows)
from .auto_preview import SAMPLE_SEGMENTS, sample_docs, segment_bound
from .auto_schedule import schedule_bound

KEEP = 1  # finish at least this many candidates, best estimate first (the bound decides the rest)


@dataclass(frozen=True, slots=True)
class Estimate:
    """The placement bound of one strategy, in seconds (see the module doc)."""

    fwd_s: float
    bwd_s: float
    compute_s: float   # the busiest device's forward + backward compute
    comm_s: float      # the busiest device's forward + backward send or receive queue
    comm_bytes: int    # every transfer of both phases once (what the plan's transfers will total)
    relayed: int = 0   # Q and KV transfers forwarded inside a node (node relays, or the tree's hops)
    gathered: int = 0  # partials summed inside their node before crossing (node reduces)
    spread: int = 0    # the Q and KV transfers relay=tree forwards beyond the node relays' (0: the same plan)

    @property
    def total_s(self) -> float:
        return self.fwd_s + self.bwd_s


# ------------------------------------------------------------------------------------------ the estimate

def _queues(n: int, per_node: int, prof, parts) -> tuple[np.ndarray, int]:
    """Per device, the busier of its send and receive queue for ``parts``
    (``(src, dst, bytes, group)`` arrays of transfers, ``group`` telling the
    messages apart between the same two devices): ``bytes / bandwidth`` per
    transfer and ``alpha`` per distinct (src, dst, group); and their bytes."""
    send, recv, total = np.zeros(n), np.zeros(n), 0
    src, dst, nbytes, group = (np.concatenate([p[i] for p in parts]).astype(np.int64) for i in range(4))
    inter = (src // per_node) != (dst // per_node)
    sec = nbytes / np.where(inter, prof.inter_bw, prof.intra_bw)
    send += np.bincount(src, weights=sec, minlength=n)
    recv += np.bincount(dst, weights=sec, minlength=n)
    msg = np.unique((group * n + src) * n + dst)
    ms, md = (msg // n) % n, msg % n
    alpha = np.where((ms // per_node) != (md // per_node), prof.inter_alpha, prof.intra_alpha)
    send += np.bincount(ms, weights=alpha, minlength=n)
    recv += np.bincount(md, weights=alpha, minlength=n)
    total += int(nbytes.sum())
    return np.maximum(send, recv), total


def _routes(g, pl, need, mode: str, relay: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Q and KV transfers as rows ``(tb, hg, src, dst)`` with the message group
    of each (its stage: the ring hop, or the relay stage), routed as
    ``comm{mode=mode,relay=relay}`` routes them: the needed ones (p2p), every
    hop of the ring, or p2p with node relays (:func:`relay_rows`) or with
    relays and an in-node tree (``relay=tree``: its stage is the group)."""
    q, kv = need[X_Q], need[X_KV]
    if mode == "p2p" and relay == "tree":
        rq, rkv = tree_data_rows(need, pl.devices_per_node, pl.nodes)
        return rq[:, [XTB, XHG, XSRC, XDST]], rq[:, XSTAGE], rkv[:, [XTB, XHG, XSRC, XDST]], rkv[:, XSTAGE]
    if mode == "ring" and pl.devices > 1:
        rows, _ = ring_kv(g, pl)
        return q, np.zeros(len(q), np.int64), rows[:, [XTB, XHG, XSRC, XDST]], rows[:, XSTAGE]
    if mode == "p2p" and relay == "node" and pl.nodes > 1:
        rq, _ = relay_rows(X_Q, q, pl.devices_per_node)
        rkv, _ = relay_rows(X_KV, kv, pl.devices_per_node)
        return rq[:, [XTB, XHG, XSRC, XDST]], rq[:, XSTAGE], rkv[:, [XTB, XHG, XSRC, XDST]], rkv[:, XSTAGE]
    return q, np.zeros(len(q), np.int64), kv, np.zeros(len(kv), np.int64)


def estimate(ir: PlanIR, prof, comm_mode: str = "p2p", relay: str | None = None,
             reduce: str | None = None) -> Estimate:
    """The bound of step 2 of the module doc for a placed IR (graph and
    placement) under the cost profile ``prof``, its transfers routed as
    ``comm{mode=comm_mode,relay=relay,reduce=reduce}`` would route them
    (None: the default pipeline's, :func:`attnplan.passes.comm.default_relay`
    and :func:`~attnplan.passes.comm.default_reduce`)."""
    return estimates(ir, prof, comm_mode, [(relay, reduce)])[0]


def estimates(ir: PlanIR, prof, comm_mode: str, routes: list, spread: bool = True) -> list[Estimate]:
    """:func:`estimate` for each ``(relay, reduce)`` of ``routes``, sharing
    what they share (compute, the needed transfers, each relay's and each
    reduce's routes): auto bounds a placement's default and its other
    schedules (:func:`comm_variants`) at once. ``spread``: fill
    ``Estimate.spread`` (it routes the tree; 0 without)."""
    g, pl = ir.need_graph(), ir.need_placement()
    n, per_node = pl.devices, pl.devices_per_node
    rate = DTYPE_EFFICIENCY.get(g.problem.dtype, 1.0)
    fwd_cb = cb_seconds(g, prof, launch=False) / rate
    blocks = np.bincount(pl.cb_device, minlength=n)
    compute = np.bincount(pl.cb_device, weights=fwd_cb, minlength=n) + prof.launch_s * launches(blocks, prof) / rate
    need = needed_transfers(g, pl)
    data: dict = {}
    partials: dict = {}
    out = []
    def routed(relay):
        if relay not in data:
            data[relay] = _routes(g, pl, need, comm_mode, relay)
        return data[relay]

    for relay, reduce in routes:
        relay = default_relay(comm_mode) if relay is None else relay
        reduce = default_reduce(comm_mode) if reduce is None else reduce
        on = comm_mode == "p2p" and reduce == "node"
        if on not in partials:
            partials[on] = (_partial_routes(need[X_O], pl, on), _partial_routes(need[X_KV][:, [0, 1, 3, 2]], pl, on))
        est = _estimate(g, pl.home, n, per_node, prof, compute, comm_mode, routed(relay), partials[on])
        if spread and comm_mode == "p2p" and relay == "node" and pl.nodes > 1:  # whether the tree is another plan
            est = replace(est, spread=_forwarded(routed("tree"), pl.home) - est.relayed)
        out.append(est)
    return out


def _forwarded(data: tuple, home: np.ndarray) -> int:
    """Q and KV transfers of routes (:func:`_routes`) sent by a device that is not the block's home."""
    q, _, kv, _ = data
    return int((q[:, 2] != home[q[:, 0]]).sum() + (kv[:, 2] != home[kv[:, 0]]).sum())


def _estimate(g, home: np.ndarray, n: int, per_node: int, prof, compute: np.ndarray, comm_mode: str, data: tuple,
              partials: tuple) -> Estimate:
    """One schedule's estimate from its routes (:func:`estimates`)."""
    q, q_hop, kv, hop = data
    (o, o_hop), (dkv, dkv_hop) = partials
    relayed = _forwarded(data, home) if comm_mode == "p2p" else 0
    PARTIAL = -1  # partials travel apart from data (a group of their own; a node's sums another)

    def part(rows: np.ndarray, phase: int, kind: int, group):
        return rows[:, 2], rows[:, 3], buffer_bytes(g, phase, kind, rows[:, 0], rows[:, 1], wire=True), \
            np.broadcast_to(group, len(rows)) + 1

    o_grp, dkv_grp = PARTIAL - (o_hop == HOP_CROSS), PARTIAL - (dkv_hop == HOP_CROSS)
    comm_f, bytes_f = _queues(n, per_node, prof, [part(q, FWD, B_Q, q_hop), part(kv, FWD, B_KV, hop),
                                                   part(o, FWD, B_O, o_grp)])
    data_b = [part(q, BWD, B_Q, q_hop)] + ([] if g.problem.keep_kv else [part(kv, BWD, B_KV, hop)])  # keep_kv: the
    #                                                              backward computes with the forward's KV copies
    comm_b, bytes_b = _queues(n, per_node, prof, data_b + [part(o, BWD, B_DQ, o_grp), part(dkv, BWD, B_DKV, dkv_grp)])
    merge_f, merge_b = _merges(g, n, prof, o, dkv)
    comp_f, comp_b = compute + merge_f, compute * prof.bwd_factor + merge_b
    gathered = int((o_hop == HOP_GATHER).sum() + (dkv_hop == HOP_GATHER).sum())
    return Estimate(float(np.maximum(comp_f, comm_f).max()), float(np.maximum(comp_b, comm_b).max()),
                    float((comp_f + comp_b).max()), float((comm_f + comm_b).max()), bytes_f + bytes_b, relayed,
                    gathered)


def _partial_routes(rows: np.ndarray, pl, reduce: bool) -> tuple[np.ndarray, np.ndarray]:
    """Partial rows ``(tb, hg, src, dst)`` (``src`` computes, ``dst`` is
    home) as they travel, with the hop of each (:data:`HOP_CROSS` for a
    node's sum, a message group apart): straight home, or under a node
    reduce as :func:`attnplan.passes.comm.reduce_rows` routes them."""
    if not (reduce and pl.nodes > 1) or not len(rows):
        return rows, np.zeros(len(rows), np.int64)
    return reduced_partials(rows, pl.devices_per_node)


def _merges(g, n: int, prof, o: np.ndarray, dkv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per device, the seconds of merging the partial outputs it receives
    (forward O, backward dQ and dKV, at their home or at their node's
    aggregator): emit merges each received partial block after its compute,
    an instruction of its stream that reads and writes its bytes
    (:func:`attnplan.backends.walk.merge_seconds`, as the simulator charges it).
    ``o``, ``dkv``: the partial rows as they travel (src sends, dst merges)."""
    def at(dst, phase, kind, rows):
        sec = merge_seconds(buffer_bytes(g, phase, kind, rows[:, 0], rows[:, 1], wire=True).astype(float), prof.mem_bw)
        return np.bincount(dst, weights=sec, minlength=n)
    return at(o[:, 3], FWD, B_O, o), at(o[:, 3], BWD, B_DQ, o) + at(dkv[:, 3], BWD, B_DKV, dkv)


# ------------------------------------------------------------------------------------------ the search

def _split(passes: list) -> tuple[list, list]:
    """(tile and the placement pass, the rest) of a default pipeline."""
    i = next((k for k, p in enumerate(passes) if type(p).strategy), len(passes) - 1)
    return passes[:i + 1], passes[i + 1:]


def problem_ir(kwargs: dict) -> PlanIR:
    """The unplaced IR of ``compile``'s checked arguments (the mask lowered once)."""
    from ..frontend.lower import lower_heads
    from ..ir.problem import Problem
    lens, segments, prog, q_lens = kwargs["seqlens"], kwargs["segments"], kwargs["mask"], kwargs.get("q_lens")
    pieces, ptr, classes = lower_heads(prog, lens.tolist(), segments, q_lens, kwargs["heads"])
    problem = Problem(seqlens=lens, heads=kwargs["heads"], kv_heads=kwargs["kv_heads"], head_dim=kwargs["head_dim"],
                      pieces=pieces, mask=prog.source, segments=segments, dtype=kwargs["dtype"], q_lens=q_lens,
                      head_class=classes, class_ptr=ptr, partials_dtype=kwargs.get("partials_dtype", "float32"),
                      keep_kv=kwargs.get("keep_kv", False))
    return PlanIR(problem, kwargs["devices"], kwargs["nodes"], kwargs["memory_cap"])


def _reason(e: PlanError) -> str:
    """A PlanError as a short reason for ``meta["pruned"]``."""
    first = (str(e).splitlines() or [""])[0]
    return f"PlanError: {first if len(first) <= 300 else first[:297] + '...'}"


@dataclass(frozen=True, slots=True)
class Placed:
    """One strategy after step 1: its placed IR and estimate, or the PlanError it raised."""

    name: str
    ir: PlanIR | None = None
    estimate: Estimate | None = None
    error: str = ""
    seconds: float = 0.0   # measured (Plan.measured only, never meta)
    others: tuple = ()     # (variant, comm options, estimate) of its other schedules (:func:`comm_variants`)

    @property
    def total_s(self) -> float:
        """The estimate, or infinity for a strategy that could not place the batch."""
        return math.inf if self.estimate is None else self.estimate.total_s


def _heads(kwargs: dict) -> dict[str, list]:
    """Per strategy entry (each strategy and its ``variants``, ``span{grain=2}``): the tile pass and the
    placement pass of its default pipeline."""
    from ..passes.default import default_pipeline
    return {name: _split(parse_pipeline(default_pipeline(name, kwargs["block_size"])))[0]
            for name in strategy_entries()}


def _run(ir: PlanIR, passes: list, kwargs: dict) -> PlanIR:
    """``passes`` on a candidate, unverified (:func:`compile_auto` verifies the chosen plan)."""
    return run_pipeline(ir, passes, verify_each=False, instruments=kwargs["instruments"],
                        max_compute_blocks=kwargs["max_compute_blocks"])


def place(name: str, tiled: PlanIR, strategy_pass, kwargs: dict, prof) -> Placed:
    """Steps 1 and 2 for strategy ``name`` on the tiled IR (a PlanError becomes ``Placed.error``)."""
    t0 = time.perf_counter()
    try:
        ir = _run(tiled, [strategy_pass], kwargs)
        mode = REGISTRY[strategy_name(name)].default_comm
        several = mode == "p2p" and ir.need_placement().nodes > 1
        tree = several and REGISTRY[strategy_name(name)].tree
        est, *rest = estimates(ir, prof, mode, [(None, None)] + ([(None, "none"), ("none", "none")] if several else [])
                               + ([("tree", None)] if tree else []), spread=tree)
    except PlanError as e:
        return Placed(name, error=_reason(e), seconds=time.perf_counter() - t0)
    by = dict(zip(("relay", "direct", "tree"), rest))
    others = tuple((v, comm, by[v]) for v, comm in comm_variants(name, est))
    return Placed(name, ir, est, seconds=time.perf_counter() - t0, others=others)


def preview(strategy_pass, tiled: PlanIR, prof, max_blocks: int | None = None, docs: np.ndarray | None = None,
            segments: tuple[np.ndarray, np.ndarray] | None = None) -> float:
    """Step 0: :func:`segment_bound` of a strategy whose pass exposes its
    segments (``segments(ir)``: zigzag, per_doc, dacp; or the ``segments``
    given), else 0 (it must be placed to be bounded); over the samples
    ``docs`` only if given (no refusal by count then). Raises the
    strategy's PlanError."""
    fn = getattr(strategy_pass, "segments", None)
    if fn is None:
        return 0.0
    starts, devices = fn(tiled) if segments is None else segments
    grouped = getattr(strategy_pass, "varlen", 0) != 0  # per_doc and dacp pack varlen groups by default
    return segment_bound(tiled, starts, devices, prof, None if docs is not None else max_blocks, grouped, docs)


@dataclass(frozen=True, slots=True, eq=False)
class Sampled:
    """A heap entry's state for a strategy bounded from its longest samples
    only, those holding at most ``limit`` of its segments (:func:`sample_docs`;
    ``docs`` of them): popped, it is bounded from :data:`SAMPLE_GROWTH` times
    as many, up to all its segments."""

    docs: int
    limit: int
    segments: tuple


SAMPLE_GROWTH = 8  # each refinement of a sampled preview takes up to 8x the segments of the one before


def next_bound(name: str, strategy_pass, tiled: PlanIR, prof, max_blocks: int | None, limit: int | None,
               segments=None):
    """A strategy's heap entry over the longest samples holding at most
    ``limit`` of its segments (a :class:`Sampled` state), or over all of them
    (state None) where that is every segment — or where it has no segments
    (bound 0: it must be placed to be bounded)."""
    fn = getattr(strategy_pass, "segments", None)
    if fn is None:
        return 0.0, name, None
    segments = fn(tiled) if segments is None else segments
    docs = None if limit is None else sample_docs(tiled.problem, segments[0], limit)
    if docs is None or limit is None:
        return preview(strategy_pass, tiled, prof, max_blocks, segments=segments), name, None
    return (preview(strategy_pass, tiled, prof, docs=docs, segments=segments), name,
            Sampled(len(docs), limit, segments))


def tails(p: Placed, prof) -> list[tuple[str, str | None, float]]:
    """The schedules auto tries for a placed strategy, as (candidate name,
    comm options or None for the default pipeline's, lower bound): the
    default, and for a p2p strategy on several nodes the same transfers
    with node relays but without node reduces (``name:relay``; the reduce
    wins the median but loses on some batches: a node's sum leaves only
    after its aggregator's last block), unless the reduce sums nothing or
    the relay forwards nothing (then it is ``name:direct``), and without
    either (``name:direct``; the relay loses on some batches too: its relayed
    blocks' compute waits for a second stage), unless neither does anything;
    and with the in-node tree (``name:tree``: node relays, then recursive
    doubling inside each node, :func:`attnplan.passes.comm.tree_rows`) where
    it forwards more than the relays (``Estimate.spread``) and the strategy
    gives each document a set of devices that gather its KV (``tree``: span,
    per_doc, dacp, usp). It wins where one document spans whole nodes
    (lmsys-128k-0 at 32 devices: 3.12 -> 2.52 of the bound) and loses where
    documents span a few devices (its blocks reach the last members a stage
    or two later). Over the 28 shared batches at 32 devices (auto_bench's
    exhaustive runs) the tree made per_doc and dacp faster on every batch
    (median 1.11x and 1.10x) and usp on 17 of 26, but hypergraph, minheap and
    tile_pool, whose devices gather from scattered tiles, slower (median
    0.95x, 0.95x, 0.91x; never the best plan): they do not try it, which
    keeps auto within 2x of its slowest strategy.
    ``divide`` and turning ``overlap`` off are not tried: on the 128K
    batches at 8 devices neither ever predicted a faster plan; the
    backward's other order is tried on the winner (:func:`other_order`)."""
    return [(p.name, None, p.total_s)] + [(f"{p.name}:{v}", comm, e.total_s) for v, comm, e in p.others]


def comm_variants(name: str, est: Estimate) -> list[tuple[str, str]]:
    """The other schedules of ``name`` auto tries (variant, comm options),
    given its default's estimate ``est``: only those that are another plan
    than the default (:func:`tails`; the exhaustive search the same)."""
    mode = REGISTRY[strategy_name(name)].default_comm
    if mode != "p2p" or default_relay(mode) == "none":
        return []
    out = [("relay", COMM_VARIANTS["relay"])] if est.gathered > 0 and est.relayed > 0 else []
    if est.gathered > 0 or est.relayed > 0:
        out.append(("direct", "mode=p2p"))
    if est.spread > 0 and REGISTRY[strategy_name(name)].tree:
        out.append(("tree", COMM_VARIANTS["tree"]))
    return out


@dataclass(frozen=True, slots=True, eq=False)
class Scheduled:
    """A heap entry's state for a candidate scheduled (its pipeline up to
    ``emit``) and bounded by :func:`attnplan.tools.auto_schedule.schedule_bound`:
    popped, it is emitted and simulated."""

    ir: PlanIR
    passes: list


def schedule(p: Placed, kwargs: dict, comm: str | None = None) -> Scheduled:
    """``p``'s default pipeline (its comm step's options replaced by
    ``comm``, if given) from its placement up to, not including, ``emit``."""
    from ..passes.default import default_pipeline
    if p.ir is None:
        raise PlanError(f"{p.name} has no placement to finish ({p.error})")
    passes = parse_pipeline(default_pipeline(p.name, kwargs["block_size"], comm))
    rest = _split(passes)[1]
    return Scheduled(_run(p.ir, rest[:-1], kwargs), passes)


def emit_and_simulate(s: Scheduled, kwargs: dict, prof) -> tuple[PlanIR, list, float, float]:
    """The rest of a scheduled candidate's pipeline (``emit``) and the simulation:
    (IR, the whole pipeline's passes, predicted seconds, of which the forward's)."""
    ir = _run(s.ir, s.passes[-1:], kwargs)
    sim = simulate(ir, prof)
    return ir, s.passes, sim["predicted_s"], sim["fwd"]["makespan_s"]


_SHADE = 3e-9  # a schedule bound enters the heap this much lower: one at or above the best then exceeds it by 2e-9,
#                so its predicted time cannot round (choice_key) to the best's and win the tie on its estimate


def scheduled_bound(s: Scheduled, estimate_s: float, prof) -> float:
    """A scheduled candidate's heap bound: its estimate or its schedule bound (shaded, ``_SHADE``)."""
    fwd, bwd = schedule_bound(s.ir, prof)
    return max(estimate_s, (fwd + bwd) * (1 - _SHADE))


_REL = 1e-9  # the bound and the prediction are exact up to summation order: equal within this relative slack


def choice_key(predicted_s: float, estimate_s: float, name: str) -> tuple[float, float, str]:
    """What auto minimizes over the candidates (and the exhaustive search
    with it): the predicted time, rounded to 10 significant digits (two plans
    predicted equal up to summation order tie), then the estimate (the
    placement bound: among equally fast plans the one with the lighter
    busiest device or queue), then the name."""
    return float(f"{predicted_s:.9e}"), estimate_s, name


def candidate_estimate(ir: PlanIR, key: str, prof) -> float:
    """The estimate auto gives candidate ``key`` (``name``, ``name:relay``,
    ``name:direct`` or ``name:tree``) from its placed or compiled IR (comm, overlap and
    emit change neither graph nor placement)."""
    name, _, variant = split_order(key)[0].partition(":")
    mode = REGISTRY[strategy_name(name)].default_comm
    relay = "none" if variant == "direct" else "tree" if variant == "tree" else None
    reduce = "none" if variant in ("direct", "relay") else None
    return estimate(ir, prof, mode, relay, reduce).total_s


def search(base: PlanIR, kwargs: dict, prof, keep: int = KEEP):
    """Steps 0–4 as one branch and bound over lower bounds, smallest first
    (ties by name): a strategy not yet placed has its :func:`preview` bound,
    a placed one its estimate, a scheduled one the larger of its estimate and
    its schedule bound (:func:`scheduled_bound`), a finished one its predicted
    time. Popping an unplaced strategy places it (its estimate is never below
    its preview); popping a placed one schedules it; popping a scheduled one
    emits and simulates it. Once ``keep`` are finished, the first bound at
    or above the best predicted time ends the search: it and everything
    after it cannot win, not even a tie (:func:`choice_key`: its estimate, at
    least its bound, is not below the best's, and on equal estimates its
    name comes later; or its schedule bound is above the best's predicted
    time by more than rounding). Returns (the winner as (name, IR,
    passes, its simulated forward seconds) or None, predicted seconds of the finished ones, estimates of the
    placed ones, pruned name -> reason, measured seconds: ``place_s`` and
    ``finish_s`` per strategy)."""
    heads = _heads(kwargs)
    tiled_by: dict[str, PlanIR] = {}
    pruned: dict[str, str] = {}
    seconds: dict[str, float] = {}   # per strategy: preview and placement
    finishing: dict[str, float] = {}  # per scheduled candidate: the rest of its pipeline, bound and simulation
    heap: list = []
    for name, (tile, strat) in heads.items():
        t0 = time.perf_counter()
        try:
            if tile.spec() not in tiled_by:
                tiled_by[tile.spec()] = _run(base, [tile], kwargs)
            heapq.heappush(heap, next_bound(name, strat, tiled_by[tile.spec()], prof, kwargs["max_compute_blocks"],
                                            SAMPLE_SEGMENTS))
        except PlanError as e:
            pruned[name] = _reason(e)
        seconds[name] = time.perf_counter() - t0
    best, candidates, estimates = _branch_and_bound(heap, heads, tiled_by, kwargs, prof, keep, pruned, seconds,
                                                    finishing)
    return best, candidates, estimates, pruned, {"place_s": seconds, "finish_s": finishing}


def _branch_and_bound(heap, heads, tiled_by, kwargs, prof, keep, pruned, seconds, finishing):
    """The loop of :func:`search` over its heap of ``(bound, name, state)``:
    state :class:`Sampled` (a preview over some samples), None (the whole
    preview: place it next), (placed, comm options) (schedule it next) or
    :class:`Scheduled` (emit and simulate it next)."""
    best: tuple[str, PlanIR, list] | None = None
    candidates: dict[str, float] = {}
    estimates: dict[str, float] = {}
    while heap:
        bound, name, p = heapq.heappop(heap)
        if best is not None and len(candidates) >= keep and bound >= candidates[best[0]] * (1 - _REL):
            for b, n, q in [(bound, name, p)] + sorted(heap, key=lambda e: (e[0], e[1])):
                how = _bound_source(q)
                pruned[n] = (f"lower bound {b * 1e3:.4g} ms{how} >= {candidates[best[0]] * 1e3:.4g} ms, the "
                             f"predicted time of {best[0]}")
            break
        if isinstance(p, Sampled):
            tile, strat = heads[name]
            t0 = time.perf_counter()
            try:
                finer, _, state = next_bound(name, strat, tiled_by[tile.spec()], prof, kwargs["max_compute_blocks"],
                                             p.limit * SAMPLE_GROWTH, p.segments)
                heapq.heappush(heap, (max(bound, finer), name, state))
            except PlanError as e:
                pruned[name] = _reason(e)
            seconds[name] += time.perf_counter() - t0
            continue
        if p is None:
            tile, strat = heads[name]
            placed = place(name, tiled_by[tile.spec()], strat, kwargs, prof)
            seconds[name] += placed.seconds
            if placed.estimate is None:
                pruned[name] = placed.error
                continue
            t0 = time.perf_counter()
            for key, comm, b in tails(placed, prof):
                estimates[key] = b
                heapq.heappush(heap, (b, key, (placed, comm)))
            seconds[name] += time.perf_counter() - t0
            continue
        t0 = time.perf_counter()
        try:
            if not isinstance(p, Scheduled):
                p = schedule(p[0], kwargs, p[1])
                heapq.heappush(heap, (scheduled_bound(p, estimates[name], prof), name, p))
                continue
            ir, passes, candidates[name], forward = emit_and_simulate(p, kwargs, prof)
        except PlanError as e:
            pruned[name] = _reason(e)
            continue
        finally:
            finishing[name] = finishing.get(name, 0.0) + time.perf_counter() - t0
        if best is None or (choice_key(candidates[name], estimates[name], name) <
                            choice_key(candidates[best[0]], estimates[best[0]], best[0])):
            best = (name, ir, passes, forward)
    return best, candidates, estimates


def _bound_source(state) -> str:
    """Where a pruned heap entry's bound came from, for its reason."""
    if isinstance(state, Scheduled):
        return " from its schedule"
    if isinstance(state, Sampled):
        return f" from its segments in its {state.docs} longest samples, before placing"
    return " from its segments, before placing" if state is None else ""


OTHER_ORDER = " overlap{local=last}"  # step 5's candidate: ``name`` + this, its default pipeline in that order


def other_order(best: tuple, predicted_s: float, estimate_s: float, kwargs: dict, prof):
    """Step 5 (module doc): the winner ``best`` (name, IR, passes, its
    simulated forward) with its backward's own blocks last
    (``overlap{local=last}``) where its default runs them first — the same
    placement and transfers, another order: its schedule with
    ``local_last``, as ``overlap{local=last}`` makes it — as (candidate
    name, (IR, passes) or None, its predicted seconds or why it was not
    simulated); None where there is no other order to try (no overlap, an
    all-to-all, already last: the KV kept). Its forward is the winner's
    (the order changes the backward only), so its bound is that forward's
    simulated time and its backward's schedule bound."""
    name, ir, passes, forward_s = best
    i = next((k for k, p in enumerate(passes) if isinstance(p, Overlap)), None)
    s = ir.need_schedule()
    if i is None or i != len(passes) - 2 or s.collective or s.local_last:  # default pipelines: overlap, emit
        return None
    flipped = passes[:i] + [replace(passes[i], local="last")] + passes[i + 1:]
    key = name + OTHER_ORDER
    sched = Scheduled(ir.with_levels(schedule=replace(s, local_last=True)), flipped)
    bound = forward_s + schedule_bound(sched.ir, prof)[1]
    if bound >= predicted_s * (1 - _REL):
        return key, None, (f"lower bound {bound * 1e3:.4g} ms from its schedule >= {predicted_s * 1e3:.4g} ms, the "
                           f"predicted time of {name}")
    out_ir, out_passes, predicted, _ = emit_and_simulate(sched, kwargs, prof)
    return key, (out_ir, out_passes), predicted


def _try_other_order(best: tuple, candidates: dict, estimates: dict, pruned: dict, finishing: dict, kwargs: dict,
                     prof) -> tuple:
    """:func:`other_order` of the winner, recorded like any candidate (its estimate is the winner's: the same
    placement and transfers); the faster of the two (:func:`choice_key`: on a tie the default order)."""
    name = best[0]
    t0 = time.perf_counter()
    try:
        other = other_order(best, candidates[name], estimates[name], kwargs, prof)
    except PlanError as e:
        other = None
        pruned[name + OTHER_ORDER] = _reason(e)
    if other is None:
        return best[:3]
    key, done, result = other
    finishing[key] = time.perf_counter() - t0
    if done is None:
        pruned[key] = result
        return best[:3]
    candidates[key], estimates[key] = result, estimates[name]
    if choice_key(result, estimates[key], key) < choice_key(candidates[name], estimates[name], name):
        return (key, *done)
    return best[:3]


def compile_auto(kwargs: dict, keep: int = KEEP):
    """``compile(strategy="auto")`` on its checked arguments (``kwargs``: the
    options of ``check_options`` and seqlens, segments, mask, verify,
    instruments, max_compute_blocks). Returns the :class:`attnplan.tools.plan.Plan`."""
    from .plan import Plan
    t0 = time.perf_counter()
    prof = get_profile(kwargs["profile"])
    best, candidates, estimates, pruned, spent = search(problem_ir(kwargs), kwargs, prof, keep)
    if best is None:
        raise PlanError("auto: no strategy could plan this batch (" +
                        "; ".join(f"{n}: {r}" for n, r in sorted(pruned.items())) + ")")
    name, ir, passes = _try_other_order(best, candidates, estimates, pruned, spent["finish_s"], kwargs, prof)
    t1 = time.perf_counter()
    if kwargs["verify"]:
        try:
            verify(ir)
        except VerifyError as e:
            cap = ("; auto chooses by predicted time and does not search under a memory cap: compile a strategy "
                   "that fits, or raise the cap" if str(e).startswith("invariant 6") else "")
            raise VerifyError(f"auto: the chosen plan ({name}: {','.join(p.spec() for p in passes)}) does not "
                              f"verify: {e}{cap}") from None
    spent["verify_s"] = time.perf_counter() - t1
    meta = {"pipeline": ",".join(p.spec() for p in passes), "strategy": f"auto:{name}",
            "block_size": kwargs["block_size"], "profile": kwargs["profile"], "candidates": candidates,
            "estimates": dict(sorted(estimates.items())), "pruned": dict(sorted(pruned.items()))}
    measured = {"plan_s": time.perf_counter() - t0, **spent}
    return Plan(ir, meta, measured, prof)
