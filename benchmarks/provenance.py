"""Where a GPU table's figures come from: the device, the software and the tree measured.

Every table run (``experts_table``, ``dep_table``, ``wide_table``, ``dense_table`` and the
two-GPU tables) starts its result with :func:`run_header`, so a result file names the
commit it measured even when it ran from a copy of the tree without git (a GPU node gets
a ``git archive`` copy): ``BENCH_COMMIT`` where the caller sets it (``make bench`` does),
else a ``COMMIT`` file at the repository root (what such a copy carries), else git.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

__all__ = ["ROOT", "git_head", "tree_commit", "run_header", "tree_note"]

ROOT = Path(__file__).resolve().parents[1]


def git_head(root: Path = ROOT) -> tuple[str, bool]:
    """``(HEAD's full commit, whether a tracked file differs)`` of the checkout at
    ``root``. Raises OSError or ``subprocess.CalledProcessError`` where git cannot tell (no
    git, or a copied tree without its history)."""
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, check=True,
                         capture_output=True, text=True).stdout.strip()
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                            cwd=root, check=True, capture_output=True, text=True).stdout
    return sha, bool(status.strip())


def tree_commit(root: Path = ROOT) -> str:
    """The measured tree's commit: ``$BENCH_COMMIT`` (``<sha>[-dirty]``), else the first
    word of ``root/COMMIT``, else :func:`git_head` (``-dirty`` when a tracked file
    differs), else ``"unknown"``."""
    given = os.environ.get("BENCH_COMMIT")
    if given:
        return given
    marker = root / "COMMIT"
    if marker.is_file():
        words = marker.read_text().split()
        if words:
            return words[0]
    try:
        sha, dirty = git_head(root)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")


def run_header() -> dict:
    """``{"device", "torch", "python", "commit"}`` of a run on this process's GPU."""
    import torch

    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "python": platform.python_version(), "commit": tree_commit()}


def tree_note(result: dict) -> str:
    """``", tree <commit>"`` for a result that names its commit, else ``""`` (runs from
    before :func:`run_header` recorded it)."""
    commit = result.get("commit")
    return f", tree {commit}" if commit else ""
