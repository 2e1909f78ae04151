"""Is cuBLAS batch invariant once split-K is off? One GPU run over both schedules' dense GEMMs.

    python3 -m benchmarks.cublas_splitk_probe --out probe.json
    python3 -m benchmarks.cublas_splitk_probe --render probe.json

The layers' stock dense GEMMs (``fast.stock``: ``torch.mm`` / ``torch.addmm`` with FP32
reduction) let cuBLAS pick a kernel per row count, and with it a split of K, so a row's
bits change with the batch (``docs/verify.md``). PyTorch can forbid cuBLAS's split-K
reductions (``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = (False,
False)``: the second flag is ``allow_splitk``). Whether every kernel cuBLAS then picks sums
each output element in the same order at every row count is not documented; this measures
it, at the real dimensions, for

* the DEP rank's four GEMMs (``fast.schedules.dense.gemm_shapes``) at every ``T`` of
  ``--dep-rows`` (default 1..64), and
* the TP8 rank's four (``fast.schedules.wide_gemms.gemm_shapes``) at every row count of
  ``--wide-rows`` (default 1..1024),

each with split-K allowed (the stock setting) and forbidden. A GEMM's rows at ``M`` rows are
compared bitwise with the same rows of its call at the largest ``M``; the inputs have a
wide dynamic range (each K column scaled by a power of two in ``2^-8..2^8``), so another
summation order shows in the BF16 outputs too, not only in the FP32 ones. At a few row
counts (``--time-rows``) each setting is timed (graph replays after an L2 flush, medians of
``--reps``, fraction of the byte limit at the read bandwidth measured in the run) and the
names of the kernels it launched are kept.

The answer is a property of the installed cuBLAS, so a run names its versions; it is
evidence for a backend, not the backend's contract (that would be a ``verify/`` sweep on
the node that runs it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.experts_table import device_time_us, rendered
from benchmarks.provenance import run_header, tree_note

#: setting -> (``torch.backends.cuda.preferred_blas_library``, the BF16 reduction flags):
#: the stock call as the layers make it, the same on cuBLASLt, and cuBLASLt without split-K
#: (PyTorch takes ``allow_splitk=False`` only on cuBLASLt).
SETTINGS = {"splitk": ("default", (False, True)), "lt_splitk": ("cublaslt", (False, True)),
            "no_splitk": ("cublaslt", (False, False))}


def parse_rows(text: str) -> list[int]:
    """``"1..64"``, ``"1,8,64"`` or a mix (``"1..4,8,16"``) -> sorted distinct row counts."""
    rows: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, sep, hi = part.partition("..")
        first, last = int(lo), int(hi) if sep else int(lo)
        if first < 1 or last < first:
            raise ValueError(f"rows: bad range {part!r} (need 1 <= first <= last)")
        rows.update(range(first, last + 1))
    return sorted(rows)


def differing_rows(got: torch.Tensor, want: torch.Tensor) -> int:
    """How many rows of ``got`` differ bitwise from the same rows of ``want`` (same shape,
    BF16 or FP32; NaNs compared by bits)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        raise ValueError(f"got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}")
    view = torch.int16 if got.dtype == torch.bfloat16 else torch.int32
    return int((got.view(view) != want.view(view)).any(dim=1).sum())


def gemm_cases(config, ranks: int) -> dict[str, dict]:
    """Per schedule and GEMM: its weight shape ``(N, K)``, output dtype and addend."""
    from fast.schedules import dense, wide_gemms

    dep = dense.gemm_shapes(config)
    wide = wide_gemms.gemm_shapes(config, ranks)
    out = {}
    for name, shape in dep.items():
        out[f"dep.{name}"] = {"shape": shape, "fp32_out": name == "router", "addend": name == "up"}
    for name, shape in wide.items():
        out[f"tp{ranks}.{name}"] = {"shape": shape, "fp32_out": name == "front", "addend": name == "up"}
    return out


def _call(case: dict, weight, a, addend):
    """The stock call of ``case`` (``fast.stock``'s, without its flag setting)."""
    if case["fp32_out"]:
        return torch.mm(a, weight.t(), out_dtype=torch.float32)
    if case["addend"]:
        return torch.addmm(addend, a, weight.t())
    return torch.mm(a, weight.t())


