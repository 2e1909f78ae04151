"""The MMA kind of a batch-invariant GEMM set (``fast.gemm.DenseGemm(wgmma=...)``): which
kinds exist, which a layer may name, and what ``"auto"`` is on each GPU architecture.

A kind fixes a token's bits as the K split does (another instruction, another summation
inside each MMA step), so a batch-invariant layer runs all its fast.gemm GEMMs on one kind
at every row count; the two kinds give other bits than each other.
"""

from __future__ import annotations

__all__ = ["INVARIANT_MMAS", "MMA_CHOICES", "check_mma", "check_overlap", "resolve_mma",
           "resolve_dense_mode"]

#: The MMA kinds the batch-invariant mode runs its GEMMs on (module docstring).
INVARIANT_MMAS = ("mma.sync", "wgmma")
#: What a layer's ``invariant_mma`` accepts: ``"auto"`` (:func:`resolve_mma`) or a kind.
MMA_CHOICES = ("auto",) + INVARIANT_MMAS


def check_mma(owner: str, mma, allow_auto: bool = False) -> None:
    """Refuse, by name, an ``mma`` that is not one of ``INVARIANT_MMAS`` (or ``"auto"``
    where ``allow_auto``: a layer's argument, before :func:`resolve_mma`)."""
    choices = MMA_CHOICES if allow_auto else INVARIANT_MMAS
    if mma not in choices:
        raise ValueError(f"{owner}: invariant_mma must be one of {choices}, got {mma!r}")


def resolve_mma(owner: str, mma, arch: str) -> str:
    """The MMA kind a layer built with ``invariant_mma=mma`` runs on a GPU of ``arch``
    (``fast.backend.device_arch``): ``"auto"`` is ``"wgmma"`` on ``sm_90a`` (measured
    faster than ``mma.sync`` at every row count of the wide layer, 65..1024, on an H100:
    ``docs/schedules/wide.md``) and ``"mma.sync"`` elsewhere (wgmma is an sm_90a
    instruction); a kind is itself, ``"wgmma"`` refused off ``sm_90a``. So a layer's bits
    in this mode are a function of the GPU architecture and the argument, never of the
    batch."""
    check_mma(owner, mma, allow_auto=True)
    if mma == "auto":
        return "wgmma" if arch == "sm_90a" else "mma.sync"
    if mma == "wgmma" and arch != "sm_90a":
        raise ValueError(f"{owner}: invariant_mma='wgmma' needs an sm_90a GPU (warpgroup MMA), "
                         f"this one is {arch}")
    return mma


def check_overlap(owner: str, overlap, mma: str, name: str = "invariant_overlap") -> None:
    """Argument ``name`` of ``owner`` (a layer's ``invariant_overlap``, ``DenseGemm``'s
    ``overlap``), a bool, refused by name with ``mma="mma.sync"`` (it keeps warpgroup MMAs
    in flight across a stage: ``fast.gemm.Tactic.overlap``, the same bits); a layer calls
    it again with the kind ``"auto"`` resolved to."""
    if not isinstance(overlap, bool):
        raise ValueError(f"{owner}: {name} must be a bool, got {overlap!r}")
    if overlap and mma == "mma.sync":
        raise ValueError(f"{owner}: {name}=True keeps warpgroup MMAs in flight: it needs the "
                         f"warpgroup MMA ('wgmma', or 'auto' on sm_90a), not 'mma.sync'")


def resolve_dense_mode(owner: str, batch_invariant: bool, mma, overlap, arch) -> tuple[str, bool]:
    """The MMA kind and the MMAs-in-flight setting a DEP layer's dense GEMMs run with
    (``fast.schedules.dense.DenseFront``'s ``invariant_mma`` and ``invariant_overlap``),
    from the layer's ``invariant_mma=mma`` and ``invariant_overlap=overlap`` on a GPU of
    ``arch``.

    * ``mma``: a kind is itself (``"wgmma"`` refused off sm_90a); ``"auto"`` is
      :func:`resolve_mma`'s choice with ``batch_invariant`` (``"wgmma"`` on sm_90a, where
      the DEP16 rank measured the mode at most 2.6% above the default dense backends
      against up to 8.4% on ``"mma.sync"``: ``docs/schedules/dep.md``), and
      ``"mma.sync"`` without it (the kind the default dense backends' tactic table was
      measured on).
    * ``overlap``: a bool is itself (:func:`check_overlap`: refused with ``"mma.sync"``);
      None is True exactly on ``"wgmma"`` (the same bits; the dense stage up to 2.5 us
      shorter at T = 32 and 64).
    """
    check_mma(owner, mma, allow_auto=True)
    if overlap is not None and not isinstance(overlap, bool):
        raise ValueError(f"{owner}: invariant_overlap must be None or a bool, got {overlap!r}")
    kind = resolve_mma(owner, mma, arch) if batch_invariant or mma != "auto" else "mma.sync"
    flying = kind == "wgmma" if overlap is None else overlap
    check_overlap(owner, flying, kind)
    return kind, flying
