"""Backends: emit per-device programs, serialize plans, simulate them."""

from . import emit  # noqa: F401  (registers the emit pass)
