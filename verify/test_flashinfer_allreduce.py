"""FlashInfer's fused all-reduce + RMSNorm as the wide layer's latent tail, over real ranks,
checked by the contract of the project's own tail (``LatentAllReduceNormKernel``:
``routed`` = ``ordered_sum_bf16`` of the ranks' partials, ``normed`` = ``rms_norm`` of it).
Run with::

    torchrun --standalone --nproc-per-node 2 -m pytest verify/test_flashinfer_allreduce.py -m multi_gpu

| contract | how |
|---|---|
| outputs written | ``residual_out`` and ``norm_out`` are filled with NaN before the call: every element of the batch's rows must be replaced, and the 8 rows after the batch must not be (an SM90 build that leaves its outputs unwritten is a finding, as FlashInfer's ``mxfp8_quantize`` was: ``verify/test_mx.py``) |
| all-reduced sum | bit for bit ``reference.schedules.groups.ordered_sum_bf16`` of every rank's partial (the sign of a zero aside) with ``fp32_acc``, and at 2 ranks without it; bounded by ``gamma_{N-1}(u_bf16) sum |p_r|`` without it at more ranks |
| normalized rows | within ``verify.flashinfer_allreduce.normed_bound`` of the exact RMSNorm of that sum (the project's RMSNorm bound with FlashInfer's fast-math division and flush-to-zero); the share of bits off ``reference/norm.py`` is reported |

Cases: the latent at the real width (``kimi_k3``: 3584 BF16 columns), the layer's RMSNorm
weight (``latent_norm`` of ``cases.layer_weights``) and ``rms_eps``, 65, 100, 256 and 1024
rows (the wide layer's batches), the one-shot (Lamport) and the two-shot kernels, FP32 and
BF16 accumulation. One workspace for the module (``max_token_num`` = ``wide_rows``).

Skipped, with the reason, where FlashInfer (or a module it imports) is missing, where
this FlashInfer lacks the API, where its ``trtllm_comm`` kernels are not compiled for
this GPU's major (read from ``flashinfer.jit.comm.gen_trtllm_comm_module``), where the
rank count is not one the kernel dispatches, and where building the workspace could
create a multicast object (read from the workspace builder's source: every
``SymmDeviceMemory`` must pass ``enable_multicast=False``); the workspace is built with
``backend="trtllm"`` named (``"auto"`` picks the multicast ``"mnnvl"`` backend wherever the
driver offers multicast) and with ``cuMulticastCreate`` replaced by a refusal. Evidence
for each point: ``verify/flashinfer_allreduce.py``.

The first call JIT-compiles FlashInfer's ``trtllm_comm`` module (all patterns, 2-16 ranks)
for this GPU, which takes minutes; ``python3 -c "from flashinfer.comm.trtllm_ar import
get_trtllm_comm_module as m; m()"`` on the node does it beforehand.
"""

from __future__ import annotations

import functools
import inspect
import os

import pytest
import torch

from verify import cases
from verify.flashinfer_allreduce import (PAD_ROWS, check_fused_allreduce_norm,
                                         check_no_subnormals, forbid_multicast,
                                         jit_arch_majors, latent_partials, multicast_free,
                                         unsupported_reason)

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu(2), pytest.mark.config("kimi_k3"),
              pytest.mark.contract("flashinfer_allreduce_rmsnorm")]

TOKENS = (65, 100, 256, 1024)
_API = ("create_allreduce_fusion_workspace", "allreduce_fusion", "AllReduceFusionPattern")


