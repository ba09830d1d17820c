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

- **head chain**: on device ``d`` the receive queue serves one message at a
  time from time 0, so block ``j`` cannot start before every data message
  first needed by ``d``'s blocks up to ``j`` has arrived — at least the sum
  of their seconds, ``A_j``; with ``P_j`` the device's compute up to and
  including ``j``, ``j`` ends at ``E_j >= P_j + max(0, max_{i<=j} (A_i -
  P_{i-1}))`` (a list schedule on one machine with release dates);
- **partials**: a partial output is sent at the end of its last writing
  block (``E`` of it, its release ``r``) and arrives at least ``alpha +
  bytes / bandwidth`` later, then the home merges it;
- **queues with release dates or tails**: the messages a device receives
  (or sends; it waits for all of them before it ends) take at least
  ``r + sum of the seconds of those released at or after r`` for every
  ``r``; a data message's receiver still has every block from its first
  need on to run after it arrives (a tail), so on the sender ``q + sum of
  the seconds of those with a tail at least q`` (the one-machine bounds of
  Carlier, *The one-machine sequencing problem*, EJOR 1982, on heads and
  tails separately).

Each is a lower bound of the simulation with ``links="queue"`` (a message
holds its sender's and receiver's queue for ``alpha + bytes / bandwidth``);
with ``links="fair"`` messages share ports and their latencies overlap, so
:func:`schedule_bound` is 0 there, as for all-to-all schedules
(``collective``). ``tests/test_auto.py`` checks it against the simulator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backends.cost import DTYPE_EFFICIENCY, cb_seconds, link_seconds, merge_seconds
from ..ir.module import PlanIR
from ..ir.program import B_DKV, B_DQ, B_KV, B_O, B_Q, BWD, FWD, buffer_bytes
from ..ir.schedule import X_KV, X_O, X_Q, XDST, XHG, XK, XSRC, XSTAGE, XTB
from ..ir.verify import needed_transfers
from ..passes.emit import compute_order


def release_bound(dev: np.ndarray, release: np.ndarray, seconds: np.ndarray, n: int) -> np.ndarray:
    """Per device of ``n``: ``max over r of r + (seconds of its jobs released
    at or after r)`` — when one machine serving one job at a time can at the
    earliest have done its jobs (``dev`` the machine of each)."""
    out = np.zeros(n)
    if not len(dev):
        return out
    o = np.lexsort((-release, dev))
    d, r, s = dev[o], release[o], seconds[o]
    run = np.cumsum(s)
    start = np.flatnonzero(np.r_[True, d[1:] != d[:-1]])
    before = np.repeat(run[start] - s[start], np.diff(np.r_[start, len(d)]))
    np.maximum.at(out, d, r + run - before)
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
    starts: np.ndarray      # first position of each device that computes
    x: np.ndarray           # data transfer rows of the schedule (Q and KV)
    msg: np.ndarray         # ... their message
    msrc: np.ndarray        # per message: source, destination
    mdst: np.ndarray
    need: np.ndarray | None  # per message: position of the first block reading it (len(order): none); None: unknown
    partials: tuple         # per phase: ((rows (tb, hg, src, dst), kind, position of the last writer per row), ...)


