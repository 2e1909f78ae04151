"""Contracts of the latent RMSNorm: ``x * rsqrt(mean(x^2) + eps) * w``, one BF16 rounding.

By the backend's claim for the ``rms_norm`` stage:

* bitwise (``reference``): bit-identical to :func:`verify.oracles.stages.rms_norm`; for
  the reference, its FP32 value before the rounding too, to the oracle
  :func:`verify.oracles.stages.rms_norm_fp32` (every FP32 step in its order: exact sum of
  squares rounded once, ``/ L``, ``+ eps``, torch's FP32 ``rsqrt`` of the same argument,
  ``(x * r) * w``);
* own order (``fast``): bit-identical to the backend's emulation
  (``reference.emulation.rms_norm_tree``: the kernel's own reduction tree, correctly
  rounded sqrt and division);
* every backend, whatever its claim (``stock`` = ``torch.nn.functional.rms_norm`` in FP32,
  ``reference-cuda`` with CUDA's rsqrt, external ones): within
  ``verify.tolerances.rms_norm_relative_error`` of the exact value plus the final BF16
  rounding; the share of outputs whose bits differ from the reference's is reported
  (``n/a`` for a bitwise claim, where it is 0 by construction).

Widths and ``eps`` are the config's (``latent``, ``rms_eps``).
"""

from __future__ import annotations

import pytest
import torch

from reference.norm import rms_norm, rms_norm_fp32
from verify import bounds, cases, compare, tolerances
from verify.oracles import stages as oracle


def _inputs(tokens: int, width: int, seed: int, device: str):
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-4, 5, (tokens, 1), generator=g).float())
    x = (torch.randn(tokens, width, generator=g) * scale).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(width, generator=g)).to(torch.bfloat16)
    return x.to(device), weight.to(device)


def _check(backend, config_name, tokens, seed, contract):
    claim = backend.claim("rms_norm")
    cfg = cases.config(config_name)
    eps = cfg.rms_eps
    x, weight = _inputs(tokens, cfg.latent, seed, backend.device)
    out = backend.rms_norm(x, weight, eps).cpu()
    x, weight = x.cpu(), weight.cpu()
    names = ("token", "column")
    if claim.exact:
        contract.bitwise(out, oracle.rms_norm(x, weight, eps),
                         what=f"{backend.name} RMSNorm vs oracle", index_names=names)
    if claim.emulation:
        contract.bitwise(out, claim.emulation(x, weight, eps),
                         what=f"{backend.name} RMSNorm vs its emulation", index_names=names)
    x64 = x.double()
    exact = x64 * torch.rsqrt((x64 * x64).mean(1, keepdim=True) + eps) * weight.double()
    relative = tolerances.rms_norm_relative_error(cfg.latent)
    bound = bounds.final_rounding_bound(exact, exact.abs() * relative, torch.bfloat16)
    contract.bounded(out, exact, bound, what=f"{backend.name} RMSNorm vs exact",
                     bound_name="FP32 sum/rsqrt/multiply error + BF16 half-ULP",
                     index_names=names)
    if claim.exact:
        contract.not_applicable("bf16_ulp_off_vs_reference")
    else:
        off = compare.ulp_distance(out, rms_norm(x, weight, eps)) > 0
        contract.figure("bf16_ulp_off_vs_reference", off.double().mean().item(), worst="max")


@pytest.mark.backends("reference-cuda", "stock", "fast", external=True)
@pytest.mark.parametrize("config_name", cases.STAGE_CONFIGS)
@pytest.mark.parametrize("tokens", cases.ALL_BATCHES)
def test_rms_norm(backend, config_name, tokens, seed, contract):
    _check(backend, config_name, tokens, seed, contract)


@pytest.mark.contract("rms_norm")
@pytest.mark.backends("reference")
@pytest.mark.parametrize("config_name,tokens", cases.REFERENCE_GRID)
def test_rms_norm_reference(backend, config_name, tokens, seed, contract):
    """The contract, and the reference's FP32 value before the rounding
    (``rms_norm_fp32``) bit-identical to the oracle's."""
    cfg = cases.config(config_name)
    x, weight = _inputs(tokens, cfg.latent, seed, "cpu")
    contract.bitwise(rms_norm_fp32(x, weight, cfg.rms_eps),
                     oracle.rms_norm_fp32(x, weight, cfg.rms_eps),
                     what="reference RMSNorm (FP32, before rounding) vs oracle",
                     index_names=("token", "column"))
    _check(backend, config_name, tokens, seed, contract)
