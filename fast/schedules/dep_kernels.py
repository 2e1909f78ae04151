"""CuTe DSL kernels of the DEP layer's routed data movement: dispatch to the owners, the
owners' partial finalize, and the home rank's combine.

Each kernel takes raw device addresses (``Int64``) and run-time sizes (``Int32``); the
owners' buffers are reached through a table of addresses in device memory, so one kernel
serves virtual ranks (every buffer on this GPU) and real ranks (peer addresses from
symmetric memory; plain unicast stores and loads over NVLink).

Over real ranks the kernels also say when their rows are written: the dispatch and the
owner finalize built with ``signal=True`` end each CTA with a release at system scope that
adds 1 to a word in the receiving rank's memory (its *arrival counter* for this sender;
``fast.device.arrival.signal_arrival``), and ``fast.device.arrival.ArrivalWaitKernel``
holds the receiver's stream until every sender's counter has grown by this call's CTA
count, or records a timeout in an error word.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from fast.device import SMEM_PER_CTA
from fast.device import fp32 as h
from fast.device import ptx as p
from fast.device.arrival import signal_arrival

__all__ = ["DispatchKernel", "OwnerFinalizeKernel", "CombineKernel", "POISON_WORDS",
           "TABLE_FIELDS"]

#: The four receive buffers of an owner, in the order of a table row: E4M3 codes
#: ``[N*T, L]``, E8M0 scales ``[N*T, L/32]``, int32 ids ``[N*T, K]``, FP32 weights ``[N*T, K]``.
TABLE_FIELDS = ("codes", "scales", "ids", "weights")
#: The 32-bit word an empty receive row holds in each buffer: E4M3 NaN bytes, E8M0 NaN
#: bytes, id -1, an FP32 quiet NaN.
POISON_WORDS = {"codes": 0x7F7F7F7F, "scales": 0xFFFFFFFF, "ids": 0xFFFFFFFF,
                "weights": 0x7FC00000}

_THREADS = 128


def _owner_of_any(ids_row: Int64, top_k: int, lo, hi):
    """1 if any of the row's ``top_k`` ids lies in ``[lo, hi)``, else 0 (every thread
    reads the row; it is 64 bytes)."""
    hit = Int32(0)
    for j in range(top_k):  # unrolled at trace time (a plain helper, not a kernel body)
        e = p.ldg_i32(ids_row + j * 4)
        hit = hit | cutlass.select_((e >= lo) & (e < hi), Int32(1), Int32(0))
    return hit


class DispatchKernel:
    """A source rank's tokens to every owner's receive buffers: one CTA per (token t,
    owner o), 128 threads.

    CTA ``(t, o)``: the token is *present* at ``o`` when one of its ``top_k`` ids lies in
    ``[o * per, (o + 1) * per)``. Receive row ``src * T + t`` of owner ``o`` then gets the
    token's E4M3 codes (``L`` bytes, 16-byte copies), E8M0 scales, ids and weights
    (4-byte copies), else the poison words of ``POISON_WORDS`` (an empty row). Every
    receive row of this source is written, so no buffer keeps a previous call's rows.

    Pure data movement: the owner's rows are the source's bits.

    With ``signal=True`` (real ranks) CTA ``(t, o)`` then adds 1 to owner ``o``'s arrival
    counter for this source (address ``arrivals[o]``, an int64 ``[N]`` table), after a
    system-scope release: owner ``o`` has all of this source's rows once its counter has
    grown by ``T`` (``ArrivalWaitKernel``). With ``signal=False`` ``arrivals`` is unused.

    Constraints: ``L % 32 == 0``; source tensors contiguous; codes 16-byte aligned; the
    table int64 ``[N, 4]`` (``TABLE_FIELDS`` order) of owner addresses.
    """

    def __init__(self, latent: int, top_k: int, per: int, signal: bool = False):
        self.latent, self.top_k, self.per, self.signal = latent, top_k, per, signal

    @classmethod
    def compile_args(cls, **params):
        """(kernel, fake arguments but the stream) for ``fast.device.compile.compiled``."""
        return cls(**params), [Int64(0)] * 6 + [Int32(0), Int32(1), Int32(1)]

    @cute.jit
    def __call__(self, codes: Int64, scales: Int64, ids: Int64, weights: Int64, table: Int64,
                 arrivals: Int64, source: Int32, tokens: Int32, ranks: Int32, stream):
        self.kernel(codes, scales, ids, weights, table, arrivals, source, tokens).launch(
            grid=(tokens, ranks, 1), block=(_THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, codes: Int64, scales: Int64, ids: Int64, weights: Int64, table: Int64,
               arrivals: Int64, source: Int32, tokens: Int32):
        tid = cute.arch.thread_idx()[0]
        t, o, _ = cute.arch.block_idx()
        latent: cutlass.Constexpr = self.latent
        top_k: cutlass.Constexpr = self.top_k
        present = _owner_of_any(ids + Int64(t) * (top_k * 4), top_k, o * self.per,
                                (o + 1) * self.per)
        row = Int64(source) * Int64(tokens) + Int64(t)
        dst = [p.ldg_u64(table + Int64(o) * 32 + 8 * i) for i in range(4)]
        keep = present != 0
        granules: cutlass.Constexpr = latent // 16
        for i in cutlass.range_constexpr((granules + _THREADS - 1) // _THREADS):
            g = tid + _THREADS * i
            if g < granules:
                got = p.ldg_stream_v4(codes + Int64(t) * latent + g * 16)
                poison = Uint32(POISON_WORDS["codes"])
                p.stg_v4(dst[0] + row * latent + g * 16,
                         [cutlass.select_(keep, w, poison) for w in got])
        # scales, ids, weights: 4-byte words
        for field, src, width in ((1, scales, latent // 128), (2, ids, top_k),
                                  (3, weights, top_k)):
            poison = Uint32(POISON_WORDS[TABLE_FIELDS[field]])
            for i in cutlass.range_constexpr((width + _THREADS - 1) // _THREADS):
                g = tid + _THREADS * i
                if g < width:
                    word = p.ldg_u32(src + (Int64(t) * width + g) * 4)
                    p.stg_u32(dst[field] + (row * width + g) * 4, cutlass.select_(keep, word, poison))
        if cutlass.const_expr(self.signal):
            signal_arrival(p.ldg_u64(arrivals + Int64(o) * 8), tid)


class OwnerFinalizeKernel:
    """An owner's partial finalize of its receive rows: one CTA per receive row, ``L / 8``
    threads of 8 columns.

    Row ``r``: ``acc = +0``; for ``j`` = 0 .. K-1 in order, when ``ids[r, j]`` is local
    (in ``[first, first + count)``): ``acc = fma.rn.f32(w[r, j], rows[K r + j], acc)``;
    then one RNE rounding to BF16. Rows of non-local slots are never read (they hold
    whatever the engine left there); a row with no local slot (an empty receive row)
    gives +0.

    With ``signal=True`` (real ranks) the CTA of receive row ``s*T + t`` then adds 1 to
    home ``s``'s arrival counter for this owner (address ``ready[s]``, an int64 ``[N]``
    table) after a system-scope release: home ``s`` has all of this owner's partials of
    its tokens once the counter has grown by ``T``. With ``signal=False`` ``ready`` is
    unused.

    Constraints: ``L % 8 == 0``, ``L / 8 <= 1024``; rows BF16 ``[R*K, L]``, weights FP32
    ``[R, K]``, ids int32 ``[R, K]``, out BF16 ``[R, L]``, contiguous, 16-byte aligned.
    """

    def __init__(self, latent: int, top_k: int, signal: bool = False):
        self.latent, self.top_k, self.signal = latent, top_k, signal
        self.threads = latent // 8

    @classmethod
    def compile_args(cls, **params):
        """(kernel, fake arguments but the stream) for ``fast.device.compile.compiled``."""
        return cls(**params), [Int64(0)] * 5 + [Int32(0), Int32(1), Int32(1), Int32(1)]

    @cute.jit
    def __call__(self, rows: Int64, weights: Int64, ids: Int64, out: Int64, ready: Int64,
                 first: Int32, count: Int32, tokens: Int32, receive_rows: Int32, stream):
        self.kernel(rows, weights, ids, out, ready, first, count, tokens).launch(
            grid=(receive_rows, 1, 1), block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, rows: Int64, weights: Int64, ids: Int64, out: Int64, ready: Int64,
               first: Int32, count: Int32, tokens: Int32):
        tid = cute.arch.thread_idx()[0]
        r = cute.arch.block_idx()[0]
        latent: cutlass.Constexpr = self.latent
        top_k: cutlass.Constexpr = self.top_k
        acc = cute.make_rmem_tensor((8,), Float32)
        for i in cutlass.range_constexpr(8):
            acc[i] = Float32(0.0)
        for j in cutlass.range_constexpr(top_k):
            e = p.ldg_i32(ids + (Int64(r) * top_k + j) * 4)
            if (e >= first) & (e < first + count):
                w = h.from_bits(p.ldg_u32(weights + (Int64(r) * top_k + j) * 4))
                words = p.ldg_stream_v4(rows + ((Int64(r) * top_k + j) * latent + tid * 8) * 2)
                for i in cutlass.range_constexpr(4):
                    acc[2 * i] = h.ffma(w, h.bf16_lo(words[i]), acc[2 * i])
                    acc[2 * i + 1] = h.ffma(w, h.bf16_hi(words[i]), acc[2 * i + 1])
        packed = [h.pack_bf16x2(acc[2 * i], acc[2 * i + 1]) for i in range(4)]
        p.stg_v4(out + (Int64(r) * latent + tid * 8) * 2, packed)
        if cutlass.const_expr(self.signal):
            signal_arrival(p.ldg_u64(ready + Int64(r // tokens) * 8), tid)


class CombineKernel:
    """The home rank's combine of its owners' partials, fused with the latent RMSNorm: one
    CTA per token, ``L / 8`` threads of 8 columns.

    Token ``t`` of source ``s``:

    1. the partial rows ``s * T + t`` of the owners that hold one of the token's experts
       are copied into shared memory all at once (``cp.async``, 16 bytes per thread and
       owner, addresses from the table; branches on presence are uniform over the CTA),
       with this thread's norm weights, and each thread reads its own bytes back after one
       wait: one round trip for every owner. (Loaded into registers, the compiler had
       issued them one or two at a time, each waiting for the last: the SASS interleaved
       the loads with the additions.)
    2. for owners ``o`` = 0 .. N-1 in order, when one of the token's ids lies in ``o``'s
       range: the first present partial is widened exactly to FP32, each later one added
       (``add.rn.f32``); one RNE rounding to BF16 -> ``routed[t]``;
    3. ``normed[t]`` = ``fast.device.norm.normalize_row`` of the BF16 routed row (the RMSNorm
       kernel's exact reduction tree and rounding points).

    Every CTA first lets the stream's next grid launch (``griddepcontrol.launch_dependents``):
    the up-projection that follows, launched with programmatic dependent launch, then
    streams its first weight stages while the combine runs, and waits
    (``griddepcontrol.wait``: this grid complete, its stores visible) before it reads
    ``normed``. A next grid launched without it waits for this one as usual.

    Constraints: ``L % 256 == 0``, ``L <= 8192``; ``ranks <= 32``; ``(min(N, K) + 1) * L * 2``
    bytes of shared memory (the present owners' rows and the norm weights) at most
    ``fast.device.SMEM_PER_CTA``; ids int32 ``[T, K]``; partial buffers BF16 ``[N*T, L]``; routed,
    normed BF16 ``[T, L]``; norm weight BF16 ``[L]``; table int64 ``[N]``.
    """

    def __init__(self, latent: int, top_k: int, ranks: int, per: int):
        self.latent, self.top_k, self.ranks, self.per = latent, top_k, ranks, per
        self.threads = latent // 8
        #: at most this many owners hold one of a token's ``top_k`` experts
        self.slots = min(ranks, top_k)
        self.stage_bytes = (self.slots + 1) * latent * 2  # and the norm weights
        if self.stage_bytes > SMEM_PER_CTA:
            raise ValueError(f"CombineKernel: min(ranks={ranks}, top_k={top_k}) partial rows "
                             f"and the norm weights of latent={latent} need {self.stage_bytes} "
                             f"bytes of shared memory, more than {SMEM_PER_CTA}")

    @classmethod
    def compile_args(cls, **params):
        """(kernel, fake arguments but the stream) for ``fast.device.compile.compiled``."""
        return cls(**params), [Int64(0)] * 5 + [Float32(1e-5), Int32(0), Int32(1)]

    @cute.jit
    def __call__(self, ids: Int64, table: Int64, routed: Int64, norm_weight: Int64,
                 normed: Int64, eps: Float32, source: Int32, tokens: Int32, stream):
        self.kernel(ids, table, routed, norm_weight, normed, eps, source, tokens).launch(
            grid=(tokens, 1, 1), block=(self.threads, 1, 1), stream=stream,
            smem=self.stage_bytes)

    @cute.kernel
    def kernel(self, ids: Int64, table: Int64, routed: Int64, norm_weight: Int64,
               normed: Int64, eps: Float32, source: Int32, tokens: Int32):
        from fast.device.norm import normalize_row

        cute.arch.griddepcontrol_launch_dependents()
        tid = cute.arch.thread_idx()[0]
        t = cute.arch.block_idx()[0]
        latent: cutlass.Constexpr = self.latent
        top_k: cutlass.Constexpr = self.top_k
        row = Int64(source) * Int64(tokens) + Int64(t)
        ranks: cutlass.Constexpr = self.ranks
        # the owners' partial-buffer addresses, loaded with the ids (they depend on nothing)
        bases = [p.ldg_u64(table + 8 * o) for o in range(ranks)]
        present = cute.make_rmem_tensor((ranks,), Int32)
        for o in cutlass.range_constexpr(ranks):
            present[o] = _owner_of_any(ids + Int64(t) * (top_k * 4), top_k, o * self.per,
                                       (o + 1) * self.per)
        # the present owners' 16 bytes of this thread's columns, into consecutive slots
        # (slot-major, so a warp's reads back are conflict-free), all copies in flight
        stage = cute.arch.get_dyn_smem(cutlass.Uint8, alignment=16).toint()
        threads: cutlass.Constexpr = self.threads
        slot = Int32(0)
        for o in cutlass.range_constexpr(ranks):
            if present[o] != 0:  # the same for the whole CTA: no divergence
                p.cp_async_16(stage + (slot * threads + tid) * 16,
                              bases[o] + (row * latent + tid * 8) * 2, True)
            slot = slot + present[o]
        # the norm weights too (a register load of them was issued only where they are used)
        p.cp_async_16(stage + (self.slots * threads + tid) * 16, norm_weight + tid * 16, True)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)  # this thread's copies, visible to this thread
        ww = p.lds_v4(stage + (self.slots * threads + tid) * 16)
        words = cute.make_rmem_tensor((ranks * 4,), Uint32)
        slot = Int32(0)
        for o in cutlass.range_constexpr(ranks):
            for i in cutlass.range_constexpr(4):
                words[o * 4 + i] = Uint32(0)
            if present[o] != 0:
                got = p.lds_v4(stage + (slot * threads + tid) * 16)
                for i in cutlass.range_constexpr(4):
                    words[o * 4 + i] = got[i]
            slot = slot + present[o]
        acc = cute.make_rmem_tensor((8,), Float32)
        for i in cutlass.range_constexpr(8):
            acc[i] = Float32(0.0)
        seen = Int32(0)
        for o in cutlass.range_constexpr(ranks):
            keep = present[o] != 0
            started = seen != 0
            for i in cutlass.range_constexpr(4):
                for half in cutlass.range_constexpr(2):
                    word = words[o * 4 + i]
                    v = h.bf16_lo(word) if half == 0 else h.bf16_hi(word)
                    a = acc[2 * i + half]
                    acc[2 * i + half] = cutlass.select_(
                        keep, cutlass.select_(started, h.fadd(a, v), v), a)
            seen = seen | present[o]
        packed = [h.pack_bf16x2(acc[2 * i], acc[2 * i + 1]) for i in range(4)]
        p.stg_v4(routed + (Int64(t) * latent + tid * 8) * 2, packed)
        out = normalize_row(packed, ww, eps, latent, self.threads // 32)
        p.stg_v4(normed + (Int64(t) * latent + tid * 8) * 2, out)
