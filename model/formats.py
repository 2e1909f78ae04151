"""MX (microscaling) number formats: the E8M0 / E4M3 / E2M1 codecs, the block quantizer,
and MXFP4, the format of the routed experts' weights.

Pure PyTorch, on any device, vectorized; every rounding point is explicit. The MXFP8
activation quantizer built on ``quantize_blocks`` is the ``mx`` stage of the reference
(``reference.mx``); the 128x4 scale layout is ``model.swizzle``.

Formats (OCP Microscaling Formats (MX) v1.0):

| name | bits | values | max | min normal | min subnormal |
|---|---|---|---|---|---|
| E8M0 (scale) | 8, no sign | ``2^(code-127)``, code 255 = NaN | ``2^127`` | ``2^-127`` | -- |
| E4M3 (``float8_e4m3fn``) | 1.4.3, bias 7 | no Inf; ``S.1111.111`` = NaN | 448 | ``2^-6`` | ``2^-9`` |
| E2M1 (``float4_e2m1fn``) | 1.2.1, bias 1 | 0, 0.5, 1, 1.5, 2, 3, 4, 6 | 6 | 1 | 0.5 |

A block is 32 consecutive elements along the last dimension. Quantizing a block is

1. ``amax = max |x_i|`` over the block (exact in any input dtype);
2. a scale exponent ``e`` from ``amax`` by a ``ScaleRule``, stored
   as the E8M0 code ``e + 127``;
3. each element ``v_i = x_i * 2^-e`` in FP32 (exact: a power-of-two scaling; see below),
   clamped to ``±max_elem``, then rounded to the element format with round-to-nearest-even
   (RNE). The clamp makes the rounding "satfinite", as the ``cvt.rn.satfinite`` PTX
   conversions the stock kernels use.

Dequantizing is ``element * 2^e`` in FP32; the product is exact (an element has at most 4
significant bits) unless it overflows FP32, which only RCEIL blocks with
``amax >= 1.9375 * 2^127`` reach (see ``docs/numerics.md``).

Rounding points, all of them: the FP32 quotient ``amax / max_elem`` (RCEIL only; IEEE
round-to-nearest with gradual underflow), the element RNE, and nothing else.

Non-finite inputs are rejected by the quantizers with a ``ValueError``: the stock kernels
turn a NaN/Inf block into a NaN or saturated scale and garbage elements, and a reference
must not silently produce a number. The element codecs themselves are total (NaN and Inf
have a defined result, see each codec).

The module assumes PyTorch's default floating-point environment (no flush-to-zero,
``torch.set_flush_denormal(False)``); every power of two is built from its bits, so only
the RCEIL quotient and the FP32 subnormal scaling described in
``quantize_blocks`` touch subnormal arithmetic.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import torch

__all__ = [
    "BLOCK",
    "E4M3_MAX",
    "E2M1_MAX",
    "E8M0_BIAS",
    "E8M0_NAN",
    "ElementFormat",
    "E4M3_FORMAT",
    "E2M1_FORMAT",
    "ScaleRule",
    "check_dtype",
    "e8m0_to_float32",
    "float32_to_e8m0_rceil",
    "float32_to_e4m3",
    "e4m3_to_float32",
    "float32_to_e2m1",
    "e2m1_to_float32",
    "pack_e2m1",
    "unpack_e2m1",
    "quantize_blocks",
    "check_scales",
    "apply_scales",
    "quantize_mxfp4",
    "dequantize_mxfp4",
]

BLOCK = 32
"""Elements per MX block (one E8M0 scale each), along the last dimension."""

E4M3_MAX = 448.0
"""Largest finite E4M3 magnitude, ``1.75 * 2^8``."""

E2M1_MAX = 6.0
"""Largest E2M1 magnitude, ``1.5 * 2^2``."""

E8M0_BIAS = 127
"""E8M0 exponent bias: code ``c`` is ``2^(c - 127)``."""

E8M0_NAN = 255
"""The E8M0 NaN code."""


class ElementFormat(NamedTuple):
    """An element format: fraction bits, minimum normal exponent, largest magnitude,
    exponent of the largest binade, position of the sign bit in the code."""

    mbits: int
    emin: int
    max: float
    emax: int
    sign_bit: int


E4M3_FORMAT = ElementFormat(mbits=3, emin=-6, max=E4M3_MAX, emax=8, sign_bit=7)
"""E4M3 (``float8_e4m3fn``), the MXFP8 element."""

E2M1_FORMAT = ElementFormat(mbits=1, emin=0, max=E2M1_MAX, emax=2, sign_bit=3)
"""E2M1 (``float4_e2m1fn``), the MXFP4 element."""

_FLOAT_INPUTS = (torch.bfloat16, torch.float16, torch.float32)


class ScaleRule(enum.Enum):
    """How the E8M0 block scale exponent ``e`` is chosen from the block's ``amax``.

    ``max_elem`` is 448 (E4M3) or 6 (E2M1); ``emax_elem`` is the exponent of the element
    format's largest binade, 8 (E4M3) or 2 (E2M1). Codes are ``e + 127``.

    Attributes:
        RCEIL: The stock NVIDIA rule (default). ``q = fp32(amax / max_elem)`` (IEEE
            round-to-nearest division, gradual underflow), then ``e = ceil(log2(q))`` taken
            exactly from the bits of ``q``: the smallest ``e`` with ``2^e >= q``, clamped to
            ``[-127, 127]`` (so ``q <= 2^-127``, zero included, gives code 0, and
            ``2^-127 < q <= 2^-126`` gives code 1). This is
            ``cvt.rp.satfinite.ue8m0x2.f32`` applied to the quotient
            (``__nv_cvt_float_to_e8m0(q, __NV_SATFINITE, cudaRoundPosInf)``), as in
            FlashInfer's / TensorRT-LLM's ``mxfp8_quantize`` and torchao's
            ``ScaleCalculationMode.RCEIL``. Because ``2^e >= amax / max_elem`` no element
            exceeds ``max_elem`` after scaling except by the quotient's rounding (never by
            more than that rounding; the clamp absorbs it). Elements of a block with code 0
            (``0 < amax <= max_elem * 2^-127``) are multiplied by 1 instead of ``2^127``
            (TransformerEngine's ``exp2f_rcp`` convention, which torchao copies; FlashInfer's
            kernels, built with flush-to-zero, treat the subnormal scale ``2^-127`` as 0 and
            also write zeros -- read from their source, not run here), so such a block
            quantizes to signed zeros.
        FLOOR: OCP MX v1.0 §6.3. ``e = floor(log2(amax)) - emax_elem`` taken from the
            exponent bits of ``amax``, clamped to ``[-127, 127]``; an all-zero or FP32
            subnormal ``amax`` gives code 0. Elements are ``x * 2^-e`` for every code
            (``2^127`` for code 0), so up to the top binade's worth of elements exceed
            ``max_elem`` and are clamped (e.g. E4M3: ``amax = 500`` gives ``e = 0`` and
            element 448). torchao's ``ScaleCalculationMode.FLOOR`` computes the same codes;
            its elements differ only for code-0 blocks, where it divides by ``2^-126``
            instead of ``2^-127`` (a documented Triton workaround).
    """

    RCEIL = "rceil"
    FLOOR = "floor"


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """``2^k`` as float32, exactly, for int32 ``k`` in ``[-149, 127]``, built from bits.

    Normal results are ``(k + 127) << 23``; subnormal ones (``k < -126``) are
    ``0x00400000 >> (-127 - k)`` (``0x00400000`` is ``2^-127``).
    """
    normal = (k + 127).clamp(min=1) << 23
    sub = torch.bitwise_right_shift(
        torch.full_like(k, 0x00400000), (-127 - k).clamp(0, 22)
    )
    return torch.where(k >= -126, normal, sub).view(torch.float32)


def _round_magnitude(a: torch.Tensor, fmt: ElementFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Round float32 magnitudes ``a >= 0`` to the element format ``fmt`` (RNE, saturating).

    1. ``a`` is clamped to ``max`` first: for a saturating round-to-nearest this changes
       nothing (anything above ``max`` rounds to at least ``max`` and then saturates), and it
       keeps ``+Inf`` out of the arithmetic. NaN passes through.
    2. ``2^e`` with ``e = floor(log2 a)`` is ``a``'s exponent bits (``a & 0x7F800000``),
       floored at the format's minimum normal exponent ``emin`` (below it the format is
       subnormal and keeps the lowest binade's spacing).
    3. The quantum (ULP) is ``2^(e - mbits)``; ``n = a / quantum`` is an exact power-of-two
       scaling (``mbits - e >= -126``, no FP32 overflow or underflow) and ``torch.round``
       rounds it half-to-even to an integer in ``[0, 2^(mbits+1)]``.

    The rounded magnitude is ``n * 2^(e - mbits)`` and its code is
    ``n + ((e - emin) << mbits)`` (see ``_magnitude_code``; ``n`` carries the implicit bit,
    so a carry into the next binade lands on the right code).

    Args:
        a: float32 tensor of non-negative values (or NaN), any shape.
        fmt: the element format.

    Returns:
        ``(n, binade)``: float32 integers ``n`` and int32 bits of ``2^e``, ``a``'s shape.
    """
    mbits, emin = fmt.mbits, fmt.emin
    a = a.clamp(max=fmt.max)
    binade = (a.view(torch.int32) & 0x7F800000).clamp_(min=(emin + 127) << 23)  # bits of 2^e
    inv_quantum = (((254 + mbits) << 23) - binade).view(torch.float32)  # 2^(mbits - e)
    return torch.round(a.mul_(inv_quantum)), binade


