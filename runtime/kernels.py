"""Tile kernels: masked partial attention of one (q block, kv block) tile, call by call.

On CPU tensors every call runs the CPU flash op below; on other devices (a
GPU's fp32/fp64, or where flash-attn cannot take a call) the same calls run
in plain tensor ops (:mod:`attnplan.runtime.mathattn`). The varlen launches
of GPUs, and the choice between them, are :mod:`attnplan.runtime.varlen`'s.

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
  passing the GLOBAL (merged) out and lse yields this tile's exact share;
* q, k and v must have unit stride on head_dim: a view with another stride
  there (a permute, ``x[..., ::2]``, an expanded dim) silently gives a wrong
  result (measured: max error 1.5 forward, 3.0 backward). Any other stride
  (token or head axis, storage offset) is read correctly. The kernels copy an
  operand whose head_dim stride is not 1 (:func:`_operand`);
* non-finite inputs do not follow dense masked attention: a row whose every
  score in the call is NaN or −inf comes back like a fully masked row (out 0,
  lse 0) in calls under 16 rows, where a dense softmax gives NaN (a NaN
  score) or no mass (all −inf); and a NaN or infinite value of a *masked*
  key reaches rows not allowed to see it (0 · NaN in P @ V; with an additive
  mask also in the scores). A call whose operands are not all finite is
  therefore computed by :func:`_exact_call_fwd` / :func:`_exact_call_bwd`
  (float64, masked pairs excluded rather than multiplied by 0): a NaN or
  infinite key or value reaches exactly the rows allowed to see it. Finite
  calls (checked in O(rows · heads · head_dim)) take the op.

Precision of the merge (:func:`merge_into`). With saturated logits (q, k
scaled by 100) a row's lse is ~2e4, where one float32 ulp is 2e-3. Weighting
two partials by ``e^(l1 - l)`` with ``l = logaddexp(l1, l2)`` rounded to
float32 makes the dominant weight ``1 ± 2e-3`` instead of ``1 - e^(l2 - l1)``,
so the merged out carries an error as large as the part of it the second
partial explains; the backward's ``D = rowsum(dout * out)`` then cancels
against ``dP``, and dq/dk came out 0.2-1.0 off (max error / max |ref|) where
one untiled call is 1e-3-3e-3 off. The merge therefore weights by the lse
*difference* only, ``w2 = sigmoid(l2 - l1)``, ``w1 = sigmoid(l1 - l2)``,
which two float32 lse values give to float32 accuracy whatever their
magnitude; only the merged lse itself is rounded. What remains is the op's
own float32 rounding of each tile's lse (half an ulp of |lse|, like the
rounding of its scores), which keeps the tiled gradients within 1-2x (norm)
and at worst 4.4x (max error) of one untiled call (tests/test_kernel_inputs.py).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..errors import ShapeError
from . import mathattn

__all__ = [
    "NEG_INF",
    "UNBOUNDED",
    "TileCall",
    "plan_tile",
    "attn_fwd",
    "attn_bwd",
    "merge_into",
    "check_scale",
    "rows_with_keys",
    "settle_rows_without_mass",
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
    try:
        p = np.asarray(pieces, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as e:
        raise ShapeError(f"mask pieces must be integers of shape [n, 6]: {e}") from None
    if p.size == 0:
        return np.zeros((0, 6), dtype=np.int64)
    if p.ndim == 1:
        p = p.reshape(1, -1)
    if p.ndim != 2 or p.shape[1] != 6:
        raise ShapeError(f"mask pieces must have shape [n, 6], got {list(p.shape)}")
    return p


def _tighten(qs: int, ks: int, Sq: int, Sk: int, p: np.ndarray):
    """Clip pieces to tile [qs, qs+Sq) x [ks, ks+Sk) and tighten each to the
    rows and cols it actually allows: tile-local ``R0, R1, C0, C1``, the band
    ``blo <= c - r <= bhi`` in tile-local coordinates, and ``keep`` (the piece
    allows at least one pair inside the tile)."""
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
    return R0, R1, C0, C1, blo, bhi, keep


def rows_with_keys(rows, pieces) -> np.ndarray:
    """bool per entry of ``rows`` (global token indices): whether any piece
    allows that row some key. Costs O((pieces + rows) log pieces)."""
    p = _as_pieces(pieces)
    rows = np.asarray(rows, dtype=np.int64)
    if len(p) and rows.size:
        p = p[(p[:, 0] <= rows.max()) & (p[:, 1] > rows.min())]  # pieces whose rows can matter
    if not len(p) or not rows.size:
        return np.zeros(rows.shape, dtype=bool)
    big = int(max(p[:, :4].max(), rows.max(initial=0))) + 1
    R0, R1, _, _, _, _, keep = _tighten(0, 0, big, big, p)
    R0, R1 = R0[keep], R1[keep]
    if not len(R0):
        return np.zeros(rows.shape, dtype=bool)
    order = np.argsort(R0, kind="stable")
    starts, reach = R0[order], np.maximum.accumulate(R1[order])
    i = np.searchsorted(starts, rows, side="right") - 1
    return (i >= 0) & (reach[np.maximum(i, 0)] > rows)


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
    R0, R1, C0, C1, blo, bhi, keep = _tighten(qs, ks, Sq, Sk, p)
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


def _band(m: int, n: int, lo: int, hi: int, device=None) -> Tensor:
    """bool [m, n]: ``lo <= j - i <= hi``."""
    dj = torch.arange(n, device=device).unsqueeze(0) - torch.arange(m, device=device).unsqueeze(1)
    return (dj >= lo) & (dj <= hi)


def _allowed(kind: str, m: int, n: int, lo: int, hi: int, device=None) -> Tensor | None:
    """bool [m, n]: the pairs a call of ``kind`` allows, in its own (possibly
    flipped) coordinates; None for ``full`` (every pair)."""
    if kind == FULL:
        return None
    if kind in (CAUSAL, RCAUSAL):  # RCAUSAL runs as top-left causal on flipped rows
        return _band(m, n, -UNBOUNDED, 0, device)
    return _band(m, n, lo, hi, device)


def _band_mask(m: int, n: int, lo: int, hi: int, dtype) -> Tensor:
    """The op's additive float mask (0 allowed, -inf not) of a ``mask`` call."""
    return torch.zeros((m, n), dtype=dtype).masked_fill_(~_band(m, n, lo, hi), NEG_INF)


