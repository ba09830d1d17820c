"""The step verifier (docs/DESIGN.md, "Above one attention call").

:func:`verify_plan` checks a :class:`StepPlan` on its own:

1. Shapes: fragment columns of one length, one group, slot and strategy per
   micro-batch, at most ``MAX_MICRO_BATCHES`` micro-batches, groups CSR.
2. Fragments are listed micro-batch by micro-batch, every micro-batch has
   one, and each is a non-empty range ``[start, end)`` inside its document.
3. Every token of the step is in exactly one micro-batch or the document is
   queued for a later step (``queue_out``, each at most once, then without
   fragments). A document is one fragment unless the plan carries KV
   between chunks (``chunk_keep ≥ 1``, ChunkFlow); then its fragments tile
   it in order, each in a strictly later slot than the one before, and every
   fragment but the first is its micro-batch's only fragment (its attention
   is a cross problem: its rows × the document's keys up to its end).
4. Groups: ranks of the stage, no rank twice, sorted, node-aligned (every node
   a group touches gives it the same number of devices, so the attention
   plan's nodes are the mesh's), at most ``MAX_DEVICES`` ranks.
5. Micro-batches that run at the same time (one slot) use disjoint ranks.
6. Every strategy is a registered placement strategy.

:func:`verify_lowered` checks the lowered step: every micro-batch's attention
plan (itself verified after every pass when it was lowered) is on as many
devices as its group and computes exactly its fragments — the same sample
lengths and the same allowed pairs as the documents under the step's mask —
and every device stays under its memory cap (:class:`MemoryCapError` naming
the device, the micro-batch and the bytes).
"""

from __future__ import annotations

import numpy as np

from ..errors import MemoryCapError, VerifyError
from ..ir.limits import MAX_DEVICES, MAX_MICRO_BATCHES
from ..passes import strategies
from .ir import StepPlan
from .lower import Lowered, frag_pairs


def _fail(plan: StepPlan, msg: str) -> VerifyError:
    return VerifyError(f"step plan of {plan.system}: {msg}")


def _is_int_vector(a) -> bool:
    return isinstance(a, np.ndarray) and a.ndim == 1 and a.dtype == np.int64


def verify_plan(plan: StepPlan) -> None:
    """Invariants 1-6 (see the module doc); VerifyError naming the first that fails."""
    _shapes(plan)
    _fragments(plan)
    _coverage(plan)
    _groups(plan)
    _concurrency(plan)
    known = set(strategies())
    for m, s in enumerate(plan.mb_strategy):
        if s not in known:
            raise _fail(plan, f"micro-batch {m}: unknown attention strategy {s!r}")
    _unkept(plan)


def _unkept(plan: StepPlan) -> None:
    u = plan.mb_unkept
    if not all(isinstance(m, int) and not isinstance(m, bool) for m in u):
        raise _fail(plan, "mb_unkept must list micro-batch numbers")
    if u and not plan.problem.keep_kv:
        raise _fail(plan, "mb_unkept lists micro-batches that do not keep the forward's KV, but the problem keeps "
                          "none (keep_kv is off)")
    if list(u) != sorted(set(u)) or (u and not 0 <= u[0] <= u[-1] < plan.n_mb):
        raise _fail(plan, f"mb_unkept must be ascending distinct micro-batches of 0..{plan.n_mb - 1}, got "
                          f"{list(u)[:8]}")
    if "keep_kv" in plan.info_dict() and plan.problem.keep_kv:  # step/driver.py: planned without it altogether
        raise _fail(plan, "info says the step was planned without keep_kv, but its problem keeps the forward's KV")


