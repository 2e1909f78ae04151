"""Independent oracles: what the contracts compare the reference (and every backend) with.

Each oracle is written from the layer's definition, with its own arithmetic, and never
calls the reference stage it checks (it may read the model's config and weights):

* :mod:`verify.oracles.exact` — exact rounding of sums and dot products (IEEE
  round-to-nearest-even from its definition, certified float64 GEMMs, ``math.fsum``);
* :mod:`verify.oracles.mx` — MX block quantization with ``ml_dtypes`` element codecs, the
  MXFP4 nibble packing and the 128x4 scale layout;
* :mod:`verify.oracles.stages` — router top-k with its tie rule, SiTU, RMSNorm, the
  Finalize FMA chain and the GEMM orders, op by op in numpy FP32;
* :mod:`verify.oracles.experts` — the routed experts as a loop over pairs.

A contract checks the ``reference`` backend against these, so a bug in a reference stage
fails ``pytest verify/`` on any machine, not only where a second implementation runs.
"""
