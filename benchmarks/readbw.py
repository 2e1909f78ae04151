"""A streaming read of a large buffer with the experts engine's load instruction
(``ld.global.nc.L1::no_allocate.v4.u32``): the read-bandwidth ceiling of a weight stream,
and the project's one bandwidth (``docs/targets.md``).

``read(buf, out)``: each of ``4096`` CTAs of 256 threads reads a contiguous share of
``buf`` (16 bytes per thread per step, 4 loads in flight per thread) and writes the XOR of
what it read to ``out[cta]`` (so no load can be optimized away). The benchmark tables also
flush L2 with it (``benchmarks.experts_table.l2_flush``).

:func:`read_bandwidth_gbs`: the read bandwidth every table measures in its own run and
divides its byte limits by.
"""


import functools
import statistics

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


def read_bandwidth_gbs(nbytes: int = 4 << 30, reps: int = 20) -> float:
    """The read bandwidth (GB/s, 1e9 bytes per second) of this GPU: ``nbytes`` (4 GiB, 80x
    the H200's L2) of random bytes read once by :func:`read`, the call captured in a CUDA
    graph and its replay timed by CUDA events ``reps`` times (no flush between: the buffer
    does not fit in L2); ``nbytes`` over the median time."""
    buf = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    out = torch.zeros(CTAS, dtype=torch.int32, device="cuda")
    read(buf, out)  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        read(buf, out)
    torch.cuda.synchronize()
    times_us = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times_us.append(start.elapsed_time(end) * 1e3)
    return nbytes / (statistics.median(times_us) * 1e-6) / 1e9
