"""Device timing of GPU benchmark cases: pytest-benchmark's statistics in device seconds.

A GPU case is decorated with :func:`device_timed` and times its kernel with
:func:`measure`. Every round then runs as:

1. outside the measured region (pytest-benchmark's ``setup``): L2 flushed by a 256 MiB
   write (:func:`flush_l2`), then a GPU spin of ``SPIN_CYCLES`` queued behind it;
2. the clock's start event is recorded behind the spin, the callable is enqueued, the end
   event is recorded; the host waits for the end event.

The spin lasts about 0.5 ms, longer than the host needs to enqueue one call (wrapper
checks, pointer wrapping and launch: 50-150 us for the CuTe DSL kernels), so the start
event fires when the kernel is already queued: the round's duration is the device time
of the callable alone, with a cold L2. A whole layer is timed the same way by passing
``graph.replay`` of a ``torch.cuda.CUDAGraph`` that captured it (the callable must leave
its work joined to the current stream).

The same method gives the peers' figures (:func:`median_device_us`, stored in
``extra_info``, not in the statistics) and the copy bandwidth that is the ceiling of a
memory-bound kernel (:func:`copy_bandwidth_gbs`).
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

__all__ = [
    "graph_replay_us",
    "SPIN_CYCLES",
    "DeviceClock",
    "device_clock",
    "device_timed",
    "flush_l2",
    "prepare_round",
    "measure",
    "median_device_us",
    "host_us",
    "copy_bandwidth_gbs",
    "bandwidth_info",
]

#: Cycles of ``torch.cuda._sleep`` queued before each start event: about 0.5 ms at the
#: H200's 1.98 GHz, several times the host cost of one fast-kernel call.
SPIN_CYCLES = 1_000_000
#: Bytes written to evict L2 before each round (the H200's L2 is 50 MiB).
FLUSH_BYTES = 256 << 20

_FLUSH: dict[str, torch.Tensor] = {}


class DeviceClock:
    """A pytest-benchmark timer whose differences are device seconds.

    pytest-benchmark times a round as ``end - start`` with ``start = timer()`` before the
    call and ``end = timer()`` after it. The first call of a pair records a CUDA start
    event and returns 0.0; the second records the end event, waits for it and returns the
    seconds between the two events. So ``end - start`` is the device time of what was
    enqueued between them. Use only through :func:`measure` (``benchmark.pedantic``, one
    iteration per round), which always calls the timer in such pairs.
    """

    __name__ = "device_clock"

    def __init__(self) -> None:
        self._start: torch.cuda.Event | None = None

    def __call__(self) -> float:
        if self._start is None:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
            return 0.0
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        start, self._start = self._start, None
        return start.elapsed_time(end) * 1e-3

    def reset(self) -> None:
        """Forget a start event left by an interrupted round."""
        self._start = None

    def __repr__(self) -> str:
        return "device_clock"


#: The one clock of every GPU case (its name is stored in each result's options).
device_clock = DeviceClock()


def device_timed(function):
    """Mark a benchmark case as a GPU case timed by :data:`device_clock`: the markers
    ``gpu`` and ``benchmark_gpu``, and pytest-benchmark's ``benchmark(timer=...)``."""
    for mark in (pytest.mark.gpu, pytest.mark.benchmark_gpu,
                 pytest.mark.benchmark(timer=device_clock)):
        function = mark(function)
    return function


def flush_l2(device: str = "cuda") -> None:
    """Evict L2 by writing ``FLUSH_BYTES`` (the buffer is allocated once per device)."""
    buf = _FLUSH.get(device)
    if buf is None:
        buf = _FLUSH[device] = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
    buf.fill_(1)


def prepare_round(before=None) -> None:
    """The unmeasured part of a round: ``before()`` where given (what the callable needs in
    place, e.g. a polled mailbox restored), flush L2, then queue the spin."""
    device_clock.reset()
    if before is not None:
        before()
    flush_l2()
    torch.cuda._sleep(SPIN_CYCLES)


def measure(benchmark, fn, *, rounds: int = 50, warmup_rounds: int = 3,
            before=None) -> float:
    """Time ``fn`` into ``benchmark``'s statistics (device seconds per round, see the
    module docstring) and return the median in microseconds.

    ``fn`` is called once first (compilation, allocator warm-up), outside the statistics;
    ``before`` (optional) runs ahead of every call, outside the measured region.
    The test must carry :func:`device_timed`; :mod:`benchmarks.conftest` refuses a
    ``benchmark_gpu`` case timed by another clock."""
    if before is not None:
        before()
    fn()
    torch.cuda.synchronize()
    benchmark.pedantic(fn, setup=lambda: prepare_round(before), rounds=rounds,
                       warmup_rounds=warmup_rounds)
    return benchmark.stats.stats.median * 1e6


def median_device_us(fn, reps: int = 30, warmup: int = 3, before=None) -> float:
    """Median device microseconds of ``fn()`` over ``reps`` rounds, each prepared and
    timed as in :func:`measure` (for figures kept in ``extra_info``: peers, copies)."""
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    times = []
    for _ in range(reps):
        prepare_round(before)
        start = device_clock()
        fn()
        times.append((device_clock() - start) * 1e6)
    return statistics.median(times)


def graph_replay_us(fn, reps: int = 20) -> float:
    """Warm-L2 microseconds of one CUDA-graph replay of ``fn`` (captured after an eager
    call and one on a side stream; the mean of ``reps`` back-to-back replays): the peers'
    smoke figures, not a benchmark's."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(reps):
        graph.replay()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) * 1e3 / reps


def host_us(fn, reps: int = 200) -> float:
    """Host microseconds per call of ``fn`` (wrapper + launch), the device kept busy."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / reps * 1e6


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth (bytes read + bytes written) in GB/s, the ceiling
    a memory-bound kernel is measured against."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = median_device_us(lambda: b.copy_(a), reps=10)
    return 2 * nbytes / (us * 1e-6) / 1e9


def bandwidth_info(*, batch: int, nbytes: int, device_us: float, copy_gbs: float,
                   peers: dict[str, float], stage: str | None = None,
                   schedule: str | None = None, variant: str | None = None) -> dict:
    """The ``extra_info`` of a GPU case (keys in ``benchmarks/README.md``): what it
    measures, its counted bytes, GB/s and fraction of the copy bandwidth from the median
    device time, and each peer's median device microseconds."""
    if (stage is None) == (schedule is None):
        raise ValueError("bandwidth_info: give exactly one of stage= and schedule=")
    gbs = nbytes / (device_us * 1e-6) / 1e9
    info = {"stage": stage} if stage is not None else {"schedule": schedule}
    if variant is not None:
        info["variant"] = variant
    info.update(batch=batch, bytes=nbytes, device_us=device_us, gbs=gbs, copy_gbs=copy_gbs,
                fraction_of_copy=gbs / copy_gbs, peers=dict(peers),
                device=torch.cuda.get_device_name())
    return info
