"""The ``plan`` command line (issue 2, items 8 and 9), called in-process.

Every test goes through ``attnplan.cli.main([...])`` with capsys, except
``test_console_script_end_to_end``, which runs the installed ``plan`` script.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import attnplan
from attnplan import cli
from attnplan.backends import planfile
from attnplan.frontend import load_batch, parse_seqlens
from attnplan.ir.program import Program

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
DEMO = EXAMPLES / "batches" / "demo.json"
SHARED_BATCHES = ROOT.parent / "shared" / "workloads" / "batches.jsonl"

# The small plan most tests use: 3 samples, GQA, a mask that is not plain causal.
SMALL_SEQLENS = (100, 37, 5)
SMALL_MASK = "sliding_window(20) | (k < 3 & k <= q)"
SMALL = ["--seqlens", ",".join(map(str, SMALL_SEQLENS)), "--mask", SMALL_MASK, "--devices", "2",
         "--block-size", "32", "--heads", "4", "--kv-heads", "2", "--head-dim", "16"]


def run(capsys, *argv):
    """(exit code, stdout, stderr) of ``plan ARGV`` in this process."""
    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as e:  # argparse errors exit through SystemExit
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def dense_pairs(pred, seqlens) -> int:
    """Allowed (q, k) pairs of ``pred(q, k, L)`` over every sample, by brute force."""
    total = 0
    for L in seqlens:
        q, k = np.meshgrid(np.arange(L), np.arange(L), indexing="ij")
        total += int(np.count_nonzero(pred(q, k, L)))
    return total


def causal(q, k, L):
    return k <= q


def small_mask(q, k, L):  # SMALL_MASK written out
    return ((q - 20 < k) & (k <= q)) | ((k < 3) & (k <= q))


def assert_clean_error(code, out, err, *needles):
    assert code == 2, (code, out, err)
    assert err.startswith("plan: error:"), err
    assert err.count("plan: error:") == 1, err
    assert "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)


@pytest.fixture(scope="module")
def small_plan(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "small.plan"
    assert cli.main(["compile", *SMALL, "-o", str(path)]) == 0
    return path


@pytest.fixture(scope="module")
def small_bytes(small_plan) -> bytes:
    return small_plan.read_bytes()


# ------------------------------------------------------------------ compile

def test_compile_seqlens_writes_plan(capsys, tmp_path):
    out_path = tmp_path / "a.plan"
    code, out, err = run(capsys, "compile", "--seqlens", "100,37,5", "--devices", "2", "--block-size", "32",
                         "-o", out_path)
    assert code == 0, err
    assert out.startswith(f"wrote {out_path}: 2 devices, 142 tokens"), out
    assert out_path.is_file() and out_path.stat().st_size > planfile._HEADER.size
    plan = attnplan.load(out_path)
    assert plan.devices == 2
    assert plan.problem.seqlens.tolist() == [100, 37, 5]
    assert plan.stats()["pairs"] == 8 * dense_pairs(causal, [100, 37, 5])  # default: causal, 8 heads


def test_compile_batch_json(capsys, tmp_path):
    out_path = tmp_path / "demo.plan"
    code, out, err = run(capsys, "compile", "--batch", DEMO, "--devices", "4", "--block-size", "512",
                         "-o", out_path)
    assert code == 0, err
    want = json.loads(DEMO.read_text())["seqlens"]
    plan = attnplan.load(out_path)
    assert plan.problem.seqlens.tolist() == want
    assert plan.stats()["tokens"] == sum(want)
    assert plan.devices == 4


def test_compile_batch_jsonl_name(capsys, tmp_path):
    if not SHARED_BATCHES.is_file():
        pytest.skip(f"{SHARED_BATCHES} is absent (the shared workloads live next to the repository)")
    # the spec is relative to the repository root, as a user types it there
    spec = "../shared/workloads/batches.jsonl:lmsys-128k-0"
    want = next(json.loads(ln)["seqlens"] for ln in SHARED_BATCHES.read_text().splitlines()
                if ln.strip() and json.loads(ln).get("name") == "lmsys-128k-0")
    out_path = tmp_path / "lmsys.plan"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)
        code, out, err = run(capsys, "compile", "--batch", spec, "--devices", "8", "-o", out_path)
    assert code == 0, err
    s = attnplan.load(out_path).stats()
    assert s["tokens"] == sum(want) == 131072
    assert s["devices"] == 8


@pytest.mark.parametrize("mask, pred", [
    ("sliding_window(16)", lambda q, k, L: (q - 16 < k) & (k <= q)),
    ("chunked_causal(8)", lambda q, k, L: (k <= q) & (q // 8 == k // 8)),
    (SMALL_MASK, small_mask),
    (str(EXAMPLES / "masks" / "window_with_sinks.mask"),  # sliding_window(256) | (k < 16 & k <= q)
     lambda q, k, L: ((q - 256 < k) & (k <= q)) | ((k < 16) & (k <= q))),
], ids=["builtin", "builtin-chunked", "expression", "mask-file"])
def test_compile_masks(capsys, tmp_path, mask, pred):
    seqlens = [300, 37, 5]
    out_path = tmp_path / "m.plan"
    code, out, err = run(capsys, "compile", "--seqlens", ",".join(map(str, seqlens)), "--mask", mask,
                         "--devices", "2", "--block-size", "64", "--heads", "2", "-o", out_path)
    assert code == 0, err
    assert attnplan.load(out_path).stats()["pairs"] == 2 * dense_pairs(pred, seqlens)


def test_compile_verbose_lists_passes(capsys, tmp_path):
    code, out, err = run(capsys, "compile", *SMALL, "-v", "-o", tmp_path / "v.plan")
    assert code == 0
    names = [ln.split()[0] for ln in err.splitlines()]
    assert [n.split("{")[0] for n in names] == ["tile", "zigzag", "comm", "overlap", "emit"], err
    assert names[0].startswith("tile{block=32"), err


def test_compile_pipeline(capsys, tmp_path):
    code, out, err = run(capsys, "compile", "--seqlens", "50,9", "--devices", "2",
                         "--pipeline", "tile{block=16},zigzag,comm{mode=ring},overlap,emit", "-o", tmp_path / "p.plan")
    assert code == 0, err
    code, out, err = run(capsys, "compile", "--seqlens", "50,9", "--devices", "2", "--block-size", "16",
                         "-o", tmp_path / "d.plan")
    assert code == 0, err
    plan, default = attnplan.load(tmp_path / "p.plan"), attnplan.load(tmp_path / "d.plan")
    assert plan.ir.program == default.ir.program  # the default pipeline spelled out
    s = plan.stats()
    pipe = s["pipeline"]  # normalized: every option spelled out
    assert pipe.startswith("tile{block=16") and pipe.endswith(",zigzag,comm{mode=ring,relay=none},overlap,emit"), pipe


# ------------------------------------------------------------------ stats

STATS_KEYS = ("devices", "tokens", "pairs", "flops_fwd", "compute_imbalance", "token_imbalance",
              "comm_bytes_total", "comm_bytes_max", "lower_bound_s", "predicted_s", "plan_s")
PER_DEVICE_KEYS = ("flops", "tokens", "comm_in_bytes", "comm_out_bytes")


def test_stats_json_contract(capsys, small_plan):
    code, out, err = run(capsys, "stats", small_plan, "--json")
    assert code == 0, err
    s = json.loads(out)
    for key in STATS_KEYS:
        assert key in s, key
    n = s["devices"]
    assert n == 2
    pd = s["per_device"]
    for key in PER_DEVICE_KEYS:
        assert len(pd[key]) == n, key
    heads, head_dim = 4, 16
    assert s["tokens"] == sum(SMALL_SEQLENS) == sum(pd["tokens"])
    assert s["pairs"] == heads * dense_pairs(small_mask, SMALL_SEQLENS)
    assert s["flops_fwd"] == 4 * head_dim * s["pairs"]
    assert sum(pd["flops"]) == s["flops_fwd"]
    assert s["compute_imbalance"] == pytest.approx(max(pd["flops"]) / np.mean(pd["flops"]))
    assert s["token_imbalance"] == pytest.approx(max(pd["tokens"]) / np.mean(pd["tokens"]))
    assert sum(pd["comm_in_bytes"]) == sum(pd["comm_out_bytes"]) == s["comm_bytes_total"] > 0
    assert s["comm_bytes_max"] == max(i + o for i, o in zip(pd["comm_in_bytes"], pd["comm_out_bytes"]))
    assert 0 < s["lower_bound_s"] <= s["predicted_s"]
    assert s["plan_s"] is None  # a plan file holds no timing: loaded plans report none


def test_stats_json_equals_api(capsys, small_plan):
    code, out, err = run(capsys, "stats", small_plan, "--json")
    assert code == 0, err
    assert json.loads(out) == json.loads(json.dumps(attnplan.load(small_plan).stats()))


def test_stats_table(capsys, small_plan):
    code, out, err = run(capsys, "stats", small_plan)
    assert code == 0, err
    assert "compute imbalance" in out and "predicted" in out
    assert len([ln for ln in out.splitlines() if ln.split()[:1] in (["0"], ["1"])]) == 2  # one row a device


def test_stats_profile(capsys, small_plan):
    code, out, err = run(capsys, "stats", small_plan, "--json", "--profile", "a100")
    assert code == 0, err
    assert json.loads(out)["profile"] == "a100"


# ------------------------------------------------------------------ run

@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_run_check_passes(capsys, small_plan, dtype):
    code, out, err = run(capsys, "run", small_plan, "--check", "--dtype", dtype, "--devices", "2")
    assert code == 0, out + err
    assert "PASS" in out and "FAIL" not in out
    for name in ("out", "dq", "dk", "dv"):
        assert f"{name}: max abs error" in out


def test_run_without_check(capsys, small_plan):
    code, out, err = run(capsys, "run", small_plan)
    assert code == 0, err
    assert out.startswith("ran 2 devices")


def test_run_on_cuda(capsys, small_plan):
    """``--device cuda`` runs every device on one GPU and checks it; without a GPU: one line, exit 2."""
    code, out, err = run(capsys, "run", small_plan, "--check", "--device", "cuda")
    if torch.cuda.is_available():
        assert code == 0 and "PASS" in out and "cuda" in out, out + err
    else:
        assert code == 2 and "no CUDA device" in err and len(err.strip().splitlines()) == 1, err
    code, out, err = run(capsys, "run", small_plan, "--device", "cuda", "--procs", "2")
    assert code == 2 and "--procs" in err, err


# ------------------------------------------------------------------ show

def test_show_parses_back(capsys, small_plan):
    code, out, err = run(capsys, "show", small_plan)
    assert code == 0, err
    assert out.startswith("program devices=2")
    assert Program.from_text(out) == attnplan.load(small_plan).ir.program


def test_show_one_device(capsys, small_plan):
    plan = attnplan.load(small_plan)
    code, out, err = run(capsys, "show", small_plan, "--device", "1")
    assert code == 0, err
    assert out == plan.to_text(1)
    lines = out.splitlines()
    assert "device 1 fwd" in lines and "device 1 bwd" in lines
    assert not any(ln.startswith("device 0") for ln in lines)
    for ln in lines:
        if ln.startswith("transfer "):
            assert "d1" in ln.split()[6].split("->"), ln
    # the program for device 1 alone is a strict part of the whole text
    assert len(out) < len(plan.to_text())


def test_show_level_all(capsys, small_plan):
    code, out, err = run(capsys, "show", small_plan, "--level", "all")
    assert code == 0, err
    assert out.startswith("problem tokens=142")
    assert "blockgraph" in out and "program devices=2" in out


# ------------------------------------------------------------------ mask

def test_mask_picture(capsys):
    code, out, err = run(capsys, "mask", "causal", "--seqlens", "5,3")
    assert code == 0, err
    assert "21 allowed pairs" in out  # 15 + 6
    grid = [ln[1:-1] for ln in out.splitlines() if ln.startswith("|")]
    assert grid == ["#       ", "##      ", "###     ", "####    ", "#####   ",
                    "     #  ", "     ## ", "     ###"]


def test_mask_file_and_batch(capsys):
    code, out, err = run(capsys, "mask", EXAMPLES / "masks" / "segments_qa.mask",
                         "--batch", EXAMPLES / "batches" / "qa.json", "--width", "40")
    assert code == 0, err
    assert sum(ln.startswith("|") for ln in out.splitlines()) == 40


# ------------------------------------------------------------------ errors (item 9)

def _patched(data: bytes, tmp_path: Path, name: str, fn) -> Path:
    d = bytearray(data)
    fn(d)
    p = tmp_path / name
    p.write_bytes(bytes(d))
    return p


C = ["--devices", "2", "--block-size", "32"]

COMPILE_ERRORS = [
    # (extra argv, substrings of the message)
    (["--seqlens", "10", "--mask", "causal &"], [":1:9:", "causal &", "^", "expected"]),
    (["--seqlens", "10", "--mask", "k < < q"], [":1:5:", "k < < q", "^", "expected"]),
    (["--seqlens", "10", "--mask", "causl"], ["unknown name", "causl", "did you mean `causal`"]),
    (["--seqlens", "10", "--mask", "sliding_window(1, 2)"], ["takes 1 argument", "got 2"]),
    (["--seqlens", "10", "--mask", "sliding_window(0)"], ["must be a positive integer", "got 0"]),
    (["--seqlens", "10", "--mask", "sliding_window(-3)"], ["must be a positive integer", "got -3"]),
    (["--seqlens", "10", "--mask", "nothere.mask"], ["nothere.mask", "not found"]),
    (["--seqlens", "4096,1.5"], ["'1.5'", "is not an integer"]),
    (["--seqlens", "4096,0"], ["0", "is not a positive length"]),
    (["--seqlens", "4096,-5"], ["-5", "is not a positive length"]),
    (["--seqlens", ""], ["empty list of sequence lengths"]),
    (["--batch", "nothere.json"], ["batch file not found", "nothere.json"]),
    (["--batch", f"{DEMO}:nope"], ["no batch named 'nope'", "demo"]),
    (["--seqlens", "10", "--strategy", "nope"], ["unknown strategy 'nope'", "zigzag"]),
    (["--seqlens", "10", "--pipeline", "tile{block=,zz"], ["unbalanced"]),
    (["--seqlens", "10", "--pipeline", "tile{block=8},bogus,comm,emit"], ["unknown pass 'bogus'"]),
    (["--seqlens", "10", "--pipeline", "tile{block=8},zigzag"], ["does not end in a program"]),
    (["--seqlens", "10", "--nodes", "3"], ["devices (2) must be a multiple of nodes (3)"]),
    (["--seqlens", "10", "--heads", "6", "--kv-heads", "4"], ["heads (6) must be a multiple of kv_heads (4)"]),
    (["--seqlens", "10", "--profile", "tpu"], ["unknown cost profile 'tpu'"]),
    (["--seqlens", "10", "--memory-cap", "10"], ["cap is 10"]),
]


@pytest.mark.parametrize("argv, needles", COMPILE_ERRORS, ids=[" ".join(a) for a, _ in COMPILE_ERRORS])
def test_compile_errors(capsys, tmp_path, argv, needles):
    out_path = tmp_path / "x.plan"
    code, out, err = run(capsys, "compile", *C, *argv, "-o", out_path)
    assert_clean_error(code, out, err, *needles)
    assert not out_path.exists()


def test_mask_syntax_error_has_line_and_caret(capsys):
    code, out, err = run(capsys, "compile", *C, "--seqlens", "10", "--mask", "sliding_window(4) | & k < 3",
                         "-o", "unused.plan")
    assert_clean_error(code, out, err)
    lines = err.splitlines()
    assert lines[0].startswith("plan: error: <mask>:1:21:") and "expected" in lines[0], err
    assert lines[1].strip() == "sliding_window(4) | & k < 3"
    assert lines[2].index("^") == lines[1].index("&")  # the caret is under the offending token


def test_mask_file_syntax_error(capsys, tmp_path):
    f = tmp_path / "bad.mask"
    f.write_text("# a comment\nlet w = 4\nsliding_window(w) |\n")
    code, out, err = run(capsys, "mask", f, "--seqlens", "8")
    assert_clean_error(code, out, err, f"{f}:3:", "sliding_window(w) |", "^", "expected")


def test_bad_json_batch(capsys, tmp_path):
    f = tmp_path / "bad.json"
    f.write_text('{"seqlens": [1,\n')
    code, out, err = run(capsys, "compile", *C, "--batch", f, "-o", tmp_path / "x.plan")
    assert_clean_error(code, out, err, str(f), "invalid JSON")


def test_batch_with_bad_length(capsys, tmp_path):
    f = tmp_path / "b.json"
    f.write_text('{"seqlens": [4, 0]}')
    code, out, err = run(capsys, "compile", *C, "--batch", f, "-o", tmp_path / "x.plan")
    assert_clean_error(code, out, err, "seqlens[1] = 0 is not a positive integer")


def test_unwritable_output(capsys, tmp_path):
    code, out, err = run(capsys, "compile", *C, "--seqlens", "10", "-o", tmp_path / "no" / "dir" / "x.plan")
    assert_clean_error(code, out, err, "cannot write plan file")
    code, out, err = run(capsys, "compile", *C, "--seqlens", "10", "-o", tmp_path)  # a directory
    assert_clean_error(code, out, err, "cannot write plan file")


PLAN_FILE_CASES = {
    "truncated": (lambda d: d.__delitem__(slice(len(d) // 2, None)), "truncated"),
    "body-byte": (lambda d: d.__setitem__(len(d) - 10, d[len(d) - 10] ^ 0x01), "checksum mismatch"),
    "magic": (lambda d: d.__setitem__(0, ord("X")), "not an attnplan plan file"),
    "version": (lambda d: d.__setitem__(slice(8, 10), struct.pack("<H", planfile.FORMAT_VERSION + 1)),
                f"format version {planfile.FORMAT_VERSION + 1}"),
    "empty": (lambda d: d.clear(), "not an attnplan plan file"),
}


@pytest.mark.parametrize("cmd", ["stats", "run", "show"])
@pytest.mark.parametrize("case", sorted(PLAN_FILE_CASES))
def test_bad_plan_files(capsys, tmp_path, small_bytes, cmd, case):
    fn, needle = PLAN_FILE_CASES[case]
    path = _patched(small_bytes, tmp_path, f"{case}.plan", fn)
    code, out, err = run(capsys, cmd, path)
    assert_clean_error(code, out, err, str(path), needle)
    assert out == ""


def test_missing_plan_file(capsys, tmp_path):
    for cmd in ("stats", "run", "show"):
        code, out, err = run(capsys, cmd, tmp_path / "missing.plan")
        assert_clean_error(code, out, err, "missing.plan", "cannot read plan file")


def test_run_device_count_mismatch(capsys, small_plan):
    code, out, err = run(capsys, "run", small_plan, "--devices", "3")
    assert_clean_error(code, out, err, "compiled for 2 devices, not 3")
    assert out == ""


@pytest.mark.parametrize("device", ["99", "2", "-1"])
def test_show_bad_device(capsys, small_plan, device):
    code, out, err = run(capsys, "show", small_plan, "--device", device)
    assert_clean_error(code, out, err, f"device {device} does not exist", "0..1")
    code, out, err = run(capsys, "show", small_plan, "--device", device, "--level", "all")
    assert_clean_error(code, out, err, f"device {device} does not exist")
    assert out == ""


@pytest.mark.parametrize("argv, needles", [
    (["--seqlens", "5000"], ["at most 4096 tokens"]),
    (["--seqlens", "5,0"], ["0", "is not a positive length"]),
])
def test_mask_command_errors(capsys, argv, needles):
    code, out, err = run(capsys, "mask", "causal", *argv)
    assert_clean_error(code, out, err, *needles)


@pytest.mark.parametrize("argv", [
    ["compile", "--seqlens", "10", "--devices", "2", "--frob", "-o", "x.plan"],  # unknown flag
    ["compile", "--seqlens", "10", "-o", "x.plan"],                              # missing --devices
    ["compile", "--devices", "2", "-o", "x.plan"],                               # no batch
    ["compile", "--seqlens", "10", "--batch", "b.json", "--devices", "2", "-o", "x.plan"],
    ["compile", "--seqlens", "10", "--devices", "two", "-o", "x.plan"],
    ["run", "x.plan", "--dtype", "float64"],
    ["frobnicate"],
    [],
], ids=["unknown-flag", "missing-devices", "no-batch", "both-batches", "bad-int", "bad-choice",
        "bad-command", "no-command"])
def test_argparse_errors(capsys, argv):
    code, out, err = run(capsys, *argv)
    assert code == 2, (code, err)
    assert "error:" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


# ------------------------------------------------------------------ typed exceptions in the API

def test_api_batch_errors():
    with pytest.raises(attnplan.BatchError):
        attnplan.compile(seqlens=[4, 0])
    with pytest.raises(attnplan.BatchError):
        attnplan.compile(seqlens=[4, -1])
    with pytest.raises(attnplan.BatchError):
        attnplan.compile(seqlens=[4, 1.5])
    with pytest.raises(attnplan.BatchError):
        attnplan.compile(seqlens=[])
    with pytest.raises(attnplan.BatchError, match="not an integer"):
        parse_seqlens("4096,1.5")
    with pytest.raises(attnplan.BatchError, match="not found"):
        load_batch(str(ROOT / "nothere.json"))
    with pytest.raises(attnplan.BatchError, match="no batch named"):
        load_batch(f"{DEMO}:nope")


def test_api_bad_json_batch(tmp_path):
    f = tmp_path / "bad.json"
    f.write_text("{nope")
    with pytest.raises(attnplan.BatchError, match="invalid JSON"):
        load_batch(str(f))


@pytest.mark.parametrize("mask, line, col", [
    ("causal &", 1, 9), ("causl", 1, 1), ("sliding_window(1, 2)", 1, 1), ("sliding_window(0)", 1, 16),
    ("sliding_window(-3)", 1, 16), ("(causal\n  | k <)", 2, 8),
])
def test_api_mask_errors(mask, line, col):
    with pytest.raises(attnplan.MaskError) as ei:
        attnplan.compile(seqlens=[8], mask=mask)
    assert (ei.value.line, ei.value.col) == (line, col)
    assert f":{line}:{col}:" in str(ei.value) and "^" in str(ei.value)


@pytest.mark.parametrize("kwargs, match", [
    (dict(devices=3, nodes=2), "multiple of nodes"),
    (dict(heads=6, kv_heads=4), "multiple of kv_heads"),
    (dict(strategy="nope"), "unknown strategy"),
    (dict(pipeline="tile{block=,zz"), "unbalanced"),
    (dict(devices=0), "devices must be a positive integer"),
])
def test_api_plan_errors(kwargs, match):
    with pytest.raises(attnplan.PlanError, match=match):
        attnplan.compile(seqlens=[8], **kwargs)


def test_api_plan_file_errors(tmp_path, small_bytes):
    with pytest.raises(attnplan.PlanFileError, match="cannot read"):
        attnplan.load(tmp_path / "missing.plan")
    for case, (fn, needle) in PLAN_FILE_CASES.items():
        path = _patched(small_bytes, tmp_path, f"{case}.plan", fn)
        with pytest.raises(attnplan.PlanFileError, match=needle):
            attnplan.load(path)


def test_api_show_bad_device(small_plan):
    with pytest.raises(attnplan.PlanError, match="does not exist"):
        attnplan.load(small_plan).to_text(2)


# ------------------------------------------------------------------ the installed console script

def test_console_script_end_to_end(tmp_path):
    script = Path(sys.executable).parent / "plan"
    if not script.is_file():
        pytest.skip(f"no console script next to {sys.executable} (install the package: pip install -e .)")
    out_path = tmp_path / "e2e.plan"
    r = subprocess.run([script, "compile", *SMALL, "-o", out_path], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"wrote {out_path}: 2 devices, 142 tokens")
    r = subprocess.run([script, "run", out_path, "--check"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS" in r.stdout
    r = subprocess.run([script, "mask", "causal &", "--seqlens", "4"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.startswith("plan: error: <mask>:1:9:") and "Traceback" not in r.stderr


# ------------------------------------------------------------------ consistency over the parser

TABLE_COMMANDS = {("stats",), ("compare",), ("bench",), ("run",), ("step", "compare"), ("step", "show"),
                  ("step", "bench")}  # the subcommands that print a table


def _subcommands(parser, prefix=()):
    import argparse
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield prefix + (name,), sub
                yield from _subcommands(sub, prefix + (name,))


def test_every_table_printing_subcommand_takes_json():
    subs = dict(_subcommands(cli.build_parser()))
    assert TABLE_COMMANDS <= set(subs)
    for path in TABLE_COMMANDS:
        opts = {o for a in subs[path]._actions for o in a.option_strings}
        assert "--json" in opts, " ".join(path)
    long_work = [p for p, sp in subs.items() if p[-1] == "bench"]
    for path in long_work:  # long work can silence its progress bar (it is drawn on a terminal only)
        assert "--no-progress" in {o for a in subs[path]._actions for o in a.option_strings}


def test_exit_codes_are_documented():
    text = cli.build_parser().format_help()
    text = " ".join(text.split())
    assert "exit codes: 0 ok; 1" in text and "2 bad input" in text


def test_run_check_json(capsys, small_plan):
    code, out, err = run(capsys, "run", small_plan, "--check", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["ok"] is True and set(d["max_abs_error"]) == {"out", "dq", "dk", "dv"} and d["device"] == "cpu"


def test_stats_of_a_plan_file_says_its_plan_time_is_not_stored(capsys, small_plan):
    code, out, err = run(capsys, "stats", small_plan)
    line = next(x for x in out.splitlines() if x.startswith("plan time"))
    assert code == 0 and line.split()[-2:] == ["not", "stored"], out
    code, out, err = run(capsys, "stats", small_plan, "--json")
    assert json.loads(out)["plan_s"] is None


def test_progress_is_quiet_when_piped(capsys):
    from attnplan.cli_io import progress
    with progress(10, "x") as advance:  # pytest's stderr is not a terminal
        for _ in range(10):
            advance("y")
    assert capsys.readouterr().err == ""
