"""reference.router against a plain-Python routing written here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from reference.gemm import matmul
from reference.router import route, router_logits
from test_fp import seed_of


def route_python(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool,
                 scale: float):
    """Independent: numpy FP32 ops, selection by sorting (-score, id) keys."""
    s = torch.sigmoid(logits).numpy()  # the same FP32 sigmoid function (see route's docs)
    b = bias.numpy()
    weights, ids = [], []
    for row in s:
        biased = (row + b).astype(np.float32)
        order = sorted(range(len(row)), key=lambda e: (-float(biased[e]), e))[:top_k]
        w = np.array([row[e] for e in order], dtype=np.float32)
        if renormalize:
            total = np.float32(0)
            for v in w:
                total = np.float32(total + v)
            w = (w / total).astype(np.float32)
        w = (w * np.float32(scale)).astype(np.float32)
        weights.append(w)
        ids.append(order)
    return torch.from_numpy(np.stack(weights)), torch.tensor(ids, dtype=torch.int32)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_route_matches_python(request, renormalize, scale):
    g = torch.Generator().manual_seed(seed_of(request.node.nodeid))
    logits = torch.randn(12, 64, generator=g) * 2
    bias = torch.randn(64, generator=g) * 0.05
    w, ids = route(logits, bias, top_k=16, renormalize=renormalize, scale=scale)
    ww, wi = route_python(logits, bias, 16, renormalize, scale)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids, wi) and torch.equal(w, ww)
    if renormalize:
        # sums to scale within the FP32 rounding of 16 divisions and a 15-add sum:
        # |sum - scale| <= (16 + 15) * 2^-24 * scale (first order).
        assert torch.all((w.double().sum(-1) - scale).abs() <= 31 * 2.0**-24 * scale)


def test_ties_go_to_the_lower_id():
    # every score equal: the selection is ids 0..15 in order
    w, ids = route(torch.zeros(2, 32), torch.zeros(32), top_k=16)
    assert ids.tolist() == [list(range(16))] * 2
    assert torch.equal(w, torch.full((2, 16), 1 / 16))
    # a tie between experts 20 and 5 at the cut: 5 wins, and it comes before 20
    logits = torch.full((1, 32), -5.0)
    logits[0, :15] = torch.linspace(5, 3, 15)
    logits[0, 20] = 1.0
    logits[0, 15] = 1.0
    _, ids = route(logits, torch.zeros(32), top_k=16)
    assert ids[0, 15].item() == 15
    logits[0, 15] = -5.0
    logits[0, 5] = 1.0
    logits[0, 25] = 1.0
    _, ids = route(logits, torch.zeros(32), top_k=16)
    assert ids[0, -2:].tolist() == [5, 20] and 25 not in ids[0].tolist()


def test_bias_changes_the_selection_not_the_weights():
    logits = torch.linspace(3, -3, 32)[None]
    bias = torch.zeros(32)
    _, ids0 = route(logits, bias, top_k=16, renormalize=False)
    assert 31 not in ids0[0].tolist()
    bias[31] = 10.0  # the lowest logit becomes the first choice
    w, ids = route(logits, bias, top_k=16, renormalize=False)
    assert ids[0, 0].item() == 31
    assert w[0, 0].item() == torch.sigmoid(logits[0, 31]).item()  # the unbiased score
    assert torch.equal(w[0, 1:], torch.sigmoid(logits[0, :15]))


def test_router_logits_is_the_fp32_gemm(request):
    g = torch.Generator().manual_seed(seed_of(request.node.nodeid))
    x = torch.randn(3, 64, generator=g).bfloat16()
    gate = torch.randn(32, 64, generator=g).bfloat16()
    got = router_logits(x, gate)
    assert got.dtype == torch.float32
    assert torch.equal(got, matmul(x, gate, out_dtype=torch.float32))
    # and close to the FP64 value: one FP32 rounding plus the float64 accumulation
    ref = x.double() @ gate.double().T
    bound = 2.0**-24 * ref.abs() + 64 * 2.0**-53 * (x.double().abs() @ gate.double().abs().T)
    assert torch.all((got.double() - ref).abs() <= bound)


def test_errors():
    with pytest.raises(ValueError, match="logits must be a float32"):
        route(torch.zeros(2, 32, dtype=torch.float64), torch.zeros(32))
    with pytest.raises(ValueError, match=r"bias must be a float32 \[32\]"):
        route(torch.zeros(2, 32), torch.zeros(31))
    with pytest.raises(ValueError, match=r"top_k must be an int in \[1, E=32\]"):
        route(torch.zeros(2, 32), torch.zeros(32), top_k=33)
    with pytest.raises(ValueError, match="logits must be finite"):
        route(torch.full((1, 32), float("nan")), torch.zeros(32))
    with pytest.raises(ValueError, match="x must be a bfloat16"):
        router_logits(torch.zeros(2, 32), torch.zeros(4, 32, dtype=torch.bfloat16))
