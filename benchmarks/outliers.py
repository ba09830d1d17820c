"""Step plans for global batches with one giant document: every system on generated batches.

    .venv/bin/python benchmarks/outliers.py [--sizes 1,2,4] [--meshes 8x4,4x8,2x16] [--seeds 3] [--out FILE]

A batch of ``S`` Mi-tokens is a long-tailed mix (log-normal lengths, median about 1,800 tokens, cut to
[16, 60,000]) plus one giant document of a share drawn uniformly from [25%, 50%] of the batch, placed at
a random position; seeded (``numpy.random.default_rng(seed)``), so the same flags give the same batches.
Every system of ``plan step compare`` plans each batch (llama3-8b, h100, 8 devices a node, full
recompute); a row is the system's step time over the step bound, or its one-line refusal. The summary:
per mesh, each system's median step / bound over the batches it planned (and how many it planned), and
the best system's median. The bound is the step simulator's: every rank's linear and attention work
spread perfectly over the mesh, no exposed communication, no pipeline (``attnplan.step.simulate``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from attnplan.step import Mesh, make_problem, system_names
from attnplan.step.compare import compare_systems


def giant_batch(tokens: int, seed: int) -> list[int]:
    """A long-tailed mix of ``tokens`` tokens in all, one document of 25-50% of them among it."""
    rng = np.random.default_rng(seed)
    giant = int(tokens * rng.uniform(0.25, 0.5))
    lens: list[int] = []
    while sum(lens) < tokens - giant:
        room = tokens - giant - sum(lens)
        lens.append(int(min(room, np.clip(rng.lognormal(7.5, 1.3), 16, 60_000))))
    lens.insert(int(rng.integers(0, len(lens) + 1)), giant)
    return lens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,2,4", help="batch sizes in Mi-tokens")
    ap.add_argument("--meshes", default="8x4,4x8,2x16", help="dp x cp meshes (32 devices: 4 nodes of 8)")
    ap.add_argument("--seeds", type=int, default=3, help="batches per size")
    ap.add_argument("--out", default=None, help="write every row as JSON here")
    a = ap.parse_args(argv)
    names = list(system_names())
    rows = []
    t0 = time.perf_counter()
    for size in (int(s) for s in a.sizes.split(",")):
        for seed in range(a.seeds):
            lens = giant_batch(size << 20, seed)
            for spec in a.meshes.split(","):
                dp, cp = (int(x) for x in spec.split("x"))
                p = make_problem(lens, model="llama3-8b", mesh=Mesh(dp, cp), profile="h100")
                got, _ = compare_systems(p, names)
                for r in got:
                    rows.append({"size_mi": size, "seed": seed, "giant": max(lens), "docs": len(lens),
                                 "mesh": spec, "system": r["system"], "error": r.get("error"),
                                 "step_over_bound": r.get("step_over_lower_bound"),
                                 "fallback": dict(r.get("info") or {}).get("fallback")})
                best = min((r["step_over_lower_bound"] for r in got if "error" not in r), default=float("nan"))
                print(f"{size}Mi seed {seed} giant {max(lens):,} ({max(lens) / sum(lens):.0%}) {spec}: best "
                      f"{best:.3f}", file=sys.stderr, flush=True)
    print(summary(rows, names, a.meshes.split(",")))
    print(f"({time.perf_counter() - t0:.0f} s)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def summary(rows: list[dict], names: list[str], meshes: list[str]) -> str:
    head = f"{'mesh':<6} " + " ".join(f"{n:>12}" for n in names) + f" {'best':>8}"
    lines = [head]
    for m in meshes:
        mine = [r for r in rows if r["mesh"] == m]
        batches = sorted({(r["size_mi"], r["seed"]) for r in mine})
        cells = []
        for n in names:
            v = [r["step_over_bound"] for r in mine if r["system"] == n and r["error"] is None]
            cells.append(f"{np.median(v):.3f} ({len(v)}/{len(batches)})" if v else f"- (0/{len(batches)})")
        best = [min(r["step_over_bound"] for r in mine if (r["size_mi"], r["seed"]) == b and r["error"] is None)
                for b in batches if any(r["error"] is None for r in mine if (r["size_mi"], r["seed"]) == b)]
        lines.append(f"{m:<6} " + " ".join(f"{c:>12}" for c in cells) + f" {np.median(best):>8.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
