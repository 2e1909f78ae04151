"""A model of one wide (S2, TP) rank's layer time at TP8 and TP16 on an NVLink domain, from
the measured per-stage times of one virtual TP8 rank and the measured peer bandwidth (no
GPU needed)::

    python -m benchmarks.wide_model          # the committed H200 results; prints the markdown
                                             # and writes results/models/wide_model.md
    python -m benchmarks.wide_model --wide A.json --experts B.json --peers C.json --out ''

Inputs (each a committed result JSON; the dimensions from ``model.config``):

* ``--wide``: ``benchmarks.wide_table`` over 8 virtual TP ranks on one H200
  (``results/models/h200_tp8_v10_listed.json``): rank 0's median time per stage (shared, front,
  publish, route, experts, finalize, latent, hidden), its whole step (``rank``), the
  touched experts and the read bandwidth of the run, for T = 65..1024 rows;
* ``--experts``: ``benchmarks.experts_table`` (``results/models/h200_engine_v14_all.json``):
  the engine alone on a TP8 rank, uniform routing (the engine fit's other two points);
* ``--peers``: ``benchmarks.dep_peer_table`` on two H200s
  (``results/h200/two-gpu-dep2.json``): the peer write and read bandwidth over NVLink
  (``peer_gbs``; a symmetric-memory probe measured 390 / 372 GB/s the same way,
  ``docs/ledger.md``).

Bytes per rank and stage at ``N`` ranks and ``T`` rows (:func:`stage_bytes`; BF16 2 bytes,
FP32 4, an MXFP4 expert ``3 I L (1/2 + 1/32)`` bytes with its scales), from the schedule
(``fast.schedules.wide``, ``fast.schedules.wide_kernels``, ``fast.schedules.wide_peer``):

* local stages, every byte in the rank's own HBM:
  ``shared`` (side stream) ``6 S H / N`` weights + ``T (4 H + 12 S / N)`` activations;
  ``front`` ``(E + L) H 2 / N`` + ``T 2 H`` + ``T (E + L) 4 / N``;
  ``route`` (poll, copy out, re-arm, router, MXFP8 plan, and the engine's BF16 plan rows
  and routing-list appends) and ``finalize`` (every pair's full-``L`` partial row) the
  same bytes at every ``N``;
  ``experts`` ``touched I L 3 (1/2 + 1/32) / N`` (the rank's slice of every touched
  expert) + ``T K L 2`` (FC2 writes a full-``L`` BF16 partial row per pair at every ``N``);
* communication stages: what a real rank moves over NVLink (``remote``), what stays in its
  HBM (``local``), and what the virtual measurement moved in one HBM (``virtual``: the
  peers' copies are local there). With ``row = 4 E / N + 2 L / N`` (the rank's logits and
  latent slice of one mailbox row):

  ======== =========================================== ================================
  stage    remote (per rank)                           local
  ======== =========================================== ================================
  publish  ``(N-1) T row`` written (peer stores)        front read ``T (E+L) 4/N`` + own
                                                        mailbox ``T row``
  latent   ``(N-1) T L 2`` read (one-shot all-reduce:   own partial ``T L 2``, routed and
           every rank reads every partial)             normed ``2 T L 2``, the up columns
                                                        ``H L 2/N + T L 2 + 2 T H 2/N``
  hidden   ``(N-1) T H 2`` read (one-shot)              own partial ``T H 2``, out ``T H 2``
  ======== =========================================== ================================

  ``virtual = local + remote`` (every rank's copy or partial on the one GPU).

The model, per stage ``s`` with ``t8`` its measured virtual TP8 time at ``T``::

    a_s      = the intercept of the least-squares line t8 = a + b * virtual_bytes(8, T)
               over the five rows, clamped to [0, min t8]     (the stage's fixed cost)
    local    : t(N) = a_s + (t8 - a_s) * bytes(N) / bytes(8)
    comm     : t(N) = a_s + (t8 - a_s) * local(N) / virtual(8) + remote(N) / peer_gbs
    experts  : local, with a_s = a the engine's fixed cost: the least-squares line
               t = a + limit / f1 (limit = the engine's bytes at the run's read bandwidth)
               through the TP8 rows at one window and <= 128 rows (65 and 128 rows of both
               files); 256 rows are left out (a line through them has a negative fixed
               cost: the engine's time grows faster than its touched bytes once experts
               hold more than 8 tokens and take a second pass)
    side     = (rank8 - sum of main stages at TP8) * shared(N) / shared8
    layer    = front + publish + route + experts + finalize + latent + hidden + side

so at TP8 with the peer traffic kept local (``predict(8, T, virtual=True)``) every stage
and the rank are the measured ones; ``(t8 - a_s) / bytes(8)`` is the stage's measured cost
per byte at that row (the engine's: its streaming fraction under that row's routing, which
a TP16 rank sees too: the routing does not depend on ``N``). The virtual measurement does
not separate the copies that stand in for peer traffic from the local work of a stage;
the model gives the peers' share of the stage's local cost to the NVLink term, and bounds
it: ``low = a_s + max((t8 - a_s) local / virtual, remote / peer_gbs)`` (the transfer
overlaps the local work), ``high = a_s + (t8 - a_s) virtual(N) / virtual(8) + remote /
peer_gbs`` (none of the virtual time was the peers' copies, nothing overlaps).

Assumptions (none measured): each GPU's NVLink bandwidth to ``N - 1`` peers at once is the
measured pair bandwidth (both directions busy, as in the pair measurement); TP16 needs a
16-GPU NVLink domain with that per-GPU bandwidth (an 8-GPU H200 board has none); every
rank's routing is the TP8 run's (same tokens, same router, so the same touched experts);
the shared expert on the side stream costs the main stream in proportion to its own time;
GEMM stages scale with their bytes (their FLOPs halve too, their ``x`` reads do not).
Not modelled: the skew between ranks (a poll or a wait holds a rank until its slowest
peer), the signal/wait pairs of the two all-reduces (two system-scope flag round trips
per call), NVLink load latency beyond the virtual stage's fixed cost, the plan rows and
the FC1->FC2 intermediate the engine reads (L2-resident or small beside its weights).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from model.config import LatentMoEConfig

RESULTS = Path(__file__).resolve().parent / "results"
#: the runs the model is fitted on (``benchmarks/results/README.md``)
DEFAULTS = dict(wide=RESULTS / "models" / "h200_tp8_v10_listed.json",
                experts=RESULTS / "models" / "h200_engine_v14_all.json",
                peers=RESULTS / "h200" / "two-gpu-dep2.json")
OUT = RESULTS / "models" / "wide_model.md"
CONFIG = LatentMoEConfig.kimi_k3()
#: the measured TP8 rank
MEASURED_RANKS = 8
#: main-stream stages in order (``shared`` runs on the side stream)
MAIN = ("front", "publish", "route", "experts", "finalize", "latent", "hidden")
LOCAL = ("shared", "front", "route", "experts", "finalize")
COMM = {"publish": "write", "latent": "read", "hidden": "read"}
#: the engine fit uses the TP8 rows at one window up to this many rows
ENGINE_FIT_ROWS = 128


def expert_bytes(c: LatentMoEConfig = CONFIG) -> int:
    """Bytes of one MXFP4 expert: w13 ``[2I, L]`` and w2 ``[L, I]`` at half a byte per
    value plus one E8M0 scale per 32."""
    return 3 * c.intermediate * c.latent // 2 + 3 * c.intermediate * c.latent // 32


def dense_bytes(n: int, c: LatentMoEConfig = CONFIG) -> int:
    """One rank's dense weight slices (``benchmarks.wide_table``'s byte limit): router and
    latent-down rows, the shared expert's gate/up and down slices, the up-projection rows."""
    h, l, e, s = c.hidden, c.latent, c.experts, c.shared_intermediate
    return ((e + l) * h * 2 + 6 * s * h + 2 * h * l) // n


