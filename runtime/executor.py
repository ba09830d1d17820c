"""In-process executor: runs every device's program in one process.

Devices take turns (the same cooperative walk the verifier uses): a device
runs until it waits on a transfer whose other side is not yet posted; the
transport is an in-memory mailbox. A round in which no device moves raises
:class:`DeadlockError` naming the devices and transfer keys.

Forward and backward go through :class:`PlanAttention`, a custom
``torch.autograd.Function``: every compute block's backward uses the global
(merged) out and lse of its query rows, as exactness requires.
"""

from __future__ import annotations

import math

import torch

from ..errors import ShapeError
from ..ir.interp import cooperate
from ..ir.program import (ADD, ATTN, ATTN_BWD, B_DKV, B_DQ, B_KV, B_O, B_Q, BWD, FWD, HOME, MERGE, RECV, SEND,
                          T_DST, WAIT)
from . import kernels

NEG_INF = float("-inf")


class _Views:
    """Row and head ranges of token blocks and head groups."""

    def __init__(self, graph):
        self.s = graph.tb_start.tolist()
        self.e = graph.tb_end.tolist()
        g = graph.problem.group
        self.kv = list(zip(graph.hg_start.tolist(), graph.hg_end.tolist()))
        self.q = [(a * g, b * g) for a, b in self.kv]

    def rows(self, tb):
        return slice(self.s[tb], self.e[tb])


class _Mailbox:
    """In-memory transport: a send posts a copy of the buffer; the receiver's
    wait takes it. (The walk only lets a wait pass once both sides posted.)"""

    def __init__(self, prog):
        self.dst = prog.transfers[:, T_DST].tolist()
        self.box = {}
        self.pending = [dict() for _ in range(prog.devices)]

    def handle(self, d, row, st) -> bool:
        op = row[0]
        if op == SEND:
            self.box[row[1]] = tuple(t.clone() for t in st[row[3]])
        elif op == RECV:
            self.pending[d][row[1]] = row[3]
        elif op == WAIT:
            if self.dst[row[1]] == d:
                st[self.pending[d].pop(row[1])] = self.box.pop(row[1])
        else:
            return False
        return True


def check_inputs(plan_ir, q, k, v) -> None:
    p = plan_ir.problem
    T = p.tokens
    for name, t, heads in (("q", q, p.heads), ("k", k, p.kv_heads), ("v", v, p.kv_heads)):
        if not isinstance(t, torch.Tensor):
            raise ShapeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3 or tuple(t.shape) != (T, heads, p.head_dim):
            raise ShapeError(f"{name} must have shape [tokens={T}, heads={heads}, head_dim={p.head_dim}], "
                             f"got {list(t.shape)}")
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise ShapeError(f"{name} has dtype {t.dtype}; expected a floating dtype")
    if not (q.dtype == k.dtype == v.dtype):
        raise ShapeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ShapeError("q, k, v must be on one device")


def _pieces(graph, c: int):
    return graph.tile_pieces(int(graph.cb_tile[c]))


def run_forward(plan_ir, q, k, v, scale: float):
    """Execute the forward programs. Returns (out fp32 [T, Hq, D], lse fp32 [T, Hq])."""
    g, prog = plan_ir.graph, plan_ir.program
    vw = _Views(g)
    T, Hq, D = q.shape
    out = torch.zeros(T, Hq, D, dtype=torch.float32)
    lse = torch.full((T, Hq), NEG_INF, dtype=torch.float32)
    cq, ck = g.cb_q.tolist(), g.cb_k.tolist()
    state = []
    for d in range(prog.devices):
        st = {}
        for b, (kind, tb, hg, role, _, _) in enumerate(prog.buffers[FWD][d].tolist()):
            if role != HOME:
                continue
            r, (h0, h1), (q0, q1) = vw.rows(tb), vw.kv[hg], vw.q[hg]
            if kind == B_Q:
                st[b] = (q[r, q0:q1],)
            elif kind == B_KV:
                st[b] = (k[r, h0:h1], v[r, h0:h1])
            elif kind == B_O:  # the home accumulator is a view of the global result
                st[b] = (out[r, q0:q1], lse[r, q0:q1])
        state.append(st)
    box = _Mailbox(prog)

    def on(d, i, row):
        op = row[0]
        st = state[d]
        if box.handle(d, row, st):
            pass
        elif op == ATTN:
            c, qb, kb, ob = row[1:5]
            o, l = kernels.attn_fwd(st[qb][0], st[kb][0], st[kb][1], vw.s[cq[c]], vw.s[ck[c]], _pieces(g, c), scale)
            if ob not in st:  # a partial accumulator, created on first write
                st[ob] = (o, l)
            else:
                kernels.merge_into(st[ob][0], st[ob][1], o, l)
        elif op == MERGE:
            dst, src = row[1], row[2]
            kernels.merge_into(st[dst][0], st[dst][1], *st[src])
            del st[src]
        else:  # pragma: no cover - the verifier rejects other opcodes
            raise RuntimeError(f"unexpected opcode {op} in forward")

    cooperate(prog, FWD, on)
    return out, lse


