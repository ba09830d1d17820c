"""emit: lower a scheduled placement to per-device instruction streams.

Per device and phase, stage by stage:

* a Q/KV transfer of stage ``s`` must complete before compute stage ``s``.
  With ``schedule.overlap`` it is posted at the start of stage ``s-1`` (so it
  flies during that stage's compute) and waited lazily, right before the first
  compute block that reads it; without, it is posted and waited at the start
  of stage ``s``;
* a device forwarding a block it received (ring traffic) waits for it first;
* compute blocks run by stage, those needing nothing remote first;
* partial outputs (forward O; backward dQ and dKV) are sent home right after
  their last write with ``overlap``, else after the last stage; receives of
  partials are posted up front and merged at the end;
* finally every own send is waited.

Backward mirrors the forward routes: Q bundles (q, out, dout, lse) and KV
travel like Q and KV; partial dQ goes to Q's home and partial dKV to KV's
home, summed in fp32.

Cost follows the work, not devices × work: every instruction of every device
is an event row tagged with its device and its place in that device's
program (stage, section, position); one stable sort of all events puts each
device's stream in program order, a receive is waited at its first use
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
from ..ir.program import (ADD, ATTN, ATTN_BWD, B_DKV, B_DQ, B_KV, B_O, B_Q, BWD, FWD, HOME, KINDS, MERGE, PART,
                          PHASES, RECV, RECVD, SEND, T_BYTES, T_DST, T_HG, T_KIND, T_PHASE, T_SRC, T_TAG, T_TB,
                          WAIT, Program, buffer_bytes)
from ..ir.schedule import X_KV, X_O, X_Q, XDST, XHG, XK, XSRC, XSTAGE, XTB, Schedule
from ..ir.verify import needed_transfers
from .base import Pass

_DATA = (B_Q, B_KV)
T_STAGE = 8  # the transfer table's extra column (the program keeps the first 8)
_I64 = np.int64


def _levels(ir: PlanIR) -> tuple[BlockGraph, Placement, Schedule]:
    """The levels emit lowers (a clear error when one is missing)."""
    g, pl, s = ir.graph, ir.placement, ir.schedule
    if g is None or pl is None or s is None:
        missing = [n for n, v in (("graph", g), ("placement", pl), ("schedule", s)) if v is None]
        raise PlanError(f"emit needs a {', '.join(missing)}; run tile, a placement and comm before it")
    return g, pl, s


def transfer_table(ir: PlanIR) -> np.ndarray:
    """All transfers, forward then backward, tagged 0..n-1: rows
    ``(tag, phase, kind, tb, hg, src, dst, bytes, stage)`` (the program keeps
    the first 8 columns)."""
    g, pl, s = _levels(ir)
    x = s.xfer
    last = s.stages - 1
    dkv = needed_transfers(g, pl)[X_KV]  # (tb, hg, home, device): reversed for dKV partials
    dkv_rows = np.column_stack([np.full(len(dkv), X_KV), dkv[:, 0], dkv[:, 1], dkv[:, 3], dkv[:, 2],
                                np.full(len(dkv), last)]).reshape(-1, 6)
    fwd = [(B_Q, x[x[:, XK] == X_Q]), (B_KV, x[x[:, XK] == X_KV]), (B_O, x[x[:, XK] == X_O])]
    bwd = [(B_Q, fwd[0][1]), (B_KV, fwd[1][1]), (B_DQ, fwd[2][1]), (B_DKV, dkv_rows)]
    parts = []
    for phase, items in ((FWD, fwd), (BWD, bwd)):
        for kind, rows in items:
            nbytes = buffer_bytes(g, phase, kind, rows[:, XTB], rows[:, XHG])
            parts.append(np.column_stack([np.full(len(rows), phase), np.full(len(rows), kind), rows[:, XTB],
                                          rows[:, XHG], rows[:, XSRC], rows[:, XDST], nbytes, rows[:, XSTAGE]]))
    t = np.concatenate(parts).astype(_I64) if parts else np.zeros((0, 8), _I64)
    return np.column_stack([np.arange(len(t), dtype=_I64), t])


def _is_data(kind: np.ndarray) -> np.ndarray:
    """Q or KV (the rest are partial outputs)."""
    return (kind == B_Q) | (kind == B_KV)


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


def _by_device(rows: np.ndarray, col: int) -> np.ndarray:
    """Rows stably sorted by the device in column ``col`` (table order within)."""
    return rows[np.argsort(rows[:, col], kind="stable")]


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
    inc: np.ndarray           # the phase's transfers sorted by destination (table order within)
    out: np.ndarray           # ... sorted by source
    m: np.ndarray             # device -> home token blocks
    n_home: np.ndarray        # device -> home buffers
    n_in: np.ndarray          # device -> incoming transfers
    inc_buf: np.ndarray       # local receive buffer of each row of ``inc``
    recv_keys: np.ndarray     # sorted keys (device, kind, tb, hg) of receive buffers
    recv_buf: np.ndarray      # their local buffer (the last received, if a key repeats)

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


def _key(n_tb: int, n_hg: int, dev, kind, tb, hg) -> np.ndarray:
    """One integer per (device, kind, token block, head group)."""
    return ((np.asarray(dev, _I64) * len(KINDS) + kind) * n_tb + tb) * n_hg + hg


def _last_of_each(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct keys and, for each, the value of its last occurrence."""
    order = np.argsort(keys, kind="stable")
    k = keys[order]
    last = np.r_[k[1:] != k[:-1], True] if len(k) else np.zeros(0, bool)
    return k[last], values[order][last]


