"""``plan calibrate``'s fits (runtime/calibrate.py): they recover known
parameters from synthetic timings with noise, the profile they build is one
``backends.cost`` accepts, and every input is bounded. Fast: the only real
measurements are a few tiny kernel calls and merges."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnplan.backends.cost import load_profile_file, profile_from_dict, simulate
from attnplan.errors import PlanError
from attnplan.ir import limits
from attnplan.runtime import calibrate as cal
from attnplan.runtime.calibrate import KernelShape

HD = cal.HEAD_DIM


def noisy(rng, values, noise: float) -> np.ndarray:
    """``values`` times independent factors exp(N(0, noise)) (timing noise is multiplicative)."""
    v = np.asarray(values, float)
    return v * np.exp(rng.normal(0.0, noise, v.shape))


def kernel_truth(shapes, launch, rate, tile, bwd_factor):
    fwd = np.array([launch + s.work(tile, HD) / rate for s in shapes])
    return fwd, fwd * bwd_factor


# ------------------------------------------------------------------ affine fits

@settings(max_examples=30)
@given(a=st.floats(1e-6, 1e-2), rate=st.floats(1e8, 1e13), seed=st.integers(0, 2**32 - 1))
def test_fit_affine_recovers_intercept_and_rate(a, rate, seed):
    """Work spanning from 'all fixed cost' to 'all rate' (as the calibration
    grids do): 3% noise gives both parameters back within 10%, and the
    residuals are the relative errors of the fitted model."""
    rng = np.random.default_rng(seed)
    x = np.geomspace(a * rate * 1e-3, a * rate * 1e3, 25)
    t = noisy(rng, a + x / rate, 0.03)
    f = cal.fit_affine(x, t)
    assert f.intercept == pytest.approx(a, rel=0.1)
    assert 1 / f.slope == pytest.approx(rate, rel=0.1)
    assert np.allclose(f.residuals, (f.intercept + f.slope * x) / t - 1)
    assert f.rms < 0.1 and f.worst >= f.rms


def test_fit_affine_exact_data_is_exact_and_zero_intercept_is_clamped():
    x = np.array([0.0, 1e3, 1e6, 1e9])
    f = cal.fit_affine(x, 2e-4 + x / 5e10)
    assert f.intercept == pytest.approx(2e-4, rel=1e-9) and f.slope == pytest.approx(1 / 5e10, rel=1e-9)
    assert f.worst < 1e-9
    # timings that would fit a negative fixed cost: the fixed cost is 0, the rate still fitted
    x = np.array([1e6, 2e6, 4e6, 8e6])
    g = cal.fit_affine(x, x / 1e9 - 1e-4 * np.array([0.5, 0.2, 0.1, 0.0]))
    assert g.intercept == 0.0 and 1 / g.slope == pytest.approx(1e9, rel=0.2)


def test_fit_transfer_recovers_alpha_and_bandwidth():
    rng = np.random.default_rng(3)
    sizes = np.array(cal.DEFAULT_SIZES, float)
    f = cal.fit_transfer(sizes, noisy(rng, 60e-6 + sizes / 2.5e9, 0.03))
    assert f.intercept == pytest.approx(60e-6, rel=0.15)
    assert 1 / f.slope == pytest.approx(2.5e9, rel=0.1)


def test_fit_merge_recovers_memory_bandwidth():
    rng = np.random.default_rng(4)
    nbytes = np.array([1e5, 1e6, 1e7, 1e8])
    bw, res = cal.fit_merge(nbytes, noisy(rng, 3 * nbytes / 4e9, 0.03))
    assert bw == pytest.approx(4e9, rel=0.1) and len(res) == 4 and max(map(abs, res)) < 0.15


# ------------------------------------------------------------------ the kernel fit

@settings(max_examples=20)
@given(launch=st.floats(1e-6, 1e-3), rate=st.floats(1e10, 1e12), tile=st.sampled_from([1, 16, 64, 128]),
       factor=st.floats(1.5, 8.0), seed=st.integers(0, 2**32 - 1))
def test_fit_kernel_predicts_the_true_times(launch, rate, tile, factor, seed):
    """Timings made by the simulator's own compute model (rows rounded up to
    ``tile``) with 2% noise: the fitted model predicts every shape's noise-free
    forward time within 6%, the launch within a tenth of the smallest tile's
    time, the rate within 15% and the backward factor within 5%. (Where the launch hides a rounding step, a
    nearby step fits as well: the next test pins the step where it shows.)"""
    rng = np.random.default_rng(seed)
    shapes = cal.default_shapes()
    fwd, bwd = kernel_truth(shapes, launch, rate, tile, factor)
    k = cal.fit_kernel(shapes, noisy(rng, fwd, 0.02), noisy(rng, bwd, 0.02))
    model = np.array([k.launch_s + s.work(k.tile_q, HD) / k.rate for s in shapes])
    assert np.abs(model / fwd - 1).max() < 0.06
    assert abs(k.launch_s - launch) <= 0.1 * fwd.min()  # as well as the smallest tiles tell it
    assert k.rate == pytest.approx(rate, rel=0.15)
    assert k.bwd_factor == pytest.approx(factor, rel=0.05) and k.bwd_factor_ls == pytest.approx(factor, rel=0.05)
    assert k.candidates[k.tile_q] <= min(k.candidates.values()) * (1 + cal.TILE_TOLERANCE)


@pytest.mark.parametrize("tile", [8, 16, 32, 64, 128])
def test_fit_kernel_finds_a_rounding_step_that_shows(tile):
    """A small launch (10 us) and 2% noise: the grid's odd row counts pin the step."""
    rng = np.random.default_rng(tile)
    shapes = cal.default_shapes()
    fwd, bwd = kernel_truth(shapes, 1e-5, 1e11, tile, 3.0)
    k = cal.fit_kernel(shapes, noisy(rng, fwd, 0.02), noisy(rng, bwd, 0.02))
    assert k.tile_q == tile


