"""The zero-filling copies of ``fast.device.ptx`` (``cp_async_16``, ``cp_async_4z``): a
copy whose ``valid`` is false writes zeros and reads nothing, one whose ``valid`` is true
copies its bytes.

The engine's B operand (the padded token slots of a window), the dense GEMM's rows past
the batch and the Blackwell engine's gathers use them. A padded slot's products land only
in its own output column, which nothing stores, so the engine's contracts could not see a
copy that left stale bytes there: this probe checks the copies themselves. The shared
memory is first filled with 0xFF bytes; each thread then copies 16 bytes (into the first
``THREADS * 16`` bytes, 16-byte aligned as cp.async needs) and 4 bytes (into the next
``THREADS * 4``), the valid ones from a source of known bytes in the same layout, and the
result is read back. Compiles for every
target on any machine; runs where a GPU is present.
"""

from __future__ import annotations

import pytest
import torch

cutlass = pytest.importorskip("cutlass", reason="CuTe DSL (nvidia-cutlass-dsl) is not installed")
import cutlass.cute as cute  # noqa: E402
from cutlass import Int32, Int64  # noqa: E402

from fast.device import ptx as p  # noqa: E402

THREADS = 128
#: thread t's 16 bytes (cp_async_16) at 16 t; its 4 bytes (cp_async_4z) at WIDE + 4 t
WIDE = THREADS * 16
SMEM = WIDE + THREADS * 4


def valid_16(tid: int) -> bool:
    """Which threads' 16-byte copies read their source (the others must write zeros)."""
    return tid % 3 != 0


def valid_4(tid: int) -> bool:
    """Which threads' 4-byte copies read their source."""
    return tid % 2 == 0


class ZeroFillProbe:
    """out[SMEM] = shared memory after each thread's two copies from src[SMEM]."""

    @cute.jit
    def __call__(self, src: Int64, out: Int64, stream):
        self.kernel(src, out).launch(grid=(1, 1, 1), block=(THREADS, 1, 1), stream=stream,
                                     smem=SMEM)

    @cute.kernel
    def kernel(self, src: Int64, out: Int64):
        tid = cute.arch.thread_idx()[0]
        smem = cute.arch.get_dyn_smem(cutlass.Uint8, alignment=128).toint()
        for i in cutlass.range_constexpr(SMEM // (4 * THREADS)):
            p.sts_i32(smem + 4 * (i * THREADS + tid), Int32(-1))
        cute.arch.sync_threads()
        wide, narrow = tid * 16, WIDE + tid * 4
        p.cp_async_16(smem + wide, src + Int64(wide), tid % 3 != 0)
        p.cp_async_4z(smem + narrow, src + Int64(narrow), tid % 2 == 0)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        for i in cutlass.range_constexpr(SMEM // (4 * THREADS)):
            at = 4 * (i * THREADS + tid)
            p.stg_i32(out + Int64(at), p.lds_i32(smem + at))


def _compile(arch: str):
    from fast import backend

    return cute.compile(ZeroFillProbe(), Int64(0), Int64(0), backend.fake_stream(),
                        options=f"--gpu-arch {arch}")


@pytest.mark.parametrize("arch", ("sm_90a", "sm_100a", "sm_103a"))
def test_zero_fill_probe_compiles(arch):
    assert _compile(arch) is not None


@pytest.mark.gpu
def test_zero_fill_copies_write_zeros_and_read_nothing():
    from fast import backend

    if backend.gpu_arch() is None:
        pytest.skip("the probe runs the copies: it needs a CUDA GPU (sm_90a/sm_100a/sm_103a)")
    gen = torch.Generator().manual_seed(7)
    src = torch.randint(1, 256, (SMEM,), generator=gen, dtype=torch.int32).to(torch.uint8).cuda()
    out = torch.zeros(SMEM, dtype=torch.uint8, device="cuda")
    fn = _compile(backend.gpu_arch())
    fn(Int64(src.data_ptr()), Int64(out.data_ptr()), backend.stream())
    torch.cuda.synchronize()
    expected = src.cpu().clone()
    for tid in range(THREADS):
        if not valid_16(tid):
            expected[16 * tid:16 * (tid + 1)] = 0
        if not valid_4(tid):
            expected[WIDE + 4 * tid:WIDE + 4 * (tid + 1)] = 0
    got = out.cpu()
    wrong = (got != expected).nonzero().flatten()
    assert wrong.numel() == 0, (f"{wrong.numel()} bytes differ, first at byte {int(wrong[0])} "
                                f"(16-byte copies below {WIDE}): got {int(got[wrong[0]])}, "
                                f"expected {int(expected[wrong[0]])}")
