"""One wide (TP) rank's layer time on one GPU, stage by stage, against the stock composition
and the byte limit (GPU node):

    PYTHONPATH=.gpu/peers:. python3 -m benchmarks.wide_table --out results.json

The layer is ``fast.schedules.wide.WideLayer`` over ``--ranks`` virtual ranks (default 8,
TP8: every expert's 384-wide slice of the intermediate per rank). A full call fills every
rank's buffers; then rank 0's own work is timed: its shared expert (side stream), its front
GEMM, its publish into every mailbox, its poll + router + plan rows, its experts, its
Finalize, its latent all-reduce + RMSNorm + up columns (reading the other ranks' partials
from the full call; without the wait for the shared expert, ``latent_stage(...,
wait_shared=False)``) and its hidden all-reduce, and the whole rank's step with the shared
expert beside it. Each is captured in a CUDA graph; before every replay the L2 is flushed
(``benchmarks.experts_table``) and, for the stages that poll, rank 0's mailbox is restored
to the state after every rank published (a snapshot: the peers' publishes are not rank 0's
work, and a poll re-arms what it read).

The stock composition of the same rank, one graph: cuBLAS front (FP32 out) and shared
GEMMs; the gather of every rank's logits and latent shard as one copy each (what an
all-gather delivers); PyTorch sigmoid top-k and SiTU; triton_kernels ``matmul_ogs`` experts
over the rank's TP slice of every expert (best of ``num_warps`` 4 and 8, as vLLM runs MXFP4
MoE on Hopper; its scatter-combine is the Finalize); the two all-reduces as FP32 sums of the
ranks' partial rows (the reads a one-shot all-reduce makes); PyTorch RMSNorm; cuBLAS addmm.

The layer is built as ``WideLayer``'s defaults build it (``--batch-invariant``, on by
default): the front on ``fast.gemm`` with one K split at every row count and the shared
gate/up, shared down and up columns on cuBLASLt without split-K (``--invariant-gemms
stock``; ``fast``: all four on ``fast.gemm``, ``fast.schedules.wide_gemms``), so every
token's outputs are bitwise independent of its batch; run it beside a
``--no-batch-invariant`` run (cuBLAS, split-K allowed) on the same GPU for the mode's cost
per row count (the render says which mode a run used, and each case records what each GEMM
launched). ``--invariant-mma`` picks those GEMMs' MMA: ``auto`` (the layer's
default: the warpgroup MMA on sm_90a, ``mma.sync`` elsewhere), ``mma.sync`` or ``wgmma``;
the result records the kind that ran.

The byte limit: rank 0's dense weight slices (router rows and latent-down rows, shared
gate/up and down slices, up-projection rows) plus the TP slices of the touched experts, at
the read bandwidth measured in the same run (the mailbox and all-reduce traffic, a few MB,
is left out and shows in the fraction).
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

STAGES = ("shared", "front", "publish", "route", "experts", "finalize", "latent", "hidden",
          "rank")
#: rank 0's whole step with the shared expert forked at the other placements
#: (``fast.schedules.wide.SHARED_PLACEMENTS``; ``rank`` is ``"front"``)
PLACED = ("rank_beside", "rank_tail")
#: the stages whose graph polls rank 0's mailbox (its snapshot is restored before a replay)
POLLING = ("route", "rank") + PLACED


def fast_stages(layer, x, tokens: int) -> dict:
    """Callables of rank 0's stages (the peers' buffers from a full call) and of its whole
    step (the shared expert on the side stream, joined before the up columns)."""
    front = layer.front_stage(0, x)

    def shared():
        torch.cuda.current_stream().wait_event(layer.shared_stage(0, x, order="side"))

    def latent():
        # timed alone: the shared expert (the event it would wait for was recorded in
        # another stage's capture) is not part of this stage
        layer.latent_stage(0, tokens, wait_shared=False)

    def step(shared_at):
        def rank():
            if shared_at == "front":
                layer.shared_stage(0, x, order="side")
            layer.publish_stage(0, layer.front_stage(0, x), tokens)
            layer.route_stage(0, tokens)
            if shared_at == "beside":
                layer.shared_stage(0, x, order="side")
            layer.experts_stage(0, tokens)
            if shared_at == "tail":
                layer.shared_stage(0, x, order="side")
            layer.finalize_stage(0, tokens)
            layer.latent_stage(0, tokens)
            layer.hidden_stage(0, tokens)
        return rank

    return {
        "shared": shared,
        "front": lambda: layer.front_stage(0, x),
        "publish": lambda: layer.publish_stage(0, front, tokens),
        "route": lambda: layer.route_stage(0, tokens),
        "experts": lambda: layer.experts_stage(0, tokens),
        "finalize": lambda: layer.finalize_stage(0, tokens),
        "latent": latent,
        "hidden": lambda: layer.hidden_stage(0, tokens),
        "rank": step("front"),
        "rank_beside": step("beside"),
        "rank_tail": step("tail"),
    }


def stock_step(layer, r: int, moe, x, comm):
    """Rank ``r`` of the stock composition (module docstring) on the tokens ``x``: its front
    GEMM, the gather of every rank's logits and latent shard, the router, ``moe`` over its
    TP slice, the latent all-reduce, RMSNorm, its shared-expert slice, its up-projection
    columns and the hidden all-reduce. ``layer`` holds the rank's weights (a ``WideLayer``
    or a ``fast.schedules.wide_peer.WidePeerLayer``: ``front_weights[r]``, ...); ``comm``
    moves the rows between ranks: ``gather(logits_shard, latent_shard) -> (logits [T, E]
    FP32, latent [T, L] BF16)``, ``reduce_routed(partial [T, L])`` and
    ``reduce_hidden(partial [T, H])`` (BF16 sums over the ranks). :class:`StockRank` does it
    on one GPU, ``benchmarks.wide_peer_table.StockPeerRank`` over NCCL."""
    from fast import stock

    c = layer.config
    e_n = c.experts // layer.ranks
    front = stock.mm_fp32_out(x, layer.front_weights[r])
    logits, latent = comm.gather(front[:, :e_n], front[:, e_n:])
    w, ids = stock.route(logits, layer.bias, top_k=c.top_k, renormalize=c.renormalize,
                         scale=c.routed_scaling_factor)
    routed = comm.reduce_routed(moe(latent, ids, w))
    normed = stock.rms_norm(routed, layer.latent_norm, c.rms_eps)
    h = stock.mm_bf16(x, layer.shared_gate_up[r])
    shared = stock.mm_bf16(stock.situ_and_mul(h, beta=c.situ_beta,
                                              linear_beta=c.situ_linear_beta),
                           layer.shared_down[r])
    cols = slice(r * layer.columns, (r + 1) * layer.columns)
    shared[:, cols] = stock.addmm_bf16(shared[:, cols].contiguous(), normed, layer.up[r])
    return comm.reduce_hidden(shared)


class StockRank:
    """Rank 0 of the stock composition (module docstring) for ``tokens`` rows: the
    collectives as one-copy gathers and FP32 sums over the other ranks' rows (random)."""

    def __init__(self, layer, moe, tokens: int):
        c, n, dev = layer.config, layer.ranks, layer.device
        self.layer, self.moe, self.tokens = layer, moe, tokens
        e_n, l_n = c.experts // n, c.latent // n
        self.logits = torch.empty(tokens, c.experts, device=dev)
        self.latent = torch.empty(tokens, c.latent, dtype=torch.bfloat16, device=dev)
        self.peer_logits = torch.randn(n, tokens, e_n, device=dev)
        self.peer_latent = torch.randn(n, tokens, l_n, device=dev).bfloat16()
        self.peer_routed = torch.randn(n, tokens, c.latent, device=dev).bfloat16()
        self.peer_hidden = torch.randn(n, tokens, c.hidden, device=dev).bfloat16()

    def gather(self, logits_shard, latent_shard):
        c, t = self.layer.config, self.tokens
        self.peer_logits[0].copy_(logits_shard)
        self.peer_latent[0].copy_(latent_shard)
        self.logits.copy_(self.peer_logits.permute(1, 0, 2).reshape(t, c.experts))
        self.latent.copy_(self.peer_latent.permute(1, 0, 2).reshape(t, c.latent))
        return self.logits, self.latent

    def reduce_routed(self, partial):
        self.peer_routed[0] = partial
        return self.peer_routed.float().sum(0).bfloat16()

    def reduce_hidden(self, partial):
        self.peer_hidden[0] = partial
        return self.peer_hidden.float().sum(0).bfloat16()

    def __call__(self, x):
        return stock_step(self.layer, 0, self.moe, x, self)


