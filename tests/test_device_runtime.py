"""The GPU runtime's device-independent parts, on CPU: varlen segments and
launches (run by the reference kernel, which reads windows as flash-attn
does), the plain-ops kernel of fp32 on GPUs, the stream memory the plan
predicts, the optimistic finiteness check, device errors; and, where CUDA is
present, the same checks on the GPU (skipped otherwise)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attnplan
from attnplan.errors import ShapeError
from attnplan.ir.program import BWD, FWD
from attnplan.runtime import executor, kernels, mathattn, memory, runner, varlen
from attnplan.runtime.check import check_plan
from attnplan.runtime.reference import dense_allowed

STRATEGIES = ("zigzag", "per_doc", "minheap", "hypergraph", "tile_pool", "ulysses", "dacp", "usp")
MASKS = ("causal", "sliding_window(37)", "streaming(8, 40)", "prefix_lm(30) & (k < q - 70 | k > q - 50)",
         "full", "chunked_causal(33)")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def kernel(monkeypatch):
    def use(name: str) -> None:
        monkeypatch.setenv(varlen.KERNEL_ENV, name)
    return use


# segments --------------------------------------------------------------------------------

def _allowed_of_segments(segs, m: int, n: int, clamp_k: int | None = None) -> np.ndarray:
    """bool [m, n] union of the segments (flipped ones in their own coordinates), as flash-attn reads them."""
    a = np.zeros((m, n), dtype=np.int64)
    for s in segs:
        sm, sn = s.r1 - s.r0, s.c1 - s.c0
        wl, wr = s.wl, s.wr
        if clamp_k is not None:
            wl = -1 if wl >= clamp_k else wl
            wr = -1 if wr >= clamp_k else wr
        i = np.arange(sm)[:, None]
        j = np.arange(sn)[None, :]
        ok = np.ones((sm, sn), dtype=bool)
        if wl >= 0:
            ok &= j >= i + (sn - sm) - wl
        if wr >= 0:
            ok &= j <= i + (sn - sm) + wr
        if s.flip:
            ok = ok[::-1, ::-1]
        a[s.r0:s.r1, s.c0:s.c1] += ok
    return a


@given(st.integers(1, 40), st.integers(1, 40), st.integers(-45, 45), st.integers(-45, 45), st.integers(0, 1))
def test_segments_cover_each_allowed_pair_once(m, n, lo, hi, cross):
    """The segments of a tile's calls allow exactly the pairs the pieces allow, each once, even when each
    segment is read with flash-attn's clamp (a window of at least the keys is unbounded)."""
    qs, ks = 100, 100 + cross * 7
    piece = np.array([[qs, qs + m, ks, ks + n, lo, hi]], dtype=np.int64)
    calls = kernels.plan_tile(qs, ks, m, n, piece)
    segs, rest = varlen.segments(calls)
    got = _allowed_of_segments(segs, m, n)
    for s in segs:  # read alone in a launch, each segment keeps its meaning under flash-attn's clamp
        alone = _allowed_of_segments([s], m, n, clamp_k=s.c1 - s.c0)
        assert (alone == _allowed_of_segments([s], m, n)).all(), s
    rest_mask = np.zeros((m, n), dtype=np.int64)
    for c in rest:
        i = np.arange(c.r1 - c.r0)[:, None]
        j = np.arange(c.c1 - c.c0)[None, :]
        rest_mask[c.r0:c.r1, c.c0:c.c1] += (j - i >= c.lo) & (j - i <= c.hi)
    q = np.arange(qs, qs + m)[:, None]
    k = np.arange(ks, ks + n)[None, :]
    want = (k - q >= lo) & (k - q <= hi)
    assert ((got + rest_mask) == want).all()


@given(st.lists(st.tuples(st.integers(0, 30), st.integers(1, 20), st.sampled_from([(-1, -1), (-1, 0), (3, 0)])),
                min_size=1, max_size=12))
def test_forward_launches_have_distinct_rows(spec):
    segs = [varlen.Segment(a, a + n, 0, n, False, wl, wr) for a, n, (wl, wr) in spec]
    groups = varlen.launches(segs, 60, distinct=True)
    assert sorted(id(s) for g in groups for s in g) == sorted(id(s) for s in segs)
    for g in groups:
        assert len({(s.wl, s.wr) for s in g}) == 1
        rows = np.concatenate([np.arange(s.r0, s.r1) for s in g])
        assert len(rows) == len(set(rows.tolist()))


# the kernels against dense attention ------------------------------------------------------

