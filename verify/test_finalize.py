"""Contracts of Finalize: ``out[t] = sum_k w[t,k] * rows[K t + k]`` as an FP32 fused
multiply-add chain in k order from ``acc = +0``, one BF16 rounding.

By the backend's claim for the ``finalize`` stage:

* bitwise (``reference`` on the CPU, ``reference-cuda``, ``fast``): bit-identical to the
  oracle :func:`verify.oracles.stages.finalize` (each step the exact ``w * row + acc``
  rounded once), on random rows and on designed tokens where every k order, every pair of
  adjacent slots swapped, a multiply rounded before the add, and a ``-0`` start change the
  bits;
* bound (``stock``: a PyTorch reduction, products rounded, its own summation order; any
  backend that sums in another order): within ``gamma_k(2^-24) * sum_k |w_k r_k|`` plus
  the final BF16 rounding of the exact sum.

Widths and ``top_k`` are the config's (``latent``, ``top_k``).
"""

from __future__ import annotations

import pytest
import torch

from verify import bounds, cases
from verify.oracles import stages as oracle

U32 = bounds.unit_roundoff(torch.float32)
BIG, SMALL = 2.0**30, 1.0 + 2.0**-7  # FP32 ULP at 2^30 is 2^7: SMALL vanishes next to BIG

# A token (found by a seeded random search) where multiplying, rounding, then adding -
# instead of one fused multiply-add - changes the BF16 output of the chain.
FMA_CASE_W = [0.7213906645774841, 0.5728296041488647, 0.25865840911865234, 0.5910871624946594,
              0.8515946269035339, 0.3838203549385071, 0.08265364170074463, 0.7709635496139526,
              0.7749025821685791, 0.7003988027572632, 0.4024728536605835, 0.8808536529541016,
              0.4745709300041199, 0.49941688776016235, 0.07765114307403564, 0.6195959448814392]
FMA_CASE_ROWS = [-1.015625, 0.58984375, -0.6328125, -0.8828125, -1.4140625, 1.1328125, 1.4375,
                 -0.193359375, -0.2138671875, -0.09423828125, -1.1953125, 0.6171875, 0.97265625,
                 1.453125, -0.6953125, 0.447265625]


def _designed(rows: torch.Tensor, w: torch.Tensor, top_k: int) -> None:
    """Overwrite tokens 0 (and 1) of ``rows [T*K, L]`` / ``w [T, K]`` in place.

    Token 0, weights 1.0 (so the chain adds the rows exactly until it absorbs):
      * column 0: slot 0 BIG, slot 4 -BIG, slot 8 SMALL: in order SMALL, reversed 0;
      * column 1 + a (a = 1 .. K-2): slot 0 BIG, slot a -BIG, slot a+1 SMALL: in order
        SMALL; with slots a and a+1 swapped, SMALL is absorbed by BIG and the result is 0;
      * column K: every row -0: fma(1, -0, +0) = +0 (a chain started at -0 gives -0).
    Token 1 (if any), column 0: ``FMA_CASE``, where mul-then-add differs from the FMA.
    """
    width = rows.shape[1]
    if top_k != 16 or width < 64:
        raise ValueError("the designed tokens assume top_k 16 and at least 64 columns")
    w[0] = 1.0
    r0 = torch.zeros(top_k, width)
    r0[0, 0], r0[4, 0], r0[8, 0] = BIG, -BIG, SMALL
    for a in range(1, top_k - 1):
        r0[0, 1 + a], r0[a, 1 + a], r0[a + 1, 1 + a] = BIG, -BIG, SMALL
    r0[:, top_k] = -0.0
    rows[:top_k] = r0.to(torch.bfloat16)
    if w.shape[0] > 1:
        w[1] = torch.tensor(FMA_CASE_W)
        rows[top_k:2 * top_k, 0] = torch.tensor(FMA_CASE_ROWS, dtype=torch.bfloat16)


