"""Cross-attention samples (issue 12, item 3): a sample's queries come from one
sequence (``Lq`` tokens) and its keys from another (``Lk``).

The lowered pieces are checked against a brute-force numpy evaluation of the
mask's definition over ``[0, Lq) x [0, Lk)``; plans of every strategy execute
equal to dense cross-attention written here with torch (forward and
backward), in one process and on gloo processes; bad inputs get one clear
error."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnplan
from attnplan import cli
from attnplan.errors import BatchError, MaskError, PlanError, ShapeError
from attnplan.frontend import load_batch, load_mask, lower_batch, parse_mask
from attnplan.ir.problem import Problem
from attnplan.ir.verify import verify_problem
from attnplan.passes import strategies
from attnplan.runtime.reference import dense_allowed

from .test_mask_arith import expressions

ROOT = Path(__file__).resolve().parents[1]
MASKS = ROOT / "examples" / "masks"
SHAPE = dict(heads=4, kv_heads=2, head_dim=8)


def cross_dense(py: str, lq: int, lk: int) -> np.ndarray:
    """The condition ``py`` (numpy, of q, k, Lq, Lk, L) over ``[0, lq) x [0, lk)``."""
    q, k = np.arange(lq)[:, None], np.arange(lk)[None, :]
    env = {"q": q, "k": k, "Lq": lq, "Lk": lk, "L": max(lq, lk)}
    return np.broadcast_to(eval(py, env), (lq, lk))  # the test's own expression, no input


def pieces_dense(a: np.ndarray, lq: int, lk: int) -> np.ndarray:
    side = max(lq, lk)
    assert (a[:, 1] <= lq).all() and (a[:, 3] <= lk).all()  # inside the sample's queries x keys
    return dense_allowed(a, side)[:lq, :lk]


# ------------------------------------------------------------------ lowering

LENGTH_TERMS = [("k < Lk - {c}", "k < Lk - {c}"), ("q >= Lq - {c}", "q >= Lq - {c}"),
                ("k <= q + Lk - Lq", "k <= q + Lk - Lq"), ("k < L // 2", "k < L // 2"),
                ("q + {c} < Lk", "q + {c} < Lk")]


@settings(max_examples=200)
@given(expressions(), st.sampled_from(range(len(LENGTH_TERMS))), st.sampled_from(["&", "|"]),
       st.integers(0, 5), st.integers(1, 30), st.integers(1, 30))
def test_random_cross_expressions_match_brute_force(expr, term, op, c, lq, lk):
    text, py = expr
    mine, mine_py = (t.format(c=c) for t in LENGTH_TERMS[term])
    text, py = f"({text}) {op} ({mine})", f"({py}) {op} ({mine_py})"
    try:
        prog = parse_mask(text)
    except MaskError as e:  # a form the language refuses: one clear error
        assert e.line == 1 and e.col >= 1
        return
    p = prog.lower_cross(lq, lk)
    want = cross_dense(py, lq, lk)
    assert np.array_equal(pieces_dense(p.a, lq, lk), want)
    assert p.pair_count() == int(want.sum())  # each pair once: the pieces are disjoint


@settings(max_examples=40)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40)), min_size=1, max_size=5),
       st.sampled_from(["causal", "full", "k <= q + Lk - Lq", "(k - q) % 3 == 0 | k < 2", "k // 4 == q // 8"]))
def test_a_cross_batch_packs_each_samples_keys_after_its_queries(pairs, text):
    lq, lk = [a for a, _ in pairs], [b for _, b in pairs]
    prog = parse_mask(text)
    lens = [a + b for a, b in pairs]
    pieces = lower_batch(prog, lens, q_lens=lq)
    problem = Problem(seqlens=lens, pieces=pieces, q_lens=lq, **SHAPE)
    verify_problem(problem)  # every piece inside its sample's queries x keys
    off = np.cumsum([0] + lens[:-1])
    dense = dense_allowed(pieces.a, sum(lens))
    for o, a, b in zip(off, lq, lk):
        want = pieces_dense(prog.lower_cross(a, b).a, a, b)
        assert np.array_equal(dense[o:o + a, o + a:o + a + b], want)
    assert dense.sum() == sum(prog.lower_cross(a, b).pair_count() for a, b in pairs)
    qi, ki = problem.query_index(), problem.key_index()
    assert len(qi) == sum(lq) and len(ki) == sum(lk) and sorted(np.r_[qi, ki].tolist()) == list(range(sum(lens)))


def test_causal_is_top_left_and_the_lengths_are_named():
    assert np.array_equal(pieces_dense(parse_mask("causal").lower_cross(3, 5).a, 3, 5), cross_dense("k <= q", 3, 5))
    br = parse_mask("k <= q + Lk - Lq").lower_cross(3, 5)
    assert br.pair_count() == 3 + 4 + 5  # the last query sees every key
    with pytest.raises(MaskError, match="reserved"):
        parse_mask("let Lq = 3\ncausal")
    # a self-attention sample has Lq = Lk = L
    assert parse_mask("k < Lk - 1 & q < Lq").lower(6).pair_count() == 6 * 5


# ------------------------------------------------------------------ execution

def dense_cross_attention(q, k, v, allowed: np.ndarray, scale: float):
    """Torch dense attention over [Tq, Tk] (GQA by repeating kv heads); rows without keys give 0."""
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    s = s.masked_fill(~torch.from_numpy(np.ascontiguousarray(allowed)), float("-inf"))
    p = torch.softmax(s, -1).nan_to_num()
    return torch.einsum("hqk,khd->qhd", p, vv)


CROSS_MASKS = {"causal": "k <= q", "full": "True", "k <= q + Lk - Lq": "k <= q + Lk - Lq",
               "k // 4 == q // 8": "k // 4 == q // 8", "(k - q) % 3 == 0 | q >= Lq - 2": "((k - q) % 3 == 0) | (q >= Lq - 2)"}


def _block_diag(text: str, lq, lk) -> np.ndarray:
    out = np.zeros((sum(lq), sum(lk)), bool)
    for i, (a, b) in enumerate(zip(lq, lk)):
        oq, ok = sum(lq[:i]), sum(lk[:i])
        out[oq:oq + a, ok:ok + b] = cross_dense(CROSS_MASKS[text], a, b)
    return out


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 48), st.integers(1, 48)), min_size=1, max_size=4),
       st.sampled_from(sorted(CROSS_MASKS)), st.sampled_from(strategies()), st.integers(1, 4),
       st.sampled_from([4, 16, 64]))
def test_every_strategy_executes_cross_attention_equal_to_dense(pairs, text, strategy, devices, block):
    lq, lk = [a for a, _ in pairs], [b for _, b in pairs]
    try:
        plan = attnplan.compile(seqlens_q=lq, seqlens_k=lk, mask=text, devices=devices, strategy=strategy,
                                block_size=block, dtype="float32", **SHAPE)
    except PlanError as e:  # e.g. ulysses over more devices than heads, a mask without pairs
        assert "heads" in str(e) or "no allowed pair" in str(e) or "allows no" in str(e), str(e)
        return
    g = torch.Generator().manual_seed(len(lq) + 7 * devices)
    q = torch.randn(sum(lq), 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(sum(lk), 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(sum(lk), 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    out = attnplan.execute(plan, q, k, v)
    ref = dense_cross_attention(q, k, v, _block_diag(text, lq, lk), 1 / math.sqrt(8))
    dout = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_tiles_never_mix_the_two_sides():
    """The tile pass cuts each sample's queries and keys apart, so a block
    holds one side and no block moves the other side's unused Q or KV."""
    plan = attnplan.compile(seqlens_q=[100, 30], seqlens_k=[50, 70], devices=2, strategy="minheap",
                            block_size=32, **SHAPE)
    g, p = plan.ir.graph, plan.ir.problem
    side = np.zeros(p.tokens, int)
    side[p.key_index()] = 1
    for s, e in zip(g.tb_start, g.tb_end):
        assert len(set(side[s:e].tolist())) == 1
    assert set(side[g.tb_start[g.cb_q]].tolist()) == {0} and set(side[g.tb_start[g.cb_k]].tolist()) == {1}


