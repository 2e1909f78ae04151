"""Oracles of the elementwise and reduction stages, written op by op from the layer's
definition in numpy FP32 (each numpy ``float32`` operation is one IEEE round-to-nearest),
with every sum rounded exactly (:mod:`verify.oracles.exact`).

Where the definition names a library function that is not correctly rounded (torch's FP32
``sigmoid``, ``tanh``, ``rsqrt``), the oracle takes that function as an argument and applies
it to the same FP32 argument: the oracle then pins every other rounding point and the
order of operations bit for bit, and the function itself is bounded against float64
separately (``verify.tolerances``). The fast kernels' own functions
(``reference.emulation``'s ``exp_rn`` / ``tanh_rn`` / ``sigmoid_rn``) plug into the same
oracles.

| oracle | definition |
|---|---|
| :func:`route` | ``s = sigmoid(l)``; top-k of ``fp32(s + bias)`` descending, ties to the lower id; weights ``s[ids]`` / their FP32 sum in k order, times ``scale`` |
| :func:`situ_and_mul_fp32` | ``((beta * tanh(g / beta)) * sigmoid(g)) * (lb * tanh(u / lb))``, FP32, in this order |
| :func:`rms_norm_fp32`, :func:`rms_norm` | exact sum of squares rounded to FP32; ``/ L``; ``+ eps``; ``rsqrt``; ``(x * r) * w``; one BF16 rounding |
| :func:`finalize` | per column ``acc = fma(w_k, row_k, acc)`` from ``acc = +0`` in k order (each exact, rounded once to FP32); one BF16 rounding |
| :func:`matmul`, :func:`split_k_matmul`, :func:`addmm` | exact sums rounded once; split-K: each split's exact sum rounded to FP32, the splits added in FP32 in order |
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from verify.oracles.exact import BF16, FP32, RoundedDot, format_of, rounded_dot, rounded_sum

__all__ = [
    "route",
    "situ_and_mul_fp32",
    "situ_and_mul",
    "rms_norm_fp32",
    "rms_norm",
    "finalize",
    "matmul",
    "split_k_matmul",
    "addmm",
]

f32 = np.float32
Fn = Callable[[torch.Tensor], torch.Tensor]


def _apply(fn: Fn, x: np.ndarray) -> np.ndarray:
    """A torch FP32 library function applied to a numpy FP32 array."""
    out = fn(torch.from_numpy(np.ascontiguousarray(x, dtype=f32)))
    if out.dtype != torch.float32:
        raise TypeError(f"oracle: the function must return float32, got {out.dtype}")
    return out.numpy()


def _bf16(x: np.ndarray) -> torch.Tensor:
    """FP32 -> BF16, one RNE rounding (torch's float32 -> bfloat16 conversion rounds once)."""
    return torch.from_numpy(np.ascontiguousarray(x, dtype=f32)).to(torch.bfloat16)


def route(logits: torch.Tensor, bias: torch.Tensor, *, top_k: int, renormalize: bool,
          scale: float, sigmoid: Fn = torch.sigmoid) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid top-k routing. logits FP32 [T, E], bias FP32 [E] -> (weights FP32 [T, k],
    ids int32 [T, k]). The selection sorts the keys ``(-biased, id)`` with numpy's
    ``lexsort`` (so equal scores go to the lower id; ``-0`` and ``+0`` are equal)."""
    s = _apply(sigmoid, logits.detach().cpu().numpy())
    biased = (s + bias.detach().cpu().numpy().astype(f32)).astype(f32)
    t, e = biased.shape
    ids = np.lexsort((np.broadcast_to(np.arange(e), (t, e)), -biased.astype(np.float64)),
                     axis=-1)[:, :top_k]
    w = np.take_along_axis(s, ids, axis=1).astype(f32)
    if renormalize:
        total = w[:, 0].copy()
        for k in range(1, top_k):
            total = (total + w[:, k]).astype(f32)
        w = (w / total[:, None]).astype(f32)
    w = (w * f32(scale)).astype(f32)
    return torch.from_numpy(w), torch.from_numpy(ids.astype(np.int32))


def situ_and_mul_fp32(gate: torch.Tensor, up: torch.Tensor, *, beta: float, linear_beta: float,
                      tanh: Fn = torch.tanh, sigmoid: Fn = torch.sigmoid) -> torch.Tensor:
    """SiTU-and-mul in FP32, op by op: gate, up FP32 [..., N] (exact values) -> FP32."""
    g = gate.detach().cpu().to(torch.float32).numpy()
    u = up.detach().cpu().to(torch.float32).numpy()
    b, lb = f32(beta), f32(linear_beta)
    a = (b * _apply(tanh, (g / b).astype(f32))).astype(f32)
    a = (a * _apply(sigmoid, g)).astype(f32)
    c = (lb * _apply(tanh, (u / lb).astype(f32))).astype(f32)
    return torch.from_numpy((a * c).astype(f32))


def situ_and_mul(h: torch.Tensor, *, beta: float, linear_beta: float, tanh: Fn = torch.tanh,
                 sigmoid: Fn = torch.sigmoid) -> torch.Tensor:
    """BF16 [..., N] of h [..., 2N] (gate half first): :func:`situ_and_mul_fp32`, one BF16
    rounding."""
    n = h.shape[-1] // 2
    out = situ_and_mul_fp32(h[..., :n], h[..., n:], beta=beta, linear_beta=linear_beta,
                            tanh=tanh, sigmoid=sigmoid)
    return _bf16(out.numpy())


def rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
                  rsqrt: Fn = torch.rsqrt) -> torch.Tensor:
    """RMSNorm before its BF16 rounding: x BF16 [T, L], weight BF16 [L] -> FP32 [T, L].
    The sum of squares is exact (each square of a BF16 value is exact in float64), rounded
    once to FP32; then ``mean = ss / L``, ``r = rsqrt(mean + eps)``, ``(x * r) * w``."""
    x64 = x.detach().cpu().double()
    ss = rounded_sum(x64 * x64, FP32).value.numpy()
    length = x.shape[-1]
    mean = (ss / f32(length)).astype(f32)
    r = _apply(rsqrt, (mean + f32(eps)).astype(f32))
    xs = x.detach().cpu().float().numpy()
    y = ((xs * r[:, None]).astype(f32) * weight.detach().cpu().float().numpy()).astype(f32)
    return torch.from_numpy(y)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             rsqrt: Fn = torch.rsqrt) -> torch.Tensor:
    """RMSNorm: :func:`rms_norm_fp32` rounded once to BF16."""
    return _bf16(rms_norm_fp32(x, weight, eps, rsqrt=rsqrt).numpy())


def _fma_fp32(p: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """float64 ``p`` (exact products) and ``acc`` (FP32 values) -> FP32 ``RN(p + acc)``.

    ``s = p + acc`` in float64 is the exact sum rounded to 53 bits, and rounding ``s`` to
    FP32 equals rounding the exact sum unless ``s`` is exactly an FP32 midpoint (53 >=
    2 * 24 + 2; a midpoint strictly between the exact sum and ``s`` would be a closer
    float64). At such a midpoint the sign of the exact remainder ``p + acc - s``
    (``math.fsum``) decides: zero is a true tie (nearest even, as ``s.float()`` rounds),
    otherwise the FP32 neighbour on the remainder's side."""
    s = p + acc
    out = s.float()
    near = out.double()
    toward = torch.where(s > near, float("inf"), float("-inf")).to(torch.float32)
    other = torch.nextafter(out, toward)
    mid = ((s - near).abs() * 2 == (other.double() - near).abs()) & (s != near)
    if bool(mid.any()):
        at = torch.nonzero(mid.reshape(-1)).flatten()
        ps, accs, ss = (v.reshape(-1)[at].tolist() for v in (p, acc, s))
        rest = torch.tensor([math.fsum([a, b, -c]) for a, b, c in zip(ps, accs, ss)],
                            dtype=torch.float64)
        flat_out, flat_other = out.reshape(-1), other.reshape(-1)
        s_at = torch.tensor(ss, dtype=torch.float64)
        beyond = (rest != 0) & ((rest > 0) == (flat_other[at].double() > s_at))
        flat_out[at] = torch.where(beyond, flat_other[at], flat_out[at])
    return out


def finalize(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Finalize: rows BF16 [T*K, L], weights FP32 [T, K] -> BF16 [T, L]. Each step is the
    exact ``w * row + acc`` rounded once to FP32 (a fused multiply-add; the product of an
    FP32 and a BF16 value is exact in float64)."""
    t, k = weights.shape
    r = rows.detach().cpu().double().view(t, k, -1)
    w = weights.detach().cpu().double()
    acc = torch.zeros(t, r.shape[-1], dtype=torch.float32)
    for j in range(k):
        acc = _fma_fp32(w[:, j:j + 1] * r[:, j], acc.double())
    return _bf16(acc.numpy())


def matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> RoundedDot:
    """``a [M, K] @ b [N, K]^T``, each exact sum rounded once to ``out_dtype``."""
    return rounded_dot(a, b, format_of(out_dtype))


def addmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> RoundedDot:
    """``c + a @ b^T`` (c BF16 [M, N]), each exact sum rounded once to BF16."""
    return rounded_dot(a, b, BF16, addend=c)


def split_k_matmul(a: torch.Tensor, b: torch.Tensor, *, splits: int,
                   out_dtype: torch.dtype) -> RoundedDot:
    """The split-K order: split ``s`` (columns ``[s K/S, (s+1) K/S)``) summed exactly and
    rounded once to FP32; ``acc = p_0``, ``acc = fp32(acc + p_s)`` for s = 1.. in order; then
    one rounding to ``out_dtype`` (none for FP32). ``ambiguous`` marks the elements where a
    split's exact sum is ambiguous for a float64 model (its FP32 partial may differ by one
    rounding there); ``low`` / ``high`` are ``value`` (no interval is carried through)."""
    k = a.shape[1]
    if splits < 1 or k % splits:
        raise ValueError(f"split_k_matmul: splits must divide K={k}, got {splits}")
    width = k // splits
    acc = None
    ambiguous = None
    fallbacks = 0
    for s in range(splits):
        cols = slice(s * width, (s + 1) * width)
        part = rounded_dot(a[:, cols], b[:, cols], FP32)
        fallbacks += part.exact_fallbacks
        values = part.value.numpy()
        acc = values if acc is None else (acc + values).astype(f32)
        ambiguous = part.ambiguous if ambiguous is None else ambiguous | part.ambiguous
    out = torch.from_numpy(acc)
    out = out if out_dtype == torch.float32 else out.to(out_dtype)
    return RoundedDot(out, out, out, ambiguous, fallbacks)
