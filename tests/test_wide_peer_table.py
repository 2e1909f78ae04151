"""``benchmarks/wide_peer_table.py`` on the CPU: it imports without a GPU, its arguments,
the byte limit, the mailbox word checks, the markdown render, the stage orchestration
(snapshot restored before every poll, mailboxes armed after, no stale side-stream event
for the latent stage) on a stand-in layer, ``wide_table.StockRank`` unchanged by the
``stock_step`` refactor, and the stock composition over two real gloo ranks (torchrun)
equal to the same composition computed in one process, with a failing experts peer on one
rank reported on both (no hang)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks import wide_peer_table as wpt
from benchmarks import wide_table
from model.config import LatentMoEConfig
from reference.schedules.mailbox import SENTINEL_BF16, SENTINEL_F32

ROOT = Path(__file__).resolve().parents[1]
#: small widths that split over 2 ranks as the wide layer does (the fake layer's config)
CFG = LatentMoEConfig.small()
#: a published logit word whose low 16-bit half is the latent sentinel (only 32-bit
#: polling tells it from an empty word)
LOGIT_WORD = 0x3F808000
LATENT_WORD = 0x3F80


# -- helpers (also imported by the torchrun script below) -------------------------------------

def dense(cfg=CFG, seed=5) -> dict:
    """Random BF16 dense weights of ``cfg``'s shapes (no experts: the peers are stand-ins)."""
    g = torch.Generator().manual_seed(seed)

    def normal(rows, cols):
        return (torch.randn(rows, cols, generator=g) / cols**0.5).bfloat16()

    c = cfg
    return dict(gate=normal(c.experts, c.hidden), latent_down=normal(c.latent, c.hidden),
                shared_gate_up=normal(2 * c.shared_intermediate, c.hidden),
                shared_down=normal(c.hidden, c.shared_intermediate),
                up=normal(c.hidden, c.latent),
                bias=torch.randn(c.experts, generator=g) * 0.01,
                latent_norm=(1 + 0.1 * torch.randn(c.latent, generator=g)).bfloat16())


def rank_weights(cfg, n: int, r: int, d=None) -> dict:
    """Rank ``r``'s slices in ``{r: ...}`` containers, sliced as ``WidePeerLayer`` does."""
    d = dense(cfg) if d is None else d
    c = cfg
    e_n, l_n, s_n, h_n = c.experts // n, c.latent // n, c.shared_intermediate // n, c.hidden // n
    s, gu = c.shared_intermediate, d["shared_gate_up"]
    return dict(
        front_weights={r: torch.cat([d["gate"][r * e_n:(r + 1) * e_n],
                                     d["latent_down"][r * l_n:(r + 1) * l_n]]).contiguous()},
        shared_gate_up={r: torch.cat([gu[r * s_n:(r + 1) * s_n],
                                      gu[s + r * s_n:s + (r + 1) * s_n]]).contiguous()},
        shared_down={r: d["shared_down"][:, r * s_n:(r + 1) * s_n].contiguous()},
        up={r: d["up"][r * h_n:(r + 1) * h_n].contiguous()},
        bias=d["bias"], latent_norm=d["latent_norm"], columns=h_n)


def moe_of(r: int):
    """A deterministic stand-in for rank ``r``'s experts peer: BF16 ``[T, L]``."""
    def moe(latent, ids, w):
        return (latent.float() * w.sum(1, keepdim=True) * (1.0 + 0.5 * r)
                + ids.float().mean(1, keepdim=True) / 64).bfloat16()
    return moe


def failing_moe(latent, ids, w):
    raise ValueError("planted experts failure")


def rows(tokens: int, cfg=CFG, seed=3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, cfg.hidden, generator=g).bfloat16()


def armed_mailbox(cfg, max_rows: int) -> torch.Tensor:
    """Both buffers of a mailbox, every word empty (as ``WidePeerLayer._arm`` leaves it)."""
    box = torch.empty(2, max_rows, cfg.latent + 2 * cfg.experts, dtype=torch.int16)
    box[..., :cfg.latent] = SENTINEL_BF16
    box[..., cfg.latent:].view(torch.int32)[:] = SENTINEL_F32
    return box


