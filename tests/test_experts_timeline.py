"""CPU checks of ``benchmarks.experts_timeline``: profiler records cut into engine calls,
their medians, the rendered table and the tactic syntax (the GPU part runs on a node)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import experts_timeline as tl
from benchmarks.experts_table import parse_tactic

LISTS = "kernel_cutlass_kernel_fastexpertskernelsRoutingListsKernel_object_at_0"
PLAN = "kernel_cutlass_kernel_fastexpertskernelsPlanKernel_object_at_0"
GEMM = "kernel_cutlass_kernel_fastexpertskernelsExpertsGemmKernel_object_at_0"
FUSED = "kernel_cutlass_kernel_fastexpertskernelsFusedExpertsKernel_object_at_0"
FLUSH = "read_kernel"


def _call(t0, fused=False):
    """One call's records starting at t0: lists 3 us, gap 2, plan 2, gap 1, FC1 40, FC2
    starting 5 us before FC1 ends and ending 20 us after (or one fused grid of 60)."""
    recs = [(FLUSH, t0 - 30, t0 - 5), (LISTS, t0, t0 + 3), (PLAN, t0 + 5, t0 + 7)]
    if fused:
        return recs + [(FUSED, t0 + 8, t0 + 68)]
    return recs + [(GEMM, t0 + 8, t0 + 48), (GEMM, t0 + 43, t0 + 68)]


def test_calls_cut_and_measured():
    records = _call(100) + _call(300)
    got = tl.calls_from_records(list(reversed(records)))  # any order
    assert len(got) == 2
    for c in got:
        assert c == {"lists": 3, "gap_plan": 2, "plan": 2, "gap_fc1": 1, "fc1": 40, "fc2": 25,
                     "fc2_after_fc1": 20, "call": 68, "fused": False}


def test_fused_call_and_incomplete_calls():
    records = _call(100, fused=True) + _call(300)[:-1]  # the second call lost its FC2
    got = tl.calls_from_records(records)
    assert len(got) == 1 and got[0]["fused"] and got[0]["fc1"] == 60 and got[0]["call"] == 68
    assert got[0]["fc2"] == 0.0 and got[0]["fc2_after_fc1"] == 0.0


def test_summary_and_render():
    calls = tl.calls_from_records(_call(100) + _call(300) + _call(500))
    m = tl.summarize(calls)
    assert m["calls"] == 3 and m["call"] == 68 and m["gap_plan"] == 2
    with pytest.raises(ValueError, match="no complete engine call"):
        tl.summarize([])
    result = {"device": "X", "torch": "t", "read_gbs": 4500.0, "reps": 3, "cases": [
        {"mode": "dep16", "size": 1, "tactic": "", "limit_us": 60.0, "median_us": m},
        {"mode": "dep16", "size": 1, "tactic": "fused=1", "limit_us": 60.0, "median_us": m,
         "launch": "eager"}]}
    text = tl.render(result)
    assert "| dep16 | 1 | default | 60.0 | 3.0 | 2.0 | 2.0 | 1.0 | 40.0 | 25.0 | 20.0 | 68.0 | 8.0 |" in text
    assert "fused=1 (eager)" in text


def test_tactic_syntax():
    assert parse_tactic("") == {}
    assert parse_tactic("wgmma=1,fused=1") == {"wgmma": 1, "fused": 1}
    with pytest.raises(ValueError, match="key=int"):
        parse_tactic("wgmma")


def test_engine_tactic_checked_by_name():
    """A layer's ``experts_tactic`` (``ExpertsEngine(tactic=...)``) is refused by name before
    any kernel is built: unknown keys, non-int values, not a dict, wgmma off sm_90a; and
    the tables' ``--experts-tactic`` syntax gives the dict the engine takes."""
    from fast.experts.engine import TACTIC_KEYS, check_tactic

    assert check_tactic(parse_tactic("wgmma=1,fused=1,pdl_chain=1"), "sm_90a", "X") == \
        {"wgmma": 1, "fused": 1, "pdl_chain": 1}
    assert check_tactic({}, "sm_100a", "X") == {}
    with pytest.raises(ValueError, match="X: unknown tactic keys \\['wgmm'\\]"):
        check_tactic({"wgmm": 1}, "sm_90a", "X")
    with pytest.raises(ValueError, match="tactic values must be ints"):
        check_tactic({"ring": "4"}, "sm_90a", "X")
    with pytest.raises(TypeError, match="tactic must be a dict"):
        check_tactic("wgmma=1", "sm_90a", "X")
    with pytest.raises(ValueError, match="wgmma needs sm_90a"):
        check_tactic({"wgmma": 1}, "sm_100a", "X")
    with pytest.raises(ValueError, match="X: ctas .* must be an int >= 1, got 0"):
        check_tactic({"ctas": 0}, "sm_90a", "X")
    assert check_tactic({"ctas": 3, "fused": 1}, "sm_90a", "X") == {"ctas": 3, "fused": 1}
    assert set(TACTIC_KEYS) >= {"wgmma", "fused", "pdl_chain", "warps", "mtiles"}


