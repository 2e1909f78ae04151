"""Peer MoE implementations benchmarked against ``fast.experts`` in the same run.

* :mod:`benchmarks.peers.triton_moe` — OpenAI ``triton_kernels`` ``matmul_ogs`` with MXFP4
  weights in the Hopper layout (the MXFP4 MoE that vLLM runs on H100/H200).
* :mod:`benchmarks.peers.marlin_moe` — the Marlin MoE kernel (vLLM 0.26.0's prebuilt
  ``_moe_C`` / ``_C`` libraries, fetched by :mod:`benchmarks.peers.fetch_marlin`), W4A16 on
  MXFP4 weights (vLLM's and SGLang's ``--moe-backend marlin``).

Every peer module imports its third-party package lazily, so that this package imports
on a CPU-only machine; each has an ``available() -> (ok, reason)`` for a pytest skip.
"""
