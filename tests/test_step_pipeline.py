"""Pipelines in the step plan and ChunkFlow: meshes with pp and vp, the
schedules (1F1B, interleaved, ChunkFlow's state-aware 1F1B) against their
closed forms, the schedule verifier, chunks of cut documents (their masks
against brute force, their attention plans executed against dense attention),
and random global batches × every system × pp ∈ {1, 2, 4}."""

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnplan.cli import main
from attnplan.errors import StepError, VerifyError
from attnplan.frontend import load_mask
from attnplan.runtime.reference import dense_allowed
from attnplan.step import BUILTIN, Mesh, Model, compile_step, make_problem, parse_mesh
from attnplan.step.lower import chunk_pieces
from attnplan.step.pipeline import B, F, Schedule, build_schedule, interleaved, one_f_one_b, verify_schedule
from attnplan.step.pipesim import bubble_ratio, timeline
from attnplan.step.systems.chunkflow import bubble_example
from attnplan.step.verify import verify_plan

from .test_step_systems import check_execution

TINY4 = Model("tiny4", 4, 64, 4, 2, 8, 128, 256)


def _problem(lens, dp, cp, pp, per_node=8, vp=1, model=TINY4, block_size=8, mask="causal"):
    return make_problem(lens, model=model, mesh=Mesh(dp, cp, pp, per_node, vp=vp), block_size=block_size,
                        profile="h100", mask=mask)


def _schedule(rows, stages, vp, units, recompute=None, bwd=None) -> Schedule:
    a = np.array(rows, np.int64).reshape(-1, 3)
    per = len(a) // stages
    return Schedule("test", stages, vp, units, np.arange(stages + 1) * per, a[:, 0], a[:, 1], a[:, 2],
                    np.zeros(units, bool) if recompute is None else recompute,
                    np.arange(units) if bwd is None else bwd)


def _equal_bubble(sch: Schedule, f=1.0, b=2.0) -> float:
    fd = np.full((sch.units, sch.chunks), f)
    members, ranks = _one_each(sch.units)
    start, end = timeline(sch, members, ranks, 1, fd, fd * b / f, fd * 0, fd * 0)
    return bubble_ratio(sch, ranks, 1, start, end)[0]


def _one_each(units):
    return [np.array([u]) for u in range(units)], [np.array([0]) for _ in range(units)]


# ------------------------------------------------------------------------------------ meshes

def test_mesh_text_takes_pp_and_vp_and_splits_layers():
    m = parse_mesh("dp=2,cp=4,pp=2,vp=2")
    assert (m.pp, m.vp, m.devices, m.chunks, m.spec()) == (2, 2, 16, 4, "dp=2,cp=4,pp=2,vp=2")
    assert m.chunk_layers(10) == (3, 3, 2, 2)
    assert Mesh(1, 1, 2, stage_layers=[5, 3]).chunk_layers(8) == (5, 3)
    with pytest.raises(StepError, match="add up to 8 layers, the model has 9"):
        Mesh(1, 1, 2, stage_layers=(5, 3)).chunk_layers(9)
    with pytest.raises(StepError, match="need a pipeline"):
        Mesh(1, 1, 1, vp=2)
    with pytest.raises(StepError, match="one positive layer count per model chunk"):
        Mesh(1, 1, 2, stage_layers=(5,))
    with pytest.raises(StepError, match="cannot fill"):
        make_problem([10], model=TINY4, mesh=Mesh(1, 1, 4, vp=2))


# ------------------------------------------------------------------------------------ schedules

@settings(max_examples=40)
@given(st.integers(1, 8), st.integers(1, 20))
def test_1f1b_bubble_is_the_closed_form(stages, units):
    """Equal micro-batches under 1F1B: bubble (p - 1) / (m + p - 1) (Narayanan et al. 2021)."""
    per = one_f_one_b(units, stages, np.arange(units))
    sch = _schedule([(u, s, k) for s, ops in enumerate(per) for u, k in ops], stages, 1, units)
    assert _equal_bubble(sch) == pytest.approx((stages - 1) / (units + stages - 1), abs=1e-12)
    for s, ops in enumerate(per):  # warm-up forwards, then one forward one backward
        warm = min(stages - s - 1, units)
        assert [k for _, k in ops[:warm]] == [F] * warm and ops[warm] == (warm, F) if warm < units else True


@settings(max_examples=30)
@given(st.integers(2, 6), st.integers(2, 4), st.integers(1, 4))
def test_interleaved_bubble_is_the_closed_form(stages, vp, groups):
    """Megatron-LM's interleaved 1F1B on m = k·p equal micro-batches: bubble (p - 1) / (v·m + p - 1)."""
    units = stages * groups
    per = interleaved(units, stages, vp)
    sch = _schedule([op for ops in per for op in ops], stages, vp, units)
    assert _equal_bubble(sch) == pytest.approx((stages - 1) / (vp * units + stages - 1), abs=1e-12)
    # the survey's Dynamic-CP quota: a rank's time is W·(m·V + p − 1), W a micro-batch's F + B on one chunk
    fd = np.full((units, stages * vp), 1.0)
    members, ranks = _one_each(units)
    start, end = timeline(sch, members, ranks, 1, fd, 2 * fd, fd * 0, fd * 0)
    assert np.nanmax(end) == pytest.approx(3.0 * (units * vp + stages - 1))


