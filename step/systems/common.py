"""What the batch passes share: the memory bound in tokens, the greedy that
fills micro-batches, dealing micro-batches to replicas."""

from __future__ import annotations

import heapq

import numpy as np

from ...errors import StepError
from ..ir import StepProblem
from ..mesh import gib
from ..model import activation_per_token, stage_static_bytes, static_bytes

PLAN_MARGIN = 0.97  # share of the free memory the planners fill (the attention plans' buffers take the rest)


def model_bytes(problem: StepProblem) -> int:
    """Model states per device: the whole model's (:func:`model.static_bytes`), or with a pipeline its
    largest stage's (:func:`model.stage_static_bytes`)."""
    m, mesh = problem.model, problem.mesh
    if mesh.pp == 1:
        return static_bytes(m, mesh.stage_devices)
    layers = mesh.chunk_layers(m.layers)
    C, P = mesh.chunks, mesh.pp
    return max(stage_static_bytes(m, sum(layers[c] for c in range(s, C, P)), s == 0, (C - 1) % P == s,
                                  mesh.stage_devices) for s in range(P))


def tokens_per_device(problem: StepProblem) -> int:
    """Most tokens of one micro-batch a device can hold: ``PLAN_MARGIN`` × (cap − model states − reserve)
    / activation bytes per token (:func:`model.activation_per_token`); the verifier checks the real plan."""
    m, mesh = problem.model, problem.mesh
    static = model_bytes(problem)
    free = problem.cap - static - mesh.reserve
    if free <= 0:
        where = f"{mesh.stage_devices} devices" + (f" a stage ({mesh.pp} stages)" if mesh.pp > 1 else "")
        raise StepError(f"{m.name} does not fit on {where} of {gib(problem.cap)} GiB: its weights, "
                        f"gradients and sharded optimizer states take {static / 2**30:.1f} GiB a device")
    return int(PLAN_MARGIN * free // activation_per_token(m, mesh.recompute))


PIPELINE_MICRO = 4  # micro-batches per pipeline stage a system aims for when pp > 1 (1F1B bubble (p-1)/(m+p-1))


def micro_tokens(problem: StepProblem) -> int:
    """Most tokens of one micro-batch a device should hold: :func:`tokens_per_device` (memory), and with a
    pipeline (``pp > 1``) no more than the step's share for ``PIPELINE_MICRO · pp`` micro-batches per
    replica (so the 1F1B bubble stays near ``(p − 1) / (m + p − 1)`` with ``m ≥ 4p``), though never less
    than the longest document over a CP group needs nor than one token block (smaller micro-batches cost
    more in launches and kernel tiles than their bubbles)."""
    cap = tokens_per_device(problem)
    mesh = problem.mesh
    if mesh.pp == 1:
        return cap
    share = -(-problem.tokens // (mesh.stage_devices * PIPELINE_MICRO * mesh.pp))
    floor = max(problem.block_size, -(-int(problem.seqlens.max()) // mesh.cp))
    return max(1, min(cap, max(share, floor)))


def pipeline_micro(problem: StepProblem, micro: int) -> int:
    """A system's packed sequences per replica: ``micro``, and with ``pp > 1`` at least ``PIPELINE_MICRO · pp``."""
    pp = problem.mesh.pp
    return micro if pp == 1 else max(micro, PIPELINE_MICRO * pp)


def check_fits(problem: StepProblem, docs: np.ndarray, devices: int, what: str) -> None:
    """StepError in one line when a document cannot fit a group of ``devices`` devices (evenly split)."""
    cap = tokens_per_device(problem) * devices
    big = docs[problem.seqlens[docs] > cap]
    if len(big):
        d = int(big[np.argmax(problem.seqlens[big])])
        raise StepError(f"{what}: document {d} ({int(problem.seqlens[d]):,} tokens) does not fit a group of {devices} "
                        f"devices of {gib(problem.cap)} GiB ({cap:,} tokens at most)")


def greedy_fill(order: np.ndarray, size: np.ndarray, work: np.ndarray, bins: int, cap: int,
                load: np.ndarray | None = None, held: np.ndarray | None = None) -> np.ndarray:
    """Bin of every item, taken in ``order``: into the bin of least work if its tokens fit under ``cap``,
    else into the bin of fewest tokens if they fit there (WLB-LLM's greedy, survey §2.3; with an
    unbounded cap it is Graham's LPT rule); -1 for an item that fits nowhere. ``load``/``held``:
    the bins' work and tokens to start from. Ties go to the lower bin."""
    load = np.zeros(bins) if load is None else np.asarray(load, float).copy()
    held = np.zeros(bins, np.int64) if held is None else np.asarray(held, np.int64).copy()
    out = np.full(len(size), -1, np.int64)
    by_work = [(float(load[b]), b) for b in range(bins)]
    heapq.heapify(by_work)
    for i in order.tolist():
        s = int(size[i])
        # the least-loaded bin: pop stale heap entries (a bin's load only grows)
        while by_work[0][0] != load[by_work[0][1]]:
            heapq.heappop(by_work)
        b = by_work[0][1]
        if held[b] + s > cap:
            b = int(np.argmin(held))
            if held[b] + s > cap:
                continue
        out[i] = b
        load[b] += work[i]
        held[b] += s
        heapq.heappush(by_work, (float(load[b]), b))
    return out


def members(where: np.ndarray, bins: int) -> list[np.ndarray]:
    """The items of every bin (``where[i]`` is item ``i``'s bin, -1 for none), in increasing order."""
    order = np.argsort(where, kind="stable")
    counts = np.bincount(where[where >= 0], minlength=bins)
    start = int(np.count_nonzero(where < 0))
    return np.split(order[start:], np.cumsum(counts)[:-1])


def deal(bins: int, dp: int) -> tuple[np.ndarray, np.ndarray]:
    """Replica and slot of micro-batch ``j`` dealt round-robin: replica ``j mod dp``, slot ``j // dp``."""
    j = np.arange(bins, dtype=np.int64)
    return j % dp, j // dp


def deal_balanced(load: np.ndarray, dp: int) -> tuple[np.ndarray, np.ndarray]:
    """Replica and slot of every micro-batch so that replicas' summed loads are even: heaviest first,
    each to the replica of least load among those holding fewest micro-batches so far (LPT with
    equal counts, so every replica runs ``ceil(bins / dp)`` or one fewer); ties to the lower index."""
    bins = len(load)
    replica = np.zeros(bins, np.int64)
    slot = np.zeros(bins, np.int64)
    total = np.zeros(dp)
    count = np.zeros(dp, np.int64)
    for j in np.lexsort((np.arange(bins), -np.asarray(load, float))).tolist():
        open_ = np.flatnonzero(count == count.min())
        r = int(open_[np.argmin(total[open_])])
        replica[j], slot[j] = r, count[r]
        total[r] += load[j]
        count[r] += 1
    return replica, slot
