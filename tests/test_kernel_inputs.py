"""What users hand the runtime: tensors of any strides, softmax scales,
saturated logits, NaN and infinite values, malformed tensors and programs.

* Strided q/k/v (head_dim stride != 1, non-contiguous token or head axes,
  storage offsets, expanded dims) give exactly the contiguous call's output
  and gradients (torch.equal), in process and on 2 gloo ranks.
* A softmax scale that is not a finite number > 0 is refused at entry.
* With q, k scaled by 40 and 100 (fp32), the tiled gradients' relative error
  against a float64 dense reference stays within 5x of ONE untiled kernel
  call's error (before the fix of ``kernels.merge_into``: up to 400x).
* A NaN key/value propagates exactly to the rows dense masked attention
  propagates it to, also when it is a row's only key in a tile call; an
  infinite input follows dense semantics.
* Shape, dtype and device problems in the kernels and the runner raise
  ShapeError; an instruction stream the runner cannot execute raises PlanError.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import attnplan
from attnplan.errors import PlanError, ShapeError
from attnplan.ir.program import ATTN, ATTN_BWD, B_KV, BK, FWD, OP, Program
from attnplan.runtime import dist as rt_dist
from attnplan.runtime import executor, kernels, layout
from attnplan.runtime.check import random_inputs, reference
from attnplan.runtime.reference import dense_allowed

U = 1 << 62
_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _compile(strategy="zigzag", **kw):
    args = dict(seqlens=[40, 23, 9], mask="causal", devices=2, heads=4, kv_heads=2, head_dim=8, block_size=8)
    args.update(kw)
    try:
        return attnplan.compile(strategy=strategy, **args)
    except PlanError as e:  # a strategy that cannot take this shape says so
        if "not supported" in str(e):
            pytest.skip(str(e))
        raise


# ----------------------------------------------------------------- layouts

def _load_cases():
    """tests/_kernel_inputs_cases.py (the layouts, and the 2-rank case), loaded by path."""
    import importlib.util
    path = Path(__file__).with_name("_kernel_inputs_cases.py")
    spec = importlib.util.spec_from_file_location("_kernel_inputs_cases", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


CASES = _load_cases()
LAYOUTS = CASES.LAYOUTS
_permuted, _every_other_dim = CASES.permuted, CASES.every_other_dim
_strided_tokens_with_offset = CASES.strided_tokens_with_offset


def _run(fn, q, k, v, dout):
    """(out, dq, dk, dv) of ``fn(q, k, v)`` with q, k, v as given (leaves)."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), dout)]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("layout", [n for n in LAYOUTS if n != "contiguous"])
def test_strided_inputs_equal_contiguous_in_process(layout):
    """Before: a head_dim stride other than 1 gave max differences of 1.5 (slice)
    and 4e18 (permute) in out and gradients."""
    plan = _compile()
    q, k, v, dout = random_inputs(plan, "float32", 3)
    f = LAYOUTS[layout]
    views = [f(t) for t in (q, k, v)]
    assert all(t.stride(-1) != 1 for t in views) == (layout in ("permuted", "every_other_dim", "expanded_dim"))
    assert not any(t.is_contiguous() for t in views)
    got = _run(lambda *x: attnplan.execute(plan, *x), *views, dout)
    want = _run(lambda *x: attnplan.execute(plan, *x), *(t.contiguous() for t in views), dout)
    assert _same(got, want)
    assert all(torch.isfinite(t).all() for t in got)


@settings(max_examples=25)
@given(data=st.data())
def test_strided_inputs_equal_contiguous_property(data):
    """Any strategy, batch, head layout and any layout per tensor."""
    strategy = data.draw(st.sampled_from(attnplan.strategies()))
    lens = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=3))
    heads, kv = data.draw(st.sampled_from([(1, 1), (4, 2), (2, 1), (4, 4)]))
    mask = data.draw(st.sampled_from(["causal", "full", "sliding_window(5)", "k < 3 | (k <= q)",
                                      "chunked_causal(7)"]))
    try:
        plan = attnplan.compile(seqlens=lens, mask=mask, devices=data.draw(st.integers(1, 4)), heads=heads,
                                kv_heads=kv, head_dim=data.draw(st.sampled_from([4, 8])),
                                block_size=data.draw(st.sampled_from([4, 8, 16])), strategy=strategy)
    except PlanError as e:
        assume("not supported" not in str(e))
        raise
    q, k, v, dout = random_inputs(plan, "float32", data.draw(st.integers(0, 100)))
    names = data.draw(st.tuples(*[st.sampled_from(sorted(LAYOUTS))] * 3))
    views = [LAYOUTS[n](t) for n, t in zip(names, (q, k, v))]
    got = _run(lambda *x: attnplan.execute(plan, *x), *views, dout)
    want = _run(lambda *x: attnplan.execute(plan, *x), *(t.contiguous() for t in views), dout)
    assert _same(got, want), names


