"""The arrival protocol of the real-rank schedules (CuTe DSL): how a rank that wrote into
a peer's memory tells it so, and how the peer waits for it without ever hanging.

* ``signal_arrival`` -- the end of a writing CTA: a system-scope release, then +1 on the
  receiver's *arrival counter* for this sender (the DEP layer's dispatch and owner
  finalize end with it);
* ``ArrivalSignalKernel`` -- the same signal as a kernel of its own, launched after writers
  that cannot signal (cuBLAS, library kernels: the wide layer's all-reduce inputs);
* ``ArrivalWaitKernel`` -- holds the receiver's stream until every sender's counter reached
  this call's target, or a timeout passes; a timeout writes an error record
  (``WAIT_ERROR_FIELDS``) that the layer's ``check`` raises as :class:`ArrivalTimeout`
  (:func:`wait_timeout`), the one timeout type of the real-rank schedules (the wide
  layer's mailbox poll raises it too).

The DEP (``fast.schedules.dep_peer``) and wide (``fast.schedules.wide_peer``) layers over
real ranks both use these pieces; their counters live in symmetric memory.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from fast.device import ptx as p

__all__ = ["signal_arrival", "ArrivalSignalKernel", "ArrivalWaitKernel", "WAIT_ERROR_FIELDS",
           "WAIT_TIMEOUT", "wait_timeout_message", "wait_timeout", "ArrivalTimeout"]


class ArrivalTimeout(TimeoutError):
    """A rank gave up waiting for a peer's writes, after the layer's timeout: an
    ``ArrivalWaitKernel`` whose counter for ``peer`` fell short (``DepPeerLayer.check``,
    ``WidePeerLayer.check``, from :func:`wait_timeout`), or the wide layer's mailbox poll
    that found a word of ``peer``'s still empty (``WideLayer.check``,
    ``WidePeerLayer.check``, from ``fast.schedules.wide.mailbox_timeout``). The layer must
    then be reset (the virtual wide layer) or rebuilt on every rank.

    Fields (None where not known): ``rank``, the rank that waited; ``what``, what it waited
    for (a schedule's name of the wait, e.g. ``"receive rows"``, or ``"mailbox"``);
    ``peer``, the rank whose writes did not arrive. ``str(error)`` says all of it."""

    def __init__(self, message: str, *, rank: int | None = None, what: str | None = None,
                 peer: int | None = None):
        super().__init__(message)
        self.rank, self.what, self.peer = rank, what, peer


def signal_arrival(counter: Int64, tid):
    """End of a CTA whose stores another rank will read: every thread fences at system
    scope (``fence.acq_rel.sys``: its stores, peer stores over NVLink included, are
    ordered before what follows), the CTA synchronizes, and thread 0 adds 1 to the
    receiver's counter word at ``counter`` with ``red.release.sys`` (a reader that
    acquires the new count sees every store of the CTA)."""
    cute.arch.fence_acq_rel_sys()
    cute.arch.barrier()
    cute.arch.inline_ptx("{ .reg .pred first; setp.eq.s32 first, {$r1}, 0; "
                         "@first red.release.sys.global.add.u32 [{$r0}], 1; }",
                         write_only_types=[], read_only_args=[Int64(counter), Int32(tid)])


class ArrivalSignalKernel:
    """Tell every rank that this rank's buffers of the current stage are written: ``N``
    CTAs of 32 threads; CTA ``d`` ends with ``signal_arrival`` on the word at ``table[d]``
    (this rank's arrival counter in rank ``d``'s memory): a ``fence.acq_rel.sys`` by every
    thread, a CTA barrier, then ``red.release.sys`` add 1 by thread 0.

    Launched after the writer kernels in stream order (their stores are complete when this
    kernel starts), so a reader that acquires the new count (``ArrivalWaitKernel``,
    ``ld.acquire.sys``) sees every store the rank made before it, peer stores included.
    Each launch adds exactly 1 to each target counter (a wait's increment is 1 per call).
    No data is read or written besides the counters.

    Constraints: table int64 ``[N]`` of 4-byte aligned counter addresses.
    """

    def __init__(self, ranks: int):
        self.ranks = ranks

    @classmethod
    def compile_args(cls, **params):
        """(kernel, fake arguments but the stream) for ``fast.device.compile.compiled``."""
        return cls(**params), [Int64(0)]

    @cute.jit
    def __call__(self, table: Int64, stream):
        self.kernel(table).launch(grid=(self.ranks, 1, 1), block=(32, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, table: Int64):
        tid = cute.arch.thread_idx()[0]
        d = cute.arch.block_idx()[0]
        signal_arrival(p.ldg_u64(table + Int64(d) * 8), tid)


#: The int32 words of a wait's error record: nonzero ``code`` (1: timed out), the waiting
#: ``rank``, the ``what`` it waited for (an index the schedule names), the ``peer``
#: rank whose counter fell short, the counter's ``seen`` value and its ``target``.
WAIT_ERROR_FIELDS = ("code", "rank", "what", "peer", "seen", "target")
WAIT_TIMEOUT = 1


def wait_timeout_message(schedule: str, waits: tuple[str, ...], record: dict, ranks: int,
                         timeout_s: float) -> str:
    """The message of an ``ArrivalWaitKernel`` timeout from its error record (the fields of
    ``WAIT_ERROR_FIELDS``): the waiting rank, what it waited for (``waits[what]``), the
    rank that did not arrive, the counts, and what to do."""
    return (f"{schedule} rank {record['rank']} of {ranks}: the {waits[record['what']]} from "
            f"rank {record['peer']} did not arrive within {timeout_s:g} s (its counter here "
            f"read {record['seen']}, the call needed {record['target']}); every rank must call "
            "the layer with the same T. The layer's counters are now out of step with its "
            "peers': rebuild it on every rank.")


def wait_timeout(schedule: str, waits: tuple[str, ...], record: dict, ranks: int,
                 timeout_s: float) -> ArrivalTimeout:
    """The :class:`ArrivalTimeout` of an ``ArrivalWaitKernel`` error record
    (:func:`wait_timeout_message`, with the record's ``rank``, ``waits[what]`` and
    ``peer``)."""
    return ArrivalTimeout(wait_timeout_message(schedule, waits, record, ranks, timeout_s),
                          rank=record["rank"], what=waits[record["what"]], peer=record["peer"])


class ArrivalWaitKernel:
    """Hold the stream until every peer's arrival counter has reached this call's target,
    or a timeout passes: one CTA of 32 * ceil(N / 32) threads.

    ``counters`` holds N uint32 words in this rank's memory, word ``s`` counting the CTAs
    of peer ``s`` that finished writing here (``signal_arrival``); ``expected`` (int32,
    this rank's memory) is the count every word held after the previous wait. Thread
    ``s < N`` polls word ``s`` (``ld.acquire.sys``) until ``seen - target >= 0`` in
    wrapping 32-bit arithmetic, where ``target = expected + increment``, or until
    ``%globaltimer`` passes ``timeout_ns`` after the thread began. The CTA then
    synchronizes and thread 0 stores ``target`` to ``expected``. A timeout writes the error
    record (``WAIT_ERROR_FIELDS``) at ``error`` if no error is recorded there yet (the
    first one wins; ``atom.cas`` on the code) and the kernel ends: never a hang. After a
    timeout the layer's outputs are unspecified and its counters out of step: the host
    raises :class:`ArrivalTimeout` (``DepPeerLayer.check``, ``WidePeerLayer.check``) and
    the layer must be rebuilt.

    The counters only grow (by ``T`` per call and peer), so no re-arm is needed and a CUDA
    graph replays the same launches.
    """

    def __init__(self, ranks: int):
        self.ranks = ranks
        self.threads = 32 * ((ranks + 31) // 32)

    @classmethod
    def compile_args(cls, **params):
        """(kernel, fake arguments but the stream) for ``fast.device.compile.compiled``."""
        return cls(**params), [Int64(0)] * 4 + [Int32(1), Int32(0), Int32(0)]

    @cute.jit
    def __call__(self, counters: Int64, expected: Int64, error: Int64, timeout_ns: Int64,
                 increment: Int32, rank: Int32, what: Int32, stream):
        self.kernel(counters, expected, error, timeout_ns, increment, rank, what).launch(
            grid=(1, 1, 1), block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, counters: Int64, expected: Int64, error: Int64, timeout_ns: Int64,
               increment: Int32, rank: Int32, what: Int32):
        tid = cute.arch.thread_idx()[0]
        target = p.ldg_i32(expected) + increment
        if tid < self.ranks:
            start = cute.arch.globaltimer()
            seen = Int32(p.ld_acquire_sys(counters + Int64(tid) * 4))
            late = Int32(0)
            while ((seen - target) < 0) & (late == 0):
                seen = Int32(p.ld_acquire_sys(counters + Int64(tid) * 4))
                late = cutlass.select_(cute.arch.globaltimer() - start > timeout_ns,
                                       Int32(1), Int32(0))
            if ((seen - target) < 0) & (late != 0):
                if p.atomic_cas(error, 0, WAIT_TIMEOUT) == 0:
                    record = [rank, what, tid, seen, target]
                    for i in cutlass.range_constexpr(len(record)):
                        p.stg_i32(error + 4 * (i + 1), record[i])
        cute.arch.barrier()
        if tid == 0:
            p.stg_i32(expected, target)
