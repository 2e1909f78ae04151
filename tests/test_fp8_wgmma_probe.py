"""``benchmarks/fp8_wgmma_probe.py`` on the CPU: its designed operands are exact E4M3
values with the exact sums the analysis assumes, the analysis recovers a known adder from
the model it is run against (``simulate``), and the probe kernel compiles for sm_90a."""

from __future__ import annotations

import pytest

from benchmarks import fp8_wgmma_probe as probe
from fast import backend

_cute_error = backend.cute_import_error()


def test_e4m3_codes_round_trip_and_refuse_other_values():
    for value in (448.0, -448.0, 1.0, 1.5, 2.0 ** -6, 2.0 ** -9, 3 * 2.0 ** -9, 0.0):
        assert probe.e4m3_value(probe.e4m3_code(value)) == value
    for bad in (449.0, 1.0625, 2.0 ** -10, 1e9):
        with pytest.raises(ValueError, match="is not an E4M3 value"):
            probe.e4m3_code(bad)


def test_bit_positions():
    assert probe.leading_bit(1.5) == 0 and probe.lowest_bit(1.5) == -1
    assert probe.leading_bit(448.0) == 8 and probe.lowest_bit(448.0) == 6
    assert probe.leading_bit(2.0 ** -18) == -18 == probe.lowest_bit(-(2.0 ** -18))


def test_designed_sums_are_what_the_families_say():
    """Each family's outputs hold the terms its metadata names, and the float64 sum of
    32 E4M3 products is exact at these magnitudes (a product has at most 8 significant
    bits; the terms span far fewer than 53 - 8 bits)."""
    fams = probe.experiments()
    (align,), _ = fams["alignment"]
    exact = align.exact(False)
    for m in range(len(probe.SMALL_EXPONENTS)):
        for n in range(probe.COLS):
            meta = align.meta[m][n]
            assert exact[m, n] == meta["big"] + meta["small"]
    acc_probes, accumulate = fams["accumulate"]
    assert accumulate
    for q in acc_probes:
        exact = q.exact(True)
        for m in range(probe.ROWS):
            for n in range(probe.COLS):
                if q.meta[m][n] is not None:
                    assert exact[m, n] == q.meta[m][n]["d"] + q.meta[m][n]["product"]
    ratios = {-r["ratio_log2"] for q in acc_probes for row in q.meta for r in row if r}
    assert max(ratios) >= 28 and min(ratios) <= 1
    for q in fams["position"][0]:
        a, b = q.values()
        for k in range(1, probe.KS):
            assert (a[k - 1] * b[0]).nonzero().flatten().tolist() == [0, k]


@pytest.mark.parametrize("width", (11, 13, 16))
def test_analysis_recovers_a_truncating_adder(width):
    """On the outputs of a fixed-point adder of ``width`` bits below the largest term's
    leading bit, truncating, with D in the same adder: the analysis finds exact products,
    that width for the products and for D, truncation toward zero, no dependence on a
    term's position."""
    fams = probe.experiments()
    results = {name: probe.simulate(qs, acc, width, d_in_adder=True) for name, (qs, acc) in fams.items()}
    got = probe.analyze(results, fams)
    assert got["products_exact"]
    assert got["alignment"] == {"at_least": width, "below": width + 1, "width": width,
                                "lost": "toward_zero"}
    assert got["accumulate"]["width"] == width and got["accumulate"]["lost"] == "toward_zero"
    assert not got["position_dependent"]


def test_analysis_tells_an_fp32_d_from_a_narrow_one():
    """D added after the adder in FP32 (round to nearest): D's terms survive far below the
    products' width, and where they are lost the rounding is not a truncation."""
    fams = probe.experiments()
    results = {name: probe.simulate(qs, acc, 13, d_in_adder=False) for name, (qs, acc) in fams.items()}
    got = probe.analyze(results, fams)
    assert got["alignment"]["width"] == 13
    assert got["accumulate"]["at_least"] >= 23 and got["accumulate"]["lost"] == "mixed"


def test_analysis_flags_wrong_products_and_position_dependence():
    fams = probe.experiments()
    results = {name: probe.simulate(qs, acc, 13, d_in_adder=True) for name, (qs, acc) in fams.items()}
    results["products"] = results["products"].clone()
    results["products"][0, 5, 2] *= 1.0000001
    pos = results["position"].clone()
    q = fams["position"][0][0]  # ratio 2^-12: kept by a 13-bit adder
    exact = q.exact(False)
    pos[0, 20:31] = exact[20:31].float() - 16.0  # terms at k = 21..31 lost
    results["position"] = pos
    got = probe.analyze(results, fams)
    assert not got["products_exact"]
    assert got["position_dependent"] and got["position_kept"]["12"] == [False, True]


@pytest.mark.skipif(_cute_error is not None, reason=f"CuTe DSL not importable: {_cute_error}")
def test_probe_kernel_compiles_for_hopper_only():
    assert probe.compile_probe("sm_90a") is not None
    with pytest.raises(ValueError, match="sm_90a"):
        probe.compile_probe("sm_100a")
