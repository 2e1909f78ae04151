"""The PTX instructions the kernels issue, one helper each (CuTe DSL inline PTX, and the
DSL's own vector load and store for ``load_v4`` / ``store_v4``): global and shared memory
accesses, atomics, cross-GPU acquire and release, ``cp.async``, warp shuffles, byte
permutes, conversions and the tensor-core MMAs (``mma.sync``, sm_90a's ``wgmma``).

Addresses are plain integers: ``Int64`` generic/global addresses, ``Int32`` shared-window
addresses (``Pointer.toint()`` of a shared-memory pointer), so the kernels do their own
index arithmetic and every access is exactly the instruction named here. ``load_v4`` and
``store_v4`` take CuTe pointers instead (the memory-bound kernels' 16-byte accesses).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir import ir
from cutlass._mlir.dialects import vector

__all__ = [
    "ldg_stream_v4", "ldg_u32", "ldg_u8", "ldg_i32", "ldg_v2", "ldg_u64",
    "stg_u16", "stg_u8", "stg_f32", "stg_i32", "stg_u32", "stg_v4", "atomic_cas", "ld_acquire_sys",
    "cp_async_16", "cp_async_4", "cp_async_4z", "lds_u16", "lds_v4", "sts_v4", "sts_f32", "lds_f32", "sts_i32", "lds_i32",
    "mma_bf16", "rotr", "prmt", "mul_bf16x2", "atomic_add", "atomic_max", "shfl_xor", "shfl_up",
    "e4m3x2_to_f32", "f32x2_to_e4m3x2", "f32_to_bf16_bits",
    "smem_matrix_descriptor", "smem_matrix_descriptor_sw128", "smem_descriptor_offset", "wgmma_bf16", "wgmma_bf16_ss", "wgmma_e4m3_ss", "wgmma_settle", "ld_relaxed_gpu",
    "fence_acq_rel_gpu",
    "red_release_gpu_add", "pinned_i32", "lds_u32", "load_v4", "store_v4",
]


def _asm(code, outs, ins):
    return cute.arch.inline_ptx(code, write_only_types=outs, read_only_args=ins)


# --- global memory ------------------------------------------------------------------


def ldg_stream_v4(address):
    """Four words from a 16-byte aligned global address, streamed: read once, not kept
    in L1 (``ld.global.nc.L1::no_allocate.v4.u32``)."""
    return _asm("ld.global.nc.L1::no_allocate.v4.u32 { {$w0}, {$w1}, {$w2}, {$w3} }, [{$r0}];",
                [Uint32] * 4, [Int64(address)])


def ldg_v2(address):
    """Two words from an 8-byte aligned global address (``ld.global.nc.v2.u32``)."""
    return _asm("ld.global.nc.v2.u32 { {$w0}, {$w1} }, [{$r0}];", [Uint32] * 2, [Int64(address)])


def ldg_u32(address):
    return _asm("ld.global.nc.u32 {$w0}, [{$r0}];", [Uint32], [Int64(address)])


def ldg_u64(address):
    """A 64-bit global load of an entry of an address table (``ld.global.nc.u64``)."""
    return _asm("ld.global.nc.u64 {$w0}, [{$r0}];", [Int64], [Int64(address)])


def ld_acquire_sys(address):
    """``ld.acquire.sys.global.u32``: a counter another GPU adds to."""
    return _asm("ld.acquire.sys.global.u32 {$w0}, [{$r0}];", [Uint32], [Int64(address)])


def ld_relaxed_gpu(address):
    """A 32-bit strong load at GPU scope without ordering (``ld.relaxed.gpu``: reads L2,
    invalidates nothing), for a spin that ends in ``fence_acq_rel_gpu``."""
    return _asm("ld.relaxed.gpu.global.u32 {$w0}, [{$r0}];", [Uint32], [Int64(address)])


def fence_acq_rel_gpu():
    """``fence.acq_rel.gpu``: with a relaxed load before it, an acquire. Compiles to a
    memory barrier that waits for this thread's outstanding accesses, then the L1
    invalidation. (A spin on ``ld.acquire.gpu`` instead invalidates L1 at every poll,
    with no barrier first. On the H200 a fused experts kernel faulted with "illegal
    address" at that invalidation, and it ran clean with the relaxed spin and this fence.)"""
    _asm("fence.acq_rel.gpu;", [], [])


def red_release_gpu_add(address, value):
    """Add ``value`` to a 32-bit word with GPU-scope release semantics: ``fence.acq_rel.gpu``
    then a relaxed reduction (cumulative over what this thread observed, e.g. its CTA's
    stores before a barrier)."""
    _asm("fence.acq_rel.gpu; red.relaxed.gpu.global.add.s32 [{$r0}], {$r1};", [],
         [Int64(address), Int32(value)])


def ldg_u8(address):
    return _asm("{ .reg .b16 t; ld.global.nc.u8 t, [{$r0}]; cvt.u32.u16 {$w0}, t; }",
                [Uint32], [Int64(address)])


def ldg_i32(address):
    """A coherent 32-bit global load (``ld.global.s32``: data another kernel or CTA wrote)."""
    return _asm("ld.global.s32 {$w0}, [{$r0}];", [Int32], [Int64(address)])


def stg_u16(address, value):
    _asm("{ .reg .b16 t; cvt.u16.u32 t, {$r1}; st.global.u16 [{$r0}], t; }", [],
         [Int64(address), Uint32(value)])


def stg_u8(address, value):
    _asm("{ .reg .b16 t; cvt.u16.u32 t, {$r1}; st.global.u8 [{$r0}], t; }", [],
         [Int64(address), Uint32(value)])


def stg_f32(address, value):
    _asm("st.global.f32 [{$r0}], {$r1};", [], [Int64(address), Float32(value)])


def stg_i32(address, value):
    _asm("st.global.s32 [{$r0}], {$r1};", [], [Int64(address), Int32(value)])


def stg_u32(address, value):
    _asm("st.global.u32 [{$r0}], {$r1};", [], [Int64(address), Uint32(value)])


def stg_v4(address, words):
    _asm("st.global.v4.u32 [{$r0}], { {$r1}, {$r2}, {$r3}, {$r4} };", [],
         [Int64(address)] + [Uint32(w) for w in words])


def atomic_add(address, value):
    """``atom.global.add.s32``: the old value."""
    return _asm("atom.global.add.s32 {$w0}, [{$r0}], {$r1};", [Int32], [Int64(address), Int32(value)])


def atomic_cas(address, compare, value):
    """``atom.global.cas.b32``: the old value."""
    return _asm("atom.global.cas.b32 {$w0}, [{$r0}], {$r1}, {$r2};", [Int32],
                [Int64(address), Int32(compare), Int32(value)])


def atomic_max(address, value):
    _asm("{ .reg .s32 t; atom.global.max.s32 t, [{$r0}], {$r1}; }", [], [Int64(address), Int32(value)])


# --- 16-byte global accesses through CuTe pointers ---------------------------------------------------------


def load_v4(ptr):
    """Four 32-bit words from a 16-byte aligned address (one ``ld.global.v4.b32``)."""
    vt = ir.VectorType.get([4], Uint32.mlir_type)
    v = cute.arch.load(ptr, vt)
    return [Uint32(vector.extract(v, [], [i])) for i in range(4)]


def store_v4(ptr, words):
    """Four 32-bit words to a 16-byte aligned address (one ``st.global.v4.b32``)."""
    vt = ir.VectorType.get([4], Uint32.mlir_type)
    v = vector.from_elements(vt, [Uint32(w).ir_value() for w in words])
    cute.arch.store(ptr, v)


# --- shared memory ------------------------------------------------------------------


def cp_async_16(smem_address, global_address, valid):
    """Copy 16 bytes global -> shared, bypassing L1 (``cp.async.cg``); ``valid`` false
    fills the 16 bytes with zeros and reads nothing."""
    if isinstance(valid, bool):  # known at trace time: the plain 16-byte copy
        if valid:
            _asm("cp.async.cg.shared.global [{$r0}], [{$r1}], 16;", [],
                 [Int32(smem_address), Int64(global_address)])
        return
    size = cutlass.select_(valid, Int32(16), Int32(0))
    _asm("cp.async.cg.shared.global [{$r0}], [{$r1}], 16, {$r2};", [],
         [Int32(smem_address), Int64(global_address), Int32(size)])


def cp_async_4(smem_address, global_address):
    """Copy 4 bytes global -> shared (``cp.async.ca``, 4-byte aligned)."""
    _asm("cp.async.ca.shared.global [{$r0}], [{$r1}], 4;", [],
         [Int32(smem_address), Int64(global_address)])


def cp_async_4z(smem_address, global_address, valid):
    """Copy 4 bytes global -> shared (``cp.async.ca``); ``valid`` false fills them with
    zeros and reads nothing."""
    size = cutlass.select_(valid, Int32(4), Int32(0))
    _asm("cp.async.ca.shared.global [{$r0}], [{$r1}], 4, {$r2};", [],
         [Int32(smem_address), Int64(global_address), Int32(size)])


def pinned_i32(value):
    """``value`` through an opaque move: the compiler keeps the result in a register (or
    spills it) instead of recomputing the expression that made it inside a loop."""
    return _asm("mov.b32 {$w0}, {$r0};", [Int32], [Int32(value)])


def lds_u32(smem_address):
    return _asm("ld.shared.u32 {$w0}, [{$r0}];", [Uint32], [Int32(smem_address)])


def lds_u16(smem_address):
    return _asm("{ .reg .b16 t; ld.shared.u16 t, [{$r0}]; cvt.u32.u16 {$w0}, t; }", [Uint32],
                [Int32(smem_address)])


def lds_v4(smem_address):
    return _asm("ld.shared.v4.u32 { {$w0}, {$w1}, {$w2}, {$w3} }, [{$r0}];", [Uint32] * 4,
                [Int32(smem_address)])


def sts_v4(smem_address, words):
    _asm("st.shared.v4.u32 [{$r0}], { {$r1}, {$r2}, {$r3}, {$r4} };", [],
         [Int32(smem_address)] + [Uint32(w) for w in words])


def sts_f32(smem_address, value):
    _asm("st.shared.f32 [{$r0}], {$r1};", [], [Int32(smem_address), Float32(value)])


def lds_f32(smem_address):
    return _asm("ld.shared.f32 {$w0}, [{$r0}];", [Float32], [Int32(smem_address)])


def sts_i32(smem_address, value):
    _asm("st.shared.s32 [{$r0}], {$r1};", [], [Int32(smem_address), Int32(value)])


def lds_i32(smem_address):
    return _asm("ld.shared.s32 {$w0}, [{$r0}];", [Int32], [Int32(smem_address)])


# --- arithmetic ---------------------------------------------------------------------


def mma_bf16(a, b, c):
    """``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32``: a 4 words, b 2 words, c 4
    FP32 accumulators; returns the 4 new accumulators."""
    return _asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{ {$w0}, {$w1}, {$w2}, {$w3} }, { {$r0}, {$r1}, {$r2}, {$r3} }, "
        "{ {$r4}, {$r5} }, { {$r6}, {$r7}, {$r8}, {$r9} };",
        [Float32] * 4, [Uint32(x) for x in a] + [Uint32(x) for x in b] + [Float32(x) for x in c])


