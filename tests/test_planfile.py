"""The plan file (backends/planfile.py): round trip, determinism (no timing
in the file), bounded loading, and that no truncated, altered or malformed file
loads as anything but PlanFileError."""

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
from attnplan.backends import planfile, planfile_schema
from attnplan.backends.planfile import FORMAT_VERSION, MAGIC, _HEADER, pack, pack_body, unpack
from attnplan.errors import BatchError, PlanFileError
from attnplan.ir.graph import BlockGraph
from attnplan.ir.program import ADD, ATTN, ATTN_BWD, FWD, MERGE, Program
from attnplan.passes import strategy_entries
from attnplan.tools.auto import OTHER_ORDER

KW = dict(seqlens=[100, 37, 5], mask="sliding_window(20) | (k < 3 & k <= q)", devices=2, block_size=32,
          heads=4, kv_heads=2, head_dim=16)


@pytest.fixture(scope="module")
def plan() -> attnplan.Plan:
    return attnplan.compile(**KW)


@pytest.fixture(scope="module")
def data(plan) -> bytes:
    """The file with its tiles written out (every graph field present to craft)."""
    return pack(plan.ir, plan.meta, derive=False)


def _body(data: bytes) -> dict:
    return msgpack.unpackb(zlib.decompress(data[_HEADER.size:]), raw=False)


def _frame(raw: bytes, version: int = FORMAT_VERSION) -> bytes:
    """A header with the right length and checksum around an arbitrary body."""
    return _HEADER.pack(MAGIC, version, 0, len(raw), hashlib.sha256(raw).digest()) + raw


def _repack(body) -> bytes:
    return pack_body(body)


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
        if f in ("kv_rep", "relation"):
            assert getattr(back.ir.graph, f) == getattr(plan.ir.graph, f)
        elif f != "problem":
            a, b = getattr(plan.ir.graph, f), getattr(back.ir.graph, f)
            if a is None:  # the span fields of varlen groups, absent from this graph
                assert b is None, f
                continue
            assert a.dtype == b.dtype == np.int64 and np.array_equal(a, b), f
    assert np.array_equal(plan.ir.placement.home, back.ir.placement.home)
    assert np.array_equal(plan.ir.placement.cb_device, back.ir.placement.cb_device)
    assert plan.ir.schedule.stages == back.ir.schedule.stages
    assert np.array_equal(plan.ir.schedule.xfer, back.ir.schedule.xfer)
    assert np.array_equal(plan.ir.schedule.cb_stage, back.ir.schedule.cb_stage)
    assert back.meta == plan.meta
    assert back.measured == {} and plan.measured["plan_s"] > 0  # timings stay in memory, out of the file
    assert json.dumps(dict(back.stats(), plan_s=None)) == json.dumps(dict(plan.stats(), plan_s=None))
    assert back.ir.to_text() == plan.ir.to_text()
    assert back.to_bytes() == plan.to_bytes()


def test_round_trip_kv_head_copies():
    """A plan that copies kv heads (ulysses beyond the kv heads) keeps them: the
    file says ``graph.kv_rep``; plans without copies do not write the key."""
    p = attnplan.compile(seqlens=[60, 20], devices=4, heads=4, kv_heads=1, head_dim=8, block_size=16,
                         strategy="ulysses")
    body = _body(p.to_bytes())
    assert body["graph"]["kv_rep"] == 4 and "kv_rep" not in _body(attnplan.compile(**KW).to_bytes())["graph"]
    back = _load(p.to_bytes())
    assert back.ir.graph.kv_rep == 4 and back.to_bytes() == p.to_bytes()
    assert back.stats()["comm_bytes_total"] == p.stats()["comm_bytes_total"]


def test_round_trip_collective_schedule():
    """``comm{mode=a2a}``: the file says ``schedule.collective``; other plans
    do not write the key (their bytes are those of before)."""
    p = attnplan.compile(seqlens=[60, 20], devices=4, heads=4, kv_heads=4, head_dim=8, block_size=16,
                         pipeline="tile{block=16},ulysses,comm{mode=a2a},overlap,emit")
    assert _body(p.to_bytes())["schedule"]["collective"] is True
    assert "collective" not in _body(attnplan.compile(**KW).to_bytes())["schedule"]
    back = _load(p.to_bytes())
    assert back.ir.schedule.collective and not back.ir.schedule.overlap and back.to_bytes() == p.to_bytes()


def test_collective_flag_on_a_staged_overlapped_plan_does_not_verify(data):
    body = _body(data)
    body["schedule"]["collective"] = True  # the runtime would run its staged messages as all-to-alls
    with pytest.raises(PlanFileError, match=r"plan does not verify: invariant 3: a collective schedule "
                                            r"\(comm\{mode=a2a\}\) has one stage and no overlap"):
        _load(_repack(body))


