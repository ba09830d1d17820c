"""Program: one instruction stream and one buffer table per device and phase,
and the messages that travel between devices.

Columnar: each stream is an int64 array ``[n, 6]``; column :data:`OP` holds
the opcode and columns :data:`A1` .. :data:`A5` its operands (unused ones are
0). The instruction set is one table, :data:`ISA`: per opcode its name, its
operands (name and what each one names: a message, a peer device, a buffer
or a compute block), which buffers it reads and writes, the kind and role
each buffer operand must have, and the phases it is legal in. The text form,
the parser, :data:`OPS`, :data:`N_OPERANDS` and the verifier's operand checks
are all derived from it (the table is printed at the end of this docstring).

Communication is by *message*: every block that moves between two devices
is a *transfer* (a row of ``transfers``: kind, token block, head group,
source, destination, bytes, and the buffer it is packed from on the source
and unpacked into on the destination), and the transfers that travel between
the same two devices in the same phase and stage form one message (a row of
``messages``: its transfers are the contiguous range ``[start, end)`` of the
transfer table, a CSR index; its bytes are theirs summed). ``send``,
``recv`` and ``wait`` name a message: the sender packs the source buffers of
its transfers into one contiguous buffer, in transfer order; the receiver
gets one buffer and views it as the receive buffers of its transfers.

A message completes only when both its send and its receive are posted
(rendezvous semantics, as NCCL), so a symbolic run that never blocks proves
the absence of deadlock on any transport. Between two devices, sends and
receives are posted in the same order (per phase, per ordered pair), so a
transport may match them by posting order alone, as NCCL does.

Buffers are rows ``(kind, tb, hg, role, peer, bytes)``; ``kind`` is Q, KV, O,
dQ or dKV of token block ``tb`` and head group ``hg``; ``role`` is ``home``
(the device owns it), ``recv`` (received from ``peer``), ``part`` (a partial
result computed here for another device's home) or, backward only, ``kept``
(a KV block this device received in the forward and kept: ``peer`` is that
forward receive buffer's index on the same device; ``Problem.keep_kv``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import AttnplanError, PlanError, PlanFileError
from .limits import MAX_DEVICES

FWD, BWD = 0, 1
PHASES = ("fwd", "bwd")
B_Q, B_KV, B_O, B_DQ, B_DKV = range(5)
KINDS = ("Q", "KV", "O", "dQ", "dKV")
HOME, RECVD, PART, KEPT = range(4)
ROLES = ("home", "recv", "part", "kept")
# transfer columns: the block, its route, its bytes, its buffer on the source and on the destination
T_TAG, T_PHASE, T_KIND, T_TB, T_HG, T_SRC, T_DST, T_BYTES, T_SBUF, T_RBUF = range(10)
T_COLS = 10
# message columns: its transfers are rows [start, end) of the transfer table
M_ID, M_PHASE, M_SRC, M_DST, M_START, M_END, M_BYTES = range(7)
M_COLS = 7
# buffer columns
BK, BTB, BHG, BROLE, BPEER, BBYTES = range(6)
# instruction columns: the opcode, then operands 1..5
OP, A1, A2, A3, A4, A5 = range(6)
ARG_COLS = (A1, A2, A3, A4, A5)
# what an operand names
ARG_MSG, ARG_PEER, ARG_BUF, ARG_CB = range(4)
ARG_NAMES = ("message", "device", "buffer", "compute block")
ARG_PREFIX = ("m", "d", "%", "c")  # the text form of each kind: m3, d1, %7, c12
# buffer kinds legal in each phase (forward: q, k/v, out/lse; backward: the q bundle, k/v and the gradients)
PHASE_KINDS = ((B_Q, B_KV, B_O), (B_Q, B_KV, B_DQ, B_DKV))
_ANY_KIND = (B_Q, B_KV, B_O, B_DQ, B_DKV)
_ANY_ROLE = (HOME, RECVD, PART)


@dataclass(frozen=True, slots=True)
class OpSpec:
    """One opcode of the instruction set.

    ``operands`` and ``args`` name each operand and say what it names
    (``ARG_*``); ``reads`` / ``writes`` are positions (0-based, into
    ``operands``) of the buffers whose data the instruction reads / writes;
    ``kinds`` / ``roles`` give, per buffer operand, the buffer kinds and roles
    it may have (``None`` for operands that are not buffers)."""

    code: int
    name: str
    operands: tuple
    args: tuple
    reads: tuple
    writes: tuple
    kinds: tuple
    roles: tuple
    phases: tuple
    meaning: str

    def col(self, operand: str) -> int:
        """The code column of the operand called ``operand``."""
        return ARG_COLS[self.operands.index(operand)]

    def cols(self, arg: int) -> tuple:
        """The code columns of every operand that names an ``arg`` (``ARG_*``)."""
        return tuple(ARG_COLS[i] for i, a in enumerate(self.args) if a == arg)


RECV, SEND, WAIT, ATTN, MERGE, ATTN_BWD, ADD = range(7)
_BOTH = (FWD, BWD)
ISA = (
    OpSpec(RECV, "recv", ("msg", "src"), (ARG_MSG, ARG_PEER), (), (), (None, None), (None, None), _BOTH,
           "post the receive of message ``msg`` from ``src``: one buffer, viewed as the receive buffers of its "
           "transfers (:data:`MSG_BUFFERS`; they hold data after the wait)"),
    OpSpec(SEND, "send", ("msg", "dst"), (ARG_MSG, ARG_PEER), (), (), (None, None), (None, None), _BOTH,
           "post the send of message ``msg`` to ``dst``: the source buffers of its transfers packed into one "
           "(unchanged until the wait)"),
    OpSpec(WAIT, "wait", ("msg",), (ARG_MSG,), (), (), (None,), (None,), _BOTH,
           "block until message ``msg`` completed (both sides posted)"),
    OpSpec(ATTN, "attn", ("cb", "q", "kv", "o"), (ARG_CB, ARG_BUF, ARG_BUF, ARG_BUF), (1, 2), (3,),
           (None, (B_Q,), (B_KV,), (B_O,)), (None, (HOME, RECVD), (HOME, RECVD), (HOME, PART)), (FWD,),
           "o ⊕= attention(q, kv) over compute block ``cb`` (online softmax)"),
    OpSpec(MERGE, "merge", ("dst", "src"), (ARG_BUF, ARG_BUF), (0, 1), (0,),
           ((B_O,), (B_O,)), ((HOME, PART), (RECVD,)), (FWD,),
           "dst ⊕= src: a received partial output into its home, or into this device's own partial of the block "
           "(a node reduce's aggregator; online-softmax merge, fp32)"),
    OpSpec(ATTN_BWD, "attn_bwd", ("cb", "q", "kv", "dq", "dkv"), (ARG_CB, ARG_BUF, ARG_BUF, ARG_BUF, ARG_BUF),
           (1, 2), (3, 4), (None, (B_Q,), (B_KV,), (B_DQ,), (B_DKV,)),
           (None, (HOME, RECVD), (HOME, RECVD, KEPT), (HOME, PART), (HOME, PART)), (BWD,),
           "dq += ∂q, dkv += ∂kv of compute block ``cb``"),
    OpSpec(ADD, "add", ("dst", "src"), (ARG_BUF, ARG_BUF), (0, 1), (0,),
           ((B_DQ, B_DKV), (B_DQ, B_DKV)), ((HOME, PART), (RECVD,)), (BWD,),
           "dst += src: a received partial gradient into its home, or into this device's own partial of the "
           "block (a node reduce's aggregator; fp32)"),
)
if tuple(s.code for s in ISA) != tuple(range(len(ISA))):  # pragma: no cover - the table is ordered by opcode
    raise ImportError("attnplan.ir.program: ISA rows must be ordered by opcode")

# the buffers a message's send reads and its receive writes: per transfer (column, the kinds and roles the
# buffer may have); the verifier checks them as it checks the buffer operands of the ISA
MSG_BUFFERS = {SEND: (T_SBUF, _ANY_KIND, _ANY_ROLE), RECV: (T_RBUF, _ANY_KIND, (RECVD,))}

OPS = tuple(s.name for s in ISA)
N_OPERANDS = tuple(len(s.operands) for s in ISA)
OP_BY_NAME = {s.name: s for s in ISA}
# OP_PHASE[op, phase]: the opcode is legal in that phase
OP_PHASE = np.array([[ph in s.phases for ph in (FWD, BWD)] for s in ISA], dtype=bool)
OP_PHASE.setflags(write=False)


def _isa_doc() -> str:
    rows = [(s.name, ", ".join(s.operands), " / ".join(PHASES[p] for p in s.phases), s.meaning) for s in ISA]
    w = [max(len(r[i]) for r in rows + [("opcode", "operands", "phases", "")]) for i in range(3)]
    rule = "  ".join("=" * x for x in w) + "  " + "=" * 40
    lines = ["", "Instruction set (from :data:`ISA`):", "", rule,
             "  ".join(h.ljust(x) for h, x in zip(("opcode", "operands", "phases"), w)) + "  meaning", rule]
    lines += ["  ".join(c.ljust(x) for c, x in zip(r[:3], w)) + "  " + r[3] for r in rows]
    return "\n".join(lines + [rule, ""])


__doc__ = (__doc__ or "") + _isa_doc()


def buffer_bytes(g, phase: int, kind: int, tb, hg, wire: bool = False) -> np.ndarray:
    """Bytes of buffers of ``kind`` for token blocks ``tb`` and head groups ``hg`` of the
    BlockGraph ``g``: Q/KV in the problem dtype, O/dQ/dKV and lse in fp32; the
    backward Q bundle is (q, out, dout, lse). ``wire``: as a transfer and its
    receive buffer carry it — a partial output's out, dQ or dK/dV in the
    problem's ``partials_dtype`` (its lse in fp32), the rest as stored."""
    p = g.problem
    rows = g.tb_len[tb]
    hkv = g.hg_end[hg] - g.hg_start[hg]  # (virtual) kv heads: copies travel and are stored as such
    hq = hkv * g.group
    d, es = p.head_dim, p.dtype_bytes
    ps = p.partial_bytes if wire else 4
    if kind == B_Q:
        per = hq * d * es if phase == FWD else hq * (3 * d * es + 4)
    elif kind == B_KV:
        per = 2 * hkv * d * es
    elif kind == B_O:
        per = hq * (ps * d + 4)
    elif kind == B_DQ:
        per = hq * d * ps
    else:
        per = 2 * hkv * d * ps
    return (rows * per).astype(np.int64)


