"""``benchmarks.dense_defaults`` on the CPU: the one-split rule on made-up runs, its refusals,
and the committed defaults against the H200 runs they came from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.dense_defaults import SHAPES, choose, main, medians, tactic_literal
from fast.gemm.host import CANDIDATES, DEFAULT_TACTICS
from fast.gemm.layout import MAX_TOKENS, Tactic

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "h200"
R64S1, R128S1 = "r64w2s1", "r128w4s1"
R64S2, R128S2 = "r64w2s2", "r128w4s2"


def _run(times: dict[int, dict[str, float]], gemm: str = "shared_down") -> dict:
    return {"device": "GPU", "rows": [{"tokens": t, "gemms": {gemm: {"median_us": m}}}
                                      for t, m in times.items()]}


def test_the_shapes_are_the_candidates():
    assert set(SHAPES.values()) == set(CANDIDATES)


def test_one_split_for_every_t_the_least_total():
    """Split 1 wins T = 1 and 8 by 1 us each, split 2 wins T = 64 by 5: split 2, whose
    64-row tactic is fastest at T <= 8 and 128-row one at 64 (the last bucket to 64)."""
    times = {1: {R64S1: 20.0, R64S2: 21.0, R128S2: 23.0},
             8: {R64S1: 21.0, R64S2: 22.0, R128S2: 24.0},
             64: {R64S1: 40.0, R64S2: 38.0, R128S2: 35.0}}
    c = choose("shared_down", medians([_run(times)], "shared_down"))
    assert c.splits == 2
    assert c.buckets == {8: Tactic(warps=2, mtiles=2, splits=2),
                         MAX_TOKENS: Tactic(warps=4, mtiles=2, splits=2)}
    assert c.per_t[64] == (35.0, 35.0, None)


def test_runs_are_averaged_and_noise_does_not_cut_a_bucket():
    a = {1: {R64S2: 20.0, R128S2: 20.1}, 8: {R64S2: 21.0, R128S2: 20.9},
         64: {R64S2: 30.0, R128S2: 25.0}}
    b = {1: {R64S2: 20.0, R128S2: 20.1}, 8: {R64S2: 21.0, R128S2: 20.9}}
    c = choose("shared_down", medians([_run(a), _run(b)], "shared_down"))
    assert c.buckets == {8: Tactic(warps=2, mtiles=2, splits=2),  # 21.0 within 1% of 20.9
                         MAX_TOKENS: Tactic(warps=4, mtiles=2, splits=2)}
    strict = choose("shared_down", medians([_run(a)], "shared_down"), tolerance=0.0)
    assert list(strict.buckets) == [1, MAX_TOKENS]


def test_the_128k_forms_and_the_wgmma_family():
    times = {1: {R64S2: 22.0, "r64w2s2,stage_k128": 20.0, "r128w4s2,wgmma": 30.0},
             64: {R128S2: 35.0, "r128w4s2,stage_k128": 33.0, "r128w4s2,wgmma": 31.0}}
    c = choose("shared_down", medians([_run(times)], "shared_down"))
    assert c.buckets == {1: Tactic(warps=2, mtiles=2, splits=2, stage_k=128),
                         MAX_TOKENS: Tactic(warps=4, mtiles=2, splits=2, stage_k=128)}
    assert tactic_literal(c.buckets[1]) == "Tactic(warps=2, mtiles=2, splits=2, stage_k=128)"
    w = choose("shared_down", medians([_run(times)], "shared_down"), family="wgmma")
    assert w.buckets == {MAX_TOKENS: Tactic(warps=4, mtiles=2, splits=2, wgmma=True)}


def test_refusals():
    with pytest.raises(ValueError, match="no K split has a mma.sync tactic timed at every T"):
        choose("shared_down", {1: {R64S1: 20.0}, 8: {R64S2: 21.0}})
    with pytest.raises(ValueError, match="no timed rows"):
        choose("up", {})
    with pytest.raises(ValueError, match="family must be one of"):
        choose("up", {1: {R64S1: 1.0}}, family="hmma")
    # 2 warps of 4 m-tiles serve up to 5 windows: fastest at T = 40, its bucket reaching 64
    four = {1: {R64S2: 20.0, "r128w2s2": 30.0}, 40: {R64S2: 30.0, "r128w2s2": 25.0}}
    with pytest.raises(ValueError, match="r128w2s2 chosen for T = 2..64 does not serve T = 41"):
        choose("shared_down", four)


def test_the_committed_defaults_follow_from_the_h200_runs(capsys):
    """The splits of every shape, and the whole tables of the front, the router and the up
    projection, are what the rule derives from the two H200 runs they were chosen from
    (the shared down projection's 64- and 128-row tiles are within 1% of each other at
    T <= 8 there, so its bucket edge is a judgment)."""
    runs = [json.loads((RESULTS / name).read_text()) for name in ("dense.json", "dense-rerun.json")]
    for gemm, shape in SHAPES.items():
        c = choose(gemm, medians(runs, gemm))
        assert {t.splits for t in DEFAULT_TACTICS[shape].values()} == {c.splits}, gemm
        if gemm != "shared_down":
            assert c.buckets == DEFAULT_TACTICS[shape], gemm
    assert main([str(RESULTS / "dense.json"), "--gemms", "router"]) == 0
    assert "(896, 7168): {64: Tactic(warps=2, mtiles=2, splits=8)},  # router, split 8" in \
        capsys.readouterr().out
