"""RMSNorm of the routed latent (CuTe DSL): one CTA per token, ``L / 8`` threads of 8
columns, a stated FP32 reduction tree (``reference.emulation.rms_norm_tree`` repeats it
bit-exactly)."""

import cutlass
import cutlass.cute as cute
import torch

from fast.device import ptx as p
from fast.device.norm import COLUMNS, normalize_row
from fast import backend

__all__ = ["rms_norm", "NormKernel"]

_COLS = COLUMNS


class NormKernel:
    """y = bf16(x * rsqrt(mean(x^2) + eps) * w): one CTA per token, ``L / 8`` threads.

    Algorithm (thread i of CTA t owns columns [8i, 8i + 8); W = L / 256 warps):

    1. one 16-byte load of ``x[t, 8i : 8i + 8]`` and one of ``w[8i : 8i + 8]``;
    2. per thread, in column order: ``s = x0*x0``, then ``s = s + xj*xj`` for j = 1..7
       (``mul.rn.f32`` / ``add.rn.f32``: BF16 squares are exact in FP32);
    3. warp butterfly: ``s = s + shfl_xor(s, o)`` for o = 16, 8, 4, 2, 1 (``add.rn``;
       both lanes of a pair add the same two numbers, so every lane ends equal);
    4. lane 0 of warp j stores ``s`` in shared memory slot j; ``bar.sync``; every
       thread adds the W warp sums left to right: ``tot = w_0 + w_1 + ... + w_{W-1}``;
    5. ``mean = tot / L`` (``div.rn.f32``, true IEEE division), ``r = 1 / sqrt(mean +
       eps)`` as ``div.rn.f32(1, sqrt.rn.f32(add.rn.f32(mean, eps)))`` -- two correctly
       rounded operations, not ``rsqrt.approx`` (whose documented max relative error
       is 2^-22.9 and is not reproducible on the CPU), so the kernel is bitwise
       equal to ``reference.emulation.rms_norm_tree``;
    6. ``y = (x * r) * w`` (two ``mul.rn.f32``), rounded once to BF16 (RNE), one
       16-byte store.

    Constraints: ``L % 256 == 0``, ``L <= 8192``; x, out BF16 ``[T, L]`` and w BF16
    ``[L]`` contiguous, 16-byte aligned; eps is passed as FP32.

    Run: ``python -m pytest verify/test_norm.py -k fast`` (on an SM90/SM100 GPU).
    """

    def __init__(self, width: int):
        self.width = width
        self.threads = width // _COLS

    @classmethod
    def compile_args(cls, *, width: int):
        """(kernel, fake arguments but the stream) for ``fast.device.compile.compiled``."""
        return cls(width), (backend.ptr(None, "bf16"), backend.ptr(None, "bf16"),
                            backend.ptr(None, "bf16"), backend.float32(1e-5), backend.int32(1))

    @cute.jit
    def __call__(self, x, w, out, eps, tokens, stream):
        self.kernel(x, w, out, eps).launch(
            grid=(tokens, 1, 1), block=(self.threads, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(self, x, w, out, eps):
        tid = cute.arch.thread_idx()[0]
        token = cute.arch.block_idx()[0]
        width: cutlass.Constexpr = self.width
        warps: cutlass.Constexpr = self.threads // 32
        xw = p.load_v4(x + (token * width + tid * _COLS))
        ww = p.load_v4(w + tid * _COLS)
        p.store_v4(out + (token * width + tid * _COLS), normalize_row(xw, ww, eps, width, warps))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out=None) -> torch.Tensor:
    """BF16 ``[T, L]`` RMSNorm of BF16 ``x [T, L]`` with BF16 ``weight [L]`` (see
    ``NormKernel``'s docstring for the exact math). Contiguous CUDA tensors, L % 256 == 0."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError("rms_norm: x and weight must be torch.Tensors")
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        raise TypeError(f"rms_norm: x must be bfloat16 [T, L], got {x.dtype} {tuple(x.shape)}")
    t, width = x.shape
    if weight.dtype != torch.bfloat16 or tuple(weight.shape) != (width,):
        raise TypeError(
            f"rms_norm: weight must be bfloat16 [{width}], got {weight.dtype} {tuple(weight.shape)}"
        )
    if width % 256 or width > 8192:
        raise ValueError(f"rms_norm: L={width} must be a multiple of 256, at most 8192")
    for name, v in (("x", x), ("weight", weight)):
        if not v.is_cuda or v.device != x.device:
            raise ValueError(f"rms_norm: {name} must be a CUDA tensor on x's device, got {v.device}")
        if not v.is_contiguous() or v.data_ptr() % 16:
            raise ValueError(f"rms_norm: {name} must be contiguous and 16-byte aligned")
    if not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"rms_norm: eps must be a non-negative float, got {eps!r}")
    if x.numel() >= 2**31:
        raise ValueError(f"rms_norm: x has {x.numel()} elements (limit 2^31)")
    if out is None:
        out = torch.empty_like(x)
    elif out.dtype != torch.bfloat16 or out.shape != x.shape or not out.is_contiguous() \
            or out.device != x.device or out.data_ptr() % 16:
        raise ValueError(f"rms_norm: out must be contiguous bfloat16 {tuple(x.shape)} on {x.device}")
    if t == 0:
        return out
    fn = backend.compiled("norm", backend.device_arch(x.device), width=width)
    fn(backend.ptr(x, "bf16"), backend.ptr(weight, "bf16"), backend.ptr(out, "bf16"),
       backend.float32(eps), backend.int32(t), backend.stream(x.device))
    return out
