"""The backends a contract runs against: the built-in ones, those selected on the command
line or registered by entry point, and the checked calls the contracts make through them.

Every backend implements :class:`verify.interface.Backend`, the built-in ones included:

| name | what computes | devices | claims |
|---|---|---|---|
| ``reference`` | the reference stages (``reference/``) | CPU | every stage bitwise (checked against the oracles) |
| ``reference-cuda`` | the same code on CUDA tensors (PyTorch's CUDA ops) | any CUDA GPU | MX and Finalize bitwise; router, SiTU, RMSNorm within the bound (CUDA's libm) |
| ``stock`` | the stock PyTorch / torchao ops the fast paths replace (``fast.stock``) and the S0 layer built from them | CUDA where present, else CPU | MX bitwise (torchao's ``to_mx``); the rest within the bound |
| ``fast`` | the project's CuTe DSL kernels (``fast/``) and its S1 and S2 layers (``fast.schedules.dep``, ``fast.schedules.wide``) | SM90 / SM100 GPUs | MX and Finalize bitwise; router, SiTU, RMSNorm in their own order (``reference.emulation``); expert rows within the bound, stage by stage; the S1 and S2 layers within the bound |

The reference's schedule emulations (``reference.schedules``) are what a whole layer is
compared with, so the ``reference`` backend claims no ``layer_*`` stage; they are checked
stage by stage by ``verify/test_dep.py`` and ``verify/test_wide.py``.

Selection (``pytest verify/ --backend SPEC``, repeatable; ``verify/conftest.py``): a SPEC
is a built-in name, the name of a ``latentmoe.backends`` entry point, ``module:attribute``
(an importable module) or ``path/to/file.py:attribute``; ``default`` stands for what a run
without ``--backend`` selects: the built-ins and every registered entry point. The
attribute is a :class:`~verify.interface.Backend` subclass (instantiated without
arguments) or an instance.

Each backend says whether this machine can run it and, when not, why: that reason becomes
the skip reason of its contracts, so a contract that could not run says so instead of
silently comparing the reference with itself. A backend that cannot be loaded (an import
that fails, a declaration that is wrong) fails every contract it was selected for with the
load error; a stage that raises, or returns the wrong dtype or shape, fails that contract
with the stage's name and what was expected (:class:`StageError`). Neither stops the run.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import re
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from model.weights import LatentMoEWeights
from verify import interface, tolerances
from verify.interface import BITWISE, BOUND, Claim, ExpertRows, LayerOutput, own_order

ENTRY_POINT_GROUP = "latentmoe.backends"
DEFAULT = "default"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")


def _package_version() -> str:
    try:
        return "latentmoe " + importlib.metadata.version("latentmoe")
    except importlib.metadata.PackageNotFoundError:
        return "latentmoe (not installed)"


def _version_of(distribution: str) -> str:
    try:
        return f"{distribution} {importlib.metadata.version(distribution)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{distribution} not installed"


# --- the built-in backends ----------------------------------------------------------------


class ReferenceBackend(interface.Backend):
    """The reference stages on the CPU, each checked bit for bit against its oracle."""

    name = "reference"
    devices = ("cpu",)
    claims = {stage: BITWISE for stage in (
        "quantize_mxfp8", "quantize_mxfp8_swizzled", "route", "situ_and_mul", "finalize",
        "rms_norm", "expert_rows")}

    @property
    def version(self) -> str:
        return _package_version()

    def quantize_mxfp8(self, x):
        from reference import mx

        return mx.quantize_mxfp8(x)

    def quantize_mxfp8_swizzled(self, x):
        from model.swizzle import swizzle_scales_128x4
        from reference import mx

        codes, scales = mx.quantize_mxfp8(x)
        return codes, swizzle_scales_128x4(scales)

    def route(self, logits, bias, *, top_k, renormalize, scale):
        from reference import router

        return router.route(logits, bias, top_k=top_k, renormalize=renormalize, scale=scale)

    def situ_and_mul(self, h, *, beta, linear_beta):
        from reference.activation import situ_and_mul

        return situ_and_mul(h, beta=beta, linear_beta=linear_beta)

    def finalize(self, rows, weights):
        from reference.finalize import finalize

        return finalize(rows, weights)

    def rms_norm(self, x, weight, eps):
        from reference.norm import rms_norm

        return rms_norm(x, weight, eps)

    def expert_rows(self, codes, scales, ids, weights, *, experts, shard, intermediates):
        from reference.experts import pair_rows_fp32
        from reference.mx import dequantize_mxfp8

        cfg = weights.config
        first, count = experts
        k = cfg.top_k
        flat = ids.reshape(-1).long()
        local = torch.nonzero((flat >= first) & (flat < first + count)).flatten()
        rows = torch.full((flat.numel(), cfg.latent), float("nan"), dtype=torch.bfloat16,
                          device=codes.device)
        x = dequantize_mxfp8(codes, scales)  # [R, L] FP32, exact
        rows[local] = pair_rows_fp32(x, flat[local], weights, cfg, rows=local // k,
                                     shard=None if shard == (0, 1) else shard)
        return ExpertRows(rows)


class ReferenceCudaBackend(ReferenceBackend):
    """The reference code on CUDA tensors: PyTorch's CUDA ops, whose ``exp`` / ``tanh`` /
    ``rsqrt`` are CUDA's libm (within the library ULP bounds of ``verify.tolerances``), so
    the router, SiTU and RMSNorm claim the bound; MX and Finalize have no libm call and
    stay bitwise."""

    name = "reference-cuda"
    devices = ("cuda",)
    claims = {"quantize_mxfp8": BITWISE, "route": BOUND, "situ_and_mul": BOUND,
              "finalize": BITWISE, "rms_norm": BOUND}


class StockBackend(interface.Backend):
    """The stock library ops of ``fast.stock`` (cuBLAS where a GPU is, CPU BLAS here),
    torchao's ``to_mx`` for MXFP8, and the S0 layer built from them."""

    name = "stock"
    devices = ("cuda", "cpu")
    claims = {"quantize_mxfp8": BITWISE, "route": BOUND, "situ_and_mul": BOUND,
              "finalize": BOUND, "rms_norm": BOUND, "layer_stock": BOUND}
    layer_ranks = {"layer_stock": (1,)}

    @property
    def version(self) -> str:
        return f"{_package_version()}, torch {torch.__version__}, {_version_of('torchao')}"

    def quantize_mxfp8(self, x):
        pytest.importorskip("torchao", reason="the stock MXFP8 quantizer here is torchao's "
                            "to_mx; torchao is not installed on this machine")
        from torchao.prototype.mx_formats.mx_tensor import ScaleCalculationMode, to_mx

        scales, data = to_mx(x.contiguous(), torch.float8_e4m3fn, 32,
                             scaling_mode=ScaleCalculationMode.RCEIL)
        return data.view(x.shape), scales.view(torch.uint8).view(*x.shape[:-1], -1)

    def route(self, logits, bias, *, top_k, renormalize, scale):
        from fast import stock

        return stock.route(logits, bias, top_k=top_k, renormalize=renormalize, scale=scale)

    def situ_and_mul(self, h, *, beta, linear_beta):
        from fast import stock

        return stock.situ_and_mul(h, beta=beta, linear_beta=linear_beta)

    def finalize(self, rows, weights):
        from fast import stock

        return stock.finalize(rows, weights)

    def rms_norm(self, x, weight, eps):
        from fast import stock

        return stock.rms_norm(x, weight, eps)

    def layer(self, schedule, xs, weights):
        """S0 in stock ops: the GEMMs on cuBLAS / CPU BLAS with FP32 accumulation, the
        router, SiTU, Finalize and RMSNorm of ``fast.stock``; the routed experts are the
        reference's (``reference.experts``: no stock library computes MXFP4 experts on
        every machine)."""
        from fast import stock
        from reference.experts import expert_rows

        c, w = weights.config, weights
        s2 = 2 * c.shared_intermediate
        outs = []
        for x in xs:
            logits = stock.mm_fp32_out(x, w.gate)
            topk_w, ids = stock.route(logits, w.bias, top_k=c.top_k, renormalize=c.renormalize,
                                      scale=c.routed_scaling_factor)
            front = stock.mm_bf16(x, w.front)
            act = stock.situ_and_mul(front[:, :s2].contiguous(), beta=c.situ_beta,
                                     linear_beta=c.situ_linear_beta)
            shared = stock.mm_bf16(act, w.shared_down)
            rows = expert_rows(front[:, s2:].contiguous(), ids, w, c)
            normed = stock.rms_norm(stock.finalize(rows, topk_w), w.latent_norm, c.rms_eps)
            outs.append(LayerOutput(stock.addmm_bf16(shared, normed, w.up), ids))
        return outs


