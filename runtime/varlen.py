"""Tile kernels per device: varlen launches on GPUs, the CPU op on CPUs.

:func:`tile_fwd` / :func:`tile_bwd` are what the runner calls for one
compute block (one (q block, kv block) tile and its mask pieces). The kernel
is chosen per device and dtype (:func:`kernel_for`):

* ``cpu``: the CPU flash op, call by call (:mod:`attnplan.runtime.kernels`);
* ``flash``: CUDA bf16/fp16 with head_dim ≤ 256 divisible by 8: the tile's
  calls (:func:`kernels.plan_tile`) become *segments* of flash-attention 2's
  varlen kernel (``torch.ops.aten._flash_attention_forward`` /
  ``_flash_attention_backward``, the flash-attn 2 kernel PyTorch's CUDA
  builds ship, lse returned as [heads, total_q]); many segments, one launch
  per window kind (:func:`segments`, :func:`launches`);
* ``varlen-ref``: the same segments and launches run by a reference kernel in
  plain tensor ops (:mod:`attnplan.runtime.mathattn`), so that the
  segmenting, gathering and merging of the ``flash`` path are tested on CPU;
* ``math``: every other device and dtype (CUDA fp32/fp64), call by call in
  plain tensor ops.

Non-finite operands always take the exact float64 path of the kernels
module. ``$ATTNPLAN_KERNEL`` (``auto``, ``cpu``, ``math``, ``varlen-ref``,
``flash``) overrides the choice (tests and the GPU check use it). If a
flash launch fails, that launch and later ones of its kind (windowed, or all)
run by the reference kernel, and later tiles choose ``math``; recorded in
:data:`NOTES` (the GPU check prints it).

Segments. flash-attn aligns a causal or windowed band *bottom-right*: key j
of a segment of m rows and n keys is allowed for row i iff
``i + (n − m) − wl ≤ j ≤ i + (n − m) + wr`` (−1: unbounded). A ``full`` call
is the segment (−1, −1); a top-left ``causal`` call of m rows and n ≤ m
keys is a causal square (−1, 0) of its first n rows plus a ``full``
rectangle of the rest; ``rcausal`` is the same on reversed rows and keys
(the gather reverses them); a ``mask`` band ``lo ≤ j − i ≤ hi`` is the
window (n − m − lo, hi − n + m) when flash-attn reads it right
(:func:`_band_window`), else it runs call by call in plain tensor ops. A
tile's segments and launches are built once per plan (:func:`tile_plan`,
cached under the graph and tile). Forward launches hold segments with distinct rows (a row of two
segments is merged by the lse-difference merge); backward launches take
every segment of a kind at once (gradients are added).
"""

from __future__ import annotations

import os
from collections import Counter, OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..errors import PlanError
from . import kernels, mathattn
from .kernels import CAUSAL, FULL, MASK, RCAUSAL, TileCall

KERNEL_ENV = "ATTNPLAN_KERNEL"
KERNELS = ("auto", "cpu", "math", "varlen-ref", "flash")
COUNTS: Counter = Counter()  # launches per kernel (the GPU check prints them)
NOTES: list[str] = []        # why a kernel fell back
_FLASH_OK = {"ok": True, "window": True}  # "window": launches with window sizes (bands) work too


@dataclass(frozen=True, slots=True)
class Segment:
    """Rows [r0, r1) × keys [c0, c1) of a tile (reversed when ``flip``) under the bottom-right window (wl, wr)."""

    r0: int
    r1: int
    c0: int
    c1: int
    flip: bool
    wl: int
    wr: int


def kernel_for(q: Tensor) -> str:
    """The kernel for tiles of ``q``'s device and dtype (module doc)."""
    want = os.environ.get(KERNEL_ENV, "auto")
    if want not in KERNELS:
        raise PlanError(f"${KERNEL_ENV} must be one of {', '.join(KERNELS)}, got {want[:40]!r}")
    if want != "auto":
        if want == "cpu" and q.device.type != "cpu":
            return "math"
        if want == "flash" and not _flash_possible(q):
            return "varlen-ref"
        return want
    if q.device.type == "cpu":
        return "cpu"
    return "flash" if _flash_possible(q) else "math"


def _flash_possible(q: Tensor) -> bool:
    d = q.shape[-1]
    return (q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16) and d % 8 == 0 and d <= 256
            and _FLASH_OK["ok"] and hasattr(torch.ops.aten, "_flash_attention_forward"))


# segments ---------------------------------------------------------------------------