def _phase(ir: PlanIR, X: np.ndarray, phase: int) -> _Phase:
    (g, pl, s), n = _levels(ir), ir.devices
    kinds = np.array((B_Q, B_KV, B_O) if phase == FWD else (B_Q, B_KV, B_DQ, B_DKV))
    tb = np.repeat(np.arange(g.n_tb), g.n_hg)
    hg = np.tile(np.arange(g.n_hg), g.n_tb)
    nbytes = np.stack([buffer_bytes(g, phase, k, tb, hg).reshape(g.n_tb, g.n_hg) for k in kinds.tolist()])
    ph = X[X[:, T_PHASE] == phase]
    _check_devices("home", pl.home, n, "token block")
    _check_devices("computing", pl.cb_device, n, "compute block")
    _check_devices("source", ph[:, T_SRC], n, f"{PHASES[phase]} transfer #")
    _check_devices("destination", ph[:, T_DST], n, f"{PHASES[phase]} transfer #")
    by_home = np.argsort(pl.home, kind="stable")
    rank = np.empty(g.n_tb, _I64)
    rank[by_home] = _rank_in_group(pl.home[by_home])
    m = np.bincount(pl.home, minlength=n)
    n_home = len(kinds) * m * g.n_hg
    inc = _by_device(ph, T_DST)
    inc_buf = n_home[inc[:, T_DST]] + _rank_in_group(inc[:, T_DST])
    recv_keys, recv_buf = _last_of_each(_key(g.n_tb, g.n_hg, inc[:, T_DST], inc[:, T_KIND], inc[:, T_TB],
                                             inc[:, T_HG]), inc_buf)
    return _Phase(g, pl, s, phase, pl.home, rank, kinds, np.array((B_O,) if phase == FWD else (B_DQ, B_DKV)),
                  nbytes, inc, _by_device(ph, T_SRC), m, n_home, np.bincount(ph[:, T_DST], minlength=n), inc_buf,
                  recv_keys, recv_buf)


# ---------------------------------------------------------------- buffer tables

def _buffer_tables(sh: _Phase, part_dev: np.ndarray, part_rows: np.ndarray) -> list[np.ndarray]:
    """Each device's buffer table: home buffers, receive buffers, partials."""
    n_dev, H = len(sh.n_home), sh.n_hg
    k, tb, h = (a.ravel() for a in np.meshgrid(np.arange(len(sh.kinds)), np.arange(len(sh.home)), np.arange(H),
                                              indexing="ij"))
    order = np.lexsort((h, sh.rank[tb], k, sh.home[tb]))
    k, tb, h = k[order], tb[order], h[order]
    kind = sh.kinds[k]
    home = _rows(kind, tb, h, HOME, -1, sh.nbytes[k, tb, h])
    inc = sh.inc
    recv = _rows(inc[:, T_KIND], inc[:, T_TB], inc[:, T_HG], RECVD, inc[:, T_SRC], inc[:, T_BYTES])
    dev = np.concatenate([sh.home[tb], inc[:, T_DST], part_dev])
    section = np.repeat([0, 1, 2], [len(home), len(recv), len(part_rows)])
    order = np.lexsort((section, dev))
    table = np.concatenate([home, recv, part_rows.reshape(-1, 6)])[order]
    return np.split(table, np.cumsum(np.bincount(dev, minlength=n_dev))[:-1])


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


def _compute_order(sh: _Phase):
    """Compute blocks by device, then stage, those needing nothing remote
    first, then q block, kv block and head group."""
    g, pl, s = sh.graph, sh.placement, sh.schedule
    dev, cq, ck, chg, cst = pl.cb_device, g.cb_q, g.cb_k, g.cb_hg, s.cb_stage
    bad = (cst < 0) | (cst >= s.stages)
    if bad.any():
        i = int(np.argmax(bad))
        raise VerifyError(f"emit: device {dev[i]}: compute block c{i} is in stage {cst[i]}, outside "
                          f"0..{s.stages - 1}, so it would never run")
    remote = (sh.home[cq] != dev) | (sh.home[ck] != dev)
    order = np.lexsort((chg, ck, cq, remote, cst, dev))
    return order, dev[order], cq[order], ck[order], chg[order], cst[order]


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
    local = sh.n_home[fd] + sh.n_in[fd] + _rank_in_group(fd)
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
    return _Compute(dev, order, cst, _rank_in_group(dev), qb, kb, outs, pdev, rows, keys, pbuf, first, last)


