"""Exact FP32 arithmetic of the kernels (CuTe DSL), shared by every kernel module whose
numerics the reference repeats bit for bit (``fast.mx``, ``fast.router``,
``fast.finalize``, ``fast.activation``, ``fast.norm``, the experts engine, ``fast.gemm``
and the schedules' kernels).

Every floating-point operation a kernel's numerics depend on is issued here as one
explicit PTX instruction with an explicit rounding mode (``mul.rn.f32``, ``add.rn.f32``,
``fma.rn.f32``, ``div.rn.f32``, ``sqrt.rn.f32``, ``cvt.rn...``). An explicit ``.rn``
forbids ptxas from contracting a multiply and an add into an FMA and no instruction here
flushes subnormals (no ``.ftz``), so each kernel computes exactly the IEEE-754 FP32
sequence its docstring states, and ``reference.emulation`` reproduces it with plain
PyTorch FP32 tensor operations (which round each op to nearest even, without contraction,
on the CPU).

The exponential ``exp_rn`` is the project's own (not ``ex2.approx`` and not libdevice's
``expf``): Cody-Waite reduction with Cephes' split of ln 2, a degree-7 Taylor polynomial
in Horner form, and an exact power-of-two scale, all in the instructions above. It is
therefore bit-reproducible on the CPU (``reference.emulation.exp_rn``); its constants are
``model.exp_tanh``'s (the one place both read them) and its accuracy over FP32
arguments is measured against float64 in ``tests/test_emulation.py``.

Nothing here launches anything. The memory accesses are in ``fast.device.ptx``.
"""

from __future__ import annotations

import struct

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32

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

__all__ = [
    "Float32",
    "Int32",
    "Uint32",
    "fmul",
    "fadd",
    "fsub",
    "ffma",
    "fdiv",
    "fsqrt",
    "fmax_nan",
    "fmin_nan",
    "rint",
    "bits",
    "from_bits",
    "bf16_lo",
    "bf16_hi",
    "pack_bf16x2",
    "exp_rn",
    "tanh_rn",
    "sigmoid_rn",
]

def _ptx_f32(value: float) -> str:
    """A PTX FP32 immediate (``0fXXXXXXXX``, the IEEE bits) of a Python float."""
    return "0f%08X" % struct.unpack(">I", struct.pack(">f", value))[0]


def _ptx1(code, *args, out=Float32):
    return cute.arch.inline_ptx(code, write_only_types=[out], read_only_args=list(args))


# --- IEEE-754 FP32 arithmetic, round to nearest even, no contraction, no FTZ ---------


def fmul(a, b):
    return _ptx1("mul.rn.f32 {$w0}, {$r0}, {$r1};", Float32(a), Float32(b))


def fadd(a, b):
    return _ptx1("add.rn.f32 {$w0}, {$r0}, {$r1};", Float32(a), Float32(b))


def fsub(a, b):
    return _ptx1("sub.rn.f32 {$w0}, {$r0}, {$r1};", Float32(a), Float32(b))


def ffma(a, b, c):
    """fma(a, b, c) = a * b + c rounded once (``fma.rn.f32``)."""
    return _ptx1(
        "fma.rn.f32 {$w0}, {$r0}, {$r1}, {$r2};", Float32(a), Float32(b), Float32(c)
    )


def fdiv(a, b):
    """a / b, IEEE-754 correctly rounded (``div.rn.f32``, full range)."""
    return _ptx1("div.rn.f32 {$w0}, {$r0}, {$r1};", Float32(a), Float32(b))


def fsqrt(a):
    """sqrt(a), IEEE-754 correctly rounded (``sqrt.rn.f32``)."""
    return _ptx1("sqrt.rn.f32 {$w0}, {$r0};", Float32(a))


def fmax_nan(a, b):
    """max(a, b) propagating NaN (``max.NaN.f32``: torch.maximum's semantics)."""
    return _ptx1("max.NaN.f32 {$w0}, {$r0}, {$r1};", Float32(a), Float32(b))


def fmin_nan(a, b):
    """min(a, b) propagating NaN (``min.NaN.f32``: torch.minimum's semantics)."""
    return _ptx1("min.NaN.f32 {$w0}, {$r0}, {$r1};", Float32(a), Float32(b))


def rint(a):
    """Round to the nearest integer, ties to even, as FP32 (``cvt.rni.f32.f32``;
    torch.round's rule)."""
    return _ptx1("cvt.rni.f32.f32 {$w0}, {$r0};", Float32(a))


def bits(a):
    """The IEEE bits of an FP32 value as Uint32."""
    return Float32(a).bitcast(Uint32)


