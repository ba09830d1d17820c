"""Train the tiny model of examples/train_tiny.py with whole-step plans: dp × cp ranks, a batch pass per step.

    python examples/train_step.py                         # 4 gloo processes, dp=2 x cp=2, gds (wlb until gds exists)
    python examples/train_step.py --system wlb            # any system of attnplan.step (text: pool{inner=minheap})
    python examples/train_step.py --reference             # the same steps in one process, dense attention
    python examples/train_step.py --compare               # both, and the largest relative difference of the loss
    torchrun --nproc-per-node 4 examples/train_step.py    # under torchrun (one process per rank)

Every step is a global batch of long-tailed synthetic documents (lengths
log-normal with a heavy tail, from a seeded generator; each document an
arithmetic sequence mod the vocabulary, so predicting a token needs the
document's earlier ones). A :class:`attnplan.tools.step_loader.StepLoader`
plans each step ahead in a worker process with the chosen system — which
documents go into which micro-batch, on which group of ranks, in which order,
and every micro-batch's attention plan — and hands each rank its
micro-batches in order: local token ids, labels, loss weights (1 / the
step's label tokens), positions inside each document, the attention plan and
its process group. A rank runs its micro-batches one after another,
accumulating gradients; then the gradients (and the loss) are summed over
all dp × cp ranks in one all_reduce and every rank takes the same AdamW step.

The loss of every step equals single-process training with dense masked
attention on the same global batch (``--compare``; fp32 reassociation only;
with WLB-LLM's outlier queue, ``--system "wlb{max_tokens=512,outlier=0.5}"``,
on the documents each step trains, long ones waiting for a later step),
and two runs give bitwise identical losses: the plans are pure functions of
the batches, the data and the initial weights come from explicit seeds.

A micro-batch holds at most ``--micro-tokens`` tokens (the ``max_tokens``
option of ``wlb`` and ``gds``; the tiny model would fit a whole step in an
H100's memory), so a step takes several micro-batches per replica (gradient
accumulation), which is what the systems schedule.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from attnplan.step import SYSTEMS, Mesh, Model, system_names
from attnplan.tools.step_loader import IGNORE, StepLoader, batch_documents


def _load_tiny():
    """examples/train_tiny.py (its model, rotary embedding and dense reference attention)."""
    spec = importlib.util.spec_from_file_location("attnplan_example_train_tiny",
                                                  Path(__file__).resolve().with_name("train_tiny.py"))
    if spec is None or spec.loader is None:
        raise ImportError("examples/train_tiny.py not found next to train_step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


tiny = _load_tiny()


def default_system() -> str:
    """Skrull's ``gds`` once it is registered, else WLB-LLM's ``wlb``."""
    return "gds" if "gds" in system_names() else "wlb"


CONFIG = dict(vocab=32, dim=32, heads=4, kv_heads=2, head_dim=8, layers=2, lr=3e-3, mask="causal", seed=0,
              dp=2, cp=2, devices_per_node=2, system="", step_tokens=1536, max_doc=480, micro_tokens=512,
              block_size=32, steps=10)


# data -----------------------------------------------------------------------------

def documents(cfg: dict):
    """Endless seeded documents (int64 token ids): lengths log-normal (median about 30, a heavy tail)
    cut to [2, max_doc]; each an arithmetic sequence mod the vocabulary (random start and stride)."""
    rng = np.random.default_rng(cfg["seed"])
    while True:
        n = int(min(max(2, rng.lognormal(3.4, 1.3)), cfg["max_doc"]))
        start, stride = int(rng.integers(cfg["vocab"])), int(rng.integers(1, 4))
        yield (start + stride * np.arange(n, dtype=np.int64)) % cfg["vocab"]


def global_batches(cfg: dict):
    """The first ``steps`` global batches: documents in order until a batch holds ``step_tokens`` tokens."""
    for _, batch in zip(range(cfg["steps"]), batch_documents(documents(cfg), cfg["step_tokens"])):
        yield batch


# the step: model and mesh as the planner sees them ----------------------------------

def step_model(cfg: dict) -> Model:
    """The tiny model's shapes for the step cost model (GELU MLP of 4 × dim, untied output layer)."""
    return Model("tiny-lm", cfg["layers"], cfg["dim"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"],
                 4 * cfg["dim"], cfg["vocab"], mlp="gelu")


def mesh(cfg: dict) -> Mesh:
    """dp × cp ranks, ``devices_per_node`` to a node, each with an H100's memory (the tiny model never
    comes near it: ``micro_tokens`` is what makes a step take several micro-batches)."""
    return Mesh(cfg["dp"], cfg["cp"], devices_per_node=cfg["devices_per_node"])


def system_spec(cfg: dict) -> str:
    """The system as text: ``cfg["system"]`` (default :func:`default_system`); a bare name whose pass
    takes ``max_tokens`` (wlb, gds) gets ``max_tokens=micro_tokens``: tokens per micro-batch."""
    text = cfg["system"] or default_system()
    if "{" not in text and text in SYSTEMS and "max_tokens" in {f.name for f in dataclasses.fields(SYSTEMS[text])}:
        text += f"{{max_tokens={cfg['micro_tokens']}}}"
    return text


class Block(tiny.Block):
    """train_tiny's block, but for a rank that holds no token of a micro-batch (it still takes part in the
    attention plan's transfers): ``flatten`` where train_tiny reshapes to ``(T, -1)``, ambiguous at T = 0."""

    def forward(self, x, pos, attn):
        T = x.shape[0]
        q, k, v = self.qkv(self.n1(x)).split([self.h * self.d, self.g * self.d, self.g * self.d], dim=-1)
        q = tiny.rope(q.view(T, self.h, self.d), pos)
        k = tiny.rope(k.view(T, self.g, self.d), pos)
        a = attn(q.contiguous(), k.contiguous(), v.reshape(T, self.g, self.d).contiguous())
        x = x + self.o(a.flatten(1))
        return x + self.down(F.gelu(self.up(self.n2(x))))


def make_model(cfg: dict):
    """train_tiny's model with its seeded initial weights (the global generator's state left as it was),
    its blocks taking empty micro-batches (:class:`Block`)."""
    with torch.random.fork_rng(devices=[]):
        model = tiny.make_model(cfg)
    for b in model.blocks:
        b.__class__ = Block
    return model


# training -----------------------------------------------------------------------------

def train(rank: int, world: int, cfg: dict, workers: int = 1) -> dict:
    """One rank; returns the loss of every step (the same on every rank) and what the plans looked like."""
    import torch.distributed as dist
    model = make_model(cfg)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=cfg["lr"])
    losses, micro, groups = [], [], 0
    with StepLoader(global_batches(cfg), step_model(cfg), mesh(cfg), system_spec(cfg),
                    mask=cfg["mask"], block_size=cfg["block_size"], workers=workers) as loader:
        for step in loader:
            for p in params:
                p.grad = torch.zeros_like(p)
            total = torch.zeros((), dtype=torch.float32)
            for mb in step:  # gradient accumulation, in the plan's order
                logits = model(mb.ids, mb.position_ids, mb.attention)
                tok = F.cross_entropy(logits, mb.labels.clamp_min(0), reduction="none")
                loss = (tok * mb.loss_weights).sum()
                loss.backward()
                total += loss.detach()
            flat = torch.cat([p.grad.reshape(-1) for p in params] + [total.reshape(1)])
            dist.all_reduce(flat)  # sum over every dp x cp rank: the gradient and loss of the global batch
            i = 0
            for p in params:
                p.grad.copy_(flat[i:i + p.numel()].view_as(p))
                i += p.numel()
            opt.step()
            losses.append(float(flat[-1]))
            micro.append(len(step))
        groups = len(loader.groups)
    return {"losses": losses, "micro_batches": micro, "groups": groups}


