"""attnplan: a plan compiler for distributed attention in long-context training.

    import attnplan
    plan = attnplan.compile(seqlens=[4096, 1000, 300], mask="causal", devices=4, heads=8, kv_heads=2, head_dim=64)
    out = attnplan.execute(plan, q, k, v)      # q [T, Hq, D], k/v [T, Hkv, D]; differentiable
    plan.stats(); plan.save("x.plan"); attnplan.load("x.plan")

In a training step on rank r of a torch.distributed group (one process per device):

    x_local = plan.dispatch(x_global)                      # rank r's tokens, in plan order
    pos = plan.position_ids(r)                              # position inside each sample (RoPE)
    out_local = attnplan.attention(q, k, v, plan, group=pg)   # autograd-aware
    y_global = plan.undispatch(out_local, group=pg)
"""

from .api import Plan, attention, compile, execute, load
from .errors import (AttnplanError, BatchError, DeadlockError, MaskError, PlanError, PlanFileError, ShapeError,
                     TransportError, VerifyError)
from .passes import strategies
from .tools.prefetch import PlanPrefetcher

__version__ = "0.1.0"

__all__ = ["compile", "execute", "attention", "load", "Plan", "PlanPrefetcher", "strategies", "AttnplanError",
           "BatchError", "DeadlockError", "MaskError", "PlanError", "PlanFileError", "ShapeError", "TransportError",
           "VerifyError"]
