"""``benchmarks.run``'s ``check`` on a machine with no committed history: an error by
default, or with ``--without-baseline run`` the cases run once (their failure still fails)
and nothing is compared."""

from __future__ import annotations

from benchmarks import run


def _fake_pytest(status: int, calls: list):
    def fake(suite, out, **kwargs):
        calls.append((suite, kwargs.get("baseline")))
        return status
    return fake


def test_check_without_baseline_fails_by_default(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(run, "run_pytest", _fake_pytest(0, calls))
    assert run.main(["cpu", "check", "--machine", "no-such-machine"]) == 2
    assert calls == [] and "no baseline for machine 'no-such-machine'" in capsys.readouterr().err


def test_check_without_baseline_run_runs_the_cases_once(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(run, "run_pytest", _fake_pytest(0, calls))
    assert run.main(["cpu", "check", "--machine", "no-such-machine",
                     "--without-baseline", "run"]) == 0
    assert calls == [("cpu", None)]
    assert "NOT COMPARED" in capsys.readouterr().err


def test_check_without_baseline_run_keeps_a_failing_case_failing(monkeypatch):
    for status in (1, 5):  # a failed case; no case ran
        monkeypatch.setattr(run, "run_pytest", _fake_pytest(status, []))
        assert run.main(["cpu", "check", "--machine", "no-such-machine",
                         "--without-baseline", "run"]) == status
