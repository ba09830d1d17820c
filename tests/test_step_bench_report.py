"""``plan step bench`` (tools/step_bench.py) and the step report (``plan step
compare --html``, step/report.py): the suite's files and table on one tiny
batch; bad flags are one line and exit 2; the report holds every system and
rank, escapes every name, fetches nothing, and each system's timeline spans
exactly its simulated step, every rank's segments back to back."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import pytest

from attnplan import cli
from attnplan.step import Mesh, StepPass, build_plan, make_problem, register_system, unregister_system
from attnplan.step.compare import compare_systems
from attnplan.step.report import rank_segments, render_step_html
from attnplan.tools.step_bench import mesh_for, run_suite

TINY_BATCH = {"name": "tiny<&>", "seqlens": [6000, 3000, 1500, 700, 400, 300, 90, 10]}


@pytest.fixture()
def batch_file(tmp_path):
    f = tmp_path / "b.jsonl"
    f.write_text(json.dumps(TINY_BATCH) + "\n" + json.dumps({"name": "other", "seqlens": [100, 200]}) + "\n")
    return f


def test_step_bench_writes_table_json_and_plots(batch_file, tmp_path, capsys):
    out = tmp_path / "o"
    assert cli.main(["step", "bench", "--batches", str(batch_file), "--names", "tiny<&>", "--systems", "fixed,wlb",
                     "--out", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    data = json.loads((out / "step_bench.json").read_text())
    rows = data["rows"]
    assert [r["system"] for r in rows] == ["fixed", "wlb"] and {r["batch"] for r in rows} == {"tiny<&>"}
    assert all("error" not in r and r["mesh"] == "dp=8,cp=4" for r in rows)        # under 512K: dp=8,cp=4
    assert rows[0]["speedup_vs_fixed"] == 1.0
    assert rows[1]["speedup_vs_fixed"] == pytest.approx(rows[0]["step_s"] / rows[1]["step_s"])
    assert all(r["step_s"] >= r["lower_bound_s"] > 0 and r["peak_memory_bytes"] <= r["memory_cap_bytes"]
               for r in rows)
    assert data["summary"]["planned"] == 2 and data["summary"]["over_cap"] == 0
    for line, r in zip([ln for ln in text.splitlines() if ln.startswith("tiny<&>")], rows):
        assert line.split()[1] == r["system"] and f"{r['step_s'] * 1e3:.1f}" in line
    for png in ("step_over_lb.png", "speedup_vs_fixed.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "summary.txt").read_text().strip() in text


def test_bench_rows_are_the_compare_rows_on_the_suite_mesh():
    rows = run_suite([TINY_BATCH], ["fixed", "pool"])
    mesh = mesh_for(sum(TINY_BATCH["seqlens"]))
    assert (mesh.dp, mesh.cp) == (8, 4) and (mesh_for(512 * 1024).dp, mesh_for(512 * 1024).cp) == (4, 8)
    ref, _ = compare_systems(make_problem(TINY_BATCH["seqlens"], mesh=mesh), ["fixed", "pool"])
    for r, q in zip(rows, ref):
        assert r["step_s"] == q["step_s"] and r["peak_memory_bytes"] == q["peak_memory_bytes"]


@pytest.mark.parametrize("args,msg", [
    (["--systems", "nope"], "unknown system 'nope'"),
    (["--systems", "wlb{micro=-1}"], "micro must be"),
    (["--names", "absent"], "no batch named absent"),
    (["--model", "nope"], "unknown model"),
    (["--block-size", "0"], "must be an integer"),
    (["--recompute", "some"], "invalid choice"),
    (["--bogus"], "unrecognized arguments"),
])
def test_step_bench_bad_flags_are_one_line_and_exit_2(batch_file, tmp_path, capsys, args, msg):
    argv = ["step", "bench", "--batches", str(batch_file), "--out", str(tmp_path / "o"), "--no-progress", *args]
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == 2 and msg in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists()  # nothing written before the inputs are checked


def test_step_bench_out_must_be_a_folder(batch_file, tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert cli.main(["step", "bench", "--batches", str(batch_file), "--out", str(f), "--no-progress"]) == 2
    assert "not a folder" in capsys.readouterr().err


@dataclass(frozen=True, slots=True)
class Hostile(StepPass):
    """Every document on one replica's CP group in one micro-batch, under a name full of HTML."""

    name = "x<script>alert(1)</script>&'\""

    def apply(self, problem):
        ranks = list(problem.mesh.cp_group(0))
        return build_plan(problem, self.spec(), [list(range(problem.docs))], [ranks], [0], ["zigzag"])


def _svgs(page: str) -> list[tuple[dict, str]]:
    out = []
    for m in re.finditer(r"<svg ([^>]*)>(.*?)</svg>", page, re.S):
        attrs = dict(re.findall(r"([\w-]+)='([^']*)'", m.group(1)))
        out.append((attrs, m.group(2)))
    return out


@pytest.fixture()
def hostile():
    register_system(Hostile)  # registered only while the test runs: other modules list the systems
    yield Hostile.name
    unregister_system(Hostile.name)