@pytest.mark.parametrize("name", ["varlen-ref", "math"])
@pytest.mark.parametrize("mask", MASKS)
def test_device_kernels_equal_dense(kernel, name, mask):
    """Strategies' plans, run by the GPU paths' kernels on CPU, equal dense attention (bf16 and fp32): on
    each mask four of the eight strategies, a window that moves by three, so that each kernel runs every
    strategy on two to four masks (all eight on every mask took 45 s of the suite)."""
    kernel(name)
    varlen.COUNTS.clear()
    i = MASKS.index(mask)
    for strategy in (STRATEGIES * 2)[i * 3 % len(STRATEGIES):][:4]:
        plan = attnplan.compile([300, 77, 130, 41], mask=mask, devices=4, heads=4, kv_heads=2, head_dim=16,
                                strategy=strategy, block_size=64)
        for dtype in ("float32", "bfloat16"):
            r = check_plan(plan, dtype)
            assert r["ok"], (strategy, dtype, r)
    assert varlen.COUNTS[name] > 0


def test_a_window_flash_attn_would_misread_runs_call_by_call(kernel):
    """A band whose right side cuts but is at least the keys (flash-attn reads it as unbounded) is not a
    segment: the reference kernel reads windows as flash-attn does, and the plan still equals dense."""
    assert varlen._band_window(548, 49, -548, 0) is None  # rows 0..547, keys 0..48, j <= i
    kernel("varlen-ref")
    plan = attnplan.compile([1500, 700, 333], mask="prefix_lm(300) & (k < q - 700 | k > q - 500)", devices=1,
                            heads=4, kv_heads=2, head_dim=16, strategy="per_doc", block_size=256)
    assert check_plan(plan, "bfloat16")["ok"]


@given(st.integers(1, 30), st.integers(1, 30), st.sampled_from([1, 2, 4]), st.booleans())
def test_mathattn_equals_dense(m, n, rep, masked):
    g = torch.Generator().manual_seed(m * 131 + n)
    q = torch.randn(m, 2 * rep, 8, generator=g, dtype=torch.float64)
    k = torch.randn(n, 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(n, 2, 8, generator=g, dtype=torch.float64)
    allowed = torch.rand(m, n, generator=g) < 0.6 if masked else None
    out, lse = mathattn.fwd(q, k, v, allowed, 0.3)
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(rep, 1)) * 0.3
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    want_lse = torch.logsumexp(s, -1).T
    p = torch.softmax(s, -1).nan_to_num(0.0)
    want = torch.einsum("hqk,khd->qhd", p, v.repeat_interleave(rep, 1))
    assert torch.allclose(lse, want_lse, atol=1e-12, equal_nan=False) or bool(
        (torch.isneginf(lse) == torch.isneginf(want_lse)).all())
    assert torch.allclose(out, want, atol=1e-12)


# memory -----------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", STRATEGIES)
def test_stream_peak_is_what_the_runner_holds(monkeypatch, strategy):
    seen: list = []
    init = runner.DeviceRunner.__init__

    def tracking(self, *a, **k):
        init(self, *a, **k)
        self.track_memory = True
        seen.append(self)
    monkeypatch.setattr(runner.DeviceRunner, "__init__", tracking)
    plan = attnplan.compile([300, 77, 130, 500], devices=4, heads=4, kv_heads=2, head_dim=16, strategy=strategy,
                            block_size=64, dtype="float32")
    q = torch.randn(1007, 4, 16, requires_grad=True)
    k = torch.randn(1007, 2, 16, requires_grad=True)
    v = torch.randn(1007, 2, 16, requires_grad=True)
    attnplan.execute(plan, q, k, v).sum().backward()
    assert {(r.phase, r.device) for r in seen} == {(ph, d) for ph in (FWD, BWD) for d in range(4)}
    for r in seen:
        m = memory.stream_peak(plan.ir.program, r.phase, r.device)
        assert r.peak_bytes == m.peak - m.home  # the liveness replay is exact for the runner's buffers
        assert m.home <= m.peak <= m.total


# finiteness, devices -------------------------------------------------------------------------

def test_optimistic_run_redoes_a_phase_with_non_finite_inputs(monkeypatch):
    """On a GPU a phase runs before its finiteness check is read; NaN inputs then rerun it exactly."""
    plan = attnplan.compile([60, 40], devices=2, heads=2, kv_heads=1, head_dim=8, strategy="zigzag",
                            block_size=16, dtype="float32")
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(100, 2, 8, generator=g), torch.randn(100, 1, 8, generator=g), torch.randn(100, 1, 8, generator=g)
    k[70, 0, 3] = float("nan")  # a key of the second document: its rows 70..99 become NaN, the first stays finite
    want = attnplan.execute(plan, q, k, v)
    monkeypatch.setattr(executor, "optimistic", lambda device: True)
    got = attnplan.execute(plan, q, k, v)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and bool(torch.isnan(got[70:]).all())
    assert torch.equal(got[:60], want[:60])


