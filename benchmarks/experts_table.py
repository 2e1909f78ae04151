"""The experts engine against its peers at the real dimensions, in one run (GPU node).

    PYTHONPATH=.gpu/peers:. python3 -m benchmarks.experts_table --out results.json

Cases (Kimi-K3 latent MoE, L = 3584, I = 3072, E = 896, top-16):

* DEP16 rank: experts [0, 56) of a rank over ``16 T`` received rows, T = 1..64 tokens per
  rank, uniform routing and a skewed one (Zipf-like popularity, exponent 1.0);
* TP8 rank: all 896 experts, the intermediate slice [0, 384), 65..1024 rows, uniform
  routing (``--wide-skews`` adds skewed ones).

Contestants, each captured in a CUDA graph and timed by CUDA events around one replay,
L2 flushed (a 256 MiB streaming read, ``l2_flush``) before every replay, median of ``--reps``:

* ``engine``: ``fast.experts.ExpertsEngine`` (routing lists, plan, FC1, FC2);
* ``triton_kernels``: OpenAI's ``matmul_ogs`` MXFP4 MoE (``benchmarks/peers/triton_moe``), at
  ``num_warps`` 4 and 8, each in two layouts: ``owner`` (the ``R`` received rows routed as
  they are, ``triton_w<nw>``) and ``compact`` (the rows with a local pair gathered into a
  batch of exactly their count, the BLOCK_M hint from the real pair count, the outputs
  scattered back: ``triton_compact_w<nw>``); the best of all is reported, named;
* ``marlin``: vLLM's Marlin MoE (``moe_wna16_marlin_gemm``, W4A16: BF16 activations x MXFP4
  weights repacked by ``gptq_marlin_repack``; ``benchmarks/peers/marlin_moe``, the libraries
  in ``.gpu/peers/marlin``), SiLU-and-mul between the GEMMs, at every ``block_size_m`` of
  8, 16, 32, 48, 64, each in two layouts: ``owner`` (vLLM's EP path: every stage over the
  ``R K`` pair rows, ``marlin_bm<bs>``) and ``compact`` (the ``P`` local pairs gathered,
  every stage over ``P`` rows, an FP32 ``index_add_`` combine: ``marlin_compact_bm<bs>``);
  the best of all is reported with its layout and block size (vLLM's own heuristic pick is
  in the JSON); its tiny-problem checks run first and pick the owner combine (``moe_sum``,
  else an FP32 PyTorch sum) whose results pass, and check the compact layout;
* ``trtllm``: FlashInfer's trtllm-gen MXFP4 MoE (``trtllm_fp4_block_scale_routed_moe``,
  MXFP4 weights x MXFP8 activations, SM100/SM103 only; ``benchmarks/peers/trtllm_moe``),
  our SiTU fused into FC1 (FlashInfer's ``ActivationType.Situ``), the owner layout (the
  ``R`` received rows, non-local pairs dropped by ``local_expert_offset``), tactics tuned by
  ``flashinfer.autotune`` per row count, in two inputs: the case's MXFP8 codes and scales
  (what the engine gets: ``trtllm_mx``) and BF16 ``x`` quantized by FlashInfer's
  ``mxfp8_quantize`` inside the call (vLLM's path: ``trtllm_bf16``); its tiny-problem check
  runs first. Where it cannot run (no Blackwell GPU, FlashInfer or its cubins missing) the
  reason is printed, kept as ``trtllm_error`` and the table says ``not run``;
* ``fi90``: FlashInfer's SM90 CUTLASS MoE (``cutlass_fused_moe`` with
  ``use_w4_group_scaling=True``, H100/H200; ``benchmarks/peers/flashinfer_sm90_moe``, the
  reduced ahead-of-time library in ``.gpu/peers/flashinfer_sm90``), our SiTU as its
  activation kernel (``ActivationType.Situ``), non-local pairs dropped by ``ep_size`` /
  ``ep_rank``, tactics tuned by ``flashinfer.autotune``, in each precision the library holds
  (``w4a16``: BF16 activations x MXFP4 weights; ``w4a8``: the Humming path, activations
  quantized per row to FP8 inside the call) and two layouts: ``owner`` (the ``R`` received
  rows, ``fi90_<precision>``) and ``compact`` (the rows with a local pair gathered, their
  count from the host: ``fi90_compact_<precision>``); the best of all is reported, named;
  its tiny-problem checks run first (a precision or layout whose checks fail is not timed);
  where it cannot run the reason is kept as ``fi90_error`` and the table says ``not run``;
* ``grouped_mm``: ``torch._grouped_mm`` on BF16-resident weights (rows sorted by expert);
* the byte limit: touched experts x bytes per expert, at the read bandwidth measured in
  the same run (``benchmarks.readbw.read_bandwidth_gbs``: a streaming read of 4 GiB with
  the engine's load instruction).

The compact layouts' batch sizes (local rows, local pairs) are host ints computed before
the timed call, as a DEP dispatch knows what it received; the calls themselves do no host
synchronization.

Each figure is also stated as a fraction of the byte limit. The JSON holds every sample.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.provenance import run_header, tree_note

L, I, E, K = 3584, 3072, 896, 16
FLUSH_BYTES = 256 << 20


def parse_tactic(spec: str) -> dict:
    """``'wgmma=1,fused=1'`` -> ``{'wgmma': 1, 'fused': 1}`` ('' -> the defaults)."""
    tactic = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if not key or not value.lstrip("-").isdigit():
            raise ValueError(f"tactic items are key=int, got {item!r}")
        tactic[key] = int(value)
    return tactic


def l2_flush():
    """A callable that evicts the L2 before a timed replay by a 256 MiB streaming read
    (``benchmarks.readbw``). A write flush (``fill_``) would leave dirty lines that drain
    during the timed kernel (measured on the H200: four cuBLAS GEMMs timed apart after a
    write flush summed to 135 us against 117 us in one graph); results up to
    ``h200_engine_v4`` and ``h200_dep16_v1`` were made with the write flush."""
    from benchmarks import readbw

    buf = torch.randint(0, 255, (FLUSH_BYTES,), dtype=torch.uint8, device="cuda")
    out = torch.zeros(readbw.CTAS, dtype=torch.int32, device="cuda")
    return lambda: readbw.read(buf, out)


def capture_graph(fn, before=lambda: None):
    """``fn`` captured once in a CUDA graph; returns the graph's ``replay``. ``fn`` runs
    eagerly first (compiles, allocates), then once more on the capture stream (its
    per-stream workspaces, e.g. cuBLAS's), each after ``before()`` (what a replay
    needs in place: a polled mailbox restored)."""
    before()
    fn()  # warm-up (compiles, allocates)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        before()
        fn()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return graph.replay


def replay_times_us(replay, *, reps: int, flush) -> list[float]:
    """Device times (us) of ``reps`` calls of ``replay``, ``flush()`` (the L2 flush, a
    mailbox restore) run ahead of each outside the timed events."""
    times = []
    for _ in range(reps):
        flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return times


def device_time_us(fn, *, reps: int, flush) -> list[float]:
    """Per-replay device times (us) of ``fn`` (captured once in a CUDA graph), ``flush()``
    ahead of the warm-up calls and of each replay."""
    return replay_times_us(capture_graph(fn, flush), reps=reps, flush=flush)


def rendered(args, render) -> bool:
    """With ``--render``: print ``render`` of that result JSON and return True (no run)."""
    if not args.render:
        return False
    with open(args.render) as f:
        print(render(json.load(f)), end="")
    return True


def new_result() -> dict:
    """A run's result record: the device, the software, an empty case list, and the read
    bandwidth measured now (``read_gbs``, the byte limits' rate)."""
    result = {**run_header(), "cases": []}
    from benchmarks import readbw

    result["read_gbs"] = readbw.read_bandwidth_gbs()
    return result


def random_weights(seed=7):
    """The real layer with uniformly random MXFP4 expert codes, scale codes 118..124
    (``verify.cases.device_weights``; the engine reads only the experts)."""
    from verify import cases

    return cases.device_weights("kimi_k3", seed)


def routing(rows: int, seed: int, skew: float) -> torch.Tensor:
    from model.config import LatentMoEConfig
    from verify import cases

    return cases.routing(LatentMoEConfig.kimi_k3(), rows, seed, skew=skew)


def rank_case(mode: str, size: int, skew: float, first: int, count: int, expert_bytes: int,
              read_gbs: float, device: str = "cuda") -> dict:
    """One case's inputs and byte limit: ``size`` tokens per DEP16 rank (``16 size`` rows)
    or ``size`` rows of a TP8 rank, routed by ``routing`` (seed ``1000 + rows``), latent rows
    ``2 N(0, 1)`` in BF16 (``x``) and their MXFP8 ``codes`` and ``scales``; the pairs and
    touched experts of the local experts ``[first, first + count)``, the bytes those stream
    (``expert_bytes`` each) and the time they take at ``read_gbs`` (``limit_us``); every
    tensor on ``device``; ``local_rows``: the rows with a local pair (the compact peers'
    batch)."""
    from reference.mx import quantize_mxfp8

    rows = size * 16 if mode == "dep16" else size
    ids = routing(rows, 1000 + rows, skew).to(device)
    x = (torch.randn(rows, L, device=device) * 2).bfloat16()
    codes, scales = quantize_mxfp8(x)
    is_local = (ids >= first) & (ids < first + count)  # [rows, K]
    local = ids[is_local].long()
    touched = int(torch.unique(local).numel())
    max_pairs = int(torch.bincount(local - first).max()) if local.numel() else 0
    nbytes = touched * expert_bytes
    return {"rows": rows, "ids": ids, "x": x, "codes": codes, "scales": scales,
            "pairs": int(local.numel()), "local_rows": int(is_local.any(dim=1).sum()),
            "touched": touched, "max_pairs": max_pairs,
            "bytes": nbytes,
            "limit_us": nbytes / (read_gbs * 1e9) * 1e6}


def run_ranks(args, run_mode, result: dict, started: float) -> None:
    """``run_mode(mode, first, count, shard, sizes)`` for one DEP16 rank (its 56 experts,
    whole, at ``args.dep_tokens`` tokens per rank) and one TP8 rank (all 896 experts, the
    first of 8 slices, at ``args.wide_rows`` rows), each where its sizes are given; then
    ``result``, with its wall time since ``started``, written to ``args.out``. The file is
    also written after the first mode with ``"complete": false``, so that a run stopped by a
    time limit keeps the mode it finished."""
    def write(complete: bool) -> None:
        result["wall_s"] = time.time() - started
        result["complete"] = complete
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    if args.dep_tokens:
        run_mode("dep16", 0, 56, (0, 1), [int(v) for v in args.dep_tokens.split(",")])
        torch.cuda.empty_cache()  # the mode's engine and peers are gone with its scope
        if args.wide_rows:
            write(complete=False)
    if args.wide_rows:
        run_mode("tp8", 0, 896, (0, 8), [int(v) for v in args.wide_rows.split(",")])
    write(complete=True)


def experts_arguments(ap: argparse.ArgumentParser, *, out: str, reps: int, dep_tokens: str,
                      wide_rows: str) -> None:
    """The options of a run over ``run_ranks``'s two ranks: ``--render`` (a result JSON to
    print as markdown instead of a run: :func:`rendered`), ``--out``, ``--reps``,
    ``--dep-tokens`` and ``--wide-rows``."""
    ap.add_argument("--render", help="print the markdown table of a result JSON and exit")
    ap.add_argument("--out", default=out)
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--dep-tokens", default=dep_tokens)
    ap.add_argument("--wide-rows", default=wide_rows)


def start_run():
    """A GPU run's start: the seed, the L2 flush, the start time, ``new_result()`` (its
    read bandwidth printed) and the random layer weights: ``(flush, started, result,
    weights)``."""
    torch.manual_seed(0)
    flush = l2_flush()
    started = time.time()
    result = new_result()
    print(f"read {result['read_gbs']:.0f} GB/s", flush=True)
    return flush, started, result, random_weights()


def marlin_setup(peers: list, result: dict):
    """Where ``"marlin"`` is among ``peers`` and the peer can run: its tiny-problem checks
    (``marlin_moe.passing_combine``, recorded in ``result["marlin_checks"]``; the compact
    layout's ``marlin_moe.compact_passes`` in ``result["marlin_compact_checks"]``), the
    combine that passed and whether the compact layout passed, as ``(marlin_moe, combine,
    compact_ok)``; else None, the reason in ``result["marlin_error"]`` and printed."""
    if "marlin" not in peers:
        return None
    try:
        from benchmarks.peers import marlin_moe

        ok, why = marlin_moe.available()
        if not ok:
            print("marlin unavailable:", why, flush=True)
            result["marlin_error"] = why
            return None
        combine, checks = marlin_moe.passing_combine()
        result["marlin_checks"] = checks
        result["marlin_versions"] = marlin_moe.versions()
        print(f"marlin checks ({marlin_moe.ops_set()} set):", [c["ok"] for c in checks],
              "combine", combine, flush=True)
        if combine is None:
            result["marlin_error"] = "tiny-problem checks failed (not timed)"
            return None
        compact_ok, compact_checks = marlin_moe.compact_passes()
        result["marlin_compact_checks"] = compact_checks
        print("marlin compact checks:", [c["ok"] for c in compact_checks], flush=True)
        if not compact_ok:
            result["marlin_compact_error"] = "compact tiny-problem checks failed (compact not timed)"
        return marlin_moe, combine, compact_ok
    except Exception as error:  # reported, not hidden
        print("marlin setup failed:", repr(error), flush=True)
        result["marlin_error"] = repr(error)
        return None


def marlin_peers(marlin, w, first: int, count: int, shard: tuple[int, int], result: dict) -> dict:
    """``{"marlin_bm<bs>": fn, "marlin_compact_bm<bs>": fn}`` for every candidate
    ``block_size_m`` (the compact ones where its checks passed), all over one converted
    weight set of the rank (``rank_moe``); each ``fn(x, ids, rw, case)`` (the compact
    layout's capacity is ``case["pairs"]``); the configuration in
    ``result["peers"]["marlin"]``. Empty (reason printed) if the build fails."""
    module, combine, compact_ok = marlin
    try:
        moe, why = module.rank_moe(w, first, count, shard, combine=combine)
    except Exception as error:  # reported, not hidden
        moe, why = None, repr(error)
    if moe is None:
        print(f"marlin build failed: {why}", flush=True)
        return {}
    desc = moe.describe()
    desc["block_size_m"] = "best of " + "/".join(map(str, module.BLOCK_SIZES)) + " per case"
    desc["layout"] = ("best of owner (every stage over the R K pair rows, moe_sum combine) and compact "
                      "(the P local pairs gathered, P from the host, FP32 index_add_ combine) per case"
                      if compact_ok else "owner (compact failed its checks)")
    desc["weights"] = "gptq_marlin_repack int32 [E, K/16, 2N]; E8M0 scales [E, K/32, N] permuted"
    for key in ("first", "count", "latent", "intermediate", "bytes_per_expert", "stored_bytes_per_expert"):
        desc.pop(key, None)
    result.setdefault("peers", {})["marlin"] = desc
    fns = {f"marlin_bm{bs}": (lambda x, ids, rw, case, bs=bs: moe(x, ids, rw, block_size_m=bs))
           for bs in module.BLOCK_SIZES}
    if compact_ok:
        fns.update({f"marlin_compact_bm{bs}": (
            lambda x, ids, rw, case, bs=bs: moe(x, ids, rw, block_size_m=bs, layout="compact",
                                                capacity=max(1, case["pairs"])))
            for bs in module.BLOCK_SIZES})
    return fns


def marlin_vllm_pick(rows: int, count: int) -> int:
    """vLLM's own ``block_size_m`` for ``rows`` at a rank of ``count`` of the ``E`` experts."""
    from benchmarks.peers.marlin_moe import vllm_block_size_m

    return vllm_block_size_m(rows, K, count, E)


def trtllm_setup(peers: list, result: dict):
    """Where ``"trtllm"`` is among ``peers`` and the peer can run: its tiny-problem checks
    (``trtllm_moe.check_forward``, SiTU, MXFP8 and BF16 inputs; recorded in
    ``result["trtllm_checks"]``), as the module; else None, the reason in
    ``result["trtllm_error"]`` and printed."""
    if "trtllm" not in peers:
        return None
    try:
        from benchmarks.peers import trtllm_moe

        ok, why = trtllm_moe.available()
        if not ok:
            print("trtllm unavailable:", why, flush=True)
            result["trtllm_error"] = why
            return None
        checks = [trtllm_moe.check_forward(bf16_input=b, raise_on_fail=False) for b in (False, True)]
        result["trtllm_checks"] = checks
        result["trtllm_versions"] = trtllm_moe.versions()
        print("trtllm checks:", [c["ok"] for c in checks], flush=True)
        if not all(c["ok"] for c in checks):
            result["trtllm_error"] = "tiny-problem checks failed (not timed)"
            return None
        return trtllm_moe
    except Exception as error:  # reported, not hidden
        print("trtllm setup failed:", repr(error), flush=True)
        result["trtllm_error"] = repr(error)
        return None


def trtllm_peers(module, w, first: int, count: int, shard: tuple[int, int], result: dict, mx: dict) -> dict:
    """``{"trtllm_mx": fn, "trtllm_bf16": fn}`` over one converted weight set of the rank
    (``rank_moe``): ``trtllm_mx`` reads the case's MXFP8 codes and scales from ``mx`` (set
    per case by the caller), ``trtllm_bf16`` quantizes ``x`` inside the call; the
    configuration in ``result["peers"]["trtllm"]``. Empty (reason printed and kept) if the
    build fails."""
    try:
        moe, why = module.rank_moe(w, first, count, shard)
    except Exception as error:  # reported, not hidden
        moe, why = None, repr(error)
    if moe is None:
        print(f"trtllm build failed: {why}", flush=True)
        result["trtllm_error"] = f"build failed: {why}"
        return {}
    desc = moe.describe()
    desc["inputs"] = "best of MXFP8 given (mx) and BF16 + mxfp8_quantize in the call (bf16) per case"
    for key in ("first", "count", "latent", "intermediate", "bytes_per_expert"):
        desc.pop(key, None)
    result.setdefault("peers", {})["trtllm"] = desc
    return {"trtllm_mx": lambda x, ids, rw, case: moe.forward_mxfp8(mx["codes"], mx["scales"], ids, rw),
            "trtllm_bf16": lambda x, ids, rw, case: moe(x, ids, rw)}


def fi90_setup(peers: list, result: dict):
    """Where ``"fi90"`` is among ``peers`` and the peer can run: its tiny-problem checks
    (``flashinfer_sm90_moe.check_forward``, SiTU, each precision the library holds, both
    layouts; recorded in ``result["fi90_checks"]``), as ``(flashinfer_sm90_moe, {precision:
    [layouts that passed]})``; else None, the reason in ``result["fi90_error"]`` and printed.
    A precision or layout whose check failed is left out (its reason in
    ``result["fi90_partial_error"]``)."""
    if "fi90" not in peers:
        return None
    try:
        from benchmarks.peers import flashinfer_sm90_moe as fi90

        ok, why = fi90.available()
        if not ok:
            print("fi90 unavailable:", why, flush=True)
            result["fi90_error"] = why
            return None
        kernels = fi90.load_module()["entry"]["manifest"].get("kernels", ["w4a16"])
        checks, passed = [], {}
        for precision in kernels:
            for layout in fi90.LAYOUTS:
                res = fi90.check_forward(precision=precision, layout=layout, raise_on_fail=False, autotune=False)
                checks.append(res)
                if res["ok"]:
                    passed.setdefault(precision, []).append(layout)
        result["fi90_checks"] = checks
        result["fi90_versions"] = fi90.versions()
        print("fi90 checks:", [(c["config"]["precision"], c["config"]["layout"], c["ok"]) for c in checks],
              flush=True)
        if not passed:
            result["fi90_error"] = "tiny-problem checks failed (not timed)"
            return None
        failed = [f"{c['config']['precision']} {c['config']['layout']}" for c in checks if not c["ok"]]
        if failed:
            result["fi90_partial_error"] = f"tiny-problem checks failed for {', '.join(failed)} (not timed)"
        return fi90, passed
    except Exception as error:  # reported, not hidden
        print("fi90 setup failed:", repr(error), flush=True)
        result["fi90_error"] = repr(error)
        return None


def fi90_peers(fi90, w, first: int, count: int, shard: tuple[int, int], result: dict) -> dict:
    """``{"fi90_<precision>": fn, "fi90_compact_<precision>": fn}`` for each precision and
    layout whose checks passed, over one converted weight set per precision of the rank
    (``rank_moe``); each ``fn(x, ids, rw, case)`` (the compact layout's capacity is
    ``case["local_rows"]``); the configuration in ``result["peers"]["fi90"]``. Empty (reason
    printed and kept) if no build succeeds."""
    module, passed = fi90
    fns, desc = {}, None
    for precision, layouts in passed.items():
        try:
            moe, why = module.rank_moe(w, first, count, shard, precision=precision)
        except Exception as error:  # reported, not hidden
            moe, why = None, repr(error)
        if moe is None:
            print(f"fi90 {precision} build failed: {why}", flush=True)
            result["fi90_error"] = f"build failed: {why}"
            continue
        desc = desc or moe.describe()
        for layout in layouts:
            name = f"fi90_{precision}" if layout == "owner" else f"fi90_compact_{precision}"
            fns[name] = (lambda x, ids, rw, case, moe=moe, layout=layout:
                         moe(x, ids, rw, layout=layout, capacity=max(1, case["local_rows"])))
    if desc is not None:
        desc["precision"] = "best of " + "/".join(passed) + " per case"
        desc["layout"] = ("best of owner (the R received rows) and compact (the rows with a local pair gathered, "
                          "their count from the host) per case")
        desc["peer"] = "FlashInfer cutlass_fused_moe SM90 (use_w4_group_scaling; w4a8: use_wfp4afp8_humming)"
        for key in ("first", "count", "latent", "intermediate", "bytes_per_expert", "routing"):
            desc.pop(key, None)
        result.setdefault("peers", {})["fi90"] = desc
    return fns


class GroupedMM:
    """``torch._grouped_mm`` experts over BF16-resident weights: rows sorted by expert,
    FC1, SiTU (PyTorch ops), FC2, rows scattered back (the PyTorch path a user has)."""

    def __init__(self, w13_bf16, w2_bf16, first: int, count: int):
        self.w13 = w13_bf16.transpose(1, 2)  # [E_loc, L, 2I] (column-major views)
        self.w2 = w2_bf16.transpose(1, 2)  # [E_loc, I, L]
        self.first, self.count = first, count

    def __call__(self, x, ids, weights=None):
        flat = ids.reshape(-1).long() - self.first
        local = (flat >= 0) & (flat < self.count)
        key = torch.where(local, flat, torch.full_like(flat, self.count))
        order = torch.argsort(key, stable=True)
        counts = torch.zeros(self.count + 1, dtype=torch.int64, device=x.device)
        counts = counts.scatter_add_(0, key, torch.ones_like(key))[: self.count]  # no host sync
        offs = torch.cumsum(counts, 0).to(torch.int32)
        rows = x[torch.div(order, K, rounding_mode="floor")]
        h = torch._grouped_mm(rows, self.w13, offs=offs)
        inter = h.shape[1] // 2
        g, u = h[:, :inter].float(), h[:, inter:].float()
        a = (4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g) * (25.0 * torch.tanh(u / 25.0))).bfloat16()
        y = torch._grouped_mm(a, self.w2, offs=offs)
        out = torch.empty(ids.numel(), x.shape[1], dtype=torch.bfloat16, device=x.device)
        out[order] = y
        return out


