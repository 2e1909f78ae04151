"""S1, the DEP layer, over real ranks: one process per GPU, the owners' receive buffers and
partials in torch symmetric memory, reached by unicast peer stores and loads (never a
multicast object).

Each rank runs the rank program of a virtual rank of ``fast.schedules.dep.DepLayer``
(``fast.schedules.dep_program.DEP_STEPS`` on this rank's ``DepRank``: the same stages and
kernels); only the addresses in the kernels' tables differ (peer addresses from the
symmetric-memory handle), and two waits join the ranks (the rank's ``wait`` hook, which
the program calls after the dispatch and after the owner finalize)::

    dense part (fast.schedules.dense.DenseFront; router and shared expert on a side stream)
    DispatchKernel(signal)      my tokens -> every owner's receive rows rank*T + t;
                                each CTA then adds 1 to the owner's arrival counter for me
    ArrivalWaitKernel           until every source's counter here grew by T (receive rows)
    ExpertsEngine               my experts over the N*T receive rows
    OwnerFinalizeKernel(signal) my partial of each receive row; the CTA of row s*T + t adds
                                1 to home s's counter for me
    ArrivalWaitKernel           until every owner's counter here grew by T (owner partials)
    CombineKernel               owners' partials of my tokens (peer loads) in owner order,
                                fused with the RMSNorm
    up-projection               shared + normed @ up^T

The bits of every output equal those of the virtual layer's rank (the same kernels on the
same data; ``verify/test_dep_peer.py`` compares them), so the stage contracts of
``verify/test_dep_fast.py`` carry over.

Buffer reuse needs no extra barrier: an owner overwrites its partials (call k+1) only
after every source dispatched call k+1, which each did after its combine of call k read
those partials; a source overwrites an owner's receive rows (call k+1) only after that
owner's partials of call k arrived, which the owner wrote after its experts read the rows.
The host, though, may read a call's outputs later than that: the receive rows a call
returns are live views unless it is asked to keep a copy (``keep_received``).

Every rank must call the layer with the same ``T`` (the DEP padding contract). A wait
whose peer does not arrive within ``timeout_s`` records which rank it waited for and what
for; the next :meth:`DepPeerLayer.check` raises :class:`fast.device.arrival.ArrivalTimeout`
naming them. The counters only grow, so a call can be captured in a CUDA graph and
replayed.
"""

from __future__ import annotations

import torch

from fast import backend
from fast.gemm.mma_kind import resolve_dense_mode
from fast.schedules.dense import DenseFront
from fast.schedules.dep import compiled_kernel, check_token_rows, kernel_params
from fast.schedules.dep_program import DEP_STEPS, DepCall, DepRank, DepRankOutputs
from fast.schedules.steps import run_steps
from fast.schedules.symmetric import SymmetricBuffer, meet, pack, process_group
from model.weights import LatentMoEWeights

__all__ = ["DepPeerLayer", "DepPeerScratch", "symmetric_layout", "WAITS"]

#: What each of a call's two waits waits for, by index (``ArrivalWaitKernel``'s ``what``).
WAITS = ("receive rows", "owner partials")


