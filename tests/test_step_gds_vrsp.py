"""Skrull's GDS (``gds``) and Libra's VRSP (``vrsp``) batch passes (issue 10,
item 4): random global batches × both systems × small meshes — the fragments
partition the batch and the micro-batches' attention plans compute dense
attention per document; GDS's cost coefficients, its LPT across replicas,
its memory bound and its interleaving; VRSP's packing (fixed's), its pools
and LPT."""


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnplan.errors import StepError
from attnplan.step import Mesh, Model, compile_step, make_problem, parse_system, system_names
from attnplan.step.model import LINEAR_BWD_FACTOR, linear_flops, skrull_linear_flops
from attnplan.step.simulate import doc_seconds, rates, work_factors
from attnplan.step.systems.common import tokens_per_device
from attnplan.step.systems.fixed import Fixed
from attnplan.passes.dacp import default_slack
from attnplan.step.systems.gds import Gds, interleave, lpt, skrull_coefficients
from attnplan.step.systems.vrsp import Vrsp, fixed_packing, lpt_pools

TINY = Model("tiny", 2, 64, 4, 2, 8, 128, 256)
MESHES = [(1, 1, 1), (1, 2, 2), (2, 1, 2), (2, 2, 4), (1, 4, 4), (2, 2, 2), (4, 2, 4), (4, 1, 4)]


def problem(lens, dp, cp, per_node, model=TINY, block_size=8, packing=None):
    return make_problem(lens, model=model, mesh=Mesh(dp, cp, devices_per_node=per_node), block_size=block_size,
                        profile="h100", packing=packing)


def _load_cases():
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("_step_cases", Path(__file__).with_name("_step_cases.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_cases = _load_cases()
dense_causal, check_execution = _cases.dense_causal, _cases.check_execution


def replica_of(plan, m):
    return int(plan.mb_ranks(m)[0]) // plan.problem.mesh.cp


@st.composite
def global_batches(draw):
    lens = draw(st.lists(st.one_of(st.integers(1, 12), st.integers(13, 90)), min_size=1, max_size=12))
    return lens, draw(st.sampled_from(MESHES))


@settings(max_examples=30)
@given(global_batches(), st.sampled_from(["gds", "vrsp", "vrsp{pool=2}", "gds{micro=2}",
                                                 "vrsp{micro=2,pool=2}", "vrsp{place=data,pool=2,micro=2}"]))
def test_partition_and_dense_attention(case, system):
    lens, (dp, cp, per_node) = case
    if "pool=2" in system and dp % 2:
        system = system.replace("pool=2", "pool=1")
    c = compile_step(problem(lens, dp, cp, per_node), system)
    plan = c.plan
    assert sorted(plan.frag_doc.tolist()) == list(range(len(lens))) and not len(plan.queue_out)
    assert (plan.frag_start == 0).all() and (plan.frag_end == np.asarray(lens)[plan.frag_doc]).all()
    check_execution(c)


# ------------------------------------------------------------------------------------------------ gds

@settings(max_examples=25)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=30))
def test_skrull_cost_is_the_step_cost_model(lens):
    """c1·s + c2·s² prices a document as the step's cost model does, up to the mask's diagonal: exactly for a
    one-document batch, and within s·c2 (the diagonal's s/2 pairs) for every document of a causal batch."""
    p = problem(lens, 1, 1, 1)
    c1, c2 = skrull_coefficients(p)
    s = p.seqlens.astype(float)
    exact = doc_seconds(p)
    r, L = rates(p), p.model.layers
    fl, fa = work_factors(p)
    assert c1 == pytest.approx(L * fl * r["lin"] + (1 + LINEAR_BWD_FACTOR) * r["head"], rel=1e-12)
    pair = L * fa * r["pair"]
    assert c2 == pytest.approx(pair * p.pairs.sum() / (s ** 2).sum(), rel=1e-12)
    assert np.all(np.abs(c1 * s + c2 * s ** 2 - exact) <= pair * s / 2 * (1 + 1e-9))
    one = problem(lens[:1], 1, 1, 1)
    a1, a2 = skrull_coefficients(one)
    assert a1 * lens[0] + a2 * lens[0] ** 2 == pytest.approx(float(doc_seconds(one)[0]), rel=1e-12)


