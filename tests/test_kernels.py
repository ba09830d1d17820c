"""Tile kernels vs a dense float64 reference.

Tolerances (errors are measured as max|got - ref| / max(1, max|ref|), the
reference being float64 on the inputs already rounded to the tested dtype, so
only kernel error counts):
* float32: 1e-5 on out, lse, dq, dk, dv (observed worst 1.5e-6: the op
  accumulates in fp32, values are O(1), tiles have <= 40 keys).
* float64: 1e-10 (observed ~2e-15; the op supports float64 natively).
* bfloat16: out 1e-2, dq/dk/dv 4e-2, lse 1e-4. The op returns out, dq, dk, dv
  in the input dtype, so each partial and each tile's gradient contribution is
  rounded to 8 significant bits (unit roundoff 2^-9 ~ 2e-3), P is rounded to
  bf16 before P @ V, and the backward's D = rowsum(dout * out) is taken from a
  bf16-rounded out, after which dP - D cancels. One untiled bf16 call already
  shows ~1e-2 gradient error on a 200-token causal tile; summing up to 4 tile
  contributions with cancellation gave a worst of 1.9e-2 (dq) and 4e-3 (out)
  over 300 generated problems: the bounds keep a 2x margin. lse is computed in
  fp32 by the op (observed 1e-5).
* float16: 3 more mantissa bits than bf16: out 2e-3, grads 6e-3 (observed
  5e-4 and 2.6e-3), lse 1e-4.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnplan.runtime import kernels
from attnplan.runtime.kernels import NEG_INF, attn_bwd, attn_fwd, merge_into, plan_tile
from attnplan.runtime.reference import dense_allowed, dense_attention

U = 1 << 62
HEADS = [(1, 1), (4, 2), (4, 1)]

TOL = {
    # dtype: (out, grads, lse), each relative to max(1, max|ref|)
    torch.float32: (1e-5, 1e-5, 1e-5),
    torch.float64: (1e-10, 1e-10, 1e-10),
    torch.bfloat16: (1e-2, 4e-2, 1e-4),
    torch.float16: (2e-3, 6e-3, 1e-4),
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: intra-op threads only add OpenMP sync cost, and on a loaded
    2-core machine that cost explodes (80 s vs 7 s for this file)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ----------------------------------------------------------------------------
# problem generation


def _band(draw, allow_empty: bool, center: int = 0):
    """lo <= k - q <= hi, either side possibly unbounded; ``center`` is the
    tile's diagonal offset ks - qs, so that bands often cut through the tile."""
    lo = draw(st.one_of(st.just(-U), st.integers(center - 40, center + 40)))
    hi = draw(st.one_of(st.just(U), st.integers(center - 40, center + 40)))
    if lo > hi and not allow_empty:
        lo, hi = hi, lo
    return lo, hi


def _split(draw, a: int, b: int, max_cuts: int) -> list[int]:
    if b - a <= 1:
        return [a, b]
    cuts = draw(st.sets(st.integers(a + 1, b - 1), max_size=max_cuts))
    return [a, *sorted(cuts), b]