def limit_bytes(n: int, touched: int, c: LatentMoEConfig = CONFIG) -> int:
    """The byte limit's bytes of one rank: its dense slices and the ``1/N`` slice of every
    touched expert."""
    return dense_bytes(n, c) + touched * expert_bytes(c) // n


def stage_bytes(n: int, t: int, touched: int, c: LatentMoEConfig = CONFIG) -> dict:
    """``{stage: {"local", "remote", "virtual"}}`` bytes of one rank at ``n`` ranks and ``t``
    rows (module docstring)."""
    h, l, e, k, s = c.hidden, c.latent, c.experts, c.top_k, c.shared_intermediate
    local = {
        "shared": 6 * s * h / n + t * (4 * h + 12 * s / n),
        "front": (e + l) * h * 2 / n + t * 2 * h + t * (e + l) * 4 / n,
        "route": t * (3 * (2 * l + 4 * e) + 4 * e + 8 * k + 2 * l + l + l / 32 + 2 * l + 4 * k),
        "experts": touched * expert_bytes(c) / n + t * k * l * 2,
        "finalize": t * k * l * 2 + t * k * 4 + t * l * 2,
    }
    row = 4 * e / n + 2 * l / n
    comm_local = {"publish": t * (e + l) * 4 / n + t * row,
                  "latent": 3 * t * l * 2 + h * l * 2 / n + t * l * 2 + 2 * t * h * 2 / n,
                  "hidden": 2 * t * h * 2}
    remote = {"publish": (n - 1) * t * row, "latent": (n - 1) * t * l * 2,
              "hidden": (n - 1) * t * h * 2}
    out = {name: {"local": b, "remote": 0.0, "virtual": b} for name, b in local.items()}
    for name in COMM:
        out[name] = {"local": comm_local[name], "remote": remote[name],
                     "virtual": comm_local[name] + remote[name]}
    return out


