"""Contracts of the reference's routed experts against the loop over pairs
(:func:`verify.oracles.experts.expert_rows`): MXFP8 latent, FC1 over ``w13`` rows
``[gate; up]`` rounded once to FP32, SiTU in FP32, the MXFP8 re-quantization of the
activation, FC2 rounded to FP32 then BF16, row ``t * K + k``. Bit for bit, on the CPU,
for whole experts and for tensor-parallel slices of the intermediate, and for two layers in
a row (the second with other weights, through the same process and its caches).

The GPU engine's contracts are in ``verify/test_experts.py``; the schedules compare their
expert rows with the reference stage (``verify/test_dep.py``, ``verify/test_wide.py``).
"""

from __future__ import annotations

import pytest
import torch

from reference.experts import expert_rows, routed_experts
from reference.finalize import finalize
from reference.mx import quantize_mxfp8
from verify import cases
from verify.oracles import experts as oracle

pytestmark = pytest.mark.config("small")
ROWS = ("pair", "column")


def _latent_and_ids(cfg, tokens: int, seed: int):
    """A BF16 latent at the layer's magnitude (a few outliers, one all-zero block per row)
    and distinct top-k ids per token."""
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(tokens, cfg.latent, generator=g) * 0.5
    latent[:, :cfg.block] = 0
    latent[:, -1] = 8.0
    ids = torch.stack([torch.randperm(cfg.experts, generator=g)[:cfg.top_k]
                       for _ in range(tokens)])
    return latent.to(torch.bfloat16), ids.to(torch.int32)


@pytest.mark.backends("reference")
@pytest.mark.parametrize("shard", [None, (1, 4)], ids=["whole", "tp-slice-1-of-4"])
@pytest.mark.parametrize("tokens", (1, 7))
def test_expert_rows(backend, tokens, shard, seed, contract):
    """The reference's ``expert_rows`` (BF16 latent in) and the reference backend's stage
    (MXFP8 latent in, every expert local) against the pair loop."""
    cfg, w = cases.config("small"), cases.weights("small")
    latent, ids = _latent_and_ids(cfg, tokens, seed)
    want = oracle.expert_rows(latent, ids, w, cfg, shard=shard)
    contract.bitwise(expert_rows(latent, ids, w, cfg, shard=shard), want,
                     what=f"expert rows (shard {shard}) vs the pair loop", index_names=ROWS)
    codes, scales = quantize_mxfp8(latent)
    stage = backend.expert_rows(codes, scales, ids, w, experts=(0, cfg.experts),
                                shard=shard or (0, 1))
    contract.bitwise(stage.rows, want, what=f"{backend.name} expert_rows stage (shard {shard}) "
                     "vs the pair loop", index_names=ROWS)


def test_expert_rows_two_layers(seed, contract):
    """Two layers in a row, one process: the second layer's weights (other experts at every
    index) must be read, not the first layer's dequantized experts."""
    cfg = cases.config("small")
    latent, ids = _latent_and_ids(cfg, 3, seed)
    for name, w in (("first", cases.weights("small")), ("second", cases.other_weights("small"))):
        got = expert_rows(latent, ids, w, cfg)
        contract.bitwise(got, oracle.expert_rows(latent, ids, w, cfg),
                         what=f"{name} layer's expert rows vs the pair loop", index_names=ROWS)


def test_routed_experts_is_finalize_of_the_rows(seed, contract):
    cfg, w = cases.config("small"), cases.weights("small")
    latent, ids = _latent_and_ids(cfg, 2, seed)
    g = torch.Generator().manual_seed(seed)
    weights = torch.softmax(torch.randn(2, cfg.top_k, generator=g), -1)
    contract.bitwise(routed_experts(latent, weights, ids, w, cfg),
                     finalize(oracle.expert_rows(latent, ids, w, cfg), weights),
                     what="routed latent = finalize(pair rows)", index_names=("token", "column"))