@st.composite
def problems(draw):
    hq, hkv = draw(st.sampled_from(HEADS))
    D = draw(st.sampled_from([8, 16]))
    qs = draw(st.integers(0, 60))
    Sq = draw(st.integers(1, 40))
    # Tiles near the diagonal are where masks get interesting.
    ks = max(0, qs + draw(st.one_of(st.integers(-45, 45), st.integers(-8, 8), st.just(0))))
    Sk = draw(st.integers(1, 40))
    T = max(qs + Sq, ks + Sk) + 8
    # Rectangle the pieces live in: the tile, or a global one beyond it.
    if draw(st.booleans()):
        rq0, rq1, rk0, rk1 = qs, qs + Sq, ks, ks + Sk
    else:
        rq0, rq1, rk0, rk1 = 0, T, 0, T
    kind = draw(st.sampled_from(
        ["full", "causal", "sliding", "inverse", "band", "band", "subrect", "pair", "grid"]))
    if kind == "full":
        pieces = [(rq0, rq1, rk0, rk1, -U, U)]
    elif kind == "causal":
        pieces = [(rq0, rq1, rk0, rk1, -U, draw(st.sampled_from([0, 0, -1, 3])))]
    elif kind == "sliding":
        w = draw(st.integers(1, 20))
        pieces = [(rq0, rq1, rk0, rk1, -(w - 1), 0)]
    elif kind == "inverse":
        pieces = [(rq0, rq1, rk0, rk1, draw(st.integers(-5, 5)), U)]
    elif kind == "band":
        pieces = [(rq0, rq1, rk0, rk1, *_band(draw, True, ks - qs))]
    elif kind == "subrect":
        a, b = sorted(draw(st.tuples(st.integers(qs - 3, qs + Sq + 3), st.integers(qs - 3, qs + Sq + 3))))
        c, d = sorted(draw(st.tuples(st.integers(ks - 3, ks + Sk + 3), st.integers(ks - 3, ks + Sk + 3))))
        pieces = [(max(a, 0), b, max(c, 0), d, *_band(draw, False, ks - qs))]
    elif kind == "pair":
        lo, hi = _band(draw, False, ks - qs)
        how = draw(st.sampled_from(["diag", "rows", "cols"]))
        if how == "diag":
            cut = draw(st.integers(max(lo, ks - qs - 40), min(hi, ks - qs + 40)))
            pieces = [(rq0, rq1, rk0, rk1, lo, cut), (rq0, rq1, rk0, rk1, cut + 1, hi)]
        elif how == "rows":
            m = draw(st.integers(qs, qs + Sq))
            pieces = [(rq0, m, rk0, rk1, lo, hi), (m, rq1, rk0, rk1, *_band(draw, False, ks - qs))]
        else:
            m = draw(st.integers(ks, ks + Sk))
            pieces = [(rq0, rq1, rk0, m, lo, hi), (rq0, rq1, m, rk1, *_band(draw, False, ks - qs))]
    else:  # grid of cells, each with its own band; some cells left out
        pieces = []
        rows = _split(draw, qs, qs + Sq, 2)
        cols = _split(draw, ks, ks + Sk, 2)
        for a, b in zip(rows, rows[1:]):
            for c, d in zip(cols, cols[1:]):
                if draw(st.integers(0, 3)) > 0:
                    pieces.append((a, b, c, d, *_band(draw, False, ks - qs)))
    pieces = np.array(pieces, dtype=np.int64).reshape(-1, 6)
    qcuts = _split(draw, 0, Sq, 3)
    kcuts = _split(draw, 0, Sk, 3)
    clip = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(hq=hq, hkv=hkv, D=D, qs=qs, Sq=Sq, ks=ks, Sk=Sk, T=T, pieces=pieces,
                qcuts=qcuts, kcuts=kcuts, clip=clip, seed=seed, kind=kind)


def _clip(pieces: np.ndarray, q0: int, q1: int, k0: int, k1: int) -> np.ndarray:
    p = pieces.copy()
    p[:, 0] = np.maximum(p[:, 0], q0)
    p[:, 1] = np.minimum(p[:, 1], q1)
    p[:, 2] = np.maximum(p[:, 2], k0)
    p[:, 3] = np.minimum(p[:, 3], k1)
    return p[(p[:, 0] < p[:, 1]) & (p[:, 2] < p[:, 3])]


def _assert_disjoint(pieces: np.ndarray, T: int) -> None:
    total = sum(int(dense_allowed(p[None], T).sum()) for p in pieces)
    assert total == int(dense_allowed(pieces, T).sum()), "generator made overlapping pieces"


def _tensors(pr, dtype):
    g = torch.Generator().manual_seed(pr["seed"])
    q = torch.randn(pr["Sq"], pr["hq"], pr["D"], generator=g).to(dtype)
    k = torch.randn(pr["Sk"], pr["hkv"], pr["D"], generator=g).to(dtype)
    v = torch.randn(pr["Sk"], pr["hkv"], pr["D"], generator=g).to(dtype)
    dout = torch.randn(pr["Sq"], pr["hq"], pr["D"], generator=g)
    return q, k, v, dout


def _close(got: torch.Tensor, ref: torch.Tensor, tol: float, what: str, relative: bool = True) -> None:
    """max|got - ref| <= tol * max(1, max|ref|) (relative) or <= tol (absolute)."""
    got, ref = got.double(), ref.detach().double()
    assert not torch.isnan(got).any(), f"{what}: NaN"
    bound = tol * (max(1.0, float(ref.abs().max()) if ref.numel() else 1.0) if relative else 1.0)
    err = float((got - ref).abs().max()) if ref.numel() else 0.0
    assert err <= bound, f"{what}: max err {err:.3g} > {bound:.3g}"


