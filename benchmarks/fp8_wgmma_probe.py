"""How Hopper's FP8 warpgroup MMA sums: a probe on designed operands (sm_90a).

The experts engine's next structure (issue 36's candidate) would run FC1 and FC2 on
``wgmma ... k32.f32.e4m3.e4m3``: E2M1 weight codes widened to E4M3 (exact: every E2M1
value is an E4M3 value) against the MXFP8 activations as they are, one ``k32`` MMA per
32-wide MX block from a zero accumulator, each block's result scaled by both E8M0 scales
and added to an FP32 sum on the CUDA cores. Its error bound needs to know what one
``k32`` MMA does with its 32 exact products, which NVIDIA does not document: this program
measures it, on operands whose exact sums are known, and writes what it finds.

Each probe is one CTA of one warpgroup (``benchmarks.fp8_wgmma_kernel``): A (64 x 32 E4M3
codes) and B (8 x 32) copied into shared memory under the 128-byte swizzle, one
``wgmma.mma_async m64n8k32.f32.e4m3.e4m3`` (``fast.device.ptx.wgmma_e4m3_ss``) from an FP32
D loaded from memory (``accumulate=1``) or from zero (``accumulate=0``), D stored. The
families (``experiments``):

* ``products``: one non-zero product per output (64 E4M3 magnitudes, normal and subnormal,
  times 8 values of both signs): is every product exact?
* ``alignment``: a large product (448 x 448 or 448 x 320) plus a small one 2^-9.6 ..
  2^-26.6 times smaller, of both signs and of mantissa 1 or 1.5: how many bits below the
  largest term's leading bit survive, and whether the lost ones are truncated (toward zero)
  or rounded;
* ``position``: the same pair with the small product at each of k = 1..31: does the
  survival depend on where in the 32 products a term sits (the adder tree's grouping)?
* ``accumulate``: D = +-1, 1.5 or 2^10 plus one product +-2^-1 .. 2^-18: is D added with
  the products in the same narrow adder, or in FP32?

``analyze`` turns the results into ``products_exact``; for ``alignment`` (and, for D,
``accumulate``) the adder's width in bits below the largest term's leading bit at which a
small term still survives exactly (bounded from both sides by the rows that kept and lost
it) and how the lost bits went (toward zero or otherwise); and ``position_dependent``. ``simulate`` is the model the analysis
is tested against on the CPU (``tests/test_fp8_wgmma_probe.py``): exact products summed in
a fixed-point adder aligned to the largest term, ``width`` bits below its leading bit,
truncated, then D added in FP32.

Run on an sm_90a GPU::

    python -m benchmarks.fp8_wgmma_probe --out fp8_wgmma_probe.json
"""

from __future__ import annotations

import argparse
import json
import math

import torch

__all__ = ["e4m3_code", "e4m3_value", "Probe", "experiments", "run",
           "simulate", "analyze", "compile_probe", "main"]

ROWS, COLS, KS = 64, 8, 32


def e4m3_value(code: int) -> float:
    """The value of an E4M3 (``float8_e4m3fn``) byte."""
    return float(torch.tensor([code], dtype=torch.uint8).view(torch.float8_e4m3fn).float())


def e4m3_code(value: float) -> int:
    """The E4M3 byte of ``value``; ValueError naming it when it is not exactly an E4M3
    value."""
    code = int(torch.tensor([value], dtype=torch.float32).to(torch.float8_e4m3fn)
               .view(torch.uint8))
    if e4m3_value(code) != value:
        raise ValueError(f"e4m3_code: {value!r} is not an E4M3 value")
    return code


class Probe:
    """One CTA's operands: A codes ``uint8 [64, 32]``, B codes ``uint8 [8, 32]``, D
    ``float32 [64, 8]``, the family and, per output, what it tests (``meta[m][n]``: a
    dict, or None for an output the analysis ignores)."""

    def __init__(self, family: str):
        self.family = family
        self.a = torch.zeros(ROWS, KS, dtype=torch.uint8)
        self.b = torch.zeros(COLS, KS, dtype=torch.uint8)
        self.d = torch.zeros(ROWS, COLS, dtype=torch.float32)
        self.meta = [[None] * COLS for _ in range(ROWS)]

    def values(self):
        """(A, B) as float64 values."""
        lut = torch.tensor([e4m3_value(c) if (c & 0x7F) != 0x7F else 0.0 for c in range(256)],
                           dtype=torch.float64)
        return lut[self.a.long()], lut[self.b.long()]

    def exact(self, accumulate: bool) -> torch.Tensor:
        """float64 ``A B^T (+ D)``: every term exact (E4M3 products and their sum of 32 fit
        a double exactly at these magnitudes)."""
        a, b = self.values()
        out = a @ b.T
        return out + self.d.double() if accumulate else out


