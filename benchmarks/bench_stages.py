"""GPU timings of the memory-bound fast kernels beside the PyTorch op they replace, at the
real widths (latent 3584, 896 experts, top-16, shared intermediate 6144).

Each case reports the median kernel time from CUDA events with L2 flushed before every
run (a 256 MiB write queued ahead of the start event, which also hides the host launch
cost), GB/s from counted bytes (every input read once, every output written once), and
the measured device-to-device copy bandwidth as the ceiling.

    PYTHONPATH=. python3 -m pytest benchmarks/ --benchmark-json=benchmarks/results/h200.json

On a machine without a GPU every case is skipped with the reason. ``tests/gpu_selfcheck.py``
uses the same cases and timer.
"""

import statistics
import time

import pytest
import torch

from fast import backend

LATENT, EXPERTS, TOP_K, SHARED_I = 3584, 896, 16, 6144
BETA, LINEAR_BETA, EPS = 4.0, 25.0, 1e-5
BATCHES = (1, 2, 3, 7, 16, 64, 65, 100, 256, 1024)
BENCH_BATCHES = (1, 16, 64, 256, 1024)
KERNELS = ("mx", "mx_swizzled", "router", "finalize", "activation", "norm")

_FLUSH = {}


def flush_l2(device="cuda"):
    buf = _FLUSH.get(device)
    if buf is None:
        buf = _FLUSH[device] = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    buf.fill_(1)


def gpu_time_us(fn, reps=30, warmup=3):
    """Median microseconds of ``fn()`` by CUDA events, L2 flushed before each run.

    A GPU-side spin (``torch.cuda._sleep``, ~0.5 ms) is queued after the flush and before
    the start event, so the host finishes enqueueing ``fn`` (wrapper checks, pointer
    wrapping, launch) before the start event fires: the figure is device time only."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        flush_l2()
        torch.cuda._sleep(1_000_000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def host_us(fn, reps=200):
    """Host microseconds per call of ``fn`` (wrapper + launch), the device kept busy."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / reps * 1e6


def copy_bandwidth_gbs(nbytes=2 << 30):
    """Device-to-device copy bandwidth (bytes read + bytes written) in GB/s."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = gpu_time_us(lambda: b.copy_(a), reps=10)
    return 2 * nbytes / (us * 1e-6) / 1e9


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


_KERNEL_OF = {"mx_swizzled": "mx"}


def _skip_reason():
    ok, why = backend.device_supported()
    return None if ok else why


@pytest.fixture(scope="session")
def copy_gbs():
    why = _skip_reason()
    if why:
        pytest.skip(why)
    return copy_bandwidth_gbs()


@pytest.mark.benchmark_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("t", BENCH_BATCHES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_stage(benchmark, kernel, t, copy_gbs):
    why = _skip_reason()
    if why:
        pytest.skip(why)
    _, fast_fn, torch_fn, nbytes = make_case(kernel, t)
    fast_us = gpu_time_us(fast_fn)
    torch_us = gpu_time_us(torch_fn)
    benchmark.extra_info.update(
        kernel=kernel, batch=t, bytes=nbytes, fast_us=fast_us, torch_us=torch_us,
        fast_gbs=nbytes / (fast_us * 1e-6) / 1e9, torch_gbs=nbytes / (torch_us * 1e-6) / 1e9,
        copy_gbs=copy_gbs, speedup=torch_us / fast_us, device=torch.cuda.get_device_name(),
    )

    def once():
        fast_fn()
        torch.cuda.synchronize()

    benchmark.pedantic(once, rounds=20, warmup_rounds=2)
