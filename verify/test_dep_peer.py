"""Contracts of the fast S1 layer over real ranks (``fast.schedules.dep_peer.DepPeerLayer``):
one process per GPU, peer buffers in torch symmetric memory. Run with::

    torchrun --standalone --nproc-per-node 2 -m pytest verify/test_dep_peer.py -m multi_gpu

| contract | how |
|---|---|
| every stage output of a real rank | bitwise = the same rank of the virtual layer (``DepLayer``, every rank on this GPU) on the same inputs; the virtual layer's stage contracts are ``verify/test_dep_fast.py``'s |
| consecutive calls | a call on new inputs after another equals the virtual layer on the new inputs (no stale receive row, partial or counter) |
| stream orders, CUDA graph | serialized, side stream, side stream delayed by a spin, graph replays on new inputs and 100 reruns: bitwise equal |
| a peer that never arrives | the wait times out and ``check`` raises naming the rank, the peer and the buffer (never a hang) |
| the wait kernel alone (one GPU) | passes when every counter reached its target (also across the 32-bit wrap), times out with the error record otherwise |

Every process builds the same weights (one seed) and every rank's inputs, so each runs the
virtual layer locally and compares its own rank.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

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
def _layers(config_name: str, max_tokens: int):
    """The real rank's layer and the virtual layer of all ranks, on this process's GPU."""
    import torch.distributed as dist

    from fast.schedules.dep import DepLayer
    from fast.schedules.dep_peer import DepPeerLayer

    w = cases.layer_weights(config_name)
    real = DepPeerLayer(w, max_tokens=max_tokens)
    virtual = DepLayer(w, ranks=dist.get_world_size(), max_tokens=max_tokens, device="cuda")
    return real, virtual


def _local_pairs(out, rank: int, per: int) -> torch.Tensor:
    lo = rank * per
    return ((out.recv_ids >= lo) & (out.recv_ids < lo + per)).flatten()


def compare_with_virtual(contract, real_out, virtual_out, rank: int, per: int, what: str):
    """Every field of a real rank's outputs bitwise equal to the virtual rank's (the
    engine's rows of pairs that are not local are unspecified in both: only local pairs).
    The real call must have kept its receive rows (``keep_received=True``): a peer that
    finished the call may already be writing its next call's rows into the live buffer
    while this rank still runs the virtual layer."""
    for f in dataclasses.fields(real_out):
        got, want = getattr(real_out, f.name), getattr(virtual_out, f.name)
        if f.name == "rows":
            pairs = _local_pairs(virtual_out, rank, per)
            got, want = got[pairs], want[pairs]
        if got.dtype == torch.float32:  # poisoned weights are NaN: compare the bits
            got, want = got.view(torch.int32), want.view(torch.int32)
        contract.bitwise(got, want, what=f"{what}: {f.name} = virtual rank {rank}")


@pytest.mark.multi_gpu(2)
@pytest.mark.config("small")
@pytest.mark.parametrize("tokens", (1, 5, 16))
def test_dep_peer_equals_virtual(backend, process_group, tokens, seed, contract):
    """Two consecutive calls on different inputs; each equals the virtual layer."""
    import torch.distributed as dist

    cfg = cases.config("small")
    real, virtual = _layers("small", 16)
    rank, n = dist.get_rank(), dist.get_world_size()
    for call in range(2):
        xs = cases.rank_rows(cfg, n, tokens, seed + 1000 * call, "cuda")
        got = real(xs[rank], keep_received=True)
        want = virtual(xs)[rank]
        compare_with_virtual(contract, got, want, rank, real.per,
                             f"rank {rank}/{n} T={tokens} call {call}")


@pytest.mark.multi_gpu(2)
@pytest.mark.config("small")
def test_dep_peer_stream_orders_and_graph(backend, process_group, seed, contract):
    """Serialized, side stream, side stream delayed by a spin (after a call on other
    inputs, so stale buffers differ), graph replays on new inputs: all bitwise equal to
    the virtual layer; then 100 replays of one input give the same bits every time."""
    import torch.distributed as dist

    cfg, tokens = cases.config("small"), 7
    real, virtual = _layers("small", 16)
    rank, n = dist.get_rank(), dist.get_world_size()
    xs = cases.rank_rows(cfg, n, tokens, seed, "cuda")
    other = cases.rank_rows(cfg, n, tokens, seed + 999, "cuda")
    want = virtual(xs)[rank].out.clone()
    runs = {"serial": real(xs[rank], order="serial").out.clone()}
    real(other[rank])
    runs["side, delayed"] = real(xs[rank], side_delay_cycles=2_000_000).out.clone()
    real(other[rank])
    runs["side"] = real(xs[rank]).out.clone()
    static = other[rank].clone()
    replay, outs = real.graph(static)
    for i in range(3):
        fresh = cases.rank_rows(cfg, n, tokens, seed + 100 * (i + 1), "cuda")
        static.copy_(fresh[rank])
        replay()
        torch.cuda.synchronize()
        contract.bitwise(outs.out, virtual(fresh)[rank].out,
                         what=f"rank {rank}: graph replay {i} = virtual", index_names=ROWS)
    static.copy_(xs[rank])
    replay()
    torch.cuda.synchronize()
    runs["graph replay"] = outs.out.clone()
    for name, got in runs.items():
        contract.bitwise(got, want, what=f"rank {rank}: {name} = virtual", index_names=ROWS)
    differ = 0
    for _ in range(100):
        replay()
        differ += int(not torch.equal(outs.out, want))
    real.check()
    assert differ == 0, f"rank {rank}: {differ} of 100 graph replays on one input differ"


@pytest.mark.multi_gpu(2)
@pytest.mark.config("kimi_k3")
@pytest.mark.parametrize("tokens", (1, 4))
def test_dep_peer_real_dims(backend, process_group, tokens, seed, contract):
    """The real layer (E/N experts per rank) equals the virtual layer of the same ranks."""
    import torch.distributed as dist

    cfg = cases.config("kimi_k3")
    real, virtual = _layers("kimi_k3", 4)
    rank, n = dist.get_rank(), dist.get_world_size()
    xs = cases.rank_rows(cfg, n, tokens, seed, "cuda")
    compare_with_virtual(contract, real(xs[rank], keep_received=True), virtual(xs)[rank], rank,
                         real.per, f"kimi_k3 rank {rank}/{n} T={tokens}")


@pytest.mark.multi_gpu(2)
@pytest.mark.config("small")
def test_dep_peer_missing_peer_times_out(backend, process_group):
    """Rank 0 calls the layer alone: its wait for rank 1's receive rows gives up after the
    timeout and ``check`` names the rank, the peer and the buffer; rank 1 never calls."""
    import torch.distributed as dist

    from fast.device.arrival import ArrivalTimeout
    from fast.schedules.dep_peer import DepPeerLayer

    cfg = cases.config("small")
    layer = DepPeerLayer(cases.weights("small"), max_tokens=4, timeout_s=0.2)
    _RETIRED.append(layer)
    rank, n = dist.get_rank(), dist.get_world_size()
    xs = cases.rank_rows(cfg, n, 3, 0, "cuda")
    layer(xs[rank])  # every rank once: the first call of a T meets the peers
    dist.barrier()
    if rank == 0:
        with pytest.raises(ArrivalTimeout,
                           match=rf"DEP rank 0 of {n}: the receive rows from rank 1 did not "
                                 r"arrive within 0.2 s") as error:
            layer(xs[0])
        assert (error.value.rank, error.value.what, error.value.peer) == (0, "receive rows", 1)
    dist.barrier()


@pytest.mark.config("small")
def test_dep_peer_wait_kernel(backend):
    """``ArrivalWaitKernel`` on one GPU: counters at their target pass and advance the
    expected count (also across the 32-bit wrap); a counter short of it times out with the
    error record; the kernel returns either way."""
    from cutlass import Int32, Int64

    from fast import backend as fb
    from fast.schedules.dep import compiled_kernel, kernel_params
    from fast.device.arrival import WAIT_ERROR_FIELDS

    ranks = 4
    wait = compiled_kernel("wait", fb.device_arch("cuda"),
                     kernel_params(cases.config("small"), ranks, peers=True)["wait"])

    def run(counters, expected, increment, timeout_s):
        c = torch.tensor(counters, dtype=torch.int64).to(torch.int32).cuda()
        e = torch.tensor([expected], dtype=torch.int64).to(torch.int32).cuda()
        err = torch.zeros(len(WAIT_ERROR_FIELDS), dtype=torch.int32, device="cuda")
        wait(Int64(c.data_ptr()), Int64(e.data_ptr()), Int64(err.data_ptr()),
             Int64(int(timeout_s * 1e9)), Int32(increment), Int32(5), Int32(1), fb.stream())
        torch.cuda.synchronize()
        return int(e.item()), dict(zip(WAIT_ERROR_FIELDS, err.tolist()))

    expected, record = run([7, 7, 9, 7], 4, 3, 1.0)
    assert (expected, record["code"]) == (7, 0)
    wrap = 2**31 - 2  # target wraps past 2^31 - 1
    expected, record = run([(wrap + 3) - 2**32] * ranks, wrap, 3, 1.0)
    assert (expected, record["code"]) == ((wrap + 3) - 2**32, 0)
    expected, record = run([3, 3, 2, 3], 0, 3, 0.02)
    assert record == dict(code=1, rank=5, what=1, peer=2, seen=2, target=3), record
    assert expected == 3


@pytest.mark.multi_gpu(2)
@pytest.mark.config("small")
def test_dep_peer_layers_share_scratch(backend, process_group, seed, contract):
    """Two layers with different weights on one ``DepPeerScratch`` (receive rows,
    partials, counters, engine buffers), called in turn on different inputs: each call
    equals the virtual layer of its own weights (no stale row crosses layers)."""
    import torch.distributed as dist

    from fast.schedules.dep import DepLayer
    from fast.schedules.dep_peer import DepPeerLayer

    cfg = cases.config("small")
    rank, n = dist.get_rank(), dist.get_world_size()
    weights = [cases.weights("small", seed=s) for s in (2026, 7)]
    first = DepPeerLayer(weights[0], max_tokens=8)
    layers = [first, DepPeerLayer(weights[1], scratch=first.scratch)]
    _RETIRED.extend(layers)
    virtual = [DepLayer(w, ranks=n, max_tokens=8, device="cuda") for w in weights]
    for call, which in enumerate((0, 1, 0, 1)):
        xs = cases.rank_rows(cfg, n, 6, seed + 10 * call, "cuda")
        compare_with_virtual(contract, layers[which](xs[rank], keep_received=True),
                             virtual[which](xs)[rank], rank, first.per, f"rank {rank} call {call} (layer {which})")


@pytest.mark.multi_gpu(2)
@pytest.mark.config("small")
def test_dep_peer_bucket_graphs(backend, process_group, seed, contract):
    """``BucketGraphs`` over a real rank: T = 5 and T = 7 run the bucket-8 graph; the
    first five tokens' outputs are the same bits in both (batch invariance within a
    bucket), and each equals an eager call on the zero-padded input."""
    import torch.distributed as dist

    from fast.schedules.graphs import BucketGraphs

    cfg = cases.config("small")
    real, _ = _layers("small", 16)
    rank, n = dist.get_rank(), dist.get_world_size()
    graphs = BucketGraphs(real, buckets=(1, 8, 16))
    x7 = cases.rank_rows(cfg, n, 7, seed, "cuda")[rank]
    x5 = x7[:5].clone()
    out7 = graphs(x7).clone()
    out5 = graphs(x5).clone()
    contract.bitwise(out5, out7[:5], what=f"rank {rank}: tokens 0-4 alone = within 7 (bucket 8)",
                     index_names=ROWS)
    padded = torch.zeros(8, cfg.hidden, dtype=torch.bfloat16, device="cuda")
    padded[:7] = x7
    contract.bitwise(out7, real(padded).out[:7], what=f"rank {rank}: graph = eager on padded",
                     index_names=ROWS)


@pytest.mark.config("small")
def test_dep_virtual_bucket_graphs(backend, seed, contract):
    """``BucketGraphs`` over the virtual layer (4 ranks): batch invariance within a bucket
    and equality with an eager call on the zero-padded inputs."""
    from fast.schedules.dep import DepLayer
    from fast.schedules.graphs import BucketGraphs

    cfg, ranks = cases.config("small"), 4
    layer = DepLayer(cases.weights("small"), ranks=ranks, max_tokens=16, device="cuda")
    graphs = BucketGraphs(layer, buckets=(4, 16))
    xs = cases.rank_rows(cfg, ranks, 13, seed, "cuda")
    out13 = [o.clone() for o in graphs(xs)]
    out9 = [o.clone() for o in graphs([x[:9].clone() for x in xs])]
    padded = [torch.cat([x, torch.zeros(3, cfg.hidden, dtype=x.dtype, device=x.device)])
              for x in xs]
    eager = layer(padded)
    for r in range(ranks):
        contract.bitwise(out9[r], out13[r][:9], what=f"rank {r}: 9 tokens = first 9 of 13",
                         index_names=ROWS)
        contract.bitwise(out13[r], eager[r].out[:13], what=f"rank {r}: graph = eager on padded",
                         index_names=ROWS)
    with pytest.raises(ValueError, match="above the largest bucket 16"):
        graphs(cases.rank_rows(cfg, ranks, 17, seed, "cuda"))
