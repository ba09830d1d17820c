"""Asynchronous planning: compile upcoming batches in worker processes while
the current step trains (every production system of the survey plans ahead).

Plans cross processes as plan-file bytes (:meth:`Plan.to_bytes` /
:meth:`Plan.from_bytes`: checked and verified on arrival, never pickled). A
planning error is raised in the training process, when its batch comes up,
as the same typed error with the same fields (``MaskError.line`` ...) and
the batch named. A worker that dies (killed, out of memory) gives a
:class:`~attnplan.errors.PlanError` for the batch asked for; the workers are
restarted and the batches in flight planned again, until workers have died
``MAX_RESTARTS`` times in a row, after which the prefetcher says it is
closed. This module does not import torch: workers start in well under a
second.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import pickle
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from .plan import Plan
from .compiler import compile as compile_plan
from ..errors import AttnplanError, PlanError
from ..ir.limits import MAX_PREFETCH

WORKER_DIED = ("a planning worker process died (killed, out of memory, or started by a script outside "
               "`if __name__ == '__main__':` — each spawned worker imports the script)")

_BATCH_KEYS = ("seqlens", "segments")
MAX_RESTARTS = 3  # worker deaths in a row after which the prefetcher gives up


def _batch_spec(batch, i: int):
    """(name, seqlens, segments) of a batch: a list of lengths, a dict like a
    line of ``batches.jsonl`` (``seqlens``, optional ``segments`` and
    ``name``), or an object with those attributes (``frontend.Batch``)."""
    if isinstance(batch, dict):
        if "seqlens" not in batch:
            raise PlanError(f"batch #{i}: a batch dict needs 'seqlens'")
        return str(batch.get("name", f"#{i}")), batch["seqlens"], batch.get("segments")
    if hasattr(batch, "seqlens"):
        return str(getattr(batch, "name", None) or f"#{i}"), batch.seqlens, getattr(batch, "segments", None)
    if isinstance(batch, (list, tuple)) or hasattr(batch, "__array__"):
        return f"#{i}", list(batch), None
    raise PlanError(f"batch #{i}: expected a list of sequence lengths or a dict with 'seqlens', got "
                    f"{type(batch).__name__}")


def compile_to_bytes(seqlens, segments, kwargs: dict):
    """Worker side: ``("ok", plan bytes)`` or ``("error", AttnplanError)`` (the
    error itself: it pickles with its class and fields)."""
    try:
        plan = compile_plan(seqlens=seqlens, segments=segments, **kwargs)
        return ("ok", plan.to_bytes())
    except AttnplanError as e:
        err = e
    except Exception as e:  # a bug, not bad input: still name the batch in the training process
        err = PlanError(f"planning failed: {type(e).__name__}: {e}")
    try:
        pickle.dumps(err)
    except Exception:
        err = PlanError(f"planning failed: {type(err).__name__}: {err}")
    return ("error", err)


@dataclasses.dataclass(frozen=True)
class _Item:
    """A batch in flight: its plan's future (``None``: compiled when asked
    for, in this process) or the error to raise when it comes up."""

    batch: object
    name: str
    seqlens: object
    segments: object
    future: Future | None = None
    error: PlanError | None = None


def _check_count(name: str, v, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= MAX_PREFETCH:
        raise PlanError(f"PlanPrefetcher: {name} must be an integer in {lo}..{MAX_PREFETCH}, got {v!r}")
    return v


class PlanPrefetcher:
    """Iterate ``(batch, plan)`` pairs, compiling ahead in ``workers`` processes.

    ``batches``: any iterable of batches (lists of lengths, dicts with
    ``seqlens``/``segments``/``name``, or ``frontend.Batch``); consumed
    lazily. ``compile_kwargs``: every other argument of ``attnplan.compile``
    (mask, devices, heads, strategy, ...). ``workers=0`` compiles in this
    process when a batch is asked for. ``lookahead``: batches in flight
    (default ``2 * workers``). ``compile_fn``/``decode``: another kind of
    plan (the step loader's): a module-level ``compile_fn(seqlens, segments,
    kwargs)`` returning what :func:`compile_to_bytes` returns, run in the
    workers, and ``decode(bytes, source)`` run on arrival (default: attention
    plans, ``Plan.from_bytes``). Use as a context manager (or call
    :meth:`close`) to stop the workers early::

        with attnplan.PlanPrefetcher(batches, dict(mask="causal", devices=2), workers=2) as pf:
            for batch, plan in pf:
                train_step(batch, plan)

    A planning error of one batch is raised when that batch comes up; the
    following batches still come. A dead worker process raises
    :class:`PlanError` for the batch asked for (see the module docstring).
    """

    def __init__(self, batches, compile_kwargs: dict | None = None, workers: int = 1, lookahead: int | None = None,
                 mp_context: str = "spawn", compile_fn=None, decode=None):
        if compile_kwargs is not None and not isinstance(compile_kwargs, dict):
            raise PlanError(f"PlanPrefetcher: compile_kwargs must be a dict, got {type(compile_kwargs).__name__}")
        kwargs = dict(compile_kwargs or {})
        bad = [k for k in _BATCH_KEYS if k in kwargs]
        if bad:
            raise PlanError(f"PlanPrefetcher: {', '.join(bad)} come from each batch, not from compile_kwargs")
        workers = _check_count("workers", workers, 0)
        lookahead = _check_count("lookahead", max(1, 2 * workers) if lookahead is None else lookahead, 1)
        try:
            self._ctx = multiprocessing.get_context(mp_context)
        except (ValueError, TypeError):
            raise PlanError(f"PlanPrefetcher: mp_context must be one of "
                            f"{', '.join(multiprocessing.get_all_start_methods())}, got {mp_context!r}") from None
        try:
            self._it = enumerate(iter(batches))
        except TypeError:
            raise PlanError(f"PlanPrefetcher: batches must be iterable, got {type(batches).__name__}") from None
        self.kwargs, self.workers, self.lookahead = kwargs, workers, lookahead
        # hook for other plan kinds (tools/step_loader.py): a module-level worker function like
        # compile_to_bytes, and decode(bytes, source) for its bytes, called in this process
        self._compile = compile_to_bytes if compile_fn is None else compile_fn
        self._decode = Plan.from_bytes if decode is None else decode
        self._queue: deque[_Item] = deque()
        self._pool = ProcessPoolExecutor(workers, mp_context=self._ctx) if workers else None
        self._done = False
        self._closed: str | None = None  # why the prefetcher cannot go on, once it cannot
        self._deaths = 0
        self._fill()

    def _fill(self) -> None:
        while self._pool is not None and not self._done and len(self._queue) < self.lookahead:
            if not self._pull():
                break

    def _pull(self) -> bool:
        try:
            i, batch = next(self._it)
        except StopIteration:
            self._done = True
            return False
        try:
            name, lens, segs = _batch_spec(batch, i)
        except PlanError as e:  # raised when this batch comes up
            self._queue.append(_Item(batch, f"#{i}", None, None, None, e))
            return True
        future = self._submit(lens, segs)  # first: a restart inside it resubmits the queue
        self._queue.append(_Item(batch, name, lens, segs, future))
        return True

    def _submit(self, lens, segs):
        """A future of this batch's plan; a pool whose workers died while idle
        is restarted first (the batches in flight are submitted again)."""
        if self._pool is None:
            return None
        try:
            return self._pool.submit(self._compile, lens, segs, self.kwargs)
        except BrokenProcessPool:
            self._restart("(between batches)")
            if self._pool is None:  # closed: deaths repeated; __next__ says so
                return None
            return self._pool.submit(self._compile, lens, segs, self.kwargs)

    def __iter__(self):
        return self

    def __next__(self):
        if self._closed is not None:
            raise PlanError(f"PlanPrefetcher is closed: {self._closed}")
        if not self._queue and (self._done or not self._pull()):
            self.close()
            raise StopIteration
        item = self._queue.popleft()
        if item.error is not None:
            self._fill()
            raise item.error
        res = self._result(item)
        self._fill()
        if res[0] == "error":
            raise res[1].with_prefix(f"batch {item.name}: ")
        return item.batch, self._decode(res[1], f"<plan of batch {item.name}>")

    def _result(self, item: "_Item"):
        if item.future is None:
            return self._compile(item.seqlens, item.segments, self.kwargs)
        try:
            res = item.future.result()
        except BrokenProcessPool:
            self._restart(item.name)
            raise PlanError(f"batch {item.name}: {WORKER_DIED} before this batch was planned; "
                            f"{self._after_death()}") from None
        except Exception as e:  # the batch could not be handed to a worker (e.g. it does not pickle)
            raise PlanError(f"batch {item.name}: cannot send the batch to a planning worker: "
                            f"{type(e).__name__}: {str(e)[:200]}") from None
        self._deaths = 0
        return res

    def _restart(self, name: str) -> None:
        """A worker died: every future of the pool is lost. Start new workers
        and submit the batches in flight again (unless deaths repeat)."""
        self._deaths += 1
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = None
        if self._deaths >= MAX_RESTARTS:
            self._closed = f"planning workers died {self._deaths} times in a row (last at batch {name})"
            self._queue.clear()
            return
        self._pool = ProcessPoolExecutor(self.workers, mp_context=self._ctx)
        pending = list(self._queue)
        self._queue.clear()  # the same deque, refilled: callers may hold it
        self._queue.extend(it if it.error is not None else
                           dataclasses.replace(it, future=self._submit(it.seqlens, it.segments)) for it in pending)

    def _after_death(self) -> str:
        if self._closed is not None:
            return f"the prefetcher is now closed: {self._closed}"
        return "the workers were restarted and the following batches are planned again"

    def close(self) -> None:
        """Stop the workers (pending compiles are cancelled)."""
        self._done = True
        for it in self._queue:
            if it.future is not None:
                it.future.cancel()
        self._queue.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):  # pragma: no cover - best effort
        try:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
        except Exception:
            pass
