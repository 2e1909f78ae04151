"""Optimized kernels (CuTe DSL on SM90 / SM100) and the stock library ops they replace.

* ``fast.mx.quantize_mxfp8`` -- MXFP8 (RCEIL) quantizer, linear or 128x4 swizzled scales;
* ``fast.router.route`` -- exact top-16 sigmoid routing;
* ``fast.activation.situ_and_mul`` -- SiTU-and-mul (bit-reproducible exp/tanh/sigmoid);
* ``fast.finalize.finalize`` -- routing-weighted FP32 FMA sum of the top-k rows;
* ``fast.norm.rms_norm`` -- RMSNorm with a stated reduction tree;
* ``fast.experts`` -- the routed experts' engine (``ExpertsEngine`` on SM90,
  ``BlackwellExpertsEngine`` on SM100/SM103; ``select`` picks per target);
* ``fast.gemm`` -- the dense part's split-K swap-AB GEMM (``T <= 64`` tokens; one K split
  per weight at every batch: batch invariant);
* ``fast.schedules`` -- the schedules on the GPU: S1 (``dep.DepLayer`` over virtual ranks,
  ``dep_peer.DepPeerLayer`` over real ones; ``batch_invariant=True`` for bits independent
  of the batch) and S2 (``wide.WideLayer``, ``wide_peer``); each schedule's stage
  sequence written once (``dep_program``, ``wide_program``) and run by both kinds of rank;
* ``fast.stock`` -- the stock PyTorch / cuBLAS ops, the baseline the kernels are checked
  and timed against;
* ``fast.backend`` -- architecture detection, availability reasons, the stage kernels' table;
* ``fast.device`` -- the device library every kernel module builds on: one helper per
  PTX instruction (``ptx``), the exact FP32 arithmetic and exp/tanh/sigmoid (``fp32``),
  the row RMSNorm (``norm``), the cross-GPU arrival signal and wait (``arrival``), and the
  one compile path with its cache (``compile``).

``fast.backend`` imports no kernel module until a kernel is compiled, so it works on any
machine and reports why a kernel cannot run; a kernel module imports the CuTe DSL (the
``nvidia-cutlass-dsl`` package; compiling needs no GPU). The schedules' reference
emulations are in ``reference.schedules``; the model's vocabulary (config, weights, formats)
is ``model``, which ``fast`` shares with ``reference`` without importing a reference stage.

See docs/fast.md.
"""
