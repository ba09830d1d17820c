"""Lowering: every micro-batch of a step plan becomes an attention plan on
its group, built exactly as :func:`attnplan.compile` builds one — the batch's
mask lowered by the frontend over the micro-batch's samples, then the default
pipeline ``tile{block=B},STRATEGY,comm{mode=...},overlap,emit`` run with the
verifier after every pass — without the face (the step layer sits below it).

A micro-batch's attention plan depends only on (sample lengths, group size,
nodes it spans, strategy, block size, mask), so :class:`AttentionCache`
lowers and simulates each distinct one once: the ``dp`` identical
micro-batches of a fixed-length batch cost one compile, and a system that
compares strategies for a micro-batch (WLB-LLM's per-micro-batch choice)
reuses the winner when the step is lowered.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass

import numpy as np

from ..backends.cost import Profile, cb_seconds, get_profile, launches, simulate
from ..errors import BatchError, PlanError, StepError
from ..frontend import MaskProgram, load_mask, lower_batch
from ..ir.limits import MAX_SAMPLES, MAX_TOKENS
from ..ir.mask import HI, INF, K0, K1, LO, Q0, Q1, Pieces
from ..ir.module import PlanIR
from ..ir.problem import Problem
from ..ir.program import BBYTES, BWD, FWD
from ..passes import parse_pipeline, run_pipeline, strategies
from ..passes.default import default_pipeline
from .ir import StepPlan, StepProblem
from .mesh import Mesh
from .model import Model, activation_bytes, load_model, static_bytes


def pipeline_text(strategy: str, block_size: int) -> str:
    """The default attention pipeline (:func:`attnplan.passes.default.default_pipeline`)."""
    return default_pipeline(strategy, block_size)


@dataclass(frozen=True, slots=True, eq=False)
class Lowered:
    """One micro-batch's verified attention plan and its simulation, per
    group-local device: tokens homed, forward/backward finish and busy
    seconds of one layer's attention, buffer bytes (the larger phase)."""

    ir: PlanIR
    strategy: str
    tokens: np.ndarray
    fwd_finish: np.ndarray
    bwd_finish: np.ndarray
    fwd_busy: np.ndarray
    bwd_busy: np.ndarray
    buffers: np.ndarray
    plan_pairs: int
    kept: np.ndarray  # per device: bytes of KV its backward keeps from its forward (Problem.keep_kv), per layer

    @property
    def predicted_s(self) -> float:
        return float(self.fwd_finish.max() + self.bwd_finish.max())

    @classmethod
    def of(cls, ir: PlanIR, strategy: str, sim: dict | None = None) -> Lowered:
        """``ir`` (emitted) lowered: tokens, buffers and kept bytes from its programs; times from ``sim``
        (a :func:`simulate` result; None: zeros, for what needs only the memory, as a loaded step file)."""
        g, prog, n = ir.need_graph(), ir.need_program(), ir.devices
        buffers = np.array([max(int(prog.buffers[FWD][i][:, BBYTES].sum()), int(prog.buffers[BWD][i][:, BBYTES].sum()))
                            for i in range(n)], dtype=np.int64)
        def times(ph: str, key: str) -> np.ndarray:
            return np.zeros(n) if sim is None else np.asarray(sim[ph][key])
        return cls(ir, strategy, query_tokens(ir, n), times("fwd", "finish_s"), times("bwd", "finish_s"),
                   times("fwd", "compute_s"), times("bwd", "compute_s"), buffers, int(g.cb_pairs.sum()),
                   prog.kept_bytes())


