"""The CuTe DSL kernel of the split-K swap-AB GEMM (``fast.gemm``; byte layout in
``fast.gemm.layout``).

The kernel takes raw device addresses (``Int64``) and run-time sizes (``Int32``): N, K, the
token count, the number of K splits and the output/addend kinds are run-time values, and
only the CTA shape, the window count, the ring and the stage width are compile-time
constants of a kernel object, so one compile serves every GEMM of the layer at one tactic
shape.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32
from cutlass.cute.nvgpu import warpgroup

from fast.device import fp32 as h
from fast.device import ptx as p
from fast.gemm import layout as lay

__all__ = ["SplitKGemmKernel", "GroupedSplitKGemmKernel", "FLAG_F32_OUT", "FLAG_ADD_BF16", "FLAG_ADD_F32",
           "ld_cg_v4", "ld_u16", "ld_f32", "stg_u16_if", "stg_f32_if", "fence_gpu"]

#: ``flags`` bits of a launch: FP32 output (else BF16), a BF16 or an FP32 addend.
FLAG_F32_OUT, FLAG_ADD_BF16, FLAG_ADD_F32 = 1, 2, 4


def _asm(code, outs, ins):
    return cute.arch.inline_ptx(code, write_only_types=outs, read_only_args=ins)


def ld_cg_v4(address):
    """Four words another CTA of this launch wrote, read through L2 (``ld.global.cg.v4``:
    not the non-coherent path, not L1)."""
    return _asm("ld.global.cg.v4.u32 { {$w0}, {$w1}, {$w2}, {$w3} }, [{$r0}];",
                [Uint32] * 4, [Int64(address)])


def ld_u16(address):
    """A zero-extended coherent 16-bit load (``ld.global.u16``: the addend may be the
    output itself)."""
    return _asm("{ .reg .b16 t; ld.global.u16 t, [{$r0}]; cvt.u32.u16 {$w0}, t; }",
                [Uint32], [Int64(address)])


def ld_f32(address):
    """A coherent FP32 load (``ld.global.f32``)."""
    return _asm("ld.global.f32 {$w0}, [{$r0}];", [Float32], [Int64(address)])


def stg_u16_if(address, value, live):
    """Store the low 16 bits of ``value`` when ``live`` (Int32) is non-zero: one predicated
    ``st.global.u16``, no branch."""
    _asm("{ .reg .pred p; .reg .b16 t; setp.ne.s32 p, {$r2}, 0; cvt.u16.u32 t, {$r1}; "
         "@p st.global.u16 [{$r0}], t; }", [], [Int64(address), Uint32(value), Int32(live)])


def stg_f32_if(address, value, live):
    """Store ``value`` when ``live`` (Int32) is non-zero (predicated ``st.global.f32``)."""
    _asm("{ .reg .pred p; setp.ne.s32 p, {$r2}, 0; @p st.global.f32 [{$r0}], {$r1}; }", [],
         [Int64(address), Float32(value), Int32(live)])


def fence_gpu():
    """``fence.acq_rel.gpu``: this thread's earlier writes before its later accesses, for
    every thread of the GPU (``__threadfence``)."""
    _asm("fence.acq_rel.gpu;", [], [])


class SplitKGemmKernel:
    """``out[t, n] = sum_k x[t, k] W[n, k] (+ addend[t, n])`` for ``8 (windows - 1) < T <=
    8 windows`` tokens: BF16 operands, FP32 accumulation, FP32 or BF16 (RNE) output.

    Grid: one CTA per (tile of ``16 * warps * mtiles`` weight rows, K split), split-major
    (``block = split * tiles + tile``); the host launches ``tiles * splits`` CTAs, at most
    one wave for the layer's shapes.

    Algorithm of CTA (tile, split s) over ``k in [s K/S, (s+1) K/S)``:

    1. each lane computes the global addresses of its weight pieces (``layout.a_source``:
       per m-tile rows ``g`` and ``g + 8``, 16 bytes at ``8q``) and each thread the offsets
       of its token pieces (``layout.b_offset``; tokens past ``T`` in the last window are
       zero-filled);
    2. main loop over the split's stages of ``stage_k`` k: ``cp.async.cg`` copies of the
       weights (each lane's own pieces) and tokens into a ring of ``ring`` slots, ``ring - 1``
       stages ahead; one barrier per stage. The prologue copies the weights of the first
       ``ring - 1`` stages, then ``griddepcontrol.wait`` (with programmatic dependent launch,
       the CTA may start while the stream's previous kernel finishes: nothing that kernel
       writes is read or written before the wait), ``griddepcontrol.launch_dependents``, then
       the tokens of those stages; per sub-chunk of 32 k and MMA step j = 0, 1, for
       every (m-tile, window) one ``mma.m16n8k16`` adding 16 exact products into that
       (m-tile, window)'s FP32 accumulators, step-major over the independent accumulators
       (no accumulator's MMAs back to back). The window count is a compile-time constant
       (one kernel per ``ceil(T / 8)``): no branch in the loop;
    3. ``S = 1``: the epilogue. ``S > 1``: the split's accumulators go to the workspace in
       fragment order (``layout.ws_offset``), every thread fences, thread 0 increments the
       tile's counter; the CTA that finds ``S - 1`` (the last to finish, whichever split it
       is) re-arms the counter to 0, fences, reads the S partials back through L2 (all
       loads of a split in flight together) and sums them **in split order** ``acc = p_0;
       acc = acc + p_s`` (``add.rn.f32``), then the epilogue;
    4. epilogue: with an addend, every ``addend[t, n]`` loaded first (rows past ``T``
       clamped to ``T - 1``, never used), ``v = add.rn(acc, addend)`` (a BF16 addend
       converted exactly); then FP32 out or one ``cvt.rn.bf16.f32``, stored by predicated
       stores for ``t < T`` (no branch).

    Summation order of an output (what ``verify.bounds.mma_matmul_bound`` covers): per
    split, the MMA steps in k order from the split's first k, each adding 16 exact
    products; the splits' partials in split order; the addend last. Nothing in it depends on
    the other tokens of the call, on the tile shape, the window count, the ring, the stage
    width or which CTA reduces: only ``splits`` changes bits.

    **Token chunks and padded rows** (``chunked``, a compile-time parameter: the kernels
    without it are the single-chunk ones, their code as before). The grid's second
    dimension is the token chunk (``layout.token_chunks``): CTA (tile, split, chunk ``c``)
    runs the algorithm above on the rows ``[8 windows c, min(T, 8 windows (c + 1)))`` of
    ``x``, ``out`` and the addend (their row stride: ``width`` output columns, ``K``
    inputs), with chunk ``c``'s slice of the workspace (``layout.chunk_workspace_bytes``)
    and of the tile counters (``tiles`` per chunk). ``N`` is then the padded weight rows
    (``layout.padded_rows``: zero rows after the last) and ``width <= N`` the output's
    columns: only columns ``< width`` are stored, and addend loads of the padding columns
    are clamped to column ``width - 1`` (never used). A token's sums are the same in any
    chunk: still only ``splits`` changes bits.

    **Serial splits** (``serial``, a compile-time parameter; the kernels without it keep
    their code). The grid has one CTA per tile (and chunk), not per (tile, split): the CTA
    runs every split of K itself, one after another through one pipeline over all of K, and
    keeps a second set of accumulators, the running sum. At the end of split ``s`` (a
    stage boundary: ``K / splits`` is a multiple of ``stage_k``) it folds the split's
    accumulators into the running sum, ``sum = p_0`` for ``s = 0`` and ``sum = sum + p_s``
    (``add.rn.f32``) after, and zeroes them for split ``s + 1``; then the epilogue on the
    sum. Each ``p_s`` is the MMA chain a split CTA computes (the same steps in k order from
    the split's first k, from zero) and the fold is the last CTA's reduction, in the same
    order, so the bits equal the cross-CTA form's at the same ``splits``; what changes is
    the work: no workspace, no tile counter, ``splits`` times fewer CTAs, each streaming all
    of K (the form for calls with many token chunks, where the cross-CTA form writes and
    reads back ``splits`` FP32 partials of every output).

    **Overlap** (``overlap``, a compile-time parameter of the ``wgmma`` kernels; those
    without it keep their code). A stage's warpgroup MMAs stay in flight while the next
    stage's copies are waited for and issued: each stage waits only for the previous
    stage's group (``wait_group 1``), and the copies run ``ring - 2`` stages ahead instead
    of ``ring - 1``, so the slot refilled at stage ``s`` is that of stage ``s - 2``, whose
    MMAs every warp has waited for before the stage's barrier. The accumulators are read
    only after a ``wait_group 0`` (after the loop, and before each serial split's fold).
    The MMAs and their order are the same: the same bits as the kernel without it.

    **Wide chunks** (``wgmma`` kernels of 9..16 windows, ``Tactic.chunk_windows = 16``): the
    code above at a larger compile-time window count, one ``m64n(8 windows)k16`` per m-tile
    and 16 k up to ``m64n128k16``; the windows' accumulators are laid out per window as at 8
    windows, so the epilogue, the workspace and the folds are unchanged.

    Constraints (checked by the host, ``fast.gemm.DenseGemm``): ``N % tile_rows == 0``,
    ``K % (splits * stage_k) == 0``, ``8 (windows - 1) < T <= 8 windows`` (chunked: per
    chunk, as ``layout.token_chunks`` cuts them; at most 16 windows on ``wgmma``, else 8), at most ``layout.MAX_ACCUMULATORS``
    (m-tile, window) tiles per warp, contiguous 16-byte aligned operands.

    Run: ``python -m pytest verify/test_gemm_fast.py -k fast`` (on an SM90/SM100 GPU).
    """

    def __init__(self, *, warps: int = 4, mtiles: int = 2, windows: int = 1, ring: int = 4,
                 stage_k: int = 64, occupancy: int = 2, wgmma: bool = False,
                 chunked: bool = False, serial: bool = False, overlap: bool = False):
        top = lay.MAX_WIDE_WINDOWS if wgmma else lay.MAX_WINDOWS  # wide chunks: wgmma only
        if warps not in (1, 2, 4, 8) or mtiles not in (1, 2, 4) or not 1 <= windows <= top:
            raise ValueError(f"SplitKGemmKernel: warps {warps}, mtiles {mtiles}, windows "
                             f"{windows} not supported (at most {top} windows)")
        if stage_k not in (64, 128) or not 2 <= ring <= 12:
            raise ValueError(f"SplitKGemmKernel: stage_k {stage_k} / ring {ring} not supported")
        if wgmma and warps not in (4, 8):
            raise ValueError(f"SplitKGemmKernel: wgmma needs warps 4 or 8, got {warps}")
        if overlap and (not wgmma or ring < 3):
            raise ValueError(f"SplitKGemmKernel: overlap needs wgmma and a ring of at least 3 "
                             f"stages, got wgmma={wgmma}, ring={ring}")
        #: warpgroup MMA with both operands in the slot (``layout.a_offset_wgmma``)
        self.wgmma = bool(wgmma)
        #: token chunks on the grid's second dimension and padded rows (class docstring)
        self.chunked = bool(chunked)
        #: every K split in this CTA, one after another (class docstring, "Serial splits")
        self.serial = bool(serial)
        #: one stage's warpgroup MMAs left in flight (class docstring, "Overlap")
        self.overlap = bool(overlap)
        #: stages copied ahead of the one computed: ``ring - 1``, one fewer with ``overlap``
        #: (the slot refilled is then two stages back, whose MMAs have completed)
        self.ahead = ring - 2 if self.overlap else ring - 1
        self.warps, self.mtiles, self.windows = warps, mtiles, windows
        self.ring, self.stage_k, self.occupancy = ring, stage_k, occupancy
        self.threads = 32 * warps
        self.tile_rows = 16 * warps * mtiles
        self.subs = stage_k // lay.SUB_K
        self.pieces = stage_k // 8  # 16-byte pieces of one row per stage
        self.a_bytes = self.tile_rows * stage_k * 2
        self.slot_bytes = lay.slot_bytes(self.tile_rows, windows, stage_k)
        self.smem_bytes = ring * self.slot_bytes
        self.granules = lay.WINDOW * windows * self.pieces  # token pieces per stage
        self.copies = -(-self.granules // self.threads)

    @classmethod
    def compile_args(cls, **params):
        """(kernel, fake arguments but the stream) for ``fast.device.compile.compiled``."""
        return cls(**params), [Int64(0)] * 6 + [Int32(1)] * 9

    @cute.jit
    def __call__(self, w: Int64, x: Int64, out: Int64, addend: Int64, ws: Int64,
                 counters: Int64, n: Int32, k: Int32, tokens: Int32, splits: Int32,
                 flags: Int32, grid: Int32, chunks: Int32, width: Int32, pdl: Int32, stream):
        """Launch ``grid`` (tiles x splits) by ``chunks`` CTAs (``chunks`` is 1 for a
        kernel that is not ``chunked``); ``width``: the output's columns (``n`` for a kernel
        that is not ``chunked``, which does not read it)."""
        self.kernel(w, x, out, addend, ws, counters, n, k, tokens, splits, flags, width).launch(
            grid=(grid, chunks, 1), block=(self.threads, 1, 1), stream=stream,
            smem=self.smem_bytes, min_blocks_per_mp=self.occupancy, preferred_smem_carveout=100,
            use_pdl=pdl)

    @cute.kernel
    def kernel(self, w: Int64, x: Int64, out: Int64, addend: Int64, ws: Int64, counters: Int64,
               n: Int32, k: Int32, tokens: Int32, splits: Int32, flags: Int32, width: Int32):
        self._cta(w, x, out, addend, ws, counters, n, k, tokens, splits, flags, width,
                  cute.arch.block_idx()[0])

    @cute.jit
    def _cta(self, w: Int64, x: Int64, out: Int64, addend: Int64, ws: Int64, counters: Int64,
             n: Int32, k: Int32, tokens: Int32, splits: Int32, flags: Int32, width: Int32,
             block: Int32):
        """The algorithm of the class docstring for the CTA of index ``block`` (split-major
        over (tile, split)) of the GEMM these arguments describe."""
        tid = cute.arch.thread_idx()[0]
        lane = tid % 32
        warp = tid // 32
        MT: cutlass.Constexpr = self.mtiles
        W: cutlass.Constexpr = self.windows
        SUBS: cutlass.Constexpr = self.subs
        RING: cutlass.Constexpr = self.ring
        TILE: cutlass.Constexpr = self.tile_rows
        SLOT: cutlass.Constexpr = self.slot_bytes
        threads: cutlass.Constexpr = self.threads

        # the wgmma tactic's swizzle atoms need 1024-byte alignment (every slot and operand
        # block is a multiple of 1024 bytes)
        ring = cute.arch.get_dyn_smem(cutlass.Uint8,
                                      alignment=1024 if self.wgmma else 128).toint()
        flag = cute.arch.alloc_smem(Int32, 4, alignment=16).toint()

        tiles = n // TILE
        tile = block % tiles
        split = block // tiles
        if cutlass.const_expr(self.chunked):
            # this CTA's token chunk: rows [row0, row0 + 8 W) of x, out and the addend (row
            # strides K and width), its slices of the workspace and of the tile counters
            chunk = cute.arch.block_idx()[1]
            row0 = lay.chunk_first_row(chunk, W)
            tokens = cutlass.min(tokens - row0, lay.WINDOW * W)
            x = x + Int64(row0) * Int64(k) * 2
            out_bytes = cutlass.select_((flags & FLAG_F32_OUT) != 0, Int32(4), Int32(2))
            out = out + Int64(row0) * Int64(width) * Int64(out_bytes)
            add_bytes = cutlass.select_((flags & FLAG_ADD_F32) != 0, Int32(4), Int32(2))
            addend = addend + Int64(row0) * Int64(width) * Int64(add_bytes)
            ws = ws + lay.chunk_workspace_offset(Int64(chunk), Int64(splits), Int64(n), W)
            counters = counters + Int64(lay.chunk_counter(chunk, tiles, 0)) * 4
        kc = k // splits
        k0 = split * kc
        stages = kc // self.stage_k
        per_split = stages  # stages of one split
        if cutlass.const_expr(self.serial):
            # one CTA per tile (and chunk): every split, from k = 0, one after another
            k0 = Int32(0)
            stages = k // self.stage_k
        row_bytes = Int64(k) * 2

        # 1. this lane's weight pieces (stage 0, sub-chunk 0), per (m-tile, half)
        abase = w + Int64(tile * TILE) * row_bytes + Int64(k0) * 2
        asrc = []
        for mt in cutlass.range_constexpr(MT):
            for half in cutlass.range_constexpr(2):
                row, kk = lay.a_source(warp, mt, half, lane, MT)
                asrc.append(abase + Int64(row) * row_bytes + kk * 2)
        # this thread's token pieces: byte offset from x + k0 (-1: zero-fill, -2: none) and
        # slot offset
        xbase = x + Int64(k0) * 2
        src = cute.make_rmem_tensor((self.copies,), Int32)
        dst = cute.make_rmem_tensor((self.copies,), Int32)
        for i in cutlass.range_constexpr(self.copies):
            gid = tid + threads * i
            token = gid // self.pieces
            piece = gid % self.pieces
            if cutlass.const_expr(self.wgmma):
                dst[i] = lay.b_offset_wgmma(token, piece, SUBS, self.a_bytes, W)
            else:
                dst[i] = lay.b_offset(token, piece, SUBS, self.a_bytes)
            off = Int32(-2)
            if gid < self.granules:
                off = Int32(-1)
                if token < tokens:
                    off = (token * k + piece * 8) * 2
            src[i] = off

        acc = cute.make_rmem_tensor((MT * W * 4,), Float32)
        for i in cutlass.range_constexpr(MT * W * 4):
            acc[i] = Float32(0.0)
        if cutlass.const_expr(self.serial):
            # the running sum of the splits folded so far (written at the first fold)
            total = cute.make_rmem_tensor((MT * W * 4,), Float32)
            for i in cutlass.range_constexpr(MT * W * 4):
                total[i] = Float32(0.0)

        # 2. main loop. Prologue: the weights of the first ring - 1 stages (one group), then
        # (programmatic dependent launch) wait for the previous grid of the stream, whose
        # output x, the addend or out may be, and let the next grid launch; then the tokens
        # of those stages (one group each).
        AHEAD: cutlass.Constexpr = self.ahead
        for st in cutlass.range_constexpr(AHEAD):
            if st < stages:
                self._issue_a(asrc, ring + st * SLOT, st, warp, lane)
        cute.arch.cp_async_commit_group()
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        for st in cutlass.range_constexpr(AHEAD):
            if st < stages:
                self._issue_b(xbase, src, dst, ring + st * SLOT, st)
            cute.arch.cp_async_commit_group()
        for s in cutlass.range(stages, unroll=1):
            cute.arch.cp_async_wait_group(AHEAD - 1)
            if cutlass.const_expr(self.wgmma):
                # this thread's completed copies, visible to the wgmma reads (async proxy)
                cute.arch.fence_view_async_shared()
            # every thread's copies of stage s have landed, and every warp has passed its
            # wait for the MMAs of the stage whose slot is refilled next (s - 1; with
            # overlap s - 2)
            cute.arch.sync_threads()
            ahead = s + AHEAD
            if ahead < stages:
                self._issue(asrc, xbase, src, dst, ring + (ahead % RING) * SLOT, ahead, warp, lane)
            cute.arch.cp_async_commit_group()
            if cutlass.const_expr(self.wgmma):
                self._compute_wgmma(acc, ring + (s % RING) * SLOT, warp)
            else:
                self._compute(acc, ring + (s % RING) * SLOT, warp, lane)
            if cutlass.const_expr(self.serial):
                if (s + 1) % per_split == 0:
                    if cutlass.const_expr(self.overlap):
                        self._settle_wgmma(acc)  # the split's last MMAs, before the fold
                    # split (s + 1) / per_split - 1 is complete (its wgmma waited for in
                    # _compute_wgmma): fold it in split order, the reduction's
                    # ``acc = p_0; acc = acc + p_s`` (split 0 starts the sum: -0 stays -0),
                    # and start the next split's chain from zero
                    first = s + 1 == per_split
                    for i in cutlass.range_constexpr(MT * W * 4):
                        total[i] = cutlass.select_(first, acc[i], h.fadd(total[i], acc[i]))
                        acc[i] = Float32(0.0)
        cute.arch.cp_async_wait_group(0)
        if cutlass.const_expr(self.overlap):
            self._settle_wgmma(acc)  # the last stage's MMAs (a no-op wait after a fold)

        # 3. split-K: partials to the workspace, the last CTA of the tile reduces in order
        # (serial splits: the running sum is the reduced result)
        if cutlass.const_expr(self.serial):
            if cutlass.const_expr(self.chunked):
                self._epilogue(total, out, addend, width, tokens, flags, tile, warp, lane,
                               width=width)
            else:
                self._epilogue(total, out, addend, n, tokens, flags, tile, warp, lane)
        elif splits > 1:
            for mt in cutlass.range_constexpr(MT):
                for wn in cutlass.range_constexpr(W):
                    at = (mt * W + wn) * 4
                    p.stg_v4(ws + lay.ws_offset(Int64(split), tile, warp, mt, wn, lane, tiles,
                                                self.warps, MT, W),
                             [h.bits(acc[at + i]) for i in range(4)])
            fence_gpu()
            cute.arch.sync_threads()
            if tid == 0:
                fence_gpu()
                old = p.atomic_add(counters + Int64(tile) * 4, 1)
                last = Int32(0)
                if old == splits - 1:
                    last = Int32(1)
                    p.stg_i32(counters + Int64(tile) * 4, 0)
                p.sts_i32(flag, last)
            cute.arch.sync_threads()
            if p.lds_i32(flag) != 0:
                fence_gpu()
                for sp in cutlass.range(splits, unroll=1):
                    for mt in cutlass.range_constexpr(MT):  # one m-tile's loads in flight at once
                        got = [ld_cg_v4(ws + lay.ws_offset(Int64(sp), tile, warp, mt, wn, lane,
                                                           tiles, self.warps, MT, W))
                               for wn in range(W)]
                        for wn in cutlass.range_constexpr(W):
                            at = (mt * W + wn) * 4
                            for i in cutlass.range_constexpr(4):
                                part = h.from_bits(got[wn][i])
                                # split 0 starts the sum (acc = p_0, not 0 + p_0: -0 stays -0)
                                acc[at + i] = cutlass.select_(sp == 0, part,
                                                              h.fadd(acc[at + i], part))
                if cutlass.const_expr(self.chunked):
                    self._epilogue(acc, out, addend, width, tokens, flags, tile, warp, lane,
                                   width=width)
                else:
                    self._epilogue(acc, out, addend, n, tokens, flags, tile, warp, lane)
        else:
            if cutlass.const_expr(self.chunked):
                self._epilogue(acc, out, addend, width, tokens, flags, tile, warp, lane,
                               width=width)
            else:
                self._epilogue(acc, out, addend, n, tokens, flags, tile, warp, lane)

    # -- pieces -----------------------------------------------------------------------

    @cute.jit
    def _issue(self, asrc, xbase, src, dst, slot, stage, warp, lane):
        """``cp.async`` everything stage ``stage`` reads into ``slot``."""
        self._issue_b(xbase, src, dst, slot, stage)
        self._issue_a(asrc, slot, stage, warp, lane)

    @cute.jit
    def _issue_b(self, xbase, src, dst, slot, stage):
        """This thread's token pieces of stage ``stage``."""
        offset = Int64(stage) * (self.stage_k * 2)
        for i in cutlass.range_constexpr(self.copies):
            if cutlass.const_expr((i + 1) * self.threads <= self.granules):
                p.cp_async_16(slot + dst[i], xbase + Int64(cutlass.max(src[i], Int32(0))) + offset,
                              src[i] >= 0)
            else:
                if src[i] >= -1:
                    p.cp_async_16(slot + dst[i], xbase + Int64(cutlass.max(src[i], Int32(0))) + offset,
                                  src[i] >= 0)

    @cute.jit
    def _issue_a(self, asrc, slot, stage, warp, lane):
        """This lane's weight pieces of stage ``stage``."""
        MT: cutlass.Constexpr = self.mtiles
        SUBS: cutlass.Constexpr = self.subs
        offset = Int64(stage) * (self.stage_k * 2)
        for mt in cutlass.range_constexpr(MT):
            for half in cutlass.range_constexpr(2):
                for sub in cutlass.range_constexpr(SUBS):
                    if cutlass.const_expr(self.wgmma):
                        at = lay.a_offset_wgmma(warp, mt, sub, half, lane, MT, SUBS,
                                                self.tile_rows)
                    else:
                        at = lay.a_offset(warp, mt, sub, half, lane, MT, SUBS)
                    p.cp_async_16(slot + at, asrc[mt * 2 + half] + offset + sub * (lay.SUB_K * 2),
                                  True)

    @cute.jit
    def _mma(self, acc, a_words, b_words, j: int, mt: int, wn: int):
        W: cutlass.Constexpr = self.windows
        lo, hi = a_words
        at = (mt * W + wn) * 4
        a_regs, b_regs = lay.mma_operands(lo, hi, b_words, j)
        d = p.mma_bf16(a_regs, b_regs, [acc[at + i] for i in range(4)])
        for i in cutlass.range_constexpr(4):
            acc[at + i] = d[i]

    @cute.jit
    def _compute(self, acc, slot, warp, lane):
        """One stage from ``slot``: per sub-chunk, the A words of every m-tile (two 16-byte
        loads each) and the B words of every window, then MMA steps 0 and 1 over (m-tile,
        window): step-major over all of them for up to 2 m-tiles; window by window (B words
        loaded per window, fewer live registers) for 4 m-tiles, where the 4 m-tiles already
        separate an accumulator's two steps."""
        MT: cutlass.Constexpr = self.mtiles
        W: cutlass.Constexpr = self.windows
        SUBS: cutlass.Constexpr = self.subs
        for sub in cutlass.range_constexpr(SUBS):
            a = []
            for mt in cutlass.range_constexpr(MT):
                a.append((p.lds_v4(slot + lay.a_offset(warp, mt, sub, 0, lane, MT, SUBS)),
                          p.lds_v4(slot + lay.a_offset(warp, mt, sub, 1, lane, MT, SUBS))))
            if cutlass.const_expr(MT >= 4):
                for wn in cutlass.range_constexpr(W):
                    b = p.lds_v4(slot + lay.b_read_offset(wn, sub, lane, SUBS, self.a_bytes))
                    for j in cutlass.range_constexpr(2):
                        for mt in cutlass.range_constexpr(MT):
                            self._mma(acc, a[mt], b, j, mt, wn)
            else:
                b = [p.lds_v4(slot + lay.b_read_offset(wn, sub, lane, SUBS, self.a_bytes))
                     for wn in range(W)]
                for j in cutlass.range_constexpr(2):
                    for mt in cutlass.range_constexpr(MT):
                        for wn in cutlass.range_constexpr(W):
                            self._mma(acc, a[mt], b[wn], j, mt, wn)

    @cute.jit
    def _compute_wgmma(self, acc, slot, warp):
        """One stage from ``slot`` with warpgroup MMAs: per sub-chunk, MMA step j and m-tile,
        one ``wgmma m64n(8 windows)k16`` of this warp's warpgroup, both operands read by
        descriptor (``layout.wgmma_descriptors``), every output adding its steps in k
        order; one commit group per stage, waited for before the slot is refilled, then
        the accumulators are read back only after the wait. With ``overlap`` the wait leaves
        this stage's group in flight (``wait_group 1``: the previous stage's has completed,
        so its slot, two stages back from the next refill, is free) and the accumulators
        are read back by :meth:`_settle_wgmma` after the loop."""
        MT: cutlass.Constexpr = self.mtiles
        W: cutlass.Constexpr = self.windows
        SUBS: cutlass.Constexpr = self.subs
        wg = warp // 4
        warpgroup.fence()
        for sub in cutlass.range_constexpr(SUBS):
            for j in cutlass.range_constexpr(2):
                for mt in cutlass.range_constexpr(MT):
                    a, b = lay.wgmma_descriptors(wg, mt, sub, j, MT, SUBS, self.a_bytes, W)
                    base = mt * W * 4
                    d = p.wgmma_bf16_ss([acc[base + i] for i in range(4 * W)],
                                        p.smem_matrix_descriptor_sw128(slot + a[0], a[1]),
                                        p.smem_matrix_descriptor_sw128(slot + b[0], b[1]),
                                        8 * W)
                    for i in cutlass.range_constexpr(4 * W):
                        acc[base + i] = d[i]
        warpgroup.commit_group()
        if cutlass.const_expr(self.overlap):
            warpgroup.wait_group(1)
        else:
            self._settle_wgmma(acc)

    @cute.jit
    def _settle_wgmma(self, acc):
        """Wait for every warpgroup MMA of this warp's group (``wait_group 0``), then take
        the accumulators back as ordinary registers (``wgmma_settle``)."""
        warpgroup.wait_group(0)
        d = p.wgmma_settle([acc[i] for i in range(self.mtiles * self.windows * 4)])
        for i in cutlass.range_constexpr(self.mtiles * self.windows * 4):
            acc[i] = d[i]

    @cute.jit
    def _epilogue(self, acc, out: Int64, addend: Int64, n: Int32, tokens: Int32, flags: Int32,
                  tile, warp, lane, width=None):
        """Addend (loads of one m-tile in flight together), output rounding, predicated
        stores of the tokens ``< T``. ``n``: the output's row stride; ``width`` (the
        chunked kernel: equal to ``n``): only columns ``< width`` stored, addend loads of
        the columns beyond clamped to ``width - 1``."""
        MT: cutlass.Constexpr = self.mtiles
        W: cutlass.Constexpr = self.windows
        col0 = tile * self.tile_rows
        last = tokens - 1
        add_bf16 = (flags & FLAG_ADD_BF16) != 0
        add_f32 = (flags & FLAG_ADD_F32) != 0
        f32_out = (flags & FLAG_F32_OUT) != 0
        for mt in cutlass.range_constexpr(MT):
            # (accumulator index, element offset of (min(t, T - 1), n), token) of the m-tile;
            # offsets are Int32 (T N < 2^31), one register each
            where = []
            for wn in cutlass.range_constexpr(W):
                for r in cutlass.range_constexpr(4):
                    row, token = lay.c_map(warp, mt, wn, lane, r, MT)
                    if cutlass.const_expr(width is None):
                        where.append(((mt * W + wn) * 4 + r,
                                      cutlass.min(token, last) * n + col0 + row, token))
                    else:
                        # a padding column is never stored: 'token' past every live token
                        col = col0 + row
                        where.append(((mt * W + wn) * 4 + r,
                                      cutlass.min(token, last) * n + cutlass.min(col, width - 1),
                                      cutlass.select_(col < width, token, tokens)))
            if add_bf16:
                vals = [ld_u16(addend + Int64(at) * 2) for _, at, _ in where]
                for e in cutlass.range_constexpr(W * 4):
                    i = where[e][0]
                    acc[i] = h.fadd(acc[i], h.bf16_lo(vals[e]))
            if add_f32:
                vals = [ld_f32(addend + Int64(at) * 4) for _, at, _ in where]
                for e in cutlass.range_constexpr(W * 4):
                    i = where[e][0]
                    acc[i] = h.fadd(acc[i], vals[e])
            if f32_out:
                for e in cutlass.range_constexpr(W * 4):
                    i, at, token = where[e]
                    stg_f32_if(out + Int64(at) * 4, acc[i],
                               cutlass.select_(token < tokens, Int32(1), Int32(0)))
            else:
                for e in cutlass.range_constexpr(W * 4):
                    i, at, token = where[e]
                    stg_u16_if(out + Int64(at) * 2, p.f32_to_bf16_bits(acc[i]),
                               cutlass.select_(token < tokens, Int32(1), Int32(0)))


class GroupedSplitKGemmKernel(SplitKGemmKernel):
    """Two GEMMs of the same tokens in one launch: ``out_1 = x W_1^T`` and ``out_2 = x
    W_2^T`` (each FP32 or BF16 out; an addend for the first only), for ``T <= 64`` tokens
    (not ``chunked``, not ``serial``).

    Grid: the first GEMM's ``tiles_1 * splits_1`` CTAs, then the second's ``tiles_2 *
    splits_2`` (``first_blocks = tiles_1 * splits_1``). CTA ``b`` runs
    :class:`SplitKGemmKernel`'s algorithm for CTA ``b`` of the first GEMM when ``b <
    first_blocks``, else for CTA ``b - first_blocks`` of the second, on that GEMM's weight,
    output, workspace, tile counters, rows, K splits and flags. Both GEMMs share the kernel's
    compile-time shape (tile, windows, ring, stage, MMA kind) and ``x``, ``K`` and ``T``;
    each has its own K split. Since only ``splits`` changes bits, each output is bitwise
    what :class:`SplitKGemmKernel` gives for that GEMM alone at the same splits: one launch
    instead of two (one launch latency, one ramp of the memory stream, one tail), nothing
    else.
    """

    def __init__(self, **params):
        super().__init__(**params)
        if self.chunked or self.serial:
            raise ValueError("GroupedSplitKGemmKernel: token chunks and serial splits are not "
                             "grouped (calls of at most 64 rows, cross-CTA splits)")

    @classmethod
    def compile_args(cls, **params):
        """(kernel, fake arguments but the stream) for ``fast.device.compile.compiled``."""
        return cls(**params), [Int64(0)] * 6 + [Int32(1)] * 5 + [Int64(0)] * 4 + [Int32(1)] * 6

    @cute.jit
    def __call__(self, w: Int64, x: Int64, out: Int64, addend: Int64, ws: Int64,
                 counters: Int64, n: Int32, k: Int32, tokens: Int32, splits: Int32,
                 flags: Int32, w2: Int64, out2: Int64, ws2: Int64, counters2: Int64,
                 n2: Int32, splits2: Int32, flags2: Int32, first_blocks: Int32, grid: Int32,
                 pdl: Int32, stream):
        """Launch ``grid = first_blocks + tiles_2 * splits_2`` CTAs; ``n``, ``n2``: the
        two weights' rows (each a multiple of the tile, each its output's row stride)."""
        self.grouped_kernel(w, x, out, addend, ws, counters, n, k, tokens, splits, flags,
                            w2, out2, ws2, counters2, n2, splits2, flags2, first_blocks).launch(
            grid=(grid, 1, 1), block=(self.threads, 1, 1), stream=stream,
            smem=self.smem_bytes, min_blocks_per_mp=self.occupancy, preferred_smem_carveout=100,
            use_pdl=pdl)

    @cute.kernel
    def grouped_kernel(self, w: Int64, x: Int64, out: Int64, addend: Int64, ws: Int64,
                       counters: Int64, n: Int32, k: Int32, tokens: Int32, splits: Int32,
                       flags: Int32, w2: Int64, out2: Int64, ws2: Int64, counters2: Int64,
                       n2: Int32, splits2: Int32, flags2: Int32, first_blocks: Int32):
        b = cute.arch.block_idx()[0]
        second = b >= first_blocks
        rows = cutlass.select_(second, n2, n)
        self._cta(cutlass.select_(second, w2, w), x, cutlass.select_(second, out2, out), addend,
                  cutlass.select_(second, ws2, ws), cutlass.select_(second, counters2, counters),
                  rows, k, tokens, cutlass.select_(second, splits2, splits),
                  cutlass.select_(second, flags2, flags), rows,
                  b - cutlass.select_(second, first_blocks, Int32(0)))
