"""CuTe DSL kernels of the wide layer's own communication: the publish into every rank's
Lamport mailbox, the poll that waits for it (with a timeout) and re-arms it, and the
tail's two rank-ordered all-reduces (the latent one fused with the RMSNorm).

Every kernel takes raw device addresses (``Int64``) and run-time sizes (``Int32``); the
other ranks' buffers are reached through tables of addresses in device memory (int64,
one entry per rank, rank order), so one kernel serves virtual ranks (every buffer on this
GPU) and real ranks (peer addresses from symmetric memory: plain unicast stores and loads,
never multicast).

The mailbox of one rank (``reference.schedules.mailbox``'s layout and protocol): two
rotating buffers of ``rows`` rows, each row ``L + 2E`` 16-bit words, contiguous
``int16 [2, rows, L + 2E]``. Columns ``[0, L)`` hold the BF16 latent (rank ``r`` writes
``[r L/N, (r+1) L/N)``), columns ``[L, L + 2E)`` the FP32 router logits as pairs of
16-bit words (rank ``r`` writes the ``2 E/N`` words from ``L + 2 (E/N) r``, i.e. the
logits of experts ``[r E/N, (r+1) E/N)`` in expert order). Empty is negative zero of the
lane's width: ``0x8000`` per latent word, ``0x80000000`` per logit word. In 16-byte
granules the row is uniform: granule ``g`` covers 16-bit columns ``[8g, 8g + 8)``, the
first ``L/8`` granules are latent, the next ``E/4`` are logits.

Over real ranks the two all-reduces read buffers the peers wrote with cuBLAS and library
kernels, which take no signal option; ``fast.device.arrival.ArrivalSignalKernel``,
launched after the writer in stream order, tells every reader that they are written (an
arrival counter in the reader's memory, after a system-scope release), and
``fast.device.arrival.ArrivalWaitKernel`` holds the reader's stream until every writer's
counter grew.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from fast.device import fp32 as h
from fast.device import ptx as p

__all__ = ["PublishKernel", "PollKernel", "LatentAllReduceNormKernel", "HiddenAllReduceKernel",
           "SENTINEL_LATENT_WORD", "SENTINEL_LOGIT_WORD", "ERROR_WORDS", "ERROR_FIELDS",
           "ERROR_TIMEOUT"]

#: A 32-bit word of the latent region in the armed state: two BF16 negative zeros.
SENTINEL_LATENT_WORD = 0x80008000
#: A 32-bit word of the logit region in the armed state: FP32 negative zero.
SENTINEL_LOGIT_WORD = 0x80000000
#: The error record of the poll (int32 words): a flag (``ERROR_TIMEOUT`` once a reader
#: timed out; the first one to set it writes the fields after it), the reader's rank, the
#: buffer, the token (row), the first still-empty 16-bit column of its granule, and the
#: number of 16-byte granules that timed out (every reader adds to it).
ERROR_FIELDS = ("flag", "rank", "buffer", "token", "column", "granules")
ERROR_WORDS = 8
ERROR_TIMEOUT = 1

_THREADS = 128


# --- PTX helpers this file needs beyond fast.device.ptx --------------------------------


def _ld_volatile_v4(address, now):
    """Four words from a 16-byte aligned global address, re-read from memory on every
    call (``ld.volatile.global.v4.u32``): a poll sees a peer's store as soon as it lands.
    ``now`` (the timer value of this poll iteration) is an operand the instruction does
    not use: it makes the load depend on the iteration, so the compiler can never hoist
    it out of the spin loop as a loop-invariant expression."""
    return cute.arch.inline_ptx(
        "ld.volatile.global.v4.u32 { {$w0}, {$w1}, {$w2}, {$w3} }, [{$r0}];",
        write_only_types=[Uint32] * 4, read_only_args=[Int64(address), Int64(now)])


def _st_volatile_v4(address, words):
    """Four words to a 16-byte aligned global address, not kept in a write-back cache
    (``st.volatile.global.v4.u32``): the publish's peer stores."""
    cute.arch.inline_ptx("st.volatile.global.v4.u32 [{$r0}], { {$r1}, {$r2}, {$r3}, {$r4} };",
                         write_only_types=[], read_only_args=[Int64(address)]
                         + [Uint32(w) for w in words])


def _sanitize_logit(word):
    """FP32 -0 (the logit sentinel) -> +0; every other word unchanged."""
    return cutlass.select_(Uint32(word) == Uint32(SENTINEL_LOGIT_WORD), Uint32(0), Uint32(word))


