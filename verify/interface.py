"""The interface a backend implements so that ``pytest verify/`` checks it.

A backend is *who computes*: the project's reference, its fast kernels, a stock library,
or a kernel that lives in another code base. It is a class with a few declarations and
one method per stage it implements; the contracts feed every method the same inputs and
compare its outputs with the reference's definition, bit for bit or within the bound
derived for that stage (``docs/verify.md``).

```python
from verify.interface import BITWISE, Backend


class MyQuantizer(Backend):
    name = "my-mxfp8"
    version = "1.2.0"
    devices = ("cuda",)
    claims = {"quantize_mxfp8": BITWISE}

    def quantize_mxfp8(self, x):
        return my_kernels.mxfp8_quantize(x)   # (codes, scales)
```

Run it with ``pytest verify/ --backend mypkg.kernels:MyQuantizer``, or register it under the
``latentmoe.backends`` entry-point group so that a plain ``pytest verify/`` picks it up. Its
rows join the summary table; every contract of a stage it does not claim is skipped with
that reason, and never compares the reference with itself.

The stages (:data:`STAGES`) and what each may claim:

| stage | method | may claim |
|---|---|---|
| ``quantize_mxfp8`` | :meth:`Backend.quantize_mxfp8` | bitwise |
| ``quantize_mxfp8_swizzled`` | :meth:`Backend.quantize_mxfp8_swizzled` | bitwise |
| ``route`` | :meth:`Backend.route` | bitwise, bound, own order |
| ``situ_and_mul`` | :meth:`Backend.situ_and_mul` | bitwise, bound, own order |
| ``finalize`` | :meth:`Backend.finalize` | bitwise, bound |
| ``rms_norm`` | :meth:`Backend.rms_norm` | bitwise, bound, own order |
| ``expert_rows`` | :meth:`Backend.expert_rows` | bitwise, bound (with intermediates and its SiTU's ``tanh`` / ``sigmoid``) |
| ``layer_stock``, ``layer_dep``, ``layer_wide`` | :meth:`Backend.layer` | bitwise, bound |

An MX quantizer has no freedom (the format's rules fix every bit), so it can only claim
bitwise; a stage that reorders an FP32 sum can only claim the bound.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch

from model.weights import LatentMoEWeights

__all__ = [
    "BITWISE",
    "BOUND",
    "Backend",
    "Claim",
    "ExpertRows",
    "LayerOutput",
    "SCHEDULES",
    "STAGES",
    "own_order",
]

#: The layer schedules a backend may run whole: S0 (the stock order, one rank), S1 (DEP:
#: each rank routes its own tokens to the owners of their experts) and S2 (wide: every
#: rank holds every token and a tensor-parallel slice of every expert).
SCHEDULES = ("stock", "dep", "wide")

#: stage name -> the claim kinds it accepts (``"own order"`` is a bound with an emulation).
STAGES: dict[str, tuple[str, ...]] = {
    "quantize_mxfp8": ("bitwise",),
    "quantize_mxfp8_swizzled": ("bitwise",),
    "route": ("bitwise", "bound", "own order"),
    "situ_and_mul": ("bitwise", "bound", "own order"),
    "finalize": ("bitwise", "bound"),
    "rms_norm": ("bitwise", "bound", "own order"),
    "expert_rows": ("bitwise", "bound"),
    **{f"layer_{s}": ("bitwise", "bound") for s in SCHEDULES},
}


@dataclasses.dataclass(frozen=True)
class Claim:
    """What a backend claims for one stage.

    * ``kind="bitwise"``: every output bit equals the reference's (which the suite checks
      against an independent oracle), on every input of the contract.
    * ``kind="bound"``: every output lies within the error bound the suite derives for the
      stage from its operands (FP32 sums in any order, library ``exp`` / ``tanh`` /
      ``rsqrt`` within their documented ULP, one final rounding); routing decisions may
      differ from the reference's only where the competing scores lie within their error
      bound.
    * ``kind="own order"`` (made with :func:`own_order`): within the bound, *and* bit for
      bit equal to ``emulation``, a CPU function that reproduces the backend's own
      documented order of operations (what the project's fast kernels claim).

    Attributes:
        kind: ``"bitwise"``, ``"bound"`` or ``"own order"``.
        emulation: own order only: a function with the stage method's signature that runs on
            CPU tensors and returns the backend's bits.
        tanh: optional: the FP32 ``tanh`` the backend uses, as a CPU function (FP32
            tensor in and out) that reproduces it bit for bit. With an own-order claim the
            SiTU oracle is also evaluated with it and must match; with a bound claim on
            ``expert_rows`` it is the ``tanh`` of the SiTU between FC1 and the MXFP8
            re-quantization, which is checked bitwise on the backend's own FC1 output
            (default: torch's CPU ``tanh``).
        sigmoid: likewise, the FP32 sigmoid it uses (SiTU, the experts' SiTU, the router).
        sigmoid_abs_error: optional: the absolute error of the backend's FP32 sigmoid (the
            router's score bound). Default: a library sigmoid's,
            ``verify.tolerances.SIGMOID_ABS_ERROR``; a backend with a sigmoid of its own
            states its bound and documents where it comes from.
    """

    kind: str
    emulation: Callable | None = None
    tanh: Callable | None = None
    sigmoid: Callable | None = None
    sigmoid_abs_error: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("bitwise", "bound", "own order"):
            raise ValueError(f"Claim.kind must be 'bitwise', 'bound' or 'own order', got "
                             f"{self.kind!r}")
        if self.kind == "own order" and not callable(self.emulation):
            raise ValueError("an 'own order' claim needs a callable emulation")
        if self.kind != "own order" and self.emulation:
            raise ValueError(f"a {self.kind!r} claim takes no emulation (use own_order(...))")
        if self.kind == "bitwise" and (self.tanh or self.sigmoid or self.sigmoid_abs_error):
            raise ValueError("a bitwise claim takes no tanh, sigmoid or sigmoid_abs_error: "
                             "its outputs are the reference's")
        if self.sigmoid_abs_error is not None and not (
                isinstance(self.sigmoid_abs_error, float) and 0 < self.sigmoid_abs_error < 1):
            raise ValueError(f"sigmoid_abs_error must be a float in (0, 1), got "
                             f"{self.sigmoid_abs_error!r}")

    @property
    def exact(self) -> bool:
        """True for a bitwise claim: the outputs are the reference's bits."""
        return self.kind == "bitwise"


#: Every output bit equal to the reference's.
BITWISE = Claim("bitwise")
#: Within the stage's derived error bound.
BOUND = Claim("bound")


def own_order(emulation: Callable, *, tanh: Callable | None = None,
              sigmoid: Callable | None = None,
              sigmoid_abs_error: float | None = None) -> Claim:
    """A claim of the bound plus bit equality with ``emulation`` (see :class:`Claim`)."""
    return Claim("own order", emulation, tanh, sigmoid, sigmoid_abs_error)


@dataclasses.dataclass
class ExpertRows:
    """The result of :meth:`Backend.expert_rows` for ``R`` latent rows of ``k`` pairs each.

    Attributes:
        rows: BF16 ``[R*k, L]``: row ``r*k + j`` is expert ``ids[r, j]`` on latent row
            ``r`` (this rank's partial of it for a tensor-parallel ``shard``); NaN for a
            pair whose expert is not local.
        fc1: FP32 ``[R*k, 2 I_s]`` (``I_s = I / ranks``): each pair's FC1 output, gate
            columns then up columns; ``None`` unless intermediates were asked for.
        hidden_codes: uint8 ``[R*k, I_s]``: the E4M3 codes of the MXFP8 re-quantized SiTU
            output, the FC2 input; ``None`` unless asked for.
        hidden_scales: uint8 ``[R*k, I_s/32]``: their E8M0 scales; ``None`` unless asked for.
    """

    rows: torch.Tensor
    fc1: torch.Tensor | None = None
    hidden_codes: torch.Tensor | None = None
    hidden_scales: torch.Tensor | None = None


@dataclasses.dataclass
class LayerOutput:
    """One rank's result of :meth:`Backend.layer`.

    Attributes:
        out: BF16 ``[T_r, H]``: the layer output of the rank's tokens.
        ids: int32 ``[T_r, top_k]``: the experts its router chose for them.
    """

    out: torch.Tensor
    ids: torch.Tensor


class Backend:
    """Subclass this, set the class attributes, and override the methods of the stages
    named in ``claims``.

    Attributes:
        name: the backend's name in test ids and the summary table (letters, digits and
            ``. _ + -``).
        version: what the report records next to the name, so a result can be cited
            (e.g. your package's version and commit).
        devices: where it runs, in order of preference: ``"cuda"`` and/or ``"cpu"``. The
            contracts run on the first this machine has and hand the stage methods
            tensors on it; with none present every contract of the backend is skipped,
            saying so.
        claims: stage name (:data:`STAGES`) -> :class:`Claim` for every stage it
            implements. A stage not named here is skipped with that reason.
        layer_ranks: for each ``layer_*`` stage it claims, the rank counts it runs
            (default ``(1,)``).
    """

    name: str = ""
    version: str = "unversioned"
    devices: tuple[str, ...] = ("cpu",)
    claims: Mapping[str, Claim] = {}
    layer_ranks: Mapping[str, tuple[int, ...]] = {}

    def available(self) -> tuple[bool, str]:
        """``(True, "")`` when this machine can run it, else ``(False, the reason)``:
        beyond ``devices``, e.g. a library that does not import or a GPU architecture it
        was not built for. The reason becomes every contract's skip reason."""
        return True, ""

    # --- the stages --------------------------------------------------------------------

    def quantize_mxfp8(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MXFP8 (E4M3 elements, one E8M0 scale per 32 along the last dimension, RCEIL
        scales, satfinite round-to-nearest-even elements).

        Args:
            x: BF16 ``[T, K]``, ``K % 32 == 0``.

        Returns:
            ``(codes, scales)``: float8_e4m3fn ``[T, K]`` and uint8 ``[T, K/32]`` (the
            E8M0 bit patterns).
        """
        raise NotImplementedError

    def quantize_mxfp8_swizzled(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`quantize_mxfp8` with the scales in the 128x4 tiled layout of the
        block-scaled GEMMs (``model.swizzle.swizzle_scales_128x4``: rows padded to 128,
        scale columns to 4, zero padding).

        Args:
            x: BF16 ``[T, K]``, ``K % 32 == 0``.

        Returns:
            ``(codes, scales)``: float8_e4m3fn ``[T, K]`` and uint8 with
            ``pad128(T) * pad4(K/32)`` elements (any shape; read in memory order).
        """
        raise NotImplementedError

    def route(self, logits: torch.Tensor, bias: torch.Tensor, *, top_k: int,
              renormalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The sigmoid top-k router: ids of the ``top_k`` largest ``sigmoid(logits) +
        bias`` (descending, ties to the lower expert id), weights the unbiased sigmoids of
        those ids (divided by their sum when ``renormalize``) times ``scale``.

        Args:
            logits: FP32 ``[T, E]``; bias: FP32 ``[E]``.

        Returns:
            ``(weights, ids)``: FP32 ``[T, top_k]`` and int32 ``[T, top_k]``.
        """
        raise NotImplementedError

    def situ_and_mul(self, h: torch.Tensor, *, beta: float,
                     linear_beta: float) -> torch.Tensor:
        """SiTU-and-mul: ``beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta)``
        in FP32, one BF16 rounding.

        Args:
            h: BF16 ``[T, 2N]``, the gate ``g`` in the first ``N`` columns, ``u`` after.

        Returns:
            BF16 ``[T, N]``.
        """
        raise NotImplementedError

    def finalize(self, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routing-weighted sum of each token's expert rows:
        ``out[t] = sum_j weights[t, j] * rows[t*k + j]`` (the reference: an FP32 fused
        multiply-add chain in ``j`` order from ``+0``, one BF16 rounding).

        Args:
            rows: BF16 ``[T*k, L]``; weights: FP32 ``[T, k]``.

        Returns:
            BF16 ``[T, L]``.
        """
        raise NotImplementedError

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x * rsqrt(mean(x^2) + eps) * weight`` per row in FP32, one BF16 rounding.

        Args:
            x: BF16 ``[T, L]``; weight: BF16 ``[L]``.

        Returns:
            BF16 ``[T, L]``.
        """
        raise NotImplementedError

    def expert_rows(self, codes: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor,
                    weights: LatentMoEWeights, *, experts: tuple[int, int],
                    shard: tuple[int, int], intermediates: bool) -> ExpertRows:
        """The routed experts' output row of every local pair: FC1 over the MXFP4 ``w13``
        (gate rows, then up rows) in FP32, SiTU-and-mul in FP32, the result re-quantized
        to MXFP8, FC2 over the MXFP4 ``w2``, one BF16 rounding (``reference.experts``).

        Args:
            codes: float8_e4m3fn ``[R, L]``, the MXFP8 latent rows; scales: uint8
                ``[R, L/32]``.
            ids: int32 ``[R, k]`` global expert ids.
            weights: the layer's weights on the backend's device (``w13``,
                ``w13_scales``, ``w2``, ``w2_scales`` are read; ``weights.config`` holds
                the widths and the SiTU betas). The same object comes back on every call
                with these weights, so a backend may cache what it prepares from them.
            experts: ``(first, count)``: the local experts (a DEP owner's slice; all of
                them is ``(0, E)``). Pairs of other experts are not computed: NaN rows.
            shard: ``(rank, ranks)``: this rank's tensor-parallel slice of the
                intermediate (``(0, 1)``: all of it).
            intermediates: also return ``fc1``, ``hidden_codes`` and ``hidden_scales``
                (a ``bound`` claim is checked stage by stage on them).

        Returns:
            :class:`ExpertRows`.
        """
        raise NotImplementedError

    def layer(self, schedule: str, xs: list[torch.Tensor],
              weights: LatentMoEWeights) -> list[LayerOutput]:
        """The whole layer in ``schedule`` (:data:`SCHEDULES`) over ``len(xs)`` ranks.

        Args:
            schedule: ``"stock"``, ``"dep"`` or ``"wide"`` (the claimed ``layer_*`` stages).
            xs: one BF16 ``[T_r, H]`` tensor of hidden rows per rank (for ``"wide"`` every
                rank's is the same batch; for ``"stock"`` there is one).
            weights: the layer's weights on the backend's device (config in
                ``weights.config``).

        Returns:
            one :class:`LayerOutput` per rank, in rank order.
        """
        raise NotImplementedError
