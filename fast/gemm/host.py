"""Host side of the split-K GEMM: the tactic table, kernels compiled once per tactic shape,
workspace and tile counters allocated once per GEMM object, every argument checked before
the launch.

A call of ``T`` rows launches one kernel (``launch_for``): ``T <= 64`` one token chunk of
``ceil(T / 8)`` windows (S1's calls), more rows ``ceil(T / 64)`` chunks on the grid's
second dimension (``fast.gemm.layout.token_chunks``; S2's 65..1024 rows). A weight whose
rows are not a multiple of 64 is padded once at construction (``layout.padded_rows``).
Each ``DenseGemm`` has one K split (``DenseGemm.splits``) that every default tactic of every
``T`` uses, so its default GEMM is batch invariant at every row count it serves."""

from __future__ import annotations

import dataclasses
import typing

import torch

from fast import backend
from fast.device.compile import compiled, frozen
from fast.gemm.mma_kind import check_overlap
from fast.gemm.tiled_layout import check_tiled_options
from fast.gemm.layout import (MAX_CALL_TOKENS, MAX_TOKENS, MAX_WINDOWS, Tactic,
                              check_chunk_windows, chunk_workspace_bytes, padded_rows,
                              token_chunks, CHUNK_WINDOWS)

__all__ = ["DenseGemm", "choose_tactic", "splits_of", "splits_for_rows", "CANDIDATES",
           "DEFAULT_TACTICS", "WGMMA_TILES", "PDL_MAX_TOKENS", "check_serial_from",
           "check_chunk_windows", "check_forms", "check_form_stages", "form_at", "form_key_at",
           "FORM_KEYS",
           "check_tiled_form",
           "default_tactic", "compile_kernel", "kernel_shapes", "Launch", "launch_for",
           "check_weight_shape", "check_weight_placement", "check_gemm_call"]

_R64, _R128 = dict(warps=2, mtiles=2), dict(warps=4, mtiles=2)
_R128M4, _R256M4 = dict(warps=2, mtiles=4), dict(warps=4, mtiles=4, occupancy=1)
_R64DEEP = dict(warps=2, mtiles=2, occupancy=1, ring=12)
_K128 = dict(stage_k=128)

#: The tactics considered for the layer's four dense GEMMs (kimi_k3 shapes ``(N, K)``): each
#: is verified (``verify/test_gemm_fast.py``) and timed (``benchmarks/dense_table.py``); all
#: launch one wave on an H200 (132 multiprocessors). Seven kernel shapes serve them all
#: (``splits`` is a run-time value): tiles of 64 rows (2 warps x 2 m-tiles), 128 rows (4 x 2,
#: or 2 x 4: each B fragment feeds 4 m-tiles) at 2 CTAs per multiprocessor, 256 rows (4 x 4)
#: at one, and 64 rows at one CTA per multiprocessor with a 12-stage ring (more bytes in
#: flight where the grid has fewer CTAs than multiprocessors); and the 64- and 128-row tiles
#: in 128-k ring stages (``_K128``: half the stage barriers, the same bits as their 64-k
#: forms), the forms that one H100 measured fastest at T <= 8 (the four GEMMs in one graph at
#: 0.85-0.86 of their bytes against 0.80-0.81; ``docs/ledger.md``), not yet timed on the H200.
CANDIDATES: dict[tuple[int, int], tuple[Tactic, ...]] = {
    (15872, 7168): (  # front [shared gate_up | latent down], BF16 out
        Tactic(**_R128, splits=1), Tactic(**_R128, splits=2), Tactic(**_R64, splits=1),
        Tactic(**_R128M4, splits=1), Tactic(**_R128M4, splits=2), Tactic(**_R256M4, splits=2),
        Tactic(**_R128, splits=1, **_K128), Tactic(**_R64, splits=1, **_K128)),
    (896, 7168): (  # router gate, FP32 out
        Tactic(**_R64, splits=4), Tactic(**_R64, splits=8), Tactic(**_R64, splits=16),
        Tactic(**_R128M4, splits=16), Tactic(**_R64, splits=8, **_K128)),
    (7168, 6144): (  # shared down, BF16 out
        Tactic(**_R128, splits=2), Tactic(**_R128, splits=4), Tactic(**_R64, splits=1),
        Tactic(**_R64, splits=2), Tactic(**_R128M4, splits=2), Tactic(**_R128M4, splits=4),
        Tactic(**_R64DEEP, splits=1), Tactic(**_R64, splits=1, **_K128),
        Tactic(**_R64, splits=2, **_K128), Tactic(**_R128, splits=2, **_K128)),
    (7168, 3584): (  # latent up + shared (addend), BF16 out
        Tactic(**_R128, splits=2), Tactic(**_R128, splits=4), Tactic(**_R64, splits=1),
        Tactic(**_R64, splits=2), Tactic(**_R128M4, splits=2), Tactic(**_R128M4, splits=4),
        Tactic(**_R64DEEP, splits=1), Tactic(**_R64, splits=1, **_K128),
        Tactic(**_R64, splits=2, **_K128), Tactic(**_R128, splits=2, **_K128)),
}

