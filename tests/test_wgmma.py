"""The warpgroup MMA helpers of ``fast.device.ptx`` (``wgmma_bf16`` with A from registers,
``smem_matrix_descriptor``, ``wgmma_settle``) on one 64 x N x 64 product.

The kernel is the engine's use in miniature: each warp of one warpgroup holds its 16 rows
of A in the ``mma.m16n8k16`` fragment order, B (N x 64, K-major) is copied to shared
memory in the no-swizzle core-matrix layout (8 rows x 16 bytes per 128-byte core
matrix), and four k16 steps accumulate in FP32. Small integers make every product and
every partial sum exact, so the result must equal ``A @ B.T`` bit for bit whatever the
hardware's summation order: a wrong fragment, descriptor or layout cannot hide.
Compiles for sm_90a on any machine; runs where an SM90 GPU is present.
"""

from __future__ import annotations

import pytest
import torch

cute_error = None
try:
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int64
    from cutlass.cute.nvgpu import warpgroup

    from fast.device import ptx as p
except ImportError as error:  # pragma: no cover - CuTe DSL missing
    cute_error = error

pytestmark = pytest.mark.skipif(cute_error is not None, reason=f"CuTe DSL not importable: {cute_error}")

K = 64
ROWS = 64


if cute_error is None:

    class WgmmaProbe:
        """D[64, n] = A[64, 64] @ B[n, 64]^T, A and B BF16 row-major, D FP32 row-major."""

        def __init__(self, n: int):
            self.n = n

        @cute.jit
        def __call__(self, a: Int64, b: Int64, d: Int64, stream):
            self.kernel(a, b, d).launch(grid=(1, 1, 1), block=(128, 1, 1), stream=stream,
                                        smem=self.n * K * 2)

        @cute.kernel
        def kernel(self, a: Int64, b: Int64, d: Int64):
            n: cutlass.Constexpr = self.n
            tid = cute.arch.thread_idx()[0]
            lane = tid % 32
            warp = tid // 32
            g = lane // 4
            q = lane % 4
            smem = cute.arch.get_dyn_smem(cutlass.Uint8, alignment=128).toint()
            # B granule (token t, k block kb of 8) -> core matrix kb, row t
            for i in cutlass.range_constexpr((n * 8 + 127) // 128):
                gi = tid + 128 * i
                if gi < n * 8:
                    t = gi // 8
                    kb = gi % 8
                    dst = ((t // 8) * 8 + kb) * 128 + (t % 8) * 16
                    p.cp_async_16(smem + dst, b + Int64(t * K + kb * 8) * 2, True)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            cute.arch.fence_view_async_shared()
            cute.arch.sync_threads()
            acc = cute.make_rmem_tensor((n // 2,), Float32)
            for i in cutlass.range_constexpr(n // 2):
                acc[i] = Float32(0.0)
            row = warp * 16 + g
            frags = []
            for j in cutlass.range_constexpr(4):
                words = []
                for (dr, dk) in ((0, 0), (8, 0), (0, 8), (8, 8)):
                    words.append(p.ldg_u32(a + Int64((row + dr) * K + 16 * j + 2 * q + dk) * 2))
                frags.append(words)
            vals = [acc[i] for i in range(n // 2)]
            warpgroup.fence()
            for j in cutlass.range_constexpr(4):
                desc = p.smem_matrix_descriptor(smem + 2 * j * 128, 128, 8 * 128)
                vals = p.wgmma_bf16(vals, frags[j], desc, n)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            vals = p.wgmma_settle(vals)
            for blk in cutlass.range_constexpr(n // 8):
                for h in cutlass.range_constexpr(4):
                    r = row + 8 * (h // 2)
                    c = blk * 8 + 2 * q + h % 2
                    p.stg_f32(d + Int64(r * n + c) * 4, vals[4 * blk + h])


def _compile(n: int, arch: str):
    from fast import backend

    return cute.compile(WgmmaProbe(n), Int64(0), Int64(0), Int64(0), backend.fake_stream(),
                        options=f"--gpu-arch {arch}")


@pytest.mark.parametrize("n", (8, 16, 24, 32))
def test_wgmma_probe_compiles_for_sm90a(n):
    assert _compile(n, "sm_90a") is not None


@pytest.mark.gpu
@pytest.mark.parametrize("n", (8, 16, 24, 32))
def test_wgmma_probe_exact_product(n):
    from fast import backend

    if backend.gpu_arch() != "sm_90a":
        pytest.skip(f"wgmma is an sm_90a instruction; this machine's GPU: {backend.gpu_arch()}")
    gen = torch.Generator().manual_seed(n)
    # |a|, |b| <= 8: products <= 64, sums of 64 <= 4096, all exact in FP32 and BF16
    a = torch.randint(-8, 9, (ROWS, K), generator=gen).to(torch.bfloat16).cuda()
    b = torch.randint(-8, 9, (n, K), generator=gen).to(torch.bfloat16).cuda()
    d = torch.full((ROWS, n), float("nan"), device="cuda")
    fn = _compile(n, "sm_90a")
    fn(Int64(a.data_ptr()), Int64(b.data_ptr()), Int64(d.data_ptr()), backend.stream())
    torch.cuda.synchronize()
    expected = a.float() @ b.float().T
    assert torch.equal(d, expected), (d - expected).abs().max()



# --- the engine's B operand in a ring slot (pure index arithmetic, no CuTe DSL needed) ---


@pytest.mark.parametrize("stage_chunks", (1, 2))
@pytest.mark.parametrize("windows", (1, 2, 4))
def test_engine_b_layouts_fill_the_slot_once(stage_chunks, windows):
    """Both B layouts place every token piece of a window group in its own place of the
    slot's ``windows * stage_chunks * 1024`` bytes: ``mma.sync`` 16-byte pieces, ``wgmma``
    the pieces' four 4-byte words (no copy overwrites another)."""
    from fast.experts.layout import WGMMA_WORD_STRIDE, WINDOW, b_offset_mma, b_offset_wgmma

    size = windows * stage_chunks * 1024
    every = [(w, n, cc, kk) for w in range(windows) for n in range(WINDOW)
             for cc in range(stage_chunks) for kk in range(8)]
    assert sorted(b_offset_mma(*x, stage_chunks) for x in every) == list(range(0, size, 16))
    words = sorted(b_offset_wgmma(*x, stage_chunks) + m * WGMMA_WORD_STRIDE
                   for x in every for m in range(4))
    assert words == list(range(0, size, 4))


def _copied_wgmma(n, cc, physical_k, stage_chunks):
    """Where the kernel's copies put token n's chunk-k ``physical_k`` of chunk cc."""
    from fast.experts.layout import WGMMA_WORD_STRIDE, WINDOW, b_offset_wgmma

    kk, within = divmod(physical_k, 8)
    m, e = divmod(within, 2)
    return (b_offset_wgmma(n // WINDOW, n % WINDOW, cc, kk, stage_chunks)
            + m * WGMMA_WORD_STRIDE + 2 * e)


@pytest.mark.parametrize("stage_chunks", (1, 2))
@pytest.mark.parametrize("live", (1, 2, 3, 4))
def test_engine_wgmma_descriptor_reads_the_permuted_tokens(stage_chunks, live):
    """Every element (token n, logical k) of MMA step j of chunk cc that ``wgmma`` reads
    through the engine's descriptor (the PTX canonical K-major layout) is the element the
    kernel copied for chunk k ``mma_physical_k(j, k)``: the k the decoded A fragment holds
    at that logical k, so every product pairs a weight and a token of the same k."""
    from fast.experts.layout import mma_physical_k, wgmma_b_descriptor, wgmma_b_reads

    for cc in range(stage_chunks):
        for j in range(4):
            start, leading, stride = wgmma_b_descriptor(cc, j, stage_chunks)
            for n in range(8 * live):
                for k in range(16):
                    assert (wgmma_b_reads(start, leading, stride, n, k)
                            == _copied_wgmma(n, cc, mma_physical_k(j, k), stage_chunks)), (cc, j, n, k)


def test_k_permutation_covers_each_chunk_k_once():
    """``mma_physical_k`` over the 4 steps x 16 logical k is a permutation of 0..63."""
    from fast.experts.layout import mma_physical_k

    assert sorted(mma_physical_k(j, k) for j in range(4) for k in range(16)) == list(range(64))


def test_engine_mma_fragments_follow_the_k_permutation():
    """The ``mma.sync`` path (verified on the H200): lane l's two 16-byte loads of (window,
    chunk) at ``((window SC + cc) 2 + h) 512 + 16 l`` hold pieces ``2 (l % 4) + h`` of token
    ``l // 4``, and its B registers of step j (words 2j, 2j + 1 of the 8) are chunk k
    ``mma_physical_k(j, 2q)`` and ``mma_physical_k(j, 2q + 8)``, q = l % 4: the map the
    decoded A fragments follow, which the wgmma layout reproduces."""
    from fast.experts.layout import WINDOW, b_offset_mma, mma_physical_k

    for sc in (1, 2):
        for w in range(2):
            for cc in range(sc):
                for lane in range(32):
                    n, q = lane // 4, lane % 4
                    for h in range(2):
                        read = (((w * sc + cc) * 2 + h) * 32 + lane) * 16
                        assert n < WINDOW and b_offset_mma(w, n, cc, 2 * q + h, sc) == read
                    for j in range(4):
                        for word, logical in ((2 * j, 2 * q), (2 * j + 1, 2 * q + 8)):
                            piece, at = divmod(word, 4)  # word of the lane's 8 = 2 pieces
                            physical = 8 * (2 * q + piece) + 2 * at
                            assert physical == mma_physical_k(j, logical), (lane, j, word)
