"""CPU checks of the DEP rank's dense part (``fast.schedules.dense``): the per-GEMM backend
table is what the committed H200 measurements say, the modes choose what they promise, and
every fast.gemm kernel a ``DenseFront`` may launch is one of the shapes
``tests/test_gemm_fast.py`` compiles for sm_90a (so nothing it runs is compiled first on the
GPU). The GPU contracts of the layer with each backend are ``verify/test_dep_fast.py``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fast.schedules import dense
from model.config import LatentMoEConfig

ROOT = Path(__file__).resolve().parents[1]


def _measured() -> dict[tuple[str, int], tuple[float, float]]:
    """(gemm, T) -> (cuBLAS us, fast.gemm us at its committed default tactic): the mean over
    the runs of ``DENSE_BACKENDS_SOURCE`` of the per-GEMM medians ("each GEMM alone")."""
    from fast.gemm.host import choose_tactic

    runs = [json.loads((ROOT / path).read_text())["rows"] for path in dense.DENSE_BACKENDS_SOURCE]
    shapes = dense.gemm_shapes(LatentMoEConfig.kimi_k3())
    out = {}
    for rows in zip(*runs):
        tokens = rows[0]["tokens"]
        assert all(r["tokens"] == tokens for r in rows)
        for name in dense.GEMMS:
            label = choose_tactic(*shapes[name], tokens).label()
            med = [r["gemms"][name]["median_us"] for r in rows]
            out[(name, tokens)] = (sum(m["cublas"] for m in med) / len(med),
                                   sum(m[label] for m in med) / len(med))
    return out


def test_dense_backends_follow_the_committed_measurements():
    """At every batch the H200 runs measured, ``DENSE_BACKENDS`` picks the backend that took
    less time (a new measurement that flips one fails here until the table follows it);
    the table covers the real layer's four GEMMs at their shapes, T = 1..64."""
    shapes = dense.gemm_shapes(LatentMoEConfig.kimi_k3())
    assert set(dense.DENSE_BACKENDS) == {(name, *shapes[name]) for name in dense.GEMMS}
    for (name, n, k), table in dense.DENSE_BACKENDS.items():
        assert max(table) == dense.FAST_MAX_TOKENS, name
        assert set(table.values()) <= {"fast", "cublas"}, name
    measured = _measured()
    assert {t for _, t in measured} >= {1, 2, 4, 8, 16, 32, 64}
    for (name, tokens), (cublas_us, fast_us) in measured.items():
        want = "fast" if fast_us < cublas_us else "cublas"
        got = dense.choose_backend(name, *shapes[name], tokens)
        assert got == want, (f"{name} at T={tokens}: measured cuBLAS {cublas_us:.1f} us, "
                             f"fast.gemm {fast_us:.1f} us, table says {got}")


def test_batch_invariant_mode_runs_one_order_per_gemm():
    """``DenseFront(gemm="fast")`` (with ``batch_invariant=True``: all four) runs every GEMM of both DEP
    configs on fast.gemm at every T = 1..64 with one K split per GEMM; ``"auto"`` does not
    (it moves GEMMs between cuBLAS and fast.gemm at bucket edges: not batch invariant)."""
    for config in (LatentMoEConfig.kimi_k3(), LatentMoEConfig.small()):
        plan = dense.fast_tactics(config, "fast")
        assert set(plan) == set(dense.GEMMS)
        for name, per_t in plan.items():
            assert sorted(per_t) == list(range(1, 65)), name
            assert len({t.splits for t in per_t.values()}) == 1, name
    auto = dense.fast_tactics(LatentMoEConfig.kimi_k3(), "auto")
    assert any(len(per_t) < 64 for per_t in auto.values())


def test_choose_backend_modes():
    """Forced modes choose their backend everywhere; ``auto`` gives cuBLAS to shapes the
    table does not list and to batches above its buckets; a bad mode is refused."""
    for name, (n, k) in dense.gemm_shapes(LatentMoEConfig.small()).items():
        for tokens in (1, 8, 64):
            assert dense.choose_backend(name, n, k, tokens, "fast") == "fast"
            assert dense.choose_backend(name, n, k, tokens, "cublas") == "cublas"
            assert dense.choose_backend(name, n, k, tokens, "auto") == "cublas"
    assert dense.choose_backend("front", 15872, 7168, 1) == "fast"
    assert dense.choose_backend("front", 15872, 7168, 65) == "cublas"
    assert dense.choose_backend("up", 7168, 3584, 8) == "fast"
    assert dense.choose_backend("up", 7168, 3584, 9) == "cublas"
    with pytest.raises(ValueError, match="mode must be one of"):
        dense.choose_backend("up", 7168, 3584, 1, "cuBLAS")


@pytest.mark.parametrize("config_name", ["kimi_k3", "small"])  # the DEP contracts' configs
@pytest.mark.parametrize("mode,mma,overlap", [("auto", "mma.sync", False),
                                              ("fast", "mma.sync", False),
                                              ("fast", "wgmma", False), ("fast", "wgmma", True)])
