"""``benchmarks.experts_table.merge_runs`` and ``--merge`` on the CPU: runs of one device and
tree joined into one table, each case keeping its own run's read bandwidth; mismatched
runs, a case measured twice and a peer configured differently refused."""

from __future__ import annotations

import json

import pytest

from benchmarks import experts_table as table

HEADER = {"device": "NVIDIA H200", "torch": "2.11.0+cu130", "python": "3.12.3",
          "commit": "abc1234"}
PEERS = {"triton": {"num_warps": "best of 4/8 per case"}}


def case(mode, size, skew, read_gbs, engine_us):
    limit = 100.0 * 4500.0 / read_gbs  # 450 MB at the run's rate
    return {"mode": mode, "size": size, "skew": skew, "touched": 56, "limit_us": limit,
            "median_us": {"engine": engine_us, "triton_w4": 2 * engine_us}}


def run(read_gbs, cases, **extra):
    return {**HEADER, "read_gbs": read_gbs, "cases": cases, "peers": PEERS, "wall_s": 300.0,
            "complete": True, **extra}


def two_runs():
    return [run(4500.0, [case("dep16", 1, 0.0, 4500.0, 90.0), case("dep16", 64, 0.0, 4500.0, 400.0)],
                triton_compact_checks=[{"ok": True}]),
            run(4400.0, [case("tp8", 1024, 0.0, 4400.0, 800.0)], triton_compact_checks=[{"ok": True}],
                marlin_error="no library")]


def test_merge_keeps_each_case_at_its_own_runs_bandwidth():
    merged = table.merge_runs(two_runs())
    assert [(c["mode"], c["size"], c["read_gbs"]) for c in merged["cases"]] == [
        ("dep16", 1, 4500.0), ("dep16", 64, 4500.0), ("tp8", 1024, 4400.0)]
    assert [p["read_gbs"] for p in merged["parts"]] == [4500.0, 4400.0]
    assert "read_gbs" not in merged and merged["complete"] is True
    assert merged["commit"] == "abc1234" and merged["peers"] == PEERS
    assert len(merged["triton_compact_checks"]) == 2 and merged["marlin_error"] == "no library"
    text = table.render(merged)
    assert "2 runs joined, read bandwidth 4500 / 4400 GB/s" in text and "tree abc1234" in text
    tp8 = next(line for line in text.splitlines() if line.startswith("| tp8 | 1024"))
    limit = 100.0 * 4500.0 / 4400.0
    assert f"| 4400 | {limit:.1f} | 800.0 ({limit / 800.0:.2f}) |" in tp8  # its own run's rate


def test_merge_refuses_what_is_not_one_table():
    a, b = two_runs()
    with pytest.raises(ValueError, match="at least two runs"):
        table.merge_runs([a])
    with pytest.raises(ValueError, match="commit="):
        table.merge_runs([a, dict(b, commit="def5678")])
    with pytest.raises(ValueError, match="device="):
        table.merge_runs([a, dict(b, device="NVIDIA H100 80GB HBM3")])
    with pytest.raises(ValueError, match=r"case \('dep16', 64, 0.0\) is in run 0 and run 1"):
        table.merge_runs([a, run(4400.0, [case("dep16", 64, 0, 4400.0, 410.0)])])
    with pytest.raises(ValueError, match="peer 'triton' is described differently"):
        table.merge_runs([a, dict(b, peers={"triton": {"num_warps": "4"}})])
    with pytest.raises(ValueError, match="fi90_versions differ"):
        table.merge_runs([dict(a, fi90_versions={"variant": "w4a16"}),
                          dict(b, fi90_versions={"variant": "w4a16_w4a8"})])
    with pytest.raises(ValueError, match="not an experts_table result"):
        table.merge_runs([a, {k: v for k, v in b.items() if k != "read_gbs"}])


def test_merge_marks_an_incomplete_part():
    a, b = two_runs()
    assert table.merge_runs([a, dict(b, complete=False)])["complete"] is False


def test_merge_command_writes_the_joined_result(tmp_path, capsys):
    paths = []
    for i, r in enumerate(two_runs()):
        paths.append(tmp_path / f"part{i}.json")
        paths[-1].write_text(json.dumps(r))
    out = tmp_path / "experts.json"
    table.main(["--merge", *map(str, paths), "--out", str(out)])
    merged = json.loads(out.read_text())
    assert len(merged["cases"]) == 3 and len(merged["parts"]) == 2
    assert "| dep16 | 64 |" in capsys.readouterr().out


def test_render_of_one_run_is_unchanged_by_the_merge_columns():
    a, _ = two_runs()
    text = table.render(a)
    assert "read bandwidth 4500 GB/s (this run)" in text and "read GB/s" not in text


def test_the_best_peer_is_the_fastest_of_every_family_layout_and_configuration():
    c = case("dep16", 64, 0.0, 4500.0, 400.0)
    c["median_us"].update({"triton_compact_w8": 500.0, "marlin_compact_bm32": 700.0, "fi90_w4a8": 440.0,
                           "fi90_compact_w4a16": 450.0, "grouped_mm": 900.0, "engine_windows=4": 300.0})
    assert table.best_of(c["median_us"], table.PEER_FAMILIES) == ("fi90_w4a8", 440.0)  # no engine variant
    assert table.peer_label("fi90_w4a8") == "fi90 owner w4a8"
    assert table.peer_label("marlin_compact_bm32") == "marlin compact bm32"
    assert table.peer_label("grouped_mm") == "grouped_mm"
    row = next(line for line in table.render(run(4500.0, [c])).splitlines() if line.startswith("| dep16"))
    assert row.endswith("| fi90 owner w4a8 | 1.10x |")
    assert table.best_of({"engine": 1.0}, table.PEER_FAMILIES) == (None, None)
