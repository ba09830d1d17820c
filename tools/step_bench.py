"""``plan step bench`` and ``benchmarks/step.py`` (issue 10's acceptance
table): every batch-level system on every batch of a workload file at one
model, on 4 nodes × 8 devices a pipeline stage — dp=4,cp=8 for batches of
512K tokens or more, dp=8,cp=4 below, ``pp`` stages — with a progress bar, a table, a JSON file of every
row and PNG plots. This module is the one place the rows are computed.

Per (batch, system): step time, step / lower bound, DP imbalance (max/mean
per-rank busy time), exposed gradient reduction, peak memory per device
and plan time. Each system plans on a fresh problem, so no system reuses
another's lowered micro-batches and every plan time is the system's own.
A system that cannot plan a batch (a document no group of the mesh can
hold, ...) gets a row with its one-line error. The summary, over the
batches of 512K tokens or more: the best system's speedup over ``fixed``
per batch and its median, the best system's step / lower bound on the
median batch, the largest plan time per system, devices over their cap.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from ..errors import BatchError, PlanError, StepError
from ..step import Mesh, make_problem
from ..step.compare import _pct, compare_systems, system_list
from .bench import ensure_out_dir, load_batches

BIG = 512 * 1024                 # batches of at least this many tokens use the dp=4,cp=8 mesh
TARGET_SPEEDUP, TARGET_RATIO, TARGET_PLAN_S = 1.3, 1.25, 5.0


def mesh_for(tokens: int, recompute: str = "full", pp: int = 1, vp: int = 1) -> Mesh:
    """The suite's mesh on 4 nodes × 8 devices a pipeline stage: dp=4,cp=8 at 512K tokens or more, dp=8,cp=4
    below; ``pp`` such stages (``vp`` model chunks each)."""
    dp, cp = (4, 8) if tokens >= BIG else (8, 4)
    return Mesh(dp=dp, cp=cp, pp=pp, devices_per_node=8, recompute=recompute, vp=vp)


def budget_of(batch: dict) -> int:
    """The batch's token budget (``budget`` in batches.jsonl) or, without one, its tokens."""
    b = batch.get("budget")
    return int(b) if isinstance(b, int) and not isinstance(b, bool) and b > 0 else int(sum(batch["seqlens"]))


def run_suite(batches: list[dict], names: list[str], model="llama3-8b", profile="h100", recompute="full",
              block_size: int = 2048, progress=None, log=None, pp: int = 1, vp: int = 1,
              partials_dtype: str = "float32", keep_kv: bool = False) -> list[dict]:
    """Every system of ``names`` on every batch (the rows; see the module doc). ``progress(batch, system)``
    is called after each (batch, system) pair, ``log(line)`` after each batch."""
    rows = []
    for b in batches:
        if b.get("segments") is not None:
            raise StepError(f"batch {b['name']}: plan step does not take segments yet")
        budget = budget_of(b)
        mesh = mesh_for(budget, recompute, pp, vp)
        got = []
        for name in names:
            problem = make_problem(b["seqlens"], model=model, mesh=mesh, profile=profile, block_size=block_size,
                                   partials_dtype=partials_dtype, keep_kv=keep_kv)
            got += compare_systems(problem, [name])[0]
            if progress is not None:
                progress(b["name"], name)
        base = next((r for r in got if r["system"].startswith("fixed") and "error" not in r), None)
        for r in got:
            r.pop("speedup_vs_fixed", None)
            if base is not None and "error" not in r:
                r["speedup_vs_fixed"] = base["step_s"] / r["step_s"]
            rows.append({"batch": b["name"], "budget": budget, "mesh": mesh.spec(), **r})
        if log is not None:
            log(f"{b['name']:<20} {mesh.spec():<10} " + "  ".join(
                f"{r['system']}=" + (f"{r['step_s'] * 1e3:.0f}ms/{r['step_over_lower_bound']:.2f}/"
                                     f"{r['peak_memory_bytes'] / 2**30:.0f}G/{r['plan_s']:.1f}s"
                                     if "error" not in r else "ERROR " + r["error"][:60]) for r in got))
    return rows


def table(rows: list[dict]) -> str:
    width = max([8] + [len(r["system"]) for r in rows])
    bw = max([20] + [len(str(r["batch"])) for r in rows])
    pipe = any("bubble_ratio" in r for r in rows)
    head = (f"{'batch':<{bw}} {'system':<{width}} {'mb':>4} {'step ms':>9} {'step/LB':>7} {'DP imb':>6} "
            + (f"{'bubble':>6} " if pipe else "") + f"{'grad ms':>7} {'peak GiB':>8} {'plan s':>6} {'vs fixed':>8}")
    out = [head]
    for r in rows:
        if "error" in r:
            out.append(f"{r['batch']:<{bw}} {r['system']:<{width}} {r['error']}")
            continue
        vs = f"{r['speedup_vs_fixed']:.2f}x" if "speedup_vs_fixed" in r else "-"
        out.append(f"{r['batch']:<{bw}} {r['system']:<{width}} {r['micro_batches']:>4} {r['step_s'] * 1e3:>9.1f} "
                   f"{r['step_over_lower_bound']:>7.3f} {r['dp_imbalance']:>6.3f} "
                   + (f"{_pct(r.get('bubble_ratio')):>6} " if pipe else "") + f"{r['exposed_grad_s'] * 1e3:>7.1f} "
                   f"{r['peak_memory_bytes'] / 2**30:>8.1f} {r['plan_s']:>6.2f} {vs:>8}")
    return "\n".join(out)


