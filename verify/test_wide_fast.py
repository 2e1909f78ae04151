"""Contracts of the fast S2 layer (``fast.schedules.wide.WideLayer``) over virtual ranks on
one GPU: each stage of every rank against the reference stage on *that rank's own inputs*
(``reference.schedules.wide`` defines what a rank computes and in which order).

| stage | contract |
|---|---|
| front (FP32 out), shared gate/up, shared partial | on cuBLAS within the FP32-accumulated GEMM bound of the exact product; on fast.gemm within ``mma_matmul_bound`` at its K split and bitwise = the same GEMM alone (the default layer: the front on fast.gemm, the others on cuBLASLt without split-K) |
| shared SiTU | bitwise = the activation kernel's emulation on own gate/up |
| mailbox (after the publishes) | every rank's words bitwise = each writer's own front: logits' FP32 bits, the latent's RNE BF16, ``-0`` stored as ``+0`` (``reference.schedules.mailbox.sanitize_negative_zero``); rows at and beyond T and the other buffer armed |
| polled logits, latent | bitwise = those words (every writer's shard in its columns) |
| ids, weights | bitwise = the router's emulation on own polled logits |
| plan rows (MXFP8) | bitwise = ``reference.mx.quantize_mxfp8(own polled latent)`` |
| routing lists | counts bitwise = the histogram of own ids; each expert's list, sorted, bitwise = ``reference.schedules.wide.routing_lists`` (the engine's slot claims are atomics: their order is free and changes no bit) |
| expert rows | bitwise = the rank's engine run alone on its own plan rows (the engine's own bounds are ``test_experts.py``'s) |
| routed partial | bitwise = ``reference.finalize.finalize(own rows, own weights)`` |
| latent all-reduce | bitwise = ``ordered_sum_bf16`` of every rank's partial (FP32, rank order, one BF16 rounding) |
| normed | bitwise = the RMSNorm kernel's emulation on own routed |
| up columns | within the two-rounding bound of cuBLAS's BF16 ``addmm`` on own shared columns and normed |
| out | bitwise = ``ordered_sum_bf16`` of every rank's hidden partial (own shared with own up columns), the same on every rank |
| mailbox after a call | every word of both buffers of every rank armed again |
| state | two consecutive calls on other inputs through the same buffers (the second with every output buffer poisoned first), a third equal to the first bit for bit |
| late writer | polls launched before the publishes (another stream, behind a spin) wait and return the writers' words |
| timeout | a reader whose writer never arrives records the error and ends; ``check`` raises naming the rank, buffer, token, column and the writer |
| CUDA graph, stream orders | replays (both mailbox buffers, interleaved with eager calls) and the side stream (plain, delayed by a spin) bitwise equal to the serialized eager call |
| a bad token | one row NaN, infinite or overflowing (``verify.isolation``): the call completes and every other row's every token stage on every rank is bitwise as with its ordinary row |
| bad input | rows outside 65..max_rows, a rank count that does not match, a wrong dtype: a clear error before any launch |
| batch invariance (``batch_invariant=True``, the default; ``invariant_gemms`` ``"stock"`` and ``"fast"``) | the GEMMs on fast.gemm pass the stage contracts (``mma_matmul_bound`` at their K split, bitwise = the same GEMM alone); each token's every stage output on every rank (front, logits, latent, ids, weights, plan rows, expert rows, partial, routed, normed, shared gate/up, SiTU, shared, up columns, out) at row counts on both sides of every tactic and token-chunk edge bitwise = the same token in the largest batch; TP 2, 4 (small), 8, 16 (small, S = I = 1024) and TP8 at the real widths (65 to 1023 rows against 1024) |
| serial splits (``invariant_serial_from``) | every stage of every rank bitwise the cross-CTA split layer's at 65..256 rows, and batch invariant across the switch |
| MMAs in flight (``invariant_overlap``) | every stage of every rank bitwise the same layer's without it at 65..256 rows (with serial splits from 129), and batch invariant |
| per-GEMM forms (``invariant_forms``) | every stage of every rank bitwise the same layer's without them at 65..256 rows, and batch invariant across the forms' edges; ``invariant_forms="auto"`` (the default: the measured TP8 table, tiled kernel and clusters) at the real widths: every stage bitwise the layer without forms (``invariant_forms=None``) at 65..1024 rows and batch invariant against 1024 |
| 128-row token chunks (``invariant_chunk_windows=16``) | every stage of every rank bitwise the same layer's in 64-row chunks at 65..256 rows (serial splits from 129, MMAs in flight), and batch invariant |
| another process | the same batch-invariant layer, weights and rows in a second process: the same bits |
| 1000 graph replays | on changing inputs, every 50th (and the last) bitwise equal to an eager call |
| designed all-reduce orders | every rank's partials (latent) and hidden partials (shared, up columns) replaced by values of a wide dynamic range, at 4, 8 and 16 ranks, where the FP32 sum's order decides its bits: every rank's routed, normed and out bitwise = the rank-order sum (``ordered_sum_bf16``) and every other rank's; the reversed order differs on many elements (the inputs do expose the order) |
"""

from __future__ import annotations

import dataclasses
import functools
import time

import pytest
import torch

from fast.gemm.mma_kind import INVARIANT_MMAS
from fast.schedules.wide_gemms import INVARIANT_GEMMS
from model.config import LatentMoEConfig
from model.weights import LatentMoEWeights
from reference.schedules.mailbox import SENTINEL_BF16, SENTINEL_F32
from verify import caches, cases, isolation
from verify.compare import raw_bits
from reference.schedules.groups import ordered_sum_bf16
from verify.wide_fast_checks import ROWS, check_armed, check_wide_fast, published_words

pytestmark = [pytest.mark.gpu, pytest.mark.backends("fast")]

#: ``small`` with the routed intermediate widened to 1024, so that 8 and 16 TP ranks keep
#: the experts engine's 64-wide slices of it (``fast.schedules.wide.check_ranks``).
SMALL_I1024 = dataclasses.replace(LatentMoEConfig.small(), intermediate=1024)
#: ``SMALL_I1024`` with the shared expert widened to 1024 too, so that the shared
#: down-projection of 8 and 16 TP ranks keeps a K (``S / N``) that is a multiple of
#: fast.gemm's 64 (the batch-invariant mode, ``fast.schedules.wide_gemms``).
SMALL_S1024 = dataclasses.replace(SMALL_I1024, shared_intermediate=1024)


@functools.cache
def _weights(config_name: str) -> LatentMoEWeights:
    if config_name == "small":
        return cases.weights("small")
    if config_name == "kimi_k3":  # the real layer from the GPU generator
        return cases.device_weights("kimi_k3")
    if config_name == "small_i1024":
        return _device_weights(SMALL_I1024)
    if config_name == "small_s1024":
        return _device_weights(SMALL_S1024)
    raise KeyError(config_name)


