"""S2, the wide layer, over real ranks: one process per GPU (one TP rank each), every buffer
a peer writes or reads in one torch symmetric-memory buffer per rank, reached by unicast
peer stores and loads (never a multicast object).

Each rank runs the rank program of the virtual layer's ranks
(``fast.schedules.wide_program.WIDE_STEPS`` on this rank's ``WideRank``, the same code and
kernels as :class:`fast.schedules.wide.WideLayer`); only the address tables differ (peer addresses from the symmetric-memory handle), and two signal/wait pairs
join the ranks where a kernel reads what a peer wrote with kernels that cannot signal
(cuBLAS, ``fast.finalize``): the rank's ``wait`` hook, which the program calls after the
Finalize and after the up columns::

    side : shared_stage   shared partial -> shared[c % 2] (symmetric) ─────────────┐
    main : front_stage, publish_stage   my front -> every rank's mailbox c % 2      │
                          (Lamport words: self-synchronizing, no signal)           │
           route_stage    poll my mailbox (sentinel + %globaltimer timeout), re-arm │
           experts_stage, finalize_stage -> partial (symmetric)                     │
           signal 0       ArrivalSignalKernel: +1 on my counter at every rank       │
           wait 0         ArrivalWaitKernel: every rank's counter 0 here grew by 1  │
           latent_stage   LatentAllReduceNormKernel over every rank's partial;      │
                          (wait side) up = shared[:, cols] + normed @ up^T ◄────────┘
                          -> up (symmetric)
           signal 1, wait 1   the same for the hidden partials (shared[c % 2] and up)
           hidden_stage   HiddenAllReduceKernel over every rank's shared and up -> out

Shapes, dtypes and rounding points are the virtual layer's (``fast.schedules.wide``), and
so are the bits: every output of a real rank equals the virtual layer's same rank on the
same inputs (``verify/test_wide_peer.py`` compares them), so the stage contracts of
``verify/test_wide_fast.py`` carry over.

Buffer reuse across calls (call ``c`` of every rank; ``A -> B``: B is after A in one
rank's stream order, or B acquired a count A released; both order memory at system
scope). Every overwrite below is after the last read of the previous contents:

* mailbox buffer ``c % 2`` of rank ``d`` (written by every writer ``w`` in call ``c + 2``;
  read and re-armed by ``d``'s poll in call ``c``): ``d``'s poll ``c`` -> ``d``'s signal 0
  of call ``c + 1`` -> ``w``'s wait 0 of call ``c + 1`` -> ``w``'s publish ``c + 2``. The
  re-arm stores are before that release, so the sentinels land before the new words
  (with one buffer the chain through signal 1 of call ``c`` would do as well; the two
  rotating buffers are the virtual layer's, kept so both run the same stages);
* partial of rank ``r`` (read by every rank ``o``'s latent all-reduce of call ``c``,
  rewritten by ``r``'s finalize of call ``c + 1``): ``o``'s latent stage ``c`` -> ``o``'s
  signal 1 of call ``c`` -> ``r``'s wait 1 of call ``c`` -> ``r``'s finalize ``c + 1``;
* up of rank ``r`` (read by ``o``'s hidden all-reduce of call ``c``): the shared stage
  copies the addend of the up columns into it on the side stream, before any wait of its
  call, so it rotates with the mailbox as ``shared`` does (below): buffer ``c % 2``,
  rewritten in call ``c + 2`` (the copy, then the addmm): ``o``'s hidden stage ``c`` ->
  ``o``'s signal 0 of call ``c + 1`` -> ``r``'s wait 0 of call ``c + 1`` -> ``r``'s
  shared stage ``c + 2``;
* shared of rank ``r``: the shared expert runs on the side stream from the *start* of the
  call, before any wait, so one buffer would race with a slower peer's hidden all-reduce
  of the previous call. It rotates with the mailbox: buffer ``c % 2``, rewritten in call
  ``c + 2`` after ``r``'s wait 0 of call ``c + 1`` (the side stream waits for the main
  stream at the start of each call), which follows ``o``'s hidden stage ``c`` as above.
* the counters only grow (by 1 per call, per wait and per peer; the wait keeps its
  target in ``expected``), so they need no re-arm, and a CUDA graph replays the same
  launches.

The signal kernel runs after its writers in stream order (a kernel boundary: their
stores are complete), then fences at system scope and adds with ``red.release.sys``; the
wait loads with ``ld.acquire.sys``; the all-reduces then load peers' rows with
``ld.global.nc`` in a later kernel (their rows do not change while it runs: the reuse
analysis above).

``WidePeerLayer(batch_invariant=True)`` (the default) runs the rank's GEMMs as the
virtual layer does (the front on ``fast.gemm`` with one K split at every row count, the
others on cuBLASLt without split-K, or with ``invariant_gemms="fast"`` all four on
``fast.gemm``; ``fast.schedules.wide_gemms``), so a real rank's bits stay the virtual
rank's: every token's outputs bitwise
independent of the batch it is decoded in (``fast.schedules.wide``'s "Batch invariance":
the other stages are row-wise, the two all-reduces sum every rank's row in rank order).

Every rank must call the layer with the same ``T`` (the wide bucket's contract: every
rank holds the same tokens). A poll or a wait that gives up after ``timeout_s`` records
who and what; :meth:`WidePeerLayer.check` raises :class:`fast.device.arrival.ArrivalTimeout`
(``what`` ``"mailbox"`` for the poll, the wait's name for a wait), and the layer must then
be rebuilt on every rank (its mailboxes and counters are out of step with its peers').
"""

