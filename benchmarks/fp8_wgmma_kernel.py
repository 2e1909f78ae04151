"""The CuTe DSL kernel of ``benchmarks.fp8_wgmma_probe`` (sm_90a): one CTA per probe, one
warpgroup, one ``wgmma.mma_async m64n8k32.f32.e4m3.e4m3`` on designed operands."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint8
from cutlass.cute.nvgpu import warpgroup

from fast.device import fp32 as h
from fast.device import ptx as p

__all__ = ["Fp8WgmmaProbeKernel", "ROWS", "COLS", "KS", "SMEM_BYTES"]

ROWS, COLS, KS = 64, 8, 32
#: A (8 atoms of 8 rows x 128 bytes), B (one atom), and slack for the 1024-byte alignment
SMEM_BYTES = 8 * 1024 + 1024 + 1024


class Fp8WgmmaProbeKernel:
    """Addresses: A codes ``uint8 [P, 64, 32]``, B codes ``uint8 [P, 8, 32]``, D and out
    ``float32 [P, 64, 8]``; ``accumulate``: D added (non-zero) or not (the scale-d
    predicate); ``probes``: P, one CTA each.

    Per CTA: A's 64 rows of 32 bytes (two 16-byte chunks each, one per thread) and B's 8
    rows into shared memory under the 128-byte swizzle (chunk ``c`` of row ``r`` at chunk
    ``c ^ (r % 8)`` of the row's 128 bytes, 8-row atoms of 1024 bytes, the first 32 bytes
    of each row used: the k32 step at offset 0); the async-proxy fence and a barrier; D's
    m64n8 fragment loaded (rows ``16 warp + lane / 4`` and ``+ 8``, columns ``2 (lane %
    4) + 0, 1``); one MMA; the fragment stored to ``out``."""

    threads = 128

    @classmethod
    def compile_args(cls, **params):
        """(kernel, fake arguments but the stream) for ``fast.device.compile.compiled``."""
        return cls(**params), [Int64(0)] * 4 + [Int32(1)] * 2

    @cute.jit
    def __call__(self, a: Int64, b: Int64, d: Int64, out: Int64, accumulate: Int32,
                 probes: Int32, stream):
        self.kernel(a, b, d, out, accumulate).launch(
            grid=(probes, 1, 1), block=(self.threads, 1, 1), stream=stream, smem=SMEM_BYTES)

    @cute.kernel
    def kernel(self, a: Int64, b: Int64, d: Int64, out: Int64, accumulate: Int32):
        tid = cute.arch.thread_idx()[0]
        lane = tid % 32
        warp = tid // 32
        probe = cute.arch.block_idx()[0]
        base = cute.arch.get_dyn_smem(Uint8, alignment=1024).toint()
        a_smem = base
        b_smem = base + 8 * 1024
        row = tid // 2
        chunk = tid % 2
        words = p.ldg_stream_v4(a + Int64(probe) * (ROWS * KS) + Int64(row * KS + chunk * 16))
        p.sts_v4(a_smem + (row // 8) * 1024 + (row % 8) * 128 + (chunk ^ (row % 8)) * 16, words)
        if tid < 2 * COLS:
            words = p.ldg_stream_v4(b + Int64(probe) * (COLS * KS) + Int64(row * KS + chunk * 16))
            p.sts_v4(b_smem + row * 128 + (chunk ^ row) * 16, words)
        cute.arch.fence_view_async_shared()
        cute.arch.sync_threads()
        where = []
        for i in cutlass.range_constexpr(4):
            r = warp * 16 + lane // 4 + 8 * (i // 2)
            col = 2 * (lane % 4) + i % 2
            where.append(Int64(probe) * (ROWS * COLS) + Int64(r * COLS + col))
        acc = [h.from_bits(p.ldg_u32(d + where[i] * 4)) for i in range(4)]
        warpgroup.fence()
        acc = p.wgmma_e4m3_ss(acc, p.smem_matrix_descriptor_sw128(a_smem, 1024),
                              p.smem_matrix_descriptor_sw128(b_smem, 1024), COLS, accumulate)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        acc = p.wgmma_settle(acc)
        for i in cutlass.range_constexpr(4):
            p.stg_f32(out + where[i] * 4, acc[i])
