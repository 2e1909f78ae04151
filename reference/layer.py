"""The whole layer: the stock op order (schedule S0) and the unquantized FP64 layer.

`stock_order_trace(x, weights, config)` runs the layer's op list (`docs/design.md`) on one
stream, keeping every intermediate:

| step | value | op | rounding |
|---|---|---|---|
| 1 | `logits [T, E]` FP32 | `router_logits(x, gate)` | exact sum, one RNE to FP32 |
| 2 | `weights [T, K]` FP32, `ids [T, K]` int32 | `route(logits, bias, ...)` | see `reference.router` |
| 3 | `front [T, 2S+L]` BF16 | `matmul(x, front_w, out_dtype=bf16)` | exact sum, one RNE to BF16 |
| 4 | `shared_act [T, S]` BF16 | `situ_and_mul(front[:, :2S])` | FP32 ops, one RNE to BF16 |
| 5 | `shared [T, H]` BF16 | `matmul(shared_act, shared_down, out_dtype=bf16)` | one RNE to BF16 |
| 6 | `latent [T, L]` BF16 | `front[:, 2S:]` | none (a slice) |
| 7 | `rows [T*K, L]` BF16 | `expert_rows(latent, ids)` | see `reference.experts` |
| 8 | `routed [T, L]` BF16 | `finalize(rows, weights)` | FP32 FMA chain, one RNE to BF16 |
| 9 | `normed [T, L]` BF16 | `rms_norm(routed, latent_norm, eps)` | see `reference.norm` |
| 10 | `out [T, H]` BF16 | `addmm(shared, normed, up)` | exact `shared + sum`, one RNE to BF16 |

Every value of token t depends on row t of `x` only (each step is row-wise), so the
output is batch invariant. `stock_order` returns `stock_order_trace(...).out`.

`ideal_layer` is the same layer with no rounding at all (float64 everywhere, MXFP4
weights dequantized and taken as the model's weights, no activation quantization): the
reference for the quality figure (SQNR).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.config import LatentMoEConfig
from model.formats import dequantize_mxfp4
from model.weights import LatentMoEWeights
from reference.activation import situ_and_mul, situ_and_mul_float64
from reference.experts import expert_rows
from reference.finalize import finalize
from reference.gemm import addmm, matmul
from reference.norm import rms_norm
from reference.router import route, router_logits

__all__ = ["StockTrace", "stock_order_trace", "stock_order", "ideal_layer", "sqnr_db"]


@dataclass
class StockTrace:
    """Every intermediate of one stock-order forward (shapes/dtypes in the module table)."""

    logits: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    front: torch.Tensor
    shared_act: torch.Tensor
    shared: torch.Tensor
    latent: torch.Tensor
    rows: torch.Tensor
    routed: torch.Tensor
    normed: torch.Tensor
    out: torch.Tensor


def _check(x: torch.Tensor, weights: LatentMoEWeights, config: LatentMoEConfig, fn: str) -> None:
    if not isinstance(config, LatentMoEConfig):
        raise ValueError(f"{fn}: config must be a LatentMoEConfig")
    if not isinstance(weights, LatentMoEWeights) or weights.config != config:
        raise ValueError(f"{fn}: weights must be LatentMoEWeights built for this config")
    if (not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2
            or x.shape[1] != config.hidden):
        raise ValueError(f"{fn}: x must be a bfloat16 [T, H={config.hidden}] tensor, got "
                         f"{getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}")
    if x.device != weights.device:
        raise ValueError(f"{fn}: x on {x.device}, weights on {weights.device}")


def stock_order_trace(x: torch.Tensor, weights: LatentMoEWeights, config: LatentMoEConfig) -> StockTrace:
    """S0, the stock op order, keeping every intermediate.

    Args:
        x: [T, H] bfloat16 hidden rows.
        weights: the layer's weights.
        config: the layer config.

    Returns:
        a `StockTrace`; `.out` is the [T, H] bfloat16 layer output.
    """
    _check(x, weights, config, "stock_order_trace")
    c, w = config, weights
    s2 = 2 * c.shared_intermediate
    logits = router_logits(x, w.gate)
    topk_w, ids = route(logits, w.bias, top_k=c.top_k, renormalize=c.renormalize,
                        scale=c.routed_scaling_factor)
    front = matmul(x, w.front, out_dtype=torch.bfloat16)
    shared_act = situ_and_mul(front[:, :s2], beta=c.situ_beta, linear_beta=c.situ_linear_beta)
    shared = matmul(shared_act, w.shared_down, out_dtype=torch.bfloat16)
    latent = front[:, s2:].contiguous()
    rows = expert_rows(latent, ids, w, c)
    routed = finalize(rows, topk_w)
    normed = rms_norm(routed, w.latent_norm, c.rms_eps)
    out = addmm(shared, normed, w.up)
    return StockTrace(logits=logits, weights=topk_w, ids=ids, front=front, shared_act=shared_act,
                      shared=shared, latent=latent, rows=rows, routed=routed, normed=normed,
                      out=out)


def stock_order(x: torch.Tensor, weights: LatentMoEWeights, config: LatentMoEConfig) -> torch.Tensor:
    """S0: `stock_order_trace(x, weights, config).out`, [T, H] bfloat16."""
    return stock_order_trace(x, weights, config).out


def ideal_layer(
    x: torch.Tensor,
    weights: LatentMoEWeights,
    config: LatentMoEConfig,
    *,
    ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The unquantized layer in float64 (no rounding after reading the stored weights).

    float64 GEMMs (torch's float64 matmul; its own rounding is ~2^-53 relative, negligible
    next to the quantization this figure measures), float64 SiTU, the MXFP4 expert weights
    dequantized exactly, the latent and the SiTU output NOT quantized, float64 finalize
    and RMSNorm. Routing: top-k of `sigmoid(logits64) + bias` (ties to the lower id)
    unless `ids` is given; the weights are always the float64 sigmoid of the chosen ids,
    renormalized in float64 and scaled.

    Args:
        x: [T, H] bfloat16.
        ids: optional [T, K] int ids (e.g. the stock path's, so both use one routing).

    Returns:
        [T, H] float64.
    """
    _check(x, weights, config, "ideal_layer")
    c, w = config, weights
    d = torch.float64
    s2 = 2 * c.shared_intermediate
    xd = x.to(d)
    s = torch.sigmoid(xd @ w.gate.to(d).T)
    if ids is None:
        biased = s + w.bias.to(d)
        ids = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, : c.top_k]
    elif (not isinstance(ids, torch.Tensor) or tuple(ids.shape) != (x.shape[0], c.top_k)
          or ids.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"ideal_layer: ids must be int [T, K] = [{x.shape[0]}, {c.top_k}], got "
                         f"{getattr(ids, 'dtype', type(ids))} {tuple(getattr(ids, 'shape', ()))}")
    ids = ids.long()
    tw = torch.gather(s, 1, ids)
    if c.renormalize:
        tw = tw / tw.sum(-1, keepdim=True)
    tw = tw * c.routed_scaling_factor
    front = xd @ w.front.to(d).T
    shared = situ_and_mul_float64(front[:, :s2], beta=c.situ_beta,
                                  linear_beta=c.situ_linear_beta) @ w.shared_down.to(d).T
    latent = front[:, s2:]
    routed = torch.zeros_like(latent)
    flat = ids.reshape(-1)
    k = c.top_k
    for e in torch.unique(flat).tolist():
        pairs = torch.nonzero(flat == e).flatten()
        tok = pairs // k
        w13 = dequantize_mxfp4(w.w13[e], w.w13_scales[e]).to(d)
        w2 = dequantize_mxfp4(w.w2[e], w.w2_scales[e]).to(d)
        a = situ_and_mul_float64(latent[tok] @ w13.T, beta=c.situ_beta,
                                 linear_beta=c.situ_linear_beta)
        y = a @ w2.T
        routed.index_add_(0, tok, y * tw.reshape(-1)[pairs, None])
    normed = routed * torch.rsqrt((routed * routed).mean(-1, keepdim=True) + c.rms_eps)
    normed = normed * w.latent_norm.to(d)
    return shared + normed @ w.up.to(d).T


def sqnr_db(signal: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: `10 log10(sum s^2 / sum (s - a)^2)`."""
    s = signal.to(torch.float64)
    n = s - approx.to(torch.float64)
    return float(10 * torch.log10((s * s).sum() / (n * n).sum()))