def triton_slice_moes(w, rank: int, ranks: int) -> tuple[dict, str]:
    """triton_kernels ``matmul_ogs`` over rank ``rank``'s TP slice of the intermediate of
    every expert (of ``ranks``), ``num_warps`` 4 and 8, named ``stock_triton_w4`` /
    ``stock_triton_w8``; ``({}, why)`` where triton_kernels cannot run, else ``(moes, "")``."""
    from benchmarks.peers import triton_moe

    moes, why = triton_moe.rank_moes(w, 0, w.config.experts, (rank, ranks))
    return {f"stock_triton_w{nw}": moe for nw, moe in moes.items()}, why


def rank_dense_bytes(layer, r: int) -> int:
    """Bytes of rank ``r``'s dense weight slices: router + latent-down rows, shared gate/up
    and down slices, up-projection rows (the byte limit's dense part)."""
    return sum(t.numel() * t.element_size() for t in (
        layer.front_weights[r], layer.shared_gate_up[r], layer.shared_down[r], layer.up[r]))


def rank_arguments(ap, *, out: str, tokens: str, reps: int) -> None:
    """The options of a run over one virtual rank's layer: ``--render`` (a result JSON to
    print as markdown instead of a run: :func:`rendered`), ``--out``, ``--ranks``,
    ``--tokens``, ``--reps`` and ``--experts-tactic``."""
    ap.add_argument("--render", help="print the markdown of a result JSON and exit")
    ap.add_argument("--out", default=out)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--tokens", default=tokens)
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--experts-tactic", default="",
                    help="the experts engine's tactic in the layer, e.g. 'wgmma=1,fused=1' "
                         "(ExpertsEngine tactic; default the engine's)")


