"""The warp-specialized experts kernel (``fast.experts.specialized``) without a GPU: its
copies land exactly where ``ExpertsGemmKernel``'s do, its tactic is refused where it cannot
hold, it compiles for sm_90a at the real widths, and the PTX has the pipeline the module
docstring describes. The stage contracts on the GPU (``verify/test_experts.py``, tactics
``specialized=1``) and the planted bugs of ``tests/test_mutations.py`` check what it
computes."""

from __future__ import annotations

import re

import pytest

from fast.experts.kernels import ExpertsGemmKernel
from fast.experts.layout import Geometry, b_offset_wgmma
from model.config import LatentMoEConfig
from tools.ptx_dump import dump_ptx

try:
    from fast.experts.specialized import SpecializedExpertsKernel, scale_block, weight_block

    _cute_error = None
except Exception as exc:  # the CuTe DSL is a dev dependency; report why it is missing
    _cute_error = repr(exc)

needs_cute = pytest.mark.skipif(_cute_error is not None,
                                reason=f"CuTe DSL not importable: {_cute_error}")

K3 = LatentMoEConfig.kimi_k3()
SMALL = LatentMoEConfig.small()
GEOMETRIES = {
    "small": (SMALL, Geometry(SMALL.latent, SMALL.intermediate, 0, SMALL.experts, (0, 1))),
    "dep16": (K3, Geometry(K3.latent, K3.intermediate, 56, 56, (0, 1))),
    "tp8": (K3, Geometry(K3.latent, K3.intermediate // 8, 0, K3.experts, (0, 8))),
}
TACTIC = dict(specialized=1, wgmma=1, warps=8, mtiles=2, pdl_chain=1)


def _gemms(geometry: str, windows: int = 4, warps: int = 8, mtiles: int = 2):
    cfg, g = GEOMETRIES[geometry]
    common = dict(inter=g.inter, latent=g.latent, count=g.count, windows=windows, warps=warps,
                  mtiles=mtiles, wgmma=True)
    return (ExpertsGemmKernel(fc1=True, rows=2 * g.inter, k=g.latent, **common),
            ExpertsGemmKernel(fc1=False, rows=g.latent, k=g.inter, **common))


def _lane_copies(gemm: ExpertsGemmKernel, stage: int) -> dict[int, int]:
    """What ``ExpertsGemmKernel._issue`` copies for ``stage``, byte by byte: slot offset ->
    byte offset from the item's first m-tile in the prepared weights (``w``) or scales
    (``s``), as its lanes compute them (warp, lane, m-tile, chunk)."""
    SC, MT = gemm.stage_chunks, gemm.mtiles
    w, s = {}, {}
    for warp in range(gemm.warps):
        mbase = warp * MT
        for lane in range(32):
            for mt in range(MT):
                for cc in range(SC):
                    to = gemm.w_offset + warp * (MT * SC * 512) + lane * 16 + (mt * SC + cc) * 512
                    at = (mbase * gemm.chunks * 512 + lane * 16
                          + (mt * gemm.chunks + stage * SC + cc) * 512)
                    w.update({to + b: at + b for b in range(16)})
            if lane < 8 * SC:
                for mt in range(MT):
                    to = (gemm.w_offset + gemm.w_bytes + warp * (MT * 32 * SC) + lane * 4
                          + mt * 32 * SC)
                    at = (mbase * (gemm.stages * 32 * SC) + lane * 4
                          + (mt * gemm.stages + stage) * (32 * SC))
                    s.update({to + b: at + b for b in range(4)})
    return w, s


def _bulk_copies(gemm: ExpertsGemmKernel, stage: int):
    blocks = gemm.warps * gemm.mtiles
    w, s, sizes = {}, {}, []
    for block in range(blocks):
        for fn, into in ((weight_block, w), (scale_block, s)):
            to, at, size = fn(gemm, block, stage)
            assert to % 16 == 0 and at % 16 == 0 and size % 16 == 0, (fn.__name__, to, at, size)
            into.update({to + b: at + b for b in range(size)})
            sizes.append(size)
    return w, s, sizes


@needs_cute
@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_bulk_copies_are_the_lane_copies(geometry):
    """Per stage, the producer's bulk copies (one per m-tile block of weights and of
    scales, ``weight_block`` / ``scale_block``) move the same bytes from the same places
    into the same slot offsets as the lane-by-lane copies of ``ExpertsGemmKernel``, whose
    decode reads them; the stage's transaction bytes are their total, and the blocks never
    overlap the B operand at the slot's start."""
    fc1, fc2 = _gemms(geometry)
    kernel = SpecializedExpertsKernel(fc1, fc2)
    for gemm in (fc1, fc2):
        for stage in sorted({0, 1, gemm.stages - 1}):
            lane_w, lane_s = _lane_copies(gemm, stage)
            bulk_w, bulk_s, sizes = _bulk_copies(gemm, stage)
            assert bulk_w == lane_w, f"{geometry} fc1={gemm.fc1} stage {stage}: weights differ"
            assert bulk_s == lane_s, f"{geometry} fc1={gemm.fc1} stage {stage}: scales differ"
            assert sum(sizes) == kernel.tx_bytes
            assert min(bulk_w) >= gemm.b_bytes and max(bulk_s) < kernel.slot_bytes


@needs_cute
@pytest.mark.parametrize("windows,producers", [(1, 1), (2, 2), (4, 1), (4, 2)])
def test_b_pieces_split_over_producer_lanes(windows, producers):
    """Every 16-byte B piece of a stage is copied by exactly one producer lane, to the
    ``wgmma`` core-matrix offsets ``b_offset_wgmma`` gives (the layout the consumers'
    descriptors read), and the pieces tile the slot's B block."""
    fc1, fc2 = _gemms("small", windows=windows)
    kernel = SpecializedExpertsKernel(fc1, fc2, producers=producers)
    lanes = 32 * producers
    SC = fc1.stage_chunks
    pieces = sorted(lane + lanes * c for lane in range(lanes) for c in range(kernel.copies))
    assert pieces == list(range(kernel.granules))
    words = set()
    for piece in pieces:
        token, gi = divmod(piece, 8 * SC)
        at = b_offset_wgmma(token // 8, token % 8, gi // 8, gi % 8, SC)
        words.update(at + 128 * m + b for m in range(4) for b in range(4))
    assert words == set(range(fc1.b_bytes))


@needs_cute
def test_ring_fills_shared_memory():
    """The default ring is as deep as the shared memory of one CTA per multiprocessor
    holds, at most 8 slots (DEP16 at four windows: 8 slots of 25 KB, 17 KB of weights and
    scales each); two CTAs per multiprocessor halve it; a ring that does not fit is
    refused by name."""
    fc1, fc2 = _gemms("dep16")
    one = SpecializedExpertsKernel(fc1, fc2)
    assert one.slot_bytes == 25600 and one.ring == 8 and one.tx_bytes == 17408
    two = SpecializedExpertsKernel(*_gemms("dep16"), occupancy=2)
    assert two.ring == 4
    with pytest.raises(ValueError, match="ring 9: 8 slots of 25600 bytes fit 1 CTA"):
        SpecializedExpertsKernel(*_gemms("dep16"), ring=9)
    assert one.threads == 288 and SpecializedExpertsKernel(*_gemms("dep16"),
                                                           producers=2).threads == 320


@needs_cute
def test_refused_where_it_cannot_hold():
    """Built only from an FC1 and an FC2 ``wgmma`` GEMM of the same tile and stage shape,
    without a walk; the engine's tactic check refuses it without ``wgmma``, with a walk, and
    ``producers`` without it, each by name."""
    from fast.experts.engine import complete_tactic, kernel_params

    fc1, fc2 = _gemms("small")
    with pytest.raises(ValueError, match="takes an FC1 and an FC2"):
        SpecializedExpertsKernel(fc2, fc1)
    cfg, g = GEOMETRIES["small"]
    plain = dict(inter=g.inter, latent=g.latent, count=g.count, windows=4)
    with pytest.raises(ValueError, match="needs the wgmma tile"):
        SpecializedExpertsKernel(ExpertsGemmKernel(fc1=True, rows=512, k=256, **plain),
                                 ExpertsGemmKernel(fc1=False, rows=256, k=256, **plain))
    with pytest.raises(ValueError, match="producers must be 1 or 2"):
        SpecializedExpertsKernel(*_gemms("small"), producers=3)
    # a TP16 slice: FC2's K of 192 streams one chunk per stage, FC1's two
    tp16 = Geometry(K3.latent, K3.intermediate // 16, 0, K3.experts, (0, 16))
    with pytest.raises(ValueError, match="differ in \\['stage_chunks'\\]"):
        params = kernel_params(tp16, K3, 4, False, False,
                               complete_tactic(dict(TACTIC, warps=4, mtiles=1), "sm_90a"))
        SpecializedExpertsKernel.compile_args(**dict(params["specialized"]))
    with pytest.raises(ValueError, match="specialized .* name wgmma=1"):
        complete_tactic(dict(specialized=1), "sm_90a")
    with pytest.raises(ValueError, match="takes no walk, got walk=4"):
        complete_tactic(dict(specialized=1, wgmma=1, walk=4), "sm_90a")
    with pytest.raises(ValueError, match="producers is the warp-specialized grid's"):
        complete_tactic(dict(wgmma=1, producers=2), "sm_90a")
    with pytest.raises(ValueError, match="wgmma needs sm_90a"):
        complete_tactic(dict(TACTIC), "sm_100a")


@needs_cute
def test_engine_params_select_the_kernel():
    """``kernel_params`` with ``specialized=1``: the list and plan kernels of the fused
    grid (the plan zeroes the FC1 counts the FC2 items wait for), and one warp-specialized
    kernel holding both GEMMs, the ring and occupancy its own; the default tactic of a TP
    slice takes no walk with it."""
    from fast.experts.engine import complete_tactic, kernel_params

    cfg, g = GEOMETRIES["tp8"]
    params = kernel_params(g, cfg, 4, False, False,
                           complete_tactic(dict(TACTIC, ring=6, occupancy=1), "sm_90a"))
    assert set(params) == {"lists", "plan", "specialized"}
    assert dict(params["plan"])["fused"] is True
    own = dict(params["specialized"])
    assert (own["ring"], own["occupancy"], own["producers"]) == (6, 1, 1)
    assert "ring" not in dict(own["fc1"]) and dict(own["fc2"])["walk"] == 1


_PTX = """
from fast.experts import engine
from fast.experts.layout import Geometry
from model.config import LatentMoEConfig
c = LatentMoEConfig.small()
g = Geometry(c.latent, c.intermediate, 0, c.experts, (0, 1))
params = engine.kernel_params(g, c, 4, False, False, engine.complete_tactic(
    dict(specialized=1, wgmma=1, warps=8, mtiles=2, producers={producers}), "sm_90a"))
engine.compiled_kernel("specialized", "sm_90a", params["specialized"])
"""


@needs_cute
@pytest.mark.parametrize("producers", (1, 2))
def test_ptx_pipeline(tmp_path, producers):
    """The PTX of the small geometry's kernel: the weights and scales arrive by bulk copies
    counted in transaction bytes on an mbarrier, the B operand by ``cp.async`` tracked by
    ``cp.async.mbarrier.arrive.noinc``; consumers wait with ``mbarrier.try_wait.parity``
    and fence to the async proxy before the warpgroup MMAs; the epilogue's barriers are
    named barrier 1 of the 256 consumer threads (the producers never reach them), the CTA
    barrier is met once (after the barriers' initialization), and the producers meet at
    named barrier 2 of 64 threads only when there are two of them."""
    dumps = dump_ptx(_PTX.format(producers=producers), tmp_path, "*SpecializedExperts*.ptx")
    assert len(dumps) == 1, dumps
    ptx = dumps[0].read_text()
    assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in ptx
    assert "cp.async.mbarrier.arrive.noinc.shared.b64" in ptx
    assert "mbarrier.arrive.expect_tx.shared.b64" in ptx
    assert "mbarrier.try_wait.parity.shared.b64" in ptx
    assert "fence.proxy.async.shared::cta" in ptx and "wgmma.mma_async" in ptx
    barriers = re.findall(r"\bbar(?:rier)?\.sync(?:\.aligned)?\s+([^;]+);", ptx)
    ids = sorted({b.split(",")[0].strip() for b in barriers})
    assert ids == (["0", "1"] if producers == 1 else ["0", "1", "2"]), barriers
    assert sum(b.split(",")[0].strip() == "0" for b in barriers) == 1, barriers
    for b in barriers:
        parts = [x.strip() for x in b.split(",")]
        if parts[0] == "1":
            assert parts[1] == "256", b
        if parts[0] == "2":
            assert parts[1] == "64", b


@needs_cute
@pytest.mark.parametrize("geometry", ["dep16", "tp8"])
def test_compiles_at_the_real_widths(geometry):
    """DEP16 and TP8 at four windows with the default tile, one and two producers, for
    sm_90a (the only target: the consumers run the warpgroup MMA)."""
    from fast.experts.engine import compile_all

    cfg, g = GEOMETRIES[geometry]
    for producers in (1, 2):
        compile_all(g, cfg, windows=4, arch="sm_90a", tactic=dict(TACTIC, producers=producers))


def _nvdisasm_error() -> str | None:
    from tools.sass_budget import nvdisasm

    try:
        nvdisasm()
    except Exception as exc:  # the dev extra's nvidia-cuda-nvdisasm wheel, or one on PATH
        return repr(exc)
    return None


@needs_cute
@pytest.mark.skipif(_nvdisasm_error() is not None, reason=f"no nvdisasm: {_nvdisasm_error()}")
def test_machine_code_keeps_the_mma_groups_pipelined(tmp_path):
    """DEP16 at four windows, in the machine code: ptxas kept the consumers' warpgroup MMAs
    in groups of four (one ``WARPGROUP.ARRIVE`` per group, as in the fused kernel) instead of
    serializing them (one per MMA, which it does when it cannot prove an in-flight group's
    registers safe: a version that kept the last group in flight across stages compiled so),
    and fits its registers without a stack frame at one CTA of 288 threads per
    multiprocessor."""
    import subprocess

    from tools.sass_budget import compile_cubin, kernel_attributes, nvdisasm

    cubin = compile_cubin("sm_90a", "dep16", 4, TACTIC, "specialized", tmp_path)
    attrs = kernel_attributes(cubin.read_bytes())
    assert attrs["frame"] == 0 and attrs["registers"] <= 224, attrs
    sass = subprocess.run([nvdisasm(), "-c", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    mmas = len(re.findall(r"\bHGMMA\.", sass))
    arrives = len(re.findall(r"\bWARPGROUP\.ARRIVE\b", sass))
    assert mmas > 0 and arrives * 4 <= mmas, f"{arrives} arrives for {mmas} warpgroup MMAs"
