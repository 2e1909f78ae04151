"""The model of an FP32-accumulated GEMM used by every reference stage.

`matmul(a, b)` returns each `sum_k a[m, k] * b[n, k]` computed (almost always) exactly and
rounded ONCE to the output dtype:

1. products in float64 — exact for BF16 and FP32 operands (at most 24 + 24 significand
   bits, no float64 overflow/underflow from FP32 exponents);
2. a pairwise TwoSum tree over k: each level adds neighbours in float64 and keeps each
   addition's exact error, so `hi + lo` (the tree's root plus the float64 sum of all
   errors) equals the exact sum up to the rounding of that error sum, at most about
   `K * 2^-106 * sum_k |a_k b_k|` — far below an FP32 ulp of any non-cancelling sum;
3. one rounding of the pair: round-to-odd at 53 bits, then RNE to FP32 (and round-to-odd
   at 24 bits then RNE to BF16 for a BF16 output), see `reference.fp`.

The result therefore does not depend on the summation order, on the device, or on the
other rows of the batch (deterministic and batch invariant). A real kernel accumulates in
FP32 in its own order: it differs from this model by the accumulation error only, which
the verification contracts bound (`gamma_K * sum |a_k b_k|` plus the final rounding).
`split_k_matmul` models the split-K tactic's extra FP32 rounding of each partial.
"""

from __future__ import annotations

import torch

from reference.fp import pair_to_bfloat16, pair_to_float32, two_sum

__all__ = ["matmul", "split_k_matmul", "addmm", "exact_dot_pair"]

_INPUT_DTYPES = (torch.bfloat16, torch.float32)
_OUT_DTYPES = (torch.float32, torch.bfloat16)
# float64 elements of the [M, n_chunk, K] product tensor materialized at once.
_CHUNK_ELEMENTS = 1 << 22


def _check_operands(a: torch.Tensor, b: torch.Tensor, fn: str) -> None:
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{fn}: {name} must be 2-D ([M, K] / [N, K]), got shape {tuple(t.shape)}")
        if t.dtype not in _INPUT_DTYPES:
            raise ValueError(f"{fn}: {name} must be bfloat16 or float32, got {t.dtype}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(
            f"{fn}: a [M, K] and b [N, K] must share K, got a {tuple(a.shape)} and b {tuple(b.shape)}"
        )
    if a.device != b.device:
        raise ValueError(f"{fn}: a and b must be on one device, got {a.device} and {b.device}")


