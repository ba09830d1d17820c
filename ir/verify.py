"""The verifier. ``verify(ir)`` checks every level the IR has so far:

1. Mask pieces are disjoint and inside their sample.
2. Every allowed (q, k, head) is computed exactly once: token blocks
   partition the token axis, head groups the kv heads, every tile piece lies
   inside its tile and inside the mask piece it came from, those pieces add up
   to every mask piece's pair count, and every (tile, head group) is one
   compute block, run exactly once by the program.
3. A compute block's Q and KV are on its device before it runs: owned, or
   received in a transfer whose wait came first. The schedule moves exactly
   the blocks a device needs, each once.
4. Every partial output is merged into its home exactly once (forward O;
   backward dQ and dKV), after its last write, and nothing writes a buffer
   while it is being sent.
5. Every send has one matching receive of the same size and kind, and a
   symbolic run of all programs (rendezvous semantics) finishes: no deadlock.
6. Per-device buffer memory stays under ``ir.memory_cap`` in each phase.

A failure raises :class:`VerifyError` naming the invariant, the block and the
device, with the IR around it.
"""

from __future__ import annotations

import numpy as np

from ..errors import DeadlockError, VerifyError
from .graph import BlockGraph
from .interp import cooperate, transfer_key
from .mask import HI, K0, K1, LO, Q0, Q1, _intersect_rows, _pairwise, normalize, piece_counts, tighten
from .module import PlanIR
from .placement import Placement
from .problem import Problem
from .program import (ADD, ATTN, ATTN_BWD, B_DKV, B_DQ, B_KV, B_O, B_Q, BHG, BK, BPEER, BROLE, BTB, BBYTES, BWD,
                      FWD, HOME, KINDS, MERGE, PART, PHASES, RECV, RECVD, SEND, T_BYTES, T_DST, T_HG, T_KIND,
                      T_PHASE, T_SRC, T_TAG, T_TB, WAIT, Program, format_instr)
from .schedule import X_KV, X_O, X_Q, XDST, XHG, XK, XSRC, XTB, Schedule


def _fail(inv: int, msg: str, context: str = "") -> None:
    raise VerifyError(f"invariant {inv}: {msg}" + (f"\n{context}" if context else ""))


def verify_problem(p: Problem) -> None:
    a = p.pieces.a
    off = p.offsets
    s = np.searchsorted(off, a[:, Q0], "right") - 1
    bad = np.flatnonzero((s < 0) | (s >= len(p.seqlens)) | (a[:, Q1] > off[np.clip(s + 1, 0, len(off) - 1)])
                         | (a[:, K0] < off[np.clip(s, 0, len(off) - 1)])
                         | (a[:, K1] > off[np.clip(s + 1, 0, len(off) - 1)]))
    if len(bad):
        _fail(1, f"mask piece {bad[0]} {a[bad[0]].tolist()} is not inside its sample")
    if (piece_counts(a) <= 0).any() or not np.array_equal(normalize(a), a):
        _fail(1, "mask pieces are not in canonical (tightened, non-empty) form")
    i, j = _pairwise(a, a)
    keep = i < j
    i, j = i[keep], j[keep]
    overlap = np.flatnonzero(tighten(_intersect_rows(a[i], a[j])))
    if len(overlap):
        x, y = i[overlap[0]], j[overlap[0]]
        _fail(1, f"mask pieces {x} {a[x].tolist()} and {y} {a[y].tolist()} overlap")


