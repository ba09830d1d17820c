"""Plan visualizer: the data behind each picture, a self-contained HTML report, PNG figures.

The panels, each computed by one function from the plan alone (columnar
numpy, no HTML), so tests can check them against ``plan.stats()``:

* :func:`mask_cells` — the mask as a grid of compute blocks coloured by
  device, with document boundaries. When there are more token blocks than
  ``max_bins``, consecutive token blocks are grouped into at most
  ``max_bins`` bins of about equal tokens, so at most ``max_bins²`` cells are
  drawn; a cell keeps its exact pair count, its pairs per device (the
  dominant device colours it), its stages and the range of blocks it stands for.
* :func:`device_bars` — per device: forward attention FLOPs, tokens homed,
  buffer memory (forward, backward), bytes in and out, with their means.
* :func:`comm_matrix` — device × device bytes moved (forward, backward) and
  transfer counts.
* :func:`timeline` — the simulator's events (``cost.simulate(record=True)``)
  per device: compute by stage, merges, waits, sends and receives, forward
  and backward. Events closer than a time step are merged into spans; the
  step doubles until at most ``max_spans`` spans remain. Spans keep their busy
  seconds, event counts and bytes, so totals survive the merge. Also the
  exposed communication of each stage (waits, attributed to the stage of the
  compute block each wait delays; waits after a device's last compute block
  belong to its *tail*: merges of incoming partials and completion of sends).

:func:`render_html` and :func:`render_compare_html` write one HTML file with
inline CSS, JS and canvas drawing (no network); :func:`write_pngs` draws the
same pictures with matplotlib (Agg) for papers and terminals.
"""

from __future__ import annotations

import colorsys
import html
import json
from pathlib import Path

import numpy as np

from ..errors import PlanError
from ..ir.program import (
    BBYTES,
    BWD,
    FWD,
    KINDS,
    T_BYTES,
    T_DST,
    T_KIND,
    T_PHASE,
    T_SRC,
    T_TB,
)
from .cost import get_profile, simulate

# timeline lanes
L_COMPUTE, L_WAIT, L_SEND, L_RECV = range(4)
LANES = ("compute", "wait", "send", "recv")
# stage colours (compute spans); merges/adds, waits and transfers have their own
STAGE_COLOURS = ("#4c78a8", "#f58518", "#54a24b", "#b279a2", "#eeca3b", "#72b7b2", "#ff9da6", "#9d755d",
                 "#79706e")
MERGE_COLOUR, WAIT_COLOUR, SEND_COLOUR, RECV_COLOUR = "#9e9e9e", "#d62728", "#3f51b5", "#00897b"


def device_palette(n: int) -> list[str]:
    """``n`` distinct colours, neighbours far apart in hue (golden-angle steps),
    alternating lightness; the same in the HTML report and the PNGs."""
    out = []
    for i in range(n):
        h = (i * 0.381966) % 1.0
        light = (0.45, 0.62, 0.36)[i % 3]
        r, g, b = colorsys.hls_to_rgb(h, light, 0.62)
        out.append(f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}")
    return out


def _profile(plan, profile):
    return profile or plan.meta.get("profile", "h100")


# ----------------------------------------------------------------------------------------------
# panel data
# ----------------------------------------------------------------------------------------------

def _group_starts(sorted_keys: np.ndarray) -> np.ndarray:
    """Start index of every run of equal values in ``sorted_keys``."""
    if not len(sorted_keys):
        return np.zeros(0, np.int64)
    return np.concatenate([[0], np.flatnonzero(np.diff(sorted_keys)) + 1]).astype(np.int64)


def token_bins(graph, max_bins: int) -> np.ndarray:
    """Bin of every token block: one bin per block when there are at most
    ``max_bins``, else consecutive blocks grouped by their middle token into
    at most ``max_bins`` bins of about ``tokens / max_bins`` tokens."""
    if max_bins < 1:
        raise PlanError(f"max_bins must be positive, got {max_bins}")
    n = graph.n_tb
    if n <= max_bins:
        return np.arange(n, dtype=np.int64)
    T = int(graph.tb_end[-1])
    raw = ((graph.tb_start + graph.tb_end) * max_bins) // (2 * T)
    return np.unique(raw, return_inverse=True)[1].astype(np.int64)


def mask_cells(plan, max_bins: int = 160) -> dict:
    """The mask panel: compute blocks aggregated into cells of a (q bin, kv bin) grid.

    Returns ``edges`` (token position of each bin start, and T), ``bin_tb0``
    (first token block of each bin, and n_tb), ``doc_offsets``, per-cell
    columns ``q, k, pairs, blocks, device, share, devices, stage_min,
    stage_max, cb_min, cb_max, density`` (``pairs`` are allowed pairs × query
    heads; ``density`` = pairs / (heads × cell area); ``share`` = the dominant
    device's part of the pairs) and the exact per-(cell, device) breakdown
    ``cd_cell, cd_device, cd_pairs``."""
    ir = plan.ir
    g, pl, p = ir.graph, ir.placement, ir.problem
    n = ir.devices
    tb_bin = token_bins(g, max_bins)
    nb = int(tb_bin[-1]) + 1 if len(tb_bin) else 0
    bin_tb0 = np.searchsorted(tb_bin, np.arange(nb + 1)).astype(np.int64)
    edges = np.concatenate([g.tb_start[bin_tb0[:-1]], [p.tokens]]).astype(np.int64)
    cell = tb_bin[g.cb_q] * nb + tb_bin[g.cb_k]
    dev = pl.cb_device.astype(np.int64)
    pairs = g.cb_pairs.astype(np.int64)
    stage = ir.schedule.cb_stage.astype(np.int64) if ir.schedule is not None else np.zeros(g.n_cb, np.int64)
    # per (cell, device)
    key = cell * n + dev
    order = np.argsort(key, kind="stable")
    st = _group_starts(key[order])
    cd_key = key[order][st]
    cd_pairs = np.add.reduceat(pairs[order], st) if len(st) else np.zeros(0, np.int64)
    cd_cell, cd_device = cd_key // n, cd_key % n
    # per cell
    c_order = np.argsort(cell, kind="stable")
    cs = _group_starts(cell[c_order])
    cells = cell[c_order][cs]
    blocks = np.diff(np.concatenate([cs, [len(cell)]])).astype(np.int64)
    cell_pairs = np.add.reduceat(pairs[c_order], cs) if len(cs) else np.zeros(0, np.int64)
    s0 = np.minimum.reduceat(stage[c_order], cs) if len(cs) else np.zeros(0, np.int64)
    s1 = np.maximum.reduceat(stage[c_order], cs) if len(cs) else np.zeros(0, np.int64)
    ids = np.arange(g.n_cb, dtype=np.int64)[c_order]
    c0 = np.minimum.reduceat(ids, cs) if len(cs) else np.zeros(0, np.int64)
    c1 = np.maximum.reduceat(ids, cs) if len(cs) else np.zeros(0, np.int64)
    # dominant device: largest pairs within each cell (ties: lowest device)
    dom = np.lexsort((cd_device, -cd_pairs, cd_cell))
    ds = _group_starts(cd_cell[dom])
    top_dev = cd_device[dom][ds]
    top_pairs = cd_pairs[dom][ds]
    ndev = np.diff(np.concatenate([ds, [len(dom)]])).astype(np.int64)
    q, k = cells // nb if nb else cells, cells % nb if nb else cells
    area = (edges[q + 1] - edges[q]).astype(float) * (edges[k + 1] - edges[k])
    density = cell_pairs / np.maximum(1.0, area * p.heads)
    return {
        "tokens": p.tokens, "heads": p.heads, "n_tb": g.n_tb, "n_cb": g.n_cb, "bins": nb,
        "aggregated": nb < g.n_tb, "edges": edges, "bin_tb0": bin_tb0, "doc_offsets": p.offsets,
        "q": q, "k": k, "pairs": cell_pairs, "blocks": blocks, "device": top_dev,
        "share": top_pairs / np.maximum(1, cell_pairs), "devices": ndev, "stage_min": s0, "stage_max": s1,
        "cb_min": c0, "cb_max": c1, "density": np.minimum(1.0, density),
        "cd_cell": cd_cell, "cd_device": cd_device, "cd_pairs": cd_pairs,
    }