def _sanitize_latent(word):
    """Each BF16 -0 (the latent sentinel) of a word of two BF16 -> +0 (its sign bit
    cleared); every other half unchanged."""
    w = Uint32(word)
    keep_lo = cutlass.select_((w & Uint32(0xFFFF)) == Uint32(0x8000), Uint32(0xFFFF7FFF),
                              Uint32(0xFFFFFFFF))
    keep_hi = cutlass.select_((w & Uint32(0xFFFF0000)) == Uint32(0x80000000),
                              Uint32(0x7FFFFFFF), Uint32(0xFFFFFFFF))
    return w & keep_lo & keep_hi


def _sum_rank_order(words, ranks: int):
    """The 8 BF16 columns of ``ranks`` 16-byte granules (``words[4 o + i]``: rank ``o``)
    summed as ``reference.schedules.groups.ordered_sum_bf16`` does: ``acc`` = rank 0's
    value widened exactly to FP32, then ``acc = add.rn.f32(acc, rank o's value)`` for
    ``o`` = 1 .. N-1 in order, then one RNE rounding to BF16. Returns 4 packed words."""
    acc = cute.make_rmem_tensor((8,), Float32)
    for i in range(4):  # a plain helper: Python loops unroll at trace time
        acc[2 * i] = h.bf16_lo(words[i])
        acc[2 * i + 1] = h.bf16_hi(words[i])
    for o in range(1, ranks):
        for i in range(4):
            acc[2 * i] = h.fadd(acc[2 * i], h.bf16_lo(words[4 * o + i]))
            acc[2 * i + 1] = h.fadd(acc[2 * i + 1], h.bf16_hi(words[4 * o + i]))
    return [h.pack_bf16x2(acc[2 * i], acc[2 * i + 1]) for i in range(4)]


