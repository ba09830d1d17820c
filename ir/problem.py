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
    the runtime fills them with zeros (``query_index``, ``key_index``)."""

    seqlens: np.ndarray
    heads: int
    kv_heads: int
    head_dim: int
    pieces: Pieces
    mask: str = "causal"
    segments: tuple | None = None
    dtype: str = "bfloat16"
    q_lens: np.ndarray | None = None

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

    def pairs(self) -> int:
        """Allowed (q, k) pairs × query heads."""
        return self.pieces.pair_count() * self.heads

    def flops_fwd(self) -> int:
        return 4 * self.head_dim * self.pairs()

    def to_text(self) -> str:
        lens = self.seqlens.tolist()
        shown = ", ".join(map(str, lens[:16])) + (f", ... ({len(lens)} samples)" if len(lens) > 16 else "")
        if self.q_lens is not None:
            ql = self.q_lens.tolist()
            shown += "; cross-attention, queries [" + ", ".join(map(str, ql[:16])) + (", ..." * (len(ql) > 16)) + "]"
        return (f"problem tokens={self.tokens} heads={self.heads} kv_heads={self.kv_heads} "
                f"head_dim={self.head_dim} dtype={self.dtype} pieces={len(self.pieces)} "
                f"pairs={self.pairs()}\n  seqlens [{shown}]\n  mask {self.mask.strip()!r}")