#: Default tactic per shape and batch bucket (largest T of the bucket -> tactic). **One
#: ``splits`` per shape at every T**, so a token's bits never depend on the batch it is
#: computed in (the tile shape, which is all the buckets change, moves no bit; the GPU
#: contracts ``verify/test_gemm_fast.py`` and ``verify/test_dep_fast.py`` check it). Per
#: shape, the split whose best tactic took the least time over T = 1..64 in two runs on the
#: H200 (benchmarks/results/h200/dense.json, dense-rerun.json), and per bucket the fastest
#: tactic of that split. Against the fastest tactic of any split, per T: the front (split 1)
#: 2.7-2.9 us slower at T = 56-64 (than split 2), shared down and up (split 2) 0.5-1.5 us
#: slower at T <= 8 (than split 1) and up to 1.8 us at T = 64 (than split 4).
DEFAULT_TACTICS: dict[tuple[int, int], dict[int, Tactic]] = {
    (15872, 7168): {16: Tactic(**_R64, splits=1), 64: Tactic(**_R128, splits=1)},
    (896, 7168): {64: Tactic(**_R64, splits=8)},
    (7168, 6144): {24: Tactic(**_R64, splits=2), 64: Tactic(**_R128, splits=2)},
    (7168, 3584): {24: Tactic(**_R64, splits=2), 64: Tactic(**_R128, splits=2)},
}


def splits_of(n: int, k: int, sms: int = 132) -> int:
    """The K splits of an ``[N, K]`` weight's default tactic, the same at every batch (one
    summation order per output element: ``DEFAULT_TACTICS``' rule, and the fallback of
    ``choose_tactic``, which depends on N, K and ``sms`` only)."""
    return _one_chunk_tactic(n, k, 1, sms).splits


def splits_for_rows(n: int, k: int, tokens: int, sms: int = 132) -> int:
    """The fewest K splits (doubled from 1 while ``K`` still divides into ``2 splits``
    stages of 64) that give a call of ``tokens`` rows at least ``sms`` CTAs of 64-row tiles
    (``padded_rows(N) / 64`` tiles x splits x ``token_chunks(tokens)`` chunks): the K split
    of a GEMM whose *smallest* call has ``tokens`` rows (S2's layers: ``front_max + 1``),
    fixed for all its calls. A function of N, K, ``tokens`` and ``sms`` only: every layer of
    one config on one GPU model sums in the same order."""
    tiles = padded_rows(n) // 64
    chunks = token_chunks(tokens)[0]
    splits = 1
    while tiles * splits * chunks < sms and k % (2 * splits * 64) == 0:
        splits *= 2
    return splits


#: The tiles ``choose_tactic(..., wgmma=True)`` gives (at any ``splits``): 4 warps of one
#: (64 rows) or two (128 rows) m-tiles; what a ``DenseGemm(wgmma=True)`` compiles.
WGMMA_TILES = (Tactic(warps=4, mtiles=1, wgmma=True), Tactic(warps=4, mtiles=2, wgmma=True))


#: Calls of at most this many tokens launch with programmatic dependent launch by default
#: (``DenseGemm(pdl=None)``). Measured on the H200 (the four GEMMs in one graph): 3.5-4 us
#: faster at T <= 8, 1-1.5 us at 12-16, but 6-26 us slower from T = 24 on, where the
#: compute-heavier CTAs of a kernel that launched early are packed two per multiprocessor.
PDL_MAX_TOKENS = 16


def choose_tactic(n: int, k: int, tokens: int, sms: int = 132,
                  splits: int | None = None, wgmma: bool = False, serial: bool = False,
                  overlap: bool = False, chunk_windows: int = MAX_WINDOWS,
                  stage_k: int = 64) -> Tactic:
    """The default tactic of an ``[N, K]`` weight (``N`` its padded rows,
    ``layout.padded_rows``) at ``tokens`` rows, with ``splits`` K splits (default
    ``splits_of(N, K, sms)``), on ``mma.sync`` or (``wgmma``) on the warpgroup MMA.

    Up to 64 tokens, where ``splits`` is that default: the measured table for the layer's
    shapes; otherwise 64-row tiles (128 where N allows one wave of them) with the fewest K
    splits (dividing K into multiples of 64) that give at least ``sms`` CTAs. Other
    ``splits``, or more than 64 tokens (token chunks, ``layout.token_chunks``): 128-row
    tiles where N allows them and they still make ``sms`` CTAs (tiles x splits x chunks),
    else 64-row tiles; two m-tiles per warp, so a chunk's 8 windows fit the registers.
    ``wgmma``: the same rule at every ``tokens`` (the measured table is ``mma.sync``'s), on
    4 warps of one (64 rows) or two (128 rows) m-tiles. Either way neither ``splits`` nor
    the MMA kind depends on ``tokens``: the default GEMM is batch invariant.
    ``serial``: the same tactic with its splits run one after another in each CTA
    (``Tactic.serial``: the same bits), its tile chosen for ``tiles x chunks`` CTAs.
    ``overlap`` (with ``wgmma`` only; ``Tactic`` refuses it otherwise): each stage's MMAs
    left in flight (``Tactic.overlap``: the same bits). ``chunk_windows`` 16 (with
    ``wgmma`` only; ``Tactic`` refuses it otherwise): token chunks of up to 128 rows
    (``Tactic.chunk_windows``: the same bits), one m-tile per warp (a chunk's 16 windows
    fill the registers), so 4 warps for 64-row tiles and 8 for 128-row ones (at one CTA per
    multiprocessor: 8 such warps take more than 128 registers each). ``stage_k`` 128 (not
    with the measured table): 128-k ring stages (half the stages and barriers per K; the
    same bits), at one CTA per multiprocessor where the tile's own occupancy leaves no ring
    of 3 stages."""
    if tokens <= MAX_TOKENS and not wgmma and not serial and not overlap and stage_k == 64:
        one = _one_chunk_tactic(n, k, tokens, sms)
        if splits is None or splits == one.splits:
            return one
    if splits is None:
        splits = splits_of(n, k, sms)
    chunks = token_chunks(tokens, chunk_windows)[0]
    ctas_per_tile = chunks * (1 if serial else splits)
    rows = 128 if n % 128 == 0 and n // 128 * ctas_per_tile >= sms else 64
    if wgmma and chunk_windows > MAX_WINDOWS:
        # 8 warps of 16 windows need more than 128 registers: one CTA per multiprocessor
        tactic = Tactic(warps=rows // 16, mtiles=1, splits=splits, wgmma=True, serial=serial,
                        overlap=overlap, chunk_windows=chunk_windows,
                        occupancy=1 if rows == 128 else None)
    elif wgmma:
        tactic = Tactic(warps=4, mtiles=rows // 64, splits=splits, wgmma=True, serial=serial,
                        overlap=overlap)
    else:
        tactic = Tactic(warps=rows // 32, mtiles=2, splits=splits, serial=serial,
                        overlap=overlap)
    return tactic if stage_k == tactic.stage_k else _with_stage_k(tactic, stage_k, tokens)


