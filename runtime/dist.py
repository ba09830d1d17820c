"""Distributed executor: one device per process over ``torch.distributed``.

Device ``d`` of a plan is rank ``d`` of the process group (``group=None``:
the default group). Each rank holds only its local tokens (its home token
blocks in increasing order, see :mod:`attnplan.runtime.layout`) and runs its
own forward and backward streams with the same
:class:`~attnplan.runtime.runner.DeviceRunner` as the in-process executor,
through :class:`TorchTransport`: every ``recv``/``send`` of a message becomes
one tagged ``irecv``/``isend`` posted where the program posts it and waited
where the program waits, so a stage's messages fly while earlier compute
blocks run. A message is one contiguous buffer on the wire: the sender packs
the buffers of its transfers into one flat tensor (one ``torch.cat``), the
receiver receives into one flat tensor and views it as its receive buffers.
Gloo matches messages by tag; a message's tag is its id offset by a per-call
*generation*, so messages of two attention calls can never be mixed up even
if autograd ran their backwards in different orders on different ranks.
(NCCL ignores tags and matches by posting order per pair of ranks; the
verifier proves every pair posts its sends and receives in the same order,
and ``match="order"`` runs the programs that way on gloo — every message
with tag 0 — which tests/test_distributed.py checks for every strategy.
On ``backend="nccl"`` the runtime always matches by order: NCCL has no
tags.) A collective schedule (``comm{mode=a2a}``) runs its messages as
two ``all_to_all_single`` a phase instead (:mod:`attnplan.runtime.collective`).

Backward transfers are issued by :class:`DistAttention`'s backward, a custom
``torch.autograd.Function``, in the plan's order on every rank — never by
autograd of collectives (whose order can differ between ranks and silently
mix tensors: docs/DESIGN.md).

Every function here takes the IR (``plan.ir``, a compiled
:class:`~attnplan.ir.module.PlanIR`) and plain values, never the face's
``Plan``; the plan fingerprint of the handshake hashes the IR's arrays.

Checks, all before the plan's first transfer: the group has exactly
``plan.devices`` ranks (:class:`PlanError`); inputs have this rank's token
count, the plan's head counts and head dim, one floating dtype
(:class:`ShapeError`); and, once per plan and group, a handshake (a gloo
``monitored_barrier`` that names missing ranks, then an all_gather of a
fingerprint of the plan, dtype and shapes) proves every rank holds the same
plan and inputs of the same dtype and shape (:class:`PlanError` /
:class:`ShapeError` naming the ranks that differ). A message that does not
complete within ``timeout`` seconds, or whose peer died, raises
:class:`TransportError` naming the peer and the message.
"""

from __future__ import annotations

import datetime
import hashlib
import math
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..errors import PlanError, ShapeError
from ..ir import limits
from ..ir.interp import message_key
from ..ir.module import PlanIR
from ..ir.program import BWD, FWD, PHASES
from . import layout
from .collective import CollectiveTransport
from .executor import check_inputs, embed, expand_kv, order_heads, resolve_scale, restore_heads
from .kernels import settle_rows_without_mass
from .runner import NEG_INF, DeviceRunner, Timings, acc_dtype, home_bindings, kept_bindings, pack
from .transport import TransportError

TIMEOUT_ENV = "ATTNPLAN_TIMEOUT"  # default seconds a transfer may take (300 when unset)
MATCH_ENV = "ATTNPLAN_MATCH"  # how messages are matched: "tag" (default) or "order"
MATCH_MODES = ("tag", "order")
_MAX_TAG = (1 << 31) - 1
_DTYPE_CODE = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float64: 4}


@dataclass(frozen=True)
class GroupInfo:
    """A process group as the plan sees it: ``rank`` = this process's device,
    ``ranks[d]`` = the global rank of device ``d``."""

    group: Any
    rank: int
    ranks: tuple
    backend: str

    @property
    def size(self) -> int:
        return len(self.ranks)


