"""The fast wide layer on the CPU: its own kernels (``fast.schedules.wide_kernels``) compile
for every target at every rank count the real layer splits into and at the small configs'
(no GPU needed; the H200 runs them in ``verify/test_wide_fast.py``), its rank rule agrees
with the reference's, and bad arguments are refused before anything touches a device."""

import dataclasses

import pytest
import torch

from fast import backend
from model.config import LatentMoEConfig
from reference.schedules.wide import check_wide_ranks
from tools.ptx_dump import dump_ptx
from tools.ptx_dump import loops as spin_loops

_cute_error = backend.cute_import_error()
needs_cute = pytest.mark.skipif(_cute_error is not None,
                                reason=f"CuTe DSL not importable: {_cute_error}")

#: small with the routed intermediate widened so that 8 and 16 TP ranks keep the engine's
#: 64-wide slices (``verify/test_wide_fast.py`` runs 8 and 16 virtual ranks on it).
WIDE16 = dataclasses.replace(LatentMoEConfig.small(), intermediate=1024)
CONFIGS = {"kimi_k3": LatentMoEConfig.kimi_k3(), "small": LatentMoEConfig.small(),
           "small_i1024": WIDE16}
COMPILE_CASES = [("kimi_k3", n) for n in (1, 2, 4, 8, 16)] + [("small", n) for n in (1, 2, 4)] \
    + [("small_i1024", n) for n in (8, 16)]


@needs_cute
@pytest.mark.parametrize("arch", backend.TARGETS)
@pytest.mark.parametrize("config,ranks", COMPILE_CASES)
def test_wide_kernels_compile(arch, config, ranks):
    from fast.schedules.wide import compile_all, kernel_params

    compiled = compile_all(CONFIGS[config], ranks, arch)
    assert len(compiled) == len(kernel_params(CONFIGS[config], ranks)) == 4
    assert all(fn is not None for fn in compiled)


def _accepts(check, config, ranks) -> bool:
    try:
        check(config, ranks)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_wide_fast_ranks_within_the_reference_rule(config):
    """Every rank count the fast layer takes is one the reference's split rule takes (the
    fast rule only adds the kernels' granules); the real layer runs TP 1, 2, 4, 8, 16."""
    from fast.schedules.wide import check_ranks

    cfg = CONFIGS[config]
    fast = [n for n in range(1, 65) if _accepts(check_ranks, cfg, n)]
    extra = [n for n in fast if not _accepts(check_wide_ranks, cfg, n)]
    assert not extra, f"{config}: the fast layer takes {extra}, which the reference refuses"
    want = {"kimi_k3": [1, 2, 4, 8, 16], "small": [1, 2, 4], "small_i1024": [1, 2, 4, 8, 16]}
    assert fast == want[config]


def test_wide_fast_rank_errors_name_the_reason():
    from fast.schedules.wide import check_ranks

    with pytest.raises(ValueError, match=r"3 ranks cannot split this layer: experts 896 % 3"):
        check_ranks(CONFIGS["kimi_k3"], 3)
    with pytest.raises(ValueError, match=r"intermediate/N = 32 % 64"):
        check_ranks(CONFIGS["small"], 8)
    wide32 = dataclasses.replace(LatentMoEConfig.small(), experts=1024, intermediate=2048)
    check_wide_ranks(wide32, 32)  # the reference splits it; the tail kernels stop at 16
    with pytest.raises(ValueError, match=r"wide layer: 32 ranks cannot split this layer: "
                                         r"32 ranks > 16$"):
        check_ranks(wide32, 32)
    for bad in (0, -2, 2.0, True, "8"):
        with pytest.raises(ValueError, match="ranks must be a positive int"):
            check_ranks(CONFIGS["kimi_k3"], bad)


def test_wide_layer_refuses_bad_arguments_before_any_device_work():
    """Bad ranks, a bucket outside 65..wide_rows, a CPU device, a bad timeout: a clear
    error naming the argument, before a weight is copied or a kernel compiled."""
    from fast.schedules.wide import WideLayer
    from verify import cases

    w = cases.weights("small")
    with pytest.raises(ValueError, match="3 ranks cannot split"):
        WideLayer(w, ranks=3)
    with pytest.raises(ValueError, match=r"max_rows must be an int in \[65, wide_rows=1024\]"):
        WideLayer(w, ranks=2, max_rows=64)
    with pytest.raises(ValueError, match=r"max_rows must be an int in \[65, wide_rows=1024\]"):
        WideLayer(w, ranks=2, max_rows=1025)
    with pytest.raises(ValueError, match="timeout_s"):
        WideLayer(w, ranks=2, max_rows=128, timeout_s=0)
    with pytest.raises(ValueError, match="device must be a CUDA device"):
        WideLayer(w, ranks=2, max_rows=128, device="cpu")
    with pytest.raises(TypeError, match="weights must be LatentMoEWeights"):
        WideLayer({"gate": torch.zeros(1)}, ranks=2)


