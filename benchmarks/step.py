"""Issue 10's acceptance table: every batch-level system on every batch of
../shared/workloads/batches.jsonl, llama3-8b, 4 nodes × 8 devices (h100
profile, full recompute, causal documents): dp=4,cp=8 for the 512K batches,
dp=8,cp=4 for the 128K ones.

    .venv/bin/python benchmarks/step.py [--out out/step_bench.json] [--systems fixed,wlb,pool] [--names a,b]

Per batch and system: step time, step / lower bound, DP imbalance (max/mean
per-rank busy time), exposed gradient reduction, peak memory per device and
plan time (each system plans on a fresh problem, so no system reuses another's
lowered micro-batches). Then, over the 512K batches: the speedup of the
best system against ``fixed`` per batch, its median, the best system's
step / lower bound on the median batch, and the largest plan time per system
(target: 5 s). Writes every row to JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from attnplan.step import Mesh, make_problem
from attnplan.step.compare import compare_systems, system_list

ROOT = Path(__file__).resolve().parent.parent
MODEL = "llama3-8b"
TARGET_SPEEDUP, TARGET_RATIO, TARGET_PLAN_S = 1.3, 1.25, 5.0


def mesh_for(budget: int) -> Mesh:
    return Mesh(dp=4, cp=8) if budget >= 512 * 1024 else Mesh(dp=8, cp=4)


def run(batches, names, log) -> list[dict]:
    rows = []
    for b in batches:
        mesh = mesh_for(int(b.get("budget", sum(b["seqlens"]))))
        got = []
        for name in names:
            problem = make_problem(b["seqlens"], model=MODEL, mesh=mesh, profile="h100")
            got += compare_systems(problem, [name])[0]
        base = next((r for r in got if r["system"] == "fixed" and "error" not in r), None)
        for r in got:
            if base is not None and "error" not in r:
                r["speedup_vs_fixed"] = base["step_s"] / r["step_s"]
            rows.append({"batch": b["name"], "budget": b.get("budget"), "mesh": mesh.spec(), **r})
        log(f"{b['name']:<20} {mesh.spec():<10} " + "  ".join(
            f"{r['system']}=" + (f"{r['step_s'] * 1e3:.0f}ms/{r['step_over_lower_bound']:.2f}/"
                                 f"{r['peak_memory_bytes'] / 2**30:.0f}G/{r['plan_s']:.1f}s" if "error" not in r
                                 else "ERROR " + r["error"][:60]) for r in got))
    return rows


def table(rows) -> str:
    head = (f"{'batch':<20} {'system':<8} {'mb':>3} {'step ms':>9} {'step/LB':>7} {'DP imb':>6} {'grad ms':>7} "
            f"{'peak GiB':>8} {'plan s':>6} {'vs fixed':>8}")
    out = [head]
    for r in rows:
        if "error" in r:
            out.append(f"{r['batch']:<20} {r['system']:<8} {r['error']}")
            continue
        out.append(f"{r['batch']:<20} {r['system']:<8} {r['micro_batches']:>3} {r['step_s'] * 1e3:>9.1f} "
                   f"{r['step_over_lower_bound']:>7.3f} {r['dp_imbalance']:>6.3f} {r['exposed_grad_s'] * 1e3:>7.1f} "
                   f"{r['peak_memory_bytes'] / 2**30:>8.1f} {r['plan_s']:>6.2f} "
                   f"{r.get('speedup_vs_fixed', float('nan')):>7.2f}x")
    return "\n".join(out)


def summary(rows) -> tuple[list[str], dict]:
    """The acceptance items over the 512K batches."""
    lines, res = [], {}
    errors = [r for r in rows if "error" in r]
    lines.append(f"planned: {sum('error' not in r for r in rows)} of {len(rows)} (batch, system) pairs; "
                 f"errors: {len(errors)}" + (" — " + "; ".join(f"{r['batch']}/{r['system']}: {r['error'][:80]}"
                                                              for r in errors[:5]) if errors else ""))
    big = sorted({r["batch"] for r in rows if (r.get("budget") or 0) >= 512 * 1024})
    best = {}
    for name in big:
        ok = [r for r in rows if r["batch"] == name and "error" not in r]
        if not ok or not any(r["system"] == "fixed" for r in ok):
            continue
        b = min(ok, key=lambda r: r["step_s"])
        best[name] = b
    if best:
        order = sorted(best, key=lambda n: best[n]["speedup_vs_fixed"])
        speedups = [best[n]["speedup_vs_fixed"] for n in order]
        med = statistics.median(speedups)
        mid = order[len(order) // 2]
        res.update(median_speedup=med, median_batch=mid, median_best=best[mid]["system"],
                   median_ratio=best[mid]["step_over_lower_bound"], speedups={n: best[n]["speedup_vs_fixed"]
                                                                              for n in order})
        lines.append("512K batches, best system vs fixed: " + ", ".join(
            f"{n}={best[n]['system']} {best[n]['speedup_vs_fixed']:.2f}x" for n in order))
        lines.append(f"median speedup {med:.2f}x (target >= {TARGET_SPEEDUP}): "
                     f"{'PASS' if med >= TARGET_SPEEDUP else 'FAIL'}")
        lines.append(f"median batch {mid}: best {best[mid]['system']} {best[mid]['speedup_vs_fixed']:.2f}x, step/LB "
                     f"{best[mid]['step_over_lower_bound']:.3f} (target <= {TARGET_RATIO}): "
                     f"{'PASS' if best[mid]['step_over_lower_bound'] <= TARGET_RATIO else 'FAIL'}")
    plan = {}
    for r in rows:
        if "error" not in r and (r.get("budget") or 0) >= 512 * 1024:
            plan[r["system"]] = max(plan.get(r["system"], 0.0), r["plan_s"])
    res["max_plan_s_512k"] = plan
    lines.append("largest plan time, 512K on 32 devices: " + ", ".join(f"{k} {v:.2f}s" for k, v in plan.items())
                 + f" (target <= {TARGET_PLAN_S} s): "
                 + ("PASS" if plan and max(plan.values()) <= TARGET_PLAN_S else "FAIL"))
    over = [r for r in rows if "error" not in r and r["peak_memory_bytes"] > r["memory_cap_bytes"]]
    lines.append(f"devices over their memory cap: {len(over)}")
    return lines, res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default=str(ROOT.parent / "shared" / "workloads" / "batches.jsonl"))
    ap.add_argument("--out", default="out/step_bench.json")
    ap.add_argument("--systems", default="all")
    ap.add_argument("--names", default=None, help="comma-separated batch names to keep")
    args = ap.parse_args(argv)
    batches = [json.loads(line) for line in Path(args.batches).read_text().splitlines() if line.strip()]
    if args.names:
        keep = set(args.names.split(","))
        batches = [b for b in batches if b["name"] in keep]
    names = system_list(args.systems)
    t0 = time.perf_counter()
    rows = run(batches, names, lambda s: print(s, file=sys.stderr, flush=True))
    print(table(rows))
    lines, res = summary(rows)
    print("\n".join(lines))
    print(f"({time.perf_counter() - t0:.0f} s)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": MODEL, "profile": "h100", "rows": rows, "summary": res}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