def two_shot_bytes(n: int, t: int, c: LatentMoEConfig = CONFIG) -> dict:
    """Peer bytes one rank would move in a two-shot all-reduce (reduce-scatter of ``T/N``
    rows, then all-gather): ``2 (N-1)/N`` of one partial row per row (for comparison only;
    the schedule's all-reduces are one-shot)."""
    return {"latent": 2 * (n - 1) / n * t * c.latent * 2,
            "hidden": 2 * (n - 1) / n * t * c.hidden * 2}


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """``(intercept, slope)`` of the least-squares line through ``points``."""
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    slope = (sum((x - mx) * (y - my) for x, y in points)
             / sum((x - mx) ** 2 for x, _ in points))
    return my - slope * mx, slope


def engine_points(wide: dict, experts: dict) -> list[dict]:
    """The TP8 engine rows the fit uses: one window (``rows * K / E <= 8``) and at most
    ``ENGINE_FIT_ROWS`` rows, from the wide table (its experts stage, the layer's routing)
    and the experts table (the engine alone, uniform routing); ``limit_us`` is the engine's
    bytes (:func:`stage_bytes`) at the read bandwidth of the file's own run."""
    c, out = CONFIG, []
    rows = [(wide, case["tokens"], case["touched"], case["median_us"]["experts"], "wide")
            for case in wide["cases"]]
    rows += [(experts, case["rows"], case["touched"], case["median_us"]["engine"], "experts")
             for case in experts["cases"] if case["mode"] == "tp8"]
    for src, t, touched, us, name in rows:
        if t <= ENGINE_FIT_ROWS and t * c.top_k / c.experts <= 8:
            nbytes = stage_bytes(MEASURED_RANKS, t, touched)["experts"]["local"]
            out.append({"file": name, "rows": t, "touched": touched, "us": us,
                        "limit_us": nbytes / (src["read_gbs"] * 1e3)})
    return out


