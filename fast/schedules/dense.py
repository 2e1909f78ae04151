"""The dense part of a DEP rank on a GPU (``T <= front_max`` tokens): the router, the packed
front, the shared expert, the MXFP8 latent and, after the routed part, the up-projection.

What runs, for one rank's BF16 tokens ``x [T, H]`` (the order of ``reference.schedules.dep``)::

    main stream                                   side stream (order="side")
    front = x @ [shared gate_up | latent down]^T  logits = x @ gate^T (FP32 out)
                                                  weights, ids = fast.router.route(logits)
    codes, scales = fast.mx.quantize_mxfp8(front[:, 2S:])
                                                  act = fast.activation.situ_and_mul(front[:, :2S])
                                                  shared = act @ shared_down^T
    ... the routed part (dispatch waits for the router) ...
    out = shared + normed @ up^T   (after a wait for the shared expert)

The four GEMMs (``GEMMS``: ``router``, ``front``, ``shared_down``, ``up``) each run on one
of two backends, chosen per GEMM and per batch size ``T``:

* ``"cublas"`` (``fast.stock``): FP32 accumulation in the library's order; router FP32 out,
  front and shared BF16 (one rounding), ``up`` through ``torch.addmm``, which rounds the
  product to BF16 and then the sum with ``shared`` (two roundings);
* ``"fast"`` (``fast.gemm.DenseGemm``, the project's split-K swap-AB GEMM, at its default
  tactic ``fast.gemm.choose_tactic``): per K split an ``mma.sync`` chain in k order, the
  splits' FP32 partials added in split order, one rounding to the output type; ``up`` adds
  ``shared`` to the FP32 sum before its one BF16 rounding (``reference.gemm.addmm``'s
  definition). Only the tactic's ``splits`` moves bits, and a GEMM's ``splits`` is the
  same at every batch (``fast.gemm.splits_of``): a token's row depends neither on its
  batch-mates nor on the batch size.

``DenseFront(gemm="auto")`` (the default) takes each GEMM's backend at ``T`` from
``DENSE_BACKENDS`` (measured on the H200), ``"cublas"`` / ``"fast"`` force one backend for
all four (the contracts and the benchmark run both).

**Batch invariance.** With every GEMM on fast.gemm (``gemm="fast"``) every output of the
dense part is, for each token, bitwise the
same at every batch size and whatever its batch-mates: each GEMM sums every output
element in one order at every ``T``, and the router, SiTU and MXFP8 kernels work row by
row. ``"auto"`` is not batch invariant: cuBLAS picks its kernel (and its split of K) per
batch, and ``DENSE_BACKENDS`` moves a GEMM between the two backends at a bucket edge, so a
token's logits (and, near a tie, its experts) can change with ``T``. ``DenseFront.plan(T)`` says what a call
of ``T`` tokens runs. A GEMM whose chosen backend is ``"fast"`` never falls back to cuBLAS:
input it cannot take raises.

**Batch invariance on cuBLAS** (``gemm="invariant_stock"``, what ``batch_invariant=True``
takes ``"auto"`` as: the DEP layers' default): the router (FP32 out) on
fast.gemm, the three BF16-output GEMMs on cuBLAS with split-K forbidden
(``fast.stock.fp32_reduction(split_k=False)``: cuBLASLt, each output element summed along
the whole K by one CTA). cuBLAS documents no batch invariance; that its kernels then give a
row the same bits at every batch was measured at the real dimensions (an H100 with cuBLAS
13, every T of 1..64: ``benchmarks/cublas_splitk_probe.py``; with split-K allowed the
shared down-projection's rows differed at T = 1..8) and ``verify/test_dep_fast.py`` holds
each node to it at every T. The FP32-output router does not behave so on cuBLAS without
split-K (its one-token call took a kernel with other bits, and 25-160 us against 10), so it
stays on fast.gemm. The up projection is cuBLAS's ``addmm`` (two roundings, the cuBLAS
bound).

**The router in the front's launch** (``router_with_front=True``, with every GEMM on
fast.gemm): one ``fast.gemm.GroupedGemm`` grid computes the front and the logits (the
front's CTAs, then the router's, on the front's kernel shape with the router's own K
split): the same bits as the two launches, one launch's fixed cost instead of two; the
route then runs on the side stream after it.

The fast GEMMs are built once per weight at construction (``DenseGemm`` objects: each holds
its own split-K workspace and tile counters, so the router's on the side stream and the
front's on the main stream never share one) and every kernel they may launch is compiled
then, so a call only launches (and a CUDA-graph capture never compiles). Calls of
``T <= fast.gemm.host.PDL_MAX_TOKENS`` launch with programmatic dependent launch: a kernel
streams its first weight stages before it waits (``griddepcontrol.wait``) for the stream's
previous work; cross-stream event waits stay full dependencies.

Every other step is a fast kernel whose bits equal its reference on its own inputs.
``order="serial"`` runs the side-stream steps on the current stream; the bits are the same.
"""

