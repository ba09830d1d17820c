"""The per-device runner: executes one device's forward or backward stream.

Both executors use it: the in-process one (:mod:`attnplan.runtime.executor`,
every device in this process, an in-memory mailbox, driven by the
cooperative walk of :mod:`attnplan.ir.interp`) and the distributed one
(:mod:`attnplan.runtime.dist`, one device per process, torch.distributed).
A runner is given

* ``home``: its home buffers bound to tensors (views of the caller's q, k, v,
  out, lse, dout, dq, dk, dv; see :func:`home_bindings`), and
* a ``transport`` (:mod:`attnplan.runtime.transport`) with ``post_send``,
  ``post_recv`` and ``wait`` — the three message instructions of
  :mod:`attnplan.ir.program`, with their semantics: a posted send's tensors
  are not modified until its ``wait``; a receive's tensors hold the data
  after its ``wait``.

A message carries the buffers of its transfers as one contiguous buffer: a
``recv`` allocates one flat tensor for all of them, laid out as the
transfers' buffers in order (:func:`buffer_shapes`: what each kind of buffer
holds; :func:`packed_empty`), and binds each receive buffer to its views
into it; a ``send`` hands the transport the tensors of its transfers' source
buffers, which it packs into one flat tensor the same way (:func:`pack`: one
``torch.cat`` of their flattened bytes). Partial accumulators are created by
their first write; a buffer that is not a home buffer is dropped after its
last use in the stream (a send of a message uses the buffers it packs). A
message may forward buffers that were received (ring traffic), a
``merge``/``add`` may target any buffer; a target that holds nothing yet
takes a copy of the source.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import PlanError, ShapeError
from ..ir.program import (A1, ADD, ARG_BUF, ATTN, ATTN_BWD, B_DKV, B_DQ, B_KV, B_O, B_Q, BHG, BK, BPEER, BROLE,
                          BTB, BWD, FWD, HOME, ISA, KEPT, KINDS, M_DST, M_END, M_PHASE, M_SRC, M_START, MERGE, OP, OPS,
                          PHASES, RECV, RECVD, SEND, T_RBUF, T_SBUF, WAIT)
from . import kernels, varlen

NEG_INF = float("-inf")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulator dtype of partial outputs, lse and gradients (as the kernels)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class Timings:
    """Seconds one device spent, summed over the runs it is passed to.

    ``kernel``: attention kernels, merges and adds; ``wait``: blocked in
    ``wait`` (transfer time not hidden behind compute); ``post``: posting
    sends and receives (copies to contiguous buffers, the transport's own
    launch cost); ``wall``: the whole stream, from the first instruction to
    the last. ``wall - kernel - wait - post`` is the runner's own overhead."""

    kernel: float = 0.0
    wait: float = 0.0
    post: float = 0.0
    wall: float = 0.0
    instructions: int = 0
    bytes_sent: int = 0
    bytes_recv: int = 0
    phases: dict = field(default_factory=dict)  # phase name -> wall seconds

    def add(self, other: "Timings") -> None:
        for f in ("kernel", "wait", "post", "wall", "instructions", "bytes_sent", "bytes_recv"):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        for k, v in other.phases.items():
            self.phases[k] = self.phases.get(k, 0.0) + v

    def as_dict(self) -> dict:
        return {"kernel_s": self.kernel, "wait_s": self.wait, "post_s": self.post, "wall_s": self.wall,
                "overhead_s": self.wall - self.kernel - self.wait - self.post, "instructions": self.instructions,
                "bytes_sent": self.bytes_sent, "bytes_recv": self.bytes_recv, "phases": dict(self.phases)}


