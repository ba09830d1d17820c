"""A crafted-plan-file fuzzer: valid plans whose decoded body is altered
(instructions, buffer rows, transfers, messages, seqlens, pieces, graph arrays, devices,
shapes, dtypes, huge, negative and zero numbers, wrong types, missing keys),
re-encoded with a VALID checksum. Loading each must give ``PlanFileError`` or
a plan that runs (forward and backward, float64) equal to dense attention over
its own problem, and whose stats compute — never another exception, and within
a time bound per case. Deterministic: every case comes from an explicit seed."""

from __future__ import annotations

import copy
import math
import time
import traceback
import zlib

import msgpack
import numpy as np
import pytest
import torch

import attnplan
from attnplan.backends import planfile_schema
from attnplan.backends.planfile import _HEADER, pack_body
from attnplan.errors import PlanFileError
from attnplan.ir.program import ADD, ATTN, ATTN_BWD, MERGE
from attnplan.runtime.check import reference

BASES = {
    "zigzag": dict(seqlens=[23, 9, 4], mask="sliding_window(6) | (k < 2 & k <= q)", devices=2, heads=2,
                   kv_heads=1, head_dim=4, block_size=8, strategy="zigzag"),
    "minheap-gqa": dict(seqlens=[17, 11], mask="causal", devices=3, heads=4, kv_heads=2, head_dim=4, block_size=4,
                        strategy="minheap"),
    "per_doc-segments": dict(seqlens=[10, 6], segments=[[("question", 4), ("answer", 6)], None],
                             mask="earlier_segment | (same_segment & k <= q)", devices=2, heads=2, kv_heads=2,
                             head_dim=4, block_size=4, strategy="per_doc"),
    "divide-overlap": dict(seqlens=[20, 7], mask="causal", devices=2, heads=2, kv_heads=1, head_dim=4,
                           pipeline="tile{block=4},minheap,comm{mode=p2p},divide{stages=2},overlap,emit"),
}
CASES_PER_BASE = 125
LOAD_SECONDS = 2.0  # per case, generous for a loaded 2-core machine (a load here takes milliseconds)
TOL = 1e-9          # float64 against the float64 reference

HUGE = [2**31 - 1, -2**31, 2**62, -2**62, 2**63 - 1, -2**63]


# ------------------------------------------------------------------ encoding

def _decode(data: bytes) -> dict:
    return msgpack.unpackb(zlib.decompress(data[_HEADER.size:]), raw=False)


def _encode(body) -> bytes:
    return pack_body(body)


def _is_record(x) -> bool:
    """An array record that decodes (an earlier mutation may have broken one: it is then a container)."""
    if not (isinstance(x, dict) and set(x) - {"enc"} == {"dtype", "shape", "data"}):
        return False
    try:
        _get(x)
    except (PlanFileError, TypeError, IndexError):
        return False
    return True


def _get(rec) -> np.ndarray:
    return planfile_schema.record(rec, "fuzz", rec["shape"][1] if len(rec["shape"]) == 2 else None)


def _rec(a) -> dict:
    a = np.asarray(a, dtype=np.int64)
    return {"dtype": "<i8", "shape": list(a.shape), "data": a.tobytes()}


def _sites(body):
    """Paths of every array record and of every other leaf (scalar)."""
    arrays, scalars, containers = [], [], []

    def walk(x, path):
        if _is_record(x):
            arrays.append(path)
        elif isinstance(x, (dict, list)):
            containers.append(path)
            for k, v in (x.items() if isinstance(x, dict) else enumerate(x)):
                walk(v, path + (k,))
        else:
            scalars.append(path)

    walk(body, ())
    return arrays, scalars, containers


def _at(body, path):
    for k in path:
        body = body[k]
    return body


def _put(body, path, value):
    _at(body, path[:-1])[path[-1]] = value


def _pick(rng, seq):
    return seq[int(rng.integers(len(seq)))]


# ------------------------------------------------------------------ mutations (each edits ``body`` in place)

def m_element(body, rng):
    """One array entry becomes 0, ±1, a neighbour, a huge or negative number, or another entry."""
    arrays = [p for p in _sites(body)[0] if _get(_at(body, p)).size]
    path = _pick(rng, arrays)
    a = _get(_at(body, path)).copy()
    flat = a.reshape(-1)
    i = int(rng.integers(flat.size))
    v = int(flat[i])
    flat[i] = _pick(rng, [0, 1, -1, v + 1, v - 1, 2 * v, int(rng.integers(-3, 60)), int(flat[rng.integers(flat.size)]),
                          *HUGE])
    _put(body, path, _rec(a))
    return f"element {path}[{i}]: {v} -> {int(flat[i])}"


