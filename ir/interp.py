"""The one semantics of walking programs: rendezvous messages.

``send`` and ``recv`` only post; a ``wait`` passes once both sides of its
message are posted; nothing else blocks. Two ways to use it:

* :func:`cooperate` runs every device's stream in one process, calling a
  handler per instruction in an order every real transport could also take
  (the simulator and the in-process executor). It is event driven: a device
  runs until it reaches a ``wait`` whose message is not complete, and is
  resumed when the post that completes it happens, so the walk costs one step
  per instruction, not per device and round.
* :func:`check_deadlock_free` proves without running anything that the walk
  finishes (the verifier): the waits form a graph in which a wait depends on
  the previous wait of its device and on the last wait before each of the two
  posts of its message; the walk finishes exactly when that graph has no
  cycle (and every waited message is posted). Cost: a few numpy passes and
  one strongly-connected-components call, linear in the instructions.

Either way a deadlock raises :class:`DeadlockError` naming every blocked
device, the message it waits on and which of its sides were posted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np

from ..errors import DeadlockError
from .program import (
    A1,
    KINDS,
    M_DST,
    M_END,
    M_PHASE,
    M_SRC,
    M_START,
    OP,
    PHASES,
    RECV,
    SEND,
    T_HG,
    T_KIND,
    T_TB,
    WAIT,
    Program,
)


def message_key(program: Program, msg: int) -> str:
    """``m3 fwd d0->d1 (2 blocks: KV[tb4,hg0], ...)``: a message and what it carries."""
    m = program.messages[msg]
    start, end = int(m[M_START]), int(m[M_END])
    blocks = ""
    if 0 <= start < end <= len(program.transfers):
        t = program.transfers[start]
        name = f"{KINDS[t[T_KIND]] if 0 <= t[T_KIND] < len(KINDS) else t[T_KIND]}[tb{t[T_TB]},hg{t[T_HG]}]"
        blocks = f" ({end - start} block{'s' if end - start > 1 else ''}: {name}{', ...' if end - start > 1 else ''})"
    phase = PHASES[m[M_PHASE]] if 0 <= m[M_PHASE] < len(PHASES) else f"phase {m[M_PHASE]}"
    return f"m{msg} {phase} d{m[M_SRC]}->d{m[M_DST]}{blocks}"


def _deadlock(program: Program, phase: int, blocked: list) -> DeadlockError:
    """``blocked``: (device, message, send posted, recv posted) of every device that cannot go on."""
    parts = [f"device {d} waits on {message_key(program, t)} (send {'posted' if s else 'not posted'}, "
             f"recv {'posted' if r else 'not posted'})" for d, t, s, r in blocked]
    return DeadlockError(f"deadlock in {PHASES[phase]}: " + "; ".join(parts))


def cooperate(program: Program, phase: int, on_instr: Callable[[int, int, list], None], code=None) -> None:
    """Run every device's ``phase`` stream, calling ``on_instr(device, index, row)``
    for each instruction in an order every real transport could also take.
    ``code`` replaces the program's streams."""
    code = [c.tolist() for c in (program.code[phase] if code is None else code)]
    n = len(code)
    ntags = len(program.messages)
    sent, recvd = bytearray(ntags), bytearray(ntags)  # sides posted of every message
    waiting: dict[int, list[int]] = {}                # message -> devices blocked on it
    pc = [0] * n
    ready = deque(range(n))
    op_, tag_, wait_, send_, recv_ = OP, A1, WAIT, SEND, RECV  # locals: this loop runs once per instruction
    while ready:
        d = ready.popleft()
        c, i = code[d], pc[d]
        end = len(c)
        while i < end:
            row = c[i]
            op = row[op_]
            if op == wait_:
                t = row[tag_]
                if not (sent[t] and recvd[t]):
                    waiting.setdefault(t, []).append(d)
                    break
            elif op == send_:
                t = row[tag_]
                if not sent[t]:
                    sent[t] = 1
                    if recvd[t] and t in waiting:
                        ready.extend(waiting.pop(t))
            elif op == recv_:
                t = row[tag_]
                if not recvd[t]:
                    recvd[t] = 1
                    if sent[t] and t in waiting:
                        ready.extend(waiting.pop(t))
            on_instr(d, i, row)
            i += 1
        pc[d] = i
    blocked = [(d, code[d][pc[d]][A1]) for d in range(n) if pc[d] < len(code[d])]
    if blocked:
        raise _deadlock(program, phase, [(d, t, bool(sent[t]), bool(recvd[t])) for d, t in blocked])


# ---------------------------------------------------------------------------- static proof

