"""Program: one instruction stream and one buffer table per device and phase.

Columnar: each stream is an int64 array ``[n, 6]`` of ``(op, a, b, c, d, e)``.

========  ==============================  ===========================================
op        operands                        meaning
========  ==============================  ===========================================
recv      tag, src, buf                   post a receive of transfer ``tag`` into ``buf``
send      tag, dst, buf                   post a send of ``buf``
wait      tag                             block until transfer ``tag`` completed
attn      cb, q, kv, o                    o ⊕= attention(q, kv) over compute block cb
merge     dst, src                        dst ⊕= src (online-softmax merge, fp32)
attn_bwd  cb, q, kv, dq, dkv              dq += ∂q, dkv += ∂kv of compute block cb
add       dst, src                        dst += src (fp32)
========  ==============================  ===========================================

A transfer completes only when both its send and its receive are posted
(rendezvous semantics, as NCCL), so a symbolic run that never blocks proves
the absence of deadlock on any transport.

Buffers are rows ``(kind, tb, hg, role, peer, bytes)``; ``kind`` is Q, KV, O,
dQ or dKV of token block ``tb`` and head group ``hg``; ``role`` is ``home``
(the device owns it), ``recv`` (received from ``peer``) or ``part`` (a partial
result computed here for another device's home).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import PlanFileError

FWD, BWD = 0, 1
PHASES = ("fwd", "bwd")
RECV, SEND, WAIT, ATTN, MERGE, ATTN_BWD, ADD = range(7)
OPS = ("recv", "send", "wait", "attn", "merge", "attn_bwd", "add")
N_OPERANDS = (3, 3, 1, 4, 2, 5, 2)
B_Q, B_KV, B_O, B_DQ, B_DKV = range(5)
KINDS = ("Q", "KV", "O", "dQ", "dKV")
HOME, RECVD, PART = range(3)
ROLES = ("home", "recv", "part")
# transfer columns
T_TAG, T_PHASE, T_KIND, T_TB, T_HG, T_SRC, T_DST, T_BYTES = range(8)
# buffer columns
BK, BTB, BHG, BROLE, BPEER, BBYTES = range(6)


def buffer_bytes(g, phase: int, kind: int, tb, hg) -> np.ndarray:
    """Bytes of buffers of ``kind`` for token blocks ``tb`` and head groups ``hg`` of the
    BlockGraph ``g``: Q/KV in the problem dtype, O/dQ/dKV and lse in fp32; the
    backward Q bundle is (q, out, dout, lse)."""
    p = g.problem
    rows = g.tb_len[tb]
    hkv = g.hg_end[hg] - g.hg_start[hg]
    hq = hkv * p.group
    d, es = p.head_dim, p.dtype_bytes
    if kind == B_Q:
        per = hq * d * es if phase == FWD else hq * (3 * d * es + 4)
    elif kind == B_KV:
        per = 2 * hkv * d * es
    elif kind == B_O:
        per = hq * (4 * d + 4)
    elif kind == B_DQ:
        per = hq * d * 4
    else:
        per = 2 * hkv * d * 4
    return (rows * per).astype(np.int64)


def _frozen(a) -> np.ndarray:
    a = np.ascontiguousarray(np.asarray(a, dtype=np.int64))
    a.setflags(write=False)
    return a


@dataclass(frozen=True, slots=True, eq=False)
class Program:
    """``transfers``: int64 ``[n, 8]`` rows ``(tag, phase, kind, tb, hg, src,
    dst, bytes)``. ``buffers[phase][device]``: ``[nb, 6]``. ``code[phase][device]``: ``[n, 6]``."""

    devices: int
    transfers: np.ndarray
    buffers: tuple
    code: tuple

    def __post_init__(self):
        object.__setattr__(self, "transfers", _frozen(self.transfers).reshape(-1, 8))
        object.__setattr__(self, "buffers", tuple(tuple(_frozen(b).reshape(-1, 6) for b in ph) for ph in self.buffers))
        object.__setattr__(self, "code", tuple(tuple(_frozen(c).reshape(-1, 6) for c in ph) for ph in self.code))

    def __eq__(self, other) -> bool:
        if not isinstance(other, Program) or other.devices != self.devices:
            return False
        if not np.array_equal(self.transfers, other.transfers):
            return False
        return all(np.array_equal(a, b) for pa, pb in zip(self.buffers + self.code, other.buffers + other.code)
                   for a, b in zip(pa, pb))

    __hash__ = None

    def n_instructions(self) -> int:
        return sum(len(c) for ph in self.code for c in ph)

    # text form ---------------------------------------------------------------
    def to_text(self, device: int | None = None) -> str:
        out = [f"program devices={self.devices}"]
        for t in self.transfers.tolist():
            if device is None or device in (t[T_SRC], t[T_DST]):
                out.append(f"transfer t{t[T_TAG]} {PHASES[t[T_PHASE]]} {KINDS[t[T_KIND]]} tb={t[T_TB]} "
                           f"hg={t[T_HG]} d{t[T_SRC]}->d{t[T_DST]} {t[T_BYTES]}")
        for ph in (FWD, BWD):
            for d in range(self.devices):
                if device is not None and d != device:
                    continue
                out.append(f"device {d} {PHASES[ph]}")
                for i, (k, tb, hg, role, peer, nbytes) in enumerate(self.buffers[ph][d].tolist()):
                    src = f" d{peer}" if role == RECVD else ""
                    out.append(f"  buffer %{i} {KINDS[k]} tb={tb} hg={hg} {ROLES[role]}{src} {nbytes}")
                for row in self.code[ph][d].tolist():
                    out.append("  " + format_instr(row))
        return "\n".join(out) + "\n"

    @staticmethod
    def from_text(text: str) -> "Program":
        return parse_program(text)


def format_instr(row) -> str:
    op = row[0]
    a = row[1:1 + N_OPERANDS[op]]
    if op in (RECV, SEND):
        return f"{OPS[op]} t{a[0]} d{a[1]} %{a[2]}"
    if op == WAIT:
        return f"wait t{a[0]}"
    if op in (ATTN, ATTN_BWD):
        return f"{OPS[op]} c{a[0]} " + " ".join(f"%{x}" for x in a[1:])
    return f"{OPS[op]} %{a[0]} %{a[1]}"


def _num(tok: str, prefix: str, lineno: int) -> int:
    if not tok.startswith(prefix) or not tok[len(prefix):].lstrip("-").isdigit():
        raise PlanFileError(f"program text line {lineno}: expected {prefix}<int>, got {tok!r}")
    return int(tok[len(prefix):])


def parse_program(text: str) -> Program:
    """Inverse of :meth:`Program.to_text` (for the whole program)."""
    lines = [ln.split("#", 1)[0].strip() for ln in text.splitlines()]
    devices = None
    transfers, cur = [], None
    buffers: dict = {}
    code: dict = {}
    for no, ln in enumerate(lines, 1):
        if not ln:
            continue
        w = ln.split()
        try:
            if w[0] == "program":
                devices = _num(w[1], "devices=", no)
            elif w[0] == "transfer":
                src, dst = w[6].split("->")
                transfers.append([_num(w[1], "t", no), PHASES.index(w[2]), KINDS.index(w[3]), _num(w[4], "tb=", no),
                                  _num(w[5], "hg=", no), _num(src, "d", no), _num(dst, "d", no), int(w[7])])
            elif w[0] == "device":
                cur = (PHASES.index(w[2]), _num(w[1], "", no))
                buffers[cur], code[cur] = [], []
            elif cur is None:
                raise PlanFileError(f"program text line {no}: {w[0]!r} outside a device section")
            elif w[0] == "buffer":
                if _num(w[1], "%", no) != len(buffers[cur]):
                    raise PlanFileError(f"program text line {no}: buffers must be numbered in order")
                role = ROLES.index(w[5])
                peer = _num(w[6], "d", no) if role == RECVD else -1
                buffers[cur].append([KINDS.index(w[2]), _num(w[3], "tb=", no), _num(w[4], "hg=", no), role, peer,
                                     int(w[-1])])
            else:
                op = OPS.index(w[0])
                args = []
                for tok in w[1:]:
                    args.append(int(tok.lstrip("tdc%")))
                if len(args) != N_OPERANDS[op]:
                    raise PlanFileError(f"program text line {no}: {w[0]} takes {N_OPERANDS[op]} operands")
                code[cur].append([op] + args + [0] * (5 - len(args)))
        except (ValueError, IndexError) as e:
            raise PlanFileError(f"program text line {no}: cannot parse {ln!r} ({e})") from None
    if devices is None:
        raise PlanFileError("program text: missing 'program devices=N' header")
    bufs = tuple(tuple(buffers.get((ph, d), []) for d in range(devices)) for ph in (FWD, BWD))
    cds = tuple(tuple(code.get((ph, d), []) for d in range(devices)) for ph in (FWD, BWD))
    return Program(devices, np.asarray(transfers, np.int64).reshape(-1, 8), bufs, cds)
