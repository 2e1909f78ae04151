"""The routed experts on Blackwell (sm_100a / sm_103a): MXFP4 weights x MXFP8 activations
through the tensor cores' native block scaling (``tcgen05.mma.kind::mxf8f6f4.block_scale``).

**Status: compiled for sm_100a and sm_103a; not run on a GPU** (none was available where
it was written). ``tests/test_experts_blackwell.py`` compiles it for both targets and holds
the contract a Blackwell GPU must pass (FC1 within a derived bound of the exact product,
SiTU + MXFP8 bitwise, FC2 within its bound plus the BF16 rounding); elsewhere that test
skips with the reason "needs an SM100 GPU". The schedules run it on sm_100a / sm_103a
(``fast.experts.select.experts_engine_for``); the Hopper engine (``fast.experts``, BF16
``mma.sync`` / ``wgmma`` on decoded weights) is the engine of record on sm_90a, where
every contract has run.

What it computes, per routed pair (token row ``t``, slot ``k``, expert ``e``), is what
``reference.experts.pair_rows_fp32`` defines, with the FC1 and FC2 sums done by the tensor
cores:

1. FC1 = the row's MXFP8 latent (E4M3 codes, E8M0 scales per 32, as the caller passes
   them) x the MXFP4 ``w13[e]`` (E2M1 codes, E8M0 scales per 32): every product is
   ``e2m1 * e4m3 * 2^(sa + sb - 254)``, exact, accumulated in FP32 in tensor memory;
2. SiTU-and-mul in FP32 and the RCEIL MXFP8 re-quantization: the Hopper FC1 epilogue's own
   helpers (``ExpertsGemmKernel.situ`` / ``rceil``, the same IEEE sequence), written as
   MXFP8 hidden rows (codes and scales, not BF16: FC2 consumes them natively);
3. FC2 = hidden x MXFP4 ``w2[e]``, FP32 in tensor memory, one rounding to BF16.

One call is four launches: the Hopper engine's ``RoutingListsKernel`` (routing lists;
its BF16 plan rows are written but not read here) and ``PlanKernel`` (work items of
``8 * windows`` tokens per expert and tile, prefix sums), then ``BlockScaledExpertsKernel``
for FC1 and for FC2.

**The kernel** (one CTA of 4 warps per work item, persistent, items claimed from the work
counter as in ``ExpertsGemmKernel``; swap-AB: the weights are the MMA's A = M = 128 rows,
the item's tokens its B = N = ``8 * windows`` columns):

* weights: TMA (``make_tiled_tma_atom_A`` with ``internal_type=Int8``: the packed E2M1
  codes land in shared memory one per byte, the layout ``kind::mxf8f6f4`` reads when its
  operands differ in width) in stages of 128 rows x 128 k, with their scale factors (TMA of
  the 128x4 tiled layout, ``model.swizzle.swizzle_scales_128x4``), through a ring of
  ``ring`` stages on mbarriers (TMA transaction bytes = the packed bytes read, as CUTLASS
  counts them);
* activations: the item's rows gathered once per item by all threads (``cp.async``, zero
  fill past the item's tokens) into the whole-K B operand in the 128-byte-swizzled K-major
  layout, and their scale factors into the B scale-factor layout, then
  ``fence.proxy.async`` and a barrier;
* warp 0 issues per k stage the scale-factor copies to tensor memory (``tcgen05.cp``) and 4
  block-scaled MMAs (``m128 n(8W) k32``), then ``tcgen05.commit`` to the stage's empty
  barrier (the ring refills it by TMA) and, after the last stage, to the accumulator's;
* epilogue (all 4 warps, ``tcgen05.ld.32x32b``: thread ``32w + l`` holds weight row
  ``32w + l`` of every token). FC1's prepared row order puts, in each 32-row group, 16
  gate rows then their 16 up rows, so one ``shfl.xor 16`` pairs them; the MXFP8 block
  (32 intermediate columns) is two warps, joined through shared memory.

Sum order: each output is the tensor cores' sum of ``K / 32`` block-scaled MMAs in k
order into one FP32 accumulator, independent of the other tokens (batch invariant by
construction: a pair's row does not depend on its window). The products are exact; only
the accumulation rounds. The bound the contract derives (``tests/test_experts_blackwell.py``,
``blockscaled_fc_bound``) assumes nothing about how the tensor core groups its additions:
each product is added once and each addition truncates by less than one FP32 ULP of its
largest term, so every product passes through at most ``2K`` relative losses of ``2^-23``:
``gamma_{2K}(2^-23) * sum |x w|`` plus the subnormal term of ``verify.bounds``.

Widths: ``L % 128 == 0`` and ``I_s % 128 == 0`` (FC2's K stage is 128; kimi_k3 at 1, 2, 4
and 8 ranks). Unlike the Hopper layout every E8M0 weight scale code is valid (the MMA
applies it; no BF16 decode range).

The schedules select this engine on sm_100a / sm_103a (``fast.experts.select``). What this
module does not do yet (see ``docs/stages/experts.md``): run (no Blackwell GPU was
available), overlap one item's epilogue with the next item's loads (no warp
specialization), multicast or 2-CTA MMAs, programmatic dependent launch, the Hopper
engine's tactics (tile, MMA kind, fused grid, walk: only ``ctas``).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100
import cutlass.utils.blockscaled_layout as bsl
from cutlass import Float32, Int32, Int64, Uint32
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass.memory import SmemAllocator, TmemAllocator
from cutlass.pipeline import NamedBarrier

from fast.device import SMEM_PER_CTA
from fast.device import fp32 as h
from fast.device import ptx as p
from fast.device.compile import compiled
from fast.experts.blackwell_layout import (
    ARCHS,
    K_STAGE,
    TILE_ROWS,
    BlackwellExperts,
    b_smem_offset,
    sfb_smem_offset,
)
from fast.experts.engine import check_ctas
from fast.experts.kernels import ExpertsGemmKernel
from fast.experts.layout import WINDOW
from fast.experts.lists import Workspace

__all__ = ["BlockScaledExpertsKernel", "BlackwellExpertsEngine", "compiled_kernel",
           "compile_blackwell"]

_TOP_K = 16
_GMEM = cute.AddressSpace.gmem


def _tcgen05_fence(kind: str):
    """``tcgen05.fence::before_thread_sync`` / ``after_thread_sync``: order this thread's
    tcgen05 operations (TMEM loads, MMAs) with a barrier between threads."""
    cute.arch.inline_ptx(f"tcgen05.fence::{kind}_thread_sync;", write_only_types=[],
                         read_only_args=[])


class BlockScaledExpertsKernel:
    """One GEMM of the block-scaled engine over every work item of a call: FC1
    (``fc1=True``: SiTU and MXFP8 hidden rows) or FC2 (BF16 rows). See the module docstring
    for the data flow; items are the Hopper engine's ``(expert, tile, window group)`` with
    128-row tiles.

    Arguments of a launch (device addresses as ``Int64``): ``weights``, ``wscales`` (the
    ``BlackwellExperts`` tensors of this GEMM); ``act`` / ``act_scales``: FC1 the call's
    E4M3 rows ``[R, L]`` and their E8M0 scales ``[R, L/32]``, FC2 the hidden codes ``[R*K,
    I_s]`` and scales ``[R*K, I_s/32]``; ``lists``, ``work``: the routing lists and work
    table (``fast.experts.lists``); ``out`` / ``out_scales``: FC1 the hidden codes and
    scales (row ``offs[e] + slot``), FC2 the BF16 rows ``[R*K, L]`` (``out_scales``
    unused); ``cap_*``: with ``capture``, FC1's FP32 outputs ``[R*K, 2 I_s]`` (gate columns,
    then up), E4M3 codes and E8M0 scales per pair.

    Constraints: ``rows % 128 == 0``, ``k % 128 == 0``, ``windows`` in 1, 2, 4.
    """

    def __init__(self, *, fc1: bool, rows: int, k: int, inter: int, latent: int, count: int,
                 windows: int, top_k: int = _TOP_K, ring: int | None = None,
                 capture: bool = False, beta: float = 4.0, linear_beta: float = 25.0):
        if windows not in (1, 2, 4):
            raise ValueError(f"windows must be 1, 2 or 4, got {windows}")
        if rows % TILE_ROWS or k % K_STAGE:
            raise ValueError(f"the block-scaled kernel tiles rows % 128 == 0 and K % 128 == 0, "
                             f"got rows={rows}, K={k}")
        self.fc1, self.rows, self.k, self.inter, self.latent = fc1, rows, k, inter, latent
        self.count, self.windows, self.top_k, self.capture = count, windows, top_k, capture
        self.beta, self.linear_beta = beta, linear_beta
        self.tokens = WINDOW * windows  # the MMA's N
        self.tiles = rows // TILE_ROWS
        self.ktiles = k // K_STAGE
        self.b_bytes = self.ktiles * self.tokens * K_STAGE  # whole-K B operand
        self.sfb_bytes = self.ktiles * 512  # one 128x4 scale chunk per k stage
        self.stage_bytes = TILE_ROWS * K_STAGE + 512  # unpacked A stage + its scales
        budget = SMEM_PER_CTA - self.b_bytes - self.sfb_bytes - 4096
        ring = ring or max(2, min(8, budget // self.stage_bytes))
        if ring < 2 or ring * self.stage_bytes > budget:
            raise ValueError(f"a ring of {ring} stages ({self.stage_bytes} B each) does not fit "
                             f"beside the {self.b_bytes + self.sfb_bytes} B B operand")
        self.ring = ring
        # accumulator (N <= 32 columns) at column 0, A and B scale factors (16 columns each)
        # at columns 32 and 64
        self.tmem_cols = 128
        self.ws = Workspace(count)
        self.search_steps = max(1, math.ceil(math.log2(count + 1)))
        self.gate = False  # read by the shared locate (no fused FC2 here)
        # the Hopper FC1 epilogue's SiTU and RCEIL, bit for bit (same IEEE sequence)
        self._epi = object.__new__(ExpertsGemmKernel)
        self._epi.beta, self._epi.linear_beta = beta, linear_beta

    # the Hopper engine's claim and item location (same work table, same items)
    claim = ExpertsGemmKernel.claim
    claim_locate = ExpertsGemmKernel.claim_locate
    locate = ExpertsGemmKernel.locate
    token_table = ExpertsGemmKernel.token_table

    def _tiled_mma(self):
        """The block-scaled MMA ``m128 n(8W) k32`` of kind ``mxf8f6f4``: A = E2M1 weights,
        B = E4M3 activations, both K-major, UE8M0 scales per 32, FP32 accumulator."""
        op = tcgen05.MmaMXF8F6F4Op(cutlass.Float4E2M1FN, cutlass.Float8E4M3FN,
                                   (TILE_ROWS, self.tokens, 32), tcgen05.CtaGroup.ONE,
                                   tcgen05.OperandSource.SMEM, OperandMajorMode.K,
                                   OperandMajorMode.K)
        return cute.make_tiled_mma(cute.make_mma_atom(op))

    def _mma_tiler(self):
        return (TILE_ROWS, self.tokens, K_STAGE)

    @classmethod
    def compile_args(cls, **params):
        """(kernel, fake arguments but the stream) for ``fast.device.compile.compiled``."""
        return cls(**params), [Int64(0)] * 11 + [Int32(1), Int32(1)]

    @cute.jit
    def __call__(self, weights: Int64, wscales: Int64, act: Int64, act_scales: Int64,
                 lists: Int64, work: Int64, out: Int64, out_scales: Int64, cap_fc1: Int64,
                 cap_codes: Int64, cap_scales: Int64, capacity: Int32, grid: Int32, stream):
        tiled_mma = self._tiled_mma()
        tiler = self._mma_tiler()
        a_layout = sm100.make_smem_layout_a(tiled_mma, tiler, cutlass.Int8, self.ring)
        b_layout = sm100.make_smem_layout_b(tiled_mma, tiler, cutlass.Float8E4M3FN, self.ktiles)
        sfa_layout = bsl.make_smem_layout_sfa(tiled_mma, tiler, 32, self.ring)
        sfb_layout = bsl.make_smem_layout_sfb(tiled_mma, tiler, 32, self.ktiles)
        a = cute.make_tensor(
            cute.make_ptr(cutlass.Float4E2M1FN, weights, _GMEM, assumed_align=32),
            cute.make_layout((self.rows, self.k, self.count),
                             stride=(self.k, 1, self.rows * self.k)))
        sfa = cute.make_tensor(
            cute.make_ptr(cutlass.Float8E8M0FNU, wscales, _GMEM, assumed_align=16),
            bsl.tile_atom_to_shape_SF(a.shape, 32))
        cluster = cute.tiled_divide(cute.make_layout((1, 1, 1)), (tiled_mma.thr_id.shape,))
        a_stage = cute.slice_(a_layout, (None, None, None, 0))
        sfa_stage = cute.slice_(sfa_layout, (None, None, None, 0))
        tma_a, g_a = cute.nvgpu.make_tiled_tma_atom_A(
            cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE), a, a_stage, tiler, tiled_mma,
            cluster.shape, internal_type=cutlass.Int8)
        tma_sfa, g_sfa = cute.nvgpu.make_tiled_tma_atom_A(
            cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE), sfa, sfa_stage, tiler,
            tiled_mma, cluster.shape, internal_type=cutlass.Int16)
        # transaction bytes: what TMA reads (packed E2M1), as CUTLASS counts them
        tx = (cute.size_in_bytes(cutlass.Float4E2M1FN, a_stage)
              + cute.size_in_bytes(cutlass.Float8E8M0FNU, sfa_stage))
        self.kernel(tiled_mma, tma_a, g_a, tma_sfa, g_sfa, a_layout, b_layout, sfa_layout,
                    sfb_layout, tx, act, act_scales, lists, work, out, out_scales, cap_fc1,
                    cap_codes, cap_scales, capacity).launch(
            grid=(grid, 1, 1), block=(128, 1, 1), stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_a: cute.CopyAtom, g_a: cute.Tensor,
               tma_sfa: cute.CopyAtom, g_sfa: cute.Tensor, a_layout: cute.ComposedLayout,
               b_layout: cute.ComposedLayout, sfa_layout: cute.Layout, sfb_layout: cute.Layout,
               tx: cutlass.Constexpr, act: Int64, act_scales: Int64, lists: Int64, work: Int64,
               out: Int64, out_scales: Int64, cap_fc1: Int64, cap_codes: Int64,
               cap_scales: Int64, capacity: Int32):
        RING: cutlass.Constexpr = self.ring
        KT: cutlass.Constexpr = self.ktiles
        N: cutlass.Constexpr = self.tokens
        tid = cute.arch.thread_idx()[0]
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tid % 32

        @cute.struct
        class Storage:
            full: cute.struct.MemRange[cutlass.Int64, RING]
            empty: cute.struct.MemRange[cutlass.Int64, RING]
            acc: cutlass.Int64
            tmem: cutlass.Int32
            info: cute.struct.MemRange[cutlass.Int32, 8]
            table: cute.struct.MemRange[cutlass.Int32, 3 * N]
            red: cute.struct.MemRange[cutlass.Float32, 4 * N]

        smem = SmemAllocator()
        storage = smem.allocate(Storage)
        sA = smem.allocate_tensor(element_type=cutlass.Int8, layout=a_layout.outer,
                                  byte_alignment=1024, swizzle=a_layout.inner)
        sB = smem.allocate_tensor(element_type=cutlass.Float8E4M3FN, layout=b_layout.outer,
                                  byte_alignment=1024, swizzle=b_layout.inner)
        sSFA = smem.allocate_tensor(element_type=cutlass.Float8E8M0FNU, layout=sfa_layout,
                                    byte_alignment=128)
        sSFB = smem.allocate_tensor(element_type=cutlass.Float8E8M0FNU, layout=sfb_layout,
                                    byte_alignment=128)
        full = storage.full.data_ptr()
        empty = storage.empty.data_ptr()
        acc_bar = storage.acc.ptr
        info = storage.info.data_ptr().toint()
        table = storage.table.data_ptr().toint()
        red = storage.red.data_ptr().toint()
        b_base = sB.iterator.toint()
        sfb_base = sSFB.iterator.toint()

        if warp == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_sfa)
            with cute.arch.elect_one():
                for s in cutlass.range_constexpr(RING):
                    cute.arch.mbarrier_init(full + s, 1)
                    cute.arch.mbarrier_init(empty + s, 1)
                cute.arch.mbarrier_init(acc_bar, 1)
            cute.arch.mbarrier_init_fence()
        tmem = TmemAllocator(storage.tmem.ptr,
                             barrier_for_retrieve=NamedBarrier(barrier_id=1, num_threads=128))
        tmem.allocate(self.tmem_cols)
        tmem.wait_for_alloc()
        acc_ptr = tmem.retrieve_ptr(Float32)

        # MMA operands: A (ring) and B (whole K) in shared memory, C and scales in TMEM
        thr_mma = tiled_mma.get_slice(0)
        tCrA = tiled_mma.make_fragment_A(sA)
        tCrB = tiled_mma.make_fragment_B(sB)
        acc_shape = tiled_mma.partition_shape_C(self._mma_tiler()[:2])
        tCtAcc = cute.make_tensor(acc_ptr, tiled_mma.make_fragment_C(acc_shape).layout)
        # scale factors at columns 32 and 64 (32-column aligned past the accumulator's N <= 32)
        sfa_tmem = cute.recast_ptr(acc_ptr + 32, dtype=cutlass.Float8E8M0FNU)
        tCtSFA = cute.make_tensor(sfa_tmem, bsl.make_tmem_layout_sfa(
            tiled_mma, self._mma_tiler(), 32, cute.slice_(sfa_layout, (None, None, None, 0))))
        sfb_tmem = cute.recast_ptr(acc_ptr + 64, dtype=cutlass.Float8E8M0FNU)
        tCtSFB = cute.make_tensor(sfb_tmem, bsl.make_tmem_layout_sfb(
            tiled_mma, self._mma_tiler(), 32, cute.slice_(sfb_layout, (None, None, None, 0))))
        s2t_atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(tcgen05.CtaGroup.ONE),
                                       cutlass.Float8E8M0FNU)
        s2t_sfa, s_sfa, t_sfa = self._s2t(s2t_atom, sSFA, tCtSFA)
        s2t_sfb, s_sfb, t_sfb = self._s2t(s2t_atom, sSFB, tCtSFB)

        # TMA partitions of the weights and their scales: (expert, tile, k stage) -> stage
        g_a_tiles = cute.local_tile(g_a, cute.slice_(self._mma_tiler(), (None, 0, None)),
                                    (None, None, None))
        g_sfa_tiles = cute.local_tile(g_sfa, cute.slice_(self._mma_tiler(), (None, 0, None)),
                                      (None, None, None))
        tAsA, tAgA = cpasync.tma_partition(tma_a, 0, cute.make_layout(1),
                                           cute.group_modes(sA, 0, 3),
                                           cute.group_modes(thr_mma.partition_A(g_a_tiles), 0, 3))
        tAsSFA, tAgSFA = cpasync.tma_partition(
            tma_sfa, 0, cute.make_layout(1), cute.group_modes(sSFA, 0, 3),
            cute.group_modes(thr_mma.partition_A(g_sfa_tiles), 0, 3))
        tAsSFA = cute.filter_zeros(tAsSFA)
        tAgSFA = cute.filter_zeros(tAgSFA)

        # the accumulator -> registers: thread 32 w + l holds row 32 w + l, N columns
        t2r_atom = cute.make_copy_atom(
            tcgen05.Ld32x32bOp(getattr(tcgen05.Repetition, f"x{N}"), tcgen05.Pack.NONE), Float32)
        t2r = tcgen05.make_tmem_copy(t2r_atom, tCtAcc)
        thr_t2r = t2r.get_slice(tid)
        tTR_tAcc = thr_t2r.partition_S(tCtAcc)
        coords = thr_t2r.partition_D(thr_mma.partition_C(
            cute.make_identity_tensor((TILE_ROWS, N))))
        regs = cute.make_rmem_tensor(coords.shape, Float32)

        cute.arch.sync_threads()
        tiles = Int32(self.tiles)
        done = Int32(0)
        item = self.claim(work, info, tid, tiles)
        while item >= 0:
            expert = p.lds_i32(info + 4)
            tile = p.lds_i32(info + 8)
            group = p.lds_i32(info + 12)
            ntok = p.lds_i32(info + 16)
            base = done * KT
            if warp == 0:
                _tcgen05_fence("after")
                # the ring's first stages of this item (they wait for the previous item's
                # MMAs of the same slots)
                for j in cutlass.range_constexpr(min(RING, KT)):
                    self._load_stage(tma_a, tAgA, tAsA, tma_sfa, tAgSFA, tAsSFA, full, empty,
                                     tx, base + j, expert, tile, j)
            self.token_table(lists, work, table, expert, group, ntok, capacity, tid)
            cute.arch.sync_threads()
            self._gather(act, act_scales, table, ntok, b_base, sfb_base, tid)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()
            if warp == 0:
                self._mma_item(tiled_mma, tCtAcc, tCrA, tCrB, tCtSFA, tCtSFB, s2t_sfa, s_sfa,
                               t_sfa, s2t_sfb, s_sfb, t_sfb, tma_a, tAgA, tAsA, tma_sfa, tAgSFA,
                               tAsSFA, full, empty, acc_bar, tx, base, expert, tile)
            cute.arch.mbarrier_wait(acc_bar, done % 2)
            cute.copy(t2r, tTR_tAcc, regs)
            cute.arch.fence_view_async_tmem_load()
            if cutlass.const_expr(self.fc1):
                self._epilogue_fc1(regs, table, red, out, out_scales, cap_fc1, cap_codes,
                                   cap_scales, tile, ntok, warp, lane)
            else:
                self._epilogue_fc2(regs, table, out, tile, ntok, tid)
            _tcgen05_fence("before")
            done = done + 1
            item = self.claim(work, info, tid, tiles)
        tmem.relinquish_alloc_permit()
        cute.arch.sync_threads()
        tmem.free(acc_ptr)

    def _s2t(self, atom, s_sf, t_sf):
        """The shared -> tensor memory copy of a scale-factor operand (``tcgen05.cp``)."""
        t_compact = cute.filter_zeros(t_sf)
        copy = tcgen05.make_s2t_copy(atom, t_compact)
        thr = copy.get_slice(0)
        src = tcgen05.get_s2t_smem_desc_tensor(copy, thr.partition_S(cute.filter_zeros(s_sf)))
        return copy, src, thr.partition_D(t_compact)

    @cute.jit
    def _load_stage(self, tma_a, tAgA, tAsA, tma_sfa, tAgSFA, tAsSFA, full, empty,
                    tx: cutlass.Constexpr, g, expert, tile, kt):
        """Warp 0: the weights and scales of k stage ``kt`` into ring slot ``g % RING``
        (``g``: the CTA's running stage count) once the MMAs of stage ``g - RING`` (the
        slot's previous contents) are done."""
        RING: cutlass.Constexpr = self.ring
        slot = g % RING
        if g >= RING:
            cute.arch.mbarrier_wait(empty + slot, (g // RING - 1) % 2)
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(full + slot, tx)
        cute.copy(tma_a, tAgA[(None, tile, kt, expert)], tAsA[(None, slot)],
                  tma_bar_ptr=full + slot)
        cute.copy(tma_sfa, tAgSFA[(None, tile, kt, expert)], tAsSFA[(None, slot)],
                  tma_bar_ptr=full + slot)

    @cute.jit
    def _mma_item(self, tiled_mma, tCtAcc, tCrA, tCrB, tCtSFA, tCtSFB, s2t_sfa, s_sfa, t_sfa,
                  s2t_sfb, s_sfb, t_sfb, tma_a, tAgA, tAsA, tma_sfa, tAgSFA, tAsSFA, full,
                  empty, acc_bar, tx: cutlass.Constexpr, base, expert, tile):
        """Warp 0: every k stage of the item in order: wait for its weights, copy both
        operands' scale factors to tensor memory, 4 block-scaled MMAs (the first of the
        item overwrites the accumulator), release the slot; refill the previous stage's
        slot with stage ``kt - 1 + RING``; after the last, signal the accumulator."""
        RING: cutlass.Constexpr = self.ring
        KT: cutlass.Constexpr = self.ktiles
        for kt in cutlass.range(KT, unroll=1):
            g = base + kt
            slot = g % RING
            cute.arch.mbarrier_wait(full + slot, (g // RING) % 2)
            cute.copy(s2t_sfa, s_sfa[(None, None, None, None, slot)], t_sfa)
            cute.copy(s2t_sfb, s_sfb[(None, None, None, None, kt)], t_sfb)
            tiled_mma.set(tcgen05.Field.ACCUMULATE, kt != 0)
            for kb in cutlass.range_constexpr(K_STAGE // 32):
                tiled_mma.set(tcgen05.Field.SFA, tCtSFA[(None, None, kb)].iterator)
                tiled_mma.set(tcgen05.Field.SFB, tCtSFB[(None, None, kb)].iterator)
                cute.gemm(tiled_mma, tCtAcc, tCrA[(None, None, kb, slot)],
                          tCrB[(None, None, kb, kt)], tCtAcc)
                tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
            with cute.arch.elect_one():
                tcgen05.commit(empty + slot)
            if kt >= 1:
                if kt - 1 + RING < KT:
                    self._load_stage(tma_a, tAgA, tAsA, tma_sfa, tAgSFA, tAsSFA, full, empty,
                                     tx, g - 1 + RING, expert, tile, kt - 1 + RING)
        with cute.arch.elect_one():
            tcgen05.commit(acc_bar)

    @cute.jit
    def _gather(self, act: Int64, act_scales: Int64, table, ntok, b_base, sfb_base, tid):
        """All threads: the item's B operand for the whole K, ``cp.async`` 16 bytes at a
        time into the 128-byte-swizzled K-major layout (``b_smem_offset``; tokens past
        ``ntok`` zero-filled), and 4 scale bytes per token and k stage into the stage's B
        scale-factor chunk (``sfb_smem_offset``; tokens past ``ntok`` read token 0's, their
        codes are 0)."""
        N: cutlass.Constexpr = self.tokens
        K: cutlass.Constexpr = self.k
        KT: cutlass.Constexpr = self.ktiles
        per_row: cutlass.Constexpr = K // 16
        granules: cutlass.Constexpr = N * per_row
        for i in cutlass.range((granules + 127) // 128, unroll=4):
            gi = tid + 128 * i
            if gi < granules:
                n = gi // per_row
                j = gi % per_row
                live = n < ntok
                row = p.lds_i32(table + (N + cutlass.select_(live, n, Int32(0))) * 4)
                dst = b_smem_offset(n, j, N)
                p.cp_async_16(b_base + dst, act + Int64(row) * K + j * 16, live)
        pieces: cutlass.Constexpr = N * KT
        for i in cutlass.range_constexpr((pieces + 127) // 128):
            gi = tid + 128 * i
            if gi < pieces:
                n = gi // KT
                kt = gi % KT
                row = p.lds_i32(table + (N + cutlass.select_(n < ntok, n, Int32(0))) * 4)
                dst = sfb_smem_offset(n, kt)
                p.cp_async_4(sfb_base + dst, act_scales + Int64(row) * (K // 32) + kt * 4)

    @cute.jit
    def _epilogue_fc1(self, regs, table, red, hidden: Int64, hidden_scales: Int64,
                      cap_fc1: Int64, cap_codes: Int64, cap_scales: Int64, tile, ntok, warp,
                      lane):
        """Thread ``32 w + l``: row ``32 w + l`` of the tile for every token (``regs``).
        Lanes ``l`` and ``l + 16`` exchange their values (``shfl.xor 16``) so that both
        hold column ``c = 64 tile + 16 w + l % 16``'s gate and up; lane ``l < 16`` finishes
        the first half of the tokens, ``l + 16`` the second: SiTU, the block maximum
        (16 columns in the warp, then the two warps of the block through shared memory),
        the RCEIL scale, the E4M3 code, stored to the pair's hidden row (and the capture)."""
        N: cutlass.Constexpr = self.tokens
        H: cutlass.Constexpr = N // 2
        inter: cutlass.Constexpr = self.inter
        hi = lane >= 16
        column = tile * 64 + warp * 16 + lane % 16
        act = cute.make_rmem_tensor((H,), Float32)
        gates = cute.make_rmem_tensor((H,), Float32)
        ups = cute.make_rmem_tensor((H,), Float32)
        for j in cutlass.range_constexpr(H):
            # lane < 16 holds gate rows and finishes token j; lane >= 16 holds up rows and
            # finishes token j + H: each sends its partner the value the partner lacks
            mine_lo = regs[j]
            mine_hi = regs[j + H]
            got = h.from_bits(p.shfl_xor(h.bits(cutlass.select_(hi, mine_lo, mine_hi)), 16))
            g = cutlass.select_(hi, got, mine_lo)
            u = cutlass.select_(hi, mine_hi, got)
            gates[j] = g
            ups[j] = u
            a = self._epi.situ(g, u)
            act[j] = a
            m = h.bits(a) & Uint32(0x7FFFFFFF)
            for o in (1, 2, 4, 8):
                m = cutlass.max(m, p.shfl_xor(m, o))
            if lane % 16 == 0:
                token = j + cutlass.select_(hi, Int32(H), Int32(0))
                p.sts_f32(red + (warp * N + token) * 4, h.from_bits(m))
        cute.arch.sync_threads()
        pair_warp = warp - warp % 2
        for j in cutlass.range_constexpr(H):
            token = j + cutlass.select_(hi, Int32(H), Int32(0))
            amax = h.fmax_nan(p.lds_f32(red + (pair_warp * N + token) * 4),
                              p.lds_f32(red + ((pair_warp + 1) * N + token) * 4))
            code, mult = self._epi.rceil(amax)
            e4m3 = p.f32x2_to_e4m3x2(h.fmul(act[j], mult), Float32(0.0)) & Uint32(0xFF)
            if token < ntok:
                hrow = p.lds_i32(table + (2 * N + token) * 4)
                p.stg_u8(hidden + Int64(hrow) * inter + column, e4m3)
                first_of_block = (warp % 2 == 0) & (lane % 16 == 0)
                if first_of_block:
                    p.stg_u8(hidden_scales + Int64(hrow) * (inter // 32) + column // 32, code)
                if cutlass.const_expr(self.capture):
                    pair = p.lds_i32(table + token * 4)
                    p.stg_f32(cap_fc1 + (Int64(pair) * (2 * inter) + column) * 4, gates[j])
                    p.stg_f32(cap_fc1 + (Int64(pair) * (2 * inter) + inter + column) * 4, ups[j])
                    p.stg_u8(cap_codes + Int64(pair) * inter + column, e4m3)
                    if first_of_block:
                        p.stg_u8(cap_scales + Int64(pair) * (inter // 32) + column // 32, code)

    @cute.jit
    def _epilogue_fc2(self, regs, table, out: Int64, tile, ntok, tid):
        """Thread ``t``: output column ``128 tile + t`` of every live token's pair row,
        rounded once to BF16."""
        N: cutlass.Constexpr = self.tokens
        column = tile * TILE_ROWS + tid
        for n in cutlass.range_constexpr(N):
            if n < ntok:
                pair = p.lds_i32(table + n * 4)
                p.stg_u16(out + (Int64(pair) * self.latent + column) * 2,
                          p.f32_to_bf16_bits(regs[n]))



# --- host side ---------------------------------------------------------------------------


def _fc_params(g, config, windows: int, capture: bool) -> dict:
    """The two block-scaled GEMMs of one geometry and window count (hashable params)."""
    common = dict(inter=g.inter, latent=g.latent, count=g.count, windows=windows,
                  top_k=config.top_k)
    return {
        "fc1": tuple(sorted(dict(common, fc1=True, rows=2 * g.inter, k=g.latent, capture=capture,
                                 beta=float(config.situ_beta),
                                 linear_beta=float(config.situ_linear_beta)).items())),
        "fc2": tuple(sorted(dict(common, fc1=False, rows=g.latent, k=g.inter).items())),
    }


def _list_params(g, config, windows: int, strict: bool, empty_rows: bool) -> dict:
    """The Hopper engine's routing-lists and plan kernels, unchanged (no launch chain)."""
    return {
        "lists": tuple(sorted(dict(latent=g.latent, top_k=config.top_k, experts=config.experts,
                                   first=g.first, count=g.count, strict=strict,
                                   empty_rows=empty_rows, pdl_chain=False).items())),
        "plan": tuple(sorted(dict(count=g.count, windows=windows, pdl_chain=False,
                                  fused=False).items())),
    }


def compiled_kernel(kind: str, arch: str, params: tuple):
    """The kernel ``kind`` (the Hopper engine's ``lists`` and ``plan``, or ``fc1`` / ``fc2``:
    the block-scaled GEMM) compiled for ``arch`` (``fast.device.compile``; cached there)."""
    from fast.experts import engine

    if kind in ("lists", "plan"):
        return engine.compiled_kernel(kind, arch, params)
    if arch not in ARCHS:
        raise ValueError(f"the block-scaled experts kernel targets {'/'.join(ARCHS)}, got {arch}")
    return compiled(BlockScaledExpertsKernel, arch, params)


def compile_blackwell(geometry, config, *, windows: int, arch: str, capture: bool = False,
                      strict: bool = False, empty_rows: bool = False) -> list:
    """Compile the four kernels of one call of ``geometry`` at ``windows`` for ``arch``
    (``sm_100a`` / ``sm_103a``; no GPU needed)."""
    if arch not in ARCHS:
        raise ValueError(f"the block-scaled experts kernel targets {'/'.join(ARCHS)}, got {arch}")
    if windows not in (1, 2, 4):
        raise ValueError(f"windows must be 1, 2 or 4, got {windows}")
    params = {**_list_params(geometry, config, windows, strict, empty_rows),
              **_fc_params(geometry, config, windows, capture)}
    return [compiled_kernel(kind, arch, p_) for kind, p_ in params.items()]


class BlackwellExpertsEngine:
    """The routed experts of one rank on an sm_100a / sm_103a GPU, through
    ``BlockScaledExpertsKernel`` (module docstring). **Not yet run on a GPU.** The
    schedules build it through ``fast.experts.select.experts_engine_for`` on those targets.

    The same calling convention as ``fast.experts.ExpertsEngine`` where the schedules use
    it (DEP owner or wide TP slice, ``strict``, ``empty_rows``, ``scratch``, ``validate``,
    ``capture``, ``listed``, ``list_params``, ``live_counts``, ``compile_for``, ``check``),
    over ``prepare_blackwell_experts(...)`` weights. ``tactic`` (the engine's and a call's)
    takes only ``ctas`` (the persistent grids' size): the Hopper engine's other keys choose
    among its ``mma.sync`` / ``wgmma`` kernel shapes, which this kernel does not have, and
    are refused by name. Buffers: the work table, routing lists and BF16 plan rows of the
    Hopper engine's list kernel (the plan rows are written there, not read here), and the
    MXFP8 hidden rows (codes ``[max_rows * K, I_s]``, scales ``[max_rows * K, I_s / 32]``)
    FC1 writes and FC2 reads. With an ``EngineScratch`` (``fast.experts.engine``; the DEP
    rank's layers share one) the first three are the scratch's and the hidden codes and
    scales are carved, in that order, out of the bytes of its BF16 hidden buffer (``2
    max_rows 16 I_s`` bytes hold ``max_rows K I_s (1 + 1/32)`` for ``K <= 16``).
    """

    #: The keys of ``tactic`` this engine takes (``fast.experts.engine.TACTIC_KEYS`` has
    #: the Hopper engine's).
    TACTIC_KEYS = ("ctas",)

    def __init__(self, prepared: BlackwellExperts, *, max_rows: int, strict: bool = False,
                 empty_rows: bool = False, scratch=None, tactic: dict | None = None):
        import torch

        from fast import backend
        from fast.experts.engine import EngineScratch

        if not isinstance(prepared, BlackwellExperts):
            raise TypeError(f"BlackwellExpertsEngine: prepared must be BlackwellExperts, got "
                            f"{type(prepared).__name__}")
        if prepared.device.type != "cuda":
            raise ValueError(f"BlackwellExpertsEngine: prepared experts must be on a CUDA device, "
                             f"got {prepared.device}")
        if not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"BlackwellExpertsEngine: max_rows must be a positive int, got "
                             f"{max_rows!r}")
        arch = backend.gpu_arch(prepared.device)
        if arch not in ARCHS:
            raise RuntimeError(f"BlackwellExpertsEngine: needs an SM100 GPU ({'/'.join(ARCHS)}), "
                               f"the device is {arch}")
        g, dev = prepared.geometry, prepared.device
        if g.latent % 256:
            raise ValueError(f"BlackwellExpertsEngine: the routing-lists kernel needs L % 256 == 0, "
                             f"got L={g.latent}")
        self.tactic = self.check_tactic(tactic or {})
        self.prepared, self.strict, self.empty_rows = prepared, strict, bool(empty_rows)
        self.config, self.geometry, self.device, self.arch = prepared.config, g, dev, arch
        k = self.config.top_k
        if scratch is None:
            scratch = EngineScratch(g, max_rows=max_rows, device=dev)
        elif not isinstance(scratch, EngineScratch):
            raise TypeError(f"BlackwellExpertsEngine: scratch must be EngineScratch, got "
                            f"{type(scratch).__name__}")
        elif (why := scratch.fits(g, max_rows, dev)) is not None:
            raise ValueError(f"BlackwellExpertsEngine: the scratch does not fit: {why}")
        self.scratch, self.max_rows, self.layout = scratch, scratch.max_rows, scratch.layout
        self.work, self.lists, self.plan = scratch.work, scratch.lists, scratch.plan
        pairs = self.max_rows * k
        held = scratch.hidden.view(torch.uint8).view(-1)
        need = pairs * g.inter + pairs * (g.inter // 32)
        if held.numel() < need:  # top_k > 16: more pairs than the scratch was sized for
            raise ValueError(f"BlackwellExpertsEngine: the scratch's hidden buffer holds "
                             f"{held.numel()} bytes, the MXFP8 hidden rows of {pairs} pairs "
                             f"need {need}")
        self.hidden = held[:pairs * g.inter].view(pairs, g.inter)
        self.hidden_scales = held[pairs * g.inter:need].view(pairs, g.inter // 32)
        self.sms = torch.cuda.get_device_properties(dev).multi_processor_count
        self._null = torch.zeros(16, dtype=torch.uint8, device=dev)

    # the Hopper engine's input checks, error word, capture buffers, routing-list
    # parameters and live counters (the same attributes and work table)
    from fast.experts.engine import ExpertsEngine as _E

    check_inputs = _E.check_inputs
    start_call = _E.start_call
    check = _E.check
    capture_buffers = _E.capture_buffers
    list_params = _E.list_params
    live_counts = _E.live_counts
    del _E

    @classmethod
    def check_tactic(cls, tactic) -> dict:
        """``tactic`` as a dict of ``TACTIC_KEYS``, refused by name otherwise."""
        if not isinstance(tactic, dict):
            raise TypeError(f"BlackwellExpertsEngine: tactic must be a dict of {cls.TACTIC_KEYS}, "
                            f"got {type(tactic).__name__}")
        other = sorted(set(tactic) - set(cls.TACTIC_KEYS))
        if other:
            raise ValueError(f"BlackwellExpertsEngine: tactic keys {other} are the Hopper engine's "
                             f"kernel shapes (fast.experts.ExpertsEngine); the block-scaled engine "
                             f"takes only {cls.TACTIC_KEYS}")
        check_ctas(tactic.get("ctas"), "BlackwellExpertsEngine")
        return dict(tactic)

    def _params(self, windows: int, capture: bool) -> dict:
        c, g = self.config, self.geometry
        return {**_list_params(g, c, windows, self.strict, self.empty_rows),
                **_fc_params(g, c, windows, capture)}

    def compile_for(self, rows: int) -> None:
        """Compile, on the host only, the kernels a call of ``rows`` rows launches with the
        default windows (``fast.experts.engine.choose_windows``), so that call launches at
        once (a real rank's peers wait for its rows with a timeout)."""
        from fast.experts.engine import choose_windows

        c = self.config
        for kind, p_ in self._params(choose_windows(rows, c.top_k, c.experts), False).items():
            compiled_kernel(kind, self.arch, p_)

    def __call__(self, codes, scales, ids, *, out=None, windows: int | None = None,
                 validate: bool = True, capture: bool = False, ctas: int | None = None,
                 tactic: dict | None = None, listed: bool = False):
        """Every local pair's expert row: BF16 ``[R*K, L]`` (rows of pairs that are not
        local are left untouched; default a new NaN-filled tensor), or ``(out, Capture)``
        with ``capture`` (FC1's FP32 outputs, the E4M3 codes and E8M0 scales of the hidden
        rows, per pair). Arguments as ``fast.experts.ExpertsEngine.__call__``
        (``listed``: the caller's kernel already appended the pairs to ``lists``, so the
        call launches from the plan kernel on); ``ctas`` (or ``tactic={"ctas": n}``, over
        the engine's own tactic): the persistent grids' size (default one CTA per
        multiprocessor; fewer make every CTA run many items, as the Hopper engine's tactic
        ``ctas``; no bit changes)."""
        from fast import backend

        check_ctas(ctas, "BlackwellExpertsEngine")
        own = {**self.tactic, **(self.check_tactic(tactic) if tactic is not None else {})}
        ctas = ctas or own.get("ctas")
        rows, out, windows = self.start_call(codes, scales, ids, out, windows)
        if scales.data_ptr() % 4:
            raise ValueError("BlackwellExpertsEngine: scales must be 4-byte aligned")
        if rows == 0:
            return (out, self.capture_buffers(0)) if capture else out
        c = self.config
        fn = {kind: compiled_kernel(kind, self.arch, p_)
              for kind, p_ in self._params(windows, capture).items()}
        cap = self.capture_buffers(rows) if capture else None

        def i64(t):
            return Int64(t.data_ptr())

        stream = backend.stream(self.device)
        work, null = i64(self.work), i64(self._null)
        if not listed:
            fn["lists"](i64(ids), i64(codes), i64(scales), i64(self.plan), i64(self.lists), work,
                        Int32(rows), Int32(self.max_rows), stream)
        fn["plan"](work, Int32(self.max_rows), Int32(rows * c.top_k), stream)
        caps = [i64(t) for t in ((cap.fc1, cap.codes, cap.scales) if cap else (self._null,) * 3)]
        p_ = self.prepared
        grid = Int32(ctas or self.sms)  # default one CTA per multiprocessor (shared memory)
        fn["fc1"](i64(p_.w13), i64(p_.s13), i64(codes), i64(scales), i64(self.lists), work,
                  i64(self.hidden), i64(self.hidden_scales), *caps, Int32(self.max_rows), grid,
                  stream)
        fn["fc2"](i64(p_.w2), i64(p_.s2), i64(self.hidden), i64(self.hidden_scales),
                  i64(self.lists), work, i64(out), null, null, null, null, Int32(self.max_rows),
                  grid, stream)
        if validate:
            self.check()
        return (out, cap) if capture else out
