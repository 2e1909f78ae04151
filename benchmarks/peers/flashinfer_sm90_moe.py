"""Peer: FlashInfer's SM90 CUTLASS MoE (``cutlass_fused_moe``, ``use_w4_group_scaling=True``)
on MXFP4 weights, H100 / H200.

The MoE that FlashInfer's unified MoE API runs for MXFP4 checkpoints on Hopper
(``CutlassW4A16Runner``; vLLM's FlashInfer CUTLASS MoE path): CUTLASS's SM90 mixed-input
grouped GEMM, MXFP4 weights converted to BF16 in registers (W4A16), FP32 accumulation, our
SiTU in a separate activation kernel, the combine in a finalize kernel. Optionally the
"Humming" path (``use_wfp4afp8_humming=True``, W4A8): BF16 activations quantized per row to
FP8 E4M3 inside the call, MXFP4 weights converted to E4M3 before the FP8 MMA. This module
turns our weight format into the kernel's once, runs one MoE call, and checks itself on a
tiny problem (:func:`check_forward`) against a float64 computation with the kernel's
rounding points, so that no timing comes from a wrong result. **It has not run here** (no
GPU on the machine that wrote it); everything that needs no GPU is tested on the CPU
(``tests/test_flashinfer_sm90_peer.py``).

Written against **FlashInfer 0.7.2.post1** (``flashinfer-python``), read from its installed
Python and C++ sources. Nothing but torch and the repository is imported at module import
time; FlashInfer on use.

**The library.** FlashInfer compiles this code on first use (JIT module ``fused_moe_90``,
nvcc, hours for all data types); the GPU node has no nvcc. ``tools/build_flashinfer_sm90.py``
builds a reduced ``fused_moe_90.so`` ahead of time on a CPU machine (only the MXFP4
launchers; calling any other data type's runner or a launcher left out raises a
``RuntimeError`` naming the library, which FlashInfer's autotuner skips) in FlashInfer's AOT layout::

    .gpu/peers/flashinfer_sm90/w4a16/fused_moe_90/fused_moe_90.so        (W4A16, 11.3 MB)
    .gpu/peers/flashinfer_sm90/w4a16/manifest.json
    .gpu/peers/flashinfer_sm90/w4a16_w4a8/fused_moe_90/fused_moe_90.so   (W4A16 + W4A8, 19.8 MB)
    .gpu/peers/flashinfer_sm90/w4a16_w4a8/manifest.json

(``$LATENTMOE_FI90_DIR`` replaces ``.gpu/peers/flashinfer_sm90``; it may also name one
variant's folder). :func:`find_library` takes the first variant present, ``w4a16_w4a8``
first (``$LATENTMOE_FI90_VARIANT`` picks one), and checks its size and SHA-256 against the
manifest. :func:`load_module` then points FlashInfer's AOT directory at that folder
(``flashinfer.jit.env.FLASHINFER_AOT_DIR``, restored afterwards), sets
``FLASHINFER_DISABLE_JIT=1`` for the load (a failed load raises instead of starting nvcc)
and calls ``flashinfer.fused_moe.core.get_cutlass_fused_moe_module("90")``, which loads the
library with ``tvm_ffi.load_module`` and caches it for the process. FlashInfer still
generates its CUTLASS instantiation list into ``$FLASHINFER_WORKSPACE_BASE`` (default: the
home directory), which must be writable.

**Our weights** (as in ``marlin_moe``): w13 codes ``uint8 [E, 2I, L/2]`` (rows gate
``0..I-1`` then up ``I..2I-1``; element ``2i`` in the low nibble), E8M0 scales ``uint8
[E, 2I, L/32]``; w2 codes ``uint8 [E, L, I/2]``, scales ``uint8 [E, L, I/32]``; decoded by
``model.formats.dequantize_mxfp4``.

**Conversion** (once, outside the timed region; a permutation of bytes,
:func:`restore_weights` inverts it exactly, tested):

1. FC1 rows ``[up; gate]``: the activation kernel (``doActivationKernel``) reads the linear
   (up) value from column ``j`` and the gate from column ``I + j`` of FC1's output, so
   kernel row ``n`` is our row ``(n + I) mod 2I`` (:func:`fc1_row_order`); the scales take
   the same rows;
2. W4A16 codes, per expert ``[N, K/2]``: FlashInfer's ``interleave_moe_weights_for_sm90_mixed_gemm(w,
   "fp4")`` (CUDA kernel ``interleave_fp4_weights_for_sm90_mixed_gemm_kernel``): per pair of
   rows ``r, r + 8`` of a 16-row group and per 32 bytes of a row, four bytes (rows ``r``,
   ``r + 8`` at byte columns ``c``, ``c + 4``) form a 32-bit word whose bits are permuted
   (:data:`INTERLEAVE_BIT_MOVES`) and written as 4 consecutive bytes of row ``r`` or ``r +
   8`` (:func:`interleave_fp4_codes`, a PyTorch port; the smoke checks it byte-equal to the
   extension's kernel on the GPU);
3. scales ``[N, K/32]`` folded into 64 x 128 blocks of 16 bytes
   (``interleave_moe_scales_for_sm90_mixed_gemm``, pure PyTorch there too): ``[N/64, 4, 16,
   K/128, 4] -> [N/64, K/128, 16, 4, 4]``, i.e. uint8 ``[E, N/64, K/128, 16, 16]``, passed
   viewed as int32 (:func:`interleave_scales`);
4. W4A8 only: FlashInfer's own ``preprocess_moe_weights_for_sm90_mixed_gemm_humming(codes,
   scales)`` (GPU) on the rows of step 1: per expert, scales clamped to the 11 binades below
   its largest (codes of blocks below that are rewritten; our weights' scale codes span
   fewer), codes interleaved for the FP8 MMA, scale offsets folded as in step 3, and one FP32
   residual scale per expert, passed times ``2^6`` (FlashInfer's
   ``prepare_cutlass_humming_weights``).

**What one call does (what is timed)**, :meth:`FlashInferSm90MoE.__call__`:
``flashinfer.fused_moe.cutlass_fused_moe(input=x, token_selected_experts=ids,
token_final_scales=weights, fc1_expert_weights, fc2_expert_weights,
output_dtype=bfloat16, quant_scales=[...], ep_size, ep_rank, output=out,
use_w4_group_scaling=True, use_wfp4afp8_humming=(W4A8), activation_type=Situ,
situ_beta, situ_linear_beta, workspace_buffer)``; inside (the C++ runner ``runMoe``):

* routing: ids ``int32 [R, K]`` global; the runner's local experts are ``[ep_rank E_loc,
  (ep_rank + 1) E_loc)`` with ``E_loc`` the weights' expert count, every other id (also
  ``-1``) is dropped (vLLM's expert parallelism: ``ep_size``, ``ep_rank`` and global ids).
  Our rank's ``[first, first + count)`` maps onto that exactly when ``first`` is a multiple
  of ``count`` (``ep_rank = first / count``, ``ep_size = ceil(E / count)``: a DEP16 rank's
  56 of 896, a TP8 rank's all); otherwise the call first subtracts ``first mod count`` from
  the ids (one more elementwise kernel; the tiny checks use it, the benchmark does not);
* the pairs sorted by local expert, the rows gathered (W4A8: each row quantized to E4M3
  with ``q = 448 / max|x_r|``, dequantized by ``1/q`` times the expert's residual in the
  epilogue);
* FC1 (grouped GEMM, FP32 accumulation) -> BF16 ``h [P, 2I]``;
* activation (``doActivationKernel``, FP32 on the BF16 ``h``): SiTU ``beta tanh(g / beta)
  sigmoid(g) * linear_beta tanh(u / linear_beta)`` with ``tanh(z) = 2 sigmoid(2z) - 1``
  (FlashInfer's ``SituAdaptor``: ``situ_beta = 4``, ``situ_linear_beta = 25`` per local
  expert, our ``config.situ_beta``, ``config.situ_linear_beta``), or SwiGLU ``silu(g) u``
  -> BF16 ``a [P, I]`` (W4A8: per row E4M3 with ``q = 448 / max|a_r|``);
* FC2 -> BF16 per pair (the mixed-input GEMM has no fused finalize);
* finalize: each row's local pairs times their FP32 routing weight, summed in FP32 ->
  BF16 ``[R, L]``; rows without a local pair are written as zeros.

**The compact layout** (``layout="compact"``, ``capacity``: a host int >= the rows with a
local pair, computed before the timed call as a DEP dispatch knows what it received): the
rows with a local pair gathered into ``capacity`` rows (``triton_moe.compact_forward``;
empty slots get ids ``-1``), the call over those, the rows scattered back.

**Tactics.** FlashInfer's ``AutoTuner`` picks the two GEMMs' CUTLASS configurations;
outside ``flashinfer.autotune()`` the runner's heuristic (tactic ``-1``) runs.
``autotune=True`` (default) tunes once per row count, eagerly, before the call that
follows (never inside a CUDA-graph capture), over FlashInfer's token buckets up to
``tune_max_num_tokens`` (default 1024, the table's largest row count).

**Checked on an SM90 node** (one H100, tree 6acca8d, library SHA-256 ``37a526fc...``): the
reduced library loads through FlashInfer's AOT path; :func:`check_forward` passes for
W4A16 and W4A8 in both layouts; the tuner completes over both precisions. W4A8's tuning
reaches a path the reduced build left out: with stubs that aborted, the process ended
there (at its first W4A8 tuning); with stubs that raise, the tuning completed. Still taken from the source, not
from a run: the W4A8 model (the pre-MMA FP4 -> E4M3 conversion exact for scale ranges of
at most 11 binades), which the checks' tolerance (:data:`TOLERANCE`) covers but does not
prove.

Smoke on an H100/H200 node (the checks, then one DEP16 rank at the real dimensions)::

    PYTHONPATH=. python3 -m benchmarks.peers.flashinfer_sm90_moe | tee fi90_smoke.json
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks.peers.triton_moe import (check_int, check_routing_inputs, check_weights,
                                         compact_forward, expert_bytes, gated_activation64, local_rows,
                                         random_routing, random_weights, rank_weight_slice,
                                         touched_experts)
from model.formats import dequantize_mxfp4, e4m3_to_float32, float32_to_e4m3

__all__ = [
    "FLASHINFER_VERSION", "MODULE", "ENV_DIR", "ENV_VARIANT", "VARIANTS", "MANIFEST", "PRECISIONS",
    "ACTIVATIONS", "LAYOUTS", "SUPPORTED_CAPABILITY", "ROW_ALIGN", "HUMMING_COMPENSATION", "TOLERANCE",
    "INTERLEAVE_BIT_MOVES", "lib_dir", "find_library", "check_library", "import_flashinfer", "load_module",
    "available", "versions", "check_dims", "fc1_row_order", "interleave_fp4_codes", "deinterleave_fp4_codes",
    "interleave_scales", "deinterleave_scales", "convert_weights", "restore_weights", "expert_parallel",
    "FlashInferSm90MoE", "rank_moe", "fp8_rows", "reference_forward", "row_errors", "check_forward",
    "check_interleave", "smoke",
]

FLASHINFER_VERSION = "0.7.2.post1"
MODULE = "fused_moe_90"
ENV_DIR = "LATENTMOE_FI90_DIR"
ENV_VARIANT = "LATENTMOE_FI90_VARIANT"
VARIANTS = {"w4a16_w4a8": ("w4a16", "w4a8"), "w4a16": ("w4a16",)}
"""The library variants ``tools/build_flashinfer_sm90.py`` writes, in the order they are
looked for, and the precisions each serves."""
MANIFEST = "manifest.json"
PRECISIONS = ("w4a16", "w4a8")
"""``w4a16``: BF16 activations x MXFP4 weights; ``w4a8``: the Humming path (activations
quantized per row to E4M3 inside the call)."""
ACTIVATIONS = {"situ": 10, "swiglu": 3}
"""Our name -> FlashInfer's ``ActivationType`` value (``Situ`` = 10, ``Swiglu`` = 3)."""
LAYOUTS = ("owner", "compact")
SUPPORTED_CAPABILITY = (9, 0)
"""sm_90a (H100, H200): the library holds sm_90a code only."""
ROW_ALIGN = 128
"""MXFP4 weights: hidden and intermediate sizes multiples of 128 (the binding checks it)."""
HUMMING_COMPENSATION = 64.0
"""The fixed ``2^6`` FlashInfer's Humming preparation multiplies each residual scale by."""
FP8_MAX = 448.0
SCALE_CODES = (121, 125)
"""The check's weight scale codes (``2^-6 .. 2^-2``): see :func:`check_forward`."""
TOLERANCE = {"w4a16": 2.0 ** -6, "w4a8": 2.0 ** -5}
""":func:`check_forward`'s per-row normwise bounds (its docstring derives them)."""
_TUNE_DEFAULT = 1024
_HUMMING_CHUNK = 8
"""Experts per call of FlashInfer's Humming preparation (it holds int64 copies of the codes)."""