def publish_rows(box_rows: torch.Tensor, latent: int) -> None:
    """Fill mailbox rows with published words (logit words with a 0x8000 low half)."""
    box_rows[..., :latent] = LATENT_WORD
    box_rows[..., latent:].view(torch.int32)[:] = LOGIT_WORD


class FakeEvent:
    def __init__(self, in_call: bool):
        self.in_call = in_call

    def wait(self):
        pass


class FakeLayer(SimpleNamespace):
    """A ``WidePeerLayer`` stand-in on the CPU: the public stage calls, a model of this
    rank's mailbox (a publish fills the rows, a poll records a timeout unless they are
    full, and re-arms them), and the latent stage refusing to wait on a side-stream event
    that no full call recorded (on the GPU: an event of another graph's capture)."""

    def __init__(self, r: int = 0, n: int = 1, *, max_rows: int = 96, publishes=True,
                 rearms=True):
        super().__init__(**rank_weights(CFG, n, r))
        self.config, self.rank, self.ranks, self.max_rows = CFG, r, n, max_rows
        self.device, self.group = torch.device("cpu"), None
        live = torch.zeros(3, dtype=torch.int32)  # the engine's routing-list counters
        self.engine = SimpleNamespace(prepared=SimpleNamespace(expert_bytes=lambda: 1000),
                                      live_counts=lambda: live)
        self.listed = []  # the counters each experts stage found
        self.mailboxes = {r: armed_mailbox(CFG, max_rows)}
        self.calls, self.log, self.timed_out = 0, [], False
        self.publishes, self.rearms = publishes, rearms
        self.event, self.in_call = None, False

    @property
    def mailbox_index(self) -> int:
        return self.calls % 2

    def front_stage(self, r, x):
        self.log.append("front")
        return torch.zeros(x.shape[0], 4)

    def shared_stage(self, r, x, *, order="side"):
        self.log.append("shared")
        self.event = FakeEvent(self.in_call) if order == "side" else None
        return self.event

    def publish_stage(self, r, front, tokens):
        self.log.append("publish")
        if self.publishes or self.in_call:  # publishes=False: the stage alone lands nothing
            publish_rows(self.mailboxes[r][self.mailbox_index, :tokens], CFG.latent)

    def route_stage(self, r, tokens):
        self.log.append("route")
        box = self.mailboxes[r][self.mailbox_index, :tokens]
        if not wpt.mailbox_full(box, CFG.latent):
            self.timed_out = True
        if self.rearms:
            box.copy_(armed_mailbox(CFG, tokens)[0])
        self.engine.live_counts().add_(torch.tensor([2, 0, 1], dtype=torch.int32))

    def experts_stage(self, r, tokens):
        self.log.append("experts")
        live = self.engine.live_counts()
        self.listed.append(live.tolist())  # the plan kernel reads them, then re-arms
        live.zero_()

    def finalize_stage(self, r, tokens):
        self.log.append("finalize")

    def latent_stage(self, r, tokens):
        self.log.append("latent")
        if self.event is not None and not self.event.in_call:
            raise RuntimeError("latent stage waits on a side-stream event of another capture")

    def hidden_stage(self, r, tokens):
        self.log.append("hidden")

    def __call__(self, x, *, check=True, order="side"):
        r, tokens = self.rank, x.shape[0]
        self.in_call = True
        self.shared_stage(r, x, order=order)
        self.publish_stage(r, self.front_stage(r, x), tokens)
        self.route_stage(r, tokens)
        self.experts_stage(r, tokens)
        self.finalize_stage(r, tokens)
        self.latent_stage(r, tokens)
        self.hidden_stage(r, tokens)
        self.in_call = False
        self.calls += 1
        if check:
            self.check()
        ids = (torch.arange(tokens * CFG.top_k) % CFG.experts).view(tokens, CFG.top_k)
        return SimpleNamespace(ids=ids)

    def graph(self, x):
        self(x)
        return (lambda: self(x, check=False)), None

    def check(self):
        if self.timed_out:
            raise TimeoutError("a poll timed out")