class FastBackend(interface.Backend):
    """The project's CuTe DSL kernels. The router, SiTU and RMSNorm use the kernels' own
    ``exp_rn`` / ``tanh_rn`` / ``sigmoid_rn`` and reduction tree, which
    ``reference.emulation`` repeats bit for bit; the experts engine's FC1 and FC2 sums run
    in tensor-core order, so it claims the bound and hands its intermediates over; the S1
    layer's GEMMs run on cuBLAS, so it claims the bound (its stages are checked one by one
    in ``verify/test_dep_fast.py``)."""

    name = "fast"
    devices = ("cuda",)

    def __init__(self) -> None:
        self._engines: dict = {}

    @property
    def claims(self) -> Mapping[str, Claim]:
        from reference import emulation

        return {
            "quantize_mxfp8": BITWISE,
            "quantize_mxfp8_swizzled": BITWISE,
            "route": own_order(emulation.route, sigmoid=emulation.sigmoid_rn,
                               sigmoid_abs_error=tolerances.SIGMOID_RN_ABS_ERROR),
            "situ_and_mul": own_order(emulation.situ_and_mul, tanh=emulation.tanh_rn,
                                      sigmoid=emulation.sigmoid_rn),
            "finalize": BITWISE,
            "rms_norm": own_order(emulation.rms_norm_tree),
            "expert_rows": Claim("bound", tanh=emulation.tanh_rn, sigmoid=emulation.sigmoid_rn),
            "layer_dep": Claim("bound", sigmoid_abs_error=tolerances.SIGMOID_RN_ABS_ERROR),
            "layer_wide": Claim("bound", sigmoid_abs_error=tolerances.SIGMOID_RN_ABS_ERROR),
        }

    #: the small config's routed intermediate (256) splits into the experts engine's
    #: 64-wide slices over at most 4 TP ranks (``fast.schedules.wide.check_ranks``)
    layer_ranks = {"layer_dep": (1, 2, 4, 8, 16), "layer_wide": (1, 2, 4)}

    @property
    def version(self) -> str:
        return f"{_package_version()}, {_version_of('nvidia-cutlass-dsl')}"

    def available(self):
        try:
            from fast import backend as fast_backend
        except Exception as error:  # the reason is reported, never swallowed
            return False, f"backend 'fast' could not be imported: {error!r}"
        return fast_backend.device_supported()

    def quantize_mxfp8(self, x):
        from fast import mx

        return mx.quantize_mxfp8(x, swizzled=False)

    def quantize_mxfp8_swizzled(self, x):
        from fast import mx

        return mx.quantize_mxfp8(x, swizzled=True)

    def route(self, logits, bias, *, top_k, renormalize, scale):
        from fast import router

        return router.route(logits, bias, top_k=top_k, renormalize=renormalize, scale=scale)

    def situ_and_mul(self, h, *, beta, linear_beta):
        from fast import activation

        return activation.situ_and_mul(h, beta=beta, linear_beta=linear_beta)

    def finalize(self, rows, weights):
        from fast import finalize

        return finalize.finalize(rows, weights)

    def rms_norm(self, x, weight, eps):
        from fast import norm

        return norm.rms_norm(x, weight, eps)

    def engine(self, weights: LatentMoEWeights, experts: tuple[int, int],
               shard: tuple[int, int], rows: int):
        """The ``fast.experts.ExpertsEngine`` of one rank, prepared once per (weights,
        experts, shard) and sized for at least 256 rows."""
        from fast.experts import ExpertsEngine, prepare_experts

        max_rows = max(rows, 256)
        key = (id(weights), experts, shard)
        held = self._engines.get(key)
        if held is None or held[1].max_rows < max_rows:
            prepared = prepare_experts(weights, "cuda", experts=experts, shard=shard)
            held = (weights, ExpertsEngine(prepared, max_rows=max_rows))
            self._engines[key] = held  # the weights are kept so that their id stays theirs
        return held[1]

    def layer(self, schedule, xs, weights):
        """S1 over ``len(xs)`` virtual ranks on one GPU (``fast.schedules.dep.DepLayer``,
        built once per weights and rank count, for up to 64 tokens per rank), or S2
        (:meth:`wide_layer`)."""
        from fast.schedules.dep import DepLayer

        if schedule == "wide":
            return self.wide_layer(xs, weights)
        tokens = xs[0].shape[0]
        key = ("dep", id(weights), len(xs))
        held = self._engines.get(key)
        if held is None or held[1].max_tokens < tokens:
            held = (weights, DepLayer(weights, ranks=len(xs), max_tokens=max(tokens, 64),
                                      device="cuda"))
            self._engines[key] = held
        return [LayerOutput(o.out, o.ids) for o in held[1](xs)]

    def wide_layer(self, xs, weights):
        """S2 over ``len(xs)`` virtual TP ranks on one GPU (``fast.schedules.wide.WideLayer``,
        built once per weights and rank count for up to 128 rows). The layer serves 65
        rows and more; a smaller batch runs padded with zero rows to 65 and its own rows
        are taken back: no stage mixes tokens (the router, the plan rows, each pair's
        expert row, the Finalize, the norm and each GEMM row are per token), so the padding
        rows reach no other row; the layer contract's bounds cover the GEMMs' order."""
        from fast.schedules.wide import WideLayer

        c, tokens = weights.config, xs[0].shape[0]
        rows = max(tokens, c.front_max + 1)
        key = ("wide", id(weights), len(xs))
        held = self._engines.get(key)
        if held is None or held[1].max_rows < rows:
            held = (weights, WideLayer(weights, ranks=len(xs), max_rows=max(rows, 128),
                                       device="cuda"))
            self._engines[key] = held
        if rows > tokens:
            xs = [torch.cat([x, x.new_zeros(rows - tokens, x.shape[1])]) for x in xs]
        return [LayerOutput(o.out[:tokens], o.ids[:tokens]) for o in held[1](xs)]

    def expert_rows(self, codes, scales, ids, weights, *, experts, shard, intermediates):
        engine = self.engine(weights, tuple(experts), tuple(shard), codes.shape[0])
        if not intermediates:
            return ExpertRows(engine(codes, scales, ids))
        out, cap = engine(codes, scales, ids, capture=True)
        return ExpertRows(out, cap.fc1, cap.codes, cap.scales)


