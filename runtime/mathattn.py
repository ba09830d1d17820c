"""Masked attention of one call in plain tensor ops, on any device.

The kernel of last resort (and of fp32/fp64 on GPUs, which flash-attn does
not take): the scores of the call are formed in the accumulator dtype
(float32; float64 for float64 inputs), a boolean ``allowed`` mask (None:
every pair) excludes pairs, and the softmax statistics come back as the
natural-log ``lse`` the merge uses. Rows are taken in chunks so that the
score matrix held at once stays under :data:`CHUNK` elements.

Semantics are the CPU op's (:mod:`attnplan.runtime.kernels`) for finite
inputs: ``fwd`` returns (out [m, Hq, D], lse [m, Hq]); a row with no allowed
key has out 0 and lse −inf. ``bwd`` takes the GLOBAL (merged) out and lse of
the call's rows and returns this call's share of (dq, dk, dv): with
P = exp(s − lse) and D = rowsum(dout ∘ out), dS = P (dout·vᵀ − D). Grouped
query heads (Hkv dividing Hq) are handled by viewing q as [Hkv, rep·m, D].
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK = 1 << 25  # score elements per row chunk (128 MiB in float32)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _heads(x: Tensor, hkv: int, acc: torch.dtype) -> Tensor:
    """[m, Hq, D] -> [Hkv, rep, m, D] in ``acc``."""
    m, hq, d = x.shape
    return x.to(acc).permute(1, 0, 2).reshape(hkv, hq // hkv, m, d)


def _scores(qh: Tensor, kh: Tensor, allowed: Tensor | None, scale: float) -> Tensor:
    """[Hkv, rep, m, n] scores, −inf at pairs not allowed."""
    s = torch.matmul(qh, kh.transpose(-1, -2).unsqueeze(1)) * scale
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    return s


def _row_step(hq: int, n: int) -> int:
    return max(1, CHUNK // max(1, hq * n))


def fwd(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """(out [m, Hq, D], lse [m, Hq]) in the accumulator dtype."""
    m, hq, d = q.shape
    n, hkv, _ = k.shape
    acc = acc_dtype(q.dtype)
    kh, vh = k.to(acc).permute(1, 0, 2), v.to(acc).permute(1, 0, 2)  # [Hkv, n, D]
    out = torch.zeros((m, hq, d), dtype=acc, device=q.device)
    lse = torch.full((m, hq), float("-inf"), dtype=acc, device=q.device)
    step = _row_step(hq, n)
    for a in range(0, m, step):
        b = min(m, a + step)
        s = _scores(_heads(q[a:b], hkv, acc), kh, None if allowed is None else allowed[a:b], scale)
        l = torch.logsumexp(s, dim=-1)  # [Hkv, rep, rows]; −inf for a row with no allowed key
        p = torch.exp(s - torch.where(torch.isneginf(l), torch.zeros_like(l), l).unsqueeze(-1))
        o = torch.matmul(p, vh.unsqueeze(1))  # [Hkv, rep, rows, D]
        out[a:b] = o.reshape(hq, b - a, d).permute(1, 0, 2)
        lse[a:b] = l.reshape(hq, b - a).T
    return out, lse


def bwd(q: Tensor, k: Tensor, v: Tensor, out: Tensor, dout: Tensor, lse: Tensor, allowed: Tensor | None,
        scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """This call's (dq [m, Hq, D], dk [n, Hkv, D], dv [n, Hkv, D]) in the
    accumulator dtype, from the global out, dout and lse of its rows (a row
    whose lse is +inf contributes nothing: P = 0)."""
    m, hq, d = q.shape
    n, hkv, _ = k.shape
    acc = acc_dtype(q.dtype)
    kh, vh = k.to(acc).permute(1, 0, 2), v.to(acc).permute(1, 0, 2)
    dq = torch.zeros((m, hq, d), dtype=acc, device=q.device)
    dk = torch.zeros((hkv, n, d), dtype=acc, device=q.device)
    dv = torch.zeros((hkv, n, d), dtype=acc, device=q.device)
    step = _row_step(hq, n)
    for a in range(0, m, step):
        b = min(m, a + step)
        qh, doh = _heads(q[a:b], hkv, acc), _heads(dout[a:b], hkv, acc)
        s = _scores(qh, kh, None if allowed is None else allowed[a:b], scale)
        lh = lse[a:b].to(acc).T.reshape(hkv, hq // hkv, b - a, 1)
        p = torch.exp(s - lh)  # masked pairs: exp(−inf) = 0
        rowd = (doh * _heads(out[a:b], hkv, acc)).sum(-1, keepdim=True)
        ds = p * (torch.matmul(doh, vh.transpose(-1, -2).unsqueeze(1)) - rowd)
        dq[a:b] = (torch.matmul(ds, kh.unsqueeze(1)) * scale).reshape(hq, b - a, d).permute(1, 0, 2)
        dk += torch.matmul(ds.transpose(-1, -2), qh).sum(1) * scale
        dv += torch.matmul(p.transpose(-1, -2), doh).sum(1)
    return dq, dk.permute(1, 0, 2), dv.permute(1, 0, 2)
