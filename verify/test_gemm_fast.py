"""Contracts of the dense part's split-K GEMM (``fast.gemm``) on the GPU, at the real widths.

The four dense GEMMs of the DEP layer at ``T <= front_max`` (``reference.schedules.dep``),
each with its own output rule:

| GEMM | weight | out | reference stage |
|---|---|---|---|
| ``front`` | ``[2S + L, H]`` packed ``[shared gate_up ; latent down]`` | BF16 | ``projection(x, front)`` |
| ``router`` | gate ``[E, H]`` | FP32 | ``projection(x, gate)`` (logits) |
| ``shared_down`` | ``[H, S]`` | BF16 | ``projection(act, shared_down)`` |
| ``up`` | ``[H, L]`` | BF16, ``+ shared`` before the one rounding | ``addmm(shared, normed, up)`` |

For every candidate tactic of every GEMM (``fast.gemm.host.CANDIDATES``, the ones the
defaults are chosen from) and every batch T in 1, 2, 4, 8, 16, 32, 33, 64 it serves (a
tactic of 4 m-tiles per warp serves up to 40 tokens):

* **bound**: within ``verify.bounds.mma_matmul_bound`` of the exact product sum (float64):
  ``gamma_n(2^-23) sum|x w| (+|addend|)`` with ``n = c + ceil(c/16) + splits - 1`` (``c =
  K / splits``: the tensor-core MMA model of truncating adders, the splits' FP32 sum, one
  more term for the addend), plus the float64 reference's own error and, for BF16, the
  final half-ULP. The kernel's only freedom is the order of FP32 sums; a dropped k range,
  a wrong row or token, a split added twice or rounded to BF16 is far outside it.
* **batch invariance** (what the design promises, bit for bit): a token's row is the same
  at every T the tactic serves and whatever its batch-mates (rows 1..63 replaced by other values 1000 times
  larger), and the same for every tactic of the same ``splits`` (the tile, the ring, the
  stage width and the occupancy move no bit); the default tactic, which follows the
  batch bucket, at every T = 1..64 (its ``splits`` is one per shape).
* **determinism**: reruns, and a CUDA graph replayed with new inputs (the tile counters
  re-arm themselves), are bitwise equal to the eager call.
* **programmatic dependent launch**: a call that reads the previous call's output on the
  same stream (eager and in a graph) sees that output, bit for bit.
* **bad input** raises a ValueError/TypeError naming the argument before any launch (the
  output buffer stays untouched).

**More than 64 rows** (the wide layer's GEMMs, ``test_gemm_fast_wide_rows``): the four TP8
shapes of ``fast.schedules.wide_gemms`` (the front's 560 rows padded to 576) at their one K
split, 65..1024 rows in token chunks: within the bound (rows of the first three chunks and
of the last), every row count on both sides of a chunk or tile edge bitwise the first rows
of the 1024-row call, token 0 unmoved by batch-mates 1000 times larger, nothing stored
past the ``[T, N]`` output (a NaN guard), a CUDA graph's replays equal to eager calls, and
the split-K order on designed operands across five token chunks.
**Serial splits** (``test_gemm_fast_wide_serial_splits``): the same four GEMMs with every
split run in one CTA (``fast.gemm.Tactic.serial``) give bitwise the cross-CTA form's output
at 65, 129, 257 and 1024 rows, store nothing past the output, and a ``DenseGemm`` that
switches to them from 129 rows (``serial_from``) is bitwise the first rows of the
cross-CTA 1024-row call at every row count of ``WIDE_ROWS``.

**Two GEMMs in one launch** (``test_gemm_fast_grouped_same_bits``: ``fast.gemm.GroupedGemm``
of the front and the router, both MMA kinds): each output bitwise that GEMM's own call at
T = 1, 2, 8, 9, 16, 17, 33, 64, batch invariant, the front's FP32 addend, and CUDA-graph
replays on new tokens equal to eager calls.

Inputs per GEMM come from one seed per GEMM (``verify.seeds.seed_of`` of the GEMM's id), so
the float64 reference of the largest batch is computed once and every smaller batch is a
prefix of it (rows are independent). Weights: ``verify.cases.dense_weights("kimi_k3")``.
"""

from __future__ import annotations

import functools

import pytest
import torch

from fast.gemm.mma_kind import INVARIANT_MMAS
from verify import bounds, cases
from verify.seeds import seed_of

pytestmark = [pytest.mark.gpu, pytest.mark.backends("fast"), pytest.mark.config("kimi_k3")]

BATCHES = (1, 2, 4, 8, 16, 32, 33, 64)
DEVICE = "cuda"
ROWS = ("token", "column")
GEMMS = ("front", "router", "shared_down", "up")
BOUND_NAME = "gamma_{c+c/16+splits-1(+1)}(2^-23) sum|x w| (+|addend|) (+ BF16 half-ULP)"


@functools.cache
def case(gemm: str):
    """(weight, x [64, K], addend [64, N] or None, out dtype) of one GEMM on the GPU."""
    w = cases.dense_weights("kimi_k3", DEVICE)
    cfg = cases.config("kimi_k3")
    g = torch.Generator().manual_seed(seed_of(f"verify/test_gemm_fast.py::{gemm}"))
    if gemm in ("front", "router"):
        x = cases.hidden_rows(cfg, 64, int(torch.randint(1 << 30, (1,), generator=g)))
        weight = w.front if gemm == "front" else w.gate
        return weight, x.to(DEVICE), None, torch.bfloat16 if gemm == "front" else torch.float32
    if gemm == "shared_down":
        act = (torch.randn(64, cfg.shared_intermediate, generator=g) * 0.5).to(torch.bfloat16)
        return w.shared_down, act.to(DEVICE), None, torch.bfloat16
    normed = torch.randn(64, cfg.latent, generator=g).to(torch.bfloat16)
    shared = torch.randn(64, cfg.hidden, generator=g).to(torch.bfloat16)
    return w.up, normed.to(DEVICE), shared.to(DEVICE), torch.bfloat16


@functools.cache
def reference(gemm: str, splits: int):
    """(float64 exact sum, bound) of the 64-row case: ``bounds.mma_matmul_bound``."""
    weight, x, addend, out_dtype = case(gemm)
    return bounds.mma_matmul_bound(x, weight, splits=splits, addend=addend, out_dtype=out_dtype)


@functools.cache
def engine(gemm: str):
    from fast.gemm import DenseGemm
    from fast.gemm.host import CANDIDATES

    weight = case(gemm)[0]
    return DenseGemm(weight, tactics=CANDIDATES[tuple(weight.shape)])


