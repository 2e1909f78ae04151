"""Contracts of the stock order (S0)'s dense GEMMs.

Every GEMM of the layer has BF16 operands and FP32 accumulation, one rounding at the end.

* ``stock`` (cuBLAS / CPU BLAS through ``fast.stock``): within ``gamma_K(2^-24) * |A| |B|^T``
  plus the final rounding of the float64 product (``verify.bounds.matmul_*_out_bound``);
  the observed worst ratio |diff| / bound is reported per row.
* ``reference`` (``reference.gemm``, the model every reference stage uses: float64
  accumulation, one rounding): bit-identical to the exact sum rounded once
  (:func:`verify.oracles.stages.matmul` / ``addmm`` / ``split_k_matmul``), except where
  the exact sum lies so close to a rounding boundary that a float64 accumulation may land on
  either side (``ambiguous``, reported; none is expected at these sizes), and on designed
  rows where a second rounding (through FP32 on the way to BF16, or of the product before
  the add) changes the result.

The whole S0 layer of a backend that runs it (stage ``layer_stock``; ``stock`` builds it
from its ops): ``verify.layers``.
"""

from __future__ import annotations

import pytest
import torch

from fast import stock
from reference import gemm
from reference.gemm import addmm
from verify import bounds, cases, compare
from verify.layers import check_layer
from verify.oracles import stages as oracle

GEMM_BOUND = bounds.ANY_ORDER_GEMM_BOUND
TOKENS = ("token", "column")


def _model(config_name: str, backend):
    if config_name == "kimi_k3" and backend.name == "reference":
        pytest.skip("the reference backend runs on the CPU, where the real dimensions' float64 "
                    "GEMMs take minutes; its GEMM code is checked at small (one code path)")
    if config_name == "kimi_k3" and backend.device == "cpu":
        pytest.skip("the real dimensions run on a GPU only (their float64 GEMMs and bounds "
                    "take minutes on a CPU)")
    return cases.config(config_name), cases.dense_weights(config_name, backend.device)


def _check_reference(contract, got, want, *, what):
    """``got`` (reference.gemm) equals the oracle's single rounding ``want`` (a
    ``RoundedDot``) bit for bit, except at its ambiguous elements (either rounding)."""
    contract.bitwise(got.cpu(), want.accept_float64_model(got.cpu()), what=what,
                     index_names=TOKENS)
    contract.figure("ambiguous_sums", int(want.ambiguous.sum()), worst="max")


CONFIG_NAMES = pytest.mark.parametrize("config_name", ["small", "kimi_k3"])


def _check_gemm(contract, out, a, b, *, what):
    """``out`` (BF16 or FP32 ``a @ b^T``) within the FP32-accumulation bound of the
    float64 product, plus the output rounding for a BF16 result."""
    make = bounds.matmul_bf16_out_bound if out.dtype == torch.bfloat16 else \
        bounds.matmul_fp32_out_bound
    rounding = bounds.gemm_accum_rounding(out.device)
    contract.bounded(out, bounds.reference_matmul(a, b), make(a, b, accum_rounding=rounding),
                     what=what,
                     bound_name=GEMM_BOUND, index_names=TOKENS)


@pytest.mark.backends("stock", "reference")
@CONFIG_NAMES
@pytest.mark.parametrize("tokens", cases.ALL_BATCHES)
def test_front_gemm(backend, config_name, tokens, seed, contract):
    """front = x @ [shared gate_up ; latent down]^T, BF16 out (one packed weight)."""
    cfg, w = _model(config_name, backend)
    x = cases.hidden_rows(cfg, tokens, seed, backend.device)
    if backend.name == "reference":
        _check_reference(contract, gemm.matmul(x, w.front, out_dtype=torch.bfloat16),
                         oracle.matmul(x, w.front, torch.bfloat16), what="reference front GEMM")
        return
    _check_gemm(contract, stock.mm_bf16(x, w.front), x, w.front, what="front GEMM")


@pytest.mark.backends("stock", "reference")
@CONFIG_NAMES
@pytest.mark.parametrize("tokens", cases.ALL_BATCHES)
def test_router_gemm(backend, config_name, tokens, seed, contract):
    """logits = x @ gate^T, FP32 out."""
    cfg, w = _model(config_name, backend)
    x = cases.hidden_rows(cfg, tokens, seed, backend.device)
    if backend.name == "reference":
        _check_reference(contract, gemm.matmul(x, w.gate, out_dtype=torch.float32),
                         oracle.matmul(x, w.gate, torch.float32), what="reference router GEMM")
        return
    _check_gemm(contract, stock.mm_fp32_out(x, w.gate), x, w.gate, what="router logits")