def _device_weights(cfg: LatentMoEConfig, seed: int = 11) -> LatentMoEWeights:
    """``verify.cases.device_weights``' generator for a config that is not in
    ``cases.CONFIGS``: N(0, 1/fan_in) BF16 dense weights, router gate doubled, bias
    normal(0, 0.01), norm weight ``1 + normal(0, 0.1)``, MXFP4 experts of
    ``cases.mxfp4_expert_codes``, all drawn on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def normal(rows, cols, scale=1.0):
        return (torch.randn(rows, cols, generator=g, device="cuda") * scale / cols**0.5).bfloat16()

    gate = normal(cfg.experts, cfg.hidden, 2.0)
    front = normal(cfg.front_rows, cfg.hidden)
    shared_down = normal(cfg.hidden, cfg.shared_intermediate)
    up = normal(cfg.hidden, cfg.latent)
    bias = torch.randn(cfg.experts, generator=g, device="cuda") * 0.01
    latent_norm = (1 + 0.1 * torch.randn(cfg.latent, generator=g, device="cuda")).bfloat16()
    return LatentMoEWeights(gate=gate, bias=bias, front=front, shared_down=shared_down,
                            latent_norm=latent_norm, up=up, **cases.mxfp4_expert_codes(cfg, g),
                            config=cfg)


def _layer(config_name: str, ranks: int, max_rows: int, **kwargs):
    from fast.schedules.wide import WideLayer

    return WideLayer(_weights(config_name), ranks=ranks, max_rows=max_rows, device="cuda",
                     **kwargs)


def _fast_gemms_layer(config_name: str, ranks: int, max_rows: int, **kwargs):
    """The batch-invariant layer with all four GEMMs on fast.gemm
    (``invariant_gemms="fast"``), whose forms, MMA kinds and splits the cases below vary."""
    return _layer(config_name, ranks, max_rows, batch_invariant=True, invariant_gemms="fast",
                  **kwargs)


def _inputs(cfg: LatentMoEConfig, tokens: int, seed: int) -> torch.Tensor:
    return cases.hidden_rows(cfg, tokens, seed).cuda()


#: (config, ranks, tokens): every rank count the fast layer runs, the bucket's first row
#: count and a few inside it.
GRID = [("small", 1, 65), ("small", 2, 100), ("small", 4, 65), ("small", 4, 256),
        ("small_i1024", 8, 65), ("small_i1024", 16, 80)]


@pytest.mark.parametrize("batch_invariant", (True, False), ids=("default", "split_k"))
@pytest.mark.parametrize("config_name,ranks,tokens", GRID)
def test_wide_fast_stages(backend, config_name, ranks, tokens, batch_invariant, seed, contract):
    """Every stage of every rank, on the default layer (batch invariant: the front on
    fast.gemm, the other GEMMs on cuBLASLt without split-K) and with
    ``batch_invariant=False`` (the four GEMMs on cuBLAS, split-K allowed)."""
    layer = _layer(config_name, ranks, max(tokens, 128), batch_invariant=batch_invariant)
    x = _inputs(layer.config, tokens, seed)
    check_wide_fast(contract, layer, layer(x), x)
    check_armed(contract, layer, "after the call")


@pytest.mark.config("small")
def test_wide_fast_mailbox(backend, seed, contract):
    """The publish and the poll alone, on fronts holding the sentinels' values: FP32 -0
    logits, BF16 -0 latent values and negative FP32 values that round to BF16 -0. After
    every rank published, each mailbox holds every writer's words (``-0`` as ``+0``) in
    rows ``[0, T)`` of the call's buffer and nothing else; the polls return exactly those
    words and re-arm every slot they read."""
    ranks, tokens = 4, 70
    layer = _layer("small", ranks, 96)
    c = layer.config
    width = c.experts // ranks + c.latent // ranks
    g = torch.Generator().manual_seed(seed)
    fronts = []
    for r in range(ranks):
        f = torch.randn(tokens, width, generator=g)
        f[::3, r] = -0.0                       # a logit -0
        f[1::3, -1 - r] = -0.0                 # a latent -0
        f[2::3, -2] = -1e-41                   # rounds to BF16 -0
        f[2::3, 1] = -1e-41                    # a tiny logit stays itself
        fronts.append(f)
    index = layer.mailbox_index
    for r in range(ranks):
        layer.publish_stage(r, fronts[r].cuda(), tokens)
    want_latent, want_logits = published_words(layer, fronts)
    assert not bool((want_latent == SENTINEL_BF16).any()) and \
        not bool((want_logits == SENTINEL_F32).any())
    for r, box in enumerate(layer.mailboxes):
        box = box.cpu()
        current = box[index]
        contract.bitwise(current[:tokens, :c.latent], want_latent,
                         what=f"rank {r} mailbox latent words", index_names=ROWS)
        contract.bitwise(current[:tokens, c.latent:].contiguous().view(torch.int32), want_logits,
                         what=f"rank {r} mailbox logit words", index_names=ROWS)
        rest = current[tokens:]
        contract.bitwise(rest[:, :c.latent], torch.full_like(rest[:, :c.latent], SENTINEL_BF16),
                         what=f"rank {r} rows >= T armed (latent)", index_names=ROWS)
        rest_logits = rest[:, c.latent:].contiguous().view(torch.int32)
        contract.bitwise(rest_logits, torch.full_like(rest_logits, SENTINEL_F32),
                         what=f"rank {r} rows >= T armed (logits)", index_names=ROWS)
        other = box[1 - index]
        contract.bitwise(other[:, :c.latent], torch.full_like(other[:, :c.latent], SENTINEL_BF16),
                         what=f"rank {r} other buffer armed", index_names=ROWS)
    for r in range(ranks):
        layer.route_stage(r, tokens)
    layer.check()
    for r in range(ranks):
        polled = layer.outputs(r, tokens)
        contract.bitwise(polled.logits.cpu().view(torch.int32), want_logits,
                         what=f"rank {r} polled logits", index_names=ROWS)
        contract.bitwise(polled.latent.cpu().view(torch.int16), want_latent,
                         what=f"rank {r} polled latent", index_names=ROWS)
    check_armed(contract, layer, "after the polls")
    for r in range(ranks):  # the route stages' routing-list appends are consumed
        layer.experts_stage(r, tokens)
    layer.check()
    x = _inputs(c, tokens, seed)  # the layer is whole again: a full call passes
    check_wide_fast(contract, layer, layer(x), x)


@pytest.mark.config("small")
def test_wide_fast_late_writer(backend, seed, contract):
    """The poll waits for its writers: every rank's poll is launched on one stream while
    the publishes wait behind a spin of about 25 ms on another, so the polls start on
    empty slots (on one stream a poll always finds its row complete). The polled rows must
    be every writer's words, the slots re-armed, no error recorded."""
    ranks, tokens = 2, 65
    layer = _layer("small", ranks, 96)
    x = _inputs(layer.config, tokens, seed)
    layer(x)  # every kernel compiled: the launches below follow each other closely
    fronts = [layer.front_stage(r, x) for r in range(ranks)]
    torch.cuda.synchronize()
    reader, writer = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(writer):
        torch.cuda._sleep(50_000_000)
    with torch.cuda.stream(reader):
        for r in range(ranks):
            layer.route_stage(r, tokens)
    with torch.cuda.stream(writer):
        for r in range(ranks):
            layer.publish_stage(r, fronts[r], tokens)
    torch.cuda.synchronize()
    layer.check()
    want_latent, want_logits = published_words(layer, [f.cpu() for f in fronts])
    for r in range(ranks):
        polled = layer.outputs(r, tokens)
        contract.bitwise(polled.logits.cpu().view(torch.int32), want_logits,
                         what=f"rank {r} polled logits of late writers", index_names=ROWS)
        contract.bitwise(polled.latent.cpu().view(torch.int16), want_latent,
                         what=f"rank {r} polled latent of late writers", index_names=ROWS)
    check_armed(contract, layer, "after the late writers")