def device_bars(plan) -> dict:
    """Per-device loads: ``flops`` (forward attention), ``tokens`` (homed),
    ``memory_fwd``/``memory_bwd`` (buffer bytes), ``comm_in``/``comm_out``
    (bytes, forward + backward), each an int64 array; ``means`` of each."""
    ir = plan.ir
    g, pl, prog = ir.graph, ir.placement, ir.program
    n = ir.devices
    m = comm_matrix(plan)
    tot = m["fwd"] + m["bwd"]
    out = {
        "flops": np.bincount(pl.cb_device, weights=g.cb_flops(), minlength=n).astype(np.int64),
        "tokens": np.bincount(pl.home, weights=g.tb_len, minlength=n).astype(np.int64),
        "memory_fwd": np.array([b[:, BBYTES].sum() for b in prog.buffers[FWD]], np.int64),
        "memory_bwd": np.array([b[:, BBYTES].sum() for b in prog.buffers[BWD]], np.int64),
        "comm_in": tot.sum(axis=0).astype(np.int64),
        "comm_out": tot.sum(axis=1).astype(np.int64),
    }
    out["means"] = {k: float(v.mean()) if n else 0.0 for k, v in out.items()}
    return out


BAR_LABELS = {"flops": ("attention FLOPs (fwd)", "flop"), "tokens": ("tokens homed", "tok"),
              "memory_fwd": ("buffer memory, fwd", "B"), "memory_bwd": ("buffer memory, bwd", "B"),
              "comm_in": ("bytes in (fwd+bwd)", "B"), "comm_out": ("bytes out (fwd+bwd)", "B")}


def comm_matrix(plan) -> dict:
    """Bytes moved from device (row) to device (column): ``fwd``, ``bwd`` (int64
    ``[n, n]``) and ``count`` (transfers, both phases)."""
    prog = plan.ir.program
    n = plan.ir.devices
    X = prog.transfers
    src, dst, nb = X[:, T_SRC], X[:, T_DST], X[:, T_BYTES]
    flat = src * n + dst
    fwd = X[:, T_PHASE] == FWD
    mat = {}
    for name, sel in (("fwd", fwd), ("bwd", ~fwd)):
        mat[name] = np.bincount(flat[sel], weights=nb[sel], minlength=n * n).astype(np.int64).reshape(n, n)
    mat["count"] = np.bincount(flat, minlength=n * n).astype(np.int64).reshape(n, n)
    return mat


def _merge_spans(dev, t0, t1, key, ident, nbytes, peer, kind, tb, eps):
    """Merge events of one lane, per device in time order, into spans: a new
    span starts where the device or ``key`` changes or the gap to the
    span's furthest end exceeds ``eps``. Returns columns of the spans."""
    order = np.lexsort((t0, dev))
    dev, t0, t1, key, ident, nbytes, peer, kind, tb = (a[order] for a in (dev, t0, t1, key, ident, nbytes, peer,
                                                                          kind, tb))
    if not len(dev):
        z = np.zeros(0)
        return {c: z.astype(np.int64) if c not in ("t0", "t1", "busy") else z
                for c in ("dev", "t0", "t1", "n", "busy", "key", "a", "b", "bytes", "peer", "kind", "tb")}
    # running furthest end per device: offset each device's times past the previous ones
    span = float(max(t1.max(), t0.max())) + 1.0 + eps
    reach = np.maximum.accumulate(t1 + dev * span)
    new = np.ones(len(dev), bool)
    new[1:] = (dev[1:] != dev[:-1]) | (key[1:] != key[:-1]) | (t0[1:] + dev[1:] * span > reach[:-1] + eps)
    st = np.flatnonzero(new)
    stop = np.concatenate([st[1:], [len(dev)]])
    pmin, pmax = np.minimum.reduceat(peer, st), np.maximum.reduceat(peer, st)
    kmin, kmax = np.minimum.reduceat(kind, st), np.maximum.reduceat(kind, st)
    return {
        "dev": dev[st], "t0": t0[st], "t1": np.maximum.reduceat(t1, st), "n": (stop - st).astype(np.int64),
        "busy": np.add.reduceat(t1 - t0, st), "key": key[st], "a": np.minimum.reduceat(ident, st),
        "b": np.maximum.reduceat(ident, st), "bytes": np.add.reduceat(nbytes, st),
        "peer": np.where(pmin == pmax, pmin, -1), "kind": np.where(kmin == kmax, kmin, -1),
        "tb": np.where(stop - st == 1, tb[st], -1),
    }


def _lane_events(plan, ev: dict, stage_of_cb: np.ndarray) -> list[tuple]:
    """The events of one phase as lane columns ``(lane, dev, t0, t1, key, id, bytes, peer, kind, tb)``."""
    X = plan.ir.program.transfers
    C, R, W = ev["compute"], ev["transfer"], ev["wait"]
    lanes = []
    cb = C[:, 3].astype(np.int64)
    stg = np.where(cb >= 0, stage_of_cb[np.maximum(cb, 0)] if len(stage_of_cb) else 0, -1)
    zc = np.zeros(len(C), np.int64)
    lanes.append((L_COMPUTE, C[:, 0].astype(np.int64), C[:, 1], C[:, 2], stg, cb, zc, zc - 1, zc - 1, zc - 1))
    wt = W[:, 3].astype(np.int64)
    wd = W[:, 0].astype(np.int64)
    wsrc, wdst = X[wt, T_SRC], X[wt, T_DST]
    zw = np.zeros(len(W), np.int64)
    lanes.append((L_WAIT, wd, W[:, 1], W[:, 2], zw, wt, X[wt, T_BYTES], np.where(wsrc == wd, wdst, wsrc),
                  X[wt, T_KIND], X[wt, T_TB]))
    tt = R[:, 0].astype(np.int64)
    src, dst = R[:, 1].astype(np.int64), R[:, 2].astype(np.int64)
    zt = np.zeros(len(R), np.int64)
    for lane, d, peer in ((L_SEND, src, dst), (L_RECV, dst, src)):
        lanes.append((lane, d, R[:, 3], R[:, 4], zt, tt, X[tt, T_BYTES], peer, X[tt, T_KIND], X[tt, T_TB]))
    return lanes


def exposed_by_stage(plan, ev: dict, stage_of_cb: np.ndarray) -> dict:
    """Exposed communication of one phase: each wait is charged to the stage
    of the next compute block on its device (-1: the tail, after the last
    one). Returns ``{stage: {"total_s", "max_s", "device", "per_device"}}``:
    the sum over devices, the largest device's waits and which device that
    is, and every device's waits."""
    n = plan.ir.devices
    C, W = ev["compute"], ev["wait"]
    stage = np.full(len(W), -1, np.int64)
    real = C[C[:, 3] >= 0]
    for d in range(n):
        wsel = np.flatnonzero(W[:, 0] == d)
        if not len(wsel):
            continue
        cd = real[real[:, 0] == d]
        cd = cd[np.argsort(cd[:, 1], kind="stable")]
        pos = np.searchsorted(cd[:, 1], W[wsel, 2] - 1e-15, "left")
        ok = pos < len(cd)
        stage[wsel[ok]] = stage_of_cb[cd[pos[ok], 3].astype(np.int64)]
    out = {}
    dur = W[:, 2] - W[:, 1]
    for s in np.unique(stage).tolist():
        sel = stage == s
        per_dev = np.bincount(W[sel, 0].astype(np.int64), weights=dur[sel], minlength=n)
        out[int(s)] = {"total_s": float(per_dev.sum()), "max_s": float(per_dev.max()),
                       "device": int(per_dev.argmax()), "per_device": per_dev}
    return out


