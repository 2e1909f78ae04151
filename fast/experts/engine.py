"""Host side of the experts engine: buffers allocated once, kernels compiled once per
geometry and window count, four launches per call, errors raised before or right after
the launches (never a silent wrong row)."""

from __future__ import annotations

import dataclasses
import functools

import torch

from fast import backend
from fast.experts.layout import WINDOW, PreparedExperts, stages_of

__all__ = ["ExpertsEngine", "EngineScratch", "Capture", "EngineError", "choose_windows",
           "choose_tile", "choose_tactic", "choose_walk", "complete_tactic", "check_tactic",
           "TACTIC_KEYS", "WGMMA_TILE", "WGMMA_TILE_ROWS", "kernel_params", "kernel_class",
           "compiled_kernel", "compile_all"]

_TOP_K = 16


class EngineError(ValueError):
    """A bad routing entry found by the engine's routing-lists kernel, or routing lists its
    plan kernel refused (over their capacity, or holding more pairs than the call has)."""


@dataclasses.dataclass
class Capture:
    """The engine's intermediates of one call, per pair ``p = row * top_k + k`` (rows of
    pairs this rank did not compute are NaN / 0xFF):

    * ``fc1``: FP32 ``[R*K, 2 I_s]`` FC1 outputs (gate columns, then up columns);
    * ``codes``: uint8 ``[R*K, I_s]`` E4M3 codes of the re-quantized SiTU output;
    * ``scales``: uint8 ``[R*K, I_s/32]`` their E8M0 scales.
    """

    fc1: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor


def choose_windows(rows: int, top_k: int, experts: int) -> int:
    """Windows of 8 tokens per work item: enough for the average expert's tokens
    (``rows * top_k / experts`` under uniform routing) in one pass over its weights, at
    most 4 (registers)."""
    tokens = rows * top_k / experts
    return 1 if tokens <= 8 else 2 if tokens <= 16 else 4


def choose_tile(rows: int, top_k: int, experts: int, local: int, *, windows: int,
                wgmma: bool) -> dict:
    """The tile and MMA part of ``choose_tactic`` (what ``choose_walk`` depends on), for
    a call of ``windows`` windows per item; ``wgmma``: the warpgroup MMA may be chosen
    (sm_90a, its 256-row tiles divide both GEMMs' rows, and the caller's own tactic
    leaves the tile and the MMA kind open: ``ExpertsEngine.default_tactic``)."""
    pairs = rows * top_k * local / experts
    if pairs <= 24:
        return dict(warps=4, mtiles=1)
    if wgmma and windows == 4:
        return dict(WGMMA_TILE)
    return {}


#: The default warpgroup-MMA tile of a four-window call (``choose_tile``), and its rows
#: (16 per warp and m-tile).
WGMMA_TILE = {"wgmma": 1, "warps": 8, "mtiles": 2}
WGMMA_TILE_ROWS = 16 * WGMMA_TILE["warps"] * WGMMA_TILE["mtiles"]