from __future__ import annotations

import typing

import torch

from fast import activation, mx, router, stock
from fast.gemm.layout import MAX_TOKENS as FAST_MAX_TOKENS
from fast.gemm.mma_kind import check_mma, check_overlap, resolve_mma
from fast.gemm.layout import Tactic, windows_for
from model.config import LatentMoEConfig
from model.weights import LatentMoEWeights

__all__ = ["check_hidden_rows", "DenseFront", "DenseOutputs", "GemmChoice", "GEMMS", "GEMM_MODES",
           "INVARIANT_MODES",
           "DENSE_BACKENDS", "DENSE_BACKENDS_SOURCE", "FAST_MAX_TOKENS", "gemm_shapes",
           "choose_backend", "fast_tactics", "fast_kernel_params"]

#: The dense GEMMs of a DEP rank, by name (weight ``[N, K]``, output):
#: ``router`` gate ``[E, H]`` FP32; ``front`` ``[2S + L, H]`` BF16; ``shared_down``
#: ``[H, S]`` BF16; ``up`` ``[H, L]`` BF16 plus ``shared``.
GEMMS = ("router", "front", "shared_down", "up")

#: ``DenseFront(gemm=...)``: ``"auto"`` per GEMM and batch from ``DENSE_BACKENDS``;
#: ``"cublas"`` / ``"fast"`` that backend for all four GEMMs at every batch;
#: ``"invariant_stock"`` the router on fast.gemm, the others on cuBLASLt without split-K.
GEMM_MODES = ("auto", "cublas", "fast", "invariant_stock")
#: The modes whose every output is batch invariant (the module docstring).
INVARIANT_MODES = ("fast", "invariant_stock")

#: Where ``DENSE_BACKENDS`` comes from (``tests/test_dense_front.py`` re-derives it from them).
DENSE_BACKENDS_SOURCE = ("benchmarks/results/h200/dense.json",
                         "benchmarks/results/h200/dense-rerun.json")

