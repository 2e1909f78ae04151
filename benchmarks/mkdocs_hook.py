"""mkdocs hook: the performance page's status, figures and tables, built from the
committed history when the site is built (``benchmarks.performance_page``).

``docs/performance.md`` holds the hand-written text and two marker lines: ``STATUS``,
right under the title, which this hook replaces with the page's status (which run, how far
behind HEAD, and whether the SASS of the kernels it draws is the one recorded with the
run), and ``MARKER``, which it replaces with the figures and tables; the figures are added
to the site as generated files under ``performance/``. A history that does not parse fails
the build (as it fails ``benchmarks/test_history.py``).

This is where CI computes the current tree's SASS digests (``make test`` ends with the
strict docs build): ``benchmarks.sass_check.current_digests`` compiles the kernel sets the
GPU runs time for the run's architecture, on the CPU, once per build process and source
state. ``LATENTMOE_SKIP_SASS_CHECK=1`` skips that compile (a quick local build; the page
then says "Not checked"); without CuTe DSL the page says so too.
"""

from __future__ import annotations

import hashlib
import os

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

from benchmarks import performance_page, sass_check

STATUS = "<!-- performance:status -->"
MARKER = "<!-- performance:generated -->"
PAGE = "performance.md"
_generated: dict[str, performance_page.Page] = {}
#: (arch, digest of the sources) -> digest lines, so ``mkdocs serve`` recompiles only
#: after a change to the kernels' sources
_digests: dict[tuple[str, str], list[str]] = {}


def _sources_key() -> str:
    """SHA-1 of every ``.py`` file under ``fast/``, ``tools/`` and the model's config."""
    root = performance_page.ROOT
    sha = hashlib.sha1()
    for path in sorted(p for d in ("fast", "tools", "reference", "model") if (root / d).is_dir()
                       for p in (root / d).rglob("*.py")):
        sha.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return sha.hexdigest()


def _current_digests(arch: str) -> list[str]:
    key = (arch, _sources_key())
    if key not in _digests:
        _digests[key] = sass_check.current_digests(arch)
    return _digests[key]


def _digest_source():
    """(the callable that computes the current digests, or None; why not)."""
    if os.environ.get(sass_check.SKIP_ENV) == "1":
        return None, f"{sass_check.SKIP_ENV}=1"
    from fast import backend

    error = backend.cute_import_error()
    if error is not None:
        return None, f"CuTe DSL is not importable: {error}"
    return _current_digests, ""


def on_files(files, config):
    current, why = _digest_source()
    page = performance_page.build(current_digests=current, not_checked=why)
    _generated[PAGE] = page
    for path, content in page.images.items():
        files.append(File.generated(config, path, content=content))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri != PAGE:
        return markdown
    for marker in (STATUS, MARKER):
        if marker not in markdown:
            raise PluginError(f"docs/{PAGE} lacks the line {marker!r} the generated part "
                              "replaces")
    built = _generated[PAGE]
    return markdown.replace(STATUS, built.status).replace(MARKER, built.body)
