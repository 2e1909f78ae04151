"""How the layers run a rank program (``fast.schedules.dep_program.DEP_STEPS``,
``fast.schedules.wide_program.WIDE_STEPS``): an ordered tuple of steps, each a function
``step(rank, call)`` of one rank's resources and its call state, ending where the rank
needs its peers' writes (the rank's ``wait`` hook: nothing for a virtual rank, the
arrival wait for a real one).

A leaf of ``fast.schedules``: it imports no layer and no program.
"""

from __future__ import annotations

__all__ = ["run_steps"]


def run_steps(steps, ranks, calls) -> None:
    """Run ``steps`` for ``ranks`` with their ``calls`` (one state each): every step for
    every rank, in rank order, before the next step. The virtual layers pass every rank
    (one stream: a step's reads of its peers' writes follow them in launch order); a real
    rank passes itself (its steps' waits join it to its peers)."""
    for step in steps:
        for rank, call in zip(ranks, calls, strict=True):
            step(rank, call)
