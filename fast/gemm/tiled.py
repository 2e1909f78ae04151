"""``TiledGemm``: the batch-invariant GEMM for many rows on the GPU (sm_90a).

``TiledGemm(weight, splits=S)(x, out_dtype=..., addend=...)`` computes what
``fast.gemm.DenseGemm(weight, splits=S, wgmma=True)`` computes, **bit for bit**, with
``fast.gemm.tiled_kernel.TiledGemmKernel``: TMA-fed warpgroup MMA on 128-row weight tiles
and 32- to 160-token tiles, the same K split folded in the same order. It is the form for
the wide layer's 256 to 1024 rows, where ``DenseGemm``'s decode-width loop runs at 1.4-1.9x
cuBLAS's time; a token's row does not depend on which of the two computed it, nor on its
batch-mates (``verify/test_gemm_fast.py::test_gemm_fast_tiled_same_bits``).

sm_90a only (warpgroup MMA and TMA): any other target is refused by name. With
``cross=True`` (the default where ``splits > 1``) each K split runs in its own CTAs and the
last CTA of a tile folds the partials in split order, through an FP32 workspace and a
counter per tile allocated here for ``max_tokens`` rows (the counters re-armed by the
kernel itself, so calls and graph replays need no reset); ``cross=False`` runs the splits
one after another in each CTA (no workspace); ``persistent=True`` runs one CTA per
multiprocessor, each a contiguous range of (tile, split) units, the splits of a tile that
straddles two CTAs handed over through the same workspace. Every form gives the same bits. The kernel of
each (output, addend) kind is compiled at its first call (call once outside a CUDA-graph
capture per kind, or use :meth:`compile_for`).
"""

from __future__ import annotations

import torch

from fast import backend
from fast.device.compile import compiled, frozen
from fast.gemm.host import check_gemm_call, check_weight_placement, check_weight_shape
from fast.gemm.tiled_kernel import TiledGemmKernel
from fast.gemm.tiled_layout import STAGE_K, check_tiled_options, tile_grid, workspace_bytes

__all__ = ["TiledGemm"]

_BF16, _F32 = torch.bfloat16, torch.float32


