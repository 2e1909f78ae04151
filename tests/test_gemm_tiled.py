"""``fast.gemm.TiledGemm`` on the CPU: the tiled kernel compiles for sm_90a at every TP8 wide
GEMM's shape and kind, and bad shapes, kinds and weights are refused by name. Its bits (the
same as ``DenseGemm``'s warpgroup MMA at the same K split, at every row count) are the GPU
contract ``verify/test_gemm_fast.py::test_gemm_fast_tiled_same_bits``."""

from __future__ import annotations

import pytest
import torch

try:
    import cutlass.cute  # noqa: F401

    _cute_error = None
except Exception as e:  # pragma: no cover - the CuTe DSL is a dev dependency
    _cute_error = repr(e)

needs_cute = pytest.mark.skipif(_cute_error is not None,
                                reason=f"CuTe DSL not importable: {_cute_error}")


def _wide_kinds():
    """(n, k, splits, out_f32, addend) of the TP8 wide rank's four GEMMs at the real
    dimensions, on an H100/H200's 132 multiprocessors."""
    from fast.schedules.wide_gemms import gemm_shapes, gemm_splits
    from model.config import LatentMoEConfig

    cfg = LatentMoEConfig.kimi_k3()
    shapes, splits = gemm_shapes(cfg, 8), gemm_splits(cfg, 8, 132)
    kinds = {"front": (True, "none"), "shared_gate_up": (False, "none"),
             "shared_down": (False, "none"), "up": (False, "bf16")}
    return [(name, *shapes[name], splits[name], *kinds[name]) for name in shapes]


@needs_cute
@pytest.mark.parametrize("producer", [False, True], ids=["", "producer"])
@pytest.mark.parametrize("cross", [True, False], ids=["cross", "serial"])
@pytest.mark.parametrize("tile_tokens", [128, 64])
@pytest.mark.parametrize("case", _wide_kinds(), ids=lambda c: c[0])
def test_tiled_kernel_compiles_for_every_wide_gemm(case, tile_tokens, cross, producer):
    from fast.device.compile import compiled, frozen
    from fast.gemm.tiled_kernel import TiledGemmKernel

    _, n, k, splits, out_f32, addend = case
    params = dict(n=n, k=k, width=n, splits=splits, out_f32=out_f32, addend=addend,
                  tile_tokens=tile_tokens, stages=4, cross=cross, producer=producer)
    assert compiled(TiledGemmKernel, "sm_90a", frozen(params))


