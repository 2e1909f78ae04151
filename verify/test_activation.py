"""Contracts of SiTU-and-mul: ``beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta)``
in FP32, one BF16 rounding (shared expert) or, inside the experts, the FP32 value itself.

* ``reference``: its FP32 value bit-identical to the oracle
  :func:`verify.oracles.stages.situ_and_mul_fp32` (every operation in order, torch's FP32
  ``tanh`` / ``sigmoid`` on the same arguments) and its BF16 value to the oracle's rounding;
* ``fast``: bit-identical to ``reference.emulation.situ_and_mul`` and to the same oracle
  fed with the kernels' own ``tanh_rn`` / ``sigmoid_rn`` (so the emulation is checked too);
* every backend (``stock``, ``reference-cuda`` with CUDA's library functions): within
  ``verify.tolerances.SITU_RELATIVE_ERROR`` of the exact float64 value plus the final BF16
  rounding; the share of outputs whose bits differ from the reference is reported (``n/a``
  for the reference itself).

Widths are the config's: the shared expert's ``shared_intermediate`` and the routed
experts' ``intermediate`` (``N``; the input is ``[T, 2N]``, gate half first).
"""

from __future__ import annotations

import pytest
import torch

from reference import emulation
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


def _run(backend, h, cfg):
    kwargs = dict(beta=cfg.situ_beta, linear_beta=cfg.situ_linear_beta)
    if backend.name == "fast":
        from fast import activation

        return activation.situ_and_mul(h, **kwargs)
    if backend.name == "stock":
        from fast import stock

        return stock.situ_and_mul(h, **kwargs)
    return situ_and_mul(h, **kwargs)


def _check(backend, config_name, which, tokens, seed, contract):
    cfg = cases.config(config_name)
    width = getattr(cfg, WIDTHS[which])
    h = _inputs(tokens, width, seed, backend.device)
    out = _run(backend, h, cfg).cpu()
    h = h.cpu()
    names = ("token", "column")
    kwargs = dict(beta=cfg.situ_beta, linear_beta=cfg.situ_linear_beta)
    gate, up = h[:, :width], h[:, width:]
    if backend.name == "reference":
        contract.bitwise(situ_and_mul_fp32(h, **kwargs), oracle.situ_and_mul_fp32(gate, up, **kwargs),
                         what="reference SiTU (FP32) vs oracle", index_names=names)
        contract.bitwise(out, oracle.situ_and_mul(h, **kwargs), what="reference SiTU vs oracle",
                         index_names=names)
    if backend.name == "fast":
        contract.bitwise(out, emulation.situ_and_mul(h, **kwargs),
                         what="fast SiTU vs its emulation", index_names=names)
        own = oracle.situ_and_mul(h, **kwargs, tanh=emulation.tanh_rn, sigmoid=emulation.sigmoid_rn)
        contract.bitwise(out, own, what="fast SiTU vs oracle with tanh_rn / sigmoid_rn",
                         index_names=names)
    exact = situ_and_mul_float64(h.double(), **kwargs)
    bound = bounds.final_rounding_bound(
        exact, exact.abs() * tolerances.SITU_RELATIVE_ERROR, torch.bfloat16)
    contract.bounded(out, exact, bound, what=f"{backend.name} SiTU vs exact",
                     bound_name="library exp/tanh ULP + FP32 roundings + BF16 half-ULP",
                     index_names=names)
    if backend.name == "reference":
        contract.not_applicable("bf16_ulp_off_vs_reference")
    else:
        off = compare.ulp_distance(out, situ_and_mul(h, **kwargs)) > 0
        contract.figure("bf16_ulp_off_vs_reference", off.double().mean().item(), worst="max")


@pytest.mark.backends("reference-cuda", "stock", "fast")
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
    _check(backend, config_name, which, tokens, seed, contract)
