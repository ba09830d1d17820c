"""Tile kernels: masked partial attention of one (q block, kv block) tile on CPU.

A tile is the Q rows of one token block (global rows ``[qs, qs+Sq)``) against
the K/V rows of another (global rows ``[ks, ks+Sk)``), restricted to a set of
disjoint mask pieces. A piece is 6 ints ``(q0, q1, k0, k1, lo, hi)`` in global
token coordinates: (q, k) is allowed iff ``q0 <= q < q1``, ``k0 <= k < k1`` and
``lo <= k - q <= hi`` (``lo``/``hi`` may be ``-(1<<62)`` / ``1<<62``: unbounded).

Every piece is lowered to one or two calls of
``aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward) on the
smallest sub-rectangle it touches inside the tile:

* ``full``    every pair of the sub-rect is allowed: no mask;
* ``causal``  ``j <= i`` in sub-rect coordinates: ``is_causal=True`` (the CPU
  op's causal is top-left aligned);
* ``rcausal`` ``j - i >= n - m`` (anti-causal, bottom-right aligned): the rows
  of Q and K/V are reversed, which turns it into ``causal``;
* ``mask``    anything else: an additive float mask (0 / -inf) of the
  sub-rect only, which costs the full dense work of the sub-rect.

A band bounded on one side only (e.g. causal seen from a wider kv block, or
inverse causal) is split into a ``full`` rectangle plus a ``causal`` /
``rcausal`` triangle, which is cheaper than a masked call.

Facts about the CPU op this relies on (torch 2.13, measured):

* layout (B, H, S, D); GQA (fewer kv heads) works directly, and the backward
  returns dk/dv with the kv head count;
* lse is float32 (natural log, scale included) for fp32/bf16/fp16 inputs and
  float64 for float64 inputs; shape (B, H, S) but stored (B, S, H)
  (non-contiguous);
* output is in the input dtype (so bf16 partial outputs carry bf16 rounding);
* the mask must be float (the input dtype, or float32); a bool mask is rejected;
* fully masked rows come back with out 0 and lse 0 (not -inf);
* an empty Q or K/V (S == 0) kills the process with SIGFPE: never call it so.
* the backward wants grad_out/out in the input dtype and lse in the lse dtype
  above; it computes ``D = rowsum(dout * out)`` from the ``out`` it is given, so
  passing the GLOBAL (merged) out and lse yields this tile's exact share.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "NEG_INF",
    "UNBOUNDED",
    "TileCall",
    "plan_tile",
    "attn_fwd",
    "attn_bwd",
    "merge_into",
]

NEG_INF = float("-inf")
UNBOUNDED = 1 << 62

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

FULL, CAUSAL, RCAUSAL, MASK = "full", "causal", "rcausal", "mask"


@dataclass(frozen=True, slots=True)
class TileCall:
    """One op call: tile-local rows [r0, r1) x cols [c0, c1) and a kind.

    For ``mask`` the allowed set is ``lo <= j - i <= hi`` in sub-rect
    coordinates (i = row - r0, j = col - c0).
    """

    r0: int
    r1: int
    c0: int
    c1: int
    kind: str
    lo: int = 0
    hi: int = 0


def _as_pieces(pieces) -> np.ndarray:
    p = np.asarray(pieces, dtype=np.int64)
    if p.size == 0:
        return np.zeros((0, 6), dtype=np.int64)
    if p.ndim == 1:
        p = p.reshape(1, -1)
    if p.ndim != 2 or p.shape[1] != 6:
        raise ValueError(f"pieces must have shape [n, 6], got {p.shape}")
    return p


def plan_tile(qs: int, ks: int, Sq: int, Sk: int, pieces) -> list[TileCall]:
    """Lower the pieces falling in tile [qs, qs+Sq) x [ks, ks+Sk) to op calls.

    Pieces are clipped to the tile (passing unclipped global pieces is fine),
    tightened to the rows/cols they actually touch, and classified. The calls
    of one tile are pairwise disjoint and together allow exactly the union of
    the pieces inside the tile.
    """
    p = _as_pieces(pieces)
    if p.shape[0] == 0 or Sq <= 0 or Sk <= 0:
        return []
    q0, q1, k0, k1 = p[:, 0], p[:, 1], p[:, 2], p[:, 3]
    lo = np.clip(p[:, 4], -UNBOUNDED, UNBOUNDED)
    hi = np.clip(p[:, 5], -UNBOUNDED, UNBOUNDED)
    # Clip to the tile, in tile-local coordinates.
    R0 = np.maximum(q0 - qs, 0)
    R1 = np.minimum(q1 - qs, Sq)
    C0 = np.maximum(k0 - ks, 0)
    C1 = np.minimum(k1 - ks, Sk)
    # Band in tile-local coordinates: lo' <= c - r <= hi'.
    d = ks - qs
    blo, bhi = lo - d, hi - d
    # Tighten rows: r has a key iff C0 - bhi <= r <= C1 - 1 - blo.
    R0 = np.maximum(R0, C0 - bhi)
    R1 = np.minimum(R1, C1 - blo)
    # Tighten cols over the tightened rows (one pass suffices: the row set of
    # a band-rectangle is an interval and every kept row keeps its keys).
    C0 = np.maximum(C0, R0 + blo)
    C1 = np.minimum(C1, R1 + bhi)
    keep = (R0 < R1) & (C0 < C1) & (blo <= bhi)
    calls: list[TileCall] = []
    for r0, r1, c0, c1, bl, bh in zip(
        R0[keep].tolist(), R1[keep].tolist(), C0[keep].tolist(), C1[keep].tolist(),
        blo[keep].tolist(), bhi[keep].tolist(),
    ):
        m, n = r1 - r0, c1 - c0
        off = c0 - r0
        # Effective band in sub-rect coordinates; tightening gives l <= 0 <= u.
        l = max(bl - off, -(m - 1))
        u = min(bh - off, n - 1)
        full_lo, full_hi = l == -(m - 1), u == n - 1
        if full_lo and full_hi:
            calls.append(TileCall(r0, r1, c0, c1, FULL))
        elif full_lo:
            # j <= i + u: cols [0, u) full, cols [u, n) top-left causal.
            if u > 0:
                calls.append(TileCall(r0, r1, c0, c0 + u, FULL))
            calls.append(TileCall(r0, r1, c0 + u, c1, CAUSAL))
        elif full_hi:
            # j - i >= l: reversed rows/cols make it j' <= i' + w with
            # w = n - m - l: cols [n - w, n) full, cols [0, n - w) anti-causal.
            w = n - m - l
            if w > 0:
                calls.append(TileCall(r0, r1, c1 - w, c1, FULL))
            calls.append(TileCall(r0, r1, c0, c1 - w, RCAUSAL))
        else:
            calls.append(TileCall(r0, r1, c0, c1, MASK, l, u))
    return calls


def _band_mask(m: int, n: int, lo: int, hi: int, dtype) -> tuple[Tensor, Tensor]:
    i = torch.arange(m).unsqueeze(1)
    j = torch.arange(n).unsqueeze(0)
    dj = j - i
    allowed = (dj >= lo) & (dj <= hi)
    mask = torch.zeros((m, n), dtype=dtype).masked_fill_(~allowed, NEG_INF)
    return mask, ~allowed.any(dim=1)


def _bhsd(x: Tensor) -> Tensor:
    """[S, H, D] -> [1, H, S, D] view."""
    return x.transpose(0, 1).unsqueeze(0)


def _shd(x: Tensor) -> Tensor:
    """[1, H, S, ...] -> [S, H, ...] view."""
    return x[0].transpose(0, 1)


def _check(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError("q, k, v must be [S, H, D]")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    if q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"bad shapes q {tuple(q.shape)} k {tuple(k.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError("q, k, v must share a dtype")


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.no_grad()
def attn_fwd(q: Tensor, k: Tensor, v: Tensor, qs: int, ks: int, pieces, scale: float) -> tuple[Tensor, Tensor]:
    """Partial attention of one tile.

    q [Sq, Hq, D] holds global rows [qs, qs+Sq); k, v [Sk, Hkv, D] hold global
    rows [ks, ks+Sk). Returns (out [Sq, Hq, D], lse [Sq, Hq]) in float32
    (float64 for float64 inputs); rows with no allowed key in this tile have
    out 0 and lse -inf.
    """
    _check(q, k, v)
    Sq, Hq, D = q.shape
    Sk = k.shape[0]
    acc = _acc_dtype(q.dtype)
    out = torch.zeros((Sq, Hq, D), dtype=acc)
    lse = torch.full((Sq, Hq), NEG_INF, dtype=acc)
    touched: list[tuple[int, int]] = []  # row ranges already written
    for c in plan_tile(qs, ks, Sq, Sk, pieces):
        qi, ki, vi = q[c.r0:c.r1], k[c.c0:c.c1], v[c.c0:c.c1]
        flip = c.kind == RCAUSAL
        if flip:
            qi, ki, vi = qi.flip(0), ki.flip(0), vi.flip(0)
        mask = empty = None
        if c.kind == MASK:
            mask, empty = _band_mask(c.r1 - c.r0, c.c1 - c.c0, c.lo, c.hi, q.dtype)
        o, l = _FWD(_bhsd(qi), _bhsd(ki), _bhsd(vi), 0.0, c.kind in (CAUSAL, RCAUSAL),
                    attn_mask=mask, scale=scale)
        o, l = _shd(o), _shd(l)
        if flip:
            o, l = o.flip(0), l.flip(0)
        if empty is not None and bool(empty.any()):  # cannot happen after tightening
            l = l.masked_fill(empty.unsqueeze(1), NEG_INF)
        if any(a < c.r1 and c.r0 < b for a, b in touched):
            merge_into(out[c.r0:c.r1], lse[c.r0:c.r1], o, l)
        else:  # first write to these rows: nothing to merge with
            out[c.r0:c.r1] = o
            lse[c.r0:c.r1] = l
        touched.append((c.r0, c.r1))
    return out, lse


@torch.no_grad()
def attn_bwd(q: Tensor, k: Tensor, v: Tensor, out: Tensor, dout: Tensor, lse: Tensor,
             qs: int, ks: int, pieces, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of one tile given the GLOBAL (fully merged) out, dout, lse of q's rows.

    Returns (dq [Sq, Hq, D], dk [Sk, Hkv, D], dv [Sk, Hkv, D]) in float32
    (float64 for float64 inputs): this tile's contributions; summed over all
    tiles they give the exact gradient. Rows whose global lse is -inf get zero
    gradient (their dout is ignored).
    """
    _check(q, k, v)
    Sq, Hq, D = q.shape
    Sk, Hkv, _ = k.shape
    acc = _acc_dtype(q.dtype)
    dq = torch.zeros((Sq, Hq, D), dtype=acc)
    dk = torch.zeros((Sk, Hkv, D), dtype=acc)
    dv = torch.zeros((Sk, Hkv, D), dtype=acc)
    calls = plan_tile(qs, ks, Sq, Sk, pieces)
    if not calls:
        return dq, dk, dv
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out_c = out.to(q.dtype)
    lse_c = lse.to(lse_dtype)
    dead = torch.isneginf(lse_c)
    dout_c = dout.to(q.dtype)
    if bool(dead.any()):
        lse_c = lse_c.masked_fill(dead, 0.0)
        dout_c = dout_c.masked_fill(dead.unsqueeze(-1), 0.0)
    for c in calls:
        qi, ki, vi = q[c.r0:c.r1], k[c.c0:c.c1], v[c.c0:c.c1]
        oi, doi, li = out_c[c.r0:c.r1], dout_c[c.r0:c.r1], lse_c[c.r0:c.r1]
        flip = c.kind == RCAUSAL
        if flip:
            qi, ki, vi, oi, doi, li = (x.flip(0) for x in (qi, ki, vi, oi, doi, li))
        mask = None
        if c.kind == MASK:
            mask, _ = _band_mask(c.r1 - c.r0, c.c1 - c.c0, c.lo, c.hi, q.dtype)
        gq, gk, gv = _BWD(_bhsd(doi), _bhsd(qi), _bhsd(ki), _bhsd(vi), _bhsd(oi),
                          li.transpose(0, 1).unsqueeze(0), 0.0, c.kind in (CAUSAL, RCAUSAL),
                          attn_mask=mask, scale=scale)
        gq, gk, gv = _shd(gq), _shd(gk), _shd(gv)
        if flip:
            gq, gk, gv = gq.flip(0), gk.flip(0), gv.flip(0)
        dq[c.r0:c.r1] += gq
        dk[c.c0:c.c1] += gk
        dv[c.c0:c.c1] += gv
    return dq, dk, dv


@torch.no_grad()
def merge_into(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor) -> None:
    """Online-softmax merge, in place, in acc's dtype (float32 or float64).

    l = logaddexp(l1, l2); o = e^(l1 - l) o1 + e^(l2 - l) o2. A side whose lse
    is -inf contributes nothing (its out is ignored, even if garbage); both
    -inf gives out 0, lse -inf. No NaN.
    """
    lse = lse.to(acc_lse.dtype)
    new = torch.logaddexp(acc_lse, lse)
    base = new.masked_fill(torch.isneginf(new), 0.0)
    w1 = torch.exp(acc_lse - base).unsqueeze(-1)
    w2 = torch.exp(lse - base).unsqueeze(-1)
    o2 = out.to(acc_out.dtype) * w2
    dead2 = torch.isneginf(lse)
    if bool(dead2.any()):
        o2.masked_fill_(dead2.unsqueeze(-1), 0.0)
    dead1 = torch.isneginf(acc_lse)
    acc_out.mul_(w1)
    if bool(dead1.any()):
        acc_out.masked_fill_(dead1.unsqueeze(-1), 0.0)
    acc_out.add_(o2)
    acc_lse.copy_(new)
