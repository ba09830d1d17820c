"""The Python API: ``compile``, ``execute``, ``load`` and the ``Plan`` value."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import BatchError, PlanError, PlanFileError
from .ir.module import PlanIR
from .ir.problem import Problem



def default_pipeline(strategy: str, block_size: int) -> str:
    """The default pipeline, one named step a line."""
    from .passes import REGISTRY
    return ",".join([
        f"tile{{block={block_size}}}",                         # token blocks per sample, the block graph
        strategy,                                             # placement: token homes, compute devices
        f"comm{{mode={REGISTRY[strategy].default_comm}}}",   # transfers (p2p, or ring for zigzag)
        "overlap",                                            # next stage's transfers fly during compute
        "emit",                                               # per-device instruction streams, fwd + bwd
    ])


def _positive_int(name: str, v, err=PlanError) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise err(f"{name} must be a positive integer, got {v!r}")
    return int(v)


def _seqlens(seqlens) -> np.ndarray:
    if seqlens is None:
        raise BatchError("no sequence lengths given")
    lens = list(seqlens)
    if not lens:
        raise BatchError("the batch has no samples")
    for i, x in enumerate(lens):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x <= 0:
            raise BatchError(f"sample {i}: length must be a positive integer, got {x!r}")
    return np.asarray(lens, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class Plan:
    """A compiled plan: the verified IR down to per-device programs."""

    ir: PlanIR
    meta: dict = field(default_factory=dict)      # pipeline, strategy, block size, profile
    measured: dict = field(default_factory=dict)  # plan_s (the only non-deterministic field)

    @property
    def devices(self) -> int:
        return self.ir.devices

    @property
    def problem(self) -> Problem:
        return self.ir.problem

    def stats(self, profile: str | None = None, sim: dict | None = None) -> dict:
        from .backends.stats import compute_stats
        s = compute_stats(self.ir, self.measured.get("plan_s", 0.0), profile or self.meta.get("profile", "h100"), sim)
        s["pipeline"] = self.meta.get("pipeline", "")
        return s

    def to_text(self, device: int | None = None) -> str:
        if device is not None and not 0 <= device < self.devices:
            raise PlanError(f"device {device} does not exist; the plan has devices 0..{self.devices - 1}")
        return self.ir.program.to_text(device)

    def to_bytes(self) -> bytes:
        from .backends.planfile import pack
        return pack(self.ir, self.meta, self.measured)

    def canonical_bytes(self) -> bytes:
        """The deterministic part of the plan file (everything but ``measured``)."""
        from .backends.planfile import canonical_bytes
        return canonical_bytes(self.ir, self.meta)

    def save(self, path) -> None:
        Path(path).write_bytes(self.to_bytes())

    @staticmethod
    def from_bytes(data: bytes, source: str = "<bytes>") -> "Plan":
        from .backends.planfile import unpack
        ir, meta, measured = unpack(data, source)
        return Plan(ir, meta, measured)

    # token ownership (the training API; see attnplan.runtime.layout) ---------------
    def local_index(self, rank: int) -> np.ndarray:
        """Global (packed) token index of each of ``rank``'s local rows: its home
        token blocks in increasing order."""
        from .runtime.layout import local_index
        return local_index(self.ir, rank)

    def local_tokens(self, rank: int) -> int:
        from .runtime.layout import local_tokens
        return local_tokens(self.ir, rank)

    def position_ids(self, rank: int, kind: str = "sample") -> np.ndarray:
        """Positions of ``rank``'s local tokens for RoPE: by default the position
        inside each token's own sample (0 at every sample start, as packed
        training needs); ``kind="global"`` gives the packed-axis position."""
        from .runtime.layout import position_ids
        return position_ids(self.ir, rank, kind)

    def sample_ids(self, rank: int) -> np.ndarray:
        """The sample each of ``rank``'s local tokens belongs to (for labels and loss weights)."""
        from .runtime.layout import sample_ids
        return sample_ids(self.ir, rank)

    def dispatch(self, x_global, rank: int | None = None, group=None):
        """``rank``'s rows of ``x_global`` (tokens first: a torch tensor or numpy
        array of the whole batch), in local order. ``rank`` defaults to this
        process's rank in ``group``. Differentiable."""
        from .runtime.dist import dispatch
        return dispatch(self.ir, x_global, self._rank(rank, group))

    def undispatch(self, x_local, group=None, timeout: float | None = None):
        """Every rank's local rows gathered into global token order, on every rank
        (an all_gather over ``group``). Its backward returns this rank's rows of
        the incoming gradient and communicates nothing: every rank must compute
        the same function of the result (then sum parameter gradients over the
        group, as for a loss over ``dispatch``-ed tokens)."""
        from .runtime.dist import undispatch
        return undispatch(self, x_local, group, timeout)

    def _rank(self, rank, group) -> int:
        if rank is not None:
            return rank
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(group)
        if self.devices == 1:
            return 0
        raise PlanError("no rank given and torch.distributed is not initialized")


