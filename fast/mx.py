"""MXFP8 quantization of BF16 activations (CuTe DSL) -- the project's quantizer on SM90,
where FlashInfer's ``mxfp8_quantize`` CUDA kernels are compiled empty (their outputs are
left unwritten below SM100). Bit-identical to ``reference.mx.quantize_mxfp8`` (RCEIL)."""

import cutlass
import cutlass.cute as cute
import torch

from fast.device import fp32 as h
from fast.device import ptx as p
from fast import backend

__all__ = ["quantize_mxfp8", "QuantizeKernel", "quantize_block"]

_BLOCK = 32
_THREADS = 128
U = h.Uint32


def _pad(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def sel(cond, a, b):
    """``a`` if ``cond`` else ``b``, as Uint32."""
    return U(cutlass.select_(cond, U(a), U(b)))


def e4m3x4(v0, v1, v2, v3):
    """Four FP32 values to four E4M3 codes in one word (``cvt.rn.satfinite.e4m3x2.f32``
    twice: RNE, saturating to +-448), ``v0`` in the low byte."""
    return cute.arch.inline_ptx(
        "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, {$r1}, {$r0}; "
        "cvt.rn.satfinite.e4m3x2.f32 hi, {$r3}, {$r2}; mov.b32 {$w0}, {lo, hi}; }",
        write_only_types=[U],
        read_only_args=[v0, v1, v2, v3],
    )


def quantize_block(words):
    """Steps 2-6 of ``QuantizeKernel`` for one block: its 32 BF16 values as 16 words (two
    per word, the lower address in the low half) -> ``(E8M0 code, 8 words of E4M3 codes)``
    in the same order. Emits the instructions inline (any kernel may call it)."""
    m = U(0)
    for w in words:
        a = w & U(0x7FFF7FFF)
        m = cutlass.max(m, a & U(0xFFFF))
        m = cutlass.max(m, a >> U(16))
    q = h.fdiv(h.from_bits(m << U(16)), h.Float32(448.0))
    qb = h.bits(q)
    e = qb >> U(23)
    normal = e + sel((qb & U(0x7FFFFF)) != U(0), 1, 0)
    sub = sel(qb > U(0x00400000), 1, 0)
    code = sel(e == U(0), sub, normal)
    code = cutlass.min(code, U(254))
    code = sel(qb > U(0x7F800000), 255, code)
    mult = sel(code == U(254), 0x00400000, (U(254) - code) << U(23))
    mult = sel(code == U(0), 0x3F800000, mult)
    mf = h.from_bits(mult)
    vals = []
    for w in words:
        vals.append(h.fmul(h.bf16_lo(w), mf))
        vals.append(h.fmul(h.bf16_hi(w), mf))
    return code, [e4m3x4(*vals[4 * i: 4 * i + 4]) for i in range(8)]


class QuantizeKernel:
    """MXFP8 (E4M3 elements, E8M0 scale per 32 along K) of BF16 ``x [M, K]``.

    Algorithm: one thread per 32-element block; thread g of the launch covers scale
    entry (r, c) = (g // C, g % C) with C = K/32 (linear layout) or pad4(K/32)
    (swizzled layout, where rows run to pad128(M)); a thread outside [0, M) x [0, K/32)
    only writes a 0 scale into the padding. An in-range thread:

    1. four 16-byte loads of its 32 BF16 values;
    2. ``amax``: the maximum of the magnitudes as BF16 bit patterns (``& 0x7FFF``,
       unsigned max: the order of non-negative finite floats), widened to FP32 exactly;
    3. ``q = div.rn.f32(amax, 448)`` (true IEEE division, gradual underflow);
    4. E8M0 code from the bits of ``q`` (RCEIL, ``cvt.rp.satfinite.ue8m0x2.f32``'s
       rule): biased exponent ``E``, fraction ``m``: normal -> ``E + (m != 0)``;
       subnormal -> ``1`` if ``q > 2^-127`` else ``0`` (zero -> 0); capped at 254;
    5. multiplier ``2^(127 - code)`` built from bits (code 254: the FP32 subnormal
       2^-127), and 1 for code 0 (``model.formats.ScaleRule.RCEIL``'s convention);
    6. ``v = mul.rn.f32(x, multiplier)`` (exact unless |v| < 2^-126, which E4M3 rounds
       to 0 either way), ``cvt.rn.satfinite.e4m3x2.f32`` (RNE, saturating to ±448 --
       identical to clamping to ±448 first), two 16-byte stores of 32 codes, one byte
       store of the scale (linear ``[r, c]``, or the 128x4 swizzle offset
       ``((r//128) * C/4 + c//4) * 512 + (r%32) * 16 + ((r%128)//32) * 4 + c%4``).

    Non-finite input: not checked by the wrapper (a scan would cost as much as the
    quantization); the output for a block holding NaN/Inf is unspecified.

    Constraints: ``K % 32 == 0``; x BF16 ``[M, K]`` contiguous, 16-byte aligned;
    ``M * K < 2^31``.

    Run: ``python -m pytest verify/test_mx.py -k fast`` (on an SM90/SM100 GPU).
    """

    def __init__(self, k: int, swizzled: bool):
        self.k, self.swizzled = k, swizzled
        self.kb = k // _BLOCK
        self.cols = _pad(self.kb, 4) if swizzled else self.kb

    @classmethod
    def compile_args(cls, *, k: int, swizzled: bool):
        """(kernel, fake arguments but the stream) for ``fast.device.compile.compiled``."""
        return cls(k, bool(swizzled)), (backend.ptr(None, "bf16"), backend.ptr(None, "u8"),
                                        backend.ptr(None, "u8", 1), backend.int32(1),
                                        backend.int32(1))

    @cute.jit
    def __call__(self, x, codes, scales, rows, total, stream):
        self.kernel(x, codes, scales, rows, total).launch(
            grid=((total + _THREADS - 1) // _THREADS, 1, 1),
            block=(_THREADS, 1, 1),
            stream=stream,
        )

    @cute.kernel
    def kernel(self, x, codes, scales, rows, total):
        g = cute.arch.block_idx()[0] * _THREADS + cute.arch.thread_idx()[0]
        cols: cutlass.Constexpr = self.cols
        kb: cutlass.Constexpr = self.kb
        k: cutlass.Constexpr = self.k
        r = g // cols
        c = g - r * cols
        if g < total:
            code = U(0)
            if r < rows and c < kb:
                src = x + (r * k + c * _BLOCK)
                words = []
                for i in cutlass.range_constexpr(4):
                    words += p.load_v4(src + 8 * i)
                code, out = quantize_block(words)
                dst = codes + (r * k + c * _BLOCK)
                p.store_v4(dst, out[:4])
                p.store_v4(dst + 16, out[4:])
            off = r * cols + c
            if cutlass.const_expr(self.swizzled):
                off = ((r // 128) * (cols // 4) + c // 4) * 512 + (r % 32) * 16 \
                    + ((r % 128) // 32) * 4 + c % 4
            cute.arch.store(scales + off, cutlass.Uint8(code))


def quantize_mxfp8(x: torch.Tensor, *, swizzled: bool = False):
    """``(codes float8_e4m3fn [M, K], scales uint8)`` of BF16 ``x [M, K]`` (contiguous CUDA,
    K % 32 == 0), bit-identical to ``reference.mx.quantize_mxfp8`` (RCEIL). Scales are
    ``[M, K // 32]`` (linear) or, with ``swizzled``, the 128x4 layout flattened to
    ``pad128(M) * pad4(K // 32)`` bytes with zero padding
    (``model.swizzle.swizzle_scales_128x4``). Non-finite input is not checked; its
    blocks' output is unspecified."""
    if not isinstance(x, torch.Tensor):
        raise TypeError("quantize_mxfp8: x must be a torch.Tensor")
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] % _BLOCK:
        raise TypeError(
            f"quantize_mxfp8: x must be bfloat16 [M, K] with K % 32 == 0, got {x.dtype} "
            f"{tuple(x.shape)}"
        )
    if not x.is_cuda:
        raise ValueError(f"quantize_mxfp8: x must be a CUDA tensor, got {x.device}")
    if not x.is_contiguous() or x.data_ptr() % 16:
        raise ValueError("quantize_mxfp8: x must be contiguous and 16-byte aligned")
    m, k = x.shape
    if _pad(max(m, 1), 128) * k >= 2**31:
        raise ValueError(f"quantize_mxfp8: x [{m}, {k}] is too large (2^31 elements)")
    kb = k // _BLOCK
    codes = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    if swizzled:
        rows_cover, cols = _pad(m, 128), _pad(kb, 4)
        scales = torch.empty(rows_cover * cols, dtype=torch.uint8, device=x.device)
    else:
        rows_cover, cols = m, kb
        scales = torch.empty(m, kb, dtype=torch.uint8, device=x.device)
    total = rows_cover * cols
    if total == 0:
        return codes, scales
    fn = backend.compiled("mx", backend.device_arch(x.device), k=k, swizzled=bool(swizzled))
    fn(backend.ptr(x, "bf16"), backend.ptr(codes.view(torch.uint8), "u8"),
       backend.ptr(scales, "u8", 1), backend.int32(m), backend.int32(total),
       backend.stream(x.device))
    return codes, scales
