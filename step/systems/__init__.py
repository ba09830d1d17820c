"""The batch passes, one per system of the survey, listed by name in
:data:`BUILTIN` and registered when :mod:`attnplan.step` loads (nothing is
found by scanning modules). A new one drops in here the same way: a frozen
dataclass with ``name``, typed options and ``apply(StepProblem) -> StepPlan``
(see :mod:`attnplan.step.base`)."""

from __future__ import annotations

from ..base import StepPass
from .chunkflow import ChunkFlow
from .dyncp import DynCP
from .fixed import Fixed
from .flexsp import FlexSP
from .gds import Gds
from .pool import Pool
from .vrsp import Vrsp
from .wlb import Wlb

BUILTIN: dict[str, type[StepPass]] = {cls.name: cls for cls in (
    Fixed,    # packed in data order, dealt in order, one CP size, zigzag (the baseline)
    Wlb,      # WLB-LLM: workload-aware variable-length packing, outlier queue, per-document sharding
    Pool,     # DCP / MagiAttention: the whole DP x CP grid as one pool per micro-batch
    DynCP,    # Megatron-LM Dynamic CP: a power-of-two CP size per document, balanced rounds over the pool
    FlexSP,   # FlexSP: concurrent heterogeneous Ulysses groups, sequences assigned by a MILP (HiGHS)
    Gds,      # Skrull GDS: LPT of c1*s + c2*s^2 across replicas, long and short interleaved, dacp inside
    Vrsp,     # Libra VRSP: fixed packing, LPT of packed sequences into pools of P replicas, tile_pool
    ChunkFlow,  # ChunkFlow: uniform chunks, long documents cut with their KV carried, state-aware 1F1B
)}

__all__ = ["BUILTIN", "ChunkFlow", "DynCP", "Fixed", "FlexSP", "Pool", "Wlb"]
