"""Where every byte of the split-K GEMM goes: ring-slot offsets, fragment maps, tactics.

Pure Python (no CuTe DSL): the index functions below take plain ints or the kernel's
``Int32`` values alike (they use only ``+``, ``*``, ``//``, ``%``), so the kernel
(``fast.gemm.kernel``) calls them while tracing and ``tests/test_gemm_fast.py`` replays
the whole data path of a CTA with them on the CPU (copies into a ring slot, fragment
reads, the PTX fragment layout of ``mma.m16n8k16``, the output map) before any GPU runs.

**Operands (swap-AB).** ``out[t, n] = sum_k x[t, k] * W[n, k]``: the weight rows are the
16-row M side of ``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32``, the tokens the
8-column N side (a *window* of 8 tokens), K the reduction. An *m-tile* is 16 weight rows;
a warp owns ``mtiles`` m-tiles, a CTA ``warps`` warps (``tile_rows = 16 warps mtiles``).

**k permutation.** A *sub-chunk* is 32 consecutive k. Lane ``l = 4g + q`` loads, per
m-tile and sub-chunk, the 16 bytes ``W[r, 8q : 8q + 8]`` of rows ``r = g`` (half 0) and
``r = g + 8`` (half 1) and, per window, ``x[8w + g, 8q : 8q + 8]``. MMA step ``j`` (0, 1)
of the sub-chunk gives the MMA's logical k ``{2q, 2q+1}`` the physical ``8q + 4j + {0,
1}`` (word ``2j`` of the lane's 16 bytes) and ``{2q+8, 2q+9}`` the physical ``8q + 4j +
{2, 3}`` (word ``2j + 1``): one permutation of k applied to both operands, so each MMA
adds 16 exact products of matching k, every physical k of the sub-chunk exactly once over
the two steps (a dot product does not depend on the names of its terms; the hardware's
order is what ``verify.bounds.mma_matmul_bound`` covers).

**A ring slot** (one stage of ``stage_k`` k): the weights first, ``[warp, m-tile,
sub-chunk, half, lane, 16 bytes]`` (each lane reads back exactly the 16-byte pieces it
copied), then the tokens, ``[window, sub-chunk, lane (= 4 token + piece), 16 bytes]``.
Both are read as one 16-byte shared load per lane at ``lane * 16`` of a 512-byte block:
no bank conflict.

**Split-K workspace.** Split ``s`` of tile ``t`` stores its FP32 accumulators in fragment
order, ``[split, tile, warp, m-tile, window, lane, 4 floats]`` (one coalesced 16-byte store
per lane), so the reducing CTA reads each partial back into the same registers.

**Token chunks** (calls of more than ``MAX_TOKENS`` rows: S2's 65..1024). One launch serves
``T`` rows as ``ceil(T / 64)`` chunks on the grid's second dimension (``token_chunks``):
every chunk has the same compile-time window count ``windows = ceil(ceil(T / chunks) / 8)``
(the chunks balanced, so a call of 65 rows runs 2 x 5 windows, not 8 + 8), chunk ``c``
holds rows ``[8 windows c, 8 windows (c + 1))`` (the last one fewer, zero-filled as a short
last window is), and its CTAs are those of a single-chunk call on those rows, with their
own slice of the workspace (``chunk_workspace_bytes``) and of the tile counters. A token's
sum is the same whatever chunk it lands in: nothing but ``splits`` changes its bits.

**Padded rows.** A weight of ``N`` rows, ``N`` not a multiple of ``ROW_QUANTUM``, is copied
once into ``padded_rows(N)`` rows (zero rows after the last) so that every tile reads
whole rows; the chunked kernel stores only the columns ``< N`` of an output whose row
stride is ``N``.
"""

from __future__ import annotations

import dataclasses

