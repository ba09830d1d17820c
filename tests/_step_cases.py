"""Shared by the step tests (loaded by path: tests/ is not a package): every
micro-batch's attention plan executed against dense causal attention."""

from __future__ import annotations

import math

import torch

from attnplan.runtime.executor import execute


def dense_causal(q, k, v):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    n = q.shape[0]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)


def check_execution(c, seed=0):
    """Every micro-batch's attention plan on its fragments' q, k, v equals dense causal attention of every
    fragment's rows of its document, the gradient of q too; a later chunk of a cut document (a cross
    problem: its rows x every key of its document up to its end) also the gradients of its keys."""
    p, plan = c.plan.problem, c.plan
    gen = torch.Generator().manual_seed(seed)
    m = p.model
    docs = {d: [torch.randn(int(p.seqlens[d]), h, m.head_dim, generator=gen, dtype=torch.float64)
                for h in (m.heads, m.kv_heads, m.kv_heads)] for d in range(p.docs)}
    ptr = plan.mb_ptr()
    for mb, low in enumerate(c.lowered):
        frags = range(int(ptr[mb]), int(ptr[mb + 1]))
        prefix = plan.mb_prefix(mb)
        if prefix:
            (f,) = frags
            d, s, e = int(plan.frag_doc[f]), int(plan.frag_start[f]), int(plan.frag_end[f])
            q = docs[d][0][s:e].float().requires_grad_(True)
            k, v = (docs[d][i][:e].float().requires_grad_(True) for i in (1, 2))
            out = execute(low.ir, q, k, v)
            out.square().sum().backward()
            qd, kd, vd = (docs[d][i][:e].clone().requires_grad_(True) for i in range(3))
            ref = dense_causal(qd, kd, vd)[s:e]
            ref.square().sum().backward()
            assert torch.allclose(out.double(), ref, atol=2e-5), (mb, d)
            for got, want in ((q.grad, qd.grad[s:e]), (k.grad, kd.grad), (v.grad, vd.grad)):
                assert torch.allclose(got.double(), want, atol=1e-4), (mb, d)
            continue
        rows = [(int(plan.frag_doc[f]), int(plan.frag_start[f]), int(plan.frag_end[f])) for f in frags]
        q, k, v = (torch.cat([docs[d][i][s:e] for d, s, e in rows]).float().requires_grad_(True) for i in range(3))
        out = execute(low.ir, q, k, v)
        out.square().sum().backward()
        off = 0
        for d, s, e in rows:
            assert s == 0, (mb, d, s)  # a fragment packed with others starts its document
            n = e - s
            qd = docs[d][0][:e].clone().requires_grad_(True)
            ref = dense_causal(qd, docs[d][1][:e], docs[d][2][:e])
            ref.square().sum().backward()
            assert torch.allclose(out[off:off + n].double(), ref, atol=2e-5), (mb, d)
            assert torch.allclose(q.grad[off:off + n].double(), qd.grad, atol=1e-4), (mb, d)
            off += n
