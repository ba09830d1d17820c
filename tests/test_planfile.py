"""The plan file (backends/planfile.py): round trip, determinism, and that no
truncated, altered or malformed file loads as anything but PlanFileError."""

from __future__ import annotations

import ast
import hashlib
import json
import struct
import zlib
from pathlib import Path

import msgpack
import numpy as np
import pytest

import attnplan
from attnplan.backends import planfile
from attnplan.backends.planfile import FORMAT_VERSION, MAGIC, _HEADER, pack, unpack
from attnplan.errors import PlanFileError
from attnplan.ir.graph import BlockGraph
from attnplan.ir.program import ATTN, FWD, Program

KW = dict(seqlens=[100, 37, 5], mask="sliding_window(20) | (k < 3 & k <= q)", devices=2, block_size=32,
          heads=4, kv_heads=2, head_dim=16)


@pytest.fixture(scope="module")
def plan() -> attnplan.Plan:
    return attnplan.compile(**KW)


@pytest.fixture(scope="module")
def data(plan) -> bytes:
    return plan.to_bytes()


def _body(data: bytes) -> dict:
    return msgpack.unpackb(zlib.decompress(data[_HEADER.size:]), raw=False)


def _frame(raw: bytes, version: int = FORMAT_VERSION) -> bytes:
    """A header with the right length and checksum around an arbitrary body."""
    return _HEADER.pack(MAGIC, version, 0, len(raw), hashlib.sha256(raw).digest()) + raw


def _repack(body) -> bytes:
    return _frame(zlib.compress(msgpack.packb(body, use_bin_type=True)))


def _load(data: bytes):
    return attnplan.Plan.from_bytes(data, "t.plan")


# ------------------------------------------------------------------ round trip

def test_round_trip(plan, tmp_path):
    path = tmp_path / "a.plan"
    plan.save(path)
    back = attnplan.load(path)
    assert back.devices == plan.devices and back.ir.nodes == plan.ir.nodes
    assert back.ir.memory_cap == plan.ir.memory_cap
    assert back.ir.program == plan.ir.program
    p, q = plan.problem, back.problem
    assert np.array_equal(p.seqlens, q.seqlens) and np.array_equal(p.pieces.a, q.pieces.a)
    assert (p.heads, p.kv_heads, p.head_dim, p.mask, p.dtype, p.segments) == \
           (q.heads, q.kv_heads, q.head_dim, q.mask, q.dtype, q.segments)
    for f in BlockGraph.__dataclass_fields__:
        if f != "problem":
            a, b = getattr(plan.ir.graph, f), getattr(back.ir.graph, f)
            assert a.dtype == b.dtype == np.int64 and np.array_equal(a, b), f
    assert np.array_equal(plan.ir.placement.home, back.ir.placement.home)
    assert np.array_equal(plan.ir.placement.cb_device, back.ir.placement.cb_device)
    assert plan.ir.schedule.stages == back.ir.schedule.stages
    assert np.array_equal(plan.ir.schedule.xfer, back.ir.schedule.xfer)
    assert np.array_equal(plan.ir.schedule.cb_stage, back.ir.schedule.cb_stage)
    assert back.meta == plan.meta and back.measured == plan.measured
    assert json.dumps(back.stats()) == json.dumps(plan.stats())
    assert back.ir.to_text() == plan.ir.to_text()
    assert back.to_bytes() == plan.to_bytes()


def test_round_trip_segments_and_memory_cap():
    p = attnplan.compile(seqlens=[10, 6], segments=[[("question", 4), ("answer", 6)], None],
                         mask="earlier_segment | (same_segment & k <= q)", devices=2, block_size=4,
                         memory_cap=1 << 30)
    back = _load(p.to_bytes())
    assert back.problem.segments == ((("question", 4), ("answer", 6)), None)
    assert back.ir.memory_cap == 1 << 30
    assert back.canonical_bytes() == p.canonical_bytes()


# ------------------------------------------------------------------ determinism

