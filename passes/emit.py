"""emit: lower a scheduled placement to per-device instruction streams.

Messages: every block that moves is a transfer (the schedule's rows, and the
backward ones that follow from them), and the transfers that travel between
the same two devices in the same phase and stage become one message: one
``send``, ``recv`` and ``wait`` on each side, one latency, one contiguous
buffer on the wire. A data block's stage is its schedule stage (the stage
whose compute needs it); a partial output's is the compute stage in which
its sender sends it home (with ``overlap``, the stage of its last write;
without, the device's last stage), so coalescing never delays a block past
the point where its compute or its send would have happened. Message ids
follow the order in which both sides post them — by phase, posting stage,
data before partials, stage, destination, source — and every device posts
its sends and its receives in id order, so between two devices sends and
receives are posted in the same order (a transport may match by order, as
NCCL). A message's transfers are contiguous in the transfer table (by
message, then table order), its CSR index; each device's receive buffers
are numbered in table order (kind, then the schedule's order).

Per device and phase, stage by stage:

* a data message of stage ``s`` (Q, KV) must complete before compute stage
  ``s``. With ``schedule.overlap`` it is posted at the start of stage ``s-1``
  (so it flies during that stage's compute) and waited lazily, right before
  the first compute block that reads one of its blocks; without, it is
  posted and waited at the start of stage ``s``;
* a device forwarding blocks it received (ring traffic) waits for the
  messages that brought them first;
* compute blocks run by stage, those needing nothing remote first;
* partial outputs (forward O; backward dQ and dKV) go home in one message
  per destination and stage, sent right after the last write of its last
  partial with ``overlap``, else after the device's last block; the home
  posts its receive at the start of that stage and waits and merges it at
  the end;
* finally every own send is waited.

Backward mirrors the forward routes: Q bundles (q, out, dout, lse) and KV
travel like Q and KV; partial dQ goes to Q's home and partial dKV to KV's
home, summed in fp32.

Cost follows the work, not devices × work: every instruction of every device
is an event row tagged with its device and its place in that device's
program (stage, section, position); one stable sort of all events puts each
device's stream in program order, a message is waited at its first use
(the first of its conditional waits), and the streams are split by device
at the end. Buffer indices are local to a device, computed from per-device
counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import PlanError, VerifyError
from ..ir.graph import BlockGraph
from ..ir.module import PlanIR
from ..ir.placement import Placement
from ..ir.program import (ADD, ATTN, ATTN_BWD, B_DKV, B_DQ, B_KV, B_O, B_Q, BWD, FWD, HOME, KEPT, KINDS, M_COLS,
                          M_DST, M_PHASE, M_SRC, M_START, MERGE, PART, PHASES, RECV, RECVD, SEND, T_BYTES, T_COLS,
                          T_DST, T_HG, T_KIND, T_PHASE, T_RBUF, T_SBUF, T_SRC, T_TAG, T_TB, WAIT, Program,
                          buffer_bytes)
from ..ir.schedule import X_KV, X_O, X_Q, XDST, XHG, XK, XSRC, XSTAGE, XTB, Schedule, phase_schedule
from ..ir.verify import needed_transfers
from .base import Pass
from .comm import HOP_CROSS, reduce_rows

_I64 = np.int64
if (B_Q, B_KV) != (0, 1) or min(B_O, B_DQ, B_DKV) <= B_KV:  # pragma: no cover - _is_data relies on it
    raise ImportError("attnplan.passes.emit: data kinds must come before the partial kinds")
if (T_HG - T_TB, T_SRC - T_TB, T_DST - T_TB) != (XHG - XTB, XSRC - XTB, XDST - XTB):  # pragma: no cover
    raise ImportError("attnplan.passes.emit: the schedule's (tb, hg, src, dst) columns must be in the transfer "
                      "table's order")


def _levels(ir: PlanIR) -> tuple[BlockGraph, Placement, Schedule]:
    """The levels emit lowers (a clear error when one is missing)."""
    g, pl, s = ir.graph, ir.placement, ir.schedule
    if g is None or pl is None or s is None:
        missing = [n for n, v in (("graph", g), ("placement", pl), ("schedule", s)) if v is None]
        raise PlanError(f"emit needs a {', '.join(missing)}; run tile, a placement and comm before it")
    return g, pl, s


def _check_levels(ir: PlanIR) -> None:
    """What lowering indexes with, in range (typed errors when the verifier was skipped)."""
    (_, pl, s), n = _levels(ir), ir.devices
    _check_devices("home", pl.home, n, "token block")
    _check_devices("computing", pl.cb_device, n, "compute block")
    cst = s.cb_stage
    bad = (cst < 0) | (cst >= s.stages)
    if bad.any():
        i = int(np.argmax(bad))
        raise VerifyError(f"emit: device {pl.cb_device[i]}: compute block c{i} is in stage {cst[i]}, outside "
                          f"0..{s.stages - 1}, so it would never run")
    x = s.xfer
    for name, col in (("source", XSRC), ("destination", XDST)):
        _check_devices(name, x[:, col], n, "scheduled transfer #")
    bad = (x[:, XSTAGE] < 0) | (x[:, XSTAGE] >= s.stages)
    if bad.any():
        i = int(np.argmax(bad))
        raise VerifyError(f"emit: scheduled transfer #{i} is in stage {x[i, XSTAGE]}, outside 0..{s.stages - 1}, "
                          f"so it would never be posted")


def _block_parts(ir: PlanIR) -> tuple[list, list]:
    """Every block that moves, per phase: (buffer kind, schedule rows
    ``(kind, tb, hg, src, dst, stage)``, hop of each row) per kind (the
    partials' stage: the last). Data rows and, without a node reduce,
    partials go straight (``HOP_DIRECT``); with ``schedule.reduce`` the
    partials take the routes of :func:`attnplan.passes.comm.reduce_rows`."""
    g, pl, s = _levels(ir)
    x = s.xfer
    xk = x[:, XK]
    q, kv, o = (x[xk == k] for k in (X_Q, X_KV, X_O))
    dkv = needed_transfers(g, pl)[X_KV]  # (tb, hg, home, device): reversed for dKV partials
    dkv = np.column_stack([np.full(len(dkv), X_KV), dkv[:, 0], dkv[:, 1], dkv[:, 3], dkv[:, 2],
                           np.full(len(dkv), s.stages - 1)]).reshape(-1, 6)

    def direct(rows):
        return rows, np.zeros(len(rows), _I64)

    def routed(rows):
        return reduce_rows(rows, pl.devices_per_node) if s.reduce else direct(rows)
    o_r, dkv_r = routed(o), routed(dkv)
    bwd_kv = kv[:0] if ir.problem.keep_kv else kv  # kept: each device reuses the KV it received in the forward
    return ([(B_Q, *direct(q)), (B_KV, *direct(kv)), (B_O, *o_r)],
            [(B_Q, *direct(q)), (B_KV, *direct(bwd_kv)), (B_DQ, *o_r), (B_DKV, *dkv_r)])


def _send_stages(ir: PlanIR, kind, tb, hg, src) -> np.ndarray:
    """The compute stage in which each partial (``kind``, ``tb``, ``hg``)
    computed on ``src`` is sent home: with overlap, the stage of its last
    write there; without, the source's last stage (the last stage where the
    source writes nothing, which the verifier then rejects)."""
    g, pl, s = _levels(ir)
    dev, cst, last = pl.cb_device, s.cb_stage, s.stages - 1
    if not s.overlap:
        dev_last = np.full(ir.devices, last, _I64)
        if len(dev):
            dev_last[:] = -1
            np.maximum.at(dev_last, dev, cst)
            dev_last[dev_last < 0] = last
        return dev_last[src]
    out = np.full(len(kind), last, _I64)
    for by_k in (False, True):  # O and dQ belong to the block's q rows, dKV to its kv rows
        sel = np.flatnonzero((kind == B_DKV) == by_k)
        if not len(sel) or not len(dev):
            continue
        cb_tb = g.cb_k if by_k else g.cb_q
        keys, inv = np.unique((dev * g.n_tb + cb_tb) * g.n_hg + g.cb_hg, return_inverse=True)
        mx = np.full(len(keys), -1, _I64)
        np.maximum.at(mx, inv.ravel(), cst)
        want = (src[sel] * g.n_tb + tb[sel]) * g.n_hg + hg[sel]
        pos = np.minimum(np.searchsorted(keys, want), len(keys) - 1)
        out[sel] = np.where(keys[pos] == want, mx[pos], last)
    return out


def transfer_table(ir: PlanIR) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """All transfers grouped into messages. Returns ``(X, tmsg, M, post, born, cross)``:
    ``X`` the program's transfer table, rows ``(tag, phase, kind, tb, hg,
    src, dst, bytes, sbuf, rbuf)`` sorted by message (tags 0..n-1 in that
    order; ``sbuf``/``rbuf`` still 0: the phases fill them); ``tmsg`` the
    message of every transfer; ``M`` the message table (see
    :class:`~attnplan.ir.program.Program`); ``post`` the stage at whose start
    both sides post each message; ``born`` the place of every transfer in its
    phase's table order (kind, then the schedule's order), which numbers the
    receive buffers (a buffer table in block order compresses well);
    ``cross`` whether each message carries a node reduce's sums across
    (``HOP_CROSS``: sent after the aggregator merged, in messages of their own)."""
    _check_levels(ir)
    g, s, n = ir.graph, _levels(ir)[2], ir.devices
    S = s.stages
    tables: list[np.ndarray] = []
    msgs: list[np.ndarray] = []
    posts: list[np.ndarray] = []
    born: list[np.ndarray] = []
    crosses: list[np.ndarray] = []
    for phase, parts in zip((FWD, BWD), _block_parts(ir)):
        xs = np.concatenate([r for _, r, _ in parts]).astype(_I64)
        kind = np.repeat(np.array([k for k, _, _ in parts], _I64), [len(r) for _, r, _ in parts])
        cross = np.concatenate([h for _, _, h in parts]) == HOP_CROSS
        R = np.empty((len(xs), T_COLS), _I64)
        at = 0
        for k, r, _ in parts:
            template = np.zeros(T_COLS, _I64)
            template[T_PHASE], template[T_KIND] = phase, k
            R[at:at + len(r)] = template  # whole rows: phase, kind, and sbuf/rbuf 0 until the phases fill them
            R[at:at + len(r), T_BYTES] = buffer_bytes(g, phase, k, r[:, XTB], r[:, XHG], wire=True)
            at += len(r)
        R[:, T_TB:T_DST + 1] = xs[:, XTB:XDST + 1]  # the schedule's (tb, hg, src, dst): the table's too
        src, dst, stage = xs[:, XSRC], xs[:, XDST], xs[:, XSTAGE].copy()
        data = _is_data(kind)
        part = np.flatnonzero(~data)
        stage[part] = _send_stages(ir, kind[part], xs[part, XTB], xs[part, XHG], src[part])
        stage[cross] = S - 1  # a node's sum leaves after the aggregator's tail merged it
        post = np.where(data, np.maximum(stage - 1, 0) if s.overlap else stage, stage)
        # the posting order of both sides: stage of posting, data before partials before sums across nodes,
        # stage, destination, source (any order of the last two would do; this one makes the smallest plan files)
        cls = np.where(data, 0, np.where(cross, 2, 1))
        key = (((post * 3 + cls) * S + stage) * n + dst) * n + src
        order = np.argsort(key, kind="stable")
        key = key[order]
        new = np.r_[True, key[1:] != key[:-1]] if len(key) else np.zeros(0, bool)
        tables.append(R[order])
        born.append(order)
        msgs.append(np.cumsum(new) - 1 + sum((len(p) for p in posts), 0))
        posts.append(post[order][new])
        crosses.append(cross[order][new])
    X = np.concatenate(tables)
    X[:, T_TAG] = np.arange(len(X))
    tmsg = np.concatenate(msgs)
    start = np.flatnonzero(np.r_[True, tmsg[1:] != tmsg[:-1]]) if len(X) else np.zeros(0, _I64)
    nm = len(start)
    M = np.empty((nm, M_COLS), _I64)
    M[:, 0] = np.arange(nm)
    M[:, 1:4] = X[start][:, [T_PHASE, T_SRC, T_DST]]
    M[:, 4], M[:, 5] = start, np.append(start[1:], len(X))
    M[:, 6] = np.add.reduceat(X[:, T_BYTES], start) if nm else 0
    return X, tmsg, M, np.concatenate(posts), np.concatenate(born), np.concatenate(crosses)


def _is_data(kind: np.ndarray) -> np.ndarray:
    """Q or KV (the rest are partial outputs; kinds are B_Q, B_KV, then the partials)."""
    return kind <= B_KV


def _rows(*cols, n: int | None = None) -> np.ndarray:
    """Stack columns (arrays or scalars) into int64 rows."""
    if n is None:
        n = next((len(c) for c in cols if isinstance(c, np.ndarray) and c.ndim), 1)
    out = np.empty((n, len(cols)), _I64)
    for j, c in enumerate(cols):
        out[:, j] = c
    return out


def _code(op, a=0, b=0, c=0, d=0, e=0) -> np.ndarray:
    return _rows(op, a, b, c, d, e)


def _rank_in_group(group: np.ndarray) -> np.ndarray:
    """Position of each element among the equal values of ``group`` (sorted)."""
    return np.arange(len(group)) - np.searchsorted(group, group, side="left")


def _by_device(devices: np.ndarray) -> np.ndarray:
    """The stable order of ``devices`` (values below MAX_DEVICES = 256: a
    radix sort of 16-bit keys, linear)."""
    return np.argsort(devices.astype(np.uint16), kind="stable")


def _check_devices(name: str, values: np.ndarray, n: int, what: str) -> None:
    bad = (values < 0) | (values >= n)
    if bad.any():
        i = int(np.argmax(bad))
        raise VerifyError(f"emit: {what} {i} has {name} device {values[i]}, outside 0..{n - 1}")


# ---------------------------------------------------------------- one phase: what every step reads

@dataclass(frozen=True, slots=True)
class _Phase:
    """The phase's transfers grouped by device, and each device's buffer
    layout: home buffers (kind × own token block × head group), one receive
    buffer per incoming transfer, then partial outputs in order of first write."""

    graph: BlockGraph
    placement: Placement
    schedule: Schedule
    phase: int
    home: np.ndarray          # token block -> home device
    rank: np.ndarray          # token block -> position among its home's blocks
    kinds: np.ndarray         # home buffer kinds of the phase, in buffer-table order
    out_kinds: np.ndarray     # what a compute block writes (O; or dQ of its q, dKV of its kv)
    nbytes: np.ndarray        # [len(kinds), n_tb, n_hg] buffer bytes
    rows: np.ndarray          # the phase's rows of the transfer table (their positions in it)
    inc: np.ndarray           # the phase's transfers sorted by destination (table order within)
    inc_row: np.ndarray       # ... their rows in the transfer table
    inc_msg: np.ndarray       # ... their message
    out: np.ndarray           # ... sorted by source
    out_row: np.ndarray       # ... their rows in the transfer table
    out_msg: np.ndarray       # ... their message
    m: np.ndarray             # device -> home token blocks
    n_home: np.ndarray        # device -> home buffers
    n_fixed: np.ndarray       # device -> home and kept buffers (kept: the backward's KV received in the forward)
    kept: np.ndarray          # kept buffers: rows (device, local index, buffer-table row...) [k, 8]
    n_in: np.ndarray          # device -> incoming transfers
    inc_buf: np.ndarray       # local receive buffer of each row of ``inc``
    recv_keys: np.ndarray     # sorted keys (device, kind, tb, hg) of receive buffers
    recv_buf: np.ndarray      # their local buffer (the last received, if a key repeats)
    msgs: np.ndarray          # the phase's messages (ids, ascending)
    msg_src: np.ndarray       # ... their source
    msg_dst: np.ndarray       # ... their destination
    msg_data: np.ndarray      # ... whether they carry data (Q, KV) or partials
    post: np.ndarray          # message id -> the stage at whose start both sides post it
    msg_cross: np.ndarray     # the phase's messages: whether they carry a node reduce's sums across (sent in the tail)

    @property
    def n_hg(self) -> int:
        return self.nbytes.shape[2]

    @property
    def where(self) -> str:
        return PHASES[self.phase]

    def key(self, dev, kind, tb, hg) -> np.ndarray:
        return _key(len(self.home), self.n_hg, dev, kind, tb, hg)

    def bytes_of(self, kind, tb, hg) -> np.ndarray:
        return self.nbytes[np.searchsorted(self.kinds, kind), tb, hg]

    def home_index(self, kind, tb, hg) -> np.ndarray:
        """Local index of the home buffer of (kind, tb, hg) on tb's home device."""
        return (np.searchsorted(self.kinds, kind) * self.m[self.home[tb]] + self.rank[tb]) * self.n_hg + hg

    def lookup(self, dev, kind, tb, hg, who) -> np.ndarray:
        """Local index of the buffer holding (kind, tb, hg) on ``dev``: its
        home buffer, or the one it was received into (the last, if several).
        ``who(i)`` names the i-th user in an error."""
        dev, kind = (np.broadcast_to(np.asarray(x, _I64), tb.shape) for x in (dev, kind))
        own = self.home[tb] == dev
        out = np.empty(len(tb), _I64)
        out[own] = self.home_index(kind[own], tb[own], hg[own])
        if len(self.recv_keys):
            want = self.key(dev[~own], kind[~own], tb[~own], hg[~own])
            pos = np.minimum(np.searchsorted(self.recv_keys, want), len(self.recv_keys) - 1)
            found, idx = self.recv_keys[pos] == want, self.recv_buf[pos]
        else:
            found, idx = np.zeros((~own).sum(), bool), np.zeros((~own).sum(), _I64)
        if not found.all():
            i = int(np.flatnonzero(~own)[np.argmin(found)])
            raise VerifyError(f"emit: device {dev[i]} {self.where}: {who(i)} needs {KINDS[kind[i]]}[tb{tb[i]},"
                              f"hg{hg[i]}], which is neither home there nor received")
        out[~own] = idx
        return out

    def message_of(self, dev: np.ndarray, buf: np.ndarray) -> np.ndarray:
        """The message that brings receive buffer ``buf`` of device ``dev``."""
        if not len(buf):
            return np.zeros(0, _I64)
        start = np.searchsorted(self.inc[:, T_DST], np.arange(len(self.n_home)))
        return self.inc_msg[start[dev] + buf - self.n_fixed[dev]]


