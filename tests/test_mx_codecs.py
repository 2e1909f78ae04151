"""E8M0 / E4M3 / E2M1 codecs of model.formats: exhaustive over codes, midpoints, golden cases.

The independent implementations are ml_dtypes (decode, and encode where it agrees) and a
round-to-nearest-even over the explicit list of representable values written here with
exact rational arithmetic (``_ref_rne``).
"""

from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch

from model import formats

ALL_U8 = torch.arange(256, dtype=torch.uint8)
ALL_E2M1 = torch.arange(16, dtype=torch.uint8)


def _bits(t: torch.Tensor) -> list[int]:
    """float32 bit patterns (so -0.0 and 0.0 differ)."""
    return t.contiguous().view(torch.int32).tolist()


def _f32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def _e4m3_codes(values) -> list[int]:
    return formats.float32_to_e4m3(_f32(values)).view(torch.uint8).tolist()


def _grid(decode, codes):
    """(value, code) of every non-negative, non-NaN code, sorted by value."""
    vals = decode(codes)
    out = [(Fraction(float(v)), int(c)) for v, c in zip(vals, codes) if not math.isnan(v)]
    out = [(v, c) for v, c in out if v >= 0 and not (v == 0 and c != 0)]
    return sorted(out)


def _ref_rne(x: float, grid) -> int:
    """Independent RNE with saturation: nearest grid value, ties to the even code."""
    mag = abs(Fraction(x))
    top_value, top_code = grid[-1]
    if mag >= top_value:
        return top_code
    best = min(grid, key=lambda vc: (abs(vc[0] - mag), vc[1] & 1))
    return best[1]


E4M3_GRID = _grid(lambda c: formats.e4m3_to_float32(c).tolist(), ALL_U8[:128])
E2M1_GRID = _grid(lambda c: formats.e2m1_to_float32(c).tolist(), ALL_E2M1[:8])


# ------------------------------------------------------------------ decode, exhaustive


def test_e2m1_decode_all_16_codes_match_ml_dtypes():
    ref = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    assert _bits(formats.e2m1_to_float32(ALL_E2M1)) == ref.view(np.int32).tolist()


def test_e4m3_decode_all_256_codes_match_ml_dtypes():
    ref = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = formats.e4m3_to_float32(ALL_U8).numpy()
    nan = np.isnan(ref)
    # the NaN codes are exactly S.1111.111 (0x7F, 0xFF); their payload bits may differ
    assert np.flatnonzero(nan).tolist() == [0x7F, 0xFF]
    assert np.flatnonzero(np.isnan(got)).tolist() == [0x7F, 0xFF]
    assert got[~nan].view(np.int32).tolist() == ref[~nan].view(np.int32).tolist()


def test_e4m3_decode_accepts_uint8_bit_patterns_and_float8():
    as_fp8 = formats.e4m3_to_float32(ALL_U8.view(torch.float8_e4m3fn))
    assert _bits(as_fp8) == _bits(formats.e4m3_to_float32(ALL_U8))


def test_e8m0_decode_all_256_codes_match_ml_dtypes():
    ref = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    got = formats.e8m0_to_float32(ALL_U8).numpy()
    assert np.isnan(got[255]) and np.isnan(ref[255])
    # code 0 is 2^-127, an FP32 subnormal, built from bits (0x00400000)
    assert got[:255].view(np.int32).tolist() == ref[:255].view(np.int32).tolist()
    assert got[0].view(np.int32) == 0x00400000


# ------------------------------------------------------------------ encode round trips


def test_e4m3_encode_round_trips_every_code():
    back = formats.float32_to_e4m3(formats.e4m3_to_float32(ALL_U8)).view(torch.uint8)
    expected = ALL_U8.clone()
    expected[0xFF] = 0x7F  # both NaN codes encode back to the canonical NaN 0x7F
    assert back.tolist() == expected.tolist()


def test_e2m1_encode_round_trips_every_code():
    # includes code 8 = -0.0 -> 8
    assert formats.float32_to_e2m1(formats.e2m1_to_float32(ALL_E2M1)).tolist() == ALL_E2M1.tolist()


