"""The case grid of the contracts: batches, rank counts, configs, and cached inputs.

* Batches: S1 (DEP) serves 1..``front_max`` (64) tokens per rank with its split-K front
  and the stock order above; S2 (wide) serves 65..``wide_rows`` (1024) (``docs/design.md``).
* Rank counts: every divisor of the experts and the latent width up to 16.
* Configs: ``small`` everywhere (keeps top-16 and the 32-element blocks, so every real code
  path runs); ``kimi_k3`` (the real dimensions) for the stage contracts, whose widths come
  from the config (:data:`STAGE_CONFIGS`), and for the GEMMs on a GPU; its 15 GB of MXFP4
  experts only where a GPU holds them. Every report row is labelled with the config its
  case really ran (the ``config_name`` parameter).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from model.config import LatentMoEConfig
from model.weights import LatentMoEWeights

ALL_BATCHES = (1, 2, 3, 7, 16, 64, 65, 100, 256, 1024)
DEP_BATCHES = tuple(b for b in ALL_BATCHES if b <= 64)
WIDE_BATCHES = (1, 3, 65, 100, 256)  # the emulation serves any batch; 65.. is production
RANKS = (1, 2, 4, 8, 16)

#: The configs whose widths the per-stage contracts take (``LatentMoEConfig`` fields, never
#: re-typed numbers).
STAGE_CONFIGS = ("small", "kimi_k3")

#: (config, batch) cases of a stage contract on the ``reference`` backend, which runs on
#: this machine's CPU: every batch at ``small``, and the real widths at three batches (one
#: token, a few, past the S1 bucket): a CPU reference stage is one vectorized code path
#: whatever its width, and the oracles it is compared with are CPU code too.
REFERENCE_GRID = [("small", t) for t in ALL_BATCHES] + [("kimi_k3", t) for t in (1, 7, 65)]

CONFIGS = {
    "small": LatentMoEConfig.small,
    "kimi_k3": LatentMoEConfig.kimi_k3,
}


def config(name: str) -> LatentMoEConfig:
    return CONFIGS[name]()


@functools.cache
def weights(name: str, device: str = "cpu", seed: int = 2026) -> LatentMoEWeights:
    """The layer's weights for a config (one fixed seed: the weights are the model; the
    inputs vary per case)."""
    return LatentMoEWeights.random(config(name), seed, device=device)


def hidden_rows(cfg: LatentMoEConfig, tokens: int, seed: int, device: str = "cpu",
                scale: float = 1.0) -> torch.Tensor:
    """Hidden rows x [tokens, H] BF16 like a decoder's normalized residual stream."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, cfg.hidden, generator=g) * scale
    return x.to(torch.bfloat16).to(device)


def _tp16() -> LatentMoEConfig:
    """``small`` with the routed intermediate widened to 512, so that 16 TP ranks keep a
    whole MX block (32) of it each (the wide layer at 16 ranks)."""
    return dataclasses.replace(LatentMoEConfig.small(), intermediate=512)


CONFIGS["tp16"] = _tp16


@dataclasses.dataclass(frozen=True)
class DenseWeights:
    """The dense (BF16) weights of a layer only: what the GEMM contracts read. At the real
    dimensions this avoids generating 15 GB of MXFP4 experts to test four GEMMs."""

    gate: torch.Tensor
    front: torch.Tensor
    shared_down: torch.Tensor
    up: torch.Tensor


@functools.cache
def dense_weights(name: str, device: str = "cpu", seed: int = 2026) -> DenseWeights:
    """The layer's dense weights: those of :func:`weights` for the small configs, else
    N(0, 1/fan_in) BF16 matrices of the config's shapes (generated on ``device``)."""
    if name != "kimi_k3":
        w = weights(name, device, seed)
        return DenseWeights(w.gate, w.front, w.shared_down, w.up)
    cfg = config(name)
    g = torch.Generator(device=device).manual_seed(seed)

    def normal(rows, cols):
        return (torch.randn(rows, cols, generator=g, device=device) / cols**0.5).to(torch.bfloat16)

    return DenseWeights(
        gate=normal(cfg.experts, cfg.hidden) * 2,
        front=normal(cfg.front_rows, cfg.hidden),
        shared_down=normal(cfg.hidden, cfg.shared_intermediate),
        up=normal(cfg.hidden, cfg.latent),
    )


