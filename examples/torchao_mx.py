"""An external backend: torchao's MXFP8 quantizer (``to_mx``) checked by ``pytest verify/``.

This file lives outside the ``latentmoe`` package on purpose: it is what a kernel engineer
writes for a kernel in another code base. It declares one stage, ``quantize_mxfp8``, which
an MX quantizer can only claim bit for bit, and wraps the library call in the interface's
types (BF16 ``[T, K]`` in; float8_e4m3fn codes and uint8 E8M0 scales out). Run its
contracts with

    pytest verify/ --backend examples/torchao_mx.py:TorchaoMX

Every other stage's contracts are skipped with the reason "does not implement"; the
summary table and ``verify-report.json`` list the backend with its version.
"""

from __future__ import annotations

import importlib.metadata

import torch

from verify.interface import BITWISE, Backend


def _torchao_version() -> str:
    try:
        return "torchao " + importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return "torchao not installed"


class TorchaoMX(Backend):
    """torchao's ``to_mx`` with the RCEIL scale rule, on the CPU (and on a GPU, where one
    is present)."""

    name = "torchao-mx"
    version = _torchao_version()
    devices = ("cpu", "cuda")
    claims = {"quantize_mxfp8": BITWISE}

    def available(self) -> tuple[bool, str]:
        try:
            from torchao.prototype.mx_formats.mx_tensor import to_mx  # noqa: F401
        except Exception as error:  # the reason becomes the contracts' skip reason
            return False, f"torchao's to_mx does not import: {type(error).__name__}: {error}"
        return True, ""

    def quantize_mxfp8(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x BF16 [T, K] -> (codes float8_e4m3fn [T, K], scales uint8 [T, K/32])."""
        from torchao.prototype.mx_formats.mx_tensor import ScaleCalculationMode, to_mx

        scales, codes = to_mx(x.contiguous(), torch.float8_e4m3fn, 32,
                              scaling_mode=ScaleCalculationMode.RCEIL)
        # torchao returns the scales as float8_e8m0fnu [T, K/32]: the interface wants the
        # E8M0 bit patterns as uint8.
        return codes.view(x.shape), scales.view(torch.uint8).view(x.shape[0], -1)
