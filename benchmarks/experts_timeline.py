"""Where an engine call's fixed cost goes: the device timeline of its kernels (GPU node).

    PYTHONPATH=. python3 -m benchmarks.experts_timeline --out timeline.json
    python3 -m benchmarks.experts_timeline --render timeline.json

The experts table gives one figure per call; its straight-line fit separates a fixed cost
(about 39 us on the H200) from the streaming. This script takes the call apart. Each
configuration (mode, size, tactic) is captured in a CUDA graph like the table's, and
``--reps`` replays, each after the L2 flush, run under ``torch.profiler``; the kernel
records (start, end) of each replay give, per call (where the profiler records no kernel
of a graph replay, eager calls are profiled instead and the case says ``launch: eager``):

* ``lists``, ``plan``: the routing-lists and plan kernels' durations;
* ``gap_plan``, ``gap_fc1``: from the end of one kernel to the start of the next (launch
  latency, or less than zero where programmatic dependent launch overlaps them);
* ``fc1``, ``fc2``: the two GEMMs' durations (``fused``: the one grid's);
* ``fc2_after_fc1``: from FC1's end to FC2's end (FC2's own time once FC1 is done; with
  ``pdl`` FC2 starts before FC1 ends, so its duration alone overstates it);
* ``call``: from the list kernel's start to the last kernel's end.

Medians over the replays. The byte limit (touched experts x bytes per expert at the read
bandwidth measured in the same run) goes beside them, so ``call - limit`` is what the
call spends beyond streaming. The profiler's own cost is outside the kernels' records.
"""

from __future__ import annotations

import argparse
import json
import statistics

from benchmarks.experts_table import parse_tactic, rendered

#: The engine's kernels by class name (what CuTe DSL puts in the kernel symbol).
KERNELS = {"RoutingListsKernel": "lists", "PlanKernel": "plan", "ExpertsGemmKernel": "gemm",
           "FusedExpertsKernel": "fused"}
FIELDS = ("lists", "gap_plan", "plan", "gap_fc1", "fc1", "fc2", "fc2_after_fc1", "call")


def kind_of(name: str) -> str | None:
    """The engine kernel a profiler record names (None: another kernel, e.g. the flush)."""
    for cls, kind in KERNELS.items():
        if cls in name:
            return kind
    return None


def calls_from_records(records) -> list[dict]:
    """Per-call timings (us) from kernel records ``(name, start_us, end_us)`` in any order:
    the engine's kernels sorted by start, cut into calls at each list kernel; a call's
    GEMM records are FC1 then FC2 (or one fused grid). Calls missing a kernel (the
    profiler dropped a record) are left out rather than guessed."""
    engine = sorted(((kind_of(n), s, e) for n, s, e in records if kind_of(n)), key=lambda r: r[1])
    calls, current = [], None
    for kind, start, end in engine:
        if kind == "lists":
            if current is not None:
                calls.append(current)
            current = {"lists": (start, end), "gemm": []}
        elif current is not None:
            if kind == "plan":
                current["plan"] = (start, end)
            else:
                current["gemm"].append((kind, start, end))
    if current is not None:
        calls.append(current)
    out = []
    for c in calls:
        gemms = c["gemm"]
        if "plan" not in c or not gemms:
            continue
        fused = gemms[0][0] == "fused"
        if (fused and len(gemms) != 1) or (not fused and len(gemms) != 2):
            continue
        (l0, l1), (p0, p1) = c["lists"], c["plan"]
        g1 = gemms[0][1:]
        g2 = g1 if fused else gemms[1][1:]
        out.append({
            "lists": l1 - l0, "gap_plan": p0 - l1, "plan": p1 - p0, "gap_fc1": g1[0] - p1,
            "fc1": g1[1] - g1[0], "fc2": 0.0 if fused else g2[1] - g2[0],
            "fc2_after_fc1": 0.0 if fused else g2[1] - g1[1],
            "call": max(g1[1], g2[1]) - l0, "fused": fused,
        })
    return out


