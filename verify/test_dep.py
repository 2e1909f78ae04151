"""Contracts of S1, the DEP layer, at every rank count: each stage of every rank against the
reference stage applied to *that rank's own inputs of the stage*, so a difference upstream
never hides or excuses one downstream.

| stage | contract |
|---|---|
| path, tactics | ``T <= front_max``: the split-K front path with the requested splits (default: front 1, router 4 up to 32 tokens, else 2); above: the stock path, unsplit |
| front / shared | split 1: bitwise = ``matmul``; split s: bitwise = ``split_k_matmul(s)`` and within ``matmul_bf16_out_bound(s)`` of exact |
| router logits | the same with FP32 out |
| ids, weights | bitwise = ``route(own logits)``; vs S0's ids: flips only within the score bound |
| MXFP8 latent | bitwise = ``quantize_mxfp8(own latent)`` |
| dispatch | the owners' receive rows are the sources' codes/scales/ids/weights, bit for bit; empty rows poisoned |
| expert rows | bitwise = ``expert_rows(own latent, own ids)`` at the owner |
| owner partial | bitwise = an FMA chain over the owner's slots in k order, written here |
| combine | bitwise = the present partials summed in FP32 in owner order, written here; N = 1: = ``finalize``; N > 1: within the bound of owner partials summed in FP32 |
| normed, out | bitwise = ``rms_norm(own routed)``, ``addmm(own shared, own normed, up)`` |
| end to end | N = 1, unsplit: bitwise equal to S0 |

On designed experts (constructed rows, the real dispatch, owner Finalize and combine), every
order the schedule fixes is visible in the output bits: each pair of adjacent slots in the
owner's chain, and the owners' order in the combine. Two consecutive layers run through one
world of ranks (different inputs and weights), the second checked like the first.

A backend that runs the whole S1 layer (stage ``layer_dep``) is checked at its output and
routing per rank (``verify.layers``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from reference import layer
from reference.activation import situ_and_mul
from reference.experts import expert_rows
from reference.finalize import finalize
from reference.fp import fma_f32
from reference.gemm import addmm, matmul, split_k_matmul
from reference.mx import quantize_mxfp8
from reference.norm import rms_norm
from reference.router import route
from reference.schedules import dep
from reference.schedules.groups import run_virtual
from reference.schedules.dep import POISON_CODE, POISON_SCALE, dep_layer_virtual, dep_rank
from verify import bounds, cases, schedule_bounds, tolerances
from verify.layers import check_layer
from verify.oracles import stages as oracle
from verify.routing import biased_score_bound, compare_routing

pytestmark = pytest.mark.config("small")

#: (ranks, tokens per rank): every rank count with every DEP batch, up to 256 tokens in all
#: (the emulation runs all ranks on this machine), and the stock path (T > front_max).
GRID = [(n, t) for n in cases.RANKS for t in cases.DEP_BATCHES if n * t <= 256]
GRID += [(1, 65), (2, 65)]
#: Requested tactics: the default (front 1, router 4 / 2), everything unsplit, the front
#: and the shared down-projection split in two.
TACTICS = {"default": {}, "unsplit": {"front_splits": 1, "router_splits": 1},
           "front_split": {"front_splits": 2, "router_splits": 4}}
ROWS = ("token", "column")


def expected_path(tokens: int, cfg, requested: dict) -> tuple[str, int, int]:
    """(path, front splits, router splits) the schedule must take: the split-K front path
    up to ``front_max`` tokens with the requested splits (default front 1, router 4 up to
    32 tokens, else 2); the stock path, unsplit, above."""
    if tokens > cfg.front_max:
        return "stock", 1, 1
    router_default = 4 if tokens <= 32 else 2
    return ("front", requested.get("front_splits", 1),
            requested.get("router_splits", router_default))


def _check_projection(contract, got, x, weight, splits, out_dtype, what):
    """Bitwise against the tactic's own order; split-K also within the derived bound."""
    if splits == 1:
        contract.bitwise(got, matmul(x, weight, out_dtype=out_dtype), what=what,
                         index_names=ROWS)
        return
    contract.bitwise(got, split_k_matmul(x, weight, splits=splits, out_dtype=out_dtype),
                     what=f"{what} (split-K {splits} order)", index_names=ROWS)
    make = bounds.matmul_fp32_out_bound if out_dtype == torch.float32 else \
        bounds.matmul_bf16_out_bound
    contract.bounded(got, bounds.reference_matmul(x, weight),
                     make(x, weight, splits=splits), what=f"{what} (split-K {splits})",
                     bound_name="gamma_{K/s+s-1}(2^-24)|A||B| + final half-ULP",
                     index_names=ROWS)


