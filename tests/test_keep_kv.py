"""The backward computes with the KV each device received in the forward
(``keep_kv``): no KV block travels in the backward; each device's backward
names the forward receive buffers it keeps, the verifier proves each names
the right block, plan files round-trip, execution equals dense attention for
every strategy and schedule (``test_execute.py::
test_execute_equals_dense_with_kept_kv``, ``test_distributed.py::
test_kept_kv_runs_on_processes``), auto's bounds stay below the simulation,
the memory replay keeps the blocks alive across the phases, and bad values
are refused."""

from __future__ import annotations


import numpy as np
import pytest
import torch

import attnplan
from attnplan.backends.cost import simulate
from attnplan.backends.planfile import pack_body, to_body
from attnplan.cli import main
from attnplan.errors import VerifyError
from attnplan.ir.program import (B_KV, B_Q, BPEER, BROLE, BTB, BWD, FWD, KEPT, RECVD, T_BYTES, T_DST, T_HG, T_KIND,
                                 T_PHASE, T_SRC, T_TB, Program)
from attnplan.ir.verify import verify
from attnplan.runtime import memory
from attnplan.runtime.check import random_inputs, reference, run_plan
from attnplan.runtime.executor import run_backward, run_forward
from attnplan.passes.default import entry_pipeline
from attnplan.tools.auto import estimate
from attnplan.tools.auto_schedule import schedule_bound

SHAPE = dict(heads=8, kv_heads=2, head_dim=16, block_size=64)
LENS = [300, 700, 77, 500, 41]
STRATEGIES = ["per_doc", "dacp", "hypergraph", "minheap", "span{grain=1}:tree", "zigzag:ring", "ulysses:a2a",
              "usp", "tile_pool", "per_doc:relay"]


def _plan(strategy="per_doc", keep=True, devices=8, nodes=2, **kw):
    return attnplan.compile(LENS, devices=devices, nodes=nodes, strategy=strategy, keep_kv=keep, **dict(SHAPE, **kw))


def _received_kv(plan) -> set:
    """(device, tb, hg) of every KV block the forward brings to a device."""
    X = plan.ir.program.transfers
    f = X[(X[:, T_PHASE] == FWD) & (X[:, T_KIND] == B_KV)]
    return {tuple(r) for r in f[:, [T_DST, T_TB, T_HG]].tolist()}


def _kept(plan) -> set:
    out = set()
    for d, b in enumerate(plan.ir.program.buffers[BWD]):
        k = b[b[:, BROLE] == KEPT]
        out |= {(d, int(tb), int(hg)) for tb, hg in k[:, [BTB, 2]].tolist()}
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_backward_moves_no_kv(strategy):
    """The forward is the default plan's; the backward moves only Q bundles
    and partials, keeps every KV block its forward received that a block
    computes with, and the plan verifies and is faster by the KV it no longer
    moves (same placement: every strategy but hypergraph, whose cut weighs
    the bytes that travel)."""
    keep, plain = _plan(strategy), _plan(strategy, keep=False)
    verify(keep.ir)
    X, Y = keep.ir.program.transfers, plain.ir.program.transfers
    assert not ((X[:, T_PHASE] == BWD) & (X[:, T_KIND] == B_KV)).any()
    g, pl = keep.ir.graph, keep.ir.placement
    remote = pl.home[g.cb_k] != pl.cb_device
    want = set(zip(pl.cb_device[remote].tolist(), g.cb_k[remote].tolist(), g.cb_hg[remote].tolist()))
    assert _kept(keep) == want
    assert want <= _received_kv(keep)
    if strategy != "hypergraph":
        assert np.array_equal(X[X[:, T_PHASE] == FWD], Y[Y[:, T_PHASE] == FWD])
        cols = [T_SRC, T_DST, T_KIND, T_TB, T_HG, T_BYTES]  # the rest: the backward's KV rows left out
        assert np.array_equal(X[(X[:, T_PHASE] == BWD)][:, cols],
                              Y[(Y[:, T_PHASE] == BWD) & (Y[:, T_KIND] != B_KV)][:, cols])
        s, t = keep.stats(), plain.stats()
        moved = ((Y[:, T_PHASE] == BWD) & (Y[:, T_KIND] == B_KV)).any()
        assert (s["comm_bytes_total"] < t["comm_bytes_total"]) == bool(moved)
        assert s["predicted_s"] <= t["predicted_s"] * (1 + 1e-9)
    s = keep.stats()
    kept_bytes = [int(b[b[:, BROLE] == KEPT, 5].sum()) for b in keep.ir.program.buffers[BWD]]
    assert keep.ir.program.kept_bytes().tolist() == kept_bytes and s["per_device"]["kept_bytes"] == kept_bytes and s["kept_bytes_max"] == max(kept_bytes)
    assert (s["kept_bytes_max"] > 0) == bool(want) and plain.stats()["kept_bytes_max"] == 0
    text = attnplan.backends.stats.format_stats(s)
    assert s["keep_kv"] is True and "forward KV kept" in text and "KV kept fwd -> bwd" in text
    assert "KV kept" not in attnplan.backends.stats.format_stats(plain.stats())


