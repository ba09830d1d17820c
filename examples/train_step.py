"""Train the tiny model of examples/train_tiny.py with whole-step plans: dp × cp ranks, a batch pass per step.

    python examples/train_step.py                         # 4 gloo processes, dp=2 x cp=2, gds (wlb until gds exists)
    python examples/train_step.py --system wlb            # any system of attnplan.step (text: pool{inner=minheap})
    python examples/train_step.py --reference             # the same steps in one process, dense attention
    python examples/train_step.py --compare               # both, and the largest relative difference of the loss
    python examples/train_step.py --dp 1 --cp 2 --pp 2 --system "wlb{max_tokens=320}" --compare     # 1F1B
    python examples/train_step.py --dp 1 --cp 2 --pp 2 --system "chunkflow{chunk=128}" --compare    # ChunkFlow
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

**Pipelines** (``--pp P``: ``dp · cp · P`` processes; and ChunkFlow's chunks on any mesh). The
layers are split between the stages (``Mesh.chunk_layers``); stage 0 holds the embedding, the last
stage the final norm, output layer and loss, and a stage trains, reduces (over its ``dp · cp`` ranks)
and steps only its own parameters. Every stage runs the same micro-batches on the same stage-local
groups, so local rank ``r`` holds the same tokens at every stage and hidden states go rank
``(s, r) → (s + 1, r)``. A rank runs its stage's ops of the plan's schedule in order
(:func:`run_schedule`: 1F1B, or ChunkFlow's state-aware 1F1B): a forward receives its input (blocking
recv) or embeds and sends its output on (``isend``), a backward receives the output gradient or starts
from the loss and sends the input gradient back. A document ChunkFlow cuts runs as a chain of chunks:
at every layer each chunk's K and V are gathered over its CP group (:class:`_GatherRows`, whose
backward sums the ranks' gradients) and kept in a :class:`KVStore` as leaves; a later chunk attends to
the earlier chunks' K, V and its own, each rank passing the key rows its cross plan homes, and the
gradients the leaves collect join the earlier chunk's backward (the schedule runs a document's
backwards in reverse chunk order). A chunk the schedule marks ``recompute`` runs its first forward
without a graph and again, from its kept stage input, right before its backward. Losses and the first
step's gradients equal the dense single-process run (``--compare`` prints both differences).

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
from typing import NamedTuple

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
              dp=2, cp=2, pp=1, devices_per_node=2, system="", step_tokens=1536, max_doc=480, micro_tokens=512,
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
    """dp × cp ranks on each of ``pp`` pipeline stages, ``devices_per_node`` to a node, each with an H100's
    memory (the tiny model never comes near it: ``micro_tokens`` is what makes a step take several
    micro-batches)."""
    return Mesh(cfg["dp"], cfg["cp"], cfg.get("pp", 1), devices_per_node=cfg["devices_per_node"])


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


# pipeline stages ------------------------------------------------------------------------

class StagePart(NamedTuple):
    """What pipeline stage ``stage`` of the tiny model holds: the embedding on the first stage, the layers
    ``layers`` (``Mesh.chunk_layers``), the final norm, output layer and loss on the last."""

    stage: int
    first: bool
    last: bool
    layers: range


def stage_part(cfg: dict, m: Mesh, stage: int) -> StagePart:
    """Stage ``stage``'s part of the model on mesh ``m`` (one model chunk per stage: vp = 1)."""
    if m.vp != 1:
        raise ValueError(f"train_step runs one model chunk per stage (1F1B or ChunkFlow's schedule); vp={m.vp}")
    per = m.chunk_layers(cfg["layers"])
    lo = sum(per[:stage])
    return StagePart(stage, stage == 0, stage == m.pp - 1, range(lo, lo + per[stage]))


