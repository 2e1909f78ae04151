"""Peer: OpenAI ``triton_kernels`` ``matmul_ogs`` MXFP4 MoE on Hopper, for the issue-8 benchmark.

The contestant that vLLM runs for MXFP4 MoE on H100/H200: BF16 activations x MXFP4 weights
in triton_kernels' Hopper layout, two ``matmul_ogs`` calls (gather -> FC1 with fused
activation; FC2 -> scatter-combine weighted by the routing weights). This module turns our
weight format into that layout once, builds the routing from our ids/weights, and runs one
MoE call. It is **timed, not checked against our numerics**; ``check_fc1`` and
``check_forward`` only prove (on a tiny problem) that the converted weights and the routing
are right.

**API version.** Written against the triton_kernels copy that vLLM 0.26.0 vendors
(``vllm/third_party/triton_kernels``, API v3.5.1: ``triton_kernels.matmul_ogs.matmul_ogs``,
``routing.routing_from_bitmatrix``, ``tensor.convert_layout`` / ``wrap_torch_tensor`` /
``FP4``, ``tensor_details.layout.HopperMXValueLayout`` / ``HopperMXScaleLayout``), run with
triton 3.6.0. On the GPU node it is importable with ``PYTHONPATH=.gpu/peers:$PYTHONPATH``;
``available()`` also adds ``<repo>/.gpu/peers`` to ``sys.path`` by itself when the plain
import fails. Nothing here imports triton at module import time (CPU-only machines import
this module and test the pure-PyTorch parts).

**Our weights** (compressed-tensors mxfp4-pack-quantized, nn.Linear ``[out, in]``): w13 codes
``uint8 [E, 2I, L/2]`` (rows: gate ``0..I-1`` then up ``I..2I-1``; element ``2i`` in the low
nibble), E8M0 scales ``uint8 [E, 2I, L/32]``; w2 codes ``uint8 [E, L, I/2]``, scales ``uint8
[E, L, I/32]``. A TP rank passes its already-sliced tensors (gate slice, up slice, w2 column
slice), so ``I`` is then ``I_s``.

**Conversion** (``convert_weight``, once, outside the timed region; the same calls as vLLM's
``_swizzle_mxfp4`` on SM90):

1. w13 rows are interleaved ``[g0, u0, g1, u1, ...]`` (triton's SwiGLU reads gate = even
   columns, linear = odd columns of FC1's output; vLLM does the same ``_gu_interleave`` for
   ``[gate; up]`` checkpoints). w2 is not permuted.
2. codes ``[E, N, K/2]`` -> ``.transpose(-2, -1)`` (a view ``[E, K/2, N]``, packed along K,
   ``stride(-2) == 1``) -> ``wrap_torch_tensor(..., dtype=FP4)`` (logical ``[E, K, N]``) ->
   ``convert_layout(..., HopperMXValueLayout, mx_axis=1)``.
3. scales ``[E, N, K/32]`` -> ``.transpose(-2, -1)`` -> ``wrap_torch_tensor`` ->
   ``convert_layout(..., HopperMXScaleLayout, mx_axis=1, num_warps=num_warps)``.
4. ``PrecisionConfig(weight_scale=<scale Tensor>, flex_ctx=FlexCtx(rhs_data=InFlexData()))``.

The layouts act on each expert independently, so the conversion runs ``chunk_experts``
experts at a time (bounded temporary memory; the result is byte-identical, tested).
matmul_ogs then sees ``K, N = w.shape[-2:]`` = ``(L, 2I)`` for FC1 and ``(I, L)`` for FC2,
and ``W_TRANSPOSE`` (``stride(-2) == 1``), which the Hopper scale layout requires.

**Routing** (``route``, inside the timed call, device-only, no host sync): ids are made local
(``ids - first``; pairs outside ``[first, first + count)`` become ``-1``, int16, the sentinel
that triton's routing sorts last and skips — the same as vLLM's EP ``expert_map`` path), a
``uint32 [R, ceil(count/32)]`` bitmatrix of the local pairs is built with PyTorch ops
(``bitmatrix_words``), and ``routing_from_bitmatrix(bitmatrix, weights_fp32, local_ids,
count, K)`` gives ``RoutingData`` (histogram over the ``count`` local experts, the routing
weights in expert-sorted order as FC2's ``gammas``) and the gather/scatter indices. Tokens
with no local pair come out as zero rows (triton's grouped reduce writes every row).

**What one call does (what is timed)**, ``TritonMoE.__call__(x, ids, weights)``:
routing (bitmatrix build + triton's routing kernels), FC1
``matmul_ogs(x, w13, None, rd, gather_indx=..., precision_config=..., fused_activation=SwiGLU)``,
FC2 ``matmul_ogs(h, w2, None, rd, scatter_indx=..., precision_config=..., gammas=rd.gate_scal)``
whose grouped reduce is the combine; returns BF16 ``[R, L]``. FP32 accumulation in both
GEMMs (BF16 x BF16-dequantized-MXFP4 ``tl.dot``), BF16 ``h`` and BF16 per-pair FC2 rows,
FP32 combine, BF16 output.

**Activation.** Our model's SiTU is not a triton_kernels activation. The peer uses
triton_kernels' SwiGLU (``alpha = 1.702``, ``limit = 7.0``, vLLM's gpt-oss values), same
order of cost (one exp, a few FMAs per output element):

* ``activation="swiglu_fused"`` (default; vLLM's path): fused into FC1's epilogue, FC1
  writes ``[R*K, I]``;
* ``activation="swiglu_separate"``: FC1 without activation writes ``[R*K, 2I]``, then
  triton_kernels' standalone ``swiglu`` kernel over the valid (routed, local) rows only —
  the "unfused elementwise op" variant; ``8 I`` extra bytes of traffic per routed pair (FC1
  writes ``2I`` BF16 instead of ``I``, the swiglu kernel reads them and writes ``I``).

**Configuration knobs** (constructor): ``num_warps`` 4 or 8 (baked into the Hopper scale
swizzle; matmul_ogs takes the kernel's num_warps from it; BLOCK_N = 128 for 4, 256 for 8);
``split_k`` (default 1; set as an opt-flags constraint around each call, restored after);
``block_m`` (None = triton's heuristic, or a forced 16/32/64/128); ``tokens_per_expert_hint``
(``"uniform"`` = ``max(1, R*K // n_experts_total)``, the expected local pairs per expert of
uniform routing, stored as ``RoutingData.expected_tokens_per_expt`` — the field triton_kernels
provides for expert sharding; ``None`` = triton's default ``R*K // count``, which is what
vLLM's EP path does and over-estimates a DEP owner's load ``E/count`` times; an ``int``
forces it). It only steers BLOCK_M (the kernel also receives it as an unspecialized
annotation argument: no recompilation per value). Hopper MXFP4 cannot use TMA/persistent kernels in this version,
so matmul_ogs runs its non-persistent kernel.

**CUDA graphs.** A call does no host synchronization and no data-dependent host logic
(every size is derived from ``R``, ``K``, ``count``; the routing kernels read the counts on
the device), allocates only through PyTorch's caching allocator, and launches triton kernels
that are compiled at the first (warm-up) call — so it can be captured in a
``torch.cuda.CUDAGraph`` after one eager warm-up call at the same shapes (as vLLM's
CUDA-graph mode does with this path). ``smoke()`` captures one and checks the replay against the eager output.

**Bytes.** ``bytes_streamed(ids, ...)`` is the weight bytes one call must read: local experts
with at least one routed pair x our MXFP4 bytes per expert (codes + E8M0 scales of w13 and
w2: 17,547,264 B at L = 3584, I = 3072). ``TritonMoE.stored_bytes_per_expert`` is the size
of the converted (swizzled, possibly padded) tensors, equal for the real dimensions.

Smoke test on the GPU node::

    PYTHONPATH=.gpu/peers:. python3 -m benchmarks.peers.triton_moe
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any

import torch

from model.formats import dequantize_mxfp4  # our MXFP4 decoded exactly (re-exported)

__all__ = [
    "API_VERSION",
    "check_capacity",
    "check_weights",
    "per_expert_float64",
    "tiny_problem",
    "SWIGLU_ALPHA",
    "SWIGLU_LIMIT",
    "ACTIVATIONS",
    "available",
    "versions",
    "dequantize_mxfp4",
    "interleave_gate_up",
    "deinterleave_gate_up",
    "canonical_weight",
    "dequantize_canonical",
    "local_ids",
    "bitmatrix_words",
    "unpack_bitmatrix",
    "expert_bytes",
    "touched_experts",
    "bytes_streamed",
    "check_routing_inputs",
    "LAYOUTS",
    "compact_slots",
    "compact_rows",
    "local_rows",
    "local_pairs",
    "pairs_hint",
    "compact_forward",
    "convert_weight",
    "rank_moes", "rank_weight_slice", "gated_activation64", "check_int",
    "TritonMoE",
    "random_weights",
    "random_routing",
    "check_fc1",
    "check_forward",
    "smoke",
]

API_VERSION = "3.5.1"
"""The triton_kernels API this harness is written against (vLLM 0.26.0's vendored copy)."""

SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0
ACTIVATIONS = ("swiglu_fused", "swiglu_separate")
MX_BLOCK = 32
_MAX_LOCAL_EXPERTS = 32767  # local ids travel as int16 (triton's routing keys are 16-bit)

# E2M1 code -> value (code 8 is -0.0)


# --------------------------------------------------------------------------------------
# availability
# --------------------------------------------------------------------------------------

def _peers_dir() -> str:
    """``<repo>/.gpu/peers``: where the GPU node keeps the triton_kernels copy."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        ".gpu", "peers")


def _import_triton_kernels():
    """Import ``triton_kernels`` (adding ``<repo>/.gpu/peers`` to sys.path if needed).

    Raises:
        ImportError: naming what is missing (triton itself, or the triton_kernels copy).
    """
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise ImportError(f"triton is not importable ({e}); triton_kernels needs it") from e
    try:
        import triton_kernels  # noqa: F401
    except ImportError:
        peers = _peers_dir()
        if not os.path.isdir(os.path.join(peers, "triton_kernels")):
            raise ImportError(
                "triton_kernels is not importable and there is no copy at "
                f"{os.path.join(peers, 'triton_kernels')} (run with PYTHONPATH=.gpu/peers)"
            ) from None
        if peers not in sys.path:
            sys.path.insert(0, peers)
        import triton_kernels  # noqa: F401
    try:
        import triton_kernels.matmul_ogs as mo
        import triton_kernels.matmul_ogs_details.opt_flags as opt_flags
        import triton_kernels.routing as routing
        import triton_kernels.swiglu as swiglu
        import triton_kernels.tensor as tensor
        from triton_kernels.numerics import InFlexData
        from triton_kernels.tensor_details import layout
    except (ImportError, AttributeError) as e:  # a triton too old/new for this copy
        raise ImportError(f"triton_kernels failed to import with this triton: "
                          f"{type(e).__name__}: {e}") from e

    # The v3.5.1 names this harness calls; a newer copy (renamed `matmul`, new layout ctor
    # signatures) fails here with the name, not deep inside a kernel launch.
    for mod, names in ((mo, ("matmul_ogs", "PrecisionConfig", "FlexCtx", "FusedActivation", "FnSpecs")),
                       (routing, ("routing_from_bitmatrix", "RoutingData")),
                       (tensor, ("convert_layout", "wrap_torch_tensor", "FP4", "Bitmatrix", "Tensor",
                                 "Storage")),
                       (layout, ("HopperMXValueLayout", "HopperMXScaleLayout")),
                       (opt_flags, ("update_opt_flags_constraints", "reset_opt_flags_constraints",
                                    "make_opt_flags")),
                       (swiglu, ("swiglu", "swiglu_fn", "PrecisionConfig"))):
        missing = [n for n in names if not hasattr(mod, n)]
        if missing:
            raise ImportError(f"{mod.__name__} lacks {missing}: not the triton_kernels API "
                              f"v{API_VERSION} this harness is written for")
    import inspect
    if "mx_axis" not in inspect.signature(layout.HopperMXValueLayout.__init__).parameters:
        raise ImportError("HopperMXValueLayout(shape, mx_axis, ...) expected (API v"
                          f"{API_VERSION}); this copy has another signature")
    return {"mo": mo, "opt_flags": opt_flags, "routing": routing, "swiglu": swiglu,
            "tensor": tensor, "layout": layout, "InFlexData": InFlexData}


def available() -> tuple[bool, str]:
    """Whether the peer can run here: ``(True, "")`` or ``(False, reason)`` for a pytest skip.

    Needs triton and the triton_kernels copy importable, a CUDA device, and compute
    capability 9.x (the Hopper MXFP4 layout; on SM100 triton_kernels wants its Blackwell
    layouts and persistent TMA kernels, which this harness does not set up).
    """
    try:
        _import_triton_kernels()
    except ImportError as e:
        return False, f"triton_kernels peer unavailable: {e}"
    if not torch.cuda.is_available():
        return False, "triton_kernels peer needs a CUDA GPU (none visible)"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return False, (f"triton_kernels peer uses the Hopper MXFP4 layout and needs SM90; "
                       f"this GPU is sm_{major}{minor}")
    return True, ""


def versions() -> dict:
    """Versions for a benchmark record (triton, torch, the triton_kernels API, its path)."""
    out = {"triton_kernels_api": API_VERSION, "torch": torch.__version__}
    try:
        import triton
        out["triton"] = triton.__version__
        tk = _import_triton_kernels()
        out["triton_kernels_path"] = os.path.dirname(tk["mo"].__file__)
    except ImportError as e:
        out["error"] = str(e)
    return out


# --------------------------------------------------------------------------------------
# pure PyTorch: our format, the canonical (pre-swizzle) form, routing inputs, bytes
# --------------------------------------------------------------------------------------

def _check_u8(t, name: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
        raise ValueError(f"{name} must be a uint8 tensor, got {getattr(t, 'dtype', type(t).__name__)}")


def interleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """Rows ``[gate_0..gate_{I-1}, up_0..up_{I-1}]`` (dim -2) -> ``[gate_0, up_0, gate_1, ...]``.

    Works on ``[E, 2I, X]`` codes or scales (a contiguous copy)."""
    if t.dim() < 2 or t.shape[-2] % 2:
        raise ValueError(f"interleave_gate_up: need [..., 2I, X], got {tuple(t.shape)}")
    i = t.shape[-2] // 2
    lead = t.shape[:-2]
    return t.reshape(*lead, 2, i, t.shape[-1]).transpose(-3, -2).reshape(t.shape).contiguous()


def deinterleave_gate_up(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Inverse of the interleave along ``dim`` (e.g. FC1 output columns): ``[g0, u0, g1, u1,
    ...]`` -> ``[g0..g_{I-1}, u0..u_{I-1}]``."""
    dim = dim % t.dim()
    if t.shape[dim] % 2:
        raise ValueError(f"deinterleave_gate_up: dim {dim} of {tuple(t.shape)} is odd")
    u = t.unflatten(dim, (-1, 2))
    return torch.cat((u.select(dim + 1, 0), u.select(dim + 1, 1)), dim=dim)


def canonical_weight(codes: torch.Tensor, scales: torch.Tensor, *, interleave: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Our ``[E, N, K/2]`` codes / ``[E, N, K/32]`` scales -> the (un-swizzled) form that
    triton_kernels' matmul_ogs multiplies as ``x @ w[e]``: views ``[E, K/2, N]`` (packed along
    K) and ``[E, K/32, N]``, ``stride(-2) == 1``. ``interleave`` first interleaves gate/up rows
    (w13 for SwiGLU)."""
    if interleave:
        codes, scales = interleave_gate_up(codes), interleave_gate_up(scales)
    else:
        codes, scales = codes.contiguous(), scales.contiguous()
    return codes.transpose(-2, -1), scales.transpose(-2, -1)


def dequantize_canonical(codes_kn: torch.Tensor, scales_kn: torch.Tensor) -> torch.Tensor:
    """Dequantize the canonical form (``[E, K/2, N]`` packed along dim -2, ``[E, K/32, N]``)
    to float32 ``[E, K, N]`` — the matrix matmul_ogs multiplies by."""
    return dequantize_mxfp4(codes_kn.transpose(-2, -1).contiguous(),
                            scales_kn.transpose(-2, -1).contiguous()).transpose(-2, -1)


def local_ids(ids: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Global expert ids ``[R, K]`` -> local ids ``ids - first`` for experts in
    ``[first, first + count)``, ``-1`` for the others; int16 contiguous (triton's routing
    sorts the ``-1`` pairs last and skips them)."""
    if not 0 < count <= _MAX_LOCAL_EXPERTS:
        raise ValueError(f"count must be in [1, {_MAX_LOCAL_EXPERTS}], got {count}")
    loc = ids.to(torch.int32) - first
    valid = (loc >= 0) & (loc < count)
    return torch.where(valid, loc, torch.full_like(loc, -1)).to(torch.int16).contiguous()


def bitmatrix_words(lids: torch.Tensor, count: int) -> torch.Tensor:
    """The routing bitmatrix of local ids ``[R, K]`` (int16, -1 = not local): ``uint32
    [R, ceil(count/32)]``, bit ``e % 32`` of word ``e // 32`` set when the row routes to local
    expert ``e``. PyTorch ops only (no host sync; CUDA-graph capturable). Assumes the ids of a
    row are distinct (top-k ids are; ``check_routing_inputs`` verifies it)."""
    r, _ = lids.shape
    words = (count + 31) // 32
    lid = lids.long()
    valid = lid >= 0
    safe = torch.where(valid, lid, torch.zeros_like(lid))
    bit = torch.where(valid, torch.bitwise_left_shift(torch.ones_like(safe), safe % 32),
                      torch.zeros_like(safe))
    acc = torch.zeros((r, words), dtype=torch.int64, device=lids.device)
    acc.scatter_add_(1, safe // 32, bit)  # distinct ids: the sum of distinct bits is their OR
    acc = torch.where(acc >= 2 ** 31, acc - 2 ** 32, acc)  # two's-complement wrap to int32
    return acc.to(torch.int32).view(torch.uint32)


def unpack_bitmatrix(words: torch.Tensor, count: int) -> torch.Tensor:
    """Bool ``[R, count]`` from ``bitmatrix_words`` (for tests)."""
    w = words.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    bits = (w.unsqueeze(-1) >> torch.arange(32, device=w.device)) & 1
    return bits.reshape(w.shape[0], -1)[:, :count].bool()


def expert_bytes(latent: int, intermediate: int) -> dict:
    """Our MXFP4 bytes of one expert (codes + E8M0 scales) at latent ``L`` and intermediate
    ``I`` (pass ``I_s`` for a TP slice): keys ``w13``, ``w13_scales``, ``w2``, ``w2_scales``,
    ``total``. 17,547,264 B in total at L = 3584, I = 3072."""
    out = {"w13": 2 * intermediate * latent // 2, "w13_scales": 2 * intermediate * latent // MX_BLOCK,
           "w2": latent * intermediate // 2, "w2_scales": latent * intermediate // MX_BLOCK}
    out["total"] = sum(out.values())
    return out


def touched_experts(ids: torch.Tensor, first: int = 0, count: int | None = None) -> int:
    """Number of distinct local experts (in ``[first, first + count)``) with at least one
    routed pair in ``ids`` (host sync; call outside the timed region)."""
    flat = ids.reshape(-1).long()
    if count is not None:
        flat = flat[(flat >= first) & (flat < first + count)]
    return int(torch.unique(flat).numel())


def bytes_streamed(ids: torch.Tensor, *, latent: int, intermediate: int, first: int = 0,
                   count: int | None = None) -> int:
    """Weight bytes one call must read: touched local experts x our MXFP4 bytes per expert
    (``expert_bytes(latent, intermediate)['total']``). For the fraction of read bandwidth:
    ``bytes_streamed / seconds / bandwidth``."""
    return touched_experts(ids, first, count) * expert_bytes(latent, intermediate)["total"]


def check_routing_inputs(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *,
                         latent: int, n_experts_total: int | None = None) -> None:
    """Validate one call's inputs (host sync: run once outside the timed region).

    Raises:
        ValueError: naming the argument: x not BF16 ``[R, latent]`` contiguous; ids not
            int32/int64 ``[R, K]``; weights not FP32 ``[R, K]``; devices differ; an id
            outside ``[0, n_experts_total)``; a row with a repeated id (the bitmatrix would
            miss a pair).
    """
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2 \
            or x.shape[1] != latent or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous bfloat16 [R, {latent}] tensor, got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    r = x.shape[0]
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64) \
            or ids.dim() != 2 or ids.shape[0] != r:
        raise ValueError(f"ids must be an int32/int64 [R={r}, K] tensor, got "
                         f"{getattr(ids, 'dtype', type(ids).__name__)} {tuple(getattr(ids, 'shape', ()))}")
    if not isinstance(weights, torch.Tensor) or weights.dtype != torch.float32 \
            or tuple(weights.shape) != tuple(ids.shape):
        raise ValueError(f"weights must be a float32 {tuple(ids.shape)} tensor, got "
                         f"{getattr(weights, 'dtype', type(weights).__name__)} "
                         f"{tuple(getattr(weights, 'shape', ()))}")
    if not (x.device == ids.device == weights.device):
        raise ValueError(f"x, ids, weights must share a device, got {x.device}, {ids.device}, "
                         f"{weights.device}")
    if ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or (n_experts_total is not None and hi >= n_experts_total):
            raise ValueError(f"ids must lie in [0, {n_experts_total}), got [{lo}, {hi}]")
        s = ids.sort(dim=1).values
        dup = (s[:, 1:] == s[:, :-1]).any(dim=1)
        if bool(dup.any()):
            row = int(dup.nonzero()[0, 0])
            raise ValueError(f"ids: row {row} repeats an expert ({ids[row].tolist()}); the "
                             "routing bitmatrix needs distinct ids per row")


LAYOUTS = ("owner", "compact")
"""``owner``: the ``R`` received rows as they are (every one of their ``R K`` pair slots
routed, the non-local ones dropped); ``compact``: only the rows with at least one local
pair, gathered into a static batch of ``capacity`` rows before routing, their outputs
scattered back (module docstring)."""


def check_capacity(capacity, name: str = "capacity") -> int:
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"{name} must be an int >= 1, got {capacity!r}")
    return capacity


def compact_slots(mask: torch.Tensor, capacity: int) -> torch.Tensor:
    """The positions of the ``True`` entries of a flat bool ``mask`` (``n`` entries), in
    order, in a static int64 ``[capacity]``: slot ``j`` holds the index of the ``j``-th
    ``True`` entry, slots past their count hold ``n`` (the sentinel). Entries past
    ``capacity`` are dropped (the caller's capacity must cover the count).

    Device ops with static shapes only (a cumulative sum and one scatter with distinct
    indices: deterministic, no host sync, CUDA-graph capturable)."""
    check_capacity(capacity)
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor, got {getattr(mask, 'dtype', type(mask).__name__)}")
    m = mask.reshape(-1)
    n = m.numel()
    idx = torch.arange(n, device=m.device)
    pos = torch.cumsum(m, 0) - 1
    # a kept entry goes to its rank; every other entry to its own slot past `capacity`
    slot = torch.where(m & (pos < capacity), pos, capacity + idx)
    out = torch.full((capacity + n,), n, dtype=torch.int64, device=m.device)
    out.scatter_(0, slot, idx)
    return out[:capacity]


def compact_rows(ids: torch.Tensor, first: int, count: int, capacity: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of ``ids [R, K]`` with at least one pair in ``[first, first + count)``,
    compacted into a static batch of ``capacity`` slots: ``(src, valid)``, int64 ``src
    [capacity]`` (the source row of each slot, in row order; ``0`` for an empty slot, so
    that it can index directly) and bool ``valid [capacity]``. Device ops only."""
    r = ids.shape[0]
    local = (ids >= first) & (ids < first + count)
    src = compact_slots(local.any(dim=1), capacity)
    valid = src < r
    return torch.where(valid, src, torch.zeros_like(src)), valid


def local_rows(ids: torch.Tensor, first: int, count: int) -> int:
    """Rows of ``ids`` with at least one local pair (host sync: the ``capacity`` of the
    compact layout, computed outside the timed region, as a dispatch knows its count)."""
    return int(((ids >= first) & (ids < first + count)).any(dim=1).sum())


def local_pairs(ids: torch.Tensor, first: int, count: int) -> int:
    """Pairs of ``ids`` in ``[first, first + count)`` (host sync; outside the timed region)."""
    return int(((ids >= first) & (ids < first + count)).sum())


def pairs_hint(pairs: int, count: int) -> int:
    """``tokens_per_expert_hint`` from a real local pair count: ``max(1, round(pairs /
    count))``, the mean pairs per local expert (BLOCK_M is the next power of two of it,
    16..128, in triton_kernels' Hopper rule)."""
    check_capacity(count, "count")
    if isinstance(pairs, bool) or not isinstance(pairs, int) or pairs < 0:
        raise ValueError(f"pairs must be an int >= 0, got {pairs!r}")
    return max(1, (2 * pairs + count) // (2 * count))


def compact_forward(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, first: int, count: int,
                    capacity: int, experts) -> torch.Tensor:
    """The compact layout's glue around an owner-layout call ``experts(xc, idc, wc)`` (BF16
    ``[capacity, L]``, zero rows for rows without a local pair): the rows of ``x``, ``ids``
    and ``weights`` with a local pair gathered into ``capacity`` slots
    (:func:`compact_rows`; an empty slot gets row 0's ``x`` with every id ``-1``, i.e. no
    local pair), the call, and its rows put back at their source rows of a zero ``[R,
    L]`` (each empty slot into a row of its own past ``R``, dropped). Device ops with
    static shapes only."""
    r, k = ids.shape
    src, valid = compact_rows(ids, first, count, capacity)
    xc = x.index_select(0, src)
    idc = torch.where(valid.unsqueeze(1), ids.index_select(0, src), torch.full_like(ids[:1], -1))
    wc = weights.index_select(0, src)
    yc = experts(xc, idc.contiguous(), wc.contiguous())
    out = torch.zeros(r + capacity, yc.shape[1], dtype=yc.dtype, device=yc.device)
    dest = torch.where(valid, src, r + torch.arange(capacity, device=src.device))
    out.index_copy_(0, dest, yc)
    return out[:r]


def check_weights(w13, w13_scales, w2, w2_scales) -> tuple[int, int, int]:
    """Shapes/dtypes of our four weight tensors -> ``(E, L, I)``; ValueError naming the
    argument otherwise."""
    for name, t in (("w13", w13), ("w13_scales", w13_scales), ("w2", w2), ("w2_scales", w2_scales)):
        _check_u8(t, name)
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D [E, rows, cols], got {tuple(t.shape)}")
    e, two_i, half_l = w13.shape
    if two_i % 2:
        raise ValueError(f"w13 must be [E, 2I, L/2] with an even row count, got {tuple(w13.shape)}")
    i, lat = two_i // 2, half_l * 2
    if lat % MX_BLOCK or i % MX_BLOCK:
        raise ValueError(f"latent L={lat} and intermediate I={i} must be multiples of {MX_BLOCK}")
    want = {"w13_scales": (e, 2 * i, lat // MX_BLOCK), "w2": (e, lat, i // 2),
            "w2_scales": (e, lat, i // MX_BLOCK)}
    for name, t in (("w13_scales", w13_scales), ("w2", w2), ("w2_scales", w2_scales)):
        if tuple(t.shape) != want[name]:
            raise ValueError(f"{name} must be {list(want[name])} for w13 {list(w13.shape)} "
                             f"(E={e}, 2I={2 * i}, L/2={half_l}), got {list(t.shape)}")
    return e, lat, i


# --------------------------------------------------------------------------------------
# triton_kernels side
# --------------------------------------------------------------------------------------

def convert_weight(codes: torch.Tensor, scales: torch.Tensor, *, num_warps: int, interleave: bool,
                   chunk_experts: int | None = 64):
    """Our codes/scales -> triton_kernels ``(Tensor values, Tensor scales)`` in the Hopper
    MXFP4 layout (on the tensors' device; runs on CPU too: the layouts are PyTorch code).

    ``wrap_torch_tensor(codes.transpose(-2, -1), FP4)`` -> ``convert_layout(HopperMXValueLayout,
    mx_axis=1)``; ``wrap_torch_tensor(scales.transpose(-2, -1))`` -> ``convert_layout(
    HopperMXScaleLayout, mx_axis=1, num_warps=num_warps)``; ``chunk_experts`` experts at a time
    (None: all at once), concatenated in the layouts' storage order.
    """
    tk = _import_triton_kernels()
    T, L = tk["tensor"], tk["layout"]
    if num_warps not in (4, 8):
        raise ValueError(f"num_warps must be 4 or 8 (the Hopper scale swizzle), got {num_warps}")
    e = codes.shape[0]
    step = e if not chunk_experts or chunk_experts >= e else int(chunk_experts)
    vals, scls = [], []
    for lo in range(0, e, step):
        c_kn, s_kn = canonical_weight(codes[lo:lo + step], scales[lo:lo + step], interleave=interleave)
        vals.append(T.convert_layout(T.wrap_torch_tensor(c_kn, dtype=T.FP4), L.HopperMXValueLayout, mx_axis=1))
        scls.append(T.convert_layout(T.wrap_torch_tensor(s_kn), L.HopperMXScaleLayout, mx_axis=1,
                                     num_warps=num_warps))
    if len(vals) == 1:
        return vals[0], scls[0]

    def _join(parts, layout_cls, logical, **kw):
        datas = [p.storage.data for p in parts]
        for d in datas:  # every layout ends with .mT of a contiguous tensor
            if not d.mT.is_contiguous():
                raise RuntimeError("unexpected storage order from convert_layout: "
                                   f"{layout_cls.__name__} data strides {d.stride()}")
        data = torch.cat([d.mT for d in datas], dim=0).mT
        # the layout object only keeps shape-derived fields (K, N, mx_axis, num_warps)
        full = list(parts[0].storage.layout.initial_shape)
        full[0] = e
        lay = layout_cls(torch.Size(full), mx_axis=1, **kw)
        return T.Tensor(T.Storage(data, lay), dtype=parts[0].dtype, shape=logical,
                        shape_max=list(logical))

    n = codes.shape[1]
    k = codes.shape[2] * 2
    w = _join(vals, L.HopperMXValueLayout, [e, k, n])
    s = _join(scls, L.HopperMXScaleLayout, [e, k // MX_BLOCK, n], num_warps=num_warps)
    return w, s


class TritonMoE:
    """triton_kernels' Hopper MXFP4 MoE over our weights: one object per weight set and config.

    Args:
        w13, w13_scales, w2, w2_scales: our uint8 tensors (module docstring), either all ``E``
            experts (then ``[first, first + count)`` are taken) or exactly the ``count`` local
            ones. Any device; converted on ``device``.
        first, count: the local experts (DEP owner mode); ``count=None`` = all (wide TP mode).
            Pairs whose expert is not local are skipped; tokens without a local pair give
            zero rows.
        num_warps: 4 or 8 (baked into the scale swizzle).
        split_k: matmul_ogs split-K (1 = the measured best on the H200).
        block_m: None (heuristic) or a forced BLOCK_M.
        tokens_per_expert_hint: ``"uniform"``, None or an int (module docstring).
        n_experts_total: the model's expert count for the ``"uniform"`` hint (default: ``E``
            of the given weights when they are the full set, else ``first + count``; pass
            896 for a DEP rank given only its local experts).
        activation: ``"swiglu_fused"`` or ``"swiglu_separate"``.
        layout: the default call layout, ``"owner"`` or ``"compact"`` (:data:`LAYOUTS`;
            also a per-call argument, so one converted weight set serves both).
        device: where the converted weights live and calls run (conversion works on CPU
            for tests; calls need an SM90 GPU).
        chunk_experts: experts converted at a time.
    """

    def __init__(self, w13, w13_scales, w2, w2_scales, *, first: int = 0, count: int | None = None,
                 num_warps: int = 8, split_k: int = 1, block_m: int | None = None,
                 tokens_per_expert_hint: Any = "uniform", n_experts_total: int | None = None,
                 activation: str = "swiglu_fused", layout: str = "owner", device="cuda",
                 chunk_experts: int | None = 64):
        e, lat, inter = check_weights(w13, w13_scales, w2, w2_scales)
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ValueError(f"first must be a non-negative int, got {first!r}")
        if count is None:
            count = e - first
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be a positive int, got {count!r}")
        if count > _MAX_LOCAL_EXPERTS:
            raise ValueError(f"count={count} exceeds {_MAX_LOCAL_EXPERTS} (16-bit routing keys)")
        if e >= first + count:
            sl = slice(first, first + count)
            full_set = True
        elif e == count:
            sl = slice(0, count)  # already the local experts
            full_set = False
        else:
            raise ValueError(f"w13 has E={e} experts: pass either all experts (E >= first + count "
                             f"= {first + count}) or exactly count={count} local ones")
        if num_warps not in (4, 8):
            raise ValueError(f"num_warps must be 4 or 8, got {num_warps!r}")
        if isinstance(split_k, bool) or not isinstance(split_k, int) or split_k < 1:
            raise ValueError(f"split_k must be a positive int, got {split_k!r}")
        if block_m is not None and block_m not in (16, 32, 64, 128):
            raise ValueError(f"block_m must be None or one of 16, 32, 64, 128, got {block_m!r}")
        if not (tokens_per_expert_hint in (None, "uniform")
                or (isinstance(tokens_per_expert_hint, int) and not isinstance(tokens_per_expert_hint, bool)
                    and tokens_per_expert_hint >= 1)):
            raise ValueError(f"tokens_per_expert_hint must be 'uniform', None or an int >= 1, got "
                             f"{tokens_per_expert_hint!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if n_experts_total is None:
            n_experts_total = e if full_set else first + count
        if n_experts_total < first + count:
            raise ValueError(f"n_experts_total={n_experts_total} < first + count = {first + count}")
        self.first, self.count, self.latent, self.intermediate = first, count, lat, inter
        self.num_warps, self.split_k, self.block_m = num_warps, split_k, block_m
        self.tokens_per_expert_hint, self.n_experts_total = tokens_per_expert_hint, n_experts_total
        self.activation, self.layout = activation, layout
        self.device = torch.device(device)
        if self.device.type == "cuda":
            ok, why = available()
            if not ok:
                raise RuntimeError(why)

        tk = _import_triton_kernels()
        self._tk = tk
        mo = tk["mo"]
        dev = self.device
        self.w13, self.w13_scale = convert_weight(
            w13[sl].to(dev), w13_scales[sl].to(dev), num_warps=num_warps, interleave=True,
            chunk_experts=chunk_experts)
        self.w2, self.w2_scale = convert_weight(
            w2[sl].to(dev), w2_scales[sl].to(dev), num_warps=num_warps, interleave=False,
            chunk_experts=chunk_experts)
        flex = mo.FlexCtx(rhs_data=tk["InFlexData"]())
        self.pc13 = mo.PrecisionConfig(weight_scale=self.w13_scale, flex_ctx=flex)
        self.pc2 = mo.PrecisionConfig(weight_scale=self.w2_scale, flex_ctx=flex)
        self._swiglu_act = mo.FusedActivation(
            mo.FnSpecs("swiglu", tk["swiglu"].swiglu_fn, ("alpha", "limit")), (SWIGLU_ALPHA, SWIGLU_LIMIT), 2)
        self._swiglu_pc = tk["swiglu"].PrecisionConfig(limit=SWIGLU_LIMIT)
        self._constraints = {"split_k": split_k}
        if block_m is not None:
            self._constraints["block_m"] = block_m
        self.bytes_per_expert = expert_bytes(lat, inter)["total"]
        self.stored_bytes_per_expert = sum(
            t.storage.data.numel() * t.storage.data.element_size()
            for t in (self.w13, self.w13_scale, self.w2, self.w2_scale)) // count

    # -- helpers ------------------------------------------------------------------------

    def describe(self) -> dict:
        """The configuration, for a benchmark record."""
        return {"peer": "triton_kernels.matmul_ogs", "api": API_VERSION, "num_warps": self.num_warps,
                "split_k": self.split_k, "block_m": self.block_m,
                "tokens_per_expert_hint": self.tokens_per_expert_hint,
                "n_experts_total": self.n_experts_total, "activation": self.activation,
                "layout": self.layout, "first": self.first, "count": self.count, "latent": self.latent,
                "intermediate": self.intermediate, "bytes_per_expert": self.bytes_per_expert,
                "stored_bytes_per_expert": self.stored_bytes_per_expert}

    @contextlib.contextmanager
    def _constraints_scope(self):
        """Set this object's opt-flags constraints (a module global in triton_kernels) for the
        duration of a call, then restore the previous ones."""
        of = self._tk["opt_flags"]
        saved = dict(of._opt_flags_constraints)
        of.reset_opt_flags_constraints()
        of.update_opt_flags_constraints(self._constraints)
        try:
            yield
        finally:
            of.reset_opt_flags_constraints()
            of.update_opt_flags_constraints(saved)

    def _require_gpu(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        if self.device.type != "cuda":
            raise RuntimeError(f"TritonMoE was built on {self.device}; calls need an SM90 GPU "
                               "(build it with device='cuda')")
        if x.device != self.w13.device:
            raise ValueError(f"x is on {x.device}, the converted weights on {self.w13.device}")
        for name, t in (("ids", ids), ("weights", weights)):
            if t.device != x.device:
                raise ValueError(f"{name} is on {t.device}, x on {x.device}")

    def _hint(self, rows: int, top_k: int):
        h = self.tokens_per_expert_hint
        if h == "uniform":
            return max(1, rows * top_k // self.n_experts_total)
        return h

    def route(self, ids: torch.Tensor, weights: torch.Tensor, hint: int | None = None):
        """``(RoutingData, GatherIndx, ScatterIndx)`` for one call (device ops only);
        ``hint`` overrides the object's ``tokens_per_expert_hint`` rule."""
        tk = self._tk
        r, k = ids.shape
        lids = local_ids(ids, self.first, self.count)
        words = bitmatrix_words(lids, self.count)
        bm = tk["tensor"].Bitmatrix(words, shape=[r, words.shape[1] * 32], shape_max=[r, None],
                                    scratchpad=None)
        rd, gi, si = tk["routing"].routing_from_bitmatrix(
            bm, weights.to(torch.float32).contiguous(), lids, self.count, k)
        rd.expected_tokens_per_expt = self._hint(r, k) if hint is None else hint
        return rd, gi, si

    def compact_hint(self, rows: int, top_k: int, pairs: int | None) -> int | None:
        """The compact layout's ``tokens_per_expert_hint``: from the real local pair count
        ``pairs`` (:func:`pairs_hint`) when the object's rule is ``"uniform"`` (else the
        object's int or None); without ``pairs``, the uniform expectation over the ``rows``
        received rows (the owner rule, which equals ``pairs / count`` in expectation)."""
        h = self.tokens_per_expert_hint
        if h != "uniform":
            return h
        return pairs_hint(pairs, self.count) if pairs is not None else self._hint(rows, top_k)

    def opt_flags(self, rows: int, top_k: int = 16) -> dict:
        """The opt flags matmul_ogs will pick for FC1 and FC2 at ``rows`` tokens (GPU only)."""
        tk = self._tk
        of, mo = tk["opt_flags"], tk["mo"]
        rd = tk["routing"].RoutingData(None, None, self.count, top_k,
                                       expected_tokens_per_expt=self._hint(rows, top_k))
        m = rows * top_k
        fused = self.activation == "swiglu_fused"
        out = {}
        with self._constraints_scope():
            for name, w, pc, n, kk in (("fc1", self.w13, self.pc13, 2 * self.intermediate, self.latent),
                                       ("fc2", self.w2, self.pc2, self.latent, self.intermediate)):
                f = of.make_opt_flags(torch.bfloat16, torch.bfloat16, w.dtype, pc, m, n, kk, rd,
                                      False, False, None)
                out[name] = {k_: getattr(f, k_) for k_ in ("block_m", "block_n", "block_k", "num_warps",
                                                          "num_stages", "split_k", "is_persistent",
                                                          "fused_scatter")}
        out["fused_activation"] = fused
        return out

    # -- the call -----------------------------------------------------------------------

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *,
                 layout: str | None = None, capacity: int | None = None,
                 pairs: int | None = None) -> torch.Tensor:
        """Routing + FC1 + SwiGLU + FC2 + combine: BF16 ``[R, L]`` (the timed unit).

        ``x`` BF16 ``[R, L]`` contiguous, ``ids`` int32/int64 ``[R, K]`` global expert ids
        (distinct per row), ``weights`` FP32 ``[R, K]``; no validation inside (host syncs):
        run ``check_routing_inputs`` once outside the timed region.

        ``layout`` (default: the object's): ``"owner"`` routes all ``R`` rows;
        ``"compact"`` routes a static batch of ``capacity`` rows, those with a local pair
        (:func:`compact_rows`; ``capacity`` >= their count, a host int the caller knows, e.g.
        :func:`local_rows` outside the timed region; default ``R``), with the hint from
        ``pairs`` (the local pair count, a host int; :meth:`compact_hint`), and scatters
        the results back: rows without a local pair are zero. No host sync either way.
        """
        self._require_gpu(x, ids, weights)
        layout = self.layout if layout is None else layout
        if layout == "owner":
            return self._experts(x, ids, weights, None)
        if layout != "compact":
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        r, k = ids.shape
        cap = r if capacity is None else check_capacity(capacity)
        hint = self.compact_hint(r, k, pairs)
        return compact_forward(x, ids, weights, self.first, self.count, cap,
                               lambda xc, idc, wc: self._experts(xc, idc, wc, hint))

    def _experts(self, x, ids, weights, hint):
        mo = self._tk["mo"]
        rd, gi, si = self.route(ids, weights, hint)
        with self._constraints_scope():
            if self.activation == "swiglu_fused":
                h = mo.matmul_ogs(x, self.w13, None, rd, gather_indx=gi, precision_config=self.pc13,
                                  fused_activation=self._swiglu_act)
            else:
                h = mo.matmul_ogs(x, self.w13, None, rd, gather_indx=gi, precision_config=self.pc13)
                h = self._tk["swiglu"].swiglu(h, SWIGLU_ALPHA, self._swiglu_pc, rd)
            return mo.matmul_ogs(h, self.w2, None, rd, scatter_indx=si, precision_config=self.pc2,
                                 gammas=rd.gate_scal)

    def fc1_pairs(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """FC1 alone (no activation) per routed pair: float32 ``[R, K, 2I]`` in our ``[gate; up]``
        column order (the BF16 values matmul_ogs wrote), NaN rows for non-local pairs."""
        self._require_gpu(x, ids, weights)
        mo = self._tk["mo"]
        r, k = ids.shape
        rd, gi, _ = self.route(ids, weights)
        with self._constraints_scope():
            h = mo.matmul_ogs(x, self.w13, None, rd, gather_indx=gi, precision_config=self.pc13)
        src = gi.src_indx.long()  # gate position -> flat pair t*K + k, -1 past the local pairs
        out = torch.full((r * k, 2 * self.intermediate), float("nan"), dtype=torch.float32, device=x.device)
        ok = src >= 0
        out[src[ok]] = h[ok].float()
        return deinterleave_gate_up(out, dim=-1).view(r, k, 2 * self.intermediate)

    def bytes_streamed(self, ids: torch.Tensor) -> int:
        """Our MXFP4 weight bytes one call must read for ``ids`` (touched local experts x
        ``bytes_per_expert``; host sync)."""
        return touched_experts(ids, self.first, self.count) * self.bytes_per_expert


def check_int(value, name: str, lo: int = 0) -> int:
    """``value`` if it is an int (not a bool) ``>= lo``; else ValueError naming ``name``.
    The peers' argument checks use it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
    return value


def rank_weight_slice(weights, first: int, count: int, shard: tuple[int, int] = (0, 1)):
    """One rank's expert weights in our layout (the module docstring), from a
    ``model.weights.LatentMoEWeights``: experts ``[first, first + count)``, the ``shard =
    (rank, ranks)`` slice of their intermediate (the gate and up rows of the slice, the
    matching ``w2`` columns): contiguous ``(w13, w13_scales, w2, w2_scales)``, uint8
    ``[count, 2 I/ranks, L/2]``, ``[count, 2 I/ranks, L/32]``, ``[count, L, I/ranks/2]``,
    ``[count, L, I/ranks/32]``. Every peer's ``rank_moe`` starts from it."""
    c = weights.config
    inter = c.intermediate // shard[1]
    lo, full, sl = shard[0] * inter, c.intermediate, slice(first, first + count)
    w13 = torch.cat([weights.w13[sl, lo:lo + inter],
                     weights.w13[sl, full + lo:full + lo + inter]], 1).contiguous()
    s13 = torch.cat([weights.w13_scales[sl, lo:lo + inter],
                     weights.w13_scales[sl, full + lo:full + lo + inter]], 1).contiguous()
    w2 = weights.w2[sl, :, lo // 2:(lo + inter) // 2].contiguous()
    s2 = weights.w2_scales[sl, :, lo // MX_BLOCK:(lo + inter) // MX_BLOCK].contiguous()
    return w13, s13, w2, s2


def gated_activation64(h: torch.Tensor, activation: str, beta: float, linear_beta: float) -> torch.Tensor:
    """A peer's gated activation in float64 on our ``[gate; up]`` halves of ``h`` (``[...,
    2I]`` -> ``[..., I]``): ``"situ"``, ``beta tanh(g / beta) sigmoid(g) * linear_beta
    tanh(u / linear_beta)``, else SwiGLU ``silu(g) u``. The float64 models of the peers'
    checks use it."""
    inter = h.shape[-1] // 2
    g, u = h[..., :inter], h[..., inter:]
    if activation == "situ":
        return beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))
    return g * torch.sigmoid(g) * u


def rank_moes(weights, first: int, count: int, shard: tuple[int, int] = (0, 1), *,
              warps=(4, 8), device="cuda") -> tuple[dict, str]:
    """The peer over one rank's experts of a ``model.weights.LatentMoEWeights``: experts
    ``[first, first + count)``, the ``shard = (rank, ranks)`` slice of their intermediate
    (the gate and up rows of the slice, the matching ``w2`` columns), one ``TritonMoE`` per
    ``num_warps`` in ``warps``: ``({num_warps: TritonMoE}, "")``, or ``({}, why)`` where the
    peer cannot run here (:func:`available`)."""
    ok, why = available()
    if not ok:
        return {}, why
    c = weights.config
    w13, s13, w2, s2 = rank_weight_slice(weights, first, count, shard)
    return {nw: TritonMoE(w13, s13, w2, s2, first=0, count=count, n_experts_total=c.experts,
                          num_warps=nw, device=device) for nw in warps}, ""


# --------------------------------------------------------------------------------------
# GPU sanity checks (tiny problems) and smoke
# --------------------------------------------------------------------------------------

def random_weights(experts: int, latent: int, intermediate: int, *, device="cpu", seed: int = 0,
                   scale_lo: int = 124, scale_hi: int = 130) -> tuple[torch.Tensor, ...]:
    """Random MXFP4 weights in our format: uniform codes (every E2M1 value), E8M0 scales in
    ``[scale_lo, scale_hi]``. Returns ``(w13, w13_scales, w2, w2_scales)``."""
    g = torch.Generator(device=device).manual_seed(seed)
    u8 = dict(dtype=torch.uint8, device=device, generator=g)
    e, lat, i = experts, latent, intermediate
    return (torch.randint(0, 256, (e, 2 * i, lat // 2), **u8),
            torch.randint(scale_lo, scale_hi + 1, (e, 2 * i, lat // MX_BLOCK), **u8),
            torch.randint(0, 256, (e, lat, i // 2), **u8),
            torch.randint(scale_lo, scale_hi + 1, (e, lat, i // MX_BLOCK), **u8))


def random_routing(rows: int, top_k: int, experts: int, *, first: int = 0, count: int | None = None,
                   device="cpu", seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random top-k routing: ids int32 ``[rows, top_k]`` (distinct per row, uniform over
    ``experts``), FP32 weights summing to 1 per row. When at least ``top_k`` experts lie
    outside ``[first, first + count)``, row 0 is routed to non-local experts only (it must
    come out as a zero row)."""
    g = torch.Generator(device=device).manual_seed(seed + 1)
    ids = torch.rand(rows, experts, generator=g, device=device).topk(top_k, dim=1).indices.to(torch.int32)
    if count is not None:
        outside = [e for e in range(experts) if not first <= e < first + count]
        if len(outside) >= top_k and rows > 1:
            pick = torch.randperm(len(outside), generator=g, device=device)[:top_k]
            ids[0] = torch.tensor(outside, dtype=torch.int32, device=device)[pick]
    w = torch.rand(rows, top_k, generator=g, device=device, dtype=torch.float32) + 0.05
    return ids, w / w.sum(dim=1, keepdim=True)


def tiny_problem(experts, latent, intermediate, rows, top_k, first, count, seed, device):
    """The peers' small check problem: random MXFP4 weights of ``experts`` experts
    (``random_weights``), top-``top_k`` routing of ``rows`` rows with the local experts
    ``[first, first + count)`` (``random_routing``) and BF16 activations ``[rows, latent]``;
    returns ``(weights, x, ids, routing weights)``."""
    w = random_weights(experts, latent, intermediate, device=device, seed=seed)
    ids, rw = random_routing(rows, top_k, experts, first=first, count=count, device=device, seed=seed)
    g = torch.Generator(device=device).manual_seed(seed + 2)
    x = torch.randn(rows, latent, generator=g, device=device).to(torch.bfloat16)
    return w, x, ids, rw


def check_fc1(*, num_warps: int = 8, experts: int = 32, latent: int = 512, intermediate: int = 256,
              rows: int = 24, top_k: int = 16, first: int = 8, count: int | None = 12, seed: int = 0,
              device="cuda", raise_on_fail: bool = True, _impl=None) -> dict:
    """Tiny-problem check that the weight conversion and routing are right: the peer's FC1
    (no activation) per routed pair vs float64 ``x @ dequant(w13_e)^T`` from our format.

    Pass condition, every local pair and column: ``|peer - ref| <= 2^-7 |ref| + L 2^-20
    (|x| @ |w13_e|^T)``, twice the rigorous bound of an FP32 accumulation in any order
    (``gamma_L <= L 2^-23`` times ``|x| @ |w|``, with a factor-2 margin) rounded once to BF16
    (unit roundoff ``2^-8``), and exactly the local pairs present. A transposed, mis-interleaved or mis-swizzled weight, or
    a wrong gather, misses it by orders of magnitude (``rel_err`` ~ 1). Default: DEP-like
    subset (experts ``[8, 20)`` of 32 local, top-16).

    Returns:
        dict with ``ok``, ``max_ratio`` (max |err| / bound), ``rel_err`` (normwise),
        ``pairs`` (local pairs checked), ``config``.
    """
    cnt = experts - first if count is None else count
    w, x, ids, rw = tiny_problem(experts, latent, intermediate, rows, top_k, first, cnt, seed, device)
    moe = (_impl or TritonMoE)(*w, first=first, count=cnt, num_warps=num_warps, device=device)
    check_routing_inputs(x, ids, rw, latent=latent, n_experts_total=experts)
    got = moe.fc1_pairs(x, ids, rw)  # [R, K, 2I]
    if got.is_cuda:
        torch.cuda.synchronize()
    loc = (ids >= first) & (ids < first + cnt)
    rr, kk = loc.nonzero(as_tuple=True)
    ref, absdot = per_expert_float64(x.double()[rr], ids[rr, kk], w[0], w[1], lambda a, b: a @ b.T,
                              with_abs=True)
    peer = got[rr, kk].double()
    bound = 2.0 ** -7 * ref.abs() + latent * 2.0 ** -20 * absdot
    err = (peer - ref).abs()
    nonlocal_clean = bool(torch.isnan(got[~loc]).all())
    finite = bool(torch.isfinite(peer).all())
    ratio = float((err / bound.clamp_min(1e-300)).max()) if err.numel() else 0.0
    rel = float((peer - ref).norm() / ref.norm().clamp_min(1e-300)) if err.numel() else 0.0
    ok = finite and nonlocal_clean and bool((err <= bound).all())
    res = {"ok": ok, "max_ratio": ratio, "rel_err": rel, "pairs": int(rr.numel()),
           "nonlocal_pairs_absent": nonlocal_clean,
           "config": {"num_warps": num_warps, "experts": experts, "latent": latent,
                      "intermediate": intermediate, "rows": rows, "top_k": top_k, "first": first,
                      "count": cnt}}
    if raise_on_fail and not ok:
        raise AssertionError(f"triton peer FC1 check failed: {res}")
    return res


def per_expert_float64(rows: torch.Tensor, experts: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                fn, with_abs: bool = False):
    """``fn(rows[p], W_e)`` per pair ``p`` with ``W_e`` = expert ``experts[p]`` dequantized to
    float64 ``[N, K]`` from our format, grouped by expert; also ``|rows| @ |W_e|^T`` if
    ``with_abs``."""
    n = codes.shape[1]
    out = torch.empty(rows.shape[0], n, dtype=torch.float64, device=rows.device)
    absd = torch.empty_like(out) if with_abs else None
    for e in torch.unique(experts).tolist():
        sel = (experts == e).nonzero().reshape(-1)
        we = dequantize_mxfp4(codes[e], scales[e]).double()
        out[sel] = fn(rows[sel], we)
        if with_abs:
            absd[sel] = fn(rows[sel].abs(), we.abs())
    return (out, absd) if with_abs else out


def _swiglu_ref(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """triton_kernels' SwiGLU on ``[gate; up]`` halves, FP32 ops (``compute_swiglu``)."""
    i = h.shape[-1] // 2
    gate, lin = h[..., :i].float(), h[..., i:].float()
    gate = gate.clamp(max=limit)
    lin = lin.clamp(min=-limit, max=limit)
    s = gate / (1 + torch.exp(-alpha * gate))
    return s * lin + s


def check_forward(*, num_warps: int = 8, activation: str = "swiglu_fused", experts: int = 32,
                  latent: int = 512, intermediate: int = 256, rows: int = 24, top_k: int = 16,
                  first: int = 8, count: int | None = 12, seed: int = 0, device="cuda",
                  layout: str = "owner", raise_on_fail: bool = True, _impl=None) -> dict:
    """Tiny-problem check of a whole call (covers w2's conversion, gammas and the combine):
    the peer's BF16 ``[R, L]`` vs a PyTorch model of the same computation with the kernel's
    rounding points (FC1 exact -> FP32 -> SwiGLU in FP32 -> BF16 ``h``; FC2 exact x gamma ->
    BF16 per pair; FP32 sum over the row's local pairs -> BF16).

    Pass: each row's ``||peer - ref|| <= 2^-7 ||ref||`` (accumulation order and the odd
    flipped BF16 rounding of ``h``; a wrong weight or a wrong scatter gives ~1), and rows
    without a local pair exactly zero. ``layout="compact"`` calls with the capacity and pair
    count of the problem (:func:`local_rows`, :func:`local_pairs`, host ints computed
    before the call, as the benchmark does).
    """
    cnt = experts - first if count is None else count
    w, x, ids, rw = tiny_problem(experts, latent, intermediate, rows, top_k, first, cnt, seed, device)
    moe = (_impl or TritonMoE)(*w, first=first, count=cnt, num_warps=num_warps, activation=activation,
                               device=device)
    check_routing_inputs(x, ids, rw, latent=latent, n_experts_total=experts)
    if layout == "owner":
        y = moe(x, ids, rw)
    else:
        y = moe(x, ids, rw, layout=layout, capacity=max(1, local_rows(ids, first, cnt)),
                pairs=local_pairs(ids, first, cnt))
    if y.is_cuda:
        torch.cuda.synchronize()
    loc = (ids >= first) & (ids < first + cnt)
    rr, kk = loc.nonzero(as_tuple=True)
    e = ids[rr, kk]
    h = per_expert_float64(x.double()[rr], e, w[0], w[1], lambda a, b: a @ b.T).float()
    if activation == "swiglu_separate":
        h = h.to(torch.bfloat16)
    a = _swiglu_ref(h, SWIGLU_ALPHA, SWIGLU_LIMIT).to(torch.bfloat16).double()
    o = per_expert_float64(a, e, w[2], w[3], lambda a_, b: a_ @ b.T).float() * rw[rr, kk].unsqueeze(1)
    o = o.to(torch.bfloat16).float()
    ref = torch.zeros(rows, latent, dtype=torch.float32, device=x.device).index_add_(0, rr, o)
    ref = ref.to(torch.bfloat16).double()
    yd = y.double()
    has = loc.any(dim=1)
    row_err = (yd - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-300)
    worst = float(row_err[has].max()) if bool(has.any()) else 0.0
    zero_rows_ok = bool((y[~has] == 0).all())
    ok = (tuple(y.shape) == (rows, latent) and y.dtype == torch.bfloat16 and bool(torch.isfinite(yd).all())
          and worst <= 2.0 ** -7 and zero_rows_ok)
    res = {"ok": ok, "worst_row_rel_err": worst, "rows_without_local_pair": int((~has).sum()),
           "zero_rows_ok": zero_rows_ok,
           "config": {"num_warps": num_warps, "activation": activation, "layout": layout, "experts": experts,
                      "latent": latent, "intermediate": intermediate, "rows": rows, "top_k": top_k,
                      "first": first, "count": cnt}}
    if raise_on_fail and not ok:
        raise AssertionError(f"triton peer forward check failed: {res}")
    return res


def smoke(device="cuda") -> dict:
    """GPU smoke test: the checks (num_warps 4 and 8; DEP subset and all experts; both
    activations), then one real-dimension DEP16-rank call (56 of 896 experts, I = 3072,
    T = 4 -> R = 64 rows) and one TP8-rank call (896 experts, I_s = 384, 256 rows): eager,
    CUDA-graph capture + replay (bitwise equal to eager), and a rough event timing (warm
    L2, not the benchmark)."""
    ok, why = available()
    if not ok:
        raise RuntimeError(why)
    out = {"versions": versions(), "checks": []}
    for nw in (4, 8):
        out["checks"].append(check_fc1(num_warps=nw))
        out["checks"].append(check_fc1(num_warps=nw, first=0, count=None))
        for act in ACTIVATIONS:
            out["checks"].append(check_forward(num_warps=nw, activation=act))
        out["checks"].append(check_forward(num_warps=nw, first=0, count=None))
        out["checks"].append(check_forward(num_warps=nw, layout="compact"))
    cases = (("dep16_T4", dict(experts=56, first=5 * 56, n_total=896, inter=3072, rows=64)),
             ("tp8_R256", dict(experts=896, first=0, n_total=896, inter=384, rows=256)))
    out["real"] = {}
    for name, c in cases:
        w = random_weights(c["experts"], 3584, c["inter"], device=device, seed=1)
        g = torch.Generator(device=device).manual_seed(7)
        ids = torch.rand(c["rows"], c["n_total"], generator=g, device=device).topk(16, dim=1).indices.int()
        rw = torch.rand(c["rows"], 16, generator=g, device=device)
        x = torch.randn(c["rows"], 3584, generator=g, device=device).to(torch.bfloat16)
        for nw in (4, 8):
            moe = TritonMoE(*w, first=c["first"], count=c["experts"], num_warps=nw,
                            n_experts_total=c["n_total"], device=device)
            check_routing_inputs(x, ids, rw, latent=3584, n_experts_total=c["n_total"])
            eager = moe(x, ids, rw)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                moe(x, ids, rw)  # warm-up on the capture stream
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = moe(x, ids, rw)
            graph.replay()
            torch.cuda.synchronize()
            same = bool(torch.equal(static_out, eager))
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            for _ in range(20):
                graph.replay()
            t1.record()
            torch.cuda.synchronize()
            us = t0.elapsed_time(t1) * 1e3 / 20
            nbytes = moe.bytes_streamed(ids)
            out["real"][f"{name}_nw{nw}"] = {
                "graph_equals_eager": same, "warm_l2_us": round(us, 1), "bytes_streamed": nbytes,
                "warm_l2_GBps": round(nbytes / us / 1e3, 1), "opt_flags": moe.opt_flags(c["rows"]),
                "describe": moe.describe()}
            del moe, graph, static_out, eager
            torch.cuda.empty_cache()
        del w
    out["ok"] = all(c["ok"] for c in out["checks"]) and all(
        v["graph_equals_eager"] for v in out["real"].values())
    return out


if __name__ == "__main__":
    res = smoke()
    print(json.dumps(res, indent=1, default=str))
    sys.exit(0 if res["ok"] else 1)
