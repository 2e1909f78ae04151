"""Contracts of S2, the wide layer, at every rank count, against S0.

Per rank, each stage against the reference stage on that rank's own inputs:

| stage | contract |
|---|---|
| logits, ids, weights | bitwise = S0 (each logit is its own dot product, FP32 out) |
| latent (published) | bitwise = ``round_to_bfloat16(FP32 GEMM)``; within the BF16-out GEMM bound of exact |
| plan (MXFP8) | bitwise = ``quantize_mxfp8(own latent)`` |
| routing lists | every pair once, in its expert's list, counts = histogram, tails poisoned -1 |
| windows | <= 8 pairs of one expert each, ``ceil(count/8)`` per expert, all pairs once |
| expert rows | bitwise = ``expert_rows_mxfp8(..., shard=(r, N))`` |
| Finalize | bitwise = ``finalize(own rows)`` |
| latent all-reduce | bitwise = FP32 rank-order sum of the partials, one BF16 rounding; N > 1: within the derived bound of S0's routed latent |
| shared partial | within the BF16-out GEMM bound of ``act_r @ down_r^T`` (exact) |
| out | bitwise = FP32 rank-order sum of the hidden partials; within the derived bound of the exact layer tail |

Bucket edges: the production range starts at 65 tokens and ends at ``wide_rows`` (the
routing lists' capacity); at ``wide_rows`` with every token on one expert that expert's
list is exactly full, and one token more is refused with an error naming the limit. State
across calls: two consecutive layers (other inputs and weights) run through one rank's
persistent mailbox (:class:`~reference.schedules.wide.WideScratch`), the second checked
like the first, the rotating buffers alternating and re-armed.

A backend that runs the whole S2 layer (stage ``layer_wide``) is checked at its output and
routing per rank (``verify.layers``).
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from reference.activation import situ_and_mul
from reference.experts import expert_rows, expert_rows_mxfp8
from reference.finalize import finalize
from reference.fp import round_to_bfloat16
from reference.gemm import addmm, matmul
from reference.router import route, router_logits
from reference.mx import quantize_mxfp8
from reference.norm import rms_norm
from reference.schedules import mailbox
from reference.schedules.groups import run_virtual
from reference.schedules.wide import WideScratch, routing_lists, wide_layer_virtual, wide_rank
from verify import bounds, cases, schedule_bounds
from verify.layers import check_layer

ROWS = ("token", "column")
#: Pairs per unit window of the listed engine: each touched expert's weights stream once
#: per 8 of its tokens (``docs/design.md``; written here, not read from the schedule).
WINDOW = 8
GRID = [("small", n, t) for n in (1, 2, 4, 8) for t in cases.WIDE_BATCHES]
GRID += [("tp16", 16, t) for t in (1, 65, 100)]


def _ordered_sum(parts):
    """The stock one-shot all-reduce, written independently: FP32, rank order, one BF16
    rounding."""
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    return acc.to(torch.bfloat16)


def _stock_front(x, w, cfg):
    """S0's router and shared expert on ``x`` (``reference.layer.stock_order_trace``'s steps
    1-4, without its routed experts, which the check needs on S2's own latent instead)."""
    logits = router_logits(x, w.gate)
    weights, ids = route(logits, w.bias, top_k=cfg.top_k, renormalize=cfg.renormalize,
                         scale=cfg.routed_scaling_factor)
    front = matmul(x, w.front, out_dtype=torch.bfloat16)
    act = situ_and_mul(front[:, :2 * cfg.shared_intermediate], beta=cfg.situ_beta,
                       linear_beta=cfg.situ_linear_beta)
    return types.SimpleNamespace(logits=logits, weights=weights, ids=ids, shared_act=act)


