"""Two dense GEMMs of the same tokens in one launch (``fast.gemm.kernel.GroupedSplitKGemmKernel``).

The DEP rank's router (``gate [E, H]``, FP32 out) and packed front (``[2S + L, H]``, BF16
out) both read the rank's tokens ``x [T, H]``. Each launched alone pays a GEMM's fixed cost
(the launch, the first DRAM round trips, the last CTAs); the router's 12.8 MB at the real
dimensions costs about 3 us of bytes and 9-10 us alone. :class:`GroupedGemm` runs both in one
grid: the first GEMM's CTAs, then the second's, each CTA running the split-K algorithm of
``fast.gemm`` on its own GEMM with that GEMM's K split.

**Bits.** Only a GEMM's K split changes its bits (``fast.gemm``: tiles, windows and launch
shape do not). The grouped launch takes the first GEMM's default tactic at ``T`` and gives
the second the same kernel shape with the second's own :attr:`DenseGemm.splits`, so each
output is bitwise what that ``DenseGemm`` returns alone, at every ``T``: the group is as
batch invariant as its two GEMMs.

Pure-Python planning (:func:`grouped_launch`) is checked on the CPU; the launch itself needs
an SM90/SM100 GPU (``verify/test_gemm_fast.py``).
"""

from __future__ import annotations

import dataclasses
import typing

import torch

from fast import backend
from fast.device.compile import compiled, frozen
from fast.gemm.host import DenseGemm, Launch, launch_for
from fast.gemm.layout import MAX_TOKENS, Tactic

__all__ = ["GroupedLaunch", "grouped_launch", "GroupedGemm"]


class GroupedLaunch(typing.NamedTuple):
    """What one grouped call launches: each GEMM's :class:`fast.gemm.host.Launch` (the same
    kernel parameters, each its own K split), ``first_blocks`` (the first GEMM's CTAs, which
    come first in the grid) and ``grid`` (both GEMMs' CTAs)."""

    first: Launch
    second: Launch
    first_blocks: int
    grid: int


def grouped_launch(n1: int, n2: int, k: int, tokens: int, tactic: Tactic,
                   splits2: int) -> GroupedLaunch:
    """The grouped launch of ``tokens`` rows over weights ``[n1, k]`` (at ``tactic``) and
    ``[n2, k]`` (the same tactic with ``splits2`` K splits). Pure Python.

    Raises ValueError: more than ``MAX_TOKENS`` rows (token chunks are not grouped), a
    serial tactic, a weight whose rows are not a multiple of the tactic's tile (the grouped
    kernel does not pad), or what ``launch_for`` refuses for either GEMM."""
    if not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"grouped_launch: tokens must be in [1, {MAX_TOKENS}], got {tokens}")
    if tactic.serial:
        raise ValueError(f"grouped_launch: tactic {tactic.label()} runs serial splits; the "
                         "grouped kernel runs cross-CTA splits only")
    for name, n in (("n1", n1), ("n2", n2)):
        if n % tactic.tile_rows:
            raise ValueError(f"grouped_launch: {name}={n} is not a multiple of the tactic's "
                             f"{tactic.tile_rows}-row tile ({tactic.label()})")
    first = launch_for(n1, k, tokens, tactic=tactic)
    second = launch_for(n2, k, tokens, tactic=dataclasses.replace(tactic, splits=splits2))
    if first.chunks != 1 or first.params.get("chunked") or first.params != second.params:
        raise ValueError(f"grouped_launch: the two GEMMs do not share one unchunked kernel "
                         f"({first.params} / {second.params})")
    return GroupedLaunch(first, second, first.grid, first.grid + second.grid)