def test_strided_inputs_equal_contiguous_through_runtime_dist_one_device():
    """runtime.dist.attention takes the PlanIR; one device runs without torch.distributed."""
    plan = _compile(devices=1)
    q, k, v, dout = random_inputs(plan, "float32", 4)
    views = [_permuted(q), _every_other_dim(k), _strided_tokens_with_offset(v)]
    got = _run(lambda *x: rt_dist.attention(*x, plan.ir), *views, dout)
    want = _run(lambda *x: executor.execute(plan.ir, *x), *(t.contiguous() for t in views), dout)
    assert _same(got, want)


def test_kernels_read_any_strides():
    """The kernels themselves copy an operand whose head_dim stride is not 1."""
    g = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(n, h, 8, generator=g) for n, h in ((12, 4), (9, 2), (9, 2), (12, 4)))
    pieces = np.array([(0, 40, 0, 40, -U, 0), (0, 40, 0, 40, 2, 4)])
    want_f = kernels.attn_fwd(q, k, v, 7, 3, pieces, 0.25)
    want_b = kernels.attn_bwd(q, k, v, want_f[0], dout, want_f[1], 7, 3, pieces, 0.25)
    for f in (_permuted, _every_other_dim, _strided_tokens_with_offset):
        sq, sk, sv = f(q), f(k), f(v)
        got_f = kernels.attn_fwd(sq, sk, sv, 7, 3, pieces, 0.25)
        got_b = kernels.attn_bwd(sq, sk, sv, f(want_f[0]), f(dout), want_f[1], 7, 3, pieces, 0.25)
        assert _same(got_f, want_f) and _same(got_b, want_b), f.__name__


@pytest.mark.slow
def test_strided_inputs_equal_contiguous_on_two_gloo_ranks():
    """Before: NaN output on 2 ranks for a permuted q."""
    from attnplan.tools.launch import run_local
    res = run_local(f"{CASES.__file__}:strided_equals_contiguous", 2, (sorted(LAYOUTS),), timeout=240)
    for r, x in enumerate(res):
        assert x[0] == "ok", f"rank {r}: {x}"
        assert x[1]["ran"] >= 3 and x[1]["bad"] == [], x[1]


# ----------------------------------------------------------------- softmax scale

BAD_SCALES = [0, 0.0, -1.0, -0.5, float("nan"), float("inf"), -float("inf"), True, False, "0.5", [0.5], 10 ** 400]


@pytest.mark.parametrize("scale", BAD_SCALES, ids=repr)
def test_bad_softmax_scale_is_refused_at_entry(scale):
    """Before: 0 and negative scales ran and gave NaN rows or flattened attention."""
    plan = _compile(devices=1)
    q, k, v, _ = random_inputs(plan, "float32", 0)
    with pytest.raises(ShapeError, match="softmax_scale"):
        executor.execute(plan.ir, q, k, v, softmax_scale=scale)
    with pytest.raises(ShapeError, match="softmax_scale"):
        rt_dist.attention(q, k, v, plan.ir, softmax_scale=scale)
    with pytest.raises(ShapeError, match="softmax_scale"):
        kernels.attn_fwd(q, k, v, 0, 0, plan.problem.pieces.a, scale)
    with pytest.raises(attnplan.AttnplanError):  # the face checks too (its own error type)
        attnplan.execute(plan, q, k, v, softmax_scale=scale)


def test_good_softmax_scales_are_used():
    plan = _compile(devices=1)
    q, k, v, _ = random_inputs(plan, "float32", 0)
    a = executor.execute(plan.ir, q, k, v, softmax_scale=np.float32(0.25))
    b = executor.execute(plan.ir, q, k, v, softmax_scale=0.25)
    c = executor.execute(plan.ir, q, k, v, softmax_scale=1)
    assert torch.equal(a, b) and not torch.equal(b, c) and torch.isfinite(c).all()


# ----------------------------------------------------------------- saturated logits

