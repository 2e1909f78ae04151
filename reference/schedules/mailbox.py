"""The wide layer's Lamport mailbox: one rank's rotating receive buffers, written by every
rank's peer stores, read by polling.

An empty word holds the *sentinel*, negative zero of its lane's width (BF16 ``0x8000`` in
the latent region, FP32 ``0x80000000`` in the logit region); a writer replaces every real
negative zero by ``+0`` before it stores (:func:`sanitize_negative_zero`), so a reader
knows a word has arrived when it no longer holds the sentinel, and re-arms it after
reading. The protocol is :class:`Mailbox`'s docstring.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from reference.schedules.groups import Group, VirtualGroup

__all__ = [
    "Mailbox",
    "open_mailbox",
    "MailboxLayout",
    "MailboxTimeout",
    "MailboxProtocolError",
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


def open_mailbox(group: Group, rows: int, latent: int, experts: int, *,
                 buffers: int = 2) -> Mailbox:
    """This rank's :class:`Mailbox` on ``group`` (collective: every rank calls it). Virtual
    ranks register it in their world (``VirtualWorld.mailboxes``: the peers' stores write
    into it); the barrier then orders every registration before any peer store."""
    box = Mailbox(group, rows, latent, experts, buffers=buffers)
    if isinstance(group, VirtualGroup):
        group.world.mailboxes[group.rank] = box
    group.barrier()
    return box
