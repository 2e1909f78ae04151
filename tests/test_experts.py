"""reference.experts, the pieces: the TP shard's rows and columns, bad input.

The contracts (every pair's row bit for bit against the loop over pairs of
``verify.oracles.experts``, whole and TP-sliced, two layers in a row) are
``verify/test_experts_reference.py``; the schedules' expert rows are checked in
``verify/test_dep.py`` and ``verify/test_wide.py``.
"""

from __future__ import annotations

import pytest
import torch

from model.config import LatentMoEConfig
from model.weights import LatentMoEWeights
from reference.experts import expert_rows, expert_rows_mxfp8, shard_rows
from reference.mx import quantize_mxfp8

CFG = LatentMoEConfig.tiny()


@pytest.fixture(scope="module")
def weights():
    return LatentMoEWeights.random(CFG, seed=3)


def make_inputs(gen, t=5):
    latent = torch.randn(t, CFG.latent, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(CFG.experts, generator=gen)[: CFG.top_k] for _ in range(t)])
    return latent, ids.to(torch.int32)


def test_shard_rows_and_errors(gen, weights):
    rows, cols = shard_rows(CFG, (1, 2))
    assert rows == list(range(32, 64)) + list(range(96, 128)) and cols == slice(32, 64)
    latent, ids = make_inputs(gen)
    with pytest.raises(ValueError, match=r"intermediate I=64 must split into 4 slices"):
        expert_rows(latent, ids, weights, CFG, shard=(0, 4))
    with pytest.raises(ValueError, match="rank < ranks"):
        expert_rows(latent, ids, weights, CFG, shard=(2, 2))
    with pytest.raises(ValueError, match=r"ids must be an int32/int64 \[T, top_k\] = \[5, 16\]"):
        expert_rows(latent, ids[:, :8], weights, CFG)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, experts=32\)"):
        expert_rows(latent, ids + 32, weights, CFG)
    with pytest.raises(ValueError, match="latent must be a bfloat16"):
        expert_rows(latent.float(), ids, weights, CFG)
    codes, scales = quantize_mxfp8(latent)
    with pytest.raises(ValueError, match=r"scales must be a uint8 \[T, L/32\]"):
        expert_rows_mxfp8(codes, scales[:, :1], ids, weights, CFG)


def test_expert_rows_of_the_mxfp8_latent_are_those_of_the_bf16_latent(gen, weights):
    latent, ids = make_inputs(gen)
    codes, scales = quantize_mxfp8(latent)
    assert torch.equal(expert_rows_mxfp8(codes, scales, ids.long(), weights, CFG),
                       expert_rows(latent, ids, weights, CFG))