INTERLEAVE_BIT_MOVES = (
    (0x00000080, 24), (0x00000070, 18), (0x00000008, 12), (0x00000007, 6),
    (0x00008000, 13), (0x00007000, 7), (0x00000800, 1), (0x00000700, -5),
    (0x00800000, 2), (0x00700000, -4), (0x00080000, -10), (0x00070000, -16),
    (0x80000000, -1), (0x10000000, 1), (0x60000000, -3), (0x08000000, -13),
    (0x01000000, -11), (0x06000000, -15),
)
"""``(mask, left shift)`` of each move of ``interleave_fp4_weights_for_sm90_mixed_gemm_kernel``
(FlashInfer 0.7.2.post1, ``moe_gemm_mixed_utils.cu``), in its order: ``out |= (word & mask)
<< shift`` (a negative shift is a right shift). Together a permutation of the 32 bits."""


def _bit_destinations() -> list[int]:
    """Source bit -> destination bit of :data:`INTERLEAVE_BIT_MOVES`."""
    dest = [-1] * 32
    for mask, shift in INTERLEAVE_BIT_MOVES:
        for bit in range(32):
            if mask >> bit & 1:
                dest[bit] = bit + shift
    if sorted(dest) != list(range(32)):
        raise AssertionError("INTERLEAVE_BIT_MOVES is not a permutation of 32 bits")
    return dest


_BIT_DEST = _bit_destinations()
_BIT_SOURCE = [_BIT_DEST.index(d) for d in range(32)]


# --------------------------------------------------------------------------------------
# the library: where, which, checked; FlashInfer; availability
# --------------------------------------------------------------------------------------

