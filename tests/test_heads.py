"""Per-head masks (issue 12, item 2): the query head ``h`` in the mask language.

Lowered pieces of every head equal a brute-force numpy evaluation of the
mask's definition; plans of every strategy execute equal to dense attention
with each head's own mask (written here with torch, forward and backward),
including masks that differ between the query heads of one kv head (GQA);
plan files and the verifier carry the head classes; bad input gets one
clear error."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnplan
from attnplan.errors import MaskError, PlanError, PlanFileError, VerifyError
from attnplan.frontend import load_mask, parse_mask
from attnplan.frontend.lower import lower_heads
from attnplan.ir.verify import verify_graph
from attnplan.passes import strategies
from attnplan.runtime.reference import dense_allowed

from .test_mask_arith import expressions, numpy_mask

ROOT = Path(__file__).resolve().parents[1]
MASKS = ROOT / "examples" / "masks"

HEAD_CONDS = [("h < {c}", lambda h, c, m: h < c), ("h % {m} == {r}", lambda h, c, m: h % m == c % m),
              ("h // {m} == {r}", lambda h, c, m: h // m == c % 3), ("h == {c}", lambda h, c, m: h == c),
              ("h * 2 >= {c} + 1", lambda h, c, m: h * 2 >= c + 1)]


def _cond_text(i: int, c: int, m: int) -> str:
    return HEAD_CONDS[i][0].format(c=c, m=m, r=c % m if "%" in HEAD_CONDS[i][0] else c % 3)


# ------------------------------------------------------------------ lowering

@settings(max_examples=40, deadline=None)
@given(expressions(), expressions(), st.sampled_from(range(len(HEAD_CONDS))), st.integers(0, 7), st.integers(1, 4),
       st.integers(1, 24), st.sampled_from([1, 2, 4, 8]))
def test_each_heads_pieces_match_brute_force(e1, e2, cond, c, m, L, heads):
    text = f"(({_cond_text(cond, c, m)}) & ({e1[0]})) | (!({_cond_text(cond, c, m)}) & ({e2[0]}))"
    try:
        prog = parse_mask(text)
    except MaskError as e:  # a comparison form the language refuses: one clear error
        assert e.line == 1 and e.col >= 1
        return
    pieces, ptr, classes = lower_heads(prog, [L], heads=heads)
    hc = np.zeros(heads, np.int64) if classes is None else classes
    ptr = np.array([0, len(pieces)]) if ptr is None else ptr
    for h in range(heads):
        want = numpy_mask(e1[1], L) if HEAD_CONDS[cond][1](h, c, m) else numpy_mask(e2[1], L)
        mine = pieces.a[ptr[hc[h]]:ptr[hc[h] + 1]]
        assert np.array_equal(dense_allowed(mine, L), want), h
        assert int(dense_allowed(mine, L).sum()) == int(attnplan.ir.mask.Pieces(mine).pair_count())  # disjoint
    # classes are the distinct piece lists, numbered by first head
    arrays = [pieces.a[ptr[i]:ptr[i + 1]].tobytes() for i in range(len(ptr) - 1)]
    assert len(set(arrays)) == len(arrays) and (classes is None or classes[0] == 0)


def test_a_mask_without_h_is_one_class_and_h_needs_a_head():
    prog = parse_mask("causal")
    assert not prog.uses_heads and lower_heads(prog, [5, 3], heads=8)[1:] == (None, None)
    per_head = parse_mask("(h < 2 & causal) | (h >= 2 & full)")
    with pytest.raises(MaskError, match="uses the query head `h`"):
        per_head.lower(4)
    assert per_head.lower(4, head=0).pair_count() == 10 and per_head.lower(4, head=5).pair_count() == 16
    same = parse_mask("(h < 100 & causal)")  # uses h, but every head sees the same mask: one class
    assert lower_heads(same, [5], heads=4)[1:] == (None, None)
    with pytest.raises(MaskError, match="reserved"):
        parse_mask("let h = 3\ncausal")


# ------------------------------------------------------------------ execution

HEAD_MASKS = {
    "(h % 2 == 0 & causal) | (h % 2 == 1 & sliding_window(5))":
        lambda h, q, k: (k <= q) & ((h % 2 == 1) <= (q - k < 5)),
    "(h < 3 & causal) | (h >= 3 & full)": lambda h, q, k: (k <= q) | (h >= 3),
    "(h == 1 & k < 4) | (h != 1 & (k - q) % 3 == 0 & k <= q)":
        lambda h, q, k: (k < 4) if h == 1 else (((k - q) % 3 == 0) & (k <= q)),
    "(h // 2 == 1 & false) | (h // 2 != 1 & causal)": lambda h, q, k: (k <= q) & (h // 2 != 1),
}


def dense_per_head(text: str, lens, heads: int) -> np.ndarray:
    """bool [heads, T, T]: block diagonal over samples, each head's definition."""
    T = sum(lens)
    out = np.zeros((heads, T, T), bool)
    o = 0
    for L in lens:
        q, k = np.arange(L)[:, None], np.arange(L)[None, :]
        for h in range(heads):
            out[h, o:o + L, o:o + L] = np.broadcast_to(HEAD_MASKS[text](h, q, k), (L, L))
        o += L
    return out


