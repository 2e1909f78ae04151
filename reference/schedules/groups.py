"""The groups of ranks the schedule emulations run on: one per-rank code path, two worlds.

Every schedule in :mod:`reference.schedules` is written as a function of one rank,
``fn(group, ...)``, that talks to its peers only through a :class:`Group`. Two groups
implement the same interface with the same bits:

* :class:`VirtualGroup` — ``N`` virtual ranks in one process, one Python thread per rank
  (:func:`run_virtual`), meeting at a :class:`threading.Barrier`. Torch ops release the
  GIL, so the ranks really interleave; the mailbox's peer stores are direct writes into
  the other rank's buffer.
* :class:`TorchGroup` — real ranks under :mod:`torch.distributed` (gloo on CPU, NCCL on
  GPUs; launched with ``torchrun`` or :mod:`torch.multiprocessing`). Every collective is
  built from ``all_gather`` of raw bytes (:mod:`reference.schedules.codec`), so data
  movement is bit-exact for every dtype and every reduction is done by this module, in a
  defined order, never by the backend.

Collectives and their precision (identical in both worlds):

* :meth:`Group.all_gather` — every rank's tensor, in rank order 0..N-1 (shapes may
  differ between ranks; dtype must agree).
* :meth:`Group.all_to_all` — ``send[j]`` goes to rank ``j``; returns ``recv[i]`` from
  rank ``i`` (the dispatch and combine of the DEP layer).
* :meth:`Group.all_reduce_bf16` — the stock one-shot all-reduce: every rank reads every
  rank's BF16 partial, accumulates in FP32 **starting from rank 0's value and adding ranks
  1..N-1 in order** (each addition one FP32 rounding), then rounds once to BF16. Every
  rank therefore holds the same bits. See :func:`ordered_sum_bf16`.

The wide layer's Lamport mailbox is :class:`~reference.schedules.mailbox.Mailbox`, opened on
a group by :func:`~reference.schedules.mailbox.open_mailbox`; it builds on this module
(which does not import it) and keeps the virtual ranks' mailboxes in
:attr:`VirtualWorld.mailboxes`.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

import torch

from reference.schedules.codec import decode, encode

__all__ = [
    "Group",
    "VirtualGroup",
    "VirtualWorld",
    "TorchGroup",
    "run_virtual",
    "ordered_sum_bf16",
    "DEFAULT_TIMEOUT_S",
]

DEFAULT_TIMEOUT_S = 120.0
"""How long a virtual rank waits at a barrier before the world is declared hung."""



def ordered_sum_bf16(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The defined reduction of :meth:`Group.all_reduce_bf16`.

    ``parts``: N BF16 tensors of one shape, rank 0 first. Returns BF16 of that shape:
    ``acc = f32(parts[0]); acc = acc + f32(parts[i]) for i = 1..N-1`` (each addition is one
    FP32 rounding, round-to-nearest-even), then one rounding to BF16. With N = 1 the
    result is ``parts[0]`` bit for bit (BF16 -> FP32 -> BF16 is exact).
    """
    if not parts:
        raise ValueError("ordered_sum_bf16: no parts")
    for i, p in enumerate(parts):
        if p.dtype != torch.bfloat16:
            raise TypeError(f"ordered_sum_bf16: part {i} is {p.dtype}, expected bfloat16")
        if p.shape != parts[0].shape:
            raise ValueError(
                f"ordered_sum_bf16: part {i} has shape {tuple(p.shape)}, "
                f"part 0 {tuple(parts[0].shape)}"
            )
    acc = parts[0].to(torch.float32)
    for p in parts[1:]:
        acc = acc + p.to(torch.float32)  # FP32 add: one rounding per rank
    return acc.to(torch.bfloat16)


