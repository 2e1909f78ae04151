"""pytest plumbing of the verification suite.

* ``--backend SPEC`` (repeatable): the backends the contracts run against: a built-in name,
  a ``latentmoe.backends`` entry point, ``module:attribute`` or ``path/file.py:attribute``
  (``verify.backends``); ``default`` stands for a plain run's selection, the built-ins
  and every registered entry point. With ``--backend``, the contracts of backends not
  selected are deselected (the reference's own contracts too, unless ``reference`` is
  named).
* ``seed``: an integer derived from the test's node id (md5), so a failing case
  reproduces alone (``pytest 'verify/test_x.py::test_y[...]'``).
* ``backend``: parametrized over the selected backends a test names with
  ``@pytest.mark.backends("reference", "fast", ..., external=True)`` (default:
  ``reference``); ``external=True`` adds every selected backend that is not built in.
  The fixture is the checked backend (``verify.backends.UnderTest``); a backend this
  machine cannot run is skipped with its reason, one that could not be loaded fails with
  its load error.
* ``contract``: the recorder a test compares through (``verify.recorder.Recorder``); what it
  records, with the test's outcome, becomes a row of the summary table printed at the end
  of the session and written to ``verify-report.json`` / ``verify-report.md``, with the
  name, version and source of every backend of the run.
* hardware markers: ``gpu``, ``sm90``, ``sm100``, ``multi_gpu`` are skipped with a reason
  where the machine lacks them (``verify.plan.hardware_skip_reason``; ``python -m
  verify.plan --arch sm_100a`` evaluates them, and every other skip, for another machine).
* ``process_group``: under ``torchrun``, the world process group (NCCL with one GPU per
  process where CUDA is available, else gloo), initialised once per session.
* pytest-xdist (``pytest verify/ -n N``): each worker hands its rows to
  the controller when it finishes, and the controller prints and writes the one merged
  report (``verify.report.merge_reports``); a worker that ends without handing them over
  is a failed row of its own.
* ``--case-timeout SECONDS`` (default 1200; 0: off): a case that runs longer ends its
  process with every thread's traceback in ``verify-watchdog-<pid>.log`` (a GPU kernel that
  never returns cannot be interrupted otherwise; under xdist the case becomes a failed row;
  ``verify.watchdog``).
* ``real_dimensions``: the marker of every case at the real dimensions (config
  ``kimi_k3``), added at collection, so that ``-m real_dimensions`` / ``-m "not
  real_dimensions"`` split a GPU run: each process keeps the real layer's weights it built
  (tens of GB of GPU memory), so many workers on one GPU take the small cases and one
  process the real ones (docs/gpu-node.md).
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import pytest
import torch

from benchmarks.provenance import tree_commit
from verify import caches, cpu_math
from verify import backends as backend_registry
from verify.recorder import Recorder
from verify.report import (Report, format_table, format_totals, merge_reports, report_payload,
                           write_report)
from verify.seeds import seed_of
from verify.shard import ShardSelection, parse_shard
from verify.watchdog import DEFAULT_CASE_TIMEOUT_S, CaseWatchdog, parse_case_timeout

REPORT_KEY = pytest.StashKey[Report]()
SELECTED_KEY = pytest.StashKey[list]()
#: pytest-xdist controller: each finished worker's (name, report payload)
WORKER_PARTS_KEY = pytest.StashKey[list]()
#: the key of a worker's report payload in its ``workeroutput``
WORKER_OUTPUT = "latentmoe_report"
#: the config of the real-dimension cases (marker ``real_dimensions``)
REAL_DIMENSIONS = "kimi_k3"
VERIFY_DIR = Path(__file__).resolve().parent
#: The parameter of a contract none of whose backends is selected (the item is deselected).
NOT_SELECTED = "not-selected"


def pytest_addoption(parser):
    parser.getgroup("latentmoe").addoption(
        "--backend", action="append", default=None, metavar="SPEC",
        help="a backend to verify (repeatable): a built-in name (reference, reference-cuda, "
             "stock, fast), a latentmoe.backends entry point, module:attribute, "
             "path/file.py:attribute, or 'default' (the built-ins and every entry point)")
    parser.getgroup("latentmoe").addoption(
        "--shard", default=None, metavar="I/N",
        help="run only the I-th of N contiguous slices of the selected cases (after -m, -k "
             "and --backend): a suite split over N time-limited calls, joined with "
             "python -m verify.report merge (verify.shard)")
    parser.getgroup("latentmoe").addoption(
        "--case-timeout", default=str(DEFAULT_CASE_TIMEOUT_S), metavar="SECONDS",
        help="end the process of a case that runs longer (a hung GPU kernel; its tracebacks "
             "go to verify-watchdog-<pid>.log, and under xdist the case is a failed row); "
             "0: off (verify.watchdog)")


def pytest_configure(config):
    shard = config.getoption("shard", default=None)
    if shard is not None:
        try:
            config.pluginmanager.register(ShardSelection(*parse_shard(shard)), "latentmoe-shard")
        except ValueError as e:
            raise pytest.UsageError(str(e)) from None
    seconds = parse_case_timeout(config.getoption("case_timeout", default="0"))
    if seconds is not None:
        config.pluginmanager.register(CaseWatchdog(seconds, Path.cwd()), "latentmoe-watchdog")
    cpu_math.warm_up()  # PyTorch's first parallel exp/tanh call in a process (verify.cpu_math)
    report = Report()
    config.stash[REPORT_KEY] = report
    specs = config.getoption("backend", default=None)
    selected = backend_registry.select(specs)
    config.stash[SELECTED_KEY] = selected
    config.stash[WORKER_PARTS_KEY] = []
    for b in selected:
        report.backends[b.name] = b.describe()
    config.addinivalue_line(
        "markers", "backends(*names, external=False): the built-in backends this contract "
        "runs against; external=True adds every selected backend that is not built in"
    )
    config.addinivalue_line(
        "markers", "contract(name): the report row's contract name (default: the test's "
        "name without test_)"
    )
    config.addinivalue_line(
        "markers", "config(name): the layer config a contract without a config_name "
        "parameter runs (its report rows are labelled with it)"
    )
    config.addinivalue_line(
        "markers", "real_dimensions: a case at the real dimensions (config kimi_k3; added at "
        "collection): -m 'not real_dimensions' for many workers on one GPU"
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
        external = bool(marker.kwargs.get("external", False)) if marker else False
        selected = metafunc.config.stash[SELECTED_KEY]
        by_name = {b.name: b for b in selected if b.builtin}
        chosen = [by_name[n] for n in names if n in by_name]
        chosen += [b for b in selected if external and not b.builtin]
        metafunc.parametrize("backend", chosen or [NOT_SELECTED], ids=str, indirect=True)


@pytest.hookimpl(tryfirst=True)  # the marker before ``-m`` selects by it
def pytest_collection_modifyitems(config, items):
    """Deselect the contracts of backends the run did not select: a contract none of whose
    backends is selected, and, when ``--backend`` leaves ``reference`` out, the contracts
    without a backend parameter (they check the reference). Mark the cases at the real
    dimensions ``real_dimensions``."""
    names = {b.name for b in config.stash[SELECTED_KEY]}
    keep, drop = [], []
    for item in items:
        if Path(str(item.path)).parent != VERIFY_DIR:
            keep.append(item)
            continue
        _, backend, config_name = row_key(item)
        if config_name == REAL_DIMENSIONS:
            item.add_marker(pytest.mark.real_dimensions)
        (keep if backend in names else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _cuda_capability():
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def pytest_runtest_setup(item):
    """The hardware markers on this machine (``verify.plan.hardware_skip_reason``, which
    ``python -m verify.plan`` evaluates for another machine)."""
    from verify.plan import hardware_skip_reason

    reason = hardware_skip_reason(item, _cuda_capability(),
                                  int(os.environ.get("WORLD_SIZE", "1")))
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module", autouse=True)
def release_caches_at_module_end(request):
    """Each test module's cached layers dropped when the module ends
    (:func:`verify.caches.release_module_caches`), so one process running every
    real-dimension module holds one module's layers at a time."""
    yield
    caches.release_module_caches(request.module)


