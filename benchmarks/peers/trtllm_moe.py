"""Peer: FlashInfer's trtllm-gen MXFP4 MoE (``trtllm_fp4_block_scale_routed_moe``), Blackwell only.

The MoE that vLLM and SGLang run on B200 / GB200 / B300 / GB300 for MXFP4 checkpoints:
MXFP4 weights (E2M1 codes, one E8M0 scale per 32) x MXFP8 activations (E4M3 codes, one E8M0
scale per 32), trtllm-gen's batched GEMMs (cubins for sm_100a / sm_103a), the gated
activation fused into FC1's epilogue, the combine in a finalize kernel. This module turns
our weight format into the kernel's once, runs one MoE call, and checks itself on a tiny
problem (:func:`check_forward`) against a float64 computation of what the kernel computes,
so that no timing comes from a wrong result. **It has not run**: no Blackwell GPU was
available to this project. Everything that needs no GPU is tested on the CPU
(``tests/test_trtllm_peer.py``); the GPU contract is ``verify/test_trtllm_moe.py``.

Written against **FlashInfer 0.7.2.post1** (``flashinfer-python``, the version the project
pins for GPU nodes), read from its installed Python and C++ sources. This module imports
nothing but torch and the repository at import time; FlashInfer is imported on use.

**Our weights** (as in ``marlin_moe``): w13 codes ``uint8 [E, 2I, L/2]`` (rows gate
``0..I-1`` then up ``I..2I-1``; element ``2i`` in the low nibble), E8M0 scales ``uint8
[E, 2I, L/32]``; w2 codes ``uint8 [E, L, I/2]``, scales ``uint8 [E, L, I/32]``. The nibble
order is FlashInfer's too (its FP4 unpacking reads the first element of a pair from the low
nibble), so codes are moved by whole rows only.

**Conversion** (once, pure PyTorch, any device; FlashInfer's own MXFP4 x MXFP8 preparation
``flashinfer.fused_moe.prepare.prepare_trtllm_fp4_weights`` does the same to weights it
quantizes itself):

1. FC1 rows in the kernel's gated order: FlashInfer's gated activations take the FC1
   output as ``[x0; x1]`` = ``[linear (up); gate]`` ("x0 is linear/first; x1 is
   gate/second"), and ``reorder_rows_for_gated_act_gemm`` interleaves the halves, so
   row ``2j`` is up row ``j`` and row ``2j + 1`` gate row ``j``: from ours, row ``2j`` =
   our row ``I + j``, row ``2j + 1`` = our row ``j`` (:func:`gated_row_order`);
2. every matrix (FC1 after step 1, FC2 as it is) row-shuffled for the epilogue tile
   (``epilogue_tile_m = 128``, hence blocks of 32 rows): within each block of 32, kernel
   row ``d`` is source row ``4 (d % 8) + d // 8`` (``shuffle_matrix_a``'s
   ``srcToDstBlk32RowMap``: source ``4a + b`` goes to ``8b + a``;
   :func:`shuffle_row_order`);
3. the scales take the same row permutation as their codes (``shuffle_matrix_sf_a`` uses
   the codes' row indices for any ``num_elts_per_sf``), then each expert's ``[N, K/32]``
   is stored in the 128x4 tiled layout (``block_scale_interleave``, a CUDA op; here
   ``model.swizzle.swizzle_scales_128x4``, the same layout: FlashInfer's own unswizzle in
   its MoE trace reference reads it as ``[N/128, K/128, 32, 4, 4]`` tiles) and viewed as
   ``float8_e4m3fn`` ``[E, N, K/32]`` (the launcher requires that dtype for UE8M0 bytes;
   a pure relabelling, no byte changes).

Steps 1-3 are a permutation of bytes; :func:`restore_weights` inverts them exactly (tested).

**What one call does (what is timed)**, :meth:`TrtllmGenMoE.forward_mxfp8`:

* routing: our global ids and FP32 weights packed into ``int32 [R, K]`` as
  ``(expert_id << 16) | bf16_bits(weight)`` (the packed pre-computed format of the
  docstring; :func:`pack_topk`; the weight is rounded to BF16 here). The kernel maps the
  ids ``[local_expert_offset, local_expert_offset + local_num_experts)`` to its local
  experts and skips the others (expert parallelism: the DEP owner's view). With
  pre-computed ids the routing kernel only builds the permutation (its score
  pre/post-processing runs only where logits are given); ``routing_method_type`` is
  ``TopK`` (5, no normalization);
* ``trtllm_fp4_block_scale_routed_moe(packed, None, codes, scales, w13, s13, None, alpha,
  beta, None, w2, s2, None, ones, ones, ones, num_experts=E_total, top_k=K, n_group=None,
  topk_group=None, intermediate_size=I, local_expert_offset=first,
  local_num_experts=count, routed_scaling_factor=None, routing_method_type=5,
  do_finalize=True, activation_type=..., output=out,
  hidden_states_scale_layout=SfLayout.layout_linear)``: activations
  ``float8_e4m3fn [R, L]`` with linear E8M0 scales viewed ``float8_e4m3fn [R, L/32]``
  (FlashInfer deduces ``MxE4m3`` x ``MxE2m1`` from the dtypes and the scale count);
  the ``output*_scale_scalar`` are FP32 ones ``[count]`` (FlashInfer's MXFP4 preparation
  passes ones; MXFP8 activations do not require them);
* inside (the C++ runner): FC1 over the routed rows, FP32 accumulation, the gated
  activation on FP32, the result **re-quantized to MXFP8** (the FC1 output dtype is the
  activation dtype, ``MxE4m3``: E4M3 codes ``[padded tokens, I]`` and 128x4 E8M0 scales);
  FC2 (MXFP8 x MXFP4) -> BF16 per pair; finalize: each row's local pairs times their
  routing weight, summed -> BF16 ``[R, L]`` (``do_finalize=True``; the weights are the
  packed BF16 ones);
* :meth:`TrtllmGenMoE.__call__` takes BF16 ``x`` instead and quantizes it first with
  FlashInfer's ``mxfp8_quantize(x, is_sf_swizzled_layout=False)`` (vLLM's path; the same
  RCEIL codes as ``reference.mx.quantize_mxfp8``, bit for bit: the ``sm100`` contract
  ``verify/test_mx.py::test_flashinfer_mxfp8_quantize``).

**Activation.** ``activation="situ"`` (default): FlashInfer's ``ActivationType.Situ``
(10), ``beta tanh(x0 / beta) * alpha tanh(x1 / alpha) sigmoid(x1)`` with ``gemm1_alpha``
the gate scale and ``gemm1_beta`` the linear scale, per local expert, FP32; we pass 4.0 and
25.0 (``config.situ_beta``, ``config.situ_linear_beta``), which is **our SiTU-and-mul**:
``4 tanh(g/4) sigmoid(g) * 25 tanh(u/25)`` (FlashInfer 0.7.2's ``SiTU`` activation config
names these the canonical Kimi-K3 scales). ``activation="swiglu"``: ``ActivationType.Swiglu``
(3), ``x1 sigmoid(x1) x0`` (alpha 1, beta 0, no clamp: the parameters left ``None``), the
same cost class (one exp, a few FMAs per element). Offered for MXFP4 x MXFP8: SwiGLU,
GeGLU, SiTU, ReLU2 (FlashInfer's ``TrtllmFp4RoutedRunner``).

**Tactics.** 0.7.2 has no ``tile_tokens_dim`` argument: the tile (8, 16, 32, 64, 128,
192, 256 tokens for MXFP8 x MXFP4) and the kernel configuration are a tactic that
FlashInfer's ``AutoTuner`` picks; outside ``flashinfer.autotune()`` the launcher's default
(``[-1, -1]``: its heuristic) runs. ``autotune=True`` tunes once per row count, eagerly,
before the call that follows (so never inside a CUDA-graph capture). Requirements (the
preparation's): ``L % 128 == 0`` and ``I % 128 == 0`` (true at L = 3584, I = 3072 and the TP8
slice I_s = 384).

**Cubins and the JIT module.** 0.7.2 compiles its launcher (the ``fused_moe_trtllm_sm100``
JIT module: nvcc, the CUDA toolkit) unless ``flashinfer-jit-cache`` provides it prebuilt,
and reads the trtllm-gen batched-GEMM cubins (artifact ``TRTLLM_GEN_BMM``) from
``FLASHINFER_CUBIN_DIR``: the ``flashinfer-cubin`` package's directory if that package is
installed at the same version, else ``~/.cache/flashinfer/cubins``, which it fills from
NVIDIA's artifactory at first use (``FLASHINFER_CUBINS_REPOSITORY``). An offline node needs
the cubins there beforehand (``docs/gpu-node.md``); :func:`cubin_status` says which case
holds, :func:`available` loads the module and reports why it could not.

**Unverified until a Blackwell run** (each is what :func:`check_forward` decides on the
first run; a failure there keeps the peer out of the table):

* the layout of steps 1-3 as the cubins read it (settled from FlashInfer's preparation
  code, not from a run);
* the scale rule of the FC1 epilogue's MXFP8 re-quantization (inside the cubins):
  :func:`check_forward` accepts RCEIL or the OCP floor rule and reports which matched;
* that with pre-computed routing the packed BF16 weights reach finalize unchanged for
  ``routing_method_type=TopK``, and that rows with no local pair come out zero;
* that the routing kernels have a compiled tier for 896 experts x top-16 (permutation-only);
* the SiTU epilogue's ``tanh`` / ``sigmoid`` accuracy (covered by the tolerance);
* whether ``flashinfer-cubin`` 0.7.2.post1 exists as a wheel (PyPI's newest on 2026-12-05
  is 0.6.13; FlashInfer's CLI installs it from ``https://flashinfer.ai/whl``, which this
  project's machines cannot reach) and its size.

Smoke on a Blackwell node (the checks, then one DEP16 rank at the real dimensions)::

    PYTHONPATH=. python3 -m benchmarks.peers.trtllm_moe | tee trtllm_smoke.json
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from benchmarks.peers.triton_moe import (MX_BLOCK, check_int, check_routing_inputs, check_weights,
                                         expert_bytes, gated_activation64, random_routing,
                                         random_weights, rank_weight_slice, touched_experts)
from model.swizzle import swizzle_scales_128x4, unswizzle_scales_128x4

__all__ = [
    "FLASHINFER_VERSION", "ACTIVATIONS", "SUPPORTED_CAPABILITIES", "EPILOGUE_TILE_M", "SHUFFLE_BLOCK",
    "ROW_ALIGN", "ROUTING_METHOD_TOPK", "TOLERANCE", "import_flashinfer", "cubin_status", "available",
    "versions", "check_dims", "gated_row_order", "shuffle_row_order", "w13_row_order", "w2_row_order",
    "convert_codes", "convert_scales", "convert_weights", "restore_weights", "pack_topk", "unpack_topk",
    "TrtllmGenMoE", "rank_moe", "reference_forward", "check_forward", "smoke",
]

FLASHINFER_VERSION = "0.7.2.post1"
ACTIVATIONS = {"situ": 10, "swiglu": 3}
"""Our name -> FlashInfer's ``ActivationType`` value (``Situ`` = 10, ``Swiglu`` = 3)."""
SUPPORTED_CAPABILITIES = ((10, 0), (10, 3))
"""sm_100a (B200, GB200) and sm_103a (B300, GB300): the trtllm-gen MXFP4 x MXFP8 cubins."""
EPILOGUE_TILE_M = 128
SHUFFLE_BLOCK = 32
"""Rows per shuffle block: 32 for an epilogue tile that is a multiple of 128 (else 16)."""
ROW_ALIGN = 128
"""MXFP4 weights: hidden and intermediate sizes multiples of 128 (FlashInfer's preparation)."""
ROUTING_METHOD_TOPK = 5
"""``RoutingMethodType.TopK``: no softmax / renormalization of the (pre-computed) weights."""
SCALE_CODES = (121, 125)
"""The check's weight scale codes (``2^-6 .. 2^-2``): see :func:`check_forward`."""
TOLERANCE = 2.0 ** -5
""":func:`check_forward`'s per-row normwise bound (its docstring derives it)."""
MAX_EXPERT_ID = 2 ** 15 - 1
_TUNE_DEFAULT = 8192