def lib_dir() -> str:
    """``$LATENTMOE_FI90_DIR`` if set, else ``<repo>/.gpu/peers/flashinfer_sm90``."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.environ.get(ENV_DIR) or os.path.join(repo, ".gpu", "peers", "flashinfer_sm90")


def find_library(folder: str | None = None, variant: str | None = None) -> dict:
    """The library to use: ``{"dir": <AOT dir>, "path": <.so>, "variant", "manifest"}``.

    ``folder`` (default :func:`lib_dir`) holds either a manifest itself (one variant's
    folder) or one folder per variant (:data:`VARIANTS`, tried in that order, or only
    ``variant`` / ``$LATENTMOE_FI90_VARIANT``).

    Raises:
        ImportError: naming the folder and what is missing there, or a manifest that is not
            FlashInfer :data:`FLASHINFER_VERSION`'s ``fused_moe_90``.
    """
    folder = folder or lib_dir()
    variant = variant or os.environ.get(ENV_VARIANT) or None
    if variant is not None and variant not in VARIANTS:
        raise ImportError(f"variant {variant!r} is not one of {sorted(VARIANTS)}")
    if os.path.isfile(os.path.join(folder, MANIFEST)):
        candidates = [folder]
    else:
        candidates = [os.path.join(folder, v) for v in ([variant] if variant else list(VARIANTS))]
    for d in candidates:
        path = os.path.join(d, MANIFEST)
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            manifest = json.load(f)
        if manifest.get("flashinfer") != FLASHINFER_VERSION or manifest.get("module") != MODULE:
            raise ImportError(f"{path} describes {manifest.get('module')} of FlashInfer "
                              f"{manifest.get('flashinfer')}, not {MODULE} of {FLASHINFER_VERSION}")
        if variant is not None and manifest.get("variant") != variant:
            continue
        return {"dir": d, "path": os.path.join(d, manifest.get("file", f"{MODULE}/{MODULE}.so")),
                "variant": manifest.get("variant"), "manifest": manifest}
    raise ImportError(f"no {MANIFEST} of the {variant or ' or '.join(VARIANTS)} library in {folder} "
                      f"(python3 tools/build_flashinfer_sm90.py on a CPU machine, carry "
                      f".gpu/peers/flashinfer_sm90, or set {ENV_DIR})")


def _sha256(path: str) -> str:
    """The SHA-256 of the file at ``path``, hex."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check_library(entry: dict) -> dict:
    """``entry`` (:func:`find_library`) if its library is there with the manifest's size
    and SHA-256.

    Raises:
        ImportError: the file is missing, or its size or SHA-256 differ from the manifest's.
    """
    path, manifest = entry["path"], entry["manifest"]
    if not os.path.isfile(path):
        raise ImportError(f"{path} is missing (its manifest is in {entry['dir']})")
    size = os.path.getsize(path)
    if size != manifest.get("bytes"):
        raise ImportError(f"{path}: {size} B, the manifest says {manifest.get('bytes')} B (a partial carry?)")
    digest = _sha256(path)
    if digest != manifest.get("sha256"):
        raise ImportError(f"{path}: SHA-256 {digest}, the manifest says {manifest.get('sha256')}")
    return entry


def import_flashinfer():
    """``flashinfer`` at the pinned version.

    Raises:
        ImportError: FlashInfer is not importable, or its version is not
            :data:`FLASHINFER_VERSION` (the library and the layout are that version's).
    """
    try:
        import flashinfer
    except Exception as e:  # an ImportError, or a broken install's RuntimeError
        raise ImportError(f"FlashInfer is not importable ({type(e).__name__}: {e}); the GPU node's "
                          f"flashinfer-python=={FLASHINFER_VERSION}") from e
    version = getattr(flashinfer, "__version__", "unknown")
    if version != FLASHINFER_VERSION:
        raise ImportError(f"FlashInfer {version} is installed; the library was built from "
                          f"{FLASHINFER_VERSION}")
    return flashinfer


@contextlib.contextmanager
def _aot_dir(folder: str):
    """FlashInfer's AOT directory pointed at ``folder`` and JIT compilation disabled, both
    restored on exit."""
    from flashinfer.jit import env as jit_env

    saved_dir, saved_flag = jit_env.FLASHINFER_AOT_DIR, os.environ.get("FLASHINFER_DISABLE_JIT")
    jit_env.FLASHINFER_AOT_DIR = Path(folder)
    os.environ["FLASHINFER_DISABLE_JIT"] = "1"
    try:
        yield
    finally:
        jit_env.FLASHINFER_AOT_DIR = saved_dir
        if saved_flag is None:
            os.environ.pop("FLASHINFER_DISABLE_JIT", None)
        else:
            os.environ["FLASHINFER_DISABLE_JIT"] = saved_flag


_LOADED: dict | None = None
_LOAD_ERROR: str | None = None


def load_module() -> dict:
    """Load the library through FlashInfer once: ``{"entry": find_library(), "module":
    FlashInfer's module namespace (``cutlass_fused_moe``, ``MoERunner``, ...)}``.

    Raises:
        ImportError: the library is missing or does not match its manifest, FlashInfer is
            missing or of another version, or the load failed (the error named).
    """
    global _LOADED, _LOAD_ERROR
    if _LOADED is not None:
        return _LOADED
    if _LOAD_ERROR is not None:
        raise ImportError(_LOAD_ERROR)
    entry = check_library(find_library())
    import_flashinfer()
    try:
        from flashinfer.fused_moe import core

        with _aot_dir(entry["dir"]):
            module = core.get_cutlass_fused_moe_module("90")
    except Exception as e:  # reported, not hidden
        _LOAD_ERROR = f"FlashInfer did not load {entry['path']} ({type(e).__name__}: {e})"
        raise ImportError(_LOAD_ERROR) from e
    _LOADED = {"entry": entry, "module": module}
    return _LOADED


def available() -> tuple[bool, str]:
    """``(True, "")`` where the peer can run, else ``(False, reason)``: the library and its
    manifest are found and match; FlashInfer :data:`FLASHINFER_VERSION` imports; a CUDA
    GPU of capability :data:`SUPPORTED_CAPABILITY` is visible; FlashInfer loads the
    library."""
    try:
        check_library(find_library())
        import_flashinfer()
    except ImportError as e:
        return False, f"FlashInfer SM90 MoE peer unavailable: {e}"
    if not torch.cuda.is_available():
        return False, "the FlashInfer SM90 MoE peer needs an SM90 GPU (no CUDA GPU visible)"
    cap = tuple(torch.cuda.get_device_capability())
    if cap != SUPPORTED_CAPABILITY:
        return False, (f"the FlashInfer SM90 MoE library holds sm_90a code only (H100, H200); "
                       f"this GPU is sm_{cap[0]}{cap[1]}")
    try:
        load_module()
    except ImportError as e:
        return False, str(e)
    return True, ""


def versions() -> dict:
    """For a benchmark record: FlashInfer's version, the library's variant, kernels and
    SHA-256, torch."""
    out = {"flashinfer_pinned": FLASHINFER_VERSION, "torch": torch.__version__}
    try:
        entry = find_library()
        out.update(variant=entry["variant"], kernels=entry["manifest"].get("kernels"),
                   sha256=entry["manifest"].get("sha256"), library=os.path.basename(entry["path"]))
        out["flashinfer"] = import_flashinfer().__version__
    except ImportError as e:
        out["error"] = str(e)
    return out


# --------------------------------------------------------------------------------------
# pure PyTorch: the weight conversion
# --------------------------------------------------------------------------------------

def check_dims(latent: int, intermediate: int) -> None:
    """MXFP4 weights need ``latent % 128 == 0`` and ``intermediate % 128 == 0``; ValueError
    naming the one that is not."""
    for name, v in (("latent", latent), ("intermediate", intermediate)):
        check_int(v, name, 1)
        if v % ROW_ALIGN:
            raise ValueError(f"{name}={v}: the SM90 MXFP4 MoE needs a multiple of {ROW_ALIGN}")