class CpuRanks(wpt.Ranks):
    """``Ranks`` without a device: a graph is the callable itself (``before`` and the call
    twice, as ``capture_graph`` warms up), a replay is timed as 1 us. ``gather`` and
    ``require`` are the real ones over a process group, or local without one."""

    def __init__(self, reps: int):
        super().__init__(reps)
        self.syncs = 0

    def sync(self):
        import torch.distributed as dist

        self.syncs += 1
        if dist.is_initialized():
            dist.barrier()

    def gather(self, obj):
        import torch.distributed as dist

        return super().gather(obj) if dist.is_initialized() else [obj]

    def capture(self, fn, before):
        for _ in range(2):
            before()
            fn()
        return fn

    def times(self, replay, before):
        out = []
        for _ in range(self.reps):
            before()
            replay()
            out.append(1.0)
        return out


# -- import, arguments ------------------------------------------------------------------------

def test_imports_without_gpu():
    """The module imports with no CUDA device visible and touches none (nor the fast
    kernels' modules) until ``main`` runs on the GPU node."""
    code = ("import sys, torch\n"
            "import benchmarks.wide_peer_table as m\n"
            "assert not torch.cuda.is_initialized()\n"
            "bad = [k for k in ('cutlass', 'fast.schedules.wide_peer', 'triton') if k in sys.modules]\n"
            "assert not bad, bad\n"
            "import torch.distributed as dist\n"
            "assert not dist.is_initialized()\n"
            "print(m.STAGES)\n")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "shared" in done.stdout


def test_parse_args_defaults():
    args = wpt.parse_args([])
    assert args.tokens == [65, 128, 256, 512, 1024]
    assert (args.reps, args.timeout_s, args.peers) == (20, 10.0, "triton")
    assert args.out == "wide_peer_table.json" and args.render is None


def test_parse_args_values():
    args = wpt.parse_args(["--tokens", "65,1024", "--reps", "5", "--timeout-s", "2.5",
                           "--peers", "", "--out", "x.json"])
    assert args.tokens == [65, 1024]
    assert (args.reps, args.timeout_s, args.peers, args.out) == (5, 2.5, "", "x.json")
    assert wpt.parse_args(["--render", "r.json"]).render == "r.json"


@pytest.mark.parametrize("argv", [
    ["--tokens", "64"], ["--tokens", "1025"], ["--tokens", "65,a"], ["--tokens", ","],
    ["--tokens", "128,128"], ["--reps", "0"], ["--reps", "x"], ["--timeout-s", "0"],
    ["--timeout-s", "601"], ["--bogus"],
])
def test_parse_args_refuses(argv, capsys):
    with pytest.raises(SystemExit):
        wpt.parse_args(argv)
    assert "error" in capsys.readouterr().err


