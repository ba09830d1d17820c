"""Per-head masks and cross-attention (issue 12, items 2 and 3): what they cost.

Per-head masks: one batch of the suite (default libra-128k-0) on 8 devices,
32 query / 8 kv heads x 128, block 2048, h100, under causal and under three
per-head masks — classes on kv-head boundaries (nothing copied), alternating
classes inside every kv head (each kv head copied once per class), and
Sparse VideoGen's spatial/temporal heads. For each strategy: plan time
(median of ``--repeats``, verifier on, forward + backward programs), the
mask classes, kv copies and head groups, compute imbalance, predicted /
lower bound and bytes moved a step.

Cross-attention: Flamingo-style samples (``--cross``: text tokens with
one 64-token image per 256 text tokens) on 8 devices, the same shape: the
same columns for every strategy.

    .venv/bin/python benchmarks/heads_cross.py [--batch libra-128k-0] [--devices 8] [--repeats 3]
        [--strategies hypergraph,minheap,tile_pool,zigzag] [--json out/heads_cross.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import attnplan
from attnplan.frontend import load_batch

ROOT = Path(__file__).resolve().parent.parent
SHAPE = dict(heads=32, kv_heads=8, head_dim=128, block_size=2048)
MASKS = {
    "causal": "causal",
    "kv-aligned": "(h < 16 & sliding_window(4096)) | (h >= 16 & causal)",
    "alternating": str(ROOT / "examples" / "masks" / "local_global_heads.mask"),
    "svg": "(h < 16 & q // 4096 == k // 4096) | (h >= 16 & (k - q) % 4096 == 0)",
}
CROSS = dict(seqlens_q=[8192] * 6 + [4096] * 10, seqlens_k=[2048] * 6 + [1024] * 10)


def measure(kw: dict, strategy: str, devices: int, repeats: int) -> dict:
    times, plan = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        plan = attnplan.compile(devices=devices, strategy=strategy, **SHAPE, **kw)
        times.append(time.perf_counter() - t)
    s, p, g = plan.stats(), plan.problem, plan.ir.graph
    return {"strategy": strategy, "plan_s": statistics.median(times), "classes": p.n_classes, "kv_copies": g.kv_rep,
            "head_groups": g.n_hg, "compute_imbalance": s["compute_imbalance"],
            "pred_over_lb": s["predicted_over_lower_bound"], "comm_gb": s["comm_bytes_total"] / 1e9}


def row(name: str, r: dict) -> str:
    return (f"{name:<12} {r['strategy']:<11} {r['plan_s']:7.2f} {r['classes']:>7} {r['kv_copies']:>5} "
            f"{r['head_groups']:>4} {r['compute_imbalance']:8.3f} {r['pred_over_lb']:8.2f} {r['comm_gb']:8.2f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="libra-128k-0")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--strategies", default="hypergraph,minheap,tile_pool,zigzag")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    batch = load_batch(str(ROOT.parent / "shared" / "workloads" / f"batches.jsonl:{args.batch}"))
    strategies = args.strategies.split(",")
    cases = [(f"{name}", dict(seqlens=list(batch.seqlens), mask=mask)) for name, mask in MASKS.items()]
    cases.append(("cross", dict(CROSS, mask=str(ROOT / "examples" / "masks" / "flamingo_cross.mask"))))
    print(f"{args.batch} ({batch.num_tokens:,} tokens) and a cross batch ({sum(CROSS['seqlens_q']):,} queries, "
          f"{sum(CROSS['seqlens_k']):,} keys), {args.devices} devices, 32/8 heads x 128, h100")
    print(f"{'mask':<12} {'strategy':<11} {'plan s':>7} {'classes':>7} {'kv x':>5} {'hg':>4} {'comp imb':>8} "
          f"{'pred/LB':>8} {'comm GB':>8}")
    out = []
    for name, kw in cases:
        for s in strategies:
            r = dict(measure(kw, s, args.devices, args.repeats), mask=name)
            out.append(r)
            print(row(name, r), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
