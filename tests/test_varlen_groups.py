"""Varlen groups (issue 9, item 1): per_doc and dacp pack the chunks that
play the same part in many documents into one token block of spans; the
plans stay equal to dense attention, the verifier guards the spans, plan
files carry them."""

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnplan
from attnplan.errors import PlanError, PlanFileError, VerifyError
from attnplan.ir.groups import group_graph, ungroup, varlen_groups
from attnplan.ir.mask import piece_counts
from attnplan.ir.verify import verify
from attnplan.passes.per_doc import per_doc_chunks
from attnplan.runtime.check import random_inputs, reference

MASKS = ("causal", "full", "sliding_window(9)", "prefix_lm(5)", "causal & (k - q) % 3 != 1", "chunked_causal(7)")


def _compile(lens, devices, nodes=1, strategy="per_doc", mask="causal", block=32, heads=4, kv_heads=2, **kw):
    return attnplan.compile(seqlens=lens, mask=mask, devices=devices, nodes=nodes, heads=heads, kv_heads=kv_heads,
                            head_dim=8, block_size=block, strategy=strategy, **kw)


def _dense_error(plan) -> float:
    """Largest |difference| of out, dq, dk, dv against dense attention (float64)."""
    q, k, v, dout = (t.double() for t in random_inputs(plan, "float32", 3))
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = attnplan.execute(plan, qg, kg, vg)
    grads = torch.autograd.grad(out, (qg, kg, vg), dout)
    want_out, want_grads = reference(plan.problem, q, k, v, dout, 1.0 / math.sqrt(plan.problem.head_dim))
    return max(float((a.detach() - b).abs().max()) for a, b in zip((out, *grads), (want_out, *want_grads)))


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(1, 90), min_size=1, max_size=14), devices=st.integers(1, 6),
       two_nodes=st.booleans(), strategy=st.sampled_from(["per_doc", "dacp"]), mask=st.sampled_from(MASKS),
       block=st.sampled_from([8, 16, 64]), heads=st.sampled_from([(4, 2), (4, 4), (2, 1)]))
def test_grouped_plans_equal_dense_attention(lens, devices, two_nodes, strategy, mask, block, heads):
    nodes = 2 if two_nodes and devices % 2 == 0 else 1
    plan = _compile(lens, devices, nodes, strategy, mask, block, *heads)
    s = plan.stats()
    assert s["pairs"] == sum(s["per_device"]["pairs"])
    assert _dense_error(plan) < 1e-9


@pytest.mark.parametrize("strategy", ["per_doc", "dacp"])
def test_groups_change_blocks_not_homes_or_work(strategy):
    """Against ``varlen=0`` (a block per chunk): every token on the same
    device, the same pairs per device, fewer compute blocks and transfers."""
    lens = [300, 5, 17, 900, 64, 1, 3, 250, 40, 40, 8]
    a = _compile(lens, 4, 2, strategy)
    b = _compile(lens, 4, 2, pipeline=f"tile{{block=32}},{strategy}{{varlen=0}},comm,emit")
    ga, gb = a.ir.graph, b.ir.graph
    assert ga.grouped and not gb.grouped

    def token_home(ir):
        out = np.empty(ir.problem.tokens, np.int64)
        out[ir.graph.block_rows(np.arange(ir.graph.n_tb))] = np.repeat(ir.placement.home, ir.graph.tb_len)
        return out

    assert np.array_equal(token_home(a.ir), token_home(b.ir))
    assert a.stats()["per_device"]["pairs"] == b.stats()["per_device"]["pairs"]
    assert ga.n_cb < gb.n_cb and ga.n_tb < gb.n_tb
    assert len(a.ir.program.transfers) <= len(b.ir.program.transfers)
    pa, pb = _all_pieces(ga), _all_pieces(gb)  # a chunk cut at a block edge is one span in its group
    assert len(pa) <= len(pb) and piece_counts(pa).sum() == piece_counts(pb).sum() == ga.problem.pairs() // 4