def _tree_sum(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairwise TwoSum reduction of float64 `p [..., K]` -> `(hi, lo)` with `hi = fl(hi + lo)`."""
    lo = torch.zeros(p.shape[:-1], dtype=torch.float64, device=p.device)
    while p.shape[-1] > 1:
        if p.shape[-1] % 2:
            p = torch.cat([p, torch.zeros_like(p[..., :1])], dim=-1)
        s, e = two_sum(p[..., 0::2], p[..., 1::2])
        lo = lo + torch.where(torch.isfinite(s), e, torch.zeros_like(e)).sum(-1)
        p = s
    hi = p[..., 0]
    finite = torch.isfinite(hi)
    lo = torch.where(finite, lo, torch.zeros_like(lo))
    hi, lo2 = two_sum(hi, lo)  # renormalize: hi = fl(hi + lo)
    lo = torch.where(torch.isfinite(hi), lo2, torch.zeros_like(lo2))
    return hi, lo


def exact_dot_pair(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`a @ b.T (+ c)` as a float64 pair `hi + lo` (see the module docstring).

    Args:
        a: [M, K] bfloat16/float32.
        b: [N, K] bfloat16/float32.
        c: optional [M, N] tensor (any float dtype exactly representable in float64) added
           as one more exact term.

    Returns:
        `(hi, lo)`, float64 [M, N] each, `hi = fl(hi + lo)`.
    """
    _check_operands(a, b, "exact_dot_pair")
    m, k = a.shape
    n = b.shape[0]
    a64 = a.to(torch.float64)
    b64 = b.to(torch.float64)
    if c is not None and tuple(c.shape) != (m, n):
        raise ValueError(f"exact_dot_pair: c must be [M, N] = [{m}, {n}], got {tuple(c.shape)}")
    his, los = [], []
    step = max(1, _CHUNK_ELEMENTS // max(1, m * (k + 1)))
    for n0 in range(0, n, step):
        p = a64[:, None, :] * b64[None, n0:n0 + step, :]
        if c is not None:
            p = torch.cat([p, c[:, n0:n0 + step, None].to(torch.float64)], dim=-1)
        if p.shape[-1] == 0:
            p = torch.zeros(*p.shape[:-1], 1, dtype=torch.float64, device=p.device)
        hi, lo = _tree_sum(p)
        his.append(hi)
        los.append(lo)
    if n == 0:
        empty = torch.zeros(m, 0, dtype=torch.float64, device=a.device)
        return empty, empty.clone()
    return torch.cat(his, dim=1), torch.cat(los, dim=1)


def _round_pair(hi: torch.Tensor, lo: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    if out_dtype == torch.float32:
        return pair_to_float32(hi, lo)
    return pair_to_bfloat16(hi, lo)


def _check_out(out_dtype, fn: str) -> None:
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"{fn}: out_dtype must be torch.float32 or torch.bfloat16, got {out_dtype}")


def matmul(a: torch.Tensor, b: torch.Tensor, *, out_dtype: torch.dtype) -> torch.Tensor:
    """`a @ b.T` with exact products and sum, ONE rounding to `out_dtype`.

    Args:
        a: [M, K] bfloat16 or float32 (activations).
        b: [N, K] bfloat16 or float32 (weight rows, as stored: `nn.Linear` layout).
        out_dtype: torch.float32 or torch.bfloat16.

    Returns:
        [M, N] in `out_dtype`: RNE of the exact sum (see the module docstring for the
        `K * 2^-106` caveat). Row m depends on row m of `a` only (batch invariant).
    """
    _check_out(out_dtype, "matmul")
    _check_operands(a, b, "matmul")
    hi, lo = exact_dot_pair(a, b)
    return _round_pair(hi, lo, out_dtype)


def split_k_matmul(
    a: torch.Tensor, b: torch.Tensor, *, splits: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """The split-K tactic's order: per-split FP32 partials, summed in FP32 in split order.

    K is cut into `splits` contiguous equal chunks `[s*K/splits, (s+1)*K/splits)`. Each
    partial is `matmul(a_chunk, b_chunk, out_dtype=float32)` (one FP32 rounding); then
    `acc = partial[0]; acc = acc + partial[s]` for s = 1.. in FP32 (one RNE each); then one
    rounding of `acc` to `out_dtype` (none for float32).

    Args:
        a: [M, K], b: [N, K], bfloat16/float32.
        splits: positive int dividing K.
        out_dtype: torch.float32 or torch.bfloat16.

    Returns:
        [M, N] in `out_dtype`.
    """
    _check_out(out_dtype, "split_k_matmul")
    _check_operands(a, b, "split_k_matmul")
    k = a.shape[1]
    if isinstance(splits, bool) or not isinstance(splits, int) or splits < 1 or k % splits:
        raise ValueError(f"split_k_matmul: splits must be a positive int dividing K={k}, got {splits!r}")
    width = k // splits
    acc = None
    for s in range(splits):
        cols = slice(s * width, (s + 1) * width)
        part = matmul(a[:, cols], b[:, cols], out_dtype=torch.float32)
        acc = part if acc is None else acc + part
    return acc.to(out_dtype)


def addmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`c + a @ b.T` with one BF16 rounding (cuBLAS addmm, beta = 1, alpha = 1).

    `c` is added exactly (as float64) to the exact product sum; the total is rounded once
    to BF16 (round-to-odd at 53 and 24 bits, RNE to 8).

    Args:
        c: [M, N] bfloat16.
        a: [M, K] bfloat16/float32.
        b: [N, K] bfloat16/float32.

    Returns:
        [M, N] bfloat16.
    """
    _check_operands(a, b, "addmm")
    if not isinstance(c, torch.Tensor) or c.dtype != torch.bfloat16:
        raise ValueError(f"addmm: c must be a bfloat16 tensor, got {getattr(c, 'dtype', type(c))}")
    if tuple(c.shape) != (a.shape[0], b.shape[0]):
        raise ValueError(
            f"addmm: c must be [M, N] = [{a.shape[0]}, {b.shape[0]}], got {tuple(c.shape)}"
        )
    hi, lo = exact_dot_pair(a, b, c)
    return pair_to_bfloat16(hi, lo)
