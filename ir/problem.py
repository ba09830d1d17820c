"""Problem: what is to be computed — tokens, heads, and the mask as disjoint pieces."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import PlanError
from .mask import Pieces

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


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
        for name in ("heads", "kv_heads", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
                raise PlanError(f"{name} must be a positive integer, got {v!r}")
        if self.heads % self.kv_heads:
            raise PlanError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.dtype not in DTYPE_BYTES:
            raise PlanError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        self.seqlens.setflags(write=False)

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
