"""Every system with pipeline parallelism on the suite's 512K batches: one
``plan step bench`` per (model, pp) — 4 nodes × 8 devices a stage (dp=4,
cp=8), h100, full recompute — and one summary table over all of them.

    .venv/bin/python benchmarks/pipeline.py [--configs llama3-8b:2,llama3-8b:4,llama3-70b:4:h200,...] [--out D]

Per (model, pp, profile, system): batches planned (of 14), the median step / lower
bound, the median bubble ratio (the share of its compute span a device
idles), the median speedup over ``fixed``, the largest peak memory and the
largest plan time. llama3-70b at pp = 2 does not fit (143.7 GiB of model
states a device). At pp = 4 on H100s it leaves about 20K tokens a device
after its stage's weights, gradients and optimizer states, so a CP group of
8 cannot hold a 60K-token document: the systems with fixed groups of cp
devices refuse those batches, the ones that regroup (or cut) plan them; on
H200s (141 GB) every system plans every batch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from attnplan.tools.bench import load_batches
from attnplan.tools.step_bench import step_bench

ROOT = Path(__file__).resolve().parent.parent


def summarize(head: str, rows: list[dict]) -> list[str]:
    out = []
    for system in dict.fromkeys(r["system"] for r in rows):
        mine = [r for r in rows if r["system"] == system]
        ok = [r for r in mine if "error" not in r]
        if not ok:
            out.append(f"| {head} | {system} | 0 of {len(mine)} | - | - | - | - | - |")
            continue
        vs = [r["speedup_vs_fixed"] for r in ok if "speedup_vs_fixed" in r]
        out.append(f"| {head} | {system} | {len(ok)} of {len(mine)} | "
                   f"{statistics.median(r['step_over_lower_bound'] for r in ok):.2f} | "
                   f"{statistics.median(r['bubble_ratio'] for r in ok):.1%} | "
                   + (f"{statistics.median(vs):.2f}x" if vs else "-") + " | "
                   f"{max(r['peak_memory_bytes'] for r in ok) / 2**30:.1f} / {ok[0]['memory_cap_bytes'] / 2**30:.0f} | "
                   f"{max(r['plan_s'] for r in ok):.2f} |")
    return out


def million_batches(path: str, out: str) -> str:
    """A JSONL of 1M-token batches: every source's ``-512k-0`` and ``-512k-1`` batches joined in order."""
    import json
    batches = {b["name"]: b for b in load_batches(path, None)}
    lines = []
    for name, b in batches.items():
        if name.endswith("-512k-0") and name[:-1] + "1" in batches:
            lens = list(b["seqlens"]) + list(batches[name[:-1] + "1"]["seqlens"])
            lines.append(json.dumps({"name": name[:-len("-512k-0")] + "-1m", "dist": b.get("dist", ""),
                                     "budget": sum(lens), "seqlens": lens}))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text("\n".join(lines) + "\n")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default=str(ROOT.parent / "shared" / "workloads" / "batches.jsonl"))
    ap.add_argument("--configs", default="llama3-8b:2,llama3-8b:4,llama3-70b:4,llama3-70b:4:h200,llama3-70b:8",
                    help="model:pp[:profile] items (profile default h100)")
    ap.add_argument("--out", default="out/pipeline")
    ap.add_argument("--million", action="store_true", help="1M-token batches instead: each source's two 512K "
                    "batches joined (seven batches)")
    args = ap.parse_args(argv)
    if args.million:
        args.batches = million_batches(args.batches, f"{args.out}/batches-1m.jsonl")
    names = [b["name"] for b in load_batches(args.batches, None) if sum(b["seqlens"]) >= 512 * 1024]
    t0 = time.perf_counter()
    lines = ["| model | pp | profile | system | planned | step/LB (median) | bubble (median) | vs fixed (median) | "
             "peak / cap GiB | plan s (max) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for cfg in args.configs.split(","):
        model, pp, profile = (cfg.split(":") + ["h100"])[:3]
        res = step_bench(args.batches, "all", f"{args.out}/{model}-pp{pp}-{profile}", names=names, model=model,
                         pp=int(pp), profile=profile, show_progress=False,
                         log=lambda s: print(s[:160], file=sys.stderr, flush=True))
        lines += summarize(f"{model} | {pp} | {profile}", res["rows"])
    print("\n".join(lines))
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
