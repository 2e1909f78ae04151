"""The wide layer's polled routing in one kernel: the poll of a rank's mailbox, the router
and the MXFP8 quantization of the polled latent (``WideRouteSharded``'s reads and what
follows them), one CTA per token.

Each of the three parts is the code of its own kernel, emitted into this one, so each
output is bitwise what the separate kernels write (and what their contracts check):

1. ``fast.schedules.wide_kernels.PollKernel.poll_row``: every granule of the token's
   mailbox row polled until it arrives (or the deadline passes: the error record, never
   a hang), copied to ``logits [T, E]`` (FP32) and ``latent [T, L]`` (BF16), re-armed;
   each arrived granule also lands in shared memory;
2. a barrier; threads ``b < L / 32``: ``fast.mx.quantize_block`` of the staged latent's
   block ``b`` (RCEIL E8M0 scale, E4M3 codes) into ``codes [T, L]`` and ``scales [T,
   L/32]`` (the linear layout of ``fast.mx.quantize_mxfp8``);
3. ``fast.router.RouterKernel.route_row`` over the staged logits: ``ids [T, k]``,
   ``weights [T, k]``;
4. with ``lists`` (the experts engine's ``list_params()``), the engine's routing-lists
   kernel's work for the token (``fast.experts.lists.RoutingListsKernel``'s code): the
   quantizer threads also write the token's BF16 plan row (``plan_granule`` of their
   codes), and after a barrier threads ``r < k`` append pair ``t k + r`` (its id read back
   from ``ids``) to its expert's routing list (``list_pair``: the engine's counters and
   error record), so the engine's call (``listed=True``) starts at its plan kernel.

What it removes (measured on the H200, ``benchmarks.wide_timeline``): the router's and
the quantizer's launches and the gaps before them, and the router's re-read of the
logits; the poll, the router and the quantizer were three kernels between the rank's
publish and its experts (and, with ``lists``, the engine's list kernel a fourth).

Constraints: those of the three kernels (``E % 32 == 0``, ``32 <= E <= 1024``, ``L % 32
== 0``) and ``L / 32 <= E / P`` (one quantizer thread per block; ``P`` the router's keys
per thread). A timed-out poll leaves the outputs unspecified (the host raises).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from fast import mx
from fast.device import ptx as p
from fast.experts.lists import RoutingListsKernel
from fast.router import RouterKernel
from fast.schedules.wide_kernels import PollKernel

__all__ = ["PolledRouteKernel"]


class PolledRouteKernel:
    """Poll, quantize and route one rank's tokens (module docstring): grid ``T``, block
    ``E / P`` threads (the router's)."""

    def __init__(self, latent: int, experts: int, top_k: int, renormalize: bool,
                 lists: dict | None = None):
        self.latent, self.experts, self.top_k = latent, experts, top_k
        #: the engine's routing-lists kernel whose work this kernel also does (step 4)
        self.lists = None if lists is None else RoutingListsKernel(**dict(lists))
        if self.lists is not None and (self.lists.latent, self.lists.top_k) != (latent, top_k):
            raise ValueError(f"PolledRouteKernel: the engine's lists are for L={self.lists.latent}, "
                             f"k={self.lists.top_k}, not L={latent}, k={top_k}")
        self.poll = PollKernel(latent, experts)
        self.router = RouterKernel(experts, top_k, bool(renormalize))
        self.threads = self.router.threads
        self.blocks = latent // 32
        if latent % 32 or self.blocks > self.threads:
            raise ValueError(f"PolledRouteKernel: L={latent} must be a multiple of 32 with "
                             f"L/32 <= {self.threads} (the router's threads for E={experts})")

    @classmethod
    def compile_args(cls, **params):
        """(kernel, fake arguments but the stream) for ``fast.device.compile.compiled``."""
        from fast import backend

        return cls(**params), ([Int64(0)] * 7 + [backend.ptr(None, "f32", 4),
                                                  backend.ptr(None, "f32", 4),
                                                  backend.ptr(None, "i32", 4), Float32(1.0),
                                                  Int32(0), Int32(0), Int32(1)]
                               + [Int64(0)] * 3 + [Int32(1), Int32(1)])

    @cute.jit
    def __call__(self, box: Int64, logits: Int64, latent: Int64, codes: Int64, scales: Int64,
                 error: Int64, timeout_ns: Int64, bias, weights, ids, scale: Float32,
                 rank: Int32, buffer: Int32, rows: Int32, plan: Int64, lists: Int64,
                 work: Int64, capacity: Int32, tokens: Int32, stream):
        self.kernel(box, logits, latent, codes, scales, error, timeout_ns, bias, weights, ids,
                    scale, rank, buffer, rows, plan, lists, work, capacity).launch(
            grid=(tokens, 1, 1), block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, box: Int64, logits: Int64, latent: Int64, codes: Int64, scales: Int64,
               error: Int64, timeout_ns: Int64, bias, weights, ids, scale: Float32,
               rank: Int32, buffer: Int32, rows: Int32, plan: Int64, lists: Int64,
               work: Int64, capacity: Int32):
        tid = cute.arch.thread_idx()[0]
        t = cute.arch.block_idx()[0]
        L: cutlass.Constexpr = self.latent
        staged_latent = cute.arch.alloc_smem(Uint32, L // 2, alignment=16)
        staged_logits = cute.arch.alloc_smem(Float32, self.experts, alignment=16)
        self.poll.poll_row(box, logits, latent, error, timeout_ns, rank, buffer, rows,
                           self.threads, staged=(staged_latent.toint(), staged_logits.toint()))
        cute.arch.sync_threads()
        if tid < self.blocks:
            at = staged_latent.toint() + tid * 64
            words = []
            for i in cutlass.range_constexpr(4):
                words += p.lds_v4(at + 16 * i)
            code, out = mx.quantize_block(words)
            dst = codes + Int64(t) * L + tid * 32
            p.stg_v4(dst, out[:4])
            p.stg_v4(dst + 16, out[4:])
            p.stg_u8(scales + Int64(t) * (L // 32) + tid, code)
            if cutlass.const_expr(self.lists is not None):
                row = plan + (Int64(t) * L + tid * 32) * 2
                for i in cutlass.range_constexpr(4):
                    p.stg_v4(row + 16 * i, self.lists.plan_granule(out[2 * i: 2 * i + 2], code))
        self.router.route_row(staged_logits, bias, weights, ids, scale, t)
        if cutlass.const_expr(self.lists is not None):
            cute.arch.sync_threads()  # the router's ids stores, visible to the block
            if tid < self.top_k:
                pair = t * self.top_k + tid
                expert = cute.arch.load(ids + pair, Int32)
                self.lists.list_pair(work, lists, capacity, pair, expert)
