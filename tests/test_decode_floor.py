"""The experts engine's decode cannot drop below 8 integer instructions per word with shifts,
rotations and masks: the searches behind the experts page's claim, on the CPU.

A prepared word holds 8 E2M1 codes; the decode makes 4 BF16x2 registers of it, each with its
8 bits at the positions of ``fast.experts.layout.DECODE_MASK`` (sign, e1, e0, m of the low
and the high code) and zero elsewhere. A register costs one instruction when its bits
already sit at the mask's positions (``w & M``) and two when a shift or rotation brings
them there first (``rotr(w, r) & M``, or a funnel shift of two words, ``shf.r``). The
prepared layout may put any code bit anywhere, so 7 instructions per word need the other
three registers' bits to be three rotations of the mask that, with the mask, tile the word;
and 7 per word over a pair of words need six rotations or funnel shifts that, with the two
masks, tile the 64 bits.
"""

from __future__ import annotations

import itertools

from fast.experts.layout import DECODE_MASK

MASK_BITS = [b for b in range(32) if DECODE_MASK >> b & 1]


def _rotations(r: int, offset: int = 0, mask=MASK_BITS) -> frozenset:
    """Source bits (in a 64-bit pair, ``offset`` 32 for the high word) of ``rotr(w, r) & M``."""
    return frozenset((p + r) % 32 + offset for p in mask)


def _funnel(r: int, low_first: bool, mask=MASK_BITS) -> frozenset:
    """Source bits of ``shf.r(lo, hi, r) & M`` over the pair (low word bits 0..31): the low
    32 bits of ``hi:lo >> r``, with the pair's low word as ``lo`` or swapped."""
    bits = set()
    for p in mask:
        q = p + r  # bit q of hi:lo, 0..62
        if low_first:
            bits.add(q)
        else:  # hi:lo = low:high
            bits.add(q + 32 if q < 32 else q - 32)
    return frozenset(bits)


def _exact_covers(universe: frozenset, candidates: list[frozenset], parts: int) -> int:
    """How many ways ``parts`` of ``candidates`` partition ``universe`` (each partition
    counted once: the set covering the lowest uncovered bit is chosen first)."""
    def cover(rest, left):
        if not rest or left == 0:
            return int(not rest and left == 0)
        low = min(rest)
        return sum(cover(rest - c, left - 1) for c in candidates if low in c and c <= rest)
    return cover(universe, parts)


def one_word_tilings(mask=MASK_BITS) -> int:
    """Triples of rotations that, with ``w & M``, place all 32 bits of a word."""
    rest = frozenset(range(32)) - frozenset(mask)
    inside = sorted({c for r in range(1, 32) if (c := _rotations(r, mask=mask)) <= rest},
                    key=sorted)
    return _exact_covers(rest, inside, 3)


def two_word_tilings(mask=MASK_BITS) -> int:
    """Sets of six rotations or funnel shifts (either word low, 1..31 bits) that, with each
    word's ``w & M``, place all 64 bits of a pair of words."""
    rest = frozenset(range(64)) - frozenset(mask) - frozenset(p + 32 for p in mask)
    candidates = {_rotations(r, off, mask) for r in range(1, 32) for off in (0, 32)}
    candidates |= {_funnel(r, first, mask) for r in range(1, 32) for first in (True, False)}
    inside = sorted((c for c in candidates if c <= rest), key=sorted)
    return _exact_covers(rest, inside, 6)


def test_the_decode_mask_holds_two_codes():
    assert len(MASK_BITS) == 8


def test_the_searches_find_a_tiling_where_one_exists():
    """A mask of one byte per register (bits 0..7) tiles by rotations of 8, 16, 24."""
    assert one_word_tilings(list(range(8))) == 1
    assert two_word_tilings(list(range(8))) > 0


def test_no_three_rotations_tile_one_word():
    """None of the 4495 triples of rotations with the mask partitions the 32 bits: 8
    instructions per word stay (the engine's: a mask, two rotate-and-mask pairs, a gather by
    multiplication)."""
    assert len(list(itertools.combinations(range(1, 32), 3))) == 4495
    assert one_word_tilings() == 0


def test_no_funnel_shifts_tile_a_pair_of_words():
    """Over two words no six rotations or funnel shifts place the other 48 bits: a pair needs
    16 instructions too."""
    assert two_word_tilings() == 0
