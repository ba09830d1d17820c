"""``overlap{local=...}``: where the backward runs a device's blocks that need
nothing remote. ``last`` puts them after every block that writes a partial
output (the partials travel home while the device computes its own);
``kept`` (the default) does so where the backward keeps the forward's KV.
The order is the program's, the forward keeps its own first, plans equal
dense attention and survive their file."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

import attnplan
from attnplan.backends.cost import get_profile, simulate
from attnplan.errors import PlanError, PlanFileError, VerifyError
from attnplan.ir.verify import verify
from attnplan.ir.program import ATTN, ATTN_BWD, BWD, FWD, OP
from attnplan.tools.compare import compare
from attnplan.runtime.check import TOLERANCE, random_inputs, reference

SHAPE = dict(heads=4, kv_heads=2, head_dim=16, block_size=128)
LENS = [1500, 1400, 1300, 200, 90]


def compile_(local: str | None, keep_kv: bool = False, strategy: str = "span", comm: str = "mode=p2p,relay=node"):
    overlap = "overlap" if local is None else f"overlap{{local={local}}}"
    return attnplan.compile(seqlens=LENS, mask="causal", devices=8, nodes=2, keep_kv=keep_kv,
                            pipeline=f"tile{{block=128}},{strategy},comm{{{comm}}},{overlap},emit", **SHAPE)


def own_and_remote(plan, phase: int, dev: int) -> tuple[list[int], list[int]]:
    """Program positions of device ``dev``'s compute blocks that need nothing remote, and of the others."""
    g, pl = plan.ir.graph, plan.ir.placement
    code = plan.ir.program.code[phase][dev]
    at = np.flatnonzero(np.isin(code[:, OP], (ATTN, ATTN_BWD)))
    cb = code[at, 1]
    own = (pl.home[g.cb_q[cb]] == dev) & (pl.home[g.cb_k[cb]] == dev)
    return at[own].tolist(), at[~own].tolist()


@pytest.mark.parametrize("strategy,comm", [("span", "mode=p2p,relay=node"), ("per_doc", "mode=p2p,relay=tree"),
                                           ("minheap", "mode=p2p,relay=node,reduce=node")])
def test_the_backward_runs_its_own_blocks_last_the_forward_first(strategy, comm):
    plan = compile_("last", strategy=strategy, comm=comm)
    mixed = 0
    for dev in range(plan.ir.devices):
        own, remote = own_and_remote(plan, BWD, dev)
        if own and remote:
            mixed += 1
            assert max(remote) < min(own), f"device {dev}: an own block before a remote one in the backward"
        own_f, remote_f = own_and_remote(plan, FWD, dev)
        if own_f and remote_f:
            assert max(own_f) < min(remote_f), f"device {dev}: the forward's own blocks are not first"
    assert mixed > 0  # the case has devices with both kinds
    first = compile_("first", strategy=strategy, comm=comm)
    assert any(own_and_remote(first, BWD, d)[0] and own_and_remote(first, BWD, d)[1]
               and max(own_and_remote(first, BWD, d)[0]) < min(own_and_remote(first, BWD, d)[1])
               for d in range(first.ir.devices))
    assert np.array_equal(plan.ir.placement.cb_device, first.ir.placement.cb_device)


def test_the_default_puts_them_last_only_where_the_kv_is_kept():
    assert not compile_(None).ir.schedule.local_last
    assert compile_(None, keep_kv=True).ir.schedule.local_last
    assert not compile_("first", keep_kv=True).ir.schedule.local_last
    assert compile_("last").ir.schedule.local_last
    assert compile_(None).ir.schedule.cb_stage.tolist() == compile_("last").ir.schedule.cb_stage.tolist()


def test_spec_and_errors():
    assert compile_("last").meta["pipeline"].split(",")[-2] == "overlap{local=last}"
    assert compile_(None).meta["pipeline"].split(",")[-2] == "overlap"
    with pytest.raises(PlanError, match="overlap: local must be first, last or kept, got 'middle'"):
        compile_("middle")


ENTRY_KW = dict(seqlens=LENS, devices=8, nodes=2, **SHAPE)