def _bhsd(x: Tensor) -> Tensor:
    """[S, H, D] -> [1, H, S, D] view, with unit stride on D (the op needs it)."""
    return _operand(x).transpose(0, 1).unsqueeze(0)


def _shd(x: Tensor) -> Tensor:
    """[1, H, S, ...] -> [S, H, ...] view."""
    return x[0].transpose(0, 1)


def _operand(x: Tensor) -> Tensor:
    """``x`` itself if its last (head_dim) axis has unit stride, else a copy
    that has: the op reads head_dim as if its stride were 1 (module doc)."""
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        return x.contiguous()
    return x


DEVICE_TYPES = ("cpu", "cuda")  # where the kernels run (others, e.g. meta tensors, hold no values)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check(q: Tensor, k: Tensor, v: Tensor) -> None:
    """q [Sq, Hq, D], k and v [Sk, Hkv, D] with Hkv dividing Hq, one floating
    dtype, one device; else :class:`ShapeError`."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ShapeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ShapeError(f"{name} must be [tokens, heads, head_dim], got shape {list(t.shape)}")
    if k.shape != v.shape:
        raise ShapeError(f"k {list(k.shape)} and v {list(v.shape)} differ in shape")
    if q.shape[2] != k.shape[2] or k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ShapeError(f"q {list(q.shape)} and k {list(k.shape)}: head_dim must match and the kv heads must "
                         f"divide the q heads")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DTYPES:
        raise ShapeError(f"q, k, v must share one of float32, bfloat16, float16, float64; got {q.dtype}, "
                         f"{k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ShapeError(f"q, k, v must be on one device; got q on {q.device}, k on {k.device}, v on {v.device}")
    if q.device.type not in DEVICE_TYPES:
        raise ShapeError(f"the kernels run on CPU and CUDA tensors; got {q.device}")


def _check_rows(name: str, t, shape: tuple, device: torch.device) -> None:
    if not isinstance(t, Tensor) or tuple(t.shape) != shape:
        got = list(t.shape) if isinstance(t, Tensor) else type(t).__name__
        raise ShapeError(f"{name} must have shape {list(shape)}, got {got}")
    if not t.is_floating_point() or t.device != device:
        raise ShapeError(f"{name} must be a floating tensor on {device} (where q is), got {t.dtype} on {t.device}")


SCALE_RANGE = (1e-30, 1e30)  # inside the normal range of float32 and bfloat16 (1.2e-38 .. 3.4e38)


def check_scale(scale) -> float:
    """``scale`` as a float if it is a finite real number > 0 (not a bool);
    else :class:`ShapeError` (a softmax scale of 0, below 0, nan or inf
    gives NaN rows or silently flattens attention)."""
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise ShapeError(f"softmax_scale must be a finite number > 0, got {scale!r} ({type(scale).__name__})")
    try:
        f = float(scale)
    except (OverflowError, ValueError):
        f = math.inf
    if not (math.isfinite(f) and f > 0):
        raise ShapeError(f"softmax_scale must be a finite number > 0, got {scale!r}")
    if not SCALE_RANGE[0] <= f <= SCALE_RANGE[1]:  # 1e-50 is 0 in fp32/bf16: NaN rows
        raise ShapeError(f"softmax_scale must be in [{SCALE_RANGE[0]:g}, {SCALE_RANGE[1]:g}] (representable in "
                         f"fp32 and bf16), got {f:g}")
    return f


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _finite(*xs: Tensor) -> bool:
    """Whether every value of ``xs`` is finite, from one sum each (a NaN or an
    infinity makes the sum non-finite; a sum that overflows only sends the
    call down the exact path). 20x cheaper than ``isfinite(x).all()``; on a
    GPU the sums are added on the device and read back once (one sync)."""
    if not xs:
        return True
    if xs[0].device.type == "cpu":
        return all(math.isfinite(float(x.sum(dtype=_acc_dtype(x.dtype)))) for x in xs)
    return bool(finite_flag(*xs))


def finite_flag(*xs: Tensor) -> Tensor:
    """:func:`_finite` as a 0-dim bool tensor on the device, not read back
    (no host sync: a GPU caller reads it once its kernels are queued). Each
    sum is taken in its tensor's own dtype (float32 accumulation inside):
    asking for a float64 sum of bf16 makes a float64 copy first, which on a
    GPU cost more than the reads (measured: 3.7 ms of a 35 ms forward at
    128K tokens); a sum that overflows only sends the call down the exact path."""
    return torch.isfinite(torch.stack([x.sum().double() for x in xs]).sum())

_EXACT_CHUNK = 1 << 22  # elements of the [H, rows, keys, D] products the exact path builds at once


def _masked_bmm(w: Tensor, x: Tensor, allowed: Tensor | None) -> Tensor:
    """``sum_k w[h, i, k] * x[h, k, :]`` over allowed (i, k) only: a NaN or
    infinite ``x[h, k]`` reaches exactly the rows i allowed to see k (a plain
    matmul would spread it as 0 * NaN). w [H, m, n], x [H, n, D] -> [H, m, D];
    rows are taken in chunks so that memory stays bounded."""
    if allowed is None:
        return torch.matmul(w, x)
    H, m, n = w.shape
    D = x.shape[-1]
    out = w.new_zeros((H, m, D))
    step = max(1, _EXACT_CHUNK // max(1, H * n * D))
    for a in range(0, m, step):
        t = w[:, a:a + step, :, None] * x[:, None]
        out[:, a:a + step] = torch.where(allowed[None, a:a + step, :, None], t, torch.zeros((), dtype=t.dtype)).sum(2)
    return out


def _exact_scores(qi: Tensor, ki: Tensor, allowed: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """float64 scores [Hq, m, n] (masked pairs −inf, whatever q or k hold there)
    and k with its heads repeated to the q heads ([Hq, n, D])."""
    rep = qi.shape[1] // ki.shape[1]
    kh = ki.double().repeat_interleave(rep, dim=1).transpose(0, 1)
    s = torch.matmul(qi.double().transpose(0, 1), kh.transpose(1, 2)) * scale
    if allowed is not None:
        s = s.masked_fill(~allowed, NEG_INF)
    return s, kh


def _exact_call_fwd(qi: Tensor, ki: Tensor, vi: Tensor, allowed: Tensor | None, scale: float,
                    acc: torch.dtype) -> tuple[Tensor, Tensor]:
    """One call's (out [m, Hq, D], lse [m, Hq]) as dense masked softmax
    attention in float64: a NaN score makes its row NaN, a row whose allowed
    scores are all −inf contributes nothing (lse −inf, out 0)."""
    s, _ = _exact_scores(qi, ki, allowed, scale)
    m = s.amax(dim=-1, keepdim=True)  # NaN if a score is NaN
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    total = p.sum(dim=-1, keepdim=True)
    lse = (m + torch.log(total)).squeeze(-1)
    rep = qi.shape[1] // vi.shape[1]
    vh = vi.double().repeat_interleave(rep, dim=1).transpose(0, 1)
    o = _masked_bmm(p / torch.where(total > 0, total, torch.ones_like(total)), vh, allowed)
    return o.transpose(0, 1).to(acc), lse.transpose(0, 1).to(acc)


def _exact_call_bwd(qi, ki, vi, oi, doi, li, allowed: Tensor | None, scale: float):
    """One call's (dq, dk, dv) from the global out/dout/lse of its rows, in
    float64, over allowed pairs only (the op's backward, made exact for
    non-finite operands): P = exp(s − lse), dS = P (dout·v − rowsum(dout∘out))."""
    s, kh = _exact_scores(qi, ki, allowed, scale)
    rep = qi.shape[1] // ki.shape[1]
    vh = vi.double().repeat_interleave(rep, dim=1).transpose(0, 1)
    do = doi.double().transpose(0, 1)
    p = torch.exp(s - li.double().transpose(0, 1).unsqueeze(-1))
    dp = torch.matmul(do, vh.transpose(1, 2))  # NaN at masked pairs is dropped with them below
    ds = p * (dp - (do * oi.double().transpose(0, 1)).sum(-1, keepdim=True))
    if allowed is not None:
        p = torch.where(allowed, p, torch.zeros((), dtype=p.dtype))
        ds = torch.where(allowed, ds, torch.zeros((), dtype=ds.dtype))
    at = None if allowed is None else allowed.T
    dq = _masked_bmm(ds, kh, allowed) * scale
    dk = _masked_bmm(ds.transpose(1, 2), qi.double().transpose(0, 1), at) * scale
    dv = _masked_bmm(p.transpose(1, 2), do, at)
    n, hkv, d = ki.shape
    return (dq.transpose(0, 1), dk.transpose(0, 1).reshape(n, hkv, rep, d).sum(2),
            dv.transpose(0, 1).reshape(n, hkv, rep, d).sum(2))


def settle_rows_without_mass(out: Tensor, lse: Tensor, rows, pieces, classes=None) -> None:
    """After the last merge: a row that the mask allows some key but that got
    no softmax mass (lse −inf: every allowed score was −inf, from infinite
    inputs) is NaN, as in dense masked softmax; rows without keys keep out 0,
    lse −inf. ``rows``: the global token index of each row of ``out``/``lse``.
    ``classes``: per-head masks, ``[(query heads, their pieces), ...]``
    (default: every head sees ``pieces``)."""
    dead = torch.isneginf(lse)
    if not bool(dead.any()):
        return
    r = torch.nonzero(dead.any(dim=1)).flatten()
    bad = torch.zeros_like(dead)
    for heads, P in [(np.arange(lse.shape[1]), pieces)] if classes is None else classes:
        has = torch.from_numpy(rows_with_keys(np.asarray(rows)[r.cpu().numpy()], P)).to(r.device)
        idx = (r[has][:, None], torch.from_numpy(np.asarray(heads, np.int64)).to(r.device)[None, :])
        bad[idx] = dead[idx]
    out.masked_fill_(bad.unsqueeze(-1), float("nan"))
    lse.masked_fill_(bad, float("nan"))


def _call_fwd(q: Tensor, k: Tensor, v: Tensor, c: TileCall, scale: float, finite: bool) -> tuple[Tensor, Tensor]:
    """One op call of a tile: (out, lse) of rows [c.r0, c.r1) over cols [c.c0, c.c1).
    ``finite``: the whole tile's operands are known to be finite."""
    qi, ki, vi = q[c.r0:c.r1], k[c.c0:c.c1], v[c.c0:c.c1]
    flip = c.kind == RCAUSAL
    if flip:
        qi, ki, vi = qi.flip(0), ki.flip(0), vi.flip(0)
    allowed = _allowed(c.kind, c.r1 - c.r0, c.c1 - c.c0, c.lo, c.hi, q.device)
    if q.device.type != "cpu" and (finite or _finite(qi, ki, vi)):  # the CPU op is CPU-only: plain tensor ops
        o, l = mathattn.fwd(qi, ki, vi, allowed, scale)
    elif finite or _finite(qi, ki, vi):
        mask = None if c.kind != MASK else _band_mask(c.r1 - c.r0, c.c1 - c.c0, c.lo, c.hi, q.dtype)
        o, l = _FWD(_bhsd(qi), _bhsd(ki), _bhsd(vi), 0.0, c.kind in (CAUSAL, RCAUSAL), attn_mask=mask, scale=scale)
        o, l = _shd(o), _shd(l)
    else:
        o, l = _exact_call_fwd(qi, ki, vi, allowed, scale, _acc_dtype(q.dtype))
    if flip:
        o, l = o.flip(0), l.flip(0)
    return o, l