class AttentionCache:
    """Memo of lowered micro-batches (a pure function of the key; see the module doc)."""

    def __init__(self, mask: MaskProgram, profile: Profile, block_size: int, partials_dtype: str = "float32",
                 keep_kv: bool = False):
        self.mask, self.profile, self.block_size = mask, profile, block_size
        self.partials_dtype, self.keep_kv = partials_dtype, keep_kv  # every attention problem's options
        self._plans: dict[tuple, Lowered] = {}
        self._failed: dict[tuple, PlanError] = {}
        self._placed: dict[tuple, PlanIR] = {}
        self._best: dict[tuple, Lowered] = {}
        self._unkept: AttentionCache | None = None
        self.compiles = 0

    def without_kept(self) -> "AttentionCache":
        """The cache of the same attention problems without ``keep_kv`` (itself where nothing is kept): what a
        micro-batch whose kept KV would exceed the memory cap lowers with (:mod:`attnplan.step.kept`)."""
        if not self.keep_kv:
            return self
        if self._unkept is None:
            self._unkept = AttentionCache(self.mask, self.profile, self.block_size, self.partials_dtype, False)
        return self._unkept

    def get(self, lens: tuple[int, ...], devices: int, nodes: int, strategy: str, heads: tuple[int, int, int],
            prefix: int = 0) -> Lowered:
        key = (lens, devices, nodes, strategy, heads, prefix)
        hit = self._plans.get(key)
        if hit is not None:
            return hit
        if key in self._failed:
            raise self._failed[key]
        try:
            out = self._lower(lens, devices, nodes, strategy, heads, prefix)
        except PlanError as e:
            self._failed[key] = e
            raise
        self._plans[key] = out
        return out

    def _place(self, lens, devices, nodes, strategy, heads, prefix: int = 0) -> PlanIR:
        """The micro-batch tiled and placed by ``strategy`` (the first two passes of the pipeline),
        kept until the rest of the pipeline runs on it. ``prefix > 0``: the micro-batch is one later chunk
        of a document, rows ``[prefix, prefix + lens[0])`` of it, attending to every key up to its end
        (:func:`chunk_problem`)."""
        key = (lens, devices, nodes, strategy, heads, prefix)
        hit = self._placed.get(key)
        if hit is not None:
            return hit
        if key in self._failed:
            raise self._failed[key]
        if strategy not in strategies():
            raise StepError(f"unknown attention strategy {strategy!r}; known: {', '.join(strategies())}")
        h, hkv, d = heads
        if prefix:
            problem = chunk_problem(self.mask, prefix, lens, heads, self.partials_dtype, self.keep_kv)
        else:
            problem = Problem(seqlens=np.asarray(lens, np.int64), heads=h, kv_heads=hkv, head_dim=d,
                              pieces=lower_batch(self.mask, list(lens)), mask=self.mask.source,
                              partials_dtype=self.partials_dtype, keep_kv=self.keep_kv)
        passes = parse_pipeline(pipeline_text(strategy, self.block_size))[:2]
        try:
            ir = self._placed[key] = run_pipeline(PlanIR(problem, devices, nodes), passes)
        except PlanError as e:
            self._failed[key] = e  # a strategy that cannot take the micro-batch is tried once
            raise
        return ir

    def _lower(self, lens, devices, nodes, strategy, heads, prefix: int = 0) -> Lowered:
        placed = self._place(lens, devices, nodes, strategy, heads, prefix)
        self.compiles += 1
        ir = run_pipeline(placed, parse_pipeline(pipeline_text(strategy, self.block_size))[2:])
        self._placed.pop((lens, devices, nodes, strategy, heads, prefix), None)
        return Lowered.of(ir, strategy, simulate(ir, self.profile))

    def bound(self, lens, devices, nodes, strategy, heads, prefix: int = 0) -> float:
        """A lower bound of ``strategy``'s predicted attention time, from its placement alone: the busiest
        device's compute (tile rounding and launches included), forward and backward, no communication."""
        ir = self._place(lens, devices, nodes, strategy, heads, prefix)
        dev, prof = ir.need_placement().cb_device, self.profile
        compute = np.bincount(dev, weights=cb_seconds(ir.need_graph(), prof, launch=False), minlength=devices)
        per = compute + prof.launch_s * launches(np.bincount(dev, minlength=devices), prof).astype(np.float64)
        return float(per.max()) * (1.0 + self.profile.bwd_factor)

    def best(self, lens, devices, nodes, candidates, heads, bounds: dict | None = None, prefix: int = 0
             ) -> Lowered:
        """The candidate strategy with the lowest predicted attention time (ties: the first listed). A
        candidate whose :meth:`bound` (or ``bounds[name]``) is no better than the best so far is not lowered.
        The choice is memoized: equal micro-batches choose once."""
        memo = (lens, devices, nodes, tuple(candidates), heads, prefix)
        if memo in self._best:
            return self._best[memo]
        best, errors = None, []
        for s in candidates:
            key = (lens, devices, nodes, s, heads, prefix)
            try:
                if best is not None and key not in self._plans and (
                        bounds[s] if bounds and s in bounds else self.bound(lens, devices, nodes, s, heads, prefix)
                ) >= best.predicted_s:
                    continue
                low = self.get(lens, devices, nodes, s, heads, prefix)
            except PlanError as e:
                errors.append(f"{s}: {str(e).splitlines()[0]}")
                continue
            if best is None or low.predicted_s < best.predicted_s:
                best = low
        for s in candidates:  # placements kept for bounds only
            self._placed.pop((lens, devices, nodes, s, heads, prefix), None)
        if best is None:
            raise PlanError("no attention strategy can take the micro-batch: " + "; ".join(errors))
        self._best[memo] = best
        return best


    def auto(self, lens, devices, nodes, heads, prefix: int = 0, fits=None) -> Lowered:
        """Every registered strategy that can take the micro-batch, lowered best bound first until the next
        bound cannot beat the best predicted time (the step layer's ``compile(strategy="auto")``). ``fits``
        (a predicate on a :class:`Lowered`): the fastest plan it accepts — the next fastest strategy where it
        refuses one; the last one tried where it refuses every strategy."""
        bounds = {}
        for s in strategies():
            try:
                bounds[s] = self.bound(lens, devices, nodes, s, heads, prefix)
            except PlanError:
                continue
        order = sorted(bounds, key=lambda s: (bounds[s], s)) or list(strategies())
        return self.best_fitting(lens, devices, nodes, order, heads, bounds, prefix, fits)

    def best_fitting(self, lens, devices, nodes, candidates, heads, bounds: dict | None = None, prefix: int = 0,
                     fits=None) -> Lowered:
        """:meth:`best` of ``candidates`` that ``fits`` (a predicate on a :class:`Lowered`) accepts: the next
        fastest where it refuses one; the last one tried where it refuses every candidate (the caller checks)."""
        order = list(candidates)
        while True:
            low = self.best(lens, devices, nodes, order, heads, bounds, prefix)
            if fits is None or len(order) == 1 or fits(low):
                return low
            order = [s for s in order if s != low.strategy]