# ---------------------------------------------------------------- events in program order

@dataclass(frozen=True, slots=True)
class _Events:
    """Instructions with their place in their device's program: sorted by
    (device, stage, section, position, sub, tie). ``cond >= 0`` marks a wait
    for receive buffer ``cond`` that is kept only at its first wait."""

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


def _wait(sh: _Phase, dev: np.ndarray, buf: np.ndarray) -> np.ndarray:
    """Wait rows for the receive buffers ``buf`` of devices ``dev``."""
    if not len(buf):
        return np.zeros((0, 6), _I64)
    start = np.searchsorted(sh.inc[:, T_DST], np.arange(len(sh.n_home)))
    return _code(WAIT, sh.inc[start[dev] + buf - sh.n_home[dev], T_TAG])


def _post_events(sh: _Phase) -> list[_Events]:
    """Posting of data transfers: each device's receives then sends of a
    stage, in table order, at stage ``s-1`` with overlap (else ``s``). A
    forwarded block is waited before it is sent on; without overlap,
    receives are waited right after posting."""
    s = sh.schedule
    rin = np.flatnonzero(_is_data(sh.inc[:, T_KIND]))
    inc, rb = sh.inc[rin], sh.inc_buf[rin]
    sout = sh.out[_is_data(sh.out[:, T_KIND])]
    stage = np.concatenate([inc[:, T_STAGE], sout[:, T_STAGE]])
    post = np.maximum(stage - 1, 0) if s.overlap else stage
    bad = (stage < 0) | (post >= s.stages)
    if bad.any():
        i = int(np.argmax(bad))
        t = np.concatenate([inc, sout])[i]
        raise VerifyError(f"emit: transfer t{t[T_TAG]} is in stage {stage[i]}, outside 0..{s.stages - 1}, so it "
                          f"would never be posted")
    nr = len(inc)
    n_recv = np.bincount(inc[:, T_DST], minlength=len(sh.n_home))
    rpos = _rank_in_group(inc[:, T_DST])
    rdev, sdev = inc[:, T_DST], sout[:, T_SRC]
    ev = [_Events.make(rdev, post[:nr], _POST, rpos, 0, 0, _code(RECV, inc[:, T_TAG], inc[:, T_SRC], rb))]
    sb = sh.lookup(sdev, sout[:, T_KIND], sout[:, T_TB], sout[:, T_HG], lambda i: f"transfer t{sout[i, T_TAG]}")
    sp, spos = post[nr:], n_recv[sdev] + _rank_in_group(sdev)
    fwd = sh.home[sout[:, T_TB]] != sdev  # forwarding a block received earlier: wait for it first
    ev.append(_Events.make(sdev[fwd], sp[fwd], _POST, spos[fwd], 0, 0, _wait(sh, sdev[fwd], sb[fwd]), sb[fwd]))
    ev.append(_Events.make(sdev, sp, _POST, spos, 1, 0, _code(SEND, sout[:, T_TAG], sout[:, T_DST], sb)))
    if not s.overlap:
        ev.append(_Events.make(rdev, post[:nr], _WAIT_POSTED, rpos, 0, 0, _wait(sh, rdev, rb), rb))
    return ev




def _compute_events(sh: _Phase, c: _Compute) -> list[_Events]:
    """Per compute block: wait its received operands, run it, then send the
    partials it wrote last (with overlap; else all after the device's last block)."""
    ev = []
    for sub, b in ((0, c.qb), (1, c.kb)):
        rcv = b >= sh.n_home[c.dev]  # operands are home or received, never partial
        ev.append(_Events.make(c.dev[rcv], c.stage[rcv], _COMPUTE, c.local[rcv], sub, 0,
                               _wait(sh, c.dev[rcv], b[rcv]), b[rcv]))
    if sh.phase == FWD:
        attn = _code(ATTN, c.cb, c.qb, c.kb, c.outs[:, 0])
    else:
        attn = _code(ATTN_BWD, c.cb, c.qb, c.kb, c.outs[:, 0], c.outs[:, 1])
    ev.append(_Events.make(c.dev, c.stage, _COMPUTE, c.local, 2, 0, attn))
    ev.append(_partial_sends(sh, c))
    return ev


