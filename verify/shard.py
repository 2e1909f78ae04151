"""One slice of the selected cases: ``pytest verify/ --shard I/N``.

A node whose calls are limited in time (a device lease of 600 s a command) runs the suite in
``N`` calls, each ``--shard I/N`` for ``I = 1..N``, and joins the calls' reports with
``python -m verify.report merge``. The slices are contiguous runs of the collection order
(after ``-m``, ``-k`` and the backend selection), so the cases of one module, which share
its cached layers (``verify.caches``), stay together as far as the slice sizes allow; every
case is in exactly one slice, and every pytest-xdist worker, collecting the same items,
computes the same slice.
"""

from __future__ import annotations

import pytest

__all__ = ["ShardSelection", "parse_shard", "shard_range"]


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> ``(I, N)`` with ``1 <= I <= N``. Raises ValueError naming ``--shard``
    for any other text."""
    index, sep, count = text.partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        i = n = 0
    if not sep or n < 1 or not 1 <= i <= n:
        raise ValueError(f"--shard must be I/N with 1 <= I <= N (for example 1/2), got {text!r}")
    return i, n


def shard_range(items: int, index: int, count: int) -> range:
    """The positions of slice ``index`` of ``count`` (1-based) among ``items`` cases in
    collection order: ``[floor((index - 1) items / count), floor(index items / count))``.
    The ``count`` slices partition ``range(items)``; their sizes differ by at most one."""
    if items < 0:
        raise ValueError(f"items must be non-negative, got {items}")
    parse_shard(f"{index}/{count}")
    return range((index - 1) * items // count, index * items // count)


class ShardSelection:
    """The pytest plugin of ``--shard I/N`` (registered by ``verify/conftest.py``): keeps
    the cases of :func:`shard_range` and deselects the others, after every other selection
    (``trylast``: ``-m``, ``-k`` and the backend selection have run)."""

    def __init__(self, index: int, count: int):
        parse_shard(f"{index}/{count}")
        self.index, self.count = index, count

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        keep = shard_range(len(items), self.index, self.count)
        drop = [item for i, item in enumerate(items) if i not in keep]
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = items[keep.start:keep.stop]