def _rel(got, want) -> float:
    return float((got.double() - want).norm() / want.norm())


def _rel_max(got, want) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


def _untiled_grads(problem, q, k, v, dout, scale):
    """dq, dk, dv of ONE op call (forward + backward) on the whole masked problem."""
    allowed = torch.from_numpy(dense_allowed(problem.pieces.a, problem.tokens))
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))

    def bhsd(x):
        return x.transpose(0, 1).unsqueeze(0)

    o, lse = _FWD(bhsd(q), bhsd(k), bhsd(v), 0.0, False, attn_mask=mask, scale=scale)
    grads = _BWD(bhsd(dout), bhsd(q), bhsd(k), bhsd(v), o, lse, 0.0, False, attn_mask=mask, scale=scale)
    return [g[0].transpose(0, 1) for g in grads]


SATURATED = [  # (problem, factors): measured before the fix, worst ratio 408x / 205x / 91x
    (dict(seqlens=[100, 20, 7], mask="sliding_window(9)", heads=2, kv_heads=1, head_dim=16), (40, 100)),
    (dict(seqlens=[64, 40], mask="causal", heads=4, kv_heads=4, head_dim=8), (40, 100)),
    (dict(seqlens=[120], mask="full", heads=2, kv_heads=1, head_dim=8), (40,)),  # x100: reference grads ~ 0
]


@pytest.mark.parametrize("strategy", ["zigzag", "minheap", "per_doc"])
@pytest.mark.parametrize("case", range(len(SATURATED)))
def test_saturated_logits_gradients_within_5x_of_one_untiled_call(case, strategy):
    problem, factors = SATURATED[case]
    plan = _compile(strategy, devices=2, block_size=8, **problem)
    q, k, v, dout = random_inputs(plan, "float32", 0)
    scale = 1 / math.sqrt(problem["head_dim"])
    for f in factors:
        qs, ks = q * f, k * f
        _, want = reference(plan.problem, qs, ks, v, dout, scale)
        got = _run(lambda *x: attnplan.execute(plan, *x), qs, ks, v, dout)[1:]
        one = _untiled_grads(plan.problem, qs, ks, v, dout, scale)
        for name, g, u, w in zip(("dq", "dk", "dv"), got, one, want):
            for metric in (_rel, _rel_max):
                e, e1 = metric(g, w), metric(u, w)
                assert e <= 5 * e1, f"x{f} {name} {metric.__name__}: tiled {e:.1e} vs one call {e1:.1e}"


def test_merge_weights_stay_exact_for_large_lse():
    """Two partials whose lse values are ~1e4 apart by 4: the merged out must be
    the exact convex combination (before: the dominant weight was off by 2e-3)."""
    l1 = torch.tensor([[12000.0]], dtype=torch.float32)
    l2 = torch.tensor([[11996.0]], dtype=torch.float32)
    o1, o2 = torch.ones(1, 1, 4), -torch.ones(1, 1, 4)
    acc_o, acc_l = o1.clone(), l1.clone()
    kernels.merge_into(acc_o, acc_l, o2, l2)
    w2 = 1 / (1 + math.exp(4.0))  # exact: the lse values are exact in fp32
    assert abs(float(acc_o[0, 0, 0]) - (1 - 2 * w2)) < 1e-6


