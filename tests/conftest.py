"""Fixtures of the unit tests: a seed and a generator from the test's node id
(``verify.seeds.seed_of``, the same rule as the verification suite's); a stand-in layer for
the benchmark command lines; PyTorch's CPU transcendental kernels warmed up in every test
process (``verify.cpu_math``)."""

from __future__ import annotations

import types

import pytest
import torch

from verify import cpu_math
from verify.seeds import seed_of


def pytest_configure(config):
    cpu_math.warm_up()


@pytest.fixture
def seed(request) -> int:
    """A 31-bit seed from the md5 of the test's node id."""
    return seed_of(request.node.nodeid)


@pytest.fixture
def gen(seed) -> torch.Generator:
    """A CPU generator seeded with :func:`seed`."""
    return torch.Generator().manual_seed(seed)


class StandInStop(Exception):
    """Raised by :func:`layer_stand_in`'s layer: the benchmark run stops where the layer is
    built."""


@pytest.fixture
def layer_stand_in(monkeypatch):
    """``install(table, schedule, name) -> built``: the benchmark module ``table`` on the
    CPU with ``schedule.<name>`` (the layer class it builds) replaced by a stand-in that
    records its keyword arguments in ``built`` and raises ``install.stop``
    (:class:`StandInStop`); the real weights, the L2 flush, the read-bandwidth probe and the
    device name are stood in too."""
    import verify.cases

    def install(table, schedule, name: str) -> dict:
        built = {}

        def layer(weights, **kw):
            built.update(kw)
            raise StandInStop

        monkeypatch.setattr(schedule, name, layer)
        monkeypatch.setattr(verify.cases, "device_weights",
                            lambda config_name: types.SimpleNamespace(config=None))
        monkeypatch.setattr(table, "l2_flush", lambda: None)
        monkeypatch.setattr(table, "read_bandwidth_gbs", lambda: 1.0)
        monkeypatch.setattr(table.torch.cuda, "get_device_name", lambda: "stand-in")
        return built

    install.stop = StandInStop
    return install