def run_tiled(pr, q, k, v, dout, scale):
    """Forward over all (q tile, k tile) pairs, merge, then backward with the
    merged out/lse. Returns (out, lse, dq, dk, dv)."""
    qs, ks, pieces = pr["qs"], pr["ks"], pr["pieces"]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(q.shape, dtype=acc)
    lse = torch.full(q.shape[:2], NEG_INF, dtype=acc)
    tiles = []
    for a, b in zip(pr["qcuts"], pr["qcuts"][1:]):
        for c, d in zip(pr["kcuts"], pr["kcuts"][1:]):
            tp = _clip(pieces, qs + a, qs + b, ks + c, ks + d) if pr["clip"] else pieces
            tiles.append((a, b, c, d, tp))
    for a, b, c, d, tp in tiles:
        o, l = attn_fwd(q[a:b], k[c:d], v[c:d], qs + a, ks + c, tp, scale)
        assert o.dtype == acc and l.dtype == acc
        assert o.shape == (b - a, q.shape[1], q.shape[2]) and l.shape == (b - a, q.shape[1])
        merge_into(out[a:b], lse[a:b], o, l)
    dq = torch.zeros(q.shape, dtype=acc)
    dk = torch.zeros(k.shape, dtype=acc)
    dv = torch.zeros(k.shape, dtype=acc)
    for a, b, c, d, tp in tiles:
        gq, gk, gv = attn_bwd(q[a:b], k[c:d], v[c:d], out[a:b], dout[a:b], lse[a:b],
                              qs + a, ks + c, tp, scale)
        assert gq.dtype == gk.dtype == gv.dtype == acc
        dq[a:b] += gq
        dk[c:d] += gk
        dv[c:d] += gv
    return out, lse, dq, dk, dv


