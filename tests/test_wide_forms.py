"""``fast.schedules.wide_forms`` on the CPU: the measured table behind
``invariant_forms="auto"`` is the committed H100 result's ``best_forms``, it is a valid
forms table for the TP8 rank, and "auto" resolves to it only where it was measured for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fast.schedules.wide_forms import TP8_FORMS, resolve_forms
from model.config import LatentMoEConfig

#: the result the table was taken from (one H100, commit 13887b8)
SOURCE = Path(__file__).resolve().parents[1] / "benchmarks/results/h100/wide-gemms.json"


def _tuples(forms: dict) -> dict:
    """A forms table with its list values (a cluster read from JSON) as tuples."""
    def form(f):
        if "tiled" in f:
            return {"tiled": {k: tuple(v) if isinstance(v, list) else v
                              for k, v in f["tiled"].items()}}
        return f
    return {g: {r: form(f) for r, f in t.items()} for g, t in forms.items()}


def test_table_is_the_committed_results_best_forms():
    """``TP8_FORMS`` equals ``wide_gemm_table.best_forms`` of the committed H100 result
    from the same commit (a new table is taken by replacing both together)."""
    from benchmarks.wide_gemm_table import best_forms

    result = json.loads(SOURCE.read_text())
    assert result["commit"].startswith("13887b8")
    assert _tuples(best_forms(result)) == _tuples(TP8_FORMS)


def test_table_is_a_valid_tp8_forms_table():
    """The table passes the layer's own check of forms at the real dimensions on 8 ranks
    on the warpgroup MMA (each GEMM's K split whole stages, every tiled option allowed)."""
    from fast.schedules.wide_gemms import check_gemm_forms

    check_gemm_forms("test", LatentMoEConfig.kimi_k3(), 8, TP8_FORMS, "wgmma")


@pytest.mark.parametrize("config,ranks,mma,arch,expect_table", [
    ("kimi_k3", 8, "wgmma", "sm_90a", True),
    ("kimi_k3", 8, "mma.sync", "sm_90a", False),   # the tiled kernel is the warpgroup MMA's
    ("kimi_k3", 8, "mma.sync", "sm_100a", False),
    ("kimi_k3", 4, "wgmma", "sm_90a", False),      # other shapes: not what was measured
    ("kimi_k3", 16, "wgmma", "sm_90a", False),
    ("small", 8, "wgmma", "sm_90a", False),
])
def test_auto_resolves_to_the_table_only_where_it_was_measured(config, ranks, mma, arch,
                                                              expect_table):
    cfg = getattr(LatentMoEConfig, config)()
    got = resolve_forms("test", "auto", cfg, ranks, mma, arch)
    assert (got == TP8_FORMS) if expect_table else got is None
    if expect_table:  # a copy: a caller's edit does not reach the module's table
        got["front"][65] = {"chunk_windows": 8}
        assert TP8_FORMS["front"][65] != {"chunk_windows": 8}


@pytest.mark.parametrize("serial_from,overlap,chunk_windows,own", [
    (None, False, 8, False), (257, False, 8, True), (None, True, 8, True), (None, False, 16, True),
])
def test_auto_gives_way_to_the_layers_own_form_arguments(serial_from, overlap, chunk_windows,
                                                         own):
    """Where the layer was given serial splits, MMAs in flight or 128-row chunks, those shape
    its calls and "auto" resolves to no table (the table would override them)."""
    got = resolve_forms("test", "auto", LatentMoEConfig.kimi_k3(), 8, "wgmma", "sm_90a",
                        serial_from, overlap, chunk_windows)
    assert (got is None) if own else (got == TP8_FORMS)


def test_auto_is_the_wide_layers_default():
    """Both wide layers (and their checks before the device) take "auto" when no
    ``invariant_forms`` is given."""
    import inspect

    from fast.schedules.wide import WideLayer, check_batch_invariant
    from fast.schedules.wide_peer import WidePeerLayer

    for fn in (WideLayer.__init__, WidePeerLayer.__init__, check_batch_invariant):
        assert inspect.signature(fn).parameters["invariant_forms"].default == "auto"


def test_forms_other_than_auto_pass_through_and_bad_values_are_refused():
    cfg = LatentMoEConfig.kimi_k3()
    table = {"up": {65: {"chunk_windows": 16}}}
    assert resolve_forms("W", table, cfg, 8, "wgmma", "sm_90a") is table
    assert resolve_forms("W", None, cfg, 8, "wgmma", "sm_90a") is None
    for bad in ("fast", "AUTO", 3, ["auto"], {"router": {65: {}}}):
        with pytest.raises(ValueError, match="W: invariant_forms"):
            resolve_forms("W", bad, cfg, 8, "wgmma", "sm_90a")


def test_layer_checks_take_auto_before_any_device_work():
    """``check_batch_invariant`` (the layers' checks before the device) takes "auto" and
    refuses another string by name."""
    from fast.schedules.wide import check_batch_invariant

    cfg = LatentMoEConfig.kimi_k3()
    check_batch_invariant("W", cfg, 8, True, "auto", invariant_forms="auto")
    with pytest.raises(ValueError, match="invariant_forms"):
        check_batch_invariant("W", cfg, 8, True, "auto", invariant_forms="fast")