def test_keep_kv_off_is_the_default_and_changes_nothing():
    a = attnplan.compile(LENS, devices=4, strategy="hypergraph", **SHAPE)
    b = attnplan.compile(LENS, devices=4, strategy="hypergraph", keep_kv=False, **SHAPE)
    assert a.problem.keep_kv is False and a.to_bytes() == b.to_bytes()
    assert "keep_kv" not in to_body(a.ir, a.meta)["problem"]
    assert not _kept(a)


def test_plan_file_round_trip_keeps_kept_buffers(tmp_path):
    plan = _plan("per_doc:tree")
    path = tmp_path / "p.plan"
    path.write_bytes(plan.to_bytes())
    back = attnplan.load(path)
    assert back.problem.keep_kv is True and back.to_bytes() == plan.to_bytes()
    assert Program.from_text(plan.ir.program.to_text()) == plan.ir.program
    assert "kept %" in plan.ir.program.to_text()


def _first(strategy: str) -> str:
    """``strategy``'s default pipeline with the backward's own blocks first
    (``overlap{local=first}``: the plain plan's order, which kept KV would
    otherwise change, :mod:`attnplan.passes.comm` ``Overlap``)."""
    return entry_pipeline(strategy + " overlap{local=first}", SHAPE["block_size"])


@pytest.mark.parametrize("strategy", ["per_doc", "zigzag:ring", "ulysses:a2a", "span{grain=1}:tree"])
def test_kept_plans_equal_the_plain_plan_bit_for_bit(strategy):
    """Same placement, same kernels in the same order: keeping the KV changes
    where the backward reads it from, not a single bit of the result. By
    default kept KV also runs the backward's own blocks last (another order
    of the same sums): equal within float32 rounding."""
    b = run_plan(_plan(strategy, keep=False, devices=4), "float32", 3)[:4]
    first = attnplan.compile(LENS, devices=4, nodes=2, pipeline=_first(strategy), keep_kv=True, **SHAPE)
    a = run_plan(first, "float32", 3)[:4]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    last = run_plan(_plan(strategy, devices=4), "float32", 3)[:4]
    assert torch.equal(last[0], b[0])  # the forward is the same program
    assert all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(last, b))


def test_the_backward_needs_the_forwards_kept_blocks():
    plan = _plan("per_doc", devices=4)
    p = plan.problem
    q, k, v, dout = random_inputs(plan, "float32", 1)
    kept: list = []
    out, lse = run_forward(plan.ir, q, k, v, 0.25, kept=kept)
    assert sum(len(x) for x in kept) == len(_kept(plan)) > 0
    dq, dk, dv = run_backward(plan.ir, q, k, v, out.to(q.dtype), lse, dout, 0.25, kept=kept)
    _, (rdq, rdk, rdv) = reference(p, q, k, v, dout, 0.25)
    assert max(float((x.double() - y).abs().max()) for x, y in ((dq, rdq), (dk, rdk), (dv, rdv))) < 1e-4
    with pytest.raises(attnplan.PlanError, match="keeps a KV block of the forward, which was not handed over"):
        run_backward(plan.ir, q, k, v, out.to(q.dtype), lse, dout, 0.25)