def run(gemm: str, tokens: int, tactic, x=None, addend=None):
    """The kernel on the first ``tokens`` rows into a NaN-poisoned output."""
    weight, x0, a0, out_dtype = case(gemm)
    x = x0 if x is None else x
    addend = a0 if addend is None else addend
    out = torch.full((tokens, weight.shape[0]), float("nan"), dtype=out_dtype, device=DEVICE)
    engine(gemm)(x[:tokens].contiguous(), out_dtype=out_dtype, out=out, tactic=tactic,
                 addend=None if addend is None else addend[:tokens].contiguous())
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _tactics():
    from fast.gemm.host import CANDIDATES

    shapes = {"front": "front", "router": "gate", "shared_down": "shared_down", "up": "up"}
    cfg = cases.config("kimi_k3")
    dims = {"front": (cfg.front_rows, cfg.hidden), "gate": (cfg.experts, cfg.hidden),
            "shared_down": (cfg.hidden, cfg.shared_intermediate), "up": (cfg.hidden, cfg.latent)}
    return [(g, t) for g in GEMMS for t in CANDIDATES[dims[shapes[g]]]]


def _wgmma_tactics():
    """The warpgroup-MMA versions (``Tactic.wgmma``, sm_90a) of each GEMM's candidates
    that have whole warpgroups, at most three per GEMM."""
    import dataclasses

    out = []
    for g in GEMMS:
        mine = [dataclasses.replace(t, wgmma=True) for gg, t in _tactics()
                if gg == g and t.warps in (4, 8)]
        out += [(g, t) for t in mine[:3]]
    return out


def _overlap_tactics():
    """``_wgmma_tactics`` with one stage's MMAs left in flight (``Tactic.overlap``), at most
    two per GEMM."""
    import dataclasses

    out = []
    for g in GEMMS:
        mine = [dataclasses.replace(t, overlap=True) for gg, t in _wgmma_tactics() if gg == g]
        out += [(g, t) for t in mine[:2]]
    return out


@pytest.mark.parametrize("gemm,tactic", _tactics() + _wgmma_tactics() + _overlap_tactics(),
                         ids=lambda v: v if isinstance(v, str) else v.label())
def test_gemm_fast_tactic(backend, gemm, tactic, contract):
    """One tactic of one GEMM at every batch it serves: within the bound, every batch a
    prefix of the largest one's result bit for bit, token 0 independent of its batch-mates,
    3 reruns equal."""
    if tactic.wgmma:
        from fast.backend import gpu_arch

        if gpu_arch() != "sm_90a":
            pytest.skip(f"wgmma is an sm_90a instruction; this GPU is {gpu_arch()}")
    weight, x, addend, out_dtype = case(gemm)
    ref, bound = reference(gemm, tactic.splits)
    batches = [t for t in BATCHES if tactic.serves(t)]
    top = batches[-1]
    full = run(gemm, top, tactic)
    for tokens in batches:
        out = full if tokens == top else run(gemm, tokens, tactic)
        contract.bounded(out, ref[:tokens], bound[:tokens],
                         what=f"{gemm} {tactic.label()} T={tokens}", bound_name=BOUND_NAME,
                         index_names=ROWS)
        contract.bitwise(_bits(out), _bits(full[:tokens]),
                         what=f"{gemm} {tactic.label()}: T={tokens} vs the first rows of T={top}",
                         index_names=ROWS)
    # batch-mates 1000 times larger, and other values: token 0 keeps its bits
    g = torch.Generator(device=DEVICE).manual_seed(5)
    mates = x.clone()
    mates[1:] = (torch.randn(mates[1:].shape, generator=g, device=DEVICE) * 1000).to(torch.bfloat16)
    other_addend = None if addend is None else torch.randn(addend.shape, generator=g,
                                                           device=DEVICE).to(addend.dtype)
    for tokens in (2, 8, 9, top):
        out = run(gemm, tokens, tactic, x=mates, addend=None if addend is None else
                  torch.cat([addend[:1], other_addend[1:]]))
        contract.bitwise(_bits(out[:1]), _bits(full[:1]),
                         what=f"{gemm} {tactic.label()}: token 0 among other batch-mates, T={tokens}",
                         index_names=ROWS)
    for _ in range(3):
        contract.bitwise(_bits(run(gemm, top, tactic)), _bits(full),
                         what=f"{gemm} {tactic.label()}: rerun", index_names=ROWS)


@pytest.mark.parametrize("gemm", GEMMS)
def test_gemm_fast_wgmma_overlap_same_bits(backend, gemm, contract):
    """``Tactic.overlap`` (each stage's warpgroup MMAs in flight while the next stage's
    copies are waited for, the copies one stage less ahead) runs the same MMAs in the same
    order: bitwise the tactic without it, at T = 1, 9, 33 and 64, for each of the GEMM's
    ``_overlap_tactics`` and for the default wgmma tactic a ``DenseGemm(wgmma=True,
    overlap=True)`` runs (``choose_tactic``; the router's only wgmma tactic)."""
    import dataclasses

    from fast.backend import gpu_arch
    from fast.gemm.host import choose_tactic

    if gpu_arch() != "sm_90a":
        pytest.skip(f"wgmma is an sm_90a instruction; this GPU is {gpu_arch()}")
    eng = engine(gemm)
    compared = 0
    for tokens in (1, 9, 33, 64):
        default = choose_tactic(eng.rows, eng.k, tokens, eng.sms, eng.splits, wgmma=True,
                                overlap=True)
        for tactic in [t for g, t in _overlap_tactics() if g == gemm] + [default]:
            if tactic.serves(tokens):
                plain = dataclasses.replace(tactic, overlap=False)
                contract.bitwise(_bits(run(gemm, tokens, tactic)), _bits(run(gemm, tokens, plain)),
                                 what=f"{gemm} {tactic.label()} vs {plain.label()}, T={tokens}",
                                 index_names=ROWS)
                compared += 1
    assert compared >= 4, (gemm, compared)


@pytest.mark.parametrize("gemm", GEMMS)
def test_gemm_fast_tactics_same_splits_same_bits(backend, gemm, contract):
    """Tactics with equal ``splits`` (other tile, ring, stage width, occupancy) give the same
    bits; the default tactic of every bucket is one of the candidates."""
    from fast.gemm.host import CANDIDATES, DEFAULT_TACTICS

    shape = tuple(case(gemm)[0].shape)
    assert set(DEFAULT_TACTICS[shape].values()) <= set(CANDIDATES[shape])
    for tokens in (9, 33, 64):
        by_splits = {}
        for t in CANDIDATES[shape]:
            if t.serves(tokens):
                by_splits.setdefault(t.splits, []).append(t)
        for splits, tactics in by_splits.items():
            first = run(gemm, tokens, tactics[0])
            for t in tactics[1:]:
                contract.bitwise(_bits(run(gemm, tokens, t)), _bits(first),
                                 what=f"{gemm} T={tokens}: {t.label()} vs {tactics[0].label()}",
                                 index_names=ROWS)


