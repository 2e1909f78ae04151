"""Where the fast kernels are chosen, compiled and launched: the one place that knows the
GPU architecture.

* ``gpu_arch()`` -- the CuTe DSL target of the current CUDA device (``"sm_90a"``,
  ``"sm_100a"``, ``"sm_103a"``, else ``"sm_XY"``), or None without a device.
* ``available(kernel)`` / ``device_supported()`` -- ``(ok, reason)``; the reason is the
  pytest skip reason ("no CUDA device", "CuTe DSL not importable: ...", "kernel targets
  sm_90a/sm_100a/sm_103a, device is sm_80").
* ``compile_for_target(kernel, arch, **params)`` -- compile a kernel with fake arguments
  (no GPU needed): the CPU CI compiles every kernel for every target this way.
* ``compiled(kernel, arch, **params)`` -- the cached executable for one shape bucket
  (the widths are compile-time constants; the row count is a run-time ``Int32``), built
  by ``fast.device.compile`` from the stage kernel's class (``kernel_class``).

Kernels take raw device addresses (``cute.runtime.make_ptr``) plus sizes, so one compile
serves every batch and a launch costs a few pointer wraps, not a DLPack conversion.
"""

from __future__ import annotations

import functools
import importlib

import torch

from model.config import LatentMoEConfig

__all__ = [
    "TARGETS",
    "KERNELS",
    "gpu_arch",
    "device_arch",
    "cute_import_error",
    "available",
    "device_supported",
    "compile_for_target",
    "fake_stream",
    "compiled",
    "default_params",
    "kernel_class",
]

TARGETS = ("sm_90a", "sm_100a", "sm_103a")

#: The real layer, whose widths are every kernel's default compile parameters.
REAL = LatentMoEConfig.kimi_k3()

# kernel name -> (module, kernel class, default compile parameters: the real widths)
KERNELS: dict[str, tuple[str, str, dict]] = {
    "finalize": ("fast.finalize", "FinalizeKernel", {"width": REAL.latent, "top_k": REAL.top_k}),
    "norm": ("fast.norm", "NormKernel", {"width": REAL.latent}),
    "activation": ("fast.activation", "SituKernel", {"n": REAL.shared_intermediate}),
    "router": ("fast.router", "RouterKernel", {"experts": REAL.experts, "top_k": REAL.top_k,
                                               "renormalize": REAL.renormalize}),
    "mx": ("fast.mx", "QuantizeKernel", {"k": REAL.latent, "swizzled": False}),
}

_ARCHS = {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a"}


def gpu_arch(device=None) -> str | None:
    """CuTe DSL target of ``device`` (default: the current CUDA device), None without one."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return _ARCHS.get((major, minor), f"sm_{major}{minor}")


def device_arch(device) -> str:
    arch = gpu_arch(device)
    if arch not in TARGETS:
        raise RuntimeError(f"fast kernels target {'/'.join(TARGETS)}, device is {arch}")
    return arch


@functools.cache
def cute_import_error() -> str | None:
    """None when the CuTe DSL imports, else the error text."""
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
        from cutlass.cute.runtime import make_ptr  # noqa: F401
    except Exception as error:  # reported as the skip reason, never swallowed silently
        return f"{type(error).__name__}: {error}"
    return None


def device_supported() -> tuple[bool, str]:
    """(True, "") when this machine can run the fast kernels, else (False, why)."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    error = cute_import_error()
    if error:
        return False, f"CuTe DSL not importable: {error}"
    arch = gpu_arch()
    if arch not in TARGETS:
        return False, f"kernel targets {'/'.join(TARGETS)}, device is {arch}"
    return True, ""


def require_supported(who: str) -> None:
    """A RuntimeError starting with ``who`` unless this machine can run the fast kernels
    (``device_supported``); every fast layer, engine and GEMM checks this at construction."""
    ok, why = device_supported()
    if not ok:
        raise RuntimeError(f"{who}: the fast kernels cannot run here: {why}")


def cuda_device(who: str, device=None) -> torch.device:
    """``device`` (default ``"cuda"``) as a ``torch.device`` with its index (the current
    device when it has none); a ValueError starting with ``who`` unless it is a CUDA
    device."""
    device = torch.device(device if device is not None else "cuda")
    if device.type != "cuda":
        raise ValueError(f"{who}: device must be a CUDA device, got {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def available(kernel: str) -> tuple[bool, str]:
    """(True, "") when ``kernel`` can run on this machine, else (False, the reason)."""
    if kernel not in KERNELS:
        raise KeyError(f"unknown kernel {kernel!r}; known: {sorted(KERNELS)}")
    return device_supported()


def default_params(kernel: str) -> dict:
    return dict(KERNELS[kernel][2])


def kernel_class(kernel: str) -> type:
    """The class of the stage kernel named ``kernel`` (``KERNELS``)."""
    if kernel not in KERNELS:
        raise KeyError(f"unknown kernel {kernel!r}; known: {sorted(KERNELS)}")
    module, name, _ = KERNELS[kernel]
    return getattr(importlib.import_module(module), name)


# --- argument wrapping -----------------------------------------------------------------


def _dtypes():
    import cutlass

    return {
        "bf16": cutlass.BFloat16,
        "f32": cutlass.Float32,
        "i32": cutlass.Int32,
        "u8": cutlass.Uint8,
    }


_ALIGN = {"bf16": 16, "f32": 16, "i32": 16, "u8": 16}


def ptr(tensor: torch.Tensor | None, kind: str, align: int | None = None):
    """A global-memory CuTe pointer to ``tensor`` (None: a null pointer, for compiling)."""
    import cutlass
    from cutlass.cute.runtime import make_ptr

    address = 0 if tensor is None else tensor.data_ptr()
    return make_ptr(
        _dtypes()[kind], address, cutlass.AddressSpace.gmem, assumed_align=align or _ALIGN[kind]
    )


def int32(value: int):
    import cutlass

    return cutlass.Int32(int(value))


def float32(value: float):
    import cutlass

    return cutlass.Float32(float(value))


def stream(device=None):
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)


def fake_stream():
    """A stand-in stream for compiling a kernel without a GPU (``cute.compile``'s stream
    argument)."""
    from cutlass.cute.runtime import make_fake_stream

    return make_fake_stream()


# --- compiling -------------------------------------------------------------------------


def compile_for_target(kernel: str, arch: str, **params):
    """Compile ``kernel`` for ``arch`` (one of TARGETS) with fake arguments; no GPU needed.
    ``params`` default to the real widths (``KERNELS``). Returns the compiled object."""
    if arch not in TARGETS:
        raise ValueError(f"arch must be one of {TARGETS}, got {arch!r}")
    error = cute_import_error()
    if error:
        raise RuntimeError(f"CuTe DSL not importable: {error}")
    return compiled(kernel, arch, **{**default_params(kernel), **params})


def compiled(kernel: str, arch: str, **params):
    """The cached executable of ``kernel`` for ``arch`` and one shape bucket (``params``),
    from ``fast.device.compile`` (the one compile path and cache of every fast kernel)."""
    from fast.device import compile as device_compile

    return device_compile.compiled(kernel_class(kernel), arch, device_compile.frozen(params))
