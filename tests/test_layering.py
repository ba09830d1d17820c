"""Layers import only downward, imports inside functions included:

    ir, errors  <-  frontend, passes  <-  backends  <-  runtime  <-  step  <-  tools  <-  face (api, cli, the package root)

Every module of the package is parsed (not imported) and every ``import`` /
``from ... import`` node anywhere in it is resolved to the part of the
project it names; an arrow against the rules below fails with file:line.
And no two modules import each other, directly or through others (a cycle
of the module graph, ``TYPE_CHECKING`` imports included, fails naming it)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIP = {"tests", "benchmarks", "examples", "docs", "build", "dist"}
FACE = {"api", "cli", "cli_step", "cli_io", "__init__", "hf"}
PROJECT = {"ir", "errors", "frontend", "passes", "backends", "runtime", "tools", "step"} | FACE
# part -> the parts of the project it may import (besides itself)
ALLOWED = {
    "ir": {"errors"},
    "errors": set(),
    "frontend": {"ir", "errors"},
    "passes": {"ir", "errors"},
    "backends": {"ir", "errors", "passes"},
    "runtime": {"ir", "errors", "backends"},
    "step": {"ir", "errors", "frontend", "passes", "backends"},
    "tools": PROJECT - FACE - {"tools"},  # everything below the face; never the face (api: tools.compiler is its body)
}


def part_of(rel: Path) -> str:
    head = rel.parts[0]
    return head[:-3] if head.endswith(".py") else head


def modules() -> list[Path]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in SKIP or any(p.startswith(".") or p.endswith(".egg-info") for p in rel.parts):
            continue
        out.append(rel)
    return out


def targets(rel: Path, node: ast.AST) -> list[str]:
    """Parts of the project an import node names (empty for outside imports)."""
    if isinstance(node, ast.ImportFrom) and node.level:
        pkg = list(rel.parts[:-1])
        if node.level - 1 > len(pkg):
            return ["<above the package>"]
        full = pkg[: len(pkg) - (node.level - 1)] + (node.module.split(".") if node.module else [])
        return [full[0]] if full else [a.name.split(".")[0] for a in node.names]
    names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
    out = []
    for m in names:
        if m and m.split(".")[0] == "attnplan":
            rest = m.split(".")[1:]
            if rest:
                out.append(rest[0])
            elif isinstance(node, ast.ImportFrom):
                out += [a.name for a in node.names]
            else:
                out.append("__init__")
    return out


def arrows(rel: Path):
    """(line, source part, target part) of every project import in a module."""
    tree = ast.parse((ROOT / rel).read_text(encoding="utf-8"), str(rel))
    src = part_of(rel)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for t in targets(rel, node):
                yield node.lineno, src, t[:-3] if t.endswith(".py") else t


def violations() -> list[str]:
    bad = []
    for rel in modules():
        for line, src, dst in arrows(rel):
            if dst == src or src not in ALLOWED:
                continue
            if dst in PROJECT and dst not in ALLOWED[src] or dst == "<above the package>":
                bad.append(f"{rel}:{line}: {src} -> {dst}")
    return bad


def test_every_part_of_the_package_is_known():
    """A new top-level package or module must get a place in the rules."""
    unknown = sorted({part_of(rel) for rel in modules()} - PROJECT)
    assert not unknown, f"add {unknown} to PROJECT/ALLOWED in tests/test_layering.py"


def test_layers_import_only_downward():
    assert len(modules()) > 40  # the walk sees the package (not an empty folder)
    bad = violations()
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


@pytest.mark.parametrize("source,expected", [
    ("from ..api import load\n", ["api"]),
    ("def f():\n    from ...attnplan import cli\n", ["<above the package>"]),
    ("def f():\n    import attnplan.tools.launch\n", ["tools"]),
    ("from attnplan import passes, api\n", ["passes", "api"]),
    ("from . import dist\n", ["runtime"]),
    ("import numpy\nfrom .. import errors\n", ["errors"]),
])
def test_the_walk_resolves_imports(source, expected):
    """The checker itself: relative, absolute and function-level imports, as
    seen from runtime/x.py."""
    rel = Path("runtime/x.py")
    tree = ast.parse(source)
    got = [t for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)) for t in targets(rel, node)]
    assert got == expected


def test_a_runtime_import_of_the_face_is_caught(tmp_path, monkeypatch):
    """A function-level ``from ..api import ...`` in runtime is reported."""
    fake = tmp_path / "runtime"
    fake.mkdir()
    (fake / "bad.py").write_text("def f():\n    from ..api import load\n    return load\n")
    (tmp_path / "ir").mkdir()
    (tmp_path / "ir" / "ok.py").write_text("from ..errors import PlanError\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert violations() == ["runtime/bad.py:2: runtime -> api"]


def test_pass_registry_needs_no_side_effect_import():
    """A fresh interpreter parses the default pipeline without importing
    backends first (the registry lists the built-in passes explicitly)."""
    code = ("import sys\nfrom attnplan.passes import parse_pipeline\n"
            "ps = parse_pipeline('tile,zigzag,comm,emit')\n"
            "print([p.name for p in ps], 'attnplan.backends' in sys.modules, 'attnplan.runtime' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["['tile',", "'zigzag',", "'comm',", "'emit']", "False", "False"]


# ------------------------------------------------------------------ cycles between modules

def module_name(rel: Path) -> str:
    return ".".join(rel.with_suffix("").parts)


def module_graph(root: Path | None = None) -> dict[str, set[str]]:
    """module -> the modules of the package it imports (a package's ``__init__`` when it names a package)."""
    root = ROOT if root is None else root
    rels = [p.relative_to(root) for p in sorted(root.rglob("*.py"))
            if p.relative_to(root).parts[0] not in SKIP and not any(x.startswith(".") for x in p.relative_to(root).parts)]
    mods = {module_name(r) for r in rels}

    def resolve(parts: list[str]) -> str | None:
        for i in range(len(parts), 0, -1):
            for cand in (".".join(parts[:i]), ".".join(parts[:i]) + ".__init__"):
                if cand in mods:
                    return cand
        return None

    graph: dict[str, set[str]] = {module_name(r): set() for r in rels}
    for rel in rels:
        me = module_name(rel)
        pkg = list(rel.parts[:-1])
        for node in ast.walk(ast.parse((root / rel).read_text(encoding="utf-8"))):
            names: list[list[str]] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg[:len(pkg) - (node.level - 1)] + (node.module.split(".") if node.module else [])
                elif node.module and node.module.split(".")[0] == "attnplan":
                    base = node.module.split(".")[1:]
                else:
                    continue
                names = [base + [a.name] for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name.split(".")[1:] or ["__init__"] for a in node.names if a.name.split(".")[0] == "attnplan"]
            for parts in names:
                t = resolve(parts)
                if t is not None and t != me:
                    graph[me].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root); on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w); on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop(); on.discard(w); comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_two_modules_import_each_other():
    graph = module_graph()
    assert len(graph) > 40 and sum(map(len, graph.values())) > 100  # the walk sees the imports
    found = cycles(graph)
    assert not found, "modules in an import cycle: " + "; ".join(" <-> ".join(c) for c in found)


def test_a_cycle_through_a_lazy_import_is_caught(tmp_path):
    (tmp_path / "ir").mkdir()
    (tmp_path / "ir" / "__init__.py").write_text("")
    (tmp_path / "ir" / "a.py").write_text("from .b import B\n")
    (tmp_path / "ir" / "b.py").write_text("def f():\n    from ..ir import c\n")
    (tmp_path / "ir" / "c.py").write_text("import attnplan.ir.a\n")
    (tmp_path / "ir" / "d.py").write_text("from . import a\n")
    assert cycles(module_graph(tmp_path)) == [["ir.a", "ir.b", "ir.c"]]