class PublishKernel:
    """One rank's ``WidePublish``: its slice of the front into every rank's mailbox. One
    CTA per (token ``t``, target rank ``d``), 128 threads.

    Input: the rank's FP32 front row ``[E/N logits | L/N latent]`` (``front [T, E/N +
    L/N]``, the FP32-out GEMM). CTA ``(t, d)`` stores into row ``t`` of buffer ``buffer``
    of rank ``d``'s mailbox (its address from ``table[d]``):

    * the ``E/N`` logits as FP32 words at 16-bit column ``L + 2 (E/N) rank``, each word
      ``0x80000000`` (-0) replaced by ``+0``;
    * the ``L/N`` latent values rounded once to BF16 (``cvt.rn.bf16x2.f32``, RNE: the
      reference's ``round_to_bfloat16`` of the FP32 value) at column ``(L/N) rank``, each
      BF16 ``0x8000`` (-0, including a negative value that rounds to -0) replaced by
      ``+0``.

    Stores are 16-byte ``st.volatile`` (a 32-bit word never tears, so a reader sees each
    word either armed or final). Bitwise equal to
    ``reference.schedules.mailbox.Mailbox.publish`` of ``round_to_bfloat16(front[:, E/N:])``
    and ``front[:, :E/N]``.

    Constraints: ``E/N % 4 == 0``, ``L/N % 8 == 0`` (16-byte granules); front contiguous,
    16-byte aligned; table int64 ``[N]`` of mailbox base addresses (buffer 0, row 0).
    """

    def __init__(self, latent: int, experts: int, ranks: int):
        self.latent, self.experts, self.ranks = latent, experts, ranks
        self.expert_shard, self.latent_shard = experts // ranks, latent // ranks
        self.logit_granules = self.expert_shard // 4
        self.latent_granules = self.latent_shard // 8
        self.front_row_bytes = (self.expert_shard + self.latent_shard) * 4
        self.row_bytes = 2 * (latent + 2 * experts)

    @classmethod
    def compile_args(cls, **params):
        """(kernel, fake arguments but the stream) for ``fast.device.compile.compiled``."""
        return cls(**params), [Int64(0)] * 2 + [Int32(0), Int32(0), Int32(1), Int32(1)]

    @cute.jit
    def __call__(self, front: Int64, table: Int64, rank: Int32, buffer: Int32, rows: Int32,
                 tokens: Int32, stream):
        self.kernel(front, table, rank, buffer, rows).launch(
            grid=(tokens, self.ranks, 1), block=(_THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, front: Int64, table: Int64, rank: Int32, buffer: Int32, rows: Int32):
        tid = cute.arch.thread_idx()[0]
        t, d, _ = cute.arch.block_idx()
        logit_granules: cutlass.Constexpr = self.logit_granules
        granules: cutlass.Constexpr = self.logit_granules + self.latent_granules
        box = p.ldg_u64(table + Int64(d) * 8)
        row = box + (Int64(buffer) * Int64(rows) + Int64(t)) * self.row_bytes
        src = front + Int64(t) * self.front_row_bytes
        logit_dst = row + 2 * self.latent + Int64(rank) * (4 * self.expert_shard)
        latent_src = src + 4 * self.expert_shard
        latent_dst = row + Int64(rank) * (2 * self.latent_shard)
        for i in cutlass.range_constexpr((granules + _THREADS - 1) // _THREADS):
            g = tid + _THREADS * i
            if g < logit_granules:
                got = p.ldg_stream_v4(src + g * 16)
                _st_volatile_v4(logit_dst + g * 16, [_sanitize_logit(w) for w in got])
            if (g >= logit_granules) & (g < granules):
                q = g - logit_granules
                a = p.ldg_stream_v4(latent_src + q * 32)
                b = p.ldg_stream_v4(latent_src + q * 32 + 16)
                vals = [h.from_bits(w) for w in (a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3])]
                packed = [h.pack_bf16x2(vals[2 * j], vals[2 * j + 1]) for j in range(4)]
                _st_volatile_v4(latent_dst + q * 16, [_sanitize_latent(w) for w in packed])


class PollKernel:
    """One rank's poll of its mailbox (``WideRouteSharded``'s reads): one CTA per token,
    128 threads, each thread a set of 16-byte granules of the token's row.

    For each granule ``g`` of row ``t`` of buffer ``buffer`` (latent granules ``g <
    L/8``, then logit granules):

    1. ``ld.volatile`` the 16 bytes until none of its words is the sentinel of its region
       (a latent granule: no 16-bit half ``0x8000``; a logit granule: no 32-bit word
       ``0x80000000``; a 16-bit test over a logit would mistake a logit whose low half is
       ``0x8000`` for an empty word) or the ``%globaltimer`` passes the deadline
       (``timeout_ns`` after the CTA started);
    2. arrived: the 16 bytes are copied to ``latent [T, L]`` (BF16) or ``logits [T, E]``
       (FP32) -- the data, bit for bit -- and the granule is re-armed (the sentinel
       stored back);
    3. timed out: the first reader to time out (``atom.cas`` on the flag) writes the
       error record (``ERROR_FIELDS``: rank, buffer, token, first empty 16-bit column);
       every timed-out granule adds 1 to its count; the granule is left as it is and the
       thread goes on (each later granule waits at most until the same deadline, so the
       kernel ends within about ``timeout_ns``: never a hang). The outputs of a timed-out
       call are unspecified; the host raises (``WideLayer.check``).

    Rows at and beyond ``T`` are not touched (they stay armed).

    Constraints: ``L % 8 == 0``, ``E % 4 == 0``; mailbox 16-byte aligned with rows of
    ``L + 2E`` 16-bit words; logits, latent contiguous, 16-byte aligned.
    """

    def __init__(self, latent: int, experts: int):
        self.latent, self.experts = latent, experts
        self.latent_granules = latent // 8
        self.granules = latent // 8 + experts // 4
        self.row_bytes = 2 * (latent + 2 * experts)

    @cute.jit
    def __call__(self, box: Int64, logits: Int64, latent: Int64, error: Int64, timeout_ns: Int64,
                 rank: Int32, buffer: Int32, rows: Int32, tokens: Int32, stream):
        self.kernel(box, logits, latent, error, timeout_ns, rank, buffer, rows).launch(
            grid=(tokens, 1, 1), block=(_THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, box: Int64, logits: Int64, latent: Int64, error: Int64, timeout_ns: Int64,
               rank: Int32, buffer: Int32, rows: Int32):
        self.poll_row(box, logits, latent, error, timeout_ns, rank, buffer, rows, _THREADS)

    @cute.jit
    def poll_row(self, box: Int64, logits: Int64, latent: Int64, error: Int64,
                 timeout_ns: Int64, rank: Int32, buffer: Int32, rows: Int32, threads: int,
                 staged=None):
        """Steps 1-3 for token ``t = blockIdx.x`` by this CTA's ``threads`` threads.
        ``staged``: shared-memory byte addresses ``(latent, logits)`` that also receive
        each arrived granule (row ``t``'s ``L`` BF16 and ``E`` FP32 values, packed), for a
        fused kernel that reads them after a barrier."""
        tid = cute.arch.thread_idx()[0]
        t = cute.arch.block_idx()[0]
        granules: cutlass.Constexpr = self.granules
        latent_granules: cutlass.Constexpr = self.latent_granules
        row = box + (Int64(buffer) * Int64(rows) + Int64(t)) * self.row_bytes
        deadline = cute.arch.globaltimer() + timeout_ns
        words = cute.make_rmem_tensor((4,), Uint32)
        for i in cutlass.range_constexpr((granules + threads - 1) // threads):
            g = tid + threads * i
            if g < granules:
                is_latent = g < latent_granules
                at = row + g * 16
                got = _ld_volatile_v4(at, deadline)
                for j in cutlass.range_constexpr(4):
                    words[j] = got[j]
                first = self._first_empty(words, is_latent)
                late = Int32(0)
                while (first < 8) & (late == 0):
                    now = cute.arch.globaltimer()
                    again = _ld_volatile_v4(at, now)
                    for j in cutlass.range_constexpr(4):
                        words[j] = again[j]
                    first = self._first_empty(words, is_latent)
                    late = cutlass.select_(now > deadline, Int32(1), Int32(0))
                if first == 8:
                    out = cutlass.select_(
                        is_latent, latent + (Int64(t) * self.latent + g * 8) * 2,
                        logits + (Int64(t) * self.experts + (g - latent_granules) * 4) * 4)
                    p.stg_v4(out, [words[j] for j in range(4)])
                    if cutlass.const_expr(staged is not None):
                        p.sts_v4(cutlass.select_(is_latent, staged[0] + g * 16,
                                                staged[1] + (g - latent_granules) * 16),
                                [words[j] for j in range(4)])
                    armed = cutlass.select_(is_latent, Uint32(SENTINEL_LATENT_WORD),
                                            Uint32(SENTINEL_LOGIT_WORD))
                    p.stg_v4(at, [armed] * 4)
                else:
                    if p.atomic_cas(error, 0, ERROR_TIMEOUT) == 0:
                        p.stg_i32(error + 4, rank)
                        p.stg_i32(error + 8, buffer)
                        p.stg_i32(error + 12, t)
                        p.stg_i32(error + 16, g * 8 + first)
                    p.atomic_add(error + 20, 1)

    @staticmethod
    def _first_empty(words, is_latent):
        """The first 16-bit half (0..7) of a granule that still holds the sentinel of its
        region, or 8 when it has arrived entirely."""
        first = Int32(8)
        for half in range(7, -1, -1):  # unrolled at trace time
            w = words[half // 2]
            if half % 2 == 0:
                latent_empty = (w & Uint32(0xFFFF)) == Uint32(0x8000)
                empty = cutlass.select_(is_latent, latent_empty,
                                        w == Uint32(SENTINEL_LOGIT_WORD))
            else:
                empty = is_latent & ((w & Uint32(0xFFFF0000)) == Uint32(0x80000000))
            first = cutlass.select_(empty, Int32(half), first)
        return first


class LatentAllReduceNormKernel:
    """One rank's latent all-reduce fused with the RMSNorm: one CTA per token, ``L / 8``
    threads of 8 columns.

    Token ``t``: every rank's BF16 partial row (``table[o] + t L``, rank order) is loaded
    up front (one 16-byte load per rank and thread, all in flight); ``routed[t]`` =
    ``reference.schedules.groups.ordered_sum_bf16`` of them bit for bit (FP32 from rank
    0's value, ``add.rn.f32`` of ranks 1 .. N-1 in order, one RNE rounding to BF16);
    ``normed[t]`` = ``fast.device.norm.normalize_row`` of that BF16 row (the RMSNorm kernel's
    exact reduction tree and rounding points: ``reference.emulation.rms_norm_tree``).

    Constraints: ``L % 256 == 0``, ``L <= 8192``; partials BF16 ``[rows, L]``, routed,
    normed BF16 ``[T, L]``, norm weight BF16 ``[L]``, contiguous, 16-byte aligned; table
    int64 ``[N]``.
    """

    def __init__(self, latent: int, ranks: int):
        self.latent, self.ranks = latent, ranks
        self.threads = latent // 8

    @classmethod
    def compile_args(cls, **params):
        """(kernel, fake arguments but the stream) for ``fast.device.compile.compiled``."""
        return cls(**params), [Int64(0)] * 4 + [Float32(1e-5), Int32(1)]

    @cute.jit
    def __call__(self, table: Int64, routed: Int64, norm_weight: Int64, normed: Int64,
                 eps: Float32, tokens: Int32, stream):
        self.kernel(table, routed, norm_weight, normed, eps).launch(
            grid=(tokens, 1, 1), block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, table: Int64, routed: Int64, norm_weight: Int64, normed: Int64,
               eps: Float32):
        from fast.device.norm import normalize_row

        tid = cute.arch.thread_idx()[0]
        t = cute.arch.block_idx()[0]
        ranks: cutlass.Constexpr = self.ranks
        offset = (Int64(t) * self.latent + tid * 8) * 2
        words = cute.make_rmem_tensor((ranks * 4,), Uint32)
        for o in cutlass.range_constexpr(ranks):
            got = p.ldg_stream_v4(p.ldg_u64(table + 8 * o) + offset)
            for i in cutlass.range_constexpr(4):
                words[4 * o + i] = got[i]
        packed = _sum_rank_order(words, ranks)
        p.stg_v4(routed + offset, packed)
        ww = p.ldg_stream_v4(norm_weight + tid * 16)
        p.stg_v4(normed + offset, normalize_row(packed, ww, eps, self.latent, self.threads // 32))


class HiddenAllReduceKernel:
    """One rank's all-reduce of the hidden partials: one CTA of 128 threads per (token,
    1024 columns), one 16-byte granule (8 columns) per thread.

    Rank ``o``'s hidden partial is its shared-expert partial ``shared_o [T, H]`` with its
    own up-projection columns ``[o H/N, (o+1) H/N)`` replaced by ``up_o [T, H/N]`` (the
    ``addmm`` of those columns): for column block ``q`` the kernel reads ``up_q`` from
    rank ``q`` and ``shared_o`` from every other rank (addresses from the two tables), so
    the partial is never assembled in memory. ``out[t]`` = ``ordered_sum_bf16`` of the N
    partials bit for bit (FP32 from rank 0's value, ``add.rn.f32`` in rank order, one
    RNE rounding).

    Constraints: ``H/N % 8 == 0``; shared BF16 ``[rows, H]``, up BF16 ``[rows, H/N]``,
    out BF16 ``[T, H]``, contiguous, 16-byte aligned; tables int64 ``[N]``.
    """

    def __init__(self, hidden: int, ranks: int):
        self.hidden, self.ranks = hidden, ranks
        self.columns = hidden // ranks
        self.granules = hidden // 8

    @classmethod
    def compile_args(cls, **params):
        """(kernel, fake arguments but the stream) for ``fast.device.compile.compiled``."""
        return cls(**params), [Int64(0)] * 3 + [Int32(1)]

    @cute.jit
    def __call__(self, shared_table: Int64, up_table: Int64, out: Int64, tokens: Int32, stream):
        self.kernel(shared_table, up_table, out).launch(
            grid=(tokens, (self.granules + _THREADS - 1) // _THREADS, 1),
            block=(_THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, shared_table: Int64, up_table: Int64, out: Int64):
        tid = cute.arch.thread_idx()[0]
        t, chunk, _ = cute.arch.block_idx()
        ranks: cutlass.Constexpr = self.ranks
        columns: cutlass.Constexpr = self.columns
        g = chunk * _THREADS + tid
        if g < self.granules:
            owner = (g * 8) // columns
            words = cute.make_rmem_tensor((ranks * 4,), Uint32)
            for o in cutlass.range_constexpr(ranks):
                shared_at = p.ldg_u64(shared_table + 8 * o) + (Int64(t) * self.hidden + g * 8) * 2
                up_at = p.ldg_u64(up_table + 8 * o) + (Int64(t) * columns + g * 8 - o * columns) * 2
                got = p.ldg_stream_v4(cutlass.select_(owner == o, up_at, shared_at))
                for i in cutlass.range_constexpr(4):
                    words[4 * o + i] = got[i]
            packed = _sum_rank_order(words, ranks)
            p.stg_v4(out + (Int64(t) * self.hidden + g * 8) * 2, packed)