def test_kv_rep_that_does_not_match_the_head_groups_does_not_verify(data):
    body = _body(data)
    body["graph"]["kv_rep"] = 2  # 4 query heads over 2 x 2 copies is a valid shape, but hg_end says 2 kv heads
    with pytest.raises(PlanFileError, match=r"graph: invariant 2: head groups do not partition "
                                            r"the kv heads \(x kv_rep 2\)"):
        _load(_repack(body))


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
    assert a.measured["plan_s"] != b.measured["plan_s"]  # two compiles never take the same time ...
    a.save(tmp_path / "a.plan")
    b.save(tmp_path / "b.plan")
    fa, fb = (tmp_path / "a.plan").read_bytes(), (tmp_path / "b.plan").read_bytes()
    assert fa == fb  # ... and the files are still byte-identical
    assert a.canonical_bytes() == b.canonical_bytes()


def test_no_timing_in_the_file(plan):
    slow = attnplan.Plan(plan.ir, plan.meta, {"plan_s": 1234.5})
    assert slow.to_bytes() == plan.to_bytes() and slow.canonical_bytes() == plan.canonical_bytes()
    assert "measured" not in _body(plan.to_bytes())
    assert slow.stats()["plan_s"] == 1234.5  # in memory, right after compile, for `plan stats`


def test_canonical_bytes_are_the_file_body(plan):
    assert zlib.decompress(plan.to_bytes()[_HEADER.size:]) == plan.canonical_bytes()
    # meta key order does not change the bytes
    shuffled = attnplan.Plan(plan.ir, dict(reversed(list(plan.meta.items()))))
    assert list(shuffled.meta) != list(plan.meta) and shuffled.to_bytes() == plan.to_bytes()


def test_old_files_with_measured_still_load(data, plan):
    body = _body(data)
    body["measured"] = {"plan_s": 0.25}
    back = _load(_repack(body))
    assert back.ir.program == plan.ir.program and back.measured == {}


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
    (("meta",), 7),
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
    return Program(prog.devices, prog.transfers, prog.buffers, tuple(tuple(ph) for ph in code), prog.messages)


def test_body_that_does_not_verify(plan):
    ir = plan.ir.replace(program=_drop_instruction(plan.ir.program, FWD, 0, ATTN))
    data = pack(ir, plan.meta)  # decodes fine: only the verifier can tell
    with pytest.raises(PlanFileError, match="does not verify") as ei:
        _load(data)
    assert "invariant" in str(ei.value)
    ir2, _ = unpack(data, check=False)  # the same body without the verifier loads
    assert ir2.program.n_instructions() == plan.ir.program.n_instructions() - 1


def test_bad_ids_with_valid_checksum(data):
    # ids out of range reach the verifier; it must answer PlanFileError, not IndexError
    body = _body(data)
    a = _get_arr(body["placement"]["cb_device"])
    for bad in (-1, 2, 10**6, 2**31 - 1):
        a2 = a.copy()
        a2[0] = bad
        body["placement"]["cb_device"] = _rec(a2)
        with pytest.raises(PlanFileError):
            _load(_repack(body))
    a = _get_arr(body["graph"]["tile_q"])
    a[0] = 10**6
    body["graph"]["tile_q"] = _rec(a)
    with pytest.raises(PlanFileError, match=r"graph\.tile_q\[0\] = 1000000 is outside \[0, "):
        _load(_repack(body))  # caught by the loader's id ranges, before the verifier sees it


@pytest.mark.parametrize("exc", [IndexError, ValueError, TypeError, OverflowError, MemoryError, RecursionError])
def test_any_verifier_exception_is_a_plan_file_error(data, monkeypatch, exc):
    def broken(ir, done=None):
        raise exc("crafted arrays")
    monkeypatch.setattr(planfile, "verify", broken)
    with pytest.raises(PlanFileError, match=f"does not verify: malformed arrays \\({exc.__name__}"):
        _load(data)


# ------------------------------------------------------------------ layering: the segment check lives in ir/

