"""The benchmark history: one directory per machine under ``benchmarks/results/``.

    benchmarks/results/<machine>/
        <YYYYMMDDTHHMMSSZ>_<commit>[-dirty][_<tag>].json   one run (pytest-benchmark's JSON)
        noise.json      the run-to-run noise of this machine and the threshold it gives
        accepted.json   reviewed slowdowns that the history check lets pass, each with why
        <topic>[-<part>].{json,md,log,txt}   the current result of a topic (``experts``,
                        ``dep``, ``wide``, ...; ``benchmarks/results/README.md``): not a run

A **run** is the file ``pytest --benchmark-json`` writes, named by the UTC time it was
saved and the commit it measured (``-dirty``: with uncommitted changes; a tag such as
``converted`` marks a file rebuilt from an older format, its ``note`` says how). Its
``machine_info["machine"]`` is the directory's name and its ``commit_info["id"]`` starts
with the commit of the name.

**Noise and threshold.** ``noise.json`` lists runs of unchanged code and the statistic
the machine is compared on: ``median`` of the rounds for GPU device time, ``min`` for CPU
wall time (on a shared CPU interference only adds time, so the fastest round is the
code's own cost). For each case the spread is ``max / min - 1`` of that statistic over
those runs; the threshold is the largest spread of any case, rounded up to a whole percent
(pytest-benchmark's ``--benchmark-compare-fail`` takes whole percents). The check
recomputes it from the listed runs, so the figure cannot drift from its measurement.

**Regression.** A slowdown is ``100 * current / baseline - 100`` percent of the statistic,
pytest-benchmark's ``PercentageRegressionCheck``; beyond the threshold means strictly more
than it. A case the baseline lacks is not compared.

* *A run being made* (``python -m benchmarks.run``, ``check`` and ``record``) is compared
  with the newest committed run of its machine, and a case counts as a regression only
  when it is slower beyond the threshold in each of ``CONFIRM_RUNS`` (3) separate pytest
  runs: the whole suite once, then only the cases still slower, rerun by their node ids,
  stopping as soon as none is left (``confirm_slower``). Interference on a shared machine
  only adds time, so a real slowdown repeats and a noise spike rarely does three times in
  a row. On the ``min`` statistic (CPU) this is the same as "the fastest round of all the
  runs is still beyond the threshold"; on the ``median`` (GPU) it is "slower in every
  run". A case a rerun does not measure (it failed or was skipped) stays counted as
  slower.
* *The committed history* (``check_machine``, in ``make test``): for each case, its
  newest result is compared with the newest result of an earlier commit (runs of one
  commit, ``-dirty`` counting as another, are repeated measurements and are not compared
  with each other, so committing several runs of a slower commit cannot hide its
  slowdown); a slowdown beyond the threshold fails unless ``accepted.json`` has an entry
  for that run and case with a reason.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
import os
import platform
import re
from datetime import datetime, timezone
from pathlib import Path

__all__ = [
    "RESULTS",
    "STATISTICS",
    "TOPICS",
    "CURRENT_NAME",
    "HistoryError",
    "Run",
    "Noise",
    "Accepted",
    "Change",
    "MachineCheck",
    "machine_name",
    "software_info",
    "run_file_name",
    "load_run",
    "machine_dirs",
    "load_history",
    "measure_noise",
    "write_noise",
    "load_noise",
    "load_accepted",
    "newest_changes",
    "check_machine",
    "CONFIRM_RUNS",
    "percent_slower",
    "slower_cases",
    "Confirmation",
    "confirm_slower",
]

RESULTS = Path(__file__).resolve().parent / "results"
#: The statistic each suite is compared on (see the module docstring for why).
STATISTICS = {"gpu": "median", "cpu": "min"}
NOISE_FILE = "noise.json"
ACCEPTED_FILE = "accepted.json"
#: Separate pytest runs in which a case must be slower beyond the threshold to count as a
#: regression (see the module docstring).
CONFIRM_RUNS = 3
#: Files a machine directory may hold besides its runs.
OTHER_FILES = (NOISE_FILE, ACCEPTED_FILE, "README.md")
#: The topics whose current result files (``<topic>[-<part>].<ext>``, overwritten by each new
#: run of the topic) a machine directory may hold beside its runs.
TOPICS = ("experts", "dep", "wide", "dense", "verify", "two-gpu", "sass-digest", "fp8-wgmma-probe")
CURRENT_NAME = re.compile(
    rf"^(?:{'|'.join(re.escape(t) for t in TOPICS)})(?:-[a-z0-9]+)?\.(?:json|md|log|txt)$")
RUN_NAME = re.compile(
    r"^(?P<saved>\d{8}T\d{6}Z)_(?P<commit>[0-9a-f]{7,40})(?P<dirty>-dirty)?"
    r"(?:_(?P<tag>[a-z0-9-]+))?\.json$")
_STAMP = "%Y%m%dT%H%M%SZ"
_STATS = ("min", "max", "mean", "median", "stddev")


class HistoryError(ValueError):
    """A history file that does not parse or does not fit its directory (names the file)."""


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_name(gpu: bool) -> str:
    """The history directory of this machine: the GPU's name (``h200`` for an NVIDIA
    H200) for the GPU suite, else ``cpu-<cores>core-<model>`` (``cpu-2core-amd-epyc``)."""
    if gpu:
        import torch

        if not torch.cuda.is_available():
            raise HistoryError("the GPU suite needs a CUDA device; none is visible")
        return _slug(torch.cuda.get_device_name().removeprefix("NVIDIA "))
    return f"cpu-{os.cpu_count()}core-{_slug(_cpu_model())}"


def software_info() -> dict:
    """What a result depends on besides the code: torch (and its CPU threads), CUDA, the
    GPU and the CuTe DSL version where present."""
    import importlib.metadata

    import torch

    info = {"torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:
        info["cutlass_dsl"] = importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        info["cutlass_dsl"] = None
    return info


def run_file_name(saved: datetime, commit: str, dirty: bool, tag: str | None = None) -> str:
    """``<YYYYMMDDTHHMMSSZ>_<commit[:12]>[-dirty][_<tag>].json`` (``saved`` in UTC)."""
    name = f"{saved.astimezone(timezone.utc).strftime(_STAMP)}_{commit[:12]}"
    name += "-dirty" if dirty else ""
    name += f"_{tag}" if tag else ""
    name += ".json"
    if not RUN_NAME.match(name):
        raise HistoryError(f"{name}: commit must be 7-40 hex digits and tag [a-z0-9-]")
    return name


@dataclasses.dataclass(frozen=True)
class Run:
    """One saved run: its file, what its name says, and its pytest-benchmark JSON."""

    path: Path
    saved: datetime
    commit: str
    dirty: bool
    tag: str | None
    data: dict = dataclasses.field(repr=False, compare=False)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def label(self) -> str:
        """``commit`` (with ``-dirty``) and the date, for tables and plot axes."""
        return f"{self.commit[:7]}{'-dirty' if self.dirty else ''} {self.saved:%Y-%m-%d}"

    @property
    def note(self) -> str | None:
        return self.data.get("note")

    @property
    def cases(self) -> dict[str, dict]:
        """fullname -> the case's JSON (``stats``, ``extra_info``, ``params``, ...)."""
        return {bench["fullname"]: bench for bench in self.data["benchmarks"]}

    def value(self, case: str, statistic: str) -> float:
        """The case's ``statistic`` in seconds."""
        return float(self.cases[case]["stats"][statistic])


