"""Tests of verify.compare: each comparator passes on agreeing inputs, fails on a planted
difference with a message naming the coordinate, both bit patterns and both values, and
ulp_distance agrees with an independent ranking of the representable values (ml_dtypes)."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import torch

from verify.compare import (
    ULP_NAN,
    CompareResult,
    ContractError,
    assert_bitwise_equal,
    assert_within_bound,
    assert_within_ulp,
    ulp_distance,
)


def _bits(t: torch.Tensor, int_dtype: torch.dtype) -> torch.Tensor:
    return t.view(int_dtype)


# --------------------------------------------------------------------------- bitwise


def test_bitwise_equal_passes_and_reports(gen):
    x = torch.randn(8, 32, generator=gen).to(torch.bfloat16)
    res = assert_bitwise_equal(x, x.clone(), what="latent", index_names=("token", "column"))
    assert isinstance(res, CompareResult)
    assert (res.kind, res.elements, res.mismatches, res.worst_ulp) == ("bitwise", 256, 0, 0)
    json.dumps(res.as_dict())


def test_bitwise_one_bit_flip_bf16_message():
    x = torch.ones(8, 32, dtype=torch.bfloat16)  # 1.0 is 0x3f80
    y = x.clone()
    y.view(torch.int16)[3, 17] ^= 1  # 0x3f81 = 1.0078125, one ulp above 1.0
    with pytest.raises(ContractError) as ei:
        assert_bitwise_equal(y, x, what="front GEMM out", index_names=("token", "column"))
    msg = str(ei.value)
    assert "front GEMM out" in msg
    assert "1 of 256" in msg
    assert "token=3 column=17" in msg
    assert "0x3f81" in msg and "0x3f80" in msg
    assert "1.0078125" in msg and "(1.0)" in msg
    assert "1 ulp" in msg
    rep = ei.value.report
    assert rep["mismatches"] == 1 and rep["worst_index"] == [3, 17]
    assert rep["first_mismatches"][0]["actual_hex"] == "0x3f81"
    json.dumps(rep)


def test_bitwise_reports_first_max_report_in_order():
    x = torch.zeros(4, 4, dtype=torch.float32)
    y = x.clone()
    y[0, 1], y[2, 3], y[3, 0] = 1.0, 2.0, 3.0
    with pytest.raises(ContractError) as ei:
        assert_bitwise_equal(y, x, what="w", max_report=2)
    msg = str(ei.value)
    assert "3 of 16" in msg and "first 2" in msg
    assert "[0, 1]" in msg and "[2, 3]" in msg and "[3, 0]" not in msg
    assert "0x3f800000" in msg and "0x00000000" in msg


def test_bitwise_negative_zero_is_a_mismatch_but_zero_ulp():
    pos = torch.zeros(3, dtype=torch.bfloat16)
    neg = -pos
    with pytest.raises(ContractError) as ei:
        assert_bitwise_equal(neg, pos, what="mailbox")
    assert "0x8000" in str(ei.value) and "0 ulp" in str(ei.value)
    assert ulp_distance(neg, pos).tolist() == [0, 0, 0]
    res = assert_within_ulp(neg, pos, max_ulp=0, what="mailbox")
    assert res.ulp_histogram == {0: 3}


def test_bitwise_nan_payloads():
    a = torch.tensor([0x7FC0, 0x7FC1], dtype=torch.int16).view(torch.bfloat16)
    assert torch.isnan(a).all()
    assert_bitwise_equal(a, a.clone(), what="nan same payload")
    b = torch.tensor([0x7FC0, 0x7FC0], dtype=torch.int16).view(torch.bfloat16)
    with pytest.raises(ContractError) as ei:
        assert_bitwise_equal(a, b, what="nan payload")
    assert "1 of 2" in str(ei.value) and "0x7fc1" in str(ei.value)


@pytest.mark.parametrize(
    "dtype,flip",
    [
        (torch.float8_e4m3fn, torch.uint8),
        (torch.float16, torch.int16),
        (torch.float32, torch.int32),
        (torch.float64, torch.int64),
        (torch.int32, torch.int32),
        (torch.uint8, torch.uint8),
        (torch.int64, torch.int64),
    ],
)
def test_bitwise_detects_low_bit_in_every_dtype(dtype, flip):
    x = torch.arange(1, 13, dtype=torch.float32).reshape(3, 4).to(dtype)
    y = x.clone()
    y.view(flip)[1, 2] ^= 1
    with pytest.raises(ContractError) as ei:
        assert_bitwise_equal(y, x, what="t", index_names=("row", "col"))
    assert "row=1 col=2" in str(ei.value) and "1 of 12" in str(ei.value)


def test_bitwise_bool_and_scalar():
    a = torch.tensor([True, False, True])
    b = torch.tensor([True, True, True])
    with pytest.raises(ContractError) as ei:
        assert_bitwise_equal(a, b, what="mask", index_names=("slot",))
    assert "slot=1" in str(ei.value) and "False" in str(ei.value)
    with pytest.raises(ContractError) as ei:
        assert_bitwise_equal(torch.tensor(1.5), torch.tensor(2.5), what="scalar")
    assert "1.5" in str(ei.value) and "2.5" in str(ei.value)


def test_bitwise_shape_and_dtype_errors_are_clear():
    x = torch.zeros(2, 3)
    with pytest.raises(ContractError, match=r"shape \(2, 3\) != expected \(3, 2\)"):
        assert_bitwise_equal(x, torch.zeros(3, 2), what="s")
    with pytest.raises(ContractError, match="dtype torch.float32 != expected torch.bfloat16"):
        assert_bitwise_equal(x, x.to(torch.bfloat16), what="s")
    with pytest.raises(ValueError, match="index_names"):
        assert_bitwise_equal(x, x, what="s", index_names=("token",))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bitwise_on_cuda():
    x = torch.ones(64, 64, dtype=torch.bfloat16, device="cuda")
    y = x.clone()
    y[5, 9] = 2.0
    assert_bitwise_equal(x, x.clone(), what="cuda")
    with pytest.raises(ContractError) as ei:
        assert_bitwise_equal(y, x, what="cuda", index_names=("token", "column"))
    assert "token=5 column=9" in str(ei.value) and "0x4000" in str(ei.value)
    res = assert_within_bound(x, x.double(), torch.zeros((), device="cuda"), what="cuda")
    assert res.worst_ratio == 0.0


# --------------------------------------------------------------------------- ulp_distance


def _independent_ranks(np_dtype, nbits: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank of every bit pattern among the sorted distinct non-NaN values (ml_dtypes
    decodes the values; -0 and +0 compare equal, so they share a rank), NaN mask."""
    codes = np.arange(2**nbits, dtype=np.uint64).astype({8: np.uint8, 16: np.uint16}[nbits])
    with np.errstate(invalid="ignore"):
        vals = codes.view(np_dtype).astype(np.float64)
    nan = np.isnan(vals)
    distinct = np.unique(vals[~nan])
    ranks = np.searchsorted(distinct, np.where(nan, 0.0, vals))
    return ranks.astype(np.int64), nan


