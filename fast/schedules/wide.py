"""S2, the wide layer, on a GPU: every rank's stages with the fast kernels, over ``N``
virtual ranks whose buffers all live on one device.

Every rank holds the same tokens ``x [T, H]`` (65 <= T <= ``max_rows`` <= ``wide_rows``)
and, for rank ``r``: its router rows and latent-down rows packed into one weight, the TP
slice ``[r I/N, (r+1) I/N)`` of every routed expert, its slice of the shared expert and
its up-projection columns ``[r H/N, (r+1) H/N)`` (``reference.schedules.wide``). What runs,
per rank, in the order of ``reference.schedules.wide.wide_rank``::

    side  : shared_stage   h = x @ gate_up_r^T (cuBLAS*, BF16) ; act = fast.activation(h)
                           shared_r = act @ down_r^T (cuBLAS*, BF16) ──────────────────────┐
    main  : front_stage    front_r = x @ [gate_r; down_r]^T (cuBLAS*, FP32 out)            │
            publish_stage  PublishKernel: front_r into every rank's mailbox (Lamport)      │
            route_stage    PolledRouteKernel: poll own mailbox, re-arm -> logits [T, E]    │
                           FP32, latent [T, L] BF16 -> MXFP8 codes, ids, weights, the      │
                           engine's BF16 plan rows and each pair on its routing list       │
            experts_stage  fast.experts engine, TP slice, from its plan kernel on (windows │
                           of 8 tokens per expert) -> rows [T*K, L] BF16 partial rows      │
            finalize_stage fast.finalize -> routed_partial [T, L] BF16                     │
            latent_stage   LatentAllReduceNormKernel (every rank's partial, rank order,    │
                           fused RMSNorm) -> routed, normed ; (wait side) up_r =  ◄────────┘
                           shared_r[:, cols_r] + normed @ up_r^T (cuBLAS* addmm, BF16)
            hidden_stage   HiddenAllReduceKernel: every rank's hidden partial (shared_o,
                           rank o's columns taken from up_o), rank order -> out [T, H]

    * cuBLAS's kernels with split-K forbidden (cuBLASLt), except the front: ``fast.gemm``
      (``fast.schedules.wide_gemms``), one K split at every row count (the default,
      ``batch_invariant=True``, ``invariant_gemms="stock"``); with
      ``invariant_gemms="fast"`` all four on ``fast.gemm``, the up columns' addend added
      before the one rounding; with ``batch_invariant=False`` all four on cuBLAS, split-K
      allowed

**Batch invariance is the default** (``WideLayer(batch_invariant=True)``): every token's
outputs, at every stage and on every rank, are bitwise the same whatever batch of
``65..max_rows`` rows it is decoded in and whatever its batch-mates. Stage by stage:

* the four GEMMs: the FP32-output front on ``fast.gemm`` with one K split for the layer's
  whole row range and token chunks of at most 64 rows (``fast.schedules.wide_gemms``), the
  three BF16-output GEMMs on cuBLASLt with split-K forbidden (``invariant_gemms="stock"``,
  the default; each node's contracts hold cuBLAS to it), or all four on ``fast.gemm``
  (``invariant_gemms="fast"``): one summation order per output element at every ``T``;
* publish, polled routing (mailbox words, router, MXFP8 plan rows), SiTU, Finalize: one
  token's row at a time (one CTA or thread group per token, no sum across tokens);
* the experts: each pair's row from its own activation row in one order whatever the
  window count, the tactic or the MMA kind (``verify/test_experts.py``,
  ``test_experts_mma_kinds_same_bits``); the routing lists' order (atomic claims) moves
  no bit;
* the latent all-reduce with the RMSNorm and the hidden all-reduce: one CTA per token,
  every rank's row summed in FP32 in rank order (rank 0's value first, ``add.rn.f32`` of
  ranks 1..N-1, one BF16 rounding), the norm's fixed reduction tree on that row: already
  independent of ``T`` and of the other tokens in the default mode too.

``batch_invariant=False`` leaves the four GEMMs to cuBLAS with split-K allowed: it picks its
kernel and its split of K per row count, so a token's logits (and, near a tie, its experts)
can change with ``T``. ``verify/test_wide_fast.py`` checks the mode at every tactic and
chunk edge against the largest batch, bit for bit.

The stages are the rank program ``fast.schedules.wide_program.WIDE_STEPS`` over each
rank's ``WideRank`` (its resources), which the real ranks (``fast.schedules.wide_peer``)
run too. A call runs each step for every rank before the next step
(``fast.schedules.steps.run_steps``: every publish before any poll; on one stream a poll
that waited for a later launch would only time out); a virtual rank's ``wait`` does nothing.

Rounding points and what the contracts (``verify/test_wide_fast.py``) compare, per rank
on its own inputs:

* front (FP32), shared, up columns: on cuBLAS within the FP32-accumulated GEMM bound
  (``addmm``: the two-rounding bound of cuBLAS's BF16 ``addmm``); on ``fast.gemm`` within
  ``verify.bounds.mma_matmul_bound`` at the GEMM's K split and bitwise equal to the same
  GEMM run alone;
* the mailbox: the published words are the front's bits (logits) and its RNE BF16 rounding
  (latent), ``-0`` stored as ``+0``, bitwise; polled logits and latent bitwise the words;
* ids, weights: bitwise ``reference.emulation.route`` of the polled logits; plan rows
  bitwise ``reference.mx.quantize_mxfp8`` of the polled latent; routing lists: every pair
  once in its expert's list (the list order is the order of the engine's atomic claims,
  which changes no bit of the output);
* expert rows: the engine (FP32 tensor-core sums: bounded by ``verify/test_experts.py``),
  bitwise equal to the engine alone on the same plan rows;
* routed partial: bitwise ``reference.finalize``; routed: bitwise
  ``reference.schedules.groups.ordered_sum_bf16`` of every rank's partial; normed: bitwise
  ``reference.emulation.rms_norm_tree``; out: bitwise ``ordered_sum_bf16`` of the hidden
  partials.

Buffers are allocated once at ``max_rows`` and reused by every call: the two rotating
mailbox buffers per rank (``int16 [2, max_rows, L + 2E]``, armed at construction; call
``c`` uses buffer ``c % 2``) and every stage output the peers read through address tables
(partials, shared partials, up columns) or the caller reads. The layer launches no host
synchronization (``validate=False`` engines; :meth:`WideLayer.check` reads the error
words), so a call can be captured in a CUDA graph (:meth:`WideLayer.graph`, one graph per
mailbox buffer, replayed alternately).

The polled-routing kernel also does the engine's routing-lists work (its plan rows and
list appends; the engine's call starts at its plan kernel: ``listed=True``). Not here
yet: FlashInfer's fused
all-reduce + RMSNorm as a second tail (its contract, ``verify/test_flashinfer_allreduce.py``,
is written and not yet run on two GPUs). Real ranks: ``fast.schedules.wide_peer``.
"""