@torch.no_grad()
def attn_fwd(q: Tensor, k: Tensor, v: Tensor, qs: int, ks: int, pieces, scale: float) -> tuple[Tensor, Tensor]:
    """Partial attention of one tile.

    q [Sq, Hq, D] holds global rows [qs, qs+Sq); k, v [Sk, Hkv, D] hold global
    rows [ks, ks+Sk). Returns (out [Sq, Hq, D], lse [Sq, Hq]) in float32
    (float64 for float64 inputs); rows with no allowed key in this tile (or
    whose every allowed score is −inf) have out 0 and lse -inf; a NaN score
    makes its row NaN. Any strides; bad shapes, dtypes or scale raise
    :class:`ShapeError`.
    """
    _check(q, k, v)
    scale = check_scale(scale)
    Sq, Hq, D = q.shape
    Sk = k.shape[0]
    acc = _acc_dtype(q.dtype)
    out = torch.zeros((Sq, Hq, D), dtype=acc, device=q.device)
    lse = torch.full((Sq, Hq), NEG_INF, dtype=acc, device=q.device)
    touched: list[tuple[int, int]] = []  # row ranges already written
    calls = plan_tile(qs, ks, Sq, Sk, pieces)
    finite = bool(calls) and _finite(q, k, v)
    for c in calls:
        o, l = _call_fwd(q, k, v, c, scale, finite)
        if any(a < c.r1 and c.r0 < b for a, b in touched):
            merge_into(out[c.r0:c.r1], lse[c.r0:c.r1], o, l)
        else:  # first write to these rows: nothing to merge with
            out[c.r0:c.r1] = o
            lse[c.r0:c.r1] = l
        touched.append((c.r0, c.r1))
    return out, lse