def test_dead_rows_in_backward_stay_finite_with_large_scores():
    """Rows the caller marks as keyless (lse -inf) get zero gradient, also when
    their scores would overflow exp (lse was replaced by 0 before: 0 * inf)."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(6, 2, 8, generator=g) * 30
    k = torch.randn(7, 2, 8, generator=g) * 30
    v = torch.randn(7, 2, 8, generator=g)
    lse = torch.full((6, 2), float("-inf"))
    out, dout = torch.zeros(6, 2, 8), torch.randn(6, 2, 8, generator=g)
    gq, gk, gv = kernels.attn_bwd(q, k, v, out, dout, lse, 0, 0, np.array([(0, 6, 0, 7, -U, U)]), 0.35)
    assert all(torch.isfinite(x).all() and (x == 0).all() for x in (gq, gk, gv))


# ----------------------------------------------------------------- NaN and infinity

def _dense_nonfinite(problem, q, k, v, scale):
    """bool [T, Hq, D]: where dense masked attention (float64) is not finite. A
    masked key takes no part at all (not even as 0 * NaN): a NaN or infinite
    key or value reaches exactly the rows allowed to see it."""
    allowed = torch.from_numpy(dense_allowed(problem.pieces.a, problem.tokens))
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1)  # rows with keys: NaN if a score is NaN or +inf, or all are -inf
    p = torch.where(allowed.any(1)[:, None], p, torch.zeros_like(p))  # rows without keys: out 0
    terms = p.unsqueeze(-1) * v.transpose(0, 1).unsqueeze(1)  # [H, q, k, D]
    out = torch.where(allowed[None, :, :, None], terms, torch.zeros_like(terms)).sum(2)
    return ~torch.isfinite(out.transpose(0, 1))


def test_nan_key_that_is_a_rows_only_key_in_a_tile_call_propagates():
    """Causal tile of 4 rows (the op's small-call path): row 0's only key is key
    0. Before: row 0 came back 0 with lse 0 (its NaN dropped)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 1, 8, generator=g) for _ in range(3))
    k[0] = float("nan")
    out, lse = kernels.attn_fwd(q, k, v, 0, 0, np.array([(0, 4, 0, 4, -U, 0)]), 0.3)
    assert torch.isnan(out).all() and torch.isnan(lse).all()
    # a later key only: rows 1..3 see key 1 and 0; row 0 sees key 0 only, which is fine
    k[0], k[1] = torch.randn(1, 8, generator=g), float("nan")
    out, lse = kernels.attn_fwd(q, k, v, 0, 0, np.array([(0, 4, 0, 4, -U, 0)]), 0.3)
    assert torch.isfinite(out[0]).all() and torch.isnan(out[1:]).all()


def test_zero_row_with_lse_zero_is_not_mistaken_for_nan():
    """A real row with out 0 and lse 0 (q = 0, one key, v = 0) stays 0."""
    q, k, v = torch.zeros(3, 1, 4), torch.randn(3, 1, 4), torch.zeros(3, 1, 4)
    out, lse = kernels.attn_fwd(q, k, v, 0, 0, np.array([(0, 3, 0, 3, -U, 0)]), 0.5)
    assert (out == 0).all() and lse[0, 0] == 0 and torch.allclose(lse[:, 0], torch.log(torch.arange(1.0, 4.0)))


@settings(max_examples=30)
@given(data=st.data())
def test_nan_and_inf_inputs_follow_dense_attention(data):
    strategy = data.draw(st.sampled_from(["zigzag", "minheap", "per_doc"]))
    lens = data.draw(st.lists(st.integers(1, 30), min_size=1, max_size=3))
    mask = data.draw(st.sampled_from(["causal", "full", "sliding_window(3)", "k <= q & q - k < 5 | k < 2"]))
    plan = attnplan.compile(seqlens=lens, mask=mask, devices=data.draw(st.integers(1, 3)), heads=4, kv_heads=2,
                            head_dim=4, block_size=data.draw(st.sampled_from([2, 4, 8])), strategy=strategy)
    q, k, v, dout = random_inputs(plan, "float32", data.draw(st.integers(0, 50)))
    q = q.abs()  # so that an infinite key gives one infinite score, not inf - inf
    which = data.draw(st.sampled_from(["q", "k", "v"]))
    value = data.draw(st.sampled_from([float("nan"), float("inf"), -float("inf")]))
    t = {"q": q, "k": k, "v": v}[which]
    row = data.draw(st.integers(0, plan.problem.tokens - 1))
    head = data.draw(st.integers(0, t.shape[1] - 1))
    t[row, head, :] = value
    got = attnplan.execute(plan, q, k, v)
    want = _dense_nonfinite(plan.problem, q, k, v, 1 / math.sqrt(4))
    assert torch.equal(~torch.isfinite(got), want), (which, value, row, head)
    if math.isnan(value):
        assert torch.equal(torch.isnan(got), want)


def test_all_minus_inf_scores_give_nan_like_dense_softmax():
    """Row 0 of a causal sample sees only key 0; a -inf key 0 leaves it no
    softmax mass: dense gives NaN, and so must the plan (before: 0)."""
    plan = _compile(seqlens=[12], devices=2, heads=1, kv_heads=1, block_size=4)
    q, k, v, _ = random_inputs(plan, "float32", 0)
    q = q.abs()
    k[0] = -float("inf")
    got = attnplan.execute(plan, q, k, v)
    want = _dense_nonfinite(plan.problem, q, k, v, 1 / math.sqrt(8))
    assert want[0].all() and not want[1:].any()
    assert torch.equal(~torch.isfinite(got), want)


