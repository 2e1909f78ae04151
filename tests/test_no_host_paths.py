"""Committed files name no path of the machine they were made on (a result log's
interpreter, working tree or temporary directory): a reader has none of them. Logs copied
from a run are rewritten to ``<site-packages>/``, ``<venv>/``, ``./`` or ``<tmp>/``."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOST_PATH = re.compile(r"(?<![\w.<>-])/(?:opt|root|work|home)/|/tmp/pytest-of-")


def _tracked() -> list[Path]:
    try:
        done = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                              timeout=60, check=True)
    except (OSError, subprocess.SubprocessError) as error:
        pytest.skip(f"not a git checkout ({error!r}): the tracked files are unknown")
    return [ROOT / name for name in done.stdout.decode().split("\0") if name]


def test_committed_files_name_no_host_paths():
    found = []
    for path in _tracked():
        if path == Path(__file__).resolve():
            continue  # the pattern above names what it looks for
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue  # binary, or a link
        for number, line in enumerate(text.splitlines(), 1):
            if HOST_PATH.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    assert not found, "host paths in committed files:\n" + "\n".join(found[:20])
