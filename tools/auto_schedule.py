"""The schedule bound of :mod:`attnplan.tools.auto` (its tier between the
placement estimate and the simulation): a lower bound of each phase's
simulated makespan from the scheduled IR (after ``comm`` and ``overlap``,
before ``emit``), which costs a few vectorized passes where emitting and
simulating cost tens of milliseconds.

The placement estimate is the load bound (every device's compute, send and
receive queue, each alone). What it misses is order: the simulator runs
each device's stream in program order (:func:`attnplan.passes.emit.
compute_order`: device, stage, local blocks first, ...), a block waits for
its received operands, a partial output leaves only after the block that
last writes it, and the home merges it only after it arrives. Per phase:

- **arrivals**: the data messages of stage 0 are posted by both ends at
  time 0, and the simulator starts them in an order known before emitting
  (:func:`_sweep`): each send queue by destination, each receive queue by
  source, back to back — so each arrives no earlier than the later of its
  two queues' running sums (exactly then without relays or ``divide``;
  tests compare). A forwarded block's message leaves after the message
  that brought it arrived and after both queues' stage-0 work;
- **head chain**: on device ``d`` the receive queue serves one message at a
  time from time 0, so block ``j`` cannot start before every data message
  first needed by ``d``'s blocks up to ``j`` has arrived — at least the sum
  of their seconds, ``A_j``, and at least each one's arrival; nor, at a
  stage's first block, before the waits of that stage's posting (a relay
  waits for what it forwards; without overlap a device waits for all it
  receives). With ``P_j`` the device's compute up to and including ``j``,
  ``j`` ends at ``E_j >= P_j + max(0, max_{i<=j} (A_i - P_{i-1}))`` (a list
  schedule on one machine with release dates);
- **launches**: with a fused profile the simulator charges a kernel launch
  per run of consecutive compute instructions; the bound charges one to
  each block that surely begins a run (:func:`_run_starts`: a device's
  first block, a block waiting for a message, the block after a send of
  partials), none elsewhere;
- **partials**: emit coalesces a device's partial outputs for one home
  into one message per stage of their last writers (:func:`_partial_messages`;
  tests compare with the emitted messages); it is sent at the end of its
  last row's last writing block (``E`` of it, its release ``r``), after
  both queues' stage-0 messages, and arrives at least ``alpha + bytes /
  bandwidth`` later, then the home merges its rows. Charging the latency
  per message, not per row as before, raised the backward bound at 256
  devices from 0.65–0.75 of the simulation to 0.95–1.0: a device's
  partials for some hundred homes are each mostly latency;
- **sums across nodes** (node reduces): an aggregator merges what its
  node gathered in its tail — after its last block, each gathered
  message after it arrives, one at a time (the one-machine bound below) —
  and only then sends each home the node's sum, one message per home,
  which the home merges in its tail. Left out before (the bound only
  dropped work), this was most of what the backward bound missed where
  one document spans nodes: 0.68–0.82 of the simulated backward for the
  span and dacp candidates of libra-128k-1 at 32 devices, 0.88–0.92 with it;
- **queues with release dates or tails**: the messages a device receives
  (or sends; it waits for all of them before it ends) take at least
  ``r + sum of the seconds of those released at or after r`` for every
  ``r`` (a partial or a forward is released on each queue after that
  queue's stage-0 messages); a data message's receiver still has every
  block from its first need on to run after it arrives (a tail), so on the
  sender ``q + sum of the seconds of those with a tail at least q`` (the
  one-machine bounds of Carlier, *The one-machine sequencing problem*,
  EJOR 1982, on heads and tails separately);
- **merges**: a home merges its partials one at a time after its last
  block, each after its message arrived: ``r + sum of the merges of those
  arriving at or after r`` for every ``r`` at or after its last block's
  end; and as a flow shop of its receive queue and its merges, ``r + sum
  of the seconds of the messages released at or after r`` plus the least
  merging among them (the last one's rows still have to be merged).

Each is a lower bound of the simulation with ``links="queue"`` (a message
holds its sender's and receiver's queue for ``alpha + bytes / bandwidth``);
with ``links="fair"`` messages share ports and their latencies overlap, so
:func:`schedule_bound` is 0 there, as for all-to-all schedules
(``collective``). ``tests/test_auto_schedule.py`` checks it against the
simulator (every strategy, comm mode, overlap, divide, fused or not), the
arrivals of stage 0 against the simulator's, and the launches against the
runs of the emitted programs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backends.cost import DTYPE_EFFICIENCY, cb_seconds, link_seconds
from ..backends.walk import merge_seconds
from ..ir.module import PlanIR
from ..ir.program import B_DKV, B_DQ, B_KV, B_O, B_Q, BWD, FWD, buffer_bytes
from ..ir.schedule import X_KV, X_O, X_Q, XDST, XHG, XK, XSRC, XSTAGE, XTB, phase_schedule
from ..ir.verify import needed_transfers
from ..passes.comm import HOP_CROSS, reduced_partials
from ..passes.emit import compute_order, compute_runs, own_last, run_bounds


_TINY = 1e-300  # a segment offset above 0 where every value is 0


def release_bound(dev: np.ndarray, release: np.ndarray, seconds: np.ndarray, n: int,
                  tail: np.ndarray | None = None) -> np.ndarray:
    """Per device of ``n``: ``max over r of r + (seconds of its jobs released
    at or after r)`` — when one machine serving one job at a time can at the
    earliest have done its jobs (``dev`` the machine of each); with ``tail``,
    plus the least tail among those jobs (one of them is last, and its tail
    follows it)."""
    out = np.zeros(n)
    if not len(dev):
        return out
    o = np.lexsort((-release, dev))
    d, r, s = dev[o], release[o], seconds[o]
    run = np.cumsum(s)
    start = np.flatnonzero(np.r_[True, d[1:] != d[:-1]])
    seg = np.repeat(np.arange(len(start)), np.diff(np.r_[start, len(d)]))
    value = r + run - (run[start] - s[start])[seg]
    if tail is not None:
        q = tail[o]
        span = 2.0 * float(q.max()) + _TINY  # segment offsets keep the running minimum inside each device,
        #                                      scaled to the values (a 1 s offset cost times of 1e-7 s digits)
        value = value + np.minimum.accumulate(q - seg * span) + seg * span
    np.maximum.at(out, d, value)
    return out


def _segment_cumsum(x: np.ndarray, first: np.ndarray) -> np.ndarray:
    """Inclusive running sums of ``x`` restarting at every index in ``first`` (sorted, starting with 0)."""
    run = np.cumsum(x)
    seg = np.repeat(np.arange(len(first)), np.diff(np.r_[first, len(x)]))
    return run - np.r_[0.0, run][first][seg]


@dataclass(frozen=True, slots=True, eq=False)
class _Shape:
    """What both phases share: the program order, the data messages (as emit
    groups them: stage, source, destination) and the partial outputs."""

    order: np.ndarray       # compute blocks in program order
    dev: np.ndarray         # ... their devices
    stage: np.ndarray       # ... their stages
    starts: np.ndarray      # first position of each device that computes
    x: np.ndarray           # data transfer rows of the schedule (Q and KV)
    msg: np.ndarray         # ... their message
    msrc: np.ndarray        # per message: source, destination
    mdst: np.ndarray
    need: np.ndarray | None  # per message: position of the first block reading it (len(order): none); None: unknown
    sweep: np.ndarray | None  # the stage-0 messages in the order the simulator starts them at time 0 (None: unknown)
    mstage: np.ndarray      # per message: its stage
    forwards: np.ndarray    # [k, 2]: (message, a message it forwards a block of) pairs
    partials: tuple         # per phase: ((rows (tb, hg, src, dst), kind, position of the last writer per row), ...)
    cross: tuple            # per phase: ((rows (tb, hg, aggregator, home), kind), ...): a node reduce's sums
    run_first: np.ndarray   # per position: the first position of its kernel run (emit.compute_runs)
    run_last: np.ndarray    # ... and the last
    own_last: np.ndarray    # [device, stage]: the position of its last block there needing nothing remote (-1:
    #                         none); with overlap a relay forwards right after it (emit)


def _shape(ir: PlanIR, kinds: tuple = (X_Q, X_KV), phase: int = FWD) -> _Shape:
    """``kinds``: the data kinds that travel (the backward under ``keep_kv``:
    Q only, every KV block a device reads is the forward's copy); ``phase``:
    whose program order (:func:`attnplan.ir.schedule.phase_schedule`)."""
    g, pl = ir.need_graph(), ir.need_placement()
    s = phase_schedule(g, pl, ir.need_schedule(), phase)
    n = pl.devices
    order = compute_order(g, pl, s)
    dev = pl.cb_device[order]
    first = np.searchsorted(dev, np.arange(n))
    starts = np.unique(first[first < len(dev)])
    x = s.xfer[np.isin(s.xfer[:, XK], kinds)]
    keys, msg = np.unique((x[:, XSTAGE] * n + x[:, XSRC]) * n + x[:, XDST], return_inverse=True)
    msg = msg.ravel()
    received = _received(g, n, x)
    need = _first_need(g, pl, received, msg, order, len(keys), kinds)
    pos = np.empty(len(order), np.int64)
    pos[order] = np.arange(len(order))
    o = s.xfer[s.xfer[:, XK] == X_O][:, [XTB, XHG, XSRC, XDST]]
    dkv = needed_transfers(g, pl)[X_KV][:, [0, 1, 3, 2]]  # (tb, hg, home, device): dKV goes device -> home
    o_x = dkv_x = np.zeros((0, 4), np.int64)
    if s.reduce:
        (o, o_x), (dkv, dkv_x) = _reduced(o, pl.devices_per_node), _reduced(dkv, pl.devices_per_node)
    o_last, kv_last = _last_writer(g, pl, o, False, pos), _last_writer(g, pl, dkv, True, pos)
    mstage, msrc, mdst = keys // (n * n), (keys // n) % n, keys % n
    run_first, run_last = run_bounds(compute_runs(g, pl, s, order))
    return _Shape(order, dev, s.cb_stage[order], starts, x, msg, msrc, mdst, need, _sweep(pl, x, mstage), mstage,
                  _forwards(g, pl, x, msg, received),
                  (((o, B_O, o_last),), ((o, B_DQ, o_last), (dkv, B_DKV, kv_last))),
                  (((o_x, B_O),), ((o_x, B_DQ), (dkv_x, B_DKV))), run_first, run_last, own_last(g, pl, s, order))


def _reduced(rows: np.ndarray, per_node: int) -> tuple[np.ndarray, np.ndarray]:
    """Under a node reduce, the partial rows ``(tb, hg, src, dst)`` as emit
    routes them (:func:`attnplan.passes.comm.reduce_rows`): (those a device
    sends after its last writer — home directly or gathered to its node's
    aggregator —, the sums the aggregators send across from their tails,
    ``(tb, hg, aggregator, home)``)."""
    routed, hop = reduced_partials(rows, per_node)
    return routed[hop != HOP_CROSS], routed[hop == HOP_CROSS]


def _forwards(g, pl, x: np.ndarray, msg: np.ndarray, received) -> np.ndarray:
    """(message, message of the block it forwards) pairs: a transfer from a
    device that is not the block's home sends what an earlier transfer
    brought there (emit waits for that one before posting the send)."""
    fwd = np.flatnonzero(pl.home[x[:, XTB]] != x[:, XSRC])
    if not len(fwd):
        return np.zeros((0, 2), np.int64)
    key, srt = received
    want = _copy_key(g, pl.devices, x[fwd, XK], x[fwd, XTB], x[fwd, XHG], x[fwd, XSRC])
    lo, hi = np.searchsorted(key, want), np.searchsorted(key, want, side="right")
    ok = hi - lo == 1  # the one transfer that brought it (a block brought twice: which one is not known; no pair)
    return np.unique(np.column_stack([msg[fwd[ok]], msg[srt[lo[ok]]]]), axis=0)


def _sweep(pl, x: np.ndarray, stage: np.ndarray) -> np.ndarray | None:
    """The data messages of stage 0, which the simulator starts at time 0 in
    an order known before emitting (:func:`_sweep_arrivals`); None where a
    device could stall while posting them.

    Every device posts its receives, then its sends, at the start of its
    program, in message order (emit: stage, destination, source), and the
    simulator runs the devices at time 0 in id order. A message starts at
    its second post, in the turn of the larger of its two devices: so a
    device's send queue takes its stage-0 messages in the order of their
    destinations, its receive queue in the order of their sources, back to
    back from 0. A device stalls in its posting only before forwarding a
    block (it waits for it first), never at stage 0 (checked: else None).
    Data of later stages posted at 0 (``overlap``) may come between them,
    which only delays them; partial outputs and forwards come after all of
    them in every queue: their second post follows a compute block or a
    wait."""
    first = x[:, XSTAGE] == 0
    if (pl.home[x[first, XTB]] != x[first, XSRC]).any():
        return None
    return np.flatnonzero(stage == 0)


def _copy_key(g, n: int, kind, tb, hg, dev):
    """The key of a copy of block (``kind``, ``tb``, ``hg``) on device ``dev``."""
    return ((kind * g.n_tb + tb) * g.n_hg + hg) * n + dev


def _received(g, n: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The data transfers keyed by the copy they bring (:func:`_copy_key` at
    their destination): (sorted keys, the transfer of each)."""
    key = _copy_key(g, n, x[:, XK], x[:, XTB], x[:, XHG], x[:, XDST])
    srt = np.argsort(key, kind="stable")
    return key[srt], srt


def _first_need(g, pl, received, msg: np.ndarray, order: np.ndarray, n_msg: int,
                kinds: tuple = (X_Q, X_KV)) -> np.ndarray | None:
    """Per data message: the program position (in ``order``) of the first
    block that reads it, ``len(order)`` if none; None where a device would
    receive one block twice (then which copy a block reads is not known)."""
    key, srt = received
    if len(key) > 1 and (key[1:] == key[:-1]).any():
        return None
    first = np.full(n_msg, len(order), np.int64)
    dev, hg = pl.cb_device[order], g.cb_hg[order]
    for kind, tb in ((X_Q, g.cb_q[order]), (X_KV, g.cb_k[order])):
        if kind not in kinds:
            continue
        rem = np.flatnonzero(pl.home[tb] != dev)
        if not len(rem):
            continue
        want = _copy_key(g, pl.devices, kind, tb[rem], hg[rem], dev[rem])
        pos = np.minimum(np.searchsorted(key, want), max(len(key) - 1, 0))
        if not len(key) or (key[pos] != want).any():
            return None  # an operand that arrives by no transfer: not a plan emit accepts
        np.minimum.at(first, msg[srt[pos]], rem)
    return first


def _last_writer(g, pl, rows: np.ndarray, by_kv: bool, pos: np.ndarray) -> np.ndarray:
    """Per partial row (tb, hg, src, dst): the program position of the last
    block on ``src`` that writes it (emit sends it after that block); -1 if none."""
    tb = g.cb_k if by_kv else g.cb_q
    keys, inv = np.unique((pl.cb_device * g.n_tb + tb) * g.n_hg + g.cb_hg, return_inverse=True)
    last = np.full(len(keys), -1, np.int64)
    np.maximum.at(last, inv.ravel(), pos)
    if not len(keys):
        return np.full(len(rows), -1, np.int64)
    want = (rows[:, 2] * g.n_tb + rows[:, 0]) * g.n_hg + rows[:, 1]
    at = np.minimum(np.searchsorted(keys, want), len(keys) - 1)
    return np.where(keys[at] == want, last[at], -1)


def _phase_bound(ir: PlanIR, prof, phase: int, sh: _Shape, cost: np.ndarray, launch: float) -> float:
    """The bound of one phase (module doc); ``cost``: each block's seconds in
    it; ``launch``: the seconds of each run of blocks beyond that."""
    g, pl = ir.need_graph(), ir.need_placement()
    n, per_node = pl.devices, pl.devices_per_node
    x = sh.x
    nbytes = np.where(x[:, XK] == X_Q, buffer_bytes(g, phase, B_Q, x[:, XTB], x[:, XHG]),
                      buffer_bytes(g, phase, B_KV, x[:, XTB], x[:, XHG]))
    msec = link_seconds(sh.msrc, sh.mdst, np.bincount(sh.msg, weights=nbytes, minlength=len(sh.msrc)), per_node,
                        prof)
    dev, p = sh.dev, cost[sh.order]
    if launch:
        p[_run_starts(ir, sh, phase)] += launch
    P = _segment_cumsum(p, sh.starts)
    end = P
    tail = np.zeros(len(msec))
    chain = np.zeros(n)
    arrival, ready, sent0, got0 = _sweep_arrivals(sh, msec, n)
    if sh.need is not None and len(dev):
        read = sh.need < len(dev)
        arrive = np.bincount(sh.need[read], weights=msec[read], minlength=len(dev))
        A = _segment_cumsum(arrive, sh.starts)
        np.maximum.at(A, sh.need[read], arrival[read])  # a block starts after its operands' messages arrive
        _posting_waits(ir, sh, arrival, A, chain)
        span = 2.0 * float(A.max() + P.max()) + _TINY  # device offsets keep the running max inside each device
        lag = np.maximum.accumulate(A - (P - p) + dev * span) - dev * span
        end = P + np.maximum(lag, 0.0)
        total = np.zeros(n)
        total[dev[sh.starts]] = P[np.r_[sh.starts[1:], len(dev)] - 1]
        tail[read] = total[sh.mdst[read]] - (P - p)[sh.need[read]]
    busy = np.zeros(n)
    if len(dev):
        busy[dev[sh.starts]] = end[np.r_[sh.starts[1:], len(dev)] - 1]
    # per queue job: its device, its release on the send and on the receive queue, its seconds; a job that comes
    # after the sweep (forwards, partials) starts on each queue after that queue's stage-0 messages too
    after = ready >= 0
    jobs = ([sh.msrc], [sh.mdst], [np.where(after, np.maximum(ready, sent0[sh.msrc]), 0.0)],
            [np.where(after, np.maximum(ready, got0[sh.mdst]), 0.0)], [msec])
    merges = _partial_jobs(ir, prof, phase, sh, end, busy, sent0, got0, jobs)
    src, dst, rs, rd, sec = (np.concatenate(j) for j in jobs)
    return float(np.maximum.reduce([busy, chain, merges, release_bound(dst, rd, sec, n),
                                    release_bound(src, rs, sec, n), release_bound(sh.msrc, tail, msec, n)]).max())


def _partial_jobs(ir: PlanIR, prof, phase: int, sh: _Shape, end: np.ndarray, busy: np.ndarray, sent0: np.ndarray,
                  got0: np.ndarray, jobs: tuple) -> np.ndarray:
    """The partial outputs of one phase, as emit groups them into messages
    (:func:`_partial_messages`): each message leaves after its last row's
    last writer (``end`` of it) and after both queues' stage-0 messages;
    under a node reduce, each sum across nodes after its aggregator's tail
    merged what it gathered (:func:`_cross_jobs`). Appended to ``jobs``
    (source, destination, release on the send and on the receive queue,
    seconds). Returns per home the bound of its merges (module doc) after
    its last block (``busy``)."""
    g, n = ir.need_graph(), len(busy)
    parts = [(rows, buffer_bytes(g, phase, kind, rows[:, 0], rows[:, 1], wire=True).astype(float), last)
             for rows, kind, last in sh.partials[phase]]
    if not parts or not sum(len(r) for r, _, _ in parts):
        return np.zeros(n)
    rows, nbytes, last = (np.concatenate(v) for v in zip(*parts))
    msg, src, dst = _partial_messages(ir, sh, rows, last)
    rel = np.zeros(len(src))
    np.maximum.at(rel, msg, np.where(last >= 0, end[np.maximum(last, 0)], 0.0))
    sec = link_seconds(src, dst, np.bincount(msg, weights=nbytes, minlength=len(src)),
                       ir.need_placement().devices_per_node, prof)
    rs, rd = np.maximum(rel, sent0[src]), np.maximum(rel, got0[dst])
    merge = merge_seconds(nbytes, prof.mem_bw)
    arrive = np.maximum(rs, rd)[msg] + sec[msg]
    gathered = ir.need_placement().home[rows[:, 0]] != rows[:, 3]
    at, ready = dst[msg], np.maximum(arrive, busy[dst[msg]])
    tail = np.maximum(busy, release_bound(at[gathered], ready[gathered], merge[gathered], n))
    x_at, x_ready, x_merge = _cross_jobs(ir, prof, phase, sh, tail, sent0, got0, jobs)
    for j, v in zip(jobs, (src, dst, rs, rd, sec)):
        j.append(v)
    x_ready = np.maximum(x_ready, busy[x_at])  # a home merges the sums it receives in its tail too
    return np.maximum(release_bound(np.r_[at, x_at], np.r_[ready, x_ready], np.r_[merge, x_merge], n),
                      release_bound(dst, rd, sec, n, tail=np.bincount(msg, weights=merge, minlength=len(src))))


def _cross_jobs(ir: PlanIR, prof, phase: int, sh: _Shape, tail: np.ndarray, sent0: np.ndarray, got0: np.ndarray,
                jobs: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A node reduce's sums across nodes in one phase: one message per
    aggregator and home (emit packs them in its tail), posted once the
    aggregator has waited for and merged every partial it gathered (``tail``
    per device: a lower bound of that), after both queues' stage-0
    messages; appended to ``jobs``. Returns per row its home, the earliest
    it can be merged there and the seconds of merging it."""
    g, n = ir.need_graph(), len(tail)
    parts = [(rows, buffer_bytes(g, phase, kind, rows[:, 0], rows[:, 1], wire=True).astype(float))
             for rows, kind in sh.cross[phase]]
    rows, nbytes = (np.concatenate(v) for v in zip(*parts))
    if not len(rows):
        return np.zeros(0, np.int64), np.zeros(0), np.zeros(0)
    msg, src, dst = _cross_messages(rows, n)
    sec = link_seconds(src, dst, np.bincount(msg, weights=nbytes, minlength=len(src)),
                       ir.need_placement().devices_per_node, prof)
    rs, rd = np.maximum(tail[src], sent0[src]), np.maximum(tail[src], got0[dst])
    for j, v in zip(jobs, (src, dst, rs, rd, sec)):
        j.append(v)
    return dst[msg], np.maximum(rs, rd)[msg] + sec[msg], merge_seconds(nbytes, prof.mem_bw)


def _cross_messages(rows: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The message of each sum across nodes ``(tb, hg, aggregator, home)``:
    one per aggregator and home (emit's tail packs them, one stage). Returns
    (each row's message, each message's source and destination)."""
    keys, msg = np.unique(rows[:, 2] * n + rows[:, 3], return_inverse=True)
    return msg.ravel(), keys // n, keys % n


def _partial_messages(ir: PlanIR, sh: _Shape, rows: np.ndarray, last: np.ndarray) -> tuple:
    """The message of each partial row ``(tb, hg, src, dst)`` (``last``: the
    program position of its last writer), as emit coalesces them: one per
    source, destination and sending stage — with overlap the stage of the
    row's last writer, else the source's last (one per pair). Returns (each
    row's message, each message's source and destination)."""
    n = ir.devices
    stage = np.where(last >= 0, sh.stage[np.maximum(last, 0)], 0) if ir.need_schedule().overlap else 0
    keys, msg = np.unique((stage * n + rows[:, 2]) * n + rows[:, 3], return_inverse=True)
    return msg.ravel(), (keys // n) % n, keys % n


def _posting_waits(ir: PlanIR, sh: _Shape, arrival: np.ndarray, start: np.ndarray, chain: np.ndarray) -> None:
    """Waits outside the blocks' own (emit): a device waits for every block
    it forwards before posting the send — in the stage's posting, or with
    overlap right after its blocks of that stage that need nothing remote
    (:func:`_forward_after`) — and without overlap for every data message
    it receives right after posting. Raises ``start`` (per block in program
    order: a lower bound of its start) at the first block after the wait,
    and ``chain`` (per device: a lower bound of its end)."""
    s = ir.need_schedule()
    post = np.maximum(sh.mstage - 1, 0) if s.overlap else sh.mstage
    out, inp = sh.forwards[:, 0], sh.forwards[:, 1]
    parts = [(sh.msrc[out], post[out], arrival[inp])]
    if not s.overlap:
        parts.append((sh.mdst, post, arrival))
    dev, at, wait = (np.concatenate(v) for v in zip(*parts))
    np.maximum.at(chain, dev, wait)
    span = int(max(s.stages, int(sh.stage.max(initial=0)) + 1, int(at.max(initial=0)) + 1))
    key = sh.dev * span + sh.stage  # ascending: program order is device, then stage
    pos = np.searchsorted(key, dev * span + at)
    if s.overlap and len(out):  # the forwards of a device with blocks of its own in that stage: after them
        late = _forward_after(sh, dev[:len(out)], at[:len(out)])
        pos[:len(out)] = np.where(late >= 0, late, pos[:len(out)])
    ok = pos < len(key)
    ok[ok] = sh.dev[pos[ok]] == dev[ok]
    np.maximum.at(start, pos[ok], wait[ok])


def _forward_after(sh: _Shape, dev: np.ndarray, stage: np.ndarray) -> np.ndarray:
    """With overlap: the position of the block right after the forwards of
    ``dev`` in posting stage ``stage`` where they come after its own blocks
    of that stage (emit ``_forward_places``); -1 where they are in the
    posting. The position may be past the device's blocks (checked by the callers)."""
    last = sh.own_last[dev, stage]
    return np.where(last >= 0, last + 1, -1)


def _sweep_arrivals(sh: _Shape, msec: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per message the earliest it can arrive (:func:`_sweep`; forwards
    after what they forward; else 0: no bound) and the earliest both ends
    can have posted it (-1: not known to come after the sweep); per device
    the seconds of the sweep's messages it sends and receives (its queues
    are busy that long from time 0)."""
    arrival, ready = np.zeros(len(msec)), np.full(len(msec), -1.0)
    if sh.sweep is None or not len(sh.sweep):
        return arrival, ready, np.zeros(n), np.zeros(n)
    m = sh.sweep  # in message order: by source, then destination
    by_dst = m[np.lexsort((sh.msrc[m], sh.mdst[m]))]
    for o, queue in ((m, sh.msrc[m]), (by_dst, sh.mdst[by_dst])):  # each queue in its sweep order
        run = _segment_cumsum(msec[o], np.flatnonzero(np.r_[True, queue[1:] != queue[:-1]]))
        arrival[o] = np.maximum(arrival[o], run)
    sent0, got0 = np.bincount(sh.msrc[m], weights=msec[m], minlength=n), np.bincount(sh.mdst[m], weights=msec[m],
                                                                                      minlength=n)
    out, inp = sh.forwards[:, 0], sh.forwards[:, 1]
    for stage in np.unique(sh.mstage[out]).tolist():  # a forward is posted after what it forwards arrived
        k = sh.mstage[out] == stage
        np.maximum.at(ready, out[k], arrival[inp[k]])
        o = np.unique(out[k])
        arrival[o] = np.maximum(arrival[o], np.maximum(ready[o], np.maximum(sent0[sh.msrc[o]], got0[sh.mdst[o]]))
                                + msec[o])
    return arrival, ready, sent0, got0


def schedule_bound(ir: PlanIR, prof) -> tuple[float, float]:
    """Lower bounds of the simulated forward and backward makespan of the
    scheduled IR ``ir`` under ``prof`` (module doc); (0, 0) where they do
    not apply (fair links, all-to-all schedules)."""
    s = ir.need_schedule()
    if prof.links != "queue" or s.collective:
        return 0.0, 0.0
    g = ir.need_graph()
    rate = DTYPE_EFFICIENCY.get(g.problem.dtype, 1.0)
    fwd = cb_seconds(g, prof, launch=not prof.fused) / rate
    sh = _shape(ir)
    own = g.problem.keep_kv or s.local_last  # the backward's own shape: other data, or another order
    sh_b = _shape(ir, (X_Q,) if g.problem.keep_kv else (X_Q, X_KV), BWD) if own else sh
    launch = prof.launch_s / rate if prof.fused else 0.0  # fused: a launch per run of blocks, else in ``fwd``
    return (_phase_bound(ir, prof, FWD, sh, fwd, launch),
            _phase_bound(ir, prof, BWD, sh_b, fwd * prof.bwd_factor, launch * prof.bwd_factor))


def _run_starts(ir: PlanIR, sh: _Shape, phase: int) -> np.ndarray:
    """Positions (in program order) of blocks that surely begin a run of
    consecutive compute instructions (a fused profile launches one kernel
    per run): a device's first block; and with overlap the first block of
    the kernel run (:func:`attnplan.passes.emit.compute_runs`) of a block
    that waits for a message first (emit puts the wait right before that
    run, unless the device waits for it earlier: while forwarding), the
    block after the run of the last writer of a device's partials for one
    home (a message of partials is sent right after that run, and whatever
    the stages split them into, one message holds that last one), and the
    block after a device's forwards where they follow its own blocks."""
    first = [sh.starts]
    if ir.need_schedule().overlap:
        after = []
        if sh.need is not None:
            forwarded = np.zeros(len(sh.msrc), bool)
            forwarded[sh.forwards[:, 1]] = True
            first.append(sh.run_first[sh.need[(sh.need < len(sh.order)) & ~forwarded]])
        out = sh.forwards[:, 0]
        if len(out):
            post = np.maximum(sh.mstage[out] - 1, 0)
            late = _forward_after(sh, sh.msrc[out], post)
            after.append(late[late >= 0])
        mx = np.full(ir.devices * ir.devices, -1, np.int64)  # per (source, home): its last partial's writer
        for rows, _, last in sh.partials[phase]:  # dQ and dKV share messages: one maximum over both
            np.maximum.at(mx, rows[:, 2] * ir.devices + rows[:, 3], last)
        after.append(sh.run_last[mx[mx >= 0]] + 1)
        nxt = np.concatenate(after).astype(np.int64)
        ok = nxt < len(sh.dev)
        ok[ok] = sh.dev[nxt[ok]] == sh.dev[nxt[ok] - 1]
        first.append(nxt[ok])
    return np.unique(np.concatenate(first).astype(np.int64))
