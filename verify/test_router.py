"""Contracts of the router: top-k ids (descending biased score, ties to the lower expert id)
and renormalized weights (the unbiased scores of the chosen ids over their FP32 sum in k
order, times the scale).

By the backend's claim for the ``route`` stage:

* bitwise (``reference``): ids and weights bit-identical to the oracle
  :func:`verify.oracles.stages.route` (numpy FP32 arithmetic, ``lexsort`` on
  ``(-score, id)``, torch's FP32 sigmoid);
* own order (``fast``): bit-identical to the backend's emulation
  (``reference.emulation.route``) and to the same oracle fed with the backend's sigmoid
  (the kernels' ``sigmoid_rn``), so the emulation is checked too;
* every backend, whatever its claim (``stock`` = ``torch.topk``, ``reference-cuda`` with
  CUDA's sigmoid, external ones): ids that differ from the reference's are accepted only
  where the competing biased scores lie within the sigmoid's error (flips counted,
  ``verify.routing``), weights within the derived weight bound on the backend's own ids.
  The sigmoid's error is the libraries' (``verify.tolerances.SIGMOID_ABS_ERROR``) unless
  the claim states the backend's own (``fast``: ``SIGMOID_RN_ABS_ERROR``, derived from
  the measured accuracy of ``exp_rn``).

Configs: ``small`` routes the logits of its gate weights on hidden rows; ``kimi_k3``
random logits at the real width (``experts`` 896) and spread.
"""

from __future__ import annotations

import pytest
import torch

from reference import router
from verify import cases, tolerances
from verify.oracles import stages as oracle
from verify.routing import biased_score_bound, compare_routing, routing_weights_bound

IDS = ("token", "k")


def _logits(config_name: str, tokens: int, seed: int, device: str):
    cfg = cases.config(config_name)
    if config_name == "kimi_k3":
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(tokens, cfg.experts, generator=g) * 2.0
        bias = torch.randn(cfg.experts, generator=g) * 0.05
        return cfg, logits.to(device), bias.to(device)
    w = cases.weights(config_name, "cpu")
    x = cases.hidden_rows(cfg, tokens, seed)
    return cfg, router.router_logits(x, w.gate).to(device), w.bias.to(device)


def _tied_logits(tokens: int, experts: int, seed: int, device: str):
    """Logits where groups of 4 experts share a value exactly: ties must go to the lower
    expert id (the reference rule; the fast kernel must match it bit for bit)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(tokens, experts // 4, generator=g)
    return base.repeat_interleave(4, dim=1).contiguous().to(device)


def _check(backend, cfg, logits, bias, contract):
    claim = backend.claim("route")
    kwargs = dict(top_k=cfg.top_k, renormalize=cfg.renormalize,
                  scale=cfg.routed_scaling_factor)
    weights, ids = backend.route(logits, bias, **kwargs)
    weights, ids = weights.cpu(), ids.cpu()
    logits, bias = logits.cpu(), bias.cpu()
    ref_w, ref_ids = router.route(logits, bias, **kwargs)
    sigmoid_error = claim.sigmoid_abs_error or tolerances.SIGMOID_ABS_ERROR
    if claim.exact:
        want_w, want_ids = oracle.route(logits, bias, **kwargs)
        contract.bitwise(ids, want_ids, what=f"{backend.name} router ids vs oracle",
                         index_names=IDS)
        contract.bitwise(weights, want_w, what=f"{backend.name} router weights vs oracle",
                         index_names=IDS)
    if claim.emulation:
        emu_w, emu_ids = claim.emulation(logits, bias, **kwargs)
        contract.bitwise(ids, emu_ids, what="router ids vs the backend's emulation",
                         index_names=IDS)
        contract.bitwise(weights, emu_w, what="router weights vs emulation", index_names=IDS)
    if claim.sigmoid:
        own_w, own_ids = oracle.route(logits, bias, **kwargs, sigmoid=claim.sigmoid)
        contract.bitwise(ids, own_ids, what="router ids vs oracle with the backend's sigmoid",
                         index_names=IDS)
        contract.bitwise(weights, own_w,
                         what="router weights vs oracle with the backend's sigmoid",
                         index_names=IDS)
    sigma = torch.sigmoid(logits.double())
    exact = sigma + bias.double()
    bound = biased_score_bound(torch.zeros_like(exact), bias, sigmoid_abs_error=sigmoid_error)
    contract.routing(compare_routing(ids, ref_ids, exact, bound,
                                     what=f"{backend.name} router ids"))
    own = ids.long()
    sel = sigma.gather(1, own)
    exact_w = sel / sel.sum(1, keepdim=True) if cfg.renormalize else sel
    exact_w = exact_w * cfg.routed_scaling_factor
    w_bound = routing_weights_bound(sel, torch.tensor(sigmoid_error),
                                    renormalize=cfg.renormalize,
                                    scale=cfg.routed_scaling_factor)
    contract.bounded(weights, exact_w, w_bound, what="router weights on own ids",
                     bound_name="sigmoid error + renormalization roundings", index_names=IDS)


@pytest.mark.backends("reference", "reference-cuda", "stock", "fast", external=True)
@pytest.mark.parametrize("config_name", cases.STAGE_CONFIGS)
@pytest.mark.parametrize("tokens", cases.ALL_BATCHES)
def test_route(backend, config_name, tokens, seed, contract):
    cfg, logits, bias = _logits(config_name, tokens, seed, backend.device)
    _check(backend, cfg, logits, bias, contract)


@pytest.mark.backends("reference", "reference-cuda", "stock", "fast", external=True)
@pytest.mark.parametrize("config_name", cases.STAGE_CONFIGS)
@pytest.mark.parametrize("tokens", (1, 7, 64, 256))
def test_route_ties(backend, config_name, tokens, seed, contract):
    cfg = cases.config(config_name)
    logits = _tied_logits(tokens, cfg.experts, seed, backend.device)
    bias = torch.zeros(cfg.experts, dtype=torch.float32, device=backend.device)
    _check(backend, cfg, logits, bias, contract)