def test_ulp_distance_e4m3_all_pairs():
    ranks, nan = _independent_ranks(ml_dtypes.float8_e4m3fn, 8)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    a = codes.view(torch.float8_e4m3fn)[:, None].expand(256, 256)
    b = codes.view(torch.float8_e4m3fn)[None, :].expand(256, 256)
    got = ulp_distance(a, b).numpy()
    want = np.abs(ranks[:, None] - ranks[None, :])
    want = np.where(nan[:, None] | nan[None, :], ULP_NAN, want)
    want = np.where(nan[:, None] & nan[None, :], 0, want)
    np.testing.assert_array_equal(got, want)


def test_ulp_distance_bf16_all_patterns(gen):
    ranks, nan = _independent_ranks(ml_dtypes.bfloat16, 16)
    pats = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    # every pattern against +0, against its neighbour pattern, and against a random permutation
    perm = torch.randperm(65536, generator=gen)
    for other_idx in (torch.zeros(65536, dtype=torch.long),
                      (torch.arange(65536) + 1) % 65536, perm):
        got = ulp_distance(pats, pats[other_idx]).numpy()
        o = other_idx.numpy()
        want = np.abs(ranks - ranks[o])
        want = np.where(nan | nan[o], ULP_NAN, want)
        want = np.where(nan & nan[o], 0, want)
        np.testing.assert_array_equal(got, want)


def test_ulp_distance_fp32_and_fp16_by_nextafter(gen):
    for np_t, t in ((np.float32, torch.float32), (np.float16, torch.float16)):
        x = torch.randn(200, generator=gen).to(t).numpy()
        x[:3] = np.array([0.0, -np.finfo(np_t).smallest_subnormal, np.finfo(np_t).max])
        y = x.copy()
        steps = torch.randint(0, 40, (200,), generator=gen).numpy()
        toward = np.where(torch.rand(200, generator=gen).numpy() < 0.5, -np.inf, np.inf)
        toward[2] = -np.inf  # x[2] is the largest finite value: step down from it
        toward = toward.astype(np_t)
        for i in range(200):
            for _ in range(steps[i]):
                nxt = np.nextafter(y[i], toward[i])
                if nxt == 0 and y[i] != 0:  # nextafter passes through a single zero
                    nxt = np_t(0.0)
                y[i] = nxt
        got = ulp_distance(torch.from_numpy(x), torch.from_numpy(y)).numpy()
        np.testing.assert_array_equal(got, steps)


