"""The transport of collective schedules (``comm{mode=a2a}``): a phase's
messages as all-to-alls.

A collective schedule has one stage and no overlap, so every device posts
all its data messages (Q, KV; backward: Q bundles and KV) before it waits
for any of them, and all its partial outputs (O; dQ, dKV) after its last
compute block, before it waits for them (:mod:`attnplan.passes.emit`). The
messages of one phase fall into two *exchanges*, data then partials, known
to every rank from the plan's message table. This transport records posts
and, at the first wait on a message of an exchange (or when the stream
ends), runs that exchange and every earlier one not yet run as one
``torch.distributed.all_to_all_single`` each: its packed messages
concatenated by peer, the split sizes their byte counts (zero for peers it
exchanges nothing with). Every rank runs every exchange of the phase, in
the same order, so the collectives match; a message that is not posted when
its exchange runs is a plan that is not collective-shaped (PlanError, not a
hang).
"""

from __future__ import annotations

import datetime

import numpy as np
import torch
import torch.distributed as dist

from ..errors import PlanError
from ..ir.interp import message_key
from ..ir.program import B_KV, M_DST, M_ID, M_PHASE, M_SRC, M_START, T_KIND
from .runner import pack
from .transport import TransportError


def exchanges(program, phase: int) -> dict[int, int]:
    """Message id -> exchange (0: data, 1: partial outputs) of ``phase``'s messages."""
    m = program.messages
    m = m[m[:, M_PHASE] == phase]
    kind = program.transfers[m[:, M_START], T_KIND] if len(m) else np.zeros(0, np.int64)
    return dict(zip(m[:, M_ID].tolist(), (kind > B_KV).astype(int).tolist()))


class CollectiveTransport:
    """``post_send``/``post_recv`` record; ``wait`` and ``drain`` run the
    exchanges (module doc) as ``all_to_all_single`` over the group."""

    def __init__(self, program, phase: int, device: int, info, timeout: float):
        self.program, self.device, self.info, self.timeout = program, device, info, timeout
        self.exchange = exchanges(program, phase)
        rows = program.messages[program.messages[:, M_PHASE] == phase]
        mine = rows[(rows[:, M_SRC] == device) | (rows[:, M_DST] == device)]
        self.expected: list[set[int]] = [set(), set()]  # this device's messages of each exchange
        for mid in mine[:, M_ID].tolist():
            self.expected[self.exchange[mid]].add(mid)
        self.posted: dict[int, tuple[int, torch.Tensor, bool]] = {}  # id -> (peer, flat, is send)
        self.done = 0  # exchanges run so far
        self.calls = 0  # all_to_all_single calls made (tests read it)

    def _mine(self, tag: int) -> int:
        """The exchange of message ``tag``, which must be one of this device's in this phase."""
        x = self.exchange.get(tag)
        if x is None or tag not in self.expected[x]:
            raise PlanError(f"device {self.device}: message {tag} is not one of this device's messages of this phase "
                            f"(a program not shaped for comm{{mode=a2a}})")
        return x

    def post_send(self, tag: int, peer: int, tensors, flat=None) -> None:
        self._mine(tag)
        self.posted[tag] = (peer, flat if flat is not None else pack(tensors), True)

    def post_recv(self, tag: int, peer: int, tensors, flat=None) -> None:
        if flat is None:  # pragma: no cover - the runner always receives into a flat buffer
            raise PlanError("CollectiveTransport receives into packed buffers only")
        self._mine(tag)
        self.posted[tag] = (peer, flat, False)

    def wait(self, tag: int) -> None:
        x = self._mine(tag)
        while self.done <= x:
            self._run(self.done)

    def drain(self) -> None:
        while self.done < 2:
            self._run(self.done)

    def _position(self, peer: int) -> int:
        rank = self.info.ranks[peer]
        return rank if self.info.group is None else dist.get_group_rank(self.info.group, rank)

    def _run(self, x: int) -> None:
        """Exchange ``x`` as one all_to_all_single."""
        missing = sorted(self.expected[x] - self.posted.keys())
        if missing:
            raise PlanError(f"device {self.device}: {message_key(self.program, missing[0])} is not posted when its "
                            f"all-to-all runs: the program is not shaped for comm{{mode=a2a}}")
        n = len(self.info.ranks)
        send: list[torch.Tensor | None] = [None] * n
        recv: list[torch.Tensor | None] = [None] * n
        for mid in self.expected[x]:
            peer, flat, is_send = self.posted.pop(mid)
            (send if is_send else recv)[self._position(peer)] = flat
        dev = next((t.device for t in send + recv if t is not None), torch.device("cpu"))  # NCCL: the GPU
        empty = torch.zeros(0, dtype=torch.uint8, device=dev)
        s_sizes = [0 if t is None else t.numel() for t in send]
        r_sizes = [0 if t is None else t.numel() for t in recv]
        out = torch.empty(sum(r_sizes), dtype=torch.uint8, device=dev)
        inp = torch.cat([t for t in send if t is not None]) if any(s_sizes) else empty
        try:
            work = dist.all_to_all_single(out, inp, r_sizes, s_sizes, group=self.info.group, async_op=True)
            work.wait(datetime.timedelta(seconds=self.timeout))
        except RuntimeError as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise TransportError(f"device {self.device} (rank {self.info.ranks[self.device]}): all-to-all "
                                 f"{('data', 'partials')[x]} did not complete within {self.timeout:g} s or a peer "
                                 f"failed [{msg[:160]}]") from None
        at = 0
        for t, size in zip(recv, r_sizes):
            if t is not None:
                t.copy_(out[at:at + size])
            at += size
        self.done, self.calls = x + 1, self.calls + 1