def _check_run_json(path: Path, data) -> None:
    def fail(why):
        raise HistoryError(f"{path}: {why}")

    if not isinstance(data, dict):
        fail("not a JSON object")
    for key in ("machine_info", "commit_info", "benchmarks", "datetime", "version"):
        if key not in data:
            fail(f"missing {key!r} (not pytest-benchmark's JSON)")
    benches = data["benchmarks"]
    if not isinstance(benches, list) or not benches:
        fail("'benchmarks' must be a non-empty list")
    seen = set()
    for bench in benches:
        name = bench.get("fullname") if isinstance(bench, dict) else None
        if not isinstance(name, str):
            fail("a benchmark without a 'fullname'")
        if name in seen:
            fail(f"{name} appears twice")
        seen.add(name)
        stats = bench.get("stats")
        if not isinstance(stats, dict):
            fail(f"{name}: no 'stats'")
        for key in _STATS:
            value = stats.get(key)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                fail(f"{name}: stats[{key!r}] must be a finite number >= 0, got {value!r}")
        if stats["min"] <= 0 or not stats["min"] <= stats["median"] <= stats["max"]:
            fail(f"{name}: stats must satisfy 0 < min <= median <= max")
        if not isinstance(stats.get("rounds"), int) or stats["rounds"] < 1:
            fail(f"{name}: stats['rounds'] must be a positive int")


