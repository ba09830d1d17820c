"""Wider property tests (issue 8): masks built from segment predicates,
negation ``!``, comparisons (chained, scaled, against ``L``) and ``&``/``|``,
on batches with mixed-modality segments, every strategy, several device and
node counts and block sizes.

The mask generator carries, next to the text, an independent dense numpy
evaluation of the same expression (written from the language's documented
semantics, not from the lowering), so two things are checked per example:

* the lowered pieces allow exactly the pairs of the dense evaluation (pair
  counts equal dense counts, pair for pair);
* the compiled plan executed block by block equals float64 dense attention,
  outputs and dq/dk/dv (``check`` of test_execute, which also checks the
  plan's pair counts and the program's text round trip).
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from attnplan.frontend import load_mask, lower_batch


def _helpers():
    """test_execute's helpers (pytest runs with --import-mode=importlib, so tests/ is not on sys.path)."""
    spec = importlib.util.spec_from_file_location("_attnplan_test_execute", Path(__file__).with_name("test_execute.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, mod)
    spec.loader.exec_module(mod)
    return sys.modules[spec.name]


_te = _helpers()
STRATEGIES, check, schedules = _te.STRATEGIES, _te.check, _te.schedules

KINDS = ("text", "image", "audio")


@dataclass(frozen=True)
class Sample:
    """Dense coordinates of one sample: q [L, 1], k [1, L], segment ids and kinds per position."""

    L: int
    q: np.ndarray
    k: np.ndarray
    seg_q: np.ndarray
    seg_k: np.ndarray
    kind_q: np.ndarray
    kind_k: np.ndarray

    @staticmethod
    def of(L: int, segments) -> Sample:
        segments = segments or (("text", L),)
        ids = np.repeat(np.arange(len(segments)), [n for _, n in segments])
        kinds = np.repeat(np.array([kd for kd, _ in segments]), [n for _, n in segments])
        pos = np.arange(L)
        return Sample(L, pos[:, None], pos[None, :], ids[:, None], ids[None, :], kinds[:, None], kinds[None, :])


def _num(c: int) -> str:
    """An integer offset as mask text (``+ 3``, ``- 2``, or ``+ -2`` now and then is tested by the parser)."""
    return f"+ {c}" if c >= 0 else f"- {-c}"


# --------------------------------------------------------------------------- masks with a dense oracle

small = st.integers(1, 12)
offset = st.integers(-6, 6)


@st.composite
def builtin_atoms(draw):
    name = draw(st.sampled_from(["causal", "full", "true", "false", "sliding_window", "streaming",
                                 "chunked_causal", "block_causal", "prefix_lm"]))
    if name == "causal":
        return name, lambda s: s.k <= s.q
    if name in ("full", "true"):
        return name, lambda s: np.ones((s.L, s.L), bool)
    if name == "false":
        return name, lambda s: np.zeros((s.L, s.L), bool)
    a = draw(small)
    if name == "sliding_window":
        return f"sliding_window({a})", lambda s: (s.q - a < s.k) & (s.k <= s.q)
    if name == "streaming":
        w = draw(small)
        return f"streaming({a}, {w})", lambda s: (s.k <= s.q) & ((s.k < a) | (s.q - s.k < w))
    if name == "chunked_causal":
        return f"chunked_causal({a})", lambda s: (s.k <= s.q) & (s.k // a == s.q // a)
    if name == "block_causal":
        return f"block_causal({a})", lambda s: s.k < (s.q // a + 1) * a
    return f"prefix_lm({a})", lambda s: (s.k < a) | (s.k <= s.q)


@st.composite
def segment_atoms(draw):
    name = draw(st.sampled_from(["same_segment", "earlier_segment", "q in", "k in"]))
    if name == "same_segment":
        return name, lambda s: s.seg_q == s.seg_k
    if name == "earlier_segment":
        return name, lambda s: s.seg_k < s.seg_q
    kind = draw(st.sampled_from(KINDS))
    if name == "q in":
        return f"q in {kind}", lambda s: np.broadcast_to(s.kind_q == kind, (s.L, s.L))
    return f"k in {kind}", lambda s: np.broadcast_to(s.kind_k == kind, (s.L, s.L))


@st.composite
def comparisons(draw):
    form = draw(st.sampled_from(["k<q+c", "k<=q", "k==q", "k!=q", "q-k<w", "chain", "k<c", "q>=c",
                                 "k<L//d", "q>=L-c", "scaled"]))
    c, w = draw(offset), draw(small)
    if form == "k<q+c":
        return f"k < q {_num(c)}", lambda s: s.k < s.q + c
    if form == "k<=q":
        return "k <= q", lambda s: s.k <= s.q
    if form == "k==q":
        return "k == q", lambda s: s.k == s.q
    if form == "k!=q":
        return "k != q", lambda s: s.k != s.q
    if form == "q-k<w":
        return f"q - k < {w}", lambda s: s.q - s.k < w
    if form == "chain":  # each adjacent pair must hold
        lo, hi = sorted((c, c + draw(st.integers(1, 8))))
        return f"{lo} <= k - q < {hi}", lambda s: (lo <= s.k - s.q) & (s.k - s.q < hi)
    if form == "k<c":
        return f"k < {w}", lambda s: np.broadcast_to(s.k < w, (s.L, s.L))
    if form == "q>=c":
        return f"q >= {w}", lambda s: np.broadcast_to(s.q >= w, (s.L, s.L))
    if form == "k<L//d":
        d = draw(st.integers(2, 4))
        return f"k < L // {d}", lambda s: np.broadcast_to(s.k < s.L // d, (s.L, s.L))
    if form == "q>=L-c":
        return f"q >= L - {w}", lambda s: np.broadcast_to(s.q >= s.L - w, (s.L, s.L))
    # scaled: 2*k < 2*q + c reduces to a band with a rounded bound
    return f"2*k < 2*q {_num(c)}", lambda s: 2 * s.k < 2 * s.q + c


@st.composite
def masks(draw, depth: int = 2):
    """``(text, dense)``: mask text and a function Sample -> bool [L, L]."""
    if depth == 0 or draw(st.integers(0, 2)) == 0:
        return draw(st.one_of(builtin_atoms(), segment_atoms(), comparisons()))
    op = draw(st.sampled_from(["!", "&", "|", "&", "|"]))
    a_text, a = draw(masks(depth - 1))
    if op == "!":
        return f"!({a_text})", lambda s: ~a(s)
    b_text, b = draw(masks(depth - 1))
    if op == "&":
        return f"({a_text}) & ({b_text})", lambda s: a(s) & b(s)
    return f"({a_text}) | ({b_text})", lambda s: a(s) | b(s)


# --------------------------------------------------------------------------- batches

@st.composite
def segmented_samples(draw, L: int):
    """None (one text segment) or 1-3 segments of random kinds summing to L."""
    if draw(st.booleans()):
        return None
    n = draw(st.integers(1, min(3, L)))
    cuts = sorted(draw(st.sets(st.integers(1, L - 1), min_size=n - 1, max_size=n - 1))) if n > 1 else []
    lens = np.diff([0, *cuts, L]).tolist()
    return tuple((draw(st.sampled_from(KINDS)), int(n)) for n in lens)


HEADS = [(1, 1), (2, 1), (4, 2), (4, 4)]


@st.composite
def cases(draw, strategy: str, max_tokens: int = 48):
    # the derandomized profile replays one random stream per test function: skip a strategy-dependent
    # number of draws so that each strategy sees different batches and masks
    draw(st.lists(st.integers(0, 255), min_size=STRATEGIES.index(strategy), max_size=STRATEGIES.index(strategy)))
    lens = draw(st.lists(st.integers(1, 30), min_size=1, max_size=4))
    while sum(lens) > max_tokens:
        lens.pop()
    segments = tuple(draw(segmented_samples(L)) for L in lens)
    if strategy == "ulysses":  # head split: kv heads a multiple of the devices (every head group a tile copy)
        devices = draw(st.integers(1, 4))
        heads, kv = devices * draw(st.sampled_from([1, 2])), devices
    else:
        devices = draw(st.integers(1, 8))
        heads, kv = draw(st.sampled_from(HEADS))
    nodes = draw(st.sampled_from([d for d in (1, 2, 4) if devices % d == 0]))
    # execution costs one kernel call per compute block: tiny blocks only on tiny batches
    block = draw(st.sampled_from([1, 3, 8, 64, 2048] if sum(lens) <= 12 else [4, 8, 16, 64, 2048]))
    text, dense = draw(masks())
    return dict(seqlens=lens, segments=segments if any(segments) else None, mask=text, devices=devices,
                nodes=nodes, heads=heads, kv_heads=kv, head_dim=8, block_size=block, strategy=strategy,
                schedule=draw(schedules()), seed=draw(st.integers(0, 1000))), dense


def dense_batch(case, dense) -> np.ndarray:
    """The mask of the whole packed batch from the dense oracle (nothing across samples)."""
    lens = case["seqlens"]
    segs = case["segments"] or (None,) * len(lens)
    T = sum(lens)
    out = np.zeros((T, T), bool)
    off = np.concatenate([[0], np.cumsum(lens)])
    for a, L, seg in zip(off[:-1].tolist(), lens, segs):
        out[a:a + L, a:a + L] = dense(Sample.of(L, seg))
    return out


# --------------------------------------------------------------------------- the properties

@pytest.mark.parametrize("strategy", STRATEGIES)
@settings(max_examples=10, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data())
def test_wide_masks_execute_as_dense(strategy, data):
    case, dense = data.draw(cases(strategy))
    want = dense_batch(case, dense)
    # a mask that allows no pair at all has no attention to plan (issue 8 defect 6 is tested on its own)
    assume(want.any())
    plan, _, _ = check(dict(case), "float32")
    p = plan.problem
    got = p.pieces.to_dense(p.tokens)
    assert int(got.sum()) == int(want.sum()), f"pairs {int(got.sum())} != dense {int(want.sum())} for {case['mask']!r}"
    assert np.array_equal(got, want), f"lowered mask differs from the dense evaluation of {case['mask']!r}"
    assert plan.stats()["pairs"] == int(want.sum()) * p.heads
    assert plan.ir.devices == case["devices"] and plan.ir.nodes == case["nodes"]


@settings(max_examples=60)
@given(masks(), st.lists(st.integers(1, 30), min_size=1, max_size=3), st.data())
def test_lowering_equals_dense_evaluation(mask, lens, data):
    """The mask language alone, more examples: pieces equal the dense oracle on segmented batches."""
    text, dense = mask
    segments = tuple(data.draw(segmented_samples(L)) for L in lens)
    case = dict(seqlens=lens, segments=segments if any(segments) else None)
    pieces = lower_batch(load_mask(text), lens, case["segments"])
    want = dense_batch(case, dense)
    assert pieces.pair_count() == int(want.sum())
    assert np.array_equal(pieces.to_dense(sum(lens)), want), text
