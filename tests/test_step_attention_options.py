"""The attention options at the step level (``make_problem(...,
partials_dtype=, keep_kv=)``, ``plan step ... --partials-dtype --keep-kv``):
every micro-batch's attention plan carries them, the step file records and
checks them, and the memory a step needs counts the KV kept from each
layer's forward to its backward where nothing is recomputed."""

import dataclasses
import hashlib
import json
import zlib

import msgpack
import numpy as np
import pytest

from attnplan.cli import main
from attnplan.errors import PlanFileError, StepError
from attnplan.ir.program import B_KV, BWD, T_KIND, T_PHASE
from attnplan.step import Mesh, Model, compile_step, make_problem
from attnplan.step import stepfile as sf
from attnplan.step.model import activation_bytes, static_bytes
from attnplan.step.simulate import memory

TINY = Model("tiny", 2, 64, 4, 2, 8, 128, 256)
LENS = [700, 90, 330, 40, 510, 180, 20, 600, 120]


def _step(recompute="full", system="wlb", **opts):
    p = make_problem(LENS, model=TINY, mesh=Mesh(2, 4, devices_per_node=2, recompute=recompute), block_size=32,
                     **opts)
    return compile_step(p, system)


def _body(data: bytes) -> dict:
    return msgpack.unpackb(zlib.decompress(data[sf._HEADER.size:]), raw=False)


def _file(body: dict) -> bytes:
    raw = zlib.compress(msgpack.packb(body, use_bin_type=True))
    return sf._HEADER.pack(sf.MAGIC, sf.FORMAT_VERSION, 0, len(raw), hashlib.sha256(raw).digest()) + raw


def test_every_attention_plan_carries_the_options():
    c = _step(partials_dtype="bfloat16", keep_kv=True)
    assert (c.plan.problem.partials_dtype, c.plan.problem.keep_kv) == ("bfloat16", True)
    moved = False
    for low in c.lowered:
        assert (low.ir.problem.partials_dtype, low.ir.problem.keep_kv) == ("bfloat16", True)
        X = low.ir.program.transfers
        assert not ((X[:, T_PHASE] == BWD) & (X[:, T_KIND] == B_KV)).any()
        moved |= bool(low.kept.sum())
    assert moved  # some group splits a document: its backward keeps KV
    plain = _step()
    assert all(low.ir.problem.keep_kv is False and not low.kept.any() for low in plain.lowered)
    # the same micro-batches and groups; the attention no slower
    assert all(np.array_equal(getattr(c.plan, k), getattr(plain.plan, k)) for k in sf.PLAN_COLUMNS)
    assert c.report["step_s"] <= plain.report["step_s"] * (1 + 1e-9)


def test_step_file_round_trip_and_default():
    c = _step(partials_dtype="bfloat16", keep_kv=True)
    data = sf.pack(c)
    back = sf.unpack(data)
    assert (back.plan.problem.partials_dtype, back.plan.problem.keep_kv) == ("bfloat16", True)
    assert all(ir.problem.keep_kv for ir in back.attention)
    assert sf.pack(compile_step(back.plan.problem, "wlb")) == data
    body = _body(sf.pack(_step()))
    assert "keep_kv" not in body["problem"] and "partials_dtype" not in body["problem"]


def test_step_file_whose_plans_disagree_with_its_options_is_refused():
    """A step file that says keep_kv over attention plans compiled without
    it (or the other way) would run backwards without their kept KV."""
    body = _body(sf.pack(_step(keep_kv=True)))
    body["problem"].pop("keep_kv")
    with pytest.raises(PlanFileError, match="keep_kv"):
        sf.unpack(_file(body), "x.step")
    body = _body(sf.pack(_step()))
    body["problem"]["keep_kv"] = True
    with pytest.raises(PlanFileError, match="keep_kv"):
        sf.unpack(_file(body), "x.step")
    body["problem"]["keep_kv"] = 1
    with pytest.raises(PlanFileError, match="problem.keep_kv must be a boolean"):
        sf.unpack(_file(body), "x.step")
    body["problem"]["keep_kv"] = False
    body["problem"]["partials_dtype"] = "float16"
    with pytest.raises(PlanFileError, match="partials_dtype"):
        sf.unpack(_file(body), "x.step")


