"""One timeout type for the waits on peers (``fast.device.arrival.ArrivalTimeout``): the DEP
and wide layers over real ranks raise it for an arrival wait from one builder
(``wait_timeout``), and both wide layers for a mailbox poll (``fast.schedules.wide.
mailbox_timeout``), each with the waiting rank, what it waited for and the peer (on the
CPU: the GPU contracts ``verify/test_dep_peer.py``, ``verify/test_wide_fast.py`` and
``verify/test_wide_peer.py`` time a wait and a poll out)."""

from __future__ import annotations

import pytest

from fast import backend

_cute_error = backend.cute_import_error()
pytestmark = pytest.mark.skipif(_cute_error is not None,
                                reason=f"CuTe DSL not importable: {_cute_error}")


def test_one_timeout_type_for_both_layers():
    from fast.device import arrival
    from fast.schedules import dep, dep_peer, dep_program, wide, wide_peer, wide_program

    assert issubclass(arrival.ArrivalTimeout, TimeoutError)
    for module in (dep, dep_peer, dep_program, wide, wide_peer, wide_program):
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


def test_wait_timeout_names_rank_wait_and_peer():
    from fast.device.arrival import WAIT_ERROR_FIELDS, ArrivalTimeout, wait_timeout

    record = dict(zip(WAIT_ERROR_FIELDS, (1, 2, 0, 1, 5, 6)))
    error = wait_timeout("wide", ("routed partials", "hidden partials"), record, 4, 1.5)
    assert isinstance(error, ArrivalTimeout)
    assert (error.rank, error.what, error.peer) == (2, "routed partials", 1)
    assert str(error).startswith("wide rank 2 of 4: the routed partials from rank 1 did not "
                                 "arrive within 1.5 s")


@pytest.mark.parametrize("region,offset,writer", [
    ("latent", 0, 0), ("latent", 127, 0), ("latent", 128, 1), ("latent", 255, 1),
    ("logit", 0, 0), ("logit", 63, 0), ("logit", 64, 1), ("logit", 127, 1)])
def test_mailbox_timeout_names_reader_and_writer(region, offset, writer):
    """A poll's timeout (the small config, two ranks): ``what`` is ``"mailbox"``, the peer
    is the writer of the first empty 16-bit column (latent columns ``[w L/N, (w+1) L/N)``
    are rank ``w``'s; then ``2 E/N`` logit words per rank)."""
    from fast.device.arrival import ArrivalTimeout
    from fast.schedules.wide import mailbox_timeout
    from model.config import LatentMoEConfig

    cfg = LatentMoEConfig.small()
    assert (cfg.latent, cfg.experts) == (256, 64), "the columns above are the small config's"
    column = offset if region == "latent" else cfg.latent + offset
    record = dict(flag=1, rank=1, buffer=0, token=7, column=column, granules=3)
    error = mailbox_timeout("WideLayer", cfg, 2, record, 0.05, "Reset.")
    assert isinstance(error, ArrivalTimeout)
    assert (error.rank, error.what, error.peer) == (1, "mailbox", writer)
    assert str(error).startswith(f"WideLayer: rank 1 timed out polling mailbox buffer 0: token 7, "
                                 f"column {column} (16-bit word, {region} region written by "
                                 f"rank {writer}) still empty after 0.05 s; 3 16-byte granules "
                                 "timed out. Reset.")
