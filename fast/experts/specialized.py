"""The warp-specialized experts kernel (tactic ``specialized``, sm_90a): FC1 and FC2 of one
call in one persistent grid, as ``kernels.FusedExpertsKernel``, with the data movement
taken out of the computing warps.

Why: at four windows per item the fused kernel's eight warps both copy and compute, and
every stage ends at a CTA barrier; a warp waiting at it, or issuing its copies, is a warp
not decoding, and with two CTAs of three 12.5-25 KB slots per multiprocessor only two
stages of weights per CTA are in flight. Here one CTA per multiprocessor holds a deep ring
(six to eight 25 KB slots: over 100 KB of weights requested ahead), a *producer* warp fills
it, and the *consumer* warps (the same tile, decode and warpgroup MMAs as the fused kernel's
``wgmma`` tactic) only wait on the slot they read next.

Roles (``producers`` warps after the ``warps`` consumer warps):

* **producer** (warp ``warps``; with ``producers = 2`` also warp ``warps + 1``, which
  shares the B-operand copies): claims the next item (the fused kernel's counter and
  search), writes its info and token table into item slot ``i % items``, announces it
  (``item_full``), then streams its stages into the ring: per stage, once the slot is
  released (``empty``), one bulk copy per m-tile of weights and one per m-tile of scales
  (``cp.async.bulk``, counted in transaction bytes on the slot's ``full`` barrier) and the
  B operand's 4-byte ``cp.async`` words in the ``wgmma`` core-matrix layout (zero past the
  item's tokens), each producer lane arriving on ``full`` once its copies have landed
  (``cp.async.mbarrier.arrive.noinc``). An FC2 item requests the weights of its first
  ``min(ring, stages)`` stages, then waits until its expert's FC1 items are all counted
  (the fused kernel's gate: relaxed polls, one GPU-scope acquire fence), then copies their
  hidden rows.
* **consumers** (warps ``0 .. warps - 1``, whole warpgroups): wait for the item
  (``item_full``), then per stage wait for its slot (``full``), make the copied B operand
  visible to the tensor cores (``fence.proxy.async``), decode and multiply
  (``ExpertsGemmKernel``'s ``wgmma`` stage, which ends with every MMA group complete) and
  release the slot (``empty``: one arrival per consumer warp); then the GEMM's epilogue,
  whose block maxima meet at a named barrier of the consumer threads
  (``kernels.EPILOGUE_BARRIER``); an FC1 item is then counted at its expert; last, the
  item slot is released (``item_empty``).

Bits: every output's sum is the fused kernel's (the same stage code in the same chunk
order, the same epilogues), so the tactic changes no bit; the contracts run it beside the
others. Waits: every barrier wait polls ``mbarrier.try_wait`` at most
``PIPELINE_SPIN_LIMIT`` times; a wait that runs out records ``ERROR_PIPELINE_TIMEOUT``
(the barrier's kind and the stage or item count) and marks the CTA aborted, after which
its waits return at once and its producers issue no more bulk copies; before the CTA
exits they wait ``ABORT_DRAIN_NS`` for the copies issued before the abort to land, so a
broken pipeline ends with an error that ``ExpertsEngine.check`` raises instead of a hang
or a fault.

Constraints: ``wgmma`` tiles (``warps % 4 == 0``, one accumulator chain), no walk, at most
four windows (the producer warp's lanes write one token each of the token table), both
GEMMs with the same stage shape (``stage_chunks``), and the ring's slots at least 2.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from fast.device import SMEM_PER_CTA
from fast.device import ptx as p
from fast.experts.kernels import GATE_SPIN_LIMIT, ExpertsGemmKernel
from fast.experts.layout import WGMMA_WORD_STRIDE, WINDOW, b_offset_wgmma
from fast.experts.lists import ERROR_GATE_TIMEOUT, ERROR_PIPELINE_TIMEOUT

__all__ = ["SpecializedExpertsKernel", "weight_block", "scale_block", "PIPELINE_SPIN_LIMIT",
           "ABORT_DRAIN_NS",
           "PRODUCER_BARRIER",
           "WAIT_FULL", "WAIT_EMPTY", "WAIT_ITEM_FULL", "WAIT_ITEM_EMPTY", "WAIT_KINDS"]

#: How many ``mbarrier.try_wait`` polls a wait makes before it records
#: ``ERROR_PIPELINE_TIMEOUT`` (each poll may suspend the thread for a while: far more than
#: any stage takes, seconds at most).
PIPELINE_SPIN_LIMIT = 1 << 20
#: How long (``%globaltimer`` ns) an aborted CTA's producers wait before the CTA exits, so
#: the bulk copies they issued before the abort land in shared memory that still exists: a
#: full ring of every multiprocessor (132 x 8 x 25 KB, 26 MB) takes about 9 us at the
#: H200's HBM rate; 1 ms is a hundred times that.
ABORT_DRAIN_NS = 1_000_000
#: The named barrier of the producer warps (with ``producers = 2``).
PRODUCER_BARRIER = 2
#: Which wait timed out (the error's second word): a stage's ``full`` or ``empty``
#: barrier, an item slot's ``item_full`` or ``item_empty``.
WAIT_FULL, WAIT_EMPTY, WAIT_ITEM_FULL, WAIT_ITEM_EMPTY = 1, 2, 3, 4
#: Their names, as ``ExpertsEngine.check`` reports a timeout.
WAIT_KINDS = {WAIT_FULL: "stage full", WAIT_EMPTY: "stage empty", WAIT_ITEM_FULL: "item full",
              WAIT_ITEM_EMPTY: "item empty"}
#: Bytes of an mbarrier.
_MBAR = 8
#: Int32 words of an item slot's info (as ``ExpertsGemmKernel.locate`` writes it, plus the
#: GEMM at word 6).
_INFO_WORDS = 8


def weight_block(gemm: ExpertsGemmKernel, block, stage):
    """(shared offset in a ring slot, global byte offset from the item's first m-tile,
    bytes) of the bulk copy of weight block ``block`` (consumer warp ``block // mtiles``,
    its m-tile ``block % mtiles``) of ``stage``: the ``stage_chunks`` chunks of 512 bytes
    that ``ExpertsGemmKernel`` copies lane by lane, contiguous on both sides. Plain
    arithmetic: ints here and in the tests, the kernel's run-time values in the kernel."""
    SC = gemm.stage_chunks
    return (gemm.w_offset + block * (SC * 512), (block * gemm.chunks + stage * SC) * 512, SC * 512)