def test_dense_front_kernels_are_compile_tested(config_name, mode, mma, overlap):
    """Every fast.gemm kernel shape a ``DenseFront`` of the config compiles at construction
    (``max_tokens`` 64, on ``invariant_mma``) is one that
    ``tests/test_gemm_fast.py::test_kernel_compiles`` compiles for sm_90a: every kernel
    shape of every candidate tactic at every window count it serves, and the warpgroup-MMA
    tiles. Each batch's tactic serves the batch, on the one MMA kind, with one K split per
    GEMM at every batch."""
    from fast.gemm.host import CANDIDATES, WGMMA_TILES, kernel_shapes

    cfg = getattr(LatentMoEConfig, config_name)()
    compiled = kernel_shapes({dataclasses.replace(t, splits=1) for c in CANDIDATES.values()
                              for t in c} | set(WGMMA_TILES)
                             | {dataclasses.replace(t, overlap=True) for t in WGMMA_TILES})
    plan = dense.fast_tactics(cfg, mode, 64, mma=mma, overlap=overlap)
    for per_t in plan.values():
        assert {t.wgmma for t in per_t.values()} == {mma == "wgmma"}
        assert {t.overlap for t in per_t.values()} == {overlap}
    if mode == "fast":
        assert all(len({t.splits for t in per_t.values()}) == 1 for per_t in plan.values())
    if mode == "fast":
        assert set(plan) == set(dense.GEMMS)
        assert all(sorted(per_t) == list(range(1, 65)) for per_t in plan.values())
    for name, per_t in plan.items():
        n, k = dense.gemm_shapes(cfg)[name]
        for tokens, tactic in per_t.items():
            assert tactic.serves(tokens), (name, tokens, tactic)
            assert n % tactic.tile_rows == 0 and k % (tactic.splits * tactic.stage_k) == 0
    for params in dense.fast_kernel_params(cfg, mode, 64, mma=mma, overlap=overlap):
        assert params in compiled, f"{config_name} {mode} {mma}: kernel {params} is not compile-tested"


def test_dense_front_refuses_bad_modes_before_touching_a_device():
    """``gemm`` and ``max_tokens`` are checked before any weight is copied or stream made."""
    with pytest.raises(ValueError, match="gemm must be one of"):
        dense.DenseFront(None, "cpu", gemm="cuBLAS")
    with pytest.raises(ValueError, match="serves at most 64 tokens, but max_tokens=65"):
        dense.DenseFront(None, "cpu", max_tokens=65, gemm="fast")
    with pytest.raises(ValueError, match="max_tokens must be None or a positive int"):
        dense.DenseFront(None, "cpu", max_tokens=0)
    with pytest.raises(ValueError, match="DenseFront: invariant_mma must be one of"):
        dense.DenseFront(None, "cpu", batch_invariant=True, invariant_mma="auto")
    with pytest.raises(ValueError, match="DenseFront: invariant_overlap=True keeps warpgroup MMAs"):
        dense.DenseFront(None, "cpu", batch_invariant=True, invariant_overlap=True)
    with pytest.raises(ValueError, match="DenseFront: invariant_overlap must be a bool"):
        dense.DenseFront(None, "cpu", batch_invariant=True, invariant_mma="wgmma",
                         invariant_overlap=1)


def test_batch_invariant_auto_is_the_stock_mode_and_names_the_way_out():
    """With ``batch_invariant=True`` (the DEP layers' default) ``gemm="auto"`` is taken as
    ``"invariant_stock"`` (the router on fast.gemm, the others on cuBLASLt without split-K)
    and a ``max_tokens`` above 64 is refused naming ``batch_invariant=False``, before any
    device work; ``"cublas"`` is refused in the mode."""
    with pytest.raises(ValueError, match=r"gemm='invariant_stock' runs fast.gemm, which serves "
                                         r"at most 64 tokens, but max_tokens=65 "
                                         r"\(batch_invariant=True; batch_invariant=False"):
        dense.DenseFront(None, "cpu", max_tokens=65, batch_invariant=True)
    with pytest.raises(ValueError, match="gemm='cublas' picks its kernel and split per batch"):
        dense.DenseFront(None, "cpu", gemm="cublas", batch_invariant=True)
    with pytest.raises(ValueError, match="router_with_front=True launches the router and the front"):
        dense.DenseFront(None, "cpu", batch_invariant=True, router_with_front=True)


def test_router_with_front_needs_every_gemm_on_fast_gemm():
    """``router_with_front`` is a bool, and needs the router and the front on fast.gemm at
    every batch (``gemm="fast"``): refused by name before any device work otherwise."""
    with pytest.raises(ValueError, match="router_with_front must be a bool"):
        dense.DenseFront(None, "cpu", gemm="fast", router_with_front=1)
    with pytest.raises(ValueError, match="router_with_front=True launches the router and the front"):
        dense.DenseFront(None, "cpu", gemm="auto", router_with_front=True)
    with pytest.raises(ValueError, match="router_with_front=True launches the router and the front"):
        dense.DenseFront(None, "cpu", gemm="cublas", router_with_front=True)
