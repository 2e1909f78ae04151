"""The ``contract`` fixture's object: every comparison a contract makes goes through it, so
the summary table knows the worst ULP, the worst bound ratio and the routing flips of each
row (``verify.report``)."""

from __future__ import annotations

import torch

from verify import compare
from verify.report import Row
from verify.routing import RoutingComparison


class Recorder:
    """Compares through ``verify.compare`` and records the figures into one report row."""

    def __init__(self, row: Row):
        self.row = row

    def bitwise(self, actual: torch.Tensor, expected: torch.Tensor, *, what: str,
                index_names: tuple[str, ...] | None = None) -> compare.CompareResult:
        """Equal bytes: the bitwise contract (``verify.compare.assert_bitwise_equal``)."""
        result = compare.assert_bitwise_equal(actual, expected, what=what,
                                              index_names=index_names)
        self.row.add_comparison("bitwise", worst_ulp=result.worst_ulp)
        return result

    def within_ulp(self, actual: torch.Tensor, expected: torch.Tensor, *, max_ulp: int,
                   what: str, reason: str,
                   index_names: tuple[str, ...] | None = None) -> compare.CompareResult:
        """At most ``max_ulp`` representable values apart; ``reason`` says where the ULP
        allowance comes from (it is shown in the report)."""
        result = compare.assert_within_ulp(actual, expected, max_ulp=max_ulp, what=what,
                                           index_names=index_names)
        self.row.add_comparison("ulp", worst_ulp=result.worst_ulp, bound=reason)
        if result.ulp_histogram:
            off = sum(n for d, n in result.ulp_histogram.items() if d)
            self.row.add_figure("ulp_off_fraction", off / max(result.elements, 1), worst="max")
        return result

    def bounded(self, actual: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor, *,
                what: str, bound_name: str,
                index_names: tuple[str, ...] | None = None) -> compare.CompareResult:
        """``|actual - exact| <= bound`` elementwise with a bound derived from the operands
        (``verify.bounds``); ``bound_name`` names the derivation in the report."""
        result = compare.assert_within_bound(actual, exact, bound, what=what,
                                             index_names=index_names)
        self.row.add_comparison("bound", worst_ratio=result.worst_ratio, bound=bound_name)
        return result

    def routing(self, comparison: RoutingComparison) -> RoutingComparison:
        """Record a routing comparison: raises if any difference is not explained by the
        logits' error bound, else counts the accepted flips."""
        comparison.check()
        self.row.flips += comparison.flips
        self.row.decisions += comparison.decisions
        return comparison

    def figure(self, name: str, value: float, *, worst: str = "min") -> None:
        """A tracked figure (e.g. SQNR in dB); the row keeps the worst over its cases."""
        self.row.add_figure(name, float(value), worst=worst)

    def not_applicable(self, name: str) -> None:
        """Mark a figure that is 0 by construction for this row (e.g. the reference's share
        of bits off the reference): the report shows ``n/a``, not a figure that cannot
        move."""
        self.row.add_figure(name, None, worst="max")
