"""Typed exceptions. The CLI turns every ``AttnplanError`` into one line on
stderr and exit code 2; the API raises them as they are."""

from __future__ import annotations

import unicodedata


def _rebuild(cls: type[AttnplanError], args: tuple, fields: dict) -> AttnplanError:
    """Unpickle an error without calling ``__init__`` (subclasses take other
    arguments than their message): the same class, message and fields."""
    err = Exception.__new__(cls)
    err.args = args
    err.__dict__.update(fields)
    return err


class AttnplanError(Exception):
    """Base class of every error caused by bad input.

    Errors keep their class, message and fields (``MaskError.line`` ...)
    when pickled, so they cross processes (a ``PlanPrefetcher`` worker)
    unchanged."""

    def __reduce__(self):
        return _rebuild, (type(self), self.args, dict(self.__dict__))

    def with_prefix(self, prefix: str) -> "AttnplanError":
        """A copy (same class and fields) whose message starts with ``prefix``,
        e.g. ``"batch 7: "``."""
        err = _rebuild(type(self), self.args, dict(self.__dict__))
        err.args = (prefix + str(self),)
        return err


class MaskError(AttnplanError):
    """Bad mask text: unknown name, wrong arity, bad parameter, syntax error.

    ``str()`` is ``file:line:col: message`` followed by the offending line and a caret."""

    def __init__(self, message: str, filename: str = "<mask>", line: int = 0, col: int = 0, text: str = ""):
        self.message, self.filename, self.line, self.col, self.text = message, filename, line, col, text
        super().__init__(self._render())

    def _render(self) -> str:
        if not self.line:
            return f"{self.filename}: {self.message}"
        lines = self.text.splitlines() if self.text else []
        src = lines[self.line - 1] if self.line <= len(lines) else ""
        src, at = _window(src, max(0, self.col - 1))
        return f"{self.filename}:{self.line}:{self.col}: {self.message}\n  {src}\n  {_pad(src[:at])}^"


def _pad(prefix: str) -> str:
    """Blank space as wide on a terminal as ``prefix``, so a caret after it stands under the next
    character: its tabs kept (the same tab stops), two spaces for a wide or fullwidth character (CJK),
    none for a combining mark, one for anything else."""
    return "".join("\t" if c == "\t" else "" if unicodedata.combining(c) else
                   "  " if unicodedata.east_asian_width(c) in ("W", "F") else " " for c in prefix)


_WINDOW = 100  # characters of a long source line shown on each side of the caret


def _window(src: str, at: int) -> tuple[str, int]:
    """The part of ``src`` around column ``at`` (0-based) that an error shows, and the caret's column in
    it: a generated mask can be one line of megabytes, and its error must stay one screen."""
    if len(src) <= 2 * _WINDOW + 1:
        return src, at
    lo = max(0, min(at - _WINDOW, len(src) - 2 * _WINDOW - 1))
    head = "..." if lo else ""
    tail = "..." if lo + 2 * _WINDOW + 1 < len(src) else ""
    return head + src[lo:lo + 2 * _WINDOW + 1] + tail, at - lo + len(head)


class BatchError(AttnplanError):
    """Bad batch spec: file missing or unparsable, bad lengths or segments."""


class PlanFileError(AttnplanError):
    """A plan file that is truncated, altered, of another version, or malformed."""


class PlanError(AttnplanError):
    """A plan that cannot be built or used as asked (bad options, device count mismatch)."""


class VerifyError(AttnplanError):
    """An IR invariant does not hold; the message names the pass, block and device."""


class ShapeError(AttnplanError):
    """Tensors given to the runtime do not match the plan."""


class DeadlockError(AttnplanError):
    """No device can make progress; the message names the devices and transfer keys."""


class TransportError(AttnplanError):
    """A peer died, or a transfer or the plan handshake did not complete within
    the timeout; the message names the peer (device and rank) and the transfer key."""


class StepError(AttnplanError):
    """A training step that cannot be planned as asked: bad model, mesh or
    system options, or a document no group of the mesh can hold."""


class MemoryCapError(StepError):
    """A device of a step plan over its memory cap; the message names the
    device, the micro-batch and the bytes (also ``device``, ``micro_batch``,
    ``bytes``, ``cap``)."""

    def __init__(self, message: str, device: int = -1, micro_batch: int = -1, nbytes: int = 0, cap: int = 0):
        self.device, self.micro_batch, self.bytes, self.cap = device, micro_batch, nbytes, cap
        super().__init__(message)