def test_nan_does_not_leak_into_other_samples_in_backward():
    plan = _compile(seqlens=[20, 20], heads=2, kv_heads=1)
    q, k, v, dout = random_inputs(plan, "float32", 1)
    k[3] = float("nan")
    dq, dk, dv = _run(lambda *x: attnplan.execute(plan, *x), q, k, v, dout)[1:]
    assert torch.isnan(dq[3:20]).any() and torch.isfinite(dq[20:]).all()
    assert torch.isfinite(dk[20:]).all() and torch.isfinite(dv[20:]).all()


# ----------------------------------------------------------------- typed errors

def _qkv(*shapes, dtype=torch.float32, device="cpu"):
    return [torch.zeros(s, dtype=dtype, device=device) for s in shapes]


@pytest.mark.parametrize("bad", [
    _qkv((4, 2, 8), (4, 2), (4, 2, 8)),                                   # k 2-d
    _qkv((4, 2, 8), (4, 2, 8), (5, 2, 8)),                                # k, v differ
    _qkv((4, 2, 8), (4, 3, 8), (4, 3, 8)),                                # kv heads do not divide
    _qkv((4, 2, 8), (4, 2, 4), (4, 2, 4)),                                # head_dim differs
    _qkv((4, 2, 8), (4, 2, 8), (4, 2, 8), dtype=torch.int64),             # integer
    [torch.zeros(4, 2, 8), torch.zeros(4, 2, 8, dtype=torch.float64), torch.zeros(4, 2, 8)],  # mixed
    _qkv((4, 2, 8), (4, 2, 8), (4, 2, 8), device="meta"),                 # neither CPU nor CUDA
    [np.zeros((4, 2, 8)), torch.zeros(4, 2, 8), torch.zeros(4, 2, 8)],   # not a tensor
], ids=["k2d", "kv_differ", "heads", "head_dim", "int", "mixed", "meta", "numpy"])
def test_kernel_shape_problems_raise_shape_error(bad):
    q, k, v = bad
    pieces = np.array([(0, 4, 0, 4, -U, U)])
    with pytest.raises(ShapeError):
        kernels.attn_fwd(q, k, v, 0, 0, pieces, 0.5)
    with pytest.raises(ShapeError):
        kernels.attn_bwd(q, k, v, torch.zeros(4, 2, 8), torch.zeros(4, 2, 8), torch.zeros(4, 2), 0, 0, pieces, 0.5)


def test_kernel_bad_pieces_and_backward_operands_raise_shape_error():
    q = torch.zeros(4, 2, 8)
    with pytest.raises(ShapeError, match="pieces"):
        kernels.attn_fwd(q, q, q, 0, 0, np.zeros((2, 5)), 0.5)
    with pytest.raises(ShapeError, match="pieces"):
        kernels.plan_tile(0, 0, 4, 4, [["a"] * 6])
    pieces = np.array([(0, 4, 0, 4, -U, U)])
    with pytest.raises(ShapeError, match="lse"):
        kernels.attn_bwd(q, q, q, q, q, torch.zeros(4, 3), 0, 0, pieces, 0.5)
    with pytest.raises(ShapeError, match="dout"):
        kernels.attn_bwd(q, q, q, q, torch.zeros(3, 2, 8), torch.zeros(4, 2), 0, 0, pieces, 0.5)
    with pytest.raises(ShapeError):
        kernels.merge_into(torch.zeros(4, 2, 8), torch.zeros(4, 2), torch.zeros(3, 2, 8), torch.zeros(3, 2))


def test_execute_input_problems_raise_shape_error():
    plan = _compile(devices=1)
    q, k, v, _ = random_inputs(plan, "float32", 0)
    for args in ((q[1:], k, v), (q, k.double(), v), (q.long(), k.long(), v.long()), (q.to_sparse(), k, v),
                 (q, k, v[:, :, :4])):
        with pytest.raises(ShapeError):
            executor.execute(plan.ir, *args)


def _mutate_first(ir, phase, op, fn):
    """ir with its first ``op`` instruction of ``phase`` (device 0) rewritten by ``fn(row)``."""
    prog = ir.program
    code = [list(map(np.copy, ph)) for ph in prog.code]
    c = code[phase][0]
    i = int(np.flatnonzero(c[:, OP] == op)[0])
    c[i] = fn(c[i].copy(), prog.buffers[phase][0])
    return ir.replace(program=Program(prog.devices, prog.transfers, prog.buffers, tuple(map(tuple, code)),
                                      prog.messages))


