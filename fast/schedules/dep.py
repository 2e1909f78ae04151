"""S1, the DEP layer, on a GPU: every rank's stages with the fast kernels, over ``N``
virtual ranks whose buffers all live on one device.

What runs, per rank ``r`` of ``N`` (the order of ``reference.schedules.dep``)::

    dense  : fast.schedules.dense.DenseFront (router and shared expert on a side stream;
             each GEMM on cuBLAS or fast.gemm per batch, ``dense_gemm``):
             logits = x @ gate^T (FP32 out) ; weights, ids = fast.router.route
             front = x @ [shared gate_up | latent down]^T (BF16)
             act = fast.activation.situ_and_mul(front[:, :2S]) ; shared = act @ down^T
             codes, scales = fast.mx.quantize_mxfp8(front[:, 2S:])
    routed : DispatchKernel  -> every owner's receive rows ``r*T + t`` (data or poison)
             owner o: fast.experts engine (DEP owner mode, empty rows allowed) over its
             N*T receive rows, OwnerFinalizeKernel -> BF16 partial per receive row
             home r : (wait for the shared expert) CombineKernel (owners in rank order,
                      FP32) -> routed, fused with the RMSNorm (fast.device.norm, fast.norm's
                      exact tree) -> normed ; out = shared + normed @ up^T
                      (DenseFront.up_projection)

The stages are the rank program ``fast.schedules.dep_program.DEP_STEPS`` over each rank's
``DepRank`` (its resources), which the real ranks (``fast.schedules.dep_peer``) run too. A
call runs each step for every virtual rank before the next step
(``fast.schedules.steps.run_steps``: every dispatch before any owner's experts, every
owner finalize before any combine); a virtual rank's ``wait`` does nothing.

Rounding points differ from the reference only where a GEMM's accumulation order does
(the dense GEMMs, cuBLAS or fast.gemm, and the experts engine's FC1/FC2: bounded by the
contracts); the router, SiTU, MXFP8, dispatch, owner finalize, combine and RMSNorm are
each bitwise equal to their reference (or to the emulation of the kernel's stated order)
on their own inputs.

Buffers are allocated once at ``max_tokens`` per rank and reused by every call; each call
writes every receive row it reads, so no call sees a previous call's data. The layer
launches no host synchronization (``validate=False`` engines; ``check()`` reads their
error words), so a call can be captured in a CUDA graph (``DepLayer.graph``).

The router and the shared expert run on a side stream beside the front (``order="side"``,
the default); ``order="serial"`` runs everything on one stream with the same bits.

**Batch invariance is the default** (``DepLayer(batch_invariant=True)``): every token's
outputs, at every stage, are bitwise independent of the batch it is decoded in
(``verify/test_dep_fast.py``). The router (FP32 logits) runs on the project's GEMM
(``fast.gemm``) with one K split at every T, and the front, the shared down projection and
the up projection on cuBLASLt with split-K forbidden (``dense_gemm="auto"`` taken as
``"invariant_stock"``), or all four on fast.gemm (``dense_gemm="fast"``); the mode serves
at most 64 tokens per rank. ``batch_invariant=False`` lets the dense GEMMs' backend change
with the batch: ``dense_gemm="auto"`` then takes ``fast.schedules.dense.DENSE_BACKENDS``
per GEMM and batch (measured on the H200), ``"cublas"`` / ``"fast"`` force one backend.
Real ranks over symmetric memory: ``fast.schedules.dep_peer``.
"""

from __future__ import annotations


import torch

from fast import backend
from fast.gemm.mma_kind import resolve_dense_mode
from fast.schedules.dense import DenseFront, DenseOutputs, check_hidden_rows
from fast.schedules.dep_program import (DEP_STEPS, DepCall, DepRank, DepRankOutputs, combine,
                                        dense_part, dispatch, home, owner_finalize,
                                        run_experts)
from fast.schedules.steps import run_steps
from model.config import LatentMoEConfig
from model.weights import LatentMoEWeights

__all__ = ["DepLayer", "DepRankOutputs", "check_token_rows", "kernel_params",
           "compiled_kernel", "compile_all"]


def compiled_kernel(kind: str, arch: str, params: tuple):
    """The kernel ``kind`` of :func:`kernel_params` compiled for ``arch`` with ``params``
    (``fast.device.compile``: fake arguments, no GPU needed; cached)."""
    from fast.device.arrival import ArrivalWaitKernel
    from fast.device.compile import compiled
    from fast.schedules import dep_kernels as k

    classes = {"dispatch": k.DispatchKernel, "owner_finalize": k.OwnerFinalizeKernel,
               "wait": ArrivalWaitKernel, "combine": k.CombineKernel}
    return compiled(classes[kind], arch, params)


