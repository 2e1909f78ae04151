"""``--shard I/N`` (``verify.shard``): the slices partition the selected cases in their
collection order, and the option's errors name it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from verify.shard import parse_shard, shard_range

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("items", [0, 1, 2, 7, 458])
@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_slices_partition_the_cases_in_order(items, count):
    slices = [shard_range(items, i, count) for i in range(1, count + 1)]
    assert [p for s in slices for p in s] == list(range(items))
    assert max(map(len, slices)) - min(map(len, slices)) <= 1


@pytest.mark.parametrize("text", ["0/2", "3/2", "1", "a/b", "1/0", "/2", "-1/2"])
def test_bad_shards_name_the_option(text):
    with pytest.raises(ValueError, match="--shard"):
        parse_shard(text)


def _collected(*args):
    run = subprocess.run([sys.executable, "-m", "pytest", "verify/test_mx.py", "verify/test_norm.py",
                          "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    return run.returncode, [line for line in run.stdout.splitlines() if "::" in line], run.stderr


def test_shards_of_the_suite_are_its_cases_once_each():
    code, whole, _ = _collected("-k", "not real")
    assert code == 0 and len(whole) > 10
    parts = [_collected("-k", "not real", "--shard", f"{i}/3")[1] for i in (1, 2, 3)]
    assert [case for part in parts for case in part] == whole
    assert all(parts)


def test_a_bad_shard_is_a_usage_error():
    code, _, err = _collected("--shard", "4/3")
    assert code == 4 and "--shard must be I/N" in err
