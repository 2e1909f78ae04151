"""``benchmarks.dep_model`` on the committed H200 results: the engine fit, the interpolation,
and the model's check against the measured DEP2 ranks (no GPU needed)."""

import pytest

from benchmarks import dep_model


def test_interp_is_piecewise_log_linear_and_clamped():
    points = [(1.0, 10.0), (4.0, 30.0)]
    assert dep_model._interp(points, 0.5) == 10.0
    assert dep_model._interp(points, 8.0) == 30.0
    assert dep_model._interp(points, 2.0) == pytest.approx(20.0)
    assert dep_model._extrapolate(points, 7.0) == pytest.approx(50.0)


def test_windows_follow_the_engine_rule():
    from fast.experts.engine import choose_windows

    for rows in (1, 16, 448, 449, 896, 897, 2048):
        assert dep_model._windows(rows) == choose_windows(rows, 16, 896)


def test_model_on_the_committed_results():
    import json

    files = {k: json.loads(p.read_text()) for k, p in dep_model.DEFAULTS.items()}
    model = dep_model.DepModel(**files)
    f = model.stream_fraction
    assert 0 < model.engine_cost_us < 100 and 0 < f[4] < f[2] < f[1] <= 1
    # the engine fit reproduces the DEP16 engine rows it was fitted on within 10%
    for c in files["experts"]["cases"]:
        if c["mode"] == "dep16" and c["skew"] == 0 and c["size"] <= 16:
            fit = model.engine_cost_us + c["limit_us"] / f[1]
            assert fit == pytest.approx(c["median_us"]["engine"], rel=0.1), c["size"]
    # DEP2: within 20% of every measured rank; at T = 4 rank 0 (46 touched experts) waited
    # for rank 1 (65), which the model leaves out (docs/schedules/dep.md)
    ratios = [model.predict(n, t, touched=m["touched"])["layer"] / m["median_us"]["fast"]
              for (n, t, r), m in model.measured.items() if t != 4]
    assert ratios and all(0.8 < x < 1.2 for x in ratios), ratios
    # more ranks, fewer local experts: a rank's time falls with N at every T
    for t in (1, 4, 16, 64):
        times = [model.predict(n, t)["layer"] for n in (8, 16, 32)]
        assert times == sorted(times, reverse=True), (t, times)
    assert "DEP32" in dep_model.render(model)
