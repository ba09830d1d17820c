"""The batch passes, one per system of the survey, listed by name in
:data:`BUILTIN` and registered when :mod:`attnplan.step` loads (nothing is
found by scanning modules). gds, vrsp, dyncp, flexsp and chunkflow come next
and drop in here the same way: a frozen dataclass with ``name``, typed
options and ``apply(StepProblem) -> StepPlan`` (see :mod:`attnplan.step.base`)."""

from __future__ import annotations

from ..base import StepPass
from .fixed import Fixed
from .pool import Pool
from .wlb import Wlb

BUILTIN: dict[str, type[StepPass]] = {cls.name: cls for cls in (
    Fixed,    # packed in data order, dealt in order, one CP size, zigzag (the baseline)
    Wlb,      # WLB-LLM: workload-aware variable-length packing, outlier queue, per-document sharding
    Pool,     # DCP / MagiAttention: the whole DP x CP grid as one pool per micro-batch
)}

__all__ = ["BUILTIN", "Fixed", "Pool", "Wlb"]
