"""``plan run``: execute a plan on random inputs and compare with dense masked
attention in float64, computed one sample at a time (nothing attends across
samples, so the reference never builds a T × T matrix)."""

from __future__ import annotations

import math

import numpy as np
import torch

from ..errors import PlanError
from ..ir.mask import K0, Q0
from ..ir.module import PlanIR
from .executor import embed, execute
from .reference import dense_allowed, dense_attention

# max abs error / max(1, max |reference|), per dtype and tensor. bf16 keeps 8
# mantissa bits; its gradients also carry the op's own bf16 backward error
# (about 1e-2 relative on a single untiled call) plus one bf16 rounding per tile.
# float16 keeps 11 bits: bf16's tolerances / 8 (measured on every strategy, 2 seeds: 3.6e-4 out and 1.8e-3
# gradients at most, against bf16's 3.0e-3 and 1.2e-2).
TOLERANCE = {"float32": {"out": 1e-5, "dq": 1e-5, "dk": 1e-5, "dv": 1e-5},
             "bfloat16": {"out": 1e-2, "dq": 4e-2, "dk": 4e-2, "dv": 4e-2},
             "float16": {"out": 1.25e-3, "dq": 5e-3, "dk": 5e-3, "dv": 5e-3}}
MAX_CHECK_SAMPLE = 8192
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _ir(plan) -> PlanIR:
    """The PlanIR to run: ``plan`` itself, or the ``.ir`` of an object holding one."""
    ir = plan if isinstance(plan, PlanIR) else getattr(plan, "ir", None)
    if not isinstance(ir, PlanIR):
        raise PlanError(f"expected a PlanIR (plan.ir), got {type(plan).__name__}")
    return ir


def random_inputs(plan, dtype: str, seed: int):
    """Standard-normal q, k, v, dout for ``plan`` (a PlanIR, or an object
    holding one as ``.ir``) from an explicit ``seed`` in [0, 2^63)."""
    if dtype not in DTYPES:
        raise PlanError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 63:
        raise PlanError(f"seed must be an integer in [0, 2^63), got {seed!r}"[:200])
    p = _ir(plan).problem
    gen = torch.Generator().manual_seed(seed)
    Tq, Tk = len(p.query_index()), len(p.key_index())  # both the whole batch unless cross-attention

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(DTYPES[dtype])

    return r(Tq, p.heads, p.head_dim), r(Tk, p.kv_heads, p.head_dim), r(Tk, p.kv_heads, p.head_dim), \
        r(Tq, p.heads, p.head_dim)