def test_same_inputs_same_bytes(tmp_path):
    a, b = attnplan.compile(**KW), attnplan.compile(**KW)
    assert a.canonical_bytes() == b.canonical_bytes()
    a.save(tmp_path / "a.plan")
    b.save(tmp_path / "b.plan")
    fa, fb = (tmp_path / "a.plan").read_bytes(), (tmp_path / "b.plan").read_bytes()
    # the files differ only in `measured` (the compile wall time): with b's set to a's they are equal
    assert pack(b.ir, b.meta, a.measured) == fa
    body_a, body_b = _body(fa), _body(fb)
    assert body_a.pop("measured").keys() == body_b.pop("measured").keys() == {"plan_s"}
    assert body_a == body_b


def test_canonical_bytes_leave_out_measured(plan):
    slow = attnplan.Plan(plan.ir, plan.meta, {"plan_s": 1234.5})
    assert slow.canonical_bytes() == plan.canonical_bytes()
    assert slow.to_bytes() != plan.to_bytes()
    assert "measured" not in msgpack.unpackb(plan.canonical_bytes(), raw=False)


def test_different_inputs_different_bytes(plan):
    other = attnplan.compile(**dict(KW, block_size=16))
    assert other.canonical_bytes() != plan.canonical_bytes()


# ------------------------------------------------------------------ nothing is unpickled

