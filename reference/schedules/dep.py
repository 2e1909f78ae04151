"""S1, the DEP layer (attention TP1, experts EP over all ranks): a per-rank emulation.

Every rank ``r`` of ``N`` holds its own batch ``x_r [T, H]`` BF16 (every rank runs the same
``T``: vLLM pads the DP ranks to one batch), every dense weight (replicated), and the
routed experts ``[r*E/N, (r+1)*E/N)`` (the experts it *owns*). One call of
:func:`dep_rank` on every rank of a :class:`~reference.schedules.groups.Group` is one MoE
layer step.

Streams of one rank for ``T <= config.front_max`` (what runs beside what)::

    main : front = x @ [shared gate_up | latent down]^T (split-K, BF16) ──┐
    side : logits = x @ gate^T (split-K, FP32) ; top-16 ──────────────────┼─┐
    side :                                  act = SiTU(front[:, :2S]) ; shared = act @ down^T
    main :   MXFP8(latent) ─ dispatch ─ experts (owner) ─ partial finalize ─ combine + RMSNorm
    main :                                            out = shared + normed @ up^T (addmm)

The side stream's work is data-independent of the main stream's beyond the events drawn
above, so its timing never changes a bit; the emulation runs the stages in program order.

Rounding points, in order (each is one call of a reference stage):

1. ``front = gemm(x, W_front, splits=front_splits) -> BF16`` (split 1: the plain
   FP32-accumulated GEMM, one rounding, :func:`reference.gemm.matmul`; split s > 1:
   FP32 partials summed in split order, :func:`reference.gemm.split_k_matmul`).
2. ``logits = gemm(x, gate, splits=router_splits) -> FP32``; ``weights, ids = route(...)``.
3. ``shared = gemm(situ_and_mul(front[:, :2S]), shared_down, splits=front_splits) -> BF16``
   (the shared down-projection uses the front's tactic).
4. ``codes, scales = quantize_mxfp8(front[:, 2S:])`` on the home rank.
5. Dispatch (data movement): for each owner ``o``, the tokens with at least one of their
   16 experts in ``o``'s range: codes, scales, the full ``ids`` and ``weights`` rows.
   The owner's receive buffer has ``N * T`` rows (source-major, row ``s*T + t``); rows no
   token was sent to are poisoned (codes NaN 0x7F, scales 0xFF, ids -1, weights NaN).
6. Owner experts: ``expert_rows_mxfp8`` over the received rows that hold a local expert
   (one BF16 row per pair, FP32 accumulation inside; a non-local slot is computed with
   the row's first local expert and discarded); non-local pairs stay poisoned (NaN).
7. Owner partial finalize (trtllm-gen's ``do_finalize`` over its receive rows): for each
   received token, ``acc = 0; acc = fma(w[j], row[j], acc)`` for the *local* ``j`` in
   increasing ``j`` (FP32), one BF16 rounding -> partial.
8. Combine on the home rank: the partials of the owners that hold at least one of the
   token's experts, in increasing owner rank: ``acc = f32(first); acc += f32(next)``,
   one BF16 rounding -> ``routed``.
9. ``normed = rms_norm(routed)`` (fused into the combine; the same math as
   :func:`reference.norm.rms_norm`).
10. ``out = addmm(shared, normed, up)`` (one BF16 rounding).

``T > config.front_max`` runs the stock path: the same sequence with unsplit GEMMs
(``front_splits = router_splits = 1``) — the routed part still goes through the EP
dispatch/experts/combine (the stock path calls the same routed kernels).

Bitwise vs S0 (:func:`reference.layer.stock_order_trace`), for one rank's tokens:

| stage | N = 1, splits 1 | N = 1, default splits | N > 1, splits 1 | N > 1, default |
|---|---|---|---|---|
| front, shared, latent, codes | bitwise | bitwise (front split 1) | bitwise | bitwise |
| logits | bitwise | bounded (router split-K) | bitwise | bounded |
| ids, weights | bitwise | flips only inside the logits bound | bitwise | same as N = 1 |
| expert rows (per pair) | bitwise | bitwise on own routing | bitwise | bitwise on own routing |
| routed (combine) | bitwise | bitwise on own routing | bounded (finalize split by owner) | bounded |
| normed, out | bitwise | bitwise on own routed | bitwise on own routed | bitwise on own routed |

At ``N = 1`` the one owner's partial finalize is the full FMA chain and the combine of one
partial is the identity, so S1 with splits 1 is S0 bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from model.config import LatentMoEConfig
from model.weights import LatentMoEWeights
from reference.activation import situ_and_mul
from reference.experts import pair_rows_fp32
from reference.fp import fma_f32
from reference.gemm import addmm, matmul, split_k_matmul
from reference.mx import dequantize_mxfp8, quantize_mxfp8
from reference.norm import rms_norm
from reference.router import route
from reference.schedules.groups import Group, run_virtual

__all__ = [
    "DepTrace",
    "dep_rank",
    "dep_layer_virtual",
    "dep_tactics",
    "projection",
    "local_finalize",
    "pair_rows",
    "ordered_combine",
    "POISON_CODE",
    "POISON_SCALE",
]

POISON_CODE = 0x7F
"""E4M3 NaN byte: the codes of receive rows no token was sent to."""
POISON_SCALE = 0xFF
"""E8M0 NaN byte: the scales of empty receive rows."""


def dep_tactics(tokens: int) -> dict[str, int]:
    """The default split-K tactics at ``tokens`` rows (``tokens <= front_max``): the front
    (and the shared down-projection) with one K split; the FP32 router with 4 splits up to
    32 tokens, else 2."""
    return {"front_splits": 1, "router_splits": 4 if tokens <= 32 else 2}


def projection(a: torch.Tensor, b: torch.Tensor, *, splits: int, out_dtype) -> torch.Tensor:
    """``a [M, K] @ b [N, K]^T`` under a split-K tactic: ``splits == 1`` is the plain
    FP32-accumulated GEMM (:func:`reference.gemm.matmul`, one rounding to ``out_dtype``);
    ``splits > 1`` rounds each split's partial to FP32 and adds them in split order
    (:func:`reference.gemm.split_k_matmul`), then rounds to ``out_dtype``."""
    if splits == 1:
        return matmul(a, b, out_dtype=out_dtype)
    return split_k_matmul(a, b, splits=splits, out_dtype=out_dtype)


def pair_rows(
    codes: torch.Tensor,
    scales: torch.Tensor,
    experts: torch.Tensor,
    weights: LatentMoEWeights,
    config: LatentMoEConfig,
    *,
    shard: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The expert row of each (latent row, expert) pair: what a grouped-GEMM engine
    computes for a list of pairs (the wide layer's listed engine, one window at a time).

    Args:
        codes: float8_e4m3fn [P, L] and scales uint8 [P, L/32]: pair p's MXFP8 latent row.
        experts: int [P], pair p's expert.
        shard: None or ``(rank, ranks)`` (TP slice of the intermediate).

    Returns:
        BF16 [P, L]: row p = :func:`reference.experts.pair_rows_fp32` of expert
        ``experts[p]`` on latent row p (the per-pair core of
        :func:`reference.experts.expert_rows_mxfp8`): every row depends on its (row,
        expert) alone, so the bits are those of the pair inside any batch.
    """
    if codes.shape[0] == 0:
        return torch.empty(0, config.latent, dtype=torch.bfloat16, device=codes.device)
    return pair_rows_fp32(dequantize_mxfp8(codes, scales), experts.to(torch.int64), weights,
                          config, shard=shard)


