"""Random program mutations (deterministic seeds): every mutated program is
either rejected by the verifier (or the plan-file loader), or executing it
still gives dense attention, forward and gradients. And the program text
parser turns any malformed text into a PlanFileError."""

import math

import numpy as np
import pytest
import torch

import attnplan
from attnplan.errors import AttnplanError, PlanFileError, VerifyError
from attnplan.ir.program import BBYTES, N_OPERANDS, OP, T_RBUF, T_SBUF, Program, parse_program
from attnplan.ir.verify import verify
from attnplan.runtime.check import reference
from attnplan.runtime.executor import execute

# (strategy pipeline, mask, seqlens, devices): ring and p2p traffic, partials going home, GQA
CONFIGS = [
    ("tile{block=8},zigzag,comm{mode=ring},overlap,emit", "causal", [21, 9, 14], 3),
    ("tile{block=8},per_doc,comm{mode=p2p},emit", "sliding_window(6)", [30, 12], 2),
    ("tile{block=6},minheap,comm{mode=p2p},overlap,emit", "prefix_lm(4)", [17, 23, 5], 4),
    ("tile{block=8},tile_pool,comm{mode=p2p},divide{stages=2},overlap,emit", "full", [26, 10], 2),
    # two nodes: partials summed inside their node before they cross (merges and adds into partials)
    ("tile{block=4},per_doc,comm{mode=p2p,relay=node,reduce=node},overlap,emit", "causal", [33, 17], 4, 2),
]
MUTATIONS_PER_PLAN = 100


def _inputs(p, seed: int):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((p.tokens, p.heads, p.head_dim), (p.tokens, p.kv_heads, p.head_dim),
              (p.tokens, p.kv_heads, p.head_dim), (p.tokens, p.heads, p.head_dim))
    return [torch.randn(*s, generator=gen, dtype=torch.float64) for s in shapes]


@pytest.fixture(scope="module")
def cases():
    out = []
    for i, (pipeline, mask, lens, devices, *nodes) in enumerate(CONFIGS):
        plan = attnplan.compile(seqlens=lens, mask=mask, devices=devices, nodes=(nodes or [1])[0], heads=4,
                                kv_heads=2, head_dim=4, pipeline=pipeline)
        q, k, v, dout = _inputs(plan.problem, i)
        ref = reference(plan.problem, q, k, v, dout, 1.0 / math.sqrt(plan.problem.head_dim))
        out.append((plan, (q, k, v, dout), ref))
    return out


# ------------------------------------------------------------------ mutations

def _streams(prog: Program):
    return [[c.tolist() for c in ph] for ph in prog.code], [[b.tolist() for b in ph] for ph in prog.buffers]


def _rebuild(prog: Program, code, bufs, transfers=None) -> Program:
    return Program(prog.devices, prog.transfers if transfers is None else transfers,
                   tuple(tuple(np.asarray(b, np.int64).reshape(-1, 6) for b in ph) for ph in bufs),
                   tuple(tuple(np.asarray(c, np.int64).reshape(-1, 6) for c in ph) for ph in code), prog.messages)


def mutate(prog: Program, rng: np.random.Generator) -> tuple[str, Program]:
    """One random mutation: drop, swap adjacent, duplicate an instruction;
    change an operand; drop a buffer row; change an opcode; change the
    buffer a transfer is packed from or unpacked into, or swap two transfers
    (the layout of a message)."""
    code, bufs = _streams(prog)
    phase = int(rng.integers(2))
    d = int(rng.choice([d for d in range(prog.devices) if code[phase][d]]))
    c = code[phase][d]
    i = int(rng.integers(len(c)))
    what = ("drop", "swap", "duplicate", "operand", "operand", "buffer", "opcode", "binding")[int(rng.integers(8))]
    if what == "binding":
        X = prog.transfers.copy()
        t = int(rng.integers(len(X)))
        if rng.random() < 0.25:  # swap two transfers' rows (kept in their tags' places)
            u = int(rng.integers(len(X)))
            X[[t, u], 1:] = X[[u, t], 1:]
        else:
            col = (T_SBUF, T_RBUF)[int(rng.integers(2))]
            X[t, col] = int(X[t, col] + rng.choice([-1, 1])) if rng.random() < 0.6 else int(rng.integers(-1, 40))
        return what, _rebuild(prog, code, bufs, X)
    if what == "drop":
        del c[i]
    elif what == "swap" and len(c) > 1:
        i = min(i, len(c) - 2)
        c[i], c[i + 1] = c[i + 1], c[i]
    elif what == "duplicate":
        c.insert(int(rng.integers(len(c) + 1)), list(c[i]))
    elif what == "opcode":
        c[i][OP] = int(rng.integers(len(N_OPERANDS)))
    elif what == "buffer" and bufs[phase][d]:
        del bufs[phase][d][int(rng.integers(len(bufs[phase][d])))]
    else:
        what = "operand"
        j = 1 + int(rng.integers(N_OPERANDS[c[i][OP]]))
        c[i][j] = int(c[i][j] + rng.choice([-1, 1])) if rng.random() < 0.6 else int(rng.integers(-1, 40))
    return what, _rebuild(prog, code, bufs)


