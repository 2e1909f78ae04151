"""The engine's prepared weight layout: MXFP4 experts rearranged once so that each lane of a
warp loads its tensor-core operands with one 16-byte load and decodes them to BF16 with a
few integer instructions.

Pure PyTorch (no CuTe DSL): ``prepare_experts`` runs on any device, and
``decode_tiles`` replays the kernels' decode instruction by instruction, so the layout is
tested on the CPU (``tests/test_experts_layout.py``) before any kernel reads it.

**The A operand.** Both GEMMs of an expert put the weights on the M side of
``mma.sync.m16n8k16`` (M = 16 weight rows, N = 8 tokens, K = 16). An *m-tile* is 16 weight
rows; row ``i`` of m-tile ``m`` is

* FC1: ``gate[8m + i]`` for ``i < 8``, ``up[8m + i - 8]`` for ``i >= 8`` (the lane that holds
  gate column ``j`` also holds up column ``j``: SiTU needs no exchange);
* FC2: ``w2[16m + i]``.

A *chunk* is 64 consecutive k. Lane ``l = 4g + q`` of a warp handles rows ``r0 = g`` and
``r1 = g + 8`` of the m-tile and the 16 k ``[64c + 16q, 64c + 16q + 16)`` of chunk ``c``.
Over the four MMA steps ``j = 0..3`` of a chunk the MMA's logical k ``{2q, 2q+1, 2q+8,
2q+9}`` of step j are the physical k ``16q + 4j + {0, 1, 2, 3}``: one consistent
permutation of k applied to weights and activations alike (a dot product does not
depend on the order its terms are named in; the hardware's summation order is covered by
the FC1/FC2 bounds of ``verify/test_experts.py``, the tensor-core model of
``verify.bounds``).

Prepared bytes of one expert, ``[M-tiles, chunks, 32 lanes, 16 bytes]``; a lane's 16 bytes
are four little-endian words: ``r0`` k 0-7, ``r0`` k 8-15, ``r1`` k 0-7, ``r1`` k 8-15 (k
relative to the lane's 16). A word holds four *pairs* (k ``2p``, ``2p + 1``), each of which
becomes one BF16x2 register of the A fragment.

**Decode.** An E2M1 code ``s e1 e0 m`` placed at BF16 bits 15 (sign), 8-7 (the low two
exponent bits) and 6 (the top mantissa bit) is a BF16 number equal to the code's value
times ``2^-126`` (codes with ``e = 0`` become BF16 subnormals: ``0`` and ``2^-127``). A word
is decoded into its four BF16x2 registers by

    pair 0 = w & M                      M = 0x81C081C0 (sign, e1, e0, m of both halves)
    pair 1 = rotr(w, 3) & M
    pair 2 = rotr(w, 6) & M
    pair 3 = ((w & 0x001B001B) * 0x1084) & M

(the bit positions of ``WORD_BITS`` make each of these exact; the product's three partial
products never overlap in a kept bit), then each register is multiplied (``mul.rn.bf16x2``)
by ``2^(scale - 1)``: the ``2^126`` of the placement and the block scale ``2^(scale-127)``
in one exact power-of-two product.

**Exactness range.** The product is exact whenever it is a BF16 number: the factor
``2^(scale-1)`` is a normal BF16 for E8M0 codes ``0..128`` (larger codes overflow it), and
every decoded value ``v * 2^(scale-127)`` (``|v|`` in ``{0.5, ..., 6}``, at most two
significant bits) is a normal BF16 for codes ``>= 2`` and an exact BF16 subnormal below.
``prepare_experts`` therefore rejects any scale code above ``MAX_SCALE_CODE = 128``
(weights of magnitude above ``6 * 2 = 12`` in a block; a trained checkpoint's experts are
far below) with an error naming the tensor, expert, row and block. Codes 0 and 1 rely on
the GPU keeping BF16 subnormals in ``mul.rn.bf16x2`` and in the MMA; ``verify`` checks the
whole range 0..128 on the device.

**Scales.** A *stage* is ``chunks_per_stage`` (1 or 2) chunks; per (m-tile, stage) the
lanes ``4g + 2h + p`` (h, p in {0, 1}) need the scale bytes ``X = [s(r0, b_c), s(r1, b_c)
for each chunk c of the stage]`` with ``b_c = 2c + h`` (lane q's 16 k lie in block
``2c + q // 2``). Lane ``p = 0`` stores the first half of X and ``p = 1`` the second; one
load at the even lane's bytes gives both lanes X whole (the two halves are adjacent, the
low one first), so no byte is stored twice and no shuffle is needed. Prepared scale
bytes: ``[M-tiles, stages, 32 lanes, chunks_per_stage]``.
"""

