"""Partial outputs sent in the problem's dtype (``partials_dtype``): every
transfer and receive buffer of a partial carries its out / dq / dk / dv in
that dtype (the lse in float32), accumulators and homes stay float32, the
programs verify, plan files round-trip, execution equals dense attention
within the dtype's tolerance for every strategy and schedule
(``test_execute.py::test_execute_equals_dense_with_partials_in_bf16``), the simulator
and auto's bounds see the smaller messages, and bad values are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnplan
from attnplan.backends.planfile import to_body
from attnplan.cli import main
from attnplan.ir.program import (B_DKV, B_DQ, B_O, BWD, FWD, PHASE_KINDS, RECVD, T_BYTES, T_HG, T_KIND, T_TB,
                                 buffer_bytes)
from attnplan.ir.verify import verify
from attnplan.runtime.check import random_inputs
from attnplan.tools.auto import estimate
from attnplan.tools.auto_schedule import schedule_bound


SHAPE = dict(heads=8, kv_heads=2, head_dim=16, block_size=64)
LENS = [300, 700, 77, 500, 41]


def _plan(strategy="per_doc", partials="bfloat16", devices=8, nodes=2, **kw):
    return attnplan.compile(LENS, devices=devices, nodes=nodes, strategy=strategy, partials_dtype=partials,
                            **dict(SHAPE, **kw))


@pytest.mark.parametrize("strategy", ["per_doc", "minheap", "span{grain=1}:tree", "ulysses:a2a", "zigzag"])
def test_partials_travel_in_the_dtype_and_accumulate_in_fp32(strategy):
    """Per transfer: a partial's bytes are its rows x heads x (dim in bf16, lse
    in fp32), data unchanged; receive buffers hold what travels, home and own
    partial buffers stay fp32; the bf16 plan moves fewer bytes and verifies."""
    lo, hi = _plan(strategy), _plan(strategy, partials="float32")
    X, Y = lo.ir.program.transfers, hi.ir.program.transfers
    assert np.array_equal(X[:, :T_BYTES], Y[:, :T_BYTES])  # the same transfers, only their bytes differ
    g = lo.ir.graph
    part = X[:, T_KIND] >= B_O
    assert part.any()
    rows, d = g.tb_len[X[:, T_TB]], 16
    hkv = g.hg_end[X[:, T_HG]] - g.hg_start[X[:, T_HG]]
    hq = hkv * g.group
    want = np.select([X[:, T_KIND] == B_O, X[:, T_KIND] == B_DQ, X[:, T_KIND] == B_DKV],
                     [rows * hq * (2 * d + 4), rows * hq * d * 2, rows * 2 * hkv * d * 2], Y[:, T_BYTES])
    assert np.array_equal(X[:, T_BYTES], want)
    assert (X[part, T_BYTES] < Y[part, T_BYTES]).all()
    assert np.array_equal(X[~part, T_BYTES], Y[~part, T_BYTES])
    for phase in (0, 1):
        for B in lo.ir.program.buffers[phase]:
            kind, tb, hg, role, nbytes = B[:, 0], B[:, 1], B[:, 2], B[:, 3], B[:, 5]
            for k in np.unique(kind).tolist():
                for wire in (False, True):
                    sel = (kind == k) & ((role == RECVD) == wire)
                    assert np.array_equal(nbytes[sel], buffer_bytes(g, phase, k, tb[sel], hg[sel], wire=wire))
    verify(lo.ir)
    assert lo.stats()["comm_bytes_total"] < hi.stats()["comm_bytes_total"]
    assert lo.stats()["partials_dtype"] == "bfloat16"


def test_fp32_partials_are_the_default_and_change_nothing():
    """float32 partials are what a plan has always been: no field in the plan
    file, bytes equal to an explicit float32 plan's."""
    a = attnplan.compile(LENS, devices=4, strategy="hypergraph", **SHAPE)
    b = attnplan.compile(LENS, devices=4, strategy="hypergraph", partials_dtype="float32", **SHAPE)
    assert a.problem.partials_dtype == "float32"
    assert a.to_bytes() == b.to_bytes()
    assert "partials_dtype" not in to_body(a.ir, a.meta)["problem"]
    tb = np.arange(a.ir.graph.n_tb)
    hg = np.zeros_like(tb)
    for ph in (FWD, BWD):  # wire = storage when the wire is fp32
        for k in PHASE_KINDS[ph]:
            assert np.array_equal(buffer_bytes(a.ir.graph, ph, k, tb, hg, wire=True),
                                  buffer_bytes(a.ir.graph, ph, k, tb, hg))


