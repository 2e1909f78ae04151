"""The dense GEMMs' default tactics derived from ``benchmarks.dense_table`` runs (CPU).

    python -m benchmarks.dense_defaults dense.json [dense-rerun.json ...]
    python -m benchmarks.dense_defaults dense.json --family wgmma

``fast.gemm.host.DEFAULT_TACTICS`` holds, per weight shape, one tactic per batch bucket, with
**one K split for every T** so that a token's bits never depend on its batch. This reads the
per-GEMM medians of one or more runs of the same machine (a tactic's median averaged over the
runs that timed it at that T) and applies that rule:

1. per K split, the sum over the runs' T's of the fastest tactic of that split (a split
   counts only where one of its tactics was timed at every T);
2. the split with the least sum;
3. per T, the fastest tactic of that split (the previous T's while it is within
   ``--tolerance``, 1% by default, of it); consecutive T's with the same tactic form a
   bucket, keyed by its largest T, the last one extended to ``fast.gemm.layout.MAX_TOKENS``;
   a tactic must serve (and its ring fit) every T of its bucket, timed or not.

It prints the ``DEFAULT_TACTICS`` entries and, per T, the chosen tactic's time against the
fastest of any split and against the run's default. ``--family``: ``mma.sync`` (the table's
family today) or ``wgmma`` (the warpgroup-MMA tactics, with or without MMAs in flight).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

from benchmarks.dense_table import serves_and_fits, timed_tactics
from fast.gemm.layout import MAX_TOKENS, Tactic
from fast.schedules.dense import gemm_shapes
from model.config import LatentMoEConfig

#: The weight shape ``[N, K]`` of each GEMM the table times (kimi_k3's dense GEMMs).
SHAPES = gemm_shapes(LatentMoEConfig.kimi_k3())
FAMILIES = ("mma.sync", "wgmma")


def medians(runs: list[dict], gemm: str) -> dict[int, dict[str, float]]:
    """``{T: {label: us}}`` of one GEMM: each label's median averaged over the runs that
    timed it at that T (``cublas`` and ``default`` included)."""
    seen: dict[int, dict[str, list[float]]] = {}
    for run in runs:
        for row in run["rows"]:
            case = row["gemms"].get(gemm)
            if case is None:
                continue
            for label, us in case["median_us"].items():
                seen.setdefault(row["tokens"], {}).setdefault(label, []).append(us)
    return {t: {k: statistics.fmean(v) for k, v in by.items()} for t, by in sorted(seen.items())}


def family_tactics(shape: tuple[int, int], family: str) -> dict[str, Tactic]:
    """``{label: Tactic}`` of every tactic a table can time for ``shape`` in ``family``."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    every = timed_tactics(shape, wgmma=True, overlap=True, stage_k128=True)
    return {t.label(): t for t in every if t.wgmma == (family == "wgmma")}


@dataclasses.dataclass
class Choice:
    """The derived defaults of one GEMM: its split, its buckets ``{largest T: Tactic}``, and
    per timed T (chosen us, fastest of any split us, the run's default us or None)."""
    gemm: str
    splits: int
    buckets: dict[int, Tactic]
    per_t: dict[int, tuple[float, float, float | None]]