# --------------------------------------------------------------------------------------
# FlashInfer: import, cubins, availability
# --------------------------------------------------------------------------------------

def import_flashinfer():
    """``flashinfer`` at the pinned version.

    Raises:
        ImportError: FlashInfer is not importable, or its version is not
            :data:`FLASHINFER_VERSION` (the layout was read from that version's source).
    """
    try:
        import flashinfer
    except Exception as e:  # an ImportError, or a broken install's RuntimeError
        raise ImportError(f"FlashInfer is not importable ({type(e).__name__}: {e}); pip install "
                          f"flashinfer-python=={FLASHINFER_VERSION}") from e
    version = getattr(flashinfer, "__version__", "unknown")
    if version != FLASHINFER_VERSION:
        raise ImportError(f"FlashInfer {version} is installed; this peer was written against "
                          f"{FLASHINFER_VERSION} (its weight layout and arguments)")
    return flashinfer


def cubin_status() -> tuple[bool, str]:
    """Whether the trtllm-gen batched-GEMM cubins are on this machine (no download, no
    GPU): ``(True, where)`` when the artifact's ``checksums.txt`` is in FlashInfer's cubin
    directory, else ``(False, why)`` naming the directory, whether ``flashinfer-cubin`` is
    installed, and that FlashInfer would download them from its repository at first use.

    Raises:
        ImportError: as :func:`import_flashinfer`.
    """
    import_flashinfer()
    import importlib.util

    from flashinfer.artifacts import ArtifactPath
    from flashinfer.jit import env as jit_env

    folder = jit_env.FLASHINFER_CUBIN_DIR
    marker = folder / ArtifactPath.TRTLLM_GEN_BMM / "checksums.txt"
    if marker.is_file():
        return True, f"trtllm-gen BMM cubins in {folder}"
    package = importlib.util.find_spec("flashinfer_cubin") is not None
    return False, (f"no trtllm-gen BMM cubins in {folder} (flashinfer-cubin "
                   f"{'installed but not used: another version' if package else 'not installed'}); "
                   "FlashInfer downloads them at first use from "
                   f"{os.environ.get('FLASHINFER_CUBINS_REPOSITORY', 'NVIDIA artifactory')}")


