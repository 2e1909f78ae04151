"""What each part of the experts engine's work costs at the real dimensions (GPU node).

    python -m benchmarks.experts_ablation --out ablation.json

The call's default kernels are timed as they are and with parts of their work left out
(``fast.experts.kernels.ExpertsGemmKernel(ablate=...)``, in FC1 and FC2 alike), in one
run, the same way as ``benchmarks.experts_table`` (CUDA graph, L2 flushed before every
replay, median of ``--reps``):

* ``decode``: the prepared weight words go to the MMAs as they are: no bit operations and
  no scale multiplies;
* ``situ``: FC1's activation is its gate sum: no SiTU (the block maxima, the MXFP8
  re-quantization and the stores stay);
* ``bcopy``: no copies of the B operand (the token rows) into the ring;
* ``wcopy``: no copies of the weights and their scales (the decode reads whatever the
  ring holds): with ``bcopy``, the kernels without their memory traffic;
* ``mma8``: the MMAs of each item's first window only (``m64n8k16`` instead of
  ``m64n(8 live)k16``): the tensor cores' share at several windows;
* ``bcopy16`` (warpgroup MMA only): each 16-byte piece of a token row copied whole into the
  core matrix of its 8 k instead of as four 4-byte words into four (the copies B rows
  stored in the MMA's k order would need; the k order of this measurement is wrong).

Parts combine with ``+`` (``decode+situ``). The rows of an ablated call are WRONG: this is
a measurement of where the time goes, nothing more. The engine's tactics cannot reach the
parameter; this script sets it by wrapping the engine's kernel parameters for its own
calls only (``ablated``).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch

from benchmarks.experts_table import (K, L, device_time_us, experts_arguments, parse_tactic,
                                      rank_case, rendered, run_ranks, start_run)


@contextlib.contextmanager
def ablated(parts: tuple[str, ...]):
    """Within the block, every engine call's FC1 and FC2 kernels leave ``parts`` out (one
    of ``fast.experts.kernels.ABLATION_PARTS`` each; the kernels refuse any other)."""
    from fast.experts import engine as engine_module

    original = engine_module.kernel_params

    def with_parts(*args, **kwargs):
        params = original(*args, **kwargs)

        def add(entry):
            return tuple(sorted({**dict(entry), "ablate": tuple(sorted(parts))}.items()))

        for kind in ("fc1", "fc2"):
            if kind in params:
                params[kind] = add(params[kind])
        if "fused" in params:
            params["fused"] = tuple((kind, add(entry)) for kind, entry in params["fused"])
        return params

    engine_module.kernel_params = with_parts
    try:
        yield
    finally:
        engine_module.kernel_params = original


def render(result: dict) -> str:
    """The markdown table of a result: per case the full call's time (fraction of the
    byte limit) and each ablated call's time over it."""
    names = [k for k in result["cases"][0]["median_us"] if k != "full"]
    lines = [f"{result['device']}, read bandwidth {result['read_gbs']:.0f} GB/s; each column: "
             "the call with those parts left out or cut down (`+`-joined; `@` a tactic over "
             "the default), us (time over the full call's; wrong rows: a measurement only)", "",
             "| rank | T / rows | touched | limit us | full us (fraction) | "
             + " | ".join(names) + " |",
             "|---" * (5 + len(names)) + "|"]
    for case in result["cases"]:
        med = case["median_us"]
        full = med["full"]
        size = case["size"]
        lines.append(f"| {case['mode'].upper()} | {size} | {case['touched']} | "
                     f"{case['limit_us']:.1f} | {full:.1f} ({case['limit_us'] / full:.2f}) | "
                     + " | ".join(f"{med[n]:.1f} ({med[n] / full:.2f})" for n in names) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser()
    experts_arguments(ap, out="experts_ablation.json", reps=20, dep_tokens="8,64",
                      wide_rows="256,1024")
    ap.add_argument("--ablations", default="decode;situ;bcopy;decode+situ",
                    help="';'-separated sets of parts, each '+'-joined")
    ap.add_argument("--skew", type=float, default=0.0,
                    help="the routing's Zipf exponent (rank_case; 0: uniform)")
    ap.add_argument("--tactics", default="",
                    help="';'-separated engine tactics over the call's default (e.g. 'ring=4'): "
                         "every set of parts is timed at each, after the default")
    args = ap.parse_args(argv)
    if rendered(args, render):
        return

    from fast.experts import ExpertsEngine, prepare_experts

    flush, t0, result, w = start_run()
    sets = [tuple(filter(None, spec.split("+"))) for spec in args.ablations.split(";") if spec]
    overs = [("", {})] + [(spec, parse_tactic(spec)) for spec in args.tactics.split(";") if spec]

    def run_mode(mode, first, count, shard, sizes):
        prepared = prepare_experts(w, "cuda", experts=(first, count), shard=shard)
        per_expert = prepared.expert_bytes()
        engine = ExpertsEngine(prepared, max_rows=max(sizes) * (16 if mode == "dep16" else 1))
        for size in sizes:
            inputs = rank_case(mode, size, args.skew, first, count, per_expert,
                               result["read_gbs"])
            rows, ids, limit_us = inputs["rows"], inputs["ids"], inputs["limit_us"]
            codes, scales, touched = inputs["codes"], inputs["scales"], inputs["touched"]
            case = {"mode": mode, "size": size, "rows": rows, "skew": args.skew,
                    "touched": touched, "max_pairs": inputs["max_pairs"],
                    "limit_us": limit_us, "tactic": engine.default_tactic(rows), "times": {}}
            out = torch.empty(rows * K, L, dtype=torch.bfloat16, device="cuda")
            for spec, over in overs:
                tactic = engine.default_tactic(rows, over=over) if over else None
                for parts in [()] + sets:
                    name = ("+".join(parts) or "full") + (f" @{spec}" if spec else "")
                    with ablated(parts):
                        engine(codes, scales, ids, out=out, tactic=tactic)  # compiles
                        case["times"][name] = device_time_us(
                            lambda: engine(codes, scales, ids, out=out, validate=False,
                                           tactic=tactic), reps=args.reps, flush=flush)
            case["median_us"] = {k: statistics.median(v) for k, v in case["times"].items()}
            full = case["median_us"]["full"]
            print(f"{mode:5s} size {size:5d} limit {limit_us:6.1f}us "
                  + " | ".join(f"{k} {v:7.1f}us ({v / full:4.2f})"
                               for k, v in case["median_us"].items()), flush=True)
            result["cases"].append(case)

    run_ranks(args, run_mode, result, t0)


if __name__ == "__main__":
    main()
