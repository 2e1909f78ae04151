"""The 128x4 tiled layout of E8M0 scales that the block-scaled GEMMs read.

Linear scales ``[M, K // 32]`` (``model.formats``, ``reference.mx``) are padded to 128 rows
and 4 columns and cut into 128x4 tiles of 512 bytes; the layout of cuBLAS, cuDNN,
FlashInfer and the tcgen05 scale-factor atom (``docs/numerics.md`` draws it). Pure PyTorch,
on any device; a permutation of bytes, so nothing is rounded.
"""

from __future__ import annotations

import torch

from model.formats import check_dtype

__all__ = ["scale_offset_128x4", "swizzle_scales_128x4", "unswizzle_scales_128x4"]


def _ceil_to(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def scale_offset_128x4(row, col, cols: int):
    """Byte offset of scale ``[row, col]`` in the 128x4 swizzled layout.

    ``cols`` is the unpadded number of scale columns (``K // 32``). With
    ``n_col_tiles = ceil(cols / 4)``::

        offset = ((row // 128) * n_col_tiles + col // 4) * 512
                 + (row % 32) * 16 + ((row % 128) // 32) * 4 + col % 4

    Works on Python ints or integer tensors.
    """
    n_col_tiles = _ceil_to(cols, 4) // 4
    return (
        ((row // 128) * n_col_tiles + col // 4) * 512
        + (row % 32) * 16
        + ((row % 128) // 32) * 4
        + col % 4
    )


def swizzle_scales_128x4(scales: torch.Tensor) -> torch.Tensor:
    """Linear ``[M, K // 32]`` E8M0 scales to the 128x4 tiled layout of the block-scaled GEMMs.

    The layout of cuBLAS ("1D block scaling factors layout",
    https://docs.nvidia.com/cuda/cublas/#d-block-scaling-factors-layout), cuDNN
    ("MXFP8 scale factor 128x4 layout") and FlashInfer (``SfLayout.layout_128x4``, the
    ``is_sf_swizzled_layout=True`` output of ``mxfp8_quantize``). Rows are padded to a
    multiple of 128 and columns to a multiple of 4, padding filled with 0; the padded
    matrix is cut into 128x4 tiles stored row-major over tiles (512 bytes each), and
    inside a tile scale ``[32 g + i, j]`` (``i < 32``, ``g < 4``, ``j < 4``) sits at
    ``i * 16 + g * 4 + j`` -- a ``[32][4][4]`` array. See
    ``scale_offset_128x4`` for the full offset.

    Args:
        scales: uint8 ``[M, K // 32]``.

    Returns:
        uint8, 1-D, ``ceil(M/128)*128 * ceil((K//32)/4)*4`` bytes.
    """
    check_dtype(scales, "scales", (torch.uint8,), "uint8 (E8M0 codes)")
    if scales.dim() != 2:
        raise ValueError(f"scales: expected a 2-D [M, K // 32] tensor, got shape {tuple(scales.shape)}")
    rows, cols = scales.shape
    prows, pcols = _ceil_to(rows, 128), _ceil_to(cols, 4)
    padded = torch.zeros(prows, pcols, dtype=torch.uint8, device=scales.device)
    padded[:rows, :cols] = scales
    # row = 128 rt + 32 g + i, col = 4 ct + j  ->  order [rt, ct, i, g, j]
    tiles = padded.view(prows // 128, 4, 32, pcols // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1)


def unswizzle_scales_128x4(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of ``swizzle_scales_128x4``.

    Args:
        swizzled: uint8 with ``ceil(rows/128)*128 * ceil(cols/4)*4`` elements (any shape;
            read in memory order).
        rows: M, the unpadded number of scale rows.
        cols: K // 32, the unpadded number of scale columns.

    Returns:
        uint8 ``[rows, cols]`` (padding dropped).
    """
    check_dtype(swizzled, "swizzled", (torch.uint8,), "uint8 (E8M0 codes)")
    if rows < 0 or cols < 0:
        raise ValueError(f"rows, cols: expected non-negative sizes, got {rows}, {cols}")
    prows, pcols = _ceil_to(rows, 128), _ceil_to(cols, 4)
    if swizzled.numel() != prows * pcols:
        raise ValueError(
            f"swizzled: expected {prows * pcols} elements ({prows} x {pcols} padded), "
            f"got {swizzled.numel()} (shape {tuple(swizzled.shape)})"
        )
    tiles = swizzled.reshape(prows // 128, pcols // 4, 32, 4, 4)  # [rt, ct, i, g, j]
    padded = tiles.permute(0, 3, 2, 1, 4).reshape(prows, pcols)  # [rt, g, i, ct, j]
    return padded[:rows, :cols].contiguous()
