"""CPU cost of the reference stages at the real dimensions (hidden 7168, latent 3584, 896
experts, top-16, routed intermediate 3072, shared intermediate 6144): what one call of a
stage costs a user who runs the contracts of ``verify/`` against the reference on a CPU.

Statistics: wall seconds per call (``perf_counter``; pytest-benchmark chooses the rounds,
at least 5, about half a second per case). CI compares them with the committed baseline of
its machine on the fastest round (``benchmarks.history``: on a shared CPU interference only
adds time)::

    python -m benchmarks.run cpu check        # what `make test` runs
    python -m pytest benchmarks/bench_reference.py   # the cases alone

Batches 1, 16 and 64 (the DEP schedule's decode range). The
routed experts are timed per pair (one token, one expert: dequantize the expert's MXFP4
weights, FC1, SiTU, MXFP8, FC2) with an empty dequantization cache, as each of the
896 experts meets it the first time; a token costs 16 pairs.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from model.config import LatentMoEConfig
from model.weights import LatentMoEWeights
from reference import activation, experts, finalize, gemm, mx, norm, router

CONFIG = LatentMoEConfig.kimi_k3()
CPU_BATCHES = (1, 16, 64)
STAGES = ("mx", "router_logits", "route", "activation", "finalize", "norm", "up_addmm")

pytestmark = [pytest.mark.benchmark_cpu,
              pytest.mark.benchmark(timer=time.process_time, min_rounds=5, max_time=0.5)]


#: glibc's ``M_MMAP_THRESHOLD`` and the largest value ``mallopt`` takes for it (64-bit),
#: and ``M_TRIM_THRESHOLD`` (fixing the first would leave the heap trimmed at 128 KiB).
M_MMAP_THRESHOLD, MMAP_THRESHOLD = -3, 32 << 20
M_TRIM_THRESHOLD, TRIM_THRESHOLD = -1, 1 << 30


@pytest.fixture(autouse=True, scope="module")
def fixed_mmap_threshold():
    """Fix glibc's mmap threshold at 32 MiB for the timings. Left dynamic, it moves with
    the sizes the process has freed, so a temporary of 0.1-32 MiB comes from a fresh,
    page-faulting mmap or from the reused heap depending on the cases run before: mx at
    T=64 took 5.0, 5.5 and 1.5 ms in three otherwise identical runs. Larger buffers (the
    float64 weight copies of the GEMMs) stay mmapped, as in any user's process."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError as error:
        pytest.skip(f"not glibc ({error}): the CPU timings are only defined with it")
    for option, value in ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        if libc.mallopt(option, value) != 1:
            pytest.fail(f"mallopt({option}, {value}) was refused")
    yield


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Time on one CPU thread. With torch's default (one thread per core) every parallel
    region waits for its slowest thread, and on a shared 2-core machine another process
    holding a core stalls each region: measured there with a second process busy,
    ``reference.fp.fma_f32`` on 57344 elements took 250 ms on two threads, 1.8 ms on one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _bf16(generator, *shape, scale=1.0):
    return (torch.randn(*shape, generator=generator) * scale).to(torch.bfloat16)


def make_stage_call(stage: str, t: int):
    """The reference call of ``stage`` at batch ``t`` on fixed random inputs of the real
    widths, as a no-argument callable."""
    c = CONFIG
    g = torch.Generator().manual_seed(1000 * STAGES.index(stage) + t)
    if stage == "mx":
        x = _bf16(g, t, c.latent)
        return lambda: mx.quantize_mxfp8(x)
    if stage == "router_logits":
        x, gate = _bf16(g, t, c.hidden), _bf16(g, c.experts, c.hidden, scale=c.hidden ** -0.5)
        return lambda: router.router_logits(x, gate)
    if stage == "route":
        logits = torch.randn(t, c.experts, generator=g) * 2
        bias = torch.randn(c.experts, generator=g) * 0.05
        return lambda: router.route(logits, bias, top_k=c.top_k)
    if stage == "activation":
        h = _bf16(g, t, 2 * c.shared_intermediate, scale=3.0)
        return lambda: activation.situ_and_mul(h, beta=c.situ_beta, linear_beta=c.situ_linear_beta)
    if stage == "finalize":
        rows = _bf16(g, t * c.top_k, c.latent)
        w = torch.rand(t, c.top_k, generator=g)
        w = w / w.sum(1, keepdim=True)
        return lambda: finalize.finalize(rows, w)
    if stage == "norm":
        x, w = _bf16(g, t, c.latent), 1 + _bf16(g, c.latent, scale=0.1)
        return lambda: norm.rms_norm(x, w, c.rms_eps)
    if stage == "up_addmm":
        shared, normed = _bf16(g, t, c.hidden), _bf16(g, t, c.latent)
        up = _bf16(g, c.hidden, c.latent, scale=c.latent ** -0.5)
        return lambda: gemm.addmm(shared, normed, up)
    raise KeyError(stage)


@pytest.mark.parametrize("t", CPU_BATCHES)
@pytest.mark.parametrize("stage", STAGES)
def test_reference(benchmark, stage, t):
    """One reference stage call at the real widths."""
    call = make_stage_call(stage, t)
    benchmark.extra_info.update(stage=stage, batch=t)
    benchmark(call)


def one_expert_weights() -> LatentMoEWeights:
    """Weights of the real shapes whose 896 experts all view one random MXFP4 expert
    (uniform random E2M1 bytes, E8M0 scales 118..125) and whose dense weights are zero
    views: a per-pair timing reads one expert, so the rest need no memory."""
    c = CONFIG
    g = torch.Generator().manual_seed(7)

    def codes(rows, cols):
        return torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8)

    def scales(rows, cols):
        return torch.randint(118, 126, (rows, cols // c.block), generator=g, dtype=torch.uint8)

    def every_expert(t):
        return t.expand(c.experts, *t.shape)

    def zeros(*shape):
        return torch.zeros((), dtype=torch.bfloat16).expand(*shape)

    i2, latent = 2 * c.intermediate, c.latent
    return LatentMoEWeights(
        gate=zeros(c.experts, c.hidden), bias=torch.zeros(c.experts),
        front=zeros(c.front_rows, c.hidden), shared_down=zeros(c.hidden, c.shared_intermediate),
        latent_norm=zeros(latent), up=zeros(c.hidden, latent),
        w13=every_expert(codes(i2, latent)), w13_scales=every_expert(scales(i2, latent)),
        w2=every_expert(codes(latent, c.intermediate)),
        w2_scales=every_expert(scales(latent, c.intermediate)), config=c)


def test_reference_expert_pair(benchmark):
    """One routed pair through ``reference.experts.pair_rows_fp32``, dequantization
    cache empty at every round (a fresh weights object; not timed)."""
    c = CONFIG
    weights = one_expert_weights()
    g = torch.Generator().manual_seed(11)
    codes, scales = mx.quantize_mxfp8(_bf16(g, 1, c.latent))
    x = mx.dequantize_mxfp8(codes, scales)
    expert = torch.tensor([5])

    def fresh_cache():
        return (dataclasses.replace(weights),), {}

    benchmark.extra_info.update(stage="experts", batch=1, pairs=1)
    benchmark.pedantic(lambda w: experts.pair_rows_fp32(x, expert, w, c), setup=fresh_cache,
                       rounds=3, warmup_rounds=0)
