"""``benchmarks.dense_fixed_cost``'s arithmetic on the CPU: the K slices a tactic can run,
the fitted line, and the table of a result."""

from __future__ import annotations

import pytest

from benchmarks.dense_fixed_cost import (fit_line, k_slices, main, parse_variants, render,
                                         variant_name, variant_tactic)


def test_slices_are_whole_stages_of_every_split():
    assert k_slices(7168, 1, 64, (0.125, 0.25, 0.5, 1.0)) == [896, 1792, 3584, 7168]
    widths = k_slices(6144, 2, 64, (0.125, 0.25, 0.5, 1.0))
    assert widths == [768, 1536, 3072, 6144] and all(w % 128 == 0 for w in widths)
    assert k_slices(7168, 8, 128, (0.01, 0.02, 1.0)) == [1024, 7168]  # one stage per split at least
    with pytest.raises(ValueError, match="fractions"):
        k_slices(7168, 1, 64, (0.0,))
    with pytest.raises(ValueError, match="multiple"):
        k_slices(7000, 1, 64, (1.0,))


def test_the_fit_recovers_a_line():
    nbytes = [1e6, 2e6, 4e6, 8e6]
    times = [7.5 + b / (4000e9) * 1e6 for b in nbytes]  # 7.5 us fixed, 4000 GB/s
    fit = fit_line(nbytes, times)
    assert fit["fixed_us"] == pytest.approx(7.5) and fit["rate_gbs"] == pytest.approx(4000)
    assert fit["r2"] == pytest.approx(1.0)
    assert fit_line([1, 2], [5, 5])["rate_gbs"] is None  # no positive slope: no rate
    with pytest.raises(ValueError, match="two distinct"):
        fit_line([1, 1], [2, 3])


def test_the_table_has_a_row_per_gemm_and_backend():
    med = {"fast": [10.0, 13.0], "cublas": [11.0, 15.0]}
    case = {"gemm": "up", "tokens": 1, "tactic": "r64w2s2", "k": [1792, 3584], "bytes": [1e7, 2e7],
            "limit_us": [2.2, 4.4], "median_us": med,
            "fits": {b: fit_line([1e7, 2e7], m) for b, m in med.items()}}
    text = render({"device": "GPU", "torch": "2", "read_gbs": 4500.0, "floor_us": 2.5,
                   "cases": [case]})
    rows = [line for line in text.splitlines() if line.startswith("| up |")]
    assert len(rows) == 2 and "| 7.0 |" in rows[0] and "3333 (0.74)" in rows[0]
    assert "1792 -> 10.0, 3584 -> 13.0" in rows[0] and "r64w2s2" in rows[0]


def test_variants_are_tactic_fields_over_the_default():
    """``--tactics``: ``;`` between variants, ``field=int`` items over the default tactic;
    anything else refused by name before any GPU work."""
    from fast.gemm import Tactic

    assert parse_variants("splits=1;occupancy=1,ring=4;") == [{"splits": 1},
                                                              {"occupancy": 1, "ring": 4}]
    assert parse_variants("") == []
    default = Tactic(warps=4, mtiles=1, splits=2)
    assert variant_tactic(default, {"splits": 1, "wgmma": 1}) == Tactic(warps=4, mtiles=1,
                                                                        splits=1, wgmma=True)
    with pytest.raises(ValueError, match="wgmma needs whole warpgroups"):
        variant_tactic(Tactic(warps=2, mtiles=2), {"wgmma": 1})  # the Tactic's own check
    assert variant_name({"occupancy": 1, "ring": 4}) == "fast:occupancy=1,ring=4"
    for bad in ("split=1", "splits", "splits=one", "ring=4,chunk=2"):
        with pytest.raises(ValueError, match="--tactics"):
            parse_variants(bad)
    with pytest.raises(SystemExit) as exit_info:
        main(["--tactics", "bogus=1"])
    assert exit_info.value.code == 2


def test_a_variant_gets_its_own_row_tactic_and_slices():
    med = {"fast": [10.0, 13.0], "fast:splits=1": [9.0, 12.5]}
    case = {"gemm": "up", "tokens": 1, "tactic": "r64w2s2", "k": [1792, 3584], "bytes": [1e7, 2e7],
            "limit_us": [2.2, 4.4], "median_us": med,
            "tactics": {"fast:splits=1": "r64w2s1"}, "variant_k": {"fast:splits=1": [1344, 3584]},
            "fits": {b: fit_line([1e7, 2e7], m) for b, m in med.items()}}
    text = render({"device": "GPU", "torch": "2", "read_gbs": 4500.0, "floor_us": 2.5,
                   "cases": [case]})
    rows = [line for line in text.splitlines() if line.startswith("| up |")]
    assert len(rows) == 2 and "| fast | r64w2s2 |" in rows[0]
    assert "| fast | r64w2s1 |" in rows[1] and "1344 -> 9.0, 3584 -> 12.5" in rows[1]