@pytest.mark.config("small")
def test_wide_fast_route_without_experts(backend, seed, contract):
    """A route stage whose experts stage never ran leaves its pairs in the engine's routing
    lists; the next call's plan kernel finds more pairs than the call has, computes
    nothing (every expert row keeps its poison), re-arms the lists, and the call raises
    ``EngineError`` naming the stale lists; the call after it passes every contract, and
    so does one after a route stage whose appends ``reset`` dropped."""
    from fast.experts.engine import EngineError

    ranks, tokens = 2, 70
    layer = _layer("small", ranks, 96)
    x = _inputs(layer.config, tokens, seed)
    layer(x)
    for r in range(ranks):
        layer.publish_stage(r, layer.front_stage(r, x), tokens)
    for r in range(ranks):
        layer.route_stage(r, tokens)  # no experts stage follows
    layer.check()
    for r in range(ranks):
        layer.outputs(r, tokens).rows.fill_(float("nan"))
    pairs = tokens * layer.config.top_k
    with pytest.raises(EngineError, match=rf"WideLayer rank 0 \(and on 1 other rank\(s\)\): "
                                          rf"ExpertsEngine: the routing lists held \d+ pairs, "
                                          rf"more than the call's {pairs} \(rows x top_k\)"):
        layer(x)
    for r in range(ranks):
        rows = layer.outputs(r, tokens).rows
        poison = torch.full_like(rows, float("nan"))
        contract.bitwise(rows.view(torch.int16), poison.view(torch.int16),
                         what=f"rank {r}: no expert row written by a call with stale lists",
                         index_names=("pair", "column"))
    check_wide_fast(contract, layer, layer(x), x)
    check_armed(contract, layer, "after the stale lists")
    for r in range(ranks):
        layer.publish_stage(r, layer.front_stage(r, x), tokens)
    for r in range(ranks):
        layer.route_stage(r, tokens)
    layer.reset()  # drops the routes' appends
    check_wide_fast(contract, layer, layer(x), x)


@pytest.mark.config("small")
def test_wide_fast_two_calls(backend, seed, contract):
    """State across calls: call 1 on ``x1`` (100 rows), call 2 on ``x2`` (70 rows) with
    every output buffer of call 1 poisoned with NaN first (a stage that skipped a row would
    leave the poison), call 3 on ``x1`` again; each call checked stage by stage, the
    rotating buffers used 0, 1, 0 and re-armed after each call, call 3's output equal to
    call 1's bit for bit."""
    layer = _layer("small", 2, 128)
    x1, x2 = _inputs(layer.config, 100, seed), _inputs(layer.config, 70, seed + 1)
    first = layer(x1)
    assert [o.mailbox_index for o in first] == [0, 0]
    check_wide_fast(contract, layer, first, x1)
    check_armed(contract, layer, "after call 1")
    kept = [o.out.clone() for o in first]
    for o in first:
        for name in ("logits", "latent", "weights", "rows", "routed_partial", "routed",
                     "normed", "shared_gate_up", "shared_act", "shared", "up_columns", "out"):
            getattr(o, name).fill_(float("nan"))
        o.ids.fill_(-1)
    second = layer(x2)
    assert [o.mailbox_index for o in second] == [1, 1]
    check_wide_fast(contract, layer, second, x2)
    check_armed(contract, layer, "after call 2")
    third = layer(x1)
    assert [o.mailbox_index for o in third] == [0, 0]
    for r, o in enumerate(third):
        contract.bitwise(o.out, kept[r], what=f"rank {r} call 3 = call 1", index_names=ROWS)


@pytest.mark.config("small")
def test_wide_fast_poll_timeout(backend, seed, contract):
    """A reader whose writer never arrives: the poll gives up after the layer's timeout
    (50 ms here), the kernel ends, ``check`` raises naming the reader's rank, the buffer,
    the token and the missing writer; after ``reset`` the layer runs a call that passes
    every contract."""
    from fast.device.arrival import ArrivalTimeout

    tokens = 65
    layer = _layer("small", 2, 96, timeout_s=0.05)
    x = _inputs(layer.config, tokens, seed)
    started = time.monotonic()
    layer.route_stage(0, tokens)  # nobody published
    with pytest.raises(ArrivalTimeout, match=r"rank 0 timed out polling mailbox buffer 0: "
                                             r"token \d+, column \d+ .*written by rank [01]"):
        layer.check()
    elapsed = time.monotonic() - started
    assert elapsed < 30, f"a 50 ms poll timeout took {elapsed:.1f} s to surface"
    layer.reset()
    layer.publish_stage(0, layer.front_stage(0, x), tokens)  # rank 1 never publishes
    layer.route_stage(1, tokens)
    with pytest.raises(ArrivalTimeout, match=r"rank 1 timed out polling mailbox buffer 0: .*"
                                             r"(latent|logit) region written by rank 1\)") as error:
        layer.check()
    assert (error.value.rank, error.value.what, error.value.peer) == (1, "mailbox", 1)
    layer.reset()
    layer.check()  # the error record is cleared
    check_wide_fast(contract, layer, layer(x), x)
    check_armed(contract, layer, "after recovering")


