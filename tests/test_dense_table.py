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


def test_128k_forms_are_timed_only_where_their_ring_fits():
    """``--stage-k128`` halves a tactic's own ring (the same bytes per ring) and times a
    form at a T only where its ring fits there: the 12-stage 64-row tactic's 6-stage form
    fits at every T, its 12-stage one only at one window; the wgmma forms with MMAs in
    flight need 3 stages and so stop at 2 windows; no form raises."""
    import dataclasses

    from benchmarks.dense_table import serves_and_fits
    from fast.gemm.host import CANDIDATES

    deep = next(t for t in CANDIDATES[(7168, 6144)] if t.ring == 12)
    wide = dataclasses.replace(deep, stage_k=128, ring=deep.ring // 2)
    assert all(serves_and_fits(wide, t) for t in range(1, 65))
    twelve = dataclasses.replace(deep, stage_k=128)
    assert serves_and_fits(twelve, 8) and not serves_and_fits(twelve, 9)  # 12 stages of 128 k at 2 windows
    front = CANDIDATES[(15872, 7168)][0]
    overlap = dataclasses.replace(front, stage_k=128, wgmma=True, overlap=True)
    assert serves_and_fits(overlap, 16) and not serves_and_fits(overlap, 17)
    assert all(serves_and_fits(front, t) for t in range(1, 65))