_MODULE_ERROR: str | None = None
_MODULE_LOADED = False


def _load_module() -> str | None:
    """Build / load FlashInfer's trtllm-gen MoE module once (downloads cubins where they
    are missing and the repository is reachable; compiles the launcher without
    ``flashinfer-jit-cache``): None, or the error."""
    global _MODULE_ERROR, _MODULE_LOADED
    if not _MODULE_LOADED:
        try:
            from flashinfer.fused_moe.core import get_trtllm_moe_sm100_module

            get_trtllm_moe_sm100_module()
        except Exception as e:  # reported, not hidden
            _MODULE_ERROR = f"{type(e).__name__}: {e}"
        _MODULE_LOADED = True
    return _MODULE_ERROR


def available() -> tuple[bool, str]:
    """``(True, "")`` where the peer can run, else ``(False, reason)``: FlashInfer
    :data:`FLASHINFER_VERSION` imports; a CUDA GPU is visible and is SM100 or SM103
    (:data:`SUPPORTED_CAPABILITIES`); the trtllm-gen MoE module loads (its cubins present
    or downloadable, its launcher prebuilt or compilable)."""
    try:
        import_flashinfer()
    except ImportError as e:
        return False, f"trtllm-gen peer unavailable: {e}"
    if not torch.cuda.is_available():
        return False, "the trtllm-gen MXFP4 MoE needs an SM100/SM103 GPU (no CUDA GPU visible)"
    cap = torch.cuda.get_device_capability()
    if tuple(cap) not in SUPPORTED_CAPABILITIES:
        return False, (f"the trtllm-gen MXFP4 x MXFP8 MoE runs on sm_100a/sm_103a (B200, GB200, "
                       f"B300, GB300) only; this GPU is sm_{cap[0]}{cap[1]}")
    error = _load_module()
    if error is not None:
        try:
            where = cubin_status()[1]
        except ImportError as e:
            where = f"cubin directory unknown ({e})"
        return False, f"FlashInfer's trtllm-gen MoE module did not load ({error}); {where}"
    return True, ""


def versions() -> dict:
    """For a benchmark record: FlashInfer's version and where its cubins are."""
    out = {"flashinfer_pinned": FLASHINFER_VERSION, "torch": torch.__version__}
    try:
        fi = import_flashinfer()
        out["flashinfer"] = fi.__version__
        out["cubins"] = cubin_status()[1]
    except ImportError as e:
        out["error"] = str(e)
    return out


# --------------------------------------------------------------------------------------
# pure PyTorch: dims, row orders, weight conversion, top-k packing
# --------------------------------------------------------------------------------------

