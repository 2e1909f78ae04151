"""GPU self-check of the fast memory-bound kernels (a script; pytest does not collect it).

For every kernel and batch (1, 2, 3, 7, 16, 64, 65, 100, 256, 1024) at the real widths:
run the kernel on poisoned outputs, compare on the CPU with the bit-exact reference
(``reference.finalize``, ``reference.mx``, ``reference.emulation`` for the kernels' own
exp/tanh/sigmoid/reduction tree) and report bitwise mismatches plus a ULP histogram
against the plain reference stage; then time each kernel beside its PyTorch op.

    PYTHONPATH=. python3 tests/gpu_selfcheck.py [--kernels mx,router,...] [--out DIR]
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import bench_stages as bs  # noqa: E402
from fast import backend  # noqa: E402
from reference import emulation as em  # noqa: E402


def ulp_hist(a, b):
    """Histogram of |ordinal difference| between two BF16/FP32 tensors: {0,1,2,>2}."""
    if a.dtype == torch.bfloat16:
        ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
        ia = torch.where(ia < 0, -32768 - ia, ia)
        ib = torch.where(ib < 0, -32768 - ib, ib)
    else:
        ia, ib = a.view(torch.int32).long(), b.view(torch.int32).long()
        ia = torch.where(ia < 0, -(2**31) - ia, ia)
        ib = torch.where(ib < 0, -(2**31) - ib, ib)
    d = (ia - ib).abs()
    return {"0": int((d == 0).sum()), "1": int((d == 1).sum()), "2": int((d == 2).sum()),
            ">2": int((d > 2).sum()), "max": int(d.max()) if d.numel() else 0}


def bit_mismatch(a, b):
    a, b = a.cpu().contiguous(), b.cpu().contiguous()
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    ua = a.view(torch.uint8) if a.element_size() == 1 else a.view({2: torch.int16, 4: torch.int32}[a.element_size()])
    ub = b.view(ua.dtype)
    bad = (ua != ub)
    n = int(bad.sum())
    if n == 0:
        return 0
    at = tuple(int(i) for i in torch.nonzero(bad)[0])
    return f"{n} (first at {at}: {a[at].item()!r} vs {b[at].item()!r})"


def check(kernel, t):
    """(bitwise mismatches vs the exact reference, ULP histogram vs the plain stage, note)."""
    from reference import finalize as rfin, mx as rmx, norm as rnorm, router as rrouter
    from reference import activation as ract

    inputs, fast_fn, _, _ = bs.make_case(kernel, t, seed=1)
    torch.cuda.synchronize()
    out = fast_fn()
    torch.cuda.synchronize()
    cpu = {k: v.cpu() for k, v in inputs.items()}
    if kernel in ("mx", "mx_swizzled"):
        codes, scales = rmx.quantize_mxfp8(cpu["x"])
        if kernel == "mx_swizzled":
            scales = rmx.swizzle_scales_128x4(scales)
        m1 = bit_mismatch(out[0], codes)
        m2 = bit_mismatch(out[1], scales)
        return (m1 if m1 else m2), None, f"codes {m1}, scales {m2}"
    if kernel == "router":
        w, ids = out
        ew, eids = em.route(cpu["logits"], cpu["bias"])
        rw, rids = rrouter.route(cpu["logits"], cpu["bias"])
        m = bit_mismatch(ids, eids) or bit_mismatch(w, ew)
        same = int((ids.cpu() == rids.to(torch.int32)).all(1).sum())
        hist = ulp_hist(w.cpu(), rw.float()) if torch.equal(ids.cpu(), rids.to(torch.int32)) else None
        return m, hist, f"tokens with the plain reference's ids: {same}/{t}"
    if kernel == "finalize":
        ref = rfin.finalize(cpu["rows"], cpu["weights"])
        return bit_mismatch(out, ref), ulp_hist(out.cpu(), ref), ""
    if kernel == "activation":
        emu = em.situ_and_mul(cpu["h"], beta=bs.BETA, linear_beta=bs.LINEAR_BETA)
        ref = ract.situ_and_mul(cpu["h"], beta=bs.BETA, linear_beta=bs.LINEAR_BETA)
        return bit_mismatch(out, emu), ulp_hist(out.cpu(), ref), "ULP vs reference.activation"
    if kernel == "norm":
        emu = em.rms_norm_tree(cpu["x"], cpu["weight"], bs.EPS)
        ref = rnorm.rms_norm(cpu["x"], cpu["weight"], bs.EPS)
        return bit_mismatch(out, emu), ulp_hist(out.cpu(), ref), "ULP vs reference.norm"
    raise KeyError(kernel)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", default=",".join(bs.KERNELS))
    ap.add_argument("--batches", default=",".join(map(str, bs.BATCHES)))
    ap.add_argument("--time-batches", default=",".join(map(str, bs.BENCH_BATCHES)))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    ok, why = backend.device_supported()
    if not ok:
        print(f"skipped: {why}")
        return 0
    kernels = args.kernels.split(",")
    print(f"device {torch.cuda.get_device_name()} arch {backend.gpu_arch()} torch {torch.__version__}")
    t0 = time.time()
    for k in kernels:  # compile every bucket first (reported apart from the checks)
        bs.make_case(k, 1)[1]()
    torch.cuda.synchronize()
    print(f"compile + first launch of {len(kernels)} kernels: {time.time() - t0:.1f} s")
    results, failures = {"checks": [], "timings": []}, 0
    print(f"{'kernel':12} {'T':>5} {'bitwise mismatches':>20}  ULP hist vs plain reference  note")
    for k in kernels:
        for t in map(int, args.batches.split(",")):
            try:
                m, hist, note = check(k, t)
            except Exception as error:  # reported, counted as a failure
                m, hist, note = f"ERROR {type(error).__name__}: {error}", None, ""
            failures += m != 0
            results["checks"].append({"kernel": k, "batch": t, "mismatch": m, "ulp": hist, "note": note})
            print(f"{k:12} {t:5d} {str(m):>20}  {hist}  {note}")
    copy = bs.copy_bandwidth_gbs()
    print(f"\ndevice-to-device copy: {copy:.0f} GB/s (read + write)")
    print(f"{'kernel':12} {'T':>5} {'bytes':>10} {'fast us':>8} {'GB/s':>7} {'%copy':>6} {'torch us':>9} {'speedup':>7} {'host us':>8}")
    for k in kernels:
        for t in map(int, args.time_batches.split(",")):
            _, fast_fn, torch_fn, nbytes = bs.make_case(k, t)
            fu, tu = bs.gpu_time_us(fast_fn), bs.gpu_time_us(torch_fn)
            hu = bs.host_us(fast_fn) if t == 1 else float("nan")
            gbs = nbytes / (fu * 1e-6) / 1e9
            results["timings"].append({"kernel": k, "batch": t, "bytes": nbytes, "fast_us": fu,
                                       "torch_us": tu, "fast_gbs": gbs, "copy_gbs": copy,
                                       "host_us": hu})
            print(f"{k:12} {t:5d} {nbytes:10d} {fu:8.2f} {gbs:7.0f} {100 * gbs / copy:5.1f}% {tu:9.2f} {tu / fu:7.2f} {hu:8.1f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_selfcheck.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(f"\n{'FAIL' if failures else 'PASS'}: {failures} failing checks")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
