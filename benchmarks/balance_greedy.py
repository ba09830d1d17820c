"""Balance, kernel waste and plan time of the greedy strategies of issue 3:
``per_doc`` (WLB-LLM / TransformerEngine THD), ``minheap`` (MagiAttention)
and ``tile_pool`` (Libra TAP), beside ``zigzag``.

Every batch of ``batches.jsonl``, causal mask, 8 heads / 2 kv heads / head
dim 128, block 2048, at 8 devices (1 node) and 32 devices (4 nodes x 8):

* ``minheap``, ``tile_pool``, ``zigzag``: full ``attnplan.compile`` (verifier
  on, forward and backward programs) and ``plan.stats()``: compute and token
  imbalance, comm bytes (fwd+bwd), predicted / lower bound, plus the
  granularity the strategy chose (minheap: chunks per device and tokens per
  chunk; tile_pool: sequence block).
* ``per_doc``: the placement only (``tile`` + ``per_doc``, verified), with the
  stats' definitions of compute imbalance, token imbalance and
  ``kernel_work_ratio`` (work with every piece's query rows rounded up to 128
  over exact work). Its graphs reach 1.6M compute blocks at 32 devices
  (every document in 64 chunks), which ``emit`` lowers instruction by
  instruction: a full compile of lmsys-128k-0 (348K blocks) took 59 s.

Then plan time (median of ``--repeats`` full compiles, per pass times from
``instruments``): the 131,072-token batch ``[65536, 16384, 8192, 8192] +
[2048]*8 + [1024]*16`` at 4 nodes x 8, and a 1,048,576-token batch
(lmsys-512k-0 + libra-512k-0) at 64 devices (8 nodes x 8).

    .venv/bin/python benchmarks/balance_greedy.py [--batches ../shared/workloads/batches.jsonl]
        [--devices 8,32] [--repeats 3] [--json out/balance_greedy.json]
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
from attnplan.backends.cost import rounded_pairs
from attnplan.frontend import load_mask, lower_batch
from attnplan.ir.module import PlanIR
from attnplan.ir.problem import Problem
from attnplan.passes import parse_pipeline, run_pipeline
from attnplan.passes.minheap import MinHeap

ROOT = Path(__file__).resolve().parent.parent
SHAPE = dict(heads=8, kv_heads=2, head_dim=128)
PLAN_TIME_BATCH = [65536, 16384, 8192, 8192] + [2048] * 8 + [1024] * 16


def nodes_for(devices: int) -> int:
    return max(1, devices // 8)


def compiled_row(seqlens, strategy, devices, block):
    plan = attnplan.compile(seqlens=seqlens, mask="causal", devices=devices, nodes=nodes_for(devices),
                            strategy=strategy, block_size=block, **SHAPE)
    s = plan.stats()
    g = plan.ir.graph
    row = {"compute_imbalance": s["compute_imbalance"], "token_imbalance": s["token_imbalance"],
           "comm_gb": s["comm_bytes_total"] / 1e9, "pred_over_lb": s["predicted_over_lower_bound"],
           "kernel_work_ratio": s["kernel_work_ratio"], "plan_s": s["plan_s"], "compute_blocks": g.n_cb,
           "max_block": int(g.tb_len.max())}
    if strategy == "minheap":
        k, bounds, _ = MinHeap().chunks_per_device(plan.ir)
        row["chunks_per_device"], row["chunk_tokens"] = k, int(np.diff(bounds).max())
    return row


def per_doc_row(seqlens, devices, block):
    lens = np.asarray(seqlens, np.int64)
    p = Problem(seqlens=lens, pieces=lower_batch(load_mask("causal"), lens.tolist(), None), **SHAPE)
    t0 = time.perf_counter()
    ir = run_pipeline(PlanIR(p, devices, nodes_for(devices)), parse_pipeline(f"tile{{block={block}}},per_doc"))
    dt = time.perf_counter() - t0
    g, pl = ir.graph, ir.placement
    flops = np.bincount(pl.cb_device, weights=g.cb_flops(), minlength=devices)
    tokens = np.bincount(pl.home, weights=g.tb_len, minlength=devices)
    rounded = (rounded_pairs(g, 128)[g.cb_tile] * g.hg_heads[g.cb_hg]).sum()
    return {"compute_imbalance": float(flops.max() / flops.mean()), "token_imbalance": float(tokens.max() / tokens.mean()),
            "kernel_work_ratio": float(rounded / g.cb_pairs.sum()), "place_s": dt, "compute_blocks": g.n_cb}


def plan_time(seqlens, strategy, devices, nodes, repeats, block=2048):
    totals, per_pass = [], {}
    for _ in range(repeats):
        passes = {}

        def inst(p, ir, dt, passes=passes):
            passes[p.name] = passes.get(p.name, 0.0) + dt

        t0 = time.perf_counter()
        plan = attnplan.compile(seqlens=seqlens, mask="causal", devices=devices, nodes=nodes, strategy=strategy,
                                block_size=block, instruments=[inst], **SHAPE)
        totals.append(time.perf_counter() - t0)
        for k, v in passes.items():
            per_pass.setdefault(k, []).append(v)
    med = {k: statistics.median(v) for k, v in per_pass.items()}
    total = statistics.median(totals)
    s = plan.stats()
    return {"strategy": strategy, "tokens": int(sum(seqlens)), "devices": devices, "nodes": nodes,
            "plan_s": total, "plan_s_all": totals, "passes_s": med,
            "rest_s": total - sum(med.values()),  # mask lowering + the verifier after every pass
            "compute_imbalance": s["compute_imbalance"], "compute_blocks": s["compute_blocks"],
            "plan_mb": len(plan.to_bytes()) / 1e6}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default=str(ROOT.parent / "shared" / "workloads" / "batches.jsonl"))
    ap.add_argument("--devices", default="8,32")
    ap.add_argument("--block-size", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    batches = [json.loads(line) for line in Path(args.batches).read_text().splitlines() if line.strip()]
    devs = [int(x) for x in args.devices.split(",")]
    t_start = time.perf_counter()
    rows = []
    print(f"{'batch':<20} {'dev':>3} | {'minheap imb':>11} {'k x tok':>11} {'comm GB':>7} {'pred/LB':>7} | "
          f"{'tile_pool imb':>13} {'blk':>5} {'comm GB':>7} {'pred/LB':>7} | {'zigzag imb':>10} {'comm GB':>7} "
          f"{'pred/LB':>7} | {'per_doc imb':>11} {'kwr':>6}", flush=True)
    for b in batches:
        for n in devs:
            r = {"batch": b["name"], "tokens": sum(b["seqlens"]), "devices": n}
            for strat in ("minheap", "tile_pool", "zigzag"):
                r[strat] = compiled_row(b["seqlens"], strat, n, args.block_size)
            r["per_doc"] = per_doc_row(b["seqlens"], n, args.block_size)
            rows.append(r)
            m, t, z, d = r["minheap"], r["tile_pool"], r["zigzag"], r["per_doc"]
            print(f"{r['batch']:<20} {n:>3} | {m['compute_imbalance']:>11.3f} "
                  f"{m['chunks_per_device']:>3} x {m['chunk_tokens']:<5} {m['comm_gb']:>7.2f} {m['pred_over_lb']:>7.2f} | "
                  f"{t['compute_imbalance']:>13.3f} {t['max_block']:>5} {t['comm_gb']:>7.2f} {t['pred_over_lb']:>7.2f} | "
                  f"{z['compute_imbalance']:>10.2f} {z['comm_gb']:>7.2f} {z['pred_over_lb']:>7.2f} | "
                  f"{d['compute_imbalance']:>11.3f} {d['kernel_work_ratio']:>6.2f}", flush=True)
    summary = {}
    print()
    for n in devs:
        sel = [r for r in rows if r["devices"] == n]
        s = {}
        for strat in ("minheap", "tile_pool", "zigzag", "per_doc"):
            imb = [r[strat]["compute_imbalance"] for r in sel]
            s[strat] = {"imbalance_median": statistics.median(imb), "imbalance_worst": max(imb),
                        "worst_batch": sel[int(np.argmax(imb))]["batch"]}
            if strat != "per_doc":
                s[strat]["comm_gb_median"] = statistics.median(r[strat]["comm_gb"] for r in sel)
                s[strat]["pred_over_lb_median"] = statistics.median(r[strat]["pred_over_lb"] for r in sel)
        kwr = [r["per_doc"]["kernel_work_ratio"] for r in sel]
        s["per_doc"]["kernel_work_ratio_median"] = statistics.median(kwr)
        s["per_doc"]["kernel_work_ratio_worst"] = max(kwr)
        s["per_doc"]["kernel_work_ratio_worst_batch"] = sel[int(np.argmax(kwr))]["batch"]
        s["per_doc"]["kernel_work_ratio_by_batch"] = {r["batch"]: r["per_doc"]["kernel_work_ratio"] for r in sel
                                                      if r["batch"].startswith("llama3sft")}
        s["tile_pool_fewer_bytes_than_minheap"] = sum(r["tile_pool"]["comm_gb"] < r["minheap"]["comm_gb"] for r in sel)
        summary[n] = s
        print(f"{n} devices ({nodes_for(n)} node(s)), {len(sel)} batches:")
        for strat in ("minheap", "tile_pool", "zigzag", "per_doc"):
            x = s[strat]
            extra = (f", comm median {x['comm_gb_median']:.2f} GB, predicted/LB median {x['pred_over_lb_median']:.2f}"
                     if "comm_gb_median" in x else "")
            print(f"  {strat:<9} compute imbalance median {x['imbalance_median']:.3f}, worst {x['imbalance_worst']:.3f} "
                  f"({x['worst_batch']}){extra}")
        print(f"  per_doc   kernel_work_ratio median {s['per_doc']['kernel_work_ratio_median']:.2f}, worst "
              f"{s['per_doc']['kernel_work_ratio_worst']:.2f} ({s['per_doc']['kernel_work_ratio_worst_batch']}); "
              + ", ".join(f"{k} {v:.2f}" for k, v in s["per_doc"]["kernel_work_ratio_by_batch"].items()))
        print(f"  tile_pool moves fewer bytes than minheap on {s['tile_pool_fewer_bytes_than_minheap']} of {len(sel)}")
    print()
    by_name = {b["name"]: b["seqlens"] for b in batches}
    big = by_name["lmsys-512k-0"] + by_name["libra-512k-0"]
    timing = [plan_time(PLAN_TIME_BATCH, "minheap", 32, 4, max(args.repeats, 5)),
              plan_time(PLAN_TIME_BATCH, "tile_pool", 32, 4, args.repeats),
              plan_time(big, "minheap", 64, 8, args.repeats),
              plan_time(big, "tile_pool", 64, 8, args.repeats)]
    for t in timing:
        passes = ", ".join(f"{k} {v:.3f}" for k, v in t["passes_s"].items())
        print(f"plan time {t['strategy']:<9} {t['tokens']:>8} tokens on {t['devices']} devices: median "
              f"{t['plan_s']:.3f} s of {len(t['plan_s_all'])} (all: {', '.join(f'{x:.2f}' for x in t['plan_s_all'])}); "
              f"passes: {passes}; lowering + verifier {t['rest_s']:.3f}; imbalance {t['compute_imbalance']:.3f}, "
              f"{t['compute_blocks']} compute blocks, plan file {t['plan_mb']:.2f} MB", flush=True)
    print(f"benchmark wall time {time.perf_counter() - t_start:.0f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary, "plan_time": timing}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
