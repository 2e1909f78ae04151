"""The ``mx`` stage: MXFP8 quantization of the activations the expert GEMMs consume.

The routed latent ``[T, L]`` (BF16) is quantized to MXFP8 (E4M3 elements, one E8M0 scale
per 32 along the last dimension, RCEIL scales) before dispatch, and each expert's SiTU
output is re-quantized to MXFP8 before FC2. Pure PyTorch, on any device, vectorized.

The formats themselves (the E8M0 / E4M3 / E2M1 codecs, ``ScaleRule``, the block quantizer
``quantize_blocks`` and its rounding points, MXFP4, the weights' format) are
``model.formats``; the 128x4 scale layout is ``model.swizzle``; ``docs/numerics.md``
specifies both. The fast kernel ``fast.mx.quantize_mxfp8`` is checked against
``quantize_mxfp8`` bitwise.
"""

from __future__ import annotations

import torch

from model.formats import (
    E4M3_FORMAT,
    ScaleRule,
    apply_scales,
    check_dtype,
    check_scales,
    e4m3_to_float32,
    quantize_blocks,
)

__all__ = ["quantize_mxfp8", "dequantize_mxfp8"]


def quantize_mxfp8(
    x: torch.Tensor, *, scale_rule: ScaleRule = ScaleRule.RCEIL
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 quantize along the last dimension: E4M3 elements, one E8M0 scale per 32.

    Steps per block of 32 (all in FP32 after an exact upcast of ``x``):

    1. ``amax = max_i |x_i|``;
    2. scale code ``c`` from ``amax`` by ``scale_rule`` (see
       ``ScaleRule``; RCEIL: ``c = 127 + ceil(log2(fp32(amax/448)))``);
    3. ``v_i = x_i * 2^(127-c)`` (RCEIL, code 0: ``x_i * 1``). The multiplier is a power
       of two, so the product is exact unless it lands among FP32 subnormals
       (``|v_i| < 2^-126``); there FP32 rounds it, harmlessly: any such value becomes ±0 in
       E4M3 either way (half the smallest E4M3 subnormal is ``2^-10``);
    4. ``v_i`` clamped to ±448, then E4M3 round-to-nearest-even
       (``float32_to_e4m3``).

    An all-zero block gets scale code 0 and zero elements (``-0.0`` keeps code ``0x80``).
    Under RCEIL this follows the recipe of FlashInfer's ``mxfp8_quantize`` (SM100 kernels;
    the IEEE quotient ``amax / 448.0f``, ``__nv_cvt_float_to_e8m0(.., cudaRoundPosInf)``)
    and is bit-identical to torchao ``to_mx(..., ScaleCalculationMode.RCEIL)`` on BF16
    inputs (``tests/test_mx_quantize.py``). For FP32 inputs torchao's eager fallback
    ``ceil(torch.log2(amax / 448))`` can round ``log2`` of a quotient a few ulps above
    ``2^k`` (``|k| >= 4``) down to exactly ``k`` (e.g. ``amax = 448 * 2^8 * (1 + 2^-23)``),
    one scale code below this exact rule; BF16 quotients are powers of two or at least
    1/224 relative away from one, so they never meet it.

    Args:
        x: bfloat16, float16 or float32 ``[..., K]``, K a multiple of 32, all finite.
        scale_rule: ``ScaleRule``, default RCEIL.

    Returns:
        ``(codes, scales)``: ``torch.float8_e4m3fn`` ``[..., K]`` and uint8 E8M0
        ``[..., K // 32]`` in the linear layout (block ``j`` of row ``r`` at ``[r, j]``).

    Raises:
        ValueError: wrong dtype, K not a multiple of 32, NaN/Inf in ``x``, or a bad
            ``scale_rule`` (the message names the argument).
    """
    codes, scales = quantize_blocks(x, E4M3_FORMAT, scale_rule)
    return codes.view(torch.float8_e4m3fn), scales


def dequantize_mxfp8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of ``quantize_mxfp8``: ``element * 2^(c-127)``.

    The FP32 product is exact (an E4M3 value is ``n * 2^-9`` with ``n < 2^9``, and every
    ``n * 2^(c-136)`` with ``c >= 0`` is an FP32 multiple of ``2^-149``) unless it overflows
    to ±Inf (scale code ``>= 247`` with a large element).

    Args:
        codes: ``torch.float8_e4m3fn`` ``[..., K]`` (or uint8 bit patterns).
        scales: uint8 E8M0 ``[..., K // 32]``, linear layout.

    Returns:
        float32 ``[..., K]``; NaN where a code or the block's scale is NaN.
    """
    check_dtype(codes, "codes", (torch.float8_e4m3fn, torch.uint8), "float8_e4m3fn or uint8")
    check_scales(scales, codes.shape, codes.shape[-1] if codes.dim() else 0)
    values = e4m3_to_float32(codes)
    return apply_scales(values, scales)
