"""``benchmarks.wide_gemm_table`` on the CPU: the committed result renders to the table its
markdown file holds, and the forms it times (128-k stages where they fit) are well formed."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import wide_gemm_table as table

RESULT = Path(__file__).resolve().parents[1] / "benchmarks/results/h100/wide-gemms.json"


def test_committed_result_renders_to_its_markdown():
    result = json.loads(RESULT.read_text())
    text = table.render(result)
    assert text in RESULT.with_suffix(".md").read_text()
    for row in result["rows"]:
        for gemm, case in row["gemms"].items():
            assert {f[0] for f in table.FORMS} <= set(case["same_bits"]) \
                <= set(table.form_labels(result)), gemm
            assert all(case["same_bits"].values()), (row["rows"], gemm)  # no timing of wrong bits


def test_forms_with_128_k_stages():
    """``--stage-k 64,128``: every form also at 128-k stages, at the form's own occupancy
    where a ring of 3 fits and one CTA per multiprocessor where it does not, none where a K
    split is not whole 128-k stages (the up GEMM's 448); the K split,
    the chunk width and the form (serial, overlap) kept, so the same bits are owed."""
    from fast.gemm.host import choose_tactic, launch_for

    assert table.form_labels({"stage_ks": [64, 128]})[len(table.FORMS):] == \
        [f"{f[0]},k128" for f in table.FORMS]
    assert table.form_labels({}) == [f[0] for f in table.FORMS]
    for n, k, splits in ((560, 7168, 8), (1536, 7168, 4), (7168, 768, 1), (896, 3584, 8)):
        for _, cw, serial, overlap in table.FORMS:
            t = choose_tactic(-(-n // 64) * 64, k, 1024, 132, splits, True, serial, overlap, cw)
            wide = table._with_stage(t, 128, n, k, 1024)
            if (k // splits) % 128:  # a split is not whole 128-k stages: not timed
                assert wide is None, (n, k, t)
                continue
            assert wide is not None and wide.stage_k == 128, (n, k, t)
            assert (wide.splits, wide.chunk_windows, wide.serial, wide.overlap) == \
                (t.splits, t.chunk_windows, t.serial, t.overlap)
            launch_for(n, k, 1024, tactic=wide)  # fits shared memory and its ring
            assert table._with_stage(t, 64, n, k, 1024) is t


def test_best_forms_become_a_layer_table():
    """``best_forms``: per GEMM the fastest timed form of each row count, from the row
    after the previous timed one; a table the wide layers accept (``check_gemm_forms``) and
    whose launches keep each GEMM's K split and MMA kind."""
    from fast.schedules.wide_gemms import check_gemm_forms, gemm_launches, gemm_splits
    from model.config import LatentMoEConfig

    result = json.loads(RESULT.read_text())
    forms = table.best_forms(result)
    assert set(forms) == {"front", "shared_gate_up", "shared_down", "up"}
    assert all(sorted(t) == [65, 513] for t in forms.values())
    front_1024 = result["rows"][-1]["gemms"]["front"]
    fastest = min(front_1024["tactics"], key=front_1024["median_us"].get)
    assert forms["front"][513] == table.form_of(front_1024["tactics"][fastest])
    assert table.form_of("r64w4s8,stage_k128,occupancy1,wgmma,serial,overlap,cw16") == \
        {"chunk_windows": 16, "serial": True, "overlap": True, "stage_k": 128}
    cfg = LatentMoEConfig.kimi_k3()
    check_gemm_forms("L", cfg, 8, forms, "wgmma")
    splits = gemm_splits(cfg, 8)
    for name, per_t in gemm_launches(cfg, 8, (65, 512, 513, 1024), mma="wgmma",
                                     forms=forms).items():
        assert {(l.tactic.splits, l.tactic.wgmma) for l in per_t.values()} == {(splits[name], True)}