def test_batch_invariant_refused_by_name_before_any_device_work():
    """``batch_invariant`` must be a bool, and True needs the K of every GEMM it runs on
    fast.gemm a multiple of 64 (fast.gemm's stage): every TP rank count of the real layer
    has it; with ``invariant_gemms="fast"`` the small configs' shared down-projection at 8
    and 16 ranks (K = S/N = 32, 16) does not and is refused naming the GEMM and K; the
    default (``"stock"``: the front alone on fast.gemm, K = H) and cuBLAS take it."""
    from fast.schedules.wide import WideLayer, check_batch_invariant
    from verify import cases

    w = cases.weights("small")
    for bad in (1, "yes", None):
        with pytest.raises(ValueError, match="WideLayer: batch_invariant must be a bool"):
            WideLayer(w, ranks=2, max_rows=128, device="cpu", batch_invariant=bad)
    for ranks in (1, 2, 4, 8, 16):
        check_batch_invariant("WideLayer", CONFIGS["kimi_k3"], ranks, True, invariant_gemms="fast")
    for ranks, k in ((8, 32), (16, 16)):
        with pytest.raises(ValueError, match=rf"WideLayer: batch_invariant=True runs the rank's "
                                             rf"GEMMs on fast.gemm, whose K must be a multiple "
                                             rf"of 64; at {ranks} ranks shared_down K={k} "):
            check_batch_invariant("WideLayer", CONFIGS["small_i1024"], ranks, True,
                                  invariant_gemms="fast")
        check_batch_invariant("WideLayer", CONFIGS["small_i1024"], ranks, True)
        check_batch_invariant("WideLayer", CONFIGS["small_i1024"], ranks, False,
                              invariant_gemms="fast")
    wide = dataclasses.replace(WIDE16, shared_intermediate=1024)  # verify's small_s1024
    check_batch_invariant("WidePeerLayer", wide, 16, True, invariant_gemms="fast")


_POLL_PTX = """
import cutlass.cute as cute
from cutlass import Int32, Int64
from fast import backend
from fast.schedules.wide_kernels import PollKernel
cute.compile(PollKernel({latent}, {experts}), *([Int64(0)] * 5 + [Int32(0)] * 2 + [Int32(1)] * 2),
             backend.fake_stream(), options="--gpu-arch {arch}")
"""


@needs_cute
@pytest.mark.parametrize("arch", backend.TARGETS)
def test_poll_spin_reloads_and_reads_the_clock(arch, tmp_path):
    """The poll's spin loops, in the PTX the compiler produced (the DSL's own dump): each
    loop re-issues the ``ld.volatile`` of its granule (a load hoisted out of the loop would
    spin on a stale value until the timeout) and reads ``%globaltimer`` (a loop without the
    clock could never time out: a hang); one loop per granule a thread polls at the real
    widths (448 latent + 224 logit granules over 128 threads: 6)."""
    dumps = dump_ptx(_POLL_PTX.format(latent=3584, experts=896, arch=arch), tmp_path,
                     "*PollKernel*.ptx")
    _check_spin_loops(dumps, 6, "the poll")


def _check_spin_loops(dumps, expected: int, what: str) -> None:
    """One PTX dump whose ``expected`` spin loops each reload their granule with
    ``ld.volatile`` and read ``%globaltimer``."""
    assert len(dumps) == 1, f"expected one PTX dump of {what}, found {dumps}"
    loops = spin_loops(dumps[0].read_text())
    assert len(loops) == expected, f"{len(loops)} spin loops in {what}'s PTX, expected {expected}"
    for body in loops:
        text = "\n".join(body)
        assert "ld.volatile.global.v4.u32" in text, "a spin loop without its volatile load:\n" + text
        assert "%globaltimer" in text, "a spin loop that never reads the clock:\n" + text


_ROUTE_PTX = """
import cutlass.cute as cute
from fast import backend
from fast.schedules import wide
from model.config import LatentMoEConfig
wide.compiled_kernel("route", "{arch}", wide.kernel_params(LatentMoEConfig.kimi_k3(), 8)["route"])
"""


@needs_cute
@pytest.mark.parametrize("arch", backend.TARGETS)
def test_polled_route_spin_reloads_and_reads_the_clock(arch, tmp_path):
    """The layer's route stage (``PolledRouteKernel``: the poll's code emitted for the
    router's 448 threads): the same two properties per spin loop, one loop per granule a
    thread polls (672 granules over 448 threads: 2)."""
    dumps = dump_ptx(_ROUTE_PTX.format(arch=arch), tmp_path, "*PolledRouteKernel*.ptx")
    _check_spin_loops(dumps, 2, "the polled route")


def test_polled_route_refuses_an_engine_whose_lists_it_was_not_built_for():
    """The polled-routing kernel does the wide engine's routing-lists work (every expert
    local, not strict, no empty rows): the layer refuses by name an engine whose list
    kernel would differ (a DEP owner's, a strict one), and the kernel refuses lists of
    another width."""
    from fast.schedules.wide import check_list_params, slice_list_params
    from fast.schedules.wide_route import PolledRouteKernel

    c = CONFIGS["kimi_k3"]

    class Engine:
        def __init__(self, **change):
            self.params = {**slice_list_params(c), **change}

        def list_params(self):
            return self.params

    check_list_params("WideLayer", Engine(), c)
    for change in (dict(strict=True), dict(first=56, count=56), dict(empty_rows=True)):
        with pytest.raises(ValueError, match="WideLayer: the experts engine's routing lists"):
            check_list_params("WideLayer", Engine(**change), c)
    with pytest.raises(ValueError, match="the engine's lists are for L=256"):
        PolledRouteKernel(c.latent, c.experts, c.top_k, True,
                          lists=dict(slice_list_params(c), latent=256))
