"""GPU timings of one rank's whole layer step under the two GPU schedules, at the real
dimensions, beside the stock composition of the same rank, for the regression history
(``make bench``). The tables (``benchmarks/dep_table.py``, ``benchmarks/wide_table.py``)
are the fuller runs (every batch, every stage alone, the byte limit at the read bandwidth);
these cases are the few that a change to a schedule or to a kernel in it must not slow:

* ``dep``: rank 0 of ``fast.schedules.dep.DepLayer`` over 16 virtual ranks (56 local
  experts; its dense part with the router and the shared expert on the side stream, its
  dispatch, experts over the ``16 T`` rows it received, partial finalize, combine, RMSNorm
  and up-projection), T = 1 and 64 tokens per rank;
* ``wide``: rank 0 of ``fast.schedules.wide.WideLayer`` over 8 virtual TP ranks (the
  shared expert beside the experts, the layer's default), 65 and 1024 rows; its mailbox is
  restored before every round (outside the measured region) as every rank's publish
  leaves it, and its routing-list counters zeroed.

The other ranks' buffers come from one full call of the layer (``benchmarks.dep_table`` and
``benchmarks.wide_table`` set them up the same way). Each rank step is captured in a CUDA
graph and ``graph.replay`` timed. ``bytes`` is the rank's dense weight slices plus its
slice of every expert its rows touch (the tables' byte limit); ``peers["stock"]`` is the
stock composition of the same rank (cuBLAS GEMMs, PyTorch ops, one-copy gathers and FP32
sums for the collectives, triton_kernels' faster of ``num_warps`` 4 and 8 for the
experts), timed the same way where ``triton_kernels`` runs (else ``peers_skipped`` says
why).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks import gpu_timing
from benchmarks.peers import triton_moe

DEP_TOKENS, DEP_RANKS = (1, 64), 16
WIDE_ROWS, WIDE_RANKS = (65, 1024), 8
_STATE: dict = {}


def _layer(kind: str, w):
    """The ``kind`` layer, built once (the other kind's dropped first: device memory)."""
    if _STATE.get("kind") != kind:
        _STATE.pop("layer", None)
        torch.cuda.empty_cache()
        if kind == "dep":
            from fast.schedules.dep import DepLayer

            layer = DepLayer(w, ranks=DEP_RANKS, max_tokens=max(DEP_TOKENS))
        else:
            from fast.schedules.wide import WideLayer

            layer = WideLayer(w, ranks=WIDE_RANKS, max_rows=max(WIDE_ROWS))
        _STATE.update(kind=kind, layer=layer)
    return _STATE["layer"]


def _record(benchmark, *, schedule, batch, nbytes, fast_us, copy_gbs, stock_us, why_not,
            touched):
    info = gpu_timing.bandwidth_info(schedule=schedule, batch=batch, nbytes=nbytes,
                                     device_us=fast_us, copy_gbs=copy_gbs,
                                     peers={"stock": stock_us} if stock_us else {})
    info["touched_experts"] = touched
    if why_not:
        info["peers_skipped"] = {"stock": why_not}
    benchmark.extra_info.update(info)


@gpu_timing.device_timed
@pytest.mark.parametrize("tokens", DEP_TOKENS)
def test_dep_rank(benchmark, tokens, copy_gbs, kimi_weights):
    """A DEP16 rank's step (statistics) and the stock composition's (``peers``)."""
    from benchmarks import dep_table
    from benchmarks.experts_table import capture_graph

    layer = _layer("dep", kimi_weights)
    c = layer.config
    g = torch.Generator().manual_seed(tokens)
    xs = [torch.randn(tokens, c.hidden, generator=g).bfloat16().cuda() for _ in range(DEP_RANKS)]
    outputs = layer(xs)  # every rank's buffers; rank 0 then timed alone
    received = outputs[0].recv_ids
    touched = int(torch.unique(received[(received >= 0) & (received < layer.per)]).numel())
    nbytes = layer.dense.dense_bytes + touched * layer.engines[0].prepared.expert_bytes()
    moes, why_not = triton_moe.rank_moes(kimi_weights, 0, layer.per)
    stock_us = None
    if moes:
        times = []
        for moe in moes.values():
            stock = dep_table.StockRank(layer, moe, tokens, outputs)
            times.append(gpu_timing.median_device_us(capture_graph(lambda: stock(xs[0])),
                                                     reps=20))
        stock_us = min(times)
    replay = capture_graph(dep_table.fast_stages(layer, xs[0], tokens)["rank"])
    fast_us = gpu_timing.measure(benchmark, replay)
    layer.check()
    _record(benchmark, schedule="dep", batch=tokens, nbytes=nbytes, fast_us=fast_us,
            copy_gbs=copy_gbs, stock_us=stock_us, why_not=why_not, touched=touched)


@gpu_timing.device_timed
@pytest.mark.parametrize("rows", WIDE_ROWS)
def test_wide_rank(benchmark, rows, copy_gbs, kimi_weights):
    """A TP8 rank's step, the shared expert beside the experts (statistics), and the stock
    composition's (``peers``)."""
    from benchmarks import wide_table
    from benchmarks.experts_table import capture_graph

    layer = _layer("wide", kimi_weights)
    c = layer.config
    x = torch.randn(rows, c.hidden, generator=torch.Generator().manual_seed(rows))
    x = x.bfloat16().cuda()
    case, before = wide_table.published_case(layer, x, rows, read_gbs=1.0, flush=lambda: None)
    restore = before["rank_beside"]
    moes, why_not = triton_moe.rank_moes(kimi_weights, 0, c.experts, (0, WIDE_RANKS))
    stock_us = None
    if moes:
        stock = wide_table.StockRank(layer, next(iter(moes.values())), rows)
        times = []
        for moe in moes.values():
            stock.moe = moe
            times.append(gpu_timing.median_device_us(capture_graph(lambda: stock(x)), reps=20))
        stock_us = min(times)
    replay = capture_graph(wide_table.fast_stages(layer, x, rows)["rank_beside"], restore)
    fast_us = gpu_timing.measure(benchmark, replay, before=restore)
    wide_table.rearm_peers(layer)
    _record(benchmark, schedule="wide", batch=rows, nbytes=case["bytes"], fast_us=fast_us,
            copy_gbs=copy_gbs, stock_us=stock_us, why_not=why_not, touched=case["touched"])
