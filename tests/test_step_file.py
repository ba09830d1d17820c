"""The step plan file (issue 10, item 6: ``plan step compile`` / ``show``):
round trip, determinism, and the plan file's safety — every altered,
truncated or crafted file is one PlanFileError naming the problem."""

import hashlib
import json
import zlib

import msgpack
import numpy as np
import pytest

from attnplan.cli import main
from attnplan.errors import PlanFileError
from attnplan.ir import limits
from attnplan.step import Mesh, Model, compile_step, make_problem
from attnplan.step import stepfile as sf

TINY = Model("tiny", 2, 64, 4, 2, 8, 128, 256)


@pytest.fixture(scope="module")
def compiled():
    p = make_problem([70, 9, 33, 4, 51, 18, 2, 60, 12], model=TINY, mesh=Mesh(2, 2, devices_per_node=4),
                     block_size=16)
    return compile_step(p, "wlb")


def test_round_trip(compiled):
    data = sf.pack(compiled)
    back = sf.unpack(data)
    a, b = compiled.plan, back.plan
    for k in sf.PLAN_COLUMNS:
        assert np.array_equal(getattr(a, k), getattr(b, k))
    assert (a.mb_strategy, a.system, a.info) == (b.mb_strategy, b.system, b.info)
    assert np.array_equal(a.problem.seqlens, b.problem.seqlens) and b.problem.model == a.problem.model
    for low, ir in zip(compiled.lowered, back.attention):
        assert np.array_equal(low.ir.program.transfers, ir.program.transfers)
    # recompiling the loaded problem gives the same file: a pure function of the inputs
    assert sf.pack(compile_step(b.problem, "wlb")) == data
    assert sf.pack(compile_step(compiled.plan.problem, "wlb")) == data


def _body(data: bytes) -> dict:
    return msgpack.unpackb(zlib.decompress(data[sf._HEADER.size:]), raw=False)


def _file(body: dict) -> bytes:
    raw = zlib.compress(msgpack.packb(body, use_bin_type=True))
    return sf._HEADER.pack(sf.MAGIC, sf.FORMAT_VERSION, 0, len(raw), hashlib.sha256(raw).digest()) + raw


def test_altered_and_truncated_files(compiled):
    data = sf.pack(compiled)
    flipped = bytearray(data)
    flipped[-5] ^= 1
    cases = [(bytes(flipped), "checksum mismatch"), (data[:-3], "truncated"), (data + b"x", "trailing bytes"),
             (data[:10], "truncated step file"), (b"ATTNPLAN" + data[8:], "bad magic"), (b"", "not an attnplan"),
             (data[:8] + b"\x09\x00" + data[10:], "format version 9"),
             (data[:10] + b"\x01\x00" + data[12:], "unknown flags"),
             (data[:12] + (1 << 40).to_bytes(8, "little") + data[20:], "over MAX_STEP_FILE")]
    for bad, match in cases:
        with pytest.raises(PlanFileError, match=match):
            sf.unpack(bad, "x.step")


@pytest.mark.parametrize("edit,match", [
    (lambda b: b["plan"].update(frag_doc=sf._arr(np.zeros(len(np.frombuffer(b["plan"]["frag_doc"]["data"], "<i8")),
                                                             np.int64))), "does not verify"),
    (lambda b: b["problem"].update(profile="/etc/passwd"), "not a builtin profile"),
    (lambda b: b["problem"].update(mask="x.mask"), "does not verify"),
    (lambda b: b["problem"]["mesh"].update(dp=3), "does not verify"),
    (lambda b: b["problem"]["model"].update(heads=True), "does not verify"),
    (lambda b: b.update(mb_attention=sf._arr([0, 99, 0, 0][:len(np.frombuffer(b["mb_attention"]["data"], "<i8"))])),
     "does not index"),
    (lambda b: b["attention"].__setitem__(0, b"garbage"), "attention plan 0"),
    (lambda b: b["plan"].update(mb_strategy=[1]), "wrong types"),
    (lambda b: b["plan"]["frag_end"].update(data=b"\x00" * 3), "bytes for shape"),
    (lambda b: b.pop("plan"), "plan is missing"),
    (lambda b: b["problem"].update(carried=10 ** 6), "out of range"),
])
def test_crafted_bodies(compiled, edit, match):
    body = _body(sf.pack(compiled))
    edit(body)
    with pytest.raises(PlanFileError, match=match):
        sf.unpack(_file(body), "x.step")