def reference_steps(cfg: dict):
    """The documents each step trains: the global batches; with a system that carries documents between
    steps (``wlb{outlier>0}``: its outlier queue), the documents of each step of its chain of plans
    (carried ones included, queued ones left for a later step, a last ``end-of-data`` step draining the
    queue), planned here in place — the plans are pure functions of the batches."""
    from attnplan.step import parse_system
    spec = system_spec(cfg)
    if not parse_system(spec).carries_state():
        yield from global_batches(cfg)
        return
    batches = list(global_batches(cfg))
    with StepLoader(batches, step_model(cfg), mesh(cfg), spec, mask=cfg["mask"], block_size=cfg["block_size"],
                    rank=0, workers=0, process_groups=False) as loader:
        for step in loader:
            p = step.plan.problem
            trained = sorted(set(step.plan.frag_doc.tolist()))
            yield [batches[s][i] for s, i in p.origin[trained].tolist()]


def train_reference(cfg: dict) -> list[float]:
    """The same steps in one process: every document the step trains (:func:`reference_steps`) packed in
    order, dense attention masked to each document, the loss normalized by the step's label tokens."""
    from attnplan.frontend import load_mask, lower_batch
    from attnplan.runtime.reference import dense_allowed
    model = make_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    prog = load_mask(cfg["mask"])
    losses = []
    for docs in reference_steps(cfg):
        lens = [len(d) for d in docs]
        allowed = torch.from_numpy(dense_allowed(lower_batch(prog, lens, None).a, sum(lens)))
        ids = torch.from_numpy(np.concatenate(docs))
        labels = torch.from_numpy(np.concatenate([np.append(d[1:], IGNORE) for d in docs]))
        pos = torch.from_numpy(np.concatenate([np.arange(n) for n in lens]))
        logits = model(ids, pos, tiny.dense_masked_attention(allowed))
        loss = F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum") / int((labels != IGNORE).sum())
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def run(workers: int = 1, timeout: float = 300.0, **overrides) -> dict:
    """Train on dp × cp fresh local gloo processes; rank 0's result (every rank must agree on the losses)."""
    from attnplan.tools.launch import run_local
    cfg = dict(CONFIG, **overrides)
    cfg["system"] = system_spec(cfg)
    res = run_local(f"{os.path.abspath(__file__)}:train", cfg["dp"] * cfg["cp"], (cfg, workers), timeout=timeout)
    for r, x in enumerate(res):
        if x[0] != "ok":
            raise RuntimeError(f"rank {r}: {x[1]}: {x[2] if len(x) > 2 else ''}\n{x[3] if len(x) > 3 else ''}")
    if any(x[1]["losses"] != res[0][1]["losses"] for x in res):
        raise RuntimeError("the ranks disagree on the loss")
    return dict(res[0][1], system=cfg["system"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--system", default="", help="a batch pass of attnplan.step (default: gds if registered, else wlb)")
    ap.add_argument("--steps", type=int, default=CONFIG["steps"])
    ap.add_argument("--dp", type=int, default=CONFIG["dp"])
    ap.add_argument("--cp", type=int, default=CONFIG["cp"])
    ap.add_argument("--step-tokens", type=int, default=CONFIG["step_tokens"])
    ap.add_argument("--micro-tokens", type=int, default=CONFIG["micro_tokens"],
                    help="tokens per micro-batch for systems with max_tokens (wlb, gds)")
    ap.add_argument("--seed", type=int, default=CONFIG["seed"])
    ap.add_argument("--workers", type=int, default=1, help="planning worker processes per rank")
    ap.add_argument("--reference", action="store_true", help="one process, dense masked attention")
    ap.add_argument("--compare", action="store_true", help="run both and print the largest relative difference")
    ap.add_argument("--json", help="write the loss curve(s) here")
    a = ap.parse_args(argv)
    over = dict(steps=a.steps, dp=a.dp, cp=a.cp, step_tokens=a.step_tokens, micro_tokens=a.micro_tokens,
                seed=a.seed, system=a.system)
    cfg = dict(CONFIG, **over)
    torch.set_num_threads(1)
    out: dict = {}
    if a.reference or a.compare:
        out["reference"] = train_reference(cfg)
    if not a.reference:
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
            import torch.distributed as dist
            dist.init_process_group("gloo")
            res = train(dist.get_rank(), dist.get_world_size(), dict(cfg, system=system_spec(cfg)),
                        a.workers)
            if dist.get_rank() != 0:
                return 0
        else:
            res = run(a.workers, **over)
        out["distributed"] = res["losses"]
        print(f"system {system_spec(cfg)}, dp={cfg['dp']} x cp={cfg['cp']}: micro-batches per "
              f"step on rank 0 {res['micro_batches']}, {res['groups']} process groups")
    for key, curve in out.items():
        for i, x in enumerate(curve):
            if i % 5 == 0 or i == len(curve) - 1:
                print(f"{key:11s} step {i:3d}  loss {x:.6f}")
    if a.compare:
        rel = max(abs(x - y) / abs(y) for x, y in zip(out["distributed"], out["reference"]))
        print(f"largest relative difference from the dense reference: {rel:.2e}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
