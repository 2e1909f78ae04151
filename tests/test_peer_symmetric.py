"""``fast.schedules.symmetric`` on the CPU (the torch symmetric-memory setup of the DEP and
wide layers over real ranks): the packed layouts of both layers equal the code they
replaced, the argument errors name their caller, and a buffer's views and peer-address
tables (``torch.distributed._symmetric_memory`` replaced by a stand-in) equal the
formulas the layers used; ``DepPeerScratch``'s tables, built on one gloo rank, equal its
old code's. The GPUs run the real rendezvous (``verify/test_dep_peer.py``,
``verify/test_wide_peer.py``)."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from fast.schedules import symmetric
from model.config import LatentMoEConfig

CONFIGS = {"kimi_k3": LatentMoEConfig.kimi_k3(), "small": LatentMoEConfig.small(),
           "small_i1024": dataclasses.replace(LatentMoEConfig.small(), intermediate=1024)}


def _old_pack(fields: dict) -> tuple[dict, int]:
    """The layout loop of ``dep_peer.symmetric_layout`` and ``wide_peer.symmetric_layout``
    before they shared ``symmetric.pack``, verbatim (``_ALIGN = 256``)."""
    _ALIGN = 256
    layout, at = {}, 0
    for name, (shape, dtype) in fields.items():
        layout[name] = (at, shape, dtype)
        at += -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN
    return layout, at


def _dep_fields(c, ranks, max_tokens):
    rows = ranks * max_tokens
    return {"codes": ((rows, c.latent), torch.uint8),
            "scales": ((rows, c.latent // 32), torch.uint8),
            "ids": ((rows, c.top_k), torch.int32),
            "weights": ((rows, c.top_k), torch.float32),
            "partials": ((rows, c.latent), torch.bfloat16),
            "arrivals": ((2, ranks), torch.int32)}


def _wide_fields(c, ranks, rows):
    # the old code's fields with the one deliberate change since: ``up`` holds two buffers
    # that rotate with the mailbox (the up columns accumulate in place, their addend copied
    # on the side stream, so a call's buffer must stay whole until every peer has read it)
    return {"mailbox": ((2, rows, c.latent + 2 * c.experts), torch.int16),
            "partial": ((rows, c.latent), torch.bfloat16),
            "shared": ((2, rows, c.hidden), torch.bfloat16),
            "up": ((2, rows, c.hidden // ranks), torch.bfloat16),
            "arrivals": ((2, ranks), torch.int32)}


@pytest.mark.parametrize("config,ranks", [("kimi_k3", 2), ("kimi_k3", 8), ("small", 2),
                                          ("small", 4), ("small_i1024", 16)])
@pytest.mark.parametrize("rows", (1, 7, 96, 1024))
def test_layouts_equal_the_old_code(config, ranks, rows):
    """Both layers' ``symmetric_layout``: the offsets, shapes, dtypes and size the
    per-module loop gave."""
    from fast.schedules import dep_peer, wide_peer

    c = CONFIGS[config]
    assert dep_peer.symmetric_layout(c, ranks, rows) == _old_pack(_dep_fields(c, ranks, rows))
    assert wide_peer.symmetric_layout(c, ranks, rows) == _old_pack(_wide_fields(c, ranks, rows))


def test_pack_aligns_every_field():
    layout, size = symmetric.pack({"a": ((3,), torch.uint8), "b": ((1, 65), torch.int32),
                                   "c": ((0,), torch.float32), "d": ((2,), torch.int64)})
    assert {k: v[0] for k, v in layout.items()} == {"a": 0, "b": 256, "c": 768, "d": 768}
    assert size == 1024 and symmetric.ALIGN == 256


def test_process_group_refuses_without_distributed():
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"^SomeLayer: torch.distributed is not initialised "
                                           r"\(launch with torchrun and call "
                                           r"init_process_group\('nccl'\)\)$"):
        symmetric.process_group("SomeLayer")


def test_cuda_device(monkeypatch):
    from fast import backend

    with pytest.raises(ValueError, match=r"^SomeLayer: device must be a CUDA device, got cpu$"):
        backend.cuda_device("SomeLayer", "cpu")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert backend.cuda_device("X") == torch.device("cuda", 3)
    assert backend.cuda_device("X", "cuda") == torch.device("cuda", 3)
    assert backend.cuda_device("X", torch.device("cuda", 1)) == torch.device("cuda", 1)


def test_require_supported_names_the_caller(monkeypatch):
    from fast import backend

    monkeypatch.setattr(backend, "device_supported", lambda: (False, "no CUDA device"))
    with pytest.raises(RuntimeError, match=r"^SomeLayer: the fast kernels cannot run here: "
                                           r"no CUDA device$"):
        backend.require_supported("SomeLayer")
    monkeypatch.setattr(backend, "device_supported", lambda: (True, ""))
    backend.require_supported("SomeLayer")


class FakeSymmetricMemory:
    """``torch.distributed._symmetric_memory``'s ``empty`` and ``rendezvous`` on the CPU:
    the buffer a plain tensor (filled with garbage, so the zeroing shows), the handle's
    ``buffer_ptrs`` made-up peer addresses with this rank's own at ``rank``."""

    def __init__(self, ranks: int, rank: int):
        self.ranks, self.rank, self.calls = ranks, rank, []

    def empty(self, size, *, dtype, device):
        self.calls.append(("empty", size, dtype, torch.device(device)))
        self.buffer = torch.full((size,), 7, dtype=dtype)
        return self.buffer

    def rendezvous(self, tensor, group_name):
        assert tensor is self.buffer and not tensor.any(), "rendezvous before the zeroing"
        self.calls.append(("rendezvous", group_name))
        ptrs = [(1 << 40) * (o + 1) + 4096 * o for o in range(self.ranks)]
        ptrs[self.rank] = tensor.data_ptr()
        return SimpleNamespace(buffer_ptrs=ptrs)