def resolve_group(plan_ir, group=None) -> GroupInfo:
    """Check that the process group fits the plan (before any transfer)."""
    if not dist.is_available() or not dist.is_initialized():
        raise PlanError(f"torch.distributed is not initialized, and the plan has {plan_ir.devices} devices: "
                        f"call torch.distributed.init_process_group first (attnplan.execute runs every device "
                        f"in one process)")
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if rank < 0:
        raise PlanError(f"this process (global rank {dist.get_rank()}) is not a member of the process group")
    if size != plan_ir.devices:
        raise PlanError(f"the plan was compiled for {plan_ir.devices} devices but the process group has {size} "
                        f"ranks (rank {rank}); compile it with devices={size}")
    ranks = tuple(range(size)) if group is None or group is dist.group.WORLD else \
        tuple(dist.get_global_rank(group, i) for i in range(size))
    return GroupInfo(group, rank, ranks, str(dist.get_backend(group)))


def check_backend(info: GroupInfo, device: torch.device, where: str = "") -> None:
    """Tensors on a device the group's backend moves (:class:`ShapeError`):
    NCCL moves CUDA tensors only; gloo's send/receive CPU tensors only."""
    if info.size == 1:
        return
    if info.backend == "nccl" and device.type != "cuda":
        raise ShapeError(f"{where}the process group's backend is nccl, which moves CUDA tensors; q, k, v are on "
                         f"{device} (move them to this rank's GPU, or use a gloo group for CPU tensors)")
    if info.backend == "gloo" and device.type != "cpu":
        raise ShapeError(f"{where}the process group's backend is gloo, whose send/receive takes CPU tensors; q, k, v "
                         f"are on {device} (initialize the group with backend='nccl' for GPU tensors)")


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(seconds))


def _plan_ir(plan_ir) -> PlanIR:
    """The runtime takes the IR (``plan.ir``), compiled down to programs."""
    if not isinstance(plan_ir, PlanIR):
        raise PlanError(f"the distributed runtime takes a PlanIR (plan.ir), got {type(plan_ir).__name__}")
    if plan_ir.program is None or plan_ir.graph is None or plan_ir.placement is None:
        raise PlanError("this PlanIR has no per-device programs yet: run the pipeline through emit first")
    return plan_ir


def resolve_timeout(timeout) -> float:
    """Seconds a transfer may take: ``timeout``, else ``$ATTNPLAN_TIMEOUT``, else
    300; a finite number in (0, MAX_TIMEOUT_S] (:class:`PlanError` otherwise)."""
    src = "timeout"
    if timeout is None:
        timeout, src = os.environ.get(TIMEOUT_ENV, "300"), f"${TIMEOUT_ENV}"
    if isinstance(timeout, (bool, np.bool_)) or not isinstance(timeout, (int, float, str, np.integer, np.floating)):
        raise PlanError(f"{src} must be a number of seconds, got {type(timeout).__name__}")
    try:
        t = float(timeout)
    except (ValueError, OverflowError):
        raise PlanError(f"{src} must be a number of seconds, got {str(timeout)[:40]!r}") from None
    if not (math.isfinite(t) and 0 < t <= limits.MAX_TIMEOUT_S):
        raise PlanError(f"{src} must be positive finite seconds, at most {limits.MAX_TIMEOUT_S:,}, got {t!r}")
    return t


def resolve_match(match) -> str:
    """How messages are matched: ``match``, else ``$ATTNPLAN_MATCH``, else
    ``"tag"``. ``"order"`` sends every message with one tag, so gloo matches
    the messages between two ranks by posting order alone, as NCCL does: the
    verifier's posting-order invariant is what makes that correct."""
    src = "match"
    if match is None:
        match, src = os.environ.get(MATCH_ENV, "tag"), f"${MATCH_ENV}"
    if match not in MATCH_MODES:
        raise PlanError(f"{src} must be one of {', '.join(MATCH_MODES)}, got {str(match)[:40]!r}")
    return str(match)


