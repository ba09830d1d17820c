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
                      T_PHASE, T_SRC, T_TAG, T_TB, WAIT, ROLES, N_OPERANDS, Program, buffer_bytes,
                      format_instr)
from .schedule import X_KV, X_O, X_Q, XDST, XHG, XK, XSRC, XSTAGE, XTB, Schedule


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


def _keys(tb, hg, dev, g: BlockGraph, devices: int) -> np.ndarray:
    return (np.asarray(tb) * g.n_hg + np.asarray(hg)) * devices + np.asarray(dev)


def verify_schedule(g: BlockGraph, pl: Placement, s: Schedule) -> None:
    """Q and KV reach every device that computes with them, once, in time;
    a block is forwarded only by a device that received it in an earlier
    stage; partial outputs go from each computing device to the home."""
    if len(s.cb_stage) != g.n_cb or (s.cb_stage < 0).any() or (s.cb_stage >= s.stages).any():
        _fail(3, "schedule stages do not match the compute blocks")
    x = s.xfer
    if len(x) and ((x[:, XSRC] < 0).any() or (x[:, XSRC] >= pl.devices).any() or (x[:, XDST] < 0).any()
                   or (x[:, XDST] >= pl.devices).any() or (x[:, XTB] < 0).any() or (x[:, XTB] >= g.n_tb).any()
                   or (x[:, XHG] < 0).any() or (x[:, XHG] >= g.n_hg).any() or (x[:, XSRC] == x[:, XDST]).any()
                   or (x[:, XSTAGE] < 0).any() or (x[:, XSTAGE] >= s.stages).any()):
        _fail(3, "a scheduled transfer names a block, device or stage that does not exist")
    need = needed_transfers(g, pl)
    n = pl.devices
    for kind, name, cb_tb in ((X_Q, "Q", g.cb_q), (X_KV, "KV", g.cb_k)):
        rows = x[x[:, XK] == kind]
        tb, hg, src, dst, stage = rows[:, XTB], rows[:, XHG], rows[:, XSRC], rows[:, XDST], rows[:, XSTAGE]
        home = pl.home[tb]
        if (dst == home).any():
            i = np.flatnonzero(dst == home)[0]
            _fail(3, f"{name}[tb{tb[i]},hg{hg[i]}] is sent to its own home d{dst[i]}")
        key = _keys(tb, hg, dst, g, n)
        order = np.argsort(key, kind="stable")
        skey = key[order]
        dup = np.flatnonzero(np.diff(skey) == 0)
        if len(dup):
            i = order[dup[0]]
            _fail(3, f"{name}[tb{tb[i]},hg{hg[i]}] is delivered to d{dst[i]} twice")

        def arrival(k):
            pos = np.clip(np.searchsorted(skey, k), 0, max(0, len(skey) - 1))
            found = (skey[pos] == k) if len(skey) else np.zeros(len(k), bool)
            return np.where(found, stage[order][pos] if len(skey) else 0, -1), found

        fwd = src != home
        arr, found = arrival(_keys(tb[fwd], hg[fwd], src[fwd], g, n))
        bad = np.flatnonzero(~found | (arr >= stage[fwd]))
        if len(bad):
            i = np.flatnonzero(fwd)[bad[0]]
            _fail(3, f"d{src[i]} forwards {name}[tb{tb[i]},hg{hg[i]}] in stage {stage[i]} without holding it "
                     f"(it is not home there and does not arrive in an earlier stage)")
        # every compute block's remote input arrives by its stage
        remote = pl.home[cb_tb] != pl.cb_device
        k = _keys(cb_tb[remote], g.cb_hg[remote], pl.cb_device[remote], g, n)
        arr, found = arrival(k)
        late = np.flatnonzero(~found | (arr > s.cb_stage[remote]))
        if len(late):
            c = np.flatnonzero(remote)[late[0]]
            what = "never arrives" if not found[late[0]] else f"arrives in stage {arr[late[0]]}"
            _fail(3, f"{name}[tb{cb_tb[c]},hg{g.cb_hg[c]}] is needed on d{pl.cb_device[c]} by compute block c{c} "
                     f"in stage {s.cb_stage[c]} but {what}")
    have = x[x[:, XK] == X_O][:, [XTB, XHG, XSRC, XDST]]
    hv = np.unique(have, axis=0) if len(have) else have.reshape(0, 4)
    if len(hv) != len(have):
        _fail(4, "a partial O transfer is scheduled twice")
    want = {tuple(r) for r in need[X_O].tolist()}
    got = {tuple(r) for r in hv.tolist()}
    if want - got:
        tb, hg, src, dst = sorted(want - got)[0]
        _fail(4, f"partial O of tb{tb} hg{hg} computed on d{src} is never sent home to d{dst}")
    if got - want:
        tb, hg, src, dst = sorted(got - want)[0]
        _fail(4, f"partial O transfer of tb{tb} hg{hg} d{src}->d{dst} has no partial to carry")


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
    for phase in (FWD, BWD):
        bufs = [b.tolist() for b in prog.buffers[phase]]
        _check_tables(g, prog, phase)
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
        _symbolic_run(g, pl, prog, phase)


