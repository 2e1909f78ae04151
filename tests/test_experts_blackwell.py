"""The Blackwell block-scaled experts kernel (``fast.experts.blackwell``): its prepared
layout on the CPU, its compile for sm_100a and sm_103a (CuTe DSL, no GPU needed), and the
contract a Blackwell GPU must pass (skipped elsewhere: "needs an SM100 GPU").

**The contract** (per local expert, on the kernel's own intermediates, as
``verify/test_experts.py`` checks the Hopper engine):

1. FC1 (FP32) against the float64 product of the exactly dequantized operands within
   ``blockscaled_fc_bound``. Derivation: a ``tcgen05.mma.kind::mxf8f6f4.block_scale`` term
   is ``e2m1 * e4m3 * 2^(sa - 127) * 2^(sb - 127)``: a 2-bit by 4-bit significand product
   times a power of two, exact in FP32 (down to the subnormal range, below which a
   truncating datapath may lose up to the whole spacing ``2^-149`` per product: the
   ``eta`` term of ``verify.bounds``). Only the FP32 accumulation rounds. The tensor-core
   model of ``verify.bounds.mma_split_k_terms`` (Fasi, Higham, Mikaitis, Pranesh 2021:
   aligned, truncating adders, each term of one addition step losing less than one ULP,
   ``2^-23`` relative, of the step's largest term) gives, for steps of ``s`` products
   plus the accumulator, ``n = K + K/s`` losses per product. PTX documents the
   instruction's K (32) but not the datapath's step, so the bound takes the worst step,
   ``s = 1``: ``n = 2K``, i.e. ``gamma_{2K}(2^-23) * sum |x w| + K eta (1 + gamma)``, plus
   the float64 reference's own error. (At ``s = 32``, one step per instruction, the bound
   would be ``gamma_{K + K/32}``; the looser one assumes nothing undocumented.)
2. SiTU + MXFP8 re-quantization **bitwise** against ``reference.mx.quantize_mxfp8`` of the
   SiTU oracle (``fast``'s ``tanh_rn`` / ``sigmoid_rn``) of the kernel's own FC1 output.
3. FC2 (BF16 rows) against the float64 product of the kernel's MXFP8 hidden rows and the
   dequantized ``w2`` within the same accumulation bound plus the final BF16 rounding.

Plus: non-local rows untouched (NaN); a pair's row bitwise the same alone and in a batch,
and over reruns.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from fast import backend
from fast.experts.blackwell_layout import (
    ARCHS,
    BlackwellExperts,
    b_smem_offset,
    blackwell_dsl_error,
    fc1_row_order,
    prepare_blackwell_experts,
    sfb_smem_offset,
)
from model.formats import dequantize_mxfp4
from model.swizzle import unswizzle_scales_128x4
from model.weights import LatentMoEWeights
from reference.mx import dequantize_mxfp8, quantize_mxfp8
from tools.ptx_dump import dump_ptx
from verify import bounds, cases
from verify.compare import assert_bitwise_equal, assert_within_bound


_cute_error = backend.cute_import_error()
_dsl_error = (f"CuTe DSL not importable: {_cute_error}" if _cute_error is not None
              else blackwell_dsl_error())
needs_dsl = pytest.mark.skipif(_dsl_error is not None, reason=str(_dsl_error))


def _sm100_skip_reason() -> str | None:
    """None on an sm_100a / sm_103a device with the DSL, else the skip reason."""
    arch = backend.gpu_arch()
    if arch not in ARCHS:
        return f"needs an SM100 GPU ({'/'.join(ARCHS)}); this machine has {arch or 'no CUDA device'}"
    return _dsl_error


needs_sm100 = pytest.mark.skipif(_sm100_skip_reason() is not None,
                                 reason=str(_sm100_skip_reason()))


# --- weights and inputs -------------------------------------------------------------------


# --- the layout (CPU) ---------------------------------------------------------------------


@pytest.mark.parametrize("inter", (128, 384, 3072))
def test_fc1_row_order_pairs_gate_and_up_in_one_warp(inter):
    """A permutation of the ``[gate; up]`` rows; in each 32-row group lane ``i < 16`` holds
    gate column c and lane ``i + 16`` up column c; a 128-row tile holds 64 whole columns
    (two MXFP8 blocks of 32)."""
    order = fc1_row_order(inter)
    assert sorted(order.tolist()) == list(range(2 * inter))
    groups = order.view(-1, 2, 16)  # [32-row group, gate/up, 16]
    assert bool((groups[:, 0] < inter).all()) and bool((groups[:, 1] >= inter).all())
    assert torch.equal(groups[:, 1] - inter, groups[:, 0])
    tiles = groups[:, 0].reshape(-1, 64)  # the gate columns of each tile, warp order
    assert torch.equal(tiles, torch.arange(inter).view(-1, 64))
    with pytest.raises(ValueError):
        fc1_row_order(96)


@pytest.mark.parametrize("experts,shard", [((0, 64), (0, 1)), ((16, 8), (0, 1)),
                                           ((0, 64), (1, 2))])
def test_prepared_experts_are_the_checkpoint(experts, shard):
    """Every prepared expert dequantizes (scales un-tiled with ``unswizzle_scales_128x4``)
    to the checkpoint's values: FC1 rows in ``fc1_row_order`` of the shard's ``[gate; up]``,
    FC2 the shard's columns; nothing is re-encoded."""
    w = cases.expert_code_weights("small", "cpu")
    prep = prepare_blackwell_experts(w, "cpu", experts=experts, shard=shard)
    g, cfg = prep.geometry, w.config
    assert isinstance(prep, BlackwellExperts)
    assert (g.first, g.count, g.inter, g.shard) == (*experts, cfg.intermediate // shard[1], shard)
    order = fc1_row_order(g.inter)
    for local, e in enumerate(range(experts[0], experts[0] + experts[1])):
        w13, w2 = cases.dequantized_expert(w, e, shard)
        s13 = unswizzle_scales_128x4(prep.s13[local], 2 * g.inter, g.latent // 32)
        s2 = unswizzle_scales_128x4(prep.s2[local], g.latent, g.inter // 32)
        assert torch.equal(dequantize_mxfp4(prep.w13[local], s13), w13[order])
        assert torch.equal(dequantize_mxfp4(prep.w2[local], s2), w2)
    assert prep.nbytes == sum(t.numel() for t in (prep.w13, prep.s13, prep.w2, prep.s2))


def test_prepare_accepts_every_scale_code_and_refuses_bad_arguments():
    """Scale code 250 (refused by the Hopper layout's BF16 decode) is kept: the tensor
    cores apply it. Widths the kernel does not tile, a bad range or shard are refused."""
    w = cases.expert_code_weights("small", "cpu")
    big = dataclasses.replace(w, w13_scales=torch.full_like(w.w13_scales, 250))
    prep = prepare_blackwell_experts(big, "cpu", experts=(0, 2))  # no decode range here
    assert int(prep.s13.max()) == 250
    with pytest.raises(ValueError, match="I/ranks % 128"):
        prepare_blackwell_experts(w, "cpu", shard=(0, 4))  # I_s = 64
    with pytest.raises(ValueError, match="experts must be"):
        prepare_blackwell_experts(w, "cpu", experts=(60, 8))
    with pytest.raises(ValueError, match="shard must be"):
        prepare_blackwell_experts(w, "cpu", shard=(2, 2))
    with pytest.raises(TypeError):
        prepare_blackwell_experts({"w13": w.w13}, "cpu")


# --- compiled for sm_100a / sm_103a (no GPU needed) ---------------------------------------


def _geometry(name: str, first: int, count: int, shard: tuple[int, int]):
    from fast.experts.layout import Geometry

    cfg = cases.config(name)
    return cfg, Geometry(latent=cfg.latent, inter=cfg.intermediate // shard[1], first=first,
                         count=count, shard=shard)


COMPILE_CASES = [("small", 0, 64, (0, 1), w, True) for w in (1, 2, 4)] + [
    ("kimi_k3", 3 * 56, 56, (0, 1), 1, False),  # a DEP16 owner, one window
    ("kimi_k3", 3 * 56, 56, (0, 1), 4, False),
    ("kimi_k3", 0, 896, (5, 8), 4, True),  # a TP8 rank, four windows, capture
]


@needs_dsl
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name,first,count,shard,windows,capture", COMPILE_CASES)
def test_compiles_for_blackwell(arch, name, first, count, shard, windows, capture):
    """The four kernels of a call (the Hopper engine's list and plan kernels, the
    block-scaled FC1 and FC2) compile for the target."""
    from fast.experts.blackwell import compile_blackwell

    cfg, g = _geometry(name, first, count, shard)
    fns = compile_blackwell(g, cfg, windows=windows, arch=arch, capture=capture)
    assert len(fns) == 4 and all(fn is not None for fn in fns)


@needs_dsl
@pytest.mark.parametrize("tokens", (8, 16, 32))
def test_gather_offsets_are_the_dsl_smem_layouts(tokens):
    """The kernel's hand-computed gather targets (``b_smem_offset``, ``sfb_smem_offset``)
    are, for every token, k granule and k block of two stages, the offsets the DSL's own
    B and B-scale layouts give (``make_smem_layout_b`` / ``make_smem_layout_sfb`` of the
    kernel's MMA, the swizzle ``S<3,4,3>`` applied): what the MMA descriptors read is what
    the threads wrote."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.blackwell_helpers as sm100
    import cutlass.utils.blockscaled_layout as bsl
    from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

    got = {}

    def offsets():
        op = tcgen05.MmaMXF8F6F4Op(cutlass.Float4E2M1FN, cutlass.Float8E4M3FN, (128, tokens, 32),
                                   tcgen05.CtaGroup.ONE, tcgen05.OperandSource.SMEM,
                                   OperandMajorMode.K, OperandMajorMode.K)
        mma = cute.make_tiled_mma(cute.make_mma_atom(op))
        b = sm100.make_smem_layout_b(mma, (128, tokens, 128), cutlass.Float8E4M3FN, 2)
        sfb = bsl.make_smem_layout_sfb(mma, (128, tokens, 128), 32, 2)
        got["swizzle"] = str(b.inner)
        got["b"] = {(n, j): cute.crd2idx(((n, (16 * j) % 32), 0, (16 * j) % 128 // 32, j // 8),
                                         b.outer)
                    for n in list(range(tokens)) for j in list(range(16))}
        got["sfb"] = {(n, kt, kb): cute.crd2idx(((((n % 32, n // 32), 0), (0, 0)), 0, kb, kt), sfb)
                      for n in list(range(tokens)) for kt in (0, 1) for kb in (0, 1, 2, 3)}

    @cute.jit
    def probe(stream):
        offsets()

    cute.compile(probe, backend.fake_stream(), options="--gpu-arch sm_100a")
    assert got["swizzle"] == "S<3,4,3>"

    def swizzle(i):  # S<3,4,3>: bits 4-6 ^= bits 7-9
        return i ^ (((i >> 7) & 7) << 4)

    for (n, j), index in got["b"].items():
        assert swizzle(int(index)) == b_smem_offset(n, j, tokens), (n, j)
    for (n, kt, kb), index in got["sfb"].items():
        assert int(index) == sfb_smem_offset(n, kt) + kb, (n, kt, kb)


_PTX_SCRIPT = """
import cutlass.cute as cute
from cutlass import Int32, Int64
from fast import backend
from fast.experts.blackwell import BlockScaledExpertsKernel
k = BlockScaledExpertsKernel(fc1={fc1}, rows={rows}, k={k}, inter=256, latent=256, count=64,
                             windows={windows})
cute.compile(k, *([Int64(0)] * 11), Int32(1), Int32(1), backend.fake_stream(),
             options="--gpu-arch {arch}")
"""


@needs_dsl
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fc1,windows", [(True, 1), (False, 4)])
def test_ptx_is_the_mixed_block_scaled_mma(arch, fc1, windows, tmp_path):
    """In the PTX the DSL emits (its own dump): 4 block-scaled MMAs of kind ``mxf8f6f4``
    with 32-element scale blocks per k stage and nothing else (no ``mma.sync`` /
    ``wgmma``); the weights arrive by TMA, the scale factors go to tensor memory by
    ``tcgen05.cp``, the accumulator comes back by one ``tcgen05.ld.32x32b.x(8W)``."""
    rows, k = (512, 256) if fc1 else (256, 256)
    script = _PTX_SCRIPT.format(fc1=fc1, rows=rows, k=k, windows=windows, arch=arch)
    ptx = "\n".join(f.read_text() for f in dump_ptx(script, tmp_path))
    mma = [line for line in ptx.splitlines() if "tcgen05.mma" in line]
    assert len(mma) == 4, mma
    assert all("kind::mxf8f6f4.block_scale.block32" in line for line in mma), mma
    assert "mma.sync" not in ptx and "wgmma" not in ptx
    assert "cp.async.bulk.tensor" in ptx and "tcgen05.cp" in ptx
    assert f"tcgen05.ld.sync.aligned.32x32b.x{8 * windows}.b32" in ptx


@needs_dsl
def test_refusals_without_a_blackwell_target():
    from fast.experts.blackwell import BlackwellExpertsEngine, BlockScaledExpertsKernel, compile_blackwell

    cfg, g = _geometry("small", 0, 64, (0, 1))
    with pytest.raises(ValueError, match="sm_100a/sm_103a"):
        compile_blackwell(g, cfg, windows=1, arch="sm_90a")
    with pytest.raises(ValueError, match="windows"):
        compile_blackwell(g, cfg, windows=3, arch="sm_100a")
    with pytest.raises(ValueError, match="K % 128"):
        BlockScaledExpertsKernel(fc1=False, rows=256, k=64, inter=64, latent=256, count=4,
                                 windows=1)
    prep = prepare_blackwell_experts(cases.expert_code_weights("small", "cpu"), "cpu", experts=(0, 2))
    with pytest.raises(ValueError, match="CUDA device"):
        BlackwellExpertsEngine(prep, max_rows=8)
    with pytest.raises(TypeError):
        BlackwellExpertsEngine(object(), max_rows=8)


# --- the contract on a Blackwell GPU ------------------------------------------------------


def blockscaled_fc_bound(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 ``x @ w^T``, bound of a block-scaled tensor-core FP32 accumulation's
    distance to it): ``n = 2K`` truncating losses per product (module docstring). x [P, K],
    w [N, K] FP32 holding the exactly dequantized MX values."""
    bound, ref = bounds.matmul_out_bound(x, w, 2 * x.shape[-1], None, "toward_zero")
    return ref, bound


def check_blackwell_stages(w: LatentMoEWeights, experts: tuple[int, int], shard: tuple[int, int],
                           codes, scales, ids, out, cap, *, what: str) -> None:
    """The three stage contracts over every local pair, expert by expert; non-local rows
    untouched (NaN)."""
    from reference import emulation

    from verify.oracles import stages

    cfg, k = w.config, w.config.top_k
    inter = cap.fc1.shape[1] // 2
    first, count = experts
    flat = ids.reshape(-1).long().to(out.device)
    local = (flat >= first) & (flat < first + count)
    x = dequantize_mxfp8(codes.to(out.device), scales.to(out.device))
    for e in torch.unique(flat[local]).tolist():
        pairs = torch.nonzero(flat == e).flatten()
        w13, w2 = cases.dequantized_expert(w, e, shard)
        ref1, bound1 = blockscaled_fc_bound(x[pairs // k], w13.to(out.device))
        assert_within_bound(cap.fc1[pairs], ref1, bound1, what=f"{what}: FC1 of expert {e}",
                            index_names=("pair", "column"))
        fc1 = cap.fc1[pairs].cpu()
        act = stages.situ_and_mul_fp32(fc1[:, :inter], fc1[:, inter:], beta=cfg.situ_beta,
                                       linear_beta=cfg.situ_linear_beta,
                                       tanh=emulation.tanh_rn, sigmoid=emulation.sigmoid_rn)
        want_codes, want_scales = quantize_mxfp8(act)
        assert_bitwise_equal(cap.codes[pairs].cpu(), want_codes.view(torch.uint8),
                             what=f"{what}: SiTU + MXFP8 codes of expert {e}",
                             index_names=("pair", "column"))
        assert_bitwise_equal(cap.scales[pairs].cpu(), want_scales,
                             what=f"{what}: MXFP8 scales of expert {e}",
                             index_names=("pair", "block"))
        hidden = dequantize_mxfp8(cap.codes[pairs].view(torch.float8_e4m3fn), cap.scales[pairs])
        ref2, beta2 = blockscaled_fc_bound(hidden, w2.to(out.device))
        bound2 = bounds.final_rounding_bound(ref2, beta2, torch.bfloat16)
        assert_within_bound(out[pairs], ref2, bound2, what=f"{what}: FC2 rows of expert {e}",
                            index_names=("pair", "column"))
    assert bool(torch.isnan(out[~local].float()).all()), f"{what}: a non-local row was written"


def emulate_blackwell(prep: BlackwellExperts, codes, scales, ids, *, bug: str | None = None):
    """What the kernels compute, replayed on the CPU from the *prepared* layout: FC1 of each
    prepared row (E2M1 codes with their un-tiled scales) as the exact product rounded once
    to FP32, the epilogue's row -> column map (``fc1_row_order``), SiTU + RCEIL MXFP8,
    FC2 rounded to FP32 then BF16. ``bug`` plants a kernel mistake: ``gate_up`` (the wrong
    lane pairs its rows), ``scale`` (one weight block's scale off by one code: a misplaced
    scale factor), ``kblock`` (the last 32 k of FC1 dropped: a missed MMA), ``fc2`` (one
    BF16 column off by one ULP). Returns ``(out, Capture)``."""
    from fast.experts.engine import Capture
    from reference import emulation
    from verify.oracles import stages

    cfg, g = prep.config, prep.geometry
    k, inter = cfg.top_k, g.inter
    x = dequantize_mxfp8(codes, scales).double()
    if bug == "kblock":
        x[:, -32:] = 0
    flat = ids.reshape(-1).long()
    pairs_n = flat.numel()
    out = torch.full((pairs_n, g.latent), float("nan"), dtype=torch.bfloat16)
    cap = Capture(fc1=torch.full((pairs_n, 2 * inter), float("nan")),
                  codes=torch.full((pairs_n, inter), 0xFF, dtype=torch.uint8),
                  scales=torch.full((pairs_n, inter // 32), 0xFF, dtype=torch.uint8))
    order = fc1_row_order(inter)
    if bug == "gate_up":
        order = order.view(-1, 32).roll(8, dims=1).flatten()
    for local in range(g.count):
        pairs = torch.nonzero(flat == g.first + local).flatten()
        if not len(pairs):
            continue
        s13 = unswizzle_scales_128x4(prep.s13[local], 2 * inter, g.latent // 32).clone()
        if bug == "scale":
            s13[5, 1] += 1
        w13 = dequantize_mxfp4(prep.w13[local], s13).double()
        acc = (x[pairs // k] @ w13.T).float()  # [pairs, prepared rows]
        fc1 = torch.empty_like(acc)
        fc1[:, order] = acc
        act = stages.situ_and_mul_fp32(fc1[:, :inter], fc1[:, inter:], beta=cfg.situ_beta,
                                       linear_beta=cfg.situ_linear_beta,
                                       tanh=emulation.tanh_rn, sigmoid=emulation.sigmoid_rn)
        hcodes, hscales = quantize_mxfp8(act)
        s2 = unswizzle_scales_128x4(prep.s2[local], g.latent, inter // 32)
        w2 = dequantize_mxfp4(prep.w2[local], s2).double()
        rows = (dequantize_mxfp8(hcodes, hscales).double() @ w2.T).float().to(torch.bfloat16)
        if bug == "fc2":
            rows.view(torch.int16)[:, 3] += 1
        out[pairs] = rows
        cap.fc1[pairs], cap.codes[pairs], cap.scales[pairs] = fc1, hcodes.view(torch.uint8), hscales
    return out, cap


@pytest.mark.parametrize("shard", ((0, 1), (1, 2)))
def test_contract_holds_for_an_exact_replay_and_catches_planted_bugs(shard, seed):
    """The GPU contract (``check_blackwell_stages``) is a real one: it passes the kernels'
    data flow replayed exactly on the CPU from the prepared layout, and fails each planted
    mistake (wrong gate/up pairing, a misplaced weight scale, a dropped k block, an FC2
    output one ULP off)."""
    first, count, rows = 8, 16, 9
    w = cases.expert_code_weights("small", "cpu")
    prep = prepare_blackwell_experts(w, "cpu", experts=(first, count), shard=shard)
    codes, scales = _latent_rows(w.config, rows, seed)
    ids = cases.routing(w.config, rows, seed)
    out, cap = emulate_blackwell(prep, codes, scales, ids)
    check_blackwell_stages(w, (first, count), shard, codes, scales, ids, out, cap, what="replay")
    for bug in ("gate_up", "scale", "kblock", "fc2"):
        out, cap = emulate_blackwell(prep, codes, scales, ids, bug=bug)
        with pytest.raises(AssertionError):
            check_blackwell_stages(w, (first, count), shard, codes, scales, ids, out, cap,
                                   what=f"planted {bug}")


@functools.cache
def _engine(name: str, first: int, count: int, shard: tuple[int, int], max_rows: int):
    from fast.experts.blackwell import BlackwellExpertsEngine

    prep = prepare_blackwell_experts(cases.expert_code_weights(name, "cuda"), "cuda", experts=(first, count),
                                     shard=shard)
    return BlackwellExpertsEngine(prep, max_rows=max_rows)


def _latent_rows(cfg, rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cfg.latent, generator=g) * 2.0).to(torch.bfloat16)
    return quantize_mxfp8(x)


GPU_CASES = [
    ("small", 16, 16, (0, 1), 1, 0.0),
    ("small", 16, 16, (0, 1), 7, 0.0),
    ("small", 0, 64, (0, 1), 64, 0.0),
    ("small", 0, 64, (0, 1), 200, 1.2),  # skewed: many window groups per expert
    ("small", 0, 64, (1, 2), 65, 0.0),  # a TP2 slice
]


@pytest.mark.gpu
@pytest.mark.sm100
@needs_sm100
@pytest.mark.parametrize("name,first,count,shard,rows,skew", GPU_CASES)
@pytest.mark.parametrize("windows", (1, 2, 4))
def test_blackwell_stages(name, first, count, shard, rows, skew, windows, seed):
    engine = _engine(name, first, count, shard, 256)
    cfg = engine.config
    codes, scales = _latent_rows(cfg, rows, seed)
    ids = cases.routing(cfg, rows, seed, skew=skew)
    out, cap = engine(codes.cuda(), scales.cuda(), ids.cuda(), capture=True, windows=windows)
    check_blackwell_stages(cases.expert_code_weights(name, "cuda"), (first, count), shard, codes, scales, ids,
                           out, cap, what=f"blackwell {name} experts [{first}, {first + count}) "
                           f"shard {shard} rows {rows} windows {windows}")


@pytest.mark.gpu
@pytest.mark.sm100
@needs_sm100
@pytest.mark.parametrize("windows", (1, 4))
def test_blackwell_stages_few_ctas(windows, seed):
    """A grid of 3 CTAs: each runs many FC1 and FC2 items (the default grid holds every
    item of the small config at once, so a CTA's later items would never run)."""
    engine = _engine("small", 0, 64, (0, 1), 256)
    codes, scales = _latent_rows(engine.config, 200, seed)
    ids = cases.routing(engine.config, 200, seed, skew=1.2)
    out, cap = engine(codes.cuda(), scales.cuda(), ids.cuda(), capture=True, windows=windows,
                      ctas=3)
    check_blackwell_stages(cases.expert_code_weights("small", "cuda"), (0, 64), (0, 1), codes,
                           scales, ids, out, cap,
                           what=f"blackwell small rows 200 windows {windows} on 3 CTAs")


@pytest.mark.gpu
@pytest.mark.sm100
@pytest.mark.slow
@needs_sm100
@pytest.mark.parametrize("first,count,shard,rows", [(3 * 56, 56, (0, 1), 64), (0, 896, (5, 8), 65)])
def test_blackwell_stages_real(first, count, shard, rows, seed):
    """kimi_k3: a DEP16 owner at T = 4 and a TP8 rank at 65 rows."""
    engine = _engine("kimi_k3", first, count, shard, 128)
    cfg = engine.config
    codes, scales = _latent_rows(cfg, rows, seed)
    ids = cases.routing(cfg, rows, seed)
    out, cap = engine(codes.cuda(), scales.cuda(), ids.cuda(), capture=True)
    check_blackwell_stages(cases.expert_code_weights("kimi_k3", "cuda"), (first, count), shard, codes, scales,
                           ids, out, cap, what=f"blackwell kimi_k3 [{first}, {first + count}) "
                           f"shard {shard} rows {rows}")


@pytest.mark.gpu
@pytest.mark.sm100
@needs_sm100
def test_blackwell_rows_batch_invariant_and_deterministic(seed):
    """A pair's row does not depend on its window or batch (alone = in 200 rows, every
    window count) and reruns are bitwise equal."""
    engine = _engine("small", 0, 64, (0, 1), 256)
    cfg = engine.config
    codes, scales = _latent_rows(cfg, 200, seed)
    ids = cases.routing(cfg, 200, seed, skew=1.2)
    args = (codes.cuda(), scales.cuda(), ids.cuda())
    base = engine(*args, windows=4).view(torch.int16)
    for windows in (1, 2, 4):
        again = engine(*args, windows=windows).view(torch.int16)
        assert_bitwise_equal(again, base, what=f"rerun at windows {windows}",
                             index_names=("pair", "column"))
    k = cfg.top_k
    for r in (0, 57, 199):
        alone = engine(codes[r:r + 1].cuda(), scales[r:r + 1].cuda(), ids[r:r + 1].cuda())
        assert_bitwise_equal(alone.view(torch.int16), base[r * k:(r + 1) * k],
                             what=f"row {r} alone vs in the batch", index_names=("pair", "column"))
