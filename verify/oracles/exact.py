"""Exact rounding: how every oracle turns an exact real value into a float.

Written from the IEEE-754 definition of round-to-nearest-even, not from ``reference.fp``
(which reaches the same roundings by round-to-odd): a contract that compares the two
therefore tests the reference's rounding technique against the definition.

* :func:`round_tensor` rounds float64 values to a format of ``p`` significand bits
  (``x = n * quantum`` with ``n`` rounded half-to-even, the quantum taken from the binade,
  gradual underflow, overflow to infinity). Note that ``torch`` and ``ml_dtypes`` convert
  float64 to bfloat16 through float32 (two roundings: ``1 + 2^-8 + 2^-30`` becomes 1, not
  ``1 + 2^-7``); this module never does.
* :func:`round_sum` rounds the exact sum of a list of float64 numbers once
  (``math.fsum`` gives the sum rounded to float64 and the sign of what it dropped, which
  decides the only case where that matters: a float64 sum lying exactly on a midpoint).
* :func:`rounded_dot` rounds every exact ``sum_k a[m, k] b[n, k] (+ c[m, n])`` once, with a
  float64 GEMM and two certificates (below); only the elements neither certificate covers
  are summed one by one with :func:`round_sum`.

Certificates of :func:`rounded_dot`, per output element:

1. *interval*: the float64 GEMM in any order is within ``gamma_K(2^-53) sum |a b|`` of the
   exact sum (Higham, *Accuracy and Stability of Numerical Algorithms*, §3.1; products of
   operands of at most 24 significand bits are exact in float64); if both ends of that
   interval round to one value, so does the exact sum;
2. *exact* (checked only where the interval certificate fails, :func:`exact_in_float64`):
   every product is an integer multiple of ``Q`` (the smallest lowest set bit among them)
   and ``sum |a b| <= 2^52 Q``; then every partial sum of every order is a multiple of
   ``Q`` below ``2^53 Q``, so the float64 GEMM is exact whatever its order.

Elements covered by neither are *ambiguous* for an implementation that accumulates in
float64 (the reference's GEMM model): it may return either rounding of the interval's ends,
and :class:`RoundedDot` says which elements those are.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import torch

__all__ = [
    "Format",
    "FP32",
    "BF16",
    "format_of",
    "round_tensor",
    "round_fraction",
    "round_sum",
    "exact_in_float64",
    "RoundedDot",
    "rounded_dot",
    "rounded_sum",
]


@dataclasses.dataclass(frozen=True)
class Format:
    """A binary floating-point format: ``precision`` significand bits (implicit bit
    included), ``emin`` the exponent of its smallest normal binade, ``emax`` of its
    largest, and the torch dtype that holds it."""

    name: str
    precision: int
    emin: int
    emax: int
    dtype: torch.dtype

    @property
    def max(self) -> float:
        """The largest finite value, ``(2 - 2^(1-p)) 2^emax``."""
        return (2.0 - 2.0 ** (1 - self.precision)) * 2.0**self.emax


FP32 = Format("float32", 24, -126, 127, torch.float32)
BF16 = Format("bfloat16", 8, -126, 127, torch.bfloat16)


def format_of(dtype: torch.dtype) -> Format:
    """The :class:`Format` of ``torch.float32`` or ``torch.bfloat16``."""
    for f in (FP32, BF16):
        if f.dtype == dtype:
            return f
    raise ValueError(f"no exact-rounding format for {dtype}; known: float32, bfloat16")


def round_tensor(x: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Round float64 ``x`` to ``fmt``, nearest even, once.

    With ``e = max(floor(log2 |x|), emin)`` the quantum is ``2^(e - p + 1)``; ``x /
    quantum`` is an exact power-of-two scaling, rounded half-to-even to an integer ``n``;
    the result is ``n * quantum``, or a signed infinity beyond the largest finite value.
    Zeros keep their sign; a non-zero value that rounds to zero gets the sign of ``x``.

    Returns float64 (every value exactly representable in ``fmt``; ``.to(fmt.dtype)`` is
    then exact).
    """
    if x.dtype != torch.float64:
        raise TypeError(f"round_tensor: x must be float64, got {x.dtype}")
    _, exponent = torch.frexp(x)  # |x| = m 2^exponent, m in [0.5, 1)
    e = torch.clamp(exponent - 1, min=fmt.emin)
    quantum = torch.ldexp(torch.ones_like(x), e - (fmt.precision - 1))
    y = torch.round(x / quantum) * quantum
    y = torch.where(y.abs() > fmt.max, torch.copysign(torch.full_like(y, math.inf), x), y)
    return torch.where(torch.isfinite(x), y, x)


