"""RMSNorm of the routed latent (before the up projection).

Rounding points, per row of `x [T, L]`:

1. `ss = sum_j x[j]^2` rounded once to FP32. Model: the squares are exact in float64
   (BF16 has 8 significand bits) and the sum is the exact one (`reference.gemm`'s TwoSum
   tree), so the value does not depend on an order. A kernel reduces in FP32 in its own
   tree; a contract either emulates that tree or bounds the difference
   (`gamma_L * ss`, all terms being non-negative).
2. `mean = ss / L` in FP32 (one RNE division; L is exact in FP32).
3. `r = torch.rsqrt(mean + eps)` in FP32: one RNE add of the FP32 value of `eps`, then
   torch's FP32 rsqrt (not guaranteed correctly rounded; device functions may differ).
4. `y = (float(x) * r) * float(w)` in FP32 (two RNE multiplies, in this order).
5. one RNE rounding of `y` to BF16.

(vLLM's CUDA `rms_norm` instead rounds `x * r` to BF16 before multiplying by `w`; this
project's layer rounds once, at the end: `docs/design.md`.) `rms_norm_fp32` returns the
value of step 4, before that rounding.
"""

from __future__ import annotations

import torch

from reference.fp import pair_to_float32
from reference.gemm import exact_sum_pair

__all__ = ["rms_norm", "rms_norm_fp32", "sum_of_squares"]


def sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    """Exact `sum_j x[t, j]^2`, rounded once to FP32.

    Args:
        x: [T, L] bfloat16 or float32.

    Returns:
        [T] float32.
    """
    x64 = x.to(torch.float64)
    hi, lo = exact_sum_pair(x64 * x64)
    return pair_to_float32(hi, lo)


def rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x * rsqrt(mean(x^2) + eps) * weight` in FP32, steps 1-4 (before the BF16 rounding).

    Args:
        x: [T, L] bfloat16.
        weight: [L] bfloat16.
        eps: positive float (config.rms_eps), used as its FP32 value.

    Returns:
        [T, L] float32.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.bfloat16:
        raise ValueError(f"rms_norm: x must be a bfloat16 [T, L] tensor, got "
                         f"{getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}")
    n = x.shape[1]
    if (not isinstance(weight, torch.Tensor) or weight.dtype != torch.bfloat16
            or tuple(weight.shape) != (n,)):
        raise ValueError(f"rms_norm: weight must be a bfloat16 [{n}] tensor, got "
                         f"{getattr(weight, 'dtype', type(weight))} {tuple(getattr(weight, 'shape', ()))}")
    if weight.device != x.device:
        raise ValueError(f"rms_norm: weight on {weight.device}, x on {x.device}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"rms_norm: eps must be a positive float, got {eps!r}")
    ss = sum_of_squares(x)
    mean = ss / torch.tensor(float(n), dtype=torch.float32, device=x.device)
    r = torch.rsqrt(mean + torch.tensor(eps, dtype=torch.float32, device=x.device))
    return (x.float() * r[:, None]) * weight.float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x * rsqrt(mean(x^2) + eps) * weight`, FP32 math, one BF16 rounding.

    Args:
        x: [T, L] bfloat16.
        weight: [L] bfloat16.
        eps: positive float (config.rms_eps), used as its FP32 value.

    Returns:
        [T, L] bfloat16: `rms_norm_fp32` rounded once (RNE); rounding points in the module
        docstring.
    """
    return rms_norm_fp32(x, weight, eps).to(torch.bfloat16)
