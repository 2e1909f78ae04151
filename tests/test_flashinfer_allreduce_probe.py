"""``verify/test_flashinfer_allreduce.py`` before it meets two GPUs: its skip decisions
(``verify.flashinfer_allreduce``: the JIT architecture list and the multicast check read
from FlashInfer's source, the reasons), its inputs, and its checks, fed an emulation of
FlashInfer's ``kARResidualRMSNorm`` kernel on the CPU (its rounding points: ``-0``
published as ``+0``, the rank-order FP32 or BF16 sum, an FP32 sum of squares in its own
tree, ``rsqrt`` of ``acc / L + eps`` off by up to 2 ulp, ``(x r) w`` rounded once), which
passes, and planted bugs of the kinds the contract exists for, which fail."""

from __future__ import annotations

import types

import pytest
import torch

from verify import cases
from verify.compare import ContractError
from verify.flashinfer_allreduce import (PAD_ROWS, check_fused_allreduce_norm,
                                         check_no_subnormals, forbid_multicast,
                                         jit_arch_majors, latent_partials, multicast_free,
                                         unsupported_reason)
from verify.recorder import Recorder
from verify.report import Row

WIDTH = cases.config("kimi_k3").latent
EPS = cases.config("kimi_k3").rms_eps

# The shapes of the two FlashInfer 0.7.2.post1 functions the decisions read.
GEN_SOURCE = '''def gen_trtllm_comm_module() -> JitSpec:
    nvcc_flags = current_compilation_context.get_nvcc_flags_list(
        supported_major_versions=[9, 10, 12]
    )
'''
WORKSPACE_SOURCE = '''
        if use_symm_dev_mem:
            handle = SymmDeviceMemory(
                buf_size=aligned_size,
                group_size=tp_size,
                device_idx=device.index,
                comm_backend_for_handle_transfer=comm_backend,
                enable_multicast=False,
                allocate_signal_pads=False,
            )
        else:
            ptrs, tensor, handle = _alloc_symm_buffer_bytes(aligned_size, tp_size, dtype)
'''


def test_jit_arch_majors():
    assert jit_arch_majors(GEN_SOURCE) == (9, 10, 12)
    assert jit_arch_majors("get_nvcc_flags_list(supported_major_versions=[10])") == (10,)
    assert jit_arch_majors("def gen(): return gen_jit_spec('x', [])") is None


def test_multicast_free():
    assert multicast_free(WORKSPACE_SOURCE) == (True, "")
    default = WORKSPACE_SOURCE.replace("enable_multicast=False,", "")
    assert not multicast_free(default)[0]
    assert "enable_multicast=False" in multicast_free(default)[1]
    two = WORKSPACE_SOURCE + "\nh = SymmDeviceMemory(size, f(a, (b)), enable_multicast=True)\n"
    assert not multicast_free(two)[0]
    assert multicast_free("self.handle = McastGPUBuffer(size)") == (False, "it uses McastGPUBuffer")


def _reason(**kw):
    args = dict(missing=[], arch_majors=(9, 10, 12), capability=(9, 0), world_size=2,
                multicast=(True, ""), torch_symm_path=False, torch_multicast_disabled=True)
    args.update(kw)
    return unsupported_reason(**args)


def test_unsupported_reason():
    assert _reason() is None
    assert _reason(capability=(10, 0), world_size=16) is None
    assert "lacks allreduce_fusion" in _reason(missing=["allreduce_fusion"])
    assert _reason(capability=None) == "no CUDA device"
    assert "cannot read" in _reason(arch_majors=None)
    assert "sm_80" in _reason(capability=(8, 0))
    assert "has 3" in _reason(world_size=3)
    assert "forbids multicast" in _reason(multicast=(False, "it uses multimem"))
    assert "TORCH_SYMM_MEM_DISABLE_MULTICAST" in _reason(torch_symm_path=True,
                                                         torch_multicast_disabled=False)
    assert _reason(torch_symm_path=True) is None


def test_forbid_multicast():
    driver = types.SimpleNamespace(cuMulticastCreate=lambda prop: "handle")
    with pytest.MonkeyPatch.context() as mp:
        forbid_multicast(mp, driver)
        with pytest.raises(AssertionError, match="forbids"):
            driver.cuMulticastCreate(None)
    assert driver.cuMulticastCreate(None) == "handle"


def test_latent_partials_edges():
    parts = latent_partials(2, 8, WIDTH, 3)
    assert [tuple(p.shape) for p in parts] == [(8, WIDTH)] * 2
    assert all(p.dtype == torch.bfloat16 for p in parts)
    assert ((parts[0][0].float() + parts[1][0].float()) == 0).all()  # row 0 cancels
    assert (parts[0][1, ::2].view(torch.int16) == -32768).all()  # -0 (0x8000)
    assert torch.equal(latent_partials(2, 8, WIDTH, 3)[1], parts[1])
    check_no_subnormals(latent_partials(3, 65, WIDTH, 7))


