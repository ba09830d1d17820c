"""Mutation tests: break one thing in a verified plan; the verifier must name it."""

import dataclasses

import numpy as np
import pytest

import attnplan
from attnplan.errors import VerifyError
from attnplan.ir.mask import Pieces
from attnplan.ir.program import (ADD, ATTN, BWD, FWD, M_END, M_START, RECV, RECVD, SEND, T_PHASE, T_RBUF, T_SBUF, T_SRC,
                                 WAIT, Program)
from attnplan.ir.verify import verify


@pytest.fixture(scope="module")
def plan():
    return attnplan.compile(seqlens=[37, 11, 64, 5], mask="causal", devices=4, heads=4, kv_heads=2, head_dim=8,
                            pipeline="tile{block=8},zigzag,comm{mode=p2p},overlap,emit")


@pytest.fixture(scope="module")
def ring():
    return attnplan.compile(seqlens=[37, 11, 64, 5], mask="causal", devices=4, heads=4, kv_heads=2, head_dim=8,
                            pipeline="tile{block=8},zigzag,comm{mode=ring},overlap,emit")


def with_code(ir, phase, device, rows):
    code = [list(ph) for ph in ir.program.code]
    code[phase][device] = np.asarray(rows, np.int64).reshape(-1, 6)
    prog = Program(ir.program.devices, ir.program.transfers, ir.program.buffers, tuple(map(tuple, code)),
                   ir.program.messages)
    return ir.replace(program=prog)


def with_transfers(ir, transfers):
    p = ir.program
    return ir.replace(program=Program(p.devices, transfers, p.buffers, p.code, p.messages))


def rows_of(ir, phase, device):
    return ir.program.code[phase][device].tolist()


def device_with(ir, phase, op):
    for d in range(ir.devices):
        if any(r[0] == op for r in rows_of(ir, phase, d)):
            return d
    raise AssertionError("no device has that op")


def test_plan_verifies(plan):
    verify(plan.ir)  # must not raise


def test_drop_compute_block(plan):
    g = plan.ir.graph
    g2 = dataclasses.replace(g, cb_tile=g.cb_tile[1:].copy(), cb_hg=g.cb_hg[1:].copy())
    with pytest.raises(VerifyError, match=r"invariant 2: compute block \(tile 0.*is missing"):
        verify(plan.ir.replace(graph=g2, placement=None, schedule=None, program=None))


def test_duplicate_compute_block(plan):
    g = plan.ir.graph
    g2 = dataclasses.replace(g, cb_tile=np.append(g.cb_tile, g.cb_tile[3]), cb_hg=np.append(g.cb_hg, g.cb_hg[3]))
    with pytest.raises(VerifyError, match=r"invariant 2: compute block .* appears 2 times"):
        verify(plan.ir.replace(graph=g2, placement=None, schedule=None, program=None))


def test_drop_attn_instruction(plan):
    ir = plan.ir
    d = device_with(ir, FWD, ATTN)
    rows = rows_of(ir, FWD, d)
    i = next(i for i, r in enumerate(rows) if r[0] == ATTN)
    cb = rows[i][1]
    with pytest.raises(VerifyError, match=rf"compute block c{cb} .* never runs in fwd"):
        verify(with_code(ir, FWD, d, rows[:i] + rows[i + 1:]))


def test_drop_send(plan):
    ir = plan.ir
    d = device_with(ir, FWD, SEND)
    rows = rows_of(ir, FWD, d)
    i = next(i for i, r in enumerate(rows) if r[0] == SEND)
    msg = rows[i][1]
    with pytest.raises(VerifyError, match=rf"m{msg} .*is received but never sent"):
        verify(with_code(ir, FWD, d, rows[:i] + rows[i + 1:]))


def wait_before_recv(ir):
    """(device, message, ir) where the device's first receive now comes after its wait."""
    d = device_with(ir, FWD, RECV)
    rows = rows_of(ir, FWD, d)
    r = next(i for i, x in enumerate(rows) if x[0] == RECV)
    tag = rows[r][1]
    w = next(i for i, x in enumerate(rows) if x[0] == WAIT and x[1] == tag)
    rows.insert(r, rows.pop(w))  # the wait now comes before the receive is launched
    return d, tag, with_code(ir, FWD, d, rows)


def test_wait_before_its_receive_is_posted(plan):
    d, tag, bad = wait_before_recv(plan.ir)
    with pytest.raises(VerifyError, match=rf"invariant 5: deadlock in fwd: device {d} waits on m{tag} .*recv not posted"):
        verify(bad)


