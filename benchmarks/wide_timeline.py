"""Where one wide TP rank's step goes: the device timeline of its kernels (GPU node).

    PYTHONPATH=. python3 -m benchmarks.wide_timeline --ranks 8 --out timeline.json
    python3 -m benchmarks.wide_timeline --render timeline.json

``benchmarks.wide_table`` times each stage of rank 0 alone (its own graph, after an L2
flush) and the whole step. This script takes the step apart: rank 0's step (the shared
expert forked at the front onto the side stream, as the table's ``rank``) is captured in a
CUDA graph, and ``--reps`` replays, each after restoring rank 0's mailbox and flushing L2,
run under ``torch.profiler``. A kernel is named by its class (CuTe DSL puts it in the
symbol) or, for a library kernel, by the first characters of its symbol, and known by its
stream and its place on that stream; per kernel the medians over the replays of

* ``start``: from the step's first kernel start;
* ``dur``: the kernel's own duration;
* ``gap``: from the end of the previous kernel on the same stream to its start (launch
  latency, a wait on the other stream, or below zero where programmatic dependent launch
  overlaps them).

The streams are the graph's own (a replay maps the captured branches onto streams of its
choosing), so a kernel is known by its stream and its place there. Replays whose kernel
sequence on some stream differs from the first replay's are left out (a dropped record),
never aligned by guess. Kernel durations are the profiler's; its start offsets between
streams can include the profiler's own perturbation of a graph launch. The streams are
shown as s0, s1, ... in the order of their first kernel. The byte limit of the step (the
table's) goes beside them.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics

import torch

from benchmarks.wide_table import (fast_stages, measured_layer, published_case, rank_arguments,
                                   rearm_peers, rendered)

#: The project's kernels by class name (what CuTe DSL puts in the kernel symbol).
CLASS_PATTERN = re.compile(r"([A-Z][A-Za-z0-9]*Kernel)")


def short_name(name: str) -> str:
    """A kernel's class name (CuTe DSL) or the first 40 characters of a library symbol."""
    m = CLASS_PATTERN.search(name)
    return m.group(1) if m else name[:40]


def replays_from_records(records, *, start_marker: str, end_marker: str) -> list[list[dict]]:
    """Kernel records ``(name, stream, start_us, end_us)`` of every replay, in start order:
    the kernels between a kernel whose name contains ``start_marker`` and the next one
    whose name contains ``end_marker`` (two tiny kernels the script runs around each
    replay; the L2 flush and the mailbox restore fall outside)."""
    replays, current = [], None
    for name, stream, start, end in sorted(records, key=lambda r: r[2]):
        if start_marker in name:
            current = []
        elif end_marker in name:
            if current:
                replays.append(current)
            current = None
        elif current is not None:
            current.append({"name": short_name(name), "stream": stream, "start": start,
                            "end": end})
    return replays


def _per_stream(replay: list[dict]) -> dict:
    """A replay's kernels by stream, each stream's in start order."""
    streams = {}
    for k in sorted(replay, key=lambda k: k["start"]):
        streams.setdefault(k["stream"], []).append(k)
    return streams


def summarize(replays: list[list[dict]]) -> dict:
    """Per kernel (its stream and its place on that stream) the medians of start (from the
    replay's first kernel), duration and gap after the previous kernel of its stream, in
    order of median start. The streams run side by side, so two replays may interleave
    them differently; a replay whose per-stream kernel sequences differ from the first
    replay's is left out and counted."""
    if not replays:
        raise ValueError("no replay in the profile (were the kernels traced?)")
    grouped = [_per_stream(r) for r in replays]

    def signature(streams):
        return sorted((sid, tuple(k["name"] for k in ks)) for sid, ks in streams.items())

    shape = signature(grouped[0])
    # each kept replay: (its first kernel's start, its kernels by stream)
    kept = [(min(k["start"] for k in r), g) for r, g in zip(replays, grouped)
            if signature(g) == shape]
    rows = []
    for sid, names in shape:
        for i, name in enumerate(names):
            starts, durs, gaps = [], [], []
            for t0, g in kept:
                ks = g[sid]
                starts.append(ks[i]["start"] - t0)
                durs.append(ks[i]["end"] - ks[i]["start"])
                gaps.append(ks[i]["start"] - ks[i - 1]["end"] if i else 0.0)
            rows.append({"name": name, "stream": sid, "start": statistics.median(starts),
                         "dur": statistics.median(durs), "gap": statistics.median(gaps)})
    rows.sort(key=lambda k: k["start"])
    step = statistics.median(max(k["end"] for ks in g.values() for k in ks) - t0
                             for t0, g in kept)
    return {"kernels": rows, "step": step, "replays": len(kept),
            "dropped": len(replays) - len(kept)}


def render(result: dict) -> str:
    lines = [f"Device {result['device']}, torch {result['torch']}; {result['ranks']} virtual TP "
             f"ranks, rank 0's step; read bandwidth {result['read_gbs']:.0f} GB/s (this run); "
             f"medians over graph replays after an L2 flush; us.", ""]
    for case in result["cases"]:
        s = case["summary"]
        lines += [f"### {case['tokens']} rows: step {s['step']:.1f} us, limit "
                  f"{case['limit_us']:.1f} us ({s['replays']} replays, {s['dropped']} dropped)",
                  "", "| # | kernel | stream | start | gap | dur |", "|---|---|---|---|---|---|"]
        streams = {}
        for i, k in enumerate(s["kernels"]):
            sid = streams.setdefault(k["stream"], f"s{len(streams)}")
            lines.append(f"| {i} | {k['name']} | {sid} | {k['start']:.1f} | {k['gap']:.1f} | "
                         f"{k['dur']:.1f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    rank_arguments(ap, out="wide_timeline.json", tokens="65,1024", reps=10)
    args = ap.parse_args(argv)
    if rendered(args, render):
        return

    from torch.profiler import ProfilerActivity, profile

    from benchmarks.experts_table import capture_graph

    tokens_list = [int(t) for t in args.tokens.split(",")]
    layer, w, result, flush = measured_layer(args.ranks, tokens_list, args.experts_tactic)
    # a neg kernel before and an exp kernel after each replay cut the profile into replays
    mark = torch.ones(1, device="cuda")
    for tokens in tokens_list:
        x = torch.randn(tokens, w.config.hidden, device="cuda").bfloat16()
        case, before = published_case(layer, x, tokens, result["read_gbs"], flush)
        restore_and_flush = before["rank"]
        replay = capture_graph(fast_stages(layer, x, tokens)["rank"], restore_and_flush)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.reps):
                restore_and_flush()
                torch.neg(mark, out=mark)
                replay()
                mark.exp_()
            torch.cuda.synchronize()
        records = [(e.name, e.device_resource_id, e.time_range.start, e.time_range.end)
                   for e in prof.events() if e.device_type.name == "CUDA"]
        summary = summarize(replays_from_records(records, start_marker="neg_kernel",
                                                 end_marker="exp_kernel"))
        rearm_peers(layer)
        result["cases"].append(case | {"summary": summary})
        print(f"T {tokens}: step {summary['step']:.1f} us", flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(render(result), end="")


if __name__ == "__main__":
    main()