@pytest.fixture(scope="session")
def process_group():
    """The world group of a ``torchrun`` launch (``multi_gpu`` tests only; they skip
    without torchrun), destroyed at the end of the session."""
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        options = {}
        if backend == "nccl":
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            options["device_id"] = torch.device("cuda", local)
        dist.init_process_group(backend, **options)
    yield dist.group.WORLD
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture
def seed(request) -> int:
    """A 31-bit seed from the md5 of the test's node id (``verify.seeds.seed_of``)."""
    return seed_of(request.node.nodeid)


@pytest.fixture
def generator(seed) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def backend(request) -> backend_registry.UnderTest:
    chosen = request.param
    if chosen.load_error:
        pytest.fail(chosen.load_error, pytrace=False)
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
        "commit": tree_commit(VERIFY_DIR.parent),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if capability else "cpu",
        "capability": f"sm_{capability[0]}{capability[1]}" if capability else "-",
        "world_size": os.environ.get("WORLD_SIZE", "1"),
    }


def pytest_sessionfinish(session):
    """A pytest-xdist worker hands its report to the controller (``workeroutput``)."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        # as JSON text: execnet carries only plain types (a backend's version may be a
        # str subclass such as torch's TorchVersion), and the report file is JSON anyway
        output[WORKER_OUTPUT] = json.dumps(
            report_payload(session.config.stash[REPORT_KEY], _environment()), default=str)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """The pytest-xdist controller keeps a finished worker's report; a worker that ended
    without one (it crashed, or was killed) becomes a failed row, so a merged report can
    never look whole without it."""
    name = node.gateway.id
    text = getattr(node, "workeroutput", {}).get(WORKER_OUTPUT)
    if text is None:
        why = str(error).strip().splitlines()[-1] if error else "no output"
        lost = Report()
        lost.outcome(lost.row("xdist_worker_report", "-", "-"), "failed",
                     nodeid=f"worker {name} ended without its report: {why}")
        payload = report_payload(lost, _environment())
    else:
        payload = json.loads(text)
    node.config.stash[WORKER_PARTS_KEY].append((f"worker {name}", payload))


def _run_report(config) -> tuple[Report, dict]:
    """(report, environment) of the run: this process's, or on a pytest-xdist controller
    the merge of its workers' (``environment["workers"]``: how many)."""
    parts = config.stash[WORKER_PARTS_KEY]
    if not parts:
        return config.stash[REPORT_KEY], _environment()
    environment, report = merge_reports(parts)
    environment["workers"] = environment.pop("parts")
    return report, environment


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workeroutput"):
        return  # a pytest-xdist worker: the controller writes the report
    report, environment = _run_report(config)
    if not report.rows:
        return
    rank = int(os.environ.get("RANK", "0"))
    terminalreporter.section("latentmoe verification summary")
    for name, about in report.backends.items():
        terminalreporter.write_line(about.get("load_error")
                                    or f"backend {name}: {about['version']} ({about['source']})")
    terminalreporter.write_line(format_table(report.sorted_rows()))
    terminalreporter.write_line(format_totals(report))
    if rank == 0:
        out = Path(os.environ.get("LATENTMOE_REPORT_DIR", config.rootpath))
        paths = write_report(report, out, environment)
        terminalreporter.write_line("written: " + ", ".join(str(p) for p in paths))
