"""Functions run on every rank of a local gloo group by tests/test_kernel_inputs.py
(through ``attnplan.tools.launch.run_local``); each returns plain data that the
test asserts on. Not a test module: pytest does not collect it."""

import torch

import attnplan
from attnplan.runtime.check import random_inputs


# layouts: views of x [T, H, D] holding the same values as x, or (expanded) values of their own

def permuted(x):  # head_dim is the slowest axis: stride T*H on head_dim
    return x.permute(2, 0, 1).contiguous().permute(1, 2, 0)


def every_other_dim(x):  # x[..., ::2] of a buffer twice as wide
    y = torch.full(x.shape[:-1] + (2 * x.shape[-1],), float("nan"), dtype=x.dtype)
    y[..., ::2] = x
    return y[..., ::2]


def heads_major(x):  # non-contiguous token axis, unit head_dim stride
    return x.transpose(0, 1).contiguous().transpose(0, 1)


def strided_tokens_with_offset(x):  # token stride 2*H*D and a storage offset
    y = torch.full((2 * x.shape[0] + 3,) + x.shape[1:], float("nan"), dtype=x.dtype)
    y[3::2] = x
    return y[3::2]


def expanded_dim(x):  # head_dim stride 0 (value changes: compared against its own copy)
    return x[..., :1].expand(x.shape)


def expanded_heads(x):  # head stride 0
    return x[:, :1].expand(x.shape)


LAYOUTS = {"permuted": permuted, "every_other_dim": every_other_dim, "heads_major": heads_major,
           "tokens_offset": strided_tokens_with_offset, "expanded_dim": expanded_dim,
           "expanded_heads": expanded_heads, "contiguous": lambda x: x}


def strided_equals_contiguous(rank, world, names):
    """Per strategy and layout: this rank's out, dq, dk, dv for strided local
    q/k/v equal those for contiguous copies of the same values, bit for bit."""
    layouts = LAYOUTS
    bad, ran = [], 0
    for strategy in ("zigzag", "minheap", "per_doc"):
        plan = attnplan.compile(seqlens=[40, 23, 9], mask="causal", devices=world, heads=4, kv_heads=2, head_dim=8,
                                block_size=8, strategy=strategy)
        q, k, v, dout = random_inputs(plan, "float32", 1)
        ql, kl, vl, dl = (plan.dispatch(t) for t in (q, k, v, dout))
        for name in names:
            views = [layouts[name](t) for t in (ql, kl, vl)]
            res = []
            for ins in (views, [t.contiguous() for t in views]):
                x = [t.detach().requires_grad_(True) for t in ins]
                out = attnplan.attention(*x, plan, timeout=60)
                res.append([out.detach(), *torch.autograd.grad(out, x, dl)])
            if not all(torch.equal(a, b) for a, b in zip(*res)):
                bad.append(f"{strategy} {name}: differs")
            if not all(bool(torch.isfinite(a).all()) for a in res[0]):
                bad.append(f"{strategy} {name}: not finite")
        ran += 1
    return {"bad": bad, "ran": ran}