@pytest.mark.config("small")
@pytest.mark.parametrize("ranks", (1, 4))
def test_wide_fast_graph_replay(backend, ranks, seed, contract):
    """Two CUDA graphs (one per mailbox buffer): four replays on new inputs, with an eager
    call between the second and the third (so the graphs swap buffers), each bitwise equal
    to an eager call on those inputs; the last replay passes every stage contract and
    leaves every mailbox armed."""
    tokens = 72
    layer = _layer("small", ranks, 96)
    static = _inputs(layer.config, tokens, seed)
    replay, _ = layer.graph(static)
    for i in range(1, 5):
        fresh = _inputs(layer.config, tokens, seed + 100 * i)
        static.copy_(fresh)
        outs = replay()
        torch.cuda.synchronize()
        layer.check()
        got = [o.out.clone() for o in outs]
        eager = layer(fresh.clone())
        for r in range(ranks):
            contract.bitwise(got[r], eager[r].out, what=f"replay {i} rank {r} out = eager",
                             index_names=ROWS)
        if i == 2:
            layer(fresh.clone())  # one more eager call: the next replay uses the other graph
    outs = replay()
    layer.check()
    check_wide_fast(contract, layer, outs, static)
    check_armed(contract, layer, "after the replays")


@pytest.mark.config("small")
def test_wide_fast_stream_orders(backend, seed, contract):
    """The side stream changes no bit: the shared expert serialized on one stream, on the
    side stream at each placement (front, beside the experts, at the tail), the same
    delayed by a spin (a missing wait would let the up-projection or the hidden
    all-reduce read the previous call's shared rows: each run follows one on other
    inputs), and graph replays of the side-stream order at each placement."""
    from fast.schedules.wide import SHARED_PLACEMENTS

    ranks, tokens = 4, 80
    layer = _layer("small", ranks, 96)
    x = _inputs(layer.config, tokens, seed)
    other = _inputs(layer.config, tokens, seed + 999)
    serial = [o.out.clone() for o in layer(x, order="serial")]
    runs = {}
    for shared in SHARED_PLACEMENTS:
        layer(other)
        runs[f"side {shared}, delayed"] = [o.out.clone() for o in layer(
            x, shared=shared, side_delay_cycles=2_000_000)]
        layer(other)
        runs[f"side {shared}"] = [o.out.clone() for o in layer(x, shared=shared)]
        layer(other)
        runs[f"serial {shared}"] = [o.out.clone() for o in layer(x, order="serial",
                                                                shared=shared)]
    for shared in SHARED_PLACEMENTS:
        static = other.clone()
        replay, _ = layer.graph(static, shared=shared)
        static.copy_(x)
        runs[f"graph replay {shared}"] = [o.out.clone() for o in replay()]
    layer.check()
    for name, got in runs.items():
        for r in range(ranks):
            contract.bitwise(got[r], serial[r], what=f"{name}: rank {r} out = serialized",
                             index_names=ROWS)


@functools.cache
def _real_tp8():
    return _layer("kimi_k3", 8, 1024)


@pytest.mark.config("kimi_k3")
@pytest.mark.parametrize("tokens", (65, 256, 1024))
def test_wide_fast_real_tp8(backend, tokens, seed, contract):
    """The real layer over 8 virtual TP ranks (every expert's 384-wide slice per rank),
    every stage of every rank, at the bucket's first row count, a middle one and its last."""
    layer = _real_tp8()
    x = _inputs(layer.config, tokens, seed)
    check_wide_fast(contract, layer, layer(x), x)
    check_armed(contract, layer, "after the call")


@pytest.mark.config("small")
def test_wide_fast_bad_input(backend, contract):
    """Refused with a clear error before any launch: the layer's call counter, error record
    and mailboxes are untouched."""
    layer = _layer("small", 2, 96)
    cfg = layer.config
    x = _inputs(cfg, 70, 0)
    with pytest.raises(ValueError, match=r"T=64 rows is below the wide layer's bucket \[65, 96\]"):
        layer(_inputs(cfg, 64, 0))
    with pytest.raises(ValueError, match=r"T=97 rows > max_rows=96"):
        layer(_inputs(cfg, 97, 0))
    with pytest.raises(ValueError, match="a list of 2 \\(one per rank\\), got a list of 3"):
        layer([x, x, x])
    with pytest.raises(ValueError, match="same T tokens"):
        layer([x, x[:66].contiguous()])
    with pytest.raises(ValueError, match=r"xs\[1\] must be BF16"):
        layer([x, x.float()])
    with pytest.raises(ValueError, match=r"xs\[0\] must be contiguous on cuda"):
        layer(x.cpu())
    with pytest.raises(ValueError, match="order must be"):
        layer(x, order="beside")
    with pytest.raises(ValueError, match="shared must be one of"):
        layer(x, shared="middle")
    assert layer.calls == 0, "a refused call advanced the mailbox rotation"
    assert not bool(layer.error.any()), "a refused call launched a poll"
    check_armed(contract, layer, "after the refused calls")
    with pytest.raises(ValueError, match="cannot split"):
        _layer("small", 8, 96)
    with pytest.raises(ValueError, match="batch_invariant must be a bool"):
        _layer("small", 2, 96, batch_invariant=1)
    with pytest.raises(ValueError, match="invariant_mma must be one of"):
        _fast_gemms_layer("small", 2, 96, invariant_mma="hmma")
    with pytest.raises(ValueError, match=r"K must be a multiple of 64; at 8 ranks shared_down "
                                         r"K=32"):
        _fast_gemms_layer("small_i1024", 8, 96)
    with pytest.raises(ValueError, match="invariant_gemms must be one of"):
        _layer("small", 2, 96, batch_invariant=True, invariant_gemms="cublas")


# -- batch invariance ----------------------------------------------------------------------

#: The stage outputs of a rank whose rows are the call's tokens (``WideRankOutputs``; the
#: routing lists, whose order is the engine's atomic claims, are checked as sets by the
#: stage contracts; ``rows`` are pairs ``t K + j``, so a token's rows lead as its index does).
TOKEN_STAGES = ("front", "logits", "latent", "weights", "ids", "codes", "scales", "rows",
                "routed_partial", "routed", "normed", "shared_gate_up", "shared_act", "shared",
                "up_columns", "out")


def _snapshot(out) -> dict:
    """Clones of one rank's token stages (the layer's buffers are reused by the next call)."""
    return {name: getattr(out, name).clone() for name in TOKEN_STAGES}


def launch_edges(layer, low: int, high: int) -> list[int]:
    """The row counts in ``[low, high)`` on both sides of every change of what a rank's
    GEMMs launch (tactic, token chunks, windows per chunk: ``WideLayer.gemm_plan``), plus
    ``low``: every tactic and chunk edge of the mode below the largest batch ``high``."""
    def signature(t):
        return tuple((name, l.tactic, l.chunks, l.windows) for name, l in
                     sorted(layer.gemm_plan(0, t).items()))

    edges = {low}
    for t in range(low + 1, high + 1):
        if signature(t) != signature(t - 1):
            edges |= {t - 1, t}
    return sorted(e for e in edges if e < high)