def _frozen(a, cols: int, what: str) -> np.ndarray:
    try:
        a = np.ascontiguousarray(np.asarray(a, dtype=np.int64)).reshape(-1, cols)
    except (TypeError, ValueError, OverflowError) as e:
        raise PlanError(f"program: {what} is not an int64 table of {cols} columns ({e})") from None
    a.setflags(write=False)
    return a


def _per_device(levels, devices: int, cols: int, what: str) -> tuple:
    if not isinstance(levels, (tuple, list)) or len(levels) != 2 \
            or any(not isinstance(ph, (tuple, list)) or len(ph) != devices for ph in levels):
        raise PlanError(f"program: {what} must be 2 phases x {devices} devices")
    return tuple(tuple(_frozen(x, cols, f"{what}[{p}][{d}]") for d, x in enumerate(ph))
                 for p, ph in enumerate(levels))


@dataclass(frozen=True, slots=True, eq=False)
class Program:
    """``transfers``: int64 ``[n, 10]`` rows ``(tag, phase, kind, tb, hg, src,
    dst, bytes, sbuf, rbuf)`` (``sbuf``: the buffer on ``src`` it is packed
    from, ``rbuf``: the buffer on ``dst`` it is unpacked into). ``messages``:
    int64 ``[m, 7]`` rows ``(id, phase, src, dst, start, end, bytes)``, the
    message's transfers being rows ``start..end-1``. ``buffers[phase][device]``:
    ``[nb, 6]``. ``code[phase][device]``: ``[n, 6]``."""

    devices: int
    transfers: np.ndarray
    buffers: tuple
    code: tuple
    messages: np.ndarray

    def __post_init__(self):
        n = self.devices
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= MAX_DEVICES:
            raise PlanError(f"program: devices must be an integer in [1, {MAX_DEVICES}] (MAX_DEVICES), got {n!r}")
        object.__setattr__(self, "devices", int(n))
        object.__setattr__(self, "transfers", _frozen(self.transfers, T_COLS, "transfers"))
        object.__setattr__(self, "buffers", _per_device(self.buffers, n, 6, "buffers"))
        object.__setattr__(self, "code", _per_device(self.code, n, 6, "code"))
        object.__setattr__(self, "messages", _frozen(self.messages, M_COLS, "messages"))

    def __eq__(self, other) -> bool:
        if not isinstance(other, Program) or other.devices != self.devices:
            return False
        if not np.array_equal(self.transfers, other.transfers) or not np.array_equal(self.messages, other.messages):
            return False
        return all(np.array_equal(a, b) for pa, pb in zip(self.buffers + self.code, other.buffers + other.code)
                   for a, b in zip(pa, pb))

    __hash__ = None  # type: ignore[assignment]  # arrays inside: not hashable

    def n_instructions(self) -> int:
        return sum(len(c) for ph in self.code for c in ph)

    def kept_bytes(self) -> np.ndarray:
        """Per device: bytes of the KV blocks its backward keeps from its forward (``kept`` buffers)."""
        return np.array([int(b[b[:, BROLE] == KEPT, BBYTES].sum()) for b in self.buffers[BWD]], np.int64)

    def transfer_message(self) -> np.ndarray:
        """The message of every transfer (from the CSR index; the message table must be well formed)."""
        M = self.messages
        counts = np.maximum(M[:, M_END] - M[:, M_START], 0)
        out = np.full(len(self.transfers), -1, np.int64)
        if len(M) and counts.sum() == len(self.transfers):
            out[:] = np.repeat(np.arange(len(M), dtype=np.int64), counts)
        return out

    # text form ---------------------------------------------------------------
    def to_text(self, device: int | None = None) -> str:
        out = [f"program devices={self.devices}"]
        for m in self.messages.tolist():
            if device is None or device in (m[M_SRC], m[M_DST]):
                out.append(format_message(m))
        for t in self.transfers.tolist():
            if device is None or device in (t[T_SRC], t[T_DST]):
                out.append(format_transfer(t))
        for ph in (FWD, BWD):
            for d in range(self.devices):
                if device is not None and d != device:
                    continue
                out.append(f"device {d} {PHASES[ph]}")
                for i, row in enumerate(self.buffers[ph][d].tolist()):
                    out.append(f"  buffer %{i} " + format_buffer(row))
                for row in self.code[ph][d].tolist():
                    out.append("  " + format_instr(row))
        return "\n".join(out) + "\n"

    @staticmethod
    def from_text(text: str) -> Program:
        return parse_program(text)


