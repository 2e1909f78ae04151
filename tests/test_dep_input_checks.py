"""The DEP layers' one input check (``fast.schedules.dep.check_token_rows``) on the CPU:
``DepLayer._check_inputs`` and ``DepPeerLayer._check_input`` return the same ``T`` and
raise the same error, word for word, as their separate checks did (kept below verbatim)
on good inputs and on every kind of bad one, including which error wins when several
apply."""

from __future__ import annotations

import pytest
import torch

from fast.schedules.dep import DepLayer
from fast.schedules.dep_peer import DepPeerLayer
from model.config import LatentMoEConfig

CFG = LatentMoEConfig.small()
MAX_TOKENS, RANKS = 16, 3
#: the layers' device in these checks: the tensors below live on the CPU or on "meta"
DEVICE = torch.device("cpu")


def _old_dep_check_inputs(self, xs) -> int:
    """``DepLayer._check_inputs`` before the shared check, verbatim."""
    c = self.config
    if not isinstance(xs, (list, tuple)) or len(xs) != self.ranks:
        raise ValueError(f"DepLayer: xs must be a list of {self.ranks} tensors (one per rank)")
    tokens = None
    for r, x in enumerate(xs):
        if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2 \
                or x.shape[1] != c.hidden:
            got = (x.dtype, tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"DepLayer: xs[{r}] must be BF16 [T, H={c.hidden}], got {got}")
        if x.device != self.device or not x.is_contiguous():
            raise ValueError(f"DepLayer: xs[{r}] must be contiguous on {self.device}, got {x.device}")
        tokens = x.shape[0] if tokens is None else tokens
        if x.shape[0] != tokens:
            raise ValueError(f"DepLayer: every rank runs one padded T; xs[0] has {tokens} "
                             f"rows, xs[{r}] has {x.shape[0]}")
    if not 1 <= tokens <= self.max_tokens:
        raise ValueError(f"DepLayer: T={tokens} tokens per rank is outside [1, "
                         f"max_tokens={self.max_tokens}] the layer was built for")
    return tokens


def _old_peer_check_input(self, x) -> int:
    """``DepPeerLayer._check_input`` before the shared check, verbatim."""
    c = self.config
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2 \
            or x.shape[1] != c.hidden:
        got = (x.dtype, tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"DepPeerLayer: x must be BF16 [T, H={c.hidden}], got {got}")
    if x.device != self.device or not x.is_contiguous():
        raise ValueError(f"DepPeerLayer: x must be contiguous on {self.device}, got {x.device}")
    if not 1 <= x.shape[0] <= self.max_tokens:
        raise ValueError(f"DepPeerLayer: T={x.shape[0]} tokens is outside [1, "
                         f"max_tokens={self.max_tokens}] the layer was built for")
    return x.shape[0]


def _layer(cls):
    """A layer without its device work: what the input checks read."""
    layer = cls.__new__(cls)
    layer.config, layer.ranks, layer.max_tokens, layer.device = CFG, RANKS, MAX_TOKENS, DEVICE
    return layer


def _outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except Exception as error:  # the type and the words
        return (type(error).__name__, str(error))


def rows(t: int, *, hidden: int = CFG.hidden, dtype=torch.bfloat16, device="cpu"):
    return torch.zeros(t, hidden, dtype=dtype, device=device)


ONE_RANK = {
    "ok 1": rows(1), "ok 7": rows(7), "ok max": rows(MAX_TOKENS),
    "too many": rows(MAX_TOKENS + 1), "empty": rows(0),
    "fp32": rows(4, dtype=torch.float32), "wrong H": rows(4, hidden=CFG.hidden + 8),
    "1-d": torch.zeros(CFG.hidden, dtype=torch.bfloat16),
    "3-d": torch.zeros(1, 4, CFG.hidden, dtype=torch.bfloat16),
    "not a tensor": [[0.0] * CFG.hidden], "none": None,
    "other device": rows(4, device="meta"),
    "strided": torch.zeros(CFG.hidden, 4, dtype=torch.bfloat16).t(),
    "column slice": torch.zeros(4, 2 * CFG.hidden, dtype=torch.bfloat16)[:, :CFG.hidden],
    "fp32 and too many": rows(MAX_TOKENS + 1, dtype=torch.float32),
    "other device and too many": rows(MAX_TOKENS + 1, device="meta"),
}


@pytest.mark.parametrize("case", sorted(ONE_RANK))
def test_dep_peer_check_input_as_before(case):
    layer, x = _layer(DepPeerLayer), ONE_RANK[case]
    want = _outcome(_old_peer_check_input, layer, x)
    assert _outcome(layer._check_input, x) == want
    if case.startswith("ok"):
        assert want == ("ok", x.shape[0])


ALL_RANKS = {
    "ok": [rows(5)] * RANKS, "ok tuple": tuple([rows(MAX_TOKENS)] * RANKS),
    "one tensor": rows(5), "too few": [rows(5)] * (RANKS - 1),
    "too many ranks": [rows(5)] * (RANKS + 1), "none": None,
    "T differs": [rows(5), rows(5), rows(6)], "T differs first": [rows(6), rows(5), rows(5)],
    "too many T": [rows(MAX_TOKENS + 1)] * RANKS, "empty": [rows(0)] * RANKS,
    "last fp32": [rows(5), rows(5), rows(5, dtype=torch.float32)],
    "middle on meta": [rows(5), rows(5, device="meta"), rows(5)],
    "T differs, then bad": [rows(5), rows(6), rows(5, dtype=torch.float16)],
    "bad, then T differs": [rows(5), rows(5, hidden=8), rows(6)],
    "too many T, then bad": [rows(MAX_TOKENS + 1), rows(MAX_TOKENS + 1), None],
    "strided": [rows(5), torch.zeros(CFG.hidden, 5, dtype=torch.bfloat16).t(), rows(5)],
}


@pytest.mark.parametrize("case", sorted(ALL_RANKS))
def test_dep_check_inputs_as_before(case):
    layer, xs = _layer(DepLayer), ALL_RANKS[case]
    want = _outcome(_old_dep_check_inputs, layer, xs)
    assert _outcome(layer._check_inputs, xs) == want
    if case.startswith("ok"):
        assert want[0] == "ok"
