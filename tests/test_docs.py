"""The user docs: the README is a front page, the CLI reference is current,
and every ``$ plan ...`` command a guide shows runs and prints what the guide
shows, compared for shape (numbers and spacing aside: timings vary)."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from attnplan import cli

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
SHARED = ROOT.parent / "shared"
GUIDES = ["mask-language.md", "strategies.md", "training-step.md", "runtime.md", "huggingface.md", "cli.md",
          "results.md", "DESIGN.md"]


def examples() -> list:
    """Every fenced block of the docs that shows ``$ plan`` commands: (doc:line, [(command, expected output
    lines), ...]); a block's commands run in order in one folder (a later one may read an earlier one's file)."""
    out = []
    for path in DOCS:
        lines = path.read_text(encoding="utf-8").split("\n")
        fence, block, start = False, [], 0
        for i, line in enumerate(lines):
            if line.startswith("```"):
                if fence and block:
                    out.append(pytest.param(block, id=f"{path.name}:{start}"))
                fence, block, start = not fence, [], i + 2
            elif fence and line.startswith("$ plan "):
                block.append((line[2:], []))
            elif fence and line.startswith("$ "):
                block.append((None, []))  # another program: its output is not checked
            elif fence and block:
                block[-1][1].append(line)
    return out


NUMBER = re.compile(r"[-+]?\d[\d,]*(\.\d+)?([eE][-+]?\d+)?")


def shape(line: str) -> str:
    """A line with every number replaced by N and runs of spaces by one (what a guide's output must keep)."""
    return " ".join(NUMBER.sub("N", line).split())


def matches(got: list[str], want: list[str]) -> bool:
    """``got`` has the shape of ``want``, where a line ``...`` in ``want`` stands for any lines."""
    if not want:
        return True
    if want[0].strip() == "...":
        return any(matches(got[k:], want[1:]) for k in range(len(got) + 1))
    return bool(got) and shape(got[0]) == shape(want[0]) and matches(got[1:], want[1:])


@pytest.mark.parametrize("block", examples())
def test_a_guide_command_runs_and_prints_what_the_guide_shows(block, tmp_path, capsys, monkeypatch):
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    (tmp_path / "out").mkdir()
    monkeypatch.chdir(tmp_path)
    for cmd, want in block:
        if cmd is None:
            continue
        if "../shared/" in cmd:
            if not SHARED.is_dir():
                pytest.skip("shared/ is not beside this checkout")
            cmd = cmd.replace("../shared/", f"{SHARED}/")
        argv = shlex.split(cmd, comments=True)
        try:
            code = cli.main(argv[1:])
        except SystemExit as e:
            code = e.code
        out, err = capsys.readouterr()
        expect_error = any(x.startswith("plan: error:") for x in want)
        assert (code == 2) == expect_error, (cmd, code, err)
        want = [w for w in want if w.strip()]
        got = [g for g in (out + err).split("\n") if g.strip()]
        assert matches(got, want), f"{cmd}\n--- the guide shows:\n" + "\n".join(want) + "\n--- it printed:\n" + \
            "\n".join(got)


def test_the_guides_show_commands():
    assert sum(len(b.values[0]) for b in examples()) >= 8


def test_the_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.split("\n")) <= 250
    for guide in GUIDES:
        assert (ROOT / "docs" / guide).is_file(), guide
        assert f"docs/{guide}" in text, f"the README does not link {guide}"
    for section in ("make demo", "make test", "plan compile", "plan compare", "plan viz", "plan step compare",
                    "attn_implementation"):
        assert section in text, section


def test_user_docs_hold_no_internal_history():
    for path in DOCS:
        if path.name == "DESIGN.md":
            continue
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"\b[Ii]ssue \d|\(issue|next issue", text), path.name


def test_relative_links_in_the_docs_resolve():
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            assert (path.parent / target).exists(), f"{path.name}: {target}"


def test_the_cli_reference_is_current():
    spec = importlib.util.spec_from_file_location("make_cli_reference", ROOT / "docs" / "make_cli_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--check"]) == 0, "run .venv/bin/python docs/make_cli_reference.py"
