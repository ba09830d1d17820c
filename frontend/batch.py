"""Batches: the sample lengths (and optional segments) one plan is built for.

A batch file is JSON — one object ``{"seqlens": [...], "segments": ..., "name": ...}``
or a list of them — or JSONL, one such object a line (blank lines skipped).
``segments``, if present, has one entry per sample: null (one ``text``
segment) or ``[[kind, length], ...]`` summing to that sample's length. Other
keys (``dist``, ``budget``, ...) are ignored. ``load_batch("FILE:NAME")``
picks the object whose ``name`` is NAME; without NAME the file must hold
exactly one. Every problem is a :class:`BatchError` with one line naming the
file (and line) and what is wrong.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from attnplan.errors import BatchError

__all__ = ["Batch", "parse_seqlens", "load_batch"]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class Batch:
    """Sample lengths, optional per-sample segments ``((kind, length), ...)``
    (None for a sample that is one ``text`` segment), and an optional name."""

    seqlens: tuple[int, ...]
    segments: tuple | None = None
    name: str | None = None

    def __post_init__(self):
        lens = tuple(self.seqlens)
        if not lens:
            raise BatchError("a batch needs at least one sample")
        for i, n in enumerate(lens):
            if not _is_int(n) or n < 1:
                raise BatchError(f"sample {i}: length {n!r} is not a positive integer")
        object.__setattr__(self, "seqlens", lens)
        if self.segments is not None:
            segs = _check_segments(self.segments, lens, "")
            object.__setattr__(self, "segments", None if all(s is None for s in segs) else segs)

    @property
    def num_tokens(self) -> int:
        return sum(self.seqlens)

    def __len__(self) -> int:
        return len(self.seqlens)


def _check_segments(segments, seqlens, where: str) -> tuple:
    if not isinstance(segments, (list, tuple)):
        raise BatchError(f"{where}segments must be a list with one entry per sample, got {type(segments).__name__}")
    if len(segments) != len(seqlens):
        raise BatchError(f"{where}segments has {len(segments)} entries but there are {len(seqlens)} samples")
    out = []
    for i, (seg, n) in enumerate(zip(segments, seqlens)):
        if seg is None:
            out.append(None)
            continue
        if not isinstance(seg, (list, tuple)) or not seg:
            raise BatchError(f"{where}segments[{i}] must be null or a non-empty list of [kind, length]")
        pairs = []
        for j, pair in enumerate(seg):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise BatchError(f"{where}segments[{i}][{j}] must be [kind, length], got {json.dumps(pair)}")
            kind, length = pair
            if not isinstance(kind, str) or not kind:
                raise BatchError(f"{where}segments[{i}][{j}]: kind must be a non-empty string, got {json.dumps(kind)}")
            if not _is_int(length) or length < 1:
                raise BatchError(f"{where}segments[{i}][{j}]: length {json.dumps(length)} is not a positive integer")
            pairs.append((kind, length))
        total = sum(length for _, length in pairs)
        if total != n:
            raise BatchError(f"{where}segments[{i}] sum to {total} but sample {i} has length {n}")
        out.append(tuple(pairs))
    return tuple(out)


def parse_seqlens(text: str) -> tuple[int, ...]:
    """``"4096,1000,300"`` -> ``(4096, 1000, 300)``; BatchError on anything else."""
    if not text or not text.strip():
        raise BatchError("empty list of sequence lengths (expected e.g. 4096,1000,300)")
    out = []
    for i, part in enumerate(text.split(",")):
        p = part.strip()
        if not p:
            raise BatchError(f"sequence lengths {text!r}: entry {i + 1} is empty")
        if not re.fullmatch(r"[+-]?[0-9]+", p):
            raise BatchError(f"sequence lengths {text!r}: {p!r} is not an integer")
        n = int(p)
        if n < 1:
            raise BatchError(f"sequence lengths {text!r}: {n} is not a positive length")
        out.append(n)
    return tuple(out)


def _records(path: str, text: str) -> list[tuple[str, object]]:
    """(where, object) for every batch object in the file; where is 'path:line: '."""
    ext = os.path.splitext(path)[1].lower()
    if ext != ".jsonl":
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            if ext == ".json" or len([ln for ln in text.splitlines() if ln.strip()]) <= 1:
                raise BatchError(f"{path}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
        else:
            if isinstance(obj, list) and obj and all(isinstance(o, dict) for o in obj):
                return [(f"{path}: item {i}: ", o) for i, o in enumerate(obj)]
            return [(f"{path}: ", obj)]
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append((f"{path}:{lineno}: ", json.loads(line)))
        except json.JSONDecodeError as e:
            raise BatchError(f"{path}:{lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
    return out


def _to_batch(where: str, obj) -> Batch:
    if not isinstance(obj, dict):
        raise BatchError(f"{where}expected a JSON object with \"seqlens\", got {type(obj).__name__}")
    if "seqlens" not in obj:
        raise BatchError(f"{where}missing \"seqlens\" (a list of positive sample lengths)")
    lens = obj["seqlens"]
    if not isinstance(lens, list) or not lens:
        raise BatchError(f"{where}\"seqlens\" must be a non-empty list of positive integers")
    for i, n in enumerate(lens):
        if not _is_int(n) or n < 1:
            raise BatchError(f"{where}seqlens[{i}] = {json.dumps(n)} is not a positive integer")
    name = obj.get("name")
    if name is not None and not isinstance(name, str):
        raise BatchError(f"{where}\"name\" must be a string, got {json.dumps(name)}")
    segments = obj.get("segments")
    if segments is not None:
        segments = _check_segments(segments, lens, where)
    return Batch(tuple(lens), segments, name)


def _label(where: str, obj) -> str:
    name = obj.get("name") if isinstance(obj, dict) else None
    if isinstance(name, str):
        return name
    loc = where.rstrip(": ").rsplit(":", 1)[-1].strip()
    return f"(unnamed, {'line ' + loc if loc.isdigit() else loc})"


def load_batch(spec: str) -> Batch:
    """``FILE`` or ``FILE:NAME`` (JSON or JSONL; see the module docstring)."""
    path, name = spec, None
    if not os.path.exists(spec) and ":" in spec:
        head, tail = spec.rsplit(":", 1)
        if head and tail:
            path, name = head, tail
    if not os.path.isfile(path):
        raise BatchError(f"batch file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise BatchError(f"{path}: cannot read: {e}") from None
    records = _records(path, text)
    if not records:
        raise BatchError(f"{path}: no batch in the file")
    if name is not None:
        hits = [(w, o) for w, o in records if isinstance(o, dict) and o.get("name") == name]
        if not hits:
            names = ", ".join(_label(w, o) for w, o in records)
            raise BatchError(f"{path}: no batch named {name!r}; the file has: {names}")
        if len(hits) > 1:
            raise BatchError(f"{path}: {len(hits)} batches are named {name!r} "
                             f"({', '.join(w.rstrip(': ') for w, _ in hits)})")
        return _to_batch(*hits[0])
    if len(records) > 1:
        names = ", ".join(_label(w, o) for w, o in records)
        raise BatchError(f"{path} has {len(records)} batches; pick one with {path}:NAME (names: {names})")
    return _to_batch(*records[0])
