"""The stock PyTorch ops of the layer: what a serving stack runs when it has no kernel of
its own (cuBLAS GEMMs, ``torch.topk`` routing, elementwise PyTorch formulas). They are the
baseline the project's kernels are timed against and a backend the verification contracts
check on every machine (CPU BLAS here, cuBLAS on a GPU).

Each function states what the library does with rounding; none of it is emulated
bit-for-bit by the reference, so the contracts bound these ops (accumulation order,
non-fused multiply-adds) instead of comparing bits.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = [
    "fp32_reduction",
    "mm_fp32_out",
    "mm_bf16",
    "addmm_bf16",
    "route",
    "situ_and_mul",
    "finalize",
    "rms_norm",
]


@contextlib.contextmanager
def fp32_reduction(split_k: bool = True):
    """cuBLAS with FP32 accumulation throughout: PyTorch lets cuBLAS reduce split-K
    partials of BF16 GEMMs in reduced precision by default
    (``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction``), which is not
    the stock contract (FP32 accumulation, one rounding: ``docs/design.md``) and which
    ``verify/test_stock.py`` catches on the H200 (the up addmm at batch 1).

    ``split_k=False`` also forbids split-K (PyTorch's ``allow_splitk``, which it honours on
    cuBLASLt only, so the BF16 GEMMs inside go to cuBLASLt): each output element is then
    summed by one CTA along the whole K. Measured on an H100 with cuBLAS 13 at the real
    dimensions, the BF16-output GEMMs then give every row the same bits at every row count
    (``benchmarks/cublas_splitk_probe.py``), which the batch-invariant contracts check on
    each node rather than assume; FP32-output GEMMs (``mm_fp32_out``) are not invariant
    that way (a one-row call takes another kernel) and are far slower, so nothing uses
    this for them. Both settings and the preferred BLAS library are restored on exit.

    Raises:
        RuntimeError: ``split_k=False`` on a PyTorch without the ``allow_splitk`` flag."""
    flags = torch.backends.cuda.matmul
    saved = flags.allow_bf16_reduced_precision_reduction
    saved_split = getattr(flags, "allow_bf16_reduced_precision_reduction_split_k", None)
    if not split_k and saved_split is None:
        raise RuntimeError("fp32_reduction(split_k=False) needs PyTorch's allow_splitk flag "
                           "(torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction"
                           f" = (False, False)), which torch {torch.__version__} lacks")
    library = None if split_k else torch.backends.cuda.preferred_blas_library()
    try:
        if library is not None:
            torch.backends.cuda.preferred_blas_library("cublaslt")
        flags.allow_bf16_reduced_precision_reduction = (False, split_k)
        yield
    finally:
        flags.allow_bf16_reduced_precision_reduction = \
            saved if saved_split is None else (saved, saved_split)
        if library is not None:
            torch.backends.cuda.preferred_blas_library(library)


def _check_2d(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype != dtype:
        got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a 2-D {dtype} tensor, got {got}")


def mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b.T`` with FP32 output: a [M,K] BF16, b [N,K] BF16 -> FP32 [M,N].

    CUDA: ``torch.mm(..., out_dtype=torch.float32)`` (cuBLAS, FP32 accumulation, no
    rounding of the accumulator). CPU: an FP32 GEMM of the operands widened to FP32 —
    BF16 x BF16 products are exact in FP32, so this too is FP32 accumulation in the
    library's own order."""
    _check_2d("a", a, torch.bfloat16)
    _check_2d("b", b, torch.bfloat16)
    if a.is_cuda:
        with fp32_reduction():
            return torch.mm(a, b.t(), out_dtype=torch.float32)
    return torch.mm(a.float(), b.float().t())


