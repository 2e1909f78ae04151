"""One DEP rank's layer time on one GPU, stage by stage, against the stock composition and
the byte limit (GPU node):

    PYTHONPATH=.gpu/peers:. python3 -m benchmarks.dep_table --out results.json
    PYTHONPATH=.gpu/peers:. python3 -m benchmarks.dep_table --dense-gemm fast --peers none

The layer is ``fast.schedules.dep.DepLayer`` over ``--ranks`` virtual ranks (default 16,
the real layer's 56 experts per rank). A full call fills every rank's buffers; then rank
0's own work is timed: its dense part (router and shared expert on the side stream), its
dispatch, its experts over the ``N*T`` rows it
received, its partial finalize, and its combine + RMSNorm + up-projection (reading the
other owners' partials from the full call). Each stage and the whole rank run are
captured in CUDA graphs, the L2 flushed before every replay (``benchmarks.experts_table``).

The layer is built as ``DepLayer``'s defaults build it (batch invariant: the router on
fast.gemm with one K split at every T, the front, shared down and up on cuBLASLt without
split-K) unless ``--no-batch-invariant`` (``DepLayer(batch_invariant=False)``) or
``--dense-gemm`` say otherwise. The dense GEMMs (router, front, shared down in "dense"; the
up-projection in "home") run on the backend ``--dense-gemm`` picks
(``DepLayer(dense_gemm=...)``): ``auto`` (default; batch invariant, ``invariant_stock``;
with ``--no-batch-invariant`` per GEMM and batch from
``fast.schedules.dense.DENSE_BACKENDS``), ``cublas`` (needs ``--no-batch-invariant``),
``fast`` (fast.gemm) for all four, or ``invariant_stock``. The JSON records the mode and,
per T, each GEMM's backend and fast.gemm tactic; the table states them.

The stock composition of the same rank, one graph: cuBLAS router (FP32 out), front and
shared GEMMs; PyTorch sigmoid top-k and SiTU; the dispatch as one copy of the token rows
into each owner's BF16 receive buffer; triton_kernels ``matmul_ogs`` experts over the
owner's received rows (best of ``num_warps`` 4 and 8, as vLLM runs MXFP4 MoE on Hopper);
the combine as an FP32 sum of the owners' partial rows; PyTorch RMSNorm; cuBLAS addmm.

The byte limit: the dense weights (router gate, front, shared down, up) plus the touched
local experts, at the read bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from benchmarks.provenance import run_header, tree_note
from benchmarks.experts_table import device_time_us, l2_flush, parse_tactic, rendered
from benchmarks.readbw import read_bandwidth_gbs
from fast.gemm.mma_kind import MMA_CHOICES

STAGES = ("dense", "dispatch", "experts", "partial", "home", "rank")
#: Timed apart as well, inside a stage above: the combine kernel alone (in "home").
PARTS = ("combine",)


def fast_stages(layer, x, tokens: int) -> dict:
    """Callables of rank 0's stages (buffers from a full call) and of its whole step."""
    dense = layer.dense_stage(0, x)

    def dense_side():  # the router and the shared expert beside the front, joined
        d = layer.dense_stage(0, x, order="side")
        torch.cuda.current_stream().wait_event(d.shared_ready)

    def rank():
        d = layer.dense_stage(0, x, order="side")
        layer.dispatch_stage(0, d, tokens)
        layer.experts_stage(0, tokens)
        layer.partial_stage(0, tokens)
        layer.home_stage(0, d, tokens)

    return {
        "dense": dense_side,
        "dispatch": lambda: layer.dispatch_stage(0, dense, tokens),
        "experts": lambda: layer.experts_stage(0, tokens),
        "partial": lambda: layer.partial_stage(0, tokens),
        "home": lambda: layer.home_stage(0, dense, tokens),
        "combine": lambda: layer.combine_stage(0, dense, tokens),
        "rank": rank,
    }


class StockRank:
    """Rank 0 of the stock composition (module docstring) with buffers for ``tokens``."""

    def __init__(self, layer, moe, tokens: int, outputs):
        self.layer, self.moe, self.tokens = layer, moe, tokens
        c, n, dev = layer.config, layer.ranks, layer.device
        rows = n * tokens
        # every owner receives every source's rows (the engine skips the pairs that are not
        # its own; triton_kernels does the same), with the sources' real routing
        ids = torch.cat([o.ids for o in outputs])
        weights = torch.cat([o.weights for o in outputs])
        self.recv_x = [torch.randn(rows, c.latent, device=dev).bfloat16() for _ in range(n)]
        self.recv_ids = [ids.clone() for _ in range(n)]
        self.recv_w = [weights.clone() for _ in range(n)]
        self.parts = [torch.randn(rows, c.latent, device=dev).bfloat16() for _ in range(n)]

    def __call__(self, x):
        from fast import stock

        lay, c, t = self.layer, self.layer.config, self.tokens
        s2 = 2 * c.shared_intermediate
        logits = stock.mm_fp32_out(x, lay.dense.gate)
        w, ids = stock.route(logits, lay.dense.bias, top_k=c.top_k, renormalize=c.renormalize,
                             scale=c.routed_scaling_factor)
        front = stock.mm_bf16(x, lay.dense.front_w)
        shared = stock.mm_bf16(stock.situ_and_mul(front[:, :s2], beta=c.situ_beta,
                                                  linear_beta=c.situ_linear_beta), lay.dense.shared_down)
        latent = front[:, s2:]
        for o in range(lay.ranks):
            self.recv_x[o][:t].copy_(latent)
            self.recv_ids[o][:t].copy_(ids)
            self.recv_w[o][:t].copy_(w)
        self.parts[0] = self.moe(self.recv_x[0], self.recv_ids[0], self.recv_w[0])
        routed = torch.stack([p[:t] for p in self.parts]).float().sum(0).bfloat16()
        normed = stock.rms_norm(routed, lay.dense.latent_norm, c.rms_eps)
        return stock.addmm_bf16(shared, normed, lay.dense.up)


