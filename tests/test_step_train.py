"""The step loader (issue 10, item 7: tools/step_loader.py) and examples/train_step.py.

In one process (no torch.distributed): on random global batches × systems ×
small meshes, the ranks' micro-batches partition the step's tokens, carry the
right ids, labels, positions and loss weights, in the plan's order; the
micro-batches' weighted losses and their gradients sum to the dense
single-process loss and gradient of the global batch; plans made in a worker
equal plans made in place, byte for byte; errors come typed, at their step;
sub-groups are built once each, in the plan's order. With processes (slow
tier): the tiny model trained on 4 gloo ranks (dp=2 × cp=2) equals dense
single-process training step by step, and repeats bitwise."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from attnplan.errors import BatchError, PlanError, StepError
from attnplan.runtime.executor import execute
from attnplan.step import Mesh, Model, StepPass, build_plan, compile_step, make_problem, register_system, system_names
from attnplan.step.stepfile import pack
from attnplan.tools import step_loader as sl
from attnplan.tools.step_loader import IGNORE, StepLoader, batch_documents

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_step.py"
TINY = Model("tiny-lm", 2, 32, 4, 2, 8, 128, 32, mlp="gelu")
MESHES = [(1, 2, 2), (2, 1, 2), (2, 2, 2), (2, 2, 4), (1, 4, 4)]  # dp, cp, devices a node
# every registered system (gds, dyncp, flexsp ... as they land), and micro-batch caps that force accumulation
SYSTEMS = tuple(system_names()) + ("wlb{max_tokens=120}",) + (("gds{max_tokens=120}",) if "gds" in system_names()
                                                              else ())


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_step_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def loader(batches, mesh, system="wlb", rank=0, workers=0, **kw):
    dp, cp, per_node = mesh
    return StepLoader(batches, TINY, Mesh(dp, cp, devices_per_node=per_node), system, block_size=kw.pop("block", 8),
                      rank=rank, workers=workers, process_groups=False, **kw)


def every_rank(batches, mesh, system):
    """Per step, per rank: the rank's StepBatch (one loader per rank, as the ranks of a job have)."""
    n = mesh[0] * mesh[1]
    per_rank = []
    for r in range(n):
        with loader(batches, mesh, system, rank=r) as ld:
            per_rank.append(list(ld))
    return [[per_rank[r][s] for r in range(n)] for s in range(len(per_rank[0]))]


@st.composite
def batches(draw):
    """1-3 global batches of documents: lengths short and long, token ids in the vocabulary."""
    seed = draw(st.integers(0, 2 ** 32 - 1))
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(draw(st.integers(1, 3))):
        lens = draw(st.lists(st.one_of(st.integers(1, 10), st.integers(11, 100)), min_size=1, max_size=10))
        out.append([rng.integers(0, TINY.vocab, n) for n in lens])
    return out


@settings(max_examples=25)
@given(batches(), st.sampled_from(MESHES), st.sampled_from(SYSTEMS))
def test_ranks_micro_batches_partition_the_step_with_labels_positions_and_weights(data, mesh, system):
    steps = every_rank(data, mesh, system)
    assert len(steps) == len(data)
    for docs, ranks in zip(data, steps):
        plan = ranks[0].plan
        assert all(s.digest == ranks[0].digest and s.plan.system == plan.system for s in ranks)  # one plan
        n_labels = sum(len(d) - 1 for d in docs)
        seen = {}
        weight = 0.0
        for r, step in enumerate(ranks):
            assert step.rank == r and step.label_tokens == n_labels and step.tokens == sum(map(len, docs))
            assert [mb.index for mb in step] == plan.rank_order()[r]
            assert [mb.slot for mb in step] == sorted(mb.slot for mb in step)  # accumulation order
            for mb in step:
                assert mb.ranks[mb.device] == r and mb.plan.devices == len(mb.ranks) == len(plan.mb_ranks(mb.index))
                assert mb.group is None
                assert len(sl.query_rows(mb.plan.ir, mb.device)) == mb.ids.numel() == mb.labels.numel()
                for i, (d, p) in enumerate(zip(mb.doc_ids.tolist(), mb.position_ids.tolist())):
                    key = (d, p)
                    assert key not in seen, f"token {key} on two ranks"
                    seen[key] = (r, mb.index)
                    assert mb.ids[i] == docs[d][p]
                    assert mb.labels[i] == (docs[d][p + 1] if p + 1 < len(docs[d]) else IGNORE)
                has = mb.labels != IGNORE
                assert mb.label_tokens == int(has.sum())
                assert torch.equal(mb.loss_weights == 0, ~has)
                assert torch.allclose(mb.loss_weights[has], torch.full((int(has.sum()),), 1.0 / max(n_labels, 1)))
                weight += float(mb.loss_weights.double().sum())
        assert sorted(seen) == [(d, p) for d in range(len(docs)) for p in range(len(docs[d]))]  # every token once
        assert weight == pytest.approx(1.0, rel=1e-6) if n_labels else weight == 0