from __future__ import annotations


import torch

from fast import backend
from fast.schedules.dense import check_hidden_rows
from fast.schedules.steps import run_steps
from fast.gemm.host import check_chunk_windows, check_serial_from
from fast.gemm.mma_kind import check_mma, check_overlap, resolve_mma
from fast.schedules.wide_gemms import (DEFAULT_INVARIANT_GEMMS, build_fast_gemms,
                                       check_fast_gemm_shapes, check_gemm_forms, fast_gemm_names)
from fast.schedules.wide_forms import resolve_forms
from fast.schedules.wide_program import (DEFAULT_SHARED_PLACEMENT, MAILBOX_BUFFERS,
                                         SHARED_PLACEMENTS, WIDE_STEPS, WideCall, WideRank,
                                         WideRankOutputs, WideStageCalls, as_int32)
from model.config import LatentMoEConfig
from model.weights import LatentMoEWeights

__all__ = ["WideLayer", "WideRankOutputs", "mailbox_timeout", "check_ranks",
           "kernel_params", "compiled_kernel", "compile_all", "mailbox_timeout_message", "MAX_RANKS",
           "MAILBOX_BUFFERS", "SHARED_PLACEMENTS", "DEFAULT_SHARED_PLACEMENT",
           "check_call_options", "check_rows_and_timeout", "check_batch_invariant"]

#: The tail kernels keep one 16-byte granule of every rank in registers.
MAX_RANKS = 16