def stage_parameters(model, part: StagePart) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters stage ``part`` owns (trains, reduces, steps), by their names in the whole model, in
    the model's order (every parameter when the stage is the whole model)."""
    mine = tuple(f"blocks.{i}." for i in part.layers) + (("emb.",) if part.first else ()) + \
        (("norm.", "head.") if part.last else ())
    return [(n, p) for n, p in model.named_parameters() if n.startswith(mine)]


def stage_forward(model, part: StagePart, mb, x, attention_of):
    """One micro-batch through stage ``part``: its stage input ``x`` (the embedding of ``mb.ids`` on the
    first stage), its layers (``attention_of(layer)``: that layer's attention), and on the last stage the
    loss Σ weight × token loss; returns the stage output (hidden states or the loss)."""
    if part.first:
        x = model.emb(mb.ids)
    for i in part.layers:
        x = model.blocks[i](x, mb.position_ids, attention_of(i))
    if not part.last:
        return x
    logits = model.head(model.norm(x))
    return (F.cross_entropy(logits, mb.labels.clamp_min(0), reduction="none") * mb.loss_weights).sum()


# ChunkFlow's carried KV ------------------------------------------------------------------

class _GatherRows(torch.autograd.Function):
    """The rows every rank of ``group`` holds, gathered into one tensor in the chunk's row order on every
    rank; backward: the gradients of every rank summed (all_reduce), each rank keeping its own rows."""

    @staticmethod
    def forward(ctx, x, rows, total, group, me):
        import torch.distributed as dist
        width = max(len(r) for r in rows)
        pad = x.new_zeros((width,) + tuple(x.shape[1:]))
        pad[:len(x)] = x
        parts = [torch.empty_like(pad) for _ in rows]
        dist.all_gather(parts, pad.contiguous(), group=group)
        out = x.new_empty((total,) + tuple(x.shape[1:]))
        for r, part in zip(rows, parts):
            out[r] = part[:len(r)]
        ctx.group, ctx.mine = group, rows[me]
        return out

    @staticmethod
    def backward(ctx, g):
        import torch.distributed as dist
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g.index_select(0, ctx.mine), None, None, None, None


class Chunk(NamedTuple):
    """A micro-batch that is one chunk ``[start, end)`` of a document cut by ChunkFlow. ``rows[d]``: the
    chunk rows device ``d`` of its group holds (its local layout); ``keys``: for a later chunk, the
    document positions of the key rows this rank holds in its cross plan; ``carries``: later chunks read
    this chunk's KV (it is not the document's last)."""

    doc: int
    start: int
    end: int
    carries: bool
    rows: tuple
    keys: torch.Tensor | None


def chunk_of(plan, mb) -> Chunk | None:
    """Micro-batch ``mb``'s :class:`Chunk`, or None when it holds whole documents."""
    from attnplan.tools.step_loader import key_rows, query_rows
    ptr = plan.mb_ptr()
    f = int(ptr[mb.index])
    if int(ptr[mb.index + 1]) - f != 1:
        return None
    doc, start, end = int(plan.frag_doc[f]), int(plan.frag_start[f]), int(plan.frag_end[f])
    length = int(plan.problem.seqlens[doc])
    if start == 0 and end == length:
        return None
    ir = mb.plan.ir
    rows = tuple(torch.from_numpy(query_rows(ir, d)) for d in range(ir.devices))
    if sum(len(r) for r in rows) != end - start:
        raise RuntimeError(f"micro-batch {mb.index}: its plan homes {sum(len(r) for r in rows)} rows of a "
                           f"{end - start}-row chunk")
    keys = key_rows(ir, mb.device)
    if start > 0 and keys is None:
        raise RuntimeError(f"micro-batch {mb.index}: a later chunk of document {doc} without a cross plan")
    return Chunk(doc, start, end, end < length, rows, None if keys is None else torch.from_numpy(keys))


