"""FlashInfer's fused all-reduce + RMSNorm as the wide layer's latent tail: whether it may
run here, the inputs, and the checks of ``verify/test_flashinfer_allreduce.py`` (also run
on the CPU by ``tests/test_flashinfer_allreduce_probe.py`` against an emulation of the
kernel and planted bugs).

What is called (FlashInfer 0.7.2.post1, the version of ``docs/gpu-node.md``; paths are
the wheel's, the GitHub tree has them without ``data/``):

* ``flashinfer.comm.create_allreduce_fusion_workspace(backend="trtllm", ...)`` and
  ``flashinfer.comm.allreduce_fusion(...)`` with ``AllReduceFusionPattern.kARResidualRMSNorm``
  (``flashinfer/comm/allreduce.py``). ``backend`` is always named: ``"auto"`` picks
  ``"mnnvl"`` wherever the driver reports NVLink multicast (``allreduce.py`` 599 and 350),
  and that workspace is ``McastGPUBuffer`` -> ``SymmDeviceMemory`` with its default
  ``enable_multicast=True`` -> ``cuMulticastCreate`` (``trtllm_mnnvl_ar.py`` 154,
  ``mnnvl.py`` 748, 1230, 1117); ``"mnnvl-cutedsl"`` needs Blackwell and multicast.
* The ``"trtllm"`` workspace (``trtllm_ar.py``,
  ``trtllm_create_ipc_workspace_for_all_reduce_fusion``) is three buffers per rank
  (two-shot data, barrier flags, a triple Lamport buffer) mapped into every peer:
  ``SymmDeviceMemory(..., enable_multicast=False)`` (``trtllm_ar.py`` 518: ``cuMemCreate``,
  POSIX-fd or fabric handles exchanged over the torch group, unicast mappings) or, under
  Confidential Computing (``allreduce.py`` 140), torch symmetric memory. Its kernels
  (``data/include/flashinfer/comm/trtllm_allreduce_fusion.cuh``) use plain and volatile
  loads/stores and ``st.release.sys`` / ``ld.acquire.sys`` flags: no ``multimem``
  instruction and no multicast address.
* Architectures: the JIT module ``trtllm_comm`` is built for the compute capabilities
  of majors 9, 10 and 12 present (``flashinfer/jit/comm.py`` 196-199; ``sm_90a`` on an
  H200, ``compilation_context.py`` 94-95), with ``-use_fast_math`` (``jit/core.py`` 708,
  747). The kernel bodies have no architecture guard that empties them on SM90 (the
  ``__CUDA_ARCH__ >= 900`` guards wrap only the PDL and cluster calls, the ``>= 1000``
  ones only the FP4 conversions); FlashInfer's own test skips outside majors 9, 10, 12
  (``tests/comm/test_trtllm_allreduce_fusion.py`` 15-18). Whether the SM90 build writes
  its outputs is what the contract checks first.

Semantics of the kernel for ``kARResidualRMSNorm`` (``trtllm_allreduce_fusion.cuh``):
one-shot (Lamport: every rank stores its input, ``-0`` replaced by ``+0`` (1544), into
every rank's buffer; readers spin until no ``-0`` is left, 1568) or two-shot
(reduce-scatter + all-gather through the data buffers and barrier flags); the sum is
``allreduce_sum`` (1457-1482): with ``fp32_acc`` ``acc = f32(rank 0)`` then ``acc +=
f32(rank r)`` for r = 1..N-1 and one rounding to BF16, i.e.
``reference.schedules.groups.ordered_sum_bf16``; without it the BF16 ``vec_add`` (818),
``bf16(f32(a) + f32(b))`` per rank. The residual is added (``residual_out`` is the
written sum; there is no ``allreduce_out`` for this pattern, 865), then the RMSNorm
(1291-1330): FP32 sum of squares in its own tree, ``rsqrtf(acc / hidden + eps)`` (1320),
``y = (x * r) * (weight_bias + w)`` (1327) rounded once to BF16: the rounding points of
``reference/norm.py`` with the fast-math division and rsqrt.

This layer has no residual: the contract passes ``residual_in = 0`` (``x + 0 = x``
exactly; ``-0`` becomes ``+0``).
"""

from __future__ import annotations

import re

import torch

from reference.norm import rms_norm
from reference.schedules.groups import ordered_sum_bf16
from verify import bounds, compare, tolerances

__all__ = [
    "ARCH_MAJORS_0_7", "FAST_DIV_ULP", "FTZ_MIN_NORMAL", "KERNEL_RANKS", "PAD_ROWS",
    "check_fused_allreduce_norm", "check_no_subnormals", "forbid_multicast",
    "jit_arch_majors", "latent_partials", "multicast_free", "normed_bound",
    "unsupported_reason",
]