def kernel_params(config: LatentMoEConfig, ranks: int, *, peers: bool = False) -> dict[str, tuple]:
    """The compile parameters of the routed data-movement kernels for ``ranks`` ranks:
    virtual ranks on one device, or real ranks (``peers``: the dispatch and the owner
    finalize signal their receivers, and a wait kernel holds each receiver)."""
    c, per = config, config.experts // ranks
    params = {
        "dispatch": dict(latent=c.latent, top_k=c.top_k, per=per, signal=peers),
        "owner_finalize": dict(latent=c.latent, top_k=c.top_k, signal=peers),
        "combine": dict(latent=c.latent, top_k=c.top_k, ranks=ranks, per=per),
    }
    if peers:
        params["wait"] = dict(ranks=ranks)
    return {kind: tuple(sorted(p.items())) for kind, p in params.items()}


def compile_all(config: LatentMoEConfig, ranks: int, arch: str, *, peers: bool = False):
    """Compile the routed data-movement kernels for ``arch`` (no GPU needed)."""
    return [compiled_kernel(kind, arch, params)
            for kind, params in kernel_params(config, ranks, peers=peers).items()]


def check_token_rows(who: str, xs, names, *, config: LatentMoEConfig, device: torch.device,
                     max_tokens: int, unit: str) -> int:
    """The DEP layers' input check (:class:`DepLayer`: every virtual rank's tokens;
    ``fast.schedules.dep_peer.DepPeerLayer``: one real rank's): each tensor of ``xs``
    BF16 ``[T, H]``, contiguous on ``device``, one ``T`` for all, ``1 <= T <=
    max_tokens``; returns ``T``. Each ValueError starts with ``who`` and names a tensor by
    its entry of ``names`` (``"xs[r]"``, ``"x"``); ``unit`` is what ``T`` counts in the
    range error (``"tokens per rank"``, ``"tokens"``). The tensors are checked in order,
    the range last."""
    tokens = None
    for name, x in zip(names, xs):
        rows = check_hidden_rows(who, name, x, config=config, device=device)
        tokens = rows if tokens is None else tokens
        if rows != tokens:
            raise ValueError(f"{who}: every rank runs one padded T; {names[0]} has {tokens} "
                             f"rows, {name} has {rows}")
    if not 1 <= tokens <= max_tokens:
        raise ValueError(f"{who}: T={tokens} {unit} is outside [1, max_tokens={max_tokens}] "
                         "the layer was built for")
    return tokens


