"""The MXFP8 (reference.mx) and MXFP4 (model.formats) quantizers: golden blocks, torchao
cross-checks, bad input.

Every golden line is a whole 32-element block: the listed leading values, then zeros.
"""

from __future__ import annotations


import pytest
import torch

from model import formats
from model.formats import ScaleRule
from reference import mx

RCEIL, FLOOR = ScaleRule.RCEIL, ScaleRule.FLOOR


def block(*values, dtype=torch.float32) -> torch.Tensor:
    """[1, 32]: ``values`` then zeros."""
    x = torch.zeros(1, 32, dtype=torch.float32)
    x[0, : len(values)] = torch.tensor(values, dtype=torch.float32)
    assert torch.equal(x.to(dtype).to(torch.float32), x), "golden value not exact in dtype"
    return x.to(dtype)


def q8(x, rule=RCEIL):
    codes, scales = mx.quantize_mxfp8(x, scale_rule=rule)
    return codes.view(torch.uint8)[0].tolist(), int(scales[0, 0])


def q4(x, rule=RCEIL):
    packed, scales = formats.quantize_mxfp4(x, scale_rule=rule)
    return formats.unpack_e2m1(packed)[0].tolist(), int(scales[0, 0])


def pad(codes, n=32):
    return list(codes) + [0] * (n - len(codes))


# ------------------------------------------------------------------ golden blocks: MXFP8

