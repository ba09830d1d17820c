"""The report's pictures as PNG files (matplotlib, Agg) for papers and terminals:
``mask.png``, ``bars.png``, ``comm.png``, ``timeline.png``.

Plan metadata (the strategy name, the profile name) reaches figure titles:
every figure is drawn with matplotlib's math parsing off (``text.parse_math``
false, ``parse_math=False`` on the titles), so a ``$`` in a name is text,
never mathtext.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import PlanError
from .palette import MERGE_COLOUR, RECV_COLOUR, SEND_COLOUR, STAGE_COLOURS, WAIT_COLOUR, device_palette
from .panels import BAR_LABELS, panel_data
from .timeline import L_COMPUTE, L_RECV, L_SEND, L_WAIT

# where each lane sits in a device's row of the timeline: (top, height) as a share of the row
_LANE_Y = {L_COMPUTE: (0.0, 0.62), L_WAIT: (0.0, 0.62), L_SEND: (0.64, 0.16), L_RECV: (0.8, 0.16)}


def _rects(x, y, w, h, **kw):
    """One vectorized artist for many rectangles."""
    from matplotlib.collections import PolyCollection
    x, y, w, h = (np.broadcast_to(np.asarray(a, float), np.shape(x)) for a in (x, y, w, h))
    v = np.stack([np.stack([x, y], -1), np.stack([x + w, y], -1), np.stack([x + w, y + h], -1),
                  np.stack([x, y + h], -1)], 1)
    return PolyCollection(v, **kw)


def _mask_figure(plt, d: dict, pal: list[str], head: str):
    from matplotlib.colors import to_rgba_array
    m = d["mask"]
    E, T = m["edges"], m["tokens"]
    fig, ax = plt.subplots(figsize=(7.5, 7.5), layout="constrained")
    off = m["doc_offsets"]
    size = off[1:] - off[:-1]
    ax.add_collection(_rects(off[:-1], off[:-1], size, size, facecolors="#eef0f3", edgecolors="none"))
    cols = to_rgba_array([pal[dv] for dv in m["device"]]) if len(m["device"]) else np.zeros((0, 4))
    cols[:, 3] = 0.3 + 0.7 * m["density"]
    q, k = m["q"], m["k"]
    ax.add_collection(_rects(E[k], E[q], E[k + 1] - E[k], E[q + 1] - E[q], facecolors=cols, edgecolors="none"))
    big = size >= T / 250
    ax.add_collection(_rects(off[:-1][big], off[:-1][big], size[big], size[big], facecolors="none",
                             edgecolors="#333", linewidths=0.6))
    ax.set_xlim(0, T)
    ax.set_ylim(T, 0)
    ax.set_aspect("equal")
    ax.set_xlabel("key token")
    ax.set_ylabel("query token")
    agg = f"{m['n_tb']} token blocks"
    if m["aggregated"]:
        agg = f"{m['bins']}×{m['bins']} bins of {agg}"
    ax.set_title(f"mask by device ({agg}; shade = pair density)\n{head}", fontsize=9, parse_math=False)
    return fig


def _bars_figure(plt, d: dict, pal: list[str], head: str):
    b = d["bars"]
    n = len(pal)
    fig, axes = plt.subplots(3, 2, figsize=(11, 8), layout="constrained")
    for ax, key in zip(axes.ravel(), BAR_LABELS):
        v, mean = b[key], b["means"][key]
        ax.bar(np.arange(n), v, color=pal, width=0.85)
        ax.axhline(mean, color="k", linestyle="--", linewidth=1)
        ratio = v.max() / mean if mean > 0 else 1.0
        ax.set_title(f"{BAR_LABELS[key][0]} · max/mean {ratio:.2f}", fontsize=9)
        ax.set_xlim(-0.6, n - 0.4)
        ax.tick_params(labelsize=7)
    fig.suptitle(head, fontsize=9, parse_math=False)
    return fig


def _comm_figure(plt, d: dict, ir, head: str):
    c, s = d["comm"], d["stats"]
    tot = (c["fwd"] + c["bwd"]) / 1e6
    fig, ax = plt.subplots(figsize=(6.5, 5.5), layout="constrained")
    im = ax.imshow(np.sqrt(tot), cmap="Blues", interpolation="nearest")
    cb = fig.colorbar(im, ax=ax, shrink=0.8)
    tk = cb.get_ticks()
    cb.set_ticks(tk)
    cb.set_ticklabels([f"{t * t:.3g}" for t in tk])
    cb.set_label("MB (fwd+bwd), sqrt scale")
    dpn = ir.placement.devices_per_node
    for k in range(1, ir.nodes):
        ax.axhline(k * dpn - 0.5, color="#c62828", linewidth=0.8)
        ax.axvline(k * dpn - 0.5, color="#c62828", linewidth=0.8)
    ax.set_xlabel("destination device")
    ax.set_ylabel("source device")
    ax.set_title(f"bytes moved, total {s['comm_bytes_total'] / 1e6:.2f} MB\n{head}", fontsize=9, parse_math=False)
    return fig


def _timeline_lanes(ax, sp: dict) -> None:
    """Draw one phase's spans: compute by stage (grey merges), waits, sends, receives."""
    for lane in (L_COMPUTE, L_WAIT, L_SEND, L_RECV):
        sel = sp["lane"] == lane
        if not sel.any():
            continue
        colr: list[str] | str = {L_WAIT: WAIT_COLOUR, L_SEND: SEND_COLOUR, L_RECV: RECV_COLOUR}.get(lane, "")
        if lane == L_COMPUTE:
            colr = [MERGE_COLOUR if k < 0 else STAGE_COLOURS[k % len(STAGE_COLOURS)] for k in sp["key"][sel]]
        y0, hgt = _LANE_Y[lane]
        ax.add_collection(_rects(sp["t0"][sel] * 1e3, sp["dev"][sel] + y0, (sp["t1"][sel] - sp["t0"][sel]) * 1e3,
                                 hgt, facecolors=colr, edgecolors="none"))


