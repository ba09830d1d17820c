"""Plan statistics, with the definitions of docs/DESIGN.md (the same everywhere).

* pairs: allowed (q, k) pairs × query heads; flops_fwd = 4 · head_dim · pairs.
* compute_imbalance: max over devices of forward attention FLOPs / mean.
* token_imbalance: max tokens homed on a device / mean.
* comm bytes: every transfer once, forward and backward; a device's traffic
  is what it receives plus what it sends; ``comm_bytes_max`` is the largest;
  ``comm_bytes_inter`` the bytes that cross between nodes.
* messages: what travels on the wire — one per (source, destination, phase,
  stage), carrying the blocks (``transfers``) that move together; each pays
  one latency in the cost model. ``messages_max``: the most a device sends
  plus receives.
* lower_bound_s: forward+backward attention FLOPs / (devices × effective
  peak): perfect balance, no exposed communication, same profile as
  ``predicted_s`` so that predicted / lower bound = 1 means perfect.
* predicted_s: simulated forward + backward makespan (see ``cost``).
* last_stage_share: share of compute FLOPs in the schedule's last stage (the
  forward's; under ``overlap{local=last}`` the backward also runs its own blocks there)
  (what division scheduling should keep low; 1.0 for a single stage).
* kernel_work_ratio: work with every piece's query rows rounded up to the
  kernel tile (128 rows on GPUs) over exact work — what short blocks waste.
* kept_bytes_max: with ``keep_kv``, the most bytes of received KV a device
  holds from its forward to its backward (per attention call; 0 without).
"""

from __future__ import annotations

import numpy as np

from ..ir.program import BBYTES, BWD, FWD, M_DST, M_PHASE, M_SRC, T_BYTES, T_DST, T_PHASE, T_SRC
from .cost import Profile, get_profile, rounded_pairs, simulate


def _imbalance(x: np.ndarray) -> float:
    m = float(np.mean(x)) if len(x) else 0.0
    return float(np.max(x) / m) if m > 0 else 1.0


def _per_device(ir) -> dict:
    """Per device: forward attention FLOPs and pairs, tokens homed, bytes in and
    out (every transfer, both phases) and buffer bytes per phase."""
    g, pl, prog = ir.graph, ir.placement, ir.program
    n = ir.devices
    X = prog.transfers
    nb = X[:, T_BYTES].astype(float)
    return {
        "flops": np.bincount(pl.cb_device, weights=g.cb_flops(), minlength=n).astype(np.int64),
        "pairs": np.bincount(pl.cb_device, weights=g.cb_pairs, minlength=n).astype(np.int64),
        "tokens": np.bincount(pl.home, weights=g.tb_len, minlength=n).astype(np.int64),
        "comm_in": np.bincount(X[:, T_DST], weights=nb, minlength=n).astype(np.int64),
        "comm_out": np.bincount(X[:, T_SRC], weights=nb, minlength=n).astype(np.int64),
        "memory": [[int(b[:, BBYTES].sum()) for b in prog.buffers[ph]] for ph in (FWD, BWD)],
        "kept": prog.kept_bytes(),
    }


