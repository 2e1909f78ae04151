"""reference.norm against a numpy FP32 formulation with an exact (Fraction) sum of squares."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from reference.norm import rms_norm, sum_of_squares
from test_fp import FP32, round_fraction, seed_of


def rms_norm_numpy(x: torch.Tensor, w: torch.Tensor, eps: float) -> np.ndarray:
    f = np.float32
    xs = x.float().numpy()
    out = []
    for row in xs:
        ss = f(round_fraction(sum((Fraction(float(v)) ** 2 for v in row), Fraction(0)), FP32))
        mean = f(ss / f(len(row)))
        # rsqrt: torch's FP32 function on the same FP32 argument (not correctly rounded;
        # the op order and the other roundings are what this checks)
        r = torch.rsqrt(torch.tensor(f(mean + f(eps)))).numpy()
        y = ((row * r).astype(f) * w.float().numpy()).astype(f)
        out.append(y)
    return np.stack(out)


def test_matches_numpy(request):
    g = torch.Generator().manual_seed(seed_of(request.node.nodeid))
    x = (torch.randn(6, 256, generator=g) * torch.exp2(torch.randint(-4, 5, (6, 1), generator=g))).bfloat16()
    w = (1 + 0.1 * torch.randn(256, generator=g)).bfloat16()
    got = rms_norm(x, w, 1e-5)
    want = torch.from_numpy(rms_norm_numpy(x, w, 1e-5)).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_sum_of_squares_exact():
    # 2^30 squared is 2^60; the 1.0s are lost by a float64 running sum but not here.
    x = torch.tensor([[2.0**30] + [1.0] * 63], dtype=torch.float32)
    assert sum_of_squares(x).item() == np.float32(2.0**60 + 63)


def test_rows_independent_and_zero_row(request):
    g = torch.Generator().manual_seed(seed_of(request.node.nodeid))
    x = torch.randn(5, 64, generator=g).bfloat16()
    x[2] = 0
    w = torch.ones(64, dtype=torch.bfloat16)
    full = rms_norm(x, w, 1e-5)
    assert torch.equal(full[2], torch.zeros(64, dtype=torch.bfloat16))
    for t in range(5):
        assert torch.equal(rms_norm(x[t:t + 1], w, 1e-5)[0], full[t])


def test_close_to_float64(request):
    # Bound: y has 5 FP32 roundings (ss, /L, +eps, *r, *w) + rsqrt (<= 2 ulp assumed for
    # torch's FP32 rsqrt, i.e. 4u; rsqrt halves the relative error of its argument) and
    # one BF16 rounding (2^-8 relative): |err| <= (2^-8 + 8 * 2^-24) |y| to first order.
    g = torch.Generator().manual_seed(seed_of(request.node.nodeid))
    x = torch.randn(4, 512, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(512, generator=g)).bfloat16()
    got = rms_norm(x, w, 1e-5).double()
    xd = x.double()
    ref = xd * torch.rsqrt((xd * xd).mean(-1, keepdim=True) + 1e-5) * w.double()
    assert torch.all((got - ref).abs() <= (2.0**-8 + 8 * 2.0**-24) * ref.abs())


def test_errors():
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x must be a bfloat16"):
        rms_norm(x.float(), torch.ones(64, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match=r"weight must be a bfloat16 \[64\]"):
        rms_norm(x, torch.ones(32, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="eps must be a positive float"):
        rms_norm(x, torch.ones(64, dtype=torch.bfloat16), 0.0)
