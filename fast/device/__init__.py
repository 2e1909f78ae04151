"""The device library the kernels share (CuTe DSL), imported by public names:

* ``fast.device.ptx`` -- one helper per PTX instruction the kernels issue (memory
  accesses, atomics, cross-GPU acquire/release, ``cp.async``, shuffles, conversions,
  ``mma.sync`` and ``wgmma``);
* ``fast.device.fp32`` -- the exact FP32 arithmetic (explicit ``.rn``, no contraction, no
  FTZ), BF16 pairs in 32-bit words, and the project's bit-reproducible exp/tanh/sigmoid;
* ``fast.device.arrival`` -- the cross-GPU arrival protocol of the real-rank schedules:
  the signal a writing CTA ends with, the signal and wait kernels, the wait's error
  record and its timeout;
* ``fast.device.norm`` -- the RMSNorm of one row by one CTA (``normalize_row``), which
  the RMSNorm kernel runs and the schedules' kernels fuse;
* ``fast.device.compile`` -- the one compile path of every fast kernel (``compiled``: a
  kernel class, its ``compile_args`` and a target; one cache);
* ``SMEM_PER_CTA`` (here) -- the shared-memory budget of one CTA.

Importing this package imports no CuTe DSL; its modules do.
"""

#: The most shared memory one CTA may take on the H100/H200 and the B200 (227 KB, dynamic
#: plus static): the budget of every kernel that sizes its own shared memory.
SMEM_PER_CTA = 227 << 10