def _bwd_operands(q: Tensor, out: Tensor, dout: Tensor, lse: Tensor):
    """out, dout in the input dtype and lse in the op's lse dtype; rows whose
    global lse is −inf (no key anywhere) get dout 0 and lse +inf, so that the
    op's P = exp(s − lse) is 0 for them (lse 0 would overflow P for scores
    over ~88 and make 0 · inf = NaN)."""
    lse_c = lse.to(_acc_dtype(q.dtype))
    dout_c = dout.to(q.dtype)
    dead = torch.isneginf(lse_c)
    if bool(dead.any()):
        lse_c = lse_c.masked_fill(dead, float("inf"))
        dout_c = dout_c.masked_fill(dead.unsqueeze(-1), 0.0)
    return out.to(q.dtype), dout_c, lse_c


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
    scale = check_scale(scale)
    Sq, Hq, D = q.shape
    Sk, Hkv, _ = k.shape
    _check_rows("out", out, (Sq, Hq, D), q.device)
    _check_rows("dout", dout, (Sq, Hq, D), q.device)
    _check_rows("lse", lse, (Sq, Hq), q.device)
    acc = _acc_dtype(q.dtype)
    dq = torch.zeros((Sq, Hq, D), dtype=acc, device=q.device)
    dk = torch.zeros((Sk, Hkv, D), dtype=acc, device=q.device)
    dv = torch.zeros((Sk, Hkv, D), dtype=acc, device=q.device)
    calls = plan_tile(qs, ks, Sq, Sk, pieces)
    if not calls:
        return dq, dk, dv
    out_c, dout_c, lse_c = _bwd_operands(q, out, dout, lse)
    finite = _finite(q, k, v, out_c, dout_c) and not math.isnan(float(lse_c.sum()))
    for c in calls:
        gq, gk, gv = _call_bwd(q, k, v, out_c, dout_c, lse_c, c, scale, finite)
        dq[c.r0:c.r1] += gq
        dk[c.c0:c.c1] += gk
        dv[c.c0:c.c1] += gv
    return dq, dk, dv