def check_wide_step(contract, traces, x, w, cfg) -> None:
    """Every stage of one S2 step on every rank (the table of the module docstring)."""
    tokens, ranks = x.shape[0], len(traces)
    s0 = _stock_front(x, w, cfg)
    k, n = cfg.top_k, ranks
    s_n, h_n = cfg.shared_intermediate // n, cfg.hidden // n
    published = round_to_bfloat16(matmul(x, w.latent_down, out_dtype=torch.float32))
    for tr in traces:
        r = tr.rank
        contract.bitwise(tr.logits, s0.logits, what=f"rank {r} polled logits", index_names=ROWS)
        contract.bitwise(tr.ids, s0.ids, what=f"rank {r} ids")
        contract.bitwise(tr.weights, s0.weights, what=f"rank {r} weights")
        contract.bitwise(tr.latent, published, what=f"rank {r} polled latent",
                         index_names=ROWS)
        contract.bounded(tr.latent, bounds.reference_matmul(x, w.latent_down),
                         bounds.matmul_bf16_out_bound(x, w.latent_down),
                         what=f"rank {r} latent vs exact",
                         bound_name="gamma_K(2^-24)|x||W| + BF16 half-ULP", index_names=ROWS)
        codes, scales = quantize_mxfp8(tr.latent)
        contract.bitwise(tr.codes, codes, what=f"rank {r} plan codes", index_names=ROWS)
        contract.bitwise(tr.scales, scales, what=f"rank {r} plan scales", index_names=ROWS)

        # routing lists and the engine's unit windows
        flat = tr.ids.reshape(-1).long()
        counts = torch.bincount(flat, minlength=cfg.experts).to(torch.int32)
        contract.bitwise(tr.counts, counts, what=f"rank {r} list counts")
        filled = torch.arange(tr.lists.shape[1])[None, :] < tr.counts[:, None]
        contract.bitwise(tr.lists[~filled], torch.full_like(tr.lists[~filled], -1),
                         what=f"rank {r} list tails poisoned")
        listed = tr.lists[filled].long()
        owner = torch.arange(cfg.experts)[:, None].expand_as(tr.lists)[filled]
        contract.bitwise(listed.sort().values, torch.arange(tokens * k),
                         what=f"rank {r} every pair listed once")
        contract.bitwise(flat[listed], owner, what=f"rank {r} pairs in their expert's list")
        seen = torch.cat([win for _, win in tr.windows]).long()
        contract.bitwise(seen.sort().values, torch.arange(tokens * k),
                         what=f"rank {r} every pair in one window")
        per_expert = torch.zeros(cfg.experts, dtype=torch.int32)
        for e, win in tr.windows:
            if not (1 <= win.numel() <= WINDOW) or bool((flat[win.long()] != e).any()):
                raise AssertionError(f"rank {r}: window of expert {e} holds {win.tolist()}")
            per_expert[e] += 1
        contract.bitwise(per_expert, (counts + WINDOW - 1) // WINDOW,
                         what=f"rank {r} windows per expert = ceil(count / 8)")

        rows = expert_rows_mxfp8(tr.codes, tr.scales, tr.ids, w, cfg, shard=(r, n))
        contract.bitwise(tr.rows, rows, what=f"rank {r} expert rows (TP slice)",
                         index_names=ROWS)
        contract.bitwise(tr.routed_partial, finalize(tr.rows, tr.weights),
                         what=f"rank {r} Finalize", index_names=ROWS)
        contract.bitwise(tr.normed, rms_norm(tr.routed, w.latent_norm, cfg.rms_eps),
                         what=f"rank {r} normed", index_names=ROWS)
        # the hidden partial: the shared slice, then this rank's up columns added
        cols = slice(r * h_n, (r + 1) * h_n)
        expected = tr.shared.clone()
        expected[:, cols] = addmm(tr.shared[:, cols].contiguous(), tr.normed, w.up[cols])
        contract.bitwise(tr.hidden_partial, expected, what=f"rank {r} hidden partial",
                         index_names=ROWS)
        act_r = s0.shared_act[:, r * s_n:(r + 1) * s_n]
        down_r = w.shared_down[:, r * s_n:(r + 1) * s_n]
        contract.bounded(tr.shared, bounds.reference_matmul(act_r, down_r),
                         bounds.matmul_bf16_out_bound(act_r, down_r),
                         what=f"rank {r} shared partial", index_names=ROWS,
                         bound_name="gamma_{S/N}(2^-24)|act||W| + BF16 half-ULP")

    routed = _ordered_sum([tr.routed_partial for tr in traces])
    hidden = _ordered_sum([tr.hidden_partial for tr in traces])
    for tr in traces:
        contract.bitwise(tr.routed, routed, what=f"rank {tr.rank} latent all-reduce",
                         index_names=ROWS)
        contract.bitwise(tr.out, hidden, what=f"rank {tr.rank} hidden all-reduce",
                         index_names=ROWS)

    # against S0 on the same latent: the TP split of FC2 and the partial sums
    own = traces[0]
    full_rows = expert_rows(own.latent, own.ids, w, cfg)
    s0_routed = finalize(full_rows, own.weights)
    if n == 1:
        contract.bitwise(own.routed, s0_routed, what="routed = S0 on own latent",
                         index_names=ROWS)
        return
    wk = own.weights
    full = full_rows.view(tokens, k, -1)
    full_err = schedule_bounds.bf16_part_error(full, full.double().abs() * 2.0**-24)
    s0_err = bounds.final_rounding_bound(
        s0_routed.double(),
        schedule_bounds.fma_chain_error(wk, full)
        + (wk.double().abs().unsqueeze(-1) * full_err).sum(1), torch.bfloat16)
    parts, errors = [], []
    for tr in traces:
        part_rows = tr.rows.view(tokens, k, -1)
        row_err = schedule_bounds.bf16_part_error(part_rows, part_rows.double().abs() * 2.0**-24)
        inner = schedule_bounds.fma_chain_error(wk, part_rows) \
            + (wk.double().abs().unsqueeze(-1) * row_err).sum(1)
        parts.append(tr.routed_partial)
        errors.append(schedule_bounds.bf16_part_error(tr.routed_partial, inner))
    errors[0] = errors[0] + s0_err
    bound = schedule_bounds.ordered_sum_error(parts, errors, s0_routed.double()) + s0_err
    contract.bounded(own.routed, s0_routed.double(), bound,
                     what=f"routed latent of {n} TP ranks vs S0 on own latent",
                     bound_name="BF16 FC2 partials + FMA chains + FP32 rank-order sum",
                     index_names=ROWS)


