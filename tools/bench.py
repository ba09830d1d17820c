"""``plan bench``: every strategy on every batch of a workload file, for
several masks and device counts — a progress bar, a summary table, a JSON
file of every row and PNG plots.

Reference numbers computed outside attnplan (on the same shipped batches,
with the deployed systems' own code: zigzag CP, per-document CP, DCP's
planner) are printed beside the table so the strategies can be read against
what is deployed today."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path

from ..errors import BatchError, PlanError
from ..frontend import load_batch
from ..ir.limits import MAX_BATCH_FILE, MAX_DEVICES
from .compare import compare

# Deployed baselines on batches.jsonl, computed independently of attnplan (causal).
REFERENCES = [
    ("whole-sequence zigzag, compute imbalance, 8 devices (median)", "2.06"),
    ("whole-sequence zigzag, compute imbalance, 32 devices (median / worst)", "2.52 / 6.41"),
    ("per-document zigzag, work with 128-row tiles / exact, 32 devices (median; llama3sft)", "1.41x (7.4x)"),
    ("DCP planner (eps=0.1), compute imbalance at 4x8: longalign-128k-0 / libra-128k-0 / github-128k-0 / "
     "commoncrawl-128k-0", "1.44 / 3.03 / 4.53 / 12.8 (3-16 s each)"),
]


def _read_text(path: str) -> str:
    p = Path(path)
    try:
        if not p.is_file():
            raise BatchError(f"batch file not found: {path}")
        if p.stat().st_size > MAX_BATCH_FILE:
            raise BatchError(f"{path}: {p.stat().st_size:,} bytes, over the limit of {MAX_BATCH_FILE:,} for a "
                             f"batch file")
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BatchError(f"{path}: cannot read batch file: {getattr(e, 'strerror', None) or e}") from None


def _line_name(path: str, lineno: int, line: str):
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError):
        raise BatchError(f"{path}:{lineno}: not a JSON line") from None
    if not isinstance(rec, dict):
        raise BatchError(f"{path}:{lineno}: expected a JSON object with 'seqlens', got {type(rec).__name__}")
    return rec.get("name")


def _self_attention(b, where: str):
    """``b``, refused if it is a cross-attention batch (the suites are self-attention)."""
    if b.seqlens_k is not None:
        raise BatchError(f"{where}: a cross-attention batch; plan bench and plan step take self-attention batches "
                         f"(plan compile and plan compare take both)")
    return b


def load_batches(path: str, names: list[str] | None = None) -> list[dict]:
    """Every batch of a JSONL file (or the one batch of a JSON file), or those named."""
    if not str(path).endswith(".jsonl"):
        b = _self_attention(load_batch(path), path)
        return [{"name": getattr(b, "name", None) or Path(path).stem, "seqlens": list(b.seqlens),
                 "segments": b.segments}]
    out = []
    for lineno, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        name = _line_name(path, lineno, line)
        if names and name not in names:
            continue
        b = _self_attention(load_batch(f"{path}:{name}") if name else load_batch(path), f"{path}:{lineno}")
        out.append({"name": name or Path(path).stem, "seqlens": list(b.seqlens), "segments": b.segments})
    if names and not out:
        raise BatchError(f"{path}: no batch named {', '.join(names)}")
    return out


def run_bench(batches, masks, devices, strategies, *, heads=8, kv_heads=2, head_dim=128, block_size=2048,
              profile="h100", show_progress=True, dtype="bfloat16", partials_dtype="float32",
              keep_kv=False) -> list[dict]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    rows = []
    jobs = [(b, m, n) for b in batches for m in masks for n in devices]
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  disable=not show_progress, transient=False) as bar:
        task = bar.add_task("bench", total=len(jobs) * len(strategies))
        for b, mask, n in jobs:
            bar.update(task, description=f"{b['name']} {mask} x{n}")
            got, _ = compare(strategies, progress=lambda _: bar.advance(task), seqlens=b["seqlens"],
                             segments=b["segments"], mask=mask, devices=n, nodes=max(1, n // 8), heads=heads,
                             kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, profile=profile,
                             dtype=dtype, partials_dtype=partials_dtype, keep_kv=keep_kv)
            for r in got:
                rows.append({"batch": b["name"], "mask": mask, "devices": n, "tokens": sum(b["seqlens"]), **r})
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per (mask, devices, strategy): medians and worst cases over the batches."""
    out = []
    keys = sorted({(r["mask"], r["devices"], r["strategy"]) for r in rows})
    for mask, n, strat in keys:
        rs = [r for r in rows if (r["mask"], r["devices"], r["strategy"]) == (mask, n, strat)]
        ok = [r for r in rs if "error" not in r]
        if not ok:
            out.append({"mask": mask, "devices": n, "strategy": strat, "batches": 0, "errors": len(rs)})
            continue
        imb = [r["compute_imbalance"] for r in ok]
        zz = {r["batch"]: r["comm_bytes_total"] for r in rows if "error" not in r and r["strategy"] == "zigzag"
              and (r["mask"], r["devices"]) == (mask, n)}
        rel = [r["comm_bytes_total"] / zz[r["batch"]] for r in ok if zz.get(r["batch"])]
        out.append({
            "mask": mask, "devices": n, "strategy": strat, "batches": len(ok), "errors": len(rs) - len(ok),
            "imbalance_median": statistics.median(imb), "imbalance_worst": max(imb),
            "within_1.05": sum(i <= 1.05 for i in imb) / len(imb),
            "comm_vs_zigzag_median": statistics.median(rel) if rel else None,
            "pred_over_lb_median": statistics.median(r["predicted_over_lower_bound"] for r in ok),
            "plan_s_median": statistics.median(r["plan_s"] for r in ok),
            "plan_s_max": max(r["plan_s"] for r in ok),
            "last_stage_share_median": statistics.median(r["last_stage_share"] for r in ok),
        })
    return out


