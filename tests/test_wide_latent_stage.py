"""``WideStages.latent_stage``'s wait for the shared expert on the CPU (the launches
recorded instead of run): by default the current stream waits for the side stream's event
of the last shared stage before the addmm; ``wait_shared=False`` launches the same work
without that wait and leaves the event as it was; and ``benchmarks.wide_table`` times its
``latent`` stage through that parameter (no private attribute set). The GPU runs the
stage in ``verify/test_wide_fast.py`` and ``verify/test_wide_peer.py``."""

from __future__ import annotations

import pytest
import torch

from fast.schedules import wide
from reference.config import LatentMoEConfig

CFG = LatentMoEConfig.small()
ROWS, RANKS = 80, 2


class Recorder:
    def __init__(self):
        self.log = []

    def stream(self, device=None):
        return self

    def wait_event(self, event):
        self.log.append(("wait", event))


class Rank(wide.WideStages):
    """Rank 1 of two: what ``latent_stage`` reads, on the CPU."""

    def __init__(self, log):
        c, on = CFG, dict(dtype=torch.bfloat16)
        self.config, self.ranks, self.device = c, RANKS, torch.device("cpu")
        self.columns = c.hidden // RANKS
        self._buffers = {1: dict(routed=torch.zeros(ROWS, c.latent, **on),
                                 normed=torch.zeros(ROWS, c.latent, **on),
                                 up=torch.zeros(ROWS, self.columns, **on),
                                 shared=torch.zeros(ROWS, c.hidden, **on))}
        self.up = {1: torch.zeros(self.columns, c.latent, **on)}
        self.partial_table = torch.zeros(RANKS, dtype=torch.int64)
        self.latent_norm = torch.ones(c.latent, **on)
        self._fn = {"latent_all_reduce": lambda *args: log.append(("all_reduce",))}
        self._shared_ready = {1: "side event"}


@pytest.fixture
def launches(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(wide.backend, "stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "current_stream", rec.stream)
    monkeypatch.setattr(wide, "_addmm_bf16_into",
                        lambda c, a, b, out: rec.log.append(("addmm", tuple(c.shape),
                                                             tuple(out.shape))))
    return rec


def test_latent_stage_waits_for_the_shared_expert_by_default(launches):
    layer = Rank(launches.log)
    layer.latent_stage(1, 70)
    assert launches.log == [("all_reduce",), ("wait", "side event"),
                            ("addmm", (70, CFG.hidden // RANKS), (70, CFG.hidden // RANKS))]
    launches.log.clear()
    layer.latent_stage(1, 70, wait_shared=True)
    assert launches.log[1] == ("wait", "side event")


def test_latent_stage_without_the_wait(launches):
    layer = Rank(launches.log)
    layer.latent_stage(1, 70, wait_shared=False)
    assert launches.log == [("all_reduce",),
                            ("addmm", (70, CFG.hidden // RANKS), (70, CFG.hidden // RANKS))]
    assert layer._shared_ready == {1: "side event"}, "the event is left as it was"


def test_latent_stage_after_a_serial_shared_stage(launches):
    layer = Rank(launches.log)
    layer._shared_ready[1] = None
    for wait_shared in (True, False):
        launches.log.clear()
        layer.latent_stage(1, 70, wait_shared=wait_shared)
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