def fc1_row_order(intermediate: int) -> torch.Tensor:
    """int64 ``[2I]``: kernel FC1 row ``n`` takes our row ``(n + I) mod 2I`` (``[up; gate]``
    from our ``[gate; up]``)."""
    check_int(intermediate, "intermediate", 1)
    return (torch.arange(2 * intermediate, dtype=torch.int64) + intermediate) % (2 * intermediate)


def _check_codes(codes, name: str = "codes") -> tuple[int, int, int]:
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8 or codes.dim() != 3:
        raise ValueError(f"{name} must be uint8 [E, N, K/2], got {getattr(codes, 'dtype', type(codes).__name__)} "
                         f"{tuple(getattr(codes, 'shape', ()))}")
    e, n, half_k = codes.shape
    if n % 16 or (2 * half_k) % 64:
        raise ValueError(f"{name} [E, N, K/2] = {list(codes.shape)}: the SM90 interleave needs N % 16 == 0 "
                         "and K % 64 == 0")
    return e, n, 2 * half_k


def _permute_bits(words: torch.Tensor, source: list[int]) -> torch.Tensor:
    """int64 words (32 significant bits): bit ``d`` of the result is bit ``source[d]``."""
    out = torch.zeros_like(words)
    for d, s in enumerate(source):
        out |= ((words >> s) & 1) << d
    return out


def _interleave_chunk(codes: torch.Tensor, inverse: bool) -> torch.Tensor:
    """:func:`interleave_fp4_codes` (or its inverse) of ``[E, N, K/2]`` in one go.

    Index names: row ``16 g + 8 h + r``, byte column ``32 p + 8 m + 4 c + q`` of the source
    (``m`` the kernel's ``mma_id``, ``q`` its ``lane % 4``); the source word of lane ``(m,
    q)`` is bytes ``j = 2 c + h``; it goes to row ``16 g + 8 (m % 2) + r``, byte columns ``32
    p + 16 (m // 2) + 4 q + j``."""
    e, n, half_k = codes.shape
    g, p = n // 16, half_k // 32
    if not inverse:
        s = codes.reshape(e, g, 2, 8, p, 4, 2, 4)  # [e, g, h, r, p, m, c, q]
        b = s.permute(0, 1, 3, 4, 5, 7, 6, 2)  # [e, g, r, p, m, q, c, h]: byte j = 2 c + h
        b = b.reshape(e, g, 8, p, 4, 4, 4).to(torch.int64)
        words = b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24
        words = _permute_bits(words, _BIT_SOURCE)
        out = torch.stack([(words >> (8 * j)) & 0xFF for j in range(4)], dim=-1).to(torch.uint8)
        out = out.reshape(e, g, 8, p, 2, 2, 4, 4)  # [e, g, r, p, m//2, m%2, q, j]
        return out.permute(0, 1, 5, 2, 3, 4, 6, 7).reshape(e, n, half_k)
    d = codes.reshape(e, g, 2, 8, p, 2, 4, 4)  # [e, g, m%2, r, p, m//2, q, j]
    d = d.permute(0, 1, 3, 4, 5, 2, 6, 7).reshape(e, g, 8, p, 4, 4, 4).to(torch.int64)  # [e, g, r, p, m, q, j]
    words = d[..., 0] | d[..., 1] << 8 | d[..., 2] << 16 | d[..., 3] << 24
    words = _permute_bits(words, _BIT_DEST)
    b = torch.stack([(words >> (8 * j)) & 0xFF for j in range(4)], dim=-1).to(torch.uint8)
    b = b.reshape(e, g, 8, p, 4, 4, 2, 2)  # [e, g, r, p, m, q, c, h]
    return b.permute(0, 1, 7, 2, 3, 4, 6, 5).reshape(e, n, half_k)


def interleave_fp4_codes(codes: torch.Tensor, chunk_experts: int = 4) -> torch.Tensor:
    """Our FP4 codes ``uint8 [E, N, K/2]`` (any rows order) -> the SM90 mixed-input GEMM's
    W4A16 layout, uint8 ``[E, N, K/2]``: FlashInfer's
    ``interleave_fp4_weights_for_sm90_mixed_gemm_kernel`` in PyTorch (module docstring, step
    2), ``chunk_experts`` experts at a time (bounded int64 temporaries). ``N % 16 == 0``,
    ``K % 64 == 0``."""
    e = _check_codes(codes)[0]
    return torch.cat([_interleave_chunk(codes[i:i + chunk_experts], False) for i in range(0, e, chunk_experts)]) \
        if e else codes.clone()


def deinterleave_fp4_codes(codes: torch.Tensor, chunk_experts: int = 4) -> torch.Tensor:
    """Inverse of :func:`interleave_fp4_codes`."""
    e = _check_codes(codes)[0]
    return torch.cat([_interleave_chunk(codes[i:i + chunk_experts], True) for i in range(0, e, chunk_experts)]) \
        if e else codes.clone()


