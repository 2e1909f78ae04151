"""The verification suite over pytest-xdist workers writes the report a plain run writes:
the workers hand their rows to the controller, which merges them (``verify/conftest.py``);
a worker that ends without its rows is a failed row; the real-dimension cases carry the
``real_dimensions`` marker that splits a GPU run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from verify import conftest as verify_conftest

ROOT = Path(__file__).resolve().parent.parent
#: a contract file with small and real-dimension (kimi_k3) cases that runs in seconds
SUBSET = "verify/test_router.py"


def _report(tmp_path: Path, name: str, *args: str) -> dict:
    out = tmp_path / name
    env = {**os.environ, "LATENTMOE_REPORT_DIR": str(out)}
    run = subprocess.run([sys.executable, "-m", "pytest", SUBSET, "-q", "-p", "no:cacheprovider",
                          *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads((out / "verify-report.json").read_text())


def test_report_over_workers_is_the_plain_runs(tmp_path):
    plain = _report(tmp_path, "plain")
    workers = _report(tmp_path, "workers", "-n", "2")
    assert plain["rows"], "the subset recorded no row"
    # every row, its counts, comparisons, worst ratios and skip reasons
    assert workers["rows"] == plain["rows"]
    assert workers["totals"] == plain["totals"]
    assert workers["backends"] == plain["backends"]
    assert workers["environment"]["workers"] == 2
    assert "workers" not in plain["environment"]


def _selected(*args: str) -> list[str]:
    run = subprocess.run([sys.executable, "-m", "pytest", SUBSET, "--collect-only", "-q",
                          "-p", "no:cacheprovider", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    return [line for line in run.stdout.splitlines() if "::" in line]


def test_real_dimensions_marker_splits_the_cases():
    every = _selected()
    real = _selected("-m", "real_dimensions")
    small = _selected("-m", "not real_dimensions")
    assert real and small
    assert sorted(real + small) == sorted(every)
    assert all("kimi_k3" in case for case in real)
    assert not any("kimi_k3" in case for case in small)


def _node(workeroutput=None):
    config = SimpleNamespace(stash={verify_conftest.WORKER_PARTS_KEY: []})
    node = SimpleNamespace(gateway=SimpleNamespace(id="gw3"), config=config)
    if workeroutput is not None:
        node.workeroutput = workeroutput
    return node, config


@pytest.mark.parametrize("error", [None, "Traceback ...\nRuntimeError: worker killed"])
def test_a_worker_without_its_report_is_a_failed_row(error):
    node, config = _node()
    verify_conftest.pytest_testnodedown(node, error)
    [(name, payload)] = config.stash[verify_conftest.WORKER_PARTS_KEY]
    assert name == "worker gw3"
    [row] = payload["rows"]
    assert row["contract"] == "xdist_worker_report" and row["failed"] == 1
    assert row["status"] == "FAIL"
    reason = "RuntimeError: worker killed" if error else "no output"
    assert row["failures"] == [f"worker gw3 ended without its report: {reason}"]


def test_a_workers_report_is_kept_as_sent():
    sent = {"environment": {"commit": "c"}, "backends": {}, "rows": [], "totals": {}}
    node, config = _node({verify_conftest.WORKER_OUTPUT: json.dumps(sent)})
    verify_conftest.pytest_testnodedown(node, None)
    assert config.stash[verify_conftest.WORKER_PARTS_KEY] == [("worker gw3", sent)]
