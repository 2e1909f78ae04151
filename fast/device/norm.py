"""The RMSNorm of one row by one CTA (CuTe DSL): the reduction tree of ``fast.norm`` that
``reference.emulation.rms_norm_tree`` repeats bit for bit, shared by the RMSNorm kernel and
the schedules' kernels that fuse the norm after a combine or an all-reduce.
"""

import cutlass
import cutlass.cute as cute

from fast.device import fp32 as h

__all__ = ["COLUMNS", "normalize_row"]

#: Columns of a row per thread (8 BF16: one 16-byte access).
COLUMNS = 8


@cute.jit
def normalize_row(xw, ww, eps, width: cutlass.Constexpr, warps: cutlass.Constexpr):
    """Steps 2-6 of ``fast.norm.NormKernel`` for one CTA of ``width / 8`` threads holding a
    row: this thread's 8 BF16 inputs ``xw`` and weights ``ww`` (4 words each, column order)
    -> its 4 words of BF16 output. Every thread of the CTA must call it (one barrier).
    ``fast.norm.NormKernel`` runs it on its own; ``fast.schedules.dep_kernels.CombineKernel``
    and ``fast.schedules.wide_kernels.LatentAllReduceNormKernel`` fuse it after their sums."""
    xs = []
    for i in cutlass.range_constexpr(4):
        xs.append(h.bf16_lo(xw[i]))
        xs.append(h.bf16_hi(xw[i]))
    s = h.fmul(xs[0], xs[0])
    for j in cutlass.range_constexpr(1, COLUMNS):
        s = h.fadd(s, h.fmul(xs[j], xs[j]))
    for o in (16, 8, 4, 2, 1):
        s = h.fadd(s, cute.arch.shuffle_sync_bfly(s, offset=o))
    smem = cute.make_tensor(cute.arch.alloc_smem(h.Float32, 32), cute.make_layout(32))
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    if lane == 0:
        smem[warp] = s
    cute.arch.sync_threads()
    tot = smem[0]
    for j in cutlass.range_constexpr(1, warps):
        tot = h.fadd(tot, smem[j])
    mean = h.fdiv(tot, h.Float32(float(width)))
    r = h.fdiv(h.Float32(1.0), h.fsqrt(h.fadd(mean, eps)))
    packed = []
    for i in cutlass.range_constexpr(4):
        lo = h.fmul(h.fmul(xs[2 * i], r), h.bf16_lo(ww[i]))
        hi = h.fmul(h.fmul(xs[2 * i + 1], r), h.bf16_hi(ww[i]))
        packed.append(h.pack_bf16x2(lo, hi))
    return packed
