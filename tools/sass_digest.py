"""Digests of the machine code (SASS) the fast kernels compile to, without a GPU.

A change that leaves every kernel's SASS byte for byte the same (a module split, a rename,
a comment, a refactor of the host code) leaves every GPU result of the kernels standing.
This tool proves that on a CPU: it compiles each kernel of a fixed set with CuTe DSL's
cubin dump, for sm_90a and sm_100a, and prints one line per kernel with the SHA-1 of its
``.text`` sections (the SASS; the symbol names, which carry the Python module path, and
the debug sections are left out). The set (``SETS``): the stage kernels at the real widths
(``fast.backend.KERNELS``), the experts engine at five geometries and tactics
(``ENGINES``; the warpgroup-MMA ones for sm_90a only), the DEP16 and TP8 schedules' own
kernels for virtual and real ranks, every ``fast.gemm`` shape a ``DenseFront``
compiles by default and every chunked ``fast.gemm`` shape a TP8 wide rank compiles in its
batch-invariant mode (``fast.schedules.wide_gemms``; not the Blackwell block-scaled experts
kernel of ``fast.experts.blackwell``)::

    python tools/sass_digest.py before.txt          # on the old tree (--only experts,...)
    python tools/sass_digest.py after.txt           # on the new one
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
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a file (python tools/sass_digest.py): the repository first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.ptx_dump import elf_sections, run_compile  # noqa: E402

ARCHS = ("sm_90a", "sm_100a")

#: experts engine name -> (geometry: "dep16" or "tp8", windows, strict, empty_rows, tactic)
ENGINES = {
    "dep16-fused-w1": ("dep16", 1, False, True, {"fused": 1, "pdl_chain": 1}),
    "dep16-two-w4-strict": ("dep16", 4, True, True, {"fused": 0, "pdl_chain": 0}),
    "tp8-walk4-w2": ("tp8", 2, False, False, {"walk": 4}),
    # the sm_90a defaults at four windows (ExpertsEngine.default_tactic): warpgroup MMA
    "dep16-wgmma8-fused-w4": ("dep16", 4, False, True,
                              {"wgmma": 1, "warps": 8, "mtiles": 2, "fused": 1, "pdl_chain": 1}),
    "tp8-wgmma8-walk7-w4": ("tp8", 4, False, False, {"wgmma": 1, "warps": 8, "mtiles": 2,
                                                     "walk": 7}),
}
#: every kernel set: (family, name); a set's kernels are listed by its "?" compile
SETS = ([("stage", "real")] + [("experts", name) for name in ENGINES]
        + [("dep", "dep16"), ("dep", "dep16-peers"), ("wide", "tp8"), ("wide", "tp8-peers"),
           ("gemm", "dense-auto"), ("gemm", "wide-tp8-invariant")])

_COMPILE = """
import sys
from model.config import LatentMoEConfig

c = LatentMoEConfig.kimi_k3()
arch, family, name, kind = sys.argv[1:5]
if family == "stage":  # the stage kernels at the real widths
    from fast import backend
    kinds = list(backend.KERNELS)
    build = lambda k: backend.compile_for_target(k, arch)
elif family in ("dep", "wide"):  # a schedule's own kernels, DEP16 / TP8, virtual or peers
    from fast.schedules import dep, wide
    module, ranks = (dep, 16) if family == "dep" else (wide, 8)
    params = module.kernel_params(c, ranks, peers=name.endswith("-peers"))
    kinds = list(params)
    build = lambda k: module.compiled_kernel(k, arch, params[k])
elif family == "gemm":  # the fast.gemm shapes of a DenseFront / of a TP8 wide rank
    from fast.gemm.host import compile_kernel
    from fast.schedules import dense, wide_gemms
    if name == "dense-auto":  # every shape a DenseFront compiles by default
        shapes = [p for p in dense.fast_kernel_params(c, "auto")
                  if arch == "sm_90a" or not p.get("wgmma")]
    else:  # every chunked shape of the wide layer's batch-invariant mode at TP8
        shapes = wide_gemms.kernel_params(c, 8, range(c.front_max + 1, c.wide_rows + 1))
    kinds = [str(i) for i in range(len(shapes))]
    build = lambda k: compile_kernel(arch, **shapes[int(k)])
