"""The verifier's checks of a :class:`~attnplan.ir.program.Program` against
its block graph and placement (invariants 2-6 at the instruction level; see
:mod:`attnplan.ir.verify`), plus everything the runtime relies on: opcodes
legal in their phase, operands naming what the instruction set says they
name, buffer tables with the kinds, roles and sizes of their phase.

Messages: the message table is a CSR index of the transfer table (every
transfer in exactly one message, a message's transfers share its phase,
source and destination, its bytes are theirs summed); each transfer names a
buffer of its block on its source (what the send packs) and a receive buffer
of its block on its destination (what the receive unpacks into). A send reads
the source buffers of its message's transfers and a receive writes their
receive buffers: the checks of the instruction set's buffer operands apply to
them as well (readiness before the send, each receive buffer received exactly
once, a partial final when sent). Between every two devices, the sends on
one side and the receives on the other are posted in the same order per
phase (:func:`check_pair_order`: a transport may match by order, as NCCL).

Every check is columnar over all devices of a phase at once: the streams and
buffer tables of a phase are concatenated (:class:`PhaseView`), so the cost
is a few numpy passes over the instructions and transfers, never a Python
loop per device, transfer or instruction. Deadlock freedom is the graph
check of :func:`attnplan.ir.interp.check_deadlock_free`.
"""

from __future__ import annotations

from typing import NoReturn

import numpy as np

from ..errors import DeadlockError, VerifyError
from .interp import check_deadlock_free, message_key
from .limits import MAX_TRANSFERS
from .program import (
    ADD,
    ARG_BUF,
    ARG_CB,
    ARG_COLS,
    ARG_MSG,
    ARG_NAMES,
    ARG_PEER,
    ARG_PREFIX,
    ATTN,
    ATTN_BWD,
    B_DKV,
    B_DQ,
    B_KV,
    B_O,
    B_Q,
    BBYTES,
    BHG,
    BK,
    BPEER,
    BROLE,
    BTB,
    BWD,
    FWD,
    HOME,
    ISA,
    KEPT,
    KINDS,
    M_BYTES,
    M_COLS,
    M_DST,
    M_END,
    M_ID,
    M_PHASE,
    M_SRC,
    M_START,
    MERGE,
    MSG_BUFFERS,
    N_OPERANDS,
    OP,
    OP_PHASE,
    PART,
    PHASE_KINDS,
    PHASES,
    RECV,
    RECVD,
    ROLES,
    SEND,
    T_BYTES,
    T_COLS,
    T_DST,
    T_HG,
    T_KIND,
    T_PHASE,
    T_RBUF,
    T_SBUF,
    T_SRC,
    T_TAG,
    T_TB,
    WAIT,
    Program,
    buffer_bytes,
    format_instr,
)

NEVER = np.iinfo(np.int64).max
_INV_OF_OP = {RECV: 5, SEND: 5, WAIT: 5, ATTN: 3, ATTN_BWD: 3, MERGE: 4, ADD: 4}


def fail(inv: int, msg: str, context: str = "") -> NoReturn:
    raise VerifyError(f"invariant {inv}: {msg}" + (f"\n{context}" if context else ""))


def first(mask: np.ndarray) -> int | None:
    """Index of the first True of ``mask`` (None: none)."""
    if not mask.any():
        return None
    return int(np.argmax(mask))


def member(values: np.ndarray, allowed, size: int) -> np.ndarray:
    """``np.isin(values, allowed)`` for small non-negative codes below ``size``
    (a table lookup; values outside ``[0, size)`` are not members)."""
    table = np.zeros(size + 1, bool)
    table[list(allowed)] = True
    return table[np.where((values >= 0) & (values < size), values, size)]


def check_shape(a, shape: tuple, what: str, inv: int) -> None:
    """``a`` is an int64 array of ``shape`` (``None`` matches any length)."""
    if not isinstance(a, np.ndarray) or a.dtype != np.int64 or a.ndim != len(shape) \
            or any(w is not None and w != s for w, s in zip(shape, a.shape)):
        got = f"{a.dtype} {list(a.shape)}" if isinstance(a, np.ndarray) else type(a).__name__
        fail(inv, f"{what} must be an int64 array of shape {[('n' if w is None else w) for w in shape]}, got {got}")