def check_dims(latent: int, intermediate: int) -> None:
    """MXFP4 weights need ``latent % 128 == 0`` and ``intermediate % 128 == 0``; ValueError
    naming the one that is not."""
    for name, v in (("latent", latent), ("intermediate", intermediate)):
        check_int(v, name, 1)
        if v % ROW_ALIGN:
            raise ValueError(f"{name}={v}: the trtllm-gen MXFP4 MoE needs a multiple of {ROW_ALIGN}")


def gated_row_order(intermediate: int) -> torch.Tensor:
    """int64 ``[2I]``: kernel FC1 row ``n`` takes our row ``order[n]``: ``2j`` -> ``I + j``
    (up), ``2j + 1`` -> ``j`` (gate) (step 1 of the module docstring)."""
    check_int(intermediate, "intermediate", 1)
    j = torch.arange(intermediate, dtype=torch.int64)
    return torch.stack((intermediate + j, j), dim=1).reshape(-1)


def shuffle_row_order(rows: int, block: int = SHUFFLE_BLOCK) -> torch.Tensor:
    """int64 ``[rows]``: the epilogue-tile shuffle, row ``d`` of a block of 32 taking source
    row ``4 (d % 8) + d // 8`` (block 16: ``2 (d % 8) + d // 8``) of the same block."""
    check_int(rows, "rows", 1)
    if block not in (16, 32):
        raise ValueError(f"block must be 16 or 32, got {block!r}")
    if rows % block:
        raise ValueError(f"rows={rows} must be a multiple of the shuffle block {block}")
    d = torch.arange(rows, dtype=torch.int64)
    local = d % block
    return d - local + (block // 8) * (local % 8) + local // 8


def w13_row_order(intermediate: int) -> torch.Tensor:
    """int64 ``[2I]``: kernel FC1 row ``n`` = our w13 row ``gated[shuffle[n]]`` (steps 1, 2)."""
    return gated_row_order(intermediate)[shuffle_row_order(2 * intermediate)]


def w2_row_order(latent: int) -> torch.Tensor:
    """int64 ``[L]``: kernel FC2 row ``n`` = our w2 row ``shuffle[n]`` (step 2)."""
    return shuffle_row_order(latent)


def _check_order(order: torch.Tensor, rows: int, name: str) -> None:
    if not isinstance(order, torch.Tensor) or order.dtype != torch.int64 or tuple(order.shape) != (rows,):
        raise ValueError(f"{name}: order must be int64 [{rows}], got "
                         f"{getattr(order, 'dtype', type(order).__name__)} {tuple(getattr(order, 'shape', ()))}")


def convert_codes(codes: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Our codes ``uint8 [E, N, K/2]`` -> the kernel's ``uint8 [E, N, K/2]``: row ``n`` of
    each expert is our row ``order[n]`` (whole rows: the nibble order is the same)."""
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8 or codes.dim() != 3:
        raise ValueError(f"codes must be uint8 [E, N, K/2], got {getattr(codes, 'dtype', type(codes).__name__)} "
                         f"{tuple(getattr(codes, 'shape', ()))}")
    _check_order(order, codes.shape[1], "convert_codes")
    return codes.index_select(1, order.to(codes.device)).contiguous()


def convert_scales(scales: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Our E8M0 scales ``uint8 [E, N, K/32]`` -> the kernel's ``float8_e4m3fn [E, N, K/32]``
    (the bytes relabelled): rows permuted by ``order``, then each expert's ``[N, K/32]`` in
    the 128x4 tiled layout (``N % 128 == 0`` and ``K/32 % 4 == 0``: no padding, so the size
    is unchanged)."""
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.uint8 or scales.dim() != 3:
        raise ValueError(f"scales must be uint8 [E, N, K/32], got "
                         f"{getattr(scales, 'dtype', type(scales).__name__)} {tuple(getattr(scales, 'shape', ()))}")
    e, n, groups = scales.shape
    if n % 128 or groups % 4:
        raise ValueError(f"scales [E, N, K/32] = {list(scales.shape)}: the 128x4 layout without padding "
                         "needs N % 128 == 0 and K/32 % 4 == 0")
    _check_order(order, n, "convert_scales")
    rows = scales.index_select(1, order.to(scales.device))
    out = torch.stack([swizzle_scales_128x4(rows[i]) for i in range(e)]) if e else rows.reshape(0, n * groups)
    return out.reshape(e, n, groups).view(torch.float8_e4m3fn)


def convert_weights(w13_codes, w13_scales, w2_codes, w2_scales) -> dict:
    """Our four tensors (``[E, ...]``, any device) -> the kernel's ``gemm1_weights``,
    ``gemm1_weights_scale``, ``gemm2_weights``, ``gemm2_weights_scale`` (module docstring,
    steps 1-3)."""
    e, lat, inter = check_weights(w13_codes, w13_scales, w2_codes, w2_scales)
    check_dims(lat, inter)
    o13, o2 = w13_row_order(inter), w2_row_order(lat)
    return {"gemm1_weights": convert_codes(w13_codes, o13), "gemm1_weights_scale": convert_scales(w13_scales, o13),
            "gemm2_weights": convert_codes(w2_codes, o2), "gemm2_weights_scale": convert_scales(w2_scales, o2)}


def restore_weights(converted: dict) -> tuple[torch.Tensor, ...]:
    """Inverse of :func:`convert_weights`: ``(w13_codes, w13_scales, w2_codes, w2_scales)``
    in our layout (uint8)."""
    g1, g2 = converted["gemm1_weights"], converted["gemm2_weights"]
    inter, lat = g1.shape[1] // 2, g2.shape[1]
    out = []
    for codes, scales, order in ((g1, converted["gemm1_weights_scale"], w13_row_order(inter)),
                                 (g2, converted["gemm2_weights_scale"], w2_row_order(lat))):
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        e, n, groups = scales.shape
        linear = torch.stack([unswizzle_scales_128x4(scales[i].view(torch.uint8).reshape(-1), n, groups)
                              for i in range(e)]) if e else scales.view(torch.uint8)
        out += [codes.index_select(1, inverse.to(codes.device)).contiguous(),
                linear.index_select(1, inverse.to(codes.device)).contiguous()]
    return out[0], out[1], out[2], out[3]


def pack_topk(ids: torch.Tensor, weights: torch.Tensor, *, check: bool = True) -> torch.Tensor:
    """``int32 [R, K]``: ``(ids << 16) | bf16_bits(weights)`` (FlashInfer's packed
    pre-computed routing; the weight rounded to BF16, RNE, its 16 bits in the low half).

    Args:
        ids: int32/int64 ``[R, K]``, global expert ids in ``[0, 32767]``.
        weights: float32/bfloat16 ``[R, K]``, finite.
        check: validate (the range and finiteness checks synchronize with the device);
            ``False`` inside a timed call or a CUDA-graph capture (device ops only).

    Raises:
        ValueError: naming ``ids`` or ``weights`` (dtype, shape, device; with ``check``,
            range and finiteness).
    """
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 2:
        raise ValueError(f"ids must be an int32/int64 [R, K] tensor, got "
                         f"{getattr(ids, 'dtype', type(ids).__name__)} {tuple(getattr(ids, 'shape', ()))}")
    if not isinstance(weights, torch.Tensor) or weights.dtype not in (torch.float32, torch.bfloat16) \
            or tuple(weights.shape) != tuple(ids.shape) or weights.device != ids.device:
        raise ValueError(f"weights must be a float32/bfloat16 {tuple(ids.shape)} tensor on {ids.device}, got "
                         f"{getattr(weights, 'dtype', type(weights).__name__)} "
                         f"{tuple(getattr(weights, 'shape', ()))} on {getattr(weights, 'device', None)}")
    if check and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) > MAX_EXPERT_ID):
        raise ValueError(f"ids must lie in [0, {MAX_EXPERT_ID}] (16 bits of the packed word), got "
                         f"[{int(ids.min())}, {int(ids.max())}]")
    if check and not bool(torch.isfinite(weights).all()):
        raise ValueError("weights must be finite")
    bits = weights.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    return ((ids.to(torch.int32) << 16) | bits).contiguous()


