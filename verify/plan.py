"""What ``pytest verify/`` would run on a node of another architecture, decided here.

    python -m verify.plan --arch sm_100a            # a GB200 / B200 node
    python -m verify.plan --arch sm_103a            # a GB300 / B300 node
    python -m verify.plan --arch sm_90a --world-size 2   # torchrun over two H200s
    python -m verify.plan --arch cpu --skipped      # only what a CPU machine skips

The suite is collected in this process (pytest's own collection, the selection of
backends and the markers of ``verify/conftest.py``), and every condition under which a
contract skips is evaluated for the target instead of this machine:

* the hardware markers (``gpu``, ``sm90``, ``sm100``, ``multi_gpu``):
  :func:`hardware_skip_reason`, which ``verify/conftest.py`` itself applies to this
  machine, so the plan and a run cannot disagree about them;
* the backend's availability (the ``backend`` fixture): a GPU backend on a machine
  without one, and the fast backend's targets (``fast.backend.TARGETS``);
* the skips a test body takes at run time (``pytest.skip`` / ``pytest.importorskip`` in
  ``verify/test_*.py``): :data:`RUNTIME_SKIPS` holds one evaluation per function that
  calls them, and ``tests/test_verify_plan.py`` fails when a function calls one that the
  plan does not evaluate.

Each skip is put in a category: ``no-gpu`` (a GPU contract on a target without a GPU),
``hardware`` (more processes or GPUs than the run has, or an instruction the target lacks:
``wgmma`` is sm_90a's), ``package`` (a package the node must have: FlashInfer),
``by-design`` (skipped on every machine, e.g. the reference backend at the real
dimensions), and ``node`` (decided only where it runs: an external backend's own
``available()``). For the schedule contracts (DEP and wide, virtual and real ranks) the
plan names the experts engine the layer builds on the target
(``fast.experts.select.engine_name_for``).

What the plan cannot see: a contract that fails; and the reason of a skip taken by code
outside ``verify/test_*.py`` bodies and the fixtures (a backend that claims no such stage:
``verify.backends.UnderTest.claim``, which is the same on every machine).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import io
import json
import sys
from pathlib import Path

VERIFY_DIR = Path(__file__).resolve().parent
ROOT = VERIFY_DIR.parent

#: The targets a plan is made for: an architecture's device capability (None: no GPU).
CAPABILITIES = {"sm_90a": (9, 0), "sm_100a": (10, 0), "sm_103a": (10, 3), "cpu": None}

#: The skip categories (module docstring), in the order the summary lists them.
CATEGORIES = ("no-gpu", "hardware", "package", "by-design", "node")

#: The contract files of the schedules, and the schedule each builds (its experts engine
#: is named in the plan).
SCHEDULE_FILES = {"test_dep_fast.py": "dep", "test_dep_peer.py": "dep",
                  "test_wide_fast.py": "wide", "test_wide_peer.py": "wide"}


def hardware_skip_reason(item, capability, world_size: int) -> str | None:
    """The skip reason of ``item``'s hardware markers on a machine of device
    ``capability`` ((major, minor), None without a GPU) in a run of ``world_size``
    processes, None when it runs: ``gpu``, ``sm90``, ``sm100`` and ``multi_gpu(n)``
    (default 2 processes launched with torchrun)."""
    if item.get_closest_marker("gpu") and capability is None:
        return "needs a CUDA GPU; this machine has none"
    if item.get_closest_marker("sm90") and capability != (9, 0):
        return f"needs an SM90 (Hopper) GPU; device capability is {capability}"
    if item.get_closest_marker("sm100") and (capability is None or capability[0] != 10):
        return f"needs an SM100/SM103 (Blackwell) GPU; device capability is {capability}"
    marker = item.get_closest_marker("multi_gpu")
    if marker:
        need = marker.args[0] if marker.args else 2
        if world_size < need:
            return (f"needs {need} processes launched with torchrun (WORLD_SIZE={world_size}); "
                    "see docs/verify.md")
    return None


@dataclasses.dataclass
class Target:
    """The machine a plan is for: its arch (``cpu``: no GPU) and the run's processes."""

    arch: str
    world_size: int = 1

    @property
    def capability(self):
        return CAPABILITIES[self.arch]

    @property
    def gpu(self) -> bool:
        return self.capability is not None