def choose_strategy(problem: StepProblem, lens: tuple[int, ...], ranks: np.ndarray, option: str,
                    adaptive: tuple[str, ...] = (), prefix: int = 0) -> str:
    """The attention strategy of one micro-batch for a system's option (:func:`choose_lowered`; a strategy
    name as is, without lowering it here)."""
    if option not in ("adaptive", "auto"):
        return option
    return choose_lowered(problem, lens, ranks, option, adaptive, prefix).strategy


def choose_lowered(problem: StepProblem, lens: tuple[int, ...], ranks: np.ndarray, option: str,
                   adaptive: tuple[str, ...] = (), prefix: int = 0, fits=None) -> Lowered:
    """The attention plan of one micro-batch for a system's option: a strategy name as is;
    ``adaptive``: the faster of the system's ``adaptive`` candidates; ``auto``: the fastest of all.
    ``fits`` (a predicate on a :class:`Lowered`, e.g. :func:`fits_alone`): the fastest the predicate
    accepts, the last one tried where it accepts none (the caller checks). ``prefix``: the micro-batch is a
    later chunk of a document (:meth:`AttentionCache._place`)."""
    cache, nodes, heads = cache_of(problem), group_nodes(problem.mesh, ranks), heads_of(problem)
    if option == "auto":
        return cache.auto(lens, len(ranks), nodes, heads, prefix, fits=fits)
    if option != "adaptive":
        return cache.get(lens, len(ranks), nodes, option, heads, prefix)
    return cache.best_fitting(lens, len(ranks), nodes, adaptive, heads, prefix=prefix, fits=fits)


def chunk_pieces(mask: MaskProgram, prefix: int, rows: int) -> Pieces:
    """The mask of rows ``[prefix, prefix + rows)`` of a document of ``prefix + rows`` tokens against all of
    its keys, as one cross-attention sample: queries ``0 .. rows-1`` (row ``prefix + i`` is query ``i``),
    then keys ``rows .. rows + prefix + rows - 1`` (key ``k`` is at ``rows + k``): ``k - q`` moves by the
    document's length."""
    end = prefix + rows
    a = mask.lower(end).clip(prefix, end, 0, end).a.copy()
    a[:, [Q0, Q1]] -= prefix
    a[:, [K0, K1]] += rows
    for col in (LO, HI):
        bounded = np.abs(a[:, col]) < INF // 2
        a[bounded, col] += end
    return Pieces.of(a)


