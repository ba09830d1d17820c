"""The Python API's implementation: ``compile``, ``load``, ``execute``, ``attention`` and their
checks (``attnplan.api`` is the face that re-exports them; the tools below it use them from here)."""

from __future__ import annotations

import math
import os
import time

import numpy as np

from ..errors import BatchError, PlanError
from ..ir import limits
from ..ir.module import PlanIR
from ..ir.problem import DTYPE_BYTES, Problem
from ..passes.default import default_pipeline
from .plan import Plan, _num, _show



def _positive_int(name: str, v, err=PlanError, limit: int | None = None) -> int:
    """``v`` as a Python int in ``1..limit``; numpy integer scalars count, bools do not."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise err(f"{name} must be a positive integer, got {_show(v)}")
    v = int(v)
    if v <= 0:
        raise err(f"{name} must be a positive integer, got {_num(v)}")
    if limit is not None and v > limit:
        raise err(f"{name} = {_num(v)} is over attnplan's limit of {limit:,} (ir/limits.py)")
    return v


def _text(name: str, v, err=PlanError) -> str:
    if not isinstance(v, str):
        raise err(f"{name} must be a string, got {_show(v)}")
    return v


def _seqlens(seqlens) -> np.ndarray:
    """Sample lengths (a list, tuple or range of integers, or a 1-D numpy
    integer array) as int64, checked against MAX_SAMPLES and MAX_TOKENS
    before anything is allocated (the total is summed as Python ints)."""
    if seqlens is None:
        raise BatchError("no sequence lengths given (e.g. seqlens=[4096, 1000, 300])")
    if isinstance(seqlens, np.ndarray):
        lens = _array_lens(seqlens)
    elif isinstance(seqlens, (list, tuple, range)):
        lens = _list_lens(seqlens)
    else:
        raise BatchError(f"seqlens must be a list, tuple or 1-D numpy integer array of sample lengths, "
                         f"got {_show(seqlens)}")
    total = int(lens.sum())  # lengths in 1..MAX_TOKENS, at most MAX_SAMPLES of them: no overflow
    if total > limits.MAX_TOKENS:
        raise BatchError(f"the batch has {total:,} tokens, over attnplan's limit of {limits.MAX_TOKENS:,} "
                         f"(ir/limits.py)")
    return lens


def _batch_lengths(seqlens, seqlens_q, seqlens_k) -> tuple[np.ndarray, np.ndarray | None]:
    """(packed lengths, query lengths or None): ``seqlens``, or cross-attention
    samples of ``seqlens_q`` queries and ``seqlens_k`` keys (packed: queries
    then keys, see :class:`~attnplan.ir.problem.Problem`)."""
    if seqlens_q is None and seqlens_k is None:
        return _seqlens(seqlens), None
    if seqlens is not None or seqlens_q is None or seqlens_k is None:
        raise BatchError("cross-attention takes seqlens_q and seqlens_k together, and no seqlens")
    try:
        q, k = _seqlens(seqlens_q), _seqlens(seqlens_k)
    except BatchError as e:
        raise BatchError(f"cross-attention: {e}") from None
    if len(q) != len(k):
        raise BatchError(f"seqlens_q has {len(q)} samples and seqlens_k {len(k)}: one query and one key length "
                         f"per sample")
    total = int(q.sum()) + int(k.sum())
    if total > limits.MAX_TOKENS:
        raise BatchError(f"the batch has {total:,} query and key tokens, over attnplan's limit of "
                         f"{limits.MAX_TOKENS:,} (ir/limits.py)")
    return q + k, q


def _count_samples(n: int) -> None:
    if n == 0:
        raise BatchError("the batch has no samples")
    if n > limits.MAX_SAMPLES:
        raise BatchError(f"the batch has {n:,} samples, over attnplan's limit of {limits.MAX_SAMPLES:,} "
                         f"(ir/limits.py)")


def _bad_length(i: int, x) -> BatchError:
    if isinstance(x, (int, np.integer)) and x > limits.MAX_TOKENS:
        return BatchError(f"sample {i}: length {_num(int(x))} is over attnplan's limit of "
                          f"{limits.MAX_TOKENS:,} tokens (ir/limits.py)")
    return BatchError(f"sample {i}: length must be a positive integer, got {_show(x)}")


def _list_lens(seq) -> np.ndarray:
    _count_samples(len(seq))
    ok = [isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)) and 1 <= x <= limits.MAX_TOKENS
          for x in seq]
    if not all(ok):
        i = ok.index(False)
        raise _bad_length(i, seq[i])
    return np.asarray(seq, dtype=np.int64)


def _array_lens(a: np.ndarray) -> np.ndarray:
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise BatchError(f"seqlens must be a 1-D integer array, got dtype {a.dtype} and shape {a.shape}")
    _count_samples(len(a))
    bad = (a < 1) | (a > limits.MAX_TOKENS)
    if bad.any():
        i = int(np.argmax(bad))
        raise _bad_length(i, a[i])
    return a.astype(np.int64)


def _segments(segments, lens: np.ndarray) -> tuple | None:
    """Per-sample segments: None, or one entry per sample, each None (one
    ``text`` segment) or a non-empty list of ``(kind, length)`` summing to the sample's length."""
    if segments is None:
        return None
    if not isinstance(segments, (list, tuple)):
        raise BatchError(f"segments must be a list with one entry per sample, got {_show(segments)}")
    if len(segments) != len(lens):
        raise BatchError(f"segments are given for {len(segments)} samples, the batch has {len(lens)}")
    return tuple(None if s is None else _sample_segments(i, s, int(n))
                 for i, (s, n) in enumerate(zip(segments, lens)))


