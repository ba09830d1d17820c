"""The distributed runtime: plans executed by one process per device over
torch.distributed (gloo, loopback) equal the in-process executor bit for bit,
inside autograd and a training-style step; faults give typed errors naming
the peer and the transfer; ``plan run --procs`` checks against dense
attention. Multi-process tests start fresh processes (about 3 s each here)."""

from pathlib import Path

import numpy as np
import pytest

import attnplan
from attnplan.cli import main
from attnplan.runtime import layout
from attnplan.tools.launch import run_local

pytestmark = pytest.mark.slow  # processes: the slow tier (make test runs it; -m 'not slow' skips)

CASES = str(Path(__file__).with_name("_dist_cases.py"))


def ok(results):
    for r, res in enumerate(results):
        assert res[0] == "ok", f"rank {r}: {res}"
    return [res[1] for res in results]


# ---------------------------------------------------------------- layout (no processes)

@pytest.mark.parametrize("strategy", attnplan.strategies())
def test_local_layout_partitions_tokens(strategy):
    try:
        plan = attnplan.compile(seqlens=[37, 11, 64, 5, 90], mask="causal", devices=3, heads=3, kv_heads=3,
                                head_dim=8, block_size=8, strategy=strategy)
    except attnplan.PlanError as e:
        pytest.skip(str(e))
    ir, T = plan.ir, plan.problem.tokens
    idx = [plan.local_index(d) for d in range(3)]
    assert sorted(np.concatenate(idx).tolist()) == list(range(T))  # every token on exactly one rank
    off = plan.problem.offsets
    for d in range(3):
        assert len(idx[d]) == plan.local_tokens(d)
        tbs = layout.home_blocks(ir, d)
        assert np.all(np.diff(tbs) > 0) and np.all(np.diff(idx[d][np.r_[0, np.cumsum(ir.graph.tb_len[tbs])[:-1]]]) > 0)
        sid = plan.sample_ids(d)
        assert np.all((idx[d] >= off[sid]) & (idx[d] < off[sid + 1]))
        pos = plan.position_ids(d)
        assert np.array_equal(pos, idx[d] - off[sid]) and pos.min(initial=0) >= 0
        assert np.array_equal(plan.position_ids(d, kind="global"), idx[d])
        row0 = layout.local_row0(ir, d)
        assert np.array_equal(idx[d][row0[tbs]], ir.graph.tb_start[tbs])
    x = np.arange(T * 2).reshape(T, 2)
    assert np.array_equal(plan.dispatch(x, rank=1), x[idx[1]])
    with pytest.raises(attnplan.PlanError, match="rank 3 does not exist"):
        plan.position_ids(3)
    with pytest.raises(attnplan.PlanError, match="position kind"):
        plan.position_ids(0, kind="packed")
    with pytest.raises(attnplan.ShapeError, match=f"{T} tokens"):
        plan.dispatch(x[1:], rank=0)


def test_one_device_plan_runs_without_torch_distributed():
    import torch
    plan = attnplan.compile(seqlens=[40, 9], mask="causal", devices=1, heads=2, kv_heads=1, head_dim=8,
                            block_size=16, dtype="float32")
    from attnplan.runtime.check import random_inputs
    q, k, v, dout = random_inputs(plan, "float32", 1)
    qa, qb = q.clone().requires_grad_(True), q.clone().requires_grad_(True)
    a = attnplan.attention(qa, k, v, plan)
    b = attnplan.execute(plan, qb, k, v)
    assert torch.equal(a, b)
    assert torch.equal(torch.autograd.grad(a, qa, dout)[0], torch.autograd.grad(b, qb, dout)[0])
    assert torch.equal(plan.undispatch(a), a)
    two = attnplan.compile(seqlens=[40, 9], devices=2, heads=2, kv_heads=1, head_dim=8, block_size=16)
    with pytest.raises(attnplan.PlanError, match="not initialized"):
        attnplan.attention(two.dispatch(q, 0), two.dispatch(k, 0), two.dispatch(v, 0), two)


# ---------------------------------------------------------------- multi-process

# multi-stage schedules (transfers of stage s+1 posted during stage s), ring forwarding, in-node tree hops
PIPELINES = ["tile{block={block}},zigzag,comm{mode=p2p},divide{stages=3},overlap,emit",
             "tile{block={block}},minheap,comm,divide{stages=2},overlap{local=last},emit",  # own blocks last
             "tile{block={block}},span{grain=0.25,min_chunk=1},comm{mode=p2p,relay=tree},overlap,emit"]  # the tree


