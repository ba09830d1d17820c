"""Lowering a mask over a whole batch: every sample's pieces, shifted to the
sample's offset in the packed token axis.

Samples with the same (length, segments) share one lowering: the mask is
evaluated once per distinct sample (segments only count when the mask uses
them) and the packed result is gathered with numpy, so 100,000 one-token
documents cost one evaluation and a few array operations. Sizes are checked
before anything proportional to them is built: samples against
``MAX_SAMPLES``, tokens against ``MAX_TOKENS``, pieces against
``MAX_MASK_PIECES`` (naming the sample where the total passes it), and all
evaluations of one batch share one work budget (``MAX_MASK_WORK``).
"""

from __future__ import annotations

import hashlib

import numpy as np

from attnplan.errors import BatchError, MaskError
from attnplan.ir.limits import MAX_MASK_PIECES, MAX_SAMPLES, MAX_TOKENS
from attnplan.ir.mask import Pieces
from attnplan.ir.segments import check_segments

from .batch import Batch
from .heads import HeadShare, head_free_nodes
from .setops import Budget

__all__ = ["batch_lengths", "lower_batch", "lower_heads"]


def _first_bad(values, ok) -> int:
    return next(i for i, v in enumerate(values) if not ok(v))


def _is_length(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) and bool(1 <= v <= MAX_TOKENS)


def batch_lengths(seqlens) -> np.ndarray:
    """``seqlens`` checked and as an int64 array (BatchError naming the first bad entry)."""
    try:
        n = len(seqlens)
    except TypeError:
        raise BatchError(f"seqlens must be a sequence of positive integers, got {type(seqlens).__name__}") from None
    if n > MAX_SAMPLES:
        raise BatchError(f"{n:,} samples; a batch has at most MAX_SAMPLES = {MAX_SAMPLES:,} (ir/limits.py)")
    arr = np.asarray(seqlens) if isinstance(seqlens, np.ndarray) else None
    if arr is None or arr.dtype.kind not in "iu" or arr.ndim != 1:
        values = list(seqlens)
        if not all(map(_is_length, values)):
            i = _first_bad(values, _is_length)
            raise BatchError(f"sample {i}: length {values[i]!r} is not a positive integer "
                             f"(at most MAX_TOKENS = {MAX_TOKENS:,})")
        arr = np.array(values, dtype=np.int64)
    elif n and (arr.min() < 1 or arr.max() > MAX_TOKENS):
        i = int(np.flatnonzero((arr < 1) | (arr > MAX_TOKENS))[0])
        raise BatchError(f"sample {i}: length {int(arr[i])} is not a positive integer "
                         f"(at most MAX_TOKENS = {MAX_TOKENS:,})")
    arr = arr.astype(np.int64)
    total = int(arr.sum())
    if total > MAX_TOKENS:
        raise BatchError(f"the batch has {total:,} tokens; at most MAX_TOKENS = {MAX_TOKENS:,} (ir/limits.py)")
    return arr


def batch_args(seqlens, segments, q_lens=None):
    """(packed lengths array, checked segments or None, query lengths or None)
    from a :class:`Batch` or a sequence (and segments, and the query lengths
    of cross-attention samples); a cross-attention :class:`Batch` packs each
    sample as its queries then its keys."""
    if isinstance(seqlens, Batch):
        if seqlens.seqlens_k is not None:
            q_lens = seqlens.seqlens
            segments, seqlens = None, [a + b for a, b in zip(seqlens.seqlens, seqlens.seqlens_k)]
        else:
            seqlens, segments = seqlens.seqlens, seqlens.segments if segments is None else segments
    lens = batch_lengths(seqlens)
    if segments is not None:
        segments = check_segments(segments, lens.tolist(), "")
    return lens, segments, q_lens