def test_check_no_subnormals():
    p = torch.ones(2, 4, dtype=torch.bfloat16)
    q = p.clone()
    q[0, 0] = 2.0**-130
    with pytest.raises(ValueError, match="rank 1's partial"):
        check_no_subnormals([p, q])
    a, b = p.clone(), -p.clone()
    a[1, 1], b[1, 1] = 2.0**-120, -(2.0**-120 - 2.0**-128)
    with pytest.raises(ValueError, match="through rank 1"):
        check_no_subnormals([a, b])


# --- the checks against an emulation of the kernel -------------------------------------


def _weight(seed=11):
    g = torch.Generator().manual_seed(seed)
    return (1 + 0.1 * torch.randn(WIDTH, generator=g)).bfloat16()


def _emulate(parts, weight, *, fp32_acc=True, rsqrt_ulps=0, drop_rank=None,
             weighted=True, divide=True):
    """FlashInfer's kernel on the CPU: (residual_out, norm_out) rows. The knobs plant bugs."""
    ins = [torch.where(p == 0, torch.zeros_like(p), p) for p in parts]  # -0 published as +0
    ins = [p for r, p in enumerate(ins) if r != drop_rank]
    if fp32_acc:
        acc = ins[0].float()
        for p in ins[1:]:
            acc = acc + p.float()
        s = acc.bfloat16()
    else:
        s = ins[0]
        for p in ins[1:]:
            s = (s.float() + p.float()).bfloat16()
    s = s + torch.zeros_like(s)  # the zero residual
    x = s.float()
    sq = (x * x).view(x.shape[0], -1, 8).sum(2)  # 8 columns a thread, then the block tree
    ss = sq.view(x.shape[0], -1, 28).sum(2).sum(1)
    mean = ss / WIDTH if divide else ss
    r = torch.rsqrt(mean + torch.tensor(EPS, dtype=torch.float32))
    r = r * (1 + rsqrt_ulps * 2.0**-23)
    y = x * r[:, None]
    if weighted:
        y = y * weight.float()
    return s, y.bfloat16()


def _buffers(summed, normed):
    pad = torch.full((PAD_ROWS, WIDTH), float("nan"), dtype=torch.bfloat16)
    return torch.cat([summed, pad]), torch.cat([normed, pad])


def _check(parts, summed, normed, *, fp32_acc=True, tokens=None):
    rec = Recorder(Row(contract="flashinfer_allreduce_cpu_model", backend="cpu-model",
                       config="kimi_k3"))
    tokens = parts[0].shape[0] if tokens is None else tokens
    check_fused_allreduce_norm(rec, parts, _weight(), EPS, summed, normed, tokens=tokens,
                               fp32_acc=fp32_acc, what="cpu model")
    return rec.row


@pytest.mark.parametrize("ranks,fp32_acc,rsqrt_ulps", [(2, True, 0), (2, False, 2),
                                                       (3, True, -2), (3, False, 0)])
def test_emulation_passes(ranks, fp32_acc, rsqrt_ulps):
    parts = latent_partials(ranks, 65, WIDTH, 5)
    row = _check(parts, *_buffers(*_emulate(parts, _weight(), fp32_acc=fp32_acc,
                                            rsqrt_ulps=rsqrt_ulps)), fp32_acc=fp32_acc)
    assert row.worst_ratio is not None and row.worst_ratio <= 1
    assert "bf16_ulp_off_vs_reference" in row.figures


@pytest.fixture(scope="module")
def small():
    parts = latent_partials(2, 8, WIDTH, 9)
    return parts, _emulate(parts, _weight())


def test_unwritten_rows_fail(small):
    """The symptom of a kernel compiled empty: the poison is left."""
    parts, (summed, normed) = small
    normed = normed.clone()
    normed[5:] = float("nan")
    with pytest.raises(AssertionError, match="NaN in 3 of 8 rows .*finding, not a backend"):
        _check(parts, *_buffers(summed, normed))
    with pytest.raises(AssertionError, match="residual_out"):
        _check(parts, *_buffers(torch.full_like(summed, float("nan")), normed))


def test_write_past_the_batch_fails(small):
    parts, (summed, normed) = small
    s, n = _buffers(summed, normed)
    n[8, 3] = 1.0
    with pytest.raises(AssertionError, match="written past row 8"):
        _check(parts, s, n)


@pytest.mark.parametrize("bug", ["missing rank", "no weight", "no division by L"])
def test_planted_bugs_fail(small, bug):
    parts, _ = small
    knobs = {"missing rank": dict(drop_rank=1), "no weight": dict(weighted=False),
             "no division by L": dict(divide=False)}[bug]
    with pytest.raises(ContractError):
        _check(parts, *_buffers(*_emulate(parts, _weight(), **knobs)))


def test_bf16_accumulation_is_not_the_fp32_claim():
    """At 3 ranks a BF16-accumulating kernel run with ``fp32_acc`` differs from the
    rank-order FP32 sum somewhere (row 2 holds a large and two small partials)."""
    parts = latent_partials(3, 8, WIDTH, 9)
    with pytest.raises(ContractError, match="ordered_sum_bf16"):
        _check(parts, *_buffers(*_emulate(parts, _weight(), fp32_acc=False)), fp32_acc=True)
