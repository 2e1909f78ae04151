"""The schedule packages import without circles: among the modules of ``fast.schedules``
and ``reference.schedules``, the imports (at module level and inside functions) form no
cycle, ``fast.schedules.graphs`` and ``fast.schedules.steps`` are leaves (they import no
layer and no program), and the modules the layers share (the leaves, the rank programs,
the reference's groups and mailbox) each import first in a fresh interpreter."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("fast.schedules", "reference.schedules")


def modules() -> list[str]:
    found = []
    for package in PACKAGES:
        folder = ROOT.joinpath(*package.split("."))
        found += [f"{package}.{p.stem}" for p in sorted(folder.glob("*.py"))
                  if p.stem != "__init__"]
    return found


def imports_of(module: str) -> set[str]:
    """The schedule modules ``module`` imports anywhere in its source."""
    tree = ast.parse(ROOT.joinpath(*module.split(".")).with_suffix(".py").read_text())
    ours, found = set(modules()), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {n for n in names if n in ours}
    return found - {module}


def test_no_import_cycles():
    graph = {m: imports_of(m) for m in modules()}
    state: dict[str, str] = {}

    def visit(m, path):
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycle = path[path.index(n):] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n, path + [n])
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m, [m])


@pytest.mark.parametrize("leaf", ["fast.schedules.graphs", "fast.schedules.steps"])
def test_leaves(leaf):
    assert imports_of(leaf) == set()


@pytest.mark.parametrize("module", ["fast.schedules.graphs", "fast.schedules.steps",
                                    "fast.schedules.dep_program", "fast.schedules.wide_program",
                                    "reference.schedules.groups", "reference.schedules.mailbox"])
def test_imports_first(module):
    result = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
