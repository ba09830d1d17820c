"""The placement floor (backends/floor.py): never above what the simulator
predicts, for every strategy, communication variant and option; and equal
to its terms computed by hand on small plans."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnplan
from attnplan.backends.cost import cb_seconds, get_profile, simulate
from attnplan.backends.explain import explain
from attnplan.backends.floor import placement_floor
from attnplan.errors import PlanError
from attnplan.passes import strategy_entries

ENTRIES = list(strategy_entries()) + ["span:tree", "per_doc:tree", "dacp:tree", "hypergraph:direct",
                                              "zigzag:allgather", "per_doc:relay"]


@settings(max_examples=60)
@given(st.lists(st.integers(16, 3000), min_size=1, max_size=10), st.sampled_from([(2, 1), (4, 1), (4, 2), (8, 2),
                                                                                  (8, 4)]),
       st.sampled_from(ENTRIES), st.booleans(), st.sampled_from(["float32", "bfloat16"]))
def test_the_floor_is_never_above_the_simulation(lens, shape, entry, keep_kv, partials):
    devices, nodes = shape
    try:
        plan = attnplan.compile(lens, devices=devices, nodes=nodes, heads=8, kv_heads=2, head_dim=64,
                                block_size=512, strategy=entry, keep_kv=keep_kv, partials_dtype=partials)
    except PlanError as e:  # shapes a strategy refuses (ulysses past the heads)
        assert "not supported" in str(e), e
        return
    h100 = get_profile("h100")
    fast_nic = dataclasses.replace(h100, name="y", intra_bw=10e9, inter_bw=400e9)  # NICs faster than the node links
    for prof in (h100, dataclasses.replace(h100, name="x", inter_bw=2e9), dataclasses.replace(h100, links="fair"),
                 fast_nic, dataclasses.replace(fast_nic, links="fair")):
        f = placement_floor(plan.ir, prof)
        sim = simulate(plan.ir, prof)
        assert f["floor_s"] <= sim["predicted_s"] * (1 + 1e-9), (entry, f, sim["predicted_s"])
        for ph in ("fwd", "bwd"):
            assert max(f[ph].values()) <= sim[ph]["makespan_s"] * (1 + 1e-9), (entry, ph, f[ph])


@pytest.mark.parametrize("entry", ENTRIES)
def test_every_entry_on_a_long_tailed_batch(entry):
    """Every strategy and variant plans this batch on 8 devices of 2 nodes; its
    floor is at least the bound's share and at most the prediction."""
    plan = attnplan.compile([5000, 2100, 900, 640, 300, 120, 64], devices=8, nodes=2, heads=8, kv_heads=8,
                            head_dim=64, block_size=512, strategy=entry)
    f = placement_floor(plan.ir, "h100")
    s = plan.stats()
    assert s["lower_bound_s"] * (1 - 1e-9) <= f["floor_s"] <= s["predicted_s"] * (1 + 1e-9), (entry, f, s)


def test_nics_faster_than_the_node_links():
    """A profile whose inter-node links are faster than its in-node ones (nothing forbids it): a byte's
    best rate is the faster link's (zigzag over 2 nodes kept its forward under this floor's old in-node
    rate: 944 µs of floor against 701 µs predicted)."""
    prof = dataclasses.replace(get_profile("h100"), name="fastib", intra_bw=10e9, inter_bw=400e9)
    plan = attnplan.compile([8192], devices=4, nodes=2, heads=8, kv_heads=2, head_dim=64, block_size=512,
                            strategy="zigzag", keep_kv=True)
    assert placement_floor(plan.ir, prof)["floor_s"] <= simulate(plan.ir, prof)["predicted_s"]


def test_one_device_is_its_kernel_work():
    plan = attnplan.compile([3000, 700], devices=1, heads=8, kv_heads=2, head_dim=64, block_size=512)
    prof = get_profile("h100")
    f = placement_floor(plan.ir, prof)
    work = float(cb_seconds(plan.ir.graph, prof, launch=False).sum())
    assert f["fwd"] == {"compute": pytest.approx(work), "recv": 0.0, "send": 0.0}
    assert f["floor_s"] == pytest.approx(work * (1 + prof.bwd_factor))


@pytest.mark.parametrize("keep_kv", [False, True])
def test_ulysses_on_two_devices_by_hand(keep_kv):
    """Two devices of one node, 4 query / 2 kv heads of 64: device d homes half
    the tokens and computes head group d for all of them, so it receives the
    other half's Q (2 heads x 64 x 2 bytes) and KV (2 x 1 x 64 x 2) and sends
    back their O partials (2 heads x (64 x 4 + 4) bytes, fp32 and lse)."""
    t = 4096
    plan = attnplan.compile([t], devices=2, heads=4, kv_heads=2, head_dim=64, block_size=512, strategy="ulysses",
                            keep_kv=keep_kv)
    prof = get_profile("h100")
    f = placement_floor(plan.ir, prof)
    half = t // 2
    assert f["fwd"]["recv"] == pytest.approx(half * (256 + 256) / prof.intra_bw)
    assert f["fwd"]["send"] == pytest.approx(half * 2 * (64 * 4 + 4) / prof.intra_bw)
    q_bundle = 2 * (3 * 64 * 2 + 4)  # q, out, dout in bf16 and lse in fp32, per query head
    assert f["bwd"]["recv"] == pytest.approx(half * (q_bundle + (0 if keep_kv else 256)) / prof.intra_bw)
    assert f["bwd"]["send"] == pytest.approx(half * (2 * 64 * 4 + 2 * 1 * 64 * 4) / prof.intra_bw)


def test_a_block_crosses_into_a_node_once():
    """Two nodes of two devices, ulysses: each node's two devices both need
    the other node's tokens, but each block crosses into the node once; the
    node's receive term is those bytes at the inter-node bandwidth plus its
    in-node bytes at the in-node one, over its two queues."""
    prof = dataclasses.replace(get_profile("h100"), name="slow", inter_bw=1e9)
    plan = attnplan.compile([4096], devices=4, nodes=2, heads=4, kv_heads=4, head_dim=64, block_size=512,
                            strategy="ulysses")
    f = placement_floor(plan.ir, prof)
    q, kv = 1 * 64 * 2, 2 * 1 * 64 * 2  # per token and head group (one kv head, one query head)
    # node 0 needs, for its 2 head groups, Q and KV of the 2048 tokens node 1 homes: they cross once each
    cross = 2048 * 2 * (q + kv)
    inside = 1024 * 2 * (q + kv)  # and each device the other device's 1024 tokens for its own head group
    assert f["fwd"]["recv"] == pytest.approx((cross / prof.inter_bw + inside / prof.intra_bw) / 2)


def test_explain_names_the_floor():
    plan = attnplan.compile([6000, 900, 300], devices=4, nodes=2, heads=8, kv_heads=2, head_dim=64, block_size=512,
                            strategy="per_doc")
    text = explain(plan)
    f = placement_floor(plan.ir, "h100")  # the plan's profile
    line = next(x for x in text.splitlines() if "placement floor" in x)
    assert f"{f['floor_s'] / plan.stats()['lower_bound_s']:.2f}× the bound" in line
    assert np.isfinite(f["floor_s"]) and f["floor_s"] > 0
