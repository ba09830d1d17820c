"""Long unions split the plane instead of folding: the result equals the brute-force union, its pieces
are disjoint (pair counts equal the dense count), cut pieces are joined back, the work is charged to the
budget, and the mask language takes this path for unions of many terms."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnplan.errors import MaskError
from attnplan.frontend import lower_batch, parse_mask, setops, unionsplit
from attnplan.frontend.setops import Budget, LimitExceeded
from attnplan.frontend.unionsplit import coalesce, union_split
from attnplan.ir.mask import INF, Pieces

L = 48

piece = st.tuples(st.integers(0, L - 1), st.integers(1, L), st.integers(0, L - 1), st.integers(1, L),
                  st.one_of(st.none(), st.tuples(st.integers(-L, L), st.integers(0, 2 * L))),
                  st.sampled_from(["as is", "complement", "twice"]))


def _operand(q0, h, k0, w, band, how) -> Pieces:
    lo, hi = (-INF, INF) if band is None else (band[0], band[0] + band[1])
    p = Pieces.rect(q0, min(L, q0 + h), k0, min(L, k0 + w), lo, hi)
    if how == "complement":  # an operand of several disjoint pieces
        p = p.complement(L)
    return p


def _dense_union(values) -> np.ndarray:
    want = np.zeros((L, L), bool)
    for v in values:
        want |= v.to_dense(L)
    return want


@settings(max_examples=120)
@given(st.lists(piece, min_size=1, max_size=70))
def test_the_split_union_equals_the_brute_force_union(spec):
    values = [_operand(*s) for s in spec]
    values += [_operand(*s) for s in spec if s[-1] == "twice"]  # the same operand twice
    got = union_split(values, Budget())
    want = _dense_union(values)
    assert (got.to_dense(L) == want).all()
    assert got.pair_count() == int(want.sum())  # no pair counted twice: the pieces are disjoint


@settings(max_examples=60)
@given(st.lists(st.tuples(st.integers(0, L - 1), st.integers(1, 12), st.integers(0, L - 1), st.integers(1, 12)),
                min_size=unionsplit.MIN_OPERANDS, max_size=80))
def test_the_language_splits_long_unions_and_equals_dense(boxes):
    text = " | ".join(f"(q >= {a} & q < {a + h} & k >= {b} & k < {b + w})" for a, h, b, w in boxes)
    q, k = np.arange(L)[:, None], np.arange(L)[None, :]
    want = np.zeros((L, L), bool)
    for a, h, b, w in boxes:
        want |= (q >= a) & (q < a + h) & (k >= b) & (k < b + w)
    got = lower_batch(parse_mask(text), [L])
    assert (got.to_dense(L) == want).all() and got.pair_count() == int(want.sum())


def test_long_unions_take_the_split(monkeypatch):
    calls = []
    real = unionsplit.union_split
    monkeypatch.setattr(unionsplit, "union_split", lambda *a: calls.append(1) or real(*a))
    terms = [f"(q >= {i} & q < {i + 9} & k >= {i} & k < {i + 9})" for i in range(unionsplit.MIN_OPERANDS)]
    lower_batch(parse_mask(" | ".join(terms)), [64])
    assert calls == [1]
    lower_batch(parse_mask(" | ".join(terms[:-1])), [64])  # one term fewer: folded as before
    assert calls == [1]


def test_cut_pieces_are_joined_back():
    whole = Pieces.rect(3, 40, 5, 30)
    strips = np.concatenate([Pieces.rect(a, a + 1, 5, 30).a for a in range(3, 40)])
    cells = np.concatenate([Pieces.rect(a, a + 1, b, b + 5).a for a in range(3, 40) for b in range(5, 30, 5)])
    for parts in (strips, cells):
        assert np.array_equal(coalesce(parts), whole.a)
    apart = np.concatenate([Pieces.rect(0, 5, 0, 5).a, Pieces.rect(6, 9, 0, 5).a])  # a gap: not joined
    assert len(coalesce(apart)) == 2


def test_the_split_is_charged_to_the_budget(monkeypatch):
    values = [Pieces.rect(i, i + 30, i, i + 30) for i in range(0, 200, 3)]
    spent = Budget()
    union_split(values, spent)
    assert spent.work > 0
    monkeypatch.setattr(setops, "MAX_MASK_WORK", spent.work // 2)
    with pytest.raises(LimitExceeded, match="MAX_MASK_WORK"):
        union_split(values, Budget())


def test_ten_thousand_rectangles_on_4096_tokens_equal_brute_force():
    """The long union the mask language used to refuse (the fold's work grew with the square of the terms);
    its time is measured by benchmarks/hostile_inputs.py."""
    rng = np.random.default_rng(7)
    n = 4096
    lo = rng.integers(0, n - 256, (10_000, 2))
    hi = lo + rng.integers(1, 256, (10_000, 2))
    want = np.zeros((n, n), bool)
    for (a, c), (b, d) in zip(lo, hi):
        want[a:b, c:d] = True
    text = " | ".join(f"(q >= {a} & q < {b} & k >= {c} & k < {d})" for (a, c), (b, d) in zip(lo, hi))
    got = lower_batch(parse_mask(text), [n])
    assert (got.to_dense(n) == want).all() and got.pair_count() == int(want.sum())


def test_an_error_in_a_long_line_shows_a_window_around_the_caret():
    text = " | ".join(f"k == {i}" for i in range(5000)) + " | kk"
    e = pytest.raises(MaskError, parse_mask, text).value
    shown = str(e).splitlines()
    assert e.col == len(text) - 1 and len(shown) == 3
    assert shown[1].startswith("  ...") and shown[1].endswith("| kk") and len(shown[1]) < 220
    assert shown[1][shown[2].index("^"):].startswith("kk")


def test_a_repeated_operand_is_taken_once_and_distinct_ones_are_charged_before_they_are_joined(monkeypatch):
    seen = []
    real = unionsplit.union_split
    monkeypatch.setattr(unionsplit, "union_split", lambda v, b: seen.append(b.work) or real(v, b))
    text = "let x = q % 2 == 0\n" + " | ".join(["x"] * 2000)  # one 10,000-piece value, 2,000 times
    got = lower_batch(parse_mask(text), [20_000])
    assert len(got) == 10_000 and got.pair_count() == 10_000 * 20_000 and seen
    big = [Pieces.rect(i, i + 1, 0, 10) for i in range(1000)]
    operands = [Pieces.concat(big[i:] + big[:i]) for i in range(40)]  # 40 distinct objects of 1,000 rows
    monkeypatch.setattr(setops, "MAX_MASK_WORK", 40 * 1000 * 16)
    with pytest.raises(LimitExceeded, match="sorting a union of 40 operands"):
        union_split(operands, Budget())


def test_a_diagonal_cut_in_two_is_joined_back():
    """Halves of a band piece differ in their extent across the cut (k moves with q): joined by band."""
    n = 1024
    values = [Pieces.rect(0, 500, 0, n, d, d) for d in range(20)] + [Pieces.rect(524, n, 0, n, -d, -d)
                                                                      for d in range(20)]
    values += [Pieces.rect(0, n, 0, n, d, d) for d in range(200, 210)] + [Pieces.rect(0, 300, 0, n, 0, 0)]
    got = union_split(values, Budget())
    assert got.pair_count() == int(_dense(values, n).sum())
    assert len(got) <= 51  # one piece per diagonal segment, as the fold gives


def _dense(values, n):
    want = np.zeros((n, n), bool)
    for v in values:
        want |= v.to_dense(n)
    return want