@pytest.mark.parametrize("recompute", ["full", "none"])
def test_memory_counts_kept_kv_per_layer_without_recompute(recompute):
    """Without recompute every layer holds the KV its attention kept until
    its backward: the peak grows by layers x kept bytes on each device of
    the micro-batch that sets it. Under full recompute the kept KV lives
    inside one layer's buffers (its recomputed forward to its backward)."""
    keep = _step(recompute, keep_kv=True)
    peak, which = memory(keep.plan, list(keep.lowered))
    p = keep.plan.problem
    base = static_bytes(p.model, p.mesh.stage_devices) + p.mesh.reserve
    for m, low in enumerate(keep.lowered):
        with_kept = activation_bytes(p.model, low.tokens, p.mesh.recompute, low.buffers, low.kept)
        without = activation_bytes(p.model, low.tokens, p.mesh.recompute, low.buffers)
        want = p.model.layers * low.kept if recompute == "none" else np.zeros_like(low.kept)
        assert np.array_equal(np.asarray(with_kept) - np.asarray(without), want)
        assert (peak[keep.plan.mb_ranks(m)] >= with_kept + base).all()
    assert any(low.kept.any() for low in keep.lowered)


@pytest.mark.parametrize("kw,msg", [
    (dict(partials_dtype="float16"), "partials_dtype must be float32 or the problem's dtype"),
    (dict(partials_dtype=3), "partials_dtype must be"),
    (dict(keep_kv="yes"), "keep_kv must be True or False"),
])
def test_bad_options_are_step_errors(kw, msg):
    with pytest.raises(StepError, match=msg):
        make_problem(LENS, model=TINY, mesh=Mesh(2, 2), **kw)


