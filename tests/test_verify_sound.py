"""The verifier between passes is sound: a pass written outside the project
that breaks the IR is caught right after it runs, in every pipeline
position, whatever ran before; the verifier also checks everything the
runtime relies on (opcodes per phase, operand kinds), costs time that
follows the size of the IR, and empty masks give a valid all-zero plan."""

import dataclasses
import math
import time

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import attnplan
from attnplan.errors import DeadlockError, PlanError, PlanFileError, VerifyError
from attnplan.ir import limits
from attnplan.ir import verify as verify_mod
from attnplan.ir.interp import check_deadlock_free, cooperate
from attnplan.ir.mask import Pieces, intersect_rows, _pairwise, first_overlap, normalize, tight, tighten
from attnplan.ir.module import PlanIR
from attnplan.ir.placement import Placement
from attnplan.ir.problem import Problem
from attnplan.ir.program import (A1, ATTN, ATTN_BWD, BWD, FWD, ISA, OP, OPS, SEND, WAIT, Program, format_instr,
                                 parse_program)
from attnplan.ir.verify import VerifyCache, verify
from attnplan.passes import REGISTRY, Pass, parse_pipeline, register, run_pipeline

try:
    from attnplan.passes import unregister
except ImportError:  # pragma: no cover - older registry without unregister
    def unregister(name):
        return REGISTRY.pop(name)

SHAPE = dict(heads=4, kv_heads=4, head_dim=4)
LENS = [37, 11, 64, 5]
STRATEGIES = ["zigzag", "per_doc", "minheap", "tile_pool", "dacp", "ulysses"]


# ------------------------------------------------------------------ passes a user might write (all wrong)

def _drop_cb0(prog: Program) -> Program:
    """The program without compute block 0, later blocks renumbered."""
    code = []
    for ph in prog.code:
        out = []
        for c in ph:
            c = c.copy()
            comp = np.isin(c[:, OP], (ATTN, ATTN_BWD))
            c = c[~(comp & (c[:, A1] == 0))]
            comp = np.isin(c[:, OP], (ATTN, ATTN_BWD))
            c[comp, A1] -= 1
            out.append(c)
        code.append(tuple(out))
    return Program(prog.devices, prog.transfers, prog.buffers, tuple(code), prog.messages)


@dataclasses.dataclass(frozen=True, slots=True)
class DropBlock(Pass):
    """Drops compute block 0 and keeps every level consistent with that."""

    name = "test_drop_block"
    needs = ("graph",)

    def apply(self, ir):
        g = ir.graph
        levels = {"graph": dataclasses.replace(g, cb_tile=g.cb_tile[1:].copy(), cb_hg=g.cb_hg[1:].copy())}
        if ir.placement is not None:
            pl = ir.placement
            levels["placement"] = Placement(pl.devices, pl.nodes, pl.home.copy(), pl.cb_device[1:].copy())
        if ir.schedule is not None:
            levels["schedule"] = dataclasses.replace(ir.schedule, cb_stage=ir.schedule.cb_stage[1:].copy())
        if ir.program is not None:
            levels["program"] = _drop_cb0(ir.program)
        return ir.replace(**levels)


@dataclasses.dataclass(frozen=True, slots=True)
class DropTransfer(Pass):
    """Drops one transfer: the first send of the program, else the first scheduled transfer."""

    name = "test_drop_transfer"
    needs = ("schedule",)

    def apply(self, ir):
        if ir.program is not None:
            p = ir.program
            code = [list(ph) for ph in p.code]
            d = next(d for d in range(p.devices) if (code[FWD][d][:, OP] == SEND).any())
            c = code[FWD][d]
            i = int(np.flatnonzero(c[:, OP] == SEND)[0])
            code[FWD][d] = np.delete(c, i, axis=0)
            return ir.replace(program=Program(p.devices, p.transfers, p.buffers, tuple(map(tuple, code)), p.messages))
        s = ir.schedule
        return ir.replace(schedule=dataclasses.replace(s, xfer=s.xfer[1:].copy()))