def _shapes(plan: StepPlan) -> None:
    cols = ("frag_doc", "frag_start", "frag_end", "frag_mb", "mb_group", "mb_slot", "group_ptr", "group_ranks",
            "queue_out")
    for name in cols:
        if not _is_int_vector(getattr(plan, name)):
            raise _fail(plan, f"{name} must be a 1-D int64 array")
    n = len(plan.frag_doc)
    if not (len(plan.frag_start) == len(plan.frag_end) == len(plan.frag_mb) == n):
        raise _fail(plan, "the fragment columns differ in length")
    m = len(plan.mb_group)
    if m == 0:
        raise _fail(plan, "no micro-batch")
    if m > MAX_MICRO_BATCHES:
        raise _fail(plan, f"{m:,} micro-batches, over MAX_MICRO_BATCHES = {MAX_MICRO_BATCHES:,} (ir/limits.py)")
    if len(plan.mb_slot) != m or len(plan.mb_strategy) != m:
        raise _fail(plan, f"{m} micro-batches but {len(plan.mb_slot)} slots and {len(plan.mb_strategy)} strategies")
    p = plan.group_ptr
    if len(p) < 2 or p[0] != 0 or p[-1] != len(plan.group_ranks) or (np.diff(p) <= 0).any():
        raise _fail(plan, "group_ptr must start at 0, grow strictly and end at len(group_ranks)")
    if (plan.mb_group < 0).any() or (plan.mb_group >= plan.n_groups).any():
        bad = int(np.flatnonzero((plan.mb_group < 0) | (plan.mb_group >= plan.n_groups))[0])
        raise _fail(plan, f"micro-batch {bad}: group {int(plan.mb_group[bad])} does not exist")
    if (plan.mb_slot < 0).any():
        raise _fail(plan, f"micro-batch {int(np.argmin(plan.mb_slot))}: negative slot")


def _fragments(plan: StepPlan) -> None:
    p, m = plan.problem, plan.n_mb
    fm = plan.frag_mb
    if len(fm) and ((fm < 0).any() or (fm >= m).any()):
        raise _fail(plan, f"fragment {int(np.flatnonzero((fm < 0) | (fm >= m))[0])}: micro-batch out of range")
    if (np.diff(fm) < 0).any():
        raise _fail(plan, f"fragment {int(np.flatnonzero(np.diff(fm) < 0)[0]) + 1}: fragments must be listed "
                          f"micro-batch by micro-batch")
    empty = np.flatnonzero(np.bincount(fm, minlength=m) == 0)
    if len(empty):
        raise _fail(plan, f"micro-batch {int(empty[0])} has no fragment")
    d = plan.frag_doc
    if len(d) and ((d < 0).any() or (d >= p.docs).any()):
        raise _fail(plan, f"fragment {int(np.flatnonzero((d < 0) | (d >= p.docs))[0])}: document out of range")
    bad = np.flatnonzero((plan.frag_start < 0) | (plan.frag_end <= plan.frag_start)
                         | (plan.frag_end > p.seqlens[d] if len(d) else False))
    if len(bad):
        f = int(bad[0])
        raise _fail(plan, f"fragment {f}: [{int(plan.frag_start[f])}, {int(plan.frag_end[f])}) is not a non-empty "
                          f"range of document {int(d[f])} (length {int(p.seqlens[d[f]])})")


def _coverage(plan: StepPlan) -> None:
    p = plan.problem
    q = plan.queue_out
    if len(q) and ((q < 0).any() or (q >= p.docs).any()):
        raise _fail(plan, "queue_out names a document that does not exist")
    if len(np.unique(q)) != len(q):
        raise _fail(plan, "a document is queued twice")
    count = np.bincount(plan.frag_doc, minlength=p.docs)
    split = np.flatnonzero(count > 1)
    if len(split) and plan.chunk_keep < 1:
        raise _fail(plan, f"document {int(split[0])} is split into {int(count[split[0]])} fragments; splitting a "
                          f"document needs its KV carried between chunks (chunk_keep >= 1)")
    if len(split):
        _chunks(plan, split)
    queued = np.zeros(p.docs, bool)
    queued[q] = True
    both = np.flatnonzero(queued & (count > 0))
    if len(both):
        raise _fail(plan, f"document {int(both[0])} is queued for a later step and also in a micro-batch")
    covered = np.zeros(p.docs, np.int64)
    np.add.at(covered, plan.frag_doc, plan.frag_len)
    lost = np.flatnonzero(~queued & (covered != p.seqlens))
    if len(lost):
        i = int(lost[0])
        raise _fail(plan, f"document {i}: {int(covered[i]):,} of its {int(p.seqlens[i]):,} tokens are in a "
                          f"micro-batch (every token must be in exactly one)")