class KVStore:
    """ChunkFlow's state store on one rank and stage: per (layer, document, chunk start) the K and V of a
    chunk, over the whole chunk (gathered from its CP group), kept as leaves that collect the gradients
    the document's later chunks send them; dropped after the chunk's own backward."""

    def __init__(self):
        self._kv: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def put(self, layer: int, c: Chunk, k: torch.Tensor, v: torch.Tensor) -> None:
        self._kv[(layer, c.doc, c.start)] = (k.detach().requires_grad_(True), v.detach().requires_grad_(True))

    def before(self, layer: int, c: Chunk) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The K and V leaves of chunk ``c``'s earlier chunks, in document order (they cover
        ``[0, c.start)``: RuntimeError otherwise)."""
        got = sorted((s, kv) for (l, d, s), kv in self._kv.items() if l == layer and d == c.doc and s < c.start)
        if sum(len(kv[0]) for _, kv in got) != c.start:
            raise RuntimeError(f"document {c.doc}, layer {layer}: the store holds "
                               f"{sum(len(kv[0]) for _, kv in got)} of the {c.start} earlier keys")
        return [kv[0] for _, kv in got], [kv[1] for _, kv in got]

    def grads(self, layer: int, c: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradients the later chunks sent chunk ``c``'s K and V at ``layer`` (zeros if none did)."""
        k, v = self._kv[(layer, c.doc, c.start)]
        return (k.grad if k.grad is not None else torch.zeros_like(k),
                v.grad if v.grad is not None else torch.zeros_like(v))

    def drop(self, c: Chunk) -> None:
        for key in [key for key in self._kv if key[1:] == (c.doc, c.start)]:
            del self._kv[key]

    def __len__(self) -> int:
        return len(self._kv)


def chunk_attention(mb, c: Chunk | None, store: KVStore, layer: int, carried: dict, record: bool):
    """Layer ``layer``'s attention of micro-batch ``mb``: its plan as is for whole documents; for a chunk,
    its K, V gathered over the chunk (kept in ``carried[layer]``: their gradients from the store join the
    chunk's backward, and put in the store when ``record``), a later chunk attending to the document's
    earlier K, V from the store and its own, each rank passing the key rows its cross plan homes."""
    if c is None:
        return mb.attention

    def attn(q, k, v):
        n = c.end - c.start
        kc = _GatherRows.apply(k, c.rows, n, mb.group, mb.device)
        vc = _GatherRows.apply(v, c.rows, n, mb.group, mb.device)
        if c.carries:
            carried[layer] = (kc, vc)
            if record:
                store.put(layer, c, kc, vc)
        if c.start == 0:
            return mb.attention(q, k, v)
        ks, vs = store.before(layer, c)
        keys = torch.cat(ks + [kc]).index_select(0, c.keys)
        values = torch.cat(vs + [vc]).index_select(0, c.keys)
        return mb.attention(q, keys, values)
    return attn


# the pipeline schedule on one rank --------------------------------------------------------

class InFlight:
    """A micro-batch between its forward and its backward on this stage: its stage input (a leaf; None
    on the first stage), its output and carried K, V (None / empty while dropped for recompute). (No
    dataclass: the example is loaded by path, outside ``sys.modules``.)"""

    __slots__ = ("x_in", "out", "carried")

    def __init__(self, x_in: torch.Tensor | None, out: torch.Tensor | None, carried: dict):
        self.x_in, self.out, self.carried = x_in, out, carried


