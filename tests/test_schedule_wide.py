"""S2, the wide layer, against S0 (the stock order) at 1, 2, 4, 8 and 16 virtual TP ranks.

What must hold (see ``reference.schedules.wide``'s table):

* logits, ids and weights are S0's bit for bit at every N (each logit is its own dot
  product, rounded once to FP32 in both);
* the latent is the FP32-out GEMM rounded to BF16 (bitwise against that model, within
  the derived bound of S0's), -0 published as +0; the plan rows are its MXFP8;
* every rank's rows are the stage's TP-sliced rows, its Finalize is the stage's, the
  all-reduces are the rank-order sums; at N = 1 the routed latent and the output are S0's
  given the same latent; at N > 1 they are within the derived bounds;
* the routing lists hold each expert's pairs with a -1 tail; the output does not depend
  on the claim order; the mailbox rotates and is re-armed;
* planted bugs (no -0 sanitize, biased weights, a list off by one) are caught.
"""

from __future__ import annotations

import pytest
import torch

from reference.activation import situ_and_mul_fp32
from reference.experts import expert_rows_mxfp8
from reference.finalize import finalize
from reference.fp import round_to_bfloat16
from reference.gemm import addmm, matmul
from reference.mx import dequantize_mxfp4, dequantize_mxfp8, quantize_mxfp8
from reference.norm import rms_norm
from reference.schedules import comm, wide
from reference.schedules.comm import MailboxTimeout, ordered_sum_bf16, run_virtual
from reference.schedules.launch import make_inputs
from reference.schedules.wide import WideScratch, wide_layer_virtual, wide_rank
from reference.weights import LatentMoEWeights
from test_schedule_dep import (  # the one definition of the grouped-Finalize bound
    CONFIG,
    U32,
    _f64_upper,
    grouped_finalize_bound,
    observed_rounding,
    stock_per_rank,
)
from verify import bounds
from verify.compare import ContractError, assert_bitwise_equal, assert_within_bound

TOKENS = 6
RANKS = [1, 2, 4, 8, 16]


@pytest.fixture(scope="module")
def weights():
    return LatentMoEWeights.random(CONFIG, seed=2027)


def _x(tokens=TOKENS, seed=0):
    return make_inputs(CONFIG.hidden, "wide", 1, tokens, seed)[0]


def _no_negative_zero(v: torch.Tensor) -> torch.Tensor:
    """BF16 ``v`` with -0 replaced by +0 (what a mailbox writer stores)."""
    return comm.sanitize_negative_zero(v.view(torch.int16)).view(torch.bfloat16)


