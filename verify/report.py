"""The verification report: one row per (contract, backend, config), aggregated over the
cases (batches, rank counts, orderings) that ran.

Each contract test records what it compared through the ``contract`` fixture
(``verify/conftest.py``); the pytest hooks there add the outcome of the test and, at the
end of the session, print :func:`format_table` and write ``verify-report.json`` and
``verify-report.md`` (:func:`write_report`).

A run over pytest-xdist workers (``pytest verify/ -n 8``) is joined by the
controller: each worker hands its payload over when it finishes (``verify/conftest.py``),
and the controller merges them (:func:`merge_reports`) into the one report it prints and
writes. A suite run in parts (one pytest process per file or group, each with its own
``LATENTMOE_REPORT_DIR``: a job time limit, or one GPU per part) is joined the same way
from the command line::

    python -m verify.report merge OUT_DIR PART/verify-report.json ...

It refuses parts of another commit, device or software version, and exits 1 when a row
failed (2 when the parts cannot be joined).

A report names the commit it tested as the benchmarks name theirs
(``benchmarks.provenance.tree_commit``): a copy of the tree made by ``git archive`` for a
GPU node carries a ``COMMIT`` file, which wins over the git of any checkout the copy sits in.

A row's columns:

* ``cases`` / ``passed`` / ``failed`` / ``skipped`` — test cases of that row and their
  outcomes (a skip carries its reason into ``skip_reasons``);
* ``bitwise`` — how many bitwise comparisons were made (all must be equal to pass);
* ``worst_ulp`` — the largest ULP distance seen by a ULP comparison;
* ``worst_ratio`` — the largest ``|actual - exact| / bound`` seen by a bounded comparison
  (a pass needs every ratio <= 1), with ``bound`` naming the bound that was used;
* ``flips`` — routing decisions that differ from the reference and were accepted because
  the competing scores lie within the logits' error bound (``verify.routing``);
* ``figures`` — tracked figures (SQNR, shares of outputs off the reference's bits), the
  worst over the row's cases; ``n/a`` where a figure is 0 by construction (the reference
  compared with itself).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from pathlib import Path


@dataclasses.dataclass
class Row:
    """Aggregated figures of one (contract, backend, config) row."""

    contract: str
    backend: str
    config: str
    cases: int = 0
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    bitwise: int = 0
    worst_ulp: int | None = None
    worst_ratio: float | None = None
    bound: str | None = None
    flips: int = 0
    decisions: int = 0
    figures: dict = dataclasses.field(default_factory=dict)
    #: per figure, which end is the worst ("min" or "max"): how parts of a run are joined
    figure_worst: dict = dataclasses.field(default_factory=dict)
    skip_reasons: list = dataclasses.field(default_factory=list)
    failures: list = dataclasses.field(default_factory=list)

    def add_comparison(self, kind: str, *, worst_ulp=None, worst_ratio=None, bound=None):
        if kind == "bitwise":
            self.bitwise += 1
        if worst_ulp is not None:
            self.worst_ulp = max(self.worst_ulp or 0, int(worst_ulp))
        if worst_ratio is not None and not math.isnan(worst_ratio):
            self.worst_ratio = max(self.worst_ratio or 0.0, float(worst_ratio))
        if bound is not None:
            self.bound = bound

    def add_figure(self, name: str, value: float | None, *, worst: str):
        """Keep the worst value of a tracked figure (``worst`` is "min" or "max"); ``None``
        marks a figure that does not apply to this row (0 by construction), shown "n/a"."""
        if worst not in ("min", "max"):
            raise ValueError(f"add_figure: worst must be 'min' or 'max', got {worst!r}")
        self.figure_worst.setdefault(name, worst)
        if value is None:
            self.figures.setdefault(name, None)
            return
        old = self.figures.get(name)
        if old is None:
            self.figures[name] = value
        else:
            self.figures[name] = min(old, value) if worst == "min" else max(old, value)

    def merge(self, other: "Row") -> None:
        """Add the cases of ``other`` (the same contract, backend and config, from another
        part of the run): counts add up, the worst ULP, bound ratio and figures are the
        worse of the two, skip reasons and failing node ids are joined."""
        if (other.contract, other.backend, other.config) != (self.contract, self.backend,
                                                              self.config):
            raise ValueError(f"Row.merge: {other.contract}/{other.backend}/{other.config} is "
                             f"not {self.contract}/{self.backend}/{self.config}")
        for name in ("cases", "passed", "failed", "skipped", "bitwise", "flips", "decisions"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        if other.worst_ulp is not None:
            self.worst_ulp = max(self.worst_ulp or 0, other.worst_ulp)
        if other.worst_ratio is not None:
            self.worst_ratio = max(self.worst_ratio or 0.0, other.worst_ratio)
        self.bound = self.bound or other.bound
        for name, value in other.figures.items():
            worst = other.figure_worst.get(name) or self.figure_worst.get(name)
            if name not in self.figures:  # nothing to compare with: taken as it is
                self.figures[name] = value
                if worst is not None:
                    self.figure_worst[name] = worst
                continue
            if worst is None:
                raise ValueError(f"Row.merge: figure {name!r} of {self.contract} has a value "
                                 f"in both parts and neither says which end is the worst (a "
                                 f"report written before figure_worst was recorded)")
            self.add_figure(name, value, worst=worst)
        self.skip_reasons += [r for r in other.skip_reasons if r not in self.skip_reasons]
        self.failures += [n for n in other.failures if n not in self.failures]

    @classmethod
    def from_dict(cls, data: dict) -> "Row":
        """A row as ``verify-report.json`` lists it (its ``status`` is recomputed)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})

    def status(self) -> str:
        if self.failed:
            return "FAIL"
        if self.passed:
            return "pass"
        return "skip"


