"""The routed experts: MXFP8 latent x MXFP4 w13 -> SiTU -> MXFP8 -> x MXFP4 w2.

Per routed pair (token t, slot k, expert e = ids[t, k]), rounding points in order:

1. the latent row is MXFP8 (`reference.mx.quantize_mxfp8`, RCEIL) — given as codes and
   scales to `expert_rows_mxfp8`; dequantized exactly to FP32 (E4M3 x 2^k);
2. FC1 `h = x @ w13[e].T`: w13 dequantized exactly (E2M1 x 2^k) from MXFP4; products of
   two such values are exact in FP32 and float64; the sum is exact
   (`reference.gemm.matmul`) and rounded ONCE to FP32 — the model of the kernel's FP32
   accumulation (a kernel's order differs; contracts bound it);
3. `a = situ_and_mul_fp32(h)` (`reference.activation`: FP32 ops; rows `[gate; up]`);
4. `a` re-quantized to MXFP8 (RCEIL, blocks of 32 along I) and dequantized;
5. FC2 `y = a @ w2[e].T`: exact sum rounded once to FP32, then that FP32 value rounded
   to BF16 (RNE) — the kernel's FP32 accumulator converted in its epilogue;
6. the BF16 row lands at output row `t*K + k`.

`shard=(rank, ranks)` is the tensor-parallel expert: rank r keeps gate rows
`[r*I/R, (r+1)*I/R)`, the same up rows `I + [r*I/R, (r+1)*I/R)`, and those columns of w2
(steps 2-4 are then exactly the unsharded values on that slice, since SiTU and the MXFP8
blocks act column-wise within whole blocks of 32), and step 5 is this rank's partial sum,
rounded to FP32 and to BF16 on its own (the TP all-reduce adds the partials).
"""

from __future__ import annotations

import torch

from model.config import LatentMoEConfig
from model.weights import LatentMoEWeights
from reference.activation import situ_and_mul_fp32
from reference.finalize import finalize
from reference.gemm import matmul
from reference.mx import dequantize_mxfp8, quantize_mxfp8

__all__ = ["expert_rows_mxfp8", "expert_rows", "pair_rows_fp32", "routed_experts", "shard_rows"]


def shard_rows(config: LatentMoEConfig, shard: tuple[int, int] | None) -> tuple[list[int], slice]:
    """The w13 row indices and w2 column slice of a TP shard.

    Args:
        config: the layer config.
        shard: None (everything) or `(rank, ranks)` with `I % (ranks * 32) == 0`.

    Returns:
        `(w13_rows, w2_cols)`: the gate rows then the up rows of the slice, and the
        matching column slice of w2 `[L, I]`.
    """
    i = config.intermediate
    if shard is None:
        return list(range(2 * i)), slice(0, i)
    if (not isinstance(shard, tuple) or len(shard) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in shard)):
        raise ValueError(f"shard must be None or a (rank, ranks) tuple of ints, got {shard!r}")
    rank, ranks = shard
    if ranks < 1 or not 0 <= rank < ranks:
        raise ValueError(f"shard: need 0 <= rank < ranks, got rank={rank}, ranks={ranks}")
    if i % (ranks * config.block):
        raise ValueError(
            f"shard: intermediate I={i} must split into {ranks} slices that are whole "
            f"blocks of {config.block} (I % (ranks*{config.block}) == 0)"
        )
    w = i // ranks
    lo = rank * w
    return list(range(lo, lo + w)) + list(range(i + lo, i + lo + w)), slice(lo, lo + w)


