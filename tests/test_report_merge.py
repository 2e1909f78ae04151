"""Joining the reports of a verification run made in parts (``verify.report.merge_reports``,
``python -m verify.report merge``): the joined report must say what one run over all the
parts would have said, and must refuse parts that are not of one run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verify.report import Report, Row, merge_reports, write_report

ROOT = Path(__file__).resolve().parents[1]
ENV = {"commit": "abc123", "python": "3.12.3", "torch": "2.11.0", "device": "NVIDIA H200",
       "capability": "sm_90", "world_size": "1"}
FAST = {"version": "latentmoe, nvidia-cutlass-dsl 4.8.1", "source": "built-in"}


def _part(rows) -> Report:
    """A report whose rows are built through the same calls the contracts make."""
    report = Report()
    report.backends["fast"] = dict(FAST)
    for key, build in rows:
        build(report, report.row(*key))
    return report


def _payload(report: Report, tmp_path: Path, name: str, env=ENV) -> tuple[str, dict]:
    json_path, _ = write_report(report, tmp_path / name, dict(env))
    return str(json_path), json.loads(json_path.read_text())


def _experts_a(report, row):
    row.add_comparison("bitwise")
    row.add_comparison("bound", worst_ratio=0.5, bound="mma")
    row.add_figure("sqnr_db", 40.0, worst="min")
    row.add_figure("ulp_off_fraction", 0.01, worst="max")
    report.outcome(row, "passed")
    report.outcome(row, "skipped", reason="needs two GPUs")


def _experts_b(report, row):
    row.add_comparison("bound", worst_ratio=0.9, bound="mma")
    row.add_comparison("ulp", worst_ulp=3)
    row.add_figure("sqnr_db", 35.0, worst="min")
    row.add_figure("ulp_off_fraction", 0.002, worst="max")
    row.flips, row.decisions = 2, 100
    report.outcome(row, "passed")
    report.outcome(row, "failed", nodeid="verify/test_experts.py::test_x[fast]")
    report.outcome(row, "skipped", reason="needs two GPUs")


def test_merge_adds_counts_and_keeps_the_worst_figures(tmp_path):
    key = ("experts_stages", "fast", "small")
    only_b = ("dep_stages", "fast", "small")
    a = _part([(key, _experts_a)])
    b = _part([(key, _experts_b), (only_b, lambda rep, row: rep.outcome(row, "passed"))])
    env, merged = merge_reports([_payload(a, tmp_path, "a"), _payload(b, tmp_path, "b")])

    # what one report over both parts records
    whole = _part([(key, _experts_a), (key, _experts_b),
                   (only_b, lambda rep, row: rep.outcome(row, "passed"))])
    assert [r.status() for r in merged.sorted_rows()] == ["pass", "FAIL"]
    for got, want in zip(merged.sorted_rows(), whole.sorted_rows()):
        assert got == want
    row = merged.rows[key]
    assert (row.cases, row.passed, row.failed, row.skipped, row.bitwise) == (5, 2, 1, 2, 1)
    assert row.worst_ratio == 0.9 and row.worst_ulp == 3 and row.bound == "mma"
    assert row.figures == {"sqnr_db": 35.0, "ulp_off_fraction": 0.01}  # min and max
    assert row.skip_reasons == ["needs two GPUs"]
    assert row.failures == ["verify/test_experts.py::test_x[fast]"]
    assert (row.flips, row.decisions) == (2, 100)
    assert env["parts"] == 2 and env["commit"] == "abc123"
    assert merged.totals()["failed"] == 1


def test_merge_refuses_parts_of_another_run(tmp_path):
    a = _part([(("c", "fast", "small"), _experts_a)])
    other = dict(ENV, commit="def456")
    with pytest.raises(ValueError, match="commit='def456'.*one commit and machine"):
        merge_reports([_payload(a, tmp_path, "a"), _payload(a, tmp_path, "b", env=other)])
    changed = _part([(("c", "fast", "small"), _experts_a)])
    changed.backends["fast"] = dict(FAST, version="latentmoe, nvidia-cutlass-dsl 4.9.0")
    with pytest.raises(ValueError, match="backend 'fast' is .*4.9.0"):
        merge_reports([_payload(a, tmp_path, "a"), _payload(changed, tmp_path, "b")])
    with pytest.raises(ValueError, match="no report"):
        merge_reports([])


def test_merge_keeps_both_world_sizes(tmp_path):
    """A single-GPU part and a torchrun part of one node's run: one report, both sizes."""
    a = _part([(("c", "fast", "small"), _experts_a)])
    env, _ = merge_reports([_payload(a, tmp_path, "a"),
                            _payload(a, tmp_path, "b", env=dict(ENV, world_size="2"))])
    assert env["world_size"] == "1,2"