def summarize(calls: list[dict]) -> dict:
    """Median of each field over the calls."""
    if not calls:
        raise ValueError("no complete engine call in the profile (were the kernels traced?)")
    return {f: statistics.median(c[f] for c in calls) for f in FIELDS} | {"calls": len(calls)}


def render(result: dict) -> str:
    lines = [f"Device {result['device']}, torch {result['torch']}; read bandwidth "
             f"{result['read_gbs']:.0f} GB/s (this run); medians of {result['reps']} graph "
             "replays after an L2 flush; us.", "",
             "| mode | size | tactic | limit | " + " | ".join(FIELDS) + " | call - limit |",
             "|---" * (len(FIELDS) + 5) + "|"]
    for case in result["cases"]:
        m = case["median_us"]
        cells = " | ".join(f"{m[f]:.1f}" for f in FIELDS)
        tactic = (case["tactic"] or "default") + (" (eager)" if case.get("launch") == "eager" else "")
        lines.append(f"| {case['mode']} | {case['size']} | {tactic} | "
                     f"{case['limit_us']:.1f} | {cells} | {m['call'] - case['limit_us']:.1f} |")
    return "\n".join(lines) + "\n"


def _profile(replay, flush, reps: int) -> list[dict]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush()
            replay()
        torch.cuda.synchronize()
    records = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type.name == "CUDA"]
    return calls_from_records(records)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--render", help="print the markdown table of a result JSON and exit")
    ap.add_argument("--out", default="experts_timeline.json")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dep-tokens", default="1,4,16,64")
    ap.add_argument("--wide-rows", default="65,1024")
    ap.add_argument("--tactics", default=";wgmma=1;pdl_chain=1;fused=1;wgmma=1,pdl_chain=1,fused=1",
                    help="';'-separated tactics, '' = the default")
    args = ap.parse_args(argv)
    if rendered(args, render):
        return
    tactics = [parse_tactic(t) for t in args.tactics.split(";")]

    import torch

    from benchmarks import experts_table as table
    from fast.experts import ExpertsEngine, prepare_experts

    torch.manual_seed(0)
    flush = table.l2_flush()
    result = {**table.new_result(), "reps": args.reps}
    w = table.random_weights()
    modes = []
    if args.dep_tokens:
        modes.append(("dep16", 0, 56, (0, 1), [int(v) for v in args.dep_tokens.split(",")]))
    if args.wide_rows:
        modes.append(("tp8", 0, 896, (0, 8), [int(v) for v in args.wide_rows.split(",")]))
    for mode, first, count, shard, sizes in modes:
        prepared = prepare_experts(w, "cuda", experts=(first, count), shard=shard)
        engine = ExpertsEngine(prepared, max_rows=max(sizes) * (16 if mode == "dep16" else 1))
        for size in sizes:
            inputs = table.rank_case(mode, size, 0.0, first, count, prepared.expert_bytes(),
                                     result["read_gbs"])
            rows, ids, limit_us = inputs["rows"], inputs["ids"], inputs["limit_us"]
            codes, scales, touched = inputs["codes"], inputs["scales"], inputs["touched"]
            out = torch.empty(rows * table.K, table.L, dtype=torch.bfloat16, device="cuda")
            for tactic in tactics:
                full = engine.default_tactic(rows, over=tactic)
                engine(codes, scales, ids, out=out, tactic=full)  # validated once
                def call():
                    engine(codes, scales, ids, out=out, tactic=full, validate=False)

                launch = "graph"
                calls = _profile(table.capture_graph(call, flush), flush, args.reps)
                if not calls:  # this profiler records no kernel of a graph replay
                    launch = "eager"
                    calls = _profile(call, flush, args.reps)
                case = {"mode": mode, "size": size, "rows": rows, "touched": touched,
                        "launch": launch,
                        "limit_us": limit_us, "tactic": ",".join(f"{k}={v}" for k, v in tactic.items()),
                        "calls": calls, "median_us": summarize(calls)}
                result["cases"].append(case)
                m = case["median_us"]
                print(f"{mode} {size:5d} {case['tactic'] or 'default':30s} limit {limit_us:6.1f} | "
                      + " ".join(f"{f} {m[f]:6.1f}" for f in FIELDS), flush=True)
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
