"""Where the CLI writes: output files or stdout (``-``), checked before any work."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from .errors import PlanError

STDOUT = "-"


def check_output(path: str, what: str, binary: bool = False) -> None:
    """Fail before any work when ``path`` cannot be written: a folder, or in a
    folder that does not exist; ``-`` (stdout) must not be a terminal for binary data."""
    if path == STDOUT:
        if binary and sys.stdout.isatty():
            raise PlanError(f"-o -: refusing to write a binary {what} to a terminal; pipe or redirect it")
        return
    p = Path(path)
    if p.is_dir():
        raise PlanError(f"{path}: cannot write {what}: it is a directory")
    if p.exists() and not p.is_file():  # a FIFO would block until a reader comes, a device never fills
        raise PlanError(f"{path}: cannot write {what}: not a regular file")
    if not p.parent.is_dir():
        raise PlanError(f"{path}: cannot write {what}: folder {p.parent} does not exist")


def write_output(path: str, data: bytes | str, what: str) -> str:
    """Write ``data`` to ``path``, or to stdout for ``-``; returns the name to report."""
    if path == STDOUT:
        if isinstance(data, bytes):
            sys.stdout.flush()
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()
        else:
            sys.stdout.write(data)
            sys.stdout.flush()
        return "<stdout>"
    try:
        if isinstance(data, bytes):
            Path(path).write_bytes(data)
        else:
            Path(path).write_text(data, encoding="utf-8")
    except OSError as e:
        raise PlanError(f"{path}: cannot write {what}: {e.strerror or e}") from None
    return path


def summary_stream(path: str):
    """Where a command's one-line summary goes: stderr when stdout carries the output."""
    return sys.stderr if path == STDOUT else sys.stdout


@contextlib.contextmanager
def progress(total: int, what: str, enabled: bool = True):
    """A progress bar on stderr while long work runs, yielding ``advance(label)``: shown only on a terminal
    (quiet when stderr is piped or redirected, or when ``enabled`` is false)."""
    if not (enabled and total > 1 and sys.stderr.isatty()):
        yield lambda label=None: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(what, total=total)

        def advance(label=None) -> None:
            bar.update(task, advance=1, description=f"{what} {label}" if label else what)
        yield advance


def shows_progress(no_progress: bool) -> bool:
    """Whether long work draws its progress bar: asked for, and on a terminal."""
    return not no_progress and sys.stderr.isatty()
