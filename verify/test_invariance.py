"""Invariances: a token's output bits do not depend on its batch-mates or its
row position; runs are deterministic; the EP size changes only what its order changes;
the wide engine's list order (the GPU's relaxed slot claims) changes no bit; a bad token
(NaN, infinite or overflowing row) changes no bit of any other token (``verify.isolation``).

Stream orderings (side streams delayed or serialized, CUDA-graph replay) are properties of
the fast multi-stream schedules; their contracts belong with those schedules in ``fast/``
(not built yet: the reference emulations run their stages in program order, which every
stream ordering must reproduce).
"""

from __future__ import annotations

import pytest
import torch

from reference.layer import stock_order_trace
from reference.schedules.dep import dep_layer_virtual
from reference.schedules.wide import wide_layer_virtual
from verify import cases, isolation

pytestmark = pytest.mark.config("small")
ROWS = ("token", "column")


@pytest.mark.parametrize("tokens", (2, 7, 64, 100))
def test_batch_invariance_stock(tokens, seed, contract):
    """S0: each row alone, and the batch reversed, give the same bits as the batch."""
    cfg, w = cases.config("small"), cases.weights("small")
    x = cases.hidden_rows(cfg, tokens, seed)
    full = stock_order_trace(x, w, cfg).out
    flipped = stock_order_trace(x.flip(0), w, cfg).out.flip(0)
    contract.bitwise(flipped, full, what="S0 with the batch reversed", index_names=ROWS)
    for t in (0, tokens - 1):
        alone = stock_order_trace(x[t:t + 1], w, cfg).out
        contract.bitwise(alone, full[t:t + 1], what=f"S0 token {t} alone", index_names=ROWS)


@pytest.mark.parametrize("ranks,tokens", [(2, 16), (4, 3)])
def test_batch_invariance_dep(ranks, tokens, seed, contract):
    """S1 (split-K tactic fixed): a rank's token gives the same bits whatever the other
    tokens of its batch and of the other ranks."""
    cfg, w = cases.config("small"), cases.weights("small")
    xs = cases.rank_rows(cfg, ranks, tokens, seed)
    base = dep_layer_virtual(xs, w, cfg, front_splits=1, router_splits=2)
    others = [cases.hidden_rows(cfg, tokens, seed + 100 + r) for r in range(ranks)]
    others[0] = torch.cat([xs[0][:1], others[0][1:]])
    moved = dep_layer_virtual(others, w, cfg, front_splits=1, router_splits=2)
    contract.bitwise(moved[0].out[:1], base[0].out[:1], what="S1 token 0 among other tokens",
                     index_names=ROWS)


@pytest.mark.parametrize("ranks", (1, 4))
def test_batch_invariance_wide(ranks, seed, contract):
    cfg, w = cases.config("small"), cases.weights("small")
    x = cases.hidden_rows(cfg, 65, seed)
    full = wide_layer_virtual(x, w, ranks, cfg)[0].out
    part = wide_layer_virtual(x[40:].flip(0).contiguous(), w, ranks, cfg)[0].out.flip(0)
    contract.bitwise(part, full[40:], what="S2 rows 40.. in another batch", index_names=ROWS)


@pytest.mark.parametrize("schedule", ("stock", "dep", "wide"))
def test_determinism(schedule, seed, contract):
    """Two runs of the same inputs: equal bits."""
    cfg, w = cases.config("small"), cases.weights("small")
    x = cases.hidden_rows(cfg, 16, seed)
    if schedule == "stock":
        runs = [stock_order_trace(x, w, cfg).out for _ in range(2)]
    elif schedule == "dep":
        runs = [dep_layer_virtual([x, x.flip(0)], w, cfg)[1].out for _ in range(2)]
    else:
        runs = [wide_layer_virtual(x, w, 4, cfg)[2].out for _ in range(2)]
    contract.bitwise(runs[1], runs[0], what=f"{schedule} run twice", index_names=ROWS)


@pytest.mark.parametrize("tokens", (3, 16))
def test_ep_size_invariance(tokens, seed, contract):
    """S1 with unsplit GEMMs at 1, 2, 4, 8 and 16 ranks: everything before the combine
    (ids, weights, latent, MXFP8, each pair's expert row) is bitwise independent of the EP
    size; the combine is where the order changes (``test_dep`` bounds it)."""
    cfg, w = cases.config("small"), cases.weights("small")
    x = cases.hidden_rows(cfg, tokens, seed)
    one = dep_layer_virtual([x], w, cfg, front_splits=1, router_splits=1)[0]
    for n in (2, 4, 8, 16):
        traces = dep_layer_virtual([x] * n, w, cfg, front_splits=1, router_splits=1)
        tr = traces[n - 1]
        contract.bitwise(tr.ids, one.ids, what=f"ids at EP{n}")
        contract.bitwise(tr.codes, one.codes, what=f"MXFP8 latent at EP{n}", index_names=ROWS)
        owner_of = tr.ids.long() // (cfg.experts // n)
        rows_one = one.rows[:tokens]  # [T, k, L] at the single owner
        for o in range(n):
            local = owner_of == o
            got = traces[o].rows[(n - 1) * tokens + torch.arange(tokens)]
            contract.bitwise(got[local], rows_one[local], what=f"expert rows at EP{n} owner {o}")


@pytest.mark.parametrize("ranks", (1, 2, 8))
def test_wide_claim_order_invariance(ranks, seed, contract):
    """The routing lists filled in a shuffled claim order (as relaxed GPU atomics may):
    the layer output is bit-identical."""
    cfg, w = cases.config("small"), cases.weights("small")
    tokens = 70
    x = cases.hidden_rows(cfg, tokens, seed)
    base = wide_layer_virtual(x, w, ranks, cfg)[0]
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(tokens * cfg.top_k, generator=g)
    shuffled = wide_layer_virtual(x, w, ranks, cfg, claim_order=order)[0]
    contract.bitwise(shuffled.out, base.out, what="wide output, shuffled list claims",
                     index_names=ROWS)



# -- a bad token: the reference refuses the batch, naming it (verify.isolation) --------------

@pytest.mark.parametrize("schedule", ("stock", "dep", "wide"))
@pytest.mark.parametrize("kind", isolation.BAD_KINDS)
def test_bad_token_refused_by_reference(schedule, kind, seed):
    """The reference schedules define no output for a token whose logits are not finite
    (the top-k of NaN scores is undefined): a batch holding one (``verify.isolation.bad_row``:
    NaN, infinite or overflowing rows) raises ``ValueError`` naming that token's row, on
    S0, on the S1 rank that holds it and on S2. (The fast layers cannot check without a
    host synchronization; their contract is that the bad token changes no other token:
    ``test_dep_fast_bad_token_isolation``, ``test_wide_fast_bad_token_isolation``.)"""
    cfg, w = cases.config("small"), cases.weights("small")
    if schedule == "dep":
        xs = cases.rank_rows(cfg, 4, 8, seed)
        xs[1][3] = isolation.bad_row(kind, xs[1][3], seed)
        run, row = (lambda: dep_layer_virtual(xs, w, cfg)), 3
    else:
        x = cases.hidden_rows(cfg, 70, seed)
        x[33] = isolation.bad_row(kind, x[33], seed)
        run = (lambda: stock_order_trace(x, w, cfg)) if schedule == "stock" else (
            lambda: wide_layer_virtual(x, w, 4, cfg))
        row = 33
    with pytest.raises(ValueError, match=rf"logits must be finite .* token rows \[{row}\] "):
        run()
