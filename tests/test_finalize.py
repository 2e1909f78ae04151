"""reference.finalize against an independent Fraction FMA chain."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from reference.finalize import finalize
from test_fp import FP32, BF16, round_fraction, seed_of


def finalize_fraction(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    t, k = weights.shape
    r = rows.double().view(t, k, -1).tolist()
    w = weights.double().tolist()
    out = []
    for ti in range(t):
        row = []
        for j in range(len(r[0][0])):
            acc = 0.0
            for ki in range(k):  # one exact FMA, rounded to FP32, per k, in order
                acc = round_fraction(Fraction(w[ti][ki]) * Fraction(r[ti][ki][j]) + Fraction(acc), FP32)
            row.append(round_fraction(Fraction(acc), BF16))
        out.append(row)
    return torch.tensor(out, dtype=torch.float64)


def test_matches_fraction_chain(request):
    g = torch.Generator().manual_seed(seed_of(request.node.nodeid))
    t, k, l = 3, 16, 32
    rows = (torch.randn(t * k, l, generator=g) * torch.exp2(torch.randint(-6, 7, (t * k, l), generator=g))).bfloat16()
    w = torch.softmax(torch.randn(t, k, generator=g), -1)
    got = finalize(rows, w)
    assert got.dtype == torch.bfloat16 and got.shape == (t, l)
    assert torch.equal(got.double(), finalize_fraction(rows, w))


def test_k_order_matters():
    # k=0 contributes 1, k=1 contributes 2^-24 (lost when added to 1 in FP32: tie to even),
    # k=2 contributes 2^-24 again; k=3 cancels the 1. In order: ((1 + e) + e) - 1 = 0.
    # Reversed: ((-1 + e) + e) + 1 = 2^-23 (both e survive next to -1, whose ulp below is 2^-24).
    e = 2.0**-24
    rows = torch.tensor([[1.0], [1.0], [1.0], [-1.0]], dtype=torch.bfloat16)
    w = torch.tensor([[1.0, e, e, 1.0]])
    forward = finalize(rows, w).item()
    reverse = finalize(rows.flip(0), w.flip(1)).item()
    assert forward == 0.0 and reverse == 2.0**-23
    assert torch.equal(finalize(rows, w).double(), finalize_fraction(rows, w))


# A token (found by a seeded random search) where multiplying, rounding, then adding —
# instead of a fused multiply-add — changes the BF16 output.
FMA_CASE_W = [0.7213906645774841, 0.5728296041488647, 0.25865840911865234, 0.5910871624946594,
              0.8515946269035339, 0.3838203549385071, 0.08265364170074463, 0.7709635496139526,
              0.7749025821685791, 0.7003988027572632, 0.4024728536605835, 0.8808536529541016,
              0.4745709300041199, 0.49941688776016235, 0.07765114307403564, 0.6195959448814392]
FMA_CASE_ROWS = [-1.015625, 0.58984375, -0.6328125, -0.8828125, -1.4140625, 1.1328125, 1.4375,
                 -0.193359375, -0.2138671875, -0.09423828125, -1.1953125, 0.6171875, 0.97265625,
                 1.453125, -0.6953125, 0.447265625]


def test_fma_not_mul_then_add():
    w = torch.tensor([FMA_CASE_W], dtype=torch.float32)
    rows = torch.tensor(FMA_CASE_ROWS, dtype=torch.bfloat16)[:, None]
    got = finalize(rows, w)
    assert torch.equal(got.double(), finalize_fraction(rows, w))
    acc = torch.zeros(1)
    for k in range(16):
        acc = acc + w[0, k:k + 1] * rows[k].float()  # two roundings per step
    assert acc.bfloat16().item() != got.item()


def test_errors():
    with pytest.raises(ValueError, match=r"rows must be a bfloat16 \[T\*K, L\] = \[32, L\]"):
        finalize(torch.zeros(16, 8, dtype=torch.bfloat16), torch.zeros(2, 16))
    with pytest.raises(ValueError, match="weights must be a float32"):
        finalize(torch.zeros(16, 8, dtype=torch.bfloat16), torch.zeros(1, 16, dtype=torch.float64))