def timeline(plan, profile: str | None = None, max_spans: int = 20000, columns: int = 1600,
             sim: dict | None = None) -> dict:
    """The simulated timeline per phase (``fwd``, ``bwd``): merged ``spans``
    (columns ``lane, dev, t0, t1, n, busy, key, a, b, bytes, peer, kind, tb``;
    ``key`` is the stage of compute spans, -1 for merges/adds; ``a``/``b`` the
    first/last compute block or transfer tag), ``eps_s`` (the merge step),
    ``makespan_s``, per-device ``finish_s``, ``compute_s``, ``wait_s``, the
    ``events`` counts, ``exposed`` (see :func:`exposed_by_stage`) and
    ``stages``."""
    if max_spans < 1 or columns < 1:
        raise PlanError("max_spans and columns must be positive")
    ir = plan.ir
    prof = get_profile(_profile(plan, profile))
    if sim is None:
        sim = simulate(ir, prof, record=True)
    n = ir.devices
    stage_of_cb = ir.schedule.cb_stage.astype(np.int64)
    out = {"profile": prof.name, "stages": int(ir.schedule.stages)}
    for name in ("fwd", "bwd"):
        ev = sim[name]["events"]
        lanes = _lane_events(plan, ev, stage_of_cb)
        ends = np.concatenate([ev["compute"][:, 2], ev["wait"][:, 2]])
        makespan = float(ends.max()) if len(ends) else 0.0
        eps = makespan / columns
        while True:
            merged = [(lane, _merge_spans(*cols, eps=eps)) for lane, *cols in lanes]
            total = sum(len(m["dev"]) for _, m in merged)
            if total <= max_spans or eps > 2 * makespan:
                break
            eps *= 2
        spans = {c: np.concatenate([m[c] for _, m in merged]) for c in merged[0][1]}
        spans["lane"] = np.concatenate([np.full(len(m["dev"]), lane, np.int64) for lane, m in merged])
        C, W = ev["compute"], ev["wait"]
        out[name] = {
            "spans": spans, "eps_s": eps, "makespan_s": makespan,
            "finish_s": np.asarray(sim[name]["finish_s"], float),
            "compute_s": np.bincount(C[:, 0].astype(np.int64), weights=C[:, 2] - C[:, 1], minlength=n),
            "wait_s": np.bincount(W[:, 0].astype(np.int64), weights=W[:, 2] - W[:, 1], minlength=n),
            "events": {k: len(v) for k, v in ev.items()},
            "exposed": exposed_by_stage(plan, ev, stage_of_cb),
        }
    out["predicted_s"] = sim["predicted_s"]
    return out


