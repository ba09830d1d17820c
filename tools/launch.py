"""``plan run PLAN --procs N``: run a plan on N local processes, one per device.

Two modes, one code path:

* **rank mode** — the environment has ``RANK`` and ``WORLD_SIZE`` (set by
  ``torchrun``, or by the launcher below): this process is device ``RANK``.
  It checks the plan fits the world size (before any communication), joins
  the gloo group (:func:`attnplan.runtime.rendezvous.init_group`:
  ``MASTER_ADDR``/``MASTER_PORT``),
  builds the same seeded random global inputs as every other rank, runs
  forward and backward on its own tokens through
  :func:`attnplan.runtime.dist.attention`, gathers out, dq, dk, dv on every
  rank (``undispatch``) and, on rank 0, prints the timings or (``--check``)
  the errors against dense attention.
* **launcher** — ``--procs N`` without ``RANK``: starts N copies of the same
  ``plan run`` command in rank mode (``MASTER_ADDR=127.0.0.1``, the
  rendezvous socket already bound and handed to rank 0, one intra-op thread
  each), waits for all, prints rank 0's report, and turns failures into one
  line: the root cause (a crashed rank, or the first error that is not a
  consequence of a peer's death), exit 2; a failed check exits 1.

The rendezvous store listens on ``MASTER_ADDR`` only (not every interface),
and joining is bounded by the timeout: no ``MASTER_PORT``, a port in use, a
rank that never joins and a port held by a program that is not a store each
give one :class:`~attnplan.errors.TransportError` or
:class:`~attnplan.errors.PlanError` within the timeout
(:mod:`attnplan.runtime.rendezvous`).

This module imports torch only in rank mode.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

from ..errors import PlanError
from ..runtime.rendezvous import STORE_FD, check_timeout, free_port, init_group, int_env

CONSEQUENCE = ("died or closed its connection", "not every rank joined")
GRACE_S = 3.0                   # how long the launcher lets the other ranks end after one failed


def in_rank_mode() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


# ---------------------------------------------------------------- rank mode

def run_rank(plan_path: str, dtype: str = "float32", seed: int = 0, check: bool = False,
             timeout: float = 300.0, out=sys.stdout, match: str | None = None) -> int:
    """Rank mode (see the module docstring). Returns the exit code.
    ``match``: how messages are matched (``runtime.dist.resolve_match``)."""
    from .compiler import load
    from ..runtime.check import DTYPES, check_size

    timeout = check_timeout(timeout)
    rank, world = int_env("RANK"), int_env("WORLD_SIZE", 1)
    plan = load(plan_path)
    if world != plan.devices:
        raise PlanError(f"{plan_path} was compiled for {plan.devices} devices but WORLD_SIZE is {world}")
    if not 0 <= rank < world:
        raise PlanError(f"RANK {rank} is outside 0..{world - 1}")
    if dtype not in DTYPES:
        raise PlanError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if check:
        check_size(plan)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("ATTNPLAN_THREADS", "1")))
    init_group(rank, world, timeout)
    try:
        return _run_joined(plan, rank, world, dtype, seed, check, timeout, out, match)
    finally:
        dist.destroy_process_group()


def _run_joined(plan, rank: int, world: int, dtype: str, seed: int, check: bool, timeout: float, out,
                match: str | None = None) -> int:
    import torch
    import torch.distributed as dist

    from ..runtime import dist as rt
    from ..runtime.check import compare, random_inputs
    from ..runtime.runner import Timings

    q, k, v, dout = random_inputs(plan, dtype, seed)
    sq, sk = ("q", "k") if plan.ir.problem.is_cross else (None, None)  # cross-attention: two token axes
    ql, kl, vl = (plan.dispatch(t, rank, side=s).requires_grad_(True) for t, s in ((q, sq), (k, sk), (v, sk)))
    rt.handshake(plan.ir, rt.resolve_group(plan.ir), ql, kl, timeout)  # every rank arrived: time the run alone
    import torch.fx.experimental.symbolic_shapes  # noqa: F401  (autograd.grad imports it lazily: ~1 s once)
    tm = Timings()
    t0 = time.perf_counter()
    ol = rt.attention(ql, kl, vl, plan.ir, timeout=timeout, timings=tm, match=match)
    grads = torch.autograd.grad(ol, (ql, kl, vl), plan.dispatch(dout, rank, side=sq))
    wall = time.perf_counter() - t0
    got = [plan.undispatch(x.detach(), timeout=timeout, side=s) for x, s in zip((ol, *grads), (sq, sq, sk, sk))]
    walls = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(walls, torch.tensor([wall], dtype=torch.float64))
    slowest = max(float(w) for w in walls)
    code = 0
    if rank == 0:
        where = f"{plan.devices} devices on {world} processes (gloo), {plan.problem.tokens} tokens, {dtype}"
        if not check:
            print(f"ran {where}: forward+backward {slowest:.3f} s (slowest rank; rank 0: kernels "
                  f"{tm.kernel:.3f} s, waiting {tm.wait:.3f} s)", file=out)
        else:
            torch.set_num_threads(os.cpu_count() or 1)  # the other ranks are done: the reference takes every core
            r = compare(plan, dtype, got, (q, k, v, dout))
            for name in ("out", "dq", "dk", "dv"):
                print(f"{name:>4}: max abs error {r[name]:.3e} (tolerance {r['tol'][name]:.1e})", file=out)
            print(f"{'PASS' if r['ok'] else 'FAIL'}: {where}, forward+backward {slowest:.3f} s", file=out)
            code = 0 if r["ok"] else 1
    out.flush()
    return code


# ---------------------------------------------------------------- launcher

def _root_cause(results) -> str:
    """One line naming the failure that caused the others. ``results``: per
    rank ``(rank, exit code, last error line, stdout)``; exit code ``None``
    for a rank the launcher stopped after another one failed."""
    crashed = [(r, rc, err) for r, rc, err, _ in results if rc is not None and rc not in (0, 1, 2)]
    if crashed:
        r, rc, err = crashed[0]
        how = f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
        return f"rank {r} {how}" + (f": {err}" if err else "")
    errs = [(r, err) for r, rc, err, _ in results if rc == 2 and err]
    root = [(r, e) for r, e in errs if not any(c in e for c in CONSEQUENCE)] or errs
    if root:
        return root[0][1]
    failed = [(r, err) for r, rc, err, out in results if rc == 1 and "FAIL:" not in out]
    if failed:
        r, err = failed[0]
        return f"rank {r} failed" + (f": {err}" if err else "")
    stopped = [r for r, rc, _, _ in results if rc is None]
    if stopped:
        return f"rank {stopped[0]} did not finish (stopped by the launcher)"
    return "a rank failed without a message"


def _last_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("plan: error: "):
            return ln[len("plan: error: "):]
    return lines[-1] if lines else ""


def _rendezvous_socket() -> socket.socket:
    """The store's listening socket, bound to 127.0.0.1 here and inherited by
    rank 0 (no window in which another program could take the port)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1024)
    s.set_inheritable(True)
    return s


