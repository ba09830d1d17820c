"""ASCII pictures of a packed mask: allowed pairs per cell of ``cell x cell``
tokens, computed from the pieces in closed form (never a dense matrix)."""

from __future__ import annotations

import numpy as np

from attnplan.errors import BatchError, PlanError
from attnplan.ir.limits import MAX_MASK_WIDTH
from attnplan.ir.mask import K0, K1, Q0, Q1, Pieces, normalize, piece_counts

from .lower import batch_args, lower_batch
from .setops import Budget, LimitExceeded

__all__ = ["density", "render"]

_CHUNK = 1 << 22    # cut pieces made at once
_CUT_PASSES = 16    # numpy row passes per cut piece


def _split(a: np.ndarray, lo_col: int, hi_col: int, cell: int) -> np.ndarray:
    """The pieces ``a`` cut at every multiple of ``cell`` along one axis (rows or columns)."""
    first = a[:, lo_col] // cell
    span = (a[:, hi_col] - 1) // cell - first + 1
    idx = np.repeat(np.arange(len(a)), span)
    step = np.arange(len(idx)) - np.repeat(np.cumsum(span) - span, span)
    c = first[idx] + step
    a = a[idx]
    a[:, lo_col] = np.maximum(a[:, lo_col], c * cell)
    a[:, hi_col] = np.minimum(a[:, hi_col], (c + 1) * cell)
    return normalize(a)


def _spans(a: np.ndarray, cell: int) -> np.ndarray:
    """How many picture cells each piece touches."""
    rows = (a[:, Q1] - 1) // cell - a[:, Q0] // cell + 1
    cols = (a[:, K1] - 1) // cell - a[:, K0] // cell + 1
    return rows * cols


def density(pieces: Pieces, size: int, width: int = 64):
    """Allowed pairs per picture cell: ``(counts, areas, cell)``, both ``[n, n]``
    int64 arrays for an ``n x n`` grid of ``cell x cell`` token squares.
    Pieces are cut at cell borders in chunks of at most ``_CHUNK`` cut pieces;
    the cutting is charged to one ``MAX_MASK_WORK`` budget."""
    cell = max(1, -(-size // width))
    n = -(-size // cell)
    counts = np.zeros((n, n), dtype=np.int64)
    cuts = _spans(pieces.a, cell)
    total = int(cuts.sum())
    try:
        Budget().charge(_CUT_PASSES * total, f"cutting {len(cuts):,} pieces into {total:,} at picture cells")
    except LimitExceeded as e:
        raise PlanError(f"{e} (use a smaller picture width)") from None
    inner = np.searchsorted(np.cumsum(cuts), np.arange(_CHUNK, total, _CHUNK), side="right")
    edges = [0, *np.unique(inner).tolist(), len(cuts)]
    for lo, hi in zip(edges, edges[1:]):
        a = _split(_split(pieces.a[lo:hi], Q0, Q1, cell), K0, K1, cell)
        np.add.at(counts, (a[:, Q0] // cell, a[:, K0] // cell), piece_counts(a))
    side = np.minimum(np.arange(1, n + 1) * cell, size) - np.arange(n) * cell
    return counts, side[:, None] * side[None, :], cell


def render(mask, seqlens, segments=None, width: int = 64, q_lens=None, head: int | None = None) -> str:
    """ASCII picture of the whole packed mask, one character per cell of
    ``cell x cell`` tokens: '#' all pairs allowed, '+' over half, '.' some, ' ' none.
    ``q_lens`` (or a cross-attention :class:`Batch`): cross-attention samples,
    drawn on the packed axis (each sample's queries, then its keys; see
    :func:`lower_batch`)."""
    if isinstance(width, bool) or not isinstance(width, (int, np.integer)) or not 1 <= width <= MAX_MASK_WIDTH:
        raise PlanError(f"picture width must be an integer in 1..{MAX_MASK_WIDTH} (MAX_MASK_WIDTH), got {width!r}")
    lens, segments, q_lens = batch_args(seqlens, segments, q_lens)
    if not len(lens):
        raise BatchError("a picture needs at least one sample")
    pieces = lower_batch(mask, lens, segments, q_lens, head)
    total = int(lens.sum())
    counts, area, cell = density(pieces, total, int(width))
    chars = np.where(counts == area, "#", np.where(2 * counts > area, "+", np.where(counts > 0, ".", " ")))
    pairs = int(counts.sum())
    title = (f"mask {mask.label}" + (f" (head {head})" if head is not None else "") + f": {len(lens)} "
             f"sample{'s' * (len(lens) != 1)}, {total} tokens, "
             f"{pairs} allowed pairs ({100 * pairs / total ** 2:.3g}% of the square)")
    legend = (f"1 char = {cell}x{cell} tokens; " if cell > 1 else "1 char = 1 token pair; ") + \
        "'#' all allowed, '+' over half, '.' some, ' ' none"
    border = "+" + "-" * chars.shape[1] + "+"
    rows = ["|" + "".join(r) + "|" for r in chars]
    return "\n".join([title, legend, border, *rows, border])
