"""Run a benchmark suite, save it into its machine's history, compare it with the newest
baseline of that machine (``benchmarks.history`` says how the threshold is measured).

    python -m benchmarks.run gpu record            # make bench: run, save, compare
    python -m benchmarks.run gpu noise --runs 3    # make bench-noise: runs + noise.json
    python -m benchmarks.run cpu check             # CI: run, compare, save nothing
    python -m benchmarks.run cpu noise --runs 5 --fresh   # a new CPU baseline and its noise

Suites: ``gpu`` runs the cases marked ``benchmark_gpu`` (the fast kernels' device time),
``cpu`` those marked ``benchmark_cpu`` (the reference stages' CPU cost).

The comparison (``check`` and ``record``): the whole suite runs once with
pytest-benchmark's ``--benchmark-compare`` against the newest run file of the machine (it
prints the table); the verdict is this module's, not ``--benchmark-compare-fail``'s. A
case slower than the baseline by more than the threshold (``noise.json``) on the
statistic is rerun alone, by its pytest node id, in separate pytest runs, and counts as a
regression only when it is still slower beyond the threshold in each of
``history.CONFIRM_RUNS`` (3) runs; reruns stop as soon as no case is left
(``history.confirm_slower``; on the CPU's ``min`` this is the fastest round of all runs,
on the GPU's ``median`` slower in every run). A single slow sample on a loaded machine
therefore does not fail; each confirmed regression is printed with the baseline figure
and each run's figure, each unconfirmed one as a ``noise`` line. ``record`` saves the
first run only. The command fails on a confirmed regression, on a failed case (in any
run), and when no benchmark ran (status 5).

A saved GPU run carries the SASS digests of the kernels it timed (``"sass_digest"``,
``benchmarks.sass_check``), compiled on the CPU from the measured tree for the GPU's
architecture after the run: the performance page compares them with the current tree's.

Without git (a copy of the tree on a GPU node), pass ``--commit`` (``<sha>`` or
``<sha>-dirty``, e.g. from ``git describe --always --dirty --abbrev=12`` where the copy
was made).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from benchmarks import history, provenance

ROOT = Path(__file__).resolve().parent.parent
MARKERS = {"gpu": "benchmark_gpu", "cpu": "benchmark_cpu"}
#: Suites whose saved runs keep only the statistics, as ``--benchmark-save`` writes them:
#: a CPU case has hundreds of rounds (200 KB of timings per run), its figure is the min.
STATS_ONLY = {"cpu"}


def drop_round_data(path: Path) -> None:
    """Remove each case's per-round ``stats["data"]`` from a saved run."""
    data = json.loads(path.read_text())
    for bench in data["benchmarks"]:
        bench["stats"].pop("data", None)
    path.write_text(json.dumps(data, indent=4) + "\n")


def record_sass_digest(paths: list[Path]) -> None:
    """Record the SASS digests of the kernels the GPU cases time (this tree, this GPU's
    architecture) with each saved run in ``paths`` (``benchmarks.sass_check``)."""
    from benchmarks import sass_check
    from fast import backend

    arch = backend.gpu_arch()
    print(f"benchmarks.run: compiling the SASS digests ({arch}) to record with the run",
          flush=True)
    lines = sass_check.current_digests(arch)
    for path in paths:
        sass_check.record(path, arch, lines, "compiled on the CPU from the measured tree by "
                          "benchmarks.run when the run was saved")


def resolve_commit(given: str | None) -> tuple[str, bool]:
    """(commit, dirty) from ``--commit``/``BENCH_COMMIT`` (``<sha>[-dirty]``), else git."""
    given = given or os.environ.get("BENCH_COMMIT")
    if given:
        sha, _, flag = given.partition("-")
        return sha, flag == "dirty"
    try:
        return provenance.git_head(ROOT)
    except (OSError, subprocess.CalledProcessError) as error:
        raise SystemExit(f"benchmarks.run: no git commit here ({error}); pass --commit "
                         "<sha>[-dirty] of the tree being measured") from error


def run_pytest(suite: str, out: Path, *, machine: str, commit: str | None, dirty: bool,
               baseline: history.Run | None = None, targets: list[str] = ("benchmarks/",),
               extra: list[str] = ()) -> int:
    """One pytest run of the suite's cases among ``targets`` (paths or node ids) writing
    ``out``; its comparison table against ``baseline`` printed when given (the verdict is
    ``history.confirm_slower``'s); ``commit`` None leaves pytest-benchmark's own commit
    info. Returns pytest's exit status, or 5 when no benchmark ran."""
    command = [sys.executable, "-m", "pytest", *targets, "-m", MARKERS[suite], "-q",
               "-p", "no:cacheprovider", f"--benchmark-json={out}",
               "--benchmark-columns=min,median,max,rounds", *extra]
    if baseline is not None:
        command.append(f"--benchmark-compare={baseline.path}")
    env = dict(os.environ, BENCH_MACHINE=machine)
    if commit is not None:
        env.update(BENCH_COMMIT=commit, BENCH_DIRTY="1" if dirty else "0")
    print("+", " ".join(command), flush=True)
    status = subprocess.run(command, cwd=ROOT, env=env).returncode
    ran = out.exists() and json.loads(out.read_text()).get("benchmarks")
    if not ran:
        print(f"benchmarks.run: no {suite} benchmark ran (pytest status {status}); "
              "the skip reasons are above", file=sys.stderr)
        return status or 5
    return status


