"""``verify.caches`` on the CPU: a module's own cached functions are cleared at its end
(imported ones and plain functions left alone), the shared GPU caches of ``verify.cases``
with them, and a module that keeps its caches (symmetric buffers) is left as it is."""

from __future__ import annotations

import ast
import functools
import types
from pathlib import Path

from verify import caches, cases


def make_module(keep: bool = False) -> types.ModuleType:
    module = types.ModuleType("verify.test_fake_module")

    def built():
        return object()

    def plain():
        return 1

    built.__module__ = plain.__module__ = module.__name__
    module.built = functools.cache(built)
    module.plain = plain
    module.imported = cases.rank_rows  # cached, but another module's
    if keep:
        module.KEEP_CACHES_AT_MODULE_END = True
    return module


def test_a_modules_own_caches_are_cleared_with_the_shared_gpu_caches():
    module = make_module()
    first = module.built()
    assert module.built() is first
    cases.rank_rows(cases.config("small"), 2, 3, 5)
    assert cases.rank_rows.cache_info().currsize >= 1
    assert caches.module_caches(module) == ["built"]
    assert caches.release_module_caches(module) == ["built"]
    assert module.built() is not first  # rebuilt after the module's end
    assert cases.rank_rows.cache_info().currsize == 0


def test_a_module_that_keeps_its_caches_is_left_alone():
    module = make_module(keep=True)
    first = module.built()
    assert caches.release_module_caches(module) == []
    assert module.built() is first


def test_the_test_modules_with_symmetric_buffers_keep_their_caches():
    """Read from the source (importing a contract module needs verify's own pytest
    configuration): each multi-GPU peer module sets the flag at module level."""
    root = Path(__file__).resolve().parents[1] / "verify"
    for name in ("test_dep_peer.py", "test_wide_peer.py"):
        tree = ast.parse((root / name).read_text())
        flags = [node for node in tree.body if isinstance(node, ast.Assign)
                 and any(getattr(t, "id", None) == "KEEP_CACHES_AT_MODULE_END" for t in node.targets)]
        assert len(flags) == 1 and ast.literal_eval(flags[0].value) is True, name