@pytest.mark.parametrize("gemm", GEMMS)
def test_gemm_fast_default_batch_invariant(backend, gemm, contract):
    """The default tactic (what the layers run) at every T = 1..64, across every bucket
    edge of ``DEFAULT_TACTICS``: each batch's rows are bitwise the first rows of the T = 64
    call, and the first token keeps its bits among batch-mates 1000 times larger. (The
    per-tactic contract above holds a tactic fixed; this one lets the tactic follow the
    batch, as a layer does, so a K split that changed with the bucket fails here.)"""
    from fast.gemm.layout import MAX_TOKENS

    weight, x, addend, out_dtype = case(gemm)
    full = run(gemm, MAX_TOKENS, None)
    g = torch.Generator(device=DEVICE).manual_seed(6)
    mates = x.clone()
    mates[1:] = (torch.randn(mates[1:].shape, generator=g, device=DEVICE) * 1000).to(torch.bfloat16)
    for tokens in range(1, MAX_TOKENS):
        label = engine(gemm).tactic(tokens).label()
        contract.bitwise(_bits(run(gemm, tokens, None)), _bits(full[:tokens]),
                         what=f"{gemm} default ({label}): T={tokens} vs the first rows of T=64",
                         index_names=ROWS)
        contract.bitwise(_bits(run(gemm, tokens, None, x=mates)[:1]), _bits(full[:1]),
                         what=f"{gemm} default ({label}): token 0 among other batch-mates, "
                              f"T={tokens}", index_names=ROWS)


def designed_split_operands(designed: torch.Tensor, tokens: int, splits: int, addend=None):
    """The designed operands of a split order: ``x`` BF16 ``[tokens, K]`` whose row ``t`` is
    1 at one k of each split (``k_s = s K/S + (37 t + 11 s) mod K/S``) and 0 elsewhere, and
    the FP32 ``[tokens, N]`` sum ``acc = p_0; acc = acc + p_s`` of the partials ``p_s =
    W[:, k_s(t)]`` in split order, plus ``addend`` (BF16 ``[tokens, N]`` or None) last:
    ``(x, acc)``; ``acc`` rounded once is what a GEMM summing its splits in order gives."""
    k = designed.shape[1]
    part = k // splits
    picks = torch.stack([s * part + (37 * torch.arange(tokens) + 11 * s) % part
                         for s in range(splits)], 1)  # [T, S]
    x = torch.zeros(tokens, k, dtype=torch.bfloat16)
    x.scatter_(1, picks, 1.0)
    weight = designed.float().cpu()
    acc = weight[:, picks[:, 0]].t()
    for s in range(1, splits):
        acc = acc + weight[:, picks[:, s]].t()  # [T, N]: W[n, k_s(t)]
    if addend is not None:
        acc = acc + addend.float().cpu()
    return x, acc


@pytest.mark.parametrize("gemm", GEMMS)
def test_gemm_fast_split_order_designed(backend, gemm, contract):
    """The order of the split-K sum, exposed by designed operands, for every candidate
    tactic of 2 or more splits: token ``t``'s row of ``x`` is 1 at one k of each split
    (``k_s = s K/S + (37 t + 11 s) mod K/S``) and 0 elsewhere, so split ``s``'s partial of
    output ``n`` is exactly ``W[n, k_s]`` (one exact product; the zero products add
    exactly); ``W`` holds +-2^24, 2^12, 1 and 2^-12, so the FP32 sum of the partials
    depends on its order (``2^24 + 1`` rounds to ``2^24``). Bitwise against ``acc = p_0;
    acc = acc + p_s`` in split order, then the addend, then one rounding (bounds cannot
    see an order: every order is inside them)."""
    from fast.gemm import DenseGemm
    from fast.gemm.host import CANDIDATES

    weight, x, addend, out_dtype = case(gemm)
    n, k = weight.shape
    designed = cases.order_exposing_values(
        (n, k), seed_of(f"verify/test_gemm_fast.py::designed::{gemm}"), DEVICE)
    tactics = [t for t in CANDIDATES[tuple(weight.shape)] if t.splits >= 2]
    eng = DenseGemm(designed, tactics=tactics)
    tokens = x.shape[0]
    for tactic in tactics:
        xd, acc = designed_split_operands(designed, tokens, tactic.splits, addend)
        want = acc.to(out_dtype)
        for t in (tokens, 9):
            if not tactic.serves(t):
                continue
            got = eng(xd[:t].contiguous().to(DEVICE), out_dtype=out_dtype, tactic=tactic,
                      addend=None if addend is None else addend[:t].contiguous())
            contract.bitwise(_bits(got).cpu(), _bits(want[:t]),
                             what=f"{gemm} {tactic.label()} T={t}: designed split order",
                             index_names=ROWS)


@pytest.mark.parametrize("gemm", GEMMS)
def test_gemm_fast_default_deterministic_and_graph(backend, gemm, contract):
    """The default tactic at each bucket's T: 20 eager reruns and 20 replays of a CUDA graph
    (new inputs copied in between replays) equal the eager call bit for bit."""
    weight, x, addend, out_dtype = case(gemm)
    eng = engine(gemm)
    for tokens in (1, 16, 64):
        want = run(gemm, tokens, None)
        for _ in range(20):
            contract.bitwise(_bits(run(gemm, tokens, None)), _bits(want),
                             what=f"{gemm} default T={tokens}: rerun", index_names=ROWS)
        xs = torch.empty(tokens, x.shape[1], dtype=x.dtype, device=DEVICE)
        adds = None if addend is None else torch.empty(tokens, addend.shape[1],
                                                       dtype=addend.dtype, device=DEVICE)
        out = torch.empty(tokens, weight.shape[0], dtype=out_dtype, device=DEVICE)
        xs.copy_(x[:tokens])
        if adds is not None:
            adds.copy_(addend[:tokens])
        call = lambda: eng(xs, out_dtype=out_dtype, addend=adds, out=out)  # noqa: E731
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            call()
            with torch.cuda.graph(graph, stream=stream):
                call()
        torch.cuda.current_stream().wait_stream(stream)
        other = torch.flip(x[:tokens], (1,))
        for i in range(20):
            src = other if i % 2 else x[:tokens]
            xs.copy_(src)
            graph.replay()
            want_i = run(gemm, tokens, None, x=src.contiguous()) if i % 2 else want
            contract.bitwise(_bits(out), _bits(want_i),
                             what=f"{gemm} default T={tokens}: graph replay {i}", index_names=ROWS)
        torch.cuda.synchronize()