def _check_ids(ids: torch.Tensor, t: int, config: LatentMoEConfig, device) -> None:
    k = config.top_k
    if (not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64)
            or tuple(ids.shape) != (t, k)):
        raise ValueError(f"ids must be an int32/int64 [T, top_k] = [{t}, {k}] tensor, got "
                         f"{getattr(ids, 'dtype', type(ids))} {tuple(getattr(ids, 'shape', ()))}")
    if ids.device != device:
        raise ValueError(f"ids on {ids.device}, the latent on {device}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= config.experts):
        raise ValueError(f"ids must lie in [0, experts={config.experts}), got "
                         f"[{int(ids.min())}, {int(ids.max())}]")


def expert_rows_mxfp8(
    codes: torch.Tensor,
    scales: torch.Tensor,
    ids: torch.Tensor,
    experts: LatentMoEWeights,
    config: LatentMoEConfig,
    *,
    shard: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Every routed pair's expert output row from an MXFP8 latent (steps 1-6 above).

    Args:
        codes: [T, L] float8_e4m3fn MXFP8 elements of the latent.
        scales: [T, L/32] uint8 E8M0 scales.
        ids: [T, K] int32/int64 expert ids.
        experts: the layer's weights (w13, w13_scales, w2, w2_scales are read).
        config: the layer config (`top_k`, `situ_beta`, `situ_linear_beta`, widths).
        shard: None or `(rank, ranks)`: this rank's TP slice of every expert.

    Returns:
        [T*K, L] bfloat16; row `t*K + k` is expert `ids[t, k]` on token t (the full
        output, or this rank's partial when sharded).
    """
    if not isinstance(experts, LatentMoEWeights) or experts.config != config:
        raise ValueError("experts must be LatentMoEWeights built for this config")
    l, b = config.latent, config.block
    if (not isinstance(codes, torch.Tensor) or codes.dtype != torch.float8_e4m3fn
            or codes.dim() != 2 or codes.shape[1] != l):
        raise ValueError(f"codes must be a float8_e4m3fn [T, L={l}] tensor, got "
                         f"{getattr(codes, 'dtype', type(codes))} {tuple(getattr(codes, 'shape', ()))}")
    t = codes.shape[0]
    if (not isinstance(scales, torch.Tensor) or scales.dtype != torch.uint8
            or tuple(scales.shape) != (t, l // b)):
        raise ValueError(f"scales must be a uint8 [T, L/32] = [{t}, {l // b}] tensor, got "
                         f"{getattr(scales, 'dtype', type(scales))} {tuple(getattr(scales, 'shape', ()))}")
    _check_ids(ids, t, config, codes.device)
    if experts.device != codes.device:
        raise ValueError(f"experts on {experts.device}, codes on {codes.device}")
    k = config.top_k
    x = dequantize_mxfp8(codes, scales)  # [T, L] float32, exact
    flat = ids.reshape(-1).long()  # pair p = t*K + k
    token_of_pair = torch.arange(t * k, device=codes.device) // k
    return pair_rows_fp32(x, flat, experts, config, rows=token_of_pair, shard=shard)


def pair_rows_fp32(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    experts: LatentMoEWeights,
    config: LatentMoEConfig,
    *,
    rows: torch.Tensor | None = None,
    shard: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The expert row of each (latent row, expert) pair — what a grouped-GEMM engine
    computes for a list of pairs, one pair per row (steps 2-6 above).

    Args:
        x: [R, L] float32, dequantized MXFP8 latent rows (exact values).
        expert_ids: [P] int, each pair's expert.
        rows: optional [P] int, each pair's row of `x` (default: pair p reads row p, R = P),
            so a token's latent row is never copied once per slot.
        experts: the layer's weights; config: the layer config.
        shard: None or `(rank, ranks)`: this rank's TP slice of every expert.

    Returns:
        [P, L] bfloat16. Row p depends on (x[p], expert_ids[p]) alone, so its bits are the
        same inside any batch and any grouping of the pairs.
    """
    w13_rows, w2_cols = shard_rows(config, shard)
    w13_rows_t = torch.tensor(w13_rows, device=x.device)
    out = torch.zeros(expert_ids.shape[0], config.latent, dtype=torch.bfloat16,
                      device=x.device)
    for e in torch.unique(expert_ids).tolist():
        pairs = torch.nonzero(expert_ids == e).flatten()
        w13_full, w2_full = experts.expert_fp32(e)
        xe = x[pairs] if rows is None else x[rows[pairs]]
        h = matmul(xe, w13_full[w13_rows_t], out_dtype=torch.float32)
        a = situ_and_mul_fp32(h, beta=config.situ_beta, linear_beta=config.situ_linear_beta)
        a = dequantize_mxfp8(*quantize_mxfp8(a))
        w2 = w2_full[:, w2_cols].contiguous()
        out[pairs] = matmul(a, w2, out_dtype=torch.float32).to(torch.bfloat16)
    return out


def expert_rows(
    latent: torch.Tensor,
    ids: torch.Tensor,
    experts: LatentMoEWeights,
    config: LatentMoEConfig,
    *,
    shard: tuple[int, int] | None = None,
) -> torch.Tensor:
    """`quantize_mxfp8(latent)` (RCEIL) then `expert_rows_mxfp8`.

    Args:
        latent: [T, L] bfloat16.
        ids: [T, K] int32/int64.

    Returns:
        [T*K, L] bfloat16 expert rows.
    """
    if (not isinstance(latent, torch.Tensor) or latent.dtype != torch.bfloat16
            or latent.dim() != 2 or latent.shape[1] != config.latent):
        raise ValueError(f"latent must be a bfloat16 [T, L={config.latent}] tensor, got "
                         f"{getattr(latent, 'dtype', type(latent))} {tuple(getattr(latent, 'shape', ()))}")
    codes, scales = quantize_mxfp8(latent)
    return expert_rows_mxfp8(codes, scales, ids, experts, config, shard=shard)


def routed_experts(
    latent: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    experts: LatentMoEWeights,
    config: LatentMoEConfig,
) -> torch.Tensor:
    """The layer's routed part, `experts(mxfp8(latent), w, ids)`: `finalize(expert_rows(...),
    weights)`.

    Args:
        latent: [T, L] bfloat16.
        weights: [T, K] float32 routing weights.
        ids: [T, K] int32/int64 expert ids.

    Returns:
        [T, L] bfloat16 routed latent.
    """
    return finalize(expert_rows(latent, ids, experts, config), weights)
