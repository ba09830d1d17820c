"""Distributed runtime benchmark: forward+backward wall time of each strategy's
plan on 2 gloo processes (one intra-op thread each) against single-process
dense masked attention over the same batch, how much transfer time compute
hides, and the runtime's own overhead.

    .venv/bin/python benchmarks/runtime_bench.py                       # libra-128k-0 cut to 16K tokens
    .venv/bin/python benchmarks/runtime_bench.py --repeats 5 --json out/runtime_bench.json
    .venv/bin/python benchmarks/runtime_bench.py --check-workloads     # plan run --procs 2 --check, every
                                                                       # strategy x every shared batch cut

Batch: a shared workload cut to at most 16384 tokens (:func:`cut`: lengths
clipped to 8192, then the longest prefix that fits; default libra-128k-0: 18
documents, 15,679 tokens, longest 5,353, median 302). 8 query / 2 kv heads, head dim 64, bfloat16, block 1024.

Definitions (per repeat, on the rank with the most kernel time; medians over
repeats):

* step: wall seconds of ``attnplan.attention`` forward + ``autograd.grad``
  on the slowest rank;
* kernel: seconds in attention kernels, merges and adds;
* wait: seconds blocked in ``wait`` (transfer time not hidden, plus waiting
  for a slower peer); post: seconds posting transfers (packing copies, launch);
* comm alone: the same streams replayed with every kernel skipped
  (``runtime.dist.replay_comm``): the plan's transfer time with nothing to hide it;
* hidden = 1 - wait / comm alone (clamped at 0): the share of transfer time
  overlapped with compute;
* overhead = (step - kernel - wait - post) / step: the runtime's own Python
  and bookkeeping time;
* dense 1t / 2t: one process, per sample ``F.scaled_dot_product_attention``
  (``is_causal`` for the causal mask, else the sample's dense additive mask,
  built before timing), forward + backward, with 1 and 2 intra-op threads.

Wall times on these shared 2-core machines vary about 2x run to run:
compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ROOT.parent / "shared" / "workloads" / "batches.jsonl"
BUDGET = 16384
MAX_DOC = 8192


def cut(seqlens, budget: int = BUDGET, longest: int = MAX_DOC) -> list[int]:
    """The cut rule: every length clipped to ``longest`` (8192, the dense
    check's per-sample limit), then the longest prefix whose sum is at most
    ``budget`` (16384). Never empty; keeps the batch's order and tail."""
    out, total = [], 0
    for n in seqlens:
        n = min(int(n), longest)
        if total + n > budget:
            break
        out.append(n)
        total += n
    return out


def load_batches(path=WORKLOADS) -> dict:
    with open(path) as f:
        return {b["name"]: b for b in map(json.loads, filter(str.strip, f))}


# ------------------------------------------------------------------ rank side

def rank_worker(rank, world, blobs, dtype, repeats, timeout):
    """Runs on every rank: warm-up, then ``repeats`` timed steps and
    ``repeats`` communication-only replays of every plan."""
    import torch
    import torch.distributed as dist

    import attnplan
    from attnplan.runtime import dist as rt
    from attnplan.runtime.check import random_inputs
    from attnplan.runtime.runner import Timings

    out = {}
    for name, blob in blobs:
        plan = attnplan.Plan.from_bytes(blob)
        q, k, v, dout = random_inputs(plan, dtype, 0)
        ql, kl, vl = (plan.dispatch(t).requires_grad_(True) for t in (q, k, v))
        dl = plan.dispatch(dout)
        reps = []
        for i in range(repeats + 1):
            dist.barrier()
            tm = Timings()
            t0 = time.perf_counter()
            o = attnplan.attention(ql, kl, vl, plan, timeout=timeout, timings=tm)
            torch.autograd.grad(o, (ql, kl, vl), dl)
            step = time.perf_counter() - t0
            if i:  # the first run is a warm-up
                reps.append(dict(tm.as_dict(), step_s=step))
        comm = []
        for _ in range(repeats):
            dist.barrier()
            r = rt.replay_comm(plan.ir, ql.detach(), kl.detach(), vl.detach(), timeout=timeout)
            comm.append(r["fwd"] + r["bwd"])
        out[name] = {"reps": reps, "comm": comm}
    return out


# ------------------------------------------------------------------ single-process baseline

def dense_baseline(plan, dtype: str, repeats: int, threads: int) -> float:
    """Median seconds of per-sample dense masked SDPA, forward + backward."""
    import torch
    import torch.nn.functional as F

    from attnplan.ir.mask import K0, Q0
    from attnplan.runtime.check import random_inputs
    from attnplan.runtime.reference import dense_allowed
    p = plan.problem
    q, k, v, dout = random_inputs(plan, dtype, 0)
    off, P = p.offsets, p.pieces.a
    causal = p.mask.strip() == "causal"
    masks = []
    for i in range(len(p.seqlens)):
        a, b = int(off[i]), int(off[i + 1])
        if causal:
            masks.append(None)
            continue
        sel = P[(P[:, Q0] >= a) & (P[:, Q0] < b) & (P[:, K0] >= a) & (P[:, K0] < b)].copy()
        sel[:, :4] -= a
        allowed = torch.from_numpy(dense_allowed(sel, b - a))
        masks.append(torch.zeros(allowed.shape, dtype=q.dtype).masked_fill_(~allowed, float("-inf")))
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    times = []
    try:
        for i in range(repeats + 1):
            qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
            t0 = time.perf_counter()
            outs = []
            for s in range(len(p.seqlens)):
                a, b = int(off[s]), int(off[s + 1])
                x = [t[a:b].transpose(0, 1).unsqueeze(0) for t in (qg, kg, vg)]
                o = F.scaled_dot_product_attention(*x, attn_mask=masks[s], is_causal=causal, enable_gqa=True)
                outs.append(o[0].transpose(0, 1))
            out = torch.cat(outs)
            torch.autograd.grad(out, (qg, kg, vg), dout)
            if i:
                times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(old)
    return statistics.median(times)


# ------------------------------------------------------------------ driver

def summarize(res: dict, repeats: int) -> dict:
    """Per-repeat metrics on the rank with the most kernel time; medians."""
    ranks = list(res)
    kern = [statistics.median(r["kernel_s"] for r in res[x]["reps"]) for x in ranks]
    s = res[ranks[int(np.argmax(kern))]]
    step = [max(res[x]["reps"][i]["step_s"] for x in ranks) for i in range(repeats)]
    med = {key: statistics.median(r[key] for r in s["reps"]) for key in ("kernel_s", "wait_s", "post_s", "step_s")}
    comm = statistics.median(s["comm"])
    over = [(r["step_s"] - r["kernel_s"] - r["wait_s"] - r["post_s"]) / r["step_s"] for r in s["reps"]]
    return {"step_s": statistics.median(step), "kernel_s": med["kernel_s"], "wait_s": med["wait_s"],
            "post_s": med["post_s"], "comm_alone_s": comm,
            "hidden": max(0.0, 1.0 - med["wait_s"] / comm) if comm > 0 else 1.0,
            "overhead": statistics.median(over),
            "bytes": sum(res[x]["reps"][0]["bytes_sent"] for x in ranks)}


def bench(args) -> dict:
    import torch

    import attnplan
    from attnplan.tools.launch import run_local
    torch.set_num_threads(1)
    batch = load_batches()[args.batch]
    lens = cut(batch["seqlens"])
    strategies = args.strategies.split(",") if args.strategies else list(attnplan.strategies())
    print(f"batch {args.batch} cut to {len(lens)} samples, {sum(lens)} tokens (longest {max(lens)}, median "
          f"{int(np.median(lens))}); 2 gloo processes x 1 thread; heads 8/2 x 64, {args.dtype}, block "
          f"{args.block_size}; medians of {args.repeats}")
    report = {"batch": args.batch, "seqlens": lens, "dtype": args.dtype, "block_size": args.block_size,
              "repeats": args.repeats, "masks": {}}
    for mask in args.masks:
        plans, skipped = {}, {}
        for s in strategies:
            try:
                plans[s] = attnplan.compile(seqlens=lens, mask=mask, devices=2, heads=8, kv_heads=2, head_dim=64,
                                            block_size=args.block_size, strategy=s, dtype=args.dtype)
            except attnplan.AttnplanError as e:
                skipped[s] = str(e).splitlines()[0]
        any_plan = next(iter(plans.values()))
        d1 = dense_baseline(any_plan, args.dtype, args.repeats, 1)
        d2 = dense_baseline(any_plan, args.dtype, args.repeats, 2)
        t0 = time.perf_counter()
        res = run_local(f"{os.path.abspath(__file__)}:rank_worker", 2,
                        ([(s, p.to_bytes()) for s, p in plans.items()], args.dtype, args.repeats, args.timeout),
                        timeout=args.timeout * 4)
        for r, x in enumerate(res):
            if x[0] != "ok":
                raise SystemExit(f"rank {r} failed: {x}")
        rows = {}
        for s, p in plans.items():
            per = {r: res[r][1][s] for r in range(2)}
            m = summarize(per, args.repeats)
            st = p.stats("cpu-local")
            # messages per step (fwd + bwd, all devices); a runtime before coalescing (attnplan <= 3718725)
            # sent one message per transfer and its stats() had no "messages"
            m.update(messages=int(st.get("messages", len(p.ir.program.transfers))),
                     compute_imbalance=st["compute_imbalance"], predicted_cpu_local_s=st["predicted_s"],
                     vs_dense_1t=d1 / m["step_s"], vs_dense_2t=d2 / m["step_s"])
            rows[s] = m
        report["masks"][mask] = {"dense_1t_s": d1, "dense_2t_s": d2, "strategies": rows, "skipped": skipped,
                                 "bench_wall_s": time.perf_counter() - t0}
        print(f"\nmask {mask}: dense 1 thread {d1:.3f} s, dense 2 threads {d2:.3f} s")
        print(f"{'strategy':<11} {'step s':>7} {'vs 1t':>6} {'vs 2t':>6} {'imb':>5} {'kernel':>7} {'wait':>6} "
              f"{'post':>6} {'comm':>6} {'hidden':>7} {'overhd':>7} {'MB':>6} {'msgs':>6}")
        for s, m in rows.items():
            print(f"{s:<11} {m['step_s']:7.3f} {m['vs_dense_1t']:6.2f} {m['vs_dense_2t']:6.2f} "
                  f"{m['compute_imbalance']:5.2f} {m['kernel_s']:7.3f} {m['wait_s']:6.3f} {m['post_s']:6.3f} "
                  f"{m['comm_alone_s']:6.3f} {m['hidden'] * 100:6.1f}% {m['overhead'] * 100:6.1f}% "
                  f"{m['bytes'] / 1e6:6.1f} {m['messages']:6d}")
        for s, e in skipped.items():
            print(f"{s:<11} skipped: {e}")
    return report


def check_workloads(args) -> int:
    """``plan run PLAN --procs 2 --check`` for every registered strategy on every
    shared batch cut by :func:`cut`, 2 query / 1 kv heads x 32 by default
    (``--check-heads``; small for the dense float64 check), block 1024, float32."""
    import attnplan
    strategies = args.strategies.split(",") if args.strategies else list(attnplan.strategies())
    batches = load_batches()
    names = args.names.split(",") if args.names else list(batches)
    plan_bin = str(Path(sys.executable).with_name("plan"))
    heads, kv_heads = (int(x) for x in args.check_heads.split(","))
    fails, rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            lens = cut(batches[name]["seqlens"])
            for s in strategies:
                path = os.path.join(tmp, f"{name}-{s}.plan")
                try:
                    attnplan.compile(seqlens=lens, mask=args.check_mask, devices=2, heads=heads, kv_heads=kv_heads,
                                     head_dim=32, block_size=1024, strategy=s, dtype="float32").save(path)
                except attnplan.AttnplanError as e:
                    rows.append((name, s, f"not compiled: {str(e).splitlines()[0]}"))
                    continue
                t0 = time.perf_counter()
                p = subprocess.run([plan_bin, "run", path, "--procs", "2", "--check", "--timeout", "300"],
                                   capture_output=True, text=True)
                last = (p.stdout.strip().splitlines() or [""])[-1]
                err = (p.stderr.strip().splitlines() or [last])[-1]
                verdict = last if p.returncode == 0 else f"exit {p.returncode}: {err}"
                rows.append((name, s, f"{verdict} ({time.perf_counter() - t0:.0f} s)"))
                print(f"{name:<20} {s:<11} {rows[-1][2]}", flush=True)
                if p.returncode != 0:
                    fails.append((name, s))
    print(f"\n{len([r for r in rows if 'PASS' in r[2]])} passed, {len(fails)} failed, "
          f"{len([r for r in rows if 'skipped' in r[2] or 'not compiled' in r[2]])} skipped")
    for r in rows:
        if "PASS" not in r[2]:
            print(f"  {r[0]:<20} {r[1]:<11} {r[2]}")
    return 1 if fails else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="libra-128k-0")
    ap.add_argument("--masks", nargs="+", default=["causal", "shared_question(4, 0.2)"])
    ap.add_argument("--strategies", default=None, help="comma-separated (default: every registered one)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--block-size", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--check-workloads", action="store_true")
    ap.add_argument("--check-mask", default="causal")
    ap.add_argument("--check-heads", default="2,1", help="with --check-workloads: query,kv heads (ulysses needs "
                                                         "kv heads >= devices: use 4,2)")
    ap.add_argument("--names", default=None, help="with --check-workloads: comma-separated batch names")
    args = ap.parse_args(argv)
    if args.check_workloads:
        return check_workloads(args)
    report = bench(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