def _support(comm, world_size: int) -> str | None:
    """``unsupported_reason`` from what the installed FlashInfer says of itself."""
    from flashinfer.comm import trtllm_ar
    from flashinfer.jit import comm as jit_comm
    from flashinfer.utils import is_confidential_compute

    missing = [name for name in _API if not hasattr(comm, name)]
    if not missing and not hasattr(comm.AllReduceFusionPattern, "kARResidualRMSNorm"):
        missing.append("AllReduceFusionPattern.kARResidualRMSNorm")
    builder = inspect.unwrap(trtllm_ar.trtllm_create_ipc_workspace_for_all_reduce_fusion)
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    return unsupported_reason(
        missing=missing,
        arch_majors=jit_arch_majors(inspect.getsource(jit_comm.gen_trtllm_comm_module)),
        capability=capability, world_size=world_size,
        multicast=multicast_free(inspect.getsource(builder)),
        torch_symm_path=bool(is_confidential_compute()),
        torch_multicast_disabled=os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST") == "1")


@functools.cache
def _norm_weight() -> torch.Tensor:
    """The layer's RMSNorm weight at the real width (the weights the wide contracts use)."""
    return cases.layer_weights("kimi_k3").latent_norm.detach().clone().cuda()


@pytest.fixture(scope="module")
def fused(process_group):
    """(flashinfer.comm, the "trtllm" workspace of this rank), or a skip with its reason.
    Every rank decides the same (one node, one FlashInfer)."""
    import torch.distributed as dist

    try:
        import flashinfer.comm as comm
        from flashinfer.comm import mnnvl
    except ImportError as e:  # FlashInfer, or cuda-python / nvidia-ml-py it imports
        pytest.skip(f"flashinfer.comm cannot be imported: {e}")

    n, rank = dist.get_world_size(), dist.get_rank()
    reason = _support(comm, n)
    if reason:
        pytest.skip(reason)
    cfg = cases.config("kimi_k3")
    with pytest.MonkeyPatch.context() as mp:
        forbid_multicast(mp, mnnvl.cuda)
        workspace = comm.create_allreduce_fusion_workspace(
            backend="trtllm", world_size=n, rank=rank, max_token_num=cfg.wide_rows,
            hidden_dim=cfg.latent, dtype=torch.bfloat16, group=process_group)
    assert workspace.backend == "trtllm", workspace.backend
    yield comm, workspace
    torch.cuda.synchronize()
    dist.barrier()
    workspace.destroy()


@pytest.mark.parametrize("fp32_acc", (True, False), ids=("fp32acc", "bf16acc"))
@pytest.mark.parametrize("oneshot", (True, False), ids=("oneshot", "twoshot"))
@pytest.mark.parametrize("tokens", TOKENS)
def test_flashinfer_allreduce_rmsnorm(fused, tokens, oneshot, fp32_acc, seed, contract):
    """One fused call per rank on every rank's latent partial; outputs poisoned with NaN
    before it; the contract of ``check_fused_allreduce_norm``."""
    import torch.distributed as dist

    comm, workspace = fused
    cfg = cases.config("kimi_k3")
    n, rank = dist.get_world_size(), dist.get_rank()
    parts = latent_partials(n, tokens, cfg.latent, seed)  # every rank's, one seed
    check_no_subnormals(parts)
    weight = _norm_weight()
    nan = torch.full((tokens + PAD_ROWS, cfg.latent), float("nan"), dtype=torch.bfloat16,
                     device="cuda")
    summed, normed = nan.clone(), nan.clone()
    dist.barrier()
    comm.allreduce_fusion(
        input=parts[rank].cuda(), workspace=workspace,
        pattern=comm.AllReduceFusionPattern.kARResidualRMSNorm, launch_with_pdl=False,
        residual_out=summed[:tokens], norm_out=normed[:tokens],
        residual_in=torch.zeros(tokens, cfg.latent, dtype=torch.bfloat16, device="cuda"),
        rms_gamma=weight, rms_eps=cfg.rms_eps, use_oneshot=oneshot, fp32_acc=fp32_acc)
    torch.cuda.synchronize()
    dist.barrier()  # every rank's call has ended before anyone checks and calls again
    what = (f"rank {rank}/{n} T={tokens} {'one' if oneshot else 'two'}-shot "
            f"{'FP32' if fp32_acc else 'BF16'} accumulation")
    check_fused_allreduce_norm(contract, parts, weight.cpu(), cfg.rms_eps, summed.cpu(),
                               normed.cpu(), tokens=tokens, fp32_acc=fp32_acc, what=what)
