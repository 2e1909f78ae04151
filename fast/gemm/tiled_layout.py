"""The tiled kernel's shapes and options, in pure Python (no CuTe DSL).

``fast.gemm.tiled_kernel.TiledGemmKernel`` (the kernel), ``fast.gemm.tiled.TiledGemm``
(its host object), ``fast.gemm.host.check_forms`` (a ``DenseGemm`` form that hands rows to
it) and ``benchmarks.wide_gemm_table --tiled`` take the same options; they are defined and
checked here once, so a CPU without the DSL checks them and sizes the workspace exactly as
the kernel does.

A CTA computes ``TILE_ROWS`` weight rows x ``tile_tokens`` tokens in ``STAGE_K``-wide ring
stages; a call of ``T`` rows runs :func:`tile_grid` CTA tiles (times ``splits`` with one CTA
per K split, whose partials take :func:`workspace_bytes`), or, in the persistent form, one
CTA per multiprocessor, each taking a contiguous range of (tile, split) units
(:func:`unit_range`; the partials of a tile whose splits straddle CTAs through the same
workspace, :func:`prefix_end` naming the splits the first CTA folds itself).
"""

from __future__ import annotations

__all__ = ["TILE_ROWS", "STAGE_K", "THREADS", "TILE_TOKENS", "PRODUCER_MAX_TOKENS",
           "TILED_KEYS", "check_tiled_options", "tile_grid", "workspace_bytes", "unit_range",
           "prefix_end"]

#: weight rows of a CTA tile: two warpgroups of 64
TILE_ROWS = 128
#: k of one ring stage (four ``wgmma k16`` steps)
STAGE_K = 64
#: the MMA threads of a CTA: two warpgroups (a producer warp, where there is one, after them)
THREADS = 256
#: the token tiles the kernel takes: ``wgmma`` N (a multiple of 16 here), the TMA box and
#: two FP32 accumulators of ``tile_tokens / 2`` registers per thread (160: 160 registers)
TILE_TOKENS = tuple(range(32, 161, 16))
#: the widest token tile beside a producer warp: its 288 threads take registers as three
#: warpgroups (168 each), which spill two accumulators of 80 (``tests/test_gemm_tiled.py``)
PRODUCER_MAX_TOKENS = 144
#: the options of a tiled kernel beside its shape: ``TiledGemm``'s keyword arguments
TILED_KEYS = ("tile_tokens", "stages", "cross", "producer", "persistent", "pdl", "cluster")
#: a thread-block cluster's extent along weight tiles or token tiles (``cluster``)
CLUSTER_EXTENTS = (1, 2, 4)


