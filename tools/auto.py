"""``auto``: rank the strategies by a cheap estimate of their placement, then
compile and simulate only the promising ones.

Compiling and simulating every strategy costs the sum of all of them (10–34 s
at 1M tokens, issue 9). Much of that is lowering (comm, emit, the verifier on
the program) and the event simulation, and the placement alone already bounds
what a strategy can reach: a placement whose busiest device has more work
than the best simulated plan's whole makespan cannot win.

1. **Place** every strategy: ``tile`` and the strategy pass of its default
   pipeline (:func:`attnplan.api.default_pipeline`), verified as in
   ``compile``. The mask is lowered once for all of them.
2. **Estimate** each placement (:func:`estimate`): per device and phase, its
   compute (:func:`attnplan.backends.cost.cb_seconds`: per-piece tile
   rounding, launch overhead, the dtype's rate; backward × ``bwd_factor``)
   and the time its send and its receive queue are busy with the transfers
   the placement needs (:func:`attnplan.ir.verify.needed_transfers`, or the
   ring of ``comm{mode=ring}``; ``bytes / bandwidth`` of the link per block,
   the bytes of :func:`attnplan.ir.program.buffer_bytes`, and ``alpha`` per
   message: per phase, source, destination, ring hop, data or partial — no
   more than the program's messages, which coalesce every block of one
   stage between two devices). A device can overlap
   its transfers with its compute but not do either faster, so a phase takes
   at least ``max over devices of max(compute, send, receive)`` (the load
   bound of a schedule, Graham 1969) — the estimate is that bound, forward +
   backward: the placement with no exposed communication. The simulator's
   makespan is never below it (every device runs its own compute blocks and
   waits for all its sends and receives, each queue serving one transfer at
   a time); on the shared batches it is 0.63–1.0 of the predicted time
   (median 0.90), lowest where inter-node traffic is exposed.
3. **Branch and bound**: finish the candidates (the rest of their pipeline,
   from the placement already made, verified as in ``compile``) and simulate
   them in increasing order of estimate, and stop at the first one whose
   estimate exceeds the best predicted time so far: as the estimate is a
   lower bound, neither it nor any later one can be faster. The lowest
   predicted time wins (ties: the first name, as the exhaustive search).
   The choice is therefore the exhaustive search's (compile and simulate
   every strategy), at the cost of the placements plus the finished
   candidates: 1.38 on average on the shared batches at 8 and 32 devices,
   at most 3 (benchmarks/auto_bench.py); ``tests/test_auto.py`` checks the
   bound and the choice. ``keep`` forces at least that many to be finished.

The chosen plan's IR and pipeline are exactly those of ``compile(strategy=
winner)``. Its ``meta`` records, as pure functions of the inputs (no
timings): ``candidates`` (predicted seconds of the simulated ones),
``estimates`` (the bound of every strategy that could place the batch) and
``pruned`` (strategy → why it was not simulated: its bound against the best
predicted time, or the PlanError it raised). ``Plan.measured`` (in memory
only) has the seconds of every placement and of the search after them.

Everything runs in this process: a process pool for the placements
(``concurrent.futures``, forkserver, workers started with attnplan imported)
was 1.18x slower in the median than placing in this process on this 2-core
machine (0.84-2.51x over the 56 shared cases, load 1-4, measured with an
earlier version of auto_bench.py), so there is none.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from ..backends.cost import DTYPE_EFFICIENCY, cb_seconds, get_profile, simulate
from ..errors import PlanError
from ..ir.module import PlanIR
from ..ir.program import B_DKV, B_DQ, B_KV, B_O, B_Q, BWD, FWD, buffer_bytes
from ..ir.schedule import X_KV, X_O, X_Q, XDST, XHG, XSRC, XSTAGE, XTB
from ..ir.verify import needed_transfers
from ..passes import REGISTRY, parse_pipeline, run_pipeline, strategies
from ..passes.comm import ring_kv

KEEP = 1  # finish at least this many candidates, best estimate first (the bound decides the rest)


@dataclass(frozen=True, slots=True)
class Estimate:
    """The placement bound of one strategy, in seconds (see the module doc)."""

    fwd_s: float
    bwd_s: float
    compute_s: float   # the busiest device's forward + backward compute
    comm_s: float      # the busiest device's forward + backward send or receive queue
    comm_bytes: int    # every transfer of both phases once (what the plan's transfers will total)

    @property
    def total_s(self) -> float:
        return self.fwd_s + self.bwd_s


# ------------------------------------------------------------------------------------------ the estimate

def _queues(n: int, per_node: int, prof, parts) -> tuple[np.ndarray, int]:
    """Per device, the busier of its send and receive queue for ``parts``
    (``(src, dst, bytes, group)`` arrays of transfers, ``group`` telling the
    messages apart between the same two devices): ``bytes / bandwidth`` per
    transfer and ``alpha`` per distinct (src, dst, group); and their bytes."""
    send, recv, total = np.zeros(n), np.zeros(n), 0
    src, dst, nbytes, group = (np.concatenate([p[i] for p in parts]).astype(np.int64) for i in range(4))
    inter = (src // per_node) != (dst // per_node)
    sec = nbytes / np.where(inter, prof.inter_bw, prof.intra_bw)
    send += np.bincount(src, weights=sec, minlength=n)
    recv += np.bincount(dst, weights=sec, minlength=n)
    msg = np.unique((group * n + src) * n + dst)
    ms, md = (msg // n) % n, msg % n
    alpha = np.where((ms // per_node) != (md // per_node), prof.inter_alpha, prof.intra_alpha)
    send += np.bincount(ms, weights=alpha, minlength=n)
    recv += np.bincount(md, weights=alpha, minlength=n)
    total += int(nbytes.sum())
    return np.maximum(send, recv), total


def _kv_route(g, pl, need_kv: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """KV transfers as rows ``(tb, hg, src, dst)``: the needed ones (p2p) or
    every hop of the ring; and the stage of each (0, or the ring hop)."""
    if mode == "ring" and pl.devices > 1:
        rows, _ = ring_kv(g, pl)
        return rows[:, [XTB, XHG, XSRC, XDST]], rows[:, XSTAGE]
    return need_kv, np.zeros(len(need_kv), np.int64)


def estimate(ir: PlanIR, prof, comm_mode: str = "p2p") -> Estimate:
    """The bound of step 2 of the module doc for a placed IR (graph and
    placement) under the cost profile ``prof``, its transfers routed as
    ``comm{mode=comm_mode}`` would route them."""
    g, pl = ir.need_graph(), ir.need_placement()
    n, per_node = pl.devices, pl.devices_per_node
    fwd_cb = cb_seconds(g, prof) / DTYPE_EFFICIENCY.get(g.problem.dtype, 1.0)
    compute = np.bincount(pl.cb_device, weights=fwd_cb, minlength=n)
    need = needed_transfers(g, pl)
    q, o, dkv = need[X_Q], need[X_O], need[X_KV]
    kv, hop = _kv_route(g, pl, need[X_KV], comm_mode)
    PARTIAL = -1  # partials travel apart from data (a group of their own)

    def part(rows: np.ndarray, phase: int, kind: int, group, reverse: bool = False):
        src, dst = (rows[:, 3], rows[:, 2]) if reverse else (rows[:, 2], rows[:, 3])
        return src, dst, buffer_bytes(g, phase, kind, rows[:, 0], rows[:, 1]), np.broadcast_to(group, len(rows)) + 1

    comm_f, bytes_f = _queues(n, per_node, prof, [part(q, FWD, B_Q, 0), part(kv, FWD, B_KV, hop),
                                                   part(o, FWD, B_O, PARTIAL)])
    comm_b, bytes_b = _queues(n, per_node, prof, [part(q, BWD, B_Q, 0), part(kv, BWD, B_KV, hop),
                                                   part(o, BWD, B_DQ, PARTIAL),
                                                   part(dkv, BWD, B_DKV, PARTIAL, reverse=True)])
    comp_b = compute * prof.bwd_factor
    return Estimate(float(np.maximum(compute, comm_f).max()), float(np.maximum(comp_b, comm_b).max()),
                    float((compute + comp_b).max()), float((comm_f + comm_b).max()), bytes_f + bytes_b)


# ------------------------------------------------------------------------------------------ the search

def _split(passes: list) -> tuple[list, list]:
    """(tile and the placement pass, the rest) of a default pipeline."""
    i = next((k for k, p in enumerate(passes) if type(p).strategy), len(passes) - 1)
    return passes[:i + 1], passes[i + 1:]


def problem_ir(kwargs: dict) -> PlanIR:
    """The unplaced IR of ``compile``'s checked arguments (the mask lowered once)."""
    from ..frontend import lower_batch
    from ..ir.problem import Problem
    lens, segments, prog = kwargs["seqlens"], kwargs["segments"], kwargs["mask"]
    pieces = lower_batch(prog, lens.tolist(), segments)
    problem = Problem(seqlens=lens, heads=kwargs["heads"], kv_heads=kwargs["kv_heads"], head_dim=kwargs["head_dim"],
                      pieces=pieces, mask=prog.source, segments=segments, dtype=kwargs["dtype"])
    return PlanIR(problem, kwargs["devices"], kwargs["nodes"], kwargs["memory_cap"])