def _partial_sends(sh: _Phase, c: _Compute) -> _Events:
    out = sh.out[~_is_data(sh.out[:, T_KIND])]
    keys = sh.key(out[:, T_SRC], out[:, T_KIND], out[:, T_TB], out[:, T_HG])
    _check_partials(sh, out, keys, c)
    row = np.argsort(keys)[np.searchsorted(np.sort(keys), c.part_keys)]  # each partial's transfer home
    if sh.schedule.overlap:
        anchor = c.part_last
    else:  # after the device's last block
        anchor = np.searchsorted(c.dev, c.part_dev, side="right") - 1
    return _Events.make(c.part_dev, c.stage[anchor], _COMPUTE, c.local[anchor], 3, c.part_first,
                        _code(SEND, out[row, T_TAG], out[row, T_DST], c.part_buf))


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
    """Events in program order, each receive waited only at its first wait.
    Returns ((device, code), (device, buffer) of every waited receive)."""
    dev, code, cond = ev.in_order()
    c = np.flatnonzero(cond >= 0)
    span = int(cond.max(initial=0)) + 1
    waited, first = np.unique(dev[c] * span + cond[c], return_index=True)
    keep = np.ones(len(code), bool)
    keep[c] = False
    keep[c[first]] = True
    return (dev[keep], code[keep]), (waited // span, waited % span)


def _prelude(sh: _Phase) -> _Events:
    """Receives of partials, posted up front."""
    p = np.flatnonzero(~_is_data(sh.inc[:, T_KIND]))
    inc = sh.inc[p]
    return _Events.make(inc[:, T_DST], 0, 0, p, 0, 0, _code(RECV, inc[:, T_TAG], inc[:, T_SRC], sh.inc_buf[p]))


def _tail(sh: _Phase, waited) -> _Events:
    """After the last stage: wait and merge every received partial (in
    arrival order), wait forwarded blocks never read there, wait own sends."""
    inc = sh.inc
    p = np.flatnonzero(~_is_data(inc[:, T_KIND]))
    at_home = sh.home[inc[p, T_TB]] == inc[p, T_DST]
    if not at_home.all():
        t = inc[p[np.argmin(at_home)]]
        raise VerifyError(f"emit: device {t[T_DST]} {sh.where}: receives partial {KINDS[t[T_KIND]]}"
                          f"[tb{t[T_TB]},hg{t[T_HG]}] (transfer t{t[T_TAG]}) for a block that is not home there")
    merge = np.where(inc[p, T_KIND] == B_O, MERGE, ADD)
    home_b = sh.home_index(inc[p, T_KIND], inc[p, T_TB], inc[p, T_HG])
    pd = inc[p, T_DST]
    ev = [_Events.make(pd, 0, 0, 2 * p, 0, 0, _code(WAIT, inc[p, T_TAG])),
          _Events.make(pd, 0, 0, 2 * p + 1, 0, 0, _code(merge, home_b, sh.inc_buf[p]))]
    d = np.flatnonzero(_is_data(inc[:, T_KIND]))
    span = int(sh.inc_buf.max(initial=0)) + 1
    wd, wb = waited
    read = np.isin(inc[d, T_DST] * span + sh.inc_buf[d], wd * span + wb)
    u = d[~read]
    ev.append(_Events.make(inc[u, T_DST], 0, 1, u, 0, 0, _code(WAIT, inc[u, T_TAG])))
    out = sh.out
    ev.append(_Events.make(out[:, T_SRC], 0, 2, np.arange(len(out)), 0, 0, _code(WAIT, out[:, T_TAG])))
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


def _emit_phase(ir: PlanIR, X: np.ndarray, phase: int) -> tuple[list, list]:
    """Every device's buffer table and instruction stream of one phase."""
    sh = _phase(ir, X, phase)
    c = _compute(sh)
    body, waited = _program_order(_Events.concat(_post_events(sh) + _compute_events(sh, c)))
    prelude, tail = (ev.in_order()[:2] for ev in (_prelude(sh), _tail(sh, waited)))
    code = _streams(len(sh.n_home), [prelude, body, tail])
    return _buffer_tables(sh, c.part_dev, c.part_rows), code


def emit(ir: PlanIR) -> Program:
    X = transfer_table(ir)
    bufs, code = [], []
    for phase in (FWD, BWD):
        b, c = _emit_phase(ir, X, phase)
        bufs.append(tuple(b))
        code.append(tuple(c))
    return Program(ir.devices, X[:, :8], tuple(bufs), tuple(code))


@dataclass(frozen=True, slots=True)
class Emit(Pass):
    """Lower the schedule to per-device programs (see the module docstring)."""

    name = "emit"
    needs = ("graph", "placement", "schedule")

    def apply(self, ir: PlanIR) -> PlanIR:
        return ir.with_levels(program=emit(ir))
