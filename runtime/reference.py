"""Dense float64 reference attention, for tests only.

``dense_allowed`` turns global mask pieces into a bool matrix;
``dense_attention`` is plain masked softmax attention in float64, differentiable
by torch autograd (empty rows give out 0, lse -inf and zero, non-NaN gradients).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

__all__ = ["dense_allowed", "dense_attention"]


def dense_allowed(pieces: np.ndarray, T: int) -> np.ndarray:
    """bool [T, T]: (q, k) allowed iff some piece (q0, q1, k0, k1, lo, hi) has
    q0 <= q < q1, k0 <= k < k1 and lo <= k - q <= hi."""
    p = np.asarray(pieces, dtype=np.int64).reshape(-1, 6)
    allowed = np.zeros((T, T), dtype=bool)
    q = np.arange(T)[:, None]
    k = np.arange(T)[None, :]
    d = k - q
    for q0, q1, k0, k1, lo, hi in p.tolist():
        q0, q1, k0, k1 = max(q0, 0), min(q1, T), max(k0, 0), min(k1, T)
        if q0 >= q1 or k0 >= k1:
            continue
        sub = d[q0:q1, k0:k1]
        allowed[q0:q1, k0:k1] |= (sub >= lo) & (sub <= hi)
    return allowed


def dense_attention(q: Tensor, k: Tensor, v: Tensor, allowed, scale: float) -> tuple[Tensor, Tensor]:
    """q [Sq, Hq, D], k/v [Sk, Hkv, D], allowed bool [Sq, Sk] (local rows/cols).

    Returns (out float64 [Sq, Hq, D], lse float64 [Sq, Hq]); rows with no
    allowed key have out 0 and lse -inf. GQA: q head h uses kv head
    h // (Hq // Hkv).
    """
    allowed = torch.as_tensor(np.asarray(allowed) if not isinstance(allowed, Tensor) else allowed,
                              dtype=torch.bool)
    q, k, v = q.to(torch.float64), k.to(torch.float64), v.to(torch.float64)
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    has = allowed.any(dim=1)  # [Sq]
    # Empty rows: all scores 0 (finite), zeroed after the softmax.
    m = allowed | ~has[:, None]
    s = torch.where(m, s, torch.full_like(s, float("-inf")))
    s = torch.where(has[:, None], s, torch.zeros_like(s))
    p = torch.softmax(s, dim=-1) * has[:, None].to(s.dtype)
    lse = torch.logsumexp(s, dim=-1)
    lse = torch.where(has[None, :], lse, torch.full_like(lse, float("-inf")))
    out = torch.einsum("hqk,khd->qhd", p, v)
    return out, lse.transpose(0, 1)
