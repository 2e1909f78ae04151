"""What a dense GEMM pays beyond its bytes: each of the dense part's four GEMMs timed on
slices of its weight's K, and a line fitted through the times (GPU node).

    python3 -m benchmarks.dense_fixed_cost --out dense-fixed-cost.json
    python3 -m benchmarks.dense_fixed_cost --render dense-fixed-cost.json

Timed alone, each dense GEMM takes 7-9 us more than its byte limit whatever its size. This
run separates the two parts of a GEMM's time: per GEMM (``front``, ``router``,
``shared_down``, ``up`` at the real dimensions) and batch ``T``, the weight's first ``K f``
columns for ``f`` in ``--fractions`` (rounded down to a whole number of the default
tactic's K splits x its stage), each slice timed with

* ``fast.gemm`` at the full weight's default tactic at ``T`` (the same tiles, K splits and
  grid as the full GEMM, each CTA's stream ``f`` as long), and
* cuBLAS (``fast.stock``, the library's own choice per shape),

and a least-squares line ``time = fixed + bytes / rate`` through the slices (:func:`fit_line`):
``fixed`` is what a call costs whatever its length (launch, the first DRAM round trips, the
ring's fill, the split-K reduction, the epilogue, the last CTAs), ``rate`` the rate at which
its stream runs once going, against the read bandwidth measured in the same run
(``benchmarks.readbw``). A GEMM far from its bytes because of ``fixed`` gains from
structures that overlap or remove calls (one launch for several GEMMs, a persistent kernel);
one whose ``rate`` is short of the read bandwidth gains from more bytes in flight. The floor
of the timing itself, a graph of one tiny kernel after the same flush, is ``floor_us``.

``--tactics`` adds fast.gemm variants of each default tactic, fitted the same way:
``"splits=1;occupancy=1;ring=4,stage_k=128"`` (``;`` between variants, ``key=int`` fields of
``fast.gemm.Tactic`` over the default's), so one run can say what sets a GEMM's rate (its K
split, CTAs per multiprocessor, ring depth, stage width). A variant with another K split
gives other bits; it is timed, not shipped.

Each figure is the median of ``--reps`` CUDA-graph replays after an L2 flush by a 256 MiB
read (``benchmarks.experts_table.device_time_us``); the JSON holds every sample.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

__all__ = ["GEMMS", "DEFAULT_FRACTIONS", "k_slices", "fit_line", "parse_variants", "variant_tactic",
           "render", "main"]

GEMMS = ("front", "router", "shared_down", "up")
DEFAULT_FRACTIONS = (0.125, 0.25, 0.5, 1.0)
def k_slices(k: int, splits: int, stage_k: int, fractions) -> list[int]:
    """The K widths timed for a weight of ``k`` columns whose tactic has ``splits`` K splits
    of ``stage_k``-wide stages: ``k f`` rounded down to a multiple of ``splits * stage_k``
    for each ``f`` in ``fractions`` (each in (0, 1]), at least one stage per split, without
    repeats, ascending. Raises ValueError for a fraction outside (0, 1] or ``k`` not a
    positive multiple of ``splits * stage_k``."""
    quantum = splits * stage_k
    if splits < 1 or stage_k < 1 or k < quantum or k % quantum:
        raise ValueError(f"k ({k}) must be a positive multiple of splits x stage_k = {quantum}")
    widths = set()
    for f in fractions:
        if not 0 < f <= 1:
            raise ValueError(f"fractions must lie in (0, 1], got {f}")
        widths.add(max(quantum, int(k * f) // quantum * quantum))
    return sorted(widths)


#: The ``fast.gemm.Tactic`` fields a ``--tactics`` variant may set (ints; wgmma, serial and
#: overlap as 0 / 1).
VARIANT_FIELDS = ("warps", "mtiles", "splits", "stage_k", "occupancy", "ring", "wgmma", "serial",
                  "overlap")


def parse_variants(spec: str) -> list[dict]:
    """``"splits=1;occupancy=1,ring=4"`` -> ``[{"splits": 1}, {"occupancy": 1, "ring": 4}]``.
    Raises ValueError naming ``--tactics`` for an item that is not ``field=int`` of
    ``VARIANT_FIELDS``, or an empty variant."""
    variants = []
    for part in spec.split(";"):
        if not part.strip():
            continue
        variant = {}
        for item in part.split(","):
            key, eq, value = item.strip().partition("=")
            if not eq or key not in VARIANT_FIELDS or not value.strip().lstrip("-").isdigit():
                raise ValueError(f"--tactics: each item is field=int with field one of "
                                 f"{VARIANT_FIELDS}, got {item!r}")
            variant[key] = int(value)
        variants.append(variant)
    return variants


def variant_tactic(default, variant: dict):
    """``default`` (a ``fast.gemm.Tactic``) with the fields of ``variant`` replaced (the
    booleans as bools); the Tactic's own checks raise ValueError for a field it refuses."""
    import dataclasses

    fields = {k: bool(v) if k in ("wgmma", "serial", "overlap") else v for k, v in variant.items()}
    return dataclasses.replace(default, **fields)


