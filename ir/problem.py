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


@dataclass(frozen=True, slots=True, eq=False)
class Problem:
    """One batch packed on a single token axis.

    ``pieces`` are in global (packed) coordinates; sample ``i`` occupies
    ``[offsets[i], offsets[i+1])``. ``mask`` is the mask source text it was
    lowered from (kept for display and for the plan file)."""

    seqlens: np.ndarray
    heads: int
    kv_heads: int
    head_dim: int
    pieces: Pieces
    mask: str = "causal"
    segments: tuple | None = None
    dtype: str = "bfloat16"

    def __post_init__(self):
        object.__setattr__(self, "seqlens", _check_seqlens(self.seqlens))
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
        if not isinstance(self.pieces, Pieces):
            raise PlanError(f"pieces must be mask Pieces, got {type(self.pieces).__name__}")
        if len(self.pieces) > MAX_MASK_PIECES:
            raise PlanError(f"the mask has {len(self.pieces)} pieces, over the limit MAX_MASK_PIECES = "
                            f"{MAX_MASK_PIECES}")

    @property
    def tokens(self) -> int:
        return int(self.seqlens.sum())

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.seqlens)]).astype(np.int64)

    @property
    def group(self) -> int:
        """Query heads per kv head (GQA)."""
        return self.heads // self.kv_heads

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def pairs(self) -> int:
        """Allowed (q, k) pairs × query heads."""
        return self.pieces.pair_count() * self.heads

    def flops_fwd(self) -> int:
        return 4 * self.head_dim * self.pairs()

    def to_text(self) -> str:
        lens = self.seqlens.tolist()
        shown = ", ".join(map(str, lens[:16])) + (f", ... ({len(lens)} samples)" if len(lens) > 16 else "")
        return (f"problem tokens={self.tokens} heads={self.heads} kv_heads={self.kv_heads} "
                f"head_dim={self.head_dim} dtype={self.dtype} pieces={len(self.pieces)} "
                f"pairs={self.pairs()}\n  seqlens [{shown}]\n  mask {self.mask.strip()!r}")