def rotr(word, n: int):
    """Rotate right by the constant ``n`` (``shf.r.wrap.b32``)."""
    return _asm(f"shf.r.wrap.b32 {{$w0}}, {{$r0}}, {{$r0}}, {n};", [Uint32], [Uint32(word)])


def prmt(a, b, selector: int):
    """``prmt.b32``: byte permute of {b, a} by the constant selector."""
    return _asm(f"prmt.b32 {{$w0}}, {{$r0}}, {{$r1}}, {selector:#x};", [Uint32],
                [Uint32(a), Uint32(b)])


def mul_bf16x2(a, b):
    """Two BF16 products, each rounded to nearest even (``mul.rn.bf16x2``)."""
    return _asm("mul.rn.bf16x2 {$w0}, {$r0}, {$r1};", [Uint32], [Uint32(a), Uint32(b)])


def shfl_xor(value, mask: int):
    """The value of lane ``lane ^ mask`` (``shfl.sync.bfly.b32``, full warp)."""
    return _asm(f"shfl.sync.bfly.b32 {{$w0}}, {{$r0}}, {mask}, 31, -1;", [Uint32], [Uint32(value)])


def e4m3x2_to_f32(word16):
    """The two E4M3 codes in the low 16 bits of ``word16`` as FP32 (exact, via f16)."""
    return _asm(
        "{ .reg .b16 lo, hi, x; .reg .b32 h2; cvt.u16.u32 x, {$r0}; "
        "cvt.rn.f16x2.e4m3x2 h2, x; mov.b32 {lo, hi}, h2; "
        "cvt.f32.f16 {$w0}, lo; cvt.f32.f16 {$w1}, hi; }",
        [Float32, Float32], [Uint32(word16)])


