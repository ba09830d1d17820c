"""What keeping the forward's KV for the backward (``keep_kv``) costs in memory.

For the 128K batches of ``batches.jsonl`` at 32 devices (4 nodes × 8),
causal mask, 8 heads / 2 kv heads / head dim 128, block 2048, bf16, h100
profile, each strategy with and without ``keep_kv``: per device, the bytes of
KV blocks it keeps (received in the forward, held until the backward: in a
training step that is from the layer's forward to its backward, like the
activations autograd saves), against the bytes autograd saves for the layer's
attention anyway on a device's share of the tokens (q, k, v and out, plus the
fp32 lse); and the peak
of each phase's stream (:func:`attnplan.runtime.memory.stream_peak`, home
buffers included) with and without. Prints, per strategy, the median and
worst over batches of the busiest device, and the predicted time saved.

    .venv/bin/python benchmarks/keep_kv_memory.py [--strategies per_doc,span,...] [--devices 32]
        [--batches FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


import attnplan
from attnplan.ir.program import BWD, FWD
from attnplan.runtime.memory import stream_peak

BATCHES = Path(__file__).resolve().parents[1].parent / "shared" / "workloads" / "batches.jsonl"
SHAPE = dict(heads=8, kv_heads=2, head_dim=128, block_size=2048, dtype="bfloat16")


def measure(lens: list[int], strategy: str, devices: int) -> dict:
    nodes = max(1, devices // 8)
    keep = attnplan.compile(lens, devices=devices, nodes=nodes, strategy=strategy, keep_kv=True, **SHAPE)
    plain = attnplan.compile(lens, devices=devices, nodes=nodes, strategy=strategy, **SHAPE)
    kept = keep.ir.program.kept_bytes()
    # what autograd saves for the attention of a device's share of the tokens: q, k, v, out (bf16), lse (fp32)
    saved = sum(lens) / devices * (2 * (2 * SHAPE["heads"] + 2 * SHAPE["kv_heads"]) * SHAPE["head_dim"]
                                   + 4 * SHAPE["heads"])

    def peak(plan, phase):
        return max(stream_peak(plan.ir.program, phase, d).peak for d in range(devices))
    return {"kept_max": int(kept.max()), "kept_over_saved": float(kept.max() / saved),
            "fwd_peak": (peak(plain, FWD), peak(keep, FWD)), "bwd_peak": (peak(plain, BWD), peak(keep, BWD)),
            "time": (plain.stats()["predicted_s"], keep.stats()["predicted_s"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--strategies", default="per_doc,dacp,hypergraph,span,span{grain=1}")
    ap.add_argument("--devices", type=int, default=32)
    ap.add_argument("--batches", default=str(BATCHES), help="the JSONL of batches (default: the shared suite)")
    args = ap.parse_args()
    if not Path(args.batches).is_file():
        raise SystemExit(f"batch file not found: {args.batches} (give --batches FILE)")
    batches = [json.loads(line) for line in Path(args.batches).read_text().splitlines() if line.strip()]
    batches = [b for b in batches if "-128k-" in b["name"]]
    mib = 1 / 2 ** 20
    print(f"{len(batches)} batches of 128K at {args.devices} devices; busiest device, median (worst) over batches")
    print(f"{'strategy':16} {'kept MiB':>16} {'kept/saved':>14} {'fwd peak MiB plain->kept':>28} "
          f"{'bwd peak MiB plain->kept':>28} {'time saved':>12}")
    for s in args.strategies.split(","):
        rows = [measure(b["seqlens"], s, args.devices) for b in batches]

        def mw(vals, fmt):
            return f"{fmt.format(statistics.median(vals))} ({fmt.format(max(vals))})"
        fwd = [r["fwd_peak"] for r in rows]
        bwd = [r["bwd_peak"] for r in rows]
        saved = [1 - r["time"][1] / r["time"][0] for r in rows]
        print(f"{s:16} {mw([r['kept_max'] * mib for r in rows], '{:.1f}'):>16} "
              f"{mw([r['kept_over_saved'] for r in rows], '{:.2f}'):>14} "
              f"{statistics.median(a for a, _ in fwd) * mib:>12.1f} -> {statistics.median(b for _, b in fwd) * mib:<12.1f} "
              f"{statistics.median(a for a, _ in bwd) * mib:>12.1f} -> {statistics.median(b for _, b in bwd) * mib:<12.1f} "
              f"{statistics.median(saved):>11.0%}")


if __name__ == "__main__":
    main()
