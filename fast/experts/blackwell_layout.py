"""The prepared weight layout of the Blackwell block-scaled experts kernel
(``fast.experts.blackwell``), and what the installed CuTe DSL offers for it.

Pure PyTorch (the DSL is imported only by ``blackwell_dsl_error``), so the layout is
tested on the CPU (``tests/test_experts_blackwell.py``).

The tensor cores read the checkpoint's MXFP4 weights as they are: packed E2M1 codes
(element ``2i`` in the low nibble), K-major, and E8M0 scales per 32 k in the 128x4 tiled
layout of the tcgen05 scale-factor atom (``model.swizzle.swizzle_scales_128x4``: 512-byte
chunks of 128 rows x 4 scales, ``(row % 32) * 16 + (row % 128 // 32) * 4 + col % 4``
inside a chunk, chunks k-major then row-major). The one rearrangement is FC1's row order
(``fc1_row_order``): a 128-row tile holds 64 whole intermediate columns (two MXFP8
blocks), each 32-row group 16 gate rows followed by the same 16 columns' up rows, so that
the epilogue thread that reads a gate row from tensor memory and the thread 16 lanes away
that reads its up row are in one warp.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from fast.experts.layout import ExpertTensors, Geometry, check_selection
from model.swizzle import swizzle_scales_128x4
from model.weights import LatentMoEWeights

__all__ = [
    "TILE_ROWS",
    "K_STAGE",
    "ARCHS",
    "BlackwellExperts",
    "prepare_blackwell_experts",
    "fc1_row_order",
    "b_smem_offset",
    "sfb_smem_offset",
    "blackwell_dsl_error",
]

#: Weight rows per work item: the MMA's M (``cta_group::1``).
TILE_ROWS = 128
#: k per pipeline stage: 4 block-scaled MMAs of K = 32 (one 128x4 scale-factor chunk).
K_STAGE = 128
#: The targets with ``tcgen05`` block-scaled MMA of kind ``mxf8f6f4``.
ARCHS = ("sm_100a", "sm_103a")


def fc1_row_order(inter: int) -> torch.Tensor:
    """int64 ``[2 I_s]``: the ``[gate; up]`` row (of the rank's slice) each prepared FC1 row
    holds. Row ``r = 128 t + 32 w + i`` is gate column ``c = 64 t + 16 w + i % 16`` for
    ``i < 16`` and up column ``c`` (row ``I_s + c``) for ``i >= 16``."""
    if inter % 64:
        raise ValueError(f"fc1_row_order: I_s must be a multiple of 64, got {inter}")
    r = torch.arange(2 * inter)
    t, w, i = r // 128, (r % 128) // 32, r % 32
    column = 64 * t + 16 * w + i % 16
    return torch.where(i < 16, column, inter + column)


def b_smem_offset(n, j, tokens: int):
    """Byte offset, in the kernel's whole-K B operand, of token ``n``'s 16-byte granule
    ``j`` (E4M3 k ``16 j .. 16 j + 15``), ``tokens`` = the MMA's N: the K-major layout with
    the 128-byte swizzle that ``make_smem_layout_b`` gives an 8-bit B of ``N x 128`` per k
    stage (``S<3,4,3> o ((N,32),1,4,stages):((128,1),0,32,N*128)``): row n at ``128 n``, the
    granule's 16-byte chunk XOR ``n % 8``. Works on ints and on DSL integers (the kernel's
    gather calls it); ``tests/test_experts_blackwell.py`` checks it against the DSL's layout."""
    return (j // 8) * (tokens * 128) + n * 128 + (((j % 8) ^ (n % 8)) * 16)


def sfb_smem_offset(n, kt):
    """Byte offset of token ``n``'s 4 scale bytes of k stage ``kt`` (k blocks ``4 kt ..
    4 kt + 3``, consecutive) in the B scale-factor operand: one 128x4 chunk per stage
    (``make_smem_layout_sfb``), ``(n % 32) * 16 + (n // 32) * 4`` inside it."""
    return kt * 512 + (n % 32) * 16 + (n // 32) * 4


@dataclasses.dataclass
class BlackwellExperts(ExpertTensors):
    """One rank's experts in the block-scaled kernel's layout, on one device.

    Attributes:
        config, geometry: as ``fast.experts.PreparedExperts``.
        w13: uint8 ``[E_loc, 2 I_s, L/2]`` packed E2M1 codes, rows in ``fc1_row_order``.
        s13: uint8 ``[E_loc, 2 I_s * L/32]`` their E8M0 scales, each expert's ``[2 I_s,
            L/32]`` matrix (same row order) in the 128x4 tiled layout.
        w2: uint8 ``[E_loc, L, I_s/2]`` packed E2M1 codes of the rank's columns of ``w2``.
        s2: uint8 ``[E_loc, L * I_s/32]`` their scales, 128x4 tiled per expert.
    """


def prepare_blackwell_experts(weights: LatentMoEWeights, device=None, *,
                              experts: tuple[int, int] | None = None,
                              shard: tuple[int, int] = (0, 1)) -> BlackwellExperts:
    """One rank's experts (``experts=(first, count)``, ``shard=(rank, ranks)`` as in
    ``fast.experts.prepare_experts``) in the block-scaled layout (module docstring).

    Raises ValueError for widths the kernel does not tile (``L % 128``, ``I_s % 128``: FC2's
    K stage is 128 k; kimi_k3 has I_s 3072, 1536, 768, 384 at 1, 2, 4, 8 ranks) or a bad
    expert range or shard. Every E8M0 code is accepted: the tensor cores apply the scales,
    so there is no decode range (unlike ``fast.experts.layout.MAX_SCALE_CODE``)."""
    first, count, rank, inter = check_selection("prepare_blackwell_experts", weights, experts,
                                                shard)
    c = weights.config
    if c.latent % K_STAGE or inter % K_STAGE:
        raise ValueError(f"prepare_blackwell_experts: the block-scaled kernel tiles L % 128 == 0 "
                         f"and I/ranks % 128 == 0, got L={c.latent}, I/ranks={inter}")
    device = torch.device(device) if device is not None else weights.device
    lo, i = rank * inter, c.intermediate
    order = fc1_row_order(inter)
    rows = torch.where(order < inter, lo + order, i + lo + order - inter).to(weights.device)
    parts = [[], [], [], []]
    for e in range(first, first + count):  # one expert at a time: bounded temporaries
        w13 = weights.w13[e].index_select(0, rows).to(device)
        s13 = weights.w13_scales[e].index_select(0, rows).to(device)
        w2 = weights.w2[e, :, lo // 2:(lo + inter) // 2].to(device)
        s2 = weights.w2_scales[e, :, lo // 32:(lo + inter) // 32].to(device)
        for part, t in zip(parts, (w13, swizzle_scales_128x4(s13.contiguous()), w2,
                                   swizzle_scales_128x4(s2.contiguous()))):
            part.append(t.contiguous())
    w13, s13, w2, s2 = (torch.stack(part) for part in parts)
    geometry = Geometry(latent=c.latent, inter=inter, first=first, count=count,
                        shard=tuple(shard))
    return BlackwellExperts(config=c, geometry=geometry, w13=w13, s13=s13, w2=w2, s2=s2)


@functools.cache
def blackwell_dsl_error() -> str | None:
    """None when the installed CuTe DSL has what ``fast.experts.blackwell`` uses, else why
    not (a test's skip reason): ``tcgen05.MmaMXF8F6F4Op`` with separate A and B element
    types (E2M1 x E4M3 in one ``kind::mxf8f6f4`` MMA) and the TMA atom's ``internal_type``
    (the packed FP4 codes unpacked to one per byte in shared memory)."""
    try:
        import importlib
        import inspect

        from cutlass.cute.nvgpu import make_tiled_tma_atom_A, tcgen05

        memory = importlib.import_module("cutlass.memory")
        for name in ("SmemAllocator", "TmemAllocator"):
            getattr(memory, name)
        for module in ("cutlass.utils.blockscaled_layout", "cutlass.utils.blackwell_helpers",
                       "cutlass.pipeline"):
            importlib.import_module(module)
    except Exception as error:  # the reason is reported, never swallowed silently
        return f"CuTe DSL lacks the Blackwell block-scaled API: {type(error).__name__}: {error}"
    if "a_dtype" not in inspect.signature(tcgen05.MmaMXF8F6F4Op.__init__).parameters:
        return ("CuTe DSL's tcgen05.MmaMXF8F6F4Op takes one element type for A and B; mixed "
                "E2M1 x E4M3 needs an nvidia-cutlass-dsl with separate a_dtype / b_dtype")
    if "internal_type" not in inspect.signature(make_tiled_tma_atom_A).parameters:
        return "CuTe DSL's make_tiled_tma_atom_A has no internal_type (unpacked FP4 TMA)"
    return None
