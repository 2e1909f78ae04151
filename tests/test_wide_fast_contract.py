"""The fast wide layer's contract (``verify/test_wide_fast.py``, its checks in
``verify/wide_fast_checks.py``) checked on the CPU before it
meets a GPU: fed the outputs of a CPU model of ``fast.schedules.wide.WideLayer`` built from
the reference stages (what the layer must produce, in its output format: the engine's
routing lists in a shuffled claim order with stale tails, the rows of the reference engine,
the mailboxes re-armed), ``check_wide_fast`` and ``check_armed`` pass; each planted bug of
the classes the contract exists for makes them fail with the comparator's report."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from fast import backend
from reference.activation import situ_and_mul
from reference.emulation import rms_norm_tree, route
from reference.experts import expert_rows_mxfp8
from reference.finalize import finalize
from reference.gemm import addmm, matmul
from reference.mx import quantize_mxfp8
from reference.schedules.groups import ordered_sum_bf16
from reference.schedules.mailbox import SENTINEL_BF16, SENTINEL_F32
from reference.schedules.wide import routing_lists
from verify import cases
from verify.recorder import Recorder
from verify.report import Row

_cute_error = backend.cute_import_error()
pytestmark = pytest.mark.skipif(_cute_error is not None,
                                reason=f"CuTe DSL not importable (fast.schedules.wide imports "
                                       f"it): {_cute_error}")


class CpuWideModel:
    """The attributes ``check_wide_fast`` reads from a ``WideLayer``, and its call, computed
    by the reference stages on the CPU for ``ranks`` virtual ranks (the rounding points of
    ``reference.schedules.wide``, with the fast layer's router and RMSNorm emulations)."""

    def __init__(self, weights, ranks: int, max_rows: int, claim_seed: int = 0):
        c = weights.config
        n = ranks
        e_n, l_n, s_n, h_n = c.experts // n, c.latent // n, c.shared_intermediate // n, c.hidden // n
        s, gu = c.shared_intermediate, weights.shared_gate_up
        self.config, self.ranks, self.max_rows, self.device = c, n, max_rows, torch.device("cpu")
        self.weights, self.columns, self.claim_seed = weights, h_n, claim_seed
        self.front_weights = [torch.cat([weights.gate[r * e_n:(r + 1) * e_n],
                                         weights.latent_down[r * l_n:(r + 1) * l_n]])
                              for r in range(n)]
        self.shared_gate_up = [torch.cat([gu[r * s_n:(r + 1) * s_n],
                                          gu[s + r * s_n:s + (r + 1) * s_n]]) for r in range(n)]
        self.shared_down = [weights.shared_down[:, r * s_n:(r + 1) * s_n].contiguous()
                            for r in range(n)]
        self.up = [weights.up[r * h_n:(r + 1) * h_n] for r in range(n)]
        self.bias, self.latent_norm = weights.bias, weights.latent_norm
        self.engines = [functools.partial(self._engine, r) for r in range(n)]
        self._last = {}
        self.mailboxes = []
        for _ in range(n):
            box = torch.empty(2, max_rows, c.latent + 2 * c.experts, dtype=torch.int16)
            box[..., :c.latent] = SENTINEL_BF16
            box[..., c.latent:].view(torch.int32)[:] = SENTINEL_F32
            self.mailboxes.append(box)

    def _engine(self, r, codes, scales, ids):
        """The reference rows of this rank's TP slice; the last call's rows are reused for
        the same plan rows (the contract runs the engine alone on them once more)."""
        last = self._last.get(r)
        if last is not None and all(_same_bytes(a, b) for a, b in zip(last[0], (codes, scales, ids))):
            return last[1].clone()
        rows = expert_rows_mxfp8(codes, scales, ids, self.weights, self.config, shard=(r, self.ranks))
        self._last[r] = ((codes.clone(), scales.clone(), ids.clone()), rows.clone())
        return rows

    def __call__(self, x):
        from fast.schedules.wide import WideRankOutputs

        c, n, w = self.config, self.ranks, self.weights
        e_n, k, t = c.experts // n, c.top_k, x.shape[0]
        fronts = [matmul(x, fw, out_dtype=torch.float32) for fw in self.front_weights]
        logits = torch.cat([f[:, :e_n] for f in fronts], 1)
        latent = torch.cat([f[:, e_n:] for f in fronts], 1).bfloat16()
        logits = torch.where(logits == 0, torch.zeros_like(logits), logits)  # -0 -> +0
        latent = torch.where(latent == 0, torch.zeros_like(latent), latent)
        weights, ids = route(logits, self.bias, top_k=k, renormalize=c.renormalize,
                             scale=c.routed_scaling_factor)
        codes, scales = quantize_mxfp8(latent)
        g = torch.Generator().manual_seed(self.claim_seed)
        lists, counts = routing_lists(ids, c.experts, self.max_rows,
                                      claim_order=torch.randperm(t * k, generator=g))
        stale = torch.randint(0, t * k, lists.shape, generator=g, dtype=torch.int32)
        lists = torch.where(lists < 0, stale, lists)  # the engine leaves old entries there
        outs = []
        for r in range(n):
            rows = self._engine(r, codes, scales, ids)
            h = matmul(x, self.shared_gate_up[r], out_dtype=torch.bfloat16)
            act = situ_and_mul(h, beta=c.situ_beta, linear_beta=c.situ_linear_beta)
            outs.append(dict(front=fronts[r], rows=rows, partial=finalize(rows, weights),
                             h=h, act=act,
                             shared=matmul(act, self.shared_down[r], out_dtype=torch.bfloat16)))
        routed = ordered_sum_bf16([o["partial"] for o in outs])
        normed = rms_norm_tree(routed, self.latent_norm, c.rms_eps)
        hidden = []
        for r, o in enumerate(outs):
            cols = slice(r * self.columns, (r + 1) * self.columns)
            o["up"] = addmm(o["shared"][:, cols].contiguous(), normed, self.up[r])
            part = o["shared"].clone()
            part[:, cols] = o["up"]
            hidden.append(part)
        out = ordered_sum_bf16(hidden)
        return [WideRankOutputs(
            front=o["front"], logits=logits, latent=latent, weights=weights, ids=ids,
            codes=codes, scales=scales, lists=lists.clone(), counts=counts.clone(),
            rows=o["rows"], routed_partial=o["partial"], routed=routed.clone(),
            normed=normed.clone(), shared_gate_up=o["h"], shared_act=o["act"],
            shared=o["shared"], up_columns=o["up"], out=out.clone(), mailbox_index=0)
            for o in outs]


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _recorder():
    return Recorder(Row(contract="wide_fast_cpu_model", backend="cpu-model", config="small"))


@functools.cache
def _case(ranks: int, tokens: int = 65):
    w = cases.weights("small")
    model = CpuWideModel(w, ranks, 80)
    x = cases.hidden_rows(w.config, tokens, 5)
    return model, x, model(x)


@pytest.mark.parametrize("ranks", (1, 2, 4))
def test_contract_accepts_the_cpu_model(ranks):
    from verify.wide_fast_checks import check_armed, check_wide_fast

    model, x, outs = _case(ranks)
    check_wide_fast(_recorder(), model, outs, x)
    check_armed(_recorder(), model, "cpu model")


def _mutated(outs, rank, **fields):
    outs = [dataclasses.replace(o) for o in outs]
    outs[rank] = dataclasses.replace(outs[rank], **fields)
    return outs


PLANTED = {
    # a writer without the -0 sanitize: a polled latent word is the sentinel
    "latent -0 not sanitized": lambda o: _mutated(o, 1, latent=_flip_zero_sign(o[1].latent)),
    # the latent all-reduce without the last rank's partial (the order of the FP32 sum is
    # not a planted bug here: BF16 partials of a few ranks add exactly in FP32 in any order)
    "latent all-reduce missing a rank": lambda o: _mutated(
        o, 0, routed=ordered_sum_bf16([p.routed_partial for p in o[:-1]])),
    # the hidden all-reduce takes the up columns from every rank, not only their owner's
    "up columns added on every rank": lambda o: _mutated(o, 0, out=_up_on_every_rank(o)),
    # a routing list one pair short
    "routing list one pair short": lambda o: _mutated(o, 1, counts=_one_short(o[1].counts)),
    # a pair's expert row left from another pair
    "expert row of another pair": lambda o: _mutated(o, 1, rows=_swap_rows(o[1].rows)),
    # routing weights of other tokens (a stale or misaligned router output)
    "weights of other tokens": lambda o: _mutated(o, 0, weights=o[0].weights.roll(1, 0)),
}


def _flip_zero_sign(latent):
    bits = latent.view(torch.int16).clone()
    zero = (bits == 0).nonzero()
    if zero.numel() == 0:  # make one: the model's latent has no exact zero in this case
        bits[3, 7] = SENTINEL_BF16
    else:
        bits[tuple(zero[0])] = SENTINEL_BF16
    return bits.view(torch.bfloat16)


def _up_on_every_rank(outs):
    columns = outs[0].up_columns.shape[1]
    parts = []
    for o in outs:
        part = o.shared.clone()
        for q, owner in enumerate(outs):
            part[:, q * columns:(q + 1) * columns] = owner.up_columns
        parts.append(part)
    return ordered_sum_bf16(parts)


def _one_short(counts):
    counts = counts.clone()
    e = int(counts.argmax())
    counts[e] -= 1
    return counts


def _swap_rows(rows):
    rows = rows.clone()
    rows[[0, 1]] = rows[[1, 0]]
    return rows


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_contract_catches_planted_bugs(bug):
    from verify.wide_fast_checks import check_wide_fast

    model, x, outs = _case(4)
    with pytest.raises(AssertionError):
        check_wide_fast(_recorder(), model, PLANTED[bug](outs), x)


def test_contract_catches_an_unarmed_mailbox_word():
    from verify.wide_fast_checks import check_armed

    model, _, _ = _case(2)
    model = CpuWideModel(model.weights, 2, 80)
    model.mailboxes[1][1, 79, 3] = 0  # a latent word a reader forgot to re-arm
    with pytest.raises(AssertionError, match="rank 1 latent words armed"):
        check_armed(_recorder(), model, "cpu model")
    model.mailboxes[1][1, 79, 3] = SENTINEL_BF16
    model.mailboxes[0][0, 0, model.config.latent + 1] = 0  # the high half of a logit word
    with pytest.raises(AssertionError, match="rank 0 logit words armed"):
        check_armed(_recorder(), model, "cpu model")
