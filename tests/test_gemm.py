"""reference.gemm against exact rational sums (fractions.Fraction), bitwise.

The model accumulates in float64 (error <= gamma_K(2^-53) * sum|a_k b_k|); on these
operands (few significand bits, |exponent spread| <= 2*30) that error is far below half
an FP32 ulp of the sums, so the rounded results equal the exactly rounded ones.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from reference.fp import pair_to_float32
from reference.gemm import addmm, exact_sum_pair, matmul, split_k_matmul
from verify.oracles.exact import BF16, FP32, round_fraction


def exact_dot(a: torch.Tensor, b: torch.Tensor) -> list[list[Fraction]]:
    a = a.double().tolist()
    b = b.double().tolist()
    return [[sum((Fraction(x) * Fraction(y) for x, y in zip(ra, rb)), Fraction(0)) for rb in b]
            for ra in a]


def rounded(q: list[list[Fraction]], fmt) -> torch.Tensor:
    return torch.tensor([[round_fraction(v, fmt) for v in row] for row in q], dtype=torch.float64)


def operands(seed, m, n, k, dtype, spread=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g)
    b = torch.randn(n, k, generator=g)
    if spread:  # magnitudes over 2^-spread .. 2^spread: float64 accumulation alone would round
        a = a * torch.exp2(torch.randint(-spread, spread + 1, (m, k), generator=g).float())
        b = b * torch.exp2(torch.randint(-spread, spread + 1, (n, k), generator=g).float())
    return a.to(dtype), b.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spread", [0, 30])
def test_matmul_is_the_rounded_exact_sum(seed, dtype, out_dtype, spread):
    a, b = operands(seed, 3, 5, 67, dtype, spread)
    got = matmul(a, b, out_dtype=out_dtype)
    assert got.dtype == out_dtype and got.shape == (3, 5)
    want = rounded(exact_dot(a, b), FP32 if out_dtype == torch.float32 else BF16)
    assert torch.equal(got.double(), want)


def test_exact_sum_pair_where_float64_rounds():
    # 2^60 + 1 - 2^60 + 2^-30: a float64 running sum loses the 1; the pair keeps it.
    p = torch.tensor([[2.0**60, 1.0, -(2.0**60), 2.0**-30]], dtype=torch.float64)
    naive = 0.0
    for v in p[0].tolist():
        naive += v
    assert naive == 2.0**-30
    hi, lo = exact_sum_pair(p)
    assert hi.item() + lo.item() == 1 + 2.0**-30 and pair_to_float32(hi, lo).item() == 1.0


def test_matmul_is_row_independent(seed):
    a, b = operands(seed, 19, 7, 96, torch.bfloat16)
    full = matmul(a, b, out_dtype=torch.bfloat16)
    for m in range(19):
        # alone, and inside a different batch at a different position
        other = torch.cat([a[m:m + 1].flip(1), a[m:m + 1], a[:3]])
        assert torch.equal(matmul(other, b, out_dtype=torch.bfloat16)[1], full[m])
        assert torch.equal(matmul(a[m:m + 1], b, out_dtype=torch.bfloat16), full[m:m + 1])


@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_split_k_order(seed, splits, out_dtype):
    a, b = operands(seed, 2, 4, 64, torch.bfloat16, spread=8)
    got = split_k_matmul(a, b, splits=splits, out_dtype=out_dtype)
    w = 64 // splits
    # independent: each split's exact sum rounded to FP32, then sequential FP32 adds
    parts = [rounded(exact_dot(a[:, s * w:(s + 1) * w], b[:, s * w:(s + 1) * w]), FP32)
             for s in range(splits)]
    acc = parts[0].numpy().astype(np.float32)
    for p in parts[1:]:
        acc = (acc + p.numpy().astype(np.float32)).astype(np.float32)
    want = torch.from_numpy(acc).to(out_dtype)
    assert torch.equal(got, want)


def test_split_k_differs_from_one_rounding_somewhere(seed):
    # the tactic's extra FP32 roundings are real: on enough data some outputs change
    a, b = operands(seed, 16, 64, 256, torch.bfloat16, spread=6)
    one = matmul(a, b, out_dtype=torch.float32)
    four = split_k_matmul(a, b, splits=4, out_dtype=torch.float32)
    assert not torch.equal(one, four)


def test_addmm_one_rounding(seed):
    a, b = operands(seed, 3, 4, 40, torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    c = torch.randn(3, 4, generator=g).bfloat16()
    got = addmm(c, a, b)
    q = exact_dot(a, b)
    cc = c.double().tolist()
    want = torch.tensor([[round_fraction(q[i][j] + Fraction(cc[i][j]), BF16) for j in range(4)]
                         for i in range(3)], dtype=torch.float64)
    assert got.dtype == torch.bfloat16 and torch.equal(got.double(), want)


def test_addmm_differs_from_two_roundings():
    # a@b.T = 1 + 2^-9 + 2^-12 and c = 2^-9: rounding the product to BF16 first loses
    # what lifts the total above the BF16 midpoint 1 + 2^-8.
    a = torch.tensor([[1.0, 2.0**-9, 2.0**-12]], dtype=torch.bfloat16)
    b = torch.tensor([[1.0, 1.0, 1.0]], dtype=torch.bfloat16)
    c = torch.tensor([[2.0**-9]], dtype=torch.bfloat16)
    # exact: 1 + 2^-8 + 2^-12 -> BF16 1 + 2^-7 (above the midpoint 1 + 2^-8)
    assert addmm(c, a, b).item() == 1 + 2.0**-7
    two_step = (matmul(a, b, out_dtype=torch.bfloat16).double() + c.double()).to(torch.bfloat16)
    assert two_step.item() == 1.0  # 1 + 2^-9 + 2^-12 -> 1.0, then + 2^-9 -> tie -> 1.0


def test_errors():
    a = torch.ones(2, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="share K"):
        matmul(a, torch.ones(3, 16, dtype=torch.bfloat16), out_dtype=torch.float32)
    with pytest.raises(ValueError, match="a must be bfloat16 or float32"):
        matmul(a.half(), a, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="out_dtype"):
        matmul(a, a, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="b must be 2-D"):
        matmul(a, a[0], out_dtype=torch.float32)
    with pytest.raises(ValueError, match="splits must be a positive int dividing K=32"):
        split_k_matmul(a, a, splits=3, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="c must be a bfloat16"):
        addmm(torch.ones(2, 2), a, a)
    with pytest.raises(ValueError, match=r"c must be \[M, N\]"):
        addmm(torch.ones(2, 3, dtype=torch.bfloat16), a, a)
