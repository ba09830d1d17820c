"""Kernel runs and late forwards (passes/emit.py): a device's blocks for its
remote partners share a fused kernel run until the remote work before a
partner's blocks reaches another multiple of ``overlap{run=F}`` (the waits
come before the run, the partial sends after it), and a relay forwards
after its own blocks, not before them. Execution against dense attention
covers these programs in tests/test_execute.py (its schedules draw ``run``)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import zlib

import attnplan
from attnplan.errors import PlanError, PlanFileError
from attnplan.backends.planfile import _HEADER, pack_body
from attnplan.ir.program import A1, ATTN, ATTN_BWD, B_KV, B_Q, BWD, FWD, OP, SEND, T_DST, T_KIND, T_SRC, T_TB
from attnplan.passes.emit import compute_order, compute_runs

KW = dict(seqlens=[700, 300, 260, 90, 40, 500], devices=8, nodes=2, heads=4, kv_heads=2, head_dim=8, block_size=64)


def _plan(run: float, strategy: str = "per_doc", comm: str = "mode=p2p,relay=node,reduce=node") -> attnplan.Plan:
    return attnplan.compile(pipeline=f"tile{{block=64}},{strategy},comm{{{comm}}},overlap{{run={run}}},emit", **KW)


def _runs_by_rule(ir, order: np.ndarray) -> np.ndarray:
    """compute_runs by its docstring, one block at a time."""
    g, pl, s = ir.graph, ir.placement, ir.schedule
    F = s.run_flops
    out, run, seg, group, bucket, before = [], -1, None, None, 0.0, 0.0
    for b in order.tolist():
        dev, st = int(pl.cb_device[b]), int(s.cb_stage[b])
        q_home, k_home = int(pl.home[g.cb_q[b]]), int(pl.home[g.cb_k[b]])
        remote = q_home != dev or k_home != dev
        this = (remote, (k_home if k_home != dev else q_home) if remote else -1)
        if (dev, st) != seg:  # a device's stage starts a run
            seg, group, before, run = (dev, st), this, 0.0, run + 1
            bucket = 0.0
        elif this != group:  # another partner: a new run unless its remote work is in the same multiple of F
            b_now = np.floor(before / F) if F > 0 else None
            if not (F > 0 and remote and group[0] and b_now == bucket):
                run += 1
            group, bucket = this, b_now
        out.append(run)
        before += float(g.cb_flops()[b]) if remote else 0.0
    return np.array(out, np.int64)


@pytest.mark.parametrize("run", [0.0, 1e6, 3e6, 1e30])
@pytest.mark.parametrize("strategy", ["per_doc", "hypergraph", "minheap"])
def test_compute_runs_follow_their_rule(run, strategy):
    ir = _plan(run, strategy).ir
    order = compute_order(ir.graph, ir.placement, ir.schedule)
    got = compute_runs(ir.graph, ir.placement, ir.schedule, order)
    assert got.tolist() == _runs_by_rule(ir, order).tolist()


def test_a_larger_run_only_joins_runs():
    ir0, ir1, ir2 = (_plan(r).ir for r in (0.0, 1e6, 1e30))
    order = compute_order(ir0.graph, ir0.placement, ir0.schedule)
    cuts = [set(np.flatnonzero(np.diff(compute_runs(ir.graph, ir.placement, ir.schedule, order))).tolist())
            for ir in (ir0, ir1, ir2)]
    assert cuts[2] < cuts[1] < cuts[0]  # every run of a larger threshold is a union of runs of a smaller one
    dev, st = ir2.placement.cb_device[order], ir2.schedule.cb_stage[order]
    per_segment = np.unique(compute_runs(ir2.graph, ir2.placement, ir2.schedule, order)).size
    assert per_segment <= 2 * np.unique(dev * 8 + st).size  # own blocks, then every remote block: two runs at most


@pytest.mark.parametrize("run", [0.0, 1e6, 1e30])
def test_a_run_is_one_stretch_of_compute_in_the_program(run):
    """Nothing between two blocks of one run: their waits come before it,
    their partial sends after it (one fused kernel call covers it)."""
    ir = _plan(run).ir
    g, pl, s = ir.graph, ir.placement, ir.schedule
    order = compute_order(g, pl, s)
    runs = compute_runs(g, pl, s, order)
    run_of = np.empty(g.n_cb, np.int64)
    run_of[order] = runs
    for phase, op in ((FWD, ATTN), (BWD, ATTN_BWD)):
        for code in ir.program.code[phase]:
            at = np.flatnonzero(code[:, OP] == op)
            r = run_of[code[at, A1]]
            same = r[1:] == r[:-1]
            assert (np.diff(at)[same] == 1).all()


def test_a_relay_forwards_after_its_own_blocks():
    """With overlap a device forwards what it relays after the blocks that
    need nothing remote, not before them (it would wait for the inbound
    message with its own work undone)."""
    ir = _plan(3e10).ir
    g, pl, X = ir.graph, ir.placement, ir.program.transfers
    seen = 0
    for phase, op in ((FWD, ATTN), (BWD, ATTN_BWD)):
        for d, code in enumerate(ir.program.code[phase]):
            own = [i for i in np.flatnonzero(code[:, OP] == op).tolist()
                   if pl.home[g.cb_q[code[i, A1]]] == d and pl.home[g.cb_k[code[i, A1]]] == d]
            M = ir.program.messages
            for i in np.flatnonzero(code[:, OP] == SEND).tolist():
                rows = X[M[code[i, A1], 4]:M[code[i, A1], 5]]
                forwards = (rows[:, T_SRC] == d) & (pl.home[rows[:, T_TB]] != d) & (rows[:, T_DST] != d)
                if forwards.any() and own and rows[0, T_KIND] in (B_Q, B_KV):  # data (Q, KV) relayed by this device
                    assert i > max(own), (phase, d, i, own)
                    seen += 1
    assert seen  # the batch has relays


def test_overlap_run_is_checked_and_round_trips():
    with pytest.raises(PlanError, match=r"overlap: run must be FLOPs in \[0, 1e30\]"):
        _plan(-1)
    plan = _plan(3e5)
    assert plan.ir.schedule.run_flops == 3e5 and "run=300000" in plan.ir.schedule.to_text()
    back = attnplan.Plan.from_bytes(plan.to_bytes())
    assert back.ir.schedule.run_flops == 3e5 and back.to_bytes() == plan.to_bytes()
    assert attnplan.compile(strategy="per_doc", **KW).ir.schedule.run_flops == 3e10  # the default


@pytest.mark.parametrize("value,message", [(-1.0, r"schedule.run must be FLOPs in \[0, 1e30\], got -1.0"),
                                           ("x", "schedule.run must be a number, got str"),
                                           (float("nan"), r"schedule.run must be FLOPs in \[0, 1e30\], got nan")])
def test_a_crafted_run_in_a_plan_file_is_refused(value, message):
    data = _plan(3e5).to_bytes()
    body = msgpack.unpackb(zlib.decompress(data[_HEADER.size:]), raw=False)
    body["schedule"]["run"] = value
    with pytest.raises(PlanFileError, match=message):
        attnplan.Plan.from_bytes(pack_body(body), "t.plan")