def test_step_report_timelines_span_the_simulated_steps_for_every_rank_and_system(hostile):
    problem = make_problem([700, 300, 250, 90, 40, 30, 12, 5], model="qwen2.5-0.5b",
                           mesh=Mesh(dp=2, cp=2, devices_per_node=2), block_size=64)
    names = ["fixed", "wlb{micro=2}", "pool", Hostile.name]
    rows, done = compare_systems(problem, names)
    assert set(done) == set(names)
    page = render_step_html(problem, rows, done)
    assert "<script" not in page and "http" not in page and "src=" not in page  # self-contained, names escaped
    assert "x&lt;script&gt;alert(1)&lt;/script&gt;&amp;" in page
    assert len(page) < 200_000
    svgs = _svgs(page)
    assert len(svgs) == len(names)
    for (attrs, body), name in zip(svgs, names):
        c = done[name]
        step = c.report["step_s"]
        assert float(attrs["data-step-s"]) == step
        scale = float(attrs["data-px"]) / step
        ranks = re.findall(r"<g data-rank='(\d+)'>(.*?)</g>", body, re.S)
        assert [int(r) for r, _ in ranks] == list(range(problem.mesh.stage_devices))
        for _, g in ranks:
            rects = [(float(x), float(w)) for x, w in re.findall(r"<rect class='\w+' x='([\d.]+)' y='\d+' "
                                                                  r"width='([\d.]+)'", g)]
            t = 0.0
            for i, (x, w) in enumerate(rects):  # back to back from 0 to the step time (2-decimal pixels,
                assert abs((x - 60) - t * scale) < 0.02 * (i + 1)  # each width rounded: the error adds up)
                t += w / scale
            assert abs(t - step) * scale < 0.02 * (len(rects) + 1)
        segs = rank_segments(c)  # the exact seconds
        for r, row in enumerate(segs):
            assert row[0][0] == 0.0 and row[-1][1] == pytest.approx(step, rel=1e-12)
            assert all(a[1] == pytest.approx(b[0], rel=1e-12, abs=1e-15) for a, b in zip(row, row[1:]))
            busy = sum(t1 - t0 for t0, t1, ph, _ in row if ph in ("lf", "af", "lb", "ab"))
            assert busy == pytest.approx(c.report["per_rank"]["busy_s"][r], rel=1e-9)
    hostile = done[Hostile.name]
    idle = [s for s in rank_segments(hostile)[2] if s[2] != "gr"]  # rank 2: not in the one CP group used
    assert len(idle) == 1 and idle[0][2] == "id"


def test_compare_html_on_the_command_line(tmp_path, capsys):
    f = tmp_path / "r.html"
    assert cli.main(["step", "compare", "--seqlens", "700,300,90,5", "--model", "qwen2.5-0.5b", "--mesh",
                     "dp=2,cp=2", "--block-size", "64", "--systems", "fixed,pool", "--html", str(f)]) == 0
    assert f"wrote {f}" in capsys.readouterr().out
    page = f.read_text()
    assert page.count("<svg ") == 2 and "data-rank='3'" in page
    assert cli.main(["step", "compare", "--seqlens", "700,300", "--mesh", "dp=2,cp=2", "--html",
                     str(tmp_path / "missing" / "r.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "plan: error:" in err
    # the report on stdout: the table goes to stderr, but JSON asked for as well is refused before any work
    assert cli.main(["step", "compare", "--seqlens", "700,300", "--mesh", "dp=2,cp=2", "--json", "--html", "-"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "both would go to stdout" in err


def test_c_level_stdout_of_a_solver_goes_to_stderr_while_systems_plan(capfd):
    """HiGHS can printf to the C stdout during flexsp's solve (it did on lmsys-512k-1 at dp=4,cp=8,
    breaking ``plan step compare --json``): the CLI routes fd 1 to stderr while systems plan."""
    import ctypes
    import os

    from attnplan.cli_step import _c_stdout_to_stderr
    with _c_stdout_to_stderr():
        os.write(1, b"raw fd write\n")
        ctypes.CDLL(None).printf(b"buffered C write\n")
    print("after")
    out, err = capfd.readouterr()
    assert out == "after\n" and "raw fd write" in err and "buffered C write" in err


def test_step_report_draws_stages_times_time_for_a_pipeline():
    """With pp > 1 every rank of every stage has a row of its forward and backward ops as simulated, back to
    back with idle time from 0 to the step time; an op's length is the schedule simulation's."""
    problem = make_problem([700, 300, 250, 90, 40, 30, 12, 5], model="qwen2.5-0.5b",
                           mesh=Mesh(dp=1, cp=2, pp=2, devices_per_node=2), block_size=64)
    names = ["fixed", "chunkflow{chunk=256}"]
    rows, done = compare_systems(problem, names)
    page = render_step_html(problem, rows, done)
    assert "pipeline forward op" in page and "class='pb'" in page
    for name in names:
        c = done[name]
        step = c.report["step_s"]
        segs = rank_segments(c)
        assert len(segs) == problem.mesh.devices
        pipe = c.report["pipeline"]
        for row in segs:
            assert row[0][0] == 0.0 and row[-1][1] == pytest.approx(step, rel=1e-12)
            assert all(a[1] == pytest.approx(b[0], rel=1e-12, abs=1e-15) for a, b in zip(row, row[1:]))
            ops = [(t0, t1) for t0, t1, ph, _ in row if ph in ("pf", "pb", "pr")]
            assert ops and all(t1 > t0 for t0, t1 in ops)
        starts = {round(t0, 15) for row in segs for t0, _, ph, _ in row if ph == "pf"}
        assert starts <= {round(x, 15) for mb in pipe["mb_start_s"] for ch in mb for x in ch}