def run_backward(plan_ir, q, k, v, out, lse, dout, scale: float):
    """Execute the backward programs with the global out/lse. Returns fp32 (dq, dk, dv)."""
    g, prog = plan_ir.graph, plan_ir.program
    vw = _Views(g)
    dq = torch.zeros(q.shape, dtype=torch.float32)
    dk = torch.zeros(k.shape, dtype=torch.float32)
    dv = torch.zeros(v.shape, dtype=torch.float32)
    cq, ck = g.cb_q.tolist(), g.cb_k.tolist()
    state = []
    for d in range(prog.devices):
        st = {}
        for b, (kind, tb, hg, role, _, _) in enumerate(prog.buffers[BWD][d].tolist()):
            if role != HOME:
                continue
            r, (h0, h1), (q0, q1) = vw.rows(tb), vw.kv[hg], vw.q[hg]
            if kind == B_Q:
                st[b] = (q[r, q0:q1], out[r, q0:q1], dout[r, q0:q1], lse[r, q0:q1])
            elif kind == B_KV:
                st[b] = (k[r, h0:h1], v[r, h0:h1])
            elif kind == B_DQ:
                st[b] = (dq[r, q0:q1],)
            elif kind == B_DKV:
                st[b] = (dk[r, h0:h1], dv[r, h0:h1])
        state.append(st)
    box = _Mailbox(prog)

    def on(d, i, row):
        op = row[0]
        st = state[d]
        if box.handle(d, row, st):
            pass
        elif op == ATTN_BWD:
            c, qb, kb, dqb, dkvb = row[1:6]
            qq, oo, do, ll = st[qb]
            kk, vv = st[kb]
            gq, gk, gv = kernels.attn_bwd(qq, kk, vv, oo, do, ll, vw.s[cq[c]], vw.s[ck[c]], _pieces(g, c), scale)
            if dqb in st:
                st[dqb][0].add_(gq)
            else:
                st[dqb] = (gq,)
            if dkvb in st:
                st[dkvb][0].add_(gk)
                st[dkvb][1].add_(gv)
            else:
                st[dkvb] = (gk, gv)
        elif op == ADD:
            dst, src = row[1], row[2]
            for a, b in zip(st[dst], st[src]):
                a.add_(b)
            del st[src]
        else:  # pragma: no cover
            raise RuntimeError(f"unexpected opcode {op} in backward")

    cooperate(prog, BWD, on)
    return dq, dk, dv


class PlanAttention(torch.autograd.Function):
    """out = attention(q, k, v) under the plan's mask, computed block by block."""

    @staticmethod
    def forward(ctx, q, k, v, plan_ir, scale):
        out, lse = run_forward(plan_ir, q.detach(), k.detach(), v.detach(), scale)
        res = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, res, lse)
        ctx.plan_ir, ctx.scale = plan_ir, scale
        return res

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = run_backward(ctx.plan_ir, q, k, v, out, lse, dout.contiguous().to(q.dtype), ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def execute(plan_ir, q, k, v, softmax_scale: float | None = None):
    check_inputs(plan_ir, q, k, v)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return PlanAttention.apply(q, k, v, plan_ir, scale)