def test_the_survey_figures_of_chunkflow_bubble_example():
    """4 sequences on 4 stages under 1F1B: equal lengths give 3/7 = 42.86% (the survey's 42.8%); lengths
    1, 3, 3, 8 give 4/7 = 57.14%; ChunkFlow's chunks of 3 with K = 2 give 47.83% (the paper's 47.8%)."""
    bubble = bubble_example
    assert bubble([1, 1, 1, 1], 4) == pytest.approx(3 / 7)
    assert bubble([1, 3, 3, 8], 4) == pytest.approx(4 / 7)
    assert bubble([1, 3, 3, 8], 4, chunk=3, keep=2) == pytest.approx(0.4783, abs=5e-5)
    assert bubble([1, 3, 3, 8], 4, chunk=3, keep=2) < bubble([1, 3, 3, 8], 4)


def test_the_verifier_refuses_a_broken_schedule():
    c = compile_step(_problem([40, 7, 9, 30, 5], 1, 1, 2), "chunkflow{chunk=16}")
    plan = c.plan
    sch = build_schedule(plan)
    verify_schedule(plan, sch)
    assert sch.kind == "chunkflow" and sch.recompute.any()
    # a document's chunks backward in forward order: the KV gradients would be read before they are complete
    rows = one_f_one_b(sch.units, 2, np.arange(sch.units))
    bad = _schedule([(u, s, k) for s, ops in enumerate(rows) for u, k in ops], 2, 1, sch.units, sch.recompute)
    with pytest.raises(VerifyError, match="reverse order"):
        verify_schedule(plan, bad)
    drop = dataclasses.replace(sch, op_kind=np.where(np.arange(len(sch.op_kind)) == 0, B, sch.op_kind))
    with pytest.raises(VerifyError, match="exactly once|before its forward"):
        verify_schedule(plan, drop)


def test_a_schedule_that_cannot_run_is_one_line():
    # stage 0 runs unit 1 first, stage 1 unit 0 first: each waits on the other
    sch = _schedule([(1, 0, F), (0, 0, F), (0, 0, B), (1, 0, B),
                     (0, 1, F), (0, 1, B), (1, 1, F), (1, 1, B)], 2, 1, 2)
    fd = np.ones((2, 2))
    members, ranks = _one_each(2)
    start, end = timeline(sch, members, ranks, 1, fd, fd, fd * 0, fd * 0)  # runs: stage 1 just waits
    assert np.nanmax(end) > 0
    sch = _schedule([(0, 0, B), (0, 0, F), (1, 0, F), (1, 0, B),
                     (0, 1, F), (0, 1, B), (1, 1, F), (1, 1, B)], 2, 1, 2)
    with pytest.raises(StepError, match="cannot run"):
        timeline(sch, members, ranks, 1, fd, fd, fd * 0, fd * 0)


# ------------------------------------------------------------------------------------ chunks

@settings(max_examples=40)
@given(st.integers(1, 40), st.integers(1, 30), st.sampled_from(["causal", "sliding_window(5)", "streaming(2, 6)",
                                                                 "causal & (k // 4 != q // 4 - 1)"]))
def test_a_chunks_mask_is_its_rows_of_the_document(prefix, rows, text):
    """A later chunk's cross-attention pieces are exactly rows [prefix, prefix + rows) × keys [0, end) of the
    document's mask (brute force)."""
    mask = load_mask(text)
    end = prefix + rows
    want = dense_allowed(mask.lower(end).a, end)[prefix:end, :end]
    a = chunk_pieces(mask, prefix, rows).a
    side = rows + end
    got = dense_allowed(a, side)
    assert np.array_equal(got[:rows, rows:rows + end], want)
    assert got.sum() == want.sum()


@st.composite
def pipeline_batches(draw):
    lens = draw(st.lists(st.one_of(st.integers(1, 12), st.integers(13, 90)), min_size=1, max_size=10))
    dp, cp = draw(st.sampled_from([(1, 1), (1, 2), (2, 1), (2, 2)]))
    return lens, dp, cp, draw(st.sampled_from([1, 2, 4]))


@settings(max_examples=40, deadline=None)
@given(pipeline_batches(), st.sampled_from(sorted(BUILTIN) + ["chunkflow{chunk=16}", "chunkflow{chunk=24,k=2}"]))
def test_every_system_plans_pipelines_and_chunks_equal_to_dense(case, system):
    """Random global batches × every system (ChunkFlow with small chunks too) × pp ∈ {1, 2, 4}: the plan
    verifies (fragments partition the batch, a cut document's chunks in order in later slots, carried KV
    complete), the schedule verifies and runs, and every micro-batch's attention plan — a later chunk's
    included — equals dense attention of its rows."""
    lens, dp, cp, pp = case
    c = compile_step(_problem(lens, dp, cp, pp), system)
    plan, r = c.plan, c.report
    verify_plan(plan)
    covered = np.zeros(len(lens), np.int64)
    np.add.at(covered, plan.frag_doc, plan.frag_len)
    assert covered.tolist() == list(lens)
    if pp > 1 or plan.chunk_keep:
        sch = build_schedule(plan)
        verify_schedule(plan, sch)
        assert 0.0 <= r["bubble_ratio"] < 1.0 and r["pipeline"]["stages"] == pp
        assert len(r["per_rank"]["busy_s"]) == dp * cp * pp
    if system.startswith("chunkflow{chunk=16") and max(lens) > 16:
        assert plan.chunk_keep == 1 and len(plan.frag_doc) > len(lens)
    assert r["step_s"] >= r["lower_bound_s"] > 0
    assert r["peak_memory_bytes"] <= r["memory_cap_bytes"]
    check_execution(c)