def best_per_batch(rows: list[dict]) -> list[dict]:
    """Per (mask, devices): each batch's best strategy by predicted / lower
    bound, the median of those bests and how often each strategy won."""
    out = []
    for mask, n in sorted({(r["mask"], r["devices"]) for r in rows}):
        best: dict = {}
        for r in rows:
            if (r["mask"], r["devices"]) == (mask, n) and "error" not in r:
                b = best.get(r["batch"])
                if b is None or (r["predicted_over_lower_bound"], r["strategy"]) < b:
                    best[r["batch"]] = (r["predicted_over_lower_bound"], r["strategy"])
        if best:
            wins = Counter(s for _, s in best.values())
            out.append({"mask": mask, "devices": n, "batches": len(best),
                        "pred_over_lb_median": statistics.median(v for v, _ in best.values()),
                        "pred_over_lb_worst": max(v for v, _ in best.values()), "wins": dict(sorted(wins.items()))})
    return out


def format_best(best: list[dict]) -> str:
    lines = [f"{'mask':<24} {'dev':>4} best of all, per batch: {'n':>3} {'pred/LB med':>11} {'worst':>7}  wins"]
    for b in best:
        wins = ", ".join(f"{k} {v}" for k, v in b["wins"].items())
        lines.append(f"{b['mask']:<24} {b['devices']:>4} {'':<23} {b['batches']:>3} {b['pred_over_lb_median']:>11.2f} "
                     f"{b['pred_over_lb_worst']:>7.2f}  {wins}")
    return "\n".join(lines)


