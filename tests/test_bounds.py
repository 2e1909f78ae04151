"""Tests of verify.bounds: every bound holds for adversarial summation orders against an
exact reference, is attained or approached (not vacuous), and is exceeded by a
deliberately wrong computation (accumulation in BF16, missing underflow term, ...).

Exact references. Two arguments are used:
* `fractions.Fraction` — exact rational arithmetic, on small sizes;
* "float64 is exact here": bf16 values in [1, 2) have 8-bit significands and are multiples
  of 2^-7, so each product lies in [1, 4) and is a multiple of 2^-14; a sum of K <= 2^12
  such products is below 2^14 and a multiple of 2^-14, i.e. it needs at most 28 significand
  bits <= 53: every float64 partial sum, in any order, is exact.
"""

from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch

from verify.bounds import (
    dot_bound,
    final_rounding_bound,
    gamma,
    matmul_bf16_out_bound,
    matmul_fp32_out_bound,
    mma_matmul_bound,
    mma_split_k_terms,
    reference_matmul,
    rounding_bound,
    split_k_terms,
    sum_bound,
    unit_roundoff,
)
from verify.compare import ContractError, assert_within_bound


# --------------------------------------------------------------------------- constants


@pytest.mark.parametrize(
    "dtype,np_dtype",
    [
        (torch.float64, np.float64),
        (torch.float32, np.float32),
        (torch.float16, np.float16),
        (torch.bfloat16, ml_dtypes.bfloat16),
        (torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn),
        (torch.float8_e5m2, ml_dtypes.float8_e5m2),
    ],
)
def test_unit_roundoff_is_half_machine_epsilon(dtype, np_dtype):
    # eps = 2^(1-p) is the gap from 1 to the next value; u = eps / 2 (Higham §2.1)
    finfo = ml_dtypes.finfo(np_dtype) if np_dtype not in (np.float64, np.float32, np.float16) \
        else np.finfo(np_dtype)
    assert unit_roundoff(dtype) == float(finfo.eps) / 2
    assert unit_roundoff(torch.float32) == 2.0**-24 and unit_roundoff(torch.bfloat16) == 2.0**-8


def test_gamma_values_and_domain():
    assert gamma(0, 2.0**-24) == 0.0
    assert gamma(1, 0.25) == 0.25 / 0.75
    assert gamma(3, 0.125) == 0.375 / 0.625
    with pytest.raises(ValueError):
        gamma(256, 2.0**-8)  # n u = 1
    with pytest.raises(ValueError):
        gamma(-1, 2.0**-24)


def test_split_k_terms():
    assert split_k_terms(7168, 1) == 7168
    assert split_k_terms(7168, 8) == 896 + 7
    assert split_k_terms(10, 3) == 4 + 2  # chunks of at most 4 terms, 3 partials
    assert split_k_terms(10, 10) == 10
    with pytest.raises(ValueError):
        split_k_terms(4, 5)


# --------------------------------------------------------------------------- rounding


@pytest.mark.parametrize(
    "dtype,src",
    [
        (torch.bfloat16, torch.float64),
        (torch.float16, torch.float64),
        (torch.float32, torch.float64),
        (torch.float8_e4m3fn, torch.float32),  # torch converts to fp8 from fp32 only
    ],
)
def test_rounding_bound_holds_and_is_attained(dtype, src, gen):
    p_bits = -int(math.log2(unit_roundoff(dtype)))
    fmax = 448.0 if dtype == torch.float8_e4m3fn else torch.finfo(dtype).max
    tiny = torch.finfo(dtype).tiny if dtype != torch.float8_e4m3fn else 2.0**-6
    # log-uniform magnitudes from deep in the subnormal range up to just below the maximum
    lo, hi = math.log2(tiny) - p_bits - 2, math.log2(fmax) - 0.01
    e = lo + (hi - lo) * torch.rand(20000, generator=gen, dtype=torch.float64)
    sign = torch.where(torch.rand(20000, generator=gen) < 0.5, -1.0, 1.0).double()
    x = (sign * torch.exp2(e)).to(src)
    r = x.to(dtype).to(torch.float64)
    b = rounding_bound(x, dtype)
    err = (r - x.double()).abs()
    assert bool((err <= b).all())
    # midpoints of adjacent representable values in the normal and subnormal range round
    # by exactly half a spacing: the bound is attained (ratio 1)
    grid = torch.tensor([1.0, 1.5, tiny * 1.25, tiny / 2], dtype=torch.float64)
    # spacing 2^(1-p) in [1, 2); tiny * 2^(1-p) in the smallest binade and below it
    spacing = torch.tensor([1.0, 1.0, tiny, tiny], dtype=torch.float64) * 2.0 ** (1 - p_bits)
    mid = (grid + spacing / 2).to(src)
    err = (mid.to(dtype).double() - mid.double()).abs()
    assert torch.equal(err, rounding_bound(mid, dtype))


