"""The model's vocabulary that the reference, the fast kernels and the contracts share.

* ``model.config`` -- ``LatentMoEConfig``, the layer's dimensions and constants;
* ``model.weights`` -- ``LatentMoEWeights``, the weight container (layouts, random
  initialization, the safetensors checkpoint);
* ``model.formats`` -- the MX number formats: E8M0 / E4M3 / E2M1 codecs, the block
  quantizer and MXFP4, the routed experts' weight format;
* ``model.swizzle`` -- the 128x4 tiled scale layout of the block-scaled GEMMs;
* ``model.exp_tanh`` -- the constants of the project's own FP32 exp and tanh.

Data and formats only: no stage of the layer lives here, and the package imports nothing
but the standard library, PyTorch, safetensors (the checkpoint) and itself
(``tests/test_import_rules.py``), so ``reference`` and ``fast`` both import it and ``fast``
never imports ``reference``.
"""
