"""``tools/sass_budget.py``: the loops it finds in a listing and the instructions it counts
per 512 bytes of weights must be the compiled kernels' own, and a warpgroup-MMA loop must
not be serialized by the compiler (a wait after every MMA group would show in the count)."""

from __future__ import annotations

import struct

import pytest
from tools.sass_budget import (KINDS, budget, gemm_budget, kernel_attributes, loop_budgets, loops,
                               ncu_regions, nvdisasm, parse)

from fast import backend

_cute_error = backend.cute_import_error()
needs_cute = pytest.mark.skipif(_cute_error is not None,
                                reason=f"CuTe DSL not importable: {_cute_error}")


def _nvdisasm_error():
    try:
        nvdisasm()
    except RuntimeError as error:
        return str(error)
    return None


needs_nvdisasm = pytest.mark.skipif(_nvdisasm_error() is not None,
                                    reason=f"no nvdisasm: {_nvdisasm_error()}")

# the shape the compiler gives the engine's main loop: the stage's copies moved out of
# line before the loop's first block, reached by a forward-looking branch that lands
# before it, and jumping back into the loop; an outer loop around it
_LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0020*/                   BRA `(.L_x_1) ;
.L_x_3:
        /*0030*/                   LDGSTS.E.BYPASS.128 [R4], desc[UR4][R6.64] ;
        /*0040*/                   LDGSTS.E.BYPASS.128 [R4+0x200], desc[UR4][R6.64+0x200] ;
        /*0050*/                   BRA `(.L_x_2) ;
