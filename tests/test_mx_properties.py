"""Hypothesis properties of the MX quantizers in reference.mx and model.formats.

Tolerances are derived, not tuned. Within a block with scale ``2^e`` an element is
``v = x * 2^-e``; round-to-nearest-even to a format with ``mbits`` fraction bits and
minimum normal exponent ``emin`` is off by at most half its quantum,

    |RNE(v) - v| <= 2^(max(floor(log2|v|), emin) - mbits - 1)

(E4M3: ``mbits = 3, emin = -6``, so ``2^(floor(log2|v|) - 4)`` for normals and ``2^-10``
below ``2^-6``; E2M1: ``mbits = 1, emin = 0``), and dequantizing multiplies both sides by
``2^e`` exactly. Elements with ``|v| > max`` are saturated: exactly ``±max``.
"""

from __future__ import annotations

import math

import hypothesis.extra.numpy as hnp
import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model import formats
from model.formats import ScaleRule
from reference import mx

# (quantize, dequantize, element codes -> float, max, mbits, emin, emax)
MXFP8 = (
    mx.quantize_mxfp8,
    mx.dequantize_mxfp8,
    lambda c, s: formats.e4m3_to_float32(c),
    448.0,
    3,
    -6,
    8,
)
MXFP4 = (
    formats.quantize_mxfp4,
    formats.dequantize_mxfp4,
    lambda p, s: formats.e2m1_to_float32(formats.unpack_e2m1(p)),
    6.0,
    1,
    0,
    2,
)
FORMATS = st.sampled_from([MXFP8, MXFP4])
RULES = st.sampled_from([ScaleRule.RCEIL, ScaleRule.FLOOR])
PROPS = settings(max_examples=60, deadline=None, derandomize=True)


@st.composite
def blocks(draw) -> np.ndarray:
    """float32 [n, 32]: per-block exponents over the whole FP32 range, or raw FP32 values."""
    n = draw(st.integers(1, 3))
    if draw(st.booleans()):
        return draw(
            hnp.arrays(np.float32, (n, 32), elements=st.floats(width=32, allow_nan=False, allow_infinity=False))
        )
    mant = draw(hnp.arrays(np.float32, (n, 32), elements=st.floats(-2.0, 2.0, width=32)))
    exps = draw(hnp.arrays(np.int32, (n, 1), elements=st.integers(-150, 126)))
    return (mant.astype(np.float64) * np.exp2(exps)).astype(np.float32)


def _ceil_log2(q: float) -> int:
    m, ex = math.frexp(q)  # q = m * 2^ex, 0.5 <= m < 1
    return ex - 1 if m == 0.5 else ex


def _expected_scale_code(amax: float, rule: ScaleRule, vmax: float, emax: int) -> int:
    """The scale rule, independently: float64 frexp on the FP32-rounded quotient / amax."""
    if amax == 0:
        return 0
    if rule is ScaleRule.RCEIL:
        # FP32 quotient: float64 division then rounding to FP32 is the correctly rounded
        # FP32 quotient here (amax/7 and amax/3 never sit within 2^-53 of an FP32 tie)
        q = float(np.float32(amax / vmax))
        e = -127 if q == 0 else _ceil_log2(q)
    else:
        e = math.frexp(amax)[1] - 1 - emax
    return min(max(e, -127), 127) + 127


@given(x=blocks(), fmt=FORMATS, rule=RULES)
@PROPS
def test_dequantize_within_half_ulp_of_the_scaled_value(x, fmt, rule):
    quant, dequant, decode, vmax, mbits, emin, emax = fmt
    data, scales = quant(torch.from_numpy(x), scale_rule=rule)
    elems = decode(data, scales).double().numpy()
    codes = scales.numpy().astype(np.int64)
    for b in range(x.shape[0]):
        xb = x[b].astype(np.float64)
        amax = float(np.abs(xb).max())
        c = int(codes[b, 0])
        assert c == _expected_scale_code(amax, rule, vmax, emax), (b, amax)
        if rule is ScaleRule.RCEIL and c == 0:
            # stock convention: a code-0 block is flushed to signed zeros
            assert amax <= vmax * 2.0**-127
            assert (elems[b] == 0).all() and (np.signbit(elems[b]) == np.signbit(xb)).all()
            continue
        v = xb * 2.0 ** (127 - c)  # exact in float64
        sat = np.abs(v) > vmax
        assert (elems[b][sat] == np.sign(v[sat]) * vmax).all()
        binade = np.floor(np.log2(np.maximum(np.abs(v), 2.0**emin)))
        half_quantum = np.exp2(binade - mbits - 1)
        err = np.abs(elems[b] - v)
        assert (err[~sat] <= half_quantum[~sat]).all(), (b, float((err / half_quantum).max()))
    # dequantize: the exact product element * 2^e, rounded to FP32 only by overflow
    want = (elems * np.exp2(codes.astype(np.float64) - 127).repeat(32, axis=1)).astype(np.float32)
    got = dequant(data, scales).numpy()
    assert np.array_equal(got.view(np.int32), want.view(np.int32))
    finite = np.isfinite(got)
    assert (np.abs(x[~finite]) >= 1.9375 * 2.0**127).all()