def format_message(m) -> str:
    return (f"message m{m[M_ID]} {PHASES[m[M_PHASE]]} d{m[M_SRC]}->d{m[M_DST]} t{m[M_START]}:t{m[M_END]} "
            f"{m[M_BYTES]}")


def format_transfer(t) -> str:
    return (f"transfer t{t[T_TAG]} {PHASES[t[T_PHASE]]} {KINDS[t[T_KIND]]} tb={t[T_TB]} hg={t[T_HG]} "
            f"d{t[T_SRC]}->d{t[T_DST]} {t[T_BYTES]} %{t[T_SBUF]}->%{t[T_RBUF]}")


def format_buffer(b) -> str:
    src = f" d{b[BPEER]}" if b[BROLE] == RECVD else f" %{b[BPEER]}" if b[BROLE] == KEPT else ""
    return f"{KINDS[b[BK]]} tb={b[BTB]} hg={b[BHG]} {ROLES[b[BROLE]]}{src} {b[BBYTES]}"


def format_instr(row) -> str:
    """The text of one instruction row (operands spelled by what they name, e.g. ``attn c3 %0 %4 %7``)."""
    op = row[OP]
    if not 0 <= op < len(ISA):
        return f"<opcode {op}> " + " ".join(str(x) for x in row[1:])
    s = ISA[op]
    return " ".join([s.name] + [f"{ARG_PREFIX[a]}{row[c]}" for a, c in zip(s.args, ARG_COLS)])