def run_plan(plan, dtype: str = "float32", seed: int = 0, device: str = "cpu"):
    """Forward and backward on random inputs on ``device`` (every plan device
    in this process, on that one torch device); returns (out, dq, dk, dv,
    inputs), all on the CPU."""
    cpu = random_inputs(plan, dtype, seed)
    q, k, v, dout = (t.to(device) for t in cpu)
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    out = execute(_ir(plan), q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return out.detach().cpu(), dq.cpu(), dk.cpu(), dv.cpu(), tuple(t.detach() for t in cpu)


def reference(problem, q, k, v, dout, scale: float, chunk_elems: int = 1 << 22):
    """:func:`packed_reference`; for cross-attention (``q``, ``dout`` of the
    queries, ``k``, ``v`` of the keys) on the packed axis, zeros on the other
    side, and sliced back."""
    if problem.q_lens is None:
        return packed_reference(problem, q, k, v, dout, scale, chunk_elems)
    qi, ki, T = problem.query_index(), problem.key_index(), problem.tokens
    out, (dq, dk, dv) = packed_reference(problem, embed(q, qi, T), embed(k, ki, T), embed(v, ki, T),
                                         embed(dout, qi, T), scale, chunk_elems)
    qt, kt = torch.from_numpy(qi), torch.from_numpy(ki)
    return out[qt], [dq[qt], dk[kt], dv[kt]]


def packed_reference(problem, q, k, v, dout, scale: float, chunk_elems: int = 1 << 22):
    """Dense float64 out and gradients, sample by sample, on the packed axis.

    Exact softmax attention and its gradient in closed form (``P = softmax(S)``,
    ``dS = P ∘ (dO·Vᵀ − rowsum(dO ∘ O))``), computed for a few hundred query
    rows at a time, so an 8192-token sample needs tens of MB rather than the
    GBs autograd through a dense [H, L, L] graph holds (and runs about 2x faster).
    Rows with no allowed key have out 0 and zero gradients.
    ``reference_autograd`` is the plain autograd version it is tested against."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    dq = torch.zeros(q.shape, dtype=torch.float64)
    dk = torch.zeros(k.shape, dtype=torch.float64)
    dv = torch.zeros(v.shape, dtype=torch.float64)
    off = problem.offsets
    classes = problem.class_heads() or [(np.arange(problem.heads), problem.pieces.a)]
    rep = q.shape[1] // k.shape[1]
    for i in range(len(problem.seqlens)):
        a, b = int(off[i]), int(off[i + 1])
        L = b - a
        sels = [(heads, _sample_pieces(P, a, b)) for heads, P in classes]
        ke = k[a:b].to(torch.float64).repeat_interleave(rep, dim=1)  # [L, Hq, D]
        ve = v[a:b].to(torch.float64).repeat_interleave(rep, dim=1)
        dke, dve = torch.zeros_like(ke), torch.zeros_like(ve)
        kk = torch.arange(L).unsqueeze(0)
        step = max(1, chunk_elems // max(1, L * q.shape[1]))
        for r0 in range(0, L, step):
            r1 = min(L, r0 + step)
            qq = torch.arange(r0, r1).unsqueeze(1)
            masks = [_allowed(sel, qq, kk, r1 - r0, L) for _, sel in sels]
            if len(masks) == 1:  # one mask for every head: [1, rows, keys], broadcast
                allowed = masks[0][None]
            else:  # per-head masks: [H, rows, keys]
                allowed = torch.zeros((q.shape[1], r1 - r0, L), dtype=torch.bool)
                for (heads, _), m in zip(sels, masks):
                    allowed[torch.from_numpy(heads)] = m
            qc = q[a + r0:a + r1].to(torch.float64)
            doc = dout[a + r0:a + r1].to(torch.float64)
            s = torch.einsum("qhd,khd->hqk", qc, ke).mul_(scale).masked_fill_(~allowed, float("-inf"))
            m = s.amax(dim=-1, keepdim=True)
            p = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
            den = p.sum(dim=-1, keepdim=True)
            # rows without keys: out 0; rows whose allowed scores are all -inf (infinite inputs): 0/0 = NaN
            p.div_(torch.where(allowed.any(dim=2)[:, :, None], den, torch.ones_like(den)))  # rows without keys: 0
            oc = torch.einsum("hqk,khd->qhd", p, ve)
            delta = (doc * oc).sum(-1).transpose(0, 1).unsqueeze(-1)  # [H, c, 1]
            ds = p * (torch.einsum("qhd,khd->hqk", doc, ve) - delta)
            out[a + r0:a + r1] = oc
            dq[a + r0:a + r1] = torch.einsum("hqk,khd->qhd", ds, ke) * scale
            dke += torch.einsum("hqk,qhd->khd", ds, qc) * scale
            dve += torch.einsum("hqk,qhd->khd", p, doc)
        dk[a:b] = dke.view(L, k.shape[1], rep, -1).sum(2)
        dv[a:b] = dve.view(L, k.shape[1], rep, -1).sum(2)
    return out, [dq, dk, dv]


def _allowed(sel: torch.Tensor, qq: torch.Tensor, kk: torch.Tensor, rows: int, keys: int) -> torch.Tensor:
    """bool [rows, keys]: the pairs of rows ``qq`` and keys ``kk`` some piece of ``sel`` allows."""
    out = torch.zeros((rows, keys), dtype=torch.bool)
    for q0, q1, k0, k1, lo, hi in sel.tolist():
        out |= (qq >= q0) & (qq < q1) & (kk >= k0) & (kk < k1) & (kk - qq >= lo) & (kk - qq <= hi)
    return out


def _sample_pieces(P: np.ndarray, a: int, b: int) -> torch.Tensor:
    """The pieces of the sample ``[a, b)``, sample-relative."""
    sel = torch.from_numpy(P[(P[:, Q0] >= a) & (P[:, Q0] < b) & (P[:, K0] >= a) & (P[:, K0] < b)].copy())
    sel[:, :4] -= a
    return sel


def reference_autograd(problem, q, k, v, dout, scale: float):
    """Dense float64 out and gradients by autograd through ``dense_attention``, sample by sample."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    if problem.head_class is not None:
        raise PlanError("reference_autograd takes one mask for every head (reference handles per-head masks)")
    grads = [torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v)]
    off = problem.offsets
    P = problem.pieces.a
    for i in range(len(problem.seqlens)):
        a, b = int(off[i]), int(off[i + 1])
        sel = P[(P[:, Q0] >= a) & (P[:, Q0] < b) & (P[:, K0] >= a) & (P[:, K0] < b)].copy()
        sel[:, :4] -= a
        allowed = dense_allowed(sel, b - a)
        qs, ks, vs = (t[a:b].to(torch.float64).requires_grad_(True) for t in (q, k, v))
        o, _ = dense_attention(qs, ks, vs, allowed, scale)
        g = torch.autograd.grad(o, (qs, ks, vs), dout[a:b].to(torch.float64), allow_unused=True)
        out[a:b] = o.detach()
        for acc, x in zip(grads, g):
            if x is not None:
                acc[a:b] = x
    return out, grads


def check_size(plan) -> None:
    """The dense reference is built per sample: refuse samples over the limit."""
    biggest = int(_ir(plan).problem.seqlens.max())
    if biggest > MAX_CHECK_SAMPLE:
        raise PlanError(f"--check builds a dense reference per sample; the largest sample has {biggest} tokens "
                        f"(limit {MAX_CHECK_SAMPLE})")


def check_plan(plan, dtype: str = "float32", seed: int = 0, device: str = "cpu") -> dict:
    """Max abs errors of out, dq, dk, dv (run on ``device``) against the dense
    reference, scaled by max(1, max |reference|), and whether each is within
    tolerance."""
    check_size(plan)
    out, dq, dk, dv, inputs = run_plan(plan, dtype, seed, device)
    return compare(plan, dtype, (out, dq, dk, dv), inputs)


def compare(plan, dtype: str, got, inputs) -> dict:
    """Errors of ``got = (out, dq, dk, dv)`` (global layout) for ``inputs =
    (q, k, v, dout)`` against the dense float64 reference (see :func:`check_plan`)."""
    out, dq, dk, dv = got
    q, k, v, dout = inputs
    problem = _ir(plan).problem
    ref_out, (rq, rk, rv) = reference(problem, q, k, v, dout, 1.0 / math.sqrt(problem.head_dim))
    res: dict = {"tol": {}, "ok": True}
    for name, got, want in (("out", out, ref_out), ("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        err = float((got.to(torch.float64) - want).abs().max()) if want.numel() else 0.0
        err /= max(1.0, float(want.abs().max()) if want.numel() else 1.0)
        finite = bool(torch.isfinite(got).all())
        res[name] = err if finite else float("inf")
        res["tol"][name] = TOLERANCE[dtype][name]
        res["ok"] &= finite and err <= TOLERANCE[dtype][name]
    return res