def dense_attention_heads(q, k, v, allowed: np.ndarray, scale: float):
    rep = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(rep, 1)) * scale
    s = s.masked_fill(~torch.from_numpy(allowed), float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1).nan_to_num(), v.repeat_interleave(rep, 1))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=4), st.sampled_from(sorted(HEAD_MASKS)),
       st.sampled_from(strategies()), st.integers(1, 4), st.sampled_from([(4, 4), (4, 2), (4, 1), (8, 2)]),
       st.sampled_from([4, 16, 64]))
def test_every_strategy_executes_per_head_masks_equal_to_dense(lens, text, strategy, devices, hk, block):
    heads, kv = hk
    try:
        plan = attnplan.compile(seqlens=lens, mask=text, devices=devices, strategy=strategy, block_size=block,
                                heads=heads, kv_heads=kv, head_dim=8, dtype="float32")
    except PlanError as e:  # ulysses needs whole query heads per device
        assert "heads" in str(e), str(e)
        return
    g = torch.Generator().manual_seed(sum(lens) + devices)
    q = torch.randn(sum(lens), heads, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(sum(lens), kv, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(sum(lens), kv, 8, generator=g, dtype=torch.float64, requires_grad=True)
    out = attnplan.execute(plan, q, k, v)
    ref = dense_attention_heads(q, k, v, dense_per_head(text, lens, heads), 1 / math.sqrt(8))
    dout = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    pairs = int(dense_per_head(text, lens, heads).sum())
    assert plan.problem.pairs() == pairs and int(plan.ir.graph.cb_pairs.sum()) == pairs


def test_head_groups_follow_the_classes_and_kv_heads_are_copied_only_when_needed():
    kw = dict(seqlens=[64], devices=2, heads=8, kv_heads=2, head_dim=8, block_size=16)
    aligned = attnplan.compile(mask="(h < 4 & causal) | (h >= 4 & full)", strategy="ulysses", **kw).ir.graph
    assert aligned.kv_rep == 1 and aligned.hg_class.tolist() == [0, 1]
    mixed = attnplan.compile(mask="(h < 3 & causal) | (h >= 3 & full)", strategy="ulysses", **kw)
    g = mixed.ir.graph
    assert g.kv_rep == 4 and g.hg_start.tolist() == [0, 3, 4] and g.hg_class.tolist() == [0, 1, 1]
    # ulysses keeps each near-even share of the heads on one device: head groups 0 and 1 on device 0
    dev = {int(h): set(mixed.ir.placement.cb_device[g.cb_hg == h].tolist()) for h in range(3)}
    assert dev == {0: {0}, 1: {0}, 2: {1}}
    assert set(zip(g.tile_class[g.cb_tile].tolist(), g.hg_class[g.cb_hg].tolist())) == {(0, 0), (1, 1)}


def test_plan_files_carry_the_classes_and_refuse_crafted_ones():
    from attnplan.backends.planfile import _arr

    from .test_planfile import _body, _repack
    plan = attnplan.compile(seqlens=[400, 9], mask=str(MASKS / "local_global_heads.mask"), devices=2, heads=4,
                            kv_heads=2, head_dim=8, block_size=64, strategy="hypergraph")
    data = plan.to_bytes()
    assert attnplan.Plan.from_bytes(data).to_bytes() == data
    assert _body(data)["problem"]["head_class"]["shape"] == [4]
    assert "head_class" not in _body(attnplan.compile(seqlens=[40], devices=1).to_bytes())["problem"]
    for field, bad, match in (("head_class", [1, 0, 1, 0], "by their first head"), ("head_class", [0, 0, 0, 0], "2 or more"),
                              ("class_ptr", [0, 1], "class_ptr"), ("head_class", [0, 1, 0], "head_class")):
        body = _body(data)
        body["problem"][field] = _arr(np.array(bad, np.int64))
        with pytest.raises(PlanFileError, match=match):
            attnplan.Plan.from_bytes(_repack(body))
    body = _body(data)
    del body["problem"]["head_class"]
    with pytest.raises(PlanFileError, match="per-head masks need both head_class and class_ptr"):
        attnplan.Plan.from_bytes(_repack(body))


def test_the_verifier_refuses_graphs_that_mix_classes():
    plan = attnplan.compile(seqlens=[40], mask="(h < 2 & causal) | (h >= 2 & full)", devices=1, heads=4,
                            kv_heads=4, head_dim=8, block_size=16)
    g = plan.ir.graph
    assert g.n_hg == 2
    with pytest.raises(VerifyError, match="head group 0 holds query heads of mask classes 0 and 1"):
        verify_graph(dataclasses.replace(g, hg_start=np.array([0]), hg_end=np.array([4])))
    with pytest.raises(VerifyError, match="pairs tile .* with head group"):
        verify_graph(dataclasses.replace(g, cb_hg=1 - g.cb_hg))
    with pytest.raises(VerifyError, match="compute blocks where the tiles and head groups"):
        verify_graph(dataclasses.replace(g, cb_tile=g.cb_tile[1:], cb_hg=g.cb_hg[1:]))


def test_examples_equal_their_definitions():
    svg = load_mask(str(MASKS / "svg_heads.mask"))
    lg = load_mask(str(MASKS / "local_global_heads.mask"))
    for L in (1, 37, 300, 640):
        q, k = np.arange(L)[:, None], np.arange(L)[None, :]
        for h in range(8):
            want = (q // 64 == k // 64) if h < 4 else ((k - q) % 64 == 0)
            assert np.array_equal(dense_allowed(svg.lower(L, head=h).a, L), np.broadcast_to(want, (L, L)))
            want = (k <= q) & ((q - k < 256) if h % 2 == 0 else True)
            assert np.array_equal(dense_allowed(lg.lower(L, head=h).a, L), np.broadcast_to(want, (L, L)))


def test_plan_run_on_gloo_processes_with_per_head_masks(tmp_path):
    import subprocess
    import sys

    from attnplan import cli
    out = tmp_path / "h.plan"
    assert cli.main(["compile", "--seqlens", "300,130", "--mask", str(MASKS / "local_global_heads.mask"),
                     "--devices", "2", "--heads", "8", "--kv-heads", "2", "--head-dim", "8", "--strategy", "minheap",
                     "--block-size", "64", "-o", str(out)]) == 0
    assert attnplan.load(out).problem.head_order() is not None  # heads regrouped by class inside each kv head
    r = subprocess.run([sys.executable, "-m", "attnplan.cli", "run", str(out), "--check", "--procs", "2"],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and "PASS" in r.stdout, r.stdout + r.stderr


def test_the_cli_draws_one_head_and_the_step_level_refuses_h(capsys):
    from attnplan import cli
    m = str(MASKS / "svg_heads.mask")
    assert cli.main(["mask", m, "--seqlens", "128", "--head", "5", "--width", "8"]) == 0
    assert "(head 5): 1 sample, 128 tokens, 256 allowed pairs" in capsys.readouterr().out  # 128 x 2 frames
    for argv, msg in ((["mask", m, "--seqlens", "128"], "give a head (plan mask --head H"),
                      (["step", "compare", "--seqlens", "4096,1000", "--mesh", "dp=2,cp=2", "--mask", m],
                       "without the query head")):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("plan: error:") and msg in err


CROSS_HEAD = "(h % 2 == 0 & k <= q + Lk - Lq) | (h % 2 == 1 & (k - q) % 3 == 0)"


def dense_cross_heads(pairs, heads: int) -> np.ndarray:
    """bool [heads, Tq, Tk] of CROSS_HEAD, written here with numpy."""
    lq, lk = [a for a, _ in pairs], [b for _, b in pairs]
    out = np.zeros((heads, sum(lq), sum(lk)), bool)
    oq = ok = 0
    for a, b in pairs:
        q, k = np.arange(a)[:, None], np.arange(b)[None, :]
        for h in range(heads):
            out[h, oq:oq + a, ok:ok + b] = (k <= q + b - a) if h % 2 == 0 else ((k - q) % 3 == 0)
        oq, ok = oq + a, ok + b
    return out


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40)), min_size=1, max_size=3),
       st.sampled_from(strategies()), st.integers(1, 3), st.sampled_from([4, 16]))
