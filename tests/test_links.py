"""The fair link-sharing simulator (``links="fair"``, backends/links.py):
max-min rates against their definition, and whole simulations against
hand-computed timelines."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnplan
from attnplan.backends.cost import get_profile, simulate
from attnplan.backends.links import max_min_rates
from attnplan.errors import PlanError
from attnplan.ir.program import M_BYTES, M_DST, M_PHASE, M_SRC


@settings(max_examples=60)
@given(st.integers(1, 30), st.integers(2, 8), st.integers(0, 2**31 - 1))
def test_max_min_rates_meet_their_definition(flows, ports, seed):
    """Feasible (no port over capacity), and every flow has a bottleneck: a
    full port on which no other flow gets more (the max-min characterization)."""
    rng = np.random.default_rng(seed)
    use = np.column_stack([rng.integers(0, ports, flows), rng.integers(0, ports, flows)])
    cap = rng.uniform(1.0, 10.0, ports)
    rate = max_min_rates(use, cap)
    load = np.zeros(ports)
    np.add.at(load, use.ravel(), np.repeat(rate, 2))
    assert (load <= cap * (1 + 1e-9)).all() and (rate > 0).all()
    for f in range(flows):
        ok = False
        for p in set(use[f].tolist()):
            on = (use == p).any(axis=1)
            if load[p] >= cap[p] * (1 - 1e-9) and rate[f] >= rate[on].max() * (1 - 1e-9):
                ok = True
        assert ok, (f, use[f], rate[f])


def test_max_min_rates_by_hand():
    # three flows out of port 0 (capacity 3), one of them also into port 1 (capacity 0.5)
    rate = max_min_rates(np.array([[0, 2], [0, 3], [0, 1]]), np.array([3.0, 0.5, 10.0, 10.0]))
    assert rate == pytest.approx([1.25, 1.25, 0.5])


def fair(prof="h100", **kw):
    return dataclasses.replace(get_profile(prof), links="fair", **kw)


def two_device_plan():
    return attnplan.compile(seqlens=[4096], devices=2, heads=4, kv_heads=2, head_dim=64, block_size=512,
                            strategy="zigzag")


def test_one_message_at_a_time_is_the_queue_model():
    """Where no two messages are in flight on the same port at once, sharing
    changes nothing: 2 devices, one message each way per stage, equal links."""
    plan = two_device_plan()
    prof = get_profile("h100")
    q, f = simulate(plan.ir, prof), simulate(plan.ir, fair())
    for ph in ("fwd", "bwd"):
        assert f[ph]["finish_s"] == pytest.approx(q[ph]["finish_s"], rel=1e-9)


def test_two_senders_share_one_receivers_port():
    """Devices 0 and 1 each send B bytes to device 2 at once (same node):
    the receive port is shared, both messages end at alpha + 2B/bw (the
    queue model ends one at alpha + B/bw); then device 2 sends B bytes to
    device 0 alone, at full rate."""
    from attnplan.backends.links import fair_walk
    from attnplan.ir.program import RECV, SEND, WAIT
    prof = fair()
    B, bw, a = 3.7e6, prof.intra_bw, prof.intra_alpha
    steps = [[(SEND, 0, 0.0), (WAIT, 0, 0.0), (RECV, 2, 0.0), (WAIT, 2, 0.0)],
             [(SEND, 1, 0.0), (WAIT, 1, 0.0)],
             [(RECV, 0, 0.0), (RECV, 1, 0.0), (WAIT, 0, 0.0), (WAIT, 1, 0.0), (SEND, 2, 0.0), (WAIT, 2, 0.0)]]
    walk = fair_walk(steps, [0, 1, 2], [2, 2, 0], [B, B, B], 8, prof, True, 0)
    walk.run()
    assert walk.end[0] == pytest.approx(a + 2 * B / bw) and walk.end[1] == pytest.approx(a + 2 * B / bw)
    assert walk.end[2] == pytest.approx(2 * a + 3 * B / bw)
    assert walk.clock == pytest.approx([2 * a + 3 * B / bw, a + 2 * B / bw, 2 * a + 3 * B / bw])


def test_fair_makespan_is_at_least_the_busiest_port():
    """No compute and no latency: each phase takes at least its busiest
    port's bytes over the bandwidth."""
    plan = attnplan.compile(seqlens=[3000, 1000, 500], devices=4, heads=4, kv_heads=2, head_dim=64, block_size=256,
                            strategy="minheap")
    f = simulate(plan.ir, fair(peak_flops=1e30, launch_s=0.0, intra_alpha=0.0, inter_alpha=0.0, mem_bw=1e30))
    M = plan.ir.program.messages
    for ph, name in ((0, "fwd"), (1, "bwd")):
        m = M[M[:, M_PHASE] == ph]
        busiest = max(np.bincount(m[:, M_SRC], weights=m[:, M_BYTES]).max(),
                      np.bincount(m[:, M_DST], weights=m[:, M_BYTES]).max()) / get_profile("h100").intra_bw
        assert busiest * (1 - 1e-9) <= f[name]["makespan_s"]


def test_fair_simulation_records_every_message_and_never_deadlocks():
    for strategy in ("zigzag", "hypergraph", "per_doc", "usp"):
        plan = attnplan.compile(seqlens=[5000, 2000, 700, 300, 40], devices=8, nodes=2, heads=8, kv_heads=2,
                                head_dim=64, block_size=256, strategy=strategy)
        sim = simulate(plan.ir, fair(), record=True)
        M = plan.ir.program.messages
        for ph, name in ((0, "fwd"), (1, "bwd")):
            ev = sim[name]["events"]["transfer"]
            assert sorted(ev[:, 0].astype(int).tolist()) == np.flatnonzero(M[:, M_PHASE] == ph).tolist()
            assert (ev[:, 4] > ev[:, 3]).all()
        assert sim["predicted_s"] >= plan.stats()["lower_bound_s"]


def test_links_mode_is_checked():
    with pytest.raises(PlanError, match="links must be one of"):
        dataclasses.replace(get_profile("h100"), links="shared")
