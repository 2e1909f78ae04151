"""S1, the DEP layer, against S0 (the stock order) at 1, 2, 4, 8 and 16 virtual ranks.

What must hold (see ``reference.schedules.dep``'s table):

* with the split-K tactics set to 1, every stage up to the expert rows is S0's bit for
  bit at any N; the routed latent is S0's at N = 1 and within the derived bound of the
  owner-split Finalize at N > 1; RMSNorm and the addmm are bitwise on S1's own routed;
* with the seed's default tactics, the router logits are within the split-K bound and
  any routing flip lies inside the scores' bound; downstream is bitwise on S1's routing;
* a token's output does not depend on its batch-mates (nor on the other ranks' tokens);
* planted bugs (a swapped k, a reversed combine, biased routing weights) are caught.

The bound of the owner-split Finalize (``grouped_finalize_bound``) is derived in its
docstring from Higham's gamma_n and the half-ULP of each observed BF16 rounding
(``verify.bounds``); ``tests/test_schedule_wide.py`` uses it for the TP-split rows.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from reference.config import LatentMoEConfig
from reference.finalize import finalize
from reference.gemm import addmm
from reference.layer import StockTrace, stock_order_trace
from reference.mx import quantize_mxfp8
from reference.norm import rms_norm
from reference.schedules import dep
from reference.schedules.dep import dep_layer_virtual, local_finalize, ordered_combine
from reference.schedules.launch import make_inputs
from reference.weights import LatentMoEWeights
from verify import bounds, tolerances
from verify.compare import ContractError, assert_bitwise_equal, assert_within_bound
from verify.routing import biased_score_bound, compare_routing

# K = 16 and the block of 32 as in the real layer; I = 512 so that I/16 is a whole block
# (the wide layer's TP slices at 16 ranks); E = 32 experts: 2 per rank at 16 ranks; the
# latent (64 = two MX blocks) and hidden widths small: the reference experts dequantize
# every MXFP4 weight they touch on the CPU, which dominates the run time.
CONFIG = LatentMoEConfig(
    hidden=256, latent=64, experts=32, top_k=16, intermediate=512, shared_intermediate=256
)
TOKENS = 6
RANKS = [1, 2, 4, 8, 16]

U32 = bounds.unit_roundoff(torch.float32)
ETA32 = 2.0**-150  # half the smallest FP32 subnormal spacing (an FMA's absolute error there)
TINY_BF16 = 2.0**-134  # half the smallest BF16 subnormal spacing


@pytest.fixture(scope="module")
def weights():
    return LatentMoEWeights.random(CONFIG, seed=2026)


# ------------------------------------------------------------------ derived bounds


def observed_rounding(v: torch.Tensor) -> torch.Tensor:
    """Bound on ``|v - y|`` for a BF16 value ``v = RNE_bf16(y)``, from ``v`` alone: half a
    BF16 ULP in the binade of ``|v|`` (if ``|y| > |v|`` then ``y`` lies within half a
    spacing of ``v``'s binade; if ``|y| < |v|`` the lower binade's spacing is smaller), and
    at least half the smallest subnormal spacing (``v = 0`` may come from a tiny ``y``)."""
    return bounds.rounding_bound(v.double(), torch.bfloat16, propagated=TINY_BF16)


def _f64_upper(x: torch.Tensor, n: int) -> torch.Tensor:
    """A float64 quantity evaluated with at most ``n`` roundings on any path, inflated
    by ``1 + gamma_{n+4}(2^-53)`` so it bounds the real-number value."""
    return x * (1.0 + bounds.gamma(n + 4, 2.0**-53))


def grouped_finalize_bound(
    w: torch.Tensor,
    rows0: torch.Tensor,
    out0: torch.Tensor,
    terms: torch.Tensor,
    partials: torch.Tensor,
    present: torch.Tensor,
    out1: torch.Tensor,
    row_gap: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bound on ``|out1 - out0|`` (float64 [T, L]) for two Finalize orders of one sum.

    * ``out0 = bf16(F0)``, ``F0`` = the FP32 FMA chain ``sum_j w_j rows0_j`` (k terms);
    * ``out1 = bf16(C)``, ``C`` = the FP32 sum in group order of the present group
      partials ``P_g = bf16(F_g)``, ``F_g`` = the FMA chain ``sum_j w_j terms_gj``;
    * ``|rows0_j - sum_g terms_gj| <= row_gap_j`` (0 when the groups split the rows
      exactly, as the DEP owners do).

    Chain: ``|out1 - out0| <= |out1 - C| + |C - sum P| + sum |P - F_g| + sum |F_g - S_g| +
    |sum_j w_j (sum_g terms - rows0)| + |S0 - F0| + |F0 - out0|`` with
    ``|F - S| <= gamma_k(u32) sum |w t| + k eta (1 + gamma_k)`` (each FMA rounds once; the
    products are exact, so only a subnormal result adds ``eta``), ``|C - sum P| <=
    gamma_{G-1}(u32) sum |P|`` (Higham §4.2) and each BF16 rounding bounded by
    :func:`observed_rounding` of its result.

    Shapes: ``w [T, k]`` FP32, ``rows0 [T, k, L]``, ``out0``/``out1 [T, L]``,
    ``terms [G, T, k, L]`` (0 outside a group), ``partials [G, T, L]``, ``present [G, T]``.
    """
    k, groups = w.shape[1], partials.shape[0]
    g_k = bounds.gamma(k, U32)
    aw = w.double().abs()[:, :, None]
    b = g_k * (aw * rows0.double().abs()).sum(1) + k * ETA32 * (1 + g_k) + observed_rounding(out0)
    b = b + observed_rounding(out1)
    pres = present[:, :, None]
    p_abs = torch.where(pres, partials.double().abs(), 0.0)
    b = b + bounds.gamma(max(groups - 1, 0), U32) * p_abs.sum(0)
    for g in range(groups):
        chain = g_k * (aw * terms[g].double().abs()).sum(1) + k * ETA32 * (1 + g_k)
        b = b + torch.where(pres[g], observed_rounding(partials[g]) + chain, 0.0)
    if row_gap is not None:
        b = b + (aw * row_gap).sum(1)
    return _f64_upper(b, 4 * k + 2 * groups + 8)


