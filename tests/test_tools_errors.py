"""Errors across processes and the orchestration tools under failure (issue 8,
defects 5, 7 and 9): typed errors keep their fields when pickled and when
they come from a PlanPrefetcher worker; a dead worker gives a PlanError and
the prefetcher goes on (or says it is closed); the rendezvous of ``plan run``
listens on 127.0.0.1 only and every way of failing to join gives one typed
error within the timeout."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

import attnplan
from attnplan import errors
from attnplan.runtime import rendezvous
from attnplan.tools import launch
from attnplan.tools.prefetch import MAX_RESTARTS

KW = dict(mask="causal", devices=2, heads=2, kv_heads=1, head_dim=8, block_size=16)
ERROR_CLASSES = [c for c in vars(errors).values()
                 if isinstance(c, type) and issubclass(c, errors.AttnplanError)]


# ---------------------------------------------------------------- pickling

@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_every_error_pickles_with_class_message_and_fields(cls):
    e = cls("device 3: something precise") if cls is not errors.MaskError else \
        cls("unknown mask 'caus'", "m.mask", 2, 5, "full\n(caus | full)\n")
    e.extra = {"peer": 1}  # fields set after construction travel too
    got = pickle.loads(pickle.dumps(e))
    assert type(got) is cls and str(got) == str(e) and got.args == e.args
    assert got.__dict__ == e.__dict__


def test_mask_error_fields_survive_pickling():
    e = errors.MaskError("expected ')'", "x.mask", 1, 9, "causal & (k < 3")
    got = pickle.loads(pickle.dumps(e))
    assert (got.message, got.filename, got.line, got.col, got.text) == \
        ("expected ')'", "x.mask", 1, 9, "causal & (k < 3")
    assert str(got) == "x.mask:1:9: expected ')'\n  causal & (k < 3\n          ^"
    prefixed = got.with_prefix("batch 4: ")
    assert type(prefixed) is errors.MaskError and str(prefixed).startswith("batch 4: x.mask:1:9: ")
    assert (prefixed.line, prefixed.col, prefixed.message) == (1, 9, "expected ')'")


# ---------------------------------------------------------------- PlanPrefetcher

def test_mask_error_from_a_worker_keeps_its_fields():
    text = "causal &\n  (k < 3 |"
    with pytest.raises(attnplan.MaskError) as info:
        parsed_here = None
        try:
            attnplan.compile(seqlens=[10], **dict(KW, mask=text))
        except attnplan.MaskError as e:
            parsed_here = e
        with attnplan.PlanPrefetcher([[10]], dict(KW, mask=text), workers=1) as pf:
            next(pf)
    got = info.value
    assert parsed_here is not None and parsed_here.line > 0  # the mask error has a position
    assert (got.line, got.col, got.message, got.filename, got.text) == \
        (parsed_here.line, parsed_here.col, parsed_here.message, parsed_here.filename, parsed_here.text)
    assert str(got) == f"batch #0: {parsed_here}"


class _KillsItsProcess:
    """Unpickled in a worker, this ends the worker process (exit code 3)."""

    def __reduce__(self):
        return os._exit, (3,)


def test_a_dead_worker_gives_plan_error_and_the_prefetcher_goes_on():
    batches = [[40, 9], [_KillsItsProcess()], [17], {"name": "last", "seqlens": [5, 5]}]
    got = []
    with attnplan.PlanPrefetcher(batches, KW, workers=1, lookahead=3) as pf:
        got.append(next(pf)[0])
        with pytest.raises(attnplan.PlanError, match=r"^batch #1: a planning worker process died .* restarted"):
            next(pf)
        for batch, plan in pf:
            got.append(batch)
            assert plan.devices == 2
    assert got == [[40, 9], [17], {"name": "last", "seqlens": [5, 5]}]


def test_workers_killed_while_idle_lose_no_batch():
    """Every worker SIGKILLed between batches (the pool breaks on the next
    submit): the prefetcher restarts it and still delivers every batch, in
    order (before: a raw BrokenProcessPool, and the batch being pulled went
    to a discarded queue)."""
    import multiprocessing
    import signal
    import time
    batches = [[200 + i, 64] for i in range(8)]
    got = []
    with attnplan.PlanPrefetcher(iter(batches), KW, workers=2, lookahead=3) as pf:
        got.append(next(pf)[0])
        deadline = time.monotonic() + 60
        while not all(it.future.done() for it in pf._queue) and time.monotonic() < deadline:
            time.sleep(0.05)
        for child in multiprocessing.active_children():
            os.kill(child.pid, signal.SIGKILL)
        time.sleep(0.5)
        got += [batch for batch, _ in pf]
    assert got == batches


def test_workers_that_keep_dying_close_the_prefetcher_clearly():
    batches = [[_KillsItsProcess()] for _ in range(MAX_RESTARTS + 2)]
    pf = attnplan.PlanPrefetcher(batches, KW, workers=1, lookahead=1)
    try:
        for _ in range(MAX_RESTARTS - 1):
            with pytest.raises(attnplan.PlanError, match="restarted"):
                next(pf)
        with pytest.raises(attnplan.PlanError, match=f"now closed: planning workers died {MAX_RESTARTS} times"):
            next(pf)
        with pytest.raises(attnplan.PlanError, match="^PlanPrefetcher is closed: planning workers died"):
            next(pf)
    finally:
        pf.close()


@pytest.mark.parametrize("kwargs,msg", [
    (dict(batches=5), "batches must be iterable"),
    (dict(workers=10 ** 9), "workers must be an integer in 0..1024"),
    (dict(lookahead=2.5), "lookahead must be an integer"),
    (dict(mp_context="threads"), "mp_context must be one of"),
    (dict(compile_kwargs=[("mask", "causal")]), "compile_kwargs must be a dict"),
])
def test_prefetcher_options_are_checked(kwargs, msg):
    kwargs = dict(dict(batches=[[4]], compile_kwargs=KW), **kwargs)
    with pytest.raises(attnplan.PlanError, match=msg):
        attnplan.PlanPrefetcher(**kwargs)


def test_a_batch_of_the_wrong_type_is_named_when_it_comes_up():
    with attnplan.PlanPrefetcher([[8], 7, [9]], KW, workers=0) as pf:
        assert next(pf)[0] == [8]
        with pytest.raises(attnplan.PlanError, match="batch #1: expected a list of sequence lengths"):
            next(pf)
        assert next(pf)[0] == [9]


# ---------------------------------------------------------------- launcher

def test_root_cause_names_the_failing_rank_not_the_stopped_one():
    joined = "rank 0: not every rank joined within 2 s (rendezvous at 127.0.0.1:5) [wait timeout]"
    assert launch._root_cause([(0, 2, joined, ""), (1, None, "", "")]) == joined
    assert launch._root_cause([(0, 0, "", ""), (1, None, "", "")]) == "rank 1 did not finish (stopped by the launcher)"
    foreign = "rank 1: no rendezvous store answered at 127.0.0.1:5 within 2 s (something accepted ...)"
    assert launch._root_cause([(0, 2, joined, ""), (1, 2, foreign, "")]) == foreign


@pytest.mark.parametrize("timeout", [0, -1, float("inf"), float("nan"), 10 ** 9, "5", True])
def test_bad_timeouts_are_refused(timeout):
    with pytest.raises(attnplan.PlanError, match="timeout must be positive finite seconds"):
        rendezvous.check_timeout(timeout)


def test_rank_mode_without_master_port(monkeypatch):
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(attnplan.PlanError, match="rank mode needs MASTER_PORT"):
        rendezvous.init_group(1, 2, 5.0)
    monkeypatch.setenv("MASTER_PORT", "99999")
    with pytest.raises(attnplan.PlanError, match=r"MASTER_PORT must be an integer in 1\.\.65535"):
        rendezvous.init_group(1, 2, 5.0)


JOINS = textwrap.dedent("""
    import json, os, socket, sys, threading, time
    import torch.distributed  # imported before the clocks start
    from attnplan.errors import AttnplanError
    from attnplan.runtime import rendezvous

    T = 1.0
    out = {}

    def port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def attempt(name, rank, p):
        os.environ["MASTER_PORT"] = str(p)
        t0 = time.monotonic()
        try:
            rendezvous.init_group(rank, 2, T)
            out[name] = ["joined", "", time.monotonic() - t0]
        except AttnplanError as e:
            out[name] = [type(e).__name__, str(e), time.monotonic() - t0]

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(8)
    attempt("port in use", 0, busy.getsockname()[1])
    attempt("never joins", 0, port())
    attempt("no rank 0", 1, port())
    conns = []
    threading.Thread(target=lambda: [conns.append(busy.accept()) for _ in range(8)], daemon=True).start()
    attempt("foreign listener", 1, busy.getsockname()[1])

    p = port()  # the store listens on the given address only
    store = rendezvous._master_store("127.0.0.1", p, 1, 5.0)
    listening = []
    for f in ("/proc/net/tcp", "/proc/net/tcp6"):
        if os.path.exists(f):
            for line in open(f).read().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == p:
                    listening.append(local.rsplit(":", 1)[0])
    out["listening"] = listening
    print(json.dumps(out))
    sys.stdout.flush()
    os._exit(0)  # the abandoned connect thread of the foreign-listener case stays blocked in torch