#: The majors ``gen_trtllm_comm_module`` compiles for in 0.7.2.post1 (``jit/comm.py`` 198).
ARCH_MAJORS_0_7 = (9, 10, 12)
#: ``allreduce_fusion_op`` dispatches these rank counts only (``trtllm_allreduce_fusion.cuh``
#: 1936-1951).
KERNEL_RANKS = (2, 4, 8, 16)
#: ``x / y`` compiled with ``-use_fast_math`` (``-prec-div=false``): ``div.full.f32`` (or a
#: reciprocal and a multiply), max 2 ulp over the full range (PTX ISA, ``div``; CUDA C++
#: Programming Guide, single-precision ``x/y`` without ``-prec-div``).
FAST_DIV_ULP = 2
#: ``-use_fast_math`` implies ``-ftz=true``: an FP32 result below this is flushed to zero.
FTZ_MIN_NORMAL = 2.0**-126
#: Rows past ``T`` in the output buffers, left poisoned to catch writes beyond the batch.
PAD_ROWS = 8

ROWS = ("token", "column")


# --- may it run here ------------------------------------------------------------------


def jit_arch_majors(source: str) -> tuple[int, ...] | None:
    """The compute-capability majors a ``gen_*_module`` function passes as
    ``supported_major_versions=[...]`` (from its source text), or ``None`` if it names
    none (then no architecture list can be read)."""
    m = re.search(r"supported_major_versions\s*=\s*\[([0-9,\s]*)\]", source)
    if m is None:
        return None
    return tuple(int(v) for v in m.group(1).replace(",", " ").split())


def _calls(source: str, name: str) -> list[str]:
    """The argument text of every call ``name(...)`` in ``source`` (parentheses matched)."""
    out = []
    for m in re.finditer(re.escape(name) + r"\s*\(", source):
        depth, i = 1, m.end()
        while i < len(source) and depth:
            depth += {"(": 1, ")": -1}.get(source[i], 0)
            i += 1
        out.append(source[m.end():i - 1])
    return out


def multicast_free(workspace_source: str) -> tuple[bool, str]:
    """Whether the source of the function that builds the ``"trtllm"`` workspace creates
    no multicast object: every ``SymmDeviceMemory(...)`` call passes
    ``enable_multicast=False`` (its default is ``True``), and it names no multicast
    buffer or driver call. Returns (free, why not)."""
    for word in ("McastGPUBuffer", "cuMulticastCreate", "multimem", "get_multicast_ptr"):
        if word in workspace_source:
            return False, f"it uses {word}"
    for args in _calls(workspace_source, "SymmDeviceMemory"):
        if not re.search(r"enable_multicast\s*=\s*False", args):
            return False, ("it builds a SymmDeviceMemory without enable_multicast=False "
                           "(the default creates a multicast object)")
    return True, ""


def unsupported_reason(*, missing: list[str], arch_majors: tuple[int, ...] | None,
                       capability: tuple[int, int] | None, world_size: int,
                       multicast: tuple[bool, str], torch_symm_path: bool,
                       torch_multicast_disabled: bool) -> str | None:
    """Why FlashInfer's fused all-reduce + RMSNorm must not run here, or ``None``.

    Args:
        missing: the ``flashinfer.comm`` names the contract calls that are absent.
        arch_majors: what ``jit_arch_majors`` read from ``gen_trtllm_comm_module``.
        capability: this GPU's (major, minor), ``None`` without one.
        world_size: ranks of the group.
        multicast: ``multicast_free`` of the workspace builder's source.
        torch_symm_path: the workspace will take torch symmetric memory (FlashInfer does
            under Confidential Computing).
        torch_multicast_disabled: ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` is set.
    """
    if missing:
        return "this FlashInfer lacks " + ", ".join(missing)
    if capability is None:
        return "no CUDA device"
    if arch_majors is None:
        return ("cannot read the architectures flashinfer.jit.comm.gen_trtllm_comm_module "
                "compiles for (no supported_major_versions list)")
    if capability[0] not in arch_majors:
        return (f"FlashInfer compiles its trtllm_comm kernels for majors {list(arch_majors)}; "
                f"this GPU is sm_{capability[0]}{capability[1]}")
    if world_size not in KERNEL_RANKS:
        return (f"the fused kernel dispatches {list(KERNEL_RANKS)} ranks only; the group has "
                f"{world_size}")
    free, why = multicast
    if not free:
        return (f"FlashInfer's trtllm workspace may create a multicast object ({why}); "
                "this node forbids multicast objects, so it is not called")
    if torch_symm_path and not torch_multicast_disabled:
        return ("FlashInfer would take torch symmetric memory (Confidential Computing) "
                "without TORCH_SYMM_MEM_DISABLE_MULTICAST=1: it may create a multicast object")
    return None


