"""The data behind the report's static panels, each computed by one function
from the plan's IR alone (columnar numpy, no HTML), so tests can check them
against ``plan.stats()``:

* :func:`mask_cells` — the mask as a grid of compute blocks coloured by
  device, with document boundaries. When there are more token blocks than
  ``max_bins``, consecutive token blocks are grouped into at most
  ``max_bins`` bins of about equal tokens, so at most ``max_bins²`` cells are
  drawn; a cell keeps its exact pair count, its pairs per device (the
  dominant device colours it), its stages (the schedule's: the forward's order) and the range of blocks it
  stands for.
* :func:`device_bars` — per device: forward attention FLOPs, tokens homed,
  buffer memory (forward, backward), bytes in and out, with their means.
* :func:`comm_matrix` — device × device bytes moved (forward, backward) and
  transfer counts.

:func:`panel_data` gathers them with the stats and the timeline (one
simulation serves both). A ``plan`` here is anything with the IR (``.ir``)
and its metadata (``.meta``; ``.measured`` if present).
"""

from __future__ import annotations

import numpy as np

from ..errors import PlanError
from ..ir.groups import ungroup
from ..ir.program import BBYTES, BWD, FWD, M_DST, M_SRC, T_BYTES, T_DST, T_PHASE, T_SRC
from .cost import Profile, simulate
from .stats import compute_stats
from .timeline import plan_profile, timeline

BAR_LABELS = {"flops": ("attention FLOPs (fwd)", "flop"), "tokens": ("tokens homed", "tok"),
              "memory_fwd": ("buffer memory, fwd", "B"), "memory_bwd": ("buffer memory, bwd", "B"),
              "comm_in": ("bytes in (fwd+bwd)", "B"), "comm_out": ("bytes out (fwd+bwd)", "B")}


# ----------------------------------------------------------------------------------------------
# mask
# ----------------------------------------------------------------------------------------------

def _group_starts(sorted_keys: np.ndarray) -> np.ndarray:
    """Start index of every run of equal values in ``sorted_keys``."""
    if not len(sorted_keys):
        return np.zeros(0, np.int64)
    return np.concatenate([[0], np.flatnonzero(np.diff(sorted_keys)) + 1]).astype(np.int64)


