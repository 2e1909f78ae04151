"""The backends a contract runs against, chosen at this one place.

A backend names *who computes* the thing under test; the contract then compares it with
the reference (bitwise, or within a derived bound). Each backend says whether this machine
can run it and, when not, why — that reason becomes the pytest skip reason, so a contract
that could not run says so instead of silently comparing the reference with itself.

| name | what computes | where |
|---|---|---|
| ``reference`` | the reference stages and schedule emulations (``reference/``) | CPU |
| ``reference-cuda`` | the same code on CUDA tensors (PyTorch's CUDA ops) | any CUDA GPU |
| ``stock`` | the stock PyTorch / cuBLAS / torchao ops the fast paths replace | CPU, and CUDA where present |
| ``fast`` | the project's CuTe DSL kernels and schedules (``fast/``) | SM90 / SM100 GPUs |
"""

from __future__ import annotations

import dataclasses
import functools

import torch


@dataclasses.dataclass(frozen=True)
class Backend:
    """One backend: its name, the device its tensors live on, and whether it can run."""

    name: str
    device: str
    description: str

    def availability(self) -> tuple[bool, str]:
        """(True, "") when it can run here, else (False, the reason)."""
        return _availability(self.name)

    def __str__(self) -> str:
        return self.name


@functools.cache
def _availability(name: str) -> tuple[bool, str]:
    if name in ("reference", "stock"):
        return True, ""
    if not torch.cuda.is_available():
        return False, f"backend {name!r} needs a CUDA GPU and this machine has none"
    if name == "reference-cuda":
        return True, ""
    if name == "fast":
        try:
            from fast import backend as fast_backend
        except Exception as error:  # the reason is reported, never swallowed
            return False, f"backend 'fast' could not be imported: {error!r}"
        return fast_backend.device_supported()
    raise KeyError(name)


def _stock_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("reference", "cpu", "reference stages and schedule emulations on the CPU"),
        Backend("reference-cuda", "cuda", "the reference code on CUDA tensors"),
        Backend("stock", _stock_device(), "stock PyTorch/cuBLAS/torchao ops"),
        Backend("fast", "cuda", "the project's CuTe DSL kernels and schedules"),
    )
}


def get(name: str) -> Backend:
    """The backend called ``name`` (KeyError lists the known names)."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise KeyError(f"unknown backend {name!r}; known: {sorted(BACKENDS)}") from None
