"""Top-k sigmoid routing (CuTe DSL): exact top-16 of ``sigmoid(logit) + bias`` per token,
one CTA (one warp) per token. ``reference.emulation.route`` repeats it bit-exactly."""

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Uint64

from fast import _cute as h
from fast import backend

__all__ = ["route", "RouterKernel"]


def umax(a, b):
    """Unsigned 64-bit maximum (``max.u64``)."""
    return cutlass.max(Uint64(a), Uint64(b))


def tree_max(keys):
    """Pairwise max.u64 tree (plain Python at trace time: a fixed tree shape)."""
    level = list(keys)
    while len(level) > 1:
        nxt = [umax(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


class RouterKernel:
    """ids[t], weights[t] = exact top-k of ``sigmoid_rn(logits[t]) + bias``.

    Algorithm: one CTA of one warp per token; lane l owns experts e = l + 32 j,
    j < E / 32 (coalesced loads).

    1. every lane loads its E/32 logits and biases (all loads issued first), computes
       ``s = sigmoid_rn(x) = div.rn(1, add(1, exp_rn(-x)))`` (``fast._cute``: FP32
       IEEE operations only) and ``sel = add.rn(s, bias)``;
    2. each ``sel`` becomes a 64-bit key: the FP32 bits made order-preserving as
       unsigned (``-0`` canonicalized to ``+0``; negative: all bits flipped; else the
       sign bit set) in the high word, ``0xFFFFFFFF - e`` in the low word -- so the
       unsigned order of keys is (score descending, expert id ascending), and every
       key is unique and non-zero; 0 marks a taken expert;
    3. k rounds: lane maximum by a pairwise ``max.u64`` tree over its keys, warp
       maximum by a 5-step butterfly (``shfl.bfly`` 16..1) -- every lane then holds
       the round's winner; the owner zeroes that key; lane r keeps the round-r id;
    4. lanes r < k reload ``logits[t, id_r]`` and recompute ``s_r = sigmoid_rn``
       (the same instructions, so the same bits); the sum is accumulated in k order
       from 0 (``add.rn``: ``((s_0 + s_1) + s_2) + ...``, by 15 shuffles);
       ``w_r = mul.rn(div.rn(s_r, sum), scale)`` (renormalize) or
       ``mul.rn(s_r, scale)``; lane r stores ``ids[t, r]`` and ``weights[t, r]``.

    Exactness: the selection is exact given the scores (no approximation in the
    ordering; ties go to the lower expert id); the scores and weights equal
    ``reference.emulation.route`` bitwise. NaN logits: unspecified (not checked).

    Constraints: ``E % 32 == 0``, ``32 <= E <= 1024``, ``k <= 32``, ``k < E``; logits FP32
    ``[T, E]`` and bias FP32 ``[E]`` contiguous; outputs FP32 / int32 ``[T, k]``.

    Run: ``python -m pytest verify/test_router.py -k fast`` (on an SM90/SM100 GPU).
    """

    def __init__(self, experts: int, top_k: int, renormalize: bool):
        self.experts, self.top_k, self.renormalize = experts, top_k, renormalize

    @cute.jit
    def __call__(self, logits, bias, weights, ids, scale, tokens, stream):
        self.kernel(logits, bias, weights, ids, scale).launch(
            grid=(tokens, 1, 1), block=(32, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(self, logits, bias, weights, ids, scale):
        lane = cute.arch.thread_idx()[0]
        token = cute.arch.block_idx()[0]
        experts: cutlass.Constexpr = self.experts
        top_k: cutlass.Constexpr = self.top_k
        per: cutlass.Constexpr = self.experts // 32
        row = logits + token * experts
        xs = [cute.arch.load(row + (lane + 32 * j), h.Float32) for j in range(per)]
        bs = [cute.arch.load(bias + (lane + 32 * j), h.Float32) for j in range(per)]
        keys = []
        for j in cutlass.range_constexpr(per):
            sel = h.fadd(h.sigmoid_rn(xs[j]), bs[j])
            u = h.bits(sel)
            u = h.Uint32(cutlass.select_(u == h.Uint32(0x80000000), h.Uint32(0), u))
            mask = h.Uint32(h.Int32(u) >> h.Int32(31)) | h.Uint32(0x80000000)
            hi = Uint64(u ^ mask) << Uint64(32)
            low = Uint64(h.Uint32(0xFFFFFFFF) - h.Uint32(lane + 32 * j))
            keys.append(hi | low)
        my_id = h.Int32(0)
        for r in cutlass.range_constexpr(top_k):
            best = tree_max(keys)
            for o in (16, 8, 4, 2, 1):
                best = umax(best, cute.arch.shuffle_sync_bfly(best, offset=o))
            for j in cutlass.range_constexpr(per):
                keys[j] = Uint64(cutlass.select_(keys[j] == best, Uint64(0), keys[j]))
            winner = h.Int32(h.Uint32(0xFFFFFFFF) - h.Uint32(best & Uint64(0xFFFFFFFF)))
            my_id = h.Int32(cutlass.select_(lane == r, winner, my_id))
        s = h.Float32(0.0)
        if lane < top_k:
            s = h.sigmoid_rn(cute.arch.load(row + my_id, h.Float32))
        w = s
        if cutlass.const_expr(self.renormalize):
            total = cute.arch.shuffle_sync(s, 0)
            for r in cutlass.range_constexpr(1, top_k):
                total = h.fadd(total, cute.arch.shuffle_sync(s, r))
            w = h.fdiv(s, total)
        w = h.fmul(w, scale)
        if lane < top_k:
            cute.arch.store(weights + (token * top_k + lane), w)
            cute.arch.store(ids + (token * top_k + lane), my_id)


def compile_args(*, experts: int, top_k: int, renormalize: bool):
    """(kernel object, fake arguments but the stream) for ``backend.compile_for_target``."""
    obj = RouterKernel(experts, top_k, bool(renormalize))
    return obj, (backend.ptr(None, "f32", 4), backend.ptr(None, "f32", 4),
                 backend.ptr(None, "f32", 4), backend.ptr(None, "i32", 4),
                 backend.float32(1.0), backend.int32(1))


def route(logits: torch.Tensor, bias: torch.Tensor, *, top_k: int = 16,
          renormalize: bool = True, scale: float = 1.0, out=None):
    """``(weights FP32 [T, k], ids int32 [T, k])``: exact top-k of ``sigmoid(logits) + bias``
    (descending, ties to the lower expert id); weights are the unbiased sigmoids of the
    chosen experts, divided by their FP32 sum in k order (``renormalize``), times
    ``scale``. logits FP32 ``[T, E]``, bias FP32 ``[E]``, contiguous CUDA tensors,
    ``E % 32 == 0``, ``E <= 1024``. ``out``: optional preallocated ``(weights, ids)``."""
    if not isinstance(logits, torch.Tensor) or not isinstance(bias, torch.Tensor):
        raise TypeError("route: logits and bias must be torch.Tensors")
    if logits.dtype != torch.float32 or logits.dim() != 2:
        raise TypeError(f"route: logits must be float32 [T, E], got {logits.dtype} {tuple(logits.shape)}")
    t, experts = logits.shape
    if bias.dtype != torch.float32 or tuple(bias.shape) != (experts,):
        raise TypeError(f"route: bias must be float32 [{experts}], got {bias.dtype} {tuple(bias.shape)}")
    if experts % 32 or not 32 <= experts <= 1024:
        raise ValueError(f"route: E={experts} must be a multiple of 32 in [32, 1024]")
    if not isinstance(top_k, int) or not 1 <= top_k <= min(32, experts - 1):
        raise ValueError(f"route: top_k must be an int in [1, {min(32, experts - 1)}], got {top_k!r}")
    for name, v in (("logits", logits), ("bias", bias)):
        if not v.is_cuda or v.device != logits.device:
            raise ValueError(f"route: {name} must be a CUDA tensor on logits' device, got {v.device}")
        if not v.is_contiguous():
            raise ValueError(f"route: {name} must be contiguous")
    if logits.numel() >= 2**31:
        raise ValueError("route: logits has 2^31 elements or more")
    if out is None:
        weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
        ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    else:
        weights, ids = out
        if weights.dtype != torch.float32 or ids.dtype != torch.int32 \
                or tuple(weights.shape) != (t, top_k) or tuple(ids.shape) != (t, top_k) \
                or not weights.is_contiguous() or not ids.is_contiguous() \
                or weights.device != logits.device or ids.device != logits.device:
            raise ValueError(f"route: out must be (float32 [{t}, {top_k}], int32 [{t}, {top_k}]) "
                             f"contiguous on {logits.device}")
    if t == 0:
        return weights, ids
    fn = backend.compiled("router", backend.device_arch(logits.device), experts=experts,
                          top_k=top_k, renormalize=bool(renormalize))
    fn(backend.ptr(logits, "f32", 4), backend.ptr(bias, "f32", 4), backend.ptr(weights, "f32", 4),
       backend.ptr(ids, "i32", 4), backend.float32(scale), backend.int32(t),
       backend.stream(logits.device))
    return weights, ids
