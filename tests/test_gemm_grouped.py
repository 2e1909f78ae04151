"""``fast.gemm.grouped`` on the CPU: what a grouped launch of the DEP rank's front and
router runs at every T (one kernel shape, each GEMM its own K split, the front's CTAs
first), what it refuses, and its kernel compiled for every target without a stack frame.
The launch itself runs in ``verify/test_gemm_fast.py`` (``test_gemm_fast_grouped_*``)."""

from __future__ import annotations

import pytest

from fast import backend
from fast.gemm.host import default_tactic
from fast.gemm.grouped import grouped_launch
from fast.gemm.layout import MAX_TOKENS, Tactic

_cute_error = backend.cute_import_error()
FRONT, ROUTER, HIDDEN = 15872, 896, 7168  # kimi_k3: [2S + L, H] and [E, H]
ROUTER_SPLITS = 8  # the router's one K split (fast.gemm.splits_of at 132 multiprocessors)


def _front_tactic(tokens: int, wgmma: bool) -> Tactic:
    return default_tactic(FRONT, HIDDEN, tokens, 132, 1, wgmma)


@pytest.mark.parametrize("wgmma", [False, True])
def test_grouped_launch_at_every_batch(wgmma):
    for tokens in range(1, MAX_TOKENS + 1):
        tactic = _front_tactic(tokens, wgmma)
        g = grouped_launch(FRONT, ROUTER, HIDDEN, tokens, tactic, ROUTER_SPLITS)
        assert g.first.tactic == tactic and g.second.tactic.splits == ROUTER_SPLITS
        assert g.first.params == g.second.params and not g.first.params.get("chunked")
        tiles = FRONT // tactic.tile_rows, ROUTER // tactic.tile_rows
        assert g.first_blocks == tiles[0] * tactic.splits
        assert g.grid == g.first_blocks + tiles[1] * ROUTER_SPLITS
        # only the K split differs between the two GEMMs' tactics (it alone moves bits)
        assert g.second.tactic == Tactic(**{**vars(tactic), "splits": ROUTER_SPLITS})


def test_grouped_launch_refusals():
    tactic = _front_tactic(8, False)
    with pytest.raises(ValueError, match="tokens"):
        grouped_launch(FRONT, ROUTER, HIDDEN, MAX_TOKENS + 1, tactic, ROUTER_SPLITS)
    with pytest.raises(ValueError, match="serial"):
        grouped_launch(FRONT, ROUTER, HIDDEN, 8, Tactic(warps=2, mtiles=2, serial=True),
                       ROUTER_SPLITS)
    with pytest.raises(ValueError, match="n2=896"):  # 896 rows are not whole 256-row tiles
        grouped_launch(1024, ROUTER, HIDDEN, 8, Tactic(warps=4, mtiles=4, occupancy=1),
                       ROUTER_SPLITS)
    with pytest.raises(ValueError, match="K=7168"):  # 7168 is not 5 splits of 64-wide stages
        grouped_launch(FRONT, ROUTER, HIDDEN, 8, tactic, 5)


def _grouped_shapes():
    """(arch, kernel parameters) of every grouped kernel the front + router group launches
    at T = 1..64: both MMA kinds on sm_90a, ``mma.sync`` at the smallest and largest window
    count for the other targets."""
    cases = []
    for wgmma in (False, True):
        for tokens in range(1, MAX_TOKENS + 1):
            params = grouped_launch(FRONT, ROUTER, HIDDEN, tokens, _front_tactic(tokens, wgmma),
                                    ROUTER_SPLITS).first.params
            if ("sm_90a", params) not in cases:
                cases.append(("sm_90a", params))
    plain = [p for arch, p in cases if not p.get("wgmma")]
    for arch in backend.TARGETS[1:]:
        cases += [(arch, p) for p in (plain[0], plain[-1])]
    return cases


_COMPILE = """
import ast, sys
from fast.device.compile import compiled, frozen
from fast.gemm.kernel import GroupedSplitKGemmKernel
compiled(GroupedSplitKGemmKernel, sys.argv[1], frozen(ast.literal_eval(sys.argv[2])))
"""


@pytest.mark.skipif(_cute_error is not None, reason=f"CuTe DSL not importable: {_cute_error}")
@pytest.mark.parametrize("arch,params", _grouped_shapes(),
                         ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}{x}" for k, x in v.items()))
def test_grouped_kernel_compiles(arch, params):
    from fast.device.compile import compiled, frozen
    from fast.gemm.kernel import GroupedSplitKGemmKernel

    assert compiled(GroupedSplitKGemmKernel, arch, frozen(params)) is not None


@pytest.mark.skipif(_cute_error is not None, reason=f"CuTe DSL not importable: {_cute_error}")
def test_grouped_kernels_fit_their_registers(tmp_path):
    """The sm_90a grouped kernels of the fewest and the most windows of each MMA kind keep
    their accumulators in registers (no stack frame) at their occupancy. (Holding the
    chosen GEMM's arguments costs registers: 114 against the plain kernel's 96 at one
    window, of the 512 a thread may have there.)"""
    from tools.ptx_dump import run_compile
    from tools.sass_budget import kernel_attributes

    shapes = [p for arch, p in _grouped_shapes() if arch == "sm_90a"]
    ends = []
    for wgmma in (False, True):
        kind = [p for p in shapes if bool(p.get("wgmma")) == wgmma]
        ends += [kind[0], kind[-1]]
    assert {p["windows"] for p in ends} == {1, 8}
    for i, params in enumerate(ends):
        where = tmp_path / f"k{i}"
        where.mkdir()
        run_compile(_COMPILE, ["sm_90a", repr(params)], keep="cubin", dump_dir=where)
        (cubin,) = sorted(where.rglob("*.cubin"))
        attrs = kernel_attributes(cubin.read_bytes())
        threads = 32 * params["warps"]
        assert attrs["frame"] == 0, (params, attrs)
        assert attrs["registers"] <= 65536 // (params["occupancy"] * threads), (params, attrs)


def test_grouped_kernel_refuses_chunks_and_serial_splits():
    if _cute_error is not None:
        pytest.skip(f"CuTe DSL not importable: {_cute_error}")
    from fast.gemm.kernel import GroupedSplitKGemmKernel

    for extra in ({"chunked": True}, {"serial": True}):
        with pytest.raises(ValueError, match="not grouped"):
            GroupedSplitKGemmKernel(warps=2, mtiles=2, **extra)