def _read_run(path: Path) -> dict | None:
    """The pytest-benchmark JSON at ``path`` if it holds a benchmark, else None."""
    data = json.loads(path.read_text()) if path.exists() else None
    return data if data and data.get("benchmarks") else None


def confirm(suite: str, first: dict, baseline: history.Run, noise: history.Noise, tmp: Path,
            *, machine: str, extra: list[str]) -> tuple[history.Confirmation, int]:
    """The confirmation rule on the first run's JSON: the still-slower cases rerun by
    node id into ``tmp``; returns the outcome and the worst pytest status of the reruns
    (0 when all passed or none was needed)."""
    statuses = []

    def rerun(cases: list[str]) -> dict | None:
        attempt = len(statuses) + 2
        print(f"benchmarks.run: run {attempt} of at most {history.CONFIRM_RUNS}: "
              f"{len(cases)} case(s) still slower than {baseline.name} by more than "
              f"{noise.threshold_percent}%, rerun alone", flush=True)
        out = tmp / f"run-{attempt}.json"
        statuses.append(run_pytest(suite, out, machine=machine, commit=None, dirty=False,
                                   targets=cases, extra=extra))
        return _read_run(out)

    outcome = history.confirm_slower(baseline, first, noise.statistic,
                                     noise.threshold_percent, rerun)
    for line in outcome.report():
        print(f"benchmarks.run: {line}", file=sys.stderr if line.startswith("SLOWER") else
              sys.stdout, flush=True)
    return outcome, max(statuses, default=0)


