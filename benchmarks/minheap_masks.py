"""``minheap`` on every builtin mask family (issue 9, item 5): worst compute
imbalance over the suite, token imbalance, chunk counts and plan time.

Every batch of ``batches.jsonl`` x every mask of ``MASKS`` (one realistic
parameter choice per builtin family, the strategies benchmark's where it has
one; ``causal_blockwise(256, 2)`` is the setting of the issue's 2.40) x 8
devices (1 node) and 32 devices (4 nodes x 8). For each case the minheap
placement decision (``MinHeap().chunks_per_device``, the part of the pass
that this item changes) is timed, and its compute imbalance is computed from
the chunk areas: compute runs where Q lives, so this is exactly the
``compute_imbalance`` of ``plan.stats()`` (``--check N`` compiles N cases in
full and asserts that). Then the full plan time (``attnplan.compile``,
verifier on, forward + backward programs; median of ``--repeats``) of the
131,072-token batch of the strategies benchmark at 4 x 8 for every mask.

    .venv/bin/python benchmarks/minheap_masks.py [--devices 8,32] [--masks causal,full]
        [--repeats 3] [--check 6] [--json out/minheap_masks.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import attnplan
from attnplan.frontend import load_mask, lower_batch
from attnplan.ir.module import PlanIR
from attnplan.ir.problem import Problem
from attnplan.passes.minheap import MinHeap, interval_pairs

ROOT = Path(__file__).resolve().parent.parent
SHAPE = dict(heads=8, kv_heads=2, head_dim=128)
MASKS = ("causal", "full", "sliding_window(4096)", "streaming(64,4096)", "shared_question(4,0.2)",
         "causal_blockwise(256,2)", "block_causal(1024)", "prefix_lm(1024)", "chunked_causal(8192)")
PLAN_TIME_BATCH = [65536, 16384, 8192, 8192] + [2048] * 8 + [1024] * 16


def decide(seqlens, mask, devices) -> dict:
    """Time minheap's placement decision on one batch; its compute and token imbalance."""
    lens = np.asarray(seqlens, np.int64)
    p = Problem(seqlens=lens, pieces=lower_batch(load_mask(mask), lens.tolist(), None), **SHAPE)
    ir = PlanIR(p, devices, max(1, devices // 8))
    t0 = time.perf_counter()
    k, bounds, dev = MinHeap().chunks_per_device(ir)
    dt = time.perf_counter() - t0
    areas = interval_pairs(p.pieces.a, bounds)
    work = np.bincount(dev, weights=areas, minlength=devices)
    tokens = np.bincount(dev, weights=np.diff(bounds), minlength=devices)
    return {"compute_imbalance": float(work.max() / work.mean()) if work.sum() else 1.0,
            "token_imbalance": float(tokens.max() / tokens.mean()), "chunks": len(bounds) - 1,
            "chunks_per_device": k, "min_chunk_tokens": int(np.diff(bounds).min()), "decide_s": dt}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default=str(ROOT.parent / "shared" / "workloads" / "batches.jsonl"))
    ap.add_argument("--devices", default="8,32")
    ap.add_argument("--masks", default=";".join(MASKS), help="semicolon-separated mask expressions")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--check", type=int, default=0, help="compile this many cases in full and compare stats")
    ap.add_argument("--json", default="out/minheap_masks.json")
    args = ap.parse_args(argv)
    batches = [json.loads(x) for x in Path(args.batches).read_text().splitlines() if x.strip()]
    devices = [int(x) for x in args.devices.split(",") if x]
    masks = [m for m in args.masks.split(";") if m]
    rows = []
    for mask in masks:
        for n in devices:
            for b in batches:
                rows.append({"mask": mask, "devices": n, "batch": b["name"], **decide(b["seqlens"], mask, n)})
            rs = [r for r in rows if r["mask"] == mask and r["devices"] == n]
            w = max(rs, key=lambda r: r["compute_imbalance"])
            print(f"{mask:<24} x{n:<3} worst {w['compute_imbalance']:.3f} ({w['batch']})", file=sys.stderr, flush=True)

    print(f"\nminheap on the {len(batches)} batches of {Path(args.batches).name}: compute imbalance (max/mean "
          f"forward FLOPs), token imbalance, chunks, decision time")
    print(f"{'mask':<24} {'dev':>3} {'worst comp':>10} {'batch':<18} {'median':>6} {'worst tok':>9} "
          f"{'max chunks':>10} {'min chunk':>9} {'decide med':>10} {'max':>7}")
    summary = []
    for mask in masks:
        for n in devices:
            rs = [r for r in rows if r["mask"] == mask and r["devices"] == n]
            w = max(rs, key=lambda r: r["compute_imbalance"])
            s = {"mask": mask, "devices": n, "worst": w["compute_imbalance"], "worst_batch": w["batch"],
                 "median": statistics.median(r["compute_imbalance"] for r in rs),
                 "worst_token": max(r["token_imbalance"] for r in rs), "max_chunks": max(r["chunks"] for r in rs),
                 "min_chunk": min(r["min_chunk_tokens"] for r in rs),
                 "decide_med": statistics.median(r["decide_s"] for r in rs),
                 "decide_max": max(r["decide_s"] for r in rs)}
            summary.append(s)
            print(f"{mask:<24} {n:>3} {s['worst']:>10.3f} {s['worst_batch']:<18} {s['median']:>6.3f} "
                  f"{s['worst_token']:>9.3f} {s['max_chunks']:>10} {s['min_chunk']:>9} "
                  f"{s['decide_med'] * 1e3:>8.1f}ms {s['decide_max'] * 1e3:>5.0f}ms", flush=True)

    checked = []
    for r in sorted(rows, key=lambda r: -r["compute_imbalance"])[:args.check]:
        seqlens = next(b["seqlens"] for b in batches if b["name"] == r["batch"])
        st = attnplan.compile(seqlens=seqlens, mask=r["mask"], devices=r["devices"], nodes=max(1, r["devices"] // 8),
                              strategy="minheap", block_size=2048, **SHAPE).stats()
        ok = abs(st["compute_imbalance"] - r["compute_imbalance"]) <= 1e-9 * r["compute_imbalance"]
        checked.append({**r, "stats_compute_imbalance": st["compute_imbalance"], "plan_s": st["plan_s"], "ok": ok})
        print(f"check {r['mask']} x{r['devices']} {r['batch']}: decision {r['compute_imbalance']:.4f}, "
              f"stats {st['compute_imbalance']:.4f}, plan {st['plan_s']:.2f} s {'ok' if ok else 'MISMATCH'}",
              flush=True)

    print(f"\nfull plan time, {sum(PLAN_TIME_BATCH):,} tokens at 4 x 8 (median of {args.repeats}; verifier on, "
          f"fwd + bwd):")
    plan_time = []
    for mask in masks:
        ts, st = [], {}
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            plan = attnplan.compile(seqlens=PLAN_TIME_BATCH, mask=mask, devices=32, nodes=4, strategy="minheap",
                                    block_size=2048, **SHAPE)
            ts.append(time.perf_counter() - t0)
            st = plan.stats()
        plan_time.append({"mask": mask, "plan_s": statistics.median(ts), "all_s": ts,
                          "compute_imbalance": st["compute_imbalance"], "token_imbalance": st["token_imbalance"],
                          "compute_blocks": plan.ir.graph.n_cb, "plan_bytes": len(plan.to_bytes())})
        print(f"  {mask:<24} {statistics.median(ts):6.2f} s  compute imb {st['compute_imbalance']:.3f}  token imb "
              f"{st['token_imbalance']:.3f}  {plan.ir.graph.n_cb} compute blocks", flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary, "checked": checked,
                                           "plan_time": plan_time}, indent=1))
    print(f"wrote {args.json}")
    return 0 if all(s["worst"] <= 1.05 for s in summary) and all(c["ok"] for c in checked) else 1


if __name__ == "__main__":
    sys.exit(main())