def test_fit_kernel_prefers_the_smallest_step_that_fits():
    """Without a rounding step in the data, rounding to 1 row is as good as any
    step that leaves the grid's rows unchanged: the smallest is kept."""
    shapes = [KernelShape(r, k, 1, 1) for r in (256, 512, 1024) for k in (128, 1024)]
    fwd, bwd = kernel_truth(shapes, 1e-4, 1e11, 1, 3.0)
    k = cal.fit_kernel(shapes, fwd, bwd)
    assert k.tile_q == 1 and k.fwd.worst < 1e-9
    assert k.candidates[256] <= k.candidates[1] + 1e-12  # 256 divides every row count: also exact


def test_shape_pairs_and_work():
    assert cal.causal_pairs(4, 4) == 10 and cal.causal_pairs(4, 2) == 1 + 2 + 2 + 2
    assert cal.causal_pairs(2, 5) == 3
    dense = np.tril(np.ones((7, 3), bool))
    assert cal.causal_pairs(7, 3) == int(dense.sum())
    s = KernelShape(100, 50, 8, 2, "full")
    assert s.work(1, HD) == 4 * HD * 8 * 100 * 50
    assert s.work(128, HD) == pytest.approx(s.work(1, HD) * 128 / 100)


# ------------------------------------------------------------------ the profile

def synthetic_profile(seed: int = 0):
    rng = np.random.default_rng(seed)
    shapes = cal.default_shapes()
    fwd, bwd = kernel_truth(shapes, 3e-4, 1e11, 16, 4.0)
    sizes = np.array(cal.DEFAULT_SIZES, float)
    mbytes = [1e5, 1e6, 1e7]
    return cal.build_profile(shapes, noisy(rng, fwd, 0.02), noisy(rng, bwd, 0.02), sizes,
                             noisy(rng, 1e-4 + sizes / 2e9, 0.02), mbytes, noisy(rng, 3 * np.array(mbytes) / 5e9, 0.02))