@pytest.mark.parametrize("strategy", ["per_doc", "zigzag", "hypergraph"])
def test_memory_replay_holds_kept_blocks_across_the_phases(monkeypatch, strategy):
    """The forward holds what its backward keeps to its end, the backward
    holds it from its start: the replay says so and the runners agree."""
    from attnplan.runtime import runner as runner_mod
    keep, plain = _plan(strategy, devices=4, dtype="float32"), _plan(strategy, keep=False, devices=4, dtype="float32")
    seen = []
    real = runner_mod.DeviceRunner.__init__

    def tracked(self, *a, **kw):
        real(self, *a, **kw)
        self.track_memory = True
        seen.append(self)
    monkeypatch.setattr(runner_mod.DeviceRunner, "__init__", tracked)
    run_plan(keep, "float32", 3)
    assert len(seen) == 2 * keep.ir.devices
    for r in seen:
        m = memory.stream_peak(keep.ir.program, r.phase, r.device)
        assert r.peak_bytes == m.peak - m.home
    kept_bytes = keep.ir.program.kept_bytes()
    for d in range(keep.ir.devices):
        m = memory.stream_peak(keep.ir.program, BWD, d)
        assert m.peak - m.home >= kept_bytes[d]
    assert sum(kept_bytes) > 0 and any(
        memory.stream_peak(keep.ir.program, FWD, d).peak >= memory.stream_peak(plain.ir.program, FWD, d).peak
        for d in range(keep.ir.devices))


@pytest.mark.parametrize("strategy", ["per_doc", "dacp", "hypergraph", "span{grain=1}", "minheap", "zigzag"])
def test_auto_bounds_stay_below_the_simulation(strategy):
    """auto's estimate and schedule bound leave the backward's KV out under
    keep_kv, so they stay lower bounds of the simulated time."""
    plan = _plan(strategy, devices=16, nodes=2)
    sim = simulate(plan.ir, plan.profile)
    fwd, bwd = schedule_bound(plan.ir, plan.profile)
    assert fwd <= sim["fwd"]["makespan_s"] * (1 + 1e-9) and bwd <= sim["bwd"]["makespan_s"] * (1 + 1e-9)
    assert estimate(plan.ir, plan.profile).total_s <= plan.stats()["predicted_s"] * (1 + 1e-9)


def test_auto_plans_with_kept_kv():
    plan = attnplan.compile(LENS, devices=16, nodes=2, strategy="auto", keep_kv=True, **SHAPE)
    assert plan.problem.keep_kv is True
    verify(plan.ir)


# ------------------------------------------------------------------ the verifier on crafted kept buffers

def _with_bwd_buffers(ir, device, fn):
    bufs = [list(ph) for ph in ir.program.buffers]
    b = bufs[BWD][device].copy()
    fn(b)
    bufs[BWD][device] = b
    p = ir.program
    return ir.replace(program=Program(p.devices, p.transfers, tuple(map(tuple, bufs)), p.code, p.messages))


def _kept_row(ir):
    for d, b in enumerate(ir.program.buffers[BWD]):
        rows = np.flatnonzero(b[:, BROLE] == KEPT)
        if len(rows) >= 2:
            return d, rows
    raise AssertionError("no device keeps two blocks")


@pytest.fixture(scope="module")
def kept_plan():
    return _plan("per_doc", devices=4)


def test_verifier_names_a_kept_buffer_pointing_at_the_wrong_block(kept_plan):
    ir = kept_plan.ir
    d, rows = _kept_row(ir)

    def swap(b):
        b[rows[0], BPEER], b[rows[1], BPEER] = b[rows[1], BPEER], b[rows[0], BPEER]
    with pytest.raises(VerifyError, match=r"kept buffer %\d+ \(KV\[tb\d+,hg\d+\]\) names forward buffer %\d+, which "
                                          r"is not a receive buffer of that block"):
        verify(ir.replace(program=_with_bwd_buffers(ir, d, swap).program))

    def home(b):
        b[rows[0], BPEER] = 0  # forward buffer 0: a home buffer
    with pytest.raises(VerifyError, match="not a receive buffer of that block"):
        verify(_with_bwd_buffers(ir, d, home))

    def past(b):
        b[rows[0], BPEER] = 10 ** 6
    with pytest.raises(VerifyError, match="not a receive buffer of that block"):
        verify(_with_bwd_buffers(ir, d, past))