def symmetric_layout(config, ranks: int, max_tokens: int) -> tuple[dict, int]:
    """Byte offsets, shapes and dtypes of one rank's symmetric buffer, and its size: the
    receive rows of ``N * max_tokens`` (E4M3 codes as uint8 ``[R, L]``, E8M0 scales
    ``[R, L/32]``, int32 ids and FP32 weights ``[R, K]``), the BF16 partials ``[R, L]``,
    and the arrival counters (uint32 ``[len(WAITS), N]``: one per wait and peer, as int32).
    Every field starts on a 256-byte boundary (``fast.schedules.symmetric.pack``)."""
    rows, c = ranks * max_tokens, config
    return pack({
        "codes": ((rows, c.latent), torch.uint8),
        "scales": ((rows, c.latent // 32), torch.uint8),
        "ids": ((rows, c.top_k), torch.int32),
        "weights": ((rows, c.top_k), torch.float32),
        "partials": ((rows, c.latent), torch.bfloat16),
        "arrivals": ((len(WAITS), ranks), torch.int32),
    })


class DepPeerScratch:
    """One rank's buffers of the DEP layer over real ranks, allocated once at the widest
    batch and shared by every layer of the model (the layers run one after another on one
    stream, every rank calling them in the same order):

    * ``buffers``: views of the symmetric buffer (``symmetric_layout``): receive rows,
      partials, arrival counters;
    * ``dispatch_table`` int64 ``[N, 4]``, ``combine_table`` int64 ``[N]`` and
      ``arrival_tables`` (two int64 ``[N]``): the peers' addresses the kernels write and
      read through;
    * ``rows``: BF16 ``[N*T*K, L]`` the engine's rows of this rank's pairs;
    * ``expected`` int32 ``[2]``: the count every arrival counter held after the last wait;
    * ``error`` int32 ``WAIT_ERROR_FIELDS``: the first timed-out wait;
    * ``engine``: the experts engine's ``EngineScratch`` (made by the first layer).

    Construction is collective over ``group`` (the symmetric buffer's rendezvous).
    """

    def __init__(self, config, *, max_tokens: int, group=None, device=None):
        from fast.device.arrival import WAIT_ERROR_FIELDS

        group, rank, ranks = process_group("DepPeerScratch", group)
        if config.experts % ranks:
            raise ValueError(f"DepPeerScratch: {ranks} ranks must divide E={config.experts} "
                             "(each rank owns E/N experts)")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"DepPeerScratch: max_tokens must be a positive int, got {max_tokens!r}")
        device = backend.cuda_device("DepPeerScratch", device)
        self.config, self.group, self.rank, self.ranks = config, group, rank, ranks
        self.max_tokens, self.device = max_tokens, device
        self.layout, size = symmetric_layout(config, ranks, max_tokens)
        symmetric = SymmetricBuffer(self.layout, size, group, device)
        self._symmetric, self.buffers = symmetric.tensor, symmetric.views
        self.dispatch_table = torch.tensor(
            [[symmetric.address(o, f) for f in ("codes", "scales", "ids", "weights")]
             for o in range(ranks)], dtype=torch.int64, device=device)
        self.combine_table = symmetric.table("partials")
        # my counter word at each receiver: wait 0 (receive rows) at owners, wait 1
        # (owner partials) at homes
        self.arrival_tables = [symmetric.table("arrivals", 4 * (w * ranks + rank))
                               for w in range(len(WAITS))]
        rows = ranks * max_tokens
        self.rows = torch.empty(rows * config.top_k, config.latent, dtype=torch.bfloat16,
                                device=device)
        self.expected = torch.zeros(len(WAITS), dtype=torch.int32, device=device)
        self.error = torch.zeros(len(WAIT_ERROR_FIELDS), dtype=torch.int32, device=device)
        self.engine = None
        meet(group, device)


class DepPeerLayer:
    """One real rank of S1 (this process, this GPU), reusable across calls.

    Args:
        weights: the layer's weights (any device); this rank's engine prepares its own
            experts ``[rank E/N, (rank+1) E/N)``.
        max_tokens, group, device: as :class:`DepPeerScratch` (only without ``scratch``).
        timeout_s: how long a wait for the peers' rows may take before it gives up.
        scratch: the buffers of the model's layers (:class:`DepPeerScratch`, shared: pass
            the first layer's ``.scratch`` to the others); default: a new one.
        dense_gemm: as ``fast.schedules.dep.DepLayer``'s (``"auto"``, default,
            ``"cublas"``, ``"fast"`` or ``"invariant_stock"``).
        batch_invariant: as ``fast.schedules.dep.DepLayer``'s (default True): every
            token's outputs bitwise independent of the batch it is decoded in (each dense
            GEMM sums every output element in one order at every batch).
        experts_tactic: the experts engine's FC kernel settings for every call
            (``fast.experts.ExpertsEngine``'s ``tactic``, e.g. ``{"wgmma": 1}``); default
            the engine's defaults.
        invariant_mma: as ``DepLayer``'s (the MMA of the fast.gemm dense GEMMs, default
            ``"auto"``); the same on every rank.
        invariant_overlap: as ``DepLayer``'s (None or a bool); the same on every rank.
        router_with_front: as ``DepLayer``'s; the same on every rank.

    Construction of a scratch is collective (every rank of the group must construct it).
    """

    #: ``fast.schedules.graphs.BucketGraphs``' input: this rank's tokens.
    virtual_ranks = False

    def __init__(self, weights: LatentMoEWeights, *, max_tokens: int | None = None, group=None,
                 device: str | torch.device | None = None, timeout_s: float = 10.0,
                 scratch: DepPeerScratch | None = None, dense_gemm: str = "auto",
                 batch_invariant: bool = True, experts_tactic: dict | None = None,
                 invariant_mma: str = "auto", invariant_overlap: bool | None = None,
                 router_with_front: bool = False):
        from fast.experts import experts_engine_for, prepare_experts_for
        from fast.experts.engine import EngineScratch

        if not isinstance(weights, LatentMoEWeights):
            raise TypeError(f"DepPeerLayer: weights must be LatentMoEWeights, got "
                            f"{type(weights).__name__}")
        if not timeout_s > 0:
            raise ValueError(f"DepPeerLayer: timeout_s must be positive, got {timeout_s!r}")
        backend.require_supported("DepPeerLayer")
        c = weights.config
        if scratch is None:
            scratch = DepPeerScratch(c, max_tokens=max_tokens, group=group, device=device)
        elif (max_tokens, group, device) != (None, None, None):
            raise ValueError("DepPeerLayer: pass either scratch or max_tokens/group/device (the "
                             "scratch fixes them)")
        elif not isinstance(scratch, DepPeerScratch):
            raise TypeError(f"DepPeerLayer: scratch must be DepPeerScratch, got "
                            f"{type(scratch).__name__}")
        elif scratch.config != c:
            raise ValueError("DepPeerLayer: the scratch was made for another config")
        self.scratch, self.config = scratch, c
        self.rank, self.ranks, self.group = scratch.rank, scratch.ranks, scratch.group
        self.max_tokens, self.device = scratch.max_tokens, scratch.device
        self.timeout_s = float(timeout_s)
        self.per = c.experts // self.ranks
        self.arch = backend.device_arch(self.device)
        mma, overlap = resolve_dense_mode("DepPeerLayer", batch_invariant, invariant_mma,
                                          invariant_overlap, self.arch)
        self.dense = DenseFront(weights, self.device, max_tokens=self.max_tokens,
                                gemm=dense_gemm, batch_invariant=batch_invariant,
                                invariant_mma=mma, invariant_overlap=overlap,
                                router_with_front=router_with_front)
        prepared = prepare_experts_for(self.arch, weights, self.device,
                                       experts=(self.rank * self.per, self.per))
        rows = self.ranks * self.max_tokens
        if scratch.engine is None:
            scratch.engine = EngineScratch(prepared.geometry, max_rows=rows, device=self.device)
        self.engine = experts_engine_for(self.arch, prepared, max_rows=rows, empty_rows=True,
                                         scratch=scratch.engine, tactic=experts_tactic)
        self.buffers, self.rows = scratch.buffers, scratch.rows
        self.dispatch_table, self.combine_table = scratch.dispatch_table, scratch.combine_table
        self.arrival_tables = scratch.arrival_tables
        self.expected, self.error = scratch.expected, scratch.error
        self._fn = {kind: compiled_kernel(kind, self.arch, p)
                    for kind, p in kernel_params(c, self.ranks, peers=True).items()}
        # this rank's resources of the rank program: the peers' addresses in the tables,
        # the arrival counters signalled and waited on
        self._resources = DepRank(
            config=c, rank=self.rank, ranks=self.ranks, device=self.device, dense=self.dense,
            engine=self.engine, buffers={**self.buffers, "rows": self.rows},
            dispatch_table=self.dispatch_table, combine_table=self.combine_table,
            kernels=self._fn, signal_tables=tuple(self.arrival_tables), wait=self._wait)
        self._prepared: set[int] = set()

    def rank_resources(self, r: int) -> DepRank:
        """This rank's resources of the rank program (``r`` must be :attr:`rank`)."""
        if r != self.rank:
            raise ValueError(f"DepPeerLayer: rank {r} is not this layer's rank {self.rank}")
        return self._resources

    # -- checks -------------------------------------------------------------------------

    def _check_input(self, x) -> int:
        return check_token_rows("DepPeerLayer", [x], ["x"], config=self.config,
                                device=self.device, max_tokens=self.max_tokens, unit="tokens")

    def _prepare(self, tokens: int) -> None:
        """Before the first call of ``tokens`` tokens: compile the engine's kernels for it
        and run the dense part once (its kernels compile on first use), then meet the
        peers (a collective barrier), so no rank's wait times out while another compiles."""
        import torch.distributed as dist

        self.engine.compile_for(self.ranks * tokens)
        self.dense(torch.zeros(tokens, self.config.hidden, dtype=torch.bfloat16,
                               device=self.device))
        torch.cuda.synchronize(self.device)
        dist.barrier(self.group)
        self._prepared.add(tokens)

    # -- the call -------------------------------------------------------------------------

    def __call__(self, x: torch.Tensor, *, check: bool = True, order: str = "side",
                 side_delay_cycles: int = 0, keep_received: bool = False) -> DepRankOutputs:
        """One layer step of this rank on its BF16 tokens ``x [T, H]`` (every rank passes
        the same ``T``). ``check``, ``order`` and ``side_delay_cycles`` as
        :meth:`fast.schedules.dep.DepLayer.__call__`. The first call of each ``T`` is
        collective on the host (:meth:`_prepare`); later ones launch without host
        synchronization (until ``check``).

        The receive rows are written by the peers: once this rank's partials of a call have
        reached them, a peer may start its next call and overwrite them, while this rank
        still reads the outputs. So by default ``recv_codes``, ``recv_scales``, ``recv_ids``
        and ``recv_weights`` are views valid only until any peer's next call;
        ``keep_received=True`` copies them on the stream after the experts and before the
        owner finalize signals the homes (four copies of ``N*T`` rows), and returns the
        copies. Every other output is written by this rank alone and stays valid until its
        own next call."""
        tokens = self._check_input(x)
        if tokens not in self._prepared:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"DepPeerLayer: T={tokens} is captured before an eager call "
                                   "of that T (use DepPeerLayer.graph)")
            self._prepare(tokens)
        call = DepCall(x, tokens, order=order, side_delay_cycles=side_delay_cycles,
                       keep_received=keep_received)
        run_steps(DEP_STEPS, [self._resources], [call])
        if check:
            self.check()
        return call.outputs

    def _wait(self, what: int, tokens: int) -> None:
        """The rank program's ``wait``: ``ArrivalWaitKernel`` on the current stream, until
        every peer's counter ``what`` here grew by ``tokens`` (``WAITS[what]``)."""
        from cutlass import Int32, Int64

        counters = self.buffers["arrivals"][what]
        self._fn["wait"](Int64(counters.data_ptr()), Int64(self.expected[what:].data_ptr()),
                         Int64(self.error.data_ptr()), Int64(int(self.timeout_s * 1e9)),
                         Int32(tokens), Int32(self.rank), Int32(what),
                         backend.stream(self.device))

    def check(self) -> None:
        """Raise the first error recorded since the layer was built: a wait that timed out
        (:class:`fast.device.arrival.ArrivalTimeout`, naming this rank, the peer and what
        it waited for; the layer's counters are then out of step with its peers' and it
        must be rebuilt), or an engine error (``EngineError``). Synchronizes the device."""
        from fast.device.arrival import WAIT_ERROR_FIELDS, wait_timeout

        record = dict(zip(WAIT_ERROR_FIELDS, (int(v) for v in self.error.tolist())))
        if record["code"]:
            raise wait_timeout("DEP", WAITS, record, self.ranks, self.timeout_s)
        self.engine.check()

    def graph(self, x: torch.Tensor, *, order: str = "side"):
        """Capture one call on the static input ``x`` in a CUDA graph (after an eager call
        of the same ``T``; every rank captures and then replays in step); returns
        ``(replay, outputs)`` as :meth:`fast.schedules.dep.DepLayer.graph`."""
        from fast.schedules.graphs import capture_call

        return capture_call(lambda check: self(x, check=check, order=order), self.device)
