"""Libra's bounded sequence pool in simulation (issue 10 acceptance; survey
§2.1, §3.2; Libra, arXiv:2607.23250): its pool law against ``vrsp``, and its
data-parallel scaling case.

    .venv/bin/python benchmarks/libra_pool_law.py [--part law,scaling] [--tail empirical,pareto]
        [--steps 4] [--law-sim-steps 2] [--dps 1,2,4,8,16] [--out out/libra_pool_law.json]

**Sequences.** Packed sequences are drawn from the libra distribution: the
documents of the ``libra-*`` batches of ``../shared/workloads/batches.jsonl``
(510 documents, median ≈ 640 tokens — Libra's production corpus has median
644), drawn with replacement (seeded) and packed next-fit in draw order into
sequences of the context length (a document longer than the context is drawn
again). Two variants of the distribution:

* ``empirical``: the documents as they are. The batch budgets cut their tail
  at 176K tokens, far from the corpus's ~1M tail;
* ``pareto``: the same body, with the tail above 10K tokens (2.9% of the
  documents) replaced by a Pareto tail whose exponent is fitted by maximum
  likelihood to those documents (α ≈ 0.76), truncated at the context length:
  an extrapolation to the 1M tail the survey reports, stated as such.

**Part 1, the pool law.** ``D`` packed sequences (one per data-parallel
replica and step), pools of ``P`` replicas, ``D/P`` pools; ``R`` = the
largest pool load over the mean pool load. Libra's law for a placement that
does not balance, ``E[R] ≈ 1 + CV/√P · √(2 ln(D/P))`` (CV: the coefficient of
variation of one sequence's work), against

* Monte Carlo (``--trials`` steps of ``D`` sequences drawn from 4,096 packed
  sequences of 1M tokens, the step cost model's work of each,
  :func:`attnplan.step.simulate.doc_seconds`, llama3-8b, h100):
  ``data`` pools (fixed's deal, replicas pooled as they are — the placement
  the law describes) and ``vrsp`` (its LPT, :func:`vrsp.lpt_pools`);
* the whole-step simulation (``--law-sim-steps`` steps; smaller, so it
  plans in minutes: 128K-token sequences, ``dp = D = 32``, ``cp = 4``,
  llama3-8b, h100): ``vrsp{pool=P,place=data}`` and ``vrsp{pool=P}``, ``R``
  = the largest pool's compute end over the mean pool's (TAP inside, its
  traffic included).

**Part 2, data-parallel scaling** (Libra: Qwen3-Turbo, CP = 16, 1M-token
packed sequences, DP 1 → 16: 27.6% scaling efficiency for fixed assignment
with Ulysses, 70.3% with VRSP + TAP at P = 8). Here: GPT-7B (MHA with 32 kv
heads, so Ulysses fits CP = 16; Qwen3-Turbo's shape is not public), h200
(64K tokens a device and the activations of a 1M-token sequence need more
than 80 GB under full recompute), 8 devices a node, block 8192 (1M-token plans stay under the compute-block
limit), ``16 · --steps`` sequences; at DP = d they form steps of d
consecutive sequences. ``fixed{strategy=ulysses}`` (fixed assignment) and
``vrsp{pool=min(8,d)}`` (VRSP + TAP). Scaling efficiency of a system at d:
``throughput(d) / (d · throughput(1))`` = ``Σ T₁ / (d · Σ T_d)`` over the
same sequences (T₁: one sequence per step on one replica). Also printed:
the efficiency against fixed's single-replica throughput; the same
efficiency from compute alone (each step's largest per-device busy time:
the communication that Libra's executor pipelines under the attention
kernels, here simulated by the attention passes' transfer model, left out);
and the bound of a placement that never balances across replicas (mean
sequence work / largest sequence work of each step: fixed assignment with
perfect balance inside each replica).

Attention plans are shared between steps with equal micro-batches (the
lowering cache is keyed by the micro-batch's full inputs), so the numbers are
the same as planning every step afresh; plan times are not reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from attnplan.ir.limits import MAX_TOKENS
from attnplan.step import Mesh, compile_step, make_problem
from attnplan.step.lower import AttentionCache, cache_of
from attnplan.step.simulate import doc_seconds
from attnplan.step.systems.vrsp import lpt_pools

ROOT = Path(__file__).resolve().parent.parent
TAIL_FROM = 10_000
PAPER = {"fixed": 0.276, "vrsp": 0.703}


def libra_documents(path: Path) -> np.ndarray:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return np.concatenate([np.asarray(r["seqlens"], np.int64) for r in rows if r.get("dist") == "libra"])


class Sampler:
    """Document lengths of the libra distribution (module doc), ``kind`` empirical or pareto."""

    def __init__(self, docs: np.ndarray, kind: str, seed: int, cap: int):
        self.rng = np.random.default_rng(seed)
        self.kind, self.cap = kind, cap
        tail = docs[docs > TAIL_FROM]
        self.alpha = float(len(tail) / np.log(tail / TAIL_FROM).sum())
        self.p_tail = len(tail) / len(docs)
        self.docs = docs[docs <= cap] if kind == "empirical" else docs[docs <= TAIL_FROM]

    def draw(self, n: int) -> np.ndarray:
        """``n`` document lengths."""
        out = self.docs[self.rng.integers(len(self.docs), size=n)]
        if self.kind == "pareto":
            tail = self.rng.random(n) < self.p_tail
            top = 1.0 - (TAIL_FROM / self.cap) ** self.alpha  # inverse CDF of the Pareto truncated at cap
            u = self.rng.random(int(tail.sum()))
            out[tail] = (TAIL_FROM * (1.0 - u * top) ** (-1.0 / self.alpha)).astype(np.int64)
        return out

    def sequences(self, n: int, context: int) -> list[list[int]]:
        """``n`` packed sequences: documents in draw order, next-fit into ``context`` tokens (a document longer
        than ``context`` is dropped, i.e. drawn again)."""
        out: list[list[int]] = []
        cur: list[int] = []
        held = 0
        while len(out) < n:
            for d in self.draw(4096).tolist():
                if d > context:
                    continue
                if held + d > context:
                    out.append(cur)
                    cur, held = [], 0
                    if len(out) == n:
                        break
                cur.append(d)
                held += d
        return out


def batch_of(seqs: list[list[int]]) -> tuple[list[int], list[int]]:
    """(document lengths, packed-sequence id of each) of a list of packed sequences."""
    return [d for s in seqs for d in s], [i for i, s in enumerate(seqs) for _ in s]


def law(cv: float, d: int, p: int) -> float:
    return 1.0 + cv / math.sqrt(p) * math.sqrt(2.0 * math.log(d / p))


def pool_ratio(load: np.ndarray) -> float:
    return float(load.max() / load.mean())


# --------------------------------------------------------------------------------------------- part 1

def sequence_work(seqs, model: str, profile: str) -> np.ndarray:
    """The step cost model's work of every packed sequence (:func:`doc_seconds` of its documents), each
    distinct length priced once, in problems under MAX_TOKENS."""
    lens = np.asarray([d for s in seqs for d in s], np.int64)
    owner = np.repeat(np.arange(len(seqs)), [len(s) for s in seqs])
    distinct, inverse = np.unique(lens, return_inverse=True)
    price = np.zeros(len(distinct))
    start = 0
    while start < len(distinct):
        end = start + int(np.searchsorted(np.cumsum(distinct[start:]), MAX_TOKENS, "right"))
        end = max(end, start + 1)
        p = make_problem(distinct[start:end], model=model, mesh=Mesh(1, 1), profile=profile)
        price[start:end] = doc_seconds(p)
        start = end
    return np.bincount(owner, weights=price[inverse], minlength=len(seqs))


def law_monte_carlo(sampler: Sampler, d: int, pools: list[int], trials: int, context: int, log,
                    population: int = 4096) -> dict:
    """``trials`` steps of ``d`` sequences drawn (with replacement) from ``population`` packed sequences."""
    work = sequence_work(sampler.sequences(population, context), "llama3-8b", "h100")
    cv = float(work.std() / work.mean())
    draws = work[sampler.rng.integers(population, size=(trials, d))]
    rows = []
    for p in pools:
        data, lpt = [], []
        for w in draws:
            data.append(pool_ratio(np.bincount(np.arange(d) // p, weights=w)))
            lpt.append(pool_ratio(np.bincount(lpt_pools(w, d // p, p), weights=w, minlength=d // p)))
        rows.append({"P": p, "law": law(cv, d, p), "mc_data": float(np.mean(data)), "mc_vrsp": float(np.mean(lpt))})
        log(f"  P={p:<3} law {rows[-1]['law']:.3f}  Monte Carlo: data pools {rows[-1]['mc_data']:.3f}, "
            f"vrsp {rows[-1]['mc_vrsp']:.3f}")
    return {"D": d, "context": context, "trials": trials, "population": population, "cv": cv, "rows": rows}


def pool_ends(c, pool: int) -> np.ndarray:
    mesh = c.plan.problem.mesh
    end = np.asarray(c.report["per_rank"]["end_s"]).reshape(mesh.dp // pool, pool * mesh.cp)
    return end.max(axis=1)


def law_simulated(sampler: Sampler, pools: list[int], steps: int, log, d=32, cp=4, context=128 * 1024) -> dict:
    seqs = sampler.sequences(d * steps, context)
    work = sequence_work(seqs, "llama3-8b", "h100")
    cv = float(work.std() / work.mean())
    rows = []
    for p in pools:
        got = {}
        for place in ("data", "lpt"):
            ratios = []
            for s in range(steps):
                lens, packing = batch_of(seqs[s * d:(s + 1) * d])
                prob = make_problem(lens, model="llama3-8b", mesh=Mesh(d, cp), profile="h100", packing=packing)
                c = compile_step(prob, f"vrsp{{pool={p},place={place}}}")
                ratios.append(pool_ratio(pool_ends(c, p)))
            got[place] = float(np.mean(ratios))
        rows.append({"P": p, "law": law(cv, d, p), "sim_data": got["data"], "sim_vrsp": got["lpt"]})
        log(f"  P={p:<3} law {rows[-1]['law']:.3f}  simulated: data pools {got['data']:.3f}, vrsp {got['lpt']:.3f}")
    return {"D": d, "cp": cp, "context": context, "steps": steps, "cv": cv, "rows": rows}


# --------------------------------------------------------------------------------------------- part 2

def scaling(sampler: Sampler, dps: list[int], steps: int, log, cp=16, context=1 << 20, block=8192) -> dict:
    seqs = sampler.sequences(max(dps) * steps, context)
    work = sequence_work(seqs, "gpt-7b", "h200")
    caches: dict[str, AttentionCache] = {}
    times: dict[str, dict[int, float]] = {"fixed": {}, "vrsp": {}}
    busy: dict[str, dict[int, float]] = {"fixed": {}, "vrsp": {}}
    balance: dict[int, float] = {}
    for d in dps:
        per_step = [seqs[i:i + d] for i in range(0, len(seqs), d)]
        w = [work[i:i + d] for i in range(0, len(seqs), d)]
        balance[d] = float(sum(x.mean() for x in w) / sum(x.max() for x in w))
        for name, system in (("fixed", "fixed{strategy=ulysses}"), ("vrsp", f"vrsp{{pool={min(8, d)}}}")):
            total = compute = 0.0
            for group in per_step:
                lens, packing = batch_of(group)
                prob = make_problem(lens, model="gpt-7b", mesh=Mesh(d, cp), profile="h200", packing=packing,
                                    block_size=block)
                if name in caches:
                    prob = dataclasses.replace(prob, cache=caches[name])
                else:
                    caches[name] = cache_of(prob)
                r = compile_step(prob, system).report
                total += r["step_s"]
                compute += max(r["per_rank"]["busy_s"])
            times[name][d], busy[name][d] = total, compute
        log(f"  DP={d:<3} fixed {times['fixed'][d]:8.1f} s ({busy['fixed'][d]:7.1f} s busy)   vrsp "
            f"{times['vrsp'][d]:8.1f} s ({busy['vrsp'][d]:7.1f} s busy)   (sums over {len(per_step)} steps)")
    rows = []
    for d in dps:
        row = {"dp": d, "balance_bound": balance[d]}
        for name in times:
            row[f"{name}_eff"] = times[name][dps[0]] / (d / dps[0] * times[name][d])
            row[f"{name}_eff_vs_fixed1"] = times["fixed"][dps[0]] / (d / dps[0] * times[name][d])
            row[f"{name}_busy_eff"] = busy[name][dps[0]] / (d / dps[0] * busy[name][d])
        rows.append(row)
    return {"cp": cp, "context": context, "block": block, "steps": steps,
            "cv": float(work.std() / work.mean()), "times": times, "busy": busy, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default=str(ROOT.parent / "shared" / "workloads" / "batches.jsonl"))
    ap.add_argument("--part", default="law,scaling")
    ap.add_argument("--tail", default="empirical,pareto")
    ap.add_argument("--pools", default="1,2,4,8,16")
    ap.add_argument("--D", type=int, default=64, help="sequences per step in the Monte Carlo of the law")
    ap.add_argument("--trials", type=int, default=2000)
    ap.add_argument("--law-sim-steps", type=int, default=2)
    ap.add_argument("--dps", default="1,2,4,8,16")
    ap.add_argument("--steps", type=int, default=4, help="steps of 16 sequences in the scaling case")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/libra_pool_law.json")
    args = ap.parse_args(argv)
    docs = libra_documents(Path(args.batches))
    parts = set(args.part.split(","))
    pools = [int(x) for x in args.pools.split(",")]
    dps = [int(x) for x in args.dps.split(",")]

    def log(s):
        print(s, flush=True)

    t0 = time.perf_counter()
    res: dict = {"documents": len(docs), "median": float(np.median(docs)), "max": int(docs.max())}
    for kind in args.tail.split(","):
        s = Sampler(docs, kind, args.seed, 1 << 20)
        out = res[kind] = {"tail_alpha": s.alpha, "tail_share": s.p_tail} if kind == "pareto" else {}
        log(f"== {kind}" + (f" (Pareto tail above {TAIL_FROM:,}: alpha {s.alpha:.3f}, {s.p_tail:.1%} of documents)"
                            if kind == "pareto" else f" ({len(docs)} documents, longest {int(docs.max()):,})"))
        if "law" in parts:
            log(f"pool law, Monte Carlo: D = {args.D} sequences of 1M tokens, {args.trials} trials")
            out["law_mc"] = law_monte_carlo(s, args.D, [p for p in pools if args.D % p == 0], args.trials, 1 << 20,
                                            log)
            log(f"  CV of a sequence's work: {out['law_mc']['cv']:.3f}")
            log(f"pool law, whole-step simulation: D = 32 sequences of 128K tokens, cp = 4, "
                f"{args.law_sim_steps} step(s)")
            out["law_sim"] = law_simulated(Sampler(docs, kind, args.seed + 1, 128 * 1024),
                                           [p for p in pools if 32 % p == 0], args.law_sim_steps, log)
            log(f"  CV of a sequence's work: {out['law_sim']['cv']:.3f}")
        if "scaling" in parts:
            log(f"data-parallel scaling: gpt-7b, CP = 16, 1M-token sequences, {16 * args.steps} sequences")
            out["scaling"] = sc = scaling(Sampler(docs, kind, args.seed + 2, 1 << 20), dps, args.steps, log)
            log(f"  CV of a sequence's work: {sc['cv']:.3f}")
            log(f"  {'DP':>3} {'fixed eff':>9} {'vrsp eff':>9} {'vrsp/fixed1':>11} {'fixed busy':>10} "
                f"{'vrsp busy':>9} {'balance bound':>13}")
            for r in sc["rows"]:
                log(f"  {r['dp']:>3} {r['fixed_eff']:>9.1%} {r['vrsp_eff']:>9.1%} {r['vrsp_eff_vs_fixed1']:>11.1%} "
                    f"{r['fixed_busy_eff']:>10.1%} {r['vrsp_busy_eff']:>9.1%} {r['balance_bound']:>13.1%}")
            log(f"  paper at DP=16: fixed {PAPER['fixed']:.1%}, VRSP + TAP {PAPER['vrsp']:.1%}")
    log(f"({time.perf_counter() - t0:.0f} s)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
