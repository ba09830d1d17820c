"""``comm{relay=tree}``: node relays across nodes, then recursive doubling
inside each node (:func:`attnplan.passes.comm.tree_rows`). Its routes
against their definition and brute force; execution equal to dense
attention and the schedule bound below the simulation are drawn with the
other comm modes in test_execute.py and test_auto_schedule.py."""

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attnplan
from attnplan.backends.cost import get_profile, simulate
from attnplan.ir.program import FWD, M_DST, M_PHASE, M_SRC
from attnplan.ir.schedule import X_KV, XDST, XHG, XK, XSRC, XSTAGE, XTB
from attnplan.passes.comm import relay_rows, tree_rows
from attnplan.tools import auto

SHAPE = dict(heads=8, kv_heads=2, head_dim=16)


@st.composite
def needs(draw):
    """Needed KV rows (tb, hg, home, dst) on ``nodes`` nodes of ``per`` devices, one home per block."""
    per, nodes = draw(st.sampled_from([(2, 1), (3, 2), (4, 1), (5, 2), (8, 1), (8, 4), (6, 2)]))
    n = per * nodes
    blocks = draw(st.integers(1, 12))
    home = [draw(st.integers(0, n - 1)) for _ in range(blocks)]
    rows = set()
    for tb in range(blocks):
        for d in draw(st.sets(st.integers(0, n - 1), max_size=n)):
            if d != home[tb]:
                rows.add((tb, draw(st.integers(0, 1)), home[tb], d))
    need = np.array(sorted(rows), np.int64).reshape(-1, 4)
    return need, per


def holds_before(rows: np.ndarray, home: dict) -> None:
    """Every row's source is the block's home or received it in an earlier stage; one arrival per destination."""
    arrive: dict = {}
    for k, tb, hg, _, d, s in rows.tolist():
        assert (k, tb, hg, d) not in arrive, "a block arrives twice"
        arrive[(k, tb, hg, d)] = s
    for k, tb, hg, src, _, s in rows.tolist():
        if src != home[tb]:
            assert arrive.get((k, tb, hg, src), math.inf) < s, (tb, src, s)


