"""A first cost model and an event simulator of the programs.

Compute: a compute block costs its FLOPs at ``peak_flops * efficiency``,
with each piece's query rows rounded up to the kernel's ``tile_q`` (a 1-row
piece costs a whole 128-row tile), plus ``launch_s`` per kernel call. What
one call covers is the profile's ``fused``: ``False``, one call per compute
block (this project's torch runtime: one kernel call per tile piece);
``True``, one call per run of consecutive compute blocks of a device that no
other instruction separates — a kernel over a list of (q range, k range,
mask) slices, as MagiAttention's Flex-Flash-Attention (Zhao et al. 2025,
arXiv:2505.13211) and varlen flash-attention for per-document CP
(TransformerEngine's THD layout, WLB-LLM) run everything a device has
between two communication points in one launch. The GPU profiles are
fused; ``cpu-local`` and calibrated profiles are not. Backward costs
``bwd_factor`` times forward (flash-attention's 5 matmuls vs 2).
Communication is by message (every block between two devices in one phase
and stage travels in one, see :mod:`attnplan.ir.program`): a message costs
``alpha + bytes / bandwidth``, intra-node or inter-node — one latency per
message, its blocks' bytes summed; a sender's link carries one message at a
time. Merges and adds stream their bytes at ``mem_bw``.

The simulator walks the programs with the same rendezvous semantics as the
verifier; a message starts once both ends are posted (and the sender's link
is free). Its events are messages and the instructions around them: the
local instructions between two communication instructions of a device are
one step, their seconds summed with numpy (per-instruction times are
recovered from those sums when events are recorded), so its cost follows the
messages, not the blocks. ``predicted_s`` = forward makespan + backward
makespan.

Where a profile comes from decides how it is looked up: a name recorded in a
plan (``meta.profile``) is only ever a builtin name (:func:`builtin_profile`),
so a plan file can never make the tool open a file; a profile given by the
user (command line, API argument) may also be a JSON file written by ``plan
calibrate`` (:func:`get_profile`, :func:`load_profile_file`). Every profile,
builtin or loaded, is checked once, when it is built (``Profile.__post_init__``).
"""

from __future__ import annotations

import math
import os
from dataclasses import MISSING, asdict, dataclass, fields

import numpy as np

from ..errors import PlanError
from ..ir.files import read_json
from ..ir.limits import MAX_PROFILE_FILE, MAX_TOKENS
from ..ir.mask import Q0, Q1, piece_counts
from ..ir.program import BBYTES, BWD, FWD, M_BYTES, M_DST, M_SRC, PHASES
from .walk import PhaseWalk, phase_steps

# (field, smallest allowed value, whether that value itself is allowed) of the real-valued fields. Rates are
# at least 1 per second (1e-300 FLOP/s predicts inf ms), seconds and factors at most _MAX_REAL (sums stay finite).
_REAL_FIELDS = {
    "peak_flops": (1.0, True), "efficiency": (0.0, False), "launch_s": (0.0, True),
    "intra_bw": (1.0, True), "inter_bw": (1.0, True), "intra_alpha": (0.0, True),
    "inter_alpha": (0.0, True), "mem_bw": (1.0, True), "bwd_factor": (0.0, False), "memory_bytes": (1.0, True),
}
_MAX_REAL = 1e30
LINK_MODES = ("queue", "fair")


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
    launch_s: float        # per kernel call (see ``fused``)
    tile_q: int            # kernel query tile (rows are rounded up to it)
    intra_bw: float        # bytes/s per direction, same node
    inter_bw: float        # bytes/s per direction, across nodes
    intra_alpha: float     # latency per transfer, same node
    inter_alpha: float
    mem_bw: float          # bytes/s for merges
    bwd_factor: float = 2.5
    memory_bytes: float = 80 * 2**30  # device memory (the step planner's cap, attnplan.step)
    fused: bool = False    # one launch per run of compute blocks (True) or per compute block (False)
    links: str = "queue"   # "queue": a message has its link alone, FIFO; "fair": max-min shared (backends/links.py)

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
        if not isinstance(self.fused, (bool, np.bool_)):
            raise PlanError(f"{owner}: fused must be true or false, got {_shown(self.fused)}")
        object.__setattr__(self, "fused", bool(self.fused))
        if self.links not in LINK_MODES:
            raise PlanError(f"{owner}: links must be one of {', '.join(LINK_MODES)}, got {_shown(self.links)}")

    @property
    def flops(self) -> float:
        return self.peak_flops * self.efficiency