def _causal_segments(c: TileCall, flip: bool) -> list[Segment]:
    """A top-left causal call of m rows and n ≤ m keys (in flipped coordinates when ``flip``)."""
    m, n = c.r1 - c.r0, c.c1 - c.c0
    if not flip:
        sq = [Segment(c.r0, c.r0 + n, c.c0, c.c1, False, -1, 0)]
        return sq + ([Segment(c.r0 + n, c.r1, c.c0, c.c1, False, -1, -1)] if m > n else [])
    # flipped row i' is row r1 - 1 - i': the square is the last n rows, the full rest the first m - n
    sq = [Segment(c.r1 - n, c.r1, c.c0, c.c1, True, -1, 0)]
    return sq + ([Segment(c.r0, c.r1 - n, c.c0, c.c1, False, -1, -1)] if m > n else [])


def segments(calls: list[TileCall]) -> tuple[list[Segment], list[TileCall]]:
    """The calls as varlen segments, and the calls no window expresses (run by ``math``)."""
    segs: list[Segment] = []
    rest: list[TileCall] = []
    for c in calls:
        m, n = c.r1 - c.r0, c.c1 - c.c0
        if c.kind == FULL:
            segs.append(Segment(c.r0, c.r1, c.c0, c.c1, False, -1, -1))
        elif c.kind in (CAUSAL, RCAUSAL):
            segs.extend(_causal_segments(c, c.kind == RCAUSAL))
        elif c.kind == MASK and (w := _band_window(m, n, c.lo, c.hi)) is not None:
            segs.append(Segment(c.r0, c.r1, c.c0, c.c1, False, *w))
        else:
            rest.append(c)
    return segs, rest


def _band_window(m: int, n: int, lo: int, hi: int) -> tuple[int, int] | None:
    """The bottom-right window (wl, wr) of the band ``lo <= j - i <= hi`` on m rows and n keys, −1 where a
    side cuts nothing; None when flash-attn cannot take it: a side below 0, or a right side that cuts
    something but is at least n (flash-attn reads a window of at least the keys of a launch as unbounded)."""
    wl, wr = n - m - lo, hi - n + m
    if wl < 0 or wr < 0:
        return None
    wl = -1 if wl >= n - 1 else wl  # row m - 1's first key is 0 or before: no cut
    wr = -1 if wr >= m - 1 else wr  # row 0's last key is n - 1 or after: no cut
    if wr >= n:
        return None
    return wl, wr


def launches(segs: list[Segment], rows: int, distinct: bool) -> list[list[Segment]]:
    """Segments grouped into launches: one window kind a launch and, when
    ``distinct``, no row in two segments of a launch (first fit)."""
    if not distinct:  # one launch per window kind, in order of first appearance
        by_kind: dict[tuple[int, int], list[Segment]] = {}
        for s in segs:
            by_kind.setdefault((s.wl, s.wr), []).append(s)
        return list(by_kind.values())
    out: list[list[Segment]] = []
    used: list[np.ndarray] = []
    kinds: list[tuple[int, int]] = []
    for s in segs:
        for j, (lst, u) in enumerate(zip(out, used)):
            if kinds[j] == (s.wl, s.wr) and not u[s.r0:s.r1].any():
                lst.append(s)
                u[s.r0:s.r1] = True
                break
        else:
            u = np.zeros(rows, dtype=bool)
            u[s.r0:s.r1] = True
            out.append([s]); used.append(u); kinds.append((s.wl, s.wr))
    return out


def _index(segs: list[Segment], rows: bool) -> tuple[np.ndarray, np.ndarray]:
    """(the tile-local rows or keys of the segments, concatenated (reversed where flipped); cu_seqlens)."""
    parts, lens = [], []
    for s in segs:
        a, b = (s.r0, s.r1) if rows else (s.c0, s.c1)
        parts.append(np.arange(b - 1, a - 1, -1) if s.flip else np.arange(a, b))
        lens.append(b - a)
    cu = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    return np.concatenate(parts), cu


def _identity(idx: np.ndarray, n: int) -> bool:
    """Whether ``idx`` is 0..n-1 in order (no gather needed)."""
    return len(idx) == n and (n == 0 or (idx[0] == 0 and bool((np.diff(idx) == 1).all())))


