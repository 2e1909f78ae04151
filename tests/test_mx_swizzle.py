"""The 128x4 scale layout of model.swizzle: hand-computed offsets, padding, round trips."""

from __future__ import annotations

import pytest
import torch

from model import swizzle

SHAPES = [(1, 1), (127, 3), (128, 4), (129, 5), (300, 7), (256, 8)]


def _numbered(rows: int, cols: int) -> torch.Tensor:
    """Distinct non-zero bytes where possible: 1 + (linear index mod 255)."""
    return (torch.arange(rows * cols) % 255 + 1).to(torch.uint8).reshape(rows, cols)


OFFSETS = [
    # (row, col, cols, offset)
    (0, 0, 4, 0),  # the first byte of the first tile
    (0, 1, 4, 1),  # the 4 columns of a row are adjacent
    (0, 3, 4, 3),
    (1, 0, 4, 16),  # row 1 starts after one [4][4] group: 16 bytes
    (32, 0, 4, 4),  # rows 32 apart share a 16-byte group: row 32 is the second 4 bytes
    (64, 2, 4, 10),  # 64 -> group slot 2 (8) + col 2
    (96, 3, 4, 15),  # the last slot of the first group
    (31, 0, 4, 496),  # 31 * 16
    (127, 3, 4, 511),  # the last byte of the first tile
    (0, 4, 8, 512),  # column 4 opens the second tile of the same row band
    (128, 0, 5, 1024),  # cols=5 pads to 8: two tiles per row band, so row 128 is tile 2
    (33, 5, 8, 533),  # tile (0, 1) = 512, + row 1 * 16 + group 1 * 4 + col 1
    # row band 2 of 2 tiles (cols 7 pads to 8): tile 2 * 2 + 1 = 5 -> 2560; row 300 is
    # 12 mod 32 (+192) in group 1 (+4); col 6 is 2 in its tile (+2)
    (300, 6, 7, 2758),
]


@pytest.mark.parametrize("row, col, cols, offset", OFFSETS)
def test_hand_computed_offsets(row, col, cols, offset):
    assert swizzle.scale_offset_128x4(row, col, cols) == offset
    rows = max(row + 1, 1)
    scales = torch.zeros(rows, cols, dtype=torch.uint8)
    scales[row, col] = 0xAB
    swizzled = swizzle.swizzle_scales_128x4(scales)
    assert torch.nonzero(swizzled).flatten().tolist() == [offset]


@pytest.mark.parametrize("rows, cols", SHAPES)
def test_round_trip_and_size(rows, cols):
    scales = _numbered(rows, cols)
    swizzled = swizzle.swizzle_scales_128x4(scales)
    prows, pcols = -(-rows // 128) * 128, -(-cols // 4) * 4
    assert swizzled.shape == (prows * pcols,)
    assert torch.equal(swizzle.unswizzle_scales_128x4(swizzled, rows, cols), scales)


@pytest.mark.parametrize("rows, cols", SHAPES)
def test_offset_formula_matches_swizzle_everywhere(rows, cols):
    scales = _numbered(rows, cols)
    swizzled = swizzle.swizzle_scales_128x4(scales)
    r = torch.arange(rows).unsqueeze(1).expand(rows, cols)
    c = torch.arange(cols).unsqueeze(0).expand(rows, cols)
    assert torch.equal(swizzled[swizzle.scale_offset_128x4(r, c, cols)], scales)


@pytest.mark.parametrize("rows, cols", SHAPES)
def test_padding_is_zero(rows, cols):
    # every written byte is non-zero, so the zeros are exactly the padding
    scales = torch.full((rows, cols), 0xEE, dtype=torch.uint8)
    swizzled = swizzle.swizzle_scales_128x4(scales)
    prows, pcols = -(-rows // 128) * 128, -(-cols // 4) * 4
    assert int((swizzled == 0xEE).sum()) == rows * cols
    assert int((swizzled == 0).sum()) == prows * pcols - rows * cols


@pytest.mark.parametrize("rows, cols", SHAPES)
def test_unswizzle_never_reads_padding(rows, cols):
    # poison the padding (0xFF = the E8M0 NaN code): unswizzle must not return any of it
    scales = _numbered(rows, cols)
    swizzled = swizzle.swizzle_scales_128x4(scales)
    pad = torch.ones_like(swizzled, dtype=torch.bool)
    r = torch.arange(rows).unsqueeze(1).expand(rows, cols)
    c = torch.arange(cols).unsqueeze(0).expand(rows, cols)
    pad[swizzle.scale_offset_128x4(r, c, cols).flatten()] = False
    poisoned = torch.where(pad, torch.full_like(swizzled, 0xFF), swizzled)
    assert torch.equal(swizzle.unswizzle_scales_128x4(poisoned, rows, cols), scales)


@pytest.mark.parametrize("rows, cols", SHAPES)
def test_matches_torchao_to_blocked(rows, cols):
    from torchao.prototype.mx_formats.utils import to_blocked

    scales = _numbered(rows, cols)
    assert torch.equal(swizzle.swizzle_scales_128x4(scales), to_blocked(scales))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: swizzle.swizzle_scales_128x4(torch.zeros(4, 4)), r"^scales: .*uint8"),
        (lambda: swizzle.swizzle_scales_128x4(torch.zeros(2, 4, 4, dtype=torch.uint8)), r"^scales: .*2-D"),
        (
            lambda: swizzle.unswizzle_scales_128x4(torch.zeros(100, dtype=torch.uint8), 1, 1),
            r"^swizzled: expected 512 elements",
        ),
        (lambda: swizzle.unswizzle_scales_128x4(torch.zeros(512), 1, 1), r"^swizzled: .*uint8"),
    ],
)
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
