"""The placement floor: the least forward + backward time a plan's placement
allows under a cost profile, whatever its schedule, relays and reduces.

Per phase the largest of three terms, each a time no schedule of the
placement can beat in the cost model (:func:`attnplan.backends.cost.simulate`:
one compute stream, one send and one receive queue per device, a message
``alpha + bytes / bandwidth`` on both queues):

* ``compute``: the busiest device's kernel work (tile-rounded, no launches);
* ``recv``: the busiest receive queue — every block a device computes with
  but does not home passes its queue once, at the faster link's bandwidth at
  best; and per node, each block that some device of the node needs from
  another node crosses into it at least once at the inter-node bandwidth, the
  rest of the node's inbound bytes at the faster one, spread evenly over its
  devices' queues;
* ``send``: the same for the partial outputs a device computes for other
  homes (each leaves its device once: alone, or summed with others of its
  node), out of the devices and nodes.

Under ``links="fair"`` (:mod:`attnplan.backends.links`: a device's NVLink
and NIC ports apart, used at once) a device's bytes may arrive at both
bandwidths together, and a node's crossing bytes need only its NICs.

Forward: Q and KV come in, O partials go out. Backward: the Q bundle and,
without ``keep_kv``, the KV again come in; dQ and dKV partials go out (in
the problem's ``partials_dtype``). No latency and no launches enter, so the
simulated time is never below the floor (the tests check it on every
strategy); over the lower bound (:mod:`attnplan.backends.stats`) it says how
far the placement alone keeps a plan from perfect balance, and predicted /
floor what latency, launches and imperfect overlap add.
"""

from __future__ import annotations

import numpy as np

from ..ir.program import B_DKV, B_DQ, B_KV, B_O, B_Q, BWD, FWD, PHASES, buffer_bytes
from ..ir.schedule import X_KV, X_O, X_Q
from ..ir.verify import needed_transfers
from .cost import DTYPE_EFFICIENCY, Profile, cb_seconds, get_profile

def queue_seconds(parts: list, at: int, n: int, per_node: int, prof: Profile) -> float:
    """The least time the busiest receive (``at`` = 3: rows' destinations) or
    send (``at`` = 2: sources) queue needs for ``parts``, one ``(rows,
    nbytes)`` per kind of buffer, rows ``(tb, hg, src, dst)`` (module doc)."""
    rows = np.concatenate([np.asarray(r, np.int64).reshape(-1, 4) for r, _ in parts])
    if not len(rows):
        return 0.0
    nbytes = np.concatenate([b for _, b in parts])
    kind = np.repeat(np.arange(len(parts)), [len(r) for r, _ in parts])
    dev = rows[:, at]
    fair = prof.links == "fair"  # NVLink and NIC ports apart: a device may use both at once
    fast = prof.intra_bw + prof.inter_bw if fair else max(prof.intra_bw, prof.inter_bw)  # a byte's best rate
    device = float(np.bincount(dev, weights=nbytes, minlength=n).max()) / fast
    nodes = max(1, n // per_node)
    node, other = dev // per_node, rows[:, 5 - at] // per_node
    cross = node != other
    block = (kind[cross] * (int(rows[:, 0].max()) + 1) + rows[cross, 0]) * (int(rows[:, 1].max()) + 1) + rows[cross, 1]
    first = np.unique(block * nodes + node[cross], return_index=True)[1]  # a (kind, block) crosses into a node once
    once = np.bincount(node[cross][first], weights=nbytes[cross][first], minlength=nodes)
    total = np.bincount(node, weights=nbytes, minlength=nodes)
    if fair:
        node_s = np.maximum(once / prof.inter_bw, total / fast)
    else:
        node_s = once / prof.inter_bw + (total - once) / fast
    return max(device, float((node_s / per_node).max()))


def placement_floor(ir, profile: Profile | str = "h100") -> dict:
    """``{"floor_s", "fwd": {term: seconds}, "bwd": {...}}`` of a placed IR
    (module doc); ``floor_s`` is the sum over phases of each phase's largest term."""
    prof = get_profile(profile)
    g, pl = ir.need_graph(), ir.need_placement()
    n, per_node, keep = pl.devices, pl.devices_per_node, g.problem.keep_kv
    need = needed_transfers(g, pl)
    q, kv, o = need[X_Q], need[X_KV], need[X_O]

    def size(rows: np.ndarray, phase: int, kind: int, wire: bool = False) -> np.ndarray:
        return buffer_bytes(g, phase, kind, rows[:, 0], rows[:, 1], wire=wire).astype(float)

    back = kv[:, [0, 1, 3, 2]]  # dKV partials: from the computing device to the KV's home
    traffic = {  # per phase: what comes in, what goes out, as (rows, bytes) per kind of buffer
        FWD: ([(q, size(q, FWD, B_Q)), (kv, size(kv, FWD, B_KV))], [(o, size(o, FWD, B_O, True))]),
        BWD: ([(q, size(q, BWD, B_Q))] + ([] if keep else [(kv, size(kv, BWD, B_KV))]),
              [(o, size(o, BWD, B_DQ, True)), (back, size(back, BWD, B_DKV, True))]),
    }
    kernel = cb_seconds(g, prof, launch=False) / DTYPE_EFFICIENCY.get(g.problem.dtype, 1.0)
    busiest = float(np.bincount(pl.cb_device, weights=kernel, minlength=n).max()) if g.n_cb else 0.0
    out: dict = {"floor_s": 0.0}
    for phase, factor in ((FWD, 1.0), (BWD, prof.bwd_factor)):
        into, out_of = traffic[phase]
        terms = {"compute": busiest * factor, "recv": queue_seconds(into, 3, n, per_node, prof),
                 "send": queue_seconds(out_of, 2, n, per_node, prof)}
        out[PHASES[phase]] = terms
        out["floor_s"] += max(terms.values())
    return out