def round_fraction(value: Fraction, fmt: Format) -> float:
    """Round an exact rational to ``fmt`` (nearest, ties to even). Exact zero gives +0."""
    if value == 0:
        return 0.0
    sign = -1.0 if value < 0 else 1.0
    a = abs(value)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1  # now 2^e <= a < 2^(e+1)
    e = max(e, fmt.emin)
    quantum = Fraction(2) ** (e - fmt.precision + 1)
    n = a / quantum
    whole = n.numerator // n.denominator
    rest = n - whole
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and whole % 2):
        whole += 1
    r = whole * quantum
    if r > Fraction(fmt.max):
        return sign * math.inf
    return sign * float(r)


def round_sum(terms: list[float], fmt: Format) -> float:
    """The exact sum of float64 ``terms`` rounded once to ``fmt``.

    ``s = fsum(terms)`` is the sum rounded to float64 and ``r = fsum(terms + [-s])`` the
    sign of the exact remainder; ``fmt`` has fewer than 53 bits, so the exact sum rounds like
    ``s`` unless ``s`` is exactly a midpoint of ``fmt``, where ``r`` decides (``r == 0``:
    ``s`` is the exact sum, a true tie)."""
    s = math.fsum(terms)
    if not math.isfinite(s):
        return s
    r = math.fsum(terms + [-s])
    tiny = Fraction(1, 2**1200)
    up = round_fraction(Fraction(s) + tiny, fmt)
    down = round_fraction(Fraction(s) - tiny, fmt)
    if up == down:
        out = up
    elif r > 0:
        out = up
    elif r < 0:
        out = down
    else:
        out = round_fraction(Fraction(s), fmt)
    if out == 0 and s == 0 and r == 0 and terms and all(math.copysign(1.0, t) < 0 for t in terms):
        return -0.0  # IEEE: a sum of negative zeros is -0
    return out


def exact_in_float64(terms: list[float]) -> bool:
    """Whether every float64 summation order of ``terms`` is exact: all are integer
    multiples of ``Q`` (the smallest lowest-set-bit among them) and ``sum |t| <= 2^52 Q``
    (a factor 2 below ``2^53 Q`` covers the rounding of the ``fsum`` of magnitudes)."""
    low = None
    for t in terms:
        if t == 0:
            continue
        m, e = math.frexp(t)
        n = int(abs(m) * 2**53)
        q = e - 53 + ((n & -n).bit_length() - 1)
        low = q if low is None else min(low, q)
    if low is None:
        return True
    return math.fsum(abs(t) for t in terms) <= math.ldexp(1.0, low + 52)


@dataclasses.dataclass
class RoundedDot:
    """Result of :func:`rounded_dot`.

    Attributes:
        value: the exact sums rounded once, in ``fmt.dtype``.
        low, high: the roundings of the two ends of the float64 interval, ``fmt.dtype``;
            equal to ``value`` wherever a certificate holds.
        ambiguous: bool, where ``low != high``: a float64-accumulating implementation may
            return either there (the exact ``value`` is one of them).
        exact_fallbacks: how many elements were summed one by one (:func:`round_sum`).
    """

    value: torch.Tensor
    low: torch.Tensor
    high: torch.Tensor
    ambiguous: torch.Tensor
    exact_fallbacks: int

    def accept_float64_model(self, actual: torch.Tensor) -> torch.Tensor:
        """What a float64-accumulating model must equal bit for bit: ``value``, except
        where ambiguous and ``actual`` is one of the interval's two roundings."""
        a = actual.to(self.value.device)
        either = self.ambiguous & ((a == self.low) | (a == self.high))
        return torch.where(either, a, self.value)