def test_plan_file_round_trip_keeps_the_partials_dtype(tmp_path):
    plan = _plan("per_doc:tree")
    path = tmp_path / "p.plan"
    path.write_bytes(plan.to_bytes())
    back = attnplan.load(path)
    assert back.problem.partials_dtype == "bfloat16"
    assert back.to_bytes() == plan.to_bytes()


def test_bf16_partials_round_once_and_stay_close():
    """The cast happens (dK differs from the fp32-partial plan's somewhere:
    per_doc sends dK/dV partials) and the results stay within bf16 of each other."""
    res = {}
    for pd in ("float32", "bfloat16"):
        plan = _plan("per_doc", partials=pd, devices=4, nodes=2)
        q, k, v, dout = random_inputs(plan, "bfloat16", 7)
        qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
        out = attnplan.execute(plan, qg, kg, vg)
        res[pd] = [out.detach(), *torch.autograd.grad(out, (qg, kg, vg), dout)]
    dk32, dk16 = res["float32"][2].float(), res["bfloat16"][2].float()
    assert not torch.equal(dk32, dk16)
    assert float((dk32 - dk16).abs().max()) <= 2e-2 * max(1.0, float(dk32.abs().max()))


@pytest.mark.parametrize("strategy", ["per_doc", "dacp", "hypergraph", "span{grain=1}", "minheap"])
def test_auto_bounds_stay_below_the_simulation(strategy):
    """auto's estimate and schedule bound price partials as they travel, so
    they stay lower bounds of the simulated time, which falls with them."""
    lo, hi = _plan(strategy, devices=16, nodes=2), _plan(strategy, partials="float32", devices=16, nodes=2)
    pred = lo.stats()["predicted_s"]
    same = all(np.array_equal(getattr(lo.ir.placement, f), getattr(hi.ir.placement, f)) for f in ("home", "cb_device"))
    assert same == (strategy != "hypergraph")  # hypergraph weighs its cut by the bytes that travel
    if same:
        assert pred <= hi.stats()["predicted_s"]
    assert estimate(lo.ir, lo.profile).total_s <= pred * (1 + 1e-9)
    assert sum(schedule_bound(lo.ir, lo.profile)) <= pred * (1 + 1e-9)


def test_auto_plans_with_the_partials_dtype():
    plan = attnplan.compile(LENS, devices=16, nodes=2, strategy="auto", partials_dtype="bfloat16", **SHAPE)
    assert plan.problem.partials_dtype == "bfloat16"
    verify(plan.ir)


@pytest.mark.parametrize("kw,msg", [
    (dict(dtype="float32", partials_dtype="bfloat16"), "partials_dtype must be float32 or the dtype (float32)"),
    (dict(dtype="bfloat16", partials_dtype="float16"), "partials_dtype must be float32 or the dtype (bfloat16)"),
    (dict(partials_dtype="fp8"), "partials_dtype must be float32 or the dtype"),
    (dict(partials_dtype=2), "partials_dtype must be"),
])
def test_bad_partials_dtype_is_a_plan_error(kw, msg):
    with pytest.raises(attnplan.PlanError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        attnplan.compile(LENS, devices=2, **dict(SHAPE, **kw))


def test_cli_partials_dtype(tmp_path, capsys):
    out = tmp_path / "p.plan"
    assert main(["compile", "--seqlens", "300,700", "--devices", "4", "--nodes", "2", "--strategy", "per_doc",
                 "--partials-dtype", "bfloat16", "-o", str(out)]) == 0
    assert attnplan.load(out).problem.partials_dtype == "bfloat16"
    capsys.readouterr()
    assert main(["compile", "--seqlens", "300,700", "--devices", "4", "--dtype", "float32", "--partials-dtype",
                 "bfloat16", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "partials_dtype must be float32 or the dtype (float32)" in err[0]


def test_crafted_plan_file_with_a_bad_partials_dtype_is_refused(tmp_path):
    from attnplan.backends.planfile import pack_body
    plan = _plan("hypergraph", devices=4, nodes=1)
    for bad, msg in (("float16", "partials_dtype must be float32 or the problem's dtype"),
                     (3, "partials_dtype must be a string")):
        body = to_body(plan.ir, plan.meta)
        body["problem"]["partials_dtype"] = bad
        path = tmp_path / "bad.plan"
        path.write_bytes(pack_body(body))
        with pytest.raises(attnplan.PlanFileError, match=msg):
            attnplan.load(path)