def load_run(path: Path) -> Run:
    """Parse and check one run file (its name, then its JSON); raises HistoryError."""
    path = Path(path)
    match = RUN_NAME.match(path.name)
    if not match:
        raise HistoryError(f"{path}: not a run file name "
                           "(<YYYYMMDDTHHMMSSZ>_<commit>[-dirty][_<tag>].json)")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise HistoryError(f"{path}: does not parse: {error}") from error
    _check_run_json(path, data)
    commit = match["commit"]
    recorded = str(data["commit_info"].get("id", ""))
    if not recorded.startswith(commit):
        raise HistoryError(f"{path}: the name says commit {commit}, "
                           f"commit_info['id'] is {recorded!r}")
    saved = datetime.strptime(match["saved"], _STAMP).replace(tzinfo=timezone.utc)
    return Run(path=path, saved=saved, commit=commit, dirty=bool(match["dirty"]),
               tag=match["tag"], data=data)


def machine_dirs(root: Path = RESULTS) -> list[Path]:
    """The directories of ``root`` that hold runs or a noise measurement."""
    return sorted(d for d in Path(root).iterdir() if d.is_dir() and (
        (d / NOISE_FILE).exists() or any(RUN_NAME.match(f.name) for f in d.iterdir())))


def load_history(machine_dir: Path) -> list[Run]:
    """Every run of a machine, oldest first. Raises HistoryError for a file that is
    neither a run nor one of ``OTHER_FILES`` nor a current topic file (``CURRENT_NAME``),
    a run that does not parse, or a run whose
    ``machine_info["machine"]`` is not the directory's name."""
    machine_dir = Path(machine_dir)
    runs = []
    for path in sorted(machine_dir.iterdir()):
        if path.name in OTHER_FILES or CURRENT_NAME.match(path.name):
            continue
        run = load_run(path)
        recorded = run.data["machine_info"].get("machine")
        if recorded != machine_dir.name:
            raise HistoryError(f"{path}: machine_info['machine'] is {recorded!r}, "
                               f"the directory is {machine_dir.name!r}")
        runs.append(run)
    return sorted(runs, key=lambda r: (r.saved, r.name))


@dataclasses.dataclass(frozen=True)
class Noise:
    """A machine's run-to-run noise: the spread of each case (percent) over ``runs``,
    and the threshold it gives."""

    statistic: str
    runs: tuple[str, ...]
    spreads: dict[str, float]
    threshold_percent: int
    note: str = ""

    @property
    def widest(self) -> tuple[str, float]:
        """The case with the largest spread and that spread (it sets the threshold)."""
        case = max(self.spreads, key=self.spreads.get)
        return case, self.spreads[case]