""")


@pytest.fixture(scope="module")
def joins():
    env = dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR")
    env.pop("ATTNPLAN_STORE_FD", None)
    r = subprocess.run([sys.executable, "-c", JOINS], capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case,kind,msg", [
    ("port in use", "TransportError", "rank 0: the rendezvous port MASTER_PORT=.* on 127.0.0.1 is already in use"),
    ("never joins", "TransportError", r"rank 0: not every rank joined within 1 s \(rendezvous at 127.0.0.1:"),
    ("no rank 0", "TransportError", "rank 1: nothing listens at 127.0.0.1:.*rank 0 did not start its rendezvous"),
    ("foreign listener", "TransportError", "rank 1: no rendezvous store answered at 127.0.0.1:.* within 1 s "
                                           r"\(something accepted the connection but never answered"),
])
def test_failing_to_join_is_one_typed_error_within_the_timeout(joins, case, kind, msg):
    import re
    got_kind, got_msg, seconds = joins[case]
    assert got_kind == kind and re.match(msg, got_msg), (got_kind, got_msg)
    assert "\n" not in got_msg
    assert seconds < 1.0 + 1.5, f"{case}: {seconds:.2f} s for a 1 s timeout"


def test_the_rendezvous_store_listens_on_loopback_only(joins):
    # /proc/net/tcp writes 127.0.0.1 as 0100007F; every interface would be 00000000 (or :: in tcp6)
    assert joins["listening"] == ["0100007F"], joins["listening"]