def check_dep_step(contract, traces, xs, w, cfg, requested: dict) -> None:
    """Every stage of one S1 step on every rank (the table of the module docstring)."""
    ranks, tokens = len(traces), xs[0].shape[0]
    s2 = 2 * cfg.shared_intermediate
    per = cfg.experts // ranks
    path, front_splits, router_splits = expected_path(tokens, cfg, requested)
    for tr, x in zip(traces, xs):
        r = tr.rank
        if (tr.path, tr.front_splits, tr.router_splits) != (path, front_splits, router_splits):
            raise AssertionError(
                f"rank {r} at T={tokens} took path {tr.path!r} with front/router splits "
                f"{tr.front_splits}/{tr.router_splits}; expected {path!r} "
                f"{front_splits}/{router_splits}")
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

    # experts at the owners, combine, norm, out: on each home rank's own routing. The
    # homes' expert rows come from one call over all homes' tokens (a pair's row depends
    # on that pair alone: ``reference.experts``; batch invariance is a contract of its own).
    all_rows = expert_rows(torch.cat([tr.latent for tr in traces]),
                           torch.cat([tr.ids for tr in traces]), w, cfg)
    all_rows = all_rows.view(ranks, tokens, cfg.top_k, -1)
    owners = torch.arange(ranks)
    for home in traces:
        h = home.rank
        own_rows = all_rows[h]  # [T, k, L]
        at = h * tokens + torch.arange(tokens)
        local = (home.ids.long() // per)[None] == owners[:, None, None]  # [N, T, k]
        got = torch.stack([owner.rows[at] for owner in traces])  # [N, T, k, L]
        want = torch.where(local[..., None], own_rows.expand_as(got), got)
        contract.bitwise(got, want, what=f"expert rows of home {h} at their owners",
                         index_names=("owner", "token", "slot", "column"))
        # each owner's partial: an FMA chain over its local slots in k order (written here
        # independently of the schedule's code), one BF16 rounding
        acc = torch.zeros(ranks, tokens, cfg.latent)
        for j in range(cfg.top_k):
            step = fma_f32(home.weights[None, :, j:j + 1].expand_as(acc),
                           own_rows[None, :, j].float().expand_as(acc), acc)
            acc = torch.where(local[:, :, j:j + 1], step, acc)
        present = local.any(2)  # [N, T]: the owner holds one of the token's experts
        partials = torch.stack([owner.partials[at] for owner in traces])  # [N, T, L]
        want = torch.where(present[..., None], acc.bfloat16(), partials)
        contract.bitwise(partials, want, what=f"partial finalize of home {h} at its owners",
                         index_names=("owner", "token", "column"))
        parts = list(torch.where(present[..., None], partials, torch.zeros_like(partials)))
        presence = list(present)
        inner = schedule_bounds.fma_chain_error(
            (home.weights[None] * local).reshape(ranks * tokens, -1),
            own_rows.repeat(ranks, 1, 1)).view(ranks, tokens, -1)
        errors = [schedule_bounds.bf16_part_error(p, e) for p, e in zip(parts, inner)]
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


#: (ranks, tokens, tactic): the default and unsplit tactics on the whole grid; the split
#: front on a few rank counts and batches, and above ``front_max`` (where it is ignored).
CASES = [(n, t, tactic) for tactic in ("default", "unsplit") for n, t in GRID]
CASES += [(n, t, "front_split") for n in (1, 2, 4) for t in (1, 7, 64)] + [(1, 65, "front_split")]


@pytest.mark.parametrize("ranks,tokens,tactic", CASES)
def test_dep_stages(ranks, tokens, tactic, seed, contract):
    cfg, w = cases.config("small"), cases.weights("small")
    xs = cases.rank_rows(cfg, ranks, tokens, seed)
    traces = dep_layer_virtual(xs, w, cfg, **TACTICS[tactic])
    check_dep_step(contract, traces, xs, w, cfg, TACTICS[tactic])


@pytest.mark.parametrize("ranks", (1, 2))
@pytest.mark.parametrize("tokens", (32, 33))
def test_dep_bucket_edges(ranks, tokens, seed, contract):
    """Both sides of the router's split change (32 / 33 tokens) with the default tactics:
    the tactic the schedule takes, and its bits, are those of the expected tactic's own
    order, so an off-by-one of the selection fails even where both tactics stay within
    the bounds; the neighbouring tactic really gives other bits here. (The front bucket's
    edge, ``front_max`` / ``front_max + 1`` = 64 / 65 tokens, is in ``test_dep_stages``'s
    grid, whose check asserts the path and tactic of every case the same way.)"""
    cfg, w = cases.config("small"), cases.weights("small")
    xs = cases.rank_rows(cfg, ranks, tokens, seed)
    traces = dep_layer_virtual(xs, w, cfg)
    check_dep_step(contract, traces, xs, w, cfg, {})
    _, _, splits = expected_path(tokens, cfg, {})
    other = 2 if splits == 4 else 4
    differs = sum(int((split_k_matmul(x, w.gate, splits=other, out_dtype=torch.float32)
                       != tr.logits).sum()) for x, tr in zip(xs, traces))
    contract.figure("logits_off_under_the_other_tactic", differs, worst="min")
    assert differs, f"at T={tokens} the router tactics {splits} and {other} agree bitwise"


@pytest.mark.parametrize("ranks", (1, 4))
def test_dep_two_layers_one_world(ranks, seed, contract):
    """State across calls: two consecutive layers (other inputs, other weights, another
    batch size) run by the same ranks of one world; each is checked stage by stage."""
    cfg = cases.config("small")
    layers = [(cases.weights("small"), cases.rank_rows(cfg, ranks, 7, seed)),
              (cases.other_weights("small"), cases.rank_rows(cfg, ranks, 5, seed + 50))]

    def body(group):
        return [dep_rank(group, xs[group.rank], w, cfg) for w, xs in layers]

    per_rank = run_virtual(ranks, body)
    for i, (w, xs) in enumerate(layers):
        check_dep_step(contract, [steps[i] for steps in per_rank], xs, w, cfg, {})


@pytest.mark.parametrize("tokens", cases.DEP_BATCHES + (65,))
def test_dep_single_rank_is_stock(tokens, seed, contract):
    """S1 on one rank with unsplit GEMMs is S0, bit for bit, end to end."""
    cfg, w = cases.config("small"), cases.weights("small")
    xs = cases.rank_rows(cfg, 1, tokens, seed)
    traces = dep_layer_virtual(xs, w, cfg, **TACTICS["unsplit"])
    s0 = layer.stock_order_trace(xs[0], w, cfg)
    contract.bitwise(traces[0].ids, s0.ids, what="ids")
    contract.bitwise(traces[0].combined, s0.routed, what="routed latent", index_names=ROWS)
    contract.bitwise(traces[0].out, s0.out, what="layer output", index_names=ROWS)


# ------------------------------------------------------------------ designed experts
#
# With trained-like data an FP32 reordering moves a result by about one FP32 ULP, which a
# BF16 output hides unless it sits on a rounding boundary: a swapped slot or a reversed
# combine could slip through random inputs. Here the routing and the experts (the module
# attributes the schedule calls) return constructed values on which every such reordering
# changes the BF16 result, and the schedule's real dispatch, owner Finalize and combine run
# over them.

BIG, SMALL = 2.0**30, 1.0 + 2.0**-7  # FP32 ULP at 2^30 is 2^7: SMALL is absorbed by BIG
OWNERS = 4
PER_OWNER = 4  # at 4 ranks: 4 of each owner's experts, owner by owner in slot order


def _designed_ids(cfg) -> list[int]:
    per = cfg.experts // OWNERS
    return [o * per + i for o in range(OWNERS) for i in range(PER_OWNER)]


def _designed_rows(cfg) -> torch.Tensor:
    """BF16 [E, L] rows of the constructed experts (routing weights all 1.0, the ids of
    :func:`_designed_ids` on every token, so slot j adds ``V[ids[j]]`` exactly).

    * column 0: slot 0 BIG, slot 4 -BIG, slot 8 SMALL: the k chain gives SMALL; at 4 ranks
      the owners' partials are (BIG, -BIG, SMALL, 0), whose owner-order sum is SMALL and
      whose reversed sum is 0;
    * column 1 + a (a = 1..14): slot 0 BIG, slot a -BIG, slot a+1 SMALL: the k chain gives
      SMALL, the chain with slots a and a+1 swapped gives 0."""
    v = torch.zeros(cfg.experts, cfg.latent, dtype=torch.float32)
    ids = _designed_ids(cfg)
    v[ids[0], 0], v[ids[4], 0], v[ids[8], 0] = BIG, -BIG, SMALL
    for a in range(1, cfg.top_k - 1):
        v[ids[0], 1 + a], v[ids[a], 1 + a], v[ids[a + 1], 1 + a] = BIG, -BIG, SMALL
    return v.bfloat16()


@pytest.mark.parametrize("ranks", (1, OWNERS))
def test_dep_designed_orders(ranks, seed, contract, monkeypatch):
    """Every order S1 fixes, on designed experts: at one rank every adjacent pair of slots
    of the owner's FMA chain is visible in a column; at four ranks the owners' order in the
    combine is visible in column 0 (their partials are BIG, -BIG, SMALL, 0)."""
    cfg, w = cases.config("small"), cases.weights("small")
    v, ids = _designed_rows(cfg), _designed_ids(cfg)
    k = cfg.top_k

    def routing(logits, bias, **kw):
        t = logits.shape[0]
        return (torch.ones(t, k, dtype=torch.float32),
                torch.tensor(ids, dtype=torch.int32).expand(t, k).contiguous())

    def experts(x, expert_ids, weights, config, *, rows=None, shard=None):
        return v[expert_ids.long()]  # the pair's row is its expert's constructed row

    monkeypatch.setattr(dep, "route", routing)
    monkeypatch.setattr(dep, "pair_rows_fp32", experts)
    traces = dep_layer_virtual(cases.rank_rows(cfg, ranks, 2, seed), w, cfg)
    rows = v[torch.tensor(ids)].repeat(2, 1)  # [T*k, L], pair order t*k + j
    want = oracle.finalize(rows, torch.ones(2, k))
    designed = [0] + list(range(2, k))
    if not bool((want[:, designed].float() == SMALL).all()):
        raise AssertionError("the designed columns lost their meaning")
    columns = designed if ranks == 1 else [0]
    for tr in traces:
        contract.bitwise(tr.combined[:, columns], want[:, columns],
                         what=f"rank {tr.rank} routed latent on designed experts "
                              f"(columns {columns[0]}..{columns[-1]})")


def test_designed_orders_have_power(contract):
    """The designed rows distinguish the orders the contract above relies on: reversing
    the owners' combine, or swapping any two adjacent slots, gives other bits."""
    cfg = cases.config("small")
    v, ids = _designed_rows(cfg), _designed_ids(cfg)
    k = cfg.top_k
    rows = v[torch.tensor(ids)]
    ones = torch.ones(1, k)
    want = oracle.finalize(rows, ones)
    blind = []
    for a in range(1, k - 1):
        order = list(range(k))
        order[a], order[a + 1] = order[a + 1], order[a]
        if oracle.finalize(rows[order], ones)[0, 1 + a] == want[0, 1 + a]:
            blind.append(f"slots {a},{a + 1}")
    per = [oracle.finalize(torch.where(torch.tensor([j // PER_OWNER == o for j in range(k)])[:, None],
                                       rows, torch.zeros_like(rows)), ones)
           for o in range(OWNERS)]
    forward = per[0].float() + per[1].float() + per[2].float() + per[3].float()
    backward = per[3].float() + per[2].float() + per[1].float() + per[0].float()
    if forward.bfloat16()[0, 0] == backward.bfloat16()[0, 0]:
        blind.append("owner order")
    contract.figure("designed_orders", k - 2 + 1, worst="min")
    assert not blind, f"designed experts do not distinguish: {blind}"


@pytest.mark.backends("fast", external=True)
@pytest.mark.parametrize("ranks,tokens", [(n, t) for n in cases.RANKS for t in (1, 7)] + [(2, 64)])
def test_layer_dep(backend, ranks, tokens, seed, contract):
    """A backend's whole S1 layer at ``ranks`` ranks of ``tokens`` tokens each
    (``verify.layers``)."""
    check_layer(contract, backend, "dep", ranks, tokens, seed)