def test_memory_is_checked_again_on_load(compiled):
    """A file whose cap was lowered below what its plans need (edited, or written for another machine) is
    refused on load, as compile_step refuses such a step, naming the device and the cap."""
    body = _body(sf.pack(compiled))
    peak = int(compiled.report["peak_memory_bytes"])
    assert 1 << 20 < peak <= compiled.plan.problem.cap
    body["problem"]["mesh"]["memory_cap"] = 1 << 20
    with pytest.raises(PlanFileError, match=r"does not verify: device \d+ needs .* over its cap of 0\.0 GiB"):
        sf.unpack(_file(body), "x.step")
    body["problem"]["mesh"]["memory_cap"] = compiled.plan.problem.cap  # the compiled cap loads again
    assert sf.unpack(_file(body), "x.step").plan.n_mb == compiled.plan.n_mb
    body["problem"]["mesh"]["memory_cap"] = peak  # exactly what the step needs: still under (not over) the cap
    assert sf.unpack(_file(body), "x.step").plan.n_mb == compiled.plan.n_mb


def test_a_pipelined_step_file_loads_with_its_stage_memory():
    p = make_problem([70, 9, 33, 4, 51, 18, 2, 60, 12], model=TINY, mesh=Mesh(1, 2, 2, devices_per_node=4),
                     block_size=16)
    c = compile_step(p, "fixed")
    back = sf.unpack(sf.pack(c))
    assert back.plan.problem.mesh.pp == 2 and len(back.attention) == c.plan.n_mb
    body = _body(sf.pack(c))
    body["problem"]["mesh"]["memory_cap"] = 1 << 20
    with pytest.raises(PlanFileError, match="over its cap"):
        sf.unpack(_file(body), "x.step")


def test_attention_plan_of_another_micro_batch(compiled):
    body = _body(sf.pack(compiled))
    if len(body["attention"]) < 2:
        pytest.skip("one distinct attention plan")
    body["attention"] = body["attention"][::-1]
    with pytest.raises(PlanFileError, match="not its fragments|devices|pair"):
        sf.unpack(_file(body), "x.step")


def test_inflated_size_is_bounded(compiled, monkeypatch):
    monkeypatch.setattr(limits, "MAX_STEP_BODY", 1000)
    with pytest.raises(PlanFileError, match="MAX_STEP_BODY"):
        sf.unpack(sf.pack(compiled), "x.step")


def test_cli_compile_and_show(tmp_path, capsys):
    out = tmp_path / "a.step"
    argv = ["step", "compile", "--seqlens", "9000,300,200,4000,100", "--mesh", "dp=2,cp=2", "--model", "qwen2.5-0.5b",
            "--system", "pool", "-o", str(out)]
    assert main(argv) == 0
    assert "micro-batches on 4 devices" in capsys.readouterr().out
    assert main(["step", "show", str(out), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    frags = sorted(f[0] for mb in shown["micro_batches"] for f in mb["fragments"])
    assert frags == list(range(5)) and all(mb["ranks"] == [0, 1, 2, 3] for mb in shown["micro_batches"])
    assert main(["step", "show", str(out)]) == 0
    text = capsys.readouterr().out
    assert all(f"doc {d} [0, " in text for d in range(5))
    (tmp_path / "bad.step").write_bytes(out.read_bytes()[:-1])
    assert main(["step", "show", str(tmp_path / "bad.step")]) == 2
    err = capsys.readouterr().err
    assert "truncated" in err and err.count("\n") == 1
    assert main(["step", "show", str(tmp_path)]) == 2
    assert "not a regular file" in capsys.readouterr().err
    assert main([*argv[:-1], str(tmp_path / "missing" / "x.step")]) == 2
    assert "does not exist" in capsys.readouterr().err
