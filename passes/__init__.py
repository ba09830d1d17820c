"""Passes over the IR, registered by name (see :mod:`attnplan.passes.base`)."""

from .base import REGISTRY, Pass, parse_pipeline, register, run_pipeline
from . import comm, tile, zigzag  # noqa: F401  (registration)

__all__ = ["REGISTRY", "Pass", "parse_pipeline", "register", "run_pipeline"]