@pytest.mark.parametrize("config_name,ranks,tokens", GRID)
def test_wide_stages(config_name, ranks, tokens, seed, contract):
    cfg = cases.config(config_name)
    w = cases.weights(config_name)
    x = cases.hidden_rows(cfg, tokens, seed)
    check_wide_step(contract, wide_layer_virtual(x, w, ranks, cfg), x, w, cfg)


def _edge_config():
    """``small`` with ``wide_rows`` 72: the full layer at its capacity edge stays cheap on a
    CPU (the rule is the same comparison at 1024; the lists at the real capacity are
    checked in ``test_wide_lists_at_capacity``)."""
    cfg = dataclasses.replace(cases.config("small"), wide_rows=72)
    return cfg, dataclasses.replace(cases.weights("small"), config=cfg)


@pytest.mark.config("small")
@pytest.mark.parametrize("ranks", (1, 2))
@pytest.mark.parametrize("edge", ("first", "last"))
def test_wide_bucket_edges(edge, ranks, seed, contract):
    """65 tokens (the first batch of the wide range) and ``wide_rows`` tokens with one
    expert chosen by every token (its routing list exactly full): every stage checked; one
    token more is refused before any expert runs, naming the limit."""
    cfg, w = _edge_config()
    tokens = 65 if edge == "first" else cfg.wide_rows
    if edge == "last":  # expert 0 first for every token: its list holds all of them
        bias = w.bias.clone()
        bias[0] = 10.0
        w = dataclasses.replace(w, bias=bias)
    x = cases.hidden_rows(cfg, tokens, seed)
    traces = wide_layer_virtual(x, w, ranks, cfg)
    check_wide_step(contract, traces, x, w, cfg)
    if edge == "last":
        full = int(traces[0].counts[0])
        if full != cfg.wide_rows:
            raise AssertionError(f"expert 0's list holds {full} pairs, not {cfg.wide_rows}")
        more = cases.hidden_rows(cfg, tokens + 1, seed)
        with pytest.raises(ValueError, match=f"{tokens + 1} tokens > (mailbox rows|capacity) "
                                             f"{cfg.wide_rows}"):
            wide_layer_virtual(more, w, ranks, cfg)


@pytest.mark.config("kimi_k3")
def test_wide_lists_at_capacity(contract):
    """The routing lists at the real capacity (``wide_rows`` of the real layer): with every
    token on expert 0 its list holds all ``wide_rows`` pairs in token order and no -1; one
    token more is refused."""
    cfg = cases.config("kimi_k3")
    t, k = cfg.wide_rows, cfg.top_k
    g = torch.Generator().manual_seed(0)
    others = torch.stack([torch.randperm(cfg.experts - 1, generator=g)[:k - 1] + 1
                          for _ in range(t)])
    ids = torch.cat([torch.zeros(t, 1, dtype=torch.int64), others], 1).to(torch.int32)
    lists, counts = routing_lists(ids, cfg.experts, cfg.wide_rows)
    contract.bitwise(counts, torch.bincount(ids.reshape(-1).long(), minlength=cfg.experts)
                     .to(torch.int32), what="list counts")
    contract.bitwise(lists[0], (torch.arange(t) * k).to(torch.int32),
                     what="expert 0's list: every token's slot 0, in token order")
    with pytest.raises(ValueError, match=f"{t + 1} tokens > capacity {t}"):
        routing_lists(torch.cat([ids, ids[:1]]), cfg.experts, cfg.wide_rows)