def mm_bf16(a: torch.Tensor, b: torch.Tensor, *, split_k: bool = True) -> torch.Tensor:
    """``a @ b.T`` in BF16: a [M,K], b [N,K] BF16 -> BF16 [M,N] (cuBLAS / CPU BLAS: FP32
    accumulation, one rounding to BF16 — which the contracts check, not assume);
    ``split_k=False``: cuBLASLt without split-K (:func:`fp32_reduction`; CUDA only)."""
    _check_2d("a", a, torch.bfloat16)
    _check_2d("b", b, torch.bfloat16)
    with fp32_reduction(split_k or not a.is_cuda):
        return torch.mm(a, b.t())


def addmm_bf16(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
               split_k: bool = True) -> torch.Tensor:
    """``c + a @ b.T`` in BF16 (``torch.addmm``, beta = alpha = 1): c [M,N], a [M,K],
    b [N,K] BF16 -> BF16 [M,N]; ``split_k=False``: cuBLASLt without split-K
    (:func:`fp32_reduction`; CUDA only)."""
    _check_2d("c", c, torch.bfloat16)
    _check_2d("a", a, torch.bfloat16)
    _check_2d("b", b, torch.bfloat16)
    with fp32_reduction(split_k or not a.is_cuda):
        return torch.addmm(c, a, b.t())


def route(logits: torch.Tensor, bias: torch.Tensor, *, top_k: int = 16,
          renormalize: bool = True, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The stock sigmoid top-k router in PyTorch ops: ``s = torch.sigmoid(logits)``,
    ``torch.topk(s + bias, top_k, sorted=True)`` (ties in no specified order), weights
    ``s[ids]`` divided by ``sum`` (PyTorch's reduction order) times ``scale``.

    logits FP32 [T,E], bias FP32 [E] -> (weights FP32 [T,k], ids int32 [T,k])."""
    _check_2d("logits", logits, torch.float32)
    if bias.dtype != torch.float32 or bias.shape != (logits.shape[1],):
        raise ValueError(f"bias must be FP32 [{logits.shape[1]}], got "
                         f"{tuple(bias.shape)} {bias.dtype}")
    scores = torch.sigmoid(logits)
    _, ids = torch.topk(scores + bias, top_k, dim=1, sorted=True)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=1, keepdim=True)
    return weights * scale, ids.to(torch.int32)


def situ_and_mul(h: torch.Tensor, *, beta: float, linear_beta: float) -> torch.Tensor:
    """SiTU-and-mul as PyTorch FP32 elementwise ops: h BF16 [T, 2N] -> BF16 [T, N]."""
    _check_2d("h", h, torch.bfloat16)
    gate, up = h.float().chunk(2, dim=-1)
    act = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    return (act * (linear_beta * torch.tanh(up / linear_beta))).to(torch.bfloat16)


def finalize(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The routing-weighted sum as a PyTorch reduction: rows BF16 [T*k, L], weights FP32
    [T,k] -> BF16 [T, L]; products rounded to FP32 then summed in PyTorch's order (not a
    fused multiply-add chain), one BF16 rounding."""
    _check_2d("rows", rows, torch.bfloat16)
    _check_2d("weights", weights, torch.float32)
    t, k = weights.shape
    if rows.shape[0] != t * k:
        raise ValueError(f"rows must be [{t * k}, L] for weights [{t}, {k}], got "
                         f"{tuple(rows.shape)}")
    product = rows.float().view(t, k, -1) * weights.unsqueeze(-1)
    return product.sum(dim=1).to(torch.bfloat16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``torch.nn.functional.rms_norm`` in FP32, one BF16 rounding: x BF16 [T,L], weight
    BF16 [L] -> BF16 [T,L]."""
    _check_2d("x", x, torch.bfloat16)
    if weight.dtype != torch.bfloat16 or weight.shape != (x.shape[1],):
        raise ValueError(f"weight must be BF16 [{x.shape[1]}], got "
                         f"{tuple(weight.shape)} {weight.dtype}")
    normed = torch.nn.functional.rms_norm(x.float(), (x.shape[1],), weight.float(), eps)
    return normed.to(torch.bfloat16)
