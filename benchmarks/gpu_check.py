"""The prepared GPU check: one script, a few minutes on one GPU.

    python benchmarks/gpu_check.py [--out DIR] [--batches FILE] [--quick] [--device cuda]

Prints, and writes to DIR/gpu_check.md and DIR/gpu_check.json:

1. the kernels: which one each path takes on this GPU, and flash-attn's
   varlen kernel (the one PyTorch's CUDA build ships) against plain tensor ops
   on one small varlen launch;
2. equality to dense attention: every strategy × 1, 2, 4, 8 virtual devices
   (all executed in this process on the one GPU, transfers as device copies)
   × causal and three other masks × bf16 and fp32, forward and backward,
   against the float64 dense reference (``plan run --check``'s tolerances),
   and every strategy at the most devices with partial outputs sent in bf16
   and the forward's KV kept for the backward (``partials_dtype``, ``keep_kv``),
   and every strategy at the most devices in float16;
3. kernel efficiency: a 128K-token long-tailed batch (lmsys-128k-0, causal,
   32 q / 8 kv heads, head_dim 128, bf16) on one device, attnplan's runtime
   against one flash-attn varlen call on the same documents, forward and
   backward (median of timed repeats, CUDA events);
4. predicted (h200 profile, and one calibrated from this run's kernel rate)
   against measured time per program: the 1-device plan, and each strategy's
   8-device plan executed in turn on the one GPU (its prediction is the sum of
   the devices' compute, the transfers being device copies here);
5. peak memory (``torch.cuda.max_memory_allocated``) against the plan's
   buffer peak (:func:`attnplan.runtime.memory.stream_peak`);
6. ``examples/hf_train.py --device cuda --check --steps 5``.

``--device cpu --quick`` runs the same code on the CPU (sections 2 and 4 on
small cases; no flash kernel), which is how the script is tested before a GPU
is lent. Every section catches its own failure and reports it, so one broken
section never hides the others.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
import traceback

import numpy as np
import torch

import attnplan
from attnplan.backends.cost import get_profile, simulate
from attnplan.ir.program import BWD, FWD
from attnplan.runtime import memory, varlen
from attnplan.runtime.check import TOLERANCE, random_inputs, reference

STRATEGIES = tuple(attnplan.strategies())  # every registered placement strategy
MASKS = ("causal", "sliding_window(200)", "streaming(64, 256)", "prefix_lm(300) & (k < q - 700 | k > q - 500)")
SMALL = [1500, 700, 333, 200, 120, 64, 40, 23]  # 2,980 tokens: a long-tailed mix with a dominant document
HERE = os.path.dirname(os.path.abspath(__file__))
REPORT: dict = {}
PROFILE_FILE: str | None = None
LINES: list[str] = []


def say(s: str = "") -> None:
    print(s, flush=True)
    LINES.append(s)


def sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def timed(fn, dev: str, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs after one warm-up (CUDA events on a GPU)."""
    fn()
    sync(dev)
    out = []
    for _ in range(reps):
        if dev == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); fn(); b.record(); b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter(); fn(); out.append(time.perf_counter() - t)
    return float(np.median(out))


def section(name: str):
    def wrap(fn):
        def run(*a, **k):
            say(f"\n## {name}\n")
            t = time.perf_counter()
            try:
                fn(*a, **k)
            except Exception as e:  # a broken section is reported, the others still run
                say(f"SECTION FAILED: {type(e).__name__}: {str(e)[:500]}")
                say("```\n" + traceback.format_exc()[-2000:] + "\n```")
                REPORT.setdefault("failed", []).append(name)
            say(f"\n({name}: {time.perf_counter() - t:.1f} s)")
        return run
    return wrap


# 1. kernels -----------------------------------------------------------------------------------