class _Launch:
    """One launch: its segments' rows and keys (indices and, on the device, cu_seqlens), whether they are
    every row / key of the tile in order (then nothing is gathered), and, forward, whether an earlier
    launch of the tile wrote any of its rows (then its result is merged, else copied)."""

    def __init__(self, segs: list[Segment], device, rows: int, keys: int, fresh: bool = True):
        self.segs = segs
        self.ridx, cq = _index(segs, True)
        self.cidx, ck = _index(segs, False)
        self.cu_q = torch.from_numpy(cq).to(device=device, dtype=torch.int32)
        self.cu_k = torch.from_numpy(ck).to(device=device, dtype=torch.int32)
        self.cq, self.ck = cq, ck
        self.max_q, self.max_k = int(np.diff(cq).max()), int(np.diff(ck).max())
        self.wl, self.wr = segs[0].wl, segs[0].wr
        self.r_all, self.c_all = _identity(self.ridx, rows), _identity(self.cidx, keys)
        self.rows_t = torch.from_numpy(self.ridx).to(device)
        self.cols_t = torch.from_numpy(self.cidx).to(device)
        self.fresh = fresh

    def rows(self, x: Tensor) -> Tensor:
        return x.contiguous() if self.r_all else x.index_select(0, self.rows_t)

    def keys(self, x: Tensor) -> Tensor:
        return x.contiguous() if self.c_all else x.index_select(0, self.cols_t)


@dataclass(frozen=True)
class TilePlan:
    """A tile's launches (forward: rows distinct within a launch) and the calls no window expresses,
    as global pieces (run call by call)."""

    fwd: list
    bwd: list
    rest: np.ndarray


_PLANS: OrderedDict = OrderedDict()  # (id(graph), tile, device) -> (graph, TilePlan): LRU, the graph kept alive
PLAN_CACHE = 1 << 13


def tile_plan(q: Tensor, k: Tensor, qs: int, ks: int, pieces, key=None) -> TilePlan:
    """The launches of a tile (:func:`segments`, :func:`launches`); cached under ``key = (graph, tile)``,
    so that a plan run again (every layer of a model runs the same plan) builds them once."""
    ck = None if key is None else (id(key[0]), key[1], str(q.device), q.shape[0], k.shape[0])
    if ck is not None and ck in _PLANS:
        _PLANS.move_to_end(ck)
        return _PLANS[ck][1]
    Sq, Sk = q.shape[0], k.shape[0]
    calls = kernels.plan_tile(qs, ks, Sq, Sk, pieces)
    segs, rest = segments(calls)
    used = np.zeros(Sq, dtype=bool)
    fwd = []
    for group in launches(segs, Sq, distinct=True):
        L = _Launch(group, q.device, Sq, Sk)
        L.fresh = not used[L.ridx].any()
        used[L.ridx] = True
        fwd.append(L)
    bwd = [_Launch(group, q.device, Sq, Sk) for group in launches(segs, Sq, distinct=False)]
    plan = TilePlan(fwd, bwd, _as_pieces(rest, qs, ks))
    if ck is not None:
        _PLANS[ck] = (key[0], plan)
        while len(_PLANS) > PLAN_CACHE:
            _PLANS.popitem(last=False)
    return plan


# the launch kernels: flash-attn 2 varlen, and the reference in plain tensor ops ----------

def _window_kw(L: _Launch) -> tuple[bool, dict]:
    causal = (L.wl, L.wr) == (-1, 0)
    if causal or (L.wl, L.wr) == (-1, -1):
        return causal, {}
    return False, {"window_size_left": L.wl, "window_size_right": L.wr}


def _flash_fwd(q, k, v, L: _Launch, scale):
    causal, kw = _window_kw(L)
    o, lse = torch.ops.aten._flash_attention_forward(q, k, v, L.cu_q, L.cu_k, L.max_q, L.max_k, 0.0, causal,
                                                     False, scale=scale, **kw)[:2]
    if tuple(lse.shape) != (q.shape[1], q.shape[0]):
        raise PlanError(f"flash-attn varlen returned lse of shape {list(lse.shape)}, expected [heads, total_q]")
    return o, lse.T


def _flash_bwd(q, k, v, out, dout, lse, L: _Launch, scale):
    causal, kw = _window_kw(L)
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, device=q.device)
    return torch.ops.aten._flash_attention_backward(dout, q, k, v, out, lse.T.contiguous(), L.cu_q, L.cu_k,
                                                    L.max_q, L.max_k, 0.0, causal, rng, unused, scale=scale,
                                                    **kw)


