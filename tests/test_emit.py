"""The emit pass (passes/emit.py): lowering works on the IR alone, from a
fresh registry; a schedule it cannot lower is a typed VerifyError naming the
device and block or transfer (never an assert or a KeyError)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import attnplan
from attnplan.ir.program import (B_DQ, B_O, BWD, FWD, M_DST, M_END, M_PHASE, M_SRC, M_START, RECV, SEND, T_DST,
                                 T_PHASE, T_SRC, WAIT)
from attnplan.passes import BUILTIN, parse_pipeline, run_pipeline
from attnplan.passes.emit import Emit, emit

KW = dict(seqlens=[70, 33, 9], mask="causal", devices=3, heads=4, kv_heads=2, head_dim=8)


def scheduled(pipeline: str = "tile{block=16},zigzag,comm{mode=p2p},divide{stages=2},overlap"):
    """A verified IR up to its schedule (no program yet)."""
    plan = attnplan.compile(**KW, pipeline=pipeline + ",emit")
    return plan.ir.with_levels(schedule=plan.ir.schedule)


def test_emit_is_a_builtin_pass_and_equals_the_pipelines_program():
    assert BUILTIN["emit"] is Emit and [p.name for p in parse_pipeline("emit")] == ["emit"]
    ir = scheduled()
    plan = attnplan.compile(**KW, pipeline="tile{block=16},zigzag,comm{mode=p2p},divide{stages=2},overlap,emit")
    got = emit(ir)
    for phase in (FWD, BWD):
        for d in range(ir.devices):
            assert np.array_equal(got.code[phase][d], plan.ir.program.code[phase][d])
            assert np.array_equal(got.buffers[phase][d], plan.ir.program.buffers[phase][d])


@pytest.mark.parametrize("pipeline", ["tile{block=16},zigzag,comm{mode=ring},overlap",
                                      "tile{block=8},minheap,comm{mode=p2p},divide{stages=3}"])
def test_every_message_is_posted_and_waited_once_on_each_side(pipeline):
    prog = emit(scheduled(pipeline))
    M = prog.messages
    for phase in (FWD, BWD):
        m = M[M[:, M_PHASE] == phase]
        for op, col in ((RECV, M_DST), (SEND, M_SRC)):
            posted = np.concatenate([c[c[:, 0] == op, 1] for c in prog.code[phase]])
            assert sorted(posted.tolist()) == sorted(m[:, 0].tolist())
            for d in range(prog.devices):  # posted on the right device
                c = prog.code[phase][d]
                assert set(c[c[:, 0] == op, 1].tolist()) == set(m[m[:, col] == d, 0].tolist())
        waits = [c[c[:, 0] == WAIT, 1] for c in prog.code[phase]]
        for d, w in enumerate(waits):  # each device waits each of its messages exactly once
            mine = m[(m[:, M_SRC] == d) | (m[:, M_DST] == d), 0]
            assert sorted(w.tolist()) == sorted(mine.tolist())


@pytest.mark.parametrize("pipeline", ["tile{block=16},zigzag,comm{mode=ring},overlap",
                                      "tile{block=8},minheap,comm{mode=p2p},divide{stages=3},overlap",
                                      "tile{block=8},tile_pool,comm{mode=p2p}"])
def test_messages_coalesce_the_transfers_of_a_link_and_stage(pipeline):
    """Every transfer is in exactly one message (a CSR range of the table) of
    its phase and link; a link carries at most one data and one partial
    message per stage (ring: one message per hop of the ring, n·(n−1) a
    phase, whatever the number of blocks)."""
    ir = scheduled(pipeline)
    prog = emit(ir)
    M, X = prog.messages, prog.transfers
    assert M[0, M_START] == 0 and M[-1, M_END] == len(X) and (M[1:, M_START] == M[:-1, M_END]).all()
    owner = np.repeat(np.arange(len(M)), M[:, M_END] - M[:, M_START])
    for tcol, mcol in ((T_PHASE, M_PHASE), (T_SRC, M_SRC), (T_DST, M_DST)):
        assert (X[:, tcol] == M[owner, mcol]).all()
    link = (M[:, M_PHASE] * ir.devices + M[:, M_SRC]) * ir.devices + M[:, M_DST]
    per_link = np.bincount(link)
    assert per_link.max() <= 2 * ir.schedule.stages
    assert len(M) < len(X)  # blocks share messages
    if "ring" in pipeline:  # one message per hop and link: d -> d+1 in stages 1..n-1, and nothing else
        n = ir.devices
        fwd = M[M[:, M_PHASE] == FWD]
        assert ((fwd[:, M_DST] - fwd[:, M_SRC]) % n == 1).all() and len(fwd) == n * (n - 1)


def test_a_block_in_a_stage_that_does_not_exist_is_a_verify_error():
    ir = scheduled()
    s = ir.schedule
    stage = s.cb_stage.copy()
    cb = int(np.flatnonzero(ir.placement.cb_device == 1)[0])
    stage[cb] = s.stages
    bad = ir.with_levels(schedule=dataclasses.replace(s, cb_stage=stage))
    with pytest.raises(attnplan.VerifyError, match=rf"emit: device 1: compute block c{cb} is in stage {s.stages}, "
                                                   rf"outside 0\.\.{s.stages - 1}"):
        Emit().apply(bad)


def test_a_partial_without_a_transfer_home_is_a_verify_error():
    ir = scheduled("tile{block=16},tile_pool,comm{mode=p2p}")  # tile_pool splits queries: partial outputs
    x = ir.schedule.xfer
    partial = np.flatnonzero(x[:, 0] == 2)  # X_O: partial outputs going home
    assert len(partial), "the case must send partials"
    bad = ir.with_levels(schedule=dataclasses.replace(ir.schedule, xfer=np.delete(x, partial[0], axis=0)))
    with pytest.raises(attnplan.VerifyError, match=r"emit: device \d fwd: partial O\[tb\d+,hg\d\] is written there "
                                                   r"but no transfer takes it home"):
        Emit().apply(bad)


def test_a_pipeline_without_the_verifier_still_gets_typed_errors():
    ir = scheduled()
    placement = ir.placement
    dev = placement.cb_device.copy()
    dev[0] = ir.devices + 5
    bad = ir.with_levels(placement=dataclasses.replace(placement, cb_device=dev))
    with pytest.raises(attnplan.VerifyError, match=rf"emit: compute block 0 has computing device {ir.devices + 5}"):
        run_pipeline(bad, parse_pipeline("comm,emit"), verify_each=False)


def test_program_kinds_follow_the_phase():
    prog = emit(scheduled())
    fwd_kinds = set(np.concatenate([b[:, 0] for b in prog.buffers[FWD]]).tolist())
    bwd_kinds = set(np.concatenate([b[:, 0] for b in prog.buffers[BWD]]).tolist())
    assert B_O in fwd_kinds and B_DQ not in fwd_kinds and B_DQ in bwd_kinds and B_O not in bwd_kinds


@pytest.mark.parametrize("wide", [False, True])
def test_event_sort_equals_lexsort(wide):
    """Events are ordered by packing their columns into int64 keys; columns
    too wide to pack together fall back to a lexsort of several keys."""
    from attnplan.passes.emit import _sort_rows
    rng = np.random.default_rng(7)
    cols = rng.integers(0, 4, (3000, 6))
    if wide:
        cols[:, 2] = rng.integers(0, 1 << 40, 3000)
        cols[:, 4] = rng.integers(0, 1 << 40, 3000)
    assert np.array_equal(_sort_rows(cols), np.lexsort(cols.T[::-1]))


@pytest.mark.parametrize("strategy", ["minheap", "hypergraph", "tile_pool", "span{grain=1}"])
def test_remote_blocks_run_by_partner_in_shifted_order(strategy):
    """compute_order: per device and stage, the blocks needing nothing remote first, then the others by the
    home of their remote KV (else Q) at (home - device) mod devices; both phases' programs follow it."""
    from attnplan.ir.program import ATTN, ATTN_BWD
    from attnplan.passes.emit import compute_order
    plan = attnplan.compile(seqlens=[700, 300, 260, 90, 40], devices=6, nodes=2, heads=4, kv_heads=2, head_dim=8,
                            block_size=64, strategy=strategy)
    ir = plan.ir
    g, pl, s, n = ir.graph, ir.placement, ir.schedule, ir.devices
    order = compute_order(g, pl, s)
    dev, cq, ck = pl.cb_device[order], g.cb_q[order], g.cb_k[order]
    away = (pl.home[ck] != dev) | (pl.home[cq] != dev)
    partner = np.where(pl.home[ck] != dev, pl.home[ck], pl.home[cq])
    shift = np.where(away, (partner - dev) % n, -1)
    key = np.stack([dev, s.cb_stage[order], shift], 1)
    assert (np.diff(key[:, 0]) >= 0).all()
    same = key[1:, 0] == key[:-1, 0]
    assert (np.diff(key[:, 1])[same] >= 0).all()
    same &= key[1:, 1] == key[:-1, 1]
    assert (np.diff(key[:, 2])[same] >= 0).all() and away.any()
    for phase, op in ((FWD, ATTN), (BWD, ATTN_BWD)):  # the program runs its blocks in that order
        for d in range(n):
            code = ir.program.code[phase][d]
            assert code[code[:, 0] == op, 1].tolist() == order[dev == d].tolist()