def test_main_without_torchrun_refuses(monkeypatch, tmp_path):
    """Launched without torchrun: a message naming the command, before any device work."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(SystemExit, match="torchrun --standalone --nproc-per-node 2"):
        wpt.main(["--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


# -- the byte limit ---------------------------------------------------------------------------

def test_byte_limit_arithmetic():
    assert wpt.byte_limit_us(4_500_000, 4500.0) == pytest.approx(1.0)
    assert wpt.byte_limit_us(9_000_000_000, 4500.0) == pytest.approx(2000.0)
    layer = FakeLayer(r=1, n=2)
    c, n = CFG, 2
    dense_bytes = 2 * ((c.experts // n + c.latent // n) * c.hidden  # router + latent-down rows
                       + 2 * (c.shared_intermediate // n) * c.hidden  # shared gate/up
                       + c.hidden * (c.shared_intermediate // n)  # shared down columns
                       + (c.hidden // n) * c.latent)  # up-projection rows
    assert wide_table.rank_dense_bytes(layer, 1) == dense_bytes
    assert wpt.rank_bytes(layer, 7) == dense_bytes + 7 * 1000


# -- mailbox words ----------------------------------------------------------------------------

def test_mailbox_words():
    box = armed_mailbox(CFG, 8)
    assert wpt.mailbox_armed(box, CFG.latent) and not wpt.mailbox_full(box[0, :3], CFG.latent)
    publish_rows(box[1, :3], CFG.latent)
    # a logit word's low half equals the latent sentinel: still a published 32-bit word
    assert int(box[1, 0, CFG.latent]) == SENTINEL_BF16
    assert wpt.mailbox_full(box[1, :3], CFG.latent)
    assert not wpt.mailbox_armed(box, CFG.latent) and wpt.mailbox_armed(box[0], CFG.latent)
    assert not wpt.mailbox_full(box[1, :4], CFG.latent)  # row 3 never published
    empties = [("latent", 5), ("logit", 0), ("logit", CFG.experts - 1)]
    for region, at in empties:  # one empty word in an otherwise published row
        part = box[1, :3].clone()
        if region == "latent":
            part[1, at] = SENTINEL_BF16
        else:
            part[1, CFG.latent:].view(torch.int32)[at] = SENTINEL_F32
        assert not wpt.mailbox_full(part, CFG.latent), (region, at)
        assert not wpt.mailbox_armed(part, CFG.latent), (region, at)


# -- the render -------------------------------------------------------------------------------

def _result() -> dict:
    def case(tokens, rank, layer, stocks, errors=None):
        med = {s: 10.0 + i for i, s in enumerate(wpt.STAGES)}
        med["layer"] = layer
        med.update(stocks)
        out = {"tokens": tokens, "rank": rank, "touched": 100 + rank, "bytes": 1,
               "read_gbs": 4500.0, "limit_us": 100.0, "median_us": med}
        if errors:
            out["errors"] = errors
        return out

    fail = {"stock_triton_w8": ["", "ValueError('planted')"]}
    return {"device": "NVIDIA H200", "torch": "2.11.0", "ranks": 2, "reps": 20,
            "read_gbs": 4539.4, "stages": list(wpt.STAGES), "untimed": wpt.UNTIMED,
            "per_rank": [
                [case(65, 0, 125.0, {"stock_triton_w4": 250.0, "stock_triton_w8": 300.0}),
                 case(65, 1, 200.0, {"stock_triton_w4": 260.0})],
                [case(1024, 0, 400.0, {}, fail), case(1024, 1, 500.0, {}, fail)]]}


def test_render():
    text = wpt.render(_result())
    lines = text.splitlines()
    assert lines[0].startswith("Device NVIDIA H200 x 2 (one process per GPU, TP2")
    assert "4539 GB/s" in lines[0] and "20 graph replays" in lines[0]
    table = [line for line in lines if line.startswith("|")]
    assert len(table) == 2 + 4
    widths = {line.count("|") for line in table}
    assert widths == {len(wpt.STAGES) + 8}, widths  # every row has every column
    head = table[0]
    for name in ("T", "rank", "touched", "limit us", *wpt.STAGES, "layer us (frac)",
                 "stock us (frac)", "speed-up"):
        assert f" {name} |" in head, name
    # layer 125 us at a 100 us limit: 0.80; best stock 250 (0.40), 2.00x
    assert table[2] == ("| 65 | 0 | 100 | 100.0 | " + " | ".join(
        f"{10.0 + i:.1f}" for i in range(len(wpt.STAGES))) +
        " | 125.0 (0.80) | 250.0 (0.40) | 2.00x |")
    assert table[3].endswith("| 200.0 (0.50) | 260.0 (0.38) | 1.30x |")
    assert table[4].endswith("| 400.0 (0.25) | - | - |")  # no stock figure
    assert wpt.UNTIMED in text
    assert "* T=1024 rank 1 stock_triton_w8: ValueError('planted')" in text
    assert "T=1024 rank 0" not in text  # rank 0 had no error


def test_render_cli(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_result()))
    wpt.main(["--render", str(path)])
    assert capsys.readouterr().out == wpt.render(_result())


# -- the orchestration on a stand-in layer ----------------------------------------------------

def test_measure_case_on_a_stand_in():
    """Every stage timed (warm-ups and replays of the poll each on a restored full
    mailbox: no timeout), the latent stage never waits on a stale event, both mailbox
    buffers armed after, the layer's replays, the byte limit."""
    layer, ranks, flushes = FakeLayer(max_rows=96), CpuRanks(3), []
    x = rows(70)
    case = wpt.measure_case(layer, x, ranks=ranks, flush=lambda: flushes.append(1),
                            read_gbs=1000.0, stocks={})
    assert list(case["times"]) == [*wpt.STAGES, "layer"]
    assert all(v == [1.0] * 3 for v in case["times"].values())
    assert case["median_us"]["layer"] == 1.0
    assert not layer.timed_out
    assert wpt.mailbox_armed(layer.mailboxes[0], CFG.latent)
    assert len(flushes) == len(wpt.STAGES) * (2 + 3) + 3  # warm-ups + replays, layer replays
    assert layer.calls == 1 + 1 + 3  # first call, graph()'s eager call, 3 replays
    assert ranks.syncs >= len(wpt.STAGES) + 2
    assert case["touched"] == CFG.experts
    assert case["bytes"] == wpt.rank_bytes(layer, CFG.experts)
    assert case["limit_us"] == pytest.approx(case["bytes"] / 1e3 / 1e3)
    route = [i for i, s in enumerate(layer.log) if s == "route"]
    assert len(route) >= 1 + 5
    # every experts stage, alone or in a call, found the appends of exactly one route
    assert layer.listed and all(seen == [2, 0, 1] for seen in layer.listed)
    assert layer.engine.live_counts().tolist() == [0, 0, 0]