def dense_plan(layer, tokens: int) -> dict[str, str]:
    """Each dense GEMM's backend at ``tokens``: ``"cublas"`` or ``"fast <tactic>"``."""
    return {name: "cublas" if choice.backend == "cublas" else f"fast {choice.tactic.label()}"
            for name, choice in layer.dense.plan(tokens).items()}


def _plan_cell(plan: dict[str, str]) -> str:
    from fast.schedules.dense import GEMMS

    return "/".join("cuBLAS" if plan[g] == "cublas" else "fast" for g in GEMMS)


def render(result: dict) -> str:
    """Markdown: per T, each stage's median (us), the rank's total and its fraction of the
    byte limit, the best stock composition and the speed-up; the dense GEMMs' backends
    (runs made before ``--dense-gemm`` ran every dense GEMM on cuBLAS)."""
    mode = result.get("dense_gemm")
    dense = (f"dense GEMMs: --dense-gemm {mode} (per T: router/front/shared down/up)"
             if mode else "dense GEMMs: cuBLAS (a run from before --dense-gemm)")
    if result.get("batch_invariant") and mode == "invariant_stock":
        dense += ("; batch invariant (--batch-invariant: the router on fast.gemm with one K "
                  f"split at every T, on {result.get('invariant_mma', 'mma.sync')}; the front, "
                  "shared down and up on cuBLASLt without split-K)")
    elif result.get("batch_invariant"):
        dense += ("; batch invariant (--batch-invariant: one K split per GEMM at every T, on "
                  f"{result.get('invariant_mma', 'mma.sync')}"
                  + (", MMAs in flight across stages" if result.get("invariant_overlap") else "")
                  + ")")
    if result.get("router_with_front"):
        dense += ("; the router in the front's launch (--router-with-front) at T = "
                  + ", ".join(str(t) for t in result["router_with_front"]))
    planned = all("dense_plan" in c for c in result["cases"]) and mode is not None
    # runs made before the combine was timed apart have no "combine" column
    parts = [p for p in PARTS if all(p in c["median_us"] for c in result["cases"])]
    columns = [*STAGES[:-2], *parts, STAGES[-2]]
    lines = [f"Device {result['device']}, torch {result['torch']}{tree_note(result)}; "
             f"{result['ranks']} virtual ranks; read bandwidth {result['read_gbs']:.0f} GB/s (this run); fraction = "
             f"byte limit / time; {dense}" + ("; combine: the combine kernel alone, part of "
                                              "home" if parts else "") + ".", "",
             "| T | limit us | " + " | ".join(columns) + " | rank us (frac) | "
             "stock us (frac) | speed-up |" + (" dense GEMMs |" if planned else ""),
             "|" + "---|" * (len(columns) + 5 + planned)]
    for c in result["cases"]:
        med, lim = c["median_us"], c["limit_us"]
        stock = min((v for k, v in med.items() if k.startswith("stock")), default=None)
        cells = " | ".join(f"{med[s]:.1f}" for s in columns)
        st = f"{stock:.1f} ({lim / stock:.2f})" if stock else "-"
        up = f"{stock / med['rank']:.2f}x" if stock else "-"
        plan = f" {_plan_cell(c['dense_plan'])} |" if planned else ""
        lines.append(f"| {c['tokens']} | {lim:.1f} | {cells} | {med['rank']:.1f} "
                     f"({lim / med['rank']:.2f}) | {st} | {up} |{plan}")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--render", help="print the markdown table of a result JSON and exit")
    ap.add_argument("--out", default="dep_table.json")
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--experts-tactic", default="",
                    help="the experts engine's tactic in the layer, e.g. 'wgmma=1,fused=1' "
                         "(ExpertsEngine tactic; default the engine's)")
    ap.add_argument("--peers", default="triton")
    ap.add_argument("--dense-gemm", default="auto",
                    choices=("auto", "cublas", "fast", "invariant_stock"),
                    help="the dense GEMMs' backend (DepLayer(dense_gemm=...)); default auto "
                         "(with --batch-invariant taken as invariant_stock)")
    ap.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                    help="DepLayer(batch_invariant=...); default the layer's (on): every "
                         "token's bits independent of its batch (--dense-gemm auto then runs "
                         "the router on fast.gemm with one K split at every T and the other "
                         "three on cuBLASLt without split-K; --dense-gemm fast all four on "
                         "fast.gemm); --no-batch-invariant: the backends per GEMM and batch")
    ap.add_argument("--invariant-mma", default="auto", choices=MMA_CHOICES,
                    help="the fast.gemm dense GEMMs' MMA (DepLayer(invariant_mma=...); default "
                         "auto: with --batch-invariant sm_90a's warpgroup MMA, wgmma)")
    ap.add_argument("--invariant-overlap", action=argparse.BooleanOptionalAction, default=None,
                    help="each dense GEMM's MMAs in flight across a stage "
                         "(DepLayer(invariant_overlap=...); the same bits); default: on the "
                         "warpgroup MMA")
    ap.add_argument("--router-with-front", action="store_true",
                    help="DepLayer(router_with_front=True): the router in the front's launch "
                         "(fast.gemm.GroupedGemm; needs --dense-gemm fast)")
    args = ap.parse_args(argv)
    if rendered(args, render):
        return

    from fast.schedules.dep import DepLayer
    from verify import cases

    torch.manual_seed(0)
    tokens_list = [int(t) for t in args.tokens.split(",")]
    flush = l2_flush()
    result = {**run_header(), "ranks": args.ranks, "cases": []}
    result["read_gbs"] = read_bandwidth_gbs()
    print(f"read {result['read_gbs']:.0f} GB/s", flush=True)
    w = cases.device_weights("kimi_k3")
    c = w.config
    named = {} if args.batch_invariant is None else {"batch_invariant": args.batch_invariant}
    layer = DepLayer(w, ranks=args.ranks, max_tokens=max(tokens_list), dense_gemm=args.dense_gemm,
                     experts_tactic=parse_tactic(args.experts_tactic),
                     invariant_mma=args.invariant_mma,
                     invariant_overlap=args.invariant_overlap,
                     router_with_front=args.router_with_front, **named)
    result["batch_invariant"] = layer.dense.batch_invariant  # the layer's default unless named
    result["dense_gemm"] = layer.dense.gemm
    # the batches whose router ran in the front's launch (empty: none)
    result["router_with_front"] = sorted(t for t in tokens_list if layer.dense.grouped(t))
    # the kind and overlap the layer resolved its arguments to
    result["invariant_mma"] = layer.dense.invariant_mma
    result["invariant_overlap"] = layer.dense.invariant_overlap
    result["experts_tactic"] = args.experts_tactic or "default"
    per = layer.per
    dense_bytes = layer.dense.dense_bytes
    expert_bytes = layer.engines[0].prepared.expert_bytes()
    peers = {}
    if "triton" in args.peers:
        from benchmarks.peers import triton_moe

        ok, why = triton_moe.available()
        if not ok:
            print("triton_kernels unavailable:", why)
            result["triton_error"] = why
        else:
            for nw in (4, 8):
                peers[f"stock_triton_w{nw}"] = triton_moe.TritonMoE(
                    w.w13, w.w13_scales, w.w2, w.w2_scales, first=0, count=per,
                    n_experts_total=c.experts, num_warps=nw, device="cuda")
    for tokens in tokens_list:
        xs = [(torch.randn(tokens, c.hidden, device="cuda")).bfloat16() for _ in range(args.ranks)]
        outputs = layer(xs)
        received = outputs[0].recv_ids  # rank 0 as an owner: its N*T receive rows
        local = received[(received >= 0) & (received < per)]
        touched = int(torch.unique(local).numel())
        nbytes = dense_bytes + touched * expert_bytes
        case = {"tokens": tokens, "touched": touched, "bytes": nbytes,
                "limit_us": nbytes / (result["read_gbs"] * 1e9) * 1e6,
                "dense_plan": dense_plan(layer, tokens), "times": {}}
        for name, fn in fast_stages(layer, xs[0], tokens).items():
            case["times"][name] = device_time_us(fn, reps=args.reps, flush=flush)
        for name, moe in peers.items():
            try:
                stock_rank = StockRank(layer, moe, tokens, outputs)
                case["times"][name] = device_time_us(lambda: stock_rank(xs[0]), reps=args.reps,
                                                     flush=flush)
            except Exception as error:  # reported in the JSON, not hidden
                print(f"{name} at T={tokens} failed: {error!r}", flush=True)
                case.setdefault("errors", {})[name] = repr(error)
        case["median_us"] = {k: statistics.median(v) for k, v in case["times"].items()}
        med = case["median_us"]
        print(f"T {tokens:3d} touched {touched:2d} limit {case['limit_us']:.1f}us | " +
              " | ".join(f"{k} {v:.1f}" for k, v in med.items()) +
              f" | dense GEMMs {case['dense_plan']}", flush=True)
        result["cases"].append(case)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(render(result), end="")


if __name__ == "__main__":
    main()