@dataclasses.dataclass
class Entry:
    """One collected contract case and what the target does with it."""

    nodeid: str
    contract: str
    backend: str
    config: str
    status: str  # "run" or "skip"
    category: str | None = None
    reason: str | None = None
    engine: str | None = None
    ranks: int | None = None

    @property
    def file(self) -> str:
        return self.nodeid.split("::", 1)[0]


# --- the skips a test body takes at run time ---------------------------------------------


def _wgmma_skip(target: Target, tactic) -> tuple[str, str] | None:
    wgmma = tactic.get("wgmma") if isinstance(tactic, dict) else getattr(tactic, "wgmma", False)
    if wgmma and target.arch != "sm_90a":
        return "hardware", f"wgmma is an sm_90a instruction; this GPU is {target.arch}"
    return None


def _real_experts_on_cpu(target: Target, ctx) -> tuple[str, str] | None:
    if ctx.device == "cpu":
        return "no-gpu", ("the real layer's 15 GB of MXFP4 experts are generated only where a "
                          "GPU holds them")
    return None


def _stock_real_dimensions(target: Target, ctx) -> tuple[str, str] | None:
    if ctx.params.get("config_name") != "kimi_k3":
        return None
    if ctx.backend == "reference":
        return "by-design", ("the reference backend runs on the CPU, where the real dimensions' "
                             "float64 GEMMs take minutes; its GEMM code is checked at small")
    if ctx.device == "cpu":
        return "no-gpu", "the real dimensions run on a GPU only"
    return None


def _stock_no_split_k(target: Target, ctx) -> tuple[str, str] | None:
    if ctx.device != "cuda":
        return "no-gpu", ("split_k=False is cuBLASLt's flag; the CPU BLAS is not what the stock "
                          "invariant modes run")
    return None


def _small_tp_ranks(target: Target, ctx) -> tuple[str, str] | None:
    from model.config import LatentMoEConfig

    if target.world_size > 1 and not LatentMoEConfig.small().supports_ranks(target.world_size):
        return "hardware", f"the small config does not split over {target.world_size} TP ranks"
    return None


def _flashinfer_comm(target: Target, ctx) -> tuple[str, str] | None:
    if target.capability is not None and target.capability[0] not in (9, 10, 12):
        return "hardware", (f"FlashInfer's all-reduce JIT modules target majors 9, 10, 12; "
                            f"this GPU is {target.arch}")
    return "package", "runs where flashinfer.comm imports and builds its JIT module"


def _flashinfer_installed(target: Target, ctx) -> tuple[str, str] | None:
    return "package", "runs where FlashInfer is installed (pip install flashinfer-python)"


def _trtllm_peer(target: Target, ctx) -> tuple[str, str] | None:
    return "package", ("runs where FlashInfer 0.7.2.post1 and its trtllm-gen cubins are installed "
                       "(flashinfer-cubin or FLASHINFER_CUBIN_DIR; benchmarks.peers.trtllm_moe.available() "
                       "on the node) and, at the real dimensions, 6 GiB of GPU memory are free")


@dataclasses.dataclass
class _Context:
    params: dict
    backend: str
    device: str
    call_args: dict  # helper name -> source of its first argument in the test body


def _helper_wgmma(target: Target, ctx: _Context) -> tuple[str, str] | None:
    source = ctx.call_args.get("_skip_unless_wgmma")
    try:
        tactic = eval(source, {"dict": dict}, dict(ctx.params))  # noqa: S307 (a test's own text)
    except NameError:
        return "hardware", "wgmma tactics are sm_90a's (skipped elsewhere)"
    return _wgmma_skip(target, tactic or {})


def _gemm_tactic(target: Target, ctx: _Context) -> tuple[str, str] | None:
    return _wgmma_skip(target, ctx.params.get("tactic"))


def _sm90a_only(target: Target, ctx: _Context) -> tuple[str, str] | None:
    if target.arch != "sm_90a":
        return "hardware", f"wgmma is an sm_90a instruction; this GPU is {target.arch}"
    return None