__all__ = [
    "WINDOW", "MAX_TOKENS", "MAX_WINDOWS", "SUB_K", "PIECE", "BLOCK",
    "a_source", "a_offset", "b_offset", "b_read_offset", "mma_operands", "c_map", "ws_offset",
    "a_offset_wgmma", "b_offset_wgmma", "wgmma_descriptors", "swizzled_chunk", "ROW_BYTES", "ATOM_BYTES",
    "windows_for", "Tactic", "MAX_WIDE_WINDOWS", "CHUNK_WINDOWS", "check_chunk_windows",
    "SMEM_PER_SM",
    "MAX_ACCUMULATORS", "MAX_ACCUMULATORS_SERIAL",
    "slot_bytes", "ring_for",
    "MAX_CHUNKS", "MAX_CALL_TOKENS", "ROW_QUANTUM", "token_chunks", "padded_rows",
    "chunk_workspace_bytes", "chunk_first_row", "chunk_workspace_offset", "chunk_counter",
]

#: Tokens per window: the N of ``mma.m16n8k16``.
WINDOW = 8
#: The most tokens one call serves (8 windows; the DEP front's ``front_max``).
MAX_WINDOWS = 8
MAX_TOKENS = WINDOW * MAX_WINDOWS
#: The most windows of one token chunk of a ``wgmma`` kernel with wide chunks
#: (``Tactic.chunk_windows``): 128 tokens, one ``m64n128k16`` per m-tile and 16 k, the
#: accumulators of one window in each thread's 4 registers as ``mma.sync``'s.
MAX_WIDE_WINDOWS = 16
#: The token-chunk widths a tactic may have (``Tactic.chunk_windows``): 8 windows (64 rows;
#: every kind) or 16 (128 rows; ``wgmma`` only).
CHUNK_WINDOWS = (MAX_WINDOWS, MAX_WIDE_WINDOWS)
#: k of one sub-chunk (two MMA steps of 16).
SUB_K = 32
#: Bytes of one ``cp.async`` / one lane's shared load.
PIECE = 16
#: Bytes a warp reads with one 16-byte shared load per lane.
BLOCK = 32 * PIECE
#: One 128-byte swizzled row (64 BF16 k) and one 8-row swizzle atom of the ``wgmma`` tactic.
ROW_BYTES, ATOM_BYTES = 128, 1024
#: The most (m-tile, window) accumulator tiles of one warp (4 FP32 registers each): beyond
#: it, ptxas spills (measured with the kernel's code: 4 m-tiles x 5 windows fit in 250
#: registers, 4 x 6 spill).
MAX_ACCUMULATORS = 20
#: The same bound for a ``Tactic(serial=True)``, counting the running sum's tiles too.
MAX_ACCUMULATORS_SERIAL = 32
#: The most token chunks of one launch (the grid's second dimension), so the most rows one
#: call serves: ``MAX_CALL_TOKENS`` (S2's 1024 rows are 16 chunks).
MAX_CHUNKS = 64
MAX_CALL_TOKENS = MAX_CHUNKS * MAX_TOKENS
#: Weight rows are padded to a multiple of this (the smallest default tile, 64 rows).
ROW_QUANTUM = 64
#: Shared memory of one H100/H200 multiprocessor a CTA may share (228 KiB, of which 1 KiB
#: per resident CTA is reserved by the system).
SMEM_PER_SM = 228 << 10


def a_source(warp, mt, half, lane, mtiles: int):
    """(row within the tile, k within the sub-chunk) of the 16 bytes lane ``lane`` of
    ``warp`` copies for m-tile ``mt``, half ``half``."""
    return (warp * mtiles + mt) * 16 + 8 * half + lane // 4, 8 * (lane % 4)


def a_offset(warp, mt, sub, half, lane, mtiles: int, subs: int):
    """Byte offset in a ring slot of that lane's piece for sub-chunk ``sub``."""
    return (((warp * mtiles + mt) * subs + sub) * 2 + half) * BLOCK + lane * PIECE