def _chunks(plan: StepPlan, split: np.ndarray) -> None:
    """The fragments of every split document tile it in order, in strictly increasing slots; a later chunk
    is its micro-batch's only fragment."""
    if isinstance(plan.chunk_keep, bool) or not isinstance(plan.chunk_keep, int):
        raise _fail(plan, f"chunk_keep must be an integer, got {plan.chunk_keep!r:.40}")
    per_mb = np.bincount(plan.frag_mb, minlength=plan.n_mb)
    is_split = np.zeros(plan.problem.docs, bool)
    is_split[split] = True
    frags = np.flatnonzero(is_split[plan.frag_doc])
    order = frags[np.lexsort((plan.frag_start[frags], plan.frag_doc[frags]))]
    doc, start, end = plan.frag_doc[order], plan.frag_start[order], plan.frag_end[order]
    slot = plan.mb_slot[plan.frag_mb[order]]
    same = doc[1:] == doc[:-1]
    gap = np.flatnonzero(same & (start[1:] != end[:-1]))
    if len(gap):
        f = int(order[gap[0] + 1])
        raise _fail(plan, f"document {int(doc[gap[0]])}: its chunk [{int(plan.frag_start[f])}, "
                          f"{int(plan.frag_end[f])}) does not start where the one before ends ({int(end[gap[0]])})")
    late = np.flatnonzero(same & (slot[1:] <= slot[:-1]))
    if len(late):
        f = int(order[late[0] + 1])
        raise _fail(plan, f"document {int(doc[late[0]])}: its chunk [{int(plan.frag_start[f])}, "
                          f"{int(plan.frag_end[f])}) runs in slot {int(slot[late[0] + 1])}, not after the chunk "
                          f"before it (slot {int(slot[late[0]])}): it reads that chunk's KV")
    fp = frag_pairs(plan.problem, plan)
    whole = np.zeros(plan.problem.docs, np.int64)
    np.add.at(whole, plan.frag_doc, fp)
    lost = split[whole[split] != plan.problem.pairs[split]]
    if len(lost):
        d = int(lost[0])
        raise _fail(plan, f"document {d} is cut into chunks, but its mask lets a row see a key after its chunk "
                          f"({int(plan.problem.pairs[d] - whole[d]):,} pairs would be lost): only masks where no "
                          f"query sees a later key can be cut")
    later = order[1:][same]
    shared = later[per_mb[plan.frag_mb[later]] > 1]
    if len(shared):
        f = int(shared[0])
        raise _fail(plan, f"fragment {f}: a later chunk of document {int(plan.frag_doc[f])} shares micro-batch "
                          f"{int(plan.frag_mb[f])} with other fragments (a chunk that reads earlier KV runs alone)")


def _groups(plan: StepPlan) -> None:
    mesh = plan.problem.mesh
    n = mesh.stage_devices
    for g in range(plan.n_groups):
        r = plan.group(g)
        if len(r) > MAX_DEVICES:
            raise _fail(plan, f"group {g}: {len(r)} ranks, over MAX_DEVICES = {MAX_DEVICES} (ir/limits.py)")
        if (r < 0).any() or (r >= n).any():
            raise _fail(plan, f"group {g}: rank {int(r[(r < 0) | (r >= n)][0])} is not one of the stage's {n} ranks")
        if (np.diff(r) <= 0).any():
            raise _fail(plan, f"group {g}: ranks must be sorted and distinct, got {r[:16].tolist()}")
        per_node = np.unique(mesh.node_of(r), return_counts=True)[1]
        if (per_node != per_node[0]).any():
            raise _fail(plan, f"group {g}: its nodes give it {per_node.tolist()} devices; every node a group "
                              f"touches must give it the same number")