def _reason(e: PlanError) -> str:
    """A PlanError as a short reason for ``meta["pruned"]``."""
    first = (str(e).splitlines() or [""])[0]
    return f"PlanError: {first if len(first) <= 300 else first[:297] + '...'}"


@dataclass(frozen=True, slots=True)
class Placed:
    """One strategy after step 1: its placed IR and estimate, or the PlanError it raised."""

    name: str
    ir: PlanIR | None = None
    estimate: Estimate | None = None
    error: str = ""
    seconds: float = 0.0   # measured (Plan.measured only, never meta)

    @property
    def total_s(self) -> float:
        """The estimate, or infinity for a strategy that could not place the batch."""
        return math.inf if self.estimate is None else self.estimate.total_s


def place(name: str, base: PlanIR, kwargs: dict, prof) -> Placed:
    """Step 1 and 2 for strategy ``name`` (a PlanError becomes ``Placed.error``)."""
    from ..api import default_pipeline
    t0 = time.perf_counter()
    try:
        head, _ = _split(parse_pipeline(default_pipeline(name, kwargs["block_size"])))
        ir = run_pipeline(base, head, verify_each=kwargs["verify"], instruments=kwargs["instruments"],
                          max_compute_blocks=kwargs["max_compute_blocks"])
        est = estimate(ir, prof, REGISTRY[name].default_comm)
    except PlanError as e:
        return Placed(name, error=_reason(e), seconds=time.perf_counter() - t0)
    return Placed(name, ir, est, seconds=time.perf_counter() - t0)



