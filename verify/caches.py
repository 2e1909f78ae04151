"""Dropping a test module's cached layers when the module ends.

The contracts at the real dimensions build their layers once per module and keep them in
``functools.cache`` functions of the module (a DEP16 or TP8 layer at the real dimensions
holds its 15.7 GB of repacked MXFP4 experts, often beside the 15.7 GB weights it was made
from). One process that runs every real-dimension module (one ``-m real_dimensions`` worker,
as an 80 GB card needs) would keep every module's layers to the end of the session, and the
TP8 batch-invariant case, which builds one more layer, ran out of an H100's 79 GiB. So at the
end of each module ``verify/conftest.py`` clears the module's caches and the GPU-resident
caches of :mod:`verify.cases` (:data:`SHARED_GPU_CACHES`), and hands the freed blocks back to
the driver; a later module that needs the same objects rebuilds them (seconds on the GPU).

A module whose cached objects must outlive it (a symmetric-memory buffer that a peer process
may still write into after this process has left the module) sets
``KEEP_CACHES_AT_MODULE_END = True``.
"""

from __future__ import annotations

import gc
import types

import torch

from verify import cases

#: The :mod:`verify.cases` caches that may hold GPU tensors, cleared with each module's.
SHARED_GPU_CACHES = (cases.expert_code_weights, cases.rank_rows)


def module_caches(module: types.ModuleType) -> list[str]:
    """The names of ``module``'s own cached functions (``functools.cache`` /
    ``lru_cache``: they have ``cache_clear``), defined in it, not imported into it."""
    return sorted(name for name, value in vars(module).items()
                  if callable(getattr(value, "cache_clear", None))
                  and getattr(value, "__module__", None) == module.__name__)


def release(*cached) -> None:
    """Clear these cached functions now (a module's layer no later case uses, before a case
    that builds another at the real dimensions), collect, and return freed CUDA blocks."""
    for function in cached:
        function.cache_clear()
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def release_module_caches(module: types.ModuleType) -> list[str]:
    """Clear ``module``'s cached functions and :data:`SHARED_GPU_CACHES`, collect, and
    return freed CUDA blocks to the driver (where CUDA is initialized); returns the names
    of the module's caches cleared, ``[]`` where the module sets
    ``KEEP_CACHES_AT_MODULE_END``."""
    if getattr(module, "KEEP_CACHES_AT_MODULE_END", False):
        return []
    names = module_caches(module)
    release(*(getattr(module, name) for name in names), *SHARED_GPU_CACHES)
    return names
