"""Collect ``bench_*.py`` here (pytest's default pattern only takes ``test_*.py``)."""

import pytest


def pytest_collect_file(file_path, parent):
    if file_path.suffix == ".py" and file_path.name.startswith("bench_"):
        return pytest.Module.from_parent(parent, path=file_path)
    return None