def test_built_profile_is_a_valid_profile_file(tmp_path):
    """What calibrate writes: load_profile_file accepts it, the fitted values
    land in the profile's fields (inter = intra on one machine), and the
    simulator predicts with it."""
    data = synthetic_profile()
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    assert path.stat().st_size <= limits.MAX_PROFILE_FILE
    prof = load_profile_file(path)
    assert prof.flops == pytest.approx(1e11, rel=0.15) and prof.efficiency <= 1.0
    assert prof.launch_s == pytest.approx(3e-4, rel=0.15) and prof.tile_q == 16
    assert prof.bwd_factor == pytest.approx(4.0, rel=0.05)
    assert prof.intra_bw == pytest.approx(2e9, rel=0.1) and prof.intra_alpha == pytest.approx(1e-4, rel=0.2)
    assert (prof.inter_bw, prof.inter_alpha) == (prof.intra_bw, prof.intra_alpha)
    assert prof.mem_bw == pytest.approx(5e9, rel=0.1)
    fit = data["fit"]
    assert len(fit["kernel"]["points"]) == len(cal.default_shapes())
    assert len(fit["transfer"]["points"]) == len(cal.DEFAULT_SIZES) and "inter" in fit
    import attnplan
    plan = attnplan.compile(seqlens=[300, 700], devices=2, heads=2, head_dim=32, block_size=256)
    sim = simulate(plan.ir, prof)
    assert math.isfinite(sim["predicted_s"]) and sim["bwd"]["makespan_s"] > sim["fwd"]["makespan_s"]


def test_a_clamped_latency_falls_back_to_the_smallest_message():
    """Timings whose fit puts the fixed cost at 0 (a loaded machine's small
    messages came out fast) still give a latency > 0: the smallest message's time."""
    shapes = cal.default_shapes()
    fwd, bwd = kernel_truth(shapes, 3e-4, 1e11, 1, 4.0)
    sizes = np.array(cal.DEFAULT_SIZES, float)
    xfer = sizes / 2e9 * np.where(sizes < 1e5, 0.3, 1.0)  # small messages under the line: a negative intercept
    data = cal.build_profile(shapes, fwd, bwd, sizes, xfer, [1e5, 1e6], [1e-4, 1e-3])
    assert data["intra_alpha"] == pytest.approx(xfer[0]) and data["intra_alpha"] > 0
    assert "smallest" in data["fit"]["transfer"]["alpha_from"]
    assert synthetic_profile()["fit"]["transfer"]["alpha_from"] == "fit"


def test_per_call_model_recovers_its_terms():
    """The per-call model (reported beside the profile) gives back known terms from 2% noise."""
    rng = np.random.default_rng(6)
    shapes = cal.default_shapes()
    truth = np.array([2e-4, 5e-7, 3e-8, 8e-12, 4e-12])
    F = np.array([cal.call_features(s.rows, s.keys, s.heads, s.pairs()) for s in shapes])
    coef, res = cal.fit_call_model(F, noisy(rng, F @ truth, 0.02))
    assert np.allclose(coef, truth, rtol=0.25) and max(map(abs, res)) < 0.1
    s0 = shapes[-1]
    assert cal.call_seconds(coef, s0.rows, s0.keys, s0.heads, s0.pairs()) == pytest.approx(float(F[-1] @ coef))
    with pytest.raises(PlanError, match="shape"):
        cal.fit_call_model(F[:, :3], F @ truth)


def test_built_profile_rejects_an_unknown_key_added_later():
    data = synthetic_profile() | {"surprise": 1}
    with pytest.raises(PlanError, match="surprise"):
        profile_from_dict(data, "x.json")


# ------------------------------------------------------------------ bounded inputs