def local_finalize(rows: torch.Tensor, weights: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """An owner's partial finalize of its receive rows.

    Args:
        rows: BF16 [R, k, L], the expert row of each (receive row, slot) pair; entries of
            non-local slots may hold anything (poison): they are never read.
        weights: FP32 [R, k] routing weights.
        local: bool [R, k], which slots this owner computed.

    Returns:
        BF16 [R, L]: ``acc = +0; acc = fma_f32(w[j], f32(rows[j]), acc)`` for the local
        ``j`` in increasing order, one BF16 rounding (a row with no local slot gives +0).
    """
    r, k, width = rows.shape
    acc = torch.zeros(r, width, dtype=torch.float32, device=rows.device)
    for j in range(k):
        w = weights[:, j : j + 1].to(torch.float32)
        step = fma_f32(w.expand(r, width), rows[:, j].to(torch.float32), acc)
        acc = torch.where(local[:, j : j + 1], step, acc)
    return acc.to(torch.bfloat16)


def ordered_combine(
    parts: list[torch.Tensor], present: list[torch.Tensor]
) -> torch.Tensor:
    """The home rank's combine of its owners' partials.

    Args:
        parts: per owner ``o`` (increasing), BF16 [T, L] (rows the owner did not send are
            ignored, whatever they hold).
        present: per owner, bool [T]: whether ``o`` holds at least one of the token's
            experts (and so sent a partial).

    Returns:
        BF16 [T, L]: per token, ``acc = f32(first present partial)``, then ``acc = acc +
        f32(partial)`` for each later present owner (one FP32 rounding each), one BF16
        rounding. A token with no owner raises (every token has top_k >= 1 experts).
    """
    t, width = parts[0].shape
    acc = torch.zeros(t, width, dtype=torch.float32, device=parts[0].device)
    seen = torch.zeros(t, dtype=torch.bool, device=parts[0].device)
    for p, m in zip(parts, present):
        v = p.to(torch.float32)
        acc = torch.where(m[:, None], torch.where(seen[:, None], acc + v, v), acc)
        seen = seen | m
    if not bool(seen.all()):
        missing = (~seen).nonzero().flatten().tolist()
        raise RuntimeError(f"combine: tokens {missing[:8]} received no partial")
    return acc.to(torch.bfloat16)


@dataclass
class DepTrace:
    """Every intermediate of one DEP rank's step (shapes for ``T`` tokens, ``N`` ranks).

    Attributes:
        rank, ranks, tokens: this rank, the group size, ``T``.
        path: ``"front"`` (split-K front, ``T <= front_max``) or ``"stock"``.
        front_splits, router_splits: the tactics used.
        logits: FP32 [T, E]; weights FP32 [T, k]; ids int32 [T, k] (this rank's tokens).
        front: BF16 [T, 2S + L]; shared BF16 [T, H]; latent BF16 [T, L].
        codes: float8_e4m3fn [T, L]; scales uint8 [T, L/32] (MXFP8 of the latent).
        sent: per owner, int64 [n_o]: this rank's tokens dispatched to that owner.
        recv_codes, recv_scales, recv_ids, recv_weights: this rank's receive buffer as an
            owner, [N*T, ...] rows (row ``s*T + t`` = source ``s``'s token ``t``), empty
            rows poisoned; recv_valid bool [N*T].
        rows: BF16 [N*T, k, L]: the expert row of each local received pair, NaN elsewhere.
        partials: BF16 [N*T, L]: the owner's partial finalize per received row, NaN for
            empty rows.
        combined: BF16 [T, L] (the routed latent); normed BF16 [T, L]; out BF16 [T, H].
    """

    rank: int
    ranks: int
    tokens: int
    path: str
    front_splits: int
    router_splits: int
    logits: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    front: torch.Tensor
    shared: torch.Tensor
    latent: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor
    sent: list[torch.Tensor] = field(default_factory=list)
    recv_codes: torch.Tensor | None = None
    recv_scales: torch.Tensor | None = None
    recv_ids: torch.Tensor | None = None
    recv_weights: torch.Tensor | None = None
    recv_valid: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    partials: torch.Tensor | None = None
    combined: torch.Tensor | None = None
    normed: torch.Tensor | None = None
    out: torch.Tensor | None = None


def _check_group(config: LatentMoEConfig, ranks: int) -> None:
    if ranks < 1 or config.experts % ranks:
        raise ValueError(
            f"DEP: {config.experts} experts do not divide over {ranks} ranks "
            f"(each rank owns E/N experts)"
        )


def dep_rank(
    group: Group,
    x: torch.Tensor,
    weights: LatentMoEWeights,
    config: LatentMoEConfig | None = None,
    *,
    front_splits: int | None = None,
    router_splits: int | None = None,
) -> DepTrace:
    """One DEP rank's MoE layer step (collective: every rank of ``group`` calls it with
    the same ``T``).

    Args:
        group: the EP group (virtual or torch.distributed).
        x: BF16 [T, H], this rank's tokens.
        weights: the layer's weights (this rank reads only its own experts' w13/w2).
        config: defaults to ``weights.config``.
        front_splits: split-K tactic of the front and the shared down-projection;
            ``None`` = the default (:func:`dep_tactics`). Ignored (1) when ``T > front_max``.
        router_splits: split-K tactic of the FP32 router GEMM; ``None`` = the default.
            Ignored (1) when ``T > front_max``.

    Returns:
        A :class:`DepTrace`; ``trace.out`` is BF16 [T, H], this rank's layer output.
    """
    c = config or weights.config
    n, r = group.size, group.rank
    _check_group(c, n)
    t = x.shape[0]
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != c.hidden:
        raise ValueError(f"rank {r}: x must be BF16 [T, {c.hidden}], got {x.dtype} {tuple(x.shape)}")
    gathered_t = [int(v) for v in group.all_gather(torch.tensor([t]))]
    if len(set(gathered_t)) != 1:
        raise ValueError(f"rank {r}: DEP ranks must run one padded T, got {gathered_t}")
    if t <= c.front_max:
        path, tactic = "front", dep_tactics(t)
        fs = tactic["front_splits"] if front_splits is None else front_splits
        rs = tactic["router_splits"] if router_splits is None else router_splits
    else:
        path, fs, rs = "stock", 1, 1
    s2 = 2 * c.shared_intermediate

    # side stream: FP32 router logits (split-K) and top-k
    logits = projection(x, weights.gate, splits=rs, out_dtype=torch.float32)
    topw, ids = route(
        logits, weights.bias, top_k=c.top_k, renormalize=c.renormalize,
        scale=c.routed_scaling_factor,
    )  # fmt: skip
    # main stream: the packed front; side stream: shared SiTU + down
    front = projection(x, weights.front, splits=fs, out_dtype=torch.bfloat16)
    act = situ_and_mul(front[:, :s2], beta=c.situ_beta, linear_beta=c.situ_linear_beta)
    shared = projection(act, weights.shared_down, splits=fs, out_dtype=torch.bfloat16)
    latent = front[:, s2:].contiguous()
    codes, scales = quantize_mxfp8(latent)

    trace = DepTrace(
        rank=r, ranks=n, tokens=t, path=path, front_splits=fs, router_splits=rs,
        logits=logits, weights=topw, ids=ids, front=front, shared=shared, latent=latent,
        codes=codes, scales=scales,
    )  # fmt: skip
    routed = _routed(group, trace, weights, c)
    trace.combined = routed
    trace.normed = rms_norm(routed, weights.latent_norm, c.rms_eps)
    trace.out = addmm(shared, trace.normed, weights.up)
    return trace


def _routed(group: Group, tr: DepTrace, weights: LatentMoEWeights, c: LatentMoEConfig) -> torch.Tensor:
    """Dispatch -> owner experts -> partial finalize -> combine (steps 5-8)."""
    n, r, t, k = group.size, group.rank, tr.tokens, c.top_k
    per = c.experts // n
    owner = tr.ids.to(torch.int64) // per  # [T, k] owner rank of each pair

    # dispatch: every token to each owner that holds one of its experts
    sent = [(owner == o).any(dim=1).nonzero().flatten() for o in range(n)]
    tr.sent = sent
    recv_tok = group.all_to_all(sent)
    recv_codes = group.all_to_all([tr.codes[s].view(torch.uint8) for s in sent])
    recv_scales = group.all_to_all([tr.scales[s] for s in sent])
    recv_ids = group.all_to_all([tr.ids[s] for s in sent])
    recv_w = group.all_to_all([tr.weights[s] for s in sent])

    # the owner's receive buffer: N*T rows, source-major, empty rows poisoned
    rows_n = n * t
    dev = tr.codes.device
    bc = torch.full((rows_n, c.latent), POISON_CODE, dtype=torch.uint8, device=dev)
    bs = torch.full((rows_n, c.latent // c.block), POISON_SCALE, dtype=torch.uint8, device=dev)
    bi = torch.full((rows_n, k), -1, dtype=torch.int32, device=dev)
    bw = torch.full((rows_n, k), float("nan"), dtype=torch.float32, device=dev)
    valid = torch.zeros(rows_n, dtype=torch.bool, device=dev)
    for s in range(n):
        at = s * t + recv_tok[s].to(dev)
        bc[at], bs[at], bi[at], bw[at] = recv_codes[s], recv_scales[s], recv_ids[s], recv_w[s]
        valid[at] = True
    tr.recv_codes, tr.recv_scales = bc.view(torch.float8_e4m3fn), bs
    tr.recv_ids, tr.recv_weights, tr.recv_valid = bi, bw, valid

    # owner experts over the local pairs of the received rows
    lo, hi = r * per, (r + 1) * per
    local = valid[:, None] & (bi >= lo) & (bi < hi)  # [N*T, k]
    rows = torch.full((rows_n, k, c.latent), float("nan"), dtype=torch.bfloat16, device=dev)
    row_i, slot = local.nonzero(as_tuple=True)  # the owner's local (receive row, slot) pairs
    if row_i.numel():
        # only its own experts' weights are read; each pair's row depends on that pair alone
        rows[row_i, slot] = pair_rows(tr.recv_codes[row_i], bs[row_i], bi[row_i, slot],
                                      weights, c)
    tr.rows = rows

    partial = local_finalize(rows, bw, local)
    partial[~valid] = float("nan")
    tr.partials = partial

    # combine: each owner returns the partials of the tokens a source sent it
    back = group.all_to_all([partial[s * t + recv_tok[s].to(dev)] for s in range(n)])
    parts, present = [], []
    for o in range(n):
        full = torch.full((t, c.latent), float("nan"), dtype=torch.bfloat16, device=dev)
        full[sent[o]] = back[o]
        mask = torch.zeros(t, dtype=torch.bool, device=dev)
        mask[sent[o]] = True
        parts.append(full)
        present.append(mask)
    return ordered_combine(parts, present)


def dep_layer_virtual(
    xs: list[torch.Tensor],
    weights: LatentMoEWeights,
    config: LatentMoEConfig | None = None,
    **tactics,
) -> list[DepTrace]:
    """S1 on ``len(xs)`` virtual ranks: rank ``r`` runs :func:`dep_rank` on ``xs[r]``.
    Returns the traces in rank order."""
    return run_virtual(len(xs), lambda g: dep_rank(g, xs[g.rank], weights, config, **tactics))
