"""Contracts of the fast S1 layer (``fast.schedules.dep.DepLayer``) over virtual ranks on one
GPU: each stage of every rank against the reference stage on *that rank's own inputs*.

The dense GEMMs run on the backend the layer chose for the batch (``DepLayer(dense_gemm=...)``,
``fast.schedules.dense.DenseFront.plan``); each is held to the bound of that backend:

* cuBLAS: ``verify.bounds.matmul_fp32_out_bound`` / ``matmul_bf16_out_bound`` (FP32
  accumulation in any order with truncating tensor-core adders, one rounding; ``addmm``
  rounds the product, then the sum);
* fast.gemm: ``verify.bounds.mma_matmul_bound`` at the tactic's ``splits`` (the tensor-core
  model of its split-K order, ``verify/test_gemm_fast.py``; ``up`` adds ``shared`` before
  its one rounding), and bitwise equal to the same ``DenseGemm`` run alone on the same
  operands (the kernel really ran, and neither the other stream's GEMM nor the layer's
  launch order moved a bit).

The small config runs every case with all four GEMMs on cuBLAS, with all four on fast.gemm
and as the default layer runs them (``batch_invariant=True``: the router on fast.gemm, the
others on cuBLASLt without split-K); the real layer (DEP16) runs the default at every T and
``batch_invariant=False, dense_gemm="auto"``, which mixes the two backends per batch
(``DENSE_BACKENDS``).

| stage | contract |
|---|---|
| router logits, front, shared | within the bound of the backend that ran (above) |
| ids, weights | bitwise = the router's emulation on own logits |
| SiTU feeding shared | the shared GEMM's bound is taken around the emulated SiTU of own front |
| MXFP8 latent | bitwise = ``quantize_mxfp8(own latent)`` |
| dispatch | every owner's receive rows are the sources' codes/scales/ids/weights, bit for bit; rows not sent are poisoned |
| owner rows | bitwise = the owner's engine run alone on its own receive rows (the engine's own bounds are ``test_experts.py``'s) |
| owner partial | bitwise = ``reference.schedules.dep.local_finalize`` (an FMA chain over the owner's local slots in k order, one BF16 rounding) |
| combine | bitwise = ``reference.schedules.dep.ordered_combine`` (the present partials summed in FP32 in owner order, one BF16 rounding) |
| normed | bitwise = the RMSNorm kernel's emulation on own routed |
| out | cuBLAS: within the two-rounding bound of its BF16 ``addmm``; fast.gemm: as the other GEMMs, ``shared`` the addend |
| CUDA graph | replays on new inputs bitwise equal to eager calls on those inputs (no stale scratch) |
| stream orders | serialized, side stream, side stream delayed by a spin, graph replay: bitwise equal |
| designed orders | the owner finalize (k order) and the combine (owner order) on values of a wide dynamic range at 8 ranks, where the order decides the bits: bitwise their reference orders |
| another process | the same layer, weights and tokens in a second process: the same bits |
| 1000 graph replays | on changing inputs, every 50th bitwise equal to an eager call |
| MMAs in flight (``invariant_overlap``) | on the warpgroup MMA, every stage of every rank bitwise the same layer's without it at T = 1, 9, 33, 64 |
| a bad token | one token's row NaN, infinite or overflowing (``verify.isolation``): the call completes and every other token's every stage, home and owner, is bitwise as with its ordinary row |
| batch invariance (``batch_invariant=True``, the default; dense GEMMs ``"invariant_stock"``, the default's, and ``"fast"``) | every rank's first ``t`` tokens as a batch of ``t``: every stage bitwise the same tokens' at ``T = 64`` (home: logits to out; owner: received ids/weights, local expert rows, partials), every ``t`` on the small config, both sides of every bucket edge at the real one |
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from fast.gemm.mma_kind import INVARIANT_MMAS

from reference import emulation
from reference.mx import quantize_mxfp8
from reference.schedules.dep import POISON_CODE, POISON_SCALE, local_finalize, ordered_combine
from verify import bounds, cases, isolation
from verify.compare import raw_bits

pytestmark = [pytest.mark.gpu, pytest.mark.backends("fast")]

ROWS = ("token", "column")
GEMM_BOUND = bounds.ANY_ORDER_GEMM_BOUND
#: cuBLAS ran on the GPU: truncating tensor-core adders
CUBLAS = dict(accum_rounding=bounds.gemm_accum_rounding("cuda"))
MMA_BOUND = ("verify.bounds.mma_matmul_bound: gamma_{c+c/16+splits-1(+1)}(2^-23) sum|a w| "
             "(+|addend|) (+ BF16 half-ULP): fast.gemm's tensor-core split-K order")
#: The dense backends the small-config cases run (every GEMM forced onto one of them, or
#: ``"invariant_stock"``, the default layer's: the router on fast.gemm, the others on
#: cuBLASLt without split-K).
DENSE_GEMMS = ("cublas", "fast", "invariant_stock")


def _layer(config_name: str, ranks: int, max_tokens: int, dense_gemm: str, **options):
    """A ``DepLayer`` on the dense backend ``dense_gemm`` as given: ``batch_invariant``
    False unless ``options`` set it (the layer's default is True, which takes ``"auto"``
    as ``"invariant_stock"`` and refuses ``"cublas"``)."""
    from fast.schedules.dep import DepLayer

    options.setdefault("batch_invariant", False)
    # the real layer from the GPU generator (the CPU one takes minutes at that size)
    w = cases.layer_weights(config_name)
    return DepLayer(w, ranks=ranks, max_tokens=max_tokens, device="cuda", dense_gemm=dense_gemm,
                    **options)


def _gemm(contract, layer, name, got, a, b, out_dtype, what, addend=None):
    """One dense GEMM of one rank (CPU copies ``got``, operands ``a [T, K]``, ``b [N, K]``,
    optional BF16 ``addend [T, N]``) within the bound of the backend the layer ran at
    ``T``; for fast.gemm also bitwise equal to the layer's ``DenseGemm`` run alone on the
    same operands (its default tactic at ``T``, the one the layer ran)."""
    dense = layer.dense
    choice = dense.plan(a.shape[0])[name]
    want = (None if dense.gemm == "auto" else
            ("fast" if name == "router" else "cublas") if dense.gemm == "invariant_stock"
            else dense.gemm)
    assert want is None or choice.backend == want, (
        f"{what}: the layer was built with dense_gemm={dense.gemm!r} but ran {choice.backend}")
    if choice.backend == "fast":
        ref, bound = bounds.mma_matmul_bound(a, b, splits=choice.tactic.splits, addend=addend,
                                             out_dtype=out_dtype)
        contract.bounded(got, ref, bound, what=f"{what} (fast.gemm {choice.tactic.label()})",
                         bound_name=MMA_BOUND, index_names=ROWS)
        on = layer.device
        alone = dense.fast_gemms[name](a.contiguous().to(on), out_dtype=out_dtype,
                                       addend=None if addend is None else addend.to(on))
        contract.bitwise(got, alone.cpu(), what=f"{what} = fast.gemm alone on the same operands",
                         index_names=ROWS)
        return
    if addend is not None:  # cuBLAS addmm: the product rounded to BF16, then the sum
        exact = bounds.reference_matmul(a, b) + addend.double()
        product = bounds.matmul_bf16_out_bound(a, b, **CUBLAS)
        contract.bounded(got, exact, bounds.final_rounding_bound(exact, product, torch.bfloat16),
                         what=f"{what} (cuBLAS)", index_names=ROWS,
                         bound_name=GEMM_BOUND + ", then the BF16 add (cuBLAS addmm rounds twice)")
        return
    make = bounds.matmul_fp32_out_bound if out_dtype == torch.float32 else \
        bounds.matmul_bf16_out_bound
    contract.bounded(got, bounds.reference_matmul(a, b), make(a, b, **CUBLAS), what=f"{what} (cuBLAS)",
                     bound_name=GEMM_BOUND, index_names=ROWS)


def check_dep_fast(contract, layer, outs, xs) -> None:
    """Every stage of one fast S1 call on every rank (the module docstring's table),
    compared on the CPU (the emulations and oracles run there)."""
    c, n = layer.config, layer.ranks
    tokens, k, per = xs[0].shape[0], c.top_k, layer.per
    s2 = 2 * c.shared_intermediate
    # the owners' engines alone on their own receive rows (on the GPU), then CPU copies
    alone = [engine(o.recv_codes.view(torch.float8_e4m3fn), o.recv_scales, o.recv_ids).cpu()
             for engine, o in zip(layer.engines, outs)]
    outs = [dataclasses.replace(o, **{f.name: getattr(o, f.name).cpu()
                                      for f in dataclasses.fields(o)}) for o in outs]
    xs = [x.cpu() for x in xs]
    gate, bias, front_w, shared_down, up, latent_norm = (
        t.cpu() for t in (layer.dense.gate, layer.dense.bias, layer.dense.front_w,
                          layer.dense.shared_down, layer.dense.up, layer.dense.latent_norm))
    for r, (o, x) in enumerate(zip(outs, xs)):
        _gemm(contract, layer, "router", o.logits, x, gate, torch.float32,
              f"rank {r} router logits")
        emu_w, emu_ids = emulation.route(o.logits, bias, top_k=k,
                                         renormalize=c.renormalize,
                                         scale=c.routed_scaling_factor)
        contract.bitwise(o.ids, emu_ids, what=f"rank {r} ids = route(own logits)")
        contract.bitwise(o.weights, emu_w, what=f"rank {r} weights = route(own logits)")
        _gemm(contract, layer, "front", o.front, x, front_w, torch.bfloat16, f"rank {r} front")
        act = emulation.situ_and_mul(o.front[:, :s2], beta=c.situ_beta,
                                     linear_beta=c.situ_linear_beta)
        # on the emulated SiTU of own front (bitwise = the SiTU kernel, test_activation.py)
        _gemm(contract, layer, "shared_down", o.shared, act, shared_down, torch.bfloat16,
              f"rank {r} shared")
        codes, scales = quantize_mxfp8(o.front[:, s2:].contiguous())
        contract.bitwise(o.codes, codes, what=f"rank {r} MXFP8 codes", index_names=ROWS)
        contract.bitwise(o.scales, scales, what=f"rank {r} MXFP8 scales", index_names=ROWS)

    owners = torch.arange(n)
    for dst, owner in enumerate(outs):
        for src, home in enumerate(outs):
            at = slice(src * tokens, (src + 1) * tokens)
            sent = ((home.ids.long() // per) == dst).any(1)
            want_codes = torch.where(sent[:, None], home.codes.view(torch.uint8),
                                     torch.full_like(home.codes.view(torch.uint8), POISON_CODE))
            want_scales = torch.where(sent[:, None], home.scales,
                                      torch.full_like(home.scales, POISON_SCALE))
            want_ids = torch.where(sent[:, None], home.ids, torch.full_like(home.ids, -1))
            want_w = torch.where(sent[:, None], home.weights,
                                 torch.full_like(home.weights, float("nan")))
            name = f"dispatch {src}->{dst}"
            contract.bitwise(owner.recv_codes[at], want_codes, what=f"{name} codes",
                             index_names=ROWS)
            contract.bitwise(owner.recv_scales[at], want_scales, what=f"{name} scales",
                             index_names=ROWS)
            contract.bitwise(owner.recv_ids[at], want_ids, what=f"{name} ids")
            contract.bitwise(owner.recv_weights[at].view(torch.int32),
                             want_w.view(torch.int32), what=f"{name} weights (bits)")

    # owners: the engine alone on the same receive rows gives the same local rows
    for o, out in enumerate(outs):
        lo = o * per
        local = (out.recv_ids >= lo) & (out.recv_ids < lo + per)  # [N*T, k]
        pairs = local.flatten()
        contract.bitwise(out.rows[pairs], alone[o][pairs],
                         what=f"owner {o} expert rows = engine alone",
                         index_names=("pair", "column"))
        want = local_finalize(out.rows.view(-1, k, c.latent), out.recv_weights, local)
        valid = out.recv_ids[:, 0] >= 0
        contract.bitwise(out.partials[valid], want[valid],
                         what=f"owner {o} partial finalize (local slots in k order)",
                         index_names=ROWS)

    for h, home in enumerate(outs):
        present = ((home.ids.long() // per)[None] == owners[:, None, None]).any(2)  # [N, T]
        parts = [owner.partials[h * tokens:(h + 1) * tokens] for owner in outs]
        contract.bitwise(home.routed, ordered_combine(parts, list(present)),
                         what=f"rank {h} combine (owner order)", index_names=ROWS)
        contract.bitwise(home.normed, emulation.rms_norm_tree(home.routed, latent_norm, c.rms_eps),
                         what=f"rank {h} normed", index_names=ROWS)
        _gemm(contract, layer, "up", home.out, home.normed, up, torch.bfloat16,
              f"rank {h} out = shared + normed @ up^T", addend=home.shared)


#: (ranks, tokens per rank) on the small config: every rank count, batches around the
#: engine's window sizes.
GRID = [(1, 1), (1, 64), (2, 7), (4, 16), (8, 3), (16, 2), (16, 16)]


@pytest.mark.config("small")
@pytest.mark.parametrize("dense_gemm", DENSE_GEMMS)
@pytest.mark.parametrize("ranks,tokens", GRID)
def test_dep_fast_stages(backend, ranks, tokens, dense_gemm, seed, contract):
    cfg = cases.config("small")
    layer = _layer("small", ranks, tokens, dense_gemm)
    xs = cases.rank_rows(cfg, ranks, tokens, seed, "cuda")
    check_dep_fast(contract, layer, layer(xs), xs)


@pytest.mark.config("small")
@pytest.mark.parametrize("dense_gemm", DENSE_GEMMS)
@pytest.mark.parametrize("ranks", (1, 4))
def test_dep_fast_graph_replay(backend, ranks, dense_gemm, seed, contract):
    """One CUDA graph per batch: three replays on new inputs, each bitwise equal to an
    eager call on those inputs, and the replayed call passes every stage contract (with
    fast.gemm: its launches, programmatic dependent launch included, captured on both
    streams)."""
    cfg = cases.config("small")
    tokens = 7
    layer = _layer("small", ranks, 16, dense_gemm)
    static = cases.rank_rows(cfg, ranks, tokens, seed, "cuda")
    replay, graph_outs = layer.graph(static)
    for i in range(1, 4):
        fresh = cases.rank_rows(cfg, ranks, tokens, seed + 100 * i, "cuda")
        for s, f in zip(static, fresh):
            s.copy_(f)
        replay()
        torch.cuda.synchronize()
        got = [o.out.clone() for o in graph_outs]
        eager = layer(fresh)
        for r in range(ranks):
            contract.bitwise(got[r], eager[r].out, what=f"replay {i} rank {r} out = eager",
                             index_names=ROWS)
    replay()
    layer.check()
    check_dep_fast(contract, layer, graph_outs, static)


@pytest.mark.config("small")
@pytest.mark.parametrize("dense_gemm", DENSE_GEMMS)
def test_dep_fast_stream_orders(backend, dense_gemm, seed, contract):
    """The side stream changes no bit: everything serialized on one stream, the router and
    the shared expert on the side stream, the same with each side segment delayed by a
    spin (a missing wait would let the dispatch or the up-projection read another call's
    ids or shared rows: the call before runs on other inputs so stale buffers differ),
    and a CUDA-graph replay of the side-stream order."""
    cfg = cases.config("small")
    ranks, tokens = 4, 7
    layer = _layer("small", ranks, 8, dense_gemm)
    xs = cases.rank_rows(cfg, ranks, tokens, seed, "cuda")
    other = cases.rank_rows(cfg, ranks, tokens, seed + 999, "cuda")
    serial = [o.out.clone() for o in layer(xs, order="serial")]
    runs = {}
    # each side-stream run follows one on the other inputs, so the side stream's freed
    # buffers hold other values
    layer(other, order="side")
    runs["side, delayed"] = [o.out.clone() for o in layer(xs, order="side",
                                                          side_delay_cycles=2_000_000)]
    layer(other, order="side")
    runs["side"] = [o.out.clone() for o in layer(xs, order="side")]
    static = [x.clone() for x in other]
    replay, outs = layer.graph(static, order="side")
    for s, x in zip(static, xs):
        s.copy_(x)
    replay()
    torch.cuda.synchronize()
    runs["graph replay"] = [o.out.clone() for o in outs]
    for name, got in runs.items():
        for r in range(ranks):
            contract.bitwise(got[r], serial[r], what=f"{name}: rank {r} out = serialized",
                             index_names=ROWS)


@pytest.mark.config("kimi_k3")
@pytest.mark.parametrize("tokens", (1, 4))
def test_dep_fast_real_dep16(backend, tokens, seed, contract):
    """The real layer over 16 virtual ranks (56 experts each), every stage of every rank,
    the dense GEMMs as ``dense_gemm="auto"`` picks them (``DENSE_BACKENDS``: at T = 1 the
    front, shared down and up on fast.gemm, the router on cuBLAS; at T = 4 the front too on
    cuBLAS)."""
    cfg = cases.config("kimi_k3")
    layer = _real_dep16()
    xs = cases.rank_rows(cfg, 16, tokens, seed, "cuda")
    check_dep_fast(contract, layer, layer(xs), xs)


@functools.cache
def _real_dep16():
    return _layer("kimi_k3", 16, 4, "auto")


@pytest.mark.config("small")
def test_dep_fast_bad_input(backend):
    cfg = cases.config("small")
    layer = _layer("small", 2, 4, "cublas")
    xs = cases.rank_rows(cfg, 2, 4, 0, "cuda")
    with pytest.raises(ValueError, match="max_tokens=4"):
        layer(cases.rank_rows(cfg, 2, 5, 0, "cuda"))
    with pytest.raises(ValueError, match="one padded T"):
        layer([xs[0], xs[1][:3]])
    with pytest.raises(ValueError, match=r"xs\[1\] must be BF16"):
        layer([xs[0], xs[1].float()])
    with pytest.raises(ValueError, match="list of 2 tensors"):
        layer(xs[:1])
    with pytest.raises(ValueError, match="dividing"):
        _layer("small", 3, 4, "cublas")
    with pytest.raises(ValueError, match="gemm must be one of"):
        _layer("small", 2, 4, "cuBLAS")
    with pytest.raises(ValueError, match="serves at most 64 tokens, but max_tokens=65"):
        _layer("small", 2, 65, "fast")
    with pytest.raises(ValueError, match="batch_invariant=True runs the dense GEMMs on fast.gemm"):
        _layer("small", 2, 4, "cublas", batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant must be a bool"):
        _layer("small", 2, 4, "auto", batch_invariant=1)


# -- batch invariance --------------------------------------------------------------------

#: The home rank's stage outputs whose rows are that rank's tokens (``DepRankOutputs``).
HOME_STAGES = ("logits", "weights", "ids", "front", "shared", "codes", "scales", "routed",
               "normed", "out")


def _snapshot(out) -> dict:
    """Clones of one rank's outputs (the layer's buffers are reused by the next call)."""
    return {f.name: getattr(out, f.name).clone() for f in dataclasses.fields(out)}


def check_batch_invariant(contract, layer, xs, batches) -> None:
    """Every rank's first ``t`` tokens decoded as a batch of ``t`` (each ``t`` of
    ``batches``) against the same tokens in the batch of ``T = len(xs[0])``, bit for bit at
    every stage: as home (``HOME_STAGES``: logits, routing, front, shared, MXFP8 latent,
    combine, norm, output) and as owner (each source's receive rows ``s*t + i`` against
    ``s*T + i``: ids, weights, the local pairs' expert rows, the partials of sent rows)."""
    n, k, top = layer.ranks, layer.config.top_k, xs[0].shape[0]
    want = [_snapshot(o) for o in layer(xs)]
    for t in batches:
        outs = layer([x[:t].contiguous() for x in xs])
        for r, o in enumerate(outs):
            for name in HOME_STAGES:
                contract.bitwise(raw_bits(getattr(o, name)), raw_bits(want[r][name][:t]),
                                 what=f"rank {r} {name}: T={t} vs the same tokens at T={top}",
                                 index_names=ROWS)
            got_rows, want_rows = o.rows.view(n * t, k, -1), want[r]["rows"].view(n * top, k, -1)
            for s in range(n):
                mine, theirs = slice(s * t, s * t + t), slice(s * top, s * top + t)
                ids = o.recv_ids[mine]
                contract.bitwise(ids, want[r]["recv_ids"][theirs],
                                 what=f"owner {r} ids received from {s}: T={t} vs T={top}")
                contract.bitwise(raw_bits(o.recv_weights[mine]), raw_bits(want[r]["recv_weights"][theirs]),
                                 what=f"owner {r} weights received from {s}: T={t} vs T={top}")
                local = (ids >= r * layer.per) & (ids < (r + 1) * layer.per)
                contract.bitwise(raw_bits(got_rows[mine][local]), raw_bits(want_rows[theirs][local]),
                                 what=f"owner {r} expert rows of {s}'s local pairs: T={t} vs "
                                      f"T={top}", index_names=("pair", "column"))
                sent = ids[:, 0] >= 0
                contract.bitwise(raw_bits(o.partials[mine][sent]),
                                 raw_bits(want[r]["partials"][theirs][sent]),
                                 what=f"owner {r} partials of {s}'s rows: T={t} vs T={top}",
                                 index_names=ROWS)


#: The owner's stage outputs whose rows are its receive rows ``s*T + t``.
RECEIVED_STAGES = ("recv_codes", "recv_scales", "recv_ids", "recv_weights")


def check_rank_stages(contract, got: dict, want: dict, r: int, layer, home, received,
                      what: str) -> None:
    """Rank ``r``'s snapshots (``_snapshot``) of two calls of the same batch size bitwise
    equal where they must be: as home, ``HOME_STAGES`` on the token rows ``home`` selects;
    as owner, ``RECEIVED_STAGES`` on the receive rows ``received`` selects, the expert rows
    of those rows' local pairs and the partials of those rows that were sent (the pairs and
    rows by ``want``'s received ids; the other expert rows are unspecified)."""
    isolation.check_others_unchanged(contract, {n: want[n] for n in HOME_STAGES},
                                     {n: got[n] for n in HOME_STAGES}, home, f"{what}, as home")
    isolation.check_others_unchanged(contract, {n: want[n] for n in RECEIVED_STAGES},
                                     {n: got[n] for n in RECEIVED_STAGES}, received,
                                     f"{what}, as owner")
    ids, k = want["recv_ids"], layer.config.top_k
    local = (ids >= r * layer.per) & (ids < (r + 1) * layer.per) & received[:, None]
    rows = ids.shape[0]
    contract.bitwise(got["rows"].view(rows, k, -1)[local], want["rows"].view(rows, k, -1)[local],
                     what=f"{what}: the local expert rows", index_names=("pair", "column"))
    sent = (ids[:, 0] >= 0) & received
    contract.bitwise(got["partials"][sent], want["partials"][sent],
                     what=f"{what}: the partials", index_names=ROWS)


def _skip_unless_mma_runs(mma: str) -> None:
    from fast.backend import gpu_arch

    if mma == "wgmma" and gpu_arch() != "sm_90a":
        pytest.skip(f"wgmma is an sm_90a instruction (invariant_mma='wgmma'); this GPU is "
                    f"{gpu_arch()}")


#: (ranks, the dense GEMMs' MMA kind) of the small-width batch-invariance contract
BATCH_INVARIANT_CASES = [(1, "mma.sync"), (4, "mma.sync"), (16, "mma.sync"), (4, "wgmma")]


@pytest.mark.config("small")
@pytest.mark.parametrize("ranks,mma", BATCH_INVARIANT_CASES)
def test_dep_fast_batch_invariant(backend, ranks, mma, seed, contract):
    """``DepLayer(batch_invariant=True, dense_gemm="fast")`` on each MMA kind of its dense GEMMs
    (``invariant_mma``): every T = 1..63 against T = 64 (every window and bucket edge of
    the GEMMs and the engine), every stage of every rank, and the check itself: the layer
    reports the mode and runs every dense GEMM on fast.gemm with one K split and one MMA
    kind per GEMM."""
    from fast.gemm.layout import MAX_TOKENS

    _skip_unless_mma_runs(mma)
    cfg = cases.config("small")
    layer = _layer("small", ranks, MAX_TOKENS, "fast", batch_invariant=True, invariant_mma=mma)
    assert layer.dense.batch_invariant
    plans = [layer.dense.plan(t) for t in range(1, MAX_TOKENS + 1)]
    for name in plans[0]:
        assert {p[name].backend for p in plans} == {"fast"}, name
        assert len({p[name].tactic.splits for p in plans}) == 1, name
        assert {p[name].tactic.wgmma for p in plans} == {mma == "wgmma"}, name
    xs = cases.rank_rows(cfg, ranks, MAX_TOKENS, seed, "cuda")
    check_batch_invariant(contract, layer, xs, range(1, MAX_TOKENS))


@pytest.mark.config("small")
def test_dep_fast_stock_batch_invariant(backend, seed, contract):
    """``DepLayer(batch_invariant=True, dense_gemm="invariant_stock")``, the default layer (the router on
    fast.gemm, the other three dense GEMMs on cuBLASLt without split-K): every T = 1..63
    against T = 64 (cuBLAS may change its kernel at any T, so every one is checked), every
    stage of every rank of 4; the router keeps one K split, the others run cuBLAS at every
    T; then every stage contract at T = 1 and 64 (the cuBLAS GEMMs within their bound)."""
    from fast.gemm.layout import MAX_TOKENS

    cfg = cases.config("small")
    layer = _layer("small", 4, MAX_TOKENS, "invariant_stock", batch_invariant=True)
    assert layer.dense.batch_invariant and layer.dense.gemm == "invariant_stock"
    plans = [layer.dense.plan(t) for t in range(1, MAX_TOKENS + 1)]
    assert {p["router"].backend for p in plans} == {"fast"}
    assert len({p["router"].tactic.splits for p in plans}) == 1
    for name in ("front", "shared_down", "up"):
        assert {p[name].backend for p in plans} == {"cublas"}, name
    xs = cases.rank_rows(cfg, 4, MAX_TOKENS, seed, "cuda")
    check_batch_invariant(contract, layer, xs, range(1, MAX_TOKENS))
    for t in (1, MAX_TOKENS):
        few = [x[:t].contiguous() for x in xs]
        check_dep_fast(contract, layer, layer(few), few)


@pytest.mark.config("kimi_k3")
def test_dep_fast_real_dep16_stock_batch_invariant(backend, seed, contract):
    """The real layer over 16 virtual ranks as built by default (``batch_invariant=True``,
    ``dense_gemm="auto"`` taken as ``"invariant_stock"``): every
    T = 1..63 against T = 64, every stage of every rank; then one batch of T = 2 passes
    every stage contract (the front, shared down and up on cuBLAS within their bound)."""
    cfg = cases.config("kimi_k3")
    w = cases.layer_weights("kimi_k3")
    from fast.schedules.dep import DepLayer

    layer = DepLayer(w, ranks=16, max_tokens=64, device="cuda")
    assert layer.dense.batch_invariant and layer.dense.gemm == "invariant_stock"
    xs = cases.rank_rows(cfg, 16, 64, seed, "cuda")
    check_batch_invariant(contract, layer, xs, range(1, 64))
    few = [x[:2].contiguous() for x in xs]
    check_dep_fast(contract, layer, layer(few), few)


@pytest.mark.config("kimi_k3")
@pytest.mark.parametrize("mma", INVARIANT_MMAS)
def test_dep_fast_real_dep16_batch_invariant(backend, mma, seed, contract):
    """The real layer over 16 virtual ranks with ``batch_invariant=True`` on each MMA kind
    of its dense GEMMs: T = 1, 2, 8, 9, 16, 17, 24, 25, 32, 33, 63 (both sides of every
    bucket edge of ``DEFAULT_TACTICS`` and of the engine's windows) against T = 64, every
    stage of every rank; then one batch of T = 2 passes every stage contract (each dense
    GEMM on fast.gemm at the real widths)."""
    _skip_unless_mma_runs(mma)
    cfg = cases.config("kimi_k3")
    w = cases.layer_weights("kimi_k3")
    from fast.schedules.dep import DepLayer

    layer = DepLayer(w, ranks=16, max_tokens=64, device="cuda", batch_invariant=True,
                     dense_gemm="fast", invariant_mma=mma)
    xs = cases.rank_rows(cfg, 16, 64, seed, "cuda")
    check_batch_invariant(contract, layer, xs, (1, 2, 8, 9, 16, 17, 24, 25, 32, 33, 63))
    few = [x[:2].contiguous() for x in xs]
    check_dep_fast(contract, layer, layer(few), few)


@pytest.mark.config("small")
@pytest.mark.parametrize("mma", ("wgmma",))
def test_dep_fast_overlap_same_bits(backend, mma, seed, contract):
    """``DepLayer(dense_gemm="fast", invariant_mma="wgmma", invariant_overlap=True)``
    (each dense GEMM's warpgroup MMAs in flight across a stage, ``fast.gemm.Tactic.overlap``)
    on 4 virtual ranks: every stage of every rank bitwise the same layer's without it at
    T = 1, 9, 33 and 64 (home stages, received rows, local expert rows, partials of sent
    rows), every dense GEMM running with it (the mode's default on the warpgroup MMA) and
    none without it."""
    _skip_unless_mma_runs(mma)
    ranks, top = 4, 64
    plain = _layer("small", ranks, top, "fast", batch_invariant=True, invariant_mma=mma,
                   invariant_overlap=False)
    flying = _layer("small", ranks, top, "fast", batch_invariant=True, invariant_mma=mma,
                    invariant_overlap=True)
    assert all(choice.tactic.overlap for t in (1, 33, top)
               for choice in flying.dense.plan(t).values())
    assert not any(choice.tactic.overlap for t in (1, 33, top)
                   for choice in plain.dense.plan(t).values())
    check_same_stages(contract, plain, flying, ranks, top, seed, (1, 9, 33, top),
                      lambda r, t: f"rank {r}, MMAs in flight vs not, T={t}")


def check_same_stages(contract, plain, other, ranks: int, top: int, seed: int, batches,
                      what) -> None:
    """Every stage of every virtual rank of layer ``other`` bitwise ``plain``'s (two
    ``DepLayer`` of ``ranks`` ranks that must give the same bits) on the same seeded tokens
    at each T of ``batches`` (at most ``top``); ``what(rank, T)`` labels the comparisons."""
    xs = cases.rank_rows(other.config, ranks, top, seed, "cuda")
    for t in batches:
        batch = [x[:t].contiguous() for x in xs]
        want = [_snapshot(o) for o in plain(batch)]
        got = [_snapshot(o) for o in other(batch)]
        every = torch.ones(ranks * t, dtype=torch.bool, device="cuda")
        for r in range(ranks):
            check_rank_stages(contract, got[r], want[r], r, plain, every[:t], every, what(r, t))


# -- a bad token changes no other token ---------------------------------------------------

@pytest.mark.config("small")
@pytest.mark.parametrize("dense_gemm", DENSE_GEMMS)
@pytest.mark.parametrize("kind", isolation.BAD_KINDS)
def test_dep_fast_bad_token_isolation(backend, kind, dense_gemm, seed, contract):
    """Rank 1's token 3 of 4 virtual ranks x 16 tokens replaced by a bad row
    (``verify.isolation.bad_row``: NaN, infinite or overflowing; the reference refuses such
    a batch, the GPU layer cannot check without a synchronization): the call completes (no
    engine error) and every other token's stages are bitwise those of the call with its
    ordinary row: as home on every rank (logits to out), and as owner on every rank the
    other received rows' codes, scales, ids and weights, their local pairs' expert rows and
    their partials."""
    ranks, tokens, at = 4, 16, (1, 3)
    layer = _layer("small", ranks, tokens, dense_gemm)
    xs = cases.rank_rows(layer.config, ranks, tokens, seed, "cuda")
    clean = [_snapshot(o) for o in layer(xs)]
    bad = [x.clone() for x in xs]
    bad[at[0]][at[1]] = isolation.bad_row(kind, xs[at[0]][at[1]], seed)
    dirty = [_snapshot(o) for o in layer(bad)]  # check=True: raises an engine error
    received = isolation.kept_rows(ranks * tokens, at[0] * tokens + at[1], device="cuda")
    for r in range(ranks):
        home = (isolation.kept_rows(tokens, at[1], device="cuda") if r == at[0]
                else torch.ones(tokens, dtype=torch.bool, device="cuda"))
        check_rank_stages(contract, dirty[r], clean[r], r, layer, home, received,
                          f"rank {r} with a {kind} token at rank {at[0]} row {at[1]}")


# -- orders exposed by designed values, and reliability ------------------------------------

@pytest.mark.config("small")
def test_dep_fast_reduction_orders_designed(backend, seed, contract):
    """The order-sensitive sums of the routed part on designed values, 8 virtual ranks: the
    owners' partial finalize (an FMA chain over the local slots in k order) on expert rows
    of a wide dynamic range, and the home's combine (owners in rank order) on partials of
    one: each bitwise its reference order, on tokens with at least 3 present owners
    (random values of similar size often sum exactly in FP32 whatever the order)."""
    cfg = cases.config("small")
    ranks, tokens = 8, 16
    layer = _layer("small", ranks, tokens, "fast")
    xs = cases.rank_rows(cfg, ranks, tokens, seed, "cuda")
    outs = layer(xs)
    k, per = cfg.top_k, layer.per
    present_counts = []
    # owners: designed expert rows of every local pair, then the partial finalize alone
    for o, out in enumerate(outs):
        rows = out.rows.view(ranks * tokens, k, cfg.latent)
        rows.copy_(cases.order_exposing_values(tuple(rows.shape), seed + o, rows.device))
        layer.partial_stage(o, tokens)
        local = (out.recv_ids >= o * per) & (out.recv_ids < (o + 1) * per)
        want = local_finalize(rows.cpu(), out.recv_weights.cpu(), local.cpu())
        valid = (out.recv_ids[:, 0] >= 0).cpu()
        contract.bitwise(out.partials.cpu()[valid], want[valid],
                         what=f"owner {o} partial finalize on designed rows (k order)",
                         index_names=ROWS)
    # homes: designed partials at every owner, then the combine alone
    for o, out in enumerate(outs):
        out.partials.copy_(cases.order_exposing_values(tuple(out.partials.shape), seed + 100 + o,
                                          out.partials.device))
    owners = torch.arange(ranks)
    for h, home in enumerate(outs):
        ids = home.ids.cpu()
        present = ((ids.long() // per)[None] == owners[:, None, None]).any(2)  # [N, T]
        present_counts.append(int((present.sum(0) >= 3).sum()))
        routed, _ = layer.combine_stage(h, home, tokens)
        parts = [owner.partials[h * tokens:(h + 1) * tokens].cpu() for owner in outs]
        contract.bitwise(routed.cpu(), ordered_combine(parts, list(present)),
                         what=f"rank {h} combine on designed partials (owner order)",
                         index_names=ROWS)
    assert sum(present_counts) >= ranks * tokens // 2, present_counts  # the orders were exercised


@pytest.mark.config("small")
def test_dep_fast_same_bits_in_another_process(backend, seed, contract, tmp_path):
    """A second process that builds the same layer (``batch_invariant=True``) from the same
    weights and runs the same tokens returns the same bits at every stage a user reads
    (logits, ids, weights, shared, out of every rank): nothing in a call depends on the
    process (addresses, allocator state, compile caches)."""
    from verify.other_process import check_same_bits_as_another_process

    ranks, tokens = 4, 9
    layer = _layer("small", ranks, 16, "auto", batch_invariant=True)
    outs = layer(cases.rank_rows(cases.config("small"), ranks, tokens, seed, "cuda"))
    check_same_bits_as_another_process(
        contract, outs,
        "from fast.schedules.dep import DepLayer\n"
        "w = cases.layer_weights('small')\n"
        f"layer = DepLayer(w, ranks={ranks}, max_tokens=16, device='cuda', batch_invariant=True)",
        f"layer(cases.rank_rows(cases.config('small'), {ranks}, {tokens}, {seed}, 'cuda'))",
        ("logits", "ids", "weights", "shared", "out"), tmp_path / "other_process.pt", ROWS)


@pytest.mark.config("small")
def test_dep_fast_graph_1000_replays(backend, seed, contract):
    """One CUDA graph replayed 1000 times on changing inputs (a new batch copied in before
    each replay); every 50th replay, and the last, bitwise equal to an eager call on the
    same inputs (no state drifts: tile counters re-armed, no stale scratch)."""
    cfg = cases.config("small")
    ranks, tokens = 4, 7
    layer = _layer("small", ranks, 8, "auto", batch_invariant=True)
    static = cases.rank_rows(cfg, ranks, tokens, seed, "cuda")
    replay, graph_outs = layer.graph(static)
    pool = [cases.rank_rows(cfg, ranks, tokens, seed + 1 + i, "cuda") for i in range(8)]
    g = torch.Generator().manual_seed(seed)
    for i in range(1000):
        batch = pool[i % len(pool)]
        # a fresh mix each replay: rows of two pool batches, scaled
        other = pool[(i * 3 + 1) % len(pool)]
        scale = float(torch.rand((), generator=g)) + 0.5
        for s, a, b in zip(static, batch, other):
            s.copy_(torch.cat([a[: tokens // 2], b[tokens // 2:]]) * scale)
        replay()
        if i % 50 == 49 or i == 999:
            torch.cuda.synchronize()
            got = [o.out.clone() for o in graph_outs]
            eager = layer([s.clone() for s in static])
            for r in range(ranks):
                contract.bitwise(got[r], eager[r].out,
                                 what=f"replay {i + 1} rank {r} out = eager", index_names=ROWS)
    layer.check()


@pytest.mark.config("small")
@pytest.mark.parametrize("mma", INVARIANT_MMAS)
def test_dep_fast_router_with_front_same_bits(backend, mma, seed, contract):
    """``DepLayer(batch_invariant=True, dense_gemm="fast", router_with_front=True)`` (the router in the
    front's launch, ``fast.gemm.GroupedGemm``) on 4 virtual ranks: every stage of every rank
    bitwise the same layer's without it at T = 1, 9, 16, 17, 33 and 64, the router running
    in the front's launch at T = 1 (``DenseFront.grouped``) and with its own K split there."""
    _skip_unless_mma_runs(mma)
    ranks, top = 4, 64
    plain = _layer("small", ranks, top, "fast", batch_invariant=True, invariant_mma=mma)
    grouped = _layer("small", ranks, top, "fast", batch_invariant=True, invariant_mma=mma,
                     router_with_front=True)
    assert grouped.dense.grouped(1) and not plain.dense.grouped(1)
    assert grouped.dense.plan(1)["router"].tactic.splits == plain.dense.plan(1)["router"].tactic.splits
    check_same_stages(contract, plain, grouped, ranks, top, seed, (1, 9, 16, 17, 33, top),
                      lambda r, t: f"rank {r}, router in the front's launch "
                                   f"({'grouped' if grouped.dense.grouped(t) else 'apart'}) "
                                   f"vs not, T={t}")
