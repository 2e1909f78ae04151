"""Contracts of S1, the DEP layer (seed 000), at every rank count, against S0.

Each stage of every rank is compared with the reference stage applied to *that rank's own
inputs of the stage* (so a difference upstream never hides or excuses one downstream):

| stage | contract |
|---|---|
| front / shared | bitwise with split 1; split-K: within ``matmul_bf16_out_bound(splits)`` |
| router logits | bitwise with split 1; split-K: within ``matmul_fp32_out_bound(splits)`` |
| ids, weights | bitwise = ``route(own logits)``; vs S0's ids: flips only within the score bound |
| MXFP8 latent | bitwise = ``quantize_mxfp8(own latent)`` |
| dispatch | the owners' receive rows are the sources' codes/scales/ids/weights, bit for bit; empty rows poisoned |
| expert rows | bitwise = ``expert_rows(own latent, own ids)`` at the owner |
| combine | N = 1: bitwise = ``finalize``; N > 1: within the bound of owner partials summed in FP32 |
| normed, out | bitwise = ``rms_norm(own routed)``, ``addmm(own shared, own normed, up)`` |
| end to end | N = 1 with split 1: bitwise equal to S0 |
"""

from __future__ import annotations

import pytest
import torch

from reference import layer
from reference.activation import situ_and_mul
from reference.experts import expert_rows
from reference.finalize import finalize
from reference.fp import fma_f32
from reference.gemm import addmm, matmul
from reference.mx import quantize_mxfp8
from reference.norm import rms_norm
from reference.router import route
from reference.schedules.dep import POISON_CODE, POISON_SCALE, dep_layer_virtual
from verify import bounds, cases, schedule_bounds, tolerances
from verify.routing import biased_score_bound, compare_routing

#: (ranks, tokens per rank): every rank count with every DEP batch, up to 256 tokens in all
#: (the emulation runs all ranks on this machine), and the stock path (T > front_max).
GRID = [(n, t) for n in cases.RANKS for t in cases.DEP_BATCHES if n * t <= 256]
GRID += [(1, 65), (2, 65)]
TACTICS = {"seed": {}, "split1": {"front_splits": 1, "router_splits": 1}}
ROWS = ("token", "column")


def _run(ranks, tokens, tactic, seed):
    cfg = cases.config("small")
    w = cases.weights("small")
    xs = [cases.hidden_rows(cfg, tokens, seed + r) for r in range(ranks)]
    return cfg, w, xs, dep_layer_virtual(xs, w, cfg, **TACTICS[tactic])


def _check_projection(contract, got, x, weight, splits, out_dtype, what):
    if splits == 1:
        contract.bitwise(got, matmul(x, weight, out_dtype=out_dtype), what=what,
                         index_names=ROWS)
        return
    make = bounds.matmul_fp32_out_bound if out_dtype == torch.float32 else \
        bounds.matmul_bf16_out_bound
    contract.bounded(got, bounds.reference_matmul(x, weight),
                     make(x, weight, splits=splits), what=f"{what} (split-K {splits})",
                     bound_name="gamma_{K/s+s-1}(2^-24)|A||B| + final half-ULP",
                     index_names=ROWS)


