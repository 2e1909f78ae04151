"""``benchmarks/provenance.py``: a table run names the tree it measured, from
``BENCH_COMMIT``, a ``COMMIT`` file of a copied tree, or git, in that order."""

from __future__ import annotations

import subprocess

from benchmarks import provenance


def test_tree_commit_sources_in_order(tmp_path, monkeypatch):
    monkeypatch.delenv("BENCH_COMMIT", raising=False)
    assert provenance.tree_commit(tmp_path) == "unknown"  # no git, no COMMIT file
    (tmp_path / "COMMIT").write_text("7c8c4e5\n")
    assert provenance.tree_commit(tmp_path) == "7c8c4e5"
    monkeypatch.setenv("BENCH_COMMIT", "abc1234-dirty")
    assert provenance.tree_commit(tmp_path) == "abc1234-dirty"


def test_tree_commit_of_this_checkout(monkeypatch):
    monkeypatch.delenv("BENCH_COMMIT", raising=False)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=provenance.ROOT,
                          capture_output=True, text=True).stdout.strip()
    if not head:  # not a git checkout (a copied tree): the COMMIT file or "unknown"
        return
    assert provenance.tree_commit().removesuffix("-dirty") == head


def test_tree_note():
    assert provenance.tree_note({"commit": "7c8c4e5"}) == ", tree 7c8c4e5"
    assert provenance.tree_note({}) == ""
