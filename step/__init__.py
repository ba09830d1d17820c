"""The training step as the unit of planning (docs/DESIGN.md, "Above one
attention call"; survey §1.1, §1.5).

A global batch of documents (:class:`StepProblem`, :func:`make_problem`) on a
mesh of ``dp × cp`` devices (:class:`Mesh`) training a model
(:class:`Model`, :data:`PRESETS`) becomes, by a batch pass (one per system:
``fixed``, ``wlb``, ``pool``; :mod:`attnplan.step.systems`), a micro-batch
plan (:class:`StepPlan`); every micro-batch is lowered to a verified attention
plan on its group with the existing passes; the whole step is simulated —
linear and attention work per layer, the overlapped gradient reduction,
memory per device (:func:`compile_step`)::

    from attnplan.step import Mesh, compile_step, make_problem
    problem = make_problem([60_000, 3_000, 900] * 40, model="llama3-8b", mesh=Mesh(dp=4, cp=8))
    for system in ("fixed", "wlb", "pool"):
        r = compile_step(problem, system).report
        print(system, r["step_s"], r["step_over_lower_bound"], r["peak_memory_bytes"])
"""

from __future__ import annotations

from .base import BUILTIN_SYSTEMS, SYSTEMS, StepPass, parse_system, register_system, system_names, unregister_system
from .driver import CompiledStep, compile_step
from .ir import StepPlan, StepProblem, build_plan
from .lower import make_problem
from .mesh import Mesh, parse_mesh
from .model import PRESETS, Model, load_model
from .systems import BUILTIN

for _cls in BUILTIN.values():
    SYSTEMS[_cls.name] = BUILTIN_SYSTEMS[_cls.name] = _cls

__all__ = ["BUILTIN", "PRESETS", "SYSTEMS", "CompiledStep", "Mesh", "Model", "StepPass", "StepPlan", "StepProblem",
           "build_plan", "compile_step", "load_model", "make_problem", "parse_mesh", "parse_system",
           "register_system", "system_names", "unregister_system"]