def check_wide_batch_invariant(contract, layer, x, batches) -> None:
    """The first ``t`` tokens of ``x`` decoded as a batch of ``t`` (each ``t`` of
    ``batches``) against the same tokens in the batch of ``T = len(x)``, bit for bit at
    every token stage (``TOKEN_STAGES``) of every rank."""
    k, top = layer.config.top_k, x.shape[0]
    want = [_snapshot(o) for o in layer(x)]
    for t in batches:
        outs = layer(x[:t].contiguous())
        for r, o in enumerate(outs):
            for name in TOKEN_STAGES:
                rows = t * k if name == "rows" else t
                contract.bitwise(raw_bits(getattr(o, name)), raw_bits(want[r][name][:rows]),
                                 what=f"rank {r} {name}: T={t} vs the same tokens at T={top}",
                                 index_names=("pair", "column") if name == "rows" else ROWS)


def check_same_token_stages(contract, layer, other, x, rows, what: str) -> None:
    """``layer`` and ``other`` (two wide layers that must give the same bits) on the first
    ``t`` rows of ``x`` for each ``t`` of ``rows``: every token stage (``TOKEN_STAGES``) of
    every rank bitwise equal."""
    for t in rows:
        xs = x[:t].contiguous()
        want = [{n: raw_bits(getattr(o, n)).clone() for n in TOKEN_STAGES} for o in other(xs)]
        for r, o in enumerate(layer(xs)):
            for name in TOKEN_STAGES:
                contract.bitwise(raw_bits(getattr(o, name)), want[r][name],
                                 what=f"rank {r} {name}: {what}, T={t}",
                                 index_names=("pair", "column") if name == "rows" else ROWS)


def _check_one_split_per_gemm(layer, low: int, high: int, mma: str = "mma.sync") -> None:
    """Every GEMM of every rank launches one K split and the layer's one MMA kind
    (``invariant_mma``) at every row count of the layer (the mode's design; a tile or chunk
    change is free to follow the batch)."""
    def split_and_kind(plan):  # a split-K launch, or a tiled form's TiledGemm (wgmma)
        if hasattr(plan, "tactic"):
            return plan.tactic.splits, plan.tactic.wgmma
        return plan.splits, True

    for r in layer.local_ranks:
        plans = [layer.gemm_plan(r, t) for t in range(low, high + 1)]
        assert set(plans[0]) == set(INVARIANT_GEMMS[layer.invariant_gemms])
        for name in plans[0]:
            assert len({split_and_kind(p[name])[0] for p in plans}) == 1, (r, name)
            assert {split_and_kind(p[name])[1] for p in plans} == {mma == "wgmma"}, \
                (r, name, mma)


def _skip_unless_mma_runs(mma: str) -> None:
    from fast.backend import gpu_arch

    if mma == "wgmma" and gpu_arch() != "sm_90a":
        pytest.skip(f"wgmma is an sm_90a instruction (invariant_mma='wgmma'); this GPU is "
                    f"{gpu_arch()}")


#: (config, ranks, largest batch) of the batch-invariance contracts at small widths: TP 2..16
BATCH_INVARIANT_GRID = [("small", 2, 256), ("small", 4, 256), ("small_s1024", 8, 200),
                        ("small_s1024", 16, 160)]


@pytest.mark.parametrize("mma", INVARIANT_MMAS)
@pytest.mark.parametrize("config_name,ranks,top", BATCH_INVARIANT_GRID)
def test_wide_fast_stages_batch_invariant(backend, config_name, ranks, top, mma, seed, contract):
    """``batch_invariant=True`` on each MMA kind: every stage of every rank at the bucket's
    first row count and the largest, the four GEMMs on fast.gemm within their bound and
    bitwise equal to the same GEMM alone (``verify.wide_fast_checks``)."""
    _skip_unless_mma_runs(mma)
    layer = _batch_invariant_layer(config_name, ranks, top, mma)
    assert layer.batch_invariant
    for tokens in (65, top):
        x = _inputs(layer.config, tokens, seed + tokens)
        check_wide_fast(contract, layer, layer(x), x)
        check_armed(contract, layer, f"after the call of {tokens} rows")


@functools.cache
def _batch_invariant_layer(config_name: str, ranks: int, max_rows: int, mma: str):
    return _fast_gemms_layer(config_name, ranks, max_rows, invariant_mma=mma)


@pytest.mark.parametrize("mma", INVARIANT_MMAS)
@pytest.mark.parametrize("config_name,ranks,top", BATCH_INVARIANT_GRID)
def test_wide_fast_batch_invariant(backend, config_name, ranks, top, mma, seed, contract):
    """``WideLayer(batch_invariant=True)`` on each MMA kind: the first ``t`` of ``top``
    random tokens decoded as a batch of ``t`` at every row count on both sides of every
    tactic and token-chunk edge of the GEMMs (and a few around the engine's windows), each
    token's every stage on every rank bitwise its bits in the batch of ``top``; then the
    design itself: one K split and one MMA kind per GEMM at every row count."""
    _skip_unless_mma_runs(mma)
    layer = _batch_invariant_layer(config_name, ranks, top, mma)
    low = layer.config.front_max + 1
    batches = sorted(set(launch_edges(layer, low, top)) | {66, 72, 73, 100, top - 1})
    assert len(batches) >= 8, batches  # the edges were found: the check is not vacuous
    x = _inputs(layer.config, top, seed)
    check_wide_batch_invariant(contract, layer, x, batches)
    _check_one_split_per_gemm(layer, low, top, mma)


@pytest.mark.parametrize("config_name,ranks,top", [("small", 2, 256), ("small_s1024", 8, 200)])
def test_wide_fast_stock_gemms_batch_invariant(backend, config_name, ranks, top, seed, contract):
    """``invariant_gemms="stock"`` (the front on fast.gemm, the shared expert's GEMMs and
    the up projection on cuBLASLt without split-K): every row count from 65 to ``top - 1``
    against ``top``, each token's every stage on every rank bitwise (cuBLAS may change its
    kernel at any row count, so every one is checked); then every stage contract at 65 and
    ``top`` rows (the cuBLAS GEMMs within their bound, the front bitwise fast.gemm alone)."""
    layer = _layer(config_name, ranks, top, batch_invariant=True, invariant_gemms="stock")
    assert layer.batch_invariant and set(layer.gemm_plan(0, 65)) == {"front"}
    x = _inputs(layer.config, top, seed)
    check_wide_batch_invariant(contract, layer, x, range(65, top))
    _check_one_split_per_gemm(layer, 65, top, layer.invariant_mma)
    for tokens in (65, top):
        xs = x[:tokens].contiguous()
        check_wide_fast(contract, layer, layer(xs), xs)


