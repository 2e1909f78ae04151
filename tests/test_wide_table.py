"""``benchmarks.wide_table`` on the CPU: the render of a committed H200 run (the speed-up
column gives the front step's and the default (beside) step's ratio to the best stock
composition; a run made before the placements existed shows the front step's alone) and the
case set-up shared with ``benchmarks.wide_timeline`` on a stand-in layer."""

import json
from pathlib import Path

import pytest
import torch

from benchmarks import wide_table

RUN = Path(wide_table.__file__).resolve().parent / "results" / "h200" / "wide.json"


def _with_stock(result: dict) -> dict:
    """The committed run with a stock composition beside every case (the current run was
    timed without one): 1.6x and 1.7x the rank's time, two stock contestants."""
    for case in result["cases"]:
        med = case["median_us"]
        if not any(k.startswith("stock") for k in med):
            med["stock_triton_w4"] = 1.7 * med["rank"]
            med["stock_triton_w8"] = 1.6 * med["rank"]
    return result


def _row(text: str, tokens: int) -> list[str]:
    line = next(l for l in text.splitlines() if l.startswith(f"| {tokens} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_speed_up_of_front_and_beside():
    result = _with_stock(json.loads(RUN.read_text()))
    case = next(c for c in result["cases"] if c["tokens"] == 65)
    med = case["median_us"]
    stock = min(v for k, v in med.items() if k.startswith("stock"))
    cells = _row(wide_table.render(result), 65)
    assert cells[-1] == f"{stock / med['rank']:.2f}x / {stock / med['rank_beside']:.2f}x"
    assert "speed-up (front / beside)" in wide_table.render(result)


def test_a_run_without_placements_shows_the_front_speed_up_alone():
    result = _with_stock(json.loads(RUN.read_text()))
    for case in result["cases"]:
        for name in wide_table.PLACED:
            case["median_us"].pop(name)
    cells = _row(wide_table.render(result), 1024)
    assert cells[-1].endswith("x") and "/" not in cells[-1]
    assert cells[-3] == "- / -"


class _StandInEngine:
    """What the benchmarks use of an ``ExpertsEngine``."""

    class prepared:
        @staticmethod
        def expert_bytes():
            return 1000

    def __init__(self):
        self.live = torch.zeros(3, dtype=torch.int32)

    def live_counts(self):
        return self.live


class _StandInLayer:
    """What ``published_case`` and ``rearm_peers`` use of a ``WideLayer``, on the CPU."""

    def __init__(self, ranks=3):
        self.ranks, self.mailbox_index = ranks, 1
        self.mailboxes = [torch.zeros(2, 4) for _ in range(ranks)]
        self.front_weights = [torch.zeros(10, dtype=torch.bfloat16)] * ranks
        self.shared_gate_up = self.shared_down = self.up = self.front_weights
        self.engines = [_StandInEngine() for _ in range(ranks)]
        self.calls = []

    def __call__(self, x):
        return [type("O", (), {"ids": torch.tensor([[3, 5], [5, 7]])})()]

    def front_stage(self, r, x):
        return r

    def publish_stage(self, r, front, tokens):
        self.calls.append(("publish", r, front, tokens))
        self.mailboxes[0][self.mailbox_index] += 1  # every rank's publish lands in rank 0's box

    def route_stage(self, r, tokens):
        self.calls.append(("route", r, tokens))
        self.mailboxes[r][self.mailbox_index].zero_()  # the poll re-arms the slots it read
        self.engines[r].live += torch.tensor([2, 0, 1])  # and appends to the routing lists

    def check(self):
        self.calls.append(("check",))

    def reset(self):
        self.calls.append(("reset",))
        for box in self.mailboxes:
            box.zero_()  # armed
        for engine in self.engines:
            engine.live.zero_()


def test_published_case_snapshots_rank_0s_mailbox_after_every_publish():
    layer, flushes = _StandInLayer(), []
    case, before = wide_table.published_case(layer, None, 2, read_gbs=1.0,
                                             flush=lambda: flushes.append(1))
    # every publish, then one route of rank 0 for the lists its experts stage reads
    assert [c[:2] for c in layer.calls] == [("publish", 0), ("publish", 1), ("publish", 2),
                                            ("route", 0), ("check",)]
    # touched experts 3, 5, 7; dense bytes: 4 tensors of 10 BF16 values
    assert case == {"tokens": 2, "touched": 3, "bytes": 80 + 3 * 1000,
                    "limit_us": (80 + 3000) / 1e9 * 1e6}
    # left as the publishes left it: the mailbox full, no routing-list append
    assert layer.mailboxes[0][1].tolist() == [3.0] * 4
    assert layer.engines[0].live.tolist() == [0, 0, 0]
    assert set(before) == set(wide_table.POLLING) | {"experts"}
    layer.route_stage(0, 2)  # a replay that polls: re-arms the box, appends
    before["rank"]()
    assert layer.mailboxes[0][1].tolist() == [3.0] * 4 and flushes == [1]
    assert layer.engines[0].live.tolist() == [0, 0, 0]
    before["experts"]()  # the experts stage alone: the counters one route leaves
    assert layer.engines[0].live.tolist() == [2, 0, 1] and flushes == [1, 1]
    layer.calls.clear()
    layer.route_stage(1, 2)  # a peer's leftover appends
    layer.calls.clear()
    wide_table.rearm_peers(layer)
    assert layer.calls == [("check",), ("reset",)]
    assert [e.live.tolist() for e in layer.engines] == [[0, 0, 0]] * 3


def test_render_says_which_mode_ran():
    """A run's header names its GEMM mode: ``--batch-invariant`` (``WideLayer(
    batch_invariant=True)``, recorded as ``batch_invariant`` in the JSON) or cuBLAS, which
    every committed run before the flag used; in the mode, which GEMMs run on fast.gemm
    (``--invariant-gemms``: all four, or the front alone with the others on cuBLASLt)."""
    result = json.loads(RUN.read_text())
    assert "GEMMs on cuBLAS, split-K allowed (batch_invariant=False)" in wide_table.render(result)
    result["batch_invariant"] = True
    text = wide_table.render(result)
    assert "batch invariant (--batch-invariant" in text and "cuBLAS (the default)" not in text
    assert "the four GEMMs on fast.gemm" in text and "without split-K" not in text
    result["invariant_gemms"] = "stock"
    text = wide_table.render(result)
    assert "the front on fast.gemm" in text and "the four GEMMs" not in text
    assert "the other three on cuBLASLt without split-K (--invariant-gemms stock)" in text


def test_gemm_plan_cells_name_each_launch():
    """The per-case record of what rank 0's GEMMs launched: cuBLAS for the default, else
    each fast.gemm launch's tactic, token chunks and windows."""
    from fast.gemm.host import launch_for

    class Plain:
        def gemm_plan(self, r, tokens):
            return {}

    class Invariant:
        def gemm_plan(self, r, tokens):
            return {"front": launch_for(560, 7168, tokens, splits=8),
                    "up": launch_for(896, 3584, tokens, splits=8)}

    assert set(wide_table.gemm_plan_cells(Plain(), 65).values()) == {"cuBLAS"}
    assert wide_table.gemm_plan_cells(Invariant(), 1024) == {"front": "r64w2s8 x16c8w",
                                                              "up": "r128w4s8 x16c8w"}


def test_batch_invariant_flag_reaches_the_layer(layer_stand_in):
    """``--batch-invariant`` / ``--no-batch-invariant`` and ``--invariant-gemms`` reach the
    layer as named, and without them the layer keeps its own defaults (the run does not
    restate them); unless ``--invariant-forms`` names others, the layer's default forms (a
    stand-in layer records its arguments; the run stops there)."""
    import fast.schedules.wide as wide

    built = layer_stand_in(wide_table, wide, "WideLayer")
    for flag, want in (([], {}), (["--no-batch-invariant"], {"batch_invariant": False}),
                       (["--batch-invariant"], {"batch_invariant": True}),
                       (["--invariant-gemms", "fast"], {"invariant_gemms": "fast"})):
        built.clear()
        with pytest.raises(layer_stand_in.stop):
            wide_table.main(["--tokens", "65", *flag])
        named = {k: built[k] for k in ("batch_invariant", "invariant_gemms") if k in built}
        assert named == want and built["max_rows"] == 65
    # the forms: the layer's default "auto" unless named; "none" is no forms
    for flag, want in (([], "auto"), (["--invariant-forms", "none"], None),
                       (["--invariant-forms", "auto"], "auto")):
        built.clear()
        with pytest.raises(layer_stand_in.stop):
            wide_table.main(["--tokens", "65", "--batch-invariant", *flag])
        assert built["invariant_forms"] == want