def choose_tactic(rows: int, top_k: int, experts: int, local: int, *, windows: int,
                  wgmma: bool, sliced: bool = False, walk: int = 1) -> dict:
    """The FC kernels' default shape for a call of ``windows`` windows per item whose FC2
    items walk ``walk`` row tiles (``choose_walk``; the walk itself is in the result when
    it is more than one); ``wgmma`` as ``choose_tile``.

    Tile: 64-row tiles of 4 warps of one m-tile each when the call has so few pairs that
    the 128-row tiles' work items would not fill the persistent grid twice (measured on
    the H200 at DEP16 T = 1: 113 us against 124 us for 2 warps of 2 m-tiles and 129 us for
    128-row tiles; from T = 2 on the 128-row tiles are as fast or faster), else 4 warps of
    2 m-tiles.

    MMA: ``mma.sync``, except at four windows per item on sm_90a (DEP16 T > 56, TP8 above
    896 rows), where the warpgroup MMA with 8 warps of 2 m-tiles (256-row tiles) is
    faster on the H200: as the default, 419.1 against 464.2 us at DEP16 T = 64 and 847.7
    against 898.6 us at TP8 1024 rows (walking 7 tiles;
    archived run ``experts/h200_engine_v16_wgmma_default``), but 301.2 against
    263.2 us at T = 16 (two windows; ``experts/h200_engine_v15_wgmma``; both in
    ``docs/ledger.md``). Switching the kind
    with the batch keeps a pair's rows batch invariant because the two kinds give the same
    bits (``verify/test_experts.py::test_experts_mma_kinds_same_bits``).

    Grid: an engine of whole experts (a DEP owner; ``sliced`` False) runs FC1 and FC2 in
    one persistent grid with the launch chain (``fused`` and ``pdl_chain``): measured on
    the H200 at one DEP16 rank it was the fastest engine at every T from 1 to 64, uniform
    and skewed (90.4 against 104.5 us at T = 1, 458.9 against 498.4 at T = 64,
    archived run ``experts/h200_engine_v8_tactics``; as the default, 90.8
    against 97.1 us at T = 1 over 30 replays, ``experts/h200_engine_v9_tile_T1``). An engine
    of an intermediate slice (a wide TP rank; ``sliced``) runs it too when its FC2 items
    walk and the call has at most two windows of pairs per expert: there it was 1.6-4.6%
    faster than the two kernels at TP8 65..512 rows (343.5/447.7/509.4/620.7 against
    360.0/464.0/521.6/631.1 us, ``experts/h200_engine_v11_tp8_fused``), and no faster at 1024
    rows (18 pairs per expert: 943.9 against 940.8 us, ``experts/h200_engine_v11_tp8_tactics``;
    1087.3 against 1064.6 in the layer, ``wide/h200_tp8_v5_fused``); with one row tile
    per FC2 item it was 3-5% slower (403.3 against 392.5 us at TP8 65 rows), so an unwalked
    slice keeps the two kernels. No tactic changes a bit (the contracts check each). The
    runs named here are archived (``docs/ledger.md``, experts engine)."""
    pairs = rows * top_k * local / experts
    tactic = choose_tile(rows, top_k, experts, local, windows=windows, wgmma=wgmma)
    if walk > 1:
        tactic["walk"] = walk
    if not sliced or (walk > 1 and pairs <= 2 * WINDOW * local):
        tactic.update(fused=1, pdl_chain=1)
    return tactic


#: The fewest weight stages a default FC2 work item streams (``choose_walk``).
WALK_STAGES = 12


@functools.lru_cache(maxsize=None)
def choose_walk(inter: int, latent: int, tile_rows: int) -> int:
    """FC2 row tiles per work item (tactic ``walk``) by default: the fewest that divide the
    ``latent / tile_rows`` tiles and give an item at least ``WALK_STAGES`` stages of
    ``inter`` k, 1 when FC2 is deeper than ``kernels.WALK_MAX_STAGES`` stages per tile.
    A TP8 or TP16 slice's FC2 has 3 stages per tile: 4 tiles per item; a DEP owner's (24
    stages) and a TP2 slice's (12) walk none. What it removes is each short item's claim,
    search, token table and ring fill between every 3 stages of weights (the FC2 kernel of
    a TP8 rank streamed at 0.67 of the read bandwidth against FC1's 0.84 on the H200,
    archived run ``experts/h200_engine_timeline_v2``); walking 4 tiles took 6 to
    12% off a TP8 rank's two kernels there, and 7 tiles measured the same as 4
    (``experts/h200_engine_v11_walk``; both in ``docs/ledger.md``)."""
    from fast.experts.kernels import WALK_MAX_STAGES

    stages = stages_of(inter)
    tiles = latent // tile_rows
    if stages > WALK_MAX_STAGES:
        return 1
    return next(d for d in range(1, tiles + 1)
                if tiles % d == 0 and (d * stages >= WALK_STAGES or d == tiles))


#: The keys of an FC kernel tactic (``ExpertsEngine.__call__``).
TACTIC_KEYS = ("warps", "mtiles", "ring", "chains", "occupancy", "pdl", "wgmma", "pdl_chain",
               "fused", "ctas", "walk")


def check_ctas(ctas, owner: str) -> None:
    """``ctas``, the size of a persistent grid (None: the engine's default), refused by
    name unless an int >= 1."""
    if ctas is not None and (not isinstance(ctas, int) or ctas < 1):
        raise ValueError(f"{owner}: ctas (the persistent grid's CTAs) must be an int >= 1, "
                         f"got {ctas!r}")


