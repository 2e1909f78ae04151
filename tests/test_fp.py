"""reference.fp against exact rational arithmetic (fractions.Fraction).

The independent oracle is ``verify.oracles.exact.round_fraction``: RNE of an exact rational
to a binary format with ``p`` significand bits, gradual underflow and overflow to inf.
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import numpy as np
import pytest
import torch

from reference.fp import fma_f32, pair_to_float32, round_to_bfloat16, round_to_float32, two_sum
from verify.oracles.exact import BF16, FP32
from verify.oracles.exact import round_fraction as exact_round_fraction

def round_fraction(q: Fraction, fmt=FP32, negative_zero: bool = False) -> float:
    """RNE of the exact rational ``q`` to ``fmt`` (``verify.oracles.exact``), with the sign
    of an exact zero chosen by the caller (IEEE: -0 only when every term was -0)."""
    if q == 0:
        return -0.0 if negative_zero else 0.0
    return exact_round_fraction(q, fmt)


def f32(x: float) -> float:
    """The float32 nearest a Python float (test inputs are built exactly representable)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def fma_oracle(a: float, b: float, c: float) -> float:
    if not all(math.isfinite(v) for v in (a, b, c)):
        return a * b + c  # IEEE special values: no rounding involved
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    prod_neg = (math.copysign(1, a) * math.copysign(1, b)) < 0
    both_neg_zero = exact == 0 and a * b == 0 and prod_neg and math.copysign(1, c) < 0
    return round_fraction(exact, FP32, negative_zero=both_neg_zero)


def same_bits(x: float, y: float) -> bool:
    if math.isnan(x) and math.isnan(y):
        return True
    return struct.pack("f", x) == struct.pack("f", y)


def t32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# Constructed so that float64 `a*b + c` lands exactly on an FP32 midpoint that the exact
# value is not on: the naive `(a*b + c).float()` rounds twice and is wrong.
# (1 + 2^-18)(1 - 2^-18) = 1 - 2^-36, so a*b = 2^-24 - 2^-60.
_A = 2.0**-12 * (1 + 2.0**-18)
_B = 2.0**-12 * (1 - 2.0**-18)
DOUBLE_ROUNDING_FMA = [
    # c = 1 + 2^-23 (odd last bit): exact 1 + 3*2^-24 - 2^-60 is just below the midpoint
    # -> RNE gives 1 + 2^-23; float64 rounds up onto the midpoint, tie-to-even gives 1 + 2^-22.
    (_A, _B, 1 + 2.0**-23),
    (-_A, _B, -(1 + 2.0**-23)),  # the same, negated
    (_A * 2.0**40, _B, (1 + 2.0**-23) * 2.0**40),  # the same, scaled by 2^40
    # c = 1 + 3*2^-23 (odd), a*b = -2^-24 + 2^-60: exact is just ABOVE the midpoint
    # 1 + 5*2^-24 -> RNE keeps c; float64 drops 2^-60, ties to even 1 + 2^-22.
    (-_A, _B, 1 + 3 * 2.0**-23),
]


def test_constructed_fma_cases_differ_from_naive_double_rounding():
    differ = 0
    for a, b, c in DOUBLE_ROUNDING_FMA:
        assert (f32(a), f32(b), f32(c)) == (a, b, c)
        want = fma_oracle(a, b, c)
        got = fma_f32(t32([a]), t32([b]), t32([c])).item()
        assert same_bits(got, want), (a, b, c, got, want)
        naive = (torch.tensor([a], dtype=torch.float64) * b + c).float().item()
        differ += not same_bits(naive, want)
    # every constructed case defeats the naive float64-then-float32 way
    assert differ == len(DOUBLE_ROUNDING_FMA)


def test_fma_special_values_and_signed_zeros():
    inf, nan = math.inf, math.nan
    cases = [
        (0.0, 1.0, -0.0), (-0.0, 1.0, -0.0), (-0.0, 1.0, 0.0), (1.0, -1.0, 1.0),  # exact zeros
        (2.0, 3.0, -6.0), (-2.0, 3.0, 6.0),
        (inf, 0.0, 1.0), (inf, 1.0, -inf), (inf, 2.0, 1.0), (nan, 1.0, 1.0), (1.0, 1.0, inf),
        (3.4028234663852886e38, 2.0, 0.0),  # overflow -> inf
        (3.4028234663852886e38, 1.0, 3.4028234663852886e38),
        (2.0**-75, 2.0**-75, 0.0),  # 2^-150: the tie to zero in the subnormal range -> +0
        (2.0**-75, 1.5 * 2.0**-75, 0.0),  # 1.5 * 2^-150 rounds up to 2^-149
        (-(2.0**-75), 2.0**-75, 0.0),  # -2^-150 -> -0
        (1.0 + 2.0**-23, 2.0**-126, -(2.0**-126)),  # subnormal result 2^-149
    ]
    for a, b, c in cases:
        got = fma_f32(t32([a]), t32([b]), t32([c])).item()
        want = fma_oracle(f32(a), f32(b), f32(c))
        assert same_bits(got, want), (a, b, c, got, want)