from __future__ import annotations

import dataclasses

import torch

from model.config import LatentMoEConfig
from model.weights import LatentMoEWeights

__all__ = [
    "MAX_SCALE_CODE",
    "WORD_BITS",
    "DECODE_MASK",
    "PAIR3_GATHER",
    "PAIR3_MULTIPLIER",
    "Geometry",
    "ExpertTensors",
    "check_selection",
    "PreparedExperts",
    "prepare_experts",
    "pack_tiles",
    "decode_tiles",
    "chunks_per_stage",
    "stages_of",
    "mma_physical_k",
    "b_offset_mma",
    "b_offset_wgmma",
    "WGMMA_WORD_STRIDE",
    "wgmma_b_descriptor",
    "wgmma_b_reads",
]

#: Largest E8M0 scale code the decode keeps exact (the factor 2^(code-1) must be a BF16).
MAX_SCALE_CODE = 128
#: Bit positions (sign, e1, e0, m) of the low and the high code of pair p in a word.
WORD_BITS = (
    ((15, 8, 7, 6), (31, 24, 23, 22)),
    ((18, 11, 10, 9), (2, 27, 26, 25)),
    ((21, 14, 13, 12), (5, 30, 29, 28)),
    ((3, 1, 0, 4), (19, 17, 16, 20)),
)
DECODE_MASK = 0x81C081C0
PAIR3_GATHER = 0x001B001B
PAIR3_MULTIPLIER = 0x1084  # partial products << 2, << 7, << 12
CHUNK = 64  # k per chunk
TILE_ROWS = 16  # weight rows per m-tile


#: Tokens per window (the N of one ``mma.m16n8k16``).
WINDOW = 8


def mma_physical_k(j: int, k: int) -> int:
    """The engine's k permutation: logical k ``k`` (0..15) of MMA step ``j`` (0..3) of a
    chunk is chunk k ``16 q + 4 j + 2 h + e`` for ``k = 8 h + 2 q + e``. The prepared
    weights are decoded into this order (lane ``q``'s 16 bytes hold chunk k ``16 q ..
    16 q + 15`` of its rows: one 32-k scale block per lane) and the ``mma.sync`` B
    fragments are the lane's 16-byte token pieces read in the same order, so each MMA adds
    products of matching k (a dot product does not depend on the names of its terms)."""
    h, rest = divmod(k, 8)
    q, e = divmod(rest, 2)
    return 16 * q + 4 * j + 2 * h + e


