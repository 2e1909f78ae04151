"""pytest plumbing of the verification suite.

* ``seed``: an integer derived from the test's node id (md5), so a failing case
  reproduces alone (``pytest 'verify/test_x.py::test_y[...]'``).
* ``backend``: parametrized over the backends a test names with
  ``@pytest.mark.backends("reference", "fast", ...)`` (default: ``reference``); a backend
  this machine cannot run is skipped with its reason (``verify.backends``).
* ``contract``: the recorder a test compares through (``verify.recorder.Recorder``); what it
  records, with the test's outcome, becomes a row of the summary table printed at the end
  of the session and written to ``verify-report.json`` / ``verify-report.md``.
* hardware markers: ``gpu``, ``sm90``, ``sm100``, ``multi_gpu`` are skipped with a reason
  where the machine lacks them.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest
import torch

from verify import backends as backend_registry
from verify.recorder import Recorder
from verify.report import Report, format_table, write_report
from verify.seeds import seed_of

REPORT_KEY = pytest.StashKey[Report]()
ROW_KEY = pytest.StashKey[tuple]()


def pytest_configure(config):
    config.stash[REPORT_KEY] = Report()
    config.addinivalue_line(
        "markers", "backends(*names): the backends this contract runs against"
    )
    config.addinivalue_line(
        "markers", "contract(name): the report row's contract name (default: the test's "
        "name without test_)"
    )
    config.addinivalue_line(
        "markers", "config(name): the layer config a contract without a config_name "
        "parameter runs (its report rows are labelled with it)"
    )


def _param(item, name, default):
    callspec = getattr(item, "callspec", None)
    if callspec is None or name not in callspec.params:
        return default
    return str(callspec.params[name])


def row_key(item) -> tuple[str, str, str]:
    """(contract, backend, config) of a test item: the contract is the test function's
    name without ``test_`` (or the ``contract`` marker's first argument); the config is the
    ``config_name`` parameter, else the ``config`` marker's argument, else ``-`` (a contract
    of no layer config, e.g. the codecs)."""
    marker = item.get_closest_marker("contract")
    name = marker.args[0] if marker else item.originalname.removeprefix("test_")
    config_marker = item.get_closest_marker("config")
    config = config_marker.args[0] if config_marker else "-"
    return name, _param(item, "backend", "reference"), _param(item, "config_name", config)


def pytest_generate_tests(metafunc):
    if "backend" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("backends")
        names = marker.args if marker else ("reference",)
        metafunc.parametrize("backend", [backend_registry.get(n) for n in names], ids=str,
                             indirect=True)


def _cuda_capability():
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def pytest_runtest_setup(item):
    capability = _cuda_capability()
    if item.get_closest_marker("gpu") and capability is None:
        pytest.skip("needs a CUDA GPU; this machine has none")
    if item.get_closest_marker("sm90") and capability != (9, 0):
        pytest.skip(f"needs an SM90 (Hopper) GPU; device capability is {capability}")
    if item.get_closest_marker("sm100") and (capability is None or capability[0] != 10):
        pytest.skip(f"needs an SM100/SM103 (Blackwell) GPU; device capability is {capability}")
    marker = item.get_closest_marker("multi_gpu")
    if marker:
        need = marker.args[0] if marker.args else 2
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world < need:
            pytest.skip(
                f"needs {need} processes launched with torchrun (WORLD_SIZE={world}); "
                "see docs/verify.md"
            )


@pytest.fixture
def seed(request) -> int:
    """A 31-bit seed from the md5 of the test's node id (``verify.seeds.seed_of``)."""
    return seed_of(request.node.nodeid)


@pytest.fixture
def generator(seed) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def backend(request):
    chosen = request.param
    ok, reason = chosen.availability()
    if not ok:
        pytest.skip(reason)
    return chosen


@pytest.fixture
def contract(request) -> Recorder:
    report = request.config.stash[REPORT_KEY]
    return Recorder(report.row(*row_key(request.node)))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    result = yield
    report = item.config.stash[REPORT_KEY]
    is_verify = Path(str(item.path)).parent.name == "verify"
    if not is_verify:
        return result
    done = (result.when == "call") or (result.when == "setup" and not result.passed)
    if done:
        outcome = result.outcome
        reason = None
        if result.skipped and isinstance(result.longrepr, tuple):
            reason = result.longrepr[2].removeprefix("Skipped: ")
        report.outcome(report.row(*row_key(item)), outcome, reason=reason, nodeid=item.nodeid)
    return result


def _environment() -> dict:
    capability = _cuda_capability()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if capability else "cpu",
        "capability": f"sm_{capability[0]}{capability[1]}" if capability else "-",
        "world_size": os.environ.get("WORLD_SIZE", "1"),
    }


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    report = config.stash[REPORT_KEY]
    if not report.rows:
        return
    rank = int(os.environ.get("RANK", "0"))
    terminalreporter.section("latentmoe verification summary")
    terminalreporter.write_line(format_table(report.sorted_rows()))
    totals = report.totals()
    terminalreporter.write_line(
        "rows {rows}, cases {cases}: {passed} passed, {failed} failed, {skipped} skipped; "
        "accepted routing flips {flips}".format(**totals)
    )
    if rank == 0:
        out = Path(os.environ.get("LATENTMOE_REPORT_DIR", config.rootpath))
        paths = write_report(report, out, _environment())
        terminalreporter.write_line("written: " + ", ".join(str(p) for p in paths))