def _window(m: int, n: int, wl: int, wr: int, device) -> Tensor | None:
    """bool [m, n] of a bottom-right window; None when unbounded on both sides."""
    if wl < 0 and wr < 0:
        return None
    dj = torch.arange(n, device=device)[None, :] - torch.arange(m, device=device)[:, None] - (n - m)
    ok = torch.ones((m, n), dtype=torch.bool, device=device)
    if wl >= 0:
        ok &= dj >= -wl
    if wr >= 0:
        ok &= dj <= wr
    return ok


def _clamped(L: _Launch) -> tuple[int, int]:
    """The launch's window as flash-attn reads it: a side of at least the launch's longest keys is unbounded
    (the reference kernel reads it so too, so that a window flash-attn would misread fails on CPU tests)."""
    return (-1 if L.wl >= L.max_k else L.wl), (-1 if L.wr >= L.max_k else L.wr)


def _ref_fwd(q, k, v, L: _Launch, scale):
    outs, lses = [], []
    wl, wr = _clamped(L)
    for i in range(len(L.segs)):
        a, b, c, d = int(L.cq[i]), int(L.cq[i + 1]), int(L.ck[i]), int(L.ck[i + 1])
        o, l = mathattn.fwd(q[a:b], k[c:d], v[c:d], _window(b - a, d - c, wl, wr, q.device), scale)
        outs.append(o); lses.append(l)
    return torch.cat(outs), torch.cat(lses)


def _ref_bwd(q, k, v, out, dout, lse, L: _Launch, scale):
    dq, dk, dv = [], [], []
    wl, wr = _clamped(L)
    for i in range(len(L.segs)):
        a, b, c, d = int(L.cq[i]), int(L.cq[i + 1]), int(L.ck[i]), int(L.ck[i + 1])
        g = mathattn.bwd(q[a:b], k[c:d], v[c:d], out[a:b], dout[a:b], lse[a:b],
                         _window(b - a, d - c, wl, wr, q.device), scale)
        dq.append(g[0]); dk.append(g[1]); dv.append(g[2])
    return torch.cat(dq), torch.cat(dk), torch.cat(dv)


def _run(kind: str, flash, ref, *args):
    """``flash(*args)`` for the ``flash`` kernel (falling back to the reference for good if it fails: for
    windowed launches alone when only those fail), else ``ref``."""
    key = "ok" if not _window_kw(args[-2])[1] else "window"
    if kind == "flash" and _FLASH_OK["ok"] and _FLASH_OK[key]:
        try:
            r = flash(*args)
            COUNTS["flash"] += 1
            return r
        except (RuntimeError, PlanError, TypeError) as e:  # an op this torch build lacks or refuses
            _FLASH_OK[key] = False
            what = "windowed launches" if key == "window" else "all launches"
            NOTES.append(f"flash-attn varlen failed ({what} now use the reference kernel): "
                         f"{str(e).splitlines()[0][:200]}")
    COUNTS["varlen-ref"] += 1
    return ref(*args)


# tiles ---------------------------------------------------------------------------------

def _into(into, res: tuple, add: bool = False) -> tuple:
    """``res`` copied (``add``: added) into the tensors ``into`` (returned), or ``res`` itself when ``into`` is
    None."""
    if into is None:
        return res
    for a, x in zip(into, res):
        a.add_(x) if add else a.copy_(x)
    return tuple(into)


def tile_fwd(q: Tensor, k: Tensor, v: Tensor, qs: int, ks: int, pieces, scale: float, into=None,
             finite: bool = False, key=None) -> tuple[Tensor, Tensor]:
    """:func:`kernels.attn_fwd` by the kernel of q's device and dtype: (out, lse) in the accumulator dtype.
    ``into``: (out, lse) tensors holding nothing yet (0 and −inf) to write the result into, in place of new
    ones; ``finite``: the caller knows q, k, v are finite (no check); ``key``: (graph, tile), to cache the
    tile's launches (:func:`tile_plan`)."""
    kind = kernel_for(q)
    if kind not in ("flash", "varlen-ref"):
        COUNTS[kind] += 1
        return _into(into, kernels.attn_fwd(q, k, v, qs, ks, pieces, scale))
    kernels._check(q, k, v)
    scale = kernels.check_scale(scale)
    if not (finite or kernels._finite(q, k, v)):
        return _into(into, kernels.attn_fwd(q, k, v, qs, ks, pieces, scale))
    tp = tile_plan(q, k, qs, ks, pieces, key)
    Sq, Hq, D = q.shape
    acc = kernels._acc_dtype(q.dtype)
    if into is not None:
        out, lse = into
    else:
        out = torch.zeros((Sq, Hq, D), dtype=acc, device=q.device)
        lse = torch.full((Sq, Hq), kernels.NEG_INF, dtype=acc, device=q.device)
    for L in tp.fwd:
        o, l = _run(kind, _flash_fwd, _ref_fwd, L.rows(q), L.keys(k), L.keys(v), L, scale)
        _merge_rows(out, lse, L, o, l)
    if len(tp.rest):
        o, l = kernels.attn_fwd(q, k, v, qs, ks, tp.rest, scale)
        kernels.merge_into(out, lse, o, l)
    return out, lse