def test_rounding_bound_across_binade_edge_needs_propagated():
    # x = 2 - 2^-8 lies in [1, 2) where bf16's half-spacing is 2^-8; a computed
    # y = x + beta with beta = 3 * 2^-8 lands on 2 + 2^-7, the midpoint between 2 and
    # 2 + 2^-6 (spacing 2^-6 in [2, 4)), and ties to even 2.0: error 2^-7 > 2^-8.
    x = torch.tensor([2.0 - 2.0**-8], dtype=torch.float64)
    beta = torch.tensor([3 * 2.0**-8], dtype=torch.float64)
    y = x + beta
    err = (y.to(torch.bfloat16).double() - y).abs()
    assert err.item() == 2.0**-7
    naive = rounding_bound(x, torch.bfloat16)  # binade of |x| alone: half-ulp 2^-8
    assert bool((err > naive).all())
    assert bool((err <= rounding_bound(x, torch.bfloat16, propagated=beta)).all())
    total = final_rounding_bound(x, beta, torch.bfloat16)
    assert bool(((y.to(torch.bfloat16).double() - x).abs() <= total).all())


def test_rounding_bound_zero_and_overflow():
    assert rounding_bound(torch.zeros(3, dtype=torch.float64), torch.bfloat16).tolist() == [0.0] * 3
    assert rounding_bound(torch.tensor([1e-45]), torch.float32).item() == 2.0**-150
    with pytest.raises(ValueError, match="overflow"):
        rounding_bound(torch.tensor([448.0 + 16.0], dtype=torch.float64), torch.float8_e4m3fn)


# --------------------------------------------------------------------------- dot products