def b_offset(token, piece, subs: int, a_bytes: int):
    """Byte offset in a ring slot of token ``token``'s 16-byte piece ``piece`` (k ``8 piece
    .. 8 piece + 7`` of the stage; ``piece < 4 subs``)."""
    return a_bytes + ((token // WINDOW * subs + piece // 4) * 32
                      + (token % WINDOW) * 4 + piece % 4) * PIECE


def b_read_offset(window, sub, lane, subs: int, a_bytes: int):
    """Where lane ``lane`` reads its B fragment of ``window`` for sub-chunk ``sub``: the
    piece of token ``8 window + lane // 4``, k ``32 sub + 8 (lane % 4)``."""
    return a_bytes + ((window * subs + sub) * 32 + lane) * PIECE


def swizzled_chunk(row, chunk):
    """Byte offset of 16-byte chunk ``chunk`` (0..7) of row ``row`` in a run of 128-byte
    rows under the 128-byte swizzle of ``wgmma`` (the PTX ISA's SWIZZLE_128B K-major
    layout): row ``row`` at ``128 row``, its chunks permuted by ``chunk ^ (row % 8)``, so
    eight rows form a 1024-byte atom whose 8 chunks of one k sit in 8 different bank groups."""
    return row * ROW_BYTES + (chunk ^ (row % 8)) * PIECE


def a_offset_wgmma(warp, mt, sub, half, lane, mtiles: int, subs: int, tile_rows: int):
    """Byte offset in a ring slot of the same lane's piece for the ``wgmma`` tactic: per
    64-k block ``kb`` of the stage (``tile_rows`` rows of 128 bytes at ``kb tile_rows
    128``), per (warpgroup ``wg``, m-tile ``mt``) 64 rows at ``(wg mtiles + mt) 8192``,
    each row the 64 k of that block, 128-byte swizzled (``swizzled_chunk``). The 64 rows
    of (wg, mt) are row groups ``rg = 2 w + half`` of its warps ``w`` (tile rows ``((4 wg
    + w) mtiles + mt) 16 + 8 half + g``, the ``mma.sync`` rows of that warp), so the
    accumulators keep ``c_map``'s rows. The four lanes of a row copy 64 contiguous bytes
    into one 128-byte row of the slot: each ``cp.async`` of a warp reads 8 rows x 64 bytes
    and writes 8 slot rows (with the unswizzled core-matrix layout the 4 lanes of a row
    wrote 4 rows 128 bytes apart, and every lane became its own L2 request)."""
    wg, w = warp // 4, warp % 4
    chunk = sub * 4 + lane % 4
    row = (2 * w + half) * 8 + lane // 4
    return ((chunk // 8) * tile_rows * ROW_BYTES + (wg * mtiles + mt) * 64 * ROW_BYTES
            + swizzled_chunk(row, chunk % 8))


def b_offset_wgmma(token, piece, subs: int, a_bytes: int, windows: int):
    """Byte offset of token ``token``'s piece ``piece`` (k ``8 piece ..`` of the stage) for
    ``wgmma``: per 64-k block ``kb = piece // 8`` the ``8 windows`` token rows of 128 bytes
    at ``a_bytes + kb 8 windows 128``, 128-byte swizzled (``swizzled_chunk``)."""
    return (a_bytes + (piece // 8) * WINDOW * windows * ROW_BYTES
            + swizzled_chunk(token, piece % 8))


def wgmma_descriptors(wg, mt, sub, j: int, mtiles: int, subs: int, a_bytes: int, windows: int):
    """((start, stride) of A, (start, stride) of B) of MMA step ``j`` (k ``32 sub + 16 j
    ..``) of (warpgroup ``wg``, m-tile ``mt``), both 128-byte swizzled K-major
    (``fast.device.ptx.smem_matrix_descriptor_sw128``): the start is the row block's first
    row plus 32 bytes per 16 k into the row (the swizzle is applied to the address the
    tensor cores form, so the atom's base stays 1024-byte aligned), 1024 bytes from one 8
    rows to the next."""
    tile_rows = a_bytes // (2 * SUB_K * subs)
    chunk = sub * 4 + 2 * j
    kb, into = chunk // 8, (chunk % 8) * PIECE
    a = (kb * tile_rows * ROW_BYTES + (wg * mtiles + mt) * 64 * ROW_BYTES + into, ATOM_BYTES)
    b = (a_bytes + kb * WINDOW * windows * ROW_BYTES + into, ATOM_BYTES)
    return a, b


def mma_operands(a_lo, a_hi, b, j: int):
    """The registers of MMA step ``j`` (0, 1) of a sub-chunk: ``a_lo``/``a_hi`` the 4 words
    of the lane's half-0/half-1 weight pieces, ``b`` the 4 words of its token piece.
    Returns ``((a0, a1, a2, a3), (b0, b1))`` in ``mma.m16n8k16``'s fragment order (a0: row
    g, k 2q..2q+1; a1: row g+8, same k; a2: row g, k 2q+8..2q+9; a3: row g+8, same k;
    b0: k 2q..2q+1, b1: k 2q+8..2q+9 of token g)."""
    return (a_lo[2 * j], a_hi[2 * j], a_lo[2 * j + 1], a_hi[2 * j + 1]), (b[2 * j], b[2 * j + 1])


def c_map(warp, mt, window, lane, r, mtiles: int):
    """(row within the tile, token) of accumulator ``r`` (0..3) of ``(mt, window)`` in lane
    ``lane``: the ``mma.m16n8k16`` C fragment, rows ``g`` and ``g + 8``, columns ``2q`` and
    ``2q + 1``."""
    return ((warp * mtiles + mt) * 16 + lane // 4 + 8 * (r // 2),
            window * WINDOW + 2 * (lane % 4) + r % 2)


def ws_offset(split, tile, warp, mt, window, lane, tiles, warps: int, mtiles: int,
              windows: int):
    """Byte offset of a lane's 4 FP32 partials of ``(mt, window)`` in the workspace."""
    return (((((split * tiles + tile) * warps + warp) * mtiles + mt) * windows + window)
            * BLOCK + lane * PIECE)


def windows_for(tokens: int) -> int:
    """Windows of 8 tokens a call of ``tokens`` rows runs: ``ceil(tokens / 8)``, a
    compile-time constant of the kernel (one compiled variant per count, 1..8), so its main
    loop has no branch on the token count."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"tokens must be an int in [1, {MAX_TOKENS}], got {tokens!r}")
    return -(-tokens // WINDOW)


def token_chunks(tokens: int, chunk_windows: int = MAX_WINDOWS) -> tuple[int, int]:
    """``(chunks, windows)`` of a call of ``tokens`` rows cut into chunks of at most
    ``chunk_windows`` windows (``CHUNK_WINDOWS``: 8, the default, or 16 for a ``wgmma``
    tactic's wide chunks): ``chunks = ceil(tokens / (8 chunk_windows))`` token chunks, every
    one of ``windows = ceil(ceil(tokens / chunks) / 8)`` windows, chunk ``c`` holding rows
    ``[8 windows c, min(tokens, 8 windows (c + 1)))``. Up to ``8 chunk_windows`` tokens:
    one chunk of ``windows_for``-many windows (up to 64 tokens the single-chunk launch).
    ``windows`` is a compile-time constant of the kernel, so the main loop has no branch on
    the row count; balancing the chunks keeps the zero-filled token slots below 8 per chunk
    (65 rows: 2 chunks of 5 windows, or one of 9 in wide chunks)."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= MAX_CALL_TOKENS:
        raise ValueError(f"tokens must be an int in [1, {MAX_CALL_TOKENS}], got {tokens!r}")
    if type(chunk_windows) is not int or chunk_windows not in CHUNK_WINDOWS:
        raise ValueError(f"chunk_windows must be one of {CHUNK_WINDOWS}, got {chunk_windows!r}")
    chunks = -(-tokens // (WINDOW * chunk_windows))
    windows = -(-(-(-tokens // chunks)) // WINDOW)
    return chunks, windows


def padded_rows(rows: int) -> int:
    """``rows`` rounded up to a multiple of ``ROW_QUANTUM`` (the rows a weight of ``rows``
    rows is padded to, with zero rows, so that every tile reads whole rows)."""
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows must be a positive int, got {rows!r}")
    return -(-rows // ROW_QUANTUM) * ROW_QUANTUM


def chunk_workspace_bytes(splits: int, rows: int, windows: int) -> int:
    """Bytes of one token chunk's split-K partials (``ws_offset`` of every split, tile,
    warp, m-tile, window and lane of ``rows`` weight rows): ``splits * rows * 8 windows``
    FP32 values; chunk ``c``'s slice starts at ``chunk_workspace_offset``."""
    return splits * rows * WINDOW * windows * 4


def chunk_first_row(chunk, windows: int):
    """The first row (token) of token chunk ``chunk`` of a call of ``windows`` windows per
    chunk (``token_chunks``): ``8 windows chunk``."""
    return chunk * (WINDOW * windows)


def chunk_workspace_offset(chunk, splits, rows, windows: int):
    """Byte offset of token chunk ``chunk``'s slice of the split-K workspace
    (``chunk_workspace_bytes`` per chunk, chunk-major)."""
    return chunk * splits * rows * (WINDOW * windows * 4)


def chunk_counter(chunk, tiles, tile):
    """Index of the tile counter of (``chunk``, ``tile``) among ``tiles`` tiles per chunk
    (chunk-major: chunk ``c``'s counters follow chunk ``c - 1``'s)."""
    return chunk * tiles + tile


def slot_bytes(tile_rows: int, windows: int, stage_k: int) -> int:
    """One ring slot: the tile's weights and the windows' tokens for ``stage_k`` k."""
    return (tile_rows + WINDOW * windows) * stage_k * 2


def ring_for(tile_rows: int, windows: int, stage_k: int, occupancy: int) -> int:
    """Deepest ring (at most 8 stages) whose slots fit ``occupancy`` CTAs per
    multiprocessor, 2 KiB per CTA left for the system and the kernel's flag."""
    budget = SMEM_PER_SM // occupancy - 2048
    return max(2, min(8, budget // slot_bytes(tile_rows, windows, stage_k)))


def check_chunk_windows(owner: str, name: str, value, wgmma: bool) -> None:
    """Refuse, naming ``owner`` and the argument ``name``, a token-chunk width
    (``Tactic.chunk_windows``, ``DenseGemm(chunk_windows=...)``, the wide layers'
    ``invariant_chunk_windows``) that is not one of ``CHUNK_WINDOWS``, or wide (16) without the warpgroup MMA
    (``wgmma``: whether the GEMMs run it)."""
    if type(value) is not int or value not in CHUNK_WINDOWS:
        raise ValueError(f"{owner}: {name} must be one of {CHUNK_WINDOWS}, got {value!r}")
    if value > MAX_WINDOWS and not wgmma:
        raise ValueError(f"{owner}: {name}={value} (128-row token chunks) needs the warpgroup "
                         f"MMA (wgmma); mma.sync's kernels take at most {MAX_WINDOWS} windows")


@dataclasses.dataclass(frozen=True)
class Tactic:
    """How one GEMM call is cut up. ``splits`` is the only field that changes bits (it
    fixes the summation order: each split's MMA chain over ``K / splits`` consecutive k,
    then the splits' FP32 partials added in split order); the tile shape, the ring, the
    stage width and the occupancy only move work between CTAs and through shared memory.

    Attributes:
        warps, mtiles: the CTA tile, ``16 * warps * mtiles`` weight rows.
        splits: K splits (CTAs per tile); ``K % (splits * stage_k) == 0``.
        stage_k: k per ring stage (64 or 128).
        occupancy: CTAs per multiprocessor the kernel is built for (launch bounds and
            the ring's share of shared memory); default 2 for tiles up to 128 rows, else 1.
        ring: stages in the ``cp.async`` ring; default ``ring_for(...)``.
        wgmma: warpgroup MMA (sm_90a; warps 4 or 8) with both operands read from the
            ring slot by descriptor (``a_offset_wgmma``, ``b_offset_wgmma``), one
            ``m64n(8 windows)k16`` per m-tile and 16 k, instead of ``mma.sync`` (its
            contracts pass on the H200; timed in ``dense-wgmma.md`` of the H200 and the
            H100). It changes bits against ``mma.sync`` (another instruction), never with
            the tile shape.
        serial: the K splits run one after another in each CTA (one CTA per tile and
            token chunk, a running sum folded in split order at each split's end;
            ``fast.gemm.kernel``'s "Serial splits") instead of one CTA per split: the same
            bits as the cross-CTA form at the same ``splits``, no workspace; each warp
            holds twice the accumulators, so ``2 mtiles windows <= MAX_ACCUMULATORS_SERIAL``.
        overlap: with ``wgmma``, each stage's MMAs stay in flight while the next stage's
            copies are waited for and issued (``fast.gemm.kernel``'s "Overlap"; the copies
            run one stage less ahead, so the ring needs at least 3 stages): the same MMAs in
            the same order, so the same bits as without it.
        chunk_windows: the most windows of one token chunk (``CHUNK_WINDOWS``): 8 (64
            rows, the default) or, with ``wgmma``, 16 (128 rows: one ``m64n128k16`` per
            m-tile and 16 k, so a call of many rows has half the chunks and each weight tile
            is streamed half as often). Each output is the same MMA chain whatever chunk or
            window count its token lands in, so the same bits at either width.
    """

    warps: int = 4
    mtiles: int = 2
    splits: int = 1
    stage_k: int = 64
    occupancy: int | None = None
    ring: int | None = None
    wgmma: bool = False
    serial: bool = False
    overlap: bool = False
    chunk_windows: int = MAX_WINDOWS

    def __post_init__(self):
        for name in ("warps", "mtiles", "splits"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Tactic.{name} must be a positive int, got {v!r}")
        if self.warps not in (1, 2, 4, 8) or self.mtiles not in (1, 2, 4):
            raise ValueError(f"Tactic: warps must be 1, 2, 4 or 8 and mtiles 1, 2 or 4, got "
                             f"warps={self.warps}, mtiles={self.mtiles}")
        if self.stage_k not in (64, 128):
            raise ValueError(f"Tactic.stage_k must be 64 or 128, got {self.stage_k!r}")
        if self.occupancy is not None and self.occupancy not in (1, 2, 3, 4):
            raise ValueError(f"Tactic.occupancy must be 1..4, got {self.occupancy!r}")
        if self.ring is not None and not 2 <= self.ring <= 12:
            raise ValueError(f"Tactic.ring must be 2..12, got {self.ring!r}")
        if self.wgmma and self.warps not in (4, 8):
            raise ValueError(f"Tactic.wgmma needs whole warpgroups (warps 4 or 8), got "
                             f"warps={self.warps}")
        for name in ("wgmma", "serial", "overlap"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Tactic.{name} must be a bool, got {getattr(self, name)!r}")
        if self.overlap and not self.wgmma:
            raise ValueError("Tactic.overlap keeps warpgroup MMAs in flight: it needs wgmma=True")
        check_chunk_windows("Tactic", "chunk_windows", self.chunk_windows, self.wgmma)

    def tiles_per_warp(self, windows: int) -> int:
        """Accumulator tiles (16 x 8 FP32 each) a warp holds at ``windows`` windows: one
        set per (m-tile, window), two with ``serial`` (the running sum)."""
        return self.mtiles * windows * (2 if self.serial else 1)

    def max_tiles(self) -> int:
        """The most accumulator tiles a warp may hold: ``MAX_ACCUMULATORS_SERIAL`` for
        ``serial`` (the running sum is touched once per split, not in the MMA loop), else
        ``MAX_ACCUMULATORS``."""
        return MAX_ACCUMULATORS_SERIAL if self.serial else MAX_ACCUMULATORS

    @property
    def tile_rows(self) -> int:
        return 16 * self.warps * self.mtiles

    def chunks(self, tokens: int) -> tuple[int, int]:
        """``(chunks, windows)`` of a call of ``tokens`` rows under this tactic
        (``token_chunks`` at :attr:`chunk_windows`)."""
        return token_chunks(tokens, self.chunk_windows)

    def serves(self, tokens: int) -> bool:
        """Whether the tactic runs a call of ``tokens`` rows: its warp's accumulators
        (``mtiles`` times the windows of a token chunk, :meth:`chunks`) fit
        ``MAX_ACCUMULATORS``."""
        return self.tiles_per_warp(self.chunks(tokens)[1]) <= self.max_tiles()

    def kernel_params(self, windows: int, chunked: bool = False) -> dict:
        """The compile-time parameters of the kernel this tactic runs at ``windows`` windows
        per token chunk; ``chunked``: the kernel of token chunks and padded rows (the grid's
        second dimension, an output width below the padded rows; the module docstring),
        which a call of more than ``MAX_TOKENS`` rows or of a padded weight launches."""
        if isinstance(windows, bool) or not isinstance(windows, int) \
                or not 1 <= windows <= self.chunk_windows:
            raise ValueError(f"Tactic {self.label()}: windows must be an int in [1, "
                             f"{self.chunk_windows}] (its chunk_windows), got {windows!r}")
        if self.tiles_per_warp(windows) > self.max_tiles():
            per_window = self.tiles_per_warp(1)
            raise ValueError(f"Tactic {self.label()}: {self.tiles_per_warp(windows)} accumulator "
                             f"tiles per warp at {windows} windows exceed {self.max_tiles()} "
                             f"(registers); it serves up to "
                             f"{8 * (self.max_tiles() // per_window)} tokens per chunk")
        occ = self.occupancy or (2 if self.tile_rows <= 128 else 1)
        ring = self.ring or ring_for(self.tile_rows, windows, self.stage_k, occ)
        if occ * (ring * slot_bytes(self.tile_rows, windows, self.stage_k) + 2048) > SMEM_PER_SM:
            raise ValueError(f"Tactic {self}: {ring} ring stages of "
                             f"{slot_bytes(self.tile_rows, windows, self.stage_k)} bytes do not "
                             f"fit {occ} CTAs per multiprocessor at {windows} windows")
        if self.overlap and ring < 3:
            raise ValueError(f"Tactic {self.label()}: overlap needs a ring of at least 3 stages, "
                             f"got {ring} at {windows} windows")
        params = dict(warps=self.warps, mtiles=self.mtiles, windows=windows, ring=ring,
                      stage_k=self.stage_k, occupancy=occ)
        if self.wgmma:  # only then: the mma.sync kernels' parameters stay as they were
            params["wgmma"] = True
        if chunked:  # likewise: the single-chunk kernels' parameters (and code) stay as they were
            params["chunked"] = True
        if self.serial:  # likewise
            params["serial"] = True
        if self.overlap:  # likewise
            params["overlap"] = True
        return params

    def label(self) -> str:
        extra = "".join(f",{k}{getattr(self, k)}" for k in ("stage_k", "occupancy", "ring")
                        if getattr(self, k) != Tactic.__dataclass_fields__[k].default)
        extra += ",wgmma" if self.wgmma else ""
        extra += ",serial" if self.serial else ""
        extra += ",overlap" if self.overlap else ""
        extra += f",cw{self.chunk_windows}" if self.chunk_windows != MAX_WINDOWS else ""
        return f"r{self.tile_rows}w{self.warps}s{self.splits}{extra}"