def _compare_note(suite, baseline, noise, failed: bool, saved: Path | None) -> None:
    where = f"benchmarks/results/{baseline.path.parent.name}"
    confirmed = f"in each of {history.CONFIRM_RUNS} runs"
    if not failed:
        print(f"benchmarks.run: no case slower than {baseline.name} by more than "
              f"{noise.threshold_percent}% {confirmed} ({noise.statistic}; threshold from "
              f"{where}/noise.json)")
        return
    print(f"benchmarks.run: FAILED against {baseline.name}: a case is slower by more than "
          f"{noise.threshold_percent}% {confirmed} ({noise.statistic}; threshold from "
          f"{where}/noise.json), or a case failed (see above).", file=sys.stderr)
    if saved is not None:
        print(f"The run is saved as {saved.relative_to(ROOT)}. An intended slowdown is "
              f"committed with an entry in {where}/accepted.json saying why.", file=sys.stderr)
    else:
        print(f"An intended slowdown: record new runs on this machine (`python -m "
              f"benchmarks.run {suite} noise --runs 5 --fresh`) and commit them with an "
              f"entry in {where}/accepted.json saying why.", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except history.HistoryError as error:
        print(f"benchmarks.run: {error}", file=sys.stderr)
        return 2


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", choices=sorted(MARKERS))
    parser.add_argument("mode", choices=("record", "check", "noise"),
                        help="record: run, save, compare; check: run, compare, save nothing; "
                             "noise: --runs runs saved, then noise.json")
    parser.add_argument("--runs", type=int, default=3, help="noise: runs to make (default 3)")
    parser.add_argument("--fresh", action="store_true",
                        help="noise: measure on the new runs only (default: with the runs "
                             "noise.json already lists)")
    parser.add_argument("--note", default="", help="noise: how the runs were made")
    parser.add_argument("--machine", help="history directory (default: from the hardware)")
    parser.add_argument("--commit", help="<sha>[-dirty] measured (default: git)")
    parser.add_argument("--without-baseline", choices=("fail", "run"), default="fail",
                        help="check on a machine with no committed history: fail (default), "
                             "or run the cases once, compare nothing and say so (make test: "
                             "timings of another processor model are no baseline)")
    parser.epilog = "Arguments after -- go to pytest (e.g. -- -k finalize)."
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    args.pytest_args = argv[cut + 1:]

    machine = args.machine or history.machine_name(gpu=args.suite == "gpu")
    machine_dir = history.RESULTS / machine
    runs = history.load_history(machine_dir) if machine_dir.exists() else []
    statistic = history.STATISTICS[args.suite]

    if args.mode == "noise":
        commit, dirty = resolve_commit(args.commit)
        machine_dir.mkdir(parents=True, exist_ok=True)
        previous = [] if args.fresh or not (machine_dir / history.NOISE_FILE).exists() else \
            [r for r in runs if r.name in history.load_noise(machine_dir, runs).runs]
        new = []
        for i in range(args.runs):
            out = machine_dir / history.run_file_name(datetime.now(timezone.utc), commit, dirty)
            status = run_pytest(args.suite, out, machine=machine, commit=commit, dirty=dirty,
                                extra=args.pytest_args)
            if status:
                return status
            if args.suite in STATS_ONLY:
                drop_round_data(out)
            new.append(history.load_run(out))
            print(f"benchmarks.run: run {i + 1}/{args.runs} saved as {out.relative_to(ROOT)}")
        if args.suite == "gpu":
            record_sass_digest([run.path for run in new])
        note = args.note or (f"{args.runs} runs of {commit[:12]}{'-dirty' if dirty else ''} "
                             f"in one session on {machine}")
        if previous:
            note = f"{history.load_noise(machine_dir, runs).note}; then {note}"
        noise = history.measure_noise(previous + new, statistic, note)
        path = history.write_noise(machine_dir, noise)
        case, spread = noise.widest
        print(f"benchmarks.run: {path.relative_to(ROOT)}: threshold {noise.threshold_percent}% "
              f"({statistic}, {len(noise.runs)} runs; widest spread {spread:.1f}% in {case})")
        return 0

    baseline = runs[-1] if runs else None
    noise = history.load_noise(machine_dir, runs) if baseline is not None else None
    if args.mode == "check":
        if baseline is None:
            advice = (f"no baseline for machine {machine!r} in benchmarks/results/{machine}/: "
                      f"record one with `python -m benchmarks.run {args.suite} noise --runs 5 "
                      f"--fresh` on this machine and commit it")
            if args.without_baseline == "fail":
                print(f"benchmarks.run: {advice}", file=sys.stderr)
                return 2
            # the cases must still run and pass; only the timing comparison is left out
            with tempfile.TemporaryDirectory() as tmp:
                status = run_pytest(args.suite, Path(tmp) / "run-1.json", machine=machine,
                                    commit=None, dirty=False, extra=args.pytest_args)
            print(f"benchmarks.run: NOT COMPARED: {advice}; the {args.suite} cases ran once "
                  f"(pytest status {status})", file=sys.stderr)
            return status
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "run-1.json"
            status = run_pytest(args.suite, out, machine=machine, commit=None, dirty=False,
                                baseline=baseline, extra=args.pytest_args)
            first = _read_run(out)
            if first is None:
                return status
            outcome, rerun_status = confirm(args.suite, first, baseline, noise, Path(tmp),
                                            machine=machine, extra=args.pytest_args)
        return _verdict(args.suite, baseline, noise, status, outcome, rerun_status, None)

    commit, dirty = resolve_commit(args.commit)
    machine_dir.mkdir(parents=True, exist_ok=True)
    out = machine_dir / history.run_file_name(datetime.now(timezone.utc), commit, dirty)
    if baseline is None:
        print(f"benchmarks.run: first run of {machine!r}: nothing to compare with")
    status = run_pytest(args.suite, out, machine=machine, commit=commit, dirty=dirty,
                        baseline=baseline, extra=args.pytest_args)
    first = _read_run(out)
    if out.exists():
        if args.suite in STATS_ONLY:
            drop_round_data(out)
        if args.suite == "gpu" and first is not None:
            record_sass_digest([out])
        print(f"benchmarks.run: saved {out.relative_to(ROOT)}")
    if baseline is None or first is None:
        return status
    with tempfile.TemporaryDirectory() as tmp:
        outcome, rerun_status = confirm(args.suite, first, baseline, noise, Path(tmp),
                                        machine=machine, extra=args.pytest_args)
    if outcome.unconfirmed:
        print(f"benchmarks.run: {out.name} keeps the first run's figures, noise "
              f"included ({len(outcome.unconfirmed)} case(s) above); the history check "
              "(benchmarks/test_history.py) compares committed runs one sample each and "
              "may flag them: record again rather than commit this run.", file=sys.stderr)
    return _verdict(args.suite, baseline, noise, status, outcome, rerun_status, out)


def _verdict(suite, baseline, noise, status: int, outcome: history.Confirmation,
             rerun_status: int, saved: Path | None) -> int:
    """The exit status: pytest's of the first run if it failed, else 1 on a confirmed
    regression, else the reruns' worst status; with ``_compare_note``'s summary."""
    code = status or (1 if not outcome.ok else rerun_status)
    _compare_note(suite, baseline, noise, code != 0, saved)
    return code


if __name__ == "__main__":
    sys.exit(main())