def _products() -> list[Probe]:
    probe = Probe("products")
    magnitudes = [c for c in range(1, 0x7F, 2)][:ROWS - 1] + [0x7E]  # subnormal .. 448
    b_values = [1.0, -1.0, 1.5, -448.0, 0.015625, -0.001953125, 3.5, 240.0]
    for n, v in enumerate(b_values):
        probe.b[n, 0] = e4m3_code(v)
    for m, code in enumerate(magnitudes):
        probe.a[m, 0] = code
        for n in range(COLS):
            probe.meta[m][n] = {"a": e4m3_value(code), "b": b_values[n]}
    return [probe]


#: The small factor's exponents in ``alignment``: 2^8 .. 2^-9 (the last three subnormal).
SMALL_EXPONENTS = list(range(8, -10, -1))
#: B's small factor per column, sign and mantissa: n % 4.
SMALL_B = [1.0, 1.5, -1.0, -1.5]


def _alignment() -> list[Probe]:
    probe = Probe("alignment")
    for n in range(COLS):
        probe.b[n, 0] = e4m3_code(448.0 if n < 4 else 320.0)
        probe.b[n, 1] = e4m3_code(SMALL_B[n % 4])
    for m, e in enumerate(SMALL_EXPONENTS):
        probe.a[m, 0] = e4m3_code(448.0)
        probe.a[m, 1] = e4m3_code(2.0 ** e)
        for n in range(COLS):
            big = 448.0 * (448.0 if n < 4 else 320.0)
            small = 2.0 ** e * SMALL_B[n % 4]
            probe.meta[m][n] = {"big": big, "small": small,
                                "ratio_log2": math.log2(abs(small) / big)}
    return [probe]


#: The ratios 2^-r of ``position``'s small term to its large one.
_POSITION_RATIOS = (12, 16, 20, 24)


def _position() -> list[Probe]:
    probes = []
    for r in _POSITION_RATIOS:  # big 2^16 (256 x 256) at k = 0, small 2^(16 - r) (1 x B) at k
        probe = Probe("position")
        for n in range(COLS):
            probe.b[n, 0] = e4m3_code(256.0)
            probe.b[n, 1:] = e4m3_code(2.0 ** (16 - r))
        for k in range(1, KS):
            m = k - 1
            probe.a[m, 0] = e4m3_code(256.0)
            probe.a[m, k] = e4m3_code(1.0)
            for n in range(COLS):
                probe.meta[m][n] = {"k": k, "ratio_log2": -r}
        probes.append(probe)
    return probes


#: D of ``accumulate``, per column ``n % 4``; the product is positive for n < 4, else
#: negative.
_D_VALUES = [1.0, -1.0, 1.5, 1024.0]


def _accumulate() -> list[Probe]:
    probes = []
    for b_mag, exponents in ((1.0, range(1, 10)), (2.0 ** -9, range(10, 19))):
        probe = Probe("accumulate")  # the product 2^-r = A (2^-(r - 9) or 2^-r) x B
        for n in range(COLS):
            probe.b[n, 0] = e4m3_code(b_mag if n < 4 else -b_mag)
        for m, r in enumerate(exponents):
            a = 2.0 ** -r / b_mag
            probe.a[m, 0] = e4m3_code(a)
            for n in range(COLS):
                d = _D_VALUES[n % 4]
                product = a * (b_mag if n < 4 else -b_mag)
                probe.d[m, n] = d
                probe.meta[m][n] = {"d": d, "product": product,
                                    "ratio_log2": math.log2(abs(product) / abs(d))}
        probes.append(probe)
    return probes


def experiments() -> dict[str, tuple[list[Probe], bool]]:
    """family -> (its probes, whether it accumulates into D)."""
    return {"products": (_products(), False), "alignment": (_alignment(), False),
            "position": (_position(), False), "accumulate": (_accumulate(), True)}


def compile_probe(arch: str = "sm_90a"):
    """The probe kernel compiled for ``arch`` (sm_90a: the FP8 warpgroup MMA is Hopper's);
    no GPU needed."""
    if arch != "sm_90a":
        raise ValueError(f"the FP8 warpgroup MMA is sm_90a's, got arch {arch!r}")
    from benchmarks.fp8_wgmma_kernel import Fp8WgmmaProbeKernel
    from fast.device.compile import compiled, frozen

    return compiled(Fp8WgmmaProbeKernel, arch, frozen({}))


def run(probes: list[Probe], accumulate: bool, device="cuda") -> torch.Tensor:
    """The GPU's D ``float32 [P, 64, 8]`` for ``probes``."""
    from cutlass import Int32, Int64

    from fast import backend

    fn = compile_probe("sm_90a")
    a = torch.stack([q.a for q in probes]).contiguous().to(device)
    b = torch.stack([q.b for q in probes]).contiguous().to(device)
    d = torch.stack([q.d for q in probes]).contiguous().to(device)
    out = torch.full_like(d, float("nan"))
    fn(Int64(a.data_ptr()), Int64(b.data_ptr()), Int64(d.data_ptr()), Int64(out.data_ptr()),
       Int32(int(accumulate)), Int32(len(probes)), backend.stream(torch.device(device)))
    torch.cuda.synchronize()
    return out.cpu()