def from_bits(u):
    return Uint32(u).bitcast(Float32)


# --- BF16 pairs in 32-bit words ------------------------------------------------------


def bf16_lo(word):
    """The FP32 value of the BF16 in the low half of ``word`` (exact)."""
    return (Uint32(word) << Uint32(16)).bitcast(Float32)


def bf16_hi(word):
    """The FP32 value of the BF16 in the high half of ``word`` (exact)."""
    return (Uint32(word) & Uint32(0xFFFF0000)).bitcast(Float32)


def pack_bf16x2(lo, hi):
    """Two FP32 values rounded to BF16 (RNE, ``cvt.rn.bf16x2.f32``: overflow -> inf, as
    torch's ``.to(torch.bfloat16)``), ``lo`` in the low half."""
    return _ptx1(
        "cvt.rn.bf16x2.f32 {$w0}, {$r0}, {$r1};", Float32(hi), Float32(lo), out=Uint32
    )


# --- exp, tanh, sigmoid from IEEE operations (bit-reproducible on the CPU) -----------

def exp_rn(x):
    """e^x from IEEE FP32 operations (the exact sequence; ``reference.emulation.exp_rn``
    repeats it):

        x  = min.NaN(max.NaN(x, -104), 89)
        n  = rint(mul(x, LOG2E))                   # ties to even
        r  = sub(sub(x, mul(n, LN2_HI)), mul(n, LN2_LO))
        p  = 1/5040; p = add(mul(p, r), c) for c in 1/720, 1/120, 1/24, 1/6, 1/2, 1, 1
        n1 = floor(n / 2), n2 = n - n1             # integers, each in [-75, 64]
        e^x = mul(mul(p, 2^n1), 2^n2)              # 2^k built from exponent bits
    """
    x = fmin_nan(fmax_nan(x, Float32(EXP_LO)), Float32(EXP_HI))
    n = rint(fmul(x, Float32(LOG2E)))
    r = fsub(fsub(x, fmul(n, Float32(LN2_HI))), fmul(n, Float32(LN2_LO)))
    p = Float32(EXP_COEFFS[0])
    for c in EXP_COEFFS[1:]:
        p = fadd(fmul(p, r), Float32(c))
    ni = _ptx1("cvt.rzi.s32.f32 {$w0}, {$r0};", n, out=Int32)  # n is integral
    n1 = ni >> Int32(1)  # arithmetic shift: floor(n / 2)
    n2 = ni - n1
    s1 = Uint32(n1 + Int32(127)) << Uint32(23)
    s2 = Uint32(n2 + Int32(127)) << Uint32(23)
    return fmul(fmul(p, from_bits(s1)), from_bits(s2))


def tanh_rn(y):
    """tanh(y) from IEEE FP32 operations (``reference.emulation.tanh_rn`` repeats it):

        a     = |y|
        small : z = mul(y, y); q = TANH_COEFFS[0]; q = add(mul(q, z), c) for the
                other coefficients c; t = add(mul(mul(q, z), y), y)
        large : e = exp_rn(add(a, a)); t = sub(1, div(2, add(e, 1)))
        tanh  = copysign(small if a < TANH_SMALL else large, y)   (both evaluated, selected;
                the copysign makes tanh(-0) = -0 and changes nothing else)
    """
    y = Float32(y)
    a = _ptx1("abs.f32 {$w0}, {$r0};", y)
    z = fmul(y, y)
    q = Float32(TANH_COEFFS[0])
    for c in TANH_COEFFS[1:]:
        q = fadd(fmul(q, z), Float32(c))
    small = fadd(fmul(fmul(q, z), y), y)
    e = exp_rn(fadd(a, a))
    big = fsub(Float32(1.0), fdiv(Float32(2.0), fadd(e, Float32(1.0))))
    t = cute.arch.inline_ptx(
        "{ .reg .pred p; setp.lt.f32 p, {$r0}, " + _ptx_f32(TANH_SMALL) + "; "
        "selp.f32 {$w0}, {$r1}, {$r2}, p; }",
        write_only_types=[Float32],
        read_only_args=[a, small, big],
    )
    return _ptx1("copysign.f32 {$w0}, {$r0}, {$r1};", y, t)


def sigmoid_rn(x):
    """sigmoid(x) = div(1, add(1, exp_rn(-x))) (``reference.emulation.sigmoid_rn``)."""
    neg = _ptx1("neg.f32 {$w0}, {$r0};", Float32(x))
    return fdiv(Float32(1.0), fadd(Float32(1.0), exp_rn(neg)))
