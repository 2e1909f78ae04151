"""``python -m verify.plan``: what a node of another architecture would run of ``verify/``,
decided on this machine. On a Blackwell node (sm_100a, sm_103a) no contract of the fast
backend may be skipped for a reason other than the hardware the run lacks (more GPUs, an
sm_90a instruction), and the schedule contracts run the Blackwell experts engine; every
run-time skip of a contract body is one the plan evaluates."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from verify import plan as verify_plan

ROOT = Path(__file__).resolve().parents[1]
BLACKWELL = ("sm_100a", "sm_103a")


@functools.cache
def _plan(arch: str, world_size: int = 1) -> list[dict]:
    """The plan's cases for ``arch``, from the command line (a process of its own: the
    plan runs pytest's collection of ``verify/``)."""
    out = Path(tempfile.mkdtemp()) / f"plan-{arch}-{world_size}.json"
    try:
        done = subprocess.run([sys.executable, "-m", "verify.plan", "--arch", arch,
                               "--world-size", str(world_size), "--json", str(out)],
                              cwd=ROOT, capture_output=True, text=True, timeout=1200)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return json.loads(out.read_text())["cases"]
    finally:
        out.unlink(missing_ok=True)
        out.parent.rmdir()


@pytest.mark.parametrize("arch", BLACKWELL)
def test_no_fast_contract_skipped_on_blackwell_but_for_missing_hardware(arch):
    cases = _plan(arch)
    fast = [c for c in cases if c["backend"] == "fast"]
    assert len(fast) > 100, f"only {len(fast)} fast cases collected"
    bad = [(c["nodeid"], c["category"], c["reason"]) for c in fast
           if c["status"] == "skip" and c["category"] != "hardware"]
    assert not bad, f"fast contracts skipped on {arch} for another reason than hardware: {bad}"
    hardware = {c["reason"] for c in fast if c["status"] == "skip"}
    allowed = ("processes launched with torchrun", "wgmma is an sm_90a instruction")
    assert all(any(a in r for a in allowed) for r in hardware), hardware
    runs = [c for c in fast if c["status"] == "run"]
    assert len(runs) > len(fast) // 2, f"{len(runs)} of {len(fast)} fast cases run on {arch}"


@pytest.mark.parametrize("arch", BLACKWELL)
def test_schedule_contracts_run_the_blackwell_engine(arch):
    """Every DEP contract's layer runs ``BlackwellExpertsEngine``; every wide contract's
    does at the rank counts whose slices it tiles, and ``ExpertsEngine``'s ``mma.sync``
    kernels compiled for the same target only at the others (a slice ``I/N % 128 != 0``:
    the small config over 4 ranks, kimi_k3 over 16)."""
    from fast.experts.select import blackwell_tiling_error

    cases = [c for c in _plan(arch) if Path(c["nodeid"].split("::")[0]).name
             in verify_plan.SCHEDULE_FILES]
    assert len(cases) > 20
    for c in cases:
        schedule = verify_plan.SCHEDULE_FILES[Path(c["nodeid"].split("::")[0]).name]
        if schedule == "dep":
            assert c["engine"] == "BlackwellExpertsEngine", c
        elif c["engine"] == "ExpertsEngine":
            cfg = verify_plan.contract_config(c["config"])
            assert c["ranks"] and blackwell_tiling_error(cfg, (0, c["ranks"])), c
        else:
            assert "BlackwellExpertsEngine" in c["engine"], c
    assert sum(c["engine"] == "BlackwellExpertsEngine" for c in cases) > len(cases) // 2


def test_hopper_plan_keeps_the_hopper_engine_and_cpu_skips_for_no_gpu():
    hopper = _plan("sm_90a")
    schedule = [c for c in hopper if Path(c["nodeid"].split("::")[0]).name
                in verify_plan.SCHEDULE_FILES]
    assert schedule and all(c["engine"] == "ExpertsEngine" for c in schedule)
    assert not [c for c in hopper if c["backend"] == "fast" and c["status"] == "skip"
                and "wgmma" in (c["reason"] or "")]
    cpu = _plan("cpu")
    fast = [c for c in cpu if c["backend"] == "fast"]
    assert fast and all(c["status"] == "skip" and c["category"] == "no-gpu" for c in fast)
    assert any(c["status"] == "run" for c in cpu if c["backend"] == "reference")


def test_plan_evaluates_every_runtime_skip_of_the_contracts():
    """Each function of ``verify/test_*.py`` that calls ``pytest.skip`` or
    ``pytest.importorskip`` has its evaluation in ``RUNTIME_SKIPS``, and each evaluation
    is of such a function (a new skip in a contract body must be taught to the plan)."""
    found = {(path.name, name) for path in sorted((ROOT / "verify").glob("test_*.py"))
             for name in verify_plan.skip_calls(path)}
    assert found == set(verify_plan.RUNTIME_SKIPS)


class _Item:
    def __init__(self, *markers):
        self.markers = {m.name: m for m in markers}

    def get_closest_marker(self, name):
        return self.markers.get(name)


def _marker(name, *args):
    return SimpleNamespace(name=name, args=args, kwargs={})


@pytest.mark.parametrize("markers,capability,world,skips", [
    (("gpu",), None, 1, "needs a CUDA GPU"),
    (("gpu",), (10, 3), 1, None),
    (("sm100",), (10, 0), 1, None),
    (("sm100",), (10, 3), 1, None),
    (("sm100",), (9, 0), 1, "SM100/SM103"),
    (("sm90",), (10, 0), 1, "SM90"),
    (("multi_gpu",), (9, 0), 1, "needs 2 processes"),
    (("multi_gpu",), (9, 0), 2, None),
])
def test_hardware_skip_reason(markers, capability, world, skips):
    """The markers' rule the suite applies to this machine and the plan to another."""
    reason = verify_plan.hardware_skip_reason(_Item(*(_marker(m) for m in markers)),
                                              capability, world)
    assert (reason is None) if skips is None else (skips in reason), reason


def test_plan_refuses_an_unknown_arch():
    with pytest.raises(ValueError, match="arch must be one of"):
        verify_plan.plan("sm_80")
