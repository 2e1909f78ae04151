"""The status table of the home page, generated from the repository itself.

For every stage and schedule ``X`` it lists what exists in the four places a stage lives:
the reference (``reference/X.py``; S0 is ``reference/layer.py``, S1 and S2 are in
``reference/schedules/``), the fast implementation (``fast/X.py`` or the package
``fast/X/``; the schedules' would be ``fast/schedules/X.py``), the contracts
(``verify/test_X.py`` and ``verify/test_X_*.py``, with the backends their tests name in
``@pytest.mark.backends``; a test without the marker runs the reference), and the docs page
(``docs/stages/X.md`` or ``docs/schedules/X.md``). Nothing in it is typed by hand, so the
page cannot claim what the repository does not hold.

    python -m verify.status            # print the table
    python -m verify.status --write    # rewrite it in docs/index.md

``tests/test_status.py`` fails when the committed page differs from the generated table.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INDEX = ROOT / "docs" / "index.md"
BEGIN, END = "<!-- status: begin (python -m verify.status --write) -->", "<!-- status: end -->"

#: stage or schedule -> (reference module path, fast path, docs page), relative to the root
PLACES: dict[str, tuple[str, str, str]] = {
    "mx": ("reference/mx.py", "fast/mx.py", "docs/stages/mx.md"),
    "router": ("reference/router.py", "fast/router.py", "docs/stages/router.md"),
    "activation": ("reference/activation.py", "fast/activation.py", "docs/stages/activation.md"),
    "experts": ("reference/experts.py", "fast/experts", "docs/stages/experts.md"),
    "finalize": ("reference/finalize.py", "fast/finalize.py", "docs/stages/finalize.md"),
    "norm": ("reference/norm.py", "fast/norm.py", "docs/stages/norm.md"),
    "stock": ("reference/layer.py", "fast/stock.py", "docs/schedules/stock.md"),
    "dep": ("reference/schedules/dep.py", "fast/schedules/dep.py", "docs/schedules/dep.md"),
    "wide": ("reference/schedules/wide.py", "fast/schedules/wide.py", "docs/schedules/wide.md"),
}


#: The order backends are listed in (``verify.backends``); ``external`` stands for the
#: backends selected from outside the package (``--backend``, entry points).
BACKEND_ORDER = ("reference", "reference-cuda", "stock", "fast", "external")


def _module(path: str) -> str:
    """``reference/schedules/dep.py`` -> ``reference.schedules.dep``."""
    return path.removesuffix(".py").replace("/", ".")


def _exists(path: str) -> bool:
    p = ROOT / path
    return p.is_file() or (p.is_dir() and (p / "__init__.py").is_file())


def contract_files(stage: str) -> list[Path]:
    """``verify/test_<stage>.py`` and ``verify/test_<stage>_*.py``."""
    files = [ROOT / "verify" / f"test_{stage}.py"] + sorted((ROOT / "verify").glob(f"test_{stage}_*.py"))
    return [f for f in files if f.is_file()]


def _marker_backends(node: ast.AST) -> tuple[str, ...] | None:
    """The string arguments of a ``pytest.mark.backends(...)`` call, and ``external`` when
    it says ``external=True`` (every selected backend that is not built in), else None."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "backends"):
        names = tuple(a.value for a in node.args if isinstance(a, ast.Constant))
        external = any(k.arg == "external" and isinstance(k.value, ast.Constant)
                       and k.value.value is True for k in node.keywords)
        return names + (("external",) if external else ())
    return None


def marked_tests(path: Path, marker_value) -> list[tuple[str, object]]:
    """Each test function of ``path`` with the value of its marker, read from the source:
    ``marker_value(node)`` picks a marker's value out of an AST node (None where the node
    is not that marker); a test's own decorator wins over the module's ``pytestmark``, and
    a test with neither gets None."""
    tree = ast.parse(path.read_text())
    module_level = None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            for sub in ast.walk(node.value):
                found = marker_value(sub)
                if found:
                    module_level = found
    out = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            value = module_level
            for deco in node.decorator_list:
                found = marker_value(deco)
                if found:
                    value = found
            out.append((node.name, value))
    return out


def backends_of(path: Path) -> tuple[list[str], int]:
    """(the backends the tests of ``path`` name; the number of test functions).
    Module-level ``pytestmark`` backends apply to every test."""
    tests = marked_tests(path, _marker_backends)
    seen: list[str] = []
    for _, names in tests:
        for name in names or ("reference",):
            if name not in seen:
                seen.append(name)
    return seen, len(tests)


def rows() -> list[tuple[str, str, str, str, str]]:
    """One row per stage: (stage, reference, fast, verify, docs) Markdown cells."""
    out = []
    for stage, (ref, fast, page) in PLACES.items():
        ref_cell = f"`{_module(ref)}`" if _exists(ref) else "—"
        fast_cell = f"`{_module(fast)}`" if _exists(fast) else "not built"
        cells = []
        for f in contract_files(stage):
            names, tests = backends_of(f)
            names = sorted(names, key=lambda n: BACKEND_ORDER.index(n)
                           if n in BACKEND_ORDER else len(BACKEND_ORDER))
            cells.append(f"`{f.name}` ({tests} tests: {', '.join(names)})")
        verify_cell = "<br>".join(cells) or "—"
        docs_cell = f"[{Path(page).name}]({Path(page).relative_to('docs')})" \
            if (ROOT / page).is_file() else "—"
        out.append((stage, ref_cell, fast_cell, verify_cell, docs_cell))
    return out


def table() -> str:
    """The Markdown table of :func:`rows`."""
    lines = ["| stage | reference | fast | verify (contract files: tests, backends) | docs |",
             "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows()]
    return "\n".join(lines)


def render(page: str) -> str:
    """``page`` with the text between the status markers replaced by :func:`table`."""
    if BEGIN not in page or END not in page:
        raise ValueError(f"{INDEX} has no status markers {BEGIN!r} ... {END!r}")
    head, rest = page.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + BEGIN + "\n" + table() + "\n" + END + tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the stage x {reference, fast, verify, docs} table")
    parser.add_argument("--write", action="store_true", help=f"rewrite the table in {INDEX}")
    args = parser.parse_args(argv)
    if args.write:
        INDEX.write_text(render(INDEX.read_text()))
    else:
        print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
