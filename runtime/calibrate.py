"""``plan calibrate``: measure this machine's attention kernel and gloo
transfer rates and write a cost profile (JSON) that ``--profile FILE.json``
uses. Medians of repeats; timings on shared machines vary (docs/DESIGN.md)."""

from __future__ import annotations

import json
import os
import queue
import socket
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from ..backends.cost import PROFILES
from ..errors import PlanError, TransportError
from ..ir import limits

TRANSFER_TIMEOUT_S = 120.0  # the two-process ping-pong; it takes a few seconds


def _median_time(fn, repeats: int) -> float:
    fn()  # warm up
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def kernel_rate(seq: int = 2048, heads: int = 8, dim: int = 64, repeats: int = 5) -> tuple[float, float]:
    """(FLOP/s of a full bf16 tile on the CPU flash op, seconds of a tiny call)."""
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    q, k, v = (torch.randn(1, heads, seq, dim, dtype=torch.bfloat16) for _ in range(3))
    t = _median_time(lambda: op(q, k, v, 0.0, False, scale=dim ** -0.5), repeats)
    small = [torch.randn(1, 1, 16, dim, dtype=torch.bfloat16) for _ in range(3)]
    launch = _median_time(lambda: op(*small, 0.0, False, scale=dim ** -0.5), repeats * 20)
    return 4.0 * seq * seq * heads * dim / t, launch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pingpong(rank: int, port: int, sizes, repeats: int, out) -> None:
    import torch.distributed as dist

    from .rendezvous import init_group
    torch.set_num_threads(1)
    init_group(rank, 2, TRANSFER_TIMEOUT_S, "127.0.0.1", port)  # the store listens on 127.0.0.1 only
    res = {}
    for n in sizes:
        buf = torch.zeros(n // 4, dtype=torch.float32)
        ts = []
        for i in range(repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            if i:
                ts.append((time.perf_counter() - t0) / 2)
        res[n] = statistics.median(ts)
    if rank == 0:
        out.put(res)
    dist.destroy_process_group()


def transfer_rate(repeats: int = 5) -> tuple[float, float]:
    """(bytes/s, latency s) of gloo point-to-point between two local
    processes; TransportError if they do not report within TRANSFER_TIMEOUT_S."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    sizes = (4096, 16 << 20)
    procs = [ctx.Process(target=_pingpong, args=(r, port, sizes, repeats, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        res = q.get(timeout=TRANSFER_TIMEOUT_S)
    except queue.Empty:
        codes = [p.exitcode for p in procs]
        raise TransportError(f"calibrate: the gloo ping-pong between two local processes (port {port}) did not "
                             f"finish within {TRANSFER_TIMEOUT_S:g} s (exit codes {codes})") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    small, big = res[sizes[0]], res[sizes[1]]
    bw = (sizes[1] - sizes[0]) / max(big - small, 1e-9)
    return bw, small


def calibrate(repeats: int = 5) -> dict:
    """Kernel and transfer rates with one intra-op thread, as every process of
    the multi-process runtime runs (docs/DESIGN.md: set_num_threads(1) per worker).
    ``repeats``: 1..MAX_REPEATS (PlanError otherwise)."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or not 1 <= repeats <= limits.MAX_REPEATS:
        raise PlanError(f"repeats must be an integer in 1..{limits.MAX_REPEATS}, got {repeats!r}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        flops, launch = kernel_rate(repeats=repeats)
    finally:
        torch.set_num_threads(threads)
    bw, alpha = transfer_rate(repeats)
    prof = replace(PROFILES["cpu-local"], name="calibrated", peak_flops=flops, efficiency=1.0, launch_s=launch,
                   intra_bw=bw, inter_bw=bw, intra_alpha=alpha, inter_alpha=alpha)
    return asdict(prof) | {"threads": 1, "host": os.uname().nodename}


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
