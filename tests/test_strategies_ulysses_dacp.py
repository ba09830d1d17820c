"""Properties of the ``ulysses`` (head split) and ``dacp`` (Skrull local /
distributed classification) placement strategies. Execution equals dense
attention for both in test_execute.py; here: balance, the transfers they
imply, DACP's budget and roll-back, errors and determinism."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnplan
from attnplan.ir.schedule import X_KV, X_O, X_Q, XDST, XHG, XK, XSRC, XTB
from attnplan.passes.dacp import (DISTRIBUTED, all_distributed_tokens, classify, dacp_classify, doc_pairs,
                                  zigzag_share)
from attnplan.runtime.check import TOLERANCE, random_inputs, reference

MASKS = ["causal", "full", "sliding_window(7)", "streaming(3, 5)", "shared_question(3, 0.2)",
         "causal_blockwise(4, 2)", "block_causal(6)", "prefix_lm(5)", "chunked_causal(9)",
         "(sliding_window(4)) | (k < 2 & k <= q)", "k < 3 & q >= 5"]
LENS = st.lists(st.integers(1, 90), min_size=1, max_size=8)


def executes_exactly(plan, seed=0):
    """fp32 execution (out and grads) equals dense float64 attention."""
    p = plan.problem
    q, k, v, dout = random_inputs(plan, "float32", seed)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = attnplan.execute(plan, qg, kg, vg)
    grads = torch.autograd.grad(out, (qg, kg, vg), dout)
    ref_out, ref_grads = reference(p, q, k, v, dout, 1.0 / math.sqrt(p.head_dim))
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
        err = float((got.detach().double() - want).abs().max()) / max(1.0, float(want.abs().max()))
        assert err <= TOLERANCE["float32"][name], f"{name}: error {err:.2e}"


def xfer_set(ir, kind):
    x = ir.schedule.xfer
    return {tuple(r) for r in x[x[:, XK] == kind][:, [XTB, XHG, XSRC, XDST]].tolist()}


# ulysses ---------------------------------------------------------------------------------------------------------

@settings(max_examples=40)
@given(LENS, st.sampled_from(MASKS),
       st.sampled_from([(1, 4), (2, 4), (4, 4), (2, 2), (3, 6), (8, 8), (4, 2), (8, 2), (6, 4), (3, 1)]),
       st.sampled_from([1, 2, 8, 16, 2048]))
def test_ulysses_balances_compute_exactly_on_any_mask(lens, mask, shape, block):
    devices, kv = shape
    heads = math.lcm(2 * kv, devices)
    plan = attnplan.compile(seqlens=lens, mask=mask, devices=devices, heads=heads, kv_heads=kv, head_dim=8,
                            strategy="ulysses", block_size=block)
    ir, s = plan.ir, plan.stats()
    g, pl = ir.graph, ir.placement
    # every device computes whole sequences for kv / N kv heads (copies of them beyond the kv heads): equal
    # FLOPs on any mask
    assert g.kv_rep == (math.lcm(kv, devices) // kv if devices > kv else 1)
    assert g.n_hg == devices and np.array_equal(pl.cb_device, g.cb_hg)
    assert (g.hg_heads == heads // devices).all()
    assert len(set(s["per_device"]["flops"])) == 1 and s["compute_imbalance"] == 1.0
    assert sum(s["per_device"]["pairs"]) == s["pairs"]
    # homes: a contiguous, even split of the packed sequence
    T = plan.problem.tokens
    assert (np.diff(pl.home) >= 0).all()
    tokens = np.bincount(pl.home, weights=g.tb_len, minlength=devices)
    assert tokens.max() <= -(-T // devices) and tokens.min() >= T // devices
    # transfers: Q and KV of every token block to every other head-group device that uses it, O back
    home = pl.home
    qs = {(int(t), h) for t in np.unique(g.tile_q).tolist() for h in range(devices) if h != home[t]}
    ks = {(int(t), h) for t in np.unique(g.tile_k).tolist() for h in range(devices) if h != home[t]}
    assert xfer_set(ir, X_Q) == {(t, h, int(home[t]), h) for t, h in qs}
    assert xfer_set(ir, X_KV) == {(t, h, int(home[t]), h) for t, h in ks}
    assert xfer_set(ir, X_O) == {(t, h, h, int(home[t])) for t, h in qs}


@pytest.mark.parametrize("devices,kv,heads", [(4, 2, 4), (8, 2, 8), (2, 1, 2), (3, 1, 6), (6, 4, 12), (4, 1, 8)])
def test_ulysses_beyond_kv_heads_copies_them(devices, kv, heads):
    """N > kv_heads: every kv head copied lcm(kv, N) / kv times, as yunchang
    does; the plan equals, block for block and byte for byte moved, Ulysses on
    the same batch with the copies as real kv heads, and executes exactly (the
    copies' gradients summed back into their head)."""
    lens, kw = [70, 33, 5, 120], dict(mask="causal", devices=devices, heads=heads, head_dim=8, block_size=32,
                                      strategy="ulysses", dtype="float32")
    plan = attnplan.compile(seqlens=lens, kv_heads=kv, **kw)
    g, rep = plan.ir.graph, math.lcm(kv, devices) // kv
    assert g.kv_rep == rep and g.kv_virtual == kv * rep and g.n_hg == devices
    assert plan.stats()["compute_imbalance"] == 1.0
    real = attnplan.compile(seqlens=lens, kv_heads=kv * rep, **kw)
    for f in ("hg_start", "hg_end", "cb_tile", "cb_hg"):
        assert np.array_equal(getattr(g, f), getattr(real.ir.graph, f)), f
    assert np.array_equal(plan.ir.schedule.xfer, real.ir.schedule.xfer)
    s, r = plan.stats(), real.stats()
    for key in ("comm_bytes_total", "messages", "predicted_s", "pairs"):
        assert s[key] == r[key], key
    executes_exactly(plan)


@pytest.mark.parametrize("devices,kv,heads,match", [
    (4, 2, 2, "heads must be a multiple of devices"), (3, 1, 2, "heads must be a multiple of devices"),
    (8, 2, 4, "4 query heads is not supported")])
def test_ulysses_needs_whole_query_heads(devices, kv, heads, match):
    with pytest.raises(attnplan.PlanError, match=match):
        attnplan.compile(seqlens=[100, 50], mask="causal", devices=devices, heads=heads, kv_heads=kv,
                         strategy="ulysses")


def test_ulysses_without_replication_keeps_the_kv_head_limit():
    with pytest.raises(attnplan.PlanError, match="4 devices with 2 kv heads is not supported with replicate=false"):
        attnplan.compile(seqlens=[100, 50], mask="causal", devices=4, heads=8, kv_heads=2,
                         pipeline="tile,ulysses{replicate=false},comm,emit")


def test_ulysses_uneven_head_groups_opt_in():
    with pytest.raises(attnplan.PlanError, match="not supported.*multiple of devices"):
        attnplan.compile(seqlens=[40, 23], mask="causal", devices=3, heads=4, kv_heads=4, strategy="ulysses")
    plan = attnplan.compile(seqlens=[40, 23], mask="causal", devices=3, heads=4, kv_heads=4, head_dim=8,
                            pipeline="tile{block=16},ulysses{uneven=true},comm,emit", dtype="float32")
    flops = np.array(plan.stats()["per_device"]["flops"])
    # kv heads split 1/1/2 (build_graph's near-even split): imbalance ceil(4/3) / (4/3) = 1.5
    assert sorted(flops // flops.min()) == [1, 1, 2]
    assert plan.stats()["compute_imbalance"] == pytest.approx(1.5)
    executes_exactly(plan)


# dacp ------------------------------------------------------------------------------------------------------------

def doc_of(problem, tb_start):
    return np.searchsorted(problem.offsets, tb_start, "right") - 1


@pytest.mark.parametrize("mask", ["causal", "sliding_window(64)", "full", "shared_question(3, 0.2)",
                                  "streaming(8, 32)"])
def test_dacp_local_documents_move_nothing_distributed_span_all(mask):
    lens = [3000, 40, 700, 15, 1200, 90, 64, 256, 5, 2000, 333, 1]
    n = 4
    plan = attnplan.compile(seqlens=lens, mask=mask, devices=n, heads=4, kv_heads=2, head_dim=8,
                            strategy="dacp", block_size=128)
    ir, p = plan.ir, plan.problem
    g, pl = ir.graph, ir.placement
    c = dacp_classify(p, n)
    local = np.flatnonzero(c.device >= 0)
    assert len(local) and len(c.distributed), "the batch should have both kinds"
    # per token: its document, its block (varlen groups hold spans of many documents), its device
    tok_doc = np.repeat(np.arange(len(lens)), lens)
    tok_block = np.empty(p.tokens, np.int64)
    tok_block[g.block_rows(np.arange(g.n_tb))] = np.repeat(np.arange(g.n_tb), g.tb_len)
    tok_home = pl.home[tok_block]
    # compute runs where Q lives
    assert np.array_equal(pl.cb_device, pl.home[g.cb_q])
    # local: every token on the document's device, no transfer touches it
    for d in local.tolist():
        assert (tok_home[tok_doc == d] == c.device[d]).all()
    moved = np.isin(tok_block, ir.schedule.xfer[:, XTB])
    assert not np.isin(tok_doc[moved], local).any()
    # distributed: each device holds its per-document zigzag share; documents of >= 2N tokens span all devices
    for d in c.distributed.tolist():
        held = np.bincount(tok_home[tok_doc == d], minlength=n)
        assert np.array_equal(held, zigzag_share(lens[d], n))
        if lens[d] >= 2 * n:
            assert (held > 0).all()
    # the classification's token accounting is the plan's
    assert np.array_equal(np.bincount(pl.home, weights=g.tb_len, minlength=n).astype(np.int64), c.tokens)
    assert (c.tokens <= c.bucket).all()
    assert len(ir.schedule.xfer) > 0  # the distributed documents do move KV


def test_dacp_auto_bucket_and_token_balance():
    lens = [5000, 3000, 1000] + [200] * 30 + [37] * 11
    n = 8
    p = attnplan.compile(seqlens=lens, mask="causal", devices=n, heads=2, kv_heads=1, head_dim=8,
                         strategy="dacp", block_size=256)
    T = sum(lens)
    c = dacp_classify(p.problem, n)
    assert c.bucket == max(math.ceil(1.1 * T / n), all_distributed_tokens(lens, n))
    s = p.stats()
    assert max(s["per_device"]["tokens"]) <= c.bucket
    assert s["token_imbalance"] <= c.bucket / (T / n) + 1e-9
    # the long documents are sharded, the many short ones stay local
    assert 0 in c.distributed and (c.device[3:] >= 0).sum() >= 35


@settings(max_examples=150)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=10), st.integers(1, 6), st.floats(0.3, 1.6))
def test_dacp_budget_respected_where_feasible(lens, n, frac):
    loads = [x * (x + 1) // 2 for x in lens]
    T = sum(lens)
    c_dist = all_distributed_tokens(lens, n)
    bucket = max(1, int(frac * max(c_dist, -(-T // n))))
    c = classify(lens, loads, n, bucket)
    if bucket >= c_dist:
        assert c is not None  # every document distributed fits: the heuristic never gets stuck
    if c is None:
        return
    assert (c.tokens <= bucket).all()
    # tokens are whole local documents plus the zigzag shares of distributed ones
    want = np.zeros(n, np.int64)
    for d, L in enumerate(lens):
        if c.device[d] == DISTRIBUTED:
            want += zigzag_share(L, n)
        else:
            want[c.device[d]] += L
    assert np.array_equal(c.tokens, want)
    assert set(c.rollbacks) <= set(c.distributed.tolist())
    assert c.guard_rollbacks == 0  # the pseudo-code's own steps keep every device within the bucket
    # if everything fits on every device, nothing is ever split
    if bucket >= T:
        assert len(c.distributed) == 0


def test_dacp_roll_back_constructed_case():
    # bucket 8, two devices, lengths 2 < 6 < 7 (causal loads 3, 21, 28):
    #   2 -> local on d0 (RB 6, 8); 6 -> local on d1, the least loaded (RB 6, 2);
    #   7 fits locally nowhere (RB < 7) and not distributed (d1 would need 4 of its 2 left):
    #   roll back d1's local document 6 -> distributed (RB 3, 5); replay 7 -> distributed (RB 0, 1).
    lens = [2, 6, 7]
    c = classify(lens, [3, 21, 28], 2, 8)
    assert c.device.tolist() == [0, DISTRIBUTED, DISTRIBUTED]
    assert c.rollbacks == (1,)
    assert c.tokens.tolist() == [8, 7]
    # the same through the pass, with the mask's real pair counts
    plan = attnplan.compile(seqlens=lens, mask="causal", devices=2, heads=2, kv_heads=1, head_dim=8,
                            pipeline="tile{block=4},dacp{bucket=8},comm,emit", dtype="float32")
    p = plan.problem
    assert doc_pairs(p).tolist() == [3, 21, 28]
    assert plan.stats()["per_device"]["tokens"] == [8, 7]
    g, pl = plan.ir.graph, plan.ir.placement
    home = np.empty(p.tokens, np.int64)  # per token (varlen groups: a block's rows are its spans)
    home[g.block_rows(np.arange(g.n_tb))] = np.repeat(pl.home, g.tb_len)
    tok_doc = doc_of(p, np.arange(p.tokens))
    assert (home[tok_doc == 0] == 0).all()
    assert set(home[tok_doc == 1].tolist()) == set(home[tok_doc == 2].tolist()) == {0, 1}
    executes_exactly(plan)


def test_dacp_rules_least_loaded_then_roomiest():
    # three devices, bucket 3; loads fall with length so that the least-loaded device fills up first:
    # 1 -> d0, 1 -> d1, 2 -> d2 (RB 2, 2, 1); the last 2: least loaded is d2 (rule 2) but it has 1 token left,
    # so the roomiest device takes it (rule 1: d0, ties to the lowest index) and nothing is split.
    c = classify([1, 1, 2, 2], [99, 99, 98, 98], 3, 3)
    assert c.device.tolist() == [0, 1, 2, 0] and c.rollbacks == () and c.tokens.tolist() == [3, 1, 2]
    # "least loaded" is attention work, not tokens: the 2 joins the light 1 on d1, not the heavy one on d0
    assert classify([1, 1, 2], [50, 1, 1], 2, 10).device.tolist() == [0, 1, 1]


def test_dacp_roll_back_takes_the_longest_local_document():
    # bucket 4, two devices, lengths 1, 1, 2, 4: 1 -> d0, 1 -> d1, 2 -> d0 (RB 1, 3); 4 fits nowhere and its
    # share (2, 2) not on d0: roll back d0's latest (= longest) local document, the 2 (RB 2, 2); replay 4 ->
    # distributed. Rolling back d0's first document (the 1) instead would free too little.
    c = classify([1, 1, 2, 4], [1, 1, 3, 10], 2, 4)
    assert c.device.tolist() == [0, 1, DISTRIBUTED, DISTRIBUTED]
    assert c.rollbacks == (2,) and c.tokens.tolist() == [4, 4]


def test_dacp_stuck_bucket_is_a_clear_error():
    # 1 -> d0, 4 -> d1; 5 fits nowhere; roll back 4, then 1; d0 still lacks room for 5's share: stuck
    assert classify([1, 4, 5], [1, 10, 15], 2, 5) is None
    with pytest.raises(attnplan.PlanError, match=r"bucket=5 .*too small.*bucket >= 6"):
        attnplan.compile(seqlens=[1, 4, 5], mask="causal", devices=2, heads=1, kv_heads=1,
                         pipeline="tile{block=4},dacp{bucket=5},comm,emit")


@pytest.mark.parametrize("spec,msg", [("dacp{bucket=-1}", "bucket must be"), ("dacp{slack=0.5}", "slack must be"),
                                      ("dacp{slack=x}", "slack must be float")])
def test_dacp_bad_options(spec, msg):
    with pytest.raises(attnplan.PlanError, match=msg):
        attnplan.compile(seqlens=[10], mask="causal", devices=2, pipeline=f"tile,{spec},comm,emit")


# both ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["ulysses", "dacp"])
def test_deterministic_plans(strategy):
    case = {"seqlens": [900, 33, 410, 7, 1500, 64], "mask": "sliding_window(100) | (k < 3 & k <= q)", "devices": 4,
                "heads": 8, "kv_heads": 4, "head_dim": 16, "block_size": 64, "strategy": strategy}
    a, b = attnplan.compile(**case), attnplan.compile(**case)
    assert a.canonical_bytes() == b.canonical_bytes()


@pytest.mark.parametrize("devices,kv", [(8, 2), (8, 8), (32, 2), (32, 8)])
@pytest.mark.parametrize("strategy", ["ulysses", "usp"])
def test_ulysses_and_usp_at_8_and_32_devices_with_2_and_8_kv_heads(devices, kv, strategy):
    """The communication issue's shapes: 32 query heads, 4 nodes at 32 devices;
    every plan verifies, computes every pair once and (8 devices) executes exactly."""
    lens = [300, 120, 64, 17, 9]
    plan = attnplan.compile(seqlens=lens, mask="causal", devices=devices, nodes=max(1, devices // 8), heads=32,
                            kv_heads=kv, head_dim=8, block_size=32, strategy=strategy, dtype="float32")
    s, g = plan.stats(), plan.ir.graph
    assert s["pairs"] == sum(s["per_device"]["pairs"]) == sum(n * (n + 1) // 2 for n in lens) * 32
    if strategy == "ulysses":
        assert g.kv_rep == max(1, devices // kv) and s["compute_imbalance"] == 1.0
    else:  # the default degree divides the kv heads: a node's worth of devices at 8 kv heads, no copies
        assert g.kv_rep == 1 and g.n_hg == min(8, kv)
    if devices == 8:
        executes_exactly(plan)
