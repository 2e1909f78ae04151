"""PyTorch's CPU transcendental kernels, made repeatable for the test processes.

Measured on the CPU build of torch 2.13.0 (AVX-512 and AVX2 dispatch alike, two intra-op
threads): in a fresh process, the first parallel call of an elementwise transcendental op
(``torch.exp``, ``torch.tanh``) can compute the chunk that runs on the OpenMP worker thread
with another, inaccurate result: in 2-15% of processes the worker's half of
``torch.tanh(torch.linspace(-3, 3, 4480))`` was up to 857 FP32 ULP from the correctly
rounded value, and every later call, and every call after one such op had run in that
thread, was within 1 ULP and identical from call to call. With one thread the first call is
already right.

Tests that compare the stock composition's outputs of two calls bit for bit, or compare
``torch.tanh`` with a float64 value in ULP, would fail in those processes although no code
of this project differs. :func:`warm_up` runs each such op once over enough elements that
every intra-op thread computes a chunk; both test suites call it when pytest starts (each
pytest-xdist worker is its own process and calls it too). It changes no result of this
project's own arithmetic (the reference's exp and tanh are its own polynomials) and loosens
no check."""

from __future__ import annotations

import torch

#: elements per op: at least one parallel chunk for each of up to 64 intra-op threads
WARM_UP_ELEMENTS = 1 << 20


def warm_up() -> None:
    """Run ``exp``, ``tanh``, ``sigmoid``, ``log`` and ``erf`` once on FP32 and FP64 CPU
    tensors of :data:`WARM_UP_ELEMENTS` elements (results discarded)."""
    for dtype in (torch.float32, torch.float64):
        x = torch.linspace(-3.0, 3.0, WARM_UP_ELEMENTS, dtype=dtype)
        for op in (torch.exp, torch.tanh, torch.sigmoid, torch.erf):
            op(x)
        torch.log(x.abs() + 1)