def chunk_problem(mask: MaskProgram, prefix: int, lens: tuple[int, ...], heads: tuple[int, int, int],
                  partials_dtype: str = "float32", keep_kv: bool = False) -> Problem:
    """A later chunk's attention problem: one cross-attention sample, its ``lens[0]`` rows × the document's
    ``prefix + lens[0]`` keys (:func:`chunk_pieces`); the keys of earlier chunks come from their KV."""
    if len(lens) != 1:
        raise StepError(f"a chunk that reads earlier KV is one sample, got {len(lens)}")
    rows = int(lens[0])
    h, hkv, d = heads
    return Problem(seqlens=np.array([2 * rows + prefix], np.int64), heads=h, kv_heads=hkv, head_dim=d,
                   pieces=chunk_pieces(mask, prefix, rows), mask=mask.source, q_lens=np.array([rows], np.int64),
                   partials_dtype=partials_dtype, keep_kv=keep_kv)


def query_tokens(ir: PlanIR, devices: int) -> np.ndarray:
    """Query tokens homed on every device (a cross sample's key tokens are KV only: no linear work)."""
    g, pl = ir.need_graph(), ir.need_placement()
    if not ir.problem.is_cross:
        return np.bincount(pl.home, weights=g.tb_len, minlength=devices).astype(np.int64)
    q = ir.problem.query_index()
    inside = np.searchsorted(q, g.tb_end, "left") - np.searchsorted(q, g.tb_start, "left")
    if g.tb_ptr is not None and g.span_start is not None and g.span_end is not None:
        per_span = np.searchsorted(q, g.span_end, "left") - np.searchsorted(q, g.span_start, "left")
        inside = np.add.reduceat(per_span, g.tb_ptr[:-1]) if len(per_span) else inside
    return np.bincount(pl.home, weights=inside, minlength=devices).astype(np.int64)


def frag_pairs(problem: StepProblem, plan: StepPlan) -> np.ndarray:
    """Allowed (q, k) pairs of every fragment: its rows of its document × the document's keys."""
    p = problem
    out = p.pairs[plan.frag_doc].copy()
    part = np.flatnonzero((plan.frag_start > 0) | (plan.frag_end < p.seqlens[plan.frag_doc]))
    mask = cache_of(p).mask
    for f in part.tolist():
        end = int(plan.frag_end[f])
        out[f] = mask.lower(end).clip(int(plan.frag_start[f]), end, 0, end).pair_count()
    return out


def check_option(system: str, key: str, value: str, adaptive: bool) -> None:
    """A strategy option of a system: a registered strategy, ``auto``, or ``adaptive`` where it has one."""
    allowed = ("auto", "adaptive") if adaptive else ("auto",)
    if value not in allowed and value not in strategies():
        raise StepError(f"{system}: {key} must be {' or '.join(allowed)} or one of {', '.join(strategies())}, "
                        f"got {value!r:.40}")


# ---------------------------------------------------------------------------------------- problems

def doc_pairs(mask: MaskProgram, seqlens: np.ndarray) -> np.ndarray:
    """Allowed (q, k) pairs of every document under ``mask``, each distinct length lowered once."""
    distinct, inverse = np.unique(seqlens, return_inverse=True)
    per = np.array([mask.lower(int(n)).pair_count() for n in distinct.tolist()], dtype=np.int64)
    return per[inverse]


