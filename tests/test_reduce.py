"""``comm{reduce=node}``: partial outputs bound for another node are summed
inside their node first and cross once per (block, node) — the routes
against brute force, the program's shape (one crossing per group, merges
into the aggregator's own partial before it is sent), the verifier's
refusals, and execution equal to dense attention on gloo processes."""

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnplan
from attnplan.errors import PlanError, VerifyError
from attnplan.ir.program import ADD, B_DKV, BWD, FWD, OP, PART, SEND, T_DST, T_KIND, T_PHASE, T_SRC, Program
from attnplan.ir.verify import verify
from attnplan.passes.comm import HOP_CROSS, HOP_DIRECT, HOP_GATHER, reduce_rows
from attnplan.tools.launch import run_local

CASES = str(Path(__file__).with_name("_dist_cases.py"))


@st.composite
def partial_rows(draw):
    """Partial rows (kind, tb, hg, computing device, home, stage) of a random placement."""
    nodes = draw(st.integers(1, 4))
    per = draw(st.integers(1, 4))
    n = nodes * per
    rows = []
    for tb in range(draw(st.integers(1, 6))):
        for hg in range(draw(st.integers(1, 2))):
            home = draw(st.integers(0, n - 1))
            for dev in draw(st.sets(st.integers(0, n - 1), max_size=n)):
                if dev != home:
                    rows.append((1, tb, hg, dev, home, 0))
    return np.array(rows, np.int64).reshape(-1, 6), per