def test_experts_table_renders_tactic_variants():
    """``benchmarks.experts_table.render``: the contestants' table, then (only where the run
    measured ``--tactics`` variants) each variant's time and its ratio to the default's."""
    from benchmarks.experts_table import render

    case = {"mode": "dep16", "size": 64, "skew": 0.0, "touched": 56, "limit_us": 200.0,
            "median_us": {"engine": 400.0, "triton_w4": 500.0}}
    result = {"device": "X", "torch": "t", "read_gbs": 4500.0, "cases": [case]}
    plain = render(result)
    assert "| dep16 | 64 | 0.0 | 56 | 200.0 | 400.0 (0.50) | 500.0 (0.40) owner w4 | - | 1.25x |" in plain
    assert "Engine tactics" not in plain
    case["median_us"].update(engine_windows2=440.0, engine_wgmma1_warps8_mtiles2=380.0)
    text = render(result)
    assert "| mode | size | skew | default us | wgmma1_warps8_mtiles2 | windows2 |" in text
    assert "| dep16 | 64 | 0.0 | 400.0 | 380.0 (0.95) | 440.0 (1.10) |" in text


def test_rank_case_counts_the_local_pairs_and_their_byte_limit():
    """``benchmarks.experts_table.rank_case`` (the experts table's and timeline's
    inputs): 16 rows per token of a DEP16 rank, the pairs, distinct experts and
    most pairs of one expert among the rank's local ones, their bytes at ``expert_bytes``
    each, the time those take at ``read_gbs``, and latent rows whose MXFP8 codes are those
    of ``x``."""
    from benchmarks.experts_table import L, rank_case
    from reference.mx import quantize_mxfp8

    case = rank_case("dep16", 2, 0.0, 56, 56, 1000, 2.0, device="cpu")
    ids = case["ids"]
    assert case["rows"] == 32 and tuple(ids.shape) == (32, 16)
    local = ids[(ids >= 56) & (ids < 112)]
    assert case["pairs"] == local.numel()
    assert case["touched"] == torch.unique(local).numel() > 0
    assert case["max_pairs"] == int(torch.unique(local, return_counts=True)[1].max())
    assert case["bytes"] == 1000 * case["touched"]
    assert case["limit_us"] == pytest.approx(case["bytes"] / 2e9 * 1e6)
    assert tuple(case["x"].shape) == (32, L)
    codes, scales = quantize_mxfp8(case["x"])
    assert torch.equal(codes.view(torch.uint8), case["codes"].view(torch.uint8))
    assert torch.equal(scales, case["scales"])
    assert rank_case("tp8", 65, 0.0, 0, 896, 1, 1.0, device="cpu")["rows"] == 65


def test_heavy_split_partitions_the_local_pairs_by_expert_weight():
    """``benchmarks.experts_heavy_split.split_ids``: every local pair is in exactly one of
    the light and heavy calls, by its expert's pair count; every other slot is -1."""
    from benchmarks.experts_heavy_split import split_ids

    ids = torch.tensor([[0, 1, 9], [0, 2, 8], [0, 1, 7], [3, 1, 0]], dtype=torch.int32)
    light, heavy, n_heavy = split_ids(ids, 0, 4, 2)  # experts 0..3; 0 has 4 pairs, 1 has 3
    assert n_heavy == 2
    assert torch.equal(heavy, torch.tensor([[0, 1, -1], [0, -1, -1], [0, 1, -1], [-1, 1, 0]],
                                           dtype=torch.int32))
    assert torch.equal(light, torch.tensor([[-1, -1, -1], [-1, 2, -1], [-1, -1, -1],
                                            [3, -1, -1]], dtype=torch.int32))


def test_heavy_split_table_states_each_call_against_the_default_and_the_bits():
    from benchmarks.experts_heavy_split import render

    case = {"mode": "dep16", "size": 8, "skew": 1.0, "touched": 33, "heavy_experts": 3,
            "max_pairs": 101, "limit_us": 120.0,
            "median_us": {"default": 240.0, "light": 120.0, "heavy_w2": 96.0,
                          "split_w2": 180.0},
            "same_bits": {"split_w2": False}}
    text = render({"device": "H", "torch": "t", "read_gbs": 4500.0, "heavy_pairs": 8,
                   "cases": [case]})
    assert ("| dep16 | 8 | 1.0 | 33 | 3 | 101 | 120.0 | 240.0 (0.50) | 120.0 (0.50) | "
            "96.0 (0.40) | 180.0 (0.75) | NO |") in text
