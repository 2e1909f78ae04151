"""External backends through ``pytest verify/``: selected by ``--backend`` and by entry
point, listed in the report with their version, every stage and layer contract reachable,
bad plug-ins failing their own contracts with clear errors while the run completes.

The runs are subprocesses of ``python -m pytest verify/...`` in the repository (report
written to a temporary directory); the backends are ``tests/plugins/`` and
``examples/torchao_mx.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verify import backends
from verify.interface import BITWISE, BOUND, Backend, Claim, own_order

ROOT = Path(__file__).resolve().parents[1]
EXACT = "tests/plugins/reference_plugins.py:Exact"
BOUNDED = "tests/plugins/reference_plugins.py:Bounded"
BAD = "tests/plugins/bad_plugins.py"


def run_verify(tmp_path: Path, *args: str, pythonpath: tuple[Path, ...] = ()):
    """(completed process, the written report or None) of ``pytest *args`` in the
    repository."""
    env = dict(os.environ, LATENTMOE_REPORT_DIR=str(tmp_path), PYTHONDONTWRITEBYTECODE="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *map(str, pythonpath)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    done = subprocess.run([sys.executable, "-m", "pytest", *args, "-q", "-p", "no:cacheprovider"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    path = tmp_path / "verify-report.json"
    return done, (json.loads(path.read_text()) if path.is_file() else None)


def rows_of(report: dict, backend: str) -> dict[tuple[str, str], dict]:
    return {(r["contract"], r["config"]): r for r in report["rows"] if r["backend"] == backend}


def _cases(spec_name: str) -> list[str]:
    """One case of every contract an external backend reaches on this machine."""
    b = spec_name
    return [
        f"verify/test_mx.py::test_quantize_mxfp8[{b}-7-latent-small]",
        f"verify/test_mx.py::test_quantize_mxfp8_swizzled[{b}-129-small]",
        f"verify/test_router.py::test_route[{b}-7-small]",
        f"verify/test_router.py::test_route_ties[{b}-7-small]",
        f"verify/test_activation.py::test_situ_and_mul[{b}-7-routed-small]",
        f"verify/test_finalize.py::test_finalize[{b}-7-small]",
        f"verify/test_norm.py::test_rms_norm[{b}-7-small]",
        f"verify/test_experts.py::test_experts_stages[{b}-small-0-64-shard4-65-0.0]",
        f"verify/test_experts.py::test_experts_batch_invariant_and_order_free[{b}]",
        f"verify/test_stock.py::test_layer_stock[{b}-16]",
        f"verify/test_dep.py::test_layer_dep[{b}-4-7]",
        f"verify/test_wide.py::test_layer_wide[{b}-2-65]",
    ]


def test_external_backends_reach_every_stage_and_layer(tmp_path):
    """The reference behind the interface, once claiming bitwise and once the bound: each
    contract runs (the bound paths too: routing flips, the experts stage by stage on the
    backend's intermediates, the layer's per-token SQNR floor) and passes."""
    done, report = run_verify(tmp_path, *_cases("plugin-exact"), *_cases("plugin-bounded"),
                              "--backend", EXACT, "--backend", BOUNDED)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert report["backends"]["plugin-exact"] | {"claims": None} == {
        "version": "test 1", "source": EXACT, "devices": ["cpu"], "claims": None,
        "layer_ranks": {"layer_stock": [1], "layer_dep": [1, 2, 4, 8, 16],
                        "layer_wide": [1, 2, 4, 8]}}
    exact, bounded = rows_of(report, "plugin-exact"), rows_of(report, "plugin-bounded")
    assert all(r["status"] == "pass" for r in exact.values()), exact
    assert exact[("layer_dep", "small")]["bitwise"] == 8  # 4 ranks: ids and output each
    assert exact[("experts_stages", "small")]["bitwise"] == 1
    # the bound paths: no bitwise comparison of the outputs, a bound, routing decisions
    assert bounded[("quantize_mxfp8_swizzled", "small")]["status"] == "skip"
    assert "does not implement quantize_mxfp8_swizzled" in \
        bounded[("quantize_mxfp8_swizzled", "small")]["skip_reasons"][0]
    assert bounded[("finalize", "small")]["bitwise"] == 0
    assert 0 < bounded[("finalize", "small")]["worst_ratio"] <= 1
    assert bounded[("route", "small")]["decisions"] == 7
    stages = bounded[("experts_stages", "small")]
    assert stages["status"] == "pass" and stages["bitwise"] > 0 and stages["worst_ratio"] <= 1
    for contract in ("layer_stock", "layer_dep", "layer_wide"):
        row = bounded[(contract, "small")]
        assert row["status"] == "pass" and row["decisions"] > 0, row
        assert row["figures"]["token_sqnr_db_min"] > 24, row


def test_bad_backends_fail_their_contracts_and_the_run_completes(tmp_path):
    """An import path that fails, wrong declarations, a wrong dtype or shape, a stage
    that raises: each fails the contracts it was selected for with a message naming the
    backend and what is wrong; the session still prints and writes the summary."""
    specs = ["nonexistent_pkg.kernels:Backend", f"{BAD}:UnknownStage",
             f"{BAD}:ClaimWithoutMethod", f"{BAD}:WrongDtype", f"{BAD}:WrongShape",
             f"{BAD}:Raises"]
    args = [a for spec in specs for a in ("--backend", spec)]
    done, report = run_verify(tmp_path, "verify/test_finalize.py", "verify/test_norm.py",
                              "-k", "7-small", *args)
    out = done.stdout
    assert done.returncode == 1, out[-4000:] + done.stderr[-2000:]
    assert "latentmoe verification summary" in out
    for message in (
            "backend 'nonexistent_pkg.kernels:Backend' could not be loaded: importing "
            "'nonexistent_pkg.kernels' raised ModuleNotFoundError",
            "claims names an unknown stage 'finalise'",
            "backend 'no-method' claims 'rms_norm' but does not define the method rms_norm()",
            "backend 'wrong-dtype': stage finalize returned the output as torch.float32 [7, 256]; "
            "the interface says torch.bfloat16 [7, 256]",
            "backend 'wrong-shape': stage finalize returned the output as torch.bfloat16 "
            "[6, 256]; the interface says torch.bfloat16 [7, 256]",
            "backend 'raises': stage finalize raised RuntimeError: the kernel failed to launch"):
        assert message in out, message
    assert report["backends"]["nonexistent_pkg.kernels:Backend"]["load_error"]
    for name in ("nonexistent_pkg.kernels:Backend", "wrong-dtype", "wrong-shape", "raises"):
        assert rows_of(report, name)[("finalize", "small")]["status"] == "FAIL", name
    # a broken backend fails every contract it was selected for; a working one that lacks
    # the stage skips it
    assert rows_of(report, "nonexistent_pkg.kernels:Backend")[("rms_norm", "small")]["status"] == "FAIL"
    skipped = rows_of(report, "raises")[("rms_norm", "small")]
    assert skipped["status"] == "skip" and "does not implement rms_norm" in skipped["skip_reasons"][0]


def test_entry_point_backend_runs_in_a_plain_session(tmp_path):
    """A package that registers the example under ``latentmoe.backends`` has it selected
    by a plain ``pytest verify/``, its rows in the table and its name, version and entry
    point in the report."""
    site = tmp_path / "site"
    dist = site / "latentmoe_example_backend-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: latentmoe-example-backend\n"
                                   "Version: 1.0\n")
    (dist / "entry_points.txt").write_text("[latentmoe.backends]\n"
                                           "torchao-mx = torchao_mx:TorchaoMX\n")
    done, report = run_verify(tmp_path, "verify/test_mx.py::test_quantize_mxfp8",
                              "verify/test_finalize.py::test_finalize", "-k", "torchao and 7-",
                              pythonpath=(site, ROOT / "examples"))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    about = report["backends"]["torchao-mx"]
    assert about["source"] == "entry point torchao-mx = torchao_mx:TorchaoMX"
    assert about["version"].startswith("torchao "), about
    assert set(report["backends"]) == {"reference", "reference-cuda", "stock", "fast", "torchao-mx"}
    rows = rows_of(report, "torchao-mx")
    assert rows[("quantize_mxfp8", "small")]["status"] == "pass"
    assert rows[("quantize_mxfp8", "small")]["bitwise"] == 6
    assert "does not implement finalize" in rows[("finalize", "small")]["skip_reasons"][0]
    assert "torchao-mx" in done.stdout.split("latentmoe verification summary")[1]


# --- loading and declarations, in process ---------------------------------------------------


class _Quantizer(Backend):
    name = "q"
    claims = {"quantize_mxfp8": BITWISE}

    def quantize_mxfp8(self, x):
        return x, x


def test_builtin_backends_pass_the_declaration_check():
    for name in backends.BUILTIN:
        b = backends.get(name)
        assert b.builtin and b.load_error is None and b.name == name
        backends.check_declarations(b.impl)
        assert b.version and b.describe()["claims"]


def test_declarations_are_checked_with_the_reason():
    class BoundQuantizer(_Quantizer):
        claims = {"quantize_mxfp8": BOUND}

    class BadRanks(_Quantizer):
        layer_ranks = {"layer_dep": (2,)}

    class BadName(_Quantizer):
        name = "has space"

    class NoDevices(_Quantizer):
        devices = ("tpu",)

    for cls, message in ((BoundQuantizer, "stage 'quantize_mxfp8' may claim bitwise, not 'bound'"),
                         (BadRanks, "layer_ranks names 'layer_dep', which is not a claimed"),
                         (BadName, "name must be a non-empty string"),
                         (NoDevices, "devices must be a non-empty tuple")):
        with pytest.raises(backends.BackendLoadError, match=message):
            backends.check_declarations(cls())
    backends.check_declarations(_Quantizer())


def test_claims_reject_what_they_cannot_mean():
    with pytest.raises(ValueError, match="kind must be"):
        Claim("roughly")
    with pytest.raises(ValueError, match="needs a callable emulation"):
        Claim("own order")
    with pytest.raises(ValueError, match="a bitwise claim takes no tanh"):
        Claim("bitwise", tanh=abs)
    with pytest.raises(ValueError, match="sigmoid_abs_error must be a float"):
        own_order(abs, sigmoid_abs_error=2.0)
    assert own_order(abs).kind == "own order" and not own_order(abs).exact and BITWISE.exact


def test_selection_expands_default_and_breaks_duplicates(tmp_path):
    assert [b.name for b in backends.select(None)] == list(backends.BUILTIN)
    assert [b.name for b in backends.select(["stock", "default"])] == \
        ["stock", "reference", "reference-cuda", "fast"]
    unknown = backends.load("no_colon_here")
    assert "is not a built-in backend (reference, reference-cuda, stock, fast)" in unknown.load_error
    copy = tmp_path / "copy.py"
    copy.write_text((ROOT / "tests/plugins/reference_plugins.py").read_text())
    chosen = backends.select([str(ROOT / EXACT.split(":")[0]) + ":Exact", f"{copy}:Exact"])
    assert chosen[0].load_error is None
    assert "like a backend selected before it" in chosen[1].load_error
    taken = tmp_path / "taken.py"
    taken.write_text("from verify.interface import Backend\n\n"
                     "class Stock(Backend):\n    name = 'stock'\n")
    assert "the name of a built-in backend" in backends.load(f"{taken}:Stock").load_error
