"""The "verified where" page, generated from the committed verification reports.

For every contract file ``verify/test_*.py`` and every machine (the CPU of CI, one H200,
one H100, two H200s, a Blackwell GPU) the page says what the last committed run on that machine did
with that file's contracts (cases passed, failed, skipped) and which run it was: its
commit, date and report. A run's commit is usually behind HEAD; the page says by how many
commits, so "not verified at HEAD" is visible.

Inputs, all committed (:data:`RUNS`):

* a merged ``verify.report`` JSON (``rows``: contract, backend, config, status and case
  counts) or a report of the same row shape (``two-gpu.json``);
* the run's metadata: ``commit``, ``date``, ``log`` (and ``what``) from a ``<stem>-run.json``
  beside the report when there is one, else the report's own top-level keys. The
  ``-run.json`` is what names the tree for runs made before the reports read a copy's
  ``COMMIT`` file (``benchmarks.provenance.tree_commit``): their ``environment.commit`` is
  whatever the git around the copy said (``benchmarks/results/h200/verify-notes.md``).

A report's rows are mapped to contract files by the contract name each test records
(``verify.conftest.row_key``: the ``contract`` marker's argument, else the test function's
name without ``test_``), read from the files with :mod:`ast`. A row whose contract no
current file defines (renamed since the run) is listed under the table.

The commit distance (``git rev-list --count <commit>..HEAD``) is computed only by
``--write``, and kept in a comment line of the page, so the page's test
(``tests/test_where.py``) needs no git: it checks that the page equals what this module
generates from the committed reports and contract files with the distances the page
records.

    python -m verify.where            # print the page
    python -m verify.where --write    # rewrite docs/verified.md (needs git)
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from verify.status import marked_tests

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "verified.md"
RESULTS = "benchmarks/results"

#: The machines of the page's columns, in order.
MACHINES = ("CPU (CI)", "one H200", "one H100", "two H200s", "Blackwell")

#: machine -> the committed report of its last run (relative to the root), or None where
#: no report is committed. The CPU's report is a run of what CI runs (``make test``'s
#: verify step) on a CI-like machine; CI itself runs it at every commit.
RUNS: dict[str, str | None] = {
    "CPU (CI)": f"{RESULTS}/cpu-2core-amd-epyc/verify.json",
    "one H200": f"{RESULTS}/h200/verify.json",
    "one H100": f"{RESULTS}/h100/verify.json",
    "two H200s": f"{RESULTS}/h200/two-gpu.json",
    "Blackwell": None,
}

#: What the page says of a machine with no report.
NO_RUN = {"CPU (CI)": "CI runs every file at every commit; no CPU report is committed",
          "Blackwell": "no Blackwell GPU has run a contract yet; the kernels compile for "
                       "`sm_100a` and `sm_103a` on the CPU in CI (`tests/`)"}

#: What a contract file's cell says for a machine with no report.
NO_RUN_CELL = {"CPU (CI)": "CI, every commit"}

DISTANCES_RE = re.compile(r"<!-- where: generated at (\S+); behind: (.*?) -->")


@dataclass
class Run:
    """One committed run: its metadata and its report's rows."""

    machine: str
    report: str
    commit: str
    date: str
    log: str | None
    what: str
    note: str
    rows: list[dict] = field(default_factory=list)
    #: the file beside the report with the SASS digests of the kernels the run ran
    #: (``tools/sass_digest.py``'s lines), and the architecture they ran as; None if unrecorded
    sass_digest: str | None = None
    sass_arch: str | None = None

    def totals(self) -> dict[str, int]:
        out = {"passed": 0, "failed": 0, "skipped": 0}
        for r in self.rows:
            for k in out:
                out[k] += int(r.get(k, 0))
        return out


def load_run(machine: str, report: str) -> Run:
    """The run of ``report`` (a path relative to the root), its metadata from
    ``<stem>-run.json`` beside it where there is one, else from the report itself."""
    path = ROOT / report
    data = json.loads(path.read_text())
    meta_path = path.with_name(path.stem + "-run.json")
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else data
    for key in ("commit", "date"):
        if key not in meta:
            raise ValueError(f"{report}: no {key!r} in {meta_path.name if meta is not data else 'the report'}")
    if bool(meta.get("sass_digest")) != bool(meta.get("sass_arch")):
        raise ValueError(f"{report}: 'sass_digest' and 'sass_arch' go together (the digest "
                         f"file and the architecture the run's kernels ran as)")
    return Run(machine=machine, report=report, commit=str(meta["commit"]),
               date=str(meta["date"]), log=meta.get("log"), what=str(meta.get("what", "")),
               note=str(meta.get("note") or meta.get("failures") or ""),
               rows=list(data["rows"]), sass_digest=meta.get("sass_digest"),
               sass_arch=meta.get("sass_arch"))


