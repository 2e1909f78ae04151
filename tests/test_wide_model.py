"""``benchmarks.wide_model`` on the committed H200 results: the byte counts against the
dimensions and the measured run, the engine fit, the model's reproduction of the measured
virtual TP8 rank, and the arithmetic of the predictions (no GPU needed)."""

import json

import pytest

from benchmarks import wide_model
from model.config import LatentMoEConfig

C = LatentMoEConfig.kimi_k3()


@pytest.fixture(scope="module")
def files():
    return {k: json.loads(p.read_text()) for k, p in wide_model.DEFAULTS.items()}


@pytest.fixture(scope="module")
def model(files):
    return wide_model.WideModel(**files)


def test_bytes_follow_the_dimensions(files):
    # one MXFP4 expert with its scales (benchmarks/dep_model.py's figure)
    assert wide_model.expert_bytes() == 17_547_264
    # the byte limit's bytes are wide_table's for every measured row
    for case in files["wide"]["cases"]:
        assert wide_model.limit_bytes(8, case["touched"]) == case["bytes"], case["tokens"]
    assert wide_model.dense_bytes(16) * 2 == wide_model.dense_bytes(8)
    h, l, e = C.hidden, C.latent, C.experts
    for n in (1, 2, 8, 16):
        b = wide_model.stage_bytes(n, 100, 500)
        # one rank's mailbox slice: E/N FP32 logits and L/N BF16 latent values per row,
        # stored into each of the N - 1 peers
        assert b["publish"]["remote"] == (n - 1) * 100 * (4 * e + 2 * l) / n
        # one-shot all-reduces: every peer's whole partial row, BF16
        assert b["latent"]["remote"] == (n - 1) * 100 * l * 2
        assert b["hidden"]["remote"] == (n - 1) * 100 * h * 2
        for name in wide_model.COMM:
            assert b[name]["virtual"] == b[name]["local"] + b[name]["remote"]
        for name in wide_model.LOCAL:
            assert b[name]["remote"] == 0 and b[name]["virtual"] == b[name]["local"]
    # route and finalize move the same bytes at every N; the experts' weights halve
    b8, b16 = wide_model.stage_bytes(8, 256, 700), wide_model.stage_bytes(16, 256, 700)
    for name in ("route", "finalize"):
        assert b8[name] == b16[name]
    pair_rows = 256 * C.top_k * l * 2
    assert (b16["experts"]["local"] - pair_rows) * 2 == pytest.approx(
        b8["experts"]["local"] - pair_rows)
    two = wide_model.two_shot_bytes(16, 1024)
    assert two["latent"] == pytest.approx(2 * 15 / 16 * 1024 * l * 2)


def test_engine_fit(model, files):
    a, f1 = model.engine_cost_us, model.engine_f1
    assert 0 < a < 100 and 0 < f1 <= 1
    # fitted on 65 and 128 rows of both files, and reproduces them within 3%
    assert sorted((p["file"], p["rows"]) for p in model.engine_points) == [
        ("experts", 65), ("experts", 128), ("wide", 65), ("wide", 128)]
    for p in model.engine_points:
        assert a + p["limit_us"] / f1 == pytest.approx(p["us"], rel=0.03), p


def test_model_reproduces_the_measured_virtual_rank(model, files):
    for case in files["wide"]["cases"]:
        t, m = case["tokens"], case["median_us"]
        p = model.predict(8, t, virtual=True)
        for name in ("shared",) + wide_model.MAIN:
            assert p[name] == pytest.approx(m[name], rel=1e-9), (t, name)
        assert p["layer"] == pytest.approx(m["rank"], rel=1e-9), t
        assert p["low"] == p["layer"] == p["high"]


def test_prediction_arithmetic(model, files):
    pw, pr = model.peer_gbs["write"], model.peer_gbs["read"]
    for case in files["wide"]["cases"]:
        t, m = case["tokens"], case["median_us"]
        p8, p16 = model.predict(8, t), model.predict(16, t)
        for p, n in ((p8, 8), (p16, 16)):
            b = wide_model.stage_bytes(n, t, case["touched"])
            # the NVLink term: each communication stage's peer bytes at the peer bandwidth
            link = (b["publish"]["remote"] / pw + (b["latent"]["remote"] + b["hidden"]["remote"])
                    / pr) / 1e3
            assert p["nvlink_us"] == pytest.approx(link)
            assert p["low"] <= p["layer"] <= p["high"]
            assert p["layer"] == pytest.approx(sum(p[s] for s in wide_model.MAIN) + p["side"])
            assert p["limit_us"] == pytest.approx(
                wide_model.limit_bytes(n, case["touched"]) / (files["wide"]["read_gbs"] * 1e3))
        # at TP8 the local stages are the measured ones; the peer traffic adds to the rest
        for name in wide_model.LOCAL:
            assert p8[name] == pytest.approx(m[name]), (t, name)
        for name in wide_model.COMM:
            assert p8[name] > m[name] - 1e-9, (t, name)
        assert p8["layer"] > m["rank"]
        # TP16: the limit halves, the engine's and the front's bytes shrink, route and
        # finalize stay, the engine keeps its fixed cost
        assert p16["limit_us"] == pytest.approx(p8["limit_us"] / 2)
        assert p16["experts"] < p8["experts"] and p16["front"] < p8["front"]
        assert (p16["experts"] - model.engine_cost_us) > (p8["experts"] - model.engine_cost_us) / 2
        for name in ("route", "finalize"):
            assert p16[name] == pytest.approx(p8[name])
        # one-shot all-reduces read every peer's row: more peers, more bytes
        assert p16["nvlink_us"] > p8["nvlink_us"]
        assert p16["latent"] > p8["latent"] and p16["hidden"] > p8["hidden"]


def test_committed_markdown_is_the_render(model):
    text = wide_model.render(model)
    assert "TP16" in text
    assert wide_model.OUT.read_text() == text, "rerun python -m benchmarks.wide_model"


def test_main_writes_the_markdown(tmp_path, capsys):
    out = tmp_path / "m.md"
    wide_model.main(["--out", str(out)])
    assert out.read_text() == capsys.readouterr().out


def test_refuses_a_run_of_other_ranks(files):
    with pytest.raises(ValueError, match="TP8"):
        wide_model.WideModel({**files["wide"], "ranks": 4}, files["experts"], files["peers"])
