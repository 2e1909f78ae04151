"""The four dense GEMMs of a wide (S2) rank on ``fast.gemm``: the batch-invariant mode of
``fast.schedules.wide.WideLayer`` and ``fast.schedules.wide_peer.WidePeerLayer``.

A wide rank ``r`` of ``N`` runs four GEMMs per call (``fast.schedules.wide_program``), for
``T`` rows (65 <= T <= ``max_rows``):

| name | weight ``[rows, K]`` | input | output (rounding) |
|---|---|---|---|
| ``front`` | router rows and latent-down rows ``[E/N + L/N, H]`` | ``x [T, H]`` | FP32 ``[T, E/N + L/N]`` (one RNE to FP32) |
| ``shared_gate_up`` | ``[2 S/N, H]`` | ``x`` | BF16 ``[T, 2 S/N]`` (one RNE) |
| ``shared_down`` | ``[H, S/N]`` | ``act [T, S/N]`` | BF16 ``[T, H]`` (one RNE) |
| ``up`` | ``[H/N, L]`` | ``normed [T, L]`` | BF16 ``[T, H/N]``: ``shared[:, cols_r]`` added to the FP32 sum before the one RNE |

By default they run on cuBLAS, which picks its kernel (and its split of K) per row count,
so a token's FP32 logits, and near a tie its experts, change with the batch it is decoded
in. In the batch-invariant mode each runs on ``fast.gemm.DenseGemm``: FP32 accumulation
per K split in k order, the splits' partials added in split order, one rounding to the
output type (the ``up`` GEMM's addend added before it, as ``reference.gemm.addmm``
defines; cuBLAS's ``addmm`` rounds twice). Each GEMM has **one K split for every row count
the layer serves** (:func:`gemm_splits`: ``fast.gemm.splits_for_rows`` at the layer's
smallest call, ``front_max + 1`` rows; a function of the shapes and the GPU's
multiprocessor count only), and a call of ``T`` rows runs ``ceil(T / 64)`` token chunks of
one launch (``fast.gemm.layout.token_chunks``), so each output element is summed in one
order at every ``T`` whatever the token's batch-mates: the row tiling and the chunk count
change with ``T``, never the order.

What the kernel needs of a shape: ``K`` a multiple of 64 (its stage width; refused here by
name, :func:`check_fast_gemm_shapes`), any row count (rows not a multiple of 64 are padded
once with zero rows at construction: the TP4/8/16 fronts' 1120/560/280 rows of the real
layer). At the real dimensions every TP 1..16 rank qualifies; the small test configs'
shared down-projection at 8 or 16 ranks (``S/N`` = 32 or 16) does not.

**The MMA kind** (``mma``): ``"mma.sync"`` or ``"wgmma"`` (sm_90a's warpgroup MMA,
``fast.gemm.DenseGemm(wgmma=True)``): one kind for every GEMM at every row count, so either
is batch invariant; they give other bits than each other. A layer's ``invariant_mma="auto"``
(its default) takes ``"wgmma"`` on sm_90a and ``"mma.sync"`` elsewhere
(``fast.gemm.mma_kind.resolve_mma``).

**Serial splits** (``serial_from``): calls of at least that many rows run each GEMM's
splits one after another inside each CTA (``fast.gemm.Tactic.serial``) instead of one CTA
per split: the same summation order, so the same bits at every row count, without the
split partials' round trip through global memory. None (the default) keeps the cross-CTA
splits at every row count.

**The GEMMs on cuBLAS without split-K** (``invariant_gemms="stock"``): the three
BF16-output GEMMs (``shared_gate_up``, ``shared_down``, ``up``) stay on cuBLAS with split-K
forbidden (``fast.stock.fp32_reduction(split_k=False)``: cuBLASLt, each output element
summed along the whole K by one CTA), and only the FP32-output ``front`` runs on
``fast.gemm``. cuBLAS documents no batch invariance: that the kernels it then picks sum
each element in one order at every row count was measured (an H100 with cuBLAS 13, every
row count 65..1024 at the real TP8 dimensions, ``benchmarks/cublas_splitk_probe.py``: no
row differed; with split-K allowed, rows of up to 203 row counts did), and
``verify/test_wide_fast.py`` holds each node to it. FP32-output GEMMs fare worse there
(without split-K the DEP router's one-row call took a kernel with other bits, and the TP8
front took 157 us at 65 rows against 10 with split-K), hence the front on ``fast.gemm``.
The ``up`` GEMM is cuBLAS's ``addmm``, held to the default mode's bound (not the fast
kernel's one rounding).

The mode's cost against cuBLAS: ``benchmarks/wide_table.py --batch-invariant`` (with
``--invariant-mma wgmma`` for the warpgroup MMA); ``docs/schedules/wide.md`` has the
measured figures.
"""

