"""Contracts of the MX quantizers (DESIGN §2): every MXFP8 quantizer that a schedule may use
produces the reference's bits (RCEIL scales, RNE satfinite E4M3 elements).

Backends: ``stock`` is torchao's ``to_mx`` (RCEIL) on BF16 input — the library the
reference rule is specified to match; ``fast`` is the project's CuTe DSL quantizer;
``reference-cuda`` the reference code on CUDA tensors. FlashInfer's ``mxfp8_quantize`` is a
contract of its own on Blackwell only (its SM90 build is empty: DESIGN §2).
"""

from __future__ import annotations

import pytest
import torch

from reference import mx
from verify import cases

WIDTHS = {"latent": 512, "intermediate": 1024, "real_latent": 3584}


def _activations(tokens: int, width: int, seed: int, device: str) -> torch.Tensor:
    """BF16 rows with a realistic spread (a few outliers per row, some all-zero blocks)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, width, generator=g)
    x = x * torch.exp2(torch.randint(-6, 6, (tokens, width // 32, 1), generator=g)).repeat_interleave(32, 1).view(tokens, width)
    x[:, :32] = 0  # one all-zero block per row: scale code 0
    outliers = torch.randint(0, width, (tokens, 2), generator=g)
    x.scatter_(1, outliers, 300.0)
    return x.to(torch.bfloat16).to(device)


def _fast_quantize(x, swizzled):
    from fast import mx as fast_mx

    return fast_mx.quantize_mxfp8(x, swizzled=swizzled)


def _stock_quantize(x):
    pytest.importorskip("torchao", reason="the stock MXFP8 quantizer here is torchao's "
                        "to_mx; torchao is not installed on this machine")
    from torchao.prototype.mx_formats.mx_tensor import ScaleCalculationMode, to_mx

    scales, data = to_mx(x.contiguous(), torch.float8_e4m3fn, 32,
                         scaling_mode=ScaleCalculationMode.RCEIL)
    return data.view(x.shape), scales.view(torch.uint8).view(*x.shape[:-1], -1)


@pytest.mark.backends("stock", "reference-cuda", "fast")
@pytest.mark.parametrize("width", list(WIDTHS), ids=str)
@pytest.mark.parametrize("tokens", cases.ALL_BATCHES)
def test_quantize_mxfp8(backend, width, tokens, seed, contract):
    """codes and E8M0 scales (linear layout) bit-identical to reference.mx.quantize_mxfp8."""
    x = _activations(tokens, WIDTHS[width], seed, backend.device)
    ref_codes, ref_scales = mx.quantize_mxfp8(x.cpu())
    if backend.name == "stock":
        codes, scales = _stock_quantize(x)
    elif backend.name == "fast":
        codes, scales = _fast_quantize(x, swizzled=False)
    else:
        codes, scales = mx.quantize_mxfp8(x)
    names = ("token", "column")
    contract.bitwise(scales.cpu(), ref_scales, what="MXFP8 E8M0 scales", index_names=names)
    contract.bitwise(codes.cpu(), ref_codes, what="MXFP8 E4M3 codes", index_names=names)


@pytest.mark.backends("fast")
@pytest.mark.parametrize("tokens", cases.ALL_BATCHES)
def test_quantize_mxfp8_swizzled(backend, tokens, seed, contract):
    """The 128x4-swizzled scale layout equals reference.mx.swizzle_scales_128x4 of the
    reference scales, padding included."""
    x = _activations(tokens, WIDTHS["real_latent"], seed, backend.device)
    ref_codes, ref_scales = mx.quantize_mxfp8(x.cpu())
    codes, scales = _fast_quantize(x, swizzled=True)
    contract.bitwise(codes.cpu(), ref_codes, what="MXFP8 codes (swizzled call)",
                     index_names=("token", "column"))
    expected = mx.swizzle_scales_128x4(ref_scales)
    contract.bitwise(scales.cpu().reshape(expected.shape), expected,
                     what="MXFP8 scales, 128x4 layout")


@pytest.mark.sm100
@pytest.mark.parametrize("tokens", (1, 16, 64, 256))
def test_flashinfer_mxfp8_quantize(tokens, seed, contract):
    """FlashInfer's mxfp8_quantize (stock, Blackwell only) against the reference."""
    flashinfer = pytest.importorskip("flashinfer", reason="FlashInfer is not installed")
    x = _activations(tokens, WIDTHS["real_latent"], seed, "cuda")
    codes, scales = flashinfer.mxfp8_quantize(x, is_sf_swizzled_layout=False)
    ref_codes, ref_scales = mx.quantize_mxfp8(x.cpu())
    contract.bitwise(codes.cpu().view(torch.float8_e4m3fn), ref_codes,
                     what="FlashInfer MXFP8 codes")
    contract.bitwise(scales.cpu().view(torch.uint8).reshape(ref_scales.shape), ref_scales,
                     what="FlashInfer MXFP8 scales")
