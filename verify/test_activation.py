"""Contracts of SiTU-and-mul (DESIGN §2): ``beta*tanh(g/beta)*sigmoid(g) *
linear_beta*tanh(u/linear_beta)`` in FP32, one BF16 rounding.

* ``fast``: bit-identical to ``reference.emulation.situ_and_mul`` (the kernel's exp/tanh
  built from correctly rounded FP32 operations);
* every backend (``reference`` with PyTorch's library tanh/sigmoid on the CPU and, as
  ``reference-cuda``, on CUDA tensors; ``stock``; ``fast``):
  within ``verify.tolerances.SITU_RELATIVE_ERROR`` of the exact float64 value plus the
  final BF16 rounding; the share of outputs whose bits differ from the reference is
  reported, never hidden.
"""

from __future__ import annotations

import pytest
import torch

from reference import emulation
from reference.activation import situ_and_mul, situ_and_mul_float64
from verify import bounds, cases, compare, tolerances


def _inputs(tokens: int, width: int, seed: int, device: str):
    """Gate and up values over the whole range, saturation included (|gate| >> beta,
    |up| >> linear_beta)."""
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(tokens, width, generator=g) * 4
    up = torch.randn(tokens, width, generator=g) * 16
    gate[:, :8] = torch.tensor([-60.0, -20.0, -4.0, -0.0, 0.0, 4.0, 20.0, 60.0])
    up[:, :8] = torch.tensor([-200.0, -25.0, -1.0, 0.0, -0.0, 1.0, 25.0, 200.0])
    return torch.cat([gate, up], 1).to(torch.bfloat16).to(device)


def _run(backend, h, cfg):
    kwargs = dict(beta=cfg.situ_beta, linear_beta=cfg.situ_linear_beta)
    if backend.name == "fast":
        from fast import activation

        return activation.situ_and_mul(h, **kwargs)
    if backend.name == "stock":
        from fast import stock

        return stock.situ_and_mul(h, **kwargs)
    return situ_and_mul(h, **kwargs)


@pytest.mark.backends("reference", "reference-cuda", "stock", "fast")
@pytest.mark.parametrize("width", (512, 3072, 6144))
@pytest.mark.parametrize("tokens", cases.ALL_BATCHES)
def test_situ_and_mul(backend, width, tokens, seed, contract):
    cfg = cases.config("small")
    h = _inputs(tokens, width, seed, backend.device)
    out = _run(backend, h, cfg).cpu()
    h = h.cpu()
    names = ("token", "column")
    kwargs = dict(beta=cfg.situ_beta, linear_beta=cfg.situ_linear_beta)
    if backend.name == "fast":
        contract.bitwise(out, emulation.situ_and_mul(h, **kwargs),
                         what="fast SiTU vs its emulation", index_names=names)
    exact = situ_and_mul_float64(h.double(), **kwargs)
    bound = bounds.final_rounding_bound(
        exact, exact.abs() * tolerances.SITU_RELATIVE_ERROR, torch.bfloat16)
    contract.bounded(out, exact, bound, what=f"{backend.name} SiTU vs exact",
                     bound_name="library exp/tanh ULP + FP32 roundings + BF16 half-ULP",
                     index_names=names)
    off = compare.ulp_distance(out, situ_and_mul(h, **kwargs)) > 0
    contract.figure("bf16_ulp_off_vs_reference", off.double().mean().item(), worst="max")