def measure_noise(runs: list[Run], statistic: str, note: str = "") -> Noise:
    """Each case's spread ``100 * (max / min - 1)`` of ``statistic`` over the runs that
    hold it (at least two), and the threshold ``ceil`` of the largest spread (at least
    1%). The runs must measure unchanged code."""
    if statistic not in _STATS:
        raise HistoryError(f"statistic must be one of {_STATS}, got {statistic!r}")
    values: dict[str, list[float]] = {}
    for run in runs:
        for case in run.cases:
            values.setdefault(case, []).append(run.value(case, statistic))
    spreads = {case: 100 * (max(v) / min(v) - 1) for case, v in sorted(values.items())
               if len(v) >= 2}
    if not spreads:
        raise HistoryError("measuring noise needs two runs that share a case")
    threshold = max(1, math.ceil(max(spreads.values())))
    return Noise(statistic=statistic, runs=tuple(run.name for run in runs),
                 spreads=spreads, threshold_percent=threshold, note=note)


def write_noise(machine_dir: Path, noise: Noise) -> Path:
    path = Path(machine_dir) / NOISE_FILE
    case, spread = noise.widest
    body = {
        "statistic": noise.statistic,
        "threshold_percent": noise.threshold_percent,
        "rule": "ceil of the largest spread 100 * (max / min - 1) of one case's statistic "
                "over the runs below (runs of unchanged code)",
        "widest": {"case": case, "spread_percent": round(spread, 2)},
        "runs": list(noise.runs),
        "note": noise.note,
        "spread_percent": {c: round(s, 2) for c, s in noise.spreads.items()},
    }
    path.write_text(json.dumps(body, indent=1) + "\n")
    return path


def load_noise(machine_dir: Path, runs: list[Run] | None = None) -> Noise:
    """Read ``noise.json`` and re-measure it from the runs it lists: a missing run, or a
    threshold or spread that the runs do not give, raises HistoryError."""
    machine_dir = Path(machine_dir)
    path = machine_dir / NOISE_FILE
    if not path.exists():
        raise HistoryError(f"{path}: missing: no noise measurement, so no threshold "
                           "(measure one with `make bench-noise`, benchmarks/README.md)")
    try:
        body = json.loads(path.read_text())
        statistic, listed = body["statistic"], body["runs"]
        stored_threshold, stored_spreads = body["threshold_percent"], body["spread_percent"]
    except (ValueError, KeyError, TypeError) as error:
        raise HistoryError(f"{path}: does not parse: {error!r}") from error
    by_name = {run.name: run for run in (runs if runs is not None else load_history(machine_dir))}
    missing = [name for name in listed if name not in by_name]
    if missing:
        raise HistoryError(f"{path}: lists runs that are not in {machine_dir}: {missing}")
    noise = measure_noise([by_name[name] for name in listed], statistic, body.get("note", ""))
    if noise.threshold_percent != stored_threshold:
        raise HistoryError(f"{path}: threshold_percent is {stored_threshold}, its runs give "
                           f"{noise.threshold_percent}")
    drift = {c: (stored_spreads.get(c), round(s, 2)) for c, s in noise.spreads.items()
             if stored_spreads.get(c) != round(s, 2)}
    if drift or set(stored_spreads) != set(noise.spreads):
        raise HistoryError(f"{path}: spread_percent differs from its runs' (stored, measured): "
                           f"{drift or sorted(set(stored_spreads) ^ set(noise.spreads))}")
    return noise


@dataclasses.dataclass(frozen=True)
class Accepted:
    """A reviewed slowdown: the run that shows it, the cases (an fnmatch pattern on the
    case's fullname) and why it is accepted."""

    run: str
    cases: str
    reason: str

    def covers(self, change: "Change") -> bool:
        return change.newest.name == self.run and fnmatch.fnmatchcase(change.case, self.cases)


def load_accepted(machine_dir: Path) -> list[Accepted]:
    path = Path(machine_dir) / ACCEPTED_FILE
    if not path.exists():
        return []
    try:
        entries = json.loads(path.read_text())["accepted"]
        accepted = [Accepted(run=e["run"], cases=e["cases"], reason=e["reason"]) for e in entries]
    except (ValueError, KeyError, TypeError) as error:
        raise HistoryError(f"{path}: does not parse ({{'accepted': [{{run, cases, reason}}]}}): "
                           f"{error!r}") from error
    for entry in accepted:
        if not entry.reason.strip():
            raise HistoryError(f"{path}: the entry for {entry.run} {entry.cases} gives no reason")
    return accepted


