"""``plan explain``: a short, specific text account of a plan.

Four paragraphs, numbers and names only: the most loaded device (or the one
asked for) and why — its work against its tokens, the documents and compute
blocks its work comes from; the largest transfers (blocks moved) and the
busiest link (bytes and messages); the
stage with the longest exposed communication (waits charged to the stage of
the compute block they delay, see :func:`attnplan.backends.timeline.exposed_by_stage`);
and what the cost model predicts against the lower bound, with the device
that finishes last in each phase.
"""

from __future__ import annotations

import numpy as np

from ..errors import PlanError
from ..ir.groups import ungroup
from ..ir.program import BWD, KINDS, PHASES, T_BYTES, T_DST, T_HG, T_KIND, T_PHASE, T_SRC, T_TB
from ..ir.schedule import phase_schedule
from .floor import placement_floor
from .panels import panel_data, plan_profile


def _mb(x: float) -> str:
    return f"{x / 1e9:.2f} GB" if x >= 1e9 else f"{x / 1e6:.2f} MB" if x >= 1e5 else f"{x / 1e3:.1f} kB"


def _t(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} µs"


def _ordinal(i: int) -> str:
    return f"{i}{'th' if 10 <= i % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(i % 10, 'th')}"


def _stage_name(s: int) -> str:
    return "tail (merging partials, finishing sends)" if s < 0 else f"stage {s}"


def explain(plan, device: int | None = None, profile=None, top: int = 3, data: dict | None = None) -> str:
    """The text of ``plan explain``. ``device`` focuses on one device (default:
    the one with the most forward attention FLOPs). ``profile``: the caller's
    (name, FILE.json or Profile), else the plan's recorded builtin name.
    ``data`` reuses :func:`attnplan.backends.panels.panel_data` when the
    caller already has it."""
    n = plan.ir.devices
    if device is not None and (isinstance(device, bool) or not isinstance(device, (int, np.integer))
                               or not 0 <= device < n):
        raise PlanError(f"device {device} does not exist; the plan has devices 0..{n - 1}")
    if isinstance(top, bool) or not isinstance(top, (int, np.integer)) or top < 1:
        raise PlanError(f"top must be a positive integer, got {top!r}")
    d = data if data is not None else panel_data(plan, profile)
    focus = int(np.argmax(d["bars"]["flops"])) if device is None else int(device)
    one = device is not None
    out = [_headline(plan, d)]
    for paragraph in (_device_paragraph(plan, d, focus, one, top), _transfer_paragraph(plan, d, focus, one, top),
                      _exposed_paragraph(d["timeline"], focus, one),
                      _cost_paragraph(d, focus, one) + _floor_lines(plan, d, profile)):
        out.append("")
        out.extend(paragraph)
    return "\n".join(out)


def _mask_text(source: str, limit: int = 120) -> str:
    """A mask's text on one line: its comment lines dropped, the rest joined by "; ", cut at ``limit``."""
    lines = [x.strip() for x in source.splitlines() if x.strip() and not x.strip().startswith("#")]
    text = "; ".join(lines)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _headline(plan, d: dict) -> str:
    ir, p = plan.ir, plan.ir.problem
    strategy = plan.meta.get("strategy") or plan.meta.get("pipeline", "")
    return (f"{strategy}: {ir.devices} devices on {ir.nodes} node(s), {p.tokens:,} tokens in {len(p.seqlens):,} "
            f"documents, mask {_mask_text(p.mask)!r}, {ir.graph.n_cb:,} compute blocks")


# -- the device ------------------------------------------------------------------------------------

def _device_paragraph(plan, d: dict, focus: int, one: bool, top: int) -> list[str]:
    ir = plan.ir
    g, pl, n = ir.graph, ir.placement, ir.devices
    bars, s = d["bars"], d["stats"]
    flops, tokens = bars["flops"], bars["tokens"]
    fmean, tmean = max(1.0, bars["means"]["flops"]), max(1.0, bars["means"]["tokens"])
    cbs = np.flatnonzero(pl.cb_device == focus)
    rank = int((flops > flops[focus]).sum()) + 1
    what = f"device (the {_ordinal(rank)} most loaded of {n})" if one else "most loaded device"
    out = [f"{what} d{focus}: {flops[focus] / fmean:.2f}× mean forward FLOPs ({flops[focus]:.3e}, mean "
           f"{fmean:.3e}), {tokens[focus] / tmean:.2f}× mean tokens ({tokens[focus]:,}, mean {tmean:,.0f}), "
           f"{len(cbs)} compute blocks (mean {g.n_cb / n:.1f}); compute imbalance of the plan "
           f"{s['compute_imbalance']:.2f}"]
    why = _why(plan, bars, focus, cbs, s["pairs"] > 0)
    if why:
        out.append(why)
    if not len(cbs):
        return out + ["  it computes nothing"]
    return out + _work_sources(plan, focus, cbs, top)


