"""Rank 0's home stage of a virtual DEP layer (the combine fused with the RMSNorm, then the
up-projection) run eagerly a few times, for a profiler (``ncu``) to capture:

    PYTHONPATH=. ncu --clock-control none --profile-from-start off \\
        -k "regex:CombineKernel|SplitKGemmKernel" \\
        python3 -m benchmarks.dep_home_profile --tokens 1

A full layer call over ``--ranks`` virtual ranks fills every owner's partials first; the
profiled range (``cudaProfilerStart`` / ``Stop``) then holds ``--calls`` home stages, each
after the L2 flush of ``benchmarks.dep_table``. The dense GEMMs' backends are the layer's
default (``--dense-gemm auto``: the up-projection on fast.gemm at ``T <= 8``).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.dep_table import fast_stages
from benchmarks.experts_table import l2_flush


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--dense-gemm", default="auto", choices=("auto", "cublas", "fast"))
    args = ap.parse_args(argv)
    from fast.schedules.dep import DepLayer
    from verify import cases

    torch.manual_seed(0)
    w = cases.device_weights("kimi_k3")
    layer = DepLayer(w, ranks=args.ranks, max_tokens=args.tokens, dense_gemm=args.dense_gemm)
    xs = [torch.randn(args.tokens, w.config.hidden, device="cuda").bfloat16()
          for _ in range(args.ranks)]
    layer(xs)
    home = fast_stages(layer, xs[0], args.tokens)["home"]  # the stage dep_table times
    home()  # warm-up
    flush = l2_flush()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for _ in range(args.calls):
        flush()
        home()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    up = layer.dense.plan(args.tokens)["up"].backend
    print(f"home stage of rank 0: {args.calls} calls at T={args.tokens}, "
          f"{args.ranks} virtual ranks, up-projection on {up}")


if __name__ == "__main__":
    main()
