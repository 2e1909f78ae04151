"""Contracts of the fast S2 layer over real ranks (``fast.schedules.wide_peer.WidePeerLayer``):
one process per GPU (one TP rank each), peer buffers in torch symmetric memory. Run with::

    torchrun --standalone --nproc-per-node 2 -m pytest verify/test_wide_peer.py -m multi_gpu

| contract | how |
|---|---|
| every stage output of a real rank | bitwise = the same rank of the virtual layer (``WideLayer``, every rank on this GPU) on the same inputs; routing lists: each expert's first ``counts[e]`` entries as a set (their order is the engine's atomic claims); the virtual layer's stage contracts are ``verify/test_wide_fast.py``'s |
| consecutive calls | a second call on new inputs (the other mailbox and shared buffer) equals the virtual layer on them; after each call this rank's mailbox is armed again (both buffers) |
| stream orders, CUDA graph | serialized, side stream, side stream delayed by a spin, graph replays (both mailbox buffers) on new inputs, then 20 reruns: bitwise equal |
| batch invariance (``batch_invariant=True``) | a real rank's every stage bitwise = the virtual batch-invariant layer's rank at row counts on both sides of the token-chunk edges (65, 128, 129, 200), and each of them the first rows of its own 200-row call |
| a peer that never calls | the poll and the waits time out; ``check`` raises naming the rank, the mailbox buffer and the writer (then the wait naming the peer and what); never a hang |

Every process builds the same weights (one seed) and every rank's inputs (one seed per
rank: different tokens per rank make a mixed-up peer address show), so each runs the
virtual layer locally and compares its own rank.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from reference.schedules.mailbox import SENTINEL_BF16, SENTINEL_F32
from verify import cases

pytestmark = [pytest.mark.gpu, pytest.mark.backends("fast")]

ROWS = ("token", "column")
#: Kept alive to the end of the session: a layer whose peers timed out is not used again,
#: and its symmetric buffer is not freed while a peer may still write into it.
_RETIRED = []
#: The layers of ``_layers`` hold symmetric buffers that a peer process may still write into
#: after this process has left the module: kept to the end of the session (verify.caches).
KEEP_CACHES_AT_MODULE_END = True


@functools.cache
def _layers(config_name: str, max_rows: int):
    """The real rank's layer and the virtual layer of all ranks, on this process's GPU."""
    import torch.distributed as dist

    from fast.schedules.wide import WideLayer
    from fast.schedules.wide_peer import WidePeerLayer

    w = cases.layer_weights(config_name)
    real = WidePeerLayer(w, max_rows=max_rows)
    virtual = WideLayer(w, ranks=dist.get_world_size(), max_rows=max_rows, device="cuda")
    return real, virtual


def _sorted_lists(out) -> torch.Tensor:
    """Each expert's routing list entries below its count, sorted (the rest: -1)."""
    lists, counts = out.lists, out.counts.to(torch.int64)
    live = torch.arange(lists.shape[1], device=lists.device)[None, :] < counts[:, None]
    big = torch.iinfo(torch.int32).max
    kept = torch.where(live, lists, torch.full_like(lists, big)).sort(dim=1).values
    return torch.where(kept == big, torch.full_like(kept, -1), kept)


def compare_with_virtual(contract, real_out, virtual_out, rank: int, what: str):
    """Every tensor field of a real rank's outputs bitwise equal to the virtual rank's
    (float fields as their bits; the routing lists as sets per expert)."""
    for f in dataclasses.fields(real_out):
        got, want = getattr(real_out, f.name), getattr(virtual_out, f.name)
        if not isinstance(got, torch.Tensor):
            continue  # mailbox_index: each layer's own call count
        if f.name == "lists":
            got, want = _sorted_lists(real_out), _sorted_lists(virtual_out)
        if got.dtype in (torch.float32, torch.float8_e4m3fn):
            got, want = got.view(torch.uint8), want.view(torch.uint8)
        contract.bitwise(got, want, what=f"{what}: {f.name} = virtual rank {rank}")


def _check_own_mailbox_armed(contract, real, what: str) -> None:
    """Both buffers of this rank's mailbox hold their sentinels (every peer has ended the
    call: the caller synchronized and met them)."""
    box = real.symmetric["mailbox"].cpu()
    lat = real.config.latent
    contract.bitwise(box[..., :lat], torch.full_like(box[..., :lat], SENTINEL_BF16),
                     what=f"{what}: latent words armed", index_names=("buffer", "row", "column"))
    words = box[..., lat:].contiguous().view(torch.int32)
    contract.bitwise(words, torch.full_like(words, SENTINEL_F32),
                     what=f"{what}: logit words armed", index_names=("buffer", "row", "word"))


