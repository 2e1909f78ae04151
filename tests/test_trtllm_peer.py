"""The trtllm-gen MoE peer (benchmarks/peers/trtllm_moe.py): everything testable without a
Blackwell GPU.

* the weight conversion: the row orders against independent statements of FlashInfer's
  permutations (the gated interleave of ``[up; gate]``, the literal ``srcToDstBlk32RowMap``
  of ``shuffle_matrix_a``), every code byte and scale byte of a random weight set where the
  stated permutation and the 128x4 offset formula put it, the round trip back to our layout;
* the packing of the top-k ids and weights, and bad input naming the argument;
* ``available()``'s reasons (FlashInfer missing, another version, no GPU, a non-Blackwell
  GPU, a module that does not load) and the constructor's argument checks;
* the call glue and ``check_forward`` over a PyTorch model of the kernel (``_FakeKernel``:
  reads the converted tensors as FlashInfer documents them): it passes, it passes with the
  hidden quantized by the OCP floor rule (the tolerance covers the rule the cubins may
  use), and it fails for each planted layout mistake;
* the experts table's setup and rendering of the peer.

Where FlashInfer 0.7.2.post1 is importable (not the project venv; a separate one on the CPU
suffices), the row orders are also compared with FlashInfer's own index functions.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from benchmarks.peers import trtllm_moe as tm
from model.formats import ScaleRule, dequantize_mxfp4
from reference.mx import dequantize_mxfp8, quantize_mxfp8

# FlashInfer's shuffle_matrix_a for an epilogue tile of 128 (srcToDstBlk32RowMap): source
# row i of a block of 32 goes to row MAP32[i]
MAP32 = [0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27,
         4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31]
MAP16 = [0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15]


def _weights(e=3, lat=256, i=128, seed=0, lo=0, hi=256):
    g = torch.Generator().manual_seed(seed)
    u8 = dict(dtype=torch.uint8, generator=g)
    return (torch.randint(0, 256, (e, 2 * i, lat // 2), **u8), torch.randint(lo, hi, (e, 2 * i, lat // 32), **u8),
            torch.randint(0, 256, (e, lat, i // 2), **u8), torch.randint(lo, hi, (e, lat, i // 32), **u8))


def _offset_128x4(row, col, cols):
    """The byte of scale ``[row, col]`` in FlashInfer's 128x4 layout (``[rows/128, cols/4, 32,
    4, 4]`` tiles: row ``128 t + 32 g + i``, column ``4 c + j`` at ``[t, c, i, g, j]``)."""
    return (((row // 128) * (cols // 4) + col // 4) * 32 + row % 32) * 16 + ((row % 128) // 32) * 4 + col % 4


def _shuffled_source(rows, mapping):
    """Kernel row -> source row of the shuffle, from FlashInfer's source -> destination map."""
    b = len(mapping)
    src = [0] * rows
    for s in range(rows):
        src[s - s % b + mapping[s % b]] = s
    return src


# --------------------------------------------------------------------------------------
# row orders and the conversion
# --------------------------------------------------------------------------------------

def test_row_orders_are_the_stated_permutations():
    # gated: [up; gate] interleaved -> our rows: 2j <- I + j (up), 2j + 1 <- j (gate)
    assert tm.gated_row_order(4).tolist() == [4, 0, 5, 1, 6, 2, 7, 3]
    for rows, mapping, block in ((64, MAP32, 32), (96, MAP32, 32), (32, MAP16, 16)):
        assert tm.shuffle_row_order(rows, block).tolist() == _shuffled_source(rows, mapping)
    inter = 128
    gated, shuffle = tm.gated_row_order(inter), tm.shuffle_row_order(2 * inter)
    order = tm.w13_row_order(inter)
    assert order.tolist() == [gated[shuffle[n]].item() for n in range(2 * inter)]
    assert sorted(order.tolist()) == list(range(2 * inter))
    # kernel rows 0..3: shuffled rows 0, 4, 8, 12 of [u0, g0, u1, g1, ...] = u0, u2, u4, u6
    assert order[:4].tolist() == [inter + 0, inter + 2, inter + 4, inter + 6]
    assert order[8].tolist() == 0  # shuffled row 1 = g0
    assert torch.equal(tm.w2_row_order(256), tm.shuffle_row_order(256))
    with pytest.raises(ValueError, match="rows=48 must be a multiple of the shuffle block 32"):
        tm.shuffle_row_order(48)
    with pytest.raises(ValueError, match="block must be 16 or 32"):
        tm.shuffle_row_order(64, 8)
    with pytest.raises(ValueError, match="intermediate must be an int >= 1"):
        tm.gated_row_order(0)