def run_schedule(model, part: StagePart, step, rank: int, n: int) -> tuple[torch.Tensor, dict]:
    """This rank's ops of the step's pipeline schedule (``build_schedule(plan).stage_ops(stage)``), in
    order; returns the summed loss of its micro-batches (zero before the last stage) and counts of what
    ran: ``kv_reads`` (chunks that read earlier chunks' K, V), ``recomputes`` (forwards run again). A forward receives
    the stage input from rank ``rank - n`` (blocking) or embeds, and sends its output to ``rank + n``
    (non-blocking: 1F1B cannot deadlock); a backward receives the output gradient from ``rank + n`` (or
    starts from the loss), backprops it with the gradients the store holds for the micro-batch's K, V,
    and sends the input gradient back. A unit marked ``recompute`` drops its activations after the
    forward (run without a graph) and runs it again, from the kept stage input, right before its backward."""
    import torch.distributed as dist
    from attnplan.step.pipeline import F as FWD, build_schedule
    plan = step.plan
    sch = build_schedule(plan)
    mine: dict[int, object] = {}
    for mb in step:
        if mb.slot in mine:
            raise RuntimeError(f"rank {rank}: two micro-batches in slot {mb.slot}")
        mine[mb.slot] = mb
    chunks = {u: chunk_of(plan, mb) for u, mb in mine.items()}
    store, flight, sends = KVStore(), {}, []
    stats = {"kv_reads": sum(c is not None and c.start > 0 for c in chunks.values()), "recomputes": 0}
    total = torch.zeros((), dtype=torch.float32)
    width = model.emb.embedding_dim

    def send(t, peer, tag):
        if t.numel():
            sends.append(dist.isend(t.detach().contiguous(), peer, tag=tag))

    def recv(mb, peer, tag):
        t = torch.empty(len(mb.ids), width)
        if t.numel():
            dist.recv(t, peer, tag=tag)
        return t

    def forward(u, x_in, record):
        mb, c, carried = mine[u], chunks[u], {}
        out = stage_forward(model, part, mb, x_in,
                            lambda layer: chunk_attention(mb, c, store, layer, carried, record))
        return out, carried

    for i in sch.stage_ops(part.stage):
        u, kind = int(sch.op_unit[i]), int(sch.op_kind[i])
        if u not in mine:
            continue  # no micro-batch of this slot on this rank (nor on its peers at the other stages)
        mb = mine[u]
        if kind == FWD:
            x_in = None if part.first else recv(mb, rank - n, 2 * u).requires_grad_(True)
            keep = not bool(sch.recompute[u])
            with torch.set_grad_enabled(keep):
                out, carried = forward(u, x_in, record=True)
            if part.last:
                total += out.detach()
            else:
                send(out, rank + n, 2 * u)
            flight[u] = InFlight(x_in, out if keep else None, carried if keep else {})
            continue
        f = flight.pop(u)
        if f.out is None:  # ChunkFlow's dropped chunk: its forward again, from the kept stage input
            f.out, f.carried = forward(u, f.x_in, record=False)
            stats["recomputes"] += 1
        outs, grads = [f.out], [None if part.last else recv(mb, rank + n, 2 * u + 1)]
        c = chunks[u]
        for layer, (k, v) in sorted(f.carried.items()):
            gk, gv = store.grads(layer, c)
            outs += [k, v]
            grads += [gk, gv]
        torch.autograd.backward(outs, grads)
        if c is not None and c.carries:
            store.drop(c)
        if not part.first:
            send(f.x_in.grad if f.x_in.grad is not None else torch.zeros_like(f.x_in), rank - n, 2 * u + 1)
    for w in sends:
        w.wait()
    if flight or len(store):
        raise RuntimeError(f"rank {rank}: {len(flight)} micro-batches and {len(store)} stored K, V left over")
    return total, stats


# training -----------------------------------------------------------------------------

def stage_groups(m: Mesh):
    """The gradient-reduction group of every pipeline stage (its dp × cp ranks; the default group when
    there is one stage); every rank builds them, in the same order."""
    import torch.distributed as dist
    n = m.stage_devices
    if m.pp == 1:
        return [dist.group.WORLD]
    return [dist.new_group(list(range(s * n, (s + 1) * n))) for s in range(m.pp)]