def scale_block(gemm: ExpertsGemmKernel, block, stage):
    """The same for the scale bytes of ``block`` and ``stage`` (``stage_chunks * 32``)."""
    SC = gemm.stage_chunks
    return (gemm.w_offset + gemm.w_bytes + block * (SC * 32),
            (block * gemm.stages + stage) * (SC * 32), SC * 32)


class SpecializedExpertsKernel:
    """FC1 and FC2 of one call in one warp-specialized persistent grid (module docstring).

    Args:
        fc1, fc2: the two GEMMs' ``ExpertsGemmKernel`` (``wgmma``, the same warps, m-tiles,
            windows and stage shape, no walk); their stage and epilogue code is this
            kernel's, their rings and occupancies are not.
        ring: ring slots (each one stage of B operand, weights and scales); default as many
            as the shared memory of ``occupancy`` CTAs per multiprocessor holds, at most 8.
        producers: producer warps, 1 or 2 (2: the B-operand copies split over two warps).
        items: item slots (info and token table): how many claimed items the producer may
            run ahead of the consumers.
        occupancy: CTAs per multiprocessor (1 or 2); the persistent grid is this times the
            multiprocessors.
    """

    def __init__(self, fc1: ExpertsGemmKernel, fc2: ExpertsGemmKernel, *, ring: int | None = None,
                 producers: int = 1, items: int = 3, occupancy: int = 1):
        if not fc1.fc1 or fc2.fc1:
            raise ValueError("SpecializedExpertsKernel takes an FC1 and an FC2 ExpertsGemmKernel")
        same = ("warps", "mtiles", "windows", "chains", "wgmma", "count", "top_k", "stage_chunks")
        differ = [a for a in same if getattr(fc1, a) != getattr(fc2, a)]
        if differ:
            raise ValueError(f"SpecializedExpertsKernel: FC1 and FC2 differ in {differ}")
        if not fc1.wgmma or fc1.chains != 1 or fc2.walk != 1:
            raise ValueError("SpecializedExpertsKernel needs the wgmma tile (warps % 4 == 0, "
                             f"chains 1) and no walk, got wgmma={fc1.wgmma}, "
                             f"chains={fc1.chains}, walk={fc2.walk}")
        if fc1.tokens > 32:
            raise ValueError(f"SpecializedExpertsKernel: at most 4 windows, got {fc1.windows}")
        if producers not in (1, 2):
            raise ValueError(f"producers must be 1 or 2, got {producers!r}")
        if not isinstance(items, int) or items < 2:
            raise ValueError(f"items must be an int >= 2, got {items!r}")
        if occupancy not in (1, 2):
            raise ValueError(f"occupancy must be 1 or 2, got {occupancy!r}")
        fc1.signal = True
        fc2.gate, fc2.fc1_tiles = True, fc1.tiles
        fc1.pdl = fc2.pdl = False
        self.fc1, self.fc2 = fc1, fc2
        self.warps, self.mtiles, self.windows = fc1.warps, fc1.mtiles, fc1.windows
        self.producers, self.items, self.occupancy = producers, items, occupancy
        self.consumer_threads = 32 * fc1.warps
        self.threads = self.consumer_threads + 32 * producers
        fc1.epilogue_threads = fc2.epilogue_threads = self.consumer_threads
        self.pdl_chain = fc1.pdl_chain
        self.ws = fc1.ws
        self.tokens = fc1.tokens
        self.slot_bytes = fc1.slot_bytes  # B, then weights (w_offset), then scales
        #: the bulk copies of one stage: one per consumer warp and m-tile for the weights
        #: (stage_chunks * 512 bytes) and for the scales (stage_chunks * 32 bytes)
        self.blocks = fc1.warps * fc1.mtiles
        self.tx_bytes = self.blocks * fc1.stage_chunks * (512 + 32)
        self.granules = fc1.granules  # 16-byte B pieces per stage (4 words each)
        lanes = 32 * producers
        if self.granules % lanes:
            raise ValueError(f"the B operand's {self.granules} pieces per stage do not split "
                             f"over {lanes} producer lanes")
        self.copies = self.granules // lanes  # B pieces per producer lane and stage
        static = self._static_bytes(ring or 8)
        room = SMEM_PER_CTA // occupancy - static
        fit = room // self.slot_bytes
        self.ring = ring or min(8, fit)
        if self.ring < 2 or self.ring > fit:
            raise ValueError(f"ring {self.ring}: {fit} slots of {self.slot_bytes} bytes fit "
                             f"{occupancy} CTA(s) per multiprocessor; at least 2 are needed")
        self.smem_bytes = self.ring * self.slot_bytes

    def _static_bytes(self, ring: int) -> int:
        """Static shared memory: barriers, item slots, the epilogue's block maxima, flags."""
        barriers = (2 * ring + 2 * self.items) * _MBAR
        slots = self.items * 4 * (_INFO_WORDS + 3 * self.tokens)
        red = 4 * self.warps * self.mtiles * self.tokens
        return barriers + slots + red + 64

    @classmethod
    def compile_args(cls, *, fc1: tuple, fc2: tuple, ring: int = 0, producers: int = 1,
                     items: int = 3, occupancy: int = 1):
        """(kernel, fake arguments but the stream) for ``fast.device.compile.compiled``."""
        return (cls(ExpertsGemmKernel(**dict(fc1)), ExpertsGemmKernel(**dict(fc2)),
                    ring=ring or None, producers=producers, items=items, occupancy=occupancy),
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

    # -- shared memory ----------------------------------------------------------------

    def _shared(self):
        """(ring, barriers, infos, tables, red, flag): the dynamic ring; the ``full`` and
        ``empty`` barriers of each slot, then ``item_full`` and ``item_empty`` of each item
        slot; the item slots' infos and token tables; the block maxima; the abort flag."""
        TOK: cutlass.Constexpr = self.tokens
        ring = p.pinned_i32(cute.arch.get_dyn_smem(cutlass.Uint8, alignment=128).toint())
        bars = cute.arch.alloc_smem(Int64, 2 * self.ring + 2 * self.items, alignment=8).toint()
        infos = cute.arch.alloc_smem(Int32, _INFO_WORDS * self.items, alignment=16).toint()
        tables = cute.arch.alloc_smem(Int32, 3 * TOK * self.items, alignment=16).toint()
        red = cute.arch.alloc_smem(Float32, self.warps * self.mtiles * TOK, alignment=16).toint()
        flag = cute.arch.alloc_smem(Int32, 4, alignment=16).toint()
        return ring, bars, infos, tables, red, flag

    def _full(self, bars, slot):
        return bars + slot * _MBAR

    def _empty(self, bars, slot):
        return bars + (self.ring + slot) * _MBAR

    def _item_full(self, bars, q):
        return bars + (2 * self.ring + q) * _MBAR

    def _item_empty(self, bars, q):
        return bars + (2 * self.ring + self.items + q) * _MBAR

    def _info(self, infos, q):
        return infos + q * (4 * _INFO_WORDS)

    def _table(self, tables, q):
        return tables + q * (4 * 3 * self.tokens)

    # -- the kernel -------------------------------------------------------------------

    @cute.kernel
    def kernel(self, w13: Int64, s13: Int64, plan: Int64, lists: Int64, work: Int64,
               hidden: Int64, w2: Int64, s2: Int64, out: Int64, cap_fc1: Int64,
               cap_codes: Int64, cap_scales: Int64, capacity: Int32):
        tid = cute.arch.thread_idx()[0]
        lane = tid % 32
        warp = tid // 32
        ring, bars, infos, tables, red, flag = self._shared()
        if tid == 0:
            for s in cutlass.range_constexpr(self.ring):
                p.mbarrier_init(self._full(bars, s), 1 + 32 * self.producers)
                p.mbarrier_init(self._empty(bars, s), self.warps)
            for q in cutlass.range_constexpr(self.items):
                p.mbarrier_init(self._item_full(bars, q), 1)
                p.mbarrier_init(self._item_empty(bars, q), self.warps)
            p.sts_i32(flag, 0)
            p.mbarrier_init_fence()
        cute.arch.sync_threads()
        if cutlass.const_expr(self.pdl_chain):
            cute.arch.griddepcontrol_wait()
        if warp >= self.warps:
            self._produce(w13, s13, plan, lists, work, hidden, w2, s2, capacity, ring, bars,
                          infos, tables, flag, tid - self.consumer_threads, lane,
                          warp - self.warps)
        else:
            self._consume(work, hidden, out, cap_fc1, cap_codes, cap_scales, ring, bars, infos,
                          tables, red, flag, tid, lane, warp)

    @cute.jit
    def _wait(self, barrier, parity, flag, work: Int64, kind: int, count):
        """Poll ``barrier`` until its phase of ``parity`` completes, at most
        ``PIPELINE_SPIN_LIMIT`` times, or at once when the CTA is aborted; a timeout
        records ``ERROR_PIPELINE_TIMEOUT`` with ``kind`` and ``count`` and aborts the CTA."""
        done = p.mbarrier_try_wait(barrier, parity)
        polls = Int32(0)
        while (done == 0) & (polls < PIPELINE_SPIN_LIMIT):
            done = p.mbarrier_try_wait(barrier, parity)
            polls = polls + 1
            if p.lds_i32(flag) != 0:
                polls = Int32(PIPELINE_SPIN_LIMIT)
        if done == 0:
            if p.lds_i32(flag) == 0:
                p.atomic_max(work + self.ws.error * 4, ERROR_PIPELINE_TIMEOUT)
                p.stg_i32(work + (self.ws.error + 1) * 4, kind)
                p.stg_i32(work + (self.ws.error + 2) * 4, count)
            p.sts_i32(flag, 1)

    # -- producer ---------------------------------------------------------------------

    @cute.jit
    def _produce(self, w13: Int64, s13: Int64, plan: Int64, lists: Int64, work: Int64,
                 hidden: Int64, w2: Int64, s2: Int64, capacity, ring, bars, infos, tables,
                 flag, ptid, lane, pwarp):
        """The producer warps' loop: claim, announce and stream items until none is left
        (then an item of -1 tells the consumers to stop)."""
        src = cute.make_rmem_tensor((self.copies,), Int64)
        dst = cute.make_rmem_tensor((self.copies,), Int32)
        ok = cute.make_rmem_tensor((self.copies,), Int32)
        i = Int32(0)  # items this CTA has claimed
        g = Int32(0)  # stages this CTA has streamed
        more = Int32(1)
        while more != 0:
            q = i % self.items
            info = self._info(infos, q)
            table = self._table(tables, q)
            if i >= self.items:
                self._wait(self._item_empty(bars, q), (i // self.items - 1) % 2, flag, work,
                           WAIT_ITEM_EMPTY, i)
            if ptid == 0:
                self._claim(work, info)
            self._producer_sync()
            item = p.lds_i32(info)
            if item < 0:
                if ptid == 0:
                    p.mbarrier_arrive(self._item_full(bars, q))
                more = Int32(0)
            else:
                gemm = p.lds_i32(info + 24)
                if gemm == 0:
                    self._produce_item(self.fc1, w13, s13, plan, lists, work, capacity, ring,
                                       bars, info, table, flag, src, dst, ok, ptid, lane, pwarp,
                                       q, g)
                    g = g + self.fc1.stages
                else:
                    self._produce_item(self.fc2, w2, s2, hidden, lists, work, capacity, ring,
                                       bars, info, table, flag, src, dst, ok, ptid, lane, pwarp,
                                       q, g)
                    g = g + self.fc2.stages
                i = i + 1
        p.cp_async_wait_all()  # nothing of this thread's still lands after it exits
        if p.lds_i32(flag) != 0:
            # aborted: bulk copies issued before the abort may still be landing, and the
            # CTA's shared memory (their destination and barriers) must outlive them
            start = cute.arch.globaltimer()
            waited = Int64(0)
            while waited < ABORT_DRAIN_NS:
                waited = cute.arch.globaltimer() - start

    @cute.jit
    def _producer_sync(self):
        """The producer warps' barrier: the warp's own with one producer, else named
        barrier ``PRODUCER_BARRIER``."""
        if cutlass.const_expr(self.producers == 1):
            cute.arch.sync_warp()
        else:
            cute.arch.barrier(barrier_id=PRODUCER_BARRIER, number_of_threads=32 * self.producers)

    @cute.jit
    def _claim(self, work: Int64, info):
        """Producer thread 0: the next item of the call (FC1's, then FC2's) into ``info``
        (``ExpertsGemmKernel.locate``'s words, the GEMM at word 6; -1: none left)."""
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

    @cute.jit
    def _produce_item(self, gemm: cutlass.Constexpr, weights: Int64, scales: Int64, act: Int64,
                      lists: Int64, work: Int64, capacity, ring, bars, info, table, flag, src,
                      dst, ok, ptid, lane, pwarp, q, g0):
        """One item of ``gemm``: its token table (producer warp 0's lanes, one token each),
        announced to the consumers; this lane's B copies; every stage streamed from
        stage count ``g0`` on."""
        NS: cutlass.Constexpr = gemm.stages
        RING: cutlass.Constexpr = self.ring
        SC: cutlass.Constexpr = gemm.stage_chunks
        TOK: cutlass.Constexpr = self.tokens
        lanes: cutlass.Constexpr = 32 * self.producers
        expert = p.lds_i32(info + 4)
        tile = p.lds_i32(info + 8)
        group = p.lds_i32(info + 12)
        ntok = p.lds_i32(info + 16)
        if pwarp == 0:
            ExpertsGemmKernel.token_table(gemm, lists, work, table, expert, group, ntok,
                                          capacity, lane)
        self._producer_sync()
        if ptid == 0:
            p.mbarrier_arrive(self._item_full(bars, q))
        # this lane's B pieces of every stage: shared offset, source row, zero-fill
        for c in cutlass.range_constexpr(self.copies):
            piece = ptid + lanes * c
            token = piece // (8 * SC)
            gi = piece % (8 * SC)
            dst[c] = b_offset_wgmma(token // WINDOW, token % WINDOW, gi // 8, gi % 8, SC)
            row = Int32(0)
            valid = Int32(0)
            if token < ntok:
                row = p.lds_i32(table + (TOK + token) * 4)
                valid = Int32(1)
            ok[c] = valid
            src[c] = act + (Int64(row) * gemm.k + gi * 8) * 2
        # the item's first row of weights and scales: m-tile (expert, tile, 0)
        mtile0 = Int64(expert) * gemm.m_tiles + tile * self.blocks
        wbase = weights + mtile0 * (gemm.chunks * 512)
        sbase = scales + mtile0 * (NS * 32 * SC)
        if cutlass.const_expr(gemm.gate):
            # weights of the first stages, then the wait for the expert's hidden rows
            ahead: cutlass.Constexpr = min(RING, NS)
            for s in cutlass.range_constexpr(ahead):
                self._stage_weights(gemm, wbase, sbase, ring, bars, flag, work, s, g0 + s, ptid,
                                    lane, pwarp)
            if ptid == 0:
                self._wait_ready(work, info)
            self._producer_sync()
            for s in cutlass.range_constexpr(ahead):
                self._stage_b(gemm, src, dst, ok, ring, bars, s, g0 + s)
            for s in cutlass.range(ahead, NS, unroll=1):
                self._stage_weights(gemm, wbase, sbase, ring, bars, flag, work, s, g0 + s, ptid,
                                    lane, pwarp)
                self._stage_b(gemm, src, dst, ok, ring, bars, s, g0 + s)
        else:
            for s in cutlass.range(NS, unroll=1):
                self._stage_weights(gemm, wbase, sbase, ring, bars, flag, work, s, g0 + s, ptid,
                                    lane, pwarp)
                self._stage_b(gemm, src, dst, ok, ring, bars, s, g0 + s)

    @cute.jit
    def _stage_weights(self, gemm: cutlass.Constexpr, wbase: Int64, sbase: Int64, ring, bars,
                       flag, work: Int64, stage, g, ptid, lane, pwarp):
        """Stage ``stage`` of the item into slot ``g % ring`` once it is released: every
        producer lane waits for the slot; producer warp 0's lane 0 announces the stage's
        transaction bytes, and its lanes issue one bulk copy each per m-tile block (lanes
        ``0 .. blocks - 1``: weights, ``stage_chunks * 512`` bytes; the next ``blocks``
        lanes: scales, ``stage_chunks * 32`` bytes), both verbatim from the prepared
        layout (``ExpertsGemmKernel``'s slot layout)."""
        RING: cutlass.Constexpr = self.ring
        B: cutlass.Constexpr = self.blocks
        slot = g % RING
        full = self._full(bars, slot)
        if g >= RING:
            self._wait(self._empty(bars, slot), (g // RING - 1) % 2, flag, work, WAIT_EMPTY, g)
        # an aborted CTA issues no more bulk copies; lane 0's read of the flag decides for
        # the whole warp, so a stage's expected bytes and its copies go together
        if pwarp == 0:
            aborted = cute.arch.shuffle_sync(p.lds_i32(flag), 0)
            if aborted == 0:
                if lane == 0:
                    p.mbarrier_arrive_expect_tx(full, self.tx_bytes)
                cute.arch.sync_warp()
                base = ring + slot * self.slot_bytes
                for r in cutlass.range_constexpr((2 * B + 31) // 32):
                    block = lane + 32 * r
                    if block < B:
                        to, at, size = weight_block(gemm, block, stage)
                        p.cp_async_bulk(base + to, wbase + Int64(at), size, full)
                    elif block < 2 * B:
                        to, at, size = scale_block(gemm, block - B, stage)
                        p.cp_async_bulk(base + to, sbase + Int64(at), size, full)

    @cute.jit
    def _stage_b(self, gemm: cutlass.Constexpr, src, dst, ok, ring, bars, stage, g):
        """This lane's B words of stage ``stage`` into slot ``g % ring`` (zero past the
        item's tokens), then its arrival on the slot's ``full`` barrier once they land."""
        RING: cutlass.Constexpr = self.ring
        SC: cutlass.Constexpr = gemm.stage_chunks
        slot = g % RING
        base = ring + slot * self.slot_bytes
        offset = Int64(stage) * (64 * SC * 2)
        for c in cutlass.range_constexpr(self.copies):
            for m in cutlass.range_constexpr(4):
                p.cp_async_4z(base + dst[c] + m * WGMMA_WORD_STRIDE, src[c] + offset + 4 * m,
                              ok[c] != 0)
        p.cp_async_arrive_noinc(self._full(bars, slot))

    @cute.jit
    def _wait_ready(self, work: Int64, info):
        """Producer thread 0, before an FC2 item's hidden rows: ``ExpertsGemmKernel``'s gate
        (relaxed polls of the expert's finished FC1 items, at most ``GATE_SPIN_LIMIT``, then
        one GPU-scope acquire fence; a timeout records ``ERROR_GATE_TIMEOUT``)."""
        ws = self.ws
        expert = p.lds_i32(info + 4)
        target = p.lds_i32(info + 20) * self.fc2.fc1_tiles
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

    # -- consumers --------------------------------------------------------------------

    @cute.jit
    def _consume(self, work: Int64, hidden: Int64, out: Int64, cap_fc1: Int64, cap_codes: Int64,
                 cap_scales: Int64, ring, bars, infos, tables, red, flag, tid, lane, warp):
        """The consumer warps' loop: each announced item's stages, then its epilogue,
        until the item of -1."""
        acc1 = cute.make_rmem_tensor((self.mtiles * self.windows * 4,), Float32)
        acc2 = cute.make_rmem_tensor((self.mtiles * self.windows * 4,), Float32)
        i = Int32(0)
        g = Int32(0)
        self._wait(self._item_full(bars, 0), 0, flag, work, WAIT_ITEM_FULL, 0)
        item = p.lds_i32(self._info(infos, 0))
        while item >= 0:
            q = i % self.items
            info = self._info(infos, q)
            table = self._table(tables, q)
            if p.lds_i32(info + 24) == 0:
                self._consume_item(self.fc1, acc1, hidden, cap_fc1, cap_codes, cap_scales, work,
                                   ring, bars, info, table, red, flag, tid, lane, warp, g)
                g = g + self.fc1.stages
            else:
                self._consume_item(self.fc2, acc2, out, cap_fc1, cap_codes, cap_scales, work,
                                   ring, bars, info, table, red, flag, tid, lane, warp, g)
                g = g + self.fc2.stages
            cute.arch.sync_warp()
            if lane == 0:
                p.mbarrier_arrive(self._item_empty(bars, q))
            i = i + 1
            q = i % self.items
            self._wait(self._item_full(bars, q), (i // self.items) % 2, flag, work,
                       WAIT_ITEM_FULL, i)
            item = p.lds_i32(self._info(infos, q))
            if p.lds_i32(flag) != 0:  # aborted: the item slots no longer mean anything
                item = Int32(-1)

    @cute.jit
    def _consume_item(self, gemm: cutlass.Constexpr, acc, out: Int64, cap_fc1: Int64,
                      cap_codes: Int64, cap_scales: Int64, work: Int64, ring, bars, info, table,
                      red, flag, tid, lane, warp, g0):
        """Every stage of one item of ``gemm`` from stage count ``g0`` on, with the loop for
        its count of live windows, then the epilogue (FC1: after every consumer has left the
        previous FC1 epilogue's block maxima, and counted at its expert after)."""
        W: cutlass.Constexpr = self.windows
        MT: cutlass.Constexpr = self.mtiles
        expert = p.lds_i32(info + 4)
        tile = p.lds_i32(info + 8)
        ntok = p.lds_i32(info + 16)
        for k in cutlass.range_constexpr(MT * W * 4):
            acc[k] = Float32(0.0)
        nwin = (ntok + WINDOW - 1) // WINDOW
        for live in cutlass.range_constexpr(1, W + 1):
            if nwin == live:
                self._consume_stages(gemm, acc, ring, bars, flag, work, lane, warp, live, g0)
        if cutlass.const_expr(gemm.fc1):
            # every consumer is past the previous FC1 item's reads of the block maxima
            ExpertsGemmKernel.epilogue_barrier(gemm)
            ExpertsGemmKernel.epilogue_fc1(gemm, acc, table, red, out, cap_fc1, cap_codes,
                                           cap_scales, tid, lane, warp, tile, ntok)
            ExpertsGemmKernel.signal_ready(gemm, work, expert, tid)
        else:
            ExpertsGemmKernel.epilogue_fc2(gemm, acc, table, out, lane, warp, tile, ntok)

    @cute.jit
    def _consume_stages(self, gemm: cutlass.Constexpr, acc, ring, bars, flag, work: Int64, lane,
                        warp, live: int, g0):
        """The item's stages for ``live`` windows: wait for the slot, fence the copied B
        operand to the async proxy, compute (every MMA group complete at its end), release
        the slot (one arrival per warp)."""
        RING: cutlass.Constexpr = self.ring
        for s in cutlass.range(gemm.stages, unroll=1):
            g = g0 + s
            slot = g % RING
            self._wait(self._full(bars, slot), (g // RING) % 2, flag, work, WAIT_FULL, g)
            cute.arch.fence_view_async_shared()
            ExpertsGemmKernel.compute_stage(gemm, acc, ring + slot * self.slot_bytes, warp, lane,
                                            live)
            cute.arch.sync_warp()
            if lane == 0:
                p.mbarrier_arrive(self._empty(bars, slot))
