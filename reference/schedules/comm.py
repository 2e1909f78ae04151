"""The communication layer of the schedule emulations, in three modules:

* :mod:`reference.schedules.groups` — the ranks: :class:`~reference.schedules.groups.Group`,
  virtual ranks in one process (:func:`~reference.schedules.groups.run_virtual`) and real
  ranks under ``torch.distributed``
  (:class:`~reference.schedules.groups.TorchGroup`), the rank-ordered BF16 all-reduce;
* :mod:`reference.schedules.codec` — the byte codec the real-process collectives move
  every dtype with;
* :mod:`reference.schedules.mailbox` — the wide layer's Lamport mailbox (sentinel,
  sanitize, poll, re-arm, rotating buffers).

This module re-exports their public names, so ``from reference.schedules.comm import ...``
reads one place.
"""

from reference.schedules.codec import decode, encode
from reference.schedules.groups import (
    DEFAULT_TIMEOUT_S,
    Group,
    TorchGroup,
    VirtualGroup,
    VirtualWorld,
    ordered_sum_bf16,
    run_virtual,
)
from reference.schedules.mailbox import (
    SENTINEL_BF16,
    SENTINEL_F32,
    Mailbox,
    MailboxLayout,
    MailboxProtocolError,
    MailboxTimeout,
    open_mailbox,
    sanitize_negative_zero,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Group",
    "Mailbox",
    "MailboxLayout",
    "MailboxProtocolError",
    "MailboxTimeout",
    "SENTINEL_BF16",
    "SENTINEL_F32",
    "TorchGroup",
    "VirtualGroup",
    "VirtualWorld",
    "decode",
    "encode",
    "open_mailbox",
    "ordered_sum_bf16",
    "run_virtual",
    "sanitize_negative_zero",
]
