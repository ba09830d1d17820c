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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir.module import PlanIR
from ..ir.program import (ADD, ATTN, ATTN_BWD, B_DKV, B_DQ, B_KV, B_O, B_Q, BWD, FWD, HOME, MERGE, PART, RECV,
                          RECVD, SEND, WAIT, Program, buffer_bytes)
from ..ir.schedule import X_KV, X_O, X_Q, XDST, XHG, XK, XSRC, XSTAGE, XTB
from ..ir.verify import needed_transfers
from ..passes.base import Pass, register

_DATA = (B_Q, B_KV)


def transfer_table(ir: PlanIR) -> np.ndarray:
    """All transfers, forward then backward, tagged 0..n-1: rows
    ``(tag, phase, kind, tb, hg, src, dst, bytes, stage)`` (the program keeps
    the first 8 columns)."""
    g, pl, s = ir.graph, ir.placement, ir.schedule
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
    t = np.concatenate(parts).astype(np.int64) if parts else np.zeros((0, 8), np.int64)
    return np.column_stack([np.arange(len(t), dtype=np.int64), t])


def _emit_device(ir: PlanIR, X: np.ndarray, phase: int, d: int):
    g, pl, s = ir.graph, ir.placement, ir.schedule
    home = pl.home
    overlap = s.overlap
    bufs: list[list[int]] = []
    index: dict[tuple, int] = {}

    def add(kind, tb, hg, role, peer, nbytes):
        index[(kind, tb, hg, role)] = len(bufs)
        bufs.append([kind, tb, hg, role, peer, int(nbytes)])
        return len(bufs) - 1

    kinds = (B_Q, B_KV, B_O) if phase == FWD else (B_Q, B_KV, B_DQ, B_DKV)
    mine = np.flatnonzero(home == d)
    for kind in kinds:
        tbs = np.repeat(mine, g.n_hg)
        hgs = np.tile(np.arange(g.n_hg), len(mine))
        for tb, hg, nb in zip(tbs.tolist(), hgs.tolist(), buffer_bytes(g, phase, kind, tbs, hgs).tolist()):
            add(kind, tb, hg, HOME, -1, nb)
    ph = X[X[:, 1] == phase]
    incoming = ph[ph[:, 6] == d].tolist()
    outgoing = ph[ph[:, 5] == d].tolist()
    code: list[list[int]] = []
    recv_tag: dict[int, int] = {}     # receive buffer -> tag
    waited: set[int] = set()          # receive buffers already waited
    post_at: dict[int, list] = {}     # stage -> data transfers to post then
    partial_send: dict[tuple, tuple] = {}
    for tag, _, kind, tb, hg, src, _, nb, stage in incoming:
        b = add(kind, tb, hg, RECVD, src, nb)
        recv_tag[b] = tag
        if kind in _DATA:
            post_at.setdefault(max(stage - 1, 0) if overlap else stage, []).append(("recv", tag, src, b))
        else:
            code.append([RECV, tag, src, b, 0, 0])  # partials: posted up front
    for tag, _, kind, tb, hg, _, dst, _, stage in outgoing:
        if kind in _DATA:
            post_at.setdefault(max(stage - 1, 0) if overlap else stage, []).append(("send", tag, dst, (kind, tb, hg)))
        else:
            partial_send[(kind, tb, hg)] = (tag, dst)

    def wait(b):
        if b in recv_tag and b not in waited:
            waited.add(b)
            code.append([WAIT, recv_tag[b], 0, 0, 0, 0])

    cbs = np.flatnonzero(pl.cb_device == d)
    cq, ck, chg, cst = g.cb_q[cbs], g.cb_k[cbs], g.cb_hg[cbs], s.cb_stage[cbs]
    remote = (home[cq] != d) | (home[ck] != d)
    order = np.lexsort((chg, ck, cq, remote, cst))
    cbs, cq, ck, chg, cst = (a[order].tolist() for a in (cbs, cq, ck, chg, cst))
    out_kinds = (B_O,) if phase == FWD else (B_DQ, B_DKV)
    # the last write of every partial buffer, to send it right after
    last_write: dict[tuple, int] = {}
    for i, (q, k, h) in enumerate(zip(cq, ck, chg)):
        for kind, tb in zip(out_kinds, (q, k)):
            if home[tb] != d:
                last_write[(kind, tb, h)] = i
    send_after: dict[int, list] = {}
    for key, i in last_write.items():
        send_after.setdefault(i if overlap else len(cbs) - 1, []).append(key)
    nxt = 0
    for stage in range(s.stages):
        for what, tag, peer, ref in post_at.get(stage, ()):
            if what == "recv":
                code.append([RECV, tag, peer, ref, 0, 0])
            else:
                kind, tb, hg = ref
                if home[tb] == d:
                    b = index[(kind, tb, hg, HOME)]
                else:  # forwarding a block received earlier
                    b = index[(kind, tb, hg, RECVD)]
                    wait(b)
                code.append([SEND, tag, peer, b, 0, 0])
        if not overlap:
            for what, tag, peer, ref in post_at.get(stage, ()):
                if what == "recv":
                    wait(ref)
        while nxt < len(cbs) and cst[nxt] == stage:
            c, q, k, h = cbs[nxt], cq[nxt], ck[nxt], chg[nxt]
            qb = index[(B_Q, q, h, HOME if home[q] == d else RECVD)]
            kb = index[(B_KV, k, h, HOME if home[k] == d else RECVD)]
            wait(qb)
            wait(kb)
            outs = []
            for kind, tb in zip(out_kinds, (q, k)):
                role = HOME if home[tb] == d else PART
                key = (kind, tb, h, role)
                if key not in index:
                    add(kind, tb, h, role, -1, buffer_bytes(g, phase, kind, np.array([tb]), np.array([h]))[0])
                outs.append(index[key])
            code.append([ATTN, c, qb, kb, outs[0], 0] if phase == FWD else [ATTN_BWD, c, qb, kb, outs[0], outs[1]])
            for kind, tb, hg in send_after.get(nxt, ()):
                tag, dst = partial_send.pop((kind, tb, hg))
                code.append([SEND, tag, dst, index[(kind, tb, hg, PART)], 0, 0])
            nxt += 1
    assert nxt == len(cbs) and not partial_send, f"d{d}: compute blocks or partials left unscheduled"
    for b, tag in recv_tag.items():
        kind, tb, hg = bufs[b][:3]
        if kind not in _DATA:
            code.append([WAIT, tag, 0, 0, 0, 0])
            code.append([MERGE if kind == B_O else ADD, index[(kind, tb, hg, HOME)], b, 0, 0, 0])
    for b, tag in recv_tag.items():  # a forwarded block may be received but never read here
        if bufs[b][0] in _DATA and b not in waited:
            wait(b)
    for tag, *_ in outgoing:
        code.append([WAIT, tag, 0, 0, 0, 0])
    return np.asarray(bufs, np.int64).reshape(-1, 6), np.asarray(code, np.int64).reshape(-1, 6)


def emit(ir: PlanIR) -> Program:
    X = transfer_table(ir)
    bufs, code = [], []
    for phase in (FWD, BWD):
        per = [_emit_device(ir, X, phase, d) for d in range(ir.devices)]
        bufs.append(tuple(b for b, _ in per))
        code.append(tuple(c for _, c in per))
    return Program(ir.devices, X[:, :8], tuple(bufs), tuple(code))


@register
@dataclass(frozen=True, slots=True)
class Emit(Pass):
    name = "emit"
    needs = ("graph", "placement", "schedule")

    def apply(self, ir: PlanIR) -> PlanIR:
        return ir.replace(program=emit(ir))