def _magnitude_code(n: torch.Tensor, binade: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """int32 magnitude code ``n + ((e - emin) << mbits)`` from ``_round_magnitude``'s output."""
    mbits, emin = fmt.mbits, fmt.emin
    return ((binade >> 23) - (emin + 127)).bitwise_left_shift_(mbits).add_(n.to(torch.int32))


def _sign_bit(x: torch.Tensor, position: int) -> torch.Tensor:
    """int32: float32 ``x``'s sign bit moved to bit ``position`` (``-0.0`` counts as negative)."""
    return (x.view(torch.int32) >> (31 - position)) & (1 << position)


def check_dtype(t, name: str, dtypes: tuple, what: str) -> None:
    """Raise a ValueError naming ``name`` unless ``t`` is a tensor of one of ``dtypes``
    (``what`` spells them in the message)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor ({what}), got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype {what}, got {t.dtype}")


def _first_bad_index(bad: torch.Tensor) -> tuple:
    idx = torch.nonzero(bad)[0]
    return tuple(int(i) for i in idx)


def _check_quantize_input(x, name: str) -> None:
    check_dtype(x, name, _FLOAT_INPUTS, "bfloat16, float16 or float32")
    if x.dim() == 0 or x.shape[-1] % BLOCK != 0:
        raise ValueError(
            f"{name}: expected shape [..., K] with K a multiple of {BLOCK} (the MX block), "
            f"got shape {tuple(x.shape)}"
        )


def _check_finite(x: torch.Tensor, amax: torch.Tensor, name: str) -> None:
    """NaN/Inf check on the block maxima (``amax`` propagates NaN), located on failure."""
    if not bool(torch.isfinite(amax).all()):
        at = _first_bad_index(~torch.isfinite(x))
        raise ValueError(
            f"{name}: must be finite, found {x[at].item()} at index {at}; MX quantization "
            "of NaN/Inf is not defined here (the stock kernels would emit a NaN or "
            "saturated scale and meaningless elements)"
        )


# --------------------------------------------------------------------------------------
# E8M0
# --------------------------------------------------------------------------------------


def e8m0_to_float32(codes: torch.Tensor) -> torch.Tensor:
    """Decode E8M0 scale codes.

    Args:
        codes: uint8 tensor, any shape.

    Returns:
        float32 tensor of the same shape: ``2^(code - 127)`` (code 0 is the FP32 subnormal
        ``2^-127``, code 254 is ``2^127``), NaN for code 255. Exact; built from bits.
    """
    check_dtype(codes, "codes", (torch.uint8,), "uint8 (E8M0 codes)")
    k = codes.to(torch.int32) - E8M0_BIAS
    out = _pow2(k)
    return torch.where(codes == E8M0_NAN, torch.full_like(out, float("nan")), out)


def float32_to_e8m0_rceil(q: torch.Tensor) -> torch.Tensor:
    """E8M0 code of ``q`` rounded toward +Inf, saturating: ``cvt.rp.satfinite.ue8m0x2.f32``.

    The smallest code ``c`` in ``[0, 254]`` with ``2^(c-127) >= |q|``, read from the bits:
    a normal ``q`` with biased exponent ``E`` and fraction ``m`` gives ``E + (m != 0)``;
    a subnormal ``q`` gives 0 if ``|q| <= 2^-127`` else 1; zero gives 0; ``±Inf`` and
    anything above ``2^127`` give 254; NaN gives 255. The sign is ignored (the conversion's
    software emulation in ``cuda_fp8.hpp`` works on ``|q|``).

    Args:
        q: float32 tensor, any shape.

    Returns:
        uint8 tensor of the same shape.
    """
    check_dtype(q, "q", (torch.float32,), "float32")
    bits = q.contiguous().view(torch.int32) & 0x7FFFFFFF
    exp_field = bits >> 23
    frac = bits & 0x007FFFFF
    normal = exp_field + (frac != 0).to(torch.int32)
    subnormal = (bits > 0x00400000).to(torch.int32)  # |q| > 2^-127
    code = torch.where(exp_field == 0, subnormal, normal).clamp(max=254)
    code = torch.where(bits > 0x7F800000, torch.full_like(code, E8M0_NAN), code)
    return code.to(torch.uint8)


# --------------------------------------------------------------------------------------
# E4M3
# --------------------------------------------------------------------------------------


def float32_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """FP32 to E4M3: round to nearest even, saturating (``cvt.rn.satfinite.e4m3x2.f32``).

    Finite values beyond ±448 and ``±Inf`` become ±448 (satfinite; plain RNE would send
    values above the 448/480 midpoint 464 to the NaN pattern, which is what ``ml_dtypes``
    does); NaN becomes the canonical
    NaN ``0x7F``; ``-0.0`` and negative values that round to zero give ``0x80`` (the
    conversion keeps the sign of zero). Below ``2^-6`` the result is subnormal with
    spacing ``2^-9``.

    Args:
        x: float32 tensor, any shape.

    Returns:
        ``torch.float8_e4m3fn`` tensor of the same shape.
    """
    check_dtype(x, "x", (torch.float32,), "float32")
    x = x.contiguous()
    codes = _magnitude_code(*_round_magnitude(x.abs(), E4M3_FORMAT), E4M3_FORMAT) | _sign_bit(x, 7)
    codes = codes.to(torch.uint8)
    codes = torch.where(torch.isnan(x), torch.full_like(codes, 0x7F), codes)
    return codes.view(torch.float8_e4m3fn)


def e4m3_to_float32(codes: torch.Tensor) -> torch.Tensor:
    """Decode E4M3 (exact).

    Args:
        codes: ``torch.float8_e4m3fn`` tensor, or uint8 holding its bit patterns.

    Returns:
        float32 tensor of the same shape; ``0x7F`` / ``0xFF`` decode to NaN.
    """
    check_dtype(codes, "codes", (torch.float8_e4m3fn, torch.uint8), "float8_e4m3fn or uint8")
    if codes.dtype == torch.uint8:
        codes = codes.view(torch.float8_e4m3fn)
    return codes.to(torch.float32)


# --------------------------------------------------------------------------------------
# E2M1
# --------------------------------------------------------------------------------------

_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def float32_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """FP32 to E2M1 codes: round to nearest even, saturating (``cvt.rn.satfinite.e2m1x2.f32``).

    Codes are ``sign << 3 | magnitude`` with magnitudes 0..7 meaning
    0, 0.5, 1, 1.5, 2, 3, 4, 6. Ties go to the even code (0.25 -> 0, 0.75 -> 1.0,
    1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5 -> 4.0); beyond ±6 and ``±Inf``
    saturate to ±6; ``-0.0`` and negative values rounding to zero give code ``0x8``.
    E2M1 has no NaN, so a NaN input is an error.

    Args:
        x: float32 tensor, any shape.

    Returns:
        uint8 tensor of the same shape with codes in ``0..15``.

    Raises:
        ValueError: ``x`` is not float32 or contains NaN.
    """
    check_dtype(x, "x", (torch.float32,), "float32")
    if bool(torch.isnan(x).any()):
        raise ValueError(f"x: E2M1 has no NaN, found NaN at index {_first_bad_index(torch.isnan(x))}")
    x = x.contiguous()
    codes = _magnitude_code(*_round_magnitude(x.abs(), E2M1_FORMAT), E2M1_FORMAT) | _sign_bit(x, 3)
    return codes.to(torch.uint8)


def e2m1_to_float32(codes: torch.Tensor) -> torch.Tensor:
    """Decode E2M1 codes (exact).

    Args:
        codes: uint8 tensor of codes in ``0..15``, any shape.

    Returns:
        float32 tensor of the same shape (code 8 is ``-0.0``).
    """
    check_dtype(codes, "codes", (torch.uint8,), "uint8 (E2M1 codes 0..15)")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"codes: E2M1 codes must be in 0..15, got max {int(codes.max())}")
    table = torch.tensor(
        _E2M1_VALUES + tuple(-v for v in _E2M1_VALUES), dtype=torch.float32, device=codes.device
    )
    return table[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 codes two per byte: element ``2i`` in the low nibble, ``2i+1`` in the high.

    This is the order of ``torch.float4_e2m1fn_x2``, torchao's ``pack_uint4`` and the
    NVIDIA block-scaled GEMMs.

    Args:
        codes: uint8 ``[..., K]``, K even, codes in ``0..15``.

    Returns:
        uint8 ``[..., K // 2]``.
    """
    check_dtype(codes, "codes", (torch.uint8,), "uint8 (E2M1 codes 0..15)")
    if codes.dim() == 0 or codes.shape[-1] % 2 != 0:
        raise ValueError(f"codes: expected shape [..., K] with K even, got {tuple(codes.shape)}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"codes: E2M1 codes must be in 0..15, got max {int(codes.max())}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_e2m1``.

    Args:
        packed: uint8 ``[..., K // 2]``.

    Returns:
        uint8 ``[..., K]`` codes in ``0..15``.
    """
    check_dtype(packed, "packed", (torch.uint8,), "uint8 (two E2M1 codes per byte)")
    if packed.dim() == 0:
        raise ValueError("packed: expected shape [..., K // 2], got a scalar")
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# --------------------------------------------------------------------------------------
# quantizers
# --------------------------------------------------------------------------------------


def _scale_codes(amax: torch.Tensor, fmt: ElementFormat, rule: ScaleRule) -> torch.Tensor:
    """E8M0 codes (int32) of float32 block maxima ``amax`` under ``rule``."""
    if rule is ScaleRule.RCEIL:
        return float32_to_e8m0_rceil(amax / fmt.max).to(torch.int32)
    if rule is ScaleRule.FLOOR:
        exp_field = amax.view(torch.int32) >> 23  # amax >= 0; field 0: zero / subnormal
        e = torch.where(exp_field == 0, torch.full_like(exp_field, -127), exp_field - 127)
        return (e - fmt.emax).clamp(-127, 127) + E8M0_BIAS
    raise ValueError(f"scale_rule: expected a ScaleRule (RCEIL or FLOOR), got {rule!r}")


def _element_multiplier(codes: torch.Tensor, rule: ScaleRule) -> torch.Tensor:
    """float32 ``2^(127 - code)``; under RCEIL code 0 gives 1 (see ScaleRule.RCEIL)."""
    mult = _pow2(E8M0_BIAS - codes)
    if rule is ScaleRule.RCEIL:
        mult = torch.where(codes == 0, torch.ones_like(mult), mult)
    return mult


def quantize_blocks(
    x: torch.Tensor, fmt: ElementFormat, rule: ScaleRule
) -> tuple[torch.Tensor, torch.Tensor]:
    """MX quantize along the last dimension, unpacked: the element codes and the E8M0 scales.

    Steps per block of 32 (all in FP32 after an exact upcast of ``x``):

    1. ``amax = max_i |x_i|``;
    2. scale code ``c`` from ``amax`` by ``rule`` (``ScaleRule``);
    3. ``v_i = |x_i| * 2^(127-c)`` (RCEIL, code 0: ``|x_i| * 1``). The multiplier is a
       power of two, so the product is exact unless it lands among FP32 subnormals
       (``|v_i| < 2^-126``); there FP32 rounds it, harmlessly: any such value becomes ±0
       in E4M3 and E2M1 either way (half the smallest E4M3 subnormal is ``2^-10``);
    4. ``v_i`` clamped to ``±fmt.max``, rounded to ``fmt`` to nearest even, the sign of
       ``x_i`` put back (``-0.0`` keeps its sign bit).

    Args:
        x: bfloat16, float16 or float32 ``[..., K]``, K a multiple of 32, all finite.
        fmt: the element format (``E4M3_FORMAT`` or ``E2M1_FORMAT``).
        rule: ``ScaleRule``.

    Returns:
        ``(codes, scales)``: uint8 element codes ``[..., K]`` (sign at ``fmt.sign_bit``)
        and uint8 E8M0 ``[..., K // 32]`` in the linear layout (block ``j`` of row ``r``
        at ``[r, j]``).

    Raises:
        ValueError: wrong dtype, K not a multiple of 32, NaN/Inf in ``x``, or a bad
            ``rule`` (the message names the argument).
    """
    _check_quantize_input(x, "x")
    if not isinstance(rule, ScaleRule):
        raise ValueError(f"scale_rule: expected a ScaleRule (RCEIL or FLOOR), got {rule!r}")
    *lead, k = x.shape
    xf = x.to(torch.float32).reshape(*lead, k // BLOCK, BLOCK)  # exact upcast
    mag = xf.abs()
    amax = mag.amax(dim=-1)
    _check_finite(x, amax, "x")
    codes = _scale_codes(amax, fmt, rule)
    # |x| * 2^-e, clamped to max_elem inside _round_magnitude, then RNE; sign put back last
    mag.mul_(_element_multiplier(codes, rule).unsqueeze(-1))
    elem = _magnitude_code(*_round_magnitude(mag, fmt), fmt)
    elem |= _sign_bit(xf, fmt.sign_bit)
    return elem.to(torch.uint8).reshape(*lead, k), codes.to(torch.uint8)


def quantize_mxfp4(
    x: torch.Tensor, *, scale_rule: ScaleRule = ScaleRule.RCEIL
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 quantize along the last dimension: E2M1 elements, one E8M0 scale per 32.

    The steps of ``quantize_blocks`` with element max 6
    (RCEIL: ``c = 127 + ceil(log2(fp32(amax / 6)))``; FLOOR: ``emax_elem = 2``) and E2M1
    round-to-nearest-even (``float32_to_e2m1``), then packed
    two per byte (``pack_e2m1``: element ``2i`` in the low nibble).
    Under RCEIL a BF16 ``amax / 6`` is a power of two or at least 1/192 relative away from
    one, so torchao's eager ``log2`` agrees; FP32 inputs can differ as for MXFP8
    (``reference.mx.quantize_mxfp8``).

    Args:
        x: bfloat16, float16 or float32 ``[..., K]``, K a multiple of 32, all finite.
        scale_rule: ``ScaleRule``, default RCEIL.

    Returns:
        ``(packed, scales)``: uint8 ``[..., K // 2]`` and uint8 E8M0 ``[..., K // 32]``
        (linear layout).

    Raises:
        ValueError: as ``quantize_blocks``.
    """
    codes, scales = quantize_blocks(x, E2M1_FORMAT, scale_rule)
    return pack_e2m1(codes), scales


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of ``quantize_mxfp4``: ``element * 2^(c-127)``.

    Exact in FP32 (an E2M1 value is ``n * 2^-1`` with ``n <= 12``) unless it overflows.

    Args:
        packed: uint8 ``[..., K // 2]`` (two E2M1 codes per byte, element ``2i`` low).
        scales: uint8 E8M0 ``[..., K // 32]``, linear layout.

    Returns:
        float32 ``[..., K]``; NaN in blocks whose scale code is 255.
    """
    check_dtype(packed, "packed", (torch.uint8,), "uint8 (two E2M1 codes per byte)")
    k = packed.shape[-1] * 2 if packed.dim() else 0
    check_scales(scales, packed.shape, k)
    values = e2m1_to_float32(unpack_e2m1(packed))
    return apply_scales(values, scales)


def check_scales(scales, data_shape, k: int) -> None:
    """Raise a ValueError unless ``scales`` is uint8 ``[..., K // 32]`` for data of shape
    ``data_shape`` holding ``k`` elements per row (``k`` a multiple of 32)."""
    check_dtype(scales, "scales", (torch.uint8,), "uint8 (E8M0 codes)")
    if len(data_shape) == 0 or k % BLOCK != 0:
        raise ValueError(
            f"codes: expected shape [..., K] with K a multiple of {BLOCK}, "
            f"got element count K={k} from shape {tuple(data_shape)}"
        )
    want = (*data_shape[:-1], k // BLOCK)
    if tuple(scales.shape) != want:
        raise ValueError(f"scales: expected shape {want} (one per {BLOCK} elements), got {tuple(scales.shape)}")


def apply_scales(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 ``values [..., K]`` times their blocks' E8M0 scales ``[..., K // 32]``
    (callers check the scales with ``check_scales`` first); exact unless a product
    overflows."""
    *lead, k = values.shape
    blocks = values.reshape(*lead, k // BLOCK, BLOCK) * e8m0_to_float32(scales).unsqueeze(-1)
    return blocks.reshape(*lead, k)
