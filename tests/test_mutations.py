"""The power of the verification suite: planted bugs must make ``pytest verify/`` fail.

Each mutation copies ``model/``, ``reference/``, ``fast/``, ``verify/`` and ``examples/`` to a
temporary directory, replaces exact snippets (each must occur exactly once, so a mutation
never silently stops applying when the code changes), and runs the named ``verify/``
contracts there with ``pytest -x`` (against the external backend it names, if any). The
mutation is *caught* when pytest reports failed tests (exit code 1) with the comparators'
first-mismatch report; an import or collection error (exit code 2-4) or "no tests" (5) is
not a catch. The contracts named are a subset of ``pytest verify/``, so a catch there is a
catch of the whole suite.

The bugs are of the classes the suite exists for: a wrong rounding rule or rounding point,
an operation order changed, a swapped operand, a selection off by one at a bucket edge, a
layout permuted, state leaking from one call to the next. Those in the reference are caught
on any machine (the reference is checked against the independent oracles of
``verify/oracles``), and so is the one in the example external backend
(``examples/torchao_mx.py``, run through ``--backend`` as a kernel engineer's own would
be); those in a fast kernel need its GPU (``needs_gpu``) and run with

    python -m pytest tests/test_mutations.py -k gpu

on an SM90/SM100 node.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Mutation:
    """A planted bug: ``edits`` (path, old snippet, new snippet), the contracts that must
    fail, the ``--backend`` they run against (None: the built-in ones), optionally a phrase
    the failure report must contain, and the ``-k`` keyword that picks the contracts' cases
    (None: ``"fast"``, the fast backend's cases, for a bug that needs the GPU, and every case
    otherwise; a bug in ``fast.stock`` names ``"stock"``)."""

    name: str
    edits: tuple[tuple[str, str, str], ...]
    contracts: tuple[str, ...]
    needs_gpu: bool = False
    backend: str | None = None
    expect: str | None = None
    keyword: str | None = None

    @property
    def selection(self) -> str | None:
        """The ``-k`` keyword its contracts run under (None: no ``-k``)."""
        return self.keyword or ("fast" if self.needs_gpu else None)


def _one(name, path, old, new, contracts, needs_gpu=False, backend=None,
         expect=None, keyword=None) -> Mutation:
    return Mutation(name, ((path, old, new),), tuple(contracts), needs_gpu, backend, expect,
                    keyword)


MUTATIONS = [
    # --- MX quantization (reference.mx, over the formats of model.formats and model.swizzle)
    _one("MXFP8 scale rule FLOOR instead of RCEIL", "reference/mx.py",
         "def quantize_mxfp8(\n    x: torch.Tensor, *, scale_rule: ScaleRule = ScaleRule.RCEIL",
         "def quantize_mxfp8(\n    x: torch.Tensor, *, scale_rule: ScaleRule = ScaleRule.FLOOR",
         ["verify/test_mx.py::test_quantize_mxfp8_reference"]),
    _one("element ties rounded away from even", "model/formats.py",
         "return torch.round(a.mul_(inv_quantum)), binade",
         "return torch.floor(a.mul_(inv_quantum) + 0.5), binade",
         ["verify/test_mx.py::test_quantize_mxfp8_reference"]),
    _one("a code-0 block scaled by 2^127 instead of 1", "model/formats.py",
         "mult = torch.where(codes == 0, torch.ones_like(mult), mult)",
         "mult = torch.where(codes == 0, mult, mult)",
         ["verify/test_mx.py::test_quantize_mxfp8_reference"]),
    _one("MXFP4 nibbles packed high first", "model/formats.py",
         "return codes[..., 0::2] | (codes[..., 1::2] << 4)",
         "return codes[..., 1::2] | (codes[..., 0::2] << 4)",
         ["verify/test_mx.py::test_quantize_mxfp4"]),
    _one("128x4 scale layout with the row groups transposed", "model/swizzle.py",
         "tiles = padded.view(prows // 128, 4, 32, pcols // 4, 4).permute(0, 3, 2, 1, 4)",
         "tiles = padded.view(prows // 128, 4, 32, pcols // 4, 4).permute(0, 3, 1, 2, 4)",
         ["verify/test_mx.py::test_quantize_mxfp8_swizzled_reference"]),
    # --- the stages
    _one("SiTU gate and up swapped", "reference/activation.py",
         "    g = gate.float()\n    u = up.float()",
         "    g = up.float()\n    u = gate.float()",
         ["verify/test_activation.py::test_situ_and_mul_reference"]),
    _one("experts: the SiTU output not re-quantized to MXFP8", "reference/experts.py",
         "        a = dequantize_mxfp8(*quantize_mxfp8(a))\n", "",
         ["verify/test_experts_reference.py"]),
    _one("RMSNorm multiplies (x * w) * r instead of (x * r) * w", "reference/norm.py",
         "return (x.float() * r[:, None]) * weight.float()",
         "return (x.float() * weight.float()) * r[:, None]",
         ["verify/test_norm.py::test_rms_norm_reference"]),
    _one("finalize k order reversed", "reference/finalize.py",
         "    for j in range(k):\n        acc = fma_f32(",
         "    for j in reversed(range(k)):\n        acc = fma_f32(",
         ["verify/test_finalize.py::test_finalize_reference"]),
    _one("finalize multiplies then adds (two roundings) instead of an FMA", "reference/finalize.py",
         "acc = fma_f32(weights[:, j:j + 1], r[:, j], acc)",
         "acc = weights[:, j:j + 1] * r[:, j] + acc",
         ["verify/test_finalize.py::test_finalize_reference"]),
    _one("router renormalization skipped", "reference/router.py",
         "    if renormalize:\n", "    if False:\n",
         ["verify/test_router.py::test_route"]),
    _one("router weights from the biased scores", "reference/router.py",
         "w = torch.gather(scores, 1, ids)", "w = torch.gather(biased, 1, ids)",
         ["verify/test_router.py::test_route"]),
    _one("router selects from NaN logits instead of refusing the batch", "reference/router.py",
         "    if not finite.all():\n", "    if False:\n",
         ["verify/test_invariance.py::test_bad_token_refused_by_reference"]),
    _one("router ties to the higher expert id", "reference/router.py",
         "ids = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :top_k]",
         "ids = torch.sort(biased.flip(-1), dim=-1, descending=True, stable=True)"
         ".indices[:, :top_k]\n    ids = biased.shape[-1] - 1 - ids",
         ["verify/test_router.py::test_route_ties"]),
    _one("BF16-out GEMM rounded through FP32 (two roundings)", "reference/gemm.py",
         "def _round_pair(hi: torch.Tensor, lo: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:\n"
         "    if out_dtype == torch.float32:\n        return pair_to_float32(hi, lo)\n"
         "    return pair_to_bfloat16(hi, lo)",
         "def _round_pair(hi: torch.Tensor, lo: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:\n"
         "    if out_dtype == torch.float32:\n        return pair_to_float32(hi, lo)\n"
         "    return pair_to_float32(hi, lo).to(torch.bfloat16)",
         ["verify/test_stock.py::test_gemm_rounding_designed"]),
    _one("split-K partials added in reverse split order", "reference/gemm.py",
         "    for s in range(splits):\n        cols = slice(s * width, (s + 1) * width)",
         "    for s in reversed(range(splits)):\n        cols = slice(s * width, (s + 1) * width)",
         ["verify/test_stock.py::test_split_k_gemm"]),
    # --- S1, the DEP layer
    _one("DEP owner partial finalize: two k swapped", "reference/schedules/dep.py",
         "    for j in range(k):\n        w = weights[:, j : j + 1]",
         "    for j in [0, 2, 1, *range(3, k)]:\n        w = weights[:, j : j + 1]",
         ["verify/test_dep.py::test_dep_designed_orders"]),
    _one("DEP combine in reversed owner order", "reference/schedules/dep.py",
         "    for p, m in zip(parts, present):",
         "    for p, m in zip(reversed(parts), reversed(present)):",
         ["verify/test_dep.py::test_dep_designed_orders"]),
    _one("DEP router split changes one token early (32 < 33)", "reference/schedules/dep.py",
         '"router_splits": 4 if tokens <= 32 else 2', '"router_splits": 4 if tokens < 32 else 2',
         ["verify/test_dep.py::test_dep_bucket_edges"]),
    _one("DEP front bucket ends one token early", "reference/schedules/dep.py",
         "    if t <= c.front_max:", "    if t < c.front_max:",
         ["verify/test_dep.py::test_dep_stages[1-64-default]"]),
    # --- S2, the wide layer
    _one("mailbox writer skips the -0 sanitize", "reference/schedules/mailbox.py",
         "lat = sanitize_negative_zero(latent_bf16.detach().cpu().contiguous().view(torch.int16))",
         "lat = latent_bf16.detach().cpu().contiguous().view(torch.int16)",
         ["verify/test_wide.py::test_mailbox_sentinel"]),
    _one("mailbox reader does not re-arm what it read", "reference/schedules/mailbox.py",
         "                    self.buffer[:tokens, cols] = _sentinel_words(region.shape, dtype)\n",
         "",
         ["verify/test_wide.py::test_wide_two_layers_one_scratch"]),
    _one("mailbox buffers do not rotate between calls", "reference/schedules/mailbox.py",
         "    def advance(self) -> None:\n        self.call += 1",
         "    def advance(self) -> None:\n        pass",
         ["verify/test_wide.py::test_wide_two_layers_one_scratch"]),
    _one("wide routing list read one short", "reference/schedules/wide.py",
         "pairs = lists[e, : counts[e]].to(torch.int64)",
         "pairs = lists[e, : counts[e] - 1].to(torch.int64)",
         ["verify/test_wide.py::test_wide_stages"]),
    _one("wide routing lists refuse a full list (capacity off by one)",
         "reference/schedules/wide.py",
         "    if t > capacity:", "    if t >= capacity:",
         ["verify/test_wide.py::test_wide_bucket_edges"]),
    _one("wide engine windows of 16 pairs", "reference/schedules/wide.py",
         "WIDE_WINDOW = 8\n", "WIDE_WINDOW = 16\n",
         ["verify/test_wide.py::test_wide_stages"]),
    Mutation(
        "dequantized experts cached across layers (keyed by index only)",
        (("model/weights.py", "        hit = self._dequantized.get(expert)",
          "        hit = _LAYER_CACHE.get(expert)"),
         ("model/weights.py", "            self._dequantized[expert] = pair",
          "            self._dequantized[expert] = _LAYER_CACHE[expert] = pair"),
         ("model/weights.py", "@dataclass\nclass LatentMoEWeights:",
          "_LAYER_CACHE = {}\n\n\n@dataclass\nclass LatentMoEWeights:")),
        ("verify/test_experts_reference.py::test_expert_rows_two_layers",),
    ),
    # --- the example external backend, through --backend
    _one("example backend (torchao to_mx): scale rule FLOOR instead of RCEIL",
         "examples/torchao_mx.py",
         "scaling_mode=ScaleCalculationMode.RCEIL", "scaling_mode=ScaleCalculationMode.FLOOR",
         ["verify/test_mx.py::test_quantize_mxfp8"], backend="examples/torchao_mx.py:TorchaoMX",
         expect="elements differ bitwise"),  # the comparator's first-mismatch report
    # --- the fast kernels, on their GPU
    _one("fast MXFP8 kernel: scale code rounded down (FLOOR of the quotient)", "fast/mx.py",
         "normal = e + sel((qb & U(0x7FFFFF)) != U(0), 1, 0)", "normal = e",
         ["verify/test_mx.py::test_quantize_mxfp8"], needs_gpu=True),
    _one("fast router kernel: ties to the higher expert id", "fast/router.py",
         "| Uint64(h.Uint32(0xFFFFFFFF) - h.Uint32(expert))",
         "| Uint64(h.Uint32(expert))",
         ["verify/test_router.py::test_route_ties"], needs_gpu=True),
    _one("fast router kernel: merge reads the partner warp's list unreversed", "fast/router.py",
         "lists + ((warp + stride) * n + n - 1 - 32 * r - lane)",
         "lists + ((warp + stride) * n + 32 * r + lane)",
         ["verify/test_router.py::test_route"], needs_gpu=True),
    _one("fast RMSNorm kernel: (x * w) * r", "fast/device/norm.py",
         "lo = h.fmul(h.fmul(xs[2 * i], r), h.bf16_lo(ww[i]))",
         "lo = h.fmul(h.fmul(xs[2 * i], h.bf16_lo(ww[i])), r)",
         ["verify/test_norm.py::test_rms_norm"], needs_gpu=True),
    _one("fast SiTU kernel: gate and up swapped", "fast/activation.py",
         "for g, u in ((h.bf16_lo(gw[i]), h.bf16_lo(uw[i])),\n"
         "                             (h.bf16_hi(gw[i]), h.bf16_hi(uw[i]))):",
         "for u, g in ((h.bf16_lo(gw[i]), h.bf16_lo(uw[i])),\n"
         "                             (h.bf16_hi(gw[i]), h.bf16_hi(uw[i]))):",
         ["verify/test_activation.py::test_situ_and_mul"], needs_gpu=True),
    _one("fast experts engine: gate and up swapped in the FC1 epilogue",
         "fast/experts/kernels.py",
         "a = self.situ(acc[at + t], acc[at + 2 + t])",
         "a = self.situ(acc[at + 2 + t], acc[at + t])",
         ["verify/test_experts.py::test_experts_stages"], needs_gpu=True),
    _one("fast experts engine: a window drops its 8th token (zero B operand)",
         "fast/experts/kernels.py",
         "                if token < ntok:\n                    row = p.lds_i32(",
         "                if (token < ntok) & (token % 8 != 7):\n"
         "                    row = p.lds_i32(",
         ["verify/test_experts.py::test_experts_stages_every_window_count"], needs_gpu=True),
    _one("fast experts engine (wgmma): the B descriptor skips the second 8 k of each step",
         "fast/experts/kernels.py",
         "slot_desc = p.smem_matrix_descriptor(bslot, leading, stride)",
         "slot_desc = p.smem_matrix_descriptor(bslot, 2 * leading, stride)",
         ["verify/test_experts.py::test_experts_stages_every_window_count"], needs_gpu=True),
    _one("fast experts engine (wgmma): every MMA step reads the slot's first B step "
         "(the per-step descriptor offset dropped)",
         "fast/experts/kernels.py",
         "desc = p.smem_descriptor_offset(slot_desc, start)",
         "desc = p.smem_descriptor_offset(slot_desc, 0)",
         ["verify/test_experts.py::test_experts_stages_every_window_count"], needs_gpu=True),
    _one("fast experts engine (fused): an FC1 item never counted at its expert",
         "fast/experts/kernels.py",
         "p.red_release_gpu_add(work + Int64(self.ws.ready + expert) * 4, 1)",
         "p.red_release_gpu_add(work + Int64(self.ws.ready + expert) * 4, 0)",
         ["verify/test_experts.py::test_experts_stages_every_tactic[fast-fused=1]"],
         needs_gpu=True,
         # the gate's own error, not any failure (a fault of the kernel would fail too)
         expect="for its expert's FC1 items"),
    _one("fast experts engine (walk): FC2's accumulators not zeroed between the row tiles of "
         "an item (each tile's rows also hold the sums of the tiles before it)",
         "fast/experts/kernels.py",
         "            self.epilogue_fc2(acc, table, out, lane, warp, tile + g, ntok)\n"
         "            for i in cutlass.range_constexpr(MT * self.windows * 4 * self.chains):\n"
         "                acc[i] = Float32(0.0)\n",
         "            self.epilogue_fc2(acc, table, out, lane, warp, tile + g, ntok)\n",
         ["verify/test_experts.py::test_experts_stages_every_tactic[fast-walk=2]"],
         needs_gpu=True),
    _one("fast experts engine (walk, resident B): every stage reads the first stage's "
         "resident B block (the item's later k taken from its first 128)",
         "fast/experts/kernels.py",
         "live, bslot=self._b_slot(ring, s))",
         "live, bslot=self._b_slot(ring, 0))",
         ["verify/test_experts.py::test_experts_stages_every_tactic[fast-walk=2]"],
         needs_gpu=True),
    _one("fast experts engine: the plan kernel's stale-lists guard off (lists appended by "
         "two route stages are planned as one call's)",
         "fast/experts/lists.py",
         "            if run_c > pairs:\n",
         "            if run_c > pairs + (1 << 30):\n",
         ["verify/test_wide_fast.py::test_wide_fast_route_without_experts"], needs_gpu=True),
    _one("fast experts engine: a routing list over its capacity still planned (clamped, "
         "its refused pairs' rows missing, the others computed)",
         "fast/experts/lists.py",
         "                c = capacity\n                p.sts_i32(stale, 1)\n",
         "                c = capacity\n",
         ["verify/test_experts.py::test_experts_bad_input"], needs_gpu=True),
    _one("fast wide layer: the shared expert never runs when placed beside the experts",
         "fast/schedules/wide_program.py",
         "    if call.shared == \"beside\":\n        shared_expert(rank, call)\n",
         "    if call.shared == \"beside\":\n        pass\n",
         ["verify/test_wide_fast.py::test_wide_fast_stream_orders"], needs_gpu=True),
    _one("fast experts engine: prepared gate and up rows swapped", "fast/experts/layout.py",
         "fc1 = torch.stack((gate.view(inter // 8, 8, -1), up.view(inter // 8, 8, -1)), 1)",
         "fc1 = torch.stack((up.view(inter // 8, 8, -1), gate.view(inter // 8, 8, -1)), 1)",
         ["verify/test_experts.py::test_experts_stages"], needs_gpu=True),
    _one("fast experts engine: the last routing-list slot of each window group skipped",
         "fast/experts/kernels.py",
         "ntok = cutlass.min(count - group * (WINDOW * self.windows), WINDOW * self.windows)",
         "ntok = cutlass.min(count - group * (WINDOW * self.windows), WINDOW * self.windows) - 1",
         ["verify/test_experts.py::test_experts_stages"], needs_gpu=True),
    _one("fast DEP layer: the dispatch does not wait for the side stream's router",
         "fast/schedules/dense.py",
         "        if route_ready is not None:\n            main.wait_event(route_ready)",
         "        if route_ready is not None:\n            pass",
         ["verify/test_dep_fast.py::test_dep_fast_stream_orders"], needs_gpu=True),
    _one("fast DEP layer: the up-projection does not wait for the shared expert",
         "fast/schedules/dense.py",
         "        if dense.shared_ready is not None:\n"
         "            torch.cuda.current_stream(self.device).wait_event(dense.shared_ready)",
         "        if dense.shared_ready is not None:\n            pass",
         ["verify/test_dep_fast.py::test_dep_fast_stream_orders"], needs_gpu=True),
    _one("fast DEP combine: a staged partial read back from its owner's slot, not its own",
         "fast/schedules/dep_kernels.py",
         "got = p.lds_v4(stage + (slot * threads + tid) * 16)",
         "got = p.lds_v4(stage + (o * threads + tid) * 16)",
         ["verify/test_dep_fast.py::test_dep_fast_stages"], needs_gpu=True),
    _one("fast GEMM: the tokens loaded before griddepcontrol.wait", "fast/gemm/kernel.py",
         "        cute.arch.griddepcontrol_wait()\n"
         "        cute.arch.griddepcontrol_launch_dependents()\n"
         "        for st in cutlass.range_constexpr(AHEAD):\n"
         "            if st < stages:\n"
         "                self._issue_b(xbase, src, dst, ring + st * SLOT, st)\n"
         "            cute.arch.cp_async_commit_group()\n",
         "        cute.arch.griddepcontrol_launch_dependents()\n"
         "        for st in cutlass.range_constexpr(AHEAD):\n"
         "            if st < stages:\n"
         "                self._issue_b(xbase, src, dst, ring + st * SLOT, st)\n"
         "            cute.arch.cp_async_commit_group()\n"
         "        cute.arch.griddepcontrol_wait()\n",
         ["verify/test_gemm_fast.py::test_gemm_fast_chain_waits_for_the_previous_kernel"],
         needs_gpu=True),
    _one("fast wide layer: the poll does not re-arm the slots it read",
         "fast/schedules/wide_kernels.py",
         "                    p.stg_v4(at, [armed] * 4)\n",
         "                    p.stg_v4(at, [words[j] for j in range(4)])\n",
         ["verify/test_wide_fast.py::test_wide_fast_stages"], needs_gpu=True),
    Mutation("fast wide layer: the poll reads a slot before its sentinel clears", (
        ("fast/schedules/wide_kernels.py", "while (first < 8) & (late == 0):",
         "while (first < 0) & (late == 0):"),
        ("fast/schedules/wide_kernels.py", "                if first == 8:\n",
         "                if first >= 0:\n")),
        ("verify/test_wide_fast.py::test_wide_fast_late_writer",), needs_gpu=True),
    Mutation("fast wide layer: the hidden all-reduce adds the up columns of every rank", (
        ("fast/schedules/wide_kernels.py",
         "up_at = p.ldg_u64(up_table + 8 * o) + (Int64(t) * columns + g * 8 - o * columns) * 2",
         "up_at = p.ldg_u64(up_table + 8 * owner) + (Int64(t) * columns + g * 8 - owner * columns) * 2"),
        ("fast/schedules/wide_kernels.py",
         "got = p.ldg_stream_v4(cutlass.select_(owner == o, up_at, shared_at))",
         "got = p.ldg_stream_v4(cutlass.select_(owner >= 0, up_at, shared_at))")),
        ("verify/test_wide_fast.py::test_wide_fast_stages",), needs_gpu=True),
    # A GEMM object holds one K split (DenseGemm.splits); the bug is the tactic asking for
    # another one past a batch bucket (a table entry of another split alone cannot do it:
    # choose_tactic keeps the object's split).
    _one("fast GEMM: a GEMM's K split follows the batch bucket (doubled at T = 25..64)",
         "fast/gemm/host.py",
         "        return default_tactic(self.rows, self.k, tokens, self.sms, self.splits, self.wgmma,",
         "        return default_tactic(self.rows, self.k, tokens, self.sms,\n"
         "                              self.splits * (2 if 24 < tokens <= 64 else 1), self.wgmma,",
         ["verify/test_gemm_fast.py::test_gemm_fast_default_batch_invariant"], needs_gpu=True),
    # DenseGemm(wgmma=True): the MMA kind, like the K split, fixes a token's bits
    _one("fast GEMM: the wide mode's MMA kind follows the token chunks (mma.sync up to 128 "
         "rows, wgmma above)",
         "fast/gemm/host.py",
         "    elif wgmma:\n        tactic = Tactic(warps=4, mtiles=rows // 64,",
         "    elif wgmma and chunks > 2:\n        tactic = Tactic(warps=4, mtiles=rows // 64,",
         ["verify/test_gemm_fast.py::test_gemm_fast_wide_rows[fast-front-wgmma]"],
         needs_gpu=True),
    # DenseGemm(chunk_windows=16): the chunk width may move no bit, so never the K split
    _one("fast GEMM: 128-row token chunks halve the K split",
         "fast/gemm/host.py",
         "        tactic = Tactic(warps=rows // 16, mtiles=1, splits=splits, wgmma=True, serial=serial,",
         "        tactic = Tactic(warps=rows // 16, mtiles=1, splits=max(1, splits // 2), wgmma=True,\n"
         "                        serial=serial,",
         ["verify/test_gemm_fast.py::test_gemm_fast_wide_chunks[fast-front]"], needs_gpu=True),
    # DepLayer(invariant_mma="wgmma"): its one-chunk calls take choose_tactic's rule too
    _one("fast GEMM: the DEP dense GEMMs' MMA kind follows the batch (mma.sync up to 24 "
         "tokens, wgmma above)",
         "fast/gemm/host.py",
         "    elif wgmma:\n        tactic = Tactic(warps=4, mtiles=rows // 64,",
         "    elif wgmma and tokens > 24:\n        tactic = Tactic(warps=4, mtiles=rows // 64,",
         ["verify/test_dep_fast.py::test_dep_fast_batch_invariant[fast-4-wgmma]"],
         needs_gpu=True),
    _one("fast GEMM: the wide layer's K split follows the token chunks (halved above 128 rows)",
         "fast/gemm/host.py",
         "        tactic = Tactic(warps=rows // 32, mtiles=2, splits=splits, serial=serial,\n",
         "        tactic = Tactic(warps=rows // 32, mtiles=2,\n"
         "                        splits=splits // 2 if chunks > 2 and splits > 1 else splits,\n"
         "                        serial=serial,\n",
         ["verify/test_wide_fast.py::test_wide_fast_batch_invariant"], needs_gpu=True,
         expect="vs the same tokens at T="),
    # invariant_gemms="stock": the cuBLAS GEMMs of the mode must not split K (cuBLAS picks
    # its split per row count; measured at the real TP8 widths: rows differ at up to 203
    # row counts of 65..1024 with it)
    _one("wide layer: the batch-invariant mode's cuBLAS GEMMs may split K again",
         "fast/schedules/wide_program.py",
         "    return rank.gemms is None\n",
         "    return True\n",
         ["verify/test_wide_fast.py::test_wide_fast_real_tp8_stock_gemms_batch_invariant"],
         needs_gpu=True, expect="vs the same tokens at T="),
    _one("fast.stock: split_k=False leaves cuBLASLt's split-K allowed",
         "fast/stock.py",
         "        flags.allow_bf16_reduced_precision_reduction = (False, split_k)",
         "        flags.allow_bf16_reduced_precision_reduction = (False, True)",
         ["verify/test_stock.py::test_stock_no_split_k_batch_invariant[stock-tp8.shared_gate_up]"],
         needs_gpu=True, expect="without split-K: rows at M=", keyword="stock"),
    _one("DEP dense part: the batch-invariant mode's cuBLAS GEMMs may split K again",
         "fast/schedules/dense.py",
         "        return stock.mm_bf16(a, self._weight[gemm], split_k=not self.batch_invariant)",
         "        return stock.mm_bf16(a, self._weight[gemm], split_k=True)",
         ["verify/test_dep_fast.py::test_dep_fast_real_dep16_stock_batch_invariant"],
         needs_gpu=True, expect="vs the same tokens at T="),
    # Tactic.serial: the splits in one CTA must fold exactly where a split CTA's chain ends
    _one("fast GEMM: serial splits fold their partial sum at every stage, not at each "
         "split's end",
         "fast/gemm/kernel.py",
         "                if (s + 1) % per_split == 0:",
         "                if (s + 1) % 1 == 0:",
         ["verify/test_gemm_fast.py::test_gemm_fast_wide_serial_splits[fast-front-mma.sync]"],
         needs_gpu=True, expect="serial = cross-CTA splits"),
    # fast.gemm.GroupedGemm: each CTA takes its own GEMM's pointers, split and output kind
    _one("fast GEMM: a grouped launch stores the second GEMM (the router) with the first's "
         "output kind (BF16 for FP32)", "fast/gemm/kernel.py",
         "                  cutlass.select_(second, flags2, flags), rows,",
         "                  flags, rows,",
         ["verify/test_gemm_fast.py::test_gemm_fast_grouped_same_bits[fast-mma.sync]"],
         needs_gpu=True, expect="router of the"),
    # fast.gemm.TiledGemm: each split's chain starts from zero, folded in split order
    _one("fast GEMM, tiled kernel: a split's accumulators not zeroed after its fold (the next "
         "split adds onto the previous one's)", "fast/gemm/tiled_kernel.py",
         "            total[i] = h.fadd(total[i], acc[i])\n            acc[i] = Float32(0.0)\n",
         "            total[i] = h.fadd(total[i], acc[i])\n",
         ["verify/test_gemm_fast.py::test_gemm_fast_tiled_same_bits[fast-front]"],
         needs_gpu=True, expect="serial"),
    _one("fast GEMM, tiled kernel: the cross form's last CTA folds the partials in reverse "
         "split order", "fast/gemm/tiled_kernel.py",
         "self.workspace_offset(chunk, tile, sp, j, tid)",
         "self.workspace_offset(chunk, tile, self.splits - 1 - sp, j, tid)",
         ["verify/test_gemm_fast.py::test_gemm_fast_tiled_same_bits[fast-front]"],
         needs_gpu=True, expect="cross"),
    _one("fast GEMM, tiled kernel: in a cluster every CTA multicasts the first slice of the "
         "weight stage (its own slice's coordinate ignored; the stage's bytes still arrive, "
         "the other rows of the slot stay stale)", "fast/gemm/tiled_kernel.py",
         "a_place, b_place = (coord[1], cute.make_layout(cn)), (coord[0], cute.make_layout(cm))",
         "a_place, b_place = (0, cute.make_layout(cn)), (coord[0], cute.make_layout(cm))",
         ["verify/test_gemm_fast.py::test_gemm_fast_tiled_same_bits[fast-front]"],
         needs_gpu=True, expect="cluster"),
    _one("fast GEMM, tiled kernel: the persistent form's completing CTA folds the later "
         "splits of a straddling tile in reverse split order", "fast/gemm/tiled_kernel.py",
         "self.workspace_offset(chunk, wtile, sp, j, tid)",
         "self.workspace_offset(chunk, wtile, S - 1 + first - sp, j, tid)",
         ["verify/test_gemm_fast.py::test_gemm_fast_tiled_same_bits[fast-front]"],
         needs_gpu=True, expect="persistent"),
    _one("fast GEMM: the split-K partials summed in reverse split order", "fast/gemm/kernel.py",
         "got = [ld_cg_v4(ws + lay.ws_offset(Int64(sp), tile, warp, mt, wn, lane,",
         "got = [ld_cg_v4(ws + lay.ws_offset(Int64(splits - 1 - sp), tile, warp, mt, wn, lane,",
         ["verify/test_gemm_fast.py::test_gemm_fast_split_order_designed"], needs_gpu=True),
    _one("fast DEP combine: owners summed in reverse rank order", "fast/schedules/dep_kernels.py",
         "        for o in cutlass.range_constexpr(ranks):\n            keep = present[o] != 0",
         "        for o in reversed(range(ranks)):\n            keep = present[o] != 0",
         ["verify/test_dep_fast.py::test_dep_fast_reduction_orders_designed"], needs_gpu=True),
    _one("fast finalize kernel: k order reversed", "fast/finalize.py",
         "        for k in cutlass.range_constexpr(top_k):\n            w = cute.arch.load(",
         "        for k in reversed(range(top_k)):\n            w = cute.arch.load(",
         ["verify/test_finalize.py::test_finalize"], needs_gpu=True),
]


def _apply(tree: Path, m: Mutation) -> None:
    for package in ("model", "reference", "fast", "verify", "examples"):
        shutil.copytree(ROOT / package, tree / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    for path, old, new in m.edits:
        target = tree / path
        text = target.read_text()
        count = text.count(old)
        assert count == 1, f"{m.name}: the snippet occurs {count} times in {path}, not once"
        target.write_text(text.replace(old, new))


def _id(m: Mutation) -> str:
    return ("gpu: " if m.needs_gpu else "") + m.name


@pytest.mark.parametrize("mutation", MUTATIONS, ids=_id)
def test_planted_bug_snippets_exist(mutation):
    """Every edit of every planted bug finds its snippet exactly once in today's tree, on
    any machine: a refactor that moves a GPU bug's snippet fails here on the CPU, not only
    on the next GPU run (two did: a renamed helper and a re-indented block)."""
    for path, old, _ in mutation.edits:
        count = (ROOT / path).read_text().count(old)
        assert count == 1, f"{mutation.name}: the snippet occurs {count} times in {path}, not once"


@functools.cache
def _collected(backend: str | None) -> tuple[str, ...]:
    """The node ids ``pytest --collect-only`` lists over every contract file the planted
    bugs name (with ``--backend``, if given): collection needs no GPU."""
    files = sorted({c.split("::")[0] for m in MUTATIONS if m.backend == backend
                    for c in m.contracts})
    cmd = [sys.executable, "-m", "pytest", *files, "--collect-only", "-q",
           "-p", "no:cacheprovider"] + (["--backend", backend] if backend else [])
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return tuple(line for line in done.stdout.splitlines() if "::" in line)


@pytest.mark.parametrize("mutation", MUTATIONS, ids=_id)
def test_planted_bug_contracts_select_a_case(mutation):
    """On any machine: the contracts and ``-k`` keyword of every planted bug select at least
    one case, so a GPU run never reports a bug as missed because nothing ran (one did: a
    ``fast.stock`` bug run with the fast kernels' keyword). ``-k WORD`` is matched as pytest
    matches one word, a case-insensitive substring of the case's names, which its node id
    (module, function, parameters) holds."""
    ids = _collected(mutation.backend)
    for contract in mutation.contracts:
        chosen = [i for i in ids if i == contract or i.startswith((contract + "[", contract + "::"))]
        if mutation.selection:
            chosen = [i for i in chosen if mutation.selection.lower() in i.lower()]
        assert chosen, (f"{mutation.name}: {contract} with -k {mutation.selection!r} selects no "
                        f"case of the {len(ids)} collected")


@pytest.mark.parametrize("mutation", MUTATIONS, ids=_id)
def test_planted_bug_fails_verify(mutation, tmp_path):
    if mutation.needs_gpu and not torch.cuda.is_available():
        pytest.skip("this bug is planted in a fast kernel: the contracts that catch it run "
                    "the kernel, on an SM90/SM100 GPU")
    _apply(tmp_path, mutation)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, LATENTMOE_REPORT_DIR=str(tmp_path),
               PYTHONDONTWRITEBYTECODE="1")
    args = list(mutation.contracts)
    if mutation.selection:
        args += ["-k", mutation.selection]
    if mutation.backend:
        args += ["--backend", mutation.backend]
    cmd = [sys.executable, "-m", "pytest", *args, "-x", "-q",
           "-p", "no:cacheprovider", "--rootdir", str(tmp_path)]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    tail = (done.stdout + done.stderr)[-3000:]
    assert done.returncode != 5, (
        f"planted bug '{mutation.name}': {mutation.contracts} with -k {mutation.selection!r} "
        f"selected no test, so nothing could catch it:\n{tail}")
    assert done.returncode == 1, (
        f"planted bug '{mutation.name}' was NOT caught by {mutation.contracts} "
        f"(pytest exit {done.returncode}):\n{tail}")
    assert " failed" in done.stdout, tail
    if mutation.expect:
        assert mutation.expect in done.stdout, (
            f"planted bug '{mutation.name}' failed without {mutation.expect!r}:\n{tail}")
