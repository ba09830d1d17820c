"""The step report (``plan step compare ... --html F``): one self-contained
HTML page — no script, no network, inline SVG and CSS — with the compare
table and, per system, the per-rank timeline of the whole simulated step
(with a pipeline: every rank of every stage, its forward and backward ops
as the schedule simulation placed them).

Per rank (one row each) and per micro-batch it runs, between the
micro-batch's simulated start and end (:func:`simulate.simulate_step`):
linear forward (every layer's projections and MLP, and the output layer),
attention forward, linear backward, attention backward (the backward
phases include the full-recompute forward), each summed over the layers and
drawn one after the other, then the time the rank waits for its group's
slowest device (idle); between micro-batches and after its last one, idle
until the group or the step's last rank is done; then the exposed part of
the gradient reduction, up to the step time. A rank's row therefore spans
exactly ``[0, step_s]``, and every drawn length is the simulation's. (Inside
a micro-batch the layers interleave forward and backward work; the report
shows their sums, not their order.)

Every name (systems, batch, model, errors) is HTML-escaped; numbers are
formatted by this module. The SVG of a system carries ``data-step-s`` (its
simulated step time) and ``data-px`` (pixels for that time), so a reader
can take any rectangle's times back from its ``x`` and ``width``.
"""

from __future__ import annotations

import html

import numpy as np

from .ir import StepProblem
from .lower import Lowered
from .model import LINEAR_BWD_FACTOR
from .pipeline import recomputed_units
from .simulate import rates

PHASES = (("lf", "linear forward", "#4e79a7"), ("af", "attention forward", "#f28e2b"),
          ("lb", "linear backward", "#76b7b2"), ("ab", "attention backward", "#e15759"),
          ("pf", "pipeline forward op", "#59a14f"), ("pb", "pipeline backward op", "#edc948"),
          ("pr", "pipeline backward op, its dropped forward recomputed first", "#ff9da7"),
          ("gr", "exposed gradient reduction", "#b07aa1"), ("id", "idle", "#e8e8e8"))
WIDTH = 900.0      # pixels of the longest step among the systems
ROW, GAP, LEFT = 9, 2, 60


def mb_phases(problem: StepProblem, low: Lowered) -> np.ndarray:
    """Per device of one micro-batch's group: seconds of linear fwd, attention fwd, linear bwd, attention
    bwd over the whole micro-batch (all layers, output layer, recompute forward in the backward)."""
    r = rates(problem)
    L = problem.model.layers
    rec = problem.mesh.recompute == "full"
    lin = low.tokens * r["lin"]
    head = low.tokens * r["head"]
    lf = L * lin + head
    af = L * low.fwd_busy
    lb = L * (LINEAR_BWD_FACTOR * lin + (lin if rec else 0.0)) + LINEAR_BWD_FACTOR * head
    ab = L * (low.bwd_busy + (low.fwd_busy if rec else 0.0))
    return np.stack([lf, af, lb, ab], 1)


