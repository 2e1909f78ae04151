"""Exact IEEE roundings the reference is built from.

Every function here computes a value exactly (in float64, as an unevaluated pair
`hi + lo` when one float64 is not enough) and rounds it ONCE to the target format with
round-to-nearest-even (RNE).

Why a float64 detour needs care: rounding the exact value to float64 and then to FP32 can
differ from rounding it straight to FP32 (double rounding), e.g. when the exact value lies
just above an FP32 midpoint and the float64 rounding lands exactly on it. The cure used
throughout is *round-to-odd*: round the exact value to the wider format truncating toward
zero and setting the last bit to 1 when anything was dropped. A round-to-odd result at
precision `q` followed by RNE at precision `p` equals RNE at `p` of the exact value
whenever `q >= p + 2` (Boldo & Melquiond, "Emulation of FMA and correctly rounded sums:
proved algorithms using rounding to odd", IEEE TC 2008). Here float64 has `q = 53` and
FP32 `p = 24` (53 >= 26), FP32 `q = 24` and BF16 `p = 8` (24 >= 10). Round-to-odd at
53 and then at 24 is round-to-odd at 24 of the exact value (odd roundings compose when
precision decreases), so one chain exact -> odd53 -> odd24 -> RNE8 is a single RNE to BF16.
"""

from __future__ import annotations

import torch

__all__ = [
    "fma_f32",
    "round_to_bfloat16",
    "round_to_float32",
    "two_sum",
    "pair_to_float32",
    "pair_to_bfloat16",
]


def _check_float(name: str, x: torch.Tensor, dtypes: tuple) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {dtypes}, got {x.dtype}")


def two_sum(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Knuth's TwoSum on float64: `s = fl(a + b)` and `e` with `s + e == a + b` exactly.

    Args:
        a, b: float64 tensors of broadcastable shapes, finite.

    Returns:
        `(s, e)` float64. Exact for finite inputs whose sum does not overflow float64;
        where `s` is not finite, `e` is NaN and callers must use `s` alone.
    """
    s = a + b
    bb = s - a
    e = (a - (s - bb)) + (b - bb)
    return s, e


def _odd_double(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """Round-to-odd at 53 bits of the exact value `hi + lo` (float64 pair).

    Requires `hi = fl(hi + lo)` (so `|lo| <= ulp(hi) / 2`) — `two_sum` output qualifies.
    Where `lo == 0` the value is `hi`; otherwise the exact value lies strictly between `hi`
    and its neighbour toward `lo`; the truncation toward zero is `hi` when `lo` has hi's
    sign and the next double toward zero otherwise, and its last bit is then forced to 1.
    Non-finite `hi` passes through unchanged.
    """
    bits = hi.view(torch.int64)
    inexact = (lo != 0) & torch.isfinite(hi)
    shrink = inexact & ((lo < 0) != (hi < 0))
    # float64 is sign-magnitude: decrementing the integer image of a nonzero value
    # decrements its magnitude (for either sign), i.e. steps one ulp toward zero.
    bits = torch.where(shrink, bits - 1, bits)
    bits = torch.where(inexact, bits | 1, bits)
    return bits.view(torch.float64)


def _odd_float(x: torch.Tensor) -> torch.Tensor:
    """Round-to-odd at 24 bits of a float64 tensor, as float32.

    `r = RNE32(x)`; where `r != x` the truncation toward zero of x is `r` if `|r| < |x|`,
    else the float32 next to `r` toward zero; its last bit is then forced to 1. Values
    above the FP32 range truncate to +-FLT_MAX (odd, so a later RNE to BF16 overflows to
    inf exactly when RNE of the exact value does). NaN and inf pass through.
    """
    r = x.to(torch.float32)
    r64 = r.to(torch.float64)
    finite = torch.isfinite(x)
    inexact = finite & (r64 != x)
    bits = r.view(torch.int32)
    # r == inf from a finite x: the truncation is FLT_MAX = inf's bits - 1.
    too_far = inexact & (r64.abs() > x.abs())
    bits = torch.where(too_far, bits - 1, bits)
    bits = torch.where(inexact, bits | 1, bits)
    return bits.view(torch.float32)


def round_to_float32(x64: torch.Tensor) -> torch.Tensor:
    """One RNE rounding of a float64 (or float32) tensor to float32.

    Args:
        x64: float64 or float32 tensor, any shape.

    Returns:
        float32 tensor, same shape: the IEEE conversion (round to nearest, ties to even,
        overflow to inf, gradual underflow).
    """
    _check_float("x64", x64, (torch.float64, torch.float32))
    return x64.to(torch.float32)


def round_to_bfloat16(x: torch.Tensor) -> torch.Tensor:
    """One RNE rounding of a float64 or float32 tensor to bfloat16.

    From float32 this is the IEEE conversion. From float64 the value is first rounded to
    odd at FP32 precision (24 bits) and then RNE to BF16 (8 bits): since 24 >= 8 + 2 the
    result equals RNE of the float64 value straight to BF16 — no double rounding, unlike
    `x.float().bfloat16()`.

    Args:
        x: float64 or float32 tensor, any shape.

    Returns:
        bfloat16 tensor, same shape.
    """
    _check_float("x", x, (torch.float64, torch.float32))
    if x.dtype == torch.float64:
        x = _odd_float(x)
    return x.to(torch.bfloat16)


def pair_to_float32(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """One RNE rounding to float32 of the exact value of the float64 pair `hi + lo`.

    Args:
        hi, lo: float64 tensors, same shape, `hi = fl(hi + lo)` (a `two_sum` result).

    Returns:
        float32: round-to-odd at 53 bits, then RNE to 24 bits (53 >= 24 + 2: one rounding).
    """
    return _odd_double(hi, lo).to(torch.float32)


def pair_to_bfloat16(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """One RNE rounding to bfloat16 of the exact value of the float64 pair `hi + lo`.

    Round-to-odd at 53 bits, round-to-odd at 24 bits, RNE to 8 bits: one rounding.
    """
    return _odd_float(_odd_double(hi, lo)).to(torch.bfloat16)


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The IEEE-754 FP32 fused multiply-add `RNE32(a * b + c)`, exactly.

    Emulation: `p = a * b` in float64 is exact (24 + 24 significand bits <= 53, and FP32
    exponents cannot overflow or underflow float64 in a product); `(s, e) = TwoSum(p, c)`
    holds `p + c` exactly; `s + e` is then rounded to odd at 53 bits and RNE to FP32, which
    is one rounding of the exact `a*b + c` (53 >= 24 + 2). Plain `(a*b + c).float()` in
    float64 would round twice and differs on inputs like those in `tests/test_fp.py`.

    Signs of zero follow IEEE: an exact zero sum is +0 unless `a*b` and `c` are both -0.
    inf/NaN follow IEEE (`inf * 0 + c` and `inf - inf` are NaN), overflow rounds to inf,
    FP32 subnormal results are rounded on the subnormal grid.

    Args:
        a, b, c: float32 tensors of broadcastable shapes.

    Returns:
        float32 tensor of the broadcast shape.
    """
    for name, t in (("a", a), ("b", b), ("c", c)):
        _check_float(name, t, (torch.float32,))
    p = a.to(torch.float64) * b.to(torch.float64)
    s, e = two_sum(p, c.to(torch.float64))
    e = torch.where(torch.isfinite(s), e, torch.zeros_like(e))
    return pair_to_float32(s, e)