def test_skrull_linear_term_where_the_shapes_agree():
    """For GPT-7B (MHA, GELU MLP of 4h) the per-layer linear FLOPs of c1 are Skrull's 20h² + 4h·h_kv."""
    p = make_problem([1000, 2000], model="gpt-7b", mesh=Mesh(1, 1), profile="h100")
    c1, _ = skrull_coefficients(p)
    fl, _ = work_factors(p)
    m = p.model
    per_layer = (c1 - (1 + LINEAR_BWD_FACTOR) * rates(p)["head"]) * p.profile.flops / (m.layers * fl)
    assert per_layer == pytest.approx(skrull_linear_flops(m), rel=1e-9)
    assert linear_flops(m) == skrull_linear_flops(m)


@settings(max_examples=30)
@given(st.lists(st.floats(0.01, 1e6), min_size=1, max_size=60), st.integers(1, 8))
def test_lpt_is_within_grahams_bound(cost, bins):
    cost = np.asarray(cost)
    where = lpt(np.lexsort((np.arange(len(cost)), -cost)), cost, bins)
    load = np.bincount(where, weights=cost, minlength=bins)
    assert (where >= 0).all() and load.max() <= cost.sum() / bins + cost.max() * (1 + 1e-12)


@settings(max_examples=30)
@given(st.lists(st.integers(1, 100), min_size=1, max_size=40), st.integers(1, 6), st.integers(100, 400))
def test_interleave_spreads_the_long_documents_under_the_cap(lens, micro, cap):
    lens = np.asarray(lens)
    docs = np.arange(len(lens), dtype=np.int64)
    cut = interleave(docs, lens, micro, cap)
    if cut is None:
        return
    assert sorted(np.concatenate(cut).tolist()) == docs.tolist()
    assert all(lens[d].sum() <= cap for d in cut) and len(cut) <= micro
    # the longest documents (as many as there are micro-batches) open one micro-batch each
    longest = np.lexsort((docs, -lens))[:len(cut)]
    holder = {int(d): j for j, ds in enumerate(cut) for d in ds.tolist()}
    assert len({holder[int(d)] for d in longest}) == len(longest)
    # every micro-batch gets work: the fewest-tokens rule leaves no micro-batch behind by more than a document
    held = [int(lens[d].sum()) for d in cut]
    if len(cut) == micro:
        assert max(held) - min(held) <= lens.max()


@settings(max_examples=20)
@given(st.lists(st.integers(1, 400), min_size=2, max_size=40), st.sampled_from([(2, 2, 4), (4, 1, 4), (2, 1, 2)]),
       st.integers(400, 1200))
