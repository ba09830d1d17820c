"""Batches: the sample lengths (and optional segments) one plan is built for.

A batch file is JSON — one object ``{"seqlens": [...], "segments": ..., "name": ...}``
or a list of them — or JSONL, one such object a line (blank lines skipped).
A cross-attention batch has ``"seqlens_q"`` and ``"seqlens_k"`` (each sample's
query and key lengths) instead of ``"seqlens"``, and no segments.
``segments``, if present, has one entry per sample: null (one ``text``
segment) or ``[[kind, length], ...]`` summing to that sample's length. Other
keys (``dist``, ``budget``, ...) are ignored. ``load_batch("FILE:NAME")``
picks the object whose ``name`` is NAME; without NAME the file must hold
exactly one. Every problem is a :class:`BatchError` with one line naming the
file (and line) and what is wrong.

Sizes are checked before anything proportional to them is built: a file
against ``MAX_BATCH_FILE`` bytes (before it is read), a batch against
``MAX_SAMPLES`` samples and ``MAX_TOKENS`` tokens, and every length against
``MAX_TOKENS`` (so ``--seqlens 10**30`` is an error, not an overflow).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import numpy as np

from attnplan.errors import BatchError
from attnplan.ir.limits import MAX_BATCH_FILE, MAX_SAMPLES, MAX_TOKENS
from attnplan.ir.segments import check_segments

__all__ = ["Batch", "parse_batch_text", "parse_seqlens", "load_batch"]

_MAX_DIGITS = len(str(MAX_TOKENS))
_JSON_DIGITS = 100  # digits of any integer in a batch file


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _show(v) -> str:
    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= 80 else text[:80] + "..."


def _check_lengths(lens, where: str, name: str) -> tuple[int, ...]:
    """``lens`` as a tuple of ints within the limits; BatchError naming the first bad entry."""
    if len(lens) > MAX_SAMPLES:
        raise BatchError(f"{where}{len(lens):,} samples; a batch has at most MAX_SAMPLES = {MAX_SAMPLES:,} "
                         f"(ir/limits.py)")
    for i, n in enumerate(lens):
        if not _is_int(n) or n < 1:
            raise BatchError(f"{where}{name}[{i}] = {_show(n)} is not a positive integer")
        if n > MAX_TOKENS:
            raise BatchError(f"{where}{name}[{i}] = {n} is more than MAX_TOKENS = {MAX_TOKENS:,} tokens (ir/limits.py)")
    total = sum(int(n) for n in lens)
    if total > MAX_TOKENS:
        raise BatchError(f"{where}the batch has {total:,} tokens; at most MAX_TOKENS = {MAX_TOKENS:,} (ir/limits.py)")
    return tuple(int(n) for n in lens)


@dataclass(frozen=True)
class Batch:
    """Sample lengths, optional per-sample segments ``((kind, length), ...)``
    (None for a sample that is one ``text`` segment), and an optional name.
    Cross-attention: ``seqlens_k`` holds each sample's key length, and
    ``seqlens`` its query length."""

    seqlens: tuple[int, ...]
    segments: tuple | None = None
    name: str | None = None
    seqlens_k: tuple[int, ...] | None = None

    def __post_init__(self):
        try:
            count = len(self.seqlens)
        except TypeError:
            raise BatchError(f"seqlens must be a sequence of positive integers, "
                             f"got {type(self.seqlens).__name__}") from None
        if not count:
            raise BatchError("a batch needs at least one sample")
        lens = _check_lengths(self.seqlens, "", "seqlens")
        object.__setattr__(self, "seqlens", lens)
        if self.segments is not None:
            segs = check_segments(self.segments, lens, "")
            object.__setattr__(self, "segments", None if all(s is None for s in segs) else segs)
        if self.seqlens_k is not None:
            object.__setattr__(self, "seqlens_k", _cross_lengths(lens, self.seqlens_k, self.segments, ""))

    def compile_args(self) -> dict:
        """The batch as :func:`attnplan.compile` keywords."""
        if self.seqlens_k is not None:
            return {"seqlens_q": list(self.seqlens), "seqlens_k": list(self.seqlens_k)}
        return {"seqlens": self.seqlens, "segments": self.segments}

    @property
    def num_tokens(self) -> int:
        return sum(self.seqlens)

    def __len__(self) -> int:
        return len(self.seqlens)


def _cross_lengths(q: tuple, k, segments, where: str) -> tuple[int, ...]:
    """Key lengths of a cross-attention batch with query lengths ``q``, checked."""
    if not isinstance(k, (list, tuple)):
        raise BatchError(f"{where}\"seqlens_k\" must be a list of positive integers, got {_show(k)}")
    k = _check_lengths(k, where, "seqlens_k")
    if len(k) != len(q):
        raise BatchError(f"{where}{len(q)} query lengths and {len(k)} key lengths: one of each per sample")
    if segments is not None:
        raise BatchError(f"{where}a cross-attention batch has no segments")
    _check_lengths(q + k, where, "seqlens_q + seqlens_k")  # the packed total
    return k


def parse_batch_text(text: str) -> Batch:
    """``--seqlens`` text: ``"4096,1000,300"``, or cross-attention samples
    ``"QUERIES:KEYS,..."`` (``"512:64,300:64"``); BatchError on anything else."""
    if not isinstance(text, str) or ":" not in text:
        return Batch(parse_seqlens(text))
    pairs = [p.split(":") for p in text.split(",")]
    bad = next((i for i, p in enumerate(pairs) if len(p) != 2), None)
    if bad is not None:
        raise BatchError(f"sequence lengths: entry {bad + 1}, {text.split(',')[bad][:40]!r}, is not QUERIES:KEYS "
                         f"(a batch is all lengths or all QUERIES:KEYS pairs)")
    q = parse_seqlens(",".join(p[0] for p in pairs))
    return Batch(q, seqlens_k=parse_seqlens(",".join(p[1] for p in pairs)))


def parse_seqlens(text: str) -> tuple[int, ...]:
    """``"4096,1000,300"`` -> ``(4096, 1000, 300)``; BatchError on anything else
    (checked against MAX_SAMPLES and MAX_TOKENS before any list is built)."""
    if not isinstance(text, str) or not text.strip():
        raise BatchError("empty list of sequence lengths (expected e.g. 4096,1000,300)")
    if text.count(",") + 1 > MAX_SAMPLES:
        raise BatchError(f"{text.count(',') + 1:,} sequence lengths; a batch has at most "
                         f"MAX_SAMPLES = {MAX_SAMPLES:,} samples (ir/limits.py)")
    out = []
    for i, part in enumerate(text.split(",")):
        p = part.strip()
        shown = p if len(p) <= 40 else p[:40] + "..."
        if not p:
            raise BatchError(f"sequence lengths: entry {i + 1} is empty")
        if not re.fullmatch(r"[+-]?[0-9]+", p):
            raise BatchError(f"sequence lengths: entry {i + 1}, {shown!r}, is not an integer")
        digits = p.lstrip("+-").lstrip("0")
        if p.startswith("-") or not digits:
            raise BatchError(f"sequence lengths: entry {i + 1}, {shown}, is not a positive length")
        if len(digits) > _MAX_DIGITS or int(digits) > MAX_TOKENS:
            raise BatchError(f"sequence lengths: entry {i + 1}, {shown}, is more than MAX_TOKENS = "
                             f"{MAX_TOKENS:,} tokens (ir/limits.py)")
        out.append(int(digits))
    return _check_lengths(out, "sequence lengths: ", "entry")


def _parse_int(text: str) -> int:
    """JSON integers: refuse absurd digit counts before converting (Python refuses
    over 4,300; lengths are checked against MAX_TOKENS afterwards)."""
    if len(text.lstrip("-")) > _JSON_DIGITS:
        raise _HugeNumber(text)
    return int(text)


class _HugeNumber(ValueError):
    pass


def _loads(where: str, text: str):
    try:
        return json.loads(text, parse_int=_parse_int)
    except _HugeNumber as e:
        raise BatchError(f"{where}an integer with {len(str(e).lstrip('-'))} digits; lengths are at most "
                         f"MAX_TOKENS = {MAX_TOKENS:,}") from None
    except RecursionError:
        raise BatchError(f"{where}JSON nested too deeply (a batch is an object with a list of lengths)") from None


def _records(path: str, text: str) -> list[tuple[str, object]]:
    """(where, object) for every batch object in the file; where is 'path:line: '."""
    ext = os.path.splitext(path)[1].lower()
    if ext != ".jsonl":
        try:
            obj = _loads(f"{path}: ", text)
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
            out.append((f"{path}:{lineno}: ", _loads(f"{path}:{lineno}: ", line)))
        except json.JSONDecodeError as e:
            raise BatchError(f"{path}:{lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
    return out


def _to_batch(where: str, obj) -> Batch:
    if not isinstance(obj, dict):
        raise BatchError(f"{where}expected a JSON object with \"seqlens\", got {type(obj).__name__}")
    if "seqlens_q" in obj or "seqlens_k" in obj:
        return _to_cross_batch(where, obj)
    if "seqlens" not in obj:
        raise BatchError(f"{where}missing \"seqlens\" (a list of positive sample lengths)")
    lens, name = _lengths_and_name(where, obj, "seqlens")
    segments = obj.get("segments")
    if segments is not None:
        segments = check_segments(segments, lens, where)
    return Batch(lens, segments, name)


def _lengths_and_name(where: str, obj: dict, key: str) -> tuple[tuple[int, ...], str | None]:
    """``obj[key]`` checked as a non-empty list of lengths, and the batch's name (None or a string)."""
    lens = obj[key]
    if not isinstance(lens, list) or not lens:
        raise BatchError(f"{where}\"{key}\" must be a non-empty list of positive integers")
    name = obj.get("name")
    if name is not None and not isinstance(name, str):
        raise BatchError(f"{where}\"name\" must be a string, got {_show(name)}")
    return _check_lengths(lens, where, key), name


