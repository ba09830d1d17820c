"""What a two-phase reduce of partial outputs across nodes could buy (issue
30): auto's load bound (:func:`attnplan.tools.auto.estimate`) of each plan as
compiled, beside the same bound with every partial (forward O, backward dQ
and dKV) bound for a remote home summed inside its node first — the dual of
the node relay of ``comm{relay=node}``: the partials of one (block, source
node) group go to one device of that node (the device the relay of the
reversed rows picks, :func:`attnplan.passes.comm.relay_rows`), which adds
them to its own and sends one message across. The reduce is not built; this
prices it with the estimate's model only (per device and phase, the larger
of compute plus merges and its busier send or receive queue — no program
order, so a lower bound of what a simulated plan of it could reach).

    .venv/bin/python benchmarks/reduce_whatif.py --names lmsys-128k-0,libra-128k-1 \\
        --strategies per_doc,dacp,span [--devices 32] [--batches ../shared/workloads/batches.jsonl]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np

import attnplan
from attnplan.backends.cost import DTYPE_EFFICIENCY, cb_seconds, get_profile, launches
from attnplan.backends.walk import merge_seconds
from attnplan.ir.program import B_DKV, B_DQ, B_KV, B_O, B_Q, BWD, FWD, buffer_bytes
from attnplan.ir.schedule import X_O, XDST, XHG, XSRC, XSTAGE, XTB
from attnplan.ir.verify import needed_transfers
from attnplan.passes.comm import relay_rows
from attnplan.tools.auto import _queues, _routes, estimate
from attnplan.tools.bench import load_batches


def reduced_estimate(ir, prof) -> float:
    """auto's estimate (forward + backward seconds) of a p2p plan with node
    relays for Q and KV and a two-phase reduce for the partials."""
    g, pl = ir.need_graph(), ir.need_placement()
    n, per_node = pl.devices, pl.devices_per_node
    rate = DTYPE_EFFICIENCY.get(g.problem.dtype, 1.0)
    blocks = np.bincount(pl.cb_device, minlength=n)
    compute = (np.bincount(pl.cb_device, weights=cb_seconds(g, prof, launch=False) / rate, minlength=n)
               + prof.launch_s * launches(blocks, prof) / rate)
    need = needed_transfers(g, pl)
    q, q_hop, kv, hop = _routes(g, pl, need, "p2p", "node")
    # partial O / dQ rows (tb, hg, computing device, home), reversed: the relay of (home -> computing devices)
    ro, _ = relay_rows(X_O, need[X_O][:, [0, 1, 3, 2]], per_node)
    o, o_hop = ro[:, [XTB, XHG, XSRC, XDST]], ro[:, XSTAGE]

    def part(rows, phase, kind, group, reverse=False):
        src, dst = (rows[:, 3], rows[:, 2]) if reverse else (rows[:, 2], rows[:, 3])
        return src, dst, buffer_bytes(g, phase, kind, rows[:, 0], rows[:, 1]), np.broadcast_to(group, len(rows)) + 1

    partial = 2  # message groups of their own, per reduce step
    comm_f, _ = _queues(n, per_node, prof, [part(q, FWD, B_Q, q_hop), part(kv, FWD, B_KV, hop),
                                            part(o, FWD, B_O, o_hop + partial, reverse=True)])
    comm_b, _ = _queues(n, per_node, prof, [part(q, BWD, B_Q, q_hop), part(kv, BWD, B_KV, hop),
                                            part(o, BWD, B_DQ, o_hop + partial, reverse=True),
                                            part(kv, BWD, B_DKV, hop + partial, reverse=True)])

    def merges(at, phase, kind, rows):  # every partial is merged where it arrives: the node's sum, or home
        sec = merge_seconds(buffer_bytes(g, phase, kind, rows[:, 0], rows[:, 1]).astype(float), prof.mem_bw)
        return np.bincount(at, weights=sec, minlength=n)
    comp_f = compute + merges(o[:, 2], FWD, B_O, o)
    comp_b = compute * prof.bwd_factor + merges(o[:, 2], BWD, B_DQ, o) + merges(kv[:, 2], BWD, B_DKV, kv)
    return float(np.maximum(comp_f, comm_f).max()) + float(np.maximum(comp_b, comm_b).max())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="../shared/workloads/batches.jsonl")
    ap.add_argument("--names", required=True)
    ap.add_argument("--strategies", default="per_doc,dacp,span")
    ap.add_argument("--devices", type=int, default=32)
    args = ap.parse_args(argv)
    prof = get_profile("h100")
    got: dict[str, list] = {}
    print(f"{'batch':<20} {'strategy':<14} {'pred/LB':>8} {'est/LB':>7} {'two-phase est/LB':>17}")
    for b in load_batches(args.batches, args.names.split(",")):
        for s in args.strategies.split(","):
            plan = attnplan.compile(seqlens=b["seqlens"], devices=args.devices, nodes=max(1, args.devices // 8),
                                    heads=8, kv_heads=2, head_dim=128, strategy=s)
            st = plan.stats()
            lb = st["lower_bound_s"]
            row = (st["predicted_over_lower_bound"], estimate(plan.ir, prof, "p2p").total_s / lb,
                   reduced_estimate(plan.ir, prof) / lb)
            got.setdefault(s, []).append(row)
            print(f"{b['name']:<20} {s:<14} {row[0]:>8.2f} {row[1]:>7.2f} {row[2]:>17.2f}")
    for s, rows in got.items():
        med = [statistics.median(r[i] for r in rows) for i in range(3)]
        print(f"{'median':<20} {s:<14} {med[0]:>8.2f} {med[1]:>7.2f} {med[2]:>17.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