def f32x2_to_e4m3x2(lo, hi):
    """Two FP32 values to E4M3 codes (RNE, saturating to ±448), ``lo`` in bits 0-7."""
    return _asm("{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, {$r1}, {$r0}; cvt.u32.u16 {$w0}, t; }",
                [Uint32], [Float32(lo), Float32(hi)])


def f32_to_bf16_bits(value):
    """BF16 bits (RNE; overflow to inf) of an FP32 value, in the low 16 bits."""
    return _asm("{ .reg .b16 t; cvt.rn.bf16.f32 t, {$r0}; cvt.u32.u16 {$w0}, t; }",
                [Uint32], [Float32(value)])


def shfl_up(value, delta: int):
    """The value of lane ``lane - delta`` (own value for lanes below ``delta``)."""
    return _asm(f"shfl.sync.up.b32 {{$w0}}, {{$r0}}, {delta}, 0, -1;", [Uint32], [Uint32(value)])


# --- warpgroup MMA (sm_90a only) ----------------------------------------------------


def smem_matrix_descriptor(address, leading: int, stride: int):
    """The 64-bit shared-memory matrix descriptor of ``wgmma`` for a K-major operand
    without swizzle: core matrices of 8 rows x 16 bytes stored as 128 contiguous bytes,
    ``leading`` bytes between core matrices adjacent in K, ``stride`` bytes between core
    matrices adjacent in M/N; ``address`` (Int32 shared-window address) 16-byte aligned.
    Bits 0-13 address >> 4, 16-29 leading >> 4, 32-45 stride >> 4, 62-63 layout 0."""
    if leading % 16 or stride % 16 or not (0 < leading < 1 << 18) or not (0 < stride < 1 << 18):
        raise ValueError(f"descriptor offsets must be positive multiples of 16 below 256 KiB, "
                         f"got leading={leading}, stride={stride}")
    high = Int64((stride >> 4) << 32)
    low = Int64(((Int32(address) >> 4) & Int32(0x3FFF)) | Int32((leading >> 4) << 16))
    return high | low