# parsing ---------------------------------------------------------------------

_MAX_DIGITS = 19  # int64 has at most 19 decimal digits
_I64 = 1 << 63


def _num(tok: str, prefix: str, lineno: int) -> int:
    """The integer after ``prefix`` in ``tok``; it must fit int64 (checked before converting)."""
    body = tok[len(prefix):] if tok.startswith(prefix) else ""
    digits = body[1:] if body.startswith("-") else body
    if not digits or not digits.isascii() or not digits.isdigit():
        raise PlanFileError(f"program text line {lineno}: expected {prefix}<int>, got {tok[:40]!r}")
    if len(digits.lstrip("0")) > _MAX_DIGITS or not -_I64 <= int(body) < _I64:
        raise PlanFileError(f"program text line {lineno}: {tok[:40]!r} does not fit a 64-bit integer")
    return int(body)


def _word(tok: str, names: tuple, what: str, lineno: int) -> int:
    if tok not in names:
        raise PlanFileError(f"program text line {lineno}: unknown {what} {tok[:40]!r}; expected one of "
                            f"{', '.join(names)}")
    return names.index(tok)


def _arity(w: list, n, lineno: int, form: str) -> None:
    if len(w) not in ((n,) if isinstance(n, int) else n):
        raise PlanFileError(f"program text line {lineno}: expected '{form}'")