def _timeline_figure(plt, d: dict, n: int, head: str):
    t = d["timeline"]
    fig, axes = plt.subplots(2, 1, figsize=(12, max(4.0, 0.16 * n * 2 + 2)), layout="constrained")
    for ax, ph in zip(axes, ("fwd", "bwd")):
        _timeline_lanes(ax, t[ph]["spans"])
        ax.axvline(t[ph]["makespan_s"] * 1e3, color="k", linewidth=0.8)
        ax.set_xlim(0, max(t[ph]["makespan_s"] * 1e3 * 1.01, 1e-9))
        ax.set_ylim(n, 0)
        every = max(1, -(-n // 16))
        ax.set_yticks(np.arange(0, n, every) + 0.5, [f"d{i}" for i in range(0, n, every)], fontsize=7)
        ax.set_ylabel("device")
        ax.set_xlabel("ms")
        ax.set_title(f"{'forward' if ph == 'fwd' else 'backward'}: makespan {t[ph]['makespan_s'] * 1e3:.3f} ms "
                     f"(compute by stage, grey merges, red waits, blue sends, teal receives)", fontsize=9)
    fig.suptitle(head, fontsize=9, parse_math=False)
    return fig


def _make_dir(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PlanError(f"{out}: cannot create directory: {e.strerror or e}") from None


def _save(plt, fig, path: Path, dpi: int) -> Path:
    try:
        fig.savefig(path, dpi=dpi)
    except OSError as e:
        raise PlanError(f"{path}: cannot write: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    return path


def write_pngs(plan, out_dir, profile=None, dpi: int = 130) -> list[Path]:
    """Draw the mask, per-device bars, communication heatmap and timelines as
    ``mask.png``, ``bars.png``, ``comm.png``, ``timeline.png`` in ``out_dir``.
    ``profile``: the caller's (name, FILE.json or Profile), else the plan's recorded builtin name."""
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    if isinstance(dpi, bool) or not isinstance(dpi, (int, np.integer)) or dpi < 1:
        raise PlanError(f"dpi must be a positive integer, got {dpi!r}")
    out = Path(out_dir)
    _make_dir(out)
    d = panel_data(plan, profile)
    ir = plan.ir
    n = ir.devices
    pal = device_palette(n)
    s = d["stats"]
    head = (f"{plan.meta.get('strategy') or 'plan'}: {n} devices, {s['tokens']:,} tokens, compute imbalance "
            f"{s['compute_imbalance']:.2f}, predicted {s['predicted_s'] * 1e3:.3f} ms ({s['profile']})")
    figures = (("mask.png", lambda: _mask_figure(plt, d, pal, head)),
               ("bars.png", lambda: _bars_figure(plt, d, pal, head)),
               ("comm.png", lambda: _comm_figure(plt, d, ir, head)),
               ("timeline.png", lambda: _timeline_figure(plt, d, n, head)))
    with plt.rc_context({"text.parse_math": False, "text.usetex": False}):
        return [_save(plt, draw(), out / fname, dpi) for fname, draw in figures]