def finish(p: Placed, kwargs: dict, prof) -> tuple[PlanIR, list, float]:
    """The rest of ``p``'s default pipeline from its placement, and the
    simulation: (IR, the whole pipeline's passes, predicted seconds)."""
    from ..api import default_pipeline
    if p.ir is None:
        raise PlanError(f"{p.name} has no placement to finish ({p.error})")
    passes = parse_pipeline(default_pipeline(p.name, kwargs["block_size"]))
    ir = run_pipeline(p.ir, _split(passes)[1], verify_each=kwargs["verify"], instruments=kwargs["instruments"],
                      max_compute_blocks=kwargs["max_compute_blocks"])
    return ir, passes, simulate(ir, prof)["predicted_s"]


_REL = 1e-9  # the bound is exact up to summation order: prune only beyond this relative slack


def search(placed: list[Placed], kwargs: dict, prof, keep: int = KEEP):
    """Step 3: (the winner as (name, IR, passes) or None, predicted seconds
    of the simulated candidates, pruned name -> reason)."""
    pruned = {p.name: p.error for p in placed if p.estimate is None}
    ranked = sorted((p for p in placed if p.estimate is not None), key=lambda p: (p.total_s, p.name))
    best: tuple[str, PlanIR, list] | None = None
    candidates: dict[str, float] = {}
    for i, p in enumerate(ranked):
        if best is not None and i >= keep and p.total_s > candidates[best[0]] * (1 + _REL):
            pruned[p.name] = (f"lower bound {p.total_s * 1e3:.4g} ms > {candidates[best[0]] * 1e3:.4g} ms, the "
                              f"predicted time of {best[0]}")
            continue
        try:
            ir, passes, candidates[p.name] = finish(p, kwargs, prof)
        except PlanError as e:
            pruned[p.name] = _reason(e)
            continue
        if best is None or (candidates[p.name], p.name) < (candidates[best[0]], best[0]):
            best = (p.name, ir, passes)
    return best, candidates, pruned


def compile_auto(kwargs: dict, keep: int = KEEP):
    """``compile(strategy="auto")`` on its checked arguments (``kwargs``: the
    options of ``check_options`` and seqlens, segments, mask, verify,
    instruments, max_compute_blocks). Returns the :class:`attnplan.api.Plan`."""
    from ..api import Plan
    t0 = time.perf_counter()
    prof = get_profile(kwargs["profile"])
    base = problem_ir(kwargs)
    placed = [place(name, base, kwargs, prof) for name in strategies()]
    t1 = time.perf_counter()
    best, candidates, pruned = search(placed, kwargs, prof, keep)
    if best is None:
        raise PlanError("auto: no strategy could plan this batch (" +
                        "; ".join(f"{n}: {r}" for n, r in sorted(pruned.items())) + ")")
    name, ir, passes = best
    meta = {"pipeline": ",".join(p.spec() for p in passes), "strategy": f"auto:{name}",
            "block_size": kwargs["block_size"], "profile": kwargs["profile"], "candidates": candidates,
            "estimates": {p.name: p.total_s for p in sorted(placed, key=lambda p: p.name) if p.estimate is not None},
            "pruned": dict(sorted(pruned.items()))}
    measured = {"plan_s": time.perf_counter() - t0, "place_wall_s": t1 - t0, "finish_wall_s": time.perf_counter() - t1,
                "place_s": {p.name: p.seconds for p in placed}}
    return Plan(ir, meta, measured, prof)
