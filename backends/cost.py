"""A first cost model and an event simulator of the programs.

Compute: a compute block costs ``launch_s`` plus its FLOPs at
``peak_flops * efficiency``, with each piece's query rows rounded up to the
kernel's ``tile_q`` (a 1-row piece costs a whole 128-row tile). Backward
costs ``bwd_factor`` times forward (flash-attention's 5 matmuls vs 2).
Communication: ``alpha + bytes / bandwidth``, intra-node or inter-node; a
sender's link carries one transfer at a time. Merges and adds stream their
bytes at ``mem_bw``.

The simulator walks the programs with the same cooperative walk as the
verifier; a transfer starts once both ends are posted (and the sender's link
is free). ``predicted_s`` = forward makespan + backward makespan.

Where a profile comes from decides how it is looked up: a name recorded in a
plan (``meta.profile``) is only ever a builtin name (:func:`builtin_profile`),
so a plan file can never make the tool open a file; a profile given by the
user (command line, API argument) may also be a JSON file written by ``plan
calibrate`` (:func:`get_profile`, :func:`load_profile_file`). Every profile,
builtin or loaded, is checked once, when it is built (``Profile.__post_init__``).
"""

from __future__ import annotations

import heapq
import math
import os
from dataclasses import MISSING, asdict, dataclass, field, fields

import numpy as np

from ..errors import DeadlockError, PlanError
from ..ir.files import read_json
from ..ir.limits import MAX_PROFILE_FILE, MAX_TOKENS
from ..ir.mask import Q0, Q1, piece_counts
from ..ir.program import ATTN, ATTN_BWD, BBYTES, BWD, FWD, PHASES, RECV, SEND, T_BYTES, T_DST, T_SRC, WAIT

# (field, smallest allowed value, whether that value itself is allowed) of the real-valued fields. Rates are
# at least 1 per second (1e-300 FLOP/s predicts inf ms), seconds and factors at most _MAX_REAL (sums stay finite).
_REAL_FIELDS = {
    "peak_flops": (1.0, True), "efficiency": (0.0, False), "launch_s": (0.0, True),
    "intra_bw": (1.0, True), "inter_bw": (1.0, True), "intra_alpha": (0.0, True),
    "inter_alpha": (0.0, True), "mem_bw": (1.0, True), "bwd_factor": (0.0, False), "memory_bytes": (1.0, True),
}
_MAX_REAL = 1e30