def check_tiled_options(owner: str, options, where: str | None = None) -> None:
    """Refuse (ValueError starting with ``owner``) tiled-kernel ``options`` that are not a
    dict of ``TILED_KEYS``: ``tile_tokens`` among ``TILE_TOKENS``, ``stages`` an int in
    2..8, ``cross``, ``producer``, ``persistent`` and ``pdl`` bools (``cross`` and
    ``persistent`` not both, ``pdl`` only with ``persistent``), ``producer`` only with
    ``tile_tokens`` up to ``PRODUCER_MAX_TOKENS``, ``cluster`` a pair ``(weight tiles,
    token tiles)`` of ``CLUSTER_EXTENTS``, at most 8 CTAs, and other than ``(1, 1)`` only in
    the serial or cross form with a producer warp and with ``tile_tokens`` a multiple of 8
    times its first extent (each CTA multicasts an 8-row-aligned slice of the token tile).
    An absent key takes ``TiledGemm``'s default. Each option is named as ``where[key]``
    when ``where`` (a form's entry) is given, else by its key."""
    def name(key: str) -> str:
        return f"{where}[{key!r}]" if where else key

    if not isinstance(options, dict) or not set(options) <= set(TILED_KEYS):
        raise ValueError(f"{owner}: {where or 'the tiled options'} must be a dict with keys "
                         f"among {TILED_KEYS}, got {options!r}")
    tile_tokens = options.get("tile_tokens", 128)
    if type(tile_tokens) is not int or tile_tokens not in TILE_TOKENS:
        raise ValueError(f"{owner}: {name('tile_tokens')} must be a multiple of 16 in "
                         f"{TILE_TOKENS[0]}..{TILE_TOKENS[-1]}, got {tile_tokens!r}")
    stages = options.get("stages", 4)
    if type(stages) is not int or not 2 <= stages <= 8:
        raise ValueError(f"{owner}: {name('stages')} must be an int in 2..8, got {stages!r}")
    for key in ("cross", "producer", "persistent", "pdl"):
        if key in options and not isinstance(options[key], bool):
            raise ValueError(f"{owner}: {name(key)} must be a bool, got {options[key]!r}")
    if options.get("cross") and options.get("persistent"):
        raise ValueError(f"{owner}: {where + ': ' if where else ''}cross and persistent are "
                         f"two forms of the grid: at most one of them")
    if options.get("pdl") and not options.get("persistent"):
        raise ValueError(f"{owner}: {where + ': ' if where else ''}pdl (programmatic "
                         f"dependent launch) is the persistent form's: persistent=True")
    if options.get("producer") and tile_tokens > PRODUCER_MAX_TOKENS:
        raise ValueError(f"{owner}: {where + ': ' if where else ''}a producer warp takes "
                         f"tile_tokens up to {PRODUCER_MAX_TOKENS} (its CTA's registers are "
                         f"shared by three warpgroups), got {tile_tokens}")
    cluster = options.get("cluster", (1, 1))
    if (not isinstance(cluster, (tuple, list)) or len(cluster) != 2
            or any(type(c) is not int or c not in CLUSTER_EXTENTS for c in cluster)
            or cluster[0] * cluster[1] > 8):
        raise ValueError(f"{owner}: {name('cluster')} must be a pair (weight tiles, token "
                         f"tiles) of {CLUSTER_EXTENTS}, at most 8 CTAs, got {cluster!r}")
    if tuple(cluster) != (1, 1):
        if options.get("persistent") or not options.get("producer"):
            raise ValueError(f"{owner}: {where + ': ' if where else ''}a cluster (TMA "
                             f"multicast) is the serial or cross form's with a producer "
                             f"warp: persistent=False, producer=True")
        if tile_tokens % (8 * cluster[0]):
            raise ValueError(f"{owner}: {name('cluster')} {tuple(cluster)} multicasts "
                             f"1/{cluster[0]} of the token tile from each CTA: tile_tokens "
                             f"must be a multiple of {8 * cluster[0]}, got {tile_tokens}")


def tile_grid(n: int, tokens: int, tile_tokens: int) -> tuple[int, int]:
    """(weight tiles, token tiles) of a call: ``ceil(n / 128)``, ``ceil(tokens / tile_tokens)``."""
    return -(-n // TILE_ROWS), -(-tokens // tile_tokens)


def cluster_grid(tiles, chunks, cluster: tuple[int, int]):
    """The first two grid dimensions of a clustered call: (weight tiles, token tiles) each
    rounded up to a whole number of the cluster's extents (the CTAs past the call's tiles
    load zeros and store nothing). Plain arithmetic: the kernel calls it on its run-time
    token tiles."""
    return (tiles + cluster[0] - 1) // cluster[0] * cluster[0], \
        (chunks + cluster[1] - 1) // cluster[1] * cluster[1]


def workspace_bytes(n: int, tokens: int, tile_tokens: int, splits: int) -> int:
    """Bytes of the cross form's FP32 split partials for a call of ``tokens`` rows: one
    ``128 x tile_tokens`` tile per (token tile, weight tile, split)
    (``TiledGemmKernel.workspace_offset``)."""
    tiles, chunks = tile_grid(n, tokens, tile_tokens)
    return chunks * tiles * splits * TILE_ROWS * tile_tokens * 4


def unit_range(cta, ctas, units):
    """The persistent form's units ``[q0, q1)`` of CTA ``cta`` of ``ctas`` out of ``units``
    (unit ``q``: split ``q % splits`` of CTA tile ``q // splits``, the tiles weight-tile
    fastest): ``q0 = cta * units // ctas``. Plain arithmetic: the kernel calls it on its
    run-time values."""
    return cta * units // ctas, (cta + 1) * units // ctas


def prefix_end(tile, splits: int, ctas, units, minimum=min):
    """The persistent form: how many of ``tile``'s splits (from split 0, in order) the CTA
    holding its split 0 folds in its registers before storing the running sum as the
    tile's slot 0 (``splits`` when it holds the whole tile): the CTA ``c0`` whose range
    holds unit ``q = tile * splits`` is ``((q + 1) * ctas - 1) // units``. The kernel calls
    it on its run-time values with ``minimum=cutlass.min``."""
    q = tile * splits
    c0 = ((q + 1) * ctas - 1) // units
    return minimum(unit_range(c0, ctas, units)[1], q + splits) - q
