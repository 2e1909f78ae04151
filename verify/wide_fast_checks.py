"""The stage-by-stage checks of the fast S2 layer (``fast.schedules.wide.WideLayer``)
against the reference on each rank's own inputs: the body of ``verify/test_wide_fast.py``'s
contracts (whose module docstring is the table of what is compared), kept apart from the
test module so that a CPU model of the layer can be checked by them too
(``tests/test_wide_fast_contract.py``).

Everything is compared on the CPU (the emulations and oracles run there); ``layer`` is a
``WideLayer`` or any object with the attributes these functions read (``config``,
``ranks``, ``device``, ``max_rows``, ``columns``, ``engines``, ``mailboxes``, the
per-rank weight slices ``front_weights``, ``shared_gate_up``, ``shared_down``, ``up``, and
``bias``, ``latent_norm``; a layer whose ``batch_invariant`` is True also
``rank_resources(r).gemms``, its ``fast.gemm`` GEMMs).

The GEMMs are held to the bound of the backend that ran: cuBLAS (FP32 accumulation in any
order with truncating tensor-core adders, one rounding; its ``addmm`` rounds the product,
then the sum), or, in the batch-invariant mode, ``fast.gemm``:
``verify.bounds.mma_matmul_bound`` at the GEMM's K split (the up columns' addend added
before the one rounding) and bitwise equal to the same ``DenseGemm`` run alone on the same
operands (the kernel really ran, and the layer's streams and buffers moved no bit).
"""

from __future__ import annotations

import dataclasses

import torch

from reference import emulation
from reference.finalize import finalize
from reference.fp import round_to_bfloat16
from reference.mx import quantize_mxfp8
from reference.schedules.groups import ordered_sum_bf16
from reference.schedules.mailbox import SENTINEL_BF16, SENTINEL_F32, sanitize_negative_zero
from reference.schedules.wide import routing_lists
from verify import bounds

__all__ = ["ROWS", "GEMM_BOUND", "MMA_BOUND", "published_words", "check_armed",
           "check_wide_fast", "rank_gemms"]

ROWS = ("token", "column")
GEMM_BOUND = bounds.ANY_ORDER_GEMM_BOUND
#: cuBLAS ran on the GPU: truncating tensor-core adders
CUBLAS = dict(accum_rounding=bounds.gemm_accum_rounding("cuda"))
MMA_BOUND = ("verify.bounds.mma_matmul_bound: gamma_{c+c/16+splits-1(+1)}(2^-23) sum|a w| "
             "(+|addend|) (+ BF16 half-ULP): fast.gemm's tensor-core split-K order")


def _gemm(contract, got, a, b, out_dtype, what, fast=None, addend=None):
    """One GEMM of one rank (CPU copies ``got``, operands ``a [T, K]``, ``b [N, K]``,
    optional BF16 ``addend [T, N]``): on cuBLAS (``fast`` None) within its bound; on
    ``fast.gemm`` (``fast``: the rank's ``DenseGemm``) within ``mma_matmul_bound`` at its K
    split and bitwise equal to it run alone on the same operands."""
    if fast is not None:
        ref, bound = bounds.mma_matmul_bound(a, b, splits=fast.splits, addend=addend,
                                             out_dtype=out_dtype)
        label = fast.launch(a.shape[0]).tactic.label()
        contract.bounded(got, ref, bound, what=f"{what} (fast.gemm {label})",
                         bound_name=MMA_BOUND, index_names=ROWS)
        on = fast.device
        alone = fast(a.contiguous().to(on), out_dtype=out_dtype,
                     addend=None if addend is None else addend.contiguous().to(on))
        contract.bitwise(got, alone.cpu(), what=f"{what} = fast.gemm alone on the same operands",
                         index_names=ROWS)
        return
    if addend is not None:  # cuBLAS addmm: the product rounded to BF16, then the sum
        exact = bounds.reference_matmul(a, b) + addend.double()
        product = bounds.matmul_bf16_out_bound(a, b, **CUBLAS)
        contract.bounded(got, exact, bounds.final_rounding_bound(exact, product, torch.bfloat16),
                         what=what, index_names=ROWS,
                         bound_name=GEMM_BOUND + ", then the BF16 add (cuBLAS addmm rounds twice)")
        return
    make = bounds.matmul_fp32_out_bound if out_dtype == torch.float32 else \
        bounds.matmul_bf16_out_bound
    contract.bounded(got, bounds.reference_matmul(a, b), make(a, b, **CUBLAS), what=what,
                     bound_name=GEMM_BOUND, index_names=ROWS)