def _distinct(mask, lens: np.ndarray, segments):
    """(keys, first, inverse): distinct (length, segments) keys in order of first
    use, the sample where each is first used, and each sample's key index."""
    if segments is None or not mask.uses_segments:
        uniq, where, which = np.unique(lens, return_index=True, return_inverse=True)
        order = np.argsort(where, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        return [(int(uniq[j]), None) for j in order], where[order], rank[which.reshape(-1)]
    index: dict = {}
    first: list[int] = []
    inverse = np.empty(len(lens), dtype=np.int64)
    for i, key in enumerate(zip(lens.tolist(), segments)):
        j = index.setdefault(key, len(index))
        if j == len(first):
            first.append(i)
        inverse[i] = j
    return list(index), np.array(first, dtype=np.int64), inverse


def _lower_distinct(mask, keys, first, cross: bool = False, head: int | None = None,
                    budget: Budget | None = None, share=None) -> list[np.ndarray]:
    budget = Budget() if budget is None else budget
    out = []
    for (n, seg), i in zip(keys, first.tolist()):
        try:
            out.append(mask._lower_cross(*divmod(n, 1 << 32), budget, head, share).a if cross
                       else mask._lower(n, seg, budget, head, share).a)
        except MaskError as e:
            raise MaskError(f"{e.message} (sample {i})", e.filename, e.line, e.col, e.text) from None
    return out


def _check_total(per_sample: np.ndarray, lens: np.ndarray, filename: str) -> int:
    cum = np.cumsum(per_sample)
    total = int(cum[-1])
    if total > MAX_MASK_PIECES:
        i = int(np.searchsorted(cum, MAX_MASK_PIECES, side="right"))
        raise MaskError(f"the batch's mask has {total:,} pieces, more than MAX_MASK_PIECES = {MAX_MASK_PIECES:,} "
                        f"(ir/limits.py); the total passes it at sample {i} (length {int(lens[i])}, "
                        f"{int(per_sample[i]):,} pieces)", filename)
    return total


def lower_batch(mask, seqlens, segments=None, q_lens=None, head: int | None = None,
                budget: Budget | None = None, share=None) -> Pieces:
    """The whole packed mask: sample ``i`` lowered and shifted to its offset.

    ``seqlens`` is a sequence of positive lengths (or a :class:`Batch`, whose
    segments are used); ``segments`` is None or one entry per sample (None or
    ``((kind, length), ...)``). Lowering is shared by samples with the same
    (length, segments) — segments only count when the mask uses them.
    ``q_lens`` (cross-attention, :class:`~attnplan.ir.problem.Problem`): sample
    ``i`` is ``q_lens[i]`` queries then ``seqlens[i] - q_lens[i]`` keys on the
    packed axis; its pieces are lowered by ``MaskProgram.lower_cross`` and
    their keys shifted past its queries. ``head``: the query head ``h``
    stands for (a mask that uses ``h``: see :func:`lower_heads`); ``budget``:
    the work budget to charge (default: a fresh one for this batch);
    ``share``: a :class:`~attnplan.frontend.heads.HeadShare` across heads."""
    lens, segments, q_lens = batch_args(seqlens, segments, q_lens)
    if not len(lens):
        return Pieces.empty()
    if q_lens is not None:
        return _lower_cross_batch(mask, lens, np.asarray(q_lens, np.int64), head, budget, share)
    keys, first, inverse = _distinct(mask, lens, segments)
    out, rows = _gather(mask, _lower_distinct(mask, keys, first, head=head, budget=budget, share=share), inverse,
                        lens)
    out[:, :4] += (np.cumsum(lens) - lens)[rows][:, None]
    return Pieces(out)


def _gather(mask, arrays: list, inverse: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every sample's pieces (``arrays[inverse[i]]``) in sample order, sample-relative,
    and the sample of each row; the total checked before it is built."""
    counts = np.array([len(a) for a in arrays], dtype=np.int64)
    per_sample = counts[inverse]
    total = _check_total(per_sample, lens, mask.filename)
    starts = np.cumsum(counts) - counts
    sample_of_row = np.repeat(np.arange(len(lens)), per_sample)
    within = np.arange(total) - np.repeat(np.cumsum(per_sample) - per_sample, per_sample)
    return np.concatenate(arrays)[starts[inverse][sample_of_row] + within], sample_of_row


def _lower_cross_batch(mask, lens: np.ndarray, q_lens: np.ndarray, head: int | None, budget, share) -> Pieces:
    """:func:`lower_batch` of cross-attention samples (distinct (Lq, Lk) lowered once)."""
    pairs = q_lens * (1 << 32) + (lens - q_lens)  # (Lq, Lk), both < 2^32 (MAX_TOKENS)
    keys, first, inverse = _distinct(mask, pairs, None)
    out, rows = _gather(mask, _lower_distinct(mask, keys, first, cross=True, head=head, budget=budget, share=share),
                        inverse, lens)
    out[:, [2, 3, 4, 5]] += q_lens[rows][:, None]  # keys follow the sample's queries: k, and k - q, move by Lq
    out[:, :4] += (np.cumsum(lens) - lens)[rows][:, None]
    return Pieces(out)


def lower_heads(mask, seqlens, segments=None, q_lens=None, heads: int = 1):
    """The packed mask of every query head: (pieces, class_ptr, head_class).

    A mask that does not use ``h`` is one class: (``lower_batch``, None,
    None). Otherwise it is lowered once per head ``0 .. heads-1``; heads
    with identical pieces share a *mask class* (numbered by first head), the
    classes' pieces are concatenated in class order, ``class_ptr`` (classes
    + 1) indexes them and ``head_class`` names each head's class (both None
    when every head has the same mask). Work is ``heads`` lowerings, all
    charged to one budget: the whole per-head mask within ``MAX_MASK_WORK``,
    like one batch; subexpressions that cannot depend on ``h`` are lowered
    once and shared (:mod:`.heads`)."""
    if not mask.uses_heads:
        return lower_batch(mask, seqlens, segments, q_lens), None, None
    budget, share = Budget(), HeadShare(head_free_nodes(mask._lets, mask._expr))
    index: dict[bytes, int] = {}
    arrays: list[np.ndarray] = []
    head_class: list[int] = []
    total = 0
    for h in range(heads):
        a = np.ascontiguousarray(lower_batch(mask, seqlens, segments, q_lens, head=h, budget=budget, share=share).a)
        c = index.setdefault(hashlib.sha256(a.data).digest(), len(index))  # a digest, not a copy of the pieces
        if c < len(arrays) and not np.array_equal(arrays[c], a):  # pragma: no cover - a sha-256 collision
            raise MaskError(f"head {h}: two different per-head masks share a digest", mask.filename)
        if c == len(arrays):
            total += len(a)
            if total > MAX_MASK_PIECES:
                raise MaskError(f"the per-head mask has {total:,} pieces over its distinct heads (head {h}), more "
                                f"than MAX_MASK_PIECES = {MAX_MASK_PIECES:,} (ir/limits.py)", mask.filename)
            arrays.append(a)
        head_class.append(c)
    if len(arrays) == 1:
        return Pieces(arrays[0]), None, None
    ptr = np.concatenate([[0], np.cumsum([len(a) for a in arrays])]).astype(np.int64)
    return Pieces(np.concatenate(arrays)), ptr, np.asarray(head_class, np.int64)