def _call_bwd(q, k, v, out, dout, lse, c: TileCall, scale: float, finite: bool) -> tuple[Tensor, Tensor, Tensor]:
    """One op call's share of (dq, dk, dv): rows [c.r0, c.r1), cols [c.c0, c.c1).
    ``finite``: the whole tile's operands are known to be finite (lse not NaN)."""
    qi, ki, vi = q[c.r0:c.r1], k[c.c0:c.c1], v[c.c0:c.c1]
    oi, doi, li = out[c.r0:c.r1], dout[c.r0:c.r1], lse[c.r0:c.r1]
    flip = c.kind == RCAUSAL
    if flip:
        qi, ki, vi, oi, doi, li = (x.flip(0) for x in (qi, ki, vi, oi, doi, li))
    fin = finite or (_finite(qi, ki, vi, oi, doi) and not math.isnan(float(li.sum())))
    if fin and q.device.type != "cpu":
        allowed = _allowed(c.kind, c.r1 - c.r0, c.c1 - c.c0, c.lo, c.hi, q.device)
        gq, gk, gv = mathattn.bwd(qi, ki, vi, oi, doi, li, allowed, scale)
    elif fin:
        mask = None if c.kind != MASK else _band_mask(c.r1 - c.r0, c.c1 - c.c0, c.lo, c.hi, q.dtype)
        gq, gk, gv = _BWD(_bhsd(doi), _bhsd(qi), _bhsd(ki), _bhsd(vi), _bhsd(oi),
                          li.transpose(0, 1).unsqueeze(0), 0.0, c.kind in (CAUSAL, RCAUSAL),
                          attn_mask=mask, scale=scale)
        gq, gk, gv = _shd(gq), _shd(gk), _shd(gv)
    else:
        allowed = _allowed(c.kind, c.r1 - c.r0, c.c1 - c.c0, c.lo, c.hi, q.device)
        gq, gk, gv = _exact_call_bwd(qi, ki, vi, oi, doi, li, allowed, scale)
    if flip:
        gq, gk, gv = gq.flip(0), gk.flip(0), gv.flip(0)
    return gq, gk, gv


