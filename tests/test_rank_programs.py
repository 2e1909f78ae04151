"""One rank program per schedule, on the CPU: the virtual layers (``DepLayer``,
``WideLayer``) and the real-rank layers (``DepPeerLayer``, ``WidePeerLayer``) run the same
step tuple (``fast.schedules.dep_program.DEP_STEPS``, ``fast.schedules.wide_program.
WIDE_STEPS``), and each virtual rank's launches equal the real rank's of the same index:
the same kernels, engine calls, dense and cuBLAS calls and stream events, in the same
order, with the same scalars and the same pattern of buffers (every address numbered by
its first use in the rank's log), except that a real rank also waits where its program
says (after the dispatch and the owner finalize; after the Finalize and the up columns)
and its DEP kernels signal through its arrival tables.

The layers are built on stand-ins: no GPU, no kernel runs (compiled kernels, the experts
engine, the dense part and the cuBLAS calls record their arguments), the device is a
CPU tensor store, and the real ranks' symmetric memory and process group are stand-ins
(``tests/test_peer_symmetric.py`` checks the real setup's views and tables). The GPUs run
the layers (``verify/test_dep_fast.py``, ``verify/test_dep_peer.py``,
``verify/test_wide_fast.py``, ``verify/test_wide_peer.py``)."""

from __future__ import annotations

import contextlib
import dataclasses
import types
from types import SimpleNamespace

import pytest
import torch

from fast import backend
from model.config import LatentMoEConfig
from model.weights import LatentMoEWeights

_cute_error = backend.cute_import_error()
pytestmark = pytest.mark.skipif(_cute_error is not None,
                                reason=f"CuTe DSL not importable: {_cute_error}")

CFG = LatentMoEConfig.small()


class CpuDevice(str):
    """The layers' device: a CUDA device to their checks (``type``, ``index``), the CPU to
    torch (a device string)."""

    type, index = "cuda", 0

    def __eq__(self, other):
        return str(other) == "cpu"

    def __ne__(self, other):
        return not self == other

    __hash__ = str.__hash__


DEVICE = CpuDevice("cpu")


class Recorder:
    """The launch log: ``(rank, event)`` with ``rank`` the rank whose step is running."""

    def __init__(self):
        self.log, self.rank, self.programs = [], None, []

    def clear(self):
        self.log.clear()
        self.programs.clear()

    def add(self, *event):
        self.log.append((self.rank, event))

    def run_steps(self, steps, ranks, calls):
        """``fast.schedules.steps.run_steps`` noting the program and the running rank."""
        self.programs.append(steps)
        for step in steps:
            for rank, call in zip(ranks, calls, strict=True):
                self.rank = rank.rank
                step(rank, call)
        self.rank = None

    def of(self, rank):
        return [event for r, event in self.log if r == rank]


def value(arg):
    """A launch argument as a plain value (cutlass scalars by their value)."""
    if isinstance(arg, torch.Tensor):
        return ("tensor", arg.data_ptr(), tuple(arg.shape), arg.dtype)
    return getattr(arg, "value", arg)


def numbered(events):
    """``events`` with every address (an int of 2**32 or more, a tensor's data pointer)
    replaced by the order of its first use."""
    ids = {}

    def number(v):
        if isinstance(v, tuple) and v[:1] == ("tensor",):
            return ("tensor", number(v[1]), *v[2:])
        if isinstance(v, tuple):
            return tuple(number(x) for x in v)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 1 << 32:
            return ("address", ids.setdefault(v, len(ids)))
        return v

    return [number(e) for e in events]


class TorchOnCpu(types.ModuleType):
    """``torch`` for a layer module: devices are the CPU (``device=`` arguments dropped,
    ``torch.device`` returns its argument); streams and events are recorded."""

    def __init__(self, rec):
        super().__init__("torch")
        self.rec = rec
        self.cuda = SimpleNamespace(
            current_stream=lambda device=None: self.main, Stream=lambda device=None: FakeStream(rec, "side"),
            stream=self.stream, current_device=lambda: 0, synchronize=lambda device=None: None,
            is_current_stream_capturing=lambda: False,
            _sleep=lambda cycles: rec.add("sleep", cycles))
        self.main = FakeStream(rec, "main")

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def device(*args):
        return DEVICE

    @staticmethod
    def empty(*args, device=None, **kw):
        return torch.zeros(*args, **kw)  # zeros: the recorded runs read what they write

    @staticmethod
    def zeros(*args, device=None, **kw):
        return torch.zeros(*args, **kw)

    @staticmethod
    def tensor(*args, device=None, **kw):
        return torch.tensor(*args, **kw)

    @contextlib.contextmanager
    def stream(self, s):
        self.rec.add("stream", s.name)
        yield
        self.rec.add("stream end", s.name)


