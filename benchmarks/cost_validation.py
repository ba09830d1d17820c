"""Cost model vs measurement: every strategy's predicted forward + backward
time (the simulator with this machine's calibrated profile) against the
measured step on 2 gloo processes, on the runtime benchmark's batches.

    .venv/bin/python benchmarks/cost_validation.py                          # calibrate, then run
    .venv/bin/python benchmarks/cost_validation.py --profile cpu.json       # a profile from `plan calibrate`
    .venv/bin/python benchmarks/cost_validation.py --repeats 5 --json out/cost_validation.json

Batch and shapes as ``benchmarks/runtime_bench.py``: a shared workload cut to
16K tokens (default libra-128k-0: 18 documents, 15,679 tokens), masks causal
and shared_question(4, 0.2), 8 query / 2 kv heads x 64, bfloat16, block 1024,
2 devices; every registered strategy (ulysses only where devices <= kv heads:
a strategy that does not compile is listed as skipped).

Predicted: :func:`attnplan.backends.cost.simulate` of the compiled plan with
the profile (forward makespan + backward makespan). Measured: the plans run
by :func:`attnplan.tools.launch.run_local` on 2 processes x 1 thread (gloo),
each repeat ``attnplan.attention`` forward then ``autograd.grad`` on every
rank after a barrier; step = the slowest rank's forward + backward, fwd and
bwd = the slowest rank's forward and backward; the plans are run round-robin
(load drift hits every strategy alike), one warm-up round, medians of
``--repeats``. ratio = predicted / measured. Summary: Spearman's rank
correlation between predicted and measured steps over all cases, median and
largest |log ratio|, and the share of cases within 25%.

Wall times on these shared 2-core machines vary about 2x run to run; the
load average is printed with the results.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import runtime_bench as rb  # noqa: E402  (the runtime benchmark's batch and cut)

MASKS = ["causal", "shared_question(4, 0.2)"]
SHAPE = dict(devices=2, heads=8, kv_heads=2, head_dim=64)


# ------------------------------------------------------------------ rank side

def rank_worker(rank, world, blobs, dtype, repeats, timeout):
    """Every rank: one warm-up round, then ``repeats`` rounds over all plans in
    turn; per plan and round this rank's forward and backward seconds, its
    kernel seconds in each (attention kernels, merges, adds: runtime Timings)
    and the CPU seconds of its main thread over both (kernels and the
    runner's own work; not blocked waits, nor time other processes took)."""
    import torch
    import torch.distributed as dist

    import attnplan
    from attnplan.runtime.check import random_inputs
    from attnplan.runtime.runner import Timings

    cases = []
    for key, blob in blobs:
        plan = attnplan.Plan.from_bytes(blob)
        q, k, v, dout = random_inputs(plan, dtype, 0)
        ql, kl, vl = (plan.dispatch(t).requires_grad_(True) for t in (q, k, v))
        cases.append((key, plan, ql, kl, vl, plan.dispatch(dout)))
    out: dict = {key: [] for key, *_ in cases}
    for i in range(repeats + 1):
        for key, plan, ql, kl, vl, dl in cases:
            dist.barrier()
            tm = Timings()
            t0, c0 = time.perf_counter(), time.thread_time()
            o = attnplan.attention(ql, kl, vl, plan, timeout=timeout, timings=tm)
            t1 = time.perf_counter()
            kf = tm.kernel
            torch.autograd.grad(o, (ql, kl, vl), dl)
            t2, c2 = time.perf_counter(), time.thread_time()
            if i:  # the first round is a warm-up
                out[key].append((t1 - t0, t2 - t1, kf, tm.kernel - kf, c2 - c0))
    return out


# ------------------------------------------------------------------ driver

def spearman(a, b) -> float:
    """Spearman's rank correlation (ties get their average rank); nan for fewer than 3 cases."""
    from scipy.stats import spearmanr
    if len(a) < 3:
        return math.nan
    return float(spearmanr(a, b).statistic)


def get_profile(args):
    """(Profile, its JSON dict): the given --profile file, else a fresh calibration."""
    from attnplan.backends.cost import load_profile_file, profile_from_dict
    from attnplan.runtime.calibrate import calibrate
    if args.profile:
        return load_profile_file(args.profile), json.loads(Path(args.profile).read_text())
    t0 = time.perf_counter()
    data = calibrate(args.calibrate_repeats)
    print(f"calibrated in {time.perf_counter() - t0:.0f} s", flush=True)
    if args.save_profile:
        Path(args.save_profile).parent.mkdir(parents=True, exist_ok=True)
        Path(args.save_profile).write_text(json.dumps(data, indent=1) + "\n")
    return profile_from_dict(data, "calibrate"), data


def summary(rows: list, pred: str = "predicted_s", meas: str = "measured_s") -> dict:
    """Over ``rows``: Spearman's rank correlation of ``pred`` and ``meas``,
    median and largest |log(pred / meas)|, cases within 25% of ``meas``."""
    p = [r[pred] for r in rows]
    m = [r[meas] for r in rows]
    logr = [abs(math.log(a / b)) for a, b in zip(p, m)]
    err = [abs(a - b) / b for a, b in zip(p, m)]
    return {"cases": len(rows), "spearman": spearman(p, m),
            "median_abs_log_ratio": statistics.median(logr) if logr else math.nan,
            "max_abs_log_ratio": max(logr) if logr else math.nan,
            "within_25pct": sum(e <= 0.25 for e in err), "max_rel_error": max(err) if err else math.nan}


def call_model_compute(ir, per_call: dict, head_dim: int) -> float:
    """Compute seconds of the busiest device, forward + backward, with the
    calibration's per-call model (``fit.kernel.per_call``): every compute
    block lowered to the op calls the runtime makes (runtime.kernels.plan_tile),
    each call costed by its rows, keys, heads and pairs."""
    from attnplan.runtime.calibrate import call_seconds, causal_pairs
    from attnplan.runtime.kernels import CAUSAL, RCAUSAL, plan_tile
    g, pl = ir.graph, ir.placement
    group = g.problem.heads // g.problem.kv_heads
    coef = np.add(per_call["fwd"], per_call["bwd"])
    per_dev = np.zeros(pl.devices)
    for c in range(g.n_cb):
        t = int(g.cb_tile[c])
        qb, kb = int(g.tile_q[t]), int(g.tile_k[t])
        heads = int(g.hg_end[g.cb_hg[c]] - g.hg_start[g.cb_hg[c]]) * group
        for call in plan_tile(int(g.tb_start[qb]), int(g.tb_start[kb]), int(g.tb_len[qb]), int(g.tb_len[kb]),
                              g.tile_pieces(t)):
            m, n = call.r1 - call.r0, call.c1 - call.c0
            pairs = causal_pairs(m, n) if call.kind in (CAUSAL, RCAUSAL) else m * n  # MASK computes its rectangle
            per_dev[int(pl.cb_device[c])] += call_seconds(coef, m, n, heads, pairs, head_dim)
    return float(per_dev.max())


def validate(args) -> dict:
    import attnplan
    from attnplan.backends.cost import PROFILES, simulate
    from attnplan.tools.launch import run_local

    prof, prof_data = get_profile(args)
    batch = rb.load_batches()[args.batch]
    lens = rb.cut(batch["seqlens"])
    strategies = args.strategies.split(",") if args.strategies else list(attnplan.strategies())
    plans, skipped = {}, {}
    for mask in args.masks:
        for s in strategies:
            try:
                plans[(mask, s)] = attnplan.compile(seqlens=lens, mask=mask, block_size=args.block_size, strategy=s,
                                                    dtype=args.dtype, **SHAPE)
            except attnplan.AttnplanError as e:
                skipped[f"{mask} / {s}"] = str(e).splitlines()[0]
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    blobs = [(f"{m}|{s}", p.to_bytes()) for (m, s), p in plans.items()]
    res = run_local(f"{os.path.abspath(__file__)}:rank_worker", 2, (blobs, args.dtype, args.repeats, args.timeout),
                    timeout=args.timeout * 4)
    for r, x in enumerate(res):
        if x[0] != "ok":
            raise SystemExit(f"rank {r} failed: {x}")
    wall = time.perf_counter() - t0
    load1 = os.getloadavg()
    rows = []
    for (mask, s), p in plans.items():
        key = f"{mask}|{s}"
        per = [res[r][1][key] for r in range(2)]
        fwd = [max(x[i][0] for x in per) for i in range(args.repeats)]
        bwd = [max(x[i][1] for x in per) for i in range(args.repeats)]
        step = [max(x[i][0] + x[i][1] for x in per) for i in range(args.repeats)]
        kfwd = [max(x[i][2] for x in per) for i in range(args.repeats)]
        kbwd = [max(x[i][3] for x in per) for i in range(args.repeats)]
        cpu = [max(x[i][4] for x in per) for i in range(args.repeats)]
        sim = simulate(p.ir, prof)
        per_call = prof_data.get("fit", {}).get("kernel", {}).get("per_call")
        base = simulate(p.ir, PROFILES["cpu-local"])
        rows.append({"mask": mask, "strategy": s,
                     "predicted_fwd_s": sim["fwd"]["makespan_s"], "predicted_bwd_s": sim["bwd"]["makespan_s"],
                     "predicted_s": sim["predicted_s"], "measured_fwd_s": statistics.median(fwd),
                     "measured_bwd_s": statistics.median(bwd), "measured_s": statistics.median(step),
                     "ratio": sim["predicted_s"] / statistics.median(step),
                     "cpu_local_predicted_s": base["predicted_s"],
                     "predicted_compute_s": max(f + b for f, b in zip(sim["fwd"]["compute_s"],
                                                                       sim["bwd"]["compute_s"])),
                     "predicted_compute_fwd_s": max(sim["fwd"]["compute_s"]),
                     "predicted_compute_bwd_s": max(sim["bwd"]["compute_s"]),
                     "measured_kernel_fwd_s": statistics.median(kfwd),
                     "measured_kernel_bwd_s": statistics.median(kbwd),
                     "measured_cpu_s": statistics.median(cpu),
                     "call_model_compute_s": (call_model_compute(p.ir, per_call, SHAPE["head_dim"])
                                              if per_call else math.nan),
                     "messages": int(len(p.ir.program.transfers)), "compute_blocks": int(p.ir.graph.n_cb)})
    report = {"batch": args.batch, "seqlens": lens, "dtype": args.dtype, "block_size": args.block_size,
              "repeats": args.repeats, "shape": SHAPE, "profile": prof_data, "rows": rows, "skipped": skipped,
              "summary": summary(rows), "summary_cpu_local": summary(rows, "cpu_local_predicted_s"),
              "summary_compute_vs_cpu": summary(rows, "predicted_compute_s", "measured_cpu_s"),
              "summary_call_model_vs_cpu": summary(rows, "call_model_compute_s", "measured_cpu_s"),
              "per_mask": {m: summary([r for r in rows if r["mask"] == m]) for m in args.masks},
              "loadavg": [load0, load1], "run_wall_s": wall}
    return report


def show(rep: dict) -> None:
    p = rep["profile"]
    print(f"batch {rep['batch']} cut to {len(rep['seqlens'])} samples, {sum(rep['seqlens'])} tokens; 2 gloo processes "
          f"x 1 thread; heads 8/2 x 64, {rep['dtype']}, block {rep['block_size']}; medians of {rep['repeats']}; "
          f"load average {rep['loadavg'][0][0]:.2f} before, {rep['loadavg'][1][0]:.2f} after")
    print(f"profile {p['name']}: kernel {p['peak_flops'] * p['efficiency'] / 1e9:.1f} GFLOP/s, launch "
          f"{p['launch_s'] * 1e6:.0f} us, tile_q {p['tile_q']}, bwd_factor {p['bwd_factor']:.2f}, gloo "
          f"{p['intra_bw'] / 1e9:.2f} GB/s + {p['intra_alpha'] * 1e6:.0f} us, mem_bw {p['mem_bw'] / 1e9:.2f} GB/s")
    print(f"\n{'mask':<24} {'strategy':<11} {'pred fwd':>8} {'bwd':>6} {'total':>6}  {'meas fwd':>8} {'bwd':>6} "
          f"{'total':>6}  {'ratio':>5}  {'compute':>7} {'cpu':>6} {'ratio':>5}  {'per-call':>8} {'ratio':>5}  "
          f"{'cpu-local':>9}")
    for r in rep["rows"]:
        print(f"{r['mask']:<24} {r['strategy']:<11} {r['predicted_fwd_s']:8.3f} {r['predicted_bwd_s']:6.3f} "
              f"{r['predicted_s']:6.3f}  {r['measured_fwd_s']:8.3f} {r['measured_bwd_s']:6.3f} "
              f"{r['measured_s']:6.3f}  {r['ratio']:5.2f}  "
              f"{r['predicted_compute_s']:7.3f} {r['measured_cpu_s']:6.3f} "
              f"{r['predicted_compute_s'] / r['measured_cpu_s']:5.2f}  "
              f"{r['call_model_compute_s']:8.3f} {r['call_model_compute_s'] / r['measured_cpu_s']:5.2f}  "
              f"{r['cpu_local_predicted_s'] / r['measured_s']:9.2f}")
    print("ratio = predicted / measured step (wall, slowest rank); compute = the simulator's compute seconds of the "
          "busiest device (fwd + bwd), cpu = CPU seconds of the busiest rank's main thread (fwd + bwd; load does not "
          "inflate either), ratio = compute / cpu; per-call = the same compute with the calibration's per-call "
          "kernel model (every op call the runtime makes), ratio = per-call / cpu; cpu-local = predicted / measured "
          "with the builtin cpu-local profile")
    for k, e in rep["skipped"].items():
        print(f"{k}: skipped ({e})")
    parts = [("all", rep["summary"]), *rep["per_mask"].items(), ("compute vs cpu", rep["summary_compute_vs_cpu"]),
             ("per-call model vs cpu", rep["summary_call_model_vs_cpu"]),
             ("cpu-local profile", rep["summary_cpu_local"])]
    for name, s in parts:
        print(f"{name}: {s['cases']} cases, Spearman {s['spearman']:.2f}, median |log ratio| "
              f"{s['median_abs_log_ratio']:.3f}, max {s['max_abs_log_ratio']:.3f}, within 25%: "
              f"{s['within_25pct']}/{s['cases']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=None, help="a profile JSON from `plan calibrate` (default: calibrate now)")
    ap.add_argument("--save-profile", default=None, help="write the fresh calibration here")
    ap.add_argument("--calibrate-repeats", type=int, default=5)
    ap.add_argument("--batch", default="libra-128k-0")
    ap.add_argument("--masks", nargs="+", default=MASKS)
    ap.add_argument("--strategies", default=None, help="comma-separated (default: every registered one)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--block-size", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    rep = validate(args)
    show(rep)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rep, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
