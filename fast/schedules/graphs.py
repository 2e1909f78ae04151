"""One CUDA graph per batch bucket: a DEP layer step at ``T`` tokens runs as the graph of
the smallest bucket ``>= T`` on a static input padded with zero rows, so a call costs
two copies and one graph replay on the host, whatever the layer launches.

A leaf of ``fast.schedules``: the layers import it (``capture_call``, their ``graph``), and
it imports none of them.

Every rank pads to the same bucket (DEP ranks run one padded ``T``). A token's output
depends only on its own row within a bucket: each stage is row-wise or per pair (the
router, MXFP8, dispatch, experts engine, finalize and combine), and the dense GEMMs run at
the bucket's fixed shape (``verify/test_dep_peer.py`` checks the batch invariance).
"""

from __future__ import annotations

import torch

__all__ = ["BUCKETS", "bucket_of", "BucketGraphs", "capture_call"]

#: The default batch buckets (tokens per rank) of the DEP front.
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def capture_call(call, device):
    """One layer call in a CUDA graph: ``call(check)`` runs the call (``check``: whether
    it may synchronize to read error words); it runs once eagerly (compiles and warms
    every kernel outside the capture), then is captured on a side stream forked from and
    joined back into the current one. Returns ``(replay, outputs)``: ``replay()`` reruns
    the call on whatever its static inputs then hold, writing the same output tensors,
    and returns them."""
    call(True)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    capture = torch.cuda.Stream(device)
    capture.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(capture):
        with torch.cuda.graph(graph, stream=capture):
            outputs = call(False)
    torch.cuda.current_stream(device).wait_stream(capture)
    torch.cuda.synchronize(device)

    def replay():
        graph.replay()
        return outputs

    return replay, outputs


def bucket_of(tokens: int, buckets=BUCKETS) -> int:
    """The smallest bucket that holds ``tokens``."""
    for b in sorted(buckets):
        if tokens <= b:
            return b
    raise ValueError(f"T={tokens} tokens is above the largest bucket {max(buckets)}")


class BucketGraphs:
    """Graph-per-bucket launcher of a ``DepPeerLayer`` (one rank) or a ``DepLayer`` (all
    virtual ranks: the input is the list of every rank's tokens).

    A bucket's graph is captured at its first call (an eager call first, as the layer's
    ``graph`` does; collective for real ranks). ``__call__`` returns the output rows of
    the ``T`` real tokens, BF16 ``[T, H]`` (a list per rank for ``DepLayer``): views of the
    graph's output, valid until the next call of the same bucket.

    A layer class says which kind it is with a boolean class attribute ``virtual_ranks``
    (``DepLayer``: True, ``DepPeerLayer``: False), so this module imports no layer. Any
    other layer (the wide layers included) is refused with a TypeError; ``virtual`` says
    which of the two kinds ``layer`` is.
    """

    def __init__(self, layer, buckets=BUCKETS):
        virtual = getattr(type(layer), "virtual_ranks", None)
        if not isinstance(virtual, bool):
            raise TypeError("BucketGraphs: layer must be a fast.schedules.dep.DepLayer (every "
                            "virtual rank) or a fast.schedules.dep_peer.DepPeerLayer (one real "
                            f"rank), got {type(layer).__name__}")
        buckets = tuple(sorted(set(buckets)))
        if not buckets or buckets[0] < 1 or buckets[-1] > layer.max_tokens:
            raise ValueError(f"BucketGraphs: buckets {buckets} must lie in [1, max_tokens="
                             f"{layer.max_tokens}]")
        self.layer, self.buckets = layer, buckets
        self.virtual = virtual
        self._graphs: dict[int, tuple] = {}

    def _static(self, bucket: int):
        c, dev = self.layer.config, self.layer.device

        def zeros():
            return torch.zeros(bucket, c.hidden, dtype=torch.bfloat16, device=dev)

        return [zeros() for _ in range(self.layer.ranks)] if self.virtual else zeros()

    def __call__(self, x):
        rows = x if self.virtual else [x]
        tokens = rows[0].shape[0]
        bucket = bucket_of(tokens, self.buckets)
        if bucket not in self._graphs:
            static = self._static(bucket)
            self._graphs[bucket] = (static, *self.layer.graph(static))
        static, replay, outputs = self._graphs[bucket]
        for s, r in zip(static if self.virtual else [static], rows):
            s[:tokens].copy_(r)
            s[tokens:].zero_()
        replay()
        if self.virtual:
            return [o.out[:tokens] for o in outputs]
        return outputs.out[:tokens]