def _sample_segments(i: int, seg, n: int) -> tuple:
    if not isinstance(seg, (list, tuple)) or not seg:
        raise BatchError(f"segments[{i}] must be None or a non-empty list of (kind, length), got {_show(seg)}")
    out = []
    for j, pair in enumerate(seg):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise BatchError(f"segments[{i}][{j}] must be a (kind, length) pair, got {_show(pair)}")
        kind = _text(f"segments[{i}][{j}]: kind", pair[0], BatchError)
        if not kind:
            raise BatchError(f"segments[{i}][{j}]: kind must be a non-empty string")
        out.append((kind, _positive_int(f"segments[{i}][{j}]: length", pair[1], BatchError,
                                        limits.MAX_TOKENS)))
    if sum(length for _, length in out) != n:
        raise BatchError(f"segments[{i}] sum to {sum(length for _, length in out):,} but sample {i} has length {n:,}")
    return tuple(out)


def check_options(*, devices=1, nodes=1, heads=8, kv_heads=None, head_dim=64, block_size=2048, memory_cap=None,
                  dtype="bfloat16", profile="h100", partials_dtype="float32", keep_kv=False) -> dict:
    """The shape options of :func:`compile`, checked against ir/limits.py and
    normalized to Python values (PlanError naming the option otherwise). The
    CLI's compare and bench call it once before compiling anything."""
    from ..backends.cost import get_profile
    heads = _positive_int("heads", heads, limit=limits.MAX_HEADS)
    opts = {
        "devices": _positive_int("devices", devices, limit=limits.MAX_DEVICES),
        "nodes": _positive_int("nodes", nodes, limit=limits.MAX_DEVICES),
        "heads": heads,
        "kv_heads": heads if kv_heads is None else _positive_int("kv_heads", kv_heads, limit=limits.MAX_HEADS),
        "head_dim": _positive_int("head_dim", head_dim, limit=limits.MAX_HEAD_DIM),
        "block_size": _positive_int("block_size", block_size, limit=limits.MAX_BLOCK_SIZE),
        "memory_cap": None if memory_cap is None else _positive_int("memory_cap", memory_cap,
                                                                    limit=limits.MAX_MEMORY_CAP),
        "dtype": _text("dtype", dtype),
        "profile": _text("profile", profile),
        "partials_dtype": _text("partials_dtype", partials_dtype),
        "keep_kv": keep_kv,
    }
    if not isinstance(keep_kv, (bool, np.bool_)):
        raise PlanError(f"keep_kv must be True or False, got {_show(keep_kv)}")
    opts["keep_kv"] = bool(keep_kv)
    if opts["devices"] % opts["nodes"]:
        raise PlanError(f"devices ({opts['devices']}) must be a multiple of nodes ({opts['nodes']})")
    if opts["dtype"] not in DTYPE_BYTES:
        raise PlanError(f"dtype must be one of {', '.join(sorted(DTYPE_BYTES))}, got {dtype!r}")
    if opts["partials_dtype"] not in ("float32", opts["dtype"]):
        raise PlanError(f"partials_dtype must be float32 or the dtype ({opts['dtype']}), got {partials_dtype!r}")
    get_profile(opts["profile"])
    return opts


def _check_flags(strategy, pipeline, verify, instruments, max_compute_blocks) -> tuple:
    """(strategy, pipeline, verify, instruments, max_compute_blocks) of :func:`compile`, checked."""
    strategy = _text("strategy", strategy).strip()
    pipeline = None if pipeline is None else _text("pipeline", pipeline)
    if not isinstance(verify, (bool, np.bool_)):
        raise PlanError(f"verify must be True or False, got {_show(verify)}")
    if not isinstance(instruments, (list, tuple)) or not all(callable(f) for f in instruments):
        raise PlanError(f"instruments must be a list or tuple of callables, got {_show(instruments)}")
    cap = (limits.MAX_COMPUTE_BLOCKS if max_compute_blocks is None
           else _positive_int("max_compute_blocks", max_compute_blocks))
    return strategy, pipeline, bool(verify), tuple(instruments), cap


