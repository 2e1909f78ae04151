"""Fetch the prebuilt Marlin MoE extension for the Marlin peer (``benchmarks/peers/marlin_moe``).

Run on a machine with pip access (not the GPU node, which has no package index)::

    python3 -m benchmarks.peers.fetch_marlin            # -> .gpu/peers/marlin/

It runs ``pip download --no-deps vllm==0.26.0`` (the newest vLLM whose wheel pins
``torch==2.11.0``, the GPU node's torch; CUDA 13 build, about 304 MB), takes out only the
two libtorch-stable-ABI extensions the peer loads, and writes them under ``--dest``:

* ``_moe_C_stable_libtorch.abi3.so`` (47,511,952 B, 45.3 MiB; required): ops
  ``_moe_C::moe_align_block_size``, ``_moe_C::moe_wna16_marlin_gemm``, ``_moe_C::moe_sum``;
* ``_C_stable_libtorch.abi3.so`` (78,831,048 B, 75.2 MiB; optional, the "full" set): ops
  ``_C::gptq_marlin_repack`` and ``_C::silu_and_mul``. It is larger than one device call
  may carry (64 MiB), so it is stored as parts ``<name>.part0``, ``<name>.part1``, ... of
  at most ``--part-mib`` (60) MiB each, never whole;
* ``manifest.json``: each file's size and SHA-256 and its parts' names.

Both link ``libtorch.so``, ``libtorch_cpu.so``, ``libtorch_cuda.so``, ``libcudart.so.13``
and ``libcuda.so.1`` only (no ``libc10*``: the stable ABI), so a torch 2.11 CUDA 13 build
provides everything they need. ``marlin_moe.load_ops`` joins the parts by itself (checking
the SHA-256) when the whole file is missing; by hand on the node::

    cat .gpu/peers/marlin/_C_stable_libtorch.abi3.so.part* > .gpu/peers/marlin/_C_stable_libtorch.abi3.so

The wheel itself is downloaded to a temporary directory and deleted; nothing here goes into
git (``.gpu/`` is ignored).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile

WHEEL_SPEC = "vllm==0.26.0"
WHEEL_TORCH_PIN = "torch==2.11.0"
MOE_LIB = "_moe_C_stable_libtorch.abi3.so"
C_LIB = "_C_stable_libtorch.abi3.so"
MEMBERS = {MOE_LIB: "vllm/" + MOE_LIB, C_LIB: "vllm/" + C_LIB}
"""Library name -> its path inside the wheel."""
SPLIT = (C_LIB,)
"""Libraries stored only as parts (each larger than one call's carry)."""
PART_MIB = 60
MANIFEST = "manifest.json"

__all__ = ["WHEEL_SPEC", "MOE_LIB", "C_LIB", "MANIFEST", "default_dest", "sha256", "split_file",
           "part_names", "join_parts", "extract", "fetch", "main"]


def default_dest() -> str:
    """``<repo>/.gpu/peers/marlin``."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.join(repo, ".gpu", "peers", "marlin")


def sha256(path: str) -> str:
    """The SHA-256 of the file at ``path``, hex."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def part_names(path: str, count: int) -> list[str]:
    """``[path.part0, path.part1, ...]`` (``count`` names; single-digit suffixes sort right up
    to 10 parts, which ``split_file`` never exceeds for these files)."""
    return [f"{path}.part{i}" for i in range(count)]


def split_file(path: str, part_bytes: int = PART_MIB << 20, *, remove: bool = True) -> list[str]:
    """Write ``path`` as consecutive parts of at most ``part_bytes`` bytes (``path.partN``),
    remove ``path`` if ``remove``; returns the part paths in order.

    Raises:
        ValueError: ``part_bytes`` < 1, or more than 10 parts would be needed.
    """
    if part_bytes < 1:
        raise ValueError(f"part_bytes must be >= 1, got {part_bytes}")
    size = os.path.getsize(path)
    count = max(1, -(-size // part_bytes))
    if count > 10:
        raise ValueError(f"{path}: {size} B would need {count} parts of {part_bytes} B (at most 10)")
    parts = part_names(path, count)
    with open(path, "rb") as src:
        for name in parts:
            with open(name, "wb") as dst:
                dst.write(src.read(part_bytes))
    if remove:
        os.remove(path)
    return parts


def join_parts(path: str, expect_sha256: str | None = None) -> str:
    """Reassemble ``path`` from ``path.part0, path.part1, ...`` (consecutive, from 0), via a
    temporary file renamed into place; check the SHA-256 if given. Returns ``path``.

    Raises:
        FileNotFoundError: no ``path.part0``.
        ValueError: the joined file's SHA-256 differs (the temporary file is removed).
    """
    parts = []
    while os.path.exists(f"{path}.part{len(parts)}"):
        parts.append(f"{path}.part{len(parts)}")
    if not parts:
        raise FileNotFoundError(f"neither {path} nor {path}.part0 exists")
    tmp = f"{path}.joining"
    h = hashlib.sha256()
    with open(tmp, "wb") as dst:
        for name in parts:
            with open(name, "rb") as src:
                for block in iter(lambda: src.read(1 << 20), b""):
                    h.update(block)
                    dst.write(block)
    if expect_sha256 is not None and h.hexdigest() != expect_sha256:
        os.remove(tmp)
        raise ValueError(f"{path}: joined {len(parts)} parts have SHA-256 {h.hexdigest()}, "
                         f"the manifest says {expect_sha256}")
    os.replace(tmp, path)
    return path


def extract(wheel: str, dest: str, *, libs=(MOE_LIB, C_LIB), part_bytes: int = PART_MIB << 20) -> dict:
    """Take ``libs`` out of the wheel into ``dest``, split those in ``SPLIT``, write and return
    the manifest ``{"wheel": ..., "files": {name: {"bytes", "sha256", "parts"}}}``."""
    os.makedirs(dest, exist_ok=True)
    manifest = {"wheel": os.path.basename(wheel), "torch_pin": WHEEL_TORCH_PIN, "files": {}}
    with zipfile.ZipFile(wheel) as z:
        for name in libs:
            out = os.path.join(dest, name)
            with z.open(MEMBERS[name]) as src, open(out, "wb") as dst:
                while block := src.read(1 << 20):
                    dst.write(block)
            os.chmod(out, 0o755)
            entry = {"bytes": os.path.getsize(out), "sha256": sha256(out), "parts": []}
            if name in SPLIT:
                for stale in part_names(out, 10):
                    if os.path.exists(stale):
                        os.remove(stale)
                entry["parts"] = [os.path.basename(p) for p in split_file(out, part_bytes)]
            manifest["files"][name] = entry
    with open(os.path.join(dest, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def fetch(dest: str, *, libs=(MOE_LIB, C_LIB), part_bytes: int = PART_MIB << 20) -> dict:
    """``pip download --no-deps`` the wheel into a temporary directory, then :func:`extract`."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        "--only-binary=:all:", "--platform", "manylinux_2_28_x86_64",
                        "--python-version", "3.12", "-d", tmp, WHEEL_SPEC], check=True)
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if len(wheels) != 1:
            raise RuntimeError(f"expected one wheel from pip, got {wheels}")
        return extract(os.path.join(tmp, wheels[0]), dest, libs=libs, part_bytes=part_bytes)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", default=default_dest())
    ap.add_argument("--minimal", action="store_true",
                    help=f"only {MOE_LIB} (one call's carry; PyTorch repack and activation)")
    ap.add_argument("--part-mib", type=int, default=PART_MIB)
    ap.add_argument("--wheel", help="a vllm-0.26.0 wheel already on disk (skips pip)")
    args = ap.parse_args(argv)
    libs = (MOE_LIB,) if args.minimal else (MOE_LIB, C_LIB)
    if args.wheel:
        manifest = extract(args.wheel, args.dest, libs=libs, part_bytes=args.part_mib << 20)
    else:
        manifest = fetch(args.dest, libs=libs, part_bytes=args.part_mib << 20)
    for name, e in manifest["files"].items():
        where = ", ".join(e["parts"]) if e["parts"] else name
        print(f"{name}: {e['bytes']} B ({e['bytes'] / 2 ** 20:.1f} MiB) -> {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
