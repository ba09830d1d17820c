"""What separates the best plan per batch from its lower bound, term by term.

For every batch (default: the fourteen 128K batches of ``batches.jsonl``) at
``--devices`` (default 32, 8 a node), causal mask, 8 heads / 2 kv heads /
head dim 128, block 2048, the --profile (default h100), every strategy of ``--strategies``
(default: the suite list of ``docs/results.md``, ``$S,$T``) is compiled once
(``--partials-dtype`` and ``--keep-kv`` as ``plan bench`` takes them). Then:

1. **The best plan per batch** (lowest predicted / lower bound) and, per
   phase, the device that ends last, its time in units of that phase's bound
   (the phase's FLOPs at perfect balance, :mod:`attnplan.backends.stats`):
   ``even`` (1.0, its share at perfect balance), ``extra`` (its kernel work
   beyond that: imbalance and query-tile rounding), ``launch`` (one per run of
   compute blocks, :func:`attnplan.backends.walk.run_starts`), ``merge``
   (summing received partials) and ``wait`` (idle on a message).
2. **The same plans re-simulated** under copies of the profile with one term
   changed: no message latency inside a node, across nodes, or at all; no
   kernel launches; neither; twice the inter-node bandwidth. Best per batch,
   median (worst) and how many batches are at most 1.5. The plans are not
   recompiled: no placement, comm or emit pass reads the profile (only
   ``auto`` does, which is why it is not in the list), so a profile changes
   what a plan costs, never the plan. The lower bound is the same FLOP bound
   in every row (launches and latency do not enter it).
3. **span's parameters searched per batch** (``--grid``): every ``grain`` of
   ``GRID_GRAINS`` × ``cross`` of ``GRID_CROSS``, with and without the
   in-node tree, best per batch — what choosing span's parameters per batch
   could reach at most.
4. **Each strategy's placement floor** (:mod:`attnplan.backends.floor`):
   what its placement allows at best, whatever the schedule — per phase its
   busiest device's kernel work or its busiest queue's bytes at full
   bandwidth, no latency, no launches — beside what its plan predicts, both
   over the bound: a strategy whose floor is already above a target cannot reach it
   by scheduling, and predicted / floor is what latency, launches and
   imperfect overlap cost it.

    .venv/bin/python benchmarks/gap.py [--devices 32] [--names a,b] [--strategies S]
        [--partials-dtype bfloat16] [--keep-kv] [--local first|last|kept] [--grid] [--profile h100|FILE.json]
        [--json out/gap.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import numpy as np

import attnplan
from attnplan.backends.cost import DTYPE_EFFICIENCY, cb_seconds, get_profile, simulate
from attnplan.backends.floor import placement_floor
from attnplan.backends.walk import run_starts
from attnplan.ir.program import ATTN, ATTN_BWD, BWD, FWD, OP, PHASES
from attnplan.passes.default import entry_pipeline

BATCHES = Path(__file__).resolve().parents[1].parent / "shared" / "workloads" / "batches.jsonl"
SHAPE = dict(heads=8, kv_heads=2, head_dim=128, block_size=2048)
SUITE = ("dacp,hypergraph,minheap,per_doc,span,span{grain=1},span{grain=2},span{grain=4},tile_pool,usp,zigzag,"
         "span:tree,span{grain=1}:tree,span{grain=2}:tree,span{grain=4}:tree,dacp:tree,per_doc:tree")
GRID_GRAINS = (1, 1.1, 1.25, 1.5, 2, 3, 4)
GRID_CROSS = (0, 1.2, 1.5, 2)


def knockouts(base, fair: bool = False) -> dict:
    """The profile variants of item 2, by label."""
    r = dataclasses.replace
    return {
        base.name: base,
        "no latency inside a node": r(base, name="gap", intra_alpha=0.0),
        "no latency across nodes": r(base, name="gap", inter_alpha=0.0),
        "no message latency": r(base, name="gap", intra_alpha=0.0, inter_alpha=0.0),
        "no launches": r(base, name="gap", launch_s=0.0),
        "no latency, no launches": r(base, name="gap", intra_alpha=0.0, inter_alpha=0.0, launch_s=0.0),
        "2x inter-node bandwidth": r(base, name="gap", inter_bw=2 * base.inter_bw),
        **({"fair links": r(base, name="gap", links="fair")} if fair else {}),
    }


def lower_bound(ir, prof) -> float:
    """The FLOP bound of :mod:`attnplan.backends.stats` (forward + backward at perfect balance)."""
    return float(ir.graph.cb_flops().sum()) * (1 + prof.bwd_factor) / (ir.devices * prof.flops)


def last_device_terms(ir, prof, sim: dict) -> dict:
    """Per phase, the device that ends last: its seconds as even share, extra kernel work, launches,
    merges and waits, each over the phase's bound."""
    g, prog = ir.graph, ir.program
    rate = DTYPE_EFFICIENCY.get(g.problem.dtype, 1.0)
    kernel = np.bincount(ir.placement.cb_device, weights=cb_seconds(g, prof, launch=not prof.fused) / rate,
                         minlength=ir.devices)
    lb = lower_bound(ir, prof)
    out = {}
    for phase, factor in ((FWD, 1.0), (BWD, prof.bwd_factor)):
        ph = sim[PHASES[phase]]
        d = int(np.argmax(ph["finish_s"]))
        bound = lb * factor / (1 + prof.bwd_factor)
        code = prog.code[phase][d]
        attn = (code[:, OP] == ATTN) | (code[:, OP] == ATTN_BWD)
        runs = int(run_starts(code[:, OP], np.zeros(len(code), np.int64)).sum()) if prof.fused else int(attn.sum())
        launch = runs * prof.launch_s / rate * factor if prof.fused else 0.0
        work = kernel[d] * factor
        busy, finish = float(ph["compute_s"][d]), float(ph["finish_s"][d])
        merge = max(0.0, busy - work - launch)  # what is left of its busy time: merges and adds (0 up to rounding)
        out[PHASES[phase]] = {"device": d, "total": finish / bound, "even": 1.0, "extra": (work - bound) / bound,
                              "launch": launch / bound, "runs": runs, "merge": merge / bound,
                              "wait": (finish - busy) / bound}
    return out


