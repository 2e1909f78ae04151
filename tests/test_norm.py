"""reference.norm, the pieces: the exact sum of squares, row independence, bad input.

The contracts (bit for bit against the op-by-op oracle before and after the BF16 rounding,
and within the derived bound of the exact value) are ``verify/test_norm.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from reference.norm import rms_norm, rms_norm_fp32, sum_of_squares


def test_sum_of_squares_exact():
    # 2^30 squared is 2^60; the 1.0s are lost by a float64 running sum but not here.
    x = torch.tensor([[2.0**30] + [1.0] * 63], dtype=torch.float32)
    assert sum_of_squares(x).item() == np.float32(2.0**60 + 63)


def test_rows_independent_and_zero_row(gen):
    x = torch.randn(5, 64, generator=gen).bfloat16()
    x[2] = 0
    w = torch.ones(64, dtype=torch.bfloat16)
    full = rms_norm(x, w, 1e-5)
    assert torch.equal(full[2], torch.zeros(64, dtype=torch.bfloat16))
    for t in range(5):
        assert torch.equal(rms_norm(x[t:t + 1], w, 1e-5)[0], full[t])


def test_bf16_output_is_one_rounding_of_the_fp32_value(gen):
    x = torch.randn(4, 256, generator=gen).bfloat16()
    w = (1 + 0.1 * torch.randn(256, generator=gen)).bfloat16()
    y = rms_norm_fp32(x, w, 1e-5)
    assert y.dtype == torch.float32
    assert torch.equal(rms_norm(x, w, 1e-5), y.to(torch.bfloat16))


def test_errors():
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x must be a bfloat16"):
        rms_norm(x.float(), torch.ones(64, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match=r"weight must be a bfloat16 \[64\]"):
        rms_norm(x, torch.ones(32, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="eps must be a positive float"):
        rms_norm(x, torch.ones(64, dtype=torch.bfloat16), 0.0)
