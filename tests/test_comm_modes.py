"""The ``usp`` strategy (Ulysses inside a group × zigzag ring across groups),
``comm{mode=allgather}`` and ``comm{relay=node}``: their layouts and
traffic, checked against their definitions; execution equal to dense
attention is in test_execute.py (every strategy and comm mode)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attnplan
from attnplan.ir.schedule import X_KV, XDST, XHG, XK, XSRC, XTB
from attnplan.passes.usp import default_degree, usp_segments

SHAPE = dict(heads=8, kv_heads=4, head_dim=8)


def _compile(lens, devices, nodes=1, **kw):
    return attnplan.compile(seqlens=lens, devices=devices, nodes=nodes, block_size=16, **SHAPE, **kw)


@given(st.integers(1, 5000), st.integers(1, 8), st.sampled_from([1, 2, 4]))
def test_segments_split_each_zigzag_chunk_over_its_group(tokens, ranks, degree):
    starts, devices = usp_segments(tokens, ranks, degree)
    n = ranks * degree
    assert len(starts) == 2 * n and starts[0] == 0 and np.all(np.diff(starts) >= 0)
    sizes = np.diff(np.append(starts, tokens))
    held = np.bincount(devices, weights=sizes, minlength=n)
    assert held.sum() == tokens and held.max() - held.min() <= 4  # T / N each, up to rounding
    # the group of rank r (devices r*U .. r*U+U-1) holds exactly zigzag's chunks r and 2R-1-r
    zz = attnplan.passes.zigzag.chunk_bounds(tokens, 2 * ranks)
    for r in range(ranks):
        mine = np.isin(devices, np.arange(r * degree, (r + 1) * degree))
        want = (zz[r + 1] - zz[r]) + (zz[2 * ranks - r] - zz[2 * ranks - 1 - r])
        assert sizes[mine].sum() == want


@pytest.mark.parametrize("devices,nodes,kv,want", [(8, 1, 4, 4), (16, 2, 8, 8), (32, 4, 8, 8), (12, 3, 8, 4),
                                                   (6, 1, 4, 2), (5, 1, 4, 1)])
def test_default_degree_is_the_largest_group_inside_a_node(devices, nodes, kv, want):
    assert default_degree(devices, devices // nodes, kv) == want


def test_compute_runs_on_the_head_group_device_of_q_s_rank():
    lens = [700, 300, 120, 90, 33]
    plan = _compile(lens, 8, nodes=2, strategy="usp")
    g, pl = plan.ir.graph, plan.ir.placement
    u = 4
    assert g.n_hg == u
    assert np.array_equal(pl.cb_device, (pl.home[g.cb_q] // u) * u + g.cb_hg)
    tokens = np.bincount(pl.home, weights=g.tb_len, minlength=8)
    assert tokens.max() - tokens.min() <= 4 * 2


def test_degree_one_is_zigzag_and_degree_n_is_ulysses_compute():
    lens = [500, 260, 77, 20]
    zz = _compile(lens, 4, pipeline="tile{block=16},zigzag,comm{mode=p2p},emit")
    u1 = _compile(lens, 4, pipeline="tile{block=16},usp{ulysses=1},comm{mode=p2p},emit")
    assert np.array_equal(zz.ir.placement.home, u1.ir.placement.home)
    assert np.array_equal(zz.ir.placement.cb_device, u1.ir.placement.cb_device)
    assert zz.stats()["pairs"] == u1.stats()["pairs"]
    un = _compile(lens, 4, pipeline="tile{block=16},usp{ulysses=4},comm,emit")
    per = un.stats()["per_device"]["pairs"]
    assert max(per) == min(per)  # every device one head group of every query: exact balance, as Ulysses


def test_bad_degree_is_one_clear_error():
    with pytest.raises(attnplan.PlanError, match="usp: ulysses=3 is not supported"):
        _compile([100], 4, pipeline="tile{block=16},usp{ulysses=3},comm,emit")


def test_usp_sends_less_than_the_ring_across_groups():
    lens = [4000, 2000, 900, 300, 100]
    ring = _compile(lens, 16, nodes=2, strategy="zigzag").stats()
    usp = _compile(lens, 16, nodes=2, strategy="usp").stats()
    assert usp["comm_bytes_total"] < ring["comm_bytes_total"]


def test_allgather_sends_every_kv_block_to_every_other_device_once():
    lens = [300, 200, 77, 20]
    for strategy in ("zigzag", "minheap", "usp"):
        plan = _compile(lens, 4, pipeline=f"tile{{block=16}},{strategy},comm{{mode=allgather}},emit")
        g, pl, x = plan.ir.graph, plan.ir.placement, plan.ir.schedule.xfer
        kv = x[x[:, XK] == X_KV]
        assert plan.ir.schedule.stages == 1
        assert np.all(kv[:, XSRC] == pl.home[kv[:, XTB]])  # straight from home, no forwarding
        got = {(t, h, d) for t, h, d in kv[:, [XTB, XHG, XDST]].tolist()}
        want = {(t, h, d) for t in range(g.n_tb) for h in range(g.n_hg) for d in range(4) if d != pl.home[t]}
        assert len(kv) == len(got) and got == want
        # coalesced: one forward KV message per ordered pair of devices that moves KV
        st_ = plan.stats()
        assert st_["messages_fwd"] >= 4 * 3


def test_allgather_ring_is_nccls_ring_then_compute():
    """``allgather_ring``: the KV traffic of ``mode=ring`` (N-1 hops, each to
    the next device), every compute block in the last stage; the same bytes
    as the direct all-gather."""
    lens = [300, 200, 77, 20]
    for strategy in ("zigzag", "minheap"):
        pipe = "tile{block=16},%s,comm{mode=%s},emit"
        ag = _compile(lens, 4, 2, pipeline=pipe % (strategy, "allgather_ring"))
        ring = _compile(lens, 4, 2, pipeline=pipe % (strategy, "ring"))
        direct = _compile(lens, 4, 2, pipeline=pipe % (strategy, "allgather"))
        s = ag.ir.schedule
        assert s.stages == 4 and np.all(s.cb_stage == 3)
        kv = s.xfer[s.xfer[:, XK] == X_KV]
        rkv = ring.ir.schedule.xfer[ring.ir.schedule.xfer[:, XK] == X_KV]
        assert np.array_equal(kv, rkv)
        assert np.all(kv[:, XDST] == (kv[:, XSRC] + 1) % 4)
        assert ag.stats()["comm_bytes_total"] == direct.stats()["comm_bytes_total"]


def test_comm_mode_error_names_the_modes():
    with pytest.raises(attnplan.PlanError, match="p2p, ring, allgather, allgather_ring or a2a"):
        _compile([100], 2, pipeline="tile{block=16},zigzag,comm{mode=alltoall},emit")


@given(st.lists(st.integers(1, 900), min_size=1, max_size=8), st.sampled_from(["zigzag", "minheap", "per_doc"]),
       st.sampled_from([(4, 2), (8, 2), (8, 4), (6, 3)]))
def test_relay_crosses_each_remote_node_once_per_block(lens, strategy, mesh):
    devices, nodes = mesh
    pipe = "tile{block=64},%s,comm{mode=p2p%s},emit"
    plain = _compile(lens, devices, nodes, pipeline=pipe % (strategy, ",relay=none"))
    relay = _compile(lens, devices, nodes, pipeline=pipe % (strategy, ",relay=node"))
    per = devices // nodes
    x = relay.ir.schedule.xfer
    inputs = x[x[:, XK] != 2]  # Q and KV (partial outputs go straight home)
    inter = inputs[(inputs[:, XSRC] // per) != (inputs[:, XDST] // per)]
    key = np.stack([inter[:, XK], inter[:, XTB], inter[:, XHG], inter[:, XDST] // per], 1)
    assert len(np.unique(key, axis=0)) == len(key)  # one crossing per (block, remote node)
    # relays forward only inside their node, and every device gets what it got without relays
    fwd = inputs[inputs[:, 5] == 1]
    assert np.all(fwd[:, XSRC] // per == fwd[:, XDST] // per)
    px = plain.ir.schedule.xfer
    got = {tuple(r) for r in inputs[:, [XK, XTB, XHG, XDST]].tolist()}
    want = {tuple(r) for r in px[px[:, XK] != 2][:, [XK, XTB, XHG, XDST]].tolist()}
    assert got == want
    a, b = plain.stats(), relay.stats()
    assert b["comm_bytes_inter"] <= a["comm_bytes_inter"] and b["comm_bytes_total"] == a["comm_bytes_total"]


def test_relay_is_the_p2p_default_and_spreads_over_the_nodes_links():
    """Default pipelines relay p2p traffic across nodes and keep ring as it is
    (an explicit ``comm{mode=p2p}`` does not relay);
    the block that crosses goes to a different device of the remote node
    block by block, so a node's inbound inter-node bytes are spread over its
    devices (always the lowest device put them all on one link)."""
    lens = [200] * 8
    plan = _compile(lens, 8, 2, strategy="per_doc")
    assert "comm{mode=p2p,relay=node,reduce=node}" in plan.meta["pipeline"]
    assert "comm{mode=ring,relay=none}" in _compile(lens, 8, 2, strategy="zigzag").meta["pipeline"]
    explicit = _compile(lens, 8, 2, pipeline="tile{block=16},per_doc,comm{mode=p2p},emit")
    assert "relay=none" in explicit.meta["pipeline"] and explicit.ir.schedule.stages == 1
    x = plan.ir.schedule.xfer
    inputs = x[(x[:, XK] != 2) & ((x[:, XSRC] // 4) != (x[:, XDST] // 4))]
    got = np.bincount(inputs[:, XDST], minlength=8)
    assert np.all(got > 0), got  # every device receives a share across nodes
    per_node = got.reshape(2, 4)
    assert np.all(per_node.max(1) <= 1.25 * per_node.mean(1)), got  # spread inside each node
    single = _compile(lens, 4, 1, strategy="per_doc")  # one node: nothing to relay, one stage
    assert single.ir.schedule.stages == 1


@pytest.mark.parametrize("strategy", ["zigzag", "minheap"])
def test_relay_uses_every_device_of_a_node_at_four_nodes(strategy):
    """At 4 nodes of 8 the relay of each (block, node) group rotates over the
    node's devices by a counter per destination node: every device receives
    inter-node data and the busiest gets at most 1.5x the mean (a counter
    over all groups let only 2 of 8 devices relay: 4.2x)."""
    pipe = f"tile{{block=64}},{strategy},comm{{mode=p2p,relay=node}},emit"
    plan = attnplan.compile(seqlens=[4096, 4096], devices=32, nodes=4, heads=8, pipeline=pipe)
    x = plan.ir.schedule.xfer
    inter = x[(x[:, XK] != 2) & (x[:, XSRC] // 8 != x[:, XDST] // 8)]
    got = np.bincount(inter[:, XDST], minlength=32)
    assert np.all(got > 0), got
    assert got.max() <= 1.5 * got.mean(), got


@pytest.mark.parametrize("strategy", ["ulysses", "minheap", "hypergraph"])
def test_a2a_moves_what_p2p_moves_in_one_blocking_exchange(strategy):
    """``comm{mode=a2a}``: the blocks of p2p without relays, one stage, no
    overlap even after the overlap pass (an all-to-all blocks), so every
    device posts all its data messages before its first wait; same bytes
    and messages as p2p."""
    from attnplan.ir.program import A1, B_KV, FWD, M_PHASE, M_START, OP, RECV, SEND, T_KIND, WAIT
    kw = dict(seqlens=[300, 120, 40], devices=4, nodes=2, heads=8, kv_heads=4, head_dim=8)
    a2a = attnplan.compile(pipeline=f"tile{{block=32}},{strategy},comm{{mode=a2a}},overlap,emit", **kw)
    p2p = attnplan.compile(pipeline=f"tile{{block=32}},{strategy},comm{{mode=p2p,relay=none}},overlap,emit", **kw)
    s = a2a.ir.schedule
    assert s.collective and s.stages == 1 and not s.overlap
    key = lambda x: sorted(map(tuple, x[:, :5].tolist()))  # noqa: E731
    assert key(s.xfer) == key(p2p.ir.schedule.xfer)
    a, b = a2a.stats(), p2p.stats()
    assert a["comm_bytes_total"] == b["comm_bytes_total"] and a["messages"] == b["messages"]
    prog = a2a.ir.program
    m = prog.messages[prog.messages[:, M_PHASE] == FWD]
    data = set(m[prog.transfers[m[:, M_START], T_KIND] <= B_KV][:, 0].tolist())
    assert data
    for d in range(4):
        c = prog.code[FWD][d]
        posts = np.flatnonzero(np.isin(c[:, OP], (SEND, RECV)) & np.isin(c[:, A1], list(data)))
        waits = np.flatnonzero(c[:, OP] == WAIT)
        if len(posts):  # every data post of this device before its first wait
            assert posts.max() < waits.min()


def test_relay_needs_p2p():
    with pytest.raises(attnplan.PlanError, match="relay=node needs mode=p2p"):
        _compile([100], 4, 2, pipeline="tile{block=16},zigzag,comm{mode=ring,relay=node},emit")


def test_the_collective_transport_refuses_a_message_not_of_its_phase():
    """A program not shaped for a2a (a message of the other phase, or of
    other devices, waited for): one PlanError, not a KeyError."""
    from attnplan.errors import PlanError
    from attnplan.ir.program import BWD, FWD, M_DST, M_ID, M_PHASE, M_SRC
    from attnplan.runtime.collective import CollectiveTransport
    plan = attnplan.compile(seqlens=[60, 20], devices=4, heads=4, kv_heads=4, head_dim=8, block_size=16,
                            pipeline="tile{block=16},ulysses,comm{mode=a2a},emit")
    prog = plan.ir.program
    m = prog.messages
    t = CollectiveTransport(prog, FWD, 0, None, 1.0)
    other_phase = int(m[m[:, M_PHASE] == BWD][0, M_ID])
    not_mine = m[(m[:, M_PHASE] == FWD) & (m[:, M_SRC] != 0) & (m[:, M_DST] != 0)]
    for tag in [other_phase, 10 ** 6] + ([int(not_mine[0, M_ID])] if len(not_mine) else []):
        with pytest.raises(PlanError, match="not one of this device's messages"):
            t.wait(tag)


def test_compile_takes_a_strategy_under_another_comm_step():
    """``strategy="NAME:VARIANT"``: the default pipeline with the variant's
    comm step, the entry kept as the plan's strategy; bad variants are one error."""
    from attnplan.api import default_pipeline
    from attnplan.errors import PlanError
    kw = dict(seqlens=[300, 120, 40], devices=4, nodes=2, block_size=32, **SHAPE)
    a = attnplan.compile(strategy="per_doc:direct", **kw)
    b = attnplan.compile(pipeline=default_pipeline("per_doc", 32, "mode=p2p,relay=none"), **kw)
    assert a.meta["strategy"] == "per_doc:direct" and a.meta["pipeline"] == b.meta["pipeline"]
    assert a.ir.program == b.ir.program and a.ir.schedule.stages == 1
    assert attnplan.compile(strategy="per_doc", **kw).ir.schedule.stages == 2  # the default relays
    for bad, msg in (("per_doc:nope", "unknown communication variant 'nope'"), ("nope:ring", "unknown strategy")):
        with pytest.raises(PlanError, match=msg):
            attnplan.compile(strategy=bad, **kw)