def _why(plan, bars: dict, focus: int, cbs: np.ndarray, any_pairs: bool) -> str | None:
    """Why the device has its load: its tokens against the mean, times its pairs per token against the mean."""
    g, pl = plan.ir.graph, plan.ir.placement
    flops, tokens = bars["flops"], bars["tokens"]
    fmean, tmean = max(1.0, bars["means"]["flops"]), max(1.0, bars["means"]["tokens"])
    least = int(np.argmin(flops))
    tail = f"; least loaded: d{least} at {flops[least] / fmean:.2f}×" if least != focus else ""
    if not any_pairs:
        return None
    if tokens[focus] <= 0:
        return "  why: it homes no tokens; all its work is for tokens homed elsewhere" + tail
    fr, tr = flops[focus] / fmean, tokens[focus] / tmean
    pr = fr / tr  # pairs per homed token, against the batch's
    causes = []
    if tr > 1.05:
        causes.append("it homes more tokens than the mean")
    elif tr < 0.95:
        causes.append("it homes fewer tokens than the mean")
    if pr > 1.05:
        causes.append("its work sits where queries see many keys (long documents, late positions)")
    elif pr < 0.95:
        causes.append("its work sits where queries see few keys (short documents, early positions)")
    if (pl.home[g.cb_q[cbs]] != focus).any():
        causes.append("it also computes for tokens homed elsewhere")
    return (f"  why: {fr:.2f}× = {tr:.2f}× mean tokens × {pr:.2f}× mean pairs per homed token"
            + (f" — {'; '.join(causes)}" if causes else "") + tail)


def _work_sources(plan, focus: int, cbs: np.ndarray, top: int) -> list[str]:
    """The documents the device's work comes from, and its largest compute blocks."""
    ir = plan.ir
    g, p = ir.graph, ir.problem
    pairs = g.cb_pairs[cbs]
    dev_pairs = int(pairs.sum())
    fine, owner = ungroup(g) if g.grouped else (g, np.arange(g.n_cb))  # varlen groups: span by span
    fine_doc = np.searchsorted(p.offsets, fine.tb_start[fine.cb_q], "right") - 1
    mine = np.isin(owner, cbs)
    per_doc = np.bincount(fine_doc[mine], weights=fine.cb_pairs[mine], minlength=len(p.seqlens))
    doc_total = np.bincount(fine_doc, weights=fine.cb_pairs, minlength=len(p.seqlens))
    order = np.argsort(-per_doc, kind="stable")[:top]
    parts = [f"#{i} ({int(p.seqlens[i]):,} tokens) {per_doc[i] / max(1, dev_pairs):.1%}"
             f" (d{focus} does {per_doc[i] / max(1, doc_total[i]):.0%} of it)" for i in order if per_doc[i] > 0]
    items = []
    stage = ir.schedule.cb_stage
    bwd = phase_schedule(g, ir.placement, ir.schedule, BWD).cb_stage  # own blocks last under overlap{local=last}
    docs_of = np.bincount(owner, minlength=g.n_cb) if g.grouped else None
    for c in cbs[np.argsort(-pairs, kind="stable")[:top]].tolist():
        q, k = int(g.cb_q[c]), int(g.cb_k[c])
        if docs_of is None:
            where = (f"q tb{q} [{g.tb_start[q]:,}, {g.tb_end[q]:,}) × kv tb{k} [{g.tb_start[k]:,}, {g.tb_end[k]:,}) "
                     f"hg{g.cb_hg[c]} {g.cb_pairs[c]:,} pairs (doc #{fine_doc[c]}, ")
        else:
            where = (f"q tb{q} ({int(g.tb_len[q]):,} rows) × kv tb{k} ({int(g.tb_len[k]):,} rows) hg{g.cb_hg[c]} "
                     f"{g.cb_pairs[c]:,} pairs (varlen group: {int(docs_of[c])} span pairs, ")
        items.append(f"c{c} {where}stage {stage[c]}" + (f", backward stage {bwd[c]})" if bwd[c] != stage[c] else ")"))
    return [f"  documents it works on ({int((per_doc > 0).sum())} of {len(p.seqlens)}): " + "; ".join(parts),
            "  largest blocks: " + "; ".join(items)]


# -- transfers -------------------------------------------------------------------------------------

def _transfer_paragraph(plan, d: dict, focus: int, one: bool, top: int) -> list[str]:
    X = plan.ir.program.transfers
    scope = f" to or from d{focus}" if one else ""
    if one:
        X = X[(X[:, T_SRC] == focus) | (X[:, T_DST] == focus)]
    if not len(X):
        return [f"transfers: none{scope}"]
    dpn = plan.ir.placement.devices_per_node
    order = np.lexsort((X[:, 0], -X[:, T_BYTES]))[:top]
    ties = int((X[:, T_BYTES] == X[order[0], T_BYTES]).sum())
    items = []
    for t in X[order].tolist():
        link = "inter-node" if t[T_SRC] // dpn != t[T_DST] // dpn else "intra-node"
        items.append(f"t{t[0]} {PHASES[t[T_PHASE]]} {KINDS[t[T_KIND]]}[tb{t[T_TB]},hg{t[T_HG]}] "
                     f"d{t[T_SRC]}→d{t[T_DST]} {_mb(t[T_BYTES])} ({link})")
    return [f"largest transfers{scope} ({len(X):,} in all, {ties} of the largest size): " + "; ".join(items),
            _busiest(d, focus, one)]