@dataclasses.dataclass(frozen=True)
class Change:
    """A case's newest result against the one before it, on one statistic."""

    case: str
    previous: Run
    newest: Run
    statistic: str

    @property
    def ratio(self) -> float:
        return self.newest.value(self.case, self.statistic) / self.previous.value(
            self.case, self.statistic)

    @property
    def percent(self) -> float:
        return 100 * (self.ratio - 1)

    def describe(self) -> str:
        old = self.previous.value(self.case, self.statistic) * 1e6
        new = self.newest.value(self.case, self.statistic) * 1e6
        return (f"{self.case}: {self.statistic} {old:.4g} us ({self.previous.name}) -> "
                f"{new:.4g} us ({self.newest.name}), {self.percent:+.1f}%")


def newest_changes(runs: list[Run], statistic: str) -> list[Change]:
    """For every case: its newest result against the newest result of an earlier commit
    (``runs`` oldest first; a case measured at one commit only has no change)."""
    holders: dict[str, list[Run]] = {}
    for run in runs:
        for case in run.cases:
            holders.setdefault(case, []).append(run)
    changes = []
    for case, held in sorted(holders.items()):
        newest = held[-1]
        earlier = [r for r in held if (r.commit, r.dirty) != (newest.commit, newest.dirty)]
        if earlier:
            changes.append(Change(case, earlier[-1], newest, statistic))
    return changes


@dataclasses.dataclass(frozen=True)
class MachineCheck:
    """The outcome of checking one machine's history."""

    machine: str
    noise: Noise
    changes: list[Change]
    slower: list[Change]                      # beyond the threshold, not accepted
    accepted: list[tuple[Change, Accepted]]   # beyond the threshold, accepted with a reason
    stale: list[Accepted]                     # entries naming a run that does not exist

    @property
    def ok(self) -> bool:
        return not self.slower and not self.stale

    def report(self) -> str:
        lines = [f"{self.machine}: {len(self.changes)} cases compared on the "
                 f"{self.noise.statistic}, threshold {self.noise.threshold_percent}% "
                 f"(noise.json: widest spread {self.noise.widest[1]:.1f}% in "
                 f"{self.noise.widest[0]})"]
        lines += [f"  SLOWER  {c.describe()}" for c in self.slower]
        lines += [f"  accepted  {c.describe()}: {a.reason}" for c, a in self.accepted]
        lines += [f"  STALE accepted.json entry: no run {a.run}" for a in self.stale]
        return "\n".join(lines)


def check_machine(machine_dir: Path) -> MachineCheck:
    """Parse every file of a machine's history, re-measure its noise, and compare each
    case's newest result with the previous one (see the module docstring)."""
    machine_dir = Path(machine_dir)
    runs = load_history(machine_dir)
    noise = load_noise(machine_dir, runs)
    accepted = load_accepted(machine_dir)
    names = {run.name for run in runs}
    changes = newest_changes(runs, noise.statistic)
    slower, passed = [], []
    for change in changes:
        if change.percent <= noise.threshold_percent:
            continue
        entry = next((a for a in accepted if a.covers(change)), None)
        if entry is None:
            slower.append(change)
        else:
            passed.append((change, entry))
    stale = [a for a in accepted if a.run not in names]
    return MachineCheck(machine=machine_dir.name, noise=noise, changes=changes,
                        slower=slower, accepted=passed, stale=stale)


def percent_slower(baseline_s: float, current_s: float) -> float:
    """``100 * current / baseline - 100``, as pytest-benchmark's ``PercentageRegressionCheck``
    computes it (infinite for a zero baseline)."""
    return math.inf if not baseline_s else current_s / baseline_s * 100 - 100


