"""The work table, routing-lists and plan kernels of the experts engine (the pipeline is
described in ``fast.experts``): the kernels that turn a call's top-k ids into per-expert
lists of pairs, BF16 plan rows and work items, which the GEMM kernels
(``fast.experts.kernels``) then claim.

Every kernel takes raw device addresses (``Int64``) and run-time sizes (``Int32``); the
widths and the window count are compile-time constants of the kernel object, so one
compile serves every batch of one geometry.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from fast.device import fp32 as h
from fast.device import ptx as p
from fast.experts.layout import WINDOW

__all__ = ["EMPTY_ID", "ERROR_ID_RANGE", "ERROR_LIST_OVERFLOW", "ERROR_NOT_LOCAL",
           "ERROR_GATE_TIMEOUT", "ERROR_STALE_LISTS", "Workspace", "RoutingListsKernel",
           "PlanKernel", "e8m0_f32_bits"]

#: The id of every slot of an empty receive row (engines built with ``empty_rows``).
EMPTY_ID = -1
#: Error codes the kernels record (``Workspace.error``; the largest recorded wins): the
#: routing-lists kernel's three, the fused kernel's FC2 wait for its expert's FC1 items
#: timing out, and the plan kernel finding more listed pairs than the call has (lists that
#: no plan kernel consumed: a ``listed`` call's appends made twice).
ERROR_ID_RANGE, ERROR_LIST_OVERFLOW, ERROR_NOT_LOCAL, ERROR_GATE_TIMEOUT = 1, 2, 3, 4
ERROR_STALE_LISTS = 5


class Workspace:
    """Offsets (int32 words) of the engine's per-rank work table for ``experts`` local
    experts:

    * ``wgp``: ``experts + 1`` prefix sums of each expert's window groups (items per tile);
    * ``offs``: ``experts + 1`` prefix sums of each expert's pair count (its first row in
      the FC1 -> FC2 hidden buffer);
    * ``count``: ``experts`` pair counts of this call;
    * ``claim``: the FC1 and FC2 work counters;
    * ``error``: code, pair index, value of a bad routing entry (0: none);
    * ``live``: ``experts`` counters the routing-lists kernel increments; the plan kernel
      copies them into ``count`` and re-arms them to 0 for the next call;
    * ``ready``: ``experts`` counts of finished FC1 items (the fused kernel; its plan
      kernel zeroes them).
    """

    def __init__(self, experts: int):
        self.experts = experts
        self.wgp = 0
        self.offs = experts + 1
        self.count = 2 * experts + 2
        self.claim = 3 * experts + 2
        self.error = 3 * experts + 4
        self.live = 3 * experts + 8
        self.ready = 4 * experts + 8
        self.words = 5 * experts + 8


def e8m0_f32_bits(code):
    """FP32 bits of 2^(code - 127) for an E8M0 code 0..254 (code 0: the subnormal 2^-127)."""
    return cutlass.select_(code == Uint32(0), Uint32(0x00400000), Uint32(code) << Uint32(23))


class RoutingListsKernel:
    """Routing lists and plan rows of one call, one CTA of 128 threads per received row.

    Algorithm (CTA ``r``):

    1. threads ``k < top_k``: ``e = ids[r, k]``; out of ``[0, experts)`` -> error 1; a local
       expert (``first <= e < first + count``) claims ``slot = atomicAdd(live[e - first])``
       and writes the pair ``r * top_k + k`` to ``lists[e - first, slot]`` (``slot >=
       capacity`` -> error 2); a non-local expert in strict mode -> error 3. The order of a
       list is the order of the claims; no output bit depends on it (each pair's row is
       computed alone). With ``empty_rows``, an id of ``EMPTY_ID`` (-1: a receive row no
       token was sent to) is no pair and no error.
    2. all threads: the row's MXFP8 latent (E4M3 codes ``[L]``, E8M0 scales ``[L/32]``)
       dequantized to BF16 plan row ``r`` (the B operand FC1 gathers): each value
       ``e4m3 * 2^(s - 127)`` computed exactly in FP32 and rounded to BF16, which is exact
       for scale codes 3..246 (module ``fast.experts``: exactness range).

    Constraints: ``L % 256 == 0``; ids int32 ``[R, top_k]``; codes ``[R, L]``; scales
    ``[R, L/32]``; plan BF16 ``[R, L]``; lists int32 ``[count, capacity]``.
    """

    def __init__(self, latent: int, top_k: int, experts: int, first: int, count: int,
                 strict: bool, empty_rows: bool = False, pdl_chain: bool = False):
        self.latent, self.top_k, self.experts = latent, top_k, experts
        self.first, self.count, self.strict = first, count, strict
        self.empty_rows = empty_rows
        #: let the plan kernel (launched with programmatic dependent launch) be scheduled
        #: at once; it reads nothing of this grid before its griddepcontrol.wait
        self.pdl_chain = bool(pdl_chain)
        self.ws = Workspace(count)

    @classmethod
    def compile_args(cls, **params):
        """(kernel, fake arguments but the stream) for ``fast.device.compile.compiled``."""
        return cls(**params), [Int64(0)] * 6 + [Int32(1), Int32(1)]

    @cute.jit
    def __call__(self, ids: Int64, codes: Int64, scales: Int64, plan: Int64, lists: Int64,
                 work: Int64, rows: Int32, capacity: Int32, stream):
        self.kernel(ids, codes, scales, plan, lists, work, capacity).launch(
            grid=(rows, 1, 1), block=(128, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, ids: Int64, codes: Int64, scales: Int64, plan: Int64, lists: Int64,
               work: Int64, capacity: Int32):
        tid = cute.arch.thread_idx()[0]
        row = cute.arch.block_idx()[0]
        top_k: cutlass.Constexpr = self.top_k
        latent: cutlass.Constexpr = self.latent
        if cutlass.const_expr(self.pdl_chain):
            cute.arch.griddepcontrol_launch_dependents()
        if tid < top_k:
            pair = row * top_k + tid
            expert = p.ldg_i32(ids + Int64(pair) * 4)
            if cutlass.const_expr(self.empty_rows):
                if expert != EMPTY_ID:
                    self.list_pair(work, lists, capacity, pair, expert)
            else:
                self.list_pair(work, lists, capacity, pair, expert)
        granules: cutlass.Constexpr = latent // 8
        for i in cutlass.range_constexpr((granules + 127) // 128):
            g = tid + 128 * i
            if g < granules:
                base = Int64(row) * latent + g * 8
                got = p.ldg_v2(codes + base)
                scale = p.ldg_u8(scales + Int64(row) * (latent // 32) + g // 4)
                p.stg_v4(plan + base * 2, self.plan_granule(got, scale))

    @staticmethod
    def plan_granule(codes, scale):
        """Step 2 for one granule: 8 E4M3 codes (two words, the lower k in the low byte)
        of one block with E8M0 code ``scale`` -> the 8 BF16 plan values as 4 words."""
        factor = h.from_bits(e8m0_f32_bits(scale))
        out = []
        for w in codes:
            for half in range(2):
                lo, hi = p.e4m3x2_to_f32(w >> Uint32(16 * half))
                out.append(h.pack_bf16x2(h.fmul(lo, factor), h.fmul(hi, factor)))
        return out

    @cute.jit
    def list_pair(self, work: Int64, lists: Int64, capacity, pair, expert):
        """Step 1 for one pair: its list slot, or the error it records."""
        ws = self.ws
        outside = (expert < 0) | (expert >= self.experts)
        if outside:
            self._error(work, ERROR_ID_RANGE, pair, expert)
        else:
            local = expert - self.first
            mine = (local >= 0) & (local < self.count)
            if mine:
                slot = p.atomic_add(work + Int64(ws.live + local) * 4, 1)
                if slot < capacity:
                    p.stg_i32(lists + (Int64(local) * Int64(capacity) + Int64(slot)) * 4, pair)
                else:
                    self._error(work, ERROR_LIST_OVERFLOW, pair, expert)
            elif cutlass.const_expr(self.strict):
                self._error(work, ERROR_NOT_LOCAL, pair, expert)

    @cute.jit
    def _error(self, work: Int64, code: int, pair, value):
        ws = self.ws
        p.atomic_max(work + ws.error * 4, code)
        p.stg_i32(work + (ws.error + 1) * 4, pair)
        p.stg_i32(work + (ws.error + 2) * 4, value)


class PlanKernel:
    """Windows and work items of one call: one CTA, one thread per local expert.

    Thread ``e``: ``c = min(live[e], capacity)`` (a list's appends past its capacity were
    refused and recorded by the appender), ``live[e] = 0`` (re-armed for the next call),
    window groups ``wg = ceil(c / (8 W))``; block-wide inclusive scans (warp shuffles, then
    the warp totals in order) give ``wgp`` and ``offs``; thread 0 zeroes both work
    counters. The FC kernels' items are ``(expert, tile, window group)`` in that order: item
    ``i`` belongs to the expert with ``tiles * wgp[e] <= i < tiles * wgp[e + 1]``.

    Guard: if a list is over its capacity (error ``ERROR_LIST_OVERFLOW``, recorded by the
    appender) or the lists hold more pairs than the call's ``pairs`` (``rows * top_k``:
    appends of an earlier call whose plan kernel never ran; error ``ERROR_STALE_LISTS``
    with the listed count and ``pairs``), every count is 0: no item runs, no row is
    written, and nothing is read or written past the lists, the hidden rows and the output
    the call sized.

    Constraint: at most 1024 local experts.
    """

    def __init__(self, count: int, windows: int, pdl_chain: bool = False, fused: bool = False):
        self.count, self.windows = count, windows
        #: the fused FC kernel follows: also zero its ``ready`` counts
        self.fused = bool(fused)
        self.threads = max(32, (count + 31) // 32 * 32)
        #: launched with programmatic dependent launch after the list kernel: wait for it,
        #: then let FC1 be scheduled (FC1 waits for this grid before its first claim)
        self.pdl_chain = bool(pdl_chain)
        self.ws = Workspace(count)

    @classmethod
    def compile_args(cls, **params):
        """(kernel, fake arguments but the stream) for ``fast.device.compile.compiled``."""
        return cls(**params), [Int64(0), Int32(1), Int32(1)]

    @cute.jit
    def __call__(self, work: Int64, capacity: Int32, pairs: Int32, stream):
        self.kernel(work, capacity, pairs).launch(grid=(1, 1, 1), block=(self.threads, 1, 1),
                                                  stream=stream, use_pdl=self.pdl_chain)

    @cute.kernel
    def kernel(self, work: Int64, capacity: Int32, pairs: Int32):
        tid = cute.arch.thread_idx()[0]
        lane = tid % 32
        warp = tid // 32
        ws = self.ws
        per_group: cutlass.Constexpr = WINDOW * self.windows
        nwarps: cutlass.Constexpr = self.threads // 32
        smem = cute.arch.alloc_smem(Int32, 2 * 32 + 4, alignment=16).toint()
        stale = smem + 2 * 32 * 4  # 1: the counts are unusable (the guard below)
        if cutlass.const_expr(self.pdl_chain):
            # after the wait, not before: FC1's CTAs, once scheduled, may fill the
            # multiprocessors, and the list kernel's CTAs must all have been placed by then
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        if tid == 0:
            p.sts_i32(stale, 0)
        cute.arch.sync_threads()
        c = Int32(0)
        if tid < self.count:
            c = p.ldg_i32(work + Int64(ws.live + tid) * 4)
            if c > capacity:  # the appender refused (and recorded) the pairs past it
                c = capacity
                p.sts_i32(stale, 1)
            p.stg_i32(work + Int64(ws.live + tid) * 4, 0)
            if cutlass.const_expr(self.fused):
                p.stg_i32(work + Int64(ws.ready + tid) * 4, 0)
        wg = (c + per_group - 1) // per_group
        sc, sw = c, wg
        for o in cutlass.range_constexpr(5):
            d = 1 << o
            uc = Int32(p.shfl_up(Uint32(sc), d))
            uw = Int32(p.shfl_up(Uint32(sw), d))
            if lane >= d:
                sc = sc + uc
                sw = sw + uw
        if lane == 31:
            p.sts_i32(smem + warp * 8, sc)
            p.sts_i32(smem + warp * 8 + 4, sw)
        cute.arch.sync_threads()
        if tid == 0:
            run_c, run_w = Int32(0), Int32(0)
            for i in cutlass.range_constexpr(nwarps):
                tc = p.lds_i32(smem + i * 8)
                tw = p.lds_i32(smem + i * 8 + 4)
                p.sts_i32(smem + i * 8, run_c)
                p.sts_i32(smem + i * 8 + 4, run_w)
                run_c = run_c + tc
                run_w = run_w + tw
            if run_c > pairs:
                p.sts_i32(stale, 1)
                p.atomic_max(work + ws.error * 4, ERROR_STALE_LISTS)
                p.stg_i32(work + (ws.error + 1) * 4, run_c)
                p.stg_i32(work + (ws.error + 2) * 4, pairs)
            p.stg_i32(work + ws.wgp * 4, 0)
            p.stg_i32(work + ws.offs * 4, 0)
            p.stg_i32(work + ws.claim * 4, 0)
            p.stg_i32(work + (ws.claim + 1) * 4, 0)
        cute.arch.sync_threads()
        if tid < self.count:
            sc = sc + p.lds_i32(smem + warp * 8)
            sw = sw + p.lds_i32(smem + warp * 8 + 4)
            if p.lds_i32(stale) != 0:
                sc, sw, c = Int32(0), Int32(0), Int32(0)
            p.stg_i32(work + Int64(ws.wgp + 1 + tid) * 4, sw)
            p.stg_i32(work + Int64(ws.offs + 1 + tid) * 4, sc)
            p.stg_i32(work + Int64(ws.count + tid) * 4, c)