def interleave_scales(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 scales ``uint8 [E, N, K/32]`` -> uint8 ``[E, N/64, K/128, 16, 16]``: FlashInfer's
    ``interleave_moe_scales_for_sm90_mixed_gemm(scales, group_size=32)`` (row ``64 a + 16 b +
    i``, column ``4 d + f`` at ``[a, d, i, 4 b + f]``; a permutation). ``N % 64 == 0``,
    ``K % 128 == 0``."""
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.uint8 or scales.dim() != 3:
        raise ValueError(f"scales must be uint8 [E, N, K/32], got {getattr(scales, 'dtype', type(scales).__name__)} "
                         f"{tuple(getattr(scales, 'shape', ()))}")
    e, n, groups = scales.shape
    if n % 64 or groups % 4:
        raise ValueError(f"scales [E, N, K/32] = {list(scales.shape)}: the folded layout needs N % 64 == 0 "
                         "and K % 128 == 0")
    return (scales.reshape(e, n // 64, 4, 16, groups // 4, 4).permute(0, 1, 4, 3, 2, 5).contiguous()
            .reshape(e, n // 64, groups // 4, 16, 16))


def deinterleave_scales(folded: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`interleave_scales`: uint8 ``[E, N, K/32]``."""
    if not isinstance(folded, torch.Tensor) or folded.dtype != torch.uint8 or folded.dim() != 5 \
            or tuple(folded.shape[3:]) != (16, 16):
        raise ValueError(f"folded scales must be uint8 [E, N/64, K/128, 16, 16], got "
                         f"{getattr(folded, 'dtype', type(folded).__name__)} {tuple(getattr(folded, 'shape', ()))}")
    e, a, d = folded.shape[:3]
    return (folded.reshape(e, a, d, 16, 4, 4).permute(0, 1, 4, 3, 2, 5).contiguous()
            .reshape(e, 64 * a, 4 * d))


def convert_weights(w13_codes, w13_scales, w2_codes, w2_scales) -> dict:
    """Our four tensors (``[E, ...]``, any device) -> the W4A16 kernel's
    ``fc1_expert_weights`` (uint8 ``[E, 2I, L/2]``), ``fc1_expert_scales`` (uint8 ``[E,
    2I/64, L/128, 16, 16]``), ``fc2_expert_weights`` (``[E, L, I/2]``),
    ``fc2_expert_scales`` (``[E, L/64, I/128, 16, 16]``): module docstring, steps 1-3."""
    e, lat, inter = check_weights(w13_codes, w13_scales, w2_codes, w2_scales)
    check_dims(lat, inter)
    order = fc1_row_order(inter).to(w13_codes.device)
    return {"fc1_expert_weights": interleave_fp4_codes(w13_codes.index_select(1, order).contiguous()),
            "fc1_expert_scales": interleave_scales(w13_scales.index_select(1, order).contiguous()),
            "fc2_expert_weights": interleave_fp4_codes(w2_codes.contiguous()),
            "fc2_expert_scales": interleave_scales(w2_scales.contiguous())}


def restore_weights(converted: dict) -> tuple[torch.Tensor, ...]:
    """Inverse of :func:`convert_weights`: ``(w13_codes, w13_scales, w2_codes, w2_scales)``
    in our layout."""
    w13 = deinterleave_fp4_codes(converted["fc1_expert_weights"])
    s13 = deinterleave_scales(converted["fc1_expert_scales"])
    inter = w13.shape[1] // 2
    inverse = torch.empty(2 * inter, dtype=torch.int64)
    inverse[fc1_row_order(inter)] = torch.arange(2 * inter)
    inverse = inverse.to(w13.device)
    return (w13.index_select(1, inverse).contiguous(), s13.index_select(1, inverse).contiguous(),
            deinterleave_fp4_codes(converted["fc2_expert_weights"]),
            deinterleave_scales(converted["fc2_expert_scales"]))


def expert_parallel(first: int, count: int, n_experts_total: int) -> tuple[int, int, int]:
    """``(ep_size, ep_rank, id_shift)`` such that the runner's local experts ``[ep_rank
    count, (ep_rank + 1) count)`` are ours ``[first, first + count)`` after the ids are
    lowered by ``id_shift = first mod count`` (0 when ``first`` is a multiple of ``count``:
    the ids go in unchanged); ``ep_size = max(ep_rank + 1, ceil(n_experts_total / count))``."""
    check_int(first, "first")
    check_int(count, "count", 1)
    check_int(n_experts_total, "n_experts_total", first + count)
    ep_rank = first // count
    return max(ep_rank + 1, -(-n_experts_total // count)), ep_rank, first - ep_rank * count


# --------------------------------------------------------------------------------------
# the peer
# --------------------------------------------------------------------------------------

class FlashInferSm90MoE:
    """FlashInfer's SM90 CUTLASS MXFP4 MoE over our weights, one object per weight set.

    Args:
        w13_codes, w13_scales, w2_codes, w2_scales: our uint8 tensors (module docstring):
            either all ``E`` experts (then ``[first, first + count)`` are taken) or exactly
            the ``count`` local ones. Any device; converted on ``device``.
        first, count: the local experts; ``count=None`` = all from ``first``.
        n_experts_total: the model's expert count (default ``E`` of the given weights when
            they are the full set, else ``first + count``).
        precision: ``"w4a16"`` or ``"w4a8"`` (:data:`PRECISIONS`; W4A8 needs the
            ``w4a16_w4a8`` library and, to convert, FlashInfer on the GPU).
        activation: ``"situ"`` or ``"swiglu"`` (:data:`ACTIVATIONS`).
        situ_beta, situ_linear_beta: SiTU's gate and up saturations, positive.
        layout: the default call layout, ``"owner"`` or ``"compact"`` (:data:`LAYOUTS`).
        autotune: tune each row count once under ``flashinfer.autotune()`` before its first
            call (eager; default True).
        tune_max_num_tokens: FlashInfer's tuning range (default 1024).
        device: where the converted weights live and calls run (``"cpu"`` converts for tests).
        kernel: a callable with ``cutlass_fused_moe``'s keyword arguments (tests pass a
            PyTorch model of it); default FlashInfer's, on a GPU.
        humming_prepare: W4A8's ``(codes, scales) -> (codes, folded scales, residual)``
            (default FlashInfer's ``preprocess_moe_weights_for_sm90_mixed_gemm_humming``).
    """

    def __init__(self, w13_codes, w13_scales, w2_codes, w2_scales, first: int = 0, count: int | None = None, *,
                 n_experts_total: int | None = None, precision: str = "w4a16", activation: str = "situ",
                 situ_beta: float = 4.0, situ_linear_beta: float = 25.0, layout: str = "owner",
                 autotune: bool = True, tune_max_num_tokens: int = _TUNE_DEFAULT, device="cuda", kernel=None,
                 humming_prepare=None):
        e, lat, inter = check_weights(w13_codes, w13_scales, w2_codes, w2_scales)
        check_dims(lat, inter)
        sl, first, count, n_experts_total = self._local_slice(e, first, count, n_experts_total)
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
        for name, v in (("situ_beta", situ_beta), ("situ_linear_beta", situ_linear_beta)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise ValueError(f"{name} must be a finite positive float, got {v!r}")
        check_int(tune_max_num_tokens, "tune_max_num_tokens", 1)
        self.first, self.count, self.n_experts_total = first, count, n_experts_total
        self.ep_size, self.ep_rank, self.id_shift = expert_parallel(first, count, n_experts_total)
        self.latent, self.intermediate = lat, inter
        self.precision, self.activation, self.layout = precision, activation, layout
        self.situ_beta, self.situ_linear_beta = float(situ_beta), float(situ_linear_beta)
        self.autotune, self.tune_max_num_tokens = bool(autotune), tune_max_num_tokens
        self.device = torch.device(device)
        self._fi, self._kernel = self._bind_kernel(kernel)
        dev = self.device
        local = [t[sl].to(dev) for t in (w13_codes, w13_scales, w2_codes, w2_scales)]
        if precision == "w4a16":
            self.weights = convert_weights(*local)
            self.quant_scales = [self.weights["fc1_expert_scales"].view(torch.int32),
                                 self.weights["fc2_expert_scales"].view(torch.int32)]
        else:
            self.weights, self.quant_scales = self._humming_weights(local, humming_prepare)
        self.activation_params = {"situ_beta": None, "situ_linear_beta": None}
        if activation == "situ":
            self.activation_params = {
                "situ_beta": torch.full((count,), self.situ_beta, dtype=torch.float32, device=dev),
                "situ_linear_beta": torch.full((count,), self.situ_linear_beta, dtype=torch.float32, device=dev)}
        self._tuned: set[int] = set()
        self._workspaces: dict[int, torch.Tensor] = {}
        self.bytes_per_expert = expert_bytes(lat, inter)["total"]

    @staticmethod
    def _local_slice(e: int, first, count, n_experts_total) -> tuple[slice, int, int, int]:
        """``(slice of the given tensors, first, count, n_experts_total)``."""
        check_int(first, "first")
        count = e - first if count is None else count
        check_int(count, "count", 1)
        if e >= first + count:
            sl, total = slice(first, first + count), e
        elif e == count:
            sl, total = slice(0, count), first + count
        else:
            raise ValueError(f"w13_codes has E={e} experts: pass either all experts (E >= first + "
                             f"count = {first + count}) or exactly count={count} local ones")
        total = total if n_experts_total is None else n_experts_total
        check_int(total, "n_experts_total", first + count)
        return sl, first, count, total

    def _bind_kernel(self, kernel):
        if kernel is not None:
            return None, kernel
        if self.device.type != "cuda":
            return None, None
        ok, why = available()
        if not ok:
            raise RuntimeError(why)
        if self.precision == "w4a8" and "w4a8" not in load_module()["entry"]["manifest"].get("kernels", ()):
            raise RuntimeError(f"the {load_module()['entry']['variant']} library has no W4A8 kernels "
                               "(build it with tools/build_flashinfer_sm90.py --with-w4a8)")
        fi = import_flashinfer()
        return fi, fi.fused_moe.cutlass_fused_moe

    def _humming_weights(self, local, prepare) -> tuple[dict, list]:
        """W4A8 (step 4 of the module docstring): FlashInfer's Humming preparation of the
        ``[up; gate]`` rows; quant scales ``[fc1 folded scales (int32 view), fc1 residual x
        2^6, reserved ones (FP32 scalar), fc2 folded scales, fc2 residual x 2^6]``."""
        if prepare is None:
            if self._fi is None:
                raise RuntimeError("W4A8 weights are prepared by FlashInfer on the GPU (device='cuda'), or "
                                   "by a given humming_prepare")
            prepare = self._fi.fused_moe.preprocess_moe_weights_for_sm90_mixed_gemm_humming
        w13, s13, w2, s2 = local
        order = fc1_row_order(self.intermediate).to(w13.device)

        def chunked(codes, scales):  # per expert independent; bounded temporaries (int64 codes)
            parts = [prepare(codes[i:i + _HUMMING_CHUNK].contiguous(), scales[i:i + _HUMMING_CHUNK].contiguous())
                     for i in range(0, codes.shape[0], _HUMMING_CHUNK)]
            return tuple(torch.cat([p[j] for p in parts]) for j in range(3))

        c1, f1, r1 = chunked(w13.index_select(1, order), s13.index_select(1, order))
        c2, f2, r2 = chunked(w2, s2)
        weights = {"fc1_expert_weights": c1, "fc1_expert_scales": f1, "fc2_expert_weights": c2,
                   "fc2_expert_scales": f2, "fc1_residual": (r1 * HUMMING_COMPENSATION).float().contiguous(),
                   "fc2_residual": (r2 * HUMMING_COMPENSATION).float().contiguous()}
        reserved = torch.ones((), dtype=torch.float32, device=w13.device)
        return weights, [f1.view(torch.int32), weights["fc1_residual"], reserved, f2.view(torch.int32),
                         weights["fc2_residual"]]

    def describe(self) -> dict:
        """The configuration, for a benchmark record."""
        act = (f"SiTU (ActivationType.Situ, situ_beta {self.situ_beta:g}, situ_linear_beta "
               f"{self.situ_linear_beta:g}), a separate kernel" if self.activation == "situ"
               else "SwiGLU (ActivationType.Swiglu), a separate kernel")
        return {"peer": "FlashInfer cutlass_fused_moe SM90 (use_w4_group_scaling"
                        + (", use_wfp4afp8_humming)" if self.precision == "w4a8" else ")"),
                "flashinfer": FLASHINFER_VERSION, "precision": self.precision,
                "weights": "FC1 rows [up; gate]; codes interleave_fp4 (SM90 mixed-input); E8M0 scales folded "
                           "[E, N/64, K/128, 16, 16]" + ("; Humming FP4->E4M3 rewrite" if self.precision == "w4a8"
                                                          else ""),
                "activation": act, "layout": self.layout,
                "routing": f"global ids, ep_size {self.ep_size}, ep_rank {self.ep_rank}"
                           + (f", ids lowered by {self.id_shift}" if self.id_shift else ""),
                "tactic": "flashinfer.autotune per row count" if self.autotune else "runner heuristic",
                "first": self.first, "count": self.count, "n_experts_total": self.n_experts_total,
                "latent": self.latent, "intermediate": self.intermediate,
                "bytes_per_expert": self.bytes_per_expert}

    def _require_kernel(self, *tensors) -> None:
        if self._kernel is None:
            raise RuntimeError(f"FlashInferSm90MoE was built on {self.device} without a kernel; calls need "
                               "an SM90 GPU (device='cuda')")
        for name, t in tensors:
            if t.device != self.weights["fc1_expert_weights"].device:
                raise ValueError(f"{name} is on {t.device}, the converted weights on "
                                 f"{self.weights['fc1_expert_weights'].device}")

    def _workspace(self, rows: int, top_k: int, device) -> torch.Tensor | None:
        """A workspace for ``rows`` rows (one per power-of-two capacity, kept: captured
        graphs hold its pointer); None without FlashInfer (the tests' kernels)."""
        if self._fi is None:
            return None
        cap = 1 << max(0, rows - 1).bit_length()
        if cap not in self._workspaces:
            size = self._fi.fused_moe.cutlass_fused_moe_workspace_size(
                cap, self.latent, self.intermediate, self.count * self.ep_size, top_k,
                x_dtype=torch.bfloat16, weight_dtype=torch.uint8, output_dtype=torch.bfloat16,
                activation_type=self._activation_type(), ep_size=self.ep_size, ep_rank=self.ep_rank,
                use_w4_group_scaling=True, use_wfp4afp8_humming=self.precision == "w4a8", device=device)
            self._workspaces[cap] = torch.empty(size, dtype=torch.uint8, device=device)
        return self._workspaces[cap]

    def _activation_type(self):
        value = ACTIVATIONS[self.activation]
        return self._fi.fused_moe.ActivationType(value) if self._fi is not None else value

    def arguments(self, x: torch.Tensor, ids32: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> dict:
        """The keyword arguments of ``cutlass_fused_moe`` for one owner-layout call."""
        return dict(
            input=x, token_selected_experts=ids32, token_final_scales=weights,
            fc1_expert_weights=self.weights["fc1_expert_weights"],
            fc2_expert_weights=self.weights["fc2_expert_weights"], output_dtype=torch.bfloat16,
            quant_scales=self.quant_scales, ep_size=self.ep_size, ep_rank=self.ep_rank, output=out,
            use_w4_group_scaling=True, use_wfp4afp8_humming=self.precision == "w4a8",
            tune_max_num_tokens=self.tune_max_num_tokens, activation_type=self._activation_type(),
            workspace_buffer=self._workspace(x.shape[0], ids32.shape[1], x.device), **self.activation_params)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *, layout: str | None = None,
                 capacity: int | None = None) -> torch.Tensor:
        """One MoE call: BF16 ``[R, L]`` (rows without a local pair 0).

        ``x`` BF16 ``[R, L]`` contiguous, ``ids`` int32 (or int64: cast in the call) ``[R,
        K]`` global expert ids, ``weights`` FP32 ``[R, K]``. ``layout`` (default the
        object's): ``"owner"`` (all ``R`` rows) or ``"compact"`` (the rows with a local pair
        gathered into ``capacity`` rows, a host int; default ``R``). No validation inside
        and no host synchronization: run ``check_routing_inputs`` once outside the timed
        region.
        """
        self._require_kernel(("x", x), ("ids", ids), ("weights", weights))
        layout = self.layout if layout is None else layout
        if layout == "compact":
            cap = x.shape[0] if capacity is None else capacity
            return compact_forward(x, ids, weights, self.first, self.count, cap, self._owner)
        if layout != "owner":
            raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
        return self._owner(x, ids, weights)

    def _owner(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        ids32 = ids if ids.dtype == torch.int32 and ids.is_contiguous() else ids.to(torch.int32).contiguous()
        if self.id_shift:
            ids32 = ids32 - self.id_shift
        w = weights if weights.is_contiguous() else weights.contiguous()
        out = torch.empty(x.shape[0], self.latent, dtype=torch.bfloat16, device=x.device)
        kwargs = self.arguments(x, ids32, w, out)
        if self.autotune and self._fi is not None and x.shape[0] not in self._tuned:
            with self._fi.autotune(True):
                self._kernel(**dict(kwargs, output=torch.empty_like(out)))
            self._tuned.add(x.shape[0])
        result = self._kernel(**kwargs)
        return result[0] if isinstance(result, (list, tuple)) else result

    def bytes_streamed(self, ids: torch.Tensor) -> int:
        """Our MXFP4 weight bytes one call must read for ``ids`` (host sync)."""
        return touched_experts(ids, self.first, self.count) * self.bytes_per_expert


def rank_moe(weights, first: int, count: int, shard: tuple[int, int] = (0, 1), *,
             device="cuda", **kw) -> tuple[FlashInferSm90MoE | None, str]:
    """The peer over one rank's experts of a ``model.weights.LatentMoEWeights``: experts
    ``[first, first + count)``, the ``shard = (rank, ranks)`` slice of their intermediate
    (gate and up rows of the slice, the matching w2 columns), SiTU with the config's
    saturations: ``(FlashInferSm90MoE, "")`` or ``(None, why)`` where the peer cannot run."""
    ok, why = available()
    if not ok:
        return None, why
    c = weights.config
    w13, s13, w2, s2 = rank_weight_slice(weights, first, count, shard)
    kw.setdefault("situ_beta", c.situ_beta)
    kw.setdefault("situ_linear_beta", c.situ_linear_beta)
    moe = FlashInferSm90MoE(w13, s13, w2, s2, first=first, count=count,
                            n_experts_total=c.experts, device=device, **kw)
    return moe, ""


# --------------------------------------------------------------------------------------
# the float64 model and the checks
# --------------------------------------------------------------------------------------

def _bf16(t: torch.Tensor) -> torch.Tensor:
    """Round to BF16 (RNE) and back to float64."""
    return t.to(torch.bfloat16).double()


def fp8_rows(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The runner's per-row FP8 quantization of FP32 ``v [P, n]``: ``q = 448 / max_j |v_j|``
    (FP32; 1 for an all-zero row), codes ``e4m3(v q)`` (RNE, saturating): ``(the codes'
    values as float64, q as float64 [P, 1])``."""
    v = v.float()
    amax = v.abs().amax(dim=1, keepdim=True)
    q = torch.where(amax > 0, torch.full_like(amax, FP8_MAX) / amax.clamp_min(FP8_MAX / 3.4028234663852886e38),
                    torch.ones_like(amax))
    return e4m3_to_float32(float32_to_e4m3(v * q)).double(), q.double()


def reference_forward(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w, *, first: int,
                      precision: str = "w4a16", activation: str = "situ", situ_beta: float = 4.0,
                      situ_linear_beta: float = 25.0) -> torch.Tensor:
    """Float64 ``[R, L]`` of what the runner computes, from our format (no conversion), with
    its rounding points: per local pair (``ids`` in ``[first, first + E_loc)``, ``w`` our four
    tensors of the ``E_loc`` local experts, decoded exactly by ``dequantize_mxfp4``):

    * ``w4a16``: ``h = bf16(x W13_e^T)``; ``a = bf16(act(h))``; ``o = bf16(a W2_e^T)``;
    * ``w4a8``: ``x8, q = fp8_rows(x)``, ``h = bf16((x8 W13_e^T) / q)``; ``f = fp32(act(h))``,
      ``a8, q2 = fp8_rows(f)``; ``o = bf16((a8 W2_e^T) / q2)``;

    then ``y = bf16(sum over the row's local pairs of w_p o_p)`` (the FP32 routing weights).
    Rows with no local pair are 0. The products and sums are exact (float64 of exact
    operands), each rounding once where the runner rounds."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
    count = w[0].shape[0]
    xd = x.double()
    if precision == "w4a8":
        xd, xq = fp8_rows(x.float())
    rw = weights.double()
    out = torch.zeros(x.shape[0], w[2].shape[1], dtype=torch.float64, device=x.device)
    for e in range(count):
        rows, slots = (ids.long() == first + e).nonzero(as_tuple=True)
        if not rows.numel():
            continue
        w13 = dequantize_mxfp4(w[0][e], w[1][e]).double()
        w2 = dequantize_mxfp4(w[2][e], w[3][e]).double()
        if precision == "w4a16":
            h = _bf16(xd[rows] @ w13.T)
            a = _bf16(gated_activation64(h, activation, situ_beta, situ_linear_beta))
            o = _bf16(a @ w2.T)
        else:
            h = _bf16((xd[rows] @ w13.T) / xq[rows])
            a8, q2 = fp8_rows(gated_activation64(h, activation, situ_beta, situ_linear_beta).float())
            o = _bf16((a8 @ w2.T) / q2)
        out.index_add_(0, rows, o * rw[rows, slots].unsqueeze(1))
    return _bf16(out)


def row_errors(y: torch.Tensor, ref: torch.Tensor, has: torch.Tensor) -> tuple[float, bool]:
    """``(worst ||y_r - ref_r|| / ||ref_r|| over rows with a local pair, rows without one
    exactly 0)``."""
    err = (y.double() - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-300)
    worst = float(err[has].max()) if bool(has.any()) else 0.0
    return worst, bool((y[~has] == 0).all())


def check_forward(*, precision: str = "w4a16", activation: str = "situ", layout: str = "owner", experts: int = 32,
                  latent: int = 256, intermediate: int = 128, rows: int = 24, top_k: int = 16, first: int = 8,
                  count: int = 12, seed: int = 0, device="cuda", raise_on_fail: bool = True, _kernel=None,
                  **kw) -> dict:
    """A whole call on a problem (default tiny: experts ``[8, 20)`` of 32 local, top-16, L =
    256, I = 128; row 0 has no local pair; ids lowered by 8 in the call, see
    :func:`expert_parallel`; ``first=12`` takes the unshifted path) against
    :func:`reference_forward` from our unconverted format. Weights of the ``count`` local
    experts only, scale codes :data:`SCALE_CODES`, ``x ~ N(0, 256 / L)`` in BF16, so that
    FC1's outputs have a standard deviation of about 6 at any ``L`` and SiTU works on its
    curved part, not only on its saturation. ``layout="compact"`` calls with the capacity
    of the problem (:func:`local_rows`, a host int computed before the call, as the
    benchmark does).

    Pass: BF16 ``[R, L]``, finite; rows without a local pair exactly 0; each row with one
    within ``||y_r - ref_r|| <= TOLERANCE[precision] ||ref_r||``.

    The bound for ``w4a16`` (``2^-6``): the model rounds where the runner rounds (BF16
    ``h``, BF16 ``a``, BF16 per-pair ``o``, BF16 ``y``) and differs from it only in what
    reaches each rounding: FP32 sums in another order instead of exact ones (relative
    ``<= K 2^-24`` of ``sum |x||w|``, ``K = L`` or ``I``) and the runner's FP32 SiTU with
    ``tanh(z) = 2 sigmoid(2z) - 1`` and fast ``exp`` (``~2^-21`` relative, ``25 * 2^-24``
    absolute in the up branch). A difference below half a BF16 unit can still flip a
    rounding, changing that element by one BF16 ulp (``<= 2^-7`` relative), with
    probability about the difference over the ulp: at most ``L^1.5 2^-16`` for worst-case
    sums (with ``|h| ~ sum|x||w| / sqrt(L)``: ``2^-4`` at L = 256), ``L 2^-16`` for
    random-walk ones (``2^-4`` at L = 3584), so each of the four roundings adds ``<=
    sqrt(2^-4) 2^-7 = 2^-9`` normwise, ``<= 2^-7`` together; the bound is twice that. For ``w4a8`` (``2^-5``) the
    same, plus the FP8 roundings of ``x`` and ``a``: ``x``'s are reproduced exactly (the
    same FP32 ``q``; the runner's fast division may differ by an ulp, moving a code with
    probability ``~2^-20``); ``a``'s follow a flipped BF16 ``h`` (one E4M3 unit, ``2^-3``
    relative, with probability ``~2^-8 / 2^-4`` per flipped element), and a flip at a
    row's largest ``|a|`` moves ``q2`` by ``2^-8`` relative and may move every code of the
    row by one unit with probability ``~1/16``: ``<= 2^-6`` normwise for such a row; twice
    that. Any layout mistake (rows not interleaved, gate and up swapped, scales not folded,
    the SiTU saturations swapped) gives ``> 2^-2`` (``tests/test_flashinfer_sm90_peer.py``,
    over a PyTorch model of the kernel). Also reported: ``row_rel_err_vs_w4a16`` (W4A8 only:
    the worst row's distance to the W4A16 model, the cost of the FP8 activations).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
    w = random_weights(count, latent, intermediate, device=device, seed=seed, scale_lo=SCALE_CODES[0],
                       scale_hi=SCALE_CODES[1])
    ids, rw = random_routing(rows, top_k, experts, first=first, count=count, device=device, seed=seed)
    g = torch.Generator(device=device).manual_seed(seed + 2)
    x = (torch.randn(rows, latent, generator=g, device=device) * (16.0 / latent ** 0.5)).to(torch.bfloat16)
    check_routing_inputs(x, ids, rw, latent=latent, n_experts_total=experts)
    moe = FlashInferSm90MoE(*w, first=first, count=count, n_experts_total=experts, precision=precision,
                            activation=activation, device=device, kernel=_kernel, **kw)
    cap = max(1, local_rows(ids, first, count))
    y = moe(x, ids, rw, layout=layout, capacity=cap)
    if y.is_cuda:
        torch.cuda.synchronize()
    has = ((ids >= first) & (ids < first + count)).any(dim=1)
    shape_ok = tuple(y.shape) == (rows, latent) and y.dtype == torch.bfloat16
    model = dict(first=first, activation=activation, situ_beta=moe.situ_beta, situ_linear_beta=moe.situ_linear_beta)
    ref = reference_forward(x, ids, rw, w, precision=precision, **model)
    worst, zero_rows_ok = row_errors(y, ref, has) if shape_ok else (float("inf"), False)
    tolerance = TOLERANCE[precision]
    ok = shape_ok and bool(torch.isfinite(y.double()).all()) and worst <= tolerance and zero_rows_ok
    res = {"ok": ok, "worst_row_rel_err": worst, "tolerance": tolerance,
           "rows_without_local_pair": int((~has).sum()), "zero_rows_ok": zero_rows_ok,
           "config": {"precision": precision, "activation": activation, "layout": layout, "experts": experts,
                      "latent": latent, "intermediate": intermediate, "rows": rows, "top_k": top_k, "first": first,
                      "count": count, "ep_size": moe.ep_size, "ep_rank": moe.ep_rank, "id_shift": moe.id_shift}}
    if precision == "w4a8" and shape_ok:
        res["row_rel_err_vs_w4a16"] = row_errors(y, reference_forward(x, ids, rw, w, precision="w4a16", **model),
                                                 has)[0]
    if raise_on_fail and not ok:
        raise AssertionError(f"FlashInfer SM90 peer forward check failed: {res}")
    return res


def check_interleave(device="cuda") -> dict:
    """GPU: :func:`interleave_fp4_codes` byte-equal to the library's
    ``interleave_moe_weights_for_sm90_mixed_gemm(w, "fp4")`` and :func:`interleave_scales` to
    FlashInfer's ``interleave_moe_scales_for_sm90_mixed_gemm``, at a tiny shape and at the
    real FC1 and FC2 shapes (two experts each): ``{name: bool}``."""
    load_module()
    fused_moe = import_flashinfer().fused_moe
    out, g = {}, torch.Generator(device=device).manual_seed(5)
    for name, (e, n, k) in {"tiny": (3, 256, 256), "fc1_real": (2, 6144, 3584), "fc2_real": (2, 3584, 3072)}.items():
        codes = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=device, generator=g)
        scales = torch.randint(0, 256, (e, n, k // 32), dtype=torch.uint8, device=device, generator=g)
        out[f"codes_{name}"] = bool(torch.equal(fused_moe.interleave_moe_weights_for_sm90_mixed_gemm(codes, "fp4"),
                                                interleave_fp4_codes(codes)))
        out[f"scales_{name}"] = bool(torch.equal(fused_moe.interleave_moe_scales_for_sm90_mixed_gemm(scales),
                                                 interleave_scales(scales)))
    return out


def _progress(*parts) -> None:
    print("fi90 smoke:", *parts, file=sys.stderr, flush=True)


def smoke(device="cuda", tokens: int = 4) -> dict:
    """GPU smoke: the library loads; the PyTorch interleave equals the library's
    (:func:`check_interleave`); the tiny checks (each precision the library holds, both
    activations, both layouts, the shifted and the unshifted ids); one DEP16 rank at the
    real dimensions checked the same way (experts ``[280, 336)`` of 896, I = 3072, ``16
    tokens`` rows; ``ep_rank`` 5 of 16); and warm-L2 CUDA-graph times of that call per
    precision and layout, with the runner's heuristic tactics, then after ``autotune``.
    Each step's result is also printed to stderr as it comes."""
    from benchmarks.gpu_timing import graph_replay_us

    ok, why = available()
    if not ok:
        raise RuntimeError(why)
    kernels = tuple(load_module()["entry"]["manifest"].get("kernels", ("w4a16",)))
    out = {"versions": versions()}
    _progress("versions", out["versions"])
    out["interleave"] = check_interleave(device)
    _progress("interleave equal to the library's", out["interleave"])
    started = time.time()
    checks = []
    for precision in kernels:
        cases = [dict(activation=a, layout=lay) for a in ACTIVATIONS for lay in LAYOUTS] + [dict(first=12)]
        for case in cases:
            checks.append(check_forward(precision=precision, device=device, raise_on_fail=False, autotune=False,
                                        **case))
            _progress("tiny check", precision, case, checks[-1]["ok"], checks[-1]["worst_row_rel_err"])
    out["checks"] = checks
    out["first_checks_s"] = round(time.time() - started, 1)
    rows, first, count = 16 * tokens, 280, 56
    out["dep16_rank"] = {}
    for p in kernels:
        out["dep16_rank"][p] = check_forward(precision=p, experts=896, latent=3584, intermediate=3072, rows=rows,
                                             first=first, count=count, device=device, raise_on_fail=False,
                                             autotune=False)
        _progress("DEP16 rank check", p, out["dep16_rank"][p]["ok"], out["dep16_rank"][p]["worst_row_rel_err"])
    w = random_weights(count, 3584, 3072, device=device, seed=1)
    ids, rw = random_routing(rows, 16, 896, first=first, count=count, device=device, seed=1)
    x = torch.randn(rows, 3584, device=device).to(torch.bfloat16)
    cap = max(1, local_rows(ids, first, count))
    times = out["dep16_rank_times"] = {}
    for tuned in (False, True):
        for p in kernels:
            tag = "tuned" if tuned else "heuristic"
            moe = FlashInferSm90MoE(*w, first=first, count=count, n_experts_total=896, precision=p, device=device,
                                    autotune=tuned)
            t0 = time.time()
            moe(x, ids, rw)  # tunes here where autotune is on
            torch.cuda.synchronize()
            times[f"{p}_{tag}_first_call_s"] = round(time.time() - t0, 1)
            for layout in LAYOUTS:
                times[f"{p}_{layout}_{tag}_us"] = round(graph_replay_us(
                    lambda moe=moe, layout=layout: moe(x, ids, rw, layout=layout, capacity=cap)), 1)
                _progress("DEP16 rank time", p, layout, tag, times[f"{p}_{layout}_{tag}_us"], "us")
            out.setdefault("describe", {})[p] = moe.describe()
    out["ok"] = (all(out["interleave"].values()) and all(c["ok"] for c in checks)
                 and all(c["ok"] for c in out["dep16_rank"].values()))
    return out


if __name__ == "__main__":
    res = smoke()
    print(json.dumps(res, indent=1, default=str))
    sys.exit(0 if res["ok"] else 1)