@pytest.mark.config("kimi_k3")
def test_wide_fast_real_tp8_stock_gemms_batch_invariant(backend, seed, contract):
    """The real layer over 8 virtual TP ranks with ``invariant_gemms="stock"``: 42 row
    counts from 65 to 1023 (a stride of 29 and both sides of 128, 256 and 512) against
    1024, every stage of every rank bitwise; then every stage contract at 65 rows. The
    planted bug that lets cuBLAS split K again must fail here."""
    layer = _real_tp8()  # the default layer is this mode
    assert layer.batch_invariant and layer.invariant_gemms == "stock"
    x = _inputs(layer.config, 1024, seed)
    rows = sorted(set(range(65, 1024, 29)) | {66, 128, 129, 256, 257, 512, 513, 1023})
    check_wide_batch_invariant(contract, layer, x, rows)
    _check_one_split_per_gemm(layer, 65, 1024, layer.invariant_mma)
    few = x[:65].contiguous()
    check_wide_fast(contract, layer, layer(few), few)


@pytest.mark.config("small")
def test_wide_fast_serial_splits_same_bits(backend, seed, contract):
    """``invariant_serial_from=129`` (from three token chunks on, each GEMM's K splits run
    one after another in each CTA, ``fast.gemm.Tactic.serial``): every stage of every rank
    bitwise the cross-CTA layer's at 65, 128, 129, 200 and 256 rows, and the layer still
    batch invariant across the switch (its first ``t`` tokens against its 256-row call)."""
    ranks, top = 4, 256
    cross = _batch_invariant_layer("small", ranks, top, "auto")
    serial = _fast_gemms_layer("small", ranks, top, invariant_serial_from=129)
    assert serial.invariant_mma == cross.invariant_mma
    for r in serial.local_ranks:
        assert not any(p.tactic.serial for p in serial.gemm_plan(r, 128).values())
        assert all(p.tactic.serial for p in serial.gemm_plan(r, 129).values())
    x = _inputs(serial.config, top, seed)
    check_same_token_stages(contract, serial, cross, x, (65, 128, 129, 200, top),
                            "serial splits vs cross-CTA")
    check_wide_batch_invariant(contract, serial, x, (65, 128, 129, 130, 200, top - 1))


@pytest.mark.config("small")
@pytest.mark.parametrize("mma", ("wgmma",))
def test_wide_fast_overlap_same_bits(backend, mma, seed, contract):
    """``invariant_overlap=True`` (each GEMM's warpgroup MMAs in flight across a stage,
    ``fast.gemm.Tactic.overlap``), with serial splits from 129 rows: every stage of every
    rank bitwise the same layer's without it at 65, 128, 129, 200 and 256 rows (the same
    MMAs in the same order), every GEMM launch with it, and batch invariant across those
    row counts."""
    _skip_unless_mma_runs(mma)
    ranks, top = 4, 256
    plain = _fast_gemms_layer("small", ranks, top, invariant_mma=mma,
                              invariant_serial_from=129)
    flying = _fast_gemms_layer("small", ranks, top, invariant_mma=mma,
                               invariant_serial_from=129, invariant_overlap=True)
    for r in flying.local_ranks:
        for t in (65, 129, top):
            assert all(p.tactic.overlap for p in flying.gemm_plan(r, t).values())
            assert not any(p.tactic.overlap for p in plain.gemm_plan(r, t).values())
    _check_same_bits_and_invariant(contract, flying, plain, seed, "MMAs in flight vs not")


def _check_same_bits_and_invariant(contract, layer, base, seed: int, what: str,
                                   edges=(200,)) -> None:
    """A launch-only variant of a small 256-row layer (``layer`` against ``base``, which
    differ in how their GEMMs launch, never in a K split or MMA kind): every stage of every
    rank bitwise ``base``'s at 65, 128, 129, 200 and 256 rows, and ``layer`` batch invariant
    across 65..255 rows with its ``edges``."""
    top = layer.max_rows
    x = _inputs(layer.config, top, seed)
    check_same_token_stages(contract, layer, base, x, (65, 128, 129, 200, top), what)
    check_wide_batch_invariant(contract, layer, x,
                               tuple(sorted({65, 128, 129, 200, top - 1, *edges})))