def best_of(median_us: dict, prefix: str | tuple[str, ...]) -> tuple[str | None, float | None]:
    """The fastest of a case's contestants named ``prefix...`` (one per configuration, e.g.
    ``marlin_bm16``; a tuple of prefixes: the fastest of those families, e.g.
    :data:`PEER_FAMILIES` for the best peer): ``(name, median us)``, or ``(None, None)`` if
    there is none."""
    runs = [(v, k) for k, v in median_us.items() if k.startswith(prefix)]
    if not runs:
        return None, None
    v, k = min(runs)
    return k, v


#: The contestant families of a case (``median_us`` keys start with one of these); the
#: engine and its ``engine_<tactic>`` variants are not peers.
PEER_FAMILIES = ("triton", "grouped_mm", "marlin", "trtllm", "fi90")


def peer_label(name: str) -> str:
    """A contestant's family with its layout and configuration: ``fi90_w4a8`` ->
    ``fi90 owner w4a8``, ``grouped_mm`` -> ``grouped_mm``."""
    family = next(f for f in PEER_FAMILIES if name.startswith(f))
    tag = config_tag(name, family)
    return f"{family} {tag}" if tag else family


def config_tag(name: str | None, prefix: str) -> str:
    """A contestant's layout and configuration from its name: ``triton_w4`` -> ``owner w4``,
    ``marlin_compact_bm16`` -> ``compact bm16`` (names without a layout are the owner
    layout's, as in runs before the compact layouts); ``''`` for the bare prefix or None."""
    if not name or not name.startswith(prefix + "_"):
        return ""
    rest = name[len(prefix) + 1:]
    if rest.startswith("compact_"):
        return "compact " + rest[len("compact_"):]
    return "owner " + rest


