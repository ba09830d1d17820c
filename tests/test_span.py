"""span (issue 30): every document on the fewest devices that pay off, inside
one node when it fits. Its placement rules against brute force, and its
plans — with spans of one device, of part of a node and of whole nodes —
executed equal to dense attention under every schedule."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnplan
from attnplan.errors import PlanError
from attnplan.passes.span import _best_devices, place_spans, span_options, span_segments, tiled_top, zigzag_bounds


def _helpers():
    """test_execute's helpers (pytest runs with --import-mode=importlib, so tests/ is not on sys.path)."""
    spec = importlib.util.spec_from_file_location("_attnplan_test_execute", Path(__file__).with_name("test_execute.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, mod)
    spec.loader.exec_module(mod)
    return sys.modules[spec.name]


H = _helpers()

def test_span_options_fewest_first_inside_a_node_then_whole_nodes():
    assert span_options(10_000, 32, 8, 128) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32]
    assert span_options(1_000, 32, 8, 128) == [1, 2, 3]          # 1000 // 256 chunks of >= 128 tokens
    assert span_options(5_000, 32, 8, 128) == [1, 2, 3, 4, 5, 6, 7, 8, 16]
    assert span_options(100, 32, 8, 128) == [1]
    assert span_options(10_000, 4, 4, 1) == [1, 2, 3, 4]
    assert span_options(10_000, 6, 2, 1) == [1, 2, 4, 6]


def _brute_best(load, k, per_node):
    """Every choice of devices a span of k may take, by brute force: the
    lowest (busiest device after, node total) of the k least-loaded devices
    of each node, or the whole-node sets."""
    nodes = len(load) // per_node
    if k > per_node:
        return None
    best = None
    for node in range(nodes):
        devs = range(node * per_node, (node + 1) * per_node)
        for c in itertools.combinations(devs, k):
            top = max(load[d] for d in c)
            if best is None or top < best:
                best = top
    return best


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 4000), min_size=1, max_size=12), st.sampled_from([(4, 1), (4, 2), (6, 3), (8, 2)]),
       st.sampled_from([1.0, 1.5, 2.0]))