@pytest.mark.config("small")
@pytest.mark.parametrize("mma", ("wgmma",))
def test_wide_fast_wide_chunks_same_bits(backend, mma, seed, contract):
    """``invariant_chunk_windows=16`` (each GEMM's calls of more than 64 rows in 128-row
    token chunks, ``fast.gemm.Tactic.chunk_windows``), with serial splits from 129 rows and
    the MMAs in flight: every stage of every rank bitwise the same layer's in 64-row chunks
    at 65, 128, 129, 200 and 256 rows (an output's chain does not depend on its chunk), every
    GEMM launch in 128-row chunks, and batch invariant across those row counts."""
    _skip_unless_mma_runs(mma)
    ranks, top = 4, 256
    narrow = _fast_gemms_layer("small", ranks, top, invariant_mma=mma,
                               invariant_serial_from=129, invariant_overlap=True)
    wide = _fast_gemms_layer("small", ranks, top, invariant_mma=mma,
                             invariant_serial_from=129, invariant_overlap=True,
                             invariant_chunk_windows=16)
    for r in wide.local_ranks:
        for t in (65, 129, top):
            assert all(p.tactic.chunk_windows == 16 and p.chunks == -(-t // 128)
                       for p in wide.gemm_plan(r, t).values())
            assert all(p.tactic.chunk_windows == 8 for p in narrow.gemm_plan(r, t).values())
    _check_same_bits_and_invariant(contract, wide, narrow, seed, "128-row vs 64-row token chunks")


@pytest.mark.config("small")
@pytest.mark.parametrize("mma", ("wgmma",))
def test_wide_fast_forms_same_bits(backend, mma, seed, contract):
    """``invariant_forms`` (per GEMM and row count the default tactic's form: chunk width,
    serial splits, MMAs in flight): every stage of every rank bitwise the same layer's
    without forms at 65, 128, 129, 200 and 256 rows (a form is never the K split or the MMA
    kind), every launch in the form its table gives, and batch invariant across the forms'
    edges."""
    _skip_unless_mma_runs(mma)
    ranks, top = 4, 256
    forms = {"front": {129: {"chunk_windows": 16, "serial": True}},
             "shared_gate_up": {65: {"chunk_windows": 16, "overlap": True}},
             "shared_down": {200: {"serial": True}},
             "up": {65: {"serial": True}, 129: {"serial": False, "chunk_windows": 16}}}
    plain = _fast_gemms_layer("small", ranks, top, invariant_mma=mma)
    formed = _fast_gemms_layer("small", ranks, top, invariant_mma=mma,
                               invariant_forms=forms)
    for r in formed.local_ranks:
        front, up = formed.gemm_plan(r, 128)["front"], formed.gemm_plan(r, 128)["up"]
        assert not front.tactic.serial and front.tactic.chunk_windows == 8 and up.tactic.serial
        plan = formed.gemm_plan(r, 200)
        assert plan["front"].tactic.serial and plan["front"].tactic.chunk_windows == 16
        assert plan["shared_gate_up"].tactic.overlap and plan["shared_down"].tactic.serial
        assert not plan["up"].tactic.serial and plan["up"].tactic.chunk_windows == 16
    _check_same_bits_and_invariant(contract, formed, plain, seed, "per-GEMM forms vs none",
                                   edges=(199, 200))


@pytest.mark.config("small")
def test_wide_fast_tiled_forms_same_bits(backend, seed, contract):
    """Tiled forms (``invariant_forms`` entries ``{"tiled": {...}}``: those calls on
    ``fast.gemm.TiledGemm``, warpgroup MMA only) in the layer: every stage of every rank
    bitwise the same layer's without forms at 65, 128, 129, 200 and 256 rows, with each GEMM
    on another variant (128- and 64-token tiles, the split in order or one CTA per split,
    with and without a producer warp, in 2x2 clusters sharing operand stages by multicast)
    from another row count, the plan naming the tiled kernel where its form applies, and
    batch invariant across the forms' edges."""
    _skip_unless_mma_runs("wgmma")
    ranks, top = 4, 256

    def tiled(tokens, cross, producer, cluster=(1, 1)):
        return {"tiled": {"tile_tokens": tokens, "stages": 3, "cross": cross,
                          "producer": producer, "cluster": list(cluster)}}

    forms = {"front": {129: tiled(128, True, False)},
             "shared_gate_up": {65: tiled(64, False, True), 129: tiled(64, False, True, (2, 2))},
             "shared_down": {65: {"serial": True}, 200: tiled(64, True, True)},
             "up": {65: tiled(128, False, False), 129: {"chunk_windows": 16}}}
    plain = _fast_gemms_layer("small", ranks, top, invariant_mma="wgmma")
    formed = _fast_gemms_layer("small", ranks, top, invariant_mma="wgmma",
                               invariant_forms=forms)
    for r in formed.local_ranks:
        plan = formed.gemm_plan(r, 128)
        assert hasattr(plan["front"], "tactic") and plan["up"].label().startswith("tiled t128")
        plan = formed.gemm_plan(r, 200)
        assert plan["front"].label().startswith("tiled t128 s3")
        assert plan["shared_gate_up"].label().endswith("cluster 2x2")
        assert plan["shared_down"].label().startswith("tiled t64")
        assert plan["up"].tactic.chunk_windows == 16
    _check_same_bits_and_invariant(contract, formed, plain, seed, "tiled forms vs none",
                                   edges=(199, 200))


@pytest.mark.config("small")
def test_wide_fast_same_bits_in_another_process(backend, seed, contract, tmp_path):
    """The default S2 layer (4 virtual TP ranks, batch invariant, 129 rows: three token
    chunks) built again in a second process from the same weights: the polled logits, the
    routing, the shared expert and the output of every rank are the same bits there."""
    from verify.other_process import check_same_bits_as_another_process

    layer = _layer("small", 4, 256)
    outs = layer(_inputs(layer.config, 129, seed))
    check_same_bits_as_another_process(
        contract, outs,
        "from fast.schedules.wide import WideLayer\n"
        "layer = WideLayer(cases.weights('small'), ranks=4, max_rows=256, device='cuda')",
        f"layer(cases.hidden_rows(layer.config, 129, {seed}).cuda())",
        ("logits", "ids", "weights", "shared", "out"), tmp_path / "other_process.pt", ROWS)


@pytest.mark.config("small")
def test_wide_fast_graph_1000_replays(backend, seed, contract):
    """The layer's CUDA graphs (one per mailbox buffer) replayed 1000 times on changing
    inputs (a new batch copied in before each replay); every 50th replay, and the last,
    bitwise equal to an eager call on the same inputs, which also moves the graphs to the
    other mailbox buffer (no state drifts: mailboxes re-armed, tile counters re-armed, no
    stale scratch)."""
    ranks, tokens = 4, 100
    layer = _layer("small", ranks, 256)
    static = _inputs(layer.config, tokens, seed)
    replay, _ = layer.graph(static)
    pool = [_inputs(layer.config, tokens, seed + 1 + i) for i in range(8)]
    g = torch.Generator().manual_seed(seed)
    for i in range(1000):
        batch, other = pool[i % len(pool)], pool[(i * 3 + 1) % len(pool)]
        scale = float(torch.rand((), generator=g)) + 0.5
        static.copy_(torch.cat([batch[: tokens // 2], other[tokens // 2:]]) * scale)
        outs = replay()
        if i % 50 == 49 or i == 999:
            torch.cuda.synchronize()
            layer.check()
            got = [o.out.clone() for o in outs]
            eager = layer(static.clone())
            for r in range(ranks):
                contract.bitwise(got[r], eager[r].out,
                                 what=f"replay {i + 1} rank {r} out = eager", index_names=ROWS)
    layer.check()
    check_armed(contract, layer, "after 1000 replays")


@pytest.mark.config("kimi_k3")
@pytest.mark.parametrize("mma", INVARIANT_MMAS)
def test_wide_fast_real_tp8_batch_invariant(backend, mma, seed, contract):
    """The real layer over 8 virtual TP ranks with ``batch_invariant=True`` on each MMA
    kind: 65, 66, 128, 129, 257, 512, 513 and 1023 rows against 1024 (token chunks 2 to
    16, both 64- and 128-row tiles), every stage of every rank; then one call of 65 rows
    passes every stage contract (each GEMM on fast.gemm at the real widths, the TP8 front's
    560 rows padded to 576). On the warpgroup MMA the layer runs its default forms
    (``invariant_forms="auto"``: the tiled kernel); on ``mma.sync`` none."""
    _skip_unless_mma_runs(mma)
    caches.release(_real_tp8)  # one real TP8 layer at a time (an 80 GB card holds two, not three)
    layer = _fast_gemms_layer("kimi_k3", 8, 1024, invariant_mma=mma)
    x = _inputs(layer.config, 1024, seed)
    check_wide_batch_invariant(contract, layer, x, (65, 66, 128, 129, 257, 512, 513, 1023))
    _check_one_split_per_gemm(layer, 65, 1024, mma)
    few = x[:65].contiguous()
    check_wide_fast(contract, layer, layer(few), few)


@pytest.mark.config("kimi_k3")
def test_wide_fast_real_tp8_auto_forms_same_bits(backend, seed, contract):
    """``invariant_forms="auto"`` (the default) at the real widths (TP8 on sm_90a: the measured table,
    ``fast.schedules.wide_forms.TP8_FORMS``: the tiled kernel, one CTA per split up to 256
    rows, thread-block clusters from 257): every stage of every rank at 65, 128, 256, 257,
    512, 513 and 1024 rows bitwise the same layer's without forms (the split-K kernel), and
    the same tokens at 65, 66, 256, 257, 512, 513 and 1023 rows bitwise their rows at 1024
    (across every form's edge); one K split per GEMM at every row count."""
    _skip_unless_mma_runs("wgmma")
    caches.release(_real_tp8)  # one real TP8 layer on the card at a time
    rows = (65, 128, 256, 257, 512, 513, 1024)
    plain = _fast_gemms_layer("kimi_k3", 8, 1024, invariant_mma="wgmma",
                              invariant_forms=None)
    assert plain.invariant_forms is None
    x = _inputs(plain.config, 1024, seed)
    want = {}
    for t in rows:
        want[t] = [{n: raw_bits(getattr(o, n)).cpu() for n in TOKEN_STAGES}
                   for o in plain(x[:t].contiguous())]
    del plain
    torch.cuda.empty_cache()
    layer = _fast_gemms_layer("kimi_k3", 8, 1024, invariant_mma="wgmma")
    assert layer.invariant_forms is not None and "tiled" in layer.invariant_forms["front"][65]
    assert layer.gemm_plan(0, 600)["front"].label().endswith("cluster 1x4")
    for t in rows:
        for r, o in enumerate(layer(x[:t].contiguous())):
            for name in TOKEN_STAGES:
                contract.bitwise(raw_bits(getattr(o, name)).cpu(), want[t][r][name],
                                 what=f"rank {r} {name}: auto forms vs none, T={t}",
                                 index_names=("pair", "column") if name == "rows" else ROWS)
    check_wide_batch_invariant(contract, layer, x, (65, 66, 256, 257, 512, 513, 1023))
    _check_one_split_per_gemm(layer, 65, 1024, "wgmma")



@pytest.mark.parametrize("config_name,ranks", [("small", 4), ("small_i1024", 8),
                                               ("small_i1024", 16)])
def test_wide_fast_all_reduce_orders_designed(backend, config_name, ranks, seed, contract):
    """The two all-reduces on designed values (``verify.cases.cancelling_rank_values``: per
    element two ranks hold +-2^24, the others small values that the pair absorbs or not
    depending on the order: random partials of similar size often sum exactly whatever the
    order). After a call, every rank's routed partial is replaced and every rank's latent
    stage run alone: each rank's routed and normed rows bitwise the rank-order sum
    (``ordered_sum_bf16``) and its norm (the same on every rank); then every rank's hidden
    partial (its shared partial, its own columns in its up columns) is replaced and every
    hidden stage run: each rank's out bitwise the rank-order sum, the same on every rank.
    The reversed order differs from the rank order on at least half of the elements (the
    inputs do expose the order)."""
    from reference import emulation

    tokens = 70
    layer = _layer(config_name, ranks, 96)
    c = layer.config
    outs = layer(_inputs(c, tokens, seed))
    parts = cases.cancelling_rank_values(ranks, (tokens, c.latent), seed)
    for o, part in zip(outs, parts):
        o.routed_partial.copy_(part.to(o.routed_partial.device))
    for r in range(ranks):
        layer.latent_stage(r, tokens, wait_shared=False)
    layer.check()
    routed = ordered_sum_bf16(parts)
    assert int((raw_bits(routed) != raw_bits(ordered_sum_bf16(parts[::-1]))).sum()) >= routed.numel() // 2
    normed = emulation.rms_norm_tree(routed, layer.latent_norm.cpu(), c.rms_eps)
    for r, o in enumerate(outs):
        contract.bitwise(raw_bits(o.routed.cpu()), raw_bits(routed),
                         what=f"rank {r} latent all-reduce of designed partials (rank order)",
                         index_names=ROWS)
        contract.bitwise(raw_bits(o.normed.cpu()), raw_bits(normed),
                         what=f"rank {r} normed of the designed all-reduce", index_names=ROWS)
    hidden = cases.cancelling_rank_values(ranks, (tokens, c.hidden), seed + 1)
    for r, (o, part) in enumerate(zip(outs, hidden)):
        o.shared.copy_(part.to(o.shared.device))
        o.up_columns.copy_(part[:, r * layer.columns:(r + 1) * layer.columns].to(o.shared.device))
    for r in range(ranks):
        layer.hidden_stage(r, tokens)
    layer.check()
    out = ordered_sum_bf16(hidden)
    assert int((raw_bits(out) != raw_bits(ordered_sum_bf16(hidden[::-1]))).sum()) >= out.numel() // 2
    first = raw_bits(outs[0].out.cpu())
    for r, o in enumerate(outs):
        contract.bitwise(raw_bits(o.out.cpu()), raw_bits(out),
                         what=f"rank {r} hidden all-reduce of designed partials (rank order)",
                         index_names=ROWS)
        contract.bitwise(raw_bits(o.out.cpu()), first, what=f"rank {r} out = rank 0's out",
                         index_names=ROWS)


# -- a bad token changes no other token ---------------------------------------------------

@pytest.mark.config("small")
@pytest.mark.parametrize("kind", isolation.BAD_KINDS)
def test_wide_fast_bad_token_isolation(backend, kind, seed, contract):
    """Row 33 of 70 on 4 virtual TP ranks replaced by a bad row (``verify.isolation.bad_row``:
    NaN, infinite or overflowing; the reference refuses such a batch, the GPU layer cannot
    check without a synchronization): the call completes (no engine or mailbox error) and
    every other row's every token stage (``TOKEN_STAGES``) on every rank is bitwise that of
    the call with its ordinary row."""
    layer = _layer("small", 4, 128)
    x = _inputs(layer.config, 70, seed)
    clean = [_snapshot(o) for o in layer(x)]
    bad = x.clone()
    bad[33] = isolation.bad_row(kind, x[33], seed)
    dirty = [_snapshot(o) for o in layer(bad)]  # check=True: raises a recorded error
    keep = isolation.kept_rows(70, 33, device="cuda")
    for r in range(4):
        isolation.check_others_unchanged(contract, clean[r], dirty[r], keep,
                                         f"rank {r} with a {kind} token at row 33")