def _busiest(d: dict, focus: int, one: bool) -> str:
    """The link that moves the most bytes (among the device's, with ``one``) and the busiest device."""
    bars, s = d["bars"], d["stats"]
    mat = d["comm"]["fwd"] + d["comm"]["bwd"]
    if one:
        keep = np.zeros_like(mat, bool)
        keep[focus, :] = keep[:, focus] = True
        mat = np.where(keep, mat, 0)
    a, b = np.unravel_index(int(np.argmax(mat)), mat.shape)
    busiest = int(np.argmax(bars["comm_in"] + bars["comm_out"]))
    return (f"  busiest link d{a}→d{b}: {_mb(mat[a, b])} in {d['comm']['count'][a, b]} messages; "
            f"busiest device d{busiest}: {_mb(bars['comm_in'][busiest] + bars['comm_out'][busiest])} in+out; "
            f"total {_mb(s['comm_bytes_total'])} (fwd {_mb(s['comm_bytes_fwd'])}, bwd {_mb(s['comm_bytes_bwd'])})")


# -- exposed communication -------------------------------------------------------------------------

def _device_exposed(L: dict, device: int) -> dict:
    """The exposed communication of one device per stage (from the phase's table)."""
    return {st: {"total_s": float(v["per_device"][device]), "max_s": float(v["per_device"][device]), "device": device}
            for st, v in L["exposed"].items() if v["per_device"][device] > 0}


def _exposed_paragraph(tl: dict, focus: int, one: bool) -> list[str]:
    worst = None
    lines = []
    for ph in ("fwd", "bwd"):
        ex = _device_exposed(tl[ph], focus) if one else tl[ph]["exposed"]
        if not ex:
            lines.append(f"  {ph}: no device waits")
            continue
        st, v = max(ex.items(), key=lambda kv: (kv[1]["max_s"], -kv[0]))
        lines.append(f"  {ph}: {_stage_name(st)}: d{v['device']} waits {_t(v['max_s'])}, all devices "
                     f"{_t(v['total_s'])} (of makespan {_t(tl[ph]['makespan_s'])})")
        if worst is None or v["max_s"] > worst[2]["max_s"]:
            worst = (ph, st, v)
    if worst is None:
        return ["exposed communication: none — no device ever waits on a transfer"]
    ph, st, v = worst
    return [f"longest exposed communication{f' on d{focus}' if one else ''}: {ph} "
            f"{_stage_name(st)}, {_t(v['max_s'])} on d{v['device']}"] + lines


# -- cost model ------------------------------------------------------------------------------------

def _cost_paragraph(d: dict, focus: int, one: bool) -> list[str]:
    s, tl = d["stats"], d["timeline"]
    out = [f"cost model ({s['profile']}): predicted {_t(s['predicted_s'])} = fwd {_t(s['predicted_fwd_s'])} + "
           f"bwd {_t(s['predicted_bwd_s'])}; lower bound {_t(s['lower_bound_s'])} "
           f"({s['predicted_over_lower_bound']:.2f}× the bound); kernel tile rounding "
           f"{s.get('kernel_work_ratio', 1.0):.3f}× the exact work"]
    for ph in ("fwd", "bwd"):
        L = tl[ph]
        last = focus if one else int(np.argmax(L["finish_s"]))
        idle = max(0.0, L["makespan_s"] - L["compute_s"][last] - L["wait_s"][last])
        out.append(f"  {ph} {'on' if one else 'ends on'} d{last} at {_t(L['finish_s'][last])}: compute "
                   f"{_t(L['compute_s'][last])}, waiting {_t(L['wait_s'][last])}, idle {_t(idle)}"
                   + (f" (phase makespan {_t(L['makespan_s'])})" if one else ""))
    return out


def _floor_lines(plan, d: dict, profile) -> list[str]:
    """The placement floor (:mod:`attnplan.backends.floor`) against the bound and the prediction."""
    s = d["stats"]
    f = placement_floor(plan.ir, plan_profile(plan, profile))
    lb = s["lower_bound_s"]
    binds = ", ".join(f"{ph} by {max(f[ph], key=f[ph].get)}" for ph in ("fwd", "bwd"))
    over = f" ({f['floor_s'] / lb:.2f}× the bound)" if lb > 0 else ""
    fl = f["floor_s"]
    rest = f"; the schedule, latency and launches add {s['predicted_s'] / fl:.2f}×" if fl > 0 else ""
    return [f"  placement floor {_t(f['floor_s'])}{over}: the least this placement allows with no latency, no "
            f"launches and every link busy ({binds}){rest}"]
