"""Passes over the IR, registered by name (see :mod:`attnplan.passes.base`).

Every module of this package is imported here, so a new pass only needs its
file and the ``@register`` decorator."""

import importlib
import pkgutil

from .base import REGISTRY, Pass, parse_pipeline, register, run_pipeline, strategies

for _m in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _m != "base":
        importlib.import_module(f"{__name__}.{_m}")

__all__ = ["REGISTRY", "Pass", "parse_pipeline", "register", "run_pipeline", "strategies"]
