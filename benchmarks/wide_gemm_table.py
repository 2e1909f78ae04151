"""The wide (S2) rank's four dense GEMMs at 65..1024 rows: cuBLAS against ``fast.gemm`` in
the batch-invariant mode's forms, each GEMM alone, in one run (GPU node, sm_90a).

    python3 -m benchmarks.wide_gemm_table --out wide-gemms.json
    python3 -m benchmarks.wide_gemm_table --render wide-gemms.json   # the markdown table

GEMMs of one TP rank of ``--ranks`` (``fast.schedules.wide_gemms``: front FP32 out, shared
gate/up and shared down BF16, up BF16 with a BF16 addend), each at its one K split
(``wide_gemms.gemm_splits``), random BF16 weights and inputs. Contestants at each row count:

* ``cublas``: what the default mode runs (``torch.mm`` / ``torch.addmm`` with FP32
  reduction, ``fast.stock``);
* ``fast.gemm`` on the warpgroup MMA in each form (``form_table``: the ``DenseGemm(forms=...)``
  entry, its tactic ``fast.gemm.host.default_tactic``'s at that row count): 64-row token chunks (``cw8``) or
  128-row ones (``cw16``, ``Tactic.chunk_windows``), cross-CTA or serial splits, with and
  without the MMAs in flight; with ``--stage-k 64,128`` each also with 128-k ring stages
  (``Tactic.stage_k``: half the stages and barriers per K; one CTA per multiprocessor
  where two do not fit a ring of 3). Every form's output is compared bit for bit with the plain
  ``cw8`` form's (the same ``splits``, so the same bits are owed): a timing never comes
  from a form that computes something else;
* with ``--tiled 128x4,64x4,128x4s``: ``fast.gemm.TiledGemm`` (TMA-fed warpgroup MMA on
  128-row weight tiles, the same K split folded in the same order) at those token tiles and
  ring depths, one CTA per split (``cross``) or, with an ``s``, the splits in order inside
  each CTA, with a ``k`` one CTA per multiprocessor over ranges of (tile, split) units
  (``TiledGemm(persistent=True)``), with a ``p`` a producer warp of its own
  (``TiledGemm(producer=True)``), and with ``c<w><t>`` (the splits in order with a producer
  warp) in clusters of ``w`` weight tiles by ``t`` token tiles sharing their operand
  stages by TMA multicast (``TiledGemm(cluster=(w, t))``); its output compared with the
  ``cw8`` form's in the same way.

``--forms cw8+cw16,overlap`` times only those ``fast.gemm`` forms, ``+``-separated (the
labels hold commas; ``cw8``, the bits' reference, always).

Each contestant is captured in a CUDA graph and timed by CUDA events around one replay, the
L2 flushed by a 256 MiB streaming read before each (``benchmarks.dense_table``'s method),
median of ``--reps``. The byte limit: weight, input, output and addend bytes at the read
bandwidth measured in the same run (``benchmarks.readbw``).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics

import torch

from benchmarks.experts_table import rendered
from benchmarks.provenance import run_header, tree_note

DEFAULT_ROWS = "65,128,256,512,1024"
#: (label, chunk_windows, serial, overlap) of the timed fast.gemm forms
FORMS = (("cw8", 8, False, False), ("cw8,overlap", 8, False, True),
         ("cw8,serial,overlap", 8, True, True), ("cw16", 16, False, False),
         ("cw16,overlap", 16, False, True), ("cw16,serial,overlap", 16, True, True))


def _inputs(shapes: dict, rows: int, seed: int) -> dict:
    """Per GEMM: (weight [N, K], input [T, K], addend or None, out dtype)."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    out = {}
    for name, (n, k) in shapes.items():
        w = rand(n, k, scale=k ** -0.5)
        addend = rand(rows, n) if name == "up" else None
        out[name] = (w, rand(rows, k), addend,
                     torch.float32 if name == "front" else torch.bfloat16)
    return out


def _bytes(weight, a, addend, out_dtype) -> int:
    t, n = a.shape[0], weight.shape[0]
    return (weight.numel() * 2 + a.numel() * 2 + t * n * (4 if out_dtype == torch.float32 else 2)
            + (0 if addend is None else addend.numel() * 2))


def _cublas(weight, a, addend, out_dtype):
    from fast import stock

    if out_dtype == torch.float32:
        return lambda: stock.mm_fp32_out(a, weight)
    if addend is not None:
        return lambda: stock.addmm_bf16(addend, a, weight)
    return lambda: stock.mm_bf16(a, weight)


