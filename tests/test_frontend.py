"""Frontend tests: the mask language, the standard library, batches, pictures.

Every stdlib family and every combinator is checked against a direct dense
numpy implementation of its definition (and pair counts against dense counts,
which also proves the pieces are disjoint)."""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnplan.errors import BatchError, MaskError
from attnplan.frontend import (Batch, MaskProgram, load_batch, load_mask, lower_batch, parse_mask,
                               parse_seqlens, render)
from attnplan.ir.limits import MAX_MASK_INT
from attnplan.ir.mask import Pieces

ROOT = Path(__file__).resolve().parents[1]
MASKS = ROOT / "examples" / "masks"
BATCHES = ROOT / "examples" / "batches"
SHARED_BATCHES = ROOT / ".." / "shared" / "workloads" / "batches.jsonl"

SETTINGS = settings(derandomize=True, deadline=None, max_examples=60)


# ----------------------------------------------------------------- dense oracles

def grid(L):
    return np.arange(L)[:, None], np.arange(L)[None, :]


def d_causal(L):
    q, k = grid(L)
    return np.broadcast_to(k <= q, (L, L))


def d_full(L):
    return np.ones((L, L), bool)


def d_sliding_window(L, w):
    q, k = grid(L)
    return (q - w < k) & (k <= q)


def d_streaming(L, s, w):
    q, k = grid(L)
    return (k <= q) & ((k < s) | (q - k < w))