def check_problem(pr, dtype):
    _assert_disjoint(pr["pieces"], pr["T"])
    q, k, v, dout = _tensors(pr, dtype)
    scale = 1.0 / math.sqrt(pr["D"])
    allowed = dense_allowed(pr["pieces"], pr["T"])[
        pr["qs"]:pr["qs"] + pr["Sq"], pr["ks"]:pr["ks"] + pr["Sk"]]
    rq, rk, rv = (x.detach().double().clone().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = dense_attention(rq, rk, rv, allowed, scale)
    ref_out.backward(dout.double())

    out, lse, dq, dk, dv = run_tiled(pr, q, k, v, dout, scale)
    out_tol, grad_tol, lse_tol = TOL[dtype]
    rel = dtype in (torch.bfloat16, torch.float16)  # fp32/fp64: absolute error
    empty = torch.as_tensor(~allowed.any(axis=1))
    # Empty rows: exactly out 0, lse -inf, zero gradients.
    assert torch.isneginf(lse[empty]).all()
    assert (out[empty] == 0).all()
    assert (dq[empty] == 0).all()
    assert torch.isfinite(lse[~empty]).all()
    assert torch.isneginf(ref_lse[empty]).all()
    _close(lse[~empty], ref_lse[~empty], lse_tol, "lse", rel)
    _close(out, ref_out, out_tol, "out", rel)
    _close(dq, rq.grad, grad_tol, "dq", rel)
    _close(dk, rk.grad, grad_tol, "dk", rel)
    _close(dv, rv.grad, grad_tol, "dv", rel)
    for g in (rq.grad, rk.grad, rv.grad):
        assert not torch.isnan(g).any()


@settings(derandomize=True, max_examples=300, deadline=None)
@given(problems())
def test_tiled_matches_dense_fp32(pr):
    check_problem(pr, torch.float32)


@settings(derandomize=True, max_examples=120, deadline=None)
@given(problems())
def test_tiled_matches_dense_bf16(pr):
    check_problem(pr, torch.bfloat16)


@settings(derandomize=True, max_examples=50, deadline=None)
@given(problems())
def test_tiled_matches_dense_fp16(pr):
    check_problem(pr, torch.float16)


@settings(derandomize=True, max_examples=60, deadline=None)
@given(problems())
def test_tiled_matches_dense_fp64(pr):
    check_problem(pr, torch.float64)


# ----------------------------------------------------------------------------
# lowering of pieces to op calls


def _call_allowed(c, Sq, Sk) -> np.ndarray:
    m, n = c.r1 - c.r0, c.c1 - c.c0
    i = np.arange(m)[:, None]
    j = np.arange(n)[None, :]
    if c.kind == kernels.FULL:
        a = np.ones((m, n), bool)
    elif c.kind == kernels.CAUSAL:
        a = j <= i
    elif c.kind == kernels.RCAUSAL:
        a = (j - i) >= (n - m)
    else:
        a = ((j - i) >= c.lo) & ((j - i) <= c.hi)
    full = np.zeros((Sq, Sk), bool)
    full[c.r0:c.r1, c.c0:c.c1] = a
    return full


@settings(derandomize=True, max_examples=400, deadline=None)
@given(problems())
def test_plan_tile_partitions_mask_tightly(pr):
    qs, ks, Sq, Sk = pr["qs"], pr["ks"], pr["Sq"], pr["Sk"]
    allowed = dense_allowed(pr["pieces"], pr["T"])[qs:qs + Sq, ks:ks + Sk]
    calls = plan_tile(qs, ks, Sq, Sk, pr["pieces"])
    cover = np.zeros((Sq, Sk), np.int64)
    for c in calls:
        a = _call_allowed(c, Sq, Sk)
        sub = a[c.r0:c.r1, c.c0:c.c1]
        # Tight: every row and column of the call's rectangle has a pair.
        assert sub.any(axis=1).all() and sub.any(axis=0).all(), c
        # The op's causal is top-left aligned: only ever ask for that.
        if c.kind in (kernels.CAUSAL, kernels.RCAUSAL):
            assert c.c1 - c.c0 <= c.r1 - c.r0
        cover += a
    assert (cover <= 1).all(), "calls overlap"
    assert np.array_equal(cover.astype(bool), allowed)


def _kinds(qs, ks, Sq, Sk, pieces):
    return [(c.kind, c.r0, c.r1, c.c0, c.c1) for c in plan_tile(qs, ks, Sq, Sk, np.array(pieces))]


def test_plan_tile_prefers_cheap_calls():
    # Full rectangle -> one unmasked call.
    assert _kinds(0, 0, 8, 8, [(0, 8, 0, 8, -U, U)]) == [("full", 0, 8, 0, 8)]
    # Causal on the diagonal tile -> is_causal.
    assert _kinds(16, 16, 8, 8, [(0, 64, 0, 64, -U, 0)]) == [("causal", 0, 8, 0, 8)]
    # Causal tile strictly below the diagonal -> full; above -> nothing.
    assert _kinds(32, 0, 8, 8, [(0, 64, 0, 64, -U, 0)]) == [("full", 0, 8, 0, 8)]
    assert _kinds(0, 32, 8, 8, [(0, 64, 0, 64, -U, 0)]) == []
    # Causal with a wider kv block (bottom-right aligned) -> full + causal, no mask.
    assert _kinds(10, 0, 10, 20, [(0, 64, 0, 64, -U, 0)]) == [
        ("full", 0, 10, 0, 10), ("causal", 0, 10, 10, 20)]
    # A document starting mid-block: tightened to the rows/cols it touches.
    assert _kinds(0, 0, 16, 16, [(5, 64, 5, 64, -U, 0)]) == [("causal", 5, 16, 5, 16)]
    # Inverse causal -> reversed causal (no mask).
    assert _kinds(0, 0, 8, 8, [(0, 8, 0, 8, 0, U)]) == [("rcausal", 0, 8, 0, 8)]
    # Sliding window inside the diagonal tile -> needs a mask.
    assert _kinds(0, 0, 8, 8, [(0, 8, 0, 8, -2, 0)]) == [("mask", 0, 8, 0, 8)]
    # Diagonal-only band crossing the tile's corner -> tightened mask call.
    assert _kinds(0, 5, 10, 10, [(0, 64, 0, 64, 0, 0)]) == [("mask", 5, 10, 0, 5)]
    # Empty band and a piece outside the tile -> nothing.
    assert _kinds(0, 0, 8, 8, [(0, 8, 0, 8, 3, 2), (20, 30, 0, 8, -U, U)]) == []


def test_attn_fwd_causal_uses_is_causal_without_mask(monkeypatch):
    seen = []
    real = kernels._FWD

    def spy(q, k, v, p, is_causal, *, attn_mask=None, scale=None):
        seen.append((is_causal, attn_mask is None, q.shape[2], k.shape[2]))
        return real(q, k, v, p, is_causal, attn_mask=attn_mask, scale=scale)

    monkeypatch.setattr(kernels, "_FWD", spy)
    q = torch.randn(8, 2, 8)
    k = torch.randn(20, 1, 8)
    attn_fwd(q, k, k, 10, 0, np.array([(0, 64, 0, 64, -U, 0)]), 0.3)
    assert seen == [(False, True, 8, 10), (True, True, 8, 8)]


# ----------------------------------------------------------------------------
# edge cases


def test_empty_tile_and_no_pieces():
    q = torch.randn(5, 2, 8)
    k = torch.randn(0, 2, 8)
    o, l = attn_fwd(q, k, k, 0, 0, np.array([(0, 5, 0, 5, -U, U)]), 0.3)
    assert (o == 0).all() and torch.isneginf(l).all()
    o, l = attn_fwd(q, q, q, 0, 0, np.zeros((0, 6), np.int64), 0.3)
    assert (o == 0).all() and torch.isneginf(l).all() and l.shape == (5, 2)
    dq, dk, dv = attn_bwd(q, q, q, o, torch.randn(5, 2, 8), l, 0, 0, np.zeros((0, 6)), 0.3)
    assert (dq == 0).all() and (dk == 0).all() and dk.shape == (5, 2, 8)


def test_bwd_rows_with_neg_inf_lse_get_zero_grad():
    g = torch.Generator().manual_seed(1)
    Sq, Sk, scale = 6, 7, 0.35
    q = torch.randn(Sq, 4, 8, generator=g)
    k = torch.randn(Sk, 2, 8, generator=g)
    v = torch.randn(Sk, 2, 8, generator=g)
    dout = torch.randn(Sq, 4, 8, generator=g)
    dead = torch.tensor([False, True, False, False, True, False])
    allowed = np.ones((Sq, Sk), bool)
    allowed[dead.numpy()] = False
    rk, rv = k.double().requires_grad_(), v.double().requires_grad_()
    rq = q.double().requires_grad_()
    ref_out, ref_lse = dense_attention(rq, rk, rv, allowed, scale)
    ref_out.backward(dout.double())
    # The caller says those rows have no key anywhere (lse -inf, garbage dout),
    # while the piece covers them: they must contribute nothing, and no NaN.
    dout_bad = dout.clone()
    dout_bad[dead] = 1e6
    gq, gk, gv = attn_bwd(q, k, v, ref_out.detach().float(), dout_bad, ref_lse.detach().float(),
                          0, 0, np.array([(0, Sq, 0, Sk, -U, U)]), scale)
    assert not any(torch.isnan(x).any() for x in (gq, gk, gv))
    assert (gq[dead] == 0).all()
    _close(gq, rq.grad, 1e-5, "dq", relative=False)
    _close(gk, rk.grad, 1e-5, "dk", relative=False)
    _close(gv, rv.grad, 1e-5, "dv", relative=False)


def test_merge_into_neg_inf_sides():
    D = 3
    o1 = torch.randn(4, 2, D)
    l1 = torch.tensor([[0.5, NEG_INF], [NEG_INF, NEG_INF], [1.0, 2.0], [NEG_INF, -3.0]])
    o2 = torch.randn(4, 2, D)
    l2 = torch.tensor([[NEG_INF, 0.25], [NEG_INF, NEG_INF], [-1.0, 2.0], [4.0, NEG_INF]])
    # Out on an -inf side is ignored even if it is garbage.
    o1[torch.isneginf(l1)] = float("nan")
    o2[torch.isneginf(l2)] = float("inf")
    acc_o, acc_l = o1.clone(), l1.clone()
    merge_into(acc_o, acc_l, o2, l2)
    assert not torch.isnan(acc_o).any() and not torch.isnan(acc_l).any()
    both = torch.isneginf(l1) & torch.isneginf(l2)
    assert torch.isneginf(acc_l[both]).all() and (acc_o[both] == 0).all()
    only1 = ~torch.isneginf(l1) & torch.isneginf(l2)
    only2 = torch.isneginf(l1) & ~torch.isneginf(l2)
    assert torch.equal(acc_o[only1], o1[only1]) and torch.equal(acc_l[only1], l1[only1])
    assert torch.equal(acc_o[only2], o2[only2]) and torch.equal(acc_l[only2], l2[only2])
    fin = ~torch.isneginf(l1) & ~torch.isneginf(l2)
    l = torch.logaddexp(l1[fin], l2[fin])
    expect = (torch.exp(l1[fin] - l)[:, None] * o1[fin] + torch.exp(l2[fin] - l)[:, None] * o2[fin])
    assert torch.allclose(acc_l[fin], l) and torch.allclose(acc_o[fin], expect)


def test_merge_into_is_order_independent_softmax():
    # Merging halves of a softmax equals the softmax over the union.
    g = torch.Generator().manual_seed(3)
    s = torch.randn(5, 12, generator=g, dtype=torch.float64)
    val = torch.randn(12, 4, generator=g, dtype=torch.float64)
    parts = []
    for a, b in [(0, 5), (5, 12)]:
        lse = torch.logsumexp(s[:, a:b], -1)
        parts.append((torch.softmax(s[:, a:b], -1) @ val[a:b], lse))
    acc_o = torch.zeros(5, 4, dtype=torch.float64)
    acc_l = torch.full((5,), NEG_INF, dtype=torch.float64)
    for o, l in reversed(parts):
        merge_into(acc_o, acc_l, o, l)
    assert torch.allclose(acc_o, torch.softmax(s, -1) @ val, atol=1e-12)
    assert torch.allclose(acc_l, torch.logsumexp(s, -1), atol=1e-12)


def test_reference_empty_rows_and_gqa():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(3, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(5, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(5, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    allowed = np.array([[1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], bool)
    out, lse = dense_attention(q, k, v, allowed, 0.5)
    assert torch.isneginf(lse[1]).all() and (out[1] == 0).all()
    # q head 3 uses kv head 1 (GQA group of 2).
    s = (q[0, 3] @ k[:2, 1].T) * 0.5
    assert torch.allclose(out[0, 3], torch.softmax(s, -1) @ v[:2, 1])
    assert torch.allclose(lse[0, 3], torch.logsumexp(s, -1))
    out.sum().backward()
    assert not torch.isnan(q.grad).any() and (q.grad[1] == 0).all()
    assert not torch.isnan(k.grad).any()


def test_dense_allowed():
    a = dense_allowed(np.array([(0, 4, 0, 4, -U, 0), (4, 6, 2, 6, -1, 1)]), 6)
    expect = np.zeros((6, 6), bool)
    expect[:4, :4] = np.tril(np.ones((4, 4), bool))
    expect[4, 3:6] = True
    expect[5, 4:6] = True
    assert np.array_equal(a, expect)


def test_strided_inputs_match_contiguous():
    # Inputs that are head slices of bigger buffers (non-contiguous views).
    g = torch.Generator().manual_seed(4)
    qb = torch.randn(12, 8, 16, generator=g)
    kb = torch.randn(9, 4, 16, generator=g)
    vb = torch.randn(9, 4, 16, generator=g)
    q, k, v = qb[:, 4:8], kb[:, 2:4], vb[:, 2:4]
    assert not q.is_contiguous()
    pieces = np.array([(0, 40, 0, 40, -U, 0), (0, 40, 0, 40, 2, 4)])
    o1, l1 = attn_fwd(q, k, v, 7, 3, pieces, 0.25)
    o2, l2 = attn_fwd(q.contiguous(), k.contiguous(), v.contiguous(), 7, 3, pieces, 0.25)
    assert torch.isfinite(l1).any()
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    dout = torch.randn(12, 4, 16, generator=g)
    a = attn_bwd(q, k, v, o1, dout, l1, 7, 3, pieces, 0.25)
    b = attn_bwd(q.contiguous(), k.contiguous(), v.contiguous(), o1, dout, l1, 7, 3, pieces, 0.25)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert any(bool(x.abs().sum() > 0) for x in a)
