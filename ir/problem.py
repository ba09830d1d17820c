"""Problem: what is to be computed — tokens, heads, and the mask as disjoint pieces."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import BatchError, PlanError
from .limits import MAX_HEAD_DIM, MAX_HEADS, MAX_MASK_PIECES, MAX_SAMPLES, MAX_TOKENS
from .mask import Pieces

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def _check_seqlens(seqlens) -> np.ndarray:
    """A read-only int64 vector of 1..MAX_SAMPLES positive lengths summing to at most MAX_TOKENS."""
    a = np.asarray(seqlens)
    if a.ndim != 1 or not len(a) or a.dtype.kind not in "iu":
        raise BatchError(f"sequence lengths must be a non-empty list of integers, got {a.dtype} {list(a.shape)}")
    if len(a) > MAX_SAMPLES:
        raise BatchError(f"the batch has {len(a)} samples, over the limit MAX_SAMPLES = {MAX_SAMPLES}")
    bad = np.flatnonzero((a <= 0) | (a > MAX_TOKENS))
    if len(bad):
        raise BatchError(f"sample {bad[0]}: length must be a positive integer up to MAX_TOKENS = {MAX_TOKENS}, "
                         f"got {a[bad[0]]}")
    a = a.astype(np.int64)
    total = int(a.sum())  # at most MAX_SAMPLES * MAX_TOKENS = 2^46: no overflow
    if total > MAX_TOKENS:
        raise BatchError(f"the batch has {total} tokens, over the limit MAX_TOKENS = {MAX_TOKENS}")
    a.setflags(write=False)
    return a


def _check_q_lens(q_lens, seqlens: np.ndarray, segments) -> np.ndarray:
    """Query lengths of cross-attention samples: one per sample, each in ``[1, seqlens[i])``."""
    a = np.asarray(q_lens)
    if a.ndim != 1 or len(a) != len(seqlens) or a.dtype.kind not in "iu":
        raise BatchError(f"q_lens must be one integer per sample ({len(seqlens)}), got {a.dtype} {list(a.shape)}")
    bad = np.flatnonzero((a < 1) | (a >= seqlens))
    if len(bad):
        raise BatchError(f"cross-attention sample {bad[0]}: {a[bad[0]]} queries of {seqlens[bad[0]]} packed tokens "
                         f"(it needs at least one query and one key)")
    if segments is not None:
        raise BatchError("cross-attention samples have no segments (segments describe one sequence)")
    a = a.astype(np.int64)
    a.setflags(write=False)
    return a


def _check_classes(head_class, class_ptr, heads: int, n_pieces: int) -> tuple[np.ndarray, np.ndarray]:
    """Mask classes: one per query head, numbered by first head (so at least
    two, each used); ``class_ptr`` a non-decreasing CSR index of the pieces."""
    hc, ptr = np.asarray(head_class), np.asarray(class_ptr)
    if hc.ndim != 1 or len(hc) != heads or hc.dtype.kind not in "iu":
        raise PlanError(f"head_class must be one integer per query head ({heads}), got {hc.dtype} {list(hc.shape)}")
    used, first = np.unique(hc, return_index=True)
    n = len(used)
    if n < 2 or not np.array_equal(used, np.arange(n)) or (np.diff(first) <= 0).any():
        raise PlanError(f"head_class {hc.tolist()[:16]} must number 2 or more classes 0, 1, ... by their first head")
    if ptr.ndim != 1 or len(ptr) != n + 1 or ptr.dtype.kind not in "iu" or ptr[0] != 0 or ptr[-1] != n_pieces \
            or (np.diff(ptr) < 0).any():
        raise PlanError(f"class_ptr must index the {n_pieces} mask pieces by class ({n} classes + 1 entries, "
                        f"non-decreasing from 0), got {ptr.tolist()[:16]}")
    hc, ptr = hc.astype(np.int64), ptr.astype(np.int64)
    hc.setflags(write=False)
    ptr.setflags(write=False)
    return hc, ptr


@dataclass(frozen=True, slots=True, eq=False)
class Problem:
    """One batch packed on a single token axis.

    ``pieces`` are in global (packed) coordinates; sample ``i`` occupies
    ``[offsets[i], offsets[i+1])``. ``mask`` is the mask source text it was
    lowered from (kept for display and for the plan file).

    Cross-attention (``q_lens`` set): sample ``i`` is ``q_lens[i]`` query
    tokens, then ``seqlens[i] - q_lens[i]`` key tokens of another sequence,
    and every mask piece lies in its queries x its keys. Q (and O) of a key
    token and K, V of a query token exist on the packed axis but no compute
    block uses them: strategies place the two sides' tokens independently,
    the runtime fills them with zeros (``query_index``, ``key_index``).

    Per-head masks (``head_class`` set): query head ``h`` sees the mask of
    class ``head_class[h]`` — the pieces ``pieces[class_ptr[c]:class_ptr[c+1]]``
    (disjoint within a class). Classes are numbered by their first head;
    there are at least two (one class is written as None).

    ``partials_dtype``: the dtype partial outputs (forward O, backward dQ
    and dKV) travel in between devices. Every device accumulates its
    partials in float32 and every home sums what it receives in float32;
    ``"float32"`` (the default) also sends them so, the problem's ``dtype``
    sends each partial rounded to it — half the bytes of the backward's
    partial dK/dV, one rounding per partial sent (MagiAttention's default,
    its ``MAGI_ATTENTION_BACKWARD_HIGH_PRECISION_REDUCE`` off). The lse of a
    partial O stays float32.

    ``keep_kv``: the backward reuses the K/V blocks each device received in
    the forward instead of receiving them again (what it costs: every device
    holds the KV it received from the forward until the backward, per layer;
    TransformerEngine's all-gather CP gathers K/V again in its backward,
    trading the other way). The backward then moves no KV."""

    seqlens: np.ndarray
    heads: int
    kv_heads: int
    head_dim: int
    pieces: Pieces
    mask: str = "causal"
    segments: tuple | None = None
    dtype: str = "bfloat16"
    q_lens: np.ndarray | None = None
    head_class: np.ndarray | None = None
    class_ptr: np.ndarray | None = None
    partials_dtype: str = "float32"
    keep_kv: bool = False

    def __post_init__(self):
        object.__setattr__(self, "seqlens", _check_seqlens(self.seqlens))
        if self.q_lens is not None:
            object.__setattr__(self, "q_lens", _check_q_lens(self.q_lens, self.seqlens, self.segments))
        for name, hi, limit in (("heads", MAX_HEADS, "MAX_HEADS"), ("kv_heads", MAX_HEADS, "MAX_HEADS"),
                                ("head_dim", MAX_HEAD_DIM, "MAX_HEAD_DIM")):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
                raise PlanError(f"{name} must be a positive integer, got {v!r}")
            if v > hi:
                raise PlanError(f"{name} = {v} is over the limit {limit} = {hi}")
        if self.heads % self.kv_heads:
            raise PlanError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.dtype not in DTYPE_BYTES:
            raise PlanError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.partials_dtype not in ("float32", self.dtype):
            raise PlanError(f"partials_dtype must be float32 or the problem's dtype ({self.dtype}), got "
                            f"{self.partials_dtype!r}")
        if not isinstance(self.keep_kv, (bool, np.bool_)):
            raise PlanError(f"keep_kv must be True or False, got {self.keep_kv!r}")
        object.__setattr__(self, "keep_kv", bool(self.keep_kv))
        if not isinstance(self.pieces, Pieces):
            raise PlanError(f"pieces must be mask Pieces, got {type(self.pieces).__name__}")
        if len(self.pieces) > MAX_MASK_PIECES:
            raise PlanError(f"the mask has {len(self.pieces)} pieces, over the limit MAX_MASK_PIECES = "
                            f"{MAX_MASK_PIECES}")
        if (self.head_class is None) != (self.class_ptr is None):
            raise PlanError("per-head masks need both head_class and class_ptr")
        if self.head_class is not None:
            hc, ptr = _check_classes(self.head_class, self.class_ptr, self.heads, len(self.pieces))
            object.__setattr__(self, "head_class", hc)
            object.__setattr__(self, "class_ptr", ptr)

    @property
    def tokens(self) -> int:
        return int(self.seqlens.sum())

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.seqlens)]).astype(np.int64)

    @property
    def is_cross(self) -> bool:
        return self.q_lens is not None

    def query_index(self) -> np.ndarray:
        """Packed positions of the query tokens (every token when not cross), increasing."""
        return self._side(True)

    def key_index(self) -> np.ndarray:
        """Packed positions of the key tokens (every token when not cross), increasing."""
        return self._side(False)

    def _side(self, queries: bool) -> np.ndarray:
        if self.q_lens is None:
            return np.arange(self.tokens, dtype=np.int64)
        off = self.offsets[:-1]
        first, n = (off, self.q_lens) if queries else (off + self.q_lens, self.seqlens - self.q_lens)
        return np.repeat(first - np.cumsum(n) + n, n) + np.arange(int(n.sum()), dtype=np.int64)

    @property
    def group(self) -> int:
        """Query heads per kv head (GQA)."""
        return self.heads // self.kv_heads

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def partial_bytes(self) -> int:
        """Bytes of one element of a partial output on the wire (``partials_dtype``)."""
        return DTYPE_BYTES[self.partials_dtype]

    @property
    def n_classes(self) -> int:
        """Mask classes (1 unless per-head masks)."""
        return 1 if self.class_ptr is None else len(self.class_ptr) - 1

    def class_of_piece(self) -> np.ndarray:
        if self.class_ptr is None:
            return np.zeros(len(self.pieces), np.int64)
        return np.repeat(np.arange(self.n_classes, dtype=np.int64), np.diff(self.class_ptr))

    def class_pieces(self, c: int) -> Pieces:
        if self.class_ptr is None:
            return self.pieces
        return Pieces(self.pieces.a[self.class_ptr[c]:self.class_ptr[c + 1]])

    def piece_heads(self) -> np.ndarray | None:
        """Query heads that see each mask piece (its class's heads): the
        piece's work weight; None without per-head masks (every piece: all heads)."""
        if self.head_class is None:
            return None
        return np.bincount(self.head_class, minlength=self.n_classes)[self.class_of_piece()].astype(np.int64)

    def class_heads(self, ir_order: bool = False) -> list[tuple[np.ndarray, np.ndarray]] | None:
        """Per-head masks as ``[(query heads of class c, its pieces array), ...]``
        (``ir_order``: head positions in :meth:`head_order`); None without them."""
        if self.head_class is None:
            return None
        hc = self.ir_head_classes() if ir_order else self.head_class
        return [(np.flatnonzero(hc == c), self.class_pieces(c).a) for c in range(self.n_classes)]

    def head_order(self) -> np.ndarray | None:
        """The query heads in the order the plan's head groups count them: the
        query heads of each kv head sorted (stably) by mask class, so that a
        kv head needs one copy per class it serves, not one per change of
        class (alternating heads: 2 copies, not ``heads / kv_heads``). None
        when that order is the identity (always without per-head masks)."""
        if self.head_class is None:
            return None
        g = self.heads // self.kv_heads
        order = (np.argsort(self.head_class.reshape(self.kv_heads, g), axis=1, kind="stable")
                 + np.arange(self.kv_heads)[:, None] * g).reshape(-1).astype(np.int64)
        return None if (order == np.arange(self.heads)).all() else order

    def ir_head_classes(self) -> np.ndarray:
        """The mask class of each query head in :meth:`head_order`."""
        order = self.head_order()
        return self.head_classes() if order is None else self.head_classes()[order]

    def head_classes(self) -> np.ndarray:
        """The mask class of every query head."""
        return np.zeros(self.heads, np.int64) if self.head_class is None else self.head_class

    def pairs(self) -> int:
        """Allowed (q, k) pairs × query heads (each head with its class's mask)."""
        per_class = np.bincount(self.head_classes(), minlength=self.n_classes)
        return sum(self.class_pieces(c).pair_count() * int(n) for c, n in enumerate(per_class))

    def flops_fwd(self) -> int:
        return 4 * self.head_dim * self.pairs()

    def to_text(self) -> str:
        lens = self.seqlens.tolist()
        shown = ", ".join(map(str, lens[:16])) + (f", ... ({len(lens)} samples)" if len(lens) > 16 else "")
        if self.q_lens is not None:
            ql = self.q_lens.tolist()
            shown += "; cross-attention, queries [" + ", ".join(map(str, ql[:16])) + (", ..." * (len(ql) > 16)) + "]"
        if self.head_class is not None:
            shown += f"; per-head masks, {self.n_classes} classes, head classes {self.head_class.tolist()[:32]}"
        text = self.mask.strip()
        mask = " " + repr(text) if "\n" not in text else "\n    " + text.replace("\n", "\n    ")  # a .mask file
        return (f"problem tokens={self.tokens} heads={self.heads} kv_heads={self.kv_heads} "
                f"head_dim={self.head_dim} dtype={self.dtype} pieces={len(self.pieces)} "
                f"pairs={self.pairs()}\n  seqlens [{shown}]\n  mask{mask}")