def test_every_code_and_scale_byte_lands_where_the_permutation_says():
    w = _weights()
    conv = tm.convert_weights(*w)
    inter, lat = 128, 256
    for key, codes, scales, order in (("gemm1", w[0], w[1], tm.w13_row_order(inter)),
                                      ("gemm2", w[2], w[3], tm.w2_row_order(lat))):
        got_codes, got_scales = conv[f"{key}_weights"], conv[f"{key}_weights_scale"]
        assert got_codes.dtype == torch.uint8 and got_codes.shape == codes.shape
        assert got_scales.dtype == torch.float8_e4m3fn and got_scales.shape == scales.shape
        e, n, cols = scales.shape
        flat = got_scales.view(torch.uint8).reshape(e, -1)
        rows = torch.arange(n).view(n, 1)
        col = torch.arange(cols).view(1, cols)
        offsets = _offset_128x4(rows, col, cols)
        for x in range(e):
            assert torch.equal(got_codes[x], codes[x][order])  # each kernel row n = our row order[n]
            assert torch.equal(flat[x][offsets], scales[x][order])  # byte of [n, c] at its tile offset
        assert sorted(offsets.reshape(-1).tolist()) == list(range(n * cols))  # a bijection


def test_round_trip_back_to_our_layout_is_exact():
    w = _weights(e=2, lat=512, i=384, seed=3)
    back = tm.restore_weights(tm.convert_weights(*w))
    for got, want in zip(back, w):
        assert got.dtype == torch.uint8 and torch.equal(got, want)


def test_conversion_refuses_dims_the_kernel_cannot_take():
    with pytest.raises(ValueError, match="latent=192: .* multiple of 128"):
        tm.convert_weights(*_weights(lat=192, i=128))
    with pytest.raises(ValueError, match="intermediate=96: .* multiple of 128"):
        tm.convert_weights(*_weights(lat=256, i=96))
    with pytest.raises(ValueError, match="codes must be uint8"):
        tm.convert_codes(torch.zeros(2, 4, 4, dtype=torch.int8), tm.shuffle_row_order(32)[:4])
    with pytest.raises(ValueError, match="order must be int64 \\[256\\]"):
        tm.convert_scales(_weights()[1], torch.arange(255))
    with pytest.raises(ValueError, match="N % 128 == 0"):
        tm.convert_scales(torch.zeros(1, 64, 8, dtype=torch.uint8), torch.arange(64))


def test_row_orders_equal_flashinfer_index_functions():
    """FlashInfer's own index functions (pure PyTorch), where FlashInfer is importable."""
    try:
        fi = tm.import_flashinfer()
    except ImportError as e:
        pytest.skip(f"{e} (this cross-check runs where flashinfer-python {tm.FLASHINFER_VERSION} is "
                    "installed, a CPU suffices)")
    from flashinfer.fused_moe.core import get_reorder_rows_for_gated_act_gemm_row_indices
    from flashinfer.utils import get_shuffle_matrix_a_row_indices

    assert fi.__version__ == tm.FLASHINFER_VERSION
    for inter in (128, 384, 3072):
        x = torch.zeros(2 * inter, 4, dtype=torch.uint8)
        fi_order = get_reorder_rows_for_gated_act_gemm_row_indices(x)[get_shuffle_matrix_a_row_indices(x, 128)]
        to_ours = (torch.arange(2 * inter) + inter) % (2 * inter)  # [up; gate] row -> our row
        assert torch.equal(to_ours[fi_order], tm.w13_row_order(inter))
    x = torch.zeros(3584, 4, dtype=torch.uint8)
    assert torch.equal(get_shuffle_matrix_a_row_indices(x, 128), tm.w2_row_order(3584))


# --------------------------------------------------------------------------------------
# top-k packing
# --------------------------------------------------------------------------------------