def choose(gemm: str, times: dict[int, dict[str, float]], family: str = "mma.sync",
           tolerance: float = 0.01) -> Choice:
    """The defaults of ``gemm`` from its ``times`` (:func:`medians`) by the module's rule; a
    bucket's tactic goes on to the next T while it is within ``tolerance`` (a fraction) of
    that T's fastest of the split, so that noise does not cut buckets.
    Raises ValueError where no split has a tactic timed at every T, or where a bucket's
    tactic does not serve an untimed T inside it."""
    if not times:
        raise ValueError(f"{gemm}: no timed rows")
    tactics = family_tactics(SHAPES[gemm], family)
    ts = sorted(times)
    by_split: dict[int, float] = {}
    for s in sorted({t.splits for t in tactics.values()}):
        best = [min((us for lab, us in times[t].items()
                     if lab in tactics and tactics[lab].splits == s), default=None) for t in ts]
        if None not in best:
            by_split[s] = sum(best)
    if not by_split:
        raise ValueError(f"{gemm}: no K split has a {family} tactic timed at every T")
    split = min(by_split, key=by_split.get)
    winners, per_t = [], {}
    for t in ts:
        ours = {lab: us for lab, us in times[t].items()
                if lab in tactics and tactics[lab].splits == split}
        win = min(ours, key=ours.get)
        if winners and winners[-1].label() in ours and \
                ours[winners[-1].label()] <= ours[win] * (1 + tolerance):
            win = winners[-1].label()  # the bucket goes on: within the tolerance
        winners.append(tactics[win])
        any_split = min(us for lab, us in times[t].items() if lab in tactics)
        per_t[t] = (ours[win], any_split, times[t].get("default"))
    buckets: dict[int, Tactic] = {}
    for i, (t, tactic) in enumerate(zip(ts, winners)):
        if i + 1 < len(ts) and winners[i + 1] == tactic:
            continue
        buckets[MAX_TOKENS if i + 1 == len(ts) else t] = tactic
    low = 1
    for high, tactic in buckets.items():
        missing = [t for t in range(low, high + 1) if not serves_and_fits(tactic, t)]
        if missing:
            raise ValueError(f"{gemm}: {tactic.label()} chosen for T = {low}..{high} does not "
                             f"serve T = {missing[0]}")
        low = high + 1
    return Choice(gemm, split, buckets, per_t)


def tactic_literal(tactic: Tactic) -> str:
    """``Tactic(...)``: its tile and splits, and the other fields that differ from their
    defaults."""
    fields = {f.name: getattr(tactic, f.name) for f in dataclasses.fields(tactic)
              if f.name in ("warps", "mtiles", "splits") or getattr(tactic, f.name) != f.default}
    return "Tactic(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ")"


def render(choices: list[Choice]) -> str:
    """The ``DEFAULT_TACTICS`` entries, then per GEMM and T the chosen time against the
    fastest of any split and the run's default."""
    lines = ["DEFAULT_TACTICS = {"]
    for c in choices:
        inner = ", ".join(f"{t}: {tactic_literal(x)}" for t, x in c.buckets.items())
        lines.append(f"    {SHAPES[c.gemm]}: {{{inner}}},  # {c.gemm}, split {c.splits}")
    lines += ["}", "", "| GEMM | T | chosen us | fastest of any split us | run's default us |",
              "|---|---|---|---|---|"]
    for c in choices:
        for t, (ours, best, default) in c.per_t.items():
            shown = "-" if default is None else f"{default:.1f}"
            lines.append(f"| {c.gemm} | {t} | {ours:.1f} | {best:.1f} | {shown} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="dense_table result JSONs of one machine")
    ap.add_argument("--family", default="mma.sync", choices=FAMILIES)
    ap.add_argument("--gemms", default=",".join(SHAPES))
    ap.add_argument("--tolerance", type=float, default=0.01,
                    help="a bucket's tactic goes on while within this fraction of the fastest")
    args = ap.parse_args(argv)
    runs = [json.loads(Path(p).read_text()) for p in args.runs]
    devices = {r.get("device") for r in runs}
    if len(devices) > 1:
        ap.error(f"runs of more than one device: {sorted(map(str, devices))}")
    gemms = [g for g in args.gemms.split(",") if g]
    unknown = set(gemms) - set(SHAPES)
    if unknown:
        ap.error(f"unknown GEMMs {sorted(unknown)}; known: {list(SHAPES)}")
    if not 0 <= args.tolerance < 1:
        ap.error(f"--tolerance must be in [0, 1), got {args.tolerance}")
    print(render([choose(g, medians(runs, g), args.family, args.tolerance) for g in gemms]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
