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
| ``EXP_RN_ULP`` | 2 | the fast kernels' own ``exp_rn`` (``fast.device.fp32``; ``reference.emulation`` repeats it bit for bit): measured max 1.17 ulp over every 127th FP32 bit pattern of its argument range [-104, 89] against float64 (``tests/test_emulation.py`` repeats the measurement and requires it below this bound) |
| ``TANH_RN_ULP`` | 2 | the kernels' ``tanh_rn``: measured max 1.32 ulp over every 127th FP32 bit pattern of [-1e30, 1e30] (same test) |
| ``LAYER_SQNR_FLOOR_DB`` | 24.08 | ``20 log10(2^4)``: the MX formats' relative noise (below) |

A "ULP" of a value ``v`` in FP32 is at most ``2 u |v|``, so an ``n``-ulp function has a
relative error of at most ``2 n u``. The two measured constants are bounds, not the
measurements: each is the next integer above its measured maximum, and the test that
measures fails if a change of the functions ever reaches it.
"""

from __future__ import annotations

import math

import torch

from verify import bounds

U32 = bounds.unit_roundoff(torch.float32)
CUDA_EXPF_ULP = 2
CUDA_TANHF_ULP = 2
CUDA_RSQRTF_ULP = 2
CPU_TRANSCENDENTAL_ULP = 1
EXP_RN_ULP = 2
TANH_RN_ULP = 2

#: The worst documented ULP error of the library exp/tanh/rsqrt a stock op may call.
LIBRARY_ULP = max(CUDA_EXPF_ULP, CUDA_TANHF_ULP, CUDA_RSQRTF_ULP, CPU_TRANSCENDENTAL_ULP)

#: The worst ULP error of any exp/tanh a backend of this project calls: the libraries' and
#: the kernels' own (``exp_rn``, ``tanh_rn``).
FUNCTION_ULP = max(LIBRARY_ULP, EXP_RN_ULP, TANH_RN_ULP)


def ulp_relative(n_ulp: float) -> float:
    """Relative error of an ``n_ulp`` FP32 function: ``2 n u``."""
    return 2 * n_ulp * U32


#: Absolute error of a library sigmoid ``1 / (1 + exp(-x))`` in FP32: the exp's relative
#: error moves ``1 + e`` by at most that relative amount, the add and the division round
#: once each (``2u`` relative), on a value below 1.
SIGMOID_ABS_ERROR = ulp_relative(LIBRARY_ULP) + 2 * U32

#: Absolute error of the kernels' ``sigmoid_rn(x) = 1 / (1 + exp_rn(-x))`` in FP32: with
#: ``s`` the exact sigmoid, ``E = exp(-x)`` and ``exp_rn`` within ``2 n u`` relative
#: (``n = EXP_RN_ULP``), ``1 + E`` is off by ``E 2 n u = (1 - s)(1 + E) 2 n u``, so the
#: quotient moves by ``s (1 - s) 2 n u <= n u / 2``; the add and the division round once
#: each (``2 u s <= 2 u``). Subnormal or overflowing ``E`` only give errors below
#: ``2^-126``. Second-order terms are covered by the factor ``1 + 4u``.
SIGMOID_RN_ABS_ERROR = (EXP_RN_ULP / 2 + 2) * U32 * (1 + 4 * U32)

#: Relative error of any backend's FP32 sigmoid ``1 / (1 + exp(-x))``: with ``s`` the exact
#: value and ``exp`` within ``2 n u`` relative (``n = FUNCTION_ULP``), the quotient moves by
#: ``(1 - s) 2 n u <= 2 n u`` relative; the add and the division round once each.
SIGMOID_RELATIVE_ERROR = ulp_relative(FUNCTION_ULP) + 2 * U32

#: Relative error of SiTU-and-mul ``(b*tanh(g/b))*sigmoid(g) * (l*tanh(u/l))`` in FP32 by
#: any backend's functions: two divisions, three multiplications by the betas and products,
#: the final product (6 roundings), two tanh (condition number of tanh(z) w.r.t. z is at
#: most 1, so the argument's rounding passes through once more each), one sigmoid.
SITU_RELATIVE_ERROR = (6 + 2) * U32 + 2 * ulp_relative(FUNCTION_ULP) + SIGMOID_RELATIVE_ERROR


def rms_norm_relative_error(width: int) -> float:
    """Relative error of ``x * rsqrt(mean(x^2) + eps) * w`` in FP32 (any reduction order):
    the sum of ``width`` positive squares (``gamma_width``; the squares round once each,
    one more ``u``), the division by ``width`` and the ``+ eps`` (``u`` each) pass through
    the square root halved; the rsqrt itself (library: ``LIBRARY_ULP``, or ``1/sqrt`` with
    two roundings), then two multiplications."""
    inner = bounds.gamma(width + 1, U32) + 2 * U32
    return inner / 2 + ulp_relative(LIBRARY_ULP) + 2 * U32 + 2 * U32


#: SQNR floor of the quantized layer against the unquantized float64 layer on the same
#: routing (``verify/test_quality.py`` for the whole output, ``verify.layers`` per token of
#: a backend's whole layer): MXFP4 weights and MXFP8 activations each carry a relative
#: noise of about 2^-4 (E2M1 and E4M3 half-ULP at the top of their binades: 1/4 and 1/16
#: of the value), and the routed latent passes two MXFP8 quantizations and one MXFP4
#: weight per GEMM; the shared expert and the dense GEMMs are BF16 (2^-9). So
#: ``20 log10(2^4)`` dB, which a wrong rounding mode, a swapped gate/up or a dropped scale
#: falls below (they give < 10 dB).
LAYER_SQNR_FLOOR_DB = 20 * math.log10(2**4)
