"""The schedules on real ranks: ``torchrun`` + gloo on the CPU runs the same per-rank code
as the virtual world, and every rank's trace is bitwise equal to the virtual run's.

One ``torchrun`` launch per rank count runs both schedules (S1 DEP and S2 wide) from one
checkpoint written by the test."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from model.config import LatentMoEConfig
from model.weights import LatentMoEWeights
from reference.schedules.dep import dep_layer_virtual
from reference.schedules.launch import make_inputs, trace_tensors
from reference.schedules.wide import wide_layer_virtual
from verify.compare import assert_bitwise_equal

# K = 16 and the block of 32 as in the real layer; I = 512 keeps whole MX blocks in every
# TP slice up to 16 ranks; narrow latent and hidden widths keep the CPU experts cheap.
CONFIG = LatentMoEConfig(
    hidden=256, latent=64, experts=32, top_k=16, intermediate=512, shared_intermediate=256
)
TOKENS, SEED = 6, 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    weights = LatentMoEWeights.random(CONFIG, seed=11)
    path = tmp_path_factory.mktemp("ckpt")
    weights.save(path)
    return weights, path


def _launch(ranks: int, ckpt, out) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={ranks}", "-m", "reference.schedules.launch",
        "--weights", str(ckpt), "--schedules", "dep,wide", "--tokens", str(TOKENS),
        "--seed", str(SEED), "--out", str(out),
    ]  # fmt: skip
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"torchrun with {ranks} ranks did not finish in 240 s") from exc
    if done.returncode:
        raise AssertionError(
            f"torchrun with {ranks} ranks failed ({done.returncode}):\n{done.stderr[-4000:]}"
        )


def _compare(real: dict, virtual: dict, what: str) -> int:
    assert real.keys() == virtual.keys(), (what, sorted(real), sorted(virtual))
    count = 0
    for name, v in virtual.items():
        r = real[name]
        if isinstance(v, list):
            assert len(r) == len(v), f"{what}.{name}: {len(r)} vs {len(v)} entries"
            for i, (a, b) in enumerate(zip(r, v)):
                assert_bitwise_equal(a, b, what=f"{what}.{name}[{i}]")
                count += 1
        else:
            assert_bitwise_equal(r, v, what=f"{what}.{name}")
            count += 1
    return count


@pytest.mark.parametrize("ranks", [2, 4])
def test_torchrun_gloo_equals_virtual_ranks_bitwise(ranks, checkpoint, tmp_path):
    weights, ckpt = checkpoint
    _launch(ranks, ckpt, tmp_path)

    dep = dep_layer_virtual(make_inputs(CONFIG.hidden, "dep", ranks, TOKENS, SEED), weights)
    x = make_inputs(CONFIG.hidden, "wide", ranks, TOKENS, SEED)[0]
    wide = wide_layer_virtual(x, weights, ranks)
    compared = 0
    for r in range(ranks):
        for name, traces in (("dep", dep), ("wide", wide)):
            real = torch.load(tmp_path / f"{name}_rank{r}.pt")
            compared += _compare(real, trace_tensors(traces[r]), f"{name} rank {r}")
    assert compared > 20 * ranks  # every traced tensor of both schedules was compared
