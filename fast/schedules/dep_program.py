"""S1's rank program: one rank's stage sequence of the DEP layer, which the virtual ranks
(``fast.schedules.dep.DepLayer``, every rank in one process on one device) and the real
ranks (``fast.schedules.dep_peer.DepPeerLayer``, one rank per process) both run.

A rank is a :class:`DepRank`: its buffers and the address tables its kernels write and
read through, its kernels, its dense part and experts engine, and a ``wait(what, tokens)``
hook. The program is :data:`DEP_STEPS`, three steps each of which ends where a rank needs
its peers' writes::

    dense_and_dispatch  dense part (fast.schedules.dense.DenseFront; router and shared
                        expert on a side stream), DispatchKernel -> every owner's receive
                        rows rank*T + t; wait(0): the receive rows
    owner               experts engine over the N*T receive rows, OwnerFinalizeKernel ->
                        a BF16 partial per receive row; wait(1): the owner partials
    home                (wait for the shared expert) CombineKernel fused with the RMSNorm
                        -> routed, normed ; out = shared + normed @ up^T

:func:`fast.schedules.steps.run_steps` runs every step for every rank it is given before
the next step. The
virtual layer gives it all ``N`` ranks (one stream: an owner's experts may only start
after every source dispatched, which the launch order ensures; its ``wait`` does
nothing); the real rank gives it itself (its ``wait`` is the ``ArrivalWaitKernel`` on
its arrival counters). The kernels, their arguments and the stream order of one rank are
the same in both; only the addresses in the tables and the arrival counters differ.

Shapes and dtypes, for ``T`` tokens per rank and ``N`` ranks, are those of
:class:`DepRankOutputs`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from fast import backend

__all__ = ["DepRank", "DepCall", "DepRankOutputs", "DEP_STEPS", "dense_part", "dispatch",
           "run_experts", "owner_finalize", "combine", "home", "received_rows"]


@dataclasses.dataclass
class DepRankOutputs:
    """One rank's stage outputs of one call (views into the layer's buffers, valid until
    the next call), shapes for ``T`` tokens and ``N`` ranks:

    logits FP32 ``[T, E]``; weights FP32 / ids int32 ``[T, K]``; front BF16 ``[T, 2S + L]``;
    shared BF16 ``[T, H]``; codes float8_e4m3fn ``[T, L]``; scales uint8 ``[T, L/32]``;
    as owner: recv_codes ``[N*T, L]`` (uint8), recv_scales, recv_ids, recv_weights
    ``[N*T, ...]`` (row ``s*T + t`` = source ``s``'s token ``t``, poisoned where not sent),
    rows BF16 ``[N*T*K, L]`` (the engine's row of each local pair; other rows unspecified),
    partials BF16 ``[N*T, L]``; as home: routed, normed BF16 ``[T, L]``, out BF16 ``[T, H]``.
    """

    logits: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    front: torch.Tensor
    shared: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor
    recv_codes: torch.Tensor
    recv_scales: torch.Tensor
    recv_ids: torch.Tensor
    recv_weights: torch.Tensor
    rows: torch.Tensor
    partials: torch.Tensor
    routed: torch.Tensor
    normed: torch.Tensor
    out: torch.Tensor


def no_wait(what: int, tokens: int) -> None:
    """The ``wait`` of a virtual rank: nothing (one stream orders every rank's stages)."""


@dataclasses.dataclass(eq=False)
class DepRank:
    """What one DEP rank's program reads and writes (everything on ``device``):

    * ``config``, ``rank``, ``ranks`` (``N``), ``device``;
    * ``dense``: the dense part (``fast.schedules.dense.DenseFront``; the virtual ranks
      share one);
    * ``engine``: the experts engine of this rank's experts ``[rank E/N, (rank+1) E/N)``
      (DEP owner mode, empty rows allowed);
    * ``buffers``: this rank's owner buffers, sized for ``N * max_tokens`` receive rows:
      ``codes`` uint8 ``[R, L]``, ``scales`` uint8 ``[R, L/32]``, ``ids`` int32 and
      ``weights`` FP32 ``[R, K]`` (written by the sources' dispatch), ``rows`` BF16
      ``[R K, L]`` (the engine's), ``partials`` BF16 ``[R, L]`` (read by the homes'
      combine);
    * ``dispatch_table`` int64 ``[N, 4]`` (every owner's codes, scales, ids, weights) and
      ``combine_table`` int64 ``[N]`` (every owner's partials): the addresses the kernels
      write and read through;
    * ``kernels``: the compiled ``dispatch``, ``owner_finalize`` and ``combine`` kernels
      (``fast.schedules.dep.compiled_kernel``);
    * ``signal_tables``: the arrival-counter tables the dispatch and the owner finalize
      signal through (int64 ``[N]`` each), or ``None`` for a virtual rank (the kernels
      then get address 0 and signal nothing);
    * ``wait(what, tokens)``: called after the dispatch (``what`` 0: the receive rows) and
      after the owner finalize (1: the owner partials); :func:`no_wait` for a virtual rank.
    """

    config: object
    rank: int
    ranks: int
    device: torch.device
    dense: object
    engine: object
    buffers: dict
    dispatch_table: torch.Tensor
    combine_table: torch.Tensor
    kernels: dict
    signal_tables: tuple | None = None
    wait: Callable[[int, int], None] = no_wait

    @property
    def per(self) -> int:
        """Experts per rank, ``E / N``."""
        return self.config.experts // self.ranks

    def signal_address(self, what: int) -> int:
        """The address of arrival table ``what`` (0 for a virtual rank: no signal)."""
        return 0 if self.signal_tables is None else self.signal_tables[what].data_ptr()


@dataclasses.dataclass
class DepCall:
    """One rank's state through one call: its tokens ``x`` BF16 ``[T, H]`` and ``tokens``
    (``T``), the call's options (``order``, ``side_delay_cycles`` as
    ``DepLayer.__call__``; ``keep_received`` as ``DepPeerLayer.__call__``), and what the
    steps leave for later steps: ``dense`` (``DenseOutputs``), ``received`` (the receive
    rows returned) and ``outputs`` (:class:`DepRankOutputs`, set by the last step)."""

    x: torch.Tensor
    tokens: int
    order: str = "side"
    side_delay_cycles: int = 0
    keep_received: bool = False
    dense: tuple | None = None
    received: dict | None = None
    outputs: DepRankOutputs | None = None


# -- one rank's stages ----------------------------------------------------------------------

def dense_part(rank: DepRank, x: torch.Tensor, *, order: str = "serial",
               side_delay_cycles: int = 0) -> tuple:
    """The rank's dense part (``fast.schedules.dense.DenseFront``) on its tokens ``x``
    BF16 ``[T, H]``: with ``order="side"`` the router and the shared expert run on the
    side stream; the current stream waits for the router before returning (the dispatch
    reads ids and weights) and for the shared expert in :func:`home`."""
    return rank.dense(x, order=order, side_delay_cycles=side_delay_cycles)


def dispatch(rank: DepRank, dense: tuple, tokens: int) -> None:
    """Source ``rank``'s tokens into every owner's receive rows ``rank*T + t``
    (``DispatchKernel``; a real rank's CTAs then signal the owners)."""
    from cutlass import Int32, Int64

    _, weights, ids, _, _, codes, scales, _ = dense
    rank.kernels["dispatch"](
        Int64(codes.data_ptr()), Int64(scales.data_ptr()), Int64(ids.data_ptr()),
        Int64(weights.data_ptr()), Int64(rank.dispatch_table.data_ptr()),
        Int64(rank.signal_address(0)), Int32(rank.rank), Int32(tokens), Int32(rank.ranks),
        backend.stream(rank.device))


def run_experts(rank: DepRank, tokens: int) -> None:
    """Owner ``rank``'s experts over its ``N*T`` receive rows into its ``rows``."""
    b, k, received = rank.buffers, rank.config.top_k, rank.ranks * tokens
    rank.engine(b["codes"][:received].view(torch.float8_e4m3fn), b["scales"][:received],
                b["ids"][:received], out=b["rows"][: received * k], validate=False)


def received_rows(rank: DepRank, tokens: int) -> dict:
    """Views of owner ``rank``'s ``N*T`` receive rows: ``codes``, ``scales``, ``ids``,
    ``weights``."""
    received = rank.ranks * tokens
    return {f: rank.buffers[f][:received] for f in ("codes", "scales", "ids", "weights")}


def owner_finalize(rank: DepRank, tokens: int) -> None:
    """Owner ``rank``'s partial of each receive row (``OwnerFinalizeKernel``; a real
    rank's CTA of row ``s*T + t`` then signals home ``s``)."""
    from cutlass import Int32, Int64

    b = rank.buffers
    rank.kernels["owner_finalize"](
        Int64(b["rows"].data_ptr()), Int64(b["weights"].data_ptr()), Int64(b["ids"].data_ptr()),
        Int64(b["partials"].data_ptr()), Int64(rank.signal_address(1)),
        Int32(rank.rank * rank.per), Int32(rank.per), Int32(tokens),
        Int32(rank.ranks * tokens), backend.stream(rank.device))


def combine(rank: DepRank, dense: tuple, tokens: int) -> tuple:
    """Home ``rank``'s combine of its owners' partials (owners in rank order, FP32) fused
    with the RMSNorm (the kernel alone): ``(routed, normed)``, BF16 ``[T, L]``."""
    from cutlass import Float32, Int32, Int64

    c = rank.config
    routed = torch.empty(tokens, c.latent, dtype=torch.bfloat16, device=rank.device)
    normed = torch.empty_like(routed)
    rank.kernels["combine"](Int64(dense.ids.data_ptr()), Int64(rank.combine_table.data_ptr()),
                            Int64(routed.data_ptr()), Int64(rank.dense.latent_norm.data_ptr()),
                            Int64(normed.data_ptr()), Float32(c.rms_eps), Int32(rank.rank),
                            Int32(tokens), backend.stream(rank.device))
    return routed, normed


def home(rank: DepRank, dense: tuple, tokens: int) -> tuple:
    """Home ``rank``'s combine fused with the RMSNorm, and the up-projection:
    ``(routed, normed, out)``. The wait for the side stream's shared expert comes before
    the combine, so the up-projection follows the combine directly (and overlaps it
    where it launches with programmatic dependent launch)."""
    rank.dense.wait_for_shared(dense)
    routed, normed = combine(rank, dense, tokens)
    return routed, normed, rank.dense.up_projection(dense, normed)


# -- the program ----------------------------------------------------------------------------

def dense_and_dispatch(rank: DepRank, call: DepCall) -> None:
    """Step 1: the dense part and the dispatch; then the wait for the receive rows."""
    call.dense = dense_part(rank, call.x, order=call.order,
                            side_delay_cycles=call.side_delay_cycles)
    dispatch(rank, call.dense, call.tokens)
    rank.wait(0, call.tokens)


def owner(rank: DepRank, call: DepCall) -> None:
    """Step 2: the owner's experts and partial finalize; then the wait for the owner
    partials. With ``keep_received`` the receive rows are copied between the two (before
    the owner finalize lets the sources start their next call)."""
    run_experts(rank, call.tokens)
    call.received = received_rows(rank, call.tokens)
    if call.keep_received:
        call.received = {f: t.clone() for f, t in call.received.items()}
    owner_finalize(rank, call.tokens)
    rank.wait(1, call.tokens)


def home_step(rank: DepRank, call: DepCall) -> None:
    """Step 3: the home's combine, RMSNorm and up-projection; the rank's outputs."""
    routed, normed, out = home(rank, call.dense, call.tokens)
    d, b, k = call.dense, rank.buffers, rank.config.top_k
    received = rank.ranks * call.tokens
    call.outputs = DepRankOutputs(
        logits=d.logits, weights=d.weights, ids=d.ids, front=d.front, shared=d.shared,
        codes=d.codes, scales=d.scales, recv_codes=call.received["codes"],
        recv_scales=call.received["scales"], recv_ids=call.received["ids"],
        recv_weights=call.received["weights"], rows=b["rows"][: received * k],
        partials=b["partials"][:received], routed=routed, normed=normed, out=out)


#: S1's rank program: the steps of one rank, in order (each ends with the rank's wait
#: where it needs its peers' writes).
DEP_STEPS = (dense_and_dispatch, owner, home_step)