@pytest.mark.parametrize("tactic", list(TACTICS))
@pytest.mark.parametrize("ranks,tokens", GRID)
def test_dep_stages(ranks, tokens, tactic, seed, contract):
    cfg, w, xs, traces = _run(ranks, tokens, tactic, seed)
    s2 = 2 * cfg.shared_intermediate
    per = cfg.experts // ranks
    for tr, x in zip(traces, xs):
        r = tr.rank
        _check_projection(contract, tr.front, x, w.front, tr.front_splits, torch.bfloat16,
                          f"rank {r} front")
        _check_projection(contract, tr.logits, x, w.gate, tr.router_splits, torch.float32,
                          f"rank {r} router logits")
        own_w, own_ids = route(tr.logits, w.bias, top_k=cfg.top_k,
                               renormalize=cfg.renormalize, scale=cfg.routed_scaling_factor)
        contract.bitwise(tr.ids, own_ids, what=f"rank {r} ids = route(own logits)")
        contract.bitwise(tr.weights, own_w, what=f"rank {r} weights = route(own logits)")
        # Routing against S0's: flips only inside the logits' split-K error bound.
        logits_bound = bounds.matmul_fp32_out_bound(x, w.gate, splits=tr.router_splits)
        exact_logits = bounds.reference_matmul(x, w.gate)
        s0_w, s0_ids = route(matmul(x, w.gate, out_dtype=torch.float32), w.bias,
                             top_k=cfg.top_k, renormalize=cfg.renormalize,
                             scale=cfg.routed_scaling_factor)
        contract.routing(compare_routing(
            tr.ids, s0_ids, torch.sigmoid(exact_logits) + w.bias.double(),
            biased_score_bound(logits_bound, w.bias,
                               sigmoid_abs_error=tolerances.SIGMOID_ABS_ERROR),
            what=f"rank {r} ids vs S0"))
        act = situ_and_mul(tr.front[:, :s2], beta=cfg.situ_beta,
                           linear_beta=cfg.situ_linear_beta)
        _check_projection(contract, tr.shared, act, w.shared_down, tr.front_splits,
                          torch.bfloat16, f"rank {r} shared")
        contract.bitwise(tr.latent, tr.front[:, s2:], what=f"rank {r} latent = front cols")
        codes, scales = quantize_mxfp8(tr.latent)
        contract.bitwise(tr.codes, codes, what=f"rank {r} MXFP8 codes", index_names=ROWS)
        contract.bitwise(tr.scales, scales, what=f"rank {r} MXFP8 scales", index_names=ROWS)

    # dispatch: data movement is bitwise, empty receive rows stay poisoned
    for owner in traces:
        o = owner.rank
        expected_valid = torch.zeros(ranks * tokens, dtype=torch.bool)
        for src in traces:
            sent = src.sent[o]
            at = src.rank * tokens + sent
            expected_valid[at] = True
            contract.bitwise(owner.recv_codes[at], src.codes[sent],
                             what=f"dispatch codes {src.rank}->{o}", index_names=ROWS)
            contract.bitwise(owner.recv_scales[at], src.scales[sent],
                             what=f"dispatch scales {src.rank}->{o}", index_names=ROWS)
            contract.bitwise(owner.recv_ids[at], src.ids[sent],
                             what=f"dispatch ids {src.rank}->{o}")
            contract.bitwise(owner.recv_weights[at], src.weights[sent],
                             what=f"dispatch weights {src.rank}->{o}")
            # every token whose top-k names one of o's experts was sent to o, and only those
            needs = ((src.ids.long() // per) == o).any(1).nonzero().flatten()
            contract.bitwise(sent.sort().values, needs, what=f"tokens {src.rank}->{o}")
        contract.bitwise(owner.recv_valid, expected_valid, what=f"rank {o} receive rows")
        empty = ~expected_valid
        contract.bitwise(owner.recv_codes[empty].view(torch.uint8),
                         torch.full_like(owner.recv_codes[empty].view(torch.uint8), POISON_CODE),
                         what=f"rank {o} empty receive codes poisoned")
        contract.bitwise(owner.recv_scales[empty],
                         torch.full_like(owner.recv_scales[empty], POISON_SCALE),
                         what=f"rank {o} empty receive scales poisoned")

    # experts at the owners, combine, norm, out: on each home rank's own routing
    for home in traces:
        h = home.rank
        own_rows = expert_rows(home.latent, home.ids, w, cfg).view(tokens, cfg.top_k, -1)
        owner_of = home.ids.long() // per
        parts, errors, presence = [], [], []
        for o, owner in enumerate(traces):
            at = h * tokens + torch.arange(tokens)
            local = owner_of == o
            got = owner.rows[at]
            contract.bitwise(got[local], own_rows[local],
                             what=f"expert rows of home {h} at owner {o}")
            present = local.any(1)
            # the owner's partial: an FMA chain over its local slots in k order (written
            # here independently of the schedule's code), one BF16 rounding
            acc = torch.zeros(tokens, cfg.latent)
            for j in range(cfg.top_k):
                step = fma_f32(home.weights[:, j:j + 1].expand(tokens, cfg.latent),
                               own_rows[:, j].float(), acc)
                acc = torch.where(local[:, j:j + 1], step, acc)
            contract.bitwise(owner.partials[at][present], acc.bfloat16()[present],
                             what=f"partial finalize of home {h} at owner {o}")
            part = torch.where(present[:, None], owner.partials[at],
                               torch.zeros_like(owner.partials[at]))
            presence.append(present)
            inner = schedule_bounds.fma_chain_error(home.weights * local, own_rows)
            parts.append(part)
            errors.append(schedule_bounds.bf16_part_error(part, inner))
        # the combine: FP32 sum of the present partials in owner order, one BF16 rounding
        acc = torch.zeros(tokens, cfg.latent)
        started = torch.zeros(tokens, 1, dtype=torch.bool)
        for part, present in zip(parts, presence):
            acc = torch.where(present[:, None], torch.where(started, acc + part.float(),
                                                            part.float()), acc)
            started = started | present[:, None]
        contract.bitwise(home.combined, acc.bfloat16(), what=f"rank {h} combine order",
                         index_names=ROWS)
        if ranks == 1:
            contract.bitwise(home.combined, finalize(own_rows.flatten(0, 1), home.weights),
                             what=f"rank {h} combine = finalize", index_names=ROWS)
        else:
            exact = (home.weights.double().unsqueeze(-1) * own_rows.double()).sum(1)
            contract.bounded(home.combined, exact,
                             schedule_bounds.ordered_sum_error(parts, errors, exact),
                             what=f"rank {h} combine of {ranks} owner partials",
                             bound_name="per-owner FMA chains + BF16 partials + FP32 sum",
                             index_names=ROWS)
        contract.bitwise(home.normed, rms_norm(home.combined, w.latent_norm, cfg.rms_eps),
                         what=f"rank {h} normed", index_names=ROWS)
        contract.bitwise(home.out, addmm(home.shared, home.normed, w.up),
                         what=f"rank {h} out", index_names=ROWS)


@pytest.mark.parametrize("tokens", cases.DEP_BATCHES + (65,))
def test_dep_single_rank_is_stock(tokens, seed, contract):
    """S1 on one rank with unsplit GEMMs is S0, bit for bit, end to end."""
    cfg, w, xs, traces = _run(1, tokens, "split1", seed)
    s0 = layer.stock_order_trace(xs[0], w, cfg)
    contract.bitwise(traces[0].ids, s0.ids, what="ids")
    contract.bitwise(traces[0].combined, s0.routed, what="routed latent", index_names=ROWS)
    contract.bitwise(traces[0].out, s0.out, what="layer output", index_names=ROWS)


@pytest.mark.parametrize("ranks", (2, 3, 4))
def test_combine_order_designed(ranks, contract):
    """The combine adds the owners' partials in owner order. On random rows the FP32 sum
    of a few BF16 partials is usually exact, so the order is invisible; here the partials
    are designed (1 + 2^-7, then 2^30, -2^30, ...) so that any other order changes the
    result: in order, 1 + 2^-7 is absorbed by 2^30 and the sum is 0."""
    from reference.schedules.dep import ordered_combine

    values = [1 + 2**-7, 2.0**30, -(2.0**30)] + [0.0] * (ranks - 3)
    parts = [torch.full((2, 64), v).to(torch.bfloat16) for v in values[:ranks]]
    present = [torch.ones(2, dtype=torch.bool) for _ in range(ranks)]
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    contract.bitwise(ordered_combine(parts, present), acc.bfloat16(),
                     what="combine of designed partials in owner order")
