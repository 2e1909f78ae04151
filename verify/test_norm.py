"""Contracts of the latent RMSNorm (DESIGN §2).

* ``fast``: bit-identical to ``reference.emulation.rms_norm_tree`` (the kernel's own
  reduction tree and its correctly rounded sqrt and division); and within the derived
  bound of the exact FP64 RMSNorm, like any implementation;
* ``stock`` (``torch.nn.functional.rms_norm`` in FP32) and ``reference`` (on the CPU, and
  on CUDA tensors as ``reference-cuda``, whose library rsqrt differs): within
  ``verify.tolerances.rms_norm_relative_error`` of the exact value plus the final BF16
  rounding; the share of outputs that differ from the reference's bits is reported.
"""

from __future__ import annotations

import pytest
import torch

from reference import emulation
from reference.norm import rms_norm
from verify import bounds, cases, compare, tolerances


def _inputs(tokens: int, width: int, seed: int, device: str):
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-4, 5, (tokens, 1), generator=g).float())
    x = (torch.randn(tokens, width, generator=g) * scale).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(width, generator=g)).to(torch.bfloat16)
    return x.to(device), weight.to(device)


def _run(backend, x, weight, eps):
    if backend.name == "fast":
        from fast import norm as fast_norm

        return fast_norm.rms_norm(x, weight, eps)
    if backend.name == "stock":
        from fast import stock

        return stock.rms_norm(x, weight, eps)
    return rms_norm(x, weight, eps)


@pytest.mark.backends("reference", "reference-cuda", "stock", "fast")
@pytest.mark.parametrize("width", (512, 3584))
@pytest.mark.parametrize("tokens", cases.ALL_BATCHES)
def test_rms_norm(backend, width, tokens, seed, contract):
    eps = cases.config("small").rms_eps
    x, weight = _inputs(tokens, width, seed, backend.device)
    out = _run(backend, x, weight, eps).cpu()
    x, weight = x.cpu(), weight.cpu()
    names = ("token", "column")
    if backend.name == "fast":
        contract.bitwise(out, emulation.rms_norm_tree(x, weight, eps),
                         what="fast RMSNorm vs its tree emulation", index_names=names)
    x64 = x.double()
    exact = x64 * torch.rsqrt((x64 * x64).mean(1, keepdim=True) + eps) * weight.double()
    relative = tolerances.rms_norm_relative_error(width)
    bound = bounds.final_rounding_bound(exact, exact.abs() * relative, torch.bfloat16)
    contract.bounded(out, exact, bound, what=f"{backend.name} RMSNorm vs exact",
                     bound_name="FP32 sum/rsqrt/multiply error + BF16 half-ULP",
                     index_names=names)
    off = compare.ulp_distance(out, rms_norm(x, weight, eps)) > 0
    contract.figure("bf16_ulp_off_vs_reference", off.double().mean().item(), worst="max")