def rank_gemms(layer, r: int) -> dict:
    """Rank ``r``'s ``fast.gemm`` GEMMs by name when ``layer`` runs the batch-invariant
    mode, else an empty dict (every GEMM on cuBLAS)."""
    if not getattr(layer, "batch_invariant", False):
        return {}
    return layer.rank_resources(r).gemms


def _on_cpu(outs):
    return [dataclasses.replace(o, **{f.name: getattr(o, f.name).cpu()
                                      for f in dataclasses.fields(o)
                                      if isinstance(getattr(o, f.name), torch.Tensor)})
            for o in outs]


def published_words(layer, fronts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """What every mailbox must hold after every rank published its own ``fronts[o]`` (FP32
    ``[T, E/N + L/N]``, CPU): (latent int16 ``[T, L]``, logits int32 ``[T, E]``), each
    writer's shard in its columns, rounded and sanitized as
    ``reference.schedules.mailbox.Mailbox.publish`` does."""
    e_n = layer.config.experts // layer.ranks
    latent = torch.cat([round_to_bfloat16(f[:, e_n:].contiguous()).view(torch.int16)
                        for f in fronts], 1)
    logits = torch.cat([f[:, :e_n].contiguous().view(torch.int32) for f in fronts], 1)
    return sanitize_negative_zero(latent), sanitize_negative_zero(logits)


def check_armed(contract, layer, what: str) -> None:
    """Every word of both buffers of every rank's mailbox holds its region's sentinel."""
    lat = layer.config.latent
    for r, box in enumerate(layer.mailboxes):
        box = box.cpu()
        contract.bitwise(box[..., :lat], torch.full_like(box[..., :lat], SENTINEL_BF16),
                         what=f"{what}: rank {r} latent words armed",
                         index_names=("buffer", "row", "column"))
        words = box[..., lat:].contiguous().view(torch.int32)
        contract.bitwise(words, torch.full_like(words, SENTINEL_F32),
                         what=f"{what}: rank {r} logit words armed",
                         index_names=("buffer", "row", "word"))


def check_wide_fast(contract, layer, outs, xs) -> None:
    """Every stage of one fast S2 call on every rank (the module docstring's table),
    compared on the CPU (the emulations and oracles run there)."""
    c, n = layer.config, layer.ranks
    if isinstance(xs, torch.Tensor):
        xs = [xs] * n
    tokens, k = xs[0].shape[0], c.top_k
    # CPU copies first (the lists are the engines' buffers), then the engines alone on
    # each rank's own plan rows (on the GPU)
    outs = _on_cpu(outs)
    dev = layer.device
    alone = [engine(o.codes.to(dev), o.scales.to(dev), o.ids.to(dev)).cpu()
             for engine, o in zip(layer.engines, outs)]
    xs = [x.cpu() for x in xs]
    bias, latent_norm = layer.bias.cpu(), layer.latent_norm.cpu()
    want_latent, want_logits = published_words(layer, [o.front for o in outs])
    gemms = [rank_gemms(layer, r) for r in range(n)]
    for r, (o, x) in enumerate(zip(outs, xs)):
        _gemm(contract, o.front, x, layer.front_weights[r].cpu(), torch.float32,
              f"rank {r} front (router rows, latent shard)", gemms[r].get("front"))
        contract.bitwise(o.logits.view(torch.int32), want_logits,
                         what=f"rank {r} polled logits = every writer's front (bits)",
                         index_names=ROWS)
        contract.bitwise(o.latent.view(torch.int16), want_latent,
                         what=f"rank {r} polled latent = every writer's bf16(front)",
                         index_names=ROWS)
        emu_w, emu_ids = emulation.route(o.logits, bias, top_k=k, renormalize=c.renormalize,
                                         scale=c.routed_scaling_factor)
        contract.bitwise(o.ids, emu_ids, what=f"rank {r} ids = route(own polled logits)")
        contract.bitwise(o.weights, emu_w, what=f"rank {r} weights = route(own polled logits)")
        codes, scales = quantize_mxfp8(o.latent)
        contract.bitwise(o.codes.view(torch.uint8), codes.view(torch.uint8),
                         what=f"rank {r} plan codes", index_names=ROWS)
        contract.bitwise(o.scales, scales, what=f"rank {r} plan scales", index_names=ROWS)

        got_lists, got_counts = o.lists, o.counts
        want_lists, want_counts = routing_lists(o.ids, c.experts, layer.max_rows)
        contract.bitwise(got_counts, want_counts, what=f"rank {r} routing-list counts")
        contract.bitwise(_canonical_lists(got_lists, got_counts),
                         _canonical_lists(want_lists, want_counts),
                         what=f"rank {r} routing lists (each sorted)",
                         index_names=("expert", "slot"))

        contract.bitwise(o.rows, alone[r], what=f"rank {r} expert rows = engine alone",
                         index_names=("pair", "column"))
        contract.bitwise(o.routed_partial, finalize(o.rows, o.weights),
                         what=f"rank {r} Finalize of own rows", index_names=ROWS)

        _gemm(contract, o.shared_gate_up, x, layer.shared_gate_up[r].cpu(), torch.bfloat16,
              f"rank {r} shared gate/up slice", gemms[r].get("shared_gate_up"))
        act = emulation.situ_and_mul(o.shared_gate_up, beta=c.situ_beta,
                                     linear_beta=c.situ_linear_beta)
        contract.bitwise(o.shared_act, act, what=f"rank {r} shared SiTU", index_names=ROWS)
        _gemm(contract, o.shared, o.shared_act, layer.shared_down[r].cpu(), torch.bfloat16,
              f"rank {r} shared partial", gemms[r].get("shared_down"))

    routed = ordered_sum_bf16([o.routed_partial for o in outs])
    hidden = []
    for r, o in enumerate(outs):
        contract.bitwise(o.routed, routed, what=f"rank {r} latent all-reduce (rank order)",
                         index_names=ROWS)
        contract.bitwise(o.normed, emulation.rms_norm_tree(o.routed, latent_norm, c.rms_eps),
                         what=f"rank {r} normed", index_names=ROWS)
        cols = slice(r * layer.columns, (r + 1) * layer.columns)
        own = o.shared[:, cols]
        _gemm(contract, o.up_columns, o.normed, layer.up[r].cpu(), torch.bfloat16,
              f"rank {r} up columns = shared[:, cols] + normed @ up_r^T", gemms[r].get("up"),
              addend=own)
        partial = o.shared.clone()
        partial[:, cols] = o.up_columns
        hidden.append(partial)
    out = ordered_sum_bf16(hidden)
    for r, o in enumerate(outs):
        contract.bitwise(o.out, out, what=f"rank {r} hidden all-reduce (rank order)",
                         index_names=ROWS)


def _canonical_lists(lists: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Each expert's listed pairs sorted ascending, the slots at and beyond its count
    (poison in the reference, stale in the engine) set to -1."""
    filled = torch.arange(lists.shape[1])[None, :] < counts.long()[:, None]
    big = torch.iinfo(torch.int32).max
    ordered = torch.where(filled, lists, torch.full_like(lists, big)).sort(dim=1).values
    return torch.where(ordered == big, torch.full_like(ordered, -1), ordered)
