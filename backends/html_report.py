"""The self-contained HTML report: :func:`render_html` (one plan) and
:func:`render_compare_html` (several plans of one batch side by side).

One file, no network: the page's CSS and script are package data
(``backends/report/report.css``, ``report.js``) inlined into the page, and
the panels' data is one JSON payload in a ``<script type="application/json">``
element. Every string that reaches the page — strategy and plan names, the
mask text, profile names, the explanation — is either HTML-escaped (in the
markup) or JSON-encoded with ``<``, ``>``, ``&``, U+2028 and U+2029 written
as ``\\u`` escapes (in the payload), so no name can end or comment out an
element; the page is pure ASCII.
"""

from __future__ import annotations

import functools
import html
import json
from importlib import resources
from typing import Any

import numpy as np

from ..errors import PlanError
from ..ir.program import KINDS
from .explain import explain
from .palette import MERGE_COLOUR, RECV_COLOUR, SEND_COLOUR, STAGE_COLOURS, WAIT_COLOUR, device_palette
from .panels import BAR_LABELS, panel_data, plan_profile

# characters that could end or comment out the <script> element holding the payload, or
# end a JavaScript string if the payload were ever evaluated as code
_JSON_HTML_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}
_JSON_HTML_TABLE = str.maketrans(_JSON_HTML_ESCAPES)