def test_gemm_fast_chain_waits_for_the_previous_kernel(backend, contract):
    """Programmatic dependent launch: a call reading the previous call's output on the same
    stream (the up projection's ``[T, H]`` output fed to the front GEMM, whose K is H), with
    the intermediate re-poisoned (NaN) right before the chain, equals the two calls with a
    synchronization between them, eagerly and as 10 replays of a CUDA graph (new inputs
    between replays)."""
    up, front = engine("up"), engine("front")
    _, x, addend, _ = case("up")
    width, rows = case("up")[0].shape[0], case("front")[0].shape[0]
    for tokens in (1, 33, 64):
        xs = x[:tokens].clone()
        adds = addend[:tokens].clone()
        y = torch.empty(tokens, width, dtype=torch.bfloat16, device=DEVICE)
        z = torch.empty(tokens, rows, dtype=torch.bfloat16, device=DEVICE)

        def chain():
            y.fill_(float("nan"))
            up(xs, addend=adds, out=y)
            front(y, out=z)

        def separate():
            mid = up(xs, addend=adds)
            torch.cuda.synchronize()
            want = front(mid)
            torch.cuda.synchronize()
            return want

        chain()
        contract.bitwise(_bits(z), _bits(separate()), what=f"up -> front chain, T={tokens}",
                         index_names=ROWS)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            chain()
            with torch.cuda.graph(graph, stream=stream):
                chain()
        torch.cuda.current_stream().wait_stream(stream)
        for i in range(10):
            xs.copy_(torch.roll(x[:tokens], i, dims=1))
            graph.replay()
            torch.cuda.synchronize()
            contract.bitwise(_bits(z), _bits(separate()),
                             what=f"up -> front chain in a graph, T={tokens}, replay {i}",
                             index_names=ROWS)


def test_gemm_fast_bad_input(backend):
    """Every bad argument is refused with its name, shape, dtype or device before a launch."""
    from fast.gemm import DenseGemm, Tactic

    weight, x, _, _ = case("router")
    eng = engine("router")
    out = torch.full((4, weight.shape[0]), float("nan"), dtype=torch.float32, device=DEVICE)
    bad = [
        (dict(x=x[:4].float()), ValueError, "x must be bfloat16"),
        (dict(x=x[:4, :-64].contiguous()), ValueError, r"x must be bfloat16 \[T, K=7168\]"),
        (dict(x=x[:0]), ValueError, "x has 0 rows"),
        (dict(x=torch.cat([x, x[:1]])), ValueError, "x has 65 rows"),
        (dict(x=x[:4].cpu()), ValueError, "x is on cpu"),
        (dict(x=x[:4].t().contiguous().t()), ValueError, "x must be contiguous"),
        (dict(x=[1]), TypeError, "x must be a torch.Tensor"),
        (dict(out_dtype=torch.float16), ValueError, "out_dtype must be"),
        (dict(out=out.to(torch.bfloat16)), ValueError, "out must be a contiguous torch.float32"),
        (dict(out=out[:3]), ValueError, r"\[T, N\] = \[4, 896\]"),
        (dict(addend=torch.zeros(4, 895, device=DEVICE)), ValueError, "addend must be contiguous"),
        (dict(addend=torch.zeros(4, 896, dtype=torch.int32, device=DEVICE)), ValueError,
         "addend must be a bfloat16 or float32"),
        (dict(tactic=Tactic(warps=8, mtiles=4, splits=1)), ValueError, "N=896 is not a multiple"),
        (dict(tactic=Tactic(splits=5)), ValueError, "K=7168 is not a multiple"),
        (dict(tactic="fast"), TypeError, "tactic must be a fast.gemm.Tactic"),
        (dict(x=x[:41], out=None, tactic=Tactic(warps=2, mtiles=4, splits=16)), ValueError,
         "does not serve 41 tokens"),
    ]
    for kwargs, error, match in bad:
        args = dict(x=x[:4], out_dtype=torch.float32, out=out)
        args.update(kwargs)
        xx = args.pop("x")
        with pytest.raises(error, match=match):
            eng(xx, **args)
    assert bool(torch.isnan(out).all()), "a refused call wrote its output"
    with pytest.raises(ValueError, match="K a positive multiple of 64"):
        DenseGemm(weight[:, :100].contiguous())
    with pytest.raises(ValueError, match="max_tokens"):
        DenseGemm(weight, max_tokens=4097)
    with pytest.raises(ValueError, match="splits must be None or a positive int"):
        DenseGemm(weight, splits=3)


# -- more than 64 rows: the wide layer's GEMMs ---------------------------------------------

#: Row counts of the wide contract: the bucket's first, both sides of the 2 -> 3 chunk edge
#: (where the TP8 shapes' tiles go from 64 to 128 rows), of window edges, and a 1000-row
#: call whose last chunk is short; each against the 1024-row call.
WIDE_ROWS = (65, 80, 81, 128, 129, 257, 1000)
WIDE_TOP = 1024


@functools.cache
def wide_case(gemm: str, mma: str = "mma.sync"):
    """(DenseGemm, x [1024, K], addend [1024, N] or None, out dtype) of one TP8 wide GEMM
    (``fast.schedules.wide_gemms``: shapes, K split on this GPU) on ``mma`` (the wide
    mode's ``invariant_mma``) over random weights of its shape, N(0, 1/K) BF16, one seed
    per GEMM (the same data for both MMA kinds)."""
    from fast.gemm import DenseGemm
    from fast.schedules.wide_gemms import gemm_shapes, gemm_splits

    cfg = cases.config("kimi_k3")
    n, k = gemm_shapes(cfg, 8)[gemm]
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    g = torch.Generator().manual_seed(seed_of(f"verify/test_gemm_fast.py::wide::{gemm}"))
    weight = (torch.randn(n, k, generator=g) / k ** 0.5).to(torch.bfloat16).to(DEVICE)
    x = torch.randn(WIDE_TOP, k, generator=g).to(torch.bfloat16).to(DEVICE)
    addend = (torch.randn(WIDE_TOP, n, generator=g).to(torch.bfloat16).to(DEVICE)
              if gemm == "up" else None)
    out_dtype = torch.float32 if gemm == "front" else torch.bfloat16
    eng = DenseGemm(weight, max_tokens=WIDE_TOP, splits=gemm_splits(cfg, 8, sms)[gemm],
                    wgmma=mma == "wgmma")
    eng.compile_for(WIDE_ROWS + (WIDE_TOP,))
    return eng, x, addend, out_dtype


