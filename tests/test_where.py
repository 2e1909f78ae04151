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


# -- machine code at this tree ---------------------------------------------------------------

_DIGESTS = ["sm_90a stage:real mx QuantizeKernel aaaa 10",
            "sm_90a stage:real norm NormKernel bbbb 20",
            "sm_90a dep:dep16 combine CombineKernel cccc 30",
            "sm_100a stage:real mx QuantizeKernel dddd 10"]


def _digested_run(tmp_path, monkeypatch) -> "where.Run":
    monkeypatch.setattr(where, "ROOT", tmp_path)
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "verify.json").write_text(json.dumps(
        {"rows": [{"contract": "x", "passed": 1, "failed": 0, "skipped": 0}]}))
    (tmp_path / "r" / "digests.txt").write_text("\n".join(_DIGESTS) + "\n")
    (tmp_path / "r" / "verify-run.json").write_text(json.dumps(
        {"commit": "abcdef1234", "date": "2026-12-04", "sass_digest": "digests.txt",
         "sass_arch": "sm_90a"}))
    return where.load_run("one H200", "r/verify.json")


def test_a_run_names_its_digests_with_their_architecture(tmp_path, monkeypatch):
    run = _digested_run(tmp_path, monkeypatch)
    assert (run.sass_digest, run.sass_arch) == ("digests.txt", "sm_90a")
    assert sorted(where.recorded_kernels(run)) == sorted(" ".join(d.split()[:4])
                                                         for d in _DIGESTS[:3])
    assert where.recorded_sets(run) == [("dep", "dep16"), ("stage", "real")]
    (tmp_path / "r" / "verify-run.json").write_text(json.dumps(
        {"commit": "abcdef1234", "date": "2026-12-04", "sass_digest": "digests.txt"}))
    with pytest.raises(ValueError, match="sass_arch"):
        where.load_run("one H200", "r/verify.json")


def test_kernels_status_says_same_changed_gone_new_and_not_checked(tmp_path, monkeypatch):
    run = _digested_run(tmp_path, monkeypatch)
    same = where.kernels_status(run, _DIGESTS[:3])
    assert same.startswith("**Machine code at this tree: the same.** The 3 `sm_90a` kernels")
    assert "`abcdef1`" in same and "verifies its own commit, not this one" in same
    assert "`gemm:dense-auto`" in same  # a set of tools/sass_digest.py the run lacks
    # another architecture's line and a set the run did not record change nothing
    assert where.kernels_status(run, _DIGESTS[:3] + ["sm_100a stage:real norm NormKernel x 1",
                                                     "sm_90a wide:tp8 route R y 2"]) == same
    changed = where.kernels_status(run, [_DIGESTS[0], "sm_90a stage:real norm NormKernel eeee 20"])
    assert changed.startswith("**Machine code at this tree: 2 of the 3 `sm_90a` kernels")
    assert "`stage:real norm` (NormKernel)" in changed
    assert "`dep:dep16 combine` (CombineKernel) (no longer compiled)" in changed
    assert "The other 1 compile to the same SASS." in changed
    new = where.kernels_status(run, _DIGESTS[:3] + ["sm_90a dep:dep16 wait W ffff 4"])
    assert "the same." in new and "(never run in a recorded suite): `dep:dep16 wait` (W)" in new
    skipped = where.kernels_status(run, None, "LATENTMOE_SKIP_SASS_CHECK=1")
    assert "not checked** (LATENTMOE_SKIP_SASS_CHECK=1)" in skipped and "3 `sm_90a`" in skipped


def test_the_page_has_a_kernel_marker_per_digested_run_and_the_hook_fills_it(monkeypatch):
    from benchmarks import mkdocs_hook, sass_check

    page = where.PAGE.read_text()
    digested = [r for r in where.runs().values() if r is not None and r.sass_digest]
    assert digested, "the H200 run records its kernels' digests"
    for run in digested:
        assert (where.ROOT / run.report).with_name(run.sass_digest).is_file()
        assert where.KERNELS_MARKER.format(machine=run.machine) in page
    monkeypatch.setenv(sass_check.SKIP_ENV, "1")
    built = mkdocs_hook._verified_page(page)
    assert "<!-- verified:kernels" not in built
    assert built.count("**Machine code at this tree: not checked**") == len(digested)
    with pytest.raises(Exception, match="names no run"):
        mkdocs_hook._verified_page(where.KERNELS_MARKER.format(machine="a GB300"))