def smem_matrix_descriptor_sw128(address, stride: int):
    """The 64-bit shared-memory matrix descriptor of ``wgmma`` for a K-major operand under
    the 128-byte swizzle: rows of 128 bytes (64 BF16 k), 16-byte chunk ``c`` of row ``r``
    stored at chunk ``c ^ (r % 8)``, ``stride`` bytes between 8-row groups (1024 when the
    groups are contiguous); ``address`` (Int32 shared-window address) the first row's
    address plus the bytes into the row of the step's first k (the tensor cores swizzle the
    address they form, so the 8-row atoms must start 1024-byte aligned). Bits 0-13 address
    >> 4, 16-29 leading byte offset >> 4 (unused by this layout: 1), 32-45 stride >> 4,
    49-51 base offset 0, 62-63 layout 1 (128-byte swizzle)."""
    if stride % 16 or not (0 < stride < 1 << 18):
        raise ValueError(f"descriptor stride must be a positive multiple of 16 below 256 KiB, "
                         f"got {stride}")
    high = Int64(((stride >> 4) << 32) | (1 << 62))
    low = Int64(((Int32(address) >> 4) & Int32(0x3FFF)) | Int32(1 << 16))
    return high | low


def smem_descriptor_offset(descriptor, offset: int):
    """``descriptor`` (``smem_matrix_descriptor``) moved ``offset`` bytes on (a multiple of
    16): its start-address field plus ``offset >> 4``, one add. The caller keeps the start
    below 256 KiB (the field's 14 bits; shared memory is at most 228 KiB), so the add never
    carries out of the field."""
    if offset % 16 or offset < 0:
        raise ValueError(f"descriptor offsets are non-negative multiples of 16, got {offset}")
    return descriptor + Int64(offset >> 4)


def _ir(value):
    return value.ir_value()


def wgmma_bf16(acc, a, descriptor, n: int):
    """``wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16``: ``acc`` (``n / 2`` FP32
    accumulators of this thread) += A (this warp's 16 rows, 4 registers in the
    ``mma.m16n8k16`` A-fragment order) x B (``n`` x 16, K-major, from ``descriptor``).
    Asynchronous: the caller brackets it with ``warpgroup.fence`` / ``commit_group`` /
    ``wait_group`` and reads the accumulators only through ``wgmma_settle`` after the wait.
    Returns the accumulators (the same registers: tied operands)."""
    from cutlass._mlir.dialects import llvm

    count = n // 2
    if n % 8 or not 8 <= n <= 256 or len(acc) != count or len(a) != 4:
        raise ValueError(f"wgmma m64n{n}k16 takes {n // 2} accumulators and 4 A registers")
    outs = ", ".join(f"${i}" for i in range(count))
    ins = ", ".join(f"${count + i}" for i in range(4))
    code = (f"{{ .reg .pred p; setp.ne.b32 p, ${count + 5}, 0; "
            f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{outs}}}, {{{ins}}}, "
            f"${count + 4}, p, 1, 1, 0; }}")
    constraints = ",".join(["=f"] * count + ["r"] * 4 + ["l", "r"] + [str(i) for i in range(count)])
    f32 = ir.F32Type.get()
    struct = llvm.StructType.get_literal([f32] * count)
    operands = ([_ir(Uint32(x)) for x in a] + [_ir(Int64(descriptor)), _ir(Int32(1))]
                + [_ir(Float32(x)) for x in acc])
    result = llvm.inline_asm(struct, operands, code, constraints, has_side_effects=True)
    return [Float32(llvm.extractvalue(f32, result, [i])) for i in range(count)]


