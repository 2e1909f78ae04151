"""Contracts of SiTU-and-mul: ``beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta)``
in FP32, one BF16 rounding (shared expert) or, inside the experts, the FP32 value itself.

By the backend's claim for the ``situ_and_mul`` stage:

* bitwise (``reference``): its BF16 value bit-identical to the oracle
  :func:`verify.oracles.stages.situ_and_mul` (every operation in order, torch's FP32
  ``tanh`` / ``sigmoid`` on the same arguments, one rounding); for the reference, its FP32
  value (``reference.activation.situ_and_mul_fp32``, what the experts use) to the
  oracle's FP32 value too;
* own order (``fast``): bit-identical to the backend's emulation
  (``reference.emulation.situ_and_mul``) and to the same oracle fed with the backend's
  ``tanh`` / ``sigmoid`` (the kernels' ``tanh_rn`` / ``sigmoid_rn``), so the emulation is
  checked too;
* every backend, whatever its claim (``stock``, ``reference-cuda`` with CUDA's library
  functions, external ones): within ``verify.tolerances.SITU_RELATIVE_ERROR`` of the exact
  float64 value plus the final BF16 rounding; the share of outputs whose bits differ from
  the reference is reported (``n/a`` for a bitwise claim, where it is 0 by construction).

Widths are the config's: the shared expert's ``shared_intermediate`` and the routed
experts' ``intermediate`` (``N``; the input is ``[T, 2N]``, gate half first).
"""

from __future__ import annotations

import pytest
import torch

from reference.activation import situ_and_mul, situ_and_mul_float64, situ_and_mul_fp32
from verify import bounds, cases, compare, tolerances
from verify.oracles import stages as oracle

WIDTHS = {"shared": "shared_intermediate", "routed": "intermediate"}


def _inputs(tokens: int, width: int, seed: int, device: str):
    """Gate and up values over the whole range, saturation included (|gate| >> beta,
    |up| >> linear_beta), signed zeros."""
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(tokens, width, generator=g) * 4
    up = torch.randn(tokens, width, generator=g) * 16
    gate[:, :8] = torch.tensor([-60.0, -20.0, -4.0, -0.0, 0.0, 4.0, 20.0, 60.0])
    up[:, :8] = torch.tensor([-200.0, -25.0, -1.0, 0.0, -0.0, 1.0, 25.0, 200.0])
    return torch.cat([gate, up], 1).to(torch.bfloat16).to(device)


def _check(backend, config_name, which, tokens, seed, contract):
    claim = backend.claim("situ_and_mul")
    cfg = cases.config(config_name)
    width = getattr(cfg, WIDTHS[which])
    kwargs = dict(beta=cfg.situ_beta, linear_beta=cfg.situ_linear_beta)
    h = _inputs(tokens, width, seed, backend.device)
    out = backend.situ_and_mul(h, **kwargs).cpu()
    h = h.cpu()
    names = ("token", "column")
    if claim.exact:
        contract.bitwise(out, oracle.situ_and_mul(h, **kwargs),
                         what=f"{backend.name} SiTU vs oracle", index_names=names)
    if claim.emulation:
        contract.bitwise(out, claim.emulation(h, **kwargs),
                         what=f"{backend.name} SiTU vs its emulation", index_names=names)
    if claim.tanh and claim.sigmoid:
        own = oracle.situ_and_mul(h, **kwargs, tanh=claim.tanh, sigmoid=claim.sigmoid)
        contract.bitwise(out, own, what=f"{backend.name} SiTU vs oracle with its tanh / sigmoid",
                         index_names=names)
    exact = situ_and_mul_float64(h.double(), **kwargs)
    bound = bounds.final_rounding_bound(
        exact, exact.abs() * tolerances.SITU_RELATIVE_ERROR, torch.bfloat16)
    contract.bounded(out, exact, bound, what=f"{backend.name} SiTU vs exact",
                     bound_name="library exp/tanh ULP + FP32 roundings + BF16 half-ULP",
                     index_names=names)
    if claim.exact:
        contract.not_applicable("bf16_ulp_off_vs_reference")
    else:
        off = compare.ulp_distance(out, situ_and_mul(h, **kwargs)) > 0
        contract.figure("bf16_ulp_off_vs_reference", off.double().mean().item(), worst="max")


@pytest.mark.backends("reference-cuda", "stock", "fast", external=True)
@pytest.mark.parametrize("config_name", cases.STAGE_CONFIGS)
@pytest.mark.parametrize("which", list(WIDTHS))
@pytest.mark.parametrize("tokens", cases.ALL_BATCHES)
def test_situ_and_mul(backend, config_name, which, tokens, seed, contract):
    _check(backend, config_name, which, tokens, seed, contract)


@pytest.mark.contract("situ_and_mul")
@pytest.mark.backends("reference")
@pytest.mark.parametrize("which", list(WIDTHS))
@pytest.mark.parametrize("config_name,tokens", cases.REFERENCE_GRID)
def test_situ_and_mul_reference(backend, config_name, which, tokens, seed, contract):
    """The contract, and the reference's FP32 value (``situ_and_mul_fp32``, which the
    experts use before their MXFP8 re-quantization) bit-identical to the oracle's."""
    cfg = cases.config(config_name)
    width = getattr(cfg, WIDTHS[which])
    kwargs = dict(beta=cfg.situ_beta, linear_beta=cfg.situ_linear_beta)
    h = _inputs(tokens, width, seed, "cpu")
    contract.bitwise(situ_and_mul_fp32(h, **kwargs),
                     oracle.situ_and_mul_fp32(h[:, :width], h[:, width:], **kwargs),
                     what="reference SiTU (FP32) vs oracle", index_names=("token", "column"))
    _check(backend, config_name, which, tokens, seed, contract)
