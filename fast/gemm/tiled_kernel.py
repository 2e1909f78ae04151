"""fast.gemm's tiled kernel: the batch-invariant GEMM for many rows (CuTe DSL, sm_90a).

``out[t, n] = sum_k x[t, k] W[n, k] (+ addend[t, n])`` for any number of tokens ``T``:
BF16 operands, FP32 accumulation, FP32 or BF16 (RNE) output, with **the summation order of
``fast.gemm``'s split-K kernel at the same ``splits``** (``SplitKGemmKernel``, warpgroup
MMA), so a token's row is bitwise the same whichever kernel computed it and whatever its
batch-mates. Where ``SplitKGemmKernel`` is built for decode widths (64-row weight tiles,
``cp.async`` issued by every thread, one CTA barrier per stage), this kernel is built for
256 to 1024 rows, where the wide layer's GEMMs are bound by arithmetic and by their
operands' re-reads through the L2, not by the weight bytes:

* CTA tile: 128 weight rows x ``tile_tokens`` tokens (``fast.gemm.tiled_layout``'s
  ``TILE_TOKENS``: a multiple of 16 from 32 to 160; one that divides a call's rows into a
  whole number of waves of the multiprocessors, e.g. 96 for 12 weight tiles at 1024 rows,
  fills the GPU without splitting K across CTAs), two warpgroups, each ``wgmma m64 n(tile_tokens) k16`` on its
  64 weight rows (A = weights, B = tokens, both K-major in shared memory with the 128-byte
  swizzle);
* operands by TMA (``cp.async.bulk.tensor``) into a ring of ``stages`` 64-k stages
  (weights and tokens of one stage per slot), each slot's full and empty ``mbarrier``
  replacing the CTA barrier; tokens past ``T`` and weight rows past ``N`` are filled with
  zeros by the TMA unit. ``producer=False``: one thread of warp 0 refills each slot once
  the MMA warps have released it, and every stage's MMAs are waited for before its slot is
  released; ``producer=True``: a ninth warp only issues the copies (``stages`` ahead of the
  MMAs, never waiting on its own MMAs), and each stage's MMAs stay in flight while the
  next stage's are issued (the slot released one stage later);
* grid: one CTA per (128-row weight tile, token tile) with the K split run in order inside
  the CTA (``cross=False``: no workspace, no counters), or one CTA per (weight tile, token
  tile, split) (``cross=True``): each CTA's split partial goes to an FP32 workspace, and
  the last CTA of its tile to arrive (a counter per tile, re-armed to 0 by that CTA) folds
  the ``splits`` partials in split order. The cross form puts ``splits`` times more CTAs on
  the GPU (the serial form leaves multiprocessors idle at some shapes: 40 CTAs for the TP8
  front at 1024 rows) for a round trip of the partials through the L2 (which, at 8 splits
  and 1024 rows, costs more than the idle multiprocessors do: the H100 ``wide-gemms``
  table of ``benchmarks/results``);
* thread-block clusters (``cluster=(w, t)``, the serial or cross form with a producer
  warp; the cross form's partners share their split): the grid rounded up to whole
  clusters of ``w`` weight tiles by ``t`` token tiles (the CTAs past the call's tiles load
  zeros and store nothing: no partial, counter or output); each CTA's producer loads ``1/t``
  of the weight stage and ``1/w`` of the token stage and multicasts them (TMA
  ``.multicast::cluster``) to the cluster's CTAs that share them, so a weight stage
  crosses the L2 once per cluster row instead of once per CTA; each slot's empty barrier
  takes an arrival from every MMA warp of the CTAs it feeds (a slot is refilled only once
  all of them have read it), and the CTAs meet at a cluster barrier after the barriers'
  initialization and before leaving.

Summation order of an output (``verify.bounds.mma_matmul_bound``): for each K split ``s``
(``K / splits`` consecutive k, in order), the split's MMA steps in k order from zero, each
adding 16 exact products into FP32 (one ``wgmma k16`` step, as ``SplitKGemmKernel``'s);
the splits' partials (each split's accumulators started at ``+0.0``, every step adding
into them, as ``SplitKGemmKernel``'s chains) folded in split order into a running sum
started at ``-0.0`` (``sum = -0.0 + p_0`` is ``p_0`` bit for bit, zeros' signs included;
then ``sum + p_s``, ``add.rn.f32``): the serial form's running sum, and in the cross form
the last CTA's reduction (``sum = p_0``, then ``sum + p_s``: the same values), as in
``SplitKGemmKernel``'s two forms; then the addend (``add.rn``; a BF16 addend converted
exactly) and one rounding to the output type. Nothing in it depends on ``T``, the token
tile, the ring, the form or which CTA folds: only ``splits``.

Constraints (checked by the constructor): ``K % (64 splits) == 0``; ``width <= n``;
16-byte aligned contiguous operands (``W [n, K]``, ``x [T, K]``; ``out`` and the addend
``[T, width]``).
"""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum
from cutlass.utils import SmemAllocator

from fast.device import fp32 as h
from fast.device import ptx as p
from fast.gemm.kernel import fence_gpu, ld_cg_v4, ld_f32, ld_u16, stg_f32_if, stg_u16_if
from fast.gemm.tiled_layout import (STAGE_K, THREADS, TILE_ROWS, check_tiled_options,
                                    cluster_grid, prefix_end, tile_grid, unit_range)