@pytest.mark.multi_gpu(2)
@pytest.mark.config("small")
@pytest.mark.parametrize("tokens", (65, 100))
def test_wide_peer_equals_virtual(backend, process_group, tokens, seed, contract):
    """Two consecutive calls on different inputs (both mailbox buffers); each equals the
    virtual layer, and leaves this rank's mailbox armed."""
    import torch.distributed as dist

    cfg = cases.config("small")
    real, virtual = _layers("small", 128)
    rank, n = dist.get_rank(), dist.get_world_size()
    for call in range(2):
        xs = cases.rank_rows(cfg, n, tokens, seed + 1000 * call, "cuda")
        index = real.mailbox_index
        got = real(xs[rank])
        assert got.mailbox_index == index
        want = virtual(xs)[rank]
        what = f"rank {rank}/{n} T={tokens} call {call} (buffer {index})"
        compare_with_virtual(contract, got, want, rank, what)
        dist.barrier()  # every rank's call has ended (each checked: synchronized)
        _check_own_mailbox_armed(contract, real, what)
        dist.barrier()  # nobody publishes the next call before every rank looked


@pytest.mark.multi_gpu(2)
@pytest.mark.config("small")
def test_wide_peer_stream_orders_and_graph(backend, process_group, seed, contract):
    """Serialized, side stream at each shared-expert placement, the same delayed by a
    spin (each after a call on other inputs, so stale buffers differ), graph replays on
    new inputs (both graphs, every
    output field): all bitwise equal to the virtual layer; then 20 replays of one input
    give the same bits every time."""
    import torch.distributed as dist

    cfg, tokens = cases.config("small"), 80
    real, virtual = _layers("small", 128)
    rank, n = dist.get_rank(), dist.get_world_size()
    xs = cases.rank_rows(cfg, n, tokens, seed, "cuda")
    other = cases.rank_rows(cfg, n, tokens, seed + 999, "cuda")
    want = virtual(xs)[rank].out.clone()
    runs = {"serial": real(xs[rank], order="serial").out.clone()}
    for shared in ("front", "beside", "tail"):  # fast.schedules.wide.SHARED_PLACEMENTS
        real(other[rank])
        runs[f"side {shared}, delayed"] = real(xs[rank], shared=shared,
                                               side_delay_cycles=2_000_000).out.clone()
        real(other[rank])
        runs[f"side {shared}"] = real(xs[rank], shared=shared).out.clone()
    static = other[rank].clone()
    replay, _ = real.graph(static)
    for i in range(4):  # both graphs, twice
        fresh = cases.rank_rows(cfg, n, tokens, seed + 100 * (i + 1), "cuda")
        static.copy_(fresh[rank])
        outs = replay()
        real.check()
        compare_with_virtual(contract, outs, virtual(fresh)[rank], rank,
                             f"rank {rank}: graph replay {i}")
    static.copy_(xs[rank])
    runs["graph replay"] = replay().out.clone()
    real.check()
    for name, got in runs.items():
        contract.bitwise(got, want, what=f"rank {rank}: {name} = virtual", index_names=ROWS)
    differ = 0
    for _ in range(20):
        out = replay().out
        torch.cuda.synchronize()
        differ += int(not torch.equal(out, want))
    real.check()
    assert differ == 0, f"rank {rank}: {differ} of 20 graph replays on one input differ"


@pytest.mark.multi_gpu(2)
@pytest.mark.config("kimi_k3")
def test_wide_peer_real_dims(backend, process_group, seed, contract):
    """The real layer (TP slices of the real widths) equals the virtual layer of the same
    ranks, two calls."""
    import torch.distributed as dist

    cfg = cases.config("kimi_k3")
    real, virtual = _layers("kimi_k3", 96)
    rank, n = dist.get_rank(), dist.get_world_size()
    for call in range(2):
        xs = cases.rank_rows(cfg, n, 65 + 30 * call, seed + call, "cuda")
        compare_with_virtual(contract, real(xs[rank]), virtual(xs)[rank], rank,
                             f"kimi_k3 rank {rank}/{n} call {call}")