@needs_cute
@pytest.mark.parametrize("producer", [False, True], ids=["", "producer"])
@pytest.mark.parametrize("tile_tokens", [128, 96])
@pytest.mark.parametrize("case", _wide_kinds(), ids=lambda c: c[0])
def test_tiled_kernel_persistent_form_compiles(case, tile_tokens, producer):
    """The persistent grid (``persistent=True``) at every TP8 wide GEMM's shape and kind."""
    from fast.device.compile import compiled, frozen
    from fast.gemm.tiled_kernel import TiledGemmKernel

    _, n, k, splits, out_f32, addend = case
    params = dict(n=-(-n // 128) * 128, k=k, width=n, splits=splits, out_f32=out_f32,
                  addend=addend, tile_tokens=tile_tokens, stages=4, producer=producer,
                  persistent=True, ctas=132)
    assert compiled(TiledGemmKernel, "sm_90a", frozen(params))


@needs_cute
@pytest.mark.parametrize("cross", [False, True], ids=["serial", "cross"])
@pytest.mark.parametrize("cluster", [(1, 2), (2, 1), (2, 2)], ids=lambda c: f"{c[0]}x{c[1]}")
@pytest.mark.parametrize("case", _wide_kinds(), ids=lambda c: c[0])
def test_tiled_kernel_cluster_form_compiles(case, cluster, cross):
    """The serial and cross forms in thread-block clusters (``cluster=(weight tiles, token
    tiles)``, TMA multicast of the shared operand stages) at every TP8 wide GEMM's shape and
    kind."""
    from fast.device.compile import compiled, frozen
    from fast.gemm.tiled_kernel import TiledGemmKernel

    _, n, k, splits, out_f32, addend = case
    params = dict(n=-(-n // 128) * 128, k=k, width=n, splits=splits, out_f32=out_f32,
                  addend=addend, tile_tokens=64, stages=4, cross=cross, producer=True,
                  cluster=cluster)
    assert compiled(TiledGemmKernel, "sm_90a", frozen(params))


@needs_cute
@pytest.mark.parametrize("cross", [False, True], ids=["serial", "cross"])
@pytest.mark.parametrize("cluster", [(1, 1), (1, 2), (2, 1), (2, 2)], ids=lambda c: f"{c[0]}x{c[1]}")
def test_tiled_cluster_multicasts_and_waits_for_its_partners(cluster, cross, tmp_path):
    """The clustered kernel's PTX (sm_90a): each extent above 1 multicasts its operand's
    copies (``cp.async.bulk.tensor ... multicast::cluster``: the weights where the cluster
    spans token tiles, the tokens where it spans weight tiles), the ring's empty barriers
    are released in the partner CTAs (``mbarrier.arrive.shared::cluster``), and the CTAs
    wait for each other at the start (barriers initialized) and the end (no CTA leaves
    while a partner may still write into it); without a cluster none of these."""
    from tools.ptx_dump import run_compile

    params = dict(n=640, k=7168, width=560, splits=8, out_f32=True, tile_tokens=64, stages=4,
                  cross=cross, producer=True, cluster=cluster)
    run_compile(_COMPILE, [repr(params)], keep="ptx", dump_dir=tmp_path)
    (ptx,) = sorted(tmp_path.rglob("*.ptx"))
    text = ptx.read_text()
    copies = [line for line in text.splitlines() if "cp.async.bulk.tensor" in line]
    multicast = [line for line in copies if "multicast::cluster" in line]
    assert len(copies) == 2
    assert len(multicast) == (cluster[0] > 1) + (cluster[1] > 1)
    assert ("mbarrier.arrive.shared::cluster" in text) == (cluster != (1, 1))
    assert text.count("barrier.cluster.wait") == (2 if cluster != (1, 1) else 0)


@pytest.mark.parametrize("cluster", [(1, 1), (1, 2), (2, 1), (2, 2), (4, 1), (1, 4)])
@pytest.mark.parametrize("tiles,chunks", [(1, 1), (5, 11), (6, 16), (56, 9), (7, 1)])
def test_cluster_grid_covers_the_tiles_in_whole_clusters(tiles, chunks, cluster):
    """``tiled_layout.cluster_grid``: each extent the call's tiles rounded up to a whole
    number of clusters, less than one cluster over."""
    from fast.gemm.tiled_layout import cluster_grid

    gt, gc = cluster_grid(tiles, chunks, cluster)
    assert gt % cluster[0] == 0 and gc % cluster[1] == 0
    assert tiles <= gt < tiles + cluster[0] and chunks <= gc < chunks + cluster[1]


@pytest.mark.parametrize("splits", [1, 2, 3, 8])
@pytest.mark.parametrize("ctas", [1, 7, 50, 132])
@pytest.mark.parametrize("tiles", [1, 5, 40, 96, 448])
def test_persistent_units_cover_each_split_once_and_hand_over_in_order(tiles, ctas, splits):
    """The persistent form's decomposition (``tiled_layout.unit_range``, as the kernel
    computes it, over ``min(ctas, units)`` CTAs): every (tile, split) unit in exactly one
    CTA, each CTA's units contiguous; per tile, the CTA holding split 0 folds splits
    ``0 .. prefix_end - 1`` itself, every later split is stored by one CTA, and the splits
    the CTAs hand in sum to ``splits`` (the counter the completing CTA sees)."""
    from fast.gemm.tiled_layout import prefix_end, unit_range

    units = tiles * splits
    grid = min(ctas, units)
    owner = {}
    for c in range(grid):
        q0, q1 = unit_range(c, grid, units)
        assert q0 <= q1
        for q in range(q0, q1):
            assert q not in owner
            owner[q] = c
    assert sorted(owner) == list(range(units))
    for t in range(tiles):
        segments = {}
        for s in range(splits):
            segments.setdefault(owner[t * splits + s], []).append(s)
        first = segments[owner[t * splits]]
        assert first == list(range(prefix_end(t, splits, grid, units)))
        assert sum(len(v) for v in segments.values()) == splits
        assert all(v == list(range(v[0], v[-1] + 1)) for v in segments.values())


@needs_cute
def test_tiled_kernel_other_kinds_compile():
    """An FP32 addend, an FP32 output with a BF16 addend, a deep ring, a padded width."""
    from fast.device.compile import compiled, frozen
    from fast.gemm.tiled_kernel import TiledGemmKernel

    for params in (dict(n=896, k=3584, width=896, splits=8, addend="f32"),
                   dict(n=560, k=7168, width=560, splits=8, out_f32=True, addend="bf16"),
                   dict(n=1536, k=7168, width=1500, splits=4, stages=6)):
        assert compiled(TiledGemmKernel, "sm_90a", frozen(params))


@pytest.mark.parametrize("params,word", [
    (dict(n=896, k=3584, width=896, splits=3), "splits"),       # K not whole 64-k stages per split
    (dict(n=896, k=3584, width=897, splits=1), "width"),
    (dict(n=896, k=3584, width=896, splits=1, addend="fp8"), "addend"),
    (dict(n=896, k=3584, width=896, splits=1, tile_tokens=72), "tile_tokens"),
    (dict(n=896, k=3584, width=896, splits=1, tile_tokens=176), "tile_tokens"),
    (dict(n=896, k=3584, width=896, splits=2, tile_tokens=160, producer=True), "producer"),
    (dict(n=896, k=3584, width=896, splits=1, stages=1), "stages"),
    (dict(n=896, k=3584, width=896, splits=2, cross=1), "cross"),
    (dict(n=896, k=3584, width=896, splits=2, producer=None), "producer"),
    (dict(n=896, k=3584, width=896, splits=2, cross=True, persistent=True), "persistent"),
    (dict(n=896, k=3584, width=896, splits=2, persistent=True, ctas=0), "ctas"),
    (dict(n=896, k=3584, width=896, splits=2, cross=True, cluster=(1, 2)), "producer warp"),
    (dict(n=896, k=3584, width=896, splits=2, cross=False, cluster=(1, 2)), "producer warp"),
    (dict(n=896, k=3584, width=896, splits=2, persistent=True, producer=True, cluster=(2, 1)),
     "serial or cross form's"),
    (dict(n=896, k=3584, width=896, splits=2, cross=False, producer=True, cluster=(4, 4)),
     "at most 8"),
    (dict(n=896, k=3584, width=896, splits=2, cross=False, producer=True, cluster=(3, 1)),
     "cluster"),
    (dict(n=896, k=3584, width=896, splits=2, cross=False, producer=True, cluster=(2,)),
     "cluster"),
    (dict(n=896, k=3584, width=896, splits=2, cross=False, producer=True, tile_tokens=48,
          cluster=(4, 1)), "multiple of 32"),
])
def test_tiled_kernel_refuses_bad_parameters(params, word):
    from fast.gemm.tiled_kernel import TiledGemmKernel

    with pytest.raises(ValueError, match=word):
        TiledGemmKernel(**params)


@needs_cute
@pytest.mark.parametrize("producer", [False, True], ids=["", "producer"])
def test_tiled_kernel_persistent_form_at_decode_widths_compiles(producer):
    """The persistent form at a DEP rank's decode GEMMs (32-token tiles, rings of 6 and 8
    stages: weights streamed by TMA; its prologue streams the first stages' weights before
    ``griddepcontrol.wait``)."""
    from fast.device.compile import compiled, frozen
    from fast.gemm.tiled_kernel import TiledGemmKernel

    for n, k, splits, stages in ((15872, 7168, 1, 8), (7168, 3584, 2, 6)):
        params = dict(n=n, k=k, width=n, splits=splits, tile_tokens=32, stages=stages,
                      producer=producer, persistent=True, ctas=132)
        assert compiled(TiledGemmKernel, "sm_90a", frozen(params))


def test_tiled_gemm_refuses_a_weight_it_cannot_take():
    """A CPU, FP32 or non-contiguous weight is refused by name before any GPU work."""
    from fast.gemm.tiled import TiledGemm

    for weight in (torch.zeros(128, 256, dtype=torch.bfloat16),
                   torch.zeros(128, 256, dtype=torch.float32),
                   torch.zeros(256, 128, dtype=torch.bfloat16).t()):
        with pytest.raises(ValueError, match="weight"):
            TiledGemm(weight, splits=1, max_tokens=64)



_TRACE = """
import sys
import cutlass.cute as cute
from fast.gemm.tiled_kernel import TiledGemmKernel
from fast.gemm.tiled_layout import TILE_ROWS
kernel = TiledGemmKernel(n=256, k=512, width=256, splits=1, tile_tokens=int(sys.argv[1]))
seen = []
threads = tuple(range(kernel.threads))  # a Python tuple: the loop below is unrolled at trace

@cute.jit
def trace():
    mma = kernel._tiled_mma()
    for tid in threads:
        c = kernel.thread_coordinates(mma, tid)
        seen.extend([tuple(int(v) for v in c[i]) for i in range(cute.size(c))])

trace()
tile = {(m, t) for m in range(TILE_ROWS) for t in range(kernel.tile_tokens)}
print(len(seen), len(tile), set(seen) == tile)
"""


@needs_cute
@pytest.mark.parametrize("tile_tokens", [128, 64, 96, 48, 32, 160])
def test_tiled_epilogue_coordinates_cover_the_tile_once(tile_tokens, tmp_path):
    """The (weight row, token) each of the 256 threads' accumulators stands for
    (``TiledGemmKernel.thread_coordinates``, which the epilogue stores by) covers the
    128 x ``tile_tokens`` tile exactly once: no two threads store one output, none is left
    out. Traced on the CPU for sm_90a in a process of its own (the CuTe DSL reads its
    target, ``CUTE_DSL_ARCH``, once per process); no kernel runs."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a",
               PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH"))
                                          if p))
    script = tmp_path / "trace_tiled_coordinates.py"  # the DSL compiles from a source file
    script.write_text(_TRACE)
    done = subprocess.run([sys.executable, str(script), str(tile_tokens)], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    cells = 128 * tile_tokens
    assert done.stdout.split()[-3:] == [str(cells), str(cells), "True"], done.stdout


@pytest.mark.parametrize("tile_tokens", [128, 64, 96, 48])
def test_tiled_cross_workspace_blocks_are_disjoint_and_fit(tile_tokens):
    """The cross form's workspace: the 16-byte pieces of every (token tile, weight tile,
    split, piece, thread) (``TiledGemmKernel.workspace_offset``) are distinct and fill
    ``workspace_bytes`` of a call exactly: no CTA overwrites another's partial and the host's
    allocation holds them all."""
    from fast.gemm.tiled_kernel import TiledGemmKernel
    from fast.gemm.tiled_layout import TILE_ROWS, tile_grid, workspace_bytes

    n, tokens, splits = 300, 200, 3
    kernel = TiledGemmKernel(n=n, k=3 * 128, width=n, splits=splits, tile_tokens=tile_tokens,
                             cross=True)
    tiles, chunks = tile_grid(n, tokens, tile_tokens)
    pieces = TILE_ROWS * tile_tokens // (4 * kernel.threads)
    offsets = [kernel.workspace_offset(c, t, s, j, tid) for c in range(chunks)
               for t in range(tiles) for s in range(splits) for j in range(pieces)
               for tid in range(kernel.threads)]
    assert sorted(offsets) == list(range(0, workspace_bytes(n, tokens, tile_tokens, splits), 16))
    # one split has nothing to fold: the serial form, no workspace
    assert not TiledGemmKernel(n=n, k=256, width=n, splits=1, cross=True).cross


_COMPILE = """
import ast, sys
from fast.device.compile import compiled, frozen
from fast.gemm.tiled_kernel import TiledGemmKernel
compiled(TiledGemmKernel, "sm_90a", frozen(ast.literal_eval(sys.argv[1])))
"""


@needs_cute
@pytest.mark.parametrize("tile_tokens,producer,persistent,cluster",
                         [(160, False, False, (1, 1)), (144, True, False, (1, 1)),
                          (96, True, False, (1, 1)), (144, True, True, (1, 1)),
                          (160, False, True, (1, 1)), (144, True, False, (2, 2))])
def test_tiled_kernel_fits_its_registers(tile_tokens, producer, persistent, cluster, tmp_path):
    """The widest token tile (160: two accumulators of 80 FP32 per thread) and the widest
    beside a producer warp (144; its 288 threads take registers as three warpgroups, 168
    each: 160 spills there, so it is refused) compile for sm_90a without a stack frame
    (the cubin's attributes, ``tools.sass_budget.kernel_attributes``): no spills in the
    main loop."""
    from tools.ptx_dump import run_compile
    from tools.sass_budget import kernel_attributes

    params = dict(n=1536, k=7168, width=1536, splits=4, tile_tokens=tile_tokens, stages=4,
                  cross=not persistent and cluster == (1, 1), producer=producer,
                  persistent=persistent, cluster=cluster)
    run_compile(_COMPILE, [repr(params)], keep="cubin", dump_dir=tmp_path)
    (cubin,) = sorted(tmp_path.rglob("*.cubin"))
    attrs = kernel_attributes(cubin.read_bytes())
    threads = 256 + (32 if producer else 0)
    assert attrs["frame"] == 0 and attrs["registers"] <= min(255, 65536 // threads), attrs