def test_measure_case_refuses_an_empty_mailbox():
    """A publish that leaves the mailbox empty: refused before the poll is timed."""
    with pytest.raises(RuntimeError, match="not full after every rank's publish"):
        wpt.measure_case(FakeLayer(publishes=False), rows(70), ranks=CpuRanks(2),
                         flush=lambda: None, read_gbs=1000.0, stocks={})


def test_time_stages_refuses_an_unarmed_mailbox():
    """A poll that does not re-arm: the stages end refused (the next call would read
    stale words)."""
    layer = FakeLayer(rearms=False)
    layer.calls = 1  # as after the first call
    with pytest.raises(RuntimeError, match="not armed again"):
        wpt.time_stages(layer, rows(70), ranks=CpuRanks(2), flush=lambda: None)


# -- the stock composition --------------------------------------------------------------------

def _old_stock_rank_call(self, x):
    """``wide_table.StockRank.__call__`` before the ``stock_step`` refactor, verbatim."""
    from fast import stock

    lay, c, t, n = self.layer, self.layer.config, self.tokens, self.layer.ranks
    e_n = c.experts // n
    front = stock.mm_fp32_out(x, lay.front_weights[0])
    self.peer_logits[0].copy_(front[:, :e_n])
    self.peer_latent[0].copy_(front[:, e_n:])
    self.logits.copy_(self.peer_logits.permute(1, 0, 2).reshape(t, c.experts))
    self.latent.copy_(self.peer_latent.permute(1, 0, 2).reshape(t, c.latent))
    w, ids = stock.route(self.logits, lay.bias, top_k=c.top_k, renormalize=c.renormalize,
                         scale=c.routed_scaling_factor)
    self.peer_routed[0] = self.moe(self.latent, ids, w)
    routed = self.peer_routed.float().sum(0).bfloat16()
    normed = stock.rms_norm(routed, lay.latent_norm, c.rms_eps)
    h = stock.mm_bf16(x, lay.shared_gate_up[0])
    shared = stock.mm_bf16(stock.situ_and_mul(h, beta=c.situ_beta,
                                              linear_beta=c.situ_linear_beta),
                           lay.shared_down[0])
    cols = slice(0, lay.columns)
    shared[:, cols] = stock.addmm_bf16(shared[:, cols].contiguous(), normed, lay.up[0])
    self.peer_hidden[0] = shared
    return self.peer_hidden.float().sum(0).bfloat16()


def test_virtual_stock_rank_unchanged():
    """``wide_table.StockRank`` (rank 0 of virtual ranks) gives the bits of its code
    before the refactor, on the same random peer rows."""
    layer = SimpleNamespace(**rank_weights(CFG, 4, 0), config=CFG, ranks=4,
                            device=torch.device("cpu"))
    x = rows(70)
    outs = []
    for call in (wide_table.StockRank.__call__, _old_stock_rank_call):
        torch.manual_seed(0)
        s = wide_table.StockRank(layer, moe_of(0), 70)
        outs.append(call(s, x))
    assert torch.equal(outs[0], outs[1])


