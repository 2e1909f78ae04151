"""The layer's weights: layout, random initialization, and the safetensors checkpoint.

Layouts (`nn.Linear` convention: `[out_features, in_features]`):

| field | shape | dtype | what |
|---|---|---|---|
| `gate` | `[E, H]` | BF16 | router gate |
| `bias` | `[E]` | FP32 | `e_score_correction_bias` (selection only) |
| `front` | `[2S + L, H]` | BF16 | packed `[shared gate_up ; latent down]` |
| `shared_down` | `[H, S]` | BF16 | shared experts' down projection |
| `latent_norm` | `[L]` | BF16 | RMSNorm weight on the routed latent |
| `up` | `[H, L]` | BF16 | latent up projection |
| `w13` / `w13_scales` | `[E, 2I, L/2]` / `[E, 2I, L/32]` | uint8 | MXFP4 `[gate; up]` rows |
| `w2` / `w2_scales` | `[E, L, I/2]` / `[E, L, I/32]` | uint8 | MXFP4 down rows |

MXFP4 tensors follow `model.formats`: two E2M1 codes per byte (element `2i` in the low
nibble), one E8M0 scale byte (`2^(byte - 127)`) per 32 consecutive input columns.

Checkpoint (`save` / `load`): one `model.safetensors` plus `config.json` (the config's
fields). The routed experts use the compressed-tensors `mxfp4-pack-quantized` naming: each
quantized `nn.Linear` weight `X.weight [out, in]` becomes `X.weight_packed` uint8
`[out, in/2]` (low nibble = even column) and `X.weight_scale` uint8 `[out, in/32]` (E8M0
bytes), with X = `experts.{e}.gate_proj`, `experts.{e}.up_proj` (each `[I, L]`) and
`experts.{e}.down_proj` (`[L, I]`). `w13` is assembled on load as `[gate_proj; up_proj]`.
Dense tensors:

| checkpoint name | field |
|---|---|
| `gate.weight` | `gate` |
| `gate.e_score_correction_bias` | `bias` |
| `shared_experts.gate_proj.weight`, `shared_experts.up_proj.weight` | `front[:2S]` (gate rows, then up rows) |
| `shared_experts.down_proj.weight` | `shared_down` |
| `routed_expert_down_proj.weight` | `front[2S:]` (latent down) |
| `routed_expert_norm.weight` | `latent_norm` |
| `routed_expert_up_proj.weight` | `up` |
"""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from dataclasses import dataclass, field, fields

import torch

from model.config import LatentMoEConfig
from model.formats import dequantize_mxfp4, quantize_mxfp4

__all__ = ["LatentMoEWeights", "CHECKPOINT_FILE", "CONFIG_FILE"]

CHECKPOINT_FILE = "model.safetensors"
#: Bytes of dequantized (float32) experts `LatentMoEWeights.expert_fp32` keeps.
DEQUANTIZED_CACHE_BYTES = 1 << 30
CONFIG_FILE = "config.json"

_DENSE_NAMES = {
    "gate": "gate.weight",
    "bias": "gate.e_score_correction_bias",
    "shared_down": "shared_experts.down_proj.weight",
    "latent_norm": "routed_expert_norm.weight",
    "up": "routed_expert_up_proj.weight",
}
_SHARED_GATE = "shared_experts.gate_proj.weight"
_SHARED_UP = "shared_experts.up_proj.weight"
_LATENT_DOWN = "routed_expert_down_proj.weight"

# Standard deviations of the random init, in units of 1/sqrt(fan_in): chosen so that for
# x ~ N(0, 1) the router logits have a spread of ~2 (sigmoid scores spread over (0.1, 0.9),
# realistic top-16 margins), the SiTU gates (shared and routed) have std ~2.5 so |gate| >
# beta = 4 happens for ~11% of them (saturation exercised), and every other projection
# keeps unit-variance activations.
_GATE_STD = 2.0
_BIAS_STD = 0.05
_SITU_GATE_STD = 2.5