def simulate(probes: list[Probe], accumulate: bool, width: int, d_in_adder: bool = False) -> torch.Tensor:
    """The model the analysis is checked against: per output, the 32 exact products (and D
    where ``d_in_adder``) summed exactly, then truncated toward zero to ``width`` bits
    below the leading bit of the largest term; D (otherwise) added after in FP32 (round to
    nearest); the result rounded to FP32."""
    outs = []
    for q in probes:
        a, b = q.values()
        res = torch.zeros(ROWS, COLS, dtype=torch.float32)
        for m in range(ROWS):
            for n in range(COLS):
                terms = [float(a[m, k] * b[n, k]) for k in range(KS)]
                if accumulate and d_in_adder:
                    terms.append(float(q.d[m, n]))
                big = max((abs(t) for t in terms), default=0.0)
                total = math.fsum(terms)
                if big > 0:
                    quantum = 2.0 ** (math.floor(math.log2(big)) - width)
                    total = math.trunc(total / quantum) * quantum
                if accumulate and not d_in_adder:
                    total = float(torch.tensor(total, dtype=torch.float32)) + float(q.d[m, n])
                res[m, n] = total
        outs.append(res)
    return torch.stack(outs)


def _lost(exact: float, got: float) -> str | None:
    if got == exact:
        return None
    return "toward_zero" if abs(got) < abs(exact) and got * exact >= 0 else "other"


def lowest_bit(x: float) -> int:
    """The exponent of ``x``'s lowest set bit (``x`` a non-zero double): 1.5 -> -1."""
    num, den = abs(x).as_integer_ratio()
    return (num & -num).bit_length() - 1 - (den.bit_length() - 1)


def leading_bit(x: float) -> int:
    """The exponent of ``x``'s leading bit (``x`` non-zero): 1.5 -> 0, 448 -> 8."""
    return math.frexp(abs(x))[1] - 1


def _width(rows: list[dict], big: str, small: str) -> dict:
    """The bits below the large term's leading bit at which the small term survives: every
    row's distance ``leading_bit(big) - lowest_bit(small)``; ``at_least`` the largest
    distance of a surviving small term, ``below`` the smallest of a lost one (None when none
    was lost); ``width`` the two agreeing (``below == at_least + 1``), else None."""
    kept = [leading_bit(r[big]) - lowest_bit(r[small]) for r in rows if r["got"] == r["exact"]]
    lost = [leading_bit(r[big]) - lowest_bit(r[small]) for r in rows if r["got"] != r["exact"]]
    at_least = max(kept, default=None)
    below = min(lost, default=None)
    width = at_least if below is not None and at_least is not None and below == at_least + 1 \
        else None
    return {"at_least": at_least, "below": below, "width": width}


def analyze(results: dict[str, torch.Tensor], families=None) -> dict:
    """What the outputs of each family say (the module docstring): ``results`` maps a
    family to its ``[P, 64, 8]`` outputs, in ``experiments()``'s probe order.

    ``alignment`` and ``accumulate`` give ``{"at_least", "below", "width"}`` (``_width``:
    the small term survives at ``leading_bit(large) - lowest_bit(small) <= width``) and how
    the lost ones went (``"toward_zero"``, ``"other"``, ``"mixed"``, None: none lost)."""
    families = families or experiments()
    summary = {}
    for family, (probes, accumulate) in families.items():
        got = results[family]
        rows = []
        for i, q in enumerate(probes):
            exact = q.exact(accumulate)
            for m in range(ROWS):
                for n in range(COLS):
                    if q.meta[m][n] is not None:
                        rows.append(dict(q.meta[m][n], exact=float(exact[m, n]),
                                         got=float(got[i, m, n])))
        summary[family + "_rows"] = rows
        if family == "products":
            summary["products_exact"] = all(r["got"] == r["exact"] for r in rows)
        elif family in ("alignment", "accumulate"):
            big, small = ("big", "small") if family == "alignment" else ("d", "product")
            kinds = {_lost(r["exact"], r["got"]) for r in rows} - {None}
            summary[family] = dict(_width(rows, big, small),
                                   lost=None if not kinds else kinds.pop() if len(kinds) == 1
                                   else "mixed")
        elif family == "position":
            by_ratio = {}
            for r in rows:
                by_ratio.setdefault(-r["ratio_log2"], set()).add(r["got"] == r["exact"])
            summary["position_dependent"] = any(len(v) > 1 for v in by_ratio.values())
            summary["position_kept"] = {str(k): sorted(v) for k, v in sorted(by_ratio.items())}
    return summary


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="fp8_wgmma_probe.json")
    args = ap.parse_args(argv)
    fams = experiments()
    results = {name: run(probes, acc) for name, (probes, acc) in fams.items()}
    summary = analyze(results, fams)
    summary["device"] = torch.cuda.get_device_name()
    summary["torch"] = torch.__version__
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    for key in ("products_exact", "alignment", "position_dependent", "position_kept",
                "accumulate"):
        print(f"{key}: {summary.get(key)}")


if __name__ == "__main__":
    main()
