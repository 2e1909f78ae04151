"""What splitting a skewed call by expert weight would save (GPU node): an estimate for a
grid whose items carry their own window count, measured with two calls of today's engine.

    python -m benchmarks.experts_heavy_split --out heavy_split.json

A call's window count is one compile-time constant (``fast.experts.engine.choose_windows``),
so in a skewed call the heavy experts repeat their decode once per window group while the
light ones run whatever tile the count brings. Here the local experts of each case are
split at ``--heavy-pairs`` pairs: the *light* call sees only the light experts' pairs
(one window per item), the *heavy* call only the heavy experts' (``--heavy-windows``
windows per item); every other slot holds -1 (an engine built with ``empty_rows``: no
pair). Both calls write one output buffer, whose rows are checked bit for bit against
the default call's (the window count changes no bit), then the two calls are timed back
to back in one CUDA graph, the same way as ``benchmarks.experts_table`` (L2 flushed
before every replay, median of ``--reps``), beside the default call and each call alone.

Two launches pay two grids' ramp and tail; a single grid with items of either kind would
not, so the pair's time is an upper bound of what such a grid would take.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.experts_table import (K, L, device_time_us, experts_arguments, rank_case,
                                      rendered, run_ranks, start_run)


def split_ids(ids: torch.Tensor, first: int, count: int, heavy_pairs: int):
    """``(light, heavy)``: copies of int32 ``ids [rows, K]`` holding only the pairs of the
    local experts ``[first, first + count)`` with at most / more than ``heavy_pairs``
    pairs, every other slot -1; and the number of heavy experts."""
    local = (ids >= first) & (ids < first + count)
    counts = torch.bincount((ids[local] - first).long(), minlength=count)
    heavy_expert = counts > heavy_pairs
    is_heavy = torch.zeros_like(local)
    is_heavy[local] = heavy_expert[(ids[local] - first).long()]
    empty = torch.full_like(ids, -1)
    light = torch.where(local & ~is_heavy, ids, empty)
    heavy = torch.where(is_heavy, ids, empty)
    return light, heavy, int(heavy_expert.sum())


def render(result: dict) -> str:
    """Markdown: per case the default call's median and fraction of the byte limit, and
    each other call's median as a fraction of the default's."""
    names = [n for n in result["cases"][0]["median_us"] if n != "default"]
    lines = [f"Device {result['device']}, torch {result['torch']}; read bandwidth "
             f"{result['read_gbs']:.0f} GB/s (this run); heavy: more than "
             f"{result['heavy_pairs']} pairs; light / heavy_wN / split_wN: us (time / default); "
             "split rows bitwise the default's: yes / NO.", "",
             "| mode | size | skew | touched | heavy experts | max pairs | limit us | "
             "default us (frac) | " + " | ".join(names) + " | split bits |",
             "|" + "---|" * (9 + len(names))]
    for c in result["cases"]:
        med, base = c["median_us"], c["median_us"]["default"]
        bits = ", ".join(("yes" if ok else "NO") for ok in c["same_bits"].values())
        lines.append(f"| {c['mode']} | {c['size']} | {c['skew']:.1f} | {c['touched']} | "
                     f"{c['heavy_experts']} | {c['max_pairs']} | {c['limit_us']:.1f} | "
                     f"{base:.1f} ({c['limit_us'] / base:.2f}) | "
                     + " | ".join(f"{med[n]:.1f} ({med[n] / base:.2f})" for n in names)
                     + f" | {bits} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser()
    experts_arguments(ap, out="experts_heavy_split.json", reps=20, dep_tokens="8,32,64",
                      wide_rows="256,512,1024")
    ap.add_argument("--skews", default="1.0,0")
    ap.add_argument("--heavy-pairs", type=int, default=8,
                    help="an expert with more pairs than this is heavy (8: one window)")
    ap.add_argument("--heavy-windows", default="2,4")
    args = ap.parse_args(argv)
    if rendered(args, render):
        return

    from fast.experts import ExpertsEngine, prepare_experts

    flush, t0, result, w = start_run()
    result["heavy_pairs"] = args.heavy_pairs
    heavy_windows = [int(v) for v in args.heavy_windows.split(",")]

    def run_mode(mode, first, count, shard, sizes):
        prepared = prepare_experts(w, "cuda", experts=(first, count), shard=shard)
        max_rows = max(sizes) * (16 if mode == "dep16" else 1)
        engine = ExpertsEngine(prepared, max_rows=max_rows, empty_rows=True)
        for skew in [float(s) for s in args.skews.split(",")]:
            for size in sizes:
                inputs = rank_case(mode, size, skew, first, count, prepared.expert_bytes(),
                                   result["read_gbs"])
                rows, ids = inputs["rows"], inputs["ids"]
                codes, scales = inputs["codes"], inputs["scales"]
                light, heavy, n_heavy = split_ids(ids, first, count, args.heavy_pairs)
                case = {"mode": mode, "size": size, "skew": skew, "rows": rows,
                        "touched": inputs["touched"], "max_pairs": inputs["max_pairs"],
                        "heavy_experts": n_heavy, "limit_us": inputs["limit_us"],
                        "times": {}, "same_bits": {}}
                want = torch.empty(rows * K, L, dtype=torch.bfloat16, device="cuda")
                out = torch.empty_like(want)
                engine(codes, scales, ids, out=want)
                calls = {"default": lambda: engine(codes, scales, ids, out=out, validate=False),
                         "light": lambda: engine(codes, scales, light, out=out, windows=1,
                                                 validate=False)}
                # both calls' rows, validated, against the default call's at every local
                # pair: the light rows once, each heavy call's over them
                out.fill_(float("nan"))
                engine(codes, scales, light, out=out, windows=1)
                pairs = ids.reshape(-1)
                local = (pairs >= first) & (pairs < first + count)
                for hw in heavy_windows:
                    calls[f"heavy_w{hw}"] = (lambda hw=hw: engine(
                        codes, scales, heavy, out=out, windows=hw, validate=False))
                    calls[f"split_w{hw}"] = (lambda hw=hw: (calls["light"](),
                                                           calls[f"heavy_w{hw}"]()))
                    engine(codes, scales, heavy, out=out, windows=hw)
                    case["same_bits"][f"split_w{hw}"] = bool(torch.equal(
                        out[local].view(torch.int16), want[local].view(torch.int16)))
                for name, fn in calls.items():
                    case["times"][name] = device_time_us(fn, reps=args.reps, flush=flush)
                case["median_us"] = {k: statistics.median(v) for k, v in case["times"].items()}
                med = case["median_us"]
                print(f"{mode:5s} size {size:5d} skew {skew:3.1f} heavy {n_heavy:3d} "
                      f"max {inputs['max_pairs']:4d} limit {inputs['limit_us']:6.1f}us "
                      f"bits {case['same_bits']} "
                      + " | ".join(f"{k} {v:7.1f}us ({v / med['default']:4.2f})"
                                   for k, v in med.items()), flush=True)
                result["cases"].append(case)

    run_ranks(args, run_mode, result, t0)


if __name__ == "__main__":
    main()