def _reduce(ufunc, values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """``ufunc.reduceat`` over the runs starting at ``starts`` (empty when there are none)."""
    return ufunc.reduceat(values, starts) if len(starts) else np.zeros(0, np.int64)


def token_bins(graph, max_bins: int) -> np.ndarray:
    """Bin of every token block: one bin per block when there are at most
    ``max_bins``, else consecutive blocks grouped by their middle token into
    at most ``max_bins`` bins of about ``tokens / max_bins`` tokens."""
    if isinstance(max_bins, bool) or not isinstance(max_bins, (int, np.integer)) or max_bins < 1:
        raise PlanError(f"max_bins must be a positive integer, got {max_bins!r}")
    n = graph.n_tb
    if n <= max_bins:
        return np.arange(n, dtype=np.int64)
    T = int(graph.tb_end[-1])
    raw = ((graph.tb_start + graph.tb_end) * max_bins) // (2 * T)
    return np.unique(raw, return_inverse=True)[1].astype(np.int64)


def _cell_device_pairs(cell: np.ndarray, dev: np.ndarray, pairs: np.ndarray, n: int) -> tuple:
    """Pairs per (cell, device) present: ``(cd_cell, cd_device, cd_pairs)``, sorted by cell then device."""
    key = cell * n + dev
    order = np.argsort(key, kind="stable")
    st = _group_starts(key[order])
    cd_key = key[order][st]
    return cd_key // n, cd_key % n, _reduce(np.add, pairs[order], st)


def _cell_totals(cell: np.ndarray, pairs: np.ndarray, stage: np.ndarray, cb_id: np.ndarray) -> dict:
    """Per cell present (in increasing cell order): its id, compute blocks,
    pairs, first and last stage and first and last compute block (``cb_id``;
    a varlen group's span blocks count once)."""
    order = np.lexsort((cb_id, cell))
    cs = _group_starts(cell[order])
    ids = cb_id[order]
    new_id = np.ones(len(ids), bool)
    new_id[1:] = ids[1:] != ids[:-1]
    new_id[cs] = True
    return {"cell": cell[order][cs], "blocks": _reduce(np.add, new_id.astype(np.int64), cs),
            "pairs": _reduce(np.add, pairs[order], cs),
            "stage_min": _reduce(np.minimum, stage[order], cs), "stage_max": _reduce(np.maximum, stage[order], cs),
            "cb_min": _reduce(np.minimum, ids, cs), "cb_max": _reduce(np.maximum, ids, cs)}


def _dominant_device(cd_cell: np.ndarray, cd_device: np.ndarray, cd_pairs: np.ndarray) -> tuple:
    """Per cell: the device with the most pairs (ties: the lowest), its pairs, and how many devices share the cell."""
    dom = np.lexsort((cd_device, -cd_pairs, cd_cell))
    ds = _group_starts(cd_cell[dom])
    ndev = np.diff(np.concatenate([ds, [len(dom)]])).astype(np.int64)
    return cd_device[dom][ds], cd_pairs[dom][ds], ndev


def mask_cells(plan, max_bins: int = 160) -> dict:
    """The mask panel: compute blocks aggregated into cells of a (q bin, kv bin) grid.

    Returns ``edges`` (token position of each bin start, and T), ``bin_tb0``
    (first token block of each bin, and the count; of a grouped plan, whose
    cells are drawn span by span and ``spans`` is true: first span), ``doc_offsets``, per-cell
    columns ``q, k, pairs, blocks, device, share, devices, stage_min,
    stage_max, cb_min, cb_max, density`` (``pairs`` are allowed pairs × query
    heads; ``density`` = pairs / (heads × cell area); ``share`` = the dominant
    device's part of the pairs) and the exact per-(cell, device) breakdown
    ``cd_cell, cd_device, cd_pairs``."""
    ir = plan.ir
    g, p = ir.graph, ir.problem
    cb_device = ir.placement.cb_device
    stage = ir.schedule.cb_stage if ir.schedule is not None else np.zeros(g.n_cb, np.int64)
    cb_id = np.arange(g.n_cb, dtype=np.int64)
    if g.grouped:  # varlen groups: drawn span by span, each span block's pairs on its group's device and stage
        g, cb_id = ungroup(g)
        cb_device, stage = cb_device[cb_id], stage[cb_id]
    tb_bin = token_bins(g, max_bins)
    nb = int(tb_bin[-1]) + 1 if len(tb_bin) else 0
    bin_tb0 = np.searchsorted(tb_bin, np.arange(nb + 1)).astype(np.int64)
    edges = np.concatenate([g.tb_start[bin_tb0[:-1]], [p.tokens]]).astype(np.int64)
    cell = tb_bin[g.cb_q] * nb + tb_bin[g.cb_k]
    pairs = g.cb_pairs.astype(np.int64)
    cd_cell, cd_device, cd_pairs = _cell_device_pairs(cell, cb_device.astype(np.int64), pairs, ir.devices)
    c = _cell_totals(cell, pairs, stage.astype(np.int64), cb_id)
    top_dev, top_pairs, ndev = _dominant_device(cd_cell, cd_device, cd_pairs)
    q, k = (c["cell"] // nb, c["cell"] % nb) if nb else (c["cell"], c["cell"])
    area = (edges[q + 1] - edges[q]).astype(float) * (edges[k + 1] - edges[k])
    density = c["pairs"] / np.maximum(1.0, area * p.heads)
    return {
        "tokens": p.tokens, "heads": p.heads, "n_tb": ir.graph.n_tb, "n_cb": ir.graph.n_cb, "bins": nb,
        "spans": ir.graph.grouped,
        "aggregated": nb < g.n_tb, "edges": edges, "bin_tb0": bin_tb0, "doc_offsets": p.offsets,
        "q": q, "k": k, "pairs": c["pairs"], "blocks": c["blocks"], "device": top_dev,
        "share": top_pairs / np.maximum(1, c["pairs"]), "devices": ndev, "stage_min": c["stage_min"],
        "stage_max": c["stage_max"], "cb_min": c["cb_min"], "cb_max": c["cb_max"],
        "density": np.minimum(1.0, density), "cd_cell": cd_cell, "cd_device": cd_device, "cd_pairs": cd_pairs,
    }


# ----------------------------------------------------------------------------------------------
# per-device bars, communication matrix
# ----------------------------------------------------------------------------------------------

def comm_matrix(plan) -> dict:
    """Bytes moved from device (row) to device (column): ``fwd``, ``bwd`` (int64
    ``[n, n]``) and ``count`` (messages, both phases)."""
    prog = plan.ir.program
    n = plan.ir.devices
    X = prog.transfers
    src, dst, nb = X[:, T_SRC], X[:, T_DST], X[:, T_BYTES]
    flat = src * n + dst
    fwd = X[:, T_PHASE] == FWD
    mat = {}
    for name, sel in (("fwd", fwd), ("bwd", ~fwd)):
        mat[name] = np.bincount(flat[sel], weights=nb[sel], minlength=n * n).astype(np.int64).reshape(n, n)
    M = prog.messages
    mat["count"] = np.bincount(M[:, M_SRC] * n + M[:, M_DST], minlength=n * n).astype(np.int64).reshape(n, n)
    return mat


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


# ----------------------------------------------------------------------------------------------
# everything one report draws
# ----------------------------------------------------------------------------------------------

def plan_stats(plan, prof: Profile, sim: dict | None = None) -> dict:
    """``plan.stats()`` computed from the IR and metadata (what the face's ``Plan.stats`` returns)."""
    s = compute_stats(plan.ir, getattr(plan, "measured", {}).get("plan_s", 0.0), prof, sim)
    s["pipeline"] = plan.meta.get("pipeline", "")
    return s


def panel_data(plan, profile=None, max_bins: int = 160, max_spans: int = 20000) -> dict:
    """Everything the report draws for one plan (numpy arrays and dicts)."""
    prof = plan_profile(plan, profile)
    sim = simulate(plan.ir, prof, record=True)  # one run serves the stats and the timeline
    return {"stats": plan_stats(plan, prof, sim), "mask": mask_cells(plan, max_bins), "bars": device_bars(plan),
            "comm": comm_matrix(plan), "timeline": timeline(plan, prof, max_spans, sim=sim)}