@pytest.mark.parametrize("x, t, match", [
    ([1, 2, 3], [1e-3, 2e-3], "3 work values but 2 timings"),
    ([1], [1e-3], "needs 2"),
    ([1, 2, float("nan")], [1e-3, 2e-3, 3e-3], "not finite"),
    ([1, 2, 3], [1e-3, 2e-3, float("inf")], "not finite"),
    ([1, 2, 3], [1e-3, 0.0, 3e-3], "> 0"),
    ([1, -2, 3], [1e-3, 2e-3, 3e-3], ">= 0"),
    ([5, 5, 5], [1e-3, 2e-3, 3e-3], "two distinct"),
    ([1, 2, 3], [3e-3, 2e-3, 1e-3], "do not grow"),
    ([1, 2, "x"], [1e-3, 2e-3, 3e-3], "must be numbers"),
])
def test_fit_affine_rejects_bad_points(x, t, match):
    with pytest.raises(PlanError, match=match):
        cal.fit_affine(x, t)


def test_fits_bound_the_number_of_points():
    n = cal.MAX_FIT_POINTS + 1
    with pytest.raises(PlanError, match="points"):
        cal.fit_affine(np.arange(n, dtype=float), np.ones(n))
    with pytest.raises(PlanError, match="> 0 bytes"):
        cal.fit_merge([0, 10], [1e-3, 2e-3])
    with pytest.raises(PlanError, match="model value"):
        cal.fit_ratio([0.0, 1.0], [1.0, 1.0])


@pytest.mark.parametrize("kw, match", [
    (dict(rows=0), "rows"), (dict(keys=cal.MAX_SHAPE_ROWS + 1), "keys"), (dict(heads=True), "heads"),
    (dict(heads=8, kv_heads=3), "divide"), (dict(kind="sliding"), "kind"), (dict(rows=2.5), "rows"),
])
def test_kernel_shapes_are_bounded(kw, match):
    args = dict(rows=16, keys=16, heads=1, kv_heads=1) | kw
    with pytest.raises(PlanError, match=match):
        KernelShape(**args)


def test_fit_kernel_rejects_bad_steps_and_shapes():
    shapes = cal.default_shapes()[:6]
    fwd, bwd = kernel_truth(shapes, 1e-4, 1e11, 1, 3.0)
    with pytest.raises(PlanError, match="tile steps"):
        cal.fit_kernel(shapes, fwd, bwd, steps=[0, 16])
    with pytest.raises(PlanError, match="KernelShape"):
        cal.fit_kernel([(16, 16, 1, 1)] * 6, fwd, bwd)
    with pytest.raises(PlanError, match="6 work values but 5"):
        cal.fit_kernel(shapes, fwd[:5], bwd)


@pytest.mark.parametrize("kw, match", [
    (dict(repeats=0), "repeats"), (dict(repeats=limits.MAX_REPEATS + 1), "repeats"), (dict(repeats=True), "repeats"),
    (dict(head_dim=0), "head_dim"), (dict(head_dim=limits.MAX_HEAD_DIM + 1), "head_dim"),
    (dict(shapes=[]), "shapes"), (dict(shapes=[(1, 1, 1, 1)] * 3), "shapes"),
])
def test_calibrate_checks_its_arguments_before_measuring(kw, match):
    t0 = time.perf_counter()
    with pytest.raises(PlanError, match=match):
        cal.calibrate(**kw)
    assert time.perf_counter() - t0 < 1.0


def test_message_sizes_are_bounded():
    with pytest.raises(PlanError, match="message sizes"):
        cal.measure_transfers([0])
    with pytest.raises(PlanError, match="message sizes"):
        cal.measure_transfers([cal.MAX_MESSAGE_BYTES + 1])


