"""The standard library of named masks.

Every builder takes the sample length ``L``, the sample's segment table (used
only by the segment builtins) and its already-validated arguments, and returns
sample-relative :class:`~attnplan.ir.mask.Pieces` inside ``[0, L)^2``. Pieces
are built directly, vectorized over blocks/chunks/answers where one piece per
block is needed; nothing loops over tokens, and no dense matrix is ever made.

=========================  ======================================================
``causal``                 k <= q
``full``                   every pair of the sample
``true`` / ``false``       every pair / no pair
``sliding_window(w)``      q - w < k <= q
``streaming(s, w)``        k <= q and (k < s or q - k < w)
``shared_question(n, f)``  question = first floor(L*f) tokens, causal; the rest
                           split into n answers of floor((L - Lq)/n) tokens (the
                           last takes the remainder); an answer sees the whole
                           question and itself causally, never another answer
``causal_blockwise(b, k)`` blocks of b tokens; the first and the last block
                           (the one holding L-1) are causal (k <= q); any other
                           token sees the first block and keys in
                           [max(b, q - k*b), q]
``block_causal(b)``        k < (floor(q/b) + 1) * b
``prefix_lm(p)``           k < p or k <= q
``chunked_causal(c)``      k <= q and floor(k/c) == floor(q/c)
``same_segment``           q and k in the same segment
``earlier_segment``        k's segment lies before q's
=========================  ======================================================

Widths, lengths and counts must be positive integers; ``f`` is a number with
``0 < f < 1`` (decimal literals are exact, so ``floor(L*f)`` has no rounding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Callable

import numpy as np

from attnplan.ir.mask import INF, Pieces


def fmt_number(v) -> str:
    """A number as the user wrote it: ints plainly, exact decimals as decimals."""
    if isinstance(v, Fraction) and v.denominator != 1:
        d = v.denominator
        for p in (2, 5):
            while d % p == 0:
                d //= p
        if d == 1:  # a terminating decimal: print it exactly
            return format(Decimal(v.numerator) / Decimal(v.denominator), "f")
        return f"{v.numerator}/{v.denominator}"
    return str(int(v))


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    kind: str  # "positive" (positive integer) or "unit" (number in (0, 1))
    doc: str

    def problem(self, v) -> str | None:
        """Why ``v`` is not acceptable for this parameter, or None."""
        if self.kind == "positive":
            if isinstance(v, Fraction) and v.denominator != 1:
                return (f"{self.name} ({self.doc}) must be a positive integer, got {fmt_number(v)}, "
                        f"which is not an integer")
            if v < 1:
                return f"{self.name} ({self.doc}) must be a positive integer, got {fmt_number(v)}"
            return None
        if not 0 < v < 1:
            return f"{self.name} ({self.doc}) must be a number with 0 < {self.name} < 1, got {fmt_number(v)}"
        return None


@dataclass(frozen=True, slots=True)
class Builtin:
    name: str
    params: tuple[Param, ...]
    build: Callable  # (L, seg, *args) -> Pieces
    doc: str
    uses_segments: bool = False
    size: Callable | None = None  # (L, seg, *args) -> at most this many pieces; None: a few (<= 6)

    def max_pieces(self, L, seg, *args) -> int:
        """An upper bound on the pieces ``build`` makes, known before building them."""
        return 6 if self.size is None else self.size(L, seg, *args)

    @property
    def signature(self) -> str:
        return f"{self.name}({', '.join(p.name for p in self.params)})" if self.params else self.name


@dataclass(frozen=True, slots=True)
class Segments:
    """One sample's segment table: parallel arrays of starts, ends and kinds."""
    starts: np.ndarray
    ends: np.ndarray
    kinds: np.ndarray  # object array of str

    @staticmethod
    def of(length: int, segments) -> "Segments":
        if segments is None:
            segments = (("text", length),)
        lens = np.array([int(n) for _, n in segments], dtype=np.int64)
        ends = np.cumsum(lens)
        kinds = np.empty(len(segments), dtype=object)
        kinds[:] = [str(kind) for kind, _ in segments]
        return Segments(ends - lens, ends, kinds)


def _rows(*cols) -> Pieces:
    """Pieces from broadcast columns q0, q1, k0, k1, lo, hi (disjoint by construction)."""
    cols = np.broadcast_arrays(*[np.asarray(c, dtype=np.int64) for c in cols])
    return Pieces.of(np.stack(cols, axis=-1).reshape(-1, 6))


def _causal(L, seg):
    return Pieces.rect(0, L, 0, L, -INF, 0)


def _full(L, seg):
    return Pieces.rect(0, L, 0, L)


def _false(L, seg):
    return Pieces.empty()


