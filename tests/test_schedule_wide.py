"""reference.schedules.wide, the pieces: the routing lists, the rank-count check, the
persistent scratch.

The contracts of the whole schedule (every stage of every rank at 1..16 ranks, the bucket
edges, two layers through one mailbox, the -0 sentinel) are ``verify/test_wide.py``.
"""

from __future__ import annotations

import pytest
import torch

from model.config import LatentMoEConfig
from reference.schedules.groups import run_virtual
from reference.schedules.wide import WideScratch, check_wide_ranks, routing_lists


def test_routing_lists_in_claim_order_with_poisoned_tails():
    ids = torch.tensor([[2, 0], [0, 1], [2, 1]], dtype=torch.int32)  # pairs t*2 + j
    lists, counts = routing_lists(ids, 4, capacity=3)
    assert counts.tolist() == [2, 2, 2, 0]
    assert lists.tolist() == [[1, 2, -1], [3, 5, -1], [0, 4, -1], [-1, -1, -1]]
    lists, counts = routing_lists(ids, 4, capacity=3,
                                  claim_order=torch.tensor([5, 4, 3, 2, 1, 0]))
    assert lists.tolist() == [[2, 1, -1], [5, 3, -1], [4, 0, -1], [-1, -1, -1]]
    with pytest.raises(ValueError, match="3 tokens > capacity 2"):
        routing_lists(ids, 4, capacity=2)
    with pytest.raises(ValueError, match="not a permutation"):
        routing_lists(ids, 4, capacity=3, claim_order=torch.tensor([0, 0, 1, 2, 3, 4]))


def test_rank_counts_that_do_not_split_the_layer():
    cfg = LatentMoEConfig.small()
    check_wide_ranks(cfg, 8)
    with pytest.raises(ValueError, match="3 ranks do not split"):
        check_wide_ranks(cfg, 3)
    with pytest.raises(ValueError, match=r"intermediate 256 % \(16 \* 32\)"):
        check_wide_ranks(cfg, 16)


def test_scratch_holds_a_mailbox_of_the_requested_rows():
    cfg = LatentMoEConfig.small()

    def body(group):
        scratch = WideScratch(group, cfg, rows=12)
        return scratch.rows, scratch.mailbox.rows, scratch.mailbox.is_armed()

    assert run_virtual(2, body) == [(12, 12, True)] * 2