def _kept_lines(rows: list[dict], res: dict) -> list[str]:
    """With ``--keep-kv``: the micro-batches planned without kept KV (over the memory cap with it) and the
    steps planned without it altogether (step/kept.py, step/driver.py); nothing where every step keeps it."""
    ok = [r for r in rows if "error" not in r]
    unkept = [r for r in ok if r.get("mb_unkept")]
    whole = [r for r in ok if "keep_kv" in dict(r.get("info") or {})]
    if not unkept and not whole:
        return []
    res["mb_unkept"] = sum(len(r["mb_unkept"]) for r in unkept)
    res["steps_unkept"] = len(whole)
    return [f"forward KV not kept: {res['mb_unkept']} of {sum(r['micro_batches'] for r in ok)} micro-batches in "
            f"{_n(len(unkept), 'step')} (over the memory cap with it); {_n(len(whole), 'step')} planned without it "
            f"({_n(sum(r['micro_batches'] for r in whole), 'micro-batch')})"]


def _n(k: int, noun: str) -> str:
    return f"{k} {noun}" if k == 1 else f"{k} {noun}es" if noun.endswith("ch") else f"{k} {noun}s"


def summary(rows: list[dict]) -> tuple[list[str], dict]:
    """The acceptance items (text lines, numbers) over the batches of 512K tokens or more."""
    lines: list[str] = []
    res: dict = {}
    piped = any("bubble_ratio" in r for r in rows)  # the targets below are for steps without a pipeline
    errors = [r for r in rows if "error" in r]
    res["planned"], res["errors"] = len(rows) - len(errors), len(errors)
    lines.append(f"planned: {len(rows) - len(errors)} of {len(rows)} (batch, system) pairs; errors: {len(errors)}"
                 + (" — " + "; ".join(f"{r['batch']}/{r['system']}: {r['error'][:80]}" for r in errors[:5])
                    if errors else ""))
    lines += _kept_lines(rows, res)
    big = sorted({r["batch"] for r in rows if r["budget"] >= BIG})
    best = {}
    for name in big:
        ok = [r for r in rows if r["batch"] == name and "error" not in r]
        if ok and any("speedup_vs_fixed" in r for r in ok):
            best[name] = min(ok, key=lambda r: r["step_s"])
    if best:
        order = sorted(best, key=lambda n: (best[n]["speedup_vs_fixed"], n))
        med = statistics.median(best[n]["speedup_vs_fixed"] for n in order)
        mid = order[len(order) // 2]
        res.update(median_speedup=med, median_batch=mid, median_best=best[mid]["system"],
                   median_ratio=best[mid]["step_over_lower_bound"],
                   speedups={n: [best[n]["system"], best[n]["speedup_vs_fixed"]] for n in order})
        lines.append("512K batches, best system vs fixed: " + ", ".join(
            f"{n}={best[n]['system']} {best[n]['speedup_vs_fixed']:.2f}x" for n in order))
        lines.append(f"median speedup {med:.2f}x (target >= {TARGET_SPEEDUP}): "
                     f"{'PASS' if med >= TARGET_SPEEDUP else 'FAIL'}")
        target = "" if piped else (f" (target <= {TARGET_RATIO}): "
                                   f"{'PASS' if best[mid]['step_over_lower_bound'] <= TARGET_RATIO else 'FAIL'}")
        lines.append(f"median batch {mid}: best {best[mid]['system']} {best[mid]['speedup_vs_fixed']:.2f}x, step/LB "
                     f"{best[mid]['step_over_lower_bound']:.3f}{target}")
    plan: dict[str, float] = {}
    for r in rows:
        if "error" not in r and r["budget"] >= BIG:
            plan[r["system"]] = max(plan.get(r["system"], 0.0), r["plan_s"])
    res["max_plan_s_512k"] = plan
    if plan and not piped:
        lines.append("largest plan time, 512K on 32 devices: " + ", ".join(f"{k} {v:.2f}s" for k, v in plan.items())
                     + f" (target <= {TARGET_PLAN_S} s): "
                     + ("PASS" if max(plan.values()) <= TARGET_PLAN_S else "FAIL"))
    bub: dict[str, list[float]] = {}
    for r in rows:
        if "error" not in r and "bubble_ratio" in r:
            bub.setdefault(r["system"], []).append(r["bubble_ratio"])
    if bub:
        res["median_bubble"] = {k: statistics.median(v) for k, v in bub.items()}
        lines.append("median bubble ratio: " + ", ".join(f"{k} {statistics.median(v):.1%}" for k, v in bub.items()))
        every: dict[str, float] = {}
        for r in rows:
            if "error" not in r:
                every[r["system"]] = max(every.get(r["system"], 0.0), r["plan_s"])
        res["max_plan_s"] = every
        lines.append("largest plan time: " + ", ".join(f"{k} {v:.2f}s" for k, v in every.items())
                     + f" (target <= {TARGET_PLAN_S} s): "
                     + ("PASS" if max(every.values()) <= TARGET_PLAN_S else "FAIL"))
    over = [r for r in rows if "error" not in r and r["peak_memory_bytes"] > r["memory_cap_bytes"]]
    res["over_cap"] = len(over)
    lines.append(f"rows with a device over its memory cap: {len(over)}")
    return lines, res


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
    """Per mesh: step time / lower bound per batch and system (grouped bars), and the speedup over
    ``fixed`` per system (box plot over the batches)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in rows if "error" not in r]
    meshes = sorted({r["mesh"] for r in ok})
    systems = list(dict.fromkeys(r["system"] for r in rows))
    files: list[Path] = []
    if not ok:
        return files
    most = max(len({r["batch"] for r in ok if r["mesh"] == m}) for m in meshes)
    fig, axes = plt.subplots(len(meshes), 1, figsize=(max(8.0, 0.9 * most), 3.6 * len(meshes)), squeeze=False)
    for ax, mesh in zip(axes[:, 0], meshes):
        batches = list(dict.fromkeys(r["batch"] for r in ok if r["mesh"] == mesh))
        w = 0.8 / max(1, len(systems))
        for j, s in enumerate(systems):
            val = {r["batch"]: r["step_over_lower_bound"] for r in ok if r["mesh"] == mesh and r["system"] == s}
            ax.bar([i + j * w for i in range(len(batches))], [val.get(b, float("nan")) for b in batches], w,
                   label=s)
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(batches))], batches, rotation=45, ha="right", fontsize=7)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_ylabel("step time / lower bound")
        ax.set_title(mesh, fontsize=9)
        ax.legend(fontsize=7, ncol=min(len(systems), 7))
    fig.tight_layout()
    files.append(out_dir / "step_over_lb.png")
    fig.savefig(files[-1], dpi=100)
    plt.close(fig)
    fig, axes = plt.subplots(1, len(meshes), figsize=(4.5 * len(meshes), 4), squeeze=False)
    for ax, mesh in zip(axes[0], meshes):
        data = [[r["speedup_vs_fixed"] for r in ok if r["mesh"] == mesh and r["system"] == s
                 and "speedup_vs_fixed" in r] for s in systems]
        ax.boxplot([d if d else [float("nan")] for d in data])
        ax.set_xticks(range(1, len(systems) + 1), systems, rotation=45, ha="right")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_ylabel("speedup over fixed")
        ax.set_title(mesh, fontsize=9)
    fig.tight_layout()
    files.append(out_dir / "speedup_vs_fixed.png")
    fig.savefig(files[-1], dpi=100)
    plt.close(fig)
    return files


def step_bench(batches_path: str, systems="all", out_dir="out/step_bench", names=None, model="llama3-8b",
               profile="h100", recompute="full", block_size: int = 2048, show_progress: bool = True,
               log=None, pp: int = 1, vp: int = 1, partials_dtype: str = "float32", keep_kv: bool = False) -> dict:
    """Run the suite (:func:`run_suite`), write ``step_bench.json``, ``summary.txt`` and the plots into
    ``out_dir``; the rows, the summary and the files written."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..step import load_model
    load_model(model)                    # a bad model, system or folder fails before any planning
    sys_names = system_list(systems)
    out = ensure_out_dir(out_dir)
    batches = load_batches(batches_path, names)
    if not batches:
        raise BatchError(f"{batches_path}: no batch to run")
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  disable=not show_progress, transient=False) as bar:
        task = bar.add_task("step bench", total=len(batches) * len(sys_names))

        def advance(batch, system):
            bar.update(task, advance=1, description=f"{batch} {system}")
        rows = run_suite(batches, sys_names, model=model, profile=profile, recompute=recompute,
                         block_size=block_size, progress=advance, log=log, pp=pp, vp=vp,
                         partials_dtype=partials_dtype, keep_kv=keep_kv)
    lines, res = summary(rows)
    text = table(rows) + "\n\n" + "\n".join(lines)
    model_name = load_model(model).name
    try:
        (out / "step_bench.json").write_text(json.dumps({"model": model_name, "profile": profile,
                                                         "recompute": recompute, "pp": pp, "vp": vp, "rows": rows,
                                                         "summary": res},
                                                        indent=1))
        (out / "summary.txt").write_text(text + "\n")
        plots = plot(rows, out)
    except OSError as e:
        raise PlanError(f"step bench: cannot write into {out}: {e.strerror or e}") from None
    return {"rows": rows, "summary": res, "text": text,
            "files": [out / "step_bench.json", out / "summary.txt", *plots]}
