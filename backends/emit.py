"""emit: lower a scheduled placement to per-device instruction streams.

Forward, per device: post every receive, post the sends of owned Q/KV,
run compute blocks by stage (blocks needing nothing remote first), waiting on
a receive right before the first block that reads it; send each partial O
home right after its last write; finally wait for incoming partials and merge
them, then wait for the own sends. Backward mirrors it: Q bundles (q, out,
dout, lse) and KV move like Q and KV; partial dQ goes to Q's home and partial
dKV to KV's home, summed in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir.module import PlanIR
from ..ir.program import (ADD, ATTN, ATTN_BWD, B_DKV, B_DQ, B_KV, B_O, B_Q, BWD, FWD, HOME, MERGE, PART, RECV,
                          RECVD, SEND, WAIT, Program, buffer_bytes)
from ..ir.schedule import X_KV, X_O, X_Q, XDST, XHG, XK, XSRC, XTB
from ..passes.base import Pass, register


def transfer_table(ir: PlanIR) -> np.ndarray:
    """All transfers, forward then backward, tagged 0..n-1: rows
    ``(tag, phase, kind, tb, hg, src, dst, bytes)``."""
    g, x = ir.graph, ir.schedule.xfer
    parts = []
    fwd = [(B_Q, x[x[:, XK] == X_Q], False), (B_KV, x[x[:, XK] == X_KV], False), (B_O, x[x[:, XK] == X_O], False)]
    bwd = [(B_Q, fwd[0][1], False), (B_KV, fwd[1][1], False), (B_DQ, fwd[2][1], False), (B_DKV, fwd[1][1], True)]
    for phase, items in ((FWD, fwd), (BWD, bwd)):
        for kind, rows, reverse in items:
            src, dst = (rows[:, XDST], rows[:, XSRC]) if reverse else (rows[:, XSRC], rows[:, XDST])
            nbytes = buffer_bytes(g, phase, kind, rows[:, XTB], rows[:, XHG])
            parts.append(np.column_stack([np.full(len(rows), phase), np.full(len(rows), kind), rows[:, XTB],
                                          rows[:, XHG], src, dst, nbytes]))
    t = np.concatenate(parts).astype(np.int64) if parts else np.zeros((0, 7), np.int64)
    return np.column_stack([np.arange(len(t), dtype=np.int64), t])


def _emit_device(ir: PlanIR, X: np.ndarray, phase: int, d: int):
    g, pl, s = ir.graph, ir.placement, ir.schedule
    home = pl.home
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
    code: list[list[int]] = []
    ph = X[X[:, 1] == phase]
    incoming = ph[ph[:, 6] == d].tolist()
    outgoing = ph[ph[:, 5] == d].tolist()
    recv_tag = {}
    for tag, _, kind, tb, hg, src, _, nb in incoming:
        b = add(kind, tb, hg, RECVD, src, nb)
        recv_tag[b] = tag
        code.append([RECV, tag, src, b, 0, 0])
    send_later = {}
    for tag, _, kind, tb, hg, _, dst, _ in outgoing:
        if kind in (B_Q, B_KV):
            code.append([SEND, tag, dst, index[(kind, tb, hg, HOME)], 0, 0])
        else:
            send_later[(kind, tb, hg)] = (tag, dst)
    # compute blocks: by stage, local-only first, then by (q, k, hg)
    cbs = np.flatnonzero(pl.cb_device == d)
    cq, ck, chg = g.cb_q[cbs], g.cb_k[cbs], g.cb_hg[cbs]
    remote = (home[cq] != d) | (home[ck] != d)
    order = np.lexsort((chg, ck, cq, remote, s.cb_stage[cbs]))
    cbs, cq, ck, chg = cbs[order], cq[order], ck[order], chg[order]
    out_kinds = (B_O,) if phase == FWD else (B_DQ, B_DKV)
    rows = []
    waited = set()
    for c, q, k, h in zip(cbs.tolist(), cq.tolist(), ck.tolist(), chg.tolist()):
        qb = index[(B_Q, q, h, HOME if home[q] == d else RECVD)]
        kb = index[(B_KV, k, h, HOME if home[k] == d else RECVD)]
        for b in (qb, kb):
            if b in recv_tag and b not in waited:
                waited.add(b)
                rows.append([WAIT, recv_tag[b], 0, 0, 0, 0])
        outs = []
        for kind, tb in zip(out_kinds, (q, k)):
            role = HOME if home[tb] == d else PART
            key = (kind, tb, h, role)
            if key not in index:
                add(kind, tb, h, role, -1, buffer_bytes(g, phase, kind, np.array([tb]), np.array([h]))[0])
            outs.append(index[key])
        if phase == FWD:
            rows.append([ATTN, c, qb, kb, outs[0], 0])
        else:
            rows.append([ATTN_BWD, c, qb, kb, outs[0], outs[1]])
    # send each partial right after its last write
    last = {}
    for i, r in enumerate(rows):
        if r[0] in (ATTN, ATTN_BWD):
            for b in r[4:4 + len(out_kinds)]:
                if bufs[b][3] == PART:
                    last[b] = i
    after = {}
    for b, i in last.items():
        kind, tb, hg = bufs[b][:3]
        tag, dst = send_later.pop((kind, tb, hg))
        after.setdefault(i, []).append([SEND, tag, dst, b, 0, 0])
    assert not send_later, f"partials scheduled but never computed on d{d}: {sorted(send_later)}"
    for i, r in enumerate(rows):
        code.append(r)
        code.extend(after.get(i, ()))
    # incoming partials: wait and merge into the home block
    for b, tag in recv_tag.items():
        kind, tb, hg = bufs[b][:3]
        if kind in (B_O, B_DQ, B_DKV):
            code.append([WAIT, tag, 0, 0, 0, 0])
            code.append([MERGE if kind == B_O else ADD, index[(kind, tb, hg, HOME)], b, 0, 0, 0])
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
    return Program(ir.devices, X, tuple(bufs), tuple(code))


@register
@dataclass(frozen=True, slots=True)
class Emit(Pass):
    name = "emit"
    needs = ("graph", "placement", "schedule")

    def apply(self, ir: PlanIR) -> PlanIR:
        return ir.replace(program=emit(ir))
