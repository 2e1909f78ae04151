"""The power of the verification suite (DESIGN §4.6): planted bugs must make it fail.

Each mutation copies ``reference/``, ``fast/`` and ``verify/`` to a temporary directory,
replaces one exact snippet (which must occur exactly once, so a mutation never silently
stops applying when the code changes), and runs the named ``verify/`` contracts there
with ``pytest -x``. The mutation is *caught* when pytest reports failed tests (exit code
1); an import or collection error (exit code 2-4) or "no tests" (5) is not a catch. The
contracts named are a subset of ``pytest verify/``, so a catch there is a catch of the
whole suite.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    old: str
    new: str
    contracts: tuple[str, ...]
    needs_gpu: bool = False


MUTATIONS = [
    Mutation(
        "MXFP8 scale rule FLOOR instead of RCEIL", "reference/mx.py",
        "def quantize_mxfp8(\n    x: torch.Tensor, *, scale_rule: ScaleRule = ScaleRule.RCEIL",
        "def quantize_mxfp8(\n    x: torch.Tensor, *, scale_rule: ScaleRule = ScaleRule.FLOOR",
        ("verify/test_mx.py",),
    ),
    Mutation(
        "element ties rounded away from even", "reference/mx.py",
        "return torch.round(a.mul_(inv_quantum)), binade",
        "return torch.floor(a.mul_(inv_quantum) + 0.5), binade",
        ("verify/test_mx.py",),
    ),
    Mutation(
        "SiTU gate and up swapped", "reference/activation.py",
        "    g = gate.float()\n    u = up.float()",
        "    g = up.float()\n    u = gate.float()",
        ("verify/test_activation.py", "verify/test_quality.py"),
    ),
    Mutation(
        "finalize k order reversed", "reference/finalize.py",
        "    for j in range(k):\n        acc = fma_f32(",
        "    for j in reversed(range(k)):\n        acc = fma_f32(",
        ("verify/test_dep.py",),
    ),
    Mutation(
        "DEP owner partial finalize: two k swapped", "reference/schedules/dep.py",
        "    for j in range(k):\n        w = weights[:, j : j + 1]",
        "    for j in [1, 0, *range(2, k)]:\n        w = weights[:, j : j + 1]",
        ("verify/test_dep.py",),
    ),
    Mutation(
        "DEP combine in reversed owner order", "reference/schedules/dep.py",
        "    for p, m in zip(parts, present):",
        "    for p, m in zip(reversed(parts), reversed(present)):",
        ("verify/test_dep.py::test_combine_order_designed",),
    ),
    Mutation(
        "mailbox writer skips the -0 sanitize", "reference/schedules/comm.py",
        "lat = sanitize_negative_zero(latent_bf16.detach().cpu().contiguous().view(torch.int16))",
        "lat = latent_bf16.detach().cpu().contiguous().view(torch.int16)",
        ("verify/test_wide.py::test_mailbox_sentinel",),
    ),
    Mutation(
        "wide routing list read one short", "reference/schedules/wide.py",
        "pairs = lists[e, : counts[e]].to(torch.int64)",
        "pairs = lists[e, : counts[e] - 1].to(torch.int64)",
        ("verify/test_wide.py",),
    ),
    Mutation(
        "router renormalization skipped", "reference/router.py",
        "    if renormalize:\n", "    if False:\n",
        ("verify/test_router.py",),
    ),
    Mutation(
        "router weights from the biased scores", "reference/router.py",
        "w = torch.gather(scores, 1, ids)", "w = torch.gather(biased, 1, ids)",
        ("verify/test_router.py",),
    ),
    Mutation(
        "fast finalize kernel: k order reversed", "fast/finalize.py",
        "            for k in cutlass.range_constexpr(top_k):\n                w = cute.arch.load(",
        "            for k in reversed(range(top_k)):\n                w = cute.arch.load(",
        ("verify/test_finalize.py",), needs_gpu=True,
    ),
]


def _apply(tree: Path, m: Mutation) -> None:
    for package in ("reference", "fast", "verify"):
        shutil.copytree(ROOT / package, tree / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    target = tree / m.path
    text = target.read_text()
    count = text.count(m.old)
    assert count == 1, f"{m.name}: the snippet occurs {count} times in {m.path}, not once"
    target.write_text(text.replace(m.old, m.new))


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name)
def test_planted_bug_fails_verify(mutation, tmp_path):
    if mutation.needs_gpu and not torch.cuda.is_available():
        pytest.skip("this mutation is in GPU code; the contracts that catch it need a GPU")
    _apply(tmp_path, mutation)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, LATENTMOE_REPORT_DIR=str(tmp_path),
               PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", *mutation.contracts, "-x", "-q",
           "-p", "no:cacheprovider", "--rootdir", str(tmp_path)]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    tail = (done.stdout + done.stderr)[-3000:]
    assert done.returncode == 1, (
        f"planted bug '{mutation.name}' was NOT caught by {mutation.contracts} "
        f"(pytest exit {done.returncode}):\n{tail}")
    assert " failed" in done.stdout, tail