class GroupedGemm:
    """``(x @ W_1^T (+ addend), x @ W_2^T)`` in one launch, for ``T <= 64`` rows: the two
    :class:`fast.gemm.DenseGemm` objects' weights, workspaces and tile counters, each
    output bitwise the same as that object's own call (module docstring).

    Args:
        first: the GEMM whose default tactic at ``T`` sets the kernel (the larger one: the
            front), and the only one that may take an addend.
        second: the other (the router); its :attr:`DenseGemm.splits` is its K split.

    The batches it serves (:meth:`serves`) are those whose launch :func:`grouped_launch`
    accepts (the second GEMM's rows whole tiles of the first's tactic); their launches are
    planned and the workspaces sized once, here.

    Raises (at construction): TypeError for arguments that are not ``DenseGemm``;
    ValueError naming the argument for two devices, two K, a padded weight (rows not a
    multiple of 64) or a ``max_tokens`` above 64; RuntimeError where the fast kernels cannot
    run. The objects' calls and the group's must be ordered (one stream): they share
    workspaces and counters.

    Run: ``python -m pytest verify/test_gemm_fast.py -k grouped`` (on an SM90/SM100 GPU).
    """

    def __init__(self, first: DenseGemm, second: DenseGemm):
        for name, g in (("first", first), ("second", second)):
            if not isinstance(g, DenseGemm):
                raise TypeError(f"GroupedGemm: {name} must be a fast.gemm.DenseGemm, got "
                                f"{type(g).__name__}")
            if g.rows != g.n:
                raise ValueError(f"GroupedGemm: {name}'s weight has {g.n} rows, not a multiple "
                                 f"of 64 (a padded weight is not grouped)")
            if g.max_tokens > MAX_TOKENS:
                raise ValueError(f"GroupedGemm: {name}.max_tokens is {g.max_tokens}; a grouped "
                                 f"call serves at most {MAX_TOKENS} rows")
        if second.device != first.device:
            raise ValueError(f"GroupedGemm: second is on {second.device}, first on {first.device}")
        if second.k != first.k:
            raise ValueError(f"GroupedGemm: second has K={second.k}, first K={first.k}: the two "
                             "GEMMs read the same tokens")
        backend.require_supported("GroupedGemm")
        self.first, self.second = first, second
        #: the most rows of a call (the smaller of the two objects')
        self.max_tokens = min(first.max_tokens, second.max_tokens)
        #: the addend address of a call without one (never read: no addend flag)
        self.no_addend = torch.zeros(4, dtype=torch.float32, device=first.device)
        #: each served batch's launch (:func:`grouped_launch` at the first GEMM's default tactic)
        self.launches: dict[int, GroupedLaunch] = {}
        for t in range(1, self.max_tokens + 1):
            try:
                launch = grouped_launch(first.rows, second.rows, first.k, t, first.tactic(t),
                                        second.splits)
            except ValueError:
                continue  # not served: the caller launches the two apart at this batch
            first.reserve_workspace(launch.first.tactic)
            second.reserve_workspace(launch.second.tactic)
            self.launches[t] = launch

    def serves(self, tokens: int) -> bool:
        """Whether a call of ``tokens`` rows can run grouped."""
        return tokens in self.launches

    def launch(self, tokens: int) -> GroupedLaunch:
        """What a call of ``tokens`` rows launches; ValueError for a batch it does not
        serve."""
        if tokens not in self.launches:
            raise ValueError(f"GroupedGemm: {tokens} rows are not served (the second GEMM's "
                             f"{self.second.rows} rows are not whole tiles of the first's "
                             f"tactic there, or T is outside 1..{self.max_tokens})")
        return self.launches[tokens]

    def compile_for(self, tokens) -> list[dict]:
        """Compile the grouped kernel of each served row count in ``tokens``; returns the
        distinct kernel parameters (a layer calls it at construction: no call compiles)."""
        from fast.gemm.kernel import GroupedSplitKGemmKernel

        seen = []
        for t in filter(self.serves, tokens):
            params = self.launches[t].first.params
            if params not in seen:
                seen.append(params)
                compiled(GroupedSplitKGemmKernel, self.first.arch, frozen(params))
        return seen

    def __call__(self, x: torch.Tensor, *, out_dtypes=(torch.bfloat16, torch.bfloat16),
                 outs=(None, None), addend: torch.Tensor | None = None):
        """Both products of ``x`` (BF16 ``[T, K]``, ``1 <= T <= max_tokens``), each rounded
        once to its ``out_dtypes`` entry (``torch.bfloat16`` or ``torch.float32``); the
        first plus ``addend`` (BF16 or FP32 ``[T, N_1]``) before its rounding. ``outs``:
        optional outputs. Returns ``(out_1, out_2)``."""
        if len(out_dtypes) != 2 or len(outs) != 2:
            raise ValueError("GroupedGemm: out_dtypes and outs must have two entries each")
        t = self.first.check_call(x, outs[0], out_dtypes[0], addend)
        self.second.check_call(x, outs[1], out_dtypes[1], None)
        launch = self.launch(t)  # the workspaces were sized for it at construction
        out1, out2 = (o if o is not None else torch.empty(t, g.n, dtype=d, device=g.device)
                      for o, g, d in zip(outs, (self.first, self.second), out_dtypes))
        from cutlass import Int32, Int64

        from fast.gemm.kernel import GroupedSplitKGemmKernel

        fn = compiled(GroupedSplitKGemmKernel, self.first.arch, frozen(launch.first.params))
        a, b = self.first, self.second
        flags = (a.launch_flags(out_dtypes[0], addend), b.launch_flags(out_dtypes[1], None))
        pdl = a.uses_pdl(t)
        fn(Int64(a.padded_weight.data_ptr()), Int64(x.data_ptr()), Int64(out1.data_ptr()),
           Int64((addend if addend is not None else self.no_addend).data_ptr()),
           Int64(a.workspace.data_ptr()), Int64(a.counters.data_ptr()),
           Int32(a.rows), Int32(a.k), Int32(t), Int32(launch.first.tactic.splits), Int32(flags[0]),
           Int64(b.padded_weight.data_ptr()), Int64(out2.data_ptr()),
           Int64(b.workspace.data_ptr()), Int64(b.counters.data_ptr()),
           Int32(b.rows), Int32(launch.second.tactic.splits), Int32(flags[1]),
           Int32(launch.first_blocks), Int32(launch.grid), Int32(int(pdl)),
           backend.stream(a.device))
        return out1, out2