def check_tactic(tactic, arch: str, owner: str) -> dict:
    """A caller's tactic as a dict, refused by name when it is not one (unknown key,
    non-int value, wgmma off sm_90a)."""
    if not isinstance(tactic, dict):
        raise TypeError(f"{owner}: tactic must be a dict of {TACTIC_KEYS}, got "
                        f"{type(tactic).__name__}")
    unknown = sorted(set(tactic) - set(TACTIC_KEYS))
    if unknown:
        raise ValueError(f"{owner}: unknown tactic keys {unknown}; the keys are {TACTIC_KEYS}")
    bad = {k: v for k, v in tactic.items() if not isinstance(v, (int, bool))}
    if bad:
        raise ValueError(f"{owner}: tactic values must be ints, got {bad}")
    check_ctas(tactic.get("ctas"), owner)
    complete_tactic(dict(tactic), arch)  # wgmma needs sm_90a
    return dict(tactic)


def complete_tactic(tactic: dict, arch: str) -> dict:
    """``tactic`` with the MMA instruction filled in where the caller left it out:
    ``mma.sync`` (``wgmma`` False). Warpgroup MMA (``wgmma=1``: A from registers, B from
    the ring, sm_90a only, whole warpgroups and one accumulator chain; its contracts pass
    on the H200) is ``choose_tactic``'s default only at four windows per item, with 8
    warps; at four warps it measured 0-6% slower than ``mma.sync`` there
    (``docs/stages/experts.md``). ``arch`` is checked for it. ``pdl_chain`` (default
    False; contracts pass on the H200, within 2 us of the default): the plan kernel and
    FC1 launched with programmatic dependent launch too (the list kernel lets the plan
    kernel be scheduled at once; the plan kernel waits for it, then lets FC1 be scheduled;
    FC1 waits for the plan before its first claim), so the two launch gaps of a call
    overlap the kernels before them. ``fused`` (default False here; ``choose_tactic``
    turns it on with ``pdl_chain`` for an engine of whole experts and for a
    slice whose FC2 walks, up to two windows of pairs per expert; its
    contracts pass on the H200): FC1 and FC2 in one persistent grid
    (``kernels.FusedExpertsKernel``), an FC2 item waiting only for its own expert's FC1
    items. No tactic changes a bit."""
    tactic = {"wgmma": False, "pdl_chain": False, "fused": False, **tactic}
    if tactic["wgmma"] and arch != "sm_90a":
        raise ValueError(f"ExpertsEngine: tactic wgmma needs sm_90a (warpgroup MMA is Hopper's), "
                         f"the target is {arch}")
    return tactic


def kernel_class(kind: str) -> type:
    """The class of the kernel ``kind`` of :func:`kernel_params`."""
    from fast.experts import kernels, lists

    return {"lists": lists.RoutingListsKernel, "plan": lists.PlanKernel,
            "fused": kernels.FusedExpertsKernel, "fc1": kernels.ExpertsGemmKernel,
            "fc2": kernels.ExpertsGemmKernel}[kind]


def compiled_kernel(kind: str, arch: str, params: tuple):
    """The kernel ``kind`` of :func:`kernel_params` compiled for ``arch`` with ``params``
    (``fast.device.compile``: fake arguments, no GPU needed; cached)."""
    from fast.device.compile import compiled

    return compiled(kernel_class(kind), arch, params)


@functools.lru_cache(maxsize=None)
def _occupancy(params: tuple) -> int:
    """CTAs per multiprocessor an FC kernel is built for (the persistent grid's factor)."""
    from fast.experts import kernels

    kw = dict(params)
    if "fc1" in kw and "fc2" in kw:  # the fused kernel: the smaller of the two
        return min(_occupancy(kw["fc1"]), _occupancy(kw["fc2"]))

    return kernels.ExpertsGemmKernel(**dict(params)).occupancy


def compile_all(prepared_geometry, config, *, windows: int, arch: str, capture: bool = False,
                strict: bool = False, empty_rows: bool = False, tactic: dict | None = None):
    """Compile the four kernels of one geometry for ``arch`` (no GPU needed), with the
    default FC shape or ``tactic``."""
    return [compiled_kernel(kind, arch, params) for kind, params in
            kernel_params(prepared_geometry, config, windows, capture, strict,
                           complete_tactic(tactic or {}, arch), empty_rows=empty_rows).items()]