def variant_name(variant: dict) -> str:
    """The backend name of a variant in a result: ``fast:splits=1,ring=4``."""
    return "fast:" + ",".join(f"{k}={v}" for k, v in variant.items())


def fit_line(nbytes, times_us) -> dict:
    """Least squares ``time = fixed + bytes / rate`` through ``(bytes, us)`` points:
    ``{"fixed_us", "rate_gbs", "r2"}`` (``rate_gbs`` None where the slope is not positive).
    Raises ValueError for fewer than two distinct byte counts or lists of unequal length."""
    xs, ys = [float(b) for b in nbytes], [float(t) for t in times_us]
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError("fit_line needs at least two distinct byte counts, one time each")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx  # us per byte
    fixed = my - slope * mx
    ss_res = sum((y - fixed - slope * x) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return {"fixed_us": fixed, "rate_gbs": 1e-3 / slope if slope > 0 else None,
            "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0}


def render(result: dict) -> str:
    """Markdown: per GEMM, T and backend the fitted fixed cost and stream rate (and its
    fraction of the run's read bandwidth), the full GEMM's time and byte limit, and the
    times of every slice."""
    from benchmarks.provenance import tree_note

    bw = result["read_gbs"]
    lines = [f"Device {result['device']}, torch {result['torch']}{tree_note(result)}; read "
             f"bandwidth {bw:.0f} GB/s (this run); timing floor (a graph of one tiny kernel) "
             f"{result['floor_us']:.1f} us; medians of graph replays after an L2 flush by a "
             "256 MiB read. Fit: time = fixed + bytes / rate over the K slices.", "",
             "| GEMM | T | backend | tactic | full us | limit us | fixed us | rate GB/s (of read) "
             "| r2 | slices: K -> us |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for case in result["cases"]:
        for backend, fit in case["fits"].items():
            med = case["median_us"][backend]
            rate = fit["rate_gbs"]
            rate_cell = "-" if rate is None else f"{rate:.0f} ({rate / bw:.2f})"
            widths = case.get("variant_k", {}).get(backend, case["k"])
            slices = ", ".join(f"{k} -> {t:.1f}" for k, t in zip(widths, med))
            tactic = case.get("tactics", {}).get(backend, case["tactic"] if backend == "fast" else "-")
            lines.append(f"| {case['gemm']} | {case['tokens']} | {backend.split(':')[0]} | {tactic} | "
                         f"{med[-1]:.1f} | {case['limit_us'][-1]:.1f} | {fit['fixed_us']:.1f} | "
                         f"{rate_cell} | {fit['r2']:.3f} | {slices} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.dense_fixed_cost",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--render", help="print the markdown table of a result JSON and exit")
    ap.add_argument("--out", default="dense-fixed-cost.json")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--gemms", default=",".join(GEMMS))
    ap.add_argument("--fractions", default=",".join(str(f) for f in DEFAULT_FRACTIONS))
    ap.add_argument("--tactics", default="",
                    help="fast.gemm variants of each default tactic, e.g. 'splits=1;occupancy=1,ring=4' "
                         f"(fields {','.join(VARIANT_FIELDS)})")
    args = ap.parse_args(argv)
    from benchmarks.experts_table import rendered

    if rendered(args, render):
        return
    gemms = [g for g in args.gemms.split(",") if g]
    if not gemms or set(gemms) - set(GEMMS):
        ap.error(f"--gemms must be some of {','.join(GEMMS)}, got {args.gemms!r}")
    try:
        variants = parse_variants(args.tactics)
    except ValueError as error:
        ap.error(str(error))
    fractions = [float(f) for f in args.fractions.split(",") if f]
    tokens_list = [int(t) for t in args.tokens.split(",") if t]

    import torch

    from benchmarks.dense_table import _bytes, _cublas, _inputs
    from benchmarks.experts_table import device_time_us, l2_flush, new_result
    from fast.gemm import DenseGemm
    from model.config import LatentMoEConfig
    from verify import cases

    cfg = LatentMoEConfig.kimi_k3()
    flush = l2_flush()
    t0 = time.time()
    result = {**new_result(), "fractions": fractions}
    tiny = torch.zeros(1, device="cuda")
    result["floor"] = device_time_us(lambda: tiny.add_(1), reps=args.reps, flush=flush)
    result["floor_us"] = statistics.median(result["floor"])
    print(f"read {result['read_gbs']:.0f} GB/s, floor {result['floor_us']:.1f} us", flush=True)
    w = cases.dense_weights("kimi_k3", "cuda")
    top = max(tokens_list)
    weights = {g: d[0] for g, d in _inputs(cfg, w, 1, 0).items() if g in gemms}
    # per GEMM and variant (the default first: the empty variant, backend "fast"): its tactic
    # at each T, and one engine per K slice built once for those tactics (the same tiles and
    # K split, each CTA's stream shorter); a variant a GEMM refuses is left out, said why
    named = [("fast", {})] + [(variant_name(v), v) for v in variants]
    runs = {}  # (gemm, backend) -> ({T: tactic}, [(K width, engine)])
    for g, weight in weights.items():
        full = DenseGemm(weight, max_tokens=top)
        for name, variant in named:
            try:
                own = {t: variant_tactic(full.tactic(t), variant) for t in tokens_list}
                splits = {x.splits for x in own.values()}
                if len(splits) != 1:
                    raise ValueError("the default tactics differ in K split over --tokens; "
                                     "give the variant its own splits")
                v_splits = splits.pop()
                stage_k = max(x.stage_k for x in own.values())
                runs[g, name] = (own, [
                    (width, DenseGemm(weight[:, :width].contiguous(), max_tokens=top,
                                      tactics=set(own.values()), splits=v_splits))
                    for width in k_slices(weight.shape[1], v_splits, stage_k, fractions)])
            except ValueError as error:
                if not variant:
                    raise
                print(f"{g} {name} left out: {error}", flush=True)
    for tokens in tokens_list:
        data = _inputs(cfg, w, tokens, 2000 + tokens)
        for g in gemms:
            weight, a, addend, out_dtype = data[g]
            out = torch.empty(tokens, weight.shape[0], dtype=out_dtype, device="cuda")
            case = {"gemm": g, "tokens": tokens, "tactic": runs[g, "fast"][0][tokens].label(),
                    "times": {}, "tactics": {}, "variant_k": {}, "variant_bytes": {}}
            for name, _ in named:
                if (g, name) not in runs:
                    continue
                own, engines = runs[g, name]
                tactic, widths, nbytes = own[tokens], [], []
                case["times"][name] = []
                if name == "fast":  # cuBLAS on the default's slices
                    case["times"]["cublas"] = []
                for width, eng in engines:
                    a_slice = a[:, :width].contiguous()
                    widths.append(width)
                    nbytes.append(_bytes(eng.weight, a_slice, addend, out_dtype))
                    case["times"][name].append(device_time_us(
                        lambda: eng(a_slice, out_dtype=out_dtype, addend=addend, out=out,
                                    tactic=tactic), reps=args.reps, flush=flush))
                    if name == "fast":
                        case["times"]["cublas"].append(device_time_us(
                            _cublas(g, eng.weight, a_slice, addend, out_dtype), reps=args.reps,
                            flush=flush))
                if name == "fast":
                    case["k"], case["bytes"] = widths, nbytes
                    case["limit_us"] = [b / (result["read_gbs"] * 1e9) * 1e6 for b in nbytes]
                else:
                    case["tactics"][name] = tactic.label()
                    case["variant_k"][name], case["variant_bytes"][name] = widths, nbytes
            case["median_us"] = {b: [statistics.median(s) for s in samples]
                                 for b, samples in case["times"].items()}
            case["fits"] = {b: fit_line(case["variant_bytes"].get(b, case["bytes"]), med)
                            for b, med in case["median_us"].items()}
            result["cases"].append(case)
            f = case["fits"]["fast"]
            print(f"T={tokens} {g}: fast fixed {f['fixed_us']:.1f} us rate {f['rate_gbs'] or 0:.0f} GB/s; "
                  f"full {case['median_us']['fast'][-1]:.1f} us (cuBLAS "
                  f"{case['median_us']['cublas'][-1]:.1f})", flush=True)
    result["wall_s"] = time.time() - t0
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(render(result), end="")


if __name__ == "__main__":
    main()