@pytest.mark.parametrize("varlen", [-1, 40])
def test_per_doc_groups_are_chunk_columns(varlen):
    """A group holds chunks of one column (one device, one part): all of them by default, else at
    most ``varlen`` tokens (a longer chunk alone)."""
    lens = [50, 7, 120, 3, 64, 64]
    devices, block = 3, 40
    plan = _compile(lens, devices, pipeline=f"tile{{block={block}}},per_doc{{varlen={varlen}}},comm,emit")
    g, home = plan.ir.graph, plan.ir.placement.home
    assert g.n_tb == 2 * devices if varlen == -1 else g.n_tb > 2 * devices
    sizes, dev = per_doc_chunks(np.array(lens), devices)
    off = np.concatenate([[0], np.cumsum(lens)])
    col = np.full(sum(lens), -1)
    for d, row in enumerate(sizes):
        col[off[d]:off[d + 1]] = np.repeat(np.arange(len(row)), row)
    for b in range(g.n_tb):
        rows = g.block_rows(np.array([b]))
        assert len(np.unique(col[rows])) == 1 and dev[col[rows[0]]] == home[b]
        assert varlen == -1 or len(rows) <= varlen or g.tb_ptr[b + 1] - g.tb_ptr[b] == 1


def test_varlen_groups_pack_in_order_under_the_limit():
    tb_len = np.array([5, 3, 4, 2, 2, 4, 7])
    home = np.array([0, 1, 0, 0, 1, 0, 0])
    key = np.array([0, 0, 0, -1, 0, 0, 1])
    grp = varlen_groups(tb_len, home, key, 10)
    # device 0, key 0: blocks 0 (5) + 2 (4) fit, 5 (4) would make 13: a new group; device 1: 1 + 4
    assert grp.tolist() == [0, 1, 0, 2, 1, 3, 4]
    assert grp[3] not in grp[np.arange(7) != 3]  # key < 0: alone
    sizes = np.bincount(grp, weights=tb_len)
    assert all(sizes[g] <= 10 or (grp == g).sum() == 1 for g in range(grp.max() + 1))
    assert np.array_equal(varlen_groups(tb_len, home, key, 10), grp)  # deterministic


def test_group_graph_refuses_two_blocks_of_one_piece():
    """A group that holds two blocks of one mask piece would put two of its pieces in one tile."""
    ir = attnplan.compile(seqlens=[64], devices=1, heads=2, kv_heads=2, head_dim=8, block_size=16,
                          pipeline="tile{block=16},zigzag,comm,emit").ir
    g = ir.graph
    with pytest.raises(PlanError, match="meets two blocks of one group"):
        group_graph(g, np.zeros(g.n_tb, np.int64) if g.n_tb > 1 else np.array([0]))


def test_ungroup_maps_every_pair_to_its_compute_block():
    g = _compile([300, 5, 17, 900, 64, 1, 3], 4, 2).ir.graph
    fine, owner = ungroup(g)
    assert not fine.grouped and fine.cb_pairs.sum() == g.cb_pairs.sum()
    assert np.array_equal(np.bincount(owner, weights=fine.cb_pairs, minlength=g.n_cb), g.cb_pairs)


# -- the verifier ------------------------------------------------------------------------------------

def _all_pieces(g) -> np.ndarray:
    """Every tile's pieces (made on demand for relation tiles), sorted: the mask pieces a plan computes."""
    P = np.concatenate([g.tile_pieces(t) for t in range(g.n_tile)])
    return P[np.lexsort(P.T[::-1])]


@pytest.fixture(scope="module")
def grouped():
    return _compile([300, 5, 17, 900, 64, 1, 3, 250], 4, 2).ir


def _with_graph(ir, **fields):
    return ir.replace(graph=dataclasses.replace(ir.graph, **fields))


def test_grouped_plan_verifies(grouped):
    assert grouped.graph.grouped and (np.diff(grouped.graph.tb_ptr) > 1).any()
    verify(grouped)


def test_verifier_catches_spans_that_do_not_partition(grouped):
    g = grouped.graph
    end = g.span_end.copy()
    end[0] -= 1  # a token in no span
    with pytest.raises(VerifyError, match="invariant 2: the spans of the varlen groups"):
        verify(_with_graph(grouped, span_end=end))
    start = g.span_start.copy()
    i = int(np.flatnonzero(np.diff(g.tb_ptr) > 1)[0])
    a = int(g.tb_ptr[i])
    start[[a, a + 1]], end2 = start[[a + 1, a]], g.span_end.copy()
    end2[[a, a + 1]] = end2[[a + 1, a]]  # a block's spans out of position order
    with pytest.raises(VerifyError, match="invariant 2"):
        verify(_with_graph(grouped, span_start=start, span_end=end2))