@st.composite
def representable_blocks(draw, fmt):
    """Blocks of element values times a scale, so the block is exactly representable."""
    n = draw(st.integers(1, 3))
    if fmt is MXFP8:
        not_nan = st.integers(0, 253).map(lambda c: c + (c >= 0x7F))  # skips 0x7F and 0xFF
        codes = draw(hnp.arrays(np.uint8, (n, 32), elements=not_nan))
        values = formats.e4m3_to_float32(torch.from_numpy(codes))
    else:
        codes = draw(hnp.arrays(np.uint8, (n, 32), elements=st.integers(0, 15)))
        values = formats.e2m1_to_float32(torch.from_numpy(codes))
    # scales away from code 0 (RCEIL flush) and from FP32 overflow
    scale = draw(hnp.arrays(np.uint8, (n, 1), elements=st.integers(12, 230)))
    return values * formats.e8m0_to_float32(torch.from_numpy(scale))


@given(data=st.data(), fmt=FORMATS, rule=RULES, bf16=st.booleans())
@PROPS
def test_exactly_representable_blocks_are_exact(data, fmt, rule, bf16):
    # Exact, with one exception that is OCP FLOOR's own: its scale puts the block maximum
    # in [256, 512) for E4M3, so a maximum with significand 1.875 (e.g. 240 * 2^k) becomes
    # 480 * 2^e and saturates to 448 * 2^e. (E2M1's largest significand, 1.5, always fits.)
    quant, dequant = fmt[0], fmt[1]
    x = data.draw(representable_blocks(fmt))
    if bf16:  # at most 4 significant bits and a normal exponent: exact in BF16
        assert torch.equal(x.bfloat16().float(), x)
        x = x.bfloat16()
    y = dequant(*quant(x, scale_rule=rule))
    want = x.float()
    if rule is ScaleRule.FLOOR and fmt is MXFP8:
        amax = want.abs().amax(dim=1, keepdim=True)
        top = torch.ldexp(torch.ones_like(amax), torch.frexp(amax).exponent - 1)  # 2^floor(log2)
        want = torch.copysign(torch.minimum(want.abs(), 1.75 * top), want)
    assert torch.equal(y.view(torch.int32), want.view(torch.int32))  # -0.0 included


@given(x=blocks(), fmt=FORMATS, rule=RULES)
@PROPS
def test_requantize_is_idempotent(x, fmt, rule):
    # quantize(dequantize(quantize(x))) == quantize(x), bit for bit, with one documented
    # exception under RCEIL: when a block's largest element rounded down to exactly
    # max/2 (E4M3 224, E2M1 3), the dequantized block's quotient is a power of two and its
    # new scale is one smaller, its elements twice as large: the same values.
    quant, dequant, decode, vmax = fmt[:4]
    first = quant(torch.from_numpy(x), scale_rule=rule)
    y = dequant(*first)
    if not torch.isfinite(y).all():  # |x| >= 1.9375 * 2^127 overflowed; nothing to requantize
        return
    second = quant(y, scale_rule=rule)
    v1, v2 = decode(*first), decode(*second)
    s1, s2 = first[1].int(), second[1].int()
    same = (s1 == s2).squeeze(1)
    assert torch.equal(first[0][same].view(torch.uint8), second[0][same].view(torch.uint8))
    if rule is ScaleRule.FLOOR:
        assert same.all()
    moved = ~same
    assert (s2[moved] == s1[moved] - 1).all()
    assert (v1[moved].abs().amax(dim=1) == vmax / 2).all()
    assert torch.equal(v2[moved], 2 * v1[moved])
    assert torch.equal(dequant(*second).view(torch.int32), y.view(torch.int32))


def test_requantize_exception_case():
    # the exception above, concretely: 225 -> scale 2^0 (225/448 in (1/2, 1]), element 224;
    # requantizing 224: 224/448 = 2^-1 exactly, scale 2^-1, element 448 -- the same value
    x = torch.zeros(1, 32)
    x[0, 0] = 225.0
    codes, scales = mx.quantize_mxfp8(x)
    assert (int(scales[0, 0]), codes.view(torch.uint8)[0, 0].item()) == (127, 0x76)
    codes2, scales2 = mx.quantize_mxfp8(mx.dequantize_mxfp8(codes, scales))
    assert (int(scales2[0, 0]), codes2.view(torch.uint8)[0, 0].item()) == (126, 0x7E)