def train(rank: int, world: int, cfg: dict, workers: int = 1) -> dict:
    """One rank; returns the loss of every step (the same on every rank), the gradients of the first step
    of the parameters its stage owns (by name, after the reduction; numpy arrays), what the plans looked
    like and, per pipelined step, what :func:`run_schedule` ran (``kv_reads``, ``recomputes``).

    With ``pp = 1`` and whole documents a rank runs its micro-batches one after another (gradient
    accumulation); on a pipeline (``pp > 1``) or with ChunkFlow's chunks it runs its stage's ops of the
    plan's schedule (:func:`run_schedule`). Gradients (and the loss) are summed over the dp × cp ranks of
    the stage in one all_reduce, and every rank takes the same AdamW step on the parameters it owns."""
    import torch.distributed as dist
    from attnplan.step.driver import pipelined
    m = mesh(cfg)
    if world != m.devices:
        raise ValueError(f"the mesh {m.spec()} has {m.devices} ranks, the job {world}")
    stage = rank // m.stage_devices
    part = stage_part(cfg, m, stage)
    model = make_model(cfg)
    named = stage_parameters(model, part)
    params = [p for _, p in named]
    opt = torch.optim.AdamW(params, lr=cfg["lr"])
    group = stage_groups(m)[stage]
    losses, micro, first_grads, ran = [], [], {}, {"kv_reads": [], "recomputes": []}
    with StepLoader(global_batches(cfg), step_model(cfg), m, system_spec(cfg),
                    mask=cfg["mask"], block_size=cfg["block_size"], workers=workers) as loader:
        for step in loader:
            for p in params:
                p.grad = torch.zeros_like(p)
            if pipelined(step.plan):
                total, stats = run_schedule(model, part, step, rank, m.stage_devices)
                for key, value in stats.items():
                    ran[key].append(value)
            else:
                total = torch.zeros((), dtype=torch.float32)
                for mb in step:  # gradient accumulation, in the plan's order
                    logits = model(mb.ids, mb.position_ids, mb.attention)
                    tok = F.cross_entropy(logits, mb.labels.clamp_min(0), reduction="none")
                    loss = (tok * mb.loss_weights).sum()
                    loss.backward()
                    total += loss.detach()
            flat = torch.cat([p.grad.reshape(-1) for p in params] + [total.reshape(1)])
            dist.all_reduce(flat, group=group)  # the stage's dp x cp ranks: its gradients of the global batch
            i = 0
            for p in params:
                p.grad.copy_(flat[i:i + p.numel()].view_as(p))
                i += p.numel()
            if not first_grads:
                first_grads = {n: p.grad.numpy().copy() for n, p in named}  # numpy: it leaves the process
            opt.step()
            loss = flat[-1]
            if m.pp > 1:  # the last stage's loss to every rank (one rank of it adds it to zeros)
                loss = loss.clone() if part.last and rank % m.stage_devices == 0 else torch.zeros_like(loss)
                dist.all_reduce(loss)
            losses.append(float(loss))
            micro.append(len(step))
        groups = len(loader.groups)
    return dict({"losses": losses, "micro_batches": micro, "groups": groups, "grads": first_grads}, **ran)


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


def train_reference(cfg: dict, grads: dict | None = None) -> list[float]:
    """The same steps in one process: every document the step trains (:func:`reference_steps`) packed in
    order, dense attention masked to each document, the loss normalized by the step's label tokens.
    ``grads``: filled with the first step's gradients, by parameter name (numpy arrays)."""
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
        if grads is not None and not grads:
            grads.update({n: p.grad.numpy().copy() for n, p in model.named_parameters()})
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def merge_ranks(results: list[dict]) -> dict:
    """One run's result from every rank's (in rank order): rank 0's, with the first step's gradients of
    every stage's parameters (each from the first rank holding them); RuntimeError when the ranks disagree
    on the loss."""
    if any(x["losses"] != results[0]["losses"] for x in results):
        raise RuntimeError("the ranks disagree on the loss")
    grads: dict = {}
    for x in results:
        for name, g in x["grads"].items():
            grads.setdefault(name, g)
    return dict(results[0], grads=grads)