@pytest.mark.multi_gpu(2)
@pytest.mark.config("small")
@pytest.mark.parametrize("gemms", ["fast", "stock"])
def test_wide_peer_batch_invariant(backend, process_group, gemms, seed, contract):
    """``WidePeerLayer(batch_invariant=True)`` with ``invariant_gemms`` ``"fast"`` (the
    rank's four GEMMs on fast.gemm, one K split each) or ``"stock"`` (the front on it, the
    other three on cuBLASLt without split-K): at 65, 128, 129 and 200 rows every stage
    output of this rank equals the virtual batch-invariant layer's rank on the same inputs,
    and every token stage at a smaller row count is bitwise the first rows of the 200-row
    call."""
    import torch.distributed as dist

    from fast.schedules.wide import WideLayer
    from fast.schedules.wide_peer import WidePeerLayer

    cfg = cases.config("small")
    w = cases.layer_weights("small")
    rank, n = dist.get_rank(), dist.get_world_size()
    real = WidePeerLayer(w, max_rows=200, batch_invariant=True, invariant_gemms=gemms)
    virtual = WideLayer(w, ranks=n, max_rows=200, device="cuda", batch_invariant=True,
                        invariant_gemms=gemms)
    assert real.batch_invariant and virtual.batch_invariant
    assert real.invariant_mma == virtual.invariant_mma  # "auto" resolves alike on one GPU kind
    xs = cases.rank_rows(cfg, n, 200, seed, "cuda")
    top = real(xs[rank])
    want = {f.name: getattr(top, f.name).clone() for f in dataclasses.fields(top)
            if f.name not in ("lists", "counts", "mailbox_index")}
    compare_with_virtual(contract, top, virtual(xs)[rank], rank,
                         f"batch-invariant rank {rank}/{n} T=200")
    for tokens in (65, 128, 129):
        few = [x[:tokens].contiguous() for x in xs]
        got = real(few[rank])
        what = f"batch-invariant rank {rank}/{n} T={tokens}"
        compare_with_virtual(contract, got, virtual(few)[rank], rank, what)
        k = cfg.top_k
        for name, full in want.items():
            rows = tokens * k if name == "rows" else tokens
            mine = getattr(got, name)
            if mine.dtype in (torch.float32, torch.float8_e4m3fn):
                mine, full = mine.view(torch.uint8), full.view(torch.uint8)
            contract.bitwise(mine, full[:rows], what=f"{what}: {name} = its rows at T=200")
    dist.barrier()


@pytest.mark.multi_gpu(2)
@pytest.mark.config("small")
def test_wide_peer_missing_peer_times_out(backend, process_group):
    """Rank 0 calls the layer alone: its poll gives up on rank 1's mailbox words after the
    timeout and ``check`` raises naming rank 0, the mailbox buffer and writer rank 1; the
    next ``check`` raises the wait's timeout naming rank 1's routed partials. Rank 1 never
    calls. Nothing hangs."""
    import time

    import torch.distributed as dist

    from fast.device.arrival import ArrivalTimeout
    from fast.schedules.wide_peer import WidePeerLayer

    cfg = cases.config("small")
    layer = WidePeerLayer(cases.weights("small"), max_rows=96, timeout_s=0.2)
    _RETIRED.append(layer)
    rank, n = dist.get_rank(), dist.get_world_size()
    xs = cases.rank_rows(cfg, n, 70, 0, "cuda")
    layer(xs[rank])  # every rank once: the first call of a T meets the peers
    dist.barrier()
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(ArrivalTimeout,
                           match=rf"WidePeerLayer \(TP {n}\): rank 0 timed out polling mailbox "
                                 r"buffer 1: token \d+, column \d+ \(16-bit word, (latent|logit) "
                                 r"region written by rank 1\) still empty after 0.2 s") as poll:
            layer(xs[0])
        assert (poll.value.rank, poll.value.what, poll.value.peer) == (0, "mailbox", 1)
        with pytest.raises(ArrivalTimeout,
                           match=rf"wide rank 0 of {n}: the routed partials from rank 1 did not "
                                 r"arrive within 0.2 s") as wait:
            layer.check()
        assert (wait.value.rank, wait.value.what, wait.value.peer) == (0, "routed partials", 1)
        assert time.monotonic() - start < 30, "the timeouts took far longer than 3 x 0.2 s"
    dist.barrier()
