"""Discrete decisions: a top-k routing that differs from the reference is
accepted only where the competing scores lie within their error bounds.

The scores are the biased selection scores ``s_e = sigmoid(logit_e) + bias_e``. Given the
exact scores (float64, from the exact logits) and a per-score bound ``b_e`` on how far any
correctly implemented FP32 evaluation may land from them, a candidate's ``ids[t]`` (k
experts in descending order) is *explainable* iff some set of scores inside the bounds
ranks the experts exactly so:

* every selected expert could beat every unselected one:
  ``min_sel (s_c + b_c) >= max_unsel (s_o - b_o)``;
* consecutive selected experts could be in the candidate's order:
  ``s_{c_i} + b_{c_i} >= s_{c_{i+1}} - b_{c_{i+1}}``.

(The two conditions are pairwise necessary; for a total order of intervals they are also
sufficient, by taking each score at the end of its interval that favours the candidate.)

A *flip* is a token whose ids differ from the reference's ids (as a set or in order) while
the candidate stays explainable; an unexplained difference fails the contract.
"""

from __future__ import annotations

import dataclasses

import torch

from verify import bounds
from verify.compare import ContractError

FP32_U = bounds.unit_roundoff(torch.float32)


def biased_score_bound(logits_bound: torch.Tensor, bias: torch.Tensor, *,
                       sigmoid_abs_error: float) -> torch.Tensor:
    """Bound on ``|fl(fl(sigmoid(l)) + bias) - (sigmoid(l_exact) + bias)|`` (float64 [T,E]).

    * the logit's own error ``|l - l_exact| <= logits_bound`` moves the sigmoid by at most
      ``logits_bound / 4`` (the sigmoid's slope is at most 1/4);
    * the sigmoid's evaluation error ``sigmoid_abs_error`` (absolute, from the function's
      documented ULP error: the caller states it);
    * the FP32 addition of the bias: one rounding, ``u32 * (1 + |bias|)`` since the sum is
      at most ``1 + |bias|`` in magnitude.
    """
    lb = logits_bound.to(torch.float64)
    return lb / 4 + sigmoid_abs_error + FP32_U * (1.0 + bias.to(torch.float64).abs())


@dataclasses.dataclass
class RoutingComparison:
    """Result of :func:`compare_routing`; ``check()`` raises on an unexplained token."""

    what: str
    decisions: int
    flips: int
    unexplained: list[dict]

    def check(self) -> None:
        if self.unexplained:
            first = self.unexplained[:4]
            lines = [
                f"{self.what}: {len(self.unexplained)} of {self.decisions} tokens route "
                "outside the scores' error bound"
            ] + [f"  {u}" for u in first]
            raise ContractError("\n".join(lines), {"what": self.what,
                                                   "unexplained": self.unexplained[:16]})


def compare_routing(ids: torch.Tensor, reference_ids: torch.Tensor,
                    exact_scores: torch.Tensor, score_bound: torch.Tensor, *,
                    what: str) -> RoutingComparison:
    """Compare a candidate's ``ids`` [T,k] with ``reference_ids`` [T,k] given the exact
    biased scores [T,E] (float64) and their bounds [T,E] (float64)."""
    if ids.shape != reference_ids.shape:
        raise ValueError(f"{what}: ids {tuple(ids.shape)} vs reference "
                         f"{tuple(reference_ids.shape)}")
    ids = ids.to("cpu", torch.int64)
    reference_ids = reference_ids.to("cpu", torch.int64)
    s = exact_scores.to("cpu", torch.float64)
    b = score_bound.to("cpu", torch.float64).expand_as(s)
    tokens, experts = s.shape
    if ids.min() < 0 or ids.max() >= experts:
        raise ContractError(f"{what}: expert id outside [0, {experts})",
                            {"what": what, "min": int(ids.min()), "max": int(ids.max())})
    differs = (ids != reference_ids).any(dim=1)
    hi = (s + b).gather(1, ids)  # the most each selected score could be
    lo = (s - b).gather(1, ids)  # the least
    selected = torch.zeros_like(s, dtype=torch.bool).scatter_(1, ids, True)
    duplicate = selected.sum(1) != ids.shape[1]
    unselected_max = torch.where(selected, torch.full_like(s, -torch.inf), s - b).amax(1)
    beats_rest = hi.amin(1) >= unselected_max
    in_order = (hi[:, :-1] >= lo[:, 1:]).all(1)
    bad = duplicate | ~beats_rest | ~in_order
    unexplained = []
    for t in torch.nonzero(bad).flatten().tolist():
        unexplained.append({
            "token": t,
            "ids": ids[t].tolist(),
            "reference_ids": reference_ids[t].tolist(),
            "duplicate_ids": bool(duplicate[t]),
            "weakest_selected_upper": float(hi[t].min()),
            "strongest_unselected_lower": float(unselected_max[t]),
            "order_ok": bool(in_order[t]),
        })
    return RoutingComparison(what, tokens, int((differs & ~bad).sum()), unexplained)


def routing_weights_bound(exact_selected: torch.Tensor, sigma_bound: torch.Tensor, *,
                          renormalize: bool, scale: float) -> torch.Tensor:
    """Bound on a routing weight ``w_k = scale * sigma_k / sum_j sigma_j`` computed in FP32
    (sum sequential over k, one division, one multiply) from sigmoids each within
    ``sigma_bound`` of the exact ``exact_selected`` [T,k] (float64).

    First order: ``|dw_k| <= scale * (|d sigma_k| + w_k * sum_j |d sigma_j|) / S`` with
    ``S = sum_j sigma_j``, plus the FP32 roundings: the k-term sum (``gamma(k-1)``
    relative), the division and the scaling (one ``u`` each), all relative to ``w_k``.
    Without renormalization only the sigmoid error and the scaling remain.
    """
    e = exact_selected.to(torch.float64)
    d = sigma_bound.to(torch.float64).expand_as(e)
    if not renormalize:
        return scale * d + FP32_U * scale * (e + d)
    k = e.shape[-1]
    total = e.sum(-1, keepdim=True)
    w = e / total
    first = (d + w * d.sum(-1, keepdim=True)) / (total - d.sum(-1, keepdim=True))
    rounding = (bounds.gamma(k - 1, FP32_U) + 2 * FP32_U) * (w + first)
    return scale * (first + rounding) * (1 + 2 * FP32_U)