def b_offset_mma(window, n, cc, kk, stage_chunks: int):
    """Byte offset in a ring slot of token ``n`` of ``window``'s 16-byte piece ``kk`` (chunk
    k ``8 kk .. 8 kk + 7``) of chunk ``cc``, for ``mma.sync``: in each (window, chunk, piece
    parity) block of 512 bytes, lane ``4 n + kk // 2``'s B fragment words in lane order
    (one 16-byte shared load per lane). Takes plain ints or the kernel's ``Int32`` values."""
    return (((window * stage_chunks + cc) * 2 + kk % 2) * 32 + 4 * n + kk // 2) * 16


#: For ``wgmma`` a 16-byte token piece is copied as four 4-byte words, word ``m`` at
#: ``b_offset_wgmma(...) + m * WGMMA_WORD_STRIDE``.
WGMMA_WORD_STRIDE = 128


def b_offset_wgmma(window, n, cc, kk, stage_chunks: int):
    """The same piece for ``wgmma``, whose B the tensor cores read from K-major core
    matrices (8 tokens x 16 bytes of 8 *logical* k): the slot holds one core matrix per
    (window, chunk, MMA step j, half h) at ``(((window SC + cc) 4 + j) 2 + h) 128``, and
    word ``m`` (chunk k ``8 kk + 2 m``, ``+1``) of the piece is, by ``mma_physical_k``,
    logical k ``8 h + 2 q + e`` of step ``j = 2 (kk % 2) + m // 2`` with ``h = m % 2``,
    ``q = kk // 2``: row ``n``, bytes ``4 q`` of core matrix ``... + m``. Returns word 0's
    offset; word m is ``WGMMA_WORD_STRIDE * m`` further."""
    return ((window * stage_chunks + cc) * 8 + 4 * (kk % 2)) * 128 + n * 16 + (kk // 2) * 4


def wgmma_b_descriptor(cc: int, j: int, stage_chunks: int):
    """(start offset in the slot, leading, stride) of the B descriptor of MMA step ``j``
    (16 logical k) of chunk ``cc``: core matrix (window 0, chunk cc, step j, half 0); 128
    bytes to half 1 (the next 8 logical k); one window (``stage_chunks * 8`` core
    matrices) to the next 8 tokens."""
    return (cc * 8 + 2 * j) * 128, 128, stage_chunks * 8 * 128


def wgmma_b_reads(start: int, leading: int, stride: int, n: int, k: int) -> int:
    """Byte offset the tensor cores read for element (token ``n``, logical k ``k`` in
    0..15) of a K-major no-swizzle B operand described by (start, leading, stride): core
    matrix ``(n // 8, k // 8)`` at ``start + (n // 8) stride + (k // 8) leading``, its row
    ``n % 8`` at 16 bytes per row, the element at 2 bytes (the PTX ISA's canonical
    layout)."""
    return start + (n // 8) * stride + (k // 8) * leading + (n % 8) * 16 + (k % 8) * 2


def chunks_per_stage(k: int) -> int:
    """Chunks of 64 k per pipeline stage for a GEMM of depth ``k``: 2 when ``k % 128 == 0``,
    else 1 (``k % 64 == 0`` is required)."""
    if k % CHUNK:
        raise ValueError(f"the experts engine needs K % 64 == 0, got K={k}")
    return 2 if k % (2 * CHUNK) == 0 else 1


def stages_of(k: int) -> int:
    """Pipeline stages of a GEMM of depth ``k`` (``chunks_per_stage`` chunks each)."""
    return k // CHUNK // chunks_per_stage(k)


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Widths of one rank's engine.

    Attributes:
        latent: L (FC1's K, FC2's rows).
        inter: this rank's intermediate slice I_s = I / ranks (FC1's rows are 2 I_s, FC2's K).
        first: first local expert; count: local experts (``[first, first + count)``).
        shard: ``(rank, ranks)`` of the intermediate (``(0, 1)``: the whole expert).
    """

    latent: int
    inter: int
    first: int
    count: int
    shard: tuple[int, int]

    @property
    def fc1(self) -> tuple[int, int]:
        """(rows, K) of FC1: ``(2 I_s, L)``."""
        return 2 * self.inter, self.latent

    @property
    def fc2(self) -> tuple[int, int]:
        """(rows, K) of FC2: ``(L, I_s)``."""
        return self.latent, self.inter


@dataclasses.dataclass
class ExpertTensors:
    """One rank's experts on one device, as some kernel lays them out: the config, the
    geometry and the four tensors the kernels stream (FC1 and FC2 codes and scales)."""

    config: LatentMoEConfig
    geometry: Geometry
    w13: torch.Tensor
    s13: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.w13.device

    @property
    def nbytes(self) -> int:
        """Bytes the kernels stream for all local experts (codes and scales)."""
        return sum(t.numel() for t in (self.w13, self.s13, self.w2, self.s2))

    def expert_bytes(self) -> int:
        """Bytes one expert streams (codes and scales of FC1 and FC2)."""
        return self.nbytes // self.geometry.count


@dataclasses.dataclass
class PreparedExperts(ExpertTensors):
    """One rank's experts in the engine's layout (module docstring), on one device.

    Attributes:
        config: the layer config.
        geometry: widths, local experts and shard.
        w13, s13: FC1 codes ``uint8 [E_loc, I_s/8, L/64, 32, 16]`` and scales
            ``uint8 [E_loc, I_s/8, L/(64 c1), 32, c1]`` (c1 = chunks per stage of L).
        w2, s2: FC2 codes ``uint8 [E_loc, L/16, I_s/64, 32, 16]`` and scales
            ``uint8 [E_loc, L/16, I_s/(64 c2), 32, c2]``.
    """


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] two E2M1 codes per byte (element 2i low) -> uint8 [..., K] codes."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def _as_int32(bits: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) -> int32 with the same 32 bits."""
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)


def _encode_words(codes: torch.Tensor) -> torch.Tensor:
    """[..., 8] E2M1 codes (pairs (0,1), (2,3), (4,5), (6,7)) -> int64 [...] words."""
    word = torch.zeros(codes.shape[:-1], dtype=torch.int64, device=codes.device)
    c = codes.to(torch.int64)
    for pair, halves in enumerate(WORD_BITS):
        for half, positions in enumerate(halves):
            code = c[..., 2 * pair + half]
            for bit, position in zip((3, 2, 1, 0), positions):
                word |= ((code >> bit) & 1) << position
    return word


def pack_tiles(codes: torch.Tensor, scales: torch.Tensor, stage_chunks: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The prepared layout of A matrices given as codes and scales in m-tile row order.

    Args:
        codes: uint8 ``[E, R, K]`` E2M1 codes (0..15), R a multiple of 16 (row ``16m + i``
            is row i of m-tile m), K a multiple of ``64 * stage_chunks``.
        scales: uint8 ``[E, R, K/32]`` E8M0 codes.
        stage_chunks: chunks per stage (1 or 2).

    Returns:
        ``(tiles uint8 [E, R/16, K/64, 32, 16], tile_scales uint8 [E, R/16, K/(64 s), 32,
        s])`` (module docstring).
    """
    e, r, k = codes.shape
    m, c = r // TILE_ROWS, k // CHUNK
    # [E, M, half, g, C, q, 16] -> [E, M, C, g, q, half, 16]
    t = codes.reshape(e, m, 2, 8, c, 4, 16).permute(0, 1, 4, 3, 5, 2, 6)
    words = _encode_words(t.reshape(*t.shape[:-1], 2, 8))  # [E, M, C, g, q, half, 2]
    words = _as_int32(words.reshape(e, m, c, 32, 4))
    tiles = words.view(torch.uint8).reshape(e, m, c, 32, 16)
    s, stages = stage_chunks, c // stage_chunks
    # [E, M, half, g, C, h] -> [E, M, g, h, stages, s, half] -> X (2s bytes: c major)
    x = scales.reshape(e, m, 2, 8, c, 2).permute(0, 1, 3, 5, 4, 2)
    x = x.reshape(e, m, 8, 2, stages, 2 * s)
    x = x.reshape(e, m, 8, 2, stages, 2, s)  # the two halves of X: lane p stores half p
    tile_scales = x.permute(0, 1, 4, 2, 3, 5, 6).reshape(e, m, stages, 32, s)
    return tiles.contiguous(), tile_scales.contiguous()


def decode_tiles(tiles: torch.Tensor, tile_scales: torch.Tensor) -> torch.Tensor:
    """The kernels' decode replayed with integer and float32 tensor ops (CPU or GPU): the
    float32 values ``[E, R, K]`` a warp's A fragments hold, in the original row and k order.
    Used by the tests to prove the layout and the decode are exact; the kernels do the
    same instructions in registers."""
    e, m, c = tiles.shape[:3]
    stages, s = tile_scales.shape[2], tile_scales.shape[4]
    words = tiles.reshape(e, m, c, 32, 4, 4).flatten(-2).view(torch.int32).to(torch.int64)
    words &= 0xFFFFFFFF  # [E, M, C, lane, 4]

    def rotr(w, n):
        return ((w >> n) | (w << (32 - n))) & 0xFFFFFFFF

    pairs = torch.stack([
        words & DECODE_MASK,
        rotr(words, 3) & DECODE_MASK,
        rotr(words, 6) & DECODE_MASK,
        (((words & PAIR3_GATHER) * PAIR3_MULTIPLIER) & 0xFFFFFFFF) & DECODE_MASK,
    ], dim=-1)  # [E, M, C, lane, word, pair]
    halves = torch.stack((pairs & 0xFFFF, pairs >> 16), dim=-1)  # BF16 bit patterns
    placed = _as_int32(halves << 16).view(torch.float32)  # value * 2^-126
    # scale bytes back to X per lane: lane p holds half p of X
    x = tile_scales.reshape(e, m, stages, 8, 2, 2, s)  # [.., g, h, p, s]
    x = x.reshape(e, m, stages, 8, 2, 2 * s)  # X over (p, s) = chunk-major (c, half)
    x = x.reshape(e, m, stages, 8, 2, s, 2).to(torch.int64)  # [.., g, h, chunk, row-half]
    # the factor 2^(code - 1) as float32 (exact for codes 0..254)
    factor = torch.pow(2.0, (x - 1).double()).float()
    # per lane (g, q = 2h + p) and chunk: factor of r0 and r1
    factor = factor.permute(0, 1, 2, 5, 3, 4, 6)  # [E, M, stages, chunk, g, h, half]
    factor = factor.reshape(e, m, c, 8, 2, 1, 2).expand(e, m, c, 8, 2, 2, 2)
    factor = factor.reshape(e, m, c, 32, 2)  # [.., lane, half(r0/r1)]
    # words 0, 1 are r0 and words 2, 3 are r1
    factor = factor[..., [0, 0, 1, 1]]  # [E, M, C, lane, word]
    values = placed.double() * factor.double()[..., None, None]
    values = values.float()  # exact: the tests compare with the dequantized checkpoint
    # [E, M, C, g, q, half, word-in-half, pair, lo/hi] -> [E, M, half, g, C, q, 16]
    values = values.reshape(e, m, c, 8, 4, 2, 2, 4, 2)
    values = values.permute(0, 1, 5, 3, 2, 4, 6, 7, 8).reshape(e, m, 2, 8, c, 4, 16)
    return values.reshape(e, m * TILE_ROWS, c * CHUNK)


def _check_scales(scales: torch.Tensor, name: str, first: int, row0: int = 0,
                  block0: int = 0) -> None:
    """Raise if a scale code is above ``MAX_SCALE_CODE`` (index in the checkpoint tensor)."""
    bad = scales > MAX_SCALE_CODE
    if bool(bad.any()):
        e, r, b = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"prepare_experts: {name}[{first + e}, {row0 + r}, {block0 + b}] = "
            f"{int(scales[e, r, b])}: the engine decodes exactly only E8M0 scale codes "
            f"0..{MAX_SCALE_CODE} (block values up to 12); this checkpoint's block is larger"
        )


def check_selection(who: str, weights, experts, shard) -> tuple[int, int, int, int]:
    """A preparation's arguments, refused by name: ``weights`` a ``LatentMoEWeights``,
    ``experts`` ``(first, count)`` inside ``[0, E)`` (None: every expert), ``shard``
    ``(rank, ranks)`` with ``ranks`` dividing I. Returns ``(first, count, rank, I/ranks)``."""
    if not isinstance(weights, LatentMoEWeights):
        raise TypeError(f"{who}: weights must be LatentMoEWeights, got {type(weights).__name__}")
    c = weights.config
    first, count = experts if experts is not None else (0, c.experts)
    if not (isinstance(first, int) and isinstance(count, int) and count >= 1
            and 0 <= first and first + count <= c.experts):
        raise ValueError(f"{who}: experts must be (first, count) inside [0, {c.experts}), "
                         f"got {experts!r}")
    rank, ranks = shard
    if not (isinstance(rank, int) and isinstance(ranks, int) and 0 <= rank < ranks
            and c.intermediate % ranks == 0):
        raise ValueError(f"{who}: shard must be (rank, ranks) with ranks dividing "
                         f"I={c.intermediate}, got {shard!r}")
    return first, count, rank, c.intermediate // ranks


def prepare_experts(weights: LatentMoEWeights, device=None, *,
                    experts: tuple[int, int] | None = None,
                    shard: tuple[int, int] = (0, 1)) -> PreparedExperts:
    """Rearrange one rank's MXFP4 experts into the engine's layout (module docstring).

    Args:
        weights: the layer's weights (``w13 [E, 2I, L/2]`` ``[gate; up]`` rows, ``w2 [E, L,
            I/2]``, and their E8M0 scales), on any device.
        device: where the prepared tensors live (default: the weights' device).
        experts: ``(first, count)`` local experts (DEP owner: ``(rank * E/N, E/N)``);
            default all.
        shard: ``(rank, ranks)``: this rank's slice ``[rank I/ranks, (rank + 1) I/ranks)``
            of the intermediate (the wide layer's TP slice); default the whole expert.

    Returns:
        PreparedExperts. Raises ValueError for widths the engine does not tile
        (``L % 128``, ``I_s % 64``), a bad expert range or shard, or a scale code above
        ``MAX_SCALE_CODE``.
    """
    first, count, rank, inter = check_selection("prepare_experts", weights, experts, shard)
    c = weights.config
    if c.latent % 128 or inter % 64:
        raise ValueError(f"prepare_experts: the engine tiles L % 128 == 0 and I/ranks % 64 == 0, "
                         f"got L={c.latent}, I/ranks={inter}")
    device = torch.device(device) if device is not None else weights.device
    lo = rank * inter
    i = c.intermediate
    _check_scales(weights.w13_scales[first:first + count, lo:lo + inter], "w13_scales", first, lo)
    _check_scales(weights.w13_scales[first:first + count, i + lo:i + lo + inter], "w13_scales",
                  first, i + lo)
    _check_scales(weights.w2_scales[first:first + count, :, lo // 32:(lo + inter) // 32],
                  "w2_scales", first, 0, lo // 32)
    parts = [[], [], [], []]
    for e in range(first, first + count):  # one expert at a time: bounded temporaries
        gate = _unpack(weights.w13[e, lo:lo + inter].to(device))
        up = _unpack(weights.w13[e, i + lo:i + lo + inter].to(device))
        g_s = weights.w13_scales[e, lo:lo + inter].to(device)
        u_s = weights.w13_scales[e, i + lo:i + lo + inter].to(device)
        # m-tile m: gate rows 8m..8m+7, then up rows 8m..8m+7
        fc1 = torch.stack((gate.view(inter // 8, 8, -1), up.view(inter // 8, 8, -1)), 1)
        fc1_s = torch.stack((g_s.view(inter // 8, 8, -1), u_s.view(inter // 8, 8, -1)), 1)
        w13, s13 = pack_tiles(fc1.reshape(1, 2 * inter, c.latent),
                              fc1_s.reshape(1, 2 * inter, c.latent // 32),
                              chunks_per_stage(c.latent))
        w2_codes = _unpack(weights.w2[e].to(device))[:, lo:lo + inter].contiguous()
        w2_s = weights.w2_scales[e, :, lo // 32:(lo + inter) // 32].to(device).contiguous()
        w2, s2 = pack_tiles(w2_codes[None], w2_s[None], chunks_per_stage(inter))
        for part, t in zip(parts, (w13, s13, w2, s2)):
            part.append(t)
    w13, s13, w2, s2 = (torch.cat(part) for part in parts)
    geometry = Geometry(latent=c.latent, inter=inter, first=first, count=count, shard=tuple(shard))
    return PreparedExperts(config=c, geometry=geometry, w13=w13, s13=s13, w2=w2, s2=s2)