def runs() -> dict[str, Run | None]:
    """Each machine's committed run (None where there is none)."""
    return {m: (load_run(m, RUNS[m]) if RUNS[m] else None) for m in MACHINES}


def _contract_names(path: Path) -> list[str]:
    """The contract names the tests of ``path`` record (``verify.conftest.row_key``): a
    ``pytest.mark.contract`` name (the test's own, else the module's), else the test's
    name without ``test_``."""
    names: list[str] = []
    for test, marked in marked_tests(path, _contract_marker):
        name = marked or test.removeprefix("test_")
        if name not in names:
            names.append(name)
    return names


def _contract_marker(node: ast.AST) -> str | None:
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "contract" and node.args
            and isinstance(node.args[0], ast.Constant)):
        return str(node.args[0].value)
    return None


def contract_files() -> dict[str, list[str]]:
    """``test_X.py`` -> the contract names its tests record, for every ``verify/test_*.py``."""
    return {p.name: _contract_names(p) for p in sorted((ROOT / "verify").glob("test_*.py"))}


def _cell(rows: list[dict]) -> str:
    """One file's outcome in one run: its cases passed / failed / skipped."""
    if not rows:
        return "not run"
    passed = sum(int(r.get("passed", 0)) for r in rows)
    failed = sum(int(r.get("failed", 0)) for r in rows)
    skipped = sum(int(r.get("skipped", 0)) for r in rows)
    if passed == 0 and failed == 0:
        return f"not run ({skipped} skipped)"
    parts = [f"{passed} passed"]
    if failed:
        parts.append(f"**{failed} failed**")
    if skipped:
        parts.append(f"{skipped} skipped")
    return ", ".join(parts)


def _short(commit: str) -> str:
    return commit[:7]


def _behind_text(commit: str, distances: dict[str, int | None]) -> str:
    n = distances.get(_short(commit))
    if n is None:
        return "unknown (not in this clone)"
    if n < 0:
        return "**not in HEAD's history**"
    return "**at HEAD**" if n == 0 else f"**{n} behind**"


def _link(path: str) -> str:
    """A repository path as code (the site does not serve files outside docs/)."""
    return f"`{path}`"


def runs_table(all_runs: dict[str, Run | None], distances: dict[str, int | None]) -> str:
    lines = ["| machine | commit | date | report | commits behind HEAD | cases |",
             "|---|---|---|---|---|---|"]
    for m in MACHINES:
        run = all_runs[m]
        if run is None:
            commit = "every commit (CI)" if m == "CPU (CI)" else "not run"
            lines.append(f"| {m} | {commit} | - | - | - | {NO_RUN.get(m, 'no report committed')} |")
            continue
        t = run.totals()
        report = _link(run.report) + (f", {_link(str(Path(run.report).parent / run.log))}"
                                      if run.log else "")
        cases = f"{t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped"
        lines.append(f"| {m} | `{_short(run.commit)}` | {run.date} | {report} | "
                     f"{_behind_text(run.commit, distances)} | {cases} |")
    return "\n".join(lines)


def files_table(all_runs: dict[str, Run | None]) -> tuple[str, list[str]]:
    """The contract file x machine table, and the rows no current file defines."""
    files = contract_files()
    owner = {name: f for f, names in files.items() for name in names}
    lines = ["| contract file | " + " | ".join(MACHINES) + " |",
             "|---|" + "---|" * len(MACHINES)]
    by_machine: dict[str, dict[str, list[dict]]] = {}
    orphans: list[str] = []
    for m, run in all_runs.items():
        grouped: dict[str, list[dict]] = {}
        for r in (run.rows if run else []):
            f = owner.get(r["contract"])
            if f is None:
                orphans.append(f"{m}: `{r['contract']}` ({r.get('backend', '-')}, "
                               f"{r.get('config', '-')}): {_cell([r])}")
                continue
            grouped.setdefault(f, []).append(r)
        by_machine[m] = grouped
    for f in files:
        cells = [_cell(by_machine[m].get(f, [])) if all_runs[m]
                 else NO_RUN_CELL.get(m, "not run") for m in MACHINES]
        lines.append(f"| `{f}` | " + " | ".join(cells) + " |")
    return "\n".join(lines), orphans


