"""Issue 10's acceptance table: every batch-level system on every batch of
../shared/workloads/batches.jsonl, llama3-8b, 4 nodes × 8 devices (h100
profile, full recompute, causal documents): dp=4,cp=8 for the 512K batches,
dp=8,cp=4 for the 128K ones.

    .venv/bin/python benchmarks/step.py [--out out/step_bench] [--systems fixed,wlb,pool] [--names a,b]

The same run as ``plan step bench`` (the rows, table, summary, JSON and
plots come from :mod:`attnplan.tools.step_bench`, the one place they are
computed); this script adds one line per batch on stderr as it goes.
Per batch and system: step time, step / lower bound, DP imbalance (max/mean
per-rank busy time), exposed gradient reduction, peak memory per device and
plan time. Then, over the 512K batches: the best system's speedup against
``fixed`` per batch, its median, the best system's step / lower bound on
the median batch, and the largest plan time per system (target: 5 s).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from attnplan.tools.step_bench import step_bench

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default=str(ROOT.parent / "shared" / "workloads" / "batches.jsonl"))
    ap.add_argument("--out", default="out/step_bench", help="folder for step_bench.json, summary.txt and plots")
    ap.add_argument("--systems", default="all")
    ap.add_argument("--names", default=None, help="comma-separated batch names to keep")
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--profile", default="h100")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages of 4 nodes x 8 devices each")
    ap.add_argument("--vp", type=int, default=1, help="model chunks per stage")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    names = [n for n in args.names.split(",") if n] if args.names else None
    t0 = time.perf_counter()
    res = step_bench(args.batches, args.systems, args.out, names=names, model=args.model, profile=args.profile,
                     pp=args.pp, vp=args.vp, show_progress=not args.no_progress, log=lambda s: print(s, file=sys.stderr, flush=True))
    print(res["text"])
    print(f"({time.perf_counter() - t0:.0f} s)")
    print("wrote " + ", ".join(str(f) for f in res["files"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
