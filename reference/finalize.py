"""Finalize: the routing-weighted sum of each token's top-k expert rows.

`out[t] = sum_k w[t, k] * rows[t*K + k]`, computed per column as an FP32 fused
multiply-add chain in k order from 0:

    acc = +0.0
    for k in 0 .. K-1:  acc = fma(w[t, k], float(rows[t*K + k]), acc)   # one RNE each
    out[t] = bf16(acc)                                                   # one RNE

Each `fma` is emulated exactly by `reference.fp.fma_f32` (one rounding of the exact
`w * row + acc`; a float64 multiply-add followed by `.float()` would round twice). The
order of k matters: FP32 addition is not associative, and a kernel must keep it.
"""

from __future__ import annotations

import torch

from reference.fp import fma_f32

__all__ = ["finalize"]


def finalize(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted top-k sum with an FP32 FMA chain in k order, one BF16 rounding.

    Args:
        rows: [T*K, L] bfloat16; row `t*K + k` is expert `ids[t, k]`'s output on token t.
        weights: [T, K] float32 routing weights.

    Returns:
        [T, L] bfloat16.
    """
    if not isinstance(weights, torch.Tensor) or weights.dim() != 2 or weights.dtype != torch.float32:
        raise ValueError(f"finalize: weights must be a float32 [T, K] tensor, got "
                         f"{getattr(weights, 'dtype', type(weights))} {tuple(getattr(weights, 'shape', ()))}")
    t, k = weights.shape
    if (not isinstance(rows, torch.Tensor) or rows.dim() != 2 or rows.dtype != torch.bfloat16
            or rows.shape[0] != t * k):
        raise ValueError(f"finalize: rows must be a bfloat16 [T*K, L] = [{t * k}, L] tensor, got "
                         f"{getattr(rows, 'dtype', type(rows))} {tuple(getattr(rows, 'shape', ()))}")
    if rows.device != weights.device:
        raise ValueError(f"finalize: rows on {rows.device}, weights on {weights.device}")
    r = rows.view(t, k, rows.shape[1]).float()
    acc = torch.zeros(t, rows.shape[1], dtype=torch.float32, device=rows.device)
    for j in range(k):
        acc = fma_f32(weights[:, j:j + 1], r[:, j], acc)
    return acc.to(torch.bfloat16)
