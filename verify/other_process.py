"""A layer's stage outputs computed in a second Python process, for the contracts that
hold a call's bits independent of the process (addresses, allocator state, compile
caches): ``verify/test_dep_fast.py`` and ``verify/test_wide_fast.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

__all__ = ["stages_in_another_process", "check_same_bits_as_another_process"]

ROOT = Path(__file__).resolve().parents[1]


def stages_in_another_process(build: str, call: str, stages, saved: Path,
                              timeout_s: float = 600) -> list[dict]:
    """Per rank, ``{stage: CPU tensor}`` of ``stages`` from a fresh interpreter (the
    repository on ``PYTHONPATH``) that runs ``build`` (Python statements defining ``layer``;
    ``torch`` and ``verify.cases`` imported) and then the expression ``call`` (the layer's
    outputs, one per rank), saved through ``saved``. A failing process fails with the end
    of its standard error."""
    script = ("import sys, torch\nfrom verify import cases\n" + build + "\n"
              f"outs = {call}\n"
              f"torch.save([{{n: getattr(o, n).cpu() for n in {tuple(stages)!r}}} for o in outs], "
              "sys.argv[1])\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-c", script, str(saved)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(saved)


def check_same_bits_as_another_process(contract, outs, build: str, call: str, stages,
                                       saved: Path, index_names) -> None:
    """``outs`` (this process's outputs of the layer, one per rank) bitwise equal, at every
    stage of ``stages``, to :func:`stages_in_another_process` of ``build`` and ``call``
    (the same layer, weights and inputs), through ``contract.bitwise``."""
    theirs = stages_in_another_process(build, call, stages, saved)
    for r, o in enumerate(outs):  # contract.bitwise compares bytes: -0 is not +0, NaN payloads count
        for name in stages:
            contract.bitwise(getattr(o, name).cpu(), theirs[r][name],
                             what=f"rank {r} {name}: this process vs another",
                             index_names=index_names)
