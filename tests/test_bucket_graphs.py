"""``fast.schedules.graphs.BucketGraphs`` on the CPU: which layers it takes (a ``DepLayer``:
every virtual rank's tokens as a list; a ``DepPeerLayer``: one rank's tokens; anything
else refused by type, the wide layers included), and its host work on stand-in layers of
both kinds (a graph per bucket captured once, the static input padded with zero rows, the
real tokens' rows returned). The GPUs run it on the real layers
(``verify/test_dep_peer.py``: ``test_dep_peer_bucket_graphs``,
``test_dep_virtual_bucket_graphs``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fast.schedules.dep import DepLayer
from fast.schedules.dep_peer import DepPeerLayer
from fast.schedules.graphs import BucketGraphs
from model.config import LatentMoEConfig

CFG = LatentMoEConfig.small()


def _stand_in(base, ranks: int, max_tokens: int):
    """A ``base`` (DepLayer or DepPeerLayer) built without a device: its ``graph`` returns
    a replay that writes ``2 x`` of the static input(s) into fixed output tensors, and
    records every capture and replay."""

    class StandIn(base):
        def __init__(self):  # no device work: only what BucketGraphs reads
            self.config, self.ranks, self.max_tokens = CFG, ranks, max_tokens
            self.device, self.captured, self.replays = torch.device("cpu"), [], 0

        def graph(self, static):
            statics = static if isinstance(static, list) else [static]
            self.captured.append([s.shape[0] for s in statics])
            outs = [SimpleNamespace(out=torch.empty_like(s)) for s in statics]

            def replay():
                self.replays += 1
                for s, o in zip(statics, outs):
                    o.out.copy_(2 * s)
                return outs

            return replay, (outs if isinstance(static, list) else outs[0])

    return StandIn()


def _rows(tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, CFG.hidden, generator=g).bfloat16()


def test_refuses_other_layers():
    for layer in (object(), SimpleNamespace(scratch=None, max_tokens=16, ranks=1),
                  SimpleNamespace(max_tokens=16, ranks=4)):
        with pytest.raises(TypeError, match=r"^BucketGraphs: layer must be a "
                                            r"fast\.schedules\.dep\.DepLayer \(every virtual "
                                            r"rank\) or a fast\.schedules\.dep_peer\.DepPeerLayer "
                                            r"\(one real rank\), got "):
            BucketGraphs(layer)


def test_refuses_the_wide_layers():
    from fast.schedules.wide import WideLayer
    from fast.schedules.wide_peer import WidePeerLayer

    for cls in (WideLayer, WidePeerLayer):
        with pytest.raises(TypeError, match=rf"got {cls.__name__}$"):
            BucketGraphs(cls.__new__(cls))


def test_kinds_and_bucket_range():
    virtual, real = _stand_in(DepLayer, 4, 64), _stand_in(DepPeerLayer, 2, 64)
    assert BucketGraphs(virtual).virtual is True
    assert BucketGraphs(real).virtual is False
    with pytest.raises(ValueError, match=r"buckets \(1, 128\) must lie in \[1, max_tokens=64\]"):
        BucketGraphs(real, buckets=(128, 1))


def test_real_rank_pads_and_reuses_the_bucket_graph():
    layer = _stand_in(DepPeerLayer, 2, 16)
    graphs = BucketGraphs(layer, buckets=(1, 8, 16))
    x7, x5 = _rows(7, 0), _rows(5, 1)
    out7 = graphs(x7).clone()
    assert torch.equal(out7, 2 * x7) and layer.captured == [[8]]
    out5 = graphs(x5)
    assert torch.equal(out5, 2 * x5) and out5.shape == (5, CFG.hidden)
    static = graphs._graphs[8][0]
    assert not static[5:].any(), "rows past T are zero (the 7-row call's rows cleared)"
    assert layer.captured == [[8]] and layer.replays == 2
    graphs(_rows(9, 2))
    assert layer.captured == [[8], [16]]
    with pytest.raises(ValueError, match="above the largest bucket 16"):
        graphs(_rows(17, 3))


def test_virtual_ranks_pad_every_rank():
    layer = _stand_in(DepLayer, 4, 16)
    graphs = BucketGraphs(layer, buckets=(4, 16))
    xs = [_rows(13, r) for r in range(4)]
    outs = graphs(xs)
    assert len(outs) == 4 and layer.captured == [[16] * 4]
    for x, o in zip(xs, outs):
        assert torch.equal(o, 2 * x)
    outs = graphs([x[:3].clone() for x in xs])
    assert layer.captured == [[16] * 4, [4] * 4]
    for x, o in zip(xs, outs):
        assert torch.equal(o, 2 * x[:3])
