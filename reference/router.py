"""The router: FP32 logits and the sigmoid top-k with a selection-only bias.

Stages and rounding points:

1. `router_logits`: `x @ gate.T` with FP32 output (`reference.gemm.matmul`: exact sum,
   one RNE rounding to FP32).
2. `route`:
   * `s = torch.sigmoid(logits)` in FP32 (torch's FP32 sigmoid: one evaluation, not
     guaranteed correctly rounded; the same function on a device gives the same bits);
   * `biased = s + bias` in FP32 (one RNE add) — used for the selection only;
   * ids: the `top_k` largest `biased` values in descending order; equal values are
     ordered by the LOWER expert id first (a stable descending sort over ids 0..E-1,
     so the order is fully determined);
   * weights `w = s[ids]` (unbiased); if `renormalize`: `total = w[0] + w[1] + ...`
     summed in FP32 left to right (k = 0, 1, ..., one RNE per add), `w = w / total`
     (one RNE division per weight); then `w = w * scale` (one RNE multiply by the FP32
     value of `scale`; exact for scale 1.0).
"""

from __future__ import annotations

import torch

from reference.gemm import matmul

__all__ = ["router_logits", "route", "select_top_k"]


def router_logits(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Router logits `x @ gate.T`, FP32 out.

    Args:
        x: [T, H] bfloat16 hidden rows.
        gate: [E, H] bfloat16 router weight.

    Returns:
        [T, E] float32: the exact dot products rounded once (RNE) to FP32.
    """
    for name, t, dims in (("x", x, "[T, H]"), ("gate", gate, "[E, H]")):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype != torch.bfloat16:
            raise ValueError(f"router_logits: {name} must be a bfloat16 {dims} tensor, got "
                             f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")
    return matmul(x, gate, out_dtype=torch.float32)


def route(
    logits: torch.Tensor,
    bias: torch.Tensor,
    *,
    top_k: int = 16,
    renormalize: bool = True,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid top-k routing (one group), as the module docstring states op by op.

    Args:
        logits: [T, E] float32, finite.
        bias: [E] float32 `e_score_correction_bias` (changes the selection, not weights).
        top_k: experts per token, 1 <= top_k <= E.
        renormalize: divide the selected weights by their FP32 sum (k order from 0).
        scale: `routed_scaling_factor`, applied last as an FP32 multiply.

    Returns:
        `(weights, ids)`: float32 [T, top_k] and int32 [T, top_k]; ids in descending
        biased score, ties to the lower expert id.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"route: logits must be a float32 [T, E] tensor, got "
                         f"{getattr(logits, 'dtype', type(logits))} {tuple(getattr(logits, 'shape', ()))}")
    e = logits.shape[1]
    if (not isinstance(bias, torch.Tensor) or bias.dtype != torch.float32
            or tuple(bias.shape) != (e,)):
        raise ValueError(f"route: bias must be a float32 [{e}] tensor, got "
                         f"{getattr(bias, 'dtype', type(bias))} {tuple(getattr(bias, 'shape', ()))}")
    if bias.device != logits.device:
        raise ValueError(f"route: bias is on {bias.device}, logits on {logits.device}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= e:
        raise ValueError(f"route: top_k must be an int in [1, E={e}], got {top_k!r}")
    finite = torch.isfinite(logits).all(dim=1)
    if not finite.all():
        bad = torch.nonzero(~finite).flatten().tolist()
        raise ValueError(f"route: logits must be finite (NaN/inf would make the selection "
                         f"undefined); not finite in token rows {bad[:8]}"
                         f"{' ...' if len(bad) > 8 else ''} of {logits.shape[0]}")
    if not torch.isfinite(bias).all():
        raise ValueError("route: bias must be finite")
    s = torch.sigmoid(logits)
    return select_top_k(s, s + bias, top_k=top_k, renormalize=renormalize, scale=scale)


def select_top_k(
    scores: torch.Tensor,
    biased: torch.Tensor,
    *,
    top_k: int,
    renormalize: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The selection and weighting steps of `route`, given the sigmoid scores.

    Args:
        scores: [T, E] float32 `s` (unbiased sigmoid of the logits, by whichever sigmoid
            the caller's kernel uses).
        biased: [T, E] float32 `s + bias` (selection key).

    Returns:
        `(weights float32 [T, top_k], ids int32 [T, top_k])`: ids by descending `biased`,
        ties to the lower id (stable sort); weights `scores[ids]`, renormalized by their
        FP32 sum in k order from 0, times `scale` (FP32).
    """
    ids = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :top_k]
    w = torch.gather(scores, 1, ids)
    if renormalize:
        total = w[:, 0].clone()
        for k in range(1, top_k):
            total = total + w[:, k]
        w = w / total[:, None]
    w = w * torch.tensor(scale, dtype=torch.float32, device=w.device)
    return w, ids.to(torch.int32)
