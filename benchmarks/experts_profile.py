"""One engine configuration run eagerly a few times, for a profiler (``ncu``) to capture:

    PYTHONPATH=. ncu --clock-control none --launch-skip 4 --launch-count 4 \\
        python3 -m benchmarks.experts_profile --mode dep16 --size 64

Each call is 4 launches (routing lists, plan, FC1, FC2; 3 with the fused grid, the default
of a DEP16 rank); the first call compiles.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks import experts_table as table


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("dep16", "tp8"), default="dep16")
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--skew", type=float, default=0.0)
    ap.add_argument("--windows", type=int, default=None)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--tactic", default="",
                    help="engine tactic over the call's default, e.g. 'fused=0,warps=8,mtiles=2'")
    args = ap.parse_args(argv)
    from fast.experts import ExpertsEngine, prepare_experts
    from reference.mx import quantize_mxfp8

    w = table.random_weights()
    first, count, shard = (0, 56, (0, 1)) if args.mode == "dep16" else (0, 896, (0, 8))
    rows = args.size * 16 if args.mode == "dep16" else args.size
    engine = ExpertsEngine(prepare_experts(w, "cuda", experts=(first, count), shard=shard),
                           max_rows=rows)
    ids = table.routing(rows, 1000 + rows, args.skew).cuda()
    codes, scales = quantize_mxfp8((torch.randn(rows, table.L, device="cuda") * 2).bfloat16())
    out = torch.empty(rows * table.K, table.L, dtype=torch.bfloat16, device="cuda")
    tactic = engine.default_tactic(rows, args.windows, over=table.parse_tactic(args.tactic))
    for _ in range(args.calls):
        engine(codes, scales, ids, out=out, windows=args.windows, validate=False, tactic=tactic)
    torch.cuda.synchronize()
    engine.check()


if __name__ == "__main__":
    main()