def _inputs(case: dict, rows: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    n, k = case["shape"]
    weight = torch.randn(n, k, generator=g, device="cuda").to(torch.bfloat16)
    scale = torch.exp2(torch.randint(-8, 9, (k,), generator=g, device="cuda").float())
    a = (torch.randn(rows, k, generator=g, device="cuda") * scale).to(torch.bfloat16)
    addend = torch.randn(rows, n, generator=g, device="cuda").to(torch.bfloat16) if case["addend"] else None
    return weight, a, addend


def cublas_library() -> str:
    """The file name of the cuBLAS library this process has loaded (its version is in the
    name), or ``"unknown"``."""
    torch.mm(torch.ones(8, 8, device="cuda"), torch.ones(8, 8, device="cuda"))
    try:
        with open("/proc/self/maps") as f:
            names = {line.split()[-1].rsplit("/", 1)[-1] for line in f if "libcublas." in line}
    except OSError:
        return "unknown"
    return ", ".join(sorted(names)) or "unknown"


def _kernels(fn) -> list[str]:
    """The CUDA kernels one call of ``fn`` launches (names, in order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type.name == "CUDA"]


def probe_case(case: dict, rows: list[int], time_rows: list[int], reps: int, flush,
               read_gbs: float, seed: int) -> dict:
    flags = torch.backends.cuda.matmul
    weight, a, addend = _inputs(case, max(rows), seed)
    saved = (flags.allow_bf16_reduced_precision_reduction,
             flags.allow_bf16_reduced_precision_reduction_split_k)
    saved_library = torch.backends.cuda.preferred_blas_library()
    result = {"shape": list(case["shape"]), "fp32_out": case["fp32_out"], "settings": {}}
    try:
        for setting, (library, value) in SETTINGS.items():
            torch.backends.cuda.preferred_blas_library(saved_library if library == "default" else library)
            flags.allow_bf16_reduced_precision_reduction = value
            want = _call(case, weight, a, addend)
            torch.cuda.synchronize()
            diff = {}
            for m in rows:
                got = _call(case, weight, a[:m], None if addend is None else addend[:m])
                bad = differing_rows(got, want[:m])
                if bad:
                    diff[m] = bad
            timed = {}
            for m in [t for t in time_rows if min(rows) <= t <= max(rows)]:
                am, cm = a[:m].contiguous(), None if addend is None else addend[:m].contiguous()
                fn = lambda: _call(case, weight, am, cm)  # noqa: E731
                n, k = case["shape"]
                nbytes = n * k * 2 + m * k * 2 + m * n * (4 if case["fp32_out"] else 2) * (2 if cm is not None else 1)
                us = statistics.median(device_time_us(fn, reps=reps, flush=flush))
                timed[m] = {"us": us, "limit_us": nbytes / (read_gbs * 1e9) * 1e6,
                            "kernels": _kernels(fn)}
            result["settings"][setting] = {"rows_checked": len(rows), "differing": diff,
                                           "timed": timed}
    finally:
        flags.allow_bf16_reduced_precision_reduction = saved
        torch.backends.cuda.preferred_blas_library(saved_library)
    return result


LABELS = {"splitk": "on (stock)", "lt_splitk": "on (cuBLASLt)", "no_splitk": "off (cuBLASLt)"}


def render(result: dict) -> str:
    """Markdown: per GEMM and setting, the row counts whose rows differ from the largest
    call's, and the timed row counts (us, fraction of the byte limit)."""
    lines = [f"Device {result['device']}, torch {result['torch']}, cuBLAS {result.get('cublas', '?')}"
             f"{tree_note(result)}; read bandwidth {result['read_gbs']:.0f} GB/s (this run).", "",
             "| GEMM | weight [N, K] | split-K | row counts checked | row counts with rows "
             "unlike the largest call's | timed: rows us (frac) |", "|---|---|---|---|---|---|"]
    for name, case in result["cases"].items():
        for setting, s in case["settings"].items():
            diff = s["differing"]
            shown = ", ".join(f"{m} ({n})" for m, n in list(diff.items())[:8])
            more = f" and {len(diff) - 8} more" if len(diff) > 8 else ""
            timed = "; ".join(f"{m}: {t['us']:.1f} ({t['limit_us'] / t['us']:.2f})"
                              for m, t in s["timed"].items())
            lines.append(f"| {name} | {case['shape'][0]} x {case['shape'][1]} | "
                         f"{LABELS.get(setting, setting)} | {s['rows_checked']} | "
                         f"{len(diff)}{': ' + shown + more if diff else ''} | {timed} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--render", help="print the markdown table of a result JSON and exit")
    ap.add_argument("--out", default="cublas_splitk_probe.json")
    ap.add_argument("--dep-rows", default="1..64")
    ap.add_argument("--wide-rows", default="65..1024", help="the rows a wide rank serves")
    ap.add_argument("--time-rows", default="1,8,64,65,256,512,1024")
    ap.add_argument("--ranks", type=int, default=8, help="the wide schedule's TP size")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--only", default="", help="comma-separated case names (dep.front, tp8.up, ...)")
    args = ap.parse_args(argv)
    if rendered(args, render):
        return
    from benchmarks import readbw
    from model.config import LatentMoEConfig

    t0 = time.time()
    result = {**run_header(), "cublas": cublas_library(), "read_gbs": readbw.read_bandwidth_gbs(), "cases": {}}
    flush_buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    flush_out = torch.zeros(readbw.CTAS, dtype=torch.int32, device="cuda")
    flush = lambda: readbw.read(flush_buf, flush_out)  # noqa: E731
    cases = gemm_cases(LatentMoEConfig.kimi_k3(), args.ranks)
    only = set(filter(None, args.only.split(",")))
    for i, (name, case) in enumerate(cases.items()):
        if only and name not in only:
            continue
        rows = parse_rows(args.dep_rows if name.startswith("dep.") else args.wide_rows)
        result["cases"][name] = probe_case(case, rows, parse_rows(args.time_rows), args.reps,
                                           flush, result["read_gbs"], seed=100 + i)
        result["wall_s"] = time.time() - t0
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print("\n".join(render({**result, "cases": {name: result["cases"][name]}}).splitlines()[-2:]),
              flush=True)
    print(render(result))


if __name__ == "__main__":
    main()
