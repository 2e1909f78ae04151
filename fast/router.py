"""Top-k sigmoid routing (CuTe DSL): exact top-16 of ``sigmoid(logit) + bias`` per token,
one CTA per token (``RouterKernel``). ``reference.emulation.route`` repeats it bit-exactly."""

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Uint64

from fast.device import fp32 as h
from fast import backend

__all__ = ["route", "RouterKernel"]


def umax(a, b):
    """Unsigned 64-bit maximum (``max.u64``)."""
    return cutlass.max(Uint64(a), Uint64(b))


def umin(a, b):
    """Unsigned 64-bit minimum (``min.u64``)."""
    return cutlass.min(Uint64(a), Uint64(b))


def order_key(score, expert):
    """The 64-bit selection key of ``score`` (FP32) for ``expert``: the score's bits made
    order-preserving as unsigned (``-0`` canonicalized to ``+0``; negative: all bits
    flipped; else the sign bit set) in the high word, ``0xFFFFFFFF - expert`` in the low
    word, so the unsigned order of keys is (score descending, expert id ascending) and
    every key is unique and non-zero."""
    u = h.bits(score)
    u = h.Uint32(cutlass.select_(u == h.Uint32(0x80000000), h.Uint32(0), u))
    mask = h.Uint32(h.Int32(u) >> h.Int32(31)) | h.Uint32(0x80000000)
    return (Uint64(u ^ mask) << Uint64(32)) | Uint64(h.Uint32(0xFFFFFFFF) - h.Uint32(expert))


def key_expert(key):
    """The expert id of an ``order_key`` key (int32)."""
    return h.Int32(h.Uint32(0xFFFFFFFF) - h.Uint32(key & Uint64(0xFFFFFFFF)))


def compare_exchange(mine, other, lower, descending):
    """The key an element keeps from its pair (``mine``, ``other``): the larger where it is
    the lower element of the pair and ``descending`` holds (or neither), else the smaller.
    ``lower`` and ``descending`` are trace-time bools or per-lane predicates."""
    keep_max = lower == descending
    if isinstance(keep_max, bool):  # known at trace time (a register pair)
        return umax(mine, other) if keep_max else umin(mine, other)
    # one 64-bit comparison and one select (not a max, a min and a select of the two)
    take_other = (Uint64(other) > Uint64(mine)) == keep_max
    return Uint64(cutlass.select_(take_other, other, mine))


