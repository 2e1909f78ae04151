"""The fast wide layer over real ranks on the CPU: its kernel set (the virtual layer's four,
the arrival signal and the wait) compiles for every target at every rank count the real
layer splits into, the signal kernel's PTX releases at system scope, the symmetric buffer's
layout holds every field apart and aligned, and bad arguments are refused before any
distributed or device work (no GPU needed; the GPUs run ``verify/test_wide_peer.py``)."""

import dataclasses
import math
import re

import pytest
import torch

from fast import backend
from model.config import LatentMoEConfig
from tools.ptx_dump import dump_ptx

_cute_error = backend.cute_import_error()
needs_cute = pytest.mark.skipif(_cute_error is not None,
                                reason=f"CuTe DSL not importable: {_cute_error}")
CONFIGS = {"kimi_k3": LatentMoEConfig.kimi_k3(), "small": LatentMoEConfig.small(),
           "small_i1024": dataclasses.replace(LatentMoEConfig.small(), intermediate=1024)}


@needs_cute
@pytest.mark.parametrize("arch", backend.TARGETS)
@pytest.mark.parametrize("config,ranks", [("kimi_k3", 2), ("kimi_k3", 8), ("kimi_k3", 16),
                                          ("small", 2), ("small_i1024", 16)])
def test_wide_peer_kernels_compile(arch, config, ranks):
    from fast.schedules.wide import compile_all, kernel_params

    params = kernel_params(CONFIGS[config], ranks, peers=True)
    assert sorted(params) == sorted(["publish", "route", "latent_all_reduce",
                                     "hidden_all_reduce", "signal", "wait"])
    compiled = compile_all(CONFIGS[config], ranks, arch, peers=True)
    assert len(compiled) == 6 and all(fn is not None for fn in compiled)


_SIGNAL_PTX = """
import cutlass.cute as cute
from cutlass import Int64
from fast import backend
from fast.device.arrival import ArrivalSignalKernel
cute.compile(ArrivalSignalKernel({ranks}), Int64(0), backend.fake_stream(),
             options="--gpu-arch {arch}")
"""


@needs_cute
@pytest.mark.parametrize("arch", backend.TARGETS)
def test_signal_releases_at_system_scope(arch, tmp_path):
    """The signal kernel's PTX (the DSL's own dump): a system-scope fence, then one
    ``red.release.sys`` add of 1 on the counter (peer stores before it are seen by a reader
    that acquires the count), after the CTA barrier; no other global store."""
    dumps = dump_ptx(_SIGNAL_PTX.format(ranks=8, arch=arch), tmp_path,
                     "*ArrivalSignalKernel*.ptx")
    assert len(dumps) == 1, f"expected one PTX dump of the signal kernel, found {dumps}"
    lines = [ln.strip() for ln in dumps[0].read_text().splitlines()]
    fence = [i for i, ln in enumerate(lines) if ln.startswith("fence.acq_rel.sys")]
    barrier = [i for i, ln in enumerate(lines) if ln.startswith("bar.sync") or
               ln.startswith("barrier.sync")]
    red = [i for i, ln in enumerate(lines) if "red.release.sys.global.add.u32" in ln]
    assert len(fence) == 1 and len(red) == 1 and barrier, "\n".join(lines)
    assert fence[0] < barrier[0] < red[0], "the release must follow the fence and the barrier"
    assert re.search(r"red\.release\.sys\.global\.add\.u32 \[%rd\d+\], 1;", lines[red[0]]), \
        lines[red[0]]
    stores = [ln for ln in lines if ln.startswith("st.global") or ln.startswith("st.volatile")]
    assert not stores, f"the signal kernel stores data: {stores}"


@pytest.mark.parametrize("config,ranks", [("kimi_k3", 8), ("small", 2), ("small_i1024", 16)])
def test_symmetric_layout_fields_apart_and_aligned(config, ranks):
    """Every field of the symmetric buffer starts on 256 bytes, holds its shape, and no
    two overlap; the mailbox, the shared partials and the up columns have one buffer per
    mailbox rotation, the counters one word per wait and rank."""
    from fast.schedules.wide import MAILBOX_BUFFERS
    from fast.schedules.wide_peer import WAITS, symmetric_layout

    c, rows = CONFIGS[config], 96
    layout, size = symmetric_layout(c, ranks, rows)
    want = {"mailbox": (MAILBOX_BUFFERS, rows, c.latent + 2 * c.experts),
            "partial": (rows, c.latent), "shared": (MAILBOX_BUFFERS, rows, c.hidden),
            "up": (MAILBOX_BUFFERS, rows, c.hidden // ranks), "arrivals": (len(WAITS), ranks)}
    assert {k: v[1] for k, v in layout.items()} == want
    spans = sorted((at, at + math.prod(shape) * dtype.itemsize)
                   for at, shape, dtype in layout.values())
    assert all(at % 256 == 0 for at, _ in spans)
    assert all(a_end <= b_at for (_, a_end), (b_at, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= size and size % 256 == 0
    assert layout["arrivals"][2] == torch.int32 and layout["mailbox"][2] == torch.int16


def test_wide_peer_refuses_bad_arguments_before_any_distributed_work():
    """Bad weights, max_rows, timeout: a clear error naming the argument; then, with
    torch.distributed not initialised, a clear error saying how to launch."""
    import torch.distributed as dist

    from fast.schedules.wide_peer import WidePeerLayer
    from verify import cases

    assert not dist.is_initialized()
    w = cases.weights("small")
    with pytest.raises(TypeError, match="weights must be LatentMoEWeights"):
        WidePeerLayer({"gate": torch.zeros(1)})
    for bad in (64, 1025, 100.0, True):
        with pytest.raises(ValueError, match=r"max_rows must be an int in \[65, wide_rows=1024\]"):
            WidePeerLayer(w, max_rows=bad)
    for bad in (0, -1, 601, "1"):
        with pytest.raises(ValueError, match="timeout_s must be a number of seconds"):
            WidePeerLayer(w, max_rows=128, timeout_s=bad)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        WidePeerLayer(w, max_rows=128)