class FakeStream:
    def __init__(self, rec, name):
        self.rec, self.name = rec, name

    def wait_stream(self, other):
        self.rec.add("wait_stream", self.name, other.name)

    def record_event(self):
        self.rec.add("record_event", self.name)
        return f"event of {self.name}"

    def wait_event(self, event):
        self.rec.add("wait_event", self.name, event)


class Kernel:
    def __init__(self, rec, kind):
        self.rec, self.kind = rec, kind

    def __call__(self, *args):
        self.rec.add("kernel", self.kind, *(value(a) for a in args))


@dataclasses.dataclass(frozen=True)
class Prepared:
    """``prepare_experts_for``' result: which experts (DEP) or which TP slice (wide)."""

    experts: tuple | None
    shard: tuple | None
    geometry = None


class Engine:
    """The experts engine: records its calls; the workspace a wide route kernel reads."""

    def __init__(self, rec, prepared, *, max_rows, **kw):
        self.rec, self.max_rows, self.prepared = rec, max_rows, prepared
        self.plan = torch.zeros(max_rows, CFG.latent, dtype=torch.bfloat16)
        self.lists = torch.zeros(CFG.experts, max_rows, dtype=torch.int32)
        self.work = torch.zeros(64 + CFG.experts, dtype=torch.int32)
        self.layout = SimpleNamespace(count=8)

    def __call__(self, codes, scales, ids, *, out, **kw):
        self.rec.add("engine", self.prepared, value(codes), value(scales), value(ids),
                     value(out), tuple(sorted(kw.items())))

    def list_params(self):
        from fast.schedules.wide import slice_list_params

        return slice_list_params(CFG)

    def live_counts(self):
        return self.work[:CFG.experts]

    def compile_for(self, rows):
        pass

    def check(self):
        pass