@dataclasses.dataclass(frozen=True, slots=True)
class MoveBlocks(Pass):
    """Moves every compute block to the next device and keeps the schedule and program as they were."""

    name = "test_move_blocks"
    needs = ("placement",)

    def apply(self, ir):
        pl = ir.placement
        moved = Placement(pl.devices, pl.nodes, pl.home.copy(), (pl.cb_device + 1) % pl.devices)
        return ir.replace(placement=moved)


@pytest.fixture
def bad_passes():
    """The bad passes, registered for one test and removed after it."""
    for cls in (DropBlock, DropTransfer, MoveBlocks):
        register(cls)
    yield
    for cls in (DropBlock, DropTransfer, MoveBlocks):
        unregister(cls.name)


def pipeline_with(strategy: str, bad: str, pos: int) -> str:
    items = ["tile{block=8}", strategy, "comm{mode=p2p}", "overlap", "emit"]
    return ",".join(items[:pos] + [bad] + items[pos:])


# (bad pass, first position it applies to): drop a block anywhere after tile; break transfers or the
# placement under an existing schedule anywhere after comm
CASES = [(DropBlock.name, p) for p in range(1, 6)] + [(DropTransfer.name, p) for p in range(3, 6)] \
    + [(MoveBlocks.name, p) for p in range(3, 6)]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bad_pass_caught_in_every_position_by_compile(bad_passes, strategy):
    caught = 0
    for bad, pos in CASES:
        spec = pipeline_with(strategy, bad, pos)
        with pytest.raises(VerifyError, match=rf"after pass {bad}: invariant \d") as e:
            attnplan.compile(seqlens=LENS, devices=4, pipeline=spec, **SHAPE)
        assert "invariant" in str(e.value)
        caught += 1
    assert caught == len(CASES)


@pytest.mark.parametrize("strategy", ["zigzag", "minheap"])
def test_bad_pass_caught_in_every_position_by_run_pipeline(bad_passes, strategy):
    from attnplan.frontend import load_mask, lower_batch
    lens = np.array(LENS, np.int64)
    problem = Problem(seqlens=lens, pieces=lower_batch(load_mask("causal"), LENS, None), **SHAPE)
    for bad, pos in CASES:
        passes = parse_pipeline(pipeline_with(strategy, bad, pos))
        with pytest.raises(VerifyError, match=rf"after pass {bad}"):
            run_pipeline(PlanIR(problem, 4), passes)
        # without verification the broken IR goes through: it is the verifier that catches it
        run_pipeline(PlanIR(problem, 4), passes[:pos + 1], verify_each=False)


def test_registered_passes_do_not_leak_into_other_tests():
    names = {DropBlock.name, DropTransfer.name, MoveBlocks.name}
    assert not names & set(REGISTRY)
    with pytest.raises(PlanError, match="unknown pass"):
        parse_pipeline(pipeline_with("zigzag", DropBlock.name, 1))


def test_same_content_other_object_is_checked_again(monkeypatch):
    """The cache skips a level only for the very same object (held, so its id cannot be reused)."""
    plan = attnplan.compile(seqlens=[40, 24], devices=2, block_size=8, **SHAPE)
    calls = []
    real = verify_mod.verify_graph
    monkeypatch.setattr(verify_mod, "verify_graph", lambda g: (calls.append(g), real(g)))
    cache = VerifyCache()
    verify(plan.ir, cache)
    verify(plan.ir, cache)
    assert len(calls) == 1
    g2 = dataclasses.replace(plan.ir.graph)  # equal content, another object
    verify(plan.ir.replace(graph=g2, placement=None, schedule=None, program=None), cache)
    assert len(calls) == 2 and calls[-1] is g2
    with pytest.raises(TypeError):
        verify(plan.ir, done=set())


def test_failed_level_is_not_remembered():
    plan = attnplan.compile(seqlens=[40, 24], devices=2, block_size=8, **SHAPE)
    ir = plan.ir
    cache = VerifyCache()
    bad = ir.replace(memory_cap=16)
    for _ in range(2):  # a level that failed is checked again, and fails again
        with pytest.raises(VerifyError, match="invariant 6"):
            verify(bad, cache)


# ------------------------------------------------------------------ what the runtime relies on