from __future__ import annotations

from fast.gemm.mma_kind import check_mma
from model.config import LatentMoEConfig

__all__ = ["WIDE_GEMMS", "CALL_KINDS", "INVARIANT_GEMMS", "DEFAULT_INVARIANT_GEMMS",
           "fast_gemm_names", "gemm_shapes",
           "check_fast_gemm_shapes", "check_gemm_forms",
           "gemm_splits", "gemm_launches", "kernel_params", "build_fast_gemms"]

#: The wide rank's dense GEMMs, by name (the table of the module docstring).
WIDE_GEMMS = ("front", "shared_gate_up", "shared_down", "up")
#: Each GEMM's (output dtype, addend dtype or None) as the program calls it, by name:
#: the kinds its tiled forms compile (``fast.gemm.DenseGemm.compile_for``)
CALL_KINDS = {"front": ("float32", None), "shared_gate_up": ("bfloat16", None),
              "shared_down": ("bfloat16", None), "up": ("bfloat16", "bfloat16")}
#: The wide layers' ``invariant_gemms``: the GEMMs the batch-invariant mode runs on
#: ``fast.gemm``; the others run on cuBLASLt without split-K (the module docstring).
INVARIANT_GEMMS = {"fast": WIDE_GEMMS, "stock": ("front",)}
#: The default of every wide layer's ``invariant_gemms`` (``WideLayer``, ``WidePeerLayer``
#: and their checks): one value, so a real rank's GEMMs stay the virtual rank's.
DEFAULT_INVARIANT_GEMMS = "stock"