def _wide_invariant_mma(target: Target, ctx: _Context) -> tuple[str, str] | None:
    if ctx.params.get("mma") == "wgmma" and target.arch != "sm_90a":
        return "hardware", (f"wgmma is an sm_90a instruction (invariant_mma='wgmma'); this "
                            f"GPU is {target.arch}")
    return None


#: (file, function calling pytest.skip / importorskip) -> its evaluation for a target: a
#: function of (target, context) returning (category, reason) or None (it runs). A helper's
#: skip applies to the tests that call it.
RUNTIME_SKIPS = {
    ("test_experts.py", "_skip_unless_wgmma"): _helper_wgmma,
    ("test_experts.py", "test_experts_stages_real"): _real_experts_on_cpu,
    ("test_gemm_fast.py", "test_gemm_fast_tactic"): _gemm_tactic,
    ("test_gemm_fast.py", "test_gemm_fast_wgmma_overlap_same_bits"): _sm90a_only,
    ("test_wide_fast.py", "_skip_unless_mma_runs"): _wide_invariant_mma,
    ("test_dep_fast.py", "_skip_unless_mma_runs"): _wide_invariant_mma,
    ("test_gemm_fast.py", "test_gemm_fast_wide_rows"): _wide_invariant_mma,
    ("test_gemm_fast.py", "test_gemm_fast_wide_serial_splits"): _wide_invariant_mma,
    ("test_gemm_fast.py", "test_gemm_fast_wide_chunks"): _sm90a_only,
    ("test_gemm_fast.py", "test_gemm_fast_grouped_same_bits"): _wide_invariant_mma,
    ("test_gemm_fast.py", "test_gemm_fast_tiled_same_bits"): _sm90a_only,
    ("test_gemm_fast.py", "test_gemm_fast_tiled_bad_input"): _sm90a_only,
    ("test_stock.py", "_model"): _stock_real_dimensions,
    ("test_stock.py", "test_stock_no_split_k_batch_invariant"): _stock_no_split_k,
    ("test_distributed.py", "test_wide_real_ranks"): _small_tp_ranks,
    ("test_flashinfer_allreduce.py", "fused"): _flashinfer_comm,
    ("test_mx.py", "test_flashinfer_mxfp8_quantize"): _flashinfer_installed,
    ("test_trtllm_moe.py", "_available_or_skip"): _trtllm_peer,
}


def skip_calls(path: Path) -> list[str]:
    """The functions of ``path`` (module level) whose body calls ``pytest.skip`` or
    ``pytest.importorskip``."""
    tree = ast.parse(path.read_text())
    out = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for sub in ast.walk(node):
            if (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute)
                    and isinstance(sub.func.value, ast.Name) and sub.func.value.id == "pytest"
                    and sub.func.attr in ("skip", "importorskip")):
                out.append(node.name)
                break
    return out


def _calls(path: Path) -> dict[str, dict[str, str]]:
    """function name -> {name of a module-level function it calls: source of the call's
    first argument ('' without one)}."""
    tree = ast.parse(path.read_text())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            called = {}
            for sub in ast.walk(node):
                if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name):
                    arg = ast.unparse(sub.args[0]) if sub.args else ""
                    called.setdefault(sub.func.id, arg)
            out[node.name] = called
    return out


def _runtime_skip(target: Target, file: str, function: str, fixtures, calls: dict,
                  ctx: _Context):
    """The first run-time skip on ``target`` of ``function`` of ``file``, of a fixture of
    ``file`` it uses (``fixtures``), or of a function of ``file`` either calls (two levels
    down, as the helpers are), or None."""
    seen, frontier = [], [function] + [f for f in fixtures if f in calls]
    for _ in range(3):
        nxt = []
        for name in frontier:
            if name in seen:
                continue
            seen.append(name)
            nxt += [inner for inner in calls.get(name, {}) if inner in calls]
        frontier = nxt
    for name in seen:
        rule = RUNTIME_SKIPS.get((file, name))
        if rule is not None and (found := rule(target, ctx)):
            return found
    return None


# --- backends and engines ---------------------------------------------------------------


