"""S2, the wide layer (TP over N ranks, 65..wide_rows rows): a per-rank emulation.

Every rank of the TP group holds the SAME tokens ``x [T, H]`` BF16 and, for rank ``r`` of
``N``: the router rows ``[r*E/N, (r+1)*E/N)`` and latent-down rows ``[r*L/N, (r+1)*L/N)``
(packed into one weight), the TP slice ``[r*I/N, (r+1)*I/N)`` of every routed expert's
intermediate, the slice ``[r*S/N, (r+1)*S/N)`` of the shared expert's intermediate, and
the up-projection's output columns ``[r*H/N, (r+1)*H/N)``. (The emulation reads these
slices out of one :class:`~model.weights.LatentMoEWeights`.)

Streams of one rank (sharded routing: each rank polls every logit and routes itself)::

    side  : shared expert partial (gate_up slice, SiTU, down slice) ─────────────────┐
    front : FP32 GEMM [router rows; latent shard] ─ WidePublish ─ WideRouteSharded   │
            (routing CTAs: poll logits, top-16, append to lists │ plan CTAs: poll    │
             latent, MXFP8 plan) ─ listed experts (TP slice) ─ Finalize              │
    main  :                       latent all-reduce + RMSNorm ─ addmm into shared ◄──┘
                                  ─ all-reduce of the hidden rows

Rounding points, in order:

1. ``front_r = matmul(x, [gate_r; down_r], out_dtype=FP32)`` (one FP32 rounding per
   element; each element is its own dot product, so the logits are S0's bit for bit).
2. Publish: logits as FP32 words; the latent shard ``round_to_bfloat16(front_r[:, E/N:])``
   (exact -> FP32 -> BF16: the BF16 epilogue of an FP32 accumulator; S0's model rounds
   the exact sum once to BF16, so the two differ where the FP32 value lands on a BF16
   midpoint — double rounding, at most 1 BF16 ulp); -0 becomes +0 in both.
3. Route: ``route(polled logits)`` — exact top-16, the same on every rank.
4. Plan: ``quantize_mxfp8(polled latent)``.
5. Listed engine: per touched expert (ascending id), its routing list in windows of 8
   pairs; each pair's row is ``expert_rows_mxfp8(..., shard=(r, N))``: FC1 over this
   rank's intermediate slice, SiTU, MXFP8, FC2 over the slice, one BF16 rounding of the
   FP32 partial -> ``rows[t*k + j]`` (a BF16 *partial* row).
6. Finalize: ``finalize(rows, weights)`` (FP32 FMA chain, k in order, one BF16 rounding):
   this rank's BF16 partial of the routed latent.
7. Latent all-reduce: :meth:`~reference.schedules.groups.Group.all_reduce_bf16` (FP32, rank
   order, one BF16 rounding), then ``rms_norm``.
8. Shared partial: ``matmul(x, [gate_up slice], BF16)``, ``situ_and_mul``,
   ``matmul(act, shared_down[:, slice], BF16)`` -> BF16 [T, H].
9. ``shared[:, cols_r] = addmm(shared[:, cols_r], normed, up[cols_r])`` (one rounding).
10. Hidden all-reduce: ``all_reduce_bf16(shared)`` -> ``out`` (same bits on every rank).

Routing lists: per expert a list of capacity ``wide_rows`` of pair indices ``t*k + j``,
unused entries poisoned -1, plus a count. The GPU claims list slots with relaxed atomics,
so the order inside a list is not deterministic; the emulation appends in token order
(or in any order given by ``claim_order``) and the output must not depend on it — every
pair's row goes to ``rows[pair]`` and the Finalize reads rows by pair index.

Bitwise vs S0 (:func:`reference.layer.stock_order_trace` of the same x):

| stage | N = 1 | N > 1 |
|---|---|---|
| logits, ids, weights | bitwise | bitwise |
| latent | bitwise except double-rounding points (<= 1 BF16 ulp) | same as N = 1 |
| plan (codes, scales) | bitwise on own latent | bitwise on own latent |
| expert rows | bitwise on own latent | bounded: FC2 split over the TP slices, each rounded to BF16 |
| routed (after all-reduce) | bitwise on own latent | bounded: per-rank Finalize + FP32 rank-order sum |
| normed | bitwise on own routed | bitwise on own routed |
| shared | bitwise | bounded: shared down split over S/N slices |
| out | bitwise on own latent | bounded: TP partials summed in FP32 |
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.config import LatentMoEConfig
from model.weights import LatentMoEWeights
from reference.activation import situ_and_mul
from reference.finalize import finalize
from reference.fp import round_to_bfloat16
from reference.gemm import addmm, matmul
from reference.mx import quantize_mxfp8
from reference.norm import rms_norm
from reference.router import route
from reference.schedules.dep import pair_rows
from reference.schedules.groups import Group, run_virtual
from reference.schedules.mailbox import Mailbox, open_mailbox

__all__ = [
    "WIDE_WINDOW",
    "WideScratch",
    "WideTrace",
    "check_wide_ranks",
    "routing_lists",
    "wide_rank",
    "wide_layer_virtual",
]

WIDE_WINDOW = 8
"""Tokens per unit window of the listed engine: every touched expert streams its weights
once per 8 of its tokens."""


def check_wide_ranks(config: LatentMoEConfig, ranks: int) -> None:
    """Raise a ValueError unless ``ranks`` splits the experts, the latent, the hidden
    columns, the shared intermediate and (in MX blocks of 32) the routed intermediate."""
    bad = []
    if ranks < 1:
        bad.append("ranks >= 1")
    else:
        if config.experts % ranks:
            bad.append(f"experts {config.experts} % {ranks}")
        if config.latent % ranks:
            bad.append(f"latent {config.latent} % {ranks}")
        if config.hidden % ranks:
            bad.append(f"hidden {config.hidden} % {ranks}")
        if config.shared_intermediate % ranks:
            bad.append(f"shared_intermediate {config.shared_intermediate} % {ranks}")
        if config.intermediate % (ranks * config.block):
            bad.append(f"intermediate {config.intermediate} % ({ranks} * {config.block})")
    if bad:
        raise ValueError(f"wide layer: {ranks} ranks do not split the layer: " + ", ".join(bad))


class WideScratch:
    """One rank's persistent wide-layer buffers: the Lamport :class:`Mailbox` (rotating
    buffers of ``rows`` rows) shared by every call. Collective to build (every rank of
    ``group`` constructs its own)."""

    def __init__(self, group: Group, config: LatentMoEConfig, rows: int | None = None):
        check_wide_ranks(config, group.size)
        self.config, self.group = config, group
        self.rows = rows or config.wide_rows
        self.mailbox: Mailbox = open_mailbox(group, self.rows, config.latent, config.experts)


def routing_lists(
    ids: torch.Tensor, experts: int, capacity: int, claim_order: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's routing list.

    Args:
        ids: int32 [T, k] routed experts.
        experts: E.
        capacity: entries per list (``wide_rows``); T must not exceed it (an expert appears
            at most once per token).
        claim_order: optional int64 permutation of the ``T*k`` pairs: the order in which
            pairs claim their slots (default: pair order ``t*k + j``, i.e. token order).

    Returns:
        ``lists`` int32 [E, capacity]: pair indices ``t*k + j``; entries at and beyond an
        expert's count are -1 (poison). ``counts`` int32 [E].
    """
    t, k = ids.shape
    if t > capacity:
        raise ValueError(f"routing lists: {t} tokens > capacity {capacity}")
    order = torch.arange(t * k) if claim_order is None else claim_order.to(torch.int64)
    if sorted(order.tolist()) != list(range(t * k)):
        raise ValueError("routing lists: claim_order is not a permutation of the pairs")
    lists = torch.full((experts, capacity), -1, dtype=torch.int32)
    counts = torch.zeros(experts, dtype=torch.int32)
    flat = ids.reshape(-1).to(torch.int64).cpu()
    for pair in order.tolist():
        e = int(flat[pair])
        lists[e, counts[e]] = pair
        counts[e] += 1
    return lists, counts