def test_runner_refuses_streams_it_cannot_execute():
    """Before: a forward attn rewritten as attn_bwd died with ValueError
    (unpacking), a KV buffer in the q slot with a torch error."""
    plan = _compile(devices=1)
    q, k, v, _ = random_inputs(plan, "float32", 0)

    def as_bwd(row, bufs):
        row[OP] = ATTN_BWD
        return row

    def kv_as_q(row, bufs):
        row[2] = int(np.flatnonzero(bufs[:, BK] == B_KV)[0])
        return row

    def out_of_table(row, bufs):
        row[4] = len(bufs) + 5
        return row

    for fn, msg in ((as_bwd, "not valid in fwd"), (kv_as_q, "of kind KV"), (out_of_table, "not in its buffer")):
        bad = _mutate_first(plan.ir, FWD, ATTN, fn)
        with pytest.raises(PlanError, match=msg):
            executor.run_forward(bad, q, k, v, 0.5)


# ----------------------------------------------------------------- the runtime takes the IR

def test_dist_and_layout_take_the_plan_ir():
    plan = _compile(devices=2)
    other = _compile(devices=2, block_size=16)
    assert rt_dist.plan_fingerprint(plan.ir) == rt_dist.plan_fingerprint(_compile(devices=2).ir)
    assert rt_dist.plan_fingerprint(plan.ir) != rt_dist.plan_fingerprint(other.ir)
    with pytest.raises(PlanError, match="PlanIR"):
        rt_dist.plan_fingerprint(plan)
    with pytest.raises(PlanError, match="PlanIR"):
        rt_dist.undispatch(plan, torch.zeros(plan.problem.tokens, 1))
    x = torch.arange(plan.problem.tokens)
    assert torch.equal(rt_dist.dispatch(plan.ir, x, 1), x[plan.local_index(1)])
    assert np.array_equal(layout.local_index(plan.ir, 1), plan.local_index(1))
    with pytest.raises(PlanError, match="PlanIR"):
        layout.local_index(plan, 1)


def test_check_helpers_refuse_bad_seeds_and_follow_dense_semantics():
    plan = _compile(seqlens=[12], devices=2, heads=1, kv_heads=1, block_size=4)
    for seed in (2 ** 70, -1, 1.5, True):
        with pytest.raises(PlanError, match="seed"):
            random_inputs(plan.ir, "float32", seed)
    with pytest.raises(PlanError, match="dtype"):
        random_inputs(plan.ir, "int8", 0)
    q, k, v, dout = random_inputs(plan.ir, "float32", 0)
    q = q.abs()
    k[0] = -float("inf")  # row 0's only key: no softmax mass, NaN as in dense softmax
    out, _ = reference(plan.problem, q, k, v, dout, 0.5)
    assert torch.equal(~torch.isfinite(out), _dense_nonfinite(plan.problem, q, k, v, 0.5))


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), "soon", True, 1e300])
def test_bad_timeouts_are_refused(timeout):
    plan = _compile(devices=1)
    q, k, v, _ = random_inputs(plan, "float32", 0)
    with pytest.raises(PlanError, match="timeout"):
        rt_dist.attention(q, k, v, plan.ir, timeout=timeout)


@settings(max_examples=60)
@given(data=st.data())
def test_rows_with_keys_matches_dense_mask(data):
    """The helper that tells keyless rows (out 0) from rows without softmax mass (NaN)."""
    T = 24
    pieces = []
    for _ in range(data.draw(st.integers(0, 3))):
        q0, q1 = sorted(data.draw(st.tuples(st.integers(0, T), st.integers(0, T))))
        k0, k1 = sorted(data.draw(st.tuples(st.integers(0, T), st.integers(0, T))))
        lo = data.draw(st.one_of(st.just(-U), st.integers(-8, 8)))
        hi = data.draw(st.one_of(st.just(U), st.integers(-8, 8)))
        pieces.append((q0, q1, k0, k1, lo, hi))
    pieces = np.array(pieces, dtype=np.int64).reshape(-1, 6)
    rows = np.array(data.draw(st.lists(st.integers(0, T - 1), max_size=8)), dtype=np.int64)
    assert np.array_equal(kernels.rows_with_keys(rows, pieces), dense_allowed(pieces, T).any(1)[rows])