#: What every run joined by :func:`merge_runs` must share (one device, software and tree).
MERGE_KEYS = ("device", "torch", "python", "commit")


def merge_runs(results: list[dict]) -> dict:
    """One result of several runs' cases (each run a part of one table that did not fit one
    device call): the shared header (``MERGE_KEYS``), every case in the parts' order with
    its own run's read bandwidth (``case["read_gbs"]``; its ``limit_us`` was computed at that
    rate, so each fraction stays one run's), ``parts`` (each run's read bandwidth, wall time,
    completeness and cases), the peers' descriptions and versions (which must agree: a
    layout, configuration or build that changed between runs would make one table of two
    contests), every run's tiny-problem checks and every error a run reported. There is no
    top-level ``read_gbs``: each case carries its own.

    Raises:
        ValueError: fewer than two runs; runs of another device, software or tree; a case
            (mode, size, skew) in two runs; a peer described, or built, differently by two
            runs.
    """
    if len(results) < 2:
        raise ValueError(f"merge_runs: needs at least two runs, got {len(results)}")
    first = results[0]
    for i, r in enumerate(results[1:], 1):
        for key in MERGE_KEYS:
            if r.get(key) != first.get(key):
                raise ValueError(f"merge_runs: run {i} has {key}={r.get(key)!r}, run 0 "
                                 f"{first.get(key)!r} (one table is one device, software and tree)")
    merged = {key: first.get(key) for key in MERGE_KEYS}
    merged.update(cases=[], parts=[], peers={})
    seen = {}
    for i, r in enumerate(results):
        if "read_gbs" not in r or "cases" not in r:
            raise ValueError(f"merge_runs: run {i} is not an experts_table result "
                             f"(no read_gbs or cases)")
        for c in r["cases"]:
            key = (c["mode"], c["size"], float(c["skew"]))
            if key in seen:
                raise ValueError(f"merge_runs: case {key} is in run {seen[key]} and run {i}")
            seen[key] = i
            merged["cases"].append({**c, "read_gbs": c.get("read_gbs", r["read_gbs"])})
        merged["parts"].append({"read_gbs": r["read_gbs"], "wall_s": r.get("wall_s"),
                                "complete": r.get("complete"), "cases": len(r["cases"])})
        for name, desc in r.get("peers", {}).items():
            if name in merged["peers"] and merged["peers"][name] != desc:
                raise ValueError(f"merge_runs: peer {name!r} is described differently by "
                                 f"run {i} than by an earlier run")
            merged["peers"][name] = desc
        for key, value in r.items():
            if key.endswith("_checks"):  # every run's tiny-problem checks
                merged.setdefault(key, []).extend(value)
            elif key.endswith("_versions"):  # one peer build per table
                if key in merged and merged[key] != value:
                    raise ValueError(f"merge_runs: {key} differ between runs ({merged[key]!r} "
                                     f"and {value!r})")
                merged[key] = value
            elif key.endswith("_error") and value not in merged.get(key, ""):
                merged[key] = f"{merged[key]}; run {i}: {value}" if key in merged else value
    merged["complete"] = all(p["complete"] for p in merged["parts"])
    return merged