@dataclass
class WideTrace:
    """Every intermediate of one wide rank's step (``T`` tokens, ``N`` ranks, rank ``r``).

    Attributes:
        rank, ranks, tokens: ``r``, ``N``, ``T``.
        front: FP32 [T, E/N + L/N], this rank's FP32-out GEMM (router rows, latent shard).
        logits: FP32 [T, E] polled from the mailbox (every rank's shard).
        weights: FP32 [T, k]; ids: int32 [T, k] (identical on every rank).
        latent: BF16 [T, L] polled from the mailbox.
        codes: float8_e4m3fn [T, L]; scales: uint8 [T, L/32] (the MXFP8 plan rows).
        lists: int32 [E, capacity] routing lists (-1 tail); counts: int32 [E].
        windows: list of ``(expert, pairs)``, the engine's unit windows in launch order.
        rows: BF16 [T*k, L], this rank's partial expert rows (TP slice of I).
        routed_partial: BF16 [T, L], this rank's Finalize.
        routed: BF16 [T, L] all-reduced; normed: BF16 [T, L].
        shared: BF16 [T, H], this rank's shared partial before the up columns.
        hidden_partial: BF16 [T, H], after the addmm of the up columns.
        out: BF16 [T, H], all-reduced (the same on every rank).
        mailbox_index: which rotating buffer this call used.
    """

    rank: int
    ranks: int
    tokens: int
    front: torch.Tensor
    logits: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    latent: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor
    lists: torch.Tensor
    counts: torch.Tensor
    windows: list
    rows: torch.Tensor
    routed_partial: torch.Tensor
    routed: torch.Tensor
    normed: torch.Tensor
    shared: torch.Tensor
    hidden_partial: torch.Tensor
    out: torch.Tensor
    mailbox_index: int


