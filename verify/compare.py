"""Comparators of the verification layer: bitwise, within N ULP, within a derived bound.

Every contract in `verify/` ends in one of three calls:

* [`assert_bitwise_equal`][verify.compare.assert_bitwise_equal] — the fast op and the
  reference that emulates its order must produce the same bytes;
* [`assert_within_ulp`][verify.compare.assert_within_ulp] — a distance counted in
  representable values of the output format;
* [`assert_within_bound`][verify.compare.assert_within_bound] — `|actual - exact| <= bound`
  elementwise against a high-precision truth, with `bound` derived by
  [`verify.bounds`][verify.bounds] from the operands.

Each returns a [`CompareResult`][verify.compare.CompareResult] on success (so the JSON
report records the worst figures) and raises [`ContractError`][verify.compare.ContractError]
on failure, whose message names the coordinate of each of the first mismatches (with the
caller's index names, e.g. ``token=3 column=17``), both bit patterns in hex, both values and
the ULP distance or the ratio to the bound. Inputs may live on any device; only the
mismatching entries are moved to the CPU for the report.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch

__all__ = [
    "ULP_NAN",
    "CompareResult",
    "ContractError",
    "assert_bitwise_equal",
    "assert_within_bound",
    "assert_within_ulp",
    "raw_bits",
    "ulp_distance",
]

#: Sentinel returned by [`ulp_distance`][verify.compare.ulp_distance] where exactly one of
#: the two values is a NaN (a NaN is not on the line of representable values). It is the
#: largest int64, so any `max_ulp` check fails there.
ULP_NAN: int = torch.iinfo(torch.int64).max

# Integer type of the same width used to read raw bytes, by item size in bytes.
_BITS_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# Floating formats with a sign-magnitude encoding that ulp_distance supports:
# dtype -> (bit width, smallest magnitude bit pattern that is a NaN, short name).
# E4M3FN has no infinity: only magnitude 0x7F (S.1111.111) is NaN. The IEEE-like formats
# encode NaN as all-ones exponent with a non-zero mantissa, i.e. magnitude > +inf's.
_ULP_FORMATS: dict[torch.dtype, tuple[int, int]] = {
    torch.float8_e4m3fn: (8, 0x7F),
    torch.float8_e5m2: (8, 0x7D),
    torch.float16: (16, 0x7C01),
    torch.bfloat16: (16, 0x7F81),
    torch.float32: (32, 0x7F800001),
}


class ContractError(AssertionError):
    """A verification contract failed.

    Attributes:
        report: structured description of the failure, JSON-serialisable: the fields of
            [`CompareResult.as_dict`][verify.compare.CompareResult.as_dict] plus
            ``"reason"`` (one line) and ``"first_mismatches"`` (a list of dicts with the
            coordinate, both bit patterns in hex, both values and the ULP distance or the
            ratio to the bound).
    """

    def __init__(self, message: str, report: dict[str, Any]):
        super().__init__(message)
        self.report = report


@dataclasses.dataclass
class CompareResult:
    """Outcome of one comparison, returned on success and carried by a `ContractError`.

    Attributes:
        what: the caller's name for the compared quantity (e.g. ``"finalize out"``).
        kind: ``"bitwise"``, ``"ulp"`` or ``"bound"``.
        elements: number of compared elements.
        mismatches: number of elements that broke the contract (0 on success).
        worst_ulp: largest ULP distance seen (float formats of `ulp_distance` only; for a
            bitwise comparison of such a format it is the largest distance among the
            mismatches, 0 when none), else None.
        worst_ratio: largest `|actual - expected| / bound` (kind ``"bound"`` only), else None.
        worst_index: coordinate (one int per dimension) of the worst element, or None.
        ulp_histogram: ``{ulp distance: count}`` over all elements (kind ``"ulp"``), else None.
        index_names: the caller's names of the dimensions, used to format `worst_index`.
    """

    what: str
    kind: str
    elements: int
    mismatches: int
    worst_ulp: int | None = None
    worst_ratio: float | None = None
    worst_index: tuple[int, ...] | None = None
    ulp_histogram: dict[int, int] | None = None
    index_names: tuple[str, ...] | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict: histogram keys become strings, an infinite ratio ``"inf"``,
        and ``worst_at`` holds the formatted coordinate (``"token=3 column=17"``)."""
        ratio: float | str | None = self.worst_ratio
        if ratio is not None and not math.isfinite(ratio):
            ratio = str(ratio)
        return {
            "what": self.what,
            "kind": self.kind,
            "elements": self.elements,
            "mismatches": self.mismatches,
            "worst_ulp": self.worst_ulp,
            "worst_ratio": ratio,
            "worst_index": None if self.worst_index is None else list(self.worst_index),
            "worst_at": (
                None
                if self.worst_index is None
                else _format_coord(self.worst_index, self.index_names)
            ),
            "ulp_histogram": (
                None
                if self.ulp_histogram is None
                else {str(k): v for k, v in sorted(self.ulp_histogram.items())}
            ),
        }