@functools.cache
def other_weights(name: str, device: str = "cpu") -> LatentMoEWeights:
    """A second layer of the same config, for the contracts that run two layers through
    one set of buffers: :func:`weights` with every expert moved to the next index, the
    router gate negated, the bias and the dense matrices' rows reversed (a different layer,
    built without generating and quantizing a second set of experts)."""
    w = weights(name, device)
    return dataclasses.replace(
        w, gate=-w.gate, bias=w.bias.flip(0), front=w.front.flip(0),
        shared_down=w.shared_down.flip(0), latent_norm=w.latent_norm.flip(0), up=w.up.flip(0),
        w13=w.w13.roll(1, 0), w13_scales=w.w13_scales.roll(1, 0), w2=w.w2.roll(1, 0),
        w2_scales=w.w2_scales.roll(1, 0))


def mxfp4_expert_codes(cfg: LatentMoEConfig, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Every expert's weights as uniformly random MXFP4 codes with scale codes 118..124 (the
    magnitudes of a trained layer's experts), drawn from ``g`` on its device in the order
    w13, w13 scales, w2, w2 scales: the ``LatentMoEWeights`` fields of those names (the
    real layer's 15 GB of experts in well under a second on a GPU)."""
    e, i, l = cfg.experts, cfg.intermediate, cfg.latent

    def draw(low, high, *shape):
        return torch.randint(low, high, shape, generator=g, device=g.device, dtype=torch.uint8)

    return {"w13": draw(0, 256, e, 2 * i, l // 2), "w13_scales": draw(118, 125, e, 2 * i, l // 32),
            "w2": draw(0, 256, e, l, i // 2), "w2_scales": draw(118, 125, e, l, i // 32)}


def dequantized_expert(w: LatentMoEWeights, e: int, shard: tuple[int, int]):
    """Expert ``e``'s TP slice ``shard = (rank, ranks)`` in FP32: (w13 ``[2 I_s, L]`` as
    ``[gate; up]``, w2 ``[L, I_s]``), dequantized by the reference (exact)."""
    from model.formats import dequantize_mxfp4

    i = w.config.intermediate
    rank, ranks = shard
    inter = i // ranks
    lo = rank * inter
    w13 = dequantize_mxfp4(w.w13[e], w.w13_scales[e])
    w13 = torch.cat([w13[lo:lo + inter], w13[i + lo:i + lo + inter]])
    w2 = dequantize_mxfp4(w.w2[e], w.w2_scales[e])[:, lo:lo + inter].contiguous()
    return w13, w2


@functools.cache
def expert_code_weights(name: str, device: str, seed: int = 7) -> LatentMoEWeights:
    """A layer whose experts are :func:`mxfp4_expert_codes` generated directly on
    ``device``; its dense weights are zeros (the experts' contracts never read them)."""
    cfg = config(name)
    g = torch.Generator(device=device).manual_seed(seed)

    def zeros(*shape, dtype=torch.bfloat16):
        return torch.zeros(*shape, dtype=dtype, device=device)

    return LatentMoEWeights(
        gate=zeros(cfg.experts, cfg.hidden), bias=zeros(cfg.experts, dtype=torch.float32),
        front=zeros(cfg.front_rows, cfg.hidden),
        shared_down=zeros(cfg.hidden, cfg.shared_intermediate), latent_norm=zeros(cfg.latent),
        up=zeros(cfg.hidden, cfg.latent), **mxfp4_expert_codes(cfg, g), config=cfg)


@functools.cache
def rank_rows(cfg: LatentMoEConfig, ranks: int, tokens: int, seed: int,
              device: str = "cpu") -> list[torch.Tensor]:
    """One BF16 ``[tokens, H]`` batch per DEP rank: rank ``r``'s rows are
    :func:`hidden_rows` of seed ``seed + r`` (every rank's own tokens differ)."""
    return [hidden_rows(cfg, tokens, seed + r, device) for r in range(ranks)]


def layer_weights(name: str) -> LatentMoEWeights:
    """A config's weights from the generator that suits its size: :func:`device_weights`
    on the GPU for ``kimi_k3`` (the CPU generator takes minutes there), :func:`weights`
    otherwise."""
    return device_weights(name) if name == "kimi_k3" else weights(name)


def device_weights(name: str, seed: int = 11) -> LatentMoEWeights:
    """A whole layer on the GPU in seconds (``weights``' CPU generator takes far longer at
    the real size): :func:`dense_weights` on CUDA, router bias normal(0, 0.01), latent-norm
    weight ``1 + normal(0, 0.1)``, experts from :func:`mxfp4_expert_codes`."""
    c = config(name)
    d = dense_weights(name, "cuda", seed)
    g = torch.Generator(device="cuda").manual_seed(seed)
    bias = torch.randn(c.experts, generator=g, device="cuda") * 0.01
    latent_norm = (1 + 0.1 * torch.randn(c.latent, generator=g, device="cuda")).bfloat16()
    return LatentMoEWeights(gate=d.gate, bias=bias, front=d.front, shared_down=d.shared_down,
                            latent_norm=latent_norm, up=d.up, **mxfp4_expert_codes(c, g),
                            config=c)


def routing(cfg: LatentMoEConfig, rows: int, seed: int, *, skew: float = 0.0) -> torch.Tensor:
    """int32 [rows, top_k] distinct expert ids per row: uniform, or Zipf-like popularity
    ``p(e) ~ 1 / (rank(e) + 1)^skew`` over a seeded permutation of the experts."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.ones(cfg.experts)
    if skew:
        weights = (torch.arange(cfg.experts, dtype=torch.float64) + 1.0) ** -skew
        weights = weights[torch.randperm(cfg.experts, generator=g)].float()
    ids = torch.multinomial(weights.expand(rows, -1), cfg.top_k, replacement=False, generator=g)
    return ids.to(torch.int32)


#: The magnitudes of ``order_exposing_values``: FP32 sums of them depend on their order
#: (``2^24 + 1`` rounds to ``2^24``), 36 binades apart at the ends.
ORDER_EXPOSING_MAGNITUDES = (2.0 ** 24, 2.0 ** 12, 1.0, 2.0 ** -12)


def order_exposing_values(shape, seed: int, device="cpu") -> torch.Tensor:
    """BF16 ``shape``: per element a random sign times one of
    ``ORDER_EXPOSING_MAGNITUDES`` (exact in BF16), so the FP32 sum of a few of them decides
    its bits by its order (the designed-order contracts: random values of similar size
    often sum exactly in FP32 whatever the order)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor(ORDER_EXPOSING_MAGNITUDES)
    pick = torch.randint(0, len(ORDER_EXPOSING_MAGNITUDES), tuple(shape), generator=g)
    sign = torch.randint(0, 2, tuple(shape), generator=g) * 2 - 1
    return (scale[pick] * sign).to(torch.bfloat16).to(device)


#: The cancelling pair of ``cancelling_rank_values`` and the small values around it (all
#: exact in BF16): the pair's ulp in FP32 is 2, so every small value added while the pair
#: is half summed is absorbed (rounded away), and which ones are depends on the order.
CANCELLING_BIG = 2.0 ** 24
CANCELLING_SMALL = (1.0, 0.75, 0.5, 0.375, 0.25, 0.125)


def cancelling_rank_values(ranks: int, shape, seed: int, device="cpu") -> list[torch.Tensor]:
    """``ranks`` BF16 tensors of ``shape`` (one per rank) whose FP32 sum in rank order
    depends on that order at almost every element: per element two random ranks hold
    ``+B`` and ``-B`` (``B = CANCELLING_BIG``, random sign) and the others a random
    ``+-CANCELLING_SMALL``; a small value added between the two big ones is absorbed, so
    the sum (a small number, exact in BF16) counts only the others (at 3 ranks about 70%
    of elements change when the order is reversed, at 16 about 95%). For the rank-order
    all-reduces, whose random partials of similar size often sum exactly in any order."""
    if ranks < 2:
        raise ValueError(f"cancelling_rank_values: needs at least 2 ranks, got {ranks}")
    g = torch.Generator().manual_seed(seed)
    shape = tuple(shape)
    small = torch.tensor(CANCELLING_SMALL)
    vals = small[torch.randint(0, len(small), (ranks, *shape), generator=g)]
    vals = vals * (torch.randint(0, 2, (ranks, *shape), generator=g) * 2 - 1)
    place = torch.argsort(torch.rand(ranks, *shape, generator=g), dim=0)  # per element
    big = CANCELLING_BIG * (torch.randint(0, 2, shape, generator=g) * 2 - 1)
    vals = torch.where(place == 0, big, torch.where(place == 1, -big, vals))
    return [v.to(torch.bfloat16).to(device) for v in vals]