@section("1. kernels")
def check_kernels(dev: str) -> None:
    say(f"torch {torch.__version__}, device {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}")
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        say(f"- {str(dt).replace('torch.', '')} on {dev}: kernel `{varlen.kernel_for(torch.empty(1, 1, 64, dtype=dt, device=dev))}`")
    if dev != "cuda":
        return
    g = torch.Generator(device="cuda").manual_seed(0)
    lens = [300, 17, 1000, 64]
    T = sum(lens)
    q = torch.randn(T, 8, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(T, 2, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(T, 2, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    segs = []
    a = 0
    for n in lens:
        segs.append(varlen.Segment(a, a + n, a, a + n, False, -1, 0)); a += n
    L = varlen._Launch(segs, "cuda", T, T)
    o1, l1 = varlen._flash_fwd(q, k, v, L, 0.125)
    o2, l2 = varlen._ref_fwd(q, k, v, L, 0.125)
    e_o = float((o1.float() - o2).abs().max()); e_l = float((l1 - l2).abs().max())
    dout = torch.randn_like(q)
    lse = l2.float()
    out = o2.to(q.dtype)
    g1 = varlen._flash_bwd(q, k, v, out, dout, lse, L, 0.125)
    g2 = varlen._ref_bwd(q, k, v, out, dout, lse, L, 0.125)
    e_g = max(float((a_.float() - b_).abs().max() / b_.abs().max()) for a_, b_ in zip(g1, g2))
    say(f"- flash varlen (causal, GQA 8/2, {len(lens)} docs) vs plain ops: out {e_o:.2e}, lse {e_l:.2e}, "
        f"grads (relative) {e_g:.2e}")
    REPORT["flash_selftest"] = {"out": e_o, "lse": e_l, "grad": e_g}


# 2. equality to dense -------------------------------------------------------------------------

@section("2. equality to dense attention")
def check_equality(dev: str, quick: bool, only: str = "") -> None:
    strategies = [s for s in STRATEGIES if s in only.split(",")] if only else (
        STRATEGIES[:3] if quick else STRATEGIES)
    devices = (1, 2) if quick else (1, 2, 4, 8)
    refs: dict = {}
    rows, bad = [], 0
    say("| strategy | devices | mask | dtype | out | dq | dk | dv | ok |")
    say("|---|---|---|---|---|---|---|---|---|")
    for mask in MASKS:
        for strat in strategies:
            for n in devices:
                plan = attnplan.compile(SMALL, mask=mask, devices=n, heads=8, kv_heads=2, head_dim=64,
                                        strategy=strat, block_size=256)
                for dt in ("bfloat16", "float32"):
                    inputs = random_inputs(plan, dt, 0)
                    key = (mask, dt)
                    if key not in refs:
                        q, k, v, dout = inputs
                        refs[key] = reference(plan.problem, q, k, v, dout, 1 / math.sqrt(64))
                    got = _run(plan, inputs, dev)
                    r = _errors(got, refs[key], dt)
                    bad += not r["ok"]
                    rows.append(dict(strategy=strat, devices=n, mask=mask, dtype=dt, **r))
                    if not r["ok"] or n == devices[-1]:
                        say(f"| {strat} | {n} | `{mask}` | {dt} | {r['out']:.1e} | {r['dq']:.1e} | {r['dk']:.1e} | "
                            f"{r['dv']:.1e} | {'ok' if r['ok'] else 'FAIL'} |")
    n = devices[-1]  # the plan options on the GPU: partials sent in bf16, the forward's KV kept for the backward
    for strat in strategies:
        plan = attnplan.compile(SMALL, devices=n, heads=8, kv_heads=2, head_dim=64, strategy=strat, block_size=256,
                                partials_dtype="bfloat16", keep_kv=True)
        inputs = random_inputs(plan, "bfloat16", 0)
        r = _errors(_run(plan, inputs, dev), refs[("causal", "bfloat16")], "bfloat16")
        bad += not r["ok"]
        rows.append(dict(strategy=strat + " (bf16 partials, KV kept)", devices=n, mask="causal", dtype="bfloat16",
                         **r))
        say(f"| {strat}, bf16 partials, KV kept | {n} | `causal` | bfloat16 | {r['out']:.1e} | {r['dq']:.1e} | "
            f"{r['dk']:.1e} | {r['dv']:.1e} | {'ok' if r['ok'] else 'FAIL'} |")
    for strat in strategies:  # float16 inputs (flash-attn's other half-precision path), causal, the most devices
        plan = attnplan.compile(SMALL, devices=n, heads=8, kv_heads=2, head_dim=64, strategy=strat, block_size=256,
                                dtype="float16")
        inputs = random_inputs(plan, "float16", 0)
        if ("causal", "float16") not in refs:
            q, k, v, dout = inputs
            refs[("causal", "float16")] = reference(plan.problem, q, k, v, dout, 1 / math.sqrt(64))
        r = _errors(_run(plan, inputs, dev), refs[("causal", "float16")], "float16")
        bad += not r["ok"]
        rows.append(dict(strategy=strat, devices=n, mask="causal", dtype="float16", **r))
        say(f"| {strat} | {n} | `causal` | float16 | {r['out']:.1e} | {r['dq']:.1e} | {r['dk']:.1e} | "
            f"{r['dv']:.1e} | {'ok' if r['ok'] else 'FAIL'} |")
    worst = {dt: {t: max(r[t] for r in rows if r["dtype"] == dt) for t in ("out", "dq", "dk", "dv")}
             for dt in ("bfloat16", "float32", "float16")}
    say(f"\n{len(rows)} cases, {bad} over tolerance (rows above: every failure, and the {devices[-1]}-device "
        f"case of each); worst errors: {json.dumps({d: {t: f'{e:.1e}' for t, e in w.items()} for d, w in worst.items()})}")
    say(f"tolerances: {json.dumps(TOLERANCE)}; launches per kernel: {dict(varlen.COUNTS)}")
    REPORT["equality"] = {"cases": len(rows), "failures": bad, "worst": worst, "launches": dict(varlen.COUNTS)}


def _run(plan, inputs, dev: str):
    q, k, v, dout = (t.to(dev) for t in inputs)
    q.requires_grad_(True); k.requires_grad_(True); v.requires_grad_(True)
    out = attnplan.execute(plan, q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return [t.detach().cpu() for t in (out, dq, dk, dv)]


def _errors(got, ref, dt: str) -> dict:
    want = [ref[0]] + list(ref[1])
    r: dict = {"ok": True}
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        e = float((g.double() - w).abs().max()) / max(1.0, float(w.abs().max()))
        e = e if bool(torch.isfinite(g).all()) else float("inf")
        r[name] = e
        r["ok"] &= e <= TOLERANCE[dt][name]
    return r


# 3-5. efficiency, predicted vs measured, memory -------------------------------------------------

def load_batch(path: str | None, name: str) -> list[int]:
    for p in [path, os.path.join(HERE, "..", ".device", "batches.jsonl"),
              os.path.join(HERE, "..", "..", "shared", "workloads", "batches.jsonl")]:
        if p and os.path.exists(p):
            for line in open(p):
                b = json.loads(line)
                if b["name"] == name:
                    return b["seqlens"]
    raise FileNotFoundError(f"batch {name} not found (give --batches shared/workloads/batches.jsonl)")


def flash_reference(lens, q, k, v, dout, scale):
    """One flash-attn varlen call (PyTorch's) on whole documents: (fwd, bwd) closures."""
    segs, a = [], 0
    for n in lens:
        segs.append(varlen.Segment(a, a + n, a, a + n, False, -1, 0)); a += n
    L = varlen._Launch(segs, q.device, a, a)
    state = {}

    def fwd():
        state["o"], state["l"] = varlen._flash_fwd(q, k, v, L, scale)

    def bwd():
        varlen._flash_bwd(q, k, v, state["o"], dout, state["l"], L, scale)
    return fwd, bwd


def runtime_closures(plan, q, k, v, dout):
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
    state = {}

    def fwd():
        with torch.no_grad():
            attnplan.execute(plan, q, k, v)

    def fwd_graph():
        state["out"] = attnplan.execute(plan, qg, kg, vg)

    def bwd():
        torch.autograd.grad(state["out"], (qg, kg, vg), dout, retain_graph=True)
    return fwd, fwd_graph, bwd


@section("3. kernel efficiency (one 128K batch, one device)")
def check_efficiency(dev: str, batches: str | None, quick: bool) -> None:
    lens = load_batch(batches, "lmsys-128k-0")
    if quick:
        lens = [x for x in lens if x < 1500][:30]
    H, Hkv, D = 32, 8, 128
    T = sum(lens)
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(T, H, D, device=dev, dtype=dt, generator=g)
    k = torch.randn(T, Hkv, D, device=dev, dtype=dt, generator=g)
    v = torch.randn(T, Hkv, D, device=dev, dtype=dt, generator=g)
    dout = torch.randn(T, H, D, device=dev, dtype=dt, generator=g)
    plan = attnplan.compile(lens, devices=1, heads=H, kv_heads=Hkv, head_dim=D, strategy="minheap",
                            block_size=131072, profile="h200")
    pairs = int(plan.stats()["pairs"])
    flops = 4 * D * pairs
    reps = 3 if quick else 10
    f_rt, f_rt_graph, b_rt = runtime_closures(plan, q, k, v, dout)
    t_rt_f = timed(f_rt, dev, reps)
    f_rt_graph(); sync(dev)
    t_rt_b = timed(b_rt, dev, reps)
    say(f"{len(lens)} documents, {T:,} tokens (largest {max(lens):,}), {pairs:,} pairs, "
        f"{flops / 1e12:.2f} TFLOP forward; plan: {plan.ir.graph.n_tb} token blocks, "
        f"{len(plan.ir.graph.cb_tile)} compute blocks")
    res = {"tokens": T, "docs": len(lens), "runtime_fwd_s": t_rt_f, "runtime_bwd_s": t_rt_b}
    if dev == "cuda":
        f_ref, b_ref = flash_reference(lens, q, k, v, dout, 1 / math.sqrt(D))
        t_ref_f = timed(f_ref, dev, reps)
        t_ref_b = timed(b_ref, dev, reps)
        res.update(flash_fwd_s=t_ref_f, flash_bwd_s=t_ref_b, eff_fwd=t_ref_f / t_rt_f, eff_bwd=t_ref_b / t_rt_b)
        say("| | flash-attn varlen, one call | attnplan runtime | attnplan / flash throughput |")
        say("|---|---|---|---|")
        say(f"| forward | {t_ref_f * 1e3:.2f} ms ({flops / t_ref_f / 1e12:.0f} TFLOP/s) | {t_rt_f * 1e3:.2f} ms | "
            f"{t_ref_f / t_rt_f:.1%} |")
        say(f"| backward | {t_ref_b * 1e3:.2f} ms ({2.5 * flops / t_ref_b / 1e12:.0f} TFLOP/s) | "
            f"{t_rt_b * 1e3:.2f} ms | {t_ref_b / t_rt_b:.1%} |")
    else:
        say(f"runtime forward {t_rt_f * 1e3:.1f} ms, backward {t_rt_b * 1e3:.1f} ms (no flash kernel on {dev})")
    REPORT["efficiency"] = res
    if dev == "cuda":
        profile(f_rt, f_rt_graph, b_rt)
    check_memory(plan, q, k, v, dout, dev)
    REPORT["_eff_plan"] = (plan, res)


def profile(*fns) -> None:
    """The CUDA time of one runtime forward and backward by kernel (torch.profiler), the top rows."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for fn in fns:
            fn()
        torch.cuda.synchronize()
    say("\n```\n" + p.key_averages().table(sort_by="self_cuda_time_total", row_limit=14)[-4000:] + "\n```")


def check_memory(plan, q, k, v, dout, dev: str) -> None:
    """Peak bytes allocated during the forward and the backward against the plan's stream peak."""
    if dev != "cuda":
        say("(peak memory: CUDA only)")
        return
    prog = plan.ir.program
    pred = {ph: memory.stream_peak(prog, ph, 0) for ph in (FWD, BWD)}
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
    nbytes = sum(t.numel() * t.element_size() for t in (q, k, v))
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = attnplan.execute(plan, qg, kg, vg)
    torch.cuda.synchronize()
    m_fwd = torch.cuda.max_memory_allocated() - before + nbytes  # the inputs are the home Q/KV buffers
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.autograd.grad(out, (qg, kg, vg), dout)
    torch.cuda.synchronize()
    saved = out.numel() * out.element_size() * 2 + out.shape[0] * out.shape[1] * 4  # out, dout, lse
    m_bwd = torch.cuda.max_memory_allocated() - before + nbytes + saved
    say("\n| phase | plan's buffer peak | measured peak | measured / plan |")
    say("|---|---|---|---|")
    for name, ph, m in (("forward", FWD, m_fwd), ("backward", BWD, m_bwd)):
        say(f"| {name} | {pred[ph].peak / 2**30:.2f} GiB | {m / 2**30:.2f} GiB | {m / pred[ph].peak:.2f} |")
    REPORT["memory"] = {"fwd_pred": pred[FWD].peak, "fwd_measured": m_fwd, "bwd_pred": pred[BWD].peak,
                        "bwd_measured": m_bwd}


def calibrated(dev: str):
    """``--profile FILE`` (``plan calibrate --device cuda``'s), else the h200 profile with this run's
    flash-attn rate (efficiency) and launch time, if measured."""
    if PROFILE_FILE:
        from attnplan.backends.cost import load_profile_file
        return load_profile_file(PROFILE_FILE)
    e = REPORT.get("efficiency", {})
    prof = get_profile("h200")
    if "flash_fwd_s" not in e:
        return None
    plan, _ = REPORT["_eff_plan"]
    rate = 4 * plan.problem.head_dim * int(plan.stats()["pairs"]) / e["flash_fwd_s"]
    q = torch.randn(64, 8, 64, device=dev, dtype=torch.bfloat16)
    L = varlen._Launch([varlen.Segment(0, 64, 0, 64, False, -1, 0)], dev, 64, 64)
    launch = timed(lambda: varlen._flash_fwd(q, q[:, :2], q[:, :2], L, 0.125), dev, 20)
    return dataclasses.replace(prof, name="h200-measured", efficiency=min(1.0, rate / prof.peak_flops),
                               launch_s=launch, bwd_factor=e["flash_bwd_s"] / e["flash_fwd_s"])


def serial_prediction(plan, prof) -> tuple[float, float]:
    """(forward, backward) seconds of every device's compute one after another (transfers free)."""
    free = dataclasses.replace(prof, intra_bw=1e18, inter_bw=1e18, intra_alpha=0.0, inter_alpha=0.0)
    sim = simulate(plan.ir, free)
    return tuple(float(np.sum(sim[name]["compute_s"])) for name in ("fwd", "bwd"))


@section("4. predicted vs measured time per program")
def check_predictions(dev: str, batches: str | None, quick: bool) -> None:
    lens = load_batch(batches, "lmsys-128k-0")
    lens = [x for x in lens if x < 1500][:30] if quick else lens
    H, Hkv, D = 32, 8, 128
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    T = sum(lens)
    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(T, H, D, device=dev, dtype=dt, generator=g)
    k = torch.randn(T, Hkv, D, device=dev, dtype=dt, generator=g)
    v = torch.randn(T, Hkv, D, device=dev, dtype=dt, generator=g)
    dout = torch.randn(T, H, D, device=dev, dtype=dt, generator=g)
    cal = calibrated(dev)
    if cal is not None:
        say(f"calibrated profile {cal.name!r}: efficiency {cal.efficiency:.2f} of 989 TFLOP/s, launch {cal.launch_s * 1e6:.0f} us, "
            f"backward / forward {cal.bwd_factor:.2f}")
    cases = [("minheap", 1, 131072)] + [(s, 8, 4096) for s in (STRATEGIES[:2] if quick else STRATEGIES)]
    say("| plan | devices | phase | predicted h200 | predicted calibrated | measured | measured / h200 | measured / calibrated |")
    say("|---|---|---|---|---|---|---|---|")
    rows = []
    for strat, n, block in cases:
        plan = attnplan.compile(lens, devices=n, heads=H, kv_heads=Hkv, head_dim=D, strategy=strat,
                                block_size=block, profile="h200", dtype="bfloat16")
        p_h = serial_prediction(plan, get_profile("h200"))
        p_c = serial_prediction(plan, cal) if cal is not None else (float("nan"),) * 2
        f, fg, b = runtime_closures(plan, q, k, v, dout)
        reps = 2 if quick else 5
        m_f = timed(f, dev, reps)
        fg(); sync(dev)
        m_b = timed(b, dev, reps)
        for ph, m, ph_h, ph_c in (("fwd", m_f, p_h[0], p_c[0]), ("bwd", m_b, p_h[1], p_c[1])):
            rows.append(dict(strategy=strat, devices=n, phase=ph, pred_h200=ph_h, pred_cal=ph_c, measured=m))
            say(f"| {strat} | {n} | {ph} | {ph_h * 1e3:.2f} ms | {ph_c * 1e3:.2f} ms | {m * 1e3:.2f} ms | "
                f"{m / ph_h:.2f} | {m / ph_c:.2f} |")
    REPORT["predictions"] = rows


# 6. Hugging Face --------------------------------------------------------------------------------

@section("6. examples/hf_train.py --device cuda --check")
def check_hf(dev: str) -> None:
    if dev != "cuda":
        say("(CUDA only)")
        return
    cmd = [sys.executable, os.path.join(HERE, "..", "examples", "hf_train.py"), "--device", "cuda", "--check",
           "--steps", "5"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    say("```\n" + (r.stdout + r.stderr)[-3000:] + "\n```")
    say(f"exit code {r.returncode}")
    REPORT["hf"] = {"rc": r.returncode, "tail": (r.stdout + r.stderr)[-1500:]}


# 7. ChunkFlow's chunks ---------------------------------------------------------------------------

@section("7. ChunkFlow chunks: a later chunk's cross-attention plan against dense attention")
def check_chunks(dev: str, quick: bool) -> None:
    """Every micro-batch of a ``chunkflow`` step plan whose documents were cut — a later chunk attends to
    every earlier key of its document — run on ``dev`` (its attention plan on 2 virtual devices), forward and
    backward, against dense causal attention of the document's rows in float64."""
    from attnplan.runtime.executor import execute
    from attnplan.step import Mesh, Model, compile_step, make_problem
    lens = [1500, 300, 200] if quick else [9000, 3000, 700, 300]
    model = Model("chunk-check", 2, 512, 8, 2, 64, 1024, 256)
    c = compile_step(make_problem(lens, model=model, mesh=Mesh(1, 2), block_size=256),
                     "chunkflow{chunk=1024}" if quick else "chunkflow{chunk=2048}")
    plan = c.plan
    say(f"{len(lens)} documents {lens}, chunk {plan.info_dict()['chunk']}, {plan.n_mb} micro-batches, "
        f"{sum(plan.mb_prefix(m) > 0 for m in range(plan.n_mb))} of them later chunks")
    g = torch.Generator().manual_seed(0)
    docs = {d: [torch.randn(n, h, 64, generator=g, dtype=torch.float64) for h in (8, 2, 2)]
            for d, n in enumerate(lens)}
    worst: dict[str, float] = {}
    ptr = plan.mb_ptr()
    for m, low in enumerate(c.lowered):
        prefix = plan.mb_prefix(m)
        if not prefix:
            continue
        f = int(ptr[m])
        d, a, e = int(plan.frag_doc[f]), int(plan.frag_start[f]), int(plan.frag_end[f])
        for dt in ("bfloat16", "float32"):
            tdt = getattr(torch, dt)
            q = docs[d][0][a:e].to(dev, tdt).requires_grad_(True)
            k, v = (docs[d][i][:e].to(dev, tdt).requires_grad_(True) for i in (1, 2))
            out = execute(low.ir, q, k, v)
            dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
            out.backward(dout.to(dev, tdt))
            qd, kd, vd = (docs[d][i][:e].clone().requires_grad_(True) for i in range(3))
            ref = _dense_rows(qd, kd, vd)[a:e]
            ref.backward(dout)
            for name, got, want in (("out", out, ref), ("dq", q.grad, qd.grad[a:e]), ("dk", k.grad, kd.grad),
                                    ("dv", v.grad, vd.grad)):
                want = want.detach()
                err = float((got.detach().double().cpu() - want).abs().max() / want.abs().max().clamp_min(1e-30))
                worst[f"{dt} {name}"] = max(worst.get(f"{dt} {name}", 0.0), err)
    tol = {"bfloat16": 4e-2, "float32": 1e-5}
    bad = {k: v for k, v in worst.items() if v > tol[k.split()[0]]}
    say("worst relative errors: " + ", ".join(f"{k} {v:.1e}" for k, v in sorted(worst.items()))
        + (f"; OVER TOLERANCE: {bad}" if bad else "; all within tolerance (bf16 4e-2, fp32 1e-5)"))
    REPORT["chunks"] = {"worst": worst, "failures": len(bad)}
    if bad:
        REPORT.setdefault("failed", []).append("7. chunks")


def _dense_rows(q, k, v):
    """Dense causal attention over one document (GQA by repeating the KV heads), float64."""
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q, kk) / q.shape[-1] ** 0.5
    n = q.shape[0]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--batches", help="batches.jsonl (default: .device/ or ../shared/workloads/)")
    ap.add_argument("--quick", action="store_true", help="small cases (a CPU dry run)")
    ap.add_argument("--only", default="1234567", help="sections to run, e.g. 35")
    ap.add_argument("--profile", help="the calibrated profile of section 4 (plan calibrate --device cuda's JSON)")
    ap.add_argument("--strategies", default="", help="section 2: only these strategies (comma-separated)")
    a = ap.parse_args(argv)
    global PROFILE_FILE
    PROFILE_FILE = a.profile
    t0 = time.perf_counter()
    say(f"# attnplan GPU check ({time.strftime('%Y-%m-%d')})")
    if "1" in a.only:
        check_kernels(a.device)
    if "2" in a.only:
        check_equality(a.device, a.quick, a.strategies)
    if "3" in a.only:
        check_efficiency(a.device, a.batches, a.quick)
    if "4" in a.only:
        check_predictions(a.device, a.batches, a.quick)
    if "6" in a.only:
        check_hf(a.device)
    if "7" in a.only:
        check_chunks(a.device, a.quick)
    say(f"\nkernel notes: {varlen.NOTES or 'none'}; total {time.perf_counter() - t0:.0f} s")
    REPORT.pop("_eff_plan", None)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "gpu_check.md"), "w") as f:
        f.write("\n".join(LINES) + "\n")
    with open(os.path.join(a.out, "gpu_check.json"), "w") as f:
        json.dump(REPORT, f, indent=1, default=str)
    return 1 if REPORT.get("failed") or REPORT.get("equality", {}).get("failures") else 0


if __name__ == "__main__":
    sys.exit(main())
