"""Issue 3's acceptance list, measured: balance, communication, plan time,
plan size and the deployed baselines, over ../shared/workloads/batches.jsonl
(h100 profile, forward+backward programs, 8 heads / 2 kv heads / head dim
128; 8 devices = 1 node, 32 devices = 4 nodes × 8).

    .venv/bin/python benchmarks/strategies.py [--out out/strategies.json] [--quick]

``--quick`` keeps every fourth batch (for a smoke run). Prints one line per
acceptance item with the measured numbers and PASS/FAIL, and writes every
row to JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import attnplan
from attnplan.tools.compare import compare

ROOT = Path(__file__).resolve().parent.parent
SHAPE = dict(heads=8, kv_heads=2, head_dim=128)
BALANCED = ("minheap", "hypergraph", "tile_pool")
MASKS = ("causal", "streaming(64,4096)", "shared_question(4,0.2)")
PLAN_TIME_BATCH = [65536, 16384, 8192, 8192] + [2048] * 8 + [1024] * 16


def run(batches, devices, masks, strategies, log):
    """Causal: every strategy; the sparser masks: zigzag and hypergraph (the
    communication items compare those two)."""
    rows = []
    for b in batches:
        for mask in masks:
            for n in devices:
                names = strategies if mask == "causal" else [s for s in strategies if s in ("zigzag", "hypergraph")]
                got, _ = compare(names, seqlens=b["seqlens"], mask=mask, devices=n, nodes=max(1, n // 8),
                                 block_size=2048, **SHAPE)
                for r in got:
                    rows.append({"batch": b["name"], "mask": mask, "devices": n, **r})
                log(f"{b['name']:<20} {mask:<24} x{n:<3} " + " ".join(
                    f"{r['strategy']}={r.get('compute_imbalance', float('nan')):.3f}/"
                    f"{r.get('comm_bytes_total', 0) / 1e9:.2f}GB" for r in got))
    return rows


def pick(rows, **kw):
    return [r for r in rows if all(r.get(k) == v for k, v in kw.items()) and "error" not in r]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default=str(ROOT.parent / "shared" / "workloads" / "batches.jsonl"))
    ap.add_argument("--out", default="out/strategies.json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--strategies", default="zigzag,minheap,hypergraph,tile_pool,per_doc",
                    help="comma-separated (per_doc is skipped by the pipeline's compute-block limit where it "
                         "would make over MAX_COMPUTE_BLOCKS, 600,000, blocks)")
    args = ap.parse_args(argv)
    batches = [json.loads(x) for x in Path(args.batches).read_text().splitlines() if x.strip()]
    if args.quick:
        batches = batches[::4]
    strategies = [s for s in args.strategies.split(",") if s]
    t0 = time.time()
    rows = run(batches, (8, 32), MASKS, strategies, lambda s: print(s, file=sys.stderr, flush=True))
    verdicts = []

    def verdict(name, ok, detail):
        verdicts.append({"item": name, "ok": bool(ok), "detail": detail})
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)

    # balance
    for s in BALANCED:
        for n in (8, 32):
            rs = pick(rows, strategy=s, devices=n, mask="causal")
            worst = max(rs, key=lambda r: r["compute_imbalance"]) if rs else None
            verdict(f"{s} compute imbalance <= 1.05, causal, {n} devices, every batch",
                    rs and worst["compute_imbalance"] <= 1.05 and len(rs) == len(batches),
                    f"worst {worst['compute_imbalance']:.3f} ({worst['batch']}), {len(rs)}/{len(batches)} planned"
                    if rs else "no plans")
    # communication vs zigzag ring traffic
    varlen = [b["name"] for b in batches if not b["name"].startswith("pretrain")]
    for mask, bound in (("causal", 0.5), ("streaming(64,4096)", 0.3), ("shared_question(4,0.2)", 0.3)):
        ratios = []
        for n in (8, 32):
            for name in varlen:
                h = pick(rows, strategy="hypergraph", devices=n, mask=mask, batch=name)
                z = pick(rows, strategy="zigzag", devices=n, mask=mask, batch=name)
                if h and z:
                    ratios.append((h[0]["comm_bytes_total"] / z[0]["comm_bytes_total"], name, n))
        worst = max(ratios) if ratios else (float("nan"), "-", 0)
        verdict(f"hypergraph bytes <= {bound:.0%} of zigzag ring, {mask}, varlen batches",
                ratios and worst[0] <= bound,
                f"worst {worst[0]:.2f} ({worst[1]} x{worst[2]}), median {statistics.median(r[0] for r in ratios):.2f}"
                if ratios else "no data")
    wins = total = 0
    for r in pick(rows, strategy="hypergraph"):
        m = pick(rows, strategy="minheap", devices=r["devices"], mask=r["mask"], batch=r["batch"])
        if m:
            total += 1
            wins += r["comm_bytes_total"] < m[0]["comm_bytes_total"] and r["compute_imbalance"] <= 1.05
    verdict("hypergraph moves fewer bytes than minheap at imbalance <= 1.05 on >= 80% of batches",
            total and wins / total >= 0.8, f"{wins}/{total} ({wins / max(1, total):.0%})")
    # plan time and size
    for s, limit in (("minheap", 1.0), ("hypergraph", 3.0)):
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            plan = attnplan.compile(seqlens=PLAN_TIME_BATCH, devices=32, nodes=4, strategy=s, block_size=2048,
                                    **SHAPE)
            ts.append(time.perf_counter() - t)
        size = len(plan.to_bytes())
        verdict(f"{s} plan time <= {limit:.0f} s, 131K tokens, 4x8 devices, fwd+bwd",
                statistics.median(ts) <= limit, f"median {statistics.median(ts):.2f} s of {[round(t, 2) for t in ts]}")
        verdict(f"{s} plan file <= 2 MB, 131K tokens, 32 devices", size <= 2e6, f"{size / 1e6:.2f} MB")
    allb = {b["name"]: b["seqlens"] for b in (json.loads(x) for x in Path(args.batches).read_text().splitlines() if x)}
    million = allb["lmsys-512k-0"] + allb["libra-512k-0"]
    t = time.perf_counter()
    attnplan.compile(seqlens=million, devices=64, nodes=8, strategy="minheap", block_size=2048, **SHAPE)
    t = time.perf_counter() - t
    verdict("minheap plan time <= 10 s, 1,048,576 tokens, 64 devices", t <= 10, f"{t:.2f} s")
    # deployed baselines
    for n, want in ((8, 2.06), (32, 2.52)):
        imb = [r["compute_imbalance"] for r in pick(rows, strategy="zigzag", devices=n, mask="causal")]
        verdict(f"zigzag median compute imbalance at {n} devices (reference {want})", True,
                f"{statistics.median(imb):.2f} (worst {max(imb):.2f})")
    kw = [r["kernel_work_ratio"] for r in pick(rows, strategy="per_doc", devices=32, mask="causal")]
    sft = [r["kernel_work_ratio"] for r in pick(rows, strategy="per_doc", devices=32, mask="causal")
           if r["batch"].startswith("llama3sft-128k")]
    if kw:
        verdict("per_doc work with 128-row tiles / exact at 32 devices (reference 1.41x median, 7.4x llama3sft)",
                True, f"median {statistics.median(kw):.2f}x, llama3sft-128k {', '.join(f'{x:.1f}x' for x in sft)}")
    for name in ("longalign-128k-0", "libra-128k-0", "github-128k-0", "commoncrawl-128k-0"):
        rs = {r["strategy"]: r for r in pick(rows, devices=32, mask="causal", batch=name)}
        verdict(f"{name} at 4x8 (DCP planner: imbalance 1.44/3.03/4.53/12.8)", True,
                ", ".join(f"{s} {r['compute_imbalance']:.2f} in {r['plan_s']:.2f}s" for s, r in sorted(rs.items())))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "verdicts": verdicts, "seconds": time.time() - t0}, indent=1))
    print(f"wrote {args.out} ({time.time() - t0:.0f} s)")
    return 0 if all(v["ok"] for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