def reference_stock(cfg, n: int, x: torch.Tensor) -> torch.Tensor:
    """The TP-``n`` stock composition of every rank in one process (FP32 sums of the BF16
    partials, which is what a BF16 all-reduce of two ranks rounds to)."""
    from fast import stock

    c, d = cfg, dense(cfg)
    layers = [SimpleNamespace(**rank_weights(cfg, n, r, d)) for r in range(n)]
    e_n = c.experts // n
    fronts = [stock.mm_fp32_out(x, layers[r].front_weights[r]) for r in range(n)]
    logits = torch.cat([f[:, :e_n] for f in fronts], 1)
    latent = torch.cat([f[:, e_n:].bfloat16() for f in fronts], 1)
    w, ids = stock.route(logits, d["bias"], top_k=c.top_k, renormalize=c.renormalize,
                         scale=c.routed_scaling_factor)
    routed = sum(moe_of(r)(latent, ids, w).float() for r in range(n)).bfloat16()
    normed = stock.rms_norm(routed, d["latent_norm"], c.rms_eps)
    hidden = []
    for r, lay in enumerate(layers):
        h = stock.mm_bf16(x, lay.shared_gate_up[r])
        shared = stock.mm_bf16(stock.situ_and_mul(h, beta=c.situ_beta,
                                                  linear_beta=c.situ_linear_beta),
                               lay.shared_down[r])
        cols = slice(r * lay.columns, (r + 1) * lay.columns)
        shared[:, cols] = stock.addmm_bf16(shared[:, cols].contiguous(), normed, lay.up[r])
        hidden.append(shared.float())
    return sum(hidden).bfloat16()


SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    import torch.distributed as dist

    sys.path.insert(0, {tests!r})
    import test_wide_peer_table as t
    from benchmarks import wide_peer_table as wpt

    dist.init_process_group("gloo")
    r, n, out = dist.get_rank(), dist.get_world_size(), {out!r}
    x = t.rows({tokens})
    layer = t.FakeLayer(r, n)
    torch.save(wpt.StockPeerRank(layer, t.moe_of(r), {tokens})(x), f"{{out}}/stock{{r}}.pt")
    ranks = t.CpuRanks(2)
    try:
        ranks.require(r == 0, "probe")
        probe = ""
    except RuntimeError as e:
        probe = str(e)
    own = t.moe_of(r)
    bad = (t.failing_moe if r == 1 else own)
    t_bad, e_bad = wpt.time_stock(layer, bad, x, ranks=ranks, flush=lambda: None)
    t_good, e_good = wpt.time_stock(layer, own, x, ranks=ranks, flush=lambda: None)
    case = wpt.measure_case(t.FakeLayer(r, n), x, ranks=ranks, flush=lambda: None,
                            read_gbs=1000.0, stocks={{"stock_good": own, "stock_bad": bad}})
    with open(f"{{out}}/rank{{r}}.json", "w") as f:
        json.dump(dict(probe=probe, gather=ranks.gather(r), t_bad=t_bad, e_bad=e_bad,
                       t_good=t_good, e_good=e_good, case=case), f)
    dist.barrier()
    dist.destroy_process_group()
""")


def test_stock_over_two_gloo_ranks(tmp_path):
    """Two real ranks (torchrun, gloo): each rank's stock composition equals the one
    computed in one process; ``require`` raises on both when one fails; a failing experts
    peer on rank 1 alone is reported by both ranks and times nothing (no collective
    launched); ``measure_case`` runs its stages and stocks in step."""
    tokens = 70
    script = tmp_path / "run.py"
    script.write_text(SCRIPT.format(tests=str(ROOT / "tests"), out=str(tmp_path),
                                    tokens=tokens))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=2", str(script)]
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=240)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError("torchrun with 2 gloo ranks did not finish in 240 s") from exc
    assert done.returncode == 0, done.stderr[-4000:]
    want = reference_stock(CFG, 2, rows(tokens))
    for r in range(2):
        got = torch.load(tmp_path / f"stock{r}.pt")
        assert torch.equal(got, want), f"rank {r}: stock composition differs"
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert res["probe"] == "probe: false on rank(s) [1]"
        assert res["gather"] == [0, 1]
        assert res["t_bad"] == [] and res["e_bad"][0] == ""
        assert res["e_bad"][1].startswith("alone: ValueError('planted experts failure'")
        assert res["t_good"] == [1.0, 1.0] and res["e_good"] == ["", ""]
        case = res["case"]
        assert list(case["times"]) == [*wpt.STAGES, "layer", "stock_good"]
        assert case["errors"]["stock_bad"][1].startswith("alone: ValueError")
        assert case["rank"] == r
