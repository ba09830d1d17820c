"""Token ownership of a plan, seen from one device (numpy only, no torch).

A device's *local layout* is its home token blocks in increasing order,
concatenated: local row ``i`` holds global (packed) token ``local_index[i]``.
Every per-token tensor of a training step on that device (embeddings, q, k,
v, labels, loss weights) uses this layout, and positions for RoPE come from
the same plan, so the attention layout, positions, labels and loss
normalization cannot disagree.
"""

from __future__ import annotations

import numpy as np

from ..errors import PlanError

POSITION_KINDS = ("sample", "global")


def _device(ir, device) -> int:
    """``device`` as an int of the plan ``ir`` (a PlanIR with a placement)."""
    if getattr(ir, "placement", None) is None or getattr(ir, "graph", None) is None:
        raise PlanError(f"token ownership needs a placed PlanIR (plan.ir), got {type(ir).__name__}")
    if isinstance(device, (bool, np.bool_)) or not isinstance(device, (int, np.integer)) \
            or not 0 <= device < ir.devices:
        raise PlanError(f"rank {device!r} does not exist; the plan has devices 0..{ir.devices - 1}")
    return int(device)


def home_blocks(ir, device: int) -> np.ndarray:
    """The token blocks homed on ``device``, increasing."""
    d = _device(ir, device)
    return np.flatnonzero(ir.placement.home == d).astype(np.int64)


def local_index(ir, device: int) -> np.ndarray:
    """Global token index of each local row of ``device`` (int64): its home
    blocks in block order, a varlen group's spans one after another (not
    necessarily increasing over the whole array)."""
    tbs = home_blocks(ir, device)
    return ir.graph.block_rows(tbs)


SIDES = (None, "q", "k")


def side_rows(ir, device: int, side: str | None) -> tuple[np.ndarray, np.ndarray]:
    """(local rows of ``device`` on ``side``, their index among that side's
    tokens): ``side`` ``"q"`` the query tokens, ``"k"`` the key tokens of a
    cross-attention plan (every token on both sides otherwise), None every
    token (its packed index)."""
    if side not in SIDES:
        raise PlanError(f"side must be 'q', 'k' or None, got {side!r}")
    idx = local_index(ir, device)
    if side is None:
        return np.arange(len(idx), dtype=np.int64), idx
    ref = ir.problem.query_index() if side == "q" else ir.problem.key_index()
    pos = np.searchsorted(ref, idx).clip(0, max(len(ref) - 1, 0))
    rows = np.flatnonzero(ref[pos] == idx) if len(ref) else np.zeros(0, np.int64)
    return rows.astype(np.int64), pos[rows].astype(np.int64)


def local_tokens(ir, device: int) -> int:
    tbs = home_blocks(ir, device)
    return int(ir.graph.tb_len[tbs].sum())


def local_row0(ir, device: int) -> np.ndarray:
    """``row0[tb]``: the local row where home token block ``tb`` starts (−1 if
    ``tb`` is not homed on ``device``)."""
    tbs = home_blocks(ir, device)
    g = ir.graph
    row0 = np.full(g.n_tb, -1, np.int64)
    n = g.tb_len[tbs]
    row0[tbs] = np.cumsum(n) - n
    return row0


def sample_ids(ir, device: int) -> np.ndarray:
    """The sample (document) each local token belongs to."""
    off = ir.problem.offsets
    return (np.searchsorted(off, local_index(ir, device), "right") - 1).astype(np.int64)


def position_ids(ir, device: int, kind: str = "sample") -> np.ndarray:
    """Positions of ``device``'s local tokens.

    ``kind="sample"`` (the default): position inside the token's own sample,
    0 at each sample start — what RoPE uses in packed training, so that a
    document is encoded the same whether packed or alone (and what the mask
    language's ``q``/``k`` mean). ``kind="global"``: position on the packed
    axis (the global token index)."""
    if kind not in POSITION_KINDS:
        raise PlanError(f"position kind must be one of {', '.join(POSITION_KINDS)}, got {kind!r}")
    idx = local_index(ir, device)
    if kind == "global":
        return idx
    off = ir.problem.offsets
    return idx - off[np.searchsorted(off, idx, "right") - 1]
