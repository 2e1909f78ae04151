"""The triton_kernels peer harness (benchmarks/peers/triton_moe.py): everything testable
without a GPU.

* always (pure PyTorch): our MXFP4 decode against ``model.formats``; the gate/up interleave;
  the canonical ``[E, K, N]`` form matmul_ogs multiplies by; local ids and the routing
  bitmatrix; the byte counts; input validation.
* when ``triton`` and the triton_kernels copy import (``.gpu/peers`` or PYTHONPATH; not on
  CI): the real conversion (``convert_layout`` with the Hopper value/scale layouts, run on
  the CPU) undone by triton_kernels' own ``unswizzle_data`` and dequantized by its own
  ``upcast_from_mxfp_torch`` equals our weights transposed, for num_warps 4 and 8, chunked
  and not; and (in a subprocess under ``TRITON_INTERPRET=1``) triton_kernels' routing
  kernels fed with our bitmatrix give the expected histogram and gather/scatter indices.
* on an SM90 GPU: ``check_fc1`` / ``check_forward`` (skipped elsewhere with the reason).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from benchmarks.peers import triton_moe as tm
from model.formats import dequantize_mxfp4 as ref_dequantize_mxfp4

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _triton_kernels_or_skip():
    try:
        return tm._import_triton_kernels()
    except ImportError as e:
        pytest.skip(f"triton_kernels not importable here ({e}); the conversion round trip runs "
                    "where triton and .gpu/peers/triton_kernels are present")


def _codes(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)


def _scales(shape, seed, lo=100, hi=150):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, shape, dtype=torch.uint8, generator=g)


def _weights(e=6, lat=256, i=128, seed=0):
    return (_codes((e, 2 * i, lat // 2), seed), _scales((e, 2 * i, lat // 32), seed + 1),
            _codes((e, lat, i // 2), seed + 2), _scales((e, lat, i // 32), seed + 3))


# --------------------------------------------------------------------------------------
# pure PyTorch
# --------------------------------------------------------------------------------------

def test_dequantize_is_the_reference_decode():
    """The peers check their conversions against the reference's exact MXFP4 decode (its
    codecs are tested exhaustively in tests/test_mx_codecs.py), not a copy of it."""
    assert tm.dequantize_mxfp4 is ref_dequantize_mxfp4
    with pytest.raises(ValueError, match="scales: expected shape"):
        tm.dequantize_mxfp4(_codes((2, 32), 0), _scales((2, 3), 0))


def test_interleave_gate_up_order_and_inverse():
    e, i, x = 2, 5, 3
    t = torch.arange(e * 2 * i * x).reshape(e, 2 * i, x)
    inter = tm.interleave_gate_up(t)
    for j in range(i):
        assert torch.equal(inter[:, 2 * j], t[:, j])  # gate j
        assert torch.equal(inter[:, 2 * j + 1], t[:, i + j])  # up j
    # FC1's output columns come back in [gate; up] order
    assert torch.equal(tm.deinterleave_gate_up(inter.transpose(-2, -1), dim=-1), t.transpose(-2, -1))
    assert torch.equal(tm.deinterleave_gate_up(inter, dim=1), t)


@pytest.mark.parametrize("interleave", [False, True])
def test_canonical_weight_is_the_transposed_matrix(interleave):
    codes, scales = _codes((3, 64, 48), 3), _scales((3, 64, 3), 4)  # [E, N, K/2], K = 96
    c_kn, s_kn = tm.canonical_weight(codes, scales, interleave=interleave)
    assert c_kn.shape == (3, 48, 64) and s_kn.shape == (3, 3, 64)
    assert c_kn.stride(-2) == 1 and s_kn.stride(-2) == 1  # matmul_ogs' W_TRANSPOSE
    ours = tm.dequantize_mxfp4(codes, scales)  # [E, N, K]
    if interleave:
        ours = tm.interleave_gate_up(ours)
    assert torch.equal(tm.dequantize_canonical(c_kn, s_kn), ours.transpose(-2, -1))


def test_local_ids_and_bitmatrix():
    g = torch.Generator().manual_seed(5)
    e_total, k, r = 200, 16, 37
    ids = torch.stack([torch.randperm(e_total, generator=g)[:k] for _ in range(r)]).int()
    ids[0, :3] = torch.tensor([31, 63, 95])  # bit 31 of a word: the int32 wrap
    ids[1] = torch.arange(100, 116)  # all outside [first, first + count) below
    first, count = 17, 83  # count not a multiple of 32
    lids = tm.local_ids(ids, first, count)
    assert lids.dtype == torch.int16 and lids.is_contiguous()
    local = (ids >= first) & (ids < first + count)
    assert torch.equal(lids[local].long(), (ids[local] - first).long())
    assert bool((lids[~local] == -1).all())
    words = tm.bitmatrix_words(lids, count)
    assert words.dtype == torch.uint32 and tuple(words.shape) == (r, 3)
    bits = tm.unpack_bitmatrix(words, count)
    want = torch.zeros(r, count, dtype=torch.bool)
    rr, kk = local.nonzero(as_tuple=True)
    want[rr, (ids[rr, kk] - first).long()] = True
    assert torch.equal(bits, want)
    assert not bits[1].any()
    # nothing past `count` in the last word
    full = (words.view(torch.int32).to(torch.int64) & 0xFFFFFFFF)
    assert int(full[:, -1].max()) < (1 << (count - 64))


def test_local_ids_rejects_bad_count():
    with pytest.raises(ValueError, match="count"):
        tm.local_ids(torch.zeros(1, 2, dtype=torch.int32), 0, 0)


def test_expert_bytes_and_bytes_streamed():
    b = tm.expert_bytes(3584, 3072)
    assert b["total"] == 17_547_264  # the figure
    assert tm.expert_bytes(3584, 384)["total"] * 8 == 17_547_264  # a TP8 slice
    ids = torch.tensor([[0, 5, 9], [5, 9, 12], [40, 41, 42]])
    assert tm.touched_experts(ids) == 7
    assert tm.touched_experts(ids, first=5, count=8) == 3  # 5, 9, 12
    assert tm.bytes_streamed(ids, latent=3584, intermediate=3072, first=5, count=8) == 3 * 17_547_264
    assert tm.bytes_streamed(ids, latent=3584, intermediate=384) == 7 * 2_193_408


def test_check_routing_inputs():
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    w = torch.ones(3, 2)
    tm.check_routing_inputs(x, ids, w, latent=64, n_experts_total=8)
    with pytest.raises(ValueError, match="x must be"):
        tm.check_routing_inputs(x.float(), ids, w, latent=64)
    with pytest.raises(ValueError, match="ids must be"):
        tm.check_routing_inputs(x, ids.float(), w, latent=64)
    with pytest.raises(ValueError, match="weights must be"):
        tm.check_routing_inputs(x, ids, w.bfloat16(), latent=64)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 5\)"):
        tm.check_routing_inputs(x, ids, w, latent=64, n_experts_total=5)
    with pytest.raises(ValueError, match="row 1 repeats"):
        tm.check_routing_inputs(x, torch.tensor([[0, 1], [2, 2], [4, 5]], dtype=torch.int32), w,
                                latent=64)


@pytest.mark.parametrize("bad, match", [
    (lambda w: (w[0].int(), *w[1:]), "w13 must be a uint8"),
    (lambda w: (w[0], w[1][:, :-1], *w[2:]), "w13_scales must be"),
    (lambda w: (w[0], w[1], w[2][:, :, :-1], w[3]), "w2 must be"),
    (lambda w: (*w[:3], w[3][:-1]), "w2_scales must be"),
    (lambda w: (w[0][:, :, :-1], w[1], w[2], w[3]), "multiples of 32"),
])
def test_tritonmoe_rejects_bad_weights(bad, match):
    # validated before triton_kernels is imported: runs everywhere
    with pytest.raises(ValueError, match=match):
        tm.TritonMoE(*bad(_weights()), device="cpu")


@pytest.mark.parametrize("kw, match", [
    (dict(first=2, count=5), "pass either all experts"),
    (dict(num_warps=2), "num_warps"),
    (dict(split_k=0), "split_k"),
    (dict(block_m=24), "block_m"),
    (dict(activation="situ"), "activation"),
    (dict(tokens_per_expert_hint="skewed"), "tokens_per_expert_hint"),
    (dict(layout="rows"), "layout must be one of"),
    (dict(count=0), "count"),
])
def test_tritonmoe_rejects_bad_config(kw, match):
    with pytest.raises(ValueError, match=match):
        tm.TritonMoE(*_weights(e=6), device="cpu", **kw)


def test_available_gives_a_reason():
    ok, why = tm.available()
    assert isinstance(ok, bool) and isinstance(why, str)
    assert ok or why


# --------------------------------------------------------------------------------------
# triton_kernels' layouts, run on the CPU
# --------------------------------------------------------------------------------------

def _undo(value, scale):
    """triton_kernels' own inverse: unswizzle both tensors and dequantize with
    upcast_from_mxfp_torch (mx axis 1 = K): float32 [E, K, N]."""
    from triton_kernels.numerics_details.mxfp import upcast_from_mxfp_torch
    codes_kn = value.storage.layout.unswizzle_data(value.storage.data)
    scales_kn = scale.storage.layout.unswizzle_data(scale.storage.data)
    return codes_kn, scales_kn, upcast_from_mxfp_torch(codes_kn, scales_kn, torch.float32, axis=1)


@pytest.mark.parametrize("num_warps", [4, 8])
@pytest.mark.parametrize("dims", [(5, 256, 128), (3, 512, 384)])  # (E, L, I); I=384 like a TP8 slice
def test_conversion_round_trip_through_triton_layouts(num_warps, dims):
    _triton_kernels_or_skip()
    e, lat, i = dims
    w = _weights(e, lat, i, seed=11)
    moe = tm.TritonMoE(*w, num_warps=num_warps, device="cpu", chunk_experts=None)
    for value, scale, codes, scales, interleave in ((moe.w13, moe.w13_scale, w[0], w[1], True),
                                                    (moe.w2, moe.w2_scale, w[2], w[3], False)):
        n, k = codes.shape[1], codes.shape[2] * 2
        assert list(value.shape) == [e, k, n] and value.storage.data.stride(-2) == 1
        assert value.storage.layout.name == "HOPPER_VALUE"
        assert scale.storage.layout.name == "HOPPER_SCALE" and scale.storage.layout.num_warps == num_warps
        c_kn, s_kn = tm.canonical_weight(codes, scales, interleave=interleave)
        got_c, got_s, deq = _undo(value, scale)
        assert torch.equal(got_c, c_kn) and torch.equal(got_s[..., :n], s_kn)
        ours = tm.dequantize_mxfp4(codes, scales)
        if interleave:
            ours = tm.interleave_gate_up(ours)
        assert torch.equal(deq, ours.transpose(-2, -1))  # what x @ w[e] multiplies by
    assert moe.stored_bytes_per_expert == moe.bytes_per_expert == tm.expert_bytes(lat, i)["total"]


@pytest.mark.parametrize("num_warps", [4, 8])
def test_chunked_conversion_is_byte_identical(num_warps):
    _triton_kernels_or_skip()
    w = _weights(7, 256, 128, seed=21)
    whole = tm.TritonMoE(*w, num_warps=num_warps, device="cpu", chunk_experts=None)
    parts = tm.TritonMoE(*w, num_warps=num_warps, device="cpu", chunk_experts=3)
    for a, b in ((whole.w13, parts.w13), (whole.w13_scale, parts.w13_scale),
                 (whole.w2, parts.w2), (whole.w2_scale, parts.w2_scale)):
        assert a.storage.data.shape == b.storage.data.shape
        assert a.storage.data.stride() == b.storage.data.stride()
        assert torch.equal(a.storage.data, b.storage.data)
        assert a.shape == b.shape and a.dtype == b.dtype
        assert vars(a.storage.layout) == vars(b.storage.layout)


def test_local_slice_of_full_weights_equals_presliced():
    _triton_kernels_or_skip()
    w = _weights(8, 256, 128, seed=31)
    full = tm.TritonMoE(*w, first=2, count=4, device="cpu")
    pre = tm.TritonMoE(*(t[2:6] for t in w), first=2, count=4, n_experts_total=8, device="cpu")
    assert torch.equal(full.w13.storage.data, pre.w13.storage.data)
    assert torch.equal(full.w2_scale.storage.data, pre.w2_scale.storage.data)
    assert full.n_experts_total == 8 == pre.n_experts_total
    ids = torch.tensor([[0, 2, 5, 7], [3, 2, 6, 1]])
    assert full.bytes_streamed(ids) == 3 * full.bytes_per_expert  # local [2, 6): 2, 5, 3
    with pytest.raises(RuntimeError, match="calls need an SM90 GPU"):
        full(torch.zeros(2, 256, dtype=torch.bfloat16), ids.int(), torch.ones(2, 4))


_ROUTING_SCRIPT = textwrap.dedent(r"""
    import json, sys
    import numpy as np
    import torch
    import triton.runtime.interpreter as interp
    # triton 3.6's interpreter turns loop bounds into 1-element arrays, which NumPy 2 refuses
    # to convert with int(); index them instead (test-only shim, interpreter mode only).
    _orig = interp._patch_lang_tensor
    def _patched(tensor, scope):
        _orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))
    interp._patch_lang_tensor = _patched
    from benchmarks.peers import triton_moe as tm
    tk = tm._import_triton_kernels()
    first, count, e_total, k, r = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), 16, int(sys.argv[4])
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(e_total, generator=g)[:k] for _ in range(r)]).int()
    w = torch.rand(r, k, generator=g)
    lids = tm.local_ids(ids, first, count)
    words = tm.bitmatrix_words(lids, count)
    bm = tk["tensor"].Bitmatrix(words, shape=[r, words.shape[1] * 32], shape_max=[r, None], scratchpad=None)
    rd, gi, si = tk["routing"].routing_from_bitmatrix(bm, w, lids, count, k)
    print(json.dumps({"hist": rd.expt_hist.tolist(), "gather": gi.src_indx.tolist(),
                      "scatter": si.src_indx.tolist(), "gate_scal": rd.gate_scal.tolist(),
                      "ids": ids.tolist(), "w": w.tolist()}))