def kernel_params(g, config, windows: int, capture: bool, strict: bool,
                  tactic: dict | None = None, empty_rows: bool = False) -> dict:
    """The compile parameters (kind -> sorted items) of one call's kernels of the prepared
    geometry ``g`` at ``windows`` (1, 2 or 4) with ``tactic`` (complete:
    :func:`complete_tactic`)."""
    if windows not in (1, 2, 4):
        raise ValueError(f"ExpertsEngine: windows must be 1, 2 or 4, got {windows}")
    common = dict(inter=g.inter, latent=g.latent, count=g.count, windows=windows,
                  top_k=config.top_k, capture=capture, pdl=True)
    common.update(tactic or {})
    common.pop("ctas", None)  # a launch size, not a kernel parameter
    walk = common.pop("walk", 1)  # FC2's row tiles per item (FC1's items are long)
    chain = bool(common.pop("pdl_chain", False))
    fused = bool(common.pop("fused", False))
    params = {
        "lists": tuple(sorted(dict(latent=g.latent, top_k=config.top_k, experts=config.experts,
                                   first=g.first, count=g.count, strict=strict,
                                   empty_rows=empty_rows, pdl_chain=chain).items())),
        "plan": tuple(sorted(dict(count=g.count, windows=windows, pdl_chain=chain,
                                  fused=fused).items())),
        "fc1": tuple(sorted(dict(common, fc1=True, rows=2 * g.inter, k=g.latent,
                                 beta=float(config.situ_beta), pdl_chain=chain,
                                 linear_beta=float(config.situ_linear_beta)).items())),
        "fc2": tuple(sorted(dict(common, fc1=False, rows=g.latent, k=g.inter, capture=False,
                                 walk=walk).items())),
    }
    if fused:  # one persistent grid for both GEMMs (kernels.FusedExpertsKernel)
        params["fused"] = (("fc1", params.pop("fc1")), ("fc2", params.pop("fc2")))
    return params


class EngineScratch:
    """The engine's call buffers, shareable by every engine of one geometry on one stream
    (the layers of a model run one after another; each call re-initializes what it reads,
    and the routing-lists and plan kernels leave the counters armed for the next call):

    * ``work``: int32 work table (``fast.experts.lists.Workspace``), zeroed once;
    * ``lists``: int32 ``[count, max_rows]`` routing lists (pair indices);
    * ``plan``: BF16 ``[max_rows, L]`` plan rows;
    * ``hidden``: BF16 ``[max_rows * K, I_s]`` the FC1 -> FC2 hidden rows.
    """

    def __init__(self, geometry, *, max_rows: int, device):
        from fast.experts.lists import Workspace

        if not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"EngineScratch: max_rows must be a positive int, got {max_rows!r}")
        self.geometry, self.max_rows, self.device = geometry, max_rows, torch.device(device)
        g, dev = geometry, self.device
        self.layout = Workspace(g.count)
        self.work = torch.zeros(self.layout.words, dtype=torch.int32, device=dev)
        self.lists = torch.empty(g.count, max_rows, dtype=torch.int32, device=dev)
        self.plan = torch.empty(max_rows, g.latent, dtype=torch.bfloat16, device=dev)
        self.hidden = torch.empty(max_rows * _TOP_K, g.inter, dtype=torch.bfloat16, device=dev)

    def fits(self, geometry, max_rows: int, device) -> str | None:
        """None when an engine of ``geometry`` and ``max_rows`` on ``device`` can use this
        scratch, else why not."""
        g, mine = geometry, self.geometry
        if (g.count, g.inter, g.latent) != (mine.count, mine.inter, mine.latent):
            return (f"its geometry (experts {mine.count}, I_s {mine.inter}, L {mine.latent}) is "
                    f"not the engine's ({g.count}, {g.inter}, {g.latent})")
        if max_rows > self.max_rows:
            return f"it holds {self.max_rows} rows, the engine needs {max_rows}"
        if torch.device(device) != self.device:
            return f"it is on {self.device}, the engine on {device}"
        return None


