"""The CLI and the API under bad input (issue 8, defects 3 and 5).

Every case gives, in bounded time and memory, its correct result or one
clear error: exit 2 and one line on stderr (no traceback) from ``plan``, a
typed ``AttnplanError`` from the API. Bounds come from ``ir/limits.py``.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import attnplan
from attnplan import cli
from attnplan.ir import limits
from attnplan.runtime import calibrate as calibrate_mod

SMALL = ["--seqlens", "40,9", "--devices", "2", "--block-size", "16", "--heads", "2", "--head-dim", "8"]
FAST_S = 10.0  # generous bound for an error that must come before any real work (2 shared cores)


def run(capsys, *argv):
    """(exit code, stdout, stderr, seconds) of ``plan ARGV`` in this process."""
    t0 = time.perf_counter()
    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as e:  # argparse errors exit through SystemExit
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err, time.perf_counter() - t0


def assert_one_line_error(code, err, *needles):
    assert code == 2, (code, err)
    assert "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert "error:" in err, err
    for n in needles:
        assert n in err, (n, err)


@pytest.fixture(scope="module")
def small_plan(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("inputs") / "small.plan"
    assert cli.main(["compile", *SMALL, "-o", str(path)]) == 0
    return path


# ------------------------------------------------------------------ numbers, checked where argparse reads them

def _range(lo, hi):
    return f"{lo:,}..{hi:,}"


DEV = _range(1, limits.MAX_DEVICES)
ARGPARSE_CASES = [
    # (argv after the command, flag, the range the message states)
    (["compile", "--seqlens", "500", "--devices", "100000", "-o", "x.plan"], "--devices", DEV),
    (["compile", "--seqlens", "500", "--devices", str(10 ** 12), "-o", "x.plan"], "--devices", DEV),
    (["compile", "--seqlens", "500", "--devices", "0", "-o", "x.plan"], "--devices", DEV),
    (["compile", "--seqlens", "500", "--devices", "-1", "-o", "x.plan"], "--devices", DEV),
    (["compile", "--seqlens", "500", "--devices", "1" + "0" * 5000, "-o", "x.plan"], "--devices", DEV),
    (["compile", "--seqlens", "500", "--devices", "2.0", "-o", "x.plan"], "--devices", DEV),
    (["compile", "--seqlens", "500", "--devices", "2", "--nodes", "0", "-o", "x.plan"], "--nodes", DEV),
    (["compile", "--seqlens", "500", "--devices", "2", "--heads", "0", "-o", "x.plan"], "--heads",
     _range(1, limits.MAX_HEADS)),
    (["compile", "--seqlens", "500", "--devices", "2", "--heads", str(limits.MAX_HEADS + 1), "-o", "x.plan"],
     "--heads", _range(1, limits.MAX_HEADS)),
    (["compile", "--seqlens", "500", "--devices", "2", "--kv-heads", str(10 ** 9), "-o", "x.plan"], "--kv-heads",
     _range(1, limits.MAX_HEADS)),
    (["compile", "--seqlens", "500", "--devices", "2", "--head-dim", str(limits.MAX_HEAD_DIM + 1), "-o", "x.plan"],
     "--head-dim", _range(1, limits.MAX_HEAD_DIM)),
    (["compile", "--seqlens", "500", "--devices", "2", "--block-size", str(10 ** 25), "-o", "x.plan"],
     "--block-size", _range(1, limits.MAX_BLOCK_SIZE)),
    (["compile", "--seqlens", "500", "--devices", "2", "--memory-cap", "nan", "-o", "x.plan"], "--memory-cap",
     _range(1, limits.MAX_MEMORY_CAP)),
    (["compile", "--seqlens", "500", "--devices", "2", "--memory-cap", "-5", "-o", "x.plan"], "--memory-cap",
     _range(1, limits.MAX_MEMORY_CAP)),
    (["compare", "--seqlens", "500", "--devices", "0"], "--devices", DEV),
    (["run", "x.plan", "--seed", str(2 ** 70)], "--seed", _range(0, 2 ** 64 - 1)),
    (["run", "x.plan", "--seed", "-1"], "--seed", _range(0, 2 ** 64 - 1)),
    (["run", "x.plan", "--procs", "0"], "--procs", DEV),
    (["run", "x.plan", "--devices", "0"], "--devices", DEV),
    (["bench", "--masks", ""], "--masks", "no mask"),
    (["bench", "--masks", " ; ;"], "--masks", "no mask"),
    (["bench", "--devices", "0"], "--devices", DEV),
    (["bench", "--devices", "8,"], "--devices", "device counts"),
    (["bench", "--devices", "8,100000"], "--devices", DEV),
    (["calibrate", "--repeats", "0"], "--repeats", _range(1, limits.MAX_REPEATS)),
    (["calibrate", "--repeats", str(10 ** 9)], "--repeats", _range(1, limits.MAX_REPEATS)),
    (["mask", "causal", "--seqlens", "5", "--width", "0"], "--width", _range(1, limits.MAX_MASK_WIDTH)),
    (["mask", "causal", "--seqlens", "5", "--width", str(10 ** 9)], "--width", _range(1, limits.MAX_MASK_WIDTH)),
]


@pytest.mark.parametrize("argv, flag, bound", ARGPARSE_CASES,
                         ids=[" ".join(a[:1] + a[-2:])[:60] for a, _, _ in ARGPARSE_CASES])
def test_out_of_range_numbers_are_one_line_usage_errors(capsys, tmp_path, monkeypatch, argv, flag, bound):
    monkeypatch.chdir(tmp_path)
    code, out, err, dt = run(capsys, *argv)
    assert_one_line_error(code, err, f"argument {flag}", bound)
    assert out == "" and dt < FAST_S
    assert not (tmp_path / "x.plan").exists()


@pytest.mark.parametrize("timeout", ["inf", "-inf", "nan", "0", "-1", "1e300", str(limits.MAX_TIMEOUT_S + 1)])
def test_run_timeout_must_be_finite_positive(capsys, small_plan, timeout):
    """Checked before the plan is loaded or any rank starts (inf used to pass and fail inside a rank)."""
    for extra in ([], ["--procs", "2"]):
        code, out, err, dt = run(capsys, "run", small_plan, f"--timeout={timeout}", *extra)
        assert_one_line_error(code, err, "--timeout must be positive finite seconds",
                              f"at most {limits.MAX_TIMEOUT_S:,}")
        assert err.startswith("plan: error:") and out == "" and dt < FAST_S


def test_limits_are_inclusive(capsys, tmp_path):
    """MAX_MASK_WIDTH itself is accepted; the picture never has more columns than tokens."""
    code, out, err, _ = run(capsys, "mask", "causal", "--seqlens", "5", "--width", limits.MAX_MASK_WIDTH)
    assert code == 0, err
    grid = [ln for ln in out.splitlines() if ln.startswith("|")]
    assert len(grid) == 5 and all(len(r) == 5 + 2 for r in grid)  # one column a token at most


# ------------------------------------------------------------------ batch sizes, checked before allocating

@pytest.mark.parametrize("seqlens", ["99999999999999999999999", "1000000000000", f"{limits.MAX_TOKENS},1",
                                     f"{2 ** 62},{2 ** 62}"])  # an int64 sum of the last would wrap negative
def test_huge_batches_fail_before_allocating(capsys, tmp_path, seqlens):
    """The frontend (parse_seqlens) or the API stops these; either way one line naming MAX_TOKENS."""
    code, out, err, dt = run(capsys, "compile", "--seqlens", seqlens, "--devices", "2", "-o", tmp_path / "x.plan")
    assert_one_line_error(code, err, f"{limits.MAX_TOKENS:,}")
    assert err.startswith("plan: error:") and dt < FAST_S
    assert not (tmp_path / "x.plan").exists()


def test_device_count_over_nodes_is_checked_before_compare(capsys):
    code, out, err, _ = run(capsys, "compare", "--seqlens", "100", "--devices", "3", "--nodes", "2")
    assert_one_line_error(code, err, "devices (3) must be a multiple of nodes (2)")
    assert out == ""  # not a table of per-strategy errors with exit 0


@pytest.mark.parametrize("entry, needle", [("zigzag:a2b", "unknown communication variant 'a2b'"),
                                           ("zigzag:", "unknown communication variant ''"),
                                           ("zigzg:ring", "unknown strategy 'zigzg'"), (",", "no strategy in"),
                                           ("minheap,zigzag,minheap", "lists 'minheap' twice"),
                                           ("span,span overlap{local=kept}",
                                            "lists one plan twice: 'span' and 'span overlap{local=kept}' are the same"),
                                           ("span overlap{local=no}", "local must be first, last or kept"),
                                           ("span overlap{run=1}", "only ' overlap{local=...}'")])
def test_compare_variants_are_checked(capsys, entry, needle):
    code, out, err, _ = run(capsys, "compare", "--seqlens", "100", "--devices", "2", "--strategies", entry)
    assert_one_line_error(code, err, needle)
    assert out == ""


def test_compare_runs_a_placement_under_each_communication_variant(capsys):
    """``NAME:VARIANT`` rows are the same placement with another comm step:
    the same compute imbalance, the pipeline the variant names."""
    import json
    entries = "minheap,minheap:direct,minheap:ring,minheap:allgather,minheap:allgather_ring,minheap:a2a,ulysses:a2a"
    code, out, err, _ = run(capsys, "compare", "--seqlens", "300,200,50", "--devices", "4", "--nodes", "2",
                            "--heads", "4", "--kv-heads", "4", "--strategies", entries, "--json")
    assert code == 0, err
    rows = {r["strategy"]: r for r in json.loads(out)}
    assert list(rows) == entries.split(",")
    assert "comm{mode=p2p,relay=node,reduce=node}" in rows["minheap"]["pipeline"]
    for variant, comm in (("direct", "mode=p2p,relay=none"), ("ring", "mode=ring"), ("allgather", "mode=allgather"),
                          ("allgather_ring", "mode=allgather_ring"),
                          ("a2a", "mode=a2a")):
        r = rows[f"minheap:{variant}"]
        assert f"comm{{{comm}" in r["pipeline"], r["pipeline"]
        assert r["compute_imbalance"] == rows["minheap"]["compute_imbalance"]


def test_show_device_out_of_range(capsys, small_plan):
    code, out, err, _ = run(capsys, "show", small_plan, "--device", "999")
    assert_one_line_error(code, err, "device 999 does not exist", "0..1")
    assert out == ""


# ------------------------------------------------------------------ outputs: checked before any work, `-` is stdout

def test_missing_output_folder_fails_before_compiling(capsys, tmp_path, monkeypatch):
    def no_compile(**kw):
        raise AssertionError("compile ran before the output path was checked")
    monkeypatch.setattr(attnplan.api, "compile", no_compile)
    for target in (tmp_path / "no" / "x.plan", tmp_path):
        code, out, err, _ = run(capsys, "compile", *SMALL, "-o", target)
        assert_one_line_error(code, err, str(target), "cannot write plan file")
    assert list(tmp_path.iterdir()) == []


def test_compile_to_stdout_is_the_plan_file(capsysbinary, tmp_path, small_plan):
    code = cli.main(["compile", *SMALL, "-o", "-"])
    out, err = capsysbinary.readouterr()
    assert code == 0, err
    assert err.decode().startswith("wrote <stdout>: 2 devices, 49 tokens")  # the summary goes to stderr
    assert not Path("-").exists()
    from_stdout = attnplan.Plan.from_bytes(out)
    assert from_stdout.ir.program == attnplan.load(small_plan).ir.program


def test_compile_refuses_binary_to_a_terminal(capsys, monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    code, out, err, dt = run(capsys, "compile", *SMALL, "-o", "-")
    assert_one_line_error(code, err, "refusing to write a binary plan file to a terminal")
    assert out == "" and dt < FAST_S


def test_viz_output_checked_before_loading(capsys, tmp_path):
    target = tmp_path / "no" / "r.html"
    code, out, err, _ = run(capsys, "viz", tmp_path / "missing.plan", "-o", target)
    assert_one_line_error(code, err, str(target), "does not exist")


PROFILE = {"name": "calibrated", "peak_flops": 1e11, "launch_s": 2e-5, "intra_bw": 1e9, "intra_alpha": 4e-4}


@pytest.fixture
def no_measuring(monkeypatch):
    """Every calibrate test is about paths and values: measuring takes seconds and is tested in test_schedule."""
    calls = []
    monkeypatch.setattr(calibrate_mod, "calibrate", lambda repeats=5: calls.append(repeats) or dict(PROFILE))
    return calls


def test_calibrate_missing_folder_fails_before_measuring(capsys, tmp_path, no_measuring):
    for target in (tmp_path / "no" / "p.json", tmp_path):
        code, out, err, _ = run(capsys, "calibrate", "-o", target, "--repeats", "1")
        assert_one_line_error(code, err, str(target), "cannot write cost profile")
    with pytest.raises(attnplan.PlanError, match="does not exist"):
        calibrate_mod.write_profile(str(tmp_path / "no" / "p.json"), 1)
    assert no_measuring == []


def test_calibrate_to_stdout(capsys, tmp_path, monkeypatch, no_measuring):
    monkeypatch.chdir(tmp_path)
    code, out, err, _ = run(capsys, "calibrate", "-o", "-", "--repeats", "2")
    assert code == 0, err
    assert json.loads(out) == PROFILE and no_measuring == [2]
    assert err.startswith("wrote <stdout>: kernel 100.0 GFLOP/s")
    assert list(tmp_path.iterdir()) == []  # no file named '-'


@pytest.mark.parametrize("repeats", [0, -1, limits.MAX_REPEATS + 1, 2.5, True, "3"])
def test_calibrate_api_repeats(repeats):
    with pytest.raises(attnplan.PlanError, match="repeats must be an integer"):
        calibrate_mod.calibrate(repeats)


# ------------------------------------------------------------------ bench: every input checked before benchmarking

@pytest.fixture
def batches(tmp_path) -> Path:
    f = tmp_path / "b.jsonl"
    f.write_text(json.dumps({"name": "tiny", "seqlens": [40, 9]}) + "\n")
    return f


@pytest.mark.parametrize("extra, needle", [
    (["--names", "nope"], "no batch named 'nope'"),
    (["--names", ","], "--names must list batch names"),
    (["--masks", "causl"], "unknown name"),
    (["--strategies", "nope"], "unknown strategy"),
    (["--batches", "missing.jsonl"], "batch file not found"),
])
def test_bench_bad_inputs(capsys, tmp_path, batches, extra, needle):
    out_dir = tmp_path / "out"
    code, out, err, dt = run(capsys, "bench", "--batches", batches, "--out", out_dir, "--no-progress", *extra)
    assert code == 2 and needle in err and "Traceback" not in err, err
    assert dt < FAST_S and not out_dir.exists()


def test_bench_out_is_a_file(capsys, tmp_path, batches):
    f = tmp_path / "taken"
    f.write_text("keep me")
    code, out, err, _ = run(capsys, "bench", "--batches", batches, "--out", f, "--no-progress")
    assert_one_line_error(code, err, str(f), "not a folder")
    assert f.read_text() == "keep me"


@pytest.mark.slow  # matplotlib plots: ~9 s on 2 shared cores
def test_bench_small_run_creates_its_folder(capsys, tmp_path, batches):
    out_dir = tmp_path / "new" / "bench"
    code, out, err, _ = run(capsys, "bench", "--batches", batches, "--out", out_dir, "--no-progress",
                            "--devices", "2", "--strategies", "zigzag", "--heads", "2", "--head-dim", "8",
                            "--block-size", "16", "--masks", "causal;sliding_window(4)")
    assert code == 0, err
    rows = json.loads((out_dir / "bench.json").read_text())["rows"]
    assert sorted((r["mask"], r["devices"], r["strategy"]) for r in rows) == \
        [("causal", 2, "zigzag"), ("sliding_window(4)", 2, "zigzag")]
    assert all("error" not in r for r in rows)


# ------------------------------------------------------------------ plan run: tensors sized from the problem first

def _need(plan, dtype_bytes: int, check: bool) -> int:
    """q, k, v, dout, out, dq, dk, dv, plus float64 reference out/dq/dk/dv, written out tensor by tensor."""
    p = plan.problem
    q_like = p.tokens * p.heads * p.head_dim      # q, dout, out, dq
    kv_like = p.tokens * p.kv_heads * p.head_dim  # k, v, dk, dv
    run = 4 * q_like * dtype_bytes + 4 * kv_like * dtype_bytes
    return run + (2 * q_like * 8 + 2 * kv_like * 8 if check else 0)


@pytest.mark.parametrize("check", [False, True])
def test_run_refuses_over_max_run_bytes(capsys, monkeypatch, small_plan, check):
    plan = attnplan.load(small_plan)
    need = _need(plan, 4, check)
    flag = ["--check"] if check else []
    monkeypatch.setattr(limits, "MAX_RUN_BYTES", need - 1)
    code, out, err, dt = run(capsys, "run", small_plan, *flag)
    assert_one_line_error(code, err, "MAX_RUN_BYTES", f"{need / 2 ** 30:,.1f} GiB")
    assert out == ""
    monkeypatch.setattr(limits, "MAX_RUN_BYTES", need)  # exactly the need: allowed
    code, out, err, _ = run(capsys, "run", small_plan, *flag)
    assert code == 0, err


def test_run_refuses_a_huge_plan_in_every_mode(capsys, tmp_path, monkeypatch):
    """A plan whose float32 tensors need 128 GiB (1024 tokens x 1024 heads x
    4096 dims) is refused before anything is allocated, in this process,
    for --procs, and in rank mode (torchrun) before joining a group."""
    path = tmp_path / "big.plan"
    assert cli.main(["compile", "--seqlens", "1024", "--heads", "1024", "--head-dim", "4096", "--devices", "1",
                     "--block-size", "1024", "-o", str(path)]) == 0
    need = _need(attnplan.load(path), 4, False)
    assert need > limits.MAX_RUN_BYTES
    capsys.readouterr()
    for extra in ([], ["--procs", "1"]):
        code, out, err, dt = run(capsys, "run", path, *extra)
        assert_one_line_error(code, err, "MAX_RUN_BYTES", f"{need / 2 ** 30:,.1f} GiB")
        assert dt < FAST_S
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    code, out, err, dt = run(capsys, "run", path)
    assert_one_line_error(code, err, "MAX_RUN_BYTES")


def test_run_check_refuses_a_sample_over_the_reference_limit_before_starting_processes(capsys, tmp_path):
    """--check builds a dense reference per sample: a sample over the limit
    is one line and exit 2 at once, in this process and for --procs (not
    after every rank has started)."""
    from attnplan.runtime.check import MAX_CHECK_SAMPLE
    path = tmp_path / "long.plan"
    assert cli.main(["compile", "--seqlens", f"{MAX_CHECK_SAMPLE + 1},300", "--devices", "2", "--heads", "2",
                     "--head-dim", "8", "-o", str(path)]) == 0
    capsys.readouterr()
    for extra in ([], ["--procs", "2"]):
        code, out, err, dt = run(capsys, "run", path, "--check", *extra)
        assert_one_line_error(code, err, f"the largest sample has {MAX_CHECK_SAMPLE + 1} tokens")
        assert dt < FAST_S


def test_run_procs_must_match(capsys, small_plan):
    code, out, err, _ = run(capsys, "run", small_plan, "--procs", "3")
    assert_one_line_error(code, err, "--procs must be 2, got 3")


# ------------------------------------------------------------------ the API: wrong types for every argument

BAD_COMPILE = [
    # (keyword arguments, error type, what the message names)
    (dict(seqlens=70), attnplan.BatchError, "seqlens must be a list"),
    (dict(seqlens="70,8"), attnplan.BatchError, "seqlens must be a list"),
    (dict(seqlens=None), attnplan.BatchError, "no sequence lengths"),
    (dict(seqlens={"a": 8}), attnplan.BatchError, "seqlens must be a list"),
    (dict(seqlens={8, 9}), attnplan.BatchError, "seqlens must be a list"),
    (dict(seqlens=[8, 7.0]), attnplan.BatchError, "sample 1"),
    (dict(seqlens=[8, float("nan")]), attnplan.BatchError, "sample 1"),
    (dict(seqlens=[True, 8]), attnplan.BatchError, "sample 0"),
    (dict(seqlens=[[8, 9]]), attnplan.BatchError, "sample 0"),
    (dict(seqlens=[8, None]), attnplan.BatchError, "sample 1"),
    (dict(seqlens=["8"]), attnplan.BatchError, "sample 0"),
    (dict(seqlens=np.array([8.0, 9.0])), attnplan.BatchError, "dtype float64"),
    (dict(seqlens=np.array([[8, 9]])), attnplan.BatchError, "shape (1, 2)"),
    (dict(seqlens=np.array([8, 0])), attnplan.BatchError, "sample 1"),
    (dict(seqlens=np.array([2 ** 63], dtype=np.uint64)), attnplan.BatchError, "sample 0"),
    (dict(seqlens=[2 ** 62, 2 ** 62]), attnplan.BatchError, "sample 0"),
    (dict(seqlens=[limits.MAX_TOKENS, 1]), attnplan.BatchError, f"{limits.MAX_TOKENS + 1:,} tokens"),
    (dict(seqlens=np.full(2, limits.MAX_TOKENS // 2 + 1, dtype=np.int32)), attnplan.BatchError,
     f"{limits.MAX_TOKENS + 2:,} tokens"),
    (dict(seqlens=[1] * (limits.MAX_SAMPLES + 1)), attnplan.BatchError, f"{limits.MAX_SAMPLES + 1:,} samples"),
    (dict(seqlens=[8], segments={"a": 1}), attnplan.BatchError, "segments must be a list"),
    (dict(seqlens=[8], segments=[[("text", 8.0)]]), attnplan.BatchError, "segments[0][0]: length"),
    (dict(seqlens=[8], segments=[[(3, 8)]]), attnplan.BatchError, "segments[0][0]: kind"),
    (dict(seqlens=[8], segments=[[("text", 4)]]), attnplan.BatchError, "sum to 4"),
    (dict(seqlens=[8], segments=[("text", 8)]), attnplan.BatchError, "segments[0][0] must be a (kind, length)"),
    (dict(seqlens=[8], segments=[None, None]), attnplan.BatchError, "for 2 samples"),
    (dict(seqlens=[8], devices=10 ** 12), attnplan.PlanError, "devices = 1,000,000,000,000 is over"),
    (dict(seqlens=[8], devices=np.float64(2)), attnplan.PlanError, "devices must be a positive integer"),
    (dict(seqlens=[8], devices=True), attnplan.PlanError, "devices must be a positive integer"),
    (dict(seqlens=[8], devices=None), attnplan.PlanError, "devices must be a positive integer"),
    (dict(seqlens=[8], devices=0), attnplan.PlanError, "devices must be a positive integer"),
    (dict(seqlens=[8], nodes="1"), attnplan.PlanError, "nodes must be a positive integer"),
    (dict(seqlens=[8], heads=float("nan")), attnplan.PlanError, "heads must be a positive integer"),
    (dict(seqlens=[8], kv_heads=10 ** 5000), attnplan.PlanError, "kv_heads = about 10^5000 is over"),
    (dict(seqlens=[8], head_dim=[64]), attnplan.PlanError, "head_dim must be a positive integer"),
    (dict(seqlens=[8], block_size=10 ** 25), attnplan.PlanError, "block_size = about 10^25 is over"),
    (dict(seqlens=[8], memory_cap=float("inf")), attnplan.PlanError, "memory_cap must be a positive integer"),
    (dict(seqlens=[8], memory_cap=-1), attnplan.PlanError, "memory_cap must be a positive integer"),
    (dict(seqlens=[8], memory_cap=2 ** 70), attnplan.PlanError, "memory_cap = about 10^21 is over"),
    (dict(seqlens=[8], dtype={}), attnplan.PlanError, "dtype must be a string"),
    (dict(seqlens=[8], dtype="float64"), attnplan.PlanError, "dtype must be one of"),
    (dict(seqlens=[8], profile=None), attnplan.PlanError, "profile must be a string"),
    (dict(seqlens=[8], strategy={}), attnplan.PlanError, "strategy must be a string"),
    (dict(seqlens=[8], strategy=None), attnplan.PlanError, "strategy must be a string"),
    (dict(seqlens=[8], pipeline=5), attnplan.PlanError, "pipeline must be a string"),
    (dict(seqlens=[8], mask=None), attnplan.PlanError, "mask must be"),
    (dict(seqlens=[8], mask={"causal": 1}), attnplan.PlanError, "mask must be"),
    (dict(seqlens=[8], mask=3), attnplan.PlanError, "mask must be"),
    (dict(seqlens=[8], verify="yes"), attnplan.PlanError, "verify must be True or False"),
    (dict(seqlens=[8], instruments=5), attnplan.PlanError, "instruments must be"),
    (dict(seqlens=[8], instruments=[5]), attnplan.PlanError, "instruments must be"),
    (dict(seqlens=[8], max_compute_blocks=0), attnplan.PlanError, "max_compute_blocks must be"),
    (dict(seqlens=[8], strategy="auto", devices=10 ** 6), attnplan.PlanError, "devices = 1,000,000 is over"),
]


@pytest.mark.parametrize("kwargs, err, needle", BAD_COMPILE, ids=[str(i) for i in range(len(BAD_COMPILE))])
def test_compile_rejects_wrong_arguments(kwargs, err, needle):
    t0 = time.perf_counter()
    with pytest.raises(err) as ei:
        attnplan.compile(**kwargs)
    assert needle in str(ei.value), str(ei.value)
    assert len(str(ei.value)) < 400 and time.perf_counter() - t0 < FAST_S


def test_compile_accepts_numpy_integers():
    """numpy integer scalars and arrays give the same plan as Python ints."""
    ref = attnplan.compile(seqlens=[40, 9], devices=2, heads=2, head_dim=8, block_size=16)
    for lens in (np.array([40, 9], dtype=np.int32), np.array([40, 9], dtype=np.uint16),
                 [np.int64(40), np.uint8(9)], (40, 9)):
        plan = attnplan.compile(seqlens=lens, devices=np.int64(2), heads=np.int32(2), head_dim=np.uint8(8),
                                block_size=np.int16(16), memory_cap=np.int64(1 << 40))
        assert plan.problem.seqlens.tolist() == [40, 9]
        assert plan.ir.program == ref.ir.program
        assert type(plan.devices) is int


def test_compile_segments_normalized():
    """Segment lengths may be numpy integers and pairs lists: the plan equals the plain-tuple one."""
    mask = Path(__file__).resolve().parents[1] / "examples" / "masks" / "mixed_modality.mask"
    kw = dict(seqlens=[8, 4], mask=mask, devices=1, heads=1, head_dim=8, block_size=4)
    plain = attnplan.compile(segments=((("image", 3), ("text", 5)), None), **kw)
    plan = attnplan.compile(segments=[[("image", np.int64(3)), ["text", 5]], None], **kw)
    assert plan.problem.segments == ((("image", 3), ("text", 5)), None)
    assert plan.ir.program == plain.ir.program
    assert plan.stats()["pairs"] != attnplan.compile(**dict(kw, mask="causal")).stats()["pairs"]  # segments used


@pytest.mark.parametrize("scale", [0, -1.0, float("nan"), float("inf"), "0.1", True, 10 ** 400])
def test_execute_rejects_bad_scale(small_plan, scale):
    plan = attnplan.load(small_plan)
    p = plan.problem
    q = torch.zeros(p.tokens, p.heads, p.head_dim)
    kv = torch.zeros(p.tokens, p.kv_heads, p.head_dim)
    with pytest.raises(attnplan.ShapeError, match="softmax_scale must be a finite number > 0"):
        attnplan.execute(plan, q, kv, kv, softmax_scale=scale)


@pytest.mark.parametrize("plan", [None, "x.plan", {}])
def test_execute_and_attention_need_a_plan(plan):
    with pytest.raises(attnplan.PlanError, match="plan must be an attnplan.Plan"):
        attnplan.execute(plan, None, None, None)
    with pytest.raises(attnplan.PlanError, match="plan must be an attnplan.Plan"):
        attnplan.attention(None, None, None, plan)


@pytest.mark.parametrize("timeout", [0, -5, float("inf"), float("nan"), limits.MAX_TIMEOUT_S * 2, "10"])
def test_attention_rejects_bad_timeout(small_plan, timeout):
    with pytest.raises(attnplan.PlanError, match="timeout"):
        attnplan.attention(None, None, None, attnplan.load(small_plan), timeout=timeout)


def test_execute_accepts_a_valid_scale(small_plan):
    import torch
    plan = attnplan.load(small_plan)
    p = plan.problem
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(p.tokens, p.heads, p.head_dim, generator=gen)
    k, v = (torch.randn(p.tokens, p.kv_heads, p.head_dim, generator=gen) for _ in range(2))
    a = attnplan.execute(plan, q, k, v, softmax_scale=np.float32(0.5))
    b = attnplan.execute(plan, q, k, v, softmax_scale=0.5)
    assert torch.equal(a, b) and bool(torch.isfinite(a).all())
    assert not math.isclose(float((a - attnplan.execute(plan, q, k, v)).abs().max()), 0.0)


# --- found by the outside review: sizes checked before the tiler allocates; tiny scales; odd paths -----------------
@pytest.mark.parametrize("kw", [dict(seqlens=[100_000], block_size=1, devices=8),
                                dict(seqlens=[1 << 26], devices=2),
                                dict(seqlens=[2_000_000], block_size=64, devices=8)])
def test_tiling_is_refused_before_it_allocates(kw):
    """Before: a 37 GiB numpy MemoryError, a 24 GiB allocation after 16 s, an OOM kill at 23 GB."""
    t0 = time.perf_counter()
    with pytest.raises(attnplan.PlanError, match="MAX_TILE_PIECES"):
        attnplan.compile(**kw)
    assert time.perf_counter() - t0 < 60  # work before the refusal is linear in tokens, not in tiles


@pytest.mark.parametrize("scale", [1e-50, 1e-300, 1e40])
def test_scales_that_vanish_or_overflow_in_float32_are_refused(small_plan, scale):
    plan = attnplan.load(small_plan)
    p = plan.problem
    q = torch.randn(p.tokens, p.heads, p.head_dim)
    kv = torch.randn(p.tokens, p.kv_heads, p.head_dim)
    with pytest.raises(attnplan.ShapeError, match="softmax_scale must be in"):
        attnplan.execute(plan, q, kv, kv, softmax_scale=scale)


def test_plan_paths_that_are_not_regular_files(small_plan, tmp_path):
    import os
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    plan = attnplan.load(small_plan)
    with pytest.raises(attnplan.PlanFileError, match="not a regular file"):
        attnplan.load(fifo)  # would block forever waiting for a writer
    with pytest.raises(attnplan.PlanError, match="not a regular file"):
        plan.save(fifo)
    with pytest.raises(attnplan.PlanError, match="not a regular file"):
        plan.save(tmp_path)
    with pytest.raises(attnplan.PlanError, match="device must be an integer"):
        plan.to_text(device="0")


def test_bench_summary_columns_stay_aligned_with_variant_names():
    from attnplan.tools.bench import format_summary
    row = {"mask": "causal", "devices": 8, "batches": 2, "errors": 0, "comm_vs_zigzag_median": 0.5,
           "imbalance_median": 1.0, "imbalance_worst": 1.1, "within_1.05": 0.5, "pred_over_lb_median": 1.2,
           "plan_s_median": 0.1, "plan_s_max": 0.2}
    lines = format_summary([dict(row, strategy="zigzag"), dict(row, strategy="hypergraph:allgather_ring")])
    table = lines.splitlines()[:3]
    assert len({len(line) for line in table}) == 1, table  # header and rows end in the same column
    assert table[1].index(" 2 ") == table[2].index(" 2 ")
