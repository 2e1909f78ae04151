"""The layer's dimensions and constants: one frozen object every stage reads.

`LatentMoEConfig.kimi_k3()` is the real layer (`docs/design.md`); `small()` and `tiny()` are the
scaled-down configs the tests use. Every scaled config keeps `top_k = 16` and the MX block
of 32 so the same code paths run as at the real size.

Rank counts the configs support (a width split over `r` ranks must stay a multiple of the
block of 32):

| config | experts `E` | latent `L` | intermediate `I` | ranks r with E%r, L/r%32, I/r%32 ok |
|---|---|---|---|---|
| `kimi_k3` | 896 | 3584 | 3072 | 1, 2, 4, 8, 16 (E: 896 = 56*16; L/16 = 224; I/16 = 192) |
| `small` | 64 | 256 | 256 | 1, 2, 4, 8 (and 16 for expert-parallel splits of E only) |
| `tiny` | 32 | 64 | 64 | 1, 2 (tiny is for per-pair loop tests only) |
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["LatentMoEConfig"]


@dataclass(frozen=True)
class LatentMoEConfig:
    """Every dimension and constant of one latent-MoE layer.

    Attributes:
        hidden: `H`, the model width (rows of `x [T, H]`).
        latent: `L`, the width the routed experts live in.
        experts: `E`, routed experts.
        top_k: `K`, experts per token (16 in every shipped config).
        intermediate: `I`, routed expert intermediate width (w13 `[E, 2I, L]`, w2 `[E, L, I]`).
        shared_intermediate: `S`, the fused shared experts' width (gate_up `[2S, H]`).
        rms_eps: epsilon of the latent RMSNorm.
        situ_beta: SiTU's gate saturation `beta` (4.0).
        situ_linear_beta: SiTU's up saturation `linear_beta` (25.0).
        routed_scaling_factor: scale applied to the routing weights after renormalizing.
        renormalize: divide the top-k weights by their FP32 sum.
        block: the MX block size (32).
        front_max: largest batch served by the DEP split-K front (S1).
        wide_rows: largest batch served by the wide layer (S2).
    """

    hidden: int = 7168
    latent: int = 3584
    experts: int = 896
    top_k: int = 16
    intermediate: int = 3072
    shared_intermediate: int = 6144
    rms_eps: float = 1e-5
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    routed_scaling_factor: float = 1.0
    renormalize: bool = True
    block: int = 32
    front_max: int = 64
    wide_rows: int = 1024

    def __post_init__(self) -> None:
        ints = ("hidden", "latent", "experts", "top_k", "intermediate",
                "shared_intermediate", "block", "front_max", "wide_rows")
        for name in ints:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"LatentMoEConfig.{name} must be a positive int, got {value!r}")
        if self.block != 32:
            raise ValueError(f"LatentMoEConfig.block must be 32 (the MX block), got {self.block}")
        for name in ("hidden", "latent", "intermediate", "shared_intermediate"):
            value = getattr(self, name)
            if value % self.block:
                raise ValueError(
                    f"LatentMoEConfig.{name}={value} must be a multiple of block={self.block}"
                )
        if self.top_k > self.experts:
            raise ValueError(
                f"LatentMoEConfig.top_k={self.top_k} must be <= experts={self.experts}"
            )
        for name in ("rms_eps", "situ_beta", "situ_linear_beta", "routed_scaling_factor"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"LatentMoEConfig.{name} must be a positive float, got {value!r}")
        if not isinstance(self.renormalize, bool):
            raise ValueError(f"LatentMoEConfig.renormalize must be a bool, got {self.renormalize!r}")

    @property
    def front_rows(self) -> int:
        """Rows of the packed front weight `[shared gate_up ; latent down]`: `2S + L`."""
        return 2 * self.shared_intermediate + self.latent

    def supports_ranks(self, ranks: int) -> bool:
        """Whether experts, latent and intermediate split evenly over `ranks` in blocks of 32."""
        return (
            ranks >= 1
            and self.experts % ranks == 0
            and self.latent % (ranks * self.block) == 0
            and self.intermediate % (ranks * self.block) == 0
        )

    def to_dict(self) -> dict:
        """The fields as a JSON-ready dict (what `config.json` holds)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "LatentMoEConfig":
        """Inverse of `to_dict`; unknown keys raise a ValueError naming them."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"LatentMoEConfig.from_dict: unknown keys {unknown}")
        return cls(**data)

    @classmethod
    def kimi_k3(cls) -> "LatentMoEConfig":
        """The real layer: H 7168, L 3584, E 896, K 16, I 3072, S 6144."""
        return cls()

    @classmethod
    def small(cls) -> "LatentMoEConfig":
        """A scaled-down layer for tests: H 512, L 256, E 64, K 16, I 256, S 256.

        Supports 1, 2, 4 and 8 ranks for latent and intermediate splits (256 / 8 = 32),
        and up to 16 (and 32, 64) for expert-parallel splits. Widths stay small because
        `LatentMoEWeights.random` quantizes every expert weight on the CPU."""
        return cls(hidden=512, latent=256, experts=64, top_k=16, intermediate=256,
                   shared_intermediate=256)

    @classmethod
    def tiny(cls) -> "LatentMoEConfig":
        """The smallest config for per-pair loop tests: H 128, L 64, E 32, K 16, I 64, S 64."""
        return cls(hidden=128, latent=64, experts=32, top_k=16, intermediate=64,
                   shared_intermediate=64)