@pytest.fixture(scope="module")
def plan():
    return attnplan.compile(seqlens=[37, 11, 64, 5], mask="causal", devices=4, heads=4, kv_heads=2, head_dim=8,
                            pipeline="tile{block=8},zigzag,comm{mode=ring},overlap,emit")


def with_code(ir, phase, device, rows):
    code = [list(ph) for ph in ir.program.code]
    code[phase][device] = np.asarray(rows, np.int64).reshape(-1, 6)
    return ir.replace(program=Program(ir.program.devices, ir.program.transfers, ir.program.buffers,
                                      tuple(map(tuple, code)), ir.program.messages))


def first_row(ir, phase, op):
    for d in range(ir.devices):
        rows = ir.program.code[phase][d].tolist()
        for i, r in enumerate(rows):
            if r[OP] == op:
                return d, i, rows
    raise AssertionError("no such instruction")


def test_attn_rewritten_as_attn_bwd_is_rejected(plan):
    d, i, rows = first_row(plan.ir, FWD, ATTN)
    rows[i][OP] = ATTN_BWD
    bad = with_code(plan.ir, FWD, d, rows)
    with pytest.raises(VerifyError, match=rf"device {d} fwd instruction {i}: attn_bwd is not valid in fwd"):
        verify(bad)
    data = attnplan.Plan(bad, plan.meta).to_bytes()  # valid checksum, altered program
    with pytest.raises(PlanFileError):
        attnplan.Plan.from_bytes(data)


@pytest.mark.parametrize("phase,op", [(FWD, ATTN), (BWD, ATTN_BWD)])
def test_every_buffer_operand_kind_is_checked(plan, phase, op):
    """Pointing any buffer operand of a compute instruction at a buffer of another kind is named."""
    d, i, rows = first_row(plan.ir, phase, op)
    bufs = plan.ir.program.buffers[phase][d]
    s = ISA[op]
    for name in s.operands[1:]:
        col = s.col(name)
        other = next(b for b in range(len(bufs)) if bufs[b, 0] not in s.kinds[s.operands.index(name)])
        bad = [list(r) for r in rows]
        bad[i][col] = other
        with pytest.raises(VerifyError, match=rf"instruction {i}: {s.name} operand {name} is %{other}"):
            verify(with_code(plan.ir, phase, d, bad))


def test_text_form_is_derived_from_the_table(plan):
    for s in ISA:
        row = [s.code] + list(range(1, len(s.operands) + 1)) + [0] * (5 - len(s.operands))
        text = format_instr(row)
        assert text.split()[0] == OPS[s.code] and len(text.split()) == 1 + len(s.operands)
    assert Program.from_text(plan.ir.program.to_text()) == plan.ir.program


@pytest.mark.parametrize("opt", ["nan", "inf", "-inf", "NaN", "1e999"])
def test_non_finite_pass_options_are_rejected(opt):
    with pytest.raises(PlanError, match="slack"):
        parse_pipeline(f"tile,zigzag,comm,divide{{stages=2,slack={opt}}},emit")
    with pytest.raises(PlanError, match="stages"):
        parse_pipeline(f"tile,zigzag,comm,divide{{stages={opt}}},emit")
    with pytest.raises(PlanError, match="block"):
        parse_pipeline(f"tile{{block={opt}}}")


def test_huge_int_option_is_one_clear_error():
    with pytest.raises(PlanError, match="block"):
        parse_pipeline("tile{block=" + "9" * 5000 + "}")
    with pytest.raises(PlanError, match="MAX_BLOCK_SIZE"):
        parse_pipeline(f"tile{{block={limits.MAX_BLOCK_SIZE + 1}}}")


def test_compute_block_limit_comes_from_limits():
    from attnplan.passes import base
    assert base.MAX_COMPUTE_BLOCKS == limits.MAX_COMPUTE_BLOCKS


# ------------------------------------------------------------------ deadlock proof = the walk

