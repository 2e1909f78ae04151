"""Quality: the quantized stock layer against the unquantized FP64 layer, as
a tracked figure with a floor.

Both use one routing (the quantized path's ids), so the figure measures quantization noise,
not routing flips. The floor, ``verify.tolerances.LAYER_SQNR_FLOOR_DB`` (24 dB), comes from
the MX formats' relative noise (about 2^-4 per MXFP4 weight and MXFP8 activation; the
derivation is there): a wrong rounding mode, a swapped gate/up or a dropped scale falls
below it (they give < 10 dB); the measured figure is reported per batch.
"""

from __future__ import annotations

import pytest

from reference.layer import ideal_layer, sqnr_db, stock_order_trace
from verify import cases
from verify.tolerances import LAYER_SQNR_FLOOR_DB as SQNR_FLOOR_DB

pytestmark = pytest.mark.config("small")


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
