"""The step IR, its verifier and the whole-step simulation (issue 10, items
2, 3 and 5): every invariant has a broken plan that fails it with a precise
message; the simulation's step time is bounded below by its lower bound and
by the slowest rank; memory over the cap names the device, micro-batch and bytes."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnplan.errors import MemoryCapError, StepError, VerifyError
from attnplan.step import Mesh, Model, compile_step, make_problem
from attnplan.step.base import parse_system
from attnplan.step.ir import build_plan
from attnplan.step.lower import cache_of, lower_step
from attnplan.step.simulate import doc_seconds, grad_reduce, memory, ring_seconds, simulate_step
from attnplan.step.verify import verify_lowered, verify_plan

TINY = Model("tiny", 2, 64, 4, 2, 16, 128, 256)


def problem(lens, dp=2, cp=2, per_node=4, **kw):
    return make_problem(lens, model=kw.pop("model", TINY), mesh=Mesh(dp, cp, devices_per_node=per_node, **kw),
                        block_size=16)


def fixed_plan(lens=(40, 7, 23, 5, 64, 3), **kw):
    return parse_system("fixed").apply(problem(list(lens), **kw))


def test_a_fixed_plan_verifies_and_reads_back():
    plan = fixed_plan()
    verify_plan(plan)
    p = plan.problem
    assert plan.n_mb == p.mesh.dp and sorted(plan.frag_doc.tolist()) == list(range(p.docs))
    text = plan.to_text()
    assert all(f"frag {f}: doc {int(plan.frag_doc[f])} " in text for f in range(len(plan.frag_doc)))
    assert "ranks 0..1" in text and "ranks 2..3" in text
    assert plan.rank_order() == [[0], [0], [1], [1]]


def broken(plan, **changes):
    return dataclasses.replace(plan, **changes)


def test_every_token_in_exactly_one_micro_batch():
    plan = fixed_plan()
    with pytest.raises(VerifyError, match=r"document \d+: 0 of its \d+ tokens"):
        verify_plan(broken(plan, frag_doc=plan.frag_doc[1:], frag_start=plan.frag_start[1:],
                           frag_end=plan.frag_end[1:], frag_mb=plan.frag_mb[1:]))
    with pytest.raises(VerifyError, match="document 0: 20 of its 40 tokens"):
        verify_plan(broken(plan, frag_end=np.where(plan.frag_doc == 0, 20, plan.frag_end)))
    twice = np.concatenate([plan.frag_doc[:1], plan.frag_doc])
    with pytest.raises(VerifyError, match="split into 2 fragments"):
        verify_plan(broken(plan, frag_doc=twice, frag_start=np.concatenate([[0], plan.frag_start]),
                           frag_end=np.concatenate([plan.frag_end[:1], plan.frag_end]),
                           frag_mb=np.concatenate([[0], plan.frag_mb])))
    with pytest.raises(VerifyError, match="queued for a later step and also"):
        verify_plan(broken(plan, queue_out=np.array([0])))
    with pytest.raises(VerifyError, match="queued twice"):
        verify_plan(broken(plan, queue_out=np.array([0, 0])))
    with pytest.raises(VerifyError, match="not a non-empty range"):
        verify_plan(broken(plan, frag_end=plan.frag_end + 1))


def test_fragments_and_micro_batches():
    plan = fixed_plan()
    with pytest.raises(VerifyError, match="micro-batch by micro-batch"):
        verify_plan(broken(plan, frag_mb=plan.frag_mb[::-1].copy()))
    with pytest.raises(VerifyError, match="micro-batch 2 has no fragment"):
        verify_plan(broken(plan, mb_group=np.array([0, 1, 0]), mb_slot=np.array([0, 0, 1]),
                           mb_strategy=("zigzag",) * 3))
    with pytest.raises(VerifyError, match="unknown attention strategy 'ring9'"):
        verify_plan(broken(plan, mb_strategy=("zigzag", "ring9")))
    with pytest.raises(VerifyError, match="group 5 does not exist"):
        verify_plan(broken(plan, mb_group=np.array([0, 5])))
    with pytest.raises(VerifyError, match="2 slots and 1 strategies"):
        verify_plan(broken(plan, mb_strategy=("zigzag",)))


def test_concurrent_micro_batches_use_disjoint_ranks():
    plan = fixed_plan()
    with pytest.raises(VerifyError, match="micro-batches 0 and 1 both run in slot 0 on rank 0"):
        verify_plan(broken(plan, mb_group=np.array([0, 0])))
    verify_plan(broken(plan, mb_group=np.array([0, 0]), mb_slot=np.array([0, 1])))  # one after the other: fine


def test_groups():
    plan = fixed_plan()
    with pytest.raises(VerifyError, match="rank 9 is not one of the stage's 4 ranks"):
        verify_plan(broken(plan, group_ranks=np.array([0, 1, 2, 9])))
    with pytest.raises(VerifyError, match="sorted and distinct"):
        verify_plan(broken(plan, group_ranks=np.array([1, 0, 2, 3])))
    odd = fixed_plan(dp=1, cp=4, per_node=2)  # 4 ranks on 2 nodes of 2
    with pytest.raises(VerifyError, match=r"its nodes give it \[2, 1\] devices"):
        verify_plan(broken(odd, group_ptr=np.array([0, 3]), group_ranks=np.array([0, 1, 2])))


def test_lowered_plans_must_match_their_micro_batches():
    plan = fixed_plan()
    low = lower_step(plan)
    peak, which = memory(plan, low)
    verify_lowered(plan, low, peak, which, plan.problem.cap)
    with pytest.raises(VerifyError, match="micro-batch 0: its attention plan's samples are not its fragments"):
        verify_lowered(plan, [low[1], low[0]], peak, which, plan.problem.cap)
    with pytest.raises(VerifyError, match="1 attention plans for 2 micro-batches"):
        verify_lowered(plan, low[:1], peak, which, plan.problem.cap)


def test_memory_over_the_cap_names_device_micro_batch_and_bytes():
    p = problem([300, 20, 20, 20], dp=2, cp=2, memory_cap=1 << 30, reserve=0)
    static = compile_step(p, "fixed").report["per_rank"]["peak_memory_bytes"]
    heavy = int(np.argmax(static))
    cap = (max(static) + min(static)) // 2   # the heaviest device no longer fits
    p2 = problem([300, 20, 20, 20], dp=2, cp=2, memory_cap=cap, reserve=0)
    with pytest.raises(MemoryCapError, match=r"device \d+ needs .* GiB in micro-batch \d+ \(\d+ tokens on 2 devices\), "
                                             r"over its cap") as e:
        compile_step(p2, "fixed")
    assert e.value.device == heavy and e.value.bytes == max(static) and e.value.cap == cap and e.value.micro_batch >= 0


def test_a_model_that_does_not_fit_at_all():
    big = Model("big", 80, 8192, 64, 8, 128, 28672, 128256)
    p = make_problem([100, 200], model=big, mesh=Mesh(1, 2))
    for system in ("fixed", "wlb", "pool"):
        with pytest.raises(StepError, match="does not fit on 2 devices of 80 GiB: its weights"):
            compile_step(p, system)


@st.composite
def batches(draw):
    return draw(st.lists(st.integers(1, 120), min_size=1, max_size=14))


@settings(max_examples=25)
@given(batches(), st.sampled_from([(1, 1), (1, 2), (2, 2), (4, 1), (2, 4)]), st.sampled_from(["fixed", "wlb"]),
       st.sampled_from(["full", "none"]))
def test_step_time_is_bounded_below(lens, mesh, system, recompute):
    """Simulated step ≥ its lower bound (all FLOPs over all devices at peak) and ≥ every rank's busy time."""
    p = problem(lens, *mesh, per_node=4, recompute=recompute)
    r = compile_step(p, system).report
    assert r["step_s"] >= r["lower_bound_s"] * (1 - 1e-9)
    assert r["step_s"] >= r["compute_end_s"] >= max(r["per_rank"]["busy_s"]) * (1 - 1e-9)
    assert r["dp_imbalance"] >= 1.0 - 1e-12
    assert r["tokens"] + r["tokens_queued"] == sum(lens)
    assert sum(r["per_mb"]["tokens"]) == r["tokens"]
    # busy time is all the step's work: linear + output layer exactly, attention with the kernels' rounding
    assert sum(r["per_rank"]["busy_s"]) >= r["lower_bound_s"] * p.mesh.stage_devices * (1 - 1e-9)


