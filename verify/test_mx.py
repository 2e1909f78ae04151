"""Contracts of the MX quantizers: every MXFP8 quantizer a schedule may use produces the
bits of the definition (RCEIL scales, round-to-nearest-even satfinite E4M3 elements, a
code-0 block as signed zeros), and the MXFP4 weights and the 128x4 scale layout are what
the GEMMs expect.

* every backend's ``quantize_mxfp8`` (stages ``quantize_mxfp8`` and
  ``quantize_mxfp8_swizzled``, which can only claim bitwise): codes and scales
  bit-identical to the oracle :mod:`verify.oracles.mx` (``ml_dtypes`` element codecs, the
  block rules written from their definition), and their exact dequantization by
  ``reference.mx`` on the backend's device equal to the oracle's. The backends:
  ``reference`` (``reference.mx``; also its 128x4 layout undone by ``model.swizzle``),
  ``reference-cuda`` (the same code on CUDA tensors), ``stock`` (torchao's ``to_mx``
  (RCEIL) on BF16 input, the library the rule is specified to match), ``fast`` (the
  project's CuTe DSL quantizer, linear and 128x4 layouts) and every external backend that
  claims the stage;
* the MXFP4 weight quantizer and the E4M3, E2M1 and E8M0 codecs of ``model.formats``
  against ``ml_dtypes``;
* FlashInfer's ``mxfp8_quantize``: a contract of its own on Blackwell only (its SM90 build
  leaves the outputs unwritten).

Widths are the config's: the latent (``latent``) and the expert intermediate
(``intermediate``), the two MXFP8 activations of the layer.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from model import formats
from model import swizzle
from reference import mx
from verify import cases
from verify.oracles import mx as oracle

WIDTHS = ("latent", "intermediate")


def _activations(tokens: int, width: int, seed: int, device: str) -> torch.Tensor:
    """BF16 rows with a realistic spread (a few outliers per row, some all-zero blocks),
    plus edge blocks in row 0: a code-0 block (``amax <= 448 * 2^-127``), a block whose
    quotient is a subnormal above ``2^-127`` (code 1), E4M3 ties, and negative zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, width, generator=g)
    x = x * torch.exp2(torch.randint(-6, 6, (tokens, width // 32, 1), generator=g)).repeat_interleave(32, 1).view(tokens, width)
    x[:, :32] = 0  # one all-zero block per row: scale code 0
    outliers = torch.randint(0, width, (tokens, 2), generator=g)
    x.scatter_(1, outliers, 300.0)
    if width >= 160:
        x[0, 32:64] = 2.0**-125 * torch.linspace(-1, 1, 32)  # code 0: signed zeros
        x[0, 64:96] = 0
        x[0, 64] = 336.0 * 2.0**-126  # quotient 1.5 * 2^-127: code 1
        x[0, 96:128] = torch.tensor([448.0, 1.0625, 1.1875, 17.0, 232.0, 248.0, -0.0,
                                     -(2.0**-11), 2.0**-10, 3 * 2.0**-10] + [0.0] * 22)
        x[0, 128:160] = -0.0
    return x.to(torch.bfloat16).to(device)


def _check(backend, config_name, width_name, tokens, seed, contract):
    backend.claim("quantize_mxfp8")  # the stage can only claim bitwise
    width = getattr(cases.config(config_name), width_name)
    x = _activations(tokens, width, seed, backend.device)
    want_codes, want_scales = oracle.quantize(x, "e4m3")
    codes, scales = backend.quantize_mxfp8(x)
    names = ("token", "column")
    contract.bitwise(scales.cpu(), want_scales, what=f"{backend.name} MXFP8 E8M0 scales",
                     index_names=names)
    contract.bitwise(codes.cpu().view(torch.uint8), want_codes,
                     what=f"{backend.name} MXFP8 E4M3 codes", index_names=names)
    got = mx.dequantize_mxfp8(codes, scales).cpu()
    contract.bitwise(got.double(), oracle.dequantize(want_codes, want_scales, "e4m3"),
                     what=f"{backend.name} MXFP8 dequantized", index_names=names)


@pytest.mark.backends("stock", "reference-cuda", "fast", external=True)
@pytest.mark.parametrize("config_name", cases.STAGE_CONFIGS)
@pytest.mark.parametrize("width_name", WIDTHS)
@pytest.mark.parametrize("tokens", cases.ALL_BATCHES)
def test_quantize_mxfp8(backend, config_name, width_name, tokens, seed, contract):
    _check(backend, config_name, width_name, tokens, seed, contract)


@pytest.mark.contract("quantize_mxfp8")
@pytest.mark.backends("reference")
@pytest.mark.parametrize("width_name", WIDTHS)
@pytest.mark.parametrize("config_name,tokens", cases.REFERENCE_GRID)
def test_quantize_mxfp8_reference(backend, config_name, width_name, tokens, seed, contract):
    _check(backend, config_name, width_name, tokens, seed, contract)


SWIZZLED_TOKENS = (1, 7, 65, 129, 256)


def _check_swizzled(backend, config_name, tokens, seed, contract):
    """The 128x4-swizzled scale layout, padding included (rows past a multiple of 128,
    scale columns past a multiple of 4), against the oracle's layout of the oracle's
    scales. Returns the oracle's linear scales."""
    backend.claim("quantize_mxfp8_swizzled")
    width = cases.config(config_name).latent
    x = _activations(tokens, width, seed, backend.device)
    want_codes, want_scales = oracle.quantize(x, "e4m3")
    codes, scales = backend.quantize_mxfp8_swizzled(x)
    contract.bitwise(codes.cpu().view(torch.uint8), want_codes,
                     what="MXFP8 codes (swizzled call)", index_names=("token", "column"))
    contract.bitwise(scales.cpu().reshape(-1), oracle.swizzle_128x4(want_scales),
                     what="MXFP8 scales, 128x4 layout")
    return scales, want_scales


@pytest.mark.backends("fast", external=True)
@pytest.mark.parametrize("config_name", cases.STAGE_CONFIGS)
@pytest.mark.parametrize("tokens", SWIZZLED_TOKENS)
def test_quantize_mxfp8_swizzled(backend, config_name, tokens, seed, contract):
    _check_swizzled(backend, config_name, tokens, seed, contract)


@pytest.mark.contract("quantize_mxfp8_swizzled")
@pytest.mark.backends("reference")
@pytest.mark.parametrize("config_name", cases.STAGE_CONFIGS)
@pytest.mark.parametrize("tokens", SWIZZLED_TOKENS)
def test_quantize_mxfp8_swizzled_reference(backend, config_name, tokens, seed, contract):
    """The same, and ``model.swizzle.unswizzle_scales_128x4`` undoes the layout."""
    scales, want_scales = _check_swizzled(backend, config_name, tokens, seed, contract)
    back = swizzle.unswizzle_scales_128x4(scales, tokens, cases.config(config_name).latent // 32)
    contract.bitwise(back, want_scales, what="128x4 layout undone")


@pytest.mark.backends("reference")
@pytest.mark.parametrize("config_name", cases.STAGE_CONFIGS)
@pytest.mark.parametrize("matrix", ("w13", "w2"))
def test_quantize_mxfp4(backend, config_name, matrix, seed, contract):
    """MXFP4 weight rows (E2M1 elements, two per byte, element ``2i`` in the low nibble;
    RCEIL scales with 6 as the element max) as the oracle quantizes and packs them, and
    their exact dequantization. Rows of one expert's ``w13`` ``[2I, L]`` or ``w2``
    ``[L, I]`` at trained magnitudes, with the E2M1 ties (0.25, 0.75, ..., 5) in row 0."""
    cfg = cases.config(config_name)
    rows, cols = (2 * cfg.intermediate, cfg.latent) if matrix == "w13" else \
        (cfg.latent, cfg.intermediate)
    rows = min(rows, 256)  # a slice of the real matrix: the rule is per row
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) / cols**0.5
    w[0, :32] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -0.0] + [0.0] * 22)
    w[1, :32] = 2.0**-126  # amax <= 6 * 2^-127: code 0, signed zeros
    packed, scales = formats.quantize_mxfp4(w)
    codes, want_scales = oracle.quantize(w, "e2m1")
    contract.bitwise(scales, want_scales, what=f"MXFP4 {matrix} scales",
                     index_names=("row", "block"))
    contract.bitwise(packed, oracle.pack_nibbles(codes), what=f"MXFP4 {matrix} packed codes",
                     index_names=("row", "byte"))
    contract.bitwise(formats.dequantize_mxfp4(packed, scales).double(),
                     oracle.dequantize(codes, want_scales, "e2m1"),
                     what=f"MXFP4 {matrix} dequantized", index_names=("row", "column"))


@pytest.mark.backends("reference")
def test_codecs_every_code(backend, contract):
    """Every E4M3 (256), E2M1 (16) and E8M0 (256) code decodes to ``ml_dtypes``' value
    (E4M3 NaN patterns as NaN; E8M0 code 255 as NaN), and every E4M3 / E2M1 value and every
    midpoint between neighbours below the format's max encodes (RNE) as ``ml_dtypes``
    encodes it."""
    nan_ok = "0 ulp; any NaN payload is a NaN (the codec has no payloads)"
    e4m3 = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = torch.from_numpy(e4m3.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32))
    contract.within_ulp(formats.e4m3_to_float32(e4m3), want, max_ulp=0, what="E4M3 decode",
                        reason=nan_ok)
    e2m1 = torch.arange(16, dtype=torch.int32).to(torch.uint8)
    want = torch.from_numpy(e2m1.numpy().view(ml_dtypes.float4_e2m1fn).astype(np.float32))
    contract.bitwise(formats.e2m1_to_float32(e2m1), want, what="E2M1 decode")
    want = torch.from_numpy(e4m3.numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float32))
    contract.within_ulp(formats.e8m0_to_float32(e4m3), want, max_ulp=0, what="E8M0 decode",
                        reason=nan_ok)
    for name, encode, kind, top in (("E4M3", formats.float32_to_e4m3, ml_dtypes.float8_e4m3fn, 448.0),
                                    ("E2M1", formats.float32_to_e2m1, ml_dtypes.float4_e2m1fn, 6.0)):
        size = 256 if name == "E4M3" else 16
        values = np.unique(np.arange(size, dtype=np.uint8).view(kind).astype(np.float64))
        values = values[np.isfinite(values) & (np.abs(values) <= top)]
        mids = (values[1:] + values[:-1]) / 2
        xs = np.concatenate([values, mids]).astype(np.float32)
        got = encode(torch.from_numpy(xs))
        got = got.view(torch.uint8) if got.dtype != torch.uint8 else got
        want = torch.from_numpy(xs.astype(kind).view(np.uint8).copy())
        contract.bitwise(got, want, what=f"{name} encode of every value and midpoint")


@pytest.mark.sm100
@pytest.mark.parametrize("tokens", (1, 16, 64, 256))
def test_flashinfer_mxfp8_quantize(tokens, seed, contract):
    """FlashInfer's mxfp8_quantize (stock, Blackwell only) against the oracle, at the real
    latent width."""
    flashinfer = pytest.importorskip("flashinfer", reason="FlashInfer is not installed")
    x = _activations(tokens, cases.config("kimi_k3").latent, seed, "cuda")
    codes, scales = flashinfer.mxfp8_quantize(x, is_sf_swizzled_layout=False)
    want_codes, want_scales = oracle.quantize(x, "e4m3")
    contract.bitwise(codes.cpu().view(torch.uint8), want_codes, what="FlashInfer MXFP8 codes")
    contract.bitwise(scales.cpu().view(torch.uint8).reshape(want_scales.shape), want_scales,
                     what="FlashInfer MXFP8 scales")
