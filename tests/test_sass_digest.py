"""``tools/sass_digest.py``: the SASS digest that proves a change leaves the kernels' machine
code alone must be stable from one compile to the next and must move when a kernel's code
does."""

from __future__ import annotations

import struct

import pytest
from tools.sass_digest import digest, text_digest

from fast import backend

_cute_error = backend.cute_import_error()
needs_cute = pytest.mark.skipif(_cute_error is not None,
                                reason=f"CuTe DSL not importable: {_cute_error}")


def _elf(sections: dict[bytes, bytes]) -> bytes:
    """A minimal ELF64 image with the given sections (names in a string table)."""
    names = b"\0" + b"".join(n + b"\0" for n in sections) + b".shstrtab\0"
    body, offsets, at = b"", [], 64
    for data in sections.values():
        offsets.append(at + len(body))
        body += data
    strtab_at = at + len(body)
    body += names
    shoff = at + len(body)
    header = bytearray(64)
    struct.pack_into("<Q", header, 0x28, shoff)
    struct.pack_into("<HHH", header, 0x3A, 64, len(sections) + 2, len(sections) + 1)
    table = bytes(64)  # the null section
    name_at = 1
    for (name, data), offset in zip(sections.items(), offsets):
        table += struct.pack("<IIQQQQ", name_at, 1, 0, 0, offset, len(data)) + bytes(24)
        name_at += len(name) + 1
    table += struct.pack("<IIQQQQ", name_at, 3, 0, 0, strtab_at, len(names)) + bytes(24)
    return bytes(header) + body + table


def test_text_digest_reads_only_the_text_sections():
    a = _elf({b".text.k": b"\x01\x02", b".nv.info.k": b"abc", b".debug": b"x"})
    b = _elf({b".text.k": b"\x01\x02", b".nv.info.k": b"xyz", b".debug": b"yy"})
    c = _elf({b".text.k": b"\x01\x03", b".nv.info.k": b"abc", b".debug": b"x"})
    assert text_digest(a) == text_digest(b) and text_digest(a)[1] == 2
    assert text_digest(a)[0] != text_digest(c)[0]
    with pytest.raises(ValueError, match="no .text section"):
        text_digest(_elf({b".nv.info.k": b"abc"}))


@needs_cute
def test_digest_is_stable_and_sees_a_changed_kernel():
    """The plan kernel compiled twice gives one digest; the same kernel with the fused
    grid's extra counter zeroing (another code) gives another."""
    first = digest("sm_90a", "experts", "dep16-fused-w1", "plan")
    assert first == digest("sm_90a", "experts", "dep16-fused-w1", "plan")
    assert len(first) == 1 and " PlanKernel " in first[0]
    other = digest("sm_90a", "experts", "dep16-two-w4-strict", "plan")
    assert first[0].split()[4] != other[0].split()[4]


def test_compare_digests_names_changed_gone_and_new_kernels():
    from tools.sass_digest import compare_digests, parse_lines

    old = parse_lines(["sm_90a stage:real mx Q aaaa 10", "sm_90a stage:real norm N bbbb 20",
                       "sm_90a dep:dep16 combine C cccc 30"])
    new = parse_lines(["sm_90a stage:real mx Q aaaa 10", "sm_90a stage:real norm N eeee 20",
                       "sm_90a dep:dep16 wait W ffff 4"])
    assert compare_digests(old, new) == {"sm_90a stage:real norm N": "changed",
                                         "sm_90a dep:dep16 combine C": "gone",
                                         "sm_90a dep:dep16 wait W": "new"}
    assert compare_digests(old, old) == {}
    # the size is part of the digest
    assert compare_digests(old, parse_lines(["sm_90a stage:real mx Q aaaa 11"]))[
        "sm_90a stage:real mx Q"] == "changed"
