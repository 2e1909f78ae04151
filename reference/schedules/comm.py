"""The communication layer of the schedule emulations: one per-rank code path, two worlds.

Every schedule in :mod:`reference.schedules` is written as a function of one rank,
``fn(group, ...)``, that talks to its peers only through a :class:`Group`. Two groups
implement the same interface with the same bits:

* :class:`VirtualGroup` — ``N`` virtual ranks in one process, one Python thread per rank
  (:func:`run_virtual`), meeting at a :class:`threading.Barrier`. Torch ops release the
  GIL, so the ranks really interleave; the mailbox's peer stores are direct writes into
  the other rank's buffer.
* :class:`TorchGroup` — real ranks under :mod:`torch.distributed` (gloo on CPU, NCCL on
  GPUs; launched with ``torchrun`` or :mod:`torch.multiprocessing`). Every collective is
  built from ``all_gather`` of raw bytes, so data movement is bit-exact for every dtype
  (FP8, E8M0, BF16, ...) and every reduction is done by this module, in a defined order,
  never by the backend.

Collectives and their precision (identical in both worlds):

* :meth:`Group.all_gather` — every rank's tensor, in rank order 0..N-1 (shapes may
  differ between ranks; dtype must agree).
* :meth:`Group.all_to_all` — ``send[j]`` goes to rank ``j``; returns ``recv[i]`` from
  rank ``i`` (the dispatch and combine of the DEP layer).
* :meth:`Group.all_reduce_bf16` — the stock one-shot all-reduce (vLLM's custom
  all-reduce / FlashInfer's one-shot kernels): every rank reads every rank's BF16 partial,
  accumulates in FP32 **starting from rank 0's value and adding ranks 1..N-1 in order**
  (each addition one FP32 rounding), then rounds once to BF16. Every rank therefore holds
  the same bits. See :func:`ordered_sum_bf16`.

The wide layer's Lamport mailbox is :class:`Mailbox` (built by :meth:`Group.mailbox`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

__all__ = [
    "Group",
    "VirtualGroup",
    "VirtualWorld",
    "TorchGroup",
    "Mailbox",
    "MailboxTimeout",
    "MailboxProtocolError",
    "run_virtual",
    "ordered_sum_bf16",
    "SENTINEL_BF16",
    "SENTINEL_F32",
    "sanitize_negative_zero",
]

SENTINEL_BF16 = -0x8000
"""The empty marker of a 16-bit mailbox word: BF16 negative zero (bits 0x8000, read as
int16)."""

SENTINEL_F32 = -0x80000000
"""The empty marker of a 32-bit mailbox word: FP32 negative zero (bits 0x80000000, read
as int32)."""

DEFAULT_TIMEOUT_S = 120.0
"""How long a virtual rank waits at a barrier before the world is declared hung."""


# --------------------------------------------------------------------------- reductions


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


def sanitize_negative_zero(words: torch.Tensor) -> torch.Tensor:
    """A copy of integer words ``words`` (int16 for BF16 lanes, int32 for FP32 lanes) in
    which the negative-zero pattern (the Lamport sentinel of that width) is replaced by
    +0. Every other word is unchanged. The writer of a mailbox applies this before it
    stores, so a real -0 can never be mistaken for an empty slot (-0 and +0 are equal
    values; only the sign of a zero is lost)."""
    if words.dtype == torch.int16:
        sentinel = SENTINEL_BF16
    elif words.dtype == torch.int32:
        sentinel = SENTINEL_F32
    else:
        raise TypeError(f"sanitize_negative_zero: words are {words.dtype}, not int16/int32")
    return torch.where(words == sentinel, torch.zeros_like(words), words)


# --------------------------------------------------------------------------- the groups


class Group:
    """What a rank of a schedule may do with its peers.

    ``rank`` (0..size-1) and ``size`` identify the rank. Subclasses implement
    :meth:`all_gather`, :meth:`barrier` and the mailbox transport; everything else is
    defined here once, so both worlds reduce in the same order.
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

    def mailbox(self, rows: int, latent: int, experts: int, *, buffers: int = 2) -> "Mailbox":
        """This rank's :class:`Mailbox` (collective: every rank calls it)."""
        raise NotImplementedError  # pragma: no cover


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

    def mailbox(self, rows: int, latent: int, experts: int, *, buffers: int = 2) -> "Mailbox":
        box = Mailbox(self, rows, latent, experts, buffers=buffers)
        self.world.mailboxes[self.rank] = box
        self.barrier()  # every rank's buffers are registered before any peer store
        return box


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


