"""The shared placement tail (issue 8): ``place_segments`` turns a strategy's
cut points and devices into a graph and a placement, and ``PlanIR`` clears the
levels below the one a pass replaces (``with_levels``), while ``replace``
stays an explicit field replacement."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnplan
from attnplan.errors import PlanError
from attnplan.frontend import load_mask, lower_batch
from attnplan.ir.module import LEVELS, PlanIR
from attnplan.ir.place import chunk_bounds, place_segments, segment_home, zigzag_device
from attnplan.ir.problem import Problem
from attnplan.ir.verify import verify
from attnplan.passes import dacp as dacp_mod
from attnplan.passes import parse_pipeline, run_pipeline
from attnplan.passes.per_doc import per_doc_chunks


def problem(seqlens, mask="causal", heads=4, kv_heads=2):
    lens = np.asarray(seqlens, np.int64)
    return Problem(seqlens=lens, heads=heads, kv_heads=kv_heads, head_dim=8,
                   pieces=lower_batch(load_mask(mask), lens.tolist(), None))


def tiled(seqlens, devices, block=16, mask="causal", nodes=1) -> PlanIR:
    p = problem(seqlens, mask)
    return run_pipeline(PlanIR(p, devices, nodes), parse_pipeline(f"tile{{block={block}}}"))


@pytest.fixture(scope="module")
def full_ir() -> PlanIR:
    """An IR with every level filled in."""
    return attnplan.compile(seqlens=[40, 25], devices=2, heads=2, kv_heads=2, head_dim=8, block_size=16).ir


def token_device(ir: PlanIR) -> np.ndarray:
    """The home device of every token, from the placement's token blocks."""
    g = ir.graph
    out = np.empty(g.problem.tokens, np.int64)
    out[g.block_rows(np.arange(g.n_tb))] = np.repeat(ir.placement.home, g.tb_len)  # varlen groups: rows by span
    return out


# PlanIR.with_levels / replace ----------------------------------------------------------------------

@pytest.mark.parametrize("level", LEVELS)
def test_with_levels_clears_every_level_below(full_ir, level):
    new = full_ir.with_levels(**{level: getattr(full_ir, level)})
    i = LEVELS.index(level)
    for above in LEVELS[:i + 1]:
        assert getattr(new, above) is getattr(full_ir, above), above
    for below in LEVELS[i + 1:]:
        assert getattr(new, below) is None, below
    assert (new.devices, new.nodes, new.memory_cap) == (full_ir.devices, full_ir.nodes, full_ir.memory_cap)


def test_with_levels_keeps_levels_given_and_clears_those_between(full_ir):
    new = full_ir.with_levels(graph=full_ir.graph, schedule=full_ir.schedule)
    assert new.graph is full_ir.graph and new.schedule is full_ir.schedule
    assert new.placement is None and new.program is None
    assert full_ir.with_levels() is full_ir


@pytest.mark.parametrize("bad", [{"devices": 3}, {"memory_cap": 10}, {"graph": None, "nodes": 2}])
def test_with_levels_accepts_only_levels(full_ir, bad):
    with pytest.raises(PlanError, match="not an IR level"):
        full_ir.with_levels(**bad)


def test_replace_changes_exactly_the_fields_given(full_ir):
    pl = dataclasses.replace(full_ir.placement)
    new = full_ir.replace(placement=pl)
    assert new.placement is pl
    assert new.schedule is full_ir.schedule and new.program is full_ir.program and new.graph is full_ir.graph
    capped = full_ir.replace(memory_cap=1 << 30)
    assert capped.memory_cap == 1 << 30 and all(getattr(capped, lv) is getattr(full_ir, lv) for lv in LEVELS)
    assert full_ir.memory_cap is None  # the original is untouched


@pytest.mark.parametrize("spec", ["zigzag", "per_doc", "minheap", "ulysses", "tile_pool", "dacp", "hypergraph"])
def test_strategy_on_a_full_ir_clears_schedule_and_program(full_ir, spec):
    (p,) = parse_pipeline(spec)
    new = p.apply(full_ir)
    assert new.graph is not full_ir.graph and new.placement is not None
    assert new.schedule is None and new.program is None
    verify(new)


# place_segments ------------------------------------------------------------------------------------

@st.composite
def segmentations(draw):
    lens = draw(st.lists(st.integers(1, 60), min_size=1, max_size=5))
    T = sum(lens)
    devices = draw(st.integers(1, 6))
    inner = draw(st.lists(st.integers(0, T - 1), max_size=12))
    starts = np.sort(np.array([0] + inner, np.int64))  # repeated starts are empty segments
    devs = np.array(draw(st.lists(st.integers(0, devices - 1), min_size=len(starts), max_size=len(starts))))
    return lens, devices, starts, devs, draw(st.sampled_from([1, 4, 16, 64]))