def _pair(tok: str, sep: str, prefix: str, no: int) -> tuple[int, int]:
    """``<prefix>a<sep><prefix>b`` as (a, b)."""
    a, mid, b = tok.partition(sep)
    if not mid:
        raise PlanFileError(f"program text line {no}: expected {prefix}<n>{sep}{prefix}<n>, got {tok[:40]!r}")
    return _num(a, prefix, no), _num(b, prefix, no)


def _parse_message(w: list, no: int) -> list:
    _arity(w, 6, no, "message m<id> <phase> d<src>->d<dst> t<start>:t<end> <bytes>")
    src, dst = _pair(w[3], "->", "d", no)
    start, end = _pair(w[4], ":", "t", no)
    return [_num(w[1], "m", no), _word(w[2], PHASES, "phase", no), src, dst, start, end, _num(w[5], "", no)]


def _parse_transfer(w: list, no: int) -> list:
    _arity(w, 9, no, "transfer t<tag> <phase> <kind> tb=<n> hg=<n> d<src>->d<dst> <bytes> %<sbuf>->%<rbuf>")
    src, dst = _pair(w[6], "->", "d", no)
    sbuf, rbuf = _pair(w[8], "->", "%", no)
    return [_num(w[1], "t", no), _word(w[2], PHASES, "phase", no), _word(w[3], KINDS, "kind", no),
            _num(w[4], "tb=", no), _num(w[5], "hg=", no), src, dst, _num(w[7], "", no), sbuf, rbuf]