class TinyNet(torch.nn.Module):
    """One attention layer with rotary positions and a linear head: enough for the loss and its gradient."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        h, kv, d, dim = TINY.heads, TINY.kv_heads, TINY.head_dim, TINY.hidden
        self.emb = torch.nn.Parameter(torch.randn(TINY.vocab, dim, generator=g, dtype=torch.float64))
        self.qkv = torch.nn.Parameter(torch.randn(dim, (h + 2 * kv) * d, generator=g, dtype=torch.float64) / dim ** .5)
        self.out = torch.nn.Parameter(torch.randn(h * d, TINY.vocab, generator=g, dtype=torch.float64) / 8)

    def qkv_of(self, ids, pos):
        h, kv, d = TINY.heads, TINY.kv_heads, TINY.head_dim
        x = self.emb[ids] @ self.qkv
        q, k, v = x.split([h * d, kv * d, kv * d], dim=-1)
        ang = pos.double()[:, None, None] * 0.1
        return q.view(-1, h, d) * torch.cos(ang), k.view(-1, kv, d) * torch.cos(ang), v.reshape(-1, kv, d)

    def forward(self, ids, pos, attn, keys=None):
        """Logits of tokens ``ids`` at positions ``pos``; ``keys = (ids, pos)``: the K, V come from those
        tokens (a later chunk's cross plan: its rows against its document up to its end)."""
        q, k, v = self.qkv_of(ids, pos)
        if keys is not None:
            _, k, v = self.qkv_of(*keys)
        return attn(q, k, v).reshape(len(ids), -1) @ self.out


def dense_attention(lens):
    """Causal attention inside each document of a packed batch (the reference)."""
    def attn(q, k, v):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        pos = torch.cat([torch.arange(n) for n in lens])
        allowed = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
        s = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** .5
        return torch.einsum("hqk,khd->qhd", torch.softmax(s.masked_fill(~allowed, float("-inf")), -1), v)
    return attn


def assert_dense_equal(ranks, docs):
    """Every micro-batch of one step rebuilt from its ranks' local rows (ids, positions, labels, weights)
    and run with its attention plan: Σ weight × token loss and its parameter gradient equal the dense
    mean loss and gradient of the documents the step trains (``docs``: the step problem's documents,
    carried ones first; those queued for a later step are not trained) — what summing the ranks'
    gradients gives in training."""
    plan = ranks[0].plan
    trained = sorted(set(plan.frag_doc.tolist()))
    net = TinyNet()
    total = torch.zeros((), dtype=torch.float64)
    for m in range(plan.n_mb):
        mbs = {mb.device: mb for step in ranks for mb in step if mb.index == m}
        ir = mbs[0].plan.ir
        n = sum(plan.mb_seqlens(m))
        rows = {k: torch.zeros(n, dtype=torch.int64) for k in ("ids", "position_ids", "labels")}
        w = torch.zeros(n, dtype=torch.float64)
        for dev, mb in mbs.items():
            idx = torch.from_numpy(sl.query_rows(ir, dev))
            for k in rows:
                rows[k][idx] = getattr(mb, k)
            w[idx] = mb.loss_weights.double()
        keys = None
        if plan.mb_prefix(m):  # a later chunk of a cut document: its keys are the document up to its end
            f = int(plan.mb_ptr()[m])
            end = int(plan.frag_end[f])
            keys = (torch.from_numpy(np.asarray(docs[int(plan.frag_doc[f])][:end], np.int64)), torch.arange(end))
        logits = net(rows["ids"], rows["position_ids"], lambda q, k, v, ir=ir: execute(ir, q, k, v), keys)
        total = total + (F.cross_entropy(logits, rows["labels"].clamp_min(0), reduction="none") * w).sum()
    total.backward()
    got = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    docs = [docs[d] for d in trained]
    lens = [len(d) for d in docs]
    ids = torch.from_numpy(np.concatenate(docs))
    labels = torch.from_numpy(np.concatenate([np.append(d[1:], IGNORE) for d in docs]))
    pos = torch.cat([torch.arange(n) for n in lens])
    ref = F.cross_entropy(net(ids, pos, dense_attention(lens)), labels, ignore_index=IGNORE)
    ref.backward()
    # float32 weights (1/L rounded) against the exact mean: relative error of order 1e-7
    assert float(total.detach()) == pytest.approx(float(ref.detach()), rel=1e-5)
    for g, p in zip(got, net.parameters()):
        assert torch.allclose(g, p.grad, rtol=1e-5, atol=1e-9)


@settings(max_examples=12)
@given(batches(), st.sampled_from(MESHES), st.sampled_from(SYSTEMS))
def test_weighted_micro_batch_losses_sum_to_the_dense_global_loss_and_gradient(data, mesh, system):
    """Σ weight × token loss over the micro-batches, and its gradient, equal the dense global batch's
    mean loss and gradient (:func:`assert_dense_equal`)."""
    docs = data[0]
    if sum(len(d) - 1 for d in docs) == 0:
        return
    assert_dense_equal(every_rank([docs], mesh, system)[0], docs)


def test_plans_from_a_worker_equal_plans_made_in_place_byte_for_byte():
    rng = np.random.default_rng(3)
    data = [[rng.integers(0, 32, n) for n in lens] for lens in ([40, 9, 70, 3], [5, 5, 90], [90, 1, 1, 30])]
    mesh = (2, 2, 2)
    with loader(data, mesh, "wlb{max_tokens=100}", workers=1) as ld:
        far = [s.digest for s in ld]
    with loader(data, mesh, "wlb{max_tokens=100}", workers=0) as ld:
        near = [s.digest for s in ld]
    direct = []
    for docs in data:
        p = make_problem([len(d) for d in docs], model=TINY, mesh=Mesh(2, 2, devices_per_node=2), block_size=8)
        direct.append(sl.read_step(pack(compile_step(p, "wlb{max_tokens=100}")), "x")[0])
    assert far == near == direct
    assert len(set(far)) == len(far)  # different batches, different plans


def test_errors_come_typed_at_their_step_and_later_steps_still_come():
    rng = np.random.default_rng(0)
    good = [rng.integers(0, 32, 20), rng.integers(0, 32, 7)]
    data = [good, [np.array([], np.int64)], [np.array([1, 2, 32])], [np.array([0.5, 1.0])],
            {"name": "long", "docs": [rng.integers(0, 32, 300)]}, {"name": "fine", "docs": good}]
    with loader(data, (2, 1, 2), "wlb{max_tokens=200}") as ld:
        assert next(ld).name == "#0"
        with pytest.raises(BatchError, match=r"^step #1: document 0: a non-empty 1-D array"):
            next(ld)
        with pytest.raises(BatchError, match=r"^step #2: document 0: token ids must be in 0\.\.31"):
            next(ld)
        with pytest.raises(BatchError, match=r"^step #3: document 0: .*integer token ids"):
            next(ld)
        with pytest.raises(StepError, match=r"^batch long: wlb: document 0 \(300 tokens\) does not fit"):
            next(ld)
        assert next(ld).name == "fine"
        with pytest.raises(StopIteration):
            next(ld)


QUEUE = "wlb{max_tokens=100,outlier=0.5}"   # documents of 50 tokens or more wait for a slot of their own


def test_a_queue_carries_documents_to_later_steps_each_trained_once_with_the_dense_loss():
    """WLB-LLM's outlier queue across steps: step s + 1 is planned with step s's queue as its carried
    documents, the queue drains in an end-of-data step, every document of the data is trained exactly
    once (every token once, with its ids and position), each step's loss and gradient equal dense
    training of that step's documents, and planning in a worker gives the same bytes."""
    rng = np.random.default_rng(1)
    lens = ([90, 10, 10], [20, 60, 5], [30, 30], [70, 8])
    data = [[rng.integers(0, 32, n) for n in ls] for ls in lens]
    steps = every_rank(data, (2, 1, 2), QUEUE)
    plans = [ranks[0].plan for ranks in steps]
    assert any(len(p.queue_out) for p in plans) and any(p.problem.carried for p in plans)  # the queue worked
    assert [r[0].name for r in steps][-1] == "end-of-data" and not len(plans[-1].queue_out)
    with loader(data, (2, 1, 2), QUEUE, workers=1) as ld:
        assert [(s.name, s.digest) for s in ld] == [(r[0].name, r[0].digest) for r in steps]
    trained: dict[tuple[int, int], list[int]] = {}
    for ranks in steps:
        plan = ranks[0].plan
        p = plan.problem
        assert all(r.digest == ranks[0].digest for r in ranks)
        step_docs = [data[s][i] for s, i in p.origin.tolist()]          # carried ones first
        for step in ranks:
            for mb in step:
                for d, pos, tok in zip(mb.doc_ids.tolist(), mb.position_ids.tolist(), mb.ids.tolist()):
                    s, i = p.origin[d].tolist()
                    assert tok == data[s][i][pos]
                    trained.setdefault((s, i), []).append(pos)
        assert_dense_equal(ranks, step_docs)
    assert {k: sorted(v) for k, v in trained.items()} == {
        (s, i): list(range(len(d))) for s, b in enumerate(data) for i, d in enumerate(b)}


def test_a_failed_step_of_a_chain_carries_its_queue_on():
    rng = np.random.default_rng(2)
    data = [[rng.integers(0, 32, n) for n in (90, 10, 10)], [np.array([], np.int64)],
            [rng.integers(0, 32, n) for n in (20, 5)]]
    with loader(data, (2, 1, 2), QUEUE) as ld:
        first = next(ld)
        assert first.plan.queue_out.tolist() == [0]
        with pytest.raises(BatchError, match=r"^step #1: document 0"):
            next(ld)
        rest = list(ld)
    carried = [s.plan.problem.origin[:s.plan.problem.carried].tolist() for s in rest]
    assert carried[0] == [[0, 0]] and sum(len(s.plan.frag_doc) for s in rest) == 3  # doc (0, 0) trained later


@pytest.mark.parametrize("kwargs,err,msg", [
    (dict(rank=4), StepError, "rank must be an integer in 0..3"),
    (dict(rank=None), StepError, "rank must be an integer"),
    (dict(system="nope"), StepError, "unknown system 'nope'"),
    (dict(system="wlb{micro=-1}"), StepError, "micro must be an integer"),
    (dict(mask="sliding_window(0)"), Exception, "sliding_window"),
    (dict(workers=-1), PlanError, "workers must be"),
])
def test_bad_options(kwargs, err, msg):
    kw = dict(dict(rank=0, system="wlb"), **kwargs)
    with pytest.raises(err, match=msg):
        loader([[np.arange(4)]], (2, 2, 2), **kw)


def test_process_groups_need_torch_distributed():
    with pytest.raises(StepError, match="torch.distributed is not initialized"):
        StepLoader([[np.arange(4)]], TINY, Mesh(2, 2), "wlb", workers=0)


@settings(max_examples=20)
@given(st.lists(st.integers(1, 50), max_size=30), st.integers(1, 120), st.booleans())
def test_batch_documents_cuts_the_stream_in_order(lens, tokens, drop_last):
    docs = [np.arange(n) for n in lens]
    out = list(batch_documents(iter(docs), tokens, drop_last))
    flat = [d for b in out for d in b]
    assert [len(d) for d in flat] == lens[:len(flat)]
    for i, b in enumerate(out):
        size = sum(map(len, b))
        if i < len(out) - 1 or size >= tokens:
            assert size >= tokens and size - len(b[-1]) < tokens  # full, and it stopped as soon as full
    assert len(flat) == len(lens) or drop_last and sum(lens[len(flat):]) < tokens


def test_groups_are_built_once_each_in_plan_order_on_every_rank(monkeypatch):
    """GroupCache calls new_group once per distinct rank set, in the order the plans list the groups, and
    takes the default group for all ranks (what keeps the ranks' collective calls in step)."""
    import torch.distributed as dist
    calls = []
    monkeypatch.setattr(dist, "new_group", lambda ranks: calls.append(tuple(ranks)) or ("group", tuple(ranks)))
    rng = np.random.default_rng(5)
    data = [[rng.integers(0, 32, n) for n in lens] for lens in ([50, 40, 30, 20], [60, 5, 5, 5, 5], [90, 80])]
    cache = sl.GroupCache(4)
    seen = []
    for system in ("wlb{max_tokens=100}", "pool", "fixed"):
        for step in every_rank(data, (2, 2, 2), system):
            plan = step[0].plan
            for g in range(plan.n_groups):
                key = tuple(plan.group(g).tolist())
                if key not in seen:
                    seen.append(key)
            cache.ensure(plan)
            cache.ensure(plan)  # again: nothing new
            for m in range(plan.n_mb):
                key = tuple(plan.mb_ranks(m).tolist())
                assert cache.get(key) == (dist.group.WORLD if key == (0, 1, 2, 3) else ("group", key))
    assert calls == [k for k in seen if k != (0, 1, 2, 3)] and len(set(calls)) == len(calls)
    assert (0, 1) in calls and (2, 3) in calls and len(cache) == len(seen)
    with pytest.raises(StepError, match="no process group"):
        cache.get((0, 3))


def test_example_data_is_long_tailed_seeded_and_cut_into_steps(example):
    cfg = dict(example.CONFIG, steps=6)
    steps = list(example.global_batches(cfg))
    again = list(example.global_batches(cfg))
    assert len(steps) == 6 and all(np.array_equal(a, b) for s, t in zip(steps, again) for a, b in zip(s, t))
    lens = np.array([len(d) for s in steps for d in s])
    assert lens.min() >= 2 and lens.max() <= cfg["max_doc"] and lens.max() > 8 * np.median(lens)
    assert all(sum(map(len, s)) >= cfg["step_tokens"] for s in steps)
    assert example.system_spec(dict(cfg, system="wlb")) == f"wlb{{max_tokens={cfg['micro_tokens']}}}"
    assert example.system_spec(dict(cfg, system="pool")) == "pool"


# ----------------------------------------------------------------------------- processes (slow tier)

@dataclass(frozen=True, slots=True)
class Mixed(StepPass):
    """A test system with every kind of group on dp=2 × cp=2 (2 devices a node): one-rank groups, a pair,
    the whole world, in three slots; the shortest document alone on all four ranks (three of them hold
    no token of it)."""

    name = "test_mixed"

    def apply(self, problem):
        lens = problem.seqlens
        short = int(np.argmin(lens))
        rest = np.array([d for d in range(problem.docs) if d != short], np.int64)
        groups = [[0], [1], [2, 3], [0, 1], [2, 3]]
        slots = [0, 0, 0, 2, 2]
        mb = [(rest[i::5], g, s) for i, (g, s) in enumerate(zip(groups, slots)) if len(rest[i::5])]
        mb.append((np.array([short]), [0, 1, 2, 3], 1))
        return build_plan(problem, self.spec(), [m[0] for m in mb], [m[1] for m in mb], [m[2] for m in mb],
                          ["zigzag"] * len(mb))


def _train_runs(rank, world, cfg, runs):
    """One rank: the example's training once per (system, workers), each from scratch in this process."""
    if "test_mixed" not in system_names():
        register_system(Mixed)  # this process only: such runs plan in place (workers=0)
    ex = _example_module()
    return [ex.train(rank, world, dict(cfg, system=system), workers) for system, workers in runs]


def _example_module():
    spec = importlib.util.spec_from_file_location("train_step_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow  # 4 gloo processes, each importing torch: about 30 s on an idle 2-core machine, more under load
def test_distributed_training_equals_dense_single_process_and_repeats_bitwise(example):
    from attnplan.tools.launch import run_local
    other = "gds" if "gds" in system_names() else "pool"
    cfg = dict(example.CONFIG, steps=3, step_tokens=1024, max_doc=300, micro_tokens=320)  # CI size
    runs = [("wlb", 1), ("wlb", 0), (other, 0), ("test_mixed", 0)]
    res = run_local(f"{Path(__file__).resolve()}:_train_runs", 4, (cfg, runs), timeout=400)
    for r, x in enumerate(res):
        assert x[0] == "ok", (r, x)
    per_rank = [x[1] for x in res]
    assert all(p[i]["losses"] == per_rank[0][i]["losses"] for p in per_rank for i in range(len(runs)))
    wlb, wlb_again, gds, mixed = per_rank[0]
    ref = example.train_reference(cfg)  # the same global batches whatever the system
    assert wlb["losses"] == wlb_again["losses"]  # bitwise, planned in a worker or in place
    for run in (wlb, gds, mixed):
        assert len(run["losses"]) == len(ref) == 3
        rel = max(abs(x - y) / abs(y) for x, y in zip(run["losses"], ref))
        assert rel <= 1e-5, (run, ref)
    assert max(wlb["micro_batches"]) >= 2  # gradient accumulation happened
    assert wlb["groups"] == 2  # the two CP groups, built once, reused every step
    assert mixed["groups"] == 5 and mixed["micro_batches"] == [3] * 3  # rank 0: [0], the world, [0, 1]


def _pipeline_cfg(example):
    """The CI size of the pipeline runs: 4 ranks as dp=1 × cp=2 × pp=2 (one layer a stage)."""
    return dict(example.CONFIG, dp=1, cp=2, pp=2, steps=3, step_tokens=1024, max_doc=300, micro_tokens=320)


PIPELINE_RUNS = [("wlb{max_tokens=320}", 0), ("chunkflow{chunk=128}", 0)]


@pytest.mark.slow  # 4 gloo processes, each importing torch: about 40 s on an idle 2-core machine, more under load
def test_pipeline_training_1f1b_and_chunkflow_equals_dense_single_process(example):
    """pp=2 × cp=2: WLB-LLM's micro-batches under 1F1B and ChunkFlow's chunks (documents longer than the
    chunk cut, the later chunks reading the earlier ones' K, V at every layer, their gradients flowing
    back, dropped chunks recomputed) give every step's loss and the first step's gradients of every
    stage's parameters of dense single-process training within 1e-5."""
    from attnplan.step.pipeline import build_schedule
    from attnplan.tools.launch import run_local
    cfg = _pipeline_cfg(example)
    res = run_local(f"{Path(__file__).resolve()}:_train_runs", 4, (cfg, PIPELINE_RUNS), timeout=400)
    for r, x in enumerate(res):
        assert x[0] == "ok", (r, x)
    runs = [example.merge_ranks([x[1][i] for x in res]) for i in range(len(PIPELINE_RUNS))]
    ref_grads: dict = {}
    ref = example.train_reference(cfg, ref_grads)
    names = {n for n, _ in example.make_model(cfg).named_parameters()}
    assert set(ref_grads) == names
    for (system, _), run in zip(PIPELINE_RUNS, runs):
        assert len(run["losses"]) == len(ref) == 3
        rel = max(abs(x - y) / abs(y) for x, y in zip(run["losses"], ref))
        assert rel <= 1e-5, (system, run["losses"], ref)
        assert set(run["grads"]) == names  # each stage gave its own parameters
        assert example.largest_difference(run["grads"], ref_grads) <= 1e-5, system
        assert len(run["kv_reads"]) == 3  # every step ran on the pipeline schedule
    wlb, chunkflow = runs
    assert max(wlb["micro_batches"]) >= 2 and sum(wlb["kv_reads"]) == 0
    assert sum(chunkflow["kv_reads"]) >= 3 and sum(chunkflow["recomputes"]) >= 3  # carried KV, recompute ran
    # the plans the ranks ran: documents cut into chunks (one into three), a ChunkFlow schedule
    m = example.mesh(cfg)
    cut = three = 0
    for batch in example.global_batches(cfg):
        problem = make_problem([len(d) for d in batch], model=example.step_model(cfg), mesh=m,
                               block_size=cfg["block_size"])
        plan = compile_step(problem, "chunkflow{chunk=128}").plan
        assert plan.chunk_keep >= 1 and build_schedule(plan).kind == "chunkflow"
        cut += int((plan.frag_start > 0).sum())
        three += int(np.bincount(plan.frag_doc).max() >= 3)
    assert cut >= 3 and three >= 1