def test_cli_step_compile_and_compare_take_the_options(tmp_path, capsys):
    out = tmp_path / "a.step"
    args = ["--seqlens", "9000,300,200,4000,100", "--mesh", "dp=2,cp=2", "--model", "qwen2.5-0.5b"]
    assert main(["step", "compile", *args, "--system", "wlb", "--keep-kv", "--partials-dtype", "bfloat16",
                 "-o", str(out)]) == 0
    back = sf.read_file(out)
    assert back.plan.problem.keep_kv and all(ir.problem.partials_dtype == "bfloat16" for ir in back.attention)
    capsys.readouterr()
    assert main(["step", "show", str(out)]) == 0
    assert "attention: partials bfloat16, forward KV kept" in capsys.readouterr().out
    assert main(["step", "show", str(out), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["partials_dtype"], shown["keep_kv"]) == ("bfloat16", True)
    assert main(["step", "compare", *args, "--systems", "fixed,wlb", "--keep-kv"]) == 0
    text = capsys.readouterr().out
    assert "wlb" in text and "attention: forward KV kept" in text
    with pytest.raises(SystemExit) as e:
        main(["step", "compare", *args, "--partials-dtype", "fp8"])
    assert e.value.code == 2 and "--partials-dtype" in capsys.readouterr().err


def test_step_loader_options_are_checked():
    from attnplan.tools.step_loader import planning_options
    opts = planning_options(TINY, Mesh(2, 2), "wlb", partials_dtype="bfloat16", keep_kv=True)
    assert (opts["partials_dtype"], opts["keep_kv"]) == ("bfloat16", True)
    with pytest.raises(StepError, match="keep_kv must be True or False"):
        planning_options(TINY, Mesh(2, 2), "wlb", keep_kv="no")


def test_pipelines_hold_kept_kv_per_layer_in_flight():
    """On a pipeline without recompute a stage holds each in-flight
    micro-batch's kept KV for its layers: the peak grows with keep_kv."""
    def peak(**opts):
        p = make_problem(LENS * 2, model=TINY, mesh=Mesh(1, 4, pp=2, devices_per_node=2, recompute="none"),
                         block_size=32, **opts)
        c = compile_step(p, "fixed")
        return c.report["peak_memory_bytes"], max(int(low.kept.max()) for low in c.lowered)
    plain, none_kept = peak()
    keep, kept = peak(keep_kv=True)
    assert none_kept == 0 < kept
    assert keep > plain


def _capped(cap, recompute="none", mesh=None, lens=LENS, system="wlb", **opts):
    mesh = dataclasses.replace(mesh or Mesh(2, 4, devices_per_node=2, recompute=recompute), memory_cap=cap)
    return compile_step(make_problem(lens, model=TINY, mesh=mesh, block_size=32, **opts), system)


def test_kept_kv_only_where_it_fits():
    """With a cap between the peaks without and with kept KV, the micro-batches whose kept KV would exceed it
    do without (``mb_unkept``): each of those alone would put a device over the cap with it, each kept one is
    under it, and the step plans instead of being refused."""
    kept_all = _capped(1 << 40, keep_kv=True)
    plain = _capped(1 << 40)
    hi, lo = kept_all.report["peak_memory_bytes"], plain.report["peak_memory_bytes"]
    assert lo < hi and not kept_all.plan.mb_unkept
    cap = (lo + hi) // 2
    c = _capped(cap, keep_kv=True)
    p = c.plan.problem
    base = static_bytes(p.model, p.mesh.stage_devices) + p.mesh.reserve
    assert c.plan.mb_unkept and c.report["peak_memory_bytes"] <= cap
    assert c.report["mb_unkept"] == list(c.plan.mb_unkept)
    for m, low in enumerate(c.lowered):
        ranks = c.plan.mb_ranks(m)
        assert low.ir.problem.keep_kv == (m not in c.plan.mb_unkept)
        if m in c.plan.mb_unkept:  # with its kept KV it would not fit
            with_kept = kept_all.lowered[m]
            act = activation_bytes(p.model, with_kept.tokens, "none", with_kept.buffers, with_kept.kept)
            assert (np.asarray(act) + base > cap).any() and not low.kept.any()
        else:
            act = activation_bytes(p.model, low.tokens, "none", low.buffers, low.kept)
            assert (np.asarray(act) + base <= cap).all()
        assert len(ranks) == len(low.tokens)
    # the same micro-batches as the step that keeps everywhere
    assert all(np.array_equal(getattr(c.plan, k), getattr(kept_all.plan, k)) for k in sf.PLAN_COLUMNS)


def test_full_recompute_keeps_every_micro_batch():
    """Under full recompute the kept KV lives inside one layer's buffers: the same cap keeps all of it."""
    c = _capped(1 << 40, recompute="full", keep_kv=True)
    assert not c.plan.mb_unkept and all(low.ir.problem.keep_kv for low in c.lowered)


# a batch where dropping by peak-setting micro-batch (the rule before this one) dropped 6 of 8 where 1 is needed
SPREAD = [590, 392, 288, 535, 883, 127, 271, 841, 280, 621, 329, 744, 535, 809, 581, 533, 449]


@pytest.mark.parametrize("lens", [LENS * 2, SPREAD], ids=["repeated", "spread"])
@pytest.mark.parametrize("share", [0.1, 0.25, 0.5, 0.75, 0.9])
def test_pipeline_drops_kept_kv_held_in_flight(share, lens):
    """On a pipeline a stage's peak also counts the kept KV of micro-batches in flight: the rule
    (step/kept.py) drops keepers there until every stage is under a cap between the peaks with every
    micro-batch keeping and with none, and every drop is needed (keeping any one again, the others as they
    are, puts a stage over)."""
    from attnplan.step.kept import keep_where_it_fits
    from attnplan.step.lower import lower_mb
    from attnplan.step.pipeline import build_schedule
    from attnplan.step.pipesim import mb_parts, stage_memory
    c = _capped(1 << 40, keep_kv=True, mesh=Mesh(1, 4, pp=2, devices_per_node=2, recompute="none"),
                lens=lens, system="fixed")
    sch = build_schedule(c.plan)

    def peaks(plan, lowered):
        return stage_memory(plan, sch, mb_parts(plan, lowered), lowered)
    none = dataclasses.replace(c.plan, mb_unkept=tuple(range(c.plan.n_mb)))
    lo = int(peaks(none, [lower_mb(none, m) for m in range(none.n_mb)])[0].max())
    hi = int(peaks(c.plan, list(c.lowered))[0].max())
    assert lo < hi
    cap = int(lo + share * (hi - lo))
    plan, lowered, peak, _ = keep_where_it_fits(c.plan, list(c.lowered), peaks, cap)
    assert plan.mb_unkept and len(plan.mb_unkept) < plan.n_mb and peak.max() <= cap
    assert all(low.ir.problem.keep_kv == (m not in plan.mb_unkept) for m, low in enumerate(lowered))
    same = keep_where_it_fits(c.plan, list(c.lowered), peaks, hi)  # at the peak itself nothing is dropped
    assert same[0] is c.plan
    _assert_each_drop_needed(plan, lowered, peaks, cap)


def _assert_each_drop_needed(plan, lowered, peaks, cap):
    """No micro-batch planned without kept KV could keep it, the others as they are, under ``cap``."""
    from attnplan.step.lower import lower_mb
    for m in plan.mb_unkept:
        back = dataclasses.replace(plan, mb_unkept=tuple(k for k in plan.mb_unkept if k != m))
        assert peaks(back, lowered[:m] + [lower_mb(back, m)] + lowered[m + 1:])[0].max() > cap, m


def test_step_file_records_unkept_micro_batches():
    kept_all, plain = _capped(1 << 40, keep_kv=True), _capped(1 << 40)
    c = _capped((kept_all.report["peak_memory_bytes"] + plain.report["peak_memory_bytes"]) // 2, keep_kv=True)
    data = sf.pack(c)
    back = sf.unpack(data)
    assert back.plan.mb_unkept == c.plan.mb_unkept
    assert [ir.problem.keep_kv for ir in back.attention] == [low.ir.problem.keep_kv for low in c.lowered]
    assert "mb_unkept" not in _body(sf.pack(kept_all))["plan"]
    shown = sf.to_json(back)
    assert [mb["keep_kv"] for mb in shown["micro_batches"]] == [low.ir.problem.keep_kv for low in c.lowered]
    assert "forward KV not kept" in back.plan.to_text()
    body = _body(data)
    first = c.plan.mb_unkept[0]
    for bad, msg in ((c.plan.mb_unkept[1:], "keep_kv"),                      # a plan without kept KV, not listed
                     ([first, first], "ascending distinct"), ([c.plan.n_mb], "ascending distinct"),
                     (["0"], "micro-batch numbers"), ("3", "list of micro-batches")):
        body["plan"]["mb_unkept"] = list(bad) if isinstance(bad, tuple) else bad
        with pytest.raises(PlanFileError, match=msg):
            sf.unpack(_file(body), "x.step")
    body["plan"]["mb_unkept"] = list(c.plan.mb_unkept)
    body["problem"].pop("keep_kv")
    with pytest.raises(PlanFileError, match="keep_kv"):
        sf.unpack(_file(body), "x.step")


@pytest.mark.parametrize("profile", [[1], {"a": 1}, 3, "nope"])
def test_step_file_profile_of_another_type_is_refused(profile):
    body = _body(sf.pack(_step()))
    body["problem"]["profile"] = profile
    with pytest.raises(PlanFileError, match="not a builtin profile"):
        sf.unpack(_file(body), "x.step")


def test_step_file_whose_info_and_unkept_list_disagree_is_refused():
    """A step planned without keep_kv altogether (info keep_kv) keeps it nowhere: no unkept list beside it."""
    kept_all, plain = _capped(1 << 40, keep_kv=True), _capped(1 << 40)
    c = _capped((kept_all.report["peak_memory_bytes"] + plain.report["peak_memory_bytes"]) // 2, keep_kv=True)
    body = _body(sf.pack(c))
    body["plan"]["info"] = list(body["plan"]["info"]) + [["keep_kv", "fake"]]
    with pytest.raises(PlanFileError, match="keep_kv"):
        sf.unpack(_file(body), "x.step")


@pytest.mark.parametrize("system", ["fixed", "wlb", "pool", "dyncp"])
@pytest.mark.parametrize("pp", [1, 2])
def test_keep_kv_never_loses_a_step_that_fits_without_it(system, pp):
    """Whatever the cap: where the step plans without keep_kv it plans with it too, under the cap — kept KV
    where it fits, else none (info says so)."""
    mesh = Mesh(2 // pp, 4, pp=pp, devices_per_node=2, recompute="none")
    run = dict(mesh=mesh, lens=LENS * 2, system=system)
    lo = _capped(1 << 40, **run).report["peak_memory_bytes"]
    hi = _capped(1 << 40, keep_kv=True, **run).report["peak_memory_bytes"]
    for cap in np.linspace(lo, hi, 5).astype(np.int64).tolist():
        try:
            plain = _capped(cap, **run)
        except Exception:
            continue  # the system's own sizing refuses at this cap, with or without kept KV
        c = _capped(cap, keep_kv=True, **run)
        assert c.report["peak_memory_bytes"] <= cap
        if "keep_kv" in c.plan.info_dict():  # the whole step without kept KV: the plan without the option
            assert not c.plan.problem.keep_kv and not any(low.kept.any() for low in c.lowered)
            assert c.report["step_s"] == plain.report["step_s"] and c.plan.kept_note().startswith("forward KV kept "
                                                                                                   "in no")
        else:
            assert all(low.ir.problem.keep_kv == c.plan.mb_keeps_kv(m) for m, low in enumerate(c.lowered))
            if c.plan.mb_unkept:  # kept in some only where that is not slower than in none
                assert c.report["step_s"] <= plain.report["step_s"]


def test_unkept_notes_in_every_view():
    """The one line of ``plan step compile``/``compare``/``show``, the html cell and the bench summary say
    how many micro-batches do not keep, or that none does and why; nothing where every one keeps."""
    from attnplan.step.ir import kept_note
    from attnplan.step.report import _unkept_cell
    from attnplan.tools.step_bench import _kept_lines
    over = "the forward's KV is kept in no micro-batch: with it the step exceeds the memory cap"
    assert kept_note({}, (), 8) == "" and kept_note({"keep_kv": over}, (), 8) == (
        "forward KV kept in no micro-batch (with it the step exceeds the memory cap)")
    assert kept_note({}, (3, 7), 8) == ("forward KV not kept in 2 of 8 micro-batches (over the memory cap with "
                                        "it): 3, 7")
    rows = [{"micro_batches": 8, "mb_unkept": [3, 7], "info": {}},
            {"micro_batches": 5, "mb_unkept": [], "info": {"keep_kv": over}},
            {"micro_batches": 4, "mb_unkept": [], "info": {}}, {"error": "x"}]
    assert [_unkept_cell(r) for r in rows[:3]] == [" (2 without kept KV)", " (none keeps KV)", ""]
    res: dict = {}
    assert _kept_lines(rows, res) == ["forward KV not kept: 2 of 17 micro-batches in 1 step (over the memory cap "
                                      "with it); 1 step planned without it (5 micro-batches)"]
    assert res == {"mb_unkept": 2, "steps_unkept": 1} and _kept_lines(rows[2:], {}) == []


# batches where pool's default was refused at some cap although a fixed count (the first) or minheap alone
# (the second) planned: the token bound did not see the plans' buffers, adaptive chose a plan that did not fit
POOL_CASES = [[1924, 202, 1455, 600, 1091, 1851, 568, 1457, 338, 658, 1940, 853, 1041, 600, 249, 860, 1254, 922,
               1557, 738, 1233, 1550, 1836, 866, 98, 1442, 1066, 1746, 929, 748, 143],
              [1501, 1772, 896, 1438, 434, 930, 1811, 776, 53, 1582, 620, 888, 1998, 786, 539, 482, 1701, 444, 1219,
               489, 1615, 1441, 1268]]


@pytest.mark.parametrize("lens", POOL_CASES, ids=["count", "inner"])
def test_pool_plans_wherever_one_of_its_variants_does(lens):
    """pool's default (micro=0: the fewest micro-batches that fit; inner=adaptive) sees each micro-batch's
    plan: at caps from the step's peak down, wherever a fixed count or a fixed inner strategy plans the
    step, the default plans it too, under the cap."""
    top = _capped(1 << 40, lens=lens, system="pool").report["peak_memory_bytes"]
    variants = ["pool{micro=2}", "pool{micro=3}", "pool{micro=4}", "pool{inner=minheap}", "pool{inner=hypergraph}"]
    planned_by_variant_too = 0
    for cap in np.linspace(top * 0.9, top, 9).astype(np.int64).tolist():
        others = []
        for v in variants:
            try:
                others.append(_capped(cap, lens=lens, system=v))
            except StepError:
                continue
        try:
            c = _capped(cap, lens=lens, system="pool")
        except StepError:
            assert not others, f"cap {cap}: pool refused where {[o.plan.system for o in others]} planned"
            continue
        assert c.report["peak_memory_bytes"] <= cap
        planned_by_variant_too += bool(others)
    assert planned_by_variant_too
