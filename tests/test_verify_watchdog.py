"""``verify.watchdog``: a case that runs past its limit ends its process with its traceback in
the log (a hung GPU kernel cannot be interrupted otherwise); cases that finish leave no log."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from verify.watchdog import parse_case_timeout

ROOT = Path(__file__).resolve().parents[1]

_CONFTEST = """
from pathlib import Path
from verify.watchdog import CaseWatchdog

def pytest_configure(config):
    config.pluginmanager.register(CaseWatchdog(2.0, Path.cwd()), "watchdog")
"""


def _run(tmp_path: Path, body: str) -> tuple[subprocess.CompletedProcess, float]:
    (tmp_path / "conftest.py").write_text(_CONFTEST)
    (tmp_path / "test_case.py").write_text(body)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "test_case.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    return done, time.monotonic() - start


def test_a_case_past_its_limit_ends_the_process_with_its_traceback(tmp_path):
    done, took = _run(tmp_path, "import time\n\ndef test_quick():\n    pass\n\n"
                                "def test_hangs():\n    time.sleep(60)\n")
    assert done.returncode != 0 and took < 50, (done.returncode, took, done.stdout[-500:])
    (log,) = tmp_path.glob("verify-watchdog-*.log")
    text = log.read_text()
    assert "case test_case.py::test_hangs: limit 2 s" in text
    assert "Timeout" in text and "in test_hangs" in text


def test_cases_that_finish_leave_no_log(tmp_path):
    done, _ = _run(tmp_path, "def test_quick():\n    pass\n")
    assert done.returncode == 0, done.stdout[-500:]
    assert not list(tmp_path.glob("verify-watchdog-*.log"))


@pytest.mark.parametrize("text,seconds", [("1200", 1200.0), ("2.5", 2.5), ("0", None)])
def test_case_timeout_values(text, seconds):
    assert parse_case_timeout(text) == seconds


@pytest.mark.parametrize("text", ["-1", "soon", "nan"])
def test_case_timeout_refuses_what_is_not_seconds(text):
    with pytest.raises(pytest.UsageError, match="--case-timeout"):
        parse_case_timeout(text)
