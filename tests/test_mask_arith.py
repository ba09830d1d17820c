"""Position arithmetic in the mask language (issue 12, items 1, 4, 5): ``%`` and
``//`` on q, k and k - q, the builtins people name (dilated windows, NATTEN,
sliding tiles, global tokens, documents), attention-gym's masks written in the
language, and long or deep text.

Every mask is checked against a dense numpy evaluation of its definition,
written here independently of the frontend (numpy's ``//`` and ``%`` floor like
the language's); pair counts equal the dense counts, which also proves the
pieces disjoint."""

from __future__ import annotations

import glob
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnplan
from attnplan import cli
from attnplan.errors import MaskError
from attnplan.frontend import load_batch, load_mask, lower_batch, parse_mask, setops
from attnplan.frontend.setops import Budget
from attnplan.ir.limits import MAX_MASK_DEPTH, MAX_MASK_PIECES, MAX_TOKENS
from attnplan.ir.mask import Pieces
from attnplan.runtime.reference import dense_allowed

ROOT = Path(__file__).resolve().parents[1]
MASKS = ROOT / "examples" / "masks"
QA = ROOT / "examples" / "batches" / "qa.json"

FORM_ERRORS = ("not of the form", "not both", "cannot be lowered")


def grid(L):
    return np.arange(L)[:, None], np.arange(L)[None, :]


def check(p: Pieces, expected: np.ndarray, L: int):
    """The pieces hold exactly the expected pairs, each once, inside [0, L)^2."""
    expected = np.broadcast_to(expected, (L, L))
    assert np.array_equal(dense_allowed(p.a, L), expected)
    assert p.pair_count() == int(expected.sum())
    a = p.a
    assert (a[:, 0] >= 0).all() and (a[:, 1] <= L).all() and (a[:, 2] >= 0).all() and (a[:, 3] <= L).all()


# ------------------------------------------------------ random expressions

# positions of the two families a comparison may take floors of: q and k, or k - q
GRID_BASES = ["q", "k", "(q + {c})", "(k - {c})", "(q - {c})"]
DIAG_BASES = ["(k - q)", "(q - k)", "(k - q + {c})", "(q - k - {c})"]


@st.composite
def atoms(draw, bases):
    base = draw(st.sampled_from(bases)).format(c=draw(st.integers(0, 7)))
    m1, m2 = draw(st.integers(1, 7)), draw(st.integers(1, 5))
    form = draw(st.sampled_from(["{b} // {m1}", "{b} % {m1}", "{b} // {m1} % {m2}", "{b} // {m1} // {m2}",
                                 "({b} % {m1}) // {m1}", "{b}"]))
    return form.format(b=base, m1=m1, m2=m2)


@st.composite
def sides(draw, bases):
    terms = draw(st.lists(st.tuples(st.sampled_from([1, 1, 1, -1, 2]), atoms(bases)), min_size=1, max_size=2))
    const = draw(st.integers(-6, 6))
    return " + ".join(f"{c} * ({t})" for c, t in terms) + f" + {const}"


@st.composite
def comparisons(draw):
    bases = draw(st.sampled_from([GRID_BASES, DIAG_BASES]))
    parts = [draw(sides(bases)) for _ in range(draw(st.integers(2, 3)))]
    ops = [draw(st.sampled_from(["<", "<=", ">", ">=", "==", "!="])) for _ in parts[1:]]
    text = parts[0] + "".join(f" {op} {p}" for op, p in zip(ops, parts[1:]))
    return text, " & ".join(f"(({a}) {op} ({b}))" for a, op, b in zip(parts, ops, parts[1:]))


@st.composite
def expressions(draw):
    """(mask text, the same condition as a numpy expression of q and k)."""
    first = draw(comparisons())
    if draw(st.booleans()):
        return first
    other = draw(comparisons())
    op = draw(st.sampled_from(["&", "|"]))
    neg = draw(st.booleans())
    text = f"({first[0]}) {op} {'!' if neg else ''}({other[0]})"
    py = f"({first[1]}) {op} {'~' if neg else ''}({other[1]})"
    return text, py


def numpy_mask(py: str, L: int) -> np.ndarray:
    q, k = grid(L)
    return np.broadcast_to(eval(py, {"q": q, "k": k}), (L, L))  # the test's own expression, no input


