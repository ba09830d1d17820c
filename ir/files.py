"""Bounded reads of small files a user names (a cost profile, a model): a
regular file of at most ``limit`` bytes, read whole, or one typed error
naming it — never a hang on a FIFO or device, never an unbounded read."""

from __future__ import annotations

import json
import os
import stat


def read_json(path: str, limit: int, limit_name: str, what: str, err: type[Exception]):
    """The JSON value in the file at ``path``; ``err`` with ``what`` (e.g.
    ``"cost profile p.json"``) leading the message when it is not a regular
    file, is over ``limit`` bytes (``limit_name`` of ir/limits.py), cannot be
    read or is not UTF-8 JSON."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise err(f"{what}: not a regular file")
        if st.st_size > limit:
            raise err(f"{what}: {st.st_size:,} bytes, over the limit of {limit:,} (ir/limits.py {limit_name})")
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
    except OSError as e:
        raise err(f"{what}: cannot read it ({e.strerror or e})") from None
    if len(raw) > limit:  # grew after the stat
        raise err(f"{what}: over the limit of {limit:,} bytes (ir/limits.py)")
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise err(f"{what}: not a JSON file ({type(e).__name__}: {str(e)[:80]})") from None
