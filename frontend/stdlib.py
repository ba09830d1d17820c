"""The standard library of named masks.

Every builder takes the sample length ``L``, the sample's segment table (used
only by the segment builtins) and its already-validated arguments, and returns
sample-relative :class:`~attnplan.ir.mask.Pieces` inside ``[0, L)^2``. Pieces
are built directly, vectorized over blocks/chunks/answers where one piece per
block is needed; nothing loops over tokens, and no dense matrix is ever made.

========================================  ==============================================================
``causal``                                k <= q
``full``                                  every pair of the sample
``true`` / ``false``                      every pair / no pair
``sliding_window(w)``                     q - w < k <= q
``streaming(s, w)``                       k <= q and (k < s or q - k < w)
``shared_question(n, f)``                 question = first floor(L*f) tokens, causal; the rest split
                                          into n answers of floor((L - Lq)/n) tokens (the last takes the
                                          remainder); an answer sees the whole question and itself
                                          causally, never another answer
``causal_blockwise(b, k)``                blocks of b tokens; the first and the last block (the one
                                          holding L-1) are causal (k <= q); any other token sees the
                                          first block and keys in [max(b, q - k*b), q]
``block_causal(b)``                       k < (floor(q/b) + 1) * b
``prefix_lm(p)``                          k < p or k <= q
``chunked_causal(c)``                     k <= q and floor(k/c) == floor(q/c)
``same_segment``                          q and k in the same segment
``earlier_segment``                       k's segment lies before q's
``document``                              q and k in the same document: attention-gym's document mask.
                                          Samples never attend across each other; inside a sample its
                                          segments are its documents (none given: one), so it is the
                                          same mask as ``same_segment``, under the name ported masks use
                                          (``document & causal``)
``dilated_sliding_window(w, d)``          k <= q, q - k < w*d and (q - k) % d == 0: w keys, every d-th
                                          (``dilated_sliding_window(w, 1)`` is ``sliding_window(w)``);
                                          min(w, ceil(L/d)) pieces
``global_tokens(n)``                      q < n or k < n: the first n tokens see every token and every
                                          token sees them (Longformer/BigBird global tokens; combine:
                                          ``sliding_window(w) | global_tokens(n)``)
``natten2d(H, W, kh, kw)``                NATTEN neighborhood attention over an H x W canvas laid out
                                          row-major (token t is row t // W, column t % W): the kh x kw
                                          window centred on the query, shifted inwards at the canvas
                                          edges, so every query sees exactly kh*kw keys (attention-gym's
                                          ``generate_natten``; for a non-square canvas that one clamps
                                          the row t // W against the width, here each axis is clamped
                                          within its own extent). kh, kw odd, kh <= H, kw <= W. Only
                                          tokens t < H*W are on the canvas: pairs with a token past H*W
                                          are not in the mask (add them with ``|``); a sample shorter
                                          than H*W is the first L tokens of the canvas, windows
                                          unchanged (a query near the cut sees the keys that exist). At
                                          most 3 pieces per (query row, key row) pair
``sliding_tile2d(H, W, th, tw, kh, kw)``  sliding tile attention (FastVideo's STA; attention-gym's
                                          ``generate_sta_mask_mod_2d`` with canvas (H, W), tile (th,
                                          tw), kernel (kh*th, kw*tw), no text): the H x W canvas is cut
                                          into tiles of th x tw tokens, each tile's tokens contiguous
                                          (row-major inside the tile), tiles in row-major order over the
                                          (H/th) x (W/tw) tile grid. A query sees the kh x kw tiles
                                          around its tile, the window shifted inwards at the edges
                                          (start clamp(tile - kh // 2, 0, H/th - kh), likewise for
                                          columns). th divides H, tw divides W, kh <= H/th, kw <= W/tw.
                                          Tokens past H*W and short samples as for ``natten2d``. At most
                                          kh pieces per query tile
========================================  ==============================================================

Widths, lengths and counts must be positive integers; ``f`` is a number with
``0 < f < 1`` (decimal literals are exact, so ``floor(L*f)`` has no rounding).
A builtin with several parameters checks how they fit together (a kernel
inside its canvas) where its call is written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Callable

import numpy as np

from attnplan.ir.limits import MAX_TOKENS
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
    check: Callable | None = None  # (*args) -> (argument index, problem) or None: how parameters fit together

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


def _dilated_sliding_window(L, seg, w, d):
    lags = d * np.arange(min(w, (L - 1) // d + 1), dtype=np.int64)
    return _rows(0, L, 0, L, -lags, -lags)


def _global_tokens(L, seg, n):
    n = min(n, L)
    return _rows([0, n], [n, L], 0, [L, n], -INF, INF)


def _window_starts(pos: np.ndarray, kernel: int, size: int) -> np.ndarray:
    """First cell of the ``kernel`` cells around each of ``pos`` on an axis of ``size``
    cells, shifted inwards at the edges: clamp(pos - kernel // 2, 0, size - kernel)."""
    return np.clip(pos - kernel // 2, 0, size - kernel)


def _canvas_rows(L, W, height, kernel_rows):
    """(rows that exist, key rows per query row) on a canvas of ``height`` rows of ``W`` tokens."""
    n = min(L, height * W)
    rows = -(-n // W)
    return n, rows, min(kernel_rows, rows)


def _natten2d(L, seg, H, W, kh, kw):
    n, rows, per_row = _canvas_rows(L, W, H, kh)
    y = np.arange(rows, dtype=np.int64)
    yk = _window_starts(y, kh, H)[:, None] + np.arange(per_row, dtype=np.int64)[None, :]
    y, yk = np.broadcast_arrays(y[:, None], yk)
    keep = yk < rows  # key rows past the cut hold no token
    y, yk = y[keep], yk[keep]
    r = kw // 2
    q0, k0 = y * W, yk * W
    # query columns < r see key columns [0, kw); columns >= W - r see [W - kw, W); the rest |dx| <= r
    pieces = [_rows(q0, q0 + r, k0, k0 + kw, -INF, INF),
              _rows(q0 + r, q0 + W - r, k0, k0 + W, k0 - q0 - r, k0 - q0 + r),
              _rows(q0 + W - r, q0 + W, k0 + W - kw, k0 + W, -INF, INF)]
    return _clip(Pieces.concat(pieces), n)


def _clip(p: Pieces, n: int) -> Pieces:
    """Pieces cut to ``[0, n)^2``."""
    a = p.a.copy()
    a[:, 1] = np.minimum(a[:, 1], n)
    a[:, 3] = np.minimum(a[:, 3], n)
    return Pieces.of(a)


def _sliding_tile2d(L, seg, H, W, th, tw, kh, kw):
    area, nh, nw = th * tw, H // th, W // tw
    n = min(L, H * W)
    tiles = np.arange(-(-n // area), dtype=np.int64)
    start_row = _window_starts(tiles // nw, kh, nh)
    start_col = _window_starts(tiles % nw, kw, nw)
    key_rows = start_row[:, None] + np.arange(min(kh, nh), dtype=np.int64)[None, :]
    first = (key_rows * nw + start_col[:, None]) * area
    q0 = np.broadcast_to((tiles * area)[:, None], first.shape)
    keep = first < n
    rows = np.stack(np.broadcast_arrays(q0[keep], q0[keep] + area, first[keep], first[keep] + kw * area,
                                        -INF, INF), axis=-1)
    return _clip(Pieces(merge_rows(rows, 0, 1)), n)


def merge_rows(rows: np.ndarray, lo: int, hi: int, step: int = 0) -> np.ndarray:
    """Rows ``[n, 6]`` (disjoint pieces) with every two that are equal outside columns
    (lo, hi) and touch (``hi`` of one + ``step`` == ``lo`` of the next) made one:
    step 0 for the half-open q or k ranges, 1 for the closed band."""
    if len(rows) < 2:
        return rows
    key = [c for c in range(6) if c not in (lo, hi)]
    order = np.lexsort([rows[:, lo]] + [rows[:, c] for c in reversed(key)])
    r = rows[order]
    same = np.all(r[1:, key] == r[:-1, key], axis=1) & (r[:-1, hi] + step == r[1:, lo])
    first = np.flatnonzero(np.concatenate([[True], ~same]))
    out = r[first].copy()
    out[:, hi] = r[np.append(first[1:], len(r)) - 1, hi]
    return out


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


def _natten_size(L, seg, H, W, kh, kw):
    _, rows, per_row = _canvas_rows(L, W, H, kh)
    return 3 * rows * per_row


def _sta_size(L, seg, H, W, th, tw, kh, kw):
    n = min(L, H * W)
    return -(-n // (th * tw)) * min(kh, -(-n // (W * th)))


def _canvas_problem(H, W):
    if H * W > MAX_TOKENS:
        return 0, f"the canvas H x W = {H} x {W} has more than MAX_TOKENS = {MAX_TOKENS:,} tokens (ir/limits.py)"
    return None


def _odd_inside(names: tuple, sizes: tuple):
    def check(*args):
        if _canvas_problem(args[0], args[1]):
            return _canvas_problem(args[0], args[1])
        for (i, kernel), (j, size) in zip(names, sizes):
            k, s = args[i], args[j]
            if k % 2 == 0:
                return i, f"{kernel} must be odd (a window centred on the query), got {k}"
            if k > s:
                return i, f"{kernel} ({k}) must be at most {size} ({s})"
        return None
    return check


def _check_sta(H, W, th, tw, kh, kw):
    if _canvas_problem(H, W):
        return _canvas_problem(H, W)
    for i, tile, size, what in ((2, th, H, "th (tile height) must divide H"), (3, tw, W, "tw (tile width) must "
                                                                               "divide W")):
        if size % tile:
            return i, f"{what}: {size} is not a multiple of {tile}"
    for i, kernel, tiles, what in ((4, kh, H // th, "kh (window height in tiles)"),
                                   (5, kw, W // tw, "kw (window width in tiles)")):
        if kernel > tiles:
            return i, f"{what} must be at most the {tiles} tiles of the canvas"
    return None


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
    Builtin("document", (), _same_segment, "q and k in the same document (a sample's segments; = same_segment)",
            True, _per_segment),
    Builtin("dilated_sliding_window", (Param("w", "positive", "keys in the window"),
                                       Param("d", "positive", "dilation")), _dilated_sliding_window,
            "k <= q, q - k < w*d, (q - k) % d == 0", size=lambda L, seg, w, d: min(w, (L - 1) // d + 1)),
    Builtin("global_tokens", (Param("n", "positive", "global tokens"),), _global_tokens, "q < n or k < n"),
    Builtin("natten2d", (Param("H", "positive", "canvas height"), Param("W", "positive", "canvas width"),
                         Param("kh", "positive", "kernel height"), Param("kw", "positive", "kernel width")),
            _natten2d, "NATTEN: the kh x kw neighborhood on an H x W row-major canvas", size=_natten_size,
            check=_odd_inside(((2, "kh (kernel height)"), (3, "kw (kernel width)")), ((0, "H"), (1, "W")))),
    Builtin("sliding_tile2d", (Param("H", "positive", "canvas height"), Param("W", "positive", "canvas width"),
                               Param("th", "positive", "tile height"), Param("tw", "positive", "tile width"),
                               Param("kh", "positive", "window height in tiles"),
                               Param("kw", "positive", "window width in tiles")),
            _sliding_tile2d, "STA: the kh x kw tiles around the query's tile (tiles of th x tw tokens)",
            size=_sta_size, check=_check_sta),
]}