SIDE_SEND, SIDE_RECV = 0, 1  # the two posts of a message (columns of the gate table)

def _flatten(code: list) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """All streams as columns: (opcode, first operand, device, first row of each device)."""
    lens = np.array([len(c) for c in code], np.int64)
    start = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    rows = np.concatenate([np.asarray(c, np.int64).reshape(-1, 6) for c in code])
    return (np.ascontiguousarray(rows[:, OP]), np.ascontiguousarray(rows[:, A1]),
            np.repeat(np.arange(len(code), dtype=np.int64), lens), start)


def _post_gates(op: np.ndarray, tag: np.ndarray, dev: np.ndarray, start: np.ndarray,
                ntags: int) -> tuple[np.ndarray, np.ndarray]:
    """Wait rows and, per message, the wait each of its posts comes after.

    Waits are numbered in stream order (device by device). The *gate* of a
    post is the last wait before it on its device (−1: none, it is posted at
    once; −2: the message has no such post)."""
    is_wait = op == WAIT
    before = np.cumsum(is_wait) - is_wait               # waits strictly before each row, all devices
    gate = before - 1
    gate[before <= before[start[dev]]] = -1             # no wait of the row's own device before it
    gates = np.full((ntags, 2), -2, np.int64)
    for side, code in ((SIDE_SEND, SEND), (SIDE_RECV, RECV)):
        sel = np.flatnonzero(op == code)
        gates[tag[sel], side] = gate[sel]
    return np.flatnonzero(is_wait), gates


def _blocked_waits(wait_tag: np.ndarray, wait_dev: np.ndarray, gates: np.ndarray) -> np.ndarray:
    """Which waits can never pass: those on a cycle of the wait graph, those
    whose message misses a post, and everything after them."""
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import breadth_first_order, connected_components

    n = len(wait_tag)
    ids = np.arange(n, dtype=np.int64)
    g = gates[wait_tag]                                     # [n, 2] gates of each wait's two posts
    chain = np.flatnonzero(wait_dev[1:] == wait_dev[:-1])   # wait i -> i + 1 on the same device
    s0, s1 = np.flatnonzero(g[:, SIDE_SEND] >= 0), np.flatnonzero(g[:, SIDE_RECV] >= 0)
    src = np.concatenate([chain, g[s0, SIDE_SEND], g[s1, SIDE_RECV]])
    dst = np.concatenate([chain + 1, s0, s1])
    root = (g == -2).any(1)                                 # a post that never happens
    root[src[src == dst]] = True                            # a wait that gates its own message's post
    graph = csr_matrix((np.ones(len(src), np.int8), (src, dst)), shape=(n + 1, n + 1))
    _, label = connected_components(graph, directed=True, connection="strong")
    root |= (np.bincount(label)[label] > 1)[:n]             # on a cycle
    if not root.any():
        return np.zeros(n, bool)
    # everything reachable from a root is blocked: search from an extra node n linked to every root
    src = np.concatenate([src, np.full(int(root.sum()), n)])
    dst = np.concatenate([dst, ids[root]])
    graph = csr_matrix((np.ones(len(src), np.int8), (src, dst)), shape=(n + 1, n + 1))
    blocked = np.zeros(n + 1, bool)
    blocked[breadth_first_order(graph, n, directed=True, return_predecessors=False)] = True
    return blocked[:n]


def check_deadlock_free(program: Program, phase: int, code=None, streams=None) -> None:
    """Raise :class:`DeadlockError` (the message :func:`cooperate` would give)
    unless every device's ``phase`` stream runs to its end under rendezvous
    semantics. Message ids in the streams must be in range. ``code``
    replaces the program's streams; ``streams`` gives them already as columns
    (opcode, first operand, device, first row of each device)."""
    if streams is None:
        streams = _flatten(list(program.code[phase] if code is None else code))
    op, tag, dev, start = streams
    waits, gates = _post_gates(op, tag, dev, start, len(program.messages))
    if not len(waits):
        return
    blocked = _blocked_waits(tag[waits], dev[waits], gates)
    if not blocked.any():
        return
    # each device stops at its first blocked wait (blocked waits of a device are a suffix)
    b = np.flatnonzero(blocked)
    first = b[np.r_[True, dev[waits[b]][1:] != dev[waits[b]][:-1]]]
    posted = (gates == -1) | ((gates >= 0) & ~blocked[np.maximum(gates, 0)])  # [tag, side]: the post is reached
    out = []
    for w in first.tolist():
        t = int(tag[waits[w]])
        out.append((int(dev[waits[w]]), t, bool(posted[t, SIDE_SEND]), bool(posted[t, SIDE_RECV])))
    raise _deadlock(program, phase, out)
