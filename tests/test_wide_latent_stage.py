"""``fast.schedules.wide_program.latent_stage``'s wait for the shared expert on the CPU
(the launches recorded instead of run): by default the current stream waits for the side
stream's event of the last shared stage (the rank's ``shared_ready``) before the addmm; ``wait_shared=False`` launches the same work
without that wait and leaves the event as it was; and ``benchmarks.wide_table`` times its
``latent`` stage through that parameter (no private attribute set). The GPU runs the
stage in ``verify/test_wide_fast.py`` and ``verify/test_wide_peer.py``."""

from __future__ import annotations

import pytest
import torch

from fast.schedules import wide_program
from model.config import LatentMoEConfig

CFG = LatentMoEConfig.small()
ROWS, RANKS = 80, 2


class Recorder:
    def __init__(self):
        self.log = []

    def stream(self, device=None):
        return self

    def wait_event(self, event):
        self.log.append(("wait", event))


def Rank(log, index=1):
    """Rank 1 of two: what ``latent_stage`` reads, on the CPU (the fields it does not read
    left None); its up buffer is the one of mailbox buffer ``index``."""
    c, on = CFG, dict(dtype=torch.bfloat16)
    columns = c.hidden // RANKS
    up_columns = [None, None]
    up_columns[index] = torch.zeros(ROWS, columns, **on)
    return wide_program.WideRank(
        config=c, rank=1, ranks=RANKS, max_rows=ROWS, device=torch.device("cpu"), timeout_s=1.0,
        front_weights=None, shared_gate_up=None, shared_down=None,
        up=torch.zeros(columns, c.latent, **on), bias=None,
        latent_norm=torch.ones(c.latent, **on), engine=None,
        buffers=dict(routed=torch.zeros(ROWS, c.latent, **on),
                     normed=torch.zeros(ROWS, c.latent, **on)),
        mailbox=None, shared=(None, None), up_columns=tuple(up_columns), mailbox_table=None,
        partial_table=torch.zeros(RANKS, dtype=torch.int64), shared_tables=(None, None),
        up_tables=(None, None), error=None, side=None,
        kernels={"latent_all_reduce": lambda *args: log.append(("all_reduce",))},
        shared_ready="side event")


@pytest.fixture
def launches(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(wide_program.backend, "stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "current_stream", rec.stream)
    monkeypatch.setattr(wide_program, "_addmm_bf16_into",
                        lambda c, a, b, out, split_k=True: rec.log.append(("addmm", tuple(c.shape),
                                                             tuple(out.shape))))
    return rec


def test_latent_stage_waits_for_the_shared_expert_by_default(launches):
    rank = Rank(launches.log)
    wide_program.latent_stage(rank, 70, 1)
    assert launches.log == [("all_reduce",), ("wait", "side event"),
                            ("addmm", (70, CFG.hidden // RANKS), (70, CFG.hidden // RANKS))]
    launches.log.clear()
    wide_program.latent_stage(rank, 70, 1, wait_shared=True)
    assert launches.log[1] == ("wait", "side event")


def test_latent_stage_writes_the_up_buffer_of_the_call(launches):
    """The up columns of mailbox buffer ``index`` (a real rank's rotate with it)."""
    for index in (0, 1):
        launches.log.clear()
        wide_program.latent_stage(Rank(launches.log, index=index), 70, index)
        assert [e[0] for e in launches.log] == ["all_reduce", "wait", "addmm"]


def test_latent_stage_without_the_wait(launches):
    rank = Rank(launches.log)
    wide_program.latent_stage(rank, 70, 1, wait_shared=False)
    assert launches.log == [("all_reduce",),
                            ("addmm", (70, CFG.hidden // RANKS), (70, CFG.hidden // RANKS))]
    assert rank.shared_ready == "side event", "the event is left as it was"


def test_latent_stage_after_a_serial_shared_stage(launches):
    rank = Rank(launches.log)
    rank.shared_ready = None
    for wait_shared in (True, False):
        launches.log.clear()
        wide_program.latent_stage(rank, 70, 1, wait_shared=wait_shared)
        assert [e[0] for e in launches.log] == ["all_reduce", "addmm"]


def test_wide_table_times_latent_without_the_wait():
    """``fast_stages``' ``latent``: the stage without the shared expert's wait, through the
    public parameter (the private event untouched)."""
    from benchmarks.wide_table import fast_stages

    class Layer:
        def __init__(self):
            self.calls, self._shared_ready = [], ["event of another capture"]

        def front_stage(self, r, x):
            return x

        def latent_stage(self, *args, **kwargs):
            self.calls.append((args, kwargs))

    layer = Layer()
    fast_stages(layer, torch.zeros(3, 4), 3)["latent"]()
    assert layer.calls == [((0, 3), {"wait_shared": False})]
    assert layer._shared_ready == ["event of another capture"]
