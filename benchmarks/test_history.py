"""The benchmark history check: its rules on made-up runs, then the committed history of
every machine (``benchmarks.history`` states the rules)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest

from benchmarks import gpu_timing, history

T0 = datetime(2026, 11, 30, 12, 0, 0, tzinfo=timezone.utc)
CASE_A = "benchmarks/bench_x.py::test_x[a]"
CASE_B = "benchmarks/bench_x.py::test_x[b]"


def write_run(directory, minutes, commit, seconds_by_case, *, machine=None, dirty=False):
    """A run file of pytest-benchmark's shape whose every statistic of a case is the
    given seconds; returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    saved = T0 + timedelta(minutes=minutes)
    benches = [{"fullname": case, "name": case.split("::")[1], "params": {}, "extra_info": {},
                "stats": {"min": s, "max": s, "mean": s, "median": s, "stddev": 0.0,
                          "rounds": 1}}
               for case, s in seconds_by_case.items()]
    data = {"machine_info": {"machine": machine or directory.name},
            "commit_info": {"id": commit, "dirty": dirty}, "benchmarks": benches,
            "datetime": saved.isoformat(), "version": "5.2.3"}
    path = directory / history.run_file_name(saved, commit, dirty)
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def machine(tmp_path):
    """A machine with two runs of unchanged code (its noise: 10% on case a, 4% on b) and
    its noise.json."""
    d = tmp_path / "gpu-x"
    write_run(d, 0, "a" * 40, {CASE_A: 1.00e-5, CASE_B: 2.00e-5})
    write_run(d, 1, "a" * 40, {CASE_A: 1.10e-5, CASE_B: 2.08e-5})
    history.write_noise(d, history.measure_noise(history.load_history(d), "median"))
    return d


def test_run_file_name_round_trip(tmp_path):
    path = write_run(tmp_path / "m", 5, "0123456789abcdef", {CASE_A: 1e-3}, dirty=True)
    assert path.name == "20261130T120500Z_0123456789ab-dirty.json"
    run = history.load_run(path)
    assert (run.saved, run.commit, run.dirty, run.tag) == (
        T0 + timedelta(minutes=5), "0123456789ab", True, None)


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.rename(p.with_name("latest.json")), "not a run file name"),
    (lambda p: p.write_text("{"), "does not parse"),
    (lambda p: p.write_text(json.dumps({"benchmarks": []})), "missing 'machine_info'"),
    (lambda p: _edit(p, lambda d: d["benchmarks"][0]["stats"].pop("median")), "stats['median']"),
    (lambda p: _edit(p, lambda d: d["commit_info"].update(id="ffff")), "the name says commit"),
    (lambda p: _edit(p, lambda d: d["machine_info"].update(machine="h100")), "the directory is"),
])
def test_a_damaged_run_file_fails_the_check(machine, damage, message):
    damage(sorted(machine.glob("2026*.json"))[-1])
    with pytest.raises(history.HistoryError, match=message.replace("[", r"\[")):
        history.check_machine(machine)


def test_current_topic_files_sit_beside_the_runs(machine):
    # benchmarks/results/README.md: a machine keeps its current result of each topic beside
    # its runs; those files are not runs, a misnamed run still fails
    for name in ("experts.json", "experts.md", "dense-rerun.json", "two-gpu.log"):
        (machine / name).write_text("{}")
    assert len(history.load_history(machine)) == 2
    history.check_machine(machine)
    (machine / "experts_v2.json").write_text("{}")
    with pytest.raises(history.HistoryError, match="not a run file name"):
        history.load_history(machine)


