"""``plan run``: execute a plan on random inputs and compare with dense masked
attention in float64, computed one sample at a time (nothing attends across
samples, so the reference never builds a T × T matrix)."""

from __future__ import annotations

import math

import torch

from ..errors import PlanError
from ..ir.mask import K0, Q0
from .executor import execute
from .reference import dense_allowed, dense_attention

# max abs error / max(1, max |reference|), per dtype and tensor. bf16 keeps 8
# mantissa bits; its gradients also carry the op's own bf16 backward error
# (about 1e-2 relative on a single untiled call) plus one bf16 rounding per tile.
TOLERANCE = {"float32": {"out": 1e-5, "dq": 1e-5, "dk": 1e-5, "dv": 1e-5},
             "bfloat16": {"out": 1e-2, "dq": 4e-2, "dk": 4e-2, "dv": 4e-2}}
MAX_CHECK_SAMPLE = 8192
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def random_inputs(plan, dtype: str, seed: int):
    p = plan.problem
    gen = torch.Generator().manual_seed(seed)
    T = p.tokens

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(DTYPES[dtype])

    return r(T, p.heads, p.head_dim), r(T, p.kv_heads, p.head_dim), r(T, p.kv_heads, p.head_dim), \
        r(T, p.heads, p.head_dim)


def run_plan(plan, dtype: str = "float32", seed: int = 0):
    """Forward and backward on random inputs; returns (out, dq, dk, dv, inputs)."""
    q, k, v, dout = random_inputs(plan, dtype, seed)
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    out = execute(plan.ir, q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return out.detach(), dq, dk, dv, (q.detach(), k.detach(), v.detach(), dout)


def reference(problem, q, k, v, dout, scale: float):
    """Dense float64 out and gradients, sample by sample."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    grads = [torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v)]
    off = problem.offsets
    P = problem.pieces.a
    for i in range(len(problem.seqlens)):
        a, b = int(off[i]), int(off[i + 1])
        sel = P[(P[:, Q0] >= a) & (P[:, Q0] < b) & (P[:, K0] >= a) & (P[:, K0] < b)].copy()
        sel[:, :4] -= a
        allowed = dense_allowed(sel, b - a)
        qs, ks, vs = (t[a:b].to(torch.float64).requires_grad_(True) for t in (q, k, v))
        o, _ = dense_attention(qs, ks, vs, allowed, scale)
        g = torch.autograd.grad(o, (qs, ks, vs), dout[a:b].to(torch.float64), allow_unused=True)
        out[a:b] = o.detach()
        for acc, x in zip(grads, g):
            if x is not None:
                acc[a:b] = x
    return out, grads


def check_plan(plan, dtype: str = "float32", seed: int = 0) -> dict:
    """Max abs errors of out, dq, dk, dv against the dense reference, scaled
    by max(1, max |reference|), and whether each is within tolerance."""
    biggest = int(plan.problem.seqlens.max())
    if biggest > MAX_CHECK_SAMPLE:
        raise PlanError(f"--check builds a dense reference per sample; the largest sample has {biggest} tokens "
                        f"(limit {MAX_CHECK_SAMPLE})")
    out, dq, dk, dv, (q, k, v, dout) = run_plan(plan, dtype, seed)
    scale = 1.0 / math.sqrt(plan.problem.head_dim)
    ref_out, (rq, rk, rv) = reference(plan.problem, q, k, v, dout, scale)
    res = {"tol": {}, "ok": True}
    for name, got, want in (("out", out, ref_out), ("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        err = float((got.to(torch.float64) - want).abs().max()) if want.numel() else 0.0
        err /= max(1.0, float(want.abs().max()) if want.numel() else 1.0)
        finite = bool(torch.isfinite(got).all())
        res[name] = err if finite else float("inf")
        res["tol"][name] = TOLERANCE[dtype][name]
        res["ok"] &= finite and err <= TOLERANCE[dtype][name]
    return res
