"""FlashInfer's SM90 CUTLASS MoE peer (benchmarks/peers/flashinfer_sm90_moe.py) and the script
that builds its library (tools/build_flashinfer_sm90.py): everything testable without a GPU.

* the weight conversion: the code interleave against a literal, loop-by-loop port of
  FlashInfer's CUDA kernel (``interleave_fp4_weights_for_sm90_mixed_gemm_kernel``), the
  scale fold against the index formula of ``interleave_moe_scales_for_sm90_mixed_gemm``, the
  ``[up; gate]`` row order, the round trip back to our layout (a pure permutation);
* the expert-parallel mapping of a rank's experts onto ``ep_size`` / ``ep_rank``;
* ``check_forward`` over a PyTorch model of ``cutlass_fused_moe`` (``_FakeCutlassMoE``: reads
  the converted tensors as the runner does): it passes in both precisions, activations and
  layouts, and fails for each planted layout mistake;
* the library: the build script's manifest read back by the peer, a size or SHA-256
  mismatch refused, the variant chosen; ``available()``'s reason for each missing piece;
  the libraries in ``.gpu/peers/flashinfer_sm90`` against their manifests, and loaded with
  ``tvm_ffi`` where that is importable (not in the project venv);
* the build script's pure-Python steps (launcher selection and regrouping, the reduced
  instantiation unit and ninja file, the stub list and its assembly);
* the experts table's setup and rendering of the peer.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from benchmarks.peers import flashinfer_sm90_moe as fm
from model.formats import dequantize_mxfp4, e4m3_to_float32, float32_to_e4m3
from tools import build_flashinfer_sm90 as build

REPO = Path(__file__).resolve().parents[1]

# interleave_fp4_weights_for_sm90_mixed_gemm_kernel's bit moves as written in its source
# (moe_gemm_mixed_utils.cu of FlashInfer 0.7.2.post1): out |= (raw & mask) << s, or >> s
LITERAL_MOVES = [
    (0b00000000000000000000000010000000, "<<", 24), (0b00000000000000000000000001110000, "<<", 18),
    (0b00000000000000000000000000001000, "<<", 12), (0b00000000000000000000000000000111, "<<", 6),
    (0b00000000000000001000000000000000, "<<", 13), (0b00000000000000000111000000000000, "<<", 7),
    (0b00000000000000000000100000000000, "<<", 1), (0b00000000000000000000011100000000, ">>", 5),
    (0b00000000100000000000000000000000, "<<", 2), (0b00000000011100000000000000000000, ">>", 4),
    (0b00000000000010000000000000000000, ">>", 10), (0b00000000000001110000000000000000, ">>", 16),
    (0b10000000000000000000000000000000, ">>", 1), (0b00010000000000000000000000000000, "<<", 1),
    (0b01100000000000000000000000000000, ">>", 3), (0b00001000000000000000000000000000, ">>", 13),
    (0b00000001000000000000000000000000, ">>", 11), (0b00000110000000000000000000000000, ">>", 15),
]


def _literal_interleave(weight: torch.Tensor) -> torch.Tensor:
    """The CUDA kernel's loops, one expert ``[rows, cols/2]`` (blockDim.x = 16 lanes)."""
    rows, half = weight.shape
    cols = 2 * half
    src = weight.reshape(-1).tolist()
    dst = [None] * len(src)
    for block_id in range(rows // 2):
        for partition_id in range(cols // 64):
            for lane_id in range(16):
                row_id = block_id // 8 * 16 + block_id % 8
                mma_id = lane_id // 4
                dst_row_id = row_id + (mma_id % 2) * 8
                interleaved_lane_id = lane_id // 8 * 16 + (lane_id % 4) * 4
                col_id = partition_id * 32 + mma_id * 8 + lane_id % 4
                dst_col_id = partition_id * 32 + interleaved_lane_id
                first = row_id * cols // 2 + col_id
                second = (row_id + 8) * cols // 2 + col_id
                raw = src[first] | src[second] << 8 | src[first + 4] << 16 | src[second + 4] << 24
                out = 0
                for mask, op, s in LITERAL_MOVES:
                    out |= ((raw & mask) << s) if op == "<<" else ((raw & mask) >> s)
                dst_id = dst_row_id * cols // 2 + dst_col_id
                for j in range(4):
                    dst[dst_id + j] = (out >> (8 * j)) & 0xFF
    assert None not in dst  # every byte written once
    return torch.tensor(dst, dtype=torch.uint8).reshape(rows, half)


def _weights(e=3, lat=256, i=128, seed=0, lo=121, hi=126):
    g = torch.Generator().manual_seed(seed)
    u8 = dict(dtype=torch.uint8, generator=g)
    return (torch.randint(0, 256, (e, 2 * i, lat // 2), **u8), torch.randint(lo, hi, (e, 2 * i, lat // 32), **u8),
            torch.randint(0, 256, (e, lat, i // 2), **u8), torch.randint(lo, hi, (e, lat, i // 32), **u8))


# --------------------------------------------------------------------------------------
# the conversion
# --------------------------------------------------------------------------------------

def test_bit_moves_are_the_kernels_and_a_permutation():
    assert [(m, s if op == "<<" else -s) for m, op, s in LITERAL_MOVES] == list(fm.INTERLEAVE_BIT_MOVES)
    dest = [None] * 32
    for m, op, s in LITERAL_MOVES:
        for b in range(32):
            if m >> b & 1:
                assert dest[b] is None
                dest[b] = b + s if op == "<<" else b - s
    assert sorted(dest) == list(range(32))


@pytest.mark.parametrize("rows,cols", [(16, 64), (32, 128), (48, 192)])
def test_code_interleave_equals_the_literal_kernel(rows, cols):
    g = torch.Generator().manual_seed(rows + cols)
    codes = torch.randint(0, 256, (2, rows, cols // 2), dtype=torch.uint8, generator=g)
    got = fm.interleave_fp4_codes(codes, chunk_experts=1)
    for e in range(2):
        assert torch.equal(got[e], _literal_interleave(codes[e]))
    assert not torch.equal(got, codes)
    assert torch.equal(fm.deinterleave_fp4_codes(got), codes)
    assert torch.equal(fm.interleave_fp4_codes(codes, chunk_experts=2), got)  # chunking changes nothing


def test_code_interleave_refuses_shapes_the_kernel_cannot_take():
    with pytest.raises(ValueError, match="N % 16 == 0 and K % 64 == 0"):
        fm.interleave_fp4_codes(torch.zeros(1, 8, 32, dtype=torch.uint8))
    with pytest.raises(ValueError, match="N % 16 == 0 and K % 64 == 0"):
        fm.interleave_fp4_codes(torch.zeros(1, 16, 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="codes must be uint8 \\[E, N, K/2\\]"):
        fm.interleave_fp4_codes(torch.zeros(16, 32, dtype=torch.uint8))


def test_scale_fold_is_the_documented_index_formula():
    g = torch.Generator().manual_seed(1)
    e, n, groups = 2, 128, 8
    scales = torch.randint(0, 256, (e, n, groups), dtype=torch.uint8, generator=g)
    folded = fm.interleave_scales(scales)
    assert folded.dtype == torch.uint8 and folded.shape == (e, n // 64, groups // 4, 16, 16)
    for row in range(n):
        for col in range(groups):
            a, b, i, d, f = row // 64, (row % 64) // 16, row % 16, col // 4, col % 4
            assert torch.equal(folded[:, a, d, i, 4 * b + f], scales[:, row, col])
    assert torch.equal(fm.deinterleave_scales(folded), scales)
    assert folded.view(torch.int32).shape == (e, n // 64, groups // 4, 16, 4)  # how the runner takes it
    with pytest.raises(ValueError, match="N % 64 == 0 and K % 128 == 0"):
        fm.interleave_scales(torch.zeros(1, 32, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="folded scales must be uint8"):
        fm.deinterleave_scales(torch.zeros(1, 2, 2, 16, 8, dtype=torch.uint8))


def test_scale_fold_equals_flashinfers_function():
    """FlashInfer's own (pure PyTorch) fold, where FlashInfer 0.7.2.post1 is importable."""
    try:
        fm.import_flashinfer()
        from flashinfer.fused_moe.prepare import interleave_moe_scales_for_sm90_mixed_gemm
    except ImportError as e:
        pytest.skip(f"{e} (this cross-check runs where flashinfer-python {fm.FLASHINFER_VERSION} is installed; "
                    "a CPU suffices)")
    scales = torch.randint(0, 256, (3, 256, 16), dtype=torch.uint8)
    assert torch.equal(interleave_moe_scales_for_sm90_mixed_gemm(scales), fm.interleave_scales(scales))


def test_fc1_rows_are_up_then_gate():
    assert fm.fc1_row_order(4).tolist() == [4, 5, 6, 7, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="intermediate must be an int >= 1"):
        fm.fc1_row_order(0)


def test_every_row_lands_where_the_runner_reads_it_and_the_round_trip_is_exact():
    w = _weights(e=2, lat=512, i=384, seed=3, lo=0, hi=256)
    conv = fm.convert_weights(*w)
    inter = 384
    assert conv["fc1_expert_weights"].shape == (2, 2 * inter, 256)
    assert conv["fc1_expert_scales"].shape == (2, 2 * inter // 64, 512 // 128, 16, 16)
    assert conv["fc2_expert_scales"].shape == (2, 512 // 64, inter // 128, 16, 16)
    codes = fm.deinterleave_fp4_codes(conv["fc1_expert_weights"])
    scales = fm.deinterleave_scales(conv["fc1_expert_scales"])
    for n in (0, 1, inter - 1, inter, 2 * inter - 1):  # kernel row n: up rows, then gate rows
        ours = (n + inter) % (2 * inter)
        assert torch.equal(codes[:, n], w[0][:, ours]) and torch.equal(scales[:, n], w[1][:, ours])
    back = fm.restore_weights(conv)
    for got, want in zip(back, w):
        assert got.dtype == torch.uint8 and torch.equal(got, want)


def test_conversion_refuses_dims_the_kernel_cannot_take():
    with pytest.raises(ValueError, match="latent=192: .* multiple of 128"):
        fm.convert_weights(*_weights(lat=192, i=128))
    with pytest.raises(ValueError, match="intermediate=96: .* multiple of 128"):
        fm.convert_weights(*_weights(lat=256, i=96))


def test_expert_parallel_maps_a_rank_onto_ep_size_and_ep_rank():
    assert fm.expert_parallel(0, 56, 896) == (16, 0, 0)  # a DEP16 rank: ids go in unchanged
    assert fm.expert_parallel(280, 56, 896) == (16, 5, 0)
    assert fm.expert_parallel(0, 896, 896) == (1, 0, 0)  # a TP8 rank: all experts
    assert fm.expert_parallel(8, 12, 32) == (3, 0, 8)  # not a multiple: ids lowered by 8
    assert fm.expert_parallel(26, 4, 32) == (8, 6, 2)
    with pytest.raises(ValueError, match="n_experts_total must be an int >= 20"):
        fm.expert_parallel(8, 12, 16)
    for first, count, total in ((8, 12, 32), (26, 4, 32), (12, 12, 32), (28, 4, 32)):
        ep_size, ep_rank, shift = fm.expert_parallel(first, count, total)
        ids = torch.arange(-1, total)
        local = (ids - shift >= ep_rank * count) & (ids - shift < (ep_rank + 1) * count)
        assert torch.equal(local, (ids >= first) & (ids < first + count))
        assert ep_rank < ep_size and ep_size * count >= total - shift


# --------------------------------------------------------------------------------------
# check_forward over a PyTorch model of cutlass_fused_moe
# --------------------------------------------------------------------------------------

def _fake_humming_prepare(codes, scales):
    """A stand-in for FlashInfer's Humming preparation (codes and scales in the W4A16
    layouts, residual ``2^-6`` so that residual x 2^6 = 1): the glue is what is tested."""
    return (fm.interleave_fp4_codes(codes), fm.interleave_scales(scales),
            torch.full((codes.shape[0],), 2.0 ** -6, dtype=torch.float32))


class _FakeCutlassMoE:
    """A PyTorch model of ``cutlass_fused_moe`` on the SM90 MXFP4 paths, reading its
    arguments as the C++ runner does: local experts ``[ep_rank E_loc, (ep_rank + 1) E_loc)``,
    every other id dropped; codes interleaved and scales folded (decoded with the module's
    inverses, which the tests above prove inverse to the literal kernel); FC1 rows ``[up;
    gate]``; FP32 GEMMs, BF16 ``h``; the activation in FP32 (SiTU's tanh as ``2 sigmoid(2z) -
    1``) -> BF16 (W4A8: FP8 rows of ``x`` and of the activation, the residuals); BF16 per
    pair; FP32 weighted sum -> BF16. ``bug`` plants one misreading."""

    def __init__(self, bug=None):
        self.bug, self.calls = bug, []

    def _decode(self, codes, folded):
        if self.bug != "codes_not_interleaved":
            codes = fm.deinterleave_fp4_codes(codes)
        e, n, half = codes.shape
        if self.bug == "scales_not_folded":
            scales = folded.reshape(e, n, half * 2 // 32)
        else:
            scales = fm.deinterleave_scales(folded)
        return torch.stack([dequantize_mxfp4(codes[i], scales[i]) for i in range(e)])

    def _activate(self, h, beta, linear_beta, activation_type):
        inter = h.shape[1] // 2
        up, gate = h[:, :inter], h[:, inter:]
        if self.bug == "gate_first":
            up, gate = gate, up
        if activation_type == 3:
            return torch.nn.functional.silu(gate) * up
        if self.bug == "betas_swapped":
            beta, linear_beta = linear_beta, beta

        def tanh(z):
            return torch.sigmoid(z * 2.0) * 2.0 - 1.0
        return (tanh(gate / beta) * torch.sigmoid(gate) * beta) * (tanh(up / linear_beta) * linear_beta)

    @staticmethod
    def _fp8_rows(v):
        codes, q = fm.fp8_rows(v)
        return codes.float(), q.float()

    def __call__(self, **kw):
        self.calls.append(kw)
        self._check(kw)
        x, ids, rw = kw["input"], kw["token_selected_experts"], kw["token_final_scales"]
        humming = kw["use_wfp4afp8_humming"]
        scales = kw["quant_scales"]
        s1, s2 = (scales[0], scales[3]) if humming else scales
        w13 = self._decode(kw["fc1_expert_weights"], s1.view(torch.uint8))
        w2 = self._decode(kw["fc2_expert_weights"], s2.view(torch.uint8))
        e_loc = w13.shape[0]
        start = kw["ep_rank"] * e_loc
        acc = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32)
        xf = x.float()
        if humming:
            xf, xq = self._fp8_rows(xf)
        for e in range(e_loc):
            rows, slots = (ids == start + e).nonzero(as_tuple=True)
            if not rows.numel():
                continue
            beta = kw["situ_beta"][e] if kw["situ_beta"] is not None else None
            linear_beta = kw["situ_linear_beta"][e] if kw["situ_linear_beta"] is not None else None
            if humming:
                h = ((xf[rows] @ w13[e].T) * (scales[1][e] / xq[rows])).to(torch.bfloat16).float()
                a, aq = self._fp8_rows(self._activate(h, beta, linear_beta, kw["activation_type"]))
                o = ((a @ w2[e].T) * (scales[4][e] / aq)).to(torch.bfloat16).float()
            else:
                h = (xf[rows] @ w13[e].T).to(torch.bfloat16).float()
                a = self._activate(h, beta, linear_beta, kw["activation_type"]).to(torch.bfloat16).float()
                o = (a @ w2[e].T).to(torch.bfloat16).float()
            acc.index_add_(0, rows, o * rw[rows, slots].unsqueeze(1))
        kw["output"].copy_(acc.to(torch.bfloat16))
        return [kw["output"], None, None, None]

    @staticmethod
    def _check(kw):
        """What the binding and ``cutlass_fused_moe`` check (dtypes, shapes, the MXFP4 flags)."""
        r, lat = kw["input"].shape
        e_loc, two_i, half_l = kw["fc1_expert_weights"].shape
        assert kw["input"].dtype == torch.bfloat16 and kw["input"].is_contiguous()
        assert kw["token_selected_experts"].dtype == torch.int32 and kw["token_selected_experts"].shape[0] == r
        assert kw["token_final_scales"].dtype == torch.float32
        assert kw["token_final_scales"].shape == kw["token_selected_experts"].shape
        assert kw["fc1_expert_weights"].dtype == torch.uint8 and half_l * 2 == lat
        assert tuple(kw["fc2_expert_weights"].shape) == (e_loc, lat, two_i // 4)
        assert kw["use_w4_group_scaling"] is True and kw["output_dtype"] == torch.bfloat16
        assert kw["output"].dtype == torch.bfloat16 and tuple(kw["output"].shape) == (r, lat)
        assert 0 <= kw["ep_rank"] < kw["ep_size"]
        qs = kw["quant_scales"]
        if kw["use_wfp4afp8_humming"]:
            assert len(qs) == 5 and qs[0].dtype == qs[3].dtype == torch.int32
            assert qs[1].dtype == qs[4].dtype == torch.float32 and tuple(qs[1].shape) == (e_loc,)
            assert qs[2].dtype == torch.float32 and qs[2].dim() == 0
        else:
            assert len(qs) == 2 and qs[0].dtype == qs[1].dtype == torch.int32
        assert tuple(qs[0].shape) == (e_loc, two_i // 64, lat // 128, 16, 4)
        assert kw["activation_type"] in (3, 10)
        for k in ("situ_beta", "situ_linear_beta"):
            if kw["activation_type"] == 3:
                assert kw[k] is None
            else:
                assert kw[k].dtype == torch.float32 and tuple(kw[k].shape) == (e_loc,)


PRECISION_KW = {"w4a16": {}, "w4a8": {"humming_prepare": _fake_humming_prepare}}


@pytest.mark.parametrize("precision", fm.PRECISIONS)
@pytest.mark.parametrize("activation", sorted(fm.ACTIVATIONS))
@pytest.mark.parametrize("layout", fm.LAYOUTS)
@pytest.mark.parametrize("first", [8, 12])
def test_check_forward_passes_on_the_model_of_the_kernel(precision, activation, layout, first):
    kernel = _FakeCutlassMoE()
    res = fm.check_forward(precision=precision, activation=activation, layout=layout, first=first, device="cpu",
                           _kernel=kernel, **PRECISION_KW[precision])
    assert res["ok"] and res["rows_without_local_pair"] >= 1 and res["zero_rows_ok"], res
    assert res["worst_row_rel_err"] < fm.TOLERANCE[precision] / 2, res
    call = kernel.calls[0]
    assert call["activation_type"] == fm.ACTIVATIONS[activation]
    assert (call["ep_size"], call["ep_rank"]) == ((3, 0) if first == 8 else (3, 1))
    assert res["config"]["id_shift"] == (8 if first == 8 else 0)
    if precision == "w4a8":  # the FP8 activations cost accuracy: the W4A16 model is further away
        assert res["row_rel_err_vs_w4a16"] > 4 * res["worst_row_rel_err"], res
    if layout == "compact":  # only the rows with a local pair went in
        assert call["input"].shape[0] < 24


@pytest.mark.parametrize("bug", ["codes_not_interleaved", "scales_not_folded", "gate_first", "betas_swapped"])
@pytest.mark.parametrize("precision", fm.PRECISIONS)
def test_check_forward_catches_each_layout_mistake(bug, precision):
    res = fm.check_forward(precision=precision, device="cpu", _kernel=_FakeCutlassMoE(bug=bug), raise_on_fail=False,
                           **PRECISION_KW[precision])
    assert not res["ok"] and res["worst_row_rel_err"] > 2.0 ** -2, res
    with pytest.raises(AssertionError, match="FlashInfer SM90 peer forward check failed"):
        fm.check_forward(precision=precision, device="cpu", _kernel=_FakeCutlassMoE(bug=bug),
                         **PRECISION_KW[precision])


def test_check_forward_fails_when_rows_without_local_pairs_are_not_zero_or_ids_are_not_shifted():
    class Leaky(_FakeCutlassMoE):
        def __call__(self, **kw):
            out = super().__call__(**kw)[0]
            out[0] = 1.0  # row 0 has no local pair
            return [out]
    res = fm.check_forward(device="cpu", _kernel=Leaky(), raise_on_fail=False)
    assert not res["ok"] and not res["zero_rows_ok"]

    class Unshifted(fm.FlashInferSm90MoE):  # the ids passed as they are
        def _owner(self, x, ids, weights):
            self.id_shift = 0
            return super()._owner(x, ids, weights)
    kw = dict(first=6, count=4, n_experts_total=16, device="cpu")  # ep_rank 1, ids lowered by 2
    x = torch.randn(2, 256).to(torch.bfloat16)
    ids, rw = torch.tensor([[8, 9], [0, 1]], dtype=torch.int32), torch.full((2, 2), 0.5)
    y = fm.FlashInferSm90MoE(*_weights(e=4), kernel=_FakeCutlassMoE(), **kw)(x, ids, rw)
    assert bool((y[0] != 0).any()) and bool((y[1] == 0).all())
    y = Unshifted(*_weights(e=4), kernel=_FakeCutlassMoE(), **kw)(x, ids, rw)
    assert bool((y[0] == 0).all())  # experts 8, 9 read as non-local: the shift is what maps them


def test_fp8_rows_is_the_runners_per_row_quantization():
    v = torch.tensor([[1.0, -0.5, 0.25, 3.0], [0.0, 0.0, 0.0, 0.0], [1e-3, 2e-3, -4e-3, 0.0]])
    codes, q = fm.fp8_rows(v)
    f32 = torch.tensor  # the quotients in FP32, as the runner divides
    assert q[:, 0].tolist() == [float(f32(448.0) / f32(3.0)), 1.0, float(f32(448.0) / f32(4e-3))]
    assert codes[0, 3] == 448.0 and codes[1].abs().sum() == 0
    want = e4m3_to_float32(float32_to_e4m3(v * q.float())).double()
    assert torch.equal(codes, want)


def test_reference_forward_rejects_an_unknown_precision():
    with pytest.raises(ValueError, match="precision must be one of"):
        fm.reference_forward(torch.zeros(1, 256), torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1),
                             _weights(e=1), first=0, precision="w4a4")


@pytest.mark.parametrize("kw,match", [
    (dict(precision="w4a4"), "precision must be one of \\['w4a16', 'w4a8'\\]"),
    (dict(activation="gelu"), "activation must be one of \\['situ', 'swiglu'\\]"),
    (dict(layout="rows"), "layout must be one of \\['owner', 'compact'\\]"),
    (dict(situ_beta=0.0), "situ_beta must be a finite positive float"),
    (dict(situ_linear_beta=float("nan")), "situ_linear_beta must be a finite positive float"),
    (dict(first=2, count=2), "pass either all experts"),
    (dict(first=-1), "first must be an int >= 0"),
    (dict(n_experts_total=2), "n_experts_total must be an int >= 3"),
    (dict(tune_max_num_tokens=0), "tune_max_num_tokens must be an int >= 1"),
])
def test_constructor_names_the_bad_argument(kw, match):
    with pytest.raises(ValueError, match=match):
        fm.FlashInferSm90MoE(*_weights(), device="cpu", **kw)


def test_objects_built_on_the_cpu_refuse_calls_and_w4a8_needs_its_preparation():
    moe = fm.FlashInferSm90MoE(*_weights(), first=1, count=2, n_experts_total=8, device="cpu")
    assert (moe.first, moe.count, moe.ep_size, moe.ep_rank, moe.id_shift) == (1, 2, 4, 0, 1)
    assert moe.activation_params["situ_beta"].tolist() == [4.0, 4.0]
    assert moe.activation_params["situ_linear_beta"].tolist() == [25.0, 25.0]
    assert "SiTU" in moe.describe()["activation"] and moe.describe()["precision"] == "w4a16"
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="without a kernel; calls need an SM90 GPU"):
        moe(x, torch.tensor([[1, 2], [0, 3]]), torch.full((2, 2), 0.5))
    swiglu = fm.FlashInferSm90MoE(*_weights(), activation="swiglu", device="cpu")
    assert swiglu.activation_params == {"situ_beta": None, "situ_linear_beta": None}
    with pytest.raises(RuntimeError, match="W4A8 weights are prepared by FlashInfer on the GPU"):
        fm.FlashInferSm90MoE(*_weights(), precision="w4a8", device="cpu")
    w4a8 = fm.FlashInferSm90MoE(*_weights(), precision="w4a8", device="cpu", humming_prepare=_fake_humming_prepare)
    assert len(w4a8.quant_scales) == 5 and w4a8.quant_scales[1].tolist() == [1.0, 1.0, 1.0]
    assert "humming" in w4a8.describe()["peer"]


def test_autotune_is_not_attempted_without_flashinfer():
    kernel = _FakeCutlassMoE()
    moe = fm.FlashInferSm90MoE(*_weights(e=4), device="cpu", kernel=kernel)
    assert moe.autotune and moe._fi is None
    x = torch.randn(3, 256).to(torch.bfloat16)
    ids, w = torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.full((3, 2), 0.5)
    y = moe(x, ids, w)
    assert y.shape == (3, 256) and y.dtype == torch.bfloat16 and len(kernel.calls) == 1
    assert kernel.calls[0]["workspace_buffer"] is None and moe._tuned == set()
    assert moe.bytes_streamed(ids) == 4 * moe.bytes_per_expert


# --------------------------------------------------------------------------------------
# the library: manifest, variant, availability, loading
# --------------------------------------------------------------------------------------

def _fake_library(folder: Path, kinds=("w4a16",), payload=b"\x7fELF not really a library") -> dict:
    so = folder / "built.so"
    folder.mkdir(parents=True, exist_ok=True)
    so.write_bytes(payload)
    return build.write_manifest(folder / build.variant_of(kinds), so, kinds, source="test")


def test_the_build_scripts_manifest_is_what_the_peer_reads(tmp_path, monkeypatch):
    manifest = _fake_library(tmp_path, ("w4a16",))
    assert manifest["flashinfer"] == fm.FLASHINFER_VERSION and manifest["module"] == fm.MODULE
    assert manifest["kernels"] == ["w4a16"] and manifest["file"] == "fused_moe_90/fused_moe_90.so"
    monkeypatch.setenv(fm.ENV_DIR, str(tmp_path))
    monkeypatch.delenv(fm.ENV_VARIANT, raising=False)
    entry = fm.check_library(fm.find_library())
    assert entry["variant"] == "w4a16" and entry["path"] == str(tmp_path / "w4a16" / "fused_moe_90" / "fused_moe_90.so")
    # the combined variant is preferred once present, a variant can be asked for
    _fake_library(tmp_path, ("w4a16", "w4a8"), payload=b"another")
    assert fm.find_library()["variant"] == "w4a16_w4a8"
    monkeypatch.setenv(fm.ENV_VARIANT, "w4a16")
    assert fm.find_library()["variant"] == "w4a16"
    monkeypatch.setenv(fm.ENV_VARIANT, "w8a8")
    with pytest.raises(ImportError, match="variant 'w8a8' is not one of"):
        fm.find_library()
    # a folder holding one variant's manifest itself
    assert fm.find_library(str(tmp_path / "w4a16_w4a8"), "w4a16_w4a8")["manifest"]["kernels"] == ["w4a16", "w4a8"]


def test_a_library_that_differs_from_its_manifest_is_refused(tmp_path):
    _fake_library(tmp_path)
    entry = fm.find_library(str(tmp_path))
    path = Path(entry["path"])
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(ImportError, match="the manifest says .* B \\(a partial carry\\?\\)"):
        fm.check_library(entry)
    path.write_bytes(b"\x7fELF not really a librarY")  # same size, another byte
    with pytest.raises(ImportError, match="SHA-256 .*, the manifest says"):
        fm.check_library(entry)
    path.unlink()
    with pytest.raises(ImportError, match="is missing"):
        fm.check_library(entry)
    manifest_path = Path(entry["dir"]) / fm.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps(dict(manifest, flashinfer="0.6.13")))
    with pytest.raises(ImportError, match="FlashInfer 0.6.13, not fused_moe_90 of 0.7.2.post1"):
        fm.find_library(str(tmp_path))
    with pytest.raises(ImportError, match="no manifest.json of the w4a16_w4a8 or w4a16 library"):
        fm.find_library(str(tmp_path / "empty"))


def test_write_manifest_refuses_what_one_carry_cannot_take(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "CARRY_LIMIT_BYTES", 4)
    so = tmp_path / "x.so"
    so.write_bytes(b"12345")
    with pytest.raises(ValueError, match="more than one carry"):
        build.write_manifest(tmp_path / "dest", so, ("w4a16",), source="test")
    with pytest.raises(ValueError, match="no variant holds exactly"):
        build.variant_of(("w4a8",))


@pytest.fixture
def fresh_load_state(monkeypatch):
    monkeypatch.setattr(fm, "_LOADED", None)
    monkeypatch.setattr(fm, "_LOAD_ERROR", None)


def _fake_flashinfer(monkeypatch, version):
    mod = types.ModuleType("flashinfer")
    mod.__version__ = version
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    for sub in ("flashinfer.fused_moe", "flashinfer.fused_moe.core", "flashinfer.jit", "flashinfer.jit.env"):
        monkeypatch.setitem(sys.modules, sub, None)  # importing them raises ImportError
    return mod


def test_available_names_each_missing_piece(tmp_path, monkeypatch, fresh_load_state):
    monkeypatch.setenv(fm.ENV_DIR, str(tmp_path))
    monkeypatch.delenv(fm.ENV_VARIANT, raising=False)
    ok, why = fm.available()
    assert not ok and "no manifest.json" in why and "tools/build_flashinfer_sm90.py" in why
    assert fm.rank_moe(None, 0, 56) == (None, why)
    _fake_library(tmp_path)
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    ok, why = fm.available()
    assert not ok and "FlashInfer is not importable" in why and "0.7.2.post1" in why
    _fake_flashinfer(monkeypatch, "0.7.4")
    ok, why = fm.available()
    assert not ok and "FlashInfer 0.7.4 is installed" in why
    _fake_flashinfer(monkeypatch, fm.FLASHINFER_VERSION)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ok, why = fm.available()
    assert not ok and "no CUDA GPU visible" in why
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0))
    ok, why = fm.available()
    assert not ok and "sm_90a code only" in why and "this GPU is sm_100" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    ok, why = fm.available()  # the fake has no fused_moe module to load the library with
    assert not ok and "FlashInfer did not load" in why and "ModuleNotFoundError" in why
    assert "error" in fm.versions() or fm.versions()["variant"] == "w4a16"


def test_available_on_this_machine_gives_a_reason():
    ok, why = fm.available()
    if ok:
        pytest.skip("an SM90 GPU, FlashInfer and the library are here: the peer may run")
    assert why and ("FlashInfer" in why or "GPU" in why or "manifest" in why)


def _carried() -> list[dict]:
    folder = REPO / ".gpu" / "peers" / "flashinfer_sm90"
    found = []
    for variant in fm.VARIANTS:
        try:
            found.append(fm.find_library(str(folder), variant))
        except ImportError:
            pass
    return found


def test_carried_libraries_match_their_manifests_and_fit_one_carry():
    found = _carried()
    if not found:
        pytest.skip("no library in .gpu/peers/flashinfer_sm90 (tools/build_flashinfer_sm90.py puts it there)")
    for entry in found:
        fm.check_library(entry)
        m = entry["manifest"]
        assert m["bytes"] <= build.CARRY_LIMIT_BYTES and m["kernels"] == list(fm.VARIANTS[entry["variant"]])
        assert m["needed"] is None or not any("python" in n for n in m["needed"]), m["needed"]


def test_carried_libraries_load_with_tvm_ffi():
    """The library's symbols resolve (``LD_BIND_NOW``) and it exports what FlashInfer calls:
    in a subprocess, where ``tvm_ffi`` (apache-tvm-ffi) is importable."""
    try:
        import tvm_ffi  # noqa: F401
    except ImportError as e:
        pytest.skip(f"tvm_ffi is not importable here ({e}); the load is checked where apache-tvm-ffi is installed")
    found = _carried()
    if not found:
        pytest.skip("no library in .gpu/peers/flashinfer_sm90 to load")
    code = ("import sys, tvm_ffi; m = tvm_ffi.load_module(sys.argv[1]); "
            "print([n for n in ('init', 'interleave_moe_weights_for_sm90_mixed_gemm', "
            "'set_deepgemm_jit_include_dirs') if m.get_function(n) is not None])")
    for entry in found:
        done = subprocess.run([sys.executable, "-c", code, entry["path"]], capture_output=True, text=True,
                              env=dict(os.environ, LD_BIND_NOW="1"), timeout=300)
        if done.returncode and "cannot open shared object file" in done.stderr:
            pytest.skip(f"a library the .so needs is not on this machine: {done.stderr.strip().splitlines()[-1]}")
        assert done.returncode == 0, done.stderr
        assert "'init', 'interleave_moe_weights_for_sm90_mixed_gemm', 'set_deepgemm_jit_include_dirs'" in done.stdout


# --------------------------------------------------------------------------------------
# the build script's pure-Python steps
# --------------------------------------------------------------------------------------

def _launcher(dtype_args: str, m: int, mainloop: str, small_k: bool = False) -> str:
    name = "sm90_generic_mixed_moe_small_k_kernelLauncher" if small_k else "sm90_generic_mixed_moe_gemm_kernelLauncher"
    return (f"template void {name}<{dtype_args}\ntensorrt_llm::cutlass_extensions::EpilogueOpDefault, "
            f"cute::Shape<cute::Int<{m}>, cute::Int<16>, cute::Int<128>>, cute::Shape<cute::Int<1>, cute::Int<1>, "
            f"cute::Int<1>>, cutlass::gemm::{mainloop}, cutlass::epilogue::X> (\nGroupedGemmInput<...>inputs, "
            "TmaWarpSpecializedGroupedGemmInput hopper_inputs, int sm_count_, size_t* workspace_size);")


W4A16_ARGS = "__nv_bfloat16, SafeFP4, __nv_bfloat16,"
W4A8_ARGS = "__nv_fp8_e4m3, SafeFP4, __nv_bfloat16, __nv_bfloat16,"
COOP, PING = "KernelTmaWarpSpecializedCooperative", "KernelTmaWarpSpecializedPingpong"


def test_launchers_are_selected_by_type_and_the_never_selected_ones_dropped(tmp_path):
    a = [_launcher(W4A16_ARGS, 64, PING), _launcher(W4A16_ARGS, 128, PING), _launcher(W4A16_ARGS, 128, COOP),
         _launcher("half, SafeFP4, half,", 64, COOP)]
    b = [_launcher(W4A8_ARGS, 256, PING, small_k=True), _launcher(W4A8_ARGS, 128, PING), _launcher(W4A8_ARGS, 64, COOP)]
    (tmp_path / "cutlass_kernel_file_gemm_grouped_sm90_M128_Mixed_group1.generated.cu").write_text(
        "#include <x>\n" + "\n\n".join(a) + "\n")
    (tmp_path / "cutlass_kernel_file_gemm_grouped_sm90_M64_Mixed_group0.generated.cu").write_text("\n".join(b))
    (tmp_path / "cutlass_kernel_file_gemm_grouped_sm90_M64_group0.generated.cu").write_text(
        _launcher(W4A16_ARGS, 64, COOP))  # not a mixed-input file
    kept, matched = build.select_launchers(tmp_path, build.KINDS["w4a16"])
    assert matched == 3 and kept == [a[0], a[2]]  # files in name order; M128 Pingpong dropped
    kept8, matched8 = build.select_launchers(tmp_path, build.KINDS["w4a8"])
    assert matched8 == 3 and kept8 == [b[0], b[2]]  # small-K kept whatever its tile
    assert build.tile_m(a[1]) == 128
    with pytest.raises(ValueError, match="no CTA tile shape"):
        build.tile_m("template void f();")
    units = build.launcher_units([f"L{i}" for i in range(19)])
    assert len(units) == 3 and units[2].count("L1") == 3 and "L18" in units[2]  # L16, L17, L18
    assert units[0].startswith('#include "tensorrt_llm/kernels/cutlass_kernels/moe_gemm/launchers/')
    paths = build.write_launcher_units(kept, tmp_path / "src", build.KINDS["w4a16"])
    assert [p.name for p in paths] == ["w4a16_sm90_mixed_group0.generated.cu"]
    assert build.write_launcher_units(kept[:1], tmp_path / "src", build.KINDS["w4a16"])[0].read_text().count(
        "template void") == 1


def test_the_instantiation_unit_holds_the_kept_runners_only():
    one = build.instantiation_unit(("w4a16",))
    assert "template class CutlassMoeFCRunner<__nv_bfloat16, Fp4Type>;" in one
    assert "kHummingPreMmaE8M0" not in one and one.count("template class") == 1
    assert "INSTANTIATE_FINALIZE_MOE_ROUTING(__nv_bfloat16, __nv_bfloat16, __nv_bfloat16);" in one
    both = build.instantiation_unit(("w4a16", "w4a8"))
    assert both.count("template class") == 2 and "Sm90Wfp4Afp8ScaleMode::kHummingPreMmaE8M0>" in both
    with pytest.raises(ValueError, match="non-empty subset"):
        build.instantiation_unit(("w4a4",))


def _full_ninja(csrc: str) -> str:
    head = ("ninja_required_version = 1.3\nname = fused_moe_90\n\ncommon_cflags = -DPy_LIMITED_API=0x03090000 $\n"
            f"    -D_GLIBCXX_USE_CXX11_ABI=1 $\n    -I{csrc}/nv_internal $\n    -I{csrc}/nv_internal/include\n"
            "cuda_cflags = $common_cflags\n\nrule compile\n  command = c++ $cflags -c $in -o $out\n\n"
            "rule cuda_compile\n  command = nvcc $cuda_cflags -c $in -o $out\n\n"
            "rule link\n  command = c++ $in -o $out\n")
    mg = f"{csrc}/nv_internal/tensorrt_llm/kernels/cutlass_kernels/moe_gemm"
    units = [f"build /ws/moe_gemm_{n}.cuda.o: cuda_compile {mg}/{n}.cu" for n in
             ("moe_gemm_tma_warp_specialized_input", "moe_gemm_kernels_fp8_fp8", "moe_gemm_kernels_bf16_fp4",
              "moe_gemm_mixed_utils")]
    units += [f"build /ws/cutlass_backend_{n}.cuda.o: cuda_compile {csrc}/fused_moe/cutlass_backend/{n}.cu" for n in
              ("flashinfer_cutlass_fused_moe_binding", "deepgemm_jit_setup", "cutlass_fused_moe_instantiation")]
    units += [f"build /ws/common_{n}.o: compile {csrc}/nv_internal/cpp/common/{n}.cpp" for n in
              ("envUtils", "logger", "stringUtils", "tllmException")]
    units += [f"build /ws/common_memoryUtils.cuda.o: cuda_compile {csrc}/nv_internal/cpp/common/memoryUtils.cu",
              f"build /ws/kernels_preQuantScaleKernel.cuda.o: cuda_compile "
              f"{csrc}/nv_internal/tensorrt_llm/kernels/preQuantScaleKernel.cu",
              f"build /ws/cutlass_kernels_cutlass_heuristic.o: compile "
              f"{csrc}/nv_internal/tensorrt_llm/kernels/cutlass_kernels/cutlass_heuristic.cpp",
              f"build /ws/lora_lora.o: compile {csrc}/nv_internal/tensorrt_llm/kernels/lora/lora.cpp",
              "build /ws/90_gemm_M128_group1.generated.cuda.o: cuda_compile /gen/gemm/90/M128_group1.generated.cu",
              "build /ws/fused_moe_90.so: link /ws/a.o /ws/b.o", "default /ws/fused_moe_90.so"]
    return head + "\n" + "\n".join(units) + "\n"


def test_the_reduced_ninja_file_keeps_the_fixed_units_and_replaces_the_instantiation():
    csrc = "/fi/csrc"
    extra = [build.Unit("/o/humming.cuda.o", "cuda_compile", "/s/humming.cu", extra_include="/inc/moe_gemm")]
    text, units = build.subset_ninja(_full_ninja(csrc), csrc, "/o", "/o/fused_moe_90.so",
                                     ["/s/w4a16_sm90_mixed_group0.generated.cu"], "/s/inst.cu", extra,
                                     instantiation_include="/inc/moe_gemm")
    head, _ = build.split_ninja(text)
    assert f"-I{csrc}/fused_moe/cutlass_backend $\n    -I{csrc}/nv_internal $" in head
    sources = [u.source for u in units]
    assert len(units) == len(build.FIXED_SOURCES) + 3
    assert not any("fp8_fp8" in s or "M128_group1" in s for s in sources)  # other types, FlashInfer's launchers
    assert "/s/inst.cu" in sources and not any(s.endswith(build.INSTANTIATION_SOURCE) for s in sources)
    inst = next(u for u in units if u.source == "/s/inst.cu")
    assert inst.obj == "/o/cutlass_backend_cutlass_fused_moe_instantiation.cuda.o"
    assert f"build {inst.obj}: cuda_compile /s/inst.cu\n  cuda_cflags = -I/inc/moe_gemm $cuda_cflags" in text
    assert "build /o/w4a16_sm90_mixed_group0.generated.cuda.o: cuda_compile /s/w4a16_sm90_mixed_group0" in text
    assert "build /o/stubs.o: compile /o/stubs.S" in text
    assert text.rstrip().endswith("default /o/fused_moe_90.so")
    link = next(line for line in text.splitlines() if line.startswith("build /o/fused_moe_90.so: link"))
    assert link.split()[-1] == "/o/stubs.o" and all(u.obj in link for u in units)
    assert "build objects: phony " + " ".join(u.obj for u in units) in text
    broken = _full_ninja(csrc).replace("lora/lora.cpp", "lora/other.cpp")
    with pytest.raises(ValueError, match="lacks \\['lora/lora.cpp'\\]"):
        build.subset_ninja(broken, csrc, "/o", "/o/x.so", [], "/s/inst.cu")
    with pytest.raises(ValueError, match="no '-I/elsewhere/nv_internal' line"):
        build.subset_ninja(_full_ninja(csrc), "/elsewhere", "/o", "/o/x.so", [], "/s/inst.cu")


def test_the_stub_list_and_its_assembly():
    nm_lines = ["                 U _ZN12tensorrt_llm7kernels3fooEv", "                 U cuLaunchKernel",
                "                 U memcpy", "                 U _ZN12tensorrt_llm7kernels3barEv",
                "0000000000000010 T _ZN12tensorrt_llm7kernels3barEv", "                 U _ZSt4cout",
                "                 U __tls_get_addr", "0000000000000000 W _ZN3cub5thingEv"]
    defined, undefined = build.parse_nm(nm_lines)
    assert "_ZN12tensorrt_llm7kernels3barEv" in defined and "_ZN3cub5thingEv" in defined
    driver, stubbed, left = build.classify_undefined(undefined, defined, provided={"memcpy", "_ZSt4cout"})
    assert driver == ["cuLaunchKernel"] and stubbed == ["_ZN12tensorrt_llm7kernels3fooEv"]
    assert left == ["__tls_get_addr"]
    asm = build.stubs_assembly(stubbed, ("w4a16", "w4a8"))
    assert "\t.globl _ZN12tensorrt_llm7kernels3fooEv" in asm
    assert "jmp _ZSt21__throw_runtime_errorPKc@PLT" in asm and "abort" not in asm
    assert "reduced build: w4a16 + w4a8" in asm
    assert build.driver_stub_source(driver) == "int cuLaunchKernel(void) { return 999; }\n"


def test_the_stubs_assemble_and_define_each_symbol(tmp_path):
    if shutil.which("gcc") is None or shutil.which("nm") is None:
        pytest.skip("gcc and nm (binutils) are needed to assemble the stubs")
    if os.uname().machine != "x86_64":
        pytest.skip(f"the stubs are x86_64 assembly; this machine is {os.uname().machine}")
    symbols = ["_ZN12tensorrt_llm7kernels3fooEv", "_ZN12tensorrt_llm7kernels3bazEi"]
    (tmp_path / "stubs.S").write_text(build.stubs_assembly(symbols, ("w4a16",)))
    subprocess.run(["gcc", "-c", str(tmp_path / "stubs.S"), "-o", str(tmp_path / "stubs.o")], check=True)
    defined, undefined = build.parse_nm(build._nm([], tmp_path / "stubs.o"))
    assert set(symbols) <= defined and undefined == {"_ZSt21__throw_runtime_errorPKc"}


def test_a_stub_throws_a_runtime_error_its_caller_catches(tmp_path):
    """What FlashInfer's autotuner needs to skip a tactic the reduced library lacks (an
    abort ended the whole process): the stub's exception reaches a C++ caller's handler,
    with the library's message, through a real link against libstdc++."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is needed to link a caller of the stubs")
    if os.uname().machine != "x86_64":
        pytest.skip(f"the stubs are x86_64 assembly; this machine is {os.uname().machine}")
    (tmp_path / "stubs.S").write_text(build.stubs_assembly(["_ZN12tensorrt_llm7kernels3bazEi"], ("w4a16", "w4a8")))
    (tmp_path / "caller.cc").write_text(
        "#include <cstdio>\n#include <stdexcept>\n"
        "namespace tensorrt_llm { namespace kernels { int baz(int); } }\n"
        "int main() { try { return tensorrt_llm::kernels::baz(3); }\n"
        "  catch (const std::runtime_error& e) { std::puts(e.what()); return 0; } }\n")
    subprocess.run(["g++", str(tmp_path / "caller.cc"), str(tmp_path / "stubs.S"), "-o", str(tmp_path / "caller")],
                   check=True)
    done = subprocess.run([str(tmp_path / "caller")], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ("fused_moe_90 (reduced build: w4a16 + w4a8): called a kernel or runner "
                                   "that was not compiled into this library")


def test_the_toolchain_is_pinned():
    cmds = build.toolchain_commands(Path("/v"), "python3")
    assert cmds[0] == ["python3", "-m", "venv", "/v"]
    assert cmds[1][-3:] == ["torch==2.13.0", "--index-url", "https://download.pytorch.org/whl/cpu"]
    assert cmds[2][-2:] == ["--no-deps", "flashinfer-python==0.7.2.post1"]
    assert all("==" in spec for spec in cmds[3][5:]) and "nvidia-cuda-nvcc==13.0.88" in cmds[3]
    assert build.toolchain_commands(Path("/v"), "py", "torch.whl", None)[1][-1] == "torch.whl"


# --------------------------------------------------------------------------------------
# the experts table
# --------------------------------------------------------------------------------------

def test_experts_table_fi90_setup_reports_why_not_and_render_says_not_run(monkeypatch):
    from benchmarks.experts_table import fi90_setup, render

    monkeypatch.setattr(fm, "available", lambda: (False, "the FlashInfer SM90 MoE peer needs an SM90 GPU"))
    result = {}
    assert fi90_setup(["triton"], result) is None and result == {}
    assert fi90_setup(["fi90"], result) is None
    assert result["fi90_error"] == "the FlashInfer SM90 MoE peer needs an SM90 GPU"
    case = {"mode": "dep16", "size": 4, "skew": 0.0, "touched": 50, "limit_us": 200.0,
            "median_us": {"engine": 250.0, "triton_w4": 500.0}}
    text = render(dict(result, device="X", torch="t", read_gbs=4500.0, cases=[case]))
    assert "fi90: not run: the FlashInfer SM90 MoE peer needs an SM90 GPU" in text
    assert "fi90 best" not in text


def test_experts_table_fi90_setup_times_only_what_passed(monkeypatch):
    from benchmarks import experts_table as et

    monkeypatch.setattr(fm, "available", lambda: (True, ""))
    monkeypatch.setattr(fm, "load_module", lambda: {"entry": {"manifest": {"kernels": ["w4a16", "w4a8"]}}})
    monkeypatch.setattr(fm, "versions", lambda: {"variant": "w4a16_w4a8"})
    monkeypatch.setattr(fm, "check_forward", lambda precision, layout, **kw: {
        "ok": not (precision == "w4a8" and layout == "compact"),
        "config": {"precision": precision, "layout": layout}})
    result = {}
    module, passed = et.fi90_setup(["fi90"], result)
    assert module is fm and passed == {"w4a16": ["owner", "compact"], "w4a8": ["owner"]}
    assert len(result["fi90_checks"]) == 4 and "w4a8 compact" in result["fi90_partial_error"]

    class Peer:
        def __init__(self, precision):
            self.precision = precision

        def describe(self):
            return {"peer": "x", "precision": self.precision, "first": 0, "routing": "r"}

        def __call__(self, x, ids, rw, layout, capacity):
            return (self.precision, layout, capacity)

    monkeypatch.setattr(fm, "rank_moe", lambda w, first, count, shard, precision: (Peer(precision), ""))
    fns = et.fi90_peers((fm, passed), None, 0, 56, (0, 1), result)
    assert sorted(fns) == ["fi90_compact_w4a16", "fi90_w4a16", "fi90_w4a8"]
    assert fns["fi90_compact_w4a16"](None, None, None, {"local_rows": 7}) == ("w4a16", "compact", 7)
    assert fns["fi90_w4a8"](None, None, None, {"local_rows": 0}) == ("w4a8", "owner", 1)
    assert result["peers"]["fi90"]["precision"] == "best of w4a16/w4a8 per case"
    assert "first" not in result["peers"]["fi90"] and "routing" not in result["peers"]["fi90"]


def test_experts_table_renders_fi90_columns():
    from benchmarks.experts_table import best_of, config_tag, render

    case = {"mode": "dep16", "size": 4, "skew": 0.0, "touched": 50, "limit_us": 200.0,
            "median_us": {"engine": 250.0, "triton_w4": 500.0, "fi90_w4a16": 330.0, "fi90_compact_w4a8": 300.0}}
    text = render({"device": "X", "torch": "t", "read_gbs": 4500.0, "cases": [case]})
    assert "| fi90 best us (frac) | engine / fi90 |" in text
    assert "| 300.0 (0.67) compact w4a8 | 1.20x |" in text
    assert best_of(case["median_us"], "fi90") == ("fi90_compact_w4a8", 300.0)
    assert config_tag("fi90_w4a16", "fi90") == "owner w4a16"
