"""External backends for the tests of the plug-in path (``tests/test_backend_plugins.py``):
the reference's own code behind the interface, loaded like a kernel engineer's backend
(``--backend tests/plugins/reference_plugins.py:Exact``), so that every stage contract, the
whole-layer contracts and the stage-by-stage experts check run on this machine.

* :class:`Exact` claims every stage and every layer bit for bit;
* :class:`Bounded` claims only the bound where a stage allows it, and hands over the
  experts' intermediates, so the contracts' bound paths run on the CPU too.
"""

from __future__ import annotations

import torch

from model import swizzle
from reference import mx
from reference.activation import situ_and_mul, situ_and_mul_fp32
from reference.experts import shard_rows
from reference.finalize import finalize
from reference.gemm import matmul
from reference.layer import stock_order_trace
from reference.norm import rms_norm
from reference.router import route
from reference.schedules.dep import dep_layer_virtual
from reference.schedules.wide import wide_layer_virtual
from verify.interface import BITWISE, BOUND, Backend, ExpertRows, LayerOutput


class Exact(Backend):
    """The reference behind the interface, claiming every stage bit for bit."""

    name = "plugin-exact"
    version = "test 1"
    devices = ("cpu",)
    claims = {stage: BITWISE for stage in (
        "quantize_mxfp8", "quantize_mxfp8_swizzled", "route", "situ_and_mul", "finalize",
        "rms_norm", "expert_rows", "layer_stock", "layer_dep", "layer_wide")}
    layer_ranks = {"layer_stock": (1,), "layer_dep": (1, 2, 4, 8, 16), "layer_wide": (1, 2, 4, 8)}

    def quantize_mxfp8(self, x):
        return mx.quantize_mxfp8(x)

    def quantize_mxfp8_swizzled(self, x):
        codes, scales = mx.quantize_mxfp8(x)
        return codes, swizzle.swizzle_scales_128x4(scales)

    def route(self, logits, bias, *, top_k, renormalize, scale):
        return route(logits, bias, top_k=top_k, renormalize=renormalize, scale=scale)

    def situ_and_mul(self, h, *, beta, linear_beta):
        return situ_and_mul(h, beta=beta, linear_beta=linear_beta)

    def finalize(self, rows, weights):
        return finalize(rows, weights)

    def rms_norm(self, x, weight, eps):
        return rms_norm(x, weight, eps)

    def expert_rows(self, codes, scales, ids, weights, *, experts, shard, intermediates):
        """The pair loop of ``reference.experts``, keeping its intermediates."""
        cfg = weights.config
        first, count = experts
        k, inter = cfg.top_k, cfg.intermediate // shard[1]
        flat = ids.reshape(-1).long()
        p = flat.numel()
        rows = torch.full((p, cfg.latent), float("nan"), dtype=torch.bfloat16)
        fc1 = torch.full((p, 2 * inter), float("nan"))
        hidden_codes = torch.full((p, inter), 0xFF, dtype=torch.uint8)
        hidden_scales = torch.full((p, inter // 32), 0xFF, dtype=torch.uint8)
        x = mx.dequantize_mxfp8(codes, scales)
        w13_rows, w2_cols = shard_rows(cfg, shard)
        for e in torch.unique(flat).tolist():
            if not first <= e < first + count:
                continue
            pairs = torch.nonzero(flat == e).flatten()
            w13, w2 = weights.expert_fp32(e)
            h = matmul(x[pairs // k], w13[torch.tensor(w13_rows)], out_dtype=torch.float32)
            c, s = mx.quantize_mxfp8(situ_and_mul_fp32(h, beta=cfg.situ_beta,
                                                       linear_beta=cfg.situ_linear_beta))
            y = matmul(mx.dequantize_mxfp8(c, s), w2[:, w2_cols].contiguous(),
                       out_dtype=torch.float32)
            rows[pairs] = y.to(torch.bfloat16)
            fc1[pairs], hidden_codes[pairs], hidden_scales[pairs] = h, c.view(torch.uint8), s
        if not intermediates:
            return ExpertRows(rows)
        return ExpertRows(rows, fc1, hidden_codes, hidden_scales)

    def layer(self, schedule, xs, weights):
        cfg = weights.config
        if schedule == "stock":
            traces = [stock_order_trace(xs[0], weights, cfg)]
        elif schedule == "dep":
            traces = dep_layer_virtual(xs, weights, cfg)
        else:
            traces = wide_layer_virtual(xs[0], weights, len(xs), cfg)
        return [LayerOutput(t.out, t.ids) for t in traces]


class Bounded(Exact):
    """The same code, claiming only the bound wherever a stage allows it."""

    name = "plugin-bounded"
    claims = {stage: BOUND for stage in (
        "route", "situ_and_mul", "finalize", "rms_norm", "expert_rows", "layer_stock",
        "layer_dep", "layer_wide")} | {"quantize_mxfp8": BITWISE}