@pytest.fixture
def fake_symm(monkeypatch):
    import torch.distributed._symmetric_memory as symm_mem

    def install(ranks, rank):
        fake = FakeSymmetricMemory(ranks, rank)
        monkeypatch.setattr(symm_mem, "empty", fake.empty)
        monkeypatch.setattr(symm_mem, "rendezvous", fake.rendezvous)
        return fake
    return install


def test_symmetric_buffer_views_and_tables(fake_symm):
    c, ranks, rank, rows = CONFIGS["small"], 4, 1, 96
    fake = fake_symm(ranks, rank)
    layout, size = _old_pack(_wide_fields(c, ranks, rows))
    buf = symmetric.SymmetricBuffer(layout, size, SimpleNamespace(group_name="g7"),
                                    torch.device("cpu"))
    assert fake.calls == [("empty", size, torch.uint8, torch.device("cpu")), ("rendezvous", "g7")]
    assert buf.tensor is fake.buffer and buf.tensor.shape == (size,) and not buf.tensor.any()
    peers = [int(p) for p in fake.rendezvous(buf.tensor, "again").buffer_ptrs]
    assert buf.peers == peers
    for name, (at, shape, dtype) in layout.items():
        view = buf.views[name]
        assert (view.shape, view.dtype) == (shape, dtype)
        assert view.data_ptr() == buf.tensor.data_ptr() + at and view.is_contiguous()
        for index in (0, 4, 4 * (ranks + rank)):
            # the old wide_peer table() and dep_peer at() formula
            want = [peers[o] + layout[name][0] + index for o in range(ranks)]
            got = buf.table(name, index)
            assert got.dtype == torch.int64 and got.device == torch.device("cpu")
            assert got.tolist() == want
            assert [buf.address(o, name, index) for o in range(ranks)] == want


def test_dep_peer_scratch_tables_equal_the_old_code(fake_symm, monkeypatch, tmp_path):
    """``DepPeerScratch`` on one gloo rank (the device check and the closing
    synchronization replaced, so it builds on the CPU): its buffers are the views of its
    symmetric buffer, and its dispatch, combine and arrival tables equal the old code's."""
    import torch.distributed as dist

    from fast import backend
    from fast.schedules import dep_peer

    c, max_tokens = CONFIGS["small"], 5
    fake = fake_symm(1, 0)
    met = []
    monkeypatch.setattr(backend, "cuda_device", lambda who, device: torch.device("cpu"))
    monkeypatch.setattr(dep_peer, "meet", lambda group, device: met.append((group, device)))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        scratch = dep_peer.DepPeerScratch(c, max_tokens=max_tokens)
        group, ranks, rank = dist.group.WORLD, 1, 0
        assert met == [(group, torch.device("cpu"))]
        assert fake.calls[1] == ("rendezvous", group.group_name)
    finally:
        dist.destroy_process_group()
    layout, _ = _old_pack(_dep_fields(c, ranks, max_tokens))
    assert scratch.layout == layout and scratch._symmetric is fake.buffer
    peers = [scratch._symmetric.data_ptr()]
    for name, (at, shape, dtype) in layout.items():
        assert scratch.buffers[name].data_ptr() == peers[0] + at
        assert (scratch.buffers[name].shape, scratch.buffers[name].dtype) == (shape, dtype)

    def at(peer, name, index=0):  # the old code, verbatim
        return peers[peer] + layout[name][0] + index

    on = dict(dtype=torch.int64, device="cpu")
    dispatch = torch.tensor(
        [[at(o, f) for f in ("codes", "scales", "ids", "weights")] for o in range(ranks)], **on)
    combine = torch.tensor([at(o, "partials") for o in range(ranks)], **on)
    arrivals = [torch.tensor([at(o, "arrivals", 4 * (w * ranks + rank))
                              for o in range(ranks)], **on) for w in range(2)]
    assert torch.equal(scratch.dispatch_table, dispatch)
    assert torch.equal(scratch.combine_table, combine)
    assert len(scratch.arrival_tables) == 2
    for got, want in zip(scratch.arrival_tables, arrivals):
        assert torch.equal(got, want)