@pytest.mark.parametrize("entry, pipeline, text", [
    ("span:relay overlap{local=last}", "span,comm{mode=p2p,relay=node},overlap{local=last}", None),
    ("span{grain=1}   overlap{local=first}", "span{grain=1},comm{mode=p2p,relay=node,reduce=node},overlap{local=first}",
     "span{grain=1} overlap{local=first}"),
    ("zigzag overlap{local=kept}", "zigzag,comm{mode=ring},overlap", "zigzag"),
    (" dacp:direct\toverlap{ local = last }\n", "dacp,comm{mode=p2p,relay=none},overlap{local=last}",
     "dacp:direct overlap{local=last}"),
])
def test_a_strategy_entry_names_its_order(entry, pipeline, text, tmp_path):
    """``NAME overlap{local=...}`` (what auto records for a plan in the other order) is a strategy entry:
    compile, compare and bench take it; it is its default pipeline with that order, and the plan records
    the entry's canonical text (stripped, one space, no ``local=kept``), which its file keeps."""
    named = attnplan.compile(strategy=entry, **ENTRY_KW)
    piped = attnplan.compile(pipeline=f"tile{{block=128}},{pipeline},emit", **ENTRY_KW)
    assert named.ir.program == piped.ir.program and named.meta["pipeline"] == piped.meta["pipeline"]
    assert named.meta["strategy"] == (text or entry)
    named.save(tmp_path / "x.plan")
    back = attnplan.load(tmp_path / "x.plan")
    assert back.meta["strategy"] == named.meta["strategy"] and back.ir.program == named.ir.program
    rows, _ = compare([entry], **ENTRY_KW)
    assert rows[0]["predicted_s"] == named.stats()["predicted_s"]
    with pytest.raises(PlanError, match="compare takes strategy entries"):
        compare([entry], pipeline=pipeline, **ENTRY_KW)


@pytest.mark.parametrize("entry, message", [
    ("span overlap{local=middle}", "local must be first, last or kept, got 'middle'"),
    ("span overlap{run=0}", "only ' overlap{local=...}'"),
    ("span:tree overlap{local=last} emit", "only ' overlap{local=...}'"),
    ("span overlap", "only ' overlap{local=...}'"),
    ("auto overlap{local=last}", "auto takes no options, variant or order"),
    ("auto:span:tree overlap{local=last}", "(drop the 'auto:' prefix: 'span:tree overlap{local=last}' is what auto"),
    ("span overlap{local=LAST}", "local must be first, last or kept, got 'LAST'"),
    ("span" + " " * 20000 + "x", "strategy entry of 20,005 characters (at most 1000)"),
])
def test_a_bad_order_in_an_entry_is_refused(entry, message):
    with pytest.raises(PlanError, match=re.escape(message)):
        attnplan.compile(strategy=entry, **ENTRY_KW)


def test_the_plan_file_keeps_it(tmp_path):
    plan = compile_("last")
    path = tmp_path / "x.plan"
    plan.save(path)
    back = attnplan.load(path)
    assert back.ir.schedule.local_last
    assert back.ir.program == plan.ir.program
    h100 = get_profile("h100")
    assert simulate(back.ir, h100)["predicted_s"] == simulate(plan.ir, h100)["predicted_s"]


def test_the_verifier_holds_the_flag_to_the_program():
    """The flag and the program agree: a program emitted with own blocks first under a schedule that says
    ``local_last`` (or the other way round), or one whose blocks run out of stage order, does not verify."""
    first, last = compile_("first"), compile_("last")
    for plan, flag in ((first, True), (last, False)):
        lied = plan.ir.replace(schedule=dataclasses.replace(plan.ir.schedule, local_last=flag))
        with pytest.raises(VerifyError, match=r"invariant 3: d\d+ runs c\d+ .* in its bwd program; its schedule's order"):
            verify(lied)
    code = [c.copy() for c in first.ir.program.code[FWD]]
    dev = next(d for d in range(first.ir.devices) if all(own_and_remote(first, FWD, d)))
    own, remote = own_and_remote(first, FWD, dev)
    rows = np.arange(len(code[dev]))
    code[dev] = code[dev][np.insert(np.delete(rows, own[0]), remote[-1], own[0])]  # an own block after the remote
    swapped = dataclasses.replace(first.ir.program, code=(tuple(code), first.ir.program.code[BWD]))
    with pytest.raises(VerifyError, match=f"invariant 3: d{dev} runs .* in its fwd program"):
        verify(first.ir.replace(program=swapped))


def test_a_plan_file_whose_flag_disagrees_does_not_load():
    from attnplan.backends.planfile import pack_body

    from .test_planfile import _body
    body = _body(compile_("first").to_bytes())
    body["schedule"]["local_last"] = True
    with pytest.raises(PlanFileError, match="plan does not verify: invariant 3: .*schedule.local_last"):
        attnplan.Plan.from_bytes(pack_body(body), "t.plan")


@pytest.mark.parametrize("keep_kv", [False, True])
def test_it_equals_dense_attention(keep_kv):
    plan = compile_("last", keep_kv=keep_kv, strategy="minheap", comm="mode=p2p,relay=node,reduce=node")
    p = plan.problem
    q, k, v, dout = random_inputs(plan, "float32", 3)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = attnplan.execute(plan, qg, kg, vg)
    grads = torch.autograd.grad(out, (qg, kg, vg), dout)
    ref_out, ref_grads = reference(p, q, k, v, dout, 1.0 / p.head_dim ** 0.5)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
        err = float((got.detach().double() - want).abs().max()) / max(1.0, float(want.abs().max()))
        assert err <= TOLERANCE["float32"][name], name