def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (imports inside functions count), relative ones resolved."""
    pkg = "attnplan." + ".".join(path.relative_to(Path(attnplan.__file__).parent).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = pkg.rsplit(".", node.level - 1)[0] if node.level else ""
            mod = f"{base}.{node.module}" if node.level and node.module else (node.module or base)
            out |= {mod} | {f"{mod}.{a.name}" for a in node.names}
    return out


def test_plan_file_code_imports_no_frontend_runtime_or_face():
    root = Path(attnplan.__file__).parent
    for path in (root / "backends" / "planfile.py", root / "backends" / "planfile_schema.py"):
        bad = {m for m in _imports(path)
               if m.startswith(("attnplan.frontend", "attnplan.runtime", "attnplan.api", "attnplan.cli"))}
        assert not bad, (path.name, bad)
    assert {m.split(".")[1] for m in _imports(root / "ir" / "segments.py") if m.startswith("attnplan.")} <= {
        "errors", "ir"}


BAD_SEGMENTS = [
    "text", [None], [None, None, 3], [[]], [[["text"]], None, None], [[["", 100]], None, None],
    [[[7, 100]], None, None], [[["text", 0], ["a", 100]], None, None], [[["text", True]], None, None],
    [[["text", 99]], None, None], [[["a", 50], ["b", 51]], None, None], [[["a", 1.5]], None, None],
    [[["a", 100]], [["b", 36], ["c", 2]], None],
]


@pytest.mark.parametrize("segs", BAD_SEGMENTS, ids=[str(i) for i in range(len(BAD_SEGMENTS))])
def test_segment_check_agrees_with_batch_files(segs):
    from attnplan.frontend.batch import Batch
    from attnplan.ir.segments import check_segments
    lens = (100, 37, 5)
    with pytest.raises(BatchError) as ours:
        check_segments(segs, lens, "")
    with pytest.raises(BatchError) as theirs:
        Batch(lens, segs)
    assert str(ours.value) == str(theirs.value)


def test_segment_check_normalizes_and_shows_non_json_values():
    from attnplan.ir.segments import check_segments
    assert check_segments([[["q", 4], ("a", 6)], None], [10, 6], "") == ((("q", 4), ("a", 6)), None)
    with pytest.raises(BatchError, match=r"problem\.segments\[0\]\[0\] must be \[kind, length\], got \"b'x'\""):
        check_segments([[b"x"]], [1], "problem.")  # bytes from a crafted plan file: a message, not a TypeError
    with pytest.raises(BatchError, match=r"sum to 300000000000000000000 but sample 0 has length 3"):
        check_segments([[["a", 3 * 10**20]]], [3], "")  # Python ints: no wrap-around


# ------------------------------------------------------------------ bounded loading

def _peak_bytes(fn) -> tuple[float, int]:
    """(seconds, peak bytes Python allocated) of ``fn()``, which must raise PlanFileError."""
    import time
    import tracemalloc
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(PlanFileError) as ei:
            fn()
        dt = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    _peak_bytes.last = str(ei.value)
    return dt, peak


def test_huge_file_is_refused_from_its_header(tmp_path, data):
    # a 3 GB (sparse) file whose header declares its real length: refused before its body is read
    path = tmp_path / "huge.plan"
    length = 3 << 30
    with open(path, "wb") as f:
        f.write(_HEADER.pack(MAGIC, FORMAT_VERSION, 0, length, b"\0" * 32))
        f.truncate(_HEADER.size + length)
    dt, peak = _peak_bytes(lambda: attnplan.load(path))
    assert "MAX_PLAN_FILE" in _peak_bytes.last and dt < 1 and peak < (1 << 20), (dt, peak, _peak_bytes.last)
    # a small header on a 3 GB file: the size disagrees, nothing is read
    with open(path, "r+b") as f:
        f.write(data[:_HEADER.size])
    dt, peak = _peak_bytes(lambda: attnplan.load(path))
    assert "trailing bytes" in _peak_bytes.last and dt < 1 and peak < (1 << 20), (dt, peak, _peak_bytes.last)


def test_load_reads_exactly_the_declared_body(tmp_path, data, monkeypatch):
    reads = []
    real_open = open

    class Spy:
        def __init__(self, f):
            self.f = f

        def read(self, n=-1):
            reads.append(n)
            return self.f.read(n)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

    monkeypatch.setattr("builtins.open", lambda *a, **k: Spy(real_open(*a, **k)))
    path = tmp_path / "a.plan"
    path.write_bytes(data)
    attnplan.load(path)
    assert reads == [_HEADER.size, len(data) - _HEADER.size, 1]  # header, body, the check for trailing bytes


def _bomb(inflated: int) -> bytes:
    """A zlib stream of about inflated/1000 bytes that inflates to ``inflated`` zero bytes
    (one flushed 1 MiB block repeated; its final checksum is never reached)."""
    c = zlib.compressobj(9)
    block = b"\0" * (1 << 20)
    head = c.compress(block) + c.flush(zlib.Z_FULL_FLUSH)
    rep = c.compress(block) + c.flush(zlib.Z_FULL_FLUSH)
    return head + rep * (inflated // len(block) - 1) + c.flush()


def test_zlib_bomb_fails_fast_with_little_memory():
    raw = _bomb(1 << 30)  # 1 GiB from about 1 MB
    assert len(raw) < 2 << 20
    dt, peak = _peak_bytes(lambda: _load(_frame(raw)))
    assert "MAX_PLAN_BODY" in _peak_bytes.last, _peak_bytes.last
    assert dt < 10 and peak < len(raw) + (8 << 20), (dt, peak)  # the file, one inflate step, no body


def test_body_limit_is_checked_before_decoding(data, monkeypatch):
    from attnplan.ir import limits
    size = len(zlib.decompress(data[_HEADER.size:]))
    monkeypatch.setattr(limits, "MAX_PLAN_BODY", size - 1)
    with pytest.raises(PlanFileError, match="inflates to more than MAX_PLAN_BODY"):
        _load(data)
    monkeypatch.setattr(limits, "MAX_PLAN_BODY", size)
    _load(data)
    monkeypatch.setattr(limits, "MAX_PLAN_FILE", len(data) - 1)
    with pytest.raises(PlanFileError, match="larger than the limit MAX_PLAN_FILE"):
        _load(data)


def test_incomplete_or_padded_zlib_stream(data):
    raw = data[_HEADER.size:]
    with pytest.raises(PlanFileError, match="does not decode: the compressed stream is incomplete"):
        _load(_frame(raw[:-10]))
    with pytest.raises(PlanFileError, match="does not decode: 3 bytes follow the compressed stream"):
        _load(_frame(raw + b"abc"))


def test_msgpack_string_bound():
    from attnplan.ir.limits import MAX_MASK_TEXT
    with pytest.raises(PlanFileError, match="does not decode"):
        _load(_repack({"problem": {"mask": "x" * (4 * MAX_MASK_TEXT + 1)}}))


def test_bad_paths_and_data():
    with pytest.raises(PlanFileError, match="must be a string or path"):
        attnplan.load(0)  # never a file descriptor
    with pytest.raises(PlanFileError, match="cannot read plan file"):
        attnplan.load(Path(attnplan.__file__).parent)
    with pytest.raises(PlanFileError, match="must be bytes"):
        attnplan.Plan.from_bytes("ATTNPLAN")


# ------------------------------------------------------------------ everything the runtime relies on

def _rec(a, dtype="<i8") -> dict:
    a = np.asarray(a, dtype=np.int64)
    return {"dtype": dtype, "shape": list(a.shape), "data": a.astype(dtype).tobytes()}


def _get_arr(rec) -> np.ndarray:
    return planfile_schema.record(rec, "test", rec["shape"][1] if len(rec["shape"]) == 2 else None)


def _set(body, path, value):
    d = body
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value(d[path[-1]]) if callable(value) else value


def _edit_arr(fn):
    """A value for ``_set``: the array record with ``fn`` applied to a copy of the array."""
    return lambda rec: _rec(fn(_get_arr(rec).copy()))


def _col(c, v, row=0):
    def f(a):
        a[row, c] = v
        return a
    return f


def _opcode(old, new):
    def f(a):
        i = np.flatnonzero(a[:, 0] == old)[0]  # the first such instruction (IndexError if there is none)
        a[i, 0] = new
        return a
    return f


CRAFTED = [
    # (path, new value, regex the message must match)
    (("problem", "seqlens"), _edit_arr(lambda a: np.append(a, 0)), r"problem\.seqlens\[3\] = 0 is outside \[1, "),
    (("problem", "seqlens"), _rec([1 << 62] * 4), r"problem\.seqlens\[0\] = 4611686018427387904 is outside"),
    (("problem", "seqlens"), _rec([1 << 31]), r"problem\.seqlens\[0\] = 2147483648 is outside \[1, 67108864\]"),
    (("problem", "seqlens"), _rec([1 << 25] * 3), r"sum to 100663296 tokens, more than MAX_TOKENS"),
    (("problem", "seqlens"), _rec(np.zeros(0)), r"problem\.seqlens is empty"),
    (("problem", "seqlens"), _rec([[100, 37, 5]]), r"problem\.seqlens has shape \[1, 3\], expected \[n\]"),
    (("problem", "heads"), 0, r"problem\.heads = 0 is outside"),
    (("problem", "heads"), 1 << 63, r"problem\.heads = \d+ is outside .*MAX_HEADS"),
    (("problem", "kv_heads"), 3, r"problem\.heads \(4\) is not a multiple of problem\.kv_heads \(3\)"),
    (("problem", "head_dim"), -1, r"problem\.head_dim = -1 is outside"),
    (("problem", "head_dim"), 16.0, r"problem\.head_dim must be an integer, got float"),
    (("problem", "dtype"), "float64", r"problem\.dtype 'float64' is not one of"),
    (("problem", "dtype"), 5, r"problem\.dtype must be a string"),
    (("problem", "mask"), None, r"problem\.mask must be a string"),
    (("problem", "pieces"), _edit_arr(_col(4, -(1 << 62))), r"problem\.pieces\[:, lo\]\[0\] = -4611686018427387904"),
    (("problem", "pieces"), _edit_arr(lambda a: a[:, :5]), r"problem\.pieces has shape \[\d+, 5\], expected \[n, 6\]"),
    (("problem", "segments"), [[["text", 99]], None, None], r"problem\.segments\[0\] sum to 99"),
    (("devices",), 100_000, r"body\.devices = 100000 is outside \[1, 256\] \(the limit MAX_DEVICES\)"),
    (("nodes",), 3, r"body\.nodes = 3 is outside \[1, 2\]"),
    (("graph", "tb_end"), _edit_arr(lambda a: a[:-1]), r"graph\.tb_end has \d+ rows, expected \d+"),
    (("graph", "tb_start"), _edit_arr(lambda a: np.arange(1000)), r"graph\.tb_start has 1000 rows, more than 142"),
    (("graph", "hg_end"), _edit_arr(lambda a: a + 5), r"graph\.hg_end\[0\] = 7 is outside \[0, 2\]"),
    (("graph", "cb_tile"), _edit_arr(lambda a: a[:-1]), r"graph\.cb_tile has \d+ rows, expected \d+"),
    (("graph", "cb_hg"), _edit_arr(lambda a: a + 1), r"graph\.cb_hg\[0\] = 1 is outside \[0, 0\]"),
    (("graph", "piece_src"), _edit_arr(lambda a: a - 1), r"graph\.piece_src\[0\] = -1 is outside"),
    (("graph", "tile_ptr"), _edit_arr(lambda a: a * 10), r"graph\.tile_ptr\[\d+\] = \d+ is outside"),
    (("graph", "pieces"), _edit_arr(_col(1, 10**9)), r"graph\.pieces\[:, q1\]\[0\] = 1000000000 is outside"),
    (("graph", "tile_q"), {"dtype": "<i8", "shape": [1 << 40, 1 << 40], "data": b""},
     r"graph\.tile_q has shape \[1099511627776, 1099511627776\], expected \[n\]"),
    (("graph", "tile_q"), {"dtype": "<i8", "shape": [1 << 40], "data": b""}, r"graph\.tile_q: data has 0 bytes"),
    (("graph", "tile_q"), {"dtype": "<f8", "shape": [0], "data": b""}, r"graph\.tile_q: dtype must be one of"),
    (("placement", "home"), _edit_arr(lambda a: a + 2), r"placement\.home\[0\] = 2 is outside \[0, 1\]"),
    (("placement", "cb_device"), _edit_arr(lambda a: a[:3]), r"placement\.cb_device has 3 rows"),
    (("schedule", "stages"), 0, r"schedule\.stages = 0 is outside"),
    (("schedule", "cb_stage"), _edit_arr(lambda a: a + 100), r"schedule\.cb_stage\[0\] = \d+ is outside"),
    (("schedule", "xfer"), _edit_arr(_col(0, 5)), r"schedule\.xfer\[:, kind\]\[0\] = 5 is outside \[0, 2\]"),
    (("schedule", "overlap"), 1, r"schedule\.overlap must be a boolean"),
    # a transfer record's columns: its row in the program, then the program's columns (see planfile_schema)
    (("program", "transfers"), _edit_arr(_col(2, 2)), r"program\.transfers\[:, phase\]\[\d+\] = 2 is outside"),
    (("program", "transfers"), _edit_arr(_col(6, 7)), r"program\.transfers\[:, src\]\[\d+\] = 7 is outside \[0, 1\]"),
    (("program", "transfers"), _edit_arr(_col(0, 1)), r"program\.transfers: row 1 is stored twice"),
    (("program", "buffers", 0, 0), _edit_arr(_col(3, 7)), r"program\.buffers\[0\]\[0\]\[:, role\]\[0\] = 7"),
    (("program", "buffers", 1), lambda ph: ph[:1], r"program\.buffers must have 2 phases x 2 devices"),
    (("program", "code", 0, 0), _edit_arr(_col(0, 9)),
     r"program\.code\[0\]\[0\]\[:, op\]\[0\] = 9 is outside \[0, 6\]"),
    (("program", "code", 0, 0), _edit_arr(lambda a: np.append(a, [[3, 0, 0, 0, 999, 0]], 0)),
     r"program\.code\[0\]\[0\] instruction \d+ \(attn\): operand 4 = 999 names no buffer"),
    (("program", "code", 0, 0), _edit_arr(lambda a: np.append(a, [[2, 10**6, 0, 0, 0, 0]], 0)),
     r"instruction \d+ \(wait\): operand 1 = 1000000 names no message"),
    (("program", "code", 1, 1), _edit_arr(lambda a: np.append(a, [[5, 10**6, 0, 0, 0, 0]], 0)),
     r"program\.code\[1\]\[1\] instruction \d+ \(attn_bwd\): operand 1 = 1000000 names no compute block"),
    (("program", "code", 0, 1), _edit_arr(lambda a: np.append(a, [[2, 0, 1, 0, 0, 0]], 0)),
     r"instruction \d+ \(wait\): operand 2 = 1 names no unused"),
    (("program", "code", 0, 0), _edit_arr(_opcode(ATTN, ATTN_BWD)),  # issue 8: this loaded, then crashed `plan run`
     r"program\.code\[0\]\[0\] instruction \d+: attn_bwd is not a fwd instruction"),
    (("program", "code", 1, 0), _edit_arr(_opcode(ADD, MERGE)),
     r"program\.code\[1\]\[0\] instruction \d+: merge is not a bwd instruction"),
    (("memory_cap",), 1 << 63, r"memory_cap must be null or a positive integer"),
    (("extra",), 1, r"unknown body keys \['extra'\]"),
    (("graph", "kv_rep"), 3, r"graph\.kv_rep = 3: problem\.heads \(4\) is not a multiple of kv_heads x kv_rep \(6\)"),
    (("graph", "kv_rep"), "2", r"graph\.kv_rep must be an integer"),
    (("graph", "kv_rep"), 0, r"graph\.kv_rep = 0 is outside \[1, 4096\]"),
    (("schedule", "collective"), 1, r"schedule\.collective must be a boolean"),
]


@pytest.mark.parametrize("path, value, match", CRAFTED, ids=[f"{'.'.join(map(str, c[0]))}-{i}"
                                                            for i, c in enumerate(CRAFTED)])
def test_crafted_field_names_the_field(data, path, value, match):
    body = _body(data)
    _set(body, path, value)
    with pytest.raises(PlanFileError, match=match) as ei:
        _load(_repack(body))
    assert str(ei.value).startswith("t.plan: malformed plan file: "), str(ei.value)


def test_instruction_limit(data, monkeypatch, plan):
    from attnplan.ir import limits
    monkeypatch.setattr(limits, "MAX_INSTRUCTIONS", plan.ir.program.n_instructions() - 1)
    with pytest.raises(PlanFileError,
                       match=r"program\.code\[1\]\[1\] has \d+ rows, more than \d+ \(MAX_INSTRUCTIONS\)"):
        _load(data)


def test_many_devices_are_refused_at_once(data):
    # the 27 KB file declaring 100,000 devices took 72 s to load
    import time
    body = _body(data)
    empty = _rec(np.zeros((0, 6)))
    body["devices"] = 100_000
    body["program"]["buffers"] = [[empty] * 100_000] * 2
    body["program"]["code"] = [[empty] * 100_000] * 2
    blob = _repack(body)
    t0 = time.perf_counter()
    with pytest.raises(PlanFileError, match="MAX_DEVICES"):
        _load(blob)
    assert time.perf_counter() - t0 < 5 and len(blob) < 100_000  # 0.2 s here


# ------------------------------------------------------------------ meta

@pytest.mark.parametrize("key, value, match", [
    ("profile", "/etc/passwd", r"meta\.profile must be a builtin cost profile \(a100, cpu-local, h100, h200\), "
                               r"got '/etc/passwd'"),
    ("profile", "mine.json", r"meta\.profile must be a builtin cost profile"),
    ("profile", 3, r"meta\.profile must be a builtin cost profile .*got int"),
    ("strategy", 5, r"meta\.strategy must be a string"),
    ("pipeline", ["tile"], r"meta\.pipeline must be a string"),
    ("block_size", 0, r"meta\.block_size must be an integer in \[1, "),
    ("block_size", True, r"meta\.block_size must be an integer"),
    ("candidates", {"zigzag": float("nan")}, r"meta\.candidates\.zigzag must be a finite number, got nan"),
    ("candidates", {"zigzag": "fast"}, r"meta\.candidates\.zigzag must be a finite number, got str"),
    ("candidates", [1.0], r"meta\.candidates must be a map"),
    ("anything", {"nested": 1}, r"meta\.anything must be a finite number, got dict"),
    ("anything", float("inf"), r"meta\.anything must be a finite number, got inf"),
])
def test_meta_types(data, key, value, match):
    body = _body(data)
    body["meta"][key] = value
    with pytest.raises(PlanFileError, match=match):
        _load(_repack(body))


def test_unknown_scalar_meta_keys_load(data):
    body = _body(data)
    body["meta"].update(note="<!--<script>", flag=True, count=3, none=None)
    assert _load(_repack(body)).meta["note"] == "<!--<script>"


def test_meta_that_cannot_be_written(plan):
    with pytest.raises(PlanFileError, match=r"cannot write a plan file: meta\.x must be a finite number, got list"):
        attnplan.Plan(plan.ir, dict(plan.meta, x=[1])).to_bytes()


def test_file_profile_stays_out_of_the_file(tmp_path, plan):
    from dataclasses import asdict

    from attnplan.backends.cost import PROFILES
    prof = tmp_path / "mine.json"
    prof.write_text(json.dumps(dict(asdict(PROFILES["a100"]), name="mine")))
    mine = attnplan.compile(**KW, profile=str(prof))
    predicted = {name: plan.stats(name)["predicted_s"] for name in ("h100", "a100")}
    assert predicted["h100"] != predicted["a100"]
    assert mine.meta["profile"] == str(prof) and mine.stats()["predicted_s"] == predicted["a100"]  # used in memory
    back = _load(mine.to_bytes())
    assert "profile" not in back.meta and "profile" not in _body(mine.to_bytes())["meta"]
    assert back.stats()["predicted_s"] == predicted["h100"]  # the default: the file names no path ...
    assert back.stats(str(prof))["predicted_s"] == predicted["a100"]  # ... a file profile comes from a flag
    assert mine.to_bytes() == attnplan.Plan(plan.ir, {k: v for k, v in plan.meta.items() if k != "profile"}).to_bytes()
    assert _load(attnplan.compile(**KW, profile="a100").to_bytes()).meta["profile"] == "a100"


# ------------------------------------------------------------------ reproducible files

@pytest.mark.parametrize("strategy", list(strategy_entries()) + ["auto"])
def test_every_strategy_gives_byte_identical_files(strategy):
    kw = dict(KW, strategy=strategy)
    a, b = attnplan.compile(**kw), attnplan.compile(**kw)
    assert a.to_bytes() == b.to_bytes()
    assert _load(a.to_bytes()).to_bytes() == a.to_bytes()
    if strategy == "auto":
        keys = set(a.meta["candidates"]) | set(a.meta["pruned"])  # every entry (span{grain=2} too), and the
        assert {k.removesuffix(OTHER_ORDER) for k in keys} == set(strategy_entries())  # other order


def test_byte_identical_files_across_processes(tmp_path):
    import os
    import subprocess
    import sys
    code = ("import sys, attnplan; attnplan.compile(seqlens=[300, 77, 9, 150], mask='causal | k < 4', devices=3, "
            "heads=4, kv_heads=2, head_dim=16, block_size=32, strategy='hypergraph').save(sys.argv[1])")
    outs = []
    for i, seed in enumerate(("1", "2")):  # different hash seeds: set and dict orders of str keys differ
        out = tmp_path / f"{i}.plan"
        env = dict(os.environ, PYTHONHASHSEED=seed)
        subprocess.run([sys.executable, "-c", code, str(out)], check=True, env=env, timeout=120)
        outs.append(out.read_bytes())
    assert outs[0] == outs[1] and len(outs[0]) > _HEADER.size
    assert attnplan.load(tmp_path / "0.plan").devices == 3


def test_msgpack_maps_bomb_fails_fast_with_little_memory():
    # 4M empty maps are 4 MB of msgpack (4 kB compressed) but 256 MB of Python dicts: refused after a few thousand
    n = 1 << 22
    packed = msgpack.packb({"problem": None})[:-1] + b"\xdd" + struct.pack(">I", n) + b"\x80" * n
    dt, peak = _peak_bytes(lambda: _load(_frame(zlib.compress(packed))))
    assert "maps" in _peak_bytes.last and "MAX_DEVICES" in _peak_bytes.last, _peak_bytes.last
    assert dt < 5 and peak < (64 << 20), (dt, peak)


def test_msgpack_lists_are_budgeted(monkeypatch):
    monkeypatch.setattr(planfile._Budget, "MAX_SLOTS", 100_000)
    lists = msgpack.packb({"problem": [[]] * 20_000})
    with pytest.raises(PlanFileError, match="more lists and maps than a plan of MAX_SEGMENTS"):
        _load(_frame(zlib.compress(lists)))
    with pytest.raises(PlanFileError, match="malformed"):  # within the budget: decoded, then the schema says no
        _load(_frame(zlib.compress(msgpack.packb({"problem": [[]] * 1000}))))


def test_cli_reports_a_crafted_file_in_one_line(data, tmp_path, capsys):
    from attnplan import cli
    body = _body(data)
    body["meta"]["profile"] = "/etc/passwd"
    path = tmp_path / "crafted.plan"
    path.write_bytes(_repack(body))
    for cmd in ("stats", "show"):
        code = cli.main([cmd, str(path)])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and "meta.profile must be a builtin cost profile" in err, err


# ------------------------------------------------------------------ array encoding (format 2) and format 1 files

@pytest.mark.parametrize("shape", [(0,), (7,), (0, 6), (5, 6), (3, 1)])
def test_delta_records_round_trip_extreme_values(shape):
    rng = np.random.default_rng(sum(shape))
    extremes = np.array([0, 1, -1, (1 << 62), -(1 << 62), (1 << 63) - 1, -(1 << 63), 2**31, -2**31 - 1], np.int64)
    a = extremes[rng.integers(len(extremes), size=shape)]
    rec = planfile._arr(a)
    assert rec["enc"] == "delta" and rec["shape"] == list(shape)
    assert np.array_equal(_get_arr(rec), a)


def test_raw_records_still_load(plan, data):
    """Array records written raw, row-major (no "enc"), as format 1 wrote them, load as the delta-encoded ones."""
    def raw(x):
        if isinstance(x, dict) and x.get("enc") == "delta":
            return _rec(_get_arr(x), x["dtype"] if x["dtype"] == "<i8" else "<i8")
        if isinstance(x, dict):
            return {k: raw(v) for k, v in x.items()}
        if isinstance(x, list):
            return [raw(v) for v in x]
        return x
    body = raw(_body(data))
    old = _load(_frame(zlib.compress(msgpack.packb(body, use_bin_type=True))))
    assert old.canonical_bytes() == plan.canonical_bytes()


@pytest.mark.parametrize("version", [1, 2])
def test_plans_from_before_coalesced_messages_are_refused_by_name(data, version):
    body = _body(data)
    with pytest.raises(PlanFileError, match=rf"format version {version} sends every block as its own message; this "
                                            rf"attnplan reads version 3 \(coalesced messages\): compile the plan again"):
        _load(_frame(zlib.compress(msgpack.packb(body, use_bin_type=True)), version=version))


def test_message_table_is_checked(data, plan):
    """Crafted message tables and transfers: a range past the transfers, an empty message, a message with another
    route than its blocks, bytes that are not their sum, a transfer naming a buffer its device does not have.
    (A file stores the message table's ``end`` column as it is and the rest as residuals against what the
    reader derives, which are zeros for an emitted plan: see planfile_schema.)"""
    from attnplan.ir.program import M_BYTES, M_DST, M_END, M_START, T_RBUF
    n = len(plan.ir.program.transfers)

    def put(row, col, value):
        return lambda a: a.__setitem__((row, col), value(a) if callable(value) else value)
    cases = [
        (put(0, M_END, n + 1), "messages", r"program\.messages\[:, end\]\[0\] = \d+ is outside"),
        (put(0, M_START, lambda a: a[0, M_END]), "messages", r"m0 carries transfers t\d+\.\.t\d+: a message's "
                                                            r"transfers are a non-empty range"),
        (put(0, M_DST, 1), "messages", r"program\.messages\[:, dst\]\[0\] = \d+ is outside|message m0 .* has a bad "
                                       r"phase, source or destination|is carried by m0"),
        (put(0, M_BYTES, 1), "messages", r"m0 .* says \d+ bytes; its transfers carry \d+"),
        (put(0, 1 + T_RBUF, 10**6), "transfers", r"program\.transfers\[:, rbuf\]\[\d+\] = 1000000 names no buffer "
                                                 r"of device \d"),
    ]
    for edit, field, match in cases:
        body = _body(data)
        a = _get_arr(body["program"][field]).copy()
        edit(a)
        body["program"][field] = _rec(a)
        with pytest.raises(PlanFileError, match=match):
            _load(_repack(body))


def test_derived_fields_are_stored_as_zeros_and_round_trip(data, plan):
    """An emitted plan stores its derived fields (sizes, the message table but its ends, the transfers' tags) as
    zero residuals; a program whose derived fields are wrong still round-trips exactly (and fails to verify)."""
    from attnplan.ir.program import BBYTES, M_END, T_BYTES, T_TAG
    body = _body(data)
    t, m = _get_arr(body["program"]["transfers"]), _get_arr(body["program"]["messages"])
    assert not t[:, 1 + T_TAG].any() and not t[:, 1 + T_BYTES].any()
    assert not np.delete(m, M_END, axis=1).any()
    assert not any(_get_arr(b)[:, BBYTES].any() for ph in body["program"]["buffers"] for b in ph)
    p = plan.ir.program
    X, M = p.transfers.copy(), p.messages.copy()
    X[0, T_BYTES] += 3
    M[-1, 6] -= 5
    odd = plan.ir.replace(program=Program(p.devices, X, p.buffers, p.code, M))
    back, _ = planfile.unpack(planfile.pack(odd, plan.meta), check=False)
    assert back.program == odd.program
    with pytest.raises(PlanFileError, match="does not verify"):
        planfile.unpack(planfile.pack(odd, plan.meta))


def test_unknown_array_encoding_is_named(data):
    body = _body(data)
    body["graph"]["tile_q"]["enc"] = "rle"
    with pytest.raises(PlanFileError, match=r"graph\.tile_q: enc must be 'raw' or 'delta'"):
        _load(_repack(body))
