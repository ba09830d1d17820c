"""Megatron-LM Dynamic CP's published shape in simulation (NVIDIA Technical
Blog, 2026; survey §3.1): on Llama-13B, dynamic CP gains more over a fixed
CP size on the GitHub data (lengths of high variance: 1.48x in the blog) than
on CommonCrawl (low variance: 1.25x).

    .venv/bin/python benchmarks/dyncp_megatron.py [--out out/dyncp_megatron.json] [--systems dyncp,...]

Every github and commoncrawl batch of ../shared/workloads/batches.jsonl is
planned with ``fixed`` (packed in data order, one CP size, zigzag) and
``dyncp`` (plus any ``--systems``) at ``llama-13b`` on 4 nodes × 8 H100
(dp=4,cp=8 for the 512K batches, dp=8,cp=4 for the 128K ones; ``--pp 8``
adds eight pipeline stages of those, as the blog's PP=8 × CP=8). Per batch:
the step time of each system and its speedup over ``fixed``; for ``dyncp``
also the step time with Megatron's barrier at the end of every round
(the step simulator only makes a micro-batch wait for its own group's
ranks): rounds run one after another, each as long as its slowest group's
micro-batches, and the exposed gradient reduction is kept (pp = 1 only).
Then, per data
set and budget, the geometric mean of the speedups.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from attnplan.step import Mesh, compile_step, make_problem
from attnplan.step.systems.dyncp import DynCP

ROOT = Path(__file__).resolve().parent.parent
MODEL = "llama-13b"
BLOG = {"github": 1.48, "commoncrawl": 1.25}


def mesh_for(budget: int, pp: int = 1) -> Mesh:
    return Mesh(dp=4, cp=8, pp=pp) if budget >= 512 * 1024 else Mesh(dp=8, cp=4, pp=pp)


def with_barrier(report: dict, mb_ranks: list[list[int]]) -> float:
    """The step time had every round of a ``dyncp`` plan ended at a barrier over the pool: rounds one after
    another, each as long as its busiest rank's micro-batches, then the exposed gradient reduction."""
    starts = [int(x) for x in str(report["info"]["round_slots"]).split(",")]
    pm = report["per_mb"]
    bounds = starts[1:] + [max(pm["slot"]) + 1]
    total = 0.0
    for lo, hi in zip(starts, bounds):
        per_rank: dict[int, float] = {}
        for m, slot in enumerate(pm["slot"]):
            if lo <= slot < hi:
                for r in mb_ranks[m]:
                    per_rank[r] = per_rank.get(r, 0.0) + pm["end_s"][m] - pm["start_s"][m]
        total += max(per_rank.values(), default=0.0)
    return total + report["exposed_grad_s"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default=str(ROOT.parent / "shared" / "workloads" / "batches.jsonl"))
    ap.add_argument("--out", default="out/dyncp_megatron.json")
    ap.add_argument("--systems", default="", help="more systems to run beside fixed and dyncp (comma-separated)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages (the blog: 8)")
    args = ap.parse_args(argv)
    batches = [json.loads(line) for line in Path(args.batches).read_text().splitlines() if line.strip()]
    batches = [b for b in batches if b["dist"] in BLOG]
    extra = [s for s in args.systems.split(",") if s]
    t0 = time.perf_counter()
    rows = []
    for b in batches:
        mesh = mesh_for(int(b["budget"]), args.pp)
        row = {"batch": b["name"], "dist": b["dist"], "budget": b["budget"], "mesh": mesh.spec()}
        for name, system in [("fixed", "fixed"), ("dyncp", DynCP())] + [(s, s) for s in extra]:
            c = compile_step(make_problem(b["seqlens"], model=MODEL, mesh=mesh, profile="h100"), system)
            r = c.report
            row[name] = {"step_s": r["step_s"], "step_over_lower_bound": r["step_over_lower_bound"],
                         "dp_imbalance": r["dp_imbalance"], "micro_batches": r["micro_batches"],
                         "plan_s": r["plan_s"], "info": r["info"]}
            if name == "dyncp":
                row[name]["step_barrier_s"] = r["step_s"] if args.pp > 1 else with_barrier(r, [c.plan.mb_ranks(m).tolist() for m in range(c.plan.n_mb)])
        for name in ["dyncp"] + extra:
            row[name]["speedup"] = row["fixed"]["step_s"] / row[name]["step_s"]
        row["dyncp"]["speedup_barrier"] = row["fixed"]["step_s"] / row["dyncp"]["step_barrier_s"]
        rows.append(row)
        print(f"{b['name']:<20} {mesh.spec():<9} fixed {row['fixed']['step_s']:6.2f} s  dyncp "
              f"{row['dyncp']['step_s']:6.2f} s ({row['dyncp']['speedup']:.2f}x; with round barriers "
              f"{row['dyncp']['step_barrier_s']:.2f} s, {row['dyncp']['speedup_barrier']:.2f}x; "
              f"{row['dyncp']['info']['rounds']} rounds, {row['dyncp']['micro_batches']} micro-batches, CP sizes "
              f"{row['dyncp']['info']['documents_per_cp_size']})"
              + "".join(f"  {s} {row[s]['speedup']:.2f}x" for s in extra), flush=True)
    summary = {}
    for dist in BLOG:
        for budget in sorted({r["budget"] for r in rows}):
            sel = [r for r in rows if r["dist"] == dist and r["budget"] == budget]
            if not sel:
                continue
            key = f"{dist}-{budget // 1024}k"
            summary[key] = {k: math.exp(sum(math.log(r["dyncp"][k]) for r in sel) / len(sel))
                            for k in ("speedup", "speedup_barrier")}
            print(f"{key:<18} dyncp over fixed, geometric mean of {len(sel)}: {summary[key]['speedup']:.2f}x "
                  f"({summary[key]['speedup_barrier']:.2f}x with round barriers); blog {BLOG[dist]:.2f}x")
    print(f"({time.perf_counter() - t0:.0f} s)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": MODEL, "profile": "h100", "blog": BLOG, "rows": rows,
                                          "summary": summary}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
