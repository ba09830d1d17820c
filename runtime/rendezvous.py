"""Joining a torch.distributed gloo group within a timeout, with a
rendezvous store that listens on the given address only.

torch's own ``init_process_group("gloo", init_method="env://")`` (and
``tcp://``) starts rank 0's store on every interface, fails with a raw
error when ``MASTER_PORT`` is missing or taken, and a client whose
``MASTER_PORT`` is held by a program that is not a store waits forever.
:func:`init_group` instead: checks ``MASTER_ADDR``/``MASTER_PORT`` (or the
``addr``/``port`` given), binds rank 0's listening socket to that address
itself (or takes one already bound, inherited through ``ATTNPLAN_STORE_FD``)
and hands it to ``TCPStore``, waits for a listener before connecting, gives
up on a silent one at the deadline, and turns every failure into one
:class:`~attnplan.errors.TransportError` (or
:class:`~attnplan.errors.PlanError` for a bad setting) naming the rank and
the address.

torch is imported only when a group is joined.
"""

from __future__ import annotations

import errno
import math
import os
import socket
import threading
import time

from ..errors import PlanError, TransportError
from ..ir.limits import MAX_TIMEOUT_S

STORE_FD = "ATTNPLAN_STORE_FD"  # rank 0's inherited, already listening rendezvous socket (set by the launcher)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_timeout(timeout) -> float:
    """``timeout`` as positive finite seconds (at most ``MAX_TIMEOUT_S``)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
            or not 0 < timeout <= MAX_TIMEOUT_S:
        raise PlanError(f"timeout must be positive finite seconds, at most {MAX_TIMEOUT_S:,}, got {timeout!r}")
    return float(timeout)


def int_env(name: str, lo: int = 0, hi: int = 1 << 31) -> int:
    text = os.environ.get(name)
    if text is None:
        raise PlanError(f"environment variable {name} is not set")
    try:
        v = int(text.strip()) if len(text) <= 20 else None
    except ValueError:
        v = None
    if v is None or not lo <= v <= hi:
        raise PlanError(f"environment variable {name} must be an integer in {lo}..{hi}, got {text[:40]!r}")
    return v


def _master_address() -> tuple[str, int]:
    addr = os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        raise PlanError("rank mode needs MASTER_PORT, the port of rank 0's rendezvous store (torchrun sets it; "
                        "or run `plan run PLAN --procs N`, which picks one)")
    return addr, int_env("MASTER_PORT", 1, 65535)


def _listening_socket(addr: str, port: int) -> int:
    """File descriptor of a socket listening on ``addr:port`` only: the one the
    launcher handed down, or a new one."""
    if STORE_FD in os.environ:
        fd = int_env(STORE_FD)
        try:
            s = socket.socket(fileno=fd)
        except OSError as e:
            raise PlanError(f"{STORE_FD}={fd} is not an open socket: {e.strerror or e}") from None
        if s.getsockname()[1] != port:
            s.detach()
            raise PlanError(f"{STORE_FD}={fd} listens on port {s.getsockname()[1]}, not MASTER_PORT={port}")
        return s.detach()
    try:
        family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]
        s = socket.socket(family, socket.SOCK_STREAM)
    except OSError as e:
        raise TransportError(f"rank 0: cannot resolve MASTER_ADDR={addr!r}: {e.strerror or e}") from None
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, port))
        s.listen(1024)
    except OSError as e:
        s.close()
        why = "is already in use" if e.errno == errno.EADDRINUSE else f"cannot be listened on: {e.strerror or e}"
        raise TransportError(f"rank 0: the rendezvous port MASTER_PORT={port} on {addr} {why}; choose a free "
                             f"MASTER_PORT (or run `plan run PLAN --procs N`, which picks one)") from None
    return s.detach()


def _master_store(addr: str, port: int, world: int, timeout: float):
    """Rank 0's rendezvous store, listening on ``addr`` only (torch's own
    server would listen on every interface)."""
    import datetime

    import torch.distributed as dist
    fd = _listening_socket(addr, port)
    try:
        return dist.TCPStore(addr, port, world, True, timeout=datetime.timedelta(seconds=timeout),
                             wait_for_workers=False, master_listen_fd=fd)
    except Exception as e:
        try:
            os.close(fd)
        except OSError:
            pass
        raise TransportError(f"rank 0: cannot start the rendezvous store on {addr}:{port}: "
                             f"{str(e).splitlines()[0][:200]}") from None


def _await_listener(addr: str, port: int, rank: int, timeout: float) -> float:
    """Wait until something listens at ``addr:port``; returns the seconds left."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            socket.create_connection((addr, port), timeout=max(0.05, min(1.0, left))).close()
            return max(0.0, deadline - time.monotonic())
        except OSError as e:
            if time.monotonic() + 0.05 >= deadline:
                raise TransportError(f"rank {rank}: nothing listens at {addr}:{port} (MASTER_ADDR:MASTER_PORT): rank "
                                     f"0 did not start its rendezvous store within {timeout:g} s "
                                     f"[{e.strerror or e}]") from None
            time.sleep(0.05)


def _client_store(addr: str, port: int, world: int, rank: int, timeout: float):
    """Connect to rank 0's store, giving up after ``timeout`` seconds. torch's
    client waits without limit for a listener that accepts and never answers,
    so it connects in a daemon thread that is abandoned at the deadline."""
    import datetime

    import torch.distributed as dist
    left = _await_listener(addr, port, rank, timeout)
    box: list = []

    def connect():
        try:
            box.append(dist.TCPStore(addr, port, world, False, timeout=datetime.timedelta(seconds=max(left, 0.1))))
        except Exception as e:  # reported below
            box.append(e)

    t = threading.Thread(target=connect, name="attnplan-store-connect", daemon=True)
    t.start()
    t.join(left + 0.5)
    if box and not isinstance(box[0], Exception):
        return box[0]
    why = f" [{str(box[0]).splitlines()[0][:200]}]" if box else \
        " (something accepted the connection but never answered: is MASTER_PORT held by another program?)"
    raise TransportError(f"rank {rank}: no rendezvous store answered at {addr}:{port} within {timeout:g} s{why}")


def init_group(rank: int, world: int, timeout: float, addr: str | None = None,
               port: int | None = None) -> None:
    """Join the default gloo group of ``world`` ranks as ``rank``, within
    ``timeout`` seconds (see the module docstring). ``addr``/``port``
    default to ``MASTER_ADDR`` (127.0.0.1 if unset) and ``MASTER_PORT``."""
    timeout = check_timeout(timeout)
    if addr is None or port is None:
        env_addr, env_port = _master_address()
        addr, port = addr or env_addr, port or env_port
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise PlanError(f"the rendezvous port must be an integer in 1..65535, got {port!r}")
    import datetime

    import torch.distributed as dist
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent hosts the store
    store = _master_store(addr, port, world, timeout) if rank == 0 and not agent else \
        _client_store(addr, port, world, rank, timeout)
    try:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
    except Exception as e:
        raise TransportError(f"rank {rank}: not every rank joined within {timeout:g} s (rendezvous at {addr}:{port}) "
                             f"[{str(e).splitlines()[0][:200]}]") from None