def test_e2m1_agrees_with_torch_float4_e2m1fn_x2_packing():
    # torch.float4_e2m1fn_x2 is a packed-pair container; its bytes are what pack_e2m1 makes
    packed = formats.pack_e2m1(ALL_E2M1)
    as_x2 = packed.view(torch.float4_e2m1fn_x2)
    assert as_x2.view(torch.uint8).tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]


# ------------------------------------------------------------------ midpoints (RNE)


def _midpoint_cases(grid):
    """Every midpoint between adjacent values, and the float32 just below / above it."""
    cases = []
    for (lo, _), (hi, _) in zip(grid, grid[1:]):
        mid = np.float32((lo + hi) / 2)  # exact: a sum of two FP8/FP4 values halved
        assert Fraction(float(mid)) == (lo + hi) / 2
        cases += [mid, np.nextafter(mid, np.float32(0)), np.nextafter(mid, np.float32(np.inf))]
    cases = np.array(cases, dtype=np.float32)
    return np.concatenate([cases, -cases])


def test_e4m3_every_midpoint_against_independent_rne():
    xs = _midpoint_cases(E4M3_GRID)
    got = _e4m3_codes(xs.tolist())
    want = [_ref_rne(float(x), E4M3_GRID) | (0x80 if x < 0 else 0) for x in xs]
    assert got == want


def test_e4m3_midpoints_agree_with_ml_dtypes_below_448():
    # ml_dtypes rounds to nearest even too; it differs only in overflow (next test)
    xs = _midpoint_cases(E4M3_GRID)
    ref = xs.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).tolist()
    assert _e4m3_codes(xs.tolist()) == ref


def test_e4m3_saturates_where_ml_dtypes_overflows_to_nan():
    # Above the 464 midpoint between 448 (fraction 110) and 480 (fraction 111, the bit
    # pattern S.1111.111 = NaN) plain RNE goes to 480, which ml_dtypes encodes as NaN; the
    # stock satfinite conversion gives 448 (0x7E). At 464 itself both pick the even 448.
    xs = np.array([464.0, _next_up(464.0), 500.0, 1e30, -470.0], dtype=np.float32)
    ref = [0x7E, 0x7F, 0x7F, 0x7F, 0xFF]
    assert xs.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).tolist() == ref
    assert _e4m3_codes(xs.tolist()) == [0x7E, 0x7E, 0x7E, 0x7E, 0xFE]


def test_e2m1_every_midpoint_against_independent_rne_and_ml_dtypes():
    xs = _midpoint_cases(E2M1_GRID)
    got = formats.float32_to_e2m1(torch.from_numpy(xs)).tolist()
    want = [_ref_rne(float(x), E2M1_GRID) | (0x8 if x < 0 else 0) for x in xs]
    assert got == want
    # ml_dtypes' float4_e2m1fn (no NaN/Inf) saturates too, so it agrees everywhere
    assert got == xs.astype(ml_dtypes.float4_e2m1fn).view(np.uint8).tolist()


# ------------------------------------------------------------------ golden tables

