"""Contracts of Finalize (DESIGN §2): ``out[t] = sum_k w[t,k] * rows[16t+k]`` as an FP32
FMA chain in k order from 0, one BF16 rounding.

* ``fast``: bit-identical to ``reference.finalize.finalize``;
* ``stock`` (a PyTorch reduction, products rounded, its own summation order): within
  ``gamma_k(2^-24) * sum_k |w_k r_k|`` plus the final BF16 rounding of the exact sum.
"""

from __future__ import annotations

import pytest
import torch

from reference.finalize import finalize
from verify import bounds, cases

U32 = bounds.unit_roundoff(torch.float32)


def _inputs(tokens: int, width: int, top_k: int, seed: int, device: str):
    g = torch.Generator().manual_seed(seed)
    rows = (torch.randn(tokens * top_k, width, generator=g) * 4).to(torch.bfloat16)
    w = torch.rand(tokens, top_k, generator=g) + 0.01
    w = w / w.sum(1, keepdim=True)
    return rows.to(device), w.to(device)


def _run(backend, rows, w):
    if backend.name == "fast":
        from fast import finalize as fast_finalize

        return fast_finalize.finalize(rows, w)
    if backend.name == "stock":
        from fast import stock

        return stock.finalize(rows, w)
    return finalize(rows, w)


@pytest.mark.backends("reference-cuda", "stock", "fast")
@pytest.mark.parametrize("width", (512, 3584))
@pytest.mark.parametrize("tokens", cases.ALL_BATCHES)
def test_finalize(backend, width, tokens, seed, contract):
    rows, w = _inputs(tokens, width, 16, seed, backend.device)
    out = _run(backend, rows, w).cpu()
    rows, w = rows.cpu(), w.cpu()
    names = ("token", "column")
    if backend.name in ("fast", "reference-cuda"):
        contract.bitwise(out, finalize(rows, w), what="finalize (FMA chain, k order)",
                         index_names=names)
        return
    products = rows.double().view(tokens, 16, width) * w.double().unsqueeze(-1)
    exact = products.sum(1)  # 16 exact products; float64 sum error far below the bound
    propagated = products.abs().sum(1) * (bounds.gamma(16, U32) + bounds.gamma(16, 2.0**-53))
    bound = bounds.final_rounding_bound(exact, propagated, torch.bfloat16)
    contract.bounded(out, exact, bound, what="stock finalize",
                     bound_name="gamma_k(2^-24) sum|w r| + BF16 half-ULP", index_names=names)
