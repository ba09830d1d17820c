"""The frontend under hostile input (issue 8, defects 3 and 5): every mask text
or batch gives its result or one typed error, in work that follows the text.

Costs are asserted by counting work (expression nodes evaluated, lowerings
done), not by wall-clock time; the few cases whose old behaviour was a hang
run in a subprocess with a generous timeout."""

from __future__ import annotations

import ast
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from attnplan.errors import AttnplanError, BatchError, MaskError, PlanError
from attnplan.frontend import Batch, MaskProgram, load_batch, load_mask, lower_batch, parse_mask, parse_seqlens, render
from attnplan.frontend import setops
from attnplan.frontend.evaluate import Evaluator
from attnplan.ir.limits import (MAX_BATCH_FILE, MAX_MASK_INT, MAX_MASK_PIECES, MAX_MASK_TEXT, MAX_MASK_WIDTH,
                                MAX_SAMPLES, MAX_TOKENS)
from attnplan.ir.mask import Pieces

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def visits(monkeypatch):
    """Counts expression nodes evaluated (static checks and lowerings)."""
    count = [0]
    real = Evaluator._visit

    def counted(self, node, env):
        count[0] += 1
        return real(self, node, env)

    monkeypatch.setattr(Evaluator, "_visit", counted)
    return count


