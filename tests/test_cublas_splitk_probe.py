"""CPU tests of ``benchmarks.cublas_splitk_probe``'s bookkeeping (the probe itself needs a GPU)."""

import pytest
import torch

from benchmarks import cublas_splitk_probe as probe
from model.config import LatentMoEConfig


def test_parse_rows_ranges_and_lists():
    assert probe.parse_rows("1..4,8,3") == [1, 2, 3, 4, 8]
    assert probe.parse_rows("65..67") == [65, 66, 67]
    with pytest.raises(ValueError, match="bad range"):
        probe.parse_rows("5..2")
    with pytest.raises(ValueError, match="bad range"):
        probe.parse_rows("0..2")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_differing_rows_counts_bitwise(dtype):
    want = torch.randn(5, 7).to(dtype)
    got = want.clone()
    assert probe.differing_rows(got, want) == 0
    got[1, 3] = -got[1, 3] if got[1, 3] != 0 else 1.0
    got[4, 0] = torch.nan
    assert probe.differing_rows(got, want) == 2
    zero = want.clone()
    zero[2, 2] = 0.0
    neg = zero.clone()
    neg[2, 2] = -0.0  # equal as numbers, not as bits
    assert probe.differing_rows(neg, zero) == 1
    with pytest.raises(ValueError, match="got"):
        probe.differing_rows(got[:4], want)


def test_gemm_cases_name_both_schedules_real_shapes():
    cases = probe.gemm_cases(LatentMoEConfig.kimi_k3(), 8)
    assert cases["dep.front"]["shape"] == (15872, 7168)
    assert cases["dep.router"]["fp32_out"] and not cases["dep.front"]["fp32_out"]
    assert cases["dep.up"]["addend"] and cases["tp8.up"]["addend"]
    assert cases["tp8.front"]["fp32_out"]
    assert cases["tp8.shared_down"]["shape"] == (7168, 768)
    assert len(cases) == 8


def test_render_names_differing_row_counts():
    result = {"device": "X", "torch": "2", "read_gbs": 4000.0, "cublas": "libcublas.so.13",
              "cases": {"dep.up": {"shape": [7168, 3584], "fp32_out": False, "settings": {
                  "splitk": {"rows_checked": 64, "differing": {8: 8, 9: 2},
                             "timed": {1: {"us": 20.0, "limit_us": 10.0, "kernels": ["k"]}}},
                  "no_splitk": {"rows_checked": 64, "differing": {}, "timed": {}}}}}}
    text = probe.render(result)
    assert "| dep.up | 7168 x 3584 | on (stock) | 64 | 2: 8 (8), 9 (2) | 1: 20.0 (0.50) |" in text
    assert "| dep.up | 7168 x 3584 | off (cuBLASLt) | 64 | 0 |  |" in text