from __future__ import annotations

import torch

from fast import activation, backend, finalize, mx, router, stock
from fast.schedules.dense import check_hidden_rows
from fast.schedules.steps import run_steps
from fast.schedules.wide import (compiled_kernel, check_batch_invariant, check_list_params,
                                 check_call_options, check_ranks, check_rows_and_timeout,
                                 kernel_params, mailbox_timeout)
from fast.gemm.host import check_chunk_windows
from fast.gemm.mma_kind import check_overlap, resolve_mma
from fast.schedules.wide_gemms import DEFAULT_INVARIANT_GEMMS, build_fast_gemms, fast_gemm_names
from fast.schedules.wide_forms import resolve_forms
from fast.schedules.wide_program import (DEFAULT_SHARED_PLACEMENT, MAILBOX_BUFFERS, WIDE_STEPS,
                                         WideCall, WideRank, WideRankOutputs, WideStageCalls,
                                         as_int32, rank_gemm_bf16_into)
from fast.schedules.symmetric import SymmetricBuffer, meet, pack, process_group
from model.weights import LatentMoEWeights

__all__ = ["WidePeerLayer", "symmetric_layout", "WAITS"]

#: What each of a call's two waits waits for, by index (``ArrivalWaitKernel``'s ``what``).
WAITS = ("routed partials", "hidden partials")


