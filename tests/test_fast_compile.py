"""CPU checks of the fast kernels: every kernel compiles for sm_90a, sm_100a and sm_103a
(CuTe DSL compiles without a GPU), the availability reasons, and the wrappers reject bad
input before any launch. (The kernels' own exp / tanh / sigmoid and reduction tree are
measured in ``tests/test_emulation.py``; the kernels run in ``pytest verify/ -k fast``.)"""

import pytest
import torch

from fast import backend

_cute_error = backend.cute_import_error()
needs_cute = pytest.mark.skipif(_cute_error is not None, reason=f"CuTe DSL not importable: {_cute_error}")

# One representative shape bucket per kernel (the real widths) plus the swizzled quantizer.
BUCKETS = [(name, {}) for name in backend.KERNELS] + [("mx", {"swizzled": True})]


@needs_cute
@pytest.mark.parametrize("arch", backend.TARGETS)
@pytest.mark.parametrize("kernel,params", BUCKETS, ids=lambda v: str(v) if not isinstance(v, dict) else "-".join(f"{k}={x}" for k, x in v.items()) or "real")
def test_compiles(kernel, params, arch):
    fn = backend.compile_for_target(kernel, arch, **params)
    assert fn is not None


def test_gpu_arch_and_availability_reasons():
    ok, why = backend.device_supported()
    if not torch.cuda.is_available():
        assert (ok, why) == (False, "no CUDA device")
        assert backend.gpu_arch() is None
    for kernel in backend.KERNELS:
        assert backend.available(kernel) == (ok, why)
    with pytest.raises(KeyError):
        backend.available("nope")
    with pytest.raises(ValueError):
        backend.compile_for_target("norm", "sm_80")


@pytest.mark.parametrize(
    "call,error",
    [
        (lambda: __import__("fast.finalize").finalize.finalize(torch.zeros(16, 3584, dtype=torch.bfloat16), torch.zeros(1, 16)), ValueError),
        (lambda: __import__("fast.finalize").finalize.finalize(torch.zeros(15, 3584, dtype=torch.bfloat16), torch.zeros(1, 16)), TypeError),
        (lambda: __import__("fast.norm").norm.rms_norm(torch.zeros(2, 3584), torch.zeros(3584, dtype=torch.bfloat16), 1e-5), TypeError),
        (lambda: __import__("fast.norm").norm.rms_norm(torch.zeros(2, 3584, dtype=torch.bfloat16), torch.zeros(3584, dtype=torch.bfloat16), 1e-5), ValueError),
        (lambda: __import__("fast.activation").activation.situ_and_mul(torch.zeros(2, 12, dtype=torch.bfloat16), beta=4.0, linear_beta=25.0), TypeError),
        (lambda: __import__("fast.activation").activation.situ_and_mul(torch.zeros(2, 32, dtype=torch.bfloat16), beta=4.0, linear_beta=25.0), ValueError),
        (lambda: __import__("fast.router").router.route(torch.zeros(2, 896), torch.zeros(895)), TypeError),
        (lambda: __import__("fast.router").router.route(torch.zeros(2, 900), torch.zeros(900)), ValueError),
        (lambda: __import__("fast.router").router.route(torch.zeros(2, 896), torch.zeros(896)), ValueError),
        (lambda: __import__("fast.mx").mx.quantize_mxfp8(torch.zeros(2, 48, dtype=torch.bfloat16)), TypeError),
        (lambda: __import__("fast.mx").mx.quantize_mxfp8(torch.zeros(2, 64, dtype=torch.bfloat16)), ValueError),
    ],
)
@needs_cute
def test_wrappers_reject_bad_input_before_launch(call, error):
    """On this CPU machine a launch would fail differently; the wrappers must raise the
    named error first (wrong dtype/shape: TypeError, wrong device/layout: ValueError)."""
    with pytest.raises(error):
        call()
