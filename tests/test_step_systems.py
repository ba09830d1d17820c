"""The batch passes (issue 10, items 4 and 6): random global batches × every
system × small meshes — the fragments partition the batch, and executing the
micro-batches' attention plans equals dense attention per document; each
system's own rules (fixed's packing, WLB-LLM's greedy and outlier queue, the
pool); the registry; ``plan step compare``."""

import dataclasses
import json
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnplan.cli import main
from attnplan.errors import StepError
from attnplan.step import (BUILTIN, Mesh, Model, StepPass, build_plan, compile_step, make_problem, parse_system,
                           register_system, system_names, unregister_system)
from attnplan.step.lower import next_problem
from attnplan.step.simulate import doc_seconds
from attnplan.step.systems.common import greedy_fill, tokens_per_device
from attnplan.step.systems.fixed import next_fit, smallest_context

TINY = Model("tiny", 2, 64, 4, 2, 8, 128, 256)
MESHES = [(1, 1, 1), (1, 2, 2), (2, 1, 2), (2, 2, 4), (1, 4, 4), (2, 2, 2), (4, 2, 4)]  # dp, cp, devices a node


def problem(lens, dp, cp, per_node, **kw):
    return make_problem(lens, model=kw.pop("model", TINY), mesh=Mesh(dp, cp, devices_per_node=per_node, **kw),
                        block_size=kw.pop("block_size", 8), profile="h100")


def _load_cases():
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("_step_cases", Path(__file__).with_name("_step_cases.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_cases = _load_cases()
dense_causal, check_execution = _cases.dense_causal, _cases.check_execution


@st.composite
def global_batches(draw):
    lens = draw(st.lists(st.one_of(st.integers(1, 12), st.integers(13, 90)), min_size=1, max_size=12))
    return lens, draw(st.sampled_from(MESHES))


@settings(max_examples=40)
@given(global_batches(), st.sampled_from(sorted(BUILTIN)))
def test_every_system_partitions_the_batch_and_computes_dense_attention(case, system):
    """Random global batches × every built-in system × small meshes: the fragments partition the batch
    and every micro-batch's attention plan computes dense causal attention of its documents."""
    lens, (dp, cp, per_node) = case
    c = compile_step(problem(lens, dp, cp, per_node), system)
    plan = c.plan
    # the fragments partition the batch: every token once (nothing queued by default); every document
    # whole unless the plan cuts documents into chunks that carry their KV (chunkflow)
    covered = np.zeros(len(lens), np.int64)
    np.add.at(covered, plan.frag_doc, plan.frag_len)
    assert covered.tolist() == list(lens) and not len(plan.queue_out)
    if plan.chunk_keep == 0:
        assert sorted(plan.frag_doc.tolist()) == list(range(len(lens)))
        assert (plan.frag_start == 0).all() and (plan.frag_end == np.asarray(lens)[plan.frag_doc]).all()
    check_execution(c)


@settings(max_examples=20)
@given(st.lists(st.integers(1, 500), min_size=1, max_size=40), st.integers(1, 8))
def test_fixed_context_is_the_smallest_that_packs(lens, sequences):
    lens = np.asarray(lens)
    ctx = smallest_context(lens, sequences)
    starts = next_fit(lens, ctx, sequences)
    assert starts is not None and ctx >= lens.max()
    sizes = np.add.reduceat(lens, starts)
    assert (sizes <= ctx).all()
    if ctx > lens.max():
        assert next_fit(lens, ctx - 1, sequences) is None


def test_fixed_deals_data_order_sequences_in_order():
    lens = [30, 10, 50, 5, 5, 40, 20, 60, 1]
    plan = compile_step(problem(lens, 2, 2, 4), "fixed{micro=2}").plan
    assert plan.frag_doc.tolist() == list(range(len(lens)))  # data order, sequence after sequence
    ctx = plan.info_dict()["context"]
    assert max(plan.mb_tokens()) <= ctx and plan.n_mb <= 4
    for m in range(plan.n_mb):
        assert plan.mb_ranks(m).tolist() == [2 * (m % 2), 2 * (m % 2) + 1] and plan.mb_slot[m] == m // 2
    assert set(plan.mb_strategy) == {"zigzag"}
    with pytest.raises(StepError, match="longer than the context length 40"):
        compile_step(problem(lens, 2, 2, 4), "fixed{context=40}")


def test_fixed_keeps_a_given_packing():
    p = make_problem([5, 6, 7, 8], model=TINY, mesh=Mesh(2, 1, devices_per_node=2), packing=[1, 0, 1, 0])
    plan = compile_step(p, "fixed").plan
    assert [sorted(plan.frag_doc[plan.frag_mb == m].tolist()) for m in range(2)] == [[1, 3], [0, 2]]


@settings(max_examples=30)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=60), st.integers(1, 6))
def test_greedy_is_within_grahams_bound(sizes, bins):
    """Without a binding cap the greedy is LPT: no bin exceeds the mean plus the largest item."""
    size = np.asarray(sizes)
    work = size.astype(float) ** 1.5
    order = np.lexsort((np.arange(len(size)), -size))
    where = greedy_fill(order, size, work, bins, cap=10 ** 12)
    assert (where >= 0).all()
    load = np.bincount(where, weights=work, minlength=bins)
    assert load.max() <= work.sum() / bins + work.max() + 1e-9