def buffer_shapes(graph, phase: int, kind: int, tb: int, hg: int, dtype: torch.dtype, wire: bool = False):
    """Shapes and dtypes of the tensors a buffer holds (``buffer_bytes`` of
    :mod:`attnplan.ir.program` counts the same): forward Q = q; KV = k, v;
    O = out, lse (accumulator dtype); backward Q bundle = q, out, dout, lse;
    dQ = dq; dKV = dk, dv (accumulator dtype). ``wire``: a partial output as
    it travels and is received — out, dq, dk, dv in :func:`wire_dtype`."""
    p = graph.problem
    rows = int(graph.tb_len[tb])
    hkv = int(graph.hg_end[hg] - graph.hg_start[hg])
    hq, d = hkv * graph.group, p.head_dim
    acc = acc_dtype(dtype)
    part = wire_dtype(p, dtype) if wire else acc
    if kind == B_Q:
        if phase == FWD:
            return (((rows, hq, d), dtype),)
        return (((rows, hq, d), dtype),) * 3 + (((rows, hq), acc),)
    if kind == B_KV:
        return (((rows, hkv, d), dtype),) * 2
    if kind == B_O:
        return (((rows, hq, d), part), ((rows, hq), acc))
    if kind == B_DQ:
        return (((rows, hq, d), part),)
    if kind == B_DKV:
        return (((rows, hkv, d), part),) * 2
    raise PlanError(f"unknown buffer kind {kind}")


def wire_dtype(problem, dtype: torch.dtype) -> torch.dtype:
    """The dtype partial outputs travel in: the accumulator's, or the
    inputs' where the problem sends partials in its own dtype
    (``Problem.partials_dtype``)."""
    return acc_dtype(dtype) if problem.partials_dtype == "float32" else dtype


def to_wire(kind: int, tensors: tuple, wire: torch.dtype) -> tuple:
    """A partial output's tensors as they travel: out (not its lse), dq, dk, dv in ``wire``."""
    if kind == B_O:
        return (tensors[0].to(wire),) + tuple(tensors[1:])
    return tuple(x.to(wire) for x in tensors)


_ALIGN = 16  # bytes: every tensor of a packed buffer starts at a multiple of this


def _offsets(specs) -> tuple[list[int], int]:
    offs, n = [], 0
    for shape, dt in specs:
        offs.append(n)
        size = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dt).element_size()
        n += -(-size // _ALIGN) * _ALIGN
    return offs, n


def packed_empty(specs, zero: bool = False, device=None):
    """One flat uint8 tensor holding every tensor of ``specs`` (``[(shape,
    dtype), ...]``) at aligned offsets, and the typed views into it: a buffer
    that travels as one message."""
    offs, n = _offsets(specs)
    flat = (torch.zeros if zero else torch.empty)(n, dtype=torch.uint8, device=device)
    views = []
    for (shape, dt), o in zip(specs, offs):
        size = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dt).element_size()
        views.append(flat[o:o + size].view(dt).view(shape))
    return flat, tuple(views)


def pack(tensors) -> torch.Tensor:
    """One flat uint8 tensor holding ``tensors`` laid out as :func:`packed_empty`
    (one ``torch.cat`` of their bytes, each padded to the alignment)."""
    parts = []
    for t in tensors:
        b = t.contiguous().reshape(-1).view(torch.uint8)
        pad = -len(b) % _ALIGN
        parts.append(b)
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=t.device))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)


def home_bindings(graph, program, phase: int, device: int, tensors: dict, row0) -> dict:
    """Bind ``device``'s home buffers of ``phase`` to views of ``tensors``.

    ``tensors`` has ``q, k, v`` and, forward, ``out, lse`` (accumulators: 0 and
    −inf); backward, ``out, dout, lse, dq, dk, dv`` (``dq/dk/dv`` zeros).
    ``row0[tb]`` is the row where token block ``tb`` starts in them (its global
    start for global tensors, its local offset for a rank's local tensors)."""
    t = tensors
    g = graph.group  # the tensors' kv heads are the virtual ones (see expand_kv)
    hs, he = graph.hg_start.tolist(), graph.hg_end.tolist()
    lens = graph.tb_len
    st: dict[int, tuple] = {}
    for b, (kind, tb, hg, role) in enumerate(program.buffers[phase][device][:, [BK, BTB, BHG, BROLE]].tolist()):
        if role != HOME:
            continue
        r0 = int(row0[tb])
        r = slice(r0, r0 + int(lens[tb]))
        h = slice(hs[hg], he[hg])
        qh = slice(hs[hg] * g, he[hg] * g)
        if kind == B_Q:
            st[b] = (t["q"][r, qh],) if phase == FWD else \
                (t["q"][r, qh], t["out"][r, qh], t["dout"][r, qh], t["lse"][r, qh])
        elif kind == B_KV:
            st[b] = (t["k"][r, h], t["v"][r, h])
        elif kind == B_O:
            st[b] = (t["out"][r, qh], t["lse"][r, qh])
        elif kind == B_DQ:
            st[b] = (t["dq"][r, qh],)
        elif kind == B_DKV:
            st[b] = (t["dk"][r, h], t["dv"][r, h])
    return st