def pipeline_segments(compiled) -> list[list[tuple[float, float, str, int]]]:
    """With a pipeline schedule: per global rank (stage-major: stage ``s`` holds rows ``s·n .. s·n + n−1``),
    every forward and backward op of its micro-batches on its stage's model chunks as simulated
    (:mod:`attnplan.step.pipesim`), idle between them, then the exposed gradient reduction of its stage —
    stages × time."""
    plan, rep = compiled.plan, compiled.report
    pipe = rep["pipeline"]
    n, P = plan.problem.mesh.stage_devices, pipe["stages"]
    start, end = np.asarray(pipe["mb_start_s"], float), np.asarray(pipe["mb_end_s"], float)
    ops: list[list[tuple[float, float, str, int]]] = [[] for _ in range(n * P)]
    redo = recomputed_units(plan)
    for m in range(plan.n_mb):
        back = "pr" if redo[plan.mb_slot[m]] else "pb"
        for c in range(start.shape[1]):
            s = c % P
            for k, phase in ((0, "pf"), (1, back)):
                for r in plan.mb_ranks(m).tolist():
                    ops[s * n + r].append((float(start[m, c, k]), float(end[m, c, k]), phase, m))
    out: list[list[tuple[float, float, str, int]]] = []
    for g, row in enumerate(ops):
        row.sort()
        segs, t = [], 0.0
        for t0, t1, phase, m in row:
            if t0 > t:
                segs.append((t, t0, "id", -1))
            if t1 > t0:
                segs.append((t0, t1, phase, m))
            t = max(t, t1)
        done = float(pipe["stage_grad_end_s"][g // n])
        if rep["compute_end_s"] > t:
            segs.append((t, rep["compute_end_s"], "id", -1))
            t = rep["compute_end_s"]
        if done > t:
            segs.append((t, done, "gr", -1))
            t = done
        if rep["step_s"] > t:
            segs.append((t, rep["step_s"], "id", -1))
        out.append(segs)
    return out


def rank_segments(compiled) -> list[list[tuple[float, float, str, int]]]:
    """Per global rank: ``(t0, t1, phase, micro-batch)`` segments covering ``[0, step_s]`` in order
    (``-1``: not in a micro-batch). Zero-length segments are left out. A step on a pipeline schedule:
    :func:`pipeline_segments`."""
    if "pipeline" in compiled.report:
        return pipeline_segments(compiled)
    plan, lowered, rep = compiled.plan, compiled.lowered, compiled.report
    p = plan.problem
    n = p.mesh.stage_devices
    start, end = rep["per_mb"]["start_s"], rep["per_mb"]["end_s"]
    step, compute_end = rep["step_s"], rep["compute_end_s"]
    out: list[list[tuple[float, float, str, int]]] = [[] for _ in range(n)]
    clock = [0.0] * n

    def add(r, t0, t1, phase, m):
        if t1 > t0:
            out[r].append((t0, t1, phase, m))
    for r, order in enumerate(plan.rank_order()):
        for m in order:
            ranks = plan.mb_ranks(m).tolist()
            d = ranks.index(r)
            add(r, clock[r], start[m], "id", -1)
            t = start[m]
            for key, sec in zip(("lf", "af", "lb", "ab"), mb_phases(p, lowered[m])[d].tolist()):
                add(r, t, min(t + sec, end[m]), key, m)
                t = min(t + sec, end[m])
            add(r, t, end[m], "id", m)
            clock[r] = end[m]
        add(r, clock[r], compute_end, "id", -1)
        add(r, max(clock[r], compute_end), step, "gr", -1)
    return out


def _fmt_s(x: float) -> str:
    return f"{x * 1e3:,.1f} ms"


def _timeline_svg(name: str, compiled, scale: float) -> str:
    rep = compiled.report
    step = rep["step_s"]
    px = step * scale
    segs = rank_segments(compiled)
    n = len(segs)
    piped = "pipeline" in rep  # rows stage by stage: stage s, stage-local rank r
    stage_n = compiled.plan.problem.mesh.stage_devices
    h = n * (ROW + GAP) + 24
    parts = [f"<svg width='{LEFT + px + 40:.0f}' height='{h}' "
             f"data-system='{html.escape(name, quote=True)}' data-step-s='{step!r}' data-px='{px!r}' "
             f"role='img'><title>{html.escape(name)}: per-rank timeline, step {_fmt_s(step)}</title>"]
    for r, row in enumerate(segs):
        y = r * (ROW + GAP)
        label = f"s{r // stage_n} r{r % stage_n}" if piped else f"rank {r}"
        parts.append(f"<g data-rank='{r}'><text x='{LEFT - 4}' y='{y + ROW - 1}' class='lab'>{label}</text>")
        for t0, t1, phase, m in row:
            tip = f"mb {m}: " if m >= 0 else ""
            parts.append(f"<rect class='{phase}' x='{LEFT + t0 * scale:.2f}' y='{y}' "
                         f"width='{(t1 - t0) * scale:.2f}' height='{ROW}'><title>{tip}"
                         f"{dict((k, t) for k, t, _ in PHASES)[phase]} {_fmt_s(t1 - t0)}</title></rect>")
        parts.append("</g>")
    y = n * (ROW + GAP) + 14
    for frac in (0.0, 0.25, 0.5, 0.75, 1.0):
        parts.append(f"<text x='{LEFT + frac * px:.1f}' y='{y}' class='ax'>{_fmt_s(frac * step)}</text>")
    parts.append("</svg>")
    return "".join(parts)


def _table(rows: list[dict]) -> str:
    cols = [("system", "system"), ("micro_batches", "micro-batches"), ("step_s", "step"),
            ("lower_bound_s", "lower bound"), ("step_over_lower_bound", "step / LB"), ("dp_imbalance", "DP imb."),
            ("exposed_grad_s", "exposed grad"), ("peak_memory_bytes", "peak memory"), ("memory_cap_bytes", "cap"),
            ("plan_s", "plan"), ("speedup_vs_fixed", "vs fixed")]
    if any("bubble_ratio" in r for r in rows):
        cols.insert(6, ("bubble_ratio", "bubble"))
    out = ["<table><tr>" + "".join(f"<th>{html.escape(t)}</th>" for _, t in cols) + "</tr>"]
    for r in rows:
        if "error" in r:
            out.append(f"<tr><td>{html.escape(str(r['system']))}</td><td colspan='{len(cols) - 1}' class='err'>"
                       f"{html.escape(str(r['error']))}</td></tr>")
            continue
        cells = []
        for key, _ in cols:
            v = r.get(key)
            if key == "system":
                s = str(v)
            elif v is None:
                s = "-"
            elif key.endswith("_bytes"):
                s = f"{v / 2**30:.1f} GiB"
            elif key in ("step_s", "lower_bound_s", "exposed_grad_s"):
                s = _fmt_s(v)
            elif key == "plan_s":
                s = f"{v:.2f} s"
            elif key == "speedup_vs_fixed":
                s = f"{v:.2f}x"
            elif key == "micro_batches":
                s = str(int(v)) + _unkept_cell(r)
            elif key == "bubble_ratio":
                s = f"{v:.1%}"
            else:
                s = f"{v:.3f}"
            cells.append(f"<td>{html.escape(s)}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</table>")
    return "".join(out)


def _unkept_cell(r: dict) -> str:
    """After a row's micro-batch count: how many do not keep the forward's KV where the step asked to."""
    if "keep_kv" in dict(r.get("info") or {}):
        return " (none keeps KV)"
    return f" ({len(r['mb_unkept'])} without kept KV)" if r.get("mb_unkept") else ""


STYLE = ("body{font:13px sans-serif;margin:16px;color:#222}table{border-collapse:collapse;margin:8px 0}"
         "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}td:first-child{text-align:left}"
         ".err{color:#a00;text-align:left}.lab{font-size:8px;text-anchor:end}.ax{font-size:9px;text-anchor:middle}"
         ".key span{margin-right:12px}.key i{display:inline-block;width:10px;height:10px;margin-right:3px}"
         + "".join(f".{k}{{fill:{c}}}" for k, _, c in PHASES))


def render_step_html(problem: StepProblem, rows: list[dict], compiled: dict) -> str:
    """The report: the compare ``rows`` and, for every system in ``compiled`` (name → CompiledStep), its
    per-rank timeline, on one time scale (the longest step is :data:`WIDTH` pixels)."""
    mesh = problem.mesh
    title = (f"{problem.tokens:,} tokens in {problem.docs} documents, {problem.model.name}, {mesh.spec()} on "
             f"{mesh.nodes} node(s) of {mesh.devices_per_node}, {problem.profile.name}, recompute {mesh.recompute}")
    longest = max((c.report["step_s"] for c in compiled.values()), default=0.0)
    scale = WIDTH / longest if longest > 0 else 0.0
    key = "".join(f"<span><i style='background:{c}'></i>{html.escape(t)}</span>" for _, t, c in PHASES)
    body = [f"<h1>Step report</h1><p>{html.escape(title)}</p>", _table(rows),
            "<p class='key'>" + key + "</p><p>Per rank and micro-batch: its phases summed over the layers (the "
            "backward includes the recompute forward), then waiting for the group; the exposed gradient "
            "reduction ends the step. One time scale for every system.</p>"]
    for name, c in compiled.items():
        r = c.report
        body.append(f"<h2>{html.escape(name)}</h2><p>{html.escape(c.plan.system)}: step {_fmt_s(r['step_s'])}, "
                    f"{r['micro_batches']} micro-batches, compute ends {_fmt_s(r['compute_end_s'])}, exposed "
                    f"gradient reduction {_fmt_s(r['exposed_grad_s'])}</p>")
        body.append(_timeline_svg(name, c, scale))
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>attnplan step report</title>"
            f"<style>{STYLE}</style></head><body>" + "".join(body) + "</body></html>\n")
