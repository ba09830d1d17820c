"""Functions run on every rank of a local gloo group by tests/test_distributed.py
(through ``attnplan.tools.launch.run_local``); each returns plain data that
the test asserts on. Not a test module: pytest does not collect it."""

import time

import torch

import attnplan
from attnplan.runtime.check import random_inputs

CASES = [
    dict(seqlens=[300, 77, 500, 20], mask="shared_question(2, 0.2)", block_size=64, dtype="float32"),
    dict(seqlens=[129, 1, 64, 250], mask="causal", block_size=32, dtype="float32"),
    dict(seqlens=[200, 37], mask="sliding_window(24) | (k < 3 & k <= q)", block_size=16, dtype="float32"),
    dict(seqlens=[180, 90, 33], mask="causal_blockwise(8, 2)", block_size=32, dtype="bfloat16"),
]


def _compile(case, devices, strategy, **over):
    """``strategy``: a registered name, or a pipeline (its ``{block}`` is the case's block size)."""
    kw = dict(heads=4, kv_heads=2, head_dim=16, devices=devices)
    kw.update(case)
    kw.update(over)
    if "," in strategy:
        kw["pipeline"] = strategy.replace("{block}", str(kw["block_size"]))
    else:
        kw["strategy"] = strategy
    return attnplan.compile(**kw)


def equals_in_process(rank, world, cases, strategies, match="tag", over=None):
    """Every (case index, strategy): the local out/dq/dk/dv and the gathered
    global ones equal the in-process executor's bit for bit (``over``: compile
    options that replace the defaults, e.g. ``kv_heads``). Returns the failures
    and how many ran (with the KV-head copies of each plan that ran, and the
    all_to_all_single calls each made: comm{mode=a2a} runs as collectives)."""
    bad, ran, reps, a2a = [], 0, [], []
    real, calls = torch.distributed.all_to_all_single, [0]

    def counted(*args, **kw):
        calls[0] += 1
        return real(*args, **kw)
    torch.distributed.all_to_all_single = counted
    for ci in cases:
        case = CASES[ci]
        for s in strategies:
            try:
                plan = _compile(case, world, s, **(over or {}))
            except attnplan.PlanError as e:
                if "not supported" in str(e):
                    continue
                raise
            q, k, v, dout = random_inputs(plan, case["dtype"], ci)
            before = calls[0]
            ql, kl, vl = (plan.dispatch(t).requires_grad_(True) for t in (q, k, v))
            out = attnplan.attention(ql, kl, vl, plan, timeout=60, match=match)
            grads = torch.autograd.grad(out, (ql, kl, vl), plan.dispatch(dout))
            a2a.append(calls[0] - before)
            full = [plan.undispatch(x.detach()) for x in (out, *grads)]
            if rank == 0:  # the in-process executor, once
                qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
                ref = attnplan.execute(plan, qg, kg, vg)
                want = [ref.detach(), *torch.autograd.grad(ref, (qg, kg, vg), dout)]
                for name, got, g, w in zip(("out", "dq", "dk", "dv"), (out, *grads), full, want):
                    if got.dtype != w.dtype or not torch.equal(got.detach(), plan.dispatch(w)):
                        bad.append(f"case {ci} {s}: rank 0's {name} differs")
                    if not torch.equal(g, w):
                        bad.append(f"case {ci} {s}: gathered {name} differs")
            ran += 1
            reps.append(plan.ir.graph.kv_rep)
    torch.distributed.all_to_all_single = real
    return {"bad": bad, "ran": ran, "kv_rep": reps, "a2a_calls": a2a}