def _round_with_certificates(s, abs_sum, count, fmt, terms_of):
    """Shared core of :func:`rounded_dot` / :func:`rounded_sum`: ``s`` the float64 sums,
    ``abs_sum`` the float64 sums of magnitudes, ``count`` terms each; ``terms_of(i)`` the
    terms of flat element ``i`` (only asked where the interval certificate fails)."""
    err = abs_sum * (_gamma(count + 2) * (1 + 2.0**-40)) + s.abs() * 2.0**-52
    value = round_tensor(s, fmt)
    low = round_tensor(s - err, fmt)
    high = round_tensor(s + err, fmt)
    open_ = low.view(torch.int64) != high.view(torch.int64)
    fallbacks = 0
    if bool(open_.any()):
        shape = value.shape
        value, low, high = value.reshape(-1).clone(), low.reshape(-1).clone(), high.reshape(-1).clone()
        flat_open = open_.reshape(-1).clone()
        for i in torch.nonzero(flat_open).flatten().tolist():
            terms = terms_of(i)
            if exact_in_float64(terms):  # s is exact: every float64 order gives value
                low[i] = high[i] = value[i]
                flat_open[i] = False
            else:
                value[i] = round_sum(terms, fmt)
                fallbacks += 1
        value, low, high, open_ = (v.view(shape) for v in (value, low, high, flat_open))
    cast = fmt.dtype
    return RoundedDot(value.to(cast), low.to(cast), high.to(cast), open_, fallbacks)


def _gamma(n: int) -> float:
    u = 2.0**-53
    return n * u / (1 - n * u)


def rounded_dot(a: torch.Tensor, b: torch.Tensor, fmt: Format, *,
                addend: torch.Tensor | None = None) -> RoundedDot:
    """Every ``sum_k a[m, k] b[n, k] (+ addend[m, n])`` rounded once to ``fmt``.

    Args:
        a: [M, K], b: [N, K], any float dtype of at most 24 significand bits (products are
            then exact in float64).
        fmt: :data:`FP32` or :data:`BF16`.
        addend: optional [M, N] (such a dtype too), one more exact term.

    Returns:
        :class:`RoundedDot` of [M, N].
    """
    a64, b64 = a.detach().cpu().double(), b.detach().cpu().double()
    if a64.dim() != 2 or b64.dim() != 2 or a64.shape[1] != b64.shape[1]:
        raise ValueError(f"rounded_dot: a [M, K] and b [N, K], got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    s = a64 @ b64.T
    abs_sum = a64.abs() @ b64.abs().T
    c64 = None
    if addend is not None:
        c64 = addend.detach().cpu().double()
        if tuple(c64.shape) != tuple(s.shape):
            raise ValueError(f"rounded_dot: addend must be [M, N] = {tuple(s.shape)}, got "
                             f"{tuple(c64.shape)}")
        s = s + c64
        abs_sum = abs_sum + c64.abs()
    n_cols = s.shape[1]

    def terms_of(i: int) -> list[float]:
        m, n = divmod(i, n_cols)
        terms = (a64[m] * b64[n]).tolist()
        if c64 is not None:
            terms.append(float(c64[m, n]))
        return terms

    return _round_with_certificates(s, abs_sum, a64.shape[1] + 1, fmt, terms_of)


def rounded_sum(terms: torch.Tensor, fmt: Format) -> RoundedDot:
    """``sum`` over the last dimension of exact float64 ``terms [..., K]``, rounded once."""
    t64 = terms.detach().cpu().double()
    s = t64.sum(-1)
    abs_sum = t64.abs().sum(-1)
    flat_terms = t64.reshape(-1, t64.shape[-1])

    def terms_of(i: int) -> list[float]:
        return flat_terms[i].tolist()

    return _round_with_certificates(s, abs_sum, t64.shape[-1], fmt, terms_of)