def test_gloo_processes_run_a_cross_plan_equal_to_dense(tmp_path):
    """``plan run --check --procs 2`` on a cross-attention plan: every rank
    dispatches its query rows and key rows (``side="q"``/``"k"``)."""
    out = tmp_path / "c.plan"
    assert cli.main(["compile", "--seqlens", "300:64,200:96", "--mask", str(MASKS / "cross_causal.mask"),
                     "--devices", "2", "--strategy", "hypergraph", "--block-size", "64", "-o", str(out)]) == 0
    r = subprocess.run([sys.executable, "-m", "attnplan.cli", "run", str(out), "--check", "--procs", "2"],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and "PASS" in r.stdout, r.stdout + r.stderr


def test_a_cross_plan_file_round_trips_and_self_plans_keep_their_bytes(tmp_path):
    kw = dict(devices=2, strategy="zigzag", block_size=16, **SHAPE)
    a = attnplan.compile(seqlens_q=[40, 9], seqlens_k=[17, 30], **kw)
    b = attnplan.compile(seqlens_q=[40, 9], seqlens_k=[17, 30], **kw)
    assert a.to_bytes() == b.to_bytes()
    back = attnplan.Plan.from_bytes(a.to_bytes())
    assert back.ir.problem.q_lens.tolist() == [40, 9] and back.to_bytes() == a.to_bytes()
    from .test_planfile import _body
    plain = attnplan.compile(seqlens=[57, 39], **kw)
    assert "q_lens" not in _body(plain.to_bytes())["problem"] and "q_lens" in _body(a.to_bytes())["problem"]


def test_examples_equal_their_definitions():
    q4 = {"flamingo_cross": lambda q, k, lq, lk: k // 64 == q // 256,
          "cross_causal": lambda q, k, lq, lk: k <= q + lk - lq,
          "magi_cross_slices": lambda q, k, lq, lk: ((q < 128) & (k < 256))
          | ((128 <= q) & (q < 384) & (256 <= k) & (k < 640) & (k - 256 <= q - 128 + 384 - 256))
          | ((384 <= q) & (q < 512) & (k < 640))}
    for name, f in q4.items():
        prog = load_mask(str(MASKS / f"{name}.mask"))
        for lq, lk in ((1024, 256), (512, 640), (37, 500), (1, 1), (300, 64)):
            q, k = np.arange(lq)[:, None], np.arange(lk)[None, :]
            want = np.broadcast_to(f(q, k, lq, lk), (lq, lk))
            assert np.array_equal(pieces_dense(prog.lower_cross(lq, lk).a, lq, lk), want), (name, lq, lk)
    b = load_batch(str(ROOT / "examples" / "batches" / "cross.json"))
    assert b.compile_args() == {"seqlens_q": [1024, 512], "seqlens_k": [256, 128]}


# ------------------------------------------------------------------ bad input

def test_bad_cross_batches_get_one_clear_error(tmp_path):
    kw = dict(devices=2, **SHAPE)
    for bad, match in (
        (dict(seqlens_q=[5]), "together"),
        (dict(seqlens_q=[5], seqlens_k=[3], seqlens=[8]), "together"),
        (dict(seqlens_q=[5, 2], seqlens_k=[3]), "one query and one key"),
        (dict(seqlens_q=[0], seqlens_k=[3]), "cross-attention: sample 0"),
        (dict(seqlens_q=[5], seqlens_k=[3], segments=[[["text", 8]]]), "segments"),
        (dict(seqlens_q=[1 << 25], seqlens_k=[(1 << 25) + 1]), "over attnplan's limit"),
    ):
        with pytest.raises(BatchError, match=match):
            attnplan.compile(**kw, **bad)
    for obj, match in (('{"seqlens_q": [3]}', "seqlens_k"), ('{"seqlens_q": [3], "seqlens_k": [2, 2]}', "one of each"),
                       ('{"seqlens": [3], "seqlens_q": [3], "seqlens_k": [2]}', "and no .seqlens."),
                       ('{"seqlens_q": [3], "seqlens_k": "x"}', "seqlens_k")):
        f = tmp_path / "b.json"
        f.write_text(obj)
        with pytest.raises(BatchError, match=match):
            load_batch(str(f))


@pytest.mark.parametrize("text", ["300:64,200", "3:1:2", "3:x", ":4", "5:0"])
def test_bad_cross_seqlens_on_the_cli_exit_2(text, tmp_path, capsys):
    assert cli.main(["compile", "--seqlens", text, "--devices", "2", "-o", str(tmp_path / "x.plan")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("plan: error:") and len(err.strip().splitlines()) == 1


def test_runtime_inputs_of_a_cross_plan_are_checked():
    plan = attnplan.compile(seqlens_q=[6], seqlens_k=[4], devices=1, **SHAPE)
    q, k = torch.randn(6, 4, 8), torch.randn(4, 2, 8)
    assert attnplan.execute(plan, q, k, k).shape == (6, 4, 8)
    with pytest.raises(ShapeError, match="key tokens=4"):
        attnplan.execute(plan, q, q[:, :2], q[:, :2])
    with pytest.raises(ShapeError, match="two token axes"):
        plan.dispatch(q, 0)
    assert torch.equal(plan.dispatch(q, 0, side="q"), q) and torch.equal(plan.dispatch(k, 0, side="k"), k)
    with pytest.raises(ShapeError, match="6 query tokens"):
        plan.dispatch(k, 0, side="q")
    out = attnplan.attention(q, k, k, plan)  # one device: no process group needed
    torch.testing.assert_close(out, attnplan.execute(plan, q, k, k))
    assert torch.equal(plan.undispatch(out, side="q"), out)


def test_crafted_q_lens_in_a_plan_file_are_refused():
    """A file whose ``problem.q_lens`` does not fit its samples, or moves the
    query/key split under the pieces, is refused with one message."""
    from attnplan.backends.planfile import _arr
    from attnplan.errors import PlanFileError

    from .test_planfile import _body, _repack
    plan = attnplan.compile(seqlens_q=[6, 3], seqlens_k=[4, 5], devices=1, **SHAPE)
    for bad, match in (([6], "one integer per sample \\(2\\)"), ([10, 3], "10 queries of 10 packed tokens"),
                       ([0, 3], "sample 0: 0 queries"),
                       ([5, 3], "invariant 1: mask piece 0 .* not inside its queries")):
        body = _body(plan.to_bytes())
        body["problem"]["q_lens"] = _arr(np.array(bad, np.int64))
        with pytest.raises(PlanFileError, match=match):
            attnplan.Plan.from_bytes(_repack(body))
    body = _body(plan.to_bytes())
    del body["problem"]["q_lens"]  # the same pieces read as self-attention: still valid, a different problem
    assert attnplan.Plan.from_bytes(_repack(body)).ir.problem.q_lens is None


@pytest.mark.parametrize("mode", ["ring", "allgather", "allgather_ring"])
def test_rings_and_gathers_move_only_the_key_side(mode):
    """A ring or an all-gather moves the KV blocks compute reads: never a
    cross sample's query side (zeros), nor keys a mask never sees."""
    from attnplan.ir.schedule import X_KV, XK, XTB
    plan = attnplan.compile(seqlens_q=[100, 37], seqlens_k=[50, 90], devices=4, block_size=16,
                            pipeline=f"tile{{block=16}},zigzag,comm{{mode={mode}}},emit", **SHAPE)
    g, p, x = plan.ir.graph, plan.ir.problem, plan.ir.schedule.xfer
    sent = np.unique(x[x[:, XK] == X_KV][:, XTB])
    key_side = np.isin(g.tb_start[sent], p.key_index())
    assert len(sent) and key_side.all()
    assert set(sent.tolist()) == set(np.unique(g.cb_k).tolist())
    few = attnplan.compile(seqlens=[200], mask="k < 16 & k <= q", devices=4, block_size=16,
                           pipeline=f"tile{{block=16}},zigzag,comm{{mode={mode}}},emit", **SHAPE)
    fx = few.ir.schedule.xfer
    assert np.unique(fx[fx[:, XK] == X_KV][:, XTB]).tolist() == [0]  # the one block of keys 0..15


def test_the_step_level_refuses_cross_lengths_on_the_command_line(capsys):
    assert cli.main(["step", "compare", "--seqlens", "300:64,200:96", "--mesh", "dp=2,cp=2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("plan: error:") and "cross-attention" in err and len(err.strip().splitlines()) == 1


def test_a_cross_batch_object_lowers_and_draws_as_its_lengths_do():
    from attnplan.frontend import Batch, render
    b = Batch((6, 3), seqlens_k=(4, 5))
    prog = parse_mask("k <= q + Lk - Lq")
    assert np.array_equal(lower_batch(prog, b).a, lower_batch(prog, [10, 8], q_lens=[6, 3]).a)
    assert render(prog, b, width=18) == render(prog, [10, 8], width=18, q_lens=[6, 3])