def _with_stage_k(tactic: Tactic, stage_k: int, tokens: int) -> Tactic:
    """``tactic`` with ``stage_k``-wide stages: at its own occupancy where a ring of 3
    stages fits, else at one CTA per multiprocessor."""
    wide = dataclasses.replace(tactic, stage_k=stage_k)
    windows = wide.chunks(tokens)[1]
    try:
        if wide.kernel_params(windows)["ring"] >= 3:
            return wide
    except ValueError:
        pass
    return dataclasses.replace(wide, occupancy=1)


def _one_chunk_tactic(n: int, k: int, tokens: int, sms: int) -> Tactic:
    """``choose_tactic`` of a call of at most 64 tokens at the shape's own K split: the
    measured table (``DEFAULT_TACTICS``), else the rule (``choose_tactic``'s docstring)."""
    table = DEFAULT_TACTICS.get((n, k))
    if table:
        for top in sorted(table):
            if tokens <= top:
                return table[top]
    rows = 128 if n % 128 == 0 and n // 128 >= sms else 64
    tiles = n // rows
    splits = 1
    while tiles * splits < sms and k % (2 * splits * 64) == 0:
        splits *= 2
    return Tactic(warps=rows // 32, mtiles=2, splits=splits)


class Launch(typing.NamedTuple):
    """What one call launches (``launch_for``): its ``tactic``; ``chunks`` token chunks of
    ``windows`` windows each (``layout.token_chunks``); ``params``, the kernel's
    compile-time parameters (``Tactic.kernel_params``; ``chunked`` for more than one chunk
    or a padded weight); ``grid``, the CTAs per chunk (tiles x splits; tiles for a
    ``serial`` tactic)."""

    tactic: Tactic
    chunks: int
    windows: int
    params: dict
    grid: int


def launch_for(n: int, k: int, tokens: int, *, splits: int | None = None,
               tactic: Tactic | None = None, sms: int = 132, wgmma: bool = False,
               serial: bool = False, overlap: bool = False) -> Launch:
    """The launch of a call of ``tokens`` rows on an ``[N, K]`` weight (``N`` its real
    rows: the kernel runs ``padded_rows(N)``): ``tactic`` or the default
    (``choose_tactic`` with ``splits``, ``wgmma``, ``serial`` and ``overlap``). Pure Python (what ``DenseGemm`` launches and the
    layers compile at construction; ``tests/test_gemm_fast.py`` checks it on the CPU).

    Raises ValueError: a tactic whose tile does not divide the padded rows, whose K split
    does not divide K into its stages, or that does not serve ``tokens`` rows."""
    rows = padded_rows(n)
    tactic = tactic or choose_tactic(rows, k, tokens, sms, splits, wgmma, serial, overlap)
    if rows % tactic.tile_rows:
        raise ValueError(f"N={n} (padded to {rows} rows) is not a multiple of the tactic's "
                         f"{tactic.tile_rows}-row tile ({tactic})")
    if k % (tactic.splits * tactic.stage_k):
        raise ValueError(f"K={k} is not a multiple of splits * stage_k = "
                         f"{tactic.splits} * {tactic.stage_k} ({tactic})")
    chunks, windows = tactic.chunks(tokens)
    if not tactic.serves(tokens):
        raise ValueError(f"tactic {tactic.label()} does not serve {tokens} tokens "
                         f"({tactic.tiles_per_warp(windows)} accumulator tiles per warp at "
                         f"{windows} windows per chunk > {tactic.max_tiles()})")
    params = tactic.kernel_params(windows, chunked=chunks > 1 or rows != n)
    return Launch(tactic, chunks, windows, params,
                  rows // tactic.tile_rows * (1 if tactic.serial else tactic.splits))


def kernel_shapes(tactics) -> list[dict]:
    """The distinct compile-time kernel parameters of ``tactics`` at every window count."""
    seen = []
    for t in tactics:
        for windows in range(1, t.chunk_windows + 1):
            if t.tiles_per_warp(windows) > t.max_tiles():
                continue
            params = t.kernel_params(windows)
            if params not in seen:
                seen.append(params)
    return seen


def compile_kernel(arch: str, **params):
    """Compile the kernel of one shape (``Tactic.kernel_params``) for ``arch``; no GPU
    needed. Cached per (arch, shape) by ``fast.device.compile``."""
    if arch not in backend.TARGETS:
        raise ValueError(f"arch must be one of {backend.TARGETS}, got {arch!r}")
    if params.get("wgmma") and arch != "sm_90a":
        raise ValueError(f"fast.gemm: tactic wgmma needs sm_90a (warpgroup MMA is Hopper's), "
                         f"the target is {arch}")
    from fast.gemm.kernel import SplitKGemmKernel

    return compiled(SplitKGemmKernel, arch, frozen(params))


def check_serial_from(owner: str, name: str, value) -> None:
    """Refuse, naming ``owner`` and the argument ``name``, a row count from which calls run
    serial splits (``DenseGemm(serial_from=...)`` and the wide layers'
    ``invariant_serial_from``) that is not None or a positive int."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{owner}: {name} must be None or a positive int (rows), got {value!r}")


#: What a form of ``DenseGemm(forms=...)`` may set: the default tactic's token-chunk
#: width, serial splits, MMAs in flight and ring-stage width, or, alone, ``tiled``: the
#: calls run ``fast.gemm.TiledGemm`` instead (none of them moves a bit).
FORM_KEYS = ("chunk_windows", "serial", "overlap", "stage_k", "tiled")


def check_tiled_form(owner: str, where: str, tiled, wgmma: bool) -> None:
    """Refuse, naming ``owner`` and ``where``, a form's ``tiled`` entry on a GEMM that is
    not on the warpgroup MMA (the tiled kernel reproduces the warpgroup MMA's bits only) or
    whose options ``fast.gemm.tiled_layout.check_tiled_options`` refuses."""
    if not wgmma:
        raise ValueError(f"{owner}: {where}: a tiled form runs fast.gemm.TiledGemm, whose bits "
                         "are the warpgroup MMA's: it needs wgmma=True")
    check_tiled_options(owner, tiled, where)


def check_forms(owner: str, name: str, forms, wgmma: bool) -> None:
    """Refuse, naming ``owner`` and the argument ``name``, a table of forms (``{rows_from:
    {key: value}}``, ``FORM_KEYS``) that is not None or such a dict: ``rows_from`` a
    positive int, ``chunk_windows`` as ``check_chunk_windows``, ``serial`` a bool,
    ``overlap`` as ``fast.gemm.mma_kind.check_overlap`` on the kind ``wgmma`` says,
    ``stage_k`` 64 or 128 (:func:`check_form_stages`: whole stages per K split)."""
    if forms is None:
        return
    if not isinstance(forms, dict):
        raise ValueError(f"{owner}: {name} must be None or a dict {{rows_from: form}}, got "
                         f"{type(forms).__name__}")
    for rows_from, form in forms.items():
        where = f"{name}[{rows_from!r}]"
        if type(rows_from) is not int or rows_from < 1:
            raise ValueError(f"{owner}: {name}'s keys must be positive ints (the rows a form "
                             f"applies from), got {rows_from!r}")
        if not isinstance(form, dict) or not set(form) <= set(FORM_KEYS):
            raise ValueError(f"{owner}: {where} must be a dict with keys among {FORM_KEYS}, "
                             f"got {form!r}")
        if "tiled" in form:
            if len(form) > 1:
                raise ValueError(f"{owner}: {where}: a tiled form takes no other key (they are "
                                 f"the split-K kernel's), got {form!r}")
            check_tiled_form(owner, f"{where}['tiled']", form["tiled"], wgmma)
        if "chunk_windows" in form:
            check_chunk_windows(owner, f"{where}['chunk_windows']", form["chunk_windows"], wgmma)
        if "serial" in form and not isinstance(form["serial"], bool):
            raise ValueError(f"{owner}: {where}['serial'] must be a bool, got {form['serial']!r}")
        if "overlap" in form:
            check_overlap(owner, form["overlap"], "wgmma" if wgmma else "mma.sync",
                          name=f"{where}['overlap']")
        if "stage_k" in form and (type(form["stage_k"]) is not int
                                  or form["stage_k"] not in (64, 128)):
            raise ValueError(f"{owner}: {where}['stage_k'] must be 64 or 128, got "
                             f"{form['stage_k']!r}")


def check_form_stages(owner: str, name: str, forms, k: int, splits: int) -> None:
    """Refuse, naming ``owner`` and ``name``, a form of ``forms`` (checked by
    :func:`check_forms`) whose ``stage_k`` does not cut each of ``splits`` K splits of ``k``
    into whole stages."""
    for rows_from, form in (forms or {}).items():
        stage_k = form.get("stage_k", 64)
        if k % (splits * stage_k):
            raise ValueError(f"{owner}: {name}[{rows_from!r}]['stage_k']={stage_k} does not "
                             f"divide the {splits} splits of K={k} into whole stages")


def form_key_at(forms: dict | None, tokens: int) -> int | None:
    """The ``rows_from`` of the form of ``forms`` a call of ``tokens`` rows takes: the
    largest ``rows_from <= tokens``, else None."""
    return max((r for r in (forms or {}) if r <= tokens), default=None)


def form_at(forms: dict | None, tokens: int) -> dict:
    """The form of ``forms`` (:func:`check_forms`) a call of ``tokens`` rows takes: the one
    of :func:`form_key_at`, else none (``{}``)."""
    key = form_key_at(forms, tokens)
    return {} if key is None else dict(forms[key])


def default_tactic(n: int, k: int, tokens: int, sms: int, splits: int, wgmma: bool,
                   serial_from: int | None = None, overlap: bool = False,
                   chunk_windows: int = MAX_WINDOWS, forms: dict | None = None) -> Tactic:
    """A ``DenseGemm``'s default tactic at ``tokens`` rows from its settings (pure Python;
    ``n`` its padded rows): ``choose_tactic`` at its ``splits`` and MMA kind, serial splits
    from ``serial_from`` rows, ``overlap``, ``chunk_windows`` above 64 rows, each overridden
    by the call's form of ``forms`` (:func:`form_at`)."""
    form = form_at(forms, tokens)
    serial = form.get("serial", serial_from is not None and tokens >= serial_from)
    windows = form.get("chunk_windows", chunk_windows)
    return choose_tactic(n, k, tokens, sms, splits, wgmma, serial, form.get("overlap", overlap),
                         windows if tokens > MAX_TOKENS else MAX_WINDOWS,
                         form.get("stage_k", 64))


_BF16, _F32 = torch.bfloat16, torch.float32


def check_weight_shape(owner: str, weight) -> tuple[int, int]:
    """``(N, K)`` of a GEMM weight, refused (TypeError / ValueError starting with ``owner``)
    unless a 2-D bfloat16 tensor with N > 0 and K a positive multiple of 64 (the kernels'
    64-wide stages)."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{owner}: weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dtype != _BF16 or weight.dim() != 2:
        raise ValueError(f"{owner}: weight must be a 2-D bfloat16 [N, K] tensor, got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    if k % 64 or k == 0 or n == 0:
        raise ValueError(f"{owner}: weight [N, K] = [{n}, {k}] needs N > 0 and K a positive "
                         "multiple of 64 (the kernel's 64-wide stages)")
    return n, k


def check_weight_placement(owner: str, weight: torch.Tensor) -> None:
    """Refuse (ValueError starting with ``owner``) a weight that is not on a CUDA device,
    contiguous and 16-byte aligned."""
    if weight.device.type != "cuda":
        raise ValueError(f"{owner}: weight must be on a CUDA device, got {weight.device}")
    if not weight.is_contiguous() or weight.data_ptr() % 16:
        raise ValueError(f"{owner}: weight must be contiguous and 16-byte aligned")


def check_gemm_call(owner: str, x, out, out_dtype, addend, *, n: int, k: int, max_tokens: int,
                    device) -> int:
    """Refuse (ValueError / TypeError starting with ``owner`` and naming the argument) a GEMM
    call's ``x`` (BF16 ``[T, K]``, ``1 <= T <= max_tokens``, contiguous, 16-byte aligned,
    on ``device``), ``out_dtype`` (BF16 or FP32), ``addend`` (BF16 or FP32 ``[T, N]``) or
    ``out`` (``out_dtype`` ``[T, N]``; the addend itself or not overlapping it); returns
    ``T``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{owner}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != _BF16 or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"{owner}: x must be bfloat16 [T, K={k}], got {x.dtype} "
                         f"{tuple(x.shape)}")
    t = x.shape[0]
    if not 1 <= t <= max_tokens:
        raise ValueError(f"{owner}: x has {t} rows; this GEMM serves 1..{max_tokens} "
                         f"(max_tokens)")
    if x.device != device:
        raise ValueError(f"{owner}: x is on {x.device}, the weight on {device}")
    if not x.is_contiguous() or x.data_ptr() % 16:
        raise ValueError(f"{owner}: x must be contiguous and 16-byte aligned")
    if out_dtype not in (_BF16, _F32):
        raise ValueError(f"{owner}: out_dtype must be torch.bfloat16 or torch.float32, got "
                         f"{out_dtype}")
    if addend is not None:
        if not isinstance(addend, torch.Tensor) or addend.dtype not in (_BF16, _F32):
            raise ValueError(f"{owner}: addend must be a bfloat16 or float32 tensor, got "
                             f"{getattr(addend, 'dtype', type(addend).__name__)}")
        if tuple(addend.shape) != (t, n) or not addend.is_contiguous() or addend.device != device:
            raise ValueError(f"{owner}: addend must be contiguous [T, N] = [{t}, {n}] on "
                             f"{device}, got {tuple(addend.shape)} on {addend.device}")
    if out is not None:
        if (not isinstance(out, torch.Tensor) or out.dtype != out_dtype
                or tuple(out.shape) != (t, n) or not out.is_contiguous() or out.device != device):
            raise ValueError(f"{owner}: out must be a contiguous {out_dtype} [T, N] = "
                             f"[{t}, {n}] tensor on {device}")
        if addend is not None and addend.data_ptr() != out.data_ptr() and _overlap(addend, out):
            raise ValueError(f"{owner}: out and addend overlap without being the same tensor")
    return t


