"""The schedules on real processes: under ``torchrun`` every rank runs the same
per-rank code as the virtual world on a ``TorchGroup`` (NCCL on GPUs, gloo on CPUs) and its
trace must equal the virtual run's bit for bit.

Run it with::

    torchrun --standalone --nproc-per-node 2 -m pytest verify/ -m multi_gpu

(without torchrun these cases skip, saying so). Every process builds the same weights
(one seed) and every rank's inputs, so each can replay the virtual run locally.
"""

from __future__ import annotations

import pytest

from reference.schedules.groups import TorchGroup
from reference.schedules.dep import dep_layer_virtual, dep_rank
from reference.schedules.launch import make_inputs, trace_tensors
from reference.schedules.wide import wide_layer_virtual, wide_rank
from verify import cases

pytestmark = [pytest.mark.multi_gpu(2), pytest.mark.config("small")]


@pytest.fixture(scope="module")
def group(process_group):
    return TorchGroup()


def _compare(contract, real: dict, virtual: dict, what: str) -> None:
    assert real.keys() == virtual.keys(), (what, sorted(real), sorted(virtual))
    for name, v in virtual.items():
        pairs = zip(real[name], v) if isinstance(v, list) else [(real[name], v)]
        for i, (a, b) in enumerate(pairs):
            contract.bitwise(a, b, what=f"{what}.{name}[{i}]")


@pytest.mark.parametrize("tokens", (1, 7, 64))
def test_dep_real_ranks(group, tokens, contract):
    cfg, w = cases.config("small"), cases.weights("small")
    xs = make_inputs(cfg.hidden, "dep", group.size, tokens, seed=tokens)
    real = trace_tensors(dep_rank(group, xs[group.rank], w, cfg))
    virtual = trace_tensors(dep_layer_virtual(xs, w, cfg)[group.rank])
    _compare(contract, real, virtual, f"DEP rank {group.rank}/{group.size}")


@pytest.mark.parametrize("tokens", (1, 65, 100))
def test_wide_real_ranks(group, tokens, contract):
    cfg, w = cases.config("small"), cases.weights("small")
    if not cfg.supports_ranks(group.size):
        pytest.skip(f"the small config does not split over {group.size} TP ranks")
    xs = make_inputs(cfg.hidden, "wide", group.size, tokens, seed=tokens)
    real = trace_tensors(wide_rank(group, xs[group.rank], w, cfg))
    virtual = trace_tensors(wide_layer_virtual(xs[0], w, group.size, cfg)[group.rank])
    _compare(contract, real, virtual, f"wide rank {group.rank}/{group.size}")