class TorchTransport:
    """``post_send``/``post_recv``/``wait`` over point-to-point ops: tagged by
    message (``match="tag"``), or all with tag 0 (``match="order"``). The posts
    of one run of consecutive ``send``/``recv`` instructions (a stage's
    messages) go out together as one ``batch_isend_irecv`` when the stream
    reaches its next other instruction (:meth:`flush`; the runner calls it), in
    program order: on NCCL one group of sends and receives, which cannot
    deadlock on the order of pairs inside it."""

    def __init__(self, program, device: int, info: GroupInfo, generation: int, timeout: float,
                 match: str = "tag"):
        self.program, self.device, self.info, self.timeout = program, device, info, timeout
        self.base = generation * len(program.messages)
        self.by_order = match == "order" or info.backend == "nccl"  # NCCL has no tags: posting order only
        self.pending: dict[int, tuple] = {}
        self.batch: list[tuple] = []  # (tag, op, wire, peer, what) posted since the last flush

    def _tag(self, tag: int) -> int:
        return 0 if self.by_order else (self.base + tag) % _MAX_TAG

    def _fail(self, tag: int, peer: int, what: str, e: Exception) -> TransportError:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "closure" in msg.lower():  # gloo closes a pair after a timeout on it: the group is unusable
            why = (f"the connection to peer device {peer} (rank {self.info.ranks[peer]}) was closed after an "
                   f"earlier failure")
        elif "closed" in msg.lower() or "reset" in msg.lower() or "broken pipe" in msg.lower():
            why = f"peer device {peer} (rank {self.info.ranks[peer]}) died or closed its connection"
        elif "timed out" in msg.lower() or "timeout" in msg.lower():
            why = (f"peer device {peer} (rank {self.info.ranks[peer]}) did not {what} within {self.timeout:g} s "
                   f"(it is stuck, slow, or runs another plan)")
        else:
            why = f"peer device {peer} (rank {self.info.ranks[peer]}) failed"
        return TransportError(f"device {self.device} (rank {self.info.ranks[self.device]}): message "
                              f"{message_key(self.program, tag)}: {why} [{msg[:160]}]")

    def post_send(self, tag: int, peer: int, tensors, flat=None) -> None:
        wire = flat if flat is not None else pack(tensors)  # one contiguous buffer a message
        self.batch.append((tag, dist.P2POp(dist.isend, wire, self.info.ranks[peer], self.info.group, self._tag(tag)),
                           wire, peer, "take the data"))

    def post_recv(self, tag: int, peer: int, tensors, flat=None) -> None:
        if flat is None:  # pragma: no cover - the runner always receives into a flat buffer
            raise PlanError("TorchTransport receives into packed buffers only")
        self.batch.append((tag, dist.P2POp(dist.irecv, flat, self.info.ranks[peer], self.info.group,
                                           self._tag(tag)), flat, peer, "send the data"))

    def flush(self) -> None:
        """Start the posts since the last flush, in program order, as one ``batch_isend_irecv``."""
        if not self.batch:
            return
        batch, self.batch = self.batch, []
        try:
            works = dist.batch_isend_irecv([op for _, op, _, _, _ in batch])
        except RuntimeError as e:
            tag, _, _, peer, what = batch[0]
            raise self._fail(tag, peer, what, e) from None
        works = list(works or [])
        if works and len(works) != len(batch):  # one work for the whole group (NCCL): every message waits on it
            works = [works[-1]] * len(batch)
        for i, (tag, _, wire, peer, what) in enumerate(batch):
            self.pending[tag] = (works[i:i + 1], wire, peer, what)

    def wait(self, tag: int) -> None:
        if tag not in self.pending:
            self.flush()
        works, _, peer, what = self.pending.pop(tag)
        try:
            for w in works:
                w.wait(_td(self.timeout))
        except RuntimeError as e:
            raise self._fail(tag, peer, what, e) from None

    def drain(self) -> None:
        """Wait for whatever the stream posted and never waited for."""
        self.flush()
        for tag in sorted(self.pending):
            self.wait(tag)