def load(path) -> Plan:
    """Read and validate a plan file (raises :class:`PlanFileError`): the header
    first, then exactly the body it declares, within ``MAX_PLAN_FILE``."""
    from ..backends.planfile import read_file
    ir, meta = read_file(path)
    return Plan(ir, meta)


def compile(seqlens=None, mask="causal", devices: int = 1, nodes: int = 1, heads: int = 8,
            kv_heads: int | None = None, head_dim: int = 64, strategy: str = "zigzag", block_size: int = 2048,
            pipeline: str | None = None, segments=None, dtype: str = "bfloat16", memory_cap: int | None = None,
            verify: bool = True, profile: str = "h100", instruments=(),
            max_compute_blocks: int | None = None, seqlens_q=None, seqlens_k=None,
            partials_dtype: str = "float32", keep_kv: bool = False) -> Plan:
    """Compile one batch into a verified plan.

    ``seqlens`` is a list, tuple or 1-D numpy integer array of sample lengths
    (numpy integer scalars are fine). ``mask`` is a builtin name or expression
    (``"causal"``, ``"sliding_window(256) | k < 16"``), a path to a ``.mask``
    file, or a parsed ``MaskProgram``. ``kv_heads`` defaults to ``heads``.
    ``pipeline`` overrides ``strategy``/``block_size`` with a pass pipeline
    string (its ``tile`` pass's block is the plan's); ``strategy="NAME:VARIANT"`` is the strategy's default pipeline
    under another comm step (``per_doc:direct``, ``zigzag:allgather``; the
    variants of ``attnplan.passes.comm.COMM_VARIANTS``); any entry may end in `` overlap{local=first|last|kept}``
    (the backward's order: ``"span:tree overlap{local=last}"``, the name auto records for a plan it chose in that
    order, compiles that plan again). ``strategy="auto"`` places every strategy, then compiles and
    simulates them in order of a lower bound of their time until the next
    bound reaches the best predicted time, and keeps the plan with the lowest
    predicted time (ties: the lower bound, then the name) (``plan.meta["candidates"]`` has each simulated one's,
    ``plan.meta["pruned"]`` why the others were not; :mod:`attnplan.tools.auto`).
    Cross-attention: ``seqlens_q`` and ``seqlens_k`` (instead of ``seqlens``)
    give each sample's query and key lengths; the mask sees ``Lq`` and ``Lk``
    (``attnplan.frontend.lang``), and ``execute``/``attention`` take queries
    and keys of those lengths. ``partials_dtype``: the dtype partial
    outputs travel in between devices, ``"float32"`` or ``dtype`` (half the
    backward's partial dK/dV bytes; each partial rounded once; see
    :class:`attnplan.ir.problem.Problem`). ``keep_kv``: the backward reuses
    the K/V each device received in the forward (no KV moves in the
    backward; each device holds what it received until then). Every argument is checked before any work, sizes against
    ``attnplan/ir/limits.py``: a wrong type or value raises ``BatchError``
    (batch) or ``PlanError`` (anything else) naming it."""
    t0 = time.perf_counter()
    lens, q_lens = _batch_lengths(seqlens, seqlens_q, seqlens_k)
    segments = _segments(segments, lens)
    opts = check_options(devices=devices, nodes=nodes, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                         block_size=block_size, memory_cap=memory_cap, dtype=dtype, profile=profile,
                         partials_dtype=partials_dtype, keep_kv=keep_kv)
    strategy, pipeline, verify, instruments, max_blocks = _check_flags(strategy, pipeline, verify, instruments,
                                                                       max_compute_blocks)
    prog = _mask_program(mask)
    if strategy == "auto" and pipeline is None:
        return _compile_auto(dict(opts, seqlens=lens, q_lens=q_lens, segments=segments, mask=prog, verify=verify,
                                  instruments=instruments, max_compute_blocks=max_blocks))
    from ..frontend.lower import lower_heads
    from ..passes import parse_pipeline, run_pipeline
    from ..passes.comm import parse_entry

    named = pipeline is None
    if named:
        entry = parse_entry(strategy)  # NAME{...}:VARIANT overlap{local=...}: recorded in its canonical text
        pipeline, strategy = default_pipeline(entry.strategy, opts["block_size"], entry.comm, entry.local), entry.text
    passes = parse_pipeline(pipeline)
    pieces, ptr, classes = lower_heads(prog, lens.tolist(), segments, q_lens, opts["heads"])
    problem = Problem(seqlens=lens, heads=opts["heads"], kv_heads=opts["kv_heads"], head_dim=opts["head_dim"],
                      pieces=pieces, mask=prog.source, segments=segments, dtype=opts["dtype"], q_lens=q_lens,
                      head_class=classes, class_ptr=ptr, partials_dtype=opts["partials_dtype"],
                      keep_kv=opts["keep_kv"])
    ir = run_pipeline(PlanIR(problem, opts["devices"], opts["nodes"], opts["memory_cap"]), passes,
                      verify_each=verify, instruments=instruments, max_compute_blocks=max_blocks)
    if ir.program is None:
        raise PlanError(f"pipeline {pipeline!r} does not end in a program; add 'emit'")
    from ..passes.tile import Tile
    block = next((p.block for p in passes if isinstance(p, Tile)), opts["block_size"])  # a pipeline's own tile
    meta = {"pipeline": ",".join(p.spec() for p in passes), "strategy": strategy if named else "",
            "block_size": block, "profile": opts["profile"]}
    from ..backends.cost import get_profile
    return Plan(ir, meta, {"plan_s": time.perf_counter() - t0}, get_profile(opts["profile"]))