# --------------------------------------------------------------------------- helpers


def _format_coord(coord: tuple[int, ...], names: tuple[str, ...] | None) -> str:
    if names is None:
        return "[" + ", ".join(str(c) for c in coord) + "]"
    if not coord:
        return "()"
    return " ".join(f"{n}={c}" for n, c in zip(names, coord))


def _check_names(t: torch.Tensor, index_names: tuple[str, ...] | None) -> None:
    if index_names is not None and len(index_names) != t.dim():
        raise ValueError(
            f"index_names {tuple(index_names)} has {len(index_names)} names for a tensor "
            f"of {t.dim()} dimensions (shape {tuple(t.shape)})"
        )


def raw_bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of `t` as a signed/unsigned integer tensor of the same width (bool as
    uint8), so NaN payloads and -0 compare as bits."""
    if t.is_complex():
        raise TypeError(f"complex dtype {t.dtype} is not supported")
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    size = t.element_size()
    if size not in _BITS_VIEW:
        raise TypeError(f"dtype {t.dtype} of item size {size} is not supported")
    return t.view(_BITS_VIEW[size])


def _hex(bits: int, size: int) -> str:
    return f"0x{bits & ((1 << (8 * size)) - 1):0{2 * size}x}"


def _value(t: torch.Tensor) -> Any:
    """Python value of a 1-element CPU tensor, exact for every float format."""
    if t.dtype == torch.bool:
        return bool(t.item())
    if t.is_floating_point():
        return float(t.to(torch.float64).item())
    return int(t.item())


def _same_layout(actual: torch.Tensor, expected: torch.Tensor, what: str, kind: str) -> None:
    problems = []
    if actual.shape != expected.shape:
        problems.append(f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        problems.append(f"dtype {actual.dtype} != expected {expected.dtype}")
    if problems:
        reason = f"{what}: actual " + " and ".join(problems)
        raise ContractError(
            reason,
            {
                "what": what,
                "kind": kind,
                "reason": reason,
                "actual_shape": list(actual.shape),
                "expected_shape": list(expected.shape),
                "actual_dtype": str(actual.dtype),
                "expected_dtype": str(expected.dtype),
            },
        )


def _flat_coords(flat_idx: torch.Tensor, shape: torch.Size) -> list[tuple[int, ...]]:
    idx = flat_idx.cpu().numpy()
    if len(shape) == 0:
        return [() for _ in idx]
    cols = np.unravel_index(idx, tuple(shape))
    return [tuple(int(c[i]) for c in cols) for i in range(len(idx))]


def _histogram(d: torch.Tensor) -> dict[int, int]:
    vals, counts = torch.unique(d.reshape(-1), return_counts=True)
    return {int(v): int(c) for v, c in zip(vals.cpu().tolist(), counts.cpu().tolist())}


def _raise_mismatches(result: CompareResult, actual: torch.Tensor, expected: torch.Tensor,
                      first: torch.Tensor, reason: str, details) -> None:
    """Raise the `ContractError` of a failed comparison, the one report of all three
    comparators: for each flat index in `first` (the first failures, row-major), the
    coordinate with the caller's index names, both bit patterns in hex, both values, then
    the comparator's own figures ``details(i) -> (fields, text)`` for the i-th of them
    (the ULP distance, or the difference, the bound and the ratio)."""
    coords = _flat_coords(first, actual.shape)
    sel_a = actual.reshape(-1)[first].cpu()
    sel_e = expected.to(actual.device).reshape(-1)[first].cpu()
    bits_a, bits_e = raw_bits(sel_a).tolist(), raw_bits(sel_e).tolist()
    rows, lines = [], []
    for i, coord in enumerate(coords):
        va, ve = _value(sel_a[i]), _value(sel_e[i])
        ha, he = _hex(bits_a[i], actual.element_size()), _hex(bits_e[i], expected.element_size())
        at = _format_coord(coord, result.index_names)
        fields, text = details(i)
        rows.append({"at": at, "index": list(coord), "actual_hex": ha, "expected_hex": he,
                     "actual": repr(va), "expected": repr(ve), **fields})
        lines.append(f"  {at}: actual {ha} ({va!r}) expected {he} ({ve!r})"
                     + (f", {text}" if text else ""))
    msg = reason + f"; first {len(lines)}:\n" + "\n".join(lines)
    raise ContractError(msg, {**result.as_dict(), "reason": reason, "first_mismatches": rows})


def _ulp_text(u: int | None) -> str:
    if u is None:
        return ""
    return "NaN vs number" if u == ULP_NAN else f"{u} ulp"


# --------------------------------------------------------------------------- ULP


def _ordinal(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Map each value to its position on the monotone integer line of its format.

    Returns ``(key, is_nan)``, both of `x`'s shape; `key` is int64 with
    ``key(+0) == key(-0) == 0`` and ``key(next value up) == key + 1`` for every
    non-NaN value (infinities are one step beyond the largest finite value).
    """
    width, nan_min = _ULP_FORMATS[x.dtype]
    bits = raw_bits(x).to(torch.int64) & ((1 << width) - 1)
    sign = bits >> (width - 1)
    mag = bits & ((1 << (width - 1)) - 1)
    key = torch.where(sign == 1, -mag, mag)
    return key, mag >= nan_min


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Number of representable steps between `a` and `b`, elementwise.

    Args:
        a, b: tensors of the same dtype, one of bfloat16, float16, float32,
            float8_e4m3fn, float8_e5m2, of broadcastable shapes, on one device.

    Returns:
        int64 tensor of the broadcast shape. With ``key(x)`` the signed magnitude of `x`'s
        bit pattern (sign bit set -> ``-magnitude``), the result is
        ``|key(a) - key(b)|``: 0 for equal values (``+0`` and ``-0`` are one point), 1 for
        adjacent representable values, and the count of steps otherwise; an infinity is one
        step past the largest finite value. Where exactly one of `a`, `b` is NaN the result
        is `ULP_NAN` (int64 max); where both are NaN it is 0
        (payloads are not compared here — use `assert_bitwise_equal` for that).
    """
    if a.dtype != b.dtype:
        raise TypeError(f"ulp_distance: dtypes differ ({a.dtype} vs {b.dtype})")
    if a.dtype not in _ULP_FORMATS:
        raise TypeError(
            f"ulp_distance: dtype {a.dtype} not supported "
            f"(supported: {', '.join(str(d) for d in _ULP_FORMATS)})"
        )
    ka, na = _ordinal(a)
    kb, nb = _ordinal(b)
    d = (ka - kb).abs()
    d = torch.where(na | nb, torch.full_like(d, ULP_NAN), d)
    return torch.where(na & nb, torch.zeros_like(d), d)


# --------------------------------------------------------------------------- bitwise


def assert_bitwise_equal(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    what: str,
    index_names: tuple[str, ...] | None = None,
    max_report: int = 8,
) -> CompareResult:
    """Assert `actual` and `expected` have identical bytes.

    Args:
        actual: tensor under test, any shape and dtype (floats, float8, ints, bool).
        expected: tensor of the same shape and dtype (moved to `actual`'s device).
        what: name of the compared quantity, used in the message and the report.
        index_names: one name per dimension, e.g. ``("token", "column")``, to name
            coordinates ``token=3 column=17`` in the message.
        max_report: how many of the first mismatches (in row-major order) to list.

    Returns:
        A `CompareResult` of kind ``"bitwise"`` with ``mismatches == 0``.

    Raises:
        ContractError: on a shape or dtype difference, or when any element's bit pattern
            differs. ``+0`` vs ``-0`` and NaNs with different payloads are mismatches; two
            NaNs with the same bits match. The message gives the mismatch count out of
            the total and, for each of the first `max_report`, the coordinate, both bit
            patterns in hex, both values and (float formats) the ULP distance.
    """
    _same_layout(actual, expected, what, "bitwise")
    _check_names(actual, index_names)
    expected = expected.to(actual.device)
    ba, be = raw_bits(actual), raw_bits(expected)
    differ = (ba != be).reshape(-1)
    n = differ.numel()
    count = int(differ.sum().item())
    has_ulp = actual.dtype in _ULP_FORMATS
    if count == 0:
        return CompareResult(
            what, "bitwise", n, 0, worst_ulp=0 if has_ulp else None, index_names=index_names
        )

    flat_a, flat_e = actual.reshape(-1), expected.reshape(-1)
    where = torch.nonzero(differ).reshape(-1)
    worst_ulp = None
    worst_flat = where[0]
    if has_ulp:
        d = ulp_distance(flat_a[where], flat_e[where])
        worst_ulp = int(d.max().item())
        worst_flat = where[int(torch.argmax(d).item())]
    first = where[:max_report]
    ulps = ulp_distance(flat_a[first], flat_e[first]).cpu().tolist() if has_ulp else None
    result = CompareResult(
        what, "bitwise", n, count, worst_ulp=worst_ulp,
        worst_index=_flat_coords(worst_flat.reshape(1), actual.shape)[0],
        index_names=index_names,
    )
    reason = (
        f"{what}: {count} of {n} elements differ bitwise "
        f"({actual.dtype}, shape {tuple(actual.shape)})"
    )

    def details(i):
        if ulps is None:
            return {}, ""
        return {"ulp": ulps[i]}, _ulp_text(ulps[i])

    _raise_mismatches(result, actual, expected, first, reason, details)


# --------------------------------------------------------------------------- ULP


def assert_within_ulp(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    max_ulp: int,
    what: str,
    index_names: tuple[str, ...] | None = None,
    max_report: int = 8,
) -> CompareResult:
    """Assert ``ulp_distance(actual, expected) <= max_ulp`` elementwise.

    Args:
        actual, expected: same shape and same dtype, one of the formats of
            [`ulp_distance`][verify.compare.ulp_distance].
        max_ulp: largest accepted distance in representable steps (``>= 0``). The caller
            must derive it (e.g. "one rounding of a correctly rounded function: 0 ulp").
        what, index_names, max_report: as in `assert_bitwise_equal`.

    Returns:
        A `CompareResult` of kind ``"ulp"`` with `worst_ulp`, its coordinate and the
        histogram ``{distance: count}`` over all elements.

    Raises:
        ContractError: shape/dtype mismatch, or elements farther than `max_ulp` (a NaN on
            one side only counts as `ULP_NAN`).
    """
    if max_ulp < 0:
        raise ValueError(f"max_ulp must be >= 0, got {max_ulp}")
    _same_layout(actual, expected, what, "ulp")
    _check_names(actual, index_names)
    expected = expected.to(actual.device)
    d = ulp_distance(actual, expected).reshape(-1)
    n = d.numel()
    hist = _histogram(d) if n else {}
    worst = int(d.max().item()) if n else 0
    worst_index = (
        _flat_coords(torch.argmax(d).reshape(1), actual.shape)[0] if n else None
    )
    bad = d > max_ulp
    count = int(bad.sum().item())
    result = CompareResult(
        what, "ulp", n, count, worst_ulp=worst, worst_index=worst_index,
        ulp_histogram=hist, index_names=index_names,
    )
    if count == 0:
        return result

    first = torch.nonzero(bad).reshape(-1)[:max_report]
    dist = d[first].cpu().tolist()
    reason = (
        f"{what}: {count} of {n} elements are more than {max_ulp} ulp apart "
        f"(worst {'NaN vs number' if worst == ULP_NAN else worst}; "
        f"{actual.dtype}, shape {tuple(actual.shape)})"
    )
    _raise_mismatches(result, actual, expected, first, reason,
                      lambda i: ({"ulp": dist[i]}, _ulp_text(dist[i])))


# --------------------------------------------------------------------------- bound


def assert_within_bound(
    actual: torch.Tensor,
    expected: torch.Tensor,
    bound: torch.Tensor | float,
    *,
    what: str,
    index_names: tuple[str, ...] | None = None,
    max_report: int = 8,
) -> CompareResult:
    """Assert ``|actual - expected| <= bound`` elementwise, evaluated in float64.

    Args:
        actual: tensor under test, any float dtype (its values are exact in float64).
        expected: the high-precision truth (normally float64), same shape as `actual`.
        bound: non-negative, finite, float tensor (or number) broadcastable to the shape,
            normally derived with [`verify.bounds`][verify.bounds] from the operands.
        what, index_names, max_report: as in `assert_bitwise_equal`.

    The difference is taken in float64: ``diff = |float64(actual) - float64(expected)|``
    (0 where both are equal, so equal infinities agree). The ratio reported per element is
    ``diff / bound`` with ``0/0 -> 0`` and ``diff > 0, bound == 0 -> inf``. A NaN in
    `actual` passes only where `expected` is NaN at the same place (and vice versa); a
    one-sided NaN has ratio ``inf``.

    Note: the float64 subtraction rounds; when `actual` is bf16/fp16/fp32 and `expected`
    float64, ``diff`` is within a relative ``2^-53`` of the true difference, far below the
    unit roundoffs the bounds of `verify.bounds` are built from.

    Returns:
        A `CompareResult` of kind ``"bound"`` with the worst ratio (``<= 1`` on success)
        and its coordinate.

    Raises:
        ContractError: shape mismatch, or any element outside its bound. The message gives
            the count, the worst ratio and where, and for each of the first failures the
            coordinate, both bit patterns, both values, the difference, the bound, the ratio.
        ValueError: `bound` negative, NaN or infinite somewhere (an unusable contract).
    """
    if actual.shape != expected.shape:
        _same_layout(actual, expected, what, "bound")
    if not (actual.is_floating_point() and expected.is_floating_point()):
        raise TypeError(
            f"{what}: assert_within_bound needs float tensors "
            f"(got {actual.dtype} and {expected.dtype})"
        )
    _check_names(actual, index_names)
    dev = actual.device
    a64 = actual.to(torch.float64)
    e64 = expected.to(device=dev, dtype=torch.float64)
    b64 = torch.as_tensor(bound, dtype=torch.float64, device=dev)
    if bool(torch.isnan(b64).any()) or bool((b64 < 0).any()) or bool(torch.isinf(b64).any()):
        raise ValueError(f"{what}: the bound must be finite and non-negative everywhere")
    b64 = torch.broadcast_to(b64, a64.shape)

    nan_a, nan_e = torch.isnan(a64), torch.isnan(e64)
    diff = torch.where(a64 == e64, torch.zeros_like(a64), (a64 - e64).abs())
    inf = torch.full_like(diff, math.inf)
    ratio = torch.where(b64 > 0, diff / b64, torch.where(diff > 0, inf, torch.zeros_like(diff)))
    ratio = torch.where(nan_a | nan_e, inf, ratio)
    ratio = torch.where(nan_a & nan_e, torch.zeros_like(ratio), ratio)
    ratio = ratio.reshape(-1)
    n = ratio.numel()
    bad = ratio > 1.0
    count = int(bad.sum().item())
    worst_flat = torch.argmax(ratio) if n else None
    result = CompareResult(
        what, "bound", n, count,
        worst_ratio=float(ratio[worst_flat].item()) if n else 0.0,
        worst_index=None if worst_flat is None
        else _flat_coords(worst_flat.reshape(1), actual.shape)[0],
        index_names=index_names,
    )
    if count == 0:
        return result

    first = torch.nonzero(bad).reshape(-1)[:max_report]
    sel_d = diff.reshape(-1)[first].cpu().tolist()
    sel_b = b64.reshape(-1)[first].cpu().tolist()
    sel_r = ratio[first].cpu().tolist()
    reason = (
        f"{what}: {count} of {n} elements exceed the bound; worst |diff|/bound = "
        f"{result.worst_ratio!r} at {_format_coord(result.worst_index, index_names)} "
        f"({actual.dtype} vs {expected.dtype}, shape {tuple(actual.shape)})"
    )

    def details(i):
        return ({"diff": repr(sel_d[i]), "bound": repr(sel_b[i]), "ratio": repr(sel_r[i])},
                f"|diff| {sel_d[i]!r} > bound {sel_b[i]!r} (ratio {sel_r[i]!r})")

    _raise_mismatches(result, actual, expected, first, reason, details)