class _LocalTransport:
    """A one-device plan without torch.distributed: it has no transfers."""

    def post_send(self, tag, peer, tensors, flat=None):  # pragma: no cover - no transfers in a one-device plan
        raise PlanError("a one-device plan cannot send")

    post_recv = post_send
    wait = post_send

    def drain(self) -> None:
        pass


# handshake ---------------------------------------------------------------------

_HANDSHAKES: "OrderedDict[tuple, object]" = OrderedDict()  # key -> plan ir (kept alive: ids stay unique)
_GENERATIONS: dict = {}


def _fingerprint_parts(ir: PlanIR):
    """Everything a rank's execution reads: the problem, the token and head
    blocks, the tiles' mask pieces, the homes, and every device's programs."""
    p, g, prog, pl = ir.problem, ir.graph, ir.program, ir.placement
    if g is None or prog is None or pl is None:
        raise PlanError("this PlanIR has no per-device programs yet: run the pipeline through emit first")
    collective = int(ir.schedule is not None and ir.schedule.collective)  # picks the transport (a2a or p2p)
    yield "shape", np.array([ir.devices, p.heads, p.kv_heads, p.head_dim, prog.devices, g.kv_rep, collective],
                            np.int64)
    yield "seqlens", p.seqlens
    if p.q_lens is not None:  # which local rows take the caller's queries and keys
        yield "q_lens", p.q_lens
    yield "pieces", p.pieces.a
    for name in ("tb_start", "tb_end", "hg_start", "hg_end", "tile_ptr", "pieces", "cb_tile", "cb_q", "cb_k"):
        yield "graph." + name, getattr(g, name)
    if g.grouped:  # varlen groups: which rows each block holds
        for name in ("tb_ptr", "span_start", "span_end"):
            yield "graph." + name, getattr(g, name)
    yield "home", pl.home
    yield "transfers", prog.transfers
    yield "messages", prog.messages
    for phase in (FWD, BWD):
        for d in range(prog.devices):
            yield f"buffers{phase}.{d}", prog.buffers[phase][d]
            yield f"code{phase}.{d}", prog.code[phase][d]


def plan_fingerprint(plan_ir) -> bytes:
    """sha256 over what the runtime executes of ``plan_ir`` (the arrays of
    :func:`_fingerprint_parts`, each with its name, dtype and shape): equal on
    two ranks iff they run the same plan. Needs nothing above the IR."""
    h = hashlib.sha256()
    for name, a in _fingerprint_parts(_plan_ir(plan_ir)):
        a = np.ascontiguousarray(a)
        h.update(f"{name}:{a.dtype.str}:{a.shape};".encode())
        h.update(a.tobytes())
    return h.digest()