def test_per_head_masks_on_cross_attention_samples_equal_dense(pairs, strategy, devices, block):
    """``h`` with ``Lq``/``Lk`` together: every strategy against dense attention per head."""
    try:
        plan = attnplan.compile(seqlens_q=[a for a, _ in pairs], seqlens_k=[b for _, b in pairs], mask=CROSS_HEAD,
                                devices=devices, strategy=strategy, block_size=block, heads=4, kv_heads=2,
                                head_dim=8, dtype="float32")
    except PlanError as e:
        assert "heads" in str(e), str(e)
        return
    g = torch.Generator().manual_seed(devices + len(pairs))
    tq, tk = sum(a for a, _ in pairs), sum(b for _, b in pairs)
    q = torch.randn(tq, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(tk, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(tk, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    out = attnplan.execute(plan, q, k, v)
    ref = dense_attention_heads(q, k, v, dense_cross_heads(pairs, 4), 1 / math.sqrt(8))
    dout = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("pipeline", [
    "tile{block=16},minheap,comm{mode=p2p},divide{stages=3},overlap,emit",
    "tile{block=16},hypergraph,comm{mode=a2a},emit",
    "tile{block=16},zigzag,comm{mode=allgather_ring},emit",
    "tile{block=16,head_groups=2},tile_pool,comm{mode=p2p,relay=node},overlap,emit",
])
def test_scheduling_passes_keep_per_head_and_cross_plans_exact(pipeline):
    """divide, overlap, collectives and relays on per-head masks, with and
    without cross-attention samples: equal to the dense reference."""
    from attnplan.runtime.check import check_plan
    for kw in (dict(seqlens=[120, 40], mask="(h % 2 == 0 & causal) | (h % 2 == 1 & sliding_window(30))"),
               dict(seqlens_q=[50, 30], seqlens_k=[64, 20], mask="(h % 2 == 0 & k <= q + Lk - Lq) | (h % 2 == 1)")):
        plan = attnplan.compile(devices=4, nodes=2, heads=4, kv_heads=2, head_dim=8, pipeline=pipeline, **kw)
        assert plan.ir.problem.n_classes == 2
        assert check_plan(plan)["ok"], (pipeline, kw)


def test_auto_plans_per_head_masks_and_cross_samples_exactly():
    from attnplan.runtime.check import check_plan
    for kw in (dict(seqlens=[300, 100, 50], mask=str(MASKS / "local_global_heads.mask")),
               dict(seqlens_q=[300, 100], seqlens_k=[64, 128], mask=CROSS_HEAD)):
        plan = attnplan.compile(devices=4, nodes=2, heads=4, kv_heads=2, head_dim=8, block_size=32, strategy="auto",
                                **kw)
        assert plan.meta["strategy"].startswith("auto:") and plan.meta["candidates"]
        assert check_plan(plan)["ok"], kw


def test_query_heads_of_a_kv_head_are_regrouped_by_class():
    """Alternating classes inside a kv head (0, 1, 0, 1): the plan orders each
    kv head's query heads by class (0, 0, 1, 1), so 2 copies of the kv head
    serve them, not 4; results stay in the caller's head order."""
    plan = attnplan.compile(seqlens=[400, 77], mask=str(MASKS / "local_global_heads.mask"), devices=2, heads=8,
                            kv_heads=2, head_dim=8, block_size=64, strategy="hypergraph", dtype="float32")
    p, g = plan.problem, plan.ir.graph
    assert p.head_order().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert g.kv_rep == 2 and g.hg_class.tolist() == [0, 1, 0, 1]
    same = attnplan.compile(seqlens=[400, 77], mask="(h < 4 & sliding_window(256)) | (h >= 4 & causal)", devices=2,
                            heads=8, kv_heads=2, head_dim=8, block_size=64)
    assert same.problem.head_order() is None and same.ir.graph.kv_rep == 1  # classes on kv heads: nothing moves
    from attnplan.runtime.check import check_plan
    assert check_plan(plan)["ok"]


@pytest.mark.parametrize("heads, kv, mask", [
    (3, 3, "(h < 1 & causal) | (h >= 1 & full)"), (5, 5, "(h < 1 & causal) | (h >= 1 & full)"),
    (4, 4, "(h == 2 & causal) | (h != 2 & full)"), (6, 3, "(h == 0 & false) | (h != 0 & sliding_window(3))"),
    (8, 8, "(h % 2 == 0 & causal) | (h % 2 == 1 & sliding_window(5))")])
def test_head_group_counts_that_divide_no_kv_count_plan_everywhere(heads, kv, mask):
    """Class cuts can leave a head-group count that divides no kv-head count
    (3 heads cut 1 + 2): hypergraph's head-group choice, and so auto, still
    plan (found by review: a crash), exactly."""
    from attnplan.runtime.check import check_plan
    for devices in (1, 2, 3):
        for strategy in ("hypergraph", "auto"):
            plan = attnplan.compile(seqlens=[64, 9], mask=mask, heads=heads, kv_heads=kv, head_dim=4,
                                    devices=devices, strategy=strategy, block_size=16)
            assert check_plan(plan)["ok"], (devices, strategy)


def test_what_does_not_depend_on_the_head_is_lowered_once(monkeypatch):
    """Subexpressions that name neither ``h`` nor a let that does are lowered
    once per sample and shared by every head (frontend/heads.py), with the
    same pieces as lowering each head alone."""
    from attnplan.frontend.evaluate import Evaluator
    calls = []
    real = Evaluator._builtin
    monkeypatch.setattr(Evaluator, "_builtin", lambda self, node, a, v: calls.append(node.name) or real(self, node, a, v))
    text = "let local = sliding_window(5)\nmask = (h < 2 & local) | (h >= 2 & (causal | k < h))"
    pieces, ptr, classes = lower_heads(parse_mask(text), [40, 40, 17], heads=8)
    # the parse's static check once, then two distinct samples (not 2 x 8 heads)
    assert calls.count("sliding_window") == 3 and calls.count("causal") == 3
    prog = parse_mask(text)
    for h in range(8):
        c = classes[h]
        alone = np.concatenate([prog.lower(L, head=h).a + [o, o, o, o, 0, 0] for L, o in ((40, 0), (40, 40), (17, 80))])
        assert np.array_equal(dense_allowed(pieces.a[ptr[c]:ptr[c + 1]], 97), dense_allowed(alone, 97)), h


@settings(max_examples=40, deadline=None)
@given(expressions(), expressions(), st.integers(0, 7), st.sampled_from(["&", "|"]), st.integers(1, 20),
       st.sampled_from([2, 4, 8]))
def test_head_free_terms_combined_once_give_each_heads_mask(e1, e2, c, op, L, heads):
    """``h < c OP e1 OP e2``: the head-free terms are combined once per sample
    and shared; every head's pieces still equal the brute force."""
    text = f"({e1[0]}) {op} h < {c} {op} ({e2[0]})"
    try:
        prog = parse_mask(text)
    except MaskError as e:
        assert e.line == 1 and e.col >= 1
        return
    pieces, ptr, classes = lower_heads(prog, [L, L + 3], heads=heads)
    hc = np.zeros(heads, np.int64) if classes is None else classes
    ptr = np.array([0, len(pieces)]) if ptr is None else ptr
    for h in range(heads):
        for o, n in ((0, L), (L, L + 3)):
            a, b = numpy_mask(e1[1], n), numpy_mask(e2[1], n)
            want = (a & b & (h < c)) if op == "&" else (a | b | (h < c))
            mine = pieces.a[ptr[hc[h]]:ptr[hc[h] + 1]].copy()
            mine = mine[(mine[:, 0] >= o) & (mine[:, 0] < o + n)]
            mine[:, :4] -= o
            assert np.array_equal(dense_allowed(mine, n), want), (h, o)