def load_forms(path: str | None) -> dict | str | None:
    """``--invariant-forms``: ``auto`` (the layer's default: its measured table, as
    ``WideLayer(invariant_forms="auto")`` resolves it), ``none`` (None: the split-K
    kernel's default tactics), a JSON file of ``{gemm: {rows_from: form}}`` (its row keys
    strings in JSON), or a ``benchmarks.wide_gemm_table`` result (its best form per GEMM
    and row count, ``wide_gemm_table.best_forms``)."""
    if path is None or path == "none":
        return None
    if path == "auto":
        return path
    with open(path) as f:
        data = json.load(f)
    if "rows" in data and "ranks" in data:
        from benchmarks.wide_gemm_table import best_forms

        return best_forms(data)
    return {gemm: {int(r): form for r, form in table.items()} for gemm, table in data.items()}


def measured_layer(ranks: int, tokens_list, experts_tactic: str,
                   batch_invariant: bool | None = None, invariant_mma: str = "auto",
                   serial_from: int | None = None, overlap: bool = False, chunk_windows: int = 8,
                   forms: dict | str | None = "auto", invariant_gemms: str | None = None):
    """(layer, weights, run header, flush) of a GPU-node run: the real layer's weights
    (``verify.cases.device_weights``), its virtual TP ranks at the widest batch (the
    arguments as ``WideLayer``'s; ``batch_invariant`` and ``invariant_gemms`` None: the
    layer's defaults), the run's device/torch/python, the mode the layer runs (read from
    it) and the read bandwidth measured now, and the L2 flush."""
    from fast.schedules.wide import WideLayer
    from verify import cases

    torch.manual_seed(0)
    flush = l2_flush()
    result = {**run_header(), "ranks": ranks, "cases": [], "read_gbs": read_bandwidth_gbs()}
    weights = cases.device_weights("kimi_k3")
    named = {k: v for k, v in (("batch_invariant", batch_invariant),
                               ("invariant_gemms", invariant_gemms)) if v is not None}
    layer = WideLayer(weights, ranks=ranks, max_rows=max(tokens_list),
                      experts_tactic=parse_tactic(experts_tactic), invariant_mma=invariant_mma,
                      invariant_serial_from=serial_from, invariant_overlap=overlap,
                      invariant_chunk_windows=chunk_windows, invariant_forms=forms, **named)
    result["batch_invariant"] = layer.batch_invariant
    if layer.batch_invariant:  # the kind the layer runs ("auto" resolved on this GPU)
        result["invariant_gemms"] = layer.invariant_gemms
        result["invariant_mma"] = layer.invariant_mma
        result["serial_from"] = serial_from
        result["invariant_overlap"] = overlap
        result["invariant_chunk_windows"] = chunk_windows
        result["invariant_forms"] = layer.invariant_forms  # "auto" resolved
        result["invariant_forms_asked"] = forms if isinstance(forms, str) else None
    return layer, weights, result, flush


