"""pytest plumbing of the benchmarks (the conventions are in ``benchmarks/README.md``).

* ``bench_*.py`` files are collected (pytest's default pattern only takes ``test_*.py``;
  a file named on the command line pytest collects itself).
* A case marked ``benchmark_gpu`` must be timed by ``gpu_timing.device_clock`` (decorate it
  with ``gpu_timing.device_timed``): collection fails otherwise, so no GPU case can put
  host wall time into the statistics.
* Each saved result records the machine it ran on (``machine_info["machine"]``: the
  directory of ``benchmarks/results/`` it belongs to; for a GPU run also the device,
  torch, CUDA and CuTe DSL versions) and the commit it measured (``BENCH_COMMIT`` /
  ``BENCH_DIRTY`` set by ``python -m benchmarks.run``, which names the file after them).
"""

from __future__ import annotations

import os

import pytest

from benchmarks import gpu_timing, history


def pytest_collect_file(file_path, parent):
    if parent.session.isinitpath(file_path):
        return None  # named on the command line: pytest collects it itself
    if file_path.suffix == ".py" and file_path.name.startswith("bench_"):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("benchmark_gpu") is None:
            continue
        marker = item.get_closest_marker("benchmark")
        if marker is None or marker.kwargs.get("timer") is not gpu_timing.device_clock:
            raise pytest.UsageError(
                f"{item.nodeid}: a benchmark_gpu case must be timed by the device clock "
                "(decorate it with benchmarks.gpu_timing.device_timed and time it with "
                "gpu_timing.measure)")


@pytest.fixture(scope="session")
def copy_gbs():
    """The device-to-device copy bandwidth of this session (GB/s), measured once, for a GPU
    case's ``extra_info``; a case that asks for it is skipped with the reason where the
    fast kernels cannot run (``fast.backend.device_supported``)."""
    from fast import backend

    ok, why = backend.device_supported()
    if not ok:
        pytest.skip(why)
    return gpu_timing.copy_bandwidth_gbs()


@pytest.fixture(scope="session")
def kimi_weights(copy_gbs):
    """The real layer's weights on the GPU (``verify.cases.device_weights("kimi_k3")``:
    random MXFP4 expert codes, scale codes 118..124), made once per session and shared by
    every case that streams them (about 16 GB); skipped as ``copy_gbs`` is."""
    from verify import cases

    return cases.device_weights("kimi_k3")


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["machine"] = os.environ.get("BENCH_MACHINE", "unnamed (not run by benchmarks.run)")
    machine_info.update(history.software_info())


def pytest_benchmark_update_commit_info(config, commit_info):
    commit = os.environ.get("BENCH_COMMIT")
    if commit:
        commit_info["id"] = commit
        commit_info["dirty"] = os.environ.get("BENCH_DIRTY") == "1"
        commit_info.pop("error", None)
