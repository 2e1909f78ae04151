"""Peer: the Marlin MoE kernel (vLLM's ``moe_wna16_marlin_gemm``) on MXFP4 weights, W4A16.

The MoE kernel that vLLM and SGLang run for MXFP4 MoE on H100/H200 with
``--moe-backend marlin``: BF16 activations x MXFP4 weights dequantized in registers, FP32
accumulation, one GEMM per layer over the expert-sorted pairs. This module turns our
weight format into Marlin's once, runs one MoE call, and checks itself on a tiny problem
(``check_fc1``, ``check_forward``) so that no timing comes from a wrong result.

**Extension** (nothing else from vLLM is imported or needed). Written against the vLLM
0.26.0 wheel (``vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl``, which pins
``torch==2.11.0``; CUDA 13), whose kernels are libtorch stable-ABI libraries that need only
``libtorch*.so``, ``libcudart.so.13`` and ``libcuda.so.1``:

* ``_moe_C_stable_libtorch.abi3.so`` (45.3 MiB, required): ``torch.ops._moe_C``
  ``moe_align_block_size``, ``moe_wna16_marlin_gemm``, ``moe_sum``;
* ``_C_stable_libtorch.abi3.so`` (75.2 MiB, optional): ``torch.ops._C``
  ``gptq_marlin_repack`` and ``silu_and_mul``.

``benchmarks/peers/fetch_marlin.py`` puts them in ``<repo>/.gpu/peers/marlin/`` (the second
as two parts of at most 60 MiB; :func:`load_ops` joins them, checking the SHA-256), or set
``LATENTMOE_MARLIN_DIR``. Loaded with ``torch.ops.load_library``; this module imports
nothing but torch at import time (CPU machines test the pure-PyTorch parts).

Two sets (``ops_set()`` reports which one loaded):

* ``full`` (both libraries): weights repacked by the extension's ``gptq_marlin_repack``,
  activation by its ``silu_and_mul`` (one kernel, vLLM's path);
* ``minimal`` (``_moe_C`` only; one device call's carry): the repack by
  :func:`marlin_repack_torch` (PyTorch; the smoke proves it byte-equal to the extension's
  wherever both exist), the activation as ``silu(gate) * up`` in PyTorch (two kernels).

**Our weights** (as in ``triton_moe``): w13 codes ``uint8 [E, 2I, L/2]`` (rows gate
``0..I-1`` then up ``I..2I-1``; element ``2i`` in the low nibble), E8M0 scales ``uint8
[E, 2I, L/32]``; w2 codes ``uint8 [E, L, I/2]``, scales ``uint8 [E, L, I/32]``.

**Conversion** (once, outside the timed region; vLLM's MXFP4 Marlin preparation):

1. codes ``[N, K/2]`` of an expert -> ``.view(int32).T`` = GPTQ order ``int32 [K/8, N]``
   (element ``k`` at bits ``4 (k % 8)`` of word ``k // 8``) -> ``gptq_marlin_repack(q,
   perm=empty, size_k=K, size_n=N, num_bits=4, is_a_8bit=False)`` -> ``int32 [K/16, 2N]``
   (16x64 tiles in the mma.m16n8k16 B-fragment order, nibbles interleaved);
2. scales ``[N, K/32]`` -> ``[K/32, N]`` -> every 64 consecutive entries an 8x8 transpose
   -> every 4 consecutive entries ``[0, 2, 1, 3]`` (the BF16-activation E8M0 layout) ->
   viewed ``float8_e8m0fnu`` ``[E, K/32, N]`` (a pure permutation: no value changes).

FC1 is ``N = 2I, K = L`` with our ``[gate; up]`` row order kept (Marlin writes columns in
natural order, and ``silu_and_mul`` reads gate = first half, up = second half); FC2 is
``N = L, K = I``. Marlin needs ``N % 64 == 0`` and ``K % 128 == 0`` for FP4 with group 32
(true at L = 3584, I = 3072 and I_s = 384).

**What one call does (what is timed)**, ``MarlinMoE.__call__(x, ids, weights)``:

1. ``moe_align_block_size(ids, n_experts_total, block_size_m, sorted, expert_ids,
   num_tokens_post_pad, expert_map)``: the pairs (flat index ``r K + k``) sorted by local
   expert, each expert's run padded to ``block_size_m``; ``expert_map`` (``int32
   [n_experts_total]``, ``-1`` outside ``[first, first + count)``) drops non-local pairs
   (vLLM's EP path with ``ignore_invalid_experts=True``);
2. FC1 ``moe_wna16_marlin_gemm(x, h1, w13, ..., top_k=16, mul_topk_weights=False,
   b_type=float4_e2m1f, size_m=R, size_n=2I, size_k=L, is_k_full=True,
   use_atomic_add=False, use_fp32_reduce=True)`` -> BF16 ``[R*16, 2I]`` (rows of non-local
   pairs are not written);
3. activation ``silu(gate) * up`` -> BF16 ``[R*16, I]`` (our SiTU is no Marlin
   activation; SiLU-and-mul is the same cost class: one exp, a few FMAs per element);
4. FC2 ``moe_wna16_marlin_gemm(a, y2, w2, ..., top_k=1, mul_topk_weights=True,
   size_m=R*16, size_n=L, size_k=I)`` -> BF16 ``[R*16, L]``, each pair's row times its
   routing weight (FP32 multiply before the BF16 store);
5. combine: ``moe_sum(y2.view(R, 16, L), out, ids, expert_map)`` (sums the local pairs of
   each row; ``combine="torch"`` does an FP32 masked sum in PyTorch instead) -> BF16
   ``[R, L]``; rows with no local pair are zero.

**The compact layout** (``layout="compact"``, per call, with ``capacity``: a host int >= the
local pair count ``P``; the benchmark passes ``P``, computed before the timed call as a DEP
dispatch knows what it received; default ``R*16``): what a DEP implementation that gathers
its received pairs would feed Marlin. Every stage works on ``capacity`` rows, not ``R*16``:

1. :func:`compact_pairs` (static shapes: a cumulative sum and one scatter): each local pair's
   source row, global expert id and weight, in flat order, in ``capacity`` slots (empty
   slots: expert id ``n_experts_total``, which the compact expert map sends to -1);
2. ``x`` rows gathered, BF16 ``[capacity, L]``; one ``moe_align_block_size`` of the slot ids
   ``[capacity, 1]`` (``top_k = 1``: Marlin reads activation row ``sorted_id`` and writes
   output row ``sorted_id``), shared by both GEMMs;
3. FC1 -> ``[capacity, 2I]``, SiLU-and-mul -> ``[capacity, I]``, FC2 (x routing weight) ->
   ``[capacity, L]``;
4. combine: an FP32 ``index_add_`` of the slot rows into ``[R + 1, L]`` (empty slots into the
   dropped row ``R``) -> BF16 ``[R, L]``. Its FP32 atomics may order the sum of a row with
   three or more local pairs differently from run to run (last-bit differences; rows with
   one or two are exact).

No host synchronization in either layout.

Rounding points: FP32 accumulation, BF16 ``h1``, activation in FP32 -> BF16, FC2 FP32 x
FP32 routing weight -> BF16 per pair, then the combine -> BF16.

**Configuration knobs**: ``block_size_m`` (8, 16, 32, 48 or 64; Marlin's M tile per expert
run; ``None`` = vLLM's heuristic :func:`vllm_block_size_m`; also a per-call argument, so
one object serves every candidate), ``combine`` (``"moe_sum"`` or ``"torch"``),
``n_experts_total`` (the global expert count ``moe_align_block_size`` is given; the
expert map has that length). Marlin picks its own thread tile (``thread_k = thread_n =
-1``) and blocks per SM.

**CUDA graphs.** A call does no host synchronization; the ops allocate through PyTorch's
caching allocator; the workspace (``int32 [SMs * 4]`` locks, zero) is made once.

**GPU code in the wheel** (``cuobjdump``): the Marlin MoE kernels are SASS for sm_80, sm_89
and sm_120 plus sm_80 PTX, none for sm_90: on an H100/H200 the driver JIT-compiles them at
their first use (once per process unless the compute cache keeps them; the smoke reports
the first checks' wall time, ``first_checks_s``); ``moe_align_block_size``, ``moe_sum``
and ``silu_and_mul`` have sm_90 SASS; ``gptq_marlin_repack`` is sm_80 SASS + PTX too.

Smoke on the GPU node (loads, checks the tiny problems at every block size, proves the
PyTorch repack equal to the extension's, times one DEP16 rank at T = 4 per block size)::

    export CUDA_CACHE_MAXSIZE=4294967296 PYTHONUNBUFFERED=1
    PYTHONPATH=. python3 -m benchmarks.peers.marlin_moe | tee $OUT/marlin_smoke.json

What to carry (``.gpu/`` is ignored, so name the files; a call carries at most 64 MiB):

* ``full`` set, two calls while the machine stays warm (ignored files a call leaves there
  stay for the next): first ``.gpu/peers/marlin/_C_stable_libtorch.abi3.so.part0`` (60
  MiB; any command), then ``.gpu/peers/marlin/_C_stable_libtorch.abi3.so.part1`` (15.2
  MiB), ``.gpu/peers/marlin/_moe_C_stable_libtorch.abi3.so`` (45.3 MiB) and
  ``.gpu/peers/marlin/manifest.json`` with the smoke (:func:`load_ops` joins the parts);
* ``minimal`` set, one call: ``.gpu/peers/marlin/_moe_C_stable_libtorch.abi3.so`` and
  ``.gpu/peers/marlin/manifest.json`` (PyTorch repack and activation).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from benchmarks.peers import fetch_marlin
from benchmarks.peers.triton_moe import (check_capacity, check_int, check_routing_inputs,
                                         check_weights, compact_slots, expert_bytes, local_pairs,
                                         per_expert_float64, random_weights, rank_weight_slice,
                                         tiny_problem, touched_experts)

__all__ = [
    "WHEEL", "BLOCK_SIZES", "COMBINES", "FLOAT4_E2M1F_ID", "ENV_DIR",
    "scalar_type_id", "lib_dir", "load_ops", "ops_set", "available", "versions",
    "expert_map", "local_mask", "vllm_block_size_m", "max_padded_pairs",
    "gptq_order", "marlin_repack_torch", "marlin_scales", "check_marlin_dims",
    "LAYOUTS", "compact_pairs", "compact_passes", "MarlinMoE", "rank_moe", "check_fc1", "check_forward", "smoke",
]

WHEEL = "vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl"
BLOCK_SIZES = (8, 16, 32, 48, 64)
COMBINES = ("moe_sum", "torch")
LAYOUTS = ("owner", "compact")
"""``owner``: FC1 over the ``R`` received rows with ``top_k = K`` (output rows ``R K``),
the activation, FC2 and the combine over all ``R K`` pair rows (vLLM's EP path);
``compact``: the ``P`` local pairs gathered into ``capacity`` rows first, every stage over
those rows only (module docstring)."""
MAX_ALIGN_EXPERTS = 992
"""``moe_align_block_size`` needs the expert count rounded up to 32 below 1024."""
ENV_DIR = "LATENTMOE_MARLIN_DIR"
_TILE = 16


def scalar_type_id(exponent: int, mantissa: int, signed: bool, bias: int = 0,
                   finite_values_only: bool = False, nan_repr: int = 1) -> int:
    """vLLM's ``ScalarType`` id, the int the Marlin op takes as ``b_type_id``: bit fields,
    low to high, exponent (8 bits), mantissa (8), signed (1), bias (32), finite-values-only
    (1), NaN representation (8; 0 none, 1 IEEE 754, 2 extended-range max/min)."""
    val, off = 0, 0
    for value, width in ((exponent, 8), (mantissa, 8), (int(signed), 1), (bias, 32),
                         (int(finite_values_only), 1), (nan_repr, 8)):
        val |= (int(value) & ((1 << width) - 1)) << off
        off += width
    return val


FLOAT4_E2M1F_ID = scalar_type_id(2, 1, True, 0, True, 0)
"""``float4_e2m1f`` (E2M1, finite values only, no NaN): 562949953487106."""


# --------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------

def lib_dir() -> str:
    """``$LATENTMOE_MARLIN_DIR`` if set, else ``<repo>/.gpu/peers/marlin``."""
    return os.environ.get(ENV_DIR) or fetch_marlin.default_dest()


_OPS: dict | None = None


def _manifest(folder: str) -> dict:
    path = os.path.join(folder, fetch_marlin.MANIFEST)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f).get("files", {})


def _ensure_whole(folder: str, name: str, manifest: dict) -> str | None:
    """The library's path, joined from its parts first if only they are present; None if
    neither is there."""
    path = os.path.join(folder, name)
    if os.path.exists(path):
        return path
    if not os.path.exists(path + ".part0"):
        return None
    return fetch_marlin.join_parts(path, manifest.get(name, {}).get("sha256"))


def load_ops() -> dict:
    """Load the extension once: ``{"moe": torch.ops._moe_C, "c": torch.ops._C or None,
    "paths": [...]}``.

    Raises:
        ImportError: naming the folder or library that is missing or fails to load, or the
            op that the loaded library lacks.
    """
    global _OPS
    if _OPS is not None:
        return _OPS
    folder = lib_dir()
    manifest = _manifest(folder)
    moe_path = _ensure_whole(folder, fetch_marlin.MOE_LIB, manifest)
    if moe_path is None:
        raise ImportError(f"no {fetch_marlin.MOE_LIB} in {folder} (run python3 -m "
                          f"benchmarks.peers.fetch_marlin where pip works, or set {ENV_DIR})")
    paths = []

    def load(path):
        try:
            torch.ops.load_library(path)
        except (OSError, RuntimeError) as e:
            raise ImportError(f"{path} failed to load with torch {torch.__version__}: {e}") from e
        paths.append(path)

    load(moe_path)
    # joined (a 75 MiB write) only where _moe_C loads, i.e. on the GPU node
    c_path = _ensure_whole(folder, fetch_marlin.C_LIB, manifest)
    if c_path is not None:
        load(c_path)
    moe = torch.ops._moe_C
    for op in ("moe_align_block_size", "moe_wna16_marlin_gemm", "moe_sum"):
        if not hasattr(moe, op):
            raise ImportError(f"{moe_path} registers no _moe_C::{op} (not the vLLM 0.26.0 build)")
    c = None
    if c_path is not None:
        c = torch.ops._C
        for op in ("gptq_marlin_repack", "silu_and_mul"):
            if not hasattr(c, op):
                raise ImportError(f"{c_path} registers no _C::{op} (not the vLLM 0.26.0 build)")
    _OPS = {"moe": moe, "c": c, "paths": paths}
    return _OPS


def ops_set() -> str:
    """``"full"`` (both libraries), ``"minimal"`` (``_moe_C`` only); loads them."""
    return "full" if load_ops()["c"] is not None else "minimal"


def available() -> tuple[bool, str]:
    """``(True, "")`` where the peer can run, else ``(False, reason)``: the extension loads,
    a CUDA device is visible, and it is SM80 or newer (Marlin's tensor-core path; the
    benchmark targets SM90)."""
    try:
        load_ops()
    except ImportError as e:
        return False, f"Marlin peer unavailable: {e}"
    if not torch.cuda.is_available():
        return False, "Marlin peer needs a CUDA GPU (none visible)"
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return False, f"Marlin MoE (BF16 activations) needs SM80 or newer; this GPU is sm_{major}{minor}"
    return True, ""


def versions() -> dict:
    """For a benchmark record: the wheel, the loaded set and paths, torch."""
    out = {"wheel": WHEEL, "torch": torch.__version__}
    try:
        ops = load_ops()
        out["set"] = "full" if ops["c"] is not None else "minimal"
        out["libs"] = [os.path.basename(p) for p in ops["paths"]]
    except ImportError as e:
        out["error"] = str(e)
    return out


# --------------------------------------------------------------------------------------
# pure PyTorch: routing inputs, block size, weight layout
# --------------------------------------------------------------------------------------

def expert_map(first: int, count: int, n_experts_total: int, device="cpu") -> torch.Tensor:
    """``int32 [n_experts_total]``: ``e - first`` for ``e`` in ``[first, first + count)``,
    ``-1`` elsewhere (what ``moe_align_block_size`` and ``moe_sum`` are given)."""
    check_int(first, "first")
    check_int(count, "count", 1)
    check_int(n_experts_total, "n_experts_total", 1)
    if first + count > n_experts_total:
        raise ValueError(f"first + count = {first + count} > n_experts_total = {n_experts_total}")
    m = torch.full((n_experts_total,), -1, dtype=torch.int32, device=device)
    m[first:first + count] = torch.arange(count, dtype=torch.int32, device=device)
    return m


def local_mask(ids: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Bool ``[R, K]``: the pairs whose expert lies in ``[first, first + count)`` (the ones
    the peer computes; the others are dropped, as an EP owner drops them)."""
    return (ids >= first) & (ids < first + count)


def vllm_block_size_m(rows: int, top_k: int, local: int, n_experts_total: int) -> int:
    """vLLM's default ``block_size_m`` for ``fused_marlin_moe``: with ``M = ceil(rows local
    / n_experts_total)`` (the rows a rank's experts expect), the first of 8, 16, 32, 48, 64
    with ``M top_k / local / bs < 0.9`` (else 64)."""
    check_int(rows, "rows", 1)
    check_int(top_k, "top_k", 1)
    check_int(local, "local", 1)
    check_int(n_experts_total, "n_experts_total", local)
    m = -(-rows * local // n_experts_total)
    for bs in BLOCK_SIZES:
        if m * top_k / local / bs < 0.9:
            return bs
    return BLOCK_SIZES[-1]


def max_padded_pairs(pairs: int, n_experts_total: int, block_size_m: int) -> int:
    """Length of ``moe_align_block_size``'s ``sorted_token_ids``: every pair plus up to
    ``bs - 1`` padding per expert, at most ``pairs * bs`` when ``pairs < n_experts``."""
    n = pairs + n_experts_total * (block_size_m - 1)
    if pairs < n_experts_total:
        n = min(pairs * block_size_m, n)
    return n


def compact_pairs(ids: torch.Tensor, weights: torch.Tensor, first: int, count: int, capacity: int,
                  fill_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The local pairs of ``ids [R, K]`` (experts in ``[first, first + count)``), in flat
    order ``r K + k``, compacted into ``capacity`` slots (:func:`compact_slots`): ``(rows,
    dest, slot_ids, slot_weights)``:

    * ``rows`` int64 ``[capacity]``: each slot's source row of ``x`` (``0`` for an empty slot);
    * ``dest`` int64 ``[capacity]``: the row of ``[R + 1, L]`` its FC2 row is added to
      (``R``, a row that is dropped, for an empty slot);
    * ``slot_ids`` int32 ``[capacity, 1]``: the pair's global expert id, ``fill_id`` (an id
      the compact expert map sends to -1) for an empty slot;
    * ``slot_weights`` FP32 ``[capacity]``: the pair's routing weight (an empty slot's is
      never read).

    Device ops with static shapes only. ``capacity`` must be at least the local pair count
    (pairs past it are dropped)."""
    r, k = ids.shape
    flat = ids.reshape(-1)
    n = flat.numel()
    src = compact_slots(local_mask(ids, first, count).reshape(-1), capacity)
    valid = src < n
    safe = torch.where(valid, src, torch.zeros_like(src))
    rows = torch.div(safe, k, rounding_mode="floor")
    dest = torch.where(valid, rows, torch.full_like(rows, r))
    slot_ids = torch.where(valid, flat.index_select(0, safe).to(torch.int32),
                           torch.full((), fill_id, dtype=torch.int32, device=flat.device))
    slot_weights = weights.reshape(-1).index_select(0, safe).to(torch.float32)
    return rows, dest, slot_ids.view(capacity, 1).contiguous(), slot_weights.contiguous()


def check_marlin_dims(n: int, k: int, name: str) -> None:
    """Marlin FP4 (group 32) needs ``N % 64 == 0`` and ``K % 128 == 0``; ValueError naming
    the GEMM otherwise."""
    if n % 64 or k % 128:
        raise ValueError(f"{name}: Marlin needs N % 64 == 0 and K % 128 == 0, got N={n}, K={k}")


def gptq_order(codes: torch.Tensor) -> torch.Tensor:
    """Our codes ``uint8 [..., N, K/2]`` -> GPTQ order ``int32 [..., K/8, N]``: word ``(j, n)``
    holds elements ``8j..8j+7`` of row ``n``, element ``8j + i`` at bits ``4i`` (a view of
    the same bytes, little-endian, transposed)."""
    if codes.dtype != torch.uint8 or codes.shape[-1] % 4:
        raise ValueError(f"codes must be uint8 [..., N, K/2] with K % 8 == 0, got "
                         f"{codes.dtype} {tuple(codes.shape)}")
    return codes.contiguous().view(torch.int32).transpose(-2, -1).contiguous()


def _fragment_index(device) -> tuple[torch.Tensor, torch.Tensor]:
    """For lane ``t`` (32) and nibble slot ``s`` (8) of one 16x16 tile: the tile row ``k``
    and column ``n`` that Marlin's 4-bit layout puts there. A lane holds the
    mma.m16n8k16 B fragment of both 8-column halves: rows ``2 (t % 4) + {0, 1}`` and
    ``+8``, column ``t // 4`` (+8 for the second half); slot ``s = 4 hi + 2 half + up``
    (the nibble order that lets two nibbles be converted at once)."""
    t = torch.arange(32, device=device).view(32, 1)
    s = torch.arange(8, device=device).view(1, 8)
    k = 2 * (t % 4) + (s >> 2) + 8 * (s & 1)
    n = t // 4 + 8 * ((s >> 1) & 1)
    return k, n


def marlin_repack_torch(codes: torch.Tensor, chunk_experts: int = 8) -> torch.Tensor:
    """Our codes ``uint8 [E, N, K/2]`` -> Marlin's 4-bit layout ``int32 [E, K/16, 2N]`` in
    PyTorch (what ``gptq_marlin_repack`` computes; the smoke proves it byte-equal).

    Per 16 rows of K and 64 columns of N (four 16x16 tiles ``j``), the 1024 nibbles are
    stored as 128 words, word ``4 t + j`` for lane ``t`` (32) and tile ``j`` (4): the eight
    nibbles of :func:`_fragment_index`, slot ``s`` at bits ``4 s``. ``chunk_experts`` experts
    at a time.
    """
    if codes.dtype != torch.uint8 or codes.dim() != 3:
        raise ValueError(f"codes must be uint8 [E, N, K/2], got {codes.dtype} {tuple(codes.shape)}")
    e, n, half_k = codes.shape
    k = half_k * 2
    if n % 64 or k % _TILE:
        raise ValueError(f"marlin_repack_torch: the layout needs N % 64 == 0 and K % 16 == 0, got "
                         f"N={n}, K={k}")
    if e > chunk_experts > 0:  # bounded temporaries (int64 nibbles: 16 B per weight byte)
        return torch.cat([marlin_repack_torch(codes[i:i + chunk_experts], chunk_experts)
                          for i in range(0, e, chunk_experts)])
    vals = torch.stack((codes & 0x0F, codes >> 4), dim=-1).reshape(e, n, k)  # [E, N, K]
    # [E, K/16, kk, N/64, j, nn] -> [E, K/16, N/64, j, kk, nn]
    tiles = vals.transpose(1, 2).reshape(e, k // _TILE, _TILE, n // 64, 4, _TILE).permute(0, 1, 3, 4, 2, 5)
    kk, nn = _fragment_index(codes.device)
    frag = tiles[:, :, :, :, kk, nn]  # [E, K/16, N/64, j, 32, 8]
    frag = frag.permute(0, 1, 2, 4, 3, 5).to(torch.int64)  # [E, K/16, N/64, t, j, s]
    words = (frag << (4 * torch.arange(8, device=codes.device))).sum(-1)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return words.reshape(e, k // _TILE, 2 * n)


def marlin_scales(scales: torch.Tensor) -> torch.Tensor:
    """Our E8M0 scales ``uint8 [E, N, K/32]`` -> Marlin's MXFP4 scale layout for BF16
    activations, ``float8_e8m0fnu [E, K/32, N]``: transposed to ``[K/32, N]``, each run of 64
    entries (row-major) transposed as an 8x8 block, then each run of 4 reordered
    ``[0, 2, 1, 3]``. A permutation: the codes are unchanged."""
    if scales.dtype != torch.uint8 or scales.dim() != 3 or scales.shape[1] % 64:
        raise ValueError(f"scales must be uint8 [E, N, K/32] with N % 64 == 0, got "
                         f"{scales.dtype} {tuple(scales.shape)}")
    e, n, groups = scales.shape
    s = scales.transpose(1, 2).contiguous().reshape(-1, 8, 8).transpose(1, 2)
    s = s.reshape(-1, 4)[:, [0, 2, 1, 3]]
    return s.reshape(e, groups, n).contiguous().view(torch.float8_e8m0fnu)


# --------------------------------------------------------------------------------------
# the peer
# --------------------------------------------------------------------------------------

class MarlinMoE:
    """Marlin's MXFP4 MoE over our weights (W4A16), one object per weight set.

    Args:
        w13_codes, w13_scales, w2_codes, w2_scales: our uint8 tensors (module docstring):
            either all ``E`` experts (then ``[first, first + count)`` are taken) or exactly
            the ``count`` local ones. Any device; converted on ``device``.
        first, count: the local experts; ``count=None`` = all from ``first``.
        block_size_m: default M block (8, 16, 32, 48, 64) or None (vLLM's heuristic per call).
        n_experts_total: the model's expert count (the expert map's length; default
            ``E`` of the given weights when they are the full set, else ``first + count``).
        combine: ``"moe_sum"`` (the extension's) or ``"torch"`` (the owner layout's).
        layout: the default call layout, ``"owner"`` or ``"compact"`` (:data:`LAYOUTS`;
            also a per-call argument).
        repack: ``"auto"`` (the extension's ``gptq_marlin_repack`` if loaded, else
            PyTorch), ``"ext"`` or ``"torch"``.
        activation: ``"auto"`` (the extension's ``silu_and_mul`` if loaded, else PyTorch),
            ``"ext"`` or ``"torch"``.
        device: where the converted weights live and calls run (``"cpu"`` builds with the
            PyTorch repack for tests; calls need a GPU).
    """

    def __init__(self, w13_codes, w13_scales, w2_codes, w2_scales, first: int = 0,
                 count: int | None = None, block_size_m: int | None = None, *,
                 n_experts_total: int | None = None, combine: str = "moe_sum", repack: str = "auto",
                 activation: str = "auto", layout: str = "owner", device="cuda"):
        e, lat, inter = check_weights(w13_codes, w13_scales, w2_codes, w2_scales)
        check_int(first, "first")
        if count is None:
            count = e - first
        check_int(count, "count", 1)
        if e >= first + count:
            sl, full_set = slice(first, first + count), True
        elif e == count:
            sl, full_set = slice(0, count), False
        else:
            raise ValueError(f"w13_codes has E={e} experts: pass either all experts (E >= first + "
                             f"count = {first + count}) or exactly count={count} local ones")
        if block_size_m is not None and block_size_m not in BLOCK_SIZES:
            raise ValueError(f"block_size_m must be None or one of {BLOCK_SIZES}, got {block_size_m!r}")
        if combine not in COMBINES:
            raise ValueError(f"combine must be one of {COMBINES}, got {combine!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        for name, v in (("repack", repack), ("activation", activation)):
            if v not in ("auto", "ext", "torch"):
                raise ValueError(f"{name} must be 'auto', 'ext' or 'torch', got {v!r}")
        if n_experts_total is None:
            n_experts_total = e if full_set else first + count
        check_int(n_experts_total, "n_experts_total", first + count)
        if n_experts_total >= 1024:
            raise ValueError(f"n_experts_total={n_experts_total}: moe_align_block_size takes < 1024 experts")
        check_marlin_dims(2 * inter, lat, "FC1 (N = 2I, K = L)")
        check_marlin_dims(lat, inter, "FC2 (N = L, K = I)")
        self.first, self.count, self.latent, self.intermediate = first, count, lat, inter
        self.block_size_m, self.n_experts_total, self.combine = block_size_m, n_experts_total, combine
        self.layout = layout
        self.device = torch.device(device)
        ops = None
        if self.device.type == "cuda":
            ok, why = available()
            if not ok:
                raise RuntimeError(why)
            ops = load_ops()
        has_c = ops is not None and ops["c"] is not None
        for name, v in (("repack", repack), ("activation", activation)):
            if v == "ext" and not has_c:
                raise RuntimeError(f"{name}='ext' needs {fetch_marlin.C_LIB} loaded on a GPU")
        self.repack = "ext" if repack == "ext" or (repack == "auto" and has_c) else "torch"
        self.activation = "ext" if activation == "ext" or (activation == "auto" and has_c) else "torch"
        self._ops = ops
        dev = self.device
        self.w13 = self._repack(w13_codes[sl].to(dev))
        self.w2 = self._repack(w2_codes[sl].to(dev))
        self.w13_scale = marlin_scales(w13_scales[sl].to(dev))
        self.w2_scale = marlin_scales(w2_scales[sl].to(dev))
        self.expert_map = expert_map(first, count, n_experts_total, device=dev)
        # the compact layout's alignment: one more expert id (n_experts_total, every empty
        # slot's) that the map sends to -1, so that empty slots are dropped by the map in
        # every variant of the alignment kernel
        self.compact_map = torch.cat([self.expert_map, torch.full((1,), -1, dtype=torch.int32, device=dev)])
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
        self.workspace = torch.zeros(sms * 4, dtype=torch.int32, device=dev)
        self.bytes_per_expert = expert_bytes(lat, inter)["total"]
        self.stored_bytes_per_expert = sum(t.numel() * t.element_size() for t in
                                           (self.w13, self.w2, self.w13_scale, self.w2_scale)) // count

    def _repack(self, codes: torch.Tensor) -> torch.Tensor:
        if self.repack == "torch":
            return marlin_repack_torch(codes)
        e, n, half_k = codes.shape
        rep = self._ops["c"].gptq_marlin_repack
        empty = torch.empty(0, dtype=torch.int32, device=codes.device)
        out = torch.empty((e, half_k * 2 // _TILE, 2 * n), dtype=torch.int32, device=codes.device)
        for i in range(e):
            out[i] = rep(gptq_order(codes[i]), empty, half_k * 2, n, 4, False)
        return out

    def describe(self) -> dict:
        """The configuration, for a benchmark record."""
        return {"peer": "marlin moe_wna16_marlin_gemm (W4A16 MXFP4)", "wheel": WHEEL,
                "layout": "gptq_marlin_repack int32 [E, K/16, 2N]; E8M0 scales [E, K/32, N] permuted",
                "block_size_m": self.block_size_m, "combine": self.combine, "layout": self.layout,
                "repack": self.repack,
                "activation": "silu_and_mul (" + self.activation + ")", "first": self.first,
                "count": self.count, "n_experts_total": self.n_experts_total, "latent": self.latent,
                "intermediate": self.intermediate, "bytes_per_expert": self.bytes_per_expert,
                "stored_bytes_per_expert": self.stored_bytes_per_expert}

    def choose_block_size(self, rows: int, top_k: int = 16, layout: str = "owner") -> int:
        """This object's ``block_size_m``, or vLLM's heuristic for ``rows`` received rows
        (owner) or ``rows`` compact pair rows (compact: all of them local, ``top_k = 1``)."""
        if self.block_size_m is not None:
            return self.block_size_m
        if layout == "compact":
            return vllm_block_size_m(rows, 1, self.count, self.count)
        return vllm_block_size_m(rows, top_k, self.count, self.n_experts_total)

    def _require_gpu(self, x, ids, weights) -> None:
        if self._ops is None:
            raise RuntimeError(f"MarlinMoE was built on {self.device}; calls need a GPU (device='cuda')")
        for name, t in (("x", x), ("ids", ids), ("weights", weights)):
            if t.device != self.w13.device:
                raise ValueError(f"{name} is on {t.device}, the converted weights on {self.w13.device}")

    def _align(self, ids32: torch.Tensor, bs: int, compact: bool = False):
        dev = ids32.device
        experts = self.n_experts_total + 1 if compact else self.n_experts_total
        n = max_padded_pairs(ids32.numel(), experts, bs)
        sorted_ids = torch.empty(n, dtype=torch.int32, device=dev)
        block_experts = torch.empty(-(-n // bs), dtype=torch.int32, device=dev)
        padded = torch.empty(1, dtype=torch.int32, device=dev)
        self._ops["moe"].moe_align_block_size(ids32, experts, bs, sorted_ids, block_experts, padded,
                                              self.compact_map if compact else self.expert_map)
        return sorted_ids, block_experts, padded

    def _gemm(self, a, c, w, s, route, weights, bs, top_k, mul_weights, m, n, k):
        sorted_ids, block_experts, padded = route
        return self._ops["moe"].moe_wna16_marlin_gemm(
            a, c, w, None, s, None, None, None, None, None, self.workspace, sorted_ids,
            block_experts, padded, weights, bs, top_k, mul_weights, FLOAT4_E2M1F_ID, m, n, k,
            True, False, True, False, -1, -1, -1)

    def _fc1(self, x, ids32, weights, bs, fill: float | None = None):
        r, k = ids32.shape
        route = self._align(ids32, bs)
        shape = (r * k, 2 * self.intermediate)
        h1 = (torch.empty(shape, dtype=torch.bfloat16, device=x.device) if fill is None
              else torch.full(shape, fill, dtype=torch.bfloat16, device=x.device))
        self._gemm(x, h1, self.w13, self.w13_scale, route, weights, bs, k, False, r,
                   2 * self.intermediate, self.latent)
        return route, h1

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 block_size_m: int | None = None, *, layout: str | None = None,
                 capacity: int | None = None) -> torch.Tensor:
        """Align + FC1 + SiLU-and-mul + FC2 (x routing weight) + combine: BF16 ``[R, L]``.

        ``x`` BF16 ``[R, L]`` contiguous, ``ids`` int32/int64 ``[R, K]`` global expert ids
        (distinct per row), ``weights`` FP32 ``[R, K]``; ``block_size_m`` overrides the
        object's. No validation inside (host syncs): run ``check_routing_inputs`` once
        outside the timed region.

        ``layout`` (default: the object's): ``"owner"`` or ``"compact"``; the compact layout
        works on ``capacity`` pair rows (a host int >= the local pair count ``P``: the
        caller's knowledge, e.g. :func:`local_pairs` outside the timed region, as a DEP
        dispatch knows what it received; default ``R K``, always enough). No host sync in
        either layout.
        """
        self._require_gpu(x, ids, weights)
        layout = self.layout if layout is None else layout
        if layout == "compact":
            return self._compact(x, ids, weights, block_size_m, capacity)
        if layout != "owner":
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        r, k = ids.shape
        bs = block_size_m or self.choose_block_size(r, k)
        ids32 = ids if ids.dtype == torch.int32 and ids.is_contiguous() else ids.to(torch.int32).contiguous()
        w = weights if weights.is_contiguous() else weights.contiguous()
        route, h1 = self._fc1(x, ids32, w, bs)
        a = self._activate(h1)
        y2 = torch.empty(r * k, self.latent, dtype=torch.bfloat16, device=x.device)
        self._gemm(a, y2, self.w2, self.w2_scale, route, w, bs, 1, True, r * k, self.latent,
                   self.intermediate)
        if self.combine == "moe_sum":
            out = torch.empty(r, self.latent, dtype=torch.bfloat16, device=x.device)
            self._ops["moe"].moe_sum(y2.view(r, k, self.latent), out, ids32, self.expert_map)
            return out
        keep = (self.expert_map[ids32.long()] >= 0).unsqueeze(-1)
        y = torch.where(keep, y2.view(r, k, self.latent).float(), torch.zeros((), device=x.device))
        return y.sum(dim=1).to(torch.bfloat16)

    def _activate(self, h1: torch.Tensor) -> torch.Tensor:
        """SiLU-and-mul of FC1's ``[M, 2I]`` -> BF16 ``[M, I]``."""
        a = torch.empty(h1.shape[0], self.intermediate, dtype=torch.bfloat16, device=h1.device)
        if self.activation == "ext":
            self._ops["c"].silu_and_mul(a, h1)
        else:
            g, u = h1.split(self.intermediate, dim=1)
            torch.mul(torch.nn.functional.silu(g.float()), u.float(), out=a)
        return a

    def _compact(self, x, ids, weights, block_size_m, capacity):
        """The compact layout: the ``capacity`` pair slots (:func:`compact_pairs`), their
        rows of ``x`` gathered (``[capacity, L]``), one alignment of the slots' expert ids
        (``top_k = 1``: Marlin reads row ``sorted_id`` and writes row ``sorted_id``), FC1
        ``[capacity, 2I]``, SiLU-and-mul ``[capacity, I]``, FC2 x routing weight ``[capacity,
        L]``, then an FP32 ``index_add_`` of the slot rows into ``[R, L]`` (empty slots into a
        dropped row) -> BF16."""
        r, k = ids.shape
        if self.n_experts_total + 1 > MAX_ALIGN_EXPERTS:
            raise ValueError(f"the compact layout aligns n_experts_total + 1 = {self.n_experts_total + 1} "
                             f"expert ids; moe_align_block_size takes at most {MAX_ALIGN_EXPERTS}")
        cap = r * k if capacity is None else check_capacity(capacity)
        bs = block_size_m or self.choose_block_size(cap, 1, "compact")
        rows, dest, slot_ids, slot_w = compact_pairs(ids, weights, self.first, self.count, cap,
                                                     self.n_experts_total)
        slot_w = slot_w.view(cap, 1)  # shaped like the owner call's [R, K] weights, top_k = 1
        xp = x.index_select(0, rows)
        route = self._align(slot_ids, bs, compact=True)
        h1 = torch.empty(cap, 2 * self.intermediate, dtype=torch.bfloat16, device=x.device)
        self._gemm(xp, h1, self.w13, self.w13_scale, route, slot_w, bs, 1, False, cap,
                   2 * self.intermediate, self.latent)
        a = self._activate(h1)
        y2 = torch.empty(cap, self.latent, dtype=torch.bfloat16, device=x.device)
        self._gemm(a, y2, self.w2, self.w2_scale, route, slot_w, bs, 1, True, cap, self.latent,
                   self.intermediate)
        out = torch.zeros(r + 1, self.latent, dtype=torch.float32, device=x.device)
        out.index_add_(0, dest, y2.float())
        return out[:r].to(torch.bfloat16)

    def fc1_pairs(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                  block_size_m: int | None = None) -> torch.Tensor:
        """FC1 alone per pair: float32 ``[R, K, 2I]`` (the BF16 values Marlin wrote; NaN for
        non-local pairs, whose rows Marlin leaves alone)."""
        self._require_gpu(x, ids, weights)
        r, k = ids.shape
        bs = block_size_m or self.choose_block_size(r, k)
        ids32 = ids.to(torch.int32).contiguous()
        _, h1 = self._fc1(x, ids32, weights.contiguous(), bs, fill=float("nan"))
        return h1.float().view(r, k, 2 * self.intermediate)

    def bytes_streamed(self, ids: torch.Tensor) -> int:
        """Our MXFP4 weight bytes one call must read for ``ids`` (host sync)."""
        return touched_experts(ids, self.first, self.count) * self.bytes_per_expert


def rank_moe(weights, first: int, count: int, shard: tuple[int, int] = (0, 1), *,
             n_experts_total: int | None = None, device="cuda", **kw) -> tuple[MarlinMoE | None, str]:
    """The peer over one rank's experts of a ``model.weights.LatentMoEWeights``: experts
    ``[first, first + count)``, the ``shard = (rank, ranks)`` slice of their intermediate
    (gate and up rows of the slice, the matching w2 columns): ``(MarlinMoE, "")`` or
    ``(None, why)`` where the peer cannot run here."""
    ok, why = available()
    if not ok:
        return None, why
    c = weights.config
    w13, s13, w2, s2 = rank_weight_slice(weights, first, count, shard)
    moe = MarlinMoE(w13, s13, w2, s2, first=first, count=count,
                    n_experts_total=n_experts_total or c.experts, device=device, **kw)
    return moe, ""


# --------------------------------------------------------------------------------------
# tiny-problem checks (GPU) and the smoke
# --------------------------------------------------------------------------------------

def check_fc1(*, block_size_m: int = 16, experts: int = 32, latent: int = 256, intermediate: int = 128,
              rows: int = 24, top_k: int = 16, first: int = 8, count: int = 12, seed: int = 0,
              device="cuda", raise_on_fail: bool = True, **kw) -> dict:
    """The converted w13 and the alignment, alone: Marlin's FC1 per local pair vs float64
    ``x @ dequant(w13_e)^T`` from our format.

    Pass, every local pair and column: ``|peer - ref| <= 2^-7 |ref| + L 2^-20 (|x| @
    |w13_e|^T)``: an FP32 sum in any order (``gamma_L <= L 2^-23`` of ``|x| @ |w|``, twice
    that with a factor-4 margin for split-K's extra partial sums) rounded once to BF16 (unit
    roundoff ``2^-8``, doubled); and non-local pairs' rows untouched (NaN). A wrong
    repack, scale permutation or alignment misses by orders of magnitude (``rel_err`` ~ 1).
    """
    w, x, ids, rw = tiny_problem(experts, latent, intermediate, rows, top_k, first, count, seed, device)
    moe = MarlinMoE(*w, first=first, count=count, block_size_m=block_size_m, device=device, **kw)
    check_routing_inputs(x, ids, rw, latent=latent, n_experts_total=experts)
    got = moe.fc1_pairs(x, ids, rw)
    if got.is_cuda:
        torch.cuda.synchronize()
    loc = local_mask(ids, first, count)
    rr, kk = loc.nonzero(as_tuple=True)
    ref, absdot = per_expert_float64(x.double()[rr], ids[rr, kk], w[0], w[1], lambda a, b: a @ b.T, with_abs=True)
    peer = got[rr, kk].double()
    bound = 2.0 ** -7 * ref.abs() + latent * 2.0 ** -20 * absdot
    err = (peer - ref).abs()
    untouched = bool(torch.isnan(got[~loc]).all())
    ok = bool(torch.isfinite(peer).all()) and untouched and bool((err <= bound).all())
    res = {"ok": ok, "max_ratio": float((err / bound.clamp_min(1e-300)).max()),
           "rel_err": float((peer - ref).norm() / ref.norm().clamp_min(1e-300)),
           "pairs": int(rr.numel()), "nonlocal_rows_untouched": untouched,
           "config": {"block_size_m": block_size_m, "repack": moe.repack, "experts": experts,
                      "latent": latent, "intermediate": intermediate, "rows": rows,
                      "first": first, "count": count}}
    if raise_on_fail and not ok:
        raise AssertionError(f"Marlin peer FC1 check failed: {res}")
    return res


def check_forward(*, block_size_m: int = 16, combine: str = "moe_sum", experts: int = 32, latent: int = 256,
                  intermediate: int = 128, rows: int = 24, top_k: int = 16, first: int = 8, count: int = 12,
                  seed: int = 0, device="cuda", layout: str = "owner", capacity: int | None = None,
                  raise_on_fail: bool = True, _impl=None, **kw) -> dict:
    """A whole call on a tiny problem (default: experts ``[8, 20)`` of 32 local, top-16, L =
    256, I = 128; row 0 has no local pair) vs a float64 model of the same computation with
    the kernels' rounding points: ``h1 = bf16(x @ W13_e^T)``; ``a = bf16(silu(h1_gate)
    h1_up)``; per pair ``bf16(w_p (a @ W2_e^T))``; the FP32 sum of a row's local pairs ->
    BF16.

    Pass: each row with a local pair ``||peer - ref|| <= 2^-6 ||ref||`` (four BF16 unit
    roundoffs: a flipped rounding of ``h1`` or ``a`` where the FP32 sums differ in order,
    and the combine's own BF16 additions if ``moe_sum`` accumulates in BF16, up to ~7
    additions here); rows without one exactly zero. A wrong w2, routing weight or scatter
    gives ``~1``. ``layout="compact"`` calls with ``capacity`` (default: the problem's local
    pair count, a host int computed before the call, as the benchmark does; ``combine``
    does not apply: the compact combine is an FP32 ``index_add_``).
    """
    w, x, ids, rw = tiny_problem(experts, latent, intermediate, rows, top_k, first, count, seed, device)
    moe = (_impl or MarlinMoE)(*w, first=first, count=count, block_size_m=block_size_m, combine=combine,
                               device=device, **kw)
    check_routing_inputs(x, ids, rw, latent=latent, n_experts_total=experts)
    if layout == "owner":
        y = moe(x, ids, rw)
    else:
        cap = max(1, local_pairs(ids, first, count)) if capacity is None else capacity
        y = moe(x, ids, rw, layout=layout, capacity=cap)
    if y.is_cuda:
        torch.cuda.synchronize()
    loc = local_mask(ids, first, count)
    rr, kk = loc.nonzero(as_tuple=True)
    e = ids[rr, kk]
    h = per_expert_float64(x.double()[rr], e, w[0], w[1], lambda a, b: a @ b.T).to(torch.bfloat16).float()
    a = (torch.nn.functional.silu(h[:, :intermediate]) * h[:, intermediate:]).to(torch.bfloat16).double()
    o = (per_expert_float64(a, e, w[2], w[3], lambda a_, b: a_ @ b.T) * rw[rr, kk].double().unsqueeze(1))
    o = o.to(torch.bfloat16).float()
    ref = torch.zeros(rows, latent, dtype=torch.float32, device=x.device).index_add_(0, rr, o)
    ref = ref.to(torch.bfloat16).double()
    has = loc.any(dim=1)
    row_err = (y.double() - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-300)
    worst = float(row_err[has].max()) if bool(has.any()) else 0.0
    zero_rows_ok = bool((y[~has] == 0).all())
    ok = (tuple(y.shape) == (rows, latent) and y.dtype == torch.bfloat16
          and bool(torch.isfinite(y.double()).all()) and worst <= 2.0 ** -6 and zero_rows_ok)
    res = {"ok": ok, "worst_row_rel_err": worst, "rows_without_local_pair": int((~has).sum()),
           "zero_rows_ok": zero_rows_ok,
           "config": {"block_size_m": block_size_m, "layout": layout,
                      "combine": combine if layout == "owner" else "index_add_",
                      "repack": moe.repack, "activation": moe.activation, "experts": experts, "latent": latent,
                      "intermediate": intermediate, "rows": rows, "first": first, "count": count}}
    if raise_on_fail and not ok:
        raise AssertionError(f"Marlin peer forward check failed: {res}")
    return res


def passing_combine(device="cuda") -> tuple[str | None, list]:
    """The first of ``COMBINES`` whose :func:`check_forward` passes at every block size
    (and ``check_fc1`` at 8 and 64), with the check records: ``(combine or None, checks)``
    (the owner layout's; :func:`compact_passes` checks the compact layout)."""
    checks = [check_fc1(block_size_m=bs, device=device, raise_on_fail=False) for bs in (8, 64)]
    if not all(c["ok"] for c in checks):
        return None, checks
    for combine in COMBINES:
        runs = [check_forward(block_size_m=bs, combine=combine, device=device, raise_on_fail=False)
                for bs in BLOCK_SIZES]
        checks += runs
        if all(c["ok"] for c in runs):
            return combine, checks
    return None, checks


def compact_passes(device="cuda", _impl=None) -> tuple[bool, list]:
    """The compact layout's :func:`check_forward` at every block size, on the DEP-like
    subset at the exact pair count and with spare capacity (``R K``, empty slots), and
    with all experts local: ``(all passed, checks)``."""
    kw = dict(device=device, layout="compact", raise_on_fail=False, _impl=_impl)
    checks = [check_forward(block_size_m=bs, **kw) for bs in BLOCK_SIZES]
    checks.append(check_forward(block_size_m=16, capacity=24 * 16, **kw))
    checks.append(check_forward(block_size_m=48, first=0, count=32, **kw))
    return all(c["ok"] for c in checks), checks



def smoke(device="cuda", tokens: int = 4) -> dict:
    """GPU smoke: load; where both libraries loaded, :func:`marlin_repack_torch` byte-equal to
    ``gptq_marlin_repack`` (tiny and real shapes); the tiny checks (:func:`passing_combine`);
    then one DEP16 rank at the real dimensions (experts ``[280, 336)`` of 896, I = 3072,
    ``tokens`` per rank -> ``16 tokens`` rows): eager vs CUDA-graph replay (equal), and a
    warm-L2 time per ``block_size_m``. The compact layout too: its tiny checks
    (:func:`compact_passes`), its output at the real dimensions against the owner layout's
    (each row within ``2^-6`` relative: the same products, other combine roundings), its
    graph replay against eager (within the same bound: ``index_add_``'s FP32 atomics may
    order the sums of a row with three or more local pairs differently), and its warm-L2
    time per ``block_size_m``."""
    from benchmarks.gpu_timing import graph_replay_us

    ok, why = available()
    if not ok:
        raise RuntimeError(why)
    out = {"versions": versions(), "set": ops_set()}
    if ops_set() == "full":
        same = {}
        for name, (e, n, k) in {"tiny": (3, 256, 256), "fc1_real": (2, 6144, 3584),
                                "fc2_real": (2, 3584, 3072)}.items():
            codes = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=device)
            moe_c = load_ops()["c"]
            ext = torch.stack([moe_c.gptq_marlin_repack(gptq_order(codes[i]),
                                                        torch.empty(0, dtype=torch.int32, device=device),
                                                        k, n, 4, False) for i in range(e)])
            same[name] = bool(torch.equal(ext, marlin_repack_torch(codes)))
        out["torch_repack_equals_ext"] = same
    started = time.time()
    combine, checks = passing_combine(device)
    out["first_checks_s"] = round(time.time() - started, 1)  # includes the kernels' JIT
    out["checks"], out["combine"] = checks, combine
    compact_ok, out["compact_checks"] = compact_passes(device)
    out["compact_checks_ok"] = compact_ok
    if combine is None:
        out["ok"] = False
        return out
    first, count, total = 5 * 56, 56, 896
    w = random_weights(count, 3584, 3072, device=device, seed=1)
    rows = 16 * tokens
    g = torch.Generator(device=device).manual_seed(7)
    ids = torch.rand(rows, total, generator=g, device=device).topk(16, dim=1).indices.int()
    rw = torch.rand(rows, 16, generator=g, device=device)
    rw = rw / rw.sum(1, keepdim=True)
    x = torch.randn(rows, 3584, generator=g, device=device).to(torch.bfloat16)
    moe = MarlinMoE(*w, first=first, count=count, n_experts_total=total, combine=combine, device=device)
    check_routing_inputs(x, ids, rw, latent=3584, n_experts_total=total)
    nbytes = moe.bytes_streamed(ids)
    real = {"rows": rows, "touched": touched_experts(ids, first, count), "bytes_streamed": nbytes,
            "vllm_block_size_m": moe.choose_block_size(rows), "describe": moe.describe(), "us": {}}
    eager = moe(x, ids, rw, block_size_m=16)
    static = {}

    def fn():
        static["y"] = moe(x, ids, rw, block_size_m=16)
    real["us"][16] = round(graph_replay_us(fn), 1)
    real["graph_equals_eager"] = bool(torch.equal(static["y"], eager))
    for bs in BLOCK_SIZES:
        if bs != 16:
            real["us"][bs] = round(graph_replay_us(lambda bs=bs: moe(x, ids, rw, block_size_m=bs)), 1)
    cap = local_pairs(ids, first, count)
    real["local_pairs"] = cap
    compact = moe(x, ids, rw, block_size_m=16, layout="compact", capacity=cap)

    def rows_close(a, b):
        err = (a.double() - b.double()).norm(dim=1) / b.double().norm(dim=1).clamp_min(1e-300)
        zero = b.double().norm(dim=1) == 0
        return bool((err[~zero] <= 2.0 ** -6).all()) and bool((a[zero] == 0).all())

    real["compact_close_to_owner"] = rows_close(compact, eager)

    def fn_c():
        static["c"] = moe(x, ids, rw, block_size_m=16, layout="compact", capacity=cap)
    real["compact_us"] = {16: round(graph_replay_us(fn_c), 1)}
    real["compact_graph_close_to_eager"] = rows_close(static["c"], compact)
    for bs in BLOCK_SIZES:
        if bs != 16:
            real["compact_us"][bs] = round(graph_replay_us(
                lambda bs=bs: moe(x, ids, rw, block_size_m=bs, layout="compact", capacity=cap)), 1)
    out["dep16_rank"] = real
    out["ok"] = (real["graph_equals_eager"] and all(out.get("torch_repack_equals_ext", {}).values())
                 and compact_ok and real["compact_close_to_owner"] and real["compact_graph_close_to_eager"])
    return out


if __name__ == "__main__":
    res = smoke()
    print(json.dumps(res, indent=1, default=str))
    sys.exit(0 if res["ok"] else 1)