def wide_rank(
    group: Group,
    x: torch.Tensor,
    weights: LatentMoEWeights,
    config: LatentMoEConfig | None = None,
    *,
    scratch: WideScratch | None = None,
    claim_order: torch.Tensor | None = None,
    timeout: float = 10.0,
) -> WideTrace:
    """One wide rank's MoE layer step (collective: every rank calls it with the same x).

    Args:
        group: the TP group (virtual or torch.distributed).
        x: BF16 [T, H], the same rows on every rank.
        weights: the layer's weights (this rank reads only its slices).
        config: defaults to ``weights.config``.
        scratch: this rank's persistent :class:`WideScratch` (its mailbox rotates per
            call); ``None`` builds one (collective).
        claim_order: permutation of the pairs for the routing lists (see
            :func:`routing_lists`).
        timeout: seconds a mailbox poll may wait before raising.

    Returns:
        A :class:`WideTrace`; ``trace.out`` is BF16 [T, H], the layer output.
    """
    c = config or weights.config
    n, r = group.size, group.rank
    check_wide_ranks(c, n)
    t = x.shape[0]
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != c.hidden:
        raise ValueError(f"rank {r}: x must be BF16 [T, {c.hidden}], got {x.dtype} {tuple(x.shape)}")
    scratch = scratch or WideScratch(group, c)
    box = scratch.mailbox
    e_n, l_n, s_n, h_n, k = c.experts // n, c.latent // n, c.shared_intermediate // n, c.hidden // n, c.top_k
    s = c.shared_intermediate

    # front stream: one FP32-out GEMM over [router rows; latent down shard]
    packed = torch.cat([weights.gate[r * e_n : (r + 1) * e_n], weights.latent_down[r * l_n : (r + 1) * l_n]])
    front = matmul(x, packed, out_dtype=torch.float32)
    # WidePublish: logits FP32 words, latent shard rounded once to BF16, -0 -> +0
    index = box.index
    box.publish(round_to_bfloat16(front[:, e_n:]), front[:, :e_n].contiguous())
    # WideRouteSharded: routing CTAs poll the logits, plan CTAs poll the latent
    logits = box.poll_logits(t, timeout=timeout)
    topw, ids = route(
        logits, weights.bias, top_k=k, renormalize=c.renormalize, scale=c.routed_scaling_factor
    )
    latent = box.poll_latent(t, timeout=timeout)
    box.advance()
    codes, scales = quantize_mxfp8(latent)
    lists, counts = routing_lists(ids, c.experts, scratch.rows, claim_order)

    # the listed engine: touched experts ascending, 8 pairs per window, TP slice of I.
    # The windows are formed from the lists; every windowed pair's row is then computed
    # (one call over all windows: a pair's row depends on that pair alone, so grouping
    # them changes no bit) and written to rows[pair]; a pair no window holds stays NaN.
    rows = torch.full((t * k, c.latent), float("nan"), dtype=torch.bfloat16)
    windows = []
    for e in counts.nonzero().flatten().tolist():
        pairs = lists[e, : counts[e]].to(torch.int64)
        for w0 in range(0, pairs.numel(), WIDE_WINDOW):
            windows.append((e, pairs[w0 : w0 + WIDE_WINDOW]))
    if windows:
        windowed = torch.cat([win for _, win in windows])
        eids = torch.cat([torch.full((win.numel(),), e, dtype=torch.int64) for e, win in windows])
        toks = windowed // k
        rows[windowed] = pair_rows(codes[toks], scales[toks], eids, weights, c, shard=(r, n))
    routed_partial = finalize(rows, topw)

    # shared expert partial (side stream): this rank's S/N slice
    gu = weights.shared_gate_up
    gu_r = torch.cat([gu[r * s_n : (r + 1) * s_n], gu[s + r * s_n : s + (r + 1) * s_n]])
    h = matmul(x, gu_r, out_dtype=torch.bfloat16)
    act = situ_and_mul(h, beta=c.situ_beta, linear_beta=c.situ_linear_beta)
    shared = matmul(act, weights.shared_down[:, r * s_n : (r + 1) * s_n].contiguous(), out_dtype=torch.bfloat16)

    # tail: latent all-reduce + RMSNorm, this rank's up columns, hidden all-reduce
    routed = group.all_reduce_bf16(routed_partial)
    normed = rms_norm(routed, weights.latent_norm, c.rms_eps)
    cols = slice(r * h_n, (r + 1) * h_n)
    hidden = shared.clone()
    hidden[:, cols] = addmm(shared[:, cols].contiguous(), normed, weights.up[cols])
    out = group.all_reduce_bf16(hidden)
    return WideTrace(
        rank=r, ranks=n, tokens=t, front=front, logits=logits, weights=topw, ids=ids,
        latent=latent, codes=codes, scales=scales, lists=lists, counts=counts,
        windows=windows, rows=rows, routed_partial=routed_partial, routed=routed,
        normed=normed, shared=shared, hidden_partial=hidden, out=out, mailbox_index=index,
    )  # fmt: skip


def wide_layer_virtual(
    x: torch.Tensor,
    weights: LatentMoEWeights,
    ranks: int,
    config: LatentMoEConfig | None = None,
    **kwargs,
) -> list[WideTrace]:
    """S2 on ``ranks`` virtual ranks, all holding ``x``. Returns the traces in rank
    order (``trace.out`` is identical on every rank)."""
    check_wide_ranks(config or weights.config, ranks)
    return run_virtual(ranks, lambda g: wide_rank(g, x, weights, config, **kwargs))
