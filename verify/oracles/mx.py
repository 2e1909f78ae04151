"""MX formats from their definition, with ``ml_dtypes`` as the element codec.

The element conversions are ``ml_dtypes``' (``float8_e4m3fn``, ``float4_e2m1fn``,
``float8_e8m0fnu``: round to nearest even, gradual underflow); the block rules are written
here from the OCP MX v1.0 definition and the stock NVIDIA RCEIL rule, with Python
arithmetic (``math.frexp``), not from ``model.formats``' bit manipulations:

* scale: ``q = fp32(amax / max_elem)`` (an IEEE FP32 division); the code is the smallest
  ``c`` in ``[0, 254]`` with ``2^(c - 127) >= q`` (so ``q <= 2^-127``, zero included, gives 0);
* elements: ``x * 2^(127 - c)`` in float64 (exact), except that a code-0 block is scaled
  by 1 (the stock convention: such a block becomes signed zeros), clamped to
  ``±max_elem`` (``ml_dtypes`` would turn a value above E4M3's 464 midpoint into NaN; the
  stock conversions saturate), converted by ``ml_dtypes``;
* MXFP4 packing: element ``2i`` in the low nibble of byte ``i``;
* the 128x4 scale layout: scale ``[r, c]`` of an ``[M, C]`` matrix sits in tile
  ``(r // 128, c // 4)`` (tiles row-major, ``ceil(C / 4)`` per tile row, 512 bytes each),
  inside it at ``[r % 32][(r % 128) // 32][c % 4]`` of a ``[32][4][4]`` array; padding 0
  (cuBLAS, "1D block scaling factors layout").
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import torch

__all__ = [
    "BLOCK",
    "quantize",
    "dequantize",
    "pack_nibbles",
    "unpack_nibbles",
    "swizzle_128x4",
    "ELEMENTS",
]

BLOCK = 32

#: element name -> (ml_dtypes type, largest magnitude)
ELEMENTS = {
    "e4m3": (ml_dtypes.float8_e4m3fn, 448.0),
    "e2m1": (ml_dtypes.float4_e2m1fn, 6.0),
}


def _scale_code(q: float) -> int:
    """Smallest ``c`` in [0, 254] with ``2^(c - 127) >= q`` (``q >= 0``)."""
    if q == 0:
        return 0
    m, e = math.frexp(q)  # q = m 2^e, 0.5 <= m < 1
    ceil_log2 = e - 1 if m == 0.5 else e
    return min(max(ceil_log2 + 127, 0), 254)


def quantize(x: torch.Tensor, element: str) -> tuple[torch.Tensor, torch.Tensor]:
    """MX quantization (RCEIL) of ``x [..., K]`` (BF16/FP16/FP32, finite).

    Returns ``(codes uint8 [..., K], scales uint8 [..., K // 32])``: one element code per
    byte (E4M3 bit patterns, or E2M1 codes 0..15), E8M0 scale codes, linear layout.
    """
    kind, emax = ELEMENTS[element]
    *lead, k = x.shape
    xs = x.detach().cpu().to(torch.float32).numpy().reshape(-1, k // BLOCK, BLOCK)
    amax = np.abs(xs).max(axis=-1)
    q = amax / np.float32(emax)  # IEEE FP32 division, numpy keeps subnormals
    codes = np.vectorize(_scale_code, otypes=[np.int64])(q.astype(np.float64))
    multiplier = np.where(codes == 0, 1.0, np.ldexp(1.0, 127 - codes))
    v = np.clip(xs.astype(np.float64) * multiplier[..., None], -emax, emax)
    elements = v.astype(np.float32).astype(kind).view(np.uint8)
    return (torch.from_numpy(elements.reshape(*lead, k).copy()),
            torch.from_numpy(codes.astype(np.uint8).reshape(*lead, k // BLOCK)))


def dequantize(codes: torch.Tensor, scales: torch.Tensor, element: str) -> torch.Tensor:
    """float64 ``[..., K]``: each decoded element times ``2^(scale - 127)`` (exact)."""
    kind, _ = ELEMENTS[element]
    c = codes.detach().cpu().contiguous().view(torch.uint8).numpy()
    values = c.view(kind).astype(np.float64) if element == "e4m3" else \
        (c & 0x0F).view(kind).astype(np.float64)
    s = scales.detach().cpu().numpy().astype(np.float64)
    scale = np.where(s == 255, np.nan, np.ldexp(1.0, s.astype(np.int64) - 127))
    *lead, k = values.shape
    out = values.reshape(*lead, k // BLOCK, BLOCK) * scale[..., None]
    return torch.from_numpy(out.reshape(*lead, k))


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes [..., K] -> bytes [..., K // 2], element ``2i`` in the low nibble."""
    c = codes.numpy().astype(np.uint16)
    return torch.from_numpy((c[..., 0::2] + 16 * c[..., 1::2]).astype(np.uint8))


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`."""
    p = packed.detach().cpu().numpy()
    out = np.empty((*p.shape[:-1], 2 * p.shape[-1]), dtype=np.uint8)
    out[..., 0::2] = p % 16
    out[..., 1::2] = p // 16
    return torch.from_numpy(out)


def swizzle_128x4(scales: torch.Tensor) -> torch.Tensor:
    """Linear ``[M, C]`` scales in the 128x4 layout (1-D, padded with zeros)."""
    s = scales.detach().cpu().numpy()
    rows, cols = s.shape
    tiles_r, tiles_c = -(-rows // 128), -(-cols // 4)
    out = np.zeros(tiles_r * tiles_c * 512, dtype=np.uint8)
    r = np.arange(rows)[:, None]
    c = np.arange(cols)[None, :]
    tile = (r // 128) * tiles_c + c // 4
    inside = (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    out[(tile * 512 + inside).reshape(-1)] = s.reshape(-1)
    return torch.from_numpy(out)
