"""``plan calibrate --device cuda``: a cost profile from this GPU's kernels.

What is measured, on the one GPU this process sees (CUDA events, medians):

* **kernel**: the runtime's own tile kernels on CUDA (:func:`runtime.varlen.tile_fwd`
  / :func:`~runtime.varlen.tile_bwd`, bfloat16, head_dim 128: flash-attn's
  varlen launch) on a grid of tile shapes from 128 x 128 to 8192 x 8192 with
  8/2 and 32/8 heads, full and causal; fitted exactly as the CPU calibration
  fits its tiles (:func:`runtime.calibrate.fit_kernel`: ``launch_s + work /
  rate``, rows rounded up to ``tile_q``, ``bwd_factor``);
* **merges**: :func:`runtime.kernels.merge_into` of partial outputs, fitted as
  ``3 * bytes / mem_bw``.

Links are not measured: one GPU has no NVLink or network peer, and NCCL needs
two processes on two GPUs. The link fields (``intra_bw``, ``inter_bw`` and
their latencies) are the ``base`` profile's (``h200`` by default), which the
JSON's ``fit.links`` says.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, replace
from functools import partial

import torch

from ..backends.cost import PROFILES, profile_from_dict
from ..errors import PlanError
from .calibrate import KernelShape, _r, fit_kernel, fit_merge

HEAD_DIM = 128
REPEATS = 5


def cuda_shapes() -> list[KernelShape]:
    """The GPU grid: rows x keys in 128 .. 8192, 8/2 and 32/8 heads, full and causal (40 shapes)."""
    out = []
    for h, kv in ((8, 2), (32, 8)):
        for kind in ("full", "causal"):
            for n in (128, 512, 2048, 4096, 8192):
                out.append(KernelShape(n, n, h, kv, kind))
            out += [KernelShape(n, 8192, h, kv, kind) for n in (1024, 3000)]
            out += [KernelShape(8192, 2048, h, kv, "full")] if kind == "full" else []
            out += [KernelShape(200, 8192, h, kv, kind)]
    return out


def event_seconds(fn, repeats: int = REPEATS) -> float:
    """Median seconds of ``fn()`` on the current CUDA stream (after one warm-up call)."""
    fn()
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return statistics.median(out)


def measure(shapes, repeats: int = REPEATS, head_dim: int = HEAD_DIM) -> dict:
    """Forward and backward seconds per shape, and merge (bytes, seconds), on the current CUDA device."""
    from .kernels import merge_into
    from .varlen import tile_bwd, tile_fwd
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    scale = head_dim ** -0.5
    fwd, bwd = [], []
    for s in shapes:
        q = torch.randn(s.rows, s.heads, head_dim, device=dev, generator=g, dtype=torch.bfloat16)
        k = torch.randn(s.keys, s.kv_heads, head_dim, device=dev, generator=g, dtype=torch.bfloat16)
        v = torch.randn(s.keys, s.kv_heads, head_dim, device=dev, generator=g, dtype=torch.bfloat16)
        pieces = [[0, s.rows, 0, s.keys, -(1 << 62), (1 << 62) if s.kind == "full" else 0]]
        out, lse = tile_fwd(q, k, v, 0, 0, pieces, scale, finite=True)
        dout = torch.randn_like(q)
        fwd.append(event_seconds(partial(tile_fwd, q, k, v, 0, 0, pieces, scale, finite=True), repeats))
        bwd.append(event_seconds(partial(tile_bwd, q, k, v, out, dout, lse, 0, 0, pieces, scale, finite=True),
                                 repeats))
    mb, ms = [], []
    for rows in (4096, 16384, 65536):
        acc, o = (torch.randn(rows, 32, head_dim, device=dev, generator=g) for _ in range(2))
        al, lo = (torch.randn(rows, 32, device=dev, generator=g) for _ in range(2))
        ms.append(event_seconds(partial(merge_into, acc, al, o, lo), repeats))
        mb.append(rows * 32 * (4 * head_dim + 4))
    return {"fwd_s": fwd, "bwd_s": bwd, "merge_bytes": mb, "merge_s": ms}


def build_cuda_profile(shapes, fwd_s, bwd_s, merge_bytes, merge_s, base: str = "h200",
                       head_dim: int = HEAD_DIM, name: str = "cuda-calibrated", device_name: str = "") -> dict:
    """The profile (a dict of the Profile's fields and ``fit``) from measured timings, the links from ``base``;
    a pure function of the timings (tests/test_calibrate.py checks it on synthetic ones)."""
    if base not in PROFILES:
        raise PlanError(f"calibrate --base must be a builtin profile ({', '.join(sorted(PROFILES))}), got {base!r}")
    shapes = list(shapes)
    k = fit_kernel(shapes, fwd_s, bwd_s, head_dim)
    mem_bw, mres = fit_merge(merge_bytes, merge_s)
    b = PROFILES[base]
    peak = max(b.peak_flops, k.rate)
    prof = replace(b, name=name, peak_flops=peak, efficiency=k.rate / peak, launch_s=k.launch_s, tile_q=k.tile_q,
                   mem_bw=mem_bw, bwd_factor=k.bwd_factor, fused=False)
    fit = {
        "kernel": {"model": "launch_s + 4*head_dim*heads*pairs(rows rounded up to tile_q) / (peak_flops*efficiency)",
                   "measured": f"runtime.varlen tile_fwd/tile_bwd on {device_name or 'CUDA'}, bfloat16, CUDA "
                               f"events, medians", "head_dim": head_dim, "rate_flops": _r(k.rate),
                   "launch_s": _r(k.launch_s), "tile_q": k.tile_q, "rms_rel_residual": _r(k.fwd.rms, 3),
                   "max_rel_residual": _r(k.fwd.worst, 3), "bwd_factor": _r(k.bwd_factor),
                   "points": [[s.rows, s.keys, s.heads, s.kv_heads, s.kind, _r(tf), _r(tb)]
                              for s, tf, tb in zip(shapes, fwd_s, bwd_s)]},
        "merge": {"model": "3 * bytes / mem_bw", "mem_bw": _r(mem_bw),
                  "points": [[int(n), _r(t), _r(r, 3)] for n, t, r in zip(merge_bytes, merge_s, mres)]},
        "links": f"not measured (one GPU): intra/inter bandwidth and latency are profile {base!r}'s",
    }
    out = asdict(prof) | {"threads": 1, "host": os.uname().nodename, "fit": fit}
    profile_from_dict(out, "calibrate")
    return out


def calibrate_cuda(repeats: int = REPEATS, base: str = "h200") -> dict:
    """Measure this GPU and fit its profile (module doc); PlanError without CUDA."""
    if not torch.cuda.is_available():
        raise PlanError("calibrate --device cuda: torch sees no CUDA device here")
    t0 = time.perf_counter()
    shapes = cuda_shapes()
    m = measure(shapes, repeats)
    prof = build_cuda_profile(shapes, m["fwd_s"], m["bwd_s"], m["merge_bytes"], m["merge_s"], base,
                              device_name=torch.cuda.get_device_name())
    prof["fit"]["seconds"] = round(time.perf_counter() - t0, 1)
    return prof