@given(needs())
def test_tree_delivers_every_needed_block_once_through_holders(case):
    need, per = case
    home = {tb: h for tb, _, h, _ in need.tolist()}
    relayed = relay_rows(X_KV, need, per)[0]
    rows = tree_rows(relayed, per)
    holds_before(rows, home)
    got = {(tb, hg, d) for _, tb, hg, _, d, _ in rows.tolist()}
    assert {(tb, hg, d) for tb, hg, _, d in need.tolist()} <= got
    # across nodes nothing changes: the relays' crossings are the tree's
    cross = lambda r: sorted(map(tuple, r[r[:, XSRC] // per != r[:, XDST] // per].tolist()))  # noqa: E731
    assert cross(rows) == cross(relayed)
    # an in-node hop goes to the partner that differs in one bit of the position among the members
    inside = rows[rows[:, XSRC] // per == rows[:, XDST] // per]
    assert np.all(inside[:, XSTAGE] >= 0)


@given(needs())
def test_in_a_stage_a_device_sends_to_one_partner_per_entry_stage(case):
    """Recursive doubling (a power of two members) or Bruck (any other
    count): per stage, a device's in-node sends go to at most one partner
    for the blocks that entered the node in each stage (homes in stage 0,
    relays in stage 1), and it receives in-node messages from at most
    ceil(log2(devices per node)) partners per entry stage."""
    need, per = case
    rows = tree_rows(relay_rows(X_KV, need, per)[0], per)
    inside = rows[rows[:, XSRC] // per == rows[:, XDST] // per]
    partners: dict = {}
    for _, _, _, s, d, st_ in inside.tolist():
        partners.setdefault((s, st_), set()).add(d)
    assert all(len(v) <= 2 for v in partners.values()), partners  # one per entry stage (two entry stages)
    senders: dict = {}
    for _, _, _, s, d, st_ in inside.tolist():
        senders.setdefault(d, set()).add((s, st_))
    bound = 2 * max(1, math.ceil(math.log2(per)))
    assert all(len(v) <= bound for v in senders.values()), senders


def test_a_document_over_a_node_receives_log2_messages_not_one_per_peer():
    """One causal document on a whole node (span on 8 devices): under node
    relays every device receives a message from each of its 7 peers; under
    the tree at most 3, and the plan is still verified and equal in its
    pairs."""
    kw = dict(seqlens=[16384], devices=8, nodes=1, block_size=512, heads=8, kv_heads=2, head_dim=64)
    pipe = "tile{block=512},span{grain=1},comm{mode=p2p,relay=%s},overlap,emit"
    direct = attnplan.compile(pipeline=pipe % "node", **kw)
    tree = attnplan.compile(pipeline=pipe % "tree", **kw)

    def senders(plan):
        m = plan.ir.program.messages
        m = m[m[:, M_PHASE] == FWD]
        return [len(set(m[m[:, M_DST] == d][:, M_SRC].tolist())) for d in range(8)]
    assert max(senders(direct)) == 7
    assert max(senders(tree)) <= 3
    assert tree.ir.schedule.stages == 3
    assert tree.stats()["pairs"] == direct.stats()["pairs"]


def test_tree_is_an_auto_candidate_where_it_forwards_and_its_estimate_is_a_bound():
    """On a document that spans two nodes the tree forwards more than the
    relays (``spread``), so auto tries ``name:tree``; its estimate is that of
    its own routes and below its simulation; one node or nothing to spread:
    not a candidate."""
    kw = dict(seqlens=[24000, 3000, 2000], devices=16, nodes=2, block_size=1024, **SHAPE)
    prof = get_profile("h100")
    plan = attnplan.compile(strategy="span{grain=1}", **kw)
    est = auto.estimate(plan.ir, prof)
    assert est.spread > 0
    assert ("tree", "mode=p2p,relay=tree,reduce=node") in auto.comm_variants("span", est)
    assert "tree" not in [v for v, _ in auto.comm_variants("span", dataclasses.replace(est, spread=0))]
    tree = attnplan.compile(strategy="span{grain=1}:tree", **kw)
    assert "relay=tree" in tree.meta["pipeline"]
    bound = auto.candidate_estimate(tree.ir, "span{grain=1}:tree", prof)
    assert bound != auto.candidate_estimate(tree.ir, "span{grain=1}", prof)
    assert bound <= simulate(tree.ir, prof)["predicted_s"] * (1 + 1e-9)
    m = attnplan.compile(strategy="auto", **kw).meta
    assert any(k.endswith(":tree") for k in set(m["candidates"]) | set(m["pruned"]))
    one = attnplan.compile(strategy="span{grain=1}", **dict(kw, nodes=1))
    assert auto.estimate(one.ir, prof).spread == 0


def test_tree_cuts_the_forward_of_a_document_across_nodes():
    """A long document over two nodes of 8 (h100, 8/2 heads x 128): the
    tree's forward is faster than the relays' (fewer latencies on the
    receive queues), with the same inter-node bytes."""
    kw = dict(seqlens=[30000] + [600] * 20, devices=16, nodes=2, block_size=2048, heads=8, kv_heads=2,
              head_dim=128)
    relay = attnplan.compile(strategy="span", **kw)
    tree = attnplan.compile(strategy="span:tree", **kw)
    a, b = simulate(relay.ir, relay.profile), simulate(tree.ir, tree.profile)
    assert b["fwd"]["makespan_s"] < 0.9 * a["fwd"]["makespan_s"]
    assert tree.stats()["comm_bytes_inter"] == relay.stats()["comm_bytes_inter"]


def test_relay_tree_needs_p2p():
    import pytest
    with pytest.raises(attnplan.PlanError, match="relay=tree needs mode=p2p"):
        attnplan.compile(seqlens=[100], devices=2, pipeline="tile{block=16},zigzag,comm{mode=ring,relay=tree},emit")


def test_hops_carry_blocks_of_one_kind_and_block_columns_unchanged():
    need = np.array([[0, 0, 0, d] for d in range(1, 8)], np.int64)
    rows = tree_rows(relay_rows(X_KV, need, 8)[0], 8)
    assert set(rows[:, XK].tolist()) == {X_KV} and set(rows[:, XTB].tolist()) == {0}
    assert set(rows[:, XHG].tolist()) == {0}
    # from position 0 to 7 members: bit 0 in stage 0, bit 1 in stage 1, bit 2 in stage 2
    assert sorted(rows[:, [XSRC, XDST, XSTAGE]].tolist()) == [[0, 1, 0], [0, 2, 1], [0, 4, 2], [1, 3, 1],
                                                               [1, 5, 2], [2, 6, 2], [3, 7, 2]]


@pytest.mark.parametrize("members", [3, 5, 6, 7])
def test_members_no_power_of_two_gather_by_bruck(members):
    """Every member's block needed by every other member, on a node of 8 with
    ``members`` taking part: ceil(log2(members)) stages; in stage b member i
    sends to member i - 2^b and receives from member i + 2^b (mod members),
    one message each, every member in every stage (recursive doubling over a
    count that is no power of two left some without a partner)."""
    need = np.array([[tb, 0, tb, d] for tb in range(members) for d in range(members) if d != tb], np.int64)
    rows = tree_rows(relay_rows(X_KV, need, 8)[0], 8)
    holds_before(rows, {tb: tb for tb in range(members)})
    stages = math.ceil(math.log2(members))
    assert sorted({s for s in rows[:, XSTAGE].tolist()}) == list(range(stages))
    pairs = {(s, d, st_) for _, _, _, s, d, st_ in rows.tolist()}
    assert pairs == {(i, (i - (1 << b)) % members, b) for i in range(members) for b in range(stages)}
    got = {(tb, d) for _, tb, _, _, d, _ in rows.tolist()}
    assert {(tb, d) for tb, _, _, d in need.tolist()} <= got


def test_two_spans_in_one_node_are_two_groups():
    """Devices 0-2 exchange one document's blocks, 4-6 another's: each set is a
    group of its own (Bruck over 3), and no block passes through the other
    document's devices."""
    a, b = [0, 1, 2], [4, 5, 6]
    need = np.array([[tb, 0, h, d] for tb, (h, grp) in enumerate([(h, a) for h in a] + [(h, b) for h in b])
                     for d in grp if d != h], np.int64)
    rows = tree_rows(relay_rows(X_KV, need, 8)[0], 8)
    holds_before(rows, {tb: h for tb, _, h, _ in need.tolist()})
    for _, tb, _, s, d, _ in rows.tolist():
        assert (s in a) == (d in a) == (tb < 3), (tb, s, d)
    assert set(rows[:, XSTAGE].tolist()) == {0, 1}  # ceil(log2 3) stages each


def test_a_tree_plan_round_trips_through_its_file_and_runs_equal_to_dense():
    """A tree plan (4 stages of hops across two nodes) saved and loaded is the
    same plan, byte for byte, and executes equal to dense masked attention."""
    import torch

    from attnplan.tools.plan import Plan
    lens = [900, 300, 40]
    plan = attnplan.compile(seqlens=lens, devices=8, nodes=2, block_size=32, strategy="span{grain=0.2,min_chunk=1}:tree",
                            heads=4, kv_heads=2, head_dim=8, dtype="float32")
    assert plan.ir.schedule.stages >= 3
    data = plan.to_bytes()
    again = Plan.from_bytes(data)
    assert again.to_bytes() == data
    gen = torch.Generator().manual_seed(0)
    T = sum(lens)
    q, k, v = (torch.randn(T, n, 8, generator=gen, dtype=torch.float64) for n in (4, 2, 2))
    out = attnplan.execute(again, q, k, v)
    starts = np.cumsum([0] + lens)
    ref = torch.zeros_like(out)
    for a, b in zip(starts[:-1], starts[1:]):
        L = b - a
        kk, vv = (t[a:b].repeat_interleave(2, dim=1) for t in (k, v))
        s = torch.einsum("qhd,khd->hqk", q[a:b], kk) / math.sqrt(8)
        s = s.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
        ref[a:b] = torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)
    assert torch.allclose(out.double(), ref, atol=1e-5)
