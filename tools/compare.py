"""Compare strategies side by side on one batch (``plan compare``): every
strategy asked for is compiled, nothing is pruned. An entry is a strategy
name (its default pipeline) or ``name:variant``, the same placement with
another communication mode (:data:`COMM_VARIANTS`: ``zigzag:allgather``,
``per_doc:direct``, ``minheap:ring``...) (``auto``, which compiles
only the promising ones, is :mod:`attnplan.tools.auto`).

Every number in a row comes from the plan's own ``stats()`` (the definitions
of docs/DESIGN.md); a strategy that cannot take the batch (e.g. ulysses with more
devices than kv heads) gets a row with its error instead of stopping the
comparison."""

from __future__ import annotations

from .compiler import compile as compile_plan
from ..errors import AttnplanError, PlanError
from ..passes.comm import COMM_VARIANTS, parse_entry

__all__ = ["COMM_VARIANTS", "compare", "format_rows", "parse_entry"]

COLUMNS = ("strategy", "compute_imbalance", "token_imbalance", "comm_bytes_total", "comm_bytes_max", "predicted_s",
           "predicted_over_lower_bound", "plan_s", "last_stage_share", "kernel_work_ratio")


def row_of(name: str, plan) -> dict:
    s = plan.stats()
    return {"strategy": name, **{k: s[k] for k in COLUMNS[1:]}, "lower_bound_s": s["lower_bound_s"],
            "pipeline": s["pipeline"]}


def compare(strategies, progress=None, **compile_kwargs) -> tuple[list[dict], dict]:
    """Compile ``strategies`` (entries of :func:`parse_entry`) on one batch.
    Returns (rows, plans by entry)."""
    if "pipeline" in compile_kwargs:
        raise PlanError("compare takes strategy entries; a pipeline names one plan (compile it)")
    rows, plans = [], {}
    for name in strategies:
        parse_entry(name)  # a bad entry is the caller's error, not a strategy's row
        try:
            plan = compile_plan(strategy=name, **compile_kwargs)
        except AttnplanError as e:
            if not isinstance(e, PlanError):
                raise  # bad batch or mask: the same for every strategy
            rows.append({"strategy": name, "error": str(e).splitlines()[0]})
        else:
            plans[name] = plan
            rows.append(row_of(name, plan))
        if progress is not None:
            progress(name)
    return rows, plans


def format_rows(rows: list[dict]) -> str:
    w = max([11] + [len(r["strategy"]) for r in rows])
    head = f"{'strategy':<{w}} {'comp imb':>8} {'tok imb':>7} {'comm total':>11} {'comm max':>10} " \
           f"{'predicted':>10} {'pred/LB':>8} {'plan s':>7} {'last stg':>8} {'kern work':>9}"
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['strategy']:<{w}} {r['error']}")
            continue
        lines.append(f"{r['strategy']:<{w}} {r['compute_imbalance']:>8.3f} {r['token_imbalance']:>7.3f} "
                     f"{r['comm_bytes_total'] / 1e9:>9.3f}GB {r['comm_bytes_max'] / 1e9:>8.3f}GB "
                     f"{r['predicted_s'] * 1e3:>8.3f}ms {r['predicted_over_lower_bound']:>8.2f} "
                     f"{r['plan_s']:>7.3f} {r['last_stage_share']:>8.2f} {r['kernel_work_ratio']:>9.2f}")
    return "\n".join(lines)
