"""Train a tiny transformer with attnplan on synthetic long-tailed packed batches.

    python examples/train_tiny.py                      # 2 gloo processes on CPU, 50 steps
    python examples/train_tiny.py --reference          # the same run in one process, dense masked attention
    torchrun --nproc-per-node 2 examples/train_tiny.py # under torchrun (one process per rank)

Every step draws a new packed batch (document lengths from a long-tailed
log-normal, seeded) and gets its own plan from a ``PlanPrefetcher`` that
compiles the next batches in a worker process while this step trains. The
plan owns the token layout: each rank embeds only its tokens
(``plan.dispatch``), rotates q and k by each token's position inside its
document (``plan.position_ids``), runs attention with
``attnplan.attention`` and computes the loss on its own tokens, normalized by
the batch's label count; parameter gradients are summed over the ranks (one
all_reduce of a flat buffer), so every rank takes the same optimizer step as
a single process training on the whole batch.

Documents are arithmetic sequences mod the vocabulary (random start and
stride): predicting the next token needs the previous ones of the same
document, which the mask provides, so the loss falls within 50 steps.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

import attnplan

CONFIG = dict(vocab=32, dim=32, heads=4, kv_heads=2, head_dim=8, layers=2, tokens=384, block_size=64,
              lr=3e-3, mask="causal", strategy="zigzag", seed=0, steps=50)


# data -----------------------------------------------------------------------------

def batches(cfg: dict):
    """Endless seeded packed batches: ``{"name", "seqlens", "ids"}``; lengths are
    log-normal (median about 24, a long tail) cut to fill ``tokens`` exactly."""
    rng = np.random.default_rng(cfg["seed"])
    step = 0
    while True:
        lens, total = [], 0
        while total < cfg["tokens"]:
            n = int(min(max(2, rng.lognormal(3.2, 1.0)), cfg["tokens"] - total))
            lens.append(n)
            total += n
        if lens[-1] < 2 and len(lens) > 1:  # a one-token document has no label: merge it into the previous one
            last = lens.pop()
            lens[-1] += last
        ids = np.concatenate([(rng.integers(cfg["vocab"]) + rng.integers(1, 4) * np.arange(n)) % cfg["vocab"]
                              for n in lens])
        yield {"name": f"step-{step}", "seqlens": lens, "ids": ids.astype(np.int64)}
        step += 1


def labels_of(ids: np.ndarray, seqlens) -> np.ndarray:
    """Next token inside the same document; -100 at each document's last token."""
    lab = np.roll(ids, -1)
    ends = np.cumsum(seqlens) - 1
    lab[ends] = -100
    return lab


# model ------------------------------------------------------------------------------

