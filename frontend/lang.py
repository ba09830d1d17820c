"""The mask language: parse text into a :class:`MaskProgram`, lower it to pieces.

The language
============

A mask file is a few statements, one a line, with ``#`` comments::

    # a window with a few global "sink" tokens
    let window(w) = q - w < k <= q
    let sinks = k < 16 & k <= q
    mask = window(256) | sinks

* ``let NAME = EXPR`` and ``let NAME(P1, P2, ...) = EXPR`` define helpers. A
  name refers to definitions above it (so there is no recursion); builtins and
  the reserved names ``q k L`` cannot be redefined. ``h``, ``Lq`` and ``Lk``
  are reserved too, for per-head masks (the query head) and cross-attention
  (query and key lengths), which the language does not have yet.
* Exactly one mask expression: either a bare expression or ``mask = EXPR``.
* A newline ends a statement, except inside parentheses: wrap a long
  expression in ``( ... )`` to split it over lines.

Expressions, loosest binding first:

=================  ============================================================
``A | B``          union
``A & B``          intersection
``!A``             complement within the sample (``!k < 5`` is ``!(k < 5)``)
``a < b <= c``     comparisons ``< <= > >= == !=``, chains allowed (each adjacent
                   pair must hold); ``q in KIND``, ``k in KIND`` (the token's
                   segment has that kind)
``a + b, a - b``   integer arithmetic on numbers and on position terms
``a * b, a // b``  (``//`` floors, ``a % b`` is ``a - b * (a // b)``, as in
``a % b``          Python); ``-a``
atoms              numbers (``64``, ``1_000``, exact decimals ``0.25``), ``q``,
                   ``k``, ``L`` (the sample length), ``true``, ``false``,
                   ``NAME``, ``NAME(args)``, ``( EXPR )``
=================  ============================================================

``q`` and ``k`` are query and key positions relative to the start of the
sample; ``L`` is its length, and a mask never leaves ``[0, L)^2``.
Cross-attention samples (``seqlens_q``/``seqlens_k``: queries of one
sequence, keys of another) have ``Lq`` queries and ``Lk`` keys: the mask is
evaluated on the square of side ``L = max(Lq, Lk)`` (positions still count
from 0 on both sides) and clipped to ``[0, Lq) x [0, Lk)``, so ``causal`` is
``k <= q`` (FlexAttention's top-left alignment; FlashAttention's bottom-right
causal is ``k <= q + Lk - Lq``). In a self-attention sample ``Lq = Lk = L``. A comparison
must reduce to ``k - q OP c``, ``k OP c`` or ``q OP c`` (a diagonal band, a
column range or a row range), e.g. ``q - k < w``, ``k <= q``, ``2*k < 2*q + 7``,
``k < L // 2``; anything else (``q * k``, ``k < 2 * q``) is an error at its
position. Masks, numbers and position terms are distinct types: ``causal + 1``
or ``sliding_window(k)`` is an error.

Position arithmetic (:mod:`.periodic`, lowered by :mod:`.cells`): ``x // m``
and ``x % m`` where ``m`` is a positive integer (a number or an expression of
``L``; never a position: ``q % k`` is an error) and ``x`` is ``q``, ``k``,
``k - q`` or ``q - k`` plus an integer, or one of those divided already
(``q // W // H``, ``(q // W) % H``, ``(q % (H*W)) // W``). With every floor held
fixed, a comparison must still reduce to one of the three forms above, and
may take floors of ``k - q``, or of q and k, not both. So these work::

    q // W == k // W                  # same block of W tokens
    k // W <= q // W + 1              # block distance
    (k - q) % d == 0 & k <= q         # dilated window
    -t <= q % W - k % W <= t          # same column of a W-wide canvas, within t
    q // W % H == 0                   # first row of each H x W frame

and ``2 * (q % W) < k``, ``(q + k) // 2``, ``(q % 4) // 3`` do not (an error
at the operator). Each sample lowers exactly: its positions are cut where a
floor changes, so the cost is stated in periods. Floors of one position
(q, k or k - q) cost a piece per period: pieces grow with L / period.
Comparing floors of q with floors of k is cheap when the k side never
decreases (``q // W == k // W``: a run of blocks per q period, L / W pieces);
otherwise (``q % W <= k % W``) every (q period, k period) cell is looked at:
(L / W)^2 work and pieces. Write ``(k - q) % W == 0`` rather than
``q % W == k % W`` (the same mask, 2L/W pieces instead of (L/W)^2). A sample
whose periods would pass ``MAX_MASK_PIECES`` or ``MAX_MASK_WORK`` is refused
before anything is built, with one MaskError at the comparison.

Named masks (see :mod:`attnplan.frontend.stdlib`): ``causal``, ``full``,
``sliding_window(w)``, ``streaming(s, w)``, ``shared_question(n, f)``,
``causal_blockwise(b, k)``, ``block_causal(b)``, ``prefix_lm(p)``,
``chunked_causal(c)``, ``dilated_sliding_window(w, d)``, ``global_tokens(n)``,
``natten2d(H, W, kh, kw)``, ``sliding_tile2d(H, W, th, tw, kh, kw)``, and the
segment predicates ``same_segment``, ``document`` (the same mask, under
attention-gym's name) and ``earlier_segment`` (k's segment lies before q's). A
sample without segments is one segment of kind ``text``.

Limits (``attnplan/ir/limits.py``): a text has at most ``MAX_MASK_TEXT``
characters and at most ``MAX_MASK_DEPTH`` parentheses open at once; a number,
and every arithmetic result, is at most ``MAX_MASK_INT``
(2^62) in magnitude, with at most 18 decimal places; a sample's mask, and a
batch's, has at most ``MAX_MASK_PIECES`` pieces; and evaluating a mask for one
batch costs at most ``MAX_MASK_WORK`` work units (see
:mod:`attnplan.frontend.setops`). Every ``let`` is evaluated once per sample
and argument list, and nothing recurses: long ``let`` chains, long ``|``
chains and deep nesting work, at a cost that follows the text and the pieces.
A flat ``|`` of operands whose pieces lie apart (``k == 0 | k == 1 | ...``)
is concatenated in O(n log n): 10,000 terms parse and lower in about a
second.

Everything that does not depend on ``L`` or on segments is checked when the
text is parsed (names, arity, parameter values, types, reducibility);
the rest when a sample is lowered. Errors are :class:`MaskError` with
``file:line:col``, the line and a caret.

Examples::

    causal
    sliding_window(256) | (k < 16 & k <= q)
    mask = earlier_segment | (same_segment & (q in image | k <= q))
    let local(w) = q - w < k <= q
    chunked_causal(1024) | local(128)
    (k - q) % 4 == 0 & q - k < 64              # dilated window
    natten2d(32, 48, 7, 7) | q >= 32 * 48       # an image, then text seeing all
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attnplan.errors import BatchError, MaskError
from attnplan.ir.limits import MAX_HEADS, MAX_MASK_TEXT, MAX_TOKENS
from attnplan.ir.mask import K1, Q1, Pieces, tighten
from attnplan.ir.segments import check_segments

from .evaluate import Evaluator
from .grammar import end_position, parse_text
from .lower import lower_batch
from .names import Scope, mentions, resolve
from .render import render
from .setops import Budget
from .stdlib import Segments
from .tree import Builder, Call, Let, MaskStmt

__all__ = ["MaskProgram", "parse_mask", "load_mask", "lower_batch", "render"]


@dataclass(frozen=True, eq=False)
class MaskProgram:
    """A parsed, statically checked mask. Immutable; ``lower`` gives pieces."""

    source: str
    filename: str
    uses_segments: bool
    _lets: dict = field(repr=False, compare=False)
    _expr: Any = field(repr=False, compare=False)
    uses_heads: bool = False  # names the query head ``h``: lowered once per head

    def __repr__(self):
        text = self.source.strip()
        return f"MaskProgram({self.filename if self.filename != '<mask>' else text!r})"

    def __eq__(self, other):
        return isinstance(other, MaskProgram) and (self.source, self.filename) == (other.source, other.filename)

    def __hash__(self):
        return hash((self.source, self.filename))

    def __reduce__(self):
        # a program is a function of its text: send the text (a worker parses it
        # again), never the syntax tree, however deeply nested
        return parse_mask, (self.source, self.filename)

    @property
    def label(self) -> str:
        """A short name for pictures and reports: the file name, or the expression text."""
        if self.filename != "<mask>":
            return self.filename
        return " ".join(self.source.split())

    def lower(self, length: int, segments: tuple[tuple[str, int], ...] | None = None,
              head: int | None = None) -> Pieces:
        """Sample-relative disjoint pieces inside ``[0, length)^2``.

        ``segments``: ``((kind, length), ...)`` summing to ``length``; None is one
        segment of kind ``text``. ``head``: the query head ``h`` stands for
        (needed when the mask uses ``h``)."""
        return self._lower(length, segments, Budget(), head)

    def lower_cross(self, lq: int, lk: int, head: int | None = None) -> Pieces:
        """Pieces of a cross-attention sample with ``lq`` queries and ``lk`` keys,
        inside ``[0, lq) x [0, lk)`` (sample-relative on both sides)."""
        return self._lower_cross(lq, lk, Budget(), head)

    def _lower(self, length, segments, budget: Budget, head: int | None = None, share=None) -> Pieces:
        length = _check_length(length)
        checked = _check_segments(length, segments)
        seg = Segments.of(length, checked)
        return Evaluator(self, length, seg, budget, head=_check_head(head), share=share,
                         sample=(length, checked)).mask(self._expr, {})

    def _lower_cross(self, lq, lk, budget: Budget, head: int | None = None, share=None) -> Pieces:
        """The mask on the square of side max(lq, lk), clipped to lq x lk (see the module doc)."""
        lq, lk = _check_length(lq), _check_length(lk)
        side = max(lq, lk)
        ev = Evaluator(self, side, Segments.of(side, None), budget, cross=(lq, lk), head=_check_head(head),
                       share=share, sample=("cross", lq, lk))
        a = ev.mask(self._expr, {}).a.copy()
        a[:, Q1] = np.minimum(a[:, Q1], lq)
        a[:, K1] = np.minimum(a[:, K1], lk)
        return Pieces(a[tighten(a)])


def _check_length(length) -> int:
    if (isinstance(length, (bool, np.bool_)) or not isinstance(length, (int, np.integer))
            or not 1 <= length <= MAX_TOKENS):
        raise BatchError(f"sample length must be a positive integer (at most MAX_TOKENS = {MAX_TOKENS:,}), "
                         f"got {length!r}")
    return int(length)


def _check_head(head):
    if head is not None and (isinstance(head, (bool, np.bool_)) or not isinstance(head, (int, np.integer))
                             or not 0 <= head < MAX_HEADS):
        raise MaskError(f"head must be an integer in [0, {MAX_HEADS}) (MAX_HEADS), got {head!r}")
    return None if head is None else int(head)


def _check_segments(length: int, segments):
    if segments is None:
        return None
    return check_segments([segments], [length], "sample ")[0]


def _check_text(text, filename) -> None:
    if not isinstance(text, str):
        raise MaskError(f"mask text must be a string, got {type(text).__name__}", filename)
    if len(text) > MAX_MASK_TEXT:
        raise MaskError(f"mask text has {len(text):,} characters; at most MAX_MASK_TEXT = {MAX_MASK_TEXT:,} "
                        f"(ir/limits.py)", filename)


_BUILDER = Builder()
_BUILDING = threading.Lock()  # the builder holds the current parse's error maker


def _statements(text: str, filename: str, err) -> list:
    """The statements of ``text``, built as it is parsed (:class:`attnplan.frontend.tree.Builder`)."""
    with _BUILDING:
        _BUILDER.err = err
        return parse_text(text, filename, _BUILDER)


def _check_names(stmts: list, filename: str, err) -> tuple[dict, MaskStmt | None, bool]:
    """(lets, the mask statement, whether it uses segments), names checked top to bottom."""
    scope = Scope(all_lets={s.name: s.line for s in stmts if isinstance(s, Let)})
    main, uses = None, False
    for s in stmts:
        if isinstance(s, Let):
            if s.name in scope.lets:
                raise err(f"`{s.name}` is already defined at line {scope.lets[s.name].line}", s.line, s.col)
            scope.let_segments[s.name] = resolve(s.body, frozenset(s.params or ()), scope, err)
            scope.lets[s.name] = s
        else:
            if main is not None:
                raise err(f"a second mask expression; a file has exactly one (the first is at line {main.line})",
                          s.line, s.col)
            main, uses = s, resolve(s.expr, frozenset(), scope, err)
    return scope.lets, main, uses


def parse_mask(text: str, filename: str = "<mask>") -> MaskProgram:
    """Parse and statically check mask text (names, arity, parameter values, types).
    Every failure is one MaskError with a line and column."""
    _check_text(text, filename)
    try:
        return _parse(text, filename)
    except RecursionError:  # nothing here recurses; should a library call, still one clear error
        raise MaskError("mask nested too deeply", filename, *end_position(text), text) from None


def _parse(text: str, filename: str) -> MaskProgram:
    def err(msg, line, col):
        return MaskError(msg, filename, line, col, text)

    lets, main, uses = _check_names(_statements(text, filename, err), filename, err)
    if main is None:
        if not text.strip():
            raise MaskError("empty mask: write an expression such as `causal`", filename, 1, 1, text)
        raise MaskError("no mask expression: write one expression (e.g. `causal`) or `mask = EXPR`",
                        filename, *end_position(text), text)
    heads = mentions([main.expr, *(s.body for s in lets.values())], "h")
    prog = MaskProgram(text, filename, uses, lets, main.expr, heads)
    ev = Evaluator(prog, None, None)
    for let in lets.values():
        if let.params is None:
            ev.run(Call(let.line, let.col, let.name, ()), {})
    ev.mask(main.expr, {})
    return prog


def load_mask(arg: str) -> MaskProgram:
    """A path to an existing file, a path ending in ``.mask`` (then it must exist),
    or the mask expression itself (``"causal"``, ``"sliding_window(256)"``)."""
    if not isinstance(arg, str):
        raise MaskError(f"a mask is given as text or a file path, got {type(arg).__name__}")
    if os.path.isfile(arg):
        return parse_mask(_read_mask_file(arg), arg)
    if arg.endswith(".mask"):
        raise MaskError("mask file not found", arg)
    return parse_mask(arg)


def _read_mask_file(path: str) -> str:
    try:
        size = os.path.getsize(path)
        if size > 4 * MAX_MASK_TEXT:  # utf-8: at most 4 bytes a character
            raise MaskError(f"mask file has {size:,} bytes; mask text is at most MAX_MASK_TEXT = "
                            f"{MAX_MASK_TEXT:,} characters (ir/limits.py)", path)
        with open(path, encoding="utf-8") as f:
            return f.read(MAX_MASK_TEXT + 1)
    except (OSError, UnicodeDecodeError) as e:
        raise MaskError(f"cannot read mask file: {e}", path) from None