def test_static_deadlock_check_agrees_with_the_walk(plan):
    """Drops, swaps and duplicated waits of transfer instructions: the graph
    check and the cooperative walk agree, message included."""
    rng = np.random.default_rng(7)
    ir, agree, deadlocks = plan.ir, 0, 0
    for _ in range(300):
        phase = int(rng.integers(2))
        d = int(rng.integers(ir.devices))
        rows = ir.program.code[phase][d].tolist()
        i = int(rng.integers(len(rows) - 1))
        kind = rng.integers(3)
        if kind == 0:
            rows = rows[:i] + rows[i + 1:]
        elif kind == 1:
            rows[i], rows[i + 1] = rows[i + 1], rows[i]
        else:
            w = [j for j, r in enumerate(rows) if r[OP] == WAIT]
            j = w[int(rng.integers(len(w)))]
            rows.insert(int(rng.integers(len(rows) + 1)), rows[j])
        prog = with_code(ir, phase, d, rows).program
        try:
            cooperate(prog, phase, lambda *a: None)
            walk = None
        except DeadlockError as e:
            walk = str(e)
        try:
            check_deadlock_free(prog, phase)
            static = None
        except DeadlockError as e:
            static = str(e)
        assert walk == static
        agree += 1
        deadlocks += walk is not None
    assert agree == 300 and 0 < deadlocks < 300


# ------------------------------------------------------------------ cost follows the work

@settings(max_examples=300)
@given(rows=st.lists(st.tuples(*[st.integers(-12, 12)] * 4, st.integers(-30, 30), st.integers(-30, 30)),
                     min_size=1, max_size=8), col=st.integers(0, 5), delta=st.integers(-3, 3))
@example(rows=[(0, 1, 0, 5, 0, 0)], col=3, delta=0)  # one row, k1 past the band: tighten moves only k1
def test_tight_is_normalize_leaving_the_pieces_alone(rows, col, delta):
    """The verifier's canonical check (comparisons only) equals comparing with normalize's copy,
    on random pieces and on canonical ones with one bound moved."""
    for a in (np.array(rows, np.int64), normalize(np.array(rows, np.int64))):
        if len(a):
            for b in (a, a.copy()):
                b[0, col] += delta if b is not a else 0
                assert tight(b) == (len(normalize(b)) == len(b) and np.array_equal(normalize(b), b))


def brute_overlap(a):
    i, j = _pairwise(a, a)
    keep = i < j
    hit = np.flatnonzero(tighten(intersect_rows(a[i[keep]], a[j[keep]])))
    return None if not len(hit) else (int(i[keep][hit[0]]), int(j[keep][hit[0]]))


def test_disjointness_check_equals_brute_force():
    rng = np.random.default_rng(3)
    found = [0, 0]
    for trial in range(300):
        L = int(rng.integers(3, 24))
        p = Pieces.empty()
        for _ in range(int(rng.integers(1, 12))):
            q0, k0 = int(rng.integers(0, L)), int(rng.integers(0, L))
            q1, k1 = int(rng.integers(q0 + 1, L + 1)), int(rng.integers(k0 + 1, L + 1))
            lo = int(rng.integers(-L, L))
            p = p.union(Pieces.of([(q0, q1, k0, k1, lo, int(rng.integers(lo, L + 1)))]))
        a = p.a
        if trial % 2:  # one more single pair: anywhere, or inside a piece (an overlap)
            q, k = int(rng.integers(0, L)), int(rng.integers(0, L))
            if trial % 4 == 3 and len(a):
                q0, q1, k0, _, lo, _ = a[int(rng.integers(len(a)))]
                q = int(rng.integers(q0, q1))
                k = max(int(k0), q + int(lo))
            a = np.concatenate([a, normalize(np.array([(q, q + 1, k, k + 1, k - q, k - q)]))])
            a = a[rng.permutation(len(a))]
        want = brute_overlap(a)
        got = first_overlap(a)
        assert (want is None) == (got is None)
        if got is not None:
            assert tighten(intersect_rows(a[[got[0]]], a[[got[1]]]))[0]
        found[want is None] += 1
    assert min(found) > 50


def test_disjointness_check_is_not_quadratic():
    # 200,000 one-pair pieces (chunked_causal(1)) and 4,001 diagonals of one square (every pair of
    # bounding boxes overlaps: the sweep path)
    n = 200_000
    cells = np.array([(i, i + 1, i, i + 1, 0, 0) for i in range(n)], np.int64)
    diag = normalize(np.array([(0, 2001, 0, 2001, j, j) for j in range(-2000, 2001)], np.int64))
    t = time.process_time()
    assert first_overlap(cells) is None and first_overlap(diag) is None
    assert first_overlap(np.concatenate([diag, diag[7:8]])) is not None
    assert time.process_time() - t < 10  # quadratic: 2e10 and 8e6 candidate pairs


