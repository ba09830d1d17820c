"""Relation tiles (issue 9): per_doc's and dacp's varlen groups under a causal
or full mask store no pieces; their tiles, pair counts, kernel-rounded work
and pieces are what the enumerated tiling of the same spans makes — checked
against it (brute force) — and the verifier rebuilds them from the blocks."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnplan
from attnplan.backends.cost import rounded_pairs
from attnplan.errors import VerifyError
from attnplan.ir.graph import build_graph
from attnplan.ir.groups import group_graph
from attnplan.ir.relation import CAUSAL, FULL, doc_kinds, levels
from attnplan.ir.verify import verify, verify_graph


def _compile(lens, devices, strategy="per_doc", mask="causal", block=32, nodes=1, **kw):
    return attnplan.compile(seqlens=lens, mask=mask, devices=devices, nodes=nodes, heads=4, kv_heads=2,
                            head_dim=8, block_size=block, strategy=strategy, **kw)


def _enumerated(g):
    """The same spans tiled the old way: every piece listed (build_graph, then group_graph)."""
    ss, _, owner = g.spans()
    order = np.argsort(ss, kind="stable")
    fine = build_graph(g.problem, ss[order], g.n_hg, g.kv_rep, hg_starts=g.hg_start)
    return group_graph(fine, owner[order])


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.integers(1, 70), min_size=1, max_size=14), devices=st.integers(1, 6),
       strategy=st.sampled_from(["per_doc", "dacp"]), mask=st.sampled_from(["causal", "full"]),
       block=st.sampled_from([4, 16, 64]), varlen=st.sampled_from([-1, 24]))
def test_relation_tiles_are_the_enumerated_tiles(lens, devices, strategy, mask, block, varlen):
    g = _compile(lens, devices, pipeline=f"tile{{block={block}}},{strategy}{{varlen={varlen}}},comm,emit",
                 mask=mask).ir.graph
    assert g.relation and len(g.pieces) == 0
    e = _enumerated(g)
    assert not e.relation
    for f in ("tile_q", "tile_k", "tile_pairs", "cb_tile", "cb_hg", "tb_start", "tb_end"):
        assert np.array_equal(getattr(g, f), getattr(e, f)), f
    for tq in (1, 16, 128):
        assert np.allclose(rounded_pairs(g, tq), rounded_pairs(e, tq), rtol=1e-12, atol=0)
    for t in range(g.n_tile):
        assert np.array_equal(g.tile_pieces(t), e.tile_pieces(t)), t
        a, b = g.local_pieces(t), e.local_pieces(t)
        assert np.array_equal(a[0], b[0]) and a[1:] == b[1:]


@pytest.mark.parametrize("strategy", ["per_doc", "dacp"])
def test_relation_plans_with_head_groups_equal_dense_attention(strategy):
    """Head groups multiply the compute blocks, not the tiles; the plan still equals dense attention."""
    from attnplan.runtime.check import check_plan
    plan = _compile([120, 7, 33, 2, 64, 9], 3, pipeline=f"tile{{block=16,head_groups=2}},{strategy},comm,emit")
    g = plan.ir.graph
    assert g.relation and g.n_hg == 2 and g.n_cb == 2 * g.n_tile
    res = check_plan(plan, "float32")
    assert res["ok"], res


def test_a_relation_plan_is_verified_runs_and_round_trips():
    plan = _compile([300, 5, 17, 900, 64, 1, 3, 250], 4, nodes=2)
    g = plan.ir.graph
    assert g.relation and g.tile_pairs.sum() == plan.problem.pairs() // plan.problem.heads
    verify(plan.ir)
    back = attnplan.Plan.from_bytes(plan.to_bytes())
    assert back.ir.graph.relation and back.to_bytes() == plan.to_bytes()
    assert np.array_equal(back.ir.graph.tile_pairs, g.tile_pairs)


def test_which_masks_are_relations():
    def kinds(mask, lens=(5, 9, 1)):
        return doc_kinds(_compile(list(lens), 1, strategy="zigzag", mask=mask).problem)

    kind, src = kinds("causal")
    assert kind.tolist() == [CAUSAL] * 3 and sorted(src.tolist()) == [0, 1, 2]
    assert kinds("full")[0].tolist() == [FULL, FULL, CAUSAL]  # a 1-token document: one pair either way
    for mask in ("sliding_window(3)", "prefix_lm(2)", "causal & (k - q) % 3 != 1", "chunked_causal(4)",
                 "(h < 2 & causal) | (h >= 2 & full)"):
        assert kinds(mask) is None, mask
    g = _compile([40, 41, 2, 7], 3, mask="sliding_window(9)").ir.graph
    assert g.grouped and not g.relation and len(g.pieces)


def test_levels_refuse_a_cycle_and_a_document_met_twice():
    # documents 0 and 1 visit blocks 0 -> 1 and 1 -> 0: no order has both in order
    assert levels(np.array([0, 0, 1, 1]), np.array([0, 1, 1, 0]), 2) is None
    assert levels(np.array([0, 0]), np.array([1, 1]), 2) is None
    assert levels(np.array([0, 0, 0, 1, 1]), np.array([2, 0, 1, 0, 1]), 3).tolist() == [1, 2, 0]


@pytest.fixture(scope="module")
def rel():
    return _compile([300, 5, 17, 900, 64, 1, 3, 250], 4, nodes=2).ir


def _replace(ir, **f):
    return ir.replace(graph=dataclasses.replace(ir.graph, **f))


def test_verifier_catches_a_missing_relation_tile(rel):
    g = rel.graph
    keep = np.arange(g.n_tile) != 3
    cb_keep = keep[g.cb_tile]
    bad = dataclasses.replace(g, tile_q=g.tile_q[keep], tile_k=g.tile_k[keep], tile_pairs=g.tile_pairs[keep],
                              tile_ptr=g.tile_ptr[:-1], cb_tile=np.cumsum(keep)[g.cb_tile[cb_keep]] - 1,
                              cb_hg=g.cb_hg[cb_keep])
    with pytest.raises(VerifyError, match=r"relation tiles: tile \(q block, kv block\) .* is missing"):
        verify_graph(bad)


def test_verifier_catches_wrong_relation_pairs_and_stored_pieces(rel):
    pairs = rel.graph.tile_pairs.copy()
    pairs[5] -= 1
    with pytest.raises(VerifyError, match="relation tile 5 .* pairs; its documents make"):
        verify_graph(dataclasses.replace(rel.graph, tile_pairs=pairs))
    ptr = rel.graph.tile_ptr.copy()
    ptr[1:] = 1
    with pytest.raises(VerifyError, match="no stored pieces"):
        verify_graph(dataclasses.replace(rel.graph, tile_ptr=ptr, pieces=np.zeros((1, 6), np.int64),
                                         piece_src=np.zeros(1, np.int64)))


def test_verifier_refuses_relation_on_a_mask_that_is_not_one(rel):
    g = _compile([40, 41, 2, 7], 3, mask="sliding_window(9)").ir.graph
    with pytest.raises(VerifyError, match="invariant 2"):
        verify_graph(dataclasses.replace(g, relation=True, tile_ptr=np.zeros_like(g.tile_ptr),
                                         pieces=np.zeros((0, 6), np.int64), piece_src=np.zeros(0, np.int64)))
    swapped = rel.graph.tile_k.copy()
    i = int(np.flatnonzero(rel.graph.tile_q != rel.graph.tile_k)[0])
    swapped[i] = rel.graph.tile_q[i]  # an off-diagonal tile turned into a second diagonal one
    with pytest.raises(VerifyError, match="invariant 2"):
        verify_graph(dataclasses.replace(rel.graph, tile_k=swapped))


def test_per_doc_plans_many_documents_on_many_devices_without_pieces():
    """2,000 documents on 64 devices: 2,000 x 128 x 129 / 2 = 16.5M pieces enumerated (over the limit);
    as relations the plan holds none, and its tiles are the chunk-column pairs."""
    rng = np.random.default_rng(0)
    lens = rng.integers(200, 400, 2000).tolist()
    plan = _compile(lens, 64, block=2048, nodes=8, verify=True)
    g = plan.ir.graph
    assert g.relation and g.n_tb == 128 and g.n_tile == 128 * 129 // 2
    assert g.tile_pairs.sum() == sum(n * (n + 1) // 2 for n in lens)


def test_a_picture_too_large_to_draw_span_by_span_says_so(monkeypatch):
    from attnplan.errors import PlanError
    from attnplan.ir import graph as graph_mod
    from attnplan.ir.groups import ungroup
    g = _compile([40] * 30, 8, block=64).ir.graph
    assert g.relation
    monkeypatch.setattr(graph_mod, "MAX_TILE_PIECES", 2_000)
    with pytest.raises(PlanError, match=r"drawn span by span.*tiling would make 4,080 "):
        ungroup(g)


def _crafted_groups(T: int, mask: str, spans) -> bytes:
    """A plan file of one ``mask`` document of ``T`` tokens whose graph is the groups ``spans`` (lists of
    (start, end), one list per block) — header and checksum valid, the rest as crafted."""
    from attnplan.backends.planfile import _arr, pack_body, to_body
    plan = _compile([40, 30], 2, block=16)
    body = to_body(plan.ir, {"pipeline": "x", "strategy": "per_doc", "block_size": 32, "profile": "h100"})
    body["problem"]["seqlens"] = _arr(np.array([T]))
    body["problem"]["pieces"] = _arr(np.array([[0, T, 0, T, -(T - 1), T - 1 if mask == "full" else 0]]))
    flat = [x for block in spans for x in block]
    g = body["graph"]
    g["tb_ptr"] = _arr(np.cumsum([0] + [len(b) for b in spans]))
    g["span_start"], g["span_end"] = _arr(np.array([a for a, _ in flat])), _arr(np.array([b for _, b in flat]))
    g["tb_start"], g["tb_end"] = _arr(np.array([b[0][0] for b in spans])), _arr(np.array([b[-1][1] for b in spans]))
    return pack_body(body)


def test_a_crafted_file_of_many_tiny_groups_is_refused_before_it_allocates(monkeypatch):
    from attnplan.errors import PlanFileError
    from attnplan.ir import groups
    monkeypatch.setattr(groups, "MAX_TILE_PIECES", 50_000)
    data = _crafted_groups(300, "full", [[(i, i + 1)] for i in range(300)])  # 90,000 relation tiles
    with pytest.raises(PlanFileError, match=r"90,000 tiles x 1 head groups, over the limit of 50,000"):
        attnplan.Plan.from_bytes(data)


def test_a_crafted_file_with_a_span_cut_in_two_is_refused():
    """Adjacent spans of one block are one span: a file that cuts one is not what its blocks make
    (as for enumerated groups), so every relation plan has one byte form."""
    from attnplan.errors import PlanFileError
    with pytest.raises(PlanFileError, match="span_start is not what its blocks make"):
        attnplan.Plan.from_bytes(_crafted_groups(50, "causal", [[(0, 20), (20, 30)], [(30, 50)]]))
