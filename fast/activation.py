"""SiTU-and-mul of the shared expert (CuTe DSL), with the project's own exp / tanh /
sigmoid built from IEEE FP32 operations (``fast.device.fp32``), so that
``reference.emulation.situ_and_mul`` reproduces it bit-exactly on the CPU."""

import cutlass
import cutlass.cute as cute
import torch

from fast.device import fp32 as h
from fast.device import ptx as p
from fast import backend

__all__ = ["situ_and_mul", "SituKernel"]

_COLS = 8  # output columns per thread (one 16-byte load of gate, one of up)
_THREADS = 128


class SituKernel:
    """out[t, j] = bf16(((beta * tanh(g / beta)) * sigmoid(g)) *
    (linear_beta * tanh(u / linear_beta))), g = h[t, j], u = h[t, N + j].

    Algorithm: CTA (c, t) covers columns [1024 c, 1024 c + 1024) of token t; each of
    its 128 threads owns 8 consecutive columns: one 16-byte load of the gate, one of
    the up half, 8 independent evaluations, one 16-byte store. No shared memory, no
    reductions.

    Math (every step one FP32 IEEE operation, round to nearest even, no FTZ, no
    contraction; ``fast.device.fp32`` lists the exact instruction sequences):

    * ``tg = tanh_rn(div.rn(g, beta))``; ``a = mul(beta, tg)``;
    * ``s = sigmoid_rn(g) = div.rn(1, add(1, exp_rn(-g)))``; ``a = mul(a, s)``;
    * ``tu = tanh_rn(div.rn(u, linear_beta))``; ``b = mul(linear_beta, tu)``;
    * ``out = bf16_rne(mul(a, b))``.

    ``exp_rn``: Cody-Waite reduction (Cephes' ln 2 split), degree-7 Taylor in Horner
    form, exact 2^n scale; ``tanh_rn``: Cephes' tanhf polynomial for |y| < 0.625,
    else ``1 - 2 / (exp_rn(2|y|) + 1)`` with y's sign. Not ``ex2.approx`` / libdevice:
    their bits cannot be reproduced on the CPU; these can, so the contract is bitwise
    (``reference.emulation.situ_and_mul``); their accuracy against float64 over FP32
    arguments is measured in ``tests/test_emulation.py``.

    Constraints: ``N % 8 == 0``; h BF16 ``[T, 2N]`` with unit column stride and a row
    stride (elements) that is a multiple of 8 (a column slice of a wider buffer
    works); out BF16 ``[T, N]`` contiguous; 16-byte aligned base addresses.

    Run: ``python -m pytest verify/test_activation.py -k fast`` (on an SM90/SM100 GPU).
    """

    def __init__(self, n: int):
        self.n = n

    @classmethod
    def compile_args(cls, *, n: int):
        """(kernel, fake arguments but the stream) for ``fast.device.compile.compiled``."""
        return cls(n), (backend.ptr(None, "bf16"), backend.ptr(None, "bf16"),
                        backend.int32(2 * n), backend.float32(4.0), backend.float32(25.0),
                        backend.int32(1))

    @cute.jit
    def __call__(self, hp, out, stride, beta, linear_beta, tokens, stream):
        chunks = (self.n // _COLS + _THREADS - 1) // _THREADS
        self.kernel(hp, out, stride, beta, linear_beta).launch(
            grid=(chunks, tokens, 1), block=(_THREADS, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(self, hp, out, stride, beta, linear_beta):
        tid = cute.arch.thread_idx()[0]
        chunk, token, _ = cute.arch.block_idx()
        n: cutlass.Constexpr = self.n
        col = (chunk * _THREADS + tid) * _COLS
        if col < n:
            row = hp + token * stride
            gw = p.load_v4(row + col)
            uw = p.load_v4(row + (n + col))
            packed = []
            for i in cutlass.range_constexpr(4):
                pair = []
                for g, u in ((h.bf16_lo(gw[i]), h.bf16_lo(uw[i])),
                             (h.bf16_hi(gw[i]), h.bf16_hi(uw[i]))):
                    a = h.fmul(beta, h.tanh_rn(h.fdiv(g, beta)))
                    a = h.fmul(a, h.sigmoid_rn(g))
                    b = h.fmul(linear_beta, h.tanh_rn(h.fdiv(u, linear_beta)))
                    pair.append(h.fmul(a, b))
                packed.append(h.pack_bf16x2(pair[0], pair[1]))
            p.store_v4(out + (token * n + col), packed)


def situ_and_mul(h: torch.Tensor, *, beta: float, linear_beta: float, out=None) -> torch.Tensor:
    """BF16 ``[T, N]`` SiTU-and-mul of BF16 ``h [T, 2N]`` (gate = first N columns, up = last
    N). ``h`` may be a column slice of a wider row-major buffer (unit column stride, row
    stride a multiple of 8). See ``SituKernel``'s docstring for the exact math."""
    if not isinstance(h, torch.Tensor):
        raise TypeError("situ_and_mul: h must be a torch.Tensor")
    if h.dtype != torch.bfloat16 or h.dim() != 2 or h.shape[1] % 16:
        raise TypeError(
            f"situ_and_mul: h must be bfloat16 [T, 2N] with N % 8 == 0, got {h.dtype} "
            f"{tuple(h.shape)}"
        )
    t, n = h.shape[0], h.shape[1] // 2
    if not h.is_cuda:
        raise ValueError(f"situ_and_mul: h must be a CUDA tensor, got {h.device}")
    if h.stride(1) != 1 or h.stride(0) % 8 or h.data_ptr() % 16:
        raise ValueError(
            f"situ_and_mul: h needs unit column stride, a row stride that is a multiple of 8 "
            f"and 16-byte alignment; got strides {h.stride()}"
        )
    for name, v in (("beta", beta), ("linear_beta", linear_beta)):
        if not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"situ_and_mul: {name} must be a positive float, got {v!r}")
    if (t - 1) * h.stride(0) + 2 * n >= 2**31:
        raise ValueError("situ_and_mul: h spans more than 2^31 elements")
    if out is None:
        out = torch.empty(t, n, dtype=torch.bfloat16, device=h.device)
    elif out.dtype != torch.bfloat16 or tuple(out.shape) != (t, n) or not out.is_contiguous() \
            or out.device != h.device or out.data_ptr() % 16:
        raise ValueError(f"situ_and_mul: out must be contiguous bfloat16 [{t}, {n}] on {h.device}")
    if t == 0:
        return out
    fn = backend.compiled("activation", backend.device_arch(h.device), n=n)
    fn(backend.ptr(h, "bf16"), backend.ptr(out, "bf16"), backend.int32(h.stride(0)),
       backend.float32(beta), backend.float32(linear_beta), backend.int32(t),
       backend.stream(h.device))
    return out
