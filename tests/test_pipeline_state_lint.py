"""``tools/pipeline_state_lint.py``: no fast kernel passes a pipeline state to a helper that
advances it without returning it and then uses the state again (the CuTe DSL rebinds the
helper's variable, not the caller's object: the tiled kernel's first persistent GPU run hung
on exactly that); the check catches that shape and accepts its fix."""

from __future__ import annotations

from pathlib import Path

from tools.pipeline_state_lint import findings

ROOT = Path(__file__).resolve().parents[1]

_SHAPE = """
class K:
    @cute.jit
    def prologue(self, ring, fill, loads):
        for i in cutlass.range_constexpr(4):
            if i < loads:
                ring.producer_acquire(fill)
                fill.advance()
        {ret}

    @cute.jit
    def units(self, ring, read):
        for _ in cutlass.range(8):
            ring.consumer_wait(read)
            read.advance()

    @cute.kernel
    def kernel(self, ring, fill, read, warp, loads):
        if warp == 8:
            {call}
            for _ in cutlass.range(4, loads):
                ring.producer_acquire(fill)
                fill.advance()
        else:
            self.units(ring, read)
"""


def test_no_fast_kernel_leaves_an_advanced_state_behind():
    sources = [p for p in (ROOT / "fast").rglob("*.py") if "advance()" in p.read_text()]
    assert sources  # the check reads the kernels that advance pipeline states
    found = [line for p in sources for line in findings(p.read_text(), str(p))]
    assert not found, "\n".join(found)


def test_the_unreturned_state_is_caught_and_its_fix_accepted():
    bug = _SHAPE.format(ret="pass", call="self.prologue(ring, fill, loads)")
    (line,) = findings(bug, "k.py")
    assert "kernel passes fill to prologue, which advances it (fill)" in line
    fixed = _SHAPE.format(ret="return fill", call="fill = self.prologue(ring, fill, loads)")
    assert findings(fixed, "k.py") == []
    # a state advanced by its last user (the else branch's units) is no finding
    assert not any("units" in f for f in findings(bug, "k.py"))