def test_verifier_catches_a_span_moved_to_another_block(grouped):
    """Moving a span between blocks (hulls fixed up) leaves pieces outside their tile's spans."""
    g = grouped.graph
    i = int(np.flatnonzero(np.diff(g.tb_ptr) > 1)[0])
    ptr = g.tb_ptr.copy()
    ptr[i + 1] -= 1  # block i's last span now opens block i + 1
    ss, se = g.span_start, g.span_end
    tb_start, tb_end = ss[ptr[:-1]], se[ptr[1:] - 1]
    bad = _with_graph(grouped, tb_ptr=ptr, tb_start=tb_start, tb_end=tb_end)
    with pytest.raises(VerifyError, match="invariant 2"):
        verify(bad)


def test_verifier_wants_every_span_field(grouped):
    with pytest.raises(VerifyError, match="tb_ptr, span_start and span_end together"):
        verify(_with_graph(grouped, span_end=None))


# -- plan files, pipelines, the runtime's layout -------------------------------------------------------

META = {"pipeline": "x", "strategy": "per_doc", "block_size": 32, "profile": "h100"}


def _crafted(ir, edit, derive=True) -> bytes:
    """A plan file of ``ir`` whose graph record ``edit`` changed, with a valid header and checksum."""
    from attnplan.backends.planfile import pack_body, to_body
    body = to_body(ir, META, derive)
    edit(body["graph"])
    return pack_body(body)


def test_grouped_plan_file_round_trips_and_refuses_crafted_spans(grouped):
    plan = attnplan.Plan(grouped, META)
    back = attnplan.Plan.from_bytes(plan.to_bytes())
    for f in ("tb_ptr", "span_start", "span_end"):
        assert np.array_equal(getattr(back.ir.graph, f), getattr(grouped.graph, f))
    assert back.to_bytes() == plan.to_bytes()
    for edit, msg in ((lambda gb: gb.update(span_end=gb["span_start"]), "invariant 2"),
                      (lambda gb: gb.pop("tb_ptr"), "tb_ptr"),
                      (lambda gb: gb.update(tb_ptr=gb["tb_start"]), "tb_ptr")):
        with pytest.raises(PlanFileError, match=msg):
            attnplan.Plan.from_bytes(_crafted(grouped, edit))


def test_crafted_spans_of_a_file_with_explicit_tiles_are_refused():
    """A file that stores its tiles is checked the same: bad span pointers are one clear error, no IndexError
    (a sliding window is not a relation mask: its grouped tiles store their pieces)."""
    from attnplan.backends.planfile import _arr  # the writer's own array encoding
    grouped = _compile([300, 5, 17, 900, 64, 1, 3, 250], 4, 2, mask="sliding_window(40)").ir
    assert grouped.graph.grouped and not grouped.graph.relation
    explicit = attnplan.Plan.from_bytes(_crafted(grouped, lambda gb: None, derive=False))
    assert explicit.to_bytes() == attnplan.Plan(grouped, META).to_bytes()
    full = grouped.graph.tb_ptr
    for values in (full[::-1].copy(),                                # decreasing
                   np.r_[0, np.full(len(full) - 1, full[-1])],      # empty blocks
                   np.r_[full[:-1], full[-1] - 1]):                # a span left out
        for derive in (False, True):
            with pytest.raises(PlanFileError, match="invariant 2"):
                attnplan.Plan.from_bytes(_crafted(grouped, lambda gb, v=values: gb.update(tb_ptr=_arr(v)), derive))


def test_derived_tiles_with_stored_tiles_are_refused():
    from attnplan.backends.planfile import to_body
    grouped = _compile([300, 5, 17, 900, 64, 1, 3, 250], 4, 2, mask="sliding_window(40)").ir
    tile_q = to_body(grouped, META, derive=False)["graph"]["tile_q"]
    with pytest.raises(PlanFileError, match="derived.* also stores tile_q"):
        attnplan.Plan.from_bytes(_crafted(grouped, lambda gb: gb.update(tile_q=tile_q)))


