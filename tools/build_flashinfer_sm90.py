"""Build FlashInfer's SM90 CUTLASS MoE module ahead of time, reduced to the MXFP4 paths, on a
CPU machine (x86_64, pip access, no GPU, no system CUDA).

The FlashInfer SM90 MoE peer (``benchmarks/peers/flashinfer_sm90_moe.py``) runs FlashInfer
0.7.2.post1's ``cutlass_fused_moe`` with ``use_w4_group_scaling=True``: BF16 activations x
MXFP4 weights (W4A16) and, optionally, the "Humming" FP8-activation x MXFP4 path (W4A8,
``use_wfp4afp8_humming=True``). FlashInfer compiles that code on first use as its JIT module
``fused_moe_90`` (248 translation units for every data type, hours of nvcc); the GPU node
has no nvcc and no package index. This script builds the module here, keeping only what
the two MXFP4 paths can reach, and writes it in FlashInfer's AOT layout::

    <dest>/fused_moe_90/fused_moe_90.so
    <dest>/manifest.json          # bytes, SHA-256, FlashInfer version, kernels, toolchain

Usage (from the repository root)::

    python3 tools/build_flashinfer_sm90.py                 # W4A16 -> .gpu/peers/flashinfer_sm90/w4a16
    python3 tools/build_flashinfer_sm90.py --with-w4a8     # W4A16 + W4A8 -> .../w4a16_w4a8
    python3 tools/build_flashinfer_sm90.py --from-prebuilt fused_moe_90.so [--with-w4a8]
    python3 tools/build_flashinfer_sm90.py --only sources  # the pure-Python steps (needs step 2's output)

Steps (``--only`` runs one; each reads what the earlier ones left in ``--workdir``, default
``build/flashinfer_sm90``, git-ignored):

1. ``toolchain``: a venv (``<workdir>/venv``) with the exact versions of
   :data:`TOOLCHAIN` (FlashInfer without its dependencies, a CPU PyTorch for FlashInfer's
   ninja writer, CUDA 13.0 nvcc / crt / nvvm / runtime / nvrtc / cccl from NVIDIA's pip
   wheels), the two headers FlashInfer includes but the wheels above lack (``cublasLt.h``,
   ``curand_kernel.h`` and their siblings, from the cuBLAS and cuRAND wheels, headers only),
   and ``lib64`` links so that ``<nvidia/cu13>`` works as ``CUDA_HOME``;
2. ``ninja``: FlashInfer's own build file for ``fused_moe_90`` (``gen_cutlass_fused_moe_sm90_module(
   ).write_ninja()`` with ``FLASHINFER_CUDA_ARCH_LIST=9.0a``), which also writes the
   generated CUTLASS instantiations (:func:`flashinfer_paths`);
3. ``sources`` (pure Python): the mixed-input grouped-GEMM launchers of the kept paths
   taken out of FlashInfer's generated files and regrouped, 8 per translation unit
   (:func:`select_launchers`, :func:`write_launcher_units`); the reduced instantiation unit
   (:func:`instantiation_unit`) and, for W4A8, the Humming ``MoeGemmRunner`` unit; the
   reduced ``build.ninja`` (:func:`subset_ninja`): the 13 fixed units of :data:`FIXED_SOURCES`,
   the instantiation unit in place of FlashInfer's, the launcher units, the stubs, the link;
4. ``compile``: ``ninja objects`` (W4A16: 29 units, about 30 minutes on 2 cores; W4A8 adds
   17, its 16 launcher units and the Humming ``MoeGemmRunner`` unit, about 20 minutes more);
5. ``stubs``: every symbol the objects reference but nobody defines (the runners and
   launchers of the data types not built, reached only through dispatch code the MXFP4 paths
   never take) defined as a jump to a thrower: calling one raises a C++ ``std::runtime_error``
   naming this library, which reaches Python as a ``RuntimeError``
   (:func:`classify_undefined`, :func:`stubs_assembly`), and a link-time ``libcuda.so`` stub
   (the pip wheels ship none; the driver's own ``libcuda.so.1`` is used at run time);
6. ``link``: ``ninja`` links ``fused_moe_90.so`` (``DT_NEEDED``: ``libcudart.so.13``, the C
   and C++ runtimes; the ``tvm::ffi`` symbols resolve from ``libtvm_ffi.so``, which ``import
   tvm_ffi`` loads);
7. ``install``: copy it to ``<dest>/fused_moe_90/fused_moe_90.so`` and write the manifest
   (:func:`write_manifest`).

What is dropped: of the launchers FlashInfer generates for a kept data-type pair, those
with an M tile of 128 or more and the Pingpong mainloop (FlashInfer's SM90 candidate list,
``get_candidate_configs_sm90``, uses the cooperative mainloop for those; the small-K W4A8
launchers are kept whatever their tile). The runner's heuristic never selects one, but
FlashInfer's tuner does reach a left-out path while tuning W4A8 (on an H100: stubs that
aborted ended the process at the first W4A8 tuning), which is why a stub raises: the tuner
skips that tactic. Every other data type's runner is a stub that throws: the library serves ``cutlass_fused_moe`` for
``bfloat16`` activations and ``uint8`` MXFP4 weights with ``use_w4_group_scaling=True``
(and, with ``--with-w4a8``, ``use_wfp4afp8_humming=True``), nothing else.

``--from-prebuilt SO`` skips steps 1-6: it installs an existing library (one this script or
the same procedure built) with its manifest. The result is under 60 MiB either way (W4A16
about 11 MB, with W4A8 about 20 MB), so one carry to the GPU node takes it whole.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

FLASHINFER_VERSION = "0.7.2.post1"
MODULE = "fused_moe_90"
CUDA_ARCH_LIST = "9.0a"
LIBRARY_NAME = f"{MODULE}.so"
MANIFEST = "manifest.json"
CARRY_LIMIT_BYTES = 60 << 20
"""What one carry to the GPU node takes (``.gpu/peers`` chunks of at most 60 MiB)."""

TORCH_SPEC = "torch==2.13.0"
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
TOOLCHAIN = (
    "apache-tvm-ffi==0.1.15.post2",
    "nvidia-cuda-nvcc==13.0.88",
    "nvidia-cuda-crt==13.0.88",
    "nvidia-nvvm==13.0.88",
    "nvidia-cuda-runtime==13.0.96",
    "nvidia-cuda-nvrtc==13.0.88",
    "nvidia-cuda-cccl==13.0.85",
    "ninja==1.13.2",
    "einops==0.8.2",
    "click==8.5.1",
    "tabulate==0.10.0",
    "tqdm==4.70.1",
    "packaging==26.4",
    "requests==2.34.2",
    "nvidia-ml-py==13.615.71",
    "numpy==2.4.6",
)
"""What the venv holds besides PyTorch and FlashInfer (``pip install --no-deps
flashinfer-python==0.7.2.post1``): the versions the prebuilt libraries were built with."""
HEADER_WHEELS = ("nvidia-cublas==13.1.0.3", "nvidia-curand==10.4.0.35")
"""Wheels whose ``nvidia/cu13/include/*.h`` FlashInfer's sources include (headers only)."""

VARIANTS = {"w4a16": ("w4a16",), "w4a16_w4a8": ("w4a16", "w4a8")}
"""Variant name (the ``<dest>`` folder under ``.gpu/peers/flashinfer_sm90``) -> its paths."""

FIXED_SOURCES = (
    "moe_gemm/moe_gemm_tma_warp_specialized_input.cu",
    "moe_gemm/moe_gemm_kernels_bf16_fp4.cu",
    "moe_gemm/moe_gemm_mixed_utils.cu",
    "cutlass_backend/flashinfer_cutlass_fused_moe_binding.cu",
    "cutlass_backend/deepgemm_jit_setup.cu",
    "common/envUtils.cpp",
    "common/logger.cpp",
    "common/stringUtils.cpp",
    "common/tllmException.cpp",
    "common/memoryUtils.cu",
    "kernels/preQuantScaleKernel.cu",
    "cutlass_kernels/cutlass_heuristic.cpp",
    "lora/lora.cpp",
)
"""The units of FlashInfer's build file kept as they are (path endings): the SM90 TMA
input setup, the BF16 x FP4 ``MoeGemmRunner``, the weight interleave kernels, the binding,
the DeepGEMM JIT setup (referenced by the binding), the common utilities, the heuristic."""
INSTANTIATION_SOURCE = "cutlass_fused_moe_instantiation.cu"
"""FlashInfer's unit that instantiates every ``CutlassMoeFCRunner``: replaced."""
LAUNCHERS_PER_UNIT = 8


@dataclass(frozen=True)
class LauncherKind:
    """The generated launchers of one path: ``signature`` picks their explicit
    instantiations out of FlashInfer's ``*Mixed*.generated.cu`` files."""

    name: str
    signature: str
    keep_small_k: bool
    runner: str
    """The ``CutlassMoeFCRunner`` specialization the instantiation unit emits."""


KINDS = {
    "w4a16": LauncherKind("w4a16", "kernelLauncher<__nv_bfloat16, SafeFP4,", False,
                          "CutlassMoeFCRunner<__nv_bfloat16, Fp4Type>"),
    "w4a8": LauncherKind("w4a8", "kernelLauncher<__nv_fp8_e4m3, SafeFP4, __nv_bfloat16,", True,
                         "CutlassMoeFCRunner<__nv_fp8_e4m3, Fp4Type, __nv_bfloat16, __nv_bfloat16,\n"
                         "                                  __nv_bfloat16, false, "
                         "Sm90Wfp4Afp8ScaleMode::kHummingPreMmaE8M0>"),
}

HUMMING_RUNNER_UNIT = """\
// Reduced MoeGemmRunner unit: only the Humming FP8 x MXFP4 -> BF16 specialization
// (written by tools/build_flashinfer_sm90.py).
#include "moe_gemm_template_dispatch.h"
namespace tensorrt_llm::kernels::cutlass_kernels {
template class MoeGemmRunner<__nv_fp8_e4m3, Fp4Type, __nv_bfloat16, __nv_bfloat16, false,
                             Sm90Wfp4Afp8ScaleMode::kHummingPreMmaE8M0>;
}  // namespace tensorrt_llm::kernels::cutlass_kernels
"""

_LAUNCHER_HEAD = ('#include "tensorrt_llm/kernels/cutlass_kernels/moe_gemm/launchers/'
                  'moe_gemm_tma_ws_mixed_input_launcher.inl"\n'
                  "namespace tensorrt_llm\n{\nnamespace kernels\n{\nnamespace cutlass_kernels_oss\n{\n\n")
_LAUNCHER_TAIL = "\n} // namespace cutlass_kernels_oss\n} // namespace kernels\n} // namespace tensorrt_llm\n"
_INSTANTIATION_RE = re.compile(r"template void .*?workspace_size\);", re.S)
_TILE_M_RE = re.compile(r"cute::Shape<cute::Int<(\d+)>")


# --------------------------------------------------------------------------------------
# step 3 (pure Python): launchers, instantiation unit, reduced ninja file
# --------------------------------------------------------------------------------------

def launcher_instantiations(text: str) -> list[str]:
    """The explicit launcher instantiations (``template void ...workspace_size);``) of a
    generated unit's text, in order."""
    return _INSTANTIATION_RE.findall(text)


def tile_m(instantiation: str) -> int:
    """The M extent of an instantiation's CTA tile (the first ``cute::Shape``)."""
    found = _TILE_M_RE.search(instantiation)
    if found is None:
        raise ValueError(f"no CTA tile shape in {instantiation[:120]!r}")
    return int(found.group(1))


def never_selected(instantiation: str, kind: LauncherKind) -> bool:
    """Whether FlashInfer's SM90 heuristic can never pick this launcher: an M tile of 128 or
    more with the Pingpong mainloop (those tiles run cooperative); small-K W4A8 launchers
    are kept whatever their tile."""
    if kind.keep_small_k and "small_k_kernelLauncher" in instantiation:
        return False
    return tile_m(instantiation) >= 128 and "KernelTmaWarpSpecializedPingpong" in instantiation


def select_launchers(generated_dir: str | Path, kind: LauncherKind) -> tuple[list[str], int]:
    """``(kept instantiations, how many matched)``: the instantiations of ``kind`` in the
    ``*Mixed*.generated.cu`` files of FlashInfer's ``gemm_grouped/90`` directory (sorted by
    file name), minus the never-selected ones."""
    matched = []
    for path in sorted(glob.glob(os.path.join(str(generated_dir), "*Mixed*.generated.cu"))):
        with open(path) as f:
            matched += [b for b in launcher_instantiations(f.read()) if kind.signature in b]
    return [b for b in matched if not never_selected(b, kind)], len(matched)


def launcher_units(instantiations: list[str], per_unit: int = LAUNCHERS_PER_UNIT) -> list[str]:
    """The texts of the translation units holding ``instantiations``, ``per_unit`` each."""
    return [_LAUNCHER_HEAD + "\n\n".join(instantiations[i:i + per_unit]) + _LAUNCHER_TAIL
            for i in range(0, len(instantiations), per_unit)]


def write_launcher_units(instantiations: list[str], out_dir: str | Path, kind: LauncherKind) -> list[Path]:
    """Write :func:`launcher_units` as ``<out_dir>/<kind>_sm90_mixed_group<i>.generated.cu``
    (old ones of the kind removed first); returns the paths in order."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(f"{kind.name}_sm90_mixed_group*.generated.cu"):
        stale.unlink()
    paths = []
    for i, text in enumerate(launcher_units(instantiations)):
        path = out / f"{kind.name}_sm90_mixed_group{i}.generated.cu"
        path.write_text(text)
        paths.append(path)
    return paths


def instantiation_unit(kinds: tuple[str, ...]) -> str:
    """The reduced replacement of FlashInfer's instantiation unit: the runner of each kind
    and the BF16 finalize kernel launcher. One unit for all kinds:
    ``cutlass_fused_moe_kernels.cuh`` defines non-template functions, so two such units
    cannot be linked together."""
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"kinds must be a non-empty subset of {sorted(KINDS)}, got {kinds!r}")
    runners = "".join(f"template class {KINDS[k].runner};\n" for k in kinds)
    return ("// Reduced CutlassMoeFCRunner instantiations of FlashInfer " + FLASHINFER_VERSION
            + " (" + " + ".join(kinds) + "),\n// written by tools/build_flashinfer_sm90.py in place of "
            + INSTANTIATION_SOURCE + ".\n"
            '#include "cutlass_fused_moe_kernels.cuh"\n#include "moe_kernels.h"\n\n'
            "namespace tensorrt_llm::kernels::cutlass_kernels {\n" + runners
            + "INSTANTIATE_FINALIZE_MOE_ROUTING(__nv_bfloat16, __nv_bfloat16, __nv_bfloat16);\n"
            "}  // namespace tensorrt_llm::kernels::cutlass_kernels\n")


_BUILD_RE = re.compile(r"build (\S+): (compile|cuda_compile) (\S+)$")


def split_ninja(text: str) -> tuple[str, list[tuple[str, str, str]]]:
    """FlashInfer's ``build.ninja`` -> ``(head, [(object, rule, source), ...])``: the head is
    everything before the first ``build`` line (variables, flags, rules)."""
    if "\nbuild " not in text:
        raise ValueError("no build statement in the ninja file")
    head, rest = text.split("\nbuild ", 1)
    units = []
    for line in ("build " + rest).splitlines():
        m = _BUILD_RE.match(line)
        if m:
            units.append(m.groups())
    return head, units


def add_include(head: str, directory: str, before: str) -> str:
    """``head`` with ``-I<directory>`` inserted in ``common_cflags`` just before the
    ``-I<before>`` line (once)."""
    anchor = f"$\n    -I{before} $"
    if anchor not in head:
        raise ValueError(f"no '-I{before}' line in the ninja file's flags")
    return head.replace(anchor, f"$\n    -I{directory} $\n    -I{before} $", 1)


@dataclass
class Unit:
    """One object of the reduced build: rule ``compile`` (host) or ``cuda_compile``."""

    obj: str
    rule: str
    source: str
    extra_include: str | None = None


def subset_ninja(full_text: str, csrc: str, obj_dir: str, library: str, launcher_sources: list[str],
                 instantiation: str, extra_units: list[Unit] = (), *,
                 instantiation_include: str | None = None) -> tuple[str, list[Unit]]:
    """The reduced ``build.ninja`` and its units.

    Args:
        full_text: FlashInfer's own build file for ``fused_moe_90`` (step 2).
        csrc: FlashInfer's ``data/csrc`` directory (whose ``fused_moe/cutlass_backend`` is
            added to the include path, for the instantiation unit that lives outside it).
        obj_dir: where the objects go.
        library: the output ``.so`` path.
        launcher_sources: the regrouped launcher units.
        instantiation: the reduced instantiation unit (replaces FlashInfer's).
        extra_units: more units (the W4A8 runner unit), with their own include directory.
        instantiation_include: an include directory for the instantiation unit alone.

    Returns:
        ``(text, units)``: the file (phony target ``objects``: every unit; ``default``: the
        library, linked from the units and ``<obj_dir>/stubs.o``) and the units in order.

    Raises:
        ValueError: a unit of :data:`FIXED_SOURCES` or the instantiation unit is not in
            FlashInfer's file (another FlashInfer version).
    """
    head, units = split_ninja(full_text)
    head = add_include(head, f"{csrc}/fused_moe/cutlass_backend", f"{csrc}/nv_internal")
    kept, found = [], set()
    for obj, rule, src in units:
        fixed = next((k for k in FIXED_SOURCES if src.endswith(k)), None)
        if src.endswith(INSTANTIATION_SOURCE):
            kept.append(Unit(f"{obj_dir}/{os.path.basename(obj)}", rule, instantiation, instantiation_include))
            found.add(INSTANTIATION_SOURCE)
        elif fixed is not None:
            kept.append(Unit(f"{obj_dir}/{os.path.basename(obj)}", rule, src))
            found.add(fixed)
    missing = [k for k in (*FIXED_SOURCES, INSTANTIATION_SOURCE) if k not in found]
    if missing:
        raise ValueError(f"FlashInfer's build file lacks {missing} (not FlashInfer {FLASHINFER_VERSION}?)")
    for src in launcher_sources:
        kept.append(Unit(f"{obj_dir}/{Path(src).name[:-len('.cu')]}.cuda.o", "cuda_compile", str(src)))
    kept += list(extra_units)
    lines = []
    for u in kept:
        lines.append(f"build {u.obj}: {u.rule} {u.source}")
        if u.extra_include:
            flags = "cuda_cflags" if u.rule == "cuda_compile" else "cflags"
            lines.append(f"  {flags} = -I{u.extra_include} ${flags}")
    objs = " ".join(u.obj for u in kept)
    lines += [f"build objects: phony {objs}",
              f"build {obj_dir}/stubs.o: compile {obj_dir}/stubs.S",
              f"build {library}: link {objs} {obj_dir}/stubs.o",
              f"default {library}"]
    return head + "\n" + "\n".join(lines) + "\n", kept


# --------------------------------------------------------------------------------------
# step 5 (pure Python given nm's output): the stubs
# --------------------------------------------------------------------------------------

def parse_nm(lines) -> tuple[set[str], set[str]]:
    """``(defined, undefined)`` symbol names of ``nm`` output lines (``U name`` or ``addr
    type name``)."""
    defined, undefined = set(), set()
    for line in lines:
        parts = line.split()
        if len(parts) == 2 and parts[0] == "U":
            undefined.add(parts[1])
        elif len(parts) == 3 and parts[1] != "U":
            defined.add(parts[2])
    return defined, undefined


def classify_undefined(undefined: set[str], defined: set[str], provided: set[str]
                       ) -> tuple[list[str], list[str], list[str]]:
    """What the objects reference and neither they nor the run-time libraries (``provided``)
    define: ``(driver, stubbed, left)``, each sorted. ``driver``: CUDA driver API names
    (``cu`` + capital; the link-time ``libcuda.so`` stub); ``stubbed``: mangled
    ``tensorrt_llm`` names (the code of the paths not built); ``left``: everything else,
    for the linker to report."""
    missing = sorted(undefined - defined - provided)
    driver = [s for s in missing if re.match(r"cu[A-Z]", s)]
    stubbed = [s for s in missing if s not in driver and s.startswith("_Z") and "tensorrt_llm" in s]
    left = [s for s in missing if s not in driver and s not in stubbed]
    return driver, stubbed, left


def stubs_assembly(symbols: list[str], kinds: tuple[str, ...]) -> str:
    """x86_64 assembly defining each of ``symbols`` as a jump to libstdc++'s
    ``std::__throw_runtime_error`` with the message ``fused_moe_90 (reduced build: ...):
    called a kernel or runner that was not compiled into this library``: a C++ exception,
    which FlashInfer's FFI boundary turns into a Python ``RuntimeError`` (its autotuner then
    skips that tactic) instead of ending the process. The stubs only jump (no frame of their
    own), so the thrower unwinds straight into the caller."""
    message = (f"{MODULE} (reduced build: {' + '.join(kinds)}): called a kernel or runner that was "
               "not compiled into this library")
    out = ["\t.section .rodata", ".Lmsg:", f'\t.asciz "{message}"', "\t.text", ".Lfail:",
           "\tleaq .Lmsg(%rip), %rdi", "\tjmp _ZSt21__throw_runtime_errorPKc@PLT"]
    for s in symbols:
        out += [f"\t.globl {s}", f"\t.type {s}, @function", f"{s}:", "\tjmp .Lfail"]
    out.append('\t.section .note.GNU-stack,"",@progbits')
    return "\n".join(out) + "\n"


def driver_stub_source(symbols: list[str]) -> str:
    """C source of the link-time ``libcuda.so`` stub: each driver function returns 999
    (never called: the driver's ``libcuda.so.1`` is loaded at run time)."""
    return "".join(f"int {s}(void) {{ return 999; }}\n" for s in symbols)


# --------------------------------------------------------------------------------------
# install and manifest
# --------------------------------------------------------------------------------------

def sha256(path: str | Path) -> str:
    """The SHA-256 of the file at ``path``, hex."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def dynamic_needs(path: str | Path) -> list[str] | None:
    """The library's ``DT_NEEDED`` entries (``readelf -d``), None without readelf."""
    try:
        done = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", done.stdout)


def variant_of(kinds: tuple[str, ...]) -> str:
    for name, value in VARIANTS.items():
        if value == tuple(kinds):
            return name
    raise ValueError(f"no variant holds exactly {kinds!r}; variants: {VARIANTS}")


def write_manifest(dest: str | Path, library: str | Path, kinds: tuple[str, ...], *, source: str,
                   launchers: dict | None = None, stubbed: int | None = None) -> dict:
    """Copy ``library`` to ``<dest>/fused_moe_90/fused_moe_90.so`` and write
    ``<dest>/manifest.json``; returns the manifest.

    Raises:
        ValueError: the library is larger than one carry (:data:`CARRY_LIMIT_BYTES`).
    """
    dest = Path(dest)
    size = os.path.getsize(library)
    if size > CARRY_LIMIT_BYTES:
        raise ValueError(f"{library}: {size} B is more than one carry ({CARRY_LIMIT_BYTES} B)")
    target = dest / MODULE / LIBRARY_NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    if Path(library).resolve() != target.resolve():
        shutil.copyfile(library, target)
    os.chmod(target, 0o755)
    manifest = {
        "flashinfer": FLASHINFER_VERSION,
        "module": MODULE,
        "arch": "sm_90a",
        "variant": variant_of(kinds),
        "kernels": list(kinds),
        "file": f"{MODULE}/{LIBRARY_NAME}",
        "bytes": size,
        "sha256": sha256(target),
        "needed": dynamic_needs(target),
        "source": source,
        "launchers": launchers,
        "stubbed_symbols": stubbed,
        "toolchain": {"torch": TORCH_SPEC, "pip": list(TOOLCHAIN), "headers_from": list(HEADER_WHEELS)},
        "written": datetime.date.today().isoformat(),
    }
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


# --------------------------------------------------------------------------------------
# steps 1, 2, 4-6 (the toolchain, FlashInfer's ninja writer, nvcc)
# --------------------------------------------------------------------------------------

def _run(cmd, **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def site_packages(venv: Path) -> Path:
    out = subprocess.run([str(venv_python(venv)), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def cuda_home(venv: Path) -> Path:
    """``<site-packages>/nvidia/cu13``: where the CUDA 13 wheels install (used as ``CUDA_HOME``)."""
    return site_packages(venv) / "nvidia" / "cu13"


def toolchain_commands(venv: Path, python: str, torch_spec: str = TORCH_SPEC,
                       torch_index: str | None = TORCH_INDEX) -> list[list[str]]:
    """The commands of step 1 before the headers: the venv, PyTorch (CPU), FlashInfer without
    its dependencies, :data:`TOOLCHAIN`."""
    pip = [str(venv_python(venv)), "-m", "pip", "install", "--quiet"]
    torch_cmd = pip + [torch_spec] + (["--index-url", torch_index] if torch_index else [])
    return [[python, "-m", "venv", str(venv)], torch_cmd,
            pip + ["--no-deps", f"flashinfer-python=={FLASHINFER_VERSION}"], pip + list(TOOLCHAIN)]


def step_toolchain(work: Path, venv: Path, python: str, torch_spec: str, torch_index: str | None) -> None:
    if not venv_python(venv).exists():
        for cmd in toolchain_commands(venv, python, torch_spec, torch_index):
            _run(cmd)
    cuda = cuda_home(venv)
    wheels = work / "header_wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    _run([venv_python(venv), "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
          "-d", wheels, *HEADER_WHEELS])
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as z:
            for member in z.namelist():
                if member.startswith("nvidia/cu13/include/") and member.endswith(".h"):
                    target = cuda / "include" / member[len("nvidia/cu13/include/"):]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(z.read(member))
    lib64 = cuda / "lib64"
    (lib64 / "stubs").mkdir(parents=True, exist_ok=True)
    for name, real in (("libcudart.so", "libcudart.so.13"), ("libnvrtc.so", "libnvrtc.so.13")):
        link = lib64 / name
        if not link.exists():
            link.symlink_to(Path("..") / "lib" / real)


def build_env(work: Path, venv: Path) -> dict:
    env = dict(os.environ)
    env.update(CUDA_HOME=str(cuda_home(venv)), FLASHINFER_CUDA_ARCH_LIST=CUDA_ARCH_LIST,
               FLASHINFER_WORKSPACE_BASE=str(work / "flashinfer_workspace"))
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


_PATHS_SCRIPT = """
import json, flashinfer
from flashinfer.jit import env as jit_env
from flashinfer.jit import fused_moe as fm
spec = fm.gen_cutlass_fused_moe_sm90_module()
spec.write_ninja()
print(json.dumps({"version": flashinfer.__version__, "ninja": str(spec.ninja_path),
                  "csrc": str(jit_env.FLASHINFER_CSRC_DIR),
                  "generated": str(jit_env.FLASHINFER_GEN_SRC_DIR / "cutlass_instantiations" / "90"
                                   / "gemm_grouped" / "90"),
                  "tvm_ffi_lib": __import__("tvm_ffi").__path__[0] + "/lib/libtvm_ffi.so"}))
"""


def flashinfer_paths(work: Path, venv: Path) -> dict:
    """Step 2: FlashInfer writes its build file (and the generated instantiations); returns
    ``{"version", "ninja", "csrc", "generated", "tvm_ffi_lib"}`` (also kept in
    ``<work>/flashinfer_paths.json``)."""
    try:
        done = _run([venv_python(venv), "-c", _PATHS_SCRIPT], env=build_env(work, venv),
                    capture_output=True, text=True)
    except subprocess.CalledProcessError as e:
        print(e.stdout, e.stderr, sep="\n", file=sys.stderr)
        raise
    paths = json.loads(done.stdout.strip().splitlines()[-1])
    if paths["version"] != FLASHINFER_VERSION:
        raise RuntimeError(f"the venv has FlashInfer {paths['version']}, not {FLASHINFER_VERSION}")
    (work / "flashinfer_paths.json").write_text(json.dumps(paths, indent=1))
    return paths


def step_sources(work: Path, kinds: tuple[str, ...], paths: dict) -> dict:
    """Step 3: the launcher units, the instantiation unit(s), ``<work>/build.ninja``;
    returns ``{kind: {"generated": n, "kept": m, "units": k}}``."""
    src = work / "src"
    src.mkdir(parents=True, exist_ok=True)
    launcher_sources, counts = [], {}
    for k in kinds:
        kept, matched = select_launchers(paths["generated"], KINDS[k])
        if not kept:
            raise RuntimeError(f"no {k} launchers in {paths['generated']}")
        units = write_launcher_units(kept, src, KINDS[k])
        launcher_sources += [str(u) for u in units]
        counts[k] = {"generated": matched, "kept": len(kept), "units": len(units)}
        print(f"{k}: {matched} launchers generated, {len(kept)} kept, {len(units)} units", flush=True)
    inst = src / "cutlass_fused_moe_instantiation_reduced.cu"
    inst.write_text(instantiation_unit(kinds))
    obj = work / "obj"
    extra, moe_gemm = [], f"{paths['csrc']}/nv_internal/tensorrt_llm/kernels/cutlass_kernels/moe_gemm"
    if "w4a8" in kinds:
        humming = src / "moe_gemm_kernels_fp8_fp4_humming_bf16.cu"
        humming.write_text(HUMMING_RUNNER_UNIT)
        extra.append(Unit(f"{obj}/moe_gemm_kernels_fp8_fp4_humming_bf16.cuda.o", "cuda_compile", str(humming),
                          extra_include=moe_gemm))
    # the combined instantiation unit reaches the Humming dispatch header too
    text, units = subset_ninja(Path(paths["ninja"]).read_text(), paths["csrc"], str(obj),
                               str(work / LIBRARY_NAME), launcher_sources, str(inst), extra,
                               instantiation_include=moe_gemm if "w4a8" in kinds else None)
    (work / "build.ninja").write_text(text)
    (work / "launchers.json").write_text(json.dumps(counts, indent=1))
    print(f"{len(units)} units -> {work / 'build.ninja'}", flush=True)
    return counts


def system_library(name: str) -> Path | None:
    """A run-time library's file (``c++ -print-file-name``, else ``ldconfig -p``)."""
    try:
        out = subprocess.run(["c++", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
        if os.path.isabs(out) and os.path.exists(out):
            return Path(os.path.realpath(out))
        listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    except OSError:
        return None
    m = re.search(rf"\s{re.escape(name)} \(.*?\) => (\S+)", listing)
    return Path(os.path.realpath(m.group(1))) if m else None


def _nm(args: list[str], path) -> list[str]:
    return subprocess.run(["nm", *args, str(path)], capture_output=True, text=True, check=True).stdout.splitlines()


def step_stubs(work: Path, venv: Path, kinds: tuple[str, ...], paths: dict) -> int:
    """Step 5: ``<work>/obj/stubs.S`` and the ``libcuda.so`` stub; returns how many symbols
    are stubbed (their names in ``<work>/stubbed_symbols.txt``)."""
    objs = [p for p in sorted((work / "obj").glob("*.o")) if p.name != "stubs.o"]
    defined, undefined = set(), set()
    for o in objs:
        d, u = parse_nm(_nm([], o))
        defined |= d
        undefined |= u
    cuda = cuda_home(venv)
    libs = [cuda / "lib" / "libcudart.so.13", cuda / "lib" / "libnvrtc.so.13", Path(paths["tvm_ffi_lib"])]
    libs += [p for p in (system_library(n) for n in ("libc.so.6", "libm.so.6", "libstdc++.so.6", "libgcc_s.so.1"))
             if p is not None]
    provided = set()
    for lib in libs:
        for line in _nm(["-D", "--defined-only"], lib):
            parts = line.split()
            if len(parts) == 3:
                provided.add(parts[2].split("@")[0])
    driver, stubbed, left = classify_undefined(undefined, defined, provided)
    if left:
        print("left to the linker:", " ".join(left), flush=True)
    (work / "obj" / "stubs.S").write_text(stubs_assembly(stubbed, kinds))
    (work / "stubbed_symbols.txt").write_text("\n".join(stubbed) + "\n")
    stub_dir = cuda / "lib64" / "stubs"
    stub_dir.mkdir(parents=True, exist_ok=True)
    (work / "cuda_stub.c").write_text(driver_stub_source(driver))
    _run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", stub_dir / "libcuda.so", work / "cuda_stub.c"])
    print(f"{len(stubbed)} symbols stubbed; driver functions: {' '.join(driver)}", flush=True)
    return len(stubbed)


def main(argv=None) -> int:
    repo = Path(__file__).resolve().parents[1]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--with-w4a8", action="store_true", help="also the Humming W4A8 path (variant w4a16_w4a8)")
    ap.add_argument("--workdir", type=Path, default=repo / "build" / "flashinfer_sm90")
    ap.add_argument("--dest", type=Path, help="default .gpu/peers/flashinfer_sm90/<variant>")
    ap.add_argument("--venv", type=Path, help="default <workdir>/venv")
    ap.add_argument("--python", default=sys.executable, help="the interpreter the venv is made from")
    ap.add_argument("--torch", default=TORCH_SPEC, help="PyTorch for FlashInfer's ninja writer (spec or wheel)")
    ap.add_argument("--torch-index", default=TORCH_INDEX, help="'' for the default index")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                    help="parallel nvcc jobs (each takes 4-8 GB of memory)")
    ap.add_argument("--only", choices=("toolchain", "ninja", "sources", "compile", "stubs", "link", "install"))
    ap.add_argument("--from-prebuilt", type=Path, metavar="SO",
                    help="install this library with its manifest instead of building")
    args = ap.parse_args(argv)
    kinds = VARIANTS["w4a16_w4a8" if args.with_w4a8 else "w4a16"]
    dest = args.dest or repo / ".gpu" / "peers" / "flashinfer_sm90" / variant_of(kinds)
    if args.from_prebuilt:
        manifest = write_manifest(dest, args.from_prebuilt, kinds, source=f"prebuilt {args.from_prebuilt.name}")
        print(json.dumps(manifest, indent=1))
        return 0
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    venv = (args.venv or work / "venv").resolve()
    steps = ("toolchain", "ninja", "sources", "compile", "stubs", "link", "install")
    todo = steps if args.only is None else (args.only,)
    paths_file = work / "flashinfer_paths.json"
    paths = json.loads(paths_file.read_text()) if paths_file.exists() else None
    ninja = [venv / "bin" / "ninja", "-C", work, "-f", "build.ninja", "-j", str(args.jobs)]
    for step in todo:
        if step == "toolchain":
            step_toolchain(work, venv, args.python, args.torch, args.torch_index or None)
        elif step == "ninja":
            paths = flashinfer_paths(work, venv)
        elif paths is None:
            raise SystemExit(f"step {step} needs step 'ninja' first ({paths_file} is missing)")
        elif step == "sources":
            step_sources(work, kinds, paths)
        elif step == "compile":
            _run(ninja + ["objects"], env=build_env(work, venv))
        elif step == "stubs":
            step_stubs(work, venv, kinds, paths)
        elif step == "link":
            _run(ninja, env=build_env(work, venv))
        elif step == "install":
            launchers = json.loads((work / "launchers.json").read_text())
            stubbed = len((work / "stubbed_symbols.txt").read_text().split())
            manifest = write_manifest(dest, work / LIBRARY_NAME, kinds, source=f"built by {Path(__file__).name}",
                                      launchers=launchers, stubbed=stubbed)
            print(json.dumps(manifest, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
