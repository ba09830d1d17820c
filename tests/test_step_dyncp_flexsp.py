"""The dyncp (Megatron-LM Dynamic CP) and flexsp (FlexSP) batch passes of
issue 10 item 4: random global batches × both systems × small meshes — the
fragments partition the batch and executing the micro-batches' attention
plans equals dense attention per document; each system's own rules (CP size
per document, rounds covering the pool, the MILP's optimum against brute
force, memory and device bounds, FlexSP's example); their options."""

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnplan.errors import StepError
from attnplan.step import Mesh, Model, compile_step, make_problem, parse_system
from attnplan.step.simulate import doc_seconds
from attnplan.step.systems.common import tokens_per_device
from attnplan.step.systems.dyncp import DynCP, buckets_of, group_sizes, layout, need_size
from attnplan.step.systems.flexsp import FlexSP, bucket_runs, comm_seconds, launch_seconds
from attnplan.step.systems.flexsp_milp import polish

TINY = Model("tiny", 2, 64, 4, 2, 8, 128, 256)
MESHES = [(1, 1, 1), (1, 2, 2), (2, 1, 2), (2, 2, 4), (1, 4, 4), (2, 2, 2), (4, 2, 4)]  # dp, cp, devices a node


def problem(lens, dp, cp, per_node, model=TINY, block=8, **kw):
    return make_problem(lens, model=model, mesh=Mesh(dp, cp, devices_per_node=per_node, **kw), block_size=block,
                        profile="h100")


