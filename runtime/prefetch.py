"""Asynchronous planning: compile upcoming batches in worker processes while
the current step trains (every production system of the survey plans ahead).

Plans cross processes as plan-file bytes (:meth:`Plan.to_bytes` /
:meth:`Plan.from_bytes`: checked and verified on arrival, never pickled). A
planning error is raised in the training process, when its batch comes up,
as the same typed error with the batch named. This module does not import
torch: workers start in well under a second.
"""

from __future__ import annotations

import multiprocessing
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from .. import errors
from ..errors import AttnplanError, PlanError

_BATCH_KEYS = ("seqlens", "segments")


def _batch_spec(batch, i: int):
    """(name, seqlens, segments) of a batch: a list of lengths, a dict like a
    line of ``batches.jsonl`` (``seqlens``, optional ``segments`` and
    ``name``), or an object with those attributes (``frontend.Batch``)."""
    if isinstance(batch, dict):
        if "seqlens" not in batch:
            raise PlanError(f"batch #{i}: a batch dict needs 'seqlens'")
        return str(batch.get("name", f"#{i}")), list(batch["seqlens"]), batch.get("segments")
    if hasattr(batch, "seqlens"):
        return str(getattr(batch, "name", None) or f"#{i}"), list(batch.seqlens), getattr(batch, "segments", None)
    try:
        return f"#{i}", [x for x in batch], None
    except TypeError:
        raise PlanError(f"batch #{i}: expected a list of sequence lengths or a dict with 'seqlens', got "
                        f"{type(batch).__name__}") from None


def compile_to_bytes(seqlens, segments, kwargs: dict):
    """Worker side: ``("ok", plan bytes)`` or ``("error", class name, message)``."""
    from ..api import compile as compile_plan
    try:
        plan = compile_plan(seqlens=seqlens, segments=segments, **kwargs)
        return ("ok", plan.to_bytes())
    except AttnplanError as e:
        return ("error", type(e).__name__, str(e))
    except Exception as e:  # a bug, not bad input: still name the batch in the training process
        return ("error", "", f"{type(e).__name__}: {e}")


def _raise(kind: str, message: str, name: str):
    cls = getattr(errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, AttnplanError)):
        cls = PlanError
        message = f"planning failed: {message}"
    err = cls.__new__(cls)
    Exception.__init__(err, f"batch {name}: {message}")
    raise err


class PlanPrefetcher:
    """Iterate ``(batch, plan)`` pairs, compiling ahead in ``workers`` processes.

    ``batches``: any iterable of batches (lists of lengths, dicts with
    ``seqlens``/``segments``/``name``, or ``frontend.Batch``); consumed
    lazily. ``compile_kwargs``: every other argument of ``attnplan.compile``
    (mask, devices, heads, strategy, ...). ``workers=0`` compiles in this
    process when a batch is asked for. ``lookahead``: batches in flight
    (default ``2 * workers``). Use as a context manager (or call
    :meth:`close`) to stop the workers early::

        with attnplan.PlanPrefetcher(batches, dict(mask="causal", devices=2), workers=2) as pf:
            for batch, plan in pf:
                train_step(batch, plan)
    """

    def __init__(self, batches, compile_kwargs: dict | None = None, workers: int = 1, lookahead: int | None = None,
                 mp_context: str = "spawn"):
        kwargs = dict(compile_kwargs or {})
        bad = [k for k in _BATCH_KEYS if k in kwargs]
        if bad:
            raise PlanError(f"PlanPrefetcher: {', '.join(bad)} come from each batch, not from compile_kwargs")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise PlanError(f"PlanPrefetcher: workers must be a non-negative integer, got {workers!r}")
        if lookahead is None:
            lookahead = max(1, 2 * workers)
        if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 1:
            raise PlanError(f"PlanPrefetcher: lookahead must be a positive integer, got {lookahead!r}")
        self.kwargs, self.workers, self.lookahead = kwargs, workers, lookahead
        self._it = enumerate(iter(batches))
        self._queue: deque = deque()
        self._pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(mp_context)) \
            if workers else None
        self._done = False
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
        name, lens, segs = _batch_spec(batch, i)
        fut = self._pool.submit(compile_to_bytes, lens, segs, self.kwargs) if self._pool is not None else None
        self._queue.append((batch, name, lens, segs, fut))
        return True

    def __iter__(self):
        return self

    def __next__(self):
        if not self._queue and (self._done or not self._pull()):
            self.close()
            raise StopIteration
        batch, name, lens, segs, fut = self._queue.popleft()
        self._fill()
        if fut is None:
            res = compile_to_bytes(lens, segs, self.kwargs)
        else:
            try:
                res = fut.result()
            except BrokenProcessPool:
                self.close()
                raise PlanError(f"batch {name}: the planning worker process died") from None
        if res[0] == "error":
            _raise(res[1], res[2], name)
        from ..api import Plan
        return batch, Plan.from_bytes(res[1], f"<plan of batch {name}>")

    def close(self) -> None:
        """Stop the workers (pending compiles are cancelled)."""
        self._done = True
        for *_, fut in self._queue:
            if fut is not None:
                fut.cancel()
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