def autograd_training_step(rank, world):
    """A tiny step through dispatch -> attention -> undispatch -> loss, twice
    (two attention calls, so two generations of tags), against the same step
    in one process with attnplan.execute. Returns max abs differences."""
    plan = _compile(CASES[0], world, "zigzag")
    p = plan.problem
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(p.tokens, 8, generator=gen)
    w = torch.randn(8, 3 * p.heads * p.head_dim, generator=gen, requires_grad=True)

    def step(attn, xs):
        qkv = (xs @ w).view(xs.shape[0], 3, p.heads, p.head_dim)
        q, k, v = qkv[:, 0], qkv[:, 1, :p.kv_heads].contiguous(), qkv[:, 2, :p.kv_heads].contiguous()
        o = attn(q.contiguous(), k, v)
        return attn(o, k, v)

    y_local = step(lambda q, k, v: attnplan.attention(q, k, v, plan), plan.dispatch(x))
    y = plan.undispatch(y_local)
    loss = (y.square() * torch.linspace(0, 1, p.tokens)[:, None, None]).sum()
    (gw,) = torch.autograd.grad(loss, w)
    torch.distributed.all_reduce(gw)  # per-rank shares of the parameter gradient sum to the full one
    y1 = step(lambda q, k, v: attnplan.execute(plan, q, k, v), x)
    loss1 = (y1.square() * torch.linspace(0, 1, p.tokens)[:, None, None]).sum()
    (gw1,) = torch.autograd.grad(loss1, w)
    pos = plan.position_ids(rank)
    idx = plan.local_index(rank)
    off = p.offsets
    return {"y": float((y - y1).abs().max()), "loss": abs(float(loss) - float(loss1)),
            "gw": float((gw - gw1).abs().max() / gw1.abs().max()),
            "pos_ok": bool(((idx - pos) == off[plan.sample_ids(rank)]).all())}


def faults(rank, world):
    """Fault cases on 3 ranks; returns what rank 0 saw: {case: (error type,
    message, seconds)}. Terminal faults (a timeout closes gloo's connection;
    a dead peer) each use their own process group, so one does not mask the
    next: gA = ranks [0, 1] (rank 1 stalls), gB = [0, 2] (rank 2 dies: it is
    device 1 of gB), gC = [0, 1] (rank 1 never joins a new plan)."""
    import os

    import torch.distributed as dist
    seen = {}

    def expect(name, fn):
        t0 = time.monotonic()
        try:
            fn()
            seen[name] = ("no error", "", time.monotonic() - t0)
        except attnplan.AttnplanError as e:
            seen[name] = (type(e).__name__, str(e), time.monotonic() - t0)

    groups = {name: dist.new_group(r) for name, r in (("A", [0, 1]), ("B", [0, 2]), ("C", [0, 1]))}
    case = CASES[1]
    plan = _compile(case, world, "zigzag")
    q, k, v, dout = random_inputs(plan, "float32", 0)
    ql, kl, vl = (plan.dispatch(t) for t in (q, k, v))
    # 1. a plan for another world size: refused before any transfer
    p2 = _compile(case, 2, "zigzag")
    expect("world", lambda: attnplan.attention(p2.dispatch(q, 0), p2.dispatch(k, 0), p2.dispatch(v, 0), p2))
    # 2. inputs that do not fit the plan
    expect("tokens", lambda: attnplan.attention(ql[1:], kl[1:], vl[1:], plan))
    expect("heads", lambda: attnplan.attention(ql[:, :2], kl, vl, plan))
    expect("dtype", lambda: attnplan.attention(ql, kl.double(), vl, plan))
    expect("int", lambda: attnplan.attention(ql.long(), kl.long(), vl.long(), plan))
    # 3. ranks holding different plans: the handshake refuses, on every rank
    other = _compile(case, world, "zigzag", block_size=16 if rank == 1 else 32)
    expect("plans", lambda: attnplan.attention(other.dispatch(q), other.dispatch(k), other.dispatch(v), other))
    # 4. healthy calls on the pair groups (their handshakes are now done)
    mine = {"A": [0, 1], "B": [0, 2]}
    for g in ("A", "B"):
        if rank in mine[g]:
            d = mine[g].index(rank)
            out = attnplan.attention(p2.dispatch(q, d), p2.dispatch(k, d), p2.dispatch(v, d), p2, group=groups[g],
                                     timeout=30)
            seen["healthy " + g] = float(out.abs().sum())
    if rank == 2:  # dies
        os._exit(0)
    if rank == 1:  # stalls, then leaves
        time.sleep(4.0)
        os._exit(0)
    time.sleep(0.5)
    loc = [p2.dispatch(t, 0) for t in (q, k, v)]
    expect("dead", lambda: attnplan.attention(*loc, p2, group=groups["B"], timeout=20.0))
    expect("stalled", lambda: attnplan.attention(*loc, p2, group=groups["A"], timeout=1.0))
    p3 = _compile(case, 2, "zigzag", block_size=48)
    loc3 = [p3.dispatch(t, 0) for t in (q, k, v)]
    expect("absent", lambda: attnplan.attention(*loc3, p3, group=groups["C"], timeout=1.0))
    return seen