MXFP8_GOLDEN = [
    # (rule, leading values, expected leading element codes, expected scale code)
    # amax = 448 * 2^3: q = 8 exactly, scale 2^3 (code 130); 448 -> 0x7E, 1/8 = 2^-3 -> 0x20
    (RCEIL, (448.0 * 8, 1.0), (0x7E, 0x20), 130),
    # amax = 450 * 8 (next BF16 above 448 * 8): q = 8.04 rounds up to 2^4 (code 131);
    # 3600 / 16 = 225 is between 224 and 240 (spacing 16): 224 = 0x76
    (RCEIL, (450.0 * 8,), (0x76,), 131),
    # amax = 1: q = 1/448 = 2^-8.8, ceil -> 2^-8 (code 119); element 2^8 = 256 -> 0x78
    (RCEIL, (1.0,), (0x78,), 119),
    # the codec's RNE cases inside a scale-1 block (amax 448, code 127): 1.0625 -> 1.0,
    # 1.1875 -> 1.25, 17 -> 16, 232 -> 224, 248 -> 256, -0 -> 0x80, -2^-11 -> -0,
    # 2^-10 -> 0 (tie to even), 3 * 2^-10 -> 2^-8
    (
        RCEIL,
        (448.0, 1.0625, 1.1875, 17.0, 232.0, 248.0, -0.0, -(2.0**-11), 2.0**-10, 3 * 2.0**-10),
        (0x7E, 0x38, 0x3A, 0x58, 0x76, 0x78, 0x80, 0x80, 0x00, 0x02),
        127,
    ),
    # all-zero block: scale code 0 (2^-127) and zero elements
    (RCEIL, (), (), 0),
    # negative zeros keep their sign bit; amax 0 -> code 0
    (RCEIL, (-0.0, -0.0), (0x80, 0x80), 0),
    # amax = 2^-120 <= 448 * 2^-127: q = 2^-128.8 -> code 0; the stock convention multiplies
    # code-0 blocks by 1, so the block flushes to signed zeros
    (RCEIL, (2.0**-120, -(2.0**-121)), (0x00, 0x80), 0),
    # the same block under FLOOR: floor(log2 amax) - 8 = -128 clamps to -127 (code 0) and
    # the elements are x * 2^127: 128 -> 0x70, -64 -> 0xE8
    (FLOOR, (2.0**-120, -(2.0**-121)), (0x70, 0xE8), 0),
    # q = 336 * 2^-126 / 448 = 1.5 * 2^-127, an FP32 subnormal above 2^-127: code 1;
    # element 336 is halfway between 320 (0x7A, even) and 352 (0x7B): 320
    (RCEIL, (336.0 * 2.0**-126,), (0x7A,), 1),
    # subnormal inputs (FP32 and BF16): 2^-130 next to 448 rounds to 0
    (RCEIL, (448.0, 2.0**-130), (0x7E, 0x00), 127),
    # a block of subnormals: q <= 2^-127, code 0, flushed to signed zeros
    (RCEIL, (2.0**-130, -3 * 2.0**-129), (0x00, 0x80), 0),
    # the same under FLOOR: e = -127 (code 0), x * 2^127: 2^-3 (0x20), -1.5 * 2^-1 (0xB4)
    (FLOOR, (2.0**-130, -3 * 2.0**-129), (0x20, 0xB4), 0),
    # x = 1.9375 * 2^127 (FP32 and BF16): q = 2^119.2 -> code 247; element 248 is the
    # 240/256 tie -> 256 (0x78); it dequantizes to 2^128 = +Inf (see test below)
    (RCEIL, (1.9375 * 2.0**127,), (0x78,), 247),
    # FLOOR: amax 500 -> e = 8 - 8 = 0 (code 127); 500 > 448 saturates to 0x7E
    (FLOOR, (500.0, 1.0), (0x7E, 0x38), 127),
    # FLOOR: amax 255 -> e = 7 - 8 = -1 (code 126); 510 saturates to 0x7E, -1 -> -2 = 0xC0
    (FLOOR, (255.0, -1.0), (0x7E, 0xC0), 126),
    # FLOOR: amax exactly 448 * 2^3 -> e = 11 - 8 = 3, same code as RCEIL
    (FLOOR, (448.0 * 8, 1.0), (0x7E, 0x20), 130),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rule, values, codes, scale", MXFP8_GOLDEN)
def test_mxfp8_golden(rule, values, codes, scale, dtype):
    assert q8(block(*values, dtype=dtype), rule) == (pad(codes), scale)


MXFP4_GOLDEN = [
    # amax = 6 * 2^2: q = 4, scale code 129; 24 -> 6 (0x7), 1/4 = 0.25 ties to 0
    (RCEIL, (24.0, 1.0), (0x7, 0x0), 129),
    # scale 1 (amax 6): 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0,
    # 3.5 -> 4.0, 5 -> 4.0, -0.75 -> -1.0 (0xA), -0 -> 0x8
    (
        RCEIL,
        (6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -0.0),
        (0x7, 0x0, 0x2, 0x2, 0x4, 0x4, 0x6, 0x6, 0xA, 0x8),
        127,
    ),
    # amax = 6.0625 just above 6: q = 1.0104 rounds up to 2 (code 128); 3.03 -> 3 (0x5)
    (RCEIL, (6.0625,), (0x5,), 128),
    # amax = 2^-126 <= 6 * 2^-127: code 0, flushed to zeros
    (RCEIL, (2.0**-126, -(2.0**-127)), (0x0, 0x8), 0),
    # all-zero block
    (RCEIL, (), (), 0),
    # FLOOR: amax 7 -> e = 2 - 2 = 0 (code 127); 7 saturates to 6 (0x7)
    (FLOOR, (7.0, 1.0), (0x7, 0x2), 127),
    # FLOOR: amax 3.5 -> e = 1 - 2 = -1 (code 126); 7 saturates to 6, 0.5 -> 1.0
    (FLOOR, (3.5, 0.5), (0x7, 0x2), 126),
    # FLOOR: amax 2^-126 -> e = -128 clamps to -127 (code 0); x * 2^127 = 2 (0x4), -1 (0xA)
    (FLOOR, (2.0**-126, -(2.0**-127)), (0x4, 0xA), 0),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rule, values, codes, scale", MXFP4_GOLDEN)
def test_mxfp4_golden(rule, values, codes, scale, dtype):
    assert q4(block(*values, dtype=dtype), rule) == (pad(codes), scale)


def test_mxfp4_packs_element_2i_in_the_low_nibble():
    packed, _ = formats.quantize_mxfp4(block(6.0, 1.0, -0.5, 4.0))  # codes 7, 2, 9, 6
    assert packed[0, :2].tolist() == [0x27, 0x69]


# ------------------------------------------------------------------ dequantize


def test_dequantize_overflows_only_from_the_top_of_fp32():
    # 1.9375 * 2^127 quantizes to 256 * 2^120 = 2^128, which FP32 cannot hold: +Inf.
    # 1.875 * 2^127 is exactly 240 * 2^120: finite and exact.
    x = block(1.9375 * 2.0**127, -1.875 * 2.0**127)
    y = mx.dequantize_mxfp8(*mx.quantize_mxfp8(x))
    assert y[0, 0].item() == float("inf")
    assert y[0, 1].item() == -1.875 * 2.0**127


def test_dequantize_nan_scale_gives_nan_block():
    codes = torch.full((1, 64), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scales = torch.tensor([[255, 127]], dtype=torch.uint8)
    y = mx.dequantize_mxfp8(codes, scales)
    assert torch.isnan(y[0, :32]).all() and (y[0, 32:] == 1.0).all()


def test_dequantize_code0_scale_is_exact_subnormal():
    # element 1.125 (0x39) * 2^-127 = 9 * 2^-130: an exact FP32 subnormal
    codes = torch.full((1, 32), 0x39, dtype=torch.uint8).view(torch.float8_e4m3fn)
    y = mx.dequantize_mxfp8(codes, torch.zeros(1, 1, dtype=torch.uint8))
    assert (y == 9 * 2.0**-130).all()


def test_batched_shapes_and_fp16_match_the_2d_float32_result(gen):
    x = torch.randn(2, 3, 128, generator=gen).to(torch.float16)
    for quant in (mx.quantize_mxfp8, formats.quantize_mxfp4):
        codes, scales = quant(x)
        codes2, scales2 = quant(x.float().reshape(6, 128))
        assert scales.shape == (2, 3, 4)
        assert torch.equal(codes.view(torch.uint8).reshape(6, -1), codes2.view(torch.uint8))
        assert torch.equal(scales.reshape(6, 4), scales2)


def test_non_contiguous_input_equals_contiguous(gen):
    xt = torch.randn(64, 96, generator=gen).t()  # [96, 64], strides (1, 96)
    for quant in (mx.quantize_mxfp8, formats.quantize_mxfp4):
        (c1, s1), (c2, s2) = quant(xt), quant(xt.contiguous())
        assert torch.equal(c1.view(torch.uint8), c2.view(torch.uint8)) and torch.equal(s1, s2)


# ------------------------------------------------------------------ torchao cross-check


def _torchao():
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    return to_mx, ScaleCalculationMode


def _ours_and_torchao(x, elem, rule):
    to_mx, mode = _torchao()
    ao_scales, ao_data = to_mx(x, elem, 32, getattr(mode, rule.name))
    if elem == torch.float8_e4m3fn:
        codes, scales = mx.quantize_mxfp8(x, scale_rule=rule)
        codes = codes.view(torch.uint8)
    else:
        codes, scales = formats.quantize_mxfp4(x, scale_rule=rule)
    return (codes, scales), (ao_data.view(torch.uint8), ao_scales.view(torch.uint8))


def _edge_bf16_rows(gen) -> torch.Tensor:
    """Random BF16 blocks over a wide exponent range, plus zero, tiny and exact-max blocks."""
    rows = torch.randn(64, 256, generator=gen)
    rows *= torch.exp2(torch.randint(-60, 60, (64, 8), generator=gen).float()).repeat_interleave(32, 1)
    rows[0, :32] = 0.0  # all-zero block
    rows[1, :32] = -0.0  # all negative zero
    rows[2, :32] = 448.0 * 2.0**5  # amax exactly 448 * 2^k
    rows[3, :32] = 6.0 * 2.0**-3  # amax exactly 6 * 2^k
    rows[4, :32] *= 2.0**-100  # small, but above the code-0 range
    return rows.to(torch.bfloat16)


@pytest.mark.parametrize("elem", [torch.float8_e4m3fn, torch.float4_e2m1fn_x2], ids=["mxfp8", "mxfp4"])
@pytest.mark.parametrize("rule", [RCEIL, FLOOR])
def test_bitwise_equal_to_torchao_on_bf16(rule, elem, gen):
    x = _edge_bf16_rows(gen)
    (codes, scales), (ao_codes, ao_scales) = _ours_and_torchao(x, elem, rule)
    assert torch.equal(scales, ao_scales)
    assert torch.equal(codes, ao_codes)


@pytest.mark.parametrize("elem", [torch.float8_e4m3fn, torch.float4_e2m1fn_x2], ids=["mxfp8", "mxfp4"])
@pytest.mark.parametrize("rule", [RCEIL, FLOOR])
def test_scales_equal_torchao_for_every_bf16_amax(rule, elem):
    # Exhaustive over the scale rule: every positive finite BF16 value is a block's amax.
    # For BF16 (8 significant bits), amax / 448 = (amax / 7) * 2^-6 and amax / 6 are a power
    # of two or at least 1/224 relative away from one (the closest: 225 / 224), so torchao's
    # eager ceil(log2(.)) cannot misround.
    amax = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = torch.zeros(amax.numel(), 32, dtype=torch.bfloat16)
    x[:, 0] = amax
    x[:, 1] = -amax / 3  # a second, rounded element
    (codes, scales), (ao_codes, ao_scales) = _ours_and_torchao(x, elem, rule)
    assert torch.equal(scales, ao_scales)
    # elements too, except torchao's FLOOR code-0 blocks (next test)
    keep = ~((scales[:, 0] == 0) & (rule == FLOOR))
    assert keep.sum() > 30000
    assert torch.equal(codes[keep], ao_codes[keep])


@pytest.mark.parametrize("elem", [torch.float8_e4m3fn, torch.float4_e2m1fn_x2], ids=["mxfp8", "mxfp4"])
def test_known_difference_torchao_floor_code0_blocks(elem):
    # Under FLOOR, a block with amax < 2^-118 (E4M3) or < 2^-124 (E2M1) gets scale code 0.
    # OCP: elements x / 2^-127. torchao clamps that divisor to 2^-126 (its Triton
    # workaround), so its elements are half of ours (one binade lower).
    if elem == torch.float8_e4m3fn:
        x = block(2.0**-130, -(2.0**-131), dtype=torch.bfloat16)
        ours, theirs = [0x20, 0x98], [0x18, 0x90]  # (2^-3, -2^-4) vs (2^-4, -2^-5)
    else:
        x = block(2.0**-126, -(2.0**-127), dtype=torch.bfloat16)
        ours, theirs = [0xA4], [0x92]  # packed (2, -1) vs (1, -0.5)
    (codes, scales), (ao_codes, ao_scales) = _ours_and_torchao(x, elem, FLOOR)
    assert int(scales[0, 0]) == int(ao_scales[0, 0]) == 0
    assert codes[0, : len(ours)].tolist() == ours
    assert ao_codes[0, : len(theirs)].tolist() == theirs


def test_known_difference_torchao_rceil_fp32_just_above_a_power_of_two():
    # FP32 amax = 448 * 2^8 * (1 + 2^-23): q = 2^8 * (1 + 2^-23) exactly. The exact ceil is
    # 2^9 (code 136). torchao's eager fallback takes ceil(torch.log2(q)); log2(q) =
    # 8 + 1.7e-7 rounds to 8.0 in FP32 (spacing 9.5e-7 there), so it picks 2^8 (code 135)
    # and then saturates the element to 448. It needs |log2 q| >= 4 (below that the FP32
    # spacing of log2 q is fine enough); BF16 inputs cannot reach it (previous test).
    x = block(448.0 * 2.0**8 * (1 + 2.0**-23), 1.0)
    (codes, scales), (ao_codes, ao_scales) = _ours_and_torchao(x, torch.float8_e4m3fn, RCEIL)
    assert int(scales[0, 0]) == 136 and int(ao_scales[0, 0]) == 135
    assert codes[0, :2].tolist() == [0x76, 0x01]  # 224 * 2^9 and 2^-9 * 2^9
    assert ao_codes[0, :2].tolist() == [0x7E, 0x02]  # 448 * 2^8 and 2^-8 * 2^8
    # the exact rule's guarantee: 2^(c-127) >= q > 2^(c-128)
    q = 2.0**8 * (1 + 2.0**-23)
    assert 2.0 ** (136 - 127) >= q > 2.0 ** (135 - 127)


@pytest.mark.parametrize("elem", [torch.float8_e4m3fn, torch.float4_e2m1fn_x2], ids=["mxfp8", "mxfp4"])
def test_bitwise_equal_to_torchao_on_random_fp32(elem, gen):
    # random FP32 amaxes land within 2^-21 relative above a power of two too rarely to hit
    # the known difference above; the generator's seed is fixed, so this is deterministic
    x = torch.randn(128, 512, generator=gen) * 10.0
    (codes, scales), (ao_codes, ao_scales) = _ours_and_torchao(x, elem, RCEIL)
    assert torch.equal(scales, ao_scales) and torch.equal(codes, ao_codes)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("quant", [mx.quantize_mxfp8, formats.quantize_mxfp4])
@pytest.mark.parametrize(
    "x, match",
    [
        (torch.zeros(2, 48), r"^x: .*multiple of 32.*\(2, 48\)"),
        (torch.zeros(()), r"^x: .*multiple of 32"),
        (torch.zeros(2, 32, dtype=torch.int32), r"^x: .*bfloat16, float16 or float32.*int32"),
        (torch.zeros(2, 32, dtype=torch.float64), r"^x: .*float64"),
        ([1.0] * 32, r"^x: expected a torch.Tensor"),
    ],
)
def test_quantize_bad_input(quant, x, match):
    with pytest.raises(ValueError, match=match):
        quant(x)


@pytest.mark.parametrize("quant", [mx.quantize_mxfp8, formats.quantize_mxfp4])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_rejects_non_finite_and_says_where(quant, bad, dtype):
    x = torch.ones(3, 64, dtype=dtype)
    x[2, 40] = bad
    with pytest.raises(ValueError, match=r"^x: must be finite, found .* at index \(2, 40\)"):
        quant(x)


def test_quantize_bad_scale_rule():
    with pytest.raises(ValueError, match=r"^scale_rule: expected a ScaleRule"):
        mx.quantize_mxfp8(torch.zeros(1, 32), scale_rule="rceil")


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda: mx.dequantize_mxfp8(
                torch.zeros(2, 64, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8)
            ),
            r"^scales: expected shape \(2, 2\)",
        ),
        (
            lambda: mx.dequantize_mxfp8(torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.uint8)),
            r"^codes: .*float8_e4m3fn",
        ),
        (
            lambda: mx.dequantize_mxfp8(
                torch.zeros(2, 40, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8)
            ),
            r"^codes: .*multiple of 32",
        ),
        (
            lambda: formats.dequantize_mxfp4(
                torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.int32)
            ),
            r"^scales: .*uint8",
        ),
        (
            lambda: formats.dequantize_mxfp4(
                torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8)
            ),
            r"^scales: expected shape \(2, 1\)",
        ),
    ],
)
def test_dequantize_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------ device


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")
def test_cuda_bitwise_equal_to_cpu(gen):
    x = _edge_bf16_rows(gen)
    for rule in (RCEIL, FLOOR):
        for quant in (mx.quantize_mxfp8, formats.quantize_mxfp4):
            c_cpu, s_cpu = quant(x, scale_rule=rule)
            c_gpu, s_gpu = quant(x.cuda(), scale_rule=rule)
            assert torch.equal(c_gpu.cpu().view(torch.uint8), c_cpu.view(torch.uint8))
            assert torch.equal(s_gpu.cpu(), s_cpu)
