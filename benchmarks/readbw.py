"""A streaming read of a large buffer with the experts engine's load instruction
(``ld.global.nc.L1::no_allocate.v4.u32``): the read-bandwidth ceiling of a weight stream.

``read(buf, out)``: each of ``4096`` CTAs of 256 threads reads a contiguous share of
``buf`` (16 bytes per thread per step, 4 loads in flight per thread) and writes the XOR of
what it read to ``out[cta]`` (so no load can be optimized away).
"""


import functools

import torch

CTAS, THREADS, UNROLL = 4096, 256, 4


@functools.cache
def _compiled():
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32, Int64, Uint32

    from fast import backend
    from fast.device import ptx as p

    class ReadKernel:
        @cute.jit
        def __call__(self, buf: Int64, out: Int64, steps: Int32, stream):
            self.kernel(buf, out, steps).launch(grid=(CTAS, 1, 1), block=(THREADS, 1, 1),
                                                stream=stream)

        @cute.kernel
        def kernel(self, buf: Int64, out: Int64, steps: Int32):
            tid = cute.arch.thread_idx()[0]
            cta = cute.arch.block_idx()[0]
            base = buf + (Int64(cta) * Int64(steps) * (THREADS * 16 * UNROLL)) + tid * 16
            acc = Uint32(0)
            for s in cutlass.range(steps, unroll=1):
                words = []
                for u in cutlass.range_constexpr(UNROLL):
                    words += list(p.ldg_stream_v4(base + (Int64(s) * UNROLL + u) * (THREADS * 16)))
                for x in words:
                    acc = acc ^ x
            if acc == Uint32(0x12345678):
                p.stg_i32(out + cta * 4, 1)

    return cute.compile(ReadKernel(), Int64(0), Int64(0), Int32(1), backend.fake_stream(),
                        options=f"--gpu-arch {backend.gpu_arch() or 'sm_90a'}")


def read(buf: torch.Tensor, out: torch.Tensor) -> None:
    """Read all of ``buf`` (uint8, a multiple of 4096 * 256 * 64 bytes) once."""
    from cutlass import Int32, Int64

    from fast import backend

    per = CTAS * THREADS * 16 * UNROLL
    if buf.numel() % per:
        raise ValueError(f"read: buf must be a multiple of {per} bytes, got {buf.numel()}")
    _compiled()(Int64(buf.data_ptr()), Int64(out.data_ptr()), Int32(buf.numel() // per),
                backend.stream(buf.device))