#: The line of the page that the docs build replaces with a run's kernel status
#: (:func:`kernels_status`); ``{machine}`` is the run's machine.
KERNELS_MARKER = "<!-- verified:kernels {machine} -->"
KERNELS_MARKER_RE = re.compile(r"<!-- verified:kernels (.+?) -->")


def recorded_kernels(run: Run) -> dict[str, tuple[str, str]]:
    """The digests of the kernels ``run`` ran (its ``sass_digest`` file's lines of its
    ``sass_arch``): ``{"<arch> <family>:<set> <kind> <Class>": (sha1, bytes)}``."""
    from tools.sass_digest import parse_lines

    if not run.sass_digest:
        raise ValueError(f"{run.machine}: the run recorded no SASS digests")
    path = (ROOT / run.report).with_name(run.sass_digest)
    lines = parse_lines(path.read_text().splitlines())
    return {k: v for k, v in lines.items() if k.split()[0] == run.sass_arch}


def _kernel_set(key: str) -> tuple[str, str]:
    """(family, name) of a digest key ``"<arch> <family>:<set> <kind> <Class>"``."""
    family, name = key.split()[1].split(":", 1)
    return family, name


def recorded_sets(run: Run) -> list[tuple[str, str]]:
    """The ``tools.sass_digest`` kernel sets (family, name) of ``run``'s recorded kernels."""
    return sorted({_kernel_set(key) for key in recorded_kernels(run)})


def kernels_status(run: Run, current: list[str] | None, not_checked: str = "") -> str:
    """What the page says of ``run``'s kernels at the tree the site is built from:
    whether each kernel whose contracts passed in ``run`` compiles to the same machine
    code now. ``current``: this tree's digest lines of :func:`recorded_sets` for the run's
    architecture (``tools.sass_digest`` compiled on the CPU), None when they were not
    computed (``not_checked`` says why)."""
    from tools.sass_digest import SETS, compare_digests, parse_lines

    old = recorded_kernels(run)
    where = f"the {run.machine} run at `{_short(run.commit)}`"
    if current is None:
        return (f"**Machine code at this tree: not checked** ({not_checked}). The docs build "
                f"compares the {len(old)} `{run.sass_arch}` kernels of {where} with this "
                f"tree's when CuTe DSL can compile them.")
    recorded = {_kernel_set(key) for key in old}
    new = {k: v for k, v in parse_lines(current).items()
           if k.split()[0] == run.sass_arch and _kernel_set(k) in recorded}
    name = lambda key: "`{1} {2}` ({3})".format(*key.split())  # noqa: E731
    diff = compare_digests(old, new)
    changed = sorted(name(k) + (" (no longer compiled)" if what == "gone" else "")
                     for k, what in diff.items() if what != "new")
    added = sorted(name(k) for k, what in diff.items() if what == "new")
    unrecorded = sorted(f"`{f}:{n}`" for f, n in SETS if (f, n) not in recorded)
    same = len(old) - len(changed)
    if changed:
        out = [f"**Machine code at this tree: {len(changed)} of the {len(old)} "
               f"`{run.sass_arch}` kernels of {where} compile to other machine code now**, "
               f"so their contracts have not passed on a GPU since: " + ", ".join(changed) +
               f". The other {same} compile to the same SASS."]
    else:
        out = [f"**Machine code at this tree: the same.** The {len(old)} `{run.sass_arch}` "
               f"kernels whose contracts passed in {where} compile to the same SASS from this "
               f"tree. What changed since that run, if anything, is outside their machine "
               f"code (launch arguments, buffers, streams, the contracts themselves), which "
               f"only a new run on the GPU covers: the run verifies its own commit, not this "
               f"one."]
    if added:
        out.append("Kernels of those sets that the run did not have (never run in a recorded "
                   "suite): " + ", ".join(added) + ".")
    if unrecorded:
        out.append("Kernel sets of `tools/sass_digest.py` the run did not record (not "
                   "compared): " + ", ".join(unrecorded) + ".")
    return " ".join(out)


