"""reference.experts against a per-pair numpy float64 loop on the tiny config."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from reference.config import LatentMoEConfig
from reference.experts import expert_rows, expert_rows_mxfp8, routed_experts, shard_rows
from reference.finalize import finalize
from reference.mx import dequantize_mxfp4, dequantize_mxfp8, quantize_mxfp8
from reference.weights import LatentMoEWeights
from test_activation import numpy_fp32 as situ_numpy_fp32
from test_fp import seed_of

CFG = LatentMoEConfig.tiny()


@pytest.fixture(scope="module")
def weights():
    return LatentMoEWeights.random(CFG, seed=3)


def make_inputs(request, t=5):
    g = torch.Generator().manual_seed(seed_of(request.node.nodeid))
    latent = torch.randn(t, CFG.latent, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(CFG.experts, generator=g)[: CFG.top_k] for _ in range(t)])
    return latent, ids.to(torch.int32)


_DEQUANTIZED: dict = {}


def dequantized(w: LatentMoEWeights):
    """float64 numpy copies of every expert's w13 and w2 (cached per weights object)."""
    key = id(w)
    if key not in _DEQUANTIZED:
        _DEQUANTIZED[key] = (dequantize_mxfp4(w.w13, w.w13_scales).double().numpy(),
                             dequantize_mxfp4(w.w2, w.w2_scales).double().numpy(), w)
    return _DEQUANTIZED[key][:2]


def pair_loop(latent, ids, w: LatentMoEWeights, i0=0, i1=None):
    """Per (t, k): numpy float64 FC1 (exact here: MXFP8 x MXFP4 products have <= 6
    significand bits and K = 64, far from float64's 53), rounded to FP32; SiTU in FP32
    (test_activation's formulation); MXFP8 re-quantize; FC2 in float64, rounded to FP32
    then BF16. Returns (bf16 rows, float64 pre-rounding FC2 values). [i0, i1) restricts
    the intermediate columns (a TP slice)."""
    i = CFG.intermediate
    i1 = i if i1 is None else i1
    x = dequantize_mxfp8(*quantize_mxfp8(latent)).double().numpy()
    w13_all, w2_all = dequantized(w)
    rows, exact = [], []
    for t in range(ids.shape[0]):
        for k in range(CFG.top_k):
            e = int(ids[t, k])
            w13, w2 = w13_all[e], w2_all[e]
            gate = (w13[i0:i1] @ x[t]).astype(np.float32)
            up = (w13[i + i0:i + i1] @ x[t]).astype(np.float32)
            a = situ_numpy_fp32(torch.from_numpy(gate), torch.from_numpy(up))
            a = dequantize_mxfp8(*quantize_mxfp8(torch.from_numpy(a)[None]))[0].double().numpy()
            y = w2[:, i0:i1] @ a
            exact.append(y)
            rows.append(torch.from_numpy(y.astype(np.float32)).to(torch.bfloat16))
    return torch.stack(rows), np.stack(exact)


def test_matches_pair_loop(request, weights):
    latent, ids = make_inputs(request)
    got = expert_rows(latent, ids, weights, CFG)
    want, _ = pair_loop(latent, ids, weights)
    assert got.dtype == torch.bfloat16 and got.shape == (5 * 16, CFG.latent)
    assert torch.equal(got, want)
    codes, scales = quantize_mxfp8(latent)
    assert torch.equal(expert_rows_mxfp8(codes, scales, ids.long(), weights, CFG), got)


def test_routed_experts_is_finalize_of_rows(request, weights):
    latent, ids = make_inputs(request)
    w = torch.softmax(torch.randn(5, 16), -1)
    assert torch.equal(routed_experts(latent, w, ids, weights, CFG),
                       finalize(expert_rows(latent, ids, weights, CFG), w))


def test_gate_up_order_matters(request, weights):
    latent, ids = make_inputs(request)
    i = CFG.intermediate
    swapped = dataclasses.replace(
        weights,
        w13=torch.cat([weights.w13[:, i:], weights.w13[:, :i]], dim=1),
        w13_scales=torch.cat([weights.w13_scales[:, i:], weights.w13_scales[:, :i]], dim=1))
    a = expert_rows(latent, ids, weights, CFG)
    b = expert_rows(latent, ids, swapped, CFG)
    assert (a != b).float().mean().item() > 0.5


def test_shards_sum_to_the_unsharded_value(request, weights):
    """Each rank's partial is exact_r rounded to FP32 then BF16, so
    |sum_r p_r - y| <= (2^-8 + 2^-24 + 2^-32) * sum_r |exact_r|, with y = sum_r exact_r the
    unsharded FC2 value before rounding (FC1, SiTU and the MXFP8 blocks are the same on
    each slice since the slices are whole blocks of 32)."""
    latent, ids = make_inputs(request)
    ranks = 2
    _, y = pair_loop(latent, ids, weights)
    total = np.zeros_like(y)
    mag = np.zeros_like(y)
    width = CFG.intermediate // ranks
    for r in range(ranks):
        part = expert_rows(latent, ids, weights, CFG, shard=(r, ranks))
        want, exact_r = pair_loop(latent, ids, weights, r * width, (r + 1) * width)
        assert torch.equal(part, want)
        total += part.double().numpy()
        mag += np.abs(exact_r)
    bound = (2.0**-8 + 2.0**-24 + 2.0**-32) * mag
    assert np.all(np.abs(total - y) <= bound)
    assert np.any(total != y)  # the partial roundings are visible


def test_shard_rows_and_errors(request, weights):
    rows, cols = shard_rows(CFG, (1, 2))
    assert rows == list(range(32, 64)) + list(range(96, 128)) and cols == slice(32, 64)
    latent, ids = make_inputs(request)
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
