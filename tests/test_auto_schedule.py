"""The schedule bound of ``auto`` (tools/auto_schedule.py): a lower bound of
each phase's simulated makespan for every strategy and schedule (p2p with
and without node relays, ring, all-gathers, divide, overlap on and off),
every builtin-like mask, fused and unfused launches; and the one-machine
bound it is built from, against brute force over every order."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import attnplan
from attnplan.backends.cost import get_profile, simulate
from attnplan.tools.auto import estimate
from attnplan.tools.auto_schedule import release_bound, schedule_bound

SHAPE = dict(heads=4, kv_heads=2, head_dim=16)
COMMS = ["mode=p2p,relay=node", "mode=p2p", "mode=ring", "mode=allgather", "mode=allgather_ring"]


def pipeline(name: str, comm: str, overlap: bool, divide: bool) -> str:
    steps = ["tile{block=128}", name] + (["divide{stages=3}"] if divide else []) + [f"comm{{{comm}}}"]
    return ",".join(steps + (["overlap"] if overlap else []) + ["emit"])


@settings(max_examples=25)
@given(lens=st.lists(st.integers(1, 1500), min_size=1, max_size=8), devices=st.sampled_from([2, 4, 8]),
       mask=st.sampled_from(["causal", "full", "sliding_window(100)", "(h < 2 & full) | (h >= 2 & causal)"]),
       name=st.sampled_from([n for n in attnplan.strategies() if n != "ulysses"]),
       comm=st.sampled_from(COMMS), overlap=st.booleans(), divide=st.booleans(), fused=st.booleans(),
       profile=st.sampled_from(["h100", "cpu-local"]))
def test_the_schedule_bound_is_below_the_simulated_makespan(lens, devices, mask, name, comm, overlap, divide, fused,
                                                            profile):
    prof = dataclasses.replace(get_profile(profile), fused=fused)
    try:
        plan = attnplan.compile(seqlens=lens, mask=mask, devices=devices, nodes=2 if devices >= 4 else 1,
                                pipeline=pipeline(name, comm, overlap, divide), **SHAPE)
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


def test_fair_links_and_all_to_alls_get_no_schedule_bound():
    plan = attnplan.compile(seqlens=[900, 300], mask="causal", devices=4, block_size=128,
                            pipeline="tile{block=128},minheap,comm{mode=a2a},emit", **SHAPE)
    assert schedule_bound(plan.ir, plan.profile) == (0.0, 0.0)
    plan = attnplan.compile(seqlens=[900, 300], mask="causal", devices=4, block_size=128, strategy="minheap", **SHAPE)
    fair = dataclasses.replace(plan.profile, links="fair")
    assert schedule_bound(plan.ir, fair) == (0.0, 0.0)


@settings(max_examples=60)
@given(jobs=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 20), st.integers(1, 9)), min_size=1, max_size=6))
def test_release_bound_is_below_every_order_and_reached_by_one(jobs):
    """One machine per device, jobs (device, release, seconds): the bound is
    at most the best order's end, and equals it (release dates alone: the
    earliest-release order is optimal, and it is this bound)."""
    dev, rel, sec = (np.array(c, dtype=float) for c in zip(*jobs))
    got = release_bound(dev.astype(np.int64), rel, sec, 3)
    for d in range(3):
        mine = [(r, s) for dd, r, s in jobs if dd == d]
        best = 0.0
        if mine:
            best = np.inf
            for perm in itertools.permutations(mine):
                t = 0.0
                for r, s in perm:
                    t = max(t, r) + s
                best = min(best, t)
        assert got[d] == best
