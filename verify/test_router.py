"""Contracts of the router (DESIGN §2, §4.4): top-16 ids and renormalized weights.

* ``fast``: the CuTe DSL router equals ``reference.emulation.route`` (its own sigmoid, bit
  for bit) and routes like ``reference.router.route`` wherever the competing scores are
  farther apart than the sigmoid's error; flips inside it are counted.
* ``stock``: ``torch.topk`` routing, and ``reference-cuda`` (the reference router on CUDA
  tensors, PyTorch's CUDA sigmoid): ids accepted within the score bound, weights within
  the derived weight bound on its own ids.
"""

from __future__ import annotations

import pytest
import torch

from reference import emulation, router
from verify import cases, tolerances
from verify.routing import biased_score_bound, compare_routing, routing_weights_bound

IDS = ("token", "k")


def _logits(config_name: str, tokens: int, seed: int, device: str):
    cfg = cases.config(config_name)
    w = cases.weights(config_name, "cpu")
    x = cases.hidden_rows(cfg, tokens, seed)
    logits = router.router_logits(x, w.gate)
    return cfg, w, logits.to(device), w.bias.to(device)


def _tied_logits(tokens: int, experts: int, seed: int, device: str):
    """Logits where groups of 4 experts share a value exactly: ties must go to the lower
    expert id (the reference rule; the fast kernel must match it bit for bit)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(tokens, experts // 4, generator=g)
    return base.repeat_interleave(4, dim=1).contiguous().to(device)


def _run(backend, logits, bias, cfg):
    kwargs = dict(top_k=cfg.top_k, renormalize=cfg.renormalize,
                  scale=cfg.routed_scaling_factor)
    if backend.name == "fast":
        from fast import router as fast_router

        return fast_router.route(logits, bias, **kwargs)
    if backend.name == "stock":
        from fast import stock

        return stock.route(logits, bias, **kwargs)
    return router.route(logits, bias, **kwargs)


def _check_against_reference(backend, cfg, logits, bias, contract):
    weights, ids = _run(backend, logits, bias, cfg)
    logits, bias = logits.cpu(), bias.cpu()
    ref_w, ref_ids = router.route(logits, bias, top_k=cfg.top_k, renormalize=cfg.renormalize,
                                  scale=cfg.routed_scaling_factor)
    if backend.name == "fast":
        emu_w, emu_ids = emulation.route(logits, bias, top_k=cfg.top_k,
                                         renormalize=cfg.renormalize,
                                         scale=cfg.routed_scaling_factor)
        contract.bitwise(ids.cpu(), emu_ids, what="router ids vs the kernel's emulation",
                         index_names=IDS)
        contract.bitwise(weights.cpu(), emu_w, what="router weights vs emulation",
                         index_names=IDS)
    sigma = torch.sigmoid(logits.double())
    exact = sigma + bias.double()
    bound = biased_score_bound(torch.zeros_like(exact), bias,
                               sigmoid_abs_error=tolerances.SIGMOID_ABS_ERROR)
    contract.routing(compare_routing(ids.cpu(), ref_ids, exact, bound,
                                     what=f"{backend.name} router ids"))
    own = ids.cpu().long()
    sel = sigma.gather(1, own)
    exact_w = sel / sel.sum(1, keepdim=True) if cfg.renormalize else sel
    exact_w = exact_w * cfg.routed_scaling_factor
    w_bound = routing_weights_bound(sel, torch.tensor(tolerances.SIGMOID_ABS_ERROR),
                                    renormalize=cfg.renormalize,
                                    scale=cfg.routed_scaling_factor)
    contract.bounded(weights.cpu(), exact_w, w_bound, what="router weights on own ids",
                     bound_name="sigmoid error + renormalization roundings",
                     index_names=IDS)


@pytest.mark.backends("reference", "reference-cuda", "stock", "fast")
@pytest.mark.parametrize("tokens", cases.ALL_BATCHES)
def test_route(backend, tokens, seed, contract):
    cfg, _, logits, bias = _logits("small", tokens, seed, backend.device)
    _check_against_reference(backend, cfg, logits, bias, contract)


@pytest.mark.backends("reference", "reference-cuda", "stock", "fast")
@pytest.mark.parametrize("tokens", (1, 7, 64, 256))
def test_route_ties(backend, tokens, seed, contract):
    cfg = cases.config("small")
    logits = _tied_logits(tokens, cfg.experts, seed, backend.device)
    bias = torch.zeros(cfg.experts, dtype=torch.float32, device=backend.device)
    _check_against_reference(backend, cfg, logits, bias, contract)


@pytest.mark.backends("fast")
@pytest.mark.parametrize("tokens", (1, 16, 64, 256, 1024))
def test_route_real_width(backend, tokens, seed, contract):
    """896 experts: the real router width, logits at the real spread."""
    cfg = cases.config("kimi_k3")
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(tokens, cfg.experts, generator=g) * 2.0).to(backend.device)
    bias = (torch.randn(cfg.experts, generator=g) * 0.05).to(backend.device)
    _check_against_reference(backend, cfg, logits, bias, contract)