def test_ulp_distance_infinity_and_dtype_errors():
    big = torch.tensor([torch.finfo(torch.bfloat16).max], dtype=torch.bfloat16)
    inf = torch.tensor([float("inf")], dtype=torch.bfloat16)
    assert ulp_distance(big, inf).item() == 1
    nan = torch.tensor([float("nan")], dtype=torch.bfloat16)
    assert ulp_distance(nan, big).item() == ULP_NAN
    with pytest.raises(TypeError):
        ulp_distance(big, big.float())
    with pytest.raises(TypeError):
        ulp_distance(torch.ones(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64))


# --------------------------------------------------------------------------- within ULP


def test_within_ulp_histogram_and_failure():
    base = torch.ones(10, dtype=torch.bfloat16)
    off = base.clone()
    off.view(torch.int16)[2] += 1
    off.view(torch.int16)[7] += 2
    res = assert_within_ulp(off, base, max_ulp=2, what="situ")
    assert res.ulp_histogram == {0: 8, 1: 1, 2: 1}
    assert res.worst_ulp == 2 and res.worst_index == (7,)
    with pytest.raises(ContractError) as ei:
        assert_within_ulp(off, base, max_ulp=1, what="situ", index_names=("col",))
    msg = str(ei.value)
    assert "1 of 10" in msg and "col=7" in msg and "0x3f82" in msg and "0x3f80" in msg
    assert "2 ulp" in msg and "1.015625" in msg
    json.dumps(ei.value.report)


def test_within_ulp_nan():
    a = torch.tensor([float("nan"), 1.0])
    assert_within_ulp(a, a.clone(), max_ulp=0, what="nan both")
    with pytest.raises(ContractError, match="NaN vs number"):
        assert_within_ulp(a, torch.tensor([1.0, 1.0]), max_ulp=1000, what="nan one")


def test_within_ulp_shape_error():
    with pytest.raises(ContractError, match="shape"):
        assert_within_ulp(torch.ones(2), torch.ones(3), max_ulp=0, what="x")


# --------------------------------------------------------------------------- within bound


def test_within_bound_pass_at_bound_and_fail_just_outside():
    exact = torch.full((4, 8), 1.0, dtype=torch.float64)
    actual = torch.ones(4, 8, dtype=torch.float32)
    actual[1, 6] = 1.0 + 2.0**-20  # diff 2^-20
    bound = torch.full((4, 8), 2.0**-20, dtype=torch.float64)
    res = assert_within_bound(actual, exact, bound, what="gemm", index_names=("token", "col"))
    assert res.worst_ratio == 1.0 and res.worst_index == (1, 6) and res.mismatches == 0
    # the next float64 below the bound: the same difference is now just outside it
    tight = torch.nextafter(bound, torch.zeros_like(bound))
    with pytest.raises(ContractError) as ei:
        assert_within_bound(actual, exact, tight, what="gemm", index_names=("token", "col"))
    msg = str(ei.value)
    assert "1 of 32" in msg and "token=1 col=6" in msg
    assert "0x3f800008" in msg and "0x3ff0000000000000" in msg
    assert "1.0000009536743164" in msg and "(1.0)" in msg
    assert ei.value.report["worst_ratio"] > 1.0
    json.dumps(ei.value.report)


def test_within_bound_zero_bound_and_broadcast():
    exact = torch.tensor([[0.0, 2.0]], dtype=torch.float64)
    assert assert_within_bound(exact.float(), exact, 0.0, what="z").worst_ratio == 0.0
    with pytest.raises(ContractError) as ei:
        assert_within_bound(torch.tensor([[0.0, 2.5]]), exact, torch.tensor([1.0, 0.0]), what="z")
    assert ei.value.report["worst_ratio"] == "inf" and "[0, 1]" in str(ei.value)


def test_within_bound_nan_and_bad_bounds():
    exact = torch.tensor([float("nan"), 1.0], dtype=torch.float64)
    assert_within_bound(torch.tensor([float("nan"), 1.0]), exact, 0.5, what="n")
    with pytest.raises(ContractError):
        assert_within_bound(torch.tensor([float("nan"), float("nan")]), exact, 0.5, what="n")
    with pytest.raises(ContractError):
        assert_within_bound(torch.tensor([1.0, 1.0]), exact, 0.5, what="n")
    inf = torch.tensor([float("inf")], dtype=torch.float64)
    assert_within_bound(inf.float(), inf, 0.0, what="inf agrees")
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            assert_within_bound(torch.ones(2), torch.ones(2, dtype=torch.float64), bad, what="b")
    with pytest.raises(ContractError, match="shape"):
        assert_within_bound(torch.ones(2), torch.ones(3, dtype=torch.float64), 1.0, what="b")