def run(workers: int = 1, timeout: float = 300.0, **overrides) -> dict:
    """Train on dp × cp × pp fresh local gloo processes; rank 0's result with every stage's first-step
    gradients (:func:`merge_ranks`: every rank must agree on the losses)."""
    from attnplan.tools.launch import run_local
    cfg = dict(CONFIG, **overrides)
    cfg["system"] = system_spec(cfg)
    res = run_local(f"{os.path.abspath(__file__)}:train", mesh(cfg).devices, (cfg, workers), timeout=timeout)
    for r, x in enumerate(res):
        if x[0] != "ok":
            raise RuntimeError(f"rank {r}: {x[1]}: {x[2] if len(x) > 2 else ''}\n{x[3] if len(x) > 3 else ''}")
    return dict(merge_ranks([x[1] for x in res]), system=cfg["system"])


def largest_difference(got: dict, want: dict) -> float:
    """The largest relative difference of gradients ``got`` from ``want`` (by name; the same names):
    ``max |a - b| / max |b|`` per tensor."""
    if set(got) != set(want):
        raise RuntimeError(f"gradients of different parameters: {sorted(set(got) ^ set(want))[:4]}")
    return max(float(np.abs(got[n] - want[n]).max() / max(np.abs(want[n]).max(), 1e-30)) for n in want)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--system", default="", help="a batch pass of attnplan.step (default: gds if registered, else wlb)")
    ap.add_argument("--steps", type=int, default=CONFIG["steps"])
    ap.add_argument("--dp", type=int, default=CONFIG["dp"])
    ap.add_argument("--cp", type=int, default=CONFIG["cp"])
    ap.add_argument("--pp", type=int, default=CONFIG["pp"], help="pipeline stages (1F1B; ChunkFlow's schedule "
                    "with --system chunkflow{chunk=...})")
    ap.add_argument("--step-tokens", type=int, default=CONFIG["step_tokens"])
    ap.add_argument("--micro-tokens", type=int, default=CONFIG["micro_tokens"],
                    help="tokens per micro-batch for systems with max_tokens (wlb, gds)")
    ap.add_argument("--seed", type=int, default=CONFIG["seed"])
    ap.add_argument("--workers", type=int, default=1, help="planning worker processes per rank")
    ap.add_argument("--reference", action="store_true", help="one process, dense masked attention")
    ap.add_argument("--compare", action="store_true", help="run both and print the largest relative difference")
    ap.add_argument("--json", help="write the loss curve(s) here")
    a = ap.parse_args(argv)
    over = dict(steps=a.steps, dp=a.dp, cp=a.cp, pp=a.pp, step_tokens=a.step_tokens, micro_tokens=a.micro_tokens,
                seed=a.seed, system=a.system)
    cfg = dict(CONFIG, **over)
    torch.set_num_threads(1)
    out: dict = {}
    ref_grads: dict = {}
    if a.reference or a.compare:
        out["reference"] = train_reference(cfg, ref_grads)
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
        print(f"system {system_spec(cfg)}, dp={cfg['dp']} x cp={cfg['cp']} x pp={cfg['pp']}: micro-batches per "
              f"step on rank 0 {res['micro_batches']}, {res['groups']} process groups")
    for key, curve in out.items():
        for i, x in enumerate(curve):
            if i % 5 == 0 or i == len(curve) - 1:
                print(f"{key:11s} step {i:3d}  loss {x:.6f}")
    if a.compare:
        rel = max(abs(x - y) / abs(y) for x, y in zip(out["distributed"], out["reference"]))
        print(f"largest relative difference from the dense reference: {rel:.2e}")
        got = res["grads"]  # under torchrun: rank 0's stage only
        print(f"first step's gradients ({len(got)} tensors), largest relative difference: "
              f"{largest_difference(got, {n: ref_grads[n] for n in got}):.2e}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
