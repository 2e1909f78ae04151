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
            assert "cw8" in case["same_bits"] \
                and set(case["same_bits"]) <= set(table.form_labels(result)
                                                  + table.tiled_labels(result)), gemm
            assert all(case["same_bits"].values()), (row["rows"], gemm)  # no timing of wrong bits


def test_forms_with_128_k_stages():
    """``--stage-k 64,128``: every form also at 128-k stages (``form_table``), each the
    ``DenseGemm(forms=...)`` entry the run times; its default tactic keeps the K split, the
    chunk width and the form (serial, overlap), runs 128-k stages at the form's occupancy
    where a ring of 3 fits and one CTA per multiprocessor where it does not, and launches;
    a GEMM whose K split is not whole 128-k stages (the up GEMM's 448) is not timed in them."""
    from fast.gemm.host import default_tactic, launch_for

    forms = table.form_table({"stage_ks": [64, 128]})
    assert list(forms)[len(table.FORMS):] == [f"{f[0]},k128" for f in table.FORMS]
    assert table.form_labels({}) == [f[0] for f in table.FORMS]
    for n, k, splits in ((560, 7168, 8), (1536, 7168, 4), (7168, 768, 1), (896, 3584, 8)):
        for label, form in forms.items():
            if k % (splits * form["stage_k"]):
                assert (n, form["stage_k"]) == (896, 128), (n, k, label)
                continue
            t = default_tactic(-(-n // 64) * 64, k, 1024, 132, splits, True, forms={1: form})
            assert (t.splits, t.chunk_windows, t.serial, t.overlap, t.stage_k) == \
                (splits, form["chunk_windows"], form["serial"], form["overlap"],
                 form["stage_k"]), (n, k, label)
            launch_for(n, k, 1024, tactic=t)  # fits shared memory and its ring


def test_best_forms_become_a_layer_table():
    """``best_forms``: per GEMM the fastest timed form of each row count, from the row
    after the previous timed one; a table the wide layers accept (``check_gemm_forms``) and
    whose launches keep each GEMM's K split and MMA kind."""
    from fast.schedules.wide_gemms import check_gemm_forms, gemm_launches, gemm_splits
    from model.config import LatentMoEConfig

    result = json.loads(RESULT.read_text())
    forms = table.best_forms(result)
    assert set(forms) == {"front", "shared_gate_up", "shared_down", "up"}
    starts = [65] + [row["rows"] + 1 for row in result["rows"][:-1]]
    assert all(sorted(t) == starts for t in forms.values())
    front_1024 = result["rows"][-1]["gemms"]["front"]
    fastest = min(front_1024["tactics"], key=front_1024["median_us"].get)
    assert forms["front"][starts[-1]] == table.form_table(result)[fastest]
    assert table.form_table(result)["cw16,serial,overlap,k128"] == \
        {"chunk_windows": 16, "serial": True, "overlap": True, "stage_k": 128}
    cfg = LatentMoEConfig.kimi_k3()
    check_gemm_forms("L", cfg, 8, forms, "wgmma")
    splits = gemm_splits(cfg, 8)
    for name, per_t in gemm_launches(cfg, 8, (65, 512, starts[-1], 1024), mma="wgmma",
                                     forms=forms).items():
        assert {(l.tactic.splits, l.tactic.wgmma) for l in per_t.values()} == {(splits[name], True)}


def test_best_forms_kernels_compile(tmp_path):
    """Every kernel the committed result's ``best_forms`` makes a TP8 wide rank launch at 65..1024
    rows (``WideLayer(invariant_forms=...)``: 128-k stages, serial splits, 128-row chunks
    among them) compiles for sm_90a (the warpgroup MMA is Hopper's), and the widest of each
    tile and form fits its registers without a stack frame: CI compiles what a forms table
    can ask for, not only the layer's default kernels."""
    import pytest

    from fast import backend

    if backend.cute_import_error() is not None:
        pytest.skip(f"CuTe DSL not importable: {backend.cute_import_error()}")
    from fast.gemm.host import compile_kernel
    from fast.schedules.wide_gemms import gemm_launches
    from model.config import LatentMoEConfig
    from tests.test_gemm_fast import sm90a_attributes

    cfg = LatentMoEConfig.kimi_k3()
    forms = table.best_forms(json.loads(RESULT.read_text()))
    params = []
    for per_t in gemm_launches(cfg, 8, range(65, cfg.wide_rows + 1), mma="wgmma",
                               forms=forms).values():
        params += [l.params for l in per_t.values() if l.params not in params]
    assert any(p["stage_k"] == 128 for p in params) and any(p.get("serial") for p in params)
    for p in params:
        assert compile_kernel("sm_90a", **p) is not None
    widest = {}
    for p in params:
        key = (p["warps"], p["mtiles"], p["stage_k"], bool(p.get("serial")), bool(p.get("overlap")))
        if p["windows"] >= widest.get(key, {"windows": 0})["windows"]:
            widest[key] = p
    for p, attrs in zip(widest.values(), sm90a_attributes(list(widest.values()), tmp_path)):
        assert attrs["frame"] == 0, (p, attrs)
