"""Size and time of the HTML report for a 1,048,576-token plan (issue 5).

The batch is lmsys-512k-0 followed by libra-512k-0 from
``shared/workloads/batches.jsonl``, causal, 8 heads / 2 kv heads / head dim 128,
block 2048, 64 devices on 8 nodes. For each strategy: the single-plan report
(bytes, drawn mask cells, timeline spans, render seconds, median of
``--repeats``); then one comparison report of all of them. The report must
stay under 5 MB.

    .venv/bin/python benchmarks/viz_size.py --strategies zigzag,minheap --repeats 3 [--out out/viz]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BATCHES = ROOT.parent / "shared" / "workloads" / "batches.jsonl"
LIMIT = 5_000_000


def main(argv=None) -> int:
    import attnplan
    from attnplan.backends import viz

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategies", default="zigzag", help="comma-separated, or 'all'")
    ap.add_argument("--devices", type=int, default=64)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="folder to keep the reports in")
    args = ap.parse_args(argv)
    rows = {json.loads(line)["name"]: json.loads(line)["seqlens"] for line in BATCHES.open()}
    lens = rows["lmsys-512k-0"] + rows["libra-512k-0"]
    names = list(attnplan.strategies()) if args.strategies == "all" else args.strategies.split(",")
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    plans, ok = [], True
    print(f"{sum(lens):,} tokens, {len(lens)} documents, {args.devices} devices on {args.nodes} nodes")
    print(f"{'strategy':<12} {'compile s':>9} {'render s':>9} {'HTML MB':>8} {'cells':>6} {'bins':>5} "
          f"{'spans fwd':>9} {'spans bwd':>9} {'events':>8}")
    for name in names:
        t0 = time.perf_counter()
        try:
            plan = attnplan.compile(seqlens=lens, mask="causal", devices=args.devices, nodes=args.nodes, heads=8,
                                    kv_heads=2, head_dim=128, block_size=2048, strategy=name)
        except attnplan.AttnplanError as e:
            print(f"{name:<12} not applicable: {e}")
            continue
        t_compile = time.perf_counter() - t0
        times, text = [], ""
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            text = viz.render_html(plan)
            times.append(time.perf_counter() - t0)
        d = viz.panel_data(plan)
        size = len(text.encode())
        ok &= size < LIMIT
        ev = sum(d["timeline"][ph]["events"][k] for ph in ("fwd", "bwd") for k in ("compute", "transfer", "wait"))
        print(f"{name:<12} {t_compile:>9.2f} {statistics.median(times):>9.2f} {size / 1e6:>8.2f} "
              f"{len(d['mask']['q']):>6} {d['mask']['bins']:>5} {len(d['timeline']['fwd']['spans']['dev']):>9} "
              f"{len(d['timeline']['bwd']['spans']['dev']):>9} {ev:>8}")
        if out:
            (out / f"report-{name}.html").write_text(text, encoding="utf-8")
        plans.append((name, plan))
    if len(plans) > 1:
        t0 = time.perf_counter()
        text = viz.render_compare_html(plans)
        size = len(text.encode())
        print(f"compare of {len(plans)}: {size / 1e6:.2f} MB in {time.perf_counter() - t0:.2f} s")
        ok &= size < LIMIT
        if out:
            (out / "compare.html").write_text(text, encoding="utf-8")
    print("PASS: every report under 5 MB" if ok else "FAIL: a report is 5 MB or more")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