def test_planfile_does_not_import_pickle():
    tree = ast.parse(Path(planfile.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported.isdisjoint({"pickle", "cPickle", "dill", "marshal", "shelve", "joblib"}), imported
    assert "allow_pickle" not in Path(planfile.__file__).read_text()


@pytest.mark.parametrize("body", [
    {"hello": "world"},
    {"problem": {"seqlens": [1, 2, 3]}},
    [1, 2, 3],
    "a string",
    42,
    None,
    {"problem": 1, "graph": 2, "placement": 3, "schedule": 4, "program": 5, "devices": 2, "nodes": 1},
], ids=["unknown-keys", "array-not-record", "list", "string", "int", "nil", "wrong-types"])
def test_bogus_schema(body):
    with pytest.raises(PlanFileError, match="malformed"):
        _load(_repack(body))


def test_msgpack_ext_type_is_not_executed():
    # msgpack extension types (how pickle-like payloads would ride along) stay inert data
    raw = zlib.compress(msgpack.packb({"problem": msgpack.ExtType(1, b"cos\nsystem\n")}, use_bin_type=True))
    with pytest.raises(PlanFileError, match="malformed"):
        _load(_frame(raw))


def test_body_not_zlib_or_msgpack():
    with pytest.raises(PlanFileError, match="does not decode"):
        _load(_frame(b"definitely not zlib"))
    with pytest.raises(PlanFileError, match="does not decode"):
        _load(_frame(zlib.compress(b"\xc1\xc1\xc1")))  # 0xc1 is never valid msgpack


@pytest.mark.parametrize("path, value", [
    (("devices",), 3), (("devices",), 0), (("devices",), "2"), (("memory_cap",), "big"), (("memory_cap",), -1),
    (("meta",), 7), (("measured",), None), (("measured", "plan_s"), "slow"),
    (("problem", "heads"), 0), (("problem", "dtype"), "float64"), (("problem", "segments"), ""),
    (("problem", "segments"), [[["text", 99]], None, None]), (("graph", "hg_start", "shape"), []),
    (("program", "code"), [[], []]),
])
def test_schema_violations_with_valid_checksum(data, path, value):
    body = _body(data)
    d = body
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value
    with pytest.raises(PlanFileError):
        _load(_repack(body))


@pytest.mark.parametrize("value", ["big", -1, 0, True, [1]])
def test_bad_memory_cap(data, value):
    body = _body(data)
    body["memory_cap"] = value
    with pytest.raises(PlanFileError, match="memory_cap must be null or a positive integer"):
        _load(_repack(body))


# ------------------------------------------------------------------ truncation and corruption

def _cut_points(n: int) -> list[int]:
    h = _HEADER.size
    pts = {0, 1, 4, 7, 8, 9, 10, 12, 19, 20, h - 1, h, h + 1, n - 1}
    pts |= {int(x) for x in np.linspace(0, n - 1, 36)}
    return sorted(p for p in pts if 0 <= p < n)


def test_every_truncation_is_a_plan_file_error(data):
    cuts = _cut_points(len(data))
    assert len(cuts) >= 45
    for n in cuts:
        with pytest.raises(PlanFileError) as ei:
            _load(data[:n])
        assert str(ei.value).startswith("t.plan: "), (n, str(ei.value))
        assert "truncated" in str(ei.value) or "not an attnplan plan file" in str(ei.value), (n, str(ei.value))


def test_trailing_bytes(data):
    with pytest.raises(PlanFileError, match="trailing bytes"):
        _load(data + b"\0")


def test_every_byte_flip_is_a_plan_file_error(data):
    # every header byte (magic, version, flags, length, checksum) and ~50 body bytes
    positions = sorted(set(range(_HEADER.size)) | {int(x) for x in np.linspace(_HEADER.size, len(data) - 1, 50)})
    for i in positions:
        for mask in (0x01, 0x80):
            d = bytearray(data)
            d[i] ^= mask
            with pytest.raises(PlanFileError):
                _load(bytes(d))


def test_header_fields(data):
    version = bytearray(data)
    version[8:10] = struct.pack("<H", FORMAT_VERSION + 1)
    with pytest.raises(PlanFileError, match=f"format version {FORMAT_VERSION + 1}"):
        _load(bytes(version))
    magic = b"XTTNPLAN" + data[8:]
    with pytest.raises(PlanFileError, match="bad magic"):
        _load(magic)
    with pytest.raises(PlanFileError, match="not an attnplan plan file"):
        _load(b"PK\x03\x04 a zip file")
    # another body with a correct checksum but the original length field
    longer = bytearray(_frame(data[_HEADER.size:] + b"x"))
    longer[12:20] = data[12:20]
    with pytest.raises(PlanFileError, match="trailing bytes"):
        _load(bytes(longer))


def test_altered_body_with_recomputed_checksum(data):
    # an attacker who fixes up the checksum still only gets PlanFileError
    raw = bytearray(data[_HEADER.size:])
    raw[len(raw) // 2] ^= 0xFF
    with pytest.raises(PlanFileError):
        _load(_frame(bytes(raw)))


# ------------------------------------------------------------------ the verifier runs on load

def _drop_instruction(prog: Program, phase: int, device: int, op: int) -> Program:
    code = [list(ph) for ph in prog.code]
    c = code[phase][device]
    i = int(np.flatnonzero(c[:, 0] == op)[0])
    code[phase][device] = np.delete(c, i, axis=0)
    return Program(prog.devices, prog.transfers, prog.buffers, tuple(tuple(ph) for ph in code))


def test_body_that_does_not_verify(plan):
    ir = plan.ir.replace(program=_drop_instruction(plan.ir.program, FWD, 0, ATTN))
    data = pack(ir, plan.meta, plan.measured)  # decodes fine: only the verifier can tell
    with pytest.raises(PlanFileError, match="does not verify") as ei:
        _load(data)
    assert "invariant" in str(ei.value)
    ir2, _, _ = unpack(data, check=False)  # the same body without the verifier loads
    assert ir2.program.n_instructions() == plan.ir.program.n_instructions() - 1


def test_bad_ids_with_valid_checksum(data):
    # ids out of range reach the verifier; it must answer PlanFileError, not IndexError
    body = _body(data)
    rec = body["placement"]["cb_device"]
    a = np.frombuffer(rec["data"], dtype=rec["dtype"]).copy()
    for bad in (-1, 2, 10**6, 2**31 - 1):
        a2 = a.copy()
        a2[0] = bad
        rec["data"] = a2.tobytes()
        with pytest.raises(PlanFileError):
            _load(_repack(body))
    rec = body["graph"]["tile_q"]
    a = np.frombuffer(rec["data"], dtype=rec["dtype"]).copy()
    a[0] = 10**6
    rec["data"] = a.tobytes()
    with pytest.raises(PlanFileError, match="does not verify"):
        _load(_repack(body))
