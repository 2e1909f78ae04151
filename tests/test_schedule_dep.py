"""reference.schedules.dep, the pieces: the default tactics, the owner's partial Finalize
and the home's combine on constructed values, bad groups.

The contracts of the whole schedule (every stage of every rank at 1..16 ranks, the bucket
edges, two layers in one world, designed experts that make every order visible) are
``verify/test_dep.py``.
"""

from __future__ import annotations

import pytest
import torch

from model.config import LatentMoEConfig
from model.weights import LatentMoEWeights
from reference.schedules.dep import dep_layer_virtual, dep_tactics, local_finalize, ordered_combine

BIG, SMALL = 2.0**30, 1.0 + 2.0**-7  # FP32 ULP at 2^30 is 2^7: SMALL is absorbed by BIG


def test_default_tactics():
    assert dep_tactics(1) == {"front_splits": 1, "router_splits": 4}
    assert dep_tactics(32) == {"front_splits": 1, "router_splits": 4}
    assert dep_tactics(33) == {"front_splits": 1, "router_splits": 2}
    assert dep_tactics(64) == {"front_splits": 1, "router_splits": 2}


def test_local_finalize_reads_only_local_slots_in_k_order():
    rows = torch.tensor([[[BIG], [float("nan")], [-BIG], [SMALL]]], dtype=torch.bfloat16)
    weights = torch.ones(1, 4)
    local = torch.tensor([[True, False, True, True]])
    # slot 1 is not local (NaN poison, never read); in k order BIG - BIG + SMALL = SMALL
    assert local_finalize(rows, weights, local).item() == SMALL
    # a row with no local slot gives +0
    assert local_finalize(rows, weights, torch.zeros(1, 4, dtype=torch.bool)).item() == 0.0


def test_ordered_combine_adds_present_owners_in_rank_order():
    parts = [torch.full((2, 1), v, dtype=torch.bfloat16) for v in (BIG, float("nan"), -BIG, SMALL)]
    present = [torch.tensor([True, True]), torch.tensor([False, False]),
               torch.tensor([True, True]), torch.tensor([True, False])]
    out = ordered_combine(parts, present)
    assert out[0].item() == SMALL  # (BIG + -BIG) + SMALL; owner 1 absent (NaN never read)
    assert out[1].item() == 0.0
    with pytest.raises(RuntimeError, match=r"tokens \[0, 1\] received no partial"):
        ordered_combine(parts[1:2], present[1:2])


def test_rejects_bad_groups():
    cfg = LatentMoEConfig.tiny()
    weights = LatentMoEWeights.random(cfg, seed=1)
    g = torch.Generator().manual_seed(0)

    def rows(t):
        return torch.randn(t, cfg.hidden, generator=g).bfloat16()

    with pytest.raises(ValueError, match="do not divide over 3 ranks"):
        dep_layer_virtual([rows(2) for _ in range(3)], weights)
    with pytest.raises(ValueError, match="one padded T"):
        dep_layer_virtual([rows(2), rows(1)], weights)