@settings(max_examples=80)
@given(segmentations())
def test_place_segments_homes_every_token_on_its_segment(case):
    lens, devices, starts, devs, block = case
    ir = tiled(lens, devices, block)
    out = place_segments(ir, starts, devs)
    T = ir.problem.tokens
    # token level: a token lives on the device of the last segment starting at or before it
    want = devs[np.searchsorted(starts, np.arange(T), "right") - 1]
    assert np.array_equal(token_device(out), want)
    # the tile pass's cuts are kept and every segment start is a token block boundary
    assert set(ir.graph.tb_start.tolist()) <= set(out.graph.tb_start.tolist())
    assert set(starts.tolist()) <= set(out.graph.tb_start.tolist())
    # compute where Q lives, nothing below the placement, every pair still computed once
    assert np.array_equal(out.placement.cb_device, out.placement.home[out.graph.cb_q])
    assert out.schedule is None and out.program is None
    assert int(out.graph.tile_pairs.sum()) == ir.problem.pieces.pair_count()
    verify(out)


def test_place_segments_compute_and_head_groups():
    ir = tiled([50, 30], 2, block=16)
    out = place_segments(ir, [0, 40], [1, 0], head_groups=2, compute=lambda g, home: g.cb_hg)
    assert out.graph.n_hg == 2
    assert np.array_equal(out.placement.cb_device, out.graph.cb_hg)
    assert out.placement.cb_device.dtype == np.int64 and not out.placement.cb_device.flags.writeable
    assert np.array_equal(token_device(out), np.repeat([1, 0], [40, 40]))
    verify(out)


def test_segment_home_picks_the_non_empty_of_equal_starts():
    # segments 1 and 2 both start at 5: segment 1 is empty, so tokens 5.. belong to segment 2
    assert segment_home(np.array([0, 5, 7]), np.array([0, 5, 5]), np.array([3, 1, 2])).tolist() == [3, 2, 2]


@pytest.mark.parametrize("starts,devs,msg", [
    ([3, 10], [0, 1], "must start at token 0"),
    ([], [], "must start at token 0"),
    ([0, 20, 10], [0, 1, 0], "sorted"),
    ([0, 80], [0, 1], "below 80 tokens"),
    ([0, 10], [0, 2], "device 2, outside"),
    ([0, 10], [-1, 0], "device -1, outside"),
    ([0, 10], [0], "one device per segment"),
])
def test_place_segments_rejects_bad_segments(starts, devs, msg):
    ir = tiled([50, 30], 2)
    with pytest.raises(PlanError, match=msg):
        place_segments(ir, starts, devs)


def test_place_segments_needs_a_graph():
    ir = tiled([50, 30], 2).with_levels(graph=None)
    with pytest.raises(PlanError, match="run the tile pass first"):
        place_segments(ir, [0], [0])


def test_place_segments_rejects_a_compute_result_of_the_wrong_length():
    ir = tiled([50, 30], 2)
    with pytest.raises(PlanError, match="compute devices for"):
        place_segments(ir, [0], [0], compute=lambda g, home: home)


# strategies are their segments -----------------------------------------------------------------------

def place(spec, lens, devices, block=16, mask="causal"):
    ir = tiled(lens, devices, block, mask)
    return run_pipeline(ir, parse_pipeline(spec))


@pytest.mark.parametrize("lens,devices", [([50, 30], 2), ([7], 5), ([100, 3, 61], 3)])
def test_zigzag_is_its_chunks(lens, devices):
    out = place("zigzag", lens, devices)
    T = sum(lens)
    chunk = np.searchsorted(chunk_bounds(T, 2 * devices), np.arange(T), "right") - 1
    assert np.array_equal(token_device(out), zigzag_device(chunk, devices))
    assert np.array_equal(out.placement.cb_device, out.placement.home[out.graph.cb_q])


@pytest.mark.parametrize("lens,devices", [([50, 30], 2), ([7, 1, 2], 3), ([100, 3, 61], 4)])
def test_per_doc_is_its_chunks(lens, devices):
    out = place("per_doc", lens, devices)
    sizes, dev = per_doc_chunks(np.array(lens), devices)
    want = np.concatenate([np.repeat(dev, row) for row in sizes])
    assert np.array_equal(token_device(out), want)
    assert np.array_equal(out.placement.cb_device, out.placement.home[out.graph.cb_q])


def test_ulysses_is_contiguous_shares_and_head_groups():
    out = place("ulysses", [50, 30], 2)
    assert np.array_equal(token_device(out), np.repeat([0, 1], [40, 40]))
    assert out.graph.n_hg == 2 and np.array_equal(out.placement.cb_device, out.graph.cb_hg)


def test_dacp_stuck_automatic_bucket_is_a_typed_error(monkeypatch):
    # cannot happen by the module's argument; if it did, it must be a PlanError, not an assert
    monkeypatch.setattr(dacp_mod, "classify", lambda *a, **k: None)
    with pytest.raises(PlanError, match="internal error"):
        dacp_mod.dacp_classify(problem([30, 20]), 2)
