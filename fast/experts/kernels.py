"""The GEMM kernels of the experts engine (the pipeline is described in ``fast.experts``):
FC1 and FC2 as two persistent grids (``ExpertsGemmKernel``) or one (``FusedExpertsKernel``),
claiming the work items that the plan kernel (``fast.experts.lists``) wrote.

Every kernel takes raw device addresses (``Int64``) and run-time sizes (``Int32``); the
widths, the tile shape and the window count are compile-time constants of the kernel
object, so one compile serves every batch of one geometry.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32
from cutlass.cute.nvgpu import warpgroup

from fast.device import SMEM_PER_CTA
from fast.device import fp32 as h
from fast.device import ptx as p
from fast.experts.layout import (CHUNK, DECODE_MASK, PAIR3_GATHER, PAIR3_MULTIPLIER,
                                 WGMMA_WORD_STRIDE, WINDOW, b_offset_mma, b_offset_wgmma,
                                 chunks_per_stage, stages_of, wgmma_b_descriptor)
from fast.experts.lists import ERROR_GATE_TIMEOUT, Workspace, e8m0_f32_bits

__all__ = ["GATE_SPIN_LIMIT", "WALK_MAX_STAGES", "ExpertsGemmKernel",
           "FusedExpertsKernel"]

#: How many times a fused FC2 item polls its expert's FC1 count before it gives up (claims
#: are in order and an FC1 item never waits, so only a broken kernel reaches it): 2^22 L2
#: round trips, about 2 s. A count, not ``%globaltimer``: on the H200 the relaxed spin
#: with a timer still faulted with "illegal address", and without one it ran clean.
GATE_SPIN_LIMIT = 1 << 22
#: The most stages per tile a walked GEMM (``ExpertsGemmKernel(walk > 1)``) may have: its
#: tile's stages are unrolled, and only short GEMMs (FC2 of a TP slice) need the walk.
WALK_MAX_STAGES = 8


class ExpertsGemmKernel:
    """One GEMM of the engine over all work items of a call: FC1 (``fc1=True``: SiTU, MXFP8
    re-quantization, BF16 hidden rows) or FC2 (BF16 expert rows).

    Work item ``(expert e, tile, window group)``: ``warps * mtiles * 16`` weight rows of
    expert e (a tile) times up to ``8 * windows`` of its tokens (a window group); CTAs
    claim items in order from a counter (persistent grid), so the window groups of one
    tile run side by side and read its weights from L2 after the first.

    Algorithm of a CTA for one item:

    1. thread 0 claims the item, finds its expert by binary search in ``wgp``; threads
       ``t < 8 W`` read token t's pair from the routing list and the row of its B operand
       (FC1: the plan row of the pair's received row; FC2: the hidden row
       ``offs[e] + slot``);
    2. main loop over ``stages`` of ``64 * chunks_per_stage`` k: the B operand of the
       window group is copied to shared memory by ``cp.async`` into a ring of ``RING``
       stages (zero-filled past the group's tokens), in the lanes' fragment order, and
       with it each lane's 16-byte piece of its warp's prepared weights per m-tile and
       chunk (``cp.async``, read back by the same lane); each warp decodes them
       (``fast.experts.layout``: three bit operations and a multiply per word, one
       ``mul.rn.bf16x2`` by the scale factor per BF16 pair) and issues 4 ``mma.m16n8k16``
       per chunk, m-tile and window into FP32 accumulators (exact products, FP32 sums);
    3. epilogue FC1: per (intermediate column, token) ``a = SiTU(gate, up)`` in FP32 with
       the project's exp/tanh/sigmoid (``fast.device.fp32``; bit-identical to
       ``reference.emulation``), block maxima over 32 columns (warp shuffles, then shared
       memory across the 4 m-tiles of a block), the RCEIL E8M0 code, E4M3 codes
       (``cvt.rn.satfinite``), and the BF16 value ``e4m3 * 2^(code - 127)`` (exact for codes
       3..246) written to the hidden row; with ``capture`` also the FP32 FC1 outputs, the
       codes and the scales of each pair. Epilogue FC2: each accumulator rounded to BF16
       (``cvt.rn.bf16.f32``) into its pair's output row.

    Summation order (what the bound covers): per output, the 4 MMA steps of each chunk in
    order, chunks in order from k = 0, each MMA adding 16 exact products to the FP32
    accumulator; independent of the other tokens (a pair's row does not depend on its
    window or batch).

    Walk (``walk`` G > 1, FC2 only): an item is ``(expert, G consecutive tiles, window
    group)``, and the CTA streams the G tiles' stages back to back through one ring (the
    next tile's first stages are requested while the current tile computes), writing each
    tile's rows after its last stage. For a GEMM of few stages (FC2 of a TP slice: 3), where
    an item's claim, search, token table and ring fill would otherwise stand between every
    few stages of weights. The tiles of an item multiply the same B operand (its hidden
    rows), so a walk keeps it resident (``resident_b``): the first tile's stages copy it
    once into ``stages`` blocks after the ring, whose slots then hold only weights and
    scales, and every tile reads it there. Each output's sum is the same chunk order: no
    bit changes.

    Constraints: rows % (16 * warps * mtiles) == 0; K % 64 == 0; for FC1, the CTA's
    ``8 * warps * mtiles / 2`` intermediate columns are whole MXFP8 blocks; ``walk``
    divides the tiles, and a walked GEMM has at most ``WALK_MAX_STAGES`` stages per tile
    (the tile's stages are unrolled).
    """

    def __init__(self, *, fc1: bool, rows: int, k: int, inter: int, latent: int, count: int,
                 windows: int, top_k: int = 16, warps: int = 4, mtiles: int = 2,
                 ring: int | None = None, chains: int = 1, occupancy: int | None = None,
                 capture: bool = False, beta: float = 4.0, linear_beta: float = 25.0,
                 pdl: bool = False, wgmma: bool = False, pdl_chain: bool = False,
                 walk: int = 1):
        # measured on the H200: a 4-stage ring for one window, 3 stages (one more CTA per
        # multiprocessor) for more; the ring depth never changes a bit
        ring = ring or (4 if windows == 1 else 3)
        if chains not in (1, 2, 4) or ring < 2:
            raise ValueError(f"chains must be 1, 2 or 4 and ring >= 2, got {chains}, {ring}")
        self.RING, self.chains = ring, chains
        self.wgmma = bool(wgmma)
        if self.wgmma and (warps % 4 or chains != 1):
            raise ValueError(f"wgmma needs whole warpgroups (warps % 4 == 0) and one accumulator "
                             f"chain, got warps={warps}, chains={chains}")
        self.fc1, self.rows, self.k, self.inter, self.latent = fc1, rows, k, inter, latent
        self.count, self.windows, self.top_k = count, windows, top_k
        self.warps, self.mtiles, self.capture = warps, mtiles, capture
        self.beta, self.linear_beta = beta, linear_beta
        self.pdl = bool(pdl)
        #: FC1 launched with programmatic dependent launch after the plan kernel (waits
        #: for it before the first claim)
        self.pdl_chain = bool(pdl_chain) and fc1
        #: set by ``FusedExpertsKernel``: FC1 counts each finished item at its expert
        #: (``signal``), FC2 waits for its expert's count before reading hidden rows
        #: (``gate``; ``fc1_tiles``: FC1 tiles per window group)
        self.signal, self.gate, self.fc1_tiles = False, False, 0
        self.threads = 32 * warps
        self.tokens = WINDOW * windows  # token slots of a work item (the MMA's N)
        self.tile_rows = 16 * warps * mtiles
        if rows % self.tile_rows:
            raise ValueError(f"rows={rows} is not a multiple of the tile {self.tile_rows}")
        if fc1 and (warps * mtiles) % 4:
            raise ValueError("FC1 tiles must hold whole MXFP8 blocks (warps * mtiles % 4 == 0)")
        self.tiles = rows // self.tile_rows
        self.m_tiles = rows // 16
        self.chunks = k // CHUNK
        self.stage_chunks = chunks_per_stage(k)
        self.stages = stages_of(k)
        #: consecutive row tiles per work item (FC2; see the class docstring)
        self.walk = walk
        if not isinstance(walk, int) or walk < 1 or self.tiles % walk:
            raise ValueError(f"walk must be an int >= 1 dividing the {self.tiles} row tiles, "
                             f"got {walk!r}")
        if walk > 1 and (fc1 or self.stages > WALK_MAX_STAGES):
            raise ValueError(f"walk > 1 is for FC2 GEMMs of at most {WALK_MAX_STAGES} stages "
                             f"(got fc1={fc1}, {self.stages} stages)")
        #: work items per window group: tiles // walk
        self.item_tiles = self.tiles // walk
        #: bytes of one row tile's weights and of its scales (a walk's stride between tiles)
        self.tile_weight_bytes = warps * mtiles * self.chunks * 512
        self.tile_scale_bytes = warps * mtiles * self.stages * 32 * self.stage_chunks
        # one ring slot (a stage): the window group's B operand, then this CTA's weights
        # (each lane's 16 bytes per m-tile and chunk: private to the lane), then its scales
        self.b_bytes = windows * self.stage_chunks * 1024
        self.w_bytes = warps * mtiles * self.stage_chunks * 512
        self.s_bytes = warps * mtiles * 32 * self.stage_chunks
        #: a walked item's tiles share one B operand (the same hidden rows at every tile):
        #: its ``stages`` B blocks stay resident after the ring, copied once per item, and
        #: a ring slot holds only weights and scales
        self.resident_b = walk > 1
        self.w_offset = 0 if self.resident_b else self.b_bytes  # weights' offset in a slot
        self.slot_bytes = self.w_offset + self.w_bytes + self.s_bytes  # one ring slot's
        self.granules = WINDOW * windows * 8 * self.stage_chunks  # 16-byte B copies per stage
        # dynamic: the ring, then (walked) the resident B operand
        self.smem_bytes = ring * self.slot_bytes + (self.stages * self.b_bytes
                                               if self.resident_b else 0)
        # static: the item's info and token table, the FC1 epilogue's block maxima
        static = 4 * (8 + 3 * WINDOW * windows + warps * mtiles * WINDOW * windows) + 1024
        #: CTAs per multiprocessor the kernel is built for (launch bounds; the grid size)
        self.occupancy = occupancy or max(1, min(8, SMEM_PER_CTA // (self.smem_bytes + static)))
        self.ws = Workspace(count)
        self.search_steps = max(1, math.ceil(math.log2(count + 1)))

    @classmethod
    def compile_args(cls, **params):
        """(kernel, fake arguments but the stream) for ``fast.device.compile.compiled``."""
        return cls(**params), [Int64(0)] * 9 + [Int32(1), Int32(1)]

    @cute.jit
    def __call__(self, weights: Int64, scales: Int64, act: Int64, lists: Int64, work: Int64,
                 out: Int64, cap_fc1: Int64, cap_codes: Int64, cap_scales: Int64,
                 capacity: Int32, grid: Int32, stream):
        self.kernel(weights, scales, act, lists, work, out, cap_fc1, cap_codes, cap_scales,
                    capacity).launch(grid=(grid, 1, 1), block=(self.threads, 1, 1), stream=stream,
                                     smem=self.smem_bytes, min_blocks_per_mp=self.occupancy,
                                     preferred_smem_carveout=100,
                                     use_pdl=(self.pdl and not self.fc1) or self.pdl_chain)

    # -- pieces -----------------------------------------------------------------------

    @cute.jit
    def _factor(self, x, byte: int):
        """BF16x2 2^(code - 1) in both halves from byte ``byte`` of ``x`` (codes + 126)."""
        selector = byte | (4 << 4) | (byte << 8) | (4 << 12)
        return p.prmt(x, Uint32(0), selector) << Uint32(7)

    @cute.jit
    def _decode(self, word):
        """The four BF16x2 pairs of a prepared word (value * 2^-126; layout docstring)."""
        m = Uint32(DECODE_MASK)
        pair3 = ((word & Uint32(PAIR3_GATHER)) * Uint32(PAIR3_MULTIPLIER)) & m
        return [word & m, p.rotr(word, 3) & m, p.rotr(word, 6) & m, pair3]

    @cute.jit
    def _scaled_down(self, x, beta: float):
        """``x / beta`` correctly rounded: a multiply by ``1 / beta`` when ``beta`` is a power
        of two (the exact quotient is the exact product, so both round alike, subnormals
        included), else ``div.rn``."""
        if cutlass.const_expr(math.frexp(beta)[0] == 0.5):
            return h.fmul(x, Float32(1.0 / beta))
        return h.fdiv(x, Float32(beta))

    @cute.jit
    def situ(self, g, u):
        a = h.fmul(Float32(self.beta), h.tanh_rn(self._scaled_down(g, self.beta)))
        a = h.fmul(a, h.sigmoid_rn(g))
        b = h.fmul(Float32(self.linear_beta), h.tanh_rn(self._scaled_down(u, self.linear_beta)))
        return h.fmul(a, b)

    @cute.jit
    def rceil(self, amax):
        """(E8M0 code, FP32 multiplier 2^(127 - code)) of a block maximum: the rule of
        ``fast.mx`` (RCEIL on the IEEE quotient amax / 448)."""
        q = h.fdiv(amax, Float32(448.0))
        qb = h.bits(q)
        e = qb >> Uint32(23)
        normal = e + cutlass.select_((qb & Uint32(0x7FFFFF)) != Uint32(0), Uint32(1), Uint32(0))
        sub = cutlass.select_(qb > Uint32(0x00400000), Uint32(1), Uint32(0))
        code = cutlass.select_(e == Uint32(0), sub, normal)
        code = cutlass.min(code, Uint32(254))
        code = cutlass.select_(qb > Uint32(0x7F800000), Uint32(255), code)
        mult = cutlass.select_(code == Uint32(254), Uint32(0x00400000), (Uint32(254) - code) << Uint32(23))
        mult = cutlass.select_(code == Uint32(0), Uint32(0x3F800000), mult)
        return code, h.from_bits(mult)

    # -- the kernel -------------------------------------------------------------------

    @cute.kernel
    def kernel(self, weights: Int64, scales: Int64, act: Int64, lists: Int64, work: Int64,
               out: Int64, cap_fc1: Int64, cap_codes: Int64, cap_scales: Int64, capacity: Int32):
        tid = cute.arch.thread_idx()[0]
        lane = tid % 32
        warp = tid // 32
        ring, info, table, red = self._shared()
        acc, src, dst, ok = self._registers()
        if cutlass.const_expr(self.pdl_chain):
            # the plan kernel's items and counters (and the list kernel's rows) visible
            cute.arch.griddepcontrol_wait()
        if cutlass.const_expr(self.pdl and self.fc1):
            # FC2 may be scheduled now: its CTAs take the multiprocessors this grid's CTAs
            # leave, and read nothing this grid writes before griddepcontrol.wait
            cute.arch.griddepcontrol_launch_dependents()
        tiles = Int32(self.item_tiles)
        first = Int32(1)
        item = self.claim(work, info, tid, tiles)
        while item >= 0:
            self._item(weights, scales, act, lists, work, out, cap_fc1, cap_codes,
                       cap_scales, capacity, ring, info, table, red, acc, src, dst, ok, tid,
                       lane, warp, first)
            first = Int32(0)
            item = self.claim(work, info, tid, tiles)

    def _shared(self):
        """(ring, info, table, red): the dynamic ring and the static per-item tables."""
        TOK: cutlass.Constexpr = WINDOW * self.windows
        ring = p.pinned_i32(cute.arch.get_dyn_smem(cutlass.Uint8, alignment=128).toint())
        info = cute.arch.alloc_smem(Int32, 8, alignment=16).toint()
        table = cute.arch.alloc_smem(Int32, 3 * TOK, alignment=16).toint()
        red = cute.arch.alloc_smem(Float32, self.warps * self.mtiles * TOK, alignment=16).toint()
        return ring, info, table, red

    def _registers(self):
        """(acc, src, dst, ok): the accumulators and this thread's B-copy plan."""
        copies: cutlass.Constexpr = (self.granules + self.threads - 1) // self.threads
        acc = cute.make_rmem_tensor((self.mtiles * self.windows * 4 * self.chains,), Float32)
        src = cute.make_rmem_tensor((copies,), Int64)
        dst = cute.make_rmem_tensor((copies,), Int32)
        ok = cute.make_rmem_tensor((copies,), Int32)
        return acc, src, dst, ok

    @cute.jit
    def _item(self, weights: Int64, scales: Int64, act: Int64, lists: Int64, work: Int64,
              out: Int64, cap_fc1: Int64, cap_codes: Int64, cap_scales: Int64, capacity,
              ring, info, table, red, acc, src, dst, ok, tid, lane, warp, first):
        """The work item ``info`` describes (``claim``): token table, main loop, epilogue."""
        W: cutlass.Constexpr = self.windows
        MT: cutlass.Constexpr = self.mtiles
        SC: cutlass.Constexpr = self.stage_chunks
        NS: cutlass.Constexpr = self.stages
        K: cutlass.Constexpr = self.k
        TOK: cutlass.Constexpr = WINDOW * W
        threads: cutlass.Constexpr = self.threads
        copies: cutlass.Constexpr = (self.granules + threads - 1) // threads
        expert = p.lds_i32(info + 4)
        tile = p.lds_i32(info + 8) * self.walk  # the item's first row tile
        group = p.lds_i32(info + 12)
        ntok = p.lds_i32(info + 16)
        # 1. token table: pair, B row, hidden row
        self.token_table(lists, work, table, expert, group, ntok, capacity, tid)
        cute.arch.sync_threads()
        # this thread's B copies of every stage: source row address, shared offset
        for i in cutlass.range_constexpr(copies):
            g = tid + threads * i
            token = g // (8 * SC)
            gi = g % (8 * SC)
            window = token // WINDOW
            n = token % WINDOW
            cc = gi // 8
            kk = gi % 8
            if cutlass.const_expr(self.wgmma):
                dst[i] = b_offset_wgmma(window, n, cc, kk, SC)
            else:
                dst[i] = b_offset_mma(window, n, cc, kk, SC)
            row = Int32(0)
            state = Int32(-1)  # -1: no copy (past the stage's granules), 0: zero-fill
            if g < self.granules:
                state = Int32(0)
                if token < ntok:
                    row = p.lds_i32(table + (TOK + token) * 4)
                    state = Int32(1)
            ok[i] = state
            src[i] = act + (Int64(row) * K + gi * 8) * 2
        # weights of this warp's m-tiles
        mbase = tile * (self.warps * MT) + warp * MT
        wbase = weights + (Int64(expert) * self.m_tiles + mbase) * (self.chunks * 512) + lane * 16
        sbase = scales + (Int64(expert) * self.m_tiles + mbase) * (NS * 32 * SC) + lane * 4
        for i in cutlass.range_constexpr(MT * W * 4 * self.chains):
            acc[i] = Float32(0.0)
        nwin = (ntok + WINDOW - 1) // WINDOW
        if cutlass.const_expr(self.walk > 1):
            # 2-3. the item's tiles back to back through the ring, each tile's rows
            # written after its last stage
            for live in cutlass.range_constexpr(1, W + 1):
                if nwin == live:
                    self._walk_loop(acc, src, dst, ok, wbase, sbase, ring, warp, lane, live,
                                    first, work, info, tid, table, out, tile, ntok)
        else:
            # 2. main loop, one copy per count of live windows (chosen once per item, so
            # no MMA or B load of the loop is predicated on its window)
            for live in cutlass.range_constexpr(1, W + 1):
                if nwin == live:
                    self._main_loop(acc, src, dst, ok, wbase, sbase, ring, warp, lane, live,
                                    first, work, info, tid)
            self._join_chains(acc)
            # 3. epilogue
            if cutlass.const_expr(self.fc1):
                self.epilogue_fc1(acc, table, red, out, cap_fc1, cap_codes, cap_scales,
                                   tid, lane, warp, tile, ntok)
                if cutlass.const_expr(self.signal):
                    self.signal_ready(work, expert, tid)
            else:
                self.epilogue_fc2(acc, table, out, lane, warp, tile, ntok)

    @cute.jit
    def token_table(self, lists: Int64, work: Int64, table, expert, group, ntok, capacity, tid):
        """Threads ``t < tokens``: token t of window group ``group`` of ``expert`` into the
        item's token table: its pair (-1 past ``ntok``), its B row (FC1: the pair's row of
        the call; FC2: its hidden row) and its hidden row ``offs[e] + slot``."""
        N: cutlass.Constexpr = self.tokens
        if tid < N:
            slot = group * N + tid
            pair = Int32(-1)
            brow = Int32(0)
            hrow = Int32(0)
            if tid < ntok:
                pair = p.ldg_i32(lists + (Int64(expert) * Int64(capacity) + Int64(slot)) * 4)
                hrow = p.ldg_i32(work + Int64(self.ws.offs + expert) * 4) + slot
                if cutlass.const_expr(self.fc1):
                    brow = pair // self.top_k
                else:
                    brow = hrow
            p.sts_i32(table + tid * 4, pair)
            p.sts_i32(table + (N + tid) * 4, brow)
            p.sts_i32(table + (2 * N + tid) * 4, hrow)

    @cute.jit
    def _main_loop(self, acc, src, dst, ok, wbase, sbase, ring, warp, lane, live: int, first,
                   work: Int64, info, tid):
        """Every stage of one item through the ``RING``-slot ring: copies issued
        ``RING - 1`` stages ahead, then the stage's MMAs for the first ``live`` windows.

        FC2 launched with programmatic dependent launch (``pdl``), on its CTA's ``first``
        item: the weights of the first ``RING - 1`` stages are requested, then
        ``griddepcontrol.wait`` (FC1 complete, its hidden rows visible), then those
        stages' hidden-row copies, all in the first of ``RING - 1`` commit groups (the
        others empty), so the ring's waits count groups as in the plain prologue."""
        NS: cutlass.Constexpr = self.stages
        RING: cutlass.Constexpr = self.RING
        self._fill_ring(src, dst, ok, wbase, sbase, ring, warp, lane, first, work, info, tid)
        for s in cutlass.range(NS, unroll=1):
            cute.arch.cp_async_wait_group(RING - 2)
            if cutlass.const_expr(self.wgmma):
                # this thread's completed copies, visible to the wgmma reads (async proxy)
                cute.arch.fence_view_async_shared()
            cute.arch.sync_threads()
            issue = s + RING - 1
            if issue < NS:
                self._issue(src, dst, ok, wbase, sbase, ring + (issue % RING) * self.slot_bytes,
                            issue, warp, lane)
            cute.arch.cp_async_commit_group()
            self.compute_stage(acc, ring + (s % RING) * self.slot_bytes, warp, lane, live)
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def _walk_loop(self, acc, src, dst, ok, wbase, sbase, ring, warp, lane, live: int, first,
                   work: Int64, info, tid, table, out: Int64, tile, ntok):
        """The ``walk`` tiles of one FC2 item through the ring: virtual stage
        ``v = g * stages + s`` is stage ``s`` of the item's tile ``g`` (its weights one tile
        further on; its B operand, the same hidden rows, copied once with the first tile's
        stages into the resident blocks after the ring, ``_b_slot``), copies issued
        ``RING - 1`` virtual stages ahead across the tiles' boundaries; after
        tile g's last stage its chains are joined, its rows written and its accumulators
        zeroed. The prologue is ``_main_loop``'s (``_fill_ring``) over virtual stages."""
        NS: cutlass.Constexpr = self.stages
        RING: cutlass.Constexpr = self.RING
        G: cutlass.Constexpr = self.walk
        MT: cutlass.Constexpr = self.mtiles
        ahead = self.RING - 1
        self._fill_ring(src, dst, ok, wbase, sbase, ring, warp, lane, first, work, info, tid)
        for g in cutlass.range(G, unroll=1):
            for s in cutlass.range_constexpr(NS):
                cute.arch.cp_async_wait_group(RING - 2)
                if cutlass.const_expr(self.wgmma):
                    cute.arch.fence_view_async_shared()
                cute.arch.sync_threads()
                # the virtual stage RING - 1 ahead: tile g + dg, stage ds (compile-time)
                dg = (s + ahead) // NS
                ds = (s + ahead) % NS
                if g + dg < G:
                    slot = (g * NS + (s + ahead)) % RING
                    # resident B: the slot takes weights and scales only; the B operand
                    # goes to its block with the first tile's stages (g + dg == 0)
                    self._issue(src, dst, ok, wbase + Int64(g + dg) * self.tile_weight_bytes,
                                sbase + Int64(g + dg) * self.tile_scale_bytes,
                                ring + slot * self.slot_bytes, ds, warp, lane,
                                operand_b=False)
                    if cutlass.const_expr(dg == 0):
                        if g == 0:
                            self._issue(src, dst, ok, wbase, sbase, Int32(0), ds, warp, lane,
                                        weights=False, bslot=self._b_slot(ring, ds))
                cute.arch.cp_async_commit_group()
                self.compute_stage(acc, ring + ((g * NS + s) % RING) * self.slot_bytes, warp, lane,
                              live, bslot=self._b_slot(ring, s))
            self._join_chains(acc)
            self.epilogue_fc2(acc, table, out, lane, warp, tile + g, ntok)
            for i in cutlass.range_constexpr(MT * self.windows * 4 * self.chains):
                acc[i] = Float32(0.0)
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def _fill_ring(self, src, dst, ok, wbase, sbase, ring, warp, lane, first, work: Int64,
                   info, tid):
        """The ring's first ``RING - 1`` (virtual) stages of an item. FC2 whose B operand
        must wait: in the fused grid (``gate``) for every FC1 item of this item's expert
        (its hidden rows), launched with programmatic dependent launch (``pdl``) on its
        CTA's ``first`` item for the FC1 grid; their weights are requested first
        (``_prologue``)."""
        if cutlass.const_expr(self.gate):
            self._prologue(src, dst, ok, wbase, sbase, ring, warp, lane,
                           lambda: self._wait_ready(work, info, tid))
        elif cutlass.const_expr(self.pdl and not self.fc1):
            if first != 0:
                self._prologue(src, dst, ok, wbase, sbase, ring, warp, lane,
                               cute.arch.griddepcontrol_wait)
            else:
                self._prologue(src, dst, ok, wbase, sbase, ring, warp, lane)
        else:
            self._prologue(src, dst, ok, wbase, sbase, ring, warp, lane)

    def _prologue(self, src, dst, ok, wbase, sbase, ring, warp, lane, wait=None):
        """The ring's first ``RING - 1`` slots: slot ``v`` holds virtual stage ``v``, stage
        ``v % stages`` of the item's tile ``v // stages`` (tiles beyond the first only in
        a walk). Without ``wait``, one commit group each. With ``wait`` (the
        B operand must wait: traced here, a grid dependency or a ready count) their weights
        are requested, then ``wait()``, then their B copies, all in the first of the
        ``RING - 1`` commit groups (the others empty), so the loop's waits count groups as
        after the plain prologue."""
        # a plain method (its callable argument is traced where it is called): the loops
        # and tests are Python's, over compile-time ints
        virtual = range(min(self.RING - 1, self.walk * self.stages))

        def issue(v, operand_b=True, weights=True):
            g, st = divmod(v, self.stages)
            w, sc = wbase, sbase
            if g:
                w, sc = wbase + g * self.tile_weight_bytes, sbase + g * self.tile_scale_bytes
            if self.resident_b:  # the B operand once, with the first tile's stages
                operand_b = operand_b and g == 0
            if operand_b or weights:
                self._issue(src, dst, ok, w, sc, ring + v * self.slot_bytes, st, warp, lane,
                            operand_b=operand_b, weights=weights,
                            bslot=self._b_slot(ring, st) if self.resident_b else None)

        if wait is None:
            for v in range(self.RING - 1):
                if v in virtual:
                    issue(v)
                cute.arch.cp_async_commit_group()
            return
        for v in virtual:
            issue(v, operand_b=False)
        wait()
        for v in virtual:
            issue(v, weights=False)
        for _ in range(self.RING - 1):
            cute.arch.cp_async_commit_group()

    def _b_slot(self, ring, stage):
        """Shared address of a walked item's resident B operand of ``stage``: after the
        ``RING`` slots, one ``b_bytes`` block per stage."""
        return ring + self.RING * self.slot_bytes + stage * self.b_bytes

    @cute.jit
    def claim(self, work: Int64, info, tid, tiles):
        """Thread 0 takes the next item and locates it; every thread returns the item
        (-1: none left) after a barrier."""
        cute.arch.sync_threads()
        if tid == 0:
            self.claim_locate(work, info, tiles)
        cute.arch.sync_threads()
        return p.lds_i32(info)

    @cute.jit
    def claim_locate(self, work: Int64, info, tiles):
        """Thread 0's part of ``claim``: the counter's next item into ``info`` (-1: none)."""
        ws = self.ws
        groups = p.ldg_i32(work + Int64(ws.wgp + self.count) * 4)
        total = groups * tiles
        counter = ws.claim if cutlass.const_expr(self.fc1) else ws.claim + 1
        item = p.atomic_add(work + Int64(counter) * 4, 1)
        if item < total:
            self.locate(work, info, item, item, tiles)
        else:
            p.sts_i32(info, -1)

    @cute.jit
    def locate(self, work: Int64, info, claimed, item, tiles):
        """Thread 0: item ``item`` of this GEMM (``claimed``: the counter's value) as
        ``info`` = (claimed, expert, tile, window group, tokens, the expert's groups)."""
        ws = self.ws
        lo = Int32(0)
        hi = Int32(self.count)
        for _ in cutlass.range_constexpr(self.search_steps):
            if hi - lo > 1:
                mid = (lo + hi) // 2
                if p.ldg_i32(work + Int64(ws.wgp + mid) * 4) * tiles <= item:
                    lo = mid
                else:
                    hi = mid
        start = p.ldg_i32(work + Int64(ws.wgp + lo) * 4)
        groups_e = p.ldg_i32(work + Int64(ws.wgp + lo + 1) * 4) - start
        local = item - start * tiles
        tile = local // groups_e
        group = local - tile * groups_e
        count = p.ldg_i32(work + Int64(ws.count + lo) * 4)
        ntok = cutlass.min(count - group * (WINDOW * self.windows), WINDOW * self.windows)
        p.sts_i32(info, claimed)
        p.sts_i32(info + 4, lo)
        p.sts_i32(info + 8, tile)
        p.sts_i32(info + 12, group)
        p.sts_i32(info + 16, ntok)
        if cutlass.const_expr(self.gate):
            p.sts_i32(info + 20, groups_e)

    @cute.jit
    def signal_ready(self, work: Int64, expert, tid):
        """Fused FC1: after every thread's hidden-row stores (the barrier), thread 0 counts
        this item at its expert with a GPU-scope release."""
        cute.arch.sync_threads()
        if tid == 0:
            p.red_release_gpu_add(work + Int64(self.ws.ready + expert) * 4, 1)

    @cute.jit
    def _wait_ready(self, work: Int64, info, tid):
        """Fused FC2: thread 0 polls (GPU-scope relaxed loads) until every FC1 item of the
        item's expert (``fc1_tiles`` tiles x its window groups) has counted, or
        ``GATE_SPIN_LIMIT`` polls pass (then error ``ERROR_GATE_TIMEOUT`` with the expert and the
        count seen; the rows are unspecified and ``check()`` raises); then one GPU-scope
        acquire fence (the FC1 items' release pairs with it) and a barrier.

        Not a spin on ``ld.acquire.gpu``: that compiles to an L1 invalidation at every
        poll, and on the H200 this kernel faulted with "illegal address" at it
        (``fast.device.ptx.fence_acq_rel_gpu``)."""
        ws = self.ws
        if tid == 0:
            expert = p.lds_i32(info + 4)
            target = p.lds_i32(info + 20) * self.fc1_tiles
            address = work + Int64(ws.ready + expert) * 4
            seen = Int32(p.ld_relaxed_gpu(address))
            polls = Int32(0)
            while (seen < target) & (polls < GATE_SPIN_LIMIT):
                seen = Int32(p.ld_relaxed_gpu(address))
                polls = polls + 1
            p.fence_acq_rel_gpu()
            if seen < target:
                p.atomic_max(work + ws.error * 4, ERROR_GATE_TIMEOUT)
                p.stg_i32(work + (ws.error + 1) * 4, expert)
                p.stg_i32(work + (ws.error + 2) * 4, seen)
        cute.arch.sync_threads()

    @cute.jit
    def _issue(self, src, dst, ok, wbase, sbase, slot, stage, warp, lane,
               operand_b: cutlass.Constexpr = True, weights: cutlass.Constexpr = True,
               bslot=None):
        """cp.async everything ``stage`` reads into ``slot``: this thread's B copies, its
        lane's 16-byte weight pieces (one per m-tile and chunk), and, lanes
        ``< 8 * stage_chunks``, 4 bytes of each of its warp's m-tile scale blocks
        (``operand_b`` / ``weights`` False: leave those out). ``bslot``: where the B
        copies go instead of the slot's start (the resident B of a walk)."""
        if cutlass.const_expr(bslot is None):
            bslot = slot
        SC: cutlass.Constexpr = self.stage_chunks
        MT: cutlass.Constexpr = self.mtiles
        copies: cutlass.Constexpr = (self.granules + self.threads - 1) // self.threads
        offset = Int64(stage) * (64 * SC * 2)
        if cutlass.const_expr(operand_b):
            for i in cutlass.range_constexpr(copies):
                if ok[i] >= 0:
                    if cutlass.const_expr(self.wgmma):
                        # the piece's four words to four core matrices (b_offset_wgmma)
                        for m in cutlass.range_constexpr(4):
                            p.cp_async_4z(bslot + dst[i] + m * WGMMA_WORD_STRIDE,
                                          src[i] + offset + 4 * m, ok[i] != 0)
                    else:
                        p.cp_async_16(bslot + dst[i], src[i] + offset, ok[i] != 0)
        if cutlass.const_expr(weights):
            wslot = slot + self.w_offset + warp * (MT * SC * 512) + lane * 16
            for mt in cutlass.range_constexpr(MT):
                for cc in cutlass.range_constexpr(SC):
                    chunk = Int64(stage) * SC + cc
                    p.cp_async_16(wslot + (mt * SC + cc) * 512,
                                  wbase + (Int64(mt) * self.chunks + chunk) * 512, True)
            if lane < 8 * SC:
                sslot = slot + self.w_offset + self.w_bytes + warp * (MT * 32 * SC) + lane * 4
                for mt in cutlass.range_constexpr(MT):
                    p.cp_async_4(sslot + mt * 32 * SC,
                                 sbase + (Int64(mt) * self.stages + stage) * (32 * SC))

    @cute.jit
    def _mma_step(self, acc, frags, b, j: int, w: int):
        """MMA step ``j`` of window ``w`` for every m-tile of this warp."""
        MT: cutlass.Constexpr = self.mtiles
        W: cutlass.Constexpr = self.windows
        for mt in cutlass.range_constexpr(MT):
            r0, r1 = frags[mt]
            at = ((j % self.chains) * MT * W + mt * W + w) * 4
            c = [acc[at + i] for i in range(4)]
            d = p.mma_bf16((r0[2 * j], r1[2 * j], r0[2 * j + 1], r1[2 * j + 1]),
                           (b[2 * j], b[2 * j + 1]), c)
            for i in cutlass.range_constexpr(4):
                acc[at + i] = d[i]

    @cute.jit
    def _join_chains(self, acc):
        """Fold the accumulator chains into chain 0, in chain order (FP32 adds)."""
        MT: cutlass.Constexpr = self.mtiles
        W: cutlass.Constexpr = self.windows
        for i in cutlass.range_constexpr(MT * W * 4):
            for c in cutlass.range_constexpr(1, self.chains):
                acc[i] = h.fadd(acc[i], acc[c * MT * W * 4 + i])

    @cute.jit
    def compute_stage(self, acc, slot, warp, lane, live: int, bslot=None):
        """One stage from ``slot``: decode this lane's A fragments, 4 MMAs per chunk,
        m-tile and live window (the first ``live``: the others hold no token of the item
        and their accumulators stay 0); MMA step j of a chunk accumulates into chain
        ``j % chains``. ``bslot``: the stage's B operand when it is not at the slot's
        start (the resident B of a walk)."""
        if cutlass.const_expr(bslot is None):
            bslot = slot
        SC: cutlass.Constexpr = self.stage_chunks
        MT: cutlass.Constexpr = self.mtiles
        bias = Uint32(0x7E7E7E7E) if SC == 2 else Uint32(0x7E7E)
        wslot = slot + self.w_offset + warp * (MT * SC * 512) + lane * 16
        # the scale bytes X of lanes 2i and 2i + 1 (each stores half of it, the even lane
        # the low half: layout docstring) are adjacent in the slot, so both lanes read X
        # whole with one load at the even lane's bytes (no shuffle)
        sslot = slot + self.w_offset + self.w_bytes + warp * (MT * 32 * SC) + (lane & ~1) * SC
        xs = []
        for mt in cutlass.range_constexpr(MT):
            if cutlass.const_expr(SC == 2):
                x = p.lds_u32(sslot + mt * 64)
            else:
                x = p.lds_u16(sslot + mt * 32)
            xs.append(x + bias)
        if cutlass.const_expr(self.wgmma):
            self._compute_wgmma(acc, xs, wslot, bslot, live)
            return
        for cc in cutlass.range_constexpr(SC):
            frags = []
            for mt in cutlass.range_constexpr(MT):
                frags.append(self._fragment(xs[mt], cc, wslot + (mt * SC + cc) * 512))
            # B fragments of every live window, then the MMAs step-major so that the
            # (m-tile, window) accumulator chains interleave (a chain's consecutive MMAs
            # are not back to back); each chain still adds its steps in order 0..3.
            bs = []
            for w in cutlass.range_constexpr(live):
                address = bslot + (((w * SC + cc) * 2) * 32 + lane) * 16
                bs.append(list(p.lds_v4(address)) + list(p.lds_v4(address + 512)))
            for j in cutlass.range_constexpr(4):
                for w in cutlass.range_constexpr(live):
                    self._mma_step(acc, frags, bs[w], j, w)

    @cute.jit
    def _fragment(self, x, cc: int, words):
        """This lane's A fragment of chunk ``cc`` of an m-tile: its four prepared ``words``
        (or their shared-memory address, read after the scale factors) decoded
        (``_decode``) and scaled by the chunk's two scale factors of ``x``."""
        f0 = self._factor(x, 2 * cc)
        f1 = self._factor(x, 2 * cc + 1)
        if cutlass.const_expr(not isinstance(words, list)):
            words = p.lds_v4(words)
        r0 = self._decode(words[0]) + self._decode(words[1])
        r1 = self._decode(words[2]) + self._decode(words[3])
        return ([p.mul_bf16x2(v, f0) for v in r0], [p.mul_bf16x2(v, f1) for v in r1])

    @cute.jit
    def _compute_wgmma(self, acc, xs, wslot, bslot, live: int):
        """``compute_stage`` with warpgroup MMAs: one group per (chunk, m-tile) in chunk order
        (``_wgmma_mtile``), each waited for (``wait_group 1``) once the next is issued, so
        two decoded fragments are live. Every word of the stage is read from shared memory
        before the first group, so the wait is followed by the next fragment's decode, not
        by a shared-memory round trip; the B descriptors are the slot's plus constants. The
        stage ends with every group done (the ring slot is refilled after the next
        barrier)."""
        SC: cutlass.Constexpr = self.stage_chunks
        MT: cutlass.Constexpr = self.mtiles
        words = [[list(p.lds_v4(wslot + (mt * SC + cc) * 512)) for mt in range(MT)]
                 for cc in range(SC)]
        # the B descriptor of the slot's start; each MMA's is it plus a constant
        _, leading, stride = wgmma_b_descriptor(0, 0, SC)
        slot_desc = p.smem_matrix_descriptor(bslot, leading, stride)
        order = [(cc, mt) for cc in range(SC) for mt in range(MT)]
        ahead = self._fragment(xs[0], 0, words[0][0])
        for i in cutlass.range_constexpr(len(order)):
            cc, mt = order[i]
            self._wgmma_mtile(acc, ahead, slot_desc, cc, mt, live)
            warpgroup.wait_group(1)  # the group before: its fragment's registers are free
            if cutlass.const_expr(i + 1 < len(order)):
                ncc, nmt = order[i + 1]
                ahead = self._fragment(xs[nmt], ncc, words[ncc][nmt])
        warpgroup.wait_group(0)
        self._wgmma_settle(acc, live)

    @cute.jit
    def _wgmma_mtile(self, acc, frag, slot_desc, cc: int, mt: int, live: int):
        """M-tile ``mt`` of chunk ``cc`` as one group of warpgroup MMAs: per MMA step j (16
        k) one ``wgmma m64n(8 live)k16`` whose 64 rows are m-tile ``mt`` of each of the
        warpgroup's 4 warps (A: this warp's decoded fragment in registers) and whose B is
        the live windows' tokens in the slot (core matrices: ``leading`` 128 bytes to the
        next 8 k, ``stride`` one window). Each output adds the chunk's steps in order 0..3.
        The caller waits (``wait_group(1)`` after the commit), so at most one group stays
        in flight and one decoded fragment's registers are free again for the next."""
        SC: cutlass.Constexpr = self.stage_chunks
        W: cutlass.Constexpr = self.windows
        r0, r1 = frag
        base = mt * W * 4
        warpgroup.fence()  # this fragment and the accumulators were written by this thread
        for j in cutlass.range_constexpr(4):
            start = wgmma_b_descriptor(cc, j, SC)[0]  # leading and stride: slot_desc's
            desc = p.smem_descriptor_offset(slot_desc, start)
            d = p.wgmma_bf16([acc[base + i] for i in range(4 * live)],
                             (r0[2 * j], r1[2 * j], r0[2 * j + 1], r1[2 * j + 1]), desc, 8 * live)
            for i in cutlass.range_constexpr(4 * live):
                acc[base + i] = d[i]
        warpgroup.commit_group()

    @cute.jit
    def _wgmma_settle(self, acc, live: int):
        """The live accumulators, read back only after ``wgmma.wait_group``."""
        MT: cutlass.Constexpr = self.mtiles
        W: cutlass.Constexpr = self.windows
        for mt in cutlass.range_constexpr(MT):
            base = mt * W * 4
            d = p.wgmma_settle([acc[base + i] for i in range(4 * live)])
            for i in cutlass.range_constexpr(4 * live):
                acc[base + i] = d[i]

    @cute.jit
    def epilogue_fc1(self, acc, table, red, hidden: Int64, cap_fc1: Int64, cap_codes: Int64,
                      cap_scales: Int64, tid, lane, warp, tile, ntok):
        MT: cutlass.Constexpr = self.mtiles
        W: cutlass.Constexpr = self.windows
        g = lane // 4
        q = lane % 4
        # windows past the item's tokens (no live token; the same for the whole CTA) are
        # skipped: their SiTU would only feed rows that are never written
        nwin = (ntok + WINDOW - 1) // WINDOW
        act = cute.make_rmem_tensor((MT * W * 2,), Float32)
        for mt in cutlass.range_constexpr(MT):
            for w in cutlass.range_constexpr(W):
                if w < nwin:
                    self._situ_window(acc, act, red, mt, w, warp, g, q)
        cute.arch.sync_threads()
        for mt in cutlass.range_constexpr(MT):
            local = warp * MT + mt
            block = local // 4
            column = (tile * (self.warps * MT) + local) * 8 + g
            for w in cutlass.range_constexpr(W):
                if w < nwin:
                    self._store_window(acc, act, table, red, hidden, cap_fc1, cap_codes,
                                       cap_scales, mt, w, local, block, column, g, q, ntok)

    @cute.jit
    def _situ_window(self, acc, act, red, mt: int, w: int, warp, g, q):
        """SiTU of this lane's two (gate, up) pairs of window ``w``, m-tile ``mt``, and the
        window's per-token maxima of |SiTU| over the m-tile's 8 columns (to ``red``)."""
        MT: cutlass.Constexpr = self.mtiles
        W: cutlass.Constexpr = self.windows
        TOK: cutlass.Constexpr = WINDOW * W
        at = (mt * W + w) * 4
        for t in cutlass.range_constexpr(2):
            a = self.situ(acc[at + t], acc[at + 2 + t])
            act[(mt * W + w) * 2 + t] = a
            m = h.bits(a) & Uint32(0x7FFFFFFF)
            for o in (4, 8, 16):
                m = cutlass.max(m, p.shfl_xor(m, o))
            if g == 0:
                token = w * WINDOW + 2 * q + t
                p.sts_f32(red + ((warp * MT + mt) * TOK + token) * 4, h.from_bits(m))

    @cute.jit
    def _store_window(self, acc, act, table, red, hidden: Int64, cap_fc1: Int64,
                      cap_codes: Int64, cap_scales: Int64, mt: int, w: int, local, block,
                      column, g, q, ntok):
        """RCEIL scale of each token's 32-column block, E4M3 code and BF16 hidden value of
        this lane's two activations of window ``w``, m-tile ``mt`` (and the capture)."""
        W: cutlass.Constexpr = self.windows
        TOK: cutlass.Constexpr = WINDOW * W
        inter: cutlass.Constexpr = self.inter
        for t in cutlass.range_constexpr(2):
            token = w * WINDOW + 2 * q + t
            amax = p.lds_f32(red + ((block * 4) * TOK + token) * 4)
            for i in cutlass.range_constexpr(1, 4):
                amax = h.fmax_nan(amax, p.lds_f32(red + ((block * 4 + i) * TOK + token) * 4))
            code, mult = self.rceil(amax)
            a = act[(mt * W + w) * 2 + t]
            e4m3 = p.f32x2_to_e4m3x2(h.fmul(a, mult), Float32(0.0)) & Uint32(0xFF)
            value, _ = p.e4m3x2_to_f32(e4m3)
            value = h.fmul(value, h.from_bits(e8m0_f32_bits(code)))
            if token < ntok:
                hrow = p.lds_i32(table + (2 * TOK + token) * 4)
                p.stg_u16(hidden + (Int64(hrow) * inter + column) * 2, p.f32_to_bf16_bits(value))
                if cutlass.const_expr(self.capture):
                    pair = p.lds_i32(table + token * 4)
                    at = (mt * W + w) * 4
                    p.stg_f32(cap_fc1 + (Int64(pair) * (2 * inter) + column) * 4, acc[at + t])
                    p.stg_f32(cap_fc1 + (Int64(pair) * (2 * inter) + inter + column) * 4,
                              acc[at + 2 + t])
                    p.stg_u8(cap_codes + Int64(pair) * inter + column, e4m3)
                    if g == 0 and local % 4 == 0:
                        p.stg_u8(cap_scales + Int64(pair) * (inter // 32) + column // 32, code)

    @cute.jit
    def epilogue_fc2(self, acc, table, out: Int64, lane, warp, tile, ntok):
        MT: cutlass.Constexpr = self.mtiles
        W: cutlass.Constexpr = self.windows
        g = lane // 4
        q = lane % 4
        for mt in cutlass.range_constexpr(MT):
            row0 = (tile * (self.warps * MT) + warp * MT + mt) * 16 + g
            for w in cutlass.range_constexpr(W):
                at = (mt * W + w) * 4
                for t in cutlass.range_constexpr(2):
                    token = w * WINDOW + 2 * q + t
                    if token < ntok:
                        pair = p.lds_i32(table + token * 4)
                        base = out + (Int64(pair) * self.latent + row0) * 2
                        p.stg_u16(base, p.f32_to_bf16_bits(acc[at + t]))
                        p.stg_u16(base + 16, p.f32_to_bf16_bits(acc[at + 2 + t]))


class FusedExpertsKernel:
    """FC1 and FC2 of one call in one persistent grid (tactic ``fused``).

    One counter hands out the FC1 items (``(expert, tile, window group)`` as in
    ``ExpertsGemmKernel``), then the FC2 items. A CTA runs each item with the GEMM's own
    code (``fc1``, ``fc2``: the two ``ExpertsGemmKernel`` shapes, which share warps, windows
    and m-tiles). After an FC1 item's hidden rows are stored, thread 0 counts it at its
    expert (``Workspace.ready``, GPU-scope release after a barrier). An FC2 item requests
    its first ``RING - 1`` stages of weights, then waits (GPU-scope acquire) until its
    expert's count is ``fc1.tiles`` times the expert's window groups, then copies the
    hidden rows. Items are claimed in order and an FC1 item never waits, so every FC2 wait
    ends; a timeout records ``ERROR_GATE_TIMEOUT`` all the same. What this removes: the
    FC1 grid's tail and the FC2 grid's ramp, where the multiprocessors that finished their
    FC1 items idle until the last FC1 item ends.

    Every output's sums are those of the two kernels (same chunk order, same epilogues):
    the tactic changes no bit.
    """

    def __init__(self, fc1: ExpertsGemmKernel, fc2: ExpertsGemmKernel):
        if not fc1.fc1 or fc2.fc1:
            raise ValueError("FusedExpertsKernel takes an FC1 and an FC2 ExpertsGemmKernel")
        same = ("warps", "mtiles", "windows", "chains", "wgmma", "count", "top_k")
        differ = [a for a in same if getattr(fc1, a) != getattr(fc2, a)]
        if differ:
            raise ValueError(f"FusedExpertsKernel: FC1 and FC2 differ in {differ}")
        fc1.signal = True
        fc2.gate, fc2.fc1_tiles = True, fc1.tiles
        fc1.pdl = fc2.pdl = False
        self.fc1, self.fc2 = fc1, fc2
        self.threads = fc1.threads
        self.smem_bytes = max(fc1.smem_bytes, fc2.smem_bytes)
        self.occupancy = min(fc1.occupancy, fc2.occupancy)
        self.pdl_chain = fc1.pdl_chain
        self.ws = fc1.ws

    @classmethod
    def compile_args(cls, *, fc1: tuple, fc2: tuple):
        """(kernel, fake arguments but the stream) for ``fast.device.compile.compiled``."""
        return (cls(ExpertsGemmKernel(**dict(fc1)), ExpertsGemmKernel(**dict(fc2))),
                [Int64(0)] * 12 + [Int32(1), Int32(1)])

    @cute.jit
    def __call__(self, w13: Int64, s13: Int64, plan: Int64, lists: Int64, work: Int64,
                 hidden: Int64, w2: Int64, s2: Int64, out: Int64, cap_fc1: Int64,
                 cap_codes: Int64, cap_scales: Int64, capacity: Int32, grid: Int32, stream):
        self.kernel(w13, s13, plan, lists, work, hidden, w2, s2, out, cap_fc1, cap_codes,
                    cap_scales, capacity).launch(
            grid=(grid, 1, 1), block=(self.threads, 1, 1), stream=stream, smem=self.smem_bytes,
            min_blocks_per_mp=self.occupancy, preferred_smem_carveout=100,
            use_pdl=self.pdl_chain)

    @cute.kernel
    def kernel(self, w13: Int64, s13: Int64, plan: Int64, lists: Int64, work: Int64,
               hidden: Int64, w2: Int64, s2: Int64, out: Int64, cap_fc1: Int64,
               cap_codes: Int64, cap_scales: Int64, capacity: Int32):
        tid = cute.arch.thread_idx()[0]
        lane = tid % 32
        warp = tid // 32
        ring, info, table, red = self.fc1._shared()
        acc1, src1, dst1, ok1 = self.fc1._registers()
        acc2, src2, dst2, ok2 = self.fc2._registers()
        null = Int64(0)
        if cutlass.const_expr(self.pdl_chain):
            cute.arch.griddepcontrol_wait()
        first = Int32(1)
        item = self.claim(work, info, tid)
        while item >= 0:
            if p.lds_i32(info + 24) == 0:
                self.fc1._item(w13, s13, plan, lists, work, hidden, cap_fc1, cap_codes, cap_scales,
                         capacity,
                         ring, info, table, red, acc1, src1, dst1, ok1, tid, lane, warp, first)
            else:
                self.fc2._item(w2, s2, hidden, lists, work, out, null, null, null, capacity,
                         ring, info, table, red, acc2, src2, dst2, ok2, tid, lane, warp, first)
            first = Int32(0)
            item = self.claim(work, info, tid)

    @cute.jit
    def claim(self, work: Int64, info, tid):
        """Thread 0 takes the next item: FC1's first, then FC2's; ``info + 24`` says which
        GEMM (0, 1). Every thread returns the item (-1: none left) after a barrier."""
        cute.arch.sync_threads()
        if tid == 0:
            groups = p.ldg_i32(work + Int64(self.ws.wgp + self.fc1.count) * 4)
            total1 = groups * self.fc1.tiles
            item = p.atomic_add(work + Int64(self.ws.claim) * 4, 1)
            if item < total1:
                self.fc1.locate(work, info, item, item, Int32(self.fc1.tiles))
                p.sts_i32(info + 24, 0)
            elif item < total1 + groups * self.fc2.item_tiles:
                self.fc2.locate(work, info, item, item - total1, Int32(self.fc2.item_tiles))
                p.sts_i32(info + 24, 1)
            else:
                p.sts_i32(info, -1)
        cute.arch.sync_threads()
        return p.lds_i32(info)