def verify_graph(g: BlockGraph) -> None:
    p = g.problem
    T = p.tokens
    if g.n_tb == 0 and T == 0:
        return
    if g.tb_start[0] != 0 or g.tb_end[-1] != T or not np.array_equal(g.tb_start[1:], g.tb_end[:-1]) \
            or (g.tb_len <= 0).any():
        _fail(2, "token blocks do not partition [0, T)")
    if g.hg_start[0] != 0 or g.hg_end[-1] != p.kv_heads or not np.array_equal(g.hg_start[1:], g.hg_end[:-1]) \
            or (g.hg_end <= g.hg_start).any():
        _fail(2, "head groups do not partition the kv heads")
    n = g.n_tile
    if len(g.tile_ptr) != n + 1 or g.tile_ptr[0] != 0 or g.tile_ptr[-1] != len(g.pieces) \
            or (np.diff(g.tile_ptr) <= 0).any():
        _fail(2, "tile piece pointers are malformed")
    key = g.tile_q * g.n_tb + g.tile_k
    if len(np.unique(key)) != n:
        dup = np.flatnonzero(np.bincount(np.unique(key, return_inverse=True)[1]) > 1)[0]
        _fail(2, f"tile (q block, kv block) {divmod(int(np.unique(key)[dup]), g.n_tb)} appears twice")
    owner = np.repeat(np.arange(n), np.diff(g.tile_ptr))
    P, src = g.pieces, g.piece_src
    M = p.pieces.a
    qs, qe = g.tb_start[g.tile_q[owner]], g.tb_end[g.tile_q[owner]]
    ks, ke = g.tb_start[g.tile_k[owner]], g.tb_end[g.tile_k[owner]]
    inside = (P[:, Q0] >= qs) & (P[:, Q1] <= qe) & (P[:, K0] >= ks) & (P[:, K1] <= ke)
    sub = ((P[:, Q0] >= M[src, Q0]) & (P[:, Q1] <= M[src, Q1]) & (P[:, K0] >= M[src, K0]) & (P[:, K1] <= M[src, K1])
           & (P[:, LO] >= M[src, LO]) & (P[:, HI] <= M[src, HI]))
    bad = np.flatnonzero(~(inside & sub))
    if len(bad):
        t = owner[bad[0]]
        _fail(2, f"piece {P[bad[0]].tolist()} of tile {t} lies outside its tile or its mask piece {src[bad[0]]}")
    counts = piece_counts(P)
    if (counts <= 0).any():
        _fail(2, f"tile {owner[np.flatnonzero(counts <= 0)[0]]} has an empty piece")
    if len(np.unique(owner * len(M) + src)) != len(P):
        _fail(2, "a tile holds two pieces of the same mask piece")
    per_src = np.bincount(src, weights=counts, minlength=len(M)).astype(np.int64)
    bad = np.flatnonzero(per_src != piece_counts(M))
    if len(bad):
        _fail(2, f"mask piece {bad[0]} has {piece_counts(M)[bad[0]]} pairs but its tiles cover {per_src[bad[0]]}")
    if not np.array_equal(np.add.reduceat(counts, g.tile_ptr[:-1]) if n else counts, g.tile_pairs):
        _fail(2, "tile pair counts do not match their pieces")
    cnt = np.zeros((n, g.n_hg), np.int64)
    if len(g.cb_tile) and ((g.cb_tile < 0).any() or (g.cb_tile >= n).any() or (g.cb_hg < 0).any()
                           or (g.cb_hg >= g.n_hg).any()):
        _fail(2, "compute block refers to a tile or head group that does not exist")
    np.add.at(cnt, (g.cb_tile, g.cb_hg), 1)
    if (cnt != 1).any():
        t, h = np.argwhere(cnt != 1)[0]
        what = "is missing" if cnt[t, h] == 0 else f"appears {cnt[t, h]} times"
        cbs = np.flatnonzero((g.cb_tile == t) & (g.cb_hg == h))
        _fail(2, f"compute block (tile {t}: q=tb{g.tile_q[t]}, kv=tb{g.tile_k[t]}, hg {h}) {what}"
              + (f" (blocks {cbs.tolist()})" if len(cbs) else ""))


def verify_placement(g: BlockGraph, pl: Placement) -> None:
    if pl.devices <= 0 or pl.nodes <= 0 or pl.devices % pl.nodes:
        _fail(3, f"{pl.devices} devices cannot be split over {pl.nodes} nodes")
    if len(pl.home) != g.n_tb or len(pl.cb_device) != g.n_cb:
        _fail(3, "placement does not match the block graph's sizes")
    for name, arr in (("token block", pl.home), ("compute block", pl.cb_device)):
        bad = np.flatnonzero((arr < 0) | (arr >= pl.devices))
        if len(bad):
            _fail(3, f"{name} {bad[0]} is placed on device {arr[bad[0]]}, outside 0..{pl.devices - 1}")


def needed_transfers(g: BlockGraph, pl: Placement) -> dict[int, np.ndarray]:
    """The forward transfers a placement needs, as unique rows ``(tb, hg, src, dst)`` per kind."""
    home, dev = pl.home, pl.cb_device
    out = {}
    for kind, tb, toward_home in ((X_Q, g.cb_q, False), (X_KV, g.cb_k, False), (X_O, g.cb_q, True)):
        need = home[tb] != dev
        src, dst = (dev, home[tb]) if toward_home else (home[tb], dev)
        rows = np.stack([tb[need], g.cb_hg[need], src[need], dst[need]], 1)
        out[kind] = np.unique(rows, axis=0) if len(rows) else rows.reshape(0, 4)
    return out


