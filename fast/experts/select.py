"""Which experts engine serves a GPU architecture: the one choice the schedules make.

* ``sm_90a``: ``fast.experts.ExpertsEngine`` (MXFP4 weights decoded to BF16 in registers,
  ``mma.sync`` or ``wgmma``) with its default tactics, over ``prepare_experts`` weights;
* ``sm_100a`` / ``sm_103a``: ``fast.experts.BlackwellExpertsEngine`` (``tcgen05``
  block-scaled MXFP4 x MXFP8), over ``prepare_blackwell_experts`` weights, wherever its
  kernel tiles the rank's widths (``blackwell_tiling_error``: ``L % 256``, ``I_s % 128``);
  a rank whose slice it does not tile (a TP16 slice of kimi_k3, ``I_s`` = 192; the small
  test config's TP4 slice, 64) runs the Hopper engine's ``mma.sync`` kernels compiled for
  the same Blackwell target, which every contract of ``ExpertsEngine`` covers.

A schedule prepares its rank's experts with :func:`prepare_experts_for` and builds the
engine with :func:`experts_engine_for`; :func:`engine_name_for` gives the choice without
weights, a device or the CuTe DSL (``verify.plan`` reports it), and
:func:`compile_engine_for` compiles the chosen engine's kernels of one call for a target
(no GPU needed: the CPU compile contracts).
"""

from __future__ import annotations

import torch

from fast.experts.blackwell_layout import ARCHS as BLACKWELL_ARCHS
from fast.experts.blackwell_layout import K_STAGE, BlackwellExperts, prepare_blackwell_experts
from fast.experts.layout import Geometry, PreparedExperts, check_selection, prepare_experts
from model.config import LatentMoEConfig

__all__ = ["HOPPER_ARCHS", "BLACKWELL_ARCHS", "ENGINE_ARCHS", "engine_arch",
           "blackwell_tiling_error", "engine_name_for", "geometry_for", "prepare_experts_for",
           "experts_engine_for", "compile_engine_for"]

#: The targets of the Hopper engine as the engine of record.
HOPPER_ARCHS = ("sm_90a",)
#: Every target an experts engine is selected for.
ENGINE_ARCHS = HOPPER_ARCHS + BLACKWELL_ARCHS


def engine_arch(arch_or_device, who: str = "experts_engine_for") -> str:
    """The target of ``arch_or_device``: an arch string (``"sm_90a"``, ``"sm_100a"``,
    ``"sm_103a"``) as it is, or a CUDA device (``torch.device``, ``"cuda:0"``, an index)
    mapped by ``fast.backend.gpu_arch``. Raises ValueError naming the argument for any
    other target."""
    if isinstance(arch_or_device, str) and arch_or_device.startswith("sm_"):
        arch = arch_or_device
    elif isinstance(arch_or_device, (str, int, torch.device)) and not isinstance(arch_or_device,
                                                                               bool):
        from fast import backend

        arch = backend.gpu_arch(arch_or_device)
        if arch is None:
            raise ValueError(f"{who}: arch_or_device={arch_or_device!r} is not a CUDA device "
                             "this machine has (no CUDA device)")
    else:
        raise TypeError(f"{who}: arch_or_device must be an arch string ('sm_90a', 'sm_100a', "
                        f"'sm_103a') or a CUDA device, got {type(arch_or_device).__name__}")
    if arch not in ENGINE_ARCHS:
        raise ValueError(f"{who}: arch_or_device={arch_or_device!r} is {arch}; an experts engine "
                         f"serves {'/'.join(HOPPER_ARCHS)} (ExpertsEngine) and "
                         f"{'/'.join(BLACKWELL_ARCHS)} (BlackwellExpertsEngine)")
    return arch


def blackwell_tiling_error(config: LatentMoEConfig, shard: tuple[int, int] = (0, 1)) -> str | None:
    """None when the Blackwell engine tiles a rank of ``config`` with the intermediate
    split ``shard = (rank, ranks)``, else why not: its FC2 k stage is 128 (``I_s % 128``;
    ``L % 128``) and the routing-lists kernel it shares with the Hopper engine takes
    ``L % 256``."""
    inter = config.intermediate // shard[1]
    bad = []
    if config.latent % 256:
        bad.append(f"L={config.latent} % 256 (the routing-lists kernel)")
    if inter % K_STAGE:
        bad.append(f"I/ranks={inter} % {K_STAGE} (the block-scaled FC2's k stage)")
    if not bad:
        return None
    return "the Blackwell engine does not tile " + " and ".join(bad)