def format_summary(summary: list[dict]) -> str:
    w = max([11] + [len(s["strategy"]) for s in summary])  # NAME:VARIANT entries widen the column
    lines = [f"{'mask':<24} {'dev':>4} {'strategy':<{w}} {'n':>3} {'imb med':>7} {'imb max':>7} {'<=1.05':>6} "
             f"{'comm/zz':>7} {'pred/LB':>7} {'plan s':>7} {'plan max':>8}"]
    for s in summary:
        if not s["batches"]:
            lines.append(f"{s['mask']:<24} {s['devices']:>4} {s['strategy']:<{w}}   0 (errors: {s['errors']})")
            continue
        rel = f"{s['comm_vs_zigzag_median']:.2f}" if s["comm_vs_zigzag_median"] is not None else "-"
        lines.append(f"{s['mask']:<24} {s['devices']:>4} {s['strategy']:<{w}} {s['batches']:>3} "
                     f"{s['imbalance_median']:>7.3f} {s['imbalance_worst']:>7.3f} {s['within_1.05']:>6.0%} "
                     f"{rel:>7} {s['pred_over_lb_median']:>7.2f} {s['plan_s_median']:>7.3f} {s['plan_s_max']:>8.3f}")
    lines.append("")
    lines.append("reference numbers (computed outside attnplan on the shipped batches, for the 128K batches):")
    lines += [f"  {k}: {v}" for k, v in REFERENCES]
    return "\n".join(lines)


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
    """Box plots per strategy of predicted / lower bound and of compute
    imbalance, one panel per (mask, devices)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    files = []
    groups = sorted({(r["mask"], r["devices"]) for r in rows})
    strategies = sorted({r["strategy"] for r in rows})
    for metric, label, fname in (("predicted_over_lower_bound", "predicted / lower bound", "pred_over_lb.png"),
                                 ("compute_imbalance", "compute imbalance (max/mean FLOPs)", "imbalance.png")):
        fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 4), squeeze=False)
        for ax, (mask, n) in zip(axes[0], groups):
            data = [[r[metric] for r in rows if "error" not in r and r["strategy"] == s
                     and (r["mask"], r["devices"]) == (mask, n)] for s in strategies]
            ax.boxplot([d if d else [float("nan")] for d in data])
            ax.set_xticks(range(1, len(strategies) + 1), strategies, rotation=45, ha="right")
            ax.set_yscale("log")
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
            ax.set_title(f"{mask}, {n} devices", fontsize=9)
            ax.set_ylabel(label)
        fig.tight_layout()
        path = out_dir / fname
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    return files


def _check_options(masks, devices, strategies) -> None:
    if not masks or not all(isinstance(m, str) and m.strip() for m in masks):
        raise PlanError(f"bench: give at least one mask, and no empty one (got {list(masks)!r})")
    if not devices or not all(isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_DEVICES
                              for n in devices):
        raise PlanError(f"bench: device counts must be integers in 1..{MAX_DEVICES}, got {list(devices)!r}")
    if not strategies:
        raise PlanError("bench: give at least one strategy")


def ensure_out_dir(path) -> Path:
    """A folder for several output files, created if missing (PlanError if it cannot be)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise PlanError(f"{path}: not a folder (--out names a folder for bench.json, summary.txt and plots)")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PlanError(f"{path}: cannot create folder: {e.strerror or e}") from None
    return p


def bench(batches_path: str, masks, devices, strategies, out_dir, names=None, **kw) -> dict:
    _check_options(masks, devices, strategies)
    out = ensure_out_dir(out_dir)
    batches = load_batches(batches_path, names)
    rows = run_bench(batches, masks, devices, strategies, **kw)
    summary, best = summarize(rows), best_per_batch(rows)
    text = format_summary(summary) + "\n\n" + format_best(best)
    try:
        (out / "bench.json").write_text(json.dumps({"rows": rows, "summary": summary, "best": best}, indent=1))
        (out / "summary.txt").write_text(text + "\n")
        plots = plot(rows, out)
    except OSError as e:
        raise PlanError(f"bench: cannot write into {out}: {e.strerror or e}") from None
    return {"rows": rows, "summary": summary, "best": best, "text": text,
            "files": [out / "bench.json", out / "summary.txt", *plots]}
