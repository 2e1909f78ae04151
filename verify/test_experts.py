"""Contracts of the routed experts' rows (the ``expert_rows`` stage), for every backend
that claims the stage, and of the fast engine's own knobs (``fast.experts``) on the GPU.

A backend's rows come from MXFP8 latent rows, routing ids, an expert range (a DEP owner's
slice) and a tensor-parallel shard (``verify.interface.Backend.expert_rows``). By its claim:

* bitwise: every local pair's row bit-identical to the reference's
  (``reference.experts``, itself equal to the pair loop
  :func:`verify.oracles.experts.expert_rows` bit for bit);
* bound (``fast``): the only freedom is the order of FC1's and FC2's FP32 sums
  (tensor-core MMA), so the backend hands over its intermediates and is checked stage by
  stage on them:

  1. FC1 (FP32) against the float64 product of the exactly dequantized operands, within
     ``gamma_n(2^-23) * sum|x w|`` with ``n = K + K/16`` (``mma_fc_bound``);
  2. SiTU + MXFP8 re-quantization **bitwise**: ``reference.mx.quantize_mxfp8`` of the
     SiTU oracle (:func:`verify.oracles.stages.situ_and_mul_fp32`, with the ``tanh`` and
     ``sigmoid`` the claim names: ``fast``'s ``tanh_rn`` / ``sigmoid_rn``) of the
     backend's own FC1 output (the kernel uses the same IEEE operation sequence and the
     RCEIL rule of ``fast.mx``);
  3. FC2 (BF16 rows) against the float64 product of the backend's own MXFP8 hidden and
     the dequantized ``w2``, within the same accumulation bound plus the final BF16
     rounding.

  So an FC1 difference of one ULP that moves an MXFP8 code is accounted for (step 2 uses
  the backend's FC1), and a wrong code, a swapped gate/up, a dropped token or a wrong
  expert is a failure, never absorbed by a tolerance.

For every claim, rows of pairs whose expert is not local stay NaN, and the rows are batch
invariant (alone, in a window, in a large batch), deterministic and independent of the
routing-list order (rows permuted). The fast engine's own contracts: every window count
and FC kernel shape stage by stage, shapes that change no bit, the two MMA kinds
(``mma.sync``, ``wgmma``) giving the same bits, the decode of every scale code, and bad
input raising before (or, for ids, right after) the launch.

The reference's rows are checked against the same pair loop in
``verify/test_experts_reference.py``.

The tensor-core model: ``mma.sync`` adds the 16 exact products of a step and the FP32
accumulator with aligned, truncating adders (Fasi, Higham, Mikaitis, Pranesh, *Numerical
behavior of NVIDIA tensor cores*, PeerJ CS 2021): each of the ``16 + 1`` terms of a step
loses less than one ULP (``2^-23`` relative) of the largest, so with ``K/16`` steps every
product passes through at most ``K + K/16`` such losses; the engine may split the steps
over up to 4 accumulator chains joined by 3 FP32 additions at the end:
``gamma_{K + K/16 + 3}(2^-23)`` (Higham §3.1) on ``sum |x_i w_i|``, plus the subnormal
term of ``verify.bounds``.
"""

from __future__ import annotations

import functools

import pytest
import torch

from model.config import LatentMoEConfig
from model.formats import dequantize_mxfp4
from model.weights import LatentMoEWeights
from reference.experts import expert_rows_mxfp8
from reference.mx import dequantize_mxfp8, quantize_mxfp8
from verify import bounds, cases
from verify.interface import Claim, ExpertRows
from verify.oracles import stages as oracle_stages


U_TRUNC = 2.0**-23  # one ULP of FP32 relative: a truncating adder's loss


def mma_terms(k: int) -> int:
    """Roundings each product may pass through: a K-long chain of ``mma.m16n8k16`` steps
    (``K + K/16`` truncating losses) split into at most 4 accumulator chains that are
    then added in order (3 more roundings)."""
    return k + k // 16 + 3


