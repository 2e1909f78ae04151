"""``verify.cpu_math.warm_up``: after it, a fresh process's first parallel ``exp`` and
``tanh`` calls on the CPU give the bits of every later call, within 1 ULP of float64 (each
case a new two-thread process, where the first call was measured wrong in 2-15% of them)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import torch
    from verify import cpu_math
    torch.set_num_threads(2)
    cpu_math.warm_up()
    x = torch.linspace(-3, 3, 4480)
    for op in (torch.exp, torch.tanh):
        first, again = op(x), op(x)
        assert torch.equal(first, again), op.__name__
        exact = op(x.double())
        ulp = (torch.nextafter(first, torch.full_like(first, 1e30)) - first).double()
        worst = ((first.double() - exact).abs() / ulp).max().item()
        assert worst <= 1.0, (op.__name__, worst)
    print("ok")
""")


def test_first_call_after_warm_up_is_repeatable():
    for _ in range(4):
        done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]