def gemm_plan_cells(layer, tokens: int) -> dict:
    """What rank 0's four GEMMs launch at ``tokens`` rows, for the result JSON: per GEMM
    its fast.gemm tactic label, token chunks and windows per chunk, the tiled kernel's
    label (``TiledGemm.label``), or ``"cuBLAS"``."""
    plan = layer.gemm_plan(0, tokens)
    if not plan:
        return {name: "cuBLAS" for name in ("front", "shared_gate_up", "shared_down", "up")}
    return {name: f"{run.tactic.label()} x{run.chunks}c{run.windows}w"
            if hasattr(run, "tactic") else run.label() for name, run in plan.items()}


def published_case(layer, x, tokens: int, read_gbs: float, flush):
    """Run ``layer`` once on ``x`` (compiles, fills every rank's buffers), then leave rank
    0's mailbox as every rank's publish leaves it (the polls' starting state). Returns the
    case's header (touched experts, the byte limit's bytes and time) and the callables run
    before a replay (outside the timed events), by stage name (:data:`POLLING` for the
    stages that poll; ``flush`` for the others):

    * a replay that polls: that mailbox restored, rank 0's engine's routing-list counters
      zeroed (a route stage replayed alone appends, and no experts stage consumes it),
      L2 flushed;
    * the experts stage replayed alone: its routing-list counters set to what one route
      stage of the case leaves them (its lists and plan rows stay in memory: the plan
      kernel reads and re-arms only the counters), L2 flushed."""
    outputs = layer(x)
    touched = int(torch.unique(outputs[0].ids).numel())
    nbytes = rank_dense_bytes(layer, 0) + touched * layer.engines[0].prepared.expert_bytes()
    for r in range(layer.ranks):
        layer.publish_stage(r, layer.front_stage(r, x), tokens)
    index = layer.mailbox_index
    mailbox = layer.mailboxes[0][index]
    snapshot = mailbox.clone()
    live = layer.engines[0].live_counts()
    layer.route_stage(0, tokens)
    listed = live.clone()
    mailbox.copy_(snapshot)
    live.zero_()
    layer.check()

    def restore_and_flush():
        mailbox.copy_(snapshot)
        live.zero_()
        flush()

    def relist_and_flush():
        live.copy_(listed)
        flush()

    case = {"tokens": tokens, "touched": touched, "bytes": nbytes,
            "limit_us": nbytes / (read_gbs * 1e9) * 1e6}
    before = {name: restore_and_flush for name in POLLING}
    before["experts"] = relist_and_flush
    return case, before