def verify_schedule(g: BlockGraph, pl: Placement, s: Schedule) -> None:
    if len(s.cb_stage) != g.n_cb or (s.cb_stage < 0).any() or (s.cb_stage >= s.stages).any():
        _fail(3, "schedule stages do not match the compute blocks")
    need = needed_transfers(g, pl)
    for kind, name in ((X_Q, "Q"), (X_KV, "KV"), (X_O, "partial O")):
        have = s.xfer[s.xfer[:, XK] == kind][:, [XTB, XHG, XSRC, XDST]]
        hv = np.unique(have, axis=0) if len(have) else have.reshape(0, 4)
        if len(hv) != len(have):
            _fail(3, f"a {name} transfer is scheduled twice")
        want = {tuple(r) for r in need[kind].tolist()}
        got = {tuple(r) for r in hv.tolist()}
        if want - got:
            tb, hg, src, dst = sorted(want - got)[0]
            _fail(3 if kind != X_O else 4, f"{name} of tb{tb} hg{hg} is needed on d{dst} but no transfer "
                  f"d{src}->d{dst} is scheduled")
        if got - want:
            tb, hg, src, dst = sorted(got - want)[0]
            _fail(3, f"{name} transfer of tb{tb} hg{hg} d{src}->d{dst} is not needed")


def _context(prog: Program, phase: int, d: int, i: int, width: int = 4) -> str:
    code = prog.code[phase][d].tolist()
    lines = [f"  device {d} {PHASES[phase]}:"]
    for j in range(max(0, i - width), min(len(code), i + width + 1)):
        lines.append(f"  {'>>' if j == i else '  '} {j:5d}  {format_instr(code[j])}")
    return "\n".join(lines)


def verify_program(g: BlockGraph, pl: Placement, prog: Program, memory_cap: int | None = None) -> None:
    if prog.devices != pl.devices:
        _fail(5, f"program has {prog.devices} devices, placement {pl.devices}")
    X = prog.transfers
    nt = len(X)
    if nt and not np.array_equal(X[:, T_TAG], np.arange(nt)):
        _fail(5, "transfer tags must be 0..n-1 in order")
    if nt and ((X[:, [T_SRC, T_DST]] < 0).any() or (X[:, [T_SRC, T_DST]] >= prog.devices).any()
               or (X[:, T_SRC] == X[:, T_DST]).any()):
        _fail(5, "a transfer has a bad source or destination")
    cq, ck, chg, cdev = g.cb_q, g.cb_k, g.cb_hg, pl.cb_device
    for phase in (FWD, BWD):
        bufs = [b.tolist() for b in prog.buffers[phase]]
        # 6: memory
        for d in range(prog.devices):
            total = int(prog.buffers[phase][d][:, BBYTES].sum())
            if memory_cap is not None and total > memory_cap:
                _fail(6, f"device {d} needs {total} bytes of buffers in {PHASES[phase]}, cap is {memory_cap}")
            for b in bufs[d]:
                if b[BROLE] == HOME and pl.home[b[BTB]] != d:
                    _fail(3, f"device {d} {PHASES[phase]} holds {KINDS[b[BK]]}[tb{b[BTB]}] as home, "
                          f"but tb{b[BTB]} lives on d{pl.home[b[BTB]]}")
        # 5: pairing of sends and receives
        sends = np.full(nt, -1)
        recvs = np.full(nt, -1)
        ph_mask = X[:, T_PHASE] == phase if nt else np.zeros(0, bool)
        for d in range(prog.devices):
            c = prog.code[phase][d]
            for op, arr in ((SEND, sends), (RECV, recvs)):
                rows = c[c[:, 0] == op]
                tags = rows[:, 1]
                if len(tags) and ((tags < 0).any() or (tags >= nt).any()):
                    _fail(5, f"device {d} {PHASES[phase]} posts an unknown transfer tag")
                for t, peer, b in rows[:, 1:4].tolist():
                    if arr[t] != -1:
                        _fail(5, f"{transfer_key(prog, t)} is {'sent' if op == SEND else 'received'} twice "
                              f"(devices {arr[t]} and {d})")
                    arr[t] = d
                    tx = X[t]
                    me, other = (tx[T_SRC], tx[T_DST]) if op == SEND else (tx[T_DST], tx[T_SRC])
                    if tx[T_PHASE] != phase or me != d or peer != other:
                        _fail(5, f"device {d} {PHASES[phase]} posts {transfer_key(prog, t)} with the wrong peer/phase")
                    if not 0 <= b < len(bufs[d]):
                        _fail(5, f"device {d} {PHASES[phase]}: {transfer_key(prog, t)} uses unknown buffer %{b}")
                    bb = bufs[d][b]
                    if (bb[BK], bb[BTB], bb[BHG], bb[BBYTES]) != (tx[T_KIND], tx[T_TB], tx[T_HG], tx[T_BYTES]):
                        _fail(5, f"device {d}: buffer %{b} ({KINDS[bb[BK]]} tb{bb[BTB]} hg{bb[BHG]}, {bb[BBYTES]} B) "
                              f"does not match {transfer_key(prog, t)} ({tx[T_BYTES]} B)")
                    if op == RECV and (bb[BROLE] != RECVD or bb[BPEER] != tx[T_SRC]):
                        _fail(5, f"device {d}: {transfer_key(prog, t)} receives into %{b}, not a receive buffer from d{tx[T_SRC]}")
        for t in np.flatnonzero(ph_mask):
            if sends[t] == -1:
                _fail(5, f"{transfer_key(prog, t)} is received but never sent")
            if recvs[t] == -1:
                _fail(5, f"{transfer_key(prog, t)} is sent but never received")
        _symbolic_run(g, pl, prog, phase, bufs, cq, ck, chg, cdev)