else:  # the experts engine
    from fast.experts import engine
    from fast.experts.layout import Geometry
    geometry, windows, strict, empty_rows, tactic = {engines}[name]
    g = (Geometry(latent=c.latent, inter=c.intermediate, first=0, count=56, shard=(0, 1))
         if geometry == "dep16" else
         Geometry(latent=c.latent, inter=c.intermediate // 8, first=0, count=896,
                  shard=(0, 8)))
    params = (dict() if tactic.get("wgmma") and arch != "sm_90a" else  # wgmma: Hopper only
              engine.kernel_params(g, c, windows, False, strict,
                                    engine.complete_tactic(tactic, arch), empty_rows=empty_rows))
    kinds = list(params)
    build = lambda k: engine.compiled_kernel(k, arch, params[k])
if kind == "?":
    print(" ".join(kinds))
elif kind == "?params":  # every kernel's parameters (the experts engine's, for sass_budget)
    print(repr(params))
else:
    build(kind)
"""


def compile_set(args, dump_dir: Path | None = None, engines: dict | None = None) -> str:
    """Run ``_COMPILE`` with ``args``; with ``dump_dir``, the cubins dumped there;
    ``engines``: the experts engine specs (name -> as ``ENGINES``), default ``ENGINES``."""
    return run_compile(_COMPILE.format(engines=ENGINES if engines is None else engines), args,
                       keep=None if dump_dir is None else "cubin", dump_dir=dump_dir)


def text_digest(cubin: bytes) -> tuple[str, int]:
    """SHA-1 (hex) and total size of the ``.text*`` sections of an ELF64 cubin."""
    sha, size = hashlib.sha1(), 0
    for name, data in elf_sections(cubin).items():
        if name.startswith(b".text"):
            sha.update(data)
            size += len(data)
    if size == 0:
        raise ValueError("text_digest: the cubin has no .text section")
    return sha.hexdigest(), size


def digest(arch: str, family: str, name: str, kind: str) -> list[str]:
    """One line per cubin the compile of kernel ``kind`` of set ``(family, name)`` dumps."""
    with tempfile.TemporaryDirectory() as tmp:
        compile_set([arch, family, name, kind], Path(tmp))
        cubins = sorted(Path(tmp).rglob("*.cubin"))
        if not cubins:
            raise RuntimeError(f"{arch} {family} {name} {kind}: the compile dumped no cubin")
        lines = []
        for path in cubins:
            match = re.search(r"([A-Z][A-Za-z0-9]*Kernel)", path.name)
            sha, size = text_digest(path.read_bytes())
            lines.append(f"{arch} {family}:{name} {kind} {match.group(1) if match else path.name} "
                         f"{sha} {size}")
        return lines


def parse_lines(lines) -> dict[str, tuple[str, str]]:
    """``{"<arch> <family>:<set> <kind> <Class>": (sha1, bytes)}`` of digest lines (this
    tool's output format; blank lines ignored); raises ValueError on a line of another
    shape."""
    out = {}
    for line in lines:
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 6:
            raise ValueError(f"not a sass_digest line: {line!r}")
        out[" ".join(fields[:4])] = (fields[4], fields[5])
    return out


def compare_digests(old: dict[str, tuple[str, str]],
                    new: dict[str, tuple[str, str]]) -> dict[str, str]:
    """The kernels whose digest differs between two :func:`parse_lines` results, each
    ``"changed"``, ``"gone"`` (only in ``old``) or ``"new"`` (only in ``new``)."""
    return {key: "new" if key not in old else "gone" if key not in new else "changed"
            for key in set(old) | set(new) if old.get(key) != new.get(key)}


def kinds(arch: str, family: str, name: str) -> list[tuple[str, str, str, str]]:
    """(arch, family, name, kernel kind) of every kernel of one set."""
    return [(arch, family, name, kind) for kind in compile_set([arch, family, name, "?"]).split()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the digest file to write")
    ap.add_argument("--arch", default=",".join(ARCHS), help="comma-separated targets")
    ap.add_argument("--only", default="", help="comma-separated families (" +
                    ", ".join(sorted({f for f, _ in SETS})) + "); default: all")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    only = set(filter(None, args.only.split(",")))
    sets = [(arch, *s) for s in SETS if not only or s[0] in only for arch in args.arch.split(",")]
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        todo = [job for listed in pool.map(lambda s: kinds(*s), sets) for job in listed]
        lines = [line for result in pool.map(lambda j: digest(*j), todo) for line in result]
    args.out.write_text("\n".join(sorted(lines)) + "\n")
    print(f"{len(lines)} kernels -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
