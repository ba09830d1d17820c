"""In-process executor: runs every device's program in one process.

Each device is a :class:`~attnplan.runtime.runner.DeviceRunner` (the same
runner the distributed executor uses) whose home buffers are views of the
global tensors. Devices take turns in the cooperative walk of
:mod:`attnplan.ir.interp`: a device runs until it waits on a message whose
other side is not yet posted. The transport is an in-memory mailbox: the data
of a message (the tensors of its transfers' buffers) moves when its second
side is posted (MPI semantics: a send's
tensors are not modified before its wait, which cannot pass before then). A
round in which no device moves raises :class:`DeadlockError` naming the
devices and messages.

Forward and backward go through :class:`PlanAttention`, a custom
``torch.autograd.Function``: every compute block's backward uses the global
(merged) out and lse of its query rows, as exactness requires.

What users hand in is checked here, at entry (:func:`check_inputs`,
:func:`resolve_scale`): shapes, dtype and device (:class:`ShapeError`), a
softmax scale that is a finite number > 0 (:class:`ShapeError`). Inputs of
any strides are made contiguous once, so every kernel reads the layout the
runtime's buffers use (the CPU op misreads a head_dim stride other than 1).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..errors import PlanError, ShapeError
from ..ir.interp import cooperate, message_key
from ..ir.module import PlanIR
from ..ir.program import BWD, FWD
from . import kernels
from .kernels import check_scale, settle_rows_without_mass
from .runner import NEG_INF, DeviceRunner, Timings, acc_dtype, home_bindings, kept_bindings

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class Mailbox:
    """In-memory transport shared by the devices of one phase."""

    def __init__(self, program):
        self.program = program
        self.posted: dict[int, tuple] = {}  # tag -> tensors of the side posted first

    def endpoint(self, device: int) -> "_Endpoint":
        return _Endpoint(self, device)

    def _meet(self, tag: int, src, dst) -> None:
        if len(src) != len(dst) or any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(src, dst)):
            raise PlanError(f"message {message_key(self.program, tag)}: the sender's buffers "
                            f"{[(tuple(a.shape), a.dtype) for a in src]} does not match the receiver's "
                            f"{[(tuple(b.shape), b.dtype) for b in dst]}")
        for a, b in zip(src, dst):
            b.copy_(a)


class _Endpoint:
    def __init__(self, box: Mailbox, device: int):
        self.box, self.device = box, device

    def post_send(self, tag: int, peer: int, tensors, flat=None) -> None:
        other = self.box.posted.pop(tag, None)
        if other is None:
            self.box.posted[tag] = tuple(tensors)
        else:
            self.box._meet(tag, tensors, other)

    def post_recv(self, tag: int, peer: int, tensors, flat=None) -> None:
        other = self.box.posted.pop(tag, None)
        if other is None:
            self.box.posted[tag] = tuple(tensors)
        else:
            self.box._meet(tag, other, tensors)

    def wait(self, tag: int) -> None:
        """The walk lets a wait pass only once both sides are posted, when the data already moved."""


def check_inputs(plan_ir, q, k, v, tokens: int | None = None, where: str = "", k_tokens: int | None = None) -> None:
    """Shapes ``[tokens, heads, head_dim]`` (``tokens`` defaults to the whole
    batch; k and v have ``k_tokens``, default ``tokens``), one floating
    dtype, dense CPU tensors; else :class:`ShapeError`. The plan must be
    compiled down to programs (:class:`PlanError`)."""
    if not isinstance(plan_ir, PlanIR):
        raise PlanError(f"the runtime takes a PlanIR (plan.ir), got {type(plan_ir).__name__}")
    if plan_ir.program is None or plan_ir.graph is None:
        raise PlanError("this PlanIR has no per-device programs yet: run the pipeline through emit first")
    p = plan_ir.problem
    T = p.tokens if tokens is None else tokens
    Tk = T if k_tokens is None else k_tokens
    for name, t, heads in (("q", q, p.heads), ("k", k, p.kv_heads), ("v", v, p.kv_heads)):
        if not isinstance(t, torch.Tensor):
            raise ShapeError(f"{where}{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise ShapeError(f"{where}{name} must be a dense (strided) tensor, got layout {t.layout}")
        n = T if name == "q" else Tk
        if t.dim() != 3 or tuple(t.shape) != (n, heads, p.head_dim):
            what = "tokens" if T == Tk else "query tokens" if name == "q" else "key tokens"
            raise ShapeError(f"{where}{name} must have shape [{what}={n}, heads={heads}, head_dim={p.head_dim}], "
                             f"got {list(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise ShapeError(f"{where}{name} has dtype {t.dtype}; expected float32, bfloat16, float16 or float64")
    if not (q.dtype == k.dtype == v.dtype):
        raise ShapeError(f"{where}q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ShapeError(f"{where}q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type not in kernels.DEVICE_TYPES:
        raise ShapeError(f"{where}q, k, v are on {q.device}; the runtime runs on CPU and CUDA tensors")


def embed(t: torch.Tensor, rows: np.ndarray, n: int) -> torch.Tensor:
    """``t`` as rows ``rows`` of an ``n``-row tensor, zeros elsewhere (a
    cross-attention side on the packed axis); differentiable."""
    return t.new_zeros((n,) + tuple(t.shape[1:])).index_copy(0, torch.from_numpy(rows).to(t.device), t)


def expand_kv(plan_ir, t: torch.Tensor) -> torch.Tensor:
    """``k`` or ``v`` ``[T, kv_heads, D]`` as the plan's head groups see it:
    with KV-head replication (``graph.kv_rep = r > 1``) every kv head copied
    ``r`` times, ``[T, kv_heads·r, D]`` (copy ``j`` is head ``j // r``);
    differentiable, so the copies' gradients sum back into the head."""
    r = plan_ir.graph.kv_rep
    return t if r == 1 else t.repeat_interleave(r, dim=1)


def order_heads(plan_ir, q: torch.Tensor) -> torch.Tensor:
    """``q`` (or any ``[T, Hq, ...]``) with its query heads in the plan's head
    order (:meth:`Problem.head_order`: per-head masks group each kv head's
    query heads by mask class); differentiable; ``q`` itself when unchanged."""
    order = plan_ir.problem.head_order()
    return q if order is None else q.index_select(1, torch.from_numpy(order).to(q.device))


def restore_heads(plan_ir, out: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`order_heads`."""
    order = plan_ir.problem.head_order()
    return out if order is None else out.index_select(1, torch.from_numpy(np.argsort(order)).to(out.device))


def resolve_scale(softmax_scale, head_dim: int) -> float:
    """The softmax scale: ``softmax_scale`` if given (a finite number > 0,
    else :class:`ShapeError`), else 1/sqrt(head_dim)."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    return check_scale(softmax_scale)


RESULTS = {FWD: ("out", "lse"), BWD: ("dq", "dk", "dv")}  # the tensors a phase writes


def inputs_finite(phase: int, t: dict) -> torch.Tensor:
    """Whether every input of a phase is finite, as a 0-dim bool tensor on
    their device (one check of the global tensors instead of one per tile;
    an lse of −inf, a row without keys, counts as finite)."""
    if phase == FWD:
        return kernels.finite_flag(t["q"], t["k"], t["v"])
    lse = t["lse"]
    return kernels.finite_flag(t["q"], t["k"], t["v"], t["out"], t["dout"],
                               torch.where(torch.isneginf(lse), torch.zeros((), dtype=lse.dtype, device=lse.device),
                                           lse))


def optimistic(device: torch.device) -> bool:
    """Whether a phase runs before its finiteness check is read (GPUs: a read is a host sync)."""
    return device.type != "cpu"


RESET = {"out": 0.0, "lse": NEG_INF, "dq": 0.0, "dk": 0.0, "dv": 0.0}  # what the results hold before a phase


def _run_all(plan_ir, phase: int, tensors: dict, scale: float, dtype, timings: Timings | None,
             kept: list | None = None) -> list:
    """Run ``phase``, its kernels told whether the inputs are finite. On a GPU the check is not read before
    the kernels are queued (a host sync would idle the device): the phase runs as if finite, and in the
    rare case it was not, runs again from reset results with every tile checking its own inputs (the
    exact path for non-finite operands)."""
    flag = inputs_finite(phase, tensors)
    if not optimistic(tensors["q"].device):
        return _run_layout(plan_ir, phase, tensors, scale, dtype, timings, bool(flag), kept)
    out = _run_layout(plan_ir, phase, tensors, scale, dtype, timings, True, kept)
    if not bool(flag):
        for n in RESULTS[phase]:
            tensors[n].fill_(RESET[n])
        out = _run_layout(plan_ir, phase, tensors, scale, dtype, timings, False, kept)
    return out


def _run_layout(plan_ir, phase: int, tensors: dict, scale: float, dtype, timings: Timings | None,
                finite: bool, kept: list | None = None) -> list:
    """Every device's stream of ``phase`` on the global ``tensors``: varlen groups whose spans are not in
    token order run on block-major copies, their results written back."""
    g = plan_ir.graph
    rows_np = g.block_rows(np.arange(g.n_tb)) if g.grouped else None
    if rows_np is not None and bool((rows_np == np.arange(len(rows_np))).all()):
        rows_np = None  # the groups' spans are already in token order: no copies
    lens = g.tb_len
    if rows_np is None:
        return _run_devices(plan_ir, phase, tensors, np.cumsum(lens) - lens, scale, dtype, timings, finite, kept)
    rows = torch.from_numpy(rows_np).to(tensors["q"].device)
    local = {n: t.index_select(0, rows) for n, t in tensors.items()}
    out = _run_devices(plan_ir, phase, local, np.cumsum(lens) - lens, scale, dtype, timings, finite, kept)
    for n in RESULTS[phase]:
        tensors[n].index_copy_(0, rows, local[n])
    return out


def _run_devices(plan_ir, phase: int, tensors: dict, row0: np.ndarray, scale: float, dtype,
                 timings: Timings | None, finite: bool, kept: list | None = None) -> list:
    """Every device's program of ``phase`` on ``tensors``, block ``tb``'s rows starting at ``row0[tb]``.
    Returns each device's buffers its backward keeps (forward; ``kept``: the backward's, from the forward)."""
    g, prog = plan_ir.graph, plan_ir.program
    box = Mailbox(prog)
    runners = [DeviceRunner(g, prog, phase, d, {**home_bindings(g, prog, phase, d, tensors, row0),
                                                **(kept_bindings(prog, d, kept[d]) if kept else {})},
                            box.endpoint(d), scale, dtype, timings, where=tensors["q"].device, finite=finite)
               for d in range(prog.devices)]
    cooperate(prog, phase, lambda d, i, row: runners[d].step(i, row))
    return [r.kept() for r in runners]


def run_forward(plan_ir, q, k, v, scale: float, timings: Timings | None = None, kept: list | None = None):
    """Execute the forward programs. Returns (out [T, Hq, D], lse [T, Hq]) in
    the accumulator dtype (float32; float64 for float64 inputs). ``kept``: a
    list that receives every device's buffers its backward keeps (``Problem.keep_kv``)."""
    T, Hq, D = q.shape
    acc = acc_dtype(q.dtype)
    out = torch.zeros(T, Hq, D, dtype=acc, device=q.device)
    lse = torch.full((T, Hq), NEG_INF, dtype=acc, device=q.device)
    held = _run_all(plan_ir, FWD, {"q": q, "k": k, "v": v, "out": out, "lse": lse}, scale, q.dtype, timings)
    if kept is not None:
        kept[:] = held
    p = plan_ir.problem
    settle_rows_without_mass(out, lse, np.arange(T), p.pieces.a, p.class_heads(ir_order=True))
    return out, lse


def run_backward(plan_ir, q, k, v, out, lse, dout, scale: float, timings: Timings | None = None,
                 kept: list | None = None):
    """Execute the backward programs with the global out/lse. Returns (dq, dk, dv)
    in the accumulator dtype. ``kept``: what :func:`run_forward` kept (a plan
    with ``keep_kv`` needs it)."""
    acc = acc_dtype(q.dtype)
    grads = {n: torch.zeros(t.shape, dtype=acc, device=q.device) for n, t in (("dq", q), ("dk", k), ("dv", v))}
    _run_all(plan_ir, BWD, {"q": q, "k": k, "v": v, "out": out, "lse": lse, "dout": dout, **grads}, scale,
             q.dtype, timings, kept)
    return grads["dq"], grads["dk"], grads["dv"]


class PlanAttention(torch.autograd.Function):
    """out = attention(q, k, v) under the plan's mask, computed block by block."""

    @staticmethod
    def forward(ctx, q, k, v, plan_ir, scale, timings=None):
        kept: list = []
        out, lse = run_forward(plan_ir, q.detach(), k.detach(), v.detach(), scale, timings, kept)
        res = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, res, lse)
        ctx.plan_ir, ctx.scale, ctx.timings = plan_ir, scale, timings
        ctx.kept = kept if plan_ir.problem.keep_kv else None  # the KV blocks each device received, for the backward
        return res

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = run_backward(ctx.plan_ir, q.detach(), k.detach(), v.detach(), out, lse,
                                  dout.contiguous().to(q.dtype), ctx.scale, ctx.timings, ctx.kept)
        ctx.kept = None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def execute(plan_ir, q, k, v, softmax_scale: float | None = None, timings: Timings | None = None):
    """Attention of global ``q [T, Hq, D]``, ``k``/``v [T, Hkv, D]`` under
    ``plan_ir`` (``plan.ir``), every device in this process; differentiable.
    Any strides (made contiguous once here; gradients come back in the
    caller's layout); bad inputs raise :class:`ShapeError`. A cross-attention
    plan takes ``q [Tq, Hq, D]`` and ``k``/``v [Tk, Hkv, D]`` (every sample's
    queries, every sample's keys) and returns ``[Tq, Hq, D]``."""
    p = plan_ir.problem if isinstance(plan_ir, PlanIR) else None
    if p is None or p.q_lens is None:
        return _execute_packed(plan_ir, q, k, v, softmax_scale, timings)
    qi, ki = p.query_index(), p.key_index()
    check_inputs(plan_ir, q, k, v, tokens=len(qi), k_tokens=len(ki))
    q, k, v = embed(q, qi, p.tokens), embed(k, ki, p.tokens), embed(v, ki, p.tokens)
    return _execute_packed(plan_ir, q, k, v, softmax_scale, timings).index_select(0, torch.from_numpy(qi).to(q.device))


def _execute_packed(plan_ir, q, k, v, softmax_scale, timings):
    """:func:`execute` on the packed token axis (both sides of cross-attention samples)."""
    check_inputs(plan_ir, q, k, v)
    scale = resolve_scale(softmax_scale, plan_ir.problem.head_dim)
    k, v = expand_kv(plan_ir, k.contiguous()), expand_kv(plan_ir, v.contiguous())
    q = order_heads(plan_ir, q.contiguous())
    return restore_heads(plan_ir, PlanAttention.apply(q, k, v, plan_ir, scale, timings))