_NEVER = np.iinfo(np.int64).max


def _check_tables(g, prog, phase) -> None:
    """Buffer rows name real blocks and have their canonical sizes; unused
    operand columns are zero (so the text form is complete)."""
    for d in range(prog.devices):
        B, C = prog.buffers[phase][d], prog.code[phase][d]
        if len(B):
            if ((B[:, BK] < 0) | (B[:, BK] > B_DKV) | (B[:, BTB] < 0) | (B[:, BTB] >= g.n_tb) | (B[:, BHG] < 0)
                    | (B[:, BHG] >= g.n_hg) | (B[:, BROLE] < 0) | (B[:, BROLE] > PART)).any():
                _fail(5, f"device {d} {PHASES[phase]}: a buffer names a block kind, token block or head group "
                         f"that does not exist")
            want = np.zeros(len(B), np.int64)
            for kind in np.unique(B[:, BK]):
                sel = B[:, BK] == kind
                want[sel] = buffer_bytes(g, phase, int(kind), B[sel, BTB], B[sel, BHG])
            bad = np.flatnonzero((want != B[:, BBYTES]) | ((B[:, BROLE] != RECVD) & (B[:, BPEER] != -1)))
            if len(bad):
                b = bad[0]
                _fail(5, f"device {d} {PHASES[phase]}: buffer %{b} has {B[b, BBYTES]} bytes (expected {want[b]}) "
                         f"or a peer it cannot have")
        if len(C):
            ops = C[:, 0]
            if ((ops < 0) | (ops > ADD)).any():
                i = int(np.flatnonzero((ops < 0) | (ops > ADD))[0])
                _fail(5, f"device {d} {PHASES[phase]} instruction {i}: unknown opcode {C[i, 0]}")
            used = np.array(N_OPERANDS)[ops]
            junk = (C[:, 1:] != 0) & (np.arange(1, 6)[None, :] > used[:, None])
            if junk.any():
                i = int(np.flatnonzero(junk.any(1))[0])
                _fail(5, f"device {d} {PHASES[phase]} instruction {i}: operands beyond its arity are not zero")