def _wgmma_ss(acc, a_descriptor, b_descriptor, accumulate, instruction: str, immediates: str):
    """One ``wgmma`` with both operands by descriptor: ``instruction`` (the mnemonic with
    its shape and types), the scale-d predicate from ``accumulate`` (Int32, non-zero: D
    added) and the trailing ``immediates``; ``acc`` tied to the outputs."""
    from cutlass._mlir.dialects import llvm

    count = len(acc)
    outs = ", ".join(f"${i}" for i in range(count))
    code = (f"{{ .reg .pred p; setp.ne.b32 p, ${count + 2}, 0; "
            f"{instruction} {{{outs}}}, ${count}, ${count + 1}, p, {immediates}; }}")
    constraints = ",".join(["=f"] * count + ["l", "l", "r"] + [str(i) for i in range(count)])
    f32 = ir.F32Type.get()
    struct = llvm.StructType.get_literal([f32] * count)
    operands = ([_ir(Int64(a_descriptor)), _ir(Int64(b_descriptor)), _ir(Int32(accumulate))]
                + [_ir(Float32(x)) for x in acc])
    result = llvm.inline_asm(struct, operands, code, constraints, has_side_effects=True)
    return [Float32(llvm.extractvalue(f32, result, [i])) for i in range(count)]


def wgmma_bf16_ss(acc, a_descriptor, b_descriptor, n: int):
    """``wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16`` with both operands in
    shared memory (K-major descriptors): ``acc`` (``n / 2`` FP32 accumulators of this
    thread) += A (64 x 16) x B (``n`` x 16)^T. Asynchronous, as ``wgmma_bf16``."""
    if n % 8 or not 8 <= n <= 256 or len(acc) != n // 2:
        raise ValueError(f"wgmma m64n{n}k16 takes {n // 2} accumulators")
    return _wgmma_ss(acc, a_descriptor, b_descriptor, 1,
                     f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16", "1, 1, 0, 0")


def wgmma_e4m3_ss(acc, a_descriptor, b_descriptor, n: int, accumulate=1):
    """``wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3`` with both operands in
    shared memory (K-major descriptors: 32 FP8 k are 32 bytes, so a 128-byte swizzled row
    holds 128 k and a k step moves the descriptor 32 bytes, as a BF16 k16 step does):
    ``acc`` (``n / 2`` FP32 accumulators of this thread) ``+=`` A (64 x 32) x B (``n`` x
    32)^T where ``accumulate`` (Int32) is non-zero, else ``acc = A B^T`` (the scale-d
    predicate). FP8 operands are K-major only (no transpose immediates). How the tensor
    cores round the sum is not the BF16 MMA's: ``benchmarks/fp8_wgmma_probe.py`` measures it.
    Asynchronous, as ``wgmma_bf16``."""
    if n % 8 or not 8 <= n <= 256 or len(acc) != n // 2:
        raise ValueError(f"wgmma m64n{n}k32 takes {n // 2} accumulators")
    return _wgmma_ss(acc, a_descriptor, b_descriptor, accumulate,
                     f"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3", "1, 1")


def wgmma_settle(values):
    """The accumulators after ``wgmma.wait_group``: one empty volatile statement that takes
    and returns them, ordered after the wait (volatile statements keep their order), so
    no read of an accumulator is scheduled before the MMAs that write it are complete."""
    from cutlass._mlir.dialects import llvm

    count = len(values)
    f32 = ir.F32Type.get()
    struct = llvm.StructType.get_literal([f32] * count)
    constraints = ",".join(["=f"] * count + [str(i) for i in range(count)])
    result = llvm.inline_asm(struct, [_ir(Float32(x)) for x in values], "", constraints,
                             has_side_effects=True)
    return [Float32(llvm.extractvalue(f32, result, [i])) for i in range(count)]
