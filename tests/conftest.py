"""Fixtures of the unit tests: a seed and a generator from the test's node id
(``verify.seeds.seed_of``, the same rule as the verification suite's); PyTorch's CPU
transcendental kernels warmed up in every test process (``verify.cpu_math``)."""

from __future__ import annotations

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
