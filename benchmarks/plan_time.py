"""Plan time and plan quality of the compiler over the shared workloads.

For each batch of ``batches.jsonl`` and each device count: compile (median of
``--repeats`` wall times, verifier on), then report compute/token imbalance,
communication, predicted time over the lower bound, plan-file size. A
1,048,576-token batch (two 512K batches packed together) checks that
planning a million tokens takes seconds.

    .venv/bin/python benchmarks/plan_time.py [--batches ../shared/workloads/batches.jsonl]
        [--devices 8,32,64] [--block-size 2048] [--repeats 3] [--json out/plan_time.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import attnplan

ROOT = Path(__file__).resolve().parent.parent


def measure(seqlens, devices, args):
    times, plan = [], None
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        plan = attnplan.compile(seqlens=seqlens, mask=args.mask, devices=devices, nodes=max(1, devices // 8),
                                heads=8, kv_heads=2, head_dim=128, strategy=args.strategy,
                                block_size=args.block_size)
        times.append(time.perf_counter() - t0)
    s = plan.stats()
    return {"plan_s": statistics.median(times), "compute_imbalance": s["compute_imbalance"],
            "token_imbalance": s["token_imbalance"], "comm_gb": s["comm_bytes_total"] / 1e9,
            "pred_over_lb": s["predicted_over_lower_bound"], "plan_mb": len(plan.to_bytes()) / 1e6,
            "compute_blocks": s["compute_blocks"], "instructions": s["instructions"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default=str(ROOT.parent / "shared" / "workloads" / "batches.jsonl"))
    ap.add_argument("--devices", default="8,32,64")
    ap.add_argument("--block-size", type=int, default=2048)
    ap.add_argument("--mask", default="causal")
    ap.add_argument("--strategy", default="zigzag")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    batches = [json.loads(line) for line in Path(args.batches).read_text().splitlines() if line.strip()]
    big = {"name": "packed-1m", "seqlens": batches_by(batches, "lmsys-512k-0") + batches_by(batches, "libra-512k-0")}
    rows = []
    print(f"{'batch':<20} {'dev':>4} {'plan s':>7} {'comp imb':>8} {'tok imb':>7} {'comm GB':>8} "
          f"{'pred/LB':>8} {'plan MB':>7} {'blocks':>7}", flush=True)
    for b in batches + [big]:
        for n in map(int, args.devices.split(",")):
            r = {"batch": b["name"], "tokens": sum(b["seqlens"]), "devices": n, **measure(b["seqlens"], n, args)}
            rows.append(r)
            print(f"{r['batch']:<20} {n:>4} {r['plan_s']:>7.3f} {r['compute_imbalance']:>8.2f} "
                  f"{r['token_imbalance']:>7.3f} {r['comm_gb']:>8.2f} {r['pred_over_lb']:>8.2f} "
                  f"{r['plan_mb']:>7.2f} {r['compute_blocks']:>7}", flush=True)
    for n in map(int, args.devices.split(",")):
        imb = [r["compute_imbalance"] for r in rows if r["devices"] == n and r["batch"] != "packed-1m"]
        print(f"{args.strategy} at {n} devices: compute imbalance median {statistics.median(imb):.2f}, "
              f"worst {max(imb):.2f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def batches_by(batches, name):
    return next(b["seqlens"] for b in batches if b["name"] == name)


if __name__ == "__main__":
    sys.exit(main())