class PhaseView:
    """One phase of a program with every device's streams and buffer tables
    concatenated. Instruction ``r`` is row ``r`` at index ``idx[r]`` of
    device ``dev[r]``; buffer operand ``b`` of device ``d`` is global buffer
    ``boff[d] + b``. Columns are kept contiguous (``arg[i]``: operand ``i+1``;
    ``bk``, ``btb``... of buffers; ``x[c]``: transfer column ``c``, ``m[c]``:
    message column ``c``); ``ts`` are the transfers of this phase and
    ``tmsg[t]`` the message of transfer ``t``; the rows of each opcode and
    their operands are computed once and cached."""

    def __init__(self, prog: Program, phase: int, tmsg: np.ndarray | None = None, XT: np.ndarray | None = None):
        code, bufs = prog.code[phase], prog.buffers[phase]
        n = np.array([len(c) for c in code], np.int64)
        nb = np.array([len(b) for b in bufs], np.int64)
        coff = np.concatenate([[0], np.cumsum(n)]).astype(np.int64)
        self.prog, self.phase, self.name = prog, phase, PHASES[phase]
        C = np.concatenate(code)
        CT = np.ascontiguousarray(C.T)  # one transposing copy: every column contiguous
        self.op = CT[OP]
        self.arg = [CT[c] for c in ARG_COLS]
        self.C = C
        self.dev = np.repeat(np.arange(prog.devices, dtype=np.int64), n)
        self.start = coff[:-1]                     # first row of each device
        self.B = np.concatenate(bufs)
        BT = np.ascontiguousarray(self.B.T)
        self.bk, self.btb, self.bhg, self.brole, self.bpeer, self.bbytes = (BT[c] for c in (BK, BTB, BHG, BROLE,
                                                                                          BPEER, BBYTES))
        self.bdev = np.repeat(np.arange(prog.devices, dtype=np.int64), nb)
        self.boff = np.concatenate([[0], np.cumsum(nb)]).astype(np.int64)
        self.nb = nb
        self.x = list(np.ascontiguousarray(prog.transfers.T) if XT is None else XT)
        self.m = list(np.ascontiguousarray(prog.messages.T))
        self.ts = np.flatnonzero(self.x[T_PHASE] == phase)
        # the phase's transfers as a selector: a slice when they are contiguous (as emit writes them)
        contiguous = len(self.ts) and self.ts[-1] - self.ts[0] + 1 == len(self.ts)
        self.tsel = slice(int(self.ts[0]), int(self.ts[-1]) + 1) if contiguous else self.ts
        self.tmsg = prog.transfer_message() if tmsg is None else tmsg
        self._rows: dict = {}
        self._cache: dict = {}

    # rows and operands of one opcode -------------------------------------------------
    def rows(self, op: int) -> np.ndarray:
        if op not in self._rows:
            self._rows[op] = np.flatnonzero(self.op == op)
        return self._rows[op]

    def _cached(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def operand(self, op: int, name: str) -> np.ndarray:
        """The operand ``name`` (see :data:`ISA`) of every ``op`` instruction."""
        col = ISA[op].col(name)
        return self._cached(("arg", op, col), lambda: self.arg[col - 1][self.rows(op)])

    def devs(self, op: int) -> np.ndarray:
        return self._cached(("dev", op), lambda: self.dev[self.rows(op)])

    def index(self, op: int) -> np.ndarray:
        """Index of every ``op`` instruction in its device's stream."""
        return self._cached(("idx", op), lambda: self.rows(op) - self.start[self.devs(op)])

    def buffer(self, op: int, name: str) -> np.ndarray:
        """Global buffer ids of the buffer operand ``name`` of every ``op`` instruction."""
        return self._cached(("buf", op, name), lambda: self.boff[self.devs(op)] + self.operand(op, name))

    # messages ---------------------------------------------------------------------------
    def fail(self, inv: int, r: int, msg: str) -> None:
        d = int(self.dev[r])
        i = int(r - self.start[d])
        fail(inv, f"device {d} {self.name} instruction {i}: {msg}", context(self.prog, self.phase, d, i))

    def local(self, gb: int) -> int:
        return int(gb - self.boff[self.bdev[gb]])

    def describe(self, gb: int) -> str:
        b = self.B[gb]
        return f"%{self.local(gb)} ({KINDS[b[BK]]}[tb{b[BTB]},hg{b[BHG]}], {ROLES[b[BROLE]]})"


def context(prog: Program, phase: int, d: int, i: int, width: int = 4) -> str:
    code = prog.code[phase][d]
    lines = [f"  device {d} {PHASES[phase]}:"]
    for j in range(max(0, i - width), min(len(code), i + width + 1)):
        lines.append(f"  {'>>' if j == i else '  '} {j:5d}  {format_instr(code[j].tolist())}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ tables

def check_shapes(prog: Program) -> None:
    check_shape(prog.transfers, (None, T_COLS), "program.transfers", 5)
    check_shape(prog.messages, (None, M_COLS), "program.messages", 5)
    for ph in (FWD, BWD):
        for d in range(prog.devices):
            check_shape(prog.buffers[ph][d], (None, 6), f"program.buffers[{ph}][{d}]", 5)
            check_shape(prog.code[ph][d], (None, 6), f"program.code[{ph}][{d}]", 5)


def _phase_kind_table() -> np.ndarray:
    legal = np.zeros((2, len(KINDS)), bool)
    for p, kinds in enumerate(PHASE_KINDS):
        legal[p, list(kinds)] = True
    return legal


def transfer_key(prog: Program, t: int, tmsg: np.ndarray | None = None) -> str:
    """``t5 fwd KV[tb2,hg0] d0->d1`` (and its message, when known)."""
    x = prog.transfers[t]
    kind = KINDS[x[T_KIND]] if 0 <= x[T_KIND] < len(KINDS) else f"kind {x[T_KIND]}"
    phase = PHASES[x[T_PHASE]] if 0 <= x[T_PHASE] < len(PHASES) else f"phase {x[T_PHASE]}"
    msg = f" (in message m{tmsg[t]})" if tmsg is not None and tmsg[t] >= 0 else ""
    return f"t{t} {phase} {kind}[tb{x[T_TB]},hg{x[T_HG]}] d{x[T_SRC]}->d{x[T_DST]}{msg}"


def check_transfers(g, prog: Program, XT: np.ndarray) -> None:
    """Tags 0..n-1 in order; every transfer a real block of a kind of its
    phase between two devices, with its canonical size. ``XT``: the transfer
    table's columns (its transpose, contiguous)."""
    X = prog.transfers
    if len(X) > MAX_TRANSFERS:
        fail(5, f"{len(X)} transfers, more than MAX_TRANSFERS = {MAX_TRANSFERS}")
    tag, ph, kind, tb, hg, src, dst, nbytes = (XT[c] for c in (T_TAG, T_PHASE, T_KIND, T_TB, T_HG, T_SRC, T_DST,
                                                               T_BYTES))
    if len(X) and not np.array_equal(tag, np.arange(len(X))):
        fail(5, "transfer tags must be 0..n-1 in order")
    ok = ((ph == FWD) | (ph == BWD)) & (kind >= 0) & (kind < len(KINDS))
    ok &= _phase_kind_table()[np.where(ok, ph, 0), np.where(ok, kind, 0)]
    ok &= (tb >= 0) & (tb < g.n_tb) & (hg >= 0) & (hg < g.n_hg)
    ok &= (src >= 0) & (src < prog.devices) & (dst >= 0) & (dst < prog.devices) & (src != dst)
    bad = first(~ok)
    if bad is not None:
        fail(5, f"transfer t{bad} {X[bad].tolist()} has a bad phase, kind, block, source or destination")
    want = np.zeros(len(X), np.int64)
    for p in (FWD, BWD):
        for k in PHASE_KINDS[p]:
            sel = np.flatnonzero((ph == p) & (kind == k))
            want[sel] = buffer_bytes(g, p, k, tb[sel], hg[sel], wire=True)
    bad = first(want != nbytes)
    if bad is not None:
        fail(5, f"{transfer_key(prog, bad)} carries {nbytes[bad]} bytes; the block has {want[bad]}")


def check_messages(prog: Program, XT: np.ndarray) -> np.ndarray:
    """The message table: ids 0..m-1 in order, each message between two
    devices, its transfers a non-empty range that continues where the
    previous message's ended (a CSR index covering every transfer once),
    all of them of the message's phase, source and destination, its bytes
    their sum. Returns the message of every transfer."""
    M, X = prog.messages, prog.transfers
    nm, nt = len(M), len(X)
    MT = np.ascontiguousarray(M.T)
    mid, ph, src, dst, start, end, nbytes = (MT[c] for c in (M_ID, M_PHASE, M_SRC, M_DST, M_START, M_END, M_BYTES))
    if nm and not np.array_equal(mid, np.arange(nm)):
        fail(5, "message ids must be 0..m-1 in order")
    bad = first(~(((ph == FWD) | (ph == BWD)) & (src >= 0) & (src < prog.devices) & (dst >= 0)
                  & (dst < prog.devices) & (src != dst)))
    if bad is not None:
        fail(5, f"message m{bad} {M[bad].tolist()} has a bad phase, source or destination")
    if not nm:
        if nt:
            fail(5, f"{nt} transfers but no message carries them")
        return np.zeros(0, np.int64)
    prev_end = np.concatenate([[0], end[:-1]])
    bad = first((start != prev_end) | (end <= start))
    if bad is not None:
        fail(5, f"message m{bad} carries transfers t{start[bad]}..t{end[bad] - 1}: a message's transfers are a "
                f"non-empty range that starts where the previous message's ended (t{prev_end[bad]})")
    if end[-1] != nt:
        fail(5, f"the messages carry transfers t0..t{end[-1] - 1}, but there are {nt} transfers")
    tmsg = np.repeat(np.arange(nm, dtype=np.int64), end - start)
    bad = first((XT[T_PHASE] != ph[tmsg]) | (XT[T_SRC] != src[tmsg]) | (XT[T_DST] != dst[tmsg]))
    if bad is not None:
        fail(5, f"{transfer_key(prog, bad)} is carried by {message_key(prog, int(tmsg[bad]))}, which has another "
                f"phase, source or destination")
    total = np.add.reduceat(XT[T_BYTES], start)
    bad = first(total != nbytes)
    if bad is not None:
        fail(5, f"{message_key(prog, bad)} says {nbytes[bad]} bytes; its transfers carry {total[bad]}")
    return tmsg


def check_buffers(g, pl, f: PhaseView, memory_cap: int | None) -> None:
    """Buffer rows name real blocks of a kind of this phase, in a role that
    kind can have, with their canonical sizes; a receive buffer names another
    device as its source; the buffers of each device fit under the memory
    cap (invariant 6)."""
    d, n = f.bdev, f.prog.devices
    data = (f.bk == B_Q) | (f.bk == B_KV)
    ok = member(f.bk, PHASE_KINDS[f.phase], len(KINDS)) & (f.btb >= 0) & (f.btb < g.n_tb)
    ok &= (f.bhg >= 0) & (f.bhg < g.n_hg)
    kept = f.brole == KEPT
    ok &= (f.brole >= 0) & (f.brole <= KEPT) & ~(data & (f.brole == PART))
    ok &= ~kept | ((f.bk == B_KV) & (f.phase == BWD))
    bad = first(~ok)
    if bad is not None:
        fail(5, f"device {d[bad]} {f.name}: buffer %{f.local(bad)} {f.B[bad].tolist()} names a block kind, token "
                f"block, head group or role that does not exist here (kinds in {f.name}: "
                f"{', '.join(KINDS[k] for k in PHASE_KINDS[f.phase])}; Q and KV are never partial; only the "
                f"backward keeps, and only KV)")
    recv = f.brole == RECVD
    bad = first(np.where(recv, (f.bpeer < 0) | (f.bpeer >= n) | (f.bpeer == d), ~kept & (f.bpeer != -1)))
    if bad is not None:
        fail(5, f"device {d[bad]} {f.name}: buffer %{f.local(bad)} has peer {f.bpeer[bad]}: a receive buffer "
                f"names another device, a kept one its forward buffer, other buffers -1")
    want = np.zeros(len(f.B), np.int64)
    for kind in PHASE_KINDS[f.phase]:
        for wire in (False, True):  # a receive buffer holds what travels
            sel = np.flatnonzero((f.bk == kind) & (recv == wire))
            want[sel] = buffer_bytes(g, f.phase, kind, f.btb[sel], f.bhg[sel], wire=wire)
    bad = first(want != f.bbytes)
    if bad is not None:
        fail(5, f"device {d[bad]} {f.name}: buffer %{f.local(bad)} has {f.bbytes[bad]} bytes (expected {want[bad]})")
    _check_home_buffers(g, pl, f)
    if memory_cap is not None and len(f.B):
        total = np.bincount(d, weights=f.bbytes.astype(np.float64), minlength=n)
        bad = first(total > memory_cap)
        if bad is not None:
            fail(6, f"device {bad} needs {int(f.bbytes[d == bad].sum())} bytes of buffers in {f.name}, "
                    f"cap is {memory_cap}")


def check_kept(g, prog: Program) -> None:
    """A kept buffer (backward) names a forward receive buffer of the same
    device that holds the same KV block, each device keeps a block once, and
    only a problem with ``keep_kv`` keeps (its runtime hands them over) —
    and such a problem moves no KV in its backward. The forward's receive into it completes
    (:func:`check_partials`), so it holds the data when the backward starts."""
    X = prog.transfers
    if g.problem.keep_kv and ((X[:, T_PHASE] == BWD) & (X[:, T_KIND] == B_KV)).any():
        fail(3, "the problem keeps KV (keep_kv), but the backward moves KV blocks: every KV block a device computes "
                "with and does not home is kept from its forward")
    if not any((t[:, BROLE] == KEPT).any() for t in prog.buffers[BWD]):
        return
    if not g.problem.keep_kv:
        fail(3, "the backward keeps forward KV buffers, but the problem does not keep KV (keep_kv is off): a runtime "
                "would not hand them over")
    f, b = PhaseView(prog, FWD), PhaseView(prog, BWD)
    kept = np.flatnonzero(b.brole == KEPT)
    dev, src = b.bdev[kept], b.bpeer[kept]
    ok = (src >= 0) & (src < f.nb[dev])
    gf = f.boff[dev] + np.where(ok, src, 0)
    if len(f.B):
        ok &= (f.bk[gf] == B_KV) & (f.brole[gf] == RECVD) & (f.btb[gf] == b.btb[kept]) & (f.bhg[gf] == b.bhg[kept])
    else:
        ok[:] = False
    bad = first(~ok)
    if bad is not None:
        fail(3, f"device {dev[bad]} bwd: kept buffer %{b.local(kept[bad])} ({KINDS[b.bk[kept[bad]]]}[tb"
                f"{b.btb[kept[bad]]},hg{b.bhg[kept[bad]]}]) names forward buffer %{src[bad]}, which is not a receive "
                f"buffer of that block on d{dev[bad]}")
    key = np.sort((dev * g.n_tb + b.btb[kept]) * g.n_hg + b.bhg[kept])
    dup = first(key[1:] == key[:-1])
    if dup is not None:
        dv, r = divmod(int(key[dup]), g.n_tb * g.n_hg)
        fail(5, f"device {dv} bwd keeps KV[tb{r // g.n_hg},hg{r % g.n_hg}] twice")


def _check_home_buffers(g, pl, f: PhaseView) -> None:
    """A home buffer lives on its block's home device, one per block and kind."""
    home = np.flatnonzero(f.brole == HOME)
    tb, hg, kind = f.btb[home], f.bhg[home], f.bk[home]
    bad = first(pl.home[tb] != f.bdev[home])
    if bad is not None:
        fail(3, f"device {f.bdev[home[bad]]} {f.name} holds {KINDS[kind[bad]]}[tb{tb[bad]}] as home, "
                f"but tb{tb[bad]} lives on d{pl.home[tb[bad]]}")
    key = np.sort((tb * g.n_hg + hg) * len(KINDS) + kind)
    dup = first(key[1:] == key[:-1])
    if dup is not None:
        k, kd = divmod(int(key[dup]), len(KINDS))
        t, h = divmod(k, g.n_hg)
        fail(5, f"device {pl.home[t]} {f.name} has two home buffers of {KINDS[kd]}[tb{t},hg{h}]")


# ------------------------------------------------------------------------------------ operands

def check_opcodes(f: PhaseView) -> None:
    """Known opcodes, legal in this phase; operand columns beyond the arity are zero."""
    op = f.op
    bad = first((op < 0) | (op >= len(ISA)))
    if bad is not None:
        f.fail(5, bad, f"unknown opcode {op[bad]}")
    bad = first(~OP_PHASE[op, f.phase])
    if bad is not None:
        s = ISA[op[bad]]
        f.fail(5, bad, f"{s.name} is not valid in {f.name} (only in {', '.join(PHASES[p] for p in s.phases)})")
    arity = np.asarray(N_OPERANDS)[op]
    for i, a in enumerate(f.arg):
        bad = first((a != 0) & (arity <= i))
        if bad is not None:
            f.fail(5, bad, "operands beyond its arity are not zero")


def check_operand_ids(g, pl, f: PhaseView) -> None:
    """Every operand names what the instruction set says: a message of this
    phase, an existing buffer of this device, a compute block placed here
    (peers are checked against their message)."""
    phase_of = f.m[M_PHASE]
    for s in ISA:
        rows = f.rows(s.code)
        for name, arg in zip(s.operands, s.args):
            if arg == ARG_PEER or not len(rows):
                continue
            v = f.operand(s.code, name)
            hi = {ARG_MSG: len(phase_of), ARG_BUF: f.nb[f.devs(s.code)], ARG_CB: g.n_cb}[arg]
            bad = first((v < 0) | (v >= hi))
            if bad is not None:
                f.fail(2 if arg == ARG_CB else 5, rows[bad],
                       f"{s.name} {name}: unknown {ARG_NAMES[arg]} {ARG_PREFIX[arg]}{v[bad]}")
            if arg == ARG_MSG:
                bad = first(phase_of[v] != f.phase)
                if bad is not None:
                    f.fail(5, rows[bad], f"{s.name} names {message_key(f.prog, v[bad])}, a message of another "
                                         f"phase")
            if arg == ARG_CB:
                bad = first(pl.cb_device[v] != f.devs(s.code))
                if bad is not None:
                    f.fail(3, rows[bad], f"runs c{v[bad]}, which is placed on d{pl.cb_device[v[bad]]}")


def check_buffer_kinds(f: PhaseView) -> None:
    """Each buffer operand has a kind and role the instruction set allows there."""
    for s in ISA:
        if not len(f.rows(s.code)):
            continue
        for i, (name, arg) in enumerate(zip(s.operands, s.args)):
            if arg != ARG_BUF:
                continue
            gb = f.buffer(s.code, name)
            ok = member(f.bk[gb], s.kinds[i], len(KINDS)) & member(f.brole[gb], s.roles[i], len(ROLES))
            bad = first(~ok)
            if bad is not None:
                kinds = "/".join(KINDS[k] for k in s.kinds[i])
                roles = "/".join(ROLES[r] for r in s.roles[i])
                f.fail(_INV_OF_OP[s.code], f.rows(s.code)[bad], f"{s.name} operand {name} is "
                       f"{f.describe(gb[bad])}; it must be a {kinds} buffer ({roles})")


def check_compute_operands(g, f: PhaseView) -> None:
    """attn / attn_bwd read Q of the block's q rows and KV of its kv rows and
    write the output of the same rows, all of the block's head group."""
    which = {"q": g.cb_q, "kv": g.cb_k, "o": g.cb_q, "dq": g.cb_q, "dkv": g.cb_k}
    for op in (ATTN, ATTN_BWD):
        s = ISA[op]
        c = f.operand(op, "cb")
        hg = g.cb_hg[c]
        for name in s.operands[1:]:
            gb = f.buffer(op, name)
            tb = which[name][c]
            bad = first((f.btb[gb] != tb) | (f.bhg[gb] != hg))
            if bad is not None:
                f.fail(3, f.rows(op)[bad], f"%{f.local(gb[bad])} is {f.describe(gb[bad])}, expected "
                                           f"{KINDS[f.bk[gb[bad]]]}[tb{tb[bad]},hg{hg[bad]}] for c{c[bad]}")


def check_merge_operands(f: PhaseView) -> None:
    """merge / add take a received partial and the home buffer of the same
    block, or this device's own partial of it (a node reduce's aggregator)."""
    for op in (MERGE, ADD):
        dst, src = f.buffer(op, "dst"), f.buffer(op, "src")
        bad = first((f.bk[dst] != f.bk[src]) | (f.btb[dst] != f.btb[src]) | (f.bhg[dst] != f.bhg[src]))
        if bad is not None:
            f.fail(4, f.rows(op)[bad], f"merges {f.describe(src[bad])} into {f.describe(dst[bad])}: not a received "
                                       f"partial and its home block or own partial")


def check_message_operands(f: PhaseView) -> None:
    """send / recv / wait: the device is the message's sender / receiver /
    either, the peer is the other side. Every transfer of the phase names, on
    its source, a buffer holding its block (what the send packs) and, on its
    destination, a receive buffer of its block from that source (what the
    receive unpacks into), of the kinds and roles :data:`MSG_BUFFERS` allows."""
    src, dst = f.m[M_SRC], f.m[M_DST]
    t, me = f.operand(WAIT, "msg"), f.devs(WAIT)
    bad = first((src[t] != me) & (dst[t] != me))
    if bad is not None:
        f.fail(5, f.rows(WAIT)[bad], f"waits on {message_key(f.prog, t[bad])}, which is not its own")
    for op, peer_name, mine, other in ((SEND, "dst", src, dst), (RECV, "src", dst, src)):
        t, me, rows = f.operand(op, "msg"), f.devs(op), f.rows(op)
        bad = first((mine[t] != me) | (other[t] != f.operand(op, peer_name)))
        if bad is not None:
            f.fail(5, rows[bad], f"posts {message_key(f.prog, t[bad])} with the wrong peer")
    ts, sel = f.ts, f.tsel
    kind, tb, hg = f.x[T_KIND][sel], f.x[T_TB][sel], f.x[T_HG][sel]
    for op, (col, kinds, roles) in MSG_BUFFERS.items():
        dev = f.x[T_SRC if op == SEND else T_DST][sel]
        b = f.x[col][sel]
        side = "source" if op == SEND else "receive"
        bad = first((b < 0) | (b >= f.nb[dev]))
        if bad is not None:
            fail(5, f"{transfer_key(f.prog, ts[bad], f.tmsg)}: its {side} buffer %{b[bad]} does not exist on "
                    f"d{dev[bad]} ({f.nb[dev[bad]]} buffers in {f.name})")
        gb = f.boff[dev] + b
        wrong = (f.bk[gb] != kind) | (f.btb[gb] != tb) | (f.bhg[gb] != hg)
        if len(roles) < len(ROLES):
            wrong |= ~member(f.brole[gb], roles, len(ROLES))
        if len(kinds) < len(KINDS):
            wrong |= ~member(f.bk[gb], kinds, len(KINDS))
        if op == RECV:
            wrong |= f.bpeer[gb] != f.x[T_SRC][sel]
        bad = first(wrong)
        if bad is not None:
            want = "a receive buffer of its block from its source" if op == RECV else "a buffer of its block"
            fail(5, f"device {dev[bad]} {f.name}: {transfer_key(f.prog, ts[bad], f.tmsg)} names {side} buffer "
                    f"{f.describe(gb[bad])}; it must be {want}")


# ------------------------------------------------------------------------------------ pairing and order

def _first_duplicate(keys: np.ndarray, n: int) -> tuple[int, int] | None:
    """Positions (first, second) in ``keys`` (ints in ``[0, n)``) of the
    first key that occurs twice (a count, O(len + n); positions only on failure)."""
    counts = np.bincount(keys, minlength=n)
    dup = first(counts > 1)
    if dup is None:
        return None
    at = np.flatnonzero(keys == dup)
    return int(at[0]), int(at[1])


def check_pairing(f: PhaseView) -> np.ndarray:
    """Every message of this phase is sent once, received once and waited
    once by each side. Returns ``wait_at[msg, side]``: the stream index of
    each side's wait (side 0 the sender, 1 the receiver)."""
    nm = len(f.m[M_PHASE])
    mine = f.m[M_PHASE] == f.phase
    for op, verb, missing in ((SEND, "sent", "received but never sent"), (RECV, "received", "sent but never received")):
        t = f.operand(op, "msg")
        dup = _first_duplicate(t, nm)
        if dup is not None:
            a, b = f.rows(op)[list(dup)]
            fail(5, f"{message_key(f.prog, t[dup[0]])} is {verb} twice (devices {f.dev[a]} and {f.dev[b]})")
        miss = first(mine & (np.bincount(t, minlength=nm) == 0))
        if miss is not None:
            fail(5, f"{message_key(f.prog, miss)} is {missing}")
    t = f.operand(WAIT, "msg")
    side = (f.m[M_DST][t] == f.devs(WAIT)).astype(np.int64)
    dup = _first_duplicate(t * 2 + side, 2 * nm)
    if dup is not None:
        f.fail(5, f.rows(WAIT)[dup[1]], f"waits on {message_key(f.prog, t[dup[0]])} twice")
    wait_at = np.full((nm, 2), NEVER, np.int64)
    wait_at[t, side] = f.index(WAIT)
    miss = first((mine[:, None] & (wait_at == NEVER)).ravel())
    if miss is not None:
        msg, sd = divmod(miss, 2)
        fail(5, f"{message_key(f.prog, msg)}: the {'sender' if sd == 0 else 'receiver'} never waits on it")
    return wait_at


def check_pair_order(f: PhaseView) -> None:
    """For every ordered pair of devices (a, b), the messages a sends to b
    and the messages b receives from a are posted in the same order: a
    transport that matches messages by posting order alone (NCCL) pairs
    them right. (Messages are sent and received once each: check_pairing.)"""
    n, nm = f.prog.devices, len(f.m[M_PHASE])
    ranks = []
    for op, pair in ((SEND, f.devs(SEND) * n + f.operand(SEND, "dst")),
                     (RECV, f.operand(RECV, "src") * n + f.devs(RECV))):
        order = np.argsort(pair, kind="stable")  # rows are in stream order within each device
        rank = np.empty(len(pair), np.int64)
        rank[order] = np.arange(len(pair)) - np.searchsorted(pair[order], pair[order], side="left")
        at = np.full(nm, -1, np.int64)
        at[f.operand(op, "msg")] = rank
        ranks.append(at)
    msg = f.operand(SEND, "msg")
    bad = first(ranks[0][msg] != ranks[1][msg])
    if bad is not None:
        m = int(msg[bad])
        a, b = int(f.m[M_SRC][m]), int(f.m[M_DST][m])
        f.fail(5, f.rows(SEND)[bad], f"sends {message_key(f.prog, m)} as its message #{ranks[0][m]} to d{b}, but d{b} "
                                     f"posts its receive as #{ranks[1][m]} from d{a}: sends and receives between two "
                                     f"devices must be posted in the same order")


def ready_times(f: PhaseView, wait_at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per global buffer: the stream index after which it holds data (home:
    −1; received: the receiver's wait of its message; partial: its first
    write by a compute instruction; never: NEVER), and the index of its last
    write by a compute, merge or add instruction (−1: none). A buffer is
    received into at most once."""
    ready = np.full(len(f.B), NEVER, np.int64)
    ready[(f.brole == HOME) | (f.brole == KEPT)] = -1  # a kept block holds the forward's data (check_kept)
    ts, sel = f.ts, f.tsel
    gb = f.boff[f.x[T_DST][sel]] + f.x[T_RBUF][sel]
    dup = _first_duplicate(gb, len(f.B))
    if dup is not None:
        a, b = ts[list(dup)]
        fail(5, f"device {f.bdev[gb[dup[0]]]} {f.name}: receives into %{f.local(gb[dup[0]])} twice "
                f"({transfer_key(f.prog, a, f.tmsg)} and {transfer_key(f.prog, b, f.tmsg)})")
    ready[gb] = wait_at[f.tmsg[sel], 1]
    first_w = np.full(len(f.B), NEVER, np.int64)
    last_w = np.full(len(f.B), -1, np.int64)
    for op in (ATTN, ATTN_BWD, MERGE, ADD):  # a partial holds data from its first compute write on
        for i in ISA[op].writes:
            w = f.buffer(op, ISA[op].operands[i])
            if op in (ATTN, ATTN_BWD):
                np.minimum.at(first_w, w, f.index(op))
            np.maximum.at(last_w, w, f.index(op))
    part = f.brole == PART
    ready[part] = first_w[part]
    return ready, last_w


def _sent(f: PhaseView) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per transfer of this phase: the global buffer its send packs, and the
    stream index and row of its message's send on the source."""
    def make():
        sel = f.tsel
        gb = f.boff[f.x[T_SRC][sel]] + f.x[T_SBUF][sel]
        at = np.full(len(f.m[M_PHASE]), NEVER, np.int64)
        row = np.zeros(len(f.m[M_PHASE]), np.int64)
        msg = f.operand(SEND, "msg")
        at[msg], row[msg] = f.index(SEND), f.rows(SEND)
        m = f.tmsg[sel]
        return gb, at[m], row[m]
    return f._cached("sent", make)


def check_order(f: PhaseView, ready: np.ndarray, last_w: np.ndarray) -> None:
    """Every read (per :data:`ISA`, and a send's read of its message's source
    buffers) comes after its buffer holds data, and a sent partial is not
    written after its send; the earliest offending instruction of the
    earliest device is named."""
    errors = []  # (row, invariant, message)
    for s in ISA:
        for i in s.reads:
            name = s.operands[i]
            gb = f.buffer(s.code, name)
            bad = first(ready[gb] >= f.index(s.code))
            if bad is None:
                continue
            b = f.local(gb[bad])
            if s.code in (MERGE, ADD) and name == "dst":
                msg = f"merges into partial %{b} before this device computed any of it"
            elif s.code in (MERGE, ADD):
                msg = f"merges %{b} before its receive completed"
            else:
                msg = f"{name.upper()} %{b} is read before its receive completed"
            errors.append((int(f.rows(s.code)[bad]), 3, msg))
    gb, at, row = _sent(f)
    bad = first(ready[gb] >= at)
    if bad is not None:
        errors.append((int(row[bad]), 3, f"sends %{f.local(gb[bad])} before it holds data (it travels in "
                                         f"{message_key(f.prog, f.tmsg[f.ts[bad]])})"))
    bad = first(last_w[gb] > at)
    if bad is not None:
        last = int(row[bad] - at[bad] + last_w[gb[bad]])  # the last write, on the same device
        errors.append((last, 4, f"%{f.local(gb[bad])} is written after it was sent (a partial must be final when "
                                f"sent)"))
    if errors:
        r, inv, msg = min(errors, key=lambda e: e[0])
        f.fail(inv, r, msg)


def check_partials(f: PhaseView, ready: np.ndarray) -> None:
    """A partial is sent exactly once; a received partial is merged exactly
    once; every receive buffer is received into."""
    nb = len(f.B)
    src = np.concatenate([f.buffer(MERGE, "src"), f.buffer(ADD, "src")])
    rows = np.concatenate([f.rows(MERGE), f.rows(ADD)])
    merged = np.bincount(src, minlength=nb)
    bad = first(merged > 1)
    if bad is not None:
        f.fail(4, rows[src == bad][1], f"merges partial %{f.local(bad)} twice")
    sent = np.bincount(_sent(f)[0], minlength=nb)

    def what(b: int) -> str:
        return f"{KINDS[f.bk[b]]}[tb{f.btb[b]},hg{f.bhg[b]}] (%{f.local(b)})"

    bad = first((f.brole == PART) & (sent != 1))
    if bad is not None:
        fail(4, f"device {f.bdev[bad]} {f.name}: partial {what(bad)} is sent {sent[bad]} times, not once")
    partial_kind = (f.bk == B_O) | (f.bk == B_DQ) | (f.bk == B_DKV)
    bad = first((f.brole == RECVD) & partial_kind & (merged != 1))
    if bad is not None:
        fail(4, f"device {f.bdev[bad]} {f.name}: received partial {what(bad)} is merged {merged[bad]} times")
    bad = first((f.brole == RECVD) & (ready == NEVER))
    if bad is not None:
        fail(5, f"device {f.bdev[bad]} {f.name}: receive into %{f.local(bad)} never completes")


def check_runs_once(g, pl, f: PhaseView) -> None:
    """Every compute block runs exactly once in this phase (invariant 2)."""
    op = ATTN if f.phase == FWD else ATTN_BWD
    c = f.operand(op, "cb")
    dup = _first_duplicate(c, g.n_cb)
    if dup is not None:
        f.fail(2, f.rows(op)[dup[1]], f"runs c{c[dup[0]]} a second time")
    m = first(np.bincount(c, minlength=g.n_cb) != 1)
    if m is not None:
        fail(2, f"compute block c{m} (q=tb{g.cb_q[m]}, kv=tb{g.cb_k[m]}, hg{g.cb_hg[m]}) on "
                f"d{pl.cb_device[m]} never runs in {f.name}")


# ------------------------------------------------------------------------------------ entry points

def verify_phase(g, pl, prog: Program, phase: int, memory_cap: int | None = None,
                 tmsg: np.ndarray | None = None, XT: np.ndarray | None = None) -> None:
    """Invariants 2-6 for one phase of a program, over all devices at once
    (``tmsg``: the message of every transfer, from :func:`check_messages`;
    ``XT``: the transfer table's columns)."""
    f = PhaseView(prog, phase, tmsg, XT)
    check_buffers(g, pl, f, memory_cap)
    check_opcodes(f)
    check_operand_ids(g, pl, f)
    check_buffer_kinds(f)
    check_compute_operands(g, f)
    check_merge_operands(f)
    check_message_operands(f)
    wait_at = check_pairing(f)
    check_pair_order(f)
    ready, last_w = ready_times(f, wait_at)
    check_order(f, ready, last_w)
    check_partials(f, ready)
    check_runs_once(g, pl, f)
    try:
        check_deadlock_free(prog, phase, streams=(f.op, f.arg[0], f.dev, f.start))
    except DeadlockError as e:
        raise VerifyError(f"invariant 5: {e}") from None


def verify_program(g, pl, prog: Program, memory_cap: int | None = None) -> None:
    """Every check of this module, both phases (see the module doc)."""
    if prog.devices != pl.devices:
        fail(5, f"program has {prog.devices} devices, placement {pl.devices}")
    check_shapes(prog)
    XT = np.ascontiguousarray(prog.transfers.T)  # one transposing copy: every column contiguous
    check_transfers(g, prog, XT)
    tmsg = check_messages(prog, XT)
    for phase in (FWD, BWD):
        verify_phase(g, pl, prog, phase, memory_cap, tmsg, XT)
    check_kept(g, prog)