def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [T, H, D] at integer positions pos [T]."""
    d = x.shape[-1] // 2
    freq = 1.0 / (10000 ** (torch.arange(d, dtype=torch.float32) / d))
    ang = pos.to(torch.float32)[:, None] * freq[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    a, b = x[..., :d], x[..., d:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Block(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, g, d, m = cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["dim"]
        self.h, self.g, self.d = h, g, d
        self.n1, self.n2 = torch.nn.RMSNorm(m), torch.nn.RMSNorm(m)
        self.qkv = torch.nn.Linear(m, (h + 2 * g) * d, bias=False)
        self.o = torch.nn.Linear(h * d, m, bias=False)
        self.up = torch.nn.Linear(m, 4 * m, bias=False)
        self.down = torch.nn.Linear(4 * m, m, bias=False)

    def forward(self, x, pos, attn):
        T = x.shape[0]
        q, k, v = self.qkv(self.n1(x)).split([self.h * self.d, self.g * self.d, self.g * self.d], dim=-1)
        q = rope(q.view(T, self.h, self.d), pos)
        k = rope(k.view(T, self.g, self.d), pos)
        a = attn(q.contiguous(), k.contiguous(), v.reshape(T, self.g, self.d).contiguous())
        x = x + self.o(a.reshape(T, -1))
        return x + self.down(F.gelu(self.up(self.n2(x))))


class TinyLM(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.emb = torch.nn.Embedding(cfg["vocab"], cfg["dim"])
        self.blocks = torch.nn.ModuleList(Block(cfg) for _ in range(cfg["layers"]))
        self.norm = torch.nn.RMSNorm(cfg["dim"])
        self.head = torch.nn.Linear(cfg["dim"], cfg["vocab"], bias=False)

    def forward(self, ids, pos, attn):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x, pos, attn)
        return self.head(self.norm(x))


def make_model(cfg) -> TinyLM:
    torch.manual_seed(cfg["seed"])  # the same initial weights on every rank and in the reference
    return TinyLM(cfg)


def dense_masked_attention(allowed: torch.Tensor):
    """Plain attention over the whole packed batch with a [T, T] bool mask (the reference)."""
    def attn(q, k, v):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
        s = s.masked_fill(~allowed, float("-inf"))
        has = allowed.any(dim=1)
        p = torch.softmax(torch.where(has[:, None], s, torch.zeros_like(s)), dim=-1) * has[:, None]
        return torch.einsum("hqk,khd->qhd", p, v)
    return attn


# training -----------------------------------------------------------------------------

def compile_kwargs(cfg, devices: int) -> dict:
    return dict(mask=cfg["mask"], devices=devices, heads=cfg["heads"], kv_heads=cfg["kv_heads"],
                head_dim=cfg["head_dim"], block_size=cfg["block_size"], strategy=cfg["strategy"], dtype="float32")


def train(rank: int, world: int, cfg: dict, prefetch_workers: int = 1) -> list[float]:
    """One rank of the distributed run; returns the loss of every step (every rank gets the same list)."""
    import torch.distributed as dist
    model = make_model(cfg)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=cfg["lr"])
    data = (b for _, b in zip(range(cfg["steps"]), batches(cfg)))
    losses = []
    with attnplan.PlanPrefetcher(data, compile_kwargs(cfg, world), workers=prefetch_workers) as plans:
        for batch, plan in plans:
            ids = torch.from_numpy(batch["ids"])
            labels = torch.from_numpy(labels_of(batch["ids"], batch["seqlens"]))
            n_labels = int((labels != -100).sum())  # the normalization is the whole batch's, on every rank
            ids_l, labels_l = plan.dispatch(ids, rank), plan.dispatch(labels, rank)
            pos = torch.from_numpy(plan.position_ids(rank))
            logits = model(ids_l, pos, lambda q, k, v, plan=plan: attnplan.attention(q, k, v, plan))
            loss = F.cross_entropy(logits, labels_l, ignore_index=-100, reduction="sum") / n_labels
            opt.zero_grad(set_to_none=False)
            loss.backward()
            flat = torch.cat([p.grad.reshape(-1) for p in params] + [loss.detach().reshape(1)])
            dist.all_reduce(flat)  # sum: every rank's share of the gradient and of the loss
            i = 0
            for p in params:
                p.grad.copy_(flat[i:i + p.numel()].view_as(p))
                i += p.numel()
            opt.step()
            losses.append(float(flat[-1]))
    return losses


def train_reference(cfg: dict) -> list[float]:
    """The same training in one process with dense masked attention over the packed batch."""
    from attnplan.frontend import load_mask, lower_batch
    from attnplan.runtime.reference import dense_allowed
    model = make_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    prog = load_mask(cfg["mask"])
    losses = []
    for _, batch in zip(range(cfg["steps"]), batches(cfg)):
        lens = batch["seqlens"]
        allowed = torch.from_numpy(dense_allowed(lower_batch(prog, lens, None).a, sum(lens)))
        ids = torch.from_numpy(batch["ids"])
        labels = torch.from_numpy(labels_of(batch["ids"], lens))
        pos = torch.from_numpy(np.concatenate([np.arange(n) for n in lens]))
        logits = model(ids, pos, dense_masked_attention(allowed))
        loss = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum") / int((labels != -100).sum())
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def run(procs: int = 2, prefetch_workers: int = 1, timeout: float = 300.0, **overrides) -> list[float]:
    """Train on ``procs`` fresh local gloo processes; returns the loss curve."""
    from attnplan.tools.launch import run_local
    cfg = dict(CONFIG, **overrides)
    res = run_local(f"{os.path.abspath(__file__)}:train", procs, (cfg, prefetch_workers), timeout=timeout)
    for r, x in enumerate(res):
        if x[0] != "ok":
            raise RuntimeError(f"rank {r}: {x[1]}: {x[2] if len(x) > 2 else ''}\n{x[3] if len(x) > 3 else ''}")
    curves = [x[1] for x in res]
    assert all(c == curves[0] for c in curves), "ranks disagree on the loss"
    return curves[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=CONFIG["steps"])
    ap.add_argument("--mask", default=CONFIG["mask"], help="a mask expression, builtin name or .mask file")
    ap.add_argument("--strategy", default=CONFIG["strategy"])
    ap.add_argument("--tokens", type=int, default=CONFIG["tokens"])
    ap.add_argument("--seed", type=int, default=CONFIG["seed"])
    ap.add_argument("--prefetch-workers", type=int, default=1)
    ap.add_argument("--reference", action="store_true", help="one process, dense masked attention")
    ap.add_argument("--json", help="write the loss curve here")
    a = ap.parse_args(argv)
    over = dict(steps=a.steps, mask=a.mask, strategy=a.strategy, tokens=a.tokens, seed=a.seed)
    torch.set_num_threads(1)
    if a.reference:
        losses = train_reference(dict(CONFIG, **over))
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        import torch.distributed as dist
        dist.init_process_group("gloo")
        losses = train(dist.get_rank(), dist.get_world_size(), dict(CONFIG, **over), a.prefetch_workers)
        if dist.get_rank() != 0:
            return 0
    else:
        losses = run(a.procs, a.prefetch_workers, **over)
    for i, x in enumerate(losses):
        if i % 10 == 0 or i == len(losses) - 1:
            print(f"step {i:3d}  loss {x:.6f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(losses, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