@pytest.mark.parametrize("world,cases", [(2, [0, 1, 2, 3]), (3, [3])])
def test_every_strategy_equals_in_process(world, cases):
    """Forward, backward and the gathered results on `world` gloo processes equal
    attnplan.execute bit for bit, for every registered strategy (default
    pipelines: zigzag forwards KV around a ring) and staged pipelines."""
    res = ok(run_local(f"{CASES}:equals_in_process", world, (cases, list(attnplan.strategies()) + PIPELINES),
                       timeout=240))
    assert all(r["ran"] >= len(cases) for r in res)  # zigzag at least ran every case
    assert [b for r in res for b in r["bad"]] == []


def test_messages_matched_by_posting_order_alone():
    """``match="order"``: every message with tag 0, so gloo matches the
    messages between two ranks by posting order only, as NCCL does. Every
    strategy and the staged, overlapped pipelines (ring forwarding included)
    still equal the in-process executor bit for bit: the posting-order
    invariant the verifier proves is what the programs need on NCCL."""
    res = ok(run_local(f"{CASES}:equals_in_process", 3,
                       ([0, 2], list(attnplan.strategies()) + PIPELINES, "order"), timeout=240))
    assert all(r["ran"] >= 2 for r in res)
    assert [b for r in res for b in r["bad"]] == []


def test_kv_head_copies_run_on_processes():
    """Ulysses beyond the kv heads (4 query heads, 1 kv head on 2 and 4 ranks:
    every kv head copied 2 and 4 times) and usp with a Ulysses degree above
    the kv heads: the copies travel as their own blocks, their gradients sum
    back into the one kv head, and everything equals the in-process executor
    bit for bit, with order-only matching."""
    for world in (2, 4):
        res = ok(run_local(f"{CASES}:equals_in_process", world,
                           ([1, 3], ["ulysses", "tile{block={block}},usp{ulysses=2},comm,overlap,emit"], "order",
                            {"kv_heads": 1}), timeout=240))
        assert all(r["ran"] == 4 for r in res)
        assert res[0]["kv_rep"] == [world, 2] * 2
        assert [b for r in res for b in r["bad"]] == []


def test_partials_in_bf16_run_on_processes():
    """Partial outputs sent in bf16 (``partials_dtype``) on 4 gloo ranks of 2
    nodes (node reduces: an aggregator sums bf16 partials into its fp32 own
    and sends the sum in bf16; the in-node tree; an all-to-all): bit for bit
    the in-process executor, with order-only matching."""
    res = ok(run_local(f"{CASES}:equals_in_process", 4,
                       ([3], ["per_doc", "hypergraph", "span:tree", "ulysses:a2a"], "order",
                        {"partials_dtype": "bfloat16", "nodes": 2}), timeout=240))
    assert all(r["ran"] == 4 for r in res)
    assert [b for r in res for b in r["bad"]] == []


def test_kept_kv_runs_on_processes():
    """``keep_kv``: the backward computes with the KV each rank received in the
    forward (no KV travels in the backward) on 4 gloo ranks of 2 nodes, p2p,
    node relays and reduces, the ring and an all-to-all; bit for bit the
    in-process executor, with order-only matching."""
    res = ok(run_local(f"{CASES}:equals_in_process", 4,
                       ([1, 3], ["per_doc", "hypergraph", "span:ring", "zigzag:relay", "ulysses:a2a"], "order",
                        {"keep_kv": True, "nodes": 2}), timeout=240))
    assert all(r["ran"] == 10 for r in res)
    assert [b for r in res for b in r["bad"]] == []


@pytest.mark.parametrize("world", [2, 3])
def test_a2a_runs_as_all_to_all_collectives(world):
    """``comm{mode=a2a}``: every rank runs each phase's data and partials as
    one ``all_to_all_single`` each (4 per attention call, forward and
    backward, whatever the rank exchanges), and out/dq/dk/dv equal the
    in-process executor bit for bit (Ulysses' all-to-all, and minheap's
    blocks moved the same way)."""
    pipes = ["tile{block={block}},ulysses,comm{mode=a2a},overlap,emit", "tile{block={block}},minheap,comm{mode=a2a},emit"]
    res = ok(run_local(f"{CASES}:equals_in_process", world, ([0, 1, 3], pipes, "tag", {"heads": 6, "kv_heads": 6}), timeout=240))
    assert all(r["ran"] == 6 for r in res)
    assert all(r["a2a_calls"] == [4] * 6 for r in res), [r["a2a_calls"] for r in res]
    assert [b for r in res for b in r["bad"]] == []


def test_match_mode_is_validated():
    """A bad mode is one typed error (the verifier's posting-order check is
    tested in tests/test_verify.py)."""
    from attnplan.runtime.dist import resolve_match
    assert resolve_match("order") == "order"
    with pytest.raises(attnplan.PlanError, match="match must be one of tag, order"):
        resolve_match("fifo")


