"""Systems side by side on one global batch (``plan step compare``): every
system asked for is planned, lowered, verified and simulated on the same
:class:`StepProblem`; a system that cannot plan the batch (a document no
group can hold, a device over its memory cap, a plan its verifier refuses)
gets a row with its one-line error instead of stopping the comparison; a bad
batch or mask fails before any system runs. Every number comes from the
system's own step report (:func:`attnplan.step.simulate.simulate_step`)."""

from __future__ import annotations

import re

from ..errors import PlanError, StepError, VerifyError
from .base import parse_system, system_names
from .driver import CompiledStep, compile_step
from .ir import StepProblem, kept_note
from .mesh import gib

COLUMNS = ("system", "micro_batches", "step_s", "lower_bound_s", "step_over_lower_bound", "dp_imbalance",
           "exposed_grad_s", "peak_memory_bytes", "memory_cap_bytes", "plan_s")


def system_list(text) -> list[str]:
    """``all`` (every registered system) or names separated by ``,`` outside braces, each checked."""
    if text is None or (isinstance(text, str) and text.strip() == "all"):
        return list(system_names())
    if not isinstance(text, str):
        raise StepError("systems must be text such as fixed,wlb or all")
    items, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "{") - (ch == "}")
        if ch == "," and depth == 0:
            items.append(cur.strip())
            cur = ""
        else:
            cur += ch
    items.append(cur.strip())
    items = [i for i in items if i]
    if not items:
        raise StepError(f"no system given in {text[:40]!r} (e.g. fixed,wlb or all)")
    for i in items:
        parse_system(i)
    return items


def row_of(name: str, c: CompiledStep) -> dict:
    r = c.report
    return {"system": name, **{k: r[k] for k in COLUMNS[1:]}, "spec": c.plan.system, "tokens": r["tokens"],
            "tokens_queued": r["tokens_queued"], "max_slots": r["max_slots"], "info": r["info"],
            "mb_unkept": r["mb_unkept"],
            "strategies": sorted(set(r["per_mb"]["strategy"])),
            **({"bubble_ratio": r["bubble_ratio"], "schedule": r["pipeline"]["schedule"]} if "pipeline" in r else {})}


def compare_systems(problem: StepProblem, names, progress=None) -> tuple[list[dict], dict[str, CompiledStep]]:
    """Plan ``problem`` with every system in ``names``; (rows, compiled steps by name). Rows gain
    ``speedup_vs_fixed`` when a ``fixed`` row planned."""
    rows, done = [], {}
    for name in names:
        try:
            c = compile_step(problem, name)
        except (StepError, PlanError, VerifyError) as e:  # this system's failure (a broken pass included)
            first, base = str(e).splitlines()[0], name.partition("{")[0]
            named = first.startswith((base, f"step plan of {base}"))  # each row names its system once
            rows.append({"system": name, "error": first if named else f"{base}: {first}"})
        else:
            done[name] = c
            rows.append(row_of(name, c))
        if progress is not None:
            progress(name)
    base = next((r for r in rows if r["system"].startswith("fixed") and "error" not in r), None)
    for r in rows:
        if base is not None and "error" not in r:
            r["speedup_vs_fixed"] = base["step_s"] / r["step_s"]
    return rows, done


_NO_FIT = re.compile(r"document \d+ \(([\d,]+) tokens\) does not fit .*?(?:of at most ([\d,]+) tokens.*?(\d+) devices"
                     r"|(\d+) devices.*?\(([\d,]+) tokens at most\))")


def way_forward(error: str, mesh, planned: list[str]) -> str | None:
    """For a system whose groups cannot hold a document: the CP size it would need, and which systems (of
    those that planned) and which meshes of the same devices can hold it; None for other errors."""
    m = _NO_FIT.search(error)
    others = [p for p in planned if not error.startswith(p)]
    if m is None and "over its cap of" in error:  # a micro-batch over the memory cap
        return "try " + ", ".join(others[:3]) if others else None
    if m is None:
        return None
    doc = int(m.group(1).replace(",", ""))
    cap, devices = (m.group(2), m.group(3)) if m.group(2) else (m.group(5), m.group(4))
    per_device = int(cap.replace(",", "")) / int(devices)
    need = -(-doc // max(1, int(per_device)))
    n = mesh.stage_devices
    meshes = [f"--mesh dp={n // c},cp={c}" for c in range(need, n + 1) if n % c == 0][:1]
    tries = ", ".join(others[:3] + meshes)
    return f"needs cp >= {need}" + (f": try {tries}" if tries else f": more than the {n} devices of a stage")


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def format_rows(rows: list[dict], mesh=None) -> str:
    """The comparison table; with a pipeline (any row with a schedule) a ``bubble`` column: the share of
    the compute span a stage idles, averaged over stages."""
    pipe = any("bubble_ratio" in r for r in rows) or (mesh is not None and mesh.pp > 1)
    w = max([14] + [len(str(r["system"])) + 1 for r in rows if "error" not in r])
    head = (f"{'system':<{w}} {'mb':>4} {'step ms':>9} {'bound ms':>9} {'step/LB':>7} {'DP imb':>6} "
            + (f"{'bubble':>6} " if pipe else "")
            + f"{'grad ms':>7} {'peak GiB':>8} {'cap':>5} {'plan s':>6} {'vs fixed':>8}")
    lines = [head]
    planned = [r["system"] for r in rows if "error" not in r]
    notes = []
    for r in rows:
        if "error" in r:
            hint = way_forward(r["error"], mesh, planned) if mesh is not None else None
            lines.append(f"{r['system']:<{w}} {r['error']}" + (f"; {hint}" if hint else ""))
            continue
        fallback = dict(r.get("info") or {}).get("fallback")
        if fallback:
            notes.append(f"* {r['system']}: {fallback}")
        kept = kept_note(dict(r.get("info") or {}), r.get("mb_unkept"), r["micro_batches"])
        if kept:
            notes.append(f"  {r['system']}: {kept}")
        vs = f"{r['speedup_vs_fixed']:.2f}x" if "speedup_vs_fixed" in r else "-"
        name = r["system"] + ("*" if fallback else "")
        lines.append(f"{name:<{w}} {r['micro_batches']:>4} {r['step_s'] * 1e3:>9.1f} "
                     f"{r['lower_bound_s'] * 1e3:>9.1f} {r['step_over_lower_bound']:>7.3f} {r['dp_imbalance']:>6.3f} "
                     + (f"{_pct(r.get('bubble_ratio')):>6} " if pipe else "")
                     + f"{r['exposed_grad_s'] * 1e3:>7.1f} {r['peak_memory_bytes'] / 2**30:>8.1f} "
                     f"{gib(r['memory_cap_bytes']):>5} {r['plan_s']:>6.2f} {vs:>8}")
    return "\n".join(lines + notes)
