"""Run a benchmark suite, save it into its machine's history, compare it with the newest
baseline of that machine (``benchmarks.history`` says how the threshold is measured).

    python -m benchmarks.run gpu record            # make bench: run, save, compare
    python -m benchmarks.run gpu noise --runs 3    # make bench-noise: runs + noise.json
    python -m benchmarks.run cpu check             # CI: run, compare, save nothing
    python -m benchmarks.run cpu noise --runs 5 --fresh   # a new CPU baseline and its noise

Suites: ``gpu`` runs the cases marked ``benchmark_gpu`` (the fast kernels' device time),
``cpu`` those marked ``benchmark_cpu`` (the reference stages' CPU cost). The comparison is
pytest-benchmark's own (``--benchmark-compare`` with the newest run file,
``--benchmark-compare-fail=<statistic>:<threshold>%``). A run in which no benchmark ran
fails. Without git (a copy of the tree on a GPU node), pass ``--commit`` (``<sha>`` or
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

from benchmarks import history

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


def resolve_commit(given: str | None) -> tuple[str, bool]:
    """(commit, dirty) from ``--commit``/``BENCH_COMMIT`` (``<sha>[-dirty]``), else git."""
    given = given or os.environ.get("BENCH_COMMIT")
    if given:
        sha, _, flag = given.partition("-")
        return sha, flag == "dirty"
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                cwd=ROOT, check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        raise SystemExit(f"benchmarks.run: no git commit here ({error}); pass --commit "
                         "<sha>[-dirty] of the tree being measured") from error
    return sha, bool(status.strip())


def run_pytest(suite: str, out: Path, *, machine: str, commit: str | None, dirty: bool,
               baseline: history.Run | None = None, noise: history.Noise | None = None,
               extra: list[str] = ()) -> int:
    """One pytest run of the suite writing ``out``; compared when ``baseline`` is given;
    ``commit`` None leaves pytest-benchmark's own commit info. Returns pytest's exit
    status, or 5 when no benchmark ran."""
    command = [sys.executable, "-m", "pytest", "benchmarks/", "-m", MARKERS[suite], "-q",
               "-p", "no:cacheprovider", f"--benchmark-json={out}",
               "--benchmark-columns=min,median,max,rounds", *extra]
    if baseline is not None:
        command += [f"--benchmark-compare={baseline.path}",
                    f"--benchmark-compare-fail={noise.statistic}:{noise.threshold_percent}%"]
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


def _compare_note(suite, baseline, noise, status, saved: Path | None) -> None:
    where = f"benchmarks/results/{baseline.path.parent.name}"
    if status == 0:
        print(f"benchmarks.run: no case slower than {baseline.name} by more than "
              f"{noise.threshold_percent}% ({noise.statistic}; threshold from {where}/noise.json)")
        return
    print(f"benchmarks.run: FAILED against {baseline.name}: a case is slower by more than "
          f"{noise.threshold_percent}% ({noise.statistic}; threshold from {where}/noise.json), "
          "or a case failed (see above).", file=sys.stderr)
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
            print(f"benchmarks.run: no baseline for machine {machine!r} in "
                  f"benchmarks/results/{machine}/: record one with `python -m benchmarks.run "
                  f"{args.suite} noise --runs 5 --fresh` on this machine and commit it",
                  file=sys.stderr)
            return 2
        with tempfile.TemporaryDirectory() as tmp:
            status = run_pytest(args.suite, Path(tmp) / "run.json", machine=machine,
                                commit=None, dirty=False, baseline=baseline, noise=noise,
                                extra=args.pytest_args)
        if status != 5:
            _compare_note(args.suite, baseline, noise, status, None)
        return status

    commit, dirty = resolve_commit(args.commit)
    machine_dir.mkdir(parents=True, exist_ok=True)
    out = machine_dir / history.run_file_name(datetime.now(timezone.utc), commit, dirty)
    if baseline is None:
        print(f"benchmarks.run: first run of {machine!r}: nothing to compare with")
    status = run_pytest(args.suite, out, machine=machine, commit=commit, dirty=dirty,
                        baseline=baseline, noise=noise, extra=args.pytest_args)
    if out.exists():
        if args.suite in STATS_ONLY:
            drop_round_data(out)
        print(f"benchmarks.run: saved {out.relative_to(ROOT)}")
    if baseline is not None and status != 5:
        _compare_note(args.suite, baseline, noise, status, out if out.exists() else None)
    return status


if __name__ == "__main__":
    sys.exit(main())
