"""The performance page's first lines (``benchmarks.performance_page.status``): which run the
figures are from, how far behind HEAD its commit is, and "Stale" naming the kernels whose
SASS digest differs from the one recorded with the run. The current digests are injected
here (the docs build compiles the real ones: ``benchmarks/mkdocs_hook.py``)."""

from __future__ import annotations

import fnmatch
import json
import shutil
import subprocess

import pytest

from benchmarks import history, performance_page, sass_check
from tools.sass_digest import parse_lines

DIGESTS = [
    "sm_90a stage:real mx QuantizeKernel " + "1" * 40 + " 5248",
    "sm_90a stage:real norm NormKernel " + "2" * 40 + " 4480",
    "sm_90a experts:dep16-fused-w1 plan PlanKernel " + "3" * 40 + " 2432",
    "sm_90a wide:tp8 publish PublishKernel " + "4" * 40 + " 1536",
]
needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(root, *args) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root,
                          check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    """A git checkout with three commits; returns (root, [their shas, oldest first])."""
    root = tmp_path / "repo"
    root.mkdir()
    _git(root, "init", "-q")
    shas = []
    for i in range(3):
        (root / "f").write_text(str(i))
        _git(root, "add", "f")
        _git(root, "commit", "-q", "-m", f"c{i}")
        shas.append(_git(root, "rev-parse", "HEAD"))
    return root, shas


def _results(tmp_path, commit: str, digests: list[str] | None):
    """A results tree with one GPU machine whose one run (of ``commit``) draws the mx and
    norm stages and records ``digests`` (none when None)."""
    machine = tmp_path / "results" / "gpu-x"
    machine.mkdir(parents=True)
    benches = [{"fullname": f"benchmarks/bench_stages.py::test_stage[{stage}-1]",
                "extra_info": {"stage": stage, "batch": 1},
                "stats": {s: 1e-5 for s in ("min", "max", "mean", "median")} | {
                    "stddev": 0.0, "rounds": 1}} for stage in ("mx", "norm")]
    data = {"machine_info": {"machine": "gpu-x"}, "commit_info": {"id": commit},
            "benchmarks": benches, "datetime": "2026-12-01T00:00:00", "version": "5.2.3"}
    if digests is not None:
        data["sass_digest"] = {"arch": "sm_90a", "lines": digests, "note": "test"}
    path = machine / f"20261201T000000Z_{commit[:12]}.json"
    path.write_text(json.dumps(data))
    history.load_run(path)  # a well-formed run
    return tmp_path / "results"


def _first_line(results, root, current):
    return performance_page.status(results, current_digests=current, not_checked="skipped",
                                   root=root)[0]


@needs_git
def test_equal_digests_are_current_and_the_distance_to_head_is_counted(tmp_path, repo):
    root, shas = repo
    results = _results(tmp_path, shas[0], DIGESTS)
    line = _first_line(results, root, lambda arch: list(DIGESTS))
    assert line.startswith("**Current:**"), line
    assert f"`{shas[0][:12]}`" in line and "2 commits behind HEAD" in line
    assert "at HEAD" in _first_line(_results(tmp_path / "b", shas[2], DIGESTS), root,
                                    lambda arch: list(DIGESTS))


@needs_git
def test_a_changed_digest_of_a_drawn_kernel_is_stale_and_named(tmp_path, repo):
    root, shas = repo
    results = _results(tmp_path, shas[1], DIGESTS)
    planted = [DIGESTS[0].replace("1" * 40, "f" * 40), *DIGESTS[1:]]
    line = _first_line(results, root, lambda arch: planted)
    assert line.startswith("**Stale:**"), line
    assert "`stage:real mx (QuantizeKernel)`" in line and "1 commit behind HEAD" in line
    assert "NormKernel" not in line  # unchanged
    # a kernel missing on one side counts as changed too
    line = _first_line(results, root, lambda arch: DIGESTS[:1] + DIGESTS[2:])
    assert "`stage:real norm (NormKernel) (no longer compiled)`" in line


@needs_git
def test_a_change_in_a_kernel_the_page_does_not_draw_leaves_it_current(tmp_path, repo):
    root, shas = repo
    results = _results(tmp_path, shas[0], DIGESTS)
    # the run draws the mx and norm stages only: the experts engine and the TP8 schedule
    # kernels do not feed its figures
    planted = DIGESTS[:2] + [d.replace(d.split()[4], "e" * 40) for d in DIGESTS[2:]]
    assert _first_line(results, root, lambda arch: planted).startswith("**Current:**")
    assert sass_check.changed_kernels(DIGESTS, planted, [("stage", "experts")]) == [
        "experts:dep16-fused-w1 plan (PlanKernel)"]
    assert sass_check.changed_kernels(DIGESTS, planted, [("schedule", "wide")]) == [
        "wide:tp8 publish (PublishKernel)"]


@needs_git
def test_a_run_without_digests_is_stale_and_an_unchecked_build_says_so(tmp_path, repo):
    root, shas = repo
    line = _first_line(_results(tmp_path, shas[0], None), root, lambda arch: list(DIGESTS))
    assert line.startswith("**Stale:**") and "no SASS digest is recorded" in line
    line = _first_line(_results(tmp_path / "b", shas[0], DIGESTS), root, None)
    assert line.startswith("**Not checked:**") and "(skipped)" in line


def test_without_git_the_distance_is_unknown_not_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # no repository above
    assert "not a git checkout" in performance_page.commits_behind("abc1234", tmp_path) \
        or shutil.which("git") is None
    monkeypatch.setenv("PATH", str(tmp_path))  # no git on the path
    assert "git is unavailable" in performance_page.commits_behind("abc1234", tmp_path)


@needs_git
def test_a_commit_the_checkout_lacks_is_unknown(repo):
    root, _ = repo
    assert "not in this checkout's history" in performance_page.commits_behind("0" * 40, root)


def test_the_newest_gpu_run_records_digests_of_what_it_draws():
    """The committed newest run of each GPU machine carries SASS digests that cover every
    kernel pattern its drawn figures depend on (so the page's check compares something)."""
    for machine_dir in history.machine_dirs():
        if machine_dir.name.startswith("cpu-"):
            continue
        run = history.load_history(machine_dir)[-1]
        recorded = sass_check.recorded_digests(run.data)
        assert recorded is not None, f"{run.name}: no sass_digest"
        arch, lines = recorded
        keys = [" ".join(k.split()[1:3]) for k in parse_lines(lines)]
        assert all(k.startswith(arch) for k in parse_lines(lines))
        for group in performance_page.drawn_groups(run):
            for pattern in sass_check.DEPENDS[group]:
                assert any(fnmatch.fnmatchcase(k, pattern) for k in keys), \
                    f"{run.name}: no recorded digest for {group} ({pattern})"


def test_a_removed_tactics_kernels_are_no_change_of_a_drawn_figure():
    """The experts figure depends on every engine set; a recorded set the tree no longer
    compiles at all (a tactic removed since the run) changes no figure, while a kernel of a
    set still compiled that vanished, or a changed one, does."""
    from benchmarks.sass_check import changed_kernels

    removed = "sm_90a experts:dep16-old-tactic fused FusedExpertsKernel " + "5" * 40 + " 9000"
    groups = [("stage", "experts")]
    assert changed_kernels(DIGESTS + [removed], list(DIGESTS), groups) == []
    gone = [d for d in DIGESTS if "PlanKernel" not in d]
    assert changed_kernels(DIGESTS + [removed], gone + [removed.replace("5" * 40, "6" * 40)],
                           groups) == ["experts:dep16-old-tactic fused (FusedExpertsKernel)"]
