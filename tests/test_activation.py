"""reference.activation against a numpy FP32 formulation and the float64 formula.

Two checks, because torch's FP32 `tanh`/`sigmoid` are not correctly rounded:

* bitwise: the numpy formulation below performs every basic op (/, *) in FP32 in the
  documented order and takes the transcendental values from torch's own functions on the
  same inputs — equal bits prove the op order and every rounding point;
* bounded: against the float64 formula. With u = 2^-24, the FP32 path's relative error is
  at most (first order) u for g/beta + 2u for tanh (1 ulp <= 2u) + 4u for sigmoid
  (2 ulp) + u for a3*a4 + u for u/linear_beta + 2u for tanh + u for linear_beta*b2 + u for
  the last product = 13u; the arguments' relative perturbations pass through tanh with a
  condition number |x tanh'(x) / tanh(x)| <= 1. Bound used: 14u (second-order slack).
  The tanh <= 1 ulp and sigmoid <= 2 ulp figures are preconditions, measured on the test
  inputs against math.tanh / math.exp (asserted, so a torch build that breaks them fails
  loudly here rather than silently loosening the bound). Below g = -87 torch's FP32
  sigmoid flushes to 0 (exp(-g) overflows); the test's gates stay above -80.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from reference.activation import situ_and_mul, situ_and_mul_float64, situ_and_mul_fp32
from test_fp import seed_of

BETA, LBETA = 4.0, 25.0


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.view(torch.int32).long() - b.view(torch.int32).long()).abs()


def inputs(request, n=4096):
    g = torch.Generator().manual_seed(seed_of(request.node.nodeid))
    gate = torch.cat([torch.randn(n, generator=g) * 3,          # the bulk
                      torch.rand(n, generator=g) * 160 - 80,    # |gate| >> beta: saturation
                      torch.tensor([0.0, -0.0, 4.0, -4.0, 1e-30, -79.9])])
    up = torch.cat([torch.randn(n, generator=g) * 3,
                    torch.rand(n, generator=g) * 400 - 200,     # |up| >> linear_beta
                    torch.tensor([0.0, 25.0, -25.0, 1e-30, 200.0, -0.0])])
    return gate.float(), up.float()


def numpy_fp32(gate: torch.Tensor, up: torch.Tensor) -> np.ndarray:
    f = np.float32
    g, u = gate.numpy(), up.numpy()
    a1 = (g / f(BETA)).astype(f)
    a2 = torch.tanh(torch.from_numpy(a1)).numpy()
    a3 = (f(BETA) * a2).astype(f)
    a4 = torch.sigmoid(torch.from_numpy(g)).numpy()
    a5 = (a3 * a4).astype(f)
    b1 = (u / f(LBETA)).astype(f)
    b2 = torch.tanh(torch.from_numpy(b1)).numpy()
    b3 = (f(LBETA) * b2).astype(f)
    return (a5 * b3).astype(f)


def test_bitwise_op_order(request):
    gate, up = inputs(request)
    h = torch.cat([gate, up])[None]  # [1, 2N]: gate half then up half
    got = situ_and_mul_fp32(h, beta=BETA, linear_beta=LBETA)[0]
    want = numpy_fp32(gate, up)
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy().view(np.int32), want.view(np.int32))


def test_transcendental_preconditions(request):
    gate, up = inputs(request)
    args = torch.cat([gate / BETA, up / LBETA])
    tanh_ref = torch.tensor([math.tanh(v) for v in args.double().tolist()]).float()
    sig_ref = torch.tensor([1 / (1 + math.exp(-v)) for v in gate.double().tolist()]).float()
    assert ulp_distance(torch.tanh(args), tanh_ref).max().item() <= 1, "torch FP32 tanh > 1 ulp"
    assert ulp_distance(torch.sigmoid(gate), sig_ref).max().item() <= 2, "torch FP32 sigmoid > 2 ulp"


def test_bounded_against_float64(request):
    gate, up = inputs(request)
    h = torch.stack([gate, up], dim=0).T.reshape(-1, 2)  # rows [gate_i, up_i]
    got = situ_and_mul_fp32(h, beta=BETA, linear_beta=LBETA)[:, 0].double()
    ref = situ_and_mul_float64(h.double(), beta=BETA, linear_beta=LBETA)[:, 0]
    bound = 14 * 2.0**-24 * ref.abs()
    ratio = ((got - ref).abs() / bound.clamp_min(1e-300)).max().item()
    assert torch.all((got - ref).abs() <= bound), f"worst error / bound = {ratio}"
    # saturation actually exercised: |beta tanh(g/beta)| within 1e-6 of beta, and likewise up
    assert ((BETA - (BETA * torch.tanh(gate.double() / BETA)).abs()) < 1e-6).sum() > 100
    assert ((LBETA - (LBETA * torch.tanh(up.double() / LBETA)).abs()) < 1e-3).sum() > 100


def test_bf16_is_one_rounding_and_gate_up_order(request):
    g = torch.Generator().manual_seed(seed_of(request.node.nodeid))
    h = (torch.randn(5, 64, generator=g) * 4).bfloat16()
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
