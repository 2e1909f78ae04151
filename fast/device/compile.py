"""The one compile path of the fast kernels: ``compiled(kernel_class, arch, params)``.

Every kernel class states what it is compiled with, as one classmethod::

    @classmethod
    def compile_args(cls, **params) -> tuple[kernel, tuple]:
        # the kernel object built from its compile-time parameters, and the fake
        # arguments of its ``__call__`` but the stream (0 addresses, sizes of 1)

The widths, tiles and flags are the parameters (compile-time constants of the object);
the arguments are raw addresses (``Int64`` or typed null pointers) and run-time sizes, so
one compile serves every call of one shape. ``compiled`` builds the kernel, compiles it for
``arch`` with a stand-in stream (no GPU needed) and keeps the executable in one cache, keyed
by the class, the target and the parameters. The stage kernels (``fast.backend``), the
experts engine's kernels, ``fast.gemm``'s and the schedules' own kernels all compile here.
"""

from __future__ import annotations

import functools

__all__ = ["compiled", "frozen"]


def frozen(params: dict) -> tuple:
    """``params`` as the cache key ``compiled`` takes: its items sorted by name (the values
    hashable: ints, floats, bools, strings, or tuples of items for nested parameters)."""
    return tuple(sorted(params.items()))


@functools.lru_cache(maxsize=None)
def compiled(kernel_class: type, arch: str, params: tuple = ()):
    """``kernel_class`` built with the parameters ``params`` (``frozen`` items) and compiled
    for ``arch`` (``"sm_90a"``, ``"sm_100a"``, ``"sm_103a"``) with its fake arguments
    (``kernel_class.compile_args``) and a stand-in stream; no GPU needed. Cached: one
    compile per class, target and parameters."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    kernel, args = kernel_class.compile_args(**dict(params))
    return cute.compile(kernel, *args, make_fake_stream(), options=f"--gpu-arch {arch}")