def _symbolic_run(g, pl, prog, phase, bufs, cq, ck, chg, cdev) -> None:
    X = prog.transfers
    ready = [[b[BROLE] == HOME for b in bs] for bs in bufs]
    sending = [[0] * len(bs) for bs in bufs]      # posted sends not yet waited
    was_sent = [[False] * len(bs) for bs in bufs]
    merged = [[0] * len(bs) for bs in bufs]
    written = [[False] * len(bs) for bs in bufs]
    waited = np.zeros((len(X), 2), bool)
    pending_recv = {}
    ran = np.zeros(g.n_cb, np.int64)
    where = {}

    def fail(inv, d, i, msg):
        _fail(inv, f"device {d} {PHASES[phase]} instruction {i}: {msg}", _context(prog, phase, d, i))

    def buf(d, i, b, kinds, roles, tb=None, hg=None, need_ready=True, what=""):
        if not 0 <= b < len(bufs[d]):
            fail(3, d, i, f"unknown buffer %{b}")
        r = bufs[d][b]
        if r[BK] not in kinds or r[BROLE] not in roles or (tb is not None and r[BTB] != tb) \
                or (hg is not None and r[BHG] != hg):
            fail(3, d, i, f"%{b} is {KINDS[r[BK]]}[tb{r[BTB]},hg{r[BHG]}], expected {what}")
        if need_ready and not ready[d][b]:
            fail(3, d, i, f"{what} %{b} is read before its receive completed")
        return r

    def write(d, i, b):
        if was_sent[d][b]:
            fail(4, d, i, f"%{b} is written after it was sent (a partial must be final when sent)")
        written[d][b] = True
        ready[d][b] = True

    def on(d, i, row):
        op = row[0]
        if op == SEND:
            t, _, b = row[1:4]
            if not ready[d][b]:
                fail(3, d, i, f"sends %{b} before it holds data")
            r = bufs[d][b]
            if r[BROLE] == PART and not written[d][b]:
                fail(4, d, i, f"sends partial %{b} that nothing wrote")
            sending[d][b] += 1
            was_sent[d][b] = True
            where[(t, 0)] = (d, b)
        elif op == RECV:
            t, _, b = row[1:4]
            if ready[d][b] or (d, b) in pending_recv.values():
                fail(5, d, i, f"receives into %{b} twice")
            pending_recv[t] = (d, b)
        elif op == WAIT:
            t = row[1]
            side = 0 if X[t, T_SRC] == d else 1
            if (X[t, T_SRC] if side == 0 else X[t, T_DST]) != d:
                fail(5, d, i, f"waits on {transfer_key(prog, t)}, which is not its own")
            if waited[t, side]:
                fail(5, d, i, f"waits on {transfer_key(prog, t)} twice")
            waited[t, side] = True
            if side == 1:
                rd, rb = pending_recv.pop(t)
                ready[rd][rb] = True
            else:
                sd, sb = where[(t, 0)]
                sending[sd][sb] -= 1
        elif op in (ATTN, ATTN_BWD):
            c = row[1]
            if not 0 <= c < g.n_cb:
                fail(2, d, i, f"unknown compute block c{c}")
            if cdev[c] != d:
                fail(3, d, i, f"runs c{c}, which is placed on d{cdev[c]}")
            ran[c] += 1
            if ran[c] > 1:
                fail(2, d, i, f"runs c{c} a second time")
            buf(d, i, row[2], (B_Q,), (HOME, RECVD), cq[c], chg[c], what=f"Q[tb{cq[c]},hg{chg[c]}]")
            buf(d, i, row[3], (B_KV,), (HOME, RECVD), ck[c], chg[c], what=f"KV[tb{ck[c]},hg{chg[c]}]")
            if op == ATTN:
                buf(d, i, row[4], (B_O,), (HOME, PART), cq[c], chg[c], need_ready=False, what=f"O[tb{cq[c]},hg{chg[c]}]")
                write(d, i, row[4])
            else:
                buf(d, i, row[4], (B_DQ,), (HOME, PART), cq[c], chg[c], need_ready=False, what=f"dQ[tb{cq[c]},hg{chg[c]}]")
                buf(d, i, row[5], (B_DKV,), (HOME, PART), ck[c], chg[c], need_ready=False, what=f"dKV[tb{ck[c]},hg{chg[c]}]")
                write(d, i, row[4])
                write(d, i, row[5])
        elif op in (MERGE, ADD):
            dst, srcb = row[1], row[2]
            kinds = (B_O,) if op == MERGE else (B_DQ, B_DKV)
            s = buf(d, i, srcb, kinds, (RECVD,), what="a received partial")
            buf(d, i, dst, (s[BK],), (HOME,), s[BTB], s[BHG], need_ready=False,
                what=f"home {KINDS[s[BK]]}[tb{s[BTB]},hg{s[BHG]}]")
            merged[d][srcb] += 1
            if merged[d][srcb] > 1:
                fail(4, d, i, f"merges partial %{srcb} twice")
        else:
            fail(5, d, i, f"unknown opcode {op}")

    try:
        cooperate(prog, phase, on)
    except DeadlockError as e:
        raise VerifyError(f"invariant 5: {e}") from None
    missing = np.flatnonzero(ran != 1)
    if len(missing):
        c = missing[0]
        _fail(2, f"compute block c{c} (q=tb{cq[c]}, kv=tb{ck[c]}, hg{chg[c]}) on d{cdev[c]} never runs in "
              f"{PHASES[phase]}")
    ph = np.flatnonzero(X[:, T_PHASE] == phase) if len(X) else []
    for t in ph:
        if not waited[t].all():
            side = "sender" if not waited[t, 0] else "receiver"
            _fail(5, f"{transfer_key(prog, t)}: the {side} never waits on it")
    for d, bs in enumerate(bufs):
        for b, r in enumerate(bs):
            if r[BROLE] == PART and not was_sent[d][b]:
                _fail(4, f"device {d} {PHASES[phase]}: partial {KINDS[r[BK]]}[tb{r[BTB]},hg{r[BHG]}] (%{b}) is never sent home")
            if r[BROLE] == RECVD and r[BK] in (B_O, B_DQ, B_DKV) and merged[d][b] != 1:
                _fail(4, f"device {d} {PHASES[phase]}: received partial {KINDS[r[BK]]}[tb{r[BTB]},hg{r[BHG]}] "
                      f"(%{b}) is merged {merged[d][b]} times")
            if r[BROLE] == RECVD and not ready[d][b]:
                _fail(5, f"device {d} {PHASES[phase]}: receive into %{b} never completes")


def verify(ir: PlanIR, done: set | None = None) -> None:
    """Check every invariant that applies to the levels ``ir`` has (see module doc).

    ``done`` (ids of already verified level objects) lets a pipeline skip the
    levels that a pass did not change."""
    done = set() if done is None else done

    def fresh(*objs) -> bool:
        key = tuple(id(o) for o in objs)
        if key in done:
            return False
        done.add(key)
        return True

    if fresh(ir.problem):
        verify_problem(ir.problem)
    g, pl, s, prog = ir.graph, ir.placement, ir.schedule, ir.program
    if g is not None and fresh(g):
        if g.problem is not ir.problem:
            _fail(2, "block graph belongs to another problem")
        verify_graph(g)
    if g is not None and pl is not None and fresh(g, pl):
        if pl.devices != ir.devices or pl.nodes != ir.nodes:
            _fail(3, f"placement is for {pl.devices} devices on {pl.nodes} nodes, the plan for {ir.devices} on {ir.nodes}")
        verify_placement(g, pl)
    if g is not None and pl is not None and s is not None and fresh(g, pl, s):
        verify_schedule(g, pl, s)
    if g is not None and pl is not None and prog is not None and fresh(g, pl, prog):
        verify_program(g, pl, prog, ir.memory_cap)
