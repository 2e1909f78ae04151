"""One timeout type for the arrival wait (``fast.device.arrival.ArrivalTimeout``): the DEP
and wide layers over real ranks raise it from one message builder (on the CPU: the GPU
contracts ``verify/test_dep_peer.py`` and ``verify/test_wide_peer.py`` time a wait out)."""

from __future__ import annotations

import pytest

from fast import backend

_cute_error = backend.cute_import_error()
pytestmark = pytest.mark.skipif(_cute_error is not None,
                                reason=f"CuTe DSL not importable: {_cute_error}")


def test_one_timeout_type_for_both_layers():
    from fast.device import arrival
    from fast.schedules import dep_peer, wide_peer

    assert issubclass(arrival.ArrivalTimeout, TimeoutError)
    for module in (dep_peer, wide_peer):
        own = [name for name, value in vars(module).items()
               if isinstance(value, type) and issubclass(value, BaseException)
               and value.__module__ == module.__name__]
        assert own == [], f"{module.__name__} defines its own exception types {own}"


def test_wait_timeout_message():
    from fast.device.arrival import WAIT_ERROR_FIELDS, ArrivalTimeout, wait_timeout_message

    record = dict(zip(WAIT_ERROR_FIELDS, (1, 0, 1, 3, 7, 8)))
    error = ArrivalTimeout(wait_timeout_message("DEP", ("receive rows", "owner partials"),
                                                record, 4, 0.2))
    with pytest.raises(TimeoutError, match=r"^DEP rank 0 of 4: the owner partials from rank 3 "
                                           r"did not arrive within 0.2 s \(its counter here "
                                           r"read 7, the call needed 8\)"):
        raise error