def run_wide(gemm: str, tokens: int, x=None, addend=None, mma: str = "mma.sync"):
    """The wide GEMM (on ``mma``) on the first ``tokens`` rows into a NaN-poisoned output
    followed by a NaN guard of 256 elements; returns (out, guard)."""
    eng, x0, a0, out_dtype = wide_case(gemm, mma)
    x = x0 if x is None else x
    addend = a0 if addend is None else addend
    out, guard = nan_guarded(tokens, eng.n, out_dtype)
    eng(x[:tokens].contiguous(), out_dtype=out_dtype, out=out,
        addend=None if addend is None else addend[:tokens].contiguous())
    return out, guard


def nan_guarded(tokens: int, n: int, out_dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN-poisoned ``[tokens, n]`` output and the NaN guard of 256 elements right after
    it in the same buffer: (out, guard)."""
    buf = torch.full((tokens * n + 256,), float("nan"), dtype=out_dtype, device=DEVICE)
    return buf[:tokens * n].view(tokens, n), buf[tokens * n:]


def check_guarded(contract, call, tokens: int, n: int, out_dtype, expected, what: str,
                  compared: str) -> torch.Tensor:
    """``call(out)`` into a ``nan_guarded`` output: the output bitwise ``expected`` (the
    contract's line ``what: compared``), nothing stored past it (the guard still NaN).
    Returns the output."""
    out, guard = nan_guarded(tokens, n, out_dtype)
    call(out)
    contract.bitwise(_bits(out), _bits(expected), what=f"{what}: {compared}", index_names=ROWS)
    contract.bitwise(_bits(guard), _bits(torch.full_like(guard, float("nan"))),
                     what=f"{what}: nothing stored past the output")
    return out


@pytest.mark.parametrize("mma", INVARIANT_MMAS)
@pytest.mark.parametrize("gemm", ("front", "shared_gate_up", "shared_down", "up"))
def test_gemm_fast_wide_rows(backend, gemm, mma, contract):
    """One TP8 wide GEMM at 65..1024 rows (token chunks on the grid; the module docstring)
    on each MMA kind of the wide mode (``invariant_mma``): bounded, batch invariant at every
    row count of ``WIDE_ROWS`` (one K split and one MMA kind at each), nothing past its
    output, graph replays equal to eager calls, split order on designed operands."""
    from fast.backend import gpu_arch

    if mma == "wgmma" and gpu_arch() != "sm_90a":
        pytest.skip(f"wgmma is an sm_90a instruction; this GPU is {gpu_arch()}")
    eng, x, addend, out_dtype = wide_case(gemm, mma)
    full, guard = run_wide(gemm, WIDE_TOP, mma=mma)
    label = eng.launch(WIDE_TOP).tactic.label()
    contract.bitwise(_bits(guard), _bits(torch.full_like(guard, float("nan"))),
                     what=f"wide {gemm}: nothing stored past the [T, N] output, T={WIDE_TOP}")
    for rows in (slice(0, 129), slice(WIDE_TOP - 64, WIDE_TOP)):  # chunks 0-2 and the last
        ref, bound = bounds.mma_matmul_bound(
            x[rows].cpu(), eng.weight.cpu(), splits=eng.splits,
            addend=None if addend is None else addend[rows].cpu(), out_dtype=out_dtype)
        contract.bounded(full[rows].cpu(), ref, bound,
                         what=f"wide {gemm} {label} T={WIDE_TOP}, rows {rows.start}..{rows.stop}",
                         bound_name=BOUND_NAME, index_names=ROWS)
    for tokens in WIDE_ROWS:
        assert eng.launch(tokens).tactic.splits == eng.splits
        assert eng.launch(tokens).tactic.wgmma == (mma == "wgmma")
        out, guard = run_wide(gemm, tokens, mma=mma)
        what = f"wide {gemm} ({eng.launch(tokens).tactic.label()}, {eng.launch(tokens).chunks} chunks)"
        contract.bitwise(_bits(out), _bits(full[:tokens]),
                         what=f"{what}: T={tokens} vs the first rows of T={WIDE_TOP}",
                         index_names=ROWS)
        contract.bitwise(_bits(guard), _bits(torch.full_like(guard, float("nan"))),
                         what=f"{what}: nothing stored past the output, T={tokens}")
    g = torch.Generator(device=DEVICE).manual_seed(7)
    mates = x.clone()
    mates[1:] = (torch.randn(mates[1:].shape, generator=g, device=DEVICE) * 1000).to(torch.bfloat16)
    for tokens in (65, 129, WIDE_TOP):
        out, _ = run_wide(gemm, tokens, x=mates, mma=mma)
        contract.bitwise(_bits(out[:1]), _bits(full[:1]),
                         what=f"wide {gemm}: token 0 among other batch-mates, T={tokens}",
                         index_names=ROWS)
    # a CUDA graph of a 257-row call (5 chunks), replayed on new inputs
    tokens = 257
    xs = x[:tokens].clone()
    adds = None if addend is None else addend[:tokens].clone()
    out = torch.empty(tokens, eng.n, dtype=out_dtype, device=DEVICE)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        eng(xs, out_dtype=out_dtype, addend=adds, out=out)
        with torch.cuda.graph(graph, stream=stream):
            eng(xs, out_dtype=out_dtype, addend=adds, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    for i in range(4):
        src = torch.roll(x[:tokens], i + 1, dims=0).contiguous()
        xs.copy_(src)
        graph.replay()
        want, _ = run_wide(gemm, tokens, x=src, mma=mma)
        contract.bitwise(_bits(out), _bits(want), what=f"wide {gemm} T={tokens}: graph replay {i}",
                         index_names=ROWS)
    torch.cuda.synchronize()
    if eng.splits >= 2:
        _check_wide_split_order(contract, gemm, mma)


#: The row count from which ``test_gemm_fast_wide_serial_splits``'s GEMM switches to
#: serial splits (three token chunks and more).
SERIAL_FROM = 129


@pytest.mark.parametrize("mma", INVARIANT_MMAS)
@pytest.mark.parametrize("gemm", ("front", "shared_gate_up", "shared_down", "up"))
def test_gemm_fast_wide_serial_splits(backend, gemm, mma, contract):
    """Serial splits on one TP8 wide GEMM (on each MMA kind of the wide mode): the serial
    form of the default tactic (every K split in one CTA, folded in split order) bitwise
    equal to the cross-CTA form at 65, 129, 257 and 1024 rows, nothing stored past its
    output (on wgmma also with ``Tactic.overlap``: the fold after in-flight MMAs); a
    ``DenseGemm(serial_from=129)`` of the same weight bitwise the first rows of
    the cross-CTA 1024-row call at every row count of ``WIDE_ROWS`` (across the switch)."""
    import dataclasses

    from fast.backend import gpu_arch
    from fast.gemm import DenseGemm
    from fast.gemm.host import choose_tactic

    if mma == "wgmma" and gpu_arch() != "sm_90a":
        pytest.skip(f"wgmma is an sm_90a instruction; this GPU is {gpu_arch()}")
    eng, x, addend, out_dtype = wide_case(gemm, mma)
    full, _ = run_wide(gemm, WIDE_TOP, mma=mma)
    for tokens in (65, 129, 257, WIDE_TOP):
        cross, _ = run_wide(gemm, tokens, mma=mma)
        tactic = choose_tactic(eng.rows, eng.k, tokens, eng.sms, eng.splits, eng.wgmma,
                               serial=True)
        assert tactic.serial and tactic.splits == eng.splits and tactic.wgmma == eng.wgmma
        out = check_guarded(
            contract, lambda o: eng(x[:tokens].contiguous(), out_dtype=out_dtype, out=o,
                                    tactic=tactic,
                                    addend=None if addend is None else addend[:tokens].contiguous()),
            tokens, eng.n, out_dtype, cross, f"wide {gemm} {tactic.label()} T={tokens}",
            "serial = cross-CTA splits")
        if mma == "wgmma":  # the serial fold after in-flight MMAs (Tactic.overlap)
            overlap = dataclasses.replace(tactic, overlap=True)
            out_o = torch.full_like(out, float("nan"))
            eng(x[:tokens].contiguous(), out_dtype=out_dtype, out=out_o, tactic=overlap,
                addend=None if addend is None else addend[:tokens].contiguous())
            contract.bitwise(_bits(out_o), _bits(cross),
                             what=f"wide {gemm} {overlap.label()} T={tokens}: = cross-CTA splits",
                             index_names=ROWS)
    switching = DenseGemm(eng.weight, max_tokens=WIDE_TOP, splits=eng.splits, wgmma=eng.wgmma,
                          serial_from=SERIAL_FROM)
    switching.compile_for(WIDE_ROWS + (WIDE_TOP,))
    for tokens in WIDE_ROWS + (WIDE_TOP,):
        launch = switching.launch(tokens)
        assert launch.tactic.serial == (tokens >= SERIAL_FROM)
        assert launch.tactic.splits == eng.splits
        out = switching(x[:tokens].contiguous(), out_dtype=out_dtype,
                        addend=None if addend is None else addend[:tokens].contiguous())
        contract.bitwise(_bits(out), _bits(full[:tokens]),
                         what=f"wide {gemm} serial_from={SERIAL_FROM} ({launch.tactic.label()}): "
                              f"T={tokens} vs the first rows of the cross-CTA T={WIDE_TOP}",
                         index_names=ROWS)


@pytest.mark.parametrize("gemm", ("front", "shared_gate_up", "shared_down", "up"))
def test_gemm_fast_wide_chunks(backend, gemm, contract):
    """128-row token chunks on one TP8 wide GEMM on the warpgroup MMA
    (``DenseGemm(chunk_windows=16)``: one ``m64n(8 windows)k16`` up to ``m64n128k16`` per
    m-tile, half the chunks): at every row count of ``WIDE_ROWS`` and 1024, in the cross-CTA
    and the serial form with the MMAs in flight (and, where a K split is whole 128-k stages,
    the serial form in 128-k stages: ``stage_k`` of a ``forms`` entry), bitwise the first rows of the 64-row-chunk
    1024-row call (the same K split: an output's bits may not depend on the chunk width,
    the window count of its chunk or the instruction's N), nothing stored past the output."""
    import dataclasses

    from fast.backend import gpu_arch
    from fast.gemm import DenseGemm
    from fast.gemm.host import default_tactic

    if gpu_arch() != "sm_90a":
        pytest.skip(f"wgmma is an sm_90a instruction; this GPU is {gpu_arch()}")
    eng, x, addend, out_dtype = wide_case(gemm, "wgmma")
    full, _ = run_wide(gemm, WIDE_TOP, mma="wgmma")
    wide = DenseGemm(eng.weight, max_tokens=WIDE_TOP, splits=eng.splits, wgmma=True,
                     chunk_windows=16)
    for tokens in WIDE_ROWS + (WIDE_TOP,):
        plain = wide.launch(tokens).tactic
        assert plain.splits == eng.splits and plain.chunk_windows == 16 and plain.wgmma
        forms = [plain, dataclasses.replace(plain, serial=True, overlap=True)]
        if (eng.k // eng.splits) % 128 == 0:  # 128-k stages where a split is whole stages
            forms.append(default_tactic(eng.rows, eng.k, tokens, eng.sms, eng.splits, True,
                                        forms={1: {"chunk_windows": 16, "serial": True,
                                                   "overlap": True, "stage_k": 128}}))
        for tactic in forms:
            launch = wide.launch(tokens, tactic)
            check_guarded(
                contract, lambda out: wide(
                    x[:tokens].contiguous(), out_dtype=out_dtype, out=out, tactic=tactic,
                    addend=None if addend is None else addend[:tokens].contiguous()),
                tokens, eng.n, out_dtype, full[:tokens],
                f"wide {gemm} {tactic.label()} T={tokens} ({launch.chunks} chunks of "
                f"{launch.windows} windows)", f"vs the first rows of the 64-row-chunk T={WIDE_TOP}")


@pytest.mark.parametrize("gemm", ("front", "shared_gate_up", "shared_down", "up"))
def test_gemm_fast_tiled_same_bits(backend, gemm, contract):
    """The tiled kernel (``fast.gemm.TiledGemm``: TMA-fed warpgroup MMA on 128-row weight
    tiles, the form for the wide layer's many rows) on one TP8 wide GEMM: at every row count
    of ``WIDE_ROWS`` and 1024, with 128-, 96-, 64- and 48-token tiles and rings of 2 to 4
    stages, the splits in their own CTAs (cross), in order inside each CTA (serial) and in
    ranges of (tile, split) units over a persistent grid of 132, 50 or 7 CTAs (the tiles
    whose splits straddle CTAs handed over through the workspace; with a producer warp
    also launched with programmatic dependent launch), in order inside each CTA in
    clusters of 1x2, 2x1 and 2x2 CTAs and one CTA per split in clusters of 1x2 and 2x2
    sharing their operand stages by TMA multicast (the grid rounded up to whole clusters:
    CTAs past the tiles, which must not touch a partial or counter), with and without a
    producer warp (the MMAs of consecutive stages overlapping), one object per variant
    called at every row count in turn (the tile counters re-armed by each call), bitwise
    the first rows of ``DenseGemm``'s 1024-row call on the warpgroup MMA at the same K
    split (one summation order: batch invariant, and the decode-width kernel's bits),
    nothing stored past the output; the split order on designed operands at 257 rows in
    every form."""
    from fast.backend import gpu_arch
    from fast.gemm.tiled import TiledGemm

    if gpu_arch() != "sm_90a":
        pytest.skip(f"wgmma is an sm_90a instruction; this GPU is {gpu_arch()}")
    eng, x, addend, out_dtype = wide_case(gemm, "wgmma")
    full, _ = run_wide(gemm, WIDE_TOP, mma="wgmma")
    for tile_tokens, stages, grid, producer, cluster in (
            (128, 4, "cross", False, (1, 1)), (64, 2, "cross", False, (1, 1)),
            (128, 4, "serial", False, (1, 1)), (64, 2, "serial", False, (1, 1)),
            (128, 4, "cross", True, (1, 1)), (64, 3, "serial", True, (1, 1)),
            (96, 4, "serial", False, (1, 1)), (48, 3, "cross", True, (1, 1)),
            (128, 4, 132, False, (1, 1)), (128, 4, 132, True, (1, 1)),
            (96, 3, 50, True, (1, 1)), (64, 2, 7, False, (1, 1)),
            (64, 4, "serial", True, (1, 2)), (96, 3, "serial", True, (2, 1)),
            (64, 2, "serial", True, (2, 2)), (128, 4, "cross", True, (1, 2)),
            (64, 3, "cross", True, (2, 2))):
        tiled = TiledGemm(eng.weight, splits=eng.splits, max_tokens=WIDE_TOP,
                          tile_tokens=tile_tokens, stages=stages, cross=grid == "cross",
                          producer=producer, persistent=isinstance(grid, int),
                          ctas=grid if isinstance(grid, int) else None,
                          pdl=isinstance(grid, int) and producer, cluster=cluster)
        form = (f"persistent {grid} CTAs" if isinstance(grid, int) else grid) \
            + (" producer pdl" if isinstance(grid, int) and producer else
               " producer" if producer else "") \
            + (f" cluster {cluster[0]}x{cluster[1]}" if cluster != (1, 1) else "")
        for tokens in WIDE_ROWS + (WIDE_TOP,):
            check_guarded(
                contract, lambda out: tiled(
                    x[:tokens].contiguous(), out_dtype=out_dtype, out=out,
                    addend=None if addend is None else addend[:tokens].contiguous()),
                tokens, eng.n, out_dtype, full[:tokens],
                f"wide {gemm} tiled t{tile_tokens} s{stages} {form} T={tokens}",
                f"vs the first rows of DenseGemm's wgmma T={WIDE_TOP}")
    n, k, splits, tokens = eng.n, eng.k, eng.splits, 257
    designed = cases.order_exposing_values(
        (n, k), seed_of(f"verify/test_gemm_fast.py::wide-designed::{gemm}"), DEVICE)
    adds = None if addend is None else addend[:tokens].contiguous()
    xd, acc = designed_split_operands(designed, tokens, splits, adds)
    for grid, producer, cluster in (("cross", False, (1, 1)), ("serial", False, (1, 1)),
                                    ("cross", True, (1, 1)), ("serial", True, (1, 1)),
                                    (132, False, (1, 1)), (11, True, (1, 1)),
                                    ("serial", True, (2, 2)), ("cross", True, (2, 1))):
        got = TiledGemm(designed, splits=splits, max_tokens=tokens, cross=grid == "cross",
                        producer=producer, persistent=isinstance(grid, int),
                        ctas=grid if isinstance(grid, int) else None, cluster=cluster)(
                            xd.to(DEVICE), out_dtype=out_dtype, addend=adds)
        form = (f"persistent {grid} CTAs" if isinstance(grid, int) else grid) \
            + (" producer" if producer else "") \
            + (f" cluster {cluster[0]}x{cluster[1]}" if cluster != (1, 1) else "")
        contract.bitwise(_bits(got).cpu(), _bits(acc.to(out_dtype)),
                         what=f"wide {gemm} tiled {form}, 257 rows: designed split order",
                         index_names=ROWS)


def test_gemm_fast_tiled_bad_input(backend):
    """``TiledGemm`` refuses a call it cannot take by the argument's name: x of another K,
    dtype or too many rows, an out or addend of another shape or dtype."""
    from fast.backend import gpu_arch
    from fast.gemm.tiled import TiledGemm

    if gpu_arch() != "sm_90a":
        pytest.skip(f"wgmma is an sm_90a instruction; this GPU is {gpu_arch()}")
    w = torch.zeros(256, 512, dtype=torch.bfloat16, device=DEVICE)
    g = TiledGemm(w, splits=2, max_tokens=100)
    x = torch.zeros(10, 512, dtype=torch.bfloat16, device=DEVICE)
    bad = [(dict(x=torch.zeros(10, 256, dtype=torch.bfloat16, device=DEVICE)), "x"),
           (dict(x=x.float()), "x"),
           (dict(x=torch.zeros(101, 512, dtype=torch.bfloat16, device=DEVICE)), "max_tokens"),
           (dict(x=x, out=torch.zeros(10, 255, dtype=torch.bfloat16, device=DEVICE)), "out"),
           (dict(x=x, out_dtype=torch.float32,
                 out=torch.zeros(10, 256, dtype=torch.bfloat16, device=DEVICE)), "out"),
           (dict(x=x, addend=torch.zeros(10, 256, dtype=torch.float16, device=DEVICE)), "addend"),
           (dict(x=x, out_dtype=torch.float16), "out_dtype")]
    for kwargs, word in bad:
        with pytest.raises(ValueError, match=word):
            g(**kwargs)
    with pytest.raises(ValueError, match="pdl"):  # PDL is the persistent form's
        TiledGemm(w, splits=2, max_tokens=100, pdl=True)

def _check_wide_split_order(contract, gemm: str, mma: str = "mma.sync") -> None:
    """``test_gemm_fast_split_order_designed``'s operands on a wide GEMM's shape at 257 rows
    (5 token chunks, each reducing its own splits' partials): token ``t`` picks one k per
    split, the weight holds +-2^24, 2^12, 1, 2^-12, so the FP32 sum of the partials depends
    on its order; bitwise against ``acc = p_0; acc = acc + p_s`` in split order, then the
    addend, then one rounding."""
    from fast.gemm import DenseGemm

    eng, _, addend, out_dtype = wide_case(gemm, mma)
    n, k, splits, tokens = eng.n, eng.k, eng.splits, 257
    designed = cases.order_exposing_values(
        (n, k), seed_of(f"verify/test_gemm_fast.py::wide-designed::{gemm}"), DEVICE)
    other = DenseGemm(designed, max_tokens=tokens, splits=splits, wgmma=mma == "wgmma")
    adds = None if addend is None else addend[:tokens].contiguous()
    xd, acc = designed_split_operands(designed, tokens, splits, adds)
    got = other(xd.to(DEVICE), out_dtype=out_dtype, addend=adds)
    contract.bitwise(_bits(got).cpu(), _bits(acc.to(out_dtype)),
                     what=f"wide {gemm} ({other.launch(tokens).tactic.label()}, 5 chunks): "
                          f"designed split order", index_names=ROWS)


# --- two GEMMs in one launch (fast.gemm.grouped) --------------------------------------------


@functools.cache
def grouped_pair(mma: str):
    """(front DenseGemm, router DenseGemm, GroupedGemm) at the defaults of ``mma``'s kind."""
    from fast.gemm import DenseGemm, GroupedGemm

    wgmma = mma == "wgmma"
    front = DenseGemm(case("front")[0], wgmma=wgmma)
    router = DenseGemm(case("router")[0], wgmma=wgmma)
    return front, router, GroupedGemm(front, router)


GROUPED_BATCHES = (1, 2, 8, 9, 16, 17, 33, 64)


@pytest.mark.parametrize("mma", INVARIANT_MMAS)
def test_gemm_fast_grouped_same_bits(backend, mma, contract):
    """The router and the packed front in one launch (``fast.gemm.GroupedGemm``, the
    front's CTAs then the router's) give each GEMM bitwise its own call's output at every
    T of ``GROUPED_BATCHES`` (both sides of the default tactic's bucket edge at 16 and of
    window edges), into NaN-poisoned outputs (so every element is stored); the front also
    with an FP32 addend; a CUDA graph of the grouped call replays with new tokens to the
    eager bits (the tile counters re-arm); and the grouped rows are batch invariant (T
    against the first rows of T = 64)."""
    from fast.backend import gpu_arch

    if mma == "wgmma" and gpu_arch() != "sm_90a":
        pytest.skip(f"wgmma is an sm_90a instruction; this GPU is {gpu_arch()}")
    front, router, group = grouped_pair(mma)
    x = case("front")[1]
    n_front, n_router = front.n, router.n

    def poisoned(tokens, n, dtype):
        return torch.full((tokens, n), float("nan"), dtype=dtype, device=DEVICE)

    def grouped(tokens, xs=None, addend=None):
        xs = (x if xs is None else xs)[:tokens].contiguous()
        outs = (poisoned(tokens, n_front, torch.bfloat16), poisoned(tokens, n_router, torch.float32))
        return group(xs, out_dtypes=(torch.bfloat16, torch.float32), outs=outs, addend=addend)

    full_front, full_router = grouped(64)
    for tokens in GROUPED_BATCHES:
        xs = x[:tokens].contiguous()
        got_front, got_router = grouped(tokens)
        label = f"{mma} grouped ({group.launch(tokens).first.tactic.label()} + router splits " \
                f"{router.splits}), T={tokens}"
        contract.bitwise(_bits(got_front), _bits(front(xs, out_dtype=torch.bfloat16)),
                         what=f"front of the {label} vs the front alone", index_names=ROWS)
        contract.bitwise(_bits(got_router), _bits(router(xs, out_dtype=torch.float32)),
                         what=f"router of the {label} vs the router alone", index_names=ROWS)
        contract.bitwise(_bits(got_front), _bits(full_front[:tokens]),
                         what=f"front of the {label} vs the first rows of T=64", index_names=ROWS)
        contract.bitwise(_bits(got_router), _bits(full_router[:tokens]),
                         what=f"router of the {label} vs the first rows of T=64", index_names=ROWS)
    g = torch.Generator(device=DEVICE).manual_seed(11)
    addend = torch.randn(8, n_front, generator=g, device=DEVICE)
    with_addend, _ = grouped(8, addend=addend)
    contract.bitwise(_bits(with_addend),
                     _bits(front(x[:8].contiguous(), out_dtype=torch.bfloat16, addend=addend)),
                     what=f"{mma} grouped front + FP32 addend vs the front alone", index_names=ROWS)

    # a CUDA graph of the grouped call, replayed on new tokens
    tokens = 8
    static_x = x[:tokens].clone()
    outs = (poisoned(tokens, n_front, torch.bfloat16), poisoned(tokens, n_router, torch.float32))
    call = lambda: group(static_x, out_dtypes=(torch.bfloat16, torch.float32), outs=outs)  # noqa: E731
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for rep in range(3):
        fresh = (torch.randn(tokens, x.shape[1], generator=g, device=DEVICE) * (rep + 1)).to(torch.bfloat16)
        static_x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        eager_front, eager_router = grouped(tokens, xs=fresh)
        contract.bitwise(_bits(outs[0]), _bits(eager_front),
                         what=f"{mma} grouped graph replay {rep}: front vs eager", index_names=ROWS)
        contract.bitwise(_bits(outs[1]), _bits(eager_router),
                         what=f"{mma} grouped graph replay {rep}: router vs eager", index_names=ROWS)


def test_gemm_fast_grouped_bad_input(backend):
    """A grouped call refuses, naming the argument, rows past its range, an FP32 router
    output of the wrong shape, and two GEMMs of different K, before any launch."""
    from fast.gemm import DenseGemm, GroupedGemm

    front, router, group = grouped_pair("mma.sync")
    x = case("front")[1]
    with pytest.raises(ValueError, match="rows"):
        group(torch.cat([x, x])[:65].contiguous())
    with pytest.raises(ValueError, match="out must be"):
        group(x[:4].contiguous(), out_dtypes=(torch.bfloat16, torch.float32),
              outs=(None, torch.empty(4, router.n + 1, device=DEVICE)))
    other_k = DenseGemm(case("shared_down")[0])
    with pytest.raises(ValueError, match="K="):
        GroupedGemm(front, other_k)
    with pytest.raises(TypeError, match="second"):
        GroupedGemm(front, case("router")[0])