def _max_rel_err(got, want) -> float:
    return float((got.detach().double() - want).abs().max()) / max(1.0, float(want.abs().max()))


def _runs_correctly(ir, inputs, ref) -> bool:
    q, k, v, dout = (t.clone() for t in inputs)
    qg, kg, vg = (t.requires_grad_(True) for t in (q, k, v))
    out = execute(ir, qg, kg, vg)
    grads = torch.autograd.grad(out, (qg, kg, vg), dout)
    want_out, want_grads = ref
    return all(_max_rel_err(g, w) < 1e-9 for g, w in zip((out, *grads), (want_out, *want_grads)))


def test_mutated_programs_are_rejected_or_still_exact(cases):
    rng = np.random.default_rng(20240611)
    rejected, accepted, by_kind = 0, 0, {}
    for case, (plan, inputs, ref) in enumerate(cases):
        for n in range(MUTATIONS_PER_PLAN):
            what, prog = mutate(plan.ir.program, rng)
            ir = plan.ir.replace(program=prog)
            try:
                verify(ir)
            except VerifyError:
                rejected += 1
                by_kind[what] = by_kind.get(what, 0) + 1
                if n % 10 == 0:  # the loader (valid checksum, altered program) rejects it too
                    with pytest.raises(PlanFileError):
                        attnplan.Plan.from_bytes(attnplan.Plan(ir, plan.meta).to_bytes())
                continue
            accepted += 1
            assert _runs_correctly(ir, inputs, ref), f"config {case}: a verified {what} mutation is wrong"
    print(f"\nmutations: {rejected} rejected by the verifier ({by_kind}), {accepted} verified and exact")
    assert rejected + accepted == len(cases) * MUTATIONS_PER_PLAN
    assert rejected > accepted > 0  # both outcomes happen: the harness exercises both sides


def test_buffer_sizes_are_part_of_the_contract(cases):
    plan = cases[0][0]
    code, bufs = _streams(plan.ir.program)
    bufs[0][0][0][BBYTES] += 1
    with pytest.raises(VerifyError, match=r"invariant 5: device 0 fwd: buffer %0 has \d+ bytes"):
        verify(plan.ir.replace(program=_rebuild(plan.ir.program, code, bufs)))


# ------------------------------------------------------------------ program text fuzz

def _mutate_text(lines: list, rng: np.random.Generator) -> str:
    lines = list(lines)
    i = int(rng.integers(len(lines)))
    r = int(rng.integers(6))
    words = lines[i].split()
    if r == 0 and words:  # a huge, negative or odd number in place of a number
        j = int(rng.integers(len(words)))
        big = str(int(rng.integers(1, 10))) + "9" * int(rng.integers(15, 60))
        words[j] = "".join(ch for ch in words[j] if not ch.isdigit()) + rng.choice([big, "-" + big, "1e9", "", "x"])
        lines[i] = "  ".join(words)
    elif r == 1:
        del lines[i]
    elif r == 2:
        lines.insert(int(rng.integers(len(lines) + 1)), lines[i])
    elif r == 3 and words:
        del words[int(rng.integers(len(words)))]
        lines[i] = " ".join(words)
    elif r == 4:
        s = lines[i]
        p = int(rng.integers(len(s) + 1))
        lines[i] = s[:p] + chr(int(rng.choice([0x2D, 0x3E, 0x25, 0x23, 0x30, 0x39, 0xB2, 0x3000]))) + s[p:]
    else:
        lines[i] = lines[i].replace("devices=", "devices=" + str(int(rng.integers(0, 10 ** 6))), 1)
    return "\n".join(lines)


def test_program_text_fuzz():
    """Mutated program texts: a Program or a PlanFileError naming the line, never another exception."""
    rng = np.random.default_rng(11)
    texts = [attnplan.compile(seqlens=[10, 6], devices=2, heads=2, kv_heads=1, head_dim=4,
                              pipeline=f"tile{{block=4}},zigzag,comm{{mode={mode}}},overlap,emit")
             .ir.program.to_text().splitlines() for mode in ("p2p", "ring")]
    parsed = failed = 0
    for n in range(4000):
        text = _mutate_text(texts[n % len(texts)], rng)
        try:
            prog = parse_program(text)
        except PlanFileError as e:
            failed += 1
            assert "program text" in str(e)
            continue
        except AttnplanError as e:  # pragma: no cover - the assertion below explains
            raise AssertionError(f"{type(e).__name__} instead of PlanFileError: {e}") from None
        parsed += 1
        assert isinstance(prog, Program)
    print(f"\nprogram text fuzz: {failed} rejected, {parsed} parsed")
    assert failed > 1000 and parsed > 100
