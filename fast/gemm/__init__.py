"""The dense part's split-K swap-AB GEMM on the GPU (CuTe DSL, SM90 and SM100).

At ``T <= front_max = 64`` tokens the dense part of the DEP layer streams four BF16
weights (``reference.schedules.dep``): the packed front ``[shared gate_up | latent down]``
``[2S + L, H]`` (BF16 out), the router gate ``[E, H]`` (FP32 out), the shared down-projection
``[H, S]`` (BF16 out) and the latent up-projection ``[H, L]`` (BF16 out, the shared output
added before the one rounding: ``reference.gemm.addmm``). At these batches every one is a
weight stream: ``2 T`` FLOP per weight byte.

``DenseGemm(weight)(x, out_dtype=..., addend=...)`` puts the weight rows on the 16-row M
side of ``mma.sync.m16n8k16`` (BF16, FP32 accumulation) and the tokens on its 8-column N
side (swap-AB), cuts K into ``splits`` contiguous parts handled by different CTAs, and
sums the FP32 partials in split order in the last CTA of each tile (deterministic, and a
token's bits never depend on the other tokens of the call). The weights stream through a
``cp.async`` ring of shared memory (``fast.gemm.layout``), one CTA per (tile, split), one
wave; one compiled kernel per window count ``ceil(T / 8)``; programmatic dependent launch up
to ``PDL_MAX_TOKENS`` tokens. Tactics per batch bucket: ``fast.gemm.host.DEFAULT_TACTICS``;
only ``splits`` changes bits, and a shape's default ``splits`` is the same at every batch
(``splits_of``), so the default GEMM is batch invariant: a token's output bits do not
depend on the batch it was computed in.

**More than 64 rows** (the wide layer's 65..1024, ``DenseGemm(max_tokens=...)`` up to
``MAX_CALL_TOKENS``): one launch runs ``ceil(T / 64)`` token chunks on the grid's second
dimension, each a single-chunk call on its rows (``fast.gemm.layout.token_chunks``: balanced,
``ceil(ceil(T / chunks) / 8)`` windows each), with the object's one K split, so a token's
bits are those of the same kernel over its chunk and do not depend on the batch
(``DenseGemm(splits=...)`` fixes that split for a layer's whole row range:
``splits_for_rows``). A weight of N rows, N not a multiple of 64, is padded once at
construction. The single-chunk kernels' machine code is unchanged by the chunked variant
(a compile-time parameter, ``Tactic.kernel_params(..., chunked=True)``).

**Two GEMMs of the same tokens in one launch** (``fast.gemm.grouped.GroupedGemm``: the
DEP rank's router and packed front): the first GEMM's CTAs then the second's in one grid,
each output bitwise that GEMM's own call (each keeps its K split), one fixed cost instead
of two.

**Many rows, batch invariant** (``fast.gemm.tiled.TiledGemm``, sm_90a): the same K split
folded in the same order as ``DenseGemm(wgmma=True)``, so the same bits, by TMA-fed
warpgroup MMA on 128-row weight tiles and 64- or 128-token tiles, for the wide layer's 256
to 1024 rows, where the decode-width loop above is 1.4-1.9x cuBLAS's time.

Status (H200, ``benchmarks/results/h200/dense.md``): the four GEMMs in one
graph at T <= 8 take 106.8-109.7 us, 0.77-0.79 of the byte limit at the measured read
bandwidth (cuBLAS 111.1-113.3 us, 0.75-0.76); from T = 12 on they are slower than cuBLAS
(T = 64: 161.8 us against 111.1 us): the ``mma.sync`` main loop's tensor-core and
shared-memory work per weight byte grows with the windows. The 0.85 target is not met.

Run: ``python -m pytest verify/test_gemm_fast.py -k fast`` (on an SM90/SM100 GPU);
timing: ``python -m benchmarks.dense_table``.
"""

from fast.gemm.layout import MAX_CALL_TOKENS, MAX_TOKENS, Tactic, token_chunks, windows_for

__all__ = ["DenseGemm", "Tactic", "choose_tactic", "MAX_TOKENS", "MAX_CALL_TOKENS",
           "windows_for", "token_chunks", "compile_kernel", "kernel_shapes", "DEFAULT_TACTICS",
           "splits_of", "splits_for_rows", "Launch", "launch_for", "GroupedGemm", "grouped_launch",
           "TiledGemm"]


def __getattr__(name):
    if name in ("DenseGemm", "choose_tactic", "compile_kernel", "kernel_shapes", "DEFAULT_TACTICS",
                "splits_of", "splits_for_rows", "Launch", "launch_for"):
        from fast.gemm import host

        return getattr(host, name)
    if name == "TiledGemm":
        from fast.gemm import tiled

        return tiled.TiledGemm
    if name in ("GroupedGemm", "grouped_launch"):
        from fast.gemm import grouped

        return getattr(grouped, name)
    raise AttributeError(name)