def test_tensors_on_a_device_without_kernels_are_refused():
    plan = attnplan.compile([20], devices=1, heads=2, kv_heads=2, head_dim=8, block_size=16)
    q = torch.zeros(20, 2, 8, device="meta")
    with pytest.raises(ShapeError, match="CPU and CUDA"):
        attnplan.execute(plan, q, q, q)


def test_backend_and_device_must_agree():
    from attnplan.runtime.dist import GroupInfo, check_backend
    with pytest.raises(ShapeError, match="nccl"):
        check_backend(GroupInfo(None, 0, (0, 1), "nccl"), torch.device("cpu"))
    with pytest.raises(ShapeError, match="gloo"):
        check_backend(GroupInfo(None, 0, (0, 1), "gloo"), torch.device("cuda", 0))
    check_backend(GroupInfo(None, 0, (0, 1), "gloo"), torch.device("cpu"))


def test_kernel_override_is_checked(kernel):
    kernel("tpu")
    with pytest.raises(attnplan.PlanError, match="ATTNPLAN_KERNEL"):
        varlen.kernel_for(torch.zeros(1, 1, 8))


# on a GPU ------------------------------------------------------------------------------------------

@cuda
@pytest.mark.parametrize("mask", MASKS)
def test_cuda_plans_equal_dense(mask):
    for strategy in ("zigzag", "per_doc", "ulysses"):
        plan = attnplan.compile([300, 77, 130], mask=mask, devices=2, heads=4, kv_heads=2, head_dim=64,
                                strategy=strategy, block_size=64)
        for dtype in ("float32", "bfloat16"):
            r = check_plan(plan, dtype, device="cuda")
            assert r["ok"], (strategy, dtype, r)


@cuda
def test_cuda_flash_launch_equals_plain_ops():
    if varlen.kernel_for(torch.zeros(1, 1, 64, dtype=torch.bfloat16, device="cuda")) != "flash":
        pytest.skip("no flash-attn varlen kernel in this torch build")
    g = torch.Generator(device="cuda").manual_seed(0)
    lens = [30, 7, 100]
    T = sum(lens)
    q = torch.randn(T, 4, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    kv = torch.randn(T, 2, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    segs, a = [], 0
    for n in lens:
        segs.append(varlen.Segment(a, a + n, a, a + n, False, -1, 0))
        a += n
    L = varlen._Launch(segs, "cuda", T, T)
    o1, l1 = varlen._flash_fwd(q, kv, kv, L, 0.125)
    o2, l2 = varlen._ref_fwd(q, kv, kv, L, 0.125)
    assert float((o1.float() - o2).abs().max()) < 2e-2
    assert float((l1 - l2).abs().max()) < 1e-3


def test_dense_allowed_is_the_reference_mask():  # the helper the segment test mirrors
    a = dense_allowed(np.array([[0, 4, 0, 4, -1, 0]]), 4)
    assert a.sum() == 7


# posting: a stage's sends and receives start together ----------------------------------------------

class _Recording:
    """A transport that records what the runner asks of it (data never moves: compute is off)."""

    def __init__(self):
        self.log: list = []

    def post_send(self, tag, peer, tensors, flat=None):
        self.log.append(("post", tag))

    def post_recv(self, tag, peer, tensors, flat=None):
        self.log.append(("post", tag))

    def wait(self, tag):
        self.log.append(("wait", tag))

    def flush(self):
        self.log.append(("flush",))


@pytest.mark.parametrize("strategy", ["zigzag", "hypergraph", "ulysses"])
def test_each_run_of_posts_is_flushed_before_the_stream_moves_on(strategy):
    from attnplan.ir.program import OP, RECV, SEND
    plan = attnplan.compile([300, 77, 130, 500], devices=4, heads=4, kv_heads=2, head_dim=16, strategy=strategy,
                            block_size=64, dtype="float32")
    g, prog = plan.ir.graph, plan.ir.program
    for phase in (FWD, BWD):
        tr = _Recording()
        r = runner.DeviceRunner(g, prog, phase, 1, {}, tr, 0.25, torch.float32, compute=False)
        r.run()
        ops = prog.code[phase][1][:, OP]
        posts = ((ops == SEND) | (ops == RECV)).tolist()
        runs = sum(1 for i, p in enumerate(posts) if p and (i == 0 or not posts[i - 1]))  # maximal runs of posts
        got = [e[0] for e in tr.log]
        assert got.count("post") == sum(posts) and runs > 0
        # every post is followed by a flush before any wait: one batch per run of posts, in program order
        pending = 0
        for e in got:
            if e == "post":
                pending += 1
            elif e == "flush":
                pending = 0
            else:
                assert pending == 0, "a wait came before its posts were started"
        assert pending == 0
