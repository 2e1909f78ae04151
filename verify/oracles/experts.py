"""The routed experts as a loop over pairs, from the layer's definition.

For each routed pair (token ``t``, slot ``k``, expert ``e = ids[t, k]``), output row
``t * K + k``:

1. the token's BF16 latent row, MXFP8 (RCEIL, :mod:`verify.oracles.mx`), dequantized
   exactly;
2. FC1: ``h = x . w13[e]^T`` with ``w13[e]`` MXFP4 dequantized exactly; each exact sum
   rounded once to FP32; rows ``[gate; up]`` (the first ``I`` rows are the gate);
3. SiTU-and-mul in FP32, op by op (:func:`verify.oracles.stages.situ_and_mul_fp32`);
4. the FP32 activation re-quantized to MXFP8 (RCEIL) and dequantized;
5. FC2: ``y = a . w2[e]^T``, each exact sum rounded once to FP32, then to BF16.

A tensor-parallel shard ``(rank, ranks)`` keeps the intermediate columns
``[rank I / ranks, (rank + 1) I / ranks)``: those gate rows, the same up rows (offset ``I``)
and those columns of ``w2``; step 5 is then the rank's partial.

Every FC sum here is certified exact or exactly rounded (:func:`verify.oracles.exact.
rounded_dot`); an element that a float64-accumulating implementation could round either
way raises :class:`AmbiguousOracle` instead of guessing (MX operands of a layer's
magnitudes never meet it: their float64 sums are exact).
"""

from __future__ import annotations

import torch

from model.config import LatentMoEConfig
from model.weights import LatentMoEWeights
from verify.oracles import mx as mx_oracle
from verify.oracles.exact import FP32, rounded_dot
from verify.oracles.stages import situ_and_mul_fp32

__all__ = ["AmbiguousOracle", "expert_rows", "mxfp8_roundtrip"]


class AmbiguousOracle(AssertionError):
    """An FC sum lies so close to a rounding boundary that a float64-accumulating
    implementation may round it either way: the oracle cannot decide one value."""


def mxfp8_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """float64 [..., K]: ``x`` (finite, BF16 or FP32) MXFP8-quantized and dequantized."""
    return mx_oracle.dequantize(*mx_oracle.quantize(x, "e4m3"), "e4m3")


def _mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return mx_oracle.dequantize(mx_oracle.unpack_nibbles(packed), scales, "e2m1")


def _fc(x: torch.Tensor, w: torch.Tensor, what: str) -> torch.Tensor:
    out = rounded_dot(x, w, FP32)
    if bool(out.ambiguous.any()):
        raise AmbiguousOracle(f"{what}: {int(out.ambiguous.sum())} sums are ambiguous for a "
                              "float64 model")
    return out.value


def expert_rows(latent: torch.Tensor, ids: torch.Tensor, weights: LatentMoEWeights,
                config: LatentMoEConfig, *, shard: tuple[int, int] | None = None) -> torch.Tensor:
    """BF16 [T * K, L]: row ``t * K + k`` is expert ``ids[t, k]`` on token ``t``.

    Args:
        latent: BF16 [T, L].
        ids: int [T, K].
        weights: the layer's MXFP4 experts (``w13``, ``w13_scales``, ``w2``, ``w2_scales``).
        config: widths, ``situ_beta``, ``situ_linear_beta``.
        shard: None, or ``(rank, ranks)``: that TP slice of the intermediate.
    """
    i = config.intermediate
    lo, hi = (0, i) if shard is None else (shard[0] * i // shard[1], (shard[0] + 1) * i // shard[1])
    x = mxfp8_roundtrip(latent)  # [T, L] float64, exact MXFP8 values
    t, k = ids.shape
    flat = ids.detach().cpu().reshape(-1).long()
    out = torch.full((t * k, config.latent), float("nan"), dtype=torch.bfloat16)
    for e in sorted(set(flat.tolist())):  # the pairs of one expert share its weights
        pairs = [p for p in range(t * k) if int(flat[p]) == e]
        w13 = _mxfp4(weights.w13[e].cpu(), weights.w13_scales[e].cpu())  # [2I, L]
        w2 = _mxfp4(weights.w2[e].cpu(), weights.w2_scales[e].cpu())  # [L, I]
        rows = x[[p // k for p in pairs]]
        gate = _fc(rows, w13[lo:hi], f"expert {e} FC1 gate")
        up = _fc(rows, w13[i + lo:i + hi], f"expert {e} FC1 up")
        act = situ_and_mul_fp32(gate, up, beta=config.situ_beta,
                                linear_beta=config.situ_linear_beta)
        y = _fc(mxfp8_roundtrip(act), w2[:, lo:hi], f"expert {e} FC2")
        out[pairs] = y.to(torch.bfloat16)  # FP32 -> BF16, one rounding
    return out
