"""Contract of the trtllm-gen MoE peer (FlashInfer 0.7.2.post1's ``trtllm_fp4_block_scale_routed_moe``,
MXFP4 weights x MXFP8 activations; ``benchmarks/peers/trtllm_moe.py``), stock and Blackwell only.

Before the experts table times the peer, its output must match a float64 computation of
what the kernel is documented to compute from our unconverted weights
(``trtllm_moe.check_forward``: per row within ``2^-5`` relative of the model under the
hidden's RCEIL or OCP-floor scale rule, rows without a local pair exactly zero):

* at small dimensions, SiTU and SwiGLU, with MXFP8 inputs and with BF16 inputs quantized
  by FlashInfer;
* at the real dimensions, one DEP16 owner's call: experts ``[280, 336)`` of 896, L = 3584,
  I = 3072, 64 received rows (4 tokens per rank), SiTU.

Skipped with the reason where the peer cannot run (``trtllm_moe.available()``: FlashInfer
missing or another version, no SM100/SM103 GPU, the trtllm-gen module or its cubins not
loadable) and, for the real-dimension case, where the GPU lacks the free memory.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.peers import trtllm_moe

#: The real-dimension case's GPU memory: our and the converted weights of 56 experts
#: (2 x 0.93 GB) and the float64 reference's per-expert temporaries (< 0.5 GB), doubled.
REAL_BYTES = 6 << 30


def _available_or_skip(need_bytes: int = 0) -> None:
    """Skip unless the peer can run here (and ``need_bytes`` of GPU memory are free)."""
    ok, why = trtllm_moe.available()
    if not ok:
        pytest.skip(why)
    free = torch.cuda.mem_get_info()[0]
    if free < need_bytes:
        pytest.skip(f"the real-dimension case needs {need_bytes >> 30} GiB of free GPU memory; "
                    f"{free / 2 ** 30:.1f} GiB are free")


@pytest.mark.gpu
@pytest.mark.sm100
@pytest.mark.parametrize("activation", sorted(trtllm_moe.ACTIVATIONS))
@pytest.mark.parametrize("bf16_input", [False, True], ids=["mxfp8_in", "bf16_in"])
def test_trtllm_moe_forward(activation, bf16_input, contract):
    _available_or_skip()
    res = trtllm_moe.check_forward(activation=activation, bf16_input=bf16_input, raise_on_fail=False)
    contract.figure("worst_row_rel_err", res["worst_row_rel_err"], worst="max")
    assert res["ok"], res


@pytest.mark.gpu
@pytest.mark.sm100
def test_trtllm_moe_real_dimensions_dep16_owner(contract):
    _available_or_skip(REAL_BYTES)
    res = trtllm_moe.check_forward(experts=896, latent=3584, intermediate=3072, rows=64, first=280,
                                   count=56, raise_on_fail=False)
    contract.figure("worst_row_rel_err", res["worst_row_rel_err"], worst="max")
    assert res["ok"], res
