"""GPU timings of the memory-bound fast kernels beside the PyTorch op they replace, at the
real widths (latent 3584, 896 experts, top-16, shared intermediate 6144).

Each case's pytest-benchmark statistics are the kernel's device time in seconds, one
round per L2-flushed launch (``benchmarks.gpu_timing``). ``extra_info`` holds the counted
bytes (every input read once, every output written once), GB/s and the fraction of the
device-to-device copy bandwidth measured in the same session, and the PyTorch op's median
device time under ``peers["torch"]``, timed the same way.

    make bench                                # set up, run, save, compare (benchmarks/README.md)
    python -m pytest benchmarks/bench_stages.py --benchmark-json=out.json   # the cases alone

On a machine without a GPU every case is skipped with the reason.
"""

import pytest
import torch

from benchmarks import gpu_timing
from model.config import LatentMoEConfig

_REAL = LatentMoEConfig.kimi_k3()
LATENT, EXPERTS, TOP_K, SHARED_I = _REAL.latent, _REAL.experts, _REAL.top_k, _REAL.shared_intermediate
BETA, LINEAR_BETA, EPS = 4.0, 25.0, 1e-5
BATCHES = (1, 2, 3, 7, 16, 64, 65, 100, 256, 1024)
BENCH_BATCHES = (1, 16, 64, 256, 1024)
KERNELS = ("mx", "mx_swizzled", "router", "finalize", "activation", "norm")
#: kernel -> (stage page it belongs to, variant)
STAGE_OF = {"mx": ("mx", None), "mx_swizzled": ("mx", "swizzled"), "router": ("router", None),
            "finalize": ("finalize", None), "activation": ("activation", None),
            "norm": ("norm", None)}


def make_case(kernel, t, seed=0, device="cuda"):
    """(inputs dict, fast callable, torch callable, counted bytes) for ``kernel`` at batch t."""
    g = torch.Generator(device="cpu").manual_seed(seed * 7919 + t)
    if kernel in ("mx", "mx_swizzled"):
        from fast import mx

        blocks = torch.randn(t, LATENT // 32, 32, generator=g)
        spread = torch.exp(torch.randn(t, LATENT // 32, 1, generator=g) * 3)  # per-block scales
        x = (blocks * spread).reshape(t, LATENT).bfloat16().to(device)
        sw = kernel == "mx_swizzled"
        nbytes = x.numel() * 2 + x.numel() + x.numel() // 32
        return {"x": x}, (lambda: mx.quantize_mxfp8(x, swizzled=sw)), \
            (lambda: _torch_mx(x)), nbytes
    if kernel == "router":
        from fast import router

        logits = (torch.randn(t, EXPERTS, generator=g) * 2).to(device)
        bias = (torch.randn(EXPERTS, generator=g) * 0.1).to(device)
        nbytes = logits.numel() * 4 + bias.numel() * 4 + t * TOP_K * 8
        return {"logits": logits, "bias": bias}, (lambda: router.route(logits, bias)), \
            (lambda: _torch_route(logits, bias)), nbytes
    if kernel == "finalize":
        from fast import finalize

        rows = torch.randn(t * TOP_K, LATENT, generator=g).bfloat16().to(device)
        w = torch.rand(t, TOP_K, generator=g).to(device)
        w = w / w.sum(1, keepdim=True)
        nbytes = rows.numel() * 2 + w.numel() * 4 + t * LATENT * 2
        return {"rows": rows, "weights": w}, (lambda: finalize.finalize(rows, w)), \
            (lambda: torch.einsum("tk,tkl->tl", w, rows.view(t, TOP_K, LATENT).float()).bfloat16()), nbytes
    if kernel == "activation":
        from fast import activation

        h = (torch.randn(t, 2 * SHARED_I, generator=g) * 3).bfloat16().to(device)
        nbytes = h.numel() * 2 + t * SHARED_I * 2
        return {"h": h}, (lambda: activation.situ_and_mul(h, beta=BETA, linear_beta=LINEAR_BETA)), \
            (lambda: _torch_situ(h)), nbytes
    if kernel == "norm":
        from fast import norm

        x = torch.randn(t, LATENT, generator=g).bfloat16().to(device)
        w = (1 + 0.1 * torch.randn(LATENT, generator=g)).bfloat16().to(device)
        nbytes = x.numel() * 4 + w.numel() * 2
        return {"x": x, "weight": w}, (lambda: norm.rms_norm(x, w, EPS)), \
            (lambda: torch.nn.functional.rms_norm(x, (LATENT,), w, EPS)), nbytes
    raise KeyError(kernel)


def _torch_mx(x):
    xb = x.float().view(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    e = torch.ceil(torch.log2(amax / 448)).clamp(-127, 127)
    return (xb * torch.exp2(-e)).clamp(-448, 448).to(torch.float8_e4m3fn), (e + 127).to(torch.uint8)


def _torch_route(logits, bias):
    s = torch.sigmoid(logits)
    ids = torch.topk(s + bias, TOP_K, dim=1).indices
    w = s.gather(1, ids)
    return w / w.sum(1, keepdim=True), ids.int()


def _torch_situ(h):
    g, u = h.float().chunk(2, dim=1)
    return (BETA * torch.tanh(g / BETA) * torch.sigmoid(g) * (LINEAR_BETA * torch.tanh(u / LINEAR_BETA))).bfloat16()


@gpu_timing.device_timed
@pytest.mark.parametrize("t", BENCH_BATCHES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_stage(benchmark, kernel, t, copy_gbs):
    """The fast kernel's device time (statistics) and the PyTorch op's (``peers``)."""
    _, fast_fn, torch_fn, nbytes = make_case(kernel, t)
    torch_us = gpu_timing.median_device_us(torch_fn, reps=30, warmup=3)
    fast_us = gpu_timing.measure(benchmark, fast_fn)
    stage, variant = STAGE_OF[kernel]
    benchmark.extra_info.update(gpu_timing.bandwidth_info(
        stage=stage, variant=variant, batch=t, nbytes=nbytes, device_us=fast_us,
        copy_gbs=copy_gbs, peers={"torch": torch_us}))
