"""CPU checks of the experts engine's prepared layout (``fast.experts.layout``): the
kernels' decode, replayed with integer tensor ops, returns every checkpoint weight
exactly, for every E2M1 code and every supported scale code, every shard and expert range;
prepare rejects what the decode cannot keep exact; every engine kernel compiles for every
target."""

import pytest
import torch

from fast import backend
from fast.experts.layout import (
    MAX_SCALE_CODE, WORD_BITS, decode_tiles, pack_tiles, prepare_experts)
from model.config import LatentMoEConfig
from model.formats import dequantize_mxfp4, e2m1_to_float32
from model.weights import LatentMoEWeights
from tools.ptx_dump import dump_ptx, loops

_cute_error = backend.cute_import_error()


@pytest.fixture(scope="module")
def small_weights():
    return LatentMoEWeights.random(LatentMoEConfig.small(), 11)


def test_word_bits_cover_each_bit_once():
    positions = [b for pair in WORD_BITS for half in pair for b in half]
    assert sorted(positions) == list(range(32))


@pytest.mark.parametrize("shard", [(0, 1), (1, 2), (3, 4)])
def test_decode_returns_every_weight(small_weights, shard):
    w, c = small_weights, small_weights.config
    first, count = 5, 3
    p = prepare_experts(w, experts=(first, count), shard=shard)
    inter = c.intermediate // shard[1]
    lo = shard[0] * inter
    fc1, fc2 = decode_tiles(p.w13, p.s13), decode_tiles(p.w2, p.s2)
    for j in range(count):
        w13 = dequantize_mxfp4(w.w13[first + j], w.w13_scales[first + j])
        gate, up = w13[lo:lo + inter], w13[c.intermediate + lo:c.intermediate + lo + inter]
        # m-tile m: gate rows 8m..8m+7 then up rows 8m..8m+7
        want = torch.stack((gate.view(-1, 8, c.latent), up.view(-1, 8, c.latent)), 1)
        assert torch.equal(fc1[j].view(torch.int32), want.reshape(2 * inter, -1).view(torch.int32))
        w2 = dequantize_mxfp4(w.w2[first + j], w.w2_scales[first + j])[:, lo:lo + inter]
        assert torch.equal(fc2[j].view(torch.int32), w2.contiguous().view(torch.int32))
    assert p.nbytes == count * (2 * inter * c.latent // 2 + 2 * inter * c.latent // 32
                                + c.latent * inter // 2 + c.latent * inter // 32)


@pytest.mark.parametrize("stage_chunks", [1, 2])
def test_every_code_under_every_scale(stage_chunks):
    """All 16 codes at every position class, under all scale codes 0..128."""
    g = torch.Generator().manual_seed(0)
    codes = torch.arange(16, dtype=torch.uint8).repeat(16 * 128 // 16).view(1, 16, 128)
    codes = codes[:, :, torch.randperm(128, generator=g)]
    for start in range(0, MAX_SCALE_CODE + 1, 64):
        scales = (torch.arange(64, dtype=torch.int64) + start).clamp(max=MAX_SCALE_CODE)
        scales = scales.to(torch.uint8).view(1, 16, 4)
        tiles, tile_scales = pack_tiles(codes, scales, stage_chunks)
        want = e2m1_to_float32(codes).double() * torch.pow(
            2.0, scales.double() - 127).repeat_interleave(32, -1)
        got = decode_tiles(tiles, tile_scales)
        assert torch.equal(got.view(torch.int32), want.float().view(torch.int32))


def test_prepare_rejects_what_it_cannot_decode(small_weights):
    w = small_weights
    fields = {f: getattr(w, f) for f in ("gate", "bias", "front", "shared_down", "latent_norm",
                                         "up", "w13", "w13_scales", "w2")}
    s = w.w2_scales.clone()
    s[2, 9, 3] = MAX_SCALE_CODE + 1
    bad = LatentMoEWeights(**fields, w2_scales=s, config=w.config)
    with pytest.raises(ValueError, match=r"w2_scales\[2, 9, 3\] = 129"):
        prepare_experts(bad)
    prepare_experts(bad, experts=(3, 2))  # expert 2 is not prepared: fine
    with pytest.raises(ValueError, match="experts must be"):
        prepare_experts(w, experts=(60, 8))
    with pytest.raises(ValueError, match="shard must be"):
        prepare_experts(w, shard=(2, 2))
    with pytest.raises(ValueError, match="I/ranks % 64"):
        prepare_experts(w, shard=(0, 8))  # I_s = 32
    with pytest.raises(TypeError, match="LatentMoEWeights"):
        prepare_experts(object())


@pytest.mark.skipif(_cute_error is not None, reason=f"CuTe DSL not importable: {_cute_error}")
@pytest.mark.parametrize("arch", backend.TARGETS)
@pytest.mark.parametrize("geometry,windows,capture", [
    ("dep16", 1, True), ("dep16", 2, False), ("dep16", 4, False), ("tp8", 1, False),
    ("tp16", 1, False)])
def test_engine_kernels_compile(arch, geometry, windows, capture):
    """The four kernels of each real geometry (DEP16 owner, TP8 and TP16 slices; TP16
    has one chunk per stage), every window count, for every target (no GPU needed)."""
    from fast.experts.engine import compile_all
    from fast.experts.layout import Geometry

    c = LatentMoEConfig.kimi_k3()
    g = {"dep16": Geometry(c.latent, c.intermediate, 56, 56, (0, 1)),
         "tp8": Geometry(c.latent, c.intermediate // 8, 0, c.experts, (0, 8)),
         "tp16": Geometry(c.latent, c.intermediate // 16, 0, c.experts, (0, 16))}[geometry]
    # the DEP owner's engine (empty receive rows allowed) at two window counts
    empty_rows = geometry == "dep16" and windows != 1
    assert all(compile_all(g, c, windows=windows, arch=arch, capture=capture, strict=capture,
                           empty_rows=empty_rows))
    if windows == 2:  # the launch chain (programmatic dependent launch of plan and FC1)
        assert all(compile_all(g, c, windows=windows, arch=arch, tactic=dict(pdl_chain=1),
                               empty_rows=empty_rows))
    if geometry in ("dep16", "tp8") and windows in (1, 4):  # FC1 + FC2 in one grid
        assert all(compile_all(g, c, windows=windows, arch=arch, capture=capture,
                               tactic=dict(fused=1), empty_rows=empty_rows))
    if geometry in ("tp8", "tp16"):  # a slice's short FC2 items walking 4 row tiles, in
        # the two kernels and in a slice's default: the fused grid with the launch chain
        assert all(compile_all(g, c, windows=windows, arch=arch, tactic=dict(walk=4)))
        assert all(compile_all(g, c, windows=windows, arch=arch,
                               tactic=dict(walk=4, fused=1, pdl_chain=1)))


@pytest.mark.skipif(_cute_error is not None, reason=f"CuTe DSL not importable: {_cute_error}")
def test_walk_refused_where_it_does_not_apply():
    """``walk`` (FC2 row tiles per item) is refused by name where it cannot hold: a count
    that does not divide the tiles, and a long FC2 (a DEP owner's 24 stages, which
    ``WALK_MAX_STAGES`` keeps from being unrolled)."""
    from fast.experts.engine import compile_all
    from fast.experts.layout import Geometry

    c = LatentMoEConfig.small()
    g = Geometry(c.latent, c.intermediate, 0, c.experts, (0, 1))  # FC2: 2 tiles of 128 rows
    with pytest.raises(ValueError, match="walk must be an int >= 1 dividing the 2 row tiles"):
        compile_all(g, c, windows=1, arch="sm_90a", tactic=dict(walk=3))
    k3 = LatentMoEConfig.kimi_k3()
    dep = Geometry(k3.latent, k3.intermediate, 0, 56, (0, 1))
    with pytest.raises(ValueError, match="at most 8 stages"):
        compile_all(dep, k3, windows=1, arch="sm_90a", tactic=dict(walk=2))


def test_windows_refused_past_four():
    """A work item holds 1, 2 or 4 windows of 8 tokens (``choose_windows``); any other
    count is refused by name before a kernel is built, with either MMA kind."""
    from fast.experts.engine import kernel_params
    from fast.experts.layout import Geometry

    c = LatentMoEConfig.kimi_k3()
    dep = Geometry(c.latent, c.intermediate, 0, 56, (0, 1))
    for windows, tactic in ((8, dict(wgmma=1)), (8, {}), (3, {})):
        with pytest.raises(ValueError, match=f"windows must be 1, 2 or 4, got {windows}"):
            kernel_params(dep, c, windows, False, False, tactic)


_FUSED_PTX = """
from fast.experts import engine
from fast.experts.layout import Geometry
from model.config import LatentMoEConfig
c = LatentMoEConfig.small()
g = Geometry(c.latent, c.intermediate, 0, c.experts, (0, 1))
params = engine.kernel_params(g, c, {windows}, False, False,
                               engine.complete_tactic(dict(fused=1), "sm_90a"))
engine.compiled_kernel("fused", "sm_90a", params["fused"])
"""


@pytest.mark.skipif(_cute_error is not None, reason=f"CuTe DSL not importable: {_cute_error}")
def test_fused_gate_polls_relaxed_then_fences(tmp_path):
    """The fused kernel's FC2 wait, in the PTX the DSL emits: one poll loop per count of
    live windows, each on ``ld.relaxed.gpu`` bounded by a count, then one
    ``fence.acq_rel.gpu``. Neither ``ld.acquire`` (an L1 invalidation at every poll) nor
    ``%globaltimer`` (a timed spin): on the H200 both versions faulted with "illegal
    address" at two or more windows, and the relaxed, untimed spin ran clean."""
    windows = 4
    dumps = dump_ptx(_FUSED_PTX.format(windows=windows), tmp_path, "*FusedExpertsKernel*.ptx")
    assert len(dumps) == 1, f"expected one PTX dump of the fused kernel, found {dumps}"
    ptx = dumps[0].read_text()
    assert "ld.acquire" not in ptx and "%globaltimer" not in ptx
    # the innermost loops that poll (the item loop around everything polls too)
    polls = [body for body in loops(ptx)
             if any("ld.relaxed.gpu" in ln for ln in body) and not any("bar.sync" in ln for ln in body)]
    assert len(polls) == windows, f"{len(polls)} poll loops, expected one per live count"
    lines = ptx.splitlines()
    for body in polls:
        end = lines.index(body[-1])
        after = next(ln for ln in lines[end + 1:] if "fence." in ln or "bar.sync" in ln)
        assert "fence.acq_rel.gpu" in after, f"a poll loop not followed by the fence: {after}"


@pytest.mark.skipif(_cute_error is not None, reason=f"CuTe DSL not importable: {_cute_error}")
@pytest.mark.parametrize("geometry,windows,tactic", [
    ("dep16", 1, dict(wgmma=1, warps=4, mtiles=1)), ("dep16", 2, dict(wgmma=1)),
    ("dep16", 4, dict(wgmma=1, pdl_chain=1)), ("tp8", 1, dict(wgmma=1, warps=8, mtiles=1)),
    # the sm_90a defaults at four windows (ExpertsEngine.default_tactic)
    ("dep16", 4, dict(wgmma=1, warps=8, mtiles=2, fused=1, pdl_chain=1)),
    ("tp8", 4, dict(wgmma=1, warps=8, mtiles=2, walk=7))])
def test_engine_wgmma_kernels_compile(geometry, windows, tactic):
    """The warpgroup-MMA tactic (with the launch chain at 4 windows, and as the default
    of four-window calls) compiles for sm_90a and is refused, by name, for the Blackwell
    targets (which have no wgmma)."""
    from fast.experts.engine import compile_all
    from fast.experts.layout import Geometry

    c = LatentMoEConfig.kimi_k3()
    g = {"dep16": Geometry(c.latent, c.intermediate, 56, 56, (0, 1)),
         "tp8": Geometry(c.latent, c.intermediate // 8, 0, c.experts, (0, 8))}[geometry]
    assert all(compile_all(g, c, windows=windows, arch="sm_90a", tactic=tactic))
    for arch in ("sm_100a", "sm_103a"):
        with pytest.raises(ValueError, match="wgmma needs sm_90a"):
            compile_all(g, c, windows=windows, arch=arch, tactic=tactic)


def test_default_walk_per_slice():
    """FC2 row tiles per item by default: the fewest that give an item 12 stages, none
    where FC2 is deep (a DEP owner's whole experts: 24 stages; a TP2 slice: 12)."""
    from fast.experts.engine import choose_walk

    c = LatentMoEConfig.kimi_k3()
    walks = {tp: choose_walk(c.intermediate // tp, c.latent, 128) for tp in (1, 2, 4, 8, 16)}
    assert walks == {1: 1, 2: 1, 4: 2, 8: 4, 16: 4}
    assert choose_walk(c.intermediate // 8, c.latent, 64) == 4  # 56 tiles of 64 rows
    s = LatentMoEConfig.small()  # 2 stages, 2 tiles: the whole FC2 in one item
    assert choose_walk(s.intermediate, s.latent, 128) == 2


def test_default_tactic_per_mode():
    """A call's default tactic: a DEP owner (whole experts) runs the fused grid with the
    launch chain and no walk; a TP8 slice walks 4 FC2 tiles and, so walking, runs the fused
    grid too up to two windows of pairs per expert (896 rows), not at 1024; a TP2 slice (no
    walk) keeps the two kernels; at four windows per item (DEP16 T > 56, TP8 above 896
    rows) the warpgroup MMA with 8 warps of 2 m-tiles on sm_90a only (a TP8 slice's
    256-row tiles walk 7), not when the call asks for fewer windows or the engine's own
    tactic names the tile or the MMA; the engine's own tactic wins, key by key, as over a
    DEP owner's default."""
    from types import SimpleNamespace

    from fast.experts.engine import ExpertsEngine

    c = LatentMoEConfig.kimi_k3()
    wgmma8 = dict(wgmma=1, warps=8, mtiles=2)

    def default(first, count, tp, rows, own=None, arch="sm_90a", windows=None, over=None):
        geometry = SimpleNamespace(inter=c.intermediate // tp, latent=c.latent,
                                   shard=(0, tp), count=count, first=first)
        engine = SimpleNamespace(config=c, geometry=geometry, tactic=own or {}, arch=arch)
        return ExpertsEngine.default_tactic(engine, rows, windows, over=over)

    assert default(0, 56, 1, 16 * 56) == dict(fused=1, pdl_chain=1)  # 16 pairs per expert
    assert default(0, 56, 1, 16 * 57) == dict(wgmma8, fused=1, pdl_chain=1)
    assert default(0, 56, 1, 16 * 64) == dict(wgmma8, fused=1, pdl_chain=1)
    assert default(0, 56, 1, 16 * 64, windows=2) == dict(fused=1, pdl_chain=1)
    assert default(0, 56, 1, 16 * 64, arch="sm_100a") == dict(fused=1, pdl_chain=1)
    assert default(0, 56, 1, 16) == dict(warps=4, mtiles=1, fused=1, pdl_chain=1)
    assert default(0, 896, 8, 512) == dict(walk=4, fused=1, pdl_chain=1)
    assert default(0, 896, 16, 65) == dict(walk=4, fused=1, pdl_chain=1)
    assert default(0, 896, 8, 896) == dict(walk=4, fused=1, pdl_chain=1)
    assert default(0, 896, 8, 897) == dict(wgmma8, walk=7)
    assert default(0, 896, 8, 1024) == dict(wgmma8, walk=7)
    assert default(0, 896, 8, 1024, arch="sm_100a") == dict(walk=4)
    assert default(0, 896, 16, 1024) == dict(walk=4)  # FC1's 384 rows: no 256-row tiles
    assert default(0, 896, 2, 512) == {}
    assert default(0, 896, 8, 512, own=dict(fused=0)) == dict(fused=0, pdl_chain=1, walk=4)
    assert default(0, 56, 1, 16 * 64, own=dict(fused=0)) == dict(wgmma8, fused=0, pdl_chain=1)
    assert default(0, 896, 8, 1024, own=dict(walk=2)) == dict(wgmma8, walk=2)  # two kernels
    assert default(0, 896, 8, 512, own=dict(warps=8, mtiles=1)) == dict(
        warps=8, mtiles=1, walk=4, fused=1, pdl_chain=1)
    for own in (dict(chains=2), dict(wgmma=0), dict(mtiles=2), dict(warps=4)):
        assert not default(0, 896, 8, 1024, own=own).get("wgmma"), own
    assert default(0, 896, 8, 1024, own=dict(wgmma=0)) == dict(wgmma=0, walk=4)
    # a variant laid over the engine's own tactic follows the same rules (the benchmarks')
    assert default(0, 896, 8, 1024, over=dict(chains=2)) == dict(chains=2, walk=4)
    assert default(0, 896, 8, 1024, over=dict(warps=4)) == dict(warps=4, walk=4)
    assert default(0, 896, 8, 1024, own=dict(fused=0), over=dict(ring=6)) == dict(
        wgmma8, fused=0, ring=6, walk=7)
    with pytest.raises(ValueError, match="unknown tactic keys"):
        default(0, 896, 8, 1024, over=dict(window=4))


@pytest.mark.skipif(_cute_error is not None, reason=f"CuTe DSL not importable: {_cute_error}")
@pytest.mark.parametrize("windows", [1, 2, 4])
def test_walk_resident_b_keeps_the_shared_memory_and_the_occupancy(windows):
    """A walked FC2 keeps its B operand resident (``resident_b``) in ``stages`` blocks
    after a ring of weight-and-scale slots: at a TP8 slice (3 stages per tile) it needs no
    more shared memory than the unwalked kernel's ring of full slots, so the CTAs per
    multiprocessor (the persistent grid) do not shrink."""
    from fast.experts.kernels import ExpertsGemmKernel

    c = LatentMoEConfig.kimi_k3()
    inter = c.intermediate // 8
    fc2 = dict(fc1=False, rows=c.latent, k=inter, inter=inter, latent=c.latent,
               count=c.experts, windows=windows, walk=4)
    walked, unwalked = ExpertsGemmKernel(**fc2), ExpertsGemmKernel(**dict(fc2, walk=1))
    assert walked.resident_b and not unwalked.resident_b  # no walk: nothing to share
    assert walked.RING == unwalked.RING
    assert walked.slot_bytes == unwalked.slot_bytes - unwalked.b_bytes
    assert walked.smem_bytes == walked.RING * walked.slot_bytes + walked.stages * walked.b_bytes
    assert walked.smem_bytes <= unwalked.smem_bytes
    assert walked.occupancy >= unwalked.occupancy