def run_bounded(code: str, timeout: float = 120) -> str:
    """Run ``code`` in a fresh interpreter; fail (not hang) if it passes ``timeout`` seconds."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=timeout, cwd=ROOT.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def dense(prog: MaskProgram, L: int) -> np.ndarray:
    return prog.lower(L).to_dense(L)


# ------------------------------------------------------- shared definitions

def doubling(n: int, params: str = "", args: str = "") -> str:
    return (f"let a0{params} = causal | k < 2\n"
            + "".join(f"let a{i}{params} = a{i - 1}{args} | a{i - 1}{args}\n" for i in range(1, n))
            + f"a{n - 1}{args.replace('x', '3')}\n")


@pytest.mark.parametrize("params,args", [("", ""), ("(x)", "(x)")])
def test_each_definition_is_evaluated_once(visits, params, args):
    # 40 definitions each using the one above twice: 2^39 evaluations if expanded
    prog = parse_mask(doubling(40, params, args))
    assert np.array_equal(dense(prog, 9), dense(parse_mask("causal | k < 2"), 9))
    assert visits[0] <= 4 * 3 * 40  # static check + one lowering, about 3 nodes a line


def test_ever_new_arguments_stop_at_the_work_limit(monkeypatch):
    # f(x) uses f'(2x) and f'(2x + 1): 2^29 distinct calls, which no memo can share
    monkeypatch.setattr(setops, "MAX_MASK_WORK", 10 ** 7)
    text = ("let f0(x) = k == x\n"
            + "".join(f"let f{i}(x) = f{i - 1}(2 * x) | f{i - 1}(2 * x + 1)\n" for i in range(1, 30))
            + "f29(1)\n")
    with pytest.raises(MaskError, match="MAX_MASK_WORK") as e:
        parse_mask(text)
    assert e.value.line >= 1 and e.value.col >= 1


def test_many_lets_cost_linear_work(visits):
    def cost(n):
        visits[0] = 0
        text = "let a0 = causal\n" + "".join(f"let a{i} = a{i - 1}\n" for i in range(1, n)) + f"a{n - 1} & full\n"
        assert parse_mask(text).lower(5).pair_count() == 15
        return visits[0]
    small, large = cost(250), cost(2000)
    assert large <= 8 * small * 1.1  # 8x the text, at most ~8x the work


@pytest.mark.slow
def test_twenty_thousand_lets_finish():
    # was 28 s and quadratic; a subprocess bounds it even if it regresses
    out = run_bounded("""
        from attnplan.frontend import parse_mask
        n = 20000
        text = "let a0 = causal\\n" + "".join(f"let a{i} = a{i-1}\\n" for i in range(1, n)) + f"a{n-1}\\n"
        print(parse_mask(text).lower(7).pair_count())
    """, timeout=120)
    assert out.split() == ["28"]


def test_mask_text_is_bounded(tmp_path):
    with pytest.raises(MaskError, match="MAX_MASK_TEXT"):
        parse_mask("causal" + " " * MAX_MASK_TEXT)
    f = tmp_path / "big.mask"
    f.write_text("causal" + " " * MAX_MASK_TEXT)
    with pytest.raises(MaskError, match="MAX_MASK_TEXT"):
        load_mask(str(f))
    with pytest.raises(MaskError, match="string"):
        parse_mask(b"causal")


# ------------------------------------------------------------------ numbers

def test_number_literals_are_bounded_with_a_position():
    e = pytest.raises(MaskError, parse_mask, "(causal\n& k < " + "9" * 5000 + ")").value
    assert (e.line, e.col) == (2, 7) and "out of range" in e.message
    e = pytest.raises(MaskError, parse_mask, f"k < {MAX_MASK_INT + 1}").value
    assert (e.line, e.col) == (1, 5)
    e = pytest.raises(MaskError, parse_mask, "shared_question(2, 0." + "1" * 30 + ")").value
    assert (e.line, e.col) == (1, 20) and "decimal places" in e.message
    L = 6
    q, k = np.arange(L)[:, None], np.arange(L)[None, :]
    assert np.array_equal(dense(parse_mask(f"k > -{MAX_MASK_INT} & k - q < {MAX_MASK_INT} & k <= q"), L),
                          np.broadcast_to(k <= q, (L, L)))
    assert np.array_equal(dense(parse_mask("k < 0002.5000000000000000000000"), L), np.broadcast_to(k < 3, (L, L)))


def test_arithmetic_results_are_bounded():
    e = pytest.raises(MaskError, parse_mask, f"let big = 3\nlet a = {MAX_MASK_INT} * big\nk < a").value
    assert e.line == 2 and e.col == len(f"let a = {MAX_MASK_INT} ") + 1 and "out of range" in e.message
    # repeated squaring stops at the first result past the range instead of growing without bound
    text = "let a0 = 3\n" + "".join(f"let a{i} = a{i - 1} * a{i - 1}\n" for i in range(1, 60)) + "k < a59"
    e = pytest.raises(MaskError, parse_mask, text).value
    assert e.line == 7  # 3^(2^6) is the first square past 2^62
    with pytest.raises(MaskError, match="out of range"):  # L is known only when lowering
        parse_mask(f"k < L * {MAX_MASK_INT}").lower(4)


# ------------------------------------------------------ long and deep text

def test_long_unions_and_intersections():
    L = 490
    prog = parse_mask(" | ".join(f"k == {i}" for i in range(L)))  # was a lark VisitError, exit 1
    assert prog.lower(L).pair_count() == L * L
    prog = parse_mask(" & ".join(f"k != {i}" for i in range(0, 2000, 2)))
    m = dense(prog, 20)
    assert m[:, 1::2].all() and not m[:, 0::2].any()
    prog = parse_mask(" + ".join(["1"] * 3000) + " > k")  # one flat sum, not a 3000-deep tree
    assert prog.lower(4000).pair_count() == 4000 * 3000


def test_deep_nesting_works_without_recursion():
    L = 5
    causal = dense(parse_mask("causal"), L)
    assert np.array_equal(dense(parse_mask("(" * 10_000 + "causal" + ")" * 10_000), L), causal)
    assert np.array_equal(dense(parse_mask("let f(x) = x\n" + "f(" * 5_000 + "causal" + ")" * 5_000), L), causal)
    assert np.array_equal(dense(parse_mask("k < " + "-" * 10_000 + "3"), L), np.broadcast_to(np.arange(L) < 3, (L, L)))
    parse_mask("!" * 10_001 + "causal")  # checks without recursion; lowering costs one complement a level
    assert np.array_equal(dense(parse_mask("!" * 51 + "causal"), L), ~causal)
    chain = "let f0(x) = k < x\n" + "".join(f"let f{i}(x) = f{i - 1}(x)\n" for i in range(1, 1500)) + "f1499(2)"
    assert parse_mask(chain).lower(L).pair_count() == 2 * L
    nested = "(" * 1000 + "causal" + "".join(f" | k == {i})" for i in range(1000))
    assert parse_mask(nested).lower(L).pair_count() == L * L


def test_piece_operations_are_bounded(monkeypatch):
    # a complement of 60,000 pieces would take minutes in Pieces.subtract: refused before it starts
    e = pytest.raises(MaskError, parse_mask("!chunked_causal(1)").lower, 60_000).value
    assert "MAX_MASK_WORK" in e.message and (e.line, e.col) == (1, 1)
    # a builtin's pieces are counted before they are built
    e = pytest.raises(MaskError, parse_mask("causal & chunked_causal(1)").lower, 2 * MAX_MASK_PIECES).value
    assert "MAX_MASK_PIECES" in e.message and (e.line, e.col) == (1, 10)
    # an intersection whose result passes the limit stops in its first chunks
    monkeypatch.setattr(setops, "MAX_MASK_PIECES", 10_000)
    segs = tuple(("image" if i % 2 else "text", 2) for i in range(256))
    e = pytest.raises(MaskError, parse_mask("block_causal(1) & k in image").lower, 512, segs).value
    assert "pieces" in e.message and e.col == 17


def test_complements_of_whole_bands_take_their_gaps():
    """``!`` of diagonal bands that span the square (a periodic diagonal, a window) is the bands between
    them, one piece each, exact — not the square cut by every band (a quarter of n^2 pieces)."""
    L = 300
    for text, want in (("!((k - q) % 7 == 0)", "(k - q) % 7 != 0"), ("!sliding_window(16)", "!(k <= q & k > q - 16)"),
                       ("!!((k - q) % 5 == 0)", "(k - q) % 5 == 0"), ("!(causal & k > q - 3) | k == 1", None)):
        got = dense(parse_mask(text), L)
        if want is not None:
            assert np.array_equal(got, dense(parse_mask(want), L)), text
    q, k = np.arange(L)[:, None], np.arange(L)[None, :]
    assert np.array_equal(got, ~((k <= q) & (k > q - 3)) | (k == 1))
    diagonals = parse_mask("(k - q) % 7 == 0").lower(16_384)
    big = parse_mask("!((k - q) % 7 == 0)").lower(16_384)  # 4,681 diagonals, none at the corners: 4,682 gaps
    assert len(big) == len(diagonals) + 1 and big.pair_count() == 16_384 ** 2 - diagonals.pair_count()


def test_a_complement_that_splits_on_every_step_stops_at_the_work_limit(monkeypatch):
    """Clipped diagonals are not whole bands: the square is cut by each, and the pieces grow with every
    step. What the subtraction tests beyond its estimate is charged as it runs, so it stops at the limit."""
    monkeypatch.setattr(setops, "MAX_MASK_WORK", 10 ** 8)
    prog = parse_mask("!((k - q) % 7 == 0 & k >= 5)")
    n = len(parse_mask("(k - q) % 7 == 0 & k >= 5").lower(4096))
    assert setops._subtract_cost(1, n) < 10 ** 8  # the estimate alone lets it start
    e = pytest.raises(MaskError, prog.lower, 4096).value
    assert "MAX_MASK_WORK" in e.message and "a complement of" in e.message


# ------------------------------------------------------------------ batches

def test_lengths_are_checked_against_the_limits():
    for text in ("99999999999999999999999", "1000000000000", str(MAX_TOKENS + 1), f"{MAX_TOKENS},1",
                 "9" * 5000):
        with pytest.raises(BatchError, match="MAX_TOKENS"):
            parse_seqlens(text)
    assert parse_seqlens(f"{MAX_TOKENS}") == (MAX_TOKENS,)
    with pytest.raises(BatchError, match="MAX_SAMPLES"):
        parse_seqlens("1," * MAX_SAMPLES + "1")
    for bad in (float("nan"), float("inf"), 1.0, True, np.float64(2), MAX_TOKENS + 1, 2 ** 70, 0):
        with pytest.raises(BatchError):
            Batch((4, bad))
        with pytest.raises(BatchError):
            lower_batch(parse_mask("causal"), [4, bad])
    assert Batch((np.int64(3), 4)).seqlens == (3, 4)
    with pytest.raises(BatchError, match="MAX_TOKENS"):
        lower_batch(parse_mask("causal"), np.array([MAX_TOKENS, 1]))
    with pytest.raises(BatchError, match="MAX_SAMPLES"):
        Batch(range(MAX_SAMPLES + 1))


@pytest.mark.parametrize("content,why", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"seqlens": [' * 50_000 + "1" + "]}" * 50_000, "nested too deeply"),
    ('{"seqlens": [' + "9" * 5000 + "]}", "digits"),
    ('{"seqlens": [99999999999999999999999]}', "MAX_TOKENS"),
    ('{"seqlens": [NaN]}', "NaN is not a positive integer"),
    ('{"seqlens": [Infinity]}', "Infinity is not a positive integer"),
    ('{"seqlens": [1e400]}', "not a positive integer"),
    ('{"seqlens": [4.0]}', "not a positive integer"),
    ('{"seqlens": [true]}', "not a positive integer"),
    ('{"seqlens": [4], "segments": [[["text", NaN]]]}', "not a positive integer"),
])
@pytest.mark.parametrize("ext", [".json", ".jsonl"])
def test_hostile_batch_files(tmp_path, content, why, ext):
    f = tmp_path / f"b{ext}"
    f.write_text(content)
    with pytest.raises(BatchError, match=why) as e:
        load_batch(str(f))
    assert "\n" not in str(e.value)


def test_oversized_batch_file_is_refused_before_reading(tmp_path, monkeypatch):
    f = tmp_path / "huge.json"
    with open(f, "wb") as out:
        out.truncate(MAX_BATCH_FILE + 1)  # sparse: no disk used
    monkeypatch.setattr("attnplan.frontend.batch.open", lambda *a, **k: pytest.fail("read"), raising=False)
    with pytest.raises(BatchError, match="MAX_BATCH_FILE"):
        load_batch(str(f))


# ----------------------------------------------------------------- lowering

def test_identical_samples_share_one_lowering(monkeypatch):
    lowered = []
    real = MaskProgram._lower
    monkeypatch.setattr(MaskProgram, "_lower", lambda self, n, s, b, head=None, share=None: lowered.append(n) or real(self, n, s, b, head, share))
    n = 100_000
    pieces = lower_batch(parse_mask("causal"), [1] * n)  # was 92 s through `plan compile`
    assert lowered == [1]
    t = np.arange(n)
    assert np.array_equal(pieces.a[:, :4], np.stack([t, t + 1, t, t + 1], axis=1))


def test_batch_lowering_equals_per_sample_lowering():
    rng = np.random.default_rng(7)
    lens = rng.choice([1, 5, 9, 16], size=60).tolist()
    segments = [None if n < 5 or i % 3 else (("image", 2), ("text", n - 2)) for i, n in enumerate(lens)]
    for text in ("sliding_window(3) | k < 2", "same_segment & (q in image | k <= q)"):
        prog = parse_mask(text)
        offsets = np.cumsum([0] + lens[:-1])
        expected = Pieces.concat([prog.lower(n, s).shift(int(o)) for n, s, o in zip(lens, segments, offsets)])
        assert lower_batch(prog, lens, segments) == expected


def test_total_pieces_are_bounded_naming_the_sample():
    n = MAX_MASK_PIECES // 2
    e = pytest.raises(MaskError, lower_batch, parse_mask("chunked_causal(1)"), [5, n, n, 7]).value
    assert "MAX_MASK_PIECES" in e.message and "sample 2" in e.message


def test_errors_name_the_sample():
    # L * 2^62 is in range for L = 1 only: the first sample of another length is named
    e = pytest.raises(MaskError, lower_batch, parse_mask(f"k < L * {MAX_MASK_INT}"), [1, 1, 3, 3]).value
    assert "(sample 2)" in e.message and "[sample length 3]" in e.message and (e.line, e.col) == (1, 7)


def test_render_width_is_bounded():
    prog = parse_mask("causal")
    for width in (0, MAX_MASK_WIDTH + 1, 10 ** 9, 2.5, True):
        with pytest.raises(PlanError, match="width"):
            render(prog, [10], width=width)
    assert render(prog, [3], width=MAX_MASK_WIDTH).splitlines()[3] == "|#  |"


# ----------------------------------------------------------------- errors

def test_mask_error_fields_survive_pickling():
    e = pytest.raises(MaskError, parse_mask, "let w = 3\nmask = sliding_window(w) | ()\n", "bad.mask").value
    back = pickle.loads(pickle.dumps(e))
    assert (back.message, back.filename, back.line, back.col, back.text) == \
        (e.message, e.filename, e.line, e.col, e.text)
    assert str(back) == str(e) and isinstance(back, AttnplanError)


def test_mask_programs_pickle_as_their_text():
    prog = parse_mask("let f(x) = x\nf(causal) & k < " + "-" * 3000 + "3", "deep.mask")  # a tree 3,000 deep
    back = pickle.loads(pickle.dumps(prog))
    assert back == prog and back.uses_segments == prog.uses_segments
    assert back.lower(6) == prog.lower(6)


def test_frontend_functions_are_small():
    for path in sorted((ROOT / "frontend").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno < 60, f"{path.name}: {node.name}"


def test_public_names_are_unchanged():
    import attnplan.frontend as fe
    assert sorted(fe.__all__) == sorted(["Batch", "BUILTINS", "MaskProgram", "load_batch", "load_mask",
                                         "lower_batch", "parse_batch_text", "parse_mask", "parse_seqlens",
                                         "render"])
    assert all(getattr(fe, n) is not None for n in fe.__all__)


def test_a_long_union_of_diagonals_stays_small_and_exact():
    """10,000 terms ``k - q == d`` on a 300-token document: subtracting a diagonal from a piece it does not
    meet leaves the piece whole, so the union holds one piece per distinct diagonal (it used to fragment
    into tens of thousands and pass the work budget) and equals the brute-force evaluation."""
    import numpy as np

    from attnplan.frontend import lower_batch, parse_mask
    rng = np.random.default_rng(0)
    ds = rng.integers(-300, 300, 10_000).tolist()
    pieces = lower_batch(parse_mask(" | ".join(f"k - q == {d}" for d in ds)), [300])
    q, k = np.arange(300)[:, None], np.arange(300)[None, :]
    want = np.isin(k - q, ds)
    assert (pieces.to_dense(300) == want).all()
    assert len(pieces.a) == len(set(d for d in ds if -300 < d < 300))