@pytest.mark.backends("stock", "reference")
@CONFIG_NAMES
@pytest.mark.parametrize("tokens", cases.ALL_BATCHES)
def test_shared_down_gemm(backend, config_name, tokens, seed, contract):
    """shared = situ(front[:, :2S]) @ shared_down^T, BF16 out (input: random BF16 rows of
    the activation's range)."""
    cfg, w = _model(config_name, backend)
    g = torch.Generator().manual_seed(seed)
    act = (torch.randn(tokens, cfg.shared_intermediate, generator=g) * 0.5)
    act = act.to(torch.bfloat16).to(backend.device)
    if backend.name == "reference":
        _check_reference(contract, gemm.matmul(act, w.shared_down, out_dtype=torch.bfloat16),
                         oracle.matmul(act, w.shared_down, torch.bfloat16),
                         what="reference shared down GEMM")
        return
    _check_gemm(contract, stock.mm_bf16(act, w.shared_down), act, w.shared_down, what="shared down GEMM")


@pytest.mark.backends("stock", "reference")
@CONFIG_NAMES
@pytest.mark.parametrize("tokens", cases.ALL_BATCHES)
def test_up_addmm(backend, config_name, tokens, seed, contract):
    """out = shared + normed @ up^T (``torch.addmm``, beta = 1).

    The layer defines this as one rounding (``reference.gemm.addmm``, which the
    ``reference`` backend checks against the exact sum); on the H200, cuBLAS's BF16 ``addmm`` equals
    ``bf16(bf16(normed @ up^T) + shared)`` bit for bit (measured: e.g. 2.1 M of 7.3 M
    outputs differ from the one-rounding value at [1024, 7168]), i.e. the product is
    rounded to BF16 before the add. The bound is therefore the two-rounding one: the
    BF16-out GEMM bound of the product, carried through the final BF16 rounding of the
    sum. The share of outputs that differ from the one-rounding reference
    (``reference.gemm.addmm``) is reported as a figure."""
    cfg, w = _model(config_name, backend)
    g = torch.Generator().manual_seed(seed)
    normed = torch.randn(tokens, cfg.latent, generator=g).to(torch.bfloat16)
    shared = torch.randn(tokens, cfg.hidden, generator=g).to(torch.bfloat16)
    normed, shared = normed.to(backend.device), shared.to(backend.device)
    if backend.name == "reference":
        _check_reference(contract, addmm(shared, normed, w.up), oracle.addmm(shared, normed, w.up),
                         what="reference up addmm (one rounding)")
        return
    out = stock.addmm_bf16(shared, normed, w.up)
    exact = bounds.reference_matmul(normed, w.up) + shared.double()
    product_bound = bounds.matmul_bf16_out_bound(
        normed, w.up, accum_rounding=bounds.gemm_accum_rounding(out.device))
    bound = bounds.final_rounding_bound(exact, product_bound, torch.bfloat16)
    contract.bounded(out, exact, bound, what="up addmm",
                     bound_name=GEMM_BOUND + ", then the BF16 add (two roundings)",
                     index_names=TOKENS)
    if config_name == "small":
        one = addmm(shared.cpu(), normed.cpu(), w.up.cpu())
        off = (compare.ulp_distance(out.cpu(), one) > 0).double().mean().item()
        contract.figure("off_one_rounding_fraction", off, worst="max")


@pytest.mark.backends("reference")
@pytest.mark.parametrize("splits", (2, 4))
@pytest.mark.parametrize("tokens", (1, 7, 64))
def test_split_k_gemm(backend, splits, tokens, seed, contract):
    """``reference.gemm.split_k_matmul`` (the S1 tactics' order: each split's sum rounded
    to FP32, the splits added in FP32 in order, one final rounding) against the oracle of
    that order, FP32 (router) and BF16 (front) out."""
    cfg, w = cases.config("small"), cases.dense_weights("small")
    x = cases.hidden_rows(cfg, tokens, seed)
    for weight, out_dtype, what in ((w.gate, torch.float32, "router"),
                                    (w.front, torch.bfloat16, "front")):
        got = gemm.split_k_matmul(x, weight, splits=splits, out_dtype=out_dtype)
        want = oracle.split_k_matmul(x, weight, splits=splits, out_dtype=out_dtype)
        contract.bitwise(got, torch.where(want.ambiguous, got, want.value),
                         what=f"reference {what} split-K {splits}", index_names=TOKENS)
        contract.figure("ambiguous_sums", int(want.ambiguous.sum()), worst="max")


