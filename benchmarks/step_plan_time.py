"""Plan time of one training step per system (issue 10's acceptance: one
step of a 512K batch on 32 devices in at most 5 s per system, FlexSP within
its time limit): every system on the chosen 512K batches of
../shared/workloads/batches.jsonl at llama3-8b, dp=4,cp=8 on 4 nodes × 8
H100, each plan on a fresh problem (no cache shared between systems or
repeats), the median and largest of ``--repeats`` wall times; for flexsp
also how its MILP stopped (``solver_stop``) and its gap.

    .venv/bin/python benchmarks/step_plan_time.py [--names a,b] [--repeats 3] [--systems all]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from attnplan.step import compile_step, make_problem
from attnplan.step.compare import system_list
from attnplan.tools.step_bench import TARGET_PLAN_S, mesh_for

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = "libra-512k-0,github-512k-1,lmsys-512k-0,commoncrawl-512k-0"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default=str(ROOT.parent / "shared" / "workloads" / "batches.jsonl"))
    ap.add_argument("--names", default=DEFAULT)
    ap.add_argument("--systems", default="all")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    keep = args.names.split(",")
    batches = {b["name"]: b for b in map(json.loads, Path(args.batches).read_text().splitlines()) if b["name"] in keep}
    names = system_list(args.systems)
    worst: dict[str, float] = {}
    print(f"{'batch':<20} {'system':<8} {'median s':>8} {'max s':>6}  solver")
    for bname in keep:
        b = batches[bname]
        mesh = mesh_for(sum(b["seqlens"]))
        for s in names:
            times, info = [], {}
            for _ in range(args.repeats):
                c = compile_step(make_problem(b["seqlens"], model="llama3-8b", mesh=mesh, profile="h100"), s)
                times.append(c.report["plan_s"])
                info = c.report["info"]
            worst[s] = max(worst.get(s, 0.0), max(times))
            solver = ", ".join(f"{k}={v}" for k, v in info.items() if k in ("solver_stop", "mip_gap", "time_limit"))
            print(f"{bname:<20} {s:<8} {statistics.median(times):>8.2f} {max(times):>6.2f}  {solver}", flush=True)
    print("largest: " + ", ".join(f"{k} {v:.2f} s" for k, v in worst.items())
          + f" (target <= {TARGET_PLAN_S} s): " + ("PASS" if max(worst.values()) <= TARGET_PLAN_S else "FAIL"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