#: The backend of each dense GEMM of the real layer (``kimi_k3`` shapes ``(name, N, K)``)
#: per batch bucket (largest T of the bucket -> backend): ``"fast"`` where fast.gemm at its
#: default tactic (``fast.gemm.host.DEFAULT_TACTICS``) took less device time than cuBLAS at
#: every measured batch of the bucket, in the per-GEMM figures of ``DENSE_BACKENDS_SOURCE``
#: (each GEMM alone, medians of CUDA-graph replays after a 256 MiB read flush, the mean of
#: the two runs; ``benchmarks/results/h200/dense.md``, "Each GEMM alone").
#: Measured at T = 1, 2, 3, 4, 6, 8, 12, 16, 24, ..., 64; the unmeasured 9..11 go with 12.
#:
#: The per-GEMM figures, not the "four in one graph" ones, because in the layer the GEMMs
#: are not back to back (the front beside the router on two streams, the shared down after
#: SiTU, the up-projection after the combine): the one-graph chain, where the kernel's
#: programmatic dependent launch hides the gaps between four GEMMs, favours fast.gemm at
#: every T <= 8 (106.8-109.7 us against cuBLAS 111.1-113.3), which the layer cannot use.
#: ``benchmarks/dep_table.py --dense-gemm auto|fast|cublas`` measures the choice in the layer.
#: A GEMM not listed, or a batch above its last bucket, takes cuBLAS.
DENSE_BACKENDS: dict[tuple[str, int, int], dict[int, str]] = {
    # fast.gemm 58.8 us against cuBLAS 64.4 at T = 1 (cuBLAS picks another algorithm
    # there); from T = 2 on cuBLAS 56.9-58.7 us against 58.9-82.0
    ("front", 15872, 7168): {1: "fast", 64: "cublas"},
    # cuBLAS 8.8-10.5 us against 10.1-16.9 at every T
    ("router", 896, 7168): {64: "cublas"},
    # fast.gemm (split 2) 28.5-28.8 us against cuBLAS 28.8-29.3 at T <= 8; from T = 12 on
    # cuBLAS 26.2-29.6 against 29.9-41.2
    ("shared_down", 7168, 6144): {8: "fast", 64: "cublas"},
    # (+ shared) fast.gemm (split 2) 19.6-20.1 us against cuBLAS 21.4-22.0 at T <= 8; from
    # T = 12 on cuBLAS 18.8-19.9 against 21.2-29.6
    ("up", 7168, 3584): {8: "fast", 64: "cublas"},
}


def check_hidden_rows(who: str, name: str, x, *, config: LatentMoEConfig,
                      device: torch.device) -> int:
    """Every layer's check of one tensor of hidden rows: BF16 ``[T, H]``, contiguous on
    ``device``; returns ``T``. The ValueError starts with ``who`` and names the tensor
    ``name`` (``"x"``, ``"xs[r]"``); the caller checks ``T`` against its own range."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2 \
            or x.shape[1] != config.hidden:
        got = (x.dtype, tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{who}: {name} must be BF16 [T, H={config.hidden}], got {got}")
    if x.device != device or not x.is_contiguous():
        raise ValueError(f"{who}: {name} must be contiguous on {device}, got {x.device}")
    return x.shape[0]


def gemm_shapes(config: LatentMoEConfig) -> dict[str, tuple[int, int]]:
    """The weight shape ``(N, K)`` of each dense GEMM of ``config`` (``GEMMS``)."""
    c = config
    return {"router": (c.experts, c.hidden), "front": (c.front_rows, c.hidden),
            "shared_down": (c.hidden, c.shared_intermediate), "up": (c.hidden, c.latent)}


def choose_backend(gemm: str, n: int, k: int, tokens: int, mode: str = "auto") -> str:
    """``"fast"`` or ``"cublas"``: the backend of GEMM ``gemm`` (weight ``[N, K]``) at
    ``tokens`` rows under ``mode`` (``GEMM_MODES``; ``"auto"``: ``DENSE_BACKENDS``)."""
    if mode not in GEMM_MODES:
        raise ValueError(f"dense GEMM mode must be one of {GEMM_MODES}, got {mode!r}")
    if mode == "invariant_stock":
        return "fast" if gemm == "router" else "cublas"
    if mode != "auto":
        return mode
    table = DENSE_BACKENDS.get((gemm, n, k), {})
    for top in sorted(table):
        if tokens <= top:
            return table[top]
    return "cublas"


def fast_tactics(config: LatentMoEConfig, mode: str, max_tokens: int | None = None,
                 sms: int = 132, mma: str = "mma.sync",
                 overlap: bool = False) -> dict[str, dict[int, Tactic]]:
    """Per GEMM, the batches ``T`` (up to ``max_tokens``, at most ``FAST_MAX_TOKENS``) that
    run fast.gemm under ``mode``, with the tactic each runs (``fast.gemm.choose_tactic`` on a
    GPU of ``sms`` multiprocessors, 132: the H200, on ``mma``: ``DenseFront``'s
    ``invariant_mma``, with its ``invariant_overlap``). GEMMs that never run it are left
    out."""
    from fast.gemm.host import choose_tactic

    check_mma("fast_tactics", mma)
    check_overlap("fast_tactics", overlap, mma)
    top = FAST_MAX_TOKENS if max_tokens is None else min(max_tokens, FAST_MAX_TOKENS)
    plan = {}
    for name, (n, k) in gemm_shapes(config).items():
        chosen = {t: choose_tactic(n, k, t, sms, wgmma=mma == "wgmma", overlap=overlap)
                  for t in range(1, top + 1) if choose_backend(name, n, k, t, mode) == "fast"}
        if chosen:
            plan[name] = chosen
    return plan


def fast_kernel_params(config: LatentMoEConfig, mode: str, max_tokens: int | None = None,
                       sms: int = 132, mma: str = "mma.sync", overlap: bool = False) -> list[dict]:
    """The distinct fast.gemm kernel shapes (``Tactic.kernel_params``) a ``DenseFront`` of
    ``config`` compiles under ``mode`` on ``mma`` with ``overlap`` (what
    ``tests/test_dense_front.py`` checks against the shapes ``tests/test_gemm_fast.py``
    compiles)."""
    seen = []
    for per_t in fast_tactics(config, mode, max_tokens, sms, mma, overlap).values():
        for t, tactic in per_t.items():
            params = tactic.kernel_params(windows_for(t))
            if params not in seen:
                seen.append(params)
    return seen


class GemmChoice(typing.NamedTuple):
    """What one dense GEMM runs at a batch: ``backend`` ``"fast"`` or ``"cublas"``;
    ``tactic`` the fast.gemm tactic (its ``splits`` fix the summation order), None for
    cuBLAS."""

    backend: str
    tactic: Tactic | None


class DenseOutputs(typing.NamedTuple):
    """One call's dense outputs for ``T`` tokens: logits FP32 ``[T, E]``; weights FP32 and
    ids int32 ``[T, K]``; front BF16 ``[T, 2S + L]``; shared BF16 ``[T, H]``; codes
    float8_e4m3fn ``[T, L]`` and scales uint8 ``[T, L/32]`` (the MXFP8 latent);
    ``shared_ready``: the side stream's event after the shared expert (None when serial)."""

    logits: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    front: torch.Tensor
    shared: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor
    shared_ready: torch.cuda.Event | None