def test_a_strategy_after_groups_is_refused():
    with pytest.raises(PlanError, match="varlen groups .* run tile again before zigzag"):
        attnplan.compile(seqlens=[40, 9, 30], devices=2, heads=2, kv_heads=2, head_dim=8,
                         pipeline="tile{block=16},per_doc,zigzag,comm,emit")


def test_dispatch_of_a_grouped_plan_takes_each_ranks_spans():
    plan = _compile([30, 7, 50, 2, 19], 3, block=16)
    x = torch.arange(plan.problem.tokens, dtype=torch.float64)
    parts = [plan.dispatch(x, r) for r in range(3)]
    assert sorted(torch.cat(parts).tolist()) == x.tolist()
    for r, part in enumerate(parts):
        assert part.tolist() == plan.local_index(r).tolist()


def test_bad_varlen_option():
    with pytest.raises(PlanError, match="varlen must be -1"):
        attnplan.compile(seqlens=[40], devices=2, heads=2, kv_heads=2, head_dim=8, pipeline="tile,per_doc{varlen=-2},comm,emit")


CASES = [([300, 5, 17, 900, 64, 1, 3, 250], "causal"), ([40, 41, 2, 7], "sliding_window(9)"),
         ([120, 33], "(h < 2 & causal) | (h >= 2 & full)"), ([64, 64, 9], "prefix_lm(5)")]


@pytest.mark.parametrize("strategy", attnplan.strategies())
def test_the_tile_pass_graphs_are_what_their_blocks_rebuild(strategy):
    """A plan file leaves out the tiles of graphs build_graph / group_graph made
    (marked when made): rebuilding them from the blocks gives every field back."""
    from attnplan.ir.graph import is_built
    from attnplan.ir.groups import derive_tiles
    for lens, mask in CASES:
        try:
            g = _compile(lens, 4, 2, strategy, mask, block=32, heads=4, kv_heads=2).ir.graph
        except PlanError as e:
            assert "not supported" in str(e)
            continue
        assert is_built(g)
        d = derive_tiles(g.problem, g.tb_start, g.hg_start, g.kv_rep, g.tb_ptr, g.span_start, g.span_end)
        for f in g.__dataclass_fields__:
            a, b = getattr(g, f), getattr(d, f)
            if isinstance(a, np.ndarray):
                assert isinstance(b, np.ndarray) and a.shape == b.shape and np.array_equal(a, b), f
            elif f != "problem":
                assert a == b, f


def test_a_changed_graph_is_checked_by_rebuilding(grouped):
    from attnplan.ir.graph import is_built
    from attnplan.ir.groups import tiles_derived
    g = grouped.graph
    assert tiles_derived(g)
    pairs = g.tile_pairs.copy()
    pairs[0] += 1
    bad = dataclasses.replace(g, tile_pairs=pairs)
    assert not is_built(bad) and not tiles_derived(bad)
    assert tiles_derived(dataclasses.replace(g))  # an unchanged copy: checked, and equal


def test_per_document_sharding_over_the_piece_limit_is_refused_before_it_allocates(monkeypatch):
    """Under a mask that is not one causal or full piece per document, per_doc lists a piece per
    (document, q chunk, kv chunk): over MAX_TILE_PIECES it stops with a PlanError that says why,
    counted before the rows exist. Under causal the tiles are relations: no piece is listed."""
    from attnplan.ir import graph as graph_mod
    monkeypatch.setattr(graph_mod, "MAX_TILE_PIECES", 2_000)
    lens = [40] * 30  # 30 documents x (16 x 17 / 2) causal chunk pairs on 8 devices = 4,080 pieces
    with pytest.raises(PlanError, match=r"tiling would make [\d,]+ \(mask piece, tile\) rows, over the limit of "
                                        r"2,000 .*per_doc.* 2 x devices chunks"):
        attnplan.compile(seqlens=lens, devices=8, strategy="per_doc", block_size=64, heads=4, kv_heads=2,
                         head_dim=8, mask="causal & (k - q) % 7 != 3")
    g = attnplan.compile(seqlens=lens, devices=8, strategy="per_doc", block_size=64, heads=4, kv_heads=2,
                         head_dim=8).ir.graph
    assert g.relation and len(_all_pieces(g)) == 4_080
    assert attnplan.compile(seqlens=lens, devices=8, strategy="minheap", block_size=64, heads=4, kv_heads=2,
                            head_dim=8).ir.graph is not None  # a strategy that does not cut every document