def kept_sources(program, device: int) -> list[int]:
    """The forward buffers of ``device`` its backward keeps (``Problem.keep_kv``):
    the forward runner holds them to its end instead of dropping them."""
    b = program.buffers[BWD][device]
    return b[b[:, BROLE] == KEPT, BPEER].tolist()


def kept_bindings(program, device: int, kept: dict) -> dict:
    """Bind ``device``'s kept backward buffers to the tensors its forward runner
    kept (``kept``: forward buffer -> tensors, :meth:`DeviceRunner.kept`)."""
    b = program.buffers[BWD][device]
    out = {}
    for i in np.flatnonzero(b[:, BROLE] == KEPT).tolist():
        src = int(b[i, BPEER])
        if src not in kept:
            raise PlanError(f"bwd device {device}: buffer %{i} keeps forward buffer %{src}, which the forward did "
                            f"not keep (run the backward after this plan's forward)")
        out[i] = kept[src]
    return out


def _message_buffers(program, phase: int, device: int, code: np.ndarray) -> dict:
    """For every message this device's stream sends or receives: the local
    buffers its transfers pack (a send) or unpack into (a receive), in
    transfer order."""
    M, X = program.messages, program.transfers
    out = {}
    for op, col in ((SEND, T_SBUF), (RECV, T_RBUF)):
        for m in code[code[:, OP] == op, A1].tolist():
            if not 0 <= m < len(M):
                raise PlanError(f"{PHASES[phase]} device {device}: {OPS[op]} names message m{m}, which does not "
                                f"exist ({len(M)} messages)")
            out[(op, m)] = X[M[m, M_START]:M[m, M_END], col].tolist()
    return out


def _use(code: np.ndarray, nbuf: int, msg_bufs: dict, last: bool) -> np.ndarray:
    """Index of the last (``last``) or first instruction that names each buffer, or sends or receives it in
    a message (−1: none)."""
    n = len(code)
    at = np.full(nbuf, -1 if last else n, np.int64)
    pick = np.maximum if last else np.minimum
    for spec in ISA:
        rows = np.flatnonzero(code[:, OP] == spec.code)
        for c in spec.cols(ARG_BUF) if len(rows) else ():
            pick.at(at, code[rows, c], rows)
    for op in (SEND, RECV):
        for i in np.flatnonzero(code[:, OP] == op).tolist():
            b = np.asarray(msg_bufs[(op, int(code[i, A1]))], np.int64)
            at[b] = pick(at[b], i)
    at[at == n] = -1
    return at


def _last_use(code: np.ndarray, nbuf: int, msg_bufs: dict) -> np.ndarray:
    return _use(code, nbuf, msg_bufs, last=True)


def first_use(code: np.ndarray, nbuf: int, msg_bufs: dict) -> np.ndarray:
    """Index of the first instruction that names each buffer, or sends or receives it in a message (−1: none)."""
    return _use(code, nbuf, msg_bufs, last=False)