class DenseFront:
    """The dense weights of one layer on ``device`` (BF16 gate, FP32 bias, packed front,
    shared down, latent-norm weight, up), the side stream the router and the shared expert
    run on, and the GEMM backend of each GEMM at each batch.

    Args:
        weights: the layer's weights (any device; the dense ones are copied to ``device``).
        device: the CUDA device.
        max_tokens: the most tokens a call may have; None: any (the fast GEMMs serve at most
            ``FAST_MAX_TOKENS`` = 64, so above that only cuBLAS runs).
        gemm: ``"auto"`` (``DENSE_BACKENDS``), ``"cublas"``, ``"fast"`` or
            ``"invariant_stock"`` (the router on fast.gemm, the front, the shared down and
            the up projection on cuBLASLt with split-K forbidden) (``GEMM_MODES``);
            ``"fast"`` and ``"invariant_stock"`` need ``max_tokens <= 64`` (None is taken
            as 64).
        batch_invariant: every token's outputs bitwise independent of its batch (size and
            batch-mates): ``gemm`` ``"auto"`` is taken as ``"invariant_stock"`` (the
            router on fast.gemm, the others on cuBLASLt without split-K), ``"fast"`` and
            ``"invariant_stock"`` are kept, ``"cublas"`` is refused. ``gemm="fast"`` or
            ``"invariant_stock"`` alone gives the same.
        invariant_mma: the MMA of every fast.gemm GEMM: ``"mma.sync"`` (default; the
            measured tactic table's) or ``"wgmma"`` (sm_90a's warpgroup MMA, on
            ``choose_tactic``'s rule at every T: other bits than ``mma.sync``, the same at
            every batch; ``fast.gemm.mma_kind``).
        invariant_overlap: on ``"wgmma"``, each GEMM's MMAs stay in flight across a stage
            (``fast.gemm.Tactic.overlap``; the same bits); refused with ``"mma.sync"``.
        router_with_front: run the router and the packed front as one launch
            (``fast.gemm.GroupedGemm``: the front's CTAs, then the router's) at every batch
            where both run fast.gemm and the router's rows are whole tiles of the front's
            tactic (:meth:`grouped`; :meth:`plan` says which); the same bits as two launches
            (each GEMM keeps its K split), one fixed cost instead of two, and the router's
            logits come with the front's output instead of before it. Needs ``gemm="fast"``.

    Raises:
        ValueError: a bad ``gemm``, ``max_tokens``, ``batch_invariant`` or
            ``invariant_mma`` (``"wgmma"`` off sm_90a); from ``fast.gemm.DenseGemm``, a
            weight the fast GEMM cannot take where it is chosen (N or K not a multiple of
            64); RuntimeError: the fast kernels cannot run on this device where chosen.
    """

    def __init__(self, weights: LatentMoEWeights, device: torch.device, *,
                 max_tokens: int | None = None, gemm: str = "auto",
                 batch_invariant: bool = False, invariant_mma: str = "mma.sync",
                 invariant_overlap: bool = False, router_with_front: bool = False):
        if gemm not in GEMM_MODES:
            raise ValueError(f"DenseFront: gemm must be one of {GEMM_MODES}, got {gemm!r}")
        if not isinstance(batch_invariant, bool):
            raise ValueError(f"DenseFront: batch_invariant must be a bool, got {batch_invariant!r}")
        check_mma("DenseFront", invariant_mma)
        check_overlap("DenseFront", invariant_overlap, invariant_mma)
        if batch_invariant:
            if gemm == "cublas":
                raise ValueError("DenseFront: batch_invariant=True runs the dense GEMMs on "
                                 "fast.gemm (one K split per GEMM at every batch) or, with "
                                 "gemm='invariant_stock', on cuBLASLt without split-K; "
                                 "gemm='cublas' picks its kernel and split per batch and "
                                 "cannot give it")
            if gemm == "auto":
                gemm = "invariant_stock"
        if max_tokens is not None and (isinstance(max_tokens, bool)
                                       or not isinstance(max_tokens, int) or max_tokens < 1):
            raise ValueError(f"DenseFront: max_tokens must be None or a positive int, got "
                             f"{max_tokens!r}")
        if gemm in INVARIANT_MODES:
            if max_tokens is not None and max_tokens > FAST_MAX_TOKENS:
                raise ValueError(f"DenseFront: gemm={gemm!r} runs fast.gemm, which serves at most "
                                 f"{FAST_MAX_TOKENS} tokens, but max_tokens={max_tokens} "
                                 + ("(batch_invariant=True; batch_invariant=False with "
                                    if batch_invariant else "(")
                                 + f"gemm='auto' gives the batches above {FAST_MAX_TOKENS} to "
                                 f"cuBLAS)")
            max_tokens = FAST_MAX_TOKENS if max_tokens is None else max_tokens
        if not isinstance(router_with_front, bool):
            raise ValueError(f"DenseFront: router_with_front must be a bool, got {router_with_front!r}")
        if router_with_front and gemm != "fast":
            raise ValueError(f"DenseFront: router_with_front=True launches the router and the front "
                             f"as one fast.gemm grid; gemm={gemm!r} runs them on cuBLAS at some "
                             f"batches or on cuBLASLt (pass gemm='fast')")
        self.config = c = weights.config
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.gemm, self.max_tokens = gemm, max_tokens
        if device.type == "cuda" and invariant_mma == "wgmma":  # refused off sm_90a, by name
            from fast import backend

            resolve_mma("DenseFront", invariant_mma, backend.device_arch(device))
        #: the MMA of every fast.gemm GEMM (``invariant_mma``)
        self.invariant_mma = invariant_mma
        #: on wgmma, each GEMM's MMAs in flight across a stage (``invariant_overlap``)
        self.invariant_overlap = invariant_overlap
        on = dict(device=device)
        self.gate = weights.gate.to(**on).contiguous()
        self.bias = weights.bias.to(**on).contiguous()
        self.front_w = weights.front.to(**on).contiguous()
        self.shared_down = weights.shared_down.to(**on).contiguous()
        self.latent_norm = weights.latent_norm.to(**on).contiguous()
        self.up = weights.up.to(**on).contiguous()
        self.dense_bytes = sum(t.numel() * t.element_size()
                               for t in (self.gate, self.front_w, self.shared_down, self.up))
        self._side = torch.cuda.Stream(device)
        self._s2 = 2 * c.shared_intermediate
        self._weight = {"router": self.gate, "front": self.front_w,
                        "shared_down": self.shared_down, "up": self.up}
        self.fast_gemms = self._build_fast_gemms()
        #: the router and the front in one launch (``router_with_front``), else None; it
        #: serves the batches where the router's rows are whole tiles of the front's tactic
        self.grouped_gemm = None
        if router_with_front:
            from fast.gemm import GroupedGemm

            self.grouped_gemm = GroupedGemm(self.fast_gemms["front"], self.fast_gemms["router"])
            self.grouped_gemm.compile_for(range(1, self.max_tokens + 1))

    def grouped(self, tokens: int) -> bool:
        """Whether a call of ``tokens`` rows runs the router in the front's launch."""
        return self.grouped_gemm is not None and self.grouped_gemm.serves(tokens)

    def _build_fast_gemms(self) -> dict:
        """One ``fast.gemm.DenseGemm`` per GEMM that runs it at some batch, and every kernel
        it may launch compiled now (none at call time, none inside a graph capture)."""
        top = FAST_MAX_TOKENS if self.max_tokens is None else min(self.max_tokens, FAST_MAX_TOKENS)
        names = [name for name, w in self._weight.items()
                 if any(choose_backend(name, *w.shape, t, self.gemm) == "fast"
                        for t in range(1, top + 1))]
        if not names:
            return {}
        from fast.gemm import DenseGemm, compile_kernel

        gemms = {name: DenseGemm(self._weight[name], max_tokens=top,
                                 wgmma=self.invariant_mma == "wgmma",
                                 overlap=self.invariant_overlap) for name in names}
        for name, g in gemms.items():
            for t in range(1, top + 1):
                if self.backend(name, t) == "fast":
                    compile_kernel(g.arch, **g.tactic(t).kernel_params(windows_for(t)))
        return gemms

    @property
    def batch_invariant(self) -> bool:
        """Whether every token's outputs are bitwise independent of its batch: every GEMM on
        fast.gemm at every batch (``gemm == "fast"``), or the router on it and the others on
        cuBLASLt without split-K (``"invariant_stock"``; the module docstring says why).
        The cuBLAS calls of a batch-invariant mode never split K."""
        return self.gemm in INVARIANT_MODES

    # -- which backend --------------------------------------------------------------------

    def backend(self, gemm: str, tokens: int) -> str:
        """``"fast"`` or ``"cublas"``: what GEMM ``gemm`` (``GEMMS``) runs at ``tokens``."""
        n, k = self._weight[gemm].shape
        return choose_backend(gemm, n, k, tokens, self.gemm)

    def plan(self, tokens: int) -> dict[str, GemmChoice]:
        """Each GEMM's backend and fast.gemm tactic at ``tokens`` rows (what a call runs)."""
        plan = {}
        for name in GEMMS:
            if self.backend(name, tokens) == "fast":
                plan[name] = GemmChoice("fast", self.fast_gemms[name].tactic(tokens))
            else:
                plan[name] = GemmChoice("cublas", None)
        if self.grouped(tokens):  # the router on the front's kernel shape, its own K split
            plan["router"] = GemmChoice("fast", self.grouped_gemm.launch(tokens).second.tactic)
        return plan

    def _matmul(self, gemm: str, a: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """``a @ W^T`` of GEMM ``gemm`` on its backend at ``T = a.shape[0]``, rounded once to
        ``out_dtype`` (FP32 or BF16)."""
        if self.backend(gemm, a.shape[0]) == "fast":
            return self.fast_gemms[gemm](a, out_dtype=out_dtype)
        if out_dtype == torch.float32:
            return stock.mm_fp32_out(a, self._weight[gemm])
        return stock.mm_bf16(a, self._weight[gemm], split_k=not self.batch_invariant)

    def _check(self, x: torch.Tensor) -> int:
        tokens = check_hidden_rows("DenseFront", "x", x, config=self.config, device=self.device)
        if tokens < 1 or (self.max_tokens is not None and tokens > self.max_tokens):
            raise ValueError(f"DenseFront: T={tokens} tokens is outside [1, max_tokens="
                             f"{self.max_tokens}] (gemm={self.gemm!r})")
        return tokens

    # -- the call -------------------------------------------------------------------------

    def __call__(self, x: torch.Tensor, *, order: str = "serial",
                 side_delay_cycles: int = 0) -> DenseOutputs:
        """The dense part before the routed part, for BF16 ``x [T, H]`` contiguous on
        ``device``, each GEMM on its backend at ``T`` (:meth:`plan`).

        With ``order="side"`` the router and the shared expert run on the side stream; the
        current stream waits for the router before returning (the dispatch reads ids and
        weights) and for the shared expert only through ``shared_ready``
        (:meth:`wait_for_shared`, before :meth:`up_projection`'s input is made).
        ``side_delay_cycles`` starts each side segment with a spin of that many clock
        cycles, so a missing wait shows as wrong data (the stream-order contract).
        """
        if order not in ("side", "serial"):
            raise ValueError(f"DenseFront: order must be 'side' or 'serial', got {order!r}")
        self._check(x)
        c = self.config
        main = torch.cuda.current_stream(self.device)
        side = self._side if order == "side" else main

        def segment():
            if side is not main:
                side.wait_stream(main)
                if side_delay_cycles:
                    torch.cuda._sleep(int(side_delay_cycles))

        grouped = self.grouped(x.shape[0])
        if grouped:
            front, logits = self.grouped_gemm(x, out_dtypes=(torch.bfloat16, torch.float32))
        segment()
        with torch.cuda.stream(side):
            if not grouped:
                logits = self._matmul("router", x, torch.float32)
            weights, ids = router.route(logits, self.bias, top_k=c.top_k,
                                        renormalize=c.renormalize, scale=c.routed_scaling_factor)
        route_ready = side.record_event() if side is not main else None
        if not grouped:
            front = self._matmul("front", x, torch.bfloat16)
        segment()
        with torch.cuda.stream(side):
            act = activation.situ_and_mul(front[:, :self._s2], beta=c.situ_beta,
                                          linear_beta=c.situ_linear_beta)
            shared = self._matmul("shared_down", act, torch.bfloat16)
        shared_ready = side.record_event() if side is not main else None
        codes, scales = mx.quantize_mxfp8(front[:, self._s2:].contiguous())
        if route_ready is not None:
            main.wait_event(route_ready)
        return DenseOutputs(logits, weights, ids, front, shared, codes, scales, shared_ready)

    def wait_for_shared(self, dense: DenseOutputs) -> None:
        """Make the current stream wait for the side stream's shared expert of ``dense``
        (nothing when it ran on the main stream)."""
        if dense.shared_ready is not None:
            torch.cuda.current_stream(self.device).wait_event(dense.shared_ready)

    def up_projection(self, dense: DenseOutputs, normed: torch.Tensor) -> torch.Tensor:
        """``shared + normed @ up^T`` (BF16 ``[T, H]``) for BF16 ``normed [T, L]``. fast.gemm
        adds ``shared`` to the FP32 sum before its one rounding; cuBLAS's ``addmm`` rounds
        the product, then the sum.

        The caller has made the current stream wait for the shared expert
        (:meth:`wait_for_shared`) before the kernel that writes ``normed``, so the GEMM
        follows that kernel with no event wait between them, and at ``T <=
        fast.gemm.host.PDL_MAX_TOKENS`` its programmatic dependent launch overlaps it."""
        if self.backend("up", normed.shape[0]) == "fast":
            return self.fast_gemms["up"](normed, addend=dense.shared)
        return stock.addmm_bf16(dense.shared, normed, self.up, split_k=not self.batch_invariant)
