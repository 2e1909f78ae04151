"""``verify/other_process.py`` on the CPU: a second interpreter builds a stand-in layer and
its stage outputs come back per rank, bit for bit; a failing build fails with its error."""

from __future__ import annotations

import pytest
import torch

from verify.other_process import stages_in_another_process


def test_stage_outputs_come_back_from_another_process(tmp_path):
    build = ("import types\n"
             "def layer(x):\n"
             "    return [types.SimpleNamespace(a=x * (r + 1), b=x.half()) for r in range(2)]")
    got = stages_in_another_process(build, "layer(torch.arange(5.0) / 3)", ("a", "b"),
                                    tmp_path / "out.pt", timeout_s=120)
    x = torch.arange(5.0) / 3
    assert len(got) == 2
    for r, stages in enumerate(got):
        assert torch.equal(stages["a"], x * (r + 1)) and torch.equal(stages["b"], x.half())


def test_a_failing_process_fails_with_its_error(tmp_path):
    with pytest.raises(AssertionError, match="planted failure"):
        stages_in_another_process("raise RuntimeError('planted failure')", "[]", ("a",),
                                  tmp_path / "out.pt", timeout_s=120)


class _Contract:
    """Records ``bitwise`` checks as the verify contract would judge them."""

    def __init__(self):
        self.checks = []

    def bitwise(self, got, want, *, what, index_names=None):  # bytes, as the contract does
        self.checks.append((what, torch.equal(got.view(torch.int32), want.view(torch.int32))))


def test_check_compares_every_stage_of_every_rank_as_bits(tmp_path):
    import types

    build = ("import types\n"
             "def layer(x):\n"
             "    return [types.SimpleNamespace(a=x + r, z=-x * 0) for r in range(2)]")
    x = torch.arange(4.0)
    outs = [types.SimpleNamespace(a=x + r, z=x * 0) for r in range(2)]  # +0, theirs -0
    contract = _Contract()
    from verify.other_process import check_same_bits_as_another_process

    check_same_bits_as_another_process(contract, outs, build, "layer(torch.arange(4.0))",
                                       ("a", "z"), tmp_path / "out.pt", ("row",))
    assert [w for w, _ in contract.checks] == [f"rank {r} {n}: this process vs another"
                                               for r in range(2) for n in ("a", "z")]
    assert [ok for _, ok in contract.checks] == [True, False, True, False]  # -0 is not +0