__all__ = ["TiledGemmKernel", "ADDENDS"]

#: the addend kinds: none, BF16 or FP32 ``[T, width]``, added before the output's rounding
ADDENDS = ("none", "bf16", "f32")
_GMEM = cute.AddressSpace.gmem
_MMA_WARPS = THREADS // 32


class TiledGemmKernel:
    """One compile per weight shape ``[n, k]`` (``n`` the padded rows), output ``width``,
    K ``splits``, output and addend kinds, token tile and ring depth; the token count is a
    run-time value. See the module docstring for the algorithm and its summation order."""

    def __init__(self, *, n: int, k: int, width: int, splits: int, out_f32: bool = False,
                 addend: str = "none", tile_tokens: int = 128, stages: int = 4,
                 cross: bool = False, producer: bool = False, persistent: bool = False,
                 ctas: int = 132, cluster: tuple[int, int] = (1, 1)):
        if k % (STAGE_K * splits) or splits < 1:
            raise ValueError(f"TiledGemmKernel: K={k} must be a multiple of {STAGE_K} x "
                             f"splits={splits}")
        if not 1 <= width <= n:
            raise ValueError(f"TiledGemmKernel: width={width} must be in 1..n={n}")
        if addend not in ADDENDS:
            raise ValueError(f"TiledGemmKernel: addend must be one of {ADDENDS}, got {addend!r}")
        check_tiled_options("TiledGemmKernel", dict(tile_tokens=tile_tokens, stages=stages,
                                                    cross=cross, producer=producer,
                                                    persistent=persistent, cluster=cluster))
        if isinstance(ctas, bool) or not isinstance(ctas, int) or ctas < 1:
            raise ValueError(f"TiledGemmKernel: ctas must be an int >= 1, got {ctas!r}")
        #: one CTA per multiprocessor (at most ``ctas``), each a range of (tile, split) units
        self.persistent, self.ctas = persistent, ctas
        #: a warp of its own issues the copies (and the MMAs overlap across stages)
        self.producer = producer
        #: the grid's thread-block clusters, (weight tiles, token tiles) CTAs: each
        #: CTA loads 1/(token tiles) of the weight stage and 1/(weight tiles) of the token
        #: stage, multicast to the cluster's CTAs that share it
        self.cluster = (int(cluster[0]), int(cluster[1]))
        self.multicast = self.cluster != (1, 1)
        self.n, self.k, self.width, self.splits = n, k, width, splits
        #: one CTA per split (a single split has nothing to fold: the serial form)
        self.cross = cross and splits > 1
        self.out_f32, self.addend = bool(out_f32), addend
        self.tile_tokens, self.stages = tile_tokens, stages
        self.k_tiles = k // STAGE_K
        self.split_tiles = self.k_tiles // splits
        #: k stages one CTA streams, and the splits it runs in order
        self.cta_tiles = self.split_tiles if self.cross else self.k_tiles
        self.cta_splits = 1 if self.cross else splits
        self.prologue = min(stages, self.cta_tiles)
        self.tiles = tile_grid(n, 1, tile_tokens)[0]
        self.threads = THREADS + (32 if producer else 0)

    @classmethod
    def compile_args(cls, **params):
        """(kernel, fake arguments but the stream) for ``fast.device.compile.compiled``."""
        return cls(**params), [Int64(0)] * 6 + [Int32(1), Int32(0)]

    def _tiled_mma(self):
        return sm90.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K,
                                           OperandMajorMode.K, Float32, (2, 1, 1),
                                           tiler_mn=(64, self.tile_tokens))

    def _tiler(self):
        return (TILE_ROWS, self.tile_tokens, STAGE_K)

    @cute.jit
    def __call__(self, w: Int64, x: Int64, out: Int64, addend: Int64, ws: Int64,
                 counters: Int64, tokens: Int32, pdl: Int32, stream):
        """Launch the call's grid for ``tokens`` rows; ``pdl`` (non-zero: the persistent form
        only) with programmatic dependent launch: the CTAs may start while the stream's
        previous kernel finishes, and stream the weights of their first ``stages`` stages
        before ``griddepcontrol.wait`` (nothing that kernel may write is read or written
        before it)."""
        tiler = self._tiler()
        a_smem = sm90.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tiler, BFloat16, self.stages)
        b_smem = sm90.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tiler, BFloat16, self.stages)
        weights = cute.make_tensor(cute.make_ptr(BFloat16, w, _GMEM, assumed_align=16),
                                   cute.make_layout((self.n, self.k), stride=(self.k, 1)))
        rows = cute.make_tensor(cute.make_ptr(BFloat16, x, _GMEM, assumed_align=16),
                                cute.make_layout((tokens, self.k), stride=(self.k, 1)))
        # a weight stage is shared by the cluster's token tiles, a token stage by its weight
        # tiles: multicast copies where a cluster extent is above 1
        cm, cn = self.cluster
        tma_a, g_a = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SMulticastOp() if cn > 1
            else cpasync.CopyBulkTensorTileG2SOp(), weights,
            cute.slice_(a_smem, (None, None, 0)), (TILE_ROWS, STAGE_K), num_multicast=cn)
        tma_b, g_b = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SMulticastOp() if cm > 1
            else cpasync.CopyBulkTensorTileG2SOp(), rows,
            cute.slice_(b_smem, (None, None, 0)), (self.tile_tokens, STAGE_K),
            num_multicast=cm)
        tiles = self.tiles
        chunks = (tokens + self.tile_tokens - 1) // self.tile_tokens
        if cutlass.const_expr(self.persistent):
            ctas = cutlass.min(tiles * chunks * self.splits, self.ctas)
            self.persistent_kernel(self._tiled_mma(), tma_a, g_a, tma_b, g_b, a_smem, b_smem,
                                   out, addend, ws, counters, tokens).launch(
                                       grid=(ctas, 1, 1), block=(self.threads, 1, 1),
                                       stream=stream, min_blocks_per_mp=1, use_pdl=pdl)
            return
        if cutlass.const_expr(self.multicast):
            grid_tiles, grid_chunks = cluster_grid(tiles, chunks, self.cluster)
            self.kernel(self._tiled_mma(), tma_a, g_a, tma_b, g_b, a_smem, b_smem, out,
                        addend, ws, counters, tokens).launch(
                            grid=(grid_tiles, grid_chunks, self.splits if self.cross else 1),
                            cluster=(cm, cn, 1),
                            block=(self.threads, 1, 1), stream=stream, min_blocks_per_mp=1)
            return
        self.kernel(self._tiled_mma(), tma_a, g_a, tma_b, g_b, a_smem, b_smem, out, addend,
                    ws, counters, tokens).launch(
                        grid=(tiles, chunks, self.splits if self.cross else 1),
                        block=(self.threads, 1, 1), stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_a: cute.CopyAtom, g_a: cute.Tensor,
               tma_b: cute.CopyAtom, g_b: cute.Tensor, a_smem: cute.ComposedLayout,
               b_smem: cute.ComposedLayout, out: Int64, addend: Int64, ws: Int64,
               counters: Int64, tokens: Int32):
        STAGES: cutlass.Constexpr = self.stages
        KT: cutlass.Constexpr = self.cta_tiles
        SPLITS: cutlass.Constexpr = self.cta_splits
        KS: cutlass.Constexpr = self.split_tiles
        tid = cute.arch.thread_idx()[0]
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tile, chunk, split = cute.arch.block_idx()
        # the first k stage this CTA streams (the cross form: its split's)
        first = split * KS if cutlass.const_expr(self.cross) else 0
        if warp == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)

        # this CTA's stages of weights and tokens: (tile, k stage) -> slot
        cta = self._cta_state(tiled_mma, tma_a, g_a, (tile, None), tma_b, g_b, (chunk, None),
                              a_smem, b_smem, tid, warp, self._cluster_place())
        storage, ring, acc, total, coords = cta.storage, cta.ring, cta.acc, cta.total, cta.coords
        frag_a, frag_b = cta.frag_a, cta.frag_b
        t_ga, t_sa, t_gb, t_sb = cta.t_ga, cta.t_sa, cta.t_gb, cta.t_sb
        cute.arch.sync_threads()

        fill = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
        if cutlass.const_expr(self.producer):
            if warp == _MMA_WARPS:
                for _ in cutlass.range(KT, unroll=1):
                    self._load(ring, fill, first, tma_a, t_ga, t_sa, tma_b, t_gb, t_sb,
                               cta.masks)
                    fill.advance()
            else:
                self._mma_overlapped(ring, read, tiled_mma, acc, total, frag_a, frag_b)
        else:
            self._mma_with_loads(ring, fill, read, first, tiled_mma, acc, total, frag_a,
                                 frag_b, warp, tma_a, t_ga, t_sa, tma_b, t_gb, t_sb)
        if cutlass.const_expr(self.cross and self.multicast):
            # a CTA past the call's tiles (the grid rounded up to whole clusters) has no
            # partial, counter or output: it only fed its partners
            if (tile < self.tiles) & (chunk * self.tile_tokens < tokens):
                self._fold_if_last(acc, total, coords, ws, counters,
                                   storage.last.data_ptr().toint(), out, addend, tokens, tile,
                                   chunk, split, tid, warp)
        elif cutlass.const_expr(self.cross):
            self._fold_if_last(acc, total, coords, ws, counters, storage.last.data_ptr().toint(),
                               out, addend, tokens, tile, chunk, split, tid, warp)
        elif warp < _MMA_WARPS:
            self._epilogue(total, coords, out, addend, tokens, tile, chunk)
        if cutlass.const_expr(self.multicast):
            # no CTA leaves while a partner may still multicast into its ring or arrive on
            # its empty barriers
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    def _cluster_place(self):
        """This CTA's place in its cluster (traced inline): ``None`` without one, else its
        (weight tile, token tile) coordinates in the cluster and the cluster's layout."""
        if cutlass.const_expr(not self.multicast):
            return None
        layout = cute.make_layout((*self.cluster, 1))
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        return layout, layout.get_flat_coord(rank)

    @cute.kernel
    def persistent_kernel(self, tiled_mma: cute.TiledMma, tma_a: cute.CopyAtom,
                          g_a: cute.Tensor, tma_b: cute.CopyAtom, g_b: cute.Tensor,
                          a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout, out: Int64,
                          addend: Int64, ws: Int64, counters: Int64, tokens: Int32):
        """The persistent form: CTA ``c`` of the grid runs units ``[q0, q1)``
        (``fast.gemm.tiled_layout.unit_range``; unit ``q`` is split ``q % splits`` of CTA
        tile ``q // splits``, weight tile ``tile % tiles``, token tile ``tile // tiles``),
        one ring across all of them (the copies of the next unit issued while this one's
        MMAs run and while a tile's epilogue stores). A tile whose splits all lie in one
        CTA folds them in its registers in split order (the serial form); otherwise the CTA
        holding split 0 folds its splits in its registers and stores that running sum as
        the tile's slot 0, every other CTA stores each of its splits' partials in its slot,
        and the CTA that completes the tile's counter folds slot 0 and then the later slots
        in split order (the same additions, in the same order: the same bits)."""
        S: cutlass.Constexpr = self.splits
        KS: cutlass.Constexpr = self.split_tiles
        WT: cutlass.Constexpr = self.tiles
        tid = cute.arch.thread_idx()[0]
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        cta = cute.arch.block_idx()[0]
        ctas = cute.arch.grid_dim()[0]
        chunks = (tokens + self.tile_tokens - 1) // self.tile_tokens
        units = WT * chunks * S
        q0, q1 = unit_range(cta, ctas, units)
        loads = (q1 - q0) * KS
        if warp == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)

        # every tile's stages: (weight tile, k stage) and (token tile, k stage) -> slot
        state = self._cta_state(tiled_mma, tma_a, g_a, (None, None), tma_b, g_b, (None, None),
                                a_smem, b_smem, tid, warp)
        storage, ring, acc, total, coords = (state.storage, state.ring, state.acc, state.total,
                                             state.coords)
        frag_a, frag_b = state.frag_a, state.frag_b
        t_ga, t_sa, t_gb, t_sb = state.t_ga, state.t_sa, state.t_gb, state.t_sb
        cute.arch.sync_threads()

        fill = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        done = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        flag = storage.last.data_ptr().toint()
        if cutlass.const_expr(self.producer):
            if warp == _MMA_WARPS:
                fill = self._prologue(ring, fill, q0, loads, tma_a, t_ga, t_sa, tma_b, t_gb,
                                      t_sb)
                for _ in cutlass.range(self.stages, loads, unroll=1):
                    self._load_unit(ring, fill, q0, tma_a, t_ga, t_sa, tma_b, t_gb, t_sb)
                    fill.advance()
            else:
                self._persistent_units(ring, fill, read, done, q0, q1, loads, units, ctas,
                                       tiled_mma, acc, total, frag_a, frag_b, coords, warp,
                                       tid, tma_a, t_ga, t_sa, tma_b, t_gb, t_sb, out, addend,
                                       ws, counters, flag, tokens)
        else:
            if warp == 0:
                fill = self._prologue(ring, fill, q0, loads, tma_a, t_ga, t_sa, tma_b, t_gb,
                                      t_sb)
            self._persistent_units(ring, fill, read, done, q0, q1, loads, units, ctas,
                                   tiled_mma, acc, total, frag_a, frag_b, coords, warp, tid,
                                   tma_a, t_ga, t_sa, tma_b, t_gb, t_sb, out, addend, ws,
                                   counters, flag, tokens)

    @cute.jit
    def _persistent_units(self, ring, fill, read, done, q0, q1, loads, units, ctas,
                          tiled_mma, acc, total, frag_a, frag_b, coords, warp, tid, tma_a,
                          t_ga, t_sa, tma_b, t_gb, t_sb, out: Int64, addend: Int64, ws: Int64,
                          counters: Int64, flag, tokens: Int32):
        """The persistent form's MMA warps over units ``[q0, q1)`` (``persistent_kernel``);
        without a producer warp, warp 0 also refills the ring, ``loads`` copies in all."""
        S: cutlass.Constexpr = self.splits
        KS: cutlass.Constexpr = self.split_tiles
        WT: cutlass.Constexpr = self.tiles
        for q in cutlass.range(q0, q1, unroll=1):
            tile = q // S
            base = tile * S
            lo = cutlass.max(q0, base)
            hi = cutlass.min(q1, base + S)
            if q == lo:
                for i in cutlass.range_constexpr(cute.size(total)):
                    total[i] = Float32(-0.0)
            if cutlass.const_expr(self.producer):
                read, done = self._split_overlapped(ring, read, done, tiled_mma, acc, frag_a,
                                                    frag_b)
            else:
                for kt in cutlass.range(KS, unroll=1):
                    ring.consumer_wait(read)
                    self._stage(tiled_mma, acc, frag_a, frag_b, read.index)
                    ring.consumer_release(read)
                    read.advance()
                    if warp == 0:
                        if fill.count < loads:
                            self._load_unit(ring, fill, q0, tma_a, t_ga, t_sa, tma_b, t_gb,
                                            t_sb)
                            fill.advance()
            wtile = tile % WT
            chunk = tile // WT
            if lo == base:  # this CTA holds split 0: the running sum in registers
                self._fold_split(total, acc)
            else:  # a later split of a tile begun in another CTA: its partial to its slot
                self._store_partial(acc, ws, chunk, wtile, q - base, tid)
                for i in cutlass.range_constexpr(cute.size(acc)):
                    acc[i] = Float32(0.0)
            if q == hi - 1:
                if (lo == base) & (hi == base + S):
                    self._epilogue(total, coords, out, addend, tokens, wtile, chunk)
                else:
                    if lo == base:
                        self._store_partial(total, ws, chunk, wtile, 0, tid)
                    self._arrive_and_fold(total, coords, ws, counters, flag, out, addend,
                                          tokens, tile, wtile, chunk, hi - lo, units, ctas,
                                          tid)

    @cute.jit
    def _prologue(self, ring, fill, q0, loads, tma_a, t_ga, t_sa, tma_b, t_gb, t_sb):
        """The persistent form's first ``min(stages, loads)`` loads: the weights of each
        (their slots' full barriers armed for the whole stage), then ``griddepcontrol.wait``
        and ``launch_dependents``, then the tokens of each (the weights never depend on the
        stream's previous kernel; the tokens may). Returns ``fill`` advanced past them: the
        caller must rebind it (a state advanced inside this function's dynamic ``if`` is
        rebound here, not in the caller's object; the first GPU run, which dropped the
        return, found the steady-state loads restarting at slot 0: a hang without a
        producer warp, a launch failure with one)."""
        tok = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        for i in cutlass.range_constexpr(self.stages):
            if i < loads:
                ring.producer_acquire(fill)
                wtile, _, stage = self._unit_stage(q0, fill.count)
                cute.copy(tma_a, t_ga[(None, wtile, stage)], t_sa[(None, fill.index)],
                          tma_bar_ptr=ring.producer_get_barrier(fill))
                fill.advance()
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        for i in cutlass.range_constexpr(self.stages):
            if i < loads:
                _, chunk, stage = self._unit_stage(q0, tok.count)
                cute.copy(tma_b, t_gb[(None, chunk, stage)], t_sb[(None, tok.index)],
                          tma_bar_ptr=ring.producer_get_barrier(tok))
                ring.producer_commit(tok)
                tok.advance()
        return fill

    @cute.jit
    def _unit_stage(self, q0, count):
        """(weight tile, token tile, k stage) of this CTA's load ``count`` in the persistent
        form: unit ``q0 + count // KS``, its ``count % KS``-th stage of its split."""
        KS: cutlass.Constexpr = self.split_tiles
        S: cutlass.Constexpr = self.splits
        q = q0 + count // KS
        tile = q // S
        return tile % self.tiles, tile // self.tiles, (q - tile * S) * KS + count % KS

    @cute.jit
    def _load_unit(self, ring, fill, q0, tma_a, t_ga, t_sa, tma_b, t_gb, t_sb):
        """The persistent form: one thread's TMA copies of this CTA's load ``fill.count``
        (unit ``q0 + count // KS``, its ``count % KS``-th stage) into slot ``fill.index``."""
        wtile, chunk, stage = self._unit_stage(q0, fill.count)
        ring.producer_acquire(fill)
        bar = ring.producer_get_barrier(fill)
        cute.copy(tma_a, t_ga[(None, wtile, stage)], t_sa[(None, fill.index)], tma_bar_ptr=bar)
        cute.copy(tma_b, t_gb[(None, chunk, stage)], t_sb[(None, fill.index)], tma_bar_ptr=bar)
        ring.producer_commit(fill)

    @cute.jit
    def _store_partial(self, values, ws: Int64, chunk, wtile, slot, tid):
        """This thread's FP32 ``values`` to slot ``slot`` of (``chunk``, ``wtile``) in the
        workspace (``workspace_offset``)."""
        for j in cutlass.range_constexpr(cute.size(values) // 4):
            p.stg_v4(ws + Int64(self.workspace_offset(chunk, wtile, slot, j, tid)),
                     [h.bits(values[4 * j + i]) for i in range(4)])

    @cute.jit
    def _arrive_and_fold(self, total, coords, ws: Int64, counters: Int64, flag, out: Int64,
                         addend: Int64, tokens: Int32, tile, wtile, chunk, count, units,
                         ctas, tid):
        """The persistent form's hand-off: this CTA's ``count`` splits of ``tile`` are in
        the workspace; the CTA whose arrival completes the tile's ``splits`` re-arms its
        counter, folds slot 0 (the running sum of the splits the first CTA folded,
        ``tiled_layout.prefix_end``) and then each later split in order, and stores the
        outputs. Only the MMA warps take part (named barrier 1)."""
        S: cutlass.Constexpr = self.splits
        PIECES: cutlass.Constexpr = cute.size(total) // 4
        fence_gpu()
        cute.arch.barrier(barrier_id=1, number_of_threads=THREADS)
        if tid == 0:
            fence_gpu()
            counter = counters + Int64(tile) * 4
            old = p.atomic_add(counter, count)
            last = Int32(0)
            if old + count == S:
                last = Int32(1)
                p.stg_i32(counter, 0)
            p.sts_i32(flag, last)
        cute.arch.barrier(barrier_id=1, number_of_threads=THREADS)
        last = p.lds_i32(flag)
        cute.arch.barrier(barrier_id=1, number_of_threads=THREADS)  # the flag's next write
        if last != 0:
            fence_gpu()
            first = prefix_end(tile, S, ctas, units, minimum=cutlass.min)
            for j in cutlass.range_constexpr(PIECES):
                got = ld_cg_v4(ws + Int64(self.workspace_offset(chunk, wtile, 0, j, tid)))
                for i in cutlass.range_constexpr(4):
                    total[4 * j + i] = h.from_bits(got[i])
            for sp in cutlass.range(first, S, unroll=1):
                for j in cutlass.range_constexpr(PIECES):
                    got = ld_cg_v4(ws + Int64(self.workspace_offset(chunk, wtile, sp, j, tid)))
                    for i in cutlass.range_constexpr(4):
                        total[4 * j + i] = h.fadd(total[4 * j + i], h.from_bits(got[i]))
            self._epilogue(total, coords, out, addend, tokens, wtile, chunk)

    @cute.jit
    def _mma_with_loads(self, ring, fill, read, first, tiled_mma, acc, total, frag_a, frag_b,
                        warp, tma_a, t_ga, t_sa, tma_b, t_gb, t_sb):
        """The main loop without a producer warp: warp 0 fills the ring ``stages`` ahead and
        refills each slot after the stage in it; every stage's MMAs waited for before its
        slot is released; the serial form's splits folded in order."""
        STAGES: cutlass.Constexpr = self.stages
        KT: cutlass.Constexpr = self.cta_tiles
        SPLITS: cutlass.Constexpr = self.cta_splits
        KS: cutlass.Constexpr = self.split_tiles
        if warp == 0:
            for _ in cutlass.range_constexpr(self.prologue):
                self._load(ring, fill, first, tma_a, t_ga, t_sa, tma_b, t_gb, t_sb)
                fill.advance()
        for s in cutlass.range(SPLITS, unroll=1):
            for kt in cutlass.range(KS, unroll=1):
                ring.consumer_wait(read)
                self._stage(tiled_mma, acc, frag_a, frag_b, read.index)
                ring.consumer_release(read)
                read.advance()
                if warp == 0:
                    if fill.count < KT:
                        self._load(ring, fill, first, tma_a, t_ga, t_sa, tma_b, t_gb, t_sb)
                        fill.advance()
            if cutlass.const_expr(not self.cross):
                self._fold_split(total, acc)

    @cute.jit
    def _fold_split(self, total, acc):
        """The serial form: a split's partial into the running sum (``add.rn``, in split
        order), and the accumulators back to ``+0.0`` for the next split's chain."""
        for i in cutlass.range_constexpr(cute.size(total)):
            total[i] = h.fadd(total[i], acc[i])
            acc[i] = Float32(0.0)

    @cute.jit
    def _mma_overlapped(self, ring, read, tiled_mma, acc, total, frag_a, frag_b):
        """The MMA warps' main loop beside a producer warp: each stage's MMAs issued while
        the previous stage's are in flight (``wgmma.wait_group 1``), the previous slot
        released then; at a split's end every MMA waited for (``wait_group 0``) and, in the
        serial form, the split folded into the running sum in order. The accumulator chain
        is the same (each MMA adds into the previous one's result): the same bits."""
        SPLITS: cutlass.Constexpr = self.cta_splits
        done = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        for s in cutlass.range(SPLITS, unroll=1):
            read, done = self._split_overlapped(ring, read, done, tiled_mma, acc, frag_a, frag_b)
            if cutlass.const_expr(not self.cross):
                self._fold_split(total, acc)

    @cute.jit
    def _split_overlapped(self, ring, read, done, tiled_mma, acc, frag_a, frag_b):
        """One split's stages beside a producer warp: each stage's MMAs issued while the
        previous stage's are in flight (``wgmma.wait_group 1``), the previous slot released
        then (``done``); at the split's end every MMA waited for and its last slot released.
        Returns ``(read, done)`` advanced past the split: the caller rebinds both
        (``tools/pipeline_state_lint.py``)."""
        for kt in cutlass.range(self.split_tiles, unroll=1):
            ring.consumer_wait(read)
            warpgroup.fence()
            for kb in cutlass.range_constexpr(STAGE_K // 16):
                cute.gemm(tiled_mma, acc, frag_a[(None, None, kb, read.index)],
                          frag_b[(None, None, kb, read.index)], acc)
            warpgroup.commit_group()
            warpgroup.wait_group(1)
            if kt > 0:  # the previous stage's MMAs are done with its slot
                ring.consumer_release(done)
                done.advance()
            read.advance()
        warpgroup.wait_group(0)
        ring.consumer_release(done)
        done.advance()
        return read, done

    def workspace_offset(self, chunk, tile, split, piece, tid):
        """Byte offset of thread ``tid``'s accumulators ``4 piece .. 4 piece + 3`` of
        ``split``'s partial of (``chunk``, ``tile``) in the cross form's workspace: per
        (chunk, tile, split) one block of ``128 x tile_tokens`` FP32, piece-major (each
        piece's 256 threads store 4 KiB in a row)."""
        pieces = TILE_ROWS * self.tile_tokens // (4 * THREADS)
        block = (chunk * self.tiles + tile) * self.splits + split
        return ((block * pieces + piece) * THREADS + tid) * 16

    @cute.jit
    def _fold_if_last(self, acc, total, coords, ws: Int64, counters: Int64, flag, out: Int64,
                      addend: Int64, tokens: Int32, tile, chunk, split, tid, warp):
        """The cross form's reduction and epilogue: this CTA's partial to the workspace; the
        last CTA of (``chunk``, ``tile``) to arrive re-arms its counter, folds the
        ``splits`` partials in split order into ``total`` (``p_0``, then ``+ p_s``,
        ``add.rn``) and stores the outputs (the MMA warps; a producer warp only takes part
        in the CTA barriers)."""
        PIECES: cutlass.Constexpr = cute.size(acc) // 4
        if warp < _MMA_WARPS:
            self._store_partial(acc, ws, chunk, tile, split, tid)
        fence_gpu()
        cute.arch.sync_threads()
        if tid == 0:
            fence_gpu()
            counter = counters + Int64(chunk * self.tiles + tile) * 4
            old = p.atomic_add(counter, 1)
            last = Int32(0)
            if old == self.splits - 1:
                last = Int32(1)
                p.stg_i32(counter, 0)
            p.sts_i32(flag, last)
        cute.arch.sync_threads()
        if (p.lds_i32(flag) != 0) & (warp < _MMA_WARPS):
            fence_gpu()
            for sp in cutlass.range(self.splits, unroll=1):
                for j in cutlass.range_constexpr(PIECES):
                    got = ld_cg_v4(ws + Int64(self.workspace_offset(chunk, tile, sp, j, tid)))
                    for i in cutlass.range_constexpr(4):
                        part = h.from_bits(got[i])
                        # split 0 starts the sum (p_0 itself: -0.0 + p_0 is p_0)
                        total[4 * j + i] = cutlass.select_(sp == 0, part,
                                                           h.fadd(total[4 * j + i], part))
            self._epilogue(total, coords, out, addend, tokens, tile, chunk)

    def _cta_state(self, tiled_mma, tma_a, g_a, a_tiles, tma_b, g_b, b_tiles, a_smem, b_smem,
                   tid, warp, place=None):
        """A CTA's shared memory and registers (both grid forms; traced inline): the ring's
        barriers and slots (``stages`` slots of weights and tokens, each slot's full barrier
        taking one arrival, the TMA thread's, plus the transaction bytes, its empty barrier
        one arrival per MMA warp of each CTA the slot's copies feed: in a cluster, ``place``
        (:meth:`_cluster_place`), also its partners'), the multicast masks of a clustered
        CTA's two copies, the flag of the fold, the TMA partitions of the weights
        and tokens by (tile, k stage) (``a_tiles``, ``b_tiles``: the tile coordinates,
        ``(tile, None)`` for one tile or ``(None, None)`` for all, the modes left to index), this warpgroup's MMA operands (the warpgroup's slice: wgmma reads them by
        descriptor), this thread's accumulators (``+0.0``; every step adds into them, as
        ``SplitKGemmKernel``'s chains do: the same bits, signed zeros included), its running
        sum (``-0.0``) and the tile coordinates (row, token) of each."""
        # the ring's full and empty barriers, and the fold's flag (annotations given as
        # objects: this module's annotations are strings)
        storage_type = cute.struct(type("Storage", (), {"__annotations__": {
            "bars": cute.struct.MemRange[cutlass.Int64, 2 * self.stages],
            "last": cute.struct.MemRange[cutlass.Int32, 4]}}))
        smem = SmemAllocator()
        storage = smem.allocate(storage_type)
        s_a = smem.allocate_tensor(element_type=BFloat16, layout=a_smem.outer,
                                   byte_alignment=1024, swizzle=a_smem.inner)
        s_b = smem.allocate_tensor(element_type=BFloat16, layout=b_smem.outer,
                                   byte_alignment=1024, swizzle=b_smem.inner)
        tx = (cute.size_in_bytes(BFloat16, cute.slice_(a_smem, (None, None, 0)))
              + cute.size_in_bytes(BFloat16, cute.slice_(b_smem, (None, None, 0))))
        # a cluster: every slot's empty barrier takes one arrival per MMA warp of each CTA
        # its copies feed (its own, the other token tiles of its weight tile and the other
        # weight tiles of its token tile), each full barrier the whole stage's bytes from
        # the slices' senders; the barriers of every CTA are initialized before any CTA
        # copies (the pipeline's cluster sync)
        cm, cn = self.cluster
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.bars.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     _MMA_WARPS * (cm + cn - 1)),
            tx_count=tx, cta_layout_vmnk=cute.make_layout((1, cm, cn, 1)))
        g_a_tiles = cute.local_tile(g_a, (TILE_ROWS, STAGE_K), a_tiles)
        g_b_tiles = cute.local_tile(g_b, (self.tile_tokens, STAGE_K), b_tiles)
        # each CTA's slice of the weight stage (1/cn) and of the token stage (1/cm)
        a_place, b_place, masks = (0, cute.make_layout(1)), (0, cute.make_layout(1)), None
        if cutlass.const_expr(place is not None):
            layout, coord = place
            a_place, b_place = (coord[1], cute.make_layout(cn)), (coord[0], cute.make_layout(cm))
            masks = (cute.make_layout_image_mask(layout, coord, mode=1) if cn > 1 else 0,
                     cute.make_layout_image_mask(layout, coord, mode=0) if cm > 1 else 0)
        t_sa, t_ga = cpasync.tma_partition(tma_a, *a_place, cute.group_modes(s_a, 0, 2),
                                           cute.group_modes(g_a_tiles, 0, 2))
        t_sb, t_gb = cpasync.tma_partition(tma_b, *b_place, cute.group_modes(s_b, 0, 2),
                                           cute.group_modes(g_b_tiles, 0, 2))
        wg_mma = tiled_mma.get_slice((warp // 4) * 128)
        frag_a = tiled_mma.make_fragment_A(wg_mma.partition_A(s_a))
        frag_b = tiled_mma.make_fragment_B(wg_mma.partition_B(s_b))
        coords = self.thread_coordinates(tiled_mma, tid)
        acc = cute.make_rmem_tensor(coords.shape, Float32)
        total = cute.make_rmem_tensor(coords.shape, Float32)
        for i in range(cute.size(total)):  # traced inline: a Python loop, unrolled
            total[i] = Float32(-0.0)
            acc[i] = Float32(0.0)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        return SimpleNamespace(storage=storage, ring=ring, t_sa=t_sa, t_ga=t_ga, t_sb=t_sb,
                               t_gb=t_gb, frag_a=frag_a, frag_b=frag_b, coords=coords, acc=acc,
                               total=total, masks=masks)

    def thread_coordinates(self, tiled_mma, tid):
        """The (weight row, token) of the CTA tile that each of thread ``tid``'s
        accumulators stands for, in register order (the C partition of the thread's own
        slice; the operands are partitioned by the warpgroup's): what the epilogue stores
        by (``tests/test_gemm_tiled.py`` traces that the 256 threads cover the tile once)."""
        return tiled_mma.get_slice(tid).partition_C(
            cute.make_identity_tensor((TILE_ROWS, self.tile_tokens)))

    @cute.jit
    def _load(self, ring, fill, first, tma_a, t_ga, t_sa, tma_b, t_gb, t_sb, masks=None):
        """One thread's TMA copies of k stage ``first + fill.count`` into slot
        ``fill.index``, on the slot's full barrier (after its empty barrier). In a cluster
        (``masks``: the multicast masks of ``_cta_state``) each copy is this CTA's slice of
        the stage, multicast to the cluster's CTAs of its weight tile (the weights) or of its
        token tile (the tokens); each CTA's full barrier counts the whole stage's bytes, from
        every slice's sender (the cross form's partners share the split: the same k stages)."""
        cm, cn = self.cluster
        a_mask = dict(mcast_mask=masks[0]) if cutlass.const_expr(cn > 1) else {}
        b_mask = dict(mcast_mask=masks[1]) if cutlass.const_expr(cm > 1) else {}
        ring.producer_acquire(fill)
        bar = ring.producer_get_barrier(fill)
        stage = first + fill.count
        cute.copy(tma_a, t_ga[(None, stage)], t_sa[(None, fill.index)], tma_bar_ptr=bar,
                  **a_mask)
        cute.copy(tma_b, t_gb[(None, stage)], t_sb[(None, fill.index)], tma_bar_ptr=bar,
                  **b_mask)
        ring.producer_commit(fill)

    @cute.jit
    def _stage(self, tiled_mma, acc, frag_a, frag_b, slot):
        """The four ``wgmma k16`` steps of one stage in k order, each adding into the
        accumulators, waited for before the slot is released."""
        warpgroup.fence()
        for kb in cutlass.range_constexpr(STAGE_K // 16):
            cute.gemm(tiled_mma, acc, frag_a[(None, None, kb, slot)],
                      frag_b[(None, None, kb, slot)], acc)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

    @cute.jit
    def _epilogue(self, total, coords, out: Int64, addend: Int64, tokens: Int32, tile, chunk):
        """Addend, rounding and the predicated stores of ``out[t, n]`` for ``t < T`` and
        ``n < width`` (row stride ``width``)."""
        WIDTH: cutlass.Constexpr = self.width
        for i in cutlass.range_constexpr(cute.size(total)):
            m, t = coords[i]
            col = tile * TILE_ROWS + m
            tok = chunk * self.tile_tokens + t
            live = cutlass.select_((col < WIDTH) & (tok < tokens), Int32(1), Int32(0))
            at = Int64(cutlass.min(tok, tokens - 1)) * WIDTH + cutlass.min(col, WIDTH - 1)
            v = total[i]
            if cutlass.const_expr(self.addend == "bf16"):
                v = h.fadd(v, h.bf16_lo(ld_u16(addend + at * 2)))
            if cutlass.const_expr(self.addend == "f32"):
                v = h.fadd(v, ld_f32(addend + at * 4))
            if cutlass.const_expr(self.out_f32):
                stg_f32_if(out + at * 4, v, live)
            else:
                stg_u16_if(out + at * 2, p.f32_to_bf16_bits(v), live)