def test_place_spans_rules(lens, shape, grain):
    devices, nodes = shape
    per_node = devices // nodes
    lens = np.array(lens)
    work = lens * (lens + 1) / 2.0
    where = place_spans(lens, work, devices, per_node, grain, 16)
    load = np.zeros(devices)
    for d, devs in enumerate(where):
        k = len(devs)
        assert k in span_options(int(lens[d]), devices, per_node, 16)
        assert len(set(devs.tolist())) == k and list(devs) == sorted(devs)
        if k <= per_node:  # inside one node
            assert len({int(x) // per_node for x in devs}) == 1
        else:  # whole nodes
            assert k % per_node == 0 and set(np.unique(devs // per_node) * per_node) <= set(devs.tolist())
        load[devs] += work[d] / k
    # replay the rule: documents by decreasing work, the fewest devices keeping the busiest at most the limit
    replay = np.zeros(devices)
    target = grain * work.sum() / devices
    for d in np.lexsort((np.arange(len(work)), -work)):
        k = len(where[d])
        limit = max(target, replay.max())
        opts = span_options(int(lens[d]), devices, per_node, 16)
        for j in opts[:opts.index(k)]:  # every fewer-device span would have gone over the limit
            b = _brute_best(replay, j, per_node)
            if b is not None:
                assert b + work[d] / j > limit * (1 + 1e-12) - 1e-9
        if k <= per_node:  # its devices are a best choice of k devices inside a node
            assert replay[where[d]].max() <= _brute_best(replay, k, per_node) + 1e-9
        replay[where[d]] += work[d] / k
    assert np.allclose(replay, load)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 4000), min_size=1, max_size=12), st.sampled_from([(4, 2), (8, 2), (16, 4)]),
       st.sampled_from([1.0, 1.5]), st.sampled_from([1.0, 1.2, 2.0]))
def test_cross_keeps_documents_inside_a_node_within_its_slack(lens, shape, grain, cross):
    """With ``cross`` a document crosses nodes only where the best span of
    one node would leave its busiest device above ``cross`` times the limit
    (replayed); a document the rule keeps inside a node is on one node."""
    devices, nodes = shape
    per_node = devices // nodes
    lens = np.array(lens)
    work = lens * (lens + 1) / 2.0
    where = place_spans(lens, work, devices, per_node, grain, 16, cross)
    replay = np.zeros(devices)
    target = grain * work.sum() / devices
    for d in np.lexsort((np.arange(len(work)), -work)):
        k = len(where[d])
        limit = max(target, replay.max())
        inside = [j for j in span_options(int(lens[d]), devices, per_node, 16) if j <= per_node]
        best_inside = min(_brute_best(replay, j, per_node) + work[d] / j for j in inside)
        if k > per_node:  # it crossed: no span of one node was within the slack
            assert best_inside > cross * limit * (1 + 1e-12) - 1e-9
        else:
            assert len({int(x) // per_node for x in where[d]}) == 1
        replay[where[d]] += work[d] / k


def test_cross_moves_a_node_sized_document_back_inside_its_node():
    """A document of 1.07 times a node's even share: grain 1 sends it over
    two nodes; cross 1.2 keeps it on the 8 devices of one, and the plan
    moves no byte between nodes."""
    lens = [7000] + [1500] * 60  # the first: 8.5 devices' even share
    kw = dict(devices=32, nodes=4, heads=8, kv_heads=2, head_dim=64, block_size=1024)
    far = attnplan.compile(lens, strategy="span{grain=1}", **kw)
    near = attnplan.compile(lens, strategy="span{grain=1,cross=1.2}", **kw)
    big = lambda plan: np.unique(plan.ir.placement.home[plan.ir.graph.tb_start < 7000])
    assert len(big(far)) > 8 and len(big(near)) == 8 and len(np.unique(big(near) // 8)) == 1
    assert near.stats()["comm_bytes_inter"] == 0 < far.stats()["comm_bytes_inter"]
    assert near.stats()["predicted_s"] < far.stats()["predicted_s"]  # 8.8 against 15.9 of the bound here


def test_segments_cover_every_token_on_its_span():
    lens = np.array([7, 300, 1, 40])
    off = np.concatenate([[0], np.cumsum(lens)])
    where = [np.array([3]), np.array([0, 1, 2]), np.array([5]), np.array([4, 5, 6, 7])]
    starts, devs, keys = span_segments(off[:-1], lens, where, 8)
    assert starts[0] == 0 and (np.diff(starts) >= 0).all()
    ends = np.append(starts[1:], off[-1])
    for d, devs_d in enumerate(where):
        inside = (starts >= off[d]) & (starts < off[d + 1]) & (ends > starts)
        assert set(devs[inside].tolist()) == set(devs_d.tolist())  # every device of the span holds a chunk
        assert ends[inside].max() == off[d + 1]
    assert (keys[devs == 3] == 0).all()  # whole documents share one key


def test_small_batch_stays_inside_nodes_and_moves_nothing_between_them():
    lens = [3000, 2500, 2000] + [700] * 20
    plan = attnplan.compile(seqlens=lens, devices=16, nodes=2, heads=8, kv_heads=2, head_dim=64, strategy="span",
                            block_size=1024)
    s = plan.stats()
    assert s["comm_bytes_inter"] == 0
    assert s["compute_imbalance"] <= 1.5 + 1e-9  # grain 1.5: no piece over 1.5x the even share
    assert s["pairs"] == sum(L * (L + 1) // 2 for L in lens) * 8


def test_large_document_spans_whole_nodes():
    lens = [40_000, 500, 500]
    plan = attnplan.compile(seqlens=lens, devices=16, nodes=2, heads=4, kv_heads=2, head_dim=64, strategy="span",
                            block_size=2048)
    tokens = plan.stats()["per_device"]["tokens"]
    assert min(tokens) > 0  # the 40K document is on all 16 devices
    assert plan.stats()["compute_imbalance"] < 1.1


def test_options_checked():
    for bad in ("grain=0", "grain=-1", "min_chunk=0", "varlen=-2", "cross=0.5", "cross=-1"):
        with pytest.raises(PlanError, match="span"):
            attnplan.compile(seqlens=[100], devices=2, pipeline=f"tile{{block=16}},span{{{bad}}},comm,emit")


SCHEDULES = [None, "comm{mode=p2p}", "comm{mode=p2p,relay=node},overlap", "comm{mode=ring},overlap",
             "comm{mode=allgather}", "comm{mode=a2a}", "comm{mode=p2p},divide{stages=3},overlap",
             "comm{mode=p2p,relay=node,reduce=node},overlap", "comm{mode=p2p,reduce=node}"]


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_span_plans_equal_dense(data):
    """Spans of every kind (min_chunk=1 lets tiny documents split) equal dense
    attention, outputs and gradients, under every schedule."""
    h = H
    case = data.draw(h.cases(max_tokens=120))
    case.pop("strategy")
    sched = data.draw(st.sampled_from(SCHEDULES)) or "comm{mode=p2p,relay=node},overlap"
    grain = data.draw(st.sampled_from([0.25, 0.5, 1.0, 1.5, 2.0, 4.0]))  # 1, 1.5, 2, 4: what auto searches
    varlen = data.draw(st.sampled_from([-1, 0, 7]))
    case["schedule"] = None
    case["pipeline"] = (f"tile{{block={case.pop('block_size')}}},span{{grain={grain},min_chunk=1,varlen={varlen}}},"
                        f"{sched},emit")
    case.pop("schedule")
    h.check(case, "float32")


@pytest.mark.parametrize("sched", SCHEDULES)
@pytest.mark.parametrize("lens,devices,nodes,grain", [
    ([50, 30, 9, 1], 4, 2, 0.25),       # the 50-token document on both nodes, the 30 on part of a node
    ([61, 17, 17, 5, 3], 6, 3, 0.5),
    ([40, 40, 40], 8, 2, 1.0),          # spans of 2-3 devices inside a node, idle devices
])
def test_span_kinds_equal_dense(sched, lens, devices, nodes, grain):
    case = dict(seqlens=lens, mask="causal", devices=devices, nodes=nodes, heads=4, kv_heads=2, head_dim=8, seed=3,
                pipeline=f"tile{{block=8}},span{{grain={grain},min_chunk=1}},"
                         f"{sched or 'comm{mode=p2p,relay=node},overlap'},emit")
    plan, _, _ = H.check(case, "float32")
    per = devices // nodes
    g, pl = plan.ir.graph, plan.ir.placement
    homes = [set() for _ in lens]
    starts = np.concatenate([[0], np.cumsum(lens)])
    for a, _e, tb in zip(*(x.tolist() for x in g.spans())):
        homes[int(np.searchsorted(starts, a, "right") - 1)].add(int(pl.home[tb]))
    assert max(len(h) for h in homes) > 1  # some document is split
    if grain == 0.25:  # the largest document crosses nodes: whole nodes of it
        big = homes[int(np.argmax(lens))]
        assert len(big) % per == 0 and len(big) > per


def test_span_variants_are_strategy_entries():
    """span's variants are what auto searches and plan bench compiles; an entry with options compiles as
    the default pipeline with that strategy step, and its options are checked as a pipeline's are."""
    from attnplan.api import default_pipeline
    from attnplan.passes import strategy_entries, strategy_name
    from attnplan.passes.comm import parse_entry
    entries = strategy_entries()
    assert {"span", "span{grain=1}", "span{grain=2}", "span{grain=4}"} <= set(entries)
    assert all(strategy_name(e) in attnplan.strategies() for e in entries)
    assert parse_entry("span{grain=2}:direct") == ("span{grain=2}", "mode=p2p,relay=none", "kept", "span{grain=2}:direct")
    kw = dict(seqlens=[3000, 900, 64], devices=8, nodes=2, heads=4, kv_heads=2, head_dim=16, block_size=256)
    named = attnplan.compile(strategy="span{grain=2}", **kw)
    piped = attnplan.compile(pipeline=default_pipeline("span{grain=2}", 256), **kw)
    for a, b in ((named.ir.placement.home, piped.ir.placement.home),
                 (named.ir.placement.cb_device, piped.ir.placement.cb_device)):
        assert np.array_equal(a, b)
    assert named.meta["strategy"] == "span{grain=2}" and named.meta["pipeline"] == piped.meta["pipeline"]
    for bad in ("span{grain=0}", "span{grian=2}", "span{grain=2},zigzag", "spam{grain=2}"):
        with pytest.raises(attnplan.PlanError):
            attnplan.compile(strategy=bad, **kw)


def _place_spans_by_trying_each_span(lens, work, devices, per_node, grain, min_chunk):
    """place_spans as first written: every span of a document placed by _best_devices and measured."""
    load = np.zeros(devices)
    target = grain * float(work.sum()) / devices
    out = [None] * len(work)
    for d in np.lexsort((np.arange(len(work)), -work)).tolist():
        if lens[d] < 4 * min_chunk:
            i = int(load.argmin())
            load[i] += work[d]
            out[d] = np.array([i])
            continue
        limit, best = max(target, float(load.max())), None
        for k in span_options(int(lens[d]), devices, per_node, min_chunk):
            devs = _best_devices(load, k, per_node)
            top = float(load[devs].max()) + work[d] / k
            if best is None or top < best[0]:
                best = (top, devs)
            if top <= limit * (1 + 1e-12):
                break
        load[best[1]] += work[d] / len(best[1])
        out[d] = best[1]
    return out


@settings(max_examples=60)
@given(lens=st.lists(st.integers(1, 3000), min_size=1, max_size=40),
       shape=st.sampled_from([(1, 1), (4, 4), (8, 8), (8, 2), (16, 8), (24, 8), (32, 8), (6, 3)]),
       grain=st.sampled_from([0.25, 1.0, 1.5, 2.0, 4.0]), min_chunk=st.sampled_from([1, 16, 128]))
def test_place_spans_matches_trying_each_span(lens, shape, grain, min_chunk):
    """The one-sort search of place_spans picks what placing every span with _best_devices picks."""
    lens = np.asarray(lens)
    work = lens * (lens + 1) / 2.0
    devices, per_node = shape
    got = place_spans(lens, work, devices, per_node, grain, min_chunk)
    want = _place_spans_by_trying_each_span(lens, work, devices, per_node, grain, min_chunk)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


def _tiled_top_brute(bounds, k, tile):
    """Per device: every query tile of each of its chunks, ``tile`` rows times the keys up to the tile's last row."""
    work = np.zeros(k)
    for j in range(2 * k):
        lo, hi = int(bounds[j]), int(bounds[j + 1])
        dev = j if j < k else 2 * k - 1 - j
        for t0 in range(lo, hi, tile):
            work[dev] += tile * (t0 + tile)
    return work.max()


@given(st.integers(1, 40_000), st.integers(1, 16), st.sampled_from([0, 1, 64, 128, 256]))
def test_zigzag_bounds_never_tile_worse_than_the_even_split(length, k, align):
    """The cuts are the even split or its cuts rounded to multiples of
    ``align`` (never beyond the document), sorted, and the busiest device's
    tiled work is never above the even split's; ``tiled_top`` equals a
    tile-by-tile count."""
    b = zigzag_bounds(length, k, align)
    even = np.arange(2 * k + 1) * length // (2 * k)
    assert len(b) == 2 * k + 1 and b[0] == 0 and b[-1] == length and np.all(np.diff(b) >= 0)
    tile = max(align, 1)
    assert tiled_top(b, k, tile) <= tiled_top(even, k, tile)
    if not np.array_equal(b, even):
        assert align > 1 and np.all(b[:-1] % align == 0) and length >= 2 * k * align
    if length <= 5000:
        assert tiled_top(b, k, tile) == _tiled_top_brute(b, k, tile)


def test_aligned_cuts_are_taken_where_they_tile_better():
    """12,625 tokens over 7 devices (14 chunks of ~902 rows: 8 query tiles of
    128, 1,024 rows of work): cuts at multiples of 128 give the busiest
    device 3% less tiled work; a bad ``align`` is one clear error."""
    b = zigzag_bounds(12625, 7, 128)
    assert np.all(b[:-1] % 128 == 0)
    assert tiled_top(b, 7, 128) < 0.97 * tiled_top(zigzag_bounds(12625, 7, 0), 7, 128)
    with pytest.raises(PlanError, match="align must be >= 0"):
        attnplan.compile(seqlens=[100], devices=2, pipeline="tile{block=64},span{align=-1},emit")
