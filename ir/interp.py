"""The one way programs are walked: a cooperative round-robin over devices.

Each device runs until it reaches a ``wait`` whose transfer does not yet
have both its send and its receive posted (rendezvous semantics). When a full
round moves no device, the programs deadlock: :class:`DeadlockError` names
every blocked device and the transfer it waits on. The verifier's symbolic
run, the simulator and the in-process executor all use this walk with their
own instruction handler."""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..errors import DeadlockError
from .program import KINDS, PHASES, RECV, SEND, T_DST, T_HG, T_KIND, T_SRC, T_TB, WAIT, Program


def transfer_key(program: Program, tag: int) -> str:
    t = program.transfers[tag]
    return (f"t{tag} {PHASES[t[1]]} {KINDS[t[T_KIND]]}[tb{t[T_TB]},hg{t[T_HG]}] "
            f"d{t[T_SRC]}->d{t[T_DST]}")


def cooperate(program: Program, phase: int, on_instr: Callable[[int, int, list], None], code=None) -> None:
    """Run every device's ``phase`` stream, calling ``on_instr(device, index, row)``
    for each instruction in an order every real transport could also take.
    ``code`` replaces the program's streams (the verifier walks only the
    instructions that can block)."""
    code = [c.tolist() for c in (program.code[phase] if code is None else code)]
    n = program.devices
    ntags = len(program.transfers)
    sent = np.zeros(ntags, bool)
    recvd = np.zeros(ntags, bool)
    pc = [0] * n
    while True:
        progressed = False
        for d in range(n):
            c, i = code[d], pc[d]
            while i < len(c):
                row = c[i]
                op = row[0]
                if op == WAIT:
                    t = row[1]
                    if not (sent[t] and recvd[t]):
                        break
                elif op == SEND:
                    sent[row[1]] = True
                elif op == RECV:
                    recvd[row[1]] = True
                on_instr(d, i, row)
                i += 1
            if i != pc[d]:
                pc[d] = i
                progressed = True
        if all(pc[d] == len(code[d]) for d in range(n)):
            return
        if not progressed:
            blocked = [f"device {d} waits on {transfer_key(program, code[d][pc[d]][1])} "
                       f"(send {'posted' if sent[code[d][pc[d]][1]] else 'not posted'}, "
                       f"recv {'posted' if recvd[code[d][pc[d]][1]] else 'not posted'})"
                       for d in range(n) if pc[d] < len(code[d])]
            raise DeadlockError(f"deadlock in {PHASES[phase]}: " + "; ".join(blocked))