def mma_fc_bound(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 ``x @ w^T``, bound of an FP32 MMA chain's distance to it). x [P, K], w [N, K]
    FP32 with exactly representable entries (dequantized MX values)."""
    bound, ref = bounds.matmul_out_bound(x, w, mma_terms(x.shape[-1]), None, "toward_zero")
    return ref, bound


# --- weights and inputs -----------------------------------------------------------------


def latent_rows(cfg: LatentMoEConfig, rows: int, seed: int):
    """MXFP8 (codes, scales) of random BF16 latent rows (the reference quantizer)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cfg.latent, generator=g) * 2.0).to(torch.bfloat16)
    return quantize_mxfp8(x)


@functools.cache
def engine_for(name: str, first: int, count: int, shard: tuple[int, int], max_rows: int,
               strict: bool = False):
    from fast.experts import ExpertsEngine, prepare_experts

    w = cases.expert_code_weights(name, "cuda")
    prepared = prepare_experts(w, "cuda", experts=(first, count), shard=shard)
    return ExpertsEngine(prepared, max_rows=max_rows, strict=strict)


# --- stage-by-stage ---------------------------------------------------------------------


def check_stages(contract, w: LatentMoEWeights, experts: tuple[int, int],
                 shard: tuple[int, int], codes, scales, ids, result: ExpertRows, *,
                 claim: Claim, what: str):
    """The three stage contracts over every local pair, expert by expert (``w``: the
    weights the rows were computed from; ``result`` with its intermediates; ``claim``:
    the SiTU's ``tanh`` / ``sigmoid``); non-local rows untouched (NaN)."""
    cfg = w.config
    functions = dict(tanh=claim.tanh or torch.tanh, sigmoid=claim.sigmoid or torch.sigmoid)
    inter = result.fc1.shape[1] // 2
    first, count = experts
    out = result.rows
    dev = out.device
    flat = ids.reshape(-1).long().to(dev)
    local = (flat >= first) & (flat < first + count)
    x = dequantize_mxfp8(codes.to(dev), scales.to(dev))  # [R, L] FP32, exact
    k = cfg.top_k
    for e in torch.unique(flat[local]).tolist():
        pairs = torch.nonzero(flat == e).flatten()
        w13, w2 = cases.dequantized_expert(w, e, shard)
        ref1, bound1 = mma_fc_bound(x[pairs // k], w13)
        contract.bounded(result.fc1[pairs], ref1, bound1, what=f"{what}: FC1 of expert {e}",
                         bound_name="gamma_{K+K/16+3}(2^-23) sum|x w| (tensor-core MMA)",
                         index_names=("pair", "column"))
        fc1 = result.fc1[pairs].cpu()
        act = oracle_stages.situ_and_mul_fp32(fc1[:, :inter], fc1[:, inter:], beta=cfg.situ_beta,
                                              linear_beta=cfg.situ_linear_beta, **functions)
        want_codes, want_scales = quantize_mxfp8(act)
        contract.bitwise(result.hidden_codes[pairs].cpu(), want_codes.view(torch.uint8),
                         what=f"{what}: SiTU + MXFP8 codes of expert {e}", index_names=("pair", "column"))
        contract.bitwise(result.hidden_scales[pairs].cpu(), want_scales,
                         what=f"{what}: MXFP8 scales of expert {e}", index_names=("pair", "block"))
        hidden = dequantize_mxfp8(result.hidden_codes[pairs].view(torch.float8_e4m3fn),
                                  result.hidden_scales[pairs])
        ref2, beta2 = mma_fc_bound(hidden, w2)
        bound2 = bounds.final_rounding_bound(ref2, beta2, torch.bfloat16)
        contract.bounded(out[pairs], ref2, bound2, what=f"{what}: FC2 rows of expert {e}",
                         bound_name="gamma_{K+K/16+3}(2^-23) sum|h w| + BF16 half-ULP",
                         index_names=("pair", "column"))
    _check_untouched(out, local, what)


def _check_untouched(out: torch.Tensor, local: torch.Tensor, what: str) -> None:
    untouched = out[~local]
    assert bool(torch.isnan(untouched.float()).all()), f"{what}: a non-local pair's row was written"


def check_rows_bitwise(contract, w: LatentMoEWeights, experts: tuple[int, int],
                       shard: tuple[int, int], codes, scales, ids, out, *, what: str):
    """Every local pair's row bit-identical to the reference's
    (``reference.experts.expert_rows_mxfp8`` on the weights' device: its FC sums of MX
    products are exact in float64 wherever they run, and it equals the pair loop of
    :mod:`verify.oracles.experts` bit for bit, ``verify/test_experts_reference.py``);
    non-local rows untouched (NaN)."""
    first, count = experts
    dev = w.device
    flat = ids.reshape(-1).long().cpu()
    local = (flat >= first) & (flat < first + count)
    want = expert_rows_mxfp8(codes.to(dev), scales.to(dev), ids.to(dev), w, w.config,
                             shard=None if shard == (0, 1) else shard).cpu()
    contract.bitwise(out.cpu()[local], want[local], what=f"{what}: local rows vs the reference",
                     index_names=("pair", "column"))
    _check_untouched(out.cpu(), local, what)


# --- cases ------------------------------------------------------------------------------

# (config, first, count, shard, rows, skew): DEP owners (a slice of the experts, all of
# the intermediate) and wide TP slices (every expert, a slice of the intermediate).
STAGE_CASES = [
    ("small", 16, 16, (0, 1), 1, 0.0),
    ("small", 16, 16, (0, 1), 7, 0.0),
    ("small", 0, 64, (0, 1), 64, 0.0),
    ("small", 0, 64, (0, 1), 200, 1.2),  # skewed: many window groups per expert
    ("small", 0, 64, (1, 2), 65, 0.0),
    ("small", 0, 64, (3, 4), 100, 0.0),
]
REAL_CASES = [
    ("kimi_k3", 3 * 56, 56, (0, 1), 16 * 4, 0.0),  # DEP16 rank 3, T = 4 tokens per rank
    ("kimi_k3", 0, 896, (5, 8), 65, 0.0),  # TP8 rank 5, 65 rows
]


def _check_backend(backend, contract, name, first, count, shard, rows, skew, seed):
    """The stage's contract on one case, by the backend's claim."""
    claim = backend.claim("expert_rows")
    w = cases.expert_code_weights(name, backend.device)
    cfg, dev = w.config, backend.device
    codes, scales = latent_rows(cfg, rows, seed)
    ids = cases.routing(cfg, rows, seed, skew=skew)
    result = backend.expert_rows(codes.to(dev), scales.to(dev), ids.to(dev), w,
                                 experts=(first, count), shard=shard,
                                 intermediates=not claim.exact)
    what = f"{backend.name} {name} experts [{first}, {first + count}) shard {shard} rows {rows}"
    if claim.exact:
        check_rows_bitwise(contract, w, (first, count), shard, codes, scales, ids, result.rows,
                           what=what)
    else:
        check_stages(contract, w, (first, count), shard, codes, scales, ids, result,
                     claim=claim, what=what)


@pytest.mark.backends("fast", external=True)
@pytest.mark.parametrize("config_name,first,count,shard,rows,skew", STAGE_CASES)
def test_experts_stages(backend, config_name, first, count, shard, rows, skew, seed, contract):
    _check_backend(backend, contract, config_name, first, count, shard, rows, skew, seed)


@pytest.mark.backends("fast", external=True)
@pytest.mark.slow
@pytest.mark.parametrize("config_name,first,count,shard,rows,skew", REAL_CASES)
def test_experts_stages_real(backend, config_name, first, count, shard, rows, skew, seed, contract):
    if backend.device == "cpu":
        pytest.skip("the real layer's 15 GB of MXFP4 experts are generated only where a GPU "
                    "holds them")
    _check_backend(backend, contract, config_name, first, count, shard, rows, skew, seed)


# --- the fast engine's own knobs ----------------------------------------------------------


def _run_stages(backend, contract, name, first, count, shard, rows, skew, seed, windows=None,
                tactic=None):
    engine = engine_for(name, first, count, shard, max(rows, 256))
    cfg = engine.config
    codes, scales = latent_rows(cfg, rows, seed)
    ids = cases.routing(cfg, rows, seed, skew=skew)
    out, cap = engine(codes.cuda(), scales.cuda(), ids.cuda(), capture=True, windows=windows,
                      tactic=tactic)
    check_stages(contract, cases.expert_code_weights(name, "cuda"), (first, count), shard,
                 codes, scales, ids, ExpertRows(out, cap.fc1, cap.codes, cap.scales),
                 claim=backend.claim("expert_rows"),
                 what=f"{name} experts [{first}, {first + count}) shard {shard} rows {rows}")


@pytest.mark.gpu
@pytest.mark.backends("fast")
@pytest.mark.config("small")
@pytest.mark.parametrize("windows,tactic", [(1, None), (2, None), (4, None),
                                            (4, dict(wgmma=0)), (4, dict(wgmma=1))],
                         ids=("w1", "w2", "w4", "w4-mma.sync", "w4-wgmma"))
def test_experts_stages_every_window_count(backend, windows, tactic, seed, contract):
    """Every compiled window count, on skewed routing (experts with several groups): the
    call's default at each (on sm_90a the four-window default is ``wgmma`` with 8 warps),
    ``mma.sync`` and ``wgmma`` (4 warps) at four named."""
    from fast.backend import gpu_arch

    _skip_unless_wgmma(tactic or {}, gpu_arch())
    _run_stages(backend, contract, "small", 0, 64, (0, 1), 160, 1.0, seed, windows=windows,
                tactic=tactic)


TACTICS = [dict(warps=8, mtiles=1), dict(warps=4, mtiles=1), dict(warps=2, mtiles=2),
           dict(ring=2), dict(ring=6), dict(chains=2), dict(chains=4), dict(occupancy=1),
           dict(wgmma=1), dict(wgmma=1, warps=4, mtiles=1), dict(wgmma=1, warps=8, mtiles=1),
           dict(wgmma=1, ring=6), dict(pdl_chain=1), dict(pdl_chain=1, wgmma=1),
           dict(fused=1), dict(fused=1, warps=4, mtiles=1), dict(fused=1, wgmma=1),
           dict(fused=1, pdl_chain=1),
           # a grid of 3 CTAs: each runs many items (as at a real rank's batch), so a CTA's
           # later FC1 items and its FC2 items after FC1 ones are exercised
           dict(ctas=3), dict(fused=1, pdl_chain=1, ctas=3),
           dict(wgmma=1, warps=8, mtiles=2, fused=1, pdl_chain=1, ctas=3),
           # FC2 items of several row tiles (2 of the small config's 128-row tiles, 4 of
           # its 64-row ones), the ring running across each tile boundary
           dict(walk=2), dict(walk=4, warps=4, mtiles=1), dict(walk=2, ctas=3),
           dict(walk=2, wgmma=1), dict(walk=2, fused=1, pdl_chain=1, ctas=3)]


def _skip_unless_wgmma(tactic: dict, arch: str) -> None:
    if tactic.get("wgmma") and arch != "sm_90a":
        pytest.skip(f"wgmma is an sm_90a instruction; this GPU is {arch}")


@pytest.mark.gpu
@pytest.mark.backends("fast")
@pytest.mark.config("small")
@pytest.mark.parametrize("tactic", TACTICS, ids=lambda t: ",".join(f"{k}={v}" for k, v in t.items()))
def test_experts_stages_every_tactic(backend, tactic, seed, contract):
    """Every FC kernel shape the engine can be asked for, stage by stage."""
    from fast.backend import gpu_arch

    _skip_unless_wgmma(tactic, gpu_arch())
    _run_stages(backend, contract, "small", 0, 64, (0, 1), 96, 1.0, seed, tactic=tactic)


# the shapes both MMA kinds run; mma.sync also runs 2 warps of 2 m-tiles (wgmma has no
# such shape)
_CHAIN_FREE_SHAPES = (
    dict(warps=8, mtiles=1), dict(warps=4, mtiles=1), dict(ring=2), dict(ring=6, occupancy=1),
    dict(pdl_chain=1), dict(fused=1), dict(fused=1, ctas=2), dict(walk=2),
    dict(walk=4, warps=4, mtiles=1), dict(walk=2, ctas=2), dict(walk=2, ring=2),
    dict(walk=2, fused=1, ctas=2))
_MMA_SYNC_ONLY_SHAPES = (dict(warps=2, mtiles=2),)
# (mma kind, window count)
_CHAIN_FREE_CASES = [(0, 1), (0, 2), (0, 4), (1, 1), (1, 2), (1, 4)]


@pytest.mark.gpu
@pytest.mark.backends("fast")
@pytest.mark.config("small")
@pytest.mark.parametrize("wgmma,windows", _CHAIN_FREE_CASES,
                         ids=[f"{'wgmma' if k else 'mma.sync'}-w{w}" for k, w in _CHAIN_FREE_CASES])
def test_experts_tactics_change_no_bit_but_chains(backend, seed, contract, wgmma, windows):
    """Tile shape, ring depth, occupancy, the launch chain, the fused grid, the grid's
    size and FC2's walk over several row tiles never
    change a bit (the sum order of each output is the chunk order); only the number
    of accumulator chains does. Checked for each MMA kind against itself, one case per
    (kind, window count)."""
    from fast.backend import gpu_arch

    _skip_unless_wgmma(dict(wgmma=wgmma), gpu_arch())
    engine = engine_for("small", 0, 64, (0, 1), 256)
    codes, scales = latent_rows(engine.config, 96, seed)
    ids = cases.routing(engine.config, 96, seed, skew=1.0)
    args = (codes.cuda(), scales.cuda(), ids.cuda())
    base = engine(*args, windows=windows, tactic=dict(wgmma=wgmma))
    for tactic in _CHAIN_FREE_SHAPES + (() if wgmma else _MMA_SYNC_ONLY_SHAPES):
        tactic = dict(tactic, wgmma=wgmma)
        contract.bitwise(_bits(engine(*args, windows=windows, tactic=tactic)), _bits(base),
                         what=f"tactic {tactic} vs the default shape, windows {windows}",
                         index_names=("pair", "column"))


@pytest.mark.gpu
@pytest.mark.backends("fast")
@pytest.mark.config("small")
@pytest.mark.parametrize("spread", (0, 12), ids=("plain", "spread"))
def test_experts_mma_kinds_same_bits(backend, seed, contract, spread):
    """``mma.sync`` (named: at four windows the default is ``wgmma``) and ``wgmma`` (4
    warps, and 8 warps of 2 m-tiles) give the same FP32 FC1 and the same rows, at one and
    at four windows. Both add each 16-k
    step's exact products to the FP32 accumulator on the tensor cores, in the same step
    order; this contract is what allows a tactic to change the MMA kind with the batch
    without breaking a pair's batch invariance. ``spread``: each 32-element block of a
    latent row scaled by ``2^u``, ``u`` uniform in -12..12, so one step adds products of
    very different exponents (where an adder's alignment and truncation show)."""
    from fast.backend import gpu_arch

    _skip_unless_wgmma(dict(wgmma=1), gpu_arch())
    engine = engine_for("small", 0, 64, (0, 1), 256)
    cfg = engine.config
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, cfg.latent, generator=g)
    if spread:
        u = torch.randint(-spread, spread + 1, (256, cfg.latent // 32), generator=g)
        x = x * torch.exp2(u.float()).repeat_interleave(32, dim=1)
    codes, scales = quantize_mxfp8(x.to(torch.bfloat16))
    ids = cases.routing(cfg, 256, seed, skew=0.5)
    args = (codes.cuda(), scales.cuda(), ids.cuda())
    for windows in (1, 4):
        rows, cap = engine(*args, windows=windows, capture=True, tactic=dict(wgmma=0))
        for tactic in (dict(wgmma=1), dict(wgmma=1, warps=8, mtiles=2)):
            other, other_cap = engine(*args, windows=windows, capture=True, tactic=tactic)
            what = f"{tactic} vs mma.sync, windows {windows}"
            contract.bitwise(other_cap.fc1.view(torch.int32), cap.fc1.view(torch.int32),
                             what=f"FC1 of {what}", index_names=("pair", "column"))
            contract.bitwise(_bits(other), _bits(rows), what=f"rows of {what}",
                             index_names=("pair", "column"))


REAL_TACTIC_CASES = [
    ("kimi_k3", 0, 896, (0, 8), 512, 0.0),  # TP8 rank 0, 512 rows: two windows per item
    ("kimi_k3", 2 * 56, 56, (0, 1), 16 * 64, 1.0),  # DEP16 rank 2, T = 64, skewed: four
]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.backends("fast")
@pytest.mark.parametrize("config_name,first,count,shard,rows,skew", REAL_TACTIC_CASES,
                         ids=("tp8-512", "dep16-T64-skewed"))
def test_experts_tactics_change_no_bit_real(backend, config_name, first, count, shard, rows,
                                            skew, seed, contract):
    """At the real widths and batches (items of several windows, thousands of them), the
    launch chain and the fused grid give the two kernels' bits, and the fused grid with
    wgmma (with 8 warps too) gives wgmma's: the small config's tactic contract where the
    number of work items and of concurrent waits is a real rank's (the fused kernel's
    first gate faulted only there and at two or more windows). The call's default
    (``default_tactic``: at DEP16 T = 64, four windows, wgmma with 8 warps on sm_90a) gives
    the ``mma.sync`` two kernels' bits too."""
    engine = engine_for(config_name, first, count, shard, rows)
    codes, scales = latent_rows(engine.config, rows, seed)
    ids = cases.routing(engine.config, rows, seed, skew=skew)
    args = (codes.cuda(), scales.cuda(), ids.cuda())
    # against the two kernels of the default tile, named explicitly (a DEP owner's default
    # call runs the fused grid, one of the shapes under test)
    base = {False: _bits(engine(*args, tactic={}))}
    shapes = [dict(pdl_chain=1), dict(fused=1), dict(fused=1, pdl_chain=1)]
    if shard[1] > 1:  # a TP slice: FC2 has 3 stages per tile, so its items may walk tiles
        shapes += [dict(walk=4), dict(walk=7), dict(walk=4, fused=1)]
    if engine.arch == "sm_90a":
        base[True] = _bits(engine(*args, tactic=dict(wgmma=1)))
        shapes += [dict(wgmma=1, fused=1),
                   dict(wgmma=1, warps=8, mtiles=2, fused=1, pdl_chain=1)]
    for tactic in shapes:
        wgmma = bool(tactic.get("wgmma"))
        contract.bitwise(_bits(engine(*args, tactic=tactic)), base[wgmma],
                         what=f"{config_name} rows {rows}: tactic {tactic} vs the two kernels",
                         index_names=("pair", "column"))
    contract.bitwise(_bits(engine(*args)), base[False],
                     what=f"{config_name} rows {rows}: the call's default "
                          f"{engine.default_tactic(rows)} vs mma.sync's two kernels",
                     index_names=("pair", "column"))


# --- invariances ------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _rows(backend, w, codes, scales, ids) -> torch.Tensor:
    """The backend's rows of every pair (all experts local, no shard)."""
    dev = backend.device
    return backend.expert_rows(codes.to(dev), scales.to(dev), ids.to(dev), w,
                               experts=(0, w.config.experts), shard=(0, 1)).rows


@pytest.mark.backends("fast", external=True)
@pytest.mark.config("small")
def test_experts_batch_invariant_and_order_free(backend, seed, contract):
    """A pair's row has the same bits alone, in a window of 8 rows, in a batch of 256, and
    with the batch's rows permuted (other routing-list claim orders)."""
    backend.claim("expert_rows")
    w = cases.expert_code_weights("small", backend.device)
    cfg = w.config
    codes, scales = latent_rows(cfg, 256, seed)
    ids = cases.routing(cfg, 256, seed, skew=0.8)
    full = _rows(backend, w, codes, scales, ids).cpu()
    k = cfg.top_k
    for rows in (slice(0, 1), slice(0, 8), slice(100, 101)):
        part = _rows(backend, w, codes[rows], scales[rows], ids[rows]).cpu()
        contract.bitwise(_bits(part), _bits(full[rows.start * k:rows.stop * k]),
                         what=f"rows {rows.start}:{rows.stop} alone vs in a batch of 256",
                         index_names=("pair", "column"))
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(seed))
    shuffled = _rows(backend, w, codes[perm], scales[perm], ids[perm]).cpu()
    back = shuffled.view(256, k, -1)[torch.argsort(perm)].reshape(256 * k, -1)
    contract.bitwise(_bits(back), _bits(full), what="rows permuted (list order)",
                     index_names=("pair", "column"))


@pytest.mark.gpu
@pytest.mark.backends("fast")
@pytest.mark.config("small")
def test_experts_wgmma_batch_invariant_order_free_deterministic(backend, seed, contract):
    """The wgmma tactic on its own (sm_90a): a pair's row has the same bits alone (one
    window: m64n8k16), in a window of 8 rows and in a batch of 256 (up to four windows:
    m64n32k16), with the rows permuted, and over 20 reruns."""
    from fast.backend import gpu_arch

    _skip_unless_wgmma(dict(wgmma=1), gpu_arch())
    engine = engine_for("small", 0, 64, (0, 1), 256)
    cfg, k = engine.config, engine.config.top_k
    codes, scales = latent_rows(cfg, 256, seed)
    ids = cases.routing(cfg, 256, seed, skew=0.8)
    tactic = dict(wgmma=1)

    def rows_of(sel):
        return engine(codes[sel].cuda(), scales[sel].cuda(), ids[sel].cuda(),
                      tactic=tactic).cpu()

    full = rows_of(slice(0, 256))
    for sel in (slice(0, 1), slice(0, 8), slice(100, 101)):
        contract.bitwise(_bits(rows_of(sel)), _bits(full[sel.start * k:sel.stop * k]),
                         what=f"wgmma: rows {sel.start}:{sel.stop} alone vs in a batch of 256",
                         index_names=("pair", "column"))
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(seed))
    shuffled = rows_of(perm)
    back = shuffled.view(256, k, -1)[torch.argsort(perm)].reshape(256 * k, -1)
    contract.bitwise(_bits(back), _bits(full), what="wgmma: rows permuted (list order)",
                     index_names=("pair", "column"))
    for _ in range(20):
        contract.bitwise(_bits(rows_of(slice(0, 256))), _bits(full), what="wgmma: rerun",
                         index_names=("pair", "column"))


@pytest.mark.backends("fast", external=True)
@pytest.mark.config("small")
def test_experts_deterministic(backend, seed, contract):
    """20 reruns of one call give the same bits."""
    backend.claim("expert_rows")
    w = cases.expert_code_weights("small", backend.device)
    codes, scales = latent_rows(w.config, 128, seed)
    ids = cases.routing(w.config, 128, seed, skew=1.0)
    first = _rows(backend, w, codes, scales, ids)
    for _ in range(20):
        contract.bitwise(_bits(_rows(backend, w, codes, scales, ids)), _bits(first),
                         what="rerun", index_names=("pair", "column"))


@pytest.mark.gpu
@pytest.mark.backends("fast")
@pytest.mark.config("small")
@pytest.mark.parametrize("tactic", (dict(wgmma=0), dict(wgmma=1), None),
                         ids=("mma.sync", "wgmma", "default"))
def test_experts_decode_range(backend, contract, tactic):
    """Every E2M1 code under every supported scale code (0..128) decodes exactly: FC1 of
    one-hot latent rows returns each weight itself (one exact product plus zeros), with
    each MMA kind named and with the call's default (256 rows on 16 experts: four windows,
    ``wgmma`` with 8 warps on sm_90a); the BF16 subnormals of scale codes 0 and 1 must
    survive each."""
    from fast.backend import gpu_arch
    from fast.experts import ExpertsEngine, prepare_experts

    _skip_unless_wgmma(tactic or {}, gpu_arch())

    cfg = LatentMoEConfig.small()
    w = cases.expert_code_weights("small", "cuda")
    gen = torch.Generator(device="cuda").manual_seed(3)
    w13_scales = torch.randint(0, 129, w.w13_scales.shape, generator=gen, device="cuda",
                               dtype=torch.uint8)
    w13_scales[0, :4] = torch.arange(4, device="cuda", dtype=torch.uint8)[:, None]  # 0..3 seen
    weights = LatentMoEWeights(**{**{f: getattr(w, f) for f in (
        "gate", "bias", "front", "shared_down", "latent_norm", "up", "w13", "w2", "w2_scales")},
        "w13_scales": w13_scales}, config=cfg)
    engine = ExpertsEngine(prepare_experts(weights, "cuda", experts=(0, 16)), max_rows=cfg.latent)
    x = torch.eye(cfg.latent, dtype=torch.bfloat16)  # row k: the unit vector e_k
    codes, scales = quantize_mxfp8(x)
    ids = torch.arange(16, dtype=torch.int32).expand(cfg.latent, 16).contiguous()
    _, cap = engine(codes.cuda(), scales.cuda(), ids.cuda(), capture=True, tactic=tactic)
    fc1 = cap.fc1.view(cfg.latent, 16, -1)  # [k, expert, 2I]
    for e in range(16):
        w13 = dequantize_mxfp4(weights.w13[e], weights.w13_scales[e])  # [2I, L]
        got = fc1[:, e].T.contiguous()
        same = (got == w13)  # value equality: a -0 weight gives +0 after adding zeros
        assert bool(same.all()), (f"expert {e}: decoded weight differs at (row, k) "
                                  f"{tuple(torch.nonzero(~same)[0].tolist())}")
    contract.figure("decoded_scale_codes", 129.0, worst="min")


# --- bad input --------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.backends("fast")
@pytest.mark.config("small")
def test_experts_bad_input(backend):
    from fast.experts import EngineError, ExpertsEngine, prepare_experts

    engine = engine_for("small", 16, 16, (0, 1), 8)
    strict = ExpertsEngine(engine.prepared, max_rows=8, strict=True)
    cfg = engine.config
    codes, scales = latent_rows(cfg, 4, 1)
    codes, scales = codes.cuda(), scales.cuda()
    ids = cases.routing(cfg, 4, 1).cuda()
    with pytest.raises(ValueError, match="ids must be int32"):
        engine(codes, scales, ids.long())
    with pytest.raises(ValueError, match="codes must be float8_e4m3fn"):
        engine(codes.view(torch.uint8), scales, ids)
    with pytest.raises(ValueError, match="scales must be uint8"):
        engine(codes, scales[:, :-1].contiguous(), ids)
    with pytest.raises(ValueError, match="on cpu"):
        engine(codes.cpu(), scales, ids)
    with pytest.raises(ValueError, match="max_rows=8"):
        big, big_s = latent_rows(cfg, 9, 2)
        engine(big.cuda(), big_s.cuda(), cases.routing(cfg, 9, 2).cuda())
    bad = ids.clone()
    bad[2, 5] = cfg.experts
    with pytest.raises(EngineError, match=r"ids\[2, 5\] = 64 is outside"):
        engine(codes, scales, bad)
    engine(codes, scales, ids)  # the error was cleared
    # every row names local expert 16 in two slots: 16 appends to a list of capacity 8.
    # The pairs past the capacity are refused, and the plan kernel runs no item at all
    # (a clamped list would still compute some rows: none is written)
    full, full_s = latent_rows(cfg, 8, 3)
    twice = cases.routing(cfg, 8, 3).cuda()
    twice[:, :2] = 16
    rows = engine(full.cuda(), full_s.cuda(), twice, validate=False)
    with pytest.raises(EngineError, match=r"expert 16's routing list is over its capacity 8"):
        engine.check()
    assert bool(rows.isnan().all()), "a call whose routing list overflowed wrote rows"
    engine(codes, scales, ids)  # the error was cleared, the lists re-armed
    nonlocal_ids = torch.zeros_like(ids)
    nonlocal_ids[:] = torch.arange(16, dtype=torch.int32, device="cuda") + 32  # experts 32..47
    with pytest.raises(EngineError, match="not a local expert"):
        strict(codes, scales, nonlocal_ids)
    with pytest.raises(ValueError, match="scale codes 0..128"):
        w = cases.expert_code_weights("small", "cuda")
        s = w.w13_scales.clone()
        s[3, 7, 1] = 129
        prepare_experts(LatentMoEWeights(**{**{f: getattr(w, f) for f in (
            "gate", "bias", "front", "shared_down", "latent_norm", "up", "w13", "w2", "w2_scales")},
            "w13_scales": s}, config=w.config), "cuda")
