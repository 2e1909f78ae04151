"""S2's rank program: one rank's stage sequence of the wide layer, which the virtual ranks
(``fast.schedules.wide.WideLayer``, every rank in one process on one device) and the real
ranks (``fast.schedules.wide_peer.WidePeerLayer``, one TP rank per process) both run.

A rank is a :class:`WideRank`: its weight slices, buffers, the address tables its kernels
read and write through, its kernels, its side stream, and a ``wait(what, tokens)`` hook.
The program is :data:`WIDE_STEPS`, five steps run by
``fast.schedules.steps.run_steps`` (every step for every rank given before the next
step; the virtual layer gives every rank, a real rank itself)::

    shared_first       (placement "front") the shared expert on the side stream
    front_and_publish  front_stage -> publish_stage (every rank's mailbox; Lamport words,
                       no wait needed: the poll is the synchronization)
    routed             route_stage (poll, re-arm, MXFP8 plan rows, router, routing lists)
                       ("beside") shared expert ; experts_stage ; ("tail") shared expert
                       finalize_stage ; wait(0): every rank's routed partial
    latent             latent_stage (all-reduce + RMSNorm, then the up columns after the
                       shared expert) ; wait(1): every rank's hidden partials
    hidden             hidden_stage -> out ; the rank's outputs

A virtual rank's ``wait`` does nothing (one stream: every rank's writes precede the reads
in launch order, and every publish precedes every poll); a real rank's is the
``ArrivalSignalKernel`` and ``ArrivalWaitKernel`` pair on its arrival counters. The
kernels, their arguments and one rank's stream order are the same in both; only the
addresses in the tables differ (peer addresses from the symmetric-memory handle), and
the shared and up buffers a real rank's peers read rotate with the mailbox buffer
(``fast.schedules.wide_peer`` says why).

The rank's four dense GEMMs (front, shared gate/up, shared down, up columns) run on cuBLAS,
or, when the rank holds ``gemms`` (the layers' ``batch_invariant=True``), on its
``fast.gemm.DenseGemm`` objects (``fast.schedules.wide_gemms``): the same stages, the same
buffers, one K split per GEMM at every row count. No stage chooses between the two per
call: a rank built with ``gemms`` never runs a cuBLAS GEMM.

Shapes, dtypes and rounding points: ``fast.schedules.wide`` and :class:`WideRankOutputs`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from fast import activation, backend, finalize, stock

__all__ = ["WideRank", "WideCall", "WideRankOutputs", "WideStageCalls", "WIDE_STEPS",
           "MAILBOX_BUFFERS", "SHARED_PLACEMENTS",
           "DEFAULT_SHARED_PLACEMENT", "front_stage", "shared_stage", "publish_stage", "route_stage",
           "experts_stage", "finalize_stage", "latent_stage", "hidden_stage", "rank_outputs",
           "as_int32", "mm_bf16_into", "rank_gemm_bf16_into"]

#: Rotating mailbox buffers per rank (calls alternate between them).
MAILBOX_BUFFERS = 2

#: Where the shared expert's side-stream segment forks from the main stream (seed 001's
#: placements): ``"front"`` at the start of the call, beside the front GEMM, the publish,
#: the poll and the experts; ``"beside"`` after the rank's routing, beside its experts;
#: ``"tail"`` after its experts, beside the Finalize and the latent all-reduce. The
#: placement moves only when the side stream starts: no bit changes.
SHARED_PLACEMENTS = ("front", "beside", "tail")

#: The calls' default placement: beside the experts was the fastest at every row count of
#: a virtual TP8 rank on the H200, 2 to 3% ahead of front (archived runs
#: ``wide/h200_tp8_v2_placements`` and ``wide/h200_tp8_v3``, ``docs/ledger.md``), and every placement's contracts
#: pass there on one GPU and two.
DEFAULT_SHARED_PLACEMENT = "beside"


@dataclasses.dataclass
class WideRankOutputs:
    """One rank's stage outputs of one call (views into the layer's buffers, valid until
    the next call), for ``T`` tokens and ``N`` ranks:

    front FP32 ``[T, E/N + L/N]`` (router logits, then the latent shard); logits FP32
    ``[T, E]`` and latent BF16 ``[T, L]`` (polled); weights FP32 / ids int32 ``[T, K]``;
    codes float8_e4m3fn ``[T, L]``, scales uint8 ``[T, L/32]`` (the plan rows); lists int32
    ``[E, max_rows]`` (the engine's routing lists: pair indices ``t K + j``; entries at and
    beyond ``counts[e]`` are stale) and counts int32 ``[E]``; rows BF16 ``[T K, L]`` (this
    rank's partial expert rows); routed_partial, routed, normed BF16 ``[T, L]``;
    shared_gate_up BF16 ``[T, 2 S/N]`` (this rank's shared gate and up columns) and
    shared_act BF16 ``[T, S/N]`` (their SiTU); shared BF16 ``[T, H]`` (this rank's
    shared-expert partial); up_columns BF16 ``[T, H/N]``
    (``shared[:, cols_r] + normed @ up_r^T``); out BF16 ``[T, H]``; mailbox_index: the
    rotating buffer this call used.
    """

    front: torch.Tensor
    logits: torch.Tensor
    latent: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor
    lists: torch.Tensor
    counts: torch.Tensor
    rows: torch.Tensor
    routed_partial: torch.Tensor
    routed: torch.Tensor
    normed: torch.Tensor
    shared_gate_up: torch.Tensor
    shared_act: torch.Tensor
    shared: torch.Tensor
    up_columns: torch.Tensor
    out: torch.Tensor
    mailbox_index: int


def no_wait(what: int, tokens: int) -> None:
    """The ``wait`` of a virtual rank: nothing (one stream orders every rank's stages)."""


@dataclasses.dataclass(eq=False)
class WideRank:
    """What one wide rank's program reads and writes (everything on ``device``), for
    ``N`` ranks and ``R = max_rows``:

    * ``config``, ``rank``, ``ranks`` (``N``), ``max_rows``, ``device``, ``timeout_s`` (how
      long a poll waits for a mailbox word);
    * this rank's weights: ``front_weights`` BF16 ``[E/N + L/N, H]`` (router rows, latent
      down rows), ``shared_gate_up`` ``[2 S/N, H]``, ``shared_down`` ``[H, S/N]``, ``up``
      ``[H/N, L]``; and every rank's ``bias`` FP32 ``[E]`` and ``latent_norm`` BF16 ``[L]``;
    * ``engine``: the experts engine of every expert's TP slice ``shard=(rank, N)``;
    * ``buffers``: this rank's own outputs, ``logits`` FP32 ``[R, E]``, ``latent`` BF16
      ``[R, L]``, ``weights`` FP32 / ``ids`` int32 ``[R, K]``, ``codes`` E4M3 ``[R, L]``,
      ``scales`` uint8 ``[R, L/32]``, ``rows`` BF16 ``[R K, L]``, ``partial`` BF16 ``[R, L]``
      (read by every rank's latent all-reduce), ``routed``, ``normed`` BF16 ``[R, L]``,
      ``gate_up`` ``[R, 2 S/N]``, ``act`` ``[R, S/N]``, ``out`` ``[R, H]``;
    * ``mailbox`` int16 ``[2, R, L + 2E]``: this rank's rotating mailbox buffers;
    * ``shared`` and ``up_columns``: per mailbox buffer (index ``calls % 2``), this rank's
      shared-expert partial BF16 ``[R, H]`` and up-projection columns ``[R, H/N]`` (read
      by every rank's hidden all-reduce; a virtual rank has one of each, listed twice);
    * the int64 ``[N]`` address tables: ``mailbox_table`` (every rank's mailbox),
      ``partial_table`` (every rank's ``partial``), ``shared_tables`` and ``up_tables``
      (per mailbox buffer, every rank's ``shared`` and ``up_columns``);
    * ``error``: the poll's error record (``fast.schedules.wide_kernels.ERROR_FIELDS``);
    * ``side``: the side stream of the shared expert; ``kernels``: the compiled
      ``publish``, ``route``, ``latent_all_reduce`` and ``hidden_all_reduce`` kernels
      (``fast.schedules.wide.compiled_kernel``);
    * ``wait(what, tokens)``: called after the finalize (``what`` 0: the routed partials)
      and after the up columns (1: the hidden partials); :func:`no_wait` for a virtual rank;
    * ``gemms``: None (the four GEMMs on cuBLAS) or the batch-invariant mode's
      ``fast.gemm.DenseGemm`` per GEMM that runs on it, by
      ``fast.schedules.wide_gemms.WIDE_GEMMS`` name (their weights are the ones above; the
      front's may be a view of a zero-padded copy); a GEMM without one runs on cuBLAS,
      without split-K in that mode (:func:`stock_may_split_k`);
    * per call: ``front`` (the last front stage's FP32 output) and ``shared_ready`` (the
      side stream's event of the last shared stage; None after a serial one).
    """

    config: object
    rank: int
    ranks: int
    max_rows: int
    device: torch.device
    timeout_s: float
    front_weights: torch.Tensor
    shared_gate_up: torch.Tensor
    shared_down: torch.Tensor
    up: torch.Tensor
    bias: torch.Tensor
    latent_norm: torch.Tensor
    engine: object
    buffers: dict
    mailbox: torch.Tensor
    shared: tuple
    up_columns: tuple
    mailbox_table: torch.Tensor
    partial_table: torch.Tensor
    shared_tables: tuple
    up_tables: tuple
    error: torch.Tensor
    side: object
    kernels: dict
    wait: Callable[[int, int], None] = no_wait
    gemms: dict | None = None
    front: torch.Tensor | None = None
    shared_ready: object = None

    @property
    def columns(self) -> int:
        """This rank's up-projection columns, ``H / N``."""
        return self.config.hidden // self.ranks


@dataclasses.dataclass
class WideCall:
    """One rank's state through one call: its tokens ``x`` BF16 ``[T, H]`` and ``tokens``
    (``T``), the mailbox buffer ``index`` (``calls % 2``), the call's options (``order``,
    ``shared``, ``side_delay_cycles`` as ``WideLayer.__call__``) and, after the last step,
    its ``outputs`` (:class:`WideRankOutputs`)."""

    x: torch.Tensor
    tokens: int
    index: int
    order: str = "side"
    shared: str = DEFAULT_SHARED_PLACEMENT
    side_delay_cycles: int = 0
    outputs: WideRankOutputs | None = None


def as_int32(word: int) -> int:
    """A 32-bit pattern as the signed value an int32 tensor holds."""
    return word - (1 << 32) if word >= 1 << 31 else word


def mm_bf16_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *,
                 split_k: bool = True) -> None:
    """``out = a @ b^T`` in BF16 (cuBLAS, FP32 accumulation, one rounding: the call of
    ``fast.stock.mm_bf16`` writing into a given buffer; ``split_k=False``: cuBLASLt without
    split-K, ``fast.stock.fp32_reduction``)."""
    with stock.fp32_reduction(split_k):
        torch.mm(a, b.t(), out=out)


def _addmm_bf16_into(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *,
                     split_k: bool = True) -> None:
    """``out = c + a @ b^T`` in BF16 (cuBLAS ``addmm``: ``fast.stock.addmm_bf16`` writing
    into a given buffer; ``split_k`` as :func:`mm_bf16_into`). ``c`` may be ``out`` itself
    (accumulated in place, no copy) or another tensor, which torch copies into ``out``
    first."""
    with stock.fp32_reduction(split_k):
        torch.addmm(c, a, b.t(), out=out)


def stock_may_split_k(rank: WideRank) -> bool:
    """Whether the rank's cuBLAS GEMMs may split K: in the default mode (no ``gemms``);
    not in the batch-invariant mode, whose GEMMs without a ``fast.gemm`` one
    (``invariant_gemms="stock"``) run on cuBLASLt with split-K forbidden."""
    return rank.gemms is None


def rank_gemm_bf16_into(rank: WideRank, name: str, a: torch.Tensor, out: torch.Tensor) -> None:
    """``out = a @ W^T`` in BF16 for the rank's GEMM ``name`` (``"shared_gate_up"`` or
    ``"shared_down"``, the weight of that name): FP32 accumulation, one rounding; cuBLAS
    (:func:`mm_bf16_into`, split-K as :func:`stock_may_split_k`), or the
    rank's ``fast.gemm`` GEMM of that name when its ``gemms`` hold one."""
    gemm = (rank.gemms or {}).get(name)
    if gemm is None:
        mm_bf16_into(a, getattr(rank, name), out, split_k=stock_may_split_k(rank))
    else:
        gemm(a, out=out)


# -- one rank's stages ----------------------------------------------------------------------

def front_stage(rank: WideRank, x: torch.Tensor) -> torch.Tensor:
    """The rank's FP32-out GEMM ``x @ [gate_r; down_r]^T`` (cuBLAS, or its ``fast.gemm``
    GEMM when it has ``gemms``): FP32 ``[T, E/N + L/N]``, one rounding to FP32, kept in
    ``rank.front`` for this call's outputs."""
    if "front" not in (rank.gemms or {}):
        rank.front = stock.mm_fp32_out(x, rank.front_weights)
    else:
        rank.front = rank.gemms["front"](x, out_dtype=torch.float32)
    return rank.front


def shared_stage(rank: WideRank, x: torch.Tensor, index: int, *, order: str = "side",
                 side_delay_cycles: int = 0):
    """The rank's shared-expert partial into its ``shared[index]`` buffer: ``h = x @
    gate_up_r^T``, ``act = situ_and_mul(h)``, ``act @ down_r^T`` (BF16 at each; the GEMMs
    by :func:`rank_gemm_bf16_into`); then its
    columns ``cols_r`` copied into ``up_columns[index]``, the addend :func:`latent_stage`
    accumulates into in place (the copy ``torch.addmm`` would otherwise make on the main
    stream after the latent all-reduce). With ``order="side"`` on the side stream (it
    waits for the current stream first). Returns the event :func:`latent_stage` waits on
    (None when serial), also kept in ``rank.shared_ready``."""
    c, tokens = rank.config, x.shape[0]
    main = torch.cuda.current_stream(rank.device)
    side = rank.side if order == "side" else main
    if side is not main:
        side.wait_stream(main)
    with torch.cuda.stream(side):
        if side is not main and side_delay_cycles:
            torch.cuda._sleep(int(side_delay_cycles))
        b = rank.buffers
        h = b["gate_up"][:tokens]
        rank_gemm_bf16_into(rank, "shared_gate_up", x, h)
        act = activation.situ_and_mul(h, beta=c.situ_beta, linear_beta=c.situ_linear_beta,
                                      out=b["act"][:tokens])
        rank_gemm_bf16_into(rank, "shared_down", act, rank.shared[index][:tokens])
        cols = slice(rank.rank * rank.columns, (rank.rank + 1) * rank.columns)
        rank.up_columns[index][:tokens].copy_(rank.shared[index][:tokens, cols])
    rank.shared_ready = side.record_event() if side is not main else None
    return rank.shared_ready


def publish_stage(rank: WideRank, front: torch.Tensor, tokens: int, index: int) -> None:
    """``WidePublish``: the rank's front rows into every rank's mailbox buffer ``index``
    (``PublishKernel``). ``front``: FP32 ``[T, E/N + L/N]`` contiguous."""
    from cutlass import Int32, Int64

    c, n = rank.config, rank.ranks
    width = c.experts // n + c.latent // n
    if front.dtype != torch.float32 or tuple(front.shape) != (tokens, width) \
            or not front.is_contiguous() or front.device != rank.device \
            or front.data_ptr() % 16:
        raise ValueError(f"WideLayer.publish_stage: front must be contiguous 16-byte aligned "
                         f"FP32 [{tokens}, {width}] on {rank.device}")
    rank.kernels["publish"](Int64(front.data_ptr()), Int64(rank.mailbox_table.data_ptr()),
                            Int32(rank.rank), Int32(index), Int32(rank.max_rows),
                            Int32(tokens), backend.stream(rank.device))


def route_stage(rank: WideRank, tokens: int, index: int) -> None:
    """The rank's polled routing in one kernel (``fast.schedules.wide_route.
    PolledRouteKernel``): the poll of its mailbox buffer ``index`` (logits and latent out,
    slots re-armed), the MXFP8 plan rows of the latent (``fast.mx``'s quantizer) and the
    router (``fast.router``'s) over the polled logits, each pair appended to the rank's
    engine's routing lists. Those appends are the next :func:`experts_stage`'s input: a
    second route stage before it makes that experts stage compute nothing and the layer's
    ``check`` raise ``EngineError`` (its lists hold more pairs than the call's); the
    virtual layer's ``reset`` drops them."""
    from cutlass import Float32, Int32, Int64

    c, b, engine = rank.config, rank.buffers, rank.engine
    rank.kernels["route"](Int64(rank.mailbox.data_ptr()), Int64(b["logits"].data_ptr()),
                          Int64(b["latent"].data_ptr()), Int64(b["codes"].data_ptr()),
                          Int64(b["scales"].data_ptr()), Int64(rank.error.data_ptr()),
                          Int64(int(rank.timeout_s * 1e9)), backend.ptr(rank.bias, "f32", 4),
                          backend.ptr(b["weights"], "f32", 4), backend.ptr(b["ids"], "i32", 4),
                          Float32(c.routed_scaling_factor), Int32(rank.rank), Int32(index),
                          Int32(rank.max_rows), Int64(engine.plan.data_ptr()),
                          Int64(engine.lists.data_ptr()), Int64(engine.work.data_ptr()),
                          Int32(engine.max_rows), Int32(tokens), backend.stream(rank.device))


def experts_stage(rank: WideRank, tokens: int) -> None:
    """The rank's listed engine (every expert's TP slice) over the plan rows: its partial
    expert rows ``[T K, L]``."""
    b, k = rank.buffers, rank.config.top_k
    codes, scales = b["codes"][:tokens], b["scales"][:tokens]
    rank.engine(codes, scales, b["ids"][:tokens], out=b["rows"][: tokens * k],
                validate=False, listed=True)


def finalize_stage(rank: WideRank, tokens: int) -> None:
    """The rank's Finalize of its partial rows: its BF16 partial of the routed latent."""
    b, k = rank.buffers, rank.config.top_k
    finalize.finalize(b["rows"][: tokens * k], b["weights"][:tokens], out=b["partial"][:tokens])


def latent_stage(rank: WideRank, tokens: int, index: int, *, wait_shared: bool = True) -> None:
    """The rank's latent all-reduce fused with the RMSNorm (``LatentAllReduceNormKernel``,
    every rank's partial in rank order), then (after the shared expert) its up-projection
    columns ``shared_r[:, cols_r] + normed @ up_r^T`` in place in ``up_columns[index]``,
    which :func:`shared_stage` filled with ``shared_r[:, cols_r]``: cuBLAS addmm (the call
    of an out-of-place ``addmm``, which copies its addend into its output first: the same
    bits; the product rounded to BF16, then the sum), or, when the rank has ``gemms``, its
    ``fast.gemm`` up GEMM with that addend added to the FP32 sum before the one rounding.

    ``wait_shared``: before the addmm, the current stream waits for ``rank.shared_ready``
    (the event of the last :func:`shared_stage` on the side stream; none after a serial
    one). Pass False to time this stage alone, without the shared expert: the addmm then
    reads whatever the ``shared`` buffer holds (what an earlier shared stage left there),
    and the event (which may belong to another graph's capture) is neither waited on nor
    changed, and the addmm accumulates into whatever the ``up`` buffer holds."""
    from cutlass import Float32, Int32, Int64

    c, b = rank.config, rank.buffers
    rank.kernels["latent_all_reduce"](
        Int64(rank.partial_table.data_ptr()), Int64(b["routed"].data_ptr()),
        Int64(rank.latent_norm.data_ptr()), Int64(b["normed"].data_ptr()),
        Float32(c.rms_eps), Int32(tokens), backend.stream(rank.device))
    if wait_shared and rank.shared_ready is not None:
        torch.cuda.current_stream(rank.device).wait_event(rank.shared_ready)
    up = rank.up_columns[index][:tokens]
    if "up" not in (rank.gemms or {}):
        _addmm_bf16_into(up, b["normed"][:tokens], rank.up, up, split_k=stock_may_split_k(rank))
    else:
        rank.gemms["up"](b["normed"][:tokens], addend=up, out=up)


def hidden_stage(rank: WideRank, tokens: int, index: int) -> None:
    """The rank's all-reduce of the hidden partials (``HiddenAllReduceKernel``: every
    rank's ``shared[index]`` and ``up_columns[index]``) into its ``out`` buffer."""
    from cutlass import Int32, Int64

    rank.kernels["hidden_all_reduce"](
        Int64(rank.shared_tables[index].data_ptr()), Int64(rank.up_tables[index].data_ptr()),
        Int64(rank.buffers["out"].data_ptr()), Int32(tokens), backend.stream(rank.device))


def rank_outputs(rank: WideRank, tokens: int, index: int) -> WideRankOutputs:
    """The rank's :class:`WideRankOutputs` of the stages run last with ``tokens`` rows and
    mailbox buffer ``index`` (views into its buffers; ``front`` is the last one its front
    stage made)."""
    b, engine, k = rank.buffers, rank.engine, rank.config.top_k
    counts_at = engine.layout.count
    codes, scales = b["codes"][:tokens], b["scales"][:tokens]
    return WideRankOutputs(
        front=rank.front, logits=b["logits"][:tokens], latent=b["latent"][:tokens],
        weights=b["weights"][:tokens], ids=b["ids"][:tokens], codes=codes, scales=scales,
        lists=engine.lists, counts=engine.work[counts_at:counts_at + rank.config.experts],
        rows=b["rows"][: tokens * k], routed_partial=b["partial"][:tokens],
        routed=b["routed"][:tokens], normed=b["normed"][:tokens],
        shared_gate_up=b["gate_up"][:tokens], shared_act=b["act"][:tokens],
        shared=rank.shared[index][:tokens], up_columns=rank.up_columns[index][:tokens],
        out=b["out"][:tokens], mailbox_index=index)


# -- the program ----------------------------------------------------------------------------

def shared_expert(rank: WideRank, call: WideCall) -> None:
    """The call's shared stage (its ``order`` and ``side_delay_cycles``)."""
    shared_stage(rank, call.x, call.index, order=call.order,
                 side_delay_cycles=call.side_delay_cycles)


def shared_first(rank: WideRank, call: WideCall) -> None:
    """Step 1: with the placement ``"front"``, the shared expert at the start of the call."""
    if call.shared == "front":
        shared_expert(rank, call)


def front_and_publish(rank: WideRank, call: WideCall) -> None:
    """Step 2: the front GEMM and its publish into every rank's mailbox."""
    publish_stage(rank, front_stage(rank, call.x), call.tokens, call.index)


def routed(rank: WideRank, call: WideCall) -> None:
    """Step 3: the polled routing, the experts and the Finalize (the shared expert beside
    the experts or after them, by placement); then the wait for every rank's partial."""
    route_stage(rank, call.tokens, call.index)
    if call.shared == "beside":
        shared_expert(rank, call)
    experts_stage(rank, call.tokens)
    if call.shared == "tail":
        shared_expert(rank, call)
    finalize_stage(rank, call.tokens)
    rank.wait(0, call.tokens)


def latent(rank: WideRank, call: WideCall) -> None:
    """Step 4: the latent all-reduce with the RMSNorm and the up columns; then the wait
    for every rank's hidden partials."""
    latent_stage(rank, call.tokens, call.index)
    rank.wait(1, call.tokens)


def hidden(rank: WideRank, call: WideCall) -> None:
    """Step 5: the hidden all-reduce; the rank's outputs."""
    hidden_stage(rank, call.tokens, call.index)
    call.outputs = rank_outputs(rank, call.tokens, call.index)


#: S2's rank program: the steps of one rank, in order (each ends with the rank's wait
#: where it needs its peers' writes).
WIDE_STEPS = (shared_first, front_and_publish, routed, latent, hidden)


class WideStageCalls:
    """The public per-stage calls of a wide layer (virtual or real) by rank index, each one
    function of the rank program on ``self.rank_resources(r)`` with the mailbox buffer
    ``self.mailbox_index`` (a benchmark times one rank's stages by replaying them after a
    full call filled the peers' buffers), and the CUDA-graph capture of a call. A layer
    provides ``rank_resources(r)`` (:class:`WideRank`), ``local_ranks`` (the ranks it
    holds), ``calls`` (its call count), ``device`` and ``__call__``."""

    @property
    def mailbox_index(self) -> int:
        """The rotating mailbox buffer the next call (or stage) uses: ``calls % 2``."""
        return self.calls % MAILBOX_BUFFERS

    def front_stage(self, r: int, x: torch.Tensor) -> torch.Tensor:
        """:func:`front_stage` of rank ``r``."""
        return front_stage(self.rank_resources(r), x)

    def shared_stage(self, r: int, x: torch.Tensor, *, order: str = "side",
                     side_delay_cycles: int = 0):
        """:func:`shared_stage` of rank ``r``."""
        return shared_stage(self.rank_resources(r), x, self.mailbox_index, order=order,
                            side_delay_cycles=side_delay_cycles)

    def publish_stage(self, r: int, front: torch.Tensor, tokens: int) -> None:
        """:func:`publish_stage` of rank ``r``."""
        publish_stage(self.rank_resources(r), front, tokens, self.mailbox_index)

    def route_stage(self, r: int, tokens: int) -> None:
        """:func:`route_stage` of rank ``r``."""
        route_stage(self.rank_resources(r), tokens, self.mailbox_index)

    def experts_stage(self, r: int, tokens: int) -> None:
        """:func:`experts_stage` of rank ``r``."""
        experts_stage(self.rank_resources(r), tokens)

    def finalize_stage(self, r: int, tokens: int) -> None:
        """:func:`finalize_stage` of rank ``r``."""
        finalize_stage(self.rank_resources(r), tokens)

    def latent_stage(self, r: int, tokens: int, *, wait_shared: bool = True) -> None:
        """:func:`latent_stage` of rank ``r``."""
        latent_stage(self.rank_resources(r), tokens, self.mailbox_index, wait_shared=wait_shared)

    def hidden_stage(self, r: int, tokens: int) -> None:
        """:func:`hidden_stage` of rank ``r``."""
        hidden_stage(self.rank_resources(r), tokens, self.mailbox_index)

    @property
    def batch_invariant(self) -> bool:
        """Whether every token's outputs are bitwise independent of the batch it is decoded
        in: the GEMMs on ``fast.gemm`` with one K split each (``fast.schedules.wide_gemms``),
        the others (``invariant_gemms="stock"``) on cuBLASLt without split-K; every other
        stage is row-wise or sums in a fixed rank or slot order."""
        return self.rank_resources(self.local_ranks[0]).gemms is not None

    def gemm_plan(self, r: int, tokens: int) -> dict:
        """What each GEMM of rank ``r`` runs at ``tokens`` rows (``WIDE_GEMMS`` name ->
        ``fast.gemm.Launch``: tactic, K split, token chunks, windows; or the
        ``fast.gemm.TiledGemm`` of a tiled form, ``DenseGemm.plan``); GEMMs on cuBLAS are
        absent (all four by default)."""
        gemms = self.rank_resources(r).gemms
        return {} if gemms is None else {name: g.plan(tokens) for name, g in gemms.items()}

    def outputs(self, r: int, tokens: int) -> WideRankOutputs:
        """:func:`rank_outputs` of rank ``r`` (the stages run last with ``tokens`` rows)."""
        return rank_outputs(self.rank_resources(r), tokens, self.mailbox_index)

    def graph(self, xs, *, order: str = "side", shared: str = DEFAULT_SHARED_PLACEMENT):
        """Capture one call on the static inputs ``xs`` in CUDA graphs, one per mailbox
        buffer (both streams, forked from and joined back into the capture stream);
        returns ``(replay, outputs)``: ``replay()`` reruns the whole layer on whatever
        ``xs`` then hold, alternating the graphs as eager calls alternate the buffers
        (eager calls and replays may be interleaved), and returns that graph's outputs.
        The stage outputs that live in the layer's buffers are the same tensors for both
        graphs; ``front`` is each graph's own."""
        self(xs, order=order, shared=shared)  # compile and warm every kernel outside the capture
        torch.cuda.synchronize(self.device)
        first = self.calls
        captured = []
        capture = torch.cuda.Stream(self.device)
        for _ in range(MAILBOX_BUFFERS):
            graph = torch.cuda.CUDAGraph()
            capture.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(capture):
                with torch.cuda.graph(graph, stream=capture):
                    outputs = self(xs, check=False, order=order, shared=shared)
            torch.cuda.current_stream(self.device).wait_stream(capture)
            captured.append((graph, outputs))
        torch.cuda.synchronize(self.device)
        self.calls = first  # capturing ran nothing: the next call is still call `first`

        def replay():
            graph, outputs = captured[(self.calls - first) % MAILBOX_BUFFERS]
            graph.replay()
            self.calls += 1
            return outputs

        return replay, captured[0][1]