def _concurrency(plan: StepPlan) -> None:
    n = plan.problem.mesh.stage_devices
    sizes = np.diff(plan.group_ptr)[plan.mb_group]
    mb = np.repeat(np.arange(plan.n_mb), sizes)
    ranks = np.concatenate([plan.mb_ranks(m) for m in range(plan.n_mb)])
    key = plan.mb_slot[mb] * n + ranks
    order = np.argsort(key, kind="stable")
    dup = np.flatnonzero(np.diff(key[order]) == 0)
    if len(dup):
        a, b = int(mb[order[dup[0]]]), int(mb[order[dup[0] + 1]])
        raise _fail(plan, f"micro-batches {a} and {b} both run in slot {int(plan.mb_slot[a])} on rank "
                          f"{int(ranks[order[dup[0]]])}")


def verify_attention(plan: StepPlan, irs) -> None:
    """Every micro-batch's attention plan (a verified ``PlanIR``) is on as many devices as its group and
    computes exactly its fragments: the same sample lengths, the documents' allowed pairs × heads, with
    the step's attention options."""
    p = plan.problem
    if len(irs) != plan.n_mb:
        raise _fail(plan, f"{len(irs)} attention plans for {plan.n_mb} micro-batches")
    ptr = plan.mb_ptr()
    fp = frag_pairs(p, plan)
    for m, ir in enumerate(irs):
        size = len(plan.mb_ranks(m))
        if ir.devices != size:
            raise _fail(plan, f"micro-batch {m}: its attention plan has {ir.devices} devices, its group {size}")
        prefix = plan.mb_prefix(m)
        rows = tuple(ir.problem.q_lens.tolist()) if ir.problem.is_cross else tuple(ir.problem.seqlens.tolist())
        if rows != plan.mb_seqlens(m) or ir.problem.is_cross != (prefix > 0) or (
                prefix and int(ir.problem.seqlens[0]) != 2 * rows[0] + prefix):
            raise _fail(plan, f"micro-batch {m}: its attention plan's samples are not its fragments"
                              + (f" (a chunk after {prefix:,} earlier tokens of its document)" if prefix else ""))
        if (ir.problem.heads, ir.problem.kv_heads, ir.problem.head_dim) != (p.model.heads, p.model.kv_heads,
                                                                            p.model.head_dim):
            raise _fail(plan, f"micro-batch {m}: its attention plan's heads are not the model's")
        keep = plan.mb_keeps_kv(m)
        if (ir.problem.partials_dtype, ir.problem.keep_kv) != (p.partials_dtype, keep):
            raise _fail(plan, f"micro-batch {m}: its attention plan has partials_dtype "
                              f"{ir.problem.partials_dtype} and keep_kv {ir.problem.keep_kv}, the step "
                              f"{p.partials_dtype} and {keep}"
                              + (" (it is listed in mb_unkept)" if p.keep_kv and not keep else
                                 " (it is not listed in mb_unkept)" if p.keep_kv else ""))
        got = int(ir.need_graph().cb_pairs.sum())
        want = int(fp[ptr[m]:ptr[m + 1]].sum()) * p.model.heads
        if got != want:
            raise _fail(plan, f"micro-batch {m}: its attention plan computes {got:,} (pair, head)s, its "
                              f"documents have {want:,} under the mask")


def verify_lowered(plan: StepPlan, lowered: list[Lowered], peak: np.ndarray, peak_mb: np.ndarray, cap: int) -> None:
    """The lowered step: attention plans match their micro-batches (:func:`verify_attention`); memory under
    the cap (:class:`MemoryCapError` naming the device, the micro-batch and the bytes)."""
    verify_attention(plan, [low.ir for low in lowered])
    over = np.flatnonzero(peak > cap)
    if len(over):
        d = int(over[np.argmax(peak[over])])
        m = int(peak_mb[d])
        where = f"micro-batch {m} ({int(plan.mb_tokens()[m]):,} tokens on {len(plan.mb_ranks(m))} devices)" \
            if m >= 0 else "no micro-batch (the model states alone)"
        if plan.chunk_keep >= 1:
            where += ", the K and V its document's chunks carry included"
        raise MemoryCapError(f"device {d} needs {peak[d] / 2**30:.1f} GiB in {where}, over its cap of "
                             f"{cap / 2**30:.1f} GiB ({len(over)} device(s) over)", device=d, micro_batch=m,
                             nbytes=int(peak[d]), cap=int(cap))