.L_x_1:
        /*0060*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0070*/              @!P0 BRA `(.L_x_3) ;
.L_x_2:
        /*0080*/                   LDS.128 R8, [R5] ;
        /*0090*/                   LOP3.LUT R9, R8, 0x81c081c0, RZ, 0xc0, !PT ;
        /*00a0*/                   HMUL2.BF16_V2 R9, R9, R10 ;
        /*00b0*/                   HMMA.16816.F32.BF16 R12, R16, R20, R12 ;
        /*00c0*/                   HMMA.16816.F32.BF16 R12, R16, R22, R12 ;
        /*00d0*/                   HMMA.16816.F32.BF16 R12, R16, R20, R12 ;
        /*00e0*/                   HMMA.16816.F32.BF16 R12, R16, R22, R12 ;
        /*00f0*/               @P1 BRA `(.L_x_1) ;
        /*0100*/               @P2 BRA `(.L_x_0) ;
        /*0110*/                   EXIT ;
"""


def test_loops_take_the_out_of_line_block_and_leave_the_outer_loop():
    instructions, labels = parse(_LISTING)
    assert [i.opcode for i in instructions][:3] == ["MOV", "IADD3", "BRA"]
    found = loops(instructions, labels)
    assert len(found) == 1  # the outer loop holds the inner one's start: left out
    body = [instructions[i].opcode for i in found[0]]
    assert body.count("LDGSTS") == 2 and body.count("HMMA") == 4
    assert "IADD3" not in body and "MOV" not in body and "EXIT" not in body


def test_loop_budgets_count_per_512_bytes_and_read_the_live_windows():
    (one,) = loop_budgets(_LISTING, units=1)
    # 4 HMMA over 1 chunk: 1 live window; 13 instructions from the BAR to the back branch
    assert one.live == 1 and one.instructions == 13
    assert one.kinds["mma"] == 4 and one.kinds["copy"] == 2 and one.kinds["decode"] == 2
    assert one.per_unit() == 13.0
    wgmma = _LISTING.replace("HMMA.16816.F32.BF16 R12, R16, R2",
                             "HGMMA.64x24x16.F32.BF16 R24, R64, gdesc[UR8], R2")
    (two,) = loop_budgets(wgmma, units=2)
    assert two.live == 3 and two.per_unit() == 6.5 and two.mma_waits == 0
    waited = wgmma.replace("        /*00f0*/               @P1 BRA",
                           "        /*00e8*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;\n"
                           "        /*00f0*/               @P1 BRA")
    assert loop_budgets(waited, units=2)[0].mma_waits == 1


def test_ncu_regions_split_the_source_page_into_loops_and_the_rest(tmp_path):
    """Nsight Compute's SASS source page of the listing above (branch targets as
    addresses): the loop's executed instructions and samples against the rest's."""
    import csv
    import gzip

    instructions, _ = parse(_LISTING)
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
              "stall_wait", "stall_barrier", "stall_wait (Not Issued)"]
    address = {ins.index: f"0x7f00{16 * ins.index:04x}" for ins in instructions}
    label_at = {".L_x_0": 1, ".L_x_1": 6, ".L_x_2": 8, ".L_x_3": 3}
    rows = []
    for ins in instructions:
        text = ins.text.split("*/", 1)[1].strip().rstrip(" ;")
        for label, at in label_at.items():
            text = text.replace(f"`({label})", address[at])
        inside = 3 <= ins.index <= 15
        executed = 10 if inside else 1  # the loop ran 10 times
        rows.append([address[ins.index], text, str(2 * executed), str(executed),
                     str(executed), str(executed), "0"])
    path = tmp_path / "page.csv.gz"
    with gzip.open(path, "wt", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Kernel Name", "k"])
        writer.writerow(header)
        writer.writerows(rows)
    regions = ncu_regions(path, units=10.0, loop_units=1)
    assert [r[0] for r in regions] == ["main loop, 1 live window", "rest of the kernel"]
    (_, loop_per_unit, loop_share, stalls), (_, rest_per_unit, rest_share, _) = regions
    assert loop_per_unit == 13 * 10 / 10.0 and rest_per_unit == 5 / 10.0
    assert loop_share == 260 / 270 and rest_share == 10 / 270
    assert stalls == {"wait": 0.5, "barrier": 0.5}


def test_kernel_attributes_read_the_register_count_and_frame():
    records = (struct.pack("<BBHII", 0x04, 0x2F, 8, 11, 120)  # REGCOUNT 120
               + struct.pack("<BBH", 0x03, 0x1B, 0xFF)  # an HVAL record
               + struct.pack("<BB", 0x01, 0x0A)  # an NVAL record
               + struct.pack("<BBHII", 0x04, 0x11, 8, 11, 16))  # FRAME_SIZE 16
    names = b"\0.nv.info\0.shstrtab\0"
    body = records + names
    shoff = 64 + len(body)
    header = bytearray(64)
    struct.pack_into("<Q", header, 0x28, shoff)
    struct.pack_into("<HHH", header, 0x3A, 64, 3, 2)
    table = (bytes(64)
             + struct.pack("<IIQQQQ", 1, 0x70000000, 0, 0, 64, len(records)) + bytes(24)
             + struct.pack("<IIQQQQ", 10, 3, 0, 0, 64 + len(records), len(names)) + bytes(24))
    assert kernel_attributes(bytes(header) + body + table) == {"registers": 120, "frame": 16}


@needs_cute
@needs_nvdisasm
def test_the_engines_main_loops_hold_their_mmas_and_wgmma_is_not_serialized():
    """DEP16 FC1 at 4 windows: mma.sync issues 4 MMAs per chunk and live window, one loop
    copy per live count 1..4; with wgmma each loop copy issues 4 warpgroup MMAs per chunk
    (one group per m-tile and chunk), waits for all of them once per stage, and the decode
    stays the largest part of the loop."""
    ((_, attrs, mma),) = budget("sm_90a", "dep16", 4, "", ("fc1",))
    assert [b.live for b in mma] == [1, 2, 3, 4] and attrs["registers"] <= 128
    for b in mma:
        assert b.per_unit("mma") == 4 * b.live
    ((_, _, wide),) = budget("sm_90a", "dep16", 4, "wgmma=1", ("fc1",))
    assert [b.live for b in wide] == [1, 2, 3, 4]
    for b in wide:
        assert b.per_unit("mma") == 4  # m64nNk16: one per 16 k of the warp's m-tile chunk
        # one wait per group (an m-tile's chunk) and the stage's last; a compiler that
        # serializes the MMAs waits after every one (4 per group)
        assert b.mma_waits <= b.units + 1, f"{b.mma_waits} waits for {b.units} groups"
        assert b.per_unit("decode") == max(b.per_unit(k) for k in KINDS)


def test_a_loop_of_one_block_is_that_block_alone():
    """The dense GEMM's main loop is one basic block that branches back to its own label;
    the prologue before it (which falls into the label) is not part of it."""
    listing = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0020*/              @!P0 BRA `(.L_x_0) ;
        /*0030*/                   LDGSTS.E.BYPASS.128 [R4], desc[UR4][R6.64] ;
.L_x_1:
        /*0040*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0050*/                   LDS.128 R8, [R5] ;
        /*0060*/                   HMMA.16816.F32.BF16 R12, R16, R20, R12 ;
        /*0070*/               @P2 BRA `(.L_x_1) ;
.L_x_0:
        /*0080*/                   EXIT ;
"""
    instructions, labels = parse(listing)
    (body,) = loops(instructions, labels)
    assert [instructions[i].opcode for i in body] == ["BAR", "LDS", "HMMA", "BRA"]


@needs_cute
@needs_nvdisasm
def test_the_dense_gemms_main_loop_holds_one_mma_per_chunk_and_window():
    """fast.gemm's DenseFront default (2 warps x 2 m-tiles, 64-k stages): its main loop is
    one block, found as such, with one ``mma.m16n8k16`` per 512 B of BF16 weights and live
    window; the 4-window kernel four."""
    shape = dict(warps=2, mtiles=2, ring=8, stage_k=64, occupancy=2)
    for windows in (1, 4):
        attrs, (loop,) = gemm_budget("sm_90a", dict(shape, windows=windows))
        assert loop.live == windows and loop.units == 8
        assert loop.per_unit("mma") == windows and loop.per_unit("copy") >= 1
        assert attrs["registers"] <= 255
