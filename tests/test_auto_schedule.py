"""The schedule bound of ``auto`` (tools/auto_schedule.py): a lower bound of
each phase's simulated makespan for every strategy and schedule (p2p with
and without node relays, ring, all-gathers, divide, overlap on and off),
every builtin-like mask, fused and unfused launches; and the one-machine
bound it is built from, against brute force over every order."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

import attnplan
from attnplan.backends.cost import get_profile, link_seconds, simulate
from attnplan.backends.walk import run_starts
from attnplan.ir.program import (A1, B_KV, B_Q, BWD, FWD, M_BYTES, M_DST, M_END, M_PHASE, M_SRC, M_START, OP, T_DST,
                                 T_HG, T_KIND, T_PHASE, T_SRC, T_TB,
                                 buffer_bytes)
from attnplan.ir.schedule import X_Q, XHG, XK, XTB
from attnplan.tools import auto_schedule
from attnplan.tools.auto import estimate
from attnplan.tools.auto_schedule import release_bound, schedule_bound

SHAPE = dict(heads=4, kv_heads=2, head_dim=16)
COMMS = ["mode=p2p,relay=node", "mode=p2p,relay=node,reduce=node", "mode=p2p", "mode=ring", "mode=allgather",
         "mode=allgather_ring", "mode=p2p,relay=tree,reduce=node"]


RUNS = [0.0, 1e6, 1e8, 3e10]  # overlap{run=...}: a run per partner, a few partners a run, every partner one run


def pipeline(name: str, comm: str, overlap: bool, divide: bool, run: float = 3e10, local: str = "kept") -> str:
    """``divide`` after ``comm`` (it splits a p2p schedule's stages; other comm modes refuse it)."""
    steps = ["tile{block=128}", name, f"comm{{{comm}}}"] + (["divide{stages=3}"] if divide else [])
    return ",".join(steps + ([f"overlap{{run={run},local={local}}}"] if overlap else []) + ["emit"])


@settings(max_examples=25)
@given(lens=st.lists(st.integers(1, 1500), min_size=1, max_size=8), devices=st.sampled_from([2, 4, 8]),
       mask=st.sampled_from(["causal", "full", "sliding_window(100)", "(h < 2 & full) | (h >= 2 & causal)"]),
       name=st.sampled_from([n for n in attnplan.strategies() if n != "ulysses"]),
       comm=st.sampled_from(COMMS), overlap=st.booleans(), divide=st.booleans(), fused=st.booleans(),
       profile=st.sampled_from(["h100", "cpu-local"]), run=st.sampled_from(RUNS), keep=st.booleans(),
       local=st.sampled_from(["first", "last", "kept"]))
def test_the_schedule_bound_is_below_the_simulated_makespan(lens, devices, mask, name, comm, overlap, divide, fused,
                                                            profile, run, keep, local):
    prof = dataclasses.replace(get_profile(profile), fused=fused)
    try:
        plan = attnplan.compile(seqlens=lens, mask=mask, devices=devices, nodes=2 if devices >= 4 else 1,
                                pipeline=pipeline(name, comm, overlap, divide, run, local), keep_kv=keep, **SHAPE)
    except attnplan.PlanError:
        return  # a pipeline this placement cannot take (e.g. divide after a ring strategy)
    fwd, bwd = schedule_bound(plan.ir, prof)
    sim = simulate(plan.ir, prof)
    assert 0 <= fwd <= sim["fwd"]["makespan_s"] * (1 + 1e-9)
    assert 0 <= bwd <= sim["bwd"]["makespan_s"] * (1 + 1e-9)


def test_the_schedule_bound_sees_what_the_placement_bound_cannot():
    """On a long-tailed batch across two nodes the order-free estimate is
    loose (partials come home after their last writer, operands arrive one
    message at a time): the schedule bound is above it in both phases for
    these three placements, and still a bound."""
    lens = [60000, 9000, 3000] + [500] * 40
    for name in ("minheap", "tile_pool", "hypergraph"):
        plan = attnplan.compile(seqlens=lens, mask="causal", devices=16, nodes=2, block_size=2048, strategy=name,
                                heads=8, kv_heads=2, head_dim=128)
        sim = simulate(plan.ir, plan.profile)
        est = estimate(plan.ir, plan.profile)
        fwd, bwd = schedule_bound(plan.ir, plan.profile)
        assert est.fwd_s * 1.1 < fwd <= sim["fwd"]["makespan_s"] * (1 + 1e-9), name
        assert est.bwd_s * 1.05 < bwd <= sim["bwd"]["makespan_s"] * (1 + 1e-9), name


@settings(max_examples=20)
@given(lens=st.lists(st.integers(1, 1500), min_size=1, max_size=8), devices=st.sampled_from([4, 8]),
       name=st.sampled_from(["minheap", "tile_pool", "hypergraph", "per_doc", "usp"]), overlap=st.booleans())
def test_messages_posted_at_time_0_arrive_when_the_sweep_says(lens, devices, name, overlap):
    """Without relays every data message is posted at the start of both
    programs: the simulator starts them in the sweep's order, and each
    arrives exactly at the sweep's time — the arrival the bound gives it."""
    plan = attnplan.compile(seqlens=lens, mask="causal", devices=devices, nodes=2,
                            pipeline=pipeline(name, "mode=p2p", overlap, False), **SHAPE)
    ir, prof = plan.ir, plan.profile
    sh, g = auto_schedule._shape(ir), ir.graph
    assert sh.sweep is not None and len(sh.sweep) == len(sh.msrc)  # one stage: every data message is in it
    M, X = ir.program.messages, ir.program.transfers
    sim = simulate(ir, prof, record=True)
    for phase, name_ in ((FWD, "fwd"), (BWD, "bwd")):
        x = sh.x
        nbytes = np.where(x[:, XK] == X_Q, buffer_bytes(g, phase, B_Q, x[:, XTB], x[:, XHG]),
                          buffer_bytes(g, phase, B_KV, x[:, XTB], x[:, XHG]))
        msec = link_seconds(sh.msrc, sh.mdst, np.bincount(sh.msg, weights=nbytes, minlength=len(sh.msrc)),
                            ir.placement.devices_per_node, prof)
        arrival = auto_schedule._sweep_arrivals(sh, msec, devices)[0]
        ends = {int(t[0]): t[4] for t in sim[name_]["events"]["transfer"]}
        data = [m for m in range(len(M)) if M[m, M_PHASE] == phase and X[M[m, M_START], T_KIND] <= B_KV]
        assert len(data) == len(sh.msrc)
        by_link = {(int(M[m, M_SRC]), int(M[m, M_DST])): ends[m] for m in data}
        for m in range(len(sh.msrc)):
            assert np.isclose(arrival[m], by_link[int(sh.msrc[m]), int(sh.mdst[m])], rtol=1e-12, atol=0)


def _crossing(ir, phase: int) -> set:
    """(kind, tb, hg, src, dst) of the partials a node reduce's aggregators send across: sent by a device that
    received partials of the same block (nothing else receives a partial of a block not its own)."""
    X = ir.program.transfers
    x = X[(X[:, T_PHASE] == phase) & (X[:, T_KIND] > B_KV)][:, [T_KIND, T_TB, T_HG, T_SRC, T_DST]].tolist()
    got = {(k, tb, hg, d) for k, tb, hg, _, d in x}
    return {tuple(r) for r in x if (r[0], r[1], r[2], r[3]) in got}


@settings(max_examples=25)
@given(lens=st.lists(st.integers(1, 1500), min_size=1, max_size=8), devices=st.sampled_from([2, 4, 8]),
       name=st.sampled_from([n for n in attnplan.strategies() if n != "ulysses"] + ["ulysses"]),
       comm=st.sampled_from(COMMS[:4]), overlap=st.booleans(), divide=st.booleans())
@example(lens=[955, 767, 405, 462, 62, 113], devices=4, name="hypergraph", comm="mode=p2p,relay=node", overlap=True,
         divide=False)  # partials of one device for one home sent in two stages (their last writers' stages)
@example(lens=[1500, 1400, 1300, 200, 90], devices=8, name="minheap", comm="mode=p2p,relay=node,reduce=node",
         overlap=True, divide=False)  # 42 dKV sums across nodes, from 4 aggregators
def test_partial_outputs_are_grouped_into_the_messages_emit_sends(lens, devices, name, comm, overlap, divide):
    """The bound charges one latency per message of partial outputs (the
    bulk of the backward's messages at 256 devices): its grouping is emit's
    — per phase the same messages (source, destination, rows and bytes),
    a node reduce's sums across nodes included."""
    try:
        plan = attnplan.compile(seqlens=lens, mask="causal", devices=devices, nodes=2 if devices >= 4 else 1,
                                pipeline=pipeline(name, comm, overlap, divide), **SHAPE)
    except attnplan.PlanError:
        return
    ir, g = plan.ir, plan.ir.graph
    sh = auto_schedule._shape(ir)
    M, X = ir.program.messages, ir.program.transfers
    for phase in (FWD, BWD):
        parts = sh.partials[phase]
        rows = np.concatenate([r for r, _, _ in parts])
        nbytes = np.concatenate([buffer_bytes(g, phase, k, r[:, 0], r[:, 1]) for r, k, _ in parts])
        msg, src, dst = auto_schedule._partial_messages(ir, sh, rows, np.concatenate([w for _, _, w in parts]))
        mine = sorted(zip(src.tolist(), dst.tolist(), np.bincount(msg, minlength=len(src)).tolist(),
                          np.bincount(msg, weights=nbytes, minlength=len(src)).astype(np.int64).tolist()))
        crossing = _crossing(ir, phase)  # a node reduce's sums leave from the tail, in messages of their own
        emitted = [(int(M[m, M_SRC]), int(M[m, M_DST]), int(M[m, M_END] - M[m, M_START]), int(M[m, M_BYTES]),
                    tuple(X[M[m, M_START], [T_KIND, T_TB, T_HG, T_SRC, T_DST]].tolist()) in crossing)
                   for m in range(len(M)) if M[m, M_PHASE] == phase and X[M[m, M_START], T_KIND] > B_KV]
        assert mine == sorted(e[:4] for e in emitted if not e[4])
        cross = sh.cross[phase]
        rows = np.concatenate([r for r, _ in cross])
        nbytes = np.concatenate([buffer_bytes(g, phase, k, r[:, 0], r[:, 1]) for r, k in cross])
        msg, src, dst = auto_schedule._cross_messages(rows, ir.devices)
        sums = sorted(zip(src.tolist(), dst.tolist(), np.bincount(msg, minlength=len(src)).tolist(),
                          np.bincount(msg, weights=nbytes, minlength=len(src)).astype(np.int64).tolist()))
        assert sums == sorted(e[:4] for e in emitted if e[4])


@settings(max_examples=25)
@given(lens=st.lists(st.integers(1, 1500), min_size=1, max_size=8), devices=st.sampled_from([2, 4, 8]),
       name=st.sampled_from([n for n in attnplan.strategies() if n != "ulysses"] + ["ulysses"]),
       comm=st.sampled_from(COMMS[:4]), overlap=st.booleans(), divide=st.booleans(), run=st.sampled_from(RUNS),
       local=st.sampled_from(["first", "last"]))
@example(lens=[878, 263, 1491], devices=8, name="hypergraph", comm="mode=p2p", overlap=True, divide=False,
         run=0.0, local="first")  # dQ and dKV partials of one device for one home in one message, the dQ written last
@example(lens=[1500, 1400, 1300], devices=8, name="span", comm="mode=p2p,relay=node", overlap=True, divide=False,
         run=3e10, local="last")  # the backward's own blocks after the others, in the last stage
def test_the_runs_the_bound_launches_begin_runs_in_the_program(lens, devices, name, comm, overlap, divide, run,
                                                                local):
    """A fused profile launches a kernel per run of consecutive compute
    instructions: every block the bound charges a launch to begins a run in
    the emitted program (the bound may miss runs, never invent one)."""
    try:
        plan = attnplan.compile(seqlens=lens, mask="causal", devices=devices, nodes=2 if devices >= 4 else 1,
                                pipeline=pipeline(name, comm, overlap, divide, run, local), **SHAPE)
    except attnplan.PlanError:
        return
    ir = plan.ir
    for phase in (FWD, BWD):
        sh = auto_schedule._shape(ir, phase=phase)
        begins = set()
        for dev, code in enumerate(ir.program.code[phase]):
            first = run_starts(code[:, OP], np.full(len(code), dev))
            begins |= set(code[first, A1].tolist())
        charged = set(sh.order[auto_schedule._run_starts(ir, sh, phase)].tolist())
        assert charged <= begins
        assert set(sh.order[sh.starts].tolist()) <= charged


def test_fair_links_and_all_to_alls_get_no_schedule_bound():
    plan = attnplan.compile(seqlens=[900, 300], mask="causal", devices=4, block_size=128,
                            pipeline="tile{block=128},minheap,comm{mode=a2a},emit", **SHAPE)
    assert schedule_bound(plan.ir, plan.profile) == (0.0, 0.0)
    plan = attnplan.compile(seqlens=[900, 300], mask="causal", devices=4, block_size=128, strategy="minheap", **SHAPE)
    fair = dataclasses.replace(plan.profile, links="fair")
    assert schedule_bound(plan.ir, fair) == (0.0, 0.0)


@settings(max_examples=60)
@given(jobs=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 20), st.integers(1, 9), st.integers(0, 9)),
                     min_size=1, max_size=6))