def form_table(result: dict) -> dict[str, dict]:
    """``{label: form}`` of the fast.gemm forms a result timed, in table order (``FORMS``,
    then their versions at the run's other stage widths): each form as
    ``DenseGemm(forms=...)`` takes it (``fast.gemm.host.FORM_KEYS``)."""
    return {(label if stage_k == 64 else f"{label},k{stage_k}"):
            {"chunk_windows": cw, "serial": serial, "overlap": overlap, "stage_k": stage_k}
            for stage_k in result.get("stage_ks", [64]) for label, cw, serial, overlap in FORMS}


def form_labels(result: dict) -> list[str]:
    """The labels of :func:`form_table`, in table order."""
    return list(form_table(result))


def best_forms(result: dict) -> dict:
    """``{gemm: {rows_from: form}}`` for ``WideLayer(invariant_forms=...)``: per GEMM the
    fastest form of each timed row count (a tiled variant as its ``{"tiled": {...}}``
    form, :func:`tiled_table`) that gave the plain form's bits, from the row count after
    the previous timed one (the first from 65: the wide layer's smallest call)."""
    rows = sorted(result["rows"], key=lambda r: r["rows"])
    forms = {**form_table(result), **tiled_table(result)}
    out: dict = {}
    for i, row in enumerate(rows):
        start = 65 if i == 0 else rows[i - 1]["rows"] + 1
        for gemm, case in row["gemms"].items():
            med = {k: v for k, v in case["median_us"].items()
                   if k in case["tactics"] and k in forms and case["same_bits"].get(k)}
            best = min(med, key=med.get)
            out.setdefault(gemm, {})[start] = forms[best]
    return out


def tiled_table(result: dict) -> dict[str, dict]:
    """``{label: {"tiled": options}}``: each ``TiledGemm`` variant of a result (its
    ``"tiled"``: ``[tile_tokens, stages, cross, producer, persistent]`` lists, results
    before the persistent form without the last) as ``DenseGemm(forms=...)`` takes it
    (``fast.gemm.tiled_layout.TILED_KEYS``), labelled ``tiled<tokens>x<stages>``, then ``s``
    for the splits in order or ``k`` for the persistent grid, and ``p`` for a producer
    warp, in table order."""
    out = {}
    for variant in result.get("tiled", []):
        tokens, stages, cross, producer, persistent, cluster = _variant(variant)
        label = (f"tiled{tokens}x{stages}" + ("k" if persistent else ("" if cross else "s"))
                 + ("p" if producer else "")
                 + (f"c{cluster[0]}{cluster[1]}" if cluster != (1, 1) else ""))
        out[label] = {"tiled": {"tile_tokens": tokens, "stages": stages, "cross": bool(cross),
                                "producer": bool(producer)}}
        if persistent:
            out[label]["tiled"]["persistent"] = True
        if cluster != (1, 1):
            out[label]["tiled"]["cluster"] = list(cluster)
    return out


def _variant(variant) -> tuple[int, int, bool, bool, bool, tuple[int, int]]:
    """(tile_tokens, stages, cross, producer, persistent, cluster) of a result's tiled
    variant (results before the persistent form lack the last two, before the cluster
    the last)."""
    tokens, stages, cross, producer, *rest = variant
    persistent = bool(rest and rest[0])
    cluster = tuple(rest[1]) if len(rest) > 1 else (1, 1)
    return tokens, stages, bool(cross), bool(producer), persistent, cluster


def parse_tiled(spec: str) -> list:
    """``--tiled``'s variant ``<tokens>x<stages>[s|k][p][c<w><t>]`` as a result's
    ``[tile_tokens, stages, cross, producer, persistent, [w, t]]`` (no ``s``/``k``: one CTA
    per split; ``s``: the splits in order; ``k``: the persistent grid; ``p``: a producer
    warp; ``c<w><t>``: clusters of ``w`` weight tiles by ``t`` token tiles). ValueError
    when it is not of that form or ``fast.gemm.tiled_layout.check_tiled_options`` refuses
    it."""
    from fast.gemm.tiled_layout import TILED_KEYS, check_tiled_options

    m = re.fullmatch(r"(\d+)x(\d+)([sk]?)(p?)(?:c(\d)(\d))?", spec)
    if m is None:
        raise ValueError(f"{spec!r} is not <tokens>x<stages>[s|k][p][c<w><t>]")
    tokens, stages, grid, producer, cw, ct = m.groups()
    variant = [int(tokens), int(stages), grid == "", producer == "p", grid == "k",
               [int(cw), int(ct)] if cw else [1, 1]]
    check_tiled_options("--tiled", dict(zip(TILED_KEYS, variant[:5] + [False, variant[5]])))
    return variant