E4M3_GOLDEN = [
    (1.0, 0x38),  # 1.0 = 2^0: exponent field 7, fraction 0
    (1.0625, 0x38),  # halfway between 1.0 (0x38, even) and 1.125 (0x39): RNE picks 1.0
    (1.1875, 0x3A),  # halfway between 1.125 (0x39) and 1.25 (0x3A, even): RNE picks 1.25
    (17.0, 0x58),  # halfway between 16 (0x58 = 2^4, even) and 18 (0x59): RNE picks 16
    (232.0, 0x76),  # halfway between 224 (0x76, even) and 240 (0x77): RNE picks 224
    (248.0, 0x78),  # halfway between 240 (0x77) and 256 (0x78, even): RNE carries to 2^8
    (448.0, 0x7E),  # the largest finite E4M3
    (449.0, 0x7E),  # above 448 and below the 464 midpoint: 448
    (464.0, 0x7E),  # halfway between 448 (fraction 110, even) and 480 (111 = NaN): 448
    (470.0, 0x7E),  # above that midpoint: RNE would give 480 (NaN pattern); satfinite 448
    (1e30, 0x7E),  # far above: satfinite 448
    (float("inf"), 0x7E),  # +Inf: satfinite 448
    (float("-inf"), 0xFE),  # -Inf: satfinite -448
    (float("nan"), 0x7F),  # NaN: the canonical NaN 0x7F
    (-0.0, 0x80),  # negative zero keeps its sign (cvt.rn.satfinite.e4m3x2.f32 gives 0x80)
    (-(2.0**-11), 0x80),  # a negative value that rounds to zero gives -0
    (2.0**-6, 0x08),  # the smallest normal 2^-6
    (2.0**-9, 0x01),  # the smallest subnormal 2^-9
    (2.0**-10, 0x00),  # halfway between 0 (even) and 2^-9: RNE picks 0
    (3 * 2.0**-10, 0x02),  # halfway between 2^-9 (0x01) and 2^-8 (0x02, even): RNE picks 2^-8
    (7.5 * 2.0**-9, 0x08),  # halfway between 7*2^-9 (0x07) and 2^-6 (0x08, even): picks 2^-6
    (1e-40, 0x00),  # an FP32 subnormal input rounds to +0
    (-1e-40, 0x80),  # and a negative one to -0
]


@pytest.mark.parametrize("x, code", E4M3_GOLDEN, ids=[repr(c[0]) for c in E4M3_GOLDEN])
def test_e4m3_golden(x, code):
    assert _e4m3_codes([x]) == [code]


E2M1_GOLDEN = [
    (0.25, 0x0),  # halfway between 0 (even) and 0.5: RNE picks 0
    (0.75, 0x2),  # halfway between 0.5 (0x1) and 1.0 (0x2, even): RNE picks 1.0
    (1.25, 0x2),  # halfway between 1.0 (0x2, even) and 1.5 (0x3): RNE picks 1.0
    (1.75, 0x4),  # halfway between 1.5 (0x3) and 2.0 (0x4, even): RNE picks 2.0
    (2.5, 0x4),  # halfway between 2.0 (0x4, even) and 3.0 (0x5): RNE picks 2.0
    (3.5, 0x6),  # halfway between 3.0 (0x5) and 4.0 (0x6, even): RNE picks 4.0
    (5.0, 0x6),  # halfway between 4.0 (0x6, even) and 6.0 (0x7): RNE picks 4.0
    (5.0001, 0x7),  # just above the 4/6 midpoint: 6.0
    (6.0, 0x7),  # the largest E2M1
    (7.0, 0x7),  # halfway between 6 and "8": saturates to 6
    (1e30, 0x7),  # far above: saturates to 6
    (float("inf"), 0x7),  # +Inf: satfinite 6
    (float("-inf"), 0xF),  # -Inf: satfinite -6
    (-0.0, 0x8),  # negative zero keeps its sign bit: code 0x8
    (-0.2, 0x8),  # a negative value that rounds to zero gives -0
    (-0.75, 0xA),  # the sign bit is 0x8: -1.0
    (1e-40, 0x0),  # an FP32 subnormal input rounds to +0
]


@pytest.mark.parametrize("x, code", E2M1_GOLDEN, ids=[repr(c[0]) for c in E2M1_GOLDEN])
def test_e2m1_golden(x, code):
    assert formats.float32_to_e2m1(_f32([x])).tolist() == [code]


def _next_up(x: float) -> float:
    return float(np.nextafter(np.float32(x), np.float32(np.inf)))