def handshake(plan_ir, info: GroupInfo, q, k, timeout: float) -> None:
    """Prove every rank of the group holds the same plan and inputs of the same
    dtype and shape; once per (plan, group, dtype, shapes)."""
    plan = _plan_ir(plan_ir)
    key = (id(plan), id(info.group), info.ranks, q.dtype, tuple(q.shape[1:]), tuple(k.shape[1:]))
    if key in _HANDSHAKES:
        _HANDSHAKES.move_to_end(key)
        return
    if info.size > 1:
        if info.backend == "gloo":
            try:
                dist.monitored_barrier(info.group, timeout=_td(timeout), wait_all_ranks=True)
            except RuntimeError as e:
                msg = str(e).splitlines()[0]
                raise TransportError(f"device {info.rank} (rank {info.ranks[info.rank]}): plan handshake: not every "
                                     f"rank joined within {timeout:g} s [{msg[:200]}]") from None
        h = np.frombuffer(plan_fingerprint(plan)[:16], dtype=np.int64)
        mine = torch.tensor([int(h[0]), int(h[1]), _DTYPE_CODE[q.dtype], q.shape[1], q.shape[2], k.shape[1],
                             k.shape[2], plan.devices], dtype=torch.int64, device=q.device)
        allv = [torch.empty_like(mine) for _ in range(info.size)]
        try:
            w = dist.all_gather(allv, mine, group=info.group, async_op=True)
            w.wait(_td(timeout))
        except RuntimeError as e:
            msg = str(e).splitlines()[0]
            raise TransportError(f"device {info.rank} (rank {info.ranks[info.rank]}): plan handshake did not "
                                 f"complete within {timeout:g} s [{msg[:200]}]") from None
        rows = torch.stack(allv).tolist()
        plans: dict = {}
        for r, row in enumerate(rows):
            plans.setdefault(tuple(row[:2]) + (row[7],), []).append(r)
        if len(plans) > 1:
            groups = "; ".join(f"device(s) {', '.join(map(str, rs))} hold plan {a & 0xffffffffffff:012x} "
                               f"for {n} devices" for (a, _, n), rs in plans.items())
            raise PlanError(f"device {info.rank}: the ranks hold different plans ({groups}); every rank must "
                            f"run the same plan (same batch, mask, options and device count)")
        shapes: dict = {}
        names = {v: str(k_).replace("torch.", "") for k_, v in _DTYPE_CODE.items()}
        for r, row in enumerate(rows):
            shapes.setdefault((names[row[2]],) + tuple(row[3:7]), []).append(r)
        if len(shapes) > 1:
            desc = "; ".join(f"device(s) {', '.join(map(str, rs))}: {dt} q heads/dim {a}/{b}, kv {c}/{d}"
                             for (dt, a, b, c, d), rs in shapes.items())
            raise ShapeError(f"device {info.rank}: the ranks' inputs differ in dtype or shape ({desc})")
    _HANDSHAKES[key] = plan
    while len(_HANDSHAKES) > 16:
        _HANDSHAKES.popitem(last=False)