def m_rows(body, rng):
    """Drop, duplicate, swap, reverse or append rows of one array."""
    path = _pick(rng, _sites(body)[0])
    a = _get(_at(body, path))
    op = _pick(rng, ["drop", "dup", "swap", "reverse", "append"])
    n = len(a)
    if op == "append" or n == 0:
        row = rng.integers(-2, 40, size=a.shape[1:])
        a = np.concatenate([a, row[None]])
    elif op == "drop":
        a = np.delete(a, int(rng.integers(n)), axis=0)
    elif op == "dup":
        i = int(rng.integers(n))
        a = np.insert(a, int(rng.integers(n + 1)), a[i], axis=0)
    elif op == "swap":
        i, j = rng.integers(n, size=2)
        a = a.copy()
        a[[i, j]] = a[[j, i]]
    else:
        a = a[::-1]
    _put(body, path, _rec(a))
    return f"rows {op} {path}"


def m_record(body, rng):
    """A malformed array record: dtype, shape or data wrong, a key missing, not a map."""
    path = _pick(rng, _sites(body)[0])
    rec = dict(_at(body, path))
    op = _pick(rng, ["dtype", "shape", "data-short", "data-long", "key", "type", "shape-huge"])
    if op == "dtype":
        rec["dtype"] = _pick(rng, ["<i2", "<f8", ">i8", "<u8", 5, None, "object"])
    elif op == "shape":
        rec["shape"] = _pick(rng, [[], [-1], [0], list(reversed(rec["shape"])), rec["shape"] + [1], [1.5], "3"])
    elif op == "shape-huge":
        rec["shape"] = [2**40] + rec["shape"][1:]
    elif op == "data-short":
        rec["data"] = rec["data"][:-1]
    elif op == "data-long":
        rec["data"] = rec["data"] + b"\0" * 8
    elif op == "key":
        rec.pop(_pick(rng, ["dtype", "shape", "data"]))
    else:
        rec = _pick(rng, [None, [], "array", 7, list(rec.values())])
    _put(body, path, rec)
    return f"record {op} {path}"


def m_scalar(body, rng):
    """A scalar (devices, heads, stages, dtype, mask, meta, segment entries...) gets a wrong value or type."""
    path = _pick(rng, _sites(body)[1])
    v = _at(body, path)
    choices = [0, -1, 1, 2**31, 2**63, 2**64 - 1, -2**63, 1.5, float("nan"), float("inf"), "", "x" * 300, None, True,
               [], {}, b"\0", "float64", "../../etc/passwd"]
    if isinstance(v, int) and not isinstance(v, bool):
        choices += [v + 1, v - 1, v * 2, v * 1000]
    new = _pick(rng, choices)
    _put(body, path, new)
    return f"scalar {path}: {v!r} -> {new!r}"


def m_struct(body, rng):
    """Maps and lists: a key removed or added, an element dropped or duplicated, a subtree replaced."""
    path = _pick(rng, _sites(body)[2])
    x = _at(body, path)
    op = _pick(rng, ["drop", "dup", "add", "replace"])
    if op == "replace" and path:
        _put(body, path, _pick(rng, [None, [], {}, 0, "x"]))
    elif isinstance(x, dict) and x:
        key = _pick(rng, sorted(x, key=str))
        if op == "drop":
            x.pop(key)
        else:
            x["extra" if op == "add" else key] = copy.deepcopy(x[key]) if op == "dup" else 1
    elif isinstance(x, list) and x:
        i = int(rng.integers(len(x)))
        if op == "drop":
            x.pop(i)
        else:
            x.insert(i, copy.deepcopy(x[i]))
    return f"struct {op} {path}"


def _code_sites(body):
    return [(ph, d) for ph in range(2) for d in range(len(body["program"]["code"][ph]))
            if _is_record(body["program"]["code"][ph][d]) and _get(body["program"]["code"][ph][d]).size]