def _inputs(tokens: int, width: int, top_k: int, seed: int, device: str):
    g = torch.Generator().manual_seed(seed)
    rows = (torch.randn(tokens * top_k, width, generator=g) * 4).to(torch.bfloat16)
    w = torch.rand(tokens, top_k, generator=g) + 0.01
    w = w / w.sum(1, keepdim=True)
    _designed(rows, w, top_k)
    return rows.to(device), w.to(device)


def _check(backend, config_name, tokens, seed, contract):
    claim = backend.claim("finalize")
    cfg = cases.config(config_name)
    rows, w = _inputs(tokens, cfg.latent, cfg.top_k, seed, backend.device)
    out = backend.finalize(rows, w).cpu()
    rows, w = rows.cpu(), w.cpu()
    names = ("token", "column")
    if claim.exact:
        contract.bitwise(out, oracle.finalize(rows, w),
                         what=f"{backend.name} finalize vs the exact FMA chain", index_names=names)
        return
    k = cfg.top_k
    products = rows.double().view(tokens, k, cfg.latent) * w.double().unsqueeze(-1)
    exact = products.sum(1)  # k exact products; float64 sum error far below the bound
    propagated = products.abs().sum(1) * (bounds.gamma(k, U32) + bounds.gamma(k, 2.0**-53))
    bound = bounds.final_rounding_bound(exact, propagated, torch.bfloat16)
    contract.bounded(out, exact, bound, what=f"{backend.name} finalize",
                     bound_name="gamma_k(2^-24) sum|w r| + BF16 half-ULP", index_names=names)


@pytest.mark.backends("reference-cuda", "stock", "fast", external=True)
@pytest.mark.parametrize("config_name", cases.STAGE_CONFIGS)
@pytest.mark.parametrize("tokens", cases.ALL_BATCHES)
def test_finalize(backend, config_name, tokens, seed, contract):
    _check(backend, config_name, tokens, seed, contract)


@pytest.mark.contract("finalize")
@pytest.mark.backends("reference")
@pytest.mark.parametrize("config_name,tokens", cases.REFERENCE_GRID)
def test_finalize_reference(backend, config_name, tokens, seed, contract):
    _check(backend, config_name, tokens, seed, contract)


def test_designed_tokens_see_every_order(contract):
    """The designed tokens have the power the contract relies on: the oracle's result
    differs from the chain in reversed order, with each adjacent pair of slots swapped, with
    the multiply rounded before the add, and from a chain started at -0."""
    cfg = cases.config("small")
    rows, w = _inputs(2, cfg.latent, cfg.top_k, 0, "cpu")
    k = cfg.top_k
    want = oracle.finalize(rows, w)
    r = rows.double().view(2, k, -1)
    wd = w.double()

    def chain(order, *, fused=True, start=0.0):
        acc = torch.full((2, r.shape[-1]), start, dtype=torch.float32)
        for j in order:
            prod = wd[:, j:j + 1] * r[:, j]
            if fused:
                acc = (prod + acc.double()).float()  # one rounding: exact here (no ties)
            else:
                acc = prod.float() + acc
        return acc.bfloat16()

    differs = {"reversed": (chain(reversed(range(k)))[0, 0] != want[0, 0]).item(),
               "mul then add": (chain(range(k), fused=False)[1, 0] != want[1, 0]).item(),
               "start at -0": (chain(range(k), start=-0.0)[0, k].view(torch.int16)
                               != want[0, k].view(torch.int16)).item()}
    for a in range(1, k - 1):
        order = list(range(k))
        order[a], order[a + 1] = order[a + 1], order[a]
        differs[f"slots {a},{a + 1} swapped"] = (chain(order)[0, 1 + a] != want[0, 1 + a]).item()
    blind = [name for name, d in differs.items() if not d]
    contract.figure("designed_orders", len(differs), worst="min")
    assert not blind, f"designed tokens do not distinguish: {blind}"
