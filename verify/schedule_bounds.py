"""Derived bounds for the stages a schedule *reorders*: sums of BF16 partials.

Where a schedule splits a sum over owners or TP ranks, each part is rounded to BF16 and
the parts are added in FP32 in rank order, then rounded once more. These helpers bound the
distance of such a result to the exact sum of the parts' exact values, from the parts
themselves (no tuned constants: every term is a unit roundoff, a ``gamma_n`` or a half
ULP, ``verify.bounds``).
"""

from __future__ import annotations

import torch

from verify import bounds

U32 = bounds.unit_roundoff(torch.float32)


def bf16_part_error(part: torch.Tensor, inner: torch.Tensor) -> torch.Tensor:
    """Bound on ``|part - exact_part|`` for a BF16 ``part`` that is the BF16 rounding of
    an FP32 value itself within ``inner`` of the exact part: the BF16 half-ULP at
    ``|part| + ulp`` (the rounding moved the value by at most that) plus ``inner``."""
    p = part.double().abs()
    return bounds.rounding_bound(p, torch.bfloat16, propagated=p * 2.0**-8 + inner) + inner


def ordered_sum_error(parts: list[torch.Tensor], part_errors: list[torch.Tensor],
                      exact: torch.Tensor) -> torch.Tensor:
    """Bound on ``|bf16(fp32 sum of parts in order) - exact|`` where each BF16 part is
    within ``part_errors[i]`` of its exact value and ``exact`` is the sum of those:

    ``sum_i err_i + gamma_{n-1}(u32) * sum_i |part_i|`` (the FP32 additions, Higham
    §4.2), then the final BF16 rounding of a value that far from ``exact``."""
    n = len(parts)
    propagated = sum(e.double() for e in part_errors)
    if n > 1:
        abs_sum = sum(p.double().abs() for p in parts)
        propagated = propagated + bounds.sum_bound(abs_sum, n, torch.float32)
    return bounds.final_rounding_bound(exact.double(), propagated, torch.bfloat16)


def fma_chain_error(weights: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Bound on an FP32 FMA chain ``sum_k w_k r_k`` (any k order, before the BF16
    rounding): ``gamma_k(u32) * sum_k |w_k r_k|``. weights [T,k], rows [T,k,L] -> [T,L]."""
    k = weights.shape[1]
    abs_terms = (weights.double().abs().unsqueeze(-1) * rows.double().abs()).sum(1)
    return abs_terms * bounds.gamma(k, U32)
