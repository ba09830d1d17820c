"""Per-sample segment structure: the one check shared by batch files (frontend)
and plan files (backends).

``segments`` has one entry per sample: ``None`` (the sample is one ``text``
segment) or a non-empty list of ``[kind, length]`` pairs, ``kind`` a
non-empty string and ``length`` a positive integer, summing to the sample's
length. :func:`check_segments` returns the normalized tuple form
``(((kind, length), ...) | None, ...)`` or raises :class:`BatchError` with one
line naming the entry (prefixed by ``where``). A batch has at most
``MAX_SEGMENTS`` segments in all.
"""

from __future__ import annotations

import json

from ..errors import BatchError
from .limits import MAX_SEGMENTS

__all__ = ["check_segments"]

_SHOWN = 200  # characters of an offending value quoted in a message


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _show(v) -> str:
    """``v`` as JSON (any value: bytes or other non-JSON values from a plan file are shown by repr), cut short."""
    try:
        text = json.dumps(v, default=repr)
    except (ValueError, RecursionError):  # circular or absurdly deep: never from a decoder, but never crash
        text = f"<{type(v).__name__}>"
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


def _check_pair(pair, where: str, i: int, j: int) -> tuple[str, int]:
    if not isinstance(pair, (list, tuple)) or len(pair) != 2:
        raise BatchError(f"{where}segments[{i}][{j}] must be [kind, length], got {_show(pair)}")
    kind, length = pair
    if not isinstance(kind, str) or not kind:
        raise BatchError(f"{where}segments[{i}][{j}]: kind must be a non-empty string, got {_show(kind)}")
    if not _is_int(length) or length < 1:
        raise BatchError(f"{where}segments[{i}][{j}]: length {_show(length)} is not a positive integer")
    return kind, length


def _check_sample(seg, n: int, where: str, i: int) -> tuple | None:
    if seg is None:
        return None
    if not isinstance(seg, (list, tuple)) or not seg:
        raise BatchError(f"{where}segments[{i}] must be null or a non-empty list of [kind, length]")
    pairs = tuple(_check_pair(pair, where, i, j) for j, pair in enumerate(seg))
    total = sum(length for _, length in pairs)  # Python ints: no overflow
    if total != n:
        raise BatchError(f"{where}segments[{i}] sum to {total} but sample {i} has length {n}")
    return pairs


def check_segments(segments, seqlens, where: str) -> tuple:
    """Check ``segments`` against the sample lengths ``seqlens`` (a sequence of
    ints); return the normalized tuple form (see the module doc)."""
    if not isinstance(segments, (list, tuple)):
        raise BatchError(f"{where}segments must be a list with one entry per sample, got {type(segments).__name__}")
    if len(segments) != len(seqlens):
        raise BatchError(f"{where}segments has {len(segments)} entries but there are {len(seqlens)} samples")
    total = sum(len(seg) for seg in segments if isinstance(seg, (list, tuple)))
    if total > MAX_SEGMENTS:
        raise BatchError(f"{where}segments has {total} segments in all, more than MAX_SEGMENTS = {MAX_SEGMENTS}")
    return tuple(_check_sample(seg, int(n), where, i) for i, (seg, n) in enumerate(zip(segments, seqlens)))