class WideModel:
    """The model of the module docstring over the three result files."""

    def __init__(self, wide: dict, experts: dict, peers: dict):
        if wide["ranks"] != MEASURED_RANKS:
            raise ValueError(f"wide_model: the stage times must be of a TP{MEASURED_RANKS} rank, "
                             f"got {wide['ranks']} ranks")
        self.read_gbs = wide["read_gbs"]
        self.peer_gbs = dict(peers["peer_gbs"])
        self.cases = {c["tokens"]: c for c in wide["cases"]}
        self.rows = sorted(self.cases)
        # the engine: fixed cost a and one-window streaming fraction f1
        self.engine_points = engine_points(wide, experts)
        a, slope = _line([(p["limit_us"], p["us"]) for p in self.engine_points])
        self.engine_cost_us, self.engine_f1 = a, 1 / slope
        # every other stage: the intercept of its line against its virtual bytes
        self.fixed_us, self.stage_gbs = {"experts": self.engine_cost_us}, {}
        for name in ("shared",) + MAIN:
            pts = [(stage_bytes(MEASURED_RANKS, t, c["touched"])[name]["virtual"],
                    c["median_us"][name]) for t, c in self.cases.items()]
            a, slope = _line(pts)
            self.stage_gbs[name] = 1 / slope / 1e3
            if name != "experts":
                self.fixed_us[name] = min(max(a, 0.0), min(y for _, y in pts))

    def measured(self, t: int) -> dict:
        return self.cases[t]["median_us"]

    def predict(self, ranks: int, tokens: int, virtual: bool = False) -> dict:
        """Per-stage times (us) of one rank of ``ranks`` at a measured row count ``tokens``
        (``virtual``: the peers' traffic kept local, as in the measurement), with ``low`` /
        ``high`` bounds of the layer, ``nvlink_us`` (the peer bytes at the peer bandwidth),
        ``remote`` (peer bytes per stage) and ``limit_us`` (the byte limit)."""
        n, t = ranks, tokens
        case = self.cases[t]
        m = case["median_us"]
        b_n = stage_bytes(n, t, case["touched"])
        b_8 = stage_bytes(MEASURED_RANKS, t, case["touched"])
        out, low, high, link = {}, {}, {}, 0.0
        for name in ("shared",) + MAIN:
            a, t8 = self.fixed_us[name], m[name]
            per_byte = (t8 - a) / b_8[name]["virtual"]
            if name in COMM and not virtual:
                peer = b_n[name]["remote"] / (self.peer_gbs[COMM[name]] * 1e3)
                local = per_byte * b_n[name]["local"]
                out[name] = a + local + peer
                low[name] = a + max(local, peer)
                high[name] = a + per_byte * b_n[name]["virtual"] + peer
                link += peer
            else:
                out[name] = low[name] = high[name] = a + per_byte * b_n[name]["virtual"]
        main8 = sum(m[name] for name in MAIN)
        side = (m["rank"] - main8) * out["shared"] / m["shared"]
        out["side"] = side
        out["layer"] = sum(out[name] for name in MAIN) + side
        out["low"] = sum(low[name] for name in MAIN) + side
        out["high"] = sum(high[name] for name in MAIN) + side
        out["nvlink_us"] = link
        out["remote"] = {name: b_n[name]["remote"] for name in COMM}
        out["touched"] = case["touched"]
        out["limit_us"] = limit_bytes(n, case["touched"]) / (self.read_gbs * 1e3)
        return out


