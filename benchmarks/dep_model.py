"""A model of one DEP rank's layer time on an NVLink domain of ``N`` GPUs, from measured
per-stage times and the measured peer bandwidth (no GPU needed)::

    python -m benchmarks.dep_model                      # the committed H200 results
    python -m benchmarks.dep_model --stages A.json --experts B.json --peers C.json

Inputs (each a committed result JSON):

* ``--stages``: ``benchmarks.dep_table`` over 16 virtual ranks: the dense part, dispatch,
  owner partial and home (combine + RMSNorm + up-projection) of one rank, per ``T``;
* ``--experts``: ``benchmarks.experts_table``: the engine's fraction of the byte limit
  against the local pairs per touched expert (DEP16, uniform routing);
* ``--peers``: ``benchmarks.dep_peer_table`` on real ranks: the peer write and read
  bandwidth, and the measured DEP2 rank times the model is checked against.

The model, per rank, uniform routing (``E`` experts, top ``K``, ``L`` latent, ``N*T``
tokens in the domain)::

    touched  = E/N * (1 - (1 - K/E)^(N*T))          local experts with a pair
    windows  = the engine's windows for N*T rows (fast.experts.engine.choose_windows)
    experts  = a + touched * expert_bytes / (read_bw * f[windows])
    dispatch = dispatch16(T) + (N-1) * T * row_bytes / peer_write_bw
    partial  = partial16(N*T/16)                    same received rows as DEP16
    home     = home16(T) + T * (N-1)/N * N(1 - (1-1/N)^K) * 2L / peer_read_bw
    layer    = dense16(T) + dispatch + experts + partial + home

with ``row_bytes = L + L/32 + 8K`` (codes, scales, ids, weights); ``a`` (the engine's
fixed cost: its launches, ramp and tail) and ``f[1]`` (its streaming fraction at one
window) the least-squares line ``time = a + limit / f[1]`` through the DEP16 engine's
one-window points, ``f[2]``, ``f[4]`` the mean ``limit / (time - a)`` of its points at two
and four windows; and ``X16`` a stage of
the virtual DEP16 rank (local buffers) interpolated in log(T). Not modelled: the skew
between ranks (a rank waits for the slowest peer) and the flag round trips (two per call).
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
#: the runs the model is fitted on and checked against (``benchmarks/results/README.md``)
DEFAULTS = dict(stages=RESULTS / "models" / "h200_dep16_v4_rerun.json",
                experts=RESULTS / "models" / "h200_engine_v9_default.json",
                peers=RESULTS / "h200" / "two-gpu-dep2.json")
#: kimi_k3: experts, top-k, latent, bytes of one MXFP4 expert (w13 + w2 with scales)
E, K, L, EXPERT_BYTES = 896, 16, 3584, 17_547_264


def _interp(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear in log(x) through ``points`` (sorted by x), clamped at the ends."""
    xs = [p[0] for p in points]
    if x <= xs[0]:
        return points[0][1]
    if x >= xs[-1]:
        return points[-1][1]
    i = bisect.bisect_right(xs, x)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    a = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return y0 + a * (y1 - y0)


def _extrapolate(points: list[tuple[float, float]], x: float) -> float:
    """As :func:`_interp`, but linear in x beyond the last point (a stage that grows with
    its rows)."""
    if x <= points[-1][0]:
        return _interp(points, x)
    (x0, y0), (x1, y1) = points[-2], points[-1]
    return y1 + (x - x1) * (y1 - y0) / (x1 - x0)


def _windows(rows: int) -> int:
    """The engine's windows for ``rows`` received rows (``choose_windows``'s rule)."""
    tokens = rows * K / E
    return 1 if tokens <= 8 else 2 if tokens <= 16 else 4


def _fit_engine(experts: dict) -> tuple[float, dict[int, float]]:
    """``(a, {windows: f})`` from the DEP16 uniform rows of an experts table (module
    docstring)."""
    points = {1: [], 2: [], 4: []}
    for c in experts["cases"]:
        if c["mode"] == "dep16" and c["skew"] == 0:
            points[_windows(16 * c["size"])].append((c["limit_us"], c["median_us"]["engine"]))
    one = points[1]
    mx = sum(x for x, _ in one) / len(one)
    my = sum(y for _, y in one) / len(one)
    slope = sum((x - mx) * (y - my) for x, y in one) / sum((x - mx) ** 2 for x, _ in one)
    a = my - slope * mx
    fraction = {1: 1 / slope}
    for w in (2, 4):
        fraction[w] = sum(x / (y - a) for x, y in points[w]) / len(points[w])
    return a, fraction