class DepLayer:
    """S1 over ``ranks`` virtual ranks on one CUDA device, reusable across calls.

    Args:
        weights: the layer's weights (any device; copied to ``device``); each virtual
            rank's engine prepares only its own experts ``[r E/N, (r+1) E/N)``.
        ranks: ``N``; must divide ``E``.
        max_tokens: the most tokens per rank one call may have (buffers are sized for it).
        device: the CUDA device.
        dense_gemm: the dense GEMMs' backend (``fast.schedules.dense.DenseFront``'s
            ``gemm``): ``"auto"`` (default: with ``batch_invariant``, ``"invariant_stock"``;
            without it, per GEMM and batch, ``DENSE_BACKENDS``), ``"cublas"`` (refused with
            ``batch_invariant``), ``"fast"`` (fast.gemm, ``max_tokens <= 64``) or
            ``"invariant_stock"`` (the router on fast.gemm, the others on cuBLASLt without
            split-K; batch invariant, ``max_tokens <= 64``).
        batch_invariant: every token's outputs, at every stage, bitwise independent of the
            batch it is decoded in (its size and its batch-mates), routing included
            (default True; ``fast.schedules.dense.DenseFront``'s ``batch_invariant``): each
            dense GEMM sums every output element in one order at every batch. Needs
            ``max_tokens <= 64``. False: the dense GEMMs' backend and cuBLAS's split of K
            may change with the batch, and so may a token's logits and, near a tie, its
            experts. The routed part is batch invariant in every mode (each pair's expert
            row, the owner's finalize and the combine read only that token's rows).
        experts_tactic: the experts engine's FC kernel settings for every call
            (``fast.experts.ExpertsEngine``'s ``tactic``, e.g. ``{"wgmma": 1}``); default
            the engine's defaults.
        invariant_mma: the MMA of the fast.gemm dense GEMMs (``DenseFront``'s):
            ``"auto"`` (default: with ``batch_invariant``, ``"wgmma"`` on sm_90a and
            ``"mma.sync"`` elsewhere; without it ``"mma.sync"``, the kind of the default
            backends' tactic table), ``"mma.sync"`` or ``"wgmma"`` (sm_90a; other bits than
            ``"mma.sync"``, the same at every batch); resolved by
            ``fast.gemm.mma_kind.resolve_dense_mode``, the kind in use is
            ``self.dense.invariant_mma``.
        invariant_overlap: each dense GEMM's MMAs in flight across a stage
            (``DenseFront``'s; ``fast.gemm.Tactic.overlap``, the same bits): None (default)
            on the warpgroup MMA and off on ``"mma.sync"``, or a bool (True refused with
            ``"mma.sync"``).
        router_with_front: the router in the front's launch (``DenseFront``'s: one
            ``fast.gemm.GroupedGemm`` grid, the same bits, one fixed cost instead of two);
            needs ``dense_gemm="fast"``.
    """

    #: ``fast.schedules.graphs.BucketGraphs``' input: every virtual rank's tokens (a list).
    virtual_ranks = True

    def __init__(self, weights: LatentMoEWeights, *, ranks: int, max_tokens: int,
                 device: str | torch.device = "cuda", dense_gemm: str = "auto",
                 batch_invariant: bool = True, experts_tactic: dict | None = None,
                 invariant_mma: str = "auto", invariant_overlap: bool | None = None,
                 router_with_front: bool = False):
        from fast.experts import experts_engine_for, prepare_experts_for

        if not isinstance(weights, LatentMoEWeights):
            raise TypeError(f"DepLayer: weights must be LatentMoEWeights, got {type(weights).__name__}")
        c = weights.config
        if not isinstance(ranks, int) or ranks < 1 or c.experts % ranks:
            raise ValueError(f"DepLayer: ranks={ranks!r} must be a positive int dividing "
                             f"E={c.experts} (each rank owns E/N experts)")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"DepLayer: max_tokens must be a positive int, got {max_tokens!r}")
        device = backend.cuda_device("DepLayer", device)
        backend.require_supported("DepLayer")
        self.config, self.ranks, self.max_tokens, self.device = c, ranks, max_tokens, device
        self.per = c.experts // ranks
        self.arch = backend.device_arch(device)
        on = dict(device=device)
        mma, overlap = resolve_dense_mode("DepLayer", batch_invariant, invariant_mma,
                                          invariant_overlap, self.arch)
        self.dense = DenseFront(weights, device, max_tokens=max_tokens, gemm=dense_gemm,
                                batch_invariant=batch_invariant, invariant_mma=mma,
                                invariant_overlap=overlap,
                                router_with_front=router_with_front)
        rows = ranks * max_tokens
        self.engines = [
            experts_engine_for(self.arch, prepare_experts_for(self.arch, weights, device,
                                                              experts=(r * self.per, self.per)),
                               max_rows=rows, empty_rows=True, tactic=experts_tactic)
            for r in range(ranks)
        ]
        k, L = c.top_k, c.latent
        self._owner = [dict(
            codes=torch.empty(rows, L, dtype=torch.uint8, **on),
            scales=torch.empty(rows, L // 32, dtype=torch.uint8, **on),
            ids=torch.empty(rows, k, dtype=torch.int32, **on),
            weights=torch.empty(rows, k, dtype=torch.float32, **on),
            rows=torch.empty(rows * k, L, dtype=torch.bfloat16, **on),
            partials=torch.empty(rows, L, dtype=torch.bfloat16, **on),
        ) for _ in range(ranks)]
        self.dispatch_table = torch.tensor(
            [[b[f].data_ptr() for f in ("codes", "scales", "ids", "weights")] for b in self._owner],
            dtype=torch.int64, device=device)
        self.combine_table = torch.tensor([b["partials"].data_ptr() for b in self._owner],
                                          dtype=torch.int64, device=device)
        self._fn = {kind: compiled_kernel(kind, self.arch, p)
                    for kind, p in kernel_params(c, ranks).items()}
        # every virtual rank's resources of the rank program (no signal, no wait)
        self._resources = [
            DepRank(config=c, rank=r, ranks=ranks, device=device, dense=self.dense,
                    engine=self.engines[r], buffers=self._owner[r],
                    dispatch_table=self.dispatch_table, combine_table=self.combine_table,
                    kernels=self._fn)
            for r in range(ranks)]

    def rank_resources(self, r: int) -> DepRank:
        """Virtual rank ``r``'s resources of the rank program."""
        return self._resources[r]

    # -- checks -------------------------------------------------------------------------

    def _check_inputs(self, xs) -> int:
        if not isinstance(xs, (list, tuple)) or len(xs) != self.ranks:
            raise ValueError(f"DepLayer: xs must be a list of {self.ranks} tensors (one per rank)")
        return check_token_rows("DepLayer", xs, [f"xs[{r}]" for r in range(len(xs))],
                                config=self.config, device=self.device,
                                max_tokens=self.max_tokens, unit="tokens per rank")

    # -- the call -------------------------------------------------------------------------

    def __call__(self, xs: list[torch.Tensor], *, check: bool = True, order: str = "side",
                 side_delay_cycles: int = 0) -> list[DepRankOutputs]:
        """One layer step of every rank: ``xs[r]`` BF16 ``[T, H]`` (one ``T`` for all).

        Args:
            check: read the engines' error words (one synchronization); pass False inside
                a CUDA-graph capture and call :meth:`check` after.
            order: ``"side"``: the router and the shared expert on a side stream beside
                the front, the MXFP8 quantization and the dispatch (the schedule's
                streams); ``"serial"``: everything on the current stream. The bits are
                the same (the contracts compare them).
            side_delay_cycles: a spin of this many clock cycles at the start of each
                side-stream segment (``torch.cuda._sleep``), so that a missing wait
                between the streams shows as wrong data (the stream-order contract).

        Returns each rank's :class:`DepRankOutputs` (``.out`` is its layer output)."""
        if order not in ("side", "serial"):
            raise ValueError(f"DepLayer: order must be 'side' or 'serial', got {order!r}")
        tokens = self._check_inputs(xs)
        calls = [DepCall(x, tokens, order=order, side_delay_cycles=side_delay_cycles) for x in xs]
        run_steps(DEP_STEPS, self._resources, calls)
        if check:
            self.check()
        return [call.outputs for call in calls]

    # -- one rank's stages (a call runs them for every rank; the benchmark times one
    # rank's own work by replaying its stages after a full call filled the others') -----

    def dense_stage(self, r: int, x: torch.Tensor, *, order: str = "serial",
                    side_delay_cycles: int = 0) -> DenseOutputs:
        """Rank ``r``'s dense part (``fast.schedules.dep_program.dense_part``): with
        ``order="side"`` the router and the shared expert run on the side stream; the
        current stream waits for the router before returning (the dispatch reads ids and
        weights) and for the shared expert in :meth:`home_stage`."""
        return dense_part(self.rank_resources(r), x, order=order,
                          side_delay_cycles=side_delay_cycles)

    def dispatch_stage(self, r: int, dense: tuple, tokens: int) -> None:
        """Source ``r``'s tokens into every owner's receive rows ``r*T + t``
        (``fast.schedules.dep_program.dispatch``)."""
        dispatch(self.rank_resources(r), dense, tokens)

    def experts_stage(self, o: int, tokens: int) -> None:
        """Owner ``o``'s experts over its ``N*T`` receive rows
        (``fast.schedules.dep_program.run_experts``)."""
        run_experts(self.rank_resources(o), tokens)

    def partial_stage(self, o: int, tokens: int) -> None:
        """Owner ``o``'s partial finalize of its receive rows
        (``fast.schedules.dep_program.owner_finalize``)."""
        owner_finalize(self.rank_resources(o), tokens)

    def combine_stage(self, r: int, dense: tuple, tokens: int) -> tuple:
        """Home ``r``'s combine of its owners' partials fused with the RMSNorm (the kernel
        alone, ``fast.schedules.dep_program.combine``): ``(routed, normed)``."""
        return combine(self.rank_resources(r), dense, tokens)

    def home_stage(self, r: int, dense: tuple, tokens: int) -> tuple:
        """Home ``r``'s combine fused with the RMSNorm, and the up-projection
        (``fast.schedules.dep_program.home``): ``(routed, normed, out)``."""
        return home(self.rank_resources(r), dense, tokens)

    def check(self) -> None:
        """Raise the first engine error recorded since the last check (``EngineError``
        naming the owner's receive row and slot); synchronizes the device."""
        for engine in self.engines:
            engine.check()

    def graph(self, xs: list[torch.Tensor], *, order: str = "side"):
        """Capture one call on the static inputs ``xs`` in a CUDA graph (both streams,
        forked from and joined back into the capture stream); returns ``(replay,
        outputs)``: ``replay()`` reruns the whole layer on whatever ``xs`` then hold,
        writing the same output tensors."""
        from fast.schedules.graphs import capture_call

        return capture_call(lambda check: self(xs, check=check, order=order), self.device)