def _mask_program(mask):
    """``mask`` parsed: a builtin name or expression, a ``.mask`` path, or a ``MaskProgram``."""
    from ..frontend import MaskProgram, load_mask
    if isinstance(mask, MaskProgram):
        return mask
    if isinstance(mask, os.PathLike):
        mask = os.fspath(mask)
    if not isinstance(mask, str):
        raise PlanError(f"mask must be a builtin name, a mask expression, a .mask path or a MaskProgram, "
                        f"got {_show(mask)}")
    return load_mask(mask)


def _compile_auto(kwargs: dict) -> Plan:
    """``strategy="auto"``: bound every strategy's placement, compile and simulate them best bound
    first while one can still win, keep the lowest predicted time (see :mod:`attnplan.tools.auto`)."""
    from .auto import compile_auto
    return compile_auto(kwargs)


def attention(q, k, v, plan: Plan, group=None, *, softmax_scale: float | None = None, timeout: float | None = None,
              timings=None, match: str | None = None):
    """This rank's attention under ``plan``, for a training step: ``q [T_local,
    Hq, D]``, ``k``/``v [T_local, Hkv, D]`` in the plan's local layout
    (``plan.dispatch``); returns the local output. Autograd-aware: the
    backward issues the plan's backward transfers in the plan's order on every
    rank. Device ``d`` is rank ``d`` of ``group`` (default: the default group).
    ``timeout``: seconds before a stuck transfer raises ``TransportError``
    naming the peer and transfer. ``match``: ``"tag"`` (default) or
    ``"order"`` — every message with one tag, matched by posting order alone
    as NCCL matches them (default ``$ATTNPLAN_MATCH``)."""
    from ..runtime.dist import attention as _attention
    _check_plan(plan)
    timeout = None if timeout is None else positive_real("timeout", timeout, limits.MAX_TIMEOUT_S)
    return _attention(q, k, v, plan.ir, group, softmax_scale=softmax_scale, timeout=timeout, timings=timings,
                      match=match)


def execute(plan: Plan, q, k, v, softmax_scale: float | None = None):
    """Run ``plan`` on global ``q [T, Hq, D]``, ``k``/``v [T, Hkv, D]`` in this
    process (every device's program, in-memory transport). Differentiable."""
    from ..runtime.executor import execute as _execute
    _check_plan(plan)
    return _execute(plan.ir, q, k, v, softmax_scale)


def _check_plan(plan) -> None:
    if not isinstance(plan, Plan):
        raise PlanError(f"plan must be an attnplan.Plan (from attnplan.compile or attnplan.load), got {_show(plan)}")


def positive_real(name: str, v, limit: float | None = None) -> float:
    """``v`` as a float in ``(0, limit]``: finite, not a bool (PlanError otherwise)."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise PlanError(f"{name} must be a positive number, got {_show(v)}")
    x = float(v) if not isinstance(v, int) or abs(v).bit_length() <= 64 else math.inf
    if not (math.isfinite(x) and x > 0):
        raise PlanError(f"{name} must be a positive finite number, got {_show(v) if isinstance(v, int) else x!r}")
    if limit is not None and x > limit:
        raise PlanError(f"{name} = {x:g} is over attnplan's limit of {limit:g} (ir/limits.py)")
    return x