@settings(max_examples=200, deadline=None)
@given(partial_rows())
def test_routes_take_every_partial_home_once_crossing_once_per_node(case):
    rows, per = case
    out, hop = reduce_rows(rows, per)
    assert len(out) == len(rows) and out.dtype == np.int64
    node = out[:, 3:5] // per
    home = {(tb, hg): h for _, tb, hg, _, h, _ in rows.tolist()}
    # every computing device sends each of its partials exactly once
    assert sorted(map(tuple, out[:, [1, 2, 3]].tolist())) == sorted(map(tuple, rows[:, [1, 2, 3]].tolist()))
    sums = {}
    for (_, tb, hg, src, dst, _), h in zip(out.tolist(), hop.tolist()):
        if h == HOP_GATHER:
            assert src // per == dst // per != home[tb, hg] // per  # gathered inside a remote node
        else:
            assert dst == home[tb, hg]
        if h == HOP_CROSS:
            assert (tb, hg, src // per) not in sums
            sums[tb, hg, src // per] = src
    for (_, tb, hg, src, dst, _), h in zip(out.tolist(), hop.tolist()):
        if h == HOP_GATHER:  # to the device that sends the node's sum home, never to itself
            assert sums[tb, hg, src // per] == dst != src
    # brute force: a (block, remote node) group of two or more sources crosses once; everything else goes direct
    groups: dict = {}
    for _, tb, hg, src, h, _ in rows.tolist():
        groups.setdefault((tb, hg, src // per, src // per == h // per), []).append(src)
    want_cross = sorted((tb, hg, nd) for (tb, hg, nd, local), devs in groups.items() if not local and len(devs) > 1)
    assert sorted(sums) == want_cross
    direct = sum(len(d) for (tb, hg, nd, local), d in groups.items() if local or len(d) == 1)
    assert int((hop == HOP_DIRECT).sum()) == direct
    assert int((node[:, 0] != node[:, 1]).sum()) == len(want_cross) + sum(
        len(d) for (tb, hg, nd, local), d in groups.items() if not local and len(d) == 1)


def test_reduce_rows_takes_one_kind():
    with pytest.raises(PlanError, match="one kind"):
        reduce_rows(np.array([[1, 0, 0, 1, 0, 0], [2, 0, 0, 2, 0, 0]]), 2)
    out, hop = reduce_rows(np.zeros((0, 6), np.int64), 2)
    assert out.shape == (0, 6) and hop.shape == (0,)


def _plan(pipeline, lens=(40, 24, 9), devices=4, nodes=2, **kw):
    return attnplan.compile(seqlens=list(lens), mask="causal", devices=devices, nodes=nodes, heads=4, kv_heads=2,
                            head_dim=8, pipeline=f"tile{{block=4}},{pipeline},emit", **kw)


def _inter(prog: Program, phase: int, per: int) -> int:
    X = prog.transfers
    x = X[(X[:, T_PHASE] == phase) & (X[:, T_KIND] >= 2)]
    return int((x[:, T_SRC] // per != x[:, T_DST] // per).sum())


@pytest.mark.parametrize("strategy", ["per_doc", "zigzag", "tile_pool", "span{min_chunk=1}"])
def test_partials_cross_once_per_block_and_node(strategy):
    base = _plan(f"{strategy},comm{{mode=p2p,relay=node}},overlap")
    red = _plan(f"{strategy},comm{{mode=p2p,relay=node,reduce=node}},overlap")
    assert red.ir.schedule.reduce and not base.ir.schedule.reduce
    assert "reduce=node" in red.meta["pipeline"] and "reduce" not in base.meta["pipeline"]
    for phase in (FWD, BWD):
        assert _inter(red.ir.program, phase, 2) <= _inter(base.ir.program, phase, 2)
    X = red.ir.program.transfers
    dkv = X[(X[:, T_PHASE] == BWD) & (X[:, T_KIND] == B_DKV)]
    crossing = dkv[dkv[:, T_SRC] // 2 != dkv[:, T_DST] // 2]
    # at most one crossing per (block, head group, source node)
    keys = set(map(tuple, np.column_stack([crossing[:, 3], crossing[:, 4], crossing[:, T_SRC] // 2]).tolist()))
    assert len(keys) == len(crossing)
    # the same attention: pairs, and the same compute blocks on the same devices
    assert red.stats()["pairs"] == base.stats()["pairs"]
    assert np.array_equal(red.ir.placement.cb_device, base.ir.placement.cb_device)


def test_aggregator_merges_into_its_partial_before_sending_it():
    plan = _plan("per_doc,comm{mode=p2p,relay=node,reduce=node},overlap")
    prog = plan.ir.program
    merged_parts = 0
    for d in range(prog.devices):
        code, bufs = prog.code[BWD][d], prog.buffers[BWD][d]
        adds = np.flatnonzero(code[:, OP] == ADD)
        into_part = [i for i in adds if bufs[code[i, 1], 3] == PART]
        merged_parts += len(into_part)
        for i in into_part:  # the partial is sent after the add, never before
            sends = np.flatnonzero(code[:, OP] == SEND)
            carried = [s for s in sends if code[i, 1] in _packed(prog, int(code[s, 1]), d)]
            assert carried and min(carried) > i
    assert merged_parts > 0


def _packed(prog: Program, msg: int, dev: int) -> set:
    m = prog.messages[msg]
    return {int(b) for b in prog.transfers[m[4]:m[5], 8]} if int(m[2]) == dev else set()


def _swap_first_reduce_send(prog: Program) -> Program:
    """The aggregator's sum sent before the add that completes it (the add moved after its send)."""
    code = [[c.copy() for c in ph] for ph in prog.code]
    for d, c in enumerate(code[BWD]):
        bufs = prog.buffers[BWD][d]
        for i in np.flatnonzero(c[:, OP] == ADD):
            if bufs[c[i, 1], 3] != PART:
                continue
            s = next(s for s in np.flatnonzero(c[:, OP] == SEND) if c[i, 1] in _packed(prog, int(c[s, 1]), d))
            rows = list(c)
            add = rows.pop(i)
            rows.insert(s, add)  # the send moved up one place: the add now follows it
            code[BWD][d] = np.array(rows, np.int64)
            return Program(prog.devices, prog.transfers, prog.buffers,
                           tuple(tuple(ph) for ph in code), prog.messages)
    raise AssertionError("no add into a partial")


def test_verifier_refuses_a_sum_sent_before_it_is_complete():
    plan = _plan("per_doc,comm{mode=p2p,relay=node,reduce=node},overlap")
    bad = plan.ir.replace(program=_swap_first_reduce_send(plan.ir.program))
    with pytest.raises(VerifyError, match="written after it was sent"):
        verify(bad)


def test_verifier_refuses_a_merge_into_a_partial_never_computed():
    plan = _plan("per_doc,comm{mode=p2p,relay=node,reduce=node},overlap")
    prog = plan.ir.program
    code = [[c.copy() for c in ph] for ph in prog.code]
    bufs = [[b.copy() for b in ph] for ph in prog.buffers]
    for d, c in enumerate(code[BWD]):
        b = bufs[BWD][d]
        hit = [i for i in np.flatnonzero(c[:, OP] == ADD) if b[c[i, 1], 3] == PART]
        if hit:
            i = hit[0]
            new = b[c[i, 1]].copy()  # a fresh partial buffer of the same block that no compute wrote
            bufs[BWD][d] = np.vstack([b, new])
            c[i, 1] = len(b)
            break
    prog2 = Program(prog.devices, prog.transfers, tuple(tuple(ph) for ph in bufs), tuple(tuple(ph) for ph in code),
                    prog.messages)
    with pytest.raises(VerifyError, match="before this device computed any of it|sent 0 times"):
        verify(plan.ir.replace(program=prog2))


def test_reduce_needs_p2p_and_is_not_an_all_to_all():
    with pytest.raises(PlanError, match="reduce=node needs mode=p2p"):
        _plan("per_doc,comm{mode=ring,reduce=node}")
    with pytest.raises(PlanError, match="reduce must be none or node"):
        _plan("per_doc,comm{mode=p2p,reduce=yes}")
    one = _plan("per_doc,comm{mode=p2p,reduce=node}", nodes=1)
    assert not one.ir.schedule.reduce  # on one node there is nothing to sum before crossing


def test_plan_file_round_trips_the_reduce_flag():
    plan = _plan("per_doc,comm{mode=p2p,relay=node,reduce=node},overlap")
    back = attnplan.Plan.from_bytes(plan.to_bytes())
    assert back.ir.schedule.reduce and back.to_bytes() == plan.to_bytes()


def test_the_default_reduces_and_predicts_less_than_relays_alone():
    kw = dict(seqlens=[4096, 3000, 1000], devices=16, nodes=2, heads=8, kv_heads=2, head_dim=64)
    plan, relay = attnplan.compile(strategy="per_doc", **kw), attnplan.compile(strategy="per_doc:relay", **kw)
    assert plan.ir.schedule.reduce and not relay.ir.schedule.reduce
    assert "reduce=node" in plan.meta["pipeline"]
    s, b = plan.stats(), relay.stats()
    assert s["comm_bytes_inter"] < b["comm_bytes_inter"] and s["predicted_bwd_s"] < b["predicted_bwd_s"]


@pytest.mark.slow
def test_reduce_runs_on_processes_matched_by_order():
    """Four gloo processes as two nodes of two: the node reduce's programs
    (gathers, adds into partials, sums across) equal the in-process executor
    bit for bit, messages matched by posting order alone (as NCCL)."""
    pipes = ["tile{block={block}},per_doc,comm{mode=p2p,relay=node,reduce=node},overlap,emit",
             "tile{block={block}},tile_pool,comm{mode=p2p,reduce=node},emit"]
    res = run_local(f"{CASES}:equals_in_process", 4, ([0, 1], pipes, "order", {"nodes": 2}), timeout=240)
    for r, out in enumerate(res):
        assert out[0] == "ok", f"rank {r}: {out}"
    assert all(out[1]["ran"] == 4 for out in res)
    assert [b for out in res for b in out[1]["bad"]] == []