class Report:
    """Collects rows while the session runs, and what each backend of the run is:
    ``backends`` maps its name to its version, source (built-in, entry point, import
    path), devices and claims, so that a row can be cited with the code it checked."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str, str], Row] = {}
        self.backends: dict[str, dict] = {}

    def row(self, contract: str, backend: str, config: str) -> Row:
        key = (contract, backend, config)
        if key not in self.rows:
            self.rows[key] = Row(contract, backend, config)
        return self.rows[key]

    def outcome(self, row: Row, outcome: str, *, reason: str | None = None, nodeid: str = ""):
        row.cases += 1
        if outcome == "passed":
            row.passed += 1
        elif outcome == "failed":
            row.failed += 1
            row.failures.append(nodeid)
        else:
            row.skipped += 1
            if reason and reason not in row.skip_reasons:
                row.skip_reasons.append(reason)

    def sorted_rows(self) -> list[Row]:
        return sorted(self.rows.values(), key=lambda r: (r.contract, r.backend, r.config))

    def totals(self) -> dict:
        rows = self.rows.values()
        return {
            "rows": len(self.rows),
            "cases": sum(r.cases for r in rows),
            "passed": sum(r.passed for r in rows),
            "failed": sum(r.failed for r in rows),
            "skipped": sum(r.skipped for r in rows),
            "flips": sum(r.flips for r in rows),
        }


def _fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _fmt_figures(figures: dict) -> str:
    return ", ".join(f"{k}={'n/a' if v is None else format(v, '.4g')}"
                     for k, v in sorted(figures.items())) or "-"


COLUMNS = ("contract", "backend", "config", "status", "cases", "pass", "fail", "skip",
           "bitwise", "worst ULP", "worst bound ratio", "flips", "figures")


def _cells(row: Row) -> tuple[str, ...]:
    return (
        row.contract, row.backend, row.config, row.status(), str(row.cases),
        str(row.passed), str(row.failed), str(row.skipped), str(row.bitwise),
        "-" if row.worst_ulp is None else str(row.worst_ulp),
        _fmt_ratio(row.worst_ratio), f"{row.flips}/{row.decisions}" if row.decisions else "-",
        _fmt_figures(row.figures),
    )


def format_table(rows: Iterable[Row]) -> str:
    """A fixed-width text table of the rows (the terminal summary)."""
    body = [COLUMNS] + [_cells(r) for r in rows]
    widths = [max(len(line[i]) for line in body) for i in range(len(COLUMNS))]
    lines = []
    for n, line in enumerate(body):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_totals(report: Report) -> str:
    """The one-line count under the table."""
    return ("rows {rows}, cases {cases}: {passed} passed, {failed} failed, {skipped} skipped; "
            "accepted routing flips {flips}".format(**report.totals()))


def format_markdown(rows: Iterable[Row]) -> str:
    """The same table in Markdown (``verify-report.md``)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(_cells(row)) + " |")
    return "\n".join(lines)


def _backend_line(name: str, about: dict) -> str:
    if about.get("load_error"):
        return f"* {about['load_error']}"
    return f"* `{name}` {about['version']} ({about['source']})"