def test_round_robin_keeps_to_its_budget_whatever_the_repeats():
    """Each function stops repeating once it used its share of the budget:
    10 ms calls, a 0.1 s budget over 2 functions and 1000 repeats take well
    under a second, and each function ran a few times, not 1000."""
    calls = [0, 0]

    def slow(i):
        calls[i] += 1
        time.sleep(0.01)

    t0 = time.perf_counter()
    med = cal._round_robin([lambda: slow(0), lambda: slow(1)], 1000, 0.1, clock=time.perf_counter)
    assert time.perf_counter() - t0 < 1.0
    assert all(2 <= c <= 12 for c in calls) and all(m >= 0.009 for m in med)


def test_samples_are_cpu_time_by_default():
    """A sleeping call costs no CPU: the default clock (thread CPU time) is not
    inflated by waiting, which is what keeps other processes' load out of
    the kernel rates; the wall-clock budget still bounds the time spent."""
    t0 = time.perf_counter()
    (samples,) = cal._samples([lambda: time.sleep(0.01)], 1000, 0.1)
    assert time.perf_counter() - t0 < 1.0 and max(samples) < 0.005


def test_measurements_run_the_runtime_kernels():
    """Two tiny shapes and merges, really measured: positive times, one per shape."""
    shapes = [KernelShape(4, 8, 2, 1), KernelShape(8, 8, 2, 1, "causal")]
    fwd, bwd = cal.measure_kernels(shapes, repeats=2, head_dim=16, budget_s=0.5)
    assert len(fwd) == len(bwd) == 2 and min(fwd + bwd) > 0
    nbytes, secs = cal.measure_merges(rows=(8, 32), heads=2, head_dim=16, repeats=2)
    assert nbytes == [8 * 2 * (4 * 16 + 4), 32 * 2 * (4 * 16 + 4)] and min(secs) > 0


# ------------------------------------------------------------------ one GPU (--device cuda)

def test_cuda_profile_fits_its_kernels_and_keeps_the_base_links(tmp_path):
    """What ``plan calibrate --device cuda`` writes, from synthetic GPU timings (head_dim 128): the fitted
    rate, launch and backward factor land in the profile; the links are the base profile's."""
    from attnplan.backends.cost import PROFILES
    from attnplan.runtime import calibrate_cuda as cc
    rng = np.random.default_rng(0)
    shapes = cc.cuda_shapes()
    fwd = np.array([2e-5 + s.work(128, cc.HEAD_DIM) / 4e14 for s in shapes])
    mbytes = [1e8, 4e8, 1.6e9]
    data = cc.build_cuda_profile(shapes, noisy(rng, fwd, 0.02), noisy(rng, 2.8 * fwd, 0.02), mbytes,
                                 noisy(rng, 3 * np.array(mbytes) / 3e12, 0.02), base="h200", device_name="test GPU")
    path = tmp_path / "cuda.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    prof = load_profile_file(path)
    assert prof.flops == pytest.approx(4e14, rel=0.1) and prof.launch_s == pytest.approx(2e-5, rel=0.3)
    assert prof.bwd_factor == pytest.approx(2.8, rel=0.05) and prof.mem_bw == pytest.approx(3e12, rel=0.1)
    h200 = PROFILES["h200"]
    assert (prof.intra_bw, prof.inter_bw, prof.intra_alpha, prof.inter_alpha) == \
        (h200.intra_bw, h200.inter_bw, h200.intra_alpha, h200.inter_alpha)
    assert "not measured" in data["fit"]["links"] and len(data["fit"]["kernel"]["points"]) == len(shapes)
    with pytest.raises(PlanError, match="builtin profile"):
        cc.build_cuda_profile(shapes, fwd, 2 * fwd, mbytes, [1e-3] * 3, base="nope")


def test_calibrate_on_cuda_without_a_gpu_is_one_error():
    import torch

    from attnplan.runtime.calibrate_cuda import calibrate_cuda
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(PlanError, match="no CUDA device"):
        calibrate_cuda()