@pytest.mark.backends("reference")
def test_gemm_rounding_designed(backend, contract):
    """Rows whose exact sum lies just above a BF16 midpoint: one rounding gives the value
    above; a second rounding (the sum rounded to FP32 first, or the product rounded to BF16
    before the addend) lands on the midpoint and ties to even, below. Both the BF16-out
    GEMM and the addmm must round once."""
    mid = 2.0**-8  # 1 + 2^-8 is the midpoint of 1 and 1 + 2^-7
    a = torch.tensor([[1.0, mid, 2.0**-30], [-1.0, -mid, -(2.0**-30)],
                      [2.0**10, 2.0**2, 2.0**-20]]).to(torch.bfloat16)
    b = torch.ones(2, 3, dtype=torch.bfloat16)
    want = oracle.matmul(a, b, torch.bfloat16)
    assert want.value[0, 0].item() == 1 + 2.0**-7, "the designed row lost its meaning"
    got = gemm.matmul(a, b, out_dtype=torch.bfloat16)
    contract.bitwise(got, want.value, what="BF16-out GEMM of designed rows", index_names=TOKENS)
    c = torch.tensor([[1.0, -1.0]], dtype=torch.bfloat16)
    a2 = torch.tensor([[mid, 2.0**-30]], dtype=torch.bfloat16)
    b2 = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=torch.bfloat16)
    want = oracle.addmm(c, a2, b2)
    assert want.value[0, 0].item() == 1 + 2.0**-7, "the designed addmm lost its meaning"
    contract.bitwise(addmm(c, a2, b2), want.value, what="addmm of designed rows",
                     index_names=TOKENS)


@pytest.mark.backends("stock", external=True)
@pytest.mark.config("small")
@pytest.mark.parametrize("tokens", (1, 16, 64, 256))
def test_layer_stock(backend, tokens, seed, contract):
    """A backend's whole S0 layer (``verify.layers``)."""
    check_layer(contract, backend, "stock", 1, tokens, seed)


#: The BF16-output GEMMs the batch-invariant stock modes run on cuBLASLt without split-K
#: (``DenseFront(gemm="invariant_stock")``, ``WideLayer(invariant_gemms="stock")``), by
#: schedule: the DEP rank's at every T = 1..64, the TP8 rank's at every row count 65..1024.
NO_SPLIT_K_GEMMS = ("dep.front", "dep.shared_down", "dep.up",
                    "tp8.shared_gate_up", "tp8.shared_down", "tp8.up")


def _no_split_k_case(config, name: str):
    """(weight shape ``(N, K)``, row counts, whether the call is ``addmm``) of one of
    ``NO_SPLIT_K_GEMMS`` at the real dimensions."""
    from fast.schedules import dense, wide_gemms

    schedule, gemm_name = name.split(".")
    if schedule == "dep":
        return dense.gemm_shapes(config)[gemm_name], range(1, 65), gemm_name == "up"
    return (wide_gemms.gemm_shapes(config, 8)[gemm_name], range(config.front_max + 1, 1025),
            gemm_name == "up")


@pytest.mark.backends("stock")
@pytest.mark.config("kimi_k3")
@pytest.mark.parametrize("name", NO_SPLIT_K_GEMMS)
def test_stock_no_split_k_batch_invariant(backend, name, seed, contract):
    """``fast.stock.mm_bf16`` / ``addmm_bf16`` with ``split_k=False`` (cuBLASLt, split-K
    forbidden) at the real dimensions: at every row count the schedule serves, every row
    bitwise its row in the largest call, on operands of a wide dynamic range (each K column
    scaled by a power of two in 2^-8..2^8, so another summation order shows in BF16 too).
    cuBLAS documents no such property; the batch-invariant stock modes rest on it, so each
    node checks it here. The largest call is also within the cuBLAS bound."""
    if backend.device != "cuda":
        pytest.skip("split_k=False is cuBLASLt's flag; the CPU BLAS is not what the stock "
                    "invariant modes run")
    cfg = cases.config("kimi_k3")
    (n, k), rows, is_addmm = _no_split_k_case(cfg, name)
    top = max(rows)
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, generator=g, device="cuda").to(torch.bfloat16)
    scale = torch.exp2(torch.randint(-8, 9, (k,), generator=g, device="cuda").float())
    a = (torch.randn(top, k, generator=g, device="cuda") * scale).to(torch.bfloat16)
    c = torch.randn(top, n, generator=g, device="cuda").to(torch.bfloat16) if is_addmm else None

    def call(m):
        if is_addmm:
            return stock.addmm_bf16(c[:m], a[:m], w, split_k=False)
        return stock.mm_bf16(a[:m], w, split_k=False)

    want = call(top)
    bad = [m for m in rows if not torch.equal(call(m).view(torch.int16), want[:m].view(torch.int16))]
    shown = bad[0] if bad else min(rows)
    contract.bitwise(call(shown).cpu(), want[:shown].cpu(), index_names=TOKENS,
                     what=f"{name} without split-K: rows at M={shown} vs the same rows at "
                          f"M={top} (row counts with other rows: {bad[:12]}, {len(bad)} of "
                          f"{len(rows)})")
    if is_addmm:
        exact = bounds.reference_matmul(a, w) + c.double()
        product = bounds.matmul_bf16_out_bound(a, w, accum_rounding=bounds.gemm_accum_rounding(want.device))
        contract.bounded(want, exact, bounds.final_rounding_bound(exact, product, torch.bfloat16),
                         what=f"{name} without split-K", index_names=TOKENS,
                         bound_name=GEMM_BOUND + ", then the BF16 add (two roundings)")
    else:
        _check_gemm(contract, want, a, w, what=f"{name} without split-K")