def _expected(config: LatentMoEConfig) -> dict:
    c = config
    e, h, l, i, s, b = c.experts, c.hidden, c.latent, c.intermediate, c.shared_intermediate, c.block
    return {
        "gate": ((e, h), torch.bfloat16),
        "bias": ((e,), torch.float32),
        "front": ((c.front_rows, h), torch.bfloat16),
        "shared_down": ((h, s), torch.bfloat16),
        "latent_norm": ((l,), torch.bfloat16),
        "up": ((h, l), torch.bfloat16),
        "w13": ((e, 2 * i, l // 2), torch.uint8),
        "w13_scales": ((e, 2 * i, l // b), torch.uint8),
        "w2": ((e, l, i // 2), torch.uint8),
        "w2_scales": ((e, l, i // b), torch.uint8),
    }


@dataclass
class LatentMoEWeights:
    """Every weight of one latent-MoE layer (shapes and dtypes in the module docstring).

    Construction validates each tensor's shape and dtype against `config` and that all
    tensors share one device; a mismatch raises a ValueError naming the field.
    """

    gate: torch.Tensor
    bias: torch.Tensor
    front: torch.Tensor
    shared_down: torch.Tensor
    latent_norm: torch.Tensor
    up: torch.Tensor
    w13: torch.Tensor
    w13_scales: torch.Tensor
    w2: torch.Tensor
    w2_scales: torch.Tensor
    config: LatentMoEConfig
    _dequantized: OrderedDict = field(default_factory=OrderedDict, init=False, repr=False,
                                      compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.config, LatentMoEConfig):
            raise ValueError(f"LatentMoEWeights.config must be a LatentMoEConfig, got {type(self.config).__name__}")
        device = None
        for name, (shape, dtype) in _expected(self.config).items():
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"LatentMoEWeights.{name} must be a torch.Tensor, got {type(t).__name__}")
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(
                    f"LatentMoEWeights.{name} must be {dtype} {list(shape)}, "
                    f"got {t.dtype} {list(t.shape)}"
                )
            if device is None:
                device = t.device
            elif t.device != device:
                raise ValueError(f"LatentMoEWeights.{name} is on {t.device}, the others on {device}")

    @property
    def device(self) -> torch.device:
        return self.gate.device

    @property
    def shared_gate_up(self) -> torch.Tensor:
        """View of `front[:2S]`: the shared gate rows (S of them), then the shared up rows."""
        return self.front[: 2 * self.config.shared_intermediate]

    @property
    def latent_down(self) -> torch.Tensor:
        """View of `front[2S:]`: the latent down projection `[L, H]`."""
        return self.front[2 * self.config.shared_intermediate:]

    def to(self, device) -> "LatentMoEWeights":
        """A copy with every tensor on `device`."""
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self)
                 if f.init and f.name != "config"}
        return LatentMoEWeights(config=self.config, **moved)

    def expert_fp32(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ``expert``'s dequantized MXFP4 weights ``(w13 [2I, L], w2 [L, I])``,
        float32 (exact: every MXFP4 value is an FP32 number), cached.

        The cache keeps the most recently used experts up to ``DEQUANTIZED_CACHE_BYTES``
        (the weights are never modified in place; a new object starts a new cache)."""
        hit = self._dequantized.get(expert)
        if hit is not None:
            self._dequantized.move_to_end(expert)
            return hit
        pair = (dequantize_mxfp4(self.w13[expert], self.w13_scales[expert]),
                dequantize_mxfp4(self.w2[expert], self.w2_scales[expert]))
        size = sum(t.numel() * 4 for t in pair)
        if size <= DEQUANTIZED_CACHE_BYTES:
            self._dequantized[expert] = pair
            while len(self._dequantized) * size > DEQUANTIZED_CACHE_BYTES:
                self._dequantized.popitem(last=False)
        return pair

    @classmethod
    def random(cls, config: LatentMoEConfig, seed: int, device="cpu") -> "LatentMoEWeights":
        """Random weights with trained-layer magnitudes (see `_GATE_STD` and friends).

        Dense weights: normal with std `k / sqrt(fan_in)`, rounded once to BF16 (RNE).
        Expert weights: normal FP32 the same way, quantized with
        `model.formats.quantize_mxfp4` (RCEIL scales). Generated on the CPU from
        `torch.Generator().manual_seed(seed)` (identical on every machine), then moved.
        """
        if not isinstance(config, LatentMoEConfig):
            raise ValueError(f"random: config must be a LatentMoEConfig, got {type(config).__name__}")
        c = config
        g = torch.Generator().manual_seed(int(seed))

        def normal(*shape, std):
            return torch.randn(*shape, generator=g, dtype=torch.float32) * std

        h, l, s, i = c.hidden, c.latent, c.shared_intermediate, c.intermediate
        gate = normal(c.experts, h, std=_GATE_STD / math.sqrt(h)).bfloat16()
        bias = normal(c.experts, std=_BIAS_STD)
        front = torch.cat([
            normal(s, h, std=_SITU_GATE_STD / math.sqrt(h)),
            normal(s, h, std=1.0 / math.sqrt(h)),
            normal(l, h, std=1.0 / math.sqrt(h)),
        ]).bfloat16()
        shared_down = normal(h, s, std=1.0 / math.sqrt(s)).bfloat16()
        latent_norm = (1.0 + normal(l, std=0.1)).bfloat16()
        up = normal(h, l, std=1.0 / math.sqrt(l)).bfloat16()
        w13, w13s, w2, w2s = [], [], [], []
        for _ in range(c.experts):
            rows = torch.cat([normal(i, l, std=_SITU_GATE_STD / math.sqrt(l)),
                              normal(i, l, std=1.0 / math.sqrt(l))])
            p, sc = quantize_mxfp4(rows)
            w13.append(p)
            w13s.append(sc)
            p, sc = quantize_mxfp4(normal(l, i, std=1.0 / math.sqrt(i)))
            w2.append(p)
            w2s.append(sc)
        weights = cls(gate=gate, bias=bias, front=front, shared_down=shared_down,
                      latent_norm=latent_norm, up=up, w13=torch.stack(w13),
                      w13_scales=torch.stack(w13s), w2=torch.stack(w2),
                      w2_scales=torch.stack(w2s), config=c)
        return weights.to(device)

    def state_dict(self) -> dict:
        """The checkpoint tensors by checkpoint name (contiguous CPU tensors)."""
        c = self.config
        s, i = c.shared_intermediate, c.intermediate
        out = {name: getattr(self, field) for field, name in _DENSE_NAMES.items()}
        out[_SHARED_GATE] = self.front[:s]
        out[_SHARED_UP] = self.front[s:2 * s]
        out[_LATENT_DOWN] = self.latent_down
        for e in range(c.experts):
            for proj, packed, scale in (
                ("gate_proj", self.w13[e, :i], self.w13_scales[e, :i]),
                ("up_proj", self.w13[e, i:], self.w13_scales[e, i:]),
                ("down_proj", self.w2[e], self.w2_scales[e]),
            ):
                out[f"experts.{e}.{proj}.weight_packed"] = packed
                out[f"experts.{e}.{proj}.weight_scale"] = scale
        return {k: v.detach().to("cpu").contiguous() for k, v in out.items()}

    def save(self, directory) -> None:
        """Write `model.safetensors` and `config.json` into `directory` (created if needed)."""
        from safetensors.torch import save_file

        os.makedirs(directory, exist_ok=True)
        save_file(self.state_dict(), os.path.join(directory, CHECKPOINT_FILE),
                  metadata={"format": "pt", "quantization": "mxfp4-pack-quantized"})
        with open(os.path.join(directory, CONFIG_FILE), "w") as f:
            json.dump(self.config.to_dict(), f, indent=2, sort_keys=True)

    @classmethod
    def load(cls, directory, config: LatentMoEConfig | None = None) -> "LatentMoEWeights":
        """Read a checkpoint written by `save` (CPU tensors).

        Args:
            directory: folder holding `model.safetensors` and `config.json`.
            config: if given, must equal the stored config (ValueError otherwise).
        """
        from safetensors.torch import load_file

        with open(os.path.join(directory, CONFIG_FILE)) as f:
            stored = LatentMoEConfig.from_dict(json.load(f))
        if config is not None and config != stored:
            raise ValueError(f"load: config {config} differs from the stored {stored}")
        c = stored
        t = load_file(os.path.join(directory, CHECKPOINT_FILE))
        missing = [n for n in (*_DENSE_NAMES.values(), _SHARED_GATE, _SHARED_UP, _LATENT_DOWN)
                   if n not in t]
        for e in range(c.experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                for suffix in ("weight_packed", "weight_scale"):
                    if f"experts.{e}.{proj}.{suffix}" not in t:
                        missing.append(f"experts.{e}.{proj}.{suffix}")
        if missing:
            raise ValueError(f"load: checkpoint lacks {len(missing)} tensors, e.g. {missing[:4]}")

        def stack(proj, suffix):
            return torch.stack([t[f"experts.{e}.{proj}.{suffix}"] for e in range(c.experts)])

        dense = {field: t[name] for field, name in _DENSE_NAMES.items()}
        front = torch.cat([t[_SHARED_GATE], t[_SHARED_UP], t[_LATENT_DOWN]])
        w13 = torch.cat([stack("gate_proj", "weight_packed"), stack("up_proj", "weight_packed")], dim=1)
        w13s = torch.cat([stack("gate_proj", "weight_scale"), stack("up_proj", "weight_scale")], dim=1)
        return cls(front=front, w13=w13, w13_scales=w13s, w2=stack("down_proj", "weight_packed"),
                   w2_scales=stack("down_proj", "weight_scale"), config=c, **dense)
