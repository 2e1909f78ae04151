"""reference.layer: the stock order (S0) on the small config, and the FP64 ideal layer."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model.config import LatentMoEConfig
from model.weights import LatentMoEWeights
from reference.experts import routed_experts
from reference.gemm import addmm
from reference.layer import ideal_layer, stock_order, stock_order_trace
from reference.norm import rms_norm

CFG = LatentMoEConfig.small()


@pytest.fixture(scope="module")
def weights():
    return LatentMoEWeights.random(CFG, seed=11)


def hidden(gen, t):
    return torch.randn(t, CFG.hidden, generator=gen).bfloat16()


@pytest.fixture(scope="module")
def batch_and_trace(weights):
    g = torch.Generator().manual_seed(12345)
    x = torch.randn(6, CFG.hidden, generator=g).bfloat16()
    return x, stock_order_trace(x, weights, CFG)


def test_trace_stages_fit_together(weights, batch_and_trace):
    x, tr = batch_and_trace
    s2 = 2 * CFG.shared_intermediate
    assert tr.out.dtype == torch.bfloat16 and tr.out.shape == (6, CFG.hidden)
    assert tr.logits.dtype == torch.float32 and tr.ids.dtype == torch.int32
    assert torch.equal(tr.latent, tr.front[:, s2:])
    assert torch.equal(tr.routed, routed_experts(tr.latent, tr.weights, tr.ids, weights, CFG))
    assert torch.equal(tr.normed, rms_norm(tr.routed, weights.latent_norm, CFG.rms_eps))
    assert torch.equal(tr.out, addmm(tr.shared, tr.normed, weights.up))
    assert torch.isfinite(tr.out.float()).all()
    # the SiTU saturation range is reached by the shared gates of this random layer
    assert (tr.front[:, : CFG.shared_intermediate].float().abs() > CFG.situ_beta).any()


def test_deterministic_and_batch_invariant(gen, weights, batch_and_trace):
    x, tr = batch_and_trace
    assert torch.equal(stock_order(x[:1], weights, CFG), tr.out[:1])
    # token 3 and token 5 placed among new batch-mates, in other positions
    mates = hidden(gen, 2)
    y = torch.cat([mates[:1], x[5:6], mates[1:], x[3:4]])
    out = stock_order(y, weights, CFG)
    assert torch.equal(out[1], tr.out[5]) and torch.equal(out[3], tr.out[3])


def test_ideal_layer_routes_by_float64_scores(weights, batch_and_trace):
    """Without ``ids`` the ideal layer routes by the top-k of its float64 biased scores
    (ties to the lower id), and is then the layer evaluated on those ids. (Its quality
    against the quantized layer is a contract: ``verify/test_quality.py``.)"""
    x, _ = batch_and_trace
    scores = torch.sigmoid(x.double() @ weights.gate.double().T) + weights.bias.double()
    ids = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :CFG.top_k]
    own = ideal_layer(x, weights, CFG)
    assert own.dtype == torch.float64
    assert torch.equal(own, ideal_layer(x, weights, CFG, ids=ids))


def test_ideal_is_sensitive_to_quantization_free_changes(weights, batch_and_trace):
    # the ideal layer reads the weights (a changed up projection changes it)
    x, tr = batch_and_trace
    other = dataclasses.replace(weights, up=(weights.up.float() * 2).bfloat16())
    a = ideal_layer(x[:2], weights, CFG, ids=tr.ids[:2])
    b = ideal_layer(x[:2], other, CFG, ids=tr.ids[:2])
    assert bool((a != b).all())


def test_errors(weights):
    with pytest.raises(ValueError, match=r"x must be a bfloat16 \[T, H=512\]"):
        stock_order(torch.zeros(2, 512), weights, CFG)
    with pytest.raises(ValueError, match="weights must be LatentMoEWeights built for this config"):
        stock_order(torch.zeros(2, 512, dtype=torch.bfloat16), weights, LatentMoEConfig.tiny())
    with pytest.raises(ValueError, match=r"ids must be int \[T, K\] = \[2, 16\]"):
        ideal_layer(torch.zeros(2, 512, dtype=torch.bfloat16), weights, CFG,
                    ids=torch.zeros(2, 8, dtype=torch.int32))