def _wait_all(children, grace: float) -> list:
    """Wait for every child; once one failed, give the others ``grace``
    seconds, then stop them. Returns exit codes (``None``: stopped here)."""
    first_fail, stopped = None, set()
    while True:
        codes = [p.poll() for p, _, _ in children]
        if all(c is not None for c in codes):
            return [None if i in stopped else c for i, c in enumerate(codes)]
        if first_fail is None and any(c not in (None, 0) for c in codes):
            first_fail = time.monotonic()
        if first_fail is not None and time.monotonic() - first_fail > grace:
            for i, (p, _, _) in enumerate(children):
                if p.poll() is None:
                    stopped.add(i)
                    p.kill()
        time.sleep(0.02)


def launch(argv: list[str], procs: int, grace: float = GRACE_S) -> int:
    """Start ``procs`` copies of ``plan run ARGV`` in rank mode; see the module docstring."""
    if isinstance(procs, bool) or not isinstance(procs, int) or procs <= 0:
        raise PlanError(f"--procs must be a positive integer, got {procs!r}")
    sock = _rendezvous_socket()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]), WORLD_SIZE=str(procs),
               LOCAL_WORLD_SIZE=str(procs), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop(STORE_FD, None)
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    env.setdefault("ATTNPLAN_THREADS", "1")
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # torch's rendezvous retries and waits are not errors
    with tempfile.TemporaryDirectory(prefix="attnplan-run-") as tmp:
        children = []
        try:
            for r in range(procs):
                fo = open(os.path.join(tmp, f"{r}.out"), "w+")
                fe = open(os.path.join(tmp, f"{r}.err"), "w+")
                extra = {STORE_FD: str(sock.fileno())} if r == 0 else {}
                p = subprocess.Popen([sys.executable, "-m", "attnplan.cli", "run", *argv],
                                     env=dict(env, RANK=str(r), LOCAL_RANK=str(r), **extra), stdout=fo, stderr=fe,
                                     pass_fds=(sock.fileno(),) if r == 0 else ())
                children.append((p, fo, fe))
        finally:
            sock.close()  # rank 0 holds its own copy
        codes = _wait_all(children, grace)
        results = []
        for r, ((_, fo, fe), rc) in enumerate(zip(children, codes)):
            fo.seek(0)
            fe.seek(0)
            o, e = fo.read(), fe.read()
            fo.close()
            fe.close()
            results.append((r, rc, _last_error(e), o))
    sys.stdout.write(results[0][3])
    sys.stdout.flush()
    if all(rc == 0 for _, rc, _, _ in results):
        return 0
    if all(rc in (0, 1) for _, rc, _, _ in results) and "FAIL:" in results[0][3]:
        return 1
    raise PlanError(_root_cause(results))


