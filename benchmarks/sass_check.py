"""Whether a GPU run still times the current code: the SASS digests of the kernels the
performance page draws, recorded with the run, against the current tree's.

A GPU run saved by ``python -m benchmarks.run gpu record`` (or ``noise``) carries, under
its JSON key ``"sass_digest"``, the digest lines (``tools/sass_digest.py``'s format:
``<arch> <family>:<set> <kind> <Class> <sha1> <bytes>``) of the kernel sets its cases
time (:func:`sets`), compiled for the GPU's architecture from the tree it measured::

    "sass_digest": {"arch": "sm_90a", "lines": ["sm_90a stage:real mx QuantizeKernel ...", ...],
                    "note": "how the digests were made"}

When the site is built, ``benchmarks.mkdocs_hook`` computes the same sets' digests from the
current tree (on the CPU, :func:`current_digests`) and the performance page compares them
(:func:`changed_kernels`): a kernel drawn on the page whose digest differs, or that only one
side has, makes the page's first line say **stale** and name it.

Which kernels a figure of the page depends on (``DEPENDS``): a stage's figure on that stage
kernel (the experts stage on every experts-engine set of ``tools.sass_digest.ENGINES``); a
schedule's on its own kernels (the virtual ranks'), its geometry's experts-engine sets and
every stage kernel.
"""

from __future__ import annotations

import concurrent.futures
import fnmatch
import json
import os
from pathlib import Path

__all__ = ["sets", "DEPENDS", "SKIP_ENV", "current_digests", "record",
           "recorded_digests", "changed_kernels"]

#: Environment variable that, set to ``1``, keeps the docs build from compiling the
#: digests (the page then says they were not checked).
SKIP_ENV = "LATENTMOE_SKIP_SASS_CHECK"


def _engine_sets() -> list[tuple[str, str]]:
    from tools.sass_digest import ENGINES

    return [("experts", name) for name in ENGINES]


def sets() -> list[tuple[str, str]]:
    """The ``tools.sass_digest`` sets (family, name) the GPU cases time: the stage kernels at
    the real widths, every experts-engine set, the DEP16 and TP8 schedules' kernels of the
    virtual ranks."""
    return [("stage", "real"), *_engine_sets(), ("dep", "dep16"), ("wide", "tp8")]


#: page group (kind, name) -> the digest sets and kernel kinds its figures depend on, as
#: ``fnmatch`` patterns of ``"<family>:<set> <kind>"``.
DEPENDS: dict[tuple[str, str], tuple[str, ...]] = {
    **{("stage", s): (f"stage:real {s}",) for s in ("mx", "router", "activation", "finalize",
                                                    "norm")},
    ("stage", "experts"): ("experts:* *",),
    ("schedule", "dep"): ("dep:dep16 *", "experts:dep16-* *", "stage:real *"),
    ("schedule", "wide"): ("wide:tp8 *", "experts:tp8-* *", "stage:real *"),
}


def current_digests(arch: str, jobs: int | None = None,
                    kernel_sets: list[tuple[str, str]] | None = None) -> list[str]:
    """The digest lines of ``kernel_sets`` ((family, name) of ``tools.sass_digest.SETS``;
    default ``sets()``) compiled from this tree for ``arch`` (one process per kernel,
    ``jobs`` at a time; CuTe DSL, no GPU needed), sorted."""
    from tools.sass_digest import digest, kinds

    chosen = sets() if kernel_sets is None else list(kernel_sets)
    with concurrent.futures.ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool:
        todo = [job for listed in pool.map(lambda s: kinds(arch, *s), chosen) for job in listed]
        return sorted(line for lines in pool.map(lambda j: digest(*j), todo) for line in lines)


def record(run_path: Path, arch: str, lines: list[str], note: str) -> None:
    """Write ``lines`` (of ``arch``) into the run file as its ``"sass_digest"``."""
    path = Path(run_path)
    data = json.loads(path.read_text())
    data["sass_digest"] = {"arch": arch, "lines": list(lines), "note": note}
    path.write_text(json.dumps(data, indent=4) + "\n")


def recorded_digests(run_data: dict) -> tuple[str, list[str]] | None:
    """(arch, lines) recorded with a run (its JSON), None when it has none."""
    block = run_data.get("sass_digest")
    if not block:
        return None
    return block["arch"], list(block["lines"])


def changed_kernels(recorded: list[str], current: list[str],
                    groups) -> list[str]:
    """The kernels the page ``groups`` ((kind, name) pairs, ``DEPENDS``' keys) depend on whose
    digest differs between the ``recorded`` and the ``current`` lines, or that only one side
    has: ``"<family>:<set> <kind> (<Class>)"``, with `` (not recorded with the run)`` or
    `` (no longer compiled)`` where one side lacks it; sorted. A recorded set the current
    tree no longer compiles at all (a removed tactic's kernels) is left out."""
    from tools.sass_digest import compare_digests, parse_lines

    new = parse_lines(current)
    patterns = [p for group in groups for p in DEPENDS.get(tuple(group), ())]
    compiled_sets = {key.split()[1] for key in new}
    why = {"changed": "", "new": " (not recorded with the run)", "gone": " (no longer compiled)"}
    changed = []
    for key, what in sorted(compare_digests(parse_lines(recorded), new).items()):
        _arch, where, kind, cls = key.split()
        if not any(fnmatch.fnmatchcase(f"{where} {kind}", p) for p in patterns):
            continue
        if what == "gone" and where not in compiled_sets:
            # a whole set the tree no longer compiles (a removed tactic): no figure drawn
            # now comes from it; a default that changed shows as a new or changed kernel
            continue
        changed.append(f"{where} {kind} ({cls}){why[what]}")
    return changed