def test_chunkflow_keeps_memory_bounded_by_its_chunks():
    """One long document: chunks of C keep about K chunks' activations, not the document's."""
    lens = [60_000, 2_000, 1_000]
    mesh = Mesh(dp=1, cp=1, recompute="none", memory_cap=1 << 40)
    prob = make_problem(lens, model="qwen2.5-0.5b", mesh=mesh, block_size=2048)
    whole = compile_step(prob, "chunkflow{chunk=65536}").report
    cut = compile_step(prob, "chunkflow{chunk=8192,k=1}").report
    assert cut["info"]["documents_cut"] == 1 and whole["info"]["documents_cut"] == 0
    assert cut["peak_memory_bytes"] < 0.5 * whole["peak_memory_bytes"]


def test_chunkflow_refuses_to_cut_a_mask_that_looks_ahead():
    prob = _problem([40, 5], 1, 1, 1, mask="prefix_lm(8)")
    with pytest.raises(StepError, match="no query sees a later key"):
        compile_step(prob, "chunkflow{chunk=16}")
    assert compile_step(prob, "chunkflow{chunk=48}").plan.chunk_keep == 0


def test_interleaved_needs_a_multiple_of_pp_slots():
    prob = _problem([20, 20, 20], 1, 1, 2, vp=2)
    with pytest.raises(StepError, match="multiple of pp=2"):
        compile_step(prob, "fixed{micro=1,context=20}")
    c = compile_step(_problem([20] * 8, 1, 1, 2, vp=2), "fixed{context=20}")
    assert c.report["pipeline"]["schedule"] == "interleaved" and c.report["pipeline"]["vp"] == 2
    # three sequences of two documents: the heaviest slot is cut in two (Megatron-LM's alignment)
    c = compile_step(_problem([20, 19, 18, 17, 16, 15], 1, 1, 2, vp=2), "fixed{context=40}")
    assert c.plan.n_slots() == 4 and "aligned" in c.report["info"]
    assert sorted(c.plan.frag_doc.tolist()) == list(range(6))
    check_execution(c)


def test_cli_step_compare_and_show_a_pipeline(capsys, tmp_path):
    argv = ["step", "compare", "--seqlens", "6000,3000,900,800,700", "--model", "qwen2.5-0.5b", "--mesh",
            "dp=1,cp=2,pp=2", "--systems", "fixed,chunkflow{chunk=2048}", "--block-size", "512"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "bubble" in out.splitlines()[1] and "chunkflow" in out
    f = tmp_path / "c.step"
    assert main(["step", "compile", "--seqlens", "6000,3000,900", "--model", "qwen2.5-0.5b", "--mesh",
                 "dp=1,cp=2,pp=2", "--system", "chunkflow{chunk=2048}", "--block-size", "512", "-o", str(f)]) == 0
    capsys.readouterr()
    assert main(["step", "show", str(f)]) == 0
    shown = capsys.readouterr().out
    assert "schedule chunkflow: 2 stages" in shown and " R" in shown
    assert main(["step", "compare", "--seqlens", "100", "--mesh", "dp=1,cp=1,pp=2", "--stage-layers", "1,x"]) == 2
    assert "--stage-layers" in capsys.readouterr().err


def test_stage_memory_counts_the_in_flight_micro_batches():
    """Under 1F1B stage 0 holds pp micro-batches' checkpoints, the last stage one: stage 0 peaks higher."""
    c = compile_step(_problem([64] * 8, 1, 1, 4, model="qwen2.5-0.5b", block_size=64), "fixed{context=64}")
    peak = c.report["per_rank"]["peak_memory_bytes"]
    assert len(peak) == 4 and peak[0] > peak[1] > peak[2]


def test_chunk_attention_gradients_reach_the_earlier_chunks():
    """The KV gradient a later chunk's plan returns covers the earlier chunks' keys (nonzero there)."""
    c = compile_step(_problem([48], 1, 2, 1), "chunkflow{chunk=16}")
    low = c.lowered[2]
    assert c.plan.mb_prefix(2) == 32
    from attnplan.runtime.executor import execute
    q = torch.randn(16, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(48, 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(48, 2, 8, dtype=torch.float64, requires_grad=True)
    execute(low.ir, q, k, v).sum().backward()
    assert k.grad[:32].abs().sum() > 0 and v.grad[:32].abs().sum() > 0
