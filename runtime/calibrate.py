"""``plan calibrate``: fit this machine's cost profile from measurements.

What is measured (one intra-op thread, as every process of the
multi-process runtime runs; docs/DESIGN.md), and what is fitted:

* **kernel**: the runtime's own tile kernels (:func:`runtime.kernels.attn_fwd`
  and :func:`~runtime.kernels.attn_bwd`, bfloat16) on a grid of tile shapes
  (rows x keys x heads, from 1-row tiles to 1024 x 1024 x 8 heads; full and
  causal pieces), timed in two processes at once (the runtime's two ranks
  share the machine's cores, caches and memory), on each thread's CPU clock
  (``time.thread_time``: other processes' load on this shared machine does
  not inflate it, where it doubles wall times), interleaved round-robin;
  medians of both processes' samples, each sample the mean of ~5 ms of
  calls. Fitted as the simulator charges a compute block:
  ``launch_s + 4 * head_dim * heads * rounded_pairs / rate``, where a piece's
  rows are rounded up to the kernel's ``tile_q`` (each candidate step of
  :data:`TILE_STEPS` is fitted; the smallest one within
  :data:`TILE_TOLERANCE` of the best residual is kept). Least squares on
  *relative* residuals (a 16-row tile counts as much as a 1024-row one);
  ``bwd_factor`` is the ratio of the summed backward times to the summed
  forward model (the backward's fixed cost is larger than the forward's, so
  no one factor fits every shape: the sums weigh the shapes where the time
  goes; the per-shape least-squares factor is reported beside it).
* **transfers**: a gloo ping-pong of tagged ``isend``/``irecv`` (what
  :class:`runtime.dist.TorchTransport` posts) between two local processes
  over message sizes from 256 B to 16 MiB (wall clock; per size the fastest
  sample, each sample the mean of ~20 ms of round trips: a loaded machine
  adds wake-up delays to a blocked receiver that are not the link's), fitted
  as ``alpha + bytes / bandwidth``. There is one machine, hence no inter-node link to measure:
  ``inter_alpha``/``inter_bw`` are set to the intra-node values (``fit.inter``
  says so).
* **merges**: :func:`runtime.kernels.merge_into` of partial outputs (CPU
  clock), fitted as ``3 * bytes / mem_bw`` (how the simulator charges a merge).

The profile therefore predicts the runtime on a machine whose cores are its
own: where other processes load it, measured wall times are longer (by
about the load over the number of cores).

The profile's ``peak_flops`` is the best rate seen on any shape and
``efficiency`` the fitted rate's share of it (``peak_flops * efficiency`` is
the fitted rate). Besides the profile's fields, the JSON has ``threads``,
``host`` and ``fit``: every fitted value with its residuals per shape and
size, for the reader (``backends.cost.INFO_KEYS``; not used to predict).

Time is bounded whatever ``repeats`` is: each kernel shape stops repeating
once it has used its share of :data:`KERNEL_BUDGET_S`, each message size its
share of :data:`TRANSFER_BUDGET_S`; the default run takes ~15-40 s here.
Timings on shared machines vary about 2x run to run (docs/DESIGN.md).
"""

from __future__ import annotations

import json
import math
import os
import queue
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ..backends.cost import PROFILES
from ..errors import PlanError, TransportError
from ..ir import limits

TRANSFER_TIMEOUT_S = 120.0  # the two-process ping-pong; it takes a few seconds
KERNEL_BUDGET_S = 30.0      # seconds of kernel timing in all (split evenly among the shapes)
TRANSFER_BUDGET_S = 8.0     # seconds of ping-pong in all (split evenly among the message sizes)
MERGE_BUDGET_S = 2.0
SAMPLE_S = 0.005            # one timing sample averages calls for about this long (kernels, merges)
TRANSFER_SAMPLE_S = 0.02    # ... and round trips for about this long (ping-pong)
MAX_INNER = 1000            # calls one sample averages at most
TILE_STEPS = (1, 8, 16, 32, 64, 128, 256)  # candidate row-rounding steps of the kernel (tile_q)
TILE_TOLERANCE = 0.05       # a larger step must lower the kernel's rms relative residual by more than this share
MAX_FIT_POINTS = 100_000    # points one fit accepts
MAX_SHAPE_ROWS = 8192       # rows and keys of one calibration shape
MAX_SHAPE_HEADS = 64
MAX_MESSAGE_BYTES = 1 << 28
HEAD_DIM = 64
KINDS = ("full", "causal")
_UNBOUNDED = 1 << 62


