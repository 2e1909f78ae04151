"""The dense part's four GEMMs at the real dimensions: the split-K kernel against cuBLAS, in
one run (GPU node).

    python3 -m benchmarks.dense_table --out dense.json
    python3 -m benchmarks.dense_table --render dense.json      # the markdown tables

GEMMs (Kimi-K3 latent MoE, ``reference.schedules.dep`` at ``T <= front_max``):

| GEMM | weight [N, K] | out | cuBLAS call (``fast.stock``, FP32 reduction) |
|---|---|---|---|
| front | [2S + L, H] = [15872, 7168] | BF16 | ``mm_bf16`` (``torch.mm``) |
| router | [E, H] = [896, 7168] | FP32 | ``mm_fp32_out`` (``torch.mm(..., out_dtype=float32)``) |
| shared_down | [H, S] = [7168, 6144] | BF16 | ``mm_bf16`` |
| up | [H, L] = [7168, 3584] | BF16, + shared | ``addmm_bf16`` (``torch.addmm``) |

Each contestant is captured in a CUDA graph and timed by CUDA events around one replay, L2
flushed before every replay by a 256 MiB streaming *read* (``benchmarks.readbw``), median of
``--reps`` (``benchmarks.experts_table.device_time_us``). A *write* flush (``fill_``) leaves
up to the L2's 50 MB of dirty lines, whose write-back then competes with the timed kernel's
reads: measured on the H200, the four cuBLAS GEMMs timed apart after a write flush summed to
135 us against 117 us in one graph after one flush, so per-GEMM times here use the read
flush (the one-graph figures are also given after a write flush).

* ``cublas``: the stock call above;
* every candidate tactic of the kernel that serves T (``fast.gemm.host.CANDIDATES``) and
  the default one (``DenseGemm.tactic(T)``); with ``--stage-k128`` each also in 128-k ring
  stages where its K splits hold whole ones (half the stage barriers; the 64-k form's bits,
  checked in the run);
* ``dense4``: the four GEMMs back to back in one graph: cuBLAS, the kernel's default
  tactics (programmatic dependent launch as ``DenseGemm`` chooses it, and without; and with
  the router in the front's launch, ``fast.gemm.GroupedGemm``, where it serves T), the
  kernel with this run's best tactic of each GEMM at this T; the same with the router on a second stream beside the
  front (the DEP schedule's side stream); cuBLAS and the default kernel after a write
  flush; with ``--invariant-stock`` the batch-invariant stock arrangement (the router on the
  kernel beside the front, the other three on cuBLASLt without split-K).

The byte limit of a GEMM is what it must move (weight, activations, output, addend) at
the read bandwidth measured in the same run (``benchmarks.readbw``: a 4 GiB streaming
read with the 16-byte non-allocating load); ``fraction = limit / time``. The JSON holds
every sample.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from benchmarks.provenance import run_header, tree_note
from benchmarks.experts_table import rendered

FLUSH_BYTES = 256 << 20
GEMMS = ("front", "router", "shared_down", "up")
DEFAULT_TOKENS = "1,2,3,4,6,8,12,16,24,32,40,48,56,64"


def _inputs(cfg, w, tokens: int, seed: int):
    """Per GEMM: (weight, activation [T, K], addend or None, out dtype)."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rows(n, scale=1.0):
        return (torch.randn(tokens, n, generator=g, device="cuda") * scale).to(torch.bfloat16)

    x = rows(cfg.hidden)
    return {
        "front": (w.front, x, None, torch.bfloat16),
        "router": (w.gate, x, None, torch.float32),
        "shared_down": (w.shared_down, rows(cfg.shared_intermediate, 0.5), None, torch.bfloat16),
        "up": (w.up, rows(cfg.latent), rows(cfg.hidden), torch.bfloat16),
    }


def _bytes(weight, a, addend, out_dtype) -> int:
    t, n = a.shape[0], weight.shape[0]
    out = t * n * (4 if out_dtype == torch.float32 else 2)
    return (weight.numel() * 2 + a.numel() * 2 + out
            + (0 if addend is None else addend.numel() * addend.element_size()))