BUILTIN: dict[str, type[interface.Backend]] = {
    cls.name: cls for cls in (ReferenceBackend, ReferenceCudaBackend, StockBackend, FastBackend)}


# --- loading ------------------------------------------------------------------------------


class BackendLoadError(Exception):
    """A backend that could not be imported or whose declarations are wrong."""


def check_declarations(impl) -> None:
    """Raise :class:`BackendLoadError` naming the first wrong declaration of ``impl``."""
    name = getattr(impl, "name", None)
    if not isinstance(name, str) or not _NAME.match(name):
        raise BackendLoadError(f"name must be a non-empty string of letters, digits and "
                               f"'._+-', got {name!r}")
    if not isinstance(getattr(impl, "version", None), str):
        raise BackendLoadError(f"backend {name!r}: version must be a string, got "
                               f"{getattr(impl, 'version', None)!r}")
    devices = getattr(impl, "devices", None)
    if (not isinstance(devices, tuple) or not devices
            or any(d not in ("cpu", "cuda") for d in devices)):
        raise BackendLoadError(f"backend {name!r}: devices must be a non-empty tuple of "
                               f"'cuda' and/or 'cpu', got {devices!r}")
    claims = getattr(impl, "claims", None)
    if not isinstance(claims, Mapping):
        raise BackendLoadError(f"backend {name!r}: claims must be a mapping stage -> Claim, "
                               f"got {type(claims).__name__}")
    for stage, claim in claims.items():
        if stage not in interface.STAGES:
            raise BackendLoadError(f"backend {name!r}: claims names an unknown stage "
                                   f"{stage!r}; the stages are {sorted(interface.STAGES)}")
        if not isinstance(claim, Claim):
            raise BackendLoadError(f"backend {name!r}: claims[{stage!r}] must be a Claim "
                                   f"(BITWISE, BOUND or own_order(...)), got {claim!r}")
        if claim.kind not in interface.STAGES[stage]:
            raise BackendLoadError(f"backend {name!r}: stage {stage!r} may claim "
                                   f"{' or '.join(interface.STAGES[stage])}, not {claim.kind!r}")
        method = "layer" if stage.startswith("layer_") else stage
        if not callable(getattr(impl, method, None)) or (
                getattr(type(impl), method, None) is getattr(interface.Backend, method)):
            raise BackendLoadError(f"backend {name!r} claims {stage!r} but does not define "
                                   f"the method {method}()")
    ranks = getattr(impl, "layer_ranks", {})
    if not isinstance(ranks, Mapping):
        raise BackendLoadError(f"backend {name!r}: layer_ranks must be a mapping")
    for stage, counts in ranks.items():
        if stage not in claims or not stage.startswith("layer_"):
            raise BackendLoadError(f"backend {name!r}: layer_ranks names {stage!r}, which is "
                                   "not a claimed layer_* stage")
        if (not isinstance(counts, tuple) or not counts
                or any(not isinstance(n, int) or n < 1 for n in counts)):
            raise BackendLoadError(f"backend {name!r}: layer_ranks[{stage!r}] must be a "
                                   f"non-empty tuple of positive ints, got {counts!r}")
    if not callable(getattr(impl, "available", None)):
        raise BackendLoadError(f"backend {name!r}: available() is missing")