def render(result: dict) -> str:
    """A markdown table of a result: per case the median time of each contestant (us) and
    its fraction of the byte limit; the best triton_kernels layout and configuration (named,
    :func:`config_tag`); the speed-up of the engine over it; where the run timed Marlin (or
    the trtllm-gen MoE, or FlashInfer's SM90 MoE ``fi90``), its best layout and
    configuration (named) and the engine's speed-up over it in two more columns each, and
    each peer's layout and
    configuration (``result["peers"]``) under the table; the last two columns name the best
    peer of the case (the fastest of every family, layout and configuration,
    ``best_of(..., PEER_FAMILIES)``) and the engine's speed-up over it; and ``<peer>: not run: <reason>``
    for each peer the run could not time (``result["<peer>_error"]``); then, where the run measured
    ``--tactics`` variants, a second table of each variant's time and its ratio to the
    default's."""
    extra = [p for p in ("marlin", "trtllm", "fi90")
             if any(k.startswith(p) for c in result["cases"] for k in c["median_us"])]
    parts = result.get("parts")
    if parts:  # merge_runs: each case's fractions are of its own run's read bandwidth
        rates = " / ".join(f"{p['read_gbs']:.0f}" for p in parts)
        bandwidth = (f"{len(parts)} runs joined, read bandwidth {rates} GB/s (each case's "
                     f"limit and fractions at its own run's rate, the read GB/s column)")
    else:
        bandwidth = f"read bandwidth {result['read_gbs']:.0f} GB/s (this run)"
    lines = [f"Device {result['device']}, torch {result['torch']}{tree_note(result)}; "
             f"{bandwidth}; fraction = byte limit / time.",
             "",
             "| mode | size | skew | touched |" + (" read GB/s |" if parts else "")
             + " limit us | engine us (frac) | triton best us (frac) "
             "| grouped_mm us (frac) | engine / triton |"
             + "".join(f" {p} best us (frac) | engine / {p} |" for p in extra)
             + " best peer | engine / best peer |",
             "|---|---|---|---|" + ("---|" if parts else "") + "---|---|---|---|---|"
             + "---|---|" * len(extra) + "---|---|"]
    for c in result["cases"]:
        med, lim = c["median_us"], c["limit_us"]
        tri_name, tri = best_of(med, "triton")
        cell = lambda v: f"{v:.1f} ({lim / v:.2f})" if v else "-"  # noqa: E731
        tag = lambda n, p: f" {config_tag(n, p)}" if config_tag(n, p) else ""  # noqa: E731
        gm = med.get("grouped_mm")
        ratio = f"{tri / med['engine']:.2f}x" if tri else "-"
        rate = f" {c['read_gbs']:.0f} |" if parts else ""
        line = (f"| {c['mode']} | {c['size']} | {c['skew']:.1f} | {c['touched']} |{rate} {lim:.1f} | "
                f"{cell(med['engine'])} | {cell(tri)}{tag(tri_name, 'triton')} | {cell(gm)} | {ratio} |")
        for p in extra:
            name, best = best_of(med, p)
            line += (f" {cell(best)}{tag(name, p)} | {best / med['engine']:.2f}x |" if best else " - | - |")
        name, best = best_of(med, PEER_FAMILIES)
        line += f" {peer_label(name)} | {best / med['engine']:.2f}x |" if best else " - | - |"
        lines.append(line)
    for name, desc in result.get("peers", {}).items():
        lines.append(f"\n{name}: " + "; ".join(f"{k} {v}" for k, v in desc.items()))
    for peer in ("triton", "marlin", "trtllm", "fi90"):
        if result.get(f"{peer}_error"):
            lines.append(f"\n{peer}: not run: {result[f'{peer}_error']}")
    variants = sorted({k for c in result["cases"] for k in c["median_us"] if k.startswith("engine_")})
    if variants:  # the --tactics variants, each over the call's default, against the default
        lines += ["", "Engine tactics (each over the call's default tactic), us (time / default):", "",
                  "| mode | size | skew | default us | " + " | ".join(v[len("engine_"):] for v in variants) + " |",
                  "|---|---|---|---|" + "---|" * len(variants)]
        for c in result["cases"]:
            med = c["median_us"]
            cells = [f"{med[v]:.1f} ({med[v] / med['engine']:.2f})" if v in med else "-" for v in variants]
            lines.append(f"| {c['mode']} | {c['size']} | {c['skew']:.1f} | {med['engine']:.1f} | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser()
    experts_arguments(ap, out="experts_table.json", reps=30, dep_tokens="1,2,4,8,16,32,64",
                      wide_rows="65,128,256,512,1024")
    ap.add_argument("--skews", default="0,1.0")
    ap.add_argument("--wide-skews", default="0",
                    help="the TP8 rank's routing skews (default uniform only)")
    ap.add_argument("--peers", default="triton,marlin,trtllm,fi90,grouped_mm")
    ap.add_argument("--windows", default="auto")
    ap.add_argument("--tactics", default="",
                    help="extra engine tactics, e.g. 'ring=6;warps=8,mtiles=1;wgmma=1,windows=4' "
                         "(windows=N sets that variant's window count: 1, 2 or 4)")
    ap.add_argument("--merge", nargs="+", metavar="RESULT",
                    help="join these result JSONs of one device and tree (each a part of one "
                         "table: merge_runs) into --out and print its markdown; no run")
    args = ap.parse_args(argv)
    if rendered(args, render):
        return
    if args.merge:
        runs = []
        for path in args.merge:
            with open(path) as f:
                runs.append(json.load(f))
        merged = merge_runs(runs)
        with open(args.out, "w") as f:
            json.dump(merged, f, indent=1)
        print(render(merged), end="")
        return

    from fast.experts import ExpertsEngine, prepare_experts

    flush, t0, result, w = start_run()
    peers = [p for p in args.peers.split(",") if p]
    triton, triton_compact = None, True
    if "triton" in peers:
        try:
            from benchmarks.peers import triton_moe

            ok, why = triton_moe.available()
            triton = triton_moe if ok else None
            if not ok:
                print("triton_kernels unavailable:", why)
            else:  # the weight conversion and both layouts are right before anything is timed
                for nw in (4, 8):
                    print(f"triton check_fc1 num_warps={nw}:", triton_moe.check_fc1(num_warps=nw)["ok"], flush=True)
                    res = triton_moe.check_forward(num_warps=nw, layout="compact", raise_on_fail=False)
                    result.setdefault("triton_compact_checks", []).append(res)
                    print(f"triton compact check_forward num_warps={nw}:", res["ok"], flush=True)
                    triton_compact = triton_compact and res["ok"]
                if not triton_compact:
                    result["triton_compact_error"] = "compact tiny-problem checks failed (compact not timed)"
        except Exception as error:  # reported in the table, not hidden
            print("triton_kernels import failed:", repr(error))
            result["triton_error"] = repr(error)
    marlin = marlin_setup(peers, result)
    trtllm = trtllm_setup(peers, result)
    fi90 = fi90_setup(peers, result)

    def run_mode(mode, first, count, shard, sizes, skews):
        prepared = prepare_experts(w, "cuda", experts=(first, count), shard=shard)
        per_expert = prepared.expert_bytes()
        max_rows = max(sizes) * (16 if mode == "dep16" else 1)
        engine = ExpertsEngine(prepared, max_rows=max_rows)
        inter = I // shard[1]
        lo = shard[0] * inter
        peers_built = {}
        if triton is not None:
            try:
                moes, _ = triton.rank_moes(w, first, count, shard)
                peers_built.update({f"triton_w{nw}": (lambda x, ids, rw, case, moe=moe: moe(x, ids, rw))
                                    for nw, moe in moes.items()})
                if triton_compact:
                    peers_built.update({f"triton_compact_w{nw}": (
                        lambda x, ids, rw, case, moe=moe: moe(
                            x, ids, rw, layout="compact", capacity=max(1, case["local_rows"]),
                            pairs=case["pairs"])) for nw, moe in moes.items()})
                if moes:
                    result.setdefault("peers", {})["triton"] = {
                        "weights": "HopperMXValueLayout / HopperMXScaleLayout (triton_kernels API "
                                   f"{triton.API_VERSION})",
                        "layout": ("best of owner (the R received rows routed, BLOCK_M hint R K / E) and "
                                   "compact (the rows with a local pair gathered, their count from the host, "
                                   "BLOCK_M hint P / count) per case" if triton_compact
                                   else "owner (compact failed its checks)"),
                        "num_warps": "best of " + "/".join(f"{nw}" for nw in moes) + " per case",
                        "activation": "SwiGLU fused into FC1", "split_k": 1, "block_m": "heuristic"}
            except Exception as error:  # reported, not hidden
                print(f"triton build failed: {error!r}", flush=True)
        if marlin is not None:
            peers_built.update(marlin_peers(marlin, w, first, count, shard, result))
        mx = {}  # the case's MXFP8 inputs, for the trtllm peer that takes them as the engine does
        if trtllm is not None:
            peers_built.update(trtllm_peers(trtllm, w, first, count, shard, result, mx))
        if fi90 is not None:
            peers_built.update(fi90_peers(fi90, w, first, count, shard, result))
        if "grouped_mm" in peers:
            from model.formats import dequantize_mxfp4

            w13b = torch.stack([torch.cat([
                dequantize_mxfp4(w.w13[e, lo:lo + inter], w.w13_scales[e, lo:lo + inter]),
                dequantize_mxfp4(w.w13[e, I + lo:I + lo + inter], w.w13_scales[e, I + lo:I + lo + inter]),
            ]).bfloat16() for e in range(first, first + count)])
            w2b = torch.stack([dequantize_mxfp4(w.w2[e, :, lo // 2:(lo + inter) // 2],
                                                w.w2_scales[e, :, lo // 32:(lo + inter) // 32]).bfloat16()
                               for e in range(first, first + count)])
            gm = GroupedMM(w13b, w2b, first, count)
            peers_built["grouped_mm"] = lambda x, ids, rw, case, gm=gm: gm(x, ids, rw)
            result.setdefault("peers", {})["grouped_mm"] = {
                "layout": "BF16-resident weights (dequantized once), rows sorted by expert",
                "activation": "SiTU in PyTorch ops"}
        for skew in skews:
            for size in sizes:
                inputs = rank_case(mode, size, skew, first, count, per_expert,
                                   result["read_gbs"])
                rows, ids, x = inputs["rows"], inputs["ids"], inputs["x"]
                codes, scales, limit_us = inputs["codes"], inputs["scales"], inputs["limit_us"]
                touched = inputs["touched"]
                mx.update(codes=codes, scales=scales)
                rw = torch.rand(rows, K, device="cuda") + 0.01
                rw = rw / rw.sum(1, keepdim=True)
                case = {"mode": mode, "size": size, "rows": rows, "skew": skew,
                        "pairs": inputs["pairs"], "local_rows": inputs["local_rows"], "touched": touched,
                        "max_pairs": inputs["max_pairs"], "bytes": inputs["bytes"],
                        "limit_us": limit_us, "times": {}}
                out = torch.empty(rows * K, L, dtype=torch.bfloat16, device="cuda")
                win = None if args.windows == "auto" else int(args.windows)
                engine(codes, scales, ids, out=out, windows=win)  # validate once
                case["times"]["engine"] = device_time_us(
                    lambda: engine(codes, scales, ids, out=out, windows=win, validate=False),
                    reps=args.reps, flush=flush)
                for spec in [t for t in args.tactics.split(";") if t]:
                    tac = parse_tactic(spec)
                    # a spec may set the windows too: 'wgmma=1,windows=4'
                    spec_win = tac.pop("windows", win)
                    # over the call's default tactic (engine.default_tactic's rules)
                    tac = engine.default_tactic(rows, spec_win, over=tac)
                    engine(codes, scales, ids, out=out, windows=spec_win, tactic=tac)  # validated
                    case["times"]["engine_" + spec.replace("=", "").replace(",", "_")] = device_time_us(
                        lambda: engine(codes, scales, ids, out=out, windows=spec_win,
                                       validate=False, tactic=tac), reps=args.reps, flush=flush)
                for name, peer in peers_built.items():
                    try:
                        case["times"][name] = device_time_us(lambda: peer(x, ids, rw, case), reps=args.reps,
                                                             flush=flush)
                    except Exception as error:
                        case.setdefault("errors", {})[name] = repr(error)
                        print(f"{name} failed at {mode} {size}: {error!r}", flush=True)
                med = {k: statistics.median(v) for k, v in case["times"].items()}
                case["median_us"] = med
                case["best"] = {p: best_of(med, p)[0] for p in ("triton", "marlin", "trtllm", "fi90")
                                if best_of(med, p)[0]}
                if case["best"]:  # the fastest peer of all, in its best layout and configuration
                    case["best"]["peer"] = min(case["best"].values(), key=med.get)
                if marlin is not None:
                    case["marlin_vllm_block_size_m"] = marlin_vllm_pick(rows, count)
                line = (f"{mode:5s} size {size:5d} skew {skew:3.1f} touched {touched:4d} "
                        f"max {inputs['max_pairs']:4d} limit {limit_us:7.1f}us")
                for k, v in med.items():
                    line += f" | {k} {v:7.1f}us ({limit_us / v:4.2f})"
                print(line, flush=True)
                result["cases"].append(case)

    skews = {"dep16": [float(s) for s in args.skews.split(",")],
             "tp8": [float(s) for s in args.wide_skews.split(",")]}
    run_ranks(args, lambda mode, *rank: run_mode(mode, *rank, skews[mode]), result, t0)


if __name__ == "__main__":
    main()
