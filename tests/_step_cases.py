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
    document, the gradient of q too."""
    p, plan = c.plan.problem, c.plan
    gen = torch.Generator().manual_seed(seed)
    m = p.model
    docs = {d: [torch.randn(int(p.seqlens[d]), h, m.head_dim, generator=gen, dtype=torch.float64)
                for h in (m.heads, m.kv_heads, m.kv_heads)] for d in range(p.docs)}
    ptr = plan.mb_ptr()
    for mb, low in enumerate(c.lowered):
        ids = plan.frag_doc[ptr[mb]:ptr[mb + 1]].tolist()
        q, k, v = (torch.cat([docs[d][i] for d in ids]).float().requires_grad_(True) for i in range(3))
        out = execute(low.ir, q, k, v)
        out.square().sum().backward()
        off = 0
        for d in ids:
            n = int(p.seqlens[d])
            qd = docs[d][0].clone().requires_grad_(True)
            ref = dense_causal(qd, docs[d][1], docs[d][2])
            ref.square().sum().backward()
            assert torch.allclose(out[off:off + n].double(), ref, atol=2e-5), (mb, d)
            assert torch.allclose(q.grad[off:off + n].double(), qd.grad, atol=1e-4), (mb, d)
            off += n
