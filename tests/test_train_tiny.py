"""examples/train_tiny.py: 50 steps of a 2-layer transformer on 2 gloo
processes, each step a new long-tailed packed batch with its own prefetched
plan. The loss curve equals a single-process run with dense masked attention
(fp32 tolerance) and two runs are bitwise identical."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # processes: the slow tier (make test runs it; -m 'not slow' skips)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_tiny.py"


@pytest.fixture(scope="module")
def tiny():
    spec = importlib.util.spec_from_file_location("train_tiny", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_batches_are_long_tailed_and_packed(tiny):
    cfg = tiny.CONFIG
    gen = tiny.batches(cfg)
    bs = [next(gen) for _ in range(50)]
    lens = np.concatenate([b["seqlens"] for b in bs])
    assert all(sum(b["seqlens"]) == cfg["tokens"] == len(b["ids"]) for b in bs)
    assert lens.min() >= 2 and lens.max() > 8 * np.median(lens)  # a long tail
    again = tiny.batches(cfg)
    assert all(np.array_equal(b["ids"], next(again)["ids"]) for b in bs)  # seeded
    lab = tiny.labels_of(np.arange(10), [4, 6])
    assert lab.tolist() == [1, 2, 3, -100, 5, 6, 7, 8, 9, -100]


def test_distributed_training_equals_dense_single_process(tiny):
    steps = tiny.CONFIG["steps"]
    assert steps == 50
    ref = tiny.train_reference(dict(tiny.CONFIG))
    a = tiny.run(procs=2, timeout=240)
    b = tiny.run(procs=2, timeout=240, steps=10)  # a second run of fresh processes, shorter
    assert len(a) == len(ref) == steps and len(b) == 10
    assert a[:10] == b  # bitwise: same floats, every step
    rel = max(abs(x - y) / abs(y) for x, y in zip(a, ref))
    assert rel < 1e-5, rel
    assert ref[-1] < 0.5 * ref[0]  # it learns