class ExpertsEngine:
    """The routed experts of one rank (``fast.experts``), reusable across calls.

    Args:
        prepared: ``prepare_experts(...)`` on a CUDA device (DEP owner: the local experts;
            wide: every expert's TP slice).
        max_rows: the most rows (received rows / tokens) one call may have; buffers are
            sized for it once.
        strict: a pair whose expert is not local is an error (DEP owners whose dispatch
            should only send local pairs); default: skipped.
        empty_rows: an id of -1 marks a slot of an empty row (a DEP owner's receive rows
            no token was sent to): no pair, not an error; default: -1 is an error like
            every id outside ``[0, E)``.
        scratch: an ``EngineScratch`` to use instead of allocating one (engines of the
            same geometry sharing one stream, e.g. the layers of a model); its
            ``max_rows`` becomes the engine's.
        tactic: FC kernel settings (``__call__``'s ``tactic`` keys) applied over
            ``choose_tactic``'s tile and grid in every call that passes no tactic of its own
            (``default_tactic``, also in ``compile_for``): how a layer runs its engine with
            e.g. ``{"wgmma": 1}`` or ``{"fused": 0}``.
    """

    def __init__(self, prepared: PreparedExperts, *, max_rows: int, strict: bool = False,
                 empty_rows: bool = False, scratch: EngineScratch | None = None,
                 tactic: dict | None = None):
        if not isinstance(prepared, PreparedExperts):
            raise TypeError(f"ExpertsEngine: prepared must be PreparedExperts, got {type(prepared).__name__}")
        if not prepared.device.type == "cuda":
            raise ValueError(f"ExpertsEngine: prepared experts must be on a CUDA device, got {prepared.device}")
        if not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"ExpertsEngine: max_rows must be a positive int, got {max_rows!r}")
        backend.require_supported("ExpertsEngine")
        self.prepared, self.strict = prepared, strict
        self.empty_rows = bool(empty_rows)
        self.config, self.geometry = prepared.config, prepared.geometry
        self.device = prepared.device
        self.arch = backend.device_arch(self.device)
        g, dev = self.geometry, self.device
        if scratch is None:
            scratch = EngineScratch(g, max_rows=max_rows, device=dev)
        elif not isinstance(scratch, EngineScratch):
            raise TypeError(f"ExpertsEngine: scratch must be EngineScratch, got {type(scratch).__name__}")
        elif (why := scratch.fits(g, max_rows, dev)) is not None:
            raise ValueError(f"ExpertsEngine: the scratch does not fit: {why}")
        self.scratch, self.max_rows, self.layout = scratch, scratch.max_rows, scratch.layout
        self.work, self.lists = scratch.work, scratch.lists
        self.plan, self.hidden = scratch.plan, scratch.hidden
        self.sms = torch.cuda.get_device_properties(dev).multi_processor_count
        self._null = torch.zeros(16, dtype=torch.uint8, device=dev)
        self.tactic = check_tactic(tactic or {}, self.arch, "ExpertsEngine")

    # -- checks -----------------------------------------------------------------------

    def check_inputs(self, codes, scales, ids, out):
        g, c, dev = self.geometry, self.config, self.device
        for name, t in (("codes", codes), ("scales", scales), ("ids", ids)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"ExpertsEngine: {name} must be a torch.Tensor")
            if t.device != dev:
                raise ValueError(f"ExpertsEngine: {name} is on {t.device}, the experts on {dev}")
            if not t.is_contiguous():
                raise ValueError(f"ExpertsEngine: {name} must be contiguous")
        if codes.dtype != torch.float8_e4m3fn or codes.dim() != 2 or codes.shape[1] != g.latent:
            raise ValueError(f"ExpertsEngine: codes must be float8_e4m3fn [R, L={g.latent}], got "
                             f"{codes.dtype} {tuple(codes.shape)}")
        rows = codes.shape[0]
        if rows > self.max_rows:
            raise ValueError(f"ExpertsEngine: {rows} rows > max_rows={self.max_rows} the engine "
                             "was built for")
        if scales.dtype != torch.uint8 or tuple(scales.shape) != (rows, g.latent // 32):
            raise ValueError(f"ExpertsEngine: scales must be uint8 [R, L/32] = [{rows}, "
                             f"{g.latent // 32}], got {scales.dtype} {tuple(scales.shape)}")
        if ids.dtype != torch.int32 or tuple(ids.shape) != (rows, c.top_k):
            raise ValueError(f"ExpertsEngine: ids must be int32 [R, top_k] = [{rows}, {c.top_k}], "
                             f"got {ids.dtype} {tuple(ids.shape)}")
        if codes.data_ptr() % 16:
            raise ValueError("ExpertsEngine: codes must be 16-byte aligned")
        if out is not None:
            if (not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16
                    or tuple(out.shape) != (rows * c.top_k, g.latent) or not out.is_contiguous()
                    or out.device != dev):
                raise ValueError(f"ExpertsEngine: out must be contiguous bfloat16 [R*K, L] = "
                                 f"[{rows * c.top_k}, {g.latent}] on {dev}")
        return rows

    def start_call(self, codes, scales, ids, out, windows, allowed=(1, 2, 4)):
        """A call's input checks, its output (default a new NaN-filled BF16 ``[R*K, L]``)
        and its window count (default ``choose_windows``; one of ``allowed``):
        ``(rows, out, windows)``."""
        rows = self.check_inputs(codes, scales, ids, out)
        c, g = self.config, self.geometry
        if out is None:
            out = torch.full((rows * c.top_k, g.latent), float("nan"), dtype=torch.bfloat16,
                             device=self.device)
        windows = windows or choose_windows(max(rows, 1), c.top_k, c.experts)
        if windows not in allowed:
            raise ValueError(f"{type(self).__name__}: windows must be one of {allowed}, got "
                             f"{windows}")
        return rows, out, windows

    # -- the call ---------------------------------------------------------------------

    def __call__(self, codes: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor, *,
                 out: torch.Tensor | None = None, windows: int | None = None,
                 validate: bool = True, capture: bool = False, tactic: dict | None = None,
                 listed: bool = False):
        """Every local pair's expert row.

        Args:
            codes: float8_e4m3fn ``[R, L]`` MXFP8 latent rows (received rows in DEP, the
                plan rows in wide); scales: uint8 ``[R, L/32]`` their E8M0 scales.
            ids: int32 ``[R, top_k]`` global expert ids of each row's pairs.
            out: optional BF16 ``[R*K, L]`` output (rows of pairs that are not local are
                left untouched); default a new NaN-filled tensor.
            windows: windows of 8 tokens per work item (default ``choose_windows``): 1, 2
                or 4.
            validate: read the kernels' error word after the call (one synchronization)
                and raise ``EngineError`` for an id outside ``[0, E)``, a routing list over
                its capacity, or (strict) a non-local expert. Pass False inside CUDA-graph
                capture and call ``check()`` later.
            capture: also return the intermediates (``Capture``; for verification).
            listed: the caller's kernel, launched before on this stream, already did the
                routing-lists kernel's work for exactly these ``ids``, ``codes`` and
                ``scales``: a ``lists.RoutingListsKernel(**list_params())`` emitted into
                it appended every pair to this engine's ``lists`` (its ``work`` counters)
                and wrote its ``plan`` rows (``fast.schedules.wide_route``); the call
                then launches from the plan kernel on.
            tactic: optional FC kernel shape ``{"warps", "mtiles", "ring", "chains",
                "occupancy", "pdl", "wgmma", "pdl_chain", "fused", "ctas", "walk"}``
                (defaults: ``default_tactic``'s tile and grid, a ring of 4 stages for one
                window and 3 for more, one accumulator chain, CTAs per multiprocessor
                from the shared memory, ``pdl`` on: FC1 lets FC2 launch early, and FC2
                streams its first weights before it waits for FC1's hidden rows; ``wgmma``,
                ``pdl_chain`` and ``fused`` as ``complete_tactic``
                describes them; ``ctas``: the persistent grids' size, default the
                multiprocessors times the occupancy, smaller so that every CTA runs many
                items, as at a real rank's batch; ``walk``: FC2 row tiles per work item,
                streamed back to back through one ring, their B operand copied once
                and kept in shared memory, for FC2 GEMMs of at most
                ``kernels.WALK_MAX_STAGES`` stages. Warps, m-tiles, ring,
                occupancy, pdl, pdl_chain, fused, ctas and walk never change a bit; ``chains``
                changes the summation order (within the same bound), so a call with a
                non-default ``chains`` is not batch invariant with the default; ``wgmma``
                changes the instruction (the contracts hold each MMA kind batch invariant
                on its own). Every tactic is covered by ``verify/test_experts.py``.

        Returns:
            ``out``, or ``(out, Capture)`` with ``capture``.
        """
        rows, out, windows = self.start_call(codes, scales, ids, out, windows)
        if rows == 0:
            return (out, self.capture_buffers(0)) if capture else out
        c, g = self.config, self.geometry
        if tactic is None:
            tactic = self.default_tactic(rows, windows)
        else:
            tactic = check_tactic(tactic, self.arch, "ExpertsEngine")
        tactic = complete_tactic(tactic, self.arch)
        params = kernel_params(g, c, windows, capture, self.strict, tactic, self.empty_rows)
        fn = {kind: compiled_kernel(kind, self.arch, p) for kind, p in params.items()}
        cap = self.capture_buffers(rows) if capture else None
        i64, i32 = _i64, _i32
        stream = backend.stream(self.device)
        work = i64(self.work)
        if not listed:
            fn["lists"](i64(ids), i64(codes), i64(scales), i64(self.plan), i64(self.lists), work,
                        i32(rows), i32(self.max_rows), stream)
        fn["plan"](work, i32(self.max_rows), i32(rows * c.top_k), stream)
        null = i64(self._null)
        p = self.prepared
        caps = [i64(t) for t in ((cap.fc1, cap.codes, cap.scales) if cap else (self._null,) * 3)]
        ctas = tactic.get("ctas")
        if "fused" in fn:
            grid = i32(ctas or self.sms * _occupancy(params["fused"]))
            fn["fused"](i64(p.w13), i64(p.s13), i64(self.plan), i64(self.lists), work,
                        i64(self.hidden), i64(p.w2), i64(p.s2), i64(out), *caps,
                        i32(self.max_rows), grid, stream)
            if validate:
                self.check()
            return (out, cap) if capture else out
        grid = i32(ctas or self.sms * _occupancy(params["fc1"]))
        fn["fc1"](i64(p.w13), i64(p.s13), i64(self.plan), i64(self.lists), work, i64(self.hidden),
                  *caps, i32(self.max_rows), grid, stream)
        grid2 = i32(ctas or self.sms * _occupancy(params["fc2"]))
        fn["fc2"](i64(p.w2), i64(p.s2), i64(self.hidden), i64(self.lists), work, i64(out),
                  null, null, null, i32(self.max_rows), grid2, stream)
        if validate:
            self.check()
        return (out, cap) if capture else out

    def live_counts(self) -> torch.Tensor:
        """The routing lists' append counters, int32 ``[count]`` (a view of the work table):
        what the appends of a call set and its plan kernel reads and re-arms to 0. A caller
        whose own kernel appends (``listed``) and that must drop those appends (a route
        stage run without the experts stage) zeroes them; a benchmark that replays a
        listed call alone restores them before each replay."""
        at = self.layout.live
        return self.work[at:at + self.geometry.count]

    def list_params(self) -> dict:
        """The ``lists.RoutingListsKernel`` parameters of this engine's calls (a kernel
        that does its work for a ``listed`` call builds one from them)."""
        c, g = self.config, self.geometry
        return dict(latent=g.latent, top_k=c.top_k, experts=c.experts, first=g.first,
                    count=g.count, strict=self.strict, empty_rows=self.empty_rows)

    def compile_for(self, rows: int) -> None:
        """Compile, on the host only, the kernels a call of ``rows`` rows launches with the
        default windows and tactic, so that call launches at once (a real DEP rank's
        peers wait for its rows with a timeout)."""
        c, g = self.config, self.geometry
        params = kernel_params(g, c, choose_windows(rows, c.top_k, c.experts), False,
                                self.strict, complete_tactic(self.default_tactic(rows), self.arch),
                                self.empty_rows)
        for kind, p in params.items():
            compiled_kernel(kind, self.arch, p)

    def default_tactic(self, rows: int, windows: int | None = None,
                       over: dict | None = None) -> dict:
        """The tactic of a call of ``rows`` rows and ``windows`` windows per item (default
        ``choose_windows``) that passes none: ``choose_tactic``'s (sliced when the engine
        holds a slice of each expert; the warpgroup MMA allowed on sm_90a where its
        256-row tiles divide FC1's ``2 I_s`` and FC2's ``L`` rows (not a TP16 slice's 384)
        and the engine's own tactic names neither the tile nor the MMA: ``warps``,
        ``mtiles``, ``chains`` or ``wgmma``; FC2's walk from ``choose_walk`` for the call's
        tile), under the engine's own ``tactic``. ``over``: keys
        laid over the engine's own tactic first, under the same rules (a variant of the
        default, as the benchmarks time them: ``{"chains": 2}`` gives ``mma.sync``, and
        ``{"warps": 4}`` the walk of 128-row tiles)."""
        c, g = self.config, self.geometry
        own = ({**self.tactic, **check_tactic(over, self.arch, "ExpertsEngine.default_tactic")}
               if over else self.tactic)
        windows = windows or choose_windows(rows, c.top_k, c.experts)
        wgmma = (self.arch == "sm_90a" and (2 * g.inter) % WGMMA_TILE_ROWS == 0
                 and g.latent % WGMMA_TILE_ROWS == 0
                 and not own.keys() & {"warps", "mtiles", "chains", "wgmma"})
        walk = own.get("walk", 1)
        if "walk" not in own:
            tile = {**choose_tile(rows, c.top_k, c.experts, g.count, windows=windows,
                                  wgmma=wgmma), **own}
            walk = choose_walk(g.inter, g.latent, 16 * tile.get("warps", 4) * tile.get("mtiles", 2))
        return {**choose_tactic(rows, c.top_k, c.experts, g.count, windows=windows, wgmma=wgmma,
                                sliced=g.shard[1] > 1, walk=walk), **own}

    def check(self) -> None:
        """Raise ``EngineError`` if a call since the last check met a bad routing entry or
        (tactic ``fused``) an FC2 item's wait for its expert timed out (synchronizes the
        device), and clear the error."""
        from fast.experts.kernels import GATE_SPIN_LIMIT
        from fast.experts.lists import (ERROR_GATE_TIMEOUT, ERROR_ID_RANGE, ERROR_LIST_OVERFLOW,
                                        ERROR_STALE_LISTS)

        at = self.layout.error
        code, pair, value = (int(v) for v in self.work[at:at + 3].tolist())
        if code == 0:
            return
        self.work[at:at + 3] = 0
        if code == ERROR_STALE_LISTS:
            raise EngineError(f"ExpertsEngine: the routing lists held {pair} pairs, more than the "
                              f"call's {value} (rows x top_k): appends of an earlier listed call "
                              f"that no call consumed (a route stage run twice without the "
                              f"experts stage?); nothing was computed, and the lists are "
                              f"re-armed")
        if code == ERROR_GATE_TIMEOUT:
            raise EngineError(f"ExpertsEngine (fused): an FC2 item of local expert {pair} waited "
                              f"{GATE_SPIN_LIMIT} polls (about 2 s) for its expert's FC1 items and saw "
                              f"{value} finished; the call's rows are unspecified")
        k = self.config.top_k
        where = f"ids[{pair // k}, {pair % k}] = {value}"
        if code == ERROR_ID_RANGE:
            raise EngineError(f"ExpertsEngine: {where} is outside [0, experts={self.config.experts})")
        if code == ERROR_LIST_OVERFLOW:
            raise EngineError(f"ExpertsEngine: {where}: expert {value}'s routing list is over its "
                              f"capacity {self.max_rows} (a row names the same expert twice?)")
        g = self.geometry
        raise EngineError(f"ExpertsEngine: {where} is not a local expert [{g.first}, "
                          f"{g.first + g.count}) and the engine is strict")

    def capture_buffers(self, rows: int) -> Capture:
        g, k, dev = self.geometry, self.config.top_k, self.device
        return Capture(
            fc1=torch.full((rows * k, 2 * g.inter), float("nan"), dtype=torch.float32, device=dev),
            codes=torch.full((rows * k, g.inter), 0xFF, dtype=torch.uint8, device=dev),
            scales=torch.full((rows * k, g.inter // 32), 0xFF, dtype=torch.uint8, device=dev),
        )


def _i64(t: torch.Tensor):
    from cutlass import Int64

    return Int64(t.data_ptr())


def _i32(v: int):
    from cutlass import Int32

    return Int32(int(v))
