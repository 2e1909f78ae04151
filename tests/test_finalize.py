"""reference.finalize, the pieces: the k order is part of the result, bad input is named.

The contract (bit for bit against the exact FMA chain, on random and designed tokens) is
``verify/test_finalize.py``.
"""

from __future__ import annotations

import pytest
import torch

from reference.finalize import finalize
from verify.oracles import stages as oracle


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
    assert torch.equal(finalize(rows, w), oracle.finalize(rows, w))


def test_errors():
    with pytest.raises(ValueError, match=r"rows must be a bfloat16 \[T\*K, L\] = \[32, L\]"):
        finalize(torch.zeros(16, 8, dtype=torch.bfloat16), torch.zeros(2, 16))
    with pytest.raises(ValueError, match="weights must be a float32"):
        finalize(torch.zeros(16, 8, dtype=torch.bfloat16), torch.zeros(1, 16, dtype=torch.float64))
