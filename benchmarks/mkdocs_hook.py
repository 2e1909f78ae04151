"""mkdocs hook: the performance page's figures and tables, built from the committed
history when the site is built (``benchmarks.performance_page``).

``docs/performance.md`` holds the hand-written text and the marker line
``<!-- performance:generated -->``, which this hook replaces; the figures are added to the
site as generated files under ``performance/``. A history that does not parse fails the
build (as it fails ``benchmarks/test_history.py``).
"""

from __future__ import annotations

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

from benchmarks import performance_page

MARKER = "<!-- performance:generated -->"
PAGE = "performance.md"
_generated: dict[str, str] = {}


def on_files(files, config):
    markdown, images = performance_page.build()
    _generated[PAGE] = markdown
    for path, content in images.items():
        files.append(File.generated(config, path, content=content))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise PluginError(f"docs/{PAGE} lacks the line {MARKER!r} the generated part replaces")
    return markdown.replace(MARKER, _generated[PAGE])