def check_stream(code: np.ndarray, bufs: np.ndarray, phase: int, device: int, program=None,
                 msg_bufs: dict | None = None) -> None:
    """What the runner relies on, checked before it runs (a plan whose
    verification was skipped, or a crafted one): known opcodes legal in
    ``phase``, buffer operands inside the buffer table and of the kinds the
    instruction set allows, and messages of this phase between this device
    and another whose buffers are in the table. :class:`PlanError` naming the
    first bad instruction."""
    ops = code[:, OP]
    where = f"{PHASES[phase]} device {device} instruction"
    bad = np.flatnonzero((ops < 0) | (ops >= len(ISA)))
    if len(bad):
        raise PlanError(f"{where} {int(bad[0])}: unknown opcode {int(ops[bad[0]])}")
    for spec in ISA:
        rows = np.flatnonzero(ops == spec.code)
        if len(rows) and phase not in spec.phases:
            raise PlanError(f"{where} {int(rows[0])}: {spec.name} is not valid in {PHASES[phase]}")
        operands = [j for j, arg in enumerate(spec.args) if arg == ARG_BUF]
        for j, c in zip(operands, spec.cols(ARG_BUF)) if len(rows) else ():
            b = code[rows, c]
            inside = (b >= 0) & (b < len(bufs))
            ok = inside.copy()
            ok[inside] = np.isin(bufs[b[inside], BK], spec.kinds[j])
            if not ok.all():
                n = int(np.flatnonzero(~ok)[0])
                what = (f"of kind {KINDS[int(bufs[b[n], BK])]}" if inside[n]
                        else f"not in its buffer table of {len(bufs)}")
                raise PlanError(f"{where} {int(rows[n])} ({spec.name}): operand {spec.operands[j]} names buffer "
                                f"%{int(b[n])}, {what}; {spec.name} needs "
                                f"{' or '.join(KINDS[k] for k in spec.kinds[j])}")
    if program is None or msg_bufs is None:
        return
    M = program.messages
    for i in np.flatnonzero((ops == SEND) | (ops == RECV)).tolist():
        op, m = int(ops[i]), int(code[i, A1])
        side = M_SRC if op == SEND else M_DST
        if M[m, M_PHASE] != phase or M[m, side] != device:
            raise PlanError(f"{where} {i} ({OPS[op]}): message m{m} is not a {PHASES[phase]} message "
                            f"{'from' if op == SEND else 'to'} device {device}")
        b = np.asarray(msg_bufs[(op, m)], np.int64)
        if len(b) and (b.min() < 0 or b.max() >= len(bufs)):
            raise PlanError(f"{where} {i} ({OPS[op]}): message m{m} names a buffer outside its buffer table of "
                            f"{len(bufs)}")


def _same_shapes(dst: tuple, src: tuple, dst_name: str, src_name: str) -> None:
    """Two buffers' tensors can be merged or added: same count and shapes (else :class:`ShapeError`)."""
    if len(dst) != len(src) or any(a.shape != x.shape for a, x in zip(dst, src)):
        raise ShapeError(f"{src_name} holds {[list(x.shape) for x in src]} but {dst_name} holds "
                         f"{[list(a.shape) for a in dst]}")