def test_verify_problem_chunked_causal_60000():
    from attnplan.frontend import load_mask, lower_batch
    pieces = lower_batch(load_mask("chunked_causal(1)"), [60000], None)
    p = Problem(seqlens=np.array([60000]), heads=1, kv_heads=1, head_dim=8, pieces=pieces)
    t = time.process_time()
    verify_mod.verify_problem(p)
    assert time.process_time() - t < 5  # was 18 s (quadratic in pieces)


# ------------------------------------------------------------------ empty masks

@pytest.mark.parametrize("mask,lens", [("k < q", [1, 1, 1]), ("!full", [5, 3]), ("false", [7])])
def test_empty_mask_is_a_valid_all_zero_plan(mask, lens):
    from attnplan.runtime.executor import run_forward
    plan = attnplan.compile(seqlens=lens, mask=mask, devices=2, heads=2, kv_heads=1, head_dim=4, block_size=2)
    assert plan.ir.graph.n_tile == 0 and plan.ir.graph.n_cb == 0
    verify(plan.ir)
    loaded = attnplan.Plan.from_bytes(plan.to_bytes())
    assert loaded.ir.program == plan.ir.program
    T = sum(lens)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(T, 2, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(T, 1, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(T, 1, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    out = attnplan.execute(loaded, q, k, v)
    out.backward(torch.ones_like(out))
    assert torch.all(out == 0)
    assert all(torch.all(t.grad == 0) for t in (q, k, v))
    _, lse = run_forward(loaded.ir, q.detach(), k.detach(), v.detach(), 1 / math.sqrt(4))
    assert torch.all(lse == float("-inf"))


def test_empty_mask_without_verification_still_loads(tmp_path):
    plan = attnplan.compile(seqlens=[4, 4], mask="false", devices=2, heads=2, kv_heads=1, head_dim=4,
                            block_size=2, verify=False)
    path = tmp_path / "empty.plan"
    plan.save(path)
    assert attnplan.load(path).ir.graph.n_cb == 0


# ------------------------------------------------------------------ the program text

def test_program_text_rejects_oversized_numbers(plan):
    text = plan.ir.program.to_text()
    for old, new in (("t0 ", "t" + "9" * 30 + " "), ("devices=4", "devices=" + "9" * 20), ("%0", "%-" + "9" * 25)):
        with pytest.raises(PlanFileError, match="64-bit|outside|line"):
            parse_program(text.replace(old, new, 1))
    with pytest.raises(PlanFileError, match="MAX_DEVICES"):
        parse_program("program devices=100000\n")
    with pytest.raises(PlanFileError, match="device 7 does not exist"):
        parse_program("program devices=2\ndevice 7 fwd\n")


# ------------------------------------------------------------------ the problem

@pytest.mark.parametrize("lens,match", [([5, 0, 3], "sample 1: length"), ([1 << 62, 1 << 62], "sample 0: length"),
                                        ([limits.MAX_TOKENS, 1], "over the limit MAX_TOKENS"),
                                        ([], "non-empty")])
def test_problem_rejects_lengths_the_runtime_cannot_take(lens, match):
    with pytest.raises(attnplan.BatchError, match=match):
        Problem(seqlens=np.array(lens, np.int64), heads=1, kv_heads=1, head_dim=8, pieces=Pieces.empty())


def test_problem_rejects_sizes_over_the_limits():
    with pytest.raises(PlanError, match="MAX_HEAD_DIM"):
        Problem(seqlens=np.array([4]), heads=1, kv_heads=1, head_dim=limits.MAX_HEAD_DIM + 1, pieces=Pieces.empty())
    with pytest.raises(PlanError, match="MAX_HEADS"):
        Problem(seqlens=np.array([4]), heads=limits.MAX_HEADS * 2, kv_heads=1, head_dim=8, pieces=Pieces.empty())