def test_doc_seconds_sum_to_the_bound():
    p = problem([50, 10, 33])
    r = compile_step(p, "fixed").report
    assert doc_seconds(p).sum() / p.mesh.stage_devices == pytest.approx(r["lower_bound_s"])


def test_gradient_reduction_overlap():
    end = np.array([10.0, 10.0])
    per_layer = np.array([1.0, 1.0])
    # small buckets: everything hides behind the backward but the last layer's and the embedding's
    assert grad_reduce(end, per_layer, 4, 0.1, 0.1, 0.5) == pytest.approx(10.0 + 0.1 + 0.5)
    # big buckets: the reduction is the bottleneck from the first layer's bucket on (ready after one layer)
    assert grad_reduce(end, per_layer, 4, 0.0, 3.0, 0.0) == pytest.approx(10.0 - 3 * 1.0 + 4 * 3.0)
    # a slow rank delays every bucket
    assert grad_reduce(np.array([10.0, 12.0]), per_layer, 4, 0.1, 0.1, 0.5) == pytest.approx(12.6)
    assert ring_seconds(1e9, 1, False, None) == 0.0


def test_compiling_twice_gives_the_same_plan():
    lens = [90, 3, 44, 17, 5, 5, 61, 2, 30]
    a, b = (compile_step(problem(lens), "wlb") for _ in range(2))
    for f in ("frag_doc", "frag_start", "frag_end", "frag_mb", "mb_group", "mb_slot", "group_ranks"):
        assert np.array_equal(getattr(a.plan, f), getattr(b.plan, f))
    assert a.plan.mb_strategy == b.plan.mb_strategy
    assert a.report["step_s"] == b.report["step_s"]


def test_identical_micro_batches_are_lowered_once():
    p = problem([32] * 8, dp=4, cp=1, per_node=4)
    c = compile_step(p, "fixed")
    assert c.plan.n_mb == 4 and len({mb for mb in (c.plan.mb_seqlens(m) for m in range(4))}) == 1
    assert cache_of(p).compiles == 1
    assert simulate_step(c.plan, list(c.lowered))["step_s"] == c.report["step_s"]


def test_build_plan_shares_groups():
    p = problem([10, 20, 30])
    plan = build_plan(p, "x", [[0], [1, 2]], [[0, 1], [0, 1]], [0, 1], ["zigzag", "zigzag"])
    assert plan.n_groups == 1 and plan.mb_group.tolist() == [0, 0]
    verify_plan(plan)


def test_equal_micro_batches_choose_their_strategy_once():
    p = problem([50] * 8, dp=2, cp=2, per_node=4)
    c = compile_step(p, "pool{micro=4}")
    assert c.plan.n_mb == 4 and len({c.plan.mb_seqlens(m) for m in range(4)}) == 1
    assert cache_of(p).compiles <= 2  # minheap and hypergraph, once each
