"""CPU checks of the fast kernels: every kernel compiles for sm_90a, sm_100a and sm_103a
(CuTe DSL compiles without a GPU), the kernels' own exp/tanh/sigmoid are accurate over
every BF16 input, the constants of ``fast._cute`` and ``reference.emulation`` agree, and
the wrappers reject bad input before any launch."""

import pytest
import torch

from fast import backend
from reference import emulation as em

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


@needs_cute
def test_constants_agree_with_emulation():
    from fast import _cute

    for name in ("EXP_LO", "EXP_HI", "LOG2E", "LN2_HI", "LN2_LO", "EXP_COEFFS", "TANH_SMALL", "TANH_COEFFS"):
        assert getattr(_cute, name) == getattr(em, name), name


def _all_bf16():
    b = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    return b[torch.isfinite(b)]


def _ulp_error(got, exact64):
    ref32 = exact64.float()
    spacing = (torch.nextafter(ref32.abs(), torch.tensor(float("inf"))) - ref32.abs()).double()
    return ((got.double() - exact64).abs() / spacing).max().item()


def test_emulated_functions_accuracy_over_all_bf16():
    """Measured max errors (in FP32 ULPs of the exact value) of the kernels' functions over
    every finite BF16 input: the figures docs/fast.md quotes (exp <= 1 ulp, tanh <= 1 ulp,
    sigmoid <= 2 ulp)."""
    b = _all_bf16()
    x = b[(b > -87) & (b < 88)]
    assert _ulp_error(em.exp_rn(x), torch.exp(x.double())) < 1.0
    for scale in (1.0, 4.0, 25.0):
        y = b / torch.tensor(scale)
        assert _ulp_error(em.tanh_rn(y), torch.tanh(y.double())) < 1.0
    s = b[b > -87]
    assert _ulp_error(em.sigmoid_rn(s), torch.sigmoid(s.double())) < 2.0
    # special values: overflow, underflow, NaN propagation, signed zero
    sp = torch.tensor([200.0, -200.0, float("nan"), -0.0, 0.0])
    e = em.exp_rn(sp)
    assert e[0].item() == float("inf") and e[1].item() == 0.0 and e[2].isnan() and e[3].item() == 1.0
    t = em.tanh_rn(sp)
    assert t[0].item() == 1.0 and t[1].item() == -1.0 and t[2].isnan()
    assert str(t[3].item()) == "-0.0" and str(t[4].item()) == "0.0"


def test_rms_norm_tree_close_to_reference():
    from reference import norm as rnorm

    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 3584, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(3584, generator=g)).bfloat16()
    a = em.rms_norm_tree(x, w, 1e-5).view(torch.int16).int()
    b = rnorm.rms_norm(x, w, 1e-5).view(torch.int16).int()
    assert (a - b).abs().max().item() <= 1


def test_route_emulation_ties_to_lower_id():
    logits = torch.zeros(1, 64)
    bias = torch.zeros(64)
    bias[40:] = 1.0  # experts 40..63 win, in id order; then 0.. by id among the ties
    w, ids = em.route(logits, bias, top_k=16)
    assert ids[0].tolist() == list(range(40, 56))
    assert torch.allclose(w.sum(), torch.tensor(1.0))


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
def test_wrappers_reject_bad_input_before_launch(call, error):
    """On this CPU machine a launch would fail differently; the wrappers must raise the
    named error first (wrong dtype/shape: TypeError, wrong device/layout: ValueError)."""
    with pytest.raises(error):
        call()