def engine_name_for(arch_or_device, config: LatentMoEConfig,
                    shard: tuple[int, int] = (0, 1)) -> str:
    """``"ExpertsEngine"`` or ``"BlackwellExpertsEngine"``: the engine a rank of ``config``
    with intermediate split ``shard`` runs on ``arch_or_device`` (module docstring)."""
    arch = engine_arch(arch_or_device, "engine_name_for")
    if arch in BLACKWELL_ARCHS and blackwell_tiling_error(config, shard) is None:
        return "BlackwellExpertsEngine"
    return "ExpertsEngine"


def geometry_for(config: LatentMoEConfig, experts: tuple[int, int] | None = None,
                 shard: tuple[int, int] = (0, 1)) -> Geometry:
    """The engine geometry of one rank without its weights: ``experts=(first, count)``
    (default all), ``shard=(rank, ranks)`` of the intermediate."""
    first, count = experts if experts is not None else (0, config.experts)
    return Geometry(latent=config.latent, inter=config.intermediate // shard[1], first=first,
                    count=count, shard=tuple(shard))


def prepare_experts_for(arch_or_device, weights, device=None, *,
                        experts: tuple[int, int] | None = None,
                        shard: tuple[int, int] = (0, 1)) -> PreparedExperts | BlackwellExperts:
    """One rank's experts in the layout of the engine :func:`engine_name_for` picks:
    ``prepare_blackwell_experts`` or ``prepare_experts`` (same arguments)."""
    arch = engine_arch(arch_or_device, "prepare_experts_for")
    check_selection("prepare_experts_for", weights, experts, shard)
    if engine_name_for(arch, weights.config, shard) == "BlackwellExpertsEngine":
        return prepare_blackwell_experts(weights, device, experts=experts, shard=shard)
    return prepare_experts(weights, device, experts=experts, shard=shard)


def experts_engine_for(arch_or_device, prepared, *, max_rows: int, strict: bool = False,
                       empty_rows: bool = False, scratch=None, tactic: dict | None = None):
    """The experts engine of one rank on ``arch_or_device`` over ``prepared``
    (:func:`prepare_experts_for` of the same target): ``BlackwellExpertsEngine`` for
    ``BlackwellExperts``, ``ExpertsEngine`` for ``PreparedExperts``, with the same keyword
    arguments (``tactic``: the Hopper engine's FC kernel settings; the Blackwell engine
    takes only ``ctas`` and refuses the others by name). Raises ValueError naming
    ``arch_or_device`` for a target without an engine, and TypeError when ``prepared`` is
    not the layout that target's engine reads."""
    arch = engine_arch(arch_or_device, "experts_engine_for")
    kwargs = dict(max_rows=max_rows, strict=strict, empty_rows=empty_rows, scratch=scratch,
                  tactic=tactic)
    want = engine_name_for(arch, prepared.config, prepared.geometry.shard)
    if want == "BlackwellExpertsEngine":
        if not isinstance(prepared, BlackwellExperts):
            raise TypeError(f"experts_engine_for: on {arch} this rank runs BlackwellExpertsEngine, "
                            f"which reads prepare_blackwell_experts(...) weights; prepared is "
                            f"{type(prepared).__name__} (use prepare_experts_for)")
        from fast.experts.blackwell import BlackwellExpertsEngine

        return BlackwellExpertsEngine(prepared, **kwargs)
    if not isinstance(prepared, PreparedExperts):
        raise TypeError(f"experts_engine_for: on {arch} this rank runs ExpertsEngine, which reads "
                        f"prepare_experts(...) weights; prepared is {type(prepared).__name__} "
                        "(use prepare_experts_for)")
    from fast.experts.engine import ExpertsEngine

    return ExpertsEngine(prepared, **kwargs)


def compile_engine_for(arch: str, config: LatentMoEConfig, *,
                       experts: tuple[int, int] | None = None, shard: tuple[int, int] = (0, 1),
                       windows: int, capture: bool = False, strict: bool = False,
                       empty_rows: bool = False) -> list:
    """Compile, for ``arch`` (no GPU needed), the kernels one call of the engine
    :func:`engine_name_for` picks launches for a rank of ``config`` (``experts``,
    ``shard`` as :func:`geometry_for`) at ``windows`` windows per work item:
    ``fast.experts.blackwell.compile_blackwell`` or ``fast.experts.engine.compile_all``
    (the Hopper engine's default FC shape)."""
    arch = engine_arch(arch, "compile_engine_for")
    g = geometry_for(config, experts, shard)
    options = dict(windows=windows, arch=arch, capture=capture, strict=strict,
                   empty_rows=empty_rows)
    if engine_name_for(arch, config, shard) == "BlackwellExpertsEngine":
        from fast.experts.blackwell import compile_blackwell

        return compile_blackwell(g, config, **options)
    from fast.experts.engine import compile_all

    return compile_all(g, config, **options)