class Dense:
    """``DenseFront``: fresh outputs per call, its calls recorded."""

    def __init__(self, rec):
        self.rec = rec
        self.latent_norm = torch.ones(CFG.latent, dtype=torch.bfloat16)

    def __call__(self, x, *, order="serial", side_delay_cycles=0):
        from fast.schedules.dense import DenseOutputs

        t, c = x.shape[0], CFG
        out = DenseOutputs(
            torch.zeros(t, c.experts), torch.zeros(t, c.top_k), torch.zeros(t, c.top_k, dtype=torch.int32),
            torch.zeros(t, 2 * c.shared_intermediate + c.latent, dtype=torch.bfloat16),
            torch.zeros(t, c.hidden, dtype=torch.bfloat16),
            torch.zeros(t, c.latent, dtype=torch.float8_e4m3fn),
            torch.zeros(t, c.latent // 32, dtype=torch.uint8),
            "shared event" if order == "side" else None)
        self.rec.add("dense", value(x), order, side_delay_cycles,
                     *(value(v) for v in out[:7]))
        return out

    def wait_for_shared(self, dense):
        self.rec.add("wait_for_shared", dense.shared_ready, value(dense.shared))

    def up_projection(self, dense, normed):
        self.rec.add("up_projection", value(dense.shared), value(normed))
        return torch.zeros(normed.shape[0], CFG.hidden, dtype=torch.bfloat16)


def weights():
    return LatentMoEWeights.random(CFG, seed=0)


@pytest.fixture
def stand_ins(monkeypatch):
    """Patch the layer modules' GPU pieces with recorders; returns the recorder."""
    import fast.experts
    import fast.experts.engine
    from fast.schedules import dep, dep_peer, dep_program, wide, wide_peer, wide_program

    rec = Recorder()
    cpu_torch = TorchOnCpu(rec)
    for module in (dep, dep_peer, dep_program, wide, wide_peer, wide_program):
        monkeypatch.setattr(module, "torch", cpu_torch)
        monkeypatch.setattr(module, "run_steps", rec.run_steps, raising=False)
    monkeypatch.setattr(backend, "device_supported", lambda: (True, ""))
    monkeypatch.setattr(backend, "cuda_device", lambda who, device=None: DEVICE)
    monkeypatch.setattr(backend, "device_arch", lambda device: "sm_90a")
    monkeypatch.setattr(backend, "stream", lambda device=None: "stream")
    monkeypatch.setattr(backend, "ptr", lambda t, kind, align=None: ("ptr", t.data_ptr(), kind))
    for module in (dep, dep_peer, wide, wide_peer):
        monkeypatch.setattr(module, "compiled_kernel",
                            lambda kind, arch, params: Kernel(rec, kind))
    # the layers build their engines through fast.experts.select (on sm_90a: ExpertsEngine)
    monkeypatch.setattr(fast.experts, "experts_engine_for",
                        lambda arch, prepared, **kw: Engine(rec, prepared, **kw))
    monkeypatch.setattr(fast.experts, "prepare_experts_for",
                        lambda arch, w, device, experts=None, shard=None: Prepared(experts, shard))
    monkeypatch.setattr(fast.experts.engine, "EngineScratch", lambda *a, **kw: "engine scratch")
    monkeypatch.setattr(dep, "DenseFront", lambda *a, **kw: Dense(rec))
    monkeypatch.setattr(dep_peer, "DenseFront", lambda *a, **kw: Dense(rec))
    for module in (dep, dep_peer, wide, wide_peer):
        monkeypatch.setattr(module, "check_token_rows",
                            lambda who, xs, names, **kw: xs[0].shape[0], raising=False)
        monkeypatch.setattr(module, "check_hidden_rows",
                            lambda who, name, x, **kw: x.shape[0], raising=False)
    monkeypatch.setattr(wide_program.stock, "mm_fp32_out", lambda x, w: (
        rec.add("mm_fp32_out", value(x), value(w)),
        torch.zeros(x.shape[0], w.shape[0]))[1])
    monkeypatch.setattr(wide_program, "mm_bf16_into",
                        lambda a, b, out, split_k=True: rec.add("mm_bf16", value(a), value(b),
                                                                value(out), split_k))
    monkeypatch.setattr(wide_program, "_addmm_bf16_into",
                        lambda c, a, b, out, split_k=True: rec.add("addmm_bf16", value(c), value(a),
                                                                   value(b), value(out), split_k))
    monkeypatch.setattr(wide_program.activation, "situ_and_mul", lambda h, *, out, **kw: (
        rec.add("situ_and_mul", value(h), value(out), tuple(sorted(kw.items()))), out)[1])
    monkeypatch.setattr(wide_program.finalize, "finalize", lambda rows, w, *, out: rec.add(
        "finalize", value(rows), value(w), value(out)))
    return rec


class Symmetric:
    """``fast.schedules.symmetric.SymmetricBuffer`` of one rank: CPU views of the layout,
    and tables of made-up peer addresses (rank ``p``'s field at ``(p + 1) << 40``)."""

    def __init__(self, layout, size, group, device):
        self.tensor = torch.zeros(size, dtype=torch.uint8)
        self.views = {name: self.tensor[at:at + torch.Size(shape).numel() * dtype.itemsize]
                      .view(dtype).view(shape) for name, (at, shape, dtype) in layout.items()}
        self.layout, self.ranks = layout, group.size

    def address(self, peer, name, offset=0):
        return ((peer + 1) << 40) + self.layout[name][0] + offset

    def table(self, name, offset=0):
        return torch.tensor([self.address(p, name, offset) for p in range(self.ranks)],
                            dtype=torch.int64)


def peer_world(monkeypatch, module, rank, ranks):
    """The stand-in process group of ``module``'s real-rank layer: rank ``rank`` of
    ``ranks``."""
    import torch.distributed as dist

    group = SimpleNamespace(size=ranks)
    monkeypatch.setattr(module, "process_group", lambda who, g=None: (group, rank, ranks))
    monkeypatch.setattr(module, "SymmetricBuffer", Symmetric)
    monkeypatch.setattr(module, "meet", lambda group, device: None)
    monkeypatch.setattr(dist, "all_gather_object",
                        lambda out, obj, group=None: out.__setitem__(slice(None), [obj] * ranks))
    monkeypatch.setattr(dist, "barrier", lambda group=None: None)


RANKS, TOKENS = 2, 3


def test_dep_virtual_and_real_ranks_run_one_program(stand_ins, monkeypatch):
    from fast.schedules import dep, dep_peer
    from fast.schedules.dep_program import DEP_STEPS

    w = weights()
    xs = [torch.randn(TOKENS, CFG.hidden).to(torch.bfloat16) for _ in range(RANKS)]
    rec = stand_ins
    virtual = dep.DepLayer(w, ranks=RANKS, max_tokens=4, device="cuda")
    outs = virtual(xs, check=False, order="side", side_delay_cycles=5)
    assert rec.programs == [DEP_STEPS]
    want = {r: rec.of(r) for r in range(RANKS)}
    assert [o.out.shape for o in outs] == [(TOKENS, CFG.hidden)] * RANKS
    for r in range(RANKS):
        rec.clear()
        peer_world(monkeypatch, dep_peer, r, RANKS)
        real = dep_peer.DepPeerLayer(w, max_tokens=4, timeout_s=1.0)
        real._prepared.add(TOKENS)
        out = real(xs[r], check=False, order="side", side_delay_cycles=5)
        assert rec.programs == [DEP_STEPS]
        got = numbered(rec.of(r))
        kinds = [e[1] for e in got if e[0] == "kernel"]
        assert kinds == ["dispatch", "wait", "owner_finalize", "wait", "combine"]
        waits = [e for e in got if e[:2] == ("kernel", "wait")]
        assert [(e[-3], e[-2]) for e in waits] == [(r, 0), (r, 1)]  # rank, what
        assert [e[-4] for e in waits] == [TOKENS, TOKENS]  # each counter grows by T
        # the signal tables: two distinct addresses where the virtual rank passes 0
        raw = rec.of(r)
        signals = [e[7] for e in raw if e[:2] == ("kernel", "dispatch")] \
            + [e[6] for e in raw if e[:2] == ("kernel", "owner_finalize")]
        assert signals == [t.data_ptr() for t in real.arrival_tables]
        assert numbered(without_waits_and_signals(rec.of(r))) \
            == numbered(without_waits_and_signals(want[r]))
        assert out.out.shape == (TOKENS, CFG.hidden)


def without_waits_and_signals(events):
    """A rank's DEP launches with the waits left out and the signal addresses as 0."""
    kept = []
    for e in events:
        if e[:2] == ("kernel", "wait"):
            continue
        if e[:2] == ("kernel", "dispatch"):
            e = e[:7] + (0,) + e[8:]
        if e[:2] == ("kernel", "owner_finalize"):
            e = e[:6] + (0,) + e[7:]
        kept.append(e)
    return kept


def test_wide_virtual_and_real_ranks_run_one_program(stand_ins, monkeypatch):
    """``batch_invariant=False`` (every GEMM on cuBLAS; the default's program is the next
    tests'): two calls (both mailbox buffers; each call's addresses numbered on their own: a real
    rank's shared and up buffers rotate with the mailbox, a virtual rank's do not), every
    placement of the shared expert."""
    from fast.schedules import wide, wide_peer
    from fast.schedules.wide_program import SHARED_PLACEMENTS, WIDE_STEPS

    w, rec = weights(), stand_ins
    tokens = CFG.front_max + 1
    x = torch.randn(tokens, CFG.hidden).to(torch.bfloat16)
    virtual = wide.WideLayer(w, ranks=RANKS, max_rows=tokens + 2, device="cuda", timeout_s=1.0,
                             batch_invariant=False)
    reals = []
    for r in range(RANKS):
        peer_world(monkeypatch, wide_peer, r, RANKS)
        reals.append(wide_peer.WidePeerLayer(w, max_rows=tokens + 2, timeout_s=1.0,
                                             batch_invariant=False))
        reals[-1]._prepared.add(tokens)
    for shared in SHARED_PLACEMENTS:
        for _ in range(2):
            rec.clear()
            index = virtual.mailbox_index
            outs = virtual(x, check=False, shared=shared, side_delay_cycles=7)
            assert rec.programs == [WIDE_STEPS]
            assert [o.mailbox_index for o in outs] == [index] * RANKS
            want = {r: rec.of(r) for r in range(RANKS)}
            for r, real in enumerate(reals):
                rec.clear()
                assert real.mailbox_index == index
                out = real(x, check=False, shared=shared, side_delay_cycles=7)
                assert rec.programs == [WIDE_STEPS] and out.mailbox_index == index
                got = rec.of(r)
                joins = [e[1] for e in got if e[:2] in (("kernel", "signal"), ("kernel", "wait"))]
                assert joins == ["signal", "wait", "signal", "wait"]
                order = [e[1] if e[0] == "kernel" else e[0] for e in got
                         if e[0] in ("kernel", "finalize", "addmm_bf16")]
                assert order == ["publish", "route", "finalize", "signal", "wait",
                                 "latent_all_reduce", "addmm_bf16", "signal", "wait",
                                 "hidden_all_reduce"]
                waits = [e for e in got if e[:2] == ("kernel", "wait")]
                assert [(e[-4], e[-3], e[-2]) for e in waits] == [(1, r, 0), (1, r, 1)]
                assert numbered([e for e in got if e[:2] not in (("kernel", "signal"),
                                                                 ("kernel", "wait"))]) \
                    == numbered(want[r])
                # the rotating buffers: the call's own shared and up tables
                hidden = [e for e in got if e[:2] == ("kernel", "hidden_all_reduce")][0]
                assert hidden[2:4] == (real.shared_tables[index].data_ptr(),
                                       real.up_tables[index].data_ptr())


class FastGemm:
    """A ``fast.gemm.DenseGemm`` of the batch-invariant mode: records its calls."""

    def __init__(self, rec, name, weight):
        self.rec, self.name, self.weight = rec, name, weight

    def __call__(self, a, *, out_dtype=torch.bfloat16, addend=None, out=None):
        self.rec.add("fast_gemm", self.name, value(a), out_dtype,
                     None if addend is None else value(addend), None if out is None else value(out))
        return torch.zeros(a.shape[0], self.weight.shape[0], dtype=out_dtype) if out is None else out

    def launch(self, tokens):
        return ("launch", self.name, tokens)

    def plan(self, tokens):
        return self.launch(tokens)


def _wide_invariant_programs(rec, monkeypatch, build, **options):
    """Both wide layers with ``batch_invariant=True`` and ``options``, ``build_fast_gemms``
    replaced by ``build``: the virtual layer's call recorded per rank, then each real rank's
    call, which must record the same program (its own signals and waits aside). Returns
    the virtual layer and its program per rank."""
    from fast.schedules import wide, wide_peer

    monkeypatch.setattr(wide, "build_fast_gemms", build)
    monkeypatch.setattr(wide_peer, "build_fast_gemms", build)
    w, tokens = weights(), CFG.front_max + 1
    x = torch.randn(tokens, CFG.hidden).to(torch.bfloat16)
    virtual = wide.WideLayer(w, ranks=RANKS, max_rows=tokens, device="cuda", timeout_s=1.0,
                             batch_invariant=True, **options)
    assert virtual.batch_invariant
    rec.clear()
    virtual(x, check=False)
    want = {r: rec.of(r) for r in range(RANKS)}
    for r in range(RANKS):
        peer_world(monkeypatch, wide_peer, r, RANKS)
        real = wide_peer.WidePeerLayer(w, max_rows=tokens, timeout_s=1.0, batch_invariant=True,
                                       **options)
        assert real.batch_invariant
        real._prepared.add(tokens)
        rec.clear()
        real(x, check=False)
        got = [e for e in rec.of(r) if e[:2] not in (("kernel", "signal"), ("kernel", "wait"))]
        assert numbered(got) == numbered(want[r])
    return virtual, want


def test_wide_stock_invariant_ranks_run_one_program(stand_ins, monkeypatch):
    """``invariant_gemms="stock"`` (the layers' default): the virtual and the real ranks build a fast GEMM for the
    front only and run the same program: the front on it (FP32 out), the shared gate/up and
    down and the up columns on cuBLAS with split-K forbidden (``split_k=False`` in every
    call), no FP32-output cuBLAS GEMM."""
    from fast.schedules.wide_gemms import WIDE_GEMMS

    rec, built = stand_ins, []

    def build(owner, gemm_weights, config, ranks, max_rows, mma, serial_from, overlap,
              chunk_windows, forms, names):
        assert tuple(names) == ("front",) and set(gemm_weights) == set(WIDE_GEMMS)
        built.append(owner)
        return {n: FastGemm(rec, n, gemm_weights[n]) for n in names}

    virtual, want = _wide_invariant_programs(rec, monkeypatch, build)
    assert built == ["WideLayer"] * RANKS + ["WidePeerLayer"] * RANKS
    tokens = CFG.front_max + 1
    assert virtual.gemm_plan(1, tokens) == {"front": ("launch", "front", tokens)}
    for r in range(RANKS):
        assert [e[1] for e in want[r] if e[0] == "fast_gemm"] == ["front"]
        stock_calls = [e for e in want[r] if e[0] in ("mm_fp32_out", "mm_bf16", "addmm_bf16")]
        assert [e[0] for e in stock_calls] == ["mm_bf16", "mm_bf16", "addmm_bf16"]
        assert all(e[-1] is False for e in stock_calls)  # split_k=False in every call


def test_wide_batch_invariant_ranks_run_one_program(stand_ins, monkeypatch):
    """``batch_invariant=True, invariant_gemms="fast"``: the virtual and the real ranks build one fast GEMM per
    GEMM of their rank (the same weights) and run the same program with them: the front
    (FP32 out), the shared gate/up and down, the up columns accumulated in place, in the
    same order with the same buffers; no cuBLAS GEMM runs."""
    from fast.schedules import wide
    from fast.schedules.wide_gemms import WIDE_GEMMS, gemm_shapes

    rec, built = stand_ins, []

    def build(owner, gemm_weights, config, ranks, max_rows, mma, serial_from, overlap,
              chunk_windows, forms, names):
        # invariant_mma="auto" on the stand-ins' sm_90a: the warpgroup MMA, on both layers;
        # no serial splits or MMAs in flight unless asked for
        assert set(gemm_weights) == set(WIDE_GEMMS) and tuple(names) == WIDE_GEMMS
        assert ranks == RANKS and mma == "wgmma"
        assert serial_from is None and overlap is False and chunk_windows == 8 and forms is None
        shapes = {n: tuple(t.shape) for n, t in gemm_weights.items()}
        assert shapes == gemm_shapes(config, ranks)  # the table the compile set is built from
        built.append((owner, shapes))
        return {n: FastGemm(rec, n, gemm_weights[n]) for n in names}

    virtual, want = _wide_invariant_programs(rec, monkeypatch, build, invariant_gemms="fast")
    assert len(built) == 2 * RANKS and all(b[1] == built[0][1] for b in built)  # the same shapes
    tokens = CFG.front_max + 1
    assert virtual.gemm_plan(1, tokens) == {n: ("launch", n, tokens) for n in WIDE_GEMMS}
    for r in range(RANKS):
        gemm_calls = [e[1] for e in want[r] if e[0] == "fast_gemm"]
        assert gemm_calls == ["front", "shared_gate_up", "shared_down", "up"]
        assert not [e for e in want[r] if e[0] in ("mm_fp32_out", "mm_bf16", "addmm_bf16")]
        front = [e for e in want[r] if e[:2] == ("fast_gemm", "front")][0]
        assert front[3] == torch.float32
        up = [e for e in want[r] if e[:2] == ("fast_gemm", "up")][0]
        assert up[4] == up[5]  # the addend is the output: accumulated in place
    w = weights()
    with pytest.raises(ValueError, match="batch_invariant must be a bool"):
        wide.WideLayer(w, ranks=RANKS, max_rows=tokens, device="cuda", batch_invariant="yes")
