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


def test_a_copy_inside_a_checkout_names_its_own_commit(tmp_path, monkeypatch):
    """A ``git archive`` copy sent to a GPU node sits inside the node's checkout; its
    ``COMMIT`` file, not the surrounding git, names it (a verification report once named
    the node checkout's older, dirty HEAD; ``verify/conftest.py`` reads ``tree_commit``)."""
    monkeypatch.delenv("BENCH_COMMIT", raising=False)
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "outer"], check=True)
    outer = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True,
                           text=True).stdout.strip()
    copy = tmp_path / "copy"
    copy.mkdir()
    assert provenance.tree_commit(copy) == outer  # without the marker git answers for it
    (copy / "COMMIT").write_text("6b38a72\n")
    assert provenance.tree_commit(copy) == "6b38a72"
