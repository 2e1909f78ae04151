"""The DEP layer over real ranks (``fast.schedules.dep_peer.DepPeerLayer``), one process per
GPU, against the stock composition over NCCL and the byte limit (GPU node)::

    PYTHONPATH=.gpu/peers:. torchrun --standalone --nproc-per-node 2 \\
        -m benchmarks.dep_peer_table --out dep_peer.json

Per ``T``, every rank captures one layer call in a CUDA graph and replays it ``--reps``
times, its L2 flushed before each replay (``benchmarks.experts_table.l2_flush``); a replay's
device time includes the waits for the peers, so it is the layer's time as the slower rank
sees it. Medians per rank are reported.

The stock composition, one graph per rank: cuBLAS router (FP32 out), front and shared
GEMMs; PyTorch sigmoid top-k and SiTU; the dispatch as NCCL all-gathers of every rank's
BF16 latent rows, ids and weights (every owner receives every token, as the stock
single-GPU table does); triton_kernels ``matmul_ogs`` over the owner's local experts (best
of ``num_warps`` 4 and 8); the owners' partial rows back to their homes by an NCCL
all-to-all; an FP32 sum over owners; PyTorch RMSNorm; cuBLAS addmm.

Also measured, for the docs page's model: the peer write and read bandwidth of a 256 MiB
copy into / from the next rank's symmetric buffer.

The byte limit of a rank: the dense weights plus the touched local experts, at the read
bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from benchmarks.provenance import run_header, tree_note
from benchmarks.experts_table import capture_graph, l2_flush, replay_times_us, parse_tactic, \
    rendered
from benchmarks.readbw import read_bandwidth_gbs


def replay_times_us_in_step(replay, *, reps: int, flush) -> list[float]:
    """``benchmarks.experts_table.replay_times_us`` after a barrier: every rank starts its
    replays together."""
    import torch.distributed as dist

    torch.cuda.synchronize()
    dist.barrier()
    return replay_times_us(replay, reps=reps, flush=flush)


class StockPeerRank:
    """This rank of the stock composition (module docstring) for ``tokens`` tokens."""

    def __init__(self, dense, moe, ranks: int, tokens: int):
        c = dense.config
        self.dense, self.moe, self.ranks, self.tokens = dense, moe, ranks, tokens
        on = dict(device=dense.device)
        rows = ranks * tokens
        self.recv_x = torch.empty(rows, c.latent, dtype=torch.bfloat16, **on)
        self.recv_ids = torch.empty(rows, c.top_k, dtype=torch.int32, **on)
        self.recv_w = torch.empty(rows, c.top_k, dtype=torch.float32, **on)
        self.back = torch.empty(rows, c.latent, dtype=torch.bfloat16, **on)

    def __call__(self, x):
        import torch.distributed as dist

        from fast import stock

        d, c, t = self.dense, self.dense.config, self.tokens
        s2 = 2 * c.shared_intermediate
        logits = stock.mm_fp32_out(x, d.gate)
        w, ids = stock.route(logits, d.bias, top_k=c.top_k, renormalize=c.renormalize,
                             scale=c.routed_scaling_factor)
        front = stock.mm_bf16(x, d.front_w)
        shared = stock.mm_bf16(stock.situ_and_mul(front[:, :s2], beta=c.situ_beta,
                                                  linear_beta=c.situ_linear_beta), d.shared_down)
        dist.all_gather_into_tensor(self.recv_x, front[:, s2:].contiguous())
        dist.all_gather_into_tensor(self.recv_ids, ids.to(torch.int32).contiguous())
        dist.all_gather_into_tensor(self.recv_w, w.contiguous())
        parts = self.moe(self.recv_x, self.recv_ids, self.recv_w)  # [N*T, L], row s*T + t
        dist.all_to_all_single(self.back, parts)  # now row o*T + t: owner o's partial of mine
        routed = self.back.view(self.ranks, t, c.latent).float().sum(0).bfloat16()
        normed = stock.rms_norm(routed, d.latent_norm, c.rms_eps)
        return stock.addmm_bf16(shared, normed, d.up)


def peer_bandwidth_gbs(nbytes: int = 256 << 20, reps: int = 20) -> dict:
    """Write and read bandwidth (GB/s) of a ``nbytes`` copy into / from the next rank's
    symmetric buffer (``copy_`` through the peer mapping), medians of ``reps``."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device="cuda")
    handle = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
    peer = handle.get_buffer((handle.rank + 1) % handle.world_size, (nbytes,), torch.uint8)
    local = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, fn in (("write", lambda: peer.copy_(local)), ("read", lambda: local.copy_(peer))):
        fn()
        times = replay_times_us_in_step(fn, reps=reps, flush=lambda: None)
        out[name] = nbytes / (statistics.median(times) * 1e-6) / 1e9
    dist.barrier()
    return out