def unpack_topk(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_topk`: ``(ids int32, weights bfloat16)``."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.int32:
        raise ValueError(f"packed must be an int32 tensor, got {getattr(packed, 'dtype', type(packed).__name__)}")
    low = (packed & 0xFFFF).to(torch.int16)  # the bit pattern, wrapped into int16
    return packed >> 16, low.view(torch.bfloat16)


# --------------------------------------------------------------------------------------
# the peer
# --------------------------------------------------------------------------------------

class TrtllmGenMoE:
    """FlashInfer's trtllm-gen MXFP4 x MXFP8 MoE over our weights, one object per weight set.

    Args:
        w13_codes, w13_scales, w2_codes, w2_scales: our uint8 tensors (module docstring):
            either all ``E`` experts (then ``[first, first + count)`` are taken) or exactly
            the ``count`` local ones. Any device; converted on ``device``.
        first, count: the local experts (``local_expert_offset``, ``local_num_experts``);
            ``count=None`` = all from ``first``.
        n_experts_total: the model's expert count (``num_experts``; default ``E`` of the
            given weights when they are the full set, else ``first + count``).
        activation: ``"situ"`` or ``"swiglu"`` (:data:`ACTIVATIONS`).
        situ_beta, situ_linear_beta: SiTU's gate and up saturations (our names; FlashInfer's
            ``gemm1_alpha`` and ``gemm1_beta``), positive.
        autotune: tune each row count once under ``flashinfer.autotune()`` before its first
            call (eager; default True).
        tune_max_num_tokens: FlashInfer's tuning range (default 8192).
        device: where the converted weights live and calls run (``"cpu"`` builds for tests).
        kernel: a callable with ``trtllm_fp4_block_scale_routed_moe``'s keyword arguments
            (tests pass a PyTorch model of it); default FlashInfer's, on a GPU.
    """

    def __init__(self, w13_codes, w13_scales, w2_codes, w2_scales, first: int = 0, count: int | None = None, *,
                 n_experts_total: int | None = None, activation: str = "situ", situ_beta: float = 4.0,
                 situ_linear_beta: float = 25.0, autotune: bool = True, tune_max_num_tokens: int = _TUNE_DEFAULT,
                 device="cuda", kernel=None):
        e, lat, inter = check_weights(w13_codes, w13_scales, w2_codes, w2_scales)
        check_dims(lat, inter)
        sl, first, count, n_experts_total = self._local_slice(e, first, count, n_experts_total)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        for name, v in (("situ_beta", situ_beta), ("situ_linear_beta", situ_linear_beta)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise ValueError(f"{name} must be a finite positive float, got {v!r}")
        check_int(tune_max_num_tokens, "tune_max_num_tokens", 1)
        self.first, self.count = first, count
        self.latent, self.intermediate, self.n_experts_total = lat, inter, n_experts_total
        self.activation, self.situ_beta, self.situ_linear_beta = activation, float(situ_beta), float(situ_linear_beta)
        self.autotune, self.tune_max_num_tokens = bool(autotune), tune_max_num_tokens
        self.device = torch.device(device)
        self._fi, self._kernel = self._bind_kernel(kernel)
        dev = self.device
        self.weights = convert_weights(*(t[sl].to(dev) for t in (w13_codes, w13_scales, w2_codes, w2_scales)))
        ones = torch.ones(self.count, dtype=torch.float32, device=dev)
        self.scalars = {"output1_scale_scalar": ones, "output1_scale_gate_scalar": ones,
                        "output2_scale_scalar": ones}
        self.gemm1_alpha = self.gemm1_beta = None
        if activation == "situ":
            self.gemm1_alpha = torch.full((self.count,), self.situ_beta, dtype=torch.float32, device=dev)
            self.gemm1_beta = torch.full((self.count,), self.situ_linear_beta, dtype=torch.float32, device=dev)
        self._tuned: set[int] = set()
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
        if total > MAX_EXPERT_ID + 1:
            raise ValueError(f"n_experts_total={total}: the packed ids hold at most {MAX_EXPERT_ID + 1} experts")
        return sl, first, count, total

    def _bind_kernel(self, kernel):
        if kernel is not None:
            return None, kernel
        if self.device.type != "cuda":
            return None, None
        ok, why = available()
        if not ok:
            raise RuntimeError(why)
        fi = import_flashinfer()
        return fi, fi.fused_moe.trtllm_fp4_block_scale_routed_moe

    def describe(self) -> dict:
        """The configuration, for a benchmark record."""
        return {"peer": "FlashInfer trtllm_fp4_block_scale_routed_moe (trtllm-gen, MXFP4 x MXFP8)",
                "flashinfer": FLASHINFER_VERSION,
                "weights": "FC1 rows [up; gate] interleaved, epilogue-tile shuffle (32-row blocks); "
                           "E8M0 scales same rows, 128x4 tiled",
                "activation": (f"SiTU (ActivationType.Situ, gate {self.situ_beta:g}, linear "
                               f"{self.situ_linear_beta:g})" if self.activation == "situ"
                               else "SwiGLU (ActivationType.Swiglu)"),
                "routing": "packed (id << 16 | bf16 weight), routing_method_type TopK, do_finalize",
                "tactic": "flashinfer.autotune per row count" if self.autotune else "launcher default",
                "first": self.first, "count": self.count, "n_experts_total": self.n_experts_total,
                "latent": self.latent, "intermediate": self.intermediate,
                "bytes_per_expert": self.bytes_per_expert}

    def _require_kernel(self, *tensors) -> None:
        if self._kernel is None:
            raise RuntimeError(f"TrtllmGenMoE was built on {self.device} without a kernel; calls need "
                               "an SM100/SM103 GPU (device='cuda')")
        for name, t in tensors:
            if t.device != self.weights["gemm1_weights"].device:
                raise ValueError(f"{name} is on {t.device}, the converted weights on "
                                 f"{self.weights['gemm1_weights'].device}")

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """BF16 ``[R, L]`` -> ``(codes float8_e4m3fn [R, L], scales uint8 [R, L/32])``, linear
        layout: FlashInfer's ``mxfp8_quantize`` on the GPU, ``reference.mx.quantize_mxfp8``
        (the same RCEIL codes) elsewhere."""
        if self._fi is not None:
            codes, sf = self._fi.mxfp8_quantize(x, is_sf_swizzled_layout=False)
            return codes, sf.view(torch.uint8).reshape(x.shape[0], -1)
        from reference.mx import quantize_mxfp8

        return quantize_mxfp8(x)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """MXFP8-quantize BF16 ``x [R, L]`` (:meth:`quantize`), then :meth:`forward_mxfp8`."""
        self._require_kernel(("x", x), ("ids", ids), ("weights", weights))
        codes, scales = self.quantize(x)
        return self.forward_mxfp8(codes, scales, ids, weights)

    def forward_mxfp8(self, codes: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor,
                      weights: torch.Tensor) -> torch.Tensor:
        """One MoE call on MXFP8 activations: BF16 ``[R, L]`` (rows without a local pair 0).

        ``codes`` float8_e4m3fn (or its uint8 bytes) ``[R, L]``, ``scales`` uint8 E8M0 ``[R,
        L/32]`` (linear; e.g. ``reference.mx.quantize_mxfp8``), ``ids`` int32/int64 ``[R, K]``
        global expert ids, ``weights`` float32 ``[R, K]`` (rounded to BF16 by the packing).
        No validation inside and no host synchronization (the packing without its checks):
        run ``check_routing_inputs`` once outside the timed region.
        """
        return self.call_packed(codes, scales, pack_topk(ids, weights, check=False))

    def call_packed(self, codes: torch.Tensor, scales: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """:meth:`forward_mxfp8` with the routing already packed (``int32 [R, K]``,
        :func:`pack_topk`): the kernel call alone, no host synchronization."""
        self._require_kernel(("codes", codes), ("scales", scales), ("packed", packed))
        r = codes.shape[0]
        if tuple(codes.shape) != (r, self.latent) or tuple(scales.shape) != (r, self.latent // MX_BLOCK) \
                or packed.dim() != 2 or packed.shape[0] != r:
            raise ValueError(f"codes [R, {self.latent}], scales [R, {self.latent // MX_BLOCK}] and packed [R, K] "
                             f"must agree, got {tuple(codes.shape)}, {tuple(scales.shape)}, {tuple(packed.shape)}")
        kwargs = self._arguments(codes.view(torch.float8_e4m3fn), scales.view(torch.float8_e4m3fn), packed)
        if self.autotune and self._fi is not None and r not in self._tuned:
            with self._fi.autotune(True):
                self._kernel(**dict(kwargs, output=torch.empty_like(kwargs["output"])))
            self._tuned.add(r)
        result = self._kernel(**kwargs)
        return result[0] if isinstance(result, (list, tuple)) else result

    def _arguments(self, codes, scales, packed) -> dict:
        """The keyword arguments of ``trtllm_fp4_block_scale_routed_moe`` for one call."""
        layout = self._fi.tllm_enums.SfLayout.layout_linear if self._fi is not None else "layout_linear"
        return dict(
            topk_ids=packed, routing_bias=None, hidden_states=codes.contiguous(),
            hidden_states_scale=scales.contiguous(), gemm1_bias=None, gemm1_alpha=self.gemm1_alpha,
            gemm1_beta=self.gemm1_beta, gemm1_clamp_limit=None, gemm2_bias=None,
            num_experts=self.n_experts_total, top_k=packed.shape[1], n_group=None, topk_group=None,
            intermediate_size=self.intermediate, local_expert_offset=self.first,
            local_num_experts=self.count, routed_scaling_factor=None,
            routing_method_type=ROUTING_METHOD_TOPK, do_finalize=True, enable_pdl=None,
            activation_type=ACTIVATIONS[self.activation],
            output=torch.empty(codes.shape[0], self.latent, dtype=torch.bfloat16, device=codes.device),
            tune_max_num_tokens=self.tune_max_num_tokens, hidden_states_scale_layout=layout,
            **self.weights, **self.scalars)

    def bytes_streamed(self, ids: torch.Tensor) -> int:
        """Our MXFP4 weight bytes one call must read for ``ids`` (host sync)."""
        return touched_experts(ids, self.first, self.count) * self.bytes_per_expert


def rank_moe(weights, first: int, count: int, shard: tuple[int, int] = (0, 1), *,
             device="cuda", **kw) -> tuple[TrtllmGenMoE | None, str]:
    """The peer over one rank's experts of a ``model.weights.LatentMoEWeights``: experts
    ``[first, first + count)``, the ``shard = (rank, ranks)`` slice of their intermediate
    (gate and up rows of the slice, the matching w2 columns), SiTU with the config's
    saturations: ``(TrtllmGenMoE, "")`` or ``(None, why)`` where the peer cannot run."""
    ok, why = available()
    if not ok:
        return None, why
    c = weights.config
    w13, s13, w2, s2 = rank_weight_slice(weights, first, count, shard)
    kw.setdefault("situ_beta", c.situ_beta)
    kw.setdefault("situ_linear_beta", c.situ_linear_beta)
    moe = TrtllmGenMoE(w13, s13, w2, s2, first=first, count=count,
                       n_experts_total=c.experts, device=device, **kw)
    return moe, ""


# --------------------------------------------------------------------------------------
# the float64 model and the check
# --------------------------------------------------------------------------------------

def reference_forward(codes: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                      w, *, first: int, activation: str = "situ", situ_beta: float = 4.0,
                      situ_linear_beta: float = 25.0, hidden_rule=None) -> torch.Tensor:
    """Float64 ``[R, L]`` of what the kernel computes, from our format (no conversion):
    per local pair (``ids`` in ``[first, first + E_loc)``, ``w`` our four tensors of the
    ``E_loc`` local experts) ``h = x @ W13_e^T`` with ``x`` the MXFP8 activations
    dequantized; the gated activation on ``h`` (FP32-exact inputs, float64 math); the result
    re-quantized to MXFP8 (``reference.mx.quantize_mxfp8`` of its FP32 rounding,
    ``hidden_rule``: ``model.formats.ScaleRule``, default RCEIL) and dequantized; ``o =
    a @ W2_e^T`` times the routing weight rounded to BF16 (the packing); the row's local
    pairs summed. Rows with no local pair are 0."""
    from model.formats import ScaleRule, dequantize_mxfp4
    from reference.mx import dequantize_mxfp8, quantize_mxfp8

    rule = ScaleRule.RCEIL if hidden_rule is None else hidden_rule
    count = w[0].shape[0]
    x = dequantize_mxfp8(codes.view(torch.float8_e4m3fn), scales.view(torch.uint8)).double()
    rw = weights.to(torch.bfloat16).double()
    out = torch.zeros(x.shape[0], w[2].shape[1], dtype=torch.float64, device=x.device)
    for e in range(count):
        rows, slots = (ids == first + e).nonzero(as_tuple=True)
        if not rows.numel():
            continue
        h = x[rows] @ dequantize_mxfp4(w[0][e], w[1][e]).double().T
        a = gated_activation64(h, activation, situ_beta, situ_linear_beta)
        a = dequantize_mxfp8(*quantize_mxfp8(a.float(), scale_rule=rule)).double()
        o = a @ dequantize_mxfp4(w[2][e], w[3][e]).double().T
        out.index_add_(0, rows, o * rw[rows, slots].unsqueeze(1))
    return out


def row_errors(y: torch.Tensor, ref: torch.Tensor, has: torch.Tensor) -> tuple[float, bool]:
    """``(worst ||y_r - ref_r|| / ||ref_r|| over rows with a local pair, rows without one
    exactly 0)``."""
    err = (y.double() - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-300)
    worst = float(err[has].max()) if bool(has.any()) else 0.0
    return worst, bool((y[~has] == 0).all())


def check_forward(*, activation: str = "situ", experts: int = 32, latent: int = 256, intermediate: int = 128,
                  rows: int = 24, top_k: int = 16, first: int = 8, count: int = 12, seed: int = 0,
                  device="cuda", bf16_input: bool = False, raise_on_fail: bool = True, _kernel=None,
                  **kw) -> dict:
    """A whole call on a problem (default tiny: experts ``[8, 20)`` of 32 local, top-16, L =
    256, I = 128; row 0 has no local pair; weights of the ``count`` local experts only,
    scale codes :data:`SCALE_CODES`, ``x ~ N(0, 256 / L)``, so that FC1's outputs have a
    standard deviation of about 3 at any ``L`` and SiTU works on its curved part, not only
    its saturation) against :func:`reference_forward` from our unconverted format.

    Pass: BF16 ``[R, L]``, finite; rows without a local pair exactly 0; each row with one
    within ``||y_r - ref_r|| <= 2^-5 ||ref_r||`` (:data:`TOLERANCE`) of the model under
    one of the two MXFP8 scale rules for the hidden, RCEIL (FlashInfer's ``mxfp8_quantize``
    rule) or the OCP floor rule (``model.formats.ScaleRule``): the rule of the FC1 epilogue
    is inside the cubins, and the two models differ by about 2^-5 (SiTU) to 2^-4 (SwiGLU)
    per row on this problem
    (the floor rule saturates a block's largest element at 448 where RCEIL rounds it to 480
    or 448 in the next binade), so the check reports the rule that matched
    (``hidden_rule``) and each rule's worst error.

    The tolerance, for the matching rule: the model reproduces every rounding of the
    kernel's computation but (a) the FP32 hidden before its quantization, which differs by
    the FC1 accumulation order (``<= L 2^-24`` of ``|x||w|``) and the epilogue's
    ``tanh``/``sigmoid`` approximations (``~2^-10`` relative): each may move an element
    across an E4M3 rounding boundary, changing it by one E4M3 ulp (``2^-4`` to ``2^-3``
    relative) with probability about ``2^-10 / 2^-4``, so ``~2^-7`` normwise; (b) the
    per-pair BF16 FC2 output and the BF16 result, ``2 * 2^-9`` relative (RNE). Together
    ``<= 2^-6``; the bound is twice that. Any layout mistake (rows not shuffled, gate and
    up swapped, the scales' tiles misplaced, the SiTU scales swapped) gives ``> 2^-2``
    (``tests/test_trtllm_peer.py``, over a PyTorch model of the kernel). Activations: MXFP8
    (RCEIL) of BF16 ``x``, passed as codes and scales (``bf16_input=True``: BF16 ``x``
    through :meth:`TrtllmGenMoE.__call__`, quantized by FlashInfer; the model then uses our
    quantization of the same ``x``, bit-equal by the ``mxfp8_quantize`` contract).
    """
    from model.formats import ScaleRule
    from reference.mx import quantize_mxfp8

    w = random_weights(count, latent, intermediate, device=device, seed=seed, scale_lo=SCALE_CODES[0],
                       scale_hi=SCALE_CODES[1])
    ids, rw = random_routing(rows, top_k, experts, first=first, count=count, device=device, seed=seed)
    g = torch.Generator(device=device).manual_seed(seed + 2)
    x = (torch.randn(rows, latent, generator=g, device=device) * (16.0 / latent ** 0.5)).to(torch.bfloat16)
    check_routing_inputs(x, ids, rw, latent=latent, n_experts_total=experts)
    moe = TrtllmGenMoE(*w, first=first, count=count, n_experts_total=experts, activation=activation,
                       device=device, kernel=_kernel, **kw)
    codes, scales = quantize_mxfp8(x)
    y = moe(x, ids, rw) if bf16_input else moe.forward_mxfp8(codes, scales, ids, rw)
    if y.is_cuda:
        torch.cuda.synchronize()
    has = ((ids >= first) & (ids < first + count)).any(dim=1)
    shape_ok = tuple(y.shape) == (rows, latent) and y.dtype == torch.bfloat16
    errors, zero_rows_ok = {}, False
    for rule in ScaleRule:
        ref = reference_forward(codes, scales, ids, rw, w, first=first, activation=activation,
                                situ_beta=moe.situ_beta, situ_linear_beta=moe.situ_linear_beta, hidden_rule=rule)
        errors[rule.value], zero_rows_ok = row_errors(y, ref, has) if shape_ok else (float("inf"), False)
    rule, worst = min(errors.items(), key=lambda item: item[1])
    ok = shape_ok and bool(torch.isfinite(y.double()).all()) and worst <= TOLERANCE and zero_rows_ok
    res = {"ok": ok, "worst_row_rel_err": worst, "hidden_rule": rule, "row_rel_err_by_rule": errors,
           "tolerance": TOLERANCE, "rows_without_local_pair": int((~has).sum()), "zero_rows_ok": zero_rows_ok,
           "config": {"activation": activation, "experts": experts, "latent": latent, "intermediate": intermediate,
                      "rows": rows, "top_k": top_k, "first": first, "count": count, "bf16_input": bf16_input}}
    if raise_on_fail and not ok:
        raise AssertionError(f"trtllm-gen peer forward check failed: {res}")
    return res



def smoke(device="cuda", tokens: int = 4) -> dict:
    """GPU smoke: the tiny checks (both activations, MXFP8 and BF16 inputs), one DEP16 rank
    at the real dimensions checked the same way (experts ``[280, 336)`` of 896, I = 3072,
    ``16 tokens`` rows), and a warm-L2 CUDA-graph time of that call."""
    from benchmarks.gpu_timing import graph_replay_us

    ok, why = available()
    if not ok:
        raise RuntimeError(why)
    out = {"versions": versions()}
    started = time.time()
    out["checks"] = [check_forward(activation=a, bf16_input=b, device=device, raise_on_fail=False)
                     for a in ACTIVATIONS for b in (False, True)]
    out["first_checks_s"] = round(time.time() - started, 1)  # includes module load and tuning
    real = check_forward(experts=896, latent=3584, intermediate=3072, rows=16 * tokens, first=280, count=56,
                         device=device, raise_on_fail=False)
    out["dep16_rank"] = real
    w = random_weights(56, 3584, 3072, device=device, seed=1)
    ids, rw = random_routing(16 * tokens, 16, 896, first=280, count=56, device=device, seed=1)
    x = torch.randn(16 * tokens, 3584, device=device).to(torch.bfloat16)
    moe = TrtllmGenMoE(*w, first=280, count=56, n_experts_total=896, device=device)
    codes, scales = moe.quantize(x)
    packed = pack_topk(ids, rw)
    out["dep16_rank_us"] = round(graph_replay_us(lambda: moe.call_packed(codes, scales, packed)), 1)
    out["describe"] = moe.describe()
    out["ok"] = all(c["ok"] for c in out["checks"]) and real["ok"]
    return out


if __name__ == "__main__":
    res = smoke()
    print(json.dumps(res, indent=1, default=str))
    sys.exit(0 if res["ok"] else 1)