def compile_all(lens, devices: int, strategies: list[str], options: dict, local: str | None = None) -> dict:
    """Every strategy entry compiled (``local``: its default pipeline with
    ``overlap{local=...}``, :func:`with_local`)."""
    plans = {}
    for s in strategies:
        how = {"strategy": s} if local is None else {"pipeline": with_local(s, local)}
        try:
            plans[s] = attnplan.compile(lens, devices=devices, nodes=max(1, devices // 8), verify=False, **how,
                                        **SHAPE, **options)
        except attnplan.PlanError:
            continue  # a strategy that cannot take the batch (ulysses over more devices than heads)
    return plans


def with_local(entry: str, local: str) -> str:
    """The default pipeline of strategy entry ``entry`` (``name``,
    ``name{options}``, ``name:variant``) with its overlap step's ``local``
    option set."""
    return entry_pipeline(f"{entry} overlap{{local={local}}}", SHAPE["block_size"])


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({max(values):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=32)
    ap.add_argument("--names", help="comma-separated batch names (default: every -128k- batch)")
    ap.add_argument("--batches", default=str(BATCHES))
    ap.add_argument("--strategies", default=SUITE)
    ap.add_argument("--partials-dtype", default="float32")
    ap.add_argument("--keep-kv", action="store_true")
    ap.add_argument("--local", choices=("first", "last", "kept"),
                    help="the overlap step's local option for every strategy (default: each default pipeline's)")
    ap.add_argument("--grid", action="store_true", help="also search span's grain x cross per batch (item 3)")
    ap.add_argument("--profile", default="h100", help="the base cost profile (a name, or a FILE.json from plan "
                    "calibrate or benchmarks/link_model.py); the other rows change one of its terms")
    ap.add_argument("--fair", action="store_true", help="also simulate with links='fair' (minutes)")
    ap.add_argument("--json", help="write every number here")
    a = ap.parse_args()
    records = [json.loads(line) for line in Path(a.batches).read_text().splitlines() if line.strip()]
    names = a.names.split(",") if a.names else [r["name"] for r in records if "-128k-" in r["name"]]
    by_name = {r["name"]: r for r in records}
    options = {"partials_dtype": a.partials_dtype, "keep_kv": a.keep_kv}
    strategies = _split(a.strategies)
    base = get_profile(a.profile)
    profiles = knockouts(base, a.fair)
    best_terms, ratios, grid = {}, {label: [] for label in profiles}, []
    floors: dict[str, list[tuple[float, float]]] = {}  # strategy -> (predicted, placement floor) over LB, per batch
    print(f"{a.devices} devices, {len(names)} batches, options {options}", file=sys.stderr)
    head = ("batch", "best", "pred/LB", "fwd: extra launch merge wait (runs)", "bwd: extra launch merge wait (runs)")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for name in names:
        lens = by_name[name]["seqlens"]
        plans = compile_all(lens, a.devices, strategies, options, a.local)
        lb = lower_bound(next(iter(plans.values())).ir, base)
        sims = {label: {s: simulate(p.ir, prof) for s, p in plans.items()} for label, prof in profiles.items()}
        for label, by_s in sims.items():
            ratios[label].append(min(v["predicted_s"] for v in by_s.values()) / lb)
        for s, p in plans.items():
            floors.setdefault(s, []).append((sims[base.name][s]["predicted_s"] / lb, placement_floor(p.ir, base)["floor_s"] / lb))
        win = min(sims[base.name], key=lambda s: (sims[base.name][s]["predicted_s"], s))
        t = last_device_terms(plans[win].ir, base, sims[base.name][win])
        best_terms[name] = {"strategy": win, "pred_over_lb": sims[base.name][win]["predicted_s"] / lb, **t}
        cells = [f"{t[p]['extra']:.2f} {t[p]['launch']:.2f} {t[p]['merge']:.2f} {t[p]['wait']:.2f} ({t[p]['runs']})"
                 for p in ("fwd", "bwd")]
        print(f"| {name} | {win} | {best_terms[name]['pred_over_lb']:.2f} | {cells[0]} | {cells[1]} |", flush=True)
        if a.grid:
            spans = [f"span{{grain={g},cross={c}}}{t}" for g in GRID_GRAINS for c in GRID_CROSS for t in ("", ":tree")]
            gp = compile_all(lens, a.devices, spans, options, a.local)
            grid.append(min(simulate(p.ir, base)["predicted_s"] for p in gp.values()) / lb)
    print("\n| profile | best per batch, median (worst) | batches <= 1.5 |\n|---|---|---|")
    for label, v in ratios.items():
        print(f"| {label} | {summary(v)} | {sum(x <= 1.5 for x in v)} of {len(v)} |")
    if grid:
        print(f"| {base.name}, span's grain x cross searched per batch | {summary(grid)} | "
              f"{sum(x <= 1.5 for x in grid)} of {len(grid)} |")
    print("\n| strategy | predicted / LB, median (worst) | placement floor / LB, median (worst) | "
          "predicted / floor, median |\n|---|---|---|---|")
    for s, v in floors.items():
        print(f"| {s} | {summary([p for p, _ in v])} | {summary([f for _, f in v])} | "
              f"{statistics.median(p / f for p, f in v):.2f} |")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"devices": a.devices, "options": options, "best": best_terms,
                                            "profiles": ratios, "grid": grid, "floors": floors}, indent=1))


def _split(text: str) -> list[str]:
    """Comma-separated strategies, commas inside ``{...}`` kept."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "{") - (ch == "}")
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return out + [cur] if cur else out


if __name__ == "__main__":
    main()
