"""Schedule emulations: the per-rank programs of the stock order's multi-GPU variants.

* :mod:`reference.schedules.groups` — the ranks (virtual ranks in one process or real
  ranks under ``torch.distributed``; the ordered BF16 all-reduce), with the byte codec of
  :mod:`reference.schedules.codec`;
* :mod:`reference.schedules.mailbox` — the wide layer's Lamport mailbox
  (:mod:`reference.schedules.comm` re-exports all three).
* :mod:`reference.schedules.dep` — S1, the DEP layer (experts EP over all ranks).
* :mod:`reference.schedules.wide` — S2, the wide layer (TP over all ranks).
* :mod:`reference.schedules.launch` — the same per-rank code under ``torchrun``.

S0 (the stock order on one rank) is :mod:`reference.layer`.
"""
