"""The tile pass packs short documents into shared blocks (issue 9, item 1:
varlen groups): one compute block holds the tiles of many short documents,
each piece still rounded to the kernel tile on its own."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnplan
from attnplan.backends.cost import get_profile, rounded_pairs
from attnplan.frontend import load_mask, lower_batch
from attnplan.ir.graph import build_graph, sample_cuts
from attnplan.ir.problem import Problem
from attnplan.runtime.check import reference


def problem(lens, mask="causal"):
    lens = np.asarray(lens, np.int64)
    prog = load_mask(mask)
    return Problem(seqlens=lens, heads=4, kv_heads=2, head_dim=16, pieces=lower_batch(prog, lens.tolist(), None),
                   mask=prog.source)


@settings(max_examples=60)
@given(lens=st.lists(st.integers(1, 700), min_size=1, max_size=40), block=st.sampled_from([1, 7, 64, 256, 512]))
def test_packed_blocks(lens, block):
    p = problem(lens)
    cuts = np.unique(np.concatenate([sample_cuts(p, block), [p.tokens]]))
    size = np.diff(cuts)
    off = p.offsets
    assert cuts[0] == 0 and (size > 0).all() and (size <= block).all()
    first = np.searchsorted(off, cuts[:-1], "right") - 1            # the sample each block starts in
    last = np.searchsorted(off, cuts[1:] - 1, "right") - 1          # the sample of its last token
    lens_ = np.asarray(lens)
    multi = first != last
    # a block spans several samples only if they are all short, whole, and start it
    assert (cuts[:-1][multi] == off[first[multi]]).all() and (cuts[1:][multi] == off[last[multi] + 1]).all()
    for a, b in zip(first[multi].tolist(), last[multi].tolist()):
        assert (lens_[a:b + 1] <= block).all()
    # long samples are cut every `block` tokens from their start, exactly as without packing
    for i in np.flatnonzero(lens_ > block).tolist():
        inside = cuts[(cuts >= off[i]) & (cuts < off[i + 1])]
        assert np.array_equal(inside, off[i] + np.arange(0, lens_[i], block))
    # greedy: a packed block could not also have taken the next short sample
    nxt = last + 1
    ok = (nxt < len(lens_)) & (lens_[np.minimum(nxt, len(lens_) - 1)] <= block) & (lens_[first] <= block)
    assert (size[ok] + lens_[nxt[ok]] > block).all()
    # pack=False: one block per short sample, as before
    plain = np.unique(np.concatenate([sample_cuts(p, block, pack=False), [p.tokens]]))
    assert set(off.tolist()) <= set(plain.tolist()) and (np.diff(plain) <= block).all()


def test_a_block_of_many_documents_is_one_compute_block_with_their_pieces():
    lens = [30] * 50
    p = problem(lens)
    g = build_graph(p, sample_cuts(p, 2048))
    assert g.n_tb == 1 and g.n_cb == 1 and len(g.pieces) == 50      # one varlen call, 50 documents
    alone = build_graph(p, sample_cuts(p, 2048, pack=False))
    assert alone.n_cb == 50 and g.tile_pairs.sum() == alone.tile_pairs.sum()
    # per-piece tile rounding: the packed block costs what the 50 documents cost one by one
    prof = get_profile("h100")
    assert rounded_pairs(g, prof.tile_q).sum() == pytest.approx(rounded_pairs(alone, prof.tile_q).sum())


@settings(max_examples=10, deadline=None)
@given(lens=st.lists(st.integers(1, 90), min_size=2, max_size=30), devices=st.sampled_from([2, 4]),
       strategy=st.sampled_from(["zigzag", "minheap", "hypergraph", "tile_pool", "dacp", "per_doc"]),
       mask=st.sampled_from(["causal", "sliding_window(9)", "full"]))
def test_packed_plans_equal_dense_attention(lens, devices, strategy, mask):
    plan = attnplan.compile(seqlens=lens, mask=mask, devices=devices, heads=4, kv_heads=2, head_dim=16,
                            block_size=64, strategy=strategy)
    assert plan.ir.graph.n_tb < len(lens) or max(lens) > 64 or len(lens) <= devices  # documents share blocks
    g = torch.Generator().manual_seed(len(lens))
    T = sum(lens)
    q, k, v = (torch.randn(T, h, 16, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    dout = torch.randn(T, 4, 16, generator=g, dtype=torch.float64)
    out = attnplan.execute(plan, q, k, v)
    out.backward(dout)
    ref_out, ref_grads = reference(plan.ir.problem, q.detach(), k.detach(), v.detach(), dout, 1.0 / math.sqrt(16))
    torch.testing.assert_close(out.detach(), ref_out, rtol=1e-9, atol=1e-9)
    for got, want in zip((q.grad, k.grad, v.grad), ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