PROFILES = {
    # H100 SXM: 989 TFLOP/s dense bf16; NVLink 4 450 GB/s per direction; 400 Gb/s IB per GPU; 80 GB (the default).
    "h100": Profile("h100", 989e12, 0.6, 5e-6, 128, 370e9, 45e9, 10e-6, 20e-6, 3.0e12, fused=True),
    # H200: H100 compute, 4.8 TB/s HBM3e, 141 GB.
    "h200": Profile("h200", 989e12, 0.6, 5e-6, 128, 370e9, 45e9, 10e-6, 20e-6, 4.8e12, memory_bytes=141 * 2**30,
                    fused=True),
    # A100 SXM (80 GB): 312 TFLOP/s; NVLink 3 300 GB/s per direction; 200 Gb/s IB per GPU.
    "a100": Profile("a100", 312e12, 0.6, 5e-6, 128, 240e9, 22e9, 10e-6, 20e-6, 1.8e12, fused=True),
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
    kernel's ``tile_q`` (the work a tiled kernel really does); relation
    tiles in closed form from their entry table (ir/relation.py), the same sums."""
    if graph.relation:
        return graph.relation_table().sums(graph.tile_q, graph.tile_k, tile_q)
    P = graph.pieces
    if len(P) == 0:
        return np.zeros(graph.n_tile)
    rows = P[:, Q1] - P[:, Q0]
    rounded = piece_counts(P) * (-(-rows // tile_q) * tile_q) / rows
    return np.add.reduceat(rounded, graph.tile_ptr[:-1])


def cb_seconds(graph, prof: Profile, launch: bool = True) -> np.ndarray:
    """Forward seconds of every compute block: its tile-rounded FLOPs, plus
    one launch each unless ``launch`` is false (a fused profile charges the
    launch per run, :func:`attnplan.backends.walk.run_starts`)."""
    if graph.n_tile == 0:
        return np.zeros(graph.n_cb)
    tile = rounded_pairs(graph, prof.tile_q)
    flops = 4.0 * graph.problem.head_dim * tile[graph.cb_tile] * graph.hg_heads[graph.cb_hg]
    return (prof.launch_s if launch else 0.0) + flops / prof.flops


def launches(blocks: np.ndarray, prof: Profile) -> np.ndarray:
    """A lower bound of the kernel calls of devices that run ``blocks``
    compute blocks: one each, or, fused, one if any."""
    blocks = np.asarray(blocks, float)
    return np.minimum(blocks, 1.0) if prof.fused else blocks


def link_seconds(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, per_node: int, prof: Profile) -> np.ndarray:
    """``alpha + bytes / bandwidth`` of the link (intra- or inter-node) each message crosses."""
    inter = (src // per_node) != (dst // per_node)
    nbytes = nbytes.astype(float)
    return np.where(inter, prof.inter_alpha + nbytes / prof.inter_bw, prof.intra_alpha + nbytes / prof.intra_bw)


def message_seconds(ir, prof: Profile) -> np.ndarray:
    """Seconds of every message: ``alpha + bytes / bandwidth`` of the link it crosses."""
    M = ir.program.messages
    return link_seconds(M[:, M_SRC], M[:, M_DST], M[:, M_BYTES], ir.placement.devices_per_node, prof)


# ----------------------------------------------------------------------------------------------
# the event simulation of one phase
# ----------------------------------------------------------------------------------------------

def simulate(ir, prof: Profile, record: bool = False) -> dict:
    """Event-driven simulation of every device's forward, then backward, program.

    Each device has a compute stream (its instruction stream: compute blocks,
    merges) and a send and a receive queue. Devices advance in global time
    order; a message is ready once both its ends are posted, takes ``alpha +
    bytes / bandwidth`` of the link it crosses (intra- or inter-node) on the
    sender's queue and on the receiver's queue, each serving its messages in
    the order they became ready, and ends when the later of the two is done;
    a ``wait`` stalls its device until then.

    Returns per phase ``finish_s`` and ``compute_s`` per device and the
    ``makespan_s``; ``predicted_s`` is forward + backward. With ``record``,
    each phase also has ``events``: ``compute`` rows ``(device, start, end,
    cb)`` (merges/adds have cb = -1), ``transfer`` rows ``(message, src, dst,
    start, end)`` and ``wait`` rows ``(device, start, end, message)`` for
    every wait that left the device idle; times in seconds."""
    prof = get_profile(prof)
    g, prog = ir.graph, ir.program
    rate = DTYPE_EFFICIENCY.get(g.problem.dtype, 1.0)
    fwd_cost = cb_seconds(g, prof, launch=not prof.fused) / rate
    run_launch = prof.launch_s / rate if prof.fused else 0.0
    M = prog.messages
    links = (M[:, M_SRC].tolist(), M[:, M_DST].tolist(), message_seconds(ir, prof).tolist())
    result = {}
    for phase, factor in ((FWD, 1.0), (BWD, prof.bwd_factor)):
        st = phase_steps(prog.code[phase], tuple(b[:, BBYTES] for b in prog.buffers[phase]), fwd_cost * factor,
                    prof.mem_bw, run_launch * factor)
        walk: PhaseWalk
        if prof.links == "fair":
            from .links import fair_walk
            walk = fair_walk(st.steps, links[0], links[1], M[:, M_BYTES], ir.placement.devices_per_node, prof,
                             record, len(st.step_first))
        else:
            walk = PhaseWalk(st.steps, *links, record=record, n_local=len(st.step_first))
        walk.run()
        result[PHASES[phase]] = walk.summary(phase, st)
    result["predicted_s"] = result["fwd"]["makespan_s"] + result["bwd"]["makespan_s"]
    result["profile"] = asdict(prof)
    return result