def test_verifier_refuses_a_kept_buffer_in_the_wrong_place(kept_plan):
    ir = kept_plan.ir
    d, rows = _kept_row(ir)

    def as_q(b):
        b[rows[0], 0] = B_Q
    with pytest.raises(VerifyError, match="only the backward keeps, and only KV"):
        verify(_with_bwd_buffers(ir, d, as_q))

    def in_fwd(prog):
        bufs = [list(ph) for ph in prog.buffers]
        f = bufs[FWD][d].copy()
        i = int(np.flatnonzero(f[:, BROLE] == RECVD)[0])
        f[i, BROLE], f[i, BPEER] = KEPT, 0
        bufs[FWD][d] = f
        return Program(prog.devices, prog.transfers, tuple(map(tuple, bufs)), prog.code, prog.messages)
    with pytest.raises(VerifyError, match="only the backward keeps, and only KV"):
        verify(ir.replace(program=in_fwd(ir.program)))


def test_verifier_refuses_a_block_kept_twice(kept_plan):
    ir = kept_plan.ir
    d, rows = _kept_row(ir)
    p = ir.program
    bufs = [list(ph) for ph in p.buffers]
    bufs[BWD][d] = np.vstack([bufs[BWD][d], bufs[BWD][d][rows[0]]])  # a second, unused copy
    with pytest.raises(VerifyError, match=r"device \d+ bwd keeps KV\[tb\d+,hg\d+\] twice"):
        verify(ir.replace(program=Program(p.devices, p.transfers, tuple(map(tuple, bufs)), p.code, p.messages)))

    def twice(b):  # the block that read the other one now reads the wrong KV
        b[rows[1]] = b[rows[0]]
    with pytest.raises(VerifyError, match=r"is %\d+ \(KV\[tb\d+,hg\d+\], kept\), expected KV"):
        verify(_with_bwd_buffers(ir, d, twice))


# ------------------------------------------------------------------ bad values

@pytest.mark.parametrize("bad", ["yes", 1, None, 0.0])
def test_bad_keep_kv_is_a_plan_error(bad):
    with pytest.raises(attnplan.PlanError, match="keep_kv must be True or False"):
        attnplan.compile(LENS, devices=2, keep_kv=bad, **SHAPE)


def test_cli_keep_kv(tmp_path, capsys):
    out = tmp_path / "p.plan"
    assert main(["compile", "--seqlens", "300,700", "--devices", "4", "--nodes", "2", "--strategy", "per_doc",
                 "--keep-kv", "-o", str(out)]) == 0
    assert attnplan.load(out).problem.keep_kv is True
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # argparse: a flag takes no value
        main(["compile", "--seqlens", "300,700", "--devices", "4", "--keep-kv=yes", "-o", str(out)])
    assert e.value.code == 2 and "--keep-kv" in capsys.readouterr().err


def test_crafted_plan_file_with_a_bad_keep_kv_is_refused(tmp_path):
    plan = _plan("hypergraph", devices=4, nodes=1)
    for bad in ("true", 1, None):
        body = to_body(plan.ir, plan.meta)
        body["problem"]["keep_kv"] = bad
        path = tmp_path / "bad.plan"
        path.write_bytes(pack_body(body))
        with pytest.raises(attnplan.PlanFileError, match="problem.keep_kv must be a boolean"):
            attnplan.load(path)


def test_crafted_plan_file_that_keeps_nothing_but_says_it_does_is_refused(tmp_path):
    """keep_kv on a plan whose backward still moves KV: the runtime would
    hold nothing and the stats would say it keeps."""
    plan = _plan("per_doc", keep=False, devices=4)
    body = to_body(plan.ir, plan.meta)
    body["problem"]["keep_kv"] = True
    path = tmp_path / "bad.plan"
    path.write_bytes(pack_body(body))
    with pytest.raises((attnplan.PlanFileError, VerifyError), match="the backward moves KV blocks"):
        attnplan.load(path)


def test_crafted_plan_file_with_kept_rows_but_no_keep_kv_is_refused(tmp_path):
    """A plan file whose backward keeps blocks must say so: otherwise a
    runtime would run its backward without the forward's blocks."""
    plan = _plan("per_doc", devices=4)
    body = to_body(plan.ir, plan.meta)
    del body["problem"]["keep_kv"]
    path = tmp_path / "bad.plan"
    path.write_bytes(pack_body(body))
    with pytest.raises((attnplan.PlanFileError, VerifyError), match="keep"):
        attnplan.load(path)