def _check_device(g, pl, prog, phase, d, ran, waited) -> None:
    """Invariants 2-4 for one device and phase, vectorized over its instructions.

    Order matters only through instruction indices: a received buffer is
    ready after the index of the wait on its transfer, a partial is final
    after its last write, and every read must come after readiness."""
    B, C, X = prog.buffers[phase][d], prog.code[phase][d], prog.transfers
    n, nb, nt = len(C), len(B), len(X)
    op = C[:, 0]
    idx = np.arange(n)

    def fail(inv, i, msg):
        _fail(inv, f"device {d} {PHASES[phase]} instruction {i}: {msg}", _context(prog, phase, d, int(i)))

    def first(mask, inv, msg):
        hit = np.flatnonzero(mask)
        if len(hit):
            fail(inv, hit[0], msg(hit[0]))

    first((op < 0) | (op > ADD), 5, lambda i: f"unknown opcode {op[i]}")
    # buffer operands in range
    for ops_, cols in (((RECV, SEND), (3,)), ((ATTN,), (2, 3, 4)), ((ATTN_BWD,), (2, 3, 4, 5)), ((MERGE, ADD), (1, 2))):
        sel = np.isin(op, ops_)
        for col in cols:
            first(sel & ((C[:, col] < 0) | (C[:, col] >= nb)), 3, lambda i: f"unknown buffer %{C[i, col]}")
    # waits: each transfer of this device waited at most once here
    w = op == WAIT
    tags = C[w, 1]
    first(w & ((C[:, 1] < 0) | (C[:, 1] >= nt)), 5, lambda i: f"waits on unknown transfer t{C[i, 1]}")
    mine = (X[tags, T_SRC] == d) | (X[tags, T_DST] == d)
    first(np.isin(idx, idx[w][~mine]), 5, lambda i: f"waits on {transfer_key(prog, C[i, 1])}, which is not its own")
    uniq, counts = np.unique(tags, return_counts=True)
    if (counts > 1).any():
        t = uniq[counts > 1][0]
        fail(5, idx[w][tags == t][1], f"waits on {transfer_key(prog, t)} twice")
    wait_at = np.full(nt, _NEVER)
    wait_at[tags] = idx[w]
    side = np.where(X[tags, T_SRC] == d, 0, 1)
    waited[tags, side] = True
    # readiness of every buffer: home at start, received after the wait on its transfer
    ready_at = np.full(nb, _NEVER)
    ready_at[B[:, BROLE] == HOME] = -1
    r = op == RECV
    rb = C[r, 3]
    ub, cnt = np.unique(rb, return_counts=True)
    if (cnt > 1).any():
        fail(5, idx[r][rb == ub[cnt > 1][0]][1], f"receives into %{ub[cnt > 1][0]} twice")
    ready_at[rb] = wait_at[C[r, 1]]
    # writes to partial buffers
    is_c = (op == ATTN) | (op == ATTN_BWD)
    wcols = (4,) if phase == FWD else (4, 5)
    wb = np.concatenate([C[is_c, c] for c in wcols])
    wi = np.concatenate([idx[is_c]] * len(wcols))
    first_w = np.full(nb, _NEVER)
    last_w = np.full(nb, -1)
    np.minimum.at(first_w, wb, wi)
    np.maximum.at(last_w, wb, wi)
    part = B[:, BROLE] == PART
    ready_at[part] = first_w[part]
    # compute blocks
    c = C[is_c, 1]
    ci = idx[is_c]
    first(is_c & ((C[:, 1] < 0) | (C[:, 1] >= g.n_cb)), 2, lambda i: f"unknown compute block c{C[i, 1]}")
    cdev = pl.cb_device[c]
    if (cdev != d).any():
        j = np.flatnonzero(cdev != d)[0]
        fail(3, ci[j], f"runs c{c[j]}, which is placed on d{cdev[j]}")
    np.add.at(ran, c, 1)
    over = ran[c] > 1
    if over.any():
        j = np.flatnonzero(over)[0]
        fail(2, ci[j], f"runs c{c[j]} a second time")
    cq, ck, chg = g.cb_q[c], g.cb_k[c], g.cb_hg[c]
    order_errors = []
    operands = [(2, B_Q, cq, (HOME, RECVD), True, "Q"), (3, B_KV, ck, (HOME, RECVD), True, "KV")]
    if phase == FWD:
        operands.append((4, B_O, cq, (HOME, PART), False, "O"))
    else:
        operands += [(4, B_DQ, cq, (HOME, PART), False, "dQ"), (5, B_DKV, ck, (HOME, PART), False, "dKV")]
    for col, kind, tb, roles, read, name in operands:
        b = C[is_c, col]
        ok = (B[b, BK] == kind) & (B[b, BTB] == tb) & (B[b, BHG] == chg) & np.isin(B[b, BROLE], roles)
        if not ok.all():
            j = np.flatnonzero(~ok)[0]
            x = B[b[j]]
            fail(3, ci[j], f"%{b[j]} is {KINDS[x[BK]]}[tb{x[BTB]},hg{x[BHG]}] ({ROLES[x[BROLE]]}), expected "
                           f"{name}[tb{tb[j]},hg{chg[j]}]")
        if read:
            late = ready_at[b] >= ci
            if late.any():
                j = np.flatnonzero(late)[0]
                order_errors.append((ci[j], 3, f"{name} %{b[j]} is read before its receive completed"))
    # sends: the buffer holds its data, and a partial is final (no write after the send)
    s_ = op == SEND
    sb, si = C[s_, 3], idx[s_]
    early = ready_at[sb] >= si
    if early.any():
        order_errors.append((si[np.flatnonzero(early)[0]], 3,
                             f"sends %{sb[np.flatnonzero(early)[0]]} before it holds data"))
    late = last_w[sb] > si
    if late.any():
        j = np.flatnonzero(late)[0]
        order_errors.append((last_w[sb[j]], 4, f"%{sb[j]} is written after it was sent (a partial must be final when sent)"))
    sent_count = np.bincount(sb, minlength=nb)
    # merges of received partials into home blocks
    m = (op == MERGE) | (op == ADD)
    dst, src, mi = C[m, 1], C[m, 2], idx[m]
    kind_ok = np.where(op[m] == MERGE, B[src, BK] == B_O, np.isin(B[src, BK], (B_DQ, B_DKV)))
    ok = kind_ok & (B[src, BROLE] == RECVD) & (B[dst, BROLE] == HOME) & (B[dst, BK] == B[src, BK]) \
        & (B[dst, BTB] == B[src, BTB]) & (B[dst, BHG] == B[src, BHG])
    if not ok.all():
        j = np.flatnonzero(~ok)[0]
        fail(4, mi[j], f"merges %{src[j]} into %{dst[j]}: not a received partial and its home block")
    late = ready_at[src] >= mi
    if late.any():
        j = np.flatnonzero(late)[0]
        order_errors.append((mi[j], 3, f"merges %{src[j]} before its receive completed"))
    if order_errors:  # report the earliest instruction that reads, sends or merges too early
        i, inv, msg = min(order_errors, key=lambda e: e[0])
        fail(inv, i, msg)
    merged = np.bincount(src, minlength=nb)
    if (merged > 1).any():
        b = np.flatnonzero(merged > 1)[0]
        fail(4, mi[src == b][1], f"merges partial %{b} twice")
    for b in np.flatnonzero(part & (sent_count != 1)):
        _fail(4, f"device {d} {PHASES[phase]}: partial {KINDS[B[b, BK]]}[tb{B[b, BTB]},hg{B[b, BHG]}] (%{b}) is "
                 f"sent {sent_count[b]} times, not once")
    recv_partial = (B[:, BROLE] == RECVD) & np.isin(B[:, BK], (B_O, B_DQ, B_DKV))
    for b in np.flatnonzero(recv_partial & (merged != 1)):
        _fail(4, f"device {d} {PHASES[phase]}: received partial {KINDS[B[b, BK]]}[tb{B[b, BTB]},hg{B[b, BHG]}] "
                 f"(%{b}) is merged {merged[b]} times")
    for b in np.flatnonzero((B[:, BROLE] == RECVD) & (ready_at == _NEVER)):
        _fail(5, f"device {d} {PHASES[phase]}: receive into %{b} never completes")


def _symbolic_run(g, pl, prog, phase) -> None:
    X = prog.transfers
    ran = np.zeros(g.n_cb, np.int64)
    waited = np.zeros((len(X), 2), bool)
    for d in range(prog.devices):
        _check_device(g, pl, prog, phase, d, ran, waited)
    missing = np.flatnonzero(ran != 1)
    if len(missing):
        c = missing[0]
        _fail(2, f"compute block c{c} (q=tb{g.cb_q[c]}, kv=tb{g.cb_k[c]}, hg{g.cb_hg[c]}) on "
                 f"d{pl.cb_device[c]} never runs in {PHASES[phase]}")
    for t in (np.flatnonzero(X[:, T_PHASE] == phase) if len(X) else []):
        if not waited[t].all():
            side = "sender" if not waited[t, 0] else "receiver"
            _fail(5, f"{transfer_key(prog, t)}: the {side} never waits on it")
    # deadlock freedom: only sends, receives and waits can block or unblock
    comm = [c[np.isin(c[:, 0], (RECV, SEND, WAIT))] for c in prog.code[phase]]
    try:
        cooperate(prog, phase, lambda d, i, row: None, code=comm)
    except DeadlockError as e:
        raise VerifyError(f"invariant 5: {e}") from None


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
