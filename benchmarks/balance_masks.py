"""Compute balance of the balancing strategies on every builtin mask (issue 9,
acceptance line 4): ``minheap``, ``hypergraph`` and ``tile_pool`` at compute
imbalance <= 1.05 on every batch of the suite, for every builtin mask family,
at 8 devices (1 node) and 32 devices (4 nodes x 8).

Every case runs the placement part of the strategy's default pipeline
(``tile`` and the strategy pass, verifier on) — the part that decides the
balance — and computes ``compute_imbalance`` exactly as ``plan.stats()``
does (max over devices of forward attention FLOPs / mean: compute blocks'
pairs x heads summed by the device that runs them). ``--check N`` compiles
the first N cases in full and asserts that ``plan.stats()`` agrees.

    .venv/bin/python benchmarks/balance_masks.py [--strategies minheap,hypergraph,tile_pool]
        [--devices 8,32] [--masks causal,full] [--batches lmsys-512k-0] [--check 3]
        [--json out/balance_masks.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

import attnplan
from attnplan.api import default_pipeline
from attnplan.frontend import load_mask, lower_batch
from attnplan.ir.module import PlanIR
from attnplan.ir.problem import Problem
from attnplan.passes import parse_pipeline, run_pipeline

ROOT = Path(__file__).resolve().parent.parent
SHAPE = dict(heads=8, kv_heads=2, head_dim=128)
BLOCK = 2048
PER_NODE = 8
TARGET = 1.05
STRATEGIES = ("minheap", "hypergraph", "tile_pool")
# one realistic parameter choice per builtin family (benchmarks/minheap_masks.py's)
MASKS = ("causal", "full", "sliding_window(4096)", "streaming(64,4096)", "shared_question(4,0.2)",
         "causal_blockwise(256,2)", "block_causal(1024)", "prefix_lm(1024)", "chunked_causal(8192)",
         "dilated_sliding_window(64,16)", "natten2d(128,128,13,13)", "sliding_tile2d(128,128,8,8,3,3)",
         "global_tokens(64)", "sliding_window(4096) | global_tokens(64)")
# same_segment / earlier_segment / document need segments, which the suite's batches do not have


def imbalance(ir: PlanIR) -> float:
    """``compute_imbalance`` of backends/stats.py from the placement alone."""
    g, pl = ir.graph, ir.placement
    flops = np.bincount(pl.cb_device, weights=g.cb_flops().astype(float), minlength=ir.devices)
    return float(flops.max() / flops.mean()) if flops.mean() > 0 else 1.0


def place(problem: Problem, strategy: str, devices: int) -> PlanIR:
    head = parse_pipeline(default_pipeline(strategy, BLOCK))[:2]
    return run_pipeline(PlanIR(problem, devices, max(1, devices // PER_NODE)), head)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches-file", default=str(ROOT.parent / "shared" / "workloads" / "batches.jsonl"))
    ap.add_argument("--batches", default="", help="comma-separated suite names (default: all)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--devices", default="8,32")
    ap.add_argument("--masks", default=";".join(MASKS), help="semicolon-separated mask expressions")
    ap.add_argument("--check", type=int, default=3, help="compile this many cases in full and compare stats()")
    ap.add_argument("--json", default="out/balance_masks.json")
    a = ap.parse_args(argv)
    suite = [json.loads(x) for x in Path(a.batches_file).read_text().splitlines() if x.strip()]
    if a.batches:
        want = a.batches.split(",")
        suite = [b for b in suite if b["name"] in want]
    strategies, devices = a.strategies.split(","), [int(x) for x in a.devices.split(",")]
    masks = [m for m in a.masks.split(";") if m]
    rows, t_all = [], time.perf_counter()
    print(f"{'strategy':<11}{'mask':<26}{'dev':>4}  worst imbalance (batch)        mean   seconds", flush=True)
    for strategy in strategies:
        for mask in masks:
            prog = load_mask(mask)
            for n in devices:
                worst, worst_b, vals, t0 = 0.0, "", [], time.perf_counter()
                for b in suite:
                    lens = np.asarray(b["seqlens"], np.int64)
                    problem = Problem(seqlens=lens, pieces=lower_batch(prog, lens.tolist(), None), mask=prog.source,
                                      **SHAPE)
                    imb = imbalance(place(problem, strategy, n))
                    rows.append({"strategy": strategy, "mask": mask, "devices": n, "batch": b["name"],
                                 "compute_imbalance": imb})
                    vals.append(imb)
                    if imb > worst:
                        worst, worst_b = imb, b["name"]
                flag = "" if worst <= TARGET else "  over 1.05"
                print(f"{strategy:<11}{mask:<26}{n:>4}  {worst:.3f} ({worst_b}){'':<{max(0, 22 - len(worst_b))}}"
                      f"{np.mean(vals):.3f}  {time.perf_counter() - t0:7.1f}{flag}", flush=True)
    for r in rows[:a.check]:
        b = next(x for x in suite if x["name"] == r["batch"])
        plan = attnplan.compile(b["seqlens"], mask=r["mask"], devices=r["devices"],
                                nodes=max(1, r["devices"] // PER_NODE), block_size=BLOCK, strategy=r["strategy"],
                                **SHAPE)
        got = plan.stats()["compute_imbalance"]
        if abs(got - r["compute_imbalance"]) > 1e-9 * got:
            raise SystemExit(f"check failed: {r} but stats() says {got}")
    over = [r for r in rows if r["compute_imbalance"] > TARGET]
    summary = {"cases": len(rows), "over": len(over), "worst": max((r["compute_imbalance"] for r in rows), default=0),
               "seconds": time.perf_counter() - t_all, "checked": min(a.check, len(rows))}
    print(f"\n{summary['cases']} cases, {summary['over']} over {TARGET}; worst {summary['worst']:.3f}; "
          f"stats() agreed on {summary['checked']} full compiles; {summary['seconds']:.0f} s")
    for r in over:
        print(f"  over: {r['strategy']} {r['mask']} x{r['devices']} {r['batch']}: {r['compute_imbalance']:.3f}")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