def test_pack_topk_words_and_round_trip():
    ids = torch.tensor([[0, 895], [17, 3]], dtype=torch.int64)
    w = torch.tensor([[0.25, -1.5], [1.0 + 2 ** -9, 0.0]], dtype=torch.float32)
    packed = tm.pack_topk(ids, w)
    assert packed.dtype == torch.int32 and packed.shape == (2, 2)
    # BF16 bits: 0.25 = 0x3E80, -1.5 = 0xBFC0, 1 + 2^-9 rounds (RNE, tie to even) to 1.0 = 0x3F80
    want = [[(0 << 16) | 0x3E80, (895 << 16) | 0xBFC0], [(17 << 16) | 0x3F80, (3 << 16) | 0x0000]]
    assert packed.tolist() == want
    back_ids, back_w = tm.unpack_topk(packed)
    assert back_ids.tolist() == ids.tolist()
    assert back_w.dtype == torch.bfloat16 and torch.equal(back_w, w.to(torch.bfloat16))
    big = tm.pack_topk(torch.tensor([[32767]]), torch.tensor([[-2.0]]))
    assert tm.unpack_topk(big)[0].item() == 32767 and tm.unpack_topk(big)[1].item() == -2.0


@pytest.mark.parametrize("ids,weights,match", [
    (torch.tensor([[-1, 2]]), torch.ones(1, 2), "ids must lie in \\[0, 32767\\]"),
    (torch.tensor([[32768, 2]]), torch.ones(1, 2), "ids must lie in"),
    (torch.tensor([[1.0, 2.0]]), torch.ones(1, 2), "ids must be an int32/int64 \\[R, K\\]"),
    (torch.tensor([1, 2]), torch.ones(2), "ids must be an int32/int64 \\[R, K\\]"),
    (torch.tensor([[1, 2]]), torch.ones(1, 3), "weights must be a float32/bfloat16 \\(1, 2\\)"),
    (torch.tensor([[1, 2]]), torch.ones(1, 2, dtype=torch.float64), "weights must be a float32/bfloat16"),
    (torch.tensor([[1, 2]]), torch.tensor([[1.0, float("nan")]]), "weights must be finite"),
])
def test_pack_topk_names_the_bad_argument(ids, weights, match):
    with pytest.raises(ValueError, match=match):
        tm.pack_topk(ids, weights)


def test_pack_topk_without_checks_does_not_look_at_values():
    packed = tm.pack_topk(torch.tensor([[5]]), torch.tensor([[float("inf")]]), check=False)
    assert tm.unpack_topk(packed)[0].item() == 5 and tm.unpack_topk(packed)[1].item() == float("inf")
    with pytest.raises(ValueError, match="ids must be an int32/int64"):
        tm.pack_topk(torch.tensor([[5.0]]), torch.ones(1, 1), check=False)
    with pytest.raises(ValueError, match="unpack|packed must be an int32"):
        tm.unpack_topk(torch.zeros(1, 1))


# --------------------------------------------------------------------------------------
# availability and argument checks
# --------------------------------------------------------------------------------------

@pytest.fixture
def fresh_module_state(monkeypatch):
    monkeypatch.setattr(tm, "_MODULE_LOADED", False)
    monkeypatch.setattr(tm, "_MODULE_ERROR", None)


def _fake_flashinfer(monkeypatch, version):
    mod = types.ModuleType("flashinfer")
    mod.__version__ = version
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    for sub in ("flashinfer.fused_moe", "flashinfer.fused_moe.core", "flashinfer.artifacts", "flashinfer.jit"):
        monkeypatch.setitem(sys.modules, sub, None)  # importing them raises ImportError
    return mod


def test_available_names_each_missing_piece(monkeypatch, fresh_module_state):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    ok, why = tm.available()
    assert not ok and "FlashInfer is not importable" in why and "flashinfer-python==0.7.2.post1" in why
    _fake_flashinfer(monkeypatch, "0.7.4")
    ok, why = tm.available()
    assert not ok and "FlashInfer 0.7.4 is installed" in why and "0.7.2.post1" in why
    _fake_flashinfer(monkeypatch, tm.FLASHINFER_VERSION)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ok, why = tm.available()
    assert not ok and "no CUDA GPU visible" in why
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    ok, why = tm.available()
    assert not ok and "sm_100a/sm_103a" in why and "this GPU is sm_90" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 3))
    ok, why = tm.available()  # the fake has no trtllm-gen module to load
    assert not ok and "module did not load" in why and "ModuleNotFoundError" in why
    assert tm.rank_moe(None, 0, 56) == (None, why)


