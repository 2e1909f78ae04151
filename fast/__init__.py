"""Optimized kernels (CuTe DSL on SM90 / SM100) and schedules.

Stage modules (each imports the CuTe DSL only when a kernel is compiled or launched, so
``import fast.backend`` works on any machine and reports why a kernel cannot run):

* ``fast.mx.quantize_mxfp8`` -- MXFP8 (RCEIL) quantizer, linear or 128x4 swizzled scales;
* ``fast.router.route`` -- exact top-16 sigmoid routing;
* ``fast.finalize.finalize`` -- routing-weighted FP32 FMA sum of the top-k rows;
* ``fast.activation.situ_and_mul`` -- SiTU-and-mul (bit-reproducible exp/tanh/sigmoid);
* ``fast.norm.rms_norm`` -- RMSNorm with a stated reduction tree;
* ``fast.backend`` -- architecture detection, availability reasons, compile cache.

See docs/fast.md.
"""