def _merge_rows(out: Tensor, lse: Tensor, L: _Launch, o: Tensor, l: Tensor) -> None:
    """Write a launch's (o, l) into its rows of (out, lse): a copy where no launch wrote before, else a merge."""
    if L.fresh and L.r_all:
        out.copy_(o)
        lse.copy_(l)
    elif L.fresh:
        out.index_copy_(0, L.rows_t, o.to(out.dtype))
        lse.index_copy_(0, L.rows_t, l.to(lse.dtype))
    else:
        acc_o, acc_l = out.index_select(0, L.rows_t), lse.index_select(0, L.rows_t)
        kernels.merge_into(acc_o, acc_l, o, l)
        out.index_copy_(0, L.rows_t, acc_o)
        lse.index_copy_(0, L.rows_t, acc_l)


def _as_pieces(calls: list[TileCall], qs: int, ks: int) -> np.ndarray:
    """``mask`` calls back as global pieces (6 ints), for the call-by-call path."""
    return np.array([[qs + c.r0, qs + c.r1, ks + c.c0, ks + c.c1, ks + c.c0 - qs - c.r0 + c.lo,
                      ks + c.c0 - qs - c.r0 + c.hi] for c in calls], dtype=np.int64).reshape(-1, 6)


def tile_bwd(q: Tensor, k: Tensor, v: Tensor, out: Tensor, dout: Tensor, lse: Tensor, qs: int, ks: int, pieces,
             scale: float, into=None, finite: bool = False, key=None) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`kernels.attn_bwd` by the kernel of q's device and dtype. ``into``: (dq, dk, dv) accumulators to
    add the tile's gradients to (returned), in place of new tensors; ``finite``: the caller knows q, k, v,
    out, dout and lse (but for −inf rows) are finite; ``key``: as for :func:`tile_fwd`."""
    kind = kernel_for(q)
    if kind not in ("flash", "varlen-ref"):
        COUNTS[kind] += 1
        return _into(into, kernels.attn_bwd(q, k, v, out, dout, lse, qs, ks, pieces, scale), add=True)
    kernels._check(q, k, v)
    scale = kernels.check_scale(scale)
    if finite:  # rows without keys: lse +inf makes P = exp(s − lse) 0 (a finite dout needs no masking)
        out_c, dout_c = out.to(q.dtype), dout.to(q.dtype)
        lse_c = torch.where(torch.isneginf(lse), float("inf"), lse.to(kernels._acc_dtype(q.dtype)))
    else:
        out_c, dout_c, lse_c = kernels._bwd_operands(q, out, dout, lse)
        if not kernels._finite(q, k, v, out_c, dout_c, torch.where(torch.isposinf(lse_c), 0.0, lse_c)):
            return _into(into, kernels.attn_bwd(q, k, v, out, dout, lse, qs, ks, pieces, scale), add=True)
    tp = tile_plan(q, k, qs, ks, pieces, key)
    acc = kernels._acc_dtype(q.dtype)
    if into is not None:
        dq, dk, dv = into
    else:
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    for L in tp.bwd:
        gq, gk, gv = _run(kind, _flash_bwd, _ref_bwd, L.rows(q), L.keys(k), L.keys(v), L.rows(out_c),
                          L.rows(dout_c), L.rows(lse_c), L, scale)
        if L.r_all:
            dq.add_(gq)
        else:
            dq.index_add_(0, L.rows_t, gq.to(acc))
        for a, g in ((dk, gk), (dv, gv)):
            if L.c_all:
                a.add_(g)
            else:
                a.index_add_(0, L.cols_t, g.to(acc))
    if len(tp.rest):
        g = kernels.attn_bwd(q, k, v, out, dout, lse, qs, ks, tp.rest, scale)
        dq += g[0]; dk += g[1]; dv += g[2]
    return dq, dk, dv
