"""Run the schedule emulations on real ranks: the same per-rank code as the virtual world.

Launch with ``torchrun`` (gloo on CPU, NCCL when CUDA is present)::

    torchrun --standalone --nproc-per-node 2 -m reference.schedules.launch \\
        --weights /path/to/checkpoint --schedules dep,wide --tokens 8 --seed 0 --out /tmp/run

Every rank loads the checkpoint (``LatentMoEWeights.save`` format), builds its inputs with
:func:`make_inputs` (deterministic, so the virtual run of a test rebuilds the same ones),
runs :func:`reference.schedules.dep.dep_rank` and/or
:func:`reference.schedules.wide.wide_rank` on a :class:`~reference.schedules.groups.TorchGroup`
and writes ``{out}/{schedule}_rank{r}.pt``: the trace's tensors (CPU) by field name.

The schedules run on the CPU even under NCCL here (the reference stages are CPU code); the
collectives then move their bytes through the GPU group.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import torch

__all__ = ["make_inputs", "trace_tensors", "main"]


def make_inputs(hidden: int, schedule: str, ranks: int, tokens: int, seed: int) -> list[torch.Tensor]:
    """The inputs of each rank, BF16 [tokens, hidden], rounded once from N(0, 1) FP32.

    ``dep``: each rank its own tokens (generator seed ``seed * 1000 + r``); ``wide``: the
    same rows on every rank (seed ``seed * 1000``)."""
    if schedule not in ("dep", "wide"):
        raise ValueError(f"make_inputs: unknown schedule {schedule!r}")

    def rows(s):
        g = torch.Generator().manual_seed(s)
        return torch.randn(tokens, hidden, generator=g).bfloat16()

    if schedule == "wide":
        x = rows(seed * 1000)
        return [x.clone() for _ in range(ranks)]
    return [rows(seed * 1000 + r) for r in range(ranks)]


def trace_tensors(trace) -> dict:
    """The tensor (and list-of-tensor) fields of a DepTrace / WideTrace, on the CPU."""
    out = {}
    for f in dataclasses.fields(trace):
        v = getattr(trace, f.name)
        if isinstance(v, torch.Tensor):
            out[f.name] = v.detach().cpu()
        elif isinstance(v, list) and all(isinstance(t, torch.Tensor) for t in v):
            out[f.name] = [t.detach().cpu() for t in v]
    return out


def main(argv=None) -> None:
    import torch.distributed as dist

    from model.weights import LatentMoEWeights
    from reference.schedules.dep import dep_rank
    from reference.schedules.groups import TorchGroup
    from reference.schedules.wide import wide_rank

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", required=True, help="checkpoint directory (LatentMoEWeights.save)")
    p.add_argument("--schedules", default="dep,wide")
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    try:
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        group = TorchGroup()
        weights = LatentMoEWeights.load(args.weights)
        c = weights.config
        os.makedirs(args.out, exist_ok=True)
        for schedule in args.schedules.split(","):
            xs = make_inputs(c.hidden, schedule, group.size, args.tokens, args.seed)
            x = xs[group.rank]
            if schedule == "dep":
                trace = dep_rank(group, x, weights, c)
            else:
                trace = wide_rank(group, x, weights, c)
            path = os.path.join(args.out, f"{schedule}_rank{group.rank}.pt")
            torch.save(trace_tensors(trace), path)
        group.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