def test_training_step_through_dispatch_and_undispatch():
    """Two chained attention calls, undispatch, a loss on the replicated result:
    loss, outputs and the summed parameter gradient equal one process's."""
    res = ok(run_local(f"{CASES}:autograd_training_step", 2, timeout=120))
    for r in res:
        assert r["pos_ok"]
        assert r["y"] < 1e-6 and r["loss"] < 1e-3 and r["gw"] < 1e-5, r


def test_faults_give_typed_errors_naming_peer_and_message():
    res = run_local(f"{CASES}:faults", 3, timeout=120)
    assert res[1] == ("exit", 0) and res[2] == ("exit", 0), res  # ranks 1 and 2 left on purpose
    assert res[0][0] == "ok", res[0]
    seen = res[0][1]
    kind, msg, _ = seen["world"]  # a plan for 2 devices on 3 ranks
    assert kind == "PlanError" and "compiled for 2 devices" in msg and "3 ranks" in msg, msg
    for name, what in (("tokens", "tokens="), ("heads", "heads=4"), ("dtype", "share a dtype"),
                       ("int", "expected float32")):
        assert seen[name][0] == "ShapeError" and what in seen[name][1], (name, seen[name])
    kind, msg, _ = seen["plans"]
    assert kind == "PlanError" and "different plans" in msg, msg
    assert "device(s) 0, 2 hold plan" in msg and "device(s) 1 hold plan" in msg, msg
    assert seen["healthy A"] > 0 and seen["healthy B"] > 0
    kind, msg, dt = seen["dead"]  # rank 2 (device 1 of group B) exited: named at once
    assert kind == "TransportError" and "peer device 1 (rank 2) died" in msg and "message m" in msg, msg
    assert dt < 10
    kind, msg, dt = seen["stalled"]  # rank 1 is asleep: a message times out, naming peer and message
    assert kind == "TransportError" and "peer device 1 (rank 1) did not" in msg and "within 1 s" in msg, msg
    assert "message m" in msg and " fwd " in msg and ("d1->d0" in msg or "d0->d1" in msg), msg
    assert dt < 2.5
    kind, msg, dt = seen["absent"]  # rank 1 never joins a new plan's handshake
    assert kind == "TransportError" and "handshake" in msg and "Ranks 1 failed" in msg and dt < 2.5, msg


# ---------------------------------------------------------------- plan run --procs

def test_launcher_reports_the_root_cause():
    from attnplan.tools.launch import _root_cause
    dead = ("device 0 (rank 0): message m3 fwd d1->d0 (2 blocks: KV[tb1,hg0], ...): peer device 1 (rank 1) died or "
            "closed its connection")
    shape = "device 1: q must have shape [tokens=5, heads=2, head_dim=8], got [4, 2, 8]"
    assert _root_cause([(0, 2, dead, ""), (1, 2, shape, "")]) == shape
    assert _root_cause([(0, 2, dead, ""), (1, -9, "", "")]) == "rank 1 was killed by signal 9"
    assert _root_cause([(0, 2, dead, ""), (1, 0, "", "")]) == dead
    assert _root_cause([(0, 1, "Traceback: boom", ""), (1, 0, "", "")]) == "rank 0 failed: Traceback: boom"


@pytest.fixture(scope="module")
def plan2(tmp_path_factory):
    path = tmp_path_factory.mktemp("dist") / "two.plan"
    attnplan.compile(seqlens=[120, 33, 200], mask="shared_question(2, 0.25)", devices=2, heads=4, kv_heads=2,
                     head_dim=16, block_size=32).save(path)
    return path


def test_plan_run_procs_check_passes(capsys, plan2):
    code = main(["run", str(plan2), "--procs", "2", "--check", "--timeout", "60"])
    out, err = capsys.readouterr()
    assert code == 0, (out, err)
    assert "PASS: 2 devices on 2 processes (gloo), 353 tokens, float32" in out
    assert out.count("max abs error") == 4


@pytest.mark.parametrize("argv,msg", [
    (["--procs", "3"], "compiled for 2 devices; --procs must be 2, got 3"),
    (["--procs", "2", "--timeout", "0"], "--timeout must be positive"),
])
def test_plan_run_procs_errors(capsys, plan2, argv, msg):
    code = main(["run", str(plan2), *argv])
    out, err = capsys.readouterr()
    assert code == 2 and err.startswith("plan: error: ") and msg in err and err.count("\n") == 1, err


def test_rank_mode_world_size_mismatch(capsys, plan2, monkeypatch):
    """Under torchrun (RANK/WORLD_SIZE set) a plan for another world size fails before any communication."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    code = main(["run", str(plan2), "--check"])
    out, err = capsys.readouterr()
    assert code == 2 and "compiled for 2 devices but WORLD_SIZE is 3" in err and err.count("\n") == 1