def d_shared_question(L, n, f):
    lq = math.floor(L * f)
    size = (L - lq) // n
    t = np.arange(L)
    answer = np.where(t < lq, -1, np.minimum((t - lq) // size, n - 1) if size else n - 1)
    q, k = grid(L)
    aq, ak = answer[:, None], answer[None, :]
    return ((aq == -1) & (k <= q)) | ((aq >= 0) & (ak == -1)) | ((aq >= 0) & (aq == ak) & (k <= q))


def d_causal_blockwise(L, b, kk):
    q, k = grid(L)
    blk = q // b
    edge = (blk == 0) | (blk == (L - 1) // b)
    return np.where(edge, k <= q, (k < b) | ((k >= np.maximum(b, q - kk * b)) & (k <= q)))


def d_block_causal(L, b):
    q, k = grid(L)
    return np.broadcast_to(k < (q // b + 1) * b, (L, L))


def d_prefix_lm(L, p):
    q, k = grid(L)
    return (k < p) | (k <= q)


def d_chunked_causal(L, c):
    q, k = grid(L)
    return (k <= q) & (k // c == q // c)


def check_pieces(p: Pieces, expected: np.ndarray, L: int):
    """Same pairs as the dense oracle, disjoint (counts add up), inside [0, L)^2."""
    assert np.array_equal(p.to_dense(L), expected)
    assert p.pair_count() == int(expected.sum())
    a = p.a
    assert (a[:, 0] >= 0).all() and (a[:, 1] <= L).all() and (a[:, 2] >= 0).all() and (a[:, 3] <= L).all()


lengths = st.integers(1, 80)
widths = st.integers(1, 100)
fractions = st.integers(1, 99).map(lambda x: Fraction(x, 100))


def fdec(f: Fraction) -> str:
    return f"{float(f):.2f}"


# ------------------------------------------------------------ stdlib vs dense

@SETTINGS
@given(lengths)
def test_causal_and_full(L):
    check_pieces(parse_mask("causal").lower(L), d_causal(L), L)
    check_pieces(parse_mask("full").lower(L), d_full(L), L)
    check_pieces(parse_mask("true").lower(L), d_full(L), L)
    check_pieces(parse_mask("false").lower(L), np.zeros((L, L), bool), L)


@SETTINGS
@given(lengths, widths)
def test_sliding_window(L, w):
    check_pieces(parse_mask(f"sliding_window({w})").lower(L), d_sliding_window(L, w), L)


@SETTINGS
@given(lengths, widths, widths)
def test_streaming(L, s, w):
    check_pieces(parse_mask(f"streaming({s}, {w})").lower(L), d_streaming(L, s, w), L)


@SETTINGS
@given(lengths, st.integers(1, 12), fractions)
def test_shared_question(L, n, f):
    check_pieces(parse_mask(f"shared_question({n}, {fdec(f)})").lower(L), d_shared_question(L, n, f), L)


def test_shared_question_is_exact_and_keeps_answers_apart():
    # 0.29 * 100 is 28.999... in floating point; the language's decimals are exact
    p = parse_mask("shared_question(3, 0.29)").lower(100)
    check_pieces(p, d_shared_question(100, 3, Fraction(29, 100)), 100)
    m = p.to_dense(100)
    assert m[29:, :29].all() and not m[29 + 23, 29]  # answers see the question; answer 0 is [29, 52)
    assert not m[52, 51] and m[52, 52]  # answer 1 does not see answer 0


@SETTINGS
@given(lengths, st.integers(1, 30), st.integers(1, 6))
def test_causal_blockwise(L, b, kk):
    check_pieces(parse_mask(f"causal_blockwise({b}, {kk})").lower(L), d_causal_blockwise(L, b, kk), L)


@SETTINGS
@given(lengths, widths)
def test_block_causal(L, b):
    check_pieces(parse_mask(f"block_causal({b})").lower(L), d_block_causal(L, b), L)


@SETTINGS
@given(lengths, widths)
def test_prefix_lm(L, p):
    check_pieces(parse_mask(f"prefix_lm({p})").lower(L), d_prefix_lm(L, p), L)


@SETTINGS
@given(lengths, widths)
def test_chunked_causal(L, c):
    check_pieces(parse_mask(f"chunked_causal({c})").lower(L), d_chunked_causal(L, c), L)


def test_stdlib_is_vectorized_per_block():
    # one piece per chunk/block, built without a loop over tokens: 1M tokens is fast
    t = time.perf_counter()
    p = parse_mask("chunked_causal(16)").lower(1 << 20)
    assert len(p) == (1 << 20) // 16
    assert p.pair_count() == (1 << 20) // 16 * (16 * 17 // 2)
    assert time.perf_counter() - t < 2.0


# ---------------------------------------------------------- combinators vs dense

def _atoms():
    def call(name, fn, *params):
        return st.tuples(*params).map(
            lambda ps: (f"{name}({', '.join(map(str, ps))})", lambda L, ps=ps: fn(L, *ps)))

    small = st.integers(1, 40)
    return st.one_of(
        st.just(("causal", d_causal)),
        st.just(("full", d_full)),
        call("sliding_window", d_sliding_window, small),
        call("streaming", d_streaming, small, small),
        call("block_causal", d_block_causal, small),
        call("prefix_lm", d_prefix_lm, small),
        call("chunked_causal", d_chunked_causal, small),
        call("causal_blockwise", d_causal_blockwise, st.integers(1, 10), st.integers(1, 4)),
        st.integers(-20, 40).map(lambda c: (f"k < {c}", lambda L, c=c: np.broadcast_to(grid(L)[1] < c, (L, L)))),
        st.integers(-20, 40).map(lambda c: (f"q >= {c}", lambda L, c=c: np.broadcast_to(grid(L)[0] >= c, (L, L)))),
        st.integers(-20, 20).map(lambda c: (f"k - q == {c}", lambda L, c=c: (grid(L)[1] - grid(L)[0]) == c)),
    )


def _combine(children):
    def both(op, f):
        return st.tuples(children, children).map(
            lambda ab: (f"({ab[0][0]}) {op} ({ab[1][0]})", lambda L, ab=ab: f(ab[0][1](L), ab[1][1](L))))

    return st.one_of(
        both("&", np.logical_and),
        both("|", np.logical_or),
        children.map(lambda a: (f"!({a[0]})", lambda L, a=a: ~a[1](L))),
    )


exprs = st.recursive(_atoms(), _combine, max_leaves=5)


@settings(derandomize=True, deadline=None, max_examples=120)
@given(exprs, lengths)
def test_combinators_match_boolean_algebra(e, L):
    text, dense = e
    check_pieces(parse_mask(text).lower(L), np.asarray(dense(L)), L)


def test_precedence():
    L = 20
    q, k = grid(L)
    # | is loosest, then &, then !, then comparisons
    check_pieces(parse_mask("k < 3 | k > 10 & k <= q").lower(L), (k < 3) | ((k > 10) & (k <= q)), L)
    check_pieces(parse_mask("!k < 5 & q > 2").lower(L), ~(k < 5) & (q > 2) & (k >= 0), L)
    check_pieces(parse_mask("!causal").lower(L), ~d_causal(L), L)
    check_pieces(parse_mask("k <= q - 2 * 3 + 1").lower(L), np.broadcast_to(k <= q - 5, (L, L)), L)
    check_pieces(parse_mask("k < 1_0").lower(L), np.broadcast_to(k < 10, (L, L)), L)


def test_huge_numbers_do_not_overflow():
    L, big = 17, MAX_MASK_INT  # the largest literal the language accepts
    q, k = grid(L)
    for text, expected in ((f"block_causal({big})", d_full(L)), (f"chunked_causal({big})", d_causal(L)),
                           (f"sliding_window({big})", d_causal(L)), (f"streaming({big}, {big})", d_causal(L)),
                           (f"prefix_lm({big})", d_full(L)), (f"causal_blockwise(3, {big})", d_causal(L)),
                           (f"shared_question({big}, 0.5)", d_shared_question(L, 1, Fraction(1, 2))),
                           (f"q == {big} | k - q == -{big}", np.zeros((L, L), bool)),
                           (f"k > -{big} & q < {big} & k - q <= {big}", d_full(L))):
        check_pieces(parse_mask(text).lower(L), expected, L)


# ------------------------------------------------------------------ comparisons

_OPS = {"<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal,
        "==": np.equal, "!=": np.not_equal}


@settings(derandomize=True, deadline=None, max_examples=150)
@given(st.sampled_from(["q", "k", "d", "const"]), st.integers(-3, 3).filter(bool),
       st.integers(-2, 2), st.integers(-2, 2), st.integers(-30, 30), st.integers(-30, 30),
       st.sampled_from(sorted(_OPS)), st.integers(1, 4), lengths)
def test_linear_comparisons_reduce(form, a, bq, bk, c1, c2, op, div, L):
    # lhs = (bq + dq)*q + (bk + dk)*k + c1 // div, rhs = bq*q + bk*k + c2, with (dq, dk)
    # a multiple of (1, 0), (0, 1) or (-1, 1): reducible to q/k/k-q OP const
    dq, dk = {"q": (a, 0), "k": (0, a), "d": (-a, a), "const": (0, 0)}[form]
    text = f"{bq + dq}*q + {bk + dk}*k + {c1} // {div} {op} {bq}*q + {bk}*k + {c2}"
    q, k = grid(L)
    expected = np.broadcast_to(_OPS[op]((bq + dq) * q + (bk + dk) * k + c1 // div, bq * q + bk * k + c2), (L, L))
    check_pieces(parse_mask(text).lower(L), expected, L)


@SETTINGS
@given(lengths, st.integers(1, 30), st.integers(-5, 5))
def test_chained_comparisons_and_decimals(L, w, c):
    q, k = grid(L)
    check_pieces(parse_mask(f"q - {w} < k <= q").lower(L), d_sliding_window(L, w), L)
    check_pieces(parse_mask(f"{c} <= k - q < {c} + {w} != k").lower(L),
                 (c <= k - q) & (k - q < c + w) & (c + w != k), L)
    # exact decimals: 2k < 2q + 2.5  <=>  k - q < 1.25  <=>  k - q <= 1
    check_pieces(parse_mask("2*k < 2*q + 2.5").lower(L), k - q <= 1, L)
    check_pieces(parse_mask(f"q >= L - {w}").lower(L), np.broadcast_to(q >= L - w, (L, L)), L)


def test_non_reducible_comparisons_are_errors():
    # `k >= q // 2` is a mask now (floors of positions: tests/test_mask_arith.py); 2*(q % 4) - k is not a form
    for text, col in (("k < 2 * q", 3), ("q * k < 3", 3), ("k >= 2 * (q % 4)", 3), ("causal & q + k > 3", 16)):
        with pytest.raises(MaskError) as e:
            parse_mask(text)
        assert (e.value.line, e.value.col) == (1, col), (text, str(e.value))
        assert "linear" in e.value.message or "not of the form" in e.value.message


# --------------------------------------------------------------------- segments

def seg_dense(L, segs):
    sid = np.repeat(np.arange(len(segs)), [n for _, n in segs])
    kind = np.repeat(np.array([kd for kd, _ in segs]), [n for _, n in segs])
    return sid, kind


@st.composite
def segmented(draw):
    L = draw(st.integers(1, 60))
    cuts = sorted(draw(st.sets(st.integers(1, L - 1), max_size=6))) if L > 1 else []
    bounds = [0, *cuts, L]
    kinds = draw(st.lists(st.sampled_from(["text", "image", "audio"]), min_size=len(bounds) - 1,
                          max_size=len(bounds) - 1))
    return L, tuple((kd, b - a) for kd, a, b in zip(kinds, bounds, bounds[1:]))


@SETTINGS
@given(segmented())
def test_segment_predicates(case):
    L, segs = case
    sid, kind = seg_dense(L, segs)
    q, k = grid(L)
    sq, sk = sid[:, None], sid[None, :]
    full = np.ones((L, L), bool)
    cases = {
        "q in image": full & (kind[:, None] == "image"),
        "k in text": full & (kind[None, :] == "text"),
        "same_segment": sq == sk,
        "earlier_segment": sk < sq,
        "earlier_segment | (same_segment & (q in image | k <= q))":
            (sk < sq) | ((sq == sk) & ((kind[:, None] == "image") | (k <= q))),
    }
    for text, expected in cases.items():
        prog = parse_mask(text)
        assert prog.uses_segments
        check_pieces(prog.lower(L, segs), expected, L)


def test_sample_without_segments_is_one_text_segment():
    L = 9
    assert parse_mask("q in text").lower(L) == Pieces.rect(0, L, 0, L)
    assert len(parse_mask("q in image").lower(L)) == 0
    assert len(parse_mask("earlier_segment").lower(L)) == 0
    assert not parse_mask("causal").uses_segments
    # segment use is seen through let definitions
    assert parse_mask("let f = same_segment\nlet g(w) = f & sliding_window(w)\ng(3)").uses_segments


def test_bad_segments_for_a_sample():
    with pytest.raises(BatchError):
        parse_mask("same_segment").lower(10, (("text", 3), ("image", 4)))


# ---------------------------------------------------------------------- language

def test_file_syntax_lets_comments_and_newlines_in_parens():
    text = """
# a comment line

let window(w) = q - w < k <= q   # a helper
let sinks = k < 4 & k <= q
mask = (window(8)
        | sinks)   # continues inside parentheses
"""
    prog = parse_mask(text, "x.mask")
    L = 30
    check_pieces(prog.lower(L), d_streaming(L, 4, 8), L)
    assert prog.source == text and prog.filename == "x.mask" and not prog.uses_segments
    with pytest.raises(dataclasses.FrozenInstanceError):
        prog.source = "full"  # type: ignore[misc]


def test_let_with_mask_parameters_and_reference_to_L():
    prog = parse_mask("let both(a, b) = a & b\nlet half = L // 2\nboth(causal, k < half)")
    L = 11
    q, k = grid(L)
    check_pieces(prog.lower(L), (k <= q) & (k < 5), L)


@pytest.mark.parametrize("path", sorted(glob.glob(str(MASKS / "*.mask"))), ids=os.path.basename)
def test_example_masks_parse_and_lower(path):
    prog = load_mask(path)
    batch = load_batch(str(BATCHES / ("mixed.json" if "mixed" in path else "qa.json" if "qa" in path
                                      else "demo.json")))
    assert prog.uses_segments == ("mixed" in path or "qa" in path)
    head = Path(path).read_text().lstrip()
    assert head.startswith("#"), "every example starts with a comment saying what it means"
    h = 1 if prog.uses_heads else None  # a per-head mask: one head's mask (tests/test_heads.py has all)
    pieces = lower_batch(prog, batch, head=h)
    per_sample = [prog.lower(n, None if batch.segments is None else batch.segments[i], head=h)
                  for i, n in enumerate(batch.seqlens)]
    assert pieces.pair_count() == sum(p.pair_count() for p in per_sample) > 0


def test_example_files_cover_every_family():
    names = {Path(p).stem for p in glob.glob(str(MASKS / "*.mask"))}
    families = {"causal", "full", "sliding_window", "streaming", "shared_question", "causal_blockwise",
                "block_causal", "prefix_lm", "chunked_causal", "mixed_modality", "segments_qa",
                "dilated_sliding_window", "global_tokens", "natten2d", "sliding_tile2d", "document_qa"}
    assert families <= names
    code = [[ln for ln in Path(p).read_text().splitlines() if ln and not ln.startswith("#")]
            for p in glob.glob(str(MASKS / "*.mask"))]
    assert any("|" in lines[-1] and "&" in lines[-1] for lines in code)


def test_example_semantics():
    mixed = load_batch(str(BATCHES / "mixed.json"))
    prog = load_mask(str(MASKS / "mixed_modality.mask"))
    for n, segs in zip(mixed.seqlens, mixed.segments):
        segs = segs or (("text", n),)
        sid, kind = seg_dense(n, segs)
        q, k = grid(n)
        sq, sk = sid[:, None], sid[None, :]
        img = kind[:, None] == "image"
        check_pieces(prog.lower(n, segs), (sk < sq) | ((sq == sk) & (img | (k <= q))), n)
    qa = load_batch(str(BATCHES / "qa.json"))
    prog = load_mask(str(MASKS / "segments_qa.mask"))
    for n, segs in zip(qa.seqlens, qa.segments):
        sid, kind = seg_dense(n, segs)
        q, k = grid(n)
        sq, sk = sid[:, None], sid[None, :]
        expected = ((sq == sk) & (k <= q)) | ((kind[:, None] == "answer") & (kind[None, :] == "question") & (sk < sq))
        check_pieces(prog.lower(n, segs), expected, n)
    demo = load_batch(str(BATCHES / "demo.json"))
    assert demo.seqlens == (1500, 700, 300, 211, 97, 64, 1) and demo.segments is None
    sinks = lower_batch(load_mask(str(MASKS / "window_with_sinks.mask")), demo)
    streaming = lower_batch(parse_mask("streaming(16, 256)"), demo)
    assert len(sinks.subtract(streaming)) == 0 and len(streaming.subtract(sinks)) == 0


def test_load_mask_forms(tmp_path):
    f = tmp_path / "m.txt"
    f.write_text("sliding_window(4)\n")
    assert load_mask(str(f)).filename == str(f)
    assert load_mask(str(f)).lower(10) == parse_mask("sliding_window(4)").lower(10)
    assert load_mask("causal").lower(5) == parse_mask("k <= q").lower(5)
    with pytest.raises(MaskError, match="not found"):
        load_mask(str(tmp_path / "missing.mask"))


# --------------------------------------------------------------------- batches

def test_lower_batch_places_samples_at_offsets():
    rng = np.random.default_rng(7)
    for mask in ("causal", "full", "streaming(2, 3) | k - q == 1", "shared_question(2, 0.5)", "!sliding_window(2)"):
        prog = parse_mask(mask)
        for _ in range(5):
            lens = rng.integers(1, 30, rng.integers(1, 8)).tolist()
            pieces = lower_batch(prog, lens)
            T = sum(lens)
            expected = np.zeros((T, T), bool)
            off = 0
            for n in lens:
                expected[off:off + n, off:off + n] = prog.lower(n).to_dense(n)
                off += n
            check_pieces(pieces, expected, T)
            # nothing crosses samples: every piece lies inside one sample's square
            ends = np.cumsum(lens)
            i = np.searchsorted(ends, pieces.a[:, 0], side="right")
            starts = ends - np.asarray(lens)
            assert (pieces.a[:, 1] <= ends[i]).all() and (pieces.a[:, 2] >= starts[i]).all()
            assert (pieces.a[:, 3] <= ends[i]).all()


def test_lower_batch_with_segments_and_batch_object():
    batch = Batch((5, 4), ((("text", 2), ("image", 3)), None))
    prog = parse_mask("same_segment")
    p = lower_batch(prog, batch)
    expected = np.zeros((9, 9), bool)
    expected[0:2, 0:2] = expected[2:5, 2:5] = expected[5:9, 5:9] = True
    check_pieces(p, expected, 9)
    assert lower_batch(prog, batch.seqlens, batch.segments) == p


def test_lower_batch_caches_and_is_fast(monkeypatch):
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 2600, 800)
    lens[-1] += (1 << 20) - lens.sum() if lens.sum() < (1 << 20) else 0
    prog = parse_mask("causal")
    calls = []
    real = MaskProgram._lower
    monkeypatch.setattr(MaskProgram, "_lower", lambda self, n, s, budget, head=None, share=None: calls.append(n) or real(self, n, s, budget, head, share))
    t = time.perf_counter()
    pieces = lower_batch(prog, lens.tolist())
    elapsed = time.perf_counter() - t
    assert sorted(calls) == sorted(set(lens.tolist()))
    assert len(pieces) == 800 and sum(lens) >= 1 << 20
    assert pieces.pair_count() == sum(n * (n + 1) // 2 for n in lens.tolist())
    assert elapsed < 1.0, elapsed


def test_render_matches_pieces_picture():
    prog = parse_mask("sliding_window(3) | (k < 2 & k <= q)")
    for lens, width in (([5, 7, 3], 64), ([1500, 700, 300, 211, 97, 64, 1], 40), ([33, 1, 70], 16)):
        out = render(prog, lens, width=width)
        T = sum(lens)
        grid_rows = [r[1:-1] for r in out.splitlines()[3:-1]]
        assert grid_rows == lower_batch(prog, lens).to_string(T, width).splitlines()
        assert f"{T} tokens" in out.splitlines()[0]
        assert str(lower_batch(prog, lens).pair_count()) in out.splitlines()[0]


def test_parse_seqlens():
    assert parse_seqlens("4096,1000,300") == (4096, 1000, 300)
    assert parse_seqlens(" 7 , 8 ") == (7, 8)
    for bad, why in (("", "empty"), ("4096,,3", "empty"), ("12,x", "not an integer"), ("3.5", "not an integer"),
                     ("0,4", "positive"), ("5,-2", "positive")):
        with pytest.raises(BatchError, match=why):
            parse_seqlens(bad)


def test_load_batch_json_and_jsonl(tmp_path):
    f = tmp_path / "b.json"
    f.write_text(json.dumps({"seqlens": [3, 4], "segments": [[["text", 1], ["image", 2]], None], "name": "x"}))
    b = load_batch(str(f))
    assert b == Batch((3, 4), ((("text", 1), ("image", 2)), None), "x")
    assert load_batch(f"{f}:x") == b
    g = tmp_path / "b.jsonl"
    g.write_text('{"name": "a", "seqlens": [1, 2]}\n\n{"name": "b", "seqlens": [5]}\n')
    assert load_batch(f"{g}:b").seqlens == (5,)
    with pytest.raises(BatchError, match=r"2 batches.*names: a, b"):
        load_batch(str(g))
    with pytest.raises(BatchError, match=r"no batch named 'c'.*a, b"):
        load_batch(f"{g}:c")


@pytest.mark.skipif(not SHARED_BATCHES.exists(), reason="../shared/workloads/batches.jsonl is not beside this checkout")
def test_shared_batches_load_by_name():
    spec = os.path.relpath(SHARED_BATCHES, ROOT)
    assert spec == os.path.join("..", "shared", "workloads", "batches.jsonl")
    b = load_batch(str(SHARED_BATCHES) + ":lmsys-128k-0")
    assert b.name == "lmsys-128k-0" and len(b.seqlens) == 171 and sum(b.seqlens) == 131072
    b = load_batch(str(SHARED_BATCHES) + ":pretrain-512k-1")
    assert set(b.seqlens) == {8192} and b.segments is None
    with pytest.raises(BatchError, match="lmsys-128k-0"):
        load_batch(str(SHARED_BATCHES))


@pytest.mark.parametrize("content,why", [
    ('{"seqlens": [1, 2', r"b\.json:1: invalid JSON"),
    ('{\n "seqlens": [1, 2],\n oops\n}', r"b\.json:3: invalid JSON"),
    ('{"name": "z"}', "missing \"seqlens\""),
    ('{"seqlens": []}', "non-empty"),
    ('{"seqlens": [4, 2.5]}', r"seqlens\[1\] = 2.5 is not a positive integer"),
    ('{"seqlens": [4, 0]}', r"seqlens\[1\] = 0 is not a positive integer"),
    ('{"seqlens": [4, "8"]}', "not a positive integer"),
    ('{"seqlens": [4, -1]}', "not a positive integer"),
    ('[1, 2]', "expected a JSON object"),
    ('{"seqlens": [4, 3], "segments": [null]}', "1 entries but there are 2 samples"),
    ('{"seqlens": [4], "segments": [[["text", 1], ["image", 2]]]}',
     r"segments\[0\] sum to 3 but sample 0 has length 4"),
    ('{"seqlens": [4], "segments": [[["text", 4, 1]]]}', r"must be \[kind, length\]"),
    ('{"seqlens": [4], "segments": [[[3, 4]]]}', "kind must be a non-empty string"),
    ('{"seqlens": [4], "segments": [[["text", 0], ["image", 4]]]}', "not a positive integer"),
])
def test_bad_batch_files(tmp_path, content, why):
    f = tmp_path / "b.json"
    f.write_text(content)
    with pytest.raises(BatchError, match=why) as e:
        load_batch(str(f))
    assert "\n" not in str(e.value)


def test_bad_batch_specs(tmp_path):
    with pytest.raises(BatchError, match="not found"):
        load_batch(str(tmp_path / "nope.json"))
    g = tmp_path / "b.jsonl"
    g.write_text('{"name": "a", "seqlens": [1]}\n{"name": "b", "seqlens": [1, }\n')
    with pytest.raises(BatchError, match=r"b\.jsonl:2: invalid JSON"):
        load_batch(f"{g}:a")
    with pytest.raises(BatchError, match="positive integer"):
        Batch((3, 0))
    with pytest.raises(BatchError, match="sum to"):
        Batch((3,), ((("text", 2),),))


# ----------------------------------------------------------------------- errors

def error(text, filename="<mask>") -> MaskError:
    with pytest.raises(MaskError) as e:
        parse_mask(text, filename)
    return e.value


def test_syntax_error_points_at_the_token():
    e = error("let w = 3\nmask = sliding_window(w) | ()\n", "bad.mask")
    assert (e.filename, e.line, e.col) == ("bad.mask", 2, 29)
    assert e.message == "expected an expression, got ')'"
    lines = str(e).splitlines()
    assert lines[0] == "bad.mask:2:29: expected an expression, got ')'"
    assert lines[1].strip() == "mask = sliding_window(w) | ()"
    assert lines[2].index("^") - lines[1].index("m") == 28  # caret under the ')'
    e = error("sliding_window(256")
    assert (e.col, e.message) == (19, "expected ',' or ')', got end of input")
    e = error("causal causal")
    assert e.col == 8 and "expected an operator" in e.message
    e = error("k = q")
    assert "==" in e.message
    e = error("let w = 3 +   # trailing operator\ncausal")
    assert (e.line, e.col, e.message) == (1, 12, "expected an expression, got end of line")
    e = error("causal & $")
    assert (e.col, e.message) == (10, "unexpected character '$'")


def test_unknown_name_lists_known_ones():
    e = error("causal | slidng_window(4)")
    assert (e.line, e.col) == (1, 10)
    assert "unknown name `slidng_window`" in e.message and "did you mean `sliding_window`" in e.message
    for name in ("causal", "full", "sliding_window(w)", "streaming(s, w)", "shared_question(n, f)",
                 "causal_blockwise(b, k)", "block_causal(b)", "prefix_lm(p)", "chunked_causal(c)"):
        assert name in e.message
    assert "used before its definition" in error("f\nlet f = causal").message


@pytest.mark.parametrize("text,col,msg", [
    ("sliding_window()", 1, "takes 1 argument (w), got 0"),
    ("causal | sliding_window(1, 2)", 10, "takes 1 argument (w), got 2"),
    ("streaming(4)", 1, "takes 2 arguments (s, w), got 1"),
    ("causal(3)", 1, "takes no arguments, got 1"),
    ("sliding_window", 1, "takes 1 argument (w), got 0"),
    ("let f(a, b) = a & b\nf(causal)", 1, "takes 2 arguments (a, b), got 1"),
])
def test_wrong_arity(text, col, msg):
    e = error(text)
    assert e.col == col and msg in e.message, str(e)


@pytest.mark.parametrize("text,col,msg", [
    ("sliding_window(0)", 16, "must be a positive integer, got 0"),
    ("causal & sliding_window(-4)", 25, "must be a positive integer, got -4"),
    ("chunked_causal(2.5)", 16, "got 2.5, which is not an integer"),
    ("block_causal(0)", 14, "positive integer"),
    ("prefix_lm(1 - 1)", 11, "got 0"),
    ("streaming(4, 0)", 14, "w (window width) must be a positive integer"),
    ("causal_blockwise(8, 0)", 21, "k (window in blocks) must be a positive integer"),
    ("shared_question(0, 0.5)", 17, "n (number of answers) must be a positive integer"),
    ("shared_question(2, 1)", 20, "0 < f < 1"),
    ("sliding_window(k)", 16, "must be a number, got the position term `k`"),
    ("sliding_window(causal)", 16, "must be a number, got a mask"),
    ("let f(w) = sliding_window(w)\nf(0)", 27, "(in `f`, used at line 2, col 1)"),
])
def test_bad_parameters(text, col, msg):
    e = error(text)
    assert e.col == col and msg in e.message, str(e)


def test_parameter_depending_on_L_is_checked_when_lowering():
    prog = parse_mask("sliding_window(L - 10)")
    assert prog.lower(11) == parse_mask("sliding_window(1)").lower(11)
    with pytest.raises(MaskError, match=r"got 0 \[sample length 10\]"):
        prog.lower(10)


@pytest.mark.parametrize("text,msg", [
    ("causal + 1", "left side of `+` must be a number"),
    ("q & k", "left side of `&` (intersection) must be a mask"),
    ("3", "the mask expression must be a mask, got the number 3"),
    ("!k", "`!` (complement) needs a mask"),
    ("causal < 3", "not masks"),
    ("q + 1 in image", "`in` tests the segment of `q` or `k`"),
    ("k < 1 // 0", "division by zero"),
    ("let q = 3\ncausal", "reserved"),
    ("let causal = full\ncausal", "builtin"),
    ("let f(a, a) = a\nf(1, 1)", "listed twice"),
    ("let f = causal\nlet f = full\nf", "already defined at line 1"),
    ("causal\nfull", "exactly one"),
    ("let x = causal", "no mask expression"),
    ("# only a comment\n", "no mask expression"),
    ("", "empty mask"),
    ("w = causal", "let w ="),
    ("q(3)", "cannot be called"),
])
def test_other_static_errors(text, msg):
    assert msg in error(text).message


def test_the_caret_stands_under_the_token_after_tabs_and_wide_characters():
    """The caret line repeats the source line's tabs (same tab stops) and counts a wide character as two
    columns and a combining mark as none, so on a terminal the caret is under the offending token."""
    import unicodedata

    from attnplan.errors import _pad
    e = error("\tcausal causal")
    src, caret = str(e).splitlines()[1:]
    assert caret.index("^") == src.index("causal", 4) and caret[:3] == "  \t" and caret.count("\t") == 1

    def width(s):
        return sum(2 if unicodedata.east_asian_width(c) in ("W", "F") else 0 if unicodedata.combining(c) else 1
                   for c in s)
    for prefix in ("q < 文字 ", "e\u0301 = ", "\t\tab", ""):
        pad = _pad(prefix)
        assert pad.strip() == "" and pad.count("\t") == prefix.count("\t")
        assert width(pad.replace("\t", "")) == width(prefix.replace("\t", ""))
