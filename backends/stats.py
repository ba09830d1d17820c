"""Plan statistics, with the definitions of DESIGN.md (the same everywhere).

* pairs: allowed (q, k) pairs × query heads; flops_fwd = 4 · head_dim · pairs.
* compute_imbalance: max over devices of forward attention FLOPs / mean.
* token_imbalance: max tokens homed on a device / mean.
* comm bytes: every transfer once, forward and backward; a device's traffic
  is what it receives plus what it sends; ``comm_bytes_max`` is the largest.
* lower_bound_s: forward+backward attention FLOPs / (devices × effective
  peak): perfect balance, no exposed communication, same profile as
  ``predicted_s`` so that predicted / lower bound = 1 means perfect.
* predicted_s: simulated forward + backward makespan (see ``cost``).
* last_stage_share: share of compute FLOPs in the schedule's last stage
  (what division scheduling should keep low; 1.0 for a single stage).
* kernel_work_ratio: work with every piece's query rows rounded up to the
  kernel tile (128 rows on GPUs) over exact work — what short blocks waste.
"""

from __future__ import annotations

import numpy as np

from ..ir.program import BBYTES, BWD, FWD, T_BYTES, T_DST, T_PHASE, T_SRC
from .cost import get_profile, rounded_pairs, simulate


def _imbalance(x: np.ndarray) -> float:
    m = float(np.mean(x)) if len(x) else 0.0
    return float(np.max(x) / m) if m > 0 else 1.0


def compute_stats(ir, plan_s: float = 0.0, profile: str = "h100", sim: dict | None = None) -> dict:
    """``sim``: a ``simulate`` result for ``profile`` already at hand (the report reuses its recorded run)."""
    g, pl, prog, p = ir.graph, ir.placement, ir.program, ir.problem
    n = ir.devices
    flops = np.bincount(pl.cb_device, weights=g.cb_flops(), minlength=n).astype(np.int64)
    pairs = np.bincount(pl.cb_device, weights=g.cb_pairs, minlength=n).astype(np.int64)
    tokens = np.bincount(pl.home, weights=g.tb_len, minlength=n).astype(np.int64)
    X = prog.transfers
    nb = X[:, T_BYTES].astype(float)
    cin = np.bincount(X[:, T_DST], weights=nb, minlength=n).astype(np.int64)
    cout = np.bincount(X[:, T_SRC], weights=nb, minlength=n).astype(np.int64)
    fwd = X[:, T_PHASE] == FWD
    mem = [[int(b[:, BBYTES].sum()) for b in prog.buffers[ph]] for ph in (FWD, BWD)]
    prof = get_profile(profile)
    sim = simulate(ir, prof) if sim is None else sim
    total_flops = int(flops.sum())
    lower = total_flops * (1 + prof.bwd_factor) / (n * prof.flops)
    return {
        "devices": n,
        "nodes": ir.nodes,
        "tokens": p.tokens,
        "samples": int(len(p.seqlens)),
        "heads": p.heads, "kv_heads": p.kv_heads, "head_dim": p.head_dim, "dtype": p.dtype,
        "pairs": int(pairs.sum()),
        "flops_fwd": total_flops,
        "compute_imbalance": _imbalance(flops),
        "token_imbalance": _imbalance(tokens),
        "comm_bytes_total": int(nb.sum()),
        "comm_bytes_fwd": int(nb[fwd].sum()),
        "comm_bytes_bwd": int(nb[~fwd].sum()),
        "comm_bytes_max": int((cin + cout).max()) if n else 0,
        "transfers": int(len(X)),
        "lower_bound_s": lower,
        "predicted_s": sim["predicted_s"],
        "predicted_fwd_s": sim["fwd"]["makespan_s"],
        "predicted_bwd_s": sim["bwd"]["makespan_s"],
        "predicted_over_lower_bound": sim["predicted_s"] / lower if lower > 0 else 1.0,
        "stages": ir.schedule.stages,
        "last_stage_share": float(g.cb_flops()[ir.schedule.cb_stage == ir.schedule.stages - 1].sum()
                                  / max(1, total_flops)),
        "kernel_work_ratio": float((rounded_pairs(g, 128)[g.cb_tile] * g.hg_heads[g.cb_hg]).sum() / max(1, pairs.sum())),
        "profile": profile,
        "plan_s": plan_s,
        "token_blocks": g.n_tb,
        "compute_blocks": g.n_cb,
        "instructions": prog.n_instructions(),
        "per_device": {
            "flops": flops.tolist(),
            "pairs": pairs.tolist(),
            "tokens": tokens.tolist(),
            "comm_in_bytes": cin.tolist(),
            "comm_out_bytes": cout.tolist(),
            "memory_fwd_bytes": mem[0],
            "memory_bwd_bytes": mem[1],
            "predicted_fwd_s": sim["fwd"]["finish_s"],
            "predicted_bwd_s": sim["bwd"]["finish_s"],
        },
    }


def format_stats(s: dict) -> str:
    """A human table of the stats (``plan stats`` without ``--json``)."""
    def gb(x):
        return f"{x / 1e6:.2f} MB" if x < 1e9 else f"{x / 1e9:.2f} GB"

    head = [
        ("devices x nodes", f"{s['devices']} on {s['nodes']} node(s)"),
        ("tokens / samples", f"{s['tokens']} / {s['samples']}"),
        ("heads q/kv x dim", f"{s['heads']}/{s['kv_heads']} x {s['head_dim']} ({s['dtype']})"),
        ("pairs", f"{s['pairs']:,}"),
        ("flops fwd", f"{s['flops_fwd']:.3e}"),
        ("compute imbalance", f"{s['compute_imbalance']:.3f}"),
        ("token imbalance", f"{s['token_imbalance']:.3f}"),
        ("comm total (fwd+bwd)", gb(s["comm_bytes_total"])),
        ("comm max per device", gb(s["comm_bytes_max"])),
        ("predicted", f"{s['predicted_s'] * 1e3:.3f} ms ({s['profile']})"),
        ("lower bound", f"{s['lower_bound_s'] * 1e3:.3f} ms"),
        ("predicted / bound", f"{s['predicted_over_lower_bound']:.2f}"),
        ("blocks", f"{s['token_blocks']} token, {s['compute_blocks']} compute, {s['instructions']} instr"),
        ("plan time", f"{s['plan_s']:.3f} s"),
    ]
    w = max(len(k) for k, _ in head)
    lines = [f"{k:<{w}}  {v}" for k, v in head]
    pd = s["per_device"]
    mean = max(1.0, float(np.mean(pd["flops"])))
    lines.append("")
    lines.append(f"{'dev':>4} {'tokens':>9} {'flops/mean':>10} {'comm in':>11} {'comm out':>11} {'fwd ms':>8} {'bwd ms':>8}")
    for d in range(s["devices"]):
        lines.append(f"{d:>4} {pd['tokens'][d]:>9} {pd['flops'][d] / mean:>10.3f} {gb(pd['comm_in_bytes'][d]):>11} "
                     f"{gb(pd['comm_out_bytes'][d]):>11} {pd['predicted_fwd_s'][d] * 1e3:>8.3f} "
                     f"{pd['predicted_bwd_s'][d] * 1e3:>8.3f}")
    return "\n".join(lines)