def _import_attribute(spec: str):
    module_part, _, attribute = spec.partition(":")
    if not module_part or not attribute:
        raise BackendLoadError(f"{spec!r} is not a built-in backend ({', '.join(BUILTIN)}), "
                               f"a {ENTRY_POINT_GROUP} entry point, 'module:attribute' or "
                               "'path/to/file.py:attribute'")
    try:
        if module_part.endswith(".py"):
            path = Path(module_part).resolve()
            if not path.is_file():
                raise BackendLoadError(f"{spec!r}: no file {path}")
            module_name = f"latentmoe_backend_{path.stem}"
            loader_spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[module_name] = module
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_part)
    except BackendLoadError:
        raise
    except (Exception, SystemExit) as error:  # a failing plug-in import must not stop the run
        raise BackendLoadError(f"importing {module_part!r} raised "
                               f"{type(error).__name__}: {error}") from error
    target = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise BackendLoadError(f"{module_part!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    return target


def _instantiate(target, label: str) -> interface.Backend:
    if isinstance(target, type):
        try:
            target = target()
        except Exception as error:
            raise BackendLoadError(f"{label}: {target.__name__}() raised "
                                   f"{type(error).__name__}: {error}") from error
    check_declarations(target)
    return target


@functools.cache
def _entry_points() -> tuple:
    return tuple(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def registered() -> list[str]:
    """The names of the ``latentmoe.backends`` entry points installed here."""
    return [ep.name for ep in _entry_points()]


def load(spec: str) -> UnderTest:
    """The backend a ``--backend`` SPEC names (see the module docstring). A backend that
    cannot be loaded comes back broken (:attr:`UnderTest.load_error` set), not raised."""
    if spec in BUILTIN:
        return UnderTest(BUILTIN[spec](), source="built-in", builtin=True)
    try:
        for ep in _entry_points():
            if ep.name == spec:
                source = f"entry point {ep.name} = {ep.value}"
                try:
                    target = ep.load()
                except (Exception, SystemExit) as error:
                    raise BackendLoadError(f"entry point {ep.name} = {ep.value}: loading "
                                           f"raised {type(error).__name__}: {error}") from error
                break
        else:
            source = spec
            target = _import_attribute(spec)
        impl = _instantiate(target, spec)
        if impl.name in BUILTIN:
            raise BackendLoadError(f"{spec!r} is named {impl.name!r}, the name of a built-in "
                                   "backend; choose another name")
        return UnderTest(impl, source=source)
    except BackendLoadError as error:
        return UnderTest.broken(spec, str(error))


def select(specs: list[str] | None) -> list[UnderTest]:
    """The backends of a run: ``specs`` in order (``None`` or ``default``: the built-ins,
    then every registered entry point). Two backends of one name: the later is broken."""
    expanded: list[str] = []
    for spec in specs or [DEFAULT]:
        names = [*BUILTIN, *registered()] if spec == DEFAULT else [spec]
        expanded += [n for n in names if n not in expanded]
    chosen: list[UnderTest] = []
    for spec in expanded:
        b = load(spec)
        if any(c.name == b.name for c in chosen):
            b = UnderTest.broken(spec, f"{spec!r} is named {b.name!r}, like a backend "
                                 "selected before it")
        chosen.append(b)
    return chosen


def get(name: str) -> UnderTest:
    """The built-in backend called ``name`` (KeyError lists the known names)."""
    if name not in BUILTIN:
        raise KeyError(f"unknown backend {name!r}; built-in: {sorted(BUILTIN)}")
    return load(name)


# --- the checked calls ----------------------------------------------------------------------


class StageError(AssertionError):
    """A backend's stage raised, or returned something the interface does not allow."""


def _pad(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclasses.dataclass(eq=False)
class UnderTest:
    """A backend as the contracts use it (the ``backend`` fixture): its declarations, the
    device it runs on here, and one checked method per stage. A checked method skips the
    contract when the backend does not claim the stage, wraps any exception the stage
    raises into a :class:`StageError` naming the backend and the stage, and checks the
    dtype, shape and device of what it returns."""

    impl: interface.Backend | None
    source: str
    builtin: bool = False
    load_error: str | None = None
    label: str = ""

    @classmethod
    def broken(cls, spec: str, error: str) -> UnderTest:
        return cls(None, source=spec, load_error=f"backend {spec!r} could not be loaded: {error}",
                   label=spec)

    @property
    def name(self) -> str:
        return self.label if self.impl is None else self.impl.name

    @property
    def version(self) -> str:
        return "-" if self.impl is None else self.impl.version

    def __str__(self) -> str:
        return self.name

    @functools.cached_property
    def device(self) -> str:
        """The first of the backend's devices this machine has (``cpu`` when none)."""
        for d in self.impl.devices:
            if d == "cpu" or torch.cuda.is_available():
                return d
        return "cpu"

    @functools.cached_property
    def claims(self) -> dict[str, Claim]:
        return {} if self.impl is None else dict(self.impl.claims)

    def availability(self) -> tuple[bool, str]:
        """(True, "") when it can run here, else (False, the reason). Raises
        :class:`StageError` when the backend's own ``available()`` raises."""
        return self._availability

    @functools.cached_property
    def _availability(self) -> tuple[bool, str]:
        devices = self.impl.devices
        if "cpu" not in devices and not torch.cuda.is_available():
            return False, f"backend {self.name!r} needs a CUDA GPU and this machine has none"
        try:
            ok, reason = self.impl.available()
        except Exception as error:
            raise StageError(f"backend {self.name!r}: available() raised "
                             f"{type(error).__name__}: {error}") from error
        return bool(ok), str(reason)

    def describe(self) -> dict:
        """What the report records about the backend."""
        if self.impl is None:
            return {"version": "-", "source": self.source, "load_error": self.load_error}
        return {"version": self.version, "source": self.source,
                "devices": list(self.impl.devices),
                "claims": {s: c.kind for s, c in self.claims.items()},
                "layer_ranks": {s: list(r) for s, r in self.impl.layer_ranks.items()}}

    # --- declarations -------------------------------------------------------------------

    def claim(self, stage: str) -> Claim:
        """The backend's claim for ``stage``; skips the contract when it makes none."""
        if stage not in interface.STAGES:
            raise KeyError(f"unknown stage {stage!r}")
        if stage not in self.claims:
            implemented = ", ".join(self.claims) or "none"
            pytest.skip(f"backend {self.name!r} does not implement {stage} (it implements: "
                        f"{implemented})")
        return self.claims[stage]

    def layer_claim(self, schedule: str, ranks: int) -> Claim:
        """The claim for ``layer_<schedule>`` at ``ranks`` ranks; skips the contract when
        the backend runs that layer at other rank counts only."""
        stage = f"layer_{schedule}"
        claim = self.claim(stage)
        counts = tuple(self.impl.layer_ranks.get(stage, (1,)))
        if ranks not in counts:
            pytest.skip(f"backend {self.name!r} runs {stage} at {counts} ranks, not {ranks}")
        return claim

    # --- checked stage calls ------------------------------------------------------------

    def _call(self, stage: str, *args, **kwargs):
        __tracebackhide__ = True  # a failure shows the stage's error, not this wrapper
        self.claim(stage if stage != "layer" else f"layer_{args[0]}")
        method = getattr(self.impl, stage)
        try:
            return method(*args, **kwargs)
        except Exception as error:
            raise StageError(f"backend {self.name!r}: stage {stage} raised "
                             f"{type(error).__name__}: {error}") from error

    def _expect(self, stage: str, what: str, value, dtype: torch.dtype, shape: tuple | None,
                device: torch.device, numel: int | None = None) -> torch.Tensor:
        __tracebackhide__ = True
        if not isinstance(value, torch.Tensor):
            raise StageError(f"backend {self.name!r}: stage {stage} returned "
                             f"{type(value).__name__} as {what}; the interface says a "
                             f"{dtype} tensor")
        got = f"{value.dtype} {list(value.shape)}"
        if value.dtype != dtype or (shape is not None and tuple(value.shape) != tuple(shape)) \
                or (numel is not None and value.numel() != numel):
            want = f"{dtype} {list(shape)}" if shape is not None else f"{dtype} of {numel} elements"
            raise StageError(f"backend {self.name!r}: stage {stage} returned {what} as {got}; "
                             f"the interface says {want}")
        if value.device.type != device.type:
            raise StageError(f"backend {self.name!r}: stage {stage} returned {what} on "
                             f"{value.device}; its input was on {device}")
        return value

    def _pair(self, stage: str, result, names: tuple[str, str]):
        __tracebackhide__ = True
        if not isinstance(result, tuple) or len(result) != 2:
            raise StageError(f"backend {self.name!r}: stage {stage} returned "
                             f"{type(result).__name__}; the interface says a tuple "
                             f"({', '.join(names)})")
        return result

    def quantize_mxfp8(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Checked :meth:`verify.interface.Backend.quantize_mxfp8`."""
        stage = "quantize_mxfp8"
        codes, scales = self._pair(stage, self._call(stage, x), ("codes", "scales"))
        t, k = x.shape
        return (self._expect(stage, "codes", codes, torch.float8_e4m3fn, (t, k), x.device),
                self._expect(stage, "scales", scales, torch.uint8, (t, k // 32), x.device))

    def quantize_mxfp8_swizzled(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Checked :meth:`verify.interface.Backend.quantize_mxfp8_swizzled`."""
        stage = "quantize_mxfp8_swizzled"
        codes, scales = self._pair(stage, self._call(stage, x), ("codes", "scales"))
        t, k = x.shape
        return (self._expect(stage, "codes", codes, torch.float8_e4m3fn, (t, k), x.device),
                self._expect(stage, "scales", scales, torch.uint8, None, x.device,
                             numel=_pad(t, 128) * _pad(k // 32, 4)))

    def route(self, logits: torch.Tensor, bias: torch.Tensor, *, top_k: int,
              renormalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Checked :meth:`verify.interface.Backend.route`."""
        stage = "route"
        weights, ids = self._pair(stage, self._call(
            stage, logits, bias, top_k=top_k, renormalize=renormalize, scale=scale),
            ("weights", "ids"))
        shape = (logits.shape[0], top_k)
        return (self._expect(stage, "weights", weights, torch.float32, shape, logits.device),
                self._expect(stage, "ids", ids, torch.int32, shape, logits.device))

    def situ_and_mul(self, h: torch.Tensor, *, beta: float, linear_beta: float) -> torch.Tensor:
        """Checked :meth:`verify.interface.Backend.situ_and_mul`."""
        out = self._call("situ_and_mul", h, beta=beta, linear_beta=linear_beta)
        return self._expect("situ_and_mul", "the output", out, torch.bfloat16,
                            (h.shape[0], h.shape[1] // 2), h.device)

    def finalize(self, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Checked :meth:`verify.interface.Backend.finalize`."""
        out = self._call("finalize", rows, weights)
        return self._expect("finalize", "the output", out, torch.bfloat16,
                            (weights.shape[0], rows.shape[1]), rows.device)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Checked :meth:`verify.interface.Backend.rms_norm`."""
        out = self._call("rms_norm", x, weight, eps)
        return self._expect("rms_norm", "the output", out, torch.bfloat16, tuple(x.shape),
                            x.device)

    def expert_rows(self, codes: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor,
                    weights: LatentMoEWeights, *, experts: tuple[int, int],
                    shard: tuple[int, int], intermediates: bool = False) -> ExpertRows:
        """Checked :meth:`verify.interface.Backend.expert_rows`."""
        stage = "expert_rows"
        result = self._call(stage, codes, scales, ids, weights, experts=experts, shard=shard,
                            intermediates=intermediates)
        if not isinstance(result, ExpertRows):
            raise StageError(f"backend {self.name!r}: stage {stage} returned "
                             f"{type(result).__name__}; the interface says ExpertRows")
        cfg = weights.config
        pairs, inter = ids.numel(), cfg.intermediate // shard[1]
        dev = codes.device
        self._expect(stage, "rows", result.rows, torch.bfloat16, (pairs, cfg.latent), dev)
        if intermediates:
            for what, value, dtype, width in (
                    ("fc1", result.fc1, torch.float32, 2 * inter),
                    ("hidden_codes", result.hidden_codes, torch.uint8, inter),
                    ("hidden_scales", result.hidden_scales, torch.uint8, inter // 32)):
                if value is None:
                    raise StageError(f"backend {self.name!r}: stage {stage} returned no {what} "
                                     "although the contract asked for the intermediates")
                self._expect(stage, what, value, dtype, (pairs, width), dev)
        return result

    def layer(self, schedule: str, xs: list[torch.Tensor],
              weights: LatentMoEWeights) -> list[LayerOutput]:
        """Checked :meth:`verify.interface.Backend.layer`."""
        stage = f"layer_{schedule}"
        result = self._call("layer", schedule, xs, weights)
        if not isinstance(result, (list, tuple)) or len(result) != len(xs):
            raise StageError(f"backend {self.name!r}: stage {stage} returned "
                             f"{type(result).__name__}; the interface says a list of "
                             f"{len(xs)} LayerOutput (one per rank)")
        cfg = weights.config
        for r, (got, x) in enumerate(zip(result, xs)):
            if not isinstance(got, LayerOutput):
                raise StageError(f"backend {self.name!r}: stage {stage} returned "
                                 f"{type(got).__name__} for rank {r}; the interface says "
                                 "LayerOutput")
            self._expect(stage, f"rank {r}'s out", got.out, torch.bfloat16, tuple(x.shape),
                         x.device)
            self._expect(stage, f"rank {r}'s ids", got.ids, torch.int32,
                         (x.shape[0], cfg.top_k), x.device)
        return list(result)
