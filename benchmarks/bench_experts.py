"""GPU timings of the routed-experts engine (``fast.experts``) at the real dimensions, beside
OpenAI's ``triton_kernels`` MXFP4 MoE on the same weights and routing, for the regression
history (``make bench``). ``benchmarks/experts_table.py`` is the fuller comparison (every
batch, skewed routing, ``torch._grouped_mm``, tactics); these cases are the few that a
change to the engine must not slow down:

* ``dep16``: one DEP16 owner (local experts ``[0, 56)``) over ``16 T`` received rows, T = 1,
  16, 64 (one, two and three windows of tokens per expert);
* ``tp8``: one TP8 rank (all 896 experts, intermediate slice ``[0, 384)``), 65 and 1024 rows.

Uniform routing (``verify.cases.routing``, the seed fixed per case), random MXFP4 codes with
scale codes 118..124 (the session's ``kimi_weights``, ``benchmarks/conftest.py``). The
engine's call (routing lists, plan, the fused FC1/FC2 grid) is captured in a CUDA graph
and ``graph.replay`` timed
(``benchmarks/README.md``: a multi-launch callable is timed as a graph). ``bytes`` is the
touched experts' bytes (their weights and scales, this rank's slice), the traffic a call
must stream; ``peers["triton_kernels"]`` is the faster of ``num_warps`` 4 and 8, timed the
same way, where ``triton_kernels`` runs (``.gpu/peers`` on ``PYTHONPATH``; its absence is
stated in ``peers_skipped``).

    make bench                                           # every GPU case, saved and compared
    python -m pytest benchmarks/bench_experts.py --benchmark-json=out.json   # these alone
"""

from __future__ import annotations

import pytest
import torch

from benchmarks import gpu_timing
from benchmarks.peers import triton_moe

#: mode -> (first local expert, local experts, intermediate shard, batches)
MODES = {"dep16": (0, 56, (0, 1), (1, 16, 64)), "tp8": (0, 896, (0, 8), (65, 1024))}
CASES = [(mode, size) for mode, (*_, sizes) in MODES.items() for size in sizes]
_STATE: dict = {}


def _mode(mode: str, w):
    """(engine, triton peers or None, why not) of ``mode``, built once; the other mode's
    are dropped first (device memory)."""
    if _STATE.get("mode") != mode:
        from fast.experts import ExpertsEngine, prepare_experts

        _STATE.pop("built", None)
        torch.cuda.empty_cache()
        first, count, shard, sizes = MODES[mode]
        prepared = prepare_experts(w, "cuda", experts=(first, count), shard=shard)
        rows = max(sizes) * (16 if mode == "dep16" else 1)
        engine = ExpertsEngine(prepared, max_rows=rows)
        peers, why = triton_moe.rank_moes(w, first, count, shard)
        _STATE.update(mode=mode, built=(engine, peers, why))
    return _STATE["built"]


@gpu_timing.device_timed
@pytest.mark.parametrize("mode,size", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_experts(benchmark, mode, size, copy_gbs, kimi_weights):
    """The engine's device time (statistics) and triton_kernels' best (``peers``)."""
    from benchmarks.experts_table import capture_graph
    from reference.mx import quantize_mxfp8
    from verify import cases

    engine, triton, why_not = _mode(mode, kimi_weights)
    c = engine.config
    first, count, _, _ = MODES[mode]
    rows = size * 16 if mode == "dep16" else size
    ids = cases.routing(c, rows, 1000 + rows).cuda()
    x = (torch.randn(rows, c.latent, generator=torch.Generator().manual_seed(rows)) * 2)
    x = x.bfloat16().cuda()
    weights = torch.full((rows, c.top_k), 1.0 / c.top_k, device="cuda")
    codes, scales = quantize_mxfp8(x)
    out = torch.empty(rows * c.top_k, c.latent, dtype=torch.bfloat16, device="cuda")
    engine(codes, scales, ids, out=out)  # compiled, and its routing validated
    replay = capture_graph(lambda: engine(codes, scales, ids, out=out, validate=False))
    flat = ids.reshape(-1).long()
    touched = int(torch.unique(flat[(flat >= first) & (flat < first + count)]).numel())
    peers = {}
    if triton:
        peers["triton_kernels"] = min(
            gpu_timing.median_device_us(capture_graph(lambda: moe(x, ids, weights)), reps=20)
            for moe in triton.values())
    fast_us = gpu_timing.measure(benchmark, replay)
    engine.check()
    info = gpu_timing.bandwidth_info(
        stage="experts", variant=mode, batch=size,
        nbytes=touched * engine.prepared.expert_bytes(), device_us=fast_us,
        copy_gbs=copy_gbs, peers=peers)
    info["touched_experts"] = touched
    if why_not:
        info["peers_skipped"] = {"triton_kernels": why_not}
    benchmark.extra_info.update(info)
