"""A watchdog per case: a case that runs past ``--case-timeout`` seconds ends its process.

A GPU kernel that never finishes (a ring whose barriers wait for a slot nobody releases)
blocks the test's thread inside CUDA, where no Python-level timeout can interrupt it, and a
suite left like that writes no report. So every case runs under ``faulthandler``'s
watchdog (a C thread, independent of the interpreter lock): past its limit it writes every
thread's traceback to ``verify-watchdog-<pid>.log`` in the working directory (the case's
own frames name it) and exits the process with status 1. Under pytest-xdist the controller
then reports the worker as crashed while running that case, and the suite's report has a
failed row for it (``verify.conftest``); a single process ends with the log as its record.

``--case-timeout 0`` turns it off. The default, :data:`DEFAULT_CASE_TIMEOUT_S`, is well
above the slowest case measured (a real-dimension module's first case, which builds its
layers: about two minutes on an H100); a time-limited device call sets a shorter one.
"""

from __future__ import annotations

import faulthandler
import os
from pathlib import Path

import pytest

__all__ = ["DEFAULT_CASE_TIMEOUT_S", "parse_case_timeout", "CaseWatchdog"]

#: seconds a case may run before the watchdog ends its process
DEFAULT_CASE_TIMEOUT_S = 1200.0


def parse_case_timeout(text) -> float | None:
    """``--case-timeout``'s value as seconds, or None for 0 (off); a UsageError for a value
    that is not a non-negative number."""
    try:
        seconds = float(text)
    except (TypeError, ValueError):
        seconds = -1.0
    if not seconds >= 0:
        raise pytest.UsageError(f"--case-timeout takes seconds >= 0 (0: off), got {text!r}")
    return seconds or None


class CaseWatchdog:
    """The pytest plugin: arms the watchdog around each case's setup, call and teardown."""

    def __init__(self, seconds: float, log_dir: Path):
        self.seconds = seconds
        self.log_path = Path(log_dir) / f"verify-watchdog-{os.getpid()}.log"
        self._log = None

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        if self._log is None:
            self._log = open(self.log_path, "w")
        self._log.write(f"case {item.nodeid}: limit {self.seconds:g} s\n")
        self._log.flush()
        faulthandler.dump_traceback_later(self.seconds, exit=True, file=self._log)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session):
        """A run whose cases all finished keeps no log."""
        if self._log is not None:
            self._log.close()
            self.log_path.unlink(missing_ok=True)