def _orders(p: torch.Tensor, splits: int) -> dict[str, torch.Tensor]:
    """FP32 sums over the last dim of the FP32 products `p` [M, N, K] in several orders,
    each with torch fp32 elementwise adds (IEEE round to nearest on CPU)."""
    k = p.shape[-1]
    out = {}

    def seq(t: torch.Tensor) -> torch.Tensor:
        acc = torch.zeros(t.shape[:-1], dtype=torch.float32)
        for i in range(t.shape[-1]):
            acc = acc + t[..., i]
        return acc

    out["sequential"] = seq(p)
    out["reversed"] = seq(p.flip(-1))
    x = p
    while x.shape[-1] > 1:  # pairwise tree, the odd element carried up
        n2 = x.shape[-1] // 2 * 2
        x = torch.cat([x[..., 0:n2:2] + x[..., 1:n2:2], x[..., n2:]], dim=-1)
    out["pairwise"] = x[..., 0]
    order = p.abs().argsort(dim=-1)
    out["increasing |p|"] = seq(p.gather(-1, order))
    out["decreasing |p|"] = seq(p.gather(-1, order.flip(-1)))
    c = -(-k // splits)
    partials = torch.stack([seq(p[..., j:j + c]) for j in range(0, k, c)], dim=-1)
    out["split-K"] = seq(partials.flip(-1))
    return out


def _exact(a: torch.Tensor, b: torch.Tensor) -> list[list[Fraction]]:
    a64, b64 = a.double().tolist(), b.double().tolist()
    return [[sum((Fraction(x) * Fraction(y) for x, y in zip(ra, rb)), Fraction(0))
             for rb in b64] for ra in a64]


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_dot_bound_holds_for_adversarial_orders_exact_fractions(in_dtype, gen):
    m, n, k, splits = 5, 4, 48, 5
    # mixed magnitudes and signs to provoke cancellation
    scale = torch.exp2(torch.randint(-10, 10, (1, k), generator=gen).float())
    a = (torch.randn(m, k, generator=gen) * scale).to(in_dtype)
    b = torch.randn(n, k, generator=gen).to(in_dtype)
    p = a.float()[:, None, :] * b.float()[None, :, :]
    exact = _exact(a, b)
    bound1 = dot_bound(a, b)
    bound_s = dot_bound(a, b, splits=splits)
    assert bool((bound_s <= bound1).all())
    worst = 0.0
    for name, c in _orders(p, splits).items():
        bnd = bound_s if name == "split-K" else bound1
        for i in range(m):
            for j in range(n):
                err = abs(Fraction(c[i, j].item()) - exact[i][j])
                assert err <= Fraction(bnd[i, j].item()), (name, i, j)
                worst = max(worst, float(err / Fraction(bnd[i, j].item())))
    assert worst > 0.0  # the orders did round somewhere


def _bf16_in_one_two(shape, gen):
    """bf16 values uniformly over the 128 significands of [1, 2) (see module docstring)."""
    return (1.0 + torch.randint(0, 128, shape, generator=gen).float() / 128).to(torch.bfloat16)


def test_dot_bound_not_vacuous_for_sequential_fp32(gen, record_property):
    m, n, k = 16, 16, 4096
    a, b = _bf16_in_one_two((m, k), gen), _bf16_in_one_two((n, k), gen)
    exact = reference_matmul(a, b)  # exact: 28-bit sums (module docstring)
    p = a.float()[:, None, :] * b.float()[None, :, :]  # exact bf16 products
    acc = torch.zeros(m, n, dtype=torch.float32)
    for i in range(k):
        acc = acc + p[..., i]
    res = assert_within_bound(acc, exact, dot_bound(a, b), what="sequential fp32 dot",
                              index_names=("row", "col"))
    record_property("worst_ratio_sequential_fp32_K4096", res.worst_ratio)
    print(f"worst |err|/bound, sequential FP32, K={k}: {res.worst_ratio:.3e}")
    # Not vacuous: a sequential FP32 sum's rounding errors add like a random walk, about
    # sqrt(K) u |a||b| against the bound's K u |a||b| -- a ratio near 1/sqrt(K) = 1/64 here;
    # requiring 1/1000 leaves a factor 16 for the walk's spread.
    assert res.worst_ratio > 1e-3
    # the same data accumulated in BF16 (a planted bug) breaks the bound
    acc16 = torch.zeros(m, n, dtype=torch.bfloat16)
    for i in range(k):
        acc16 = (acc16.float() + p[..., i]).to(torch.bfloat16)
    with pytest.raises(ContractError, match="exceed the bound"):
        assert_within_bound(acc16, exact, dot_bound(a, b), what="bf16 accumulation")
    # truncating adds (round toward zero, emulated exactly: the float64 sum is exact and
    # a round-to-nearest result above it in magnitude is stepped back one fp32 ulp) stay
    # inside the toward_zero bound
    acc_rz = torch.zeros(m, n, dtype=torch.float32)
    for i in range(k):
        s = acc_rz.double() + p[..., i].double()  # exact: 28-bit sums
        r = s.float()
        acc_rz = torch.where(r.double().abs() > s.abs(),
                             torch.nextafter(r, torch.zeros_like(r)), r)
    rz = assert_within_bound(acc_rz, exact, dot_bound(a, b, accum_rounding="toward_zero"),
                             what="truncating fp32 dot")
    print(f"worst |err|/bound, truncating FP32: {rz.worst_ratio:.3e}")
    # truncation errors all have one sign and grow like K, the nearest ones like sqrt(K):
    # the much larger ratio shows the emulation did truncate
    assert rz.worst_ratio > 5 * res.worst_ratio


def test_dot_bound_underflow_term_is_needed(gen):
    # bf16 inputs near 2^-70: their products (~2^-140) are FP32 subnormals and lose up to
    # 2^-150 each; gamma_K * S alone (~K^2 2^-164) cannot cover that.
    m, n, k = 8, 8, 64
    a = (_bf16_in_one_two((m, k), gen).float() * 2.0**-70).to(torch.bfloat16)
    b = (_bf16_in_one_two((n, k), gen).float() * 2.0**-70).to(torch.bfloat16)
    exact = reference_matmul(a, b)  # exact: same 28-bit argument scaled by 2^-140
    p = a.float()[:, None, :] * b.float()[None, :, :]
    acc = torch.zeros(m, n, dtype=torch.float32)
    for i in range(k):
        acc = acc + p[..., i]
    assert_within_bound(acc, exact, dot_bound(a, b), what="subnormal products")
    gamma_only = gamma(k, unit_roundoff(torch.float32)) * (a.double() @ b.double().T)
    with pytest.raises(ContractError):
        assert_within_bound(acc, exact, gamma_only, what="without the underflow term")


# --------------------------------------------------------------------------- GEMM helpers


def test_matmul_bf16_out_bound_torch_and_emulated(gen, record_property):
    m, n, k = 16, 24, 512
    a = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    ref = reference_matmul(a, b)
    bound = matmul_bf16_out_bound(a, b)
    res = assert_within_bound(a @ b.T, ref, bound, what="torch bf16 matmul",
                              index_names=("token", "column"))
    record_property("worst_ratio_torch_bf16_matmul", res.worst_ratio)
    # split-K: 4 FP32 partials reduced in FP32, then one BF16 rounding
    parts = [a[:, j:j + 128].float() @ b[:, j:j + 128].float().T for j in range(0, k, 128)]
    c = (((parts[3] + parts[1]) + parts[0]) + parts[2]).to(torch.bfloat16)
    assert_within_bound(c, ref, matmul_bf16_out_bound(a, b, splits=4), what="split-K")
    # addmm: C0 + A @ B^T in FP32, one BF16 rounding
    c0 = torch.randn(m, n, generator=gen).to(torch.bfloat16)
    c = (c0.float() + a.float() @ b.float().T).to(torch.bfloat16)
    assert_within_bound(c, ref + c0.double(), matmul_bf16_out_bound(a, b, addend=c0),
                        what="addmm")
    # a planted bug: rounding the FP32 partials to BF16 before the split-K reduction
    bad = sum(pp.to(torch.bfloat16).float() for pp in parts).to(torch.bfloat16)
    with pytest.raises(ContractError):
        assert_within_bound(bad, ref, matmul_bf16_out_bound(a, b, splits=4), what="bf16 partials")


def test_mma_split_k_terms_and_bound(gen):
    """The tensor-core split-K count: K + K/16 for one part (the experts engine's chain
    without its chain joins), ``c + ceil(c / 16) + splits - 1`` for ``splits`` parts; the
    bound holds for a truncating emulation of 16-product steps in 4 parts summed in order,
    with a BF16 addend, BF16 out, and breaks when a part is dropped."""
    assert mma_split_k_terms(7168) == 7168 + 448
    assert mma_split_k_terms(7168, 2) == 3584 + 224 + 1
    assert mma_split_k_terms(100, 3) == 34 + 3 + 2
    with pytest.raises(ValueError):
        mma_split_k_terms(4, 5)
    m, n, k, splits = 6, 10, 1024, 4
    a = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    c0 = torch.randn(m, n, generator=gen).to(torch.bfloat16)
    p = a.double()[:, None, :] * b.double()[None, :, :]  # exact products

    def rz(s):  # the float64 step sum truncated to FP32
        r = s.float()
        return torch.where(r.double().abs() > s.abs(), torch.nextafter(r, torch.zeros_like(r)), r)

    parts = []
    for part in p.split(k // splits, dim=-1):
        acc = torch.zeros(m, n, dtype=torch.float32)
        for step in part.split(16, dim=-1):
            acc = rz(acc.double() + step.sum(-1))
        parts.append(acc)
    total = parts[0]
    for q in parts[1:]:
        total = total + q
    out = (total + c0.float()).to(torch.bfloat16)
    ref, bound = mma_matmul_bound(a, b, splits=splits, addend=c0, out_dtype=torch.bfloat16)
    assert_within_bound(out, ref, bound, what="truncating split-K MMA emulation")
    ref32, bound32 = mma_matmul_bound(a, b, splits=splits)
    assert_within_bound(total, ref32, bound32, what="FP32 out")
    with pytest.raises(ContractError):
        short = (parts[0] + parts[1] + parts[2] + c0.float()).to(torch.bfloat16)
        assert_within_bound(short, ref, bound, what="a dropped split")


def test_matmul_fp32_out_bound_includes_reference_error(gen):
    m, n, k = 8, 8, 256
    a = torch.randn(m, k, generator=gen)
    b = torch.randn(n, k, generator=gen)
    ref = reference_matmul(a, b)
    fp32 = matmul_fp32_out_bound(a, b)
    assert bool((fp32 > dot_bound(a, b)).all())  # + the float64 reference's own error
    assert_within_bound(a @ b.T, ref, fp32, what="torch fp32 matmul")
    # the output rounding of a BF16-out GEMM is not covered by the FP32-out bound
    with pytest.raises(ContractError):
        assert_within_bound((a @ b.T).to(torch.bfloat16), ref, fp32, what="bf16 vs fp32 bound")


def test_sum_bound_any_order_exact(gen):
    n, rows = 300, 12
    x = (torch.randn(rows, n, generator=gen) *
         torch.exp2(torch.randint(-12, 12, (rows, n), generator=gen).float()))
    exact = [sum((Fraction(v) for v in r), Fraction(0)) for r in x.double().tolist()]
    bound = sum_bound(x.double().abs().sum(-1), n, torch.float32)
    for name, s in _orders(x[:, None, :], splits=10).items():
        # split-K: each term passes at most (c - 1) + (splits - 1) <= n - 1 additions
        for i in range(rows):
            err = abs(Fraction(s[i, 0].item()) - exact[i])
            assert err <= Fraction(bound[i].item()), (name, i)
    # accumulating the same terms in BF16 is far outside the FP32 bound
    acc = torch.zeros(rows, dtype=torch.bfloat16)
    for i in range(n):
        acc = acc + x[:, i].to(torch.bfloat16)
    err = (acc.double() - torch.tensor([float(e) for e in exact], dtype=torch.float64)).abs()
    assert bool((err > bound).any())
    assert sum_bound(5.0, 1, torch.float32).item() == 0.0


def test_gemm_accum_rounding_by_device():
    """cuBLAS on a GPU accumulates on tensor cores (truncating adders): its any-order bound
    uses ``u = 2^-23`` and is at least the round-to-nearest bound of a CPU GEMM."""
    import torch

    from verify import bounds

    assert bounds.gemm_accum_rounding("cuda") == "toward_zero"
    assert bounds.gemm_accum_rounding(torch.device("cuda", 1)) == "toward_zero"
    assert bounds.gemm_accum_rounding("cpu") == "nearest"
    g = torch.Generator().manual_seed(3)
    a = torch.randn(4, 512, generator=g).bfloat16()
    b = torch.randn(8, 512, generator=g).bfloat16()
    near = bounds.matmul_fp32_out_bound(a, b)
    trunc = bounds.matmul_fp32_out_bound(a, b, accum_rounding="toward_zero")
    assert bool((trunc >= near).all()) and bool((trunc > 1.9 * near).any())
