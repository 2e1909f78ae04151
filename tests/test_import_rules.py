"""Who may import whom (``docs/design.md``, "The packages"), read from the source's syntax tree.

* ``model`` (the shared vocabulary) imports only the standard library, PyTorch,
  safetensors (the checkpoint) and itself: no stage, no kernel, no contract;
* ``fast`` imports nothing of ``reference``: a kernel cannot fall back to the reference
  unnoticed; what the two share is ``model``;
* ``reference`` imports nothing of ``fast`` or ``verify``.

Every import counts: top-level or inside a function, ``import a.b``, ``from a import b``,
relative imports (resolved against the module's package) and
``importlib.import_module("a.b")`` with a constant name.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

MODEL_MAY_IMPORT = {"model", "torch", "safetensors"}


def imported_modules(path: Path, package: str) -> list[tuple[int, str]]:
    """``(line, dotted module name)`` of every import in the module at ``path``, by line.

    ``package`` is the module's own package (``fast.experts`` for
    ``fast/experts/layout.py``), against which relative imports are resolved; ``from a
    import b`` gives ``a`` (and ``a.b``, which may be a submodule)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names
                      if alias.name != "*"]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))
    return sorted(found, key=lambda item: item[0])


def _package_of(path: Path, root: Path) -> str:
    """The package a module file belongs to (``fast.experts`` for ``fast/experts/layout.py``
    and for ``fast/experts/__init__.py``)."""
    return ".".join(path.relative_to(root).parts[:-1])


def violations(root: Path, package: str, allowed) -> list[str]:
    """``path:line imports module`` for every import in ``root/package`` whose top-level
    name ``allowed(top)`` refuses."""
    out = []
    for path in sorted((root / package).rglob("*.py")):
        own = _package_of(path, root)
        for line, module in imported_modules(path, own):
            top = module.split(".")[0]
            if not allowed(top):
                out.append(f"{path.relative_to(root)}:{line} imports {module}")
    return sorted(set(out))


def model_allows(top: str) -> bool:
    return top in MODEL_MAY_IMPORT or top in sys.stdlib_module_names


def fast_allows(top: str) -> bool:
    return top != "reference"


def reference_allows(top: str) -> bool:
    return top not in ("fast", "verify")


RULES = {
    "model": model_allows,
    "fast": fast_allows,
    "reference": reference_allows,
}


@pytest.mark.parametrize("package", sorted(RULES))
def test_package_imports_only_what_it_may(package):
    assert (ROOT / package / "__init__.py").is_file(), f"{package}/ is not a package"
    bad = violations(ROOT, package, RULES[package])
    assert not bad, f"{package}/ imports what it may not:\n" + "\n".join(bad)


def test_a_planted_import_is_found(tmp_path):
    """The walk sees each form of import, so the rules above can fail."""
    pkg = tmp_path / "fast" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "fast" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "import torch\n"
        "import reference.mx\n"
        "from reference import layer\n"
        "def f():\n"
        "    from reference.schedules.dep import dep_rank\n"
        "    import importlib\n"
        "    return importlib.import_module('reference.router')\n"
        "from .. import backend\n"
        "from . import b\n")
    (pkg / "b.py").write_text("from model.config import LatentMoEConfig\n")
    bad = violations(tmp_path, "fast", fast_allows)
    assert bad == [
        "fast/sub/a.py:2 imports reference.mx",
        "fast/sub/a.py:3 imports reference",
        "fast/sub/a.py:3 imports reference.layer",
        "fast/sub/a.py:5 imports reference.schedules.dep",
        "fast/sub/a.py:5 imports reference.schedules.dep.dep_rank",
        "fast/sub/a.py:7 imports reference.router",
    ], bad
    # relative imports resolve against the package; under model's rule they are fast's
    assert imported_modules(pkg / "a.py", "fast.sub")[-4:] == [
        (8, "fast"), (8, "fast.backend"), (9, "fast.sub"), (9, "fast.sub.b")]
    assert violations(tmp_path, "fast", model_allows) == sorted(bad + [
        "fast/sub/a.py:8 imports fast", "fast/sub/a.py:8 imports fast.backend",
        "fast/sub/a.py:9 imports fast.sub", "fast/sub/a.py:9 imports fast.sub.b"])