def _key(n_tb: int, n_hg: int, dev, kind, tb, hg) -> np.ndarray:
    """One integer per (device, kind, token block, head group)."""
    return ((np.asarray(dev, _I64) * len(KINDS) + kind) * n_tb + tb) * n_hg + hg


def _last_of_each(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct keys and, for each, the value of its last occurrence."""
    order = np.argsort(keys, kind="stable")
    k = keys[order]
    last = np.r_[k[1:] != k[:-1], True] if len(k) else np.zeros(0, bool)
    return k[last], values[order][last]


def _kept(ir: PlanIR, fwd: _Phase | None, n_home: np.ndarray) -> np.ndarray:
    """The backward's kept buffers (``Problem.keep_kv``): every KV block a
    device computes with and does not home, device-major, each at its local
    index after the home buffers and naming the forward buffer it was
    received into. Rows ``(device, local, kind, tb, hg, KEPT, forward buffer, bytes)``."""
    if fwd is None:
        return np.zeros((0, 8), _I64)
    g, pl, _ = _levels(ir)
    dev, tb, hg = pl.cb_device, g.cb_k, g.cb_hg
    remote = pl.home[tb] != dev
    key = np.unique(_key(g.n_tb, g.n_hg, dev[remote], B_KV, tb[remote], hg[remote]))
    hg_k, rest = key % g.n_hg, key // g.n_hg
    tb_k, dev_k = rest % g.n_tb, rest // g.n_tb // len(KINDS)
    src = fwd.lookup(dev_k, B_KV, tb_k, hg_k, lambda i: f"kept KV[tb{tb_k[i]},hg{hg_k[i]}]")
    nbytes = buffer_bytes(g, BWD, B_KV, tb_k, hg_k)
    return np.column_stack([dev_k, n_home[dev_k] + _rank_in_group(dev_k),
                            _rows(np.full(len(key), B_KV), tb_k, hg_k, KEPT, src, nbytes)]).reshape(-1, 8)


def _phase(ir: PlanIR, X: np.ndarray, tmsg: np.ndarray, M: np.ndarray, post: np.ndarray, born: np.ndarray,
           cross: np.ndarray, phase: int, fwd: _Phase | None = None) -> _Phase:
    (g, pl, s), n = _levels(ir), ir.devices
    s = phase_schedule(g, pl, s, phase)
    kinds = np.array((B_Q, B_KV, B_O) if phase == FWD else (B_Q, B_KV, B_DQ, B_DKV))
    tb = np.repeat(np.arange(g.n_tb), g.n_hg)
    hg = np.tile(np.arange(g.n_hg), g.n_tb)
    nbytes = np.stack([buffer_bytes(g, phase, k, tb, hg).reshape(g.n_tb, g.n_hg) for k in kinds.tolist()])
    lo, hi = np.searchsorted(X[:, T_PHASE], [phase, phase + 1])  # the phase is the message order's major key
    rows = np.arange(lo, hi)
    ph = X[lo:hi]
    by_home = _by_device(pl.home)
    rank = np.empty(g.n_tb, _I64)
    rank[by_home] = _rank_in_group(pl.home[by_home])
    m = np.bincount(pl.home, minlength=n)
    n_home = len(kinds) * m * g.n_hg
    kept = _kept(ir, fwd, n_home)
    n_fixed = n_home + np.bincount(kept[:, 0], minlength=n)
    in_table = np.empty(len(ph), _I64)  # the phase's rows in table order (kind, then the schedule's)
    in_table[born[lo:hi]] = np.arange(len(ph))
    io = in_table[_by_device(ph[in_table, T_DST])]  # by destination, table order within: receive buffers
    inc = ph[io]
    inc_buf = n_fixed[inc[:, T_DST]] + _rank_in_group(inc[:, T_DST])
    recv_keys, recv_buf = _last_of_each(np.r_[_key(g.n_tb, g.n_hg, kept[:, 0], B_KV, kept[:, 3], kept[:, 4]),
                                              _key(g.n_tb, g.n_hg, inc[:, T_DST], inc[:, T_KIND], inc[:, T_TB],
                                                   inc[:, T_HG])], np.r_[kept[:, 1], inc_buf])
    oo = _by_device(ph[:, T_SRC])
    msgs = np.flatnonzero(M[:, M_PHASE] == phase)
    return _Phase(g, pl, s, phase, pl.home, rank, kinds, np.array((B_O,) if phase == FWD else (B_DQ, B_DKV)),
                  nbytes, rows, inc, rows[io], tmsg[rows[io]], ph[oo], rows[oo], tmsg[rows[oo]], m, n_home, n_fixed,
                  kept,
                  np.bincount(ph[:, T_DST], minlength=n),
                  inc_buf, recv_keys, recv_buf, msgs, M[msgs, M_SRC], M[msgs, M_DST],
                  _is_data(X[M[msgs, M_START], T_KIND]), post, cross[msgs])


# ---------------------------------------------------------------- buffer tables

def _buffer_tables(sh: _Phase, part_dev: np.ndarray, part_rows: np.ndarray, part_buf: np.ndarray) -> list:
    """Each device's buffer table: home buffers, receive buffers, partials
    (every row placed at its local index, without a sort)."""
    n_dev, H = len(sh.n_home), sh.n_hg
    k, tb, h = (a.ravel() for a in np.meshgrid(np.arange(len(sh.kinds)), np.arange(len(sh.home)), np.arange(H),
                                              indexing="ij"))
    dev = sh.home[tb]
    size = sh.n_fixed + sh.n_in + np.bincount(part_dev, minlength=n_dev)
    off = np.cumsum(size) - size
    table = np.empty((int(size.sum()), 6), _I64)
    table[off[dev] + (k * sh.m[dev] + sh.rank[tb]) * H + h] = _rows(sh.kinds[k], tb, h, HOME, -1, sh.nbytes[k, tb, h])
    table[off[sh.kept[:, 0]] + sh.kept[:, 1]] = sh.kept[:, 2:]
    inc = sh.inc
    table[off[inc[:, T_DST]] + sh.inc_buf] = _rows(inc[:, T_KIND], inc[:, T_TB], inc[:, T_HG], RECVD, inc[:, T_SRC],
                                                   inc[:, T_BYTES])
    table[off[part_dev] + part_buf] = part_rows.reshape(-1, 6)
    return np.split(table, np.cumsum(size)[:-1])


# ---------------------------------------------------------------- compute blocks

@dataclass(frozen=True, slots=True)
class _Compute:
    """Every device's compute blocks in program order (device-major), with
    their operand and output buffers and the partial outputs they write."""

    dev: np.ndarray
    cb: np.ndarray
    stage: np.ndarray
    local: np.ndarray         # position in its device's program order
    qb: np.ndarray
    kb: np.ndarray
    outs: np.ndarray          # [n, len(out_kinds)] output buffers
    part_dev: np.ndarray      # partial buffers (by device, in order of first write): device
    part_rows: np.ndarray     # ... their buffer-table rows
    part_keys: np.ndarray     # ... their keys (device, kind, tb, hg)
    part_buf: np.ndarray      # ... their local buffer index
    part_first: np.ndarray    # ... flat (block, output) position of their first write
    part_last: np.ndarray     # ... the compute block (index into dev, cb, ...) that writes them last
    run_first: np.ndarray     # per block: the first block of its kernel run (compute_runs), ...
    run_last: np.ndarray      # ... and the last
    own_last: np.ndarray      # [device, stage]: its last block needing nothing remote (-1: none; own_last)


def compute_order(g: BlockGraph, pl: Placement, s: Schedule) -> np.ndarray:
    """The compute blocks in program order under schedule ``s`` (the
    backward's: :func:`phase_schedule`): by device, then stage, those
    needing nothing remote first — last under ``s.local_last`` —, then the
    others by partner — the home of their remote KV, else of their remote Q
    — in shifted order (device ``d`` serves ``d + 1, d + 2, ...`` mod the
    devices first, as a pairwise exchange does, so that no device is
    everyone's first partner and the dKV partials for one home are done
    together), then q block, kv block and head group (also what
    :mod:`attnplan.tools.auto_schedule` bounds)."""
    dev, cq, ck, chg, cst = pl.cb_device, g.cb_q, g.cb_k, g.cb_hg, s.cb_stage
    kv_away, q_away = pl.home[ck] != dev, pl.home[cq] != dev
    partner = np.where(kv_away, pl.home[ck], pl.home[cq])
    shift = np.where(kv_away | q_away, (partner - dev) % pl.devices, pl.devices if s.local_last else -1)
    return np.lexsort((chg, ck, cq, shift, cst, dev))


def compute_runs(g: BlockGraph, pl: Placement, s: Schedule, order: np.ndarray) -> np.ndarray:
    """The kernel run of every block of ``order`` (:func:`compute_order`), as
    ids ascending along it: per device and stage, the blocks needing nothing
    remote are one run, and the others, grouped by partner, start a new one
    only where the remote work before their partner's blocks reaches another
    multiple of ``s.run_flops`` (0: a run per partner). Emit waits for a
    run's messages before its first block and sends the partials it
    finishes after its last, so a fused kernel covers the run: one launch,
    not one per partner, for the price of waiting for all of its partners'
    data (:class:`attnplan.passes.comm.Overlap`)."""
    n = len(order)
    if not n:
        return np.zeros(0, _I64)
    dev, st, ck, cq = pl.cb_device[order], s.cb_stage[order], g.cb_k[order], g.cb_q[order]
    kv_away, q_away = pl.home[ck] != dev, pl.home[cq] != dev
    remote = kv_away | q_away
    partner = np.where(kv_away, pl.home[ck], pl.home[cq])
    seg = np.r_[True, (dev[1:] != dev[:-1]) | (st[1:] != st[:-1])]
    new = seg | np.r_[False, (partner[1:] != partner[:-1]) | (remote[1:] != remote[:-1])]
    if s.run_flops > 0:
        work = np.where(remote, g.cb_flops()[order], 0).astype(float)
        before = np.cumsum(work) - work                       # remote work before each block, ...
        before -= before[np.flatnonzero(seg)][np.cumsum(seg) - 1]  # ... within its device and stage
        group_start = np.flatnonzero(new)
        bucket = np.floor(before[group_start] / s.run_flops)[np.cumsum(new) - 1]
        keep = ~seg & (remote == np.r_[False, remote[:-1]]) & (bucket == np.r_[-1.0, bucket[:-1]])
        new &= ~keep
    return np.cumsum(new) - 1


def run_bounds(run: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per position of ``run`` (ids ascending, :func:`compute_runs`): the
    first and the last position of its run."""
    starts = np.flatnonzero(np.r_[True, run[1:] != run[:-1]]) if len(run) else np.zeros(0, _I64)
    ends = np.r_[starts[1:], len(run)] - 1
    return starts[run], ends[run]


def own_last(g: BlockGraph, pl: Placement, s: Schedule, order: np.ndarray) -> np.ndarray:
    """``[device, stage]``: the position in ``order`` of the device's last
    block of that stage needing nothing remote (-1: none); with overlap a
    relay forwards right after it."""
    dev = pl.cb_device[order]
    own = np.flatnonzero((pl.home[g.cb_q[order]] == dev) & (pl.home[g.cb_k[order]] == dev))
    out = np.full((pl.devices, s.stages), -1, _I64)
    np.maximum.at(out, (dev[own], s.cb_stage[order][own]), own)
    return out


def _compute_order(sh: _Phase):
    g, pl = sh.graph, sh.placement
    order = compute_order(g, pl, sh.schedule)
    return order, pl.cb_device[order], g.cb_q[order], g.cb_k[order], g.cb_hg[order], sh.schedule.cb_stage[order]


def _partials(sh: _Phase, dev, targets: np.ndarray, hg: np.ndarray):
    """Output buffers of every (block, output), and the partial buffers among
    them, created at their first write. ``targets``: [n, m] token blocks."""
    n, m = targets.shape
    kind = np.tile(sh.out_kinds, n)
    tb, h, d = targets.ravel(), np.repeat(hg, m), np.repeat(dev, m)
    part = sh.home[tb] != d
    flat_pos = np.flatnonzero(part)
    uniq, first, inv = np.unique(sh.key(d[part], kind[part], tb[part], h[part]), return_index=True,
                                 return_inverse=True)
    first = flat_pos[first]
    last = np.full(len(uniq), -1, _I64)
    np.maximum.at(last, inv.ravel(), flat_pos // m)
    created = np.argsort(first, kind="stable")  # device-major: blocks are sorted by device first
    rank = np.empty(len(uniq), _I64)
    rank[created] = np.arange(len(uniq))
    fd, fk, ft, fh = d[first[created]], kind[first[created]], tb[first[created]], h[first[created]]
    local = sh.n_fixed[fd] + sh.n_in[fd] + _rank_in_group(fd)
    outs = np.empty(n * m, _I64)
    outs[part] = local[rank[inv.ravel()]]
    outs[~part] = sh.home_index(kind[~part], tb[~part], h[~part])
    rows = _rows(fk, ft, fh, PART, -1, sh.bytes_of(fk, ft, fh))
    return outs.reshape(n, m), fd, rows, uniq[created], local, first[created], last[created]


def _compute(sh: _Phase) -> _Compute:
    order, dev, cq, ck, chg, cst = _compute_order(sh)

    def who(i):
        return f"compute block c{order[i]}"
    qb = sh.lookup(dev, B_Q, cq, chg, who)
    kb = sh.lookup(dev, B_KV, ck, chg, who)
    targets = np.column_stack([cq] if sh.phase == FWD else [cq, ck])
    outs, pdev, rows, keys, pbuf, first, last = _partials(sh, dev, targets, chg)
    run_first, run_last = run_bounds(compute_runs(sh.graph, sh.placement, sh.schedule, order))
    return _Compute(dev, order, cst, _rank_in_group(dev), qb, kb, outs, pdev, rows, keys, pbuf, first, last,
                    run_first, run_last, own_last(sh.graph, sh.placement, sh.schedule, order))


# ---------------------------------------------------------------- events in program order

@dataclass(frozen=True, slots=True)
class _Events:
    """Instructions with their place in their device's program: sorted by
    (device, stage, section, position, sub, tie). ``cond >= 0`` marks a wait
    for message ``cond`` that is kept only at its first wait."""

    order: np.ndarray         # [n, 6]
    code: np.ndarray          # [n, 6]
    cond: np.ndarray          # [n]

    @staticmethod
    def make(dev, stage, section, pos, sub, tie, code, cond=-1) -> "_Events":
        code = np.asarray(code, _I64).reshape(-1, 6)
        return _Events(_rows(dev, stage, section, pos, sub, tie, n=len(code)), code,
                       np.broadcast_to(np.asarray(cond, _I64), (len(code),)))

    @staticmethod
    def concat(parts: list["_Events"]) -> "_Events":
        return _Events(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("order", "code", "cond")))

    def in_order(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(device, code, cond) in program order."""
        idx = _sort_rows(self.order)
        return self.order[idx, 0], self.code[idx], self.cond[idx]


def _sort_rows(cols: np.ndarray) -> np.ndarray:
    """Stable order of non-negative int rows by their columns, left to right:
    columns are packed into as few int64 keys as fit (mixed radix), so one
    argsort usually does."""
    if not len(cols):
        return np.zeros(0, _I64)
    keys: list[np.ndarray] = []
    key, span = cols[:, 0].astype(_I64), int(cols[:, 0].max()) + 1
    for j in range(1, cols.shape[1]):
        c = cols[:, j]
        r = int(c.max()) + 1
        if span * r < (1 << 62):
            key, span = key * r + c, span * r
        else:
            keys.append(key)
            key, span = c.astype(_I64), r
    keys.append(key)
    if len(keys) == 1:
        return np.argsort(keys[0], kind="stable")
    return np.lexsort(keys[::-1])


# event sections inside a stage
_POST, _WAIT_POSTED, _COMPUTE = 0, 1, 2


def _forward_places(sh: _Phase, c: _Compute, dev: np.ndarray, stage: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where a device forwards (waits for a block it received, then sends it
    on) in posting stage ``stage``: with overlap, right after its blocks of
    that stage that need nothing remote — a relay computes its own work
    while what it forwards is on the way; else, and where it has no such
    block, in the stage's posting. Returns (section, position)."""
    if not sh.schedule.overlap or not len(c.dev):
        return np.full(len(dev), _POST, _I64), np.full(len(dev), -1, _I64)
    at = c.own_last[dev, stage]
    return np.where(at >= 0, _COMPUTE, _POST), np.where(at >= 0, c.local[np.maximum(at, 0)], -1)


def _post_events(sh: _Phase, c: _Compute) -> tuple[list[_Events], np.ndarray]:
    """Posting of messages: at the start of its posting stage, each device
    posts its receives, then its data sends, each in message order; a send
    that forwards blocks received earlier waits for their messages first,
    after the device's own blocks of that stage with overlap
    (:func:`_forward_places`); without overlap, data receives are waited
    right after posting. Returns the events and the source buffer of every
    row of ``sh.out`` that is data."""
    nm = len(sh.post)
    msg, src, dst, data = sh.msgs, sh.msg_src, sh.msg_dst, sh.msg_data
    post = sh.post[msg]
    ev = [_Events.make(dst, post, _POST, msg, 0, 0, _code(RECV, msg, src))]
    if not sh.schedule.overlap:
        ev.append(_Events.make(dst[data], post[data], _WAIT_POSTED, msg[data], 0, 0, _code(WAIT, msg[data]),
                               msg[data]))
    so = np.flatnonzero(_is_data(sh.out[:, T_KIND]))
    sout = sh.out[so]
    sdev = sout[:, T_SRC]
    sb = sh.lookup(sdev, sout[:, T_KIND], sout[:, T_TB], sout[:, T_HG], lambda i: f"transfer t{sout[i, T_TAG]}")
    fwd = np.flatnonzero(sh.home[sout[:, T_TB]] != sdev)  # forwarding a block received earlier: wait for it first
    forwards = np.zeros(nm, bool)
    if len(fwd):
        got = sh.message_of(sdev[fwd], sb[fwd])
        pair = np.unique(sh.out_msg[so[fwd]] * nm + got)
        m_out, m_in = pair // nm, pair % nm
        forwards[m_out] = True
        dev = sh.msg_src[np.searchsorted(sh.msgs, m_out)]
        section, at = _forward_places(sh, c, dev, sh.post[m_out])
        late = section == _COMPUTE  # after the block at ``at`` (sub 2), before any partial send of it (sub 3)
        ev.append(_Events.make(dev, sh.post[m_out], section, np.where(late, at, nm + m_out), np.where(late, 4, 0),
                               np.where(late, m_out * nm + m_in, m_in), _code(WAIT, m_in), m_in))
    sm, sd, sp = msg[data], dst[data], post[data]
    section, at = _forward_places(sh, c, src[data], sp)
    late = forwards[sm] & (section == _COMPUTE)
    ev.append(_Events.make(src[data], sp, np.where(late, _COMPUTE, _POST), np.where(late, at, nm + sm),
                           np.where(late, 4, 1), np.where(late, sm * nm + nm - 1, 0), _code(SEND, sm, sd)))
    return ev, sb


def _compute_events(sh: _Phase, c: _Compute) -> list[_Events]:
    """Per compute block: wait the messages of its received operands, run it."""
    ev = []
    for sub, b in ((0, c.qb), (1, c.kb)):
        rcv = np.flatnonzero(b >= sh.n_fixed[c.dev])  # operands are home, kept or received, never partial
        m = sh.message_of(c.dev[rcv], b[rcv])
        at = c.run_first[rcv]  # before the first block of its run
        ev.append(_Events.make(c.dev[rcv], c.stage[rcv], _COMPUTE, c.local[at], sub, 0, _code(WAIT, m), m))
    if sh.phase == FWD:
        attn = _code(ATTN, c.cb, c.qb, c.kb, c.outs[:, 0])
    else:
        attn = _code(ATTN_BWD, c.cb, c.qb, c.kb, c.outs[:, 0], c.outs[:, 1])
    ev.append(_Events.make(c.dev, c.stage, _COMPUTE, c.local, 2, 0, attn))
    return ev


def _partial_sends(sh: _Phase, c: _Compute) -> tuple[_Events, np.ndarray, np.ndarray]:
    """One send per message of partials, right after the last write of its
    last partial (with overlap; else after the device's last block). Returns
    the events, and the rows of ``sh.out`` that are partials with their
    source buffers."""
    po = np.flatnonzero(~_is_data(sh.out[:, T_KIND]))
    out = sh.out[po]
    keys = sh.key(out[:, T_SRC], out[:, T_KIND], out[:, T_TB], out[:, T_HG])
    _check_partials(sh, out, keys, c)
    srt = np.argsort(c.part_keys)
    pidx = srt[np.searchsorted(c.part_keys[srt], keys)]  # each transfer's partial
    p = ~sh.msg_data & ~sh.msg_cross  # a node's sums across are sent from the tail (_tail)
    msg, src, dst = sh.msgs[p], sh.msg_src[p], sh.msg_dst[p]
    if sh.schedule.overlap:
        last = np.full(len(sh.post), -1, _I64)
        np.maximum.at(last, sh.out_msg[po], c.part_last[pidx])
        anchor = c.run_last[last[msg]]  # after the run of its last writer
    else:  # after the device's last block
        anchor = np.searchsorted(c.dev, src, side="right") - 1
    ev = _Events.make(src, c.stage[anchor], _COMPUTE, c.local[anchor], 3, msg, _code(SEND, msg, dst))
    return ev, po, c.part_buf[pidx]


def _check_partials(sh: _Phase, out: np.ndarray, keys: np.ndarray, c: _Compute) -> None:
    """Every partial written is sent home exactly once, and nothing else is."""
    uniq, count = np.unique(keys, return_counts=True)
    if not (count > 1).any() and np.array_equal(uniq, np.sort(c.part_keys)):
        return
    sent, written = set(keys.tolist()), set(c.part_keys.tolist())
    extra, missing = sorted(sent - written), sorted(written - sent)
    if extra:
        t = out[np.flatnonzero(keys == extra[0])[0]]
        raise VerifyError(f"emit: device {t[T_SRC]} {sh.where}: partial {KINDS[t[T_KIND]]}[tb{t[T_TB]},hg{t[T_HG]}] "
                          f"(transfer t{t[T_TAG]}) is never written there: partials left unscheduled")
    if missing:
        i = int(np.flatnonzero(c.part_keys == missing[0])[0])
        r = c.part_rows[i]
        raise VerifyError(f"emit: device {c.part_dev[i]} {sh.where}: partial {KINDS[r[0]]}[tb{r[1]},hg{r[2]}] is "
                          f"written there but no transfer takes it home")
    t = out[np.flatnonzero(keys == uniq[np.argmax(count > 1)])[1]]
    raise VerifyError(f"emit: device {t[T_SRC]} {sh.where}: partial {KINDS[t[T_KIND]]}[tb{t[T_TB]},hg{t[T_HG]}] "
                      f"is sent home twice (transfer t{t[T_TAG]})")


def _program_order(ev: _Events):
    """Events in program order, each message waited only at its first
    conditional wait. Returns ((device, code), the messages so waited)."""
    dev, code, cond = ev.in_order()
    c = np.flatnonzero(cond >= 0)
    waited, first = np.unique(cond[c], return_index=True)  # a message has one receiver: its id is the key
    keep = np.ones(len(code), bool)
    keep[c] = False
    keep[c[first]] = True
    return (dev[keep], code[keep]), waited


def _tail(sh: _Phase, c: _Compute, waited: np.ndarray) -> _Events:
    """After the last stage, in message order within each step: on a node
    reduce's aggregator, wait each message that brings partials to sum and
    merge its blocks (into its own partial of the block, or home), then send
    the node's sums across (messages of ``HOP_CROSS`` rows, packed from its
    partials); then wait every other message of partials and merge its
    blocks into home (the sums it receives included); then wait data
    messages never read there and its own sends. A sum waits only for
    messages sent from compute sections, which never wait for a tail: no
    cycle."""
    inc = sh.inc
    p = np.flatnonzero(~_is_data(inc[:, T_KIND]))
    at_home = sh.home[inc[p, T_TB]] == inc[p, T_DST]
    pd, pm = inc[p, T_DST], sh.inc_msg[p]
    cross_in = sh.msg_cross[np.searchsorted(sh.msgs, pm)]
    bad = ~at_home & cross_in
    if bad.any():
        t = inc[p[np.argmax(bad)]]
        raise VerifyError(f"emit: device {t[T_DST]} {sh.where}: receives a node's sum {KINDS[t[T_KIND]]}"
                          f"[tb{t[T_TB]},hg{t[T_HG]}] (transfer t{t[T_TAG]}) for a block that is not home there")
    dst_b = np.empty(len(p), _I64)
    dst_b[at_home] = sh.home_index(inc[p[at_home], T_KIND], inc[p[at_home], T_TB], inc[p[at_home], T_HG])
    if (~at_home).any():  # a gathered partial: into the aggregator's own partial of the block
        g = p[~at_home]
        want = sh.key(inc[g, T_DST], inc[g, T_KIND], inc[g, T_TB], inc[g, T_HG])
        srt = np.argsort(c.part_keys)
        pos = np.minimum(np.searchsorted(c.part_keys[srt], want), max(len(srt) - 1, 0))
        found = (c.part_keys[srt[pos]] == want) if len(srt) else np.zeros(len(want), bool)
        if not found.all():
            t = inc[g[np.argmin(found)]]
            raise VerifyError(f"emit: device {t[T_DST]} {sh.where}: receives partial {KINDS[t[T_KIND]]}"
                              f"[tb{t[T_TB]},hg{t[T_HG]}] (transfer t{t[T_TAG]}) for a block that is neither home "
                              f"there nor computed there")
        dst_b[~at_home] = c.part_buf[srt[pos]]
    merge = np.where(inc[p, T_KIND] == B_O, MERGE, ADD)
    # messages that bring partials to sum are waited first, then the sums leave, then the rest is waited
    first = np.zeros(len(sh.post), bool)
    first[pm[~at_home]] = True
    section = np.where(first[pm], 0, 2)
    part, data, cross = ~sh.msg_data, sh.msg_data, sh.msg_cross
    ev = [_Events.make(sh.msg_dst[part], 0, np.where(first[sh.msgs[part]], 0, 2), sh.msgs[part], 0, 0,
                       _code(WAIT, sh.msgs[part])),
          _Events.make(pd, 0, section, pm, 1, p, _code(merge, dst_b, sh.inc_buf[p])),
          _Events.make(sh.msg_src[cross], 0, 1, sh.msgs[cross], 0, 0, _code(SEND, sh.msgs[cross], sh.msg_dst[cross]))]
    unread = data & ~np.isin(sh.msgs, waited)
    ev.append(_Events.make(sh.msg_dst[unread], 0, 3, sh.msgs[unread], 0, 0, _code(WAIT, sh.msgs[unread])))
    ev.append(_Events.make(sh.msg_src, 0, 4, sh.msgs, 0, 0, _code(WAIT, sh.msgs)))
    return _Events.concat(ev)


def _streams(n_dev: int, parts: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
    """One instruction stream per device: its rows of each part in turn.
    ``parts``: (device, code) pairs, each sorted by device (program order
    within); rows are placed by counting, without another sort."""
    counts = np.stack([np.bincount(dev, minlength=n_dev) for dev, _ in parts])  # [part, device]
    before = np.cumsum(counts, axis=0) - counts                                  # rows of earlier parts
    start = np.cumsum(counts.sum(axis=0)) - counts.sum(axis=0)                   # first row of each device
    out = np.empty((int(counts.sum()), 6), _I64)
    for i, (dev, code) in enumerate(parts):
        out[start[dev] + before[i, dev] + _rank_in_group(dev)] = code
    return np.split(out, np.cumsum(counts.sum(axis=0))[:-1])


def _emit_phase(ir: PlanIR, X: np.ndarray, tmsg: np.ndarray, M: np.ndarray, post: np.ndarray, born: np.ndarray,
                cross: np.ndarray, phase: int, fwd: _Phase | None = None) -> tuple[list, list, _Phase]:
    """Every device's buffer table and instruction stream of one phase, and
    the phase's layout; fills the phase's source and receive buffer columns
    of ``X``. ``fwd``: the forward's layout, where the backward keeps KV."""
    sh = _phase(ir, X, tmsg, M, post, born, cross, phase, fwd)
    c = _compute(sh)
    posts, data_sb = _post_events(sh, c)
    sends, po, part_sb = _partial_sends(sh, c)
    body, waited = _program_order(_Events.concat(posts + _compute_events(sh, c) + [sends]))
    tail = _tail(sh, c, waited).in_order()[:2]
    code = _streams(len(sh.n_home), [body, tail])
    X[sh.inc_row, T_RBUF] = sh.inc_buf
    X[sh.out_row[_is_data(sh.out[:, T_KIND])], T_SBUF] = data_sb
    X[sh.out_row[po], T_SBUF] = part_sb
    return _buffer_tables(sh, c.part_dev, c.part_rows, c.part_buf), code, sh


def emit(ir: PlanIR) -> Program:
    X, tmsg, M, post, born, cross = transfer_table(ir)
    bufs, code = [], []
    fwd = None
    for phase in (FWD, BWD):
        b, c, sh = _emit_phase(ir, X, tmsg, M, post, born, cross, phase,
                               fwd if ir.problem.keep_kv else None)
        fwd = sh
        bufs.append(tuple(b))
        code.append(tuple(c))
    return Program(ir.devices, X, tuple(bufs), tuple(code), M)


@dataclass(frozen=True, slots=True)
class Emit(Pass):
    """Lower the schedule to per-device programs (see the module docstring)."""

    name = "emit"
    needs = ("graph", "placement", "schedule")

    def apply(self, ir: PlanIR) -> PlanIR:
        return ir.with_levels(program=emit(ir))
