"""Peer MoE implementations benchmarked against ``fast.experts`` in the same run.

* :mod:`benchmarks.peers.triton_moe` — OpenAI ``triton_kernels`` ``matmul_ogs`` with MXFP4
  weights in the Hopper layout (the MXFP4 MoE that vLLM runs on H100/H200).

Every peer module imports its third-party package lazily, so that this package imports
on a CPU-only machine; each has an ``available() -> (ok, reason)`` for a pytest skip.
"""