def _shape(ir: PlanIR) -> _Shape:
    g, pl, s = ir.need_graph(), ir.need_placement(), ir.need_schedule()
    n = pl.devices
    order = compute_order(g, pl, s)
    dev = pl.cb_device[order]
    first = np.searchsorted(dev, np.arange(n))
    starts = np.unique(first[first < len(dev)])
    x = s.xfer[s.xfer[:, XK] != X_O]
    keys, msg = np.unique((x[:, XSTAGE] * n + x[:, XSRC]) * n + x[:, XDST], return_inverse=True)
    msg = msg.ravel()
    need = _first_need(g, pl, x, msg, order, len(keys))
    pos = np.empty(len(order), np.int64)
    pos[order] = np.arange(len(order))
    o = s.xfer[s.xfer[:, XK] == X_O][:, [XTB, XHG, XSRC, XDST]]
    dkv = needed_transfers(g, pl)[X_KV][:, [0, 1, 3, 2]]  # (tb, hg, home, device): dKV goes device -> home
    o_last, kv_last = _last_writer(g, pl, o, False, pos), _last_writer(g, pl, dkv, True, pos)
    return _Shape(order, dev, starts, x, msg, (keys // n) % n, keys % n, need,
                  (((o, B_O, o_last),), ((o, B_DQ, o_last), (dkv, B_DKV, kv_last))))


def _first_need(g, pl, x: np.ndarray, msg: np.ndarray, order: np.ndarray, n_msg: int) -> np.ndarray | None:
    """Per data message: the program position (in ``order``) of the first
    block that reads it, ``len(order)`` if none; None where a device would
    receive one block twice (then which copy a block reads is not known)."""
    n = pl.devices
    key = ((x[:, XK] * g.n_tb + x[:, XTB]) * g.n_hg + x[:, XHG]) * n + x[:, XDST]
    srt = np.argsort(key, kind="stable")
    key = key[srt]
    if len(key) > 1 and (key[1:] == key[:-1]).any():
        return None
    first = np.full(n_msg, len(order), np.int64)
    dev, hg = pl.cb_device[order], g.cb_hg[order]
    for kind, tb in ((X_Q, g.cb_q[order]), (X_KV, g.cb_k[order])):
        rem = np.flatnonzero(pl.home[tb] != dev)
        if not len(rem):
            continue
        want = ((kind * g.n_tb + tb[rem]) * g.n_hg + hg[rem]) * n + dev[rem]
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


def _phase_bound(ir: PlanIR, prof, phase: int, sh: _Shape, cost: np.ndarray) -> float:
    """The bound of one phase (module doc); ``cost``: each block's seconds in it."""
    g, pl = ir.need_graph(), ir.need_placement()
    n, per_node = pl.devices, pl.devices_per_node
    x = sh.x
    nbytes = np.where(x[:, XK] == X_Q, buffer_bytes(g, phase, B_Q, x[:, XTB], x[:, XHG]),
                      buffer_bytes(g, phase, B_KV, x[:, XTB], x[:, XHG]))
    msec = link_seconds(sh.msrc, sh.mdst, np.bincount(sh.msg, weights=nbytes, minlength=len(sh.msrc)), per_node,
                        prof)
    dev, p = sh.dev, cost[sh.order]
    P = _segment_cumsum(p, sh.starts)
    end = P
    tail = np.zeros(len(msec))
    if sh.need is not None and len(dev):
        read = sh.need < len(dev)
        arrive = np.bincount(sh.need[read], weights=msec[read], minlength=len(dev))
        A = _segment_cumsum(arrive, sh.starts)
        span = float(A.max() + P.max()) + 1.0  # device offsets keep the running max inside each device
        lag = np.maximum.accumulate(A - (P - p) + dev * span) - dev * span
        end = P + np.maximum(lag, 0.0)
        total = np.zeros(n)
        total[dev[sh.starts]] = P[np.r_[sh.starts[1:], len(dev)] - 1]
        tail[read] = total[sh.mdst[read]] - (P - p)[sh.need[read]]
    busy = np.zeros(n)
    if len(dev):
        busy[dev[sh.starts]] = end[np.r_[sh.starts[1:], len(dev)] - 1]
    jobs_src, jobs_dst, jobs_rel, jobs_sec = [sh.msrc], [sh.mdst], [np.zeros(len(msec))], [msec]
    chain = np.zeros(n)
    for rows, kind, last in sh.partials[phase]:
        nbytes = buffer_bytes(g, phase, kind, rows[:, 0], rows[:, 1]).astype(float)
        inter = (rows[:, 2] // per_node) != (rows[:, 3] // per_node)
        sec = nbytes / np.where(inter, prof.inter_bw, prof.intra_bw)  # alpha once per message: not per row
        rel = np.where(last >= 0, end[np.maximum(last, 0)], 0.0)
        merge = merge_seconds(nbytes, prof.mem_bw)
        busy += np.bincount(rows[:, 3], weights=merge, minlength=n)
        np.maximum.at(chain, rows[:, 3], rel + np.where(inter, prof.inter_alpha, prof.intra_alpha) + sec + merge)
        jobs_src.append(rows[:, 2])
        jobs_dst.append(rows[:, 3])
        jobs_rel.append(rel)
        jobs_sec.append(sec)
    src, dst, rel, sec = (np.concatenate(j) for j in (jobs_src, jobs_dst, jobs_rel, jobs_sec))
    return float(np.maximum.reduce([busy, chain, release_bound(dst, rel, sec, n), release_bound(src, rel, sec, n),
                                    release_bound(sh.msrc, tail, msec, n)]).max())


def schedule_bound(ir: PlanIR, prof) -> tuple[float, float]:
    """Lower bounds of the simulated forward and backward makespan of the
    scheduled IR ``ir`` under ``prof`` (module doc); (0, 0) where they do
    not apply (fair links, all-to-all schedules)."""
    s = ir.need_schedule()
    if prof.links != "queue" or s.collective:
        return 0.0, 0.0
    g = ir.need_graph()
    rate = DTYPE_EFFICIENCY.get(g.problem.dtype, 1.0)
    fwd = cb_seconds(g, prof, launch=not prof.fused) / rate  # fused: a launch per run, here none (a lower bound)
    sh = _shape(ir)
    return _phase_bound(ir, prof, FWD, sh, fwd), _phase_bound(ir, prof, BWD, sh, fwd * prof.bwd_factor)
