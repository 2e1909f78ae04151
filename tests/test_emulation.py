"""The fast kernels' own math on the CPU (``reference.emulation``): the accuracy of
``exp_rn`` / ``tanh_rn`` / ``sigmoid_rn`` over FP32 arguments, measured against float64 and
held below the bounds the contracts use (``verify.tolerances``), their special values, and
the emulated stages against the oracles and bounds of ``verify``.

The measurement takes every 127th FP32 bit pattern of the argument range (about 17 million
values per function, both signs, every binade); ``verify.tolerances`` quotes its maxima
(exp 1.17 ulp, tanh 1.32 ulp, sigmoid 1.5 u absolute) and rounds them up to the bounds
this test enforces.
"""

from __future__ import annotations

import torch

from model.exp_tanh import EXP_HI, EXP_LO
from reference import emulation as em
from reference.norm import rms_norm
from verify import bounds, tolerances
from verify.oracles import stages as oracle

STRIDE = 127


def fp32_arguments(lo: float, hi: float, offset: int = 0) -> torch.Tensor:
    """Every ``STRIDE``-th non-negative FP32 bit pattern (and its negative) in [lo, hi]."""
    bits = torch.arange(offset, 0x7F800000, STRIDE, dtype=torch.int64).to(torch.int32)
    v = bits.view(torch.float32)
    v = torch.cat([v, -v])
    return v[(v >= lo) & (v <= hi)]


def ulp_error(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|got - exact| in FP32 ULPs of the exact value (the subnormal spacing below 2^-126)."""
    ref = exact.float().abs()
    spacing = (torch.nextafter(ref, torch.tensor(float("inf"))) - ref).double()
    return (got.double() - exact).abs() / spacing


def worst(fn, exact_fn, args: torch.Tensor, *, finite_only: bool = False) -> float:
    out = 0.0
    for chunk in args.split(1 << 22):
        exact = exact_fn(chunk.double())
        keep = exact.abs() < torch.finfo(torch.float32).max if finite_only else slice(None)
        out = max(out, ulp_error(fn(chunk)[keep], exact[keep]).max().item())
    return out


def test_exp_rn_over_fp32_arguments():
    measured = worst(em.exp_rn, torch.exp, fp32_arguments(EXP_LO, EXP_HI), finite_only=True)
    print(f"exp_rn: max {measured:.3f} ulp")
    assert measured < tolerances.EXP_RN_ULP


def test_tanh_rn_over_fp32_arguments():
    measured = worst(em.tanh_rn, torch.tanh, fp32_arguments(-1e30, 1e30, offset=1))
    print(f"tanh_rn: max {measured:.3f} ulp")
    assert measured < tolerances.TANH_RN_ULP


def test_sigmoid_rn_absolute_error_over_the_router_range():
    """Router logits are any FP32 value; beyond ``[-EXP_HI, -EXP_LO]`` the sigmoid has
    saturated (exp_rn clamps its argument), so that range holds every distinct case."""
    args = fp32_arguments(-EXP_HI, -EXP_LO, offset=2)
    measured = max((em.sigmoid_rn(c).double() - torch.sigmoid(c.double())).abs().max().item()
                   for c in args.split(1 << 22))
    print(f"sigmoid_rn: max absolute error {measured / tolerances.U32:.3f} u")
    assert measured <= tolerances.SIGMOID_RN_ABS_ERROR


def test_special_values():
    sp = torch.tensor([200.0, -200.0, float("nan"), -0.0, 0.0])
    e = em.exp_rn(sp)
    assert e[0].item() == float("inf") and e[1].item() == 0.0 and e[2].isnan() and e[3].item() == 1.0
    t = em.tanh_rn(sp)
    assert t[0].item() == 1.0 and t[1].item() == -1.0 and t[2].isnan()
    assert str(t[3].item()) == "-0.0" and str(t[4].item()) == "0.0"


def test_rms_norm_tree_within_the_derived_bound(gen):
    x = (torch.randn(8, 3584, generator=gen) * 4).bfloat16()
    w = (1 + 0.1 * torch.randn(3584, generator=gen)).bfloat16()
    got = em.rms_norm_tree(x, w, 1e-5)
    x64 = x.double()
    exact = x64 * torch.rsqrt((x64 * x64).mean(1, keepdim=True) + 1e-5) * w.double()
    relative = tolerances.rms_norm_relative_error(3584)
    bound = bounds.final_rounding_bound(exact, exact.abs() * relative, torch.bfloat16)
    assert torch.all((got.double() - exact).abs() <= bound)
    assert got.shape == rms_norm(x, w, 1e-5).shape


def test_situ_and_mul_is_the_oracle_with_the_kernels_functions(gen):
    h = torch.cat([torch.randn(16, 512, generator=gen) * 4,
                   torch.randn(16, 512, generator=gen) * 16], 1).bfloat16()
    got = em.situ_and_mul(h, beta=4.0, linear_beta=25.0)
    want = oracle.situ_and_mul(h, beta=4.0, linear_beta=25.0, tanh=em.tanh_rn,
                               sigmoid=em.sigmoid_rn)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_route_is_the_oracle_with_sigmoid_rn(gen):
    logits = torch.randn(64, 896, generator=gen) * 2
    bias = torch.randn(896, generator=gen) * 0.05
    bias[40:72] = 1.0  # 32 experts tie on the bias: the tie rule decides among equal scores
    logits[:, 40:72] = 0.0
    w, ids = em.route(logits, bias, top_k=16)
    want_w, want_ids = oracle.route(logits, bias, top_k=16, renormalize=True, scale=1.0,
                                    sigmoid=em.sigmoid_rn)
    assert torch.equal(ids, want_ids) and torch.equal(w, want_w)
    assert ids[0].tolist() == list(range(40, 56))