def make_problem(seqlens, model="llama3-8b", mesh: Mesh | None = None, profile="h100", mask="causal",
                 block_size: int = 2048, carried=(), carried_origin=None, step: int = 0, packing=None,
                 partials_dtype: str = "float32", keep_kv: bool = False) -> StepProblem:
    """A checked :class:`StepProblem`: this step's document lengths after the
    ``carried`` ones (lengths queued by earlier steps, with their
    ``carried_origin`` rows ``(step, index)``), every size against
    ir/limits.py. A step may bring no new documents when it has carried
    ones (the end of the data, where a queue drains). ``partials_dtype``, ``keep_kv``: every attention
    plan's (:class:`StepProblem`). BatchError for bad lengths, StepError for the rest."""
    if mesh is None:
        raise StepError("a step needs a mesh, e.g. Mesh(dp=4, cp=8)")
    if not isinstance(mesh, Mesh):
        raise StepError(f"mesh must be an attnplan.step.Mesh, got {type(mesh).__name__}")
    mdl: Model = load_model(model)
    mesh.chunk_layers(mdl.layers)  # the model's layers fill the pipeline's model chunks (StepError otherwise)
    prof = get_profile(profile)
    prog = mask if isinstance(mask, MaskProgram) else load_mask(mask)
    if prog.uses_heads:
        raise StepError("the step level takes masks without the query head `h` (per-head masks: plan compile)")
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) \
            or not 1 <= block_size <= MAX_TOKENS:
        raise StepError(f"block_size must be an integer in 1..{MAX_TOKENS:,}, got {block_size!r:.40}")
    try:  # the attention options, checked as every attention problem checks them
        opts = Problem(seqlens=np.ones(1, np.int64), heads=1, kv_heads=1, head_dim=1, pieces=lower_batch(prog, [1]),
                       partials_dtype=partials_dtype, keep_kv=keep_kv)
    except PlanError as e:
        raise StepError(str(e)) from None
    old = _lengths(carried, "carried", allow_empty=True)
    new = _lengths(seqlens, "seqlens", allow_empty=len(old) > 0)  # only carried documents: the queue drains
    lens = np.concatenate([old, new])
    if len(lens) > MAX_SAMPLES or int(lens.sum()) > MAX_TOKENS:
        raise BatchError(f"the step has {len(lens):,} documents and {int(lens.sum()):,} tokens; at most "
                         f"MAX_SAMPLES = {MAX_SAMPLES:,} and MAX_TOKENS = {MAX_TOKENS:,} (ir/limits.py)")
    if carried_origin is None:
        carried_origin = np.stack([np.full(len(old), -1, np.int64), np.arange(len(old), dtype=np.int64)], 1)
    carried_origin = np.asarray(carried_origin, np.int64).reshape(-1, 2)
    if len(carried_origin) != len(old):
        raise StepError(f"carried_origin has {len(carried_origin)} rows for {len(old)} carried documents")
    origin = np.concatenate([carried_origin, np.stack([np.full(len(new), step, np.int64),
                                                        np.arange(len(new), dtype=np.int64)], 1)])
    if packing is not None:
        packing = np.asarray(packing)
        if packing.shape != (len(lens),) or packing.dtype.kind not in "iu" or (len(packing) and packing.min() < 0):
            raise StepError(f"packing must give a non-negative sequence id for each of the {len(lens)} documents")
        packing = packing.astype(np.int64)
    return StepProblem(seqlens=lens, origin=origin, pairs=doc_pairs(prog, lens), model=mdl, mesh=mesh, profile=prof,
                       mask=prog.source, block_size=int(block_size), carried=len(old), step=int(step),
                       packing=packing, partials_dtype=opts.partials_dtype, keep_kv=opts.keep_kv,
                       cache=AttentionCache(prog, prof, int(block_size), opts.partials_dtype, opts.keep_kv))


def _lengths(v, name: str, allow_empty: bool = False) -> np.ndarray:
    a = np.asarray(list(v) if isinstance(v, (tuple, range)) else v)
    if a.ndim != 1 or (a.dtype.kind not in "iu" and len(a)):
        raise BatchError(f"{name} must be a list of positive document lengths")
    if not len(a) and not allow_empty:
        raise BatchError(f"{name}: the batch has no documents")
    if len(a) > MAX_SAMPLES:
        raise BatchError(f"{name}: {len(a):,} documents, over MAX_SAMPLES = {MAX_SAMPLES:,} (ir/limits.py)")
    a = a.astype(np.int64) if len(a) else np.zeros(0, np.int64)
    bad = np.flatnonzero((a < 1) | (a > MAX_TOKENS))
    if len(bad):
        raise BatchError(f"{name}[{bad[0]}] = {a[bad[0]]} is not a length in 1..{MAX_TOKENS:,}")
    return a


def cache_of(problem: StepProblem) -> AttentionCache:
    c = problem.cache
    if not isinstance(c, AttentionCache):
        raise StepError("the step problem has no attention cache: build it with attnplan.step.make_problem")
    return c


def heads_of(problem: StepProblem) -> tuple[int, int, int]:
    m = problem.model
    return (m.heads, m.kv_heads, m.head_dim)


def group_nodes(mesh: Mesh, ranks: np.ndarray) -> int:
    """Nodes a group spans (the attention plan's ``nodes``)."""
    return int(len(np.unique(mesh.node_of(ranks))))


