"""PlanPrefetcher: plans compiled in worker processes arrive in order, as plan
bytes, equal to compiling in place; planning errors surface typed, with the
batch named."""

import pytest

import attnplan

pytestmark = pytest.mark.slow  # processes: the slow tier (make test runs it; -m 'not slow' skips)

KW = dict(mask="causal", devices=2, heads=2, kv_heads=1, head_dim=8, block_size=16)
BATCHES = [[40, 9], {"name": "qa", "seqlens": [30, 30], "segments": [[["question", 10], ["answer", 20]], None]},
           [17], [5, 5, 5, 5]]


@pytest.mark.parametrize("workers", [0, 2])
def test_plans_arrive_in_order_and_equal_direct_compiles(workers):
    with attnplan.PlanPrefetcher(iter(BATCHES), KW, workers=workers) as pf:
        got = list(pf)
    assert [b for b, _ in got] == BATCHES
    for b, plan in got:
        lens = b["seqlens"] if isinstance(b, dict) else b
        segs = b.get("segments") if isinstance(b, dict) else None
        want = attnplan.compile(seqlens=lens, segments=segs, **KW)
        assert plan.canonical_bytes() == want.canonical_bytes()


def test_planning_error_names_the_batch():
    batches = [[40, 9], {"name": "broken", "seqlens": [12, 0, 3]}, [8]]
    with attnplan.PlanPrefetcher(batches, KW, workers=1) as pf:
        it = iter(pf)
        assert next(it)[0] == [40, 9]
        with pytest.raises(attnplan.BatchError, match=r"^batch broken: sample 1: length must be a positive integer"):
            next(it)
        assert next(it)[0] == [8]  # later batches still come


def test_mask_error_is_typed_in_the_training_process():
    with attnplan.PlanPrefetcher([[10]], dict(KW, mask="sliding_window(0)"), workers=1) as pf:
        with pytest.raises(attnplan.MaskError, match=r"batch #0: .*sliding_window"):
            next(iter(pf))


@pytest.mark.parametrize("kwargs,msg", [
    (dict(compile_kwargs=dict(KW, seqlens=[3])), "come from each batch"),
    (dict(compile_kwargs=KW, workers=-1), "workers must be"),
    (dict(compile_kwargs=KW, lookahead=0), "lookahead must be"),
])
def test_bad_options(kwargs, msg):
    with pytest.raises(attnplan.PlanError, match=msg):
        attnplan.PlanPrefetcher([[4]], **kwargs)
