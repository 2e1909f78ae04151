"""The performance page of the site, built from the committed history at build time.

:func:`build` returns the page's generated parts (:class:`Page`): its status, the first
lines of the page, and its body and figures (SVG bytes by path under ``docs/``);
``benchmarks/mkdocs_hook.py`` puts them into the site.

The status says, per machine, which run the figures are from, its commit and how many
commits that is behind HEAD (git, when the page is built; where git cannot tell, it says
so). For a GPU machine it also compares the SASS digests recorded with the run
(``benchmarks.sass_check``) with the current tree's, given to :func:`build`: where a
kernel the page draws has changed, or the run has no digests, the first line says
**Stale** and names the kernels.

The body, for every machine of ``benchmarks/results/``:

* a GPU machine: per stage and per schedule of its newest run, the device time and the
  fraction of the copy bandwidth against the batch, this project's kernel and every peer
  of ``extra_info["peers"]`` on the same axes, and a table of the figures; then the
  history of every case over the runs;
* a CPU machine (``cpu-*``): the reference's cost per stage against the batch.

Times are each suite's compared statistic (``benchmarks.history.STATISTICS``).
"""

from __future__ import annotations

import dataclasses
import io
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Callable

from benchmarks import history, sass_check

ROOT = Path(__file__).resolve().parent.parent

STAGE_ORDER = ("mx", "router", "activation", "experts", "finalize", "norm")
SCHEDULE_ORDER = ("stock", "dep", "wide")
OURS = "latentmoe"
IMAGE_DIR = "performance"


def _figure(width=9.0, height=3.4, panels=2):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=(width, height), squeeze=False)
    return fig, list(axes[0])


def _svg(fig) -> bytes:
    import matplotlib
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    with matplotlib.rc_context({"svg.hashsalt": "latentmoe", "svg.fonttype": "none"}):
        fig.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    return buffer.getvalue()


def _label(variant: str | None, who: str) -> str:
    return who if not variant else f"{who} ({variant})"


def _group_cases(run: history.Run, statistic: str):
    """{(kind, name): {variant: [(batch, seconds, extra_info), ...] by batch}} for the
    cases that say what they measure; and the names of those that do not."""
    groups: dict = defaultdict(lambda: defaultdict(list))
    unplaced = []
    for case, bench in run.cases.items():
        info = bench.get("extra_info", {})
        kind = "stage" if "stage" in info else "schedule" if "schedule" in info else None
        if kind is None or "batch" not in info:
            unplaced.append(case)
            continue
        groups[(kind, info[kind])][info.get("variant")].append(
            (int(info["batch"]), float(bench["stats"][statistic]), info))
    for variants in groups.values():
        for points in variants.values():
            points.sort(key=lambda p: p[0])
    return groups, sorted(unplaced)


def drawn_groups(run: history.Run) -> list[tuple[str, str]]:
    """The (kind, name) groups of a GPU run that the page draws, e.g. ``("stage", "mx")``,
    ``("schedule", "dep")``."""
    groups, _ = _group_cases(run, history.STATISTICS["gpu"])
    return sorted(groups, key=_order)


def _order(key):
    kind, name = key
    order = STAGE_ORDER if kind == "stage" else SCHEDULE_ORDER
    return (kind != "stage", order.index(name) if name in order else len(order), name)


def _gpu_group_figure(variants) -> bytes:
    fig, (time_ax, frac_ax) = _figure()
    for variant, points in sorted(variants.items(), key=lambda v: v[0] or ""):
        batches = [b for b, _, _ in points]
        time_ax.plot(batches, [s * 1e6 for _, s, _ in points], "o-", label=_label(variant, OURS))
        frac_ax.plot(batches, [i["bytes"] / s / 1e9 / i["copy_gbs"] * 100 for _, s, i in points],
                     "o-", label=_label(variant, OURS))
        for peer in sorted({p for _, _, i in points for p in i.get("peers", {})}):
            have = [(b, i["peers"][peer], i) for b, _, i in points if peer in i.get("peers", {})]
            label = _label(variant, peer)
            time_ax.plot([b for b, _, _ in have], [us for _, us, _ in have], "s--", label=label)
            frac_ax.plot([b for b, _, _ in have],
                         [i["bytes"] / (us * 1e-6) / 1e9 / i["copy_gbs"] * 100 for _, us, i in have],
                         "s--", label=label)
    time_ax.set(xscale="log", yscale="log", xlabel="batch (tokens)", ylabel="device time (us)")
    frac_ax.set(xscale="log", xlabel="batch (tokens)", ylabel="% of copy bandwidth", ylim=(0, 100))
    low, high = time_ax.get_ylim()
    _plain_log_ticks(time_ax.yaxis, every_minor=high / low < 10)
    all_batches = [b for points in variants.values() for b, _, _ in points]
    for ax in (time_ax, frac_ax):
        _batch_ticks(ax, all_batches)
        ax.grid(True, which="both", alpha=0.3)
    frac_ax.legend(fontsize="small", loc="upper left")
    return _svg(fig)


