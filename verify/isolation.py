"""A bad token changes no other token: the rows it is given and how a contract checks it.

A decode batch may hold a token whose hidden row is not finite, or so large that its GEMMs
overflow (a diverged sequence, a bug upstream). Its own outputs are whatever the model's
arithmetic makes of it (NaN or infinite, its experts whatever the top-k of NaN scores is);
**every other token's outputs, at every stage, must be bitwise what they are when that row
is an ordinary one**, and the call must complete without an error. Nothing is shared between
tokens in the model (each GEMM column, MX block, norm and routing decision is one token's),
so only an implementation can break it: a NaN that reaches a shared maximum, scale or
counter, a routing id out of range that indexes another token's slot, a duplicated expert
that overflows a list sized for distinct ones, a reduction that mixes rows.

:data:`BAD_KINDS` names the rows (:func:`bad_row`); :func:`check_others_unchanged` compares
two runs' stages with the bad token's rows left out. The contracts that use them:
``verify/test_invariance.py`` (the reference schedules S0, S1, S2), ``verify/test_dep_fast.py``
and ``verify/test_wide_fast.py`` (the fast layers).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from verify.compare import raw_bits

__all__ = ["BAD_KINDS", "bad_row", "kept_rows", "check_others_unchanged"]

#: The bad rows (:func:`bad_row`): every element NaN; one NaN in an ordinary row; one +Inf
#: and one -Inf in an ordinary row (their products cancel to NaN); every element the
#: largest finite BF16 with random signs (each dot product overflows to +-Inf).
BAD_KINDS = ("nan", "one_nan", "inf", "huge")
#: The largest finite BF16 (``torch.finfo(torch.bfloat16).max``).
BF16_MAX = torch.finfo(torch.bfloat16).max


def bad_row(kind: str, ordinary: torch.Tensor, seed: int) -> torch.Tensor:
    """The bad version of one hidden row: ``ordinary`` BF16 ``[H]`` (the row it replaces,
    kept where the kind leaves elements ordinary) -> BF16 ``[H]`` on its device.

    Raises:
        ValueError: ``kind`` not in :data:`BAD_KINDS`, or ``ordinary`` not a BF16 vector.
    """
    if kind not in BAD_KINDS:
        raise ValueError(f"bad_row: kind must be one of {BAD_KINDS}, got {kind!r}")
    if not isinstance(ordinary, torch.Tensor) or ordinary.dtype != torch.bfloat16 or ordinary.dim() != 1:
        raise ValueError("bad_row: ordinary must be a BF16 vector [H]")
    g = torch.Generator().manual_seed(seed)
    h = ordinary.numel()
    row = ordinary.clone()
    at = torch.randperm(h, generator=g)[:2].to(row.device)
    if kind == "nan":
        row.fill_(float("nan"))
    elif kind == "one_nan":
        row[at[0]] = float("nan")
    elif kind == "inf":
        row[at[0]] = float("inf")
        row[at[1]] = float("-inf")
    else:
        signs = torch.randint(0, 2, (h,), generator=g).to(torch.float32) * 2 - 1
        row.copy_((signs * BF16_MAX).to(torch.bfloat16))
    return row


def kept_rows(rows: int, bad: int | tuple[int, ...] | list[int], device=None) -> torch.Tensor:
    """A bool ``[rows]`` mask, False at the bad rows ``bad``."""
    keep = torch.ones(rows, dtype=torch.bool, device=device)
    keep[list(bad) if isinstance(bad, (tuple, list)) else [bad]] = False
    return keep


def check_others_unchanged(contract, clean: Mapping[str, torch.Tensor],
                           bad: Mapping[str, torch.Tensor], keep: torch.Tensor, what: str) -> int:
    """Every stage of ``clean`` (a run with an ordinary row) bitwise equal to the same stage
    of ``bad`` (the run with the bad row) on the rows ``keep`` selects; a stage whose first
    dimension is a multiple ``m`` of ``keep``'s length (a token's ``m`` pairs, rows
    ``m t .. m t + m - 1``) is compared pair by pair. Returns the rows compared.

    Raises:
        AssertionError (from ``contract.bitwise``): a kept row differs, naming the stage;
        ValueError: a stage missing from ``bad`` or whose rows are not a multiple of
        ``keep``'s.
    """
    n, compared = keep.numel(), 0
    for name, want in clean.items():
        if name not in bad:
            raise ValueError(f"check_others_unchanged: stage {name!r} missing from the bad run")
        got = bad[name]
        if got.shape != want.shape or want.shape[0] % n:
            raise ValueError(f"check_others_unchanged: stage {name!r} has {tuple(want.shape)} "
                             f"(bad run {tuple(got.shape)}), not a multiple of {n} rows")
        mask = keep.to(want.device).repeat_interleave(want.shape[0] // n)
        # rows selected from integer views of the same width (float8 has no indexing
        # kernels everywhere); the comparison is of bytes either way
        contract.bitwise(raw_bits(got)[mask.to(got.device)], raw_bits(want)[mask],
                         what=f"{what}: {name} of the other tokens")
        compared += int(mask.sum())
    return compared