def test_available_on_this_machine_gives_a_reason():
    ok, why = tm.available()
    if torch.cuda.is_available() and tuple(torch.cuda.get_device_capability()) in tm.SUPPORTED_CAPABILITIES:
        pytest.skip("a Blackwell GPU is visible: the peer may run here")
    assert not ok and why and ("FlashInfer" in why or "GPU" in why)
    assert "error" in tm.versions() or tm.versions()["flashinfer"] == tm.FLASHINFER_VERSION


@pytest.mark.parametrize("kw,match", [
    (dict(activation="gelu"), "activation must be one of \\['situ', 'swiglu'\\]"),
    (dict(situ_beta=0.0), "situ_beta must be a finite positive float"),
    (dict(situ_linear_beta=float("inf")), "situ_linear_beta must be a finite positive float"),
    (dict(first=2, count=2), "pass either all experts"),
    (dict(first=-1), "first must be an int >= 0"),
    (dict(n_experts_total=2), "n_experts_total must be an int >= 3"),
    (dict(n_experts_total=40000), "the packed ids hold at most 32768 experts"),
    (dict(tune_max_num_tokens=0), "tune_max_num_tokens must be an int >= 1"),
])
def test_constructor_names_the_bad_argument(kw, match):
    with pytest.raises(ValueError, match=match):
        tm.TrtllmGenMoE(*_weights(), device="cpu", **kw)


def test_calls_on_the_cpu_without_a_kernel_and_shape_checks():
    moe = tm.TrtllmGenMoE(*_weights(), first=1, count=2, n_experts_total=8, device="cpu")
    assert (moe.first, moe.count, moe.n_experts_total) == (1, 2, 8)
    assert moe.weights["gemm1_weights"].shape == (2, 256, 128)
    assert moe.gemm1_alpha.tolist() == [4.0, 4.0] and moe.gemm1_beta.tolist() == [25.0, 25.0]
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    ids, w = torch.tensor([[1, 2], [0, 3]]), torch.full((2, 2), 0.5)
    with pytest.raises(RuntimeError, match="without a kernel; calls need an SM100/SM103 GPU"):
        moe(x, ids, w)
    moe._kernel = _FakeKernel()
    codes, scales = quantize_mxfp8(x)
    with pytest.raises(ValueError, match="codes \\[R, 256\\], scales \\[R, 8\\] and packed \\[R, K\\] must agree"):
        moe.call_packed(codes, scales[:, :4], tm.pack_topk(ids, w))
    swiglu = tm.TrtllmGenMoE(*_weights(), activation="swiglu", device="cpu")
    assert swiglu.gemm1_alpha is None and swiglu.gemm1_beta is None
    assert "SwiGLU" in swiglu.describe()["activation"] and "SiTU" in moe.describe()["activation"]
    local_only = tm.TrtllmGenMoE(*_weights(e=2), first=5, count=2, device="cpu")
    assert (local_only.first, local_only.n_experts_total) == (5, 7)


# --------------------------------------------------------------------------------------
# the call glue and check_forward over a PyTorch model of the kernel
# --------------------------------------------------------------------------------------

