"""The Python API: ``compile``, ``execute``, ``attention``, ``load`` and the ``Plan`` value.

Implemented below the face (:mod:`attnplan.tools.compiler`, :mod:`attnplan.tools.plan`), so that
orchestration (compare, prefetch, the step loader) uses them without importing the face."""

from __future__ import annotations

from .passes.default import default_pipeline
from .tools.compiler import (_check_plan, attention, check_options, compile, execute, load,  # noqa: F401
                             positive_real)
from .tools.plan import Plan

__all__ = ["Plan", "attention", "check_options", "compile", "default_pipeline", "execute", "load", "positive_real"]