def m_program(body, rng):
    """Instruction-level edits: opcode changed (attn <-> attn_bwd, ...), instructions swapped, dropped,
    duplicated, moved to another device, an operand pointed at another buffer, tag or compute block."""
    ph, d = _pick(rng, _code_sites(body))
    codes = body["program"]["code"][ph]
    c = _get(codes[d]).copy()
    n = len(c)
    i = int(rng.integers(n))
    op = _pick(rng, ["opcode", "swap", "drop", "dup", "move", "operand", "operand", "adjacent"])
    if op == "opcode":  # half the time its sibling in the other phase (attn <-> attn_bwd, merge <-> add)
        sibling = {ATTN: ATTN_BWD, ATTN_BWD: ATTN, MERGE: ADD, ADD: MERGE}.get(int(c[i, 0]))
        c[i, 0] = sibling if sibling is not None and rng.integers(2) else int(rng.integers(7))
    elif op in ("swap", "adjacent"):
        j = min(n - 1, i + 1) if op == "adjacent" else int(rng.integers(n))
        c[[i, j]] = c[[j, i]]
    elif op == "drop":
        c = np.delete(c, i, axis=0)
    elif op == "dup":
        c = np.insert(c, i, c[i], axis=0)
    elif op == "move":
        other = int(rng.integers(len(codes)))
        moved = np.concatenate([_get(codes[other]), c[i:i + 1]])
        c = np.delete(c, i, axis=0)
        codes[other] = _rec(moved)
        if other == d:
            c = moved
    else:
        col = int(rng.integers(1, 6))
        c[i, col] = max(0, int(c[i, col]) + int(_pick(rng, [-1, 1, 2])))
    codes[d] = _rec(c)
    return f"program {op} phase {ph} device {d} instruction {i}"


def m_table(body, rng):
    """Buffer rows, transfers and messages: a field nudged to another plausible value (kind, block, role, peer,
    bytes, buffer, message range)."""
    which = _pick(rng, ["buffers", "transfers", "messages", "xfer", "home", "cb_device", "cb_stage"])
    if which == "buffers":
        ph = int(rng.integers(2))
        d = int(rng.integers(len(body["program"]["buffers"][ph])))
        path = ("program", "buffers", ph, d)
    else:
        path = {"transfers": ("program", "transfers"), "messages": ("program", "messages"),
                "xfer": ("schedule", "xfer"),
                "home": ("placement", "home"), "cb_device": ("placement", "cb_device"),
                "cb_stage": ("schedule", "cb_stage")}[which]
    a = _get(_at(body, path)).copy()
    if not a.size:
        return m_program(body, rng)
    flat = a.reshape(-1)
    i = int(rng.integers(flat.size))
    flat[i] = max(-1, int(flat[i]) + int(_pick(rng, [-1, 1, 2, -2])))
    _put(body, path, _rec(a))
    return f"table {path}[{i}]"


def m_samples(body, rng):
    """Sample lengths: a zero-length sample appended, lengths moved between samples (same total), one changed."""
    pb = body["problem"]
    lens = _get(pb["seqlens"]).copy()
    op = _pick(rng, ["zero", "shift", "grow", "split"])
    if op == "zero":
        lens = np.insert(lens, int(rng.integers(len(lens) + 1)), 0)
    elif op == "shift" and len(lens) > 1:
        lens[0] += 1
        lens[-1] -= 1
    elif op == "split":
        lens = np.concatenate([[1], lens[:1] - 1, lens[1:]])
    else:
        lens[int(rng.integers(len(lens)))] += int(_pick(rng, [1, -1, 2**40]))
    pb["seqlens"] = _rec(lens)
    return f"samples {op}"


MUTATIONS = [(m_program, 30), (m_element, 20), (m_table, 12), (m_rows, 10), (m_scalar, 10), (m_struct, 8),
             (m_record, 5), (m_samples, 5)]


def _mutate(base: dict, seed: int) -> tuple[dict, str]:
    rng = np.random.default_rng(seed)
    fns, weights = zip(*MUTATIONS)
    p = np.array(weights, float) / sum(weights)
    body = copy.deepcopy(base)
    steps = []
    for _ in range(1 + int(rng.integers(0, 2) == 0)):  # one edit, or two
        fn = fns[int(rng.choice(len(fns), p=p))]
        try:
            steps.append(fn(body, rng))
        except (KeyError, IndexError, TypeError, ValueError, AttributeError):  # an earlier edit broke what it edits
            steps.append(f"{fn.__name__} skipped")
    return body, "; ".join(steps)


# ------------------------------------------------------------------ the property