def test_release_bound_is_below_every_order_and_reached_by_one(jobs):
    """One machine per device, jobs (device, release, seconds): the bound is
    at most the best order's end, and equals it (release dates alone: the
    earliest-release order is optimal, and it is this bound). With tails (a
    second machine after the first, as a home merges what its receive queue
    delivered): at most the best order's end on the second machine."""
    dev, rel, sec, tail = (np.array(c, dtype=float) for c in zip(*jobs))
    got = release_bound(dev.astype(np.int64), rel, sec, 3)
    with_tail = release_bound(dev.astype(np.int64), rel, sec, 3, tail=tail)
    assert np.array_equal(release_bound(dev.astype(np.int64), rel, sec, 3, tail=np.zeros(len(jobs))), got)
    for d in range(3):
        mine = [(r, s, q) for dd, r, s, q in jobs if dd == d]
        best, best_tail = 0.0, 0.0
        if mine:
            best = best_tail = np.inf
            for perm in itertools.permutations(mine):
                t = t2 = 0.0
                for r, s, q in perm:
                    t = max(t, r) + s
                    t2 = max(t2, t) + q
                best, best_tail = min(best, t), min(best_tail, t2)
        assert got[d] == best
        assert got[d] <= with_tail[d] <= best_tail
        if len(mine) == 1:  # one job: its release, its seconds, its tail
            assert with_tail[d] == best_tail


def test_the_bound_keeps_its_digits_on_short_phases():
    """Per-device offsets in the running maxima are scaled to the times: a
    1 s offset on a 1e-7 s forward cost the bound its last digits and put it
    4e-9 above the simulation (a reviewer's case, fast NVLink, slow NICs)."""
    prof = dataclasses.replace(get_profile("h100"), fused=True, inter_bw=1077303933.685605, intra_alpha=0.0,
                               launch_s=0.0)
    plan = attnplan.compile(seqlens=[861, 8, 509, 1027, 1157, 582, 1207], mask="sliding_window(100)", devices=8,
                            nodes=4, keep_kv=True, partials_dtype="bfloat16", heads=4, kv_heads=2, head_dim=16,
                            pipeline="tile{block=128},span,comm{mode=p2p},divide{stages=4},overlap{run=1e8},emit")
    fwd, bwd = schedule_bound(plan.ir, prof)
    sim = simulate(plan.ir, prof)
    assert fwd <= sim["fwd"]["makespan_s"] * (1 + 1e-12) and bwd <= sim["bwd"]["makespan_s"] * (1 + 1e-12)
    assert fwd >= 0.99 * sim["fwd"]["makespan_s"]  # and it is still tight here