class TiledGemm:
    """The tiled batch-invariant GEMM of one BF16 weight ``[N, K]``.

    Args:
        weight: BF16 ``[N, K]``, contiguous, on a CUDA device; ``K`` a multiple of
            ``64 * splits``.
        splits: the K split, the one of the ``DenseGemm`` whose bits this reproduces
            (``fast.gemm.splits_for_rows`` for a wide layer's GEMM).
        max_tokens: the largest call (rows of ``x``).
        tile_tokens: tokens per CTA tile (a multiple of 16 in 32..160,
            ``fast.gemm.tiled_layout.TILE_TOKENS``); moves no bit.
        stages: the TMA ring's depth (2..8 stages of 64 k); moves no bit.
        cross: one CTA per K split, the partials folded by the last CTA of each tile
            (True), or the splits in order inside each CTA (False); moves no bit. None
            (the default): True unless ``persistent``.
        producer: a warp of its own issues the TMA copies and each stage's MMAs overlap the
            next stage's (True), or warp 0 also refills the ring and every stage's MMAs
            are waited for (False); moves no bit.
        persistent: one CTA per multiprocessor, each running a contiguous range of the
            call's (tile, split) units in one ring (True; not with ``cross``); moves no bit.
        ctas: the persistent grid's CTAs at most (None: the GPU's multiprocessors); moves
            no bit.
        pdl: launch with programmatic dependent launch (the persistent form only): a call
            starts while the stream's previous kernel finishes and streams its first
            stages' weights before waiting for it; moves no bit.
        cluster: ``(weight tiles, token tiles)``: the serial or cross form (with a producer
            warp; not persistent) in thread-block clusters of that many CTAs, each CTA loading a
            slice of the weight stage its token tiles share and of the token stage its
            weight tiles share, multicast by TMA to the others (fewer operand bytes
            through the L2: at most 8 CTAs, extents of
            ``fast.gemm.tiled_layout.CLUSTER_EXTENTS``); moves no bit.
    """

    def __init__(self, weight: torch.Tensor, *, splits: int, max_tokens: int,
                 tile_tokens: int = 128, stages: int = 4, cross: bool | None = None,
                 producer: bool = False, persistent: bool = False, ctas: int | None = None,
                 pdl: bool = False, cluster: tuple[int, int] = (1, 1)):
        n, k = check_weight_shape("TiledGemm", weight)
        check_weight_placement("TiledGemm", weight)
        if isinstance(splits, bool) or not isinstance(splits, int) or splits < 1 \
                or k % (STAGE_K * splits):
            raise ValueError(f"TiledGemm: splits must be an int >= 1 with K={k} a multiple of "
                             f"{STAGE_K} x splits, got {splits!r}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"TiledGemm: max_tokens must be an int >= 1, got {max_tokens!r}")
        backend.require_supported("TiledGemm")
        self.arch = backend.device_arch(weight.device)
        if self.arch != "sm_90a":
            raise ValueError(f"TiledGemm: the tiled kernel is warpgroup MMA and TMA (sm_90a); "
                             f"this GPU is {self.arch}")
        self.weight, self.n, self.k, self.splits = weight, n, k, splits
        self.max_tokens, self.device = max_tokens, weight.device
        self.tile_tokens, self.stages = tile_tokens, stages
        if cross is None:
            cross = not persistent
        self.ctas = (torch.cuda.get_device_properties(self.device).multi_processor_count
                     if ctas is None else ctas)
        kernel = TiledGemmKernel(n=n, k=k, width=n, splits=splits, tile_tokens=tile_tokens,
                                 stages=stages, cross=cross, producer=producer,
                                 persistent=persistent, ctas=self.ctas,
                                 cluster=cluster)  # refuses bad ones by name
        self.cross, self.producer, self.persistent = kernel.cross, producer, persistent
        self.cluster = kernel.cluster
        check_tiled_options("TiledGemm", dict(persistent=persistent, pdl=pdl))
        self.pdl = pdl
        self._null = torch.zeros(8, dtype=_F32, device=self.device)
        if self.cross or (persistent and splits > 1):
            tiles, chunks = tile_grid(n, max_tokens, tile_tokens)
            self.workspace = torch.empty(workspace_bytes(n, max_tokens, tile_tokens, splits) // 4,
                                         dtype=_F32, device=self.device)
            self.counters = torch.zeros(tiles * chunks, dtype=torch.int32, device=self.device)
        else:
            self.workspace, self.counters = self._null, self._null

    def label(self) -> str:
        """``tiled t<tile tokens> s<stages> <cross|serial>[ producer]``: what a benchmark
        table prints for calls this object serves."""
        grid = "persistent" if self.persistent else ("cross" if self.cross else "serial")
        return (f"tiled t{self.tile_tokens} s{self.stages} {grid}"
                + (" producer" if self.producer else "") + (" pdl" if self.pdl else "")
                + (f" cluster {self.cluster[0]}x{self.cluster[1]}"
                   if self.cluster != (1, 1) else ""))

    def kernel_params(self, out_dtype: torch.dtype, addend_dtype: torch.dtype | None) -> dict:
        """The compile parameters of the kernel that serves this output and addend kind."""
        kind = "none" if addend_dtype is None else ("bf16" if addend_dtype == _BF16 else "f32")
        return dict(n=self.n, k=self.k, width=self.n, splits=self.splits,
                    out_f32=out_dtype == _F32, addend=kind, tile_tokens=self.tile_tokens,
                    stages=self.stages, cross=self.cross, producer=self.producer,
                    persistent=self.persistent, ctas=self.ctas, cluster=self.cluster)

    def compile_for(self, kinds) -> None:
        """Compile the kernels of ``kinds``: ``(out_dtype, addend_dtype or None)`` pairs."""
        for out_dtype, addend_dtype in kinds:
            compiled(TiledGemmKernel, self.arch, frozen(self.kernel_params(out_dtype, addend_dtype)))

    def check_call(self, x, out, out_dtype, addend) -> int:
        """Refuse a bad call by the argument's name; return ``T``
        (``fast.gemm.host.check_gemm_call``, as ``DenseGemm``'s)."""
        return check_gemm_call("TiledGemm", x, out, out_dtype, addend, n=self.n, k=self.k,
                               max_tokens=self.max_tokens, device=self.device)

    def __call__(self, x: torch.Tensor, *, out_dtype: torch.dtype = _BF16,
                 addend: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W^T`` (``+ addend``), rounded once to ``out_dtype``: BF16 ``x [T, K]``, an
        optional BF16 or FP32 ``addend [T, N]`` added to the FP32 sum before the rounding
        (it may be ``out`` itself), an optional ``out [T, N]`` of ``out_dtype``. Returns
        ``out``."""
        return self.run(x, self.check_call(x, out, out_dtype, addend), out_dtype=out_dtype,
                        addend=addend, out=out)

    def run(self, x: torch.Tensor, t: int, *, out_dtype: torch.dtype = _BF16,
            addend: torch.Tensor | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """The launch of a call that :meth:`check_call` (or the same
        ``fast.gemm.host.check_gemm_call`` of a ``DenseGemm`` of this weight and
        ``max_tokens``) has accepted, ``t`` its rows: what ``__call__`` runs after its
        checks. Returns ``out``."""
        if out is None:
            out = torch.empty(t, self.n, dtype=out_dtype, device=self.device)
        from cutlass import Int32, Int64

        params = self.kernel_params(out_dtype, None if addend is None else addend.dtype)
        fn = compiled(TiledGemmKernel, self.arch, frozen(params))
        fn(Int64(self.weight.data_ptr()), Int64(x.data_ptr()), Int64(out.data_ptr()),
           Int64((addend if addend is not None else self._null).data_ptr()),
           Int64(self.workspace.data_ptr()), Int64(self.counters.data_ptr()), Int32(t),
           Int32(1 if self.pdl else 0), backend.stream(self.device))
        return out