def _parse_buffer(w: list, index: int, no: int) -> list:
    _arity(w, (7, 8), no, "buffer %<i> <kind> tb=<n> hg=<n> <role> [d<src> | %<forward buffer>] <bytes>")
    if _num(w[1], "%", no) != index:
        raise PlanFileError(f"program text line {no}: buffers must be numbered in order (expected %{index})")
    role = _word(w[5], ROLES, "role", no)
    if (len(w) == 8) != (role in (RECVD, KEPT)):
        raise PlanFileError(f"program text line {no}: only a 'recv' buffer names its source device and only a "
                            f"'kept' one its forward buffer")
    peer = _num(w[6], "d" if role == RECVD else "%", no) if len(w) == 8 else -1
    return [_word(w[2], KINDS, "kind", no), _num(w[3], "tb=", no), _num(w[4], "hg=", no), role, peer,
            _num(w[-1], "", no)]


def _parse_instr(w: list, no: int) -> list:
    s = OP_BY_NAME.get(w[0])
    if s is None:
        raise PlanFileError(f"program text line {no}: unknown instruction {w[0][:40]!r}; expected one of "
                            f"{', '.join(OPS)} (or message, transfer, device, buffer)")
    _arity(w, 1 + len(s.operands), no, " ".join([s.name] + [f"{ARG_PREFIX[a]}<{n}>" for a, n in
                                                           zip(s.args, s.operands)]))
    args = [_num(tok, ARG_PREFIX[a], no) for tok, a in zip(w[1:], s.args)]
    return [s.code] + args + [0] * (len(ARG_COLS) - len(args))


def _parse_header(w: list, no: int) -> int:
    _arity(w, 2, no, "program devices=<n>")
    n = _num(w[1], "devices=", no)
    if not 1 <= n <= MAX_DEVICES:
        raise PlanFileError(f"program text line {no}: devices={n} is outside [1, {MAX_DEVICES}] (MAX_DEVICES)")
    return n


def _parse_section(w: list, devices: int, seen: dict, no: int) -> tuple:
    _arity(w, 3, no, "device <d> <phase>")
    d, ph = _num(w[1], "", no), _word(w[2], PHASES, "phase", no)
    if not 0 <= d < devices:
        raise PlanFileError(f"program text line {no}: device {d} does not exist (devices={devices})")
    if (ph, d) in seen:
        raise PlanFileError(f"program text line {no}: a second section for device {d} {PHASES[ph]}")
    seen[(ph, d)] = ([], [])
    return seen[(ph, d)]


def parse_program(text: str) -> Program:
    """Inverse of :meth:`Program.to_text` (for the whole program). Anything
    malformed raises :class:`PlanFileError` naming the line."""
    if not isinstance(text, str):
        raise PlanFileError(f"program text must be a str, got {type(text).__name__}")
    devices = None
    transfers: list = []
    messages: list = []
    sections: dict = {}
    cur = None
    for no, ln in enumerate(text.splitlines(), 1):
        w = ln.split("#", 1)[0].split()
        if not w:
            continue
        if devices is None:
            if w[0] != "program":
                raise PlanFileError(f"program text line {no}: expected the header 'program devices=<n>' first")
            devices = _parse_header(w, no)
        elif w[0] == "transfer":
            transfers.append(_parse_transfer(w, no))
        elif w[0] == "message":
            messages.append(_parse_message(w, no))
        elif w[0] == "device":
            cur = _parse_section(w, devices, sections, no)
        elif cur is None:
            raise PlanFileError(f"program text line {no}: {w[0][:40]!r} outside a device section")
        elif w[0] == "buffer":
            cur[0].append(_parse_buffer(w, len(cur[0]), no))
        else:
            cur[1].append(_parse_instr(w, no))
    if devices is None:
        raise PlanFileError("program text: missing 'program devices=N' header")
    empty: tuple[list, list] = ([], [])
    bufs = tuple(tuple(sections.get((ph, d), empty)[0] for d in range(devices)) for ph in (FWD, BWD))
    cds = tuple(tuple(sections.get((ph, d), empty)[1] for d in range(devices)) for ph in (FWD, BWD))
    try:
        return Program(devices, np.asarray(transfers, np.int64).reshape(-1, T_COLS), bufs, cds,
                       np.asarray(messages, np.int64).reshape(-1, M_COLS))
    except AttnplanError as e:
        raise PlanFileError(f"program text: {e}") from None
