"""What the CuTe DSL emits for a kernel (its own dump, ``CUTE_DSL_KEEP``): the PTX, for the
tests that check which instructions a kernel issues, and the cubins of
``tools/sass_digest.py``. The compile runs in a subprocess so that its dump directory is
its own (no GPU needed)."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_compile(script: str, args=(), *, keep: str | None = None, dump_dir: Path | None = None,
                timeout: float = 1800) -> str:
    """Run ``script`` (Python that calls ``cute.compile``) in a fresh interpreter with the
    repository on ``PYTHONPATH``, the arguments ``args`` and, with ``keep``, the DSL's dump
    of those artifacts (``CUTE_DSL_KEEP``, e.g. "ptx", "cubin") into the existing directory
    ``dump_dir``; its standard output. A failed script raises with the end of its stderr."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                    os.environ.get("PYTHONPATH")])))
    if keep is not None:
        env.update(CUTE_DSL_KEEP=keep, CUTE_DSL_DUMP_DIR=str(dump_dir))
    done = subprocess.run([sys.executable, "-c", script, *map(str, args)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"compile {list(args)} failed:\n{done.stderr[-2000:]}")
    return done.stdout


def elf_sections(cubin: bytes) -> dict[bytes, bytes]:
    """Name -> contents of every section of an ELF64 cubin (section headers at ``e_shoff``,
    their size, count and string-table index at 0x3A)."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    entsize, count, names_at = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * entsize) for i in range(count)]
    strtab = headers[names_at][4]

    def name(offset: int) -> bytes:
        start = strtab + offset
        return cubin[start:cubin.index(b"\0", start)]

    return {name(h[0]): cubin[h[4]:h[4] + h[5]] for h in headers}


def dump_ptx(script: str, directory: Path, pattern: str = "*.ptx") -> list[Path]:
    """Run ``script`` with the DSL's PTX dump into ``directory`` (:func:`run_compile`); the
    dumps whose names match ``pattern``."""
    run_compile(script, keep="ptx", dump_dir=directory, timeout=600)
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