def _to_cross_batch(where: str, obj: dict) -> Batch:
    if "seqlens" in obj or "seqlens_q" not in obj or "seqlens_k" not in obj:
        raise BatchError(f"{where}a cross-attention batch has \"seqlens_q\" and \"seqlens_k\" and no \"seqlens\"")
    q, name = _lengths_and_name(where, obj, "seqlens_q")
    return Batch(q, None, name, _cross_lengths(q, obj["seqlens_k"], obj.get("segments"), where))


def _label(where: str, obj) -> str:
    name = obj.get("name") if isinstance(obj, dict) else None
    if isinstance(name, str):
        return name
    loc = where.rstrip(": ").rsplit(":", 1)[-1].strip()
    return f"(unnamed, {'line ' + loc if loc.isdigit() else loc})"


def _read(path: str) -> str:
    """The file's text, refusing files over MAX_BATCH_FILE bytes before reading them."""
    try:
        size = os.path.getsize(path)
        if size > MAX_BATCH_FILE:
            raise BatchError(f"{path}: {size:,} bytes; a batch file is at most MAX_BATCH_FILE = "
                             f"{MAX_BATCH_FILE:,} bytes (ir/limits.py)")
        with open(path, encoding="utf-8") as f:
            text = f.read(MAX_BATCH_FILE + 1)
    except (OSError, UnicodeDecodeError) as e:
        raise BatchError(f"{path}: cannot read: {e}") from None
    if len(text) > MAX_BATCH_FILE:  # grew while being read
        raise BatchError(f"{path}: more than MAX_BATCH_FILE = {MAX_BATCH_FILE:,} bytes (ir/limits.py)")
    return text


def _pick(path: str, records: list, name: str | None) -> Batch:
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


def load_batch(spec: str) -> Batch:
    """``FILE`` or ``FILE:NAME`` (JSON or JSONL; see the module docstring)."""
    if not isinstance(spec, (str, os.PathLike)):
        raise BatchError(f"a batch is given as a file path, got {type(spec).__name__}")
    spec = os.fspath(spec)
    path, name = spec, None
    if not os.path.exists(spec) and ":" in spec:
        head, tail = spec.rsplit(":", 1)
        if head and tail:
            path, name = head, tail
    if not os.path.isfile(path):
        raise BatchError(f"batch file not found: {path}")
    records = _records(path, _read(path))
    if not records:
        raise BatchError(f"{path}: no batch in the file")
    return _pick(path, records, name)