class _FakeKernel:
    """A PyTorch model of ``trtllm_fp4_block_scale_routed_moe`` (MXFP4 weights, MXFP8
    activations, packed pre-computed routing, ``do_finalize``) reading the converted tensors
    as FlashInfer 0.7.2.post1 documents them: scales in 128x4 tiles (``_offset_128x4``), rows
    shuffled by ``MAP32``, FC1 rows ``[x0 (linear), x1 (gate)]`` interleaved; the gated
    activation on FP32; the hidden re-quantized to MXFP8 (``rule``); FC2 -> BF16 per pair;
    the routing weights (BF16) applied and summed in FP32 -> BF16. ``bug`` plants one
    misreading (as if the conversion had the matching mistake)."""

    def __init__(self, bug=None, rule=ScaleRule.RCEIL):
        self.bug, self.rule, self.calls = bug, rule, []

    def _linear_scales(self, sf):
        e, n, cols = sf.shape
        flat = sf.view(torch.uint8).reshape(e, -1)
        if self.bug == "scales_not_tiled":
            return flat.reshape(e, n, cols)
        off = _offset_128x4(torch.arange(n).view(n, 1), torch.arange(cols).view(1, cols), cols)
        return flat[:, off]

    def _unshuffle(self, t):
        if self.bug == "not_shuffled":
            return t
        src = torch.tensor(_shuffled_source(t.shape[1], MAP32))
        out = torch.empty_like(t)
        out[:, src] = t
        return out

    def _activate(self, h, alpha, beta, activation_type):
        x0, x1 = h[:, 0::2], h[:, 1::2]
        if self.bug == "gate_first":
            x0, x1 = x1, x0
        if activation_type == 3:
            return x1 * torch.sigmoid(x1) * x0
        if self.bug == "alpha_beta_swapped":
            alpha, beta = beta, alpha
        return beta * torch.tanh(x0 / beta) * alpha * torch.tanh(x1 / alpha) * torch.sigmoid(x1)

    def __call__(self, **kw):
        self.calls.append(kw)
        self._check(kw)
        ids, rw = tm.unpack_topk(kw["topk_ids"])
        x = dequantize_mxfp8(kw["hidden_states"], kw["hidden_states_scale"].view(torch.uint8)).double()
        w13 = self._unshuffle(kw["gemm1_weights"])
        s13 = self._unshuffle(self._linear_scales(kw["gemm1_weights_scale"]))
        w2 = self._unshuffle(kw["gemm2_weights"])
        s2 = self._unshuffle(self._linear_scales(kw["gemm2_weights_scale"]))
        acc = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32)
        first = kw["local_expert_offset"]
        for e in range(kw["local_num_experts"]):
            rows, slots = (ids == first + e).nonzero(as_tuple=True)
            if not rows.numel():
                continue
            h = (x[rows] @ dequantize_mxfp4(w13[e], s13[e]).double().T).float()
            alpha = kw["gemm1_alpha"][e] if kw["gemm1_alpha"] is not None else 1.0
            beta = kw["gemm1_beta"][e] if kw["gemm1_beta"] is not None else 1.0
            a = self._activate(h, alpha, beta, kw["activation_type"])
            a = dequantize_mxfp8(*quantize_mxfp8(a.float(), scale_rule=self.rule)).double()
            o = (a @ dequantize_mxfp4(w2[e], s2[e]).double().T).to(torch.bfloat16).float()
            acc.index_add_(0, rows, o * rw[rows, slots].float().unsqueeze(1))
        kw["output"].copy_(acc.to(torch.bfloat16))
        return [kw["output"]]

    @staticmethod
    def _check(kw):
        """What the launcher checks (dtypes, shapes, the MXFP4 x MXFP8 pair)."""
        r, lat = kw["hidden_states"].shape
        count = kw["local_num_experts"]
        assert kw["hidden_states"].dtype == torch.float8_e4m3fn
        assert kw["hidden_states_scale"].dtype == torch.float8_e4m3fn
        assert tuple(kw["hidden_states_scale"].shape) == (r, lat // 32)
        assert kw["topk_ids"].dtype == torch.int32 and kw["topk_ids"].shape[0] == r
        assert kw["top_k"] == kw["topk_ids"].shape[1]
        for k in ("gemm1_weights", "gemm2_weights"):
            assert kw[k].dtype == torch.uint8 and kw[k].shape[0] == count
        for k in ("gemm1_weights_scale", "gemm2_weights_scale"):
            assert kw[k].dtype == torch.float8_e4m3fn and kw[k].shape[0] == count
        assert kw["gemm1_weights"].shape[1] == 2 * kw["intermediate_size"]
        assert kw["do_finalize"] is True and kw["routing_method_type"] == tm.ROUTING_METHOD_TOPK
        assert kw["activation_type"] in (3, 10) and kw["hidden_states_scale_layout"] == "layout_linear"
        assert kw["output"].dtype == torch.bfloat16 and tuple(kw["output"].shape) == (r, lat)
        for k in ("gemm1_alpha", "gemm1_beta", "output1_scale_scalar", "output2_scale_scalar"):
            assert kw[k] is None or (kw[k].dtype == torch.float32 and tuple(kw[k].shape) == (count,))
        assert kw["local_expert_offset"] + count <= kw["num_experts"]


@pytest.mark.parametrize("activation", sorted(tm.ACTIVATIONS))
@pytest.mark.parametrize("bf16_input", [False, True])
def test_check_forward_passes_on_the_model_of_the_kernel(activation, bf16_input):
    kernel = _FakeKernel()
    res = tm.check_forward(activation=activation, bf16_input=bf16_input, device="cpu", _kernel=kernel)
    assert res["ok"] and res["rows_without_local_pair"] >= 1 and res["zero_rows_ok"], res
    assert res["worst_row_rel_err"] < 2.0 ** -7 and res["hidden_rule"] == "rceil", res  # BF16 roundings only
    assert len(kernel.calls) == 1 and kernel.calls[0]["activation_type"] == tm.ACTIVATIONS[activation]
    assert (kernel.calls[0]["local_expert_offset"], kernel.calls[0]["local_num_experts"]) == (8, 12)
    assert kernel.calls[0]["num_experts"] == 32


@pytest.mark.parametrize("rule", list(ScaleRule))
def test_check_forward_names_the_hidden_scale_rule_the_kernel_uses(rule):
    """The cubins' rule for the hidden's MXFP8 scales is not in the source: a kernel using
    RCEIL or the OCP floor rule passes, the matching model is named, and the two models are
    told apart (the other one is off by more than the tolerance for some row)."""
    res = tm.check_forward(device="cpu", _kernel=_FakeKernel(rule=rule))
    assert res["ok"] and res["hidden_rule"] == rule.value, res
    other = [v for k, v in res["row_rel_err_by_rule"].items() if k != rule.value]
    assert other[0] > tm.TOLERANCE > res["worst_row_rel_err"], res


@pytest.mark.parametrize("bug", ["not_shuffled", "gate_first", "scales_not_tiled", "alpha_beta_swapped"])
def test_check_forward_catches_each_layout_mistake(bug):
    res = tm.check_forward(device="cpu", _kernel=_FakeKernel(bug=bug), raise_on_fail=False)
    assert not res["ok"] and res["worst_row_rel_err"] > 2.0 ** -2, res
    with pytest.raises(AssertionError, match="trtllm-gen peer forward check failed"):
        tm.check_forward(device="cpu", _kernel=_FakeKernel(bug=bug))


def test_check_forward_fails_when_rows_without_local_pairs_are_not_zero():
    class Leaky(_FakeKernel):
        def __call__(self, **kw):
            out = super().__call__(**kw)[0]
            out[0] = 1.0  # row 0 has no local pair
            return [out]
    res = tm.check_forward(device="cpu", _kernel=Leaky(), raise_on_fail=False)
    assert not res["ok"] and not res["zero_rows_ok"]


def test_autotune_is_not_attempted_without_flashinfer():
    kernel = _FakeKernel()
    moe = tm.TrtllmGenMoE(*_weights(e=4, lo=120, hi=124), device="cpu", kernel=kernel)
    assert moe.autotune and moe._fi is None
    x = torch.randn(3, 256).to(torch.bfloat16)
    ids, w = torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.full((3, 2), 0.5)
    y = moe(x, ids, w)
    assert y.shape == (3, 256) and y.dtype == torch.bfloat16 and len(kernel.calls) == 1
    assert moe.bytes_streamed(ids) == 4 * moe.bytes_per_expert


# --------------------------------------------------------------------------------------
# the experts table
# --------------------------------------------------------------------------------------

def test_experts_table_trtllm_setup_reports_why_not_and_render_says_not_run(monkeypatch):
    from benchmarks.experts_table import render, trtllm_setup

    monkeypatch.setattr(tm, "available", lambda: (False, "the trtllm-gen MXFP4 MoE needs an SM100/SM103 GPU"))
    result = {}
    assert trtllm_setup(["triton"], result) is None and result == {}
    assert trtllm_setup(["trtllm"], result) is None
    assert result["trtllm_error"] == "the trtllm-gen MXFP4 MoE needs an SM100/SM103 GPU"
    case = {"mode": "dep16", "size": 4, "skew": 0.0, "touched": 50, "limit_us": 200.0,
            "median_us": {"engine": 250.0, "triton_w4": 500.0}}
    text = render(dict(result, device="X", torch="t", read_gbs=4500.0, cases=[case]))
    assert "trtllm: not run: the trtllm-gen MXFP4 MoE needs an SM100/SM103 GPU" in text
    assert "trtllm best" not in text


def test_experts_table_renders_trtllm_columns():
    from benchmarks.experts_table import render

    case = {"mode": "dep16", "size": 4, "skew": 0.0, "touched": 50, "limit_us": 200.0,
            "median_us": {"engine": 250.0, "triton_w4": 500.0, "trtllm_mx": 300.0, "trtllm_bf16": 320.0}}
    text = render({"device": "X", "torch": "t", "read_gbs": 4500.0, "cases": [case]})
    assert "| trtllm best us (frac) | engine / trtllm |" in text
    assert "| 300.0 (0.67) owner mx | 1.20x |" in text
