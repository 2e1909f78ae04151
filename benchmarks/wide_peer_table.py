"""The wide layer over real ranks (``fast.schedules.wide_peer.WidePeerLayer``, TP over one
process per GPU), stage by stage, against the stock composition over NCCL and the byte
limit (GPU node)::

    PYTHONPATH=.gpu/peers:. torchrun --standalone --nproc-per-node 2 \\
        -m benchmarks.wide_peer_table --out wide_peer.json

Real dimensions (``kimi_k3``), TP over the launched ranks (2: every expert's 1536-wide
slice of the intermediate per rank), ``--tokens`` rows (default 65, 128, 256, 512, 1024),
the same rows on every rank (the wide bucket's contract). Every figure is the median device
time of ``--reps`` CUDA-graph replays, the L2 flushed before each by the 256 MiB read
(``benchmarks.experts_table.l2_flush``), every rank's replays started together (the barrier
of ``benchmarks.dep_peer_table``). Per ``T`` and rank:

* each stage alone (the layer's public stage calls, ``fast.schedules.wide_program.
  WideStageCalls``, on the rank's buffers, which a full call and the stages before it
  filled; a barrier between stages, every rank timing the
  same stage at the same time): ``shared`` (side stream, joined), ``front``, ``publish``
  (peer stores into every rank's mailbox), ``route`` (poll + router + plan rows),
  ``experts``, ``finalize``, ``latent`` (latent all-reduce reading the peers' partials +
  RMSNorm + up columns), ``hidden`` (hidden all-reduce reading the peers' partials). The
  poll consumes and re-arms its mailbox, so before ``route``'s warm-up calls and each
  replay the rank's mailbox buffer is restored from a snapshot taken after every rank's
  publish (checked full: no sentinel word left, so no poll waits); afterwards both
  buffers of every rank's mailbox are checked armed again, as the layer's next call needs
  them. ``latent`` is timed after a serial (eager) shared stage, which leaves it no event
  to wait for (the side stream's event of the ``shared`` capture belongs to that graph);
* not timed alone (:data:`UNTIMED`): the poll's wait for the peers' publishes and the two
  signal/wait pairs before the all-reduces — their time is the peers' lateness, not work
  of this rank;
* ``layer``: the whole call (``WidePeerLayer.graph``: both mailbox buffers' graphs
  alternately), waits included: the layer as the slower rank lets it run;
* the stock composition (``benchmarks.wide_table.stock_step``, one graph per rank):
  cuBLAS front (FP32 out) and shared GEMMs; NCCL all-gathers of every rank's FP32 logits
  shard and BF16 latent shard; PyTorch sigmoid top-k and SiTU; triton_kernels
  ``matmul_ogs`` experts over the rank's TP slice (best of ``num_warps`` 4 and 8); the two
  all-reduces as NCCL BF16 all-reduces (``torch.distributed``); PyTorch RMSNorm; cuBLAS
  addmm. The experts peer runs once alone on every rank first (the collectives only
  after every rank's succeeded), so a peer failure is recorded, not a hang;
* the byte limit: the rank's dense weight slices plus the TP slices of the touched
  experts (``benchmarks.wide_table.rank_dense_bytes``), at the read bandwidth the rank
  measured in the same run.

Every poll and wait has the layer's timeout (``--timeout-s``, the layer's default 10 s) and
``WidePeerLayer.check`` runs after the stages and after the layer's replays. Rank 0 writes
the JSON (after every ``T``, so an interrupted run keeps its rows); ``--render X.json``
prints the markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from benchmarks.provenance import run_header, tree_note
from benchmarks.dep_peer_table import replay_times_us_in_step
from benchmarks.experts_table import capture_graph, l2_flush, parse_tactic, rendered
from benchmarks.readbw import read_bandwidth_gbs
from benchmarks.wide_table import rank_dense_bytes, stock_step, triton_slice_moes

STAGES = ("shared", "front", "publish", "route", "experts", "finalize", "latent", "hidden")
#: the stages whose call polls the rank's mailbox (its snapshot is restored before a call)
POLLING = ("route",)
TOKENS = "65,128,256,512,1024"
UNTIMED = ("Each stage is timed alone, every rank running the same stage at the same time "
           "on the buffers the stages before it filled. Not timed alone: the poll's wait for "
           "the peers' publishes (route polls a full mailbox, restored before each replay) "
           "and the two signal/wait pairs before the all-reduces (a wait lasts as long as its "
           "peers are late; latent and hidden read partials already in place). The layer "
           "column is the whole call, every rank's replays started together, waits included.")


# -- arguments ------------------------------------------------------------------------------

def _tokens(text: str) -> list[int]:
    """``--tokens``: comma-separated row counts, each in the wide bucket of ``kimi_k3``."""
    from model.config import LatentMoEConfig

    c = LatentMoEConfig.kimi_k3()
    low, high = c.front_max + 1, c.wide_rows
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens must be comma-separated ints, got {text!r}")
    if not values:
        raise argparse.ArgumentTypeError("--tokens is empty")
    bad = [v for v in values if not low <= v <= high]
    if bad:
        raise argparse.ArgumentTypeError(f"--tokens {bad} outside the wide layer's bucket "
                                         f"[{low}, {high}]")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"--tokens has repeats: {values}")
    return values


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}")
    return value


def _timeout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value <= 600:
        raise argparse.ArgumentTypeError(f"must be seconds in (0, 600] (WidePeerLayer's "
                                         f"timeout_s), got {text!r}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="torchrun --standalone --nproc-per-node 2 -m benchmarks.wide_peer_table",
        description="The wide layer over real TP ranks against the stock composition "
                    "(module docstring).")
    ap.add_argument("--render", metavar="JSON",
                    help="print the markdown table of a result JSON and exit (no GPU)")
    ap.add_argument("--out", default="wide_peer_table.json", help="the JSON rank 0 writes")
    ap.add_argument("--tokens", type=_tokens, default=TOKENS,
                    help=f"row counts, comma-separated (default {TOKENS})")
    ap.add_argument("--reps", type=_positive_int, default=20, help="timed replays per figure")
    ap.add_argument("--experts-tactic", default="",
                    help="the experts engine's tactic in the layer, e.g. 'wgmma=1,fused=1' "
                         "(ExpertsEngine tactic; default the engine's)")
    ap.add_argument("--peers", default="triton",
                    help="'triton': also time the stock composition; '' skips it")
    ap.add_argument("--timeout-s", type=_timeout, default=10.0,
                    help="WidePeerLayer's timeout of every poll and wait (seconds)")
    return ap.parse_args(argv)


# -- arithmetic and mailbox words -----------------------------------------------------------

def byte_limit_us(nbytes: int, read_gbs: float) -> float:
    """The time (us) to read ``nbytes`` once at ``read_gbs`` GB/s."""
    return nbytes / (read_gbs * 1e9) * 1e6


def rank_bytes(layer, touched: int) -> int:
    """The rank's byte limit in bytes: its dense weight slices plus the TP slices of the
    ``touched`` experts (``layer.engine``'s bytes per expert slice)."""
    return rank_dense_bytes(layer, layer.rank) + touched * layer.engine.prepared.expert_bytes()


def _words(box: torch.Tensor, latent: int):
    """Whether each word of mailbox rows ``box`` (int16 ``[..., L + 2E]``) is empty: the
    latent words (16-bit) and the logit words (32-bit pairs, polled as such)."""
    from reference.schedules.mailbox import SENTINEL_BF16, SENTINEL_F32

    logits = box[..., latent:].contiguous().view(torch.int32)
    return box[..., :latent] == SENTINEL_BF16, logits == SENTINEL_F32


def mailbox_full(box: torch.Tensor, latent: int) -> bool:
    """No word of the rows ``box`` holds the sentinel: a poll of them returns at once."""
    lat, logits = _words(box, latent)
    return not bool(lat.any()) and not bool(logits.any())


def mailbox_armed(box: torch.Tensor, latent: int) -> bool:
    """Every word of the rows ``box`` holds the sentinel (what the layer's next call
    needs of both buffers)."""
    lat, logits = _words(box, latent)
    return bool(lat.all()) and bool(logits.all())


# -- the ranks ------------------------------------------------------------------------------

class Ranks:
    """What the measurement needs of the process group, in one place (the CPU tests
    replace the device parts): ``sync`` (this device idle, then a barrier), ``gather``
    (an object from every rank), ``require`` (raise on every rank where one fails),
    ``capture`` (a CUDA graph of a callable) and ``times`` (timed replays started
    together on every rank)."""

    def __init__(self, reps: int, group=None):
        self.reps, self.group = reps, group

    def sync(self) -> None:
        import torch.distributed as dist

        torch.cuda.synchronize()
        dist.barrier(group=self.group)

    def gather(self, obj) -> list:
        import torch.distributed as dist

        out = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def require(self, ok: bool, what: str) -> None:
        """Raise ``RuntimeError(what)`` on every rank if ``ok`` is false on any."""
        bad = [r for r, good in enumerate(self.gather(bool(ok))) if not good]
        if bad:
            raise RuntimeError(f"{what}: false on rank(s) {bad}")

    def capture(self, fn, before):
        return capture_graph(fn, before)

    def times(self, replay, before) -> list[float]:
        return replay_times_us_in_step(replay, reps=self.reps, flush=before)


# -- the fast layer -------------------------------------------------------------------------

def stage_fns(layer, x: torch.Tensor) -> dict:
    """Callables of this rank's stages (:data:`STAGES`), public stage calls only. The
    publish publishes this front (computed here, eagerly)."""
    r, tokens = layer.rank, x.shape[0]
    front = layer.front_stage(r, x)

    def shared():
        # the side stream, joined back into the current (capturing) stream
        layer.shared_stage(r, x, order="side").wait()

    return {
        "shared": shared,
        "front": lambda: layer.front_stage(r, x),
        "publish": lambda: layer.publish_stage(r, front, tokens),
        "route": lambda: layer.route_stage(r, tokens),
        "experts": lambda: layer.experts_stage(r, tokens),
        "finalize": lambda: layer.finalize_stage(r, tokens),
        "latent": lambda: layer.latent_stage(r, tokens),
        "hidden": lambda: layer.hidden_stage(r, tokens),
    }


def time_stages(layer, x: torch.Tensor, *, ranks: Ranks, flush) -> dict:
    """Per stage, ``ranks.times`` of its graph: every rank has finished the stage before
    (a barrier) and has the same call count (the same mailbox buffer). Leaves both
    buffers of every rank's mailbox armed (checked) and the engine's routing lists empty.

    Before each replay (outside the timed events): a stage that polls gets its mailbox
    back as every rank's publish left it and the engine's routing-list counters zeroed (a
    route replayed alone appends, and no experts stage consumes it); the experts stage
    alone gets the counters one route replay left (its lists and plan rows stay in
    memory: the plan kernel reads and re-arms only the counters)."""
    r, tokens, latent = layer.rank, x.shape[0], layer.config.latent
    own, index = layer.mailboxes[layer.rank], layer.mailbox_index
    live = layer.engine.live_counts()
    fns = stage_fns(layer, x)
    assert STAGES.index("route") < STAGES.index("experts")

    def restore_and_flush(snapshot):
        def before():
            own[index].copy_(snapshot)
            live.zero_()
            flush()
        return before

    def relist_and_flush(listed):
        def before():
            live.copy_(listed)
            flush()
        return before

    times = {}
    for name in STAGES:
        ranks.sync()  # every peer is done with the stage before (its publishes landed)
        before = flush
        if name in POLLING:
            snapshot = own[index].clone()  # as every rank's publish left it
            ranks.require(mailbox_full(snapshot[:tokens], latent),
                          f"wide_peer_table: mailbox buffer {index} is not full after every "
                          f"rank's publish (T={tokens}); its poll would time out")
            before = restore_and_flush(snapshot)
        elif name == "experts":
            before = relist_and_flush(live.clone())  # as the route's last replay left them
        elif name == "latent":
            # an eager serial shared stage: the same shared partial, and no side-stream
            # event left for the latent stage to wait on
            layer.shared_stage(r, x, order="serial")
        times[name] = ranks.times(ranks.capture(fns[name], before), before)
    ranks.sync()
    ranks.require(mailbox_armed(own, latent),
                  f"wide_peer_table: a mailbox is not armed again after the stages (T={tokens})")
    return times


# -- the stock composition ------------------------------------------------------------------

class _Alone:
    """The ``comm`` of :meth:`StockPeerRank.trial`: every rank's shard taken to be this
    rank's, no sums: the shapes of the real composition, no collective."""

    def __init__(self, ranks: int):
        self.ranks = ranks

    def gather(self, logits_shard, latent_shard):
        return (logits_shard.repeat(1, self.ranks),
                latent_shard.to(torch.bfloat16).repeat(1, self.ranks))

    def reduce_routed(self, partial):
        return partial

    def reduce_hidden(self, partial):
        return partial


class StockPeerRank:
    """This rank of the stock composition (``benchmarks.wide_table.stock_step``) over the
    layer's process group, for ``tokens`` rows: the shards gathered by NCCL all-gathers
    (each rank's rows copied into a send buffer first, as the one-GPU table copies them
    into its slot), the partials summed by NCCL BF16 all-reduces."""

    def __init__(self, layer, moe, tokens: int):
        c, n, on = layer.config, layer.ranks, dict(device=layer.device)
        self.layer, self.moe, self.tokens = layer, moe, tokens
        self.group = getattr(layer, "group", None)
        e_n, l_n = c.experts // n, c.latent // n
        self.send_logits = torch.empty(tokens, e_n, dtype=torch.float32, **on)
        self.send_latent = torch.empty(tokens, l_n, dtype=torch.bfloat16, **on)
        self.recv_logits = torch.empty(n * tokens, e_n, dtype=torch.float32, **on)
        self.recv_latent = torch.empty(n * tokens, l_n, dtype=torch.bfloat16, **on)
        self.logits = torch.empty(tokens, c.experts, dtype=torch.float32, **on)
        self.latent = torch.empty(tokens, c.latent, dtype=torch.bfloat16, **on)

    def gather(self, logits_shard, latent_shard):
        import torch.distributed as dist

        c, n, t = self.layer.config, self.layer.ranks, self.tokens
        self.send_logits.copy_(logits_shard)
        self.send_latent.copy_(latent_shard)
        dist.all_gather_into_tensor(self.recv_logits, self.send_logits, group=self.group)
        dist.all_gather_into_tensor(self.recv_latent, self.send_latent, group=self.group)
        # row s T + t of the gathered rows is rank s's shard of token t
        self.logits.copy_(self.recv_logits.view(n, t, -1).permute(1, 0, 2).reshape(t, c.experts))
        self.latent.copy_(self.recv_latent.view(n, t, -1).permute(1, 0, 2).reshape(t, c.latent))
        return self.logits, self.latent

    def _all_reduce(self, partial):
        import torch.distributed as dist

        partial = partial.contiguous()
        dist.all_reduce(partial, group=self.group)
        return partial

    def reduce_routed(self, partial):
        return self._all_reduce(partial)

    def reduce_hidden(self, partial):
        return self._all_reduce(partial)

    def trial(self, x):
        """Everything but the collectives, on this rank alone (:class:`_Alone`)."""
        return stock_step(self.layer, self.layer.rank, self.moe, x, _Alone(self.layer.ranks))

    def __call__(self, x):
        return stock_step(self.layer, self.layer.rank, self.moe, x, self)


def time_stock(layer, moe, x: torch.Tensor, *, ranks: Ranks, flush) -> tuple[list, list]:
    """``(times, errors)``: the stock composition's replay times on this rank, or ``[]``
    and every rank's error (``""`` where none) when any rank's experts peer failed alone
    (then no collective was launched) or any rank's timing raised."""
    error = ""
    try:
        stock = StockPeerRank(layer, moe, x.shape[0])
        stock.trial(x)
    except Exception as e:  # reported in the JSON, not hidden
        error = f"alone: {e!r}"
    errors = ranks.gather(error)
    if any(errors):
        return [], errors
    times = []
    try:
        ranks.sync()
        times = ranks.times(ranks.capture(lambda: stock(x), flush), flush)
    except Exception as e:
        error = repr(e)
    errors = ranks.gather(error)
    return ([], errors) if any(errors) else (times, errors)


# -- one T ----------------------------------------------------------------------------------

def measure_case(layer, x: torch.Tensor, *, ranks: Ranks, flush, read_gbs: float,
                 stocks: dict) -> dict:
    """This rank's figures for the rows ``x`` (the same on every rank): a first (eager,
    collective) call, the stages (:func:`time_stages`), the whole layer's graph replays,
    each stock composition, and the byte limit."""
    tokens = x.shape[0]
    out = layer(x)  # the first call of this T: compiles and meets the peers; checked
    touched = int(torch.unique(out.ids).numel())
    nbytes = rank_bytes(layer, touched)
    case = {"tokens": tokens, "rank": layer.rank, "touched": touched, "bytes": nbytes,
            "read_gbs": read_gbs, "limit_us": byte_limit_us(nbytes, read_gbs), "times": {}}
    case["times"].update(time_stages(layer, x, ranks=ranks, flush=flush))
    layer.check()
    ranks.sync()  # no peer still reads this rank's buffers in a stage
    replay, _ = layer.graph(x)
    case["times"]["layer"] = ranks.times(replay, flush)
    del replay
    layer.check()
    for name, moe in stocks.items():
        times, errors = time_stock(layer, moe, x, ranks=ranks, flush=flush)
        if times:
            case["times"][name] = times
        else:
            case.setdefault("errors", {})[name] = errors
    case["median_us"] = {k: statistics.median(v) for k, v in case["times"].items()}
    return case


# -- the table ------------------------------------------------------------------------------

def _cell(value, limit=None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if limit is None else f"{value:.1f} ({limit / value:.2f})"


def render(result: dict) -> str:
    """Markdown: per T and rank, the touched experts, the rank's byte limit, each stage's
    median (us), the whole layer's and the best stock composition's medians with their
    fractions of the limit, and the speed-up; then what the stage columns leave out."""
    stages = result.get("stages", list(STAGES))
    n = result["ranks"]
    lines = [f"Device {result['device']} x {n} (one process per GPU, TP{n}, real ranks), "
             f"torch {result['torch']}{tree_note(result)}; read bandwidth {result['read_gbs']:.0f} GB/s (rank 0, "
             f"this run); medians of {result.get('reps', '?')} graph replays, L2 flushed "
             "before each; fraction = byte limit / time.", "",
             "| T | rank | touched | limit us | " + " | ".join(stages) +
             " | layer us (frac) | stock us (frac) | speed-up |",
             "|" + "---|" * (len(stages) + 7)]
    for per_rank in result["per_rank"]:
        for c in per_rank:
            med, lim = c["median_us"], c["limit_us"]
            layer = med.get("layer")
            stock = min((v for k, v in med.items() if k.startswith("stock")), default=None)
            up = f"{stock / layer:.2f}x" if stock and layer else "-"
            lines.append(f"| {c['tokens']} | {c['rank']} | {c['touched']} | {lim:.1f} | " +
                         " | ".join(_cell(med.get(s)) for s in stages) +
                         f" | {_cell(layer, lim)} | {_cell(stock, lim)} | {up} |")
    lines += ["", result.get("untimed", UNTIMED)]
    errors = []  # a case's errors: every rank's (gathered), "" where it had none
    for per_rank in result["per_rank"]:
        for c in per_rank:
            for name, every in c.get("errors", {}).items():
                mine = every[c["rank"]] if c["rank"] < len(every) else ""
                if mine:
                    errors.append(f"T={c['tokens']} rank {c['rank']} {name}: {mine}")
    if "triton_error" in result:
        errors.insert(0, f"triton_kernels unavailable: {result['triton_error']}")
    if errors:
        lines += ["", "Errors:", ""] + [f"* {e}" for e in errors]
    return "\n".join(lines) + "\n"


def _write(result: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def main(argv=None):
    args = parse_args(argv)
    if rendered(args, render):
        return
    if "LOCAL_RANK" not in os.environ:
        raise SystemExit("benchmarks.wide_peer_table: launch with torchrun, one process per GPU: "
                         "torchrun --standalone --nproc-per-node 2 -m benchmarks.wide_peer_table")

    import torch.distributed as dist

    from fast.schedules.wide_peer import WidePeerLayer
    from verify import cases

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, n = dist.get_rank(), dist.get_world_size()
    ranks = Ranks(args.reps)
    flush = l2_flush()
    read_gbs = read_bandwidth_gbs()
    result = {**run_header(), "ranks": n, "reps": args.reps,
              "timeout_s": args.timeout_s, "read_gbs": read_gbs,
              "read_gbs_per_rank": ranks.gather(read_gbs),
              "stages": list(STAGES), "untimed": UNTIMED, "cases": [], "per_rank": []}
    if rank == 0:
        print(f"TP{n}: read {result['read_gbs_per_rank']} GB/s", flush=True)
    w = cases.device_weights("kimi_k3")  # the same weights on every rank (one seed)
    c = w.config
    layer = WidePeerLayer(w, max_rows=max(args.tokens), timeout_s=args.timeout_s,
                          experts_tactic=parse_tactic(args.experts_tactic))
    result["experts_tactic"] = args.experts_tactic or "default"
    stocks = {}
    if "triton" in args.peers:
        stocks, why = triton_slice_moes(w, rank, n)  # this rank's slice of I
        if why:
            result["triton_error"] = why
            if rank == 0:
                print("triton_kernels unavailable:", why, flush=True)
    del w  # the layer and the peers hold their slices
    torch.cuda.empty_cache()
    for tokens in args.tokens:
        x = cases.hidden_rows(c, tokens, 1000 + tokens, "cuda")  # the same rows on every rank
        case = measure_case(layer, x, ranks=ranks, flush=flush, read_gbs=read_gbs,
                            stocks=stocks)
        gathered = ranks.gather(case)
        result["cases"].append(case)
        result["per_rank"].append(gathered)
        if rank == 0:
            for g in gathered:
                print(f"T {tokens:4d} rank {g['rank']} touched {g['touched']} limit "
                      f"{g['limit_us']:.1f}us | " +
                      " | ".join(f"{k} {v:.1f}" for k, v in g["median_us"].items()) +
                      (f" | errors {g['errors']}" if g.get("errors") else ""), flush=True)
            _write(result, args.out)
    if rank == 0:
        _write(result, args.out)
        print(render(result), end="")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