def _runs_like_dense(plan, seed: int) -> float:
    """Max relative error of out, dq, dk, dv against the float64 dense reference of the plan's own problem."""
    p = plan.problem
    gen = torch.Generator().manual_seed(seed)
    T = p.tokens
    q, k, v = (torch.randn(T, h, p.head_dim, generator=gen, dtype=torch.float64)
               for h in (p.heads, p.kv_heads, p.kv_heads))
    dout = torch.randn(T, p.heads, p.head_dim, generator=gen, dtype=torch.float64)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = attnplan.execute(plan, qg, kg, vg)
    grads = torch.autograd.grad(out, (qg, kg, vg), dout, allow_unused=True)
    ref_out, ref_grads = reference(p, q, k, v, dout, 1.0 / math.sqrt(p.head_dim))
    worst = 0.0
    for got, want in zip((out, *grads), (ref_out, *ref_grads)):
        got = torch.zeros_like(want) if got is None else got.detach()
        if got.shape != want.shape or not bool(torch.isfinite(got).all()):
            return math.inf
        worst = max(worst, float((got - want).abs().max()) / max(1.0, float(want.abs().max())) if want.numel() else 0.0)
    return worst


def _case(blob: bytes, seed: int) -> tuple[str, float, str]:
    """(outcome, load seconds, detail): outcome 'rejected', 'equal' or 'BAD'."""
    t0 = time.perf_counter()
    try:
        plan = attnplan.Plan.from_bytes(blob, "fuzz.plan")
    except PlanFileError as e:
        return "rejected", time.perf_counter() - t0, str(e).split("\n")[0]
    except Exception:  # noqa: BLE001  anything else is the finding
        return "BAD", time.perf_counter() - t0, "load raised " + traceback.format_exc(limit=-3)
    dt = time.perf_counter() - t0
    try:
        err = _runs_like_dense(plan, seed)
        plan.stats()
    except Exception:  # noqa: BLE001
        return "BAD", dt, "a loaded plan failed to run: " + traceback.format_exc(limit=-3)
    if err > TOL:
        return "BAD", dt, f"a loaded plan runs wrong: error {err:.3g}"
    return "equal", dt, ""


def _reason(message: str) -> str:
    """A rejection's layer: 'schema program', 'verifier invariant 5', ..."""
    text = message.removeprefix("fuzz.plan: ")
    if text.startswith("malformed plan file: "):
        field = text.removeprefix("malformed plan file: ").split(" ")[0].split("[")[0].rstrip(":")
        return "schema " + field.split(".")[0]
    if text.startswith("plan does not verify: invariant"):
        return "verifier " + " ".join(text.split(" ")[4:6]).rstrip(":")
    if text.startswith("plan does not verify"):
        return "verifier (other)"
    return " ".join(text.split(" ")[:4])


@pytest.fixture(scope="module")
def bases() -> dict:
    out = {}
    for name, kw in BASES.items():
        plan = attnplan.compile(**kw)
        assert _runs_like_dense(plan, 0) <= TOL, name  # the unaltered plans are right
        out[name] = _decode(plan.to_bytes())
    return out


def test_crafted_plan_files(bases):
    counts = {"rejected": 0, "equal": 0, "BAD": 0}
    reasons: dict[str, int] = {}
    bad, slowest = [], (0.0, "")
    for b, (name, body) in enumerate(sorted(bases.items())):
        for i in range(CASES_PER_BASE):
            seed = 1000 * b + i
            mutated, what = _mutate(body, seed)
            outcome, dt, detail = _case(_encode(mutated), seed)
            counts[outcome] += 1
            if outcome == "rejected":
                reasons[_reason(detail)] = reasons.get(_reason(detail), 0) + 1
            if outcome == "BAD" or dt > LOAD_SECONDS:
                bad.append(f"{name} seed {seed} ({what}): {detail or f'load took {dt:.2f} s'}")
            slowest = max(slowest, (dt, f"{name} seed {seed} ({what})"))
    total = sum(counts.values())
    print(f"\ncrafted plan files: {total} cases: {counts['rejected']} rejected with PlanFileError, "
          f"{counts['equal']} loaded and ran equal to dense attention, {counts['BAD']} bad; "
          f"slowest load {slowest[0] * 1e3:.1f} ms ({slowest[1]})")
    print("  rejections: " + ", ".join(f"{k}: {v}" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1])))
    assert not bad, f"{len(bad)} of {total} crafted files:\n" + "\n".join(bad[:20])
    assert counts["rejected"] > total // 2 and counts["equal"] > 0  # the fuzzer reaches both outcomes