@torch.no_grad()
def merge_into(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor) -> None:
    """Online-softmax merge, in place, in acc's dtype (float32 or float64).

    l = logaddexp(l1, l2); o = w1 o1 + w2 o2 with w2 = sigmoid(l2 - l1) and
    w1 = sigmoid(l1 - l2): weights from the lse difference only, so that
    they stay accurate when the lse values are large (module doc). A side
    whose lse is -inf contributes nothing (its out is ignored, even if
    garbage); both -inf gives out 0, lse -inf. A NaN lse or out propagates.
    """
    if acc_out.shape != out.shape or acc_lse.shape != lse.shape or acc_lse.shape != acc_out.shape[:-1]:
        raise ShapeError(f"merge: accumulator out {list(acc_out.shape)} / lse {list(acc_lse.shape)} and partial "
                         f"out {list(out.shape)} / lse {list(lse.shape)} do not match")
    lse = lse.to(acc_lse.dtype)
    dead1, dead2 = torch.isneginf(acc_lse), torch.isneginf(lse)
    diff = (lse - acc_lse).masked_fill_(dead1 | dead2, 0.0)  # l2 - l1; 0 where a side is dead (set below)
    w1 = torch.sigmoid(-diff).masked_fill_(dead1, 0.0).masked_fill_(dead2 & ~dead1, 1.0)
    w2 = torch.sigmoid(diff).masked_fill_(dead2, 0.0).masked_fill_(dead1 & ~dead2, 1.0)
    o2 = out.to(acc_out.dtype) * w2.unsqueeze(-1)
    cpu = acc_out.device.type == "cpu"  # on a GPU: no host sync, the fills run unconditionally
    if not cpu or bool(dead2.any()):
        o2.masked_fill_(dead2.unsqueeze(-1), 0.0)
    acc_out.mul_(w1.unsqueeze(-1))
    if not cpu or bool(dead1.any()):
        acc_out.masked_fill_(dead1.unsqueeze(-1), 0.0)
    acc_out.add_(o2)
    acc_lse.copy_(torch.logaddexp(acc_lse, lse))
