"""``verify.gpu_run``: the two parts of a GPU node's whole run, and the real-dimension
worker count it picks from the card's memory (the runs that ran out of memory set it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from verify.gpu_run import part_commands, real_dimension_workers

GIB = 2**30


def test_real_dimension_workers_follow_the_card():
    assert real_dimension_workers(139 * GIB) == 2   # H200: two held beside the small part
    assert real_dimension_workers(79 * GIB) == 1    # H100 80 GB: two ran out of memory
    with pytest.raises(ValueError, match="total_memory_bytes"):
        real_dimension_workers(0)


def test_parts_split_by_marker_and_report_apart(tmp_path):
    commands = part_commands(tmp_path, 12, 1, ["-k", "fast"])
    small, small_dir = commands["small"]
    real, real_dir = commands["real"]
    assert small[small.index("-m", 3) + 1] == "not real_dimensions" and small[small.index("-n") + 1] == "12"
    assert real[real.index("-m", 3) + 1] == "real_dimensions" and real[real.index("-n") + 1] == "1"
    assert small[-2:] == ["-k", "fast"] and real[-2:] == ["-k", "fast"]
    assert small_dir != real_dir and small_dir.parent == real_dir.parent == Path(tmp_path) / "parts"
    with pytest.raises(ValueError, match="real_workers"):
        part_commands(tmp_path, 12, 0)


def test_a_call_runs_the_parts_and_the_real_slice_asked_for(tmp_path):
    commands = part_commands(tmp_path, 12, 1, parts=("real",), real_shard="2/2")
    assert list(commands) == ["real"]
    real, _ = commands["real"]
    assert real[real.index("--shard") + 1] == "2/2"
    both = part_commands(tmp_path, 12, 1, real_shard="1/2")
    assert "--shard" not in both["small"][0] and "--shard" in both["real"][0]
    assert all(any(a.startswith("--durations=") for a in c) for c, _ in both.values())
    for bad in ((), ("tiny",)):
        with pytest.raises(ValueError, match="parts"):
            part_commands(tmp_path, 12, 1, parts=bad)
    with pytest.raises(ValueError, match="--shard"):
        part_commands(tmp_path, 12, 1, real_shard="3/2")