def _load_cases():
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("_step_cases", Path(__file__).with_name("_step_cases.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_cases = _load_cases()
dense_causal, check_execution = _cases.dense_causal, _cases.check_execution


def rounds_of(plan):
    """Micro-batches of every round of a dyncp plan (by its round_slots info)."""
    starts = [int(x) for x in str(plan.info_dict()["round_slots"]).split(",")]
    ends = starts[1:] + [int(plan.mb_slot.max()) + 1]
    return [[m for m in range(plan.n_mb) if lo <= plan.mb_slot[m] < hi] for lo, hi in zip(starts, ends)]


@st.composite
def global_batches(draw):
    lens = draw(st.lists(st.one_of(st.integers(1, 12), st.integers(13, 90)), min_size=1, max_size=12))
    return lens, draw(st.sampled_from(MESHES))


def small_cap(lens, dp, cp):
    """A per-device token bound that makes the longest document need several devices where it can."""
    return max(8, -(-max(lens) // (dp * cp)), max(lens) // 3)


@settings(max_examples=25)
@given(global_batches(), st.sampled_from(["dyncp", "flexsp"]), st.booleans())
def test_both_systems_partition_the_batch_and_compute_dense_attention(case, system, tight):
    lens, (dp, cp, per_node) = case
    spec = f"{system}{{max_tokens={small_cap(lens, dp, cp)}}}" if tight else system
    c = compile_step(problem(lens, dp, cp, per_node), spec)
    plan = c.plan
    assert sorted(plan.frag_doc.tolist()) == list(range(len(lens))) and not len(plan.queue_out)
    assert (plan.frag_start == 0).all() and (plan.frag_end == np.asarray(lens)[plan.frag_doc]).all()
    check_execution(c)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 400), min_size=1, max_size=40), st.sampled_from([(2, 2, 4), (4, 2, 8), (2, 4, 4),
                                                                                (8, 1, 4)]),
       st.booleans(), st.booleans())
def test_dyncp_cp_sizes_groups_and_rounds(lens, mesh, quota, pack):
    """Megatron's rule: every document runs on a power-of-two group at least ⌈s / max_tokens⌉ large, aligned
    at a multiple of its size (so inside a node when it fits one); a micro-batch never holds more than its
    group's tokens; every round covers the pool (empty devices are filled)."""
    dp, cp, per_node = mesh
    n = dp * cp
    cap = small_cap(lens, dp, cp)
    p = problem(lens, dp, cp, per_node)
    plan = DynCP(max_tokens=cap, quota=quota, pack=pack).apply(p)
    for m in range(plan.n_mb):
        ranks = plan.mb_ranks(m)
        g = len(ranks)
        docs = plan.frag_doc[plan.frag_mb == m]
        assert g & (g - 1) == 0 and ranks[0] % g == 0 and ranks.tolist() == list(range(ranks[0], ranks[0] + g))
        assert all(g * cap >= p.seqlens[d] for d in docs)
        assert plan.mb_tokens()[m] <= g * cap or len(docs) == 1
        if not pack:
            assert len(docs) == 1
        if g <= per_node:
            assert len(set((ranks // per_node).tolist())) == 1
    for mbs in rounds_of(plan):
        covered = sorted({r for m in mbs for r in plan.mb_ranks(m).tolist()})
        assert covered == list(range(n))
        groups = {tuple(plan.mb_ranks(m).tolist()) for m in mbs}
        assert sum(len(g) for g in groups) == n  # one set of disjoint groups per round


def test_dyncp_cp_size_is_the_next_power_of_two():
    sizes = group_sizes(Mesh(4, 8))
    assert sizes == [1, 2, 4, 8, 16, 32]
    lens = np.array([1, 100, 101, 250, 300, 401, 3200, 3201])
    assert need_size(lens, 100, sizes).tolist() == [1, 1, 2, 4, 4, 8, 32, 0]
    assert group_sizes(Mesh(2, 3, devices_per_node=6)) == [1, 2, 6]  # 4 would straddle nodes of 6
    groups = layout([2, 8, 1, 4, 1])
    assert [g.tolist()[0] for g in groups] == [12, 0, 14, 8, 15]


def test_dyncp_overloaded_documents_get_larger_groups():
    """With the quota, a document whose work exceeds a device's share of the step is cut finer than memory
    requires (survey §3.1 step 3), at most over a node's devices."""
    lens = [4000] + [200] * 60
    p = problem(lens, 2, 4, 8, model="qwen2.5-0.5b")
    cap = tokens_per_device(p)
    assert cap >= 4000  # memory alone puts every document on one device
    def size_of(plan, d):
        return len(plan.mb_ranks(int(plan.frag_mb[plan.frag_doc.tolist().index(d)])))
    assert size_of(DynCP(quota=False).apply(p), 0) == 1
    big = size_of(DynCP().apply(p), 0)
    work = doc_seconds(p)
    assert big > 1 and work[0] / big <= work.sum() / 8 < work[0] / (big // 2)


def test_dyncp_buckets_keep_order_and_count():
    need = np.array([4, 4, 2, 2, 2, 1, 1, 1, 1, 1])
    work = np.array([16, 15, 6, 5, 5, 1, 1, 1, 1, 1.0])
    items = list(range(10))
    b = buckets_of(items, need, work)
    assert [d for q in b for d in q] == items and 1 <= len(b) <= 3


def test_dyncp_beats_fixed_more_when_lengths_vary():
    """Megatron's claim in miniature: over the same mesh and token count, dynamic CP gains more over a fixed
    CP size on a batch of widely varying lengths than on one of even lengths."""
    varied = [24000, 9000, 6000] + [700] * 35 + [300] * 40
    even = [1000 + 37 * (i % 11) for i in range(64)]
    even = even[:-1] + [sum(varied) - sum(even[:-1])]
    assert sum(even) == sum(varied)
    gains = []
    for lens in (varied, even):
        p = problem(lens, 2, 4, 8, model="qwen2.5-0.5b", block=2048)
        fixed, dyn = (compile_step(p, s).report["step_s"] for s in ("fixed", DynCP()))
        gains.append(fixed / dyn)
    assert gains[0] > 1.0 and gains[0] > gains[1]


def test_dyncp_micro_batches_vary_and_plans_are_pure():
    a = problem([30, 5, 5, 5, 5, 5, 5, 5], 2, 2, 4)
    b = problem([8] * 8, 2, 2, 4)
    pa, pb = DynCP(max_tokens=10).apply(a), DynCP(max_tokens=10).apply(b)
    assert pa.n_mb != pb.n_mb  # the number of micro-batches follows the batch
    again = DynCP(max_tokens=10).apply(problem([30, 5, 5, 5, 5, 5, 5, 5], 2, 2, 4))
    for col in ("frag_doc", "frag_mb", "mb_slot", "group_ranks", "group_ptr"):
        assert getattr(pa, col).tolist() == getattr(again, col).tolist()
    assert pa.mb_strategy == again.mb_strategy and pa.info == again.info


def flexsp_times(p, fallback="zigzag"):
    work = doc_seconds(p)
    return {d: work / d + comm_seconds(p, p.seqlens, d, fallback) + launch_seconds(p, d)
            for d in group_sizes(p.mesh)}


def brute_force(p, cap):
    """The least makespan over every set of power-of-two groups within the pool and every assignment of the
    documents to them (memory per group: tokens ≤ size × cap), under FlexSP's cost model."""
    n, lens = p.mesh.stage_devices, p.seqlens
    times = flexsp_times(p)
    sizes = group_sizes(p.mesh)
    best = math.inf
    configs = [c for k in range(1, p.docs + 1) for c in itertools.combinations_with_replacement(sizes, k)
               if sum(c) <= n]
    for conf in configs:
        for assign in itertools.product(range(len(conf)), repeat=p.docs):
            if len(set(assign)) != len(conf):
                continue  # every group used
            load = [0.0] * len(conf)
            held = [0] * len(conf)
            for d, g in enumerate(assign):
                load[g] += float(times[conf[g]][d])
                held[g] += int(lens[d])
            if all(h <= conf[g] * cap for g, h in enumerate(held)):
                best = min(best, max(load))
    return best


@settings(max_examples=12, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=4))
def test_flexsp_milp_finds_the_optimum(lens):
    """With a variable per document (buckets=0) and no gap, the paper's MILP reaches the brute-force optimum
    of its own cost model; the pooled MILP and the heuristics never beat it (and always stay feasible)."""
    p = problem(lens, 1, 4, 4, model="qwen2.5-0.5b", recompute="none")
    cap = max(64, -(-sum(lens) // 4))  # one micro-batch holds the batch
    opt = brute_force(p, cap)
    for form in ("groups", "pooled"):
        plan = FlexSP(max_tokens=cap, buckets=0, gap=0.0, formulation=form, time_limit=20).apply(p)
        est = plan.info_dict()["estimated_s"]
        assert est >= opt * (1 - 1e-9)
        if form == "groups":
            assert est <= opt * (1 + 1e-9)
            assert plan.info_dict()["solver_stop"] in ("optimal", "heuristic")


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=60), st.sampled_from([(2, 4, 8), (4, 4, 8), (1, 8, 4)]))
def test_flexsp_groups_memory_devices_and_strategies(lens, mesh):
    dp, cp, per_node = mesh
    n = dp * cp
    p = problem(lens, dp, cp, per_node, model="qwen2.5-0.5b")
    cap = max(100, max(lens) // 3)
    plan = FlexSP(max_tokens=cap, time_limit=1.0).apply(p)
    info = plan.info_dict()
    assert info["solver_stop"] in ("optimal", "time_limit", "heuristic")
    if info["solver_stop"] == "optimal":
        assert 0.0 <= info["mip_gap"] <= 0.01 + 1e-9
    per_slot: dict = {}
    for m in range(plan.n_mb):
        ranks = plan.mb_ranks(m)
        g = len(ranks)
        assert g & (g - 1) == 0 and ranks[0] % g == 0
        assert plan.mb_tokens()[m] <= g * cap
        # Ulysses where the group divides the KV heads, or (copies, the default) the query heads
        assert plan.mb_strategy[m] == ("ulysses" if p.model.kv_heads % g == 0 or p.model.heads % g == 0
                                       else "zigzag")
        per_slot.setdefault(int(plan.mb_slot[m]), []).append(g)
    assert all(sum(v) <= n for v in per_slot.values())
    assert len(per_slot) == info["micro_batches"]
    # the pool's memory bounds every micro-batch: the fewest micro-batches are the token count over it
    assert info["micro_batches"] >= -(-sum(lens) // (cap * n))


def test_flexsp_copies_kv_heads_beyond_them():
    """TINY has 4 query and 2 KV heads: a group of 4 runs ``ulysses`` with every KV head copied twice
    (``copies=true``, the default; lowered plans have ``kv_rep`` 2 and equal dense attention), or the ring
    fallback with ``copies=false``; the cost model charges the copies' all-to-all."""
    lens = [300, 200, 40, 30]
    p = problem(lens, 1, 4, 4)
    on = compile_step(p, "flexsp{max_tokens=80}")
    sizes = [len(on.plan.mb_ranks(m)) for m in range(on.plan.n_mb)]
    assert 4 in sizes
    for m, low in enumerate(on.lowered):
        g = sizes[m]
        assert on.plan.mb_strategy[m] == "ulysses"
        assert low.ir.graph.kv_rep == (2 if g == 4 else 1)
    check_execution(on)
    off = FlexSP(max_tokens=80, copies=False).apply(p)
    assert all(off.mb_strategy[m] == ("zigzag" if len(off.mb_ranks(m)) == 4 else "ulysses")
               for m in range(off.n_mb))
    s = np.asarray(lens)
    copied, ring = comm_seconds(p, s, 4, "zigzag", True), comm_seconds(p, s, 4, "zigzag", False)
    m = p.model
    # full recompute: Ulysses' Q, K, V in and O out with the KV of 2 copies, (2·4 + 2·2·2) heads a token over
    # d = 4, three times; the ring's K, V of 2 heads over the whole sequence (not divided by d), four times
    assert p.mesh.recompute == "full"
    assert np.allclose(copied / ring, ((2 * m.heads + 4 * m.kv_heads) / 4 * 3) / (2 * m.kv_heads * 4))


def test_flexsp_reproduces_the_papers_example_choice():
    """FlexSP Fig. 1: on 64 A100 with GPT-7B, one 100K and four 48K sequences are faster on one group of 32
    and four of 8 than on two homogeneous groups of 32 — under the MILP's own cost model (no lowering here)."""
    mesh = Mesh(dp=8, cp=8, devices_per_node=8, recompute="none")
    p = make_problem([100_000] + [48_000] * 4, model="gpt-7b", mesh=mesh, profile="a100", block_size=16384)
    plan = FlexSP().apply(p)
    groups = sorted(len(plan.mb_ranks(m)) for m in range(plan.n_mb))
    times = flexsp_times(p)
    chosen = max(float(times[len(plan.mb_ranks(m))][plan.frag_doc[plan.frag_mb == m]].sum())
                 for m in range(plan.n_mb))
    homo = min(max(float(times[32][list(a)].sum()), float(times[32][list(b)].sum()))
               for a, b in ([(0,), (1, 2, 3, 4)], [(0, 1), (2, 3, 4)]))
    assert chosen < homo
    assert chosen == pytest.approx(plan.info_dict()["estimated_s"])
    assert groups == [8, 8, 8, 8, 32]
    assert set(plan.mb_strategy) == {"ulysses"}  # GPT-7B has 32 KV heads


def test_flexsp_splits_a_batch_the_pool_cannot_hold():
    lens = [900] * 12
    p = problem(lens, 2, 2, 4)
    plan = FlexSP(max_tokens=1000).apply(p)
    assert plan.info_dict()["micro_batches"] == 3  # 10,800 tokens, 4,000 a micro-batch
    assert len(set(plan.mb_slot.tolist())) == 3
    with pytest.raises(StepError, match="document 0 \\(5,000 tokens\\) does not fit"):
        FlexSP(max_tokens=1000).apply(problem([5000, 10], 2, 2, 4))


@settings(max_examples=40)
@given(st.lists(st.floats(0.0, 100.0), min_size=1, max_size=9), st.integers(1, 4))
def test_bucket_runs_are_optimal(ws, buckets):
    w = np.sort(np.asarray(ws))[::-1]
    n = len(w)
    def cost(starts):
        ends = list(starts[1:]) + [n]
        return sum((e - s) * w[s] - w[s:e].sum() for s, e in zip(starts, ends))
    got = bucket_runs(w, buckets)
    assert got[0] == 0 and (np.diff(got) > 0).all() and len(got) <= max(buckets, 1) or n <= buckets
    best = min(cost([0, *c]) for k in range(min(buckets, n)) for c in itertools.combinations(range(1, n), k))
    assert cost(got.tolist()) <= best + 1e-9


@settings(max_examples=25)
@given(st.lists(st.integers(1, 4000), min_size=2, max_size=30), st.integers(0, 2**16))
def test_polish_keeps_documents_and_never_slows(lens, seed):
    p = problem(lens, 2, 4, 8, model="qwen2.5-0.5b")
    times = flexsp_times(p)
    need = need_size(p.seqlens, 10 ** 9, group_sizes(p.mesh))
    rng = np.random.default_rng(seed)
    sizes = [4, 2, 1, 1]
    where = rng.integers(0, len(sizes), len(lens))
    groups = [(sizes[g], np.flatnonzero(where == g).tolist()) for g in range(len(sizes)) if (where == g).any()]
    before = max(float(times[d][m].sum()) for d, m in groups)
    out = polish(groups, times, need, p.seqlens, 10 ** 9)
    assert sorted(d for _, m in out for d in m) == list(range(len(lens)))
    assert max(float(times[d][m].sum()) for d, m in out) <= before + 1e-12


@pytest.mark.parametrize("spec,match", [
    ("dyncp{delta=2}", "delta must be in"), ("dyncp{cost=cube}", "cost must be one of"),
    ("dyncp{inner=warp}", "inner must be"), ("dyncp{max_tokens=-1}", "max_tokens must be an integer"),
    ("flexsp{time_limit=0}", "time_limit must be in"), ("flexsp{gap=1}", "gap must be in"),
    ("flexsp{fallback=ulysses}", "fallback is the strategy"), ("flexsp{formulation=x}", "formulation must be"),
    ("flexsp{buckets=-2}", "buckets must be an integer"), ("flexsp{inner=zigzag}", "inner must be one of")])
def test_bad_options(spec, match):
    with pytest.raises(StepError, match=match):
        parse_system(spec)