def test_read_before_receive_completes(plan):
    ir = plan.ir
    d = device_with(ir, FWD, RECV)
    rows = rows_of(ir, FWD, d)
    tag = next(x[1] for x in rows if x[0] == RECV)
    w = next(i for i, x in enumerate(rows) if x[0] == WAIT and x[1] == tag)
    wait = rows.pop(w)
    rows.append(wait)  # compute blocks now read the buffer before the wait
    with pytest.raises(VerifyError, match=r"invariant 3: .* is read before its receive completed"):
        verify(with_code(ir, FWD, d, rows))


def test_merge_twice(plan):
    # zigzag computes where Q lives: its partials are the backward dKV blocks
    ir = plan.ir
    d = device_with(ir, BWD, ADD)
    rows = rows_of(ir, BWD, d)
    i = next(i for i, r in enumerate(rows) if r[0] == ADD)
    with pytest.raises(VerifyError, match=r"invariant 4: .*merges partial %\d+ twice"):
        verify(with_code(ir, BWD, d, rows[:i + 1] + [rows[i]] + rows[i + 1:]))


def test_partial_never_sent_home(plan):
    ir = plan.ir
    M, X = ir.program.messages, ir.program.transfers
    for d in range(ir.devices):
        rows = rows_of(ir, BWD, d)
        sends = [i for i, r in enumerate(rows) if r[0] == SEND]
        bufs = ir.program.buffers[BWD][d]
        part = [i for i in sends if any(bufs[b][3] == 2 for b in X[M[rows[i][1], M_START]:M[rows[i][1], M_END],
                                                                     T_SBUF])]
        if part:
            i = part[0]
            with pytest.raises(VerifyError, match=r"never sent|is received but never sent"):
                verify(with_code(ir, BWD, d, rows[:i] + rows[i + 1:]))
            return
    pytest.skip("no partial sends in this plan")


def test_partial_packed_from_another_buffer(plan):
    """A message that packs a home buffer in place of the partial it should carry."""
    ir = plan.ir
    X = ir.program.transfers.copy()
    bufs = ir.program.buffers[BWD]
    t = next(t for t, row in enumerate(X.tolist()) if row[T_PHASE] == BWD and bufs[row[T_SRC]][row[T_SBUF]][3] == 2)
    X[t, T_SBUF] = 0  # the device's first buffer: a home buffer of another block
    with pytest.raises(VerifyError, match=rf"invariant 5: device \d bwd: t{t} bwd .* names source buffer %0"):
        verify(with_transfers(ir, X))


def test_two_transfers_into_one_receive_buffer(ring):
    ir = ring.ir
    X = ir.program.transfers.copy()
    fwd = np.flatnonzero(X[:, T_PHASE] == FWD)
    a, b = fwd[0], fwd[1]  # the same message: same destination
    X[b, T_RBUF] = X[a, T_RBUF]
    with pytest.raises(VerifyError, match=r"invariant 5: .* names receive buffer|receives into %\d+ twice"):
        verify(with_transfers(ir, X))


def test_sends_and_receives_of_a_pair_in_another_order(ring):
    """Two messages between the same two devices whose sends are swapped: a
    transport that matches by posting order (NCCL) would mix them up."""
    ir = ring.ir
    for d in range(ir.devices):
        rows = rows_of(ir, FWD, d)
        sends = [i for i, r in enumerate(rows) if r[0] == SEND]
        pairs = [(i, j) for i in sends for j in sends if i < j and rows[i][2] == rows[j][2]]
        if pairs:
            i, j = pairs[0]
            rows[i], rows[j] = rows[j], rows[i]
            with pytest.raises(VerifyError, match=r"invariant 5: device \d fwd instruction \d+: sends m\d+ .* as its "
                                                  r"message #\d+ to d\d+, but d\d+ posts its receive as #\d+"):
                verify(with_code(ir, FWD, d, rows))
            return
    pytest.fail("the ring sends several messages to the next device")


def test_memory_cap():
    small = attnplan.compile(seqlens=[40, 24], mask="causal", devices=2, heads=2, kv_heads=1, head_dim=8,
                             block_size=8)
    need = max(int(b[:, 5].sum()) for ph in small.ir.program.buffers for b in ph)
    with pytest.raises(VerifyError, match=r"invariant 6: device \d needs \d+ bytes"):
        verify(small.ir.replace(memory_cap=need - 1))
    verify(small.ir.replace(memory_cap=need))
    with pytest.raises(attnplan.VerifyError, match="invariant 6"):
        attnplan.compile(seqlens=[40, 24], mask="causal", devices=2, heads=2, kv_heads=1, head_dim=8,
                         block_size=8, memory_cap=need - 1)


