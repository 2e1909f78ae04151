"""The wide timeline's record parsing (``benchmarks.wide_timeline``), on synthetic records."""

import pytest

from benchmarks.wide_timeline import render, replays_from_records, short_name, summarize

MAIN, SIDE = 7, 9


def replay(t0, poll_dur):
    """One replay's records: a cuBLAS GEMM, a side-stream kernel, two CuTe kernels."""
    return [("neg_kernel_cuda", MAIN, t0 - 2, t0 - 1),
            ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x64", MAIN, t0, t0 + 10),
            ("kernel_cutlass_kernel_fastschedulesSharedKernel_object", SIDE, t0 + 1, t0 + 30),
            ("kernel_cutlass_kernel_fastschedules_wide_kernelsPollKernel_obj", MAIN, t0 + 12,
             t0 + 12 + poll_dur),
            ("kernel_cutlass_kernel_fastexpertskernelsFusedExpertsKernel_o", MAIN, t0 + 40,
             t0 + 100),
            ("exp_kernel_cuda", MAIN, t0 + 101, t0 + 102),
            ("copy_kernel", MAIN, t0 + 103, t0 + 104)]  # outside: the next restore


def test_short_name_keeps_class_or_prefix():
    assert short_name("kernel_cutlass_kernel_fastexpertskernelsPlanKernel_object_at") == "PlanKernel"
    assert short_name("x" * 60) == "x" * 40


def test_replays_are_cut_at_the_markers_and_summarized_per_stream():
    records = replay(1000, 4) + replay(2000, 6) + replay(3000, 5)
    replays = replays_from_records(records[::-1], start_marker="neg_kernel",
                                   end_marker="exp_kernel")
    assert [len(r) for r in replays] == [4, 4, 4]
    s = summarize(replays)
    assert s["replays"] == 3 and s["dropped"] == 0
    names = [k["name"] for k in s["kernels"]]
    assert names[2:] == ["PollKernel", "FusedExpertsKernel"]
    poll = s["kernels"][2]
    assert poll["dur"] == 5 and poll["start"] == 12
    assert poll["gap"] == 2  # after the GEMM on the main stream, not the side kernel
    assert s["kernels"][1]["gap"] == 0.0  # the first kernel of its stream
    assert s["kernels"][3]["gap"] == 40 - 12 - 5
    assert s["step"] == 100
    text = render({"device": "d", "torch": "t", "ranks": 8, "read_gbs": 1.0,
                   "cases": [{"tokens": 65, "limit_us": 1.0, "summary": s}]})
    # streams named in the order of their first kernel: the GEMM's s0, the side kernel's s1
    assert "| 2 | PollKernel | s0 |" in text and "| 1 | SharedKernel | s1 |" in text


def test_a_replay_with_a_dropped_record_is_left_out():
    short = [r for r in replay(2000, 6) if "Poll" not in r[0]]
    replays = replays_from_records(replay(1000, 4) + short, start_marker="neg_kernel",
                                   end_marker="exp_kernel")
    s = summarize(replays)
    assert s["replays"] == 1 and s["dropped"] == 1
    with pytest.raises(ValueError, match="no replay"):
        summarize([])


def test_replays_interleaving_the_streams_differently_are_both_kept():
    late_side = [(n, st, (s + 15, e + 15) if st == SIDE else (s, e)) for n, st, *se in
                 replay(2000, 4) for s, e in [se]]
    records = replay(1000, 4) + [(n, st, s, e) for n, st, (s, e) in late_side]
    s = summarize(replays_from_records(records, start_marker="neg_kernel",
                                       end_marker="exp_kernel"))
    assert s["replays"] == 2 and s["dropped"] == 0
    side = [k for k in s["kernels"] if k["stream"] == SIDE]
    assert len(side) == 1 and side[0]["start"] == 8.5  # median of 1 and 16