def forbid_multicast(monkeypatch, driver) -> None:
    """Make ``driver.cuMulticastCreate`` (the CUDA driver bindings FlashInfer's
    ``mnnvl.py`` calls) raise before anything is created, for the monkeypatch's scope: a
    second guard beside ``multicast_free`` in case a path the source check did not read
    asks for one."""
    def refuse(*args, **kwargs):
        raise AssertionError("FlashInfer asked for a multicast object (cuMulticastCreate); "
                             "this node forbids them")

    monkeypatch.setattr(driver, "cuMulticastCreate", refuse, raising=False)


# --- inputs -----------------------------------------------------------------------------


def latent_partials(ranks: int, tokens: int, width: int, seed: int) -> list[torch.Tensor]:
    """Every rank's BF16 partial of the routed latent ``[tokens, width]`` (CPU; every
    process draws all of them from one seed): normal values times a per-row, per-rank
    power of two in ``[2^-12, 2^6]`` (rows whose mean square is far below ``eps`` and far
    above), with edge rows first:

    * row 0: rank 1's partial is minus rank 0's, the others zero: the sum is exactly zero
      (the norm's ``rsqrt(eps)`` path);
    * row 1: rank 0's partial is ``-0`` in every other column (the Lamport sentinel as data:
      a kernel that publishes it unsanitized never sees the row arrive);
    * row 2: rank 0's partial at ``2^10`` scale, the others at ``2^-10`` (the FP32 sum rounds).
    """
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-12, 7, (ranks, tokens, 1), generator=g).float())
    parts = torch.randn(ranks, tokens, width, generator=g) * scale
    if tokens > 2 and ranks > 1:
        parts[:, 0] = 0
        parts[0, 0] = torch.randn(width, generator=g)
        parts[1, 0] = -parts[0, 0]
        parts[0, 1, ::2] = -0.0
        parts[0, 2] *= 2.0**10 / scale[0, 2]
        parts[1:, 2] *= 2.0**-10 / scale[1:, 2]
    return [p.to(torch.bfloat16) for p in parts]


def _subnormal(t: torch.Tensor) -> torch.Tensor:
    a = t.float().abs()
    return (a > 0) & (a < FTZ_MIN_NORMAL)


def check_no_subnormals(parts: list[torch.Tensor]) -> None:
    """The precondition of the contract under ``-ftz``: no partial and no FP32 rank-order
    partial sum is a nonzero below ``2^-126`` (the kernel would flush it, the reference
    would not). Raises ``ValueError`` naming the first offender."""
    acc = None
    for r, p in enumerate(parts):
        if _subnormal(p).any():
            raise ValueError(f"rank {r}'s partial holds BF16 subnormals: outside the "
                             "contract (the kernel flushes them)")
        acc = p.float() if acc is None else acc + p.float()
        if _subnormal(acc).any():
            raise ValueError(f"the FP32 sum through rank {r} is subnormal somewhere: outside "
                             "the contract (the kernel flushes it)")


# --- the checks -------------------------------------------------------------------------


