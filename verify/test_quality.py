"""Quality: the quantized stock layer against the unquantized FP64 layer, as
a tracked figure with a floor.

Both use one routing (the quantized path's ids), so the figure measures quantization noise,
not routing flips. The floor: MXFP4 weights and MXFP8 activations each carry a relative
noise of about 2^-4 (E2M1 and E4M3 half-ULP at the top of their binades: 1/4 and 1/16 of
the value), and the routed latent passes two MXFP8 quantizations and one MXFP4 weight per
GEMM; the shared expert and the dense GEMMs are BF16 (2^-9). An SQNR floor of
20 log10(2^4) = 24 dB for the whole layer output, which sums the routed path with the
shared expert, is what a wrong rounding mode, a swapped gate/up or a dropped scale falls
below (they give < 10 dB); the measured figure is reported per batch.
"""

from __future__ import annotations

import math

import pytest

from reference.layer import ideal_layer, sqnr_db, stock_order_trace
from verify import cases

pytestmark = pytest.mark.config("small")
SQNR_FLOOR_DB = 20 * math.log10(2**4)


@pytest.mark.parametrize("tokens", (1, 16, 64, 256))
def test_quality_sqnr(tokens, seed, contract):
    cfg = cases.config("small")
    w = cases.weights("small")
    x = cases.hidden_rows(cfg, tokens, seed)
    trace = stock_order_trace(x, w, cfg)
    ideal = ideal_layer(x, w, cfg, ids=trace.ids)
    out_db = sqnr_db(ideal, trace.out)
    contract.figure("sqnr_db", out_db, worst="min")
    assert out_db >= SQNR_FLOOR_DB, f"SQNR {out_db:.2f} dB below the floor {SQNR_FLOOR_DB:.2f} dB"