def test_overlapping_mask_pieces(plan):
    p = plan.ir.problem
    bad = Pieces(np.concatenate([p.pieces.a, p.pieces.a[:1]]))
    with pytest.raises(VerifyError, match=r"invariant 1: mask pieces \d+ .* overlap"):
        verify(plan.ir.replace(problem=dataclasses.replace(p, pieces=bad), graph=None, placement=None,
                               schedule=None, program=None))


def test_piece_outside_sample(plan):
    p = plan.ir.problem
    a = p.pieces.a.copy()
    a[0, 1] += 1  # first sample's piece now reaches into the second sample's rows
    with pytest.raises(VerifyError, match="invariant 1"):
        verify(plan.ir.replace(problem=dataclasses.replace(p, pieces=Pieces(a)), graph=None, placement=None,
                               schedule=None, program=None))


def test_compute_on_wrong_device(plan):
    pl = plan.ir.placement
    cbd = pl.cb_device.copy()
    cbd[0] = (cbd[0] + 1) % plan.devices
    bad = dataclasses.replace(pl, cb_device=cbd)
    with pytest.raises(VerifyError, match="invariant 3"):
        verify(plan.ir.replace(placement=bad))


def test_executor_reports_deadlock(plan):
    """An unverified program whose wait precedes its receive: the in-process
    runtime stops with DeadlockError naming the device and the transfer."""
    import torch

    from attnplan.runtime.executor import execute

    ir = plan.ir
    d, tag, bad = wait_before_recv(ir)
    p = ir.problem
    q = torch.randn(p.tokens, p.heads, p.head_dim)
    kv = torch.randn(p.tokens, p.kv_heads, p.head_dim)
    with pytest.raises(attnplan.DeadlockError, match=rf"device {d} waits on m{tag} fwd"):
        execute(bad, q, kv, kv)


def test_ring_forward_before_it_arrives(ring):
    """Ring traffic forwards received KV; forwarding before the wait on its
    arrival is caught."""
    ir = ring.ir
    verify(ir)
    d = 1
    rows = rows_of(ir, FWD, d)
    bufs = ir.program.buffers[FWD][d]
    M, X = ir.program.messages, ir.program.transfers

    def forwards(r):
        return any(bufs[b][3] == RECVD for b in X[M[r[1], M_START]:M[r[1], M_END], T_SBUF])
    i = next(i for i, r in enumerate(rows) if r[0] == SEND and forwards(r))  # a forwarding send
    j = i - 1
    assert rows[j][0] == WAIT
    rows.append(rows.pop(j))
    with pytest.raises(VerifyError, match=r"invariant 3: .*sends %\d+ before it holds data"):
        verify(with_code(ir, FWD, d, rows))


def test_ring_schedule_without_forwarding_source(ring):
    """A schedule whose hop starts at a device that never received the block."""
    from attnplan.ir.schedule import XK, X_KV, XSTAGE
    s = ring.ir.schedule
    x = s.xfer.copy()
    i = np.flatnonzero((x[:, XK] == X_KV) & (x[:, XSTAGE] == 2))[0]
    x[i, XSTAGE] = 1  # the hop now leaves before the block reached its source
    bad = dataclasses.replace(s, xfer=x)
    with pytest.raises(VerifyError, match=r"invariant 3: d\d+ forwards KV\[tb\d+,hg\d+\] in stage 1 without holding it"):
        verify(ring.ir.replace(schedule=bad, program=None))


def test_needed_transfers_are_remembered_read_only_and_per_placement():
    """``needed_transfers`` remembers the last placements (auto asks for each about ten times): the same
    rows again, read-only (a caller cannot change what the next one gets); another placement of the same
    graph gets its own rows, equal to a fresh computation after the remembered ones were pushed out."""
    from attnplan.ir import verify as V
    from attnplan.ir.placement import Placement
    plan = attnplan.compile(seqlens=[300, 200], devices=4, heads=4, kv_heads=2, head_dim=8, block_size=32,
                            strategy="minheap")
    g, pl = plan.ir.graph, plan.ir.placement
    first = V.needed_transfers(g, pl)
    again = V.needed_transfers(g, pl)
    assert all(np.array_equal(first[k], again[k]) and not again[k].flags.writeable for k in first)
    moved = Placement(pl.devices, pl.nodes, (pl.home + 1) % pl.devices, pl.cb_device.copy())
    other = V.needed_transfers(g, moved)
    assert any(not np.array_equal(other[k], first[k]) for k in first)
    for shift in range(2, 2 + V._NEEDED_KEEP + 1):  # push the first placement out of the memory
        V.needed_transfers(g, Placement(pl.devices, pl.nodes, (pl.home + shift) % pl.devices, pl.cb_device.copy()))
    fresh = V.needed_transfers(g, pl)
    assert all(np.array_equal(fresh[k], first[k]) for k in first)