class Group:
    """What a rank of a schedule may do with its peers.

    ``rank`` (0..size-1) and ``size`` identify the rank. Subclasses implement
    :meth:`all_gather` and :meth:`barrier`; everything else is defined here once, so both
    worlds reduce in the same order.
    """

    rank: int
    size: int

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:  # pragma: no cover
        """Every rank's ``x`` (rank order; shapes may differ, dtypes must agree)."""
        raise NotImplementedError

    def barrier(self) -> None:  # pragma: no cover
        raise NotImplementedError

    def all_to_all(self, send: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``send[j]`` (any shape, one dtype) goes to rank ``j``; returns ``recv`` with
        ``recv[i]`` = what rank ``i`` sent to this rank. Data movement only (bit-exact)."""
        if len(send) != self.size:
            raise ValueError(
                f"rank {self.rank}: all_to_all needs {self.size} send tensors, got {len(send)}"
            )
        return self._all_to_all(list(send))

    def _all_to_all(self, send: list[torch.Tensor]) -> list[torch.Tensor]:  # pragma: no cover
        raise NotImplementedError

    def all_reduce_bf16(self, x: torch.Tensor) -> torch.Tensor:
        """The stock one-shot all-reduce of BF16 ``x`` (same shape on every rank):
        :func:`ordered_sum_bf16` of the gathered partials (FP32, rank order from rank 0,
        one BF16 rounding). Every rank returns the same bits."""
        if x.dtype != torch.bfloat16:
            raise TypeError(f"rank {self.rank}: all_reduce_bf16 of {x.dtype}")
        parts = self.all_gather(x)
        return ordered_sum_bf16(parts)


# ----------------------------------------------------------------- the virtual world


class VirtualWorld:
    """Shared state of ``size`` virtual ranks in one process: a reusable barrier, one
    exchange slot per rank, and the registry of every rank's mailbox buffers (the
    emulation of symmetric memory: a peer store is a write into another rank's
    tensor)."""

    def __init__(self, size: int, timeout: float = DEFAULT_TIMEOUT_S):
        if size < 1:
            raise ValueError(f"VirtualWorld: size {size} < 1")
        self.size = size
        self.timeout = timeout
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.slots: list[Any] = [None] * size
        self.mailboxes: list[Any] = [None] * size

    def abort(self) -> None:
        """Break the barrier so that every waiting rank raises (one rank failed)."""
        self.barrier.abort()


class VirtualGroup(Group):
    """Rank ``rank`` of a :class:`VirtualWorld`. Collectives exchange references through
    the world's slots between two barriers (so no rank overwrites a slot that a peer
    still reads) and return private copies."""

    def __init__(self, world: VirtualWorld, rank: int):
        self.world, self.rank, self.size = world, rank, world.size

    def barrier(self) -> None:
        try:
            self.world.barrier.wait()
        except threading.BrokenBarrierError:
            raise RuntimeError(
                f"virtual rank {self.rank}: barrier broken (a peer failed or "
                f"did not arrive within {self.world.timeout} s)"
            ) from None

    def _exchange(self, item: Any) -> list[Any]:
        self.world.slots[self.rank] = item
        self.barrier()
        got = list(self.world.slots)
        self.barrier()
        return got

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        got = self._exchange(x)
        _check_dtypes(self.rank, got)
        return [t.clone() for t in got]

    def _all_to_all(self, send: list[torch.Tensor]) -> list[torch.Tensor]:
        got = self._exchange(send)
        recv = [got[i][self.rank] for i in range(self.size)]
        _check_dtypes(self.rank, recv)
        return [t.clone() for t in recv]



def run_virtual(
    size: int, fn: Callable[[VirtualGroup], Any], *, timeout: float = DEFAULT_TIMEOUT_S
) -> list[Any]:
    """Run ``fn(group)`` on ``size`` virtual ranks (one thread each) and return the
    results in rank order. If a rank raises, the barrier is broken so its peers stop, and
    the first rank's exception (lowest rank that failed) is re-raised here."""
    world = VirtualWorld(size, timeout)
    results: list[Any] = [None] * size
    errors: list[BaseException | None] = [None] * size

    def body(rank: int) -> None:
        try:
            results[rank] = fn(VirtualGroup(world, rank))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors[rank] = exc
            world.abort()

    if size == 1:
        body(0)
    else:
        threads = [
            threading.Thread(target=body, args=(r,), name=f"virtual-rank-{r}")
            for r in range(size)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 4 * timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                world.abort()
                raise TimeoutError(f"run_virtual: {t.name} still running after {4 * timeout} s")
    failed = [e for e in errors if e is not None]
    if failed:
        # prefer a root cause over the "barrier broken" errors it caused in the peers
        roots = [e for e in failed if "barrier broken" not in str(e)]
        raise (roots or failed)[0]
    return results


def _check_dtypes(rank: int, tensors: Sequence[torch.Tensor]) -> None:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise TypeError(f"rank {rank}: collective over mixed dtypes {sorted(map(str, dtypes))}")


class TorchGroup(Group):
    """A rank of a :mod:`torch.distributed` process group (default: the world).

    Every collective moves raw bytes with ``all_gather`` (a header of dtype and shape
    first, then the zero-padded payload), so any dtype travels bit-exactly over gloo and
    NCCL, and the reductions are :func:`ordered_sum_bf16` on every rank, bitwise equal to
    the virtual world. ``all_to_all`` is emulated by gathering every rank's send list
    (data movement only; the NVLink dispatch/combine kernels live in ``fast/``)."""

    def __init__(self, group=None, device: torch.device | str | None = None):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("TorchGroup: torch.distributed is not initialized")
        self.dist, self.group = dist, group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if device is None:
            device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
        self.device = torch.device(device)

    def barrier(self) -> None:
        self.dist.barrier(group=self.group)

    def _gather_bytes(self, payload: torch.Tensor) -> list[torch.Tensor]:
        n = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        sizes = [torch.empty_like(n) for _ in range(self.size)]
        self.dist.all_gather(sizes, n, group=self.group)
        width = max(int(s.item()) for s in sizes)
        padded = torch.zeros(max(width, 1), dtype=torch.uint8, device=self.device)
        padded[: payload.numel()] = payload.to(self.device)
        out = [torch.empty_like(padded) for _ in range(self.size)]
        self.dist.all_gather(out, padded, group=self.group)
        return [o[: int(s.item())] for o, s in zip(out, sizes)]

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        got = [decode(b, x.device)[0] for b in self._gather_bytes(encode([x]))]
        _check_dtypes(self.rank, got)
        return got

    def _all_to_all(self, send: list[torch.Tensor]) -> list[torch.Tensor]:
        device = send[0].device
        gathered = self._gather_bytes(encode(send))
        recv = [decode(b, device)[self.rank] for b in gathered]
        _check_dtypes(self.rank, recv)
        return recv