def _next_generation(plan_ir, info: GroupInfo) -> int:
    """A per-group call counter (every rank calls attention in the same order)."""
    key = (id(info.group), info.ranks)
    n = _GENERATIONS.get(key, 0)
    _GENERATIONS[key] = n + 1
    window = max(1, min(1 << 12, _MAX_TAG // max(1, len(plan_ir.program.messages))))
    return n % window


# execution ---------------------------------------------------------------------------

@dataclass
class _Call:
    """Everything one attention call's forward and backward need."""

    ir: PlanIR
    info: GroupInfo | None
    device: int
    generation: int
    scale: float
    timeout: float
    timings: Timings | None
    compute: bool = True
    match: str = "tag"
    kept: dict | None = None  # after the forward: the buffers its backward keeps (Problem.keep_kv)

    def run(self, phase: int, tensors: dict, dtype) -> None:
        g, prog = self.ir.graph, self.ir.program
        row0 = layout.local_row0(self.ir, self.device)
        if self.info is None:
            tr: Any = _LocalTransport()
        elif self.ir.need_schedule().collective:  # comm{mode=a2a}: each exchange one all_to_all_single
            tr = CollectiveTransport(prog, phase, self.device, self.info, self.timeout)
        else:
            tr = TorchTransport(prog, self.device, self.info, self.generation, self.timeout, self.match)
        home = home_bindings(g, prog, phase, self.device, tensors, row0)
        if phase == BWD and self.kept is not None:
            home.update(kept_bindings(prog, self.device, self.kept))
        runner = DeviceRunner(g, prog, phase, self.device, home, tr, self.scale, dtype, self.timings, self.compute,
                              where=tensors["q"].device)
        runner.run()
        tr.drain()
        self.kept = runner.kept() if phase == FWD and self.ir.problem.keep_kv else None


class DistAttention(torch.autograd.Function):
    """This rank's share of attention under the plan, forward and backward.

    Forward returns the local out (input dtype); backward runs the plan's
    backward stream with the merged local out and lse — each block's
    backward needs the *global* softmax statistics of its rows, which the
    home merge produced — and returns the local dq, dk, dv."""

    @staticmethod
    def forward(ctx, q, k, v, call: _Call):
        T, Hq, D = q.shape
        acc = acc_dtype(q.dtype)
        out = torch.zeros(T, Hq, D, dtype=acc, device=q.device)
        lse = torch.full((T, Hq), NEG_INF, dtype=acc, device=q.device)
        call.run(FWD, {"q": q.detach(), "k": k.detach(), "v": v.detach(), "out": out, "lse": lse}, q.dtype)
        p = call.ir.problem
        settle_rows_without_mass(out, lse, layout.local_index(call.ir, call.device), p.pieces.a,
                                 p.class_heads(ir_order=True))
        res = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, res, lse)
        ctx.call = call
        return res

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        acc = acc_dtype(q.dtype)
        grads = {n: torch.zeros(t.shape, dtype=acc, device=q.device) for n, t in (("dq", q), ("dk", k), ("dv", v))}
        ctx.call.run(BWD, {"q": q.detach(), "k": k.detach(), "v": v.detach(), "out": out, "lse": lse,
                           "dout": dout.contiguous().to(q.dtype), **grads}, q.dtype)
        return grads["dq"].to(q.dtype), grads["dk"].to(k.dtype), grads["dv"].to(v.dtype), None


def _prepare(plan_ir, q, k, v, group, timeout):
    """Check the plan, the group, the inputs and the timeout, and hand shake;
    all before the first transfer. Returns (ir, group info, rank, timeout)."""
    ir = _plan_ir(plan_ir)
    timeout = resolve_timeout(timeout)
    if ir.devices == 1 and not (dist.is_available() and dist.is_initialized()):
        info, rank = None, 0
    else:
        info = resolve_group(ir, group)
        rank = info.rank
    check_inputs(ir, q, k, v, tokens=layout.local_tokens(ir, rank), where=f"device {rank}: ")
    if info is not None:
        check_backend(info, q.device, f"device {rank}: ")
        handshake(ir, info, q, k, timeout)
    return ir, info, rank, timeout


def attention(q, k, v, plan_ir, group=None, *, softmax_scale: float | None = None, timeout: float | None = None,
              timings: Timings | None = None, match: str | None = None):
    """Attention of this rank's local tokens under ``plan_ir`` (a compiled
    :class:`~attnplan.ir.module.PlanIR`: ``plan.ir``); autograd-aware.

    ``q [T_local, Hq, D]``, ``k``/``v [T_local, Hkv, D]`` in the plan's local
    layout (``plan.dispatch``). Returns the local output ``[T_local, Hq, D]``
    in q's dtype. Any strides: q, k, v are made contiguous once here (the
    gradients come back in the caller's layout). ``group``: the process
    group whose rank ``d`` is the plan's device ``d`` (default: the default
    group). ``softmax_scale``: a finite number > 0 (default 1/sqrt(head_dim);
    :class:`ShapeError` otherwise). ``timeout``: seconds a transfer may take
    before :class:`TransportError` (default ``$ATTNPLAN_TIMEOUT`` or 300).
    ``timings``: a :class:`~attnplan.runtime.runner.Timings` that
    accumulates this rank's kernel, wait and wall seconds, forward and
    backward. ``match``: ``"tag"`` (default, or ``$ATTNPLAN_MATCH``) or
    ``"order"`` (one tag: messages matched by posting order, as NCCL does).
    A one-device plan also runs without torch.distributed. A cross-attention
    plan takes this rank's query rows ``q [Tq_local, Hq, D]`` and key rows
    ``k``/``v [Tk_local, Hkv, D]`` (``plan.dispatch(x, side="q" | "k")``) and
    returns ``[Tq_local, Hq, D]``."""
    kw = dict(softmax_scale=softmax_scale, timeout=timeout, timings=timings, match=match)
    if _plan_ir(plan_ir).problem.q_lens is not None:
        return _cross_attention(q, k, v, plan_ir, group, **kw)
    return _packed_attention(q, k, v, plan_ir, group, **kw)


def _packed_attention(q, k, v, plan_ir, group, *, softmax_scale, timeout, timings, match):
    """:func:`attention` on the packed local layout (both sides of cross-attention samples)."""
    scale = resolve_scale(softmax_scale, _plan_ir(plan_ir).problem.head_dim)
    match = resolve_match(match)
    ir, info, rank, timeout = _prepare(plan_ir, q, k, v, group, timeout)
    gen = 0 if info is None else _next_generation(ir, info)
    q, k, v = order_heads(ir, q.contiguous()), expand_kv(ir, k.contiguous()), expand_kv(ir, v.contiguous())
    out = DistAttention.apply(q, k, v, _Call(ir, info, rank, gen, scale, timeout, timings, match=match))
    return restore_heads(ir, out)


def _cross_attention(q, k, v, plan_ir, group, **kw):
    """:func:`attention` of a cross-attention plan: this rank's query and key
    rows placed on its local layout (zeros on the other side), the output's
    query rows returned."""
    ir = _plan_ir(plan_ir)
    if ir.devices == 1 and not (dist.is_available() and dist.is_initialized()):
        rank = 0
    else:
        rank = resolve_group(ir, group).rank
    (rq, _), (rk, _) = layout.side_rows(ir, rank, "q"), layout.side_rows(ir, rank, "k")
    check_inputs(ir, q, k, v, tokens=len(rq), k_tokens=len(rk), where=f"device {rank}: ")
    n = layout.local_tokens(ir, rank)
    out = _packed_attention(embed(q, rq, n), embed(k, rk, n), embed(v, rk, n), ir, group, **kw)
    return out.index_select(0, torch.from_numpy(rq).to(out.device))


def replay_comm(plan_ir, q, k, v, group=None, timeout: float | None = None) -> dict:
    """Run only the transfers of the plan's forward and backward streams (no
    kernels; partials travel as zeros). Returns this rank's wall seconds per
    phase: the plan's transfer time when nothing hides it."""
    import time
    ir, info, rank, timeout = _prepare(plan_ir, q, k, v, group, timeout)
    k, v = expand_kv(ir, k), expand_kv(ir, v)
    res = {}
    for phase in (FWD, BWD):
        call = _Call(ir, info, rank, 0 if info is None else _next_generation(ir, info), 1.0, timeout, None,
                     compute=False)
        T, Hq, D = q.shape
        acc = acc_dtype(q.dtype)
        dev = q.device
        t = {"q": q, "k": k, "v": v, "out": torch.zeros(T, Hq, D, dtype=acc if phase == FWD else q.dtype, device=dev),
             "lse": torch.zeros(T, Hq, dtype=acc, device=dev), "dout": q,
             "dq": torch.zeros(q.shape, dtype=acc, device=dev), "dk": torch.zeros(k.shape, dtype=acc, device=dev),
             "dv": torch.zeros(v.shape, dtype=acc, device=dev)}
        t0 = time.perf_counter()
        call.run(phase, t, q.dtype)
        res[PHASES[phase]] = time.perf_counter() - t0
    return res


# dispatch / undispatch ------------------------------------------------------------------

def _side(plan_ir, side, what: str):
    """``side`` checked: None for a self-attention plan, ``"q"`` or ``"k"`` (required for cross-attention)."""
    if side not in layout.SIDES:
        raise ShapeError(f"{what}: side must be 'q', 'k' or None, got {side!r}")
    if side is None and plan_ir.problem.q_lens is not None:
        raise ShapeError(f"{what}: a cross-attention plan has two token axes: say side='q' (queries, outputs) "
                         f"or side='k' (keys, values)")
    return side


def _side_index(plan_ir, rank: int, side) -> tuple[np.ndarray, int]:
    """(``rank``'s local rows of ``side`` as indices into that side's tokens, the side's token count)."""
    p = plan_ir.problem
    count = p.tokens if side is None else len(p.query_index() if side == "q" else p.key_index())
    return layout.side_rows(plan_ir, rank, side)[1], count


def dispatch(plan_ir, x, rank: int, side: str | None = None):
    """Rows of ``x`` (global token axis first) owned by ``rank``, in local
    order; ``side`` ``"q"``/``"k"``: the query/key tokens of a cross-attention plan."""
    side = _side(plan_ir, side, "dispatch")
    idx, T = _side_index(plan_ir, rank, side)
    if not hasattr(x, "shape") or len(x.shape) < 1 or x.shape[0] != T:
        what = "tokens" if side is None else "query tokens" if side == "q" else "key tokens"
        raise ShapeError(f"dispatch: expected a tensor with the batch's {T} {what} first, got shape "
                         f"{list(getattr(x, 'shape', [])) or type(x).__name__}")
    if isinstance(x, torch.Tensor):
        return x.index_select(0, torch.from_numpy(idx).to(x.device))
    return np.asarray(x)[idx]


class _Undispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan_ir, info: GroupInfo, timeout: float, side=None):
        idx = [_side_index(plan_ir, d, side)[0] for d in range(plan_ir.devices)]
        n = max(len(i) for i in idx)
        wire = x.detach().contiguous()
        pad = torch.zeros((n,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        pad[:x.shape[0]] = wire
        parts = [torch.empty_like(pad) for _ in range(info.size)]
        try:
            w = dist.all_gather(parts, pad, group=info.group, async_op=True)
            w.wait(_td(timeout))
        except RuntimeError as e:
            raise TransportError(f"device {info.rank}: undispatch (all_gather of outputs) did not complete within "
                                 f"{timeout:g} s [{str(e).splitlines()[0][:200]}]") from None
        out = torch.empty((_side_index(plan_ir, info.rank, side)[1],) + tuple(x.shape[1:]), dtype=x.dtype,
                          device=x.device)
        for d, i in enumerate(idx):
            out[torch.from_numpy(i).to(x.device)] = parts[d][:len(i)]
        ctx.idx = torch.from_numpy(idx[info.rank]).to(x.device)
        return out

    @staticmethod
    def backward(ctx, g):
        # No collective in autograd: y_global is replicated, every rank computes the same
        # function of it, and this rank's rows are its own share of the gradient.
        return g.index_select(0, ctx.idx), None, None, None, None


def undispatch(plan_ir, x_local, group=None, timeout: float | None = None, side: str | None = None):
    """Gather every rank's local rows into the global token order, on every
    rank (``side``: as for :func:`dispatch`)."""
    ir = _plan_ir(plan_ir)
    side = _side(ir, side, "undispatch")
    if ir.devices == 1 and not (dist.is_available() and dist.is_initialized()):
        idx, T = _side_index(ir, 0, side)
        if not isinstance(x_local, torch.Tensor) or x_local.shape[0] != T:
            raise ShapeError(f"undispatch: expected {T} local rows, got "
                             f"{list(getattr(x_local, 'shape', []))}")
        return x_local.index_select(0, torch.from_numpy(idx).argsort().to(x_local.device))
    info = resolve_group(ir, group)
    n = len(_side_index(ir, info.rank, side)[0])
    if not isinstance(x_local, torch.Tensor) or x_local.dim() < 1 or x_local.shape[0] != n:
        raise ShapeError(f"undispatch: device {info.rank} holds {n} tokens, got shape "
                         f"{list(getattr(x_local, 'shape', [])) or type(x_local).__name__}")
    return _Undispatch.apply(x_local, ir, info, resolve_timeout(timeout), side)