@settings(max_examples=15)
@given(st.lists(st.integers(1, 400), min_size=2, max_size=30), st.sampled_from([(2, 2, 4), (4, 1, 4), (2, 1, 2)]))
def test_wlb_balances_work_under_its_token_bound(lens, mesh):
    dp, cp, per_node = mesh
    p = problem(lens, dp, cp, per_node)
    c = compile_step(p, "wlb{max_tokens=600}")
    plan = c.plan
    assert (plan.mb_tokens() <= 600).all()
    work = doc_seconds(p)
    per_replica = np.zeros(dp)
    for m in range(plan.n_mb):
        per_replica[plan.mb_ranks(m)[0] // cp] += work[plan.frag_doc[plan.frag_mb == m]].sum()
    if plan.info_dict()["micro_batches"] == dp:  # one micro-batch a replica, the cap never bound: Graham's bound
        if (plan.mb_tokens() + max(lens) <= 600).all():
            assert per_replica.max() <= work.sum() / dp + work.max() + 1e-12


def test_wlb_beats_fixed_when_data_order_groups_the_long_documents():
    """Data order puts the long documents into the first packed sequence; WLB-LLM spreads them."""
    lens = [1500, 1400, 1300, 1200] + [100] * 52
    p = problem(lens, 4, 1, 4, model=Model("t2", 2, 256, 4, 4, 64, 512, 256))
    fixed, wlb = (compile_step(p, s).report for s in ("fixed", "wlb"))
    assert wlb["dp_imbalance"] < fixed["dp_imbalance"]
    assert wlb["step_s"] < fixed["step_s"]


def test_wlb_outlier_queue_is_fifo_and_conserves_documents():
    """Outliers wait in the queue until there is one for every micro-batch; over a run of steps every
    document is computed exactly once, outliers in their arrival order."""
    system = "wlb{outlier=0.5,max_tokens=400,micro=1}"
    batches = [[300, 20, 30], [250, 40], [10, 260, 15], [5, 5], [330, 8]]
    p = problem(batches[0], 2, 1, 2)
    computed, released = [], []
    plan = None
    for lens in batches:
        if plan is not None:
            p = next_problem(plan, lens)
        plan = compile_step(p, system).plan
        q = set(plan.queue_out.tolist())
        assert all(p.seqlens[d] >= 200 for d in q)  # only outliers wait
        for d in plan.frag_doc.tolist():
            computed.append(tuple(p.origin[d]))
            if p.seqlens[d] >= 200:
                released.append(tuple(p.origin[d]))
        out_per_mb = [int((p.seqlens[plan.frag_doc[plan.frag_mb == m]] >= 200).sum()) for m in range(plan.n_mb)]
        assert max(out_per_mb, default=0) <= 1  # at most one outlier a micro-batch
    left = [tuple(p.origin[d]) for d in plan.queue_out.tolist()]
    every = [(s, i) for s, lens in enumerate(batches) for i in range(len(lens))]
    assert sorted(computed + left) == every  # each document once: computed or still queued
    arrivals = [(s, i) for s, i in every if batches[s][i] >= 200]
    assert released + left == arrivals  # FIFO


def test_pool_uses_the_whole_grid():
    c = compile_step(problem([50, 30, 7, 90], 2, 2, 4), "pool")
    assert c.plan.n_groups == 1 and c.plan.group(0).tolist() == [0, 1, 2, 3]
    assert set(c.plan.mb_strategy) <= {"minheap", "hypergraph"}
    small = problem([50, 30, 7, 90], 2, 2, 4)
    cap = tokens_per_device(small) * 4
    assert c.plan.n_mb == max(1, -(-small.tokens // cap))


def test_a_document_no_group_can_hold_is_one_line():
    p = make_problem([10 ** 6, 100], model="llama3-8b", mesh=Mesh(1, 2))
    for s in ("fixed", "wlb", "pool"):
        with pytest.raises(StepError, match=r"document 0 \(1,000,000 tokens\) does not fit"):
            compile_step(p, s)


def test_registry_takes_a_new_system():
    @dataclass(frozen=True, slots=True)
    class OneGroup(StepPass):
        name = "one_group_test"
        strategy: str = "minheap"

        def apply(self, problem):
            ranks = list(range(problem.mesh.stage_devices))
            return build_plan(problem, self.spec(), [list(range(problem.docs))], [ranks], [0], [self.strategy])

    register_system(OneGroup)
    try:
        assert "one_group_test" in system_names()
        c = compile_step(problem([20, 30], 1, 2, 2), "one_group_test{strategy=zigzag}")
        assert c.plan.mb_strategy == ("zigzag",) and c.report["micro_batches"] == 1
        check_execution(c)
    finally:
        unregister_system("one_group_test")
    assert "one_group_test" not in system_names()
    with pytest.raises(StepError, match="built-in system"):
        register_system(type("Fake", (BUILTIN["wlb"],), {}))
    with pytest.raises(StepError, match="built-in"):
        unregister_system("fixed")


@pytest.mark.parametrize("spec,match", [("nope", "unknown system"), ("wlb{micro=x}", "micro must be int"),
                                        ("wlb{inner=warp}", "inner must be"), ("pool{mikro=1}", "unknown option"),
                                        ("fixed{micro=0}", "micro must be an integer"),
                                        ("wlb{outlier=2}", "outlier must be in"), ("wlb{micro=1", "expected name"),
                                        ("wlb{", "expected name"), ("fixed{", "expected name"),
                                        ("wlb{,}", "empty option"), ("wlb{micro=2,,inner=auto}", "empty option"),
                                        ("wlb{micro=2,micro=3}", "given twice")])
def test_bad_system_text(spec, match):
    with pytest.raises(StepError, match=match):
        parse_system(spec)


def test_chunkflow_refuses_more_chunks_than_it_can_plan_in_bounded_time():
    """A chunk so small that one replica would run more than MAX_CHUNKS chunks is refused at once, naming a
    chunk that would do; one just above it plans."""
    from attnplan.step.systems.chunkflow import MAX_CHUNKS
    p = make_problem([6000, 3000, 900], model="qwen2.5-0.5b", mesh=Mesh(2, 4))
    with pytest.raises(StepError, match=f"over {MAX_CHUNKS:,}; give a larger chunkflow") as e:
        compile_step(p, "chunkflow{chunk=1}")
    need = int(str(e.value).split("at least ")[1].split(" ")[0].replace(",", ""))
    assert need > 1
    plan = compile_step(p, f"chunkflow{{chunk={need + 16}}}").plan
    assert np.bincount(plan.mb_group).max() <= MAX_CHUNKS


def test_pool_with_too_few_micro_batches_names_the_count_it_needs():
    """pool{micro=N} with fewer micro-batches than the step's tokens need says how many it needs (not a
    document that happened to be placed last); with enough it plans."""
    p = make_problem([4096] * 128, model="llama3-8b", mesh=Mesh(4, 8, memory_cap=40 << 30))
    with pytest.raises(StepError, match=r"524,288 tokens do not fit in 2 micro-batches of at most [\d,]+ tokens; "
                                        r"give at least (\d+)") as e:
        compile_step(p, "pool{micro=2}")
    need = int(str(e.value).split("give at least ")[1].split(" ")[0])
    assert need > 2 and compile_step(p, f"pool{{micro={need}}}").plan.n_mb == need


def test_cli_compare(capsys):
    assert main(["step", "compare", "--seqlens", "9000,300,200,4000,100,2500", "--mesh", "dp=2,cp=2",
                 "--model", "qwen2.5-0.5b", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["system"]: r for r in out["rows"]}
    assert set(rows) == set(system_names()) and out["tokens"] == 16100
    for r in rows.values():
        assert r["step_over_lower_bound"] >= 1.0 and r["peak_memory_bytes"] <= r["memory_cap_bytes"]
        assert r["speedup_vs_fixed"] == pytest.approx(rows["fixed"]["step_s"] / r["step_s"])
    assert main(["step", "compare", "--seqlens", "9000,300", "--mesh", "dp=2,cp=2", "--systems", "fixed,wlb{micro=2}",
                 "--model", "qwen2.5-0.5b"]) == 0
    text = capsys.readouterr().out
    assert "wlb{micro=2}" in text and "fixed" in text and "step/LB" in text


@pytest.mark.parametrize("argv,match", [
    (["--mesh", "dp=2"], "give both dp and cp"), (["--mesh", "dp=2,cp=2", "--systems", "warp"], "unknown system"),
    (["--mesh", "dp=2,cp=2", "--model", "gpt-9"], "unknown model"),
    (["--mesh", "dp=2,cp=2", "--nodes", "3"], "do not split evenly"),
    (["--mesh", "dp=2,cp=2", "--memory", "0"], "positive number of GiB")])
def test_cli_errors_are_one_line(capsys, argv, match):
    try:
        code = main(["step", "compare", "--seqlens", "100,200", *argv])
    except SystemExit as e:  # argparse's own checks exit with 2 as well
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and match in err and err.count("\n") == 1


def test_cli_says_when_the_mesh_cannot_hold_a_document(capsys):
    assert main(["step", "compare", "--seqlens", "500000,100", "--mesh", "dp=1,cp=2"]) == 0
    out = capsys.readouterr().out.splitlines()
    from attnplan.step import system_names
    # chunkflow cuts the document into chunks, but its KV (the state store) alone is over the cap
    assert sum("does not fit" in line and "document 0" in line for line in out) == len(system_names()) - 1
    assert any(line.startswith("chunkflow") and "over its cap" in line for line in out)


def test_auto_picks_the_fastest_attention_plan_of_every_micro_batch():
    """``auto`` lowers strategies best bound first and stops when no bound can win: whatever it skipped
    is no faster than what it kept (a bound never exceeds the simulated time)."""
    from attnplan.errors import PlanError
    from attnplan.passes import strategies
    from attnplan.step.lower import cache_of, group_nodes, heads_of
    p = problem([70, 9, 33, 4, 51, 18, 2, 60], 2, 2, 4)
    c = compile_step(p, "fixed{strategy=auto}")
    cache = cache_of(p)
    for m, low in enumerate(c.lowered):
        ranks = c.plan.mb_ranks(m)
        for s in strategies():
            try:
                other = cache.get(c.plan.mb_seqlens(m), len(ranks), group_nodes(p.mesh, ranks), s, heads_of(p))
            except PlanError:
                continue
            assert low.predicted_s <= other.predicted_s * (1 + 1e-12)
            assert cache.bound(c.plan.mb_seqlens(m), len(ranks), group_nodes(p.mesh, ranks), s, heads_of(p)) \
                <= other.predicted_s * (1 + 1e-12)
    with pytest.raises(StepError, match="strategy must be auto or one of"):
        parse_system("fixed{strategy=warp}")


# ------------------------------------------------------------------ a strategy its group cannot lower

@dataclass(frozen=True, slots=True)
class _Ulysses3(StepPass):
    """Every document on one group of 3 ranks with ``ulysses``, which cannot split 4 query heads 3 ways."""
    name = "_ulysses3"

    def apply(self, problem):
        return build_plan(problem, self.spec(), [list(range(problem.docs))], [[0, 1, 2]], [0], ["ulysses"])


def test_pool_with_an_inner_strategy_its_pool_cannot_lower_gives_way_too():
    """pool checks its micro-batches' plans against the cap; a named ``inner`` that cannot lower on the pool
    (ulysses, 4 query heads over 3 devices) still takes the shared fallback rather than refusing the step."""
    c = compile_step(problem([40, 30, 9, 70], 1, 3, 3), "pool{inner=ulysses}")
    assert c.plan.mb_strategy[0] != "ulysses" and "ulysses cannot run on its 3 devices" in c.plan.info_dict()[
        "fallback"]


def test_a_strategy_its_group_cannot_lower_gives_way_and_the_table_says_so():
    from attnplan.step.compare import compare_systems, format_rows
    p = problem([40, 30, 9, 70], 1, 3, 3)
    c = compile_step(p, _Ulysses3())
    assert c.plan.mb_strategy[0] != "ulysses" and c.lowered[0].strategy == c.plan.mb_strategy[0]
    note = c.plan.info_dict()["fallback"]
    assert "ulysses cannot run on its 3 devices" in note and f"{c.plan.mb_strategy[0]} instead" in note
    check_execution(c)  # what runs instead still computes every document's dense attention
    register_system(_Ulysses3)
    try:
        rows, _ = compare_systems(p, ["_ulysses3", "fixed"])
    finally:
        unregister_system("_ulysses3")
    text = format_rows(rows, p.mesh)
    assert "_ulysses3*" in text and "* _ulysses3: micro-batch 0: ulysses cannot run" in text


def test_the_fallback_takes_the_fastest_plan_that_fits_the_memory_cap():
    """``AttentionCache.auto(fits=...)``: where the fastest plan is refused, the next fastest that the
    predicate accepts (never a faster one); where every one is refused, the last one tried. And
    ``fits_alone`` refuses a plan exactly when one device of its group, with that micro-batch alone, is
    over the cap: with the cap just below the fastest plan's busiest device, the fallback of a group
    that cannot run ``ulysses`` takes another strategy, whose devices all fit."""
    from attnplan.step.lower import cache_of, fits_alone, heads_of, lower_or_fall_back
    from attnplan.step.model import activation_bytes, static_bytes
    p = problem([40, 30, 9, 70], 1, 3, 3)
    cache, lens = cache_of(p), (40, 30, 9, 70)
    best = cache.auto(lens, 3, 1, heads_of(p))
    other = cache.auto(lens, 3, 1, heads_of(p), fits=lambda low: low.strategy != best.strategy)
    assert other.strategy != best.strategy and other.predicted_s >= best.predicted_s
    assert cache.auto(lens, 3, 1, heads_of(p), fits=lambda low: False) is not None

    def need(low):  # the busiest device's bytes with this micro-batch alone
        act = activation_bytes(p.model, low.tokens, p.mesh.recompute, low.buffers)
        return int(max(act)) + static_bytes(p.model, p.mesh.stage_devices) + p.mesh.reserve
    plan = _Ulysses3().apply(p)
    first = lower_or_fall_back(plan)[1][0]  # the fastest that can run
    tight = dataclasses.replace(p, mesh=dataclasses.replace(p.mesh, memory_cap=need(first) - 1))
    assert not fits_alone(tight)(first) and fits_alone(p)(first)
    fitting = [low for low in (cache_of(tight).get(lens, 3, 1, s, heads_of(p)) for s in ("per_doc", "minheap", "zigzag"))
               if need(low) <= tight.cap]
    assert fitting  # some strategy holds fewer bytes on its busiest device: the fallback takes one of those
    plan2, lowered = lower_or_fall_back(_Ulysses3().apply(tight))
    assert lowered[0].strategy != first.strategy and need(lowered[0]) <= tight.cap
    assert f"{lowered[0].strategy} instead" in plan2.info_dict()["fallback"]


def test_a_group_too_small_for_a_document_names_a_way_forward():
    from attnplan.step.compare import way_forward
    mesh = Mesh(8, 4, devices_per_node=8)
    e1 = "fixed: document 0 (436,664 tokens) does not fit a group of 4 devices of 80 GiB (186,888 tokens at most)"
    e2 = ("gds: document 0 (436,664 tokens) does not fit a micro-batch of at most 169,898 tokens (a CP group of 4 "
          "devices of 80 GiB, DACP's slack 1.1)")
    assert way_forward(e1, mesh, ["pool", "dyncp"]) == "needs cp >= 10: try pool, dyncp, --mesh dp=2,cp=16"
    assert way_forward(e2, mesh, []).startswith("needs cp >= 11: try --mesh dp=2,cp=16")
    assert way_forward("flexsp: something else", mesh, ["pool"]) is None
    over = "device 0 needs 87.6 GiB in micro-batch 2 (1,435,211 tokens on 32 devices), over its cap of 80.0 GiB"
    assert way_forward(over, mesh, ["dyncp", "flexsp"]) == "try dyncp, flexsp"
    assert "more than the 32 devices" in way_forward(e1.replace("436,664", "9,000,000"), mesh, [])


@st.composite
def batches_with_a_giant(draw):
    """A long-tailed mix plus one document of 25-50% of the batch, somewhere in it."""
    rest = draw(st.lists(st.integers(1, 40), min_size=3, max_size=12))
    share = draw(st.floats(0.25, 0.5))
    giant = max(1, int(round(sum(rest) * share / (1 - share))))
    lens = list(rest)
    lens.insert(draw(st.integers(0, len(rest))), giant)
    return lens, draw(st.sampled_from(MESHES))


@settings(max_examples=30)
@given(batches_with_a_giant(), st.sampled_from(sorted(BUILTIN)))
def test_every_system_plans_a_batch_with_one_giant_document_or_says_why(case, system):
    """Every system either plans (the fragments partition the batch, every micro-batch computes dense
    attention) or refuses with its one-line reason: a document its groups cannot hold."""
    lens, (dp, cp, per_node) = case
    p = problem(lens, dp, cp, per_node, memory_cap=1 << 40)
    try:
        c = compile_step(p, system)
    except StepError as e:
        assert "does not fit" in str(e) and "\n" not in str(e), str(e)
        return
    plan = c.plan
    covered = np.zeros(len(lens), np.int64)
    np.add.at(covered, plan.frag_doc, plan.frag_len)
    assert covered.tolist() == list(lens) and not len(plan.queue_out)
    assert plan.chunk_keep >= 1 or sorted(plan.frag_doc.tolist()) == list(range(len(lens)))
    check_execution(c)
