"""reference.router, the pieces: the tie rule, the bias's role, the FP32 logits, bad input.

The contract (ids and weights bit for bit against the oracle, ``verify.oracles.stages.route``,
and the flips and weight bounds of every backend) is ``verify/test_router.py``."""

from __future__ import annotations

import pytest
import torch

from reference.gemm import matmul
from reference.router import route, router_logits
from verify import bounds


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


def test_router_logits_is_the_fp32_gemm(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 64, generator=g).bfloat16()
    gate = torch.randn(32, 64, generator=g).bfloat16()
    got = router_logits(x, gate)
    assert got.dtype == torch.float32
    assert torch.equal(got, matmul(x, gate, out_dtype=torch.float32))
    # and within one FP32 rounding plus the float64 accumulation of the exact value
    # (verify.bounds: the FP32-out bound of any accumulation order covers it)
    ref = bounds.reference_matmul(x, gate)
    assert torch.all((got.double() - ref).abs() <= bounds.matmul_fp32_out_bound(x, gate))


def test_errors():
    with pytest.raises(ValueError, match="logits must be a float32"):
        route(torch.zeros(2, 32, dtype=torch.float64), torch.zeros(32))
    with pytest.raises(ValueError, match=r"bias must be a float32 \[32\]"):
        route(torch.zeros(2, 32), torch.zeros(31))
    with pytest.raises(ValueError, match=r"top_k must be an int in \[1, E=32\]"):
        route(torch.zeros(2, 32), torch.zeros(32), top_k=33)
    with pytest.raises(ValueError, match="logits must be finite"):
        route(torch.full((1, 32), float("nan")), torch.zeros(32))
    some = torch.zeros(5, 32)
    some[3, 7], some[1, 0] = float("inf"), float("nan")
    with pytest.raises(ValueError, match=r"not finite in token rows \[1, 3\] of 5"):
        route(some, torch.zeros(32))
    with pytest.raises(ValueError, match="x must be a bfloat16"):
        router_logits(torch.zeros(2, 32), torch.zeros(4, 32, dtype=torch.bfloat16))