def _cublas(name, weight, a, addend, out_dtype, split_k: bool = True):
    """The stock call of GEMM ``name`` (``fast.stock``); ``split_k=False``: cuBLASLt with
    split-K forbidden (BF16-output GEMMs only)."""
    from fast import stock

    if name == "router":
        return lambda: stock.mm_fp32_out(a, weight)
    if addend is not None:
        return lambda: stock.addmm_bf16(addend, a, weight, split_k=split_k)
    return lambda: stock.mm_bf16(a, weight, split_k=split_k)


def timed_tactics(shape: tuple[int, int], *, wgmma: bool = False, overlap: bool = False,
                  stage_k128: bool = False) -> list:
    """The tactics a run times for an ``[N, K]`` weight shape: ``fast.gemm.host.CANDIDATES``;
    with ``wgmma`` their warpgroup-MMA versions (4 or 8 warps), with ``overlap`` those with
    one stage's MMAs in flight, with ``stage_k128`` every one of them also in 128-k ring
    stages where its K splits hold whole ones (a tactic's own ring halved: the same bytes
    per ring)."""
    from fast.gemm.host import CANDIDATES

    base = CANDIDATES[shape]
    cands = list(base)
    if wgmma:
        cands += [dataclasses.replace(t, wgmma=True) for t in base if t.warps in (4, 8)]
    if overlap:
        cands += [dataclasses.replace(t, wgmma=True, overlap=True) for t in base
                  if t.warps in (4, 8)]
    if stage_k128:
        cands += [dataclasses.replace(t, stage_k=128, ring=t.ring and max(2, t.ring // 2))
                  for t in cands if t.stage_k == 64 and shape[1] % (t.splits * 128) == 0]
    return list(dict.fromkeys(cands))  # a candidate's own 128-k form once


def serves_and_fits(tactic, tokens: int) -> bool:
    """Whether ``tactic`` serves ``tokens`` and its ring fits at that many windows (a 128-k
    stage form can need more shared memory than its occupancy leaves at many windows)."""
    if not tactic.serves(tokens):
        return False
    try:
        tactic.kernel_params(tactic.chunks(tokens)[1])
    except ValueError:
        return False
    return True


def _best_tactic(medians: dict, candidates):
    """The candidate with the smallest median at this T."""
    timed = [t for t in candidates if t.label() in medians]
    return min(timed, key=lambda t: medians[t.label()])


def _dense4(engines, data, tactics, *, side: bool, grouped=None, invariant_stock=False):
    """The four GEMMs back to back (one graph when captured): the kernel (``engines``, with
    ``tactics`` per GEMM or the defaults) or cuBLAS (``engines=None``); ``side``: the router
    on a second stream beside the front (the DEP schedule), joined before the shared
    down-projection; ``grouped``: a ``fast.gemm.GroupedGemm`` of the front and the router,
    the two in one launch; ``invariant_stock``: the router on the kernel (``engines``), the
    other three on cuBLASLt without split-K (``DenseFront(gemm="invariant_stock")``)."""
    outs = {g: torch.empty(d[1].shape[0], d[0].shape[0], dtype=d[3], device="cuda")
            for g, d in data.items()}

    def one(g):
        weight, a, addend, out_dtype = data[g]
        if invariant_stock and g != "router":
            return _cublas(g, weight, a, addend, out_dtype, split_k=False)()
        if engines is None:
            return _cublas(g, weight, a, addend, out_dtype)()
        t = None if tactics is None else tactics[g]
        return engines[g](a, out_dtype=out_dtype, addend=addend, out=outs[g], tactic=t)

    def run():
        if grouped is not None:
            grouped(data["front"][1], out_dtypes=(data["front"][3], data["router"][3]),
                    outs=(outs["front"], outs["router"]))
        elif side:
            main = torch.cuda.current_stream()
            other = torch.cuda.Stream()
            other.wait_stream(main)
            with torch.cuda.stream(other):
                one("router")
            one("front")
            main.wait_stream(other)
        else:
            one("front")
            one("router")
        one("shared_down")
        one("up")

    return run


def render(result: dict) -> str:
    """Markdown: per T the four GEMMs in one graph (cuBLAS; the kernel's default tactics and
    this run's best tactic per GEMM; the router on a side stream; the write flush), each with
    its fraction of the byte limit; then per GEMM timed alone, cuBLAS against the best and the
    default tactic."""
    lines = [f"Device {result['device']}, torch {result['torch']}{tree_note(result)}; read bandwidth "
             f"{result['read_gbs']:.0f} GB/s (this run); "
             "fraction = byte limit / time; medians of graph replays after an L2 flush by a "
             "256 MiB read (the write flush: a 256 MiB write, whose dirty lines drain during "
             "the timed run).", "",
             "| T | limit us | cuBLAS us (frac) | kernel default us (frac) | no PDL us | "
             "kernel best us (frac) | side stream: cuBLAS / kernel us | router in the front's "
             "launch us (frac) | batch-invariant stock us (frac) | write flush: cuBLAS / "
             "kernel us | cuBLAS / kernel |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        lim, d = row["limit_us"], row.get("dense4")
        if not d:
            continue
        cell = lambda v: f"{v:.1f} ({lim / v:.2f})"  # noqa: E731
        lines.append(f"| {row['tokens']} | {lim:.1f} | {cell(d['cublas'])} | {cell(d['kernel'])} | "
                     f"{d['kernel_nopdl']:.1f} | {cell(d['kernel_best'])} | {d['cublas_side']:.1f} / {d['kernel_side']:.1f} | "
                     f"{cell(d['kernel_grouped']) if 'kernel_grouped' in d else '-'} | "
                     f"{cell(d['invariant_stock_side']) if 'invariant_stock_side' in d else '-'} | "
                     f"{d['cublas_write_flush']:.1f} / {d['kernel_write_flush']:.1f} | "
                     f"{d['cublas'] / d['kernel']:.2f}x |")
    lines += ["", "Each GEMM alone:", "",
              "| T | GEMM | limit us | cuBLAS us (frac) | best tactic | us (frac) | default | us (frac) |",
              "|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        for g in GEMMS:
            c = row["gemms"].get(g)
            if not c:
                continue
            med, lim = c["median_us"], c["limit_us"]
            tactics = {k: v for k, v in med.items() if k.startswith("r")}
            best = min(tactics, key=tactics.get)
            lines.append(f"| {row['tokens']} | {g} | {lim:.1f} | {med['cublas']:.1f} "
                         f"({lim / med['cublas']:.2f}) | {best} | {tactics[best]:.1f} "
                         f"({lim / tactics[best]:.2f}) | {c['default']} | {med['default']:.1f} "
                         f"({lim / med['default']:.2f}) |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--render", help="print the markdown tables of a result JSON and exit")
    ap.add_argument("--out", default="dense_table.json")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--tokens", default=DEFAULT_TOKENS)
    ap.add_argument("--gemms", default=",".join(GEMMS))
    ap.add_argument("--wgmma", action="store_true",
                    help="also time the wgmma version of every candidate with 4 or 8 warps "
                         "(sm_90a; labels end in ',wgmma'; not used for the best-tactic rows)")
    ap.add_argument("--overlap", action="store_true",
                    help="with --wgmma: also time each wgmma version with one stage's MMAs in "
                         "flight (Tactic.overlap; labels end in ',wgmma,overlap') and check it "
                         "gives the wgmma version's bits")
    ap.add_argument("--stage-k128", action="store_true",
                    help="also time every timed tactic in 128-k ring stages where its K splits "
                         "hold whole 128-k stages (labels carry ',stage_k128'; the best-tactic "
                         "rows may pick them) and check each gives its 64-k form's bits")
    ap.add_argument("--invariant-stock", action="store_true",
                    help="also time the four in one graph as DenseFront(gemm='invariant_stock') "
                         "runs them: the router on the kernel on the side stream, the other "
                         "three on cuBLASLt without split-K (dense4 'invariant_stock_side')")
    args = ap.parse_args(argv)
    if rendered(args, render):
        return
    if args.overlap and not args.wgmma:
        ap.error("--overlap times the wgmma versions' overlap form: pass --wgmma too")

    from benchmarks.experts_table import device_time_us
    from benchmarks.readbw import read_bandwidth_gbs
    from fast.gemm import DenseGemm
    from model.config import LatentMoEConfig
    from verify import cases

    cfg = LatentMoEConfig.kimi_k3()
    from benchmarks import readbw

    flush_buf = torch.randint(0, 255, (FLUSH_BYTES,), dtype=torch.uint8, device="cuda")
    flush_out = torch.zeros(readbw.CTAS, dtype=torch.int32, device="cuda")
    flush = lambda: readbw.read(flush_buf, flush_out)  # noqa: E731
    write_flush = lambda: flush_buf.fill_(1)  # noqa: E731
    result = {**run_header(), "rows": []}
    t0 = time.time()
    result["read_gbs"] = read_bandwidth_gbs()
    print(f"read {result['read_gbs']:.0f} GB/s", flush=True)
    w = cases.dense_weights("kimi_k3", "cuda")
    gemms = [g for g in args.gemms.split(",") if g]
    probe = _inputs(cfg, w, 1, 0)
    def timed(shape):
        return timed_tactics(shape, wgmma=args.wgmma, overlap=args.overlap,
                             stage_k128=args.stage_k128)

    engines = {g: DenseGemm(probe[g][0], tactics=timed(tuple(probe[g][0].shape))) for g in gemms}
    group = None  # the front and the router in one launch (fast.gemm.GroupedGemm)
    if {"front", "router"} <= set(gemms):
        from fast.gemm import GroupedGemm

        group = GroupedGemm(engines["front"], engines["router"])
    for tokens in [int(v) for v in args.tokens.split(",")]:
        data = _inputs(cfg, w, tokens, 1000 + tokens)
        row = {"tokens": tokens, "gemms": {}}
        for g in gemms:
            weight, a, addend, out_dtype = data[g]
            eng = engines[g]
            nbytes = _bytes(weight, a, addend, out_dtype)
            limit = nbytes / (result["read_gbs"] * 1e9) * 1e6
            out = torch.empty(tokens, weight.shape[0], dtype=out_dtype, device="cuda")
            case = {"bytes": nbytes, "limit_us": limit, "default": eng.tactic(tokens).label(),
                    "times": {}}
            case["times"]["cublas"] = device_time_us(_cublas(g, weight, a, addend, out_dtype),
                                                     reps=args.reps, flush=flush)
            for t in [None] + [c for c in timed(tuple(weight.shape)) if serves_and_fits(c, tokens)]:
                name = "default" if t is None else t.label()
                case["times"][name] = device_time_us(
                    lambda: eng(a, out_dtype=out_dtype, addend=addend, out=out, tactic=t),
                    reps=args.reps, flush=flush)
            bits = lambda o: o.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32)  # noqa: E731
            if args.wgmma:  # does warpgroup MMA give mma.sync's bits at the same splits?
                case["wgmma_same_bits"], case["overlap_same_bits"] = {}, {}
                for t in timed(tuple(weight.shape)):
                    if t.wgmma and serves_and_fits(t, tokens):  # overlap: against the plain wgmma form
                        plain = dataclasses.replace(t, overlap=False) if t.overlap else \
                            dataclasses.replace(t, wgmma=False)
                        got = [eng(a, out_dtype=out_dtype, addend=addend, tactic=v).clone()
                               for v in (t, plain)]
                        key = "overlap_same_bits" if t.overlap else "wgmma_same_bits"
                        case[key][t.label()] = bool(torch.equal(bits(got[0]), bits(got[1])))
            if args.stage_k128:  # 128-k stages: the 64-k form's bits (one summation order)
                case["stage_k128_same_bits"] = {}
                for t in timed(tuple(weight.shape)):
                    if t.stage_k == 128 and serves_and_fits(t, tokens):
                        got = [eng(a, out_dtype=out_dtype, addend=addend, tactic=v).clone()
                               for v in (t, dataclasses.replace(t, stage_k=64))]
                        case["stage_k128_same_bits"][t.label()] = bool(
                            torch.equal(bits(got[0]), bits(got[1])))
            case["median_us"] = {k: statistics.median(v) for k, v in case["times"].items()}
            med = case["median_us"]
            tact = {k: v for k, v in med.items() if k.startswith("r") and ",wgmma" not in k}
            best = min(tact, key=tact.get)
            wg = {k: v for k, v in med.items() if ",wgmma" in k and ",overlap" not in k}
            ov = {k: v for k, v in med.items() if ",overlap" in k}
            same, ov_same = case.get("wgmma_same_bits", {}), case.get("overlap_same_bits", {})
            wg_best = (f" | wgmma best {min(wg, key=wg.get)} {min(wg.values()):6.1f} "
                       f"({limit / min(wg.values()):.2f}), bits = mma.sync: "
                       f"{sum(same.values())}/{len(same)}") if wg else ""
            wg_best += (f" | overlap best {min(ov, key=ov.get)} {min(ov.values()):6.1f} "
                        f"({limit / min(ov.values()):.2f}), bits = wgmma: "
                        f"{sum(ov_same.values())}/{len(ov_same)}") if ov else ""
            k128 = {k: v for k, v in med.items() if ",stage_k128" in k}
            k128_same = case.get("stage_k128_same_bits", {})
            wg_best += (f" | 128-k best {min(k128, key=k128.get)} {min(k128.values()):6.1f} "
                        f"({limit / min(k128.values()):.2f}), bits = 64-k: "
                        f"{sum(k128_same.values())}/{len(k128_same)}") if k128 else ""
            print(f"T {tokens:3d} {g:11s} limit {limit:6.1f}us | cublas {med['cublas']:6.1f} "
                  f"({limit / med['cublas']:.2f}) | default {case['default']} {med['default']:6.1f} "
                  f"({limit / med['default']:.2f}) | best {best} {tact[best]:6.1f} "
                  f"({limit / tact[best]:.2f}){wg_best}", flush=True)
            row["gemms"][g] = case
        if len(gemms) == len(GEMMS):
            best = {g: _best_tactic(row["gemms"][g]["median_us"],
                                    [t for t in timed(tuple(data[g][0].shape)) if not t.wgmma])
                    for g in GEMMS}
            row["best"] = {g: t.label() for g, t in best.items()}
            default4 = _dense4(engines, data, None, side=False)

            def nopdl():
                for e in engines.values():
                    e.pdl = False
                try:
                    default4()
                finally:
                    for e in engines.values():
                        e.pdl = None

            runs = {
                "kernel": default4,
                "kernel_nopdl": nopdl,
                "kernel_best": _dense4(engines, data, best, side=False),
                "cublas": _dense4(None, data, None, side=False),
                "kernel_side": _dense4(engines, data, None, side=True),
                "cublas_side": _dense4(None, data, None, side=True),
            }
            if group is not None and group.serves(tokens):
                runs["kernel_grouped"] = _dense4(engines, data, None, side=False, grouped=group)
            if args.invariant_stock:
                runs["invariant_stock_side"] = _dense4(engines, data, None, side=True,
                                                       invariant_stock=True)
            row["dense4_times"] = {k: device_time_us(f, reps=args.reps, flush=flush)
                                   for k, f in runs.items()}
            for k in ("kernel", "cublas"):  # the write flush: its dirty lines drain in the run
                row["dense4_times"][k + "_write_flush"] = device_time_us(
                    runs[k], reps=args.reps, flush=write_flush)
            row["dense4"] = {k: statistics.median(v) for k, v in row["dense4_times"].items()}
        meds = [row["gemms"][g]["median_us"] for g in gemms]
        row["limit_us"] = sum(row["gemms"][g]["limit_us"] for g in gemms)
        row["sum"] = {
            "cublas": sum(m["cublas"] for m in meds),
            "default": sum(m["default"] for m in meds),
            "best": sum(min(v for k, v in m.items() if k.startswith("r")) for m in meds),
        }
        s, lim = row["sum"], row["limit_us"]
        print(f"T {tokens:3d} sum: limit {lim:6.1f} | cublas {s['cublas']:6.1f} ({lim / s['cublas']:.2f}) "
              f"| default {s['default']:6.1f} ({lim / s['default']:.2f}) | best {s['best']:6.1f} "
              f"({lim / s['best']:.2f})", flush=True)
        if "dense4" in row:
            print(f"T {tokens:3d} dense4: " + ", ".join(f"{k} {v:.1f} ({lim / v:.2f})"
                                                       for k, v in row["dense4"].items()), flush=True)
        result["rows"].append(row)
        result["wall_s"] = time.time() - t0
        with open(args.out, "w") as f:  # after every T: a run cut short keeps its rows
            json.dump(result, f, indent=1)
    print(render(result))


if __name__ == "__main__":
    main()