def report_payload(report: Report, environment: dict) -> dict:
    """The contents of ``verify-report.json``: the environment, every backend of the run
    with its version and source, the totals, every row with its skip reasons and failing
    node ids. :func:`merge_reports` joins such payloads (the parts of a run in several
    processes)."""
    return {
        "environment": environment,
        "backends": report.backends,
        "totals": report.totals(),
        "rows": [dataclasses.asdict(r) | {"status": r.status()} for r in report.sorted_rows()],
    }


def write_report(report: Report, directory: Path, environment: dict) -> tuple[Path, Path]:
    """Write ``verify-report.json`` (:func:`report_payload`) and ``verify-report.md`` into
    ``directory`` (made if missing)."""
    rows = report.sorted_rows()
    directory.mkdir(parents=True, exist_ok=True)
    payload = report_payload(report, environment)
    json_path = directory / "verify-report.json"
    md_path = directory / "verify-report.md"
    json_path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    md_path.write_text(
        "# Verification report\n\n"
        + "\n".join(f"* {k}: {v}" for k, v in environment.items())
        + "\n\nBackends:\n\n"
        + "\n".join(_backend_line(n, a) for n, a in report.backends.items())
        + "\n\n" + format_markdown(rows) + "\n"
    )
    return json_path, md_path


#: Environment keys every part of one merged report must share (``world_size`` may not:
#: a multi-GPU part and a single-GPU part of one node's run are one report).
SHARED_ENVIRONMENT = ("commit", "python", "torch", "device", "capability")


def merge_reports(payloads: Iterable[tuple[str, dict]]) -> tuple[dict, Report]:
    """Join the parts of one run: ``(name, verify-report.json contents)`` of each part ->
    ``(environment, report)``. Each row is the sum of that row's parts
    (:meth:`Row.merge`).

    Raises:
        ValueError: no part; parts of another commit, Python, torch, device or capability
            (the key and the two parts named); one backend at two versions or sources.
    """
    payloads = list(payloads)
    if not payloads:
        raise ValueError("merge_reports: no report to merge")
    first_name, first = payloads[0]
    environment = dict(first["environment"])
    report = Report()
    for name, payload in payloads:
        env = payload["environment"]
        for key in SHARED_ENVIRONMENT:
            if env.get(key) != first["environment"].get(key):
                raise ValueError(f"merge_reports: {name} has {key}={env.get(key)!r}, "
                                 f"{first_name} has {first['environment'].get(key)!r}: parts "
                                 f"of one report must come from one commit and machine")
        for backend, about in payload["backends"].items():
            known = report.backends.setdefault(backend, about)
            if (known.get("version"), known.get("source")) != (about.get("version"),
                                                               about.get("source")):
                raise ValueError(f"merge_reports: backend {backend!r} is {about.get('version')} "
                                 f"({about.get('source')}) in {name}, {known.get('version')} "
                                 f"({known.get('source')}) in an earlier part")
        for data in payload["rows"]:
            row = Row.from_dict(data)
            report.row(row.contract, row.backend, row.config).merge(row)
    sizes = {str(p["environment"].get("world_size", "")) for _, p in payloads} - {""}
    if sizes:
        environment["world_size"] = ",".join(sorted(sizes))
    environment["parts"] = len(payloads)
    return environment, report


def main(argv=None) -> int:
    """``python -m verify.report merge OUT_DIR PART.json ...``: write the merged
    ``verify-report.json`` / ``.md`` into OUT_DIR and print the table. Exit status 0 when no
    row failed, 1 when one did, 2 when the parts cannot be joined."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m verify.report")
    sub = ap.add_subparsers(dest="command", required=True)
    merge = sub.add_parser("merge", help="join the verify-report.json files of one run's parts")
    merge.add_argument("out_dir", type=Path)
    merge.add_argument("parts", type=Path, nargs="+")
    args = ap.parse_args(argv)
    try:
        payloads = [(str(p), json.loads(p.read_text())) for p in args.parts]
        environment, report = merge_reports(payloads)
    except (OSError, ValueError, KeyError) as e:
        print(f"verify.report merge: {e}", file=sys.stderr)
        return 2
    paths = write_report(report, args.out_dir, environment)
    print(format_table(report.sorted_rows()))
    print(format_totals(report))
    print("written: " + ", ".join(str(p) for p in paths))
    return 1 if report.totals()["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