def normed_bound(x: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact, bound) of ``rms_norm(x, weight, eps)`` computed as FlashInfer's kernel does.

    ``exact`` = ``x rsqrt(mean(x^2) + eps32) w`` in float64, ``eps32`` the FP32 value of
    ``eps`` (what the kernel adds; ``reference/norm.py`` adds the same). The bound is
    ``verify.bounds.final_rounding_bound(exact, |exact| rel + abs, bf16)`` with

    * ``rel = tolerances.rms_norm_relative_error(L)`` (the project's RMSNorm at its rounding
      points in any reduction order: the sum of squares, ``/ L``, ``+ eps``, a 2-ulp
      library rsqrt, two multiplies) plus ``ulp_relative(FAST_DIV_ULP) / 2`` (the fast-math
      division's 2 ulp where that bound has one rounding, halved by the square root) plus
      ``2^-126 / eps32`` (``-ftz``: every flushed square or partial sum loses below
      ``2^-126``, at most ``2L`` of them, ``2^-125`` on the mean, halved by the root);
    * ``abs = 2^-126 (1 + |w|)``: ``x r`` and ``(x r) w`` flushed to zero if subnormal.
    """
    n = x.shape[1]
    eps32 = float(torch.tensor(eps, dtype=torch.float32))
    x64, w64 = x.double(), weight.double().cpu()
    exact = x64 * torch.rsqrt((x64 * x64).mean(1, keepdim=True) + eps32) * w64
    rel = (tolerances.rms_norm_relative_error(n) + tolerances.ulp_relative(FAST_DIV_ULP) / 2
           + FTZ_MIN_NORMAL / eps32)
    absolute = FTZ_MIN_NORMAL * (1 + w64.abs())
    return exact, bounds.final_rounding_bound(exact, exact.abs() * rel + absolute,
                                              torch.bfloat16)


def _zero_sign_dropped(t: torch.Tensor) -> torch.Tensor:
    """``-0`` as ``+0``, every other bit pattern unchanged."""
    return torch.where(t == 0, torch.zeros_like(t), t)


def _check_written(buf: torch.Tensor, tokens: int, name: str, what: str) -> None:
    head, tail = buf[:tokens], buf[tokens:]
    nan = torch.isnan(head)
    if nan.any():
        t, c = (int(v) for v in nan.nonzero()[0])
        rows = int(nan.any(1).sum())
        raise AssertionError(
            f"{what}: {int(nan.sum())} of {head.numel()} elements of the {name} are NaN in "
            f"{rows} of {tokens} rows (first: token {t}, column {c}): the NaN poison "
            "written before the call is still there (or the kernel computed NaN from finite "
            "inputs). A kernel that leaves its outputs unwritten on this GPU is a finding, "
            "not a backend")
    if not torch.isnan(tail).all():
        raise AssertionError(f"{what}: the {name} was written past row {tokens} (the "
                             f"{tail.shape[0]} poisoned rows after the batch changed)")


def check_fused_allreduce_norm(contract, parts: list[torch.Tensor], weight: torch.Tensor,
                               eps: float, summed: torch.Tensor, normed: torch.Tensor, *,
                               tokens: int, fp32_acc: bool, what: str) -> None:
    """The contract of one call, on CPU tensors.

    Args:
        contract: the ``contract`` fixture (``verify.recorder.Recorder``).
        parts: every rank's BF16 ``[tokens, L]`` input, rank order.
        weight: the BF16 ``[L]`` RMSNorm weight.
        eps: the config's ``rms_eps``.
        summed, normed: the call's ``residual_out`` and ``norm_out`` buffers,
            ``[tokens + pad, L]``, filled with NaN before the call (the call wrote rows
            ``[0, tokens)``).
        fp32_acc: the call's ``fp32_acc``.

    Checks, in order: (1) every element of both outputs written, nothing past the batch;
    (2) the sum: with ``fp32_acc`` bit for bit ``ordered_sum_bf16(parts)`` (the kernel's
    loop is that reduction), and so too at 2 ranks without it (one add of two BF16 values:
    ``bf16(f32(a) + f32(b))`` in both, the order of a 2-term sum does not matter), the
    sign of a zero aside (the one-shot kernel publishes ``-0`` as ``+0``, and the zero
    residual is added); without ``fp32_acc`` at more ranks, within ``gamma_{N-1}(2^-8)
    sum_r |p_r|`` of the exact sum (every step is one BF16 rounding of the exact sum of
    two BF16 values: ``f32`` holds it whenever the exponents differ by at most 15, and
    otherwise the smaller term is below half a BF16 ulp of the larger, so both roundings
    give the larger); (3) the normalized rows within ``normed_bound`` of the exact RMSNorm
    of the kernel's own sum; the share of their bits that differ from ``reference/norm.py``
    on that sum is reported (``bf16_ulp_off_vs_reference``).
    """
    n = len(parts)
    for buf, name in ((summed, "all-reduced sum (residual_out)"), (normed,
                                                                  "normalized rows (norm_out)")):
        _check_written(buf, tokens, name, what)
    got = summed[:tokens]
    if fp32_acc or n == 2:
        contract.bitwise(_zero_sign_dropped(got), _zero_sign_dropped(ordered_sum_bf16(parts)),
                         what=f"{what}: all-reduced sum = ordered_sum_bf16 (sign of zero aside)",
                         index_names=ROWS)
    else:
        exact = sum(p.double() for p in parts)
        abs_sum = sum(p.double().abs() for p in parts)
        contract.bounded(got, exact, bounds.sum_bound(abs_sum, n, torch.bfloat16),
                         what=f"{what}: all-reduced sum (BF16 accumulation)",
                         bound_name="gamma_{N-1}(u_bf16) sum_r |p_r| (one BF16 rounding "
                                    "per rank)", index_names=ROWS)
    routed = _zero_sign_dropped(got)
    exact, bound = normed_bound(routed, weight, eps)
    out = normed[:tokens]
    contract.bounded(out, exact, bound, what=f"{what}: RMSNorm of the all-reduced rows",
                     bound_name="RMSNorm any order + fast-math div/rsqrt, FTZ + BF16 half-ULP",
                     index_names=ROWS)
    off = compare.ulp_distance(out, rms_norm(routed, weight.cpu(), eps)) > 0
    contract.figure("bf16_ulp_off_vs_reference", off.double().mean().item(), worst="max")