def test_gds_balances_replicas_and_respects_its_token_bound(lens, mesh, cap):
    dp, cp, per_node = mesh
    p = problem(lens, dp, cp, per_node)
    c = compile_step(p, Gds(max_tokens=cap))
    plan = c.plan
    assert (plan.mb_tokens() <= cap).all()
    assert set(plan.mb_strategy) == {"dacp"}
    c1, c2 = skrull_coefficients(p)
    cost = c1 * p.seqlens + c2 * p.seqlens.astype(float) ** 2
    per = np.zeros(dp)
    tokens = np.zeros(dp, np.int64)
    counts = np.zeros(dp, np.int64)
    for m in range(plan.n_mb):
        r = replica_of(plan, m)
        docs = plan.frag_doc[plan.frag_mb == m]
        per[r] += cost[docs].sum()
        tokens[r] += p.seqlens[docs].sum()
        counts[r] += 1
        assert plan.mb_slot[m] < counts[r]  # slots 0, 1, ... per replica
    assert per.max() <= cost.sum() / dp + cost.max() * (1 + 1e-12)  # LPT across replicas
    for r in range(dp):  # the fewest micro-batches that fit, counted up from the token bound
        mbs = [m for m in range(plan.n_mb) if replica_of(plan, m) == r]
        if len(mbs) > max(1, -(-int(tokens[r]) // cap)):
            mine = np.sort(plan.frag_doc[np.isin(plan.frag_mb, mbs)])
            assert interleave(mine, p.seqlens, len(mbs) - 1, cap) is None


def test_gds_default_bound_leaves_dacp_its_slack():
    p = problem([40, 7, 300, 22, 5, 180, 90, 61], 2, 2, 4)
    plan = compile_step(p, Gds()).plan
    bound = int(tokens_per_device(p) * 2 / default_slack(1))  # a CP group of 2 in one node: slack 1.1
    assert default_slack(1) == 1.1 and default_slack(2) == 2.0
    assert plan.info_dict()["max_tokens"] == bound and (plan.mb_tokens() <= bound).all()


def test_gds_beats_fixed_when_data_order_groups_the_long_documents():
    lens = [1500, 1400, 1300, 1200] + [100] * 52
    p = problem(lens, 4, 1, 4, model=Model("t2", 2, 256, 4, 4, 64, 512, 256))
    fixed = compile_step(p, "fixed").report
    gds = compile_step(p, Gds()).report
    assert gds["dp_imbalance"] < fixed["dp_imbalance"] and gds["step_s"] < fixed["step_s"]


def test_gds_a_document_no_group_can_hold_is_one_line():
    p = make_problem([10 ** 6, 100], model="llama3-8b", mesh=Mesh(1, 2))
    with pytest.raises(StepError, match=r"^gds: document 0 \(1,000,000 tokens\) does not fit[^\n]*$"):
        compile_step(p, Gds())


# ------------------------------------------------------------------------------------------------ vrsp

@settings(max_examples=25)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=40), st.sampled_from([1, 2, 4]), st.integers(1, 3),
       st.sampled_from([0, 300, 450]))
def test_vrsp_keeps_fixeds_packing(lens, dp, micro, context):
    p = problem(lens, dp, 1, 4)
    fixed = Fixed(context=context, micro=micro).apply(p)
    plan = Vrsp(context=context, micro=micro, inner="zigzag").apply(p)
    seqs, ctx = fixed_packing(p, context, micro, "vrsp")
    packed = {tuple(d.tolist()) for d in seqs}
    assert packed == {tuple(fixed.frag_doc[fixed.frag_mb == m].tolist()) for m in range(fixed.n_mb)}
    assert ctx == fixed.info_dict()["context"] == plan.info_dict()["context"]
    # every micro-batch of a pool of one replica is one of fixed's packed sequences, whole
    assert {tuple(plan.frag_doc[plan.frag_mb == m].tolist()) for m in range(plan.n_mb)} == packed


def test_vrsp_keeps_a_given_packing():
    p = problem([5, 6, 7, 8, 9, 3], 2, 1, 2, packing=[2, 0, 1, 0, 2, 1])
    plan = Vrsp().apply(p)
    assert sorted(tuple(sorted(plan.frag_doc[plan.frag_mb == m].tolist())) for m in range(plan.n_mb)) == \
        [(0, 4), (1, 3), (2, 5)]


@settings(max_examples=40)
@given(st.lists(st.floats(0.01, 1e4), min_size=1, max_size=40), st.integers(1, 6), st.integers(1, 5))
def test_lpt_pools_fill_quotas_within_grahams_bound(work, pools, quota):
    work = np.asarray(work)
    if pools * quota < len(work):
        with pytest.raises(StepError):
            lpt_pools(work, pools, quota)
        return
    where = lpt_pools(work, pools, quota)
    assert (np.bincount(where, minlength=pools) <= quota).all()
    load = np.bincount(where, weights=work, minlength=pools)
    assert load.max() <= work.sum() / pools + work.max() * (1 + 1e-12)