def bitonic_stage(keys, lane, size: int, distance: int):
    """One stage of a bitonic network over a warp list of ``32 P`` keys, ``keys[r]`` being
    element ``i = 32 r + lane``: elements ``i`` and ``i ^ distance`` exchange, and the lower
    of the pair keeps the larger key where ``i & size == 0`` (a descending block; with
    ``size`` the list's length every block is). Distances below 32 pair lanes
    (``shfl.bfly``), 32 and above pair registers of one lane."""
    out = []
    for r, key in enumerate(keys):
        descending = ((lane & size) == 0) if size < 32 else ((32 * r) & size) == 0
        if distance < 32:
            other = cute.arch.shuffle_sync_bfly(key, offset=distance)
            out.append(compare_exchange(key, other, (lane & distance) == 0, descending))
        else:
            partner = r ^ (distance // 32)
            out.append(compare_exchange(key, keys[partner], r < partner, descending))
    return out


def warp_sort_descending(keys, lane):
    """A warp's ``32 P`` keys (``keys[r]``: element ``32 r + lane``) sorted descending
    (element i: the i-th largest) by a bitonic sorting network (15 stages for 32 keys, 21
    for 64)."""
    n = 32 * len(keys)
    size = 2
    while size <= n:
        distance = size // 2
        while distance >= 1:
            keys = bitonic_stage(keys, lane, size, distance)
            distance //= 2
        size *= 2
    return keys


def warp_merge_descending(keys, others_reversed, lane):
    """The ``n = 32 P`` largest of two descending warp lists, descending: element i holds
    list A's i-th key and list B's (n - 1 - i)-th; their maxima form a bitonic sequence
    holding the n largest, which ``log2(n)`` half-cleaner stages sort."""
    keys = [umax(k, o) for k, o in zip(keys, others_reversed)]
    distance = 16 * len(keys)
    while distance >= 1:
        keys = bitonic_stage(keys, lane, 32 * len(keys), distance)
        distance //= 2
    return keys


class RouterKernel:
    """ids[t], weights[t] = exact top-k of ``sigmoid_rn(logit) + bias``.

    Algorithm: one CTA per token of ``E / P`` threads, ``P`` keys per thread (2 where
    ``E % 64 == 0``, else 1); warp w owns the ``n = 32 P`` experts ``[n w, n w + n)``, its
    lane l the experts ``n w + 32 r + l`` (element ``32 r + l`` of the warp's list).

    1. each thread loads its logits and biases, computes ``s = sigmoid_rn(x) = div.rn(1,
       add(1, exp_rn(-x)))`` (``fast.device.fp32``: FP32 IEEE operations only), ``sel = add.rn(s,
       bias)`` and its key (``order_key``: unsigned order = score descending, then expert id
       ascending; unique);
    2. each warp sorts its n keys descending with a bitonic network (``shfl.bfly`` between
       lanes, register pairs within a lane; 21 stages for 64 keys);
    3. the warps' sorted lists are merged pairwise in a tree through shared memory
       (``ceil(log2(warps))`` levels, one barrier each): at the level of stride s, warp
       ``w = s mod 2s`` stores its list, warp ``w - s`` keeps the n largest of both
       (``warp_merge_descending``); warp 0 ends with the token's n largest keys in order,
       the 32 largest in its lanes' first register;
    4. lanes r < k of warp 0 take the round-r expert, reload ``logits[t, id_r]`` and
       recompute ``s_r = sigmoid_rn`` (the same instructions, so the same bits); the sum is
       accumulated in k order from 0 (``add.rn``: ``((s_0 + s_1) + s_2) + ...``, by 15
       shuffles); ``w_r = mul.rn(div.rn(s_r, sum), scale)`` (renormalize) or
       ``mul.rn(s_r, scale)``; lane r stores ``ids[t, r]`` and ``weights[t, r]``.

    Exactness: the keys are unique, so every comparison network orders them exactly: the
    selection is exact given the scores (ties go to the lower expert id); the scores and
    weights equal ``reference.emulation.route`` bitwise. NaN logits: unspecified (not
    checked).

    Why this shape (measured on the H200, ``benchmarks.wide_timeline``): the previous
    kernel, one warp per token with 16 rounds of a warp-wide maximum over 28 keys per lane,
    took 17.3 us at 65 tokens and 18.2 us at 1024, on the critical path of a wide rank;
    its straight-line code was 90 KB of SASS for one warp.

    Constraints: ``E % 32 == 0``, ``32 <= E <= 1024``, ``k <= 32``, ``k < E``; logits FP32
    ``[T, E]`` and bias FP32 ``[E]`` contiguous; outputs FP32 / int32 ``[T, k]``.

    Run: ``python -m pytest verify/test_router.py -k fast`` (on an SM90/SM100 GPU).
    """

    def __init__(self, experts: int, top_k: int, renormalize: bool):
        self.experts, self.top_k, self.renormalize = experts, top_k, renormalize
        #: keys per thread: 2 where E % 64 == 0 (half the threads per token, so twice the
        #: tokens in flight per multiprocessor), else 1
        self.per = 2 if experts % 64 == 0 else 1
        self.threads = experts // self.per
        self.warps = self.threads // 32
        #: merge levels: ceil(log2(warps))
        self.levels = max(0, (self.warps - 1).bit_length())

    @classmethod
    def compile_args(cls, *, experts: int, top_k: int, renormalize: bool):
        """(kernel, fake arguments but the stream) for ``fast.device.compile.compiled``."""
        return cls(experts, top_k, bool(renormalize)), (
            backend.ptr(None, "f32", 4), backend.ptr(None, "f32", 4), backend.ptr(None, "f32", 4),
            backend.ptr(None, "i32", 4), backend.float32(1.0), backend.int32(1))

    @cute.jit
    def __call__(self, logits, bias, weights, ids, scale, tokens, stream):
        self.kernel(logits, bias, weights, ids, scale).launch(
            grid=(tokens, 1, 1), block=(self.threads, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(self, logits, bias, weights, ids, scale):
        token = cute.arch.block_idx()[0]
        self.route_row(logits + token * self.experts, bias, weights, ids, scale, token)

    @cute.jit
    def route_row(self, row, bias, weights, ids, scale, token):
        """Steps 1-4 for one token by this CTA (``threads`` threads): ``row`` points at its
        ``E`` FP32 logits (global memory, or shared memory where a fused kernel staged
        them); writes ``ids[token]`` and ``weights[token]``."""
        tid = cute.arch.thread_idx()[0]
        lane = tid % 32
        warp = tid // 32
        top_k: cutlass.Constexpr = self.top_k
        warps: cutlass.Constexpr = self.warps
        per: cutlass.Constexpr = self.per
        n: cutlass.Constexpr = 32 * per  # keys per warp list
        # warp w owns experts [n w, n w + n): element 32 r + lane of its list is expert
        # n w + 32 r + lane (coalesced loads)
        experts_of = [warp * n + 32 * r + lane for r in range(per)]
        xs = [cute.arch.load(row + e, h.Float32) for e in experts_of]
        bs = [cute.arch.load(bias + e, h.Float32) for e in experts_of]
        keys = [order_key(h.fadd(h.sigmoid_rn(x), b), e) for x, b, e in zip(xs, bs, experts_of)]
        keys = warp_sort_descending(keys, lane)
        if cutlass.const_expr(warps > 1):
            lists = cute.arch.alloc_smem(Uint64, self.experts, alignment=16)
            for level in cutlass.range_constexpr(self.levels):
                stride = 1 << level
                if warp % (2 * stride) == stride:
                    for r in cutlass.range_constexpr(per):
                        cute.arch.store(lists + (warp * n + 32 * r + lane), keys[r])
                cute.arch.sync_threads()
                if warp % (2 * stride) == 0:
                    if warp + stride < warps:
                        # element i takes the partner list's element n - 1 - i
                        others = [cute.arch.load(lists + ((warp + stride) * n + n - 1 - 32 * r - lane),
                                                 Uint64) for r in range(per)]
                        keys = warp_merge_descending(keys, others, lane)
        if warp == 0:
            # element `lane` (register 0) is the lane-th largest key of the token
            my_id = key_expert(keys[0])
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