# ------------------------------------------------------------------ the contract


def stock_per_rank(xs, weights, config=CONFIG) -> list[StockTrace]:
    """S0 of each rank's tokens, from ONE S0 run over all ranks' tokens concatenated (S0
    is batch invariant: every row of every stage depends on its own token only — see
    ``reference.layer``), sliced back per rank."""
    t, k = xs[0].shape[0], config.top_k
    whole = stock_order_trace(torch.cat(xs), weights, config)
    out = []
    for r in range(len(xs)):
        rows = slice(r * t, (r + 1) * t)
        fields = {f.name: getattr(whole, f.name)[rows] for f in dataclasses.fields(whole)}
        fields["rows"] = whole.rows[r * t * k : (r + 1) * t * k]
        out.append(StockTrace(**fields))
    return out


def check_dep_against_s0(traces, xs, weights, *, splits_one: bool) -> dict:
    """Every S1 stage against S0 of each rank's tokens (raises ContractError).

    ``splits_one``: the run used front/router splits 1, so the router is S0's bit for bit.
    Returns figures: routing flips and the worst bound ratio of the combine."""
    c, n = CONFIG, len(traces)
    s0 = stock_per_rank(xs, weights)
    figures = {"flips": 0, "combine_worst_ratio": 0.0, "combine_differs": 0}
    for r, (tr, ref) in enumerate(zip(traces, s0)):
        where = f"rank {r}/{n}"
        for name in ("front", "shared", "latent"):
            assert_bitwise_equal(getattr(tr, name), getattr(ref, name), what=f"{where} {name}")
        if splits_one:
            for name in ("logits", "ids", "weights"):
                assert_bitwise_equal(getattr(tr, name), getattr(ref, name), what=f"{where} {name}")
        codes, scales = quantize_mxfp8(tr.latent)
        assert_bitwise_equal(tr.codes, codes, what=f"{where} MXFP8 codes")
        assert_bitwise_equal(tr.scales, scales, what=f"{where} MXFP8 scales")

    per = c.experts // n
    k, t = c.top_k, TOKENS
    # dispatch: each owner's receive buffer holds exactly what the homes sent, the rest
    # is poison (ids -1, E4M3 NaN codes, E8M0 NaN scales, NaN weights)
    for o, owner in enumerate(traces):
        valid = torch.zeros(n * t, dtype=torch.bool)
        for home in range(n):
            valid[home * t + traces[home].sent[o]] = True
        assert_bitwise_equal(owner.recv_valid, valid, what=f"owner {o} received rows")
        for field in ("ids", "weights", "codes", "scales"):
            got = getattr(owner, f"recv_{field}")
            expect = torch.cat([getattr(traces[h], field) for h in range(n)])
            assert_bitwise_equal(got[valid], expect[valid], what=f"owner {o} received {field}")
        assert bool((owner.recv_ids[~valid] == -1).all()), f"owner {o}: empty rows not poisoned"
        assert bool((owner.recv_codes[~valid].view(torch.uint8) == dep.POISON_CODE).all())
        assert bool((owner.recv_scales[~valid] == dep.POISON_SCALE).all())
        # owner experts: every local pair's row is S0's row of that pair
        local = valid[:, None] & (owner.recv_ids // per == o)
        if splits_one:
            rows0 = torch.cat([ref.rows.view(t, k, c.latent) for ref in s0])
            assert_bitwise_equal(owner.rows[local], rows0[local], what=f"owner {o} expert rows",
                                 index_names=("pair", "column"))
        assert bool(owner.rows[~local].isnan().all()), f"owner {o}: non-local rows not poisoned"
        # each owner's partial is the local FMA chain of its slots (recomputed here)
        expect = local_finalize(owner.rows[valid], owner.recv_weights[valid], local[valid])
        assert_bitwise_equal(owner.partials[valid], expect, what=f"owner {o} partial finalize")

    for home in range(n):
        tr, ref = traces[home], s0[home]
        rows0 = ref.rows.view(t, k, c.latent) if splits_one else None
        terms = torch.zeros(n, t, k, c.latent, dtype=torch.bfloat16)
        partials = torch.zeros(n, t, c.latent, dtype=torch.bfloat16)
        present = torch.zeros(n, t, dtype=torch.bool)
        for o in range(n):
            sent = tr.sent[o]
            at = home * t + sent
            mine = (tr.ids[sent] // per == o)[:, :, None]
            terms[o, sent] = torch.where(mine, traces[o].rows[at], torch.zeros((), dtype=torch.bfloat16))
            partials[o, sent] = traces[o].partials[at]
            present[o, sent] = True
        # every slot of every token was computed by exactly one owner
        assert present.any(0).all(), f"home {home}: a token reached no owner"
        # the combine is the rank-ordered sum of the owners' partials (recomputed here)
        combined = ordered_combine(list(partials), list(present))
        assert_bitwise_equal(tr.combined, combined, what=f"home {home} combine (rank order)")
        if rows0 is not None:
            if n == 1:
                assert_bitwise_equal(tr.combined, ref.routed, what=f"{home} routed at N=1")
            bound = grouped_finalize_bound(
                tr.weights, rows0, ref.routed, terms, partials, present, tr.combined
            )
            res = assert_within_bound(
                tr.combined, ref.routed.double(), bound, what=f"home {home} routed vs S0",
                index_names=("token", "column"),
            )
            figures["combine_worst_ratio"] = max(figures["combine_worst_ratio"], res.worst_ratio or 0.0)
            figures["combine_differs"] += int((tr.combined != ref.routed).sum())
        # downstream on S1's own routed latent: bitwise
        normed = rms_norm(tr.combined, weights.latent_norm, c.rms_eps)
        assert_bitwise_equal(tr.normed, normed, what=f"home {home} RMSNorm")
        assert_bitwise_equal(tr.out, addmm(tr.shared, normed, weights.up), what=f"home {home} out")
        if n == 1 and splits_one:
            assert_bitwise_equal(tr.out, ref.out, what="out at N=1")
    return figures


@pytest.mark.parametrize("ranks", RANKS)
def test_dep_splits_one_against_s0(ranks, weights):
    xs = make_inputs(CONFIG.hidden, "dep", ranks, TOKENS, seed=ranks)
    traces = dep_layer_virtual(xs, weights, front_splits=1, router_splits=1)
    figures = check_dep_against_s0(traces, xs, weights, splits_one=True)
    if ranks == 1:
        assert figures["combine_differs"] == 0
    print(f"DEP N={ranks}: routed elements differing from S0: {figures['combine_differs']}, "
          f"worst ratio to the bound {figures['combine_worst_ratio']:.3g}")


@pytest.mark.parametrize("ranks", [1, 4])
def test_dep_default_tactics_router_bounded_and_downstream_on_own_routing(ranks, weights):
    xs = make_inputs(CONFIG.hidden, "dep", ranks, TOKENS, seed=100 + ranks)
    traces = dep_layer_virtual(xs, weights)  # the seed's tactics: router split 4 at T <= 32
    assert all(tr.router_splits == 4 and tr.front_splits == 1 for tr in traces)
    flips = 0
    s0 = stock_per_rank(xs, weights)
    for r, (tr, x) in enumerate(zip(traces, xs)):
        exact = bounds.reference_matmul(x, weights.gate)
        lb = bounds.matmul_fp32_out_bound(x, weights.gate, splits=4)
        assert_within_bound(tr.logits, exact, lb, what=f"rank {r} split-K logits",
                            index_names=("token", "expert"))
        ref = s0[r]
        scores = torch.sigmoid(exact) + weights.bias.double()
        sb = biased_score_bound(lb, weights.bias, sigmoid_abs_error=tolerances.SIGMOID_ABS_ERROR)
        cmp = compare_routing(tr.ids, ref.ids, scores, sb, what=f"rank {r} routing")
        cmp.check()
        flips += cmp.flips
    # every stage after the router, on S1's own routing (stage-by-stage bitwise)
    check_dep_against_s0(traces, xs, weights, splits_one=False)
    print(f"DEP N={ranks} default tactics: {flips} routing flips (all inside the bound)")


def test_dep_stock_path_above_front_max_is_s0_at_one_rank(weights):
    cfg = dataclasses.replace(CONFIG, front_max=4)
    w = dataclasses.replace(weights, config=cfg)
    xs = make_inputs(cfg.hidden, "dep", 1, TOKENS, seed=7)
    (tr,) = dep_layer_virtual(xs, w, cfg, router_splits=4)  # ignored above front_max
    assert tr.path == "stock" and tr.router_splits == 1 and tr.front_splits == 1
    ref = stock_order_trace(xs[0], w, cfg)
    for name, mine in (("logits", tr.logits), ("ids", tr.ids), ("routed", tr.combined), ("out", tr.out)):
        assert_bitwise_equal(mine, getattr(ref, name), what=f"stock path {name}")


def test_dep_batch_invariance_across_batch_mates_and_ranks(weights):
    ranks = 4
    xs = make_inputs(CONFIG.hidden, "dep", ranks, TOKENS, seed=1)
    ys = make_inputs(CONFIG.hidden, "dep", ranks, TOKENS, seed=2)
    # keep rank 0's token 2 and rank 3's token 0; everything else is new
    ys[0][2] = xs[0][2]
    ys[3][0] = xs[3][0]
    a = dep_layer_virtual(xs, weights)
    b = dep_layer_virtual(ys, weights)
    assert_bitwise_equal(b[0].out[2], a[0].out[2], what="rank 0 token 2 with new batch-mates")
    assert_bitwise_equal(b[3].out[0], a[3].out[0], what="rank 3 token 0 with new batch-mates")


def test_dep_rejects_bad_groups(weights):
    with pytest.raises(ValueError, match="do not divide over 3 ranks"):
        dep_layer_virtual(make_inputs(CONFIG.hidden, "dep", 3, 2, 0), weights)
    xs = make_inputs(CONFIG.hidden, "dep", 2, 2, 0)
    xs[1] = xs[1][:1]
    with pytest.raises(ValueError, match="one padded T"):
        dep_layer_virtual(xs, weights)


# ------------------------------------------------------------------ planted bugs
#
# With trained-like data an FP32 reordering moves a result by about one FP32 ULP, which a
# BF16 output hides unless it sits on a rounding boundary: a k-swap or a reversed combine
# would slip through random inputs. The harness below replaces the routing and the experts
# (module attributes the schedule calls) by constructed values on which every such
# reordering changes the BF16 result, and runs the real dispatch, owner Finalize and
# combine of the schedule over them.

BIG, SMALL = 2.0**30, 1.0 + 2.0**-7  # FP32 ULP at 2^30 is 2^7: SMALL is absorbed by BIG
PER_OWNER = 4  # at 4 ranks: 4 of each owner's 8 experts, owner by owner in slot order
DESIGN_IDS = [o * (CONFIG.experts // 4) + i for o in range(4) for i in range(PER_OWNER)]


def _designed_rows() -> torch.Tensor:
    """BF16 [E, L] rows of the constructed experts (routing weights all 1.0, ids
    ``DESIGN_IDS`` on every token, so slot j adds ``V[DESIGN_IDS[j]]`` exactly).

    * column 0: slot 0 BIG, slot 4 -BIG, slot 8 SMALL: the k chain gives SMALL; at 4 ranks
      the owners' partials are (BIG, -BIG, SMALL, 0), whose rank-order sum is SMALL and
      whose reversed sum is 0;
    * column 1 + a (a = 1..14): slot 0 BIG, slot a -BIG, slot a+1 SMALL: the k chain gives
      SMALL, the chain with slots a and a+1 swapped gives 0."""
    v = torch.zeros(CONFIG.experts, CONFIG.latent, dtype=torch.float32)
    ids = DESIGN_IDS
    v[ids[0], 0], v[ids[4], 0], v[ids[8], 0] = BIG, -BIG, SMALL
    for a in range(1, CONFIG.top_k - 1):
        v[ids[0], 1 + a], v[ids[a], 1 + a], v[ids[a + 1], 1 + a] = BIG, -BIG, SMALL
    return v.bfloat16()


def _designed_run(monkeypatch, weights, ranks):
    """S1 over the constructed experts; returns (traces, the S0 Finalize of the same rows)."""
    v = _designed_rows()
    k = CONFIG.top_k

    def routing(logits, bias, **kw):
        t = logits.shape[0]
        ids = torch.tensor(DESIGN_IDS, dtype=torch.int32).expand(t, k).contiguous()
        return torch.ones(t, k, dtype=torch.float32), ids

    def experts(x, expert_ids, w, config, *, shard=None):  # pair row = V[its expert]
        return v[expert_ids.long()]

    monkeypatch.setattr(dep, "route", routing)
    monkeypatch.setattr(dep, "pair_rows_fp32", experts)
    xs = make_inputs(CONFIG.hidden, "dep", ranks, 2, seed=9)
    traces = dep_layer_virtual(xs, weights)
    rows = v[torch.tensor(DESIGN_IDS)].repeat(2, 1)  # [T*k, L], pair order t*k + j
    return traces, finalize(rows, torch.ones(2, k))


def test_designed_experts_make_every_k_order_visible(monkeypatch, weights):
    (tr,), expect = _designed_run(monkeypatch, weights, 1)
    assert_bitwise_equal(tr.combined, expect, what="routed at N=1 (designed experts)")
    designed = [0] + list(range(2, CONFIG.top_k))
    assert bool((expect[:, designed].float() == SMALL).all())
    traces, expect = _designed_run(monkeypatch, weights, 4)
    for r, tr in enumerate(traces):  # the owner split keeps column 0 (see _designed_rows)
        assert_bitwise_equal(tr.combined[:, 0], expect[:, 0], what=f"rank {r} column 0 at N=4")


def test_planted_swapped_k_in_the_owner_finalize_is_caught(monkeypatch, weights):
    real = dep.local_finalize

    def swapped(rows, w, local):  # slots 5 and 6 accumulated in the wrong order
        perm = list(range(rows.shape[1]))
        perm[5], perm[6] = 6, 5
        return real(rows[:, perm], w[:, perm], local[:, perm])

    monkeypatch.setattr(dep, "local_finalize", swapped)
    (tr,), expect = _designed_run(monkeypatch, weights, 1)
    with pytest.raises(ContractError, match=r"column=6\b"):
        assert_bitwise_equal(tr.combined, expect, what="routed at N=1 (designed experts)",
                             index_names=("token", "column"))


def test_planted_reversed_combine_order_is_caught(monkeypatch, weights):
    real = dep.ordered_combine
    monkeypatch.setattr(dep, "ordered_combine", lambda parts, present: real(parts[::-1], present[::-1]))
    traces, expect = _designed_run(monkeypatch, weights, 4)
    with pytest.raises(ContractError, match="column 0 at N=4"):
        assert_bitwise_equal(traces[0].combined[:, 0], expect[:, 0], what="rank 0 column 0 at N=4")


def test_planted_biased_routing_weights_are_caught(weights, monkeypatch):
    real = dep.route

    def biased(logits, bias, **kw):  # weights taken from the biased selection scores
        w, ids = real(logits, bias, **kw)
        s = (torch.sigmoid(logits) + bias).gather(1, ids.long())
        return s / s.sum(1, keepdim=True), ids

    monkeypatch.setattr(dep, "route", biased)
    xs = make_inputs(CONFIG.hidden, "dep", 2, TOKENS, seed=5)
    traces = dep_layer_virtual(xs, weights, front_splits=1, router_splits=1)
    with pytest.raises(ContractError, match="rank 0/2 weights"):
        check_dep_against_s0(traces, xs, weights, splits_one=True)
