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
    """``best_forms``: per GEMM the fastest timed form or tiled variant (among those that
    gave the plain form's bits) of each row count, from the row after the previous timed
    one; a table the wide layers accept (``check_gemm_forms``) whose split-K launches keep
    each GEMM's K split and MMA kind, and whose tiled rows are left to ``TiledGemm``."""
    from fast.gemm.host import form_at
    from fast.schedules.wide_gemms import check_gemm_forms, gemm_launches, gemm_splits
    from model.config import LatentMoEConfig

    result = json.loads(RESULT.read_text())
    forms = table.best_forms(result)
    assert set(forms) == {"front", "shared_gate_up", "shared_down", "up"}
    starts = [65] + [row["rows"] + 1 for row in result["rows"][:-1]]
    assert all(sorted(t) == starts for t in forms.values())
    every = {**table.form_table(result), **table.tiled_table(result)}
    for row, start in zip(result["rows"], starts):
        for gemm, case in row["gemms"].items():
            fastest = min((k for k in case["tactics"] if case["same_bits"].get(k)),
                          key=case["median_us"].get)
            assert forms[gemm][start] == every[fastest], (row["rows"], gemm)
    cfg = LatentMoEConfig.kimi_k3()
    check_gemm_forms("L", cfg, 8, forms, "wgmma")
    splits = gemm_splits(cfg, 8)
    rows = (65, 256, 257, 512, 513, 1024)
    for name, per_t in gemm_launches(cfg, 8, rows, mma="wgmma", forms=forms).items():
        assert sorted(per_t) == [t for t in rows if "tiled" not in form_at(forms[name], t)]
        assert {(l.tactic.splits, l.tactic.wgmma) for l in per_t.values()} <= {(splits[name], True)}


def test_best_forms_kernels_compile(tmp_path):
    """Every kernel the committed result's ``best_forms`` makes a TP8 wide rank launch at
    65..1024 rows (``WideLayer(invariant_forms=...)``) compiles for sm_90a (the warpgroup
    MMA is Hopper's): the split-K kernel of each row count a split-K form serves, the widest
    of each tile and form without a stack frame, and the tiled kernel of each tiled form in
    the kind its GEMM is called with (``wide_gemms.CALL_KINDS``): CI compiles what a forms
    table can ask for, not only the layer's default kernels."""
    import pytest

    from fast import backend

    if backend.cute_import_error() is not None:
        pytest.skip(f"CuTe DSL not importable: {backend.cute_import_error()}")
    from fast.device.compile import compiled, frozen
    from fast.gemm.host import compile_kernel
    from fast.gemm.tiled_kernel import TiledGemmKernel
    from fast.schedules.wide_gemms import CALL_KINDS, gemm_launches, gemm_shapes, gemm_splits
    from model.config import LatentMoEConfig
    from tests.test_gemm_fast import sm90a_attributes

    cfg = LatentMoEConfig.kimi_k3()
    forms = table.best_forms(json.loads(RESULT.read_text()))
    params = []
    for per_t in gemm_launches(cfg, 8, range(65, cfg.wide_rows + 1), mma="wgmma",
                               forms=forms).values():
        params += [l.params for l in per_t.values() if l.params not in params]
    for p in params:
        assert compile_kernel("sm_90a", **p) is not None
    widest = {}
    for p in params:
        key = (p["warps"], p["mtiles"], p["stage_k"], bool(p.get("serial")), bool(p.get("overlap")))
        if p["windows"] >= widest.get(key, {"windows": 0})["windows"]:
            widest[key] = p
    for p, attrs in zip(widest.values(), sm90a_attributes(list(widest.values()), tmp_path)):
        assert attrs["frame"] == 0, (p, attrs)
    shapes, splits = gemm_shapes(cfg, 8), gemm_splits(cfg, 8)
    tiled = [(name, form["tiled"]) for name, t in forms.items() for form in t.values()
             if "tiled" in form]
    assert tiled
    for name, form in tiled:
        n, k = shapes[name]
        out, addend = CALL_KINDS[name]
        options = {key: tuple(v) if isinstance(v, list) else v for key, v in form.items()}
        assert compiled(TiledGemmKernel, "sm_90a", frozen(dict(
            n=n, k=k, width=n, splits=splits[name], out_f32=out == "float32",
            addend="none" if addend is None else "bf16", **options)))


def test_forms_option_takes_plus_separated_labels(capsys):
    """``--forms``: the labels hold commas, so they are ``+``-separated; a label the table
    does not have (a comma-split one among them) is refused by name before any GPU work."""
    import pytest

    for bad in ("cw8,cw16", "cw16+overlap", "cw8+cw32"):
        with pytest.raises(SystemExit):
            table.main(["--forms", bad])
        assert "--forms: no such form" in capsys.readouterr().err


def test_tiled_option_is_checked_as_the_kernel_checks_it(capsys):
    """``--tiled``: each variant's options go through ``fast.gemm.tiled_layout.
    check_tiled_options`` (the kernel's own check) before any GPU work; a token tile off the
    multiples of 16, a producer warp beside 160 tokens or a malformed variant is refused."""
    import pytest

    for bad, word in (("72x4", "tile_tokens"), ("160x4p", "producer warp"),
                      ("128x1", "stages"), ("128", "is not <tokens>x<stages>"),
                      ("64x4sc12", "with a producer warp"),
                      ("64x4c12", "with a producer warp"),
                      ("64x4kpc21", "serial or cross form's with a producer warp"),
                      ("48x4spc41", "multiple of 32"), ("64x4spc44", "at most 8"),
                      ("64x4spc1", "is not <tokens>x<stages>")):
        with pytest.raises(SystemExit):
            table.main(["--tiled", bad])
        assert word in capsys.readouterr().err, bad
    assert table.tiled_labels({"tiled": [[96, 4, False, True], [128, 4, True, False]]}) == \
        ["tiled96x4sp", "tiled128x4"]


def test_tiled_variants_parse_and_label_back():
    """``parse_tiled``: each spelling of a variant to the result's list, and
    ``tiled_table`` labels it back the same way with the options ``TiledGemm`` takes
    (a cluster as its pair; the persistent grid and cluster keys only where set)."""
    specs = ["128x4", "96x6sp", "128x4kp", "64x4spc12", "96x4spc21", "64x2spc22", "128x4pc12"]
    variants = [table.parse_tiled(s) for s in specs]
    assert variants[0] == [128, 4, True, False, False, [1, 1]]
    assert variants[3] == [64, 4, False, True, False, [1, 2]]
    labelled = table.tiled_table({"tiled": variants})
    assert list(labelled) == [f"tiled{s}" for s in specs]
    assert labelled["tiled64x4spc12"]["tiled"] == {"tile_tokens": 64, "stages": 4,
                                                   "cross": False, "producer": True,
                                                   "cluster": [1, 2]}
    assert labelled["tiled128x4kp"]["tiled"]["persistent"] is True
    assert "cluster" not in labelled["tiled96x6sp"]["tiled"]