def _gpu_group_table(variants) -> list[str]:
    peers = sorted({p for points in variants.values() for _, _, i in points for p in i.get("peers", {})})
    head = ["case", "batch", f"{OURS} (us)", "GB/s", "% of copy"]
    for peer in peers:
        head += [f"{peer} (us)", f"speed-up vs {peer}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for variant, points in sorted(variants.items(), key=lambda v: v[0] or ""):
        for batch, seconds, info in points:
            us = seconds * 1e6
            gbs = info["bytes"] / seconds / 1e9
            row = [variant or "-", str(batch), f"{us:.1f}", f"{gbs:.0f}",
                   f"{100 * gbs / info['copy_gbs']:.0f}%"]
            for peer in peers:
                theirs = info.get("peers", {}).get(peer)
                row += ["-", "-"] if theirs is None else [f"{theirs:.1f}", f"{theirs / us:.1f}x"]
            lines.append("| " + " | ".join(row) + " |")
    return lines


def _history_figure(runs, cases, statistic) -> bytes:
    fig, (ax,) = _figure(width=9.0, height=3.2, panels=1)
    x = list(range(len(runs)))
    for case in cases:
        values = [(i, r.value(case, statistic) * 1e6) for i, r in enumerate(runs) if case in r.cases]
        ax.plot([i for i, _ in values], [v for _, v in values], "o-",
                label=case.split("[", 1)[-1].rstrip("]"))
    ax.set_xticks(x, [r.label for r in runs], rotation=20, ha="right", fontsize="small")
    ax.set(yscale="log", ylabel=f"{statistic} (us)")
    low, high = ax.get_ylim()
    _plain_log_ticks(ax.yaxis, every_minor=high / low < 10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="x-small", ncol=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _svg(fig)


def _plain_log_ticks(axis, *, every_minor: bool = False):
    """Tick labels of a log axis as plain numbers (5, 10, 20) instead of 5x10^0: the
    decades and the 2s and 5s, or every minor tick (``every_minor``, a narrow range)."""
    from matplotlib.ticker import FuncFormatter

    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(FuncFormatter(
        lambda v, _: f"{v:g}" if every_minor or f"{v:g}"[0] in "25" else ""))


def _batch_ticks(ax, batches):
    """The batch axis (log) labelled at the measured batches only."""
    from matplotlib.ticker import NullFormatter

    ax.set_xticks(sorted(set(batches)), [str(b) for b in sorted(set(batches))])
    ax.xaxis.set_minor_formatter(NullFormatter())


def _gpu_machine(machine_dir, images) -> list[str]:
    machine = machine_dir.name
    runs = history.load_history(machine_dir)
    noise = history.load_noise(machine_dir, runs)
    statistic = noise.statistic
    newest = runs[-1]
    info = newest.data["machine_info"]
    lines = [f"## {machine}", "",
             f"Newest run: `{newest.name}` ({info.get('gpu', machine)}, "
             f"{len(newest.cases)} cases; time = the {statistic} of the rounds' device time).",
             ""]
    if newest.note:
        lines += ['!!! note "How this run was made"', f"    {newest.note}", ""]
    groups, unplaced = _group_cases(newest, statistic)
    kinds = {kind for kind, _ in groups}
    for key in sorted(groups, key=_order):
        kind, name = key
        image = f"{IMAGE_DIR}/{machine}-{kind}-{name}.svg"
        images[image] = _gpu_group_figure(groups[key])
        lines += [f"### {kind.capitalize()} {name}", "", f"![{machine} {name}]({image})", ""]
        lines += _gpu_group_table(groups[key]) + [""]
    if "schedule" not in kinds:
        lines += ["### Schedules", "",
                  f"No schedule has a benchmark case in the newest {machine} run yet: the "
                  "stages above are timed one kernel at a time.", ""]
    if unplaced:
        lines += ["Cases without `stage`/`schedule` and `batch` in `extra_info` (not plotted): "
                  + ", ".join(f"`{c}`" for c in unplaced), ""]
    lines += [f"### History on {machine}", "",
              f"Threshold {noise.threshold_percent}% on the {statistic} "
              f"(`benchmarks/results/{machine}/noise.json`: the widest run-to-run spread of one "
              f"case, {noise.widest[1]:.1f}% in `{noise.widest[0].split('::')[-1]}`, over "
              f"{len(noise.runs)} runs). {noise.note}", "",
              "| run | commit | saved (UTC) | note |", "|---|---|---|---|"]
    for run in runs:
        note = "converted from an older format (see its note)" if run.tag == "converted" else ""
        lines.append(f"| `{run.name}` | `{run.commit}`{' (dirty)' if run.dirty else ''} | "
                     f"{run.saved:%Y-%m-%d %H:%M} | {note} |")
    lines.append("")
    by_group = defaultdict(list)
    for run in runs:
        for case, bench in run.cases.items():
            extra = bench.get("extra_info", {})
            group = extra.get("stage") or extra.get("schedule") or case.split("::")[-1].split("[")[0]
            if case not in by_group[group]:
                by_group[group].append(case)
    for group, cases in sorted(by_group.items()):
        image = f"{IMAGE_DIR}/{machine}-history-{group}.svg"
        images[image] = _history_figure(runs, cases, statistic)
        lines += [f"![{machine} history {group}]({image})", ""]
    return lines


def _cpu_machine(machine_dir, images) -> list[str]:
    machine = machine_dir.name
    runs = history.load_history(machine_dir)
    noise = history.load_noise(machine_dir, runs)
    newest = runs[-1]
    statistic = noise.statistic
    per_stage: dict[str, list[tuple[int, float]]] = defaultdict(list)
    single = []
    for case, bench in newest.cases.items():
        info = bench.get("extra_info", {})
        seconds = float(bench["stats"][statistic])
        if info.get("pairs"):
            single.append((info["stage"], info["pairs"], seconds))
        elif "stage" in info:
            per_stage[info["stage"]].append((int(info["batch"]), seconds))
    fig, (ax,) = _figure(width=7.5, height=3.6, panels=1)
    for stage, points in per_stage.items():  # in the run's order (bench_reference.STAGES)
        points.sort()
        ax.plot([b for b, _ in points], [s * 1e3 for _, s in points], "o-", label=stage)
    ax.set(xscale="log", yscale="log", xlabel="batch (tokens)", ylabel=f"CPU time, {statistic} (ms)")
    _batch_ticks(ax, [b for points in per_stage.values() for b, _ in points])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    image = f"{IMAGE_DIR}/{machine}-reference.svg"
    images[image] = _svg(fig)
    batches = sorted({b for points in per_stage.values() for b, _ in points})
    lines = [f"## {machine}: the reference on the CPU", "",
             f"Newest run: `{newest.name}` (torch {newest.data['machine_info'].get('torch')}; "
             f"CPU time of the process per call on one thread, the {statistic} of the rounds). "
             f"CI compares every run with it: threshold "
             f"{noise.threshold_percent}%, the widest spread of one case over {len(noise.runs)} "
             f"runs ({noise.widest[1]:.1f}% in `{noise.widest[0].split('::')[-1]}`). "
             f"{noise.note}", "",
             f"![{machine} reference]({image})", "",
             "| stage | " + " | ".join(f"T={b} (ms)" for b in batches) + " |",
             "|---|" + "---|" * len(batches)]
    for stage in per_stage:
        seconds = dict(per_stage[stage])
        lines.append(f"| {stage} | " + " | ".join(
            f"{seconds[b] * 1e3:.2f}" if b in seconds else "-" for b in batches) + " |")
    for stage, pairs, seconds in single:
        lines.append(f"| {stage}, {pairs} routed pair | {seconds * 1e3:.0f} ms per pair "
                     f"(a token has 16) |" + " |" * (len(batches) - 1))
    return lines + [""]


def commits_behind(commit: str, root: Path = ROOT) -> str:
    """How far ``commit`` is behind HEAD of the git checkout at ``root``, as words: "at
    HEAD", "62 commits behind HEAD", "not an ancestor of HEAD ...", or why git cannot tell
    (git missing, no repository, the commit absent from a shallow clone)."""
    def git(*args) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)

    try:
        head = git("rev-parse", "--verify", "--quiet", "HEAD")
        known = git("rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
    except OSError as error:
        return f"how far behind HEAD is unknown: git is unavailable here ({error.strerror})"
    if head.returncode != 0:
        return "how far behind HEAD is unknown: the tree is not a git checkout"
    if known.returncode != 0:
        return ("how far behind HEAD is unknown: the commit is not in this checkout's "
                "history (a shallow clone?)")
    count = int(git("rev-list", "--count", f"{commit}..HEAD").stdout)
    if git("merge-base", "--is-ancestor", commit, "HEAD").returncode != 0:
        return f"not an ancestor of HEAD ({count} commits of HEAD are not in it)"
    if count == 0:
        return "at HEAD"
    return f"{count} commit{'s' if count != 1 else ''} behind HEAD"


def _run_words(machine: str, run: history.Run, root: Path) -> str:
    commit = f"`{run.commit}`" + (" (with uncommitted changes)" if run.dirty else "")
    return (f"the {machine} figures below are from run `{run.name}` of commit {commit}, "
            f"{commits_behind(run.commit, root)}")


def _gpu_status(machine_dir: Path, current_digests, not_checked: str, root: Path) -> str:
    run = history.load_history(machine_dir)[-1]
    groups = drawn_groups(run)
    words = _run_words(machine_dir.name, run, root)
    recorded = sass_check.recorded_digests(run.data)
    if recorded is None:
        return (f"**Stale:** {words}, and no SASS digest is recorded with that run, so "
                "nothing shows that the kernels it timed are the current ones.")
    arch, lines = recorded
    if current_digests is None:
        return (f"**Not checked:** {words}; the current SASS digests were not computed in "
                f"this build ({not_checked}).")
    changed = sass_check.changed_kernels(lines, current_digests(arch), groups)
    if changed:
        return (f"**Stale:** {words}, and the SASS ({arch}) of {len(changed)} kernel"
                f"{'s' if len(changed) != 1 else ''} they draw differs from the digest "
                "recorded with that run: " + ", ".join(f"`{k}`" for k in changed) + ".")
    return (f"**Current:** {words}; every kernel they draw compiles ({arch}, from this tree "
            "when the site was built) to the SASS digest recorded with that run.")


def status(results: Path = history.RESULTS,
           current_digests: Callable[[str], list[str]] | None = None,
           not_checked: str = "", root: Path = ROOT) -> list[str]:
    """The page's first lines, one paragraph per machine, GPU machines first and stale
    ones first of those (see the module docstring). ``current_digests(arch)``: the current
    tree's digest lines (``sass_check.current_digests``); None where they were not
    computed, ``not_checked`` saying why."""
    gpu, cpu = [], []
    for machine_dir in history.machine_dirs(results):
        if machine_dir.name.startswith("cpu-"):
            run = history.load_history(machine_dir)[-1]
            words = _run_words(machine_dir.name, run, root)
            cpu.append(words[0].upper() + words[1:] + " (the reference on the CPU: no kernel SASS).")
        else:
            gpu.append(_gpu_status(machine_dir, current_digests, not_checked, root))
    gpu.sort(key=lambda line: not line.startswith("**Stale"))
    return [line for paragraph in gpu + cpu for line in (paragraph, "")]


@dataclasses.dataclass(frozen=True)
class Page:
    """The generated parts of the page: ``status`` (Markdown, the page's first lines),
    ``body`` (Markdown) and ``images`` ({image path under docs/: SVG bytes})."""

    status: str
    body: str
    images: dict[str, bytes]


def build(results: Path = history.RESULTS,
          current_digests: Callable[[str], list[str]] | None = None,
          not_checked: str = "", root: Path = ROOT) -> Page:
    """The page's status (:func:`status`, same arguments), body and figures."""
    images: dict[str, bytes] = {}
    lines: list[str] = []
    dirs = history.machine_dirs(results)
    for machine_dir in dirs:
        if not machine_dir.name.startswith("cpu-"):
            lines += _gpu_machine(machine_dir, images)
    for machine_dir in dirs:
        if machine_dir.name.startswith("cpu-"):
            lines += _cpu_machine(machine_dir, images)
    head = status(results, current_digests, not_checked, root)
    return Page(status="\n".join(head), body="\n".join(lines), images=images)
