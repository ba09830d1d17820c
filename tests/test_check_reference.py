"""The dense float64 reference of `plan run --check` and the property tests:
the chunked closed-form forward/backward equals autograd through plain dense
masked attention (runtime/reference.py), GQA and empty rows included."""

import pytest
import torch

import attnplan
from attnplan.runtime.check import random_inputs, reference, reference_autograd


@pytest.mark.parametrize("lens,mask,heads", [
    ([37, 11, 64, 5], "causal", (4, 2)),
    ([50, 20], "k < 3 & q >= 5", (2, 1)),  # rows 0..4 see nothing
    ([300, 77], "shared_question(2, 0.2) | sliding_window(5)", (4, 4)),
    ([90, 1], "full", (6, 2)),
])
@pytest.mark.parametrize("chunk", [1, 500, 1 << 22])  # one row at a time, a few rows, whole samples
def test_chunked_reference_equals_autograd(lens, mask, heads, chunk):
    plan = attnplan.compile(seqlens=lens, mask=mask, devices=1, heads=heads[0], kv_heads=heads[1], head_dim=8)
    q, k, v, d = random_inputs(plan, "float32", 0)
    out, grads = reference(plan.problem, q, k, v, d, 0.3, chunk_elems=chunk)
    out2, grads2 = reference_autograd(plan.problem, q, k, v, d, 0.3)
    assert out.dtype == torch.float64
    assert torch.allclose(out, out2, rtol=0, atol=1e-12)
    for a, b in zip(grads, grads2):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)
    if mask.startswith("k < 3"):
        assert torch.all(out[:5] == 0) and torch.all(grads[0][:5] == 0)
