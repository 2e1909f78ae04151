"""Both schedules as a Blackwell node builds them compile for sm_100a and sm_103a (no GPU
needed): the schedule's own kernels (virtual and real ranks) and the kernels of the
experts engine ``fast.experts.select`` picks for one of its ranks on that target,
``BlackwellExpertsEngine`` (the routing lists, the plan and the block-scaled FC1 and FC2)
at every window count the layer's batches use; where the Blackwell kernel does not tile a
rank's slice (kimi_k3 over 16 TP ranks: I/16 = 192), the Hopper engine's ``mma.sync``
kernels for the same target. A GB300 node runs these kernels in ``verify/test_dep_fast.py``,
``verify/test_wide_fast.py`` and their real-rank files (``python -m verify.plan --arch
sm_103a`` lists them)."""

from __future__ import annotations

import pytest

from fast import backend
from fast.experts.blackwell_layout import ARCHS, blackwell_dsl_error
from fast.experts.select import compile_engine_for, engine_name_for, geometry_for
from model.config import LatentMoEConfig

_cute_error = backend.cute_import_error()
_dsl_error = (f"CuTe DSL not importable: {_cute_error}" if _cute_error is not None
              else blackwell_dsl_error())
needs_dsl = pytest.mark.skipif(_dsl_error is not None, reason=str(_dsl_error))

CONFIGS = {"kimi_k3": LatentMoEConfig.kimi_k3(), "small": LatentMoEConfig.small()}


def _bare_engine(config, geometry, *, strict=False, empty_rows=False):
    """A ``BlackwellExpertsEngine`` without buffers or a device, for its host-side
    methods that read only the config, geometry and flags (``list_params``)."""
    from fast.experts.blackwell import BlackwellExpertsEngine

    engine = object.__new__(BlackwellExpertsEngine)
    engine.config, engine.geometry = config, geometry
    engine.strict, engine.empty_rows = strict, empty_rows
    return engine


@needs_dsl
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("config,ranks,owner", [("kimi_k3", 16, 3), ("small", 4, 1)])
def test_dep_schedule_compiles_with_the_blackwell_engine(arch, config, ranks, owner):
    """A DEP owner (``DepLayer`` and ``DepPeerLayer``: experts ``[o E/N, (o+1) E/N)``,
    empty rows allowed) at one, two and four windows, and the schedule's kernels."""
    from fast.schedules.dep import compile_all

    cfg = CONFIGS[config]
    per = cfg.experts // ranks
    assert engine_name_for(arch, cfg) == "BlackwellExpertsEngine"
    assert len(compile_all(cfg, ranks, arch)) == 3
    assert len(compile_all(cfg, ranks, arch, peers=True)) == 4
    for windows in (1, 2, 4):
        fns = compile_engine_for(arch, cfg, experts=(owner * per, per), windows=windows,
                                 empty_rows=True)
        assert len(fns) == 4 and all(fn is not None for fn in fns)


@needs_dsl
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("config,ranks,rank", [("kimi_k3", 8, 5), ("kimi_k3", 2, 1),
                                               ("small", 2, 1)])
def test_wide_schedule_compiles_with_the_blackwell_engine(arch, config, ranks, rank):
    """A wide TP rank (``WideLayer`` and ``WidePeerLayer``: every expert's slice
    ``shard=(r, N)``), whose routing lists the polled-routing kernel fills (the engine's
    ``list_params`` are the ones that kernel is compiled with), at one, two and four
    windows, and the schedule's kernels."""
    from fast.schedules.wide import compile_all, slice_list_params

    cfg = CONFIGS[config]
    shard = (rank, ranks)
    assert engine_name_for(arch, cfg, shard) == "BlackwellExpertsEngine"
    assert _bare_engine(cfg, geometry_for(cfg, shard=shard)).list_params() \
        == slice_list_params(cfg)
    assert len(compile_all(cfg, ranks, arch)) == 4
    assert len(compile_all(cfg, ranks, arch, peers=True)) == 6
    for windows in (1, 2, 4):
        fns = compile_engine_for(arch, cfg, shard=shard, windows=windows)
        assert len(fns) == 4 and all(fn is not None for fn in fns)


@needs_dsl
@pytest.mark.parametrize("arch", ARCHS)
def test_wide_tp16_keeps_the_hopper_engine_on_blackwell(arch):
    """kimi_k3 over 16 TP ranks: a slice of 192 columns, which the block-scaled FC2's
    128-wide k stage does not tile; the rank runs ``ExpertsEngine``'s kernels compiled
    for the Blackwell target."""
    cfg = CONFIGS["kimi_k3"]
    assert engine_name_for(arch, cfg, (3, 16)) == "ExpertsEngine"
    fns = compile_engine_for(arch, cfg, shard=(3, 16), windows=4)
    assert len(fns) == 4 and all(fn is not None for fn in fns)


def test_selection_names_the_argument():
    """An arch without an experts engine, or the wrong prepared layout for the target,
    is refused by name."""
    from fast.experts import experts_engine_for, prepare_experts
    from fast.experts.select import engine_arch
    from verify import cases

    with pytest.raises(ValueError, match=r"arch_or_device='sm_80' is sm_80; an experts engine "
                                         r"serves sm_90a \(ExpertsEngine\) and sm_100a/sm_103a"):
        engine_arch("sm_80")
    with pytest.raises(TypeError, match="arch_or_device must be an arch string"):
        engine_arch(9.0)
    prepared = prepare_experts(cases.expert_code_weights("small", "cpu"), "cpu", experts=(0, 2))
    with pytest.raises(TypeError, match="on sm_100a this rank runs BlackwellExpertsEngine"):
        experts_engine_for("sm_100a", prepared, max_rows=8)
    assert engine_name_for("sm_90a", CONFIGS["kimi_k3"]) == "ExpertsEngine"
    assert engine_name_for("sm_103a", CONFIGS["small"], (0, 4)) == "ExpertsEngine"