def _backend_skip(target: Target, chosen) -> tuple[str, str] | None:
    """The ``backend`` fixture's skip on ``target`` (``verify.backends.UnderTest``)."""
    if chosen.impl is None:
        return None  # a load error fails the contract (it is not a skip)
    devices = chosen.impl.devices
    if "cpu" not in devices and not target.gpu:
        return "no-gpu", f"backend {chosen.name!r} needs a CUDA GPU and this machine has none"
    if chosen.name == "fast":
        from fast.backend import TARGETS

        if not target.gpu:
            return "no-gpu", "no CUDA device"
        if target.arch not in TARGETS:
            return "hardware", f"kernel targets {'/'.join(TARGETS)}, device is {target.arch}"
        return None
    if not chosen.builtin:
        return "node", f"backend {chosen.name!r}: its available() is evaluated on the node"
    ok, reason = chosen.impl.available()
    return None if ok else ("by-design", str(reason))


def _backend_device(target: Target, chosen) -> str:
    if chosen.impl is None:
        return "cpu"
    for d in chosen.impl.devices:
        if d == "cpu" or target.gpu:
            return d
    return "cpu"


def _wide_ranks(config) -> list[int]:
    """The TP rank counts whose slices the experts engines take (``I/N % 64``)."""
    return [n for n in (1, 2, 4, 8, 16)
            if config.intermediate % n == 0 and (config.intermediate // n) % 64 == 0]


#: The wide contracts' widened small configs (``verify/test_wide_fast.py``'s SMALL_I1024,
#: and SMALL_S1024 with the shared expert widened too): name -> the fields replaced in
#: ``cases.config("small")``.
WIDENED_SMALL_CONFIGS = {"small_i1024": dict(intermediate=1024),
                         "small_s1024": dict(intermediate=1024, shared_intermediate=1024)}


def contract_config(config_name: str):
    """The ``LatentMoEConfig`` a contract's ``config_name`` parameter names: one of
    ``verify.cases``'s configs, or a widened small one (``WIDENED_SMALL_CONFIGS``)."""
    from verify import cases

    if config_name in WIDENED_SMALL_CONFIGS:
        return dataclasses.replace(cases.config("small"), **WIDENED_SMALL_CONFIGS[config_name])
    return cases.config(config_name)


def engine_of(target: Target, schedule: str, config_name: str, ranks) -> str | None:
    """The experts engine a ``schedule`` layer of ``config_name`` builds on ``target``
    (``ranks``: its TP ranks in the wide schedule, None when the contract picks them in its
    body: the engine per rank count), None off the engines' targets."""
    from fast.experts.select import ENGINE_ARCHS, engine_name_for

    if target.arch not in ENGINE_ARCHS or config_name in ("-", None):
        return None
    config = contract_config(config_name)
    if schedule == "dep":
        return engine_name_for(target.arch, config)
    if ranks is not None:
        return engine_name_for(target.arch, config, (0, int(ranks)))
    names = {n: engine_name_for(target.arch, config, (0, n)) for n in _wide_ranks(config)}
    kinds = sorted(set(names.values()), key=list(names.values()).index)
    if len(kinds) == 1:
        return kinds[0]
    return ", ".join(f"{kind} at TP{'/'.join(str(n) for n, k in names.items() if k == kind)}"
                     for kind in kinds)


# --- the plan ----------------------------------------------------------------------------


class _Collector:
    """A pytest plugin keeping every collected item of the session (after the suite's own
    selection of backends)."""

    def __init__(self):
        self.items = []

    def pytest_collection_finish(self, session):
        self.items = list(session.items)


def collect(args: list[str] | None = None) -> list:
    """The items ``pytest verify/`` collects here (``args``: extra pytest arguments, e.g.
    ``["--backend", "fast"]``)."""
    import pytest

    collector = _Collector()
    quiet = io.StringIO()
    with contextlib.redirect_stdout(quiet):
        code = pytest.main([str(VERIFY_DIR), "--collect-only", "-qq", "-p", "no:cacheprovider",
                            "--rootdir", str(ROOT), *(args or [])], plugins=[collector])
    if code not in (0, 5):  # 5: nothing collected
        raise RuntimeError(f"verify.plan: pytest collection failed (exit {code}):\n"
                           f"{quiet.getvalue()[-4000:]}")
    return collector.items


def plan(arch: str, *, world_size: int = 1, args: list[str] | None = None) -> list[Entry]:
    """Every contract case ``pytest verify/`` would collect on a node of ``arch``, run or
    skipped there with the category and reason (module docstring)."""
    from verify.conftest import row_key

    if arch not in CAPABILITIES:
        raise ValueError(f"verify.plan: arch must be one of {sorted(CAPABILITIES)}, got {arch!r}")
    target = Target(arch, world_size)
    calls_by_file: dict[str, dict] = {}
    entries = []
    for item in collect(args):
        path = Path(str(item.path))
        calls = calls_by_file.setdefault(path.name, _calls(path))
        contract, backend_name, config = row_key(item)
        params = dict(getattr(item, "callspec", None).params) if hasattr(item, "callspec") else {}
        chosen = params.get("backend")
        found = hardware_skip_reason(item, target.capability, world_size)
        skip = None
        if found:
            skip = ("no-gpu" if not target.gpu and "GPU" in found else "hardware", found)
        device = "cpu"
        if skip is None and chosen is not None and hasattr(chosen, "impl"):
            skip = _backend_skip(target, chosen)
            device = _backend_device(target, chosen)
        if skip is None:
            for marker in item.iter_markers("skipif"):
                if marker.args and marker.args[0] is True:
                    skip = ("by-design", str(marker.kwargs.get("reason", "")))
            if item.get_closest_marker("skip"):
                marker = item.get_closest_marker("skip")
                skip = ("by-design", str(marker.kwargs.get("reason", "")))
        if skip is None:
            ctx = _Context(params=params, backend=backend_name, device=device,
                           call_args={name: arg for name, arg in
                                      calls.get(item.originalname, {}).items()})
            skip = _runtime_skip(target, path.name, item.originalname,
                                 getattr(item, "fixturenames", ()), calls, ctx)
        engine = None
        if path.name in SCHEDULE_FILES:
            engine = engine_of(target, SCHEDULE_FILES[path.name], config, params.get("ranks"))
        entries.append(Entry(nodeid=item.nodeid, contract=contract, backend=backend_name,
                             config=config, status="skip" if skip else "run",
                             category=skip[0] if skip else None,
                             reason=skip[1] if skip else None, engine=engine,
                             ranks=params.get("ranks")))
    return entries


def summary(entries: list[Entry]) -> str:
    runs = sum(e.status == "run" for e in entries)
    by = {c: sum(e.category == c for e in entries) for c in CATEGORIES}
    parts = ", ".join(f"{n} {c}" for c, n in by.items() if n)
    return f"{len(entries)} cases: {runs} run, {len(entries) - runs} skipped ({parts or 'none'})"


def format_plan(entries: list[Entry], target: Target, *, skipped_only: bool = False) -> str:
    lines = [f"verify.plan for {target.arch} (WORLD_SIZE={target.world_size}): "
             + summary(entries)]
    engines = sorted({(e.file, e.engine) for e in entries if e.engine})
    if engines:
        lines.append("")
        lines.append("experts engine of the schedule contracts:")
        lines += [f"  {file}: {engine}" for file, engine in engines]
    lines.append("")
    for e in entries:
        if skipped_only and e.status == "run":
            continue
        head = "RUN " if e.status == "run" else f"SKIP [{e.category}]"
        tail = f"  ({e.reason})" if e.reason else ""
        lines.append(f"{head} {e.nodeid}{tail}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m verify.plan",
        description="what `pytest verify/` would run and skip on a node of another arch")
    parser.add_argument("--arch", required=True, choices=sorted(CAPABILITIES),
                        help="the node's architecture (cpu: no GPU)")
    parser.add_argument("--world-size", type=int, default=1,
                        help="processes of the run (torchrun --nproc-per-node); default 1")
    parser.add_argument("--skipped", action="store_true", help="list only the skipped cases")
    parser.add_argument("--json", metavar="PATH", help="also write the plan as JSON")
    parser.add_argument("pytest_args", nargs="*",
                        help="extra pytest arguments after --, e.g. -- --backend fast")
    args = parser.parse_args(argv)
    target = Target(args.arch, args.world_size)
    entries = plan(args.arch, world_size=args.world_size, args=args.pytest_args)
    print(format_plan(entries, target, skipped_only=args.skipped))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"arch": args.arch, "world_size": args.world_size, "summary": summary(entries),
             "cases": [dataclasses.asdict(e) for e in entries]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