# ----------------------------------------------------------------- torch.distributed


_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
    torch.float8_e5m2, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.bool,
]  # fmt: skip
_MAX_DIMS = 6


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
        got = [_decode(b, x.device)[0] for b in self._gather_bytes(_encode([x]))]
        _check_dtypes(self.rank, got)
        return got

    def _all_to_all(self, send: list[torch.Tensor]) -> list[torch.Tensor]:
        device = send[0].device
        gathered = self._gather_bytes(_encode(send))
        recv = [_decode(b, device)[self.rank] for b in gathered]
        _check_dtypes(self.rank, recv)
        return recv

    def mailbox(self, rows: int, latent: int, experts: int, *, buffers: int = 2) -> "Mailbox":
        box = Mailbox(self, rows, latent, experts, buffers=buffers)
        self.barrier()
        return box


def _encode(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Tensors -> one uint8 tensor: per tensor a header of 8 int64 (dtype index, ndim,
    shape padded to 6) then its bytes. Bit-exact for every dtype in ``_DTYPES``."""
    chunks = [torch.tensor([len(tensors)], dtype=torch.int64).view(torch.uint8)]
    for t in tensors:
        if t.dim() > _MAX_DIMS:
            raise ValueError(f"_encode: {t.dim()} dims > {_MAX_DIMS}")
        shape = list(t.shape) + [0] * (_MAX_DIMS - t.dim())
        head = torch.tensor([_DTYPES.index(t.dtype), t.dim(), *shape], dtype=torch.int64)
        chunks.append(head.view(torch.uint8))
        chunks.append(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8))
    return torch.cat(chunks)


def _decode(raw: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
    raw = raw.cpu()
    count = int(raw[:8].clone().view(torch.int64).item())
    pos, out = 8, []
    for _ in range(count):
        head = raw[pos : pos + 64].clone().view(torch.int64).tolist()
        pos += 64
        dtype, ndim = _DTYPES[head[0]], head[1]
        shape = head[2 : 2 + ndim]
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        body = raw[pos : pos + nbytes].clone()
        pos += nbytes
        out.append(body.view(dtype).reshape(shape).to(device))
    return out


# ------------------------------------------------------------------------- the mailbox


class MailboxTimeout(TimeoutError):
    """A reader polled a mailbox row that no writer filled within the timeout."""


class MailboxProtocolError(RuntimeError):
    """A writer found its target slot not armed (a reader did not re-arm it, or two
    calls used the same rotating buffer without a synchronization between them)."""


@dataclass(frozen=True)
class MailboxLayout:
    """Columns of one mailbox row, in 16-bit words.

    ``[0, latent)``: the BF16 latent; rank r writes ``[r*latent/N, (r+1)*latent/N)``.
    ``[latent, latent + 2*experts)``: the FP32 router logits as pairs of 16-bit words
    (little endian: low half first); rank r writes the 2*(experts/N) words from
    ``latent + 2*(experts/N)*r``. The latent region is empty when a 16-bit word is 0x8000
    (BF16 -0); the logit region is read as 32-bit words, empty when 0x80000000 (FP32 -0).
    (A 16-bit sentinel test over FP32 lanes would mistake every logit whose low half is
    0x8000 for an empty word.)"""

    latent: int
    experts: int
    ranks: int

    @property
    def width(self) -> int:
        return self.latent + 2 * self.experts

    @property
    def latent_shard(self) -> int:
        return self.latent // self.ranks

    @property
    def expert_shard(self) -> int:
        return self.experts // self.ranks


class Mailbox:
    """A rank's Lamport mailbox: ``buffers`` rotating buffers of ``rows`` rows of
    :class:`MailboxLayout` ``width`` int16 words, in this rank's memory.

    Protocol (one call = one :meth:`publish` by every rank, then this rank's
    :meth:`poll_logits` and :meth:`poll_latent`, then :meth:`advance`):

    * armed state: every latent word 0x8000, every logit 32-bit word 0x80000000; rows at
      and beyond the call's T stay armed (they are never written: an "empty" poison);
    * :meth:`publish`: the writer sanitizes -0 to +0 (:func:`sanitize_negative_zero`),
      checks the target slot is armed (else :class:`MailboxProtocolError`) and stores its
      shard into **every** rank's current buffer (its own included). Virtual world: a
      direct store into the peer's tensor under that mailbox's lock (the lock makes one
      writer's store of one call atomic, as the GPU's 16-byte vector stores never tear a
      word). torch.distributed: an ``all_gather`` of every rank's shard, which each rank
      writes into its own buffer — real peer stores (symmetric memory / IPC pointers)
      come from ``fast/``;
    * :meth:`poll_logits` / :meth:`poll_latent`: spin until no word of the region of
      rows ``[0, T)`` is the sentinel (timeout: :class:`MailboxTimeout` naming rank,
      buffer, token and column), return a copy, then re-arm the region (write the
      sentinel back);
    * :meth:`advance`: the next call uses the next buffer (calls alternate, so a fast
      peer's next publish never lands in the buffer this rank is still reading).
    """

    def __init__(self, group: Group, rows: int, latent: int, experts: int, *, buffers: int = 2):
        if latent % group.size or experts % group.size:
            raise ValueError(
                f"Mailbox: latent {latent} and experts {experts} must divide by "
                f"{group.size} ranks"
            )
        if rows < 1 or buffers < 1:
            raise ValueError(f"Mailbox: rows {rows}, buffers {buffers}")
        self.group, self.rows = group, rows
        self.layout = MailboxLayout(latent, experts, group.size)
        self.lock = threading.Lock()
        self.buffers = [
            torch.empty(rows, self.layout.width, dtype=torch.int16) for _ in range(buffers)
        ]
        for b in self.buffers:
            _arm(b, self.layout, slice(0, rows))
        self.call = 0

    # -- which buffer
    @property
    def index(self) -> int:
        return self.call % len(self.buffers)

    @property
    def buffer(self) -> torch.Tensor:
        return self.buffers[self.index]

    def advance(self) -> None:
        self.call += 1

    def is_armed(self, rows: slice | None = None) -> bool:
        """Whether every word of ``rows`` (default all) of the current buffer is the
        sentinel of its region."""
        rows = rows or slice(0, self.rows)
        with self.lock:
            return _armed_mask(self.buffer[rows], self.layout).all().item()

    # -- writer
    def publish(self, latent_bf16: torch.Tensor, logits_f32: torch.Tensor) -> None:
        """Store this rank's shard into every rank's current buffer.

        ``latent_bf16``: BF16 [T, latent/N] (this rank's latent columns, already rounded);
        ``logits_f32``: FP32 [T, experts/N] (this rank's router logits). T <= rows."""
        lay, rank, t = self.layout, self.group.rank, latent_bf16.shape[0]
        if latent_bf16.dtype != torch.bfloat16 or logits_f32.dtype != torch.float32:
            raise TypeError("Mailbox.publish: latent must be bfloat16, logits float32")
        if latent_bf16.shape != (t, lay.latent_shard) or logits_f32.shape != (t, lay.expert_shard):
            raise ValueError(
                f"rank {rank}: publish shapes {tuple(latent_bf16.shape)}, "
                f"{tuple(logits_f32.shape)}; expected ({t}, {lay.latent_shard}), "
                f"({t}, {lay.expert_shard})"
            )
        if t > self.rows:
            raise ValueError(f"rank {rank}: {t} tokens > mailbox rows {self.rows}")
        lat = sanitize_negative_zero(latent_bf16.detach().cpu().contiguous().view(torch.int16))
        log = sanitize_negative_zero(logits_f32.detach().cpu().contiguous().view(torch.int32))
        shard = (lat, log)
        if isinstance(self.group, VirtualGroup):
            for peer in self.group.world.mailboxes:
                peer._store(rank, shard, self.index)
        else:
            lats = self.group.all_gather(lat)
            logs = self.group.all_gather(log)
            for writer in range(self.group.size):
                self._store(writer, (lats[writer], logs[writer]), self.index)

    def _store(self, writer: int, shard: tuple[torch.Tensor, torch.Tensor], index: int) -> None:
        lat, log = shard
        lay, t = self.layout, lat.shape[0]
        c0 = writer * lay.latent_shard
        l0 = lay.latent + 2 * lay.expert_shard * writer
        with self.lock:
            buf = self.buffers[index]
            target_lat = buf[:t, c0 : c0 + lay.latent_shard]
            target_log = buf[:t, l0 : l0 + 2 * lay.expert_shard]
            if not (
                (target_lat == SENTINEL_BF16).all()
                and (target_log.contiguous().view(torch.int32) == SENTINEL_F32).all()
            ):
                raise MailboxProtocolError(
                    f"rank {writer} publishing into rank {self.group.rank}'s buffer "
                    f"{index}: target slot not armed (missing re-arm, or a rotating "
                    f"buffer reused without synchronization)"
                )
            target_lat.copy_(lat)
            target_log.copy_(log.view(torch.int16).reshape(t, 2 * lay.expert_shard))

    # -- readers
    def poll_logits(self, tokens: int, *, timeout: float = 10.0) -> torch.Tensor:
        """FP32 [tokens, experts]: every rank's logits of each token, once no 32-bit word
        of the logit region is 0x80000000; then the region is re-armed."""
        lay = self.layout
        cols = slice(lay.latent, lay.width)
        words = self._poll(tokens, cols, torch.int32, SENTINEL_F32, timeout)
        return words.view(torch.float32)

    def poll_latent(self, tokens: int, *, timeout: float = 10.0) -> torch.Tensor:
        """BF16 [tokens, latent]: every rank's latent shard of each token, once no 16-bit
        word of the latent region is 0x8000; then the region is re-armed."""
        words = self._poll(tokens, slice(0, self.layout.latent), torch.int16, SENTINEL_BF16, timeout)
        return words.view(torch.bfloat16)

    def _poll(self, tokens, cols, dtype, sentinel, timeout):
        if tokens > self.rows:
            raise ValueError(f"rank {self.group.rank}: poll of {tokens} rows > {self.rows}")
        deadline = time.monotonic() + timeout
        pause = 1e-5
        while True:
            with self.lock:
                region = self.buffer[:tokens, cols].contiguous().view(dtype).clone()
                empty = region == sentinel
                if not empty.any():
                    self.buffer[:tokens, cols] = _sentinel_words(region.shape, dtype)
                    return region
            if time.monotonic() > deadline:
                t, c = (int(v) for v in empty.nonzero()[0])
                width = 1 if dtype == torch.int16 else 2
                raise MailboxTimeout(
                    f"rank {self.group.rank}: mailbox buffer {self.index} token {t} "
                    f"column {cols.start + width * c} (16-bit word) still empty "
                    f"(sentinel {sentinel & 0xFFFFFFFF:#x}) after {timeout} s; "
                    f"{int(empty.sum())} empty words in rows [0, {tokens})"
                )
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)


def _sentinel_words(shape, dtype) -> torch.Tensor:
    """int16 words [rows, cols16] of the armed state of a region of ``dtype`` lanes."""
    fill = SENTINEL_BF16 if dtype == torch.int16 else SENTINEL_F32
    words = torch.full(shape, fill, dtype=dtype)
    return words.view(torch.int16)


def _arm(buf: torch.Tensor, lay: MailboxLayout, rows: slice) -> None:
    n = buf[rows].shape[0]
    buf[rows, : lay.latent] = _sentinel_words((n, lay.latent), torch.int16)
    buf[rows, lay.latent :] = _sentinel_words((n, lay.experts), torch.int32)


def _armed_mask(buf: torch.Tensor, lay: MailboxLayout) -> torch.Tensor:
    lat = buf[:, : lay.latent] == SENTINEL_BF16
    log = buf[:, lay.latent :].contiguous().view(torch.int32) == SENTINEL_F32
    return torch.cat([lat, log.repeat_interleave(2, dim=1)], dim=1)
