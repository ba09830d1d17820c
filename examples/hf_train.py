"""Train a tiny Hugging Face Llama (or Qwen2) with context parallelism planned by attnplan.

    python examples/hf_train.py --strategy hypergraph             # 2 gloo processes, 20 steps
    python examples/hf_train.py --model qwen2 --reference         # one process, attn_implementation="sdpa"
    python examples/hf_train.py --strategy dacp --check           # both, and their largest relative differences
    python examples/hf_train.py --device cuda --check             # one GPU: a 1-device and a 2-virtual-device plan
    torchrun --nproc-per-node 2 examples/hf_train.py --strategy minheap

The model is ``AutoModelForCausalLM.from_config`` of a tiny config (random
weights from an explicit seed; nothing is downloaded) with
``attn_implementation="attnplan"``: every attention layer runs through
``attnplan.attention`` with the plan of the enclosing
``attnplan.hf.plan_context``. Every step draws a new packed batch of
documents with long-tailed lengths and compiles its plan; each rank then

1. shifts the labels inside each document on the whole batch
   (``attnplan.hf.packed_labels``), before anything is dispatched,
2. takes its own tokens, labels and per-document positions
   (``plan.dispatch``, ``plan.position_ids``),
3. runs the model's forward inside ``plan_context`` and divides its summed
   token loss by the whole batch's label count,
4. sums gradients (and the loss, for printing) over the group
   (``attnplan.hf.sum_gradients``) and takes the optimizer step.

``--reference`` trains the same model in one process with
``attn_implementation="sdpa"`` on the same batches: the whole packed row with
per-document ``position_ids`` and no ``attention_mask``, from which
transformers builds the per-document causal mask (packed sequences).
``--check`` runs both and prints the largest relative difference of the
per-step losses and of every parameter's step-1 gradient.

Documents are arithmetic sequences mod the vocabulary (random start and
stride), so the loss falls within the 20 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

import attnplan
import attnplan.hf

CONFIG = dict(model="llama", strategy="zigzag", steps=20, tokens=512, block_size=64, seed=0, lr=3e-3,
              vocab=64, hidden=32, heads=4, kv_heads=2, head_dim=8, layers=2, intermediate=64)
MODELS = ("llama", "qwen2")
STRATEGIES = ("zigzag", "minheap", "hypergraph", "dacp", "per_doc", "tile_pool", "ulysses")


# data -------------------------------------------------------------------------------------------

def doc_lengths(rng: np.random.Generator, tokens: int) -> list[int]:
    """Log-normal document lengths (median about 25, a long tail) filling
    ``tokens`` exactly; every document has at least 2 tokens."""
    lens: list[int] = []
    while sum(lens) < tokens:
        room = tokens - sum(lens)
        n = int(np.clip(rng.lognormal(3.2, 1.1), 2, room))
        if room - n == 1:  # never leave a one-token remainder
            n += 1
        lens.append(n)
    return lens


def batches(cfg: dict):
    """Endless seeded packed batches ``{"seqlens", "ids"}``."""
    rng = np.random.default_rng(cfg["seed"])
    while True:
        lens = doc_lengths(rng, cfg["tokens"])
        ids = np.concatenate([(rng.integers(cfg["vocab"]) + rng.integers(1, 5) * np.arange(n)) % cfg["vocab"]
                              for n in lens]).astype(np.int64)
        yield {"seqlens": lens, "ids": ids}


# model ------------------------------------------------------------------------------------------

def model_config(cfg: dict):
    """A tiny Llama (GQA, no biases) or Qwen2 (GQA, biases on q/k/v) config."""
    from transformers import LlamaConfig, Qwen2Config
    common = dict(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"],
                  num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                  num_key_value_heads=cfg["kv_heads"], head_dim=cfg["head_dim"], max_position_embeddings=4096,
                  use_cache=False, tie_word_embeddings=False, attention_dropout=0.0)
    if cfg["model"] == "llama":
        return LlamaConfig(**common)
    if cfg["model"] == "qwen2":
        return Qwen2Config(**common)
    raise ValueError(f"--model must be one of {', '.join(MODELS)}, got {cfg['model']!r}")


def make_model(cfg: dict, attn_implementation: str):
    """The model with weights drawn from ``torch.Generator(seed)`` (the same on
    every rank and in the reference): norms 1, matrices and biases N(0, 0.02)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(model_config(cfg), attn_implementation=attn_implementation,
                                             dtype=torch.float32)
    g = torch.Generator().manual_seed(cfg["seed"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    model.train()
    return model


def compile_plan(cfg: dict, seqlens, devices: int):
    return attnplan.compile(seqlens=seqlens, mask="causal", devices=devices, heads=cfg["heads"],
                            kv_heads=cfg["kv_heads"], head_dim=cfg["head_dim"], block_size=cfg["block_size"],
                            strategy=cfg["strategy"], dtype="float32")


def _grads(model) -> dict:
    """Every parameter's gradient as a numpy array (tensors would cross the
    launcher's result queue as shared memory that dies with the process)."""
    return {n: p.grad.detach().cpu().numpy().copy() for n, p in model.named_parameters()}


# training ---------------------------------------------------------------------------------------

def train(rank: int, world: int, cfg: dict, group=None) -> dict:
    """One rank of the distributed run: ``{"losses": [...], "grads": {name: step-1 gradient}}``
    (every rank returns the same)."""
    import torch.distributed as dist
    model = make_model(cfg, "attnplan")
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=cfg["lr"])
    losses: list[float] = []
    grads: dict = {}
    for step, batch in zip(range(cfg["steps"]), batches(cfg)):
        plan = compile_plan(cfg, batch["seqlens"], world)
        ids = torch.from_numpy(batch["ids"])
        labels = attnplan.hf.packed_labels(plan, ids)              # shifted inside documents, before dispatch
        n_labels = int((labels != attnplan.hf.IGNORE_INDEX).sum())  # the whole batch's, on every rank
        ids_l, labels_l = plan.dispatch(ids, rank), plan.dispatch(labels, rank)
        pos_l = torch.from_numpy(plan.position_ids(rank))
        with attnplan.hf.plan_context(plan, group):
            logits = model(input_ids=ids_l[None], position_ids=pos_l[None], use_cache=False).logits[0]
        loss = F.cross_entropy(logits.float(), labels_l, ignore_index=attnplan.hf.IGNORE_INDEX,
                               reduction="sum") / n_labels
        opt.zero_grad(set_to_none=True)
        loss.backward()
        attnplan.hf.sum_gradients(params, group)
        total = loss.detach().reshape(1).clone()
        dist.all_reduce(total, group=group)
        if step == 0:
            grads = _grads(model)
        opt.step()
        losses.append(float(total))
    return {"losses": losses, "grads": grads}


def train_local(cfg: dict, devices: int = 1, device: str = "cpu") -> dict:
    """The training of :func:`train` in this one process on ``device``: a
    1-device plan through ``attnplan.attention`` on this rank's tokens, a
    plan for more devices through a virtual ``plan_context`` (every device's
    program here, on the whole batch in global order)."""
    model = make_model(cfg, "attnplan").to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    losses: list[float] = []
    grads: dict = {}
    virtual = devices > 1
    for step, batch in zip(range(cfg["steps"]), batches(cfg)):
        plan = compile_plan(cfg, batch["seqlens"], devices)
        ids = torch.from_numpy(batch["ids"])
        labels = attnplan.hf.packed_labels(plan, ids)
        n_labels = int((labels != attnplan.hf.IGNORE_INDEX).sum())
        if virtual:
            pos = np.concatenate([np.arange(n) for n in batch["seqlens"]])
        else:
            ids, labels, pos = plan.dispatch(ids, 0), plan.dispatch(labels, 0), plan.position_ids(0)
        ids, labels, pos = ids.to(device), labels.to(device), torch.from_numpy(pos).to(device)
        with attnplan.hf.plan_context(plan, virtual=virtual):
            logits = model(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits[0]
        loss = F.cross_entropy(logits.float(), labels, ignore_index=attnplan.hf.IGNORE_INDEX,
                               reduction="sum") / n_labels
        grads = _step(model, opt, loss, grads if step else None)
        losses.append(float(loss.detach()))
    return {"losses": losses, "grads": grads}


def _step(model, opt, loss, grads: dict | None) -> dict:
    """Backward and optimizer step; returns ``grads``, or this step's gradients when ``grads`` is None."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if grads is None:
        grads = _grads(model)
    opt.step()
    return grads


def train_many(rank: int, world: int, cfgs: list) -> list:
    """:func:`train` for several configs in the same processes (tests)."""
    return [train(rank, world, cfg) for cfg in cfgs]


def train_reference(cfg: dict, device: str = "cpu") -> dict:
    """The same training in one process with ``attn_implementation="sdpa"`` on
    the whole packed row: per-document ``position_ids`` and no attention mask,
    from which transformers builds the per-document causal mask."""
    model = make_model(cfg, "sdpa").to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    losses: list[float] = []
    grads: dict = {}
    for step, batch in zip(range(cfg["steps"]), batches(cfg)):
        ids = torch.from_numpy(batch["ids"]).to(device)
        labels = reference_labels(batch["ids"], batch["seqlens"]).to(device)
        pos = torch.from_numpy(np.concatenate([np.arange(n) for n in batch["seqlens"]])).to(device)
        logits = model(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits[0]
        loss = F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum") / int((labels != -100).sum())
        grads = _step(model, opt, loss, grads if step else None)
        losses.append(float(loss.detach()))
    return {"losses": losses, "grads": grads}


def reference_labels(ids: np.ndarray, seqlens) -> torch.Tensor:
    """Next token inside each document, -100 at each document's last token
    (written independently of attnplan.hf.packed_labels)."""
    out = []
    start = 0
    for n in seqlens:
        doc = ids[start:start + n]
        out.append(np.append(doc[1:], -100))
        start += n
    return torch.from_numpy(np.concatenate(out).astype(np.int64))


def run(procs: int = 2, cfgs: list | None = None, timeout: float = 600.0) -> list:
    """:func:`train_many` on ``procs`` fresh local gloo processes (spawned);
    returns rank 0's results after checking every rank agrees."""
    from attnplan.tools.launch import run_local
    cfgs = cfgs or [dict(CONFIG)]
    res = run_local(f"{os.path.abspath(__file__)}:train_many", procs, (cfgs,), timeout=timeout)
    for r, x in enumerate(res):
        if x[0] != "ok":
            detail = x[3] if len(x) > 3 else ""
            raise RuntimeError(f"rank {r}: {x[1]}: {x[2] if len(x) > 2 else ''}\n{detail}")
    first = res[0][1]
    for r, x in enumerate(res[1:], 1):
        if [c["losses"] for c in x[1]] != [c["losses"] for c in first]:
            raise RuntimeError(f"rank {r} disagrees with rank 0 on the losses")
    return first


def differences(got: dict, ref: dict) -> dict:
    """Largest relative difference of the per-step losses, and of each step-1
    gradient (max |g - g_ref| / max |g_ref|, per parameter)."""
    loss = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"], strict=True))
    grad = {n: float(np.abs(got["grads"][n] - g).max() / max(float(np.abs(g).max()), 1e-30))
            for n, g in ref["grads"].items()}
    return {"loss": loss, "grad": max(grad.values()), "grad_worst": max(grad, key=lambda n: grad[n]),
            "params": len(grad)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=MODELS, default=CONFIG["model"])
    ap.add_argument("--strategy", choices=STRATEGIES, default=CONFIG["strategy"])
    ap.add_argument("--steps", type=int, default=CONFIG["steps"])
    ap.add_argument("--tokens", type=int, default=CONFIG["tokens"])
    ap.add_argument("--seed", type=int, default=CONFIG["seed"])
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--reference", action="store_true", help="one process, attn_implementation='sdpa'")
    ap.add_argument("--check", action="store_true", help="run both and print their largest relative differences")
    ap.add_argument("--json", help="write the loss curve here")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: one process on the GPU, a 1-device plan and a 2-virtual-device plan")
    a = ap.parse_args(argv)
    cfg = dict(CONFIG, model=a.model, strategy=a.strategy, steps=a.steps, tokens=a.tokens, seed=a.seed)
    if a.device == "cuda":
        return main_cuda(a, cfg)
    torch.set_num_threads(1)
    procs = a.procs
    if a.reference:
        res = train_reference(cfg)
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        import torch.distributed as dist
        dist.init_process_group("gloo")
        procs = dist.get_world_size()
        res = train(dist.get_rank(), procs, cfg)
        dist.destroy_process_group()
        if int(os.environ["RANK"]) != 0:
            return 0
    else:
        res = run(procs, [cfg])[0]
    what = "sdpa, 1 process" if a.reference else f"attnplan {a.strategy}, {procs} processes"
    for i, x in enumerate(res["losses"]):
        print(f"{a.model} ({what}) step {i:3d}  loss {x:.7f}")
    if a.check and not a.reference:
        d = differences(res, train_reference(cfg))
        print(f"max relative difference to sdpa: loss {d['loss']:.2e}, step-1 gradients {d['grad']:.2e} "
              f"(worst {d['grad_worst']}, {d['params']} parameters)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res["losses"], f)
    return 0


def main_cuda(a, cfg: dict) -> int:
    """``--device cuda``: one process, one GPU; a 1-device plan (``attnplan.attention``)
    and a 2-virtual-device plan (``plan_context(virtual=True)``), each against sdpa with ``--check``.
    Exit 1 if a check is over its tolerance (loss 1e-4, step-1 gradients 1e-3, relative)."""
    if not torch.cuda.is_available():
        print("--device cuda: torch sees no CUDA device", file=sys.stderr)
        return 2
    ref = train_reference(cfg, "cuda") if a.check or a.reference else None
    if a.reference:
        res = {"sdpa": ref}
    else:
        res = {f"{n} device{'s' if n > 1 else ''}": train_local(cfg, n, "cuda") for n in (1, 2)}
    ok = True
    for what, r in res.items():
        print(f"{a.model} (cuda, {what}) loss: first {r['losses'][0]:.7f}, last {r['losses'][-1]:.7f}")
        if a.check and ref is not None and what != "sdpa":
            d = differences(r, ref)
            good = d["loss"] <= 1e-4 and d["grad"] <= 1e-3
            ok &= good
            print(f"  max relative difference to sdpa: loss {d['loss']:.2e}, step-1 gradients {d['grad']:.2e} "
                  f"(worst {d['grad_worst']}, {d['params']} parameters) {'ok' if good else 'OVER TOLERANCE'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