def summary_rows(s: dict) -> list[tuple[str, str]]:
    """The head of ``plan stats`` as (label, value) rows."""
    def by(x):
        return f"{x / 1e6:.2f} MB" if x < 1e9 else f"{x / 1e9:.2f} GB"
    return [
        ("devices × nodes", f"{s['devices']} on {s['nodes']} node(s)"),
        ("tokens / samples", f"{s['tokens']:,} / {s['samples']:,}"),
        ("heads q/kv × dim", f"{s['heads']}/{s['kv_heads']} × {s['head_dim']} ({s['dtype']})"),
        ("pairs", f"{s['pairs']:,}"),
        ("flops fwd", f"{s['flops_fwd']:.3e}"),
        ("compute imbalance", f"{s['compute_imbalance']:.3f}"),
        ("token imbalance", f"{s['token_imbalance']:.3f}"),
        ("comm total (fwd+bwd)", by(s["comm_bytes_total"])),
        ("comm max per device", by(s["comm_bytes_max"])),
        ("transfers", f"{s['transfers']:,}"),
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


def panel_data(plan, profile: str | None = None, max_bins: int = 160, max_spans: int = 20000) -> dict:
    """Everything the report draws for one plan (numpy arrays and dicts)."""
    prof = _profile(plan, profile)
    sim = simulate(plan.ir, get_profile(prof), record=True)  # one run serves the stats and the timeline
    return {"stats": plan.stats(prof, sim), "mask": mask_cells(plan, max_bins), "bars": device_bars(plan),
            "comm": comm_matrix(plan), "timeline": timeline(plan, prof, max_spans, sim=sim)}


# ----------------------------------------------------------------------------------------------
# HTML
# ----------------------------------------------------------------------------------------------

def _ints(a) -> list:
    return np.asarray(a).astype(np.int64).tolist()


def _us(a) -> list:
    """Seconds → microseconds, 4 decimals (0.1 ns), for the page."""
    return np.round(np.asarray(a, float) * 1e6, 4).tolist()


def _page_data(name: str, plan, d: dict) -> dict:
    """Compact JSON-able form of :func:`panel_data` for the page's script."""
    ir = plan.ir
    m, b, c, t = d["mask"], d["bars"], d["comm"], d["timeline"]
    nz = np.flatnonzero((c["fwd"] + c["bwd"] + c["count"]).ravel())
    n = ir.devices
    tl = {}
    for ph in ("fwd", "bwd"):
        sp = t[ph]["spans"]
        tl[ph] = {"makespan": float(t[ph]["makespan_s"] * 1e6), "eps": float(t[ph]["eps_s"] * 1e6),
                  "events": t[ph]["events"], "finish": _us(t[ph]["finish_s"]),
                  "compute": _us(t[ph]["compute_s"]), "wait": _us(t[ph]["wait_s"]),
                  "spans": {"lane": _ints(sp["lane"]), "dev": _ints(sp["dev"]), "t0": _us(sp["t0"]),
                            "t1": _us(sp["t1"]), "n": _ints(sp["n"]), "busy": _us(sp["busy"]),
                            "key": _ints(sp["key"]), "a": _ints(sp["a"]), "b": _ints(sp["b"]),
                            "bytes": _ints(sp["bytes"]), "peer": _ints(sp["peer"]), "kind": _ints(sp["kind"]),
                            "tb": _ints(sp["tb"])}}
    return {
        "name": name, "devices": n, "nodes": ir.nodes, "dpn": ir.placement.devices_per_node,
        "strategy": plan.meta.get("strategy", ""), "stages": t["stages"],
        "mask": {"tokens": m["tokens"], "heads": m["heads"], "n_tb": m["n_tb"], "n_cb": m["n_cb"],
                 "bins": m["bins"], "aggregated": bool(m["aggregated"]), "edges": _ints(m["edges"]),
                 "bin_tb0": _ints(m["bin_tb0"]), "docs": _ints(m["doc_offsets"]),
                 "cells": {"q": _ints(m["q"]), "k": _ints(m["k"]), "pairs": _ints(m["pairs"]),
                           "blocks": _ints(m["blocks"]), "device": _ints(m["device"]),
                           "share": _ints(np.round(m["share"] * 1000)), "ndev": _ints(m["devices"]),
                           "s0": _ints(m["stage_min"]), "s1": _ints(m["stage_max"]), "c0": _ints(m["cb_min"]),
                           "c1": _ints(m["cb_max"]), "density": _ints(np.round(m["density"] * 1000))}},
        "bars": [{"key": k, "label": BAR_LABELS[k][0], "unit": BAR_LABELS[k][1], "values": _ints(b[k]),
                  "mean": b["means"][k]} for k in BAR_LABELS],
        "comm": {"src": _ints(nz // n), "dst": _ints(nz % n), "fwd": _ints(c["fwd"].ravel()[nz]),
                 "bwd": _ints(c["bwd"].ravel()[nz]), "count": _ints(c["count"].ravel()[nz])},
        "timeline": tl,
    }


def _summary_table(names: list[str], stats: list[dict]) -> str:
    rows = [summary_rows(s) for s in stats]
    head = "".join(f"<th>{html.escape(n)}</th>" for n in names) if len(names) > 1 else "<th></th>"
    out = [f"<table class='summary'><thead><tr><th>stat</th>{head}</tr></thead><tbody>"]
    for i, (label, _) in enumerate(rows[0]):
        best = None
        if len(stats) > 1 and label in _LOWER_IS_BETTER:
            vals = [s[_LOWER_IS_BETTER[label]] for s in stats]
            best = min(vals)
        cells = []
        for s, r in zip(stats, rows):
            hit = best is not None and s[_LOWER_IS_BETTER[label]] == best
            cells.append(f"<td{' class=best' if hit else ''}>{html.escape(r[i][1])}</td>")
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
                    f"<td>{pd['memory_fwd_bytes'][d] / 1e6:.2f} MB</td><td>{pd['memory_bwd_bytes'][d] / 1e6:.2f} MB</td>"
                    f"<td>{pd['predicted_fwd_s'][d] * 1e3:.4f}</td><td>{pd['predicted_bwd_s'][d] * 1e3:.4f}</td></tr>")
    rows.append("</tbody></table>")
    return "".join(rows)


def _legend(stages: int) -> str:
    sw = [(STAGE_COLOURS[s % len(STAGE_COLOURS)], f"compute, stage {s}") for s in range(min(stages, 9))]
    if stages > 9:
        sw.append(("#fff", f"… {stages} stages (colours repeat)"))
    sw += [(MERGE_COLOUR, "merge/add of partials"), (WAIT_COLOUR, "waiting on a transfer"),
           (SEND_COLOUR, "sending (thin, upper)"), (RECV_COLOUR, "receiving (thin, lower)")]
    return "<div class='legend'>" + "".join(
        f"<span><i style='background:{c}'></i>{html.escape(t)}</span>" for c, t in sw) + "</div>"


def _render(named: list[tuple[str, object]], profile: str | None, title: str) -> str:
    from .explain import explain
    if not named:
        raise PlanError("nothing to render: no plans given")
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        raise PlanError(f"plan names must be distinct, got {names}")
    datas, stats, texts = [], [], []
    # the timeline span budget is shared by the plans of a page, so a comparison stays as small as one report
    max_spans = max(2000, 20000 // len(named))
    for name, plan in named:
        d = panel_data(plan, profile, max_spans=max_spans)
        datas.append(_page_data(name, plan, d))
        stats.append(d["stats"])
        texts.append(explain(plan, profile=_profile(plan, profile), data=d))
    n_max = max(p.devices for _, p in named)
    payload = {"plans": datas, "palette": device_palette(n_max), "stage_palette": list(STAGE_COLOURS),
               "colours": {"merge": MERGE_COLOUR, "wait": WAIT_COLOUR, "send": SEND_COLOUR, "recv": RECV_COLOUR},
               "kinds": list(KINDS)}
    blob = json.dumps(payload, separators=(",", ":")).replace("</", "<\\/")
    first = named[0][1]
    p = first.problem
    sub = (f"{p.tokens:,} tokens in {len(p.seqlens):,} documents · mask <code>{html.escape(p.mask.strip())}</code>"
           f" · heads {p.heads}/{p.kv_heads} × {p.head_dim} · profile {html.escape(stats[0]['profile'])}")
    cols = len(named)

    def col_heads(body_fn):
        return "".join(f"<div class='col'>{'<h3>' + html.escape(n) + '</h3>' if cols > 1 else ''}{body_fn(i)}</div>"
                       for i, n in enumerate(names))

    bars = lambda i: "".join(f"<figure><figcaption data-bar='{i}-{j}'></figcaption><canvas class='bar' "
                             f"data-plan='{i}' data-metric='{j}'></canvas></figure>" for j in range(len(BAR_LABELS)))
    explains = "".join(f"<div class='col'>{'<h3>' + html.escape(n) + '</h3>' if cols > 1 else ''}"
                       f"<pre>{html.escape(t)}</pre></div>" for n, t in zip(names, texts))
    devtables = "".join(f"<details><summary>per device{(' — ' + html.escape(n)) if cols > 1 else ''}</summary>"
                        f"{_device_table(s)}</details>" for n, s in zip(names, stats))
    timelines = "".join(
        f"<div class='tl'>{'<h3>' + html.escape(n) + '</h3>' if cols > 1 else ''}"
        f"<h4>forward</h4><canvas class='timeline' data-plan='{i}' data-phase='fwd'></canvas>"
        f"<h4>backward</h4><canvas class='timeline' data-plan='{i}' data-phase='bwd'></canvas></div>"
        for i, n in enumerate(names))
    page = _TEMPLATE.format(
        title=html.escape(title), sub=sub, cols=cols, css=_CSS, js=_JS_ASCII, data=blob,
        summary=_summary_table(names, stats), devtables=devtables, explain=explains,
        mask=col_heads(lambda i: f"<canvas class='mask' data-plan='{i}'></canvas>"),
        bars=col_heads(lambda i: f"<div class='bars'>{bars(i)}</div>"),
        heat=col_heads(lambda i: f"<canvas class='heat' data-plan='{i}'></canvas>"),
        legend=_legend(max(d["stages"] for d in datas)), timelines=timelines)
    # pure ASCII, whatever encoding the file is written in: the script and the JSON are
    # already escaped, the rest uses character references
    return page.encode("ascii", "xmlcharrefreplace").decode("ascii")


def render_html(plan, profile: str | None = None, title: str | None = None) -> str:
    """One self-contained HTML report of ``plan`` (summary, mask, per-device
    bars, communication heatmap, forward/backward timelines, explanation)."""
    name = plan.meta.get("strategy") or "plan"
    return _render([(name, plan)], profile, title or f"attnplan report — {name}, {plan.devices} devices")


def render_compare_html(named_plans: list[tuple[str, object]], profile: str | None = None,
                        title: str | None = None) -> str:
    """The same panels side by side for several plans of one batch (e.g. one
    per strategy); bars and timelines share their scales across plans so
    heights and lengths compare directly."""
    named_plans = list(named_plans)
    if named_plans:
        toks = {p.problem.tokens for _, p in named_plans}
        if len(toks) > 1:
            raise PlanError(f"compare needs plans of one batch; got token counts {sorted(toks)}")
    return _render(named_plans, profile, title or "attnplan comparison — " + ", ".join(n for n, _ in named_plans))


_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>{title}</title>
<style>{css}</style></head>
<body style="--cols:{cols}">
<header><h1>{title}</h1><p>{sub}</p></header>
<section class="panel" data-panel="summary"><h2>Summary <small>(plan stats)</small></h2><div class="scroll">{summary}
{devtables}</div></section>
<section class="panel" data-panel="mask"><h2>Mask by device <small>cells are compute blocks (or groups of them), colour =
device, shade = share of allowed pairs, outlines = documents; hover for details</small></h2><div class="cols">{mask}</div></section>
<section class="panel" data-panel="bars"><h2>Per-device load <small>dashed line = mean; title gives max / mean</small></h2>
<div class="cols">{bars}</div></section>
<section class="panel" data-panel="heatmap"><h2>Bytes moved, device × device <small>rows send, columns receive;
lines mark nodes</small></h2><div class="cols">{heat}</div></section>
<section class="panel" data-panel="timeline"><h2>Simulated timeline <small>one row per device; hover a span</small></h2>
{legend}{timelines}</section>
<section class="panel" data-panel="explain"><h2>Explanation <small>(plan explain)</small></h2><div class="cols">{explain}</div></section>
<div id="tip" role="tooltip"></div>
<script type="application/json" id="attnplan-data">{data}</script>
<script>{js}</script>
</body></html>
"""

_CSS = """
*{box-sizing:border-box}body{font:13px/1.4 system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:0;
padding:12px 20px;color:#222;background:#fafafa}h1{font-size:20px;margin:4px 0}h2{font-size:15px;margin:0 0 8px}
h2 small,h4{font-weight:normal;color:#666}h3{font-size:13px;margin:4px 0}h4{font-size:12px;margin:6px 0 2px}
header p{margin:2px 0 8px;color:#555}code{background:#eee;padding:0 3px;border-radius:3px}
.panel{background:#fff;border:1px solid #ddd;border-radius:6px;padding:10px 12px;margin:0 0 12px}
.cols{display:grid;grid-template-columns:repeat(var(--cols),minmax(0,1fr));gap:14px}
.col{min-width:0}canvas{display:block;width:100%}canvas.mask{max-width:760px}canvas.heat{max-width:560px}
.bars{display:grid;grid-template-columns:repeat(auto-fill,minmax(min(260px,100%),1fr));gap:6px 14px}
figure{margin:0}figcaption{font-size:12px;color:#444;white-space:nowrap;overflow:hidden;text-overflow:ellipsis}
table{border-collapse:collapse;font-variant-numeric:tabular-nums}td,th{padding:2px 10px 2px 0;text-align:left;
vertical-align:top}table.summary th{color:#555;font-weight:normal}table.summary thead th{font-weight:600;color:#222}
td.best{font-weight:700;color:#1b5e20}table.devs td{text-align:right}details{margin-top:6px}
table.summary td{overflow-wrap:anywhere}.scroll{overflow-x:auto}
pre{white-space:pre-wrap;margin:0;font:12px/1.45 ui-monospace,Menlo,Consolas,monospace}
.legend{display:flex;flex-wrap:wrap;gap:4px 14px;margin:0 0 6px;font-size:12px}.legend i{display:inline-block;
width:12px;height:10px;margin-right:4px;vertical-align:-1px;border:1px solid #0002}.tl{margin-bottom:10px}
#tip{position:fixed;display:none;pointer-events:none;background:#222e;color:#fff;padding:6px 8px;border-radius:4px;
font:12px/1.4 ui-monospace,Menlo,Consolas,monospace;white-space:pre;z-index:10;max-width:70vw}
"""

# The page's script: reads the JSON payload and draws every canvas; hover shows #tip.
_JS = r"""
(function () {
'use strict';
const D = JSON.parse(document.getElementById('attnplan-data').textContent);
const PAL = D.palette, SPAL = D.stage_palette, COL = D.colours, KINDS = D.kinds;
const tip = document.getElementById('tip');
const renders = [];
const fmtInt = x => Math.round(x).toLocaleString('en-US');
function fmtBytes(b) { return b >= 1e9 ? (b / 1e9).toFixed(2) + ' GB' : b >= 1e6 ? (b / 1e6).toFixed(2) + ' MB'
  : b >= 1e3 ? (b / 1e3).toFixed(1) + ' kB' : Math.round(b) + ' B'; }
function fmtTime(us) { return us >= 1000 ? (us / 1000).toFixed(3) + ' ms' : us >= 1 ? us.toFixed(2) + ' µs'
  : (us * 1000).toFixed(1) + ' ns'; }
function fmtTok(t) { return t >= 1048576 ? (t / 1048576).toFixed(2) + 'M' : t >= 1024 ? (t / 1024).toFixed(t % 1024 ? 1 : 0) + 'k' : String(Math.round(t)); }
function fmtVal(v, unit) { if (unit === 'B') return fmtBytes(v); if (unit === 'flop') return v.toExponential(2);
  return fmtInt(v); }
function fmtTick(v, unit) { // short axis labels: 1.5T, 20k, 400 MB
  if (v === 0) return '0';
  const si = [[1e12, 'T'], [1e9, 'G'], [1e6, 'M'], [1e3, 'k']].find(([f]) => Math.abs(v) >= f) || [1, ''];
  const x = v / si[0], s = (Math.abs(x) >= 10 || Number.isInteger(x) ? x.toFixed(0) : x.toFixed(1)) + si[1];
  return unit === 'B' ? s + 'B' : s; }
// last index i with a[i] <= x, or -1
function bsearch(a, x) { let lo = 0, hi = a.length - 1; if (hi < 0 || x < a[0]) return -1;
  while (lo < hi) { const m = (lo + hi + 1) >> 1; if (a[m] <= x) lo = m; else hi = m - 1; } return lo; }
function showTip(text, e) {
  if (!text) { tip.style.display = 'none'; return; }
  tip.textContent = text; tip.style.display = 'block';
  const w = tip.offsetWidth, h = tip.offsetHeight;
  let x = e.clientX + 14, y = e.clientY + 14;
  if (x + w > window.innerWidth - 4) x = Math.max(4, e.clientX - w - 14);
  if (y + h > window.innerHeight - 4) y = Math.max(4, e.clientY - h - 14);
  tip.style.left = x + 'px'; tip.style.top = y + 'px';
}
function setup(canvas, heightOf, draw, hit) {
  let geom = null;
  function render() {
    const w = Math.max(120, canvas.clientWidth || canvas.parentElement.clientWidth), h = Math.round(heightOf(w));
    const r = window.devicePixelRatio || 1;
    canvas.width = Math.round(w * r); canvas.height = Math.round(h * r);
    canvas.style.height = h + 'px';
    const ctx = canvas.getContext('2d');
    ctx.setTransform(r, 0, 0, r, 0, 0); ctx.clearRect(0, 0, w, h);
    ctx.font = '11px system-ui, sans-serif'; ctx.textBaseline = 'middle';
    geom = draw(ctx, w, h); canvas._geom = geom;
  }
  renders.push(render); render();
  canvas.addEventListener('mousemove', e => {
    const b = canvas.getBoundingClientRect();
    showTip(geom ? hit(e.clientX - b.left, e.clientY - b.top, geom) : null, e);
  });
  canvas.addEventListener('mouseleave', () => showTip(null));
}
function ticks(max, count) { // nice tick values in [0, max]
  if (!(max > 0)) return [0];
  const raw = max / count, p = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 2.5, 5, 10].map(s => s * p).find(s => s >= raw);
  const out = []; for (let v = 0; v <= max * 1.0001; v += step) out.push(v); return out;
}

// ---- mask ---------------------------------------------------------------------------------
function maskPanel(canvas, P) {
  const m = P.mask, c = m.cells, E = m.edges, nb = m.bins, T = m.tokens, docs = m.docs;
  const index = new Map(); for (let i = 0; i < c.q.length; i++) index.set(c.q[i] * nb + c.k[i], i);
  function draw(ctx, w) {
    const ox = 46, oy = 6, S = Math.max(40, Math.min(w - ox - 8, 760 - ox)), sc = S / T;
    ctx.fillStyle = '#fff'; ctx.fillRect(ox, oy, S, S);
    ctx.fillStyle = '#eef0f3';
    for (let i = 0; i + 1 < docs.length; i++) { const a = docs[i] * sc, s = Math.max(0.5, (docs[i + 1] - docs[i]) * sc);
      ctx.fillRect(ox + a, oy + a, s, s); }
    for (let i = 0; i < c.q.length; i++) {
      const q0 = E[c.q[i]] * sc, q1 = E[c.q[i] + 1] * sc, k0 = E[c.k[i]] * sc, k1 = E[c.k[i] + 1] * sc;
      ctx.globalAlpha = 0.3 + 0.7 * c.density[i] / 1000; ctx.fillStyle = PAL[c.device[i]];
      ctx.fillRect(ox + k0, oy + q0, Math.max(1, k1 - k0), Math.max(1, q1 - q0));
    }
    ctx.globalAlpha = 1; ctx.strokeStyle = '#333'; ctx.lineWidth = 0.7;
    for (let i = 0; i + 1 < docs.length; i++) { const s = (docs[i + 1] - docs[i]) * sc;
      if (s >= 3) ctx.strokeRect(ox + docs[i] * sc, oy + docs[i] * sc, s, s); }
    ctx.strokeStyle = '#999'; ctx.strokeRect(ox, oy, S, S);
    ctx.fillStyle = '#555'; ctx.textAlign = 'right';
    const unit = T >= 4096 ? 1024 : 1, tv = ticks(T / unit, 4).map(v => v * unit);
    for (const v of tv) { ctx.fillText(fmtTok(v), ox - 4, oy + v * sc); }
    ctx.textAlign = 'center';
    for (const v of tv) { ctx.fillText(fmtTok(v), ox + v * sc, oy + S + 10); }
    ctx.fillText('key tokens →   (query tokens ↓)', ox + S / 2, oy + S + 24);
    return {ox, oy, S, sc};
  }
  function docOf(t) { return Math.max(0, bsearch(docs, t)); }
  function cellText(i) {
    const qa = m.bin_tb0[c.q[i]], qb = m.bin_tb0[c.q[i] + 1] - 1, ka = m.bin_tb0[c.k[i]], kb = m.bin_tb0[c.k[i] + 1] - 1;
    const q0 = E[c.q[i]], q1 = E[c.q[i] + 1], k0 = E[c.k[i]], k1 = E[c.k[i] + 1];
    const d0 = docOf(q0), d1 = docOf(q1 - 1);
    const st = c.s0[i] === c.s1[i] ? 'stage ' + c.s0[i] : 'stages ' + c.s0[i] + '–' + c.s1[i];
    const docTxt = d0 === d1 ? 'document #' + d0 + ' (' + fmtInt(docs[d0 + 1] - docs[d0]) + ' tokens)'
      : 'documents #' + d0 + '–#' + d1;
    const pairs = 'pairs ' + fmtInt(c.pairs[i]) + ' (allowed q,k × ' + m.heads + ' q heads), ' + (c.density[i] / 10).toFixed(1) + '% of the cell';
    const node = Math.floor(c.device[i] / P.dpn);
    if (c.blocks[i] === 1) {
      return 'compute block c' + c.c0[i] + ' · device d' + c.device[i] + ' (node ' + node + ') · ' + st +
        '\nq tb' + qa + ' [' + fmtInt(q0) + ', ' + fmtInt(q1) + ') × kv tb' + ka + ' [' + fmtInt(k0) + ', ' + fmtInt(k1) + ')' +
        '\n' + pairs + '\n' + docTxt;
    }
    const devs = c.ndev[i] === 1 ? 'device d' + c.device[i] + ' (node ' + node + ')'
      : 'devices: d' + c.device[i] + ' ' + (c.share[i] / 10).toFixed(1) + '% of pairs, ' + (c.ndev[i] - 1) + ' other device(s)';
    const span = (qa === qb && ka === kb) ? 'tile q tb' + qa + ' × kv tb' + ka + ' (one per head group)'
      : 'q tb' + qa + '–tb' + qb + ' [' + fmtInt(q0) + ', ' + fmtInt(q1) + ') × kv tb' + ka + '–tb' + kb + ' [' + fmtInt(k0) + ', ' + fmtInt(k1) + ')';
    return 'cell aggregating ' + c.blocks[i] + ' compute blocks (c' + c.c0[i] + '…c' + c.c1[i] + ')\n' + span +
      '\n' + devs + ' · ' + st + '\n' + pairs + '\n' + docTxt;
  }
  function hit(x, y, g) {
    const k = (x - g.ox) / g.sc, q = (y - g.oy) / g.sc;
    if (q < 0 || k < 0 || q >= T || k >= T) return null;
    const r = 2 / g.sc; let best = -1;
    const qa = Math.max(0, bsearch(E, q - r)), qb = Math.max(0, bsearch(E, q + r));
    const ka = Math.max(0, bsearch(E, k - r)), kb = Math.max(0, bsearch(E, k + r));
    for (let qi = qa; qi <= Math.min(qb, nb - 1); qi++) for (let ki = ka; ki <= Math.min(kb, nb - 1); ki++) {
      const i = index.get(qi * nb + ki);
      if (i !== undefined && (best < 0 || c.pairs[i] > c.pairs[best])) best = i;
    }
    if (best >= 0) return cellText(best);
    const dq = docOf(q), dk = docOf(k);
    return 'q ' + fmtInt(q) + ', k ' + fmtInt(k) + ': masked, no compute block\n' +
      (dq === dk ? 'inside document #' + dq : 'q in document #' + dq + ', k in document #' + dk);
  }
  setup(canvas, w => Math.min(w - 54, 760 - 54) + 40, draw, hit);
}

// ---- bars ---------------------------------------------------------------------------------
function barPanel(canvas, P, j, ymax) {
  const B = P.bars[j], v = B.values, n = v.length;
  const cap = document.querySelector('figcaption[data-bar="' + canvas.dataset.plan + '-' + j + '"]');
  const mx = Math.max(...v);
  cap.textContent = B.label + ' · max/mean ' + (B.mean > 0 ? (mx / B.mean).toFixed(2) : '—') + ' · mean ' + fmtVal(B.mean, B.unit);
  function draw(ctx, w, h) {
    const ox = 40, oy = 6, W = w - ox - 6, H = h - oy - 16, bw = W / n, top = ymax > 0 ? ymax : 1;
    ctx.fillStyle = '#555'; ctx.textAlign = 'right';
    for (const t of ticks(top, 3)) { const y = oy + H - t / top * H; ctx.fillText(fmtTick(t, B.unit), ox - 4, y);
      ctx.fillStyle = '#eee'; ctx.fillRect(ox, y, W, 1); ctx.fillStyle = '#555'; }
    for (let d = 0; d < n; d++) { const bh = v[d] / top * H; ctx.fillStyle = PAL[d];
      ctx.fillRect(ox + d * bw + (bw > 4 ? 0.5 : 0), oy + H - bh, Math.max(1, bw - (bw > 4 ? 1 : 0)), bh); }
    const my = oy + H - B.mean / top * H; ctx.strokeStyle = '#000'; ctx.setLineDash([4, 3]); ctx.beginPath();
    ctx.moveTo(ox, my); ctx.lineTo(ox + W, my); ctx.stroke(); ctx.setLineDash([]);
    ctx.textAlign = 'center'; ctx.fillStyle = '#555';
    const every = Math.max(1, Math.ceil(n / Math.max(1, W / 26)));
    for (let d = 0; d < n; d += every) ctx.fillText('d' + d, ox + (d + 0.5) * bw, oy + H + 9);
    return {ox, bw};
  }
  function hit(x, y, g) { const d = Math.floor((x - g.ox) / g.bw); if (d < 0 || d >= n) return null;
    return 'd' + d + ' (node ' + Math.floor(d / P.dpn) + '): ' + fmtVal(v[d], B.unit) + '\n' +
      (B.mean > 0 ? (v[d] / B.mean).toFixed(3) + ' × mean (' + fmtVal(B.mean, B.unit) + ')' : 'mean 0'); }
  setup(canvas, () => 120, draw, hit);
}

// ---- heatmap ------------------------------------------------------------------------------
function heatPanel(canvas, P) {
  const C = P.comm, n = P.devices, tot = C.fwd.map((f, i) => f + C.bwd[i]);
  const mx = Math.max(1, ...tot), index = new Map();
  for (let i = 0; i < tot.length; i++) index.set(C.src[i] * n + C.dst[i], i);
  function colour(t) { const s = Math.sqrt(t / mx); // white → deep blue
    const r = Math.round(255 - s * (255 - 8)), g = Math.round(255 - s * (255 - 48)), b = Math.round(255 - s * (255 - 107));
    return 'rgb(' + r + ',' + g + ',' + b + ')'; }
  function draw(ctx, w) {
    const ox = 40, oy = 16, S = Math.max(40, Math.min(w - ox - 90, 480)), cs = S / n;
    ctx.fillStyle = '#fff'; ctx.fillRect(ox, oy, S, S);
    for (let i = 0; i < tot.length; i++) { if (!tot[i]) continue; ctx.fillStyle = colour(tot[i]);
      ctx.fillRect(ox + C.dst[i] * cs, oy + C.src[i] * cs, Math.max(1, cs), Math.max(1, cs)); }
    ctx.strokeStyle = '#888'; ctx.lineWidth = 1; ctx.strokeRect(ox, oy, S, S);
    if (P.nodes > 1) { ctx.strokeStyle = '#c62828'; ctx.beginPath();
      for (let k = 1; k < P.nodes; k++) { const p = k * P.dpn * cs; ctx.moveTo(ox + p, oy); ctx.lineTo(ox + p, oy + S);
        ctx.moveTo(ox, oy + p); ctx.lineTo(ox + S, oy + p); } ctx.stroke(); }
    ctx.fillStyle = '#555'; const every = Math.max(1, Math.ceil(n / (S / 22)));
    ctx.textAlign = 'right'; for (let d = 0; d < n; d += every) ctx.fillText('d' + d, ox - 4, oy + (d + 0.5) * cs);
    ctx.textAlign = 'center'; for (let d = 0; d < n; d += every) ctx.fillText('d' + d, ox + (d + 0.5) * cs, oy - 8);
    const lx = ox + S + 14; // colour scale
    for (let i = 0; i < 100; i++) { ctx.fillStyle = colour(mx * (1 - i / 99) ** 2); ctx.fillRect(lx, oy + i * S / 100, 12, S / 100 + 1); }
    ctx.textAlign = 'left'; ctx.fillStyle = '#555'; ctx.fillText(fmtBytes(mx), lx + 15, oy + 4); ctx.fillText('0', lx + 15, oy + S - 4);
    return {ox, oy, S, cs};
  }
  function hit(x, y, g) { const s = Math.floor((y - g.oy) / g.cs), d = Math.floor((x - g.ox) / g.cs);
    if (s < 0 || d < 0 || s >= n || d >= n) return null; const i = index.get(s * n + d);
    const link = Math.floor(s / P.dpn) === Math.floor(d / P.dpn) ? 'intra-node' : 'inter-node';
    if (i === undefined) return 'd' + s + ' → d' + d + ': nothing moves';
    return 'd' + s + ' → d' + d + ' (' + link + '): ' + fmtBytes(tot[i]) + ' in ' + C.count[i] + ' transfers\nforward ' +
      fmtBytes(C.fwd[i]) + ', backward ' + fmtBytes(C.bwd[i]); }
  setup(canvas, w => Math.max(40, Math.min(w - 130, 480)) + 30, draw, hit);
}

// ---- timeline -----------------------------------------------------------------------------
function timelinePanel(canvas, P, phase, tmax) {
  const L = P.timeline[phase], S = L.spans, n = P.devices, rowH = Math.max(7, Math.min(18, Math.floor(640 / n)));
  const lanes = new Map(); // dev*4+lane -> span indices in time order
  for (let i = 0; i < S.dev.length; i++) { const k = S.dev[i] * 4 + S.lane[i]; if (!lanes.has(k)) lanes.set(k, []); lanes.get(k).push(i); }
  for (const a of lanes.values()) a.sort((x, y) => S.t0[x] - S.t0[y]);
  const LANE_Y = [[0, 0.62], [0, 0.62], [0.64, 0.8], [0.8, 0.96]];
  function colourOf(i) { const l = S.lane[i]; if (l === 1) return COL.wait; if (l === 2) return COL.send; if (l === 3) return COL.recv;
    return S.key[i] < 0 ? COL.merge : SPAL[S.key[i] % SPAL.length]; }
  function draw(ctx, w, h) {
    const ox = 44, oy = 4, W = w - ox - 10, sx = W / (tmax > 0 ? tmax : 1);
    for (let d = 0; d < n; d++) { if (d % 2) { ctx.fillStyle = '#f6f7f9'; ctx.fillRect(ox, oy + d * rowH, W, rowH); }
      ctx.fillStyle = PAL[d]; ctx.fillRect(ox - 8, oy + d * rowH + 1, 5, rowH - 2); }
    for (const lane of [0, 1, 2, 3]) for (let i = 0; i < S.dev.length; i++) { if (S.lane[i] !== lane) continue;
      const y = oy + S.dev[i] * rowH, [a, b] = LANE_Y[lane]; ctx.fillStyle = colourOf(i);
      ctx.fillRect(ox + S.t0[i] * sx, y + a * rowH, Math.max(1, (S.t1[i] - S.t0[i]) * sx), Math.max(1, (b - a) * rowH)); }
    if (P.nodes > 1) { ctx.fillStyle = '#c62828'; for (let k = 1; k < P.nodes; k++) ctx.fillRect(ox - 10, oy + k * P.dpn * rowH - 0.5, W + 10, 1); }
    ctx.fillStyle = '#000'; ctx.fillRect(ox + L.makespan * sx, oy, 1, n * rowH);
    ctx.fillStyle = '#555'; ctx.textAlign = 'right'; const every = Math.max(1, Math.ceil(12 / rowH));
    for (let d = 0; d < n; d += every) ctx.fillText('d' + d, ox - 10, oy + (d + 0.5) * rowH);
    ctx.textAlign = 'center'; const yT = oy + n * rowH;
    for (const t of ticks(tmax, 6)) { ctx.fillRect(ox + t * sx, yT, 1, 4); ctx.fillText(fmtTime(t), ox + t * sx, yT + 11); }
    ctx.textAlign = 'left'; ctx.fillText('makespan ' + fmtTime(L.makespan), Math.min(ox + L.makespan * sx + 4, ox + W - 110), yT + 24);
    return {ox, oy, sx};
  }
  function spanText(i) {
    const l = S.lane[i], d = S.dev[i], many = S.n[i] > 1, when = fmtTime(S.t0[i]) + ' – ' + fmtTime(S.t1[i]);
    const agg = many ? '\n(aggregated: events less than ' + fmtTime(L.eps) + ' apart are merged)' : '';
    if (l === 0 && S.key[i] < 0) return (many ? S.n[i] + ' merges/adds' : 'merge/add') + ' of incoming partials on d' + d +
      '\n' + when + ', busy ' + fmtTime(S.busy[i]) + agg;
    if (l === 0) return (many ? S.n[i] + ' compute blocks c' + S.a[i] + '…c' + S.b[i] : 'compute block c' + S.a[i]) +
      ' on d' + d + ' · stage ' + S.key[i] + '\n' + when + ', busy ' + fmtTime(S.busy[i]) + agg;
    const kind = S.kind[i] >= 0 ? KINDS[S.kind[i]] : 'mixed';
    if (l === 1) return many ? 'd' + d + ' waits ' + S.n[i] + ' times, ' + fmtTime(S.busy[i]) + ' idle (transfers t' + S.a[i] + '…t' + S.b[i] + ')\n' + when + agg
      : 'd' + d + ' waits ' + fmtTime(S.busy[i]) + ' on t' + S.a[i] + ' (' + kind + ' tb' + S.tb[i] + ', peer d' + S.peer[i] + ')\n' + when;
    const dir = l === 2 ? 'out' : 'in', arrow = (p) => l === 2 ? 'd' + d + ' → ' + p : p + ' → d' + d;
    const peer = S.peer[i] >= 0 ? 'd' + S.peer[i] : 'several devices';
    if (!many) return 't' + S.a[i] + ' ' + kind + ' tb' + S.tb[i] + ' ' + arrow(peer) + ', ' + fmtBytes(S.bytes[i]) + '\n' + when;
    return S.n[i] + ' transfers ' + dir + ' (' + arrow(peer) + '), ' + fmtBytes(S.bytes[i]) + ', kinds ' + kind + '\n' + when + agg;
  }
  function hit(x, y, g) {
    const d = Math.floor((y - g.oy) / rowH); if (d < 0 || d >= n) return null;
    const f = (y - g.oy) / rowH - d, t = (x - g.ox) / g.sx, tol = 2 / g.sx;
    const order = f < 0.63 ? [1, 0] : f < 0.8 ? [2] : [3];
    for (const lane of order) { const a = lanes.get(d * 4 + lane); if (!a) continue;
      let lo = 0, hi = a.length - 1, j = -1; while (lo <= hi) { const m = (lo + hi) >> 1; if (S.t0[a[m]] <= t + tol) { j = m; lo = m + 1; } else hi = m - 1; }
      for (let k = j; k >= 0 && k > j - 4; k--) if (S.t1[a[k]] >= t - tol) return spanText(a[k]); }
    return 'd' + d + ' at ' + fmtTime(Math.max(0, t)) + ': idle' + (t > L.finish[d] ? ' (finished at ' + fmtTime(L.finish[d]) + ')' : '') +
      '\ncompute ' + fmtTime(L.compute[d]) + ', waiting ' + fmtTime(L.wait[d]) + ' in ' + phase;
  }
  setup(canvas, () => n * rowH + 34, draw, hit);
}

// shared scales across plans (compare mode)
const barMax = D.plans[0].bars.map((_, j) => Math.max(...D.plans.map(p => Math.max(...p.bars[j].values, p.bars[j].mean))));
const tMax = {fwd: Math.max(...D.plans.map(p => p.timeline.fwd.makespan)), bwd: Math.max(...D.plans.map(p => p.timeline.bwd.makespan))};
document.querySelectorAll('canvas.mask').forEach(c => maskPanel(c, D.plans[+c.dataset.plan]));
document.querySelectorAll('canvas.bar').forEach(c => barPanel(c, D.plans[+c.dataset.plan], +c.dataset.metric, barMax[+c.dataset.metric]));
document.querySelectorAll('canvas.heat').forEach(c => heatPanel(c, D.plans[+c.dataset.plan]));
document.querySelectorAll('canvas.timeline').forEach(c => timelinePanel(c, D.plans[+c.dataset.plan], c.dataset.phase, tMax[c.dataset.phase]));
let pending = 0;
window.addEventListener('resize', () => { cancelAnimationFrame(pending); pending = requestAnimationFrame(() => renders.forEach(r => r())); });
// for tests and scripts: client coordinates of token (q, k) on a plan's mask canvas
window.attnplan = {data: D, rendered: renders.length, maskPoint(plan, q, k) {
  const c = document.querySelectorAll('canvas.mask')[plan], g = c._geom, b = c.getBoundingClientRect();
  return {x: b.left + g.ox + (k + 0.5) * g.sc, y: b.top + g.oy + (q + 0.5) * g.sc}; }};
})();
"""


# JS string escapes for the few non-ASCII characters (µ, ×, →, …) of the script
_JS_ASCII = _JS.encode("ascii", "backslashreplace").decode("ascii")


# ----------------------------------------------------------------------------------------------
# PNG (matplotlib, Agg)
# ----------------------------------------------------------------------------------------------

def write_pngs(plan, out_dir, profile: str | None = None, dpi: int = 130) -> list[Path]:
    """Draw the mask, per-device bars, communication heatmap and timelines as
    ``mask.png``, ``bars.png``, ``comm.png``, ``timeline.png`` in ``out_dir``."""
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection
    from matplotlib.colors import to_rgba_array

    def rects(x, y, w, h, **kw):  # one vectorized artist for many rectangles
        x, y, w, h = (np.broadcast_to(np.asarray(a, float), np.shape(x)) for a in (x, y, w, h))
        v = np.stack([np.stack([x, y], -1), np.stack([x + w, y], -1), np.stack([x + w, y + h], -1),
                      np.stack([x, y + h], -1)], 1)
        return PolyCollection(v, **kw)

    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PlanError(f"{out}: cannot create directory: {e.strerror or e}") from None
    d = panel_data(plan, profile)
    n = plan.devices
    pal = device_palette(n)
    name = plan.meta.get("strategy") or "plan"
    s = d["stats"]
    head = (f"{name}: {n} devices, {s['tokens']:,} tokens, compute imbalance {s['compute_imbalance']:.2f}, "
            f"predicted {s['predicted_s'] * 1e3:.3f} ms ({s['profile']})")
    paths = []

    def save(fig, fname):
        p = out / fname
        try:
            fig.savefig(p, dpi=dpi)
        except OSError as e:
            raise PlanError(f"{p}: cannot write: {e.strerror or e}") from None
        finally:
            plt.close(fig)
        paths.append(p)

    # mask
    m = d["mask"]
    E, T = m["edges"], m["tokens"]
    fig, ax = plt.subplots(figsize=(7.5, 7.5), layout="constrained")
    off = m["doc_offsets"]
    size = off[1:] - off[:-1]
    ax.add_collection(rects(off[:-1], off[:-1], size, size, facecolors="#eef0f3", edgecolors="none"))
    cols = to_rgba_array([pal[dv] for dv in m["device"]]) if len(m["device"]) else np.zeros((0, 4))
    cols[:, 3] = 0.3 + 0.7 * m["density"]
    q, k = m["q"], m["k"]
    ax.add_collection(rects(E[k], E[q], E[k + 1] - E[k], E[q + 1] - E[q], facecolors=cols, edgecolors="none"))
    big = size >= T / 250
    ax.add_collection(rects(off[:-1][big], off[:-1][big], size[big], size[big], facecolors="none",
                            edgecolors="#333", linewidths=0.6))
    ax.set_xlim(0, T)
    ax.set_ylim(T, 0)
    ax.set_aspect("equal")
    ax.set_xlabel("key token")
    ax.set_ylabel("query token")
    agg = f"{m['bins']}×{m['bins']} bins of {m['n_tb']} token blocks" if m["aggregated"] else f"{m['n_tb']} token blocks"
    ax.set_title(f"mask by device ({agg}; shade = pair density)\n{head}", fontsize=9)
    save(fig, "mask.png")

    # bars
    b = d["bars"]
    fig, axes = plt.subplots(3, 2, figsize=(11, 8), layout="constrained")
    for ax, key in zip(axes.ravel(), BAR_LABELS):
        v, mean = b[key], b["means"][key]
        ax.bar(np.arange(n), v, color=pal, width=0.85)
        ax.axhline(mean, color="k", linestyle="--", linewidth=1)
        ratio = v.max() / mean if mean > 0 else 1.0
        ax.set_title(f"{BAR_LABELS[key][0]} · max/mean {ratio:.2f}", fontsize=9)
        ax.set_xlim(-0.6, n - 0.4)
        ax.tick_params(labelsize=7)
    fig.suptitle(head, fontsize=9)
    save(fig, "bars.png")

    # comm heatmap
    c = d["comm"]
    tot = (c["fwd"] + c["bwd"]) / 1e6
    fig, ax = plt.subplots(figsize=(6.5, 5.5), layout="constrained")
    im = ax.imshow(np.sqrt(tot), cmap="Blues", interpolation="nearest")
    cb = fig.colorbar(im, ax=ax, shrink=0.8)
    tk = cb.get_ticks()
    cb.set_ticks(tk)
    cb.set_ticklabels([f"{t * t:.3g}" for t in tk])
    cb.set_label("MB (fwd+bwd), sqrt scale")
    dpn = plan.ir.placement.devices_per_node
    for k in range(1, plan.ir.nodes):
        ax.axhline(k * dpn - 0.5, color="#c62828", linewidth=0.8)
        ax.axvline(k * dpn - 0.5, color="#c62828", linewidth=0.8)
    ax.set_xlabel("destination device")
    ax.set_ylabel("source device")
    ax.set_title(f"bytes moved, total {s['comm_bytes_total'] / 1e6:.2f} MB\n{head}", fontsize=9)
    save(fig, "comm.png")

    # timeline
    t = d["timeline"]
    fig, axes = plt.subplots(2, 1, figsize=(12, max(4.0, 0.16 * n * 2 + 2)), layout="constrained")
    lane_y = {L_COMPUTE: (0.0, 0.62), L_WAIT: (0.0, 0.62), L_SEND: (0.64, 0.16), L_RECV: (0.8, 0.16)}
    for ax, ph in zip(axes, ("fwd", "bwd")):
        sp = t[ph]["spans"]
        for lane in (L_COMPUTE, L_WAIT, L_SEND, L_RECV):
            sel = sp["lane"] == lane
            if not sel.any():
                continue
            if lane == L_COMPUTE:
                colr = [MERGE_COLOUR if k < 0 else STAGE_COLOURS[k % len(STAGE_COLOURS)] for k in sp["key"][sel]]
            else:
                colr = {L_WAIT: WAIT_COLOUR, L_SEND: SEND_COLOUR, L_RECV: RECV_COLOUR}[lane]
            y0, hgt = lane_y[lane]
            ax.add_collection(rects(sp["t0"][sel] * 1e3, sp["dev"][sel] + y0, (sp["t1"][sel] - sp["t0"][sel]) * 1e3,
                                    hgt, facecolors=colr, edgecolors="none"))
        ax.axvline(t[ph]["makespan_s"] * 1e3, color="k", linewidth=0.8)
        ax.set_xlim(0, max(t[ph]["makespan_s"] * 1e3 * 1.01, 1e-9))
        ax.set_ylim(n, 0)
        every = max(1, -(-n // 16))
        ax.set_yticks(np.arange(0, n, every) + 0.5, [f"d{i}" for i in range(0, n, every)], fontsize=7)
        ax.set_ylabel("device")
        ax.set_xlabel("ms")
        ax.set_title(f"{'forward' if ph == 'fwd' else 'backward'}: makespan {t[ph]['makespan_s'] * 1e3:.3f} ms "
                     f"(compute by stage, grey merges, red waits, blue sends, teal receives)", fontsize=9)
    fig.suptitle(head, fontsize=9)
    save(fig, "timeline.png")
    return paths