def test_a_figure_without_its_direction_is_refused():
    """Reports written before rows recorded each figure's direction: a figure that only
    one part has is taken as it is; one that two parts have cannot be joined."""
    old = Row("c", "fast", "small", figures={"sqnr_db": 30.0})  # a report from before
    row = Row("c", "fast", "small")
    row.merge(old)
    assert row.figures == {"sqnr_db": 30.0}
    with pytest.raises(ValueError, match="which end is the worst"):
        row.merge(old)
    with pytest.raises(ValueError, match="worst must be 'min' or 'max'"):
        Row("c", "fast", "small").add_figure("sqnr_db", 1.0, worst="lowest")


def test_merge_command(tmp_path):
    """The command writes the joined report and exits 1 on a failed row, 2 on parts it
    cannot join; a run of only passing rows exits 0."""
    a = _part([(("c", "fast", "small"), _experts_a)])
    b = _part([(("c", "fast", "small"), _experts_b)])
    pa, _ = _payload(a, tmp_path, "a")
    pb, _ = _payload(b, tmp_path, "b")
    pc, _ = _payload(a, tmp_path, "c", env=dict(ENV, device="NVIDIA H100"))

    def run(*args):
        return subprocess.run([sys.executable, "-m", "verify.report", "merge", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)

    done = run(str(tmp_path / "ab"), pa, pb)
    assert done.returncode == 1, done.stderr
    assert "rows 1, cases 5: 2 passed, 1 failed, 2 skipped" in done.stdout
    joined = json.loads((tmp_path / "ab" / "verify-report.json").read_text())
    assert joined["totals"]["failed"] == 1 and joined["environment"]["parts"] == 2
    assert "| c | fast | small | FAIL |" in (tmp_path / "ab" / "verify-report.md").read_text()
    assert run(str(tmp_path / "a"), pa).returncode == 0
    done = run(str(tmp_path / "ac"), pa, pc)
    assert done.returncode == 2 and "device='NVIDIA H100'" in done.stderr


def test_parts_of_a_real_run_merge_to_the_whole_run(tmp_path):
    """Two parts of ``pytest verify/`` (CPU) joined give the rows of one run over both
    files: the same counts, comparisons, worst ratios, figures and skip reasons."""
    files = {"a": ["verify/test_norm.py"],
             "b": ["verify/test_finalize.py", "verify/test_quality.py"]}

    def pytest_run(name, paths):
        env = dict(os.environ, LATENTMOE_REPORT_DIR=str(tmp_path / name))
        done = subprocess.run([sys.executable, "-m", "pytest", *paths, "-q", "-p",
                               "no:cacheprovider"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:]
        return json.loads((tmp_path / name / "verify-report.json").read_text())

    parts = [(name, pytest_run(name, paths)) for name, paths in files.items()]
    whole = pytest_run("whole", files["a"] + files["b"])
    _, merged = merge_reports(parts)
    assert merged.totals() == whole["totals"]
    want = [Row.from_dict(r) for r in whole["rows"]]
    assert merged.sorted_rows() == want
    assert any(r.figures for r in want) and any(r.skip_reasons for r in want)
