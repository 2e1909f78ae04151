"""Bit-exact PyTorch emulations of the fast kernels' own math, where it differs from the
plain reference stage: their exp / tanh / sigmoid (built from IEEE FP32 operations, see
``fast/device/fp32.py``), the RMSNorm reduction tree and rsqrt, the router's sigmoid.

Every function here is plain PyTorch FP32 elementwise arithmetic (``*``, ``+``, ``-``,
``/``, ``torch.sqrt``, ``torch.round``, ``torch.maximum`` / ``minimum``, bit casts). On the
CPU each of those rounds once to nearest even and flushes nothing, exactly as the
kernels' explicit ``mul.rn`` / ``add.rn`` / ``div.rn`` / ``sqrt.rn`` PTX instructions, so
the fast kernels must equal these functions **bitwise** (``verify/`` checks it). Run them
on the CPU (a GPU's torch kernels may contract or use other libm code).

This module never imports ``fast``; the constants of exp and tanh are
``model.exp_tanh``'s, which the kernels read too.
"""

from __future__ import annotations

import torch

from model.exp_tanh import (
    EXP_COEFFS,
    EXP_HI,
    EXP_LO,
    LN2_HI,
    LN2_LO,
    LOG2E,
    TANH_COEFFS,
    TANH_SMALL,
)
from reference.router import select_top_k

__all__ = [
    "exp_rn",
    "tanh_rn",
    "sigmoid_rn",
    "situ_and_mul",
    "situ_and_mul_fp32",
    "router_scores",
    "route",
    "rms_norm_tree",
    "NORM_THREADS",
]