@pytest.mark.parametrize("kind", ["normal", "near_cancel", "random_bits"])
def test_fma_random_matches_fraction(kind, seed):
    rng = np.random.default_rng(seed)
    n = 3000
    if kind == "normal":
        a, b, c = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    elif kind == "near_cancel":
        a = rng.standard_normal(n).astype(np.float32)
        b = rng.standard_normal(n).astype(np.float32)
        c = (-(a.astype(np.float64) * b)).astype(np.float32)  # a*b + c = rounding error of a*b
        c = c * (1 + rng.integers(-2, 3, n) * 2.0**-23).astype(np.float32)
    else:
        bits = rng.integers(0, 2**32, size=(3, n), dtype=np.uint64).astype(np.uint32)
        a, b, c = (bits[i].view(np.float32) for i in range(3))
        # keep most products finite: scale down huge operands (inf/NaN stay, as cases)
        with np.errstate(invalid="ignore", over="ignore"):
            a = np.where(np.abs(a) > 1e19, a * np.float32(1e-25), a).astype(np.float32)
            b = np.where(np.abs(b) > 1e19, b * np.float32(1e-25), b).astype(np.float32)
    got = fma_f32(torch.from_numpy(a), torch.from_numpy(b), torch.from_numpy(c)).numpy()
    for i in range(n):
        want = fma_oracle(float(a[i]), float(b[i]), float(c[i]))
        assert same_bits(float(got[i]), want), (i, a[i], b[i], c[i], got[i], want)


def test_fma_broadcast_and_errors():
    out = fma_f32(t32([[2.0], [3.0]]), t32([1.0, 2.0]), t32(0.5))
    assert out.shape == (2, 2) and out.tolist() == [[2.5, 4.5], [3.5, 6.5]]
    with pytest.raises(ValueError, match="a must have dtype"):
        fma_f32(torch.ones(2, dtype=torch.float64), t32([1.0, 1.0]), t32([1.0, 1.0]))
    with pytest.raises(ValueError, match="c must be a torch.Tensor"):
        fma_f32(t32([1.0]), t32([1.0]), 1.0)


# float64 values whose naive float64 -> float32 -> bfloat16 conversion rounds twice.
DOUBLE_ROUNDING_BF16 = [
    1 + 2.0**-8 + 2.0**-30,  # just above the BF16 midpoint; .float() lands on it -> ties to 1.0
    -(1 + 2.0**-8 + 2.0**-30),
    (1 + 2.0**-7 + 2.0**-8 - 2.0**-30) * 2.0**100,  # just below an odd midpoint -> 1+2^-7
    # BF16 subnormal range: quantum 2^-133 at 2^-130, FP32's there is 2^-149
    (1 + 2.0**-4 + 2.0**-30) * 2.0**-130,
]


def test_round_to_bfloat16_single_rounding():
    for x in DOUBLE_ROUNDING_BF16:
        want = round_fraction(Fraction(x), BF16)
        got = round_to_bfloat16(torch.tensor([x], dtype=torch.float64)).float().item()
        naive = torch.tensor([x], dtype=torch.float64).float().bfloat16().float().item()
        assert got == want, (x, got, want)
        assert naive != want, (x, naive, want)


def test_round_to_bfloat16_random_and_specials(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(4000) * np.exp2(rng.integers(-140, 130, 4000))
    x = np.concatenate([x, [0.0, -0.0, np.inf, -np.inf, 3.4e38, -3.39e38, 1e39, 1e-50, -1e-50]])
    got = round_to_bfloat16(torch.from_numpy(x)).float().numpy()
    for xi, gi in zip(x, got):
        if math.isinf(xi):
            want = xi
        else:
            want = round_fraction(Fraction(float(xi)), BF16, negative_zero=math.copysign(1, xi) < 0)
        assert struct.pack("d", float(gi)) == struct.pack("d", want), (xi, gi, want)
    assert math.isnan(round_to_bfloat16(torch.tensor([math.nan], dtype=torch.float64)).item())
    f = torch.from_numpy(rng.standard_normal(100).astype(np.float32))
    assert torch.equal(round_to_bfloat16(f), f.bfloat16())
    with pytest.raises(ValueError, match="x must have dtype"):
        round_to_bfloat16(torch.ones(2, dtype=torch.float16))


def test_round_to_float32_is_rne(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(2000) * np.exp2(rng.integers(-160, 128, 2000))
    got = round_to_float32(torch.from_numpy(x)).numpy()
    for xi, gi in zip(x, got):
        assert same_bits(float(gi), round_fraction(Fraction(float(xi)), FP32,
                                                   negative_zero=xi < 0)), xi
    with pytest.raises(ValueError, match="x64 must have dtype"):
        round_to_float32(torch.ones(2, dtype=torch.int32))


def test_pair_to_float32_rounds_the_exact_pair():
    # hi + lo is 1 + 3*2^-24 - 2^-60: hi alone is the midpoint; the pair is below it.
    hi, lo = two_sum(torch.tensor([1 + 2.0**-23], dtype=torch.float64),
                     torch.tensor([2.0**-24 - 2.0**-60], dtype=torch.float64))
    assert lo.item() == -(2.0**-60)
    assert pair_to_float32(hi, lo).item() == 1 + 2.0**-23
    assert hi.float().item() == 1 + 2.0**-22  # rounding hi alone is off by one ulp