def slower_cases(baseline: Run, current: dict, statistic: str,
                 threshold_percent: float) -> dict[str, tuple[float, float]]:
    """The cases of ``current`` (pytest-benchmark's JSON) slower than in ``baseline`` by
    more than ``threshold_percent`` on ``statistic``: fullname -> (baseline seconds,
    current seconds). A case that ``baseline`` lacks is not compared; one exactly at the
    threshold is not slower."""
    base = baseline.cases
    slower = {}
    for bench in current.get("benchmarks", []):
        case = bench["fullname"]
        if case not in base:
            continue
        old = float(base[case]["stats"][statistic])
        new = float(bench["stats"][statistic])
        if percent_slower(old, new) > threshold_percent:
            slower[case] = (old, new)
    return slower


@dataclasses.dataclass(frozen=True)
class Confirmation:
    """The outcome of ``confirm_slower``: every case slower in the first run, its baseline
    figure and its figure in each run it was asked for (None: that run did not measure
    it), and those slower in every one of ``runs`` runs."""

    baseline: str                                        # the baseline run's file name
    statistic: str
    threshold_percent: float
    runs: int                                            # CONFIRM_RUNS
    figures: dict[str, tuple[float, list[float | None]]]
    confirmed: tuple[str, ...]

    @property
    def unconfirmed(self) -> list[str]:
        """Slower in the first run, not in a later one: noise."""
        return [case for case in self.figures if case not in self.confirmed]

    @property
    def ok(self) -> bool:
        return not self.confirmed

    def _figures(self, case: str) -> str:
        old, news = self.figures[case]
        shown = [f"{new * 1e6:.4g} us ({percent_slower(old, new):+.1f}%)" if new is not None
                 else "not measured" for new in news]
        return (f"{case}: {self.statistic} {old * 1e6:.4g} us ({self.baseline}) -> "
                + ", ".join(f"run {i}: {text}" for i, text in enumerate(shown, 1)))

    def report(self) -> list[str]:
        """One line per confirmed regression (``SLOWER``: the baseline figure, each run's
        figure and percent, the least of them) and one per unconfirmed case (``noise``)."""
        lines = []
        for case in self.confirmed:
            old, news = self.figures[case]
            measured = [new for new in news if new is not None]
            least = (f"; at least {percent_slower(old, min(measured)):+.1f}%" if measured
                     else "")
            lines.append(f"SLOWER  {self._figures(case)}{least}: beyond "
                         f"{self.threshold_percent}% in each of {self.runs} runs")
        for case in self.unconfirmed:
            slow = sum(1 for new in self.figures[case][1] if new is not None and
                       percent_slower(self.figures[case][0], new) > self.threshold_percent)
            lines.append(f"noise   {self._figures(case)}: beyond {self.threshold_percent}% "
                         f"in {slow} of {len(self.figures[case][1])} runs, not confirmed "
                         "(not a regression)")
        return lines


def confirm_slower(baseline: Run, first: dict, statistic: str, threshold_percent: float,
                   rerun, runs: int = CONFIRM_RUNS) -> Confirmation:
    """Apply the confirmation rule (module docstring) to ``first``, the pytest-benchmark
    JSON of a run of the whole suite: ``rerun(node_ids)`` makes one more separate pytest
    run of only those cases (their fullnames) and returns its JSON (None when nothing
    ran); it is called with the cases still slower, at most ``runs - 1`` times, and not
    once none is left."""
    slow = slower_cases(baseline, first, statistic, threshold_percent)
    figures = {case: (old, [new]) for case, (old, new) in sorted(slow.items())}
    still = sorted(slow)
    for _ in range(runs - 1):
        if not still:
            break
        data = rerun(list(still)) or {}
        measured = {bench["fullname"]: float(bench["stats"][statistic])
                    for bench in data.get("benchmarks", [])}
        slow = slower_cases(baseline, data, statistic, threshold_percent)
        for case in still:
            figures[case][1].append(measured.get(case))
        still = [case for case in still if case in slow or case not in measured]
    return Confirmation(baseline=baseline.name, statistic=statistic,
                        threshold_percent=threshold_percent, runs=runs, figures=figures,
                        confirmed=tuple(still))