@pytest.mark.config("small")
@pytest.mark.parametrize("ranks", (1, 4))
def test_wide_two_layers_one_scratch(ranks, seed, contract):
    """State across calls: two consecutive layers (other inputs, other weights, another
    batch size), then the first again, through one persistent mailbox per rank; every call
    checked stage by stage, the rotating buffers alternating and re-armed after each call."""
    cfg = cases.config("small")
    layers = [(cases.weights("small"), cases.hidden_rows(cfg, 65, seed)),
              (cases.other_weights("small"), cases.hidden_rows(cfg, 7, seed + 1)),
              (cases.weights("small"), cases.hidden_rows(cfg, 3, seed + 2))]

    def body(group):
        scratch = WideScratch(group, cfg, rows=80)
        steps = []
        for w, x in layers:
            trace = wide_rank(group, x, w, cfg, scratch=scratch)
            armed = scratch.mailbox.buffers[trace.mailbox_index].clone()
            steps.append((trace, armed))
        return steps

    per_rank = run_virtual(ranks, body)
    for i, (w, x) in enumerate(layers):
        check_wide_step(contract, [steps[i][0] for steps in per_rank], x, w, cfg)
    for r, steps in enumerate(per_rank):
        used = [trace.mailbox_index for trace, _ in steps]
        if used != [0, 1, 0]:
            raise AssertionError(f"rank {r}: the calls used mailbox buffers {used}, not 0, 1, 0")
        for i, (_, buf) in enumerate(steps):
            lat = buf[:, :cfg.latent]
            log = buf[:, cfg.latent:].contiguous().view(torch.int32)
            contract.bitwise(lat, torch.full_like(lat, mailbox.SENTINEL_BF16),
                             what=f"rank {r} call {i}: latent words re-armed")
            contract.bitwise(log, torch.full_like(log, mailbox.SENTINEL_F32),
                             what=f"rank {r} call {i}: logit words re-armed")


@pytest.mark.config("small")
@pytest.mark.parametrize("ranks", (2, 4))
def test_mailbox_sentinel(ranks, seed, contract):
    """The Lamport mailbox: a published -0 (BF16 latent word 0x8000, FP32 logit word
    0x80000000) arrives as +0 — never as the empty marker — on every rank, and the slots
    read are re-armed (empty) after the poll."""
    cfg = cases.config("small")
    tokens, l_n, e_n = 3, cfg.latent // ranks, cfg.experts // ranks
    g = torch.Generator().manual_seed(seed)

    def shard(r):
        lat = torch.randn(tokens, l_n, generator=g).bfloat16()
        lat[:, r] = -0.0
        logits = torch.randn(tokens, e_n, generator=g)
        logits[:, 0] = -0.0
        return lat, logits

    shards = [shard(r) for r in range(ranks)]

    def body(group):
        box = mailbox.open_mailbox(group, 8, cfg.latent, cfg.experts)
        box.publish(*shards[group.rank])
        got = box.poll_logits(tokens, timeout=10.0), box.poll_latent(tokens, timeout=10.0)
        return got, box.is_armed(slice(0, tokens))

    results = run_virtual(ranks, body, timeout=30.0)
    want_lat = torch.cat([lat for lat, _ in shards], 1)
    want_log = torch.cat([log for _, log in shards], 1)
    want_lat = torch.where(want_lat == 0, torch.zeros_like(want_lat), want_lat)  # -0 -> +0
    want_log = torch.where(want_log == 0, torch.zeros_like(want_log), want_log)
    for r, ((logits, latent), armed) in enumerate(results):
        contract.bitwise(latent, want_lat, what=f"rank {r} latent through the mailbox")
        contract.bitwise(logits, want_log, what=f"rank {r} logits through the mailbox")
        assert armed, f"rank {r}: the slots it read were not re-armed"


@pytest.mark.backends("fast", external=True)
@pytest.mark.config("small")
@pytest.mark.parametrize("ranks,tokens", [(n, 65) for n in (1, 2, 4, 8)] + [(1, 3)])
def test_layer_wide(backend, ranks, tokens, seed, contract):
    """A backend's whole S2 layer at ``ranks`` TP ranks over one batch of ``tokens``
    (``verify.layers``)."""
    check_layer(contract, backend, "wide", ranks, tokens, seed)