class DenseGemm:
    """``x @ W^T`` (+ addend) for ``T <= max_tokens`` rows on the GPU: the dense part's
    split-K swap-AB GEMM (kernel: ``fast.gemm.kernel.SplitKGemmKernel``).

    One object per weight and call site: it owns the split-K workspace and tile counters
    of its calls, so two objects may run on two streams at once; calls of one object must
    be ordered (one stream). Buffers are allocated at construction for ``tactics`` (default:
    the default tactic of every T = 1..max_tokens); a call with another tactic that needs
    more workspace allocates it then, which is refused inside CUDA-graph capture.

    **One summation order per object.** Every default tactic of every ``T`` uses
    :attr:`splits` K splits (only ``splits`` changes bits; tiles and token chunks do not), so
    a token's output row is bitwise the same at every ``T`` the object serves and whatever
    its batch-mates. Calls of more than 64 rows run token chunks of at most 64 rows on the
    grid's second dimension, one launch (``launch_for``, ``fast.gemm.layout.token_chunks``).

    Args:
        weight: BF16 ``[N, K]`` contiguous on a CUDA device (``nn.Linear`` layout); ``K`` a
            positive multiple of 64 (the kernel's stage), ``N`` any positive count: rows
            not a multiple of 64 are padded once, here, into a zero-padded copy
            (:attr:`padded_weight`, ``layout.padded_rows(N)`` rows; :attr:`weight` is its
            first ``N`` rows), and the kernel stores only the ``N`` real columns.
        max_tokens: the most rows a call may have (1 .. ``layout.MAX_CALL_TOKENS``).
        tactics: tactics to size the buffers for (default: every default tactic of
            ``choose_tactic`` for T = 1..max_tokens).
        pdl: launch with programmatic dependent launch: a call may start streaming its
            weights while the previous kernel of the stream finishes (it waits for that
            kernel before touching anything else; ``fast.gemm.kernel``). None (default):
            for calls of at most ``PDL_MAX_TOKENS`` tokens. Never changes a bit.
        splits: the K splits of every default tactic (a positive int with ``K % (splits *
            64) == 0``); default ``splits_of(padded N, K)`` (the measured table's for the
            DEP layer's shapes). A layer that serves other row counts picks its own
            (``splits_for_rows``), once.
        wgmma: every default tactic on the warpgroup MMA (sm_90a only) instead of
            ``mma.sync``: another instruction, so other bits than ``mma.sync`` at the same
            ``splits``, but one MMA kind at every ``T``, so still batch invariant.
        serial_from: calls of at least this many rows run the default tactic's serial form
            (``Tactic.serial``: every split in one CTA, one after another; the same bits,
            no workspace traffic); None (default): never. Never changes a bit.
        overlap: with ``wgmma``, every default tactic leaves each stage's MMAs in flight
            (``Tactic.overlap``); never changes a bit.
        chunk_windows: the most windows of a token chunk of calls of more than 64 rows
            (``layout.CHUNK_WINDOWS``): 8 (default; 64-row chunks) or, with ``wgmma``, 16
            (128-row chunks, ``Tactic.chunk_windows``: each weight tile streamed half as
            often). Never changes a bit.
        forms: per row count, the default tactic's form: ``{rows_from: {key: value}}``
            with keys among ``FORM_KEYS`` (``chunk_windows``, ``serial``, ``overlap``,
            ``stage_k``), each overriding the arguments above for calls of at least
            ``rows_from`` rows up to the next key (:func:`form_at`; ``chunk_windows``
            still only above 64 rows); or ``{"tiled": {...}}`` (with ``wgmma``): those
            calls run ``fast.gemm.TiledGemm`` on this weight at :attr:`splits`, its
            keyword arguments (``fast.gemm.tiled_layout.TILED_KEYS``; one object per such
            form, built here; :meth:`tiled_at`). None (default): no overrides. Never changes a bit (the K
            split and the MMA kind are not a form's).

    Raises (before anything is allocated on the device): TypeError for a weight that is not
    a tensor; ValueError naming the argument for a bad dtype, shape, ``max_tokens``,
    ``splits``, ``pdl``, ``wgmma`` (a bool; True only on an sm_90a device), a weight not
    contiguous or not on a CUDA device; RuntimeError where the fast kernels cannot run.

    Run: ``python -m pytest verify/test_gemm_fast.py -k fast`` (on an SM90/SM100 GPU).
    """

    def __init__(self, weight: torch.Tensor, *, max_tokens: int = MAX_TOKENS, tactics=None,
                 pdl: bool | None = None, splits: int | None = None, wgmma: bool = False,
                 serial_from: int | None = None, overlap: bool = False,
                 chunk_windows: int = MAX_WINDOWS, forms: dict | None = None):
        n, k = check_weight_shape("DenseGemm", weight)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) \
                or not 1 <= max_tokens <= MAX_CALL_TOKENS:
            raise ValueError(f"DenseGemm: max_tokens must be an int in [1, {MAX_CALL_TOKENS}], "
                             f"got {max_tokens!r}")
        if splits is not None and (isinstance(splits, bool) or not isinstance(splits, int)
                                   or splits < 1 or k % (splits * 64)):
            raise ValueError(f"DenseGemm: splits must be None or a positive int dividing K={k} "
                             f"into multiples of 64, got {splits!r}")
        if pdl not in (None, True, False):
            raise ValueError(f"DenseGemm: pdl must be None, True or False, got {pdl!r}")
        if not isinstance(wgmma, bool):
            raise ValueError(f"DenseGemm: wgmma must be a bool, got {wgmma!r}")
        check_overlap("DenseGemm", overlap, "wgmma" if wgmma else "mma.sync", name="overlap")
        check_serial_from("DenseGemm", "serial_from", serial_from)
        check_chunk_windows("DenseGemm", "chunk_windows", chunk_windows, wgmma)
        check_forms("DenseGemm", "forms", forms, wgmma)
        check_weight_placement("DenseGemm", weight)
        backend.require_supported("DenseGemm")
        if wgmma and backend.device_arch(weight.device) != "sm_90a":
            raise ValueError(f"DenseGemm: wgmma=True needs an sm_90a device (warpgroup MMA is "
                             f"Hopper's), this one is {backend.device_arch(weight.device)}")
        #: N, the output's columns; ``rows``, the padded rows the kernel runs over
        self.n, self.k, self.max_tokens = n, k, max_tokens
        self.rows = padded_rows(n)
        if self.rows != n:  # zero rows after the last: every tile reads whole rows
            self.padded_weight = torch.zeros(self.rows, k, dtype=_BF16, device=weight.device)
            self.padded_weight[:n].copy_(weight)
        else:
            self.padded_weight = weight
        #: the ``[N, K]`` weight (the first N rows of :attr:`padded_weight`)
        self.weight = self.padded_weight[:n]
        self.pdl = pdl
        self.device = weight.device
        self.arch = backend.device_arch(self.device)
        #: every default tactic on the warpgroup MMA (else ``mma.sync``)
        self.wgmma = wgmma
        #: calls of at least this many rows run serial splits (None: never)
        self.serial_from = serial_from
        #: every default wgmma tactic leaves each stage's MMAs in flight
        self.overlap = overlap
        #: the most windows of a token chunk of calls of more than 64 rows
        self.chunk_windows = chunk_windows
        #: per row count, the default tactic's form ({rows_from: {key: value}}; None: none)
        self.forms = None if forms is None else {r: dict(f) for r, f in forms.items()}
        self.sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        #: the K splits of every default tactic: the one summation order of this GEMM
        self.splits = splits_of(self.rows, k, self.sms) if splits is None else splits
        check_form_stages("DenseGemm", "forms", forms, k, self.splits)
        #: the tiled kernel of each tiled form, by its ``rows_from``
        self.tiled = {}
        for rows_from, form in (forms or {}).items():
            if "tiled" in form:
                from fast.gemm.tiled import TiledGemm

                self.tiled[rows_from] = TiledGemm(self.weight, splits=self.splits,
                                                  max_tokens=max_tokens, **form["tiled"])
        if tactics is None:
            tactics = {self.tactic(t) for t in range(1, max_tokens + 1)
                       if self.tiled_at(t) is None}
            tactics = tactics or {self.tactic(1)}
        tactics = list(tactics)
        for t in tactics:
            self._check_tactic(t)
        #: the most (token chunks x windows) of a call: the workspace's windows
        self._window_slots = max(c * w for cw in CHUNK_WINDOWS  # either width (forms)
                                 for c, w in (token_chunks(t, cw)
                                              for t in range(1, max_tokens + 1)))
        self.workspace = torch.empty(max(self.workspace_bytes(t) for t in tactics) // 4 + 4,
                                     dtype=_F32, device=self.device)
        # one counter per tile of the smallest tile (16 rows) and token chunk
        self.counters = torch.zeros(token_chunks(max_tokens)[0] * self.rows // 16,
                                    dtype=torch.int32, device=self.device)
        self._null = torch.zeros(4, dtype=_F32, device=self.device)

    def tactic(self, tokens: int) -> Tactic:
        """The default tactic at ``tokens`` rows (``choose_tactic`` with :attr:`splits`,
        :attr:`wgmma`, serial splits from :attr:`serial_from` rows, :attr:`overlap` and,
        above 64 rows, :attr:`chunk_windows`; each overridden by the call's form of
        :attr:`forms`, ``form_at``)."""
        return default_tactic(self.rows, self.k, tokens, self.sms, self.splits, self.wgmma,
                              self.serial_from, self.overlap, self.chunk_windows, self.forms)

    def tiled_at(self, tokens: int):
        """The ``fast.gemm.TiledGemm`` that serves a call of ``tokens`` rows by default (its
        form is tiled, :func:`form_at`), else None (the split-K kernel)."""
        return self.tiled.get(form_key_at(self.forms, tokens))

    def plan(self, tokens: int):
        """What a default call of ``tokens`` rows runs: its ``Launch`` (:meth:`launch`) or
        the ``TiledGemm`` of its form (:meth:`tiled_at`)."""
        return self.tiled_at(tokens) or self.launch(tokens)

    def launch(self, tokens: int, tactic: Tactic | None = None) -> Launch:
        """What a call of ``tokens`` rows launches (``launch_for``; default tactic
        :meth:`tactic`)."""
        return launch_for(self.n, self.k, tokens, tactic=tactic or self.tactic(tokens),
                          sms=self.sms)

    def compile_for(self, tokens, kinds=None) -> list[dict]:
        """Compile every kernel a call of each row count in ``tokens`` (an iterable of
        ints) launches at the default tactic; returns the split-K kernel's distinct
        parameters. Rows served by a tiled form compile that ``TiledGemm``'s kernels of
        ``kinds`` (``(out_dtype, addend_dtype or None)`` pairs: they are compile-time
        there); with ``kinds`` None those compile at their first call. A layer calls it at
        construction, so no call compiles (and no graph capture does)."""
        seen = []
        tiled = {}  # the distinct tiled objects, by id
        for t in tokens:
            if (gemm := self.tiled_at(t)) is not None:
                tiled[id(gemm)] = gemm
                continue
            params = self.launch(t).params
            if params not in seen:
                seen.append(params)
                compile_kernel(self.arch, **params)
        if kinds is not None:
            for gemm in tiled.values():
                gemm.compile_for(kinds)
        return seen

    def workspace_bytes(self, t: Tactic) -> int:
        """Bytes of split-K workspace a call at tactic ``t`` needs (0 for one split or serial
        splits)."""
        if t.splits == 1 or t.serial:
            return 0
        return chunk_workspace_bytes(t.splits, self.rows, self._window_slots)

    def _check_tactic(self, t: Tactic) -> None:
        if not isinstance(t, Tactic):
            raise TypeError(f"DenseGemm: tactic must be a fast.gemm.Tactic, got {type(t).__name__}")
        if self.rows % t.tile_rows:
            padded = f" (padded to {self.rows} rows)" if self.rows != self.n else ""
            raise ValueError(f"DenseGemm: N={self.n}{padded} is not a multiple of the tactic's "
                             f"{t.tile_rows}-row tile ({t})")
        if self.k % (t.splits * t.stage_k):
            raise ValueError(f"DenseGemm: K={self.k} is not a multiple of splits * stage_k = "
                             f"{t.splits} * {t.stage_k} ({t})")
        if t.wgmma and self.arch != "sm_90a":
            raise ValueError(f"DenseGemm: tactic {t.label()} uses wgmma, which needs sm_90a; "
                             f"this GPU is {self.arch}")

    def reserve_workspace(self, tactic: Tactic) -> None:
        """Grow :attr:`workspace` to what a call at ``tactic`` needs; RuntimeError inside a
        CUDA-graph capture (pass the tactic in ``tactics=`` at construction instead)."""
        if self.workspace_bytes(tactic) > self.workspace.numel() * 4:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"DenseGemm: tactic {tactic} needs a larger workspace than "
                                   "was allocated; pass it in tactics= before graph capture")
            self.workspace = torch.empty(self.workspace_bytes(tactic) // 4 + 4, dtype=_F32,
                                         device=self.device)

    def launch_flags(self, out_dtype: torch.dtype, addend: torch.Tensor | None) -> int:
        """The kernel's ``flags`` for a call with ``out_dtype`` and ``addend``
        (``fast.gemm.kernel.FLAG_*``: FP32 output, a BF16 or an FP32 addend)."""
        from fast.gemm.kernel import FLAG_ADD_BF16, FLAG_ADD_F32, FLAG_F32_OUT

        flags = FLAG_F32_OUT if out_dtype == _F32 else 0
        if addend is not None:
            flags |= FLAG_ADD_BF16 if addend.dtype == _BF16 else FLAG_ADD_F32
        return flags

    def uses_pdl(self, tokens: int) -> bool:
        """Whether a call of ``tokens`` rows launches with programmatic dependent launch
        (``pdl``, or by default up to ``PDL_MAX_TOKENS`` rows)."""
        return tokens <= PDL_MAX_TOKENS if self.pdl is None else self.pdl

    def check_call(self, x, out, out_dtype, addend) -> int:
        """Refuse (ValueError / TypeError naming the argument) a call's ``x``, ``out``,
        ``out_dtype`` or ``addend`` that ``__call__`` cannot take; returns ``T``
        (:func:`check_gemm_call`)."""
        return check_gemm_call("DenseGemm", x, out, out_dtype, addend, n=self.n, k=self.k,
                               max_tokens=self.max_tokens, device=self.device)

    def __call__(self, x: torch.Tensor, *, out_dtype: torch.dtype = _BF16,
                 addend: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 tactic: Tactic | None = None) -> torch.Tensor:
        """``x @ W^T`` (``+ addend``), rounded once to ``out_dtype``.

        Args:
            x: BF16 ``[T, K]`` contiguous, ``1 <= T <= max_tokens``.
            out_dtype: ``torch.bfloat16`` (RNE) or ``torch.float32``.
            addend: optional BF16 or FP32 ``[T, N]`` added to the FP32 sum before the
                output rounding (``reference.gemm.addmm``'s beta = 1); may be ``out``
                itself (accumulate in place).
            out: optional ``[T, N]`` output of ``out_dtype``.
            tactic: a ``fast.gemm.Tactic`` (default ``self.tactic(T)``, or the tiled
                kernel where ``T``'s form is tiled); only its ``splits`` changes bits.

        Returns:
            ``out`` (a new tensor when not given).
        """
        t = self.check_call(x, out, out_dtype, addend)
        if tactic is None and (gemm := self.tiled_at(t)) is not None:
            return gemm.run(x, t, out_dtype=out_dtype, addend=addend, out=out)
        tactic = tactic or self.tactic(t)
        self._check_tactic(tactic)
        if not tactic.serves(t):
            raise ValueError(f"DenseGemm: tactic {tactic.label()} does not serve {t} tokens "
                             f"({tactic.tiles_per_warp(tactic.chunks(t)[1])} accumulator tiles "
                             f"per warp > {tactic.max_tiles()})")
        launch = self.launch(t, tactic)
        self.reserve_workspace(tactic)
        if out is None:
            out = torch.empty(t, self.n, dtype=out_dtype, device=self.device)
        from cutlass import Int32, Int64

        from fast.gemm.kernel import SplitKGemmKernel

        fn = compiled(SplitKGemmKernel, self.arch, frozen(launch.params))
        flags = self.launch_flags(out_dtype, addend)
        fn(Int64(self.padded_weight.data_ptr()), Int64(x.data_ptr()), Int64(out.data_ptr()),
           Int64((addend if addend is not None else self._null).data_ptr()),
           Int64(self.workspace.data_ptr()), Int64(self.counters.data_ptr()),
           Int32(self.rows), Int32(self.k), Int32(t), Int32(tactic.splits), Int32(flags),
           Int32(launch.grid), Int32(launch.chunks), Int32(self.n),
           Int32(int(self.uses_pdl(t))), backend.stream(self.device))
        return out


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()