def lower_mb(plan: StepPlan, m: int) -> Lowered:
    """Micro-batch ``m``'s attention plan (cached)."""
    p = plan.problem
    ranks = plan.mb_ranks(m)
    cache = cache_of(p) if plan.mb_keeps_kv(m) else cache_of(p).without_kept()
    return cache.get(plan.mb_seqlens(m), len(ranks), group_nodes(p.mesh, ranks), plan.mb_strategy[m],
                     heads_of(p), plan.mb_prefix(m))


def lower_step(plan: StepPlan) -> list[Lowered]:
    """Every micro-batch's attention plan, verified after every pass (PlanError names the micro-batch)."""
    out = []
    for m in range(plan.n_mb):
        try:
            out.append(lower_mb(plan, m))
        except PlanError as e:
            raise PlanError(f"micro-batch {m} ({plan.mb_strategy[m]} on {len(plan.mb_ranks(m))} devices): "
                            f"{str(e).splitlines()[0]}") from None
    return out


def fits_alone(problem: StepProblem):
    """A predicate on a micro-batch's :class:`Lowered` plan: every device of its group under the memory
    cap holding that micro-batch's activations (its plan's tokens and buffers), the model states and the
    reserve — what the step's peak is at least (:func:`attnplan.step.simulate.memory`). The fallback of a
    system whose group asked for ``ulysses`` (even tokens) takes a strategy that fits: the fastest
    strategy may hold more tokens on one device (flexsp on a 1Mi-token batch with a 429K document, one
    micro-batch on 32 devices: dacp, the fastest, needs 80.7 GiB on device 6; hypergraph, 1% slower, fits)."""
    base = static_bytes(problem.model, problem.mesh.stage_devices) + problem.mesh.reserve

    def fits(low: Lowered) -> bool:
        act = activation_bytes(problem.model, low.tokens, problem.mesh.recompute, low.buffers, low.kept)
        return bool((np.asarray(act, np.int64) + base <= problem.cap).all())
    return fits


def lower_or_fall_back(plan: StepPlan) -> tuple[StepPlan, list[Lowered]]:
    """Every micro-batch lowered, as :func:`lower_step`; but a micro-batch whose strategy the attention level
    cannot lower on its group (a compute-block limit, heads its devices cannot split, ...) takes the best
    strategy that can (:meth:`AttentionCache.auto`) whose plan leaves its devices under the memory cap with
    that micro-batch alone (:func:`fits_alone`; without pipeline stages or chunks carrying KV, where the
    peak is that sum), and the returned plan says so: its ``mb_strategy`` names what runs and its ``info``
    has a ``fallback`` entry. A PlanError only when no strategy can."""
    p = plan.problem
    out, strategies, notes = [], list(plan.mb_strategy), []
    staged, fits = p.mesh.pp > 1 or plan.chunk_keep >= 1, fits_alone(p)
    for m in range(plan.n_mb):
        ranks = plan.mb_ranks(m)
        try:
            out.append(lower_mb(plan, m))
            continue
        except PlanError as e:
            first = str(e).splitlines()[0]
        try:
            low = cache_of(p).auto(plan.mb_seqlens(m), len(ranks), group_nodes(p.mesh, ranks), heads_of(p),
                                   plan.mb_prefix(m), fits=None if staged else fits)
        except PlanError:
            raise PlanError(f"micro-batch {m} ({plan.mb_strategy[m]} on {len(ranks)} devices): {first}") from None
        why = first.split(": use ")[0].split("; ")[0]
        notes.append(f"micro-batch {m}: {plan.mb_strategy[m]} cannot run on its {len(ranks)} devices ({why}); "
                     f"{low.strategy} instead")
        strategies[m] = low.strategy
        out.append(low)
    if notes:
        plan = dataclasses.replace(plan, mb_strategy=tuple(strategies),
                                   info=tuple(plan.info) + (("fallback", "; ".join(notes)),))
    return plan, out


def next_problem(plan: StepPlan, seqlens) -> StepProblem:
    """The next step's problem: the documents ``plan`` queued (``queue_out``, in queue order, with their
    origins) carried in front of the new batch ``seqlens``; model, mesh, profile, mask and block size kept."""
    p = plan.problem
    q = plan.queue_out
    return make_problem(seqlens, model=p.model, mesh=p.mesh, profile=p.profile, mask=cache_of(p).mask,
                        block_size=p.block_size,
                        carried=p.seqlens[q], carried_origin=p.origin[q], step=p.step + 1)
