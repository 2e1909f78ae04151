"""Derived forward-error bounds for stages that differ from the reference only in the
order of their floating-point sums (the bounded contracts of ``docs/design.md``).

No tolerance here is chosen by hand: every constant is a unit roundoff ``u = 2^-p`` of a
format (``p`` = significand bits including the implicit one), combined with Higham's
``gamma_n = n u / (1 - n u)`` (N. J. Higham, *Accuracy and Stability of Numerical
Algorithms*, 2nd ed., §3.1, Lemma 3.1), and the half-ULP of the final
rounding with its subnormal spacing.

Model (Higham §2.2): each FP32 operation returns ``fl(x op y) = (x op y)(1 + d)``,
``|d| <= u``, round to nearest, no overflow. Underflow is accounted for explicitly where it
can happen: a subnormal sum or difference is exact, so only products can lose more than
``u`` relatively, by at most half the smallest subnormal spacing each (``eta`` below).

The bounds are computed in float64 from the operands. The float64 evaluation of
``|A| @ |B|^T`` itself rounds; every bound returned is multiplied by ``1 + gamma_{n+4}(2^-53)``
(``n`` = the number of float64 roundings on any path) so that the float64 number returned is
at least the real-number bound (see `_inflate`).

Typical contract (a BF16-out GEMM whose kernel may sum in any order)::

    exact = reference_matmul(a, b)                 # float64
    bound = matmul_bf16_out_bound(a, b)            # covers kernel order + BF16 rounding
    assert_within_bound(c_fast, exact, bound, what="front GEMM", index_names=("token", "col"))
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "dot_bound",
    "final_rounding_bound",
    "gamma",
    "matmul_bf16_out_bound",
    "matmul_fp32_out_bound",
    "mma_matmul_bound",
    "mma_split_k_terms",
    "reference_matmul",
    "rounding_bound",
    "split_k_terms",
    "sum_bound",
    "unit_roundoff",
]

# dtype -> (p = significand bits including the implicit bit, e_min = exponent of the
# smallest normal binade, largest finite value). The smallest subnormal spacing is
# 2^(e_min - p + 1): FP32 2^-149, BF16 2^-133, FP16 2^-24, E4M3 2^-9, FP64 2^-1074.
_FORMATS: dict[torch.dtype, tuple[int, int, float]] = {
    torch.float64: (53, -1022, torch.finfo(torch.float64).max),
    torch.float32: (24, -126, torch.finfo(torch.float32).max),
    torch.bfloat16: (8, -126, torch.finfo(torch.bfloat16).max),
    torch.float16: (11, -14, torch.finfo(torch.float16).max),
    torch.float8_e4m3fn: (4, -6, 448.0),
    torch.float8_e5m2: (3, -14, 57344.0),
}

_U64 = 2.0**-53
# Largest count of float64 roundings `_inflate` accepts: for n <= 2^20 the second-order
# terms n^2 u64^2 <= 2^-66 are below the first-order margin u64 it keeps (see _inflate).
_MAX_F64_OPS = 2**20


def _format(dtype: torch.dtype) -> tuple[int, int, float]:
    if dtype not in _FORMATS:
        raise TypeError(
            f"no rounding model for {dtype} (known: {', '.join(str(d) for d in _FORMATS)})"
        )
    return _FORMATS[dtype]


def unit_roundoff(dtype: torch.dtype) -> float:
    """Unit roundoff ``u = 2^-p`` of a binary format under round to nearest.

    ``p`` counts significand bits including the implicit one: FP64 53 (``2^-53``),
    FP32 24 (``2^-24``), FP16 11 (``2^-11``), BF16 8 (``2^-8``), E4M3 4 (``2^-4``),
    E5M2 3 (``2^-3``). For a normal result, ``|fl(x) - x| <= u |x|`` (Higham §2.1, Thm 2.2).

    Args:
        dtype: a torch floating dtype listed above.

    Returns:
        ``u`` as a Python float (exact: a power of two).
    """
    p, _, _ = _format(dtype)
    return 2.0**-p


def gamma(n: int, u: float) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)`` (Higham §3.1, Lemma 3.1).

    By Lemma 3.1, if ``|d_i| <= u`` and ``n u < 1`` then ``prod_{i<=n} (1 + d_i)^{±1} =
    1 + theta_n`` with ``|theta_n| <= gamma_n``. Also ``gamma_m + gamma_n + gamma_m gamma_n
    <= gamma_{m+n}`` (Lemma 3.3), used to chain stages.

    Args:
        n: number of roundings (``>= 0``).
        u: unit roundoff of the arithmetic.

    Returns:
        ``gamma_n`` (0.0 for ``n == 0``).

    Raises:
        ValueError: ``n < 0`` or ``n u >= 1`` (the lemma no longer holds).
    """
    if n < 0:
        raise ValueError(f"gamma: n must be >= 0, got {n}")
    nu = n * u
    if nu >= 1.0:
        raise ValueError(f"gamma: n*u = {n}*{u} = {nu} >= 1, no bound of this form exists")
    return nu / (1.0 - nu)