def check_ranks(config: LatentMoEConfig, ranks) -> None:
    """Raise a ValueError naming every reason ``ranks`` cannot run the fast wide layer:
    the reference's split rules (``reference.schedules.wide.check_wide_ranks``: E, L, H,
    S divisible by N, I by 32 N) and the kernels' granules (16-byte stores of ``E/N``
    logits and ``L/N`` latent values, 8-column granules of ``H/N``, the SiTU kernel's
    ``S/N % 8``, the engine's ``I/N % 64``, the router's ``E % 32 <= 1024``, the norm's
    ``L % 256 <= 8192``, at most ``MAX_RANKS`` ranks)."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"wide layer: ranks must be a positive int, got {ranks!r}")
    c, n, bad = config, ranks, []
    for name, width in (("experts", c.experts), ("latent", c.latent), ("hidden", c.hidden),
                        ("shared_intermediate", c.shared_intermediate)):
        if width % n:
            bad.append(f"{name} {width} % {n}")
    if c.intermediate % (n * c.block):
        bad.append(f"intermediate {c.intermediate} % ({n} * {c.block})")
    if not bad:  # the kernels' granules, on top of the reference's splits
        for name, width, unit in (("experts", c.experts, 4), ("latent", c.latent, 8),
                                  ("hidden", c.hidden, 8), ("shared_intermediate",
                                                             c.shared_intermediate, 8),
                                  ("intermediate", c.intermediate, 64)):
            if (width // n) % unit:
                bad.append(f"{name}/N = {width // n} % {unit}")
    if n > MAX_RANKS:
        bad.append(f"{n} ranks > {MAX_RANKS}")
    if c.experts % 32 or c.experts > 1024:
        bad.append(f"experts {c.experts} must be a multiple of 32 up to 1024 (fast.router)")
    if c.latent % 256 or c.latent > 8192:
        bad.append(f"latent {c.latent} must be a multiple of 256 up to 8192 (fast.norm)")
    if bad:
        raise ValueError(f"wide layer: {n} ranks cannot split this layer: " + ", ".join(bad))


def mailbox_writer(config: LatentMoEConfig, ranks: int, column: int) -> tuple[str, int]:
    """The region (``"latent"`` or ``"logit"``) of a mailbox row's 16-bit ``column`` and the
    rank that writes it."""
    c, n = config, ranks
    if column < c.latent:
        return "latent", column // (c.latent // n)
    return "logit", (column - c.latent) // (2 * c.experts // n)


def mailbox_timeout_message(who: str, config: LatentMoEConfig, ranks: int, record: dict,
                            timeout_s: float, advice: str) -> str:
    """The message of a poll's timeout from its error record (``ERROR_FIELDS`` of
    ``fast.schedules.wide_kernels``): the reader's rank, the buffer, the token, the first
    empty 16-bit column, its region and the rank that should have written it."""
    column = record["column"]
    region, writer = mailbox_writer(config, ranks, column)
    return (f"{who}: rank {record['rank']} timed out polling mailbox buffer "
            f"{record['buffer']}: token {record['token']}, column {column} (16-bit word, "
            f"{region} region written by rank {writer}) still empty after "
            f"{timeout_s} s; {record['granules']} 16-byte granules timed out. {advice}")


def mailbox_timeout(who: str, config: LatentMoEConfig, ranks: int, record: dict,
                    timeout_s: float, advice: str):
    """The ``fast.device.arrival.ArrivalTimeout`` of a poll's error record
    (:func:`mailbox_timeout_message`; ``rank`` the reader, ``what`` ``"mailbox"``, ``peer``
    the writer of the first empty column)."""
    from fast.device.arrival import ArrivalTimeout

    return ArrivalTimeout(mailbox_timeout_message(who, config, ranks, record, timeout_s, advice),
                          rank=record["rank"], what="mailbox",
                          peer=mailbox_writer(config, ranks, record["column"])[1])


def slice_list_params(config: LatentMoEConfig) -> dict:
    """The routing-lists kernel parameters of a wide rank's engine (every expert local: a
    TP slice of each; not strict, no empty rows), which the polled-routing kernel emits
    (``ExpertsEngine.list_params`` of the layer's engines; checked at construction)."""
    c = config
    return dict(latent=c.latent, top_k=c.top_k, experts=c.experts, first=0, count=c.experts,
                strict=False, empty_rows=False)


def check_list_params(owner: str, engine, config: LatentMoEConfig) -> None:
    """The polled-routing kernel does the work of ``engine``'s routing-lists kernel: refuse
    an engine whose lists differ from the ones it was compiled for."""
    if engine.list_params() != slice_list_params(config):
        raise ValueError(f"{owner}: the experts engine's routing lists {engine.list_params()} "
                         f"are not a wide rank's {slice_list_params(config)}")


def kernel_params(config: LatentMoEConfig, ranks: int, *, peers: bool = False) -> dict[str, tuple]:
    """The compile parameters of the wide layer's own kernels for ``ranks`` ranks: virtual
    ranks on one device, or real ranks (``peers``: also the arrival signal after the
    partials and the up columns, and the wait of ``fast.schedules.dep_kernels``)."""
    c = config
    params = {
        "publish": dict(latent=c.latent, experts=c.experts, ranks=ranks),
        "route": dict(latent=c.latent, experts=c.experts, top_k=c.top_k,
                      renormalize=bool(c.renormalize),
                      lists=tuple(sorted(slice_list_params(c).items()))),
        "latent_all_reduce": dict(latent=c.latent, ranks=ranks),
        "hidden_all_reduce": dict(hidden=c.hidden, ranks=ranks),
    }
    if peers:
        params["signal"] = dict(ranks=ranks)
        params["wait"] = dict(ranks=ranks)
    return {kind: tuple(sorted(p.items())) for kind, p in params.items()}


def compiled_kernel(kind: str, arch: str, params: tuple):
    """The kernel ``kind`` of :func:`kernel_params` compiled for ``arch`` with ``params``
    (``fast.device.compile``: fake arguments, no GPU needed; cached)."""
    from fast.device.arrival import ArrivalSignalKernel, ArrivalWaitKernel
    from fast.device.compile import compiled
    from fast.schedules import wide_kernels as k
    from fast.schedules.wide_route import PolledRouteKernel

    classes = {"publish": k.PublishKernel, "route": PolledRouteKernel,
               "signal": ArrivalSignalKernel, "wait": ArrivalWaitKernel,
               "latent_all_reduce": k.LatentAllReduceNormKernel,
               "hidden_all_reduce": k.HiddenAllReduceKernel}
    return compiled(classes[kind], arch, params)


def compile_all(config: LatentMoEConfig, ranks: int, arch: str, *, peers: bool = False):
    """Compile the wide layer's own kernels for ``arch`` (no GPU needed); ``peers``: the
    real ranks' set (:func:`kernel_params`)."""
    check_ranks(config, ranks)
    return [compiled_kernel(kind, arch, params)
            for kind, params in kernel_params(config, ranks, peers=peers).items()]


def check_rows_and_timeout(owner: str, config: LatentMoEConfig, max_rows, timeout_s) -> int:
    """A wide layer's ``max_rows`` (default ``wide_rows``; within the bucket ``[front_max +
    1, wide_rows]``) and ``timeout_s`` (seconds in (0, 600]), refused by name; returns
    ``max_rows``."""
    low = config.front_max + 1
    max_rows = config.wide_rows if max_rows is None else max_rows
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) \
            or not low <= max_rows <= config.wide_rows:
        raise ValueError(f"{owner}: max_rows must be an int in [{low}, wide_rows="
                         f"{config.wide_rows}] (the wide layer's bucket), got {max_rows!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
            or not 0 < timeout_s <= 600:
        raise ValueError(f"{owner}: timeout_s must be a number of seconds in (0, 600], "
                         f"got {timeout_s!r}")
    return max_rows


def check_batch_invariant(owner: str, config: LatentMoEConfig, ranks: int,
                          batch_invariant, invariant_mma="auto",
                          invariant_serial_from=None, invariant_overlap=False,
                          invariant_chunk_windows=8, invariant_forms="auto",
                          invariant_gemms=DEFAULT_INVARIANT_GEMMS) -> None:
    """A wide layer's ``batch_invariant`` (a bool), its ``invariant_mma``
    (``fast.gemm.mma_kind.MMA_CHOICES``), its ``invariant_serial_from`` (None or a positive int),
    its ``invariant_overlap`` (a bool, not with ``"mma.sync"``), its
    ``invariant_chunk_windows`` (8, or 16 not with ``"mma.sync"``), its ``invariant_forms``
    (``wide_gemms.check_gemm_forms``), its ``invariant_gemms``
    (``wide_gemms.INVARIANT_GEMMS``) and, when True, whether the rank's GEMMs that run on
    ``fast.gemm`` fit it at ``ranks`` ranks (``wide_gemms.check_fast_gemm_shapes``); refused
    by name before any device work."""
    if not isinstance(batch_invariant, bool):
        raise ValueError(f"{owner}: batch_invariant must be a bool, got {batch_invariant!r}")
    check_mma(owner, invariant_mma, allow_auto=True)
    check_serial_from(owner, "invariant_serial_from", invariant_serial_from)
    check_overlap(owner, invariant_overlap, invariant_mma)
    check_chunk_windows(owner, "invariant_chunk_windows", invariant_chunk_windows,
                        invariant_mma != "mma.sync")
    check_gemm_forms(owner, config, ranks, invariant_forms,
                     "mma.sync" if invariant_mma == "mma.sync" else "wgmma")
    names = fast_gemm_names(owner, invariant_gemms)
    if batch_invariant:
        check_fast_gemm_shapes(owner, config, ranks, names)


def check_call_options(owner: str, order: str, shared: str) -> None:
    """``order`` and ``shared`` of a wide layer call, refused by name before any launch."""
    if order not in ("side", "serial"):
        raise ValueError(f"{owner}: order must be 'side' or 'serial', got {order!r}")
    if shared not in SHARED_PLACEMENTS:
        raise ValueError(f"{owner}: shared must be one of {SHARED_PLACEMENTS}, got {shared!r}")


class WideLayer(WideStageCalls):
    """S2 over ``ranks`` virtual ranks on one CUDA device, reusable across calls.

    Args:
        weights: the layer's weights (any device; each rank's slices are copied to
            ``device``); each virtual rank's engine prepares every expert's TP slice
            ``shard=(r, N)``.
        ranks: ``N`` (:func:`check_ranks`: 1, 2, 4, 8, 16 at the real widths).
        max_rows: the most tokens one call may have, in ``[front_max + 1, wide_rows]``
            (default ``wide_rows``); every buffer is sized for it once.
        device: the CUDA device.
        timeout_s: how long a poll waits for a mailbox word before it gives up and records
            the error :meth:`check` raises (``fast.device.arrival.ArrivalTimeout``).
        experts_tactic: the experts engine's FC kernel settings for every call
            (``fast.experts.ExpertsEngine``'s ``tactic``, e.g. ``{"wgmma": 1}``); default
            the engine's defaults.
        batch_invariant: every token's outputs, at every stage and on every rank, bitwise
            independent of the batch it is decoded in (its row count and its batch-mates):
            each rank's four GEMMs on ``fast.gemm`` with one K split per GEMM at every row
            count (``fast.schedules.wide_gemms``; the module docstring says why the other
            stages already are). Default True; False: cuBLAS with split-K allowed, which is
            not. Needs the K of each GEMM on ``fast.gemm`` a multiple of 64 (every TP rank
            count of the real layer); refused otherwise.
        invariant_mma: the MMA of those GEMMs: ``"auto"`` (default: ``"wgmma"`` on sm_90a,
            the faster there, ``"mma.sync"`` elsewhere; ``fast.gemm.mma_kind.resolve_mma``),
            ``"mma.sync"`` or ``"wgmma"`` (sm_90a's warpgroup MMA; other bits than
            ``mma.sync``, the same at every row count). Read only with
            ``batch_invariant=True``; the kind in use is ``self.invariant_mma``.
        invariant_serial_from: with ``batch_invariant=True``, calls of at least this many
            rows run each GEMM's K splits one after another in each CTA
            (``fast.gemm.Tactic.serial``; the same bits); None (default): never.
        invariant_overlap: with ``batch_invariant=True`` on the warpgroup MMA, each GEMM's
            MMAs stay in flight across a stage (``fast.gemm.Tactic.overlap``; the same
            bits); refused with ``"mma.sync"``. Default False.
        invariant_chunk_windows: with ``batch_invariant=True``, the windows of 8 rows in one
            token chunk of those GEMMs' calls of more than 64 rows: 8 (default; 64-row
            chunks) or, on the warpgroup MMA, 16 (128-row chunks, ``fast.gemm.Tactic.
            chunk_windows``: each weight tile streamed half as often; the same bits);
            refused with ``"mma.sync"``.
        invariant_forms: with ``batch_invariant=True``, per GEMM and row count the form of
            its default tactic, overriding the three arguments above: ``{gemm: {rows_from:
            {key: value}}}``, ``gemm`` among ``wide_gemms.WIDE_GEMMS``, keys among
            ``fast.gemm.host.FORM_KEYS`` (``chunk_windows``, ``serial``, ``overlap``,
            ``stage_k``; ``fast.gemm.DenseGemm``'s ``forms``) or ``{"tiled": {...}}``
            (``fast.gemm.TiledGemm``'s options). None: none. ``"auto"`` (default): at the
            real dimensions on 8 ranks on sm_90a with the warpgroup MMA and the three
            arguments above at their defaults, the measured table
            ``fast.schedules.wide_forms.TP8_FORMS``, elsewhere none
            (``wide_forms.resolve_forms``; :attr:`invariant_forms` says which). The K
            split and the MMA kind are not a form's: the same bits.
        invariant_gemms: with ``batch_invariant=True``, which GEMMs run on ``fast.gemm``
            (``wide_gemms.INVARIANT_GEMMS``): ``"stock"`` (default) the FP32-output front
            only, the three BF16-output GEMMs staying on cuBLAS with split-K forbidden
            (cuBLASLt; ``fast.stock.fp32_reduction``), whose invariance the contracts check
            on each node (``wide_gemms``' docstring); ``"fast"`` all four.
    """

    def __init__(self, weights: LatentMoEWeights, *, ranks: int, max_rows: int | None = None,
                 device: str | torch.device = "cuda", timeout_s: float = 10.0,
                 experts_tactic: dict | None = None, batch_invariant: bool = True,
                 invariant_mma: str = "auto", invariant_serial_from: int | None = None,
                 invariant_overlap: bool = False, invariant_chunk_windows: int = 8,
                 invariant_forms: dict | str | None = "auto",
                 invariant_gemms: str = DEFAULT_INVARIANT_GEMMS):
        from fast.experts import experts_engine_for, prepare_experts_for

        if not isinstance(weights, LatentMoEWeights):
            raise TypeError(f"WideLayer: weights must be LatentMoEWeights, got {type(weights).__name__}")
        c = weights.config
        check_ranks(c, ranks)
        max_rows = check_rows_and_timeout("WideLayer", c, max_rows, timeout_s)
        check_batch_invariant("WideLayer", c, ranks, batch_invariant, invariant_mma,
                              invariant_serial_from, invariant_overlap, invariant_chunk_windows,
                              invariant_forms, invariant_gemms)
        device = backend.cuda_device("WideLayer", device)
        backend.require_supported("WideLayer")
        self.config, self.ranks, self.max_rows, self.device = c, ranks, max_rows, device
        self.timeout_s = float(timeout_s)
        self.arch = backend.device_arch(device)
        #: the MMA kind of the batch-invariant GEMMs (``invariant_mma`` resolved on this GPU)
        self.invariant_mma = resolve_mma("WideLayer", invariant_mma, self.arch)
        check_overlap("WideLayer", invariant_overlap, self.invariant_mma)
        check_chunk_windows("WideLayer", "invariant_chunk_windows", invariant_chunk_windows,
                            self.invariant_mma == "wgmma")
        invariant_forms = resolve_forms("WideLayer", invariant_forms, c, ranks,
                                        self.invariant_mma, self.arch, invariant_serial_from,
                                        invariant_overlap, invariant_chunk_windows)
        #: the batch-invariant GEMMs' per-GEMM forms (``invariant_forms`` resolved here)
        self.invariant_forms = invariant_forms
        #: the batch-invariant wgmma GEMMs leave each stage's MMAs in flight
        self.invariant_overlap = invariant_overlap
        n, on = ranks, dict(device=device)
        e_n, l_n, s_n, h_n = c.experts // n, c.latent // n, c.shared_intermediate // n, c.hidden // n
        s = c.shared_intermediate
        self.columns = h_n

        def slice_to_device(t):
            return t.to(**on).contiguous()

        gate, down, gu = weights.gate, weights.latent_down, weights.shared_gate_up
        self.front_weights = [slice_to_device(torch.cat([gate[r * e_n:(r + 1) * e_n],
                                                         down[r * l_n:(r + 1) * l_n]]))
                              for r in range(n)]
        self.shared_gate_up = [slice_to_device(torch.cat([gu[r * s_n:(r + 1) * s_n],
                                                          gu[s + r * s_n:s + (r + 1) * s_n]]))
                               for r in range(n)]
        self.shared_down = [slice_to_device(weights.shared_down[:, r * s_n:(r + 1) * s_n])
                            for r in range(n)]
        self.up = [slice_to_device(weights.up[r * h_n:(r + 1) * h_n]) for r in range(n)]
        #: which GEMMs the batch-invariant mode runs on fast.gemm (``"fast"``: all four;
        #: ``"stock"``: the front, the others on cuBLASLt without split-K)
        self.invariant_gemms = invariant_gemms
        #: per rank, its GEMMs on fast.gemm (``batch_invariant``), else None (cuBLAS)
        self.fast_gemms = [None] * n
        if batch_invariant:
            for r in range(n):
                self.fast_gemms[r] = build_fast_gemms(
                    "WideLayer", {"front": self.front_weights[r],
                                  "shared_gate_up": self.shared_gate_up[r],
                                  "shared_down": self.shared_down[r], "up": self.up[r]},
                    c, n, max_rows, self.invariant_mma, invariant_serial_from,
                    invariant_overlap, invariant_chunk_windows, invariant_forms,
                    fast_gemm_names("WideLayer", invariant_gemms))
                # the front GEMM's weight may be a view of its zero-padded copy: one copy
                self.front_weights[r] = self.fast_gemms[r]["front"].weight
        self.bias = slice_to_device(weights.bias)
        self.latent_norm = slice_to_device(weights.latent_norm)
        self.engines = [experts_engine_for(self.arch,
                                           prepare_experts_for(self.arch, weights, device,
                                                               shard=(r, n)),
                                           max_rows=max_rows, tactic=experts_tactic)
                        for r in range(n)]
        check_list_params("WideLayer", self.engines[0], c)
        rows, k, L, E, H = max_rows, c.top_k, c.latent, c.experts, c.hidden
        self.mailboxes = [torch.empty(MAILBOX_BUFFERS, rows, L + 2 * E, dtype=torch.int16, **on)
                          for _ in range(n)]
        self._buffers = [dict(
            logits=torch.empty(rows, E, dtype=torch.float32, **on),
            latent=torch.empty(rows, L, dtype=torch.bfloat16, **on),
            weights=torch.empty(rows, k, dtype=torch.float32, **on),
            ids=torch.empty(rows, k, dtype=torch.int32, **on),
            codes=torch.empty(rows, L, dtype=torch.float8_e4m3fn, **on),
            scales=torch.empty(rows, L // 32, dtype=torch.uint8, **on),
            rows=torch.empty(rows * k, L, dtype=torch.bfloat16, **on),
            partial=torch.empty(rows, L, dtype=torch.bfloat16, **on),
            routed=torch.empty(rows, L, dtype=torch.bfloat16, **on),
            normed=torch.empty(rows, L, dtype=torch.bfloat16, **on),
            gate_up=torch.empty(rows, 2 * s_n, dtype=torch.bfloat16, **on),
            act=torch.empty(rows, s_n, dtype=torch.bfloat16, **on),
            shared=torch.empty(rows, H, dtype=torch.bfloat16, **on),
            up=torch.empty(rows, h_n, dtype=torch.bfloat16, **on),
            out=torch.empty(rows, H, dtype=torch.bfloat16, **on),
        ) for _ in range(n)]

        def table(tensors):
            return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=device)

        self.mailbox_table = table(self.mailboxes)
        self.partial_table = table([b["partial"] for b in self._buffers])
        self.shared_table = table([b["shared"] for b in self._buffers])
        self.up_table = table([b["up"] for b in self._buffers])
        from fast.schedules.wide_kernels import ERROR_WORDS

        self.error = torch.zeros(ERROR_WORDS, dtype=torch.int32, device=device)
        self._side = torch.cuda.Stream(device)
        self._fn = {kind: compiled_kernel(kind, self.arch, p) for kind, p in kernel_params(c, n).items()}
        #: every virtual rank's resources of the rank program (``WideRank``; one shared and
        #: one up buffer each, used for both mailbox buffers; no wait)
        self._resources = [WideRank(
            config=c, rank=r, ranks=n, max_rows=max_rows, device=device,
            timeout_s=self.timeout_s, front_weights=self.front_weights[r],
            shared_gate_up=self.shared_gate_up[r], shared_down=self.shared_down[r],
            up=self.up[r], bias=self.bias, latent_norm=self.latent_norm,
            engine=self.engines[r], buffers=self._buffers[r], mailbox=self.mailboxes[r],
            shared=(self._buffers[r]["shared"],) * MAILBOX_BUFFERS,
            up_columns=(self._buffers[r]["up"],) * MAILBOX_BUFFERS,
            mailbox_table=self.mailbox_table, partial_table=self.partial_table,
            shared_tables=(self.shared_table,) * MAILBOX_BUFFERS,
            up_tables=(self.up_table,) * MAILBOX_BUFFERS, error=self.error, side=self._side,
            kernels=self._fn, gemms=self.fast_gemms[r]) for r in range(n)]
        self.calls = 0
        self.reset()

    def rank_resources(self, r: int) -> WideRank:
        """Virtual rank ``r``'s resources of the rank program."""
        return self._resources[r]

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """The ranks this layer holds: every virtual rank."""
        return tuple(range(self.ranks))

    # -- state ----------------------------------------------------------------------------

    def reset(self) -> None:
        """Arm every mailbox buffer of every rank (latent words ``0x8000``, logit words
        ``0x80000000``), drop every engine's unconsumed routing-list appends and clear the
        error record; synchronizes the device. Needed only after a poll's ``ArrivalTimeout``
        (a timed-out poll leaves its slots as they were) or a route stage run without its
        experts stage."""
        from fast.schedules.wide_kernels import SENTINEL_LATENT_WORD, SENTINEL_LOGIT_WORD

        half = self.config.latent // 2
        for box in self.mailboxes:
            words = box.view(torch.int32)  # [2, rows, L/2 + E]
            words[..., :half] = as_int32(SENTINEL_LATENT_WORD)
            words[..., half:] = as_int32(SENTINEL_LOGIT_WORD)
        for engine in self.engines:
            engine.live_counts().zero_()
        self.error.zero_()
        torch.cuda.synchronize(self.device)

    def check(self) -> None:
        """Raise ``fast.device.arrival.ArrivalTimeout`` if a poll timed out since the last
        check (``what`` ``"mailbox"``; its message names the reader's rank, the buffer, the
        token, the first empty 16-bit column and the rank that should have written it),
        then the engine error of the lowest rank that
        has one (``EngineError``, naming the rank and how many other ranks had one: every
        engine's error is read and cleared); synchronizes the device and clears the
        errors it reports."""
        from fast.experts.engine import EngineError
        from fast.schedules.wide_kernels import ERROR_FIELDS

        torch.cuda.synchronize(self.device)  # stages may have run on other streams
        record = dict(zip(ERROR_FIELDS, self.error.tolist()))
        if record["flag"]:
            self.error.zero_()
            raise mailbox_timeout(
                "WideLayer", self.config, self.ranks, record, self.timeout_s,
                "The mailboxes are left as they were: call reset() before the next call.")
        errors = {}
        for r, engine in enumerate(self.engines):
            try:
                engine.check()
            except EngineError as error:
                errors[r] = error
        if errors:
            r, error = next(iter(errors.items()))
            others = f" (and on {len(errors) - 1} other rank(s))" if len(errors) > 1 else ""
            raise EngineError(f"WideLayer rank {r}{others}: {error}") from error

    # -- checks -----------------------------------------------------------------------------

    def _check_inputs(self, xs) -> tuple[list[torch.Tensor], int]:
        c, n = self.config, self.ranks
        if isinstance(xs, torch.Tensor):
            xs = [xs] * n
        if not isinstance(xs, (list, tuple)) or len(xs) != n:
            got = f"a list of {len(xs)}" if isinstance(xs, (list, tuple)) else type(xs).__name__
            raise ValueError(f"WideLayer: xs must be one BF16 [T, H] tensor (every rank's "
                             f"tokens) or a list of {n} (one per rank), got {got}")
        tokens = None
        for r, x in enumerate(xs):
            rows = check_hidden_rows("WideLayer", f"xs[{r}]", x, config=c, device=self.device)
            tokens = rows if tokens is None else tokens
            if rows != tokens:
                raise ValueError(f"WideLayer: every rank holds the same T tokens; xs[0] has "
                                 f"{tokens} rows, xs[{r}] has {rows}")
        low = c.front_max + 1
        if tokens < low:
            raise ValueError(f"WideLayer: T={tokens} rows is below the wide layer's bucket "
                             f"[{low}, {self.max_rows}]: batches of 1..front_max={c.front_max} "
                             "rows belong to the DEP layer (fast.schedules.dep)")
        if tokens > self.max_rows:
            raise ValueError(f"WideLayer: T={tokens} rows > max_rows={self.max_rows} the layer "
                             f"was built for (the bucket ends at wide_rows={c.wide_rows})")
        return list(xs), tokens

    # -- the call ---------------------------------------------------------------------------

    def __call__(self, xs, *, check: bool = True, order: str = "side", shared: str = DEFAULT_SHARED_PLACEMENT,
                 side_delay_cycles: int = 0) -> list[WideRankOutputs]:
        """One layer step of every rank.

        Args:
            xs: BF16 ``[T, H]`` (every rank's tokens) or a list of ``N`` such tensors (one
                per rank, one ``T``), contiguous on the layer's device.
            check: call :meth:`check` after the launches (one synchronization); pass False
                inside a CUDA-graph capture and call :meth:`check` after.
            order: ``"side"``: the shared expert on a side stream beside everything up to
                each rank's up-projection (the schedule's streams); ``"serial"``:
                everything on the current stream. The bits are the same.
            shared: where each rank's shared-expert segment starts (``SHARED_PLACEMENTS``:
                ``"front"``, ``"beside"``, ``"tail"``; default ``DEFAULT_SHARED_PLACEMENT``).
                The bits are the same.
            side_delay_cycles: a spin of this many clock cycles at the start of each
                side-stream segment (``torch.cuda._sleep``), so that a missing wait
                between the streams shows as wrong data.

        Returns each rank's :class:`WideRankOutputs` (``.out`` is its layer output, the
        same bits on every rank)."""
        check_call_options("WideLayer", order, shared)
        xs, tokens = self._check_inputs(xs)
        index = self.mailbox_index
        calls = [WideCall(x, tokens, index, order=order, shared=shared,
                          side_delay_cycles=side_delay_cycles) for x in xs]
        run_steps(WIDE_STEPS, self._resources, calls)
        outputs = [call.outputs for call in calls]
        self.calls += 1
        if check:
            self.check()
        return outputs
