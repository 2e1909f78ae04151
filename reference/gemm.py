"""The model of an FP32-accumulated GEMM used by every reference stage.

`matmul(a, b)` returns each `sum_k a[m, k] * b[n, k]` accumulated in float64 and rounded
ONCE to the output dtype:

1. products in float64 — exact for BF16 and FP32 operands (at most 24 + 24 significand
   bits, no float64 overflow/underflow from FP32 exponents);
2. the float64 sum (a float64 GEMM), whose error is at most `gamma_K(2^-53) *
   sum_k |a_k b_k|` — about 2^-29 of an FP32 ulp of a non-cancelling sum for K = 7168;
3. one rounding of the float64 value: RNE to FP32, or round-to-odd at 24 bits then RNE to
   BF16 for a BF16 output (one rounding in effect, see `reference.fp`).

Determinism and batch invariance: the float64 GEMM runs on fixed blocks of
`ROW_BLOCK` rows (the last block zero-padded), so every row goes through the same library
call shape whatever the batch, its position in it or its batch-mates: a row's bits depend
on that row alone. (A float64 BLAS may choose its summation order by the shape of the
call; fixing the shape fixes the order.) The same code on another device (cuBLAS) may
differ from the CPU only where the exact sum lies within the float64 error of an output
rounding boundary.

A real kernel accumulates in FP32 in its own order: it differs from this model by the
accumulation error only, which the verification contracts bound (`gamma_K * sum |a_k b_k|`
plus the final rounding). `split_k_matmul` models the split-K tactic's extra FP32
rounding of each partial.
"""

from __future__ import annotations

import torch

from reference.fp import pair_to_bfloat16, pair_to_float32, two_sum

__all__ = ["matmul", "split_k_matmul", "addmm", "exact_dot_pair", "exact_sum_pair"]

_INPUT_DTYPES = (torch.bfloat16, torch.float32)
_OUT_DTYPES = (torch.float32, torch.bfloat16)
#: Rows of every float64 GEMM call (the batch is cut into blocks of this many rows, the
#: last zero-padded), so a row's summation order never depends on the batch.
ROW_BLOCK = 8


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
    lo = torch.where(torch.isfinite(hi), lo, torch.zeros_like(lo))
    hi, lo2 = two_sum(hi, lo)  # renormalize: hi = fl(hi + lo)
    lo = torch.where(torch.isfinite(hi), lo2, torch.zeros_like(lo2))
    return hi, lo


def exact_sum_pair(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum over the last dim of float64 `p [..., K]` as a pair `hi + lo`.

    A pairwise TwoSum tree: each level adds neighbours in float64 and keeps each
    addition's exact error; `hi + lo` is the exact sum up to the float64 rounding of the
    error sum, at most about `K * 2^-106 * sum|p|` (used for RMSNorm's sum of squares,
    where K*T terms are cheap). Round the pair once with
    `reference.fp.pair_to_float32` / `pair_to_bfloat16`.

    Returns:
        `(hi, lo)`, float64 [...] each, `hi = fl(hi + lo)`.
    """
    if not isinstance(p, torch.Tensor) or p.dtype != torch.float64 or p.dim() < 1:
        raise ValueError(f"exact_sum_pair: p must be a float64 tensor [..., K], got "
                         f"{getattr(p, 'dtype', type(p))} {tuple(getattr(p, 'shape', ()))}")
    if p.shape[-1] == 0:
        p = torch.zeros(*p.shape[:-1], 1, dtype=torch.float64, device=p.device)
    return _tree_sum(p)


def exact_dot_pair(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`a @ b.T (+ c)` as a float64 pair `hi + lo`: `hi` the float64 GEMM (in blocks of
    `ROW_BLOCK` rows), `c` added exactly as a TwoSum pair (see the module docstring).

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
    if n == 0 or m == 0:
        empty = torch.zeros(m, n, dtype=torch.float64, device=a.device)
        return empty, empty.clone()
    rows = -(-m // ROW_BLOCK) * ROW_BLOCK
    padded = torch.zeros(rows, k, dtype=torch.float64, device=a.device)
    padded[:m] = a64
    bt = b64.t()
    hi = torch.cat([padded[r:r + ROW_BLOCK] @ bt for r in range(0, rows, ROW_BLOCK)])[:m]
    if c is None:
        return hi, torch.zeros_like(hi)
    return two_sum(hi, c.to(torch.float64))


def _round_pair(hi: torch.Tensor, lo: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    if out_dtype == torch.float32:
        return pair_to_float32(hi, lo)
    return pair_to_bfloat16(hi, lo)


def _check_out(out_dtype, fn: str) -> None:
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"{fn}: out_dtype must be torch.float32 or torch.bfloat16, got {out_dtype}")


def matmul(a: torch.Tensor, b: torch.Tensor, *, out_dtype: torch.dtype) -> torch.Tensor:
    """`a @ b.T`: exact products, float64 accumulation, ONE rounding to `out_dtype`.

    Args:
        a: [M, K] bfloat16 or float32 (activations).
        b: [N, K] bfloat16 or float32 (weight rows, as stored: `nn.Linear` layout).
        out_dtype: torch.float32 or torch.bfloat16.

    Returns:
        [M, N] in `out_dtype`: one RNE rounding of the float64 sum (see the module
        docstring for its error). Row m depends on row m of `a` only (batch invariant).
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

    `c` is added exactly (a TwoSum pair) to the float64 product sum; the total is rounded
    once to BF16 (round-to-odd at 53 and 24 bits, RNE to 8).

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
