"""model.config and model.weights: validation, init magnitudes, checkpoint."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from model.config import LatentMoEConfig
from model.formats import dequantize_mxfp4
from model.weights import CHECKPOINT_FILE, CONFIG_FILE, LatentMoEWeights


def test_configs():
    k3 = LatentMoEConfig.kimi_k3()
    assert (k3.hidden, k3.latent, k3.experts, k3.top_k, k3.intermediate,
            k3.shared_intermediate) == (7168, 3584, 896, 16, 3072, 6144)
    assert k3.front_rows == 2 * 6144 + 3584
    for cfg, ranks in ((k3, (1, 2, 4, 8, 16)), (LatentMoEConfig.small(), (1, 2, 4, 8))):
        assert cfg.top_k == 16 and cfg.block == 32
        for r in ranks:
            assert cfg.supports_ranks(r), (cfg, r)
    assert not LatentMoEConfig.small().supports_ranks(16)  # L/16 = 16 is not a block
    assert LatentMoEConfig.tiny().supports_ranks(2)
    assert not LatentMoEConfig.tiny().supports_ranks(4)  # I/4 = 16 is not a block
    assert LatentMoEConfig.from_dict(k3.to_dict()) == k3
    with pytest.raises(dataclasses.FrozenInstanceError):
        k3.hidden = 1


@pytest.mark.parametrize("kwargs, match", [
    ({"hidden": 100}, "hidden=100 must be a multiple of block=32"),
    ({"intermediate": 48}, "intermediate=48 must be a multiple"),
    ({"top_k": 17, "experts": 16}, "top_k=17 must be <= experts=16"),
    ({"block": 16}, "block must be 32"),
    ({"experts": 0}, "experts must be a positive int"),
    ({"rms_eps": -1.0}, "rms_eps must be a positive float"),
    ({"renormalize": 1}, "renormalize must be a bool"),
])
def test_config_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LatentMoEConfig(**kwargs)
    with pytest.raises(ValueError, match="unknown keys"):
        LatentMoEConfig.from_dict({"hiden": 1})


@pytest.fixture(scope="module")
def tiny_weights():
    return LatentMoEWeights.random(LatentMoEConfig.tiny(), seed=7)


def test_random_layout_and_determinism(tiny_weights):
    w, c = tiny_weights, LatentMoEConfig.tiny()
    assert w.shared_gate_up.shape == (2 * c.shared_intermediate, c.hidden)
    assert w.latent_down.shape == (c.latent, c.hidden)
    assert w.latent_down.data_ptr() == w.front[2 * c.shared_intermediate:].data_ptr()  # a view
    again = LatentMoEWeights.random(c, seed=7)
    other = LatentMoEWeights.random(c, seed=8)
    assert torch.equal(again.w13, w.w13) and torch.equal(again.gate, w.gate)
    assert not torch.equal(other.w13, w.w13)


def test_random_magnitudes(tiny_weights):
    w, c = tiny_weights, LatentMoEConfig.tiny()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, c.hidden, generator=g)
    logits = x @ w.gate.float().T
    # std of the logits ~2 (a sum of H terms with std 2/sqrt(H)); sampling noise on
    # 256*32 values is far below the factor-2 window checked here.
    assert 1.0 < logits.std().item() < 4.0
    assert w.bias.abs().max().item() < 0.5
    gates = x @ w.shared_gate_up[: c.shared_intermediate].float().T
    frac = (gates.abs() > c.situ_beta).float().mean().item()
    assert 0.02 < frac < 0.3  # saturation reached sometimes (~11% for std 2.5)
    w13 = dequantize_mxfp4(w.w13, w.w13_scales)
    gate_std = w13[:, : c.intermediate].std().item() * math.sqrt(c.latent)
    up_std = w13[:, c.intermediate:].std().item() * math.sqrt(c.latent)
    assert 2.0 < gate_std < 3.0 and 0.8 < up_std < 1.2


def test_save_load_round_trip_bitwise(tiny_weights, tmp_path):
    w, c = tiny_weights, LatentMoEConfig.tiny()
    w.save(tmp_path)
    back = LatentMoEWeights.load(tmp_path)
    assert back.config == c
    for f in dataclasses.fields(w):
        if f.init and f.name != "config":
            a, b = getattr(w, f.name), getattr(back, f.name)
            assert a.dtype == b.dtype and torch.equal(a, b), f.name
    assert LatentMoEWeights.load(tmp_path, config=c).config == c
    with pytest.raises(ValueError, match="differs from the stored"):
        LatentMoEWeights.load(tmp_path, config=LatentMoEConfig.small())


def test_checkpoint_naming(tiny_weights, tmp_path):
    w, c = tiny_weights, LatentMoEConfig.tiny()
    w.save(tmp_path)
    t = load_file(tmp_path / CHECKPOINT_FILE)
    assert json.loads((tmp_path / CONFIG_FILE).read_text()) == c.to_dict()
    i, l, s = c.intermediate, c.latent, c.shared_intermediate
    e = 5
    assert t[f"experts.{e}.gate_proj.weight_packed"].shape == (i, l // 2)
    assert t[f"experts.{e}.gate_proj.weight_scale"].shape == (i, l // 32)
    assert t[f"experts.{e}.down_proj.weight_packed"].shape == (l, i // 2)
    assert t[f"experts.{e}.up_proj.weight_packed"].dtype == torch.uint8
    # w13 is [gate_proj; up_proj]
    assert torch.equal(w.w13[e, :i], t[f"experts.{e}.gate_proj.weight_packed"])
    assert torch.equal(w.w13[e, i:], t[f"experts.{e}.up_proj.weight_packed"])
    assert torch.equal(w.w13_scales[e, i:], t[f"experts.{e}.up_proj.weight_scale"])
    assert torch.equal(w.front[:s], t["shared_experts.gate_proj.weight"])
    assert torch.equal(w.front[s:2 * s], t["shared_experts.up_proj.weight"])
    assert torch.equal(w.latent_down, t["routed_expert_down_proj.weight"])
    assert t["gate.e_score_correction_bias"].dtype == torch.float32
    for name in ("gate.weight", "shared_experts.down_proj.weight",
                 "routed_expert_norm.weight", "routed_expert_up_proj.weight"):
        assert t[name].dtype == torch.bfloat16, name
    assert len(t) == 8 + 6 * c.experts


def test_load_missing_tensor(tiny_weights, tmp_path):
    from safetensors.torch import save_file

    tiny_weights.save(tmp_path)
    t = load_file(tmp_path / CHECKPOINT_FILE)
    del t["experts.3.up_proj.weight_scale"]
    save_file(t, tmp_path / CHECKPOINT_FILE)
    with pytest.raises(ValueError, match="experts.3.up_proj.weight_scale"):
        LatentMoEWeights.load(tmp_path)


def test_weights_reject_bad_tensors(tiny_weights):
    fields = {f.name: getattr(tiny_weights, f.name) for f in dataclasses.fields(tiny_weights)
              if f.init}
    bad = dict(fields, bias=fields["bias"].bfloat16())
    with pytest.raises(ValueError, match=r"bias must be torch.float32 \[32\]"):
        LatentMoEWeights(**bad)
    bad = dict(fields, w13=fields["w13"][:, :-1])
    with pytest.raises(ValueError, match=r"w13 must be torch.uint8 \[32, 128, 32\]"):
        LatentMoEWeights(**bad)
    with pytest.raises(ValueError, match="config must be a LatentMoEConfig"):
        LatentMoEWeights(**dict(fields, config=None))