def _shown(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _real(owner: str, key: str, v, low: float, inclusive: bool) -> float:
    """``v`` as a finite float above ``low`` (or equal to it when ``inclusive``), else PlanError naming ``key``."""
    bound = f">= {low:g}" if inclusive else f"> {low:g}"
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise PlanError(f"{owner}: {key} must be a number {bound}, got {_shown(v)}")
    try:
        x = float(v)
    except OverflowError:
        x = math.inf
    if not math.isfinite(x) or x < low or (x == low and not inclusive) or x > _MAX_REAL:
        raise PlanError(f"{owner}: {key} must be a finite number {bound} and <= {_MAX_REAL:g}, got {_shown(v)}")
    return x


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    peak_flops: float      # dense bf16 matmul peak, FLOP/s
    efficiency: float      # attention kernel's share of peak, in (0, 1]
    launch_s: float        # per compute-block launch overhead
    tile_q: int            # kernel query tile (rows are rounded up to it)
    intra_bw: float        # bytes/s per direction, same node
    inter_bw: float        # bytes/s per direction, across nodes
    intra_alpha: float     # latency per transfer, same node
    inter_alpha: float
    mem_bw: float          # bytes/s for merges
    bwd_factor: float = 2.5
    memory_bytes: float = 80 * 2**30  # device memory (the step planner's cap, attnplan.step)

    def __post_init__(self):
        """The one place a profile is checked: names, types and ranges (PlanError naming the field)."""
        if not isinstance(self.name, str) or not self.name.strip():
            raise PlanError(f"cost profile: name must be a non-empty string, got {_shown(self.name)}")
        owner = f"cost profile {self.name!r}"
        for key, (low, inclusive) in _REAL_FIELDS.items():
            object.__setattr__(self, key, _real(owner, key, getattr(self, key), low, inclusive))
        if self.efficiency > 1.0:
            raise PlanError(f"{owner}: efficiency is a share of peak_flops, in (0, 1]; got {self.efficiency!r}")
        t = self.tile_q
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 1 <= t <= MAX_TOKENS:
            raise PlanError(f"{owner}: tile_q must be an integer in 1..{MAX_TOKENS:,} (ir/limits.py), "
                            f"got {_shown(t)}")
        object.__setattr__(self, "tile_q", int(t))

    @property
    def flops(self) -> float:
        return self.peak_flops * self.efficiency


PROFILES = {
    # H100 SXM: 989 TFLOP/s dense bf16; NVLink 4 450 GB/s per direction; 400 Gb/s IB per GPU; 80 GB (the default).
    "h100": Profile("h100", 989e12, 0.6, 5e-6, 128, 370e9, 45e9, 10e-6, 20e-6, 3.0e12),
    # H200: H100 compute, 4.8 TB/s HBM3e, 141 GB.
    "h200": Profile("h200", 989e12, 0.6, 5e-6, 128, 370e9, 45e9, 10e-6, 20e-6, 4.8e12, memory_bytes=141 * 2**30),
    # A100 SXM (80 GB): 312 TFLOP/s; NVLink 3 300 GB/s per direction; 200 Gb/s IB per GPU.
    "a100": Profile("a100", 312e12, 0.6, 5e-6, 128, 240e9, 22e9, 10e-6, 20e-6, 1.8e12),
    # this 2-core CPU: the CPU flash op reaches 270-670 GFLOP/s bf16; gloo on loopback 1-3 GB/s.
    "cpu-local": Profile("cpu-local", 4e11, 1.0, 50e-6, 1, 2e9, 2e9, 50e-6, 50e-6, 5e9),
}
DEFAULT_PROFILE = "h100"

# keys ``plan calibrate`` writes beside the profile's fields, for the reader: accepted, not used
# (``fit``: the fitted values with their residuals, runtime/calibrate.py)
INFO_KEYS = frozenset({"threads", "host", "fit"})

# share of the bf16 kernel rate reached by other dtypes (fp32 runs as TF32 on GPUs)
DTYPE_EFFICIENCY = {"bfloat16": 1.0, "float16": 1.0, "float32": 0.5}


# ----------------------------------------------------------------------------------------------
# where a profile comes from
# ----------------------------------------------------------------------------------------------

def builtin_profile(name) -> Profile:
    """A shipped profile by name; nothing else (this is what a plan's ``meta.profile`` may name)."""
    if isinstance(name, str) and name in PROFILES:
        return PROFILES[name]
    raise PlanError(f"unknown cost profile {_shown(name)}; known: {', '.join(sorted(PROFILES))} or a FILE.json "
                    f"from `plan calibrate`")


def profile_from_dict(data, source: str) -> Profile:
    """A profile from the JSON object of a profile file: every field present
    (``bwd_factor`` may be left out), no unknown keys, then the checks of
    :class:`Profile`; PlanError naming ``source`` and the key otherwise."""
    if not isinstance(data, dict):
        raise PlanError(f"cost profile {source}: must be a JSON object with the fields of a profile, "
                        f"got {type(data).__name__}")
    known = {f.name for f in fields(Profile)}
    unknown = sorted(str(k) for k in data if k not in known and k not in INFO_KEYS)
    if unknown:
        raise PlanError(f"cost profile {source}: unknown key(s) {', '.join(map(repr, unknown))}; "
                        f"the fields are {', '.join(f.name for f in fields(Profile))}")
    missing = [f.name for f in fields(Profile) if f.default is MISSING and f.name not in data]
    if missing:
        raise PlanError(f"cost profile {source}: missing key(s) {', '.join(map(repr, missing))}")
    try:
        return Profile(**{k: v for k, v in data.items() if k in known})
    except PlanError as e:
        raise PlanError(f"{source}: {e}") from None


def load_profile_file(path) -> Profile:
    """A profile from a JSON file written by ``plan calibrate``: only for a
    path the user gave (``--profile FILE.json``, an API argument), never for
    a name read from a plan. The file must be a regular file of at most
    ``MAX_PROFILE_FILE`` bytes."""
    path = os.fspath(path)
    data = read_json(path, MAX_PROFILE_FILE, "MAX_PROFILE_FILE", f"cost profile {path}", PlanError)
    return profile_from_dict(data, path)


def get_profile(spec) -> Profile:
    """A profile the user asked for (command line or API argument): a
    :class:`Profile`, a builtin name, or the path of a ``.json`` file from
    ``plan calibrate``. A name recorded in a plan goes through
    :func:`resolve_profile`, which accepts builtin names only."""
    if isinstance(spec, Profile):
        return spec
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if isinstance(spec, str) and spec not in PROFILES and spec.endswith(".json"):
        return load_profile_file(spec)
    return builtin_profile(spec)


def resolve_profile(explicit=None, recorded=None) -> Profile:
    """The profile to predict with: the user's ``explicit`` one if given (see
    :func:`get_profile`), else the plan's ``recorded`` name (``meta.profile``,
    default h100), which must be builtin."""
    if explicit is not None:
        return get_profile(explicit)
    name = DEFAULT_PROFILE if recorded is None else recorded
    if isinstance(name, str) and name in PROFILES:
        return PROFILES[name]
    raise PlanError(f"the plan's cost profile {_shown(name)} is not a builtin one ({', '.join(sorted(PROFILES))}); "
                    f"a profile file is never named by a plan: give it explicitly (--profile FILE.json)")


# ----------------------------------------------------------------------------------------------
# compute and link costs
# ----------------------------------------------------------------------------------------------

def rounded_pairs(graph, tile_q: int) -> np.ndarray:
    """Per tile: allowed pairs with each piece's query rows rounded up to the
    kernel's ``tile_q`` (the work a tiled kernel really does)."""
    P = graph.pieces
    if len(P) == 0:
        return np.zeros(graph.n_tile)
    rows = P[:, Q1] - P[:, Q0]
    rounded = piece_counts(P) * (-(-rows // tile_q) * tile_q) / rows
    return np.add.reduceat(rounded, graph.tile_ptr[:-1])


def cb_seconds(graph, prof: Profile) -> np.ndarray:
    """Forward seconds of every compute block (tile rounding, launch overhead)."""
    if graph.n_tile == 0:
        return np.zeros(graph.n_cb)
    tile = rounded_pairs(graph, prof.tile_q)
    flops = 4.0 * graph.problem.head_dim * tile[graph.cb_tile] * graph.hg_heads[graph.cb_hg]
    return prof.launch_s + flops / prof.flops


def transfer_seconds(ir, prof: Profile) -> np.ndarray:
    """Seconds of every transfer: ``alpha + bytes / bandwidth`` of the link it crosses."""
    X = ir.program.transfers
    node = np.arange(ir.program.devices) // ir.placement.devices_per_node
    src, dst, nbytes = X[:, T_SRC], X[:, T_DST], X[:, T_BYTES].astype(float)
    inter = node[src] != node[dst] if len(X) else np.zeros(0, bool)
    return np.where(inter, prof.inter_alpha + nbytes / prof.inter_bw, prof.intra_alpha + nbytes / prof.intra_bw)


# ----------------------------------------------------------------------------------------------
# the event simulation of one phase
# ----------------------------------------------------------------------------------------------

@dataclass(slots=True, eq=False)
class _PhaseWalk:
    """The mutable state of one phase's simulation (private to :func:`simulate`):
    per device its clock, busy time, program counter and link queues; per
    transfer tag its first post, its end and the devices waiting on it."""

    code: list            # per device: its instructions as lists
    bufbytes: list        # per device: bytes of each buffer
    cost: list            # per compute block: seconds in this phase
    src: list             # per transfer: sender, receiver, seconds
    dst: list
    dur: list
    mem_bw: float
    record: bool
    clock: list = field(default_factory=list)
    busy: list = field(default_factory=list)
    pc: list = field(default_factory=list)
    send_free: list = field(default_factory=list)
    recv_free: list = field(default_factory=list)
    posted: dict = field(default_factory=dict)    # tag -> time of the first post
    end: dict = field(default_factory=dict)       # tag -> completion time
    waiting: dict = field(default_factory=dict)   # tag -> devices stalled on it
    heap: list = field(default_factory=list)
    ev_c: list = field(default_factory=list)
    ev_t: list = field(default_factory=list)
    ev_w: list = field(default_factory=list)

    def __post_init__(self):
        n = len(self.code)
        self.clock, self.busy, self.pc = [0.0] * n, [0.0] * n, [0] * n
        self.send_free, self.recv_free = [0.0] * n, [0.0] * n
        self.heap = [(0.0, d) for d in range(n)]

    def run(self) -> None:
        """Advance devices in global time order until every one has ended or stalled."""
        while self.heap:
            _, d = heapq.heappop(self.heap)
            self.advance(d)

    def advance(self, d: int) -> None:
        """Run device ``d`` until its program ends, it stalls on a wait, or it
        reaches a send/receive that devices earlier in time must post before."""
        c, i, now = self.code[d], self.pc[d], self.clock[d]
        while i < len(c):
            row = c[i]
            op = row[0]
            if op in (SEND, RECV):
                if now > self.clock[d] or (self.heap and self.heap[0][0] < now):
                    break  # let devices earlier in time post first
                self.post(row[1], now)
            elif op == WAIT:
                t = row[1]
                if t not in self.end:  # stalled: woken by the transfer's second post
                    self.clock[d], self.pc[d] = now, i
                    self.waiting.setdefault(t, []).append(d)
                    return
                if self.end[t] > now:
                    if self.record:
                        self.ev_w.append((d, now, self.end[t], t))
                    now = self.end[t]
            else:
                now = self.local(d, row, now)
            i += 1
        else:
            self.clock[d], self.pc[d] = now, i
            return
        self.clock[d], self.pc[d] = now, i
        heapq.heappush(self.heap, (now, d))

    def local(self, d: int, row: list, now: float) -> float:
        """Run one instruction that needs no other device (a compute block, a merge or add); its end time."""
        if row[0] in (ATTN, ATTN_BWD):
            dt = self.cost[row[1]]
            cb = row[1]
        else:  # MERGE / ADD stream their bytes
            dt = self.bufbytes[d][row[2]] * 3 / self.mem_bw
            cb = -1
        if self.record:
            self.ev_c.append((d, now, now + dt, cb))
        self.busy[d] += dt
        return now + dt

    def post(self, t: int, now: float) -> None:
        """One end of transfer ``t`` is posted at ``now``; the second post starts it."""
        if t not in self.posted:
            self.posted[t] = now
            return
        a, b = self.src[t], self.dst[t]
        ready = max(self.posted[t], now)
        # the sender's and the receiver's queues each serve their own
        # transfers in turn; a transfer ends when the busier side is done
        # (reserving both sides at the later start would leave idle gaps
        # that convoy through every link)
        self.send_free[a] = max(ready, self.send_free[a]) + self.dur[t]
        self.recv_free[b] = max(ready, self.recv_free[b]) + self.dur[t]
        end = self.end[t] = max(self.send_free[a], self.recv_free[b])
        if self.record:
            self.ev_t.append((t, a, b, end - self.dur[t], end))
        for w in self.waiting.pop(t, ()):
            if self.record and end > self.clock[w]:
                self.ev_w.append((w, self.clock[w], end, t))
            self.clock[w] = max(self.clock[w], end)
            self.pc[w] += 1
            heapq.heappush(self.heap, (self.clock[w], w))

    def summary(self, phase: int) -> dict:
        """``finish_s``, ``compute_s``, ``makespan_s`` (and ``events`` when recording); DeadlockError if stalled."""
        stalled = [d for d in range(len(self.code)) if self.pc[d] < len(self.code[d])]
        if stalled:  # the verifier proves this cannot happen for emitted programs
            raise DeadlockError(f"simulation of {PHASES[phase]} stalled on devices {stalled}")
        out = {"finish_s": self.clock, "compute_s": self.busy, "makespan_s": max(self.clock) if self.clock else 0.0}
        if self.record:
            out["events"] = {
                "compute": np.asarray(self.ev_c, float).reshape(-1, 4),
                "transfer": np.asarray(self.ev_t, float).reshape(-1, 5),
                "wait": np.asarray(self.ev_w, float).reshape(-1, 4),
            }
        return out


def simulate(ir, prof: Profile, record: bool = False) -> dict:
    """Event-driven simulation of every device's forward, then backward, program.

    Each device has a compute stream (its instruction stream: compute blocks,
    merges) and a send and a receive queue. Devices advance in global time
    order; a transfer is ready once both its ends are posted, takes ``alpha +
    bytes / bandwidth`` of the link it crosses (intra- or inter-node) on the
    sender's queue and on the receiver's queue, each serving its transfers in
    the order they became ready, and ends when the later of the two is done;
    a ``wait`` stalls its device until then.

    Returns per phase ``finish_s`` and ``compute_s`` per device and the
    ``makespan_s``; ``predicted_s`` is forward + backward. With ``record``,
    each phase also has ``events``: ``compute`` rows ``(device, start, end,
    cb)`` (merges/adds have cb = -1), ``transfer`` rows ``(tag, src, dst,
    start, end)`` and ``wait`` rows ``(device, start, end, tag)`` for every
    wait that left the device idle; times in seconds."""
    prof = get_profile(prof)
    g, prog = ir.graph, ir.program
    fwd_cost = cb_seconds(g, prof) / DTYPE_EFFICIENCY.get(g.problem.dtype, 1.0)
    X = prog.transfers
    links = (X[:, T_SRC].tolist(), X[:, T_DST].tolist(), transfer_seconds(ir, prof).tolist())
    result = {}
    for phase, factor in ((FWD, 1.0), (BWD, prof.bwd_factor)):
        walk = _PhaseWalk([c.tolist() for c in prog.code[phase]], [b[:, BBYTES].tolist() for b in prog.buffers[phase]],
                          (fwd_cost * factor).tolist(), *links, mem_bw=prof.mem_bw, record=record)
        walk.run()
        result[PHASES[phase]] = walk.summary(phase)
    result["predicted_s"] = result["fwd"]["makespan_s"] + result["bwd"]["makespan_s"]
    result["profile"] = asdict(prof)
    return result