def json_for_html(obj) -> str:
    """``obj`` as compact JSON that is safe inside any HTML element: ``<``,
    ``>``, ``&``, U+2028 and U+2029 become ``\\u`` escapes (they can only occur
    inside JSON strings, where the escape means the same character), and
    non-ASCII characters are escaped too."""
    try:
        text = json.dumps(obj, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    except ValueError as e:  # nan or inf: JSON.parse would reject the page's data
        raise PlanError(f"report data is not finite ({e})") from None
    return text.translate(_JSON_HTML_TABLE)


@functools.lru_cache(maxsize=None)
def _asset(name: str) -> str:
    """A file of the page (``report.js``, ``report.css``) from the package data."""
    return resources.files(__package__).joinpath("report", name).read_text(encoding="utf-8")


def _script() -> str:
    """The page's script, pure ASCII: its few non-ASCII characters (µ, ×, →, …) as JS escapes."""
    return _asset("report.js").encode("ascii", "backslashreplace").decode("ascii")


# ----------------------------------------------------------------------------------------------
# tables
# ----------------------------------------------------------------------------------------------

def summary_rows(s: dict) -> list[tuple[str, str]]:
    """The head of ``plan stats`` as (label, value) rows."""
    def by(x):
        return f"{x / 1e6:.2f} MB" if x < 1e9 else f"{x / 1e9:.2f} GB"
    return [
        ("devices × nodes", f"{s['devices']} on {s['nodes']} node(s)"),
        ("tokens / samples", f"{s['tokens']:,} / {s['samples']:,}"),
        ("heads q/kv × dim", f"{s['heads']}/{s['kv_heads']} × {s['head_dim']} ({s['dtype']})"
                             + (f", kv heads copied ×{s['kv_copies']}" if s.get("kv_copies", 1) > 1 else "")),
        ("pairs", f"{s['pairs']:,}"),
        ("flops fwd", f"{s['flops_fwd']:.3e}"),
        ("compute imbalance", f"{s['compute_imbalance']:.3f}"),
        ("token imbalance", f"{s['token_imbalance']:.3f}"),
        ("comm total (fwd+bwd)", by(s["comm_bytes_total"])),
        ("comm max per device", by(s["comm_bytes_max"])),
        ("messages (blocks)", f"{s['messages']:,} ({s['transfers']:,})"),
        ("predicted", f"{s['predicted_s'] * 1e3:.3f} ms ({s['profile']})"),
        ("predicted fwd / bwd", f"{s['predicted_fwd_s'] * 1e3:.3f} / {s['predicted_bwd_s'] * 1e3:.3f} ms"),
        ("lower bound", f"{s['lower_bound_s'] * 1e3:.3f} ms"),
        ("predicted / bound", f"{s['predicted_over_lower_bound']:.2f}"),
        ("kernel work ratio", f"{s.get('kernel_work_ratio', 1.0):.3f}"),
        ("blocks", f"{s['token_blocks']:,} token, {s['compute_blocks']:,} compute, {s['instructions']:,} instr"),
        ("plan time", f"{s['plan_s']:.3f} s"),
        ("pipeline", s.get("pipeline", "")),
    ]


# rows of the comparison table whose smallest value is best (highlighted)
_LOWER_IS_BETTER = {"compute imbalance": "compute_imbalance", "token imbalance": "token_imbalance",
                    "comm total (fwd+bwd)": "comm_bytes_total", "comm max per device": "comm_bytes_max",
                    "predicted": "predicted_s", "predicted / bound": "predicted_over_lower_bound",
                    "plan time": "plan_s"}


def _summary_table(names: list[str], stats: list[dict]) -> str:
    rows = [summary_rows(s) for s in stats]
    head = "".join(f"<th>{html.escape(n)}</th>" for n in names) if len(names) > 1 else "<th></th>"
    out = [f"<table class='summary'><thead><tr><th>stat</th>{head}</tr></thead><tbody>"]
    for i, (label, _) in enumerate(rows[0]):
        key = _LOWER_IS_BETTER.get(label) if len(stats) > 1 else None
        best = min(s[key] for s in stats) if key else None
        cells = [f"<td{' class=best' if key and s[key] == best else ''}>{html.escape(r[i][1])}</td>"
                 for s, r in zip(stats, rows)]
        out.append(f"<tr><th>{html.escape(label)}</th>{''.join(cells)}</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _device_table(s: dict) -> str:
    pd = s["per_device"]
    mean = max(1.0, float(np.mean(pd["flops"])))
    rows = [("<table class='devs'><thead><tr><th>dev</th><th>tokens</th><th>flops/mean</th><th>comm in</th>"
             "<th>comm out</th><th>mem fwd</th><th>mem bwd</th><th>fwd ms</th><th>bwd ms</th></tr></thead><tbody>")]
    for d in range(s["devices"]):
        rows.append(f"<tr><td>d{d}</td><td>{pd['tokens'][d]:,}</td><td>{pd['flops'][d] / mean:.3f}</td>"
                    f"<td>{pd['comm_in_bytes'][d] / 1e6:.2f} MB</td><td>{pd['comm_out_bytes'][d] / 1e6:.2f} MB</td>"
                    f"<td>{pd['memory_fwd_bytes'][d] / 1e6:.2f} MB</td>"
                    f"<td>{pd['memory_bwd_bytes'][d] / 1e6:.2f} MB</td>"
                    f"<td>{pd['predicted_fwd_s'][d] * 1e3:.4f}</td><td>{pd['predicted_bwd_s'][d] * 1e3:.4f}</td></tr>")
    rows.append("</tbody></table>")
    return "".join(rows)


def _legend(stages: int) -> str:
    sw = [(STAGE_COLOURS[s % len(STAGE_COLOURS)], f"compute, stage {s}") for s in range(min(stages, 9))]
    if stages > 9:
        sw.append(("#fff", f"… {stages} stages (colours repeat)"))
    sw += [(MERGE_COLOUR, "merge/add of partials"), (WAIT_COLOUR, "waiting on a message"),
           (SEND_COLOUR, "sending (thin, upper)"), (RECV_COLOUR, "receiving (thin, lower)")]
    return "<div class='legend'>" + "".join(
        f"<span><i style='background:{c}'></i>{html.escape(t)}</span>" for c, t in sw) + "</div>"


# ----------------------------------------------------------------------------------------------
# the payload: panel data in the compact form the page's script reads
# ----------------------------------------------------------------------------------------------

def _ints(a) -> list:
    return np.asarray(a).astype(np.int64).tolist()


def _us(a) -> list:
    """Seconds → microseconds, 4 decimals (0.1 ns), for the page."""
    return np.round(np.asarray(a, float) * 1e6, 4).tolist()


def _mask_page(m: dict) -> dict:
    return {"tokens": m["tokens"], "heads": m["heads"], "n_tb": m["n_tb"], "n_cb": m["n_cb"],
            "spans": bool(m["spans"]), "bins": m["bins"], "aggregated": bool(m["aggregated"]),
            "edges": _ints(m["edges"]),
            "bin_tb0": _ints(m["bin_tb0"]), "docs": _ints(m["doc_offsets"]),
            "cells": {"q": _ints(m["q"]), "k": _ints(m["k"]), "pairs": _ints(m["pairs"]),
                      "blocks": _ints(m["blocks"]), "device": _ints(m["device"]),
                      "share": _ints(np.round(m["share"] * 1000)), "ndev": _ints(m["devices"]),
                      "s0": _ints(m["stage_min"]), "s1": _ints(m["stage_max"]), "c0": _ints(m["cb_min"]),
                      "c1": _ints(m["cb_max"]), "density": _ints(np.round(m["density"] * 1000))}}


def _timeline_page(L: dict) -> dict:
    sp = L["spans"]
    return {"makespan": float(L["makespan_s"] * 1e6), "eps": float(L["eps_s"] * 1e6),
            "events": L["events"], "finish": _us(L["finish_s"]),
            "compute": _us(L["compute_s"]), "wait": _us(L["wait_s"]),
            "spans": {"lane": _ints(sp["lane"]), "dev": _ints(sp["dev"]), "t0": _us(sp["t0"]),
                      "t1": _us(sp["t1"]), "n": _ints(sp["n"]), "busy": _us(sp["busy"]),
                      "key": _ints(sp["key"]), "a": _ints(sp["a"]), "b": _ints(sp["b"]),
                      "bytes": _ints(sp["bytes"]), "peer": _ints(sp["peer"]), "kind": _ints(sp["kind"]),
                      "tb": _ints(sp["tb"])}}


def _comm_page(c: dict, n: int) -> dict:
    """The non-empty cells of the device × device matrices."""
    nz = np.flatnonzero((c["fwd"] + c["bwd"] + c["count"]).ravel())
    return {"src": _ints(nz // n), "dst": _ints(nz % n), "fwd": _ints(c["fwd"].ravel()[nz]),
            "bwd": _ints(c["bwd"].ravel()[nz]), "count": _ints(c["count"].ravel()[nz])}


def _page_data(name: str, plan, d: dict) -> dict:
    """Compact JSON-able form of :func:`panel_data` for the page's script."""
    ir = plan.ir
    b, t = d["bars"], d["timeline"]
    return {
        "name": name, "devices": ir.devices, "nodes": ir.nodes, "dpn": ir.placement.devices_per_node,
        "strategy": plan.meta.get("strategy", ""), "stages": t["stages"],
        "mask": _mask_page(d["mask"]),
        "bars": [{"key": k, "label": BAR_LABELS[k][0], "unit": BAR_LABELS[k][1], "values": _ints(b[k]),
                  "mean": b["means"][k]} for k in BAR_LABELS],
        "comm": _comm_page(d["comm"], ir.devices),
        "timeline": {ph: _timeline_page(t[ph]) for ph in ("fwd", "bwd")},
    }


# ----------------------------------------------------------------------------------------------
# the page
# ----------------------------------------------------------------------------------------------

def _check_names(named: list) -> list[str]:
    if not named:
        raise PlanError("nothing to render: no plans given")
    names = [n for n, _ in named]
    if not all(isinstance(n, str) for n in names):
        raise PlanError(f"plan names must be strings, got {names!r}")
    if len(set(names)) != len(names):
        raise PlanError(f"plan names must be distinct, got {names}")
    return names


def _heading(name: str, cols: int) -> str:
    return f"<h3>{html.escape(name)}</h3>" if cols > 1 else ""


def _sections(names: list[str], texts: list[str], stats: list[dict]) -> dict:
    """The per-plan markup of every panel (canvases the script fills, tables, explanations)."""
    cols = len(names)

    def per_plan(body) -> str:
        return "".join(f"<div class='col'>{_heading(n, cols)}{body(i)}</div>" for i, n in enumerate(names))

    def bars(i: int) -> str:
        return "".join(f"<figure><figcaption data-bar='{i}-{j}'></figcaption><canvas class='bar' "
                       f"data-plan='{i}' data-metric='{j}'></canvas></figure>" for j in range(len(BAR_LABELS)))

    return {
        "explain": "".join(f"<div class='col'>{_heading(n, cols)}<pre>{html.escape(t)}</pre></div>"
                           for n, t in zip(names, texts)),
        "devtables": "".join(f"<details><summary>per device{(' — ' + html.escape(n)) if cols > 1 else ''}"
                             f"</summary>{_device_table(s)}</details>" for n, s in zip(names, stats)),
        "timelines": "".join(
            f"<div class='tl'>{_heading(n, cols)}"
            f"<h4>forward</h4><canvas class='timeline' data-plan='{i}' data-phase='fwd'></canvas>"
            f"<h4>backward</h4><canvas class='timeline' data-plan='{i}' data-phase='bwd'></canvas></div>"
            for i, n in enumerate(names)),
        "mask": per_plan(lambda i: f"<canvas class='mask' data-plan='{i}'></canvas>"),
        "bars": per_plan(lambda i: f"<div class='bars'>{bars(i)}</div>"),
        "heat": per_plan(lambda i: f"<canvas class='heat' data-plan='{i}'></canvas>"),
    }


def _render(named: list[tuple[str, Any]], profile, title: str) -> str:
    names = _check_names(named)
    datas, stats, texts = [], [], []
    # the timeline span budget is shared by the plans of a page, so a comparison stays as small as one report
    max_spans = max(2000, 20000 // len(named))
    for name, plan in named:
        prof = plan_profile(plan, profile)
        d = panel_data(plan, prof, max_spans=max_spans)
        datas.append(_page_data(name, plan, d))
        stats.append(d["stats"])
        texts.append(explain(plan, profile=prof, data=d))
    payload = {"plans": datas, "palette": device_palette(max(p.ir.devices for _, p in named)),
               "stage_palette": list(STAGE_COLOURS),
               "colours": {"merge": MERGE_COLOUR, "wait": WAIT_COLOUR, "send": SEND_COLOUR, "recv": RECV_COLOUR},
               "kinds": list(KINDS)}
    p = named[0][1].ir.problem
    sub = (f"{p.tokens:,} tokens in {len(p.seqlens):,} documents · mask <code>{html.escape(p.mask.strip())}</code>"
           f" · heads {p.heads}/{p.kv_heads} × {p.head_dim} · profile {html.escape(stats[0]['profile'])}")
    page = _TEMPLATE.format(
        title=html.escape(title), sub=sub, cols=len(named), css=_asset("report.css"), js=_script(),
        data=json_for_html(payload), summary=_summary_table(names, stats),
        legend=_legend(max(d["stages"] for d in datas)),
        **_sections(names, texts, stats))
    # pure ASCII, whatever encoding the file is written in: the script and the JSON are
    # already escaped, the rest uses character references
    return page.encode("ascii", "xmlcharrefreplace").decode("ascii")


def render_html(plan, profile=None, title: str | None = None) -> str:
    """One self-contained HTML report of ``plan`` (summary, mask, per-device
    bars, communication heatmap, forward/backward timelines, explanation).
    ``profile``: the caller's (name, FILE.json or Profile), else the plan's recorded builtin name."""
    name = plan.meta.get("strategy") or "plan"
    return _render([(name, plan)], profile, title or f"attnplan report — {name}, {plan.ir.devices} devices")


def render_compare_html(named_plans: list[tuple[str, Any]], profile=None, title: str | None = None) -> str:
    """The same panels side by side for several plans of one batch (e.g. one
    per strategy); bars and timelines share their scales across plans so
    heights and lengths compare directly."""
    named_plans = list(named_plans)
    if named_plans:
        toks = {p.ir.problem.tokens for _, p in named_plans}
        if len(toks) > 1:
            raise PlanError(f"compare needs plans of one batch; got token counts {sorted(toks)}")
    return _render(named_plans, profile,
                   title or "attnplan comparison — " + ", ".join(str(n) for n, _ in named_plans))


_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>{title}</title>
<style>
{css}</style></head>
<body style="--cols:{cols}">
<header><h1>{title}</h1><p>{sub}</p></header>
<section class="panel" data-panel="summary"><h2>Summary <small>(plan stats)</small></h2><div class="scroll">{summary}
{devtables}</div></section>
<section class="panel" data-panel="mask">
<h2>Mask by device <small>cells are compute blocks (or groups of them), colour =
device, shade = share of allowed pairs, outlines = documents; hover for details</small></h2>
<div class="cols">{mask}</div></section>
<section class="panel" data-panel="bars">
<h2>Per-device load <small>dashed line = mean; title gives max / mean</small></h2>
<div class="cols">{bars}</div></section>
<section class="panel" data-panel="heatmap"><h2>Bytes moved, device × device <small>rows send, columns receive;
lines mark nodes</small></h2><div class="cols">{heat}</div></section>
<section class="panel" data-panel="timeline"><h2>Simulated timeline <small>one row per device; hover a span</small></h2>
{legend}{timelines}</section>
<section class="panel" data-panel="explain"><h2>Explanation <small>(plan explain)</small></h2>
<div class="cols">{explain}</div></section>
<div id="tip" role="tooltip"></div>
<script type="application/json" id="attnplan-data">{data}</script>
<script>
{js}</script>
</body></html>
"""
