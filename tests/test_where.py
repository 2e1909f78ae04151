"""The "verified where" page (docs/verified.md) is the one ``verify.where`` generates from
the committed reports and contract files (regenerate it with
``python -m verify.where --write``). The commit distances are taken from the page itself
(``--write`` counts them with git), so the test needs no git history."""

from __future__ import annotations

import json

import pytest

from verify import where


def test_verified_page_is_current():
    page = where.PAGE.read_text()
    head, distances = where.recorded_distances(page)
    assert page == where.render(distances, head), (
        "docs/verified.md is stale: run `python -m verify.where --write`")


def test_every_run_has_a_commit_and_a_date_and_every_contract_file_a_row():
    runs = where.runs()
    assert list(runs) == list(where.MACHINES)
    for machine, run in runs.items():
        if run is None:
            continue
        assert run.commit and run.date, machine
        assert run.rows, machine
        if run.log:
            assert (where.ROOT / run.report).with_name(run.log).is_file(), (machine, run.log)
    files = where.contract_files()
    assert "test_dep_fast.py" in files and "dep_fast_batch_invariant" in files["test_dep_fast.py"]
    assert "situ_and_mul" in files["test_activation.py"]  # the contract marker's name
    page = where.PAGE.read_text()
    for f in files:
        assert f"| `{f}` |" in page


def test_cells_count_cases_and_say_not_run():
    assert where._cell([]) == "not run"
    assert where._cell([{"passed": 0, "failed": 0, "skipped": 3}]) == "not run (3 skipped)"
    assert where._cell([{"passed": 2, "failed": 1, "skipped": 0},
                        {"passed": 1, "failed": 0, "skipped": 4}]) == \
        "3 passed, **1 failed**, 4 skipped"


def test_run_metadata_comes_from_the_run_file_beside_the_report(tmp_path, monkeypatch):
    monkeypatch.setattr(where, "ROOT", tmp_path)
    (tmp_path / "r").mkdir()
    report = {"environment": {"commit": "0000000-dirty"},
              "rows": [{"contract": "x", "passed": 1, "failed": 0, "skipped": 0}]}
    (tmp_path / "r" / "verify.json").write_text(json.dumps(report))
    with pytest.raises(ValueError, match="commit"):
        where.load_run("m", "r/verify.json")
    (tmp_path / "r" / "verify-run.json").write_text(
        json.dumps({"commit": "abcdef1234", "date": "2026-12-03", "log": "notes.md"}))
    run = where.load_run("m", "r/verify.json")
    assert (run.commit, run.date, run.log, run.totals()["passed"]) == \
        ("abcdef1234", "2026-12-03", "notes.md", 1)