def _edit(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_noise_threshold_is_the_widest_spread_rounded_up(machine):
    noise = history.load_noise(machine)
    assert noise.spreads == pytest.approx({CASE_A: 10.0, CASE_B: 4.0})
    assert noise.threshold_percent == 10 and noise.widest[0] == CASE_A


def test_a_threshold_its_runs_do_not_give_fails_the_check(machine):
    _edit(machine / "noise.json", lambda d: d.update(threshold_percent=50))
    with pytest.raises(history.HistoryError, match="its runs give 10"):
        history.check_machine(machine)


def test_a_slowdown_beyond_the_threshold_fails_and_one_within_passes(machine):
    write_run(machine, 2, "b" * 40, {CASE_A: 1.209e-5, CASE_B: 2.29e-5})  # +9.9%, +10.1%
    check = history.check_machine(machine)
    assert [c.case for c in check.slower] == [CASE_B] and not check.ok
    assert "SLOWER" in check.report() and "+10.1%" in check.report()


def test_an_accepted_slowdown_passes_with_its_reason_and_a_stale_entry_fails(machine):
    newest = write_run(machine, 2, "b" * 40, {CASE_A: 2e-5, CASE_B: 2e-5})
    entries = [{"run": newest.name, "cases": "*test_x[[]a]", "reason": "a does more work"}]
    (machine / "accepted.json").write_text(json.dumps({"accepted": entries}))
    check = history.check_machine(machine)
    assert check.ok and [c.case for c, _ in check.accepted] == [CASE_A]
    entries.append({"run": "20200101T000000Z_abcdefa.json", "cases": "*", "reason": "gone"})
    (machine / "accepted.json").write_text(json.dumps({"accepted": entries}))
    assert not history.check_machine(machine).ok


def test_a_case_missing_from_the_newest_run_compares_its_own_newest(machine):
    write_run(machine, 2, "b" * 40, {CASE_A: 1.0e-5})
    write_run(machine, 3, "c" * 40, {CASE_B: 2.0e-5})
    changes = {c.case: c for c in history.check_machine(machine).changes}
    assert (changes[CASE_A].previous.commit, changes[CASE_A].newest.commit) == ("a" * 12, "b" * 12)
    assert (changes[CASE_B].previous.commit, changes[CASE_B].newest.commit) == ("a" * 12, "c" * 12)


def test_several_runs_of_a_slower_commit_are_compared_with_the_commit_before(machine):
    """Repeated runs of one commit are noise samples, not each other's baseline: a slower
    commit saved three times still meets the previous commit's result."""
    for minute in (2, 3, 4):
        write_run(machine, minute, "b" * 40, {CASE_A: 2.0e-5, CASE_B: 2.0e-5})
    check = history.check_machine(machine)
    assert [(c.case, c.previous.commit) for c in check.slower] == [(CASE_A, "a" * 12)]


def test_runs_of_one_commit_only_have_nothing_to_compare(tmp_path):
    d = tmp_path / "cpu-x"
    write_run(d, 0, "a" * 40, {CASE_A: 1.0e-5})
    write_run(d, 1, "a" * 40, {CASE_A: 1.5e-5})
    history.write_noise(d, history.measure_noise(history.load_history(d), "min"))
    check = history.check_machine(d)
    assert check.ok and check.changes == []


def _current(seconds_by_case, statistic="min"):
    """pytest-benchmark JSON of a run being made (only what the comparison reads)."""
    return {"benchmarks": [{"fullname": case, "stats": {statistic: s}}
                           for case, s in seconds_by_case.items()]}


# Dyadic seconds, so that the percentages are exact: 2**-16 s -> +50% is 1.5 * 2**-16 s.
BASE_S = 2.0 ** -16
CASE_C = "benchmarks/bench_x.py::test_x[c]"


@pytest.fixture
def baseline(tmp_path):
    return history.load_run(write_run(tmp_path / "cpu-x", 0, "a" * 40,
                                      {CASE_A: BASE_S, CASE_B: BASE_S}))


def test_slower_cases_is_strictly_beyond_the_threshold_and_skips_new_cases(baseline):
    current = _current({CASE_A: 1.5 * BASE_S,                # exactly +50%: passes
                        CASE_B: 1.5 * BASE_S + 2.0 ** -40,   # just above: slower
                        CASE_C: 100 * BASE_S})               # not in the baseline
    assert history.percent_slower(BASE_S, 1.5 * BASE_S) == 50.0
    assert history.slower_cases(baseline, current, "min", 50) == {
        CASE_B: (BASE_S, 1.5 * BASE_S + 2.0 ** -40)}
    assert history.slower_cases(baseline, current, "min", 49) == {
        CASE_A: (BASE_S, 1.5 * BASE_S), CASE_B: (BASE_S, 1.5 * BASE_S + 2.0 ** -40)}
    assert history.slower_cases(baseline, _current({CASE_A: 0.5 * BASE_S}), "min", 0) == {}


class _FakeRuns:
    """A per-run runner for ``confirm_slower``: the i-th rerun returns ``reruns[i]``
    (seconds by case, restricted to the cases asked for); records what each rerun asked."""

    def __init__(self, *reruns):
        self.reruns = list(reruns)
        self.asked = []

    def __call__(self, cases):
        self.asked.append(list(cases))
        seconds = self.reruns[len(self.asked) - 1]
        return _current({case: seconds[case] for case in cases if case in seconds})


SLOW, FAST = 3 * BASE_S, 1.1 * BASE_S   # +200%, +10% against a threshold of 89%


def test_a_case_slow_once_then_fast_is_noise_and_passes(baseline):
    runs = _FakeRuns({CASE_A: FAST})
    outcome = history.confirm_slower(baseline, _current({CASE_A: SLOW, CASE_B: FAST}),
                                     "min", 89, runs)
    assert outcome.ok and outcome.confirmed == () and outcome.unconfirmed == [CASE_A]
    assert runs.asked == [[CASE_A]]   # stopped as soon as no case was left
    (line,) = outcome.report()
    assert line.startswith(f"noise   {CASE_A}") and "+200.0%" in line and "+10.0%" in line
    assert "in 1 of 2 runs" in line


def test_a_case_slow_in_every_run_is_a_regression(baseline):
    runs = _FakeRuns({CASE_A: SLOW, CASE_B: FAST}, {CASE_A: 2 * BASE_S})
    outcome = history.confirm_slower(baseline, _current({CASE_A: SLOW, CASE_B: SLOW}),
                                     "min", 89, runs)
    assert not outcome.ok and outcome.confirmed == (CASE_A,)
    assert outcome.unconfirmed == [CASE_B]
    # reruns ask only for the cases still slower, by their node ids (fullnames)
    assert runs.asked == [[CASE_A, CASE_B], [CASE_A]]
    assert outcome.figures[CASE_A] == (BASE_S, [SLOW, SLOW, 2 * BASE_S])
    slower, noise = outcome.report()
    assert slower.startswith(f"SLOWER  {CASE_A}: min") and "run 3: " in slower
    assert "at least +100.0%" in slower and "each of 3 runs" in slower
    assert noise.startswith(f"noise   {CASE_B}")


def test_a_case_fast_in_the_last_run_only_passes(baseline):
    outcome = history.confirm_slower(baseline, _current({CASE_A: SLOW}), "min", 89,
                                     _FakeRuns({CASE_A: SLOW}, {CASE_A: FAST}))
    assert outcome.ok and outcome.figures[CASE_A][1] == [SLOW, SLOW, FAST]


def test_no_rerun_when_nothing_is_slower(baseline):
    runs = _FakeRuns()
    outcome = history.confirm_slower(baseline, _current({CASE_A: FAST, CASE_C: SLOW}),
                                     "min", 89, runs)
    assert outcome.ok and runs.asked == [] and outcome.report() == []


def test_a_case_a_rerun_does_not_measure_stays_slower(baseline):
    """A rerun in which the case failed or nothing ran cannot clear it."""
    outcome = history.confirm_slower(baseline, _current({CASE_A: SLOW}), "min", 89,
                                     lambda cases: None)
    assert outcome.confirmed == (CASE_A,) and outcome.figures[CASE_A][1] == [SLOW, None, None]
    assert "run 2: not measured" in outcome.report()[0]


class _FakeEvent:
    """A CUDA event on a made-up device clock (seconds advance by the enqueued work)."""

    device_seconds = 0.0

    def __init__(self, enable_timing):
        self.at = None

    def record(self):
        self.at = _FakeEvent.device_seconds

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.at - self.at) * 1e3  # milliseconds, as torch.cuda.Event


