"""Every error allowance of the verification suite, in one table, each with its source.

Nothing here is tuned: each number is a documented property of a function or a format,
and the bounds in ``verify.bounds`` / ``verify.routing`` combine them. A contract that
needs an allowance imports it from here, so a reader finds every one in this file.

| name | value | source |
|---|---|---|
| ``U32`` | 2^-24 | unit roundoff of FP32 round-to-nearest |
| ``CUDA_EXPF_ULP`` | 2 | CUDA C++ Programming Guide, Mathematical Functions, single precision: ``expf`` max 2 ulp (full range) |
| ``CUDA_TANHF_ULP`` | 2 | same table: ``tanhf`` max 2 ulp |
| ``CUDA_RSQRTF_ULP`` | 2 | same table: ``rsqrtf`` max 2 ulp |
| ``CPU_TRANSCENDENTAL_ULP`` | 1 | PyTorch's CPU vectorized exp/tanh/sigmoid use SLEEF's ``u10`` variants: max 1.0 ulp |

A "ULP" of a value ``v`` in FP32 is at most ``2 u |v|``, so an ``n``-ulp function has a
relative error of at most ``2 n u``.
"""

from __future__ import annotations

from verify import bounds

import torch

U32 = bounds.unit_roundoff(torch.float32)
CUDA_EXPF_ULP = 2
CUDA_TANHF_ULP = 2
CUDA_RSQRTF_ULP = 2
CPU_TRANSCENDENTAL_ULP = 1

#: The worst documented ULP error of the library exp/tanh/rsqrt a stock op may call.
LIBRARY_ULP = max(CUDA_EXPF_ULP, CUDA_TANHF_ULP, CUDA_RSQRTF_ULP, CPU_TRANSCENDENTAL_ULP)


def ulp_relative(n_ulp: float) -> float:
    """Relative error of an ``n_ulp`` FP32 function: ``2 n u``."""
    return 2 * n_ulp * U32


#: Absolute error of a library sigmoid ``1 / (1 + exp(-x))`` in FP32: the exp's relative
#: error moves ``1 + e`` by at most that relative amount, the add and the division round
#: once each (``2u`` relative), on a value below 1.
SIGMOID_ABS_ERROR = ulp_relative(LIBRARY_ULP) + 2 * U32

#: Relative error of SiTU-and-mul ``(b*tanh(g/b))*sigmoid(g) * (l*tanh(u/l))`` in FP32 by
#: library functions: two divisions, three multiplications by the betas and products, the
#: final product (6 roundings), two tanh (condition number of tanh(z) w.r.t. z is at most
#: 1, so the argument's rounding passes through once more each), one sigmoid.
SITU_RELATIVE_ERROR = (6 + 2) * U32 + 2 * ulp_relative(LIBRARY_ULP) + SIGMOID_ABS_ERROR * 2


def rms_norm_relative_error(width: int) -> float:
    """Relative error of ``x * rsqrt(mean(x^2) + eps) * w`` in FP32 (any reduction order):
    the sum of ``width`` positive squares (``gamma_width``; the squares round once each,
    one more ``u``), the division by ``width`` and the ``+ eps`` (``u`` each) pass through
    the square root halved; the rsqrt itself (library: ``LIBRARY_ULP``, or ``1/sqrt`` with
    two roundings), then two multiplications."""
    inner = bounds.gamma(width + 1, U32) + 2 * U32
    return inner / 2 + ulp_relative(LIBRARY_ULP) + 2 * U32 + 2 * U32
