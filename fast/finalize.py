"""Finalize: the routing-weighted sum of each token's top-k expert rows (CuTe DSL).

``out[t] = bf16_rne(acc)``, ``acc = fma(w[t, k], rows[k_max * t + k], acc)`` for k in order
from 0, ``acc`` starting at +0.0 -- bitwise equal to ``reference.finalize``.
"""

import cutlass
import cutlass.cute as cute
import torch

from fast.device import fp32 as h
from fast.device import ptx as p
from fast import backend

__all__ = ["finalize", "FinalizeKernel"]

_COLS = 8  # columns per thread: one 16-byte load per expert row


class FinalizeKernel:
    """out[t] = sum_k w[t, k] * rows[K t + k] (FP32 FMA chain, k in order, one BF16
    rounding): one CTA per token, ``L / 8`` threads of 8 columns.

    Algorithm (thread i of CTA t owns columns [8i, 8i + 8)):

    1. issue all K 16-byte loads ``rows[K t + k, 8i : 8i + 8]`` (K = top-k, 16) before
       the first use, so K loads per thread are in flight;
    2. for k = 0 .. K-1 in order: ``w = weights[t, k]`` (FP32), and for each of the 8
       columns ``acc = fma.rn.f32(w, row, acc)``; ``acc`` starts at +0.0, BF16 row
       values are widened exactly (bits << 16);
    3. round the 8 accumulators to BF16 (``cvt.rn.bf16x2.f32``: RNE, overflow to
       inf) and store them with one 16-byte store.

    Math: per column a sequential FP32 fused multiply-add chain in k order (each
    ``fma.rn.f32`` rounds once; no reduction tree), then one RNE rounding to BF16.
    The first step is fma(w0, r0, +0.0) = round(w0 * r0) (+0.0 where the product is
    -0.0). No fast-math, no FTZ.

    Constraints: ``L % 256 == 0`` and ``L / 8 <= 1024`` (L = 3584: 448 threads, 14
    warps); rows BF16 ``[T * K, L]`` and out BF16 ``[T, L]`` contiguous and 16-byte
    aligned; weights FP32 ``[T, K]`` contiguous; ``T * K * L < 2^31``.

    Run: ``python -m pytest verify/test_finalize.py -k fast`` (on an SM90/SM100 GPU);
    compile only: ``python -c "from fast import backend;
    backend.compile_for_target('finalize', 'sm_90a')"``.
    """

    def __init__(self, width: int, top_k: int):
        self.width, self.top_k = width, top_k
        self.threads = width // _COLS

    @classmethod
    def compile_args(cls, *, width: int, top_k: int):
        """(kernel, fake arguments but the stream) for ``fast.device.compile.compiled``."""
        return cls(width, top_k), (backend.ptr(None, "bf16"), backend.ptr(None, "f32"),
                                   backend.ptr(None, "bf16"), backend.int32(1))

    @cute.jit
    def __call__(self, rows, weights, out, tokens: cutlass.Int32, stream):
        self.kernel(rows, weights, out).launch(
            grid=(tokens, 1, 1), block=(self.threads, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(self, rows, weights, out):
        tid = cute.arch.thread_idx()[0]
        token = cute.arch.block_idx()[0]
        width: cutlass.Constexpr = self.width
        top_k: cutlass.Constexpr = self.top_k
        words = []
        for k in cutlass.range_constexpr(top_k):
            words.append(p.load_v4(rows + ((token * top_k + k) * width + tid * _COLS)))
        acc = [h.Float32(0.0)] * _COLS
        for k in cutlass.range_constexpr(top_k):
            w = cute.arch.load(weights + (token * top_k + k), h.Float32)
            for i in cutlass.range_constexpr(4):
                acc[2 * i] = h.ffma(w, h.bf16_lo(words[k][i]), acc[2 * i])
                acc[2 * i + 1] = h.ffma(w, h.bf16_hi(words[k][i]), acc[2 * i + 1])
        packed = [h.pack_bf16x2(acc[2 * i], acc[2 * i + 1]) for i in range(4)]
        p.store_v4(out + (token * width + tid * _COLS), packed)


def _check(rows, weights):
    if not isinstance(rows, torch.Tensor) or not isinstance(weights, torch.Tensor):
        raise TypeError("finalize: rows and weights must be torch.Tensors")
    if weights.dtype != torch.float32 or weights.dim() != 2:
        raise TypeError(
            f"finalize: weights must be float32 [T, k], got {weights.dtype} "
            f"{tuple(weights.shape)}"
        )
    t, k = weights.shape
    if rows.dtype != torch.bfloat16 or rows.dim() != 2 or rows.shape[0] != t * k:
        raise TypeError(
            f"finalize: rows must be bfloat16 [T*k, L] = [{t * k}, L], got {rows.dtype} "
            f"{tuple(rows.shape)}"
        )
    width = rows.shape[1]
    if width % 256 or width // _COLS > 1024:
        raise ValueError(f"finalize: rows width L={width} must be a multiple of 256, <= 8192")
    for name, x in (("rows", rows), ("weights", weights)):
        if not x.is_cuda:
            raise ValueError(f"finalize: {name} must be a CUDA tensor, got {x.device}")
        if not x.is_contiguous():
            raise ValueError(f"finalize: {name} must be contiguous")
    if rows.device != weights.device:
        raise ValueError(f"finalize: rows on {rows.device}, weights on {weights.device}")
    if rows.data_ptr() % 16:
        raise ValueError("finalize: rows must be 16-byte aligned")
    if rows.numel() >= 2**31:
        raise ValueError(f"finalize: rows has {rows.numel()} elements (limit 2^31)")
    return t, k, width


def finalize(rows: torch.Tensor, weights: torch.Tensor, *, out: torch.Tensor | None = None):
    """BF16 ``[T, L]``: ``out[t] = bf16(sum_k w[t, k] * rows[k_max t + k])`` (FP32 FMA chain
    in k order). rows BF16 ``[T*k, L]``, weights FP32 ``[T, k]``, both contiguous CUDA
    tensors on one device; ``out`` (optional) BF16 ``[T, L]`` contiguous."""
    t, k, width = _check(rows, weights)
    if out is None:
        out = torch.empty(t, width, dtype=torch.bfloat16, device=rows.device)
    elif (
        out.dtype != torch.bfloat16
        or tuple(out.shape) != (t, width)
        or not out.is_contiguous()
        or out.device != rows.device
        or out.data_ptr() % 16
    ):
        raise ValueError(f"finalize: out must be contiguous bfloat16 [{t}, {width}] on {rows.device}")
    if t == 0:
        return out
    fn = backend.compiled("finalize", backend.device_arch(rows.device), width=width, top_k=k)
    fn(
        backend.ptr(rows, "bf16"),
        backend.ptr(weights, "f32"),
        backend.ptr(out, "bf16"),
        backend.int32(t),
        backend.stream(rows.device),
    )
    return out