def test_device_clock_differences_are_the_device_time_between_its_events(monkeypatch):
    monkeypatch.setattr(gpu_timing.torch.cuda, "Event", _FakeEvent)
    clock = gpu_timing.DeviceClock()
    start = clock()
    _FakeEvent.device_seconds += 3e-6  # the kernel
    end = clock()
    assert end - start == pytest.approx(3e-6)
    start = clock()  # a second round starts a new pair
    _FakeEvent.device_seconds += 5e-6
    assert clock() - start == pytest.approx(5e-6)


@pytest.mark.parametrize("machine_dir", history.machine_dirs(), ids=lambda d: d.name)
def test_committed_history(machine_dir):
    """Every committed run parses, the noise threshold is what its runs give, and no
    case's newest result is slower than the commit before's beyond it without a reason."""
    check = history.check_machine(machine_dir)
    print(check.report())
    if not check.ok:
        pytest.fail(check.report(), pytrace=False)


def test_the_gpu_history_is_committed():
    """The parametrized check above needs machines to check (an empty parameter set
    would only skip)."""
    assert "h200" in [d.name for d in history.machine_dirs()]


def test_a_planted_15_percent_gpu_regression_is_caught(tmp_path):
    """The committed H200 history with one more run, of a later commit, whose one case is
    15% slower than the newest committed run (every other case unchanged): the committed
    threshold (measured on runs of unchanged code) fails it, naming the case."""
    import shutil

    source = history.RESULTS / "h200"
    machine = tmp_path / "h200"
    shutil.copytree(source, machine)
    newest = history.load_history(machine)[-1]
    data = json.loads(newest.path.read_text())
    case = "benchmarks/bench_experts.py::test_experts[dep16-64]"
    hit = [b for b in data["benchmarks"] if b["fullname"] == case]
    assert hit, f"{case} is not in {newest.path.name}"
    for stat in ("min", "max", "mean", "median"):
        hit[0]["stats"][stat] *= 1.15
    data["commit_info"] = {"id": "f" * 40, "dirty": False}
    saved = datetime.fromisoformat(data["datetime"]) + timedelta(hours=1)
    data["datetime"] = saved.isoformat()
    (machine / history.run_file_name(saved, "f" * 40, False)).write_text(json.dumps(data))
    check = history.check_machine(machine)
    assert history.load_noise(machine).threshold_percent < 15
    assert not check.ok and [c.case for c in check.slower] == [case], check.report()
