"""Digests of the machine code (SASS) the fast kernels compile to, without a GPU.

A change that leaves every kernel's SASS byte for byte the same (a module split, a rename,
a comment, a refactor of the host code) leaves every GPU result of the kernels standing.
This tool proves that on a CPU: it compiles each kernel of a fixed set (the experts
engine at three geometries and tactics, the wide layer's polled route) with CuTe DSL's
cubin dump, and prints one line per kernel with the SHA-1 of its ``.text`` sections (the
SASS; the symbol names, which carry the Python module path, and the debug sections are
left out)::

    python tests/sass_digest.py before.txt          # on the old tree
    python tests/sass_digest.py after.txt           # on the new one
    diff before.txt after.txt                       # empty: no kernel changed

Each kernel compiles in its own process, because the DSL names a dump after the kernel's
class, so FC1 and FC2 of one engine would overwrite each other in one directory.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import os
import re
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ("sm_90a", "sm_100a")

#: name -> (geometry: "dep16" or "tp8", windows, strict, empty_rows, tactic)
ENGINES = {
    "dep16-fused-w1": ("dep16", 1, False, True, {"fused": 1, "pdl_chain": 1}),
    "dep16-two-w4-strict": ("dep16", 4, True, True, {"fused": 0, "pdl_chain": 0}),
    "tp8-walk4-w2": ("tp8", 2, False, False, {"walk": 4}),
}

_COMPILE = """
import sys
from reference.config import LatentMoEConfig
from fast.experts import engine
from fast.experts.layout import Geometry
from fast.schedules import wide

c = LatentMoEConfig.kimi_k3()
arch, name, kind = sys.argv[1:4]
if name == "wide-route":
    wide._compiled("route", arch, wide.kernel_params(c, 8)["route"])
    sys.exit()
geometry, windows, strict, empty_rows, tactic = {engines}[name]
g = (Geometry(latent=c.latent, inter=c.intermediate, first=0, count=56, shard=(0, 1))
     if geometry == "dep16" else
     Geometry(latent=c.latent, inter=c.intermediate // 8, first=0, count=896, shard=(0, 8)))
params = engine._kernel_params(g, c, windows, False, strict, engine.complete_tactic(tactic, arch),
                               empty_rows=empty_rows)
if kind == "?":
    print(" ".join(params))
else:
    engine._compiled(kind, arch, params[kind])
"""


def _python(args, dump_dir: Path | None = None) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                    os.environ.get("PYTHONPATH")])))
    if dump_dir is not None:
        env.update(CUTE_DSL_KEEP="cubin", CUTE_DSL_DUMP_DIR=str(dump_dir))
    done = subprocess.run([sys.executable, "-c", _COMPILE.format(engines=ENGINES), *args],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"compile {args} failed:\n{done.stderr[-2000:]}")
    return done.stdout


def text_digest(cubin: bytes) -> tuple[str, int]:
    """SHA-1 (hex) and total size of the ``.text*`` sections of an ELF64 cubin."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    entsize, count, names_at = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * entsize) for i in range(count)]
    strtab = headers[names_at][4]

    def name(offset: int) -> bytes:
        start = strtab + offset
        return cubin[start:cubin.index(b"\0", start)]

    sha, size = hashlib.sha1(), 0
    for name_at, _type, _flags, _addr, offset, length in headers:
        if name(name_at).startswith(b".text"):
            sha.update(cubin[offset:offset + length])
            size += length
    if size == 0:
        raise ValueError("text_digest: the cubin has no .text section")
    return sha.hexdigest(), size


def digest(arch: str, name: str, kind: str) -> list[str]:
    """One line per cubin the compile of ``kind`` of engine ``name`` dumps."""
    with tempfile.TemporaryDirectory() as tmp:
        _python([arch, name, kind], Path(tmp))
        cubins = sorted(Path(tmp).rglob("*.cubin"))
        if not cubins:
            raise RuntimeError(f"{arch} {name} {kind}: the compile dumped no cubin")
        lines = []
        for path in cubins:
            match = re.search(r"([A-Z][A-Za-z0-9]*Kernel)", path.name)
            sha, size = text_digest(path.read_bytes())
            lines.append(f"{arch} {name} {kind} {match.group(1) if match else path.name} "
                         f"{sha} {size}")
        return lines


def jobs(archs=ARCHS) -> list[tuple[str, str, str]]:
    """(arch, engine or "wide-route", kernel kind) of every kernel in the set."""
    out = []
    for name in ENGINES:
        kinds = _python(["sm_90a", name, "?"]).split()
        out += [(arch, name, kind) for arch in archs for kind in kinds]
    return out + [(arch, "wide-route", "route") for arch in archs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the digest file to write")
    ap.add_argument("--arch", default=",".join(ARCHS), help="comma-separated targets")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    todo = jobs(tuple(args.arch.split(",")))
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        lines = [line for result in pool.map(lambda j: digest(*j), todo) for line in result]
    args.out.write_text("\n".join(sorted(lines)) + "\n")
    print(f"{len(lines)} kernels -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
