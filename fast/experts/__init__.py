"""The routed experts on the GPU: the listed MXFP4 engine (CuTe DSL, SM90 and SM100).

Which engine a rank runs is chosen in one place, ``fast.experts.select``
(``experts_engine_for``): this Hopper engine on sm_90a, the Blackwell block-scaled engine
(``BlackwellExpertsEngine``, ``fast.experts.blackwell``) on sm_100a / sm_103a wherever it
tiles the rank's widths.

Per routed pair the engine computes what ``reference.experts.pair_rows_fp32`` defines:
MXFP8 latent row x MXFP4 ``w13`` (FP32 accumulation) -> SiTU in FP32 -> MXFP8
re-quantization (RCEIL) -> x MXFP4 ``w2`` (FP32 accumulation) -> one BF16 row. One engine
serves both schedules:

* **DEP owner**: the local experts ``[first, first + count)`` of one rank over the rows it
  received (``prepare_experts(..., experts=(first, count))``); pairs whose expert is not
  local are skipped (or, ``strict``, an error);
* **wide TP slice**: every expert, this rank's ``1/TP`` slice of the intermediate
  (``shard=(rank, ranks)``), partial rows.

One call is four launches on the current stream (the first two in ``fast.experts.lists``,
the GEMMs in ``fast.experts.kernels``):

1. ``RoutingListsKernel``: the routing lists (per local expert, the pairs that use it,
   claimed with atomics) and the BF16 plan rows (the MXFP8 latent dequantized exactly);
2. ``PlanKernel``: windows of 8 tokens per expert grouped by ``windows`` into work items,
   prefix sums, the work counters re-armed;
3. ``ExpertsGemmKernel`` FC1: per item (expert, 128 weight rows, up to ``8 * windows``
   tokens) the MXFP4 weights streamed once, decoded to BF16 in registers, BF16 tensor-core
   MMA with FP32 accumulation, SiTU and the MXFP8 re-quantization in the epilogue;
4. ``ExpertsGemmKernel`` FC2: the same over ``w2`` with the hidden rows, BF16 rows out.

Steps 3 and 4 run as one persistent grid by default on a DEP owner
(``kernels.FusedExpertsKernel``).

Hopper has no block-scaled MMA, so E2M1 codes are placed into BF16 bit patterns and
multiplied by their power-of-two scale (exact in the range ``layout`` states), and the
E4M3 activations are dequantized to BF16 (exact for scale codes 3..246): every product is
exact and only the FP32 accumulation order differs from the reference; the contracts
(``verify/test_experts.py``) bound FC1 and FC2 and check the SiTU + MXFP8 stage bitwise.

Exactness range of the activations: an E4M3 value ``c * 2^(s - 127)`` is a BF16 number
when the scale code ``s`` is 3..246 (smaller codes make the smallest E4M3 subnormals fall
below BF16's subnormal spacing, larger ones overflow); outside that range the plan and
hidden rows are rounded to nearest BF16 (a block whose largest magnitude is below
``448 * 2^-124`` or above ``448 * 2^119``).
"""

from fast.experts.layout import Geometry, PreparedExperts, prepare_experts
from fast.experts.select import engine_name_for, experts_engine_for, prepare_experts_for

__all__ = ["prepare_experts", "PreparedExperts", "Geometry", "ExpertsEngine", "EngineError",
           "Capture", "prepare_blackwell_experts", "BlackwellExperts", "BlackwellExpertsEngine",
           "experts_engine_for", "prepare_experts_for", "engine_name_for"]


def __getattr__(name):
    if name in ("ExpertsEngine", "EngineError", "Capture"):
        from fast.experts import engine

        return getattr(engine, name)
    # the Blackwell block-scaled engine (compiled for sm_100a/sm_103a, not yet run on a GPU)
    if name in ("prepare_blackwell_experts", "BlackwellExperts"):
        from fast.experts import blackwell_layout

        return getattr(blackwell_layout, name)
    if name == "BlackwellExpertsEngine":
        from fast.experts import blackwell

        return blackwell.BlackwellExpertsEngine
    raise AttributeError(name)
