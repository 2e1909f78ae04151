"""The whole-layer contract of a backend that runs the layer in a schedule (the stages
``layer_stock``, ``layer_dep``, ``layer_wide`` of ``verify.interface``), shared by
``verify/test_stock.py``, ``verify/test_dep.py`` and ``verify/test_wide.py``.

A backend that runs the whole layer hands back each rank's output and routing only, so
the contract is what can be derived at that boundary:

* bitwise: every rank's ids and output bit-identical to the reference's emulation of the
  same schedule at the same rank count (``reference.layer.stock_order_trace``,
  ``reference.schedules.dep.dep_layer_virtual``,
  ``reference.schedules.wide.wide_layer_virtual``, with their default tactics), which
  ``verify/test_dep.py`` and ``verify/test_wide.py`` check stage by stage;
* bound: a layer that reorders sums cannot keep the MXFP8 codes of its latent or of its
  experts' activations, so no elementwise bound on its output follows from its inputs.
  What does: its routing may differ from S0's only where the competing biased scores lie
  within the router logits' FP32-accumulation bound and the sigmoid's error (flips
  counted, ``verify.routing``), and each token's output, against the unquantized float64
  layer on the backend's own routing (``reference.layer.ideal_layer``), keeps the
  quantization floor ``verify.tolerances.LAYER_SQNR_FLOOR_DB``. A backend whose stages can
  be called one by one is checked far more tightly by the stage contracts.
"""

from __future__ import annotations

import torch

from model.weights import LatentMoEWeights
from reference.layer import ideal_layer, stock_order_trace
from reference.router import route, router_logits
from reference.schedules.dep import dep_layer_virtual
from reference.schedules.wide import wide_layer_virtual
from verify import bounds, cases, tolerances
from verify.routing import biased_score_bound, compare_routing

ROWS = ("token", "column")


def layer_inputs(schedule: str, ranks: int, tokens: int, seed: int) -> list[torch.Tensor]:
    """One BF16 ``[tokens, H]`` batch per rank (CPU): the DEP ranks' own tokens differ,
    the wide ranks all hold one batch, S0 has one rank."""
    cfg = cases.config("small")
    if schedule == "dep":
        return cases.rank_rows(cfg, ranks, tokens, seed)
    return [cases.hidden_rows(cfg, tokens, seed)] * ranks


def reference_layer(schedule: str, xs: list[torch.Tensor], w: LatentMoEWeights):
    """The reference emulation's per-rank traces (``.out``, ``.ids``) of ``schedule``."""
    if schedule == "stock":
        return [stock_order_trace(xs[0], w, w.config)]
    if schedule == "dep":
        return dep_layer_virtual(xs, w, w.config)
    return wide_layer_virtual(xs[0], w, len(xs), w.config)


def token_sqnr_db(ideal: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """float64 ``[T]``: each token's ``10 log10(sum ideal^2 / sum (ideal - out)^2)``."""
    signal = (ideal.double() ** 2).sum(-1)
    noise = ((ideal.double() - out.double()) ** 2).sum(-1)
    return 10 * torch.log10(signal / noise.clamp_min(torch.finfo(torch.float64).tiny))


def check_layer(contract, backend, schedule: str, ranks: int, tokens: int, seed: int) -> None:
    """The contract above for one case (config ``small``)."""
    claim = backend.layer_claim(schedule, ranks)
    w = cases.weights("small")
    cfg = w.config
    xs = layer_inputs(schedule, ranks, tokens, seed)
    dev = backend.device
    got = backend.layer(schedule, [x.to(dev) for x in xs], cases.weights("small", dev))
    what = f"{backend.name} {schedule} layer, {ranks} ranks"
    if claim.exact:
        for r, (mine, want) in enumerate(zip(got, reference_layer(schedule, xs, w))):
            contract.bitwise(mine.ids.cpu(), want.ids, what=f"{what}: rank {r} ids")
            contract.bitwise(mine.out.cpu(), want.out, what=f"{what}: rank {r} output",
                             index_names=ROWS)
        return
    sigmoid_error = claim.sigmoid_abs_error or tolerances.SIGMOID_ABS_ERROR
    floor = tolerances.LAYER_SQNR_FLOOR_DB
    for r, (mine, x) in enumerate(zip(got, xs)):
        ids, out = mine.ids.cpu(), mine.out.cpu()
        _, s0_ids = route(router_logits(x, w.gate), w.bias, top_k=cfg.top_k,
                          renormalize=cfg.renormalize, scale=cfg.routed_scaling_factor)
        exact_logits = bounds.reference_matmul(x, w.gate)
        logits_bound = bounds.matmul_fp32_out_bound(
            x, w.gate, accum_rounding=bounds.gemm_accum_rounding(dev))
        score_bound = biased_score_bound(logits_bound, w.bias,
                                         sigmoid_abs_error=sigmoid_error)
        contract.routing(compare_routing(ids, s0_ids,
                                         torch.sigmoid(exact_logits) + w.bias.double(),
                                         score_bound, what=f"{what}: rank {r} ids vs S0"))
        db = token_sqnr_db(ideal_layer(x, w, cfg, ids=ids), out)
        contract.figure("token_sqnr_db_min", float(db.min()), worst="min")
        low = torch.nonzero(db < floor).flatten()
        assert not low.numel(), (
            f"{what}: rank {r} token {int(low[0])} has SQNR {float(db[low[0]]):.2f} dB "
            f"against the unquantized layer on its own routing, below the floor "
            f"{floor:.2f} dB ({low.numel()} of {tokens} tokens)")
