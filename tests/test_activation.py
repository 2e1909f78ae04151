"""reference.activation, the pieces: the library functions it calls stay within the ULP the
bounds assume, one BF16 rounding, the gate/up order, bad input.

The contracts (the FP32 value bit for bit against the op-by-op oracle, the BF16 value within
``verify.tolerances.SITU_RELATIVE_ERROR`` of float64) are ``verify/test_activation.py``.
"""

from __future__ import annotations

import pytest
import torch

from reference.activation import situ_and_mul, situ_and_mul_fp32
from verify import tolerances

BETA, LBETA = 4.0, 25.0


def ulp_error(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|got - exact| in FP32 ULPs of the exact value (float64 in)."""
    ref = exact.float().abs()
    spacing = (torch.nextafter(ref, torch.tensor(float("inf"))) - ref).double()
    return (got.double() - exact).abs() / spacing


def test_cpu_library_functions_within_their_documented_ulp(gen):
    """torch's CPU FP32 ``tanh`` and ``exp`` (SLEEF ``u10``) within
    ``verify.tolerances.CPU_TRANSCENDENTAL_ULP`` of float64 on the arguments SiTU gives them
    (``g / beta``, ``u / linear_beta`` and the gates), and the sigmoid within
    ``SIGMOID_RELATIVE_ERROR``: the preconditions of the SiTU bound."""
    gate = torch.cat([torch.randn(4096, generator=gen) * 3,
                      torch.rand(4096, generator=gen) * 160 - 80])
    up = torch.cat([torch.randn(4096, generator=gen) * 3,
                    torch.rand(4096, generator=gen) * 400 - 200])
    args = torch.cat([gate / BETA, up / LBETA])
    assert ulp_error(torch.tanh(args), torch.tanh(args.double())).max() <= \
        tolerances.CPU_TRANSCENDENTAL_ULP
    exp_args = -gate[gate > -87]  # exp(-g) stays finite
    assert ulp_error(torch.exp(exp_args), torch.exp(exp_args.double())).max() <= \
        tolerances.CPU_TRANSCENDENTAL_ULP
    exact = torch.sigmoid(gate.double())
    relative = ((torch.sigmoid(gate).double() - exact).abs() / exact).max().item()
    assert relative <= tolerances.SIGMOID_RELATIVE_ERROR


def test_bf16_is_one_rounding_and_gate_up_order(gen):
    h = (torch.randn(5, 64, generator=gen) * 4).bfloat16()
    fp32 = situ_and_mul_fp32(h, beta=BETA, linear_beta=LBETA)
    out = situ_and_mul(h, beta=BETA, linear_beta=LBETA)
    assert out.dtype == torch.bfloat16 and out.shape == (5, 32)
    assert torch.equal(out, fp32.to(torch.bfloat16))
    swapped = torch.cat([h[:, 32:], h[:, :32]], dim=1)
    assert not torch.equal(situ_and_mul(swapped, beta=BETA, linear_beta=LBETA), out)


def test_errors():
    with pytest.raises(ValueError, match="even last dim"):
        situ_and_mul_fp32(torch.zeros(2, 3), beta=BETA, linear_beta=LBETA)
    with pytest.raises(ValueError, match="h must be a tensor of dtype"):
        situ_and_mul_fp32(torch.zeros(2, 4, dtype=torch.float64), beta=BETA, linear_beta=LBETA)
    with pytest.raises(ValueError, match="beta must be a positive float"):
        situ_and_mul(torch.zeros(2, 4), beta=0.0, linear_beta=LBETA)
