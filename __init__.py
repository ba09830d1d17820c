"""attnplan: a plan compiler for distributed attention in long-context training.

    import attnplan
    plan = attnplan.compile(seqlens=[4096, 1000, 300], mask="causal", devices=4, heads=8, kv_heads=2, head_dim=64)
    out = attnplan.execute(plan, q, k, v)      # q [T, Hq, D], k/v [T, Hkv, D]; differentiable
    plan.stats(); plan.save("x.plan"); attnplan.load("x.plan")
"""

from .api import Plan, compile, execute, load
from .errors import (AttnplanError, BatchError, DeadlockError, MaskError, PlanError, PlanFileError, ShapeError,
                     VerifyError)

from .passes import strategies

__version__ = "0.1.0"
__all__ = ["compile", "execute", "load", "Plan", "strategies", "AttnplanError", "BatchError", "DeadlockError",
           "MaskError", "PlanError", "PlanFileError", "ShapeError", "VerifyError"]