def tiled_labels(result: dict) -> list[str]:
    """The labels of :func:`tiled_table`, in table order."""
    return list(tiled_table(result))


def render(result: dict) -> str:
    """Markdown: per row count and GEMM, the byte limit, cuBLAS and every form and tiled
    variant (us and the fraction of the limit), the fastest against cuBLAS, and how many of
    them gave the plain form's bits."""
    forms = form_labels(result) + tiled_labels(result)
    lines = [f"Device {result['device']}, torch {result['torch']}{tree_note(result)}; "
             f"{result['ranks']} TP ranks, one rank's GEMMs, K splits {result['splits']}; "
             f"read bandwidth {result['read_gbs']:.0f} GB/s (this run); fraction = byte limit "
             "/ time; medians of graph replays after an L2 flush by a 256 MiB read.", "",
             "| rows | GEMM | limit us | cuBLAS us (frac) | " + " | ".join(forms)
             + " | best / cuBLAS | bits |",
             "|---|---|---|---|" + "---|" * len(forms) + "---|---|"]
    for row in result["rows"]:
        for g, c in row["gemms"].items():
            med, lim = c["median_us"], c["limit_us"]
            cells = [f"{med[f]:.1f} ({lim / med[f]:.2f})" if f in med else "-" for f in forms]
            best = min((f for f in forms if f in med), key=med.get)
            same = c["same_bits"]
            lines.append(f"| {row['rows']} | {g} | {lim:.1f} | {med['cublas']:.1f} "
                         f"({lim / med['cublas']:.2f}) | " + " | ".join(cells)
                         + f" | {best} {med[best] / med['cublas']:.2f}x | "
                         f"{sum(same.values())}/{len(same)} |")
    tiled = tiled_labels(result)
    lines += ["", "| rows | four GEMMs: cuBLAS us | plain cw8 us | best form per GEMM us |"
              + (" best tiled variant per GEMM us |" if tiled else ""),
              "|---|---|---|---|" + ("---|" if tiled else "")]
    for row in result["rows"]:
        meds = [c["median_us"] for c in row["gemms"].values()]
        best = sum(min(m[f] for f in form_labels(result) if f in m) for m in meds)
        cell = (f" {sum(min(m[f] for f in tiled if f in m) for m in meds):.1f} |"
                if tiled else "")
        lines.append(f"| {row['rows']} | {sum(m['cublas'] for m in meds):.1f} | "
                     f"{sum(m['cw8'] for m in meds):.1f} | {best:.1f} |" + cell)
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--render", help="print the markdown tables of a result JSON and exit")
    ap.add_argument("--out", default="wide_gemm_table.json")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--rows", default=DEFAULT_ROWS)
    ap.add_argument("--stage-k", default="64",
                    help="ring stage widths to time each form at (64, 128; e.g. 64,128)")
    ap.add_argument("--tiled", default="",
                    help="fast.gemm.TiledGemm variants to time beside the forms, as "
                         "<tile tokens>x<stages>[s|k][p][c<w><t>] (s: serial splits, k: the "
                         "persistent grid, p: a producer warp, c: clusters of w weight tiles "
                         "by t token tiles; e.g. 128x4,64x4p,128x4s,64x4spc12; sm_90a)")
    ap.add_argument("--forms", default="all",
                    help="the fast.gemm forms to time, +-separated labels of the table (e.g. "
                         "cw16+cw16,serial,overlap; cw8 always), or all")
    args = ap.parse_args(argv)
    if rendered(args, render):
        return

    from benchmarks import readbw
    from benchmarks.experts_table import device_time_us, l2_flush
    from fast.gemm import DenseGemm
    from fast.gemm.host import default_tactic
    from fast.gemm.tiled import TiledGemm
    from fast.schedules.wide_gemms import gemm_shapes, gemm_splits
    from model.config import LatentMoEConfig

    cfg = LatentMoEConfig.kimi_k3()
    rows_list = [int(v) for v in args.rows.split(",")]
    stage_ks = [int(v) for v in args.stage_k.split(",")]
    if not set(stage_ks) <= {64, 128} or 64 not in stage_ks:
        ap.error(f"--stage-k takes 64 and optionally 128, got {args.stage_k!r}")
    try:
        tiled = [parse_tiled(spec) for spec in args.tiled.split(",") if spec]
    except ValueError as e:
        ap.error(f"--tiled takes <tokens>x<stages>[s|k][p][c<w><t>] variants, e.g. "
                 f"128x4,96x4s,64x4kp,64x4spc12; got {args.tiled!r}: {e}")
    unknown = (set() if args.forms == "all"
               else set(args.forms.split("+")) - set(form_table({"stage_ks": stage_ks})))
    if unknown:
        ap.error(f"--forms: no such form {sorted(unknown)}; the labels are "
                 f"{list(form_table({'stage_ks': stage_ks}))} (+-separated), or all")
    shapes = gemm_shapes(cfg, args.ranks)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = gemm_splits(cfg, args.ranks, sms)
    flush = l2_flush()
    result = {**run_header(), "ranks": args.ranks, "splits": splits, "stage_ks": stage_ks,
              "tiled": tiled, "rows": []}
    result["read_gbs"] = readbw.read_bandwidth_gbs()
    print(f"read {result['read_gbs']:.0f} GB/s", flush=True)
    top = max(rows_list)
    for rows in rows_list:
        data = _inputs(shapes, rows, 1000 + rows)
        row = {"rows": rows, "gemms": {}}
        for g, (weight, a, addend, out_dtype) in data.items():
            eng = DenseGemm(weight, max_tokens=top, splits=splits[g], wgmma=True,
                            chunk_windows=16)
            nbytes = _bytes(weight, a, addend, out_dtype)
            case = {"bytes": nbytes, "limit_us": nbytes / (result["read_gbs"] * 1e9) * 1e6,
                    "tactics": {}, "times": {}, "same_bits": {}}
            case["times"]["cublas"] = device_time_us(_cublas(weight, a, addend, out_dtype),
                                                     reps=args.reps, flush=flush)
            outs = {}
            timed = [(label, default_tactic(eng.rows, eng.k, rows, sms, splits[g], True,
                                            forms={1: form}))
                     for label, form in form_table(result).items()
                     if eng.k % (splits[g] * form["stage_k"]) == 0  # whole stages per split
                     and (args.forms == "all" or label in {"cw8", *args.forms.split("+")})]
            for label, t in timed:
                case["tactics"][label] = t.label()
                out = torch.empty(rows, weight.shape[0], dtype=out_dtype, device="cuda")
                case["times"][label] = device_time_us(
                    lambda: eng(a, out_dtype=out_dtype, addend=addend, out=out, tactic=t),
                    reps=args.reps, flush=flush)
                outs[label] = eng(a, out_dtype=out_dtype, addend=addend, tactic=t).clone()
            for variant, label in zip(tiled, tiled_labels(result)):
                tokens, stages, cross, producer, persistent, cluster = _variant(variant)
                tg = TiledGemm(weight, splits=splits[g], max_tokens=top, tile_tokens=tokens,
                               stages=stages, cross=cross, producer=producer,
                               persistent=persistent, cluster=cluster)
                case["tactics"][label] = tg.label()
                out = torch.empty(rows, weight.shape[0], dtype=out_dtype, device="cuda")
                case["times"][label] = device_time_us(
                    lambda: tg(a, out_dtype=out_dtype, addend=addend, out=out),
                    reps=args.reps, flush=flush)
                outs[label] = tg(a, out_dtype=out_dtype, addend=addend).clone()
                timed.append((label, None))
            ref = outs["cw8"].view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32)
            for label, o in outs.items():
                got = o.view(ref.dtype)
                case["same_bits"][label] = bool(torch.equal(got, ref))
            case["median_us"] = {k: statistics.median(v) for k, v in case["times"].items()}
            med = case["median_us"]
            print(f"rows {rows:4d} {g:14s} limit {case['limit_us']:6.1f} cublas "
                  f"{med['cublas']:6.1f} | " + " | ".join(
                      f"{lab} {case['tactics'][lab]} {med[lab]:6.1f}" for lab, _ in timed)
                  + f" | same bits {sum(case['same_bits'].values())}/{len(timed)}", flush=True)
            row["gemms"][g] = case
            del eng
        result["rows"].append(row)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(render(result), end="")


if __name__ == "__main__":
    main()