def rearm_peers(layer) -> None:
    """Rank 0's last poll re-armed its mailbox; the other ranks' still hold every publish of
    the case: check the error record (rank 0's polls), then re-arm every mailbox and drop
    every engine's unconsumed routing-list appends (``WideLayer.reset``), so the next case
    starts as a fresh layer does."""
    layer.check()
    layer.reset()


def render(result: dict) -> str:
    """Markdown: per T, each stage's median (us), the rank's step (shared expert at the
    front) and its fraction of the byte limit, the step with the shared expert beside the
    experts and at the tail (runs before those placements existed show "-"), the best
    stock composition and the speed-up of the front step and of the beside step (the
    layer's default placement, ``fast.schedules.wide.DEFAULT_SHARED_PLACEMENT``)."""
    stock = result.get("invariant_gemms") == "stock"
    mode = (f"batch invariant (--batch-invariant: {'the front' if stock else 'the four GEMMs'} "
            f"on fast.gemm with one K split {'' if stock else 'per GEMM '}at every row count, "
            f"on {result.get('invariant_mma', 'mma.sync')}"
            + (f", serial splits from {result['serial_from']} rows"
               if result.get("serial_from") else "")
            + (", MMAs in flight across stages" if result.get("invariant_overlap") else "")
            + (", 128-row token chunks" if result.get("invariant_chunk_windows") == 16 else "")
            + ((", the front's form of invariant_forms in the JSON" if stock
                else ", per-GEMM forms (invariant_forms in the JSON)")
               if result.get("invariant_forms") else "")
            + ("; the other three on cuBLASLt without split-K (--invariant-gemms stock)"
               if stock else "")
            + ")" if result.get("batch_invariant")
            else "GEMMs on cuBLAS, split-K allowed (batch_invariant=False)")
    lines = [f"Device {result['device']}, torch {result['torch']}{tree_note(result)}; "
             f"{result['ranks']} virtual TP ranks, rank 0 timed; read bandwidth {result['read_gbs']:.0f} GB/s (this "
             f"run); fraction = byte limit / time; {mode}.", "",
             "| T | touched | limit us | " + " | ".join(STAGES[:-1]) +
             " | rank us (frac) | shared beside / tail us | stock us (frac) | speed-up "
             "(front / beside) |",
             "|" + "---|" * (len(STAGES) + 6)]
    for c in result["cases"]:
        med, lim = c["median_us"], c["limit_us"]
        stock = min((v for k, v in med.items() if k.startswith("stock")), default=None)
        cells = " | ".join(f"{med[s]:.1f}" for s in STAGES[:-1])
        st = f"{stock:.1f} ({lim / stock:.2f})" if stock else "-"
        up = f"{stock / med['rank']:.2f}x" if stock else "-"
        if stock and "rank_beside" in med:
            up += f" / {stock / med['rank_beside']:.2f}x"
        placed = " / ".join(f"{med[p]:.1f}" if p in med else "-" for p in PLACED)
        lines.append(f"| {c['tokens']} | {c['touched']} | {lim:.1f} | {cells} | "
                     f"{med['rank']:.1f} ({lim / med['rank']:.2f}) | {placed} | {st} | {up} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser()
    rank_arguments(ap, out="wide_table.json", tokens="65,128,256,512,1024", reps=20)
    ap.add_argument("--peers", default="triton")
    ap.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                    help="WideLayer(batch_invariant=...); default the layer's (on): the front "
                         "(with --invariant-gemms fast all four GEMMs) on fast.gemm, one K "
                         "split per GEMM at every row count; --no-batch-invariant: cuBLAS with "
                         "split-K allowed")
    ap.add_argument("--serial-from", type=int, default=None,
                    help="with --batch-invariant: calls of at least this many rows run each "
                         "GEMM's K splits serially in each CTA (the same bits; default never)")
    ap.add_argument("--invariant-overlap", action="store_true",
                    help="with --batch-invariant on the warpgroup MMA: each GEMM's MMAs in "
                         "flight across a stage (fast.gemm.Tactic.overlap; the same bits)")
    ap.add_argument("--invariant-chunk-windows", type=int, default=8, choices=(8, 16),
                    help="with --batch-invariant on the warpgroup MMA: 16 runs the GEMMs' calls "
                         "of more than 64 rows in 128-row token chunks (the same bits)")
    ap.add_argument("--invariant-forms", default="auto",
                    help="with --batch-invariant: auto (default, as WideLayer: the measured "
                         "TP8 table on sm_90a), none (no forms), a JSON file of per-GEMM forms ({gemm: "
                         "{rows_from: form}}, WideLayer(invariant_forms=...)) or a "
                         "benchmarks.wide_gemm_table result, whose best form per GEMM and row "
                         "count is taken (wide_gemm_table.best_forms)")
    ap.add_argument("--invariant-gemms", default=None, choices=("fast", "stock"),
                    help="with --batch-invariant: stock (the layer's default: the front on "
                         "fast.gemm, the other three on cuBLASLt without split-K) or fast (the "
                         "four GEMMs on fast.gemm; WideLayer(invariant_gemms=...))")
    ap.add_argument("--invariant-mma", default="auto", choices=MMA_CHOICES,
                    help="with --batch-invariant: the GEMMs' MMA (auto: the layer's default, "
                         "wgmma on sm_90a, else mma.sync; wgmma: sm_90a's warpgroup MMA)")
    args = ap.parse_args(argv)
    if rendered(args, render):
        return

    tokens_list = [int(t) for t in args.tokens.split(",")]
    layer, w, result, flush = measured_layer(args.ranks, tokens_list, args.experts_tactic,
                                             args.batch_invariant, args.invariant_mma,
                                             args.serial_from, args.invariant_overlap,
                                             args.invariant_chunk_windows,
                                             load_forms(args.invariant_forms),
                                             args.invariant_gemms)
    print(f"read {result['read_gbs']:.0f} GB/s", flush=True)
    c = w.config
    result["experts_tactic"] = args.experts_tactic or "default"
    peers = {}
    if "triton" in args.peers:
        peers, why = triton_slice_moes(w, 0, args.ranks)  # rank 0's slice of I
        if why:
            print("triton_kernels unavailable:", why)
            result["triton_error"] = why
    for tokens in tokens_list:
        x = torch.randn(tokens, c.hidden, device="cuda").bfloat16()
        case, before = published_case(layer, x, tokens, result["read_gbs"], flush)
        case["gemms"] = gemm_plan_cells(layer, tokens)
        case["times"] = {}
        for name, fn in fast_stages(layer, x, tokens).items():
            case["times"][name] = device_time_us(fn, reps=args.reps,
                                                 flush=before.get(name, flush))
        rearm_peers(layer)
        for name, moe in peers.items():
            try:
                stock_rank = StockRank(layer, moe, tokens)
                case["times"][name] = device_time_us(lambda: stock_rank(x), reps=args.reps,
                                                    flush=flush)
            except Exception as error:  # reported in the JSON, not hidden
                print(f"{name} at T={tokens} failed: {error!r}", flush=True)
                case.setdefault("errors", {})[name] = repr(error)
        case["median_us"] = {k: statistics.median(v) for k, v in case["times"].items()}
        med = case["median_us"]
        print(f"T {tokens:4d} touched {case['touched']:3d} limit {case['limit_us']:.1f}us | " +
              " | ".join(f"{k} {v:.1f}" for k, v in med.items()), flush=True)
        result["cases"].append(case)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(render(result), end="")


if __name__ == "__main__":
    main()