# ----------------------------------------------------------------------------------------------
# fits (pure functions of timings: tests/test_calibrate.py checks them on synthetic data)
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class AffineFit:
    """``seconds ≈ intercept + slope * x``, fitted on relative residuals
    (``residuals[i] = model_i / seconds_i - 1``)."""

    intercept: float
    slope: float
    residuals: tuple

    @property
    def rms(self) -> float:
        r = np.asarray(self.residuals)
        return float(np.sqrt(np.mean(r * r))) if len(r) else 0.0

    @property
    def worst(self) -> float:
        return float(np.max(np.abs(self.residuals))) if len(self.residuals) else 0.0


def _points(x, t, what: str, min_points: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """``x`` (work: >= 0) and ``t`` (seconds: > 0) as float arrays of one
    length in min_points..MAX_FIT_POINTS, every value finite; PlanError otherwise."""
    try:
        xa = np.asarray(x, dtype=float).reshape(-1)
        ta = np.asarray(t, dtype=float).reshape(-1)
    except (TypeError, ValueError, OverflowError) as e:
        raise PlanError(f"{what}: timings must be numbers ({e})") from None
    if len(xa) != len(ta):
        raise PlanError(f"{what}: {len(xa)} work values but {len(ta)} timings")
    if not min_points <= len(ta) <= MAX_FIT_POINTS:
        raise PlanError(f"{what}: needs {min_points}..{MAX_FIT_POINTS:,} points, got {len(ta)}")
    if not (np.isfinite(xa).all() and np.isfinite(ta).all()):
        raise PlanError(f"{what}: a work value or a timing is not finite")
    if (xa < 0).any() or (ta <= 0).any():
        raise PlanError(f"{what}: work must be >= 0 and every timing > 0")
    return xa, ta


def fit_affine(x, seconds, what: str = "fit") -> AffineFit:
    """Least squares ``seconds ≈ a + b * x`` on relative residuals, with ``a >= 0``
    and ``b > 0``: each point counts by its relative error, so that the
    intercept is set by the small points and the slope by the large ones.
    PlanError when the inputs are bad (:func:`_points`), fewer than two
    distinct ``x``, or the timings do not grow with ``x`` (no positive slope)."""
    xa, ta = _points(x, seconds, what)
    if np.unique(xa).size < 2:
        raise PlanError(f"{what}: needs at least two distinct work values to separate the fixed cost from the rate")
    scale = float(xa.max())
    A = np.stack([1.0 / ta, (xa / scale) / ta], axis=1)
    (a, b), *_ = np.linalg.lstsq(A, np.ones_like(ta), rcond=None)
    if a < 0 or not math.isfinite(a):  # the fixed cost is 0: refit the slope alone
        a = 0.0
        col = A[:, 1]
        b = float(col.sum() / (col * col).sum())
    if not b > 0 or not math.isfinite(b):
        raise PlanError(f"{what}: the timings do not grow with the work (fitted slope {b / scale:.3g}): "
                        f"no rate can be fitted")
    slope = b / scale
    return AffineFit(float(a), float(slope), tuple(((a + slope * xa) / ta - 1.0).tolist()))


def fit_ratio(model, seconds, what: str = "ratio fit") -> tuple[float, tuple]:
    """Least squares ``seconds ≈ r * model`` on relative residuals: (r, residuals)."""
    ma, ta = _points(model, seconds, what, min_points=1)
    if not (ma > 0).all():
        raise PlanError(f"{what}: every model value must be > 0")
    u = ma / ta
    r = float(u.sum() / (u * u).sum())
    return r, tuple((r * u - 1.0).tolist())


def causal_pairs(rows: int, keys: int) -> int:
    """Pairs of a top-left causal rows x keys piece (row i sees keys 0..i)."""
    m = min(rows, keys)
    return m * (m + 1) // 2 + (rows - m) * keys


def shape_pairs(rows: int, keys: int, kind: str) -> int:
    return rows * keys if kind == "full" else causal_pairs(rows, keys)


@dataclass(frozen=True, slots=True)
class KernelShape:
    """One calibration tile: ``rows`` queries x ``keys`` keys, ``heads`` query
    heads over ``kv_heads`` kv heads, a full or a (top-left) causal piece."""

    rows: int
    keys: int
    heads: int
    kv_heads: int
    kind: str = "full"

    def __post_init__(self):
        for name, hi in (("rows", MAX_SHAPE_ROWS), ("keys", MAX_SHAPE_ROWS), ("heads", MAX_SHAPE_HEADS),
                         ("kv_heads", MAX_SHAPE_HEADS)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 1 <= v <= hi:
                raise PlanError(f"calibration shape: {name} must be an integer in 1..{hi:,}, got {v!r}")
        if self.heads % self.kv_heads:
            raise PlanError(f"calibration shape: kv_heads {self.kv_heads} must divide heads {self.heads}")
        if self.kind not in KINDS:
            raise PlanError(f"calibration shape: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

    def pairs(self) -> int:
        return shape_pairs(self.rows, self.keys, self.kind)

    def work(self, tile_q: int, head_dim: int) -> float:
        """FLOPs the simulator charges this tile: 4 * head_dim * heads * pairs,
        the rows rounded up to ``tile_q`` (backends.cost.rounded_pairs)."""
        rounded = -(-self.rows // tile_q) * tile_q
        return 4.0 * head_dim * self.heads * self.pairs() * rounded / self.rows


def default_shapes() -> list[KernelShape]:
    """The grid ``plan calibrate`` times: rows (1 .. 1024) x keys (16, 128,
    1024), plus rows 40 and 100 against 1024 keys (odd row counts that tell
    rounding steps apart), each as a full and as a causal piece (plans hold
    about as much of each) and with 1/1 and 8/2 heads (the runtime
    benchmark's GQA): 68 shapes."""
    out = []
    for h, kv in ((1, 1), (8, 2)):
        for kind in KINDS:
            for rows in (1, 16, 64, 200, 1024):
                for keys in (16, 128, 1024):
                    out.append(KernelShape(rows, keys, h, kv, kind))
            out += [KernelShape(rows, 1024, h, kv, kind) for rows in (40, 100)]
    return out


@dataclass(frozen=True, slots=True)
class KernelFit:
    """The kernel model fitted on measured tiles (see :func:`fit_kernel`)."""

    tile_q: int
    fwd: AffineFit          # forward seconds vs rounded work: launch_s, 1 / rate
    bwd: AffineFit          # backward seconds vs rounded work, for the reader
    bwd_factor: float       # sum of backward seconds / sum of the forward model (how the simulator charges it)
    bwd_residuals: tuple    # of backward seconds against bwd_factor * forward model
    bwd_factor_ls: float    # the least-squares factor on relative residuals, for the reader
    candidates: dict        # tile step -> rms relative residual of the forward fit

    @property
    def launch_s(self) -> float:
        return self.fwd.intercept

    @property
    def rate(self) -> float:
        return 1.0 / self.fwd.slope


def fit_kernel(shapes, fwd_s, bwd_s, head_dim: int = HEAD_DIM, steps=TILE_STEPS,
               tolerance: float = TILE_TOLERANCE) -> KernelFit:
    """Fit ``launch + work / rate`` to forward seconds for every candidate
    row-rounding step in ``steps``; keep the smallest step whose rms relative
    residual is within a share ``tolerance`` of the best one; then the backward as
    its own affine fit and as a factor of the forward model."""
    shapes = list(shapes)
    if not all(isinstance(s, KernelShape) for s in shapes):
        raise PlanError("fit_kernel: shapes must be KernelShape values")
    _points([s.rows for s in shapes], fwd_s, "kernel fit (forward)")
    _points([s.rows for s in shapes], bwd_s, "kernel fit (backward)")
    steps = sorted({int(s) for s in steps})
    if not steps or steps[0] < 1 or steps[-1] > MAX_SHAPE_ROWS:
        raise PlanError(f"fit_kernel: tile steps must be integers in 1..{MAX_SHAPE_ROWS}, got {steps}")
    fits: dict[int, AffineFit] = {}
    for step in steps:
        try:
            fits[step] = fit_affine([s.work(step, head_dim) for s in shapes], fwd_s, f"kernel fit (tile {step})")
        except PlanError:
            continue  # this rounding makes the work flat: not a candidate
    if not fits:
        raise PlanError("kernel fit: the forward timings do not grow with the work for any tile step")
    best = min(f.rms for f in fits.values())
    tile = min(s for s, f in fits.items() if f.rms <= best * (1.0 + tolerance))
    fwd = fits[tile]
    model = [fwd.intercept + fwd.slope * s.work(tile, head_dim) for s in shapes]
    factor_ls, _ = fit_ratio(model, bwd_s, "kernel fit (backward factor)")
    factor = float(np.sum(bwd_s)) / float(np.sum(model))
    bres = tuple((factor * np.asarray(model) / np.asarray(bwd_s, float) - 1.0).tolist())
    bwd = fit_affine([s.work(tile, head_dim) for s in shapes], bwd_s, "kernel fit (backward)")
    return KernelFit(tile, fwd, bwd, factor, bres, factor_ls, {s: f.rms for s, f in fits.items()})


# The simulator charges a compute block ``launch + pairs / rate``. The CPU op's
# cost per call has more terms (measured: a backward of 1024 rows x 16 keys
# costs as much as 200 x 1024; a causal call costs about its whole rectangle
# forward): the per-call model below is fitted for the reader and for
# benchmarks/cost_validation.py, which predicts each plan's compute with it.
CALL_TERMS = ("call_s", "row_head_s", "key_head_s", "pair_flop_s", "masked_flop_s")


def call_features(rows: int, keys: int, heads: int, pairs: int, head_dim: int = HEAD_DIM) -> list[float]:
    """The per-call model's regressors of one op call: 1, rows x heads,
    keys x heads, FLOPs of the allowed pairs, FLOPs of the masked pairs of
    its rectangle (what a causal call computes or skips)."""
    flop = 4.0 * head_dim * heads
    return [1.0, float(rows * heads), float(keys * heads), flop * pairs, flop * (rows * keys - pairs)]


def fit_call_model(features, seconds, what: str = "per-call fit") -> tuple[tuple, tuple]:
    """Non-negative least squares of ``seconds ≈ features @ c`` on relative
    residuals: (coefficients in CALL_TERMS order, residuals)."""
    from scipy.optimize import nnls
    try:
        F = np.asarray(features, dtype=float)
    except (TypeError, ValueError, OverflowError) as e:
        raise PlanError(f"{what}: features must be numbers ({e})") from None
    _, ta = _points(np.zeros(len(F)), seconds, what, min_points=len(CALL_TERMS))
    if F.shape != (len(ta), len(CALL_TERMS)) or not np.isfinite(F).all() or (F < 0).any():
        raise PlanError(f"{what}: features must be finite, >= 0 and of shape [{len(ta)}, {len(CALL_TERMS)}]")
    scale = np.maximum(F.max(axis=0), 1e-300)
    c, _ = nnls((F / scale) / ta[:, None], np.ones_like(ta))
    coef = c / scale
    return tuple(coef.tolist()), tuple((F @ coef / ta - 1.0).tolist())


def call_seconds(coef, rows: int, keys: int, heads: int, pairs: int, head_dim: int = HEAD_DIM) -> float:
    """The per-call model's seconds of one op call."""
    return float(np.dot(coef, call_features(rows, keys, heads, pairs, head_dim)))


def fit_transfer(nbytes, seconds) -> AffineFit:
    """``alpha + bytes / bandwidth``: intercept = alpha, slope = 1 / bandwidth."""
    return fit_affine(nbytes, seconds, "transfer fit")


def fit_merge(nbytes, seconds) -> tuple[float, tuple]:
    """``mem_bw`` such that a merge of ``bytes`` takes ``3 * bytes / mem_bw``; (mem_bw, residuals)."""
    xa, ta = _points(nbytes, seconds, "merge fit", min_points=1)
    if not (xa > 0).all():
        raise PlanError("merge fit: every merge must move > 0 bytes")
    inv, res = fit_ratio(3.0 * xa, ta, "merge fit")
    return 1.0 / inv, res


# ----------------------------------------------------------------------------------------------
# measurements
# ----------------------------------------------------------------------------------------------

def _samples(fns, repeats: int, budget_s: float, sample_s: float = SAMPLE_S,
             clock=time.thread_time) -> list[list[float]]:
    """Seconds per call of each of ``fns`` on ``clock`` (default: this thread's
    CPU time, which other processes' load does not inflate): a warm-up call
    each sets how many calls one sample averages (about ``sample_s`` of wall
    time, at most :data:`MAX_INNER`); then up to ``repeats`` samples of each,
    taken round-robin (drift hits every one alike). A function stops once it
    has used ``budget_s / len(fns)`` of wall time."""
    share = budget_s / max(1, len(fns))
    times: list[list[float]] = [[] for _ in fns]
    spent = [0.0] * len(fns)
    inner = []
    for f in fns:
        w0 = time.perf_counter()
        f()
        inner.append(min(MAX_INNER, max(1, int(sample_s / max(time.perf_counter() - w0, 1e-7)))))
    for _ in range(repeats):
        live = [i for i in range(len(fns)) if not times[i] or spent[i] < share]
        if not live:
            break
        for i in live:
            f, n = fns[i], inner[i]
            w0, t0 = time.perf_counter(), clock()
            for _ in range(n):
                f()
            times[i].append((clock() - t0) / n)
            spent[i] += time.perf_counter() - w0
    return times


def _round_robin(fns, repeats: int, budget_s: float, clock=time.thread_time) -> list[float]:
    """Median seconds of each of ``fns`` (:func:`_samples`)."""
    return [statistics.median(t) for t in _samples(fns, repeats, budget_s, clock=clock)]


def _kernel_calls(shapes, head_dim: int) -> list:
    """Per shape a forward call, then per shape a backward call, of the runtime's
    ``attn_fwd`` / ``attn_bwd`` on seeded bfloat16 tiles."""
    from .kernels import attn_bwd, attn_fwd
    gen = torch.Generator().manual_seed(0)
    scale = head_dim ** -0.5
    fwd, bwd = [], []
    for s in shapes:
        q = torch.randn(s.rows, s.heads, head_dim, generator=gen).to(torch.bfloat16)
        k, v = (torch.randn(s.keys, s.kv_heads, head_dim, generator=gen).to(torch.bfloat16) for _ in range(2))
        pieces = [[0, s.rows, 0, s.keys, -_UNBOUNDED, _UNBOUNDED if s.kind == "full" else 0]]
        out, lse = attn_fwd(q, k, v, 0, 0, pieces, scale)
        dout = torch.randn(s.rows, s.heads, head_dim, generator=gen).to(torch.bfloat16)
        fwd.append(lambda q=q, k=k, v=v, p=pieces: attn_fwd(q, k, v, 0, 0, p, scale))
        bwd.append(lambda q=q, k=k, v=v, o=out, d=dout, l=lse, p=pieces: attn_bwd(q, k, v, o, d, l, 0, 0, p, scale))
    return fwd + bwd


def measure_kernels(shapes, repeats: int = 5, head_dim: int = HEAD_DIM,
                    budget_s: float = KERNEL_BUDGET_S) -> tuple[list[float], list[float]]:
    """(forward seconds, backward seconds) per shape in this process (its
    current thread setting): medians of :func:`_kernel_calls`."""
    shapes = list(shapes)
    times = _round_robin(_kernel_calls(shapes, head_dim), repeats, budget_s)
    return times[:len(shapes)], times[len(shapes):]


MERGE_ROWS = (64, 256, 1024, 4096)
MERGE_HEADS = 8


def _merge_calls(rows, heads: int, head_dim: int) -> tuple[list, list[int]]:
    """Merges of a partial output of ``rows`` x ``heads`` into an accumulator
    and their bytes (fp32 out and lse: the O buffer's bytes, ir.program.buffer_bytes)."""
    from .kernels import merge_into
    gen = torch.Generator().manual_seed(1)
    fns, nbytes = [], []
    for r in rows:
        acc, o = (torch.randn(r, heads, head_dim, generator=gen) for _ in range(2))
        al, lo = (torch.randn(r, heads, generator=gen) for _ in range(2))
        fns.append(lambda acc=acc, al=al, o=o, lo=lo: merge_into(acc, al, o, lo))
        nbytes.append(r * heads * (4 * head_dim + 4))
    return fns, nbytes


def measure_merges(rows=MERGE_ROWS, heads: int = MERGE_HEADS, head_dim: int = HEAD_DIM, repeats: int = 5,
                   budget_s: float = MERGE_BUDGET_S) -> tuple[list[int], list[float]]:
    """(bytes, median seconds) of :func:`_merge_calls` in this process."""
    fns, nbytes = _merge_calls(rows, heads, head_dim)
    return nbytes, _round_robin(fns, repeats, budget_s)


def _calibration_rank(rank: int, port: int, spec: dict, out) -> None:
    """One of the two calibration processes (one intra-op thread each, as the
    runtime's): both time the kernels and merges of ``spec`` at the same time
    (the runtime's two ranks share this machine's cores and memory), then a
    ping-pong per message size: rank 0 times a warm-up round trip and
    broadcasts how many round trips a sample averages (about
    TRANSFER_SAMPLE_S of them) and how many samples fit in the size's budget;
    one-way seconds are half a round trip. Puts ``(rank, samples)`` on ``out``."""
    import torch.distributed as dist

    from .rendezvous import init_group
    torch.set_num_threads(1)
    init_group(rank, 2, TRANSFER_TIMEOUT_S, "127.0.0.1", port)  # the store listens on 127.0.0.1 only
    repeats, res = spec["repeats"], {}
    shapes = [KernelShape(*s) for s in spec["shapes"]]
    if shapes:
        dist.barrier()
        res["kernel"] = _samples(_kernel_calls(shapes, spec["head_dim"]), repeats, spec["kernel_budget_s"])
        fns, _ = _merge_calls(MERGE_ROWS, MERGE_HEADS, spec["head_dim"])
        res["merge"] = _samples(fns, repeats, MERGE_BUDGET_S)
    peer, sizes = 1 - rank, spec["sizes"]
    share = spec["transfer_budget_s"] / max(1, len(sizes))

    def round_trip(buf):
        if rank == 0:
            dist.isend(buf, peer, tag=7).wait()
            dist.irecv(buf, peer, tag=7).wait()
        else:
            dist.irecv(buf, peer, tag=7).wait()
            dist.isend(buf, peer, tag=7).wait()

    res["transfer"] = []
    for n in sizes:
        buf = torch.zeros(n, dtype=torch.uint8)
        dist.barrier()
        t0 = time.perf_counter()
        round_trip(buf)  # warm-up
        rt = max(time.perf_counter() - t0, 1e-6)
        inner = min(MAX_INNER, max(1, int(TRANSFER_SAMPLE_S / rt)))
        plan = torch.tensor([min(repeats, max(1, int(share / (rt * inner)))), inner])
        dist.broadcast(plan, 0)
        count, inner = int(plan[0]), int(plan[1])
        ts = []
        for _ in range(count):
            t0 = time.perf_counter()
            for _ in range(inner):
                round_trip(buf)
            ts.append((time.perf_counter() - t0) / (2 * inner))
        res["transfer"].append(ts)
    out.put((rank, res))
    dist.destroy_process_group()


DEFAULT_SIZES = (256, 4096, 65536, 262144, 1 << 20, 4 << 20, 16 << 20)


def _check_sizes(sizes) -> list[int]:
    try:
        out = [int(n) for n in sizes]
    except (TypeError, ValueError, OverflowError):
        raise PlanError("message sizes must be integers") from None
    if not 1 <= len(out) <= 1000 or any(not 1 <= n <= MAX_MESSAGE_BYTES for n in out):
        raise PlanError(f"message sizes must be 1..1000 values of 1..{MAX_MESSAGE_BYTES:,} bytes, got {out[:8]}")
    return out


def measure_on_two_processes(shapes, sizes=DEFAULT_SIZES, repeats: int = 5, head_dim: int = HEAD_DIM,
                             kernel_budget_s: float = KERNEL_BUDGET_S,
                             transfer_budget_s: float = TRANSFER_BUDGET_S) -> dict:
    """Kernels and merges timed on two local processes at once (samples of both
    pooled: medians per shape), then the gloo ping-pong between them.
    Returns ``fwd_s``, ``bwd_s`` (per shape), ``merge_bytes``, ``merge_s``,
    ``sizes``, ``transfer_s``; TransportError if the processes do not report
    within TRANSFER_TIMEOUT_S + the budgets."""
    import torch.multiprocessing as mp

    from .rendezvous import free_port
    shapes, sizes = list(shapes), _check_sizes(sizes)
    spec = {"shapes": [(s.rows, s.keys, s.heads, s.kv_heads, s.kind) for s in shapes], "sizes": sizes,
            "repeats": repeats, "head_dim": head_dim, "kernel_budget_s": kernel_budget_s,
            "transfer_budget_s": transfer_budget_s}
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_calibration_rank, args=(r, port, spec, q)) for r in range(2)]
    wait_s = TRANSFER_TIMEOUT_S + 2 * (kernel_budget_s + MERGE_BUDGET_S + transfer_budget_s)
    for p in procs:
        p.start()
    got: dict = {}
    deadline = time.monotonic() + wait_s
    try:
        while len(got) < 2 and time.monotonic() < deadline:
            try:
                r, res = q.get(timeout=0.2)
                got[r] = res
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and q.empty():
                    break  # a process ended without reporting
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    if len(got) < 2:
        codes = [p.exitcode for p in procs]
        raise TransportError(f"calibrate: the two local calibration processes (gloo, port {port}) did not both "
                             f"report within {wait_s:g} s (exit codes {codes})")
    # the fastest sample per size: a sample already averages ~20 ms of round trips, and the slower ones
    # carry the wake-up delays other processes' load adds to a blocked receiver, not the link's cost
    out = {"sizes": sizes, "transfer_s": [min(t) for t in got[0]["transfer"]]}
    if shapes:
        pooled = [statistics.median(a + b) for a, b in zip(got[0]["kernel"], got[1]["kernel"])]
        out["fwd_s"], out["bwd_s"] = pooled[:len(shapes)], pooled[len(shapes):]
        out["merge_s"] = [statistics.median(a + b) for a, b in zip(got[0]["merge"], got[1]["merge"])]
        out["merge_bytes"] = [r * MERGE_HEADS * (4 * head_dim + 4) for r in MERGE_ROWS]
    return out


def measure_transfers(sizes=DEFAULT_SIZES, repeats: int = 5,
                      budget_s: float = TRANSFER_BUDGET_S) -> tuple[list[int], list[float]]:
    """(bytes, one-way seconds) of gloo point-to-point between two local
    processes (one thread each)."""
    sizes = _check_sizes(sizes)
    m = measure_on_two_processes([], sizes, repeats, transfer_budget_s=budget_s)
    return m["sizes"], m["transfer_s"]


# ----------------------------------------------------------------------------------------------
# the profile
# ----------------------------------------------------------------------------------------------

def _r(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def _rms(res) -> float:
    return float(np.sqrt(np.mean(np.square(res)))) if len(res) else 0.0


def build_profile(shapes, fwd_s, bwd_s, sizes, xfer_s, merge_bytes, merge_s, head_dim: int = HEAD_DIM,
                  name: str = "calibrated") -> dict:
    """The profile (a dict of the Profile's fields, ``threads``, ``host`` and
    ``fit``) from measured timings: :func:`fit_kernel`, :func:`fit_transfer`,
    :func:`fit_merge`. Checked by ``backends.cost.Profile`` before it is returned."""
    from ..backends.cost import profile_from_dict
    shapes = list(shapes)
    k = fit_kernel(shapes, fwd_s, bwd_s, head_dim)
    x = fit_transfer(sizes, xfer_s)
    mem_bw, mres = fit_merge(merge_bytes, merge_s)
    best = max(4.0 * head_dim * s.heads * s.pairs() / t for s, t in zip(shapes, fwd_s))
    peak = max(best, k.rate)
    bw = 1.0 / x.slope
    alpha, alpha_from = x.intercept, "fit"
    if alpha <= 0:  # the fit clamped it: a message costs at least what the smallest one took
        i = int(np.argmin(sizes))
        alpha, alpha_from = float(xfer_s[i]), f"the smallest message ({int(sizes[i])} bytes): the fit gave 0"
    prof = replace(PROFILES["cpu-local"], name=name, peak_flops=peak, efficiency=k.rate / peak,
                   launch_s=k.launch_s, tile_q=k.tile_q, intra_bw=bw, inter_bw=bw, intra_alpha=alpha,
                   inter_alpha=alpha, mem_bw=mem_bw, bwd_factor=k.bwd_factor)
    feats = [call_features(s.rows, s.keys, s.heads, s.pairs(), head_dim) for s in shapes]
    cf, cfr = fit_call_model(feats, fwd_s, "per-call fit (forward)")
    cb, cbr = fit_call_model(feats, bwd_s, "per-call fit (backward)")
    by_kind = {kind: _r(float(np.median([r for s, r in zip(shapes, k.fwd.residuals) if s.kind == kind])), 3)
               for kind in KINDS if any(s.kind == kind for s in shapes)}
    fit = {
        "kernel": {
            "model": "launch_s + 4*head_dim*heads*pairs(rows rounded up to tile_q) / (peak_flops*efficiency); "
                     "backward = bwd_factor * forward",
            "measured": "runtime.kernels attn_fwd/attn_bwd, 2 processes x 1 thread at once, thread CPU time, "
                        "medians",
            "dtype": "bfloat16", "head_dim": head_dim, "rate_flops": _r(k.rate), "launch_s": _r(k.launch_s),
            "tile_q": k.tile_q, "tile_q_rms": {str(s): _r(v, 3) for s, v in k.candidates.items()},
            "rms_rel_residual": _r(k.fwd.rms, 3), "max_rel_residual": _r(k.fwd.worst, 3),
            "median_rel_residual_by_kind": by_kind,
            "bwd_factor": _r(k.bwd_factor), "bwd_factor_least_squares": _r(k.bwd_factor_ls),
            "bwd_rms_rel_residual": _r(float(np.sqrt(np.mean(np.square(
                k.bwd_residuals)))), 3),
            "bwd_alone": {"launch_s": _r(k.bwd.intercept), "rate_flops": _r(1.0 / k.bwd.slope),
                          "rms_rel_residual": _r(k.bwd.rms, 3)},
            "per_call": {
                "note": "not used by the simulator: seconds of one op call = sum of terms x features "
                        "(runtime.calibrate.call_features); benchmarks/cost_validation.py predicts with it",
                "terms": list(CALL_TERMS), "fwd": [float(f"{c:.4g}") for c in cf],
                "bwd": [float(f"{c:.4g}") for c in cb], "fwd_rms_rel_residual": _r(_rms(cfr), 3),
                "bwd_rms_rel_residual": _r(_rms(cbr), 3)},
            "points": [[s.rows, s.keys, s.heads, s.kv_heads, s.kind, _r(tf), _r(tb), _r(rf, 3), _r(rb, 3)]
                       for s, tf, tb, rf, rb in zip(shapes, fwd_s, bwd_s, k.fwd.residuals, k.bwd_residuals)],
            "point_columns": ["rows", "keys", "heads", "kv_heads", "kind", "fwd_s", "bwd_s", "fwd_rel_residual",
                              "bwd_rel_residual"],
        },
        "transfer": {
            "model": "alpha + bytes / bw (gloo isend/irecv ping-pong, one-way = round trip / 2, fastest sample)",
            "alpha_s": _r(alpha), "alpha_from": alpha_from, "bw_bytes_per_s": _r(bw), "rms_rel_residual": _r(x.rms, 3),
            "max_rel_residual": _r(x.worst, 3),
            "points": [[int(n), _r(t), _r(r, 3)] for n, t, r in zip(sizes, xfer_s, x.residuals)],
            "point_columns": ["bytes", "seconds", "rel_residual"],
        },
        "merge": {"model": "3 * bytes / mem_bw (thread CPU time)", "mem_bw": _r(mem_bw),
                  "points": [[int(n), _r(t), _r(r, 3)] for n, t, r in zip(merge_bytes, merge_s, mres)]},
        "inter": "one machine: no inter-node link was measured; inter_alpha and inter_bw are the intra-node values",
    }
    out = asdict(prof) | {"threads": 1, "host": os.uname().nodename, "fit": fit}
    profile_from_dict(out, "calibrate")  # the Profile's own checks, before anything is written
    return out


def calibrate(repeats: int = 5, *, shapes=None, sizes=DEFAULT_SIZES, head_dim: int = HEAD_DIM) -> dict:
    """Measure and fit this machine's profile (see the module doc) with one
    intra-op thread, as every process of the multi-process runtime runs.
    ``repeats``: 1..MAX_REPEATS (PlanError otherwise); the time spent is
    bounded by the budgets whatever ``repeats`` is."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or not 1 <= repeats <= limits.MAX_REPEATS:
        raise PlanError(f"repeats must be an integer in 1..{limits.MAX_REPEATS}, got {repeats!r}")
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or not 1 <= head_dim <= limits.MAX_HEAD_DIM:
        raise PlanError(f"head_dim must be an integer in 1..{limits.MAX_HEAD_DIM}, got {head_dim!r}")
    shapes = default_shapes() if shapes is None else list(shapes)
    if not 2 <= len(shapes) <= 1000 or not all(isinstance(s, KernelShape) for s in shapes):
        raise PlanError("calibrate: shapes must be 2..1000 KernelShape values")
    t0 = time.perf_counter()
    m = measure_on_two_processes(shapes, sizes, repeats, head_dim)
    prof = build_profile(shapes, m["fwd_s"], m["bwd_s"], m["sizes"], m["transfer_s"], m["merge_bytes"], m["merge_s"],
                         head_dim)
    prof["fit"]["seconds"] = round(time.perf_counter() - t0, 1)
    return prof


def write_profile(path: str, repeats: int = 5) -> dict:
    """Measure and write the profile to ``path``, whose folder is checked
    before measuring (PlanError naming the path)."""
    folder = Path(path).parent
    if Path(path).is_dir() or not folder.is_dir():
        raise PlanError(f"{path}: cannot write cost profile: "
                        f"{'it is a directory' if Path(path).is_dir() else f'folder {folder} does not exist'}")
    prof = calibrate(repeats)
    try:
        Path(path).write_text(json.dumps(prof, indent=1) + "\n")
    except OSError as e:
        raise PlanError(f"{path}: cannot write cost profile: {e.strerror or e}") from None
    return prof
