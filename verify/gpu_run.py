"""The whole suite on one GPU node in two parts side by side, joined into one report.

``python -m verify.gpu_run OUT_DIR`` runs ``pytest verify/`` as two processes at once: the
small cases (``-m "not real_dimensions"``) under ``--small-workers`` pytest-xdist workers,
and the cases at the real dimensions (``-m real_dimensions``) under ``--real-workers``;
each part writes its report under ``OUT_DIR/parts/``, and the parts are joined into
``OUT_DIR/verify-report.{json,md}`` (:func:`verify.report.merge_reports`). The exit status
is the merge's: 0 when no row failed, 1 when one did, 2 when the parts cannot be joined
(a part that wrote no report, for example); and 1 where a part's pytest failed though no
row did (an error outside the contracts: see ``OUT_DIR/parts/<part>/pytest.log``).

Each real-dimension process keeps the real layer's weights it built, 15-32 GB of GPU
memory, beside the small part's dozen processes. :func:`real_dimension_workers` picks the
count from the card's memory: two on a card of at least 120 GiB (an H200's 139 GiB held two
beside the small part; three once ran out), one below (an 80 GB H100 ran out of memory in
four TP8 wide cases with two). ``OMP_NUM_THREADS`` defaults to 2 in both parts: a PyTorch
process starts a thread per core, and a dozen of them ran several times slower than one.

Where one command may run only so long (a device lease's 600 s), the run is split over
calls: ``--parts`` picks the parts a call runs and ``--real-shard I/N`` one contiguous slice
of the real-dimension cases (``verify.shard``); ``python -m verify.report merge`` joins the
calls' ``verify-report.json`` into one report, which refuses parts of two commits or
machines. On an 80 GB H100 with one real-dimension worker the real part ran 454 of its 458
cases in 520 s, and the last four take about 120 s more (every module builds its own real
layers since they are released at its end): more than a 600-s call, so::

    python -m verify.gpu_run run1 --real-shard 1/2                 # small part + real slice 1
    python -m verify.gpu_run run2 --parts real --real-shard 2/2    # real slice 2
    python -m verify.report merge merged run1/verify-report.json run2/verify-report.json
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from verify.shard import parse_shard

__all__ = ["PARTS", "real_dimension_workers", "part_commands", "main"]

#: The card memory from which two real-dimension workers fit beside the small part.
TWO_REAL_WORKERS_FROM_GIB = 120
#: The two parts of a whole run.
PARTS = ("small", "real")
#: Cases each part's log lists as its slowest (pytest ``--durations``).
SLOWEST_LISTED = 25


def real_dimension_workers(total_memory_bytes: int) -> int:
    """Real-dimension pytest workers for a card of ``total_memory_bytes``: 2 from
    :data:`TWO_REAL_WORKERS_FROM_GIB` GiB, else 1. Raises ValueError for a non-positive size."""
    if total_memory_bytes <= 0:
        raise ValueError(f"total_memory_bytes must be positive, got {total_memory_bytes}")
    return 2 if total_memory_bytes >= TWO_REAL_WORKERS_FROM_GIB * 2**30 else 1


def part_commands(out_dir: Path, small_workers: int, real_workers: int,
                  extra: list[str] | None = None, parts: Sequence[str] = PARTS,
                  real_shard: str | None = None) -> dict[str, tuple[list[str], Path]]:
    """``{part: (pytest command, report directory)}`` of the ``parts`` asked for (``small``,
    ``real`` or both); ``extra`` arguments go to each (``-k``, ``--backend``); ``real_shard``
    (``"I/N"``) runs only that slice of the real-dimension cases (``verify.shard``). Each
    command lists its slowest cases at the end of its log (``--durations``). Raises
    ValueError for a worker count below 1, an unknown or no part, or a bad shard."""
    for name, n in (("small_workers", small_workers), ("real_workers", real_workers)):
        if n < 1:
            raise ValueError(f"{name} must be at least 1, got {n}")
    if not parts or set(parts) - set(PARTS):
        raise ValueError(f"parts must be some of {PARTS}, got {tuple(parts)}")
    shard = []
    if real_shard is not None:
        parse_shard(real_shard)
        shard = ["--shard", real_shard]
    base = [sys.executable, "-m", "pytest", "verify/", "-q", "-p", "no:cacheprovider",
            f"--durations={SLOWEST_LISTED}"]
    chosen = {"small": ('not real_dimensions', small_workers, []),
              "real": ("real_dimensions", real_workers, shard)}
    return {name: ([*base, "-m", marker, "-n", str(n), *more, *(extra or [])], out_dir / "parts" / name)
            for name, (marker, n, more) in chosen.items() if name in parts}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m verify.gpu_run", description=__doc__.split("\n")[0],
                                 epilog="arguments after -- go to pytest in both parts")
    ap.add_argument("out_dir", type=Path, help="where the parts' and the joined reports go")
    ap.add_argument("--small-workers", type=int, default=12)
    ap.add_argument("--real-workers", type=int, default=None,
                    help="default: real_dimension_workers(the card's memory)")
    ap.add_argument("--parts", default="small,real",
                    help="comma-separated parts to run: small, real (default: both)")
    ap.add_argument("--real-shard", default=None, metavar="I/N",
                    help="only the I-th of N slices of the real-dimension cases (a run split "
                         "over calls of limited time; join the calls' reports with "
                         "python -m verify.report merge)")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    real = args.real_workers
    if real is None:
        import torch

        if not torch.cuda.is_available():
            print("verify.gpu_run: no CUDA device; run `pytest verify/` (make verify)", file=sys.stderr)
            return 2
        real = real_dimension_workers(torch.cuda.get_device_properties(0).total_memory)
    try:
        commands = part_commands(args.out_dir, args.small_workers, real, extra,
                                 tuple(p for p in args.parts.split(",") if p), args.real_shard)
    except ValueError as e:
        ap.error(str(e))
    root = Path(__file__).resolve().parents[1]
    procs = {}
    for name, (command, report_dir) in commands.items():
        report_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, LATENTMOE_REPORT_DIR=str(report_dir))
        env.setdefault("OMP_NUM_THREADS", "2")
        log = open(report_dir / "pytest.log", "w")
        print(f"{name}: {' '.join(command[1:])} > {log.name}", flush=True)
        procs[name] = (subprocess.Popen(command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT), log)
    failed_parts = []
    for name, (proc, log) in procs.items():
        code = proc.wait()
        log.close()
        print(f"{name}: pytest exit {code}", flush=True)
        if code not in (0, 5):  # 5: the part selected no case (a -k that matches none there)
            failed_parts.append(name)
    from verify import report

    status = report.main(["merge", str(args.out_dir),
                          *(str(d / "verify-report.json") for _, d in commands.values())])
    if failed_parts and status == 0:
        print(f"verify.gpu_run: pytest failed in {', '.join(failed_parts)} (see its pytest.log) "
              f"though no report row did", file=sys.stderr)
        return 1
    return status


if __name__ == "__main__":
    raise SystemExit(main())