def _comm_totals(ir, dev: dict) -> dict:
    X, M = ir.program.transfers, ir.program.messages
    nb = X[:, T_BYTES].astype(float)
    fwd = X[:, T_PHASE] == FWD
    per_dev = np.bincount(M[:, M_SRC], minlength=ir.devices) + np.bincount(M[:, M_DST], minlength=ir.devices)
    per_node = ir.placement.devices_per_node
    inter = (X[:, T_SRC] // per_node) != (X[:, T_DST] // per_node)
    return {
        "comm_bytes_total": int(nb.sum()),
        "comm_bytes_fwd": int(nb[fwd].sum()),
        "comm_bytes_bwd": int(nb[~fwd].sum()),
        "comm_bytes_max": int((dev["comm_in"] + dev["comm_out"]).max()) if ir.devices else 0,
        "comm_bytes_inter": int(nb[inter].sum()),
        "transfers": int(len(X)),
        "messages": int(len(M)),
        "messages_fwd": int((M[:, M_PHASE] == FWD).sum()),
        "messages_bwd": int((M[:, M_PHASE] == BWD).sum()),
        "messages_max": int(per_dev.max()) if ir.devices else 0,
    }


def _schedule_shares(ir, total_pairs: int, total_flops: int) -> dict:
    """``last_stage_share`` and ``kernel_work_ratio`` (see the module docstring)."""
    g = ir.graph
    last = ir.schedule.cb_stage == ir.schedule.stages - 1
    rounded = (rounded_pairs(g, 128)[g.cb_tile] * g.hg_heads[g.cb_hg]).sum()
    return {"last_stage_share": float(g.cb_flops()[last].sum() / max(1, total_flops)),
            "kernel_work_ratio": float(rounded / max(1, total_pairs))}


def compute_stats(ir, plan_s: float | None = 0.0, profile: Profile | str = "h100", sim: dict | None = None) -> dict:
    """The stats of a plan's IR under ``profile`` (a :class:`Profile`, or a
    profile the user named: see :func:`cost.get_profile`; a plan's recorded
    name is resolved with :func:`cost.resolve_profile` first). ``sim``: a
    ``simulate`` result for that profile already at hand (the report reuses
    its recorded run)."""
    p = ir.problem
    n = ir.devices
    prof = get_profile(profile)
    dev = _per_device(ir)
    sim = simulate(ir, prof) if sim is None else sim
    total_flops = int(dev["flops"].sum())
    total_pairs = int(dev["pairs"].sum())
    lower = total_flops * (1 + prof.bwd_factor) / (n * prof.flops)
    return {
        "devices": n,
        "nodes": ir.nodes,
        "tokens": p.tokens,
        "samples": int(len(p.seqlens)),
        "heads": p.heads, "kv_heads": p.kv_heads, "head_dim": p.head_dim, "dtype": p.dtype,
        "partials_dtype": p.partials_dtype,
        "keep_kv": p.keep_kv,
        "kv_copies": int(ir.graph.kv_rep),  # copies of every kv head the plan moves and stores (ulysses > kv)
        "pairs": total_pairs,
        "flops_fwd": total_flops,
        "compute_imbalance": _imbalance(dev["flops"]),
        "token_imbalance": _imbalance(dev["tokens"]),
        **_comm_totals(ir, dev),
        "lower_bound_s": lower,
        "predicted_s": sim["predicted_s"],
        "predicted_fwd_s": sim["fwd"]["makespan_s"],
        "predicted_bwd_s": sim["bwd"]["makespan_s"],
        "predicted_over_lower_bound": sim["predicted_s"] / lower if lower > 0 else 1.0,
        "stages": ir.schedule.stages,
        **_schedule_shares(ir, total_pairs, total_flops),
        "profile": prof.name,
        "plan_s": plan_s,
        "token_blocks": ir.graph.n_tb,
        "compute_blocks": ir.graph.n_cb,
        "instructions": ir.program.n_instructions(),
        "kept_bytes_max": int(dev["kept"].max(initial=0)),
        "per_device": {
            "flops": dev["flops"].tolist(),
            "pairs": dev["pairs"].tolist(),
            "tokens": dev["tokens"].tolist(),
            "comm_in_bytes": dev["comm_in"].tolist(),
            "comm_out_bytes": dev["comm_out"].tolist(),
            "memory_fwd_bytes": dev["memory"][0],
            "memory_bwd_bytes": dev["memory"][1],
            "kept_bytes": dev["kept"].tolist(),
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
        ("heads q/kv x dim", f"{s['heads']}/{s['kv_heads']} x {s['head_dim']} ({s['dtype']}"
                             + (f", partials {s['partials_dtype']}" if s['partials_dtype'] != "float32" else "")
                             + (", forward KV kept)" if s.get("keep_kv") else ")")
                             + (f", kv heads copied x{s['kv_copies']}" if s.get("kv_copies", 1) > 1 else "")),
        ("pairs", f"{s['pairs']:,}"),
        ("flops fwd", f"{s['flops_fwd']:.3e}"),
        ("compute imbalance", f"{s['compute_imbalance']:.3f}"),
        ("token imbalance", f"{s['token_imbalance']:.3f}"),
        ("comm total (fwd+bwd)", f"{gb(s['comm_bytes_total'])} in {s['messages']:,} messages "
                                 f"({s['transfers']:,} blocks)"),
        ("comm max per device", gb(s["comm_bytes_max"])),
        *([("KV kept fwd -> bwd", f"{gb(s['kept_bytes_max'])} max per device")] if s.get("keep_kv") else []),
        ("predicted", f"{s['predicted_s'] * 1e3:.3f} ms ({s['profile']})"),
        ("lower bound", f"{s['lower_bound_s'] * 1e3:.3f} ms"),
        ("predicted / bound", f"{s['predicted_over_lower_bound']:.2f}"),
        ("blocks", f"{s['token_blocks']} token, {s['compute_blocks']} compute, {s['instructions']} instr"),
        ("plan time", "not stored" if s["plan_s"] is None else f"{s['plan_s']:.3f} s"),  # a loaded plan file
    ]
    w = max(len(k) for k, _ in head)
    lines = [f"{k:<{w}}  {v}" for k, v in head]
    pd = s["per_device"]
    mean = max(1.0, float(np.mean(pd["flops"])))
    lines.append("")
    lines.append(f"{'dev':>4} {'tokens':>9} {'flops/mean':>10} {'comm in':>11} {'comm out':>11} "
                 f"{'fwd ms':>8} {'bwd ms':>8}")
    for d in range(s["devices"]):
        lines.append(f"{d:>4} {pd['tokens'][d]:>9} {pd['flops'][d] / mean:>10.3f} {gb(pd['comm_in_bytes'][d]):>11} "
                     f"{gb(pd['comm_out_bytes'][d]):>11} {pd['predicted_fwd_s'][d] * 1e3:>8.3f} "
                     f"{pd['predicted_bwd_s'][d] * 1e3:>8.3f}")
    return "\n".join(lines)