def symmetric_layout(config, ranks: int, max_rows: int) -> tuple[dict, int]:
    """Byte offsets, shapes and dtypes of one rank's symmetric buffer, and its size:

    * ``mailbox`` int16 ``[2, max_rows, L + 2E]`` (``fast.schedules.wide_kernels``' layout);
    * ``partial`` BF16 ``[max_rows, L]`` (the rank's routed partial);
    * ``shared`` BF16 ``[2, max_rows, H]`` (the shared-expert partial, one per mailbox
      buffer: the module docstring says why);
    * ``up`` BF16 ``[2, max_rows, H/N]`` (the rank's up-projection columns, one per mailbox
      buffer, as ``shared``);
    * ``arrivals`` int32 (uint32 counters) ``[len(WAITS), N]``: word ``[w, s]`` counts
      rank ``s``'s signals for wait ``w``.

    Every field starts on a 256-byte boundary (``fast.schedules.symmetric.pack``)."""
    c, rows = config, max_rows
    return pack({
        "mailbox": ((MAILBOX_BUFFERS, rows, c.latent + 2 * c.experts), torch.int16),
        "partial": ((rows, c.latent), torch.bfloat16),
        "shared": ((MAILBOX_BUFFERS, rows, c.hidden), torch.bfloat16),
        "up": ((MAILBOX_BUFFERS, rows, c.hidden // ranks), torch.bfloat16),
        "arrivals": ((len(WAITS), ranks), torch.int32),
    })


class WidePeerLayer(WideStageCalls):
    """One real TP rank of S2 (this process, this GPU), reusable across calls.

    Args:
        weights: the layer's weights (any device); this rank's slices (front rows, shared
            expert slice, up columns, every expert's TP slice ``shard=(rank, N)``) are
            copied to ``device``.
        max_rows: the most tokens one call may have, in ``[front_max + 1, wide_rows]``
            (default ``wide_rows``); the same on every rank.
        group: the process group of the TP ranks (default the world); ``N`` is its size
            (:func:`fast.schedules.wide.check_ranks`).
        device: the CUDA device (default the current one).
        timeout_s: how long a poll or a wait may wait for a peer before it gives up.
        experts_tactic: the experts engine's FC kernel settings for every call
            (``fast.experts.ExpertsEngine``'s ``tactic``, e.g. ``{"wgmma": 1}``); default
            the engine's defaults.
        batch_invariant: as ``fast.schedules.wide.WideLayer``'s (default True): every
            token's outputs bitwise independent of the batch it is decoded in (each of the
            rank's GEMMs sums every output element in one order at every row count); the
            same on every rank.
        invariant_mma: as ``WideLayer``'s: ``"auto"`` (default), ``"mma.sync"`` or
            ``"wgmma"``; the same on every rank, and so is the kind it resolves to
            (``self.invariant_mma``).
        invariant_serial_from: as ``WideLayer``'s (None or rows); the same on every rank.
        invariant_overlap: as ``WideLayer``'s (a bool); the same on every rank.
        invariant_chunk_windows: as ``WideLayer``'s (8 or 16); the same on every rank.
        invariant_forms: as ``WideLayer``'s (None, ``"auto"`` (default) or per-GEMM forms);
            the same on every rank.
        invariant_gemms: as ``WideLayer``'s (``"stock"``, default, or ``"fast"``); the same
            on every rank.

    Construction is collective over ``group`` (the symmetric buffer's rendezvous), and so
    is the first call of each ``T`` (:meth:`_prepare`).
    """

    def __init__(self, weights: LatentMoEWeights, *, max_rows: int | None = None, group=None,
                 device: str | torch.device | None = None, timeout_s: float = 10.0,
                 experts_tactic: dict | None = None, batch_invariant: bool = True,
                 invariant_mma: str = "auto", invariant_serial_from: int | None = None,
                 invariant_overlap: bool = False, invariant_chunk_windows: int = 8,
                 invariant_forms: dict | str | None = "auto",
                 invariant_gemms: str = DEFAULT_INVARIANT_GEMMS):
        import torch.distributed as dist

        from fast.experts import experts_engine_for, prepare_experts_for
        from fast.device.arrival import WAIT_ERROR_FIELDS
        from fast.schedules.wide_kernels import ERROR_WORDS

        if not isinstance(weights, LatentMoEWeights):
            raise TypeError(f"WidePeerLayer: weights must be LatentMoEWeights, got "
                            f"{type(weights).__name__}")
        c = weights.config
        max_rows = check_rows_and_timeout("WidePeerLayer", c, max_rows, timeout_s)
        group, rank, n = process_group("WidePeerLayer", group)
        check_ranks(c, n)
        check_batch_invariant("WidePeerLayer", c, n, batch_invariant, invariant_mma,
                              invariant_serial_from, invariant_overlap, invariant_chunk_windows,
                              invariant_forms, invariant_gemms)
        device = backend.cuda_device("WidePeerLayer", device)
        backend.require_supported("WidePeerLayer")
        mma = resolve_mma("WidePeerLayer", invariant_mma, backend.device_arch(device))
        check_overlap("WidePeerLayer", invariant_overlap, mma)
        check_chunk_windows("WidePeerLayer", "invariant_chunk_windows", invariant_chunk_windows,
                            mma == "wgmma")
        invariant_forms = resolve_forms("WidePeerLayer", invariant_forms, c, n, mma,
                                        backend.device_arch(device), invariant_serial_from,
                                        invariant_overlap, invariant_chunk_windows)
        seen = [None] * n
        dist.all_gather_object(seen, (max_rows, c, batch_invariant, mma, invariant_serial_from,
                                      invariant_overlap, invariant_chunk_windows, invariant_forms,
                                      invariant_gemms),
                               group=group)
        if any(s != seen[0] for s in seen):
            raise ValueError("WidePeerLayer: every rank must build the layer with the same "
                             f"config, max_rows, batch_invariant, invariant_mma, "
                             f"invariant_serial_from, invariant_overlap, "
                             f"invariant_chunk_windows, invariant_forms and invariant_gemms; got max_rows "
                             f"{[s[0] for s in seen]}, batch_invariant {[s[2] for s in seen]}, "
                             f"invariant_mma {[s[3] for s in seen]}, invariant_serial_from "
                             f"{[s[4] for s in seen]}, invariant_overlap {[s[5] for s in seen]}, "
                             f"invariant_chunk_windows {[s[6] for s in seen]}, invariant_forms "
                             f"{[s[7] for s in seen]}, invariant_gemms {[s[8] for s in seen]}")
        self.config, self.group, self.rank, self.ranks = c, group, rank, n
        self.max_rows, self.device, self.timeout_s = max_rows, device, float(timeout_s)
        self.arch = backend.device_arch(device)
        #: the MMA kind of the batch-invariant GEMMs (``invariant_mma`` resolved on this GPU)
        self.invariant_mma = mma
        #: the batch-invariant GEMMs' per-GEMM forms (``invariant_forms`` resolved here)
        self.invariant_forms = invariant_forms
        #: the batch-invariant wgmma GEMMs leave each stage's MMAs in flight
        self.invariant_overlap = invariant_overlap
        e_n, l_n, s_n, h_n = c.experts // n, c.latent // n, c.shared_intermediate // n, c.hidden // n
        s, r, on = c.shared_intermediate, rank, dict(device=device)
        self.columns = h_n

        def to_device(t):
            return t.to(**on).contiguous()

        # this rank's slices, in {rank: ...} containers (the stages index them by rank)
        gate, down, gu = weights.gate, weights.latent_down, weights.shared_gate_up
        self.front_weights = {r: to_device(torch.cat([gate[r * e_n:(r + 1) * e_n],
                                                      down[r * l_n:(r + 1) * l_n]]))}
        self.shared_gate_up = {r: to_device(torch.cat([gu[r * s_n:(r + 1) * s_n],
                                                       gu[s + r * s_n:s + (r + 1) * s_n]]))}
        self.shared_down = {r: to_device(weights.shared_down[:, r * s_n:(r + 1) * s_n])}
        self.up = {r: to_device(weights.up[r * h_n:(r + 1) * h_n])}
        #: which GEMMs the batch-invariant mode runs on fast.gemm (``WideLayer``'s)
        self.invariant_gemms = invariant_gemms
        #: this rank's GEMMs on fast.gemm (``batch_invariant``), else None (cuBLAS)
        self.fast_gemms = None
        if batch_invariant:
            self.fast_gemms = build_fast_gemms(
                "WidePeerLayer", {"front": self.front_weights[r],
                                  "shared_gate_up": self.shared_gate_up[r],
                                  "shared_down": self.shared_down[r], "up": self.up[r]},
                c, n, max_rows, self.invariant_mma, invariant_serial_from, invariant_overlap,
                invariant_chunk_windows, invariant_forms,
                fast_gemm_names("WidePeerLayer", invariant_gemms))
            # the front GEMM's weight may be a view of its zero-padded copy: one copy
            self.front_weights[r] = self.fast_gemms["front"].weight
        self.bias = to_device(weights.bias)
        self.latent_norm = to_device(weights.latent_norm)
        self.engine = experts_engine_for(self.arch,
                                         prepare_experts_for(self.arch, weights, device,
                                                             shard=(r, n)),
                                         max_rows=max_rows, tactic=experts_tactic)
        self.engines = {r: self.engine}
        check_list_params("WidePeerLayer", self.engine, c)

        # the symmetric buffer: everything a peer writes or reads
        self.layout, size = symmetric_layout(c, n, max_rows)
        symmetric = SymmetricBuffer(self.layout, size, group, device)
        self._symmetric, self.symmetric = symmetric.tensor, symmetric.views
        sym = self.symmetric
        self.mailboxes = {r: sym["mailbox"]}
        rows, k, L, E, H = max_rows, c.top_k, c.latent, c.experts, c.hidden
        self._buffers = {r: dict(
            logits=torch.empty(rows, E, dtype=torch.float32, **on),
            latent=torch.empty(rows, L, dtype=torch.bfloat16, **on),
            weights=torch.empty(rows, k, dtype=torch.float32, **on),
            ids=torch.empty(rows, k, dtype=torch.int32, **on),
            codes=torch.empty(rows, L, dtype=torch.float8_e4m3fn, **on),
            scales=torch.empty(rows, L // 32, dtype=torch.uint8, **on),
            rows=torch.empty(rows * k, L, dtype=torch.bfloat16, **on),
            partial=sym["partial"],
            routed=torch.empty(rows, L, dtype=torch.bfloat16, **on),
            normed=torch.empty(rows, L, dtype=torch.bfloat16, **on),
            gate_up=torch.empty(rows, 2 * s_n, dtype=torch.bfloat16, **on),
            act=torch.empty(rows, s_n, dtype=torch.bfloat16, **on),
            out=torch.empty(rows, H, dtype=torch.bfloat16, **on),
        )}

        table = symmetric.table
        shared_bytes = rows * H * 2
        self.mailbox_table = table("mailbox")
        self.partial_table = table("partial")
        self.shared_tables = [table("shared", i * shared_bytes) for i in range(MAILBOX_BUFFERS)]
        up_bytes = rows * (H // n) * 2
        self.up_tables = [table("up", i * up_bytes) for i in range(MAILBOX_BUFFERS)]
        # my counter word at every rank, per wait
        self.arrival_tables = [table("arrivals", 4 * (w * n + r)) for w in range(len(WAITS))]
        self.expected = torch.zeros(len(WAITS), dtype=torch.int32, **on)
        self.wait_error = torch.zeros(len(WAIT_ERROR_FIELDS), dtype=torch.int32, **on)
        self.error = torch.zeros(ERROR_WORDS, dtype=torch.int32, **on)
        self._side = torch.cuda.Stream(device)
        self._fn = {kind: compiled_kernel(kind, self.arch, p)
                    for kind, p in kernel_params(c, n, peers=True).items()}
        # this rank's resources of the rank program: the peers' addresses in the tables,
        # the shared and up buffers rotating with the mailbox, the arrival signal and wait
        self._resources = WideRank(
            config=c, rank=r, ranks=n, max_rows=max_rows, device=device,
            timeout_s=self.timeout_s, front_weights=self.front_weights[r],
            shared_gate_up=self.shared_gate_up[r], shared_down=self.shared_down[r],
            up=self.up[r], bias=self.bias, latent_norm=self.latent_norm, engine=self.engine,
            buffers=self._buffers[r], mailbox=self.mailboxes[r],
            shared=tuple(sym["shared"][i] for i in range(MAILBOX_BUFFERS)),
            up_columns=tuple(sym["up"][i] for i in range(MAILBOX_BUFFERS)),
            mailbox_table=self.mailbox_table, partial_table=self.partial_table,
            shared_tables=tuple(self.shared_tables), up_tables=tuple(self.up_tables),
            error=self.error, side=self._side, kernels=self._fn, wait=self._signal_and_wait,
            gemms=self.fast_gemms)
        self.calls = 0
        self._prepared: set[int] = set()
        self._arm()
        meet(group, device)

    # -- state ------------------------------------------------------------------------------

    def _arm(self) -> None:
        """Arm both buffers of this rank's mailbox (latent words ``0x8000``, logit words
        ``0x80000000``). Only at construction: afterwards the polls re-arm what they read,
        and peers may be writing."""
        from fast.schedules.wide_kernels import SENTINEL_LATENT_WORD, SENTINEL_LOGIT_WORD

        words = self.symmetric["mailbox"].view(torch.int32)  # [2, rows, L/2 + E]
        half = self.config.latent // 2
        words[..., :half] = as_int32(SENTINEL_LATENT_WORD)
        words[..., half:] = as_int32(SENTINEL_LOGIT_WORD)

    def rank_resources(self, r: int) -> WideRank:
        """This rank's resources of the rank program (``r`` must be :attr:`rank`)."""
        if r != self.rank:
            raise ValueError(f"WidePeerLayer: rank {r} is not this layer's rank {self.rank}")
        return self._resources

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """The ranks this layer holds: its own."""
        return (self.rank,)

    def _prepare(self, tokens: int) -> None:
        """Before the first call of ``tokens`` rows: compile the engine's kernels for it
        and run every library kernel and GEMM of the local stages once on temporaries
        (they compile or load on first use; the fast GEMMs of ``batch_invariant`` were
        compiled at construction and are loaded here), then meet the peers (a collective
        barrier), so no rank's poll or wait times out while another compiles. Touches no
        buffer a peer reads (the engine's lists and work words and the fast GEMMs'
        workspaces are this rank's own)."""
        import torch.distributed as dist

        c, r, on = self.config, self.rank, dict(device=self.device)
        rank = self._resources
        self.engine.compile_for(tokens)
        x = torch.zeros(tokens, c.hidden, dtype=torch.bfloat16, **on)
        gemms = self.fast_gemms or {}
        if "front" in gemms:
            gemms["front"](x, out_dtype=torch.float32)
        else:
            stock.mm_fp32_out(x, self.front_weights[r])
        if "up" in gemms:
            normed = torch.zeros(tokens, c.latent, dtype=torch.bfloat16, **on)
            gemms["up"](normed, addend=torch.zeros(tokens, self.columns,
                                                   dtype=torch.bfloat16, **on))
        h = torch.empty(tokens, self.shared_gate_up[r].shape[0], dtype=torch.bfloat16, **on)
        rank_gemm_bf16_into(rank, "shared_gate_up", x, h)
        act = activation.situ_and_mul(h, beta=c.situ_beta, linear_beta=c.situ_linear_beta)
        rank_gemm_bf16_into(rank, "shared_down", act, torch.empty_like(x))
        weights, ids = router.route(torch.zeros(tokens, c.experts, dtype=torch.float32, **on),
                                    self.bias, top_k=c.top_k, renormalize=c.renormalize,
                                    scale=c.routed_scaling_factor)
        codes, scales = mx.quantize_mxfp8(torch.zeros(tokens, c.latent, dtype=torch.bfloat16, **on))
        rows = torch.empty(tokens * c.top_k, c.latent, dtype=torch.bfloat16, **on)
        self.engine(codes, scales, ids, out=rows, validate=False)
        finalize.finalize(rows, weights)
        torch.cuda.synchronize(self.device)
        self.engine.check()
        dist.barrier(self.group)
        self._prepared.add(tokens)

    # -- checks -----------------------------------------------------------------------------

    def _check_input(self, x) -> int:
        c = self.config
        rows = check_hidden_rows("WidePeerLayer", "x", x, config=c, device=self.device)
        low = c.front_max + 1
        if not low <= rows <= self.max_rows:
            raise ValueError(f"WidePeerLayer: T={rows} rows is outside the layer's bucket "
                             f"[{low}, max_rows={self.max_rows}]")
        return rows

    def check(self) -> None:
        """Raise the first error recorded since the last check: a poll that timed out
        (:class:`fast.device.arrival.ArrivalTimeout`, ``what`` ``"mailbox"``: this rank, the
        buffer, token, column and the writer that never published; that record is then
        cleared), a wait that timed out (``ArrivalTimeout``: this rank, the peer and what
        it waited for), or an engine error (``EngineError``). After a timeout the layer must
        be rebuilt on every rank. Synchronizes the device."""
        from fast.device.arrival import WAIT_ERROR_FIELDS, wait_timeout
        from fast.schedules.wide_kernels import ERROR_FIELDS

        torch.cuda.synchronize(self.device)
        record = dict(zip(ERROR_FIELDS, self.error.tolist()))
        if record["flag"]:
            self.error.zero_()
            raise mailbox_timeout(
                f"WidePeerLayer (TP {self.ranks})", self.config, self.ranks, record,
                self.timeout_s, "Every rank must call the layer with the same T; the "
                "mailboxes and counters are now out of step: rebuild the layer on every rank.")
        wait = dict(zip(WAIT_ERROR_FIELDS, (int(v) for v in self.wait_error.tolist())))
        if wait["code"]:
            raise wait_timeout("wide", WAITS, wait, self.ranks, self.timeout_s)
        self.engine.check()

    # -- the call ---------------------------------------------------------------------------

    def __call__(self, x: torch.Tensor, *, check: bool = True, order: str = "side",
                 shared: str = DEFAULT_SHARED_PLACEMENT, side_delay_cycles: int = 0) -> WideRankOutputs:
        """One layer step of this rank on the BF16 tokens ``x [T, H]`` (every rank passes
        the same ``T``; in the model every rank holds the same tokens). ``check``,
        ``order``, ``shared`` and ``side_delay_cycles`` as
        :meth:`fast.schedules.wide.WideLayer.__call__`.
        The first call of each ``T`` is collective on the host (:meth:`_prepare`); later
        ones launch without host synchronization (until ``check``). Returns this rank's
        :class:`WideRankOutputs` (views into the layer's buffers, valid until the next
        call)."""
        check_call_options("WidePeerLayer", order, shared)
        tokens = self._check_input(x)
        if tokens not in self._prepared:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"WidePeerLayer: T={tokens} is captured before an eager call "
                                   "of that T (use WidePeerLayer.graph)")
            self._prepare(tokens)
        call = WideCall(x, tokens, self.mailbox_index, order=order, shared=shared,
                        side_delay_cycles=side_delay_cycles)
        run_steps(WIDE_STEPS, [self._resources], [call])
        outputs = call.outputs
        self.calls += 1
        if check:
            self.check()
        return outputs

    def _signal_and_wait(self, what: int, tokens: int) -> None:
        """The rank program's ``wait``: ``ArrivalSignalKernel`` (+1 on this rank's counter
        ``what`` at every rank) and ``ArrivalWaitKernel`` (every rank's counter ``what``
        here at ``expected + 1``, whatever ``tokens``) on the current stream."""
        from cutlass import Int32, Int64

        stream = backend.stream(self.device)
        self._fn["signal"](Int64(self.arrival_tables[what].data_ptr()), stream)
        counters = self.symmetric["arrivals"][what]
        self._fn["wait"](Int64(counters.data_ptr()), Int64(self.expected[what:].data_ptr()),
                         Int64(self.wait_error.data_ptr()), Int64(int(self.timeout_s * 1e9)),
                         Int32(1), Int32(self.rank), Int32(what), stream)