def fc2_row_bounds(codes, scales, ids, rows0, weights, ranks):
    """Derived bounds on the distance of each expert row (full, and each rank's TP
    partial) to its exact FC2 sum, from the FC2 operands.

    The operands are rebuilt from the public stages in the experts' order (MXFP8 latent,
    FC1 = ``matmul`` to FP32, ``situ_and_mul_fp32``, MXFP8 of the activation, MXFP4 w2);
    the check ``matmul(a, w2) -> BF16 == expert_rows_mxfp8`` (bitwise) proves they are the
    stage's. Each row is an FP32-accumulated sum rounded to FP32 then BF16:
    ``final_rounding_bound(ref, matmul_fp32_out_bound(a, w2), bf16)``.

    ``rows0``: BF16 [T*k, L], the stage's unsharded rows of these pairs.
    Returns ``(full [T*k, L], per_rank [N, T*k, L])`` float64."""
    c, k = CONFIG, CONFIG.top_k
    flat = ids.reshape(-1).long()
    full = torch.zeros(flat.numel(), c.latent, dtype=torch.float64)
    per_rank = torch.zeros(ranks, flat.numel(), c.latent, dtype=torch.float64)
    x = dequantize_mxfp8(codes, scales)
    for e in torch.unique(flat).tolist():
        pairs = (flat == e).nonzero().flatten()
        w13 = dequantize_mxfp4(weights.w13[e], weights.w13_scales[e])
        h = matmul(x[pairs // k], w13, out_dtype=torch.float32)
        a = situ_and_mul_fp32(h, beta=c.situ_beta, linear_beta=c.situ_linear_beta)
        a = dequantize_mxfp8(*quantize_mxfp8(a))
        w2 = dequantize_mxfp4(weights.w2[e], weights.w2_scales[e])
        assert_bitwise_equal(matmul(a, w2, out_dtype=torch.float32).to(torch.bfloat16),
                             rows0[pairs], what=f"FC2 operands of expert {e}")

        def bound(a_, w_):
            beta = bounds.matmul_fp32_out_bound(a_, w_)
            return bounds.final_rounding_bound(bounds.reference_matmul(a_, w_), beta, torch.bfloat16)

        full[pairs] = bound(a, w2)
        width = c.intermediate // ranks
        for r in range(ranks):
            sl = slice(r * width, (r + 1) * width)
            per_rank[r, pairs] = bound(a[:, sl].contiguous(), w2[:, sl].contiguous())
    return full, per_rank


def check_wide_against_s0(traces, x, weights) -> dict:
    """Every S2 stage (raises ContractError); returns figures (elements differing from
    S0, worst bound ratios)."""
    c, n, t, k = CONFIG, len(traces), x.shape[0], CONFIG.top_k
    (ref,) = stock_per_rank([x], weights)
    first = traces[0]
    figures = {}
    for tr in traces:  # every rank holds the same routing, latent and output
        for name in ("logits", "ids", "weights", "latent", "codes", "scales", "routed", "normed", "out"):
            assert_bitwise_equal(getattr(tr, name), getattr(first, name), what=f"rank {tr.rank} {name}")
    for name in ("logits", "ids", "weights"):
        assert_bitwise_equal(first.logits if name == "logits" else getattr(first, name),
                             getattr(ref, name), what=f"{name} vs S0")
    # the latent: the FP32-out GEMM rounded once to BF16, -0 published as +0
    f32 = matmul(x, weights.latent_down, out_dtype=torch.float32)
    assert_bitwise_equal(first.latent, _no_negative_zero(round_to_bfloat16(f32)), what="latent model")
    lref = bounds.reference_matmul(x, weights.latent_down)
    lbound = bounds.final_rounding_bound(lref, bounds.matmul_fp32_out_bound(x, weights.latent_down), torch.bfloat16)
    assert_within_bound(first.latent, lref, lbound, what="latent vs exact", index_names=("token", "column"))
    figures["latent_differs"] = int((first.latent != ref.latent).sum())
    codes, scales = quantize_mxfp8(first.latent)
    assert_bitwise_equal(first.codes, codes, what="plan codes")
    assert_bitwise_equal(first.scales, scales, what="plan scales")

    # routing lists: each expert's pairs (token order), -1 tail, counts
    flat = first.ids.reshape(-1).long()
    for tr in traces:
        assert_bitwise_equal(tr.counts, torch.bincount(flat, minlength=c.experts).int(), what="list counts")
        for e in range(c.experts):
            cnt = int(tr.counts[e])
            listed = tr.lists[e, :cnt].long()
            assert sorted(listed.tolist()) == (flat == e).nonzero().flatten().tolist(), f"expert {e} list"
            assert bool((tr.lists[e, cnt:] == -1).all()), f"expert {e}: list tail not poisoned"
        starts = [e for e, _ in tr.windows]
        assert starts == sorted(starts) and all(0 < w.numel() <= wide.WIDE_WINDOW for _, w in tr.windows)

    # per rank: TP-sliced rows (one batched stage call), its Finalize, the rank-order sums
    for tr in traces:
        rows = expert_rows_mxfp8(codes, scales, first.ids, weights, c, shard=(tr.rank, n))
        assert_bitwise_equal(tr.rows, rows, what=f"rank {tr.rank} TP rows", index_names=("pair", "column"))
        assert_bitwise_equal(tr.routed_partial, finalize(rows, first.weights), what=f"rank {tr.rank} Finalize")
    assert_bitwise_equal(first.routed, ordered_sum_bf16([tr.routed_partial for tr in traces]), what="latent all-reduce")
    assert_bitwise_equal(first.normed, rms_norm(first.routed, weights.latent_norm, c.rms_eps), what="RMSNorm")

    # routed latent vs S0 on the same latent
    if figures["latent_differs"] == 0:  # S0's rows are the rows of this latent
        rows0 = ref.rows
    else:
        rows0 = expert_rows_mxfp8(codes, scales, first.ids, weights, c)
    routed0 = finalize(rows0, first.weights)
    if n == 1:
        assert_bitwise_equal(first.routed, routed0, what="routed at N=1")
    else:
        full, per_rank = fc2_row_bounds(codes, scales, first.ids, rows0, weights, n)
        terms = torch.stack([tr.rows.view(t, k, c.latent) for tr in traces])
        partials = torch.stack([tr.routed_partial for tr in traces])
        gap = (full + per_rank.sum(0)).view(t, k, c.latent)
        bound = grouped_finalize_bound(first.weights, rows0.view(t, k, c.latent), routed0, terms,
                                       partials, torch.ones(n, t, dtype=torch.bool), first.routed, gap)
        res = assert_within_bound(first.routed, routed0.double(), bound, what="routed vs S0 (same latent)",
                                  index_names=("token", "column"))
        figures["routed_ratio"] = res.worst_ratio
    figures["routed_differs"] = int((first.routed != routed0).sum())

    # shared partials, up columns, hidden all-reduce
    s_n, h_n, s = c.shared_intermediate // n, c.hidden // n, c.shared_intermediate
    for tr in traces:
        r, sl = tr.rank, slice(tr.rank * s_n, (tr.rank + 1) * s_n)
        act = ref.shared_act[:, sl]
        down = weights.shared_down[:, sl].contiguous()
        assert_bitwise_equal(tr.shared, matmul(act, down, out_dtype=torch.bfloat16), what=f"rank {r} shared")
        cols = slice(r * h_n, (r + 1) * h_n)
        expect = tr.shared.clone()
        expect[:, cols] = addmm(tr.shared[:, cols].contiguous(), first.normed, weights.up[cols])
        assert_bitwise_equal(tr.hidden_partial, expect, what=f"rank {r} hidden partial")
    assert_bitwise_equal(first.out, ordered_sum_bf16([tr.hidden_partial for tr in traces]), what="hidden all-reduce")
    out0 = addmm(ref.shared, first.normed, weights.up)  # S0's tail on S2's normed latent
    if n == 1:
        assert_bitwise_equal(first.shared, ref.shared, what="shared at N=1")
        assert_bitwise_equal(first.out, out0, what="out at N=1")
    else:
        b = observed_rounding(first.out)
        b = b + bounds.gamma(n - 1, U32) * torch.stack([tr.hidden_partial.double().abs() for tr in traces]).sum(0)
        b = b + bounds.matmul_bf16_out_bound(ref.shared_act, weights.shared_down)
        b = b + bounds.matmul_bf16_out_bound(first.normed, weights.up, addend=ref.shared)
        for tr in traces:
            r, sl = tr.rank, slice(tr.rank * s_n, (tr.rank + 1) * s_n)
            b = b + bounds.matmul_bf16_out_bound(ref.shared_act[:, sl], weights.shared_down[:, sl])
            cols = slice(r * h_n, (r + 1) * h_n)
            b[:, cols] += bounds.matmul_bf16_out_bound(first.normed, weights.up[cols], addend=tr.shared[:, cols])
        res = assert_within_bound(first.out, out0.double(), _f64_upper(b, 4 * n + 8),
                                  what="out vs S0 tail (same normed)", index_names=("token", "column"))
        figures["out_ratio"] = res.worst_ratio
    figures["out_differs"] = int((first.out != out0).sum())
    assert s == c.shared_intermediate
    return figures


@pytest.mark.parametrize("ranks", RANKS)
def test_wide_against_s0(ranks, weights):
    x = _x(seed=ranks)
    traces = wide_layer_virtual(x, weights, ranks)
    figures = check_wide_against_s0(traces, x, weights)
    print(f"wide N={ranks}: {figures}")


def test_wide_claim_order_does_not_change_a_bit(weights):
    x = _x(seed=3)
    a = wide_layer_virtual(x, weights, 2)
    perm = torch.randperm(TOKENS * CONFIG.top_k, generator=torch.Generator().manual_seed(1))
    b = wide_layer_virtual(x, weights, 2, claim_order=perm)
    assert not torch.equal(a[0].lists, b[0].lists)  # the lists really were claimed differently
    for name in ("rows", "routed", "out"):
        assert_bitwise_equal(getattr(b[1], name), getattr(a[1], name), what=f"{name} with shuffled claims")


def test_wide_mailbox_rotates_and_is_rearmed_between_calls(weights):
    x, y = _x(seed=4), _x(seed=5)

    def fn(g):
        scratch = WideScratch(g, CONFIG, rows=16)
        out = []
        for inp in (x, y, x):
            tr = wide_rank(g, inp, weights, scratch=scratch)
            out.append((tr.mailbox_index, tr.out, scratch.mailbox.buffers[tr.mailbox_index].clone()))
        return out

    for calls in run_virtual(2, fn):
        assert [c[0] for c in calls] == [0, 1, 0]
        for _, _, buf in calls:  # every word armed again: latent 0x8000, logits 0x80000000
            lat = buf[:, : CONFIG.latent]
            log = buf[:, CONFIG.latent :].contiguous().view(torch.int32)
            assert bool((lat == comm.SENTINEL_BF16).all()) and bool((log == comm.SENTINEL_F32).all())
        assert_bitwise_equal(calls[2][1], calls[0][1], what="same input, other buffer generation")


def test_wide_batch_invariance(weights):
    x, y = _x(seed=6), _x(seed=7)
    y[4] = x[1]
    a = wide_layer_virtual(x, weights, 4)
    b = wide_layer_virtual(y, weights, 4)
    assert_bitwise_equal(b[0].out[4], a[0].out[1], what="token with other batch-mates and row")


def test_wide_rejects_rank_counts_that_do_not_split(weights):
    with pytest.raises(ValueError, match="3 ranks do not split"):
        wide_layer_virtual(_x(), weights, 3)
    with pytest.raises(ValueError, match="intermediate 512 % \\(32 \\* 32\\)"):
        wide.check_wide_ranks(CONFIG, 32)


# ------------------------------------------------------------------ -0 and planted bugs


def _tiny_row_input():
    """x whose row 0 is +-2^-133 (the smallest BF16 subnormal): its latent sums are FP32
    subnormals that round to BF16 +-0, so the latent holds real negative zeros."""
    x = _x(seed=8)
    sign = torch.where(torch.arange(CONFIG.hidden) % 3 == 0, -1.0, 1.0)
    x[0] = (sign * 2.0**-133).bfloat16()
    return x


def test_wide_publishes_negative_zero_as_positive_zero(weights):
    x = _tiny_row_input()
    f32 = matmul(x, weights.latent_down, out_dtype=torch.float32)
    model = round_to_bfloat16(f32)
    assert bool((model.view(torch.int16) == comm.SENTINEL_BF16).any())  # real -0s exist
    (tr,) = wide_layer_virtual(x, weights, 1)
    assert_bitwise_equal(tr.latent, _no_negative_zero(model), what="latent with -0 sanitized")
    assert not bool((tr.latent.view(torch.int16) == comm.SENTINEL_BF16).any())


def test_planted_missing_sanitize_hangs_the_reader_and_is_caught(weights, monkeypatch):
    monkeypatch.setattr(comm, "sanitize_negative_zero", lambda words: words)
    x = _tiny_row_input()
    with pytest.raises(MailboxTimeout, match="token 0 column"):
        wide_layer_virtual(x, weights, 2, timeout=0.3)


def test_planted_biased_routing_weights_are_caught(weights, monkeypatch):
    real = wide.route

    def biased(logits, bias, **kw):
        w, ids = real(logits, bias, **kw)
        s = (torch.sigmoid(logits) + bias).gather(1, ids.long())
        return s / s.sum(1, keepdim=True), ids

    monkeypatch.setattr(wide, "route", biased)
    x = _x(seed=9)
    traces = wide_layer_virtual(x, weights, 2)
    with pytest.raises(ContractError, match="weights vs S0"):
        check_wide_against_s0(traces, x, weights)


def test_planted_routing_list_off_by_one_is_caught(weights, monkeypatch):
    real = wide.routing_lists

    def short(ids, experts, capacity, claim_order=None):  # each list loses its last pair
        lists, counts = real(ids, experts, capacity, claim_order)
        for e in counts.nonzero().flatten().tolist():
            counts[e] -= 1
            lists[e, counts[e]] = -1
        return lists, counts

    monkeypatch.setattr(wide, "routing_lists", short)
    x = _x(seed=10)
    traces = wide_layer_virtual(x, weights, 2)
    with pytest.raises(ContractError, match="list counts"):
        check_wide_against_s0(traces, x, weights)
    assert bool(traces[0].routed.isnan().any())  # the unwritten rows' NaN poison shows