@settings(max_examples=300)
@given(expressions(), st.integers(1, 40))
def test_random_floor_expressions_match_brute_force(expr, L):
    text, py = expr
    try:
        prog = parse_mask(text)
    except MaskError as e:  # a form the language refuses: one clear error at the operator
        assert any(w in e.message for w in FORM_ERRORS), e.message
        assert e.line == 1 and 1 <= e.col <= len(text)
        return
    check(prog.lower(L), numpy_mask(py, L), L)


BATCH_FORMS = [
    ("q // {m} == k // {m}", lambda q, k, m: q // m == k // m),
    ("(k - q) % {m} == 0", lambda q, k, m: (k - q) % m == 0),
    ("-1 <= q % {m} - k % {m} <= 1", lambda q, k, m: abs(q % m - k % m) <= 1),
    ("k // {m} <= q // {m}", lambda q, k, m: k // m <= q // m),
    ("q % {m} < {m} // 2", lambda q, k, m: q % m < m // 2),
]


@settings(max_examples=60)
@given(st.lists(st.tuples(st.sampled_from(range(len(BATCH_FORMS))), st.integers(1, 9)), min_size=1, max_size=3),
       st.lists(st.integers(1, 30), min_size=1, max_size=4))
def test_batches_lower_sample_by_sample(parts, lens):
    prog = parse_mask(" | ".join(f"({BATCH_FORMS[i][0].format(m=m)})" for i, m in parts))
    pieces = lower_batch(prog, lens)
    offsets = np.cumsum([0] + lens[:-1])
    total = 0
    for L, o in zip(lens, offsets):
        sel = pieces.a[(pieces.a[:, 0] >= o) & (pieces.a[:, 0] < o + L)].copy()
        sel[:, :4] -= o
        assert (sel[:, 2] >= 0).all() and (sel[:, 3] <= L).all()  # nothing crosses samples
        q, k = grid(L)
        expected = np.zeros((L, L), dtype=bool)
        for i, m in parts:
            expected |= BATCH_FORMS[i][1](q, k, m)
        check(Pieces(sel), expected, L)
        total += len(sel)
    assert total == len(pieces)


def test_supported_forms_and_their_piece_counts():
    L = 64
    q, k = grid(L)
    cases = [
        ("q // 8 == k // 8", k // 8 == q // 8, 8),               # block diagonal: one piece a block
        ("k // 8 <= q // 8", k // 8 <= q // 8, 8),               # block causal
        ("-1 <= q // 8 - k // 8 <= 1", abs(q // 8 - k // 8) <= 1, 8),
        ("(k - q) % 4 == 0", (k - q) % 4 == 0, 2 * 64 // 4 - 1),  # one diagonal a lag
        ("(q - k) % 4 == 0 & k <= q", ((q - k) % 4 == 0) & (k <= q), 16),
        ("q // 8 < 3", q // 8 < 3, 1),                           # merged: one piece
        ("q % 8 < 2", q % 8 < 2, 8),
        ("q // 4 // 4 == k // 16", q // 16 == k // 16, 4),       # nested floors fold: q // 16
        ("q // 4 % 4 == 0", (q // 4) % 4 == 0, 4),
        ("(q % 32) // 8 == (k % 32) // 8", (q % 32) // 8 == (k % 32) // 8, None),
        ("k >= q // 2", k >= q // 2, None),
        ("q % 8 <= k % 8", q % 8 <= k % 8, None),
    ]
    for text, expected, pieces in cases:
        p = parse_mask(text).lower(L)
        check(p, expected, L)
        if pieces is not None:
            assert len(p) == pieces, (text, len(p))


@pytest.mark.parametrize("text,col,msg", [
    ("q % k < 3", 3, "`%` by a position"),
    ("q // (k - q) < 3", 3, "`//` by a position"),
    ("q % 0 < 1", 3, "division by zero"),
    ("q % -2 < 1", 3, "positive integer, got -2"),
    ("q // 2.5 < 1", 3, "positive integer, got 2.5"),
    ("(2 * q) // 4 < k", 9, "got `2*q`"),
    ("(q + k) // 2 < 3", 9, "got `q + k`"),
    ("(q + 0.5) // 2 < 3", 11, "adds 0.5"),
    ("(q % 4) // 3 < 1", 9, "cannot be lowered exactly"),
    ("q // 4 == (k - q) // 2", 8, "not both"),
    ("2 * (q % 4) < k", 13, "not of the form"),
    ("(q % 4) * (k % 4) < 2", 9, "multiplies two position terms"),
    ("causal & sliding_window(q % 4)", 25, "must be a number, got the position term"),
    ("let h = 1\ncausal", 5, "reserved"),
    ("h(2)", 1, "`h` is the query head, not a mask or function"),
    ("let Lq = 3\ncausal", 5, "reserved (q, k: positions, L, Lq, Lk: sample lengths, h: query head)"),
])
def test_unsupported_forms_are_clear_errors(text, col, msg):
    e = pytest.raises(MaskError, parse_mask, text).value
    assert msg in e.message and e.col == col, str(e)


def test_divisor_from_the_sample_length_is_checked_when_lowering():
    prog = parse_mask("q // (L // 4) == k // (L // 4)")
    L = 20
    q, k = grid(L)
    check(prog.lower(L), q // 5 == k // 5, L)
    with pytest.raises(MaskError, match=r"division by zero.*\[sample length 3\]"):
        prog.lower(3)


# ----------------------------------------------------------------- cost guards

def test_a_huge_sample_with_a_tiny_period_is_one_clear_error():
    for text, col in (("q % 2 == 0", 7), ("causal & (k - q) % 3 == 0", 22), ("q // 3 == k // 3", 8)):
        e = pytest.raises(MaskError, parse_mask(text).lower, MAX_TOKENS).value
        assert "MAX_MASK_PIECES" in e.message and "L / period" in e.message and e.col == col, str(e)


def test_the_full_grid_is_charged_before_it_is_built(monkeypatch):
    # q % W vs k % W looks at every (q period, k period) cell: (L/W)^2 work, refused up front
    e = pytest.raises(MaskError, parse_mask("q % 64 == k % 64").lower, 1 << 20).value
    assert "MAX_MASK_WORK" in e.message and "(L / period)^2" in e.message
    # ... while the same mask written on k - q is 2L/W pieces
    p = parse_mask("(k - q) % 64 == 0").lower(1 << 16)
    assert len(p) == 2 * (1 << 16) // 64 - 1
    monkeypatch.setattr(setops, "MAX_MASK_PIECES", 1000)
    e = pytest.raises(MaskError, parse_mask("q % 4 <= k % 4").lower, 400).value
    assert "pieces" in e.message


def test_block_level_forms_scale_with_the_number_of_blocks(monkeypatch):
    spent = []
    real = Budget.charge
    monkeypatch.setattr(Budget, "charge", lambda self, units, what: spent.append(units) or real(self, units, what))
    p = parse_mask("q // 16 == k // 16").lower(1 << 20)
    assert len(p) == (1 << 20) // 16 and p.pair_count() == (1 << 20) * 16
    assert sum(spent) < 100 * (1 << 20) // 16  # a few units a block, not a grid of 65,536^2 cells


def test_terms_past_the_int64_range_are_refused():
    with pytest.raises(MaskError, match="at most 2\\^62"):
        parse_mask("q // 3 * 1000000000000000000 < k").lower(100)


# -------------------------------------------------------------- builtins

def natten_dense(L, H, W, kh, kw):
    """attention-gym's NATTEN definition (kernel centre clamped a half kernel from the
    edge, |centre - key| <= half kernel), each axis against its own extent."""
    t = np.arange(L)
    row, col = t // W, t % W
    cr = np.clip(row, kh // 2, H - 1 - kh // 2)
    cc = np.clip(col, kw // 2, W - 1 - kw // 2)
    on = t < H * W
    return ((np.abs(cr[:, None] - row[None, :]) <= kh // 2) & (np.abs(cc[:, None] - col[None, :]) <= kw // 2)
            & on[:, None] & on[None, :])


def sta_dense(L, H, W, th, tw, kh, kw):
    """attention-gym's generate_sta_mask_mod_2d: canvas (H, W), tile (th, tw), kernel
    (kh*th, kw*tw) tokens, no text tokens."""
    t = np.arange(L)
    tile = t // (th * tw)
    nh, nw = H // th, W // tw
    r, c = tile // nw, tile % nw
    left_h, right_h = kh // 2, kh // 2 + (kh % 2 - 1)
    left_w, right_w = kw // 2, kw // 2 + (kw % 2 - 1)
    ch = np.clip(r, left_h, nh - 1 - right_h)
    cw = np.clip(c, left_w, nw - 1 - right_w)
    rows = (r[None, :] >= ch[:, None] - left_h) & (r[None, :] <= ch[:, None] + right_h)
    cols = (c[None, :] >= cw[:, None] - left_w) & (c[None, :] <= cw[:, None] + right_w)
    on = t < H * W
    return rows & cols & on[:, None] & on[None, :]


def dilated_dense(L, w, d):
    q, k = grid(L)
    diff = q - k
    return (diff >= 0) & (diff < w * d) & (diff % d == 0)


@settings(max_examples=80)
@given(st.integers(1, 9), st.integers(1, 12), st.integers(0, 4), st.integers(0, 4), st.integers(-20, 20))
def test_natten2d(H, W, hh, hw, extra):
    kh, kw = min(2 * hh + 1, H - (1 - H % 2)), min(2 * hw + 1, W - (1 - W % 2))
    L = max(1, H * W + extra)
    check(parse_mask(f"natten2d({H}, {W}, {kh}, {kw})").lower(L), natten_dense(L, H, W, kh, kw), L)


@settings(max_examples=80)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 3), st.integers(1, 3), st.integers(1, 4),
       st.integers(1, 4), st.integers(-10, 10))
def test_sliding_tile2d(nh, nw, th, tw, kh, kw, extra):
    kh, kw = min(kh, nh), min(kw, nw)
    H, W = nh * th, nw * tw
    L = max(1, H * W + extra)
    check(parse_mask(f"sliding_tile2d({H}, {W}, {th}, {tw}, {kh}, {kw})").lower(L),
          sta_dense(L, H, W, th, tw, kh, kw), L)


@settings(max_examples=60)
@given(st.integers(1, 60), st.integers(1, 9), st.integers(1, 9), st.integers(1, 70))
def test_dilated_window_and_global_tokens(L, w, d, n):
    check(parse_mask(f"dilated_sliding_window({w}, {d})").lower(L), dilated_dense(L, w, d), L)
    q, k = grid(L)
    check(parse_mask(f"global_tokens({n})").lower(L), (q < n) | (k < n), L)
    check(parse_mask(f"dilated_sliding_window({w}, 1)").lower(L), (k <= q) & (q - k < w), L)


def test_document_is_same_segment():
    batch = load_batch(str(QA))
    for L, segs in zip(batch.seqlens, batch.segments):
        doc = np.repeat(np.arange(len(segs)), [n for _, n in segs])
        q, k = grid(L)
        check(parse_mask("document").lower(L, segs), doc[:, None] == doc[None, :], L)
        check(parse_mask("document & causal").lower(L, segs), (doc[:, None] == doc[None, :]) & (k <= q), L)
        assert parse_mask("document").lower(L, segs) == parse_mask("same_segment").lower(L, segs)
    assert parse_mask("document").uses_segments


@pytest.mark.parametrize("text,col,msg", [
    ("natten2d(8, 8, 4, 3)", 16, "must be odd"),
    ("natten2d(8, 6, 3, 7)", 19, "at most W (6)"),
    ("natten2d(100000, 100000, 3, 3)", 10, "MAX_TOKENS"),
    ("sliding_tile2d(8, 9, 2, 2, 1, 1)", 25, "must divide W"),
    ("sliding_tile2d(8, 8, 2, 2, 5, 1)", 28, "at most the 4 tiles"),
    ("dilated_sliding_window(4, 0)", 27, "d (dilation) must be a positive integer"),
    ("global_tokens(0.5)", 15, "not an integer"),
])
def test_builtin_parameters_are_checked_where_written(text, col, msg):
    e = pytest.raises(MaskError, parse_mask, text).value
    assert msg in e.message and e.col == col, str(e)


def test_builtins_scale_with_the_canvas():
    L = 1 << 20
    p = parse_mask("natten2d(1024, 1024, 13, 13)").lower(L)
    assert len(p) <= 3 * 1024 * 13
    p = parse_mask("sliding_tile2d(1024, 1024, 8, 8, 3, 3)").lower(L)
    assert len(p) <= (L // 64) * 3
    # a canvas far larger than the sample builds only the rows that exist
    assert len(parse_mask("natten2d(8192, 8192, 8191, 3)").lower(100)) <= 3


# ------------------------------------------------- example files vs definitions

def _gym(name: str, L: int, segs=None) -> np.ndarray:
    q, k = grid(L)
    doc = None if segs is None else np.repeat(np.arange(len(segs)), [n for _, n in segs])
    return {
        "causal": lambda: k <= q,
        "gym_causal": lambda: k <= q,
        "sliding_window": lambda: (k <= q) & (q - k < 256),
        "gym_sliding_window": lambda: (k <= q) & (q - k <= 256),
        "prefix_lm": lambda: (k < 64) | (k <= q),
        "gym_prefix_lm": lambda: (k < 64) | (k <= q),
        "document_qa": lambda: (doc[:, None] == doc[None, :]) & (k <= q),
        "gym_document_qa": lambda: (doc[:, None] == doc[None, :]) & (k <= q),
        "dilated_sliding_window": lambda: dilated_dense(L, 64, 4),
        "gym_dilated_sliding_window": lambda: dilated_dense(L, 5, 2),
        "global_tokens": lambda: (np.abs(q - k) <= 128) | (q < 16) | (k < 16),
        "natten2d": lambda: natten_dense(L, 24, 40, 5, 7),
        "gym_natten": lambda: natten_dense(L, 24, 40, 5, 7),
        "sliding_tile2d": lambda: sta_dense(L, 48, 64, 4, 8, 3, 3),
        "gym_sliding_tile2d": lambda: sta_dense(L, 48, 64, 4, 8, 3, 3),
    }[name]()


GYM = ["causal", "gym_causal", "sliding_window", "gym_sliding_window", "prefix_lm", "gym_prefix_lm",
       "document_qa", "gym_document_qa", "dilated_sliding_window", "gym_dilated_sliding_window", "global_tokens",
       "natten2d", "gym_natten", "sliding_tile2d", "gym_sliding_tile2d"]


@pytest.mark.parametrize("name", GYM)
def test_example_masks_equal_their_definitions(name):
    prog = load_mask(str(MASKS / f"{name}.mask"))
    if prog.uses_segments:
        batch = load_batch(str(QA))
        cases = list(zip(batch.seqlens, batch.segments))
    else:
        canvas = name.endswith(("natten", "natten2d", "tile2d"))  # the canvases are 960 and 3072 tokens
        cases = [(L, None) for L in (1, 37, 500, 1000) + ((960, 3072, 3100) if canvas else ())]
    for L, segs in cases:
        check(prog.lower(L, segs), _gym(name, L, segs), L)


def test_every_new_builtin_has_an_example_file():
    names = {Path(p).stem for p in glob.glob(str(MASKS / "*.mask"))}
    for b in ("dilated_sliding_window", "natten2d", "sliding_tile2d", "global_tokens", "document_qa"):
        assert b in names
        assert (MASKS / f"{b}.mask").read_text().startswith("#")


# ------------------------------------------------- execution equals dense attention

EXEC_MASKS = {
    "(k - q) % 3 == 0 & k <= q": lambda q, k: ((k - q) % 3 == 0) & (k <= q),
    "-1 <= q % 5 - k % 5 <= 1 & q // 5 >= k // 5": lambda q, k: (abs(q % 5 - k % 5) <= 1) & (q // 5 >= k // 5),
    "natten2d(4, 5, 3, 3) | (q >= 20 & k <= q)": lambda q, k: natten_dense(q.shape[0], 4, 5, 3, 3)
    | ((q >= 20) & (k <= q)),
    "sliding_tile2d(4, 4, 2, 2, 1, 2) | global_tokens(2)": lambda q, k: sta_dense(q.shape[0], 4, 4, 2, 2, 1, 2)
    | (q < 2) | (k < 2),
}


def dense_attention(q, k, v, allowed, scale):
    """float64 softmax attention per head with a [L, L] boolean mask; rows with no key give 0."""
    hq, hk = q.shape[1], k.shape[1]
    kk = k.repeat_interleave(hq // hk, dim=1)
    vv = v.repeat_interleave(hq // hk, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    m = torch.as_tensor(allowed)[None]
    s = s.masked_fill(~m, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, vv)


@pytest.mark.parametrize("strategy", ["zigzag", "minheap", "per_doc"])
@pytest.mark.parametrize("text", list(EXEC_MASKS))
def test_execute_equals_dense_masked_attention(text, strategy):
    lens = [26, 9, 1]
    plan = attnplan.compile(seqlens=lens, mask=text, devices=3, heads=2, kv_heads=1, head_dim=8, block_size=8,
                            strategy=strategy, dtype="float32")
    T = sum(lens)
    gen = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(T, h, 8, generator=gen) for h in (2, 1, 1, 2))
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = attnplan.execute(plan, qg, kg, vg)
    grads = torch.autograd.grad(out, (qg, kg, vg), dout)
    scale = 1.0 / math.sqrt(8)
    o = 0
    for L in lens:
        qi, ki = grid(L)
        allowed = np.broadcast_to(EXEC_MASKS[text](np.broadcast_to(qi, (L, L)), np.broadcast_to(ki, (L, L))), (L, L))
        xs = [t[o:o + L].double().requires_grad_(True) for t in (q, k, v)]
        ref = dense_attention(*xs, np.array(allowed), scale)
        ref_grads = torch.autograd.grad(ref, xs, dout[o:o + L].double())
        for got, want in zip((out[o:o + L], *(g[o:o + L] for g in grads)), (ref, *ref_grads)):
            want = want.detach()
            assert float((got.detach().double() - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max()))
        o += L


# ---------------------------------------------------------- long and deep text

def test_long_flat_unions_parse_and_lower_without_subtracting(monkeypatch):
    monkeypatch.setattr(Pieces, "subtract", lambda *a: pytest.fail("a union of columns subtracts nothing"))
    for n in (489, 490, 491, 10_000):
        p = parse_mask(" | ".join(f"k == {i}" for i in range(n))).lower(n)
        assert p.pair_count() == n * n and len(p) == n
    p = parse_mask(" | ".join(f"q // 4 == {i}" for i in range(0, 500, 2))).lower(1000)
    q, _ = grid(1000)
    check(p, (q // 4 % 2 == 0) & (q < 1000), 1000)


@settings(max_examples=60)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(1, 6), st.integers(0, 30), st.integers(1, 6)),
                min_size=3, max_size=12), st.booleans())
def test_union_of_apart_operands_equals_the_fold(boxes, overlap):
    """The fast union gives the same pieces, in the same order, as folding union()."""
    operands = [Pieces.rect(a, a + h, b, b + w) for a, h, b, w in boxes]
    if overlap:
        operands.append(parse_mask("causal").lower(40))
    fast = setops.union_apart(operands, Budget())
    acc = operands[0]
    for v in operands[1:]:
        acc = setops.union(acc, v, Budget())
    if fast is not None:
        assert np.array_equal(fast.a, acc.a)
    boxes_apart = all(not (a1 < a2 + h2 and a2 < a1 + h1 and b1 < b2 + w2 and b2 < b1 + w1)
                      for i, (a1, h1, b1, w1) in enumerate(boxes) for (a2, h2, b2, w2) in boxes[i + 1:])
    if boxes_apart and not overlap:
        assert fast is not None


def test_deep_parentheses_are_one_clear_error():
    d = MAX_MASK_DEPTH + 1
    e = pytest.raises(MaskError, parse_mask, "(" * d + "causal" + ")" * d).value
    assert "MAX_MASK_DEPTH" in e.message and (e.line, e.col) == (1, d)
    e = pytest.raises(MaskError, parse_mask, "let f(x) = x\n" + "f(" * d + "causal" + ")" * d).value
    assert (e.line, e.col) == (2, 2 * d)
    assert parse_mask("(" * MAX_MASK_DEPTH + "causal" + ")" * MAX_MASK_DEPTH).lower(3).pair_count() == 6


TOKENS = ["q", "k", "L", "(", ")", "%", "//", "*", "+", "-", "<", "<=", "==", "!=", "&", "|", "!", "3", "0",
          "2.5", ",", "=", "let", "f", "causal", "natten2d", "in", "image", "\n", "#", "$", "h"]


@settings(max_examples=300)
@given(st.lists(st.sampled_from(TOKENS), min_size=0, max_size=14))
def test_token_soup_is_a_mask_or_one_mask_error_with_a_position(tokens):
    text = " ".join(tokens)
    try:
        prog = parse_mask(text)
    except MaskError as e:
        assert e.line >= 1 and e.col >= 1, str(e)
        return
    try:
        prog.lower(9)
    except MaskError as e:
        assert e.line >= 1 and e.col >= 1, str(e)


def _plan_mask(capsys, tmp_path, text, *extra):
    f = tmp_path / "m.mask"
    f.write_text(text)
    code = cli.main(["mask", str(f), *extra])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


@pytest.mark.parametrize("text", [
    "(" * (MAX_MASK_DEPTH + 1) + "causal" + ")" * (MAX_MASK_DEPTH + 1),
    "q % k < 3", "(k - q) % 0 == 0", "q // 2 == (k - q) // 2", "natten2d(4, 4, 2, 3)", "causal & $", "h == 0",
    ")(", "", "q % 4 < 2 | k == 2.5 //",
])
def test_plan_mask_exits_2_on_bad_input(capsys, tmp_path, text):
    code, out, err = _plan_mask(capsys, tmp_path, text, "--seqlens", "40")
    assert code == 2 and err.startswith("plan: error: "), err[:300]


def test_plan_mask_draws_long_unions(capsys, tmp_path):
    for n in (490, 10_000):
        code, out, err = _plan_mask(capsys, tmp_path, " | ".join(f"k == {i % 40}" for i in range(n)),
                                    "--seqlens", "40")
        assert code == 0 and "1600 allowed pairs" in out, err[:300]
    code, out, _ = _plan_mask(capsys, tmp_path, "# dilated\n(k - q) % 4 == 0 & k <= q\n", "--seqlens", "12")
    assert code == 0 and out.splitlines()[3] == "|#           |" and out.splitlines()[7] == "|#   #       |"


def test_example_directory_lists_the_gym_ports():
    have = {os.path.basename(p) for p in glob.glob(str(MASKS / "gym_*.mask"))}
    assert {f"{n}.mask" for n in GYM if n.startswith("gym_")} <= have
    assert MAX_MASK_PIECES >= 1 << 20  # the examples' piece counts stay far below the limit


_COORD = st.integers(-300, 300)
_PIECE = st.tuples(_COORD, _COORD, _COORD, _COORD, st.one_of(_COORD, st.just(-(1 << 62))),
                   st.one_of(_COORD, st.just(1 << 62)))  # a band side may be unbounded (±INF), as the language makes


@settings(max_examples=200)
@given(st.lists(_PIECE, min_size=1, max_size=10), _PIECE)
def test_the_small_piece_paths_equal_the_array_paths(rows, other):
    """tighten on a few rows (Python integers) and the intersection of one piece with one piece are the
    array code's results, bound for bound, on any pieces (empty, inverted, unbounded bands)."""
    from attnplan.ir import mask
    a = np.array(rows, np.int64)
    x, y = a.copy(), a.copy()
    keep = mask._tighten_rows(x)
    for _ in range(2):  # the array steps of tighten, spelled out
        y[:, mask.LO] = np.maximum(y[:, mask.LO], y[:, mask.K0] - (y[:, mask.Q1] - 1))
        y[:, mask.HI] = np.minimum(y[:, mask.HI], (y[:, mask.K1] - 1) - y[:, mask.Q0])
        y[:, mask.Q0] = np.maximum(y[:, mask.Q0], y[:, mask.K0] - y[:, mask.HI])
        y[:, mask.Q1] = np.minimum(y[:, mask.Q1], y[:, mask.K1] - y[:, mask.LO])
        y[:, mask.K0] = np.maximum(y[:, mask.K0], y[:, mask.Q0] + y[:, mask.LO])
        y[:, mask.K1] = np.minimum(y[:, mask.K1], y[:, mask.Q1] + y[:, mask.HI])
    want = (y[:, mask.Q0] < y[:, mask.Q1]) & (y[:, mask.K0] < y[:, mask.K1]) & (y[:, mask.LO] <= y[:, mask.HI])
    assert (keep == want).all() and (x == y).all()
    one, two = Pieces(mask.normalize(a[:1])), Pieces(mask.normalize(np.array([other], np.int64)))
    if len(one) and len(two):
        i, j = mask._pairwise(one.a, two.a)
        general = mask.normalize(mask.intersect_rows(one.a[i], two.a[j]))
        assert np.array_equal(one.intersect(two).a, general)
