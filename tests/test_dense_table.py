"""``benchmarks.dense_table``'s table on the CPU: the column of the router in the front's
launch, and a run from before it (no such column) rendered with a dash."""

from __future__ import annotations

from benchmarks.dense_table import render


def _result(with_grouped: bool) -> dict:
    d = {"cublas": 111.0, "kernel": 106.0, "kernel_nopdl": 110.0, "kernel_best": 105.0,
         "cublas_side": 110.0, "kernel_side": 104.0, "cublas_write_flush": 119.0,
         "kernel_write_flush": 115.0}
    if with_grouped:
        d["kernel_grouped"] = 100.0
    return {"device": "GPU", "torch": "2", "read_gbs": 4500.0,
            "rows": [{"tokens": 1, "limit_us": 85.0, "dense4": d, "gemms": {}}]}


def test_the_grouped_column():
    row = [line for line in render(_result(True)).splitlines() if line.startswith("| 1 |")][0]
    assert "| 100.0 (0.85) |" in row
    old = [line for line in render(_result(False)).splitlines() if line.startswith("| 1 |")][0]
    assert "| 110.0 / 104.0 | - |" in old