# ---------------------------------------------------------------- a Python function on N local ranks
# (tests, benchmarks, examples)

def _load_target(target: str):
    import importlib
    import importlib.util
    where, _, name = target.rpartition(":")
    if not where or not name:
        raise PlanError(f"target must be 'module:function' or 'path/file.py:function', got {target!r}")
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(f"_attnplan_target_{abs(hash(where))}", where)
        if spec is None or spec.loader is None:
            raise PlanError(f"target {target!r}: cannot load {where}")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    else:
        mod = importlib.import_module(where)
    return getattr(mod, name)


def _bootstrap(target: str, rank: int, world: int, port: int, args: tuple, results, timeout: float) -> None:
    import traceback

    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.environ.pop(STORE_FD, None)
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    torch.set_num_threads(int(os.environ.get("ATTNPLAN_THREADS", "1")))
    res: tuple
    try:
        fn = _load_target(target)
        init_group(rank, world, timeout)
        res = ("ok", fn(rank, world, *args))
    except BaseException as e:  # report every failure to the parent, typed
        res = ("error", type(e).__name__, str(e), traceback.format_exc())
    results.put((rank, res))
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


def run_local(target: str, nprocs: int, args: tuple = (), timeout: float = 300.0) -> list:
    """Call ``fn(rank, world, *args)`` on ``nprocs`` fresh local processes joined
    in a gloo group (``MASTER_ADDR=127.0.0.1``, a free port, one intra-op
    thread each). ``target`` is ``"module:function"`` or
    ``"path/file.py:function"``. Returns, per rank, ``("ok", result)``,
    ``("error", type name, message, traceback)`` or ``("exit", code)`` for a
    process that ended without reporting; processes still running after
    ``timeout`` seconds are killed (``("exit", None)``)."""
    import multiprocessing
    import queue as queue_mod
    timeout = check_timeout(timeout)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_bootstrap, args=(target, r, nprocs, port, tuple(args), results, timeout),
                         daemon=False) for r in range(nprocs)]
    for p in procs:
        p.start()
    out: dict = {}
    deadline = time.monotonic() + timeout
    while len(out) < nprocs and time.monotonic() < deadline:
        try:
            r, res = results.get(timeout=0.1)
            out[r] = res
        except queue_mod.Empty:
            if all(not p.is_alive() for p in procs):
                try:
                    while True:
                        r, res = results.get(timeout=0.5)
                        out[r] = res
                except queue_mod.Empty:
                    break
    for p in procs:
        p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        if p.is_alive():
            p.kill()
            p.join()
    return [out.get(r, ("exit", procs[r].exitcode)) for r in range(nprocs)]