E8M0_RCEIL_GOLDEN = [
    (0.0, 0),  # zero: the smallest code, 2^-127
    (2.0**-149, 0),  # the smallest FP32 subnormal: 2^-127 is the smallest scale above it
    (2.0**-127, 0),  # exactly 2^-127 (subnormal 0x00400000): code 0
    (_next_up(2.0**-127), 1),  # just above 2^-127: rounds up to 2^-126
    (2.0**-126, 1),  # exactly 2^-126, the smallest normal: code 1
    (_next_up(2.0**-126), 2),  # just above: 2^-125
    (0.75, 127),  # in (1/2, 1]: 2^0
    (1.0, 127),  # a power of two is its own scale
    (_next_up(1.0), 128),  # 1 + 2^-23: the exact ceil is 2^1 (log2 would round it to 0)
    (2.0**127, 254),  # the largest scale
    (3.0e38, 254),  # above 2^127: satfinite keeps 254 rather than the NaN code
    (float("inf"), 254),  # Inf: satfinite 254
    (float("nan"), 255),  # NaN: code 255
    (-1.0, 127),  # the sign is ignored (the conversion's software emulation uses |q|)
]


@pytest.mark.parametrize("q, code", E8M0_RCEIL_GOLDEN, ids=[repr(c[0]) for c in E8M0_RCEIL_GOLDEN])
def test_e8m0_rceil_golden(q, code):
    assert formats.float32_to_e8m0_rceil(_f32([q])).tolist() == [code]


def test_e8m0_rceil_is_the_exact_ceiling_over_all_binades():
    # every FP32 exponent field with fractions 0, 1 ulp, half, max: 2^(c-127) >= q and
    # 2^(c-128) < q (or c == 0), checked in exact rational arithmetic
    bits = []
    for field in range(0, 255):
        for frac in (0, 1, 0x400000, 0x7FFFFF):
            bits.append((field << 23) | frac)
    q = torch.tensor(bits, dtype=torch.int32).view(torch.float32)
    codes = formats.float32_to_e8m0_rceil(q).tolist()
    for qi, c in zip(q.tolist(), codes):
        fq = Fraction(qi)
        if fq > Fraction(2) ** 127:
            assert c == 254, qi
            continue
        assert Fraction(2) ** (c - 127) >= fq, qi
        assert c == 0 or Fraction(2) ** (c - 128) < fq, qi


# ------------------------------------------------------------------ packing


def test_pack_e2m1_puts_element_2i_in_the_low_nibble():
    codes = torch.tensor([[0x1, 0x2, 0xF, 0x8]], dtype=torch.uint8)
    assert formats.pack_e2m1(codes).tolist() == [[0x21, 0x8F]]


def test_pack_unpack_round_trip_and_match_torchao():
    from torchao.prototype.mx_formats.kernels import pack_uint4

    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (3, 5, 64), generator=g, dtype=torch.uint8)
    packed = formats.pack_e2m1(codes)
    assert packed.shape == (3, 5, 32)
    assert torch.equal(formats.unpack_e2m1(packed), codes)
    assert torch.equal(packed, pack_uint4(codes))


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: formats.float32_to_e4m3(torch.zeros(4, dtype=torch.float16)), r"^x: .*float32"),
        (lambda: formats.float32_to_e2m1(torch.zeros(4, dtype=torch.bfloat16)), r"^x: .*float32"),
        (lambda: formats.float32_to_e2m1(_f32([1.0, float("nan")])), r"^x: E2M1 has no NaN.*\(1,\)"),
        (lambda: formats.e2m1_to_float32(torch.tensor([16], dtype=torch.uint8)), r"^codes: .*0\.\.15"),
        (lambda: formats.e2m1_to_float32(torch.tensor([1], dtype=torch.int32)), r"^codes: .*uint8"),
        (lambda: formats.e8m0_to_float32(torch.zeros(2)), r"^codes: .*uint8"),
        (lambda: formats.e4m3_to_float32(torch.zeros(2)), r"^codes: .*float8_e4m3fn"),
        (lambda: formats.float32_to_e8m0_rceil(torch.zeros(2, dtype=torch.float64)), r"^q: .*float32"),
        (lambda: formats.pack_e2m1(torch.zeros(3, dtype=torch.uint8)), r"^codes: .*K even"),
        (lambda: formats.pack_e2m1(torch.full((2,), 16, dtype=torch.uint8)), r"^codes: .*0\.\.15"),
        (lambda: formats.unpack_e2m1(torch.zeros(2, dtype=torch.int8)), r"^packed: .*uint8"),
    ],
)
def test_codec_bad_input_names_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()