class DeviceRunner:
    """Executes ``program.code[phase][device]``, one instruction per :meth:`step`.

    ``compute=False`` skips kernels, merges and adds (a communication-only
    replay: partials that would have been computed are sent as zeros), which
    measures the transfer time of the plan alone."""

    def __init__(self, graph, program, phase: int, device: int, home: dict, transport, scale: float,
                 dtype: torch.dtype, timings: Timings | None = None, compute: bool = True, where=None,
                 finite: bool = False):
        self.g, self.prog, self.phase, self.device = graph, program, phase, device
        self.bufs = program.buffers[phase][device]
        code = program.code[phase][device]
        self.code = code.tolist()
        self.st = dict(home)
        self.home = {int(b) for b in np.flatnonzero(self.bufs[:, BROLE] == HOME)}
        unbound = [b for b in np.flatnonzero(self.bufs[:, BROLE] == KEPT).tolist() if b not in self.st]
        if unbound:
            raise PlanError(f"{PHASES[phase]} device {device}: buffer %{unbound[0]} keeps a KV block of the forward, "
                            f"which was not handed over (this plan keeps KV: run its backward after its forward)")
        self.transport, self.scale, self.dtype = transport, scale, dtype
        self.wire = wire_dtype(graph.problem, dtype)
        self.compute = compute
        self.timings = timings if timings is not None else Timings()
        self.msg_bufs = _message_buffers(program, phase, device, code)
        check_stream(code, self.bufs, phase, device, program, self.msg_bufs)
        last = _last_use(code, len(self.bufs), self.msg_bufs)
        self.keep = set(kept_sources(program, device)) if phase == FWD else set()  # held for the backward
        self.free_after: dict[int, list[int]] = {}
        for b in np.flatnonzero(last >= 0).tolist():
            if b not in self.home and b not in self.keep:
                self.free_after.setdefault(int(last[b]), []).append(b)
        # the torch device of the buffers it allocates: ``where``, else its home tensors'
        self.where = where if where is not None else next((x.device for ts in self.st.values() for x in ts),
                                                          torch.device("cpu"))
        self.pc = 0
        self._t0: float | None = None
        self._flush = getattr(transport, "flush", None)  # transports that start a run of posts as one batch
        self.track_memory = False  # when set: ``peak_bytes``, the most bytes of non-home buffers held at once
        self.peak_bytes = 0
        self.finite = finite  # the caller checked that every input of the phase is finite (tiles skip the check)
        # home output buffers that hold nothing yet (0, −inf): a tile's first result is written, not merged
        self.fresh = {b for b in self.home if phase == FWD and int(self.bufs[b, BK]) == B_O}

    def kept(self) -> dict:
        """After a forward stream: the buffers its backward keeps (forward buffer -> tensors)."""
        return {b: self.st[b] for b in self.keep if b in self.st}

    # buffers -----------------------------------------------------------------
    def specs(self, b: int) -> tuple:
        """``(shape, dtype)`` of each tensor of buffer ``b``."""
        kind, tb, hg, role = (int(x) for x in self.bufs[b][[BK, BTB, BHG, BROLE]])
        return buffer_shapes(self.g, self.phase, kind, tb, hg, self.dtype, wire=role == RECVD)

    def alloc(self, b: int, zero: bool = False):
        """Buffer ``b``'s tensors, views into one flat allocation."""
        return packed_empty(self.specs(b), zero, self.where)[1]

    def alloc_message(self, bufs: list) -> tuple[torch.Tensor, list]:
        """One flat tensor for the buffers ``bufs`` of a received message, laid
        out in order, and each buffer's views into it."""
        specs = [self.specs(b) for b in bufs]
        flat, views = packed_empty([x for sp in specs for x in sp], device=self.where)
        out, at = [], 0
        for sp in specs:
            out.append(views[at:at + len(sp)])
            at += len(sp)
        return flat, out

    def _get(self, b: int, i: int):
        try:
            return self.st[b]
        except KeyError:
            if not self.compute:
                self.st[b] = self.alloc(b, zero=True)
                return self.st[b]
            kind, tb, hg = self.bufs[b][[BK, BTB, BHG]].tolist()
            raise PlanError(f"{PHASES[self.phase]} device {self.device} instruction {i} "
                            f"({OPS[self.code[i][0]]}): buffer %{b} ({KINDS[kind]} tb={tb} hg={hg}) holds no data "
                            f"yet") from None

    # execution -----------------------------------------------------------------
    def step(self, i: int, row) -> None:
        """Execute instruction ``i`` (``row`` = its 6 ints)."""
        if self._t0 is None:
            self._t0 = time.perf_counter()
        op = row[0]
        tm = self.timings
        t0 = time.perf_counter()
        if op != SEND and op != RECV and self._flush is not None:
            self._flush()  # the stage's posts go out together before the stream moves on
        if op == WAIT:
            self.transport.wait(row[1])
            tm.wait += time.perf_counter() - t0
        elif op == RECV:
            bufs = self.msg_bufs[(RECV, row[1])]
            flat, views = self.alloc_message(bufs)
            for b, v in zip(bufs, views):
                self.st[b] = v
            tensors = tuple(x for v in views for x in v)
            self.transport.post_recv(row[1], row[2], tensors, flat)
            tm.bytes_recv += flat.numel()
            tm.post += time.perf_counter() - t0
        elif op == SEND:
            tensors = tuple(x for b in self.msg_bufs[(SEND, row[1])] for x in self._sent(b, i))
            self.transport.post_send(row[1], row[2], tensors, None)
            tm.bytes_sent += sum(x.numel() * x.element_size() for x in tensors)
            tm.post += time.perf_counter() - t0
        elif self.compute:
            try:
                self._compute(i, op, row)
            except ShapeError as e:
                raise ShapeError(f"{self._where(i)}: {e}") from None
            tm.kernel += time.perf_counter() - t0
        tm.instructions += 1
        if self.track_memory:
            self._track()
        for b in self.free_after.get(i, ()):
            self.st.pop(b, None)
        self.pc = i + 1
        if self.pc == len(self.code):
            self.finish()

    def _track(self) -> None:
        live = sum(x.numel() * x.element_size() for b, ts in self.st.items() if b not in self.home for x in ts)
        self.peak_bytes = max(self.peak_bytes, live)

    def _where(self, i: int) -> str:
        op = self.code[i][0]
        return f"{PHASES[self.phase]} device {self.device} instruction {i} ({OPS[op] if 0 <= op < len(OPS) else op})"

    def _sent(self, b: int, i: int) -> tuple:
        """Buffer ``b``'s tensors as a message carries them (a partial in its wire dtype)."""
        ts = self._get(b, i)
        kind = int(self.bufs[b, BK])
        return ts if kind in (B_Q, B_KV) else to_wire(kind, ts, self.wire)

    def _combine(self, i: int, op: int, dst: int, src: int) -> None:
        """``merge``/``add`` buffer ``src`` into ``dst`` (a copy in ``dst``'s
        dtypes if ``dst`` holds nothing yet: a received partial's wire dtype
        never becomes an accumulator's)."""
        st = self.st
        s = self._get(src, i)
        if dst not in st:
            st[dst] = tuple(x.to(dt, copy=True) for x, (_, dt) in zip(s, self.specs(dst)))
            return
        if op == MERGE:
            _same_shapes(st[dst], s, f"buffer %{dst}", f"buffer %{src}")
            kernels.merge_into(st[dst][0], st[dst][1], *s)
        else:
            self._add_into(dst, s)

    def _add_into(self, b: int, tensors: tuple) -> None:
        """Add ``tensors`` into buffer ``b``'s (which take them if ``b`` holds nothing yet)."""
        if b not in self.st:
            self.st[b] = tensors
            return
        _same_shapes(self.st[b], tensors, f"buffer %{b}", "the sum's operand")
        for a, x in zip(self.st[b], tensors):
            a.add_(x)

    def _compute(self, i: int, op: int, row) -> None:
        st = self.st
        if op == ATTN:
            c, qb, kb, ob = row[1:5]
            q = self._get(qb, i)[0]
            k, v = self._get(kb, i)
            tile = int(self.g.cb_tile[c])
            pieces, qs, ks = self.g.local_pieces(tile)
            key = (self.g, tile)
            if ob in self.fresh and st[ob][0].shape == q.shape:
                varlen.tile_fwd(q, k, v, qs, ks, pieces, self.scale, into=st[ob], finite=self.finite, key=key)
                self.fresh.discard(ob)
                return
            o, lse = varlen.tile_fwd(q, k, v, qs, ks, pieces, self.scale, finite=self.finite, key=key)
            self.fresh.discard(ob)
            if ob in st:
                _same_shapes(st[ob], (o, lse), f"buffer %{ob}", "the tile's output")
                kernels.merge_into(st[ob][0], st[ob][1], o, lse)
            else:  # a partial accumulator, created by its first write
                st[ob] = (o, lse)
        elif op == ATTN_BWD:
            c, qb, kb, dqb, dkvb = row[1:6]
            q, out, dout, lse = self._get(qb, i)
            k, v = self._get(kb, i)
            tile = int(self.g.cb_tile[c])
            pieces, qs, ks = self.g.local_pieces(tile)
            key = (self.g, tile)
            if dqb in st and dkvb in st and st[dqb][0].shape == q.shape and st[dkvb][0].shape == k.shape:
                into = (st[dqb][0], st[dkvb][0], st[dkvb][1])
                varlen.tile_bwd(q, k, v, out, dout, lse, qs, ks, pieces, self.scale, into=into, finite=self.finite,
                                key=key)
                return
            gq, gk, gv = varlen.tile_bwd(q, k, v, out, dout, lse, qs, ks, pieces, self.scale, finite=self.finite,
                                         key=key)
            self._add_into(dqb, (gq,))
            self._add_into(dkvb, (gk, gv))
        elif op in (MERGE, ADD):
            self._combine(i, op, row[1], row[2])
            self.fresh.discard(row[1])
        else:
            raise PlanError(f"{PHASES[self.phase]} device {self.device} instruction {i}: "
                            f"{OPS[op] if 0 <= op < len(OPS) else op} is not valid in {PHASES[self.phase]}")

    def finish(self) -> None:
        """End of the stream: start any posts still held, record the wall time."""
        if self._flush is not None:
            self._flush()
        if self._t0 is not None:
            dt = time.perf_counter() - self._t0
            self.timings.wall += dt
            name = PHASES[self.phase]
            self.timings.phases[name] = self.timings.phases.get(name, 0.0) + dt
            self._t0 = None

    def run(self) -> None:
        """Execute the whole stream in order (a distributed device: waits block)."""
        if not self.code:
            return
        for i, row in enumerate(self.code):
            self.step(i, row)