def test_vrsp_pairs_heavy_with_light_sequences_across_pools():
    """Data order puts the two heavy packed sequences on the first two replicas (one pool of fixed order);
    VRSP puts one heavy and one light sequence in each pool of two replicas. (Sequences of tens of thousands
    of tokens: at a few hundred the attention is microseconds and message latency, not work, decides.)"""
    lens = [25600, 25600] + [3200] * 8
    p = problem(lens, 4, 1, 4, packing=[0, 1, 2, 2, 2, 2, 3, 3, 3, 3], block_size=512)
    plan = compile_step(p, "fixed").plan
    c = compile_step(p, Vrsp(pool=2))
    v = c.plan
    assert v.n_groups == 2 and [len(v.group(g)) for g in range(2)] == [2, 2]
    for g in range(2):
        docs = np.concatenate([v.frag_doc[v.frag_mb == m] for m in range(v.n_mb) if v.mb_group[m] == g])
        assert sorted(p.seqlens[docs].tolist()).count(25600) == 1
    assert set(v.mb_strategy) == {"tile_pool"}
    assert v.info_dict()["pool_load_ratio"] < 1.05
    assert c.report["dp_imbalance"] < compile_step(p, "fixed").report["dp_imbalance"]
    assert plan.n_groups == 4


@settings(max_examples=15)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=30), st.sampled_from([(2, 2, 4), (4, 1, 4), (1, 2, 2)]),
       st.integers(1, 3))
def test_vrsp_without_placement_in_pools_of_one_is_fixed(lens, mesh, micro):
    """``place=data`` deals fixed's sequences as fixed does: with pools of one replica and fixed's inner
    strategy it is the same plan (micro-batches, ranks, slots) and the same step."""
    dp, cp, per_node = mesh
    p = problem(lens, dp, cp, per_node)
    a = compile_step(p, Fixed(micro=micro))
    b = compile_step(p, Vrsp(micro=micro, inner="zigzag", place="data"))
    key = [(tuple(a.plan.frag_doc[a.plan.frag_mb == m].tolist()), tuple(a.plan.mb_ranks(m).tolist()),
            int(a.plan.mb_slot[m])) for m in range(a.plan.n_mb)]
    assert sorted(key) == sorted((tuple(b.plan.frag_doc[b.plan.frag_mb == m].tolist()),
                                  tuple(b.plan.mb_ranks(m).tolist()), int(b.plan.mb_slot[m]))
                                 for m in range(b.plan.n_mb))
    assert b.report["step_s"] == pytest.approx(a.report["step_s"], rel=1e-12)


def test_vrsp_slots_hold_sequences_of_similar_work():
    """Inside a pool, the heaviest P sequences share the first slot, the next P the second."""
    lens = [300, 20, 20, 20, 200, 20, 20, 20, 100, 20, 20, 20, 10, 10, 10, 10]
    p = problem(lens, 2, 1, 2, packing=[0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3])
    v = Vrsp(pool=2, inner="zigzag").apply(p)
    assert v.n_mb == 2 and v.n_groups == 1
    first = sorted(p.seqlens[v.frag_doc[v.frag_mb == int(np.argmin(v.mb_slot))]].tolist())
    assert first == sorted([300, 20, 20, 20, 200, 20, 20, 20])


def test_registered_and_parsed():
    assert {"gds", "vrsp"} <= set(system_names())
    assert parse_system("vrsp{pool=4,inner=zigzag}") == Vrsp(pool=4, inner="zigzag")
    assert parse_system("gds{micro=3}").spec() == "gds{micro=3,max_tokens=0,inner=dacp}"


def test_vrsp_options_are_checked():
    with pytest.raises(StepError, match="must divide dp=3"):
        compile_step(problem([5, 6, 7], 3, 1, 3), Vrsp(pool=2))
    with pytest.raises(StepError, match="longer than the context length 5"):
        compile_step(problem([5, 6, 7], 1, 1, 1), Vrsp(context=5))
    with pytest.raises(StepError, match="place must be one of lpt, data"):
        parse_system("vrsp{place=random}")
    with pytest.raises(StepError, match="pool must be an integer"):
        Vrsp(pool=0)
    with pytest.raises(StepError, match="inner must be auto or one of"):
        Vrsp(inner="adaptive")
    with pytest.raises(StepError, match="inner must be auto or one of"):
        Gds(inner="warp")
    p = make_problem([10 ** 6, 100], model="llama3-8b", mesh=Mesh(1, 2))
    with pytest.raises(StepError, match=r"^vrsp: document 0 \(1,000,000 tokens\) does not fit[^\n]*$"):
        compile_step(p, Vrsp())
