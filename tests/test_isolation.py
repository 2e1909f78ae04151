"""``verify.isolation`` on the CPU: the bad rows are what their kinds say, and
``check_others_unchanged`` fails on a changed kept row (home or pair-indexed), ignores the
bad token's rows and refuses stages it cannot index by token."""

from __future__ import annotations

import pytest
import torch

from verify import isolation


class Recording:
    """A stand-in for the ``contract`` fixture: ``bitwise`` compares bytes and records."""

    def __init__(self):
        self.calls = []

    def bitwise(self, actual, expected, *, what, index_names=None):
        self.calls.append(what)
        assert actual.shape == expected.shape and torch.equal(
            actual.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8)), what


def ordinary(h=256, seed=0):
    return torch.randn(h, generator=torch.Generator().manual_seed(seed)).bfloat16()


def test_bad_rows():
    x = ordinary()
    assert isolation.bad_row("nan", x, 1).isnan().all()
    one = isolation.bad_row("one_nan", x, 1)
    assert int(one.isnan().sum()) == 1 and torch.equal(one[~one.isnan()], x[~one.isnan()])
    inf = isolation.bad_row("inf", x, 1).float()
    assert int((inf == float("inf")).sum()) == 1 and int((inf == float("-inf")).sum()) == 1
    huge = isolation.bad_row("huge", x, 1).float()
    assert (huge.abs() == isolation.BF16_MAX).all() and (huge > 0).any() and (huge < 0).any()
    assert torch.equal(isolation.bad_row("huge", x, 1), isolation.bad_row("huge", x, 1))
    assert not x.isnan().any()  # the ordinary row is not modified
    with pytest.raises(ValueError, match="kind must be one of"):
        isolation.bad_row("zero", x, 1)
    with pytest.raises(ValueError, match="ordinary must be a BF16 vector"):
        isolation.bad_row("nan", x.float(), 1)


def stages(tokens=6, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"out": torch.randn(tokens, 8, generator=g).bfloat16(),
            "ids": torch.randint(0, 32, (tokens, k), generator=g, dtype=torch.int32),
            "rows": torch.randn(tokens * k, 8, generator=g).bfloat16()}


def test_other_tokens_unchanged_passes_and_ignores_the_bad_rows():
    clean, keep = stages(), isolation.kept_rows(6, 2)
    dirty = {n: v.clone() for n, v in clean.items()}
    dirty["out"][2] = float("nan")
    dirty["ids"][2] = -1
    dirty["rows"][6:9] = float("nan")  # token 2's three pairs
    c = Recording()
    assert isolation.check_others_unchanged(c, clean, dirty, keep, "t") == 5 + 5 + 15
    assert len(c.calls) == 3


@pytest.mark.parametrize("stage,where", [("out", (0, 3)), ("ids", (5, 1)), ("rows", (9, 0)),
                                         ("rows", (5, 7))])
def test_other_tokens_unchanged_catches_a_changed_kept_row(stage, where):
    clean, keep = stages(), isolation.kept_rows(6, 2)
    dirty = {n: v.clone() for n, v in clean.items()}
    dirty[stage][where] += 1
    with pytest.raises(AssertionError, match=stage):
        isolation.check_others_unchanged(Recording(), clean, dirty, keep, "t")


def test_other_tokens_unchanged_catches_a_sign_flip_of_zero_and_a_nan_payload():
    """Bytes, not values: -0 for +0, or another NaN, in a kept row is a change."""
    clean = {"out": torch.zeros(4, 2), "f": torch.full((4, 2), float("nan"))}
    for name, value in (("out", -0.0), ("f", None)):
        dirty = {n: v.clone() for n, v in clean.items()}
        if value is None:
            dirty["f"].view(torch.int32)[1, 0] ^= 1  # another NaN payload
        else:
            dirty["out"][1, 0] = value
        with pytest.raises(AssertionError, match=name):
            isolation.check_others_unchanged(Recording(), clean, dirty,
                                             isolation.kept_rows(4, 3), "t")


def test_other_tokens_unchanged_refuses_stages_it_cannot_index():
    clean, keep = stages(), isolation.kept_rows(6, 2)
    with pytest.raises(ValueError, match="missing from the bad run"):
        isolation.check_others_unchanged(Recording(), clean, {"out": clean["out"]}, keep, "t")
    odd = {"x": torch.zeros(7, 2)}
    with pytest.raises(ValueError, match="not a multiple of 6 rows"):
        isolation.check_others_unchanged(Recording(), odd, odd, keep, "t")


def test_kept_rows():
    assert isolation.kept_rows(5, 1).tolist() == [True, False, True, True, True]
    assert isolation.kept_rows(5, (0, 4)).tolist() == [False, True, True, True, False]


def test_other_tokens_unchanged_compares_float8_and_bool_stages():
    """The MXFP8 codes (float8) and masks (bool) are compared too: a changed kept row of
    either is caught, the bad row's is not."""
    clean = {"codes": torch.zeros(4, 8).to(torch.float8_e4m3fn),
             "valid": torch.ones(4, dtype=torch.bool)}
    keep = isolation.kept_rows(4, 1)
    dirty = {n: v.clone() for n, v in clean.items()}
    dirty["codes"][1] = float("nan")
    dirty["valid"][1] = False
    isolation.check_others_unchanged(Recording(), clean, dirty, keep, "t")
    dirty["codes"][2, 3] = 1.0
    with pytest.raises(AssertionError, match="codes"):
        isolation.check_others_unchanged(Recording(), clean, dirty, keep, "t")