def _sliding_window(L, seg, w):
    return Pieces.rect(0, L, 0, L, 1 - min(w, L), 0)


def _streaming(L, seg, s, w):
    w = min(w, L)
    # the window band, plus the sinks (k < s) left of the band
    return _rows([0, 0], L, 0, [L, min(s, L)], [1 - w, -INF], [0, -w])


def _shared_question(L, seg, n, f):
    lq = math.floor(L * Fraction(f))
    rest = L - lq
    size = rest // n
    if size == 0:  # every answer but the last is empty: the last takes all
        starts = np.array([lq], dtype=np.int64)
    else:
        starts = lq + size * np.arange(n, dtype=np.int64)
    ends = np.append(starts[1:], L)
    question = Pieces.rect(0, lq, 0, lq, -INF, 0)
    sees_question = _rows(starts, ends, 0, lq, -INF, INF)
    itself = _rows(starts, ends, starts, ends, -INF, 0)
    return Pieces.concat([question, sees_question, itself])


def _causal_blockwise(L, seg, b, kb):
    b = min(b, L)
    last = (L - 1) // b * b  # start of the block holding L - 1
    if last == 0:  # one block: causal
        return _causal(L, seg)
    window = min(kb * b, L)
    # first block causal, last block causal; middle rows see block 0 fully and
    # keys in [max(b, q - kb*b), q] (k >= b, -window <= k - q <= 0)
    return _rows([0, last, b, b], [b, L, last, last], [0, 0, 0, b], [L, L, b, L],
                 [-INF, -INF, -INF, -window], [0, 0, INF, 0])


def _block_causal(L, seg, b):
    b = min(b, L)
    q0 = np.arange(0, L, b, dtype=np.int64)
    q1 = np.minimum(q0 + b, L)
    return _rows(q0, q1, 0, q1, -INF, INF)


def _prefix_lm(L, seg, p):
    return _rows(0, L, 0, [L, min(p, L)], [-INF, 1], [0, INF])


def _chunked_causal(L, seg, c):
    c = min(c, L)
    s = np.arange(0, L, c, dtype=np.int64)
    e = np.minimum(s + c, L)
    return _rows(s, e, s, e, -INF, 0)


def _same_segment(L, seg: Segments):
    return _rows(seg.starts, seg.ends, seg.starts, seg.ends, -INF, INF)


def _earlier_segment(L, seg: Segments):
    return _rows(seg.starts, seg.ends, 0, seg.starts, -INF, INF)


def segment_rows(L, seg: Segments, var: str, kind: str) -> Pieces:
    """``q in kind`` (var "q") or ``k in kind`` (var "k")."""
    hit = seg.kinds == kind
    s, e = seg.starts[hit], seg.ends[hit]
    if var == "q":
        return _rows(s, e, 0, L, -INF, INF)
    return _rows(0, L, s, e, -INF, INF)


def _per_block(L, seg, b):
    return -(-L // min(b, L))


def _per_segment(L, seg):
    return len(seg.starts)


_W = Param("w", "positive", "window width")
BUILTINS: dict[str, Builtin] = {b.name: b for b in [
    Builtin("causal", (), _causal, "k <= q"),
    Builtin("full", (), _full, "every pair of the sample"),
    Builtin("true", (), _full, "every pair of the sample"),
    Builtin("false", (), _false, "no pair"),
    Builtin("sliding_window", (_W,), _sliding_window, "q - w < k <= q"),
    Builtin("streaming", (Param("s", "positive", "sink tokens"), _W), _streaming,
            "k <= q and (k < s or q - k < w)"),
    Builtin("shared_question", (Param("n", "positive", "number of answers"),
                                Param("f", "unit", "question fraction")), _shared_question,
            "question = first floor(L*f) tokens, causal; n answers see it and themselves causally",
            size=lambda L, seg, n, f: 2 * min(n, L) + 1),
    Builtin("causal_blockwise", (Param("b", "positive", "block size"),
                                 Param("k", "positive", "window in blocks")), _causal_blockwise,
            "first/last block causal; others see block 0 and keys in [max(b, q - k*b), q]"),
    Builtin("block_causal", (Param("b", "positive", "block size"),), _block_causal,
            "k < (floor(q/b) + 1) * b", size=_per_block),
    Builtin("prefix_lm", (Param("p", "positive", "prefix length"),), _prefix_lm, "k < p or k <= q"),
    Builtin("chunked_causal", (Param("c", "positive", "chunk size"),), _chunked_causal,
            "k <= q inside chunks of c tokens", size=_per_block),
    Builtin("same_segment", (), _same_segment, "q and k in the same segment", True, _per_segment),
    Builtin("earlier_segment", (), _earlier_segment, "k's segment lies before q's", True, _per_segment),
]}