def _f32(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2^k as FP32 for integer k in [-126, 127] (exponent bits)."""
    return ((k.to(torch.int32) + 127) << 23).view(torch.float32)


def exp_rn(x: torch.Tensor) -> torch.Tensor:
    """The kernels' e^x (``fast.device.fp32.exp_rn``), bit-exact, FP32 in and out."""
    if x.dtype != torch.float32:
        raise TypeError(f"exp_rn: x must be float32, got {x.dtype}")
    x = torch.minimum(torch.maximum(x, _f32(EXP_LO)), _f32(EXP_HI))
    n = torch.round(x * _f32(LOG2E))
    r = (x - n * _f32(LN2_HI)) - n * _f32(LN2_LO)
    p = _f32(EXP_COEFFS[0]).expand_as(r)
    for c in EXP_COEFFS[1:]:
        p = p * r + _f32(c)
    ni = torch.nan_to_num(n, nan=0.0).to(torch.int32)
    n1 = torch.div(ni, 2, rounding_mode="floor")
    n2 = ni - n1
    return (p * _pow2(n1)) * _pow2(n2)


def tanh_rn(y: torch.Tensor) -> torch.Tensor:
    """The kernels' tanh (``fast.device.fp32.tanh_rn``), bit-exact, FP32 in and out."""
    if y.dtype != torch.float32:
        raise TypeError(f"tanh_rn: y must be float32, got {y.dtype}")
    a = y.abs()
    z = y * y
    q = _f32(TANH_COEFFS[0]).expand_as(z)
    for c in TANH_COEFFS[1:]:
        q = q * z + _f32(c)
    small = (q * z) * y + y
    e = exp_rn(a + a)
    big = _f32(1.0) - _f32(2.0) / (e + _f32(1.0))
    return torch.copysign(torch.where(a < _f32(TANH_SMALL), small, big), y)


def sigmoid_rn(x: torch.Tensor) -> torch.Tensor:
    """The kernels' sigmoid: 1 / (1 + exp_rn(-x)), bit-exact, FP32."""
    return _f32(1.0) / (_f32(1.0) + exp_rn(-x))


def situ_and_mul_fp32(h: torch.Tensor, *, beta: float, linear_beta: float) -> torch.Tensor:
    """The kernels' SiTU-and-mul in FP32, unrounded (``fast.experts``' FC1 epilogue feeds
    it to the MXFP8 re-quantization): h BF16 or FP32 [T, 2N] (gate | up) -> FP32 [T, N] =
    ((beta * tanh_rn(g / beta)) * sigmoid_rn(g)) * (linear_beta * tanh_rn(u / linear_beta)),
    each operation one FP32 rounding, on the CPU."""
    if h.dtype not in (torch.bfloat16, torch.float32) or h.dim() != 2 or h.shape[1] % 2:
        raise ValueError(f"situ_and_mul_fp32: h must be BF16/FP32 [T, 2N], got {h.dtype} "
                         f"{tuple(h.shape)}")
    n = h.shape[1] // 2
    g = h[:, :n].float().cpu()
    u = h[:, n:].float().cpu()
    b, lb = _f32(beta), _f32(linear_beta)
    left = (b * tanh_rn(g / b)) * sigmoid_rn(g)
    right = lb * tanh_rn(u / lb)
    return left * right


def situ_and_mul(h: torch.Tensor, *, beta: float, linear_beta: float) -> torch.Tensor:
    """``fast.activation.situ_and_mul`` bit-exactly: h BF16 [T, 2N] (gate | up) ->
    BF16 [T, N]: ``situ_and_mul_fp32`` rounded once to BF16 (RNE)."""
    if h.dtype != torch.bfloat16 or h.dim() != 2 or h.shape[1] % 2:
        raise ValueError(f"situ_and_mul: h must be BF16 [T, 2N], got {h.dtype} {tuple(h.shape)}")
    return situ_and_mul_fp32(h, beta=beta, linear_beta=linear_beta).to(torch.bfloat16)


def router_scores(logits: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, s + bias) with the kernels' sigmoid, FP32."""
    s = sigmoid_rn(logits.float().cpu())
    return s, s + bias.float().cpu()


def route(
    logits: torch.Tensor,
    bias: torch.Tensor,
    *,
    top_k: int = 16,
    renormalize: bool = True,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fast.router.route`` bit-exactly: top-k of sigmoid_rn(logits) + bias, descending,
    ties to the lower expert id; weights = s[ids], divided by their FP32 sum accumulated
    in k order from 0, then times ``scale`` (FP32)."""
    s, sel = router_scores(logits, bias)
    return select_top_k(s, sel, top_k=top_k, renormalize=renormalize, scale=scale)


NORM_THREADS = 448  # threads per CTA of fast.norm at L = 3584 (L / 8)


def rms_norm_tree(
    x: torch.Tensor, weight: torch.Tensor, eps: float, threads: int | None = None
) -> torch.Tensor:
    """``fast.norm.rms_norm`` bit-exactly. x BF16 [T, L], weight BF16 [L].

    Sum of squares, FP32: thread i of ``threads = L / 8`` owns columns [8i, 8i + 8) and
    adds ``s = s + x_j * x_j`` over them in order (from s = x_0 * x_0); each warp of 32
    threads reduces with a butterfly, ``s = s + s[lane ^ o]`` for o = 16, 8, 4, 2, 1; the
    warp totals are added in warp order, ``tot = w_0 + w_1 + ... + w_{n-1}`` (left to
    right). mean = tot / L (IEEE division); r = 1 / sqrt(mean + eps) (correctly rounded
    sqrt, then correctly rounded division); y = bf16_rne((x * r) * w)."""
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        raise ValueError(f"rms_norm_tree: x must be BF16 [T, L], got {x.dtype} {tuple(x.shape)}")
    t, length = x.shape
    threads = threads or length // 8
    if length % threads or threads % 32:
        raise ValueError(f"rms_norm_tree: L={length} is not 8 columns x {threads} threads")
    per = length // threads
    xf = x.float().cpu()
    sq = (xf * xf).view(t, threads, per)
    s = sq[:, :, 0].clone()
    for j in range(1, per):
        s = s + sq[:, :, j]
    s = s.view(t, threads // 32, 32)
    lane = torch.arange(32)
    for o in (16, 8, 4, 2, 1):
        s = s + s[:, :, lane ^ o]
    warps = s[:, :, 0]
    tot = warps[:, 0].clone()
    for w in range(1, threads // 32):
        tot = tot + warps[:, w]
    mean = tot / _f32(float(length))
    r = _f32(1.0) / torch.sqrt(mean + _f32(eps))
    return ((xf * r[:, None]) * weight.float().cpu()).to(torch.bfloat16)