def render(result: dict) -> str:
    """Markdown: per T and rank, the touched local experts, the rank's byte limit, the fast
    layer's and the best stock composition's medians; the layer is as slow as its slowest
    rank, so the last columns compare the slowest rank of each."""
    lines = [f"Device {result['device']} x {result['ranks']} (one process per GPU), torch "
             f"{result['torch']}{tree_note(result)}; read bandwidth {result['read_gbs']:.0f} GB/s, peer write "
             f"{result['peer_gbs']['write']:.0f} GB/s, peer read {result['peer_gbs']['read']:.0f} "
             "GB/s (this run); medians of graph replays; fraction = byte limit / time.", "",
             "| T | rank | touched | limit us | fast us (frac) | stock us (frac) | speed-up |",
             "|---|---|---|---|---|---|---|"]
    for ranks in result["per_rank"]:
        for r, c in enumerate(ranks):
            lim, fast = c["limit_us"], c["median_us"]["fast"]
            stocks = [v for k, v in c["median_us"].items() if k.startswith("stock")]
            stock = min(stocks) if stocks else None
            st = f"{stock:.1f} ({lim / stock:.2f})" if stock else "-"
            up = f"{stock / fast:.2f}x" if stock else "-"
            lines.append(f"| {c['tokens']} | {r} | {c['touched']} | {lim:.1f} | {fast:.1f} "
                         f"({lim / fast:.2f}) | {st} | {up} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--render", help="print the markdown table of a result JSON and exit")
    ap.add_argument("--out", default="dep_peer_table.json")
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--experts-tactic", default="",
                    help="the experts engine's tactic in the layer, e.g. 'wgmma=1,fused=1' "
                         "(ExpertsEngine tactic; default the engine's)")
    ap.add_argument("--peers", default="triton")
    args = ap.parse_args(argv)
    if rendered(args, render):
        return

    import torch.distributed as dist

    from fast.schedules.dep_peer import DepPeerLayer
    from verify import cases

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, ranks = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    tokens_list = [int(t) for t in args.tokens.split(",")]
    flush = l2_flush()
    result = {**run_header(), "ranks": ranks, "cases": [],
              "read_gbs": read_bandwidth_gbs(), "peer_gbs": peer_bandwidth_gbs()}
    if rank == 0:
        print(f"read {result['read_gbs']:.0f} GB/s, peer {result['peer_gbs']}", flush=True)
    w = cases.device_weights("kimi_k3")
    c = w.config
    layer = DepPeerLayer(w, max_tokens=max(tokens_list),
                         experts_tactic=parse_tactic(args.experts_tactic))
    result["experts_tactic"] = args.experts_tactic or "default"
    per = layer.per
    expert_bytes = layer.engine.prepared.expert_bytes()
    stocks = {}
    if "triton" in args.peers:
        from benchmarks.peers import triton_moe

        ok, why = triton_moe.available()
        if not ok:
            result["triton_error"] = why
        else:
            for nw in (4, 8):
                stocks[f"stock_triton_w{nw}"] = triton_moe.TritonMoE(
                    w.w13, w.w13_scales, w.w2, w.w2_scales, first=rank * per, count=per,
                    n_experts_total=c.experts, num_warps=nw, device="cuda")
    for tokens in tokens_list:
        x = torch.randn(tokens, c.hidden, device="cuda").bfloat16()
        out = layer(x)
        local = out.recv_ids[(out.recv_ids >= rank * per) & (out.recv_ids < (rank + 1) * per)]
        touched = int(torch.unique(local).numel())
        nbytes = layer.dense.dense_bytes + touched * expert_bytes
        case = {"tokens": tokens, "touched": touched, "bytes": nbytes,
                "limit_us": nbytes / (result["read_gbs"] * 1e9) * 1e6, "times": {}}
        replay, _ = layer.graph(x)
        case["times"]["fast"] = replay_times_us_in_step(replay, reps=args.reps, flush=flush)
        layer.check()
        for name, moe in stocks.items():
            stock_rank = StockPeerRank(layer.dense, moe, ranks, tokens)
            case["times"][name] = replay_times_us_in_step(capture_graph(lambda: stock_rank(x)),
                                                  reps=args.reps, flush=flush)
        case["median_us"] = {k: statistics.median(v) for k, v in case["times"].items()}
        gathered = [None] * ranks
        dist.all_gather_object(gathered, case)
        if rank == 0:
            print(f"T {tokens:3d} " + " | ".join(
                f"rank {r}: touched {g['touched']} limit {g['limit_us']:.1f} " +
                " ".join(f"{k} {v:.1f}" for k, v in g["median_us"].items())
                for r, g in enumerate(gathered)), flush=True)
        result["cases"].append(case)
        result.setdefault("per_rank", []).append(gathered)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(render(result), end="")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