def gemm_shapes(config: LatentMoEConfig, ranks: int) -> dict[str, tuple[int, int]]:
    """Each GEMM's weight shape ``(rows, K)`` on one of ``ranks`` TP ranks (``WIDE_GEMMS``)."""
    c, n = config, ranks
    return {"front": (c.experts // n + c.latent // n, c.hidden),
            "shared_gate_up": (2 * c.shared_intermediate // n, c.hidden),
            "shared_down": (c.hidden, c.shared_intermediate // n),
            "up": (c.hidden // n, c.latent)}


def fast_gemm_names(owner: str, invariant_gemms) -> tuple[str, ...]:
    """The GEMMs the batch-invariant mode runs on ``fast.gemm`` under ``invariant_gemms``
    (``INVARIANT_GEMMS``), refused by name when it is not one of them."""
    if not isinstance(invariant_gemms, str) or invariant_gemms not in INVARIANT_GEMMS:
        raise ValueError(f"{owner}: invariant_gemms must be one of {tuple(INVARIANT_GEMMS)}, "
                         f"got {invariant_gemms!r}")
    return INVARIANT_GEMMS[invariant_gemms]


def check_fast_gemm_shapes(owner: str, config: LatentMoEConfig, ranks: int,
                           names: tuple[str, ...] = WIDE_GEMMS) -> None:
    """Raise a ValueError, starting with ``owner`` and naming every GEMM of ``names`` whose
    reduction width ``K`` is not a multiple of 64 (``fast.gemm``'s stage), where ``ranks``
    TP ranks cannot run the batch-invariant mode."""
    bad = [f"{name} K={k}" for name, (_, k) in gemm_shapes(config, ranks).items()
           if name in names and k % 64]
    if bad:
        raise ValueError(f"{owner}: batch_invariant=True runs the rank's GEMMs on fast.gemm, "
                         f"whose K must be a multiple of 64; at {ranks} ranks " + ", ".join(bad)
                         + " (the shared down-projection's K is shared_intermediate / ranks)")


def gemm_splits(config: LatentMoEConfig, ranks: int, sms: int = 132) -> dict[str, int]:
    """Each GEMM's one K split (``fast.gemm.splits_for_rows`` of its shape at the layer's
    smallest call, ``front_max + 1`` rows, on a GPU of ``sms`` multiprocessors)."""
    from fast.gemm.host import splits_for_rows

    return {name: splits_for_rows(n, k, config.front_max + 1, sms)
            for name, (n, k) in gemm_shapes(config, ranks).items()}


def check_gemm_forms(owner: str, config: LatentMoEConfig, ranks: int, forms, mma: str,
                     sms: int = 132) -> None:
    """Refuse by name a wide rank's per-GEMM forms (``invariant_forms``: None, ``"auto"``
    (``fast.schedules.wide_forms.resolve_forms``) or ``{gemm: {rows_from: form}}``, gemm
    among ``WIDE_GEMMS``, each table as
    ``fast.gemm.host.check_forms`` on ``mma`` and ``check_form_stages`` at that GEMM's K and
    K split)."""
    from fast.gemm.host import check_form_stages, check_forms

    if forms is None or forms == "auto":  # "auto": fast.schedules.wide_forms resolves it
        return
    if not isinstance(forms, dict) or not set(forms) <= set(WIDE_GEMMS):
        raise ValueError(f"{owner}: invariant_forms must be None, 'auto' or a dict keyed by "
                         f"GEMM names among {WIDE_GEMMS}, got {forms!r}")
    splits = gemm_splits(config, ranks, sms)
    for name, table in forms.items():
        where = f"invariant_forms[{name!r}]"
        check_forms(owner, where, table, mma == "wgmma")
        check_form_stages(owner, where, table, gemm_shapes(config, ranks)[name][1], splits[name])


def gemm_launches(config: LatentMoEConfig, ranks: int, rows, sms: int = 132,
                  mma: str = "mma.sync", serial_from: int | None = None,
                  overlap: bool = False, chunk_windows: int = 8,
                  forms: dict | None = None) -> dict:
    """``{gemm: {T: fast.gemm.Launch}}``: what each GEMM launches at each row count ``T`` of
    ``rows`` (an iterable of ints), at its one K split, on ``mma`` (``fast.gemm.mma_kind.INVARIANT_MMAS``),
    with serial splits from ``serial_from`` rows (``fast.gemm.DenseGemm``'s; None: never)
    and, on ``"wgmma"``, ``overlap`` (``fast.gemm.Tactic.overlap``) and token chunks of
    ``chunk_windows`` windows (``DenseGemm``'s; 16 only on ``"wgmma"``), each GEMM's calls
    overridden by its table of ``forms`` (``{gemm: {rows_from: form}}``,
    :func:`check_gemm_forms`); row counts a tiled form serves run ``fast.gemm.TiledGemm``
    and are left out (pure Python: the CPU tests check the chunk arithmetic and compile
    these kernels)."""
    from fast.gemm.host import check_chunk_windows, default_tactic, form_at, launch_for
    from fast.gemm.layout import padded_rows

    check_mma("gemm_launches", mma)
    check_chunk_windows("gemm_launches", "chunk_windows", chunk_windows, mma == "wgmma")
    check_gemm_forms("gemm_launches", config, ranks, forms, mma, sms)
    splits = gemm_splits(config, ranks, sms)

    def launch(name, n, k, t):
        tactic = default_tactic(padded_rows(n), k, t, sms, splits[name], mma == "wgmma",
                                serial_from, overlap, chunk_windows, (forms or {}).get(name))
        return launch_for(n, k, t, tactic=tactic, sms=sms)

    return {name: {t: launch(name, n, k, t) for t in rows
                   if "tiled" not in form_at((forms or {}).get(name), t)}
            for name, (n, k) in gemm_shapes(config, ranks).items()}


def kernel_params(config: LatentMoEConfig, ranks: int, rows, sms: int = 132,
                  mma: str = "mma.sync", serial_from: int | None = None,
                  overlap: bool = False, chunk_windows: int = 8,
                  forms: dict | None = None) -> list[dict]:
    """The distinct ``fast.gemm`` kernel parameters a rank compiles for the row counts
    ``rows`` on ``mma`` with ``serial_from``, ``overlap``, ``chunk_windows`` and ``forms``
    (:func:`gemm_launches`)."""
    seen = []
    for per_t in gemm_launches(config, ranks, rows, sms, mma, serial_from, overlap,
                               chunk_windows, forms).values():
        for launch in per_t.values():
            if launch.params not in seen:
                seen.append(launch.params)
    return seen


def build_fast_gemms(owner: str, weights: dict, config: LatentMoEConfig, ranks: int,
                     max_rows: int, mma: str = "mma.sync",
                     serial_from: int | None = None, overlap: bool = False,
                     chunk_windows: int = 8, forms: dict | None = None,
                     names: tuple[str, ...] = WIDE_GEMMS) -> dict:
    """One ``fast.gemm.DenseGemm`` per GEMM of ``names`` (:func:`fast_gemm_names`) of one
    rank (``weights``: every ``WIDE_GEMMS`` name -> its BF16 weight on the device), each with its K split (:func:`gemm_splits` on
    this GPU), on ``mma`` (``fast.gemm.mma_kind.INVARIANT_MMAS``; ``"wgmma"`` needs an sm_90a device), with
    serial splits from ``serial_from`` rows (None: never; the same bits), on ``"wgmma"``
    with ``overlap`` (each stage's MMAs in flight; the same bits) and token chunks of
    ``chunk_windows`` windows (16: 128-row chunks, ``"wgmma"`` only; the same bits), each
    GEMM's per-row-count forms of ``forms`` (:func:`check_gemm_forms`; the same bits), buffers for up
    to ``max_rows`` rows, and every kernel a call of
    ``front_max + 1 .. max_rows`` rows launches compiled now (none at call time, none
    inside a graph capture). The ``front`` GEMM's weight is padded to a multiple of 64
    rows where it needs it (``DenseGemm.padded_weight``)."""
    import torch

    from fast.gemm import DenseGemm

    check_fast_gemm_shapes(owner, config, ranks, names)
    check_mma(owner, mma)
    check_gemm_forms(owner, config, ranks, forms, mma)
    if set(weights) != set(WIDE_GEMMS) or not set(names) <= set(WIDE_GEMMS):
        raise ValueError(f"{owner}: the fast GEMMs need the weights {WIDE_GEMMS} and names "
                         f"among them, got weights {sorted(weights)}, names {names}")
    device = next(iter(weights.values())).device
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    splits = gemm_splits(config, ranks, sms)
    gemms = {name: DenseGemm(weights[name], max_tokens=max_rows, splits=splits[name],
                             wgmma=mma == "wgmma", serial_from=serial_from, overlap=overlap,
                             chunk_windows=chunk_windows, forms=(forms or {}).get(name))
             for name in names}
    for name, gemm in gemms.items():
        out_dtype, addend_dtype = CALL_KINDS[name]
        gemm.compile_for(range(config.front_max + 1, max_rows + 1),
                         kinds=[(getattr(torch, out_dtype),
                                 None if addend_dtype is None else getattr(torch, addend_dtype))])
    return gemms