def _inflate(x: torch.Tensor, n: int) -> torch.Tensor:
    """Make a float64-evaluated non-negative quantity an upper bound of its real value.

    If `x` was computed in float64 from exactly representable non-negative data with at
    most `n` roundings on any path, then ``x >= x_true (1 - gamma_n(u64))``. The returned
    ``fl(x * fl(1 + gamma_{n+4}(u64)))`` carries three more roundings (the gamma, the sum
    with 1, the product), so it is ``>= x_true (1 - gamma_n)(1 + gamma_{n+4})(1 - u64)^3``;
    to first order that is ``x_true (1 + u64)``, and the second-order terms (``O(n^2
    u64^2)``) stay below ``u64`` for ``n <= 2^20``. Hence the result is ``>= x_true``.
    """
    if n > _MAX_F64_OPS:
        raise ValueError(f"_inflate: {n} float64 roundings exceed the supported {_MAX_F64_OPS}")
    return x * (1.0 + gamma(n + 4, _U64))


def _check_exact_in_f64(t: torch.Tensor) -> None:
    # Products of two FP32 significands (24 bits each) need 48 <= 53 bits, and FP32's
    # exponent range squared stays normal in FP64, so |a_i||b_i| is exact in float64.
    if t.dtype not in (torch.float32, torch.bfloat16, torch.float16,
                       torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(
            f"operand dtype {t.dtype}: the bounds assume operands of at most 24 significand "
            "bits so that float64 products are exact"
        )


def split_k_terms(k: int, splits: int = 1) -> int:
    """Effective ``n`` of ``gamma_n`` for a K-long dot product reduced in `splits` parts.

    The K products are split into `splits` contiguous chunks of at most
    ``c = ceil(K / splits)`` terms; each chunk is summed in the accumulation format in any
    order (each product is perturbed by at most ``c`` factors ``(1 + d)``: its own rounding
    and at most ``c - 1`` additions), and the `splits` partials are then summed in the
    same format in any order (at most ``splits - 1`` more factors on every term). By
    Higham Lemma 3.1 and 3.3 every product ends up multiplied by ``1 + theta`` with
    ``|theta| <= gamma_{c + splits - 1}``, so

        ``|C_computed - C_exact| <= gamma_{ceil(K/splits) + splits - 1} * sum_i |a_i b_i|``.

    ``splits == 1`` gives ``gamma_K`` (Higham §3.1, any summation order).

    Args:
        k: reduction length ``K >= 1``.
        splits: number of split-K partials, ``1 <= splits <= K``.

    Returns:
        ``ceil(K / splits) + splits - 1``.
    """
    if k < 1 or not 1 <= splits <= k:
        raise ValueError(f"need K >= 1 and 1 <= splits <= K, got K={k}, splits={splits}")
    return -(-k // splits) + splits - 1


def _abs_products(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``|A| @ |B|^T`` in float64, [..., M, N], evaluated with at most K roundings/path."""
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(f"reduction dims differ: A {tuple(a.shape)} vs B {tuple(b.shape)}")
    _check_exact_in_f64(a)
    _check_exact_in_f64(b)
    return a.to(torch.float64).abs() @ b.to(torch.float64).abs().transpose(-1, -2)


def _accum_u(accum_dtype: torch.dtype, accum_rounding: str) -> float:
    if accum_rounding == "nearest":
        return unit_roundoff(accum_dtype)
    if accum_rounding == "toward_zero":
        return 2.0 * unit_roundoff(accum_dtype)
    raise ValueError(f"accum_rounding must be 'nearest' or 'toward_zero', got {accum_rounding!r}")


def _dot_bound_from(
    s: torch.Tensor, k: int, n: int, accum_dtype: torch.dtype, accum_rounding: str
) -> torch.Tensor:
    p, e_min, _ = _format(accum_dtype)
    g = gamma(n, _accum_u(accum_dtype, accum_rounding))
    # Half of the smallest subnormal spacing 2^(e_min - p + 1) (round to nearest); a
    # truncating product loses up to the whole spacing.
    eta = 2.0 ** (e_min - p) * (1 if accum_rounding == "nearest" else 2)
    # float64 roundings on any path: K for S (+1 addend), then *g and +: K + 3.
    return _inflate(s * g + k * eta * (1.0 + g), k + 3)


def dot_bound(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    accum_dtype: torch.dtype = torch.float32,
    splits: int = 1,
    addend: torch.Tensor | None = None,
    accum_rounding: str = "nearest",
) -> torch.Tensor:
    """Bound on the accumulation error of ``C = A @ B^T`` (+ `addend`) in any order.

    Args:
        a: ``[..., M, K]`` operand (bf16, fp16, fp32 or fp8).
        b: ``[N, K]`` operand, same constraints.
        accum_dtype: format of the accumulator (FP32 for every GEMM of this project).
        splits: split-K partials, each reduced in `accum_dtype`, then summed in
            `accum_dtype`, any order (see [`split_k_terms`][verify.bounds.split_k_terms]).
        addend: optional ``C0`` broadcastable to ``[..., M, N]`` that the kernel adds in the
            accumulation format (an ``addmm``/epilogue with ``beta = 1``): it is one more
            term of the sum.
        accum_rounding: ``"nearest"`` (IEEE round to nearest, ``u = 2^-p``) or
            ``"toward_zero"`` (truncating adders, ``u = 2^(1-p)``: a truncation loses less
            than one ULP, i.e. ``|d| < 2^(1-p)``). Tensor-core MMA units have been measured
            to truncate inside their block sums (Fasi, Higham, Mikaitis, Pranesh, *Numerical
            behavior of NVIDIA tensor cores*, PeerJ CS 2021); a contract for such a kernel
            whose observed ratio approaches 1 under ``"nearest"`` should use ``"toward_zero"``.

    Returns:
        float64 ``[..., M, N]`` tensor ``beta`` such that, with ``n`` = the effective term
        count (``split_k_terms(K, splits)``, plus 1 with an addend), ``u`` as above,
        ``S = |A| @ |B|^T (+ |C0|)`` and ``eta`` half the smallest subnormal spacing of
        `accum_dtype` (the whole spacing under truncation):

            ``|C_computed - C_exact| <= gamma_n(u) * S + (K * eta) * (1 + gamma_n(u)) = beta``

        The first term is Higham's dot-product bound (§3.1, any order). The second
        covers underflow: a product below the normal range may be off by ``eta`` absolutely
        (sums never are: a subnormal sum is exact), and that error is then carried through
        at most ``n`` roundings. No overflow is assumed.
    """
    k = a.shape[-1]
    n = split_k_terms(k, splits)
    s = _abs_products(a, b)
    if addend is not None:
        _check_exact_in_f64(addend)
        n += 1
        s = s + addend.to(torch.float64).abs()
    return _dot_bound_from(s, k, n, accum_dtype, accum_rounding)


def _half_ulp(m: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half the spacing of `dtype` in the binade of each ``m >= 0`` (float64 in, out)."""
    p, e_min, _ = _format(dtype)
    # frexp: m = f * 2^E with f in [0.5, 1), so the binade of m is 2^(E-1) <= m < 2^E.
    _, e = torch.frexp(m)
    binade = torch.clamp(e.to(torch.int64) - 1, min=e_min)  # subnormals: spacing of e_min
    h = torch.ldexp(torch.ones_like(m), binade - p)  # half of 2^(binade - p + 1)
    return torch.where(m > 0, h, torch.zeros_like(m))


def rounding_bound(
    exact: torch.Tensor,
    dtype: torch.dtype,
    *,
    propagated: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Error bound of the final round-to-nearest of a value to `dtype`.

    Args:
        exact: float64 (or any float) tensor: the exact (or reference) value ``x``.
        dtype: target format (bf16, fp16, fp32, fp64, e4m3, e5m2).
        propagated: optional bound ``beta >= 0`` (broadcastable) on how far the value that
            actually gets rounded, ``y``, is from ``x`` (``|y - x| <= beta``).

    Returns:
        float64 tensor, broadcast shape: ``ulp(m) / 2`` with ``m = |x| + beta`` and
        ``ulp(m) = 2^(max(floor(log2 m), e_min) - p + 1)``, the spacing of `dtype` in the
        binade containing ``m`` (subnormal spacing ``2^(e_min - p + 1)`` below the normal
        range: FP32 ``2^-149``, BF16 ``2^-133``); 0 where ``m == 0`` (0 rounds exactly).

        Round to nearest moves ``y`` by at most half the spacing around ``y``; the spacing
        is non-decreasing in ``|y|`` and ``|y| <= |x| + beta = m``, so ``|fl(y) - y| <=
        ulp(m) / 2``. Using the binade of ``m`` rather than of ``|x|`` keeps the bound sound
        when ``y`` crosses into the next binade (``x`` just below a power of two). In the
        normal range ``ulp(m)/2 <= u * m``, so this is never looser than the relative form
        ``u |y|`` and adds the subnormal spacing where that form fails.

    Raises:
        ValueError: ``m`` reaches the overflow threshold ``max + ulp(max)/2`` of `dtype`
            (the result may round to infinity; no finite bound holds).
    """
    m = exact.to(torch.float64).abs()
    if propagated is not None:
        m = m + torch.as_tensor(propagated, dtype=torch.float64, device=m.device)
    _, _, fmax = _format(dtype)
    limit = fmax + float(_half_ulp(torch.tensor(fmax, dtype=torch.float64), dtype))
    if bool((m >= limit).any()) or bool(torch.isnan(m).any()):
        raise ValueError(
            f"rounding_bound: |value| + bound reaches the {dtype} overflow threshold {limit}"
        )
    # `m` carries at most one float64 rounding (the sum), which may leave it just below a
    # power of two the true |x| + beta reaches; _inflate makes it >= the true value, so the
    # binade (and the half-ULP, a power of two computed exactly) is never too low.
    return _half_ulp(_inflate(m, 1), dtype)


def final_rounding_bound(
    exact: torch.Tensor, propagated: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Total bound of a value computed with error `propagated`, then rounded to `dtype`.

    ``|fl_dtype(y) - x| <= |fl_dtype(y) - y| + |y - x| <= rounding_bound(x, dtype,
    propagated=beta) + beta``, with ``beta = propagated``. Shapes broadcast; float64 out.
    """
    prop = torch.as_tensor(propagated, dtype=torch.float64, device=exact.device)
    return _inflate(prop + rounding_bound(exact, dtype, propagated=prop), 1)


def sum_bound(terms_abs_sum: torch.Tensor | float, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Error bound of an ``n``-term sum evaluated in `dtype` in any order.

    For ``s = sum_{i<=n} x_i`` with exactly representable ``x_i``, any summation order
    (sequential, reversed, pairwise/tree, atomics) gives (Higham §4.2 and the
    remark after it: each term passes through at most ``n - 1`` additions)

        ``|s_computed - s| <= gamma_{n-1}(u) * sum_i |x_i|``.

    Sums never underflow inexactly (a subnormal sum is exact), so no absolute term is needed.

    Args:
        terms_abs_sum: ``sum_i |x_i|`` (float64 tensor or number; must be an upper bound
            of the true value — e.g. computed in float64 from few terms, then passed through
            this function which inflates the result by ``1 + gamma_{n+4}(u64)`` to cover
            the ``n - 1`` float64 additions of that abs sum and its own product).
        n: number of terms (``>= 1``).
        dtype: the format the sum is evaluated in (FP32 for the TP partial sums).

    Returns:
        float64 tensor of the shape of `terms_abs_sum`.
    """
    if n < 1:
        raise ValueError(f"sum_bound: n must be >= 1, got {n}")
    s = torch.as_tensor(terms_abs_sum, dtype=torch.float64)
    # float64 roundings: up to n - 1 in the caller's abs sum, one product here.
    return _inflate(s * gamma(n - 1, unit_roundoff(dtype)), n)


def reference_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The float64 reference ``A @ B^T`` ([..., M, K] x [N, K] -> [..., M, N], float64).

    Its products are exact (operands of at most 24 significand bits); only its K - 1
    float64 additions round, so ``|ref - exact| <= gamma_K(2^-53) * |A| @ |B|^T``. The
    ``matmul_*_out_bound`` helpers below include that term, so they bound the distance to
    this reference, not only to the exact product.
    """
    _check_exact_in_f64(a)
    _check_exact_in_f64(b)
    return a.to(torch.float64) @ b.to(torch.float64).transpose(-1, -2)


def matmul_out_bound(a, b, n, addend, accum_rounding):
    """(bound of |C_fp32 - ref|, ref) shared by the matmul helpers: an FP32 accumulation
    whose every product passes through ``n`` roundings (``split_k_terms`` /
    ``mma_split_k_terms``; one more with an addend) plus the float64 reference's error."""
    k = a.shape[-1]
    ref = reference_matmul(a, b)
    s = _abs_products(a, b)
    n64 = k
    if addend is not None:
        _check_exact_in_f64(addend)
        s = s + addend.to(torch.float64).abs()
        ref = ref + addend.to(torch.float64)
        n += 1
        n64 += 1
    acc = _dot_bound_from(s, k, n, torch.float32, accum_rounding)
    ref_err = _inflate(s * gamma(n64, _U64), k + 3)
    return _inflate(acc + ref_err, 1), ref


#: The bound name of a GEMM whose FP32 accumulation order is unknown (cuBLAS, PyTorch).
ANY_ORDER_GEMM_BOUND = ("gamma_K(u)|A||B| + final half-ULP (any FP32 summation order; u = 2^-23 "
                        "on a GPU: truncating tensor-core adders, 2^-24 on a CPU)")


def gemm_accum_rounding(device) -> str:
    """How a GEMM on ``device`` rounds its FP32 accumulation: ``"toward_zero"`` on a CUDA
    device (cuBLAS's BF16 GEMMs run on tensor cores, whose FP32 adders truncate: the model
    of :func:`mma_matmul_bound`), ``"nearest"`` on a CPU (IEEE adds)."""
    return "toward_zero" if torch.device(device).type == "cuda" else "nearest"


def matmul_fp32_out_bound(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    splits: int = 1,
    addend: torch.Tensor | None = None,
    accum_rounding: str = "nearest",
) -> torch.Tensor:
    """Bound for an FP32-accumulated, FP32-out GEMM against `reference_matmul`.

    ``|C_fp32 - ref| <= dot_bound(a, b, splits, addend) + gamma_{K(+1)}(2^-53) * S``, where
    the second term is the float64 reference's own error (``S = |A| @ |B|^T (+ |C0|)``).
    The FP32 result *is* the accumulator, so there is no extra output rounding.
    Shapes: ``a [..., M, K]``, ``b [N, K]`` -> float64 ``[..., M, N]``. With an `addend`,
    compare against ``reference_matmul(a, b) + addend.double()``. `splits` and
    `accum_rounding` as in [`dot_bound`][verify.bounds.dot_bound].
    """
    return matmul_out_bound(a, b, split_k_terms(a.shape[-1], splits), addend,
                             accum_rounding)[0]


def matmul_bf16_out_bound(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    splits: int = 1,
    addend: torch.Tensor | None = None,
    accum_rounding: str = "nearest",
) -> torch.Tensor:
    """Bound for an FP32-accumulated GEMM rounded once to BF16, against `reference_matmul`.

    With ``beta = matmul_fp32_out_bound(a, b, splits, addend)`` (accumulation error plus the
    float64 reference's error) and ``ref`` the float64 reference (``+ addend``):

        ``|C_bf16 - ref| <= beta + rounding_bound(ref, bf16, propagated=beta)``

    i.e. the propagated bound plus half a BF16 ULP in the binade of ``|ref| + beta``
    (sound across binade edges and in the subnormal range, see `rounding_bound`); the
    output rounding is to nearest (``__float2bfloat16_rn`` in every epilogue).
    Shapes: ``a [..., M, K]``, ``b [N, K]`` -> float64 ``[..., M, N]``.
    """
    beta, ref = matmul_out_bound(a, b, split_k_terms(a.shape[-1], splits), addend,
                                  accum_rounding)
    return final_rounding_bound(ref, beta, torch.bfloat16)


def mma_split_k_terms(k: int, splits: int = 1) -> int:
    """Effective ``n`` of ``gamma_n(2^-23)`` for a K-long dot product computed by tensor-core
    ``mma.m16n8k16`` steps in ``splits`` contiguous parts whose FP32 partials are then
    added (the split-K GEMM of ``fast.gemm``).

    The tensor-core model (the one ``verify/test_experts.py`` uses for the experts engine):
    an MMA step adds its 16 exact products and the FP32 accumulator with aligned, truncating
    adders (Fasi, Higham, Mikaitis, Pranesh, *Numerical behavior of NVIDIA tensor cores*,
    PeerJ CS 2021); each of the ``16 + 1`` terms loses less than one ULP, ``u = 2^-23``
    relative. A part of ``c = ceil(K / splits)`` products is ``ceil(c / 16)`` steps, so each
    product passes through at most ``c + ceil(c / 16)`` such losses; the ``splits - 1``
    FP32 additions of the partials (round to nearest, bounded here by the same ``u``) add one
    each (as in [`split_k_terms`][verify.bounds.split_k_terms]):

        ``n = c + ceil(c / 16) + splits - 1``.

    Args:
        k: reduction length ``K >= 1``.
        splits: number of K parts, ``1 <= splits <= K``.
    """
    c = split_k_terms(k, splits) - (splits - 1)  # ceil(K / splits), validated there
    return c + -(-c // 16) + splits - 1


def mma_matmul_bound(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    splits: int = 1,
    addend: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(reference, bound) of a split-K tensor-core GEMM ``A @ B^T (+ C0)``, FP32 or BF16 out.

    ``ref`` is `reference_matmul` (``+ addend`` in float64). The bound is the accumulation
    bound of ``dot_bound`` with ``n = mma_split_k_terms(K, splits)`` (plus 1 with an addend,
    added in FP32 after the partials) under truncating adders (``accum_rounding =
    "toward_zero"``: ``u = 2^-23``, the whole subnormal spacing per product), plus the float64
    reference's own error ``gamma_{K(+1)}(2^-53) S``; for a BF16 output, carried through the
    final round to nearest (``final_rounding_bound``).

    Shapes: ``a [..., M, K]``, ``b [N, K]``, addend ``[..., M, N]`` -> float64 ``[..., M, N]``
    each.
    """
    beta, ref = matmul_out_bound(a, b, mma_split_k_terms(a.shape[-1], splits), addend,
                                  "toward_zero")
    if out_dtype == torch.float32:
        return ref, beta
    if out_dtype != torch.bfloat16:
        raise ValueError(f"mma_matmul_bound: out_dtype must be float32 or bfloat16, got {out_dtype}")
    return ref, final_rounding_bound(ref, beta, torch.bfloat16)