""")


@pytest.mark.slow
@pytest.mark.parametrize("first, count, e_total, rows", [(0, 64, 64, 9), (40, 56, 896, 33)])
def test_routing_kernels_in_interpreter(first, count, e_total, rows):
    """Our local ids + bitmatrix through triton_kernels' routing kernels (TRITON_INTERPRET=1,
    CPU): per-expert histogram of the local pairs, gather/scatter inverse permutations of
    the local pairs in expert order, non-local pairs dropped, weights carried."""
    _triton_kernels_or_skip()
    import json
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, tm._peers_dir(), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-c", _ROUTING_SCRIPT, str(first), str(count), str(e_total),
                           str(rows)], capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    ids = torch.tensor(out["ids"])
    w = torch.tensor(out["w"])
    k = ids.shape[1]
    local = (ids >= first) & (ids < first + count)
    n_local = int(local.sum())
    hist = torch.tensor(out["hist"])
    assert hist.shape == (count,)
    assert torch.equal(hist, torch.bincount((ids[local] - first).long(), minlength=count).int())
    gather, scatter = torch.tensor(out["gather"]), torch.tensor(out["scatter"])
    assert gather.shape == (rows * k,) == scatter.shape
    assert bool((gather[n_local:] == -1).all()) and bool((gather[:n_local] >= 0).all())
    flat_local = local.reshape(-1)
    assert bool((scatter[~flat_local] == -1).all())
    pos = scatter[flat_local]
    assert torch.equal(pos.sort().values, torch.arange(n_local))
    # gather is the inverse of scatter on the local pairs
    assert torch.equal(gather[pos], flat_local.nonzero().reshape(-1))
    # gate positions are in expert order, and carry the pair's weight
    experts_in_order = (ids.reshape(-1)[gather[:n_local]] - first)
    assert bool((experts_in_order[1:] >= experts_in_order[:-1]).all())
    # the gathered weights are the pairs' own FP32 weights, copied: equal bit for bit
    assert torch.equal(torch.tensor(out["gate_scal"][:n_local]), w.reshape(-1)[gather[:n_local]])


_GLUE_SCRIPT = _ROUTING_SCRIPT.split("from benchmarks.peers")[0] + textwrap.dedent(r"""
    import torch
    from benchmarks.peers import triton_moe as tm
    from triton_kernels.numerics_details.mxfp import upcast_from_mxfp_torch
    tk = tm._import_triton_kernels()

    def fake_matmul_ogs(x, w, bias, routing_data=None, gather_indx=None, scatter_indx=None,
                        precision_config=None, gammas=None, fused_activation=None, **kw):
        # matmul_ogs' semantics, reading the swizzled weights back with triton_kernels' own
        # unswizzle; rows the kernel would not write are NaN.
        assert bias is None and not kw
        k_, n = w.shape[-2:]
        codes = w.storage.layout.unswizzle_data(w.storage.data)
        sc = precision_config.weight_scale
        scales = sc.storage.layout.unswizzle_data(sc.storage.data)[..., :n]
        wf = upcast_from_mxfp_torch(codes, scales, torch.float32, axis=1)  # [E, K, N]
        hist = routing_data.expt_hist.long()
        offs = torch.cat((torch.zeros(1, dtype=torch.long), hist.cumsum(0)))
        kact = routing_data.n_expts_act
        m = gather_indx.src_indx.shape[0] if gather_indx is not None else x.shape[0]
        n_out = n // 2 if fused_activation is not None else n
        y = torch.full((m, n_out), float("nan"))
        for e in range(wf.shape[0]):
            lo, hi = int(offs[e]), int(offs[e + 1])
            rows = gather_indx.src_indx[lo:hi].long() // kact if gather_indx is not None else torch.arange(lo, hi)
            acc = x[rows].float() @ wf[e]
            if fused_activation is not None:
                alpha, limit = fused_activation.fn_args
                g, l = acc[:, 0::2].clamp(max=limit), acc[:, 1::2].clamp(-limit, limit)
                s = g / (1 + torch.exp(-alpha * g))
                acc = s * l + s
            if gammas is not None:
                acc = acc * gammas[lo:hi, None]
            y[lo:hi] = acc.bfloat16().float()
        if scatter_indx is None:
            return y.bfloat16()
        idx = scatter_indx.src_indx.long().view(-1, kact)
        out = torch.zeros(idx.shape[0], n_out)
        for t in range(idx.shape[0]):
            for j in idx[t][idx[t] >= 0].tolist():
                out[t] += y[j]
        return out.bfloat16()

    def fake_swiglu(a, alpha, pc, routing_data):
        n_valid = int(routing_data.expt_data.token_offs_raw[routing_data.n_expts_tot])
        out = torch.full((a.shape[0], a.shape[1] // 2), float("nan"))
        h = a[:n_valid].float()
        g, l = h[:, 0::2].clamp(max=pc.limit), h[:, 1::2].clamp(-pc.limit, pc.limit)
        s = g / (1 + torch.exp(-alpha * g))
        out[:n_valid] = s * l + s
        return out.bfloat16()

    tk["mo"].matmul_ogs = fake_matmul_ogs
    tk["swiglu"].swiglu = fake_swiglu

    def factory(*w, **kw):
        moe = tm.TritonMoE(*w, **kw)
        moe.device = torch.device("cuda")  # let the CPU tensors through _require_gpu
        return moe

    small = dict(experts=32, latent=256, intermediate=128, rows=10, top_k=16, device="cpu", _impl=factory)
    res = []
    for nw in (8,):  # num_warps only changes the scale layout: covered by the round-trip tests
        res.append(tm.check_fc1(num_warps=nw, first=8, count=12, **small))
        res.append(tm.check_fc1(num_warps=nw, first=0, count=None, **small))
        for act in tm.ACTIVATIONS:
            res.append(tm.check_forward(num_warps=nw, activation=act, first=8, count=12, **small))
        res.append(tm.check_forward(num_warps=nw, layout="compact", first=8, count=12, **small))
    print(json.dumps([{k: v for k, v in r.items() if k != "config"} for r in res]))
""")


@pytest.mark.slow
def test_call_glue_in_interpreter():
    """The real ``route`` / ``fc1_pairs`` / ``__call__`` (index mapping, gate/up de-interleave,
    activation order, gammas, combine) on the CPU: triton_kernels' routing kernels under
    TRITON_INTERPRET=1, and ``matmul_ogs``/``swiglu`` replaced by a PyTorch model of their
    semantics that reads the converted (swizzled) weights back through triton_kernels' own
    unswizzle and leaves unwritten rows NaN; ``check_fc1`` and ``check_forward`` must pass."""
    _triton_kernels_or_skip()
    import json
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, tm._peers_dir(), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-c", _GLUE_SCRIPT], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(res) == 5 and all(r["ok"] for r in res), res


# --------------------------------------------------------------------------------------
# the GPU checks' own logic, on a CPU emulation of matmul_ogs' semantics
# --------------------------------------------------------------------------------------

class _Emulated:
    """CPU stand-in for ``TritonMoE``: matmul_ogs' semantics on the canonical form (``x @
    w[e]`` with w13's interleaved gate/up columns, FP32 accumulation, SwiGLU on (even, odd)
    columns, BF16 stores, gammas in FC2, FP32 combine), with optional planted bugs."""

    bug = None

    def __init__(self, w13, w13s, w2, w2s, *, first, count, num_warps, device, activation="swiglu_fused"):
        e = w13.shape[0]
        sl = slice(first, first + count) if e >= first + count else slice(0, count)
        self.first, self.count, self.activation = first, count, activation
        self.w13 = tm.dequantize_canonical(*tm.canonical_weight(w13[sl], w13s[sl], interleave=True))
        self.w2 = tm.dequantize_canonical(*tm.canonical_weight(w2[sl], w2s[sl], interleave=False))
        if self.bug == "gate_up_swapped":  # interleaved the other way round
            self.w13 = tm.interleave_gate_up(self.w13.transpose(-2, -1).flip(-2).contiguous()).transpose(-2, -1)
            self.w13 = self.w13.flip(-1)
        if self.bug == "w2_rows_rolled":
            self.w2 = self.w2.roll(1, dims=-1)
        if self.bug == "w13_k_halves_swapped":  # a mis-swizzle along K
            self.w13 = self.w13.roll(self.w13.shape[1] // 2, dims=1)

    def _pairs(self, ids):
        loc = (ids >= self.first) & (ids < self.first + self.count)
        rr, kk = loc.nonzero(as_tuple=True)
        return rr, kk, (ids[rr, kk] - self.first).long()

    def _x(self, x, rr):
        if self.bug == "gather_off_by_one":
            rr = (rr + 1) % x.shape[0]
        return x[rr].float()

    def _fc1(self, x, rr, e):
        return torch.einsum("pk,pkn->pn", self._x(x, rr), self.w13[e])  # FP32, interleaved

    def fc1_pairs(self, x, ids, weights):
        r, k = ids.shape
        rr, kk, e = self._pairs(ids)
        out = torch.full((r, k, self.w13.shape[-1]), float("nan"))
        out[rr, kk] = tm.deinterleave_gate_up(self._fc1(x, rr, e).bfloat16().float(), dim=-1)
        return out

    def __call__(self, x, ids, weights, *, layout="owner", capacity=None, pairs=None):
        if layout == "compact":  # the real glue around this owner-layout model
            if self.bug == "compact_capacity_short":
                capacity = max(1, capacity - 1)
            return tm.compact_forward(x, ids, weights, self.first, self.count, capacity,
                                      lambda xc, idc, wc: self(xc, idc, wc))
        rr, kk, e = self._pairs(ids)
        h = self._fc1(x, rr, e)
        if self.activation == "swiglu_separate":
            h = h.bfloat16().float()
        gate, lin = h[:, 0::2].clamp(max=tm.SWIGLU_LIMIT), h[:, 1::2].clamp(-tm.SWIGLU_LIMIT, tm.SWIGLU_LIMIT)
        sw = gate / (1 + torch.exp(-tm.SWIGLU_ALPHA * gate))
        a = (sw * lin + sw).bfloat16().float()
        o = torch.einsum("pi,pil->pl", a, self.w2[e]) * weights[rr, kk].unsqueeze(1)
        y = torch.zeros(x.shape[0], self.w2.shape[-1]).index_add_(0, rr, o.bfloat16().float())
        return y.bfloat16()


_SMALL = dict(experts=32, latent=128, intermediate=64, rows=12, top_k=16, first=4, device="cpu")


@pytest.mark.parametrize("activation", tm.ACTIVATIONS)
@pytest.mark.parametrize("count", [10, None])
def test_checks_pass_on_faithful_emulation(activation, count):
    r1 = tm.check_fc1(count=count, _impl=_Emulated, **_SMALL)
    assert r1["ok"] and r1["nonlocal_pairs_absent"] and r1["max_ratio"] < 0.5, r1
    r2 = tm.check_forward(activation=activation, count=count, _impl=_Emulated, **_SMALL)
    assert r2["ok"] and r2["worst_row_rel_err"] < 2.0 ** -9, r2
    if count is not None:
        assert r2["rows_without_local_pair"] >= 1 and r2["zero_rows_ok"]  # row 0 routed away


@pytest.mark.parametrize("count", [10, None])
def test_compact_layout_passes_on_faithful_emulation(count):
    r = tm.check_forward(layout="compact", count=count, _impl=_Emulated, **_SMALL)
    assert r["ok"] and r["config"]["layout"] == "compact" and r["worst_row_rel_err"] < 2.0 ** -9, r
    if count is not None:
        assert r["rows_without_local_pair"] >= 1 and r["zero_rows_ok"]


def test_compact_layout_check_catches_a_short_capacity(monkeypatch):
    monkeypatch.setattr(_Emulated, "bug", "compact_capacity_short")
    assert not tm.check_forward(layout="compact", count=10, raise_on_fail=False, _impl=_Emulated, **_SMALL)["ok"]


def test_compact_slots_and_rows():
    m = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1], dtype=torch.bool)
    assert tm.compact_slots(m, 3).tolist() == [1, 2, 4]  # past the capacity: dropped
    assert tm.compact_slots(m, 6).tolist() == [1, 2, 4, 7, 8, 8]  # empty slots hold n = 8
    assert tm.compact_slots(torch.zeros(5, dtype=torch.bool), 2).tolist() == [5, 5]
    with pytest.raises(ValueError, match="capacity must be an int >= 1"):
        tm.compact_slots(m, 0)
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        tm.compact_slots(m.int(), 2)
    ids = torch.tensor([[0, 9], [3, 4], [9, 8], [5, 1]])
    src, valid = tm.compact_rows(ids, 3, 3, 3)  # local [3, 6): rows 1 and 3
    assert src.tolist() == [1, 3, 0] and valid.tolist() == [True, True, False]
    assert tm.local_rows(ids, 3, 3) == 2 and tm.local_pairs(ids, 3, 3) == 3


def test_compact_forward_scatters_back_and_zeroes_the_rest():
    """The glue alone: the inner call sees the compacted rows (empty slots: every id -1),
    its rows land at their source rows, every other row is zero."""
    x = torch.arange(5, dtype=torch.float32).view(5, 1).repeat(1, 3).bfloat16()
    ids = torch.tensor([[0, 1], [7, 8], [2, 9], [8, 7], [6, 3]])
    w = torch.rand(5, 2)
    seen = {}

    def inner(xc, idc, wc):
        seen.update(x=xc, ids=idc, w=wc)
        return xc * 10
    y = tm.compact_forward(x, ids, w, 0, 4, 4, inner)  # local [0, 4): rows 0, 2, 4
    assert seen["x"][:, 0].tolist() == [0, 2, 4, 0]
    assert seen["ids"].tolist() == [[0, 1], [2, 9], [6, 3], [-1, -1]]
    assert torch.equal(seen["w"][:3], w[[0, 2, 4]])
    assert y.shape == (5, 3) and y[:, 0].tolist() == [0, 0, 20, 0, 40]


def test_pairs_hint():
    assert tm.pairs_hint(1024, 56) == 18  # DEP16 T = 64: BLOCK_M 32
    assert tm.pairs_hint(0, 56) == 1 and tm.pairs_hint(28, 56) == 1 and tm.pairs_hint(84, 56) == 2
    with pytest.raises(ValueError, match="pairs must be an int >= 0"):
        tm.pairs_hint(-1, 56)
    with pytest.raises(ValueError, match="count must be an int >= 1"):
        tm.pairs_hint(10, 0)


@pytest.mark.parametrize("bug, fc1_sees_it", [("gate_up_swapped", True), ("w13_k_halves_swapped", True),
                                              ("gather_off_by_one", True), ("w2_rows_rolled", False)])
def test_checks_catch_planted_bugs(bug, fc1_sees_it, monkeypatch):
    monkeypatch.setattr(_Emulated, "bug", bug)
    r1 = tm.check_fc1(count=10, raise_on_fail=False, _impl=_Emulated, **_SMALL)
    assert r1["ok"] is (not fc1_sees_it), r1
    with pytest.raises(AssertionError, match="forward check failed"):
        tm.check_forward(count=10, _impl=_Emulated, **_SMALL)
    if fc1_sees_it:
        with pytest.raises(AssertionError, match="FC1 check failed"):
            tm.check_fc1(count=10, _impl=_Emulated, **_SMALL)


# --------------------------------------------------------------------------------------
# GPU (SM90)
# --------------------------------------------------------------------------------------

def _gpu_or_skip():
    ok, why = tm.available()
    if not ok:
        pytest.skip(why)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("num_warps", [4, 8])
@pytest.mark.parametrize("subset", [True, False])
def test_check_fc1_gpu(num_warps, subset):
    _gpu_or_skip()
    kw = {} if subset else dict(first=0, count=None)
    res = tm.check_fc1(num_warps=num_warps, **kw)
    assert res["ok"], res


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("num_warps", [4, 8])
@pytest.mark.parametrize("activation", tm.ACTIVATIONS)
def test_check_forward_gpu(num_warps, activation):
    _gpu_or_skip()
    res = tm.check_forward(num_warps=num_warps, activation=activation)
    assert res["ok"], res


def test_rank_moes_slices_a_ranks_experts(monkeypatch):
    """``rank_moes``: one peer per ``num_warps`` over experts ``[first, first + count)`` and
    the ``(rank, ranks)`` slice of their intermediate (gate rows, the same up rows, those
    ``w2`` columns); where the peer cannot run, no peer and the reason."""
    from types import SimpleNamespace

    e, lat, inter = 6, 64, 128
    g = torch.Generator().manual_seed(0)
    w = SimpleNamespace(
        config=SimpleNamespace(experts=e, intermediate=inter),
        w13=torch.randint(0, 256, (e, 2 * inter, lat // 2), generator=g, dtype=torch.uint8),
        w13_scales=torch.randint(0, 256, (e, 2 * inter, lat // 32), generator=g, dtype=torch.uint8),
        w2=torch.randint(0, 256, (e, lat, inter // 2), generator=g, dtype=torch.uint8),
        w2_scales=torch.randint(0, 256, (e, lat, inter // 32), generator=g, dtype=torch.uint8))
    monkeypatch.setattr(tm, "available", lambda: (False, "no GPU here"))
    assert tm.rank_moes(w, 0, e) == ({}, "no GPU here")
    built = []
    monkeypatch.setattr(tm, "available", lambda: (True, ""))
    monkeypatch.setattr(tm, "TritonMoE", lambda *args, **kw: built.append((args, kw)) or len(built))
    moes, why = tm.rank_moes(w, 2, 3, (1, 2), device="cpu")
    assert why == "" and moes == {4: 1, 8: 2}
    (w13, s13, w2, s2), kw = built[0]
    assert kw == dict(first=0, count=3, n_experts_total=e, num_warps=4, device="cpu")
    half = inter // 2  # rank 1 of 2: intermediate [64, 128)
    assert torch.equal(w13, torch.cat([w.w13[2:5, half:inter], w.w13[2:5, inter + half:]], 1))
    assert torch.equal(s13, torch.cat([w.w13_scales[2:5, half:inter],
                                       w.w13_scales[2:5, inter + half:]], 1))
    assert torch.equal(w2, w.w2[2:5, :, half // 2:]) and torch.equal(s2, w.w2_scales[2:5, :, half // 32:])
    assert all(t.is_contiguous() for t in (w13, s13, w2, s2))
    assert built[1][1]["num_warps"] == 8
