"""The DEP layer's routed data-movement kernels (``fast.schedules.dep_kernels``) compile for
every target, at the real widths and the small config's, for one rank and sixteen, for
virtual ranks and for real ranks (``peers``: the signalling variants and the arrival wait)
(no GPU needed; the H200 runs them in ``verify/test_dep_fast.py`` and
``verify/test_dep_peer.py``)."""

import pytest

from fast import backend
from model.config import LatentMoEConfig

_cute_error = backend.cute_import_error()


@pytest.mark.skipif(_cute_error is not None, reason=f"CuTe DSL not importable: {_cute_error}")
@pytest.mark.parametrize("arch", backend.TARGETS)
@pytest.mark.parametrize("config", ("kimi_k3", "small"))
@pytest.mark.parametrize("ranks", (1, 16))
@pytest.mark.parametrize("peers", (False, True), ids=("virtual", "peers"))
def test_dep_kernels_compile(arch, config, ranks, peers):
    from fast.schedules.dep import compile_all

    cfg = getattr(LatentMoEConfig, config)()
    assert len(compile_all(cfg, ranks, arch, peers=peers)) == (4 if peers else 3)