def _shown(path) -> str:
    """A result file's path as the docs name it: from the repository root where it is
    inside the repository, else as given."""
    path = Path(path).resolve()
    root = RESULTS.parent.parent
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def render(model: WideModel, ranks=(8, 16), inputs: dict | None = None) -> str:
    """The model's markdown: its inputs (``inputs``, the files it was loaded from; default
    ``DEFAULTS``), the engine fit and its points, the byte counts and the TP8/TP16
    predictions."""
    names = {k: _shown(v) for k, v in {**DEFAULTS, **(inputs or {})}.items()}
    pw, pr = model.peer_gbs["write"], model.peer_gbs["read"]
    lines = [
        f"Inputs: `{names['wide']}` (one virtual TP8 rank, read "
        f"bandwidth {model.read_gbs:.0f} GB/s), `{names['experts']}` (the engine's TP8 rows), "
        f"`{names['peers']}` (NVLink peer write {pw:.0f} GB/s, read {pr:.0f} GB/s); "
        "dimensions from `model.config` (kimi_k3). Formulas: `benchmarks/wide_model.py`.",
        "",
        f"Engine fit (TP8, one window, <= {ENGINE_FIT_ROWS} rows): fixed cost "
        f"{model.engine_cost_us:.1f} us, streaming fraction {model.engine_f1:.2f} of the read "
        "bandwidth. Its points:", "",
        "| file | rows | touched | limit us | measured us | fit us |", "|---|---|---|---|---|---|"]
    for p in model.engine_points:
        fit = model.engine_cost_us + p["limit_us"] / model.engine_f1
        lines.append(f"| {p['file']} | {p['rows']} | {p['touched']} | {p['limit_us']:.1f} | "
                     f"{p['us']:.1f} | {fit:.1f} |")
    lines += ["", "Stage fits (least-squares line of the TP8 time against the stage's bytes "
              "on the virtual rank over the five rows; the fixed cost is its intercept "
              "clamped to [0, min time]; the engine's fixed cost is the fit above):", "",
              "| stage | fixed us | GB/s of the line |", "|---|---|---|"]
    for name in ("shared",) + MAIN:
        if name != "experts":
            lines.append(f"| {name} | {model.fixed_us[name]:.1f} | "
                         f"{model.stage_gbs[name]:.0f} |")
    lines += ["", "Check: the model at TP8 with the peers' traffic kept local against the "
              "measured virtual rank:", "", "| rows | measured rank us | model us |",
              "|---|---|---|"]
    for t in model.rows:
        lines.append(f"| {t} | {model.measured(t)['rank']:.1f} | "
                     f"{model.predict(MEASURED_RANKS, t, virtual=True)['layer']:.1f} |")
    lines += ["", "Peer bytes per rank and call (MB: publish written, latent and hidden "
              "all-reduces read; one-shot all-reduces):", "",
              "| rows | " + " | ".join(f"TP{n} publish / latent / hidden" for n in ranks) + " |",
              "|---|" + "---|" * len(ranks)]
    for t in model.rows:
        cells = []
        for n in ranks:
            r = model.predict(n, t)["remote"]
            cells.append(" / ".join(f"{r[s] / 1e6:.1f}" for s in COMM))
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    n, t = max(ranks), max(model.rows)
    one, two = two_shot_bytes(n, t), model.predict(n, t)["remote"]
    lines += ["", f"A two-shot all-reduce (reduce-scatter, then all-gather: 2 (N-1)/N of one "
              f"partial row per row) would move {one['latent'] / 1e6:.1f} MB (latent) and "
              f"{one['hidden'] / 1e6:.1f} MB (hidden) per TP{n} rank at {t} rows instead of "
              f"{two['latent'] / 1e6:.1f} and {two['hidden'] / 1e6:.1f} MB (bytes only: not "
              "a modelled stage)."]
    for n in ranks:
        lines += ["", f"Predicted TP{n} rank (us), the TP8 run's routing; model (low - high), "
                  "the byte limit at the read bandwidth and the model's fraction of it, the "
                  "peer bytes at the peer bandwidth:", "",
                  "| rows | touched | limit us | model us (low - high) | fraction | NVLink us | "
                  "front / publish / route / experts / finalize / latent / hidden / side |",
                  "|---|---|---|---|---|---|---|"]
        for t in model.rows:
            p = model.predict(n, t)
            stages = " / ".join(f"{p[s]:.0f}" for s in MAIN + ("side",))
            lines.append(f"| {t} | {p['touched']} | {p['limit_us']:.1f} | **{p['layer']:.0f}** "
                         f"({p['low']:.0f} - {p['high']:.0f}) | {p['limit_us'] / p['layer']:.2f} "
                         f"| {p['nvlink_us']:.0f} | {stages} |")
    return "\n".join(lines) + "\n"


def load(paths: dict | None = None) -> WideModel:
    paths = {**DEFAULTS, **(paths or {})}
    return WideModel(**{name: json.loads(Path(p).read_text()) for name, p in paths.items()})


def main(argv=None):
    ap = argparse.ArgumentParser()
    for name, path in DEFAULTS.items():
        ap.add_argument(f"--{name}", default=str(path))
    ap.add_argument("--out", default=str(OUT), help="where to write the markdown ('' for nowhere)")
    args = ap.parse_args(argv)
    inputs = {name: getattr(args, name) for name in DEFAULTS}
    text = render(load(inputs), inputs=inputs)
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
