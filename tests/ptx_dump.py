"""The PTX the CuTe DSL emits for a kernel (its own dump, ``CUTE_DSL_KEEP=ptx``), for the
tests that check which instructions a kernel issues. The compile runs in a subprocess so
that its dump directory is its own (no GPU needed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def dump_ptx(script: str, directory: Path, pattern: str = "*.ptx") -> list[Path]:
    """Run ``script`` (Python that calls ``cute.compile``) with the DSL's PTX dump into
    ``directory``; the dumps whose names match ``pattern``. The script's errors fail."""
    env = dict(os.environ, CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(directory),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=directory,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return sorted(directory.glob(pattern))


def loops(ptx: str) -> list[list[str]]:
    """The bodies of the PTX's loops: the lines from a label to a later branch back to it."""
    lines = ptx.splitlines()
    at = {}
    for i, line in enumerate(lines):
        if line.startswith("$L__") and line.rstrip().endswith(":"):
            at[line.strip()[:-1]] = i
    bodies = []
    for i, line in enumerate(lines):
        if "bra" in line:
            target = line.split()[-1].rstrip(";")
            if target in at and at[target] < i:
                bodies.append(lines[at[target]:i + 1])
    return bodies
