"""The dense part of a DEP rank on a GPU (``T <= front_max`` tokens): the router, the packed
front, the shared expert, the MXFP8 latent and, after the routed part, the up-projection.

What runs, for one rank's BF16 tokens ``x [T, H]`` (the order of ``reference.schedules.dep``)::

    main stream                                   side stream (order="side")
    front = x @ [shared gate_up | latent down]^T  logits = x @ gate^T (FP32 out)
                                                  weights, ids = fast.router.route(logits)
    codes, scales = fast.mx.quantize_mxfp8(front[:, 2S:])
                                                  act = fast.activation.situ_and_mul(front[:, :2S])
                                                  shared = act @ shared_down^T
    ... the routed part (dispatch waits for the router) ...
    out = shared + normed @ up^T   (waits for the shared expert; cuBLAS addmm, BF16)

The GEMMs are cuBLAS (``fast.stock``); every other step is a fast kernel whose bits equal
its reference on its own inputs. ``order="serial"`` runs the side-stream steps on the
current stream; the bits are the same.
"""

from __future__ import annotations

import typing

import torch

from fast import activation, mx, router, stock
from reference.weights import LatentMoEWeights

__all__ = ["DenseFront", "DenseOutputs"]


class DenseOutputs(typing.NamedTuple):
    """One call's dense outputs for ``T`` tokens: logits FP32 ``[T, E]``; weights FP32 and
    ids int32 ``[T, K]``; front BF16 ``[T, 2S + L]``; shared BF16 ``[T, H]``; codes
    float8_e4m3fn ``[T, L]`` and scales uint8 ``[T, L/32]`` (the MXFP8 latent);
    ``shared_ready``: the side stream's event after the shared expert (None when serial)."""

    logits: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    front: torch.Tensor
    shared: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor
    shared_ready: torch.cuda.Event | None


class DenseFront:
    """The dense weights of one layer on ``device`` (BF16 gate, FP32 bias, packed front,
    shared down, latent-norm weight, up) and the side stream the router and the shared
    expert run on."""

    def __init__(self, weights: LatentMoEWeights, device: torch.device):
        self.config = c = weights.config
        self.device = device
        on = dict(device=device)
        self.gate = weights.gate.to(**on).contiguous()
        self.bias = weights.bias.to(**on).contiguous()
        self.front_w = weights.front.to(**on).contiguous()
        self.shared_down = weights.shared_down.to(**on).contiguous()
        self.latent_norm = weights.latent_norm.to(**on).contiguous()
        self.up = weights.up.to(**on).contiguous()
        self.dense_bytes = sum(t.numel() * t.element_size()
                               for t in (self.gate, self.front_w, self.shared_down, self.up))
        self._side = torch.cuda.Stream(device)
        self._s2 = 2 * c.shared_intermediate

    def __call__(self, x: torch.Tensor, *, order: str = "serial",
                 side_delay_cycles: int = 0) -> DenseOutputs:
        """The dense part before the routed part, for BF16 ``x [T, H]`` on ``device``.

        With ``order="side"`` the router and the shared expert run on the side stream; the
        current stream waits for the router before returning (the dispatch reads ids and
        weights) and for the shared expert only through ``shared_ready`` (:meth:`up_projection`
        waits on it). ``side_delay_cycles`` starts each side segment with a spin of that
        many clock cycles, so a missing wait shows as wrong data (the stream-order contract).
        """
        if order not in ("side", "serial"):
            raise ValueError(f"DenseFront: order must be 'side' or 'serial', got {order!r}")
        c = self.config
        main = torch.cuda.current_stream(self.device)
        side = self._side if order == "side" else main

        def segment():
            if side is not main:
                side.wait_stream(main)
                if side_delay_cycles:
                    torch.cuda._sleep(int(side_delay_cycles))

        segment()
        with torch.cuda.stream(side):
            logits = stock.mm_fp32_out(x, self.gate)
            weights, ids = router.route(logits, self.bias, top_k=c.top_k,
                                        renormalize=c.renormalize, scale=c.routed_scaling_factor)
        route_ready = side.record_event() if side is not main else None
        front = stock.mm_bf16(x, self.front_w)
        segment()
        with torch.cuda.stream(side):
            act = activation.situ_and_mul(front[:, :self._s2], beta=c.situ_beta,
                                          linear_beta=c.situ_linear_beta)
            shared = stock.mm_bf16(act, self.shared_down)
        shared_ready = side.record_event() if side is not main else None
        codes, scales = mx.quantize_mxfp8(front[:, self._s2:].contiguous())
        if route_ready is not None:
            main.wait_event(route_ready)
        return DenseOutputs(logits, weights, ids, front, shared, codes, scales, shared_ready)

    def up_projection(self, dense: DenseOutputs, normed: torch.Tensor) -> torch.Tensor:
        """``shared + normed @ up^T`` (BF16 ``[T, H]``; cuBLAS addmm rounds the product and
        the sum), after the shared expert of ``dense`` is ready."""
        if dense.shared_ready is not None:
            torch.cuda.current_stream(self.device).wait_event(dense.shared_ready)
        return stock.addmm_bf16(dense.shared, normed, self.up)
