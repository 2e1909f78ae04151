"""SiTU-and-mul: the gated activation of the shared and the routed experts.

For `h [..., 2N]`, `gate = h[..., :N]`, `up = h[..., N:]` (the `[gate; up]` order of the
weight rows that produced `h`):

    out = beta * tanh(gate / beta) * sigmoid(gate) * (linear_beta * tanh(up / linear_beta))

`situ_and_mul_fp32` evaluates it in FP32 with exactly these torch ops, in this order, each
one FP32 result (the basic ops `/` and `*` are IEEE RNE; `tanh` and `sigmoid` are torch's
FP32 functions, which are not guaranteed correctly rounded and may differ between CPU and
CUDA builds by an ulp or so — `tests/test_activation.py` measures them):

1. `g = gate.float()`, `u = up.float()` (exact from BF16 or FP32)
2. `a1 = g / beta`          3. `a2 = torch.tanh(a1)`      4. `a3 = beta * a2`
5. `a4 = torch.sigmoid(g)`   6. `a5 = a3 * a4`
7. `b1 = u / linear_beta`    8. `b2 = torch.tanh(b1)`      9. `b3 = linear_beta * b2`
10. `out = a5 * b3`

`beta` and `linear_beta` enter as FP32 scalars (4.0 and 25.0 are exact).
`situ_and_mul` rounds `out` once to BF16 (RNE): the shared expert's activation.
Inside the routed experts the FP32 `out` is re-quantized to MXFP8 instead.
`situ_and_mul_float64` is the unrounded formula in float64 (the ideal layer).
"""

from __future__ import annotations

import torch

__all__ = ["situ_and_mul_fp32", "situ_and_mul", "situ_and_mul_float64"]


def _split(h: torch.Tensor, fn: str, dtypes: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(h, torch.Tensor) or h.dtype not in dtypes:
        raise ValueError(f"{fn}: h must be a tensor of dtype in {dtypes}, got "
                         f"{getattr(h, 'dtype', type(h))}")
    if h.dim() < 1 or h.shape[-1] % 2:
        raise ValueError(f"{fn}: h must be [..., 2N] with an even last dim, got {tuple(h.shape)}")
    n = h.shape[-1] // 2
    return h[..., :n], h[..., n:]


def _check_betas(fn: str, beta: float, linear_beta: float) -> None:
    for name, v in (("beta", beta), ("linear_beta", linear_beta)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"{fn}: {name} must be a positive float, got {v!r}")


def situ_and_mul_fp32(h: torch.Tensor, *, beta: float, linear_beta: float) -> torch.Tensor:
    """SiTU-and-mul in FP32, op by op as in the module docstring.

    Args:
        h: [..., 2N] bfloat16 or float32 (gate half first, then up half).
        beta: gate saturation (config.situ_beta, 4.0).
        linear_beta: up saturation (config.situ_linear_beta, 25.0).

    Returns:
        [..., N] float32.
    """
    _check_betas("situ_and_mul_fp32", beta, linear_beta)
    gate, up = _split(h, "situ_and_mul_fp32", (torch.bfloat16, torch.float32))
    g = gate.float()
    u = up.float()
    fb = torch.tensor(beta, dtype=torch.float32, device=h.device)
    fl = torch.tensor(linear_beta, dtype=torch.float32, device=h.device)
    a = (fb * torch.tanh(g / fb)) * torch.sigmoid(g)
    b = fl * torch.tanh(u / fl)
    return a * b


def situ_and_mul(h: torch.Tensor, *, beta: float, linear_beta: float) -> torch.Tensor:
    """`situ_and_mul_fp32` rounded once to BF16 (RNE).

    Args:
        h: [..., 2N] bfloat16 or float32.

    Returns:
        [..., N] bfloat16.
    """
    return situ_and_mul_fp32(h, beta=beta, linear_beta=linear_beta).to(torch.bfloat16)


def situ_and_mul_float64(h: torch.Tensor, *, beta: float, linear_beta: float) -> torch.Tensor:
    """The SiTU-and-mul formula in float64 with no FP32 rounding (for the ideal layer).

    Args:
        h: [..., 2N] float64.

    Returns:
        [..., N] float64.
    """
    _check_betas("situ_and_mul_float64", beta, linear_beta)
    g, u = _split(h, "situ_and_mul_float64", (torch.float64,))
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))