class DepModel:
    """The model of the module docstring over the three result files."""

    def __init__(self, stages: dict, experts: dict, peers: dict):
        self.read_gbs = stages["read_gbs"]
        self.stage = {name: sorted((c["tokens"], c["median_us"][name]) for c in stages["cases"])
                      for name in ("dense", "dispatch", "partial", "home", "rank")}
        self.engine_cost_us, self.stream_fraction = _fit_engine(experts)
        self.write_gbs, self.peer_read_gbs = peers["peer_gbs"]["write"], peers["peer_gbs"]["read"]
        self.measured = {(peers["ranks"], rank["tokens"], r): rank
                         for ranks in peers["per_rank"] for r, rank in enumerate(ranks)}

    def predict(self, ranks: int, tokens: int, touched: float | None = None) -> dict:
        """Per-stage times (us) of one rank of ``ranks`` at ``tokens`` tokens per rank;
        ``touched`` overrides the uniform-routing count of touched local experts."""
        n, t = ranks, tokens
        if touched is None:
            touched = E / n * (1 - (1 - K / E) ** (n * t))
        windows = _windows(n * t)
        row_bytes = L + L // 32 + 8 * K
        owners = n * (1 - (1 - 1 / n) ** K)
        out = {
            "dense": _interp(self.stage["dense"], t),
            "dispatch": _interp(self.stage["dispatch"], t)
            + (n - 1) * t * row_bytes / (self.write_gbs * 1e3),
            "experts": self.engine_cost_us
            + touched * EXPERT_BYTES / (self.read_gbs * 1e3 * self.stream_fraction[windows]),
            "partial": _extrapolate(self.stage["partial"], n * t / 16),
            "home": _interp(self.stage["home"], t)
            + t * (n - 1) / n * owners * 2 * L / (self.peer_read_gbs * 1e3),
        }
        out["layer"] = sum(out.values())
        out["touched"] = touched
        return out


def render(model: DepModel, ranks=(8, 16, 32), tokens=(1, 2, 4, 8, 16, 32, 64)) -> str:
    f = model.stream_fraction
    lines = [f"Engine fit: fixed cost {model.engine_cost_us:.0f} us, streaming fraction "
             f"{f[1]:.2f} / {f[2]:.2f} / {f[4]:.2f} of the read bandwidth at 1 / 2 / 4 windows.",
             "", "Check against the measured DEP2 ranks (model given each rank's measured touched "
             "experts):", "", "| T | rank | touched | measured us | model us | model / measured |",
             "|---|---|---|---|---|---|"]
    for (n, t, r), m in sorted(model.measured.items()):
        p = model.predict(n, t, touched=m["touched"])
        fast = m["median_us"]["fast"]
        lines.append(f"| {t} | {r} | {m['touched']} | {fast:.1f} | {p['layer']:.1f} | "
                     f"{p['layer'] / fast:.2f} |")
    lines += ["", "Predicted rank time (us), uniform routing, NVLink peer bandwidth as measured "
              f"on the H200 pair (write {model.write_gbs:.0f}, read {model.peer_read_gbs:.0f} "
              f"GB/s):", "",
              "| T | " + " | ".join(f"DEP{n} (dense / dispatch / experts / partial / home)"
                                   for n in ranks) + " |",
              "|---|" + "---|" * len(ranks)]
    for t in tokens:
        cells = []
        for n in ranks:
            p = model.predict(n, t)
            cells.append(f"**{p['layer']:.0f}** ({p['dense']:.0f} / {p['dispatch']:.0f} / "
                         f"{p['experts']:.0f} / {p['partial']:.0f} / {p['home']:.0f})")
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser()
    for name, path in DEFAULTS.items():
        ap.add_argument(f"--{name}", default=str(path))
    args = ap.parse_args(argv)
    files = {name: json.loads(Path(getattr(args, name)).read_text()) for name in DEFAULTS}
    print(render(DepModel(**files)), end="")


if __name__ == "__main__":
    main()