def render(distances: dict[str, int | None], head: str) -> str:
    """The whole page, with ``distances`` (short commit -> commits behind ``head``)."""
    all_runs = runs()
    files, orphans = files_table(all_runs)
    recorded = ", ".join(f"{c}={'?' if n is None else n}" for c, n in sorted(distances.items()))
    cpu = all_runs["CPU (CI)"]
    cpu_counts = ("Its per-file counts below come from the committed CPU report, the same "
                  "command run on a two-core machine like CI's.") if cpu else \
        "No CPU report is committed, so the CPU column gives no per-file counts."
    out = [
        "# Verified where",
        "",
        "<!-- Generated by `python -m verify.where --write` from the committed reports "
        "(tests/test_where.py fails when it is stale). Do not edit by hand. -->",
        f"<!-- where: generated at {head}; behind: {recorded} -->",
        "",
        "What the contracts of `verify/` have passed on each kind of machine, and at which",
        "commit. A GPU run is made by hand on a node ([GPU node](gpu-node.md)) and committed",
        "as a report under `benchmarks/results/`; this page is generated from those reports",
        "(`python -m verify.where --write`), so a run behind HEAD shows as such. The",
        f"distances were counted when the page was generated, at `{head}`.",
        "",
        "**CPU: verified at HEAD by CI.** CI (`.ci/run`: a fresh `.venv`, then `make test`)",
        "runs the whole `verify/` on the CPU at every commit, with the `reference` and",
        "`stock` backends and the example external backend (`examples/`); the cases that need",
        f"a GPU skip with their reason. {cpu_counts}",
        "",
        "## The runs",
        "",
        runs_table(all_runs, distances),
        "",
    ]
    notes = [(m, run.note) for m, run in all_runs.items() if run is not None and run.note]
    if notes:
        out += [f"* **{m}:** {note}" for m, note in notes] + [""]
    digested = [run for run in all_runs.values() if run is not None and run.sass_digest]
    if digested:
        out += [
            "## Machine code at this tree",
            "",
            "A GPU run records the SASS digests (`tools/sass_digest.py`) of the kernels whose",
            "contracts it ran. When this site is built the same kernels are compiled from the",
            "current tree on the CPU and compared, so the line below says whether the machine",
            "code that passed is this tree's. It cannot say the same of the host code around",
            "the kernels: the commits behind HEAD above count every change. Only the kernel",
            "sets of `tools/sass_digest.py` are compared (the stage kernels, five experts-engine",
            "geometries, the schedules' own kernels, the dense and wide GEMMs of the defaults",
            "and of the wide batch-invariant mode), not every tactic a layer can be built with.",
            "",
        ]
        for run in digested:
            out += [f"* **{run.machine}** (`{Path(run.report).parent / run.sass_digest}`, "
                    f"`{run.sass_arch}`): " + KERNELS_MARKER.format(machine=run.machine), ""]
    out += [
        "## Per contract file",
        "",
        "Cases passed / failed / skipped in each machine's run, by the file that defines the",
        "contract (each skip has its reason in the report: no GPU, not launched with",
        "`torchrun`, the reference at the real dimensions, a package missing on the node);",
        "\"not run\" where the run holds no case of the file.",
        "",
        files,
        "",
    ]
    if orphans:
        out += ["Rows of a run whose contract no current file defines (renamed since):", ""]
        out += [f"* {o}" for o in orphans] + [""]
    return "\n".join(out)


def recorded_distances(page: str) -> tuple[str, dict[str, int | None]]:
    """(the head, the distances) recorded in a generated page."""
    m = DISTANCES_RE.search(page)
    if not m:
        raise ValueError(f"{PAGE} has no '<!-- where: generated at ... -->' line")
    distances: dict[str, int | None] = {}
    for item in filter(None, (s.strip() for s in m.group(2).split(","))):
        commit, n = item.split("=")
        distances[commit] = None if n == "?" else int(n)
    return m.group(1), distances


def git_distances() -> tuple[str, dict[str, int | None]]:
    """(HEAD's short commit, each run's commits behind HEAD) from git: -1 where the commit
    is not an ancestor of HEAD (a run of another branch), None where it is not in this
    clone."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout.strip()

    head = git("rev-parse", "--short=7", "HEAD")
    distances: dict[str, int | None] = {}
    for run in runs().values():
        if run is None:
            continue
        try:
            ancestor = subprocess.run(["git", "merge-base", "--is-ancestor", run.commit, "HEAD"],
                                      cwd=ROOT, capture_output=True).returncode == 0
            distances[_short(run.commit)] = (
                int(git("rev-list", "--count", f"{run.commit}..HEAD")) if ancestor else -1)
        except subprocess.CalledProcessError:
            distances[_short(run.commit)] = None
    return head, distances


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the contract file x machine page")
    parser.add_argument("--write", action="store_true", help=f"rewrite {PAGE} (needs git)")
    args = parser.parse_args(argv)
    if args.write:
        head, distances = git_distances()
        PAGE.write_text(render(distances, head))
    else:
        head, distances = recorded_distances(PAGE.read_text()) if PAGE.is_file() \
            else git_distances()
        print(render(distances, head), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