def load(path) -> Plan:
    """Read and validate a plan file (raises :class:`PlanFileError`)."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise PlanFileError(f"{path}: cannot read plan file: {e.strerror}") from None
    return Plan.from_bytes(data, str(path))


def compile(seqlens=None, mask="causal", devices: int = 1, nodes: int = 1, heads: int = 8,
            kv_heads: int | None = None, head_dim: int = 64, strategy: str = "zigzag", block_size: int = 2048,
            pipeline: str | None = None, segments=None, dtype: str = "bfloat16", memory_cap: int | None = None,
            verify: bool = True, profile: str = "h100", instruments=(),
            max_compute_blocks: int | None = None) -> Plan:
    """Compile one batch into a verified plan.

    ``mask`` is a builtin name or expression (``"causal"``,
    ``"sliding_window(256) | k < 16"``), a path to a ``.mask`` file, or a
    parsed ``MaskProgram``. ``kv_heads`` defaults to ``heads``. ``pipeline``
    overrides ``strategy``/``block_size`` with a pass pipeline string.
    ``strategy="auto"`` compiles every strategy and keeps the plan with the
    lowest predicted time (``plan.meta["candidates"]`` has each one's)."""
    if strategy == "auto" and pipeline is None:
        return _compile_auto(dict(locals()))
    from . import backends  # noqa: F401  (registers emit)
    from .backends.cost import get_profile
    from .frontend import MaskProgram, load_mask, lower_batch
    from .passes import parse_pipeline, run_pipeline, strategies

    t0 = time.perf_counter()
    lens = _seqlens(seqlens)
    devices = _positive_int("devices", devices)
    nodes = _positive_int("nodes", nodes)
    heads = _positive_int("heads", heads)
    kv_heads = heads if kv_heads is None else _positive_int("kv_heads", kv_heads)
    head_dim = _positive_int("head_dim", head_dim)
    block_size = _positive_int("block_size", block_size)
    if devices % nodes:
        raise PlanError(f"devices ({devices}) must be a multiple of nodes ({nodes})")
    if memory_cap is not None:
        memory_cap = _positive_int("memory_cap", memory_cap)
    get_profile(profile)
    named = pipeline is None
    if named:
        if strategy not in strategies():
            raise PlanError(f"unknown strategy {strategy!r}; known: {', '.join(strategies())}")
        pipeline = default_pipeline(strategy, block_size)
    passes = parse_pipeline(pipeline)
    if segments is not None:
        segments = tuple(tuple((str(k), int(n)) for k, n in s) if s is not None else None for s in segments)
        if len(segments) != len(lens):
            raise BatchError(f"segments are given for {len(segments)} samples, the batch has {len(lens)}")
    prog = mask if isinstance(mask, MaskProgram) else load_mask(str(mask))
    pieces = lower_batch(prog, lens.tolist(), segments)
    problem = Problem(seqlens=lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim, pieces=pieces,
                      mask=prog.source, segments=segments, dtype=dtype)
    from .passes.base import MAX_COMPUTE_BLOCKS
    ir = run_pipeline(PlanIR(problem, devices, nodes, memory_cap), passes, verify_each=verify,
                      instruments=tuple(instruments), max_compute_blocks=max_compute_blocks or MAX_COMPUTE_BLOCKS)
    if ir.program is None:
        raise PlanError(f"pipeline {pipeline!r} does not end in a program; add 'emit'")
    meta = {"pipeline": ",".join(p.spec() for p in passes), "strategy": strategy if named else "",
            "block_size": block_size, "profile": profile}
    return Plan(ir, meta, {"plan_s": time.perf_counter() - t0})


def _compile_auto(kwargs: dict) -> Plan:
    from .passes import strategies
    t0 = time.perf_counter()
    best, candidates, errors = None, {}, []
    for name in strategies():
        try:
            plan = compile(**dict(kwargs, strategy=name))
        except PlanError as e:  # a strategy that cannot take this batch
            errors.append(f"{name}: {str(e).splitlines()[0]}")
            continue
        candidates[name] = plan.stats()["predicted_s"]
        if best is None or candidates[name] < candidates[best[0]]:
            best = (name, plan)
    if best is None:
        raise PlanError("auto: no strategy could plan this batch (" + "; ".join(errors) + ")")
    meta = dict(best[1].meta, strategy=f"auto:{best[0]}", candidates=candidates)
    return Plan(best[1].ir, meta, {"plan_s": time.perf_counter() - t0})


def attention(q, k, v, plan: Plan, group=None, *, softmax_scale: float | None = None, timeout: float | None = None,
              timings=None):
    """This rank's attention under ``plan``, for a training step: ``q [T_local,
    Hq, D]``, ``k``/``v [T_local, Hkv, D]`` in the plan's local layout
    (``plan.dispatch``); returns the local output. Autograd-aware: the
    backward issues the plan's backward transfers in the plan's order on every
    rank. Device ``d`` is rank ``d`` of ``group`` (default: the default group).
    ``timeout``: seconds before a stuck transfer raises ``TransportError``
    naming the peer and transfer."""
    from .runtime.dist import attention as _attention
    return _attention(q, k, v, plan, group, softmax_scale=softmax_scale, timeout=timeout, timings=timings)


def execute(plan: Plan, q, k, v, softmax_scale: float | None = None):
    """Run ``plan`` on global ``q [T, Hq, D]``, ``k``/``v [T, Hkv, D]`` in this
    process (every device's program, in-memory transport). Differentiable."""
    from .runtime.executor import execute as _execute
    return _execute(plan.ir, q, k, v, softmax_scale)
